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

import threading
import time
from typing import TYPE_CHECKING, Callable, Optional, Protocol

from . import layout as L

if TYPE_CHECKING:  # pragma: no cover
    from .bucket import Bucket
    from .cells import Cells

#: A lease not renewed for this long may be taken by another process (seconds).
LEASE_TIMEOUT = 0.050
#: The holder renews this often (seconds).
RENEW_EVERY = 0.010
#: The holder replenishes this often (seconds): about 1 kHz for limits of 500 ops/s and more ...
FILL_PERIOD = 0.001
#: ... about twice per op for slower limits, and no less often than this (seconds).  A fill
#: that finds nothing to do (bucket full, nobody grabbing) doubles the pause up to this too.
MAX_FILL_PERIOD = 0.020
#: Watchers look at the lease this often (seconds).  They need not hurry: a waiter that finds
#: the filler late replenishes for itself and nudges its own process's watcher (``nudge``).
WATCH_PERIOD = 0.5


_SLOT_MASK = (1 << L.LEASE_SLOT_BITS) - 1


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
        if not self.word:
            return False
        new = lease_word(self.clock_us() + int(LEASE_TIMEOUT * 1e6), self.slot)
        if self.cells.cas(L.LEASE, self.word, new):
            self.word = new
            return True
        self.word = 0
        return False

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


class ClockFeed:
    """Replenish from the clock: about 1 kHz, about twice per op for slow limits, slower when idle."""

    def __init__(self, bucket: "Bucket", lease: Lease) -> None:
        self.bucket = bucket
        self.idle = FILL_PERIOD

    def tick(self) -> float:
        b = self.bucket
        period = min(MAX_FILL_PERIOD, max(FILL_PERIOD, b.cost / b.tpn / 2e9))
        if b.replenish() > 0 or b.balance() < b.cap:
            self.idle = period
        else:
            self.idle = min(MAX_FILL_PERIOD, self.idle * 2)
        return self.idle

    def close(self) -> None:
        pass

    def orphan_tick(self) -> Optional[float]:
        return None  # the clock owes nothing: whoever fills next converts the time


class FillerThread(threading.Thread):
    """Watches the lease; while holding it, runs its feed and renews the lease.

    ``feed`` makes the feed.  By default a limiter fed by the clock gets a
    ``ClockFeed``; a limiter fed by an upstream (``bucket.upstream``) has no
    default: a process takes part in its election only once it was given the
    upstream's feed (``set_feed``) by its own configuration, never from what
    the segment says.
    """

    def __init__(
        self, bucket: "Bucket", lease: Lease, name: str, feed: Optional[FeedFactory] = None,
        chores: Optional[Callable[[], Optional[float]]] = None,
    ) -> None:
        super().__init__(name=f"shmlimit-filler-{name}", daemon=True)
        self.bucket = bucket
        self.lease = lease
        self.make_feed: Optional[FeedFactory] = feed if feed is not None or bucket.upstream else ClockFeed
        self.feed: Optional[Feed] = None
        self._stopping = False
        self._wake = threading.Event()
        self.fills = 0
        #: run by the elected filler now and then (giving back dead processes' tickets); it answers
        #: the seconds until it wants to run again
        self.chores = chores

    def set_feed(self, feed: FeedFactory) -> None:
        """Give a watcher the feed it may run once elected (the first one given stays)."""
        if self.make_feed is None:
            self.make_feed = feed
            self._wake.set()

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()

    def nudge(self) -> None:
        """Called by this process's waiters when they had to replenish: the filler is late.

        Takes the lease at once if it has expired, so the next filler is one
        that is known to be running, without any watcher polling quickly.
        """
        if self.make_feed is not None and not self.lease.held and self.lease.try_take():
            self._wake.set()

    def _nap_renewing(self, nap: float, last_renew: float) -> float:
        """Sleep ``nap`` seconds, renewing the lease every ``RENEW_EVERY`` meanwhile; return when it
        was last renewed.

        A hierarchical feed sleeps until its next event, up to ``upstream.IDLE_TICK``;
        a thread that wakes late on a busy machine (tens of ms) would then let the
        lease lapse, and a waiter would take it: a new filler that starts knowing no
        demand.  A renewal alone costs far less than a tick.
        """
        end = time.monotonic() + nap
        while not self._stopping:
            now = time.monotonic()
            if now >= end:
                break
            if now - last_renew >= RENEW_EVERY:
                if not self.lease.renew():
                    break
                last_renew = now
            time.sleep(min(end, last_renew + RENEW_EVERY) - now)
        return last_renew

    def run(self) -> None:
        wake = self._wake
        lease = self.lease
        bucket = self.bucket
        last_renew = 0.0
        chores_at = 0.0
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
                if self.chores is not None and now >= chores_at:
                    try:
                        chores_at = now + (self.chores() or 0.0)
                    except Exception:  # pragma: no cover - a chore never stops the filling
                        chores_at = now + 1.0
                if bucket.upstream:
                    last_renew = self._nap_renewing(nap, last_renew)
                else:
                    time.sleep(nap)
        except Exception:  # pragma: no cover - a closed mapping at interpreter exit
            pass
        finally:
            try:
                lease.drop()
                if self.feed is not None:
                    self.feed.close()
            except Exception:  # pragma: no cover
                pass
