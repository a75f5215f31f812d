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
* ``CEIL`` -- capped-release mode only: the head may not pass it; ``release``
  advances it.

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
from typing import Callable, Optional, Tuple

from . import layout as L
from .cells import MASK64, Cells
from .config import MAX_SPAN_TOKENS as MAX_SPAN
from .config import MAX_TPN, NS_PER_S, Config
from .errors import SegmentError

SIGN = 1 << 63
WRAP = 1 << 64


_CONFIG_WORDS = (
    L.CFG_RATE,
    L.CFG_PER,
    L.CFG_BURST,
    L.CFG_TPN,
    L.CFG_COST,
    L.CFG_CAP,
    L.CFG_FLAGS,
    L.CFG_RATIO,
    L.CFG_MAX_RESERVED,
    L.CFG_MAX_BEHIND,
)


def diff(a: int, b: int) -> int:
    """``a - b`` for wrapping 64-bit rovers, as a signed number."""
    d = (a - b) & MASK64
    return d - WRAP if d & SIGN else d


def behind(a: int, b: int) -> int:
    """Whichever of two rovers is behind the other."""
    return a if diff(a, b) <= 0 else b


INF_BITS = L.f2u(float("inf"))
_KNOWN_FLAGS = L.FLAG_CAPPED | L.FLAG_STOPPED | L.UPSTREAM_FLAGS
#: A config writer that holds the sequence lock longer than this is presumed dead (ns).
CONFIG_LOCK_TIMEOUT_NS = 200_000_000


def _opt(x: Optional[float]) -> int:
    return INF_BITS if x is None else L.f2u(x)


def _unopt(u: int) -> Optional[float]:
    v = L.u2f(u)
    return None if v == float("inf") else v


