"""Filler election and the filler thread.

Every registered process runs one small daemon thread per limiter.  At most one
of them -- the holder of the lease -- replenishes the bucket about every
millisecond; the others only watch the lease.

The lease is one word, ``(expiry_us << 12) | (slot + 1)``, so taking, renewing
and dropping it are each a single CAS: a holder that was stopped (SIGSTOP, a
long GC pause) and resumes finds its renewal CAS failing, learns it lost the
lease, and stops filling.  Even if it filled once more before noticing, nothing
would be double-counted: every replenish claims its interval by CAS (see
``bucket``).  A holder that dies leaves a lease that expires within
``LEASE_TIMEOUT`` and is taken by the next watcher that looks.  Meanwhile no
grant waits for the filler: waiters replenish for themselves when they find
the head short (the lazy backstop).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Optional, Protocol, Tuple

from shmlimit.bucket.rovers import diff
from shmlimit.shm import layout as L

if TYPE_CHECKING:  # pragma: no cover
    from shmlimit.bucket.rovers import Bucket
    from shmlimit.shm.cells import Cells

#: A lease not renewed for this long may be taken by another process (seconds).
LEASE_TIMEOUT = 0.050
#: The holder renews this often (seconds).
RENEW_EVERY = 0.010
#: The holder replenishes this often (seconds): about 1 kHz for limits of 500 ops/s and more ...
FILL_PERIOD = 0.001
#: ... about twice per op for slower limits, and no less often than this (seconds).  A fill
#: that finds nothing to do (bucket full, nobody grabbing) doubles the pause up to this too.
MAX_FILL_PERIOD = 0.020
#: The share of the usual pace that the refills between two ticks may lose to the capacity clamp
#: and still count as the waiters keeping the pace (``ClockFeed.lost``).  A waiter whose ticket the
#: head stops at refills at its turn itself (``sleep.STOP_LEAD_NS``), and the clamp drops what that
#: refill is late by and its second claim's own ns: a few hundred ns natively, tens of us in Python,
#: more when a wake comes later than its lead.  A filler at its usual pace ``p`` would have saved
#: some of a loss ``d`` only by ticking inside it: ``d**2 / 2p`` on average, at most a sixteenth of
#: ``d`` for ``d`` up to ``p / 8``; going back to that pace for such a loss buys next to nothing.
LOSS_SLACK = 1 / 8
#: A pace kept natively (``ClockFeed.span``) runs without returning to Python about this long
#: (seconds; at most one pace more, its last sleep being a whole one): the filler thread's loop,
#: chore and stop requests come back at least that often.
SPAN_MAX = 0.1
#: Watchers look at the lease this often (seconds).  They need not hurry: a waiter that finds
#: the filler late replenishes for itself and nudges its own process's watcher (``nudge``).
WATCH_PERIOD = 0.5


log = logging.getLogger("shmlimit.filler")

_SLOT_MASK = (1 << L.LEASE_SLOT_BITS) - 1
#: ``Waiter.fill``'s flags (``_native.c``): the lease lost, our add raced a config change
FILL_LOST = 4
FILL_BURN = 8
#: ``ClockFeed.pace``: the paces a span keeps
FIXED = 0
BACKED_OFF = 1


def slack_ns(period: float) -> int:
    """The time (ns) the refills between two ticks may lose at the usual pace ``period`` (seconds)
    and still count as the waiters keeping it: ``LOSS_SLACK`` of it."""
    return int(period * LOSS_SLACK * 1e9)


def lease_word(expiry_us: int, slot: int) -> int:
    return (expiry_us << L.LEASE_SLOT_BITS) | (slot + 1)


def lease_slot(word: int) -> Optional[int]:
    """The slot index holding the lease, or None when it is free."""
    s = word & _SLOT_MASK
    return s - 1 if s else None


def lease_expiry_us(word: int) -> int:
    return word >> L.LEASE_SLOT_BITS


def now_us() -> int:
    return time.monotonic_ns() // 1000


class Lease:
    """This process's view of one limiter's filler lease."""

    def __init__(self, cells: "Cells", slot: int, clock_us: Callable[[], int] = now_us) -> None:
        self.cells = cells
        self.slot = slot
        self.clock_us = clock_us
        self.word = 0  # the lease word we last wrote; 0 = we do not hold it

    @property
    def held(self) -> bool:
        return self.word != 0

    def try_take(self) -> bool:
        """Take the lease if it is free or expired.  One CAS; True if we hold it now."""
        c = self.cells
        cur = c.load(L.LEASE)
        now = self.clock_us()
        if cur and lease_expiry_us(cur) > now:
            return lease_slot(cur) == self.slot and self.word == cur
        new = lease_word(now + int(LEASE_TIMEOUT * 1e6), self.slot)
        if c.cas(L.LEASE, cur, new):
            self.word = new
            return True
        return False

    def renew(self) -> bool:
        """Extend our lease.  False (and we no longer hold it) if another process took it."""
        word = self.word
        if not word:
            return False
        new = lease_word(self.clock_us() + int(LEASE_TIMEOUT * 1e6), self.slot)
        if self.cells.cas(L.LEASE, word, new):
            self.word = new
            return True
        if self.word == word:  # (not if this process's nudge took it again meanwhile: ``lapsed``)
            self.word = 0
        return False

    def lapsed(self) -> bool:
        """Is the lease free or expired, whoever held it (this process too: a thread that believes it
        holds the lease may be late to renew it)?"""
        cur = self.cells.load(L.LEASE)
        return not cur or lease_expiry_us(cur) <= self.clock_us()

    def drop(self) -> None:
        """Give the lease up at once so another process takes over without waiting for expiry."""
        if self.word:
            self.cells.cas(L.LEASE, self.word, 0)
            self.word = 0

    def forget(self) -> None:
        """After fork: the child never holds its parent's lease."""
        self.word = 0


