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

1. ``HEAD <= min(head, tail) + capacity`` for the head and tail as they were at
   the start of the interval being replenished.  Hence the bucket never holds
   more than ``capacity``, and in any window of length T the grants never
   exceed ``rate*T + capacity``.
2. Each instant of time is converted to tokens at most once: an interval
   ``[REPL_TS, now]`` is claimed by a CAS on ``REPL_TS`` before its tokens are
   added, so any number of processes may call ``replenish`` at any moment.
3. A replenisher records the head and tail it read *before* reading the clock
   (``SNAP_HEAD``, ``SNAP_TAIL``); the next replenisher clamps against those.
   A replenisher that was delayed between its claim and its add therefore can
   never make tokens of an old interval spendable on top of a fresh bucket:
   the clamp is always relative to the oldest state the interval could have
   seen.  Snapshots only ever under-estimate, which can lose a little time
   (never over-grant).

Everything here is pure arithmetic on cells and an injected clock, so it is
tested with a fake clock over simulated hours.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

from . import layout as L
from .cells import MASK64, Cells
from .config import MAX_SPAN_TOKENS as MAX_SPAN
from .config import MAX_QUEUE_TOKENS as MAX_QUEUE
from .config import MAX_TPN, NS_PER_S, Config
from .errors import ConfigWriterTakenOver, QueueFullError, SegmentError

SIGN = 1 << 63
WRAP = 1 << 64




def diff(a: int, b: int) -> int:
    """``a - b`` for wrapping 64-bit rovers, as a signed number."""
    d = (a - b) & MASK64
    return d - WRAP if d & SIGN else d


def behind(a: int, b: int) -> int:
    """Whichever of two rovers is behind the other."""
    return a if diff(a, b) <= 0 else b


INF_BITS = L.f2u(float("inf"))
_KNOWN_FLAGS = L.FLAG_CAPPED | L.FLAG_STOPPED | L.UPSTREAM_FLAGS
#: The filler replenishes this often (ns): the pace a queued head can count on (see estimate_wait_ns).
FILL_NS = 1_000_000
#: A config writer that holds the sequence lock longer than this is presumed dead (ns).
CONFIG_LOCK_TIMEOUT_NS = 200_000_000


def _opt(x: Optional[float]) -> int:
    return INF_BITS if x is None else L.f2u(x)


def _unopt(u: int) -> Optional[float]:
    v = L.u2f(u)
    return None if v == float("inf") else v


@dataclass(frozen=True)
class Snapshot:
    """One process's view of the live config, derived once per change and never mutated."""

    seq: int
    tpn: int  #: tokens per nanosecond (fixed at creation)
    cost: int  #: tokens per op
    cap: int  #: capacity, tokens
    cap_ops: int  #: capacity, whole ops (the capped-mode in-flight bound)
    capped: bool
    stopped: bool
    upstream_flags: int
    upstream: bool
    time_fed: bool
    open: bool
    config: Optional[Config]
    burst_pool: int
    catch_up: bool
    wait_cap: int
    max_reserved_ns: float


_NO_SNAPSHOT = Snapshot(-1, 1, 1, 1, 1, False, False, 0, False, True, False, None, 0, False, 0, 0.0)


