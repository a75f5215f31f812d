"""``RedisKeyedLimiter``: one rate limit per key across hosts, with ``KeyedLimiter``'s interface.

    from shmlimit.redis.keyed import RedisKeyedLimiter
    per_user = RedisKeyedLimiter("login", rate=5, per=60, url="redis+cluster://redis-1:7000")
    per_user.try_acquire("alice")

Each key is one GCRA in Redis, decided by the same script as ``RedisLimiter``
(one round trip per call).  Its Redis key is ``shmlimit:{<name>/<digest>}:gcra``
where the digest is the first 128 bits of the key's SHA-256: the hash tag
differs per key, so keys spread over a cluster's slots, a key of any bytes
(up to 4096) is safe in a Redis key, and a key that was never asked for is
never stored.  A key's hash expires one second after its bucket would be full
again, so idle keys leave nothing (the TTL the script sets on every write).

Per key, grants in any window of T seconds never exceed
``rate*T/per + burst`` across every client (``grace`` adds to T for
``acquire``, as for ``RedisLimiter``).  Every client of one name must pass
the same ``rate``, ``per`` and ``burst``.

No hierarchical keyed mode: a per-key lease would have to be held by every
host for every hot key, so a key's bound would grow by one lease per host
that saw it (``hosts * (lease_ttl * rate + batch)``), and the local table
would have to track leases per key.  That bound is not a useful limit for
per-user or per-tenant keys, whose rates are low; the direct mode's single
round trip is the honest design here.
"""

from __future__ import annotations

import hashlib
import math
from typing import Any, Optional

from shmlimit.config import NS_PER_S, validate_n, validate_timeout
from shmlimit.protocol import Keyed, key_bytes
from shmlimit.redis.direct import MODE_PEEK, ClientStats, _GcraClient
from shmlimit.redis.spec import redis_key


def key_digest(key: object) -> str:
    """The hex digest naming ``key`` in Redis; TypeError/ValueError for a key that is not one."""
    return hashlib.sha256(key_bytes(key)).hexdigest()[:32]


class RedisKeyedLimiter(_GcraClient, Keyed):
    """``rate`` ops per ``per`` seconds for each key, shared through Redis by every client of ``name``.

    Methods as ``KeyedLimiter``: ``try_acquire(key, n)``, ``acquire(key, n,
    timeout)``, ``acquire_async``, ``reserve(key, n, max_wait)`` (seconds
    until the slot is due), ``retry_after(key, n)`` (seconds).  Options as
    ``RedisLimiter`` (``url``, ``burst``, ``grace``, ``clock``, ``timeout``,
    ``max_reserved``, ``client``); errors too (``RedisUnavailableError``,
    ``RedisDataError``).  ``rate``, ``per`` and ``capacity`` are each key's.
    ``lim[key]`` is one key's limit as a ``shmlimit.RateLimit``.
    """

    def redis_key(self, key: object) -> str:
        """The Redis key holding ``key``'s GCRA state (its own cluster slot, by its hash tag)."""
        return redis_key(f"{self._name}/{key_digest(key)}")

    def _above(self, n: int) -> bool:
        """True when ``n`` ops are above each key's capacity: never granted (as ``KeyedLimiter``)."""
        self._open()
        validate_n(n, 1)
        return n > self._config.burst

    def _never(self, n: int, limit: Optional[float]) -> bool:
        """True, refusing, for an ``n`` above the capacity (``_above``) in a call with a ``limit``
        (``timeout``, ``max_wait``); one without raises ``ValueError`` (as ``KeyedLimiter``)."""
        if not self._above(n):
            return False
        if limit is None:
            raise ValueError(
                f"n must be at most this key's capacity ({self._config.burst:g} ops), got {n}"
            )
        self._count(refusals=1)
        return True

    def reserve(self, key: object, n: int = 1, max_wait: Optional[float] = None) -> Optional[float]:
        """Reserve ``key``'s next slot for ``n`` ops; seconds until it is due, or None (nothing
        taken).  Untimed, an ``n`` above the capacity raises ``ValueError``."""
        rkey, max_wait = self.redis_key(key), validate_timeout(max_wait, "max_wait")
        if self._never(n, max_wait):
            return None
        return self._drive(self._reserve_steps(n, max_wait, key=rkey))

    def try_acquire(self, key: object, n: int = 1) -> bool:
        """Take ``n`` ops of ``key`` only if they are available now (one round trip)."""
        return self.reserve(key, n, 0.0) == 0.0

    def acquire(self, key: object, n: int = 1, timeout: Optional[float] = None) -> bool:
        """Take ``n`` ops of ``key``, sleeping until due; False (nothing taken) past ``timeout``
        seconds.  An ``n`` above the capacity never succeeds: False with a timeout, else
        ``ValueError``."""
        rkey, timeout = self.redis_key(key), validate_timeout(timeout)
        if self._never(n, timeout):
            return False
        return self._drive(self._acquire_steps(n, timeout, key=rkey))

    async def acquire_async(self, key: object, n: int = 1, timeout: Optional[float] = None) -> bool:
        """``acquire`` for asyncio (its own connection per event loop)."""
        rkey, timeout = self.redis_key(key), validate_timeout(timeout)
        if self._never(n, timeout):
            return False
        return await self._drive_async(self._acquire_steps(n, timeout, key=rkey))

    def retry_after(self, key: object, n: int = 1) -> float:
        """Seconds until ``n`` ops of ``key`` could be granted (0.0: now; inf: never, an ``n`` above
        the capacity).  One round trip, writes nothing."""
        rkey = self.redis_key(key)
        if self._above(n):
            return math.inf
        return self._drive(self._script(MODE_PEEK, n, key=rkey))[1] / NS_PER_S

    def stats(self) -> ClientStats:
        """Each key's configuration and this client's counters (no round trip: per key, the
        shared state is ``retry_after``'s)."""
        self._open()
        c = self._config
        return ClientStats(self._name, c.rate, c.per, c.burst, **self._counters())

    def _stored_keys(self, client: Any) -> Any:
        """Every key's hash in Redis (``unlink``): a SCAN of the keyspace, on every primary of a
        cluster, for the keys of this name (its characters are never glob patterns)."""
        return client.scan_iter(match=redis_key(f"{self._name}/*"), count=1000)

    def __repr__(self) -> str:
        return (
            f"<shmlimit.redis.keyed.RedisKeyedLimiter {self.name!r} rate={self.rate:g}/{self.per:g}s "
            f"capacity={self.capacity:g} per key url={self.url} round_trips={self.round_trips}"
            f"{' closed' if self.closed else ''}>"
        )
