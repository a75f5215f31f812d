"""The shared token bucket: Seastar's rovers, in shared memory, in tokens of schedule time.

Rovers (unsigned 64-bit, wrapping; only their differences mean anything):

* ``TAIL`` -- advanced by grabbers.  ``grab(a)`` is a fetch-add returning the
  *ticket* ``tail + a``; the grab is satisfied once ``HEAD`` reaches the
  ticket.  Tickets are handed out in order, so waiters are served FIFO across
  every process.  A grab that must not queue (try, or a timed grab whose wait
  would exceed its timeout) advances the tail by CAS only when it can be
  satisfied, and otherwise changes nothing.
* ``HEAD`` -- advanced by ``replenish`` with the time elapsed since the last
  replenish, converted exactly to tokens.  Never moves backwards.
* ``INFLIGHT`` -- capped-release mode only: ops admitted and not yet released
  (in ops, not tokens; see ``admit``).

Invariants (D = ``HEAD - TAIL``; D < 0 means -D tokens are owed to queued grabs):

1. ``HEAD <= B + max(capacity, n)``, where ``B`` is the start of the first
   request the head had not passed at the start of the interval being
   replenished (the head itself, were it at a boundary or in a range nobody
   waits on) and ``n`` that request's length.  A request is granted whole
   when the head passes its end, so the part of it already accrued counts
   against the capacity: grants at one instant never exceed
   ``max(capacity, request)``, and in any window of length T they never
   exceed ``rate*T + max(capacity, largest request)`` (docs/design.md, "The
   clamp counts from the request's start").
2. Each instant of time is converted to tokens at most once: an interval
   ``[REPL_TS, now]`` is claimed by a CAS on ``REPL_TS`` before its tokens are
   added, so any number of processes may call ``replenish`` at any moment.
3. A replenisher records the head and tail it read *before* reading the clock
   (``SNAP_HEAD``, ``SNAP_TAIL``), and the clamp they allow (``SNAP_BASE``,
   ``SNAP_END``, ``SNAP_NEXT``: see ``clamp``); the next replenisher
   clamps against those.
   A replenisher that was delayed between its claim and its add therefore can
   never make tokens of an old interval spendable on top of a fresh bucket:
   the clamp is always relative to the oldest state the interval could have
   seen.  Snapshots only ever under-estimate, which can lose a little time
   (never over-grant).
4. Every move of the head keeps ``HEAD <= LIMIT + max(0, now - DUE) * TPN`` for each
   reservation fence in force (``fences``): held there until the reservation's promise.

Pure arithmetic on cells and an injected clock: tested with a fake clock over simulated hours.
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable, List, Optional, Tuple

from shmlimit.bucket import fed_wait
from shmlimit.bucket.clamp import fill_limit, leave_words, left_named
from shmlimit.bucket.fences import NO_FENCE, FenceHold
from shmlimit.bucket.schedule import Schedule
from shmlimit.config import MAX_QUEUE_TOKENS as MAX_QUEUE
from shmlimit.config import Config
from shmlimit.errors import CorruptWordsError, QueueFullError
from shmlimit.shm import inflight
from shmlimit.shm import layout as L
from shmlimit.shm.banks import (
    NO_SNAPSHOT,
    Snapshot,
    config_words,
    published_values,
    read_snapshot,
    write_banks,
    write_under_lock,
)
from shmlimit.shm.cells import FED_ALL, MASK64, Cells, GrabResult, fed_mask
from shmlimit.shm.words import (  # rover arithmetic, re-exported: the bucket's vocabulary
    behind,
    claim_of,
    clamp_kept,
    clamp_limit,
    diff,
    take_some,
)

REFUSED, NO_RECORD = (
    "refused",
    "no record",
)  #: ``take_within`` took nothing: wait over its bound; no free record
WAIT_GRANTED, WAIT_NUDGE, WAIT_BURN = (
    1,
    2,
    4,
)  #: a native wait's flags (``waiter``): granted (counted), nudge the filler, burn


_FLAGS = L.CFG_BANK.index(L.CFG_FLAGS)  #: where the flags are among the config's words

#: The bucket's words a native waiter reads (``Cells.waiter``'s ``words``, in this order).
WAITER_WORDS = (
    L.CFG_SEQ,
    L.TAIL,
    L.HEAD,
    L.REPL_TS,
    L.SNAP_HEAD,
    L.SNAP_TAIL,
    L.LEASE,
    L.STARVED_NS,
    L.SNAP_BASE,
    L.SNAP_END,
    L.SNAP_NEXT,
)


class Bucket(Schedule):
    """Rover arithmetic on one segment.  ``clock`` returns CLOCK_MONOTONIC nanoseconds."""

    def __init__(self, cells: Cells, clock: Callable[[], int] = time.monotonic_ns) -> None:
        self.cells = cells
        self.clock = clock
        self.snap = NO_SNAPSHOT
        self.cut_short = (
            False  # the last apply's add was cut short, or left the named request: claim again
        )
        self.load_config()
        #: capped mode: this process's slot's count of ops in flight, and every slot's (see ``inflight``)
        self.own_inflight: Optional[int] = None
        self.inflights: Tuple[int, ...] = ()

    # -- configuration (published in two banks under a sequence lock: see config_banks) --------

    def load_config(self) -> None:
        """Load the config in force; one this process had not seen is first applied to the bucket
        (``burn_to``), before any grab of this process is bound to it."""
        # One immutable snapshot, swapped by reference: a thread that reads ``self.snap`` once
        # (the filler, an acquire) never combines the new sequence number with the old price.
        snap = read_snapshot(self.cells)
        if snap.seq != self.snap.seq:
            self.burn_to(snap)
        self.snap = snap

    # Single fields of the current snapshot (for code that needs only one of them).
    seq = property(lambda self: self.snap.seq)
    tpn = property(lambda self: self.snap.tpn)
    cost = property(lambda self: self.snap.cost)
    cap = property(lambda self: self.snap.cap)
    cap_ops = property(lambda self: self.snap.cap_ops)
    capped = property(lambda self: self.snap.capped)
    stopped = property(lambda self: self.snap.stopped)
    upstream = property(lambda self: self.snap.upstream)
    time_fed = property(lambda self: self.snap.time_fed)
    open = property(lambda self: self.snap.open)
    config = property(lambda self: self.snap.config)
    burst_pool = property(lambda self: self.snap.burst_pool)
    max_reserved_ns = property(lambda self: self.snap.max_reserved_ns)

    def refresh(self) -> bool:
        """Reload the config if another process changed it; True if it did."""
        if self.cells.load(L.CFG_SEQ) != self.snap.seq:
            self.load_config()
            return True
        return False

    def publish(self, cfg: Config, seq: Optional[int] = None) -> bool:
        """Replace the live config (seen by every attached process at its next operation).

        The token unit (tpn) stays the one chosen at creation: rovers and the
        clock keep their meaning, queued tickets keep their place and their
        schedule time, and only new grabs pay the new price per op.  The new
        config is validated at that unit and every word is computed before the
        lock is taken: a refused config changes nothing.  The stopped and
        upstream flags stay as the segment holds them under the lock.

        With ``seq`` (a decision computed from the config of that sequence number: the adaptive
        rate's), only if that config is still the one in force under the lock: a change published
        meanwhile stands, never undone by a decision made from the config it replaced, and the
        answer is False.
        """
        if cfg.capped != self.capped:
            raise ValueError("capped cannot be changed on a live limiter (unlink and re-create it)")
        tpn = self.tpn
        # validated before the lock: a refused config writes nothing
        config_words(cfg, tpn, False, 0)
        fallback = (L.FLAG_STOPPED if self.snap.stopped else 0) | self.snap.upstream_flags
        stood = False

        def words(c: Cells) -> List[Tuple[int, int]]:
            nonlocal stood
            lock = c.load(L.CFG_SEQ)  # (ours: the sequence number it was taken from, plus one)
            vals = published_values(c, lock)
            stood = seq is not None and vals is not None and (lock - 1) & MASK64 != seq
            if stood:
                return list(zip(L.CFG_BANK, vals))  # decided from an older config: it stands
            flags = fallback if vals is None else vals[_FLAGS]
            return config_words(cfg, tpn, bool(flags & L.FLAG_STOPPED), flags & L.UPSTREAM_FLAGS)

        # (its load of the new config burns what that no longer allows, as every process's does)
        self._under_config_lock(words)
        return not stood

    def set_upstream_flags(self, upstream_flags: int) -> None:
        """Hierarchical mode: switch the fallback flags, and nothing else (``set_flags``): a
        ``set_rate`` by any process while the filler was talking to Redis is never undone by a
        config the filler read before."""
        self.set_flags(L.UPSTREAM_FLAGS, upstream_flags)

    def check_price(self, cur: Config, new: Config) -> None:
        """Refuse a new price of an op (``rate``/``per``) on a hierarchical bucket in use.

        Its tokens are ops leased from the upstream, bought at the price in force, and its queued
        tickets were priced at it too.  A dearer op would let one leased op cover many queued
        tickets, a cheaper one make each token held worth more ops than were leased: either way
        more grants than the upstream allowed.  (``RedisLimiter``'s rate cannot change live either.)
        """
        if self.upstream and new.cost_at(self.tpn) != cur.cost_at(self.tpn):
            raise ValueError(
                f"rate cannot change on a hierarchical limiter in use (its tokens are ops leased "
                f"at {cur.rate:g} per {cur.per:g} s): got {new.rate:g} per {new.per:g} s; burst "
                f"may change, or create it again with the new rate once no process uses it"
            )

    def set_flags(self, mask: int, flags: int) -> None:
        """Set the ``mask`` bits of the config's flags to ``flags``, and nothing else: every other
        word stays as the segment holds it under the lock, so no change another process published
        since this one last looked is undone."""

        def words(c: Cells) -> List[Tuple[int, int]]:
            vals = published_values(c, c.load(L.CFG_SEQ))
            if vals is None:
                raise CorruptWordsError("no copy of its configuration passes its checksum")
            vals[_FLAGS] = (vals[_FLAGS] & ~mask) | flags
            return list(zip(L.CFG_BANK, vals))

        self._under_config_lock(words)

    def _under_config_lock(self, words: Callable[[Cells], List[Tuple[int, int]]]) -> None:
        """Write ``words(cells)`` under the config lock (``banks.write_under_lock``), then load the
        config in force, whatever happened (taken over: ``ConfigWriterTakenOver`` after it)."""
        try:
            write_under_lock(self.cells, words)
            fed_wait.wake(
                self.cells, FED_ALL
            )  # fed waiters asleep on the old config go back to rebind to the new one
        finally:
            self.load_config()

    @staticmethod
    def initialise(
        cells: Cells,
        cfg: Config,
        now_ns: int,
        initial_ops: Optional[float] = None,
        base: int = 0,
        upstream: bool = False,
    ) -> None:
        """Write the config and the starting rovers of a new segment (called by its creator only).

        The bucket starts with ``initial_ops`` tokens (default: full).  ``base``
        is where the rovers start; tests set it near 2**64 to exercise wrap-around.
        With ``upstream`` (hierarchical mode) the bucket starts empty: its
        tokens come only from leases.
        """
        c = cells
        tpn = cfg.tpn
        cap = cfg.cap_at(tpn)
        write_banks(
            c, config_words(cfg, tpn, False, L.FLAG_UPSTREAM if upstream else 0), c.load(L.CFG_SEQ)
        )
        initial = (
            0
            if upstream
            else cap
            if initial_ops is None
            else min(cap, int(initial_ops * cfg.cost_at(tpn)))
        )
        head = (base + initial) & MASK64
        c.store(L.TAIL, base & MASK64)
        c.store(L.HEAD, head)
        c.store(L.INFLIGHT, 0)  # capped mode: ops granted (or about to be) and not yet released
        c.store(L.SNAP_HEAD, head)
        c.store(L.SNAP_TAIL, base & MASK64)
        leave_words(c, (), head, base & MASK64)  # no queue: no record read
        c.store(L.REPL_TS, now_ns)
        c.store(L.WAIT, 0)

    # -- the four Seastar operations -----------------------------------------------

    def grab(self, tokens: int, grants: int, ops: int) -> Optional[int]:
        """Take ``tokens``, queueing as needed: None if granted at once, else the ticket to wait for.

        One composite of the cells.  Granted at once, ``ops`` are added to the
        counter word ``grants``; a ticket's ops are the caller's to count once
        the head covers it.  Raises ``QueueFullError`` (taking nothing) when
        the queue would hold more than ``MAX_QUEUE_TOKENS``.
        """
        ticket = self.cells.grab(L.TAIL, L.HEAD, tokens, grants, ops)
        if ticket is False:
            raise QueueFullError(tokens, self.tpn)
        return ticket  # type: ignore[return-value]

    def grabber(
        self, snap: Snapshot, grants: int, recs: Optional[Tuple[int, ...]] = None
    ) -> Callable[[], GrabResult]:
        """The acquire fast path for one op, bound once: ``grab`` priced under ``snap``.

        The callable answers False, touching nothing, once the config is no
        longer ``snap``'s (or the queue is full): the caller then takes the
        slow path; bound to ``recs`` (records' LEN offsets) also when it would queue with all in use.
        """
        return self.cells.grabber(
            L.CFG_SEQ,
            snap.seq,
            L.TAIL,
            L.HEAD,
            snap.cost,
            grants,
            1,
            *([] if recs is None else [recs]),
        )

    def gate(
        self, snap: Snapshot, grants: int, ops: int = 1, recs: Optional[Tuple[int, ...]] = None
    ) -> Any:
        """The try and timed-grab fast paths for one op, bound once under ``snap`` (see ``composites.Gate``).

        Its calls answer None, touching nothing, once the config is no longer
        ``snap``'s or when they cannot decide: the caller takes the slow path.
        A grant adds ``ops`` to ``grants`` (0: the caller counts it later).
        """
        assert snap.config is not None
        # (no ceiling word to bound: a capped limiter has no gate, so HEAD stands in for it); with
        # recs, grab_within queues only holding one of them (else it answers None: undecided)
        args = (
            L.CFG_SEQ,
            snap.seq,
            L.TAIL,
            L.HEAD,
            L.HEAD,
            L.REPL_TS,
            grants,
            snap.cost,
            ops,
            snap.tpn,
            math.ceil(snap.config.ratio),
            False,
            snap.max_reserved_ns,
        )
        return self.cells.gate(*args, recs, self.fences.hint)  # (queued behind a fence: undecided)

    def waiter(self, snap: Snapshot, grants: int, waiting: Optional[int], slack_ns: int) -> Any:
        """A ticket's whole wait as one native call, bound once under ``snap`` (None: wait in Python).

        Only the native backend has one (``_native.c``, WAITER): it loops without the GIL over
        what ``acquisition.Request`` does for a ticket -- covered? else sleep to ``due_ns``,
        ``replenish`` and look again -- for the configs whose replenish it mirrors: fed by the
        clock, not stopped, without catch-up or capped release.  ``wait(ticket, ops, until_ns,
        count_waiting)`` (counting the caller in the word ``waiting`` meanwhile, if asked) answers flags (``WAIT_GRANTED``, ``WAIT_NUDGE``, ``WAIT_BURN``), and returns at once
        when the config is no longer ``snap``'s.
        """
        if (
            snap.config
            and snap.upstream
            and not (snap.time_fed or snap.stopped or snap.capped or snap.open)
        ):
            return (
                self.cells.fed_waiter(  # hierarchical mode (fed_wait); None on the atomics backend
                    L.CFG_SEQ,
                    snap.seq,
                    L.HEAD,
                    L.LEASE,
                    grants,
                    waiting,
                    L.UP_WAKE,
                    L.UP_NEXT_NS,
                    snap.cost,
                    snap.tpn,
                    fed_wait.GRACE_NS,
                )
            )
        if (
            snap.config is None
            or snap.stopped
            or not snap.time_fed
            or snap.upstream
            or snap.catch_up
            or snap.capped
        ):
            return None
        return self.cells.waiter(  # None on the atomics backend
            WAITER_WORDS,
            snap.seq,
            grants,
            waiting,
            snap.tpn,
            snap.cap,
            slack_ns,
            self._record_lens(),
            self.fences.args,
        )

    def replenish(self) -> int:
        """Convert the time since the last replenish into tokens; return how many were added.

        Safe at any moment (invariant 2), hence twice: one that added over a quarter of the
        capacity claims again at once (a few ns), so the next clamps against the head it left
        (invariant 3) and may come a capacity late, not a capacity less this interval, unharmed.
        So does one that brought the head to the clamp's limit (``cut_short``): it stays at that
        boundary (a request's end, the tail) until a snapshot is taken there; and one that
        granted the request the clamp words name (``clamp.left_named``).
        """
        if (claim := self.claim()) is None:
            return 0
        added = self.apply(claim)
        if (added * 4 > self.snap.cap or self.cut_short) and (claim := self.claim()) is not None:
            added += self.apply(claim)
        return added

    def claim(self) -> Optional[Tuple[int, int, int, Snapshot, bool, int]]:
        """First half of ``replenish``: claim ``[REPL_TS, now]`` and leave the next snapshot.

        Returns ``(head, limit, tokens, snap, queued, catch_limit)`` for ``apply`` (``queued``:
        callers queued when the interval began; ``catch_limit``: the limit of catch-up tokens),
        or None when nothing elapsed or another process claimed the interval first.  Rovers are
        read before the clock: the snapshot left here is never newer than the interval's end
        (invariant 3).  The config is re-read first (one load when unchanged): the clamp uses
        the capacity in force, never one cached before a ``set_rate``.
        """
        c = self.cells
        self.refresh()
        snap = self.snap
        ts = c.load(L.REPL_TS)
        snap_head = c.load(L.SNAP_HEAD)
        snap_tail = c.load(L.SNAP_TAIL)
        base, end, nxt = c.load(L.SNAP_BASE), c.load(L.SNAP_END), c.load(L.SNAP_NEXT)
        head = c.load(L.HEAD)
        tail = c.load(L.TAIL)
        now = self.clock()
        elapsed = now - ts
        if elapsed < 0:
            # REPL_TS was read before the clock, and every value stored there is a reading of the
            # same (system-wide, monotonic) clock: one ahead of ours is corrupt.  Restart the
            # clock at now, granting nothing for the unknown past, instead of waiting for it.
            c.cas(L.REPL_TS, ts, now)
            return None
        if elapsed == 0:
            return None
        extra = elapsed * snap.tpn
        limit = clamp_limit(base, end, nxt, snap.cap, head, tail)
        catch_limit = (
            clamp_limit(base, end, nxt, snap.cap + snap.burst_pool, head, tail)
            if snap.catch_up
            else limit
        )
        # the reservations' fences in force for [ts, now], read after the words, before the claim:
        # no further than a fence (the time it stops is lost: counted starved), and none of the
        # time a reservation the head runs late for owns (catch-up none either)
        fence = self.fences.scan(ts, now, snap.tpn, head)
        if fence is not None:
            at = (head + fence[0]) & MASK64
            limit, catch_limit = behind(limit, at), behind(catch_limit, at)
            view = claim_of(
                ts,
                now,
                head,
                tail,
                (base, end, nxt),
                snap.tpn,
                snap.cap,
                snap.cap + snap.burst_pool,
            )
            owned = self.fences.reserved(view, self._callers(head, tail))
            if owned > 0:
                extra, catch_limit = max(0, extra - owned), limit
        if not c.cas(L.REPL_TS, ts, now):
            return None
        c.store(L.SNAP_HEAD, head)
        c.store(L.SNAP_TAIL, tail)
        if not clamp_kept(base, end, nxt, head, tail):
            leave_words(
                c, self._record_lens(), head, tail
            )  # the records are read only with callers queued
        return head, limit, extra, snap, diff(snap_tail, snap_head) > 0, catch_limit

    def apply(self, claim: Tuple[int, int, int, Snapshot, bool, int]) -> int:
        """Second half of ``replenish``: add a claimed interval's tokens, clamped (invariant 1).

        With catch-up (ratio > 1), tokens that do not fit go to the waiting
        pool instead of being dropped, and each replenish moves up to
        ``(ratio - 1)`` times its own tokens back from the waiting pool, into
        a burst room of ``capacity * (ratio - 1)`` above the usual limit
        (counted, like it, from the start of the request the head stands in):
        the catch-up rate is normalised to the time each fill covers, so ten fills
        of 0.1 ms catch up exactly as much as one of 1 ms.  While stopped, the
        interval's time is dropped (a pause is not "behind schedule"); so it is
        in hierarchical mode, where tokens come from leases (``add``).
        """
        head, limit, extra, snap, queued, catch_limit = claim
        self.cut_short = False
        if snap.stopped or not snap.time_fed:
            return 0
        c = self.cells
        taken = take_some(c, L.WAIT, int(extra * (snap.config.ratio - 1.0))) if snap.catch_up else 0
        while True:
            add = max(0, min(extra, diff(limit, head)))
            catch = max(0, min(taken, diff(catch_limit, (head + add) & MASK64)))
            total = add + catch
            if total <= 0 or c.cas(L.HEAD, head, (head + total) & MASK64):
                break
            head = c.load(L.HEAD)  # another interval landed first: add ours on top, same clamp
        after = (
            head + add
        ) & MASK64  # at the clamp's limit, or past the named request: claim again
        self.cut_short = 0 < add and (diff(limit, after) == 0 or left_named(c, after))
        owed = (
            min(extra - add, diff(c.load(L.TAIL), (head + add) & MASK64))
            if queued and add < extra
            else 0
        )
        if (
            owed >= snap.tpn
        ):  # clamped while callers queued throughout: time owed them, starved (lost
            c.fetch_add(
                L.STARVED_NS, owed // snap.tpn
            )  # or deferred); whole ns, never over-counted
        if snap.catch_up:
            self._put_wait(extra - add + taken - catch, snap)  # unusable time now: behind schedule
        if total > 0 and c.load(L.CFG_SEQ) != snap.seq:
            self.burn_late_add()
        return total

    def burn_late_add(self) -> int:
        """An add that raced a config change (its claim priced under the old one): burn down to what
        the config in force allows (``burn_to``), the burns of those who loaded it having maybe run
        before the add.  The tokens taken."""
        self.refresh()
        return self.burn_to(self.snap)

    def burn_to(self, snap: Snapshot) -> int:
        """Take the tokens beyond what ``snap``'s config allows: its capacity (and catch-up room),
        nothing while stopped.  The tokens taken.

        Every process does it when it loads a config it had not seen (``load_config``), the
        writer too, so a change is whole once anyone acts on it, even if its writer died right
        after publishing; it takes nothing when the bucket is within bounds.  It stops once the
        config is no longer ``snap``'s: the newer one's loaders burn for it.
        """
        keep = 0 if snap.stopped else snap.cap + snap.burst_pool
        return self.burn(keep, snap.seq)

    def _put_wait(self, amount: int, snap: Snapshot) -> None:
        c = self.cells
        while amount > 0:
            w = c.load(L.WAIT)
            new = min(w + amount, snap.wait_cap)
            if new <= w or c.cas(L.WAIT, w, new):
                return

    def burn(self, keep: int = 0, seq: Optional[int] = None) -> int:
        """Take every available token beyond ``keep`` (CAS on the tail); return how many were taken.

        Never touches queued tickets: when the tail is ahead of the head there is
        nothing available and nothing is done.  With ``seq``, only while ``CFG_SEQ`` holds it.
        """
        c = self.cells
        while True:
            tail = c.load(L.TAIL)
            excess = diff(c.load(L.HEAD), tail) - keep
            if excess <= 0 or (seq is not None and c.load(L.CFG_SEQ) != seq):
                return 0
            if c.cas(L.TAIL, tail, (tail + excess) & MASK64):
                return excess

    def set_stopped(self, stopped: bool, reset: bool = False) -> None:
        """``stop``: no time accrues and no token is granted until ``start``.

        Both restart the clock at now, before the flag changes (a claim of the
        paused time is made while stopped, and adds nothing), so the paused time
        is neither granted at once nor counted as behind schedule; then both
        empty the bucket, and ``reset`` the waiting pool too (``restart``).
        """
        c = self.cells
        now = self.clock()
        while True:
            ts = c.load(L.REPL_TS)
            if ts >= now or c.cas(L.REPL_TS, ts, now):
                break
        self.set_flags(L.FLAG_STOPPED, L.FLAG_STOPPED if stopped else 0)
        self.burn()
        if reset:
            c.store(L.WAIT, 0)

    def add(self, tokens: int, head_then: Optional[int] = None) -> int:
        """Give tokens to the head (a lease, a ``settle`` refund, ``give_back``), never beyond
        ``tail + capacity``, nor past what a reservation's fence protects (``Schedule.refund_to``).

        Returns how many were added (the rest do not fit and are dropped).
        The tail only grows, so a clamp against a tail read before the CAS is
        never looser than the true one.  With ``head_then`` (``give_back``),
        the head's gain since, read with it each try, counts against ``tokens``.
        A fence whose promise has passed is lifted first by a claim (one whose
        interval starts after its DUE reads it no more), so it cuts nothing.
        While stopped (the config in force, read here) nothing is added, as a replenish adds
        nothing: ``stop`` pauses every acquirer; an add that raced a change of the config is
        burned down to what the one in force allows (``burn_late_add``), a stop's to nothing.
        """
        c = self.cells
        self.refresh()
        seq = self.snap.seq
        if self.snap.stopped:
            return 0
        for _ in range(3):
            ts = c.load(L.REPL_TS)
            now = self.clock()
            if not any(
                due <= now
                for _, _, due in self.fences.held(ts, max(ts, now), self.snap.tpn, c.load(L.HEAD))
            ):
                break
            self.replenish()
        # The clamp words let the next claim bring the head up to a capacity past the snapshot's
        # head only: tokens that take it past that leave the next claim adding nothing, its whole
        # interval lost (while callers queue: a refund over debt, a lease).  So a refund that
        # goes past it claims the time so far first, and takes a snapshot at the head it left
        # just after: a few ns lost, not the time since the last claim.  (Not ``give_back``:
        # there the head's gain meanwhile counts against the tokens.)
        past = head_then is None and self.snap.time_fed
        if past:
            head = c.load(L.HEAD)
            past = diff((head + tokens) & MASK64, self.clamp_limit_at(head, self.snap.cap)) > 0
            if past:
                self.replenish()
        while True:
            head = c.load(L.HEAD)
            tail = c.load(L.TAIL)
            want = tokens if head_then is None else tokens - max(0, diff(head, head_then))
            if want <= 0:
                return 0
            to = behind((tail + self.cap) & MASK64, (head + want) & MASK64)
            if head_then is not None:
                # tokens held while their request waited, covered by time the head accrued: a
                # capacity of it at most, counted from the start of the request the head stands in
                # (``fill_limit``), as a bucket that nobody took them from would have held
                fill = fill_limit(c, self._record_lens(), head, tail, self.cap)
                if fill is None:
                    continue  # (the head moved while the records were read)
                to = behind(to, fill)
            if diff(to, head) <= 0:
                return 0
            to, passes = self.refund_to(head, tail, to)
            add = diff(to, head)
            if add <= 0:
                return 0
            # each fence passed moves first: the head never stands past a LIMIT a claim reads
            if not all(self.fences.pass_over(*p) for p in passes):
                continue
            if c.cas(L.HEAD, head, to):
                fed_wait.wake(c, fed_mask(head, to, self.snap.cost))  # the waiters it serves
                if c.load(L.CFG_SEQ) != seq:
                    self.burn_late_add()
                if past:
                    self.replenish()
                return add

    def charge(self, tokens: int, grants: int, ops: int) -> None:
        """Queue ``tokens`` no one waits for (``settle``'s charge: debt later callers wait for),
        ``ops`` counted in ``grants`` at once if covered; then the reservation fences before the
        debt move on past it where nothing granted lies between (``Schedule.over_debt``): it
        grants no one.  The part the head
        already covered is a grant, and counts as any.  A charge killed before its fences move
        leaves them where they were: time lost, never a grant."""
        ticket = self.grab(tokens, grants, ops)
        if ticket is None:
            return
        c = self.cells
        debt = min(tokens, max(0, diff(ticket, c.load(L.HEAD))))
        if debt > 0:
            for move in self.over_debt((ticket - debt) & MASK64, debt, c.load(L.TAIL)):
                self.fences.pass_over(*move)

    def forgive(self) -> int:
        """After the "open" fallback: drop the tickets left by callers it let through untaxed.

        While open, queued callers stop waiting and proceed; their tickets stay
        ahead of the head, and would make later callers wait for ops already
        granted.  Moving the head up to the tail covers them, and leaves
        nothing available.  (The head moves, never the tail: the tail never
        moves backwards, so no ticket range is ever handed out twice and the
        replenish snapshots stay lower bounds.)  Returns the tokens forgiven.
        """
        c = self.cells
        while True:
            tail = c.load(L.TAIL)
            head = c.load(L.HEAD)
            owed = diff(tail, head)
            if owed <= 0 or c.cas(L.HEAD, head, tail):
                if owed > 0:  # the tickets it covered: their waiters go
                    fed_wait.wake(c, FED_ALL)
                return max(0, owed)

    # -- capped mode: ops in flight, counted in ops --------------------------------------
    #
    # INFLIGHT counts ops admitted and not yet released.  An acquire is admitted (CAS, only while
    # INFLIGHT + n <= the capacity in ops) before it takes its tokens, and un-admitted if it then
    # takes none, so INFLIGHT is never below the ops granted and not released, and a grant never
    # takes it above the capacity in force.  Counting ops, not tokens, keeps the bound whatever
    # happens to the tokens: a set_rate that re-prices an op, a stop or restart that burns the
    # bucket, catch-up tokens above the usual limit.

    def admit(self, ops: int) -> bool:
        """Capped mode: count ``ops`` as in flight if the capacity (in ops) allows; False changes nothing."""
        return inflight.admit(self.cells, ops, self.snap.cap_ops, self.own_inflight)

    def unadmit(self, ops: int) -> None:
        """Undo an ``admit`` whose acquire took nothing."""
        inflight.release(self.cells, ops, self.own_inflight, self.inflights, False)

    def release(self, ops: int) -> None:
        """Capped mode: ``ops`` granted ops completed; beyond those in flight raises ValueError, changing nothing."""
        inflight.release(self.cells, ops, self.own_inflight, self.inflights, True)

    def in_flight(self) -> int:
        """Capped mode: ops admitted and not yet released."""
        return self.cells.load(L.INFLIGHT)

    # -- conditional grabs ---------------------------------------------------------

    def try_grab(self, tokens: int, grants: int, ops: int) -> bool:
        """Take ``tokens`` only if the head covers them now (adding ``ops`` to ``grants``); never queue.

        One composite of the cells.  A refusal changes nothing, and a try
        never jumps the queue: queued tickets are ahead of the head.
        """
        return self.cells.try_grab(L.TAIL, L.HEAD, tokens, grants, ops)

    def skip(self, start: int, end: int) -> Optional[int]:
        """The head jumps over ``[start, end)``, a range given back (``giveback.skip`` says why the bound
        holds): None while the head is before ``start`` or a fence holds it, else the tokens skipped (0: none)."""
        c = self.cells
        while True:
            head = c.load(L.HEAD)
            if diff(head, end) >= 0:
                return 0
            if diff(end, c.load(L.TAIL)) > 0 or diff(end, start) <= 0:
                return 0  # no ticket ever handed out (the tail only grows): a corrupt record
            if diff(head, start) < 0:
                return None
            to = self.fenced(
                head, end
            )  # up to a reservation's fence; the rest once it lifts (None till then)
            if diff(to, head) <= 0:
                return None
            if c.cas(L.HEAD, head, to):
                self.replenish()  # the next one then clamps against a head past the range (see giveback)
                return diff(to, head) if to == end else None

    def give_back(self, tokens: int, head_then: int) -> int:
        """Return ``tokens`` taken (and covered) when the head was at most ``head_then``, unused.

        Had they never been taken, every replenish since would have been
        clamped ``tokens`` lower, so what the head has gained since may be
        time that would have been dropped: only ``tokens`` minus that gain is
        returned (all if no replenish came between), never beyond ``tail +
        capacity``, the gain read again before every CAS (``add``): the head
        ends at most at ``max(head, head_then + tokens)``, a replenish landing
        meanwhile counted, never fuller than had they never been taken.
        """
        return self.add(tokens, head_then)

    def take_available(self, grants: int) -> int:
        """Take every whole op available now (``drain``), counted in ``grants``; return how many.

        Queued tickets are untouched.  Capped mode takes no more than the room
        among the ops in flight, and admits what it takes.
        """
        c = self.cells
        snap = self.snap
        while True:
            tail = c.load(L.TAIL)
            ops = diff(c.load(L.HEAD), tail) // snap.cost
            if snap.capped:  # no more than the room among the ops in flight
                ops = min(ops, snap.cap_ops - self.in_flight())
            if ops <= 0:
                return 0
            if snap.capped and not self.admit(ops):
                continue
            if c.cas(L.TAIL, tail, (tail + ops * snap.cost) & MASK64):
                c.fetch_add(grants, ops)
                return ops
            if snap.capped:
                self.unadmit(ops)

    # -- hierarchical mode: what waiters tell the filler, and what it tells them ---------------

    def mark_hungry(self, now_ns: int) -> None:
        """A caller found no token and took no ticket; the filler should lease."""
        self.cells.store(L.UP_HUNGRY, now_ns)

    def next_lease_ns(self) -> int:
        """When (CLOCK_MONOTONIC ns) the filler next expects tokens; 0 when it does not know."""
        return self.cells.load(L.UP_NEXT_NS)

    def take_within(
        self,
        tokens: int,
        max_wait_ns: float,
        recs: Optional[Tuple[int, ...]] = None,
        grants: int = 0,
        ops: int = 0,
        fence: Optional[FenceHold] = None,
    ) -> Tuple[Any, Optional[int]]:
        """Take ``tokens`` if their wait (``estimate_wait_ns``) is <= ``max_wait_ns``: the one CAS loop on the tail that may queue.

        Taking nothing: ``(REFUSED, None)`` when the wait exceeds a finite bound (not computable while stopped);
        ``QueueFullError`` beyond ``MAX_QUEUE_TOKENS``.  Without ``recs``: ``(ticket, None)``, maybe not yet covered.
        With ``recs`` (records' LEN offsets) it queues only holding a record, by ``words.claim_record``'s protocol
        (claimed, the ticket written in it, before the CAS: a process killed at any instant leaves every ticket it
        holds recorded but for one killed between that CAS and the next store): ``(NO_RECORD, None)``, taking nothing,
        when all are in use; ``(ticket, rec)`` queued, recorded at ``rec`` with its exact length; ``(None, None)``
        covered after all, ``ops`` added to ``grants``.  A record claimed and not needed is freed again.  The claim,
        the CAS and the LEN store are one operation of the cells (``Cells.take_tail``), which leaves the queued
        ticket in ``cells.handed()``: its caller takes it from there once it has stored it (``Request._hold``), and
        a handler raising before that finds it there (``Request.end`` gives it back: ``give_back_handed``).
        With ``fence`` (a reservation's ``fences.FenceHold``) its fence is stored before the CAS, or ``(NO_FENCE,
        None)`` with every fence record in use, taking nothing (``FenceHold.put``).
        """
        c, snap = self.cells, self.snap
        taken = False
        try:
            while True:
                tail = c.load(L.TAIL)
                new = (tail + tokens) & MASK64
                short = diff(new, c.load(L.HEAD))
                if short > MAX_QUEUE:
                    raise QueueFullError(tokens, snap.tpn)
                if (
                    short > 0
                    and max_wait_ns != float("inf")
                    and (snap.stopped or self.wait_ns(new, short, snap) > max_wait_ns)
                ):
                    return REFUSED, None
                if (
                    fence is not None
                    and (short > 0 or fence.want is not None)
                    and not fence.put(self, new, tokens, snap)
                ):
                    return NO_FENCE, None  # (its LIMIT, then DUE, stored before the CAS)
                if (
                    fence is not None
                    and fence.promise is not None
                    and fence.want is None
                    and fence.promise - self.clock() > max_wait_ns
                ):
                    # the promise, not the estimate, is what the reservation is told: one later
                    # than the bound is refused too (the head moves a capacity at most per replenish)
                    return REFUSED, None
                if recs is None:
                    got: Any = c.cas(L.TAIL, tail, new)
                else:
                    # the record's claim, the CAS, its LEN (or its release, and the grant counted)
                    # in one operation of the cells, the queued ticket left in ``handed()``: a
                    # handler raising before the request stores it finds it there (``Request.end``)
                    got = c.take_tail(L.TAIL, L.HEAD, grants, recs, tail, new, tokens, ops)
                    if got is not False and got == 0:
                        return NO_RECORD, None
                if got is not False:
                    break
                if fence is not None and fence.rec is not None:
                    # its ticket was not taken: freed at once, not left in force while the next
                    # try computes its promise (a LIMIT the head may be past already, another
                    # caller's CAS moved the tail: every promise made meanwhile would count
                    # from it, seconds late, and their fences hold the head that long)
                    fence.release(self.fences)
            taken = True
            if fence is not None and short <= 0 and fence.want is None:
                fence.release(
                    self.fences
                )  # a reservation covered at once: used now, fenced by nothing
            if recs is not None and got is None:  # covered after all: granted (counted)
                return None, None
            # queued: recorded at ``got`` (its exact length)
            return new, None if got is True else got
        finally:
            if (
                fence is not None and not taken
            ):  # a fence stored and not needed (refused): free again
                fence.release(self.fences)