class Feed(Protocol):
    """How the elected filler feeds the bucket: the clock (``ClockFeed``) or an upstream's leases."""

    def tick(self) -> float:
        """Feed the bucket once; return the seconds until the next tick."""

    def close(self) -> None:
        """Release what the feed holds (connections); called when the filler stops."""

    def orphan_tick(self) -> Optional[float]:
        """Run while this process is not (or no longer) elected: finish what the feed still owes
        the bucket; return the seconds until it must run again, None when it owes nothing."""


#: Makes the feed when this process is first elected: ``factory(bucket, lease)``.
FeedFactory = Callable[["Bucket", Lease], Feed]


def _refilled(b: "Bucket") -> Tuple[int, int]:
    """``(REPL_TS, HEAD)``: the time refilled up to, then the head (read only, for the pacing)."""
    return b.cells.load(L.REPL_TS), b.head()


class ClockFeed:
    """Replenish from the clock: about 1 kHz, about twice per op for slow limits, slower when idle
    or while queued callers keep the pace by refilling at their own turns."""

    def __init__(self, bucket: "Bucket", lease: Lease) -> None:
        self.bucket = bucket
        self.idle = FILL_PERIOD
        self.mark: Optional[Tuple[int, int, bool]] = (
            None  # (REPL_TS, HEAD, queued) after our last tick
        )
        self.native: Any = None  # the native refill bound to the config numbered native_seq
        self.native_seq: Optional[int] = None
        #: what our last tick's pace was (``span``): None, one to judge again at the next tick;
        #: FIXED, the usual pace while callers queue under a capacity of less than three ops and
        #: nothing lets us back off (it stays until the span's end, the queue gone or the config
        #: changed); BACKED_OFF, the longest pause while queued waiters keep the pace (it stays
        #: while they do, as ``queued`` sees it)
        self.pace: Optional[int] = None

    def refill(self) -> int:
        """``Bucket.replenish``, as one native call where the bucket has one for its config (the
        native wait's refill, word for word: fed by the clock, not stopped, no catch-up, not
        capped), which makes a tick cheap; the tokens added."""
        b = self.bucket
        snap = b.snap
        if self.native_seq != snap.seq:
            self.native_seq = snap.seq
            # bound like a waiter, but only ever refilling: it counts no grant and no waiter
            real_clock = b.clock is time.monotonic_ns
            self.native = b.waiter(snap, L.UNREG_GRANTS, None, 1) if real_clock else None
        if self.native is None:
            return b.replenish()
        added, burn = self.native.refill()
        if burn:  # our add raced a config change: the capacity in force applies (as Bucket.apply)
            b.burn_late_add()
        return added

    def usual(self) -> float:
        """The usual pace (seconds): half an op, at least ``FILL_PERIOD``, at most ``MAX_FILL_PERIOD``."""
        b = self.bucket
        return min(MAX_FILL_PERIOD, max(FILL_PERIOD, b.cost / b.tpn / 2e9))

    def tick(self) -> float:
        b = self.bucket
        period = self.usual()
        before = _refilled(b)[0]
        added = self.refill()
        balance = b.balance()
        ts, head = _refilled(b)
        mark, self.mark = self.mark, (ts, head, balance < 0)
        self.pace = None
        if balance < 0:
            self.idle = self.queued(period, before, mark)
        else:
            if added > 0 or balance < b.cap:
                self.idle = period
            else:
                self.idle = min(MAX_FILL_PERIOD, self.idle * 2)
        return self.idle

    def lost(self, period: float, mark: Tuple[int, int, bool]) -> bool:
        """Did the refills since our last tick (``mark``: left under a queue) lose time to the
        capacity clamp?

        The head then gained fewer tokens than the time refilled since, by more than
        ``LOSS_SLACK`` of ``period`` (the stops' own ns)."""
        b = self.bucket
        ts, head, _ = self.mark  # type: ignore[misc]
        return diff(head, mark[1]) < max(0, ts - mark[0] - slack_ns(period)) * b.tpn

    def queued(self, period: float, before: int, mark: Optional[Tuple[int, int, bool]]) -> float:
        """The pause while callers queue (the head behind the tail after our refill).

        A waiter refills when its ticket is due, so one-op tickets refill the
        bucket once per op, and the waiters' own refills turn every nanosecond
        into tokens: the clamp counts a capacity from the start of the recorded
        request the head stands in, so a refill at a turn reaches that ticket
        whatever the capacity (a waiter whose ticket the head stops at refills at the
        instant itself, and its refill claims again at once from there, so the
        next waiter's refill counts from its own request's start).  Ours then
        add nothing they need, so we back off (doubling up to
        ``MAX_FILL_PERIOD``) while we see exactly that: someone else refilled
        since our last tick, and the head gained every token of the time
        refilled since but the stops' own ns (``LOSS_SLACK``).  Anything else
        (reservations or debt nobody refills for, time lost to the clamp: a
        waiter late at its stop) keeps the usual pace, which alone keeps the
        rate: at most half an op, and at most a millisecond for fast limits;
        under a capacity of three ops a native span keeps it (``FIXED``), and
        the tick at the span's end judges again.  Pacing only decides when the
        filler looks: the bound is the refill's.
        """
        b = self.bucket
        if mark is None or not mark[2] or before == mark[0] or self.lost(period, mark):
            # (before == mark[0]: nobody else refilled since our last tick)
            if b.cap < 3 * b.cost:  # kept natively until the span's end, as it always was here
                self.pace = FIXED
            return period
        pause = min(MAX_FILL_PERIOD, max(period, self.idle * 2))
        if pause <= period and b.cap < 3 * b.cost:
            # the usual pace is the longest pause (25 ops/s and slower): half an op or less, so some
            # of our ticks see no refill of the waiters' (once per op); kept as the usual pace
            self.pace = FIXED
        elif pause == MAX_FILL_PERIOD:
            self.pace = BACKED_OFF
        return pause

    def span(self, nap: float, until: float, lease: Lease, renewed: float) -> Tuple[int, float]:
        """Sleep ``nap`` seconds after a tick, as the filler thread does; while the pace stays what
        ``queued`` would answer at every tick (``pace``: fixed under a capacity of less than three
        ops, until the span's end; or backed off as far as it goes, kept while someone else refills
        and nothing but the stops' own ns, ``slack_ns``, is lost to the clamp), go on ticking at it
        natively until ``until`` (``time.monotonic`` seconds; the tick due at or past it is left to
        the thread's Python tick, at the pace, so that it judges a whole interval, as every tick of
        the span does): one call without the GIL that renews the lease (every ``RENEW_EVERY`` since
        ``renewed``), refills, leaves the mark and sleeps (``Waiter.fill``), so the thread's Python runs about
        ten times a second instead of at every tick (a tick's wake in Python cost about twice a
        bare sleep's).  It leaves as soon as anything could change the pace: the queue gone, the
        config changed, what the backed-off pace needs no longer seen, the lease lost, a stop.
        Returns (ticks made, when the lease was last renewed)."""
        native = self.native
        word = lease.word
        if self.pace is None or self.mark is None or native is None or not word or nap <= 0:
            time.sleep(max(0.0, nap))
            return 0, renewed
        flags, fills, new_word, renewed_ns, mark_ts, mark_head = native.fill(
            int(nap * 1e9),
            int(until * 1e9),
            word,
            int(renewed * 1e9),
            int(RENEW_EVERY * 1e9),
            int(LEASE_TIMEOUT * 1e6),
            self.mark[0],
            self.mark[1],
            self.pace == BACKED_OFF,
            slack_ns(self.usual()),
        )
        self.mark = (mark_ts, mark_head, True)  # after its last tick that kept the pace (as ours)
        if flags & FILL_LOST:
            if lease.word == word:  # (not if this process's nudge took the lease again meanwhile)
                lease.word = 0
        elif lease.word == word:
            lease.word = new_word
        if flags & FILL_BURN:  # our add raced a config change: the config in force applies
            self.bucket.burn_late_add()
        return fills, renewed_ns / 1e9

    def interrupt(self) -> None:
        """End a ``span`` in progress at once (the filler stops)."""
        native = self.native
        if native is not None:
            native.interrupt()

    def close(self) -> None:
        pass

    def orphan_tick(self) -> Optional[float]:
        return None  # the clock owes nothing: whoever fills next converts the time


