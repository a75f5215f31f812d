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
from .config import Config

SIGN = 1 << 63
WRAP = 1 << 64


def diff(a: int, b: int) -> int:
    """``a - b`` for wrapping 64-bit rovers, as a signed number."""
    d = (a - b) & MASK64
    return d - WRAP if d & SIGN else d


def behind(a: int, b: int) -> int:
    """Whichever of two rovers is behind the other."""
    return a if diff(a, b) <= 0 else b


class Bucket:
    """Rover arithmetic on one segment.  ``clock`` returns CLOCK_MONOTONIC nanoseconds."""

    def __init__(self, cells: Cells, clock: Callable[[], int] = time.monotonic_ns) -> None:
        self.cells = cells
        self.clock = clock
        self.load_config()

    # -- configuration ----------------------------------------------------------

    def load_config(self) -> None:
        c = self.cells
        self.tpn = c.load(L.CFG_TPN)
        self.cost = c.load(L.CFG_COST)
        self.cap = c.load(L.CFG_CAP)
        self.capped = bool(c.load(L.CFG_FLAGS) & L.FLAG_CAPPED)
        self.config = Config(
            L.u2f(c.load(L.CFG_RATE)), L.u2f(c.load(L.CFG_PER)), L.u2f(c.load(L.CFG_BURST)), self.capped
        )

    @staticmethod
    def initialise(cells: Cells, cfg: Config, now_ns: int, initial_ops: Optional[float] = None, base: int = 0) -> None:
        """Write the config and the starting rovers of a new segment (called by its creator only).

        The bucket starts with ``initial_ops`` tokens (default: full).  ``base``
        is where the rovers start; tests set it near 2**64 to exercise wrap-around.
        """
        c = cells
        cap = cfg.cap_tokens
        initial = cap if initial_ops is None else min(cap, int(initial_ops * cfg.cost))
        c.store(L.CFG_RATE, L.f2u(cfg.rate))
        c.store(L.CFG_PER, L.f2u(cfg.per))
        c.store(L.CFG_BURST, L.f2u(cfg.burst))
        c.store(L.CFG_TPN, cfg.tpn)
        c.store(L.CFG_COST, cfg.cost)
        c.store(L.CFG_CAP, cap)
        c.store(L.CFG_FLAGS, L.FLAG_CAPPED if cfg.capped else 0)
        head = (base + initial) & MASK64
        c.store(L.TAIL, base & MASK64)
        c.store(L.HEAD, head)
        # capped mode starts with one bucket's worth of released budget
        c.store(L.CEIL, (base + cap) & MASK64)
        c.store(L.SNAP_HEAD, head)
        c.store(L.SNAP_TAIL, base & MASK64)
        c.store(L.REPL_TS, now_ns)

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
        """Second half of ``replenish``: add a claimed interval's tokens, clamped (invariant 1)."""
        c = self.cells
        head, limit, extra = claim
        while True:
            add = min(extra, diff(limit, head))
            if add <= 0:
                return 0  # full: the interval's time is not kept
            if c.cas(L.HEAD, head, (head + add) & MASK64):
                return add
            head = c.load(L.HEAD)  # another interval landed first: add ours on top, same clamp

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
            if short > 0:
                if short / self.tpn > max_wait_ns:
                    return None
                if self.capped and diff(new, c.load(L.CEIL)) > 0 and max_wait_ns != float("inf"):
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

    def wait_ns(self, tokens_short: int) -> float:
        """Nanoseconds of schedule until ``tokens_short`` more tokens accrue."""
        return tokens_short / self.tpn