class Bucket:
    """Rover arithmetic on one segment.  ``clock`` returns CLOCK_MONOTONIC nanoseconds."""

    def __init__(self, cells: Cells, clock: Callable[[], int] = time.monotonic_ns) -> None:
        self.cells = cells
        self.clock = clock
        self.snap = _NO_SNAPSHOT
        self.load_config()

    # -- configuration ----------------------------------------------------------
    #
    # The config is published under a sequence lock (CFG_SEQ odd while a writer works, and a
    # writer silent for 200 ms is taken over) into two banks, each stamped with the generation
    # it is published as (the even CFG_SEQ) and a checksum over both.  A writer writes the
    # backup bank, checks that it still holds the lock, then writes the live bank, and publishes
    # by one CAS of CFG_SEQ from its lock value: a writer that was taken over fails there.  A
    # stalled writer that resumes can scribble over at most one bank (it checks the lock between
    # the two), and its words can never pass the checksum for the generation in force, so
    # readers take the other.  Readers take the first bank valid for the even CFG_SEQ they saw
    # before and after; with none (an interrupted writer published nothing new) or while a
    # writer is presumed dead, the valid bank of the highest generation not above it.

    def load_config(self) -> None:
        c = self.cells
        deadline = None
        while True:
            seq = c.load(L.CFG_SEQ)
            if seq & 1:
                now = time.monotonic_ns()
                deadline = deadline or now + CONFIG_LOCK_TIMEOUT_NS
                if now < deadline:
                    time.sleep(0.0005)
                    continue
            vals = self._published_values(seq)
            if c.load(L.CFG_SEQ) == seq or deadline is not None:
                break
        if vals is None:
            raise SegmentError("segment is corrupt: no copy of its configuration passes its checksum")
        rate, per, burst, tpn, cost, cap, flags, ratio, max_reserved, max_behind = vals
        try:  # words from a corrupt or foreign segment must not reach the arithmetic
            cfg = Config.make(
                L.u2f(rate), L.u2f(per), L.u2f(burst), bool(flags & L.FLAG_CAPPED), L.u2f(ratio),
                _unopt(max_reserved), _unopt(max_behind),
            )
        except (TypeError, ValueError) as e:
            raise SegmentError(f"segment is corrupt: its configuration is invalid ({e})") from None
        if not 1 <= tpn <= MAX_TPN or not 1 <= cost <= MAX_SPAN or not 1 <= cap <= MAX_SPAN or flags & ~_KNOWN_FLAGS:
            raise SegmentError(
                f"segment is corrupt: token unit {tpn}, op cost {cost}, capacity {cap} or flags {flags:#x} out of range"
            )
        mb = cfg.max_behind
        mr = cfg.max_reserved
        # One immutable snapshot, swapped by reference: a thread that reads ``self.snap`` once
        # (the filler, an acquire) never combines the new sequence number with the old price.
        self.snap = Snapshot(
            seq=seq,
            tpn=tpn,
            cost=cost,
            cap=cap,
            cap_ops=max(1, cap // cost),
            capped=bool(flags & L.FLAG_CAPPED),
            stopped=bool(flags & L.FLAG_STOPPED),
            upstream_flags=flags & L.UPSTREAM_FLAGS,
            upstream=bool(flags & L.FLAG_UPSTREAM),
            time_fed=not flags & L.FLAG_UPSTREAM or bool(flags & L.FLAG_FALLBACK_LOCAL),
            open=bool(flags & L.FLAG_UPSTREAM) and bool(flags & L.FLAG_FALLBACK_OPEN),
            config=cfg,
            burst_pool=cfg.burst_pool_at(tpn),
            catch_up=cfg.ratio > 1.0,
            wait_cap=MAX_SPAN if mb is None else int(mb * NS_PER_S * tpn),
            max_reserved_ns=float("inf") if mr is None else mr * NS_PER_S,
        )

    # Single fields of the current snapshot (for code that needs only one of them).
    seq = property(lambda self: self.snap.seq)
    tpn = property(lambda self: self.snap.tpn)
    cost = property(lambda self: self.snap.cost)
    cap = property(lambda self: self.snap.cap)
    cap_ops = property(lambda self: self.snap.cap_ops)
    capped = property(lambda self: self.snap.capped)
    stopped = property(lambda self: self.snap.stopped)
    upstream_flags = property(lambda self: self.snap.upstream_flags)
    upstream = property(lambda self: self.snap.upstream)
    time_fed = property(lambda self: self.snap.time_fed)
    open = property(lambda self: self.snap.open)
    config = property(lambda self: self.snap.config)
    burst_pool = property(lambda self: self.snap.burst_pool)
    catch_up = property(lambda self: self.snap.catch_up)
    wait_cap = property(lambda self: self.snap.wait_cap)
    max_reserved_ns = property(lambda self: self.snap.max_reserved_ns)

    def _published_values(self, seq: int) -> Optional[List[int]]:
        """The config words published as of ``seq``: the first bank valid for it, else the newest older one."""
        banks = [
            self._read_bank(L.CFG_BANK, L.CFG_GEN, L.CFG_SUM),
            self._read_bank(L.CFG_BACKUP_BANK, L.CFG_BACKUP_GEN, L.CFG_BACKUP_SUM),
        ]
        valid = [(gen, vals) for gen, vals in banks if vals is not None and gen <= seq]
        exact = [vals for gen, vals in valid if gen == seq]
        if exact:
            return exact[0]
        return max(valid, key=lambda b: b[0])[1] if valid else None

    def _read_bank(self, offsets, gen_off: int, sum_off: int):
        """``(generation, values)`` of one bank; values None if its checksum does not hold."""
        c = self.cells
        gen = c.load(gen_off)
        vals = [c.load(off) for off in offsets]
        return gen, (vals if c.load(sum_off) == L.config_sum(gen, vals) else None)

    def refresh(self) -> bool:
        """Reload the config if another process changed it; True if it did."""
        if self.cells.load(L.CFG_SEQ) != self.snap.seq:
            self.load_config()
            return True
        return False

    @staticmethod
    def config_words(cfg: Config, tpn: int, stopped: bool, upstream_flags: int) -> List[Tuple[int, int]]:
        """Every config word of ``cfg`` at the segment's token unit ``tpn``, computed before any is written.

        Raises ValueError (naming the parameter) if a quantity does not fit at
        ``tpn``: a config is validated at the unit it will be stored in, never
        at the unit it would have chosen for itself.
        """
        cfg.check_at(tpn)
        flags = (L.FLAG_CAPPED if cfg.capped else 0) | (L.FLAG_STOPPED if stopped else 0) | upstream_flags
        return [
            (L.CFG_RATE, L.f2u(cfg.rate)),
            (L.CFG_PER, L.f2u(cfg.per)),
            (L.CFG_BURST, L.f2u(cfg.burst)),
            (L.CFG_TPN, tpn),
            (L.CFG_COST, cfg.cost_at(tpn)),
            (L.CFG_CAP, cfg.cap_at(tpn)),
            (L.CFG_FLAGS, flags),
            (L.CFG_RATIO, L.f2u(cfg.ratio)),
            (L.CFG_MAX_RESERVED, _opt(cfg.max_reserved)),
            (L.CFG_MAX_BEHIND, _opt(cfg.max_behind)),
        ]

    @staticmethod
    def _write_banks(cells: Cells, words: List[Tuple[int, int]], gen: int, lock: Optional[int] = None) -> bool:
        """Write the backup bank, then (if CFG_SEQ still holds ``lock``) the live bank, both for ``gen``.

        Returns False, leaving the live bank alone, if the lock was taken over.
        """
        vals = [v for _, v in words]
        total = L.config_sum(gen, vals)
        for off, v in zip(L.CFG_BACKUP_BANK, vals):
            cells.store(off, v)
        cells.store(L.CFG_BACKUP_GEN, gen)
        cells.store(L.CFG_BACKUP_SUM, total)
        if lock is not None and cells.load(L.CFG_SEQ) != lock:
            return False
        for off, v in words:
            cells.store(off, v)
        cells.store(L.CFG_GEN, gen)
        cells.store(L.CFG_SUM, total)
        return True

    def publish(self, cfg: Config, stopped: Optional[bool] = None, upstream_flags: Optional[int] = None) -> None:
        """Replace the live config (seen by every attached process at its next operation).

        The token unit (tpn) stays the one chosen at creation: rovers and the
        clock keep their meaning, queued tickets keep their place and their
        schedule time, and only new grabs pay the new price per op.  The new
        config is validated at that unit and every word is computed before the
        lock is taken: a refused config changes nothing.
        """
        if cfg.capped != self.capped:
            raise ValueError("capped cannot be changed on a live limiter (unlink and re-create it)")
        tpn = self.tpn

        def words(c: Cells) -> List[Tuple[int, int]]:
            flags = c.load(L.CFG_FLAGS)
            st = bool(flags & L.FLAG_STOPPED) if stopped is None else stopped
            up = flags & L.UPSTREAM_FLAGS if upstream_flags is None else upstream_flags
            return self.config_words(cfg, tpn, st, up)

        words(self.cells)  # validate before taking the lock: a refused config writes nothing
        self._under_config_lock(words)
        self.load_config()
        self.burn(keep=self.cap)

    def set_upstream_flags(self, upstream_flags: int) -> None:
        """Hierarchical mode: switch the fallback flags, and nothing else.

        Every other word stays as the segment holds it under the lock, so a
        ``set_rate`` by any process while the filler was talking to Redis is
        never undone by a config the filler read before.
        """

        def words(c: Cells) -> List[Tuple[int, int]]:
            vals = self._published_values(c.load(L.CFG_SEQ))
            if vals is None:
                raise SegmentError("segment is corrupt: no copy of its configuration passes its checksum")
            out = list(zip(L.CFG_BANK, vals))
            i = L.CFG_BANK.index(L.CFG_FLAGS)
            out[i] = (L.CFG_FLAGS, (vals[i] & ~L.UPSTREAM_FLAGS) | upstream_flags)
            return out

        self._under_config_lock(words)
        self.load_config()

    def _under_config_lock(self, words: Callable[[Cells], List[Tuple[int, int]]]) -> None:
        """Take the config seqlock (CFG_SEQ odd), write ``words(cells)`` into both banks, publish by CAS.

        Raises ``ConfigWriterTakenOver`` if this writer stalled past the lock's
        timeout and another took over: then nothing of ours is published.
        """
        c = self.cells
        since = time.monotonic_ns()
        while True:
            seq = c.load(L.CFG_SEQ)
            if seq & 1 and time.monotonic_ns() - since < CONFIG_LOCK_TIMEOUT_NS:
                time.sleep(0.0005)
                continue
            # even: take the lock; odd for too long: its writer is presumed dead, take it over
            lock = seq + 1 if not seq & 1 else seq + 2
            if c.cas(L.CFG_SEQ, seq, lock):
                break
        written = False
        try:
            written = self._write_banks(c, words(c), lock + 1, lock)
        finally:
            # Publish by CAS from our lock value: if we were taken over, ours is not the config.
            # (Interrupted half-way, we publish anyway: readers then find the old config valid.)
            published = c.cas(L.CFG_SEQ, lock, lock + 1)
        if not (written and published):
            self.load_config()
            raise ConfigWriterTakenOver(
                "this config change was abandoned: the writer stalled longer than the lock's "
                f"{CONFIG_LOCK_TIMEOUT_NS // 1_000_000} ms and another took over; apply it again"
            )

    @staticmethod
    def initialise(
        cells: Cells, cfg: Config, now_ns: int, initial_ops: Optional[float] = None, base: int = 0, upstream: bool = False
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
        Bucket._write_banks(c, Bucket.config_words(cfg, tpn, False, L.FLAG_UPSTREAM if upstream else 0), c.load(L.CFG_SEQ))
        initial = cap if initial_ops is None else min(cap, int(initial_ops * cfg.cost_at(tpn)))
        if upstream:
            initial = 0
        head = (base + initial) & MASK64
        c.store(L.TAIL, base & MASK64)
        c.store(L.HEAD, head)
        c.store(L.INFLIGHT, 0)  # capped mode: ops granted (or about to be) and not yet released
        c.store(L.SNAP_HEAD, head)
        c.store(L.SNAP_TAIL, base & MASK64)
        c.store(L.REPL_TS, now_ns)
        c.store(L.WAIT, 0)

    # -- the four Seastar operations -----------------------------------------------

    def grab(self, tokens: int) -> int:
        """Take ``tokens``, queueing as needed; return the ticket to wait for.

        Raises ``QueueFullError`` (taking nothing) when the queue would hold
        more than ``MAX_QUEUE_TOKENS``.
        """
        c = self.cells
        while True:
            tail = c.load(L.TAIL)
            new = (tail + tokens) & MASK64
            if diff(new, c.load(L.HEAD)) > MAX_QUEUE:
                raise QueueFullError(tokens, self.tpn)
            if c.cas(L.TAIL, tail, new):
                return new

    def deficiency(self, ticket: int) -> int:
        """Tokens the grab holding ``ticket`` is still owed (0 once it may proceed)."""
        return max(0, diff(ticket, self.cells.load(L.HEAD)))

    def replenish(self) -> int:
        """Convert the time since the last replenish into tokens; return how many were added.

        Safe from any process at any moment (invariant 2).
        """
        claim = self.claim()
        return self.apply(claim) if claim is not None else 0

    def claim(self) -> Optional[Tuple[int, int, int, Snapshot]]:
        """First half of ``replenish``: claim ``[REPL_TS, now]`` and leave the next snapshot.

        Returns ``(head, limit, tokens, snap)`` for ``apply``, or None when
        nothing elapsed or another process claimed the interval first.  The
        rovers are read before the clock, so the snapshot left here is never
        newer than the instant the interval ends (invariant 3).  The config is
        re-read first (one load when unchanged): the clamp uses the capacity in
        force, never one cached before another process's ``set_rate``.
        """
        c = self.cells
        self.refresh()
        snap = self.snap
        ts = c.load(L.REPL_TS)
        snap_head = c.load(L.SNAP_HEAD)
        snap_tail = c.load(L.SNAP_TAIL)
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
        if elapsed == 0 or not c.cas(L.REPL_TS, ts, now):
            return None
        c.store(L.SNAP_HEAD, head)
        c.store(L.SNAP_TAIL, tail)
        limit = behind(snap_head, snap_tail) + snap.cap
        return head, limit & MASK64, elapsed * snap.tpn, snap

    def apply(self, claim: Tuple[int, int, int, Snapshot]) -> int:
        """Second half of ``replenish``: add a claimed interval's tokens, clamped (invariant 1).

        With catch-up (ratio > 1), tokens that do not fit go to the waiting
        pool instead of being dropped, and each replenish moves up to
        ``(ratio - 1)`` times its own tokens back from the waiting pool, into
        a burst room of ``capacity * (ratio - 1)`` above the usual limit: the
        catch-up rate is normalised to the time each fill covers, so ten fills
        of 0.1 ms catch up exactly as much as one of 1 ms.  While stopped, the
        interval's time is dropped (a pause is not "behind schedule"); so it is
        in hierarchical mode, where tokens come from leases (``add``).
        """
        head, limit, extra, snap = claim
        if snap.stopped or not snap.time_fed:
            return 0
        c = self.cells
        taken = self._take_wait(int(extra * (snap.config.ratio - 1.0)), snap) if snap.catch_up else 0
        while True:
            add = max(0, min(extra, diff(limit, head)))
            catch = max(0, min(taken, diff((limit + snap.burst_pool) & MASK64, (head + add) & MASK64)))
            total = add + catch
            if total <= 0 or c.cas(L.HEAD, head, (head + total) & MASK64):
                break
            head = c.load(L.HEAD)  # another interval landed first: add ours on top, same clamp
        if snap.catch_up:
            self._put_wait(extra - add + taken - catch, snap)  # unusable time now: behind schedule
        if total > 0 and c.load(L.CFG_SEQ) != snap.seq:
            # The config changed between our clamp and our add: a capacity that shrank meanwhile
            # applies to our tokens too (the writer's own burn may have run before our add).
            self.refresh()
            self.burn(keep=self.snap.cap + self.snap.burst_pool)
        return total

    def _take_wait(self, want: int, snap: Snapshot) -> int:
        c = self.cells
        while want > 0:
            w = c.load(L.WAIT)
            take = min(w, want)
            if take <= 0 or c.cas(L.WAIT, w, w - take):
                return max(0, take)
        return 0

    def _put_wait(self, amount: int, snap: Snapshot) -> None:
        c = self.cells
        while amount > 0:
            w = c.load(L.WAIT)
            new = min(w + amount, snap.wait_cap)
            if new <= w or c.cas(L.WAIT, w, new):
                return

    def behind_ns(self) -> float:
        """How far behind schedule the limiter is (the waiting pool), in ns."""
        return self.cells.load(L.WAIT) / self.tpn

    def burn(self, keep: int = 0) -> int:
        """Take every available token beyond ``keep`` (CAS on the tail); return how many were taken.

        Never touches queued tickets: when the tail is ahead of the head there is
        nothing available and nothing is done.
        """
        c = self.cells
        while True:
            tail = c.load(L.TAIL)
            excess = diff(c.load(L.HEAD), tail) - keep
            if excess <= 0:
                return 0
            if c.cas(L.TAIL, tail, (tail + excess) & MASK64):
                return excess

    def set_stopped(self, stopped: bool, reset: bool = False) -> None:
        """``stop``: no time accrues and no token is granted until ``start``.

        Both restart the clock at now, so the paused time is neither granted at
        once nor counted as behind schedule; ``reset`` also empties the bucket
        and the waiting pool (``restart``).
        """
        self.publish(self.config, stopped=stopped)
        c = self.cells
        if stopped or reset:
            self.burn()
        if reset:
            c.store(L.WAIT, 0)
        now = self.clock()
        while True:
            ts = c.load(L.REPL_TS)
            if ts >= now or c.cas(L.REPL_TS, ts, now):
                break

    def add(self, tokens: int) -> int:
        """Hierarchical mode: add leased tokens to the head, never beyond ``tail + capacity``.

        Returns how many were added (the rest do not fit and are dropped).
        The tail only grows, so a clamp against a tail read before the CAS is
        never looser than the true one.
        """
        c = self.cells
        while True:
            head = c.load(L.HEAD)
            tail = c.load(L.TAIL)
            add = max(0, min(tokens, diff((tail + self.cap) & MASK64, head)))
            if add <= 0 or c.cas(L.HEAD, head, (head + add) & MASK64):
                return add

    def forgive(self) -> int:
        """After the "open" fallback: drop the tickets left by callers it let through untaxed.

        While open, queued callers stop waiting and proceed; their tickets stay
        ahead of the head, and would make later callers wait for ops already
        granted.  Moving the tail back to the head forgets them.  Returns the
        tokens forgiven.
        """
        c = self.cells
        while True:
            tail = c.load(L.TAIL)
            head = c.load(L.HEAD)
            owed = diff(tail, head)
            if owed <= 0 or c.cas(L.TAIL, tail, head):
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
        c = self.cells
        while True:
            cur = c.load(L.INFLIGHT)
            if cur + ops > self.snap.cap_ops:
                return False
            if c.cas(L.INFLIGHT, cur, cur + ops):
                return True

    def unadmit(self, ops: int) -> None:
        """Undo an ``admit`` whose acquire took nothing."""
        c = self.cells
        while True:
            cur = c.load(L.INFLIGHT)
            if c.cas(L.INFLIGHT, cur, max(0, cur - ops)):
                return

    def release(self, ops: int) -> None:
        """Capped mode: ``ops`` granted ops completed; beyond those in flight raises ValueError, changing nothing."""
        c = self.cells
        while True:
            cur = c.load(L.INFLIGHT)
            if ops > cur:
                raise ValueError(f"n must be at most the {cur} ops in flight (granted and not released), got {ops}")
            if c.cas(L.INFLIGHT, cur, cur - ops):
                return

    def in_flight(self) -> int:
        """Capped mode: ops admitted and not yet released."""
        return self.cells.load(L.INFLIGHT)

    # -- conditional grabs ---------------------------------------------------------

    def try_grab(self, tokens: int) -> Optional[int]:
        """Take ``tokens`` only if the head covers them now; return the new tail or None."""
        c = self.cells
        while True:
            tail = c.load(L.TAIL)
            new = (tail + tokens) & MASK64
            if diff(c.load(L.HEAD), new) < 0:
                return None
            if c.cas(L.TAIL, tail, new):
                return new

    def estimate_wait_ns(self, short: int, snap: Optional[Snapshot] = None) -> float:
        """Nanoseconds until ``short`` more tokens reach the head, at the speed the head can really move.

        The clamp lets one replenish add at most a capacity minus the previous
        interval's tokens, so under a queue the head gains at most about half a
        capacity per replenish.  With replenishes every ``FILL_NS`` (the
        filler), a capacity smaller than two fill intervals moves the head
        slower than the rate, and the wait is that much longer.
        """
        s = snap or self.snap
        return max(short / s.tpn, short / max(1, s.cap // 2) * FILL_NS)

    def try_grab_within(self, tokens: int, max_wait_ns: float) -> Optional[int]:
        """Take ``tokens`` if the wait they imply (``estimate_wait_ns``) is <= ``max_wait_ns``.

        Returns the ticket (possibly not yet covered: the caller waits for it),
        or None having changed nothing.  While stopped the wait is not
        computable: only an unbounded ``max_wait_ns`` queues.  Raises
        ``QueueFullError`` (changing nothing) when the queue would hold more
        than ``MAX_QUEUE_TOKENS``.
        """
        c = self.cells
        snap = self.snap
        while True:
            tail = c.load(L.TAIL)
            new = (tail + tokens) & MASK64
            short = diff(new, c.load(L.HEAD))
            if short > MAX_QUEUE:
                raise QueueFullError(tokens, snap.tpn)
            if short > 0 and max_wait_ns != float("inf"):
                if snap.stopped or self.estimate_wait_ns(short, snap) > max_wait_ns:
                    return None
            if c.cas(L.TAIL, tail, new):
                return new

    # -- observation -----------------------------------------------------------------

    def balance(self) -> int:
        """``HEAD - TAIL`` in tokens: available when positive, owed to waiters when negative."""
        c = self.cells
        tail = c.load(L.TAIL)
        return diff(c.load(L.HEAD), tail)

    def pending(self, now: Optional[int] = None) -> int:
        """Tokens a replenish at ``now`` would add at most (before the capacity clamp)."""
        now = self.clock() if now is None else now
        return max(0, now - self.cells.load(L.REPL_TS)) * self.tpn

    def due_ns(self, ticket: int) -> float:
        """When (CLOCK_MONOTONIC ns) the head reaches ``ticket`` at the current rate.

        The head holds every token up to the last replenish time, so the
        ticket is due that long after it.  A replenish claims its time
        before it adds its tokens, so the head is read first: a pair read
        across a replenish then has the newer time and the older head, and
        can only make the answer later, never earlier.
        """
        c = self.cells
        head = c.load(L.HEAD)
        return c.load(L.REPL_TS) + max(0, diff(ticket, head)) / self.tpn

    def wait_ns(self, tokens_short: int) -> float:
        """Nanoseconds of schedule until ``tokens_short`` more tokens accrue."""
        return tokens_short / self.tpn
