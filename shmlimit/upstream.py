"""Hierarchical mode: the host's shared-memory bucket, fed by batches leased from a global Redis limiter.

Workers keep the shared-memory fast path; only the elected filler talks to
Redis, one round trip per batch.  The segment is created with
``FLAG_UPSTREAM``: replenishing from the clock is off, and the head advances
only by ``Bucket.add`` of leased tokens.

Batches.  The filler measures the host's demand (the tail's advance, queued
grabs included) as an average over ~0.2 s, and when fewer than half a batch
of ops is left it leases ``demand * batch_seconds`` ops (at least one, plus
what queued callers are owed) with ``RedisLimiter.take_up_to``, which grants
what is available now, up to that.  A batch is capped at half the global
burst, so one host cannot empty the global bucket in one request, and at the
room left in the local bucket.

Leased tokens expire.  The filler records the two newest leases (their time,
taken *before* asking, and their tokens) in the segment; at every tick it burns
whatever the bucket holds beyond the tokens of leases younger than
``lease_ttl``.  An op used at time u was therefore leased after
``u - lease_ttl - d``, where d is the longest gap between two expiry checks
(a 2 ms tick, or one Redis call of at most ``timeout``), and since Redis grants
at most ``rate*T + burst`` in any window T, all hosts together grant at most
``rate*(T + lease_ttl + d) + burst`` in any window T.

Redis unreachable (``on_redis_error``):

* ``"closed"`` (default, fails safe): no new tokens; callers wait (their
  timeouts apply) until Redis answers again.
* ``"local"``: the host's bucket refills from its own clock at the local rate
  until Redis answers again; with H hosts the global rate may reach H times
  the local rate meanwhile.
* ``"open"``: no limit at all until Redis answers again.

Only a connection error or a timeout is "unreachable".  Redis answering with
an error (``WRONGTYPE`` because someone wrote the key, a failing script,
refused credentials: ``RedisDataError``) is state ``"error"``: closed,
whatever ``on_redis_error`` says, and logged -- whoever can write the key
must not be able to open the gates.

The filler retries every ``RETRY_EVERY`` seconds; the first answer ends the
fallback (local tokens are burned, tickets let through by "open" are
forgotten).  Every error and fallback is counted in the segment, so
``stats()`` of any process shows them.  Fallbacks switch only the flag bits
of the config (``Bucket.set_upstream_flags``): a ``set_rate`` made while the
filler was talking to Redis stays.

The feeder runs only in processes that configured the upstream themselves
(see ``upstream_spec``): its endpoint and credentials are theirs, never read
from the segment.
"""
from __future__ import annotations

import logging
import math
import random
import time
from typing import TYPE_CHECKING, Optional

from . import layout as L
from .errors import RedisDataError, RedisUnavailableError
from .redis import RedisLimiter
from .upstream_spec import (
    ON_ERROR, STATE_CLOSED, STATE_ERROR, STATE_LOCAL, STATE_NAMES, STATE_OK, STATE_OPEN, UpstreamSpec,
)

if TYPE_CHECKING:  # pragma: no cover
    from .bucket import Bucket
    from .filler import FeedFactory, Lease

__all__ = ["Feeder", "feed_for", "ON_ERROR", "STATE_NAMES"]

log = logging.getLogger("shmlimit.upstream")

_FALLBACK = {"local": (STATE_LOCAL, L.FLAG_UPSTREAM | L.FLAG_FALLBACK_LOCAL),
             "open": (STATE_OPEN, L.FLAG_UPSTREAM | L.FLAG_FALLBACK_OPEN),
             "closed": (STATE_CLOSED, L.FLAG_UPSTREAM)}

#: The filler's tick in hierarchical mode (seconds): how often expiry is enforced and demand read.
TICK = 0.002
#: While Redis is unreachable, it is tried again this often (seconds).
RETRY_EVERY = 0.25
#: After a lease request found nothing available upstream, wait at least this long (seconds) ...
MIN_RETRY = 0.002
#: ... and at most this long, whatever Redis said (seconds).
MAX_RETRY = 0.1
#: A caller refused this recently (ns) still wants a token.
HUNGRY_NS = 20_000_000
#: Demand is averaged over about this long (seconds).
DEMAND_WINDOW = 0.2


