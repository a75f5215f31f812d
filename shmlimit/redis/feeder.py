"""Hierarchical mode: the host's shared-memory bucket, fed by batches leased from a global Redis limiter.

Workers keep the shared-memory fast path; only the elected filler talks to
Redis, one round trip per batch.  The segment is created with
``FLAG_UPSTREAM``: replenishing from the clock is off, and the head advances
only by ``Bucket.add`` of leased tokens.

Batches are reservations.  The filler measures the host's demand (the tail's
advance, queued grabs included) as an average over ~0.2 s.  While callers
wait (a negative balance, or ``UP_HUNGRY`` set by a refused caller in the
last 20 ms), or while the host is busy and what it holds would run out
soon, it *reserves* ``demand * lease_seconds`` ops (a lease: ten ops of the
global rate and two round trips, up to 0.25 s, at least one batch) in the global GCRA (``MODE_RESERVE``),
cut into batches of ``demand * batch_seconds`` ops (at least one, at most
what the local bucket holds), each due when its own slots are.  It asks
for the next lease when the last reserved batch
falls due within ``lead`` (two round trips plus ``MIN_LEAD``), so under
saturation the global schedule never runs dry between two requests: no slot
is lost to the latency of asking, at any rate.  (Leasing only what was
available *now* and retrying blindly after a refusal lost a fifth of the
rate at 50/s.)  A reservation takes the next slots of the global schedule,
up to ``MAX_AHEAD`` (60 s) ahead, so saturated hosts are served in the order
they asked, each about one batch per round of the queue (equal shares).
Refusing reservations beyond a horizon as short as a lead starved the host
that asked last (2 % of the rate for one of three equal hosts at 50/s; the
host nearest Redis got 7 % at 1000/s through 1/3/5 ms proxies); no queue of
hosts reaches ``MAX_AHEAD``: a refusal there writes nothing, and the host
asks again when the queue should have come within it.  Nobody hoards: a host
asks only while it has demand and only when its own reserved schedule ends
within the lead, so all hosts together hold at most ``hosts * (lead +
lease)`` of schedule ahead.  A batch falls due at ``reply + wait`` (never
early: Redis ran the script before the reply) and goes into the bucket as
far as it fits; the rest waits for room, not longer than its ttl.

Lease and batch sizes, round trips and the bound.  Redis grants at most
``rate*T + burst`` of schedule in any window T, however it is cut, and a
batch is due only when all its slots are.  So neither size enters the
window bound below.  The batch sets how lumpy a host's supply is (its
tokens come ``batch`` at a time; ``batch_seconds=0.02`` capped by the local
capacity, default 10 ms of rate).  The lease sets the round trips: one per
lease, at least 4 a second per busy host (one per batch cost about 1 ms of
CPU each, 0.05 CPU-s/s at 50/s), against how much reserved schedule a host
whose demand stops, or whose filler is killed, leaves unused (at most the
lead, ``EARLY`` and one lease: what it reserved lives in its process only).
Where a batch is ten ops or more (1 000/s and up by default), a lease is one
batch: a lease of 50 ms there lost ~15 ms more of the rate per filler killed
at 2 000/s, and kept a host cut off from Redis granting longer.

Leased tokens expire.  Each delivered batch leaves a record in the segment:
one word, (the earliest moment it could be due, in ms) << 24 | its ops, in a
ring of four slots chosen by a fetch-add, so racing fillers never mix one
batch's time with another's size.  At every wake at which the bucket holds a token (a wake for a
delivery alone, ``Feeder.between``, finds it holding none), before the Redis call and
after the deliveries, the filler burns whatever the bucket holds beyond the
ops of records younger than ``lease_ttl`` (``MIN_TICK`` from now: it naps no
shorter), and it plans a wake ``MIN_TICK`` before the end of a record while
the bucket holds more than the younger ones cover, never floored past that
end.  An op used at time u was therefore due after ``u - lease_ttl - d``,
where d is how late a check comes after a record ends: the sleep's lateness
past its plan, plus one Redis call (two tries of at most ``timeout`` to connect and
``timeout`` to read).  A filler stopped
in the middle of a delivery (SIGSTOP) and resumed much later never adds a
batch older than its ttl; one it adds late carries its old record, and it
checks right after the add and, no longer the filler, after its deliveries
and at its records' ends (``orphan_tick``).
Stopped again between the add and that check, the excess waits for the
running filler's next wake: then d is at most ``IDLE_TICK`` plus one call.  Since Redis grants at most
``rate*T + burst`` in any window T, all hosts together grant at most
``rate*(T + lease_ttl + d) + burst`` in any window T.

Redis unreachable (``on_redis_error``):

* ``"closed"`` (default, fails safe): no new tokens; callers wait (their
  timeouts apply) until Redis answers again.
* ``"local"``: the host's bucket refills from its own clock at the local rate
  until Redis answers again (the batches reserved ahead are dropped); with H hosts the global rate may reach H times
  the local rate meanwhile.
* ``"open"``: no limit at all until Redis answers again.

Only a connection error or a timeout is "unreachable".  Redis answering with
an error (``WRONGTYPE`` because someone wrote the key, a failing script,
refused credentials: ``RedisDataError``), or any other failure of the call, is state ``"error"``: closed,
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
from collections import deque
from dataclasses import dataclass
from functools import partial
from itertools import islice
from typing import TYPE_CHECKING, Any, Callable, Deque, List, Optional, Tuple

from shmlimit.bucket.filler import LEASE_TIMEOUT, RENEW_EVERY, SPAN_MAX
from shmlimit.bucket.rovers import diff
from shmlimit.errors import RedisDataError, RedisUnavailableError
from shmlimit.redis.direct import MAX_BACKLOG_NS, MODE_RESERVE, RedisLimiter
from shmlimit.redis.lease_records import RECORD_MAX_OPS, RECORD_OPS_BITS, LeaseRecords  # noqa: F401 (RECORD_OPS_BITS: the tests read records)
from shmlimit.redis.lease_records import record as _record  # noqa: F401 (the tests write records with it)
from shmlimit.redis.spec import (
    ON_ERROR,
    STATE_CLOSED,
    STATE_ERROR,
    STATE_LOCAL,
    STATE_NAMES,
    STATE_OK,
    STATE_OPEN,
    UpstreamSpec,
)
from shmlimit.shm import layout as L

if TYPE_CHECKING:  # pragma: no cover
    from shmlimit.bucket.filler import FeedFactory, Lease
    from shmlimit.bucket.rovers import Bucket

__all__ = ["Feeder", "feed_for", "ON_ERROR", "STATE_NAMES"]

log = logging.getLogger("shmlimit.redis.feeder")

#: The state each ``on_redis_error`` enters while Redis is unavailable ...
_FALLBACK = {"local": STATE_LOCAL, "open": STATE_OPEN, "closed": STATE_CLOSED}
#: ... and the config's flags in a fallback that feeds the bucket otherwise (else ``FLAG_UPSTREAM``).
_FLAGS = {
    STATE_LOCAL: L.FLAG_UPSTREAM | L.FLAG_FALLBACK_LOCAL,
    STATE_OPEN: L.FLAG_UPSTREAM | L.FLAG_FALLBACK_OPEN,
}

#: The feeder sleeps until its next event (a batch falls due, the next batch is to be asked for,
#: a lease record expires with tokens in the bucket), and no longer than this (seconds): how soon
#: an idle host notices a caller's first refusal, and the lease is renewed at the latest ...
IDLE_TICK = 0.02
#: ... and no shorter than this (seconds).  So a check burns, with the records that ended, those
#: that end within this long, and the wake for a record's end is planned this long before it: the
#: floor never carries a wake past a record's end (``lease_records``).
MIN_TICK = 0.0002
#: While the "local" fallback feeds the bucket from the clock, or a due batch waits for room,
#: the feeder looks this often (seconds).
TICK = 0.002
#: A feeder awake anyway asks for the next batch up to this much earlier than the lead requires,
#: rather than wake again for it alone (seconds).
EARLY = 0.01
#: One reservation (a round trip) covers as long as ``LEASE_OPS`` ops of the global rate take, and
#: two round trips (one request is in flight at a time), up to ``MAX_LEASE_SECONDS``, at least one
#: batch (``Feeder.lease_seconds``), cut into batches of
#: ``batch_seconds`` delivered as their slots fall due.  A round trip costs about as much CPU as five
#: deliveries: at 50/s with 1-op batches, one per op cost ~1 ms of CPU each, 0.05 CPU-s/s, seven
#: times a clock-fed filler's.  Longer, a host holds more schedule ahead: a killed filler takes it
#: with it (a lease of 50 ms at 2 000/s, where a batch is 10 ms, lost ~15 ms more per kill), and
#: a host cut off from Redis keeps granting it (at 0.1 s, still 0.3 s after the cut at 300/s).
LEASE_OPS = 10
MAX_LEASE_SECONDS = 0.25
#: Batches are reserved at least this far ahead of need (seconds; ``Feeder.lead_ns``): longer than
#: a filler (or Redis) is kept off the CPU on a busy VM (at 15 ms, 64-81 ms pauses lost 2 % at 1 000/s).
MIN_LEAD = 0.075
#: While Redis is unreachable, it is tried again this often (seconds).
RETRY_EVERY = 0.25
#: A reservation is due at most this far ahead (seconds), or ``MAX_AHEAD_LEASES`` leases of the
#: global rate if longer (``Feeder.horizon_ns``): the script refuses one due later, writing nothing,
#: and the feeder asks again when the schedule should have come within it, every ``RETRY_EVERY`` at
#: the latest.  Each host holds at most the lead, ``EARLY`` and a lease ahead, so a queue of a
#: hundred hosts is far shorter: only a long queue of direct callers is waited out so, or a broken
#: key (written far ahead, or the Redis host's clock stepped back), which a host that took the
#: reservation would wait for, asking nothing more, long after the key was repaired.
MAX_AHEAD = 60.0
MAX_AHEAD_LEASES = 100
#: After a reservation was refused, wait at least this long (seconds) ...
MIN_RETRY = 0.002
#: A caller refused this recently (ns) still wants a token: longer than the feeder's longest
#: sleep, so that a refusal is never missed between two of its wakes.
HUNGRY_NS = 2 * int(IDLE_TICK * 1e9)
#: Demand is averaged over about this long (seconds).
DEMAND_WINDOW = 0.2


def feed_for(spec: UpstreamSpec) -> "FeedFactory":
    """The filler's feed for a process that configured ``spec`` itself."""
    return partial(Feeder, spec=spec)