class Bucket:
    """Rover arithmetic on one segment.  ``clock`` returns CLOCK_MONOTONIC nanoseconds."""

    def __init__(self, cells: Cells, clock: Callable[[], int] = time.monotonic_ns) -> None:
        self.cells = cells
        self.clock = clock
        self.seq = -1
        self.load_config()

    # -- configuration ----------------------------------------------------------
    #
    # The config lines are published under a sequence lock: CFG_SEQ is odd while a
    # writer is at work.  Readers retry until they see the same even value before
    # and after; a writer that died mid-write (odd for too long) is presumed dead,
    # and its fields are read as they are.  Any mix of two valid configs is still a
    # valid config for every field read on the hot path (tokens per op, capacity),
    # so a torn read can never do worse than the larger of the two.

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
            vals = [c.load(off) for off in _CONFIG_WORDS]
            if c.load(L.CFG_SEQ) == seq or deadline is not None:
                break
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
        self.seq = seq
        self.tpn = tpn
        self.cost = cost
        self.cap = cap
        self.capped = bool(flags & L.FLAG_CAPPED)
        self.stopped = bool(flags & L.FLAG_STOPPED)
        self.upstream_flags = flags & L.UPSTREAM_FLAGS
        self.upstream = bool(flags & L.FLAG_UPSTREAM)
        #: tokens come from the clock: always, but in hierarchical mode only in the "local" fallback
        self.time_fed = not self.upstream or bool(flags & L.FLAG_FALLBACK_LOCAL)
        #: hierarchical mode, "open" fallback: every acquire is granted without tokens
        self.open = self.upstream and bool(flags & L.FLAG_FALLBACK_OPEN)
        self.config = cfg
        self.burst_pool = self.config.burst_pool_at(tpn)
        self.catch_up = self.config.ratio > 1.0
        mb = self.config.max_behind
        self.wait_cap = MAX_SPAN if mb is None else int(mb * NS_PER_S * tpn)
        mr = self.config.max_reserved
        self.max_reserved_ns = float("inf") if mr is None else mr * NS_PER_S

    def refresh(self) -> bool:
        """Reload the config if another process changed it; True if it did."""
        if self.cells.load(L.CFG_SEQ) != self.seq:
            self.load_config()
            return True
        return False

    @staticmethod
    def _write_config_words(cells: Cells, cfg: Config, tpn: int, stopped: bool, upstream_flags: int) -> None:
        c = cells
        c.store(L.CFG_RATE, L.f2u(cfg.rate))
        c.store(L.CFG_PER, L.f2u(cfg.per))
        c.store(L.CFG_BURST, L.f2u(cfg.burst))
        c.store(L.CFG_TPN, tpn)
        c.store(L.CFG_COST, cfg.cost_at(tpn))
        c.store(L.CFG_CAP, cfg.cap_at(tpn))
        flags = (L.FLAG_CAPPED if cfg.capped else 0) | (L.FLAG_STOPPED if stopped else 0) | upstream_flags
        c.store(L.CFG_FLAGS, flags)
        c.store(L.CFG_RATIO, L.f2u(cfg.ratio))
        c.store(L.CFG_MAX_RESERVED, _opt(cfg.max_reserved))
        c.store(L.CFG_MAX_BEHIND, _opt(cfg.max_behind))

    def publish(self, cfg: Config, stopped: Optional[bool] = None, upstream_flags: Optional[int] = None) -> None:
        """Replace the live config (seen by every attached process at its next operation).

        The token unit (tpn) stays the one chosen at creation: rovers and the
        clock keep their meaning, queued tickets keep their place and their
        schedule time, and only new grabs pay the new price per op.
        """
        if cfg.capped != self.capped:
            raise ValueError("capped cannot be changed on a live limiter (unlink and re-create it)")

        def write(c: Cells) -> None:
            flags = c.load(L.CFG_FLAGS)
            st = bool(flags & L.FLAG_STOPPED) if stopped is None else stopped
            up = flags & L.UPSTREAM_FLAGS if upstream_flags is None else upstream_flags
            self._write_config_words(c, cfg, self.tpn, st, up)

        self._under_config_lock(write)
        self.load_config()
        self.burn(keep=self.cap)

    def set_upstream_flags(self, upstream_flags: int) -> None:
        """Hierarchical mode: switch the fallback flags, and nothing else.

        Every other word stays as the segment holds it under the lock, so a
        ``set_rate`` by any process while the filler was talking to Redis is
        never undone by a config the filler read before.
        """

        def write(c: Cells) -> None:
            c.store(L.CFG_FLAGS, (c.load(L.CFG_FLAGS) & ~L.UPSTREAM_FLAGS) | upstream_flags)

        self._under_config_lock(write)
        self.load_config()

    def _under_config_lock(self, write: Callable[[Cells], None]) -> None:
        """Run ``write`` holding the config seqlock (CFG_SEQ odd), then publish (CFG_SEQ even)."""
        c = self.cells
        since = time.monotonic_ns()
        while True:
            seq = c.load(L.CFG_SEQ)
            if seq & 1 and time.monotonic_ns() - since < CONFIG_LOCK_TIMEOUT_NS:
                time.sleep(0.0005)
                continue
            # even: take the lock; odd for too long: its writer is presumed dead, take it over
            if c.cas(L.CFG_SEQ, seq, seq + 1 if not seq & 1 else seq + 2):
                break
        try:
            write(c)
        finally:
            c.store(L.CFG_SEQ, (c.load(L.CFG_SEQ) | 1) + 1)

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
        Bucket._write_config_words(c, cfg, tpn, False, L.FLAG_UPSTREAM if upstream else 0)
        initial = cap if initial_ops is None else min(cap, int(initial_ops * cfg.cost_at(tpn)))
        if upstream:
            initial = 0
        head = (base + initial) & MASK64
        c.store(L.TAIL, base & MASK64)
        c.store(L.HEAD, head)
        # capped mode: a capacity's worth of budget may be replenished before the first release
        c.store(L.CEIL, (base + cap) & MASK64)
        c.store(L.SNAP_HEAD, head)
        c.store(L.SNAP_TAIL, base & MASK64)
        c.store(L.REPL_TS, now_ns)
        c.store(L.WAIT, 0)

    # -- the four Seastar operations -----------------------------------------------

    def grab(self, tokens: int) -> int:
        """Take ``tokens`` unconditionally (fetch-add); return the ticket to wait for."""
        return (self.cells.fetch_add(L.TAIL, tokens) + tokens) & MASK64

    def deficiency(self, ticket: int) -> int:
        """Tokens the grab holding ``ticket`` is still owed (0 once it may proceed)."""
        return max(0, diff(ticket, self.cells.load(L.HEAD)))

    def replenish(self) -> int:
        """Convert the time since the last replenish into tokens; return how many were added.

        Safe from any process at any moment (invariant 2).
        """
        claim = self.claim()
        return self.apply(claim) if claim is not None else 0

    def claim(self) -> Optional[Tuple[int, int, int]]:
        """First half of ``replenish``: claim ``[REPL_TS, now]`` and leave the next snapshot.

        Returns ``(head, limit, tokens)`` for ``apply``, or None when nothing
        elapsed or another process claimed the interval first.  The rovers are
        read before the clock, so the snapshot left here is never newer than
        the instant the interval ends (invariant 3).
        """
        c = self.cells
        ts = c.load(L.REPL_TS)
        snap_head = c.load(L.SNAP_HEAD)
        snap_tail = c.load(L.SNAP_TAIL)
        head = c.load(L.HEAD)
        tail = c.load(L.TAIL)
        now = self.clock()
        elapsed = now - ts
        if elapsed <= 0 or not c.cas(L.REPL_TS, ts, now):
            return None
        c.store(L.SNAP_HEAD, head)
        c.store(L.SNAP_TAIL, tail)
        limit = behind(snap_head, snap_tail) + self.cap
        if self.capped:
            limit = behind(limit, c.load(L.CEIL))
        return head, limit & MASK64, elapsed * self.tpn

    def apply(self, claim: Tuple[int, int, int]) -> int:
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
        if self.stopped or not self.time_fed:
            return 0
        c = self.cells
        head, limit, extra = claim
        taken = self._take_wait(int(extra * (self.config.ratio - 1.0))) if self.catch_up else 0
        while True:
            add = max(0, min(extra, diff(limit, head)))
            catch = max(0, min(taken, diff((limit + self.burst_pool) & MASK64, (head + add) & MASK64)))
            total = add + catch
            if total <= 0 or c.cas(L.HEAD, head, (head + total) & MASK64):
                break
            head = c.load(L.HEAD)  # another interval landed first: add ours on top, same clamp
        if self.catch_up:
            self._put_wait(extra - add + taken - catch)  # unusable time now: behind schedule
        return total

    def _take_wait(self, want: int) -> int:
        c = self.cells
        while want > 0:
            w = c.load(L.WAIT)
            take = min(w, want)
            if take <= 0 or c.cas(L.WAIT, w, w - take):
                return max(0, take)
        return 0

    def _put_wait(self, amount: int) -> None:
        c = self.cells
        while amount > 0:
            w = c.load(L.WAIT)
            new = min(w + amount, self.wait_cap)
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

    def release(self, tokens: int) -> None:
        """Capped mode: let ``tokens`` more be replenished (advances the ceil rover)."""
        self.cells.fetch_add(L.CEIL, tokens)

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

    def try_grab_within(self, tokens: int, max_wait_ns: float) -> Optional[int]:
        """Take ``tokens`` if the wait they imply at the current rate is <= ``max_wait_ns``.

        Returns the ticket (possibly not yet covered: the caller waits for it),
        or None having changed nothing.  In capped mode a grab beyond the ceil
        has no computable wait and is refused unless ``max_wait_ns`` is infinite.
        """
        c = self.cells
        while True:
            tail = c.load(L.TAIL)
            new = (tail + tokens) & MASK64
            short = diff(new, c.load(L.HEAD))
            if short > 0 and max_wait_ns != float("inf"):
                # no computable wait while stopped, or beyond the released budget (capped)
                if short / self.tpn > max_wait_ns or self.stopped:
                    return None
                if self.capped and diff(new, c.load(L.CEIL)) > 0:
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