#: How long after a filler lease's expiry a fed waiter sleeps at most when its process may not take the
#: lease: a watching filler thread takes it within ``WATCH_PERIOD``, plus a fed wait's grace
#: (``fed_wait.GRACE_NS``) for the new filler's first batch.
TAKEOVER_NS = int(WATCH_PERIOD * 1e9) + 30_000_000


def takeover_ns(filler: Optional["FillerThread"]) -> int:
    """What a native fed waiter (``_native.c``, ``FedWaiter.takeover_ns``) of the process whose filler
    thread is ``filler`` does with a lapsed filler lease: 0, look again soon and nudge, when the
    process may take the lease; else ``TAKEOVER_NS``: it has no slot, or it attached by name without
    the upstream, its nudge does nothing and a look every few ms would be for nothing, so it sleeps
    until the lease's expiry plus the take-over by a process that may (or the new batch's wake)."""
    return 0 if filler is not None and filler.make_feed is not None else TAKEOVER_NS


class _Wake:
    """``threading.Event``'s ``set``, ``wait`` and ``clear`` on one lock held while not set (a binary
    semaphore): a watcher's wait is then one C call, without the Python of a ``Condition`` around it.
    A watching thread wakes every ``WATCH_PERIOD`` in every process, and its wake's Python runs on cold
    caches (about 100 us of CPU each).  As with an Event, a ``set`` between a ``wait`` and the
    ``clear`` after it is cleared: the loop looks at the lease after the clear anyway."""

    __slots__ = ("_held",)

    def __init__(self) -> None:
        self._held = threading.Lock()
        self._held.acquire()

    def set(self) -> None:
        try:
            self._held.release()
        except RuntimeError:  # set already
            pass

    def wait(self, timeout: float) -> bool:
        """Until set or ``timeout`` seconds; True if set (and then cleared: ``clear`` is a no-op)."""
        return self._held.acquire(timeout=max(0.0, timeout))

    def clear(self) -> None:
        self._held.acquire(blocking=False)