@dataclass
class _Batch:
    """Ops reserved in Redis, due at ``due`` (monotonic ns, never early) and void after ``stamp + ttl``."""

    due: int  #: when the reply came, plus the wait Redis named: not before the slots are due
    stamp: int  #: when we asked, plus that wait: not after they are due (expiry counts from here)
    ops: int  #: ops reserved
    left: int  #: ops not yet in the bucket (a batch waits for room rather than be lost)
    recorded: bool = False


_NEVER = 1 << 62  # an instant later than any event (monotonic ns)
_DELIVER_MAX = 64  # batches a native ``deliver`` is given at most (``_native.c``, DELIVER_MAX)
_DELIVER_LOST = 4  # its flag: a renewal of the filler lease failed
_DELIVER_BURN = 8  # its flag: an add raced a config change (burn, as ``Bucket.add`` does)


class Feeder:
    """The filler's half of hierarchical mode: reserve, deliver, expire, fall back, recover.  Filler thread only.

    Leases are *reservations* in the global GCRA (``MODE_RESERVE``): a batch
    reserved before the global schedule reaches it is due exactly when its
    slots are, so the schedule stays continuous while this host has demand
    and no slot is lost to the latency of asking.  Blind retries after a
    refusal lost up to half of every interval at low rates.  The feeder
    keeps the chain ``lead`` ahead (two round trips and ``MIN_LEAD``): it asks
    for the next batch when the last reserved one is due sooner than that.
    """

    def __init__(
        self,
        bucket: "Bucket",
        lease: "Lease",
        spec: UpstreamSpec,
        clock: Optional[Callable[[], int]] = None,
        connect: Callable[[UpstreamSpec], RedisLimiter] = RedisLimiter.from_spec,
    ) -> None:
        self.bucket = bucket
        #: CLOCK_MONOTONIC ns: the bucket's clock unless a test gives another
        self.clock = bucket.clock if clock is None else clock
        self._connect = connect
        self.cells = bucket.cells
        self.lease = lease
        self.spec = spec
        self.redis: Optional[RedisLimiter] = (
            None  # connected at the first lease: a cluster client connects at once
        )
        self.ttl_ns = int(spec.lease_ttl * 1e9)
        self.records = LeaseRecords(bucket, self.ttl_ns, int(MIN_TICK * 1e9))
        self.interval_ns = math.ceil(spec.per * 1e9 / spec.rate)  # one op of the global schedule
        self.demand = 0.0  # ops per second
        self._last: Optional[tuple] = None  # (ns, tail) at the previous tick
        self._burned = 0  # tokens burned since then: they moved the tail but are not demand
        self.next_try = 0
        self.rtt_ns = 1_000_000  # round trip time, an average; starts at 1 ms
        self.pending: Deque[_Batch] = deque()
        #: ops a request asks at least while callers stay queued: doubled by each request that finds
        #: them queued, 1 again at one that does not.  Demand is measured from the tail, which
        #: queued callers advance only as fast as they are supplied: a filler that takes over at
        #: 1 000 000/s knows no demand, and sized by it alone its batches grew 10 % per round trip
        #: (~150 ms of the global schedule mostly lost); doubling reaches ``max_grow`` in ~14.
        self.grow = 1
        #: ops a reservation asks at least while callers want more (queued, or refused just now),
        #: doubled by each request that finds them so, up to ``max_lease``: saturated hosts then
        #: all ask ``max_lease`` and the queue of their reservations gives equal shares (sized by
        #: each one's demand, they kept whatever shares they had: 40/30/30 % for three at 1 000/s)
        self.grow_lease = 1
        #: ops per batch (a delivery), as ``want`` last sized it; a reservation is cut into batches
        self.batch = 1
        self._queued_at = -HUNGRY_NS  # when ``want`` last found callers queued (ns)
        #: the lease records this process wrote that have not ended: a record may leave the ring of
        #: four before it ends (racing fillers, many small batches), and the wake for its end is
        #: planned from here; a former filler checks its own at their ends (the filler plans from
        #: the records it saw)
        self.mine: List[int] = []
        #: the instant (monotonic ns) of the first event the last tick planned that is not a
        #: delivery (a request, a record's end, ``SPAN_MAX`` after it): ``between`` makes the
        #: deliveries due before it without a whole tick (0: none)
        self.until = 0
        #: the native delivery (``_native_delivery``), bound to the config numbered ``_native_seq``
        self._native: Any = None
        self._native_seq: Optional[int] = None
        self._stopped = False  # ``interrupt``: no native span from now on

    @property
    def max_batch(self) -> int:
        """Ops per lease at most: what the local bucket holds (and a record can count), and half
        the horizon: the next reservation, asked within the lead of this one's end, fits too."""
        b = self.bucket
        half = self.horizon_ns // (2 * self.interval_ns)
        return max(1, min(b.cap // b.cost, RECORD_MAX_OPS, half))

    @property
    def max_grow(self) -> int:
        """The most ``grow`` reaches: a batch for the global rate itself (no host's demand is
        higher), so a saturated host's batches are what its measured demand makes them."""
        return min(
            self.max_batch, max(1, math.ceil(self.spec.batch_seconds * 1e9 / self.interval_ns))
        )

    @property
    def max_lease(self) -> int:
        """Ops per reservation at most: ``lease_seconds`` at the global rate (no host's demand is
        higher)."""
        return max(1, math.ceil(self.lease_seconds * 1e9 / self.interval_ns))

    @property
    def lease_seconds(self) -> float:
        """How much of the host's demand one reservation covers (seconds): ``LEASE_OPS`` of the
        global rate and at least two round trips, up to ``MAX_LEASE_SECONDS`` (``want`` makes it
        one batch at least).  One request is in flight at a time, so a host gets at most a lease
        per round trip: at 500/s a lease of ten ops (20 ms) behind 30 ms round trips kept a
        saturated host at 45 % of the rate, the reserved schedule never reaching the lead."""
        return min(MAX_LEASE_SECONDS, max(LEASE_OPS * self.interval_ns, 2 * self.rtt_ns) / 1e9)

    @property
    def horizon_ns(self) -> int:
        """How far ahead a reservation may be due at most (``MAX_AHEAD``), in ns: the script's
        ``max_wait``.  At least ``MAX_AHEAD_LEASES`` leases, but within half of what the script
        holds ahead at all (``MAX_BACKLOG_NS``, less a tolerance of at most ``MAX_SCHEDULE_NS``)."""
        far = MAX_AHEAD_LEASES * self.max_lease * self.interval_ns
        return min(max(int(MAX_AHEAD * 1e9), far), MAX_BACKLOG_NS // 2)

    @property
    def lead_ns(self) -> int:
        """How far ahead of need the next batch is asked for: two round trips and ``MIN_LEAD``.

        A request that reaches Redis after the global schedule ran dry loses
        the gap for good (GCRA does not bank it).  Under saturation the
        reserved schedule reaches at least the lead and the GCRA's tolerance
        ahead, so a filler (or Redis) kept off the CPU for less loses nothing.
        Costs, none a grant beyond the bound: a host whose demand stops, or a
        filler killed, leaves this much schedule (plus ``EARLY`` and a batch)
        unused; a sentinel failover may grant it twice (design page).
        """
        return 2 * self.rtt_ns + int(MIN_LEAD * 1e9)

    def close(self) -> None:
        """The filler stops (its process closes): the batches still reserved here, which nobody else
        knows, are leased ops never used, so counted expired (a SIGKILL leaves them uncounted)."""
        self.cells.fetch_add(L.UP_EXPIRED, sum(bt.left for bt in self.pending))
        self.pending.clear()
        if self.redis is not None:
            self.redis.close()

    # -- one tick -----------------------------------------------------------------------

    def tick(self) -> float:
        b = self.bucket
        c = self.cells
        now = self.clock()
        self._measure(now)
        self._note_wanting(now)
        state = c.load(L.UP_STATE)
        if state in (STATE_OK, STATE_CLOSED, STATE_ERROR):  # leased tokens expire, Redis or not
            self.expire(now)
        young = self.records.young_from(now)
        self.mine = [w for w in self.mine if w >= young]  # the others were checked just now
        self._deliver(now)
        if not b.stopped and now >= self.next_try and self._lease(now, state):
            self._deliver(self.clock())  # a batch due at once goes in without waiting a tick
        # the next wake is planned from the instant of the last check (a record ending just after
        # a check that counted it young, within MIN_TICK of a later reading, is planned from there)
        now = self.clock()
        if c.load(L.UP_STATE) in (STATE_OK, STATE_CLOSED, STATE_ERROR):
            # and once more: the rest of a batch that waited for room went in after the check, and
            # its record counted all its ops already; the next wake may be far
            self.expire(now)
        if b.time_fed:  # the "local" fallback: the clock feeds the bucket meanwhile
            b.replenish()
        return self._publish_next(now)

    def orphan_tick(self) -> Optional[float]:
        """No longer the filler: deliver the batches this process reserved, when due (they are slots
        of the global schedule that nobody else will deliver); tell waiters when, unless another
        filler expects tokens sooner."""
        if not self.pending and not self.mine:
            return None
        now = self.clock()
        added = self._deliver(now)
        young = self.records.young_from(now)
        live = [w for w in self.mine if w >= young]
        # a record of ours ends (within MIN_TICK): the filler may not see it; or we delivered: the
        # rest of a batch that waited for room went in after the last check, its record counting
        # all its ops already (as a tick checks once more after its deliveries)
        if len(live) < len(self.mine) or added:
            self.mine = live
            if self.cells.load(L.UP_STATE) in (STATE_OK, STATE_CLOSED, STATE_ERROR):
                self.expire(now)
        nap = _NEVER
        if live:
            nap = self.records.nap_for_end(now, min(map(self.records.end, live)))
        if self.pending:
            bt = self.pending[0]
            due = bt.due
            cur = self.cells.load(L.UP_NEXT_NS)
            if cur <= now or cur > due:
                self.cells.cas(L.UP_NEXT_NS, cur, due)
            # due but waiting for room: look again every TICK, as a filler does (MIN_TICK was five
            # thousand wakes a second), until its ttl ends and it is dropped
            at = due if due > now else min(bt.stamp + self.ttl_ns, now + int(TICK * 1e9))
            nap = min(nap, max(int(MIN_TICK * 1e9), at - now))
        return None if nap == _NEVER else nap / 1e9

    def _publish_next(self, now: int) -> float:
        """Tell timed waiters when tokens are next expected (``UP_NEXT_NS``); return the nap until the next event."""
        nxt = self.pending[0].due if self.pending else (self.next_try if self.next_try > now else 0)
        self.cells.store(L.UP_NEXT_NS, nxt)
        self.until = 0
        if (
            self.bucket.time_fed
        ):  # the "local" fallback refills from the clock: tick as a clock feed does
            return TICK
        request = self._next_request(now)
        at = min(self._next_delivery(now), request, now + int(IDLE_TICK * 1e9))
        nap = max(int(MIN_TICK * 1e9), at - now)
        until = min(request, now + int(SPAN_MAX * 1e9))
        end = self.records.next_expiry(now, self.mine)
        if end is not None:
            nap = min(nap, self.records.nap_for_end(now, end))
            until = min(until, now + self.records.nap_for_end(now, end))
        self.until = until
        return nap / 1e9

    def between(self) -> Optional[float]:
        """At a wake the last tick planned: if it is for a delivery alone, make it here and return
        the nap to the next wake (at most ``IDLE_TICK``, as a tick's); None: a whole tick, now.

        Under saturation a host's wakes are mostly deliveries: at 50/s with one-op batches, 50 a
        second, each a whole tick of about 300 us of CPU on cold caches, where a tick's other work
        (a request, a record's end) comes every ~80 ms.  A wake is a delivery alone when every
        other event the tick planned comes later (``until``, less ``EARLY``), the state is OK,
        and callers are queued and were so at the last tick (a negative balance, ``UP_WANTING``
        set, no refusal news in ``UP_HUNGRY``): then a tick would measure, expire nothing (a
        bucket that holds no token has nothing to burn), ask nothing, and plan the same next
        events.  Anything else, or a batch that does not fit, or one that leaves tokens held, is
        a whole tick's."""
        now = self.clock()
        native = self._native_delivery()
        if native is not None:  # the same step, as the native span makes it (``nap_delivering``)
            flags, nap, _, _ = self._deliver_natively(native, 0, now, 0)
            return None if flags else nap / 1e9
        pending = self.pending
        b = self.bucket
        c = self.cells
        if (
            now >= self.until - int(EARLY * 1e9)  # (a tick then asks for the next batch early)
            or not pending
            or pending[0].due > now
            or b.balance() >= 0
            or b.stopped
            or c.load(L.UP_STATE) != STATE_OK
            or not c.load(L.UP_WANTING)
            or now - c.load(L.UP_HUNGRY) < HUNGRY_NS
        ):
            return None
        first = pending[0]
        self._deliver(now)
        if not pending or pending[0] is first or b.balance() >= 0:
            return None  # emptied, waiting for room, or tokens held: a whole tick at once
        due = pending[0].due
        c.store(L.UP_NEXT_NS, due)
        at = min(due, self.until, now + int(IDLE_TICK * 1e9))
        return max(int(MIN_TICK * 1e9), at - now) / 1e9

    def nap_delivering(self, nap: float, renewed: float) -> Optional[Tuple[int, float]]:
        """The filler thread's nap after a tick (``nap`` seconds, renewing the lease every
        ``RENEW_EVERY`` from ``renewed``, ``time.monotonic`` seconds) and every wake for a delivery
        alone after it, as ``between`` makes them, in one native call without the GIL
        (``_native.c``, DELIVER): it ends when a whole tick is due, the lease is lost, or at a stop.
        Returns (deliveries made, when the lease was last renewed), or None where there is no
        native span (the ``atomics`` backend, a fallback's config, a stop, a clock other than
        ``time.monotonic_ns``, which the span sleeps on): the thread naps and calls ``between``.

        In Python each of those wakes cost ~180 us of CPU on cold caches against ~45 for a bare
        sleep, and at 50/s they are most of the filler's wakes (docs/design/redis.md)."""
        native = self._native_delivery()
        if native is None or not self.lease.word or self.clock is not time.monotonic_ns:
            return None
        _, _, wakes, renewed_ns = self._deliver_natively(
            native, max(0, int(nap * 1e9)), 0, int(renewed * 1e9)
        )
        return wakes, renewed_ns / 1e9

    def interrupt(self) -> None:
        """End a ``nap_delivering`` in progress at once, and every later one (the filler stops)."""
        self._stopped = True
        if self._native is not None:
            self._native.interrupt()

    def _native_delivery(self) -> Any:
        """The native delivery bound to the bucket's config (a ``FedWaiter`` with its delivery
        words), or None: the ``atomics`` backend, a config not fed by leases, a stop, or more
        batches pending than it takes (a late wake's backlog: ``_record`` covers them in one
        record, which the native step, seeing only the first ones, would split)."""
        snap = self.bucket.snap
        if self._native_seq != snap.seq:
            self._native_seq = snap.seq
            w = self.bucket.waiter(snap, L.UNREG_GRANTS, None, 1)
            if w is not None and hasattr(w, "deliver"):
                w.bind_delivery(
                    L.TAIL,
                    self.bucket.fences.hint,
                    L.REPL_TS,
                    L.UP_STATE,
                    L.UP_WANTING,
                    L.UP_HUNGRY,
                    L.UP_LEASES,
                    L.UP_RECORD,
                    L.UP_RECORDS,
                    snap.cap,
                )
            else:
                w = None
            self._native = w
            if self._stopped and w is not None:  # (an ``interrupt`` that ran before it was bound)
                w.interrupt()
        return None if self._stopped or len(self.pending) > _DELIVER_MAX else self._native

    def _deliver_natively(
        self, native: Any, nap_ns: int, now: int, renewed_ns: int
    ) -> Tuple[int, int, int, int]:
        """One native ``deliver``: a step at ``now`` (an injected clock's instant), or with ``now`` 0
        the nap and the span after it; the feeder's batches, records and lease word follow what it
        did.  Returns (its flags, 0 when the step planned a nap; that nap in ns; deliveries made;
        when the lease was last renewed, ns)."""
        pending = self.pending
        batches: List[int] = []
        for bt in islice(pending, _DELIVER_MAX):
            batches += (bt.due, bt.stamp, bt.ops, bt.left, int(bt.recorded))
        lease = self.lease
        word = lease.word
        flags, done, left, recorded, records, new_word, renewed_ns, nap, wakes = native.deliver(
            nap_ns,
            now,
            max(0, self.until),
            min(int(EARLY * 1e9), max(0, self.until)),
            int(IDLE_TICK * 1e9),
            int(MIN_TICK * 1e9),
            HUNGRY_NS,
            self.ttl_ns,
            word,
            renewed_ns,
            int(RENEW_EVERY * 1e9),
            int(LEASE_TIMEOUT * 1e6),
            batches,
        )
        for _ in range(done):
            pending.popleft()
        if pending and done < len(batches) // 5:
            pending[0].left = left
        for bt in islice(pending, recorded - done):
            bt.recorded = True
        self.mine.extend(records)
        if flags & _DELIVER_BURN:  # our add raced a config change: the config in force applies
            self.bucket.burn_late_add()
        if not now and lease.word == word:  # (not if this process's nudge took it again meanwhile)
            lease.word = 0 if flags & _DELIVER_LOST else new_word
        return flags, nap, wakes, renewed_ns

    def _next_delivery(self, now: int) -> int:
        """When the first reserved batch goes into the bucket: when due, or, when it is due but waits
        for room, when the host's demand has made room for it (or its ttl ends: it is dropped then)."""
        if not self.pending:
            return _NEVER
        bt = self.pending[0]
        if bt.due > now:
            return bt.due
        if now - self.cells.load(L.UP_HUNGRY) < HUNGRY_NS:
            # callers were refused just now: they take what goes in at once (a late wake's backlog
            # of batches, behind its lease's later ones, drains at this pace, not at their demand's)
            room = now
        else:
            room = now + int(bt.left * 1e9 / self.demand) if self.demand > 0 else _NEVER
        return min(bt.stamp + self.ttl_ns, max(now + int(TICK * 1e9), room))

    def _next_request(self, now: int) -> int:
        """When ``want`` could next ask for a batch, as far as the feeder knows now.

        A caller's first refusal on an idle host is news it learns at its next
        wake (``UP_HUNGRY`` outlives the longest sleep); everything else is a
        time it computes: a retry, the reserved schedule ending within the
        lead, or a busy host's supply running low at its demand.
        """
        if self.bucket.stopped:
            return _NEVER
        if self.next_try > now or self.cells.load(L.UP_STATE) != STATE_OK:
            return max(self.next_try, now + int(MIN_TICK * 1e9))
        if self.want(now):  # the batch just reserved is due within the lead: the next one at once
            return now
        if not self.pending and (
            now - self._queued_at < HUNGRY_NS or now - self.cells.load(L.UP_HUNGRY) < HUNGRY_NS
        ):
            # callers waited a moment ago and nothing is reserved for them: a batch due at once went
            # to them, and they come back at once (their demand is not measured yet, after a start
            # or a take-over): look again soon, as a clock feed would
            return now + int(TICK * 1e9)
        if self.pending:
            reach = self.pending[-1].due - self.lead_ns
            if reach > now:
                return reach
        if self.demand <= 0:
            return _NEVER
        b = self.bucket
        batch = min(self.max_batch, max(1, math.ceil(self.demand * self.spec.batch_seconds)))
        have = b.balance() / b.cost + sum(bt.left for bt in self.pending)
        low = now + int(have * 1e9 / self.demand) - (self.lead_ns + batch * self.interval_ns)
        return low if low > now else _NEVER

    def _measure(self, now: int) -> None:
        tail = self.bucket.taken()
        if self._last is not None:
            dt = now - self._last[0]
            if dt > 0:
                ops = (diff(tail, self._last[1]) - self._burned) / self.bucket.cost
                alpha = min(1.0, dt / (DEMAND_WINDOW * 1e9))
                self.demand += alpha * (ops * 1e9 / dt - self.demand)
        self._last = (now, tail)
        self._burned = 0

    def expire(self, now: int) -> None:
        """Burn the tokens beyond those of the lease records still young ``MIN_TICK`` after ``now``
        (``LeaseRecords.expire``); they moved the tail, and are not demand (``_measure``)."""
        self._burned += self.records.expire(now)

    def _deliver(self, now: int) -> int:
        """Put the batches that are due into the bucket, as far as they fit; drop those past their ttl.
        Returns the ops put in.

        Ordered so that a filler stopped anywhere in here and resumed much
        later can do no harm: a batch older than its ttl is never added, and
        one added late carries its old record, so the next expiry check (by
        whichever filler runs) burns it.
        """
        b = self.bucket
        c = self.cells
        added = 0
        while self.pending and self.pending[0].due <= now:
            bt = self.pending[0]
            if now - bt.stamp >= self.ttl_ns:
                c.fetch_add(L.UP_EXPIRED, bt.left)
                # delivered too late to be used (the filler, or this process as an orphan, off the
                # CPU since it fell due): schedule lost as surely as a gap, if callers want it (the
                # ops queued callers are owed, or all of it for callers refused just now)
                owed = -b.balance() // b.cost
                if owed <= 0 and now - c.load(L.UP_HUNGRY) < HUNGRY_NS:
                    owed = bt.left
                if owed > 0:
                    c.fetch_add(L.STARVED_NS, min(owed, bt.left) * self.interval_ns)
                self.pending.popleft()
                continue
            if not bt.recorded:
                self._record(now)
            # a part of a token put in uses a whole op: a bucket the clock feeds ("local") may have
            # room for a fraction only, and a batch left whole would fill it again at every tick
            put = -(-b.add(bt.left * b.cost) // b.cost)
            bt.left -= put
            added += put
            if self.clock() - bt.stamp >= self.ttl_ns:
                # stopped between the age check and the add: what we added is already past its ttl
                self.expire(self.clock())
            if bt.left > 0:
                return added  # no room: the rest waits for the next tick (or its ttl)
            self.pending.popleft()
        return added

    def _record(self, now: int) -> None:
        """Write the lease record of the first batch and of every batch due behind it: one record,
        their earliest stamp and all their ops.  The batches of one reservation due at once (within
        the GCRA's tolerance), or a late wake's, would each push a record out of the ring of four,
        and the bucket would hold more than the ring covers: tokens burned early, schedule lost."""
        run: List[_Batch] = []
        ops = 0
        for bt in self.pending:
            if bt.recorded or bt.due > now or ops + bt.ops > RECORD_MAX_OPS:
                break
            run.append(bt)
            ops += bt.ops
        self.mine.append(self.records.write(min(bt.stamp for bt in run), ops))
        for bt in run:
            bt.recorded = True

    def want(self, now: int, early: int = 0) -> int:
        """Ops to reserve now (0: none needed), or up to ``early`` ns before they would be.

        Only for a host with demand: callers queued (a negative balance) or
        refused without queueing (``UP_HUNGRY``, recent), or busy enough to
        use a token within its time to live.  And only when the reserved
        schedule ends within ``lead`` and, unless callers wait, what the host
        holds and has reserved runs out at its demand within the lead plus
        one batch of the global schedule.  A batch is ``batch_seconds`` of demand or
        what queued callers are owed, at least one op, at most ``max_batch``.
        A tick asks ``EARLY`` before the lead requires it (``_lease``): the
        feeder, awake to deliver, saves a wake of its own for the request.
        """
        b = self.bucket
        lead = self.lead_ns + early
        avail = b.balance() / b.cost  # negative: owed to queued callers
        # what queued callers are owed counts too: a filler that just took over knows no demand yet
        batch = min(
            self.max_batch,
            max(
                1,
                math.ceil(self.demand * self.spec.batch_seconds),
                math.ceil(-avail),
                self.grow if avail < 0 else 1,
            ),
        )
        if avail < 0:
            self._queued_at = now
        self.batch = batch
        hungry = avail < 0 or now - self.cells.load(L.UP_HUNGRY) < HUNGRY_NS
        if not hungry and self.demand * self.ttl_ns / 1e9 < 1:
            return 0
        if self.pending and self.pending[-1].due - now >= lead:
            return 0  # the reserved schedule reaches far enough
        # one round trip reserves ``lease_seconds`` of demand (at most of the global rate), delivered
        # a batch at a time (``_slice``)
        lease = max(
            batch,
            min(
                self.max_lease,
                max(math.ceil(self.demand * self.lease_seconds), self.grow_lease if hungry else 1),
            ),
        )
        if avail < 0 or hungry:
            return lease  # callers wait: keep the schedule continuous
        # busy, nobody waiting: lease when what we hold and have reserved runs out within the lead
        # and one batch's worth of the global schedule
        have = avail + sum(bt.left for bt in self.pending)
        if have * 1e9 >= self.demand * (lead + batch * self.interval_ns):
            return 0
        return lease

    def _lease(self, now: int, state: int) -> bool:
        """Reserve the next lease if ``want`` says so (or retry after an outage); True if it asked
        Redis (a batch may be due at once, or fell due during the call)."""
        c = self.cells
        want = self.want(now, int(EARLY * 1e9))
        if state == STATE_OK and want == 0:
            return False
        # Renewed just before the call: we still hold it (or learn we do not).  Not extended over
        # the call: the lease word is nearly always fresh from the last call, and a filler killed
        # or stopped then must be replaced within the usual lease timeout, not the Redis timeout.
        # A call slower than that may let a second filler lease meanwhile, which costs only
        # slots of the global schedule: Redis counts every reservation.
        if not self.lease.renew():
            return False
        want = max(1, want)
        queued = self.bucket.balance() < 0
        hungry = queued or now - c.load(L.UP_HUNGRY) < HUNGRY_NS
        # The next slots of the global schedule, up to the horizon (a FIFO of the hosts' batches:
        # equal shares under saturation; see the module's docstring).
        sent = self.clock()
        trips = 0
        try:
            if self.redis is None:
                self.redis = self._connect(self.spec)
            trips = self.redis.round_trips
            granted, wait, backlog, dry = self.redis.call(MODE_RESERVE, want, self.horizon_ns)
        except Exception as e:  # (anything else too: a filler that dies grants nothing, ever)
            self._count_trips(trips)
            self._fail(state, e)
            return True
        received = self.clock()
        self._count_trips(trips)
        self.rtt_ns += (received - sent - self.rtt_ns) // 4
        if state != STATE_OK:
            self._switch(state, STATE_OK)
        if granted:
            if state == STATE_OK:  # (after an outage the gap is the outage's: counted as errors)
                self._note_dry(sent, dry)
            self._slice(sent, received, wait, granted)
            c.fetch_add(L.UP_LEASED, granted)
            self.next_try = 0
            batch = min(granted, self.batch)
            self.grow = min(self.max_grow, 2 * max(self.grow, batch)) if queued else 1
            self.grow_lease = (
                min(self.max_lease, 2 * max(self.grow_lease, granted)) if hungry else 1
            )
        else:
            # due beyond the horizon, refused and nothing written (a long queue, or a broken key):
            # ask again when the schedule should have come within it, or a repair have come
            c.fetch_add(L.UP_REFUSED, 1)
            later = min(int(RETRY_EVERY * 1e9), max(int(MIN_RETRY * 1e9), wait - self.horizon_ns))
            self.next_try = (
                received + later + random.randrange(min(self.interval_ns, 1_000_000) + 1)
            )
        return True

    def _slice(self, sent: int, received: int, wait: int, granted: int) -> None:
        """Queue a reservation of ``granted`` ops as batches of ``self.batch`` ops, each due when its
        own last slot is.

        Redis reserved consecutive slots, the last due ``wait`` after it ran
        the script; the slot ``j`` ops before it is due ``j * interval``
        sooner (or at once): what a reservation of the ops up to it would have
        been told.  So each batch is due (``reply + its wait``) and stamped
        (``request + its wait``) exactly as a reservation of its own, and
        delivered and expired as one.
        """
        cut = max(1, self.batch)
        iv = self.interval_ns
        done = 0
        while done < granted:
            ops = min(cut, granted - done)
            done += ops
            w = max(0, wait - (granted - done) * iv)
            self.pending.append(_Batch(due=received + w, stamp=sent + w, ops=ops, left=ops))

    def _note_wanting(self, now: int) -> None:
        """Keep ``UP_WANTING``: since when callers have wanted tokens (queued, or refused without
        queueing in the last ``HUNGRY_NS``), as every filler in turn saw it; 0 when they do not."""
        c = self.cells
        wanting = self.bucket.balance() < 0 or now - c.load(L.UP_HUNGRY) < HUNGRY_NS
        since = c.load(L.UP_WANTING)
        if wanting and not since:
            c.store(L.UP_WANTING, max(1, now))
        elif since and not wanting:
            c.store(L.UP_WANTING, 0)

    def _note_dry(self, sent: int, dry: int) -> None:
        """The global schedule had run dry for ``dry`` ns (Redis's own measure: from the end of the
        last reservation, anyone's, to when it ran this one) while callers wanted tokens: the GCRA
        does not bank the gap, so that schedule time is lost.  Counted in ``STARVED_NS``
        (``Stats.starved_seconds``, as the clamp's losses are in clock-fed mode): the part of the
        gap since callers began to want tokens (``UP_WANTING``, kept by whichever filler ran), up to
        our request; a lower bound, as Redis ran it after we sent it.  Either the filler asked late
        (its thread, or the process that should have taken over from it, off the CPU for longer
        than the lead) or Redis ran the request late (off the CPU itself).  A filler that takes
        over counts a gap its predecessor left, and never one of its own earlier stint that
        someone else's reservations closed."""
        since = self.cells.load(L.UP_WANTING)
        if dry <= 0 or not since:
            return
        lost = min(dry, sent - since)
        if lost > 0:
            self.cells.fetch_add(L.STARVED_NS, lost)

    def _count_trips(self, before: int) -> None:
        if self.redis is not None:
            self.cells.fetch_add(L.UP_ROUND_TRIPS, self.redis.round_trips - before)

    def _fail(self, state: int, e: Exception) -> None:
        """Redis unavailable (``RedisUnavailableError``): enter the configured fallback (from "ok"
        only; "error" stays closed).  Redis answered with an error (``RedisDataError``), or the
        call failed otherwise (connecting raised): "error", closed whatever the fallback, until it
        answers correctly."""
        self.cells.fetch_add(L.UP_ERRORS, 1)
        data = not isinstance(e, RedisUnavailableError)
        new = (
            STATE_ERROR if data else (_FALLBACK[self.spec.on_error] if state == STATE_OK else state)
        )
        if new != state:
            if data:
                log.error(
                    "%s; no tokens until it answers correctly",
                    e,
                    exc_info=not isinstance(e, RedisDataError),
                )
            else:
                log.warning("%s; fallback %r until it answers", e, self.spec.on_error)
            self._switch(state, new)
        self.next_try = self.clock() + int(RETRY_EVERY * 1e9)

    def _switch(self, state: int, new: int) -> None:
        """From ``state`` to ``new``.  Leaving "ok" counts a fallback.  Leaving "local" or "open"
        gives the config back ``FLAG_UPSTREAM`` alone and undoes what the fallback let in: the
        local clock's tokens are burned (not the global limit's), the tickets "open" let through
        forgiven.  Entering one of them sets its flags (after the state: ``stats`` never shows a
        bucket fed otherwise as "ok"); entering "local" drops the batches reserved ahead (counted
        expired): the host's own clock feeds it then, at the local rate alone."""
        b = self.bucket
        if state == STATE_OK:
            self.cells.fetch_add(L.UP_FALLBACKS, 1)
        if state in _FLAGS:
            b.set_upstream_flags(L.FLAG_UPSTREAM)
            if state == STATE_LOCAL:
                b.burn()
            else:
                b.forgive()
        if new == STATE_LOCAL:
            # the clock feeds the bucket now: the batches reserved ahead would come on top of it
            self.cells.fetch_add(L.UP_EXPIRED, sum(bt.left for bt in self.pending))
            self.pending.clear()
        self.cells.store(L.UP_STATE, new)
        if new in _FLAGS:
            b.set_upstream_flags(_FLAGS[new])