def feed_for(spec: UpstreamSpec) -> "FeedFactory":
    """The filler's feed for a process that configured ``spec`` itself."""

    def make(bucket: "Bucket", lease: "Lease") -> "Feeder":
        return Feeder(bucket, lease, spec)

    return make


class Feeder:
    """The filler's half of hierarchical mode: lease, expire, fall back, recover.  Filler thread only."""

    def __init__(self, bucket: "Bucket", lease: "Lease", spec: UpstreamSpec) -> None:
        self.bucket = bucket
        self.cells = bucket.cells
        self.lease = lease
        self.spec = spec
        self.redis: Optional[RedisLimiter] = None  # connected at the first lease: a cluster client connects at once
        self.on_error = spec.on_error
        self.ttl_ns = int(spec.lease_ttl * 1e9)
        self.batch_seconds = spec.batch_seconds
        self.max_batch = max(1, int(spec.burst // 2))
        self.demand = 0.0  # ops per second
        self._last: Optional[tuple] = None  # (ns, tail) at the previous tick
        self._burned = 0  # tokens burned since then: they moved the tail but are not demand
        self.next_try = 0

    def close(self) -> None:
        if self.redis is not None:
            self.redis.close()

    # -- one tick -----------------------------------------------------------------------

    def tick(self) -> float:
        b = self.bucket
        c = self.cells
        now = time.monotonic_ns()
        self._measure(now)
        state = c.load(L.UP_STATE)
        if state in (STATE_OK, STATE_CLOSED, STATE_ERROR):  # leased tokens expire, Redis or not
            self.expire(now)
        if not b.stopped and now >= self.next_try:
            self._lease(now, state)
        if b.time_fed:  # the "local" fallback: the clock feeds the bucket meanwhile
            b.replenish()
        return TICK

    def _measure(self, now: int) -> None:
        tail = self.cells.load(L.TAIL)
        if self._last is not None:
            dt = now - self._last[0]
            if dt > 0:
                ops = (((tail - self._last[1]) & ((1 << 64) - 1)) - self._burned) / self.bucket.cost
                alpha = min(1.0, dt / (DEMAND_WINDOW * 1e9))
                self.demand += alpha * (ops * 1e9 / dt - self.demand)
        self._last = (now, tail)
        self._burned = 0

    def expire(self, now: int) -> int:
        """Burn the tokens beyond those of leases younger than the time to live; return ops burned."""
        c = self.cells
        keep = 0
        for ts, amt in ((L.UP_LEASE0_TS, L.UP_LEASE0_AMT), (L.UP_LEASE1_TS, L.UP_LEASE1_AMT)):
            if now - c.load(ts) < self.ttl_ns:
                keep += c.load(amt)
        burned = self.bucket.burn(keep)
        self._burned += burned
        if burned:
            c.fetch_add(L.UP_EXPIRED, burned // self.bucket.cost)
        return burned

    def want(self, now: int) -> int:
        """Ops to lease now (0: none needed).

        Queued callers (a negative balance) or callers refused without
        queueing (``UP_HUNGRY``, recent) always get a lease.  Otherwise the
        filler leases ahead only for a host busy enough to use a token within
        its time to live, and only when less than half a batch is left.
        """
        b = self.bucket
        batch = min(self.max_batch, max(1, math.ceil(self.demand * self.batch_seconds)))
        balance = b.balance()
        avail = balance / b.cost  # negative: owed to queued callers
        hungry = avail < 0 or now - self.cells.load(L.UP_HUNGRY) < HUNGRY_NS
        if not hungry and (avail >= batch / 2 or self.demand * self.ttl_ns / 1e9 < 1):
            return 0
        room = (b.cap - max(0, balance)) // b.cost
        return max(0, min(self.max_batch, room, math.ceil(batch - avail)))

    def _lease(self, now: int, state: int) -> None:
        c = self.cells
        b = self.bucket
        want = self.want(now)
        if state == STATE_OK and want == 0:
            return
        # Renewed just before the call: we still hold it (or learn we do not).  Not extended over
        # the call: the lease word is nearly always fresh from the last call, and a filler killed
        # or stopped then must be replaced within the usual lease timeout, not the Redis timeout.
        # A call slower than that may let a second filler lease meanwhile, which costs only
        # tokens: Redis counts every lease.
        if not self.lease.renew():
            return
        sent = time.monotonic_ns()  # the lease's time: before asking, so its expiry is conservative
        trips = 0
        try:
            if self.redis is None:
                self.redis = RedisLimiter.from_spec(self.spec)
            trips = self.redis.round_trips
            # at least half the batch per round trip: under contention, wait for it to accrue
            want = max(1, want)
            granted, wait = self.redis.take_up_to(want, max(1, want // 2))
        except RedisUnavailableError as e:
            self._count_trips(trips)
            self._fail(state, e)
            return
        except RedisDataError as e:
            self._count_trips(trips)
            self._error(state, e)
            return
        self._count_trips(trips)
        if state != STATE_OK:
            self._recover(state)
        if granted:
            added = b.add(granted * b.cost)
            c.store(L.UP_LEASE1_TS, c.load(L.UP_LEASE0_TS))
            c.store(L.UP_LEASE1_AMT, c.load(L.UP_LEASE0_AMT))
            c.store(L.UP_LEASE0_TS, sent)
            c.store(L.UP_LEASE0_AMT, added)
            c.fetch_add(L.UP_LEASED, granted)
            c.fetch_add(L.UP_LEASES, 1)
            if added < granted * b.cost:  # did not fit: leased and lost
                c.fetch_add(L.UP_EXPIRED, granted - added // b.cost)
            self.next_try = 0
        else:
            c.fetch_add(L.UP_REFUSED, 1)
            # jittered, so hosts refused together do not race for the same ops again
            nap = min(MAX_RETRY, max(MIN_RETRY, wait)) * random.uniform(1.0, 1.5)
            self.next_try = time.monotonic_ns() + int(nap * 1e9)
        self.expire(time.monotonic_ns())  # the call may have taken a while

    def _count_trips(self, before: int) -> None:
        if self.redis is not None:
            self.cells.fetch_add(L.UP_ROUND_TRIPS, self.redis.round_trips - before)

    def _fail(self, state: int, e: RedisUnavailableError) -> None:
        """Redis unavailable: enter the configured fallback (from "ok" only; "error" stays closed)."""
        c = self.cells
        c.fetch_add(L.UP_ERRORS, 1)
        if state == STATE_OK:
            log.warning("%s; fallback %r until it answers", e, self.on_error)
            code, flags = _FALLBACK[self.on_error]
            c.fetch_add(L.UP_FALLBACKS, 1)
            c.store(L.UP_STATE, code)
            if flags != L.FLAG_UPSTREAM:
                self.bucket.set_upstream_flags(flags)
        self.next_try = time.monotonic_ns() + int(RETRY_EVERY * 1e9)

    def _error(self, state: int, e: RedisDataError) -> None:
        """Redis answered with an error: closed, whatever the fallback, until it answers correctly."""
        c = self.cells
        c.fetch_add(L.UP_ERRORS, 1)
        if state != STATE_ERROR:
            log.error("%s; no tokens until it answers correctly", e)
            if state == STATE_OK:
                c.fetch_add(L.UP_FALLBACKS, 1)
            c.store(L.UP_STATE, STATE_ERROR)
            if state in (STATE_LOCAL, STATE_OPEN):
                self._end_fallback(state)
        self.next_try = time.monotonic_ns() + int(RETRY_EVERY * 1e9)

    def _end_fallback(self, state: int) -> None:
        b = self.bucket
        b.set_upstream_flags(L.FLAG_UPSTREAM)
        if state == STATE_LOCAL:
            b.burn()  # tokens of the local clock are not the global limit's
        elif state == STATE_OPEN:
            b.forgive()

    def _recover(self, state: int) -> None:
        b = self.bucket
        if state in (STATE_LOCAL, STATE_OPEN):
            b.set_upstream_flags(L.FLAG_UPSTREAM)
        if state == STATE_LOCAL:
            b.burn()  # tokens of the local clock are not the global limit's
        elif state == STATE_OPEN:
            b.forgive()
        self.cells.store(L.UP_STATE, STATE_OK)