class FillerThread(threading.Thread):
    """Watches the lease; while holding it, runs its feed and renews the lease.

    ``feed`` makes the feed.  By default a limiter fed by the clock gets a
    ``ClockFeed``; a limiter fed by an upstream (``bucket.upstream``) has no
    default: a process takes part in its election only once it was given the
    upstream's feed (``set_feed``) by its own configuration, never from what
    the segment says.
    """

    def __init__(
        self,
        bucket: "Bucket",
        lease: Lease,
        name: str,
        feed: Optional[FeedFactory],
        chore: Callable[[], float],
    ) -> None:
        super().__init__(name=f"shmlimit-filler-{name}", daemon=True)
        self.bucket = bucket
        self.lease = lease
        self.make_feed: Optional[FeedFactory] = (
            feed if feed is not None or bucket.upstream else ClockFeed
        )
        self.feed: Optional[Feed] = None
        self._stopping = False
        self._wake = _Wake()
        self.fills = 0
        #: run by the elected filler now and then (giving back dead processes' tickets); it
        #: answers the seconds until it wants to run again
        self.chore = chore

    def set_feed(self, feed: FeedFactory) -> None:
        """Give a watcher the feed it may run once elected (the first one given stays)."""
        if self.make_feed is None:
            self.make_feed = feed
            self._wake.set()

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        interrupt = getattr(self.feed, "interrupt", None)
        if interrupt is not None:
            interrupt()

    def nudge(self) -> None:
        """Called by this process's waiters when they had to replenish: the filler is late.

        Takes the lease at once if it has expired, so the next filler is one
        that is known to be running, without any watcher polling quickly.  Also
        when this process's filler thread believes it holds the lease: it is
        late to renew it (off the CPU, or another process took the lease and
        let it lapse in turn), and a waiter that runs proves the process runs;
        left lapsed, every waiter would look again every few ms (a fed wait's
        short sleep) until the thread noticed.
        """
        lease = self.lease
        if self.make_feed is not None and (not lease.held or lease.lapsed()) and lease.try_take():
            self._wake.set()

    def _nap_renewing(self, nap: float, last_renew: float) -> float:
        """Sleep ``nap`` seconds, renewing the lease every ``RENEW_EVERY`` meanwhile; return when it
        was last renewed.

        A hierarchical feed sleeps until its next event, up to ``upstream.IDLE_TICK``;
        a thread that wakes late on a busy machine (tens of ms) would then let the
        lease lapse, and a waiter would take it: a new filler that starts knowing no
        demand.  A renewal alone costs far less than a tick, but a wake only for it
        cost a third of a delivery's CPU at 50/s: it renews before sleeping when
        the nap would pass ``RENEW_EVERY`` after the last renewal, then sleeps up
        to twice that (naps end within ``IDLE_TICK``: no wake for a renewal alone).
        """
        end = time.monotonic() + nap
        while not self._stopping:
            now = time.monotonic()
            if now >= end:
                break
            if now - last_renew >= RENEW_EVERY or end - last_renew > 2 * RENEW_EVERY:
                if not self.lease.renew():
                    break
                last_renew = now
            time.sleep(min(end, last_renew + 2 * RENEW_EVERY) - now)
        return last_renew

    def run(self) -> None:
        wake = self._wake
        lease = self.lease
        bucket = self.bucket
        last_renew = 0.0
        chore_at = 0.0
        try:
            while not self._stopping:
                if not lease.held:
                    if self.make_feed is None or not lease.try_take():
                        # Hierarchical mode too: only a filler brings tokens there, but every caller
                        # that finds none nudges (waiters, expecting no batch, every 2 ms; refused
                        # tries each time), so a dead filler is replaced without watchers polling.
                        # A feed that lost the election still delivers what it had leased, when due.
                        owed = self.feed.orphan_tick() if self.feed is not None else None
                        wake.wait(WATCH_PERIOD if owed is None else min(WATCH_PERIOD, owed))
                        wake.clear()
                        continue
                    last_renew = time.monotonic()
                now = time.monotonic()
                if now - last_renew >= RENEW_EVERY:
                    if not lease.renew():
                        continue
                    last_renew = now
                bucket.refresh()
                if self.feed is None:
                    self.feed = self.make_feed(bucket, lease)  # type: ignore[misc]
                nap = self.feed.tick()
                self.fills += 1
                if now >= chore_at:
                    try:
                        chore_at = now + self.chore()
                    except Exception:  # a chore never stops the filling
                        log.exception("%s: a chore failed; filling goes on", self.name)
                        chore_at = now + 1.0
                if bucket.upstream:
                    # the nap, and the wakes for a delivery alone after it, natively where it can
                    # (not once stopped: a stop before the feed was made interrupted nothing)
                    span = getattr(self.feed, "nap_delivering", None)
                    spanned = None if span is None or self._stopping else span(nap, last_renew)
                    if spanned is not None:
                        wakes, last_renew = spanned
                        self.fills += wakes
                        continue
                    last_renew = self._nap_renewing(nap, last_renew)
                    # wakes for a delivery alone are made without a whole tick (``Feeder.between``)
                    between = getattr(self.feed, "between", None)
                    while between is not None and lease.held and not self._stopping:
                        nap = between()
                        if nap is None:
                            break
                        self.fills += 1
                        last_renew = self._nap_renewing(nap, last_renew)
                elif isinstance(self.feed, ClockFeed) and not self._stopping:
                    until = min(now + SPAN_MAX, chore_at)
                    ticks, last_renew = self.feed.span(nap, until, lease, last_renew)
                    self.fills += ticks
                else:
                    time.sleep(nap)
        except Exception:  # a closed mapping at interpreter exit; anything else is a bug: said
            if not self._stopping:
                log.exception("%s stopped; another process's filler may take over", self.name)
        finally:
            try:
                lease.drop()
                if self.feed is not None:
                    self.feed.close()
            except Exception:  # pragma: no cover
                pass
