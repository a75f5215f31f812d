"""``UpstreamSpec``: what a hierarchical limiter leases from, and how it is stored in the segment.

One place for the upstream's defaults, its Redis key format and the stored
form.  No Redis here: the shared-memory side (stats, inspect, top) reads the
stored description without importing the Redis tier or redis-py.

Who chooses the endpoint.  The segment stores the description for two uses
only: to check that every process that configures ``upstream=`` asked for
the same upstream, and to show it (``stats``, ``inspect``, ``top``).  It is
never used to connect: only a process that configured the upstream itself
(``Limiter(name, upstream=...)``, or a handle it pickled or forked) runs the
lease feeder, with the endpoint and the credentials held in its own memory.
A process that merely attaches by name never connects anywhere, so whoever
can write a segment cannot redirect anyone's Redis connection or harvest a
password.  The stored description holds no secret: the URL is stored
without its password (``urls.split_secrets``).

The stored form: ``UP_DESC_LEN`` bytes of JSON in ``UP_DESC``, one object
with exactly the fields of ``UpstreamSpec`` except ``secrets``, written once
by the creator before the segment becomes ready.  ``decode`` validates every
field (type and range) and raises ``ValueError`` naming it; ``read`` turns
that into ``SegmentError``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, Tuple

from shmlimit.errors import CorruptWordsError
from shmlimit.redis import urls
from shmlimit.shm import layout as L
from shmlimit.shm.segment import validate_name

if TYPE_CHECKING:  # pragma: no cover
    from shmlimit.shm.cells import Cells

#: Fallbacks while Redis is unavailable (``on_redis_error``).
ON_ERROR = ("closed", "local", "open")
#: Leased tokens live this long (seconds) ...
DEFAULT_LEASE_TTL = 0.1
#: ... and a batch covers this much of the host's demand (seconds).
DEFAULT_BATCH_SECONDS = 0.02
#: Range of both (seconds).
MIN_SECONDS, MAX_SECONDS = 0.001, 60.0
#: The Redis client's connect and socket timeout (seconds): a rate limiter must fail fast.
DEFAULT_TIMEOUT = 0.25
#: The URL a ``RedisLimiter`` uses when given none.
DEFAULT_URL = "redis://localhost:6379/0"
CLOCKS = ("server", "client")

#: ``UP_STATE``: 0 leasing normally, else the fallback in force, or "error" (a data error: closed).
STATE_OK, STATE_LOCAL, STATE_OPEN, STATE_CLOSED, STATE_ERROR = 0, 1, 2, 3, 4
STATE_NAMES = {
    STATE_OK: "ok",
    STATE_LOCAL: "local",
    STATE_OPEN: "open",
    STATE_CLOSED: "closed",
    STATE_ERROR: "error",
}


def redis_key(name: str) -> str:
    """The Redis key of the GCRA state ``name`` (a limiter's name, or a keyed limiter's
    ``<name>/<digest>`` for one key): the hash tag keeps it in one cluster slot."""
    return f"shmlimit:{{{name}}}:gcra"


def _number(v: Any, param: str, lo: float, hi: float) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi or math.isnan(v):
        raise ValueError(f"{param} must be a number from {lo:g} to {hi:g}, got {v!r}")
    return float(v)


@dataclass(frozen=True)
class UpstreamSpec:
    """The global Redis limiter a hierarchical limiter leases from, and how it leases.

    ``name``: the global limiter's name (its key is ``redis_key(name)``);
    ``url``: the Redis URL without secrets; ``rate`` ops per ``per`` seconds
    with a burst of ``burst`` ops (every client of the global limiter must
    agree on these); ``clock`` and ``timeout`` (seconds) as for
    ``RedisLimiter``; ``on_error``: the fallback while Redis is unavailable;
    ``lease_ttl``: seconds a leased token stays usable; ``batch_seconds``:
    seconds of the host's demand one lease covers.  ``secrets`` (redis-py
    keywords such as ``password``) live only in the memory of the process
    that configured the upstream: never stored, shown, or compared.
    """

    name: str
    url: str
    rate: float
    per: float
    burst: float
    clock: str = "server"
    timeout: float = DEFAULT_TIMEOUT
    on_error: str = "closed"
    lease_ttl: float = DEFAULT_LEASE_TTL
    batch_seconds: float = DEFAULT_BATCH_SECONDS
    secrets: Tuple[Tuple[str, str], ...] = field(default=(), repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str):
            raise ValueError(f"name must be a string, got {self.name!r}")
        validate_name(self.name)
        urls.check(self.url)
        clean, secrets = urls.split_secrets(self.url)
        if secrets:
            raise ValueError(
                f"url must not hold a secret here (pass it in secrets): {urls.redact(self.url)}"
            )
        _number(self.rate, "rate", 1e-9, 1e15)
        _number(self.per, "per", 1e-9, 1e9)
        _number(self.burst, "burst", 1.0, 1e15)
        if self.clock not in CLOCKS:
            raise ValueError(f"clock must be one of {', '.join(CLOCKS)}, got {self.clock!r}")
        _number(self.timeout, "timeout", 1e-6, 3600.0)
        if self.on_error not in ON_ERROR:
            raise ValueError(
                f"on_redis_error must be one of {', '.join(ON_ERROR)}, got {self.on_error!r}"
            )
        _number(self.lease_ttl, "lease_ttl", MIN_SECONDS, MAX_SECONDS)
        _number(self.batch_seconds, "batch_seconds", MIN_SECONDS, MAX_SECONDS)
        if not isinstance(self.secrets, tuple) or not all(
            isinstance(s, tuple) and len(s) == 2 and all(isinstance(x, str) for x in s)
            for s in self.secrets
        ):
            raise ValueError("secrets must be a tuple of (keyword, value) string pairs")

    @property
    def key(self) -> str:
        """The global limiter's Redis key."""
        return redis_key(self.name)

    def describe(self) -> str:
        """One line for messages: never a secret."""
        return (
            f"{urls.redact(self.url)} key {self.name!r} rate {self.rate:g}/{self.per:g}s burst {self.burst:g} "
            f"on_redis_error={self.on_error} lease_ttl={self.lease_ttl:g}s batch_seconds={self.batch_seconds:g}s"
        )

    # -- the stored form ------------------------------------------------------------------

    def encode(self) -> bytes:
        """The JSON stored in the segment (no secrets); ValueError if it does not fit the header."""
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "secrets"}
        data = json.dumps(d, sort_keys=True, separators=(",", ":")).encode()
        if len(data) > L.UP_DESC_MAX:
            raise ValueError(
                f"upstream description is {len(data)} bytes, at most {L.UP_DESC_MAX} fit the segment header "
                f"(shorten the Redis URL or the limiter name)"
            )
        return data

    @classmethod
    def decode(cls, data: bytes) -> "UpstreamSpec":
        """The inverse of ``encode``; ValueError naming the first field that is missing or wrong."""
        try:
            d = json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as e:
            raise ValueError(f"upstream description is not JSON ({e})") from None
        names = [f.name for f in fields(cls) if f.name != "secrets"]
        if not isinstance(d, dict):
            raise ValueError(f"upstream description must be a JSON object, got {type(d).__name__}")
        unknown = sorted(set(d) - set(names))
        missing = [n for n in names if n not in d]
        if unknown or missing:
            raise ValueError(
                f"upstream description has unknown fields {unknown} or misses {missing}"
            )
        return cls(**{n: d[n] for n in names})

    def write(self, cells: "Cells") -> None:
        """Store the description in a segment being initialised (its creator only)."""
        data = self.encode()
        cells.store(L.UP_DESC_LEN, len(data))
        padded = data + b"\0" * (-len(data) % 8)
        for i in range(0, len(padded), 8):
            cells.store(L.UP_DESC + i, int.from_bytes(padded[i : i + 8], "little"))

    @classmethod
    def read(cls, cells: "Cells") -> "UpstreamSpec":
        """The description stored in a segment; SegmentError if it is not a valid one."""
        size = cells.load(L.UP_DESC_LEN)
        if size > L.UP_DESC_MAX:
            raise CorruptWordsError(f"its upstream description claims {size} bytes")
        raw = b"".join(cells.load(L.UP_DESC + i).to_bytes(8, "little") for i in range(0, size, 8))[
            :size
        ]
        try:
            return cls.decode(raw)
        except ValueError as e:
            raise CorruptWordsError(f"its upstream description is invalid: {e}") from None


__all__ = ["UpstreamSpec", "redis_key", "ON_ERROR", "STATE_NAMES"]
