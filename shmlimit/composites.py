"""The composites of the atomic layer (the hot path in one call), built from its four primitives.

This is the reference every backend must match: the ``atomics`` backend
(atomics_cells.py) inherits it, and the native one (``_native.c``) does the
same steps in C.  ``Gate`` binds the fast paths of ``try_acquire`` and of a
timed ``acquire`` to one config.
"""
from __future__ import annotations

import functools
import time
from typing import Callable, Optional, Protocol, Union

from .words import MASK64, MAX_QUEUE, GrabResult, check_offset, plain_seconds, signed


class Primitives(Protocol):
    """What a ``Gate`` uses of its cells: the atomic primitives (any backend has them)."""

    def load(self, off: int) -> int: ...

    def fetch_add(self, off: int, delta: int) -> int: ...

    def cas(self, off: int, expected: int, desired: int) -> bool: ...


class CompositesFromPrimitives:
    """The composites (the hot path in one call), built from the four primitives.

    The reference every backend must match: the ``atomics`` backend uses
    these; the native one does the same in C.
    """

    size: int = 0

    def load(self, off: int) -> int:  # pragma: no cover - provided by the backend
        raise NotImplementedError

    def fetch_add(self, off: int, delta: int) -> int:  # pragma: no cover - provided by the backend
        raise NotImplementedError

    def cas(self, off: int, expected: int, desired: int) -> bool:  # pragma: no cover - provided by the backend
        raise NotImplementedError

    def grab(self, tail: int, head: int, amount: int, grants: int, ops: int) -> GrabResult:
        """Advance the tail rover by ``amount`` (CAS), unless the queue would exceed ``MAX_QUEUE``.

        Returns ``None`` when the head already covers the new tail (granted at
        once; ``ops`` is then added to the counter cell ``grants``), ``False``
        when ``TAIL - HEAD`` would exceed ``MAX_QUEUE`` tokens (nothing
        touched), else the ticket (the new tail) that the caller must wait for.
        The head only grows, so a depth measured against a head read before
        the CAS is never smaller than the true one.
        """
        self._check(tail, head, grants)
        while True:
            t = self.load(tail)
            ticket = (t + amount) & MASK64
            depth = (ticket - self.load(head)) & MASK64
            if depth < 1 << 63 and depth > MAX_QUEUE:
                return False
            if self.cas(tail, t, ticket):
                break
        if ((self.load(head) - ticket) & MASK64) >> 63:
            return ticket
        self.fetch_add(grants, ops)
        return None

    def grab_if(self, seq: int, expected: int, tail: int, head: int, amount: int, grants: int, ops: int) -> GrabResult:
        """``grab``, unless the word ``seq`` no longer holds ``expected``: then False, nothing touched
        (as when the queue is full: either way the caller takes the slow path).

        The acquire fast path in one call: ``seq`` is the config's sequence
        word, so a grab is never priced with a config another process replaced.
        """
        self._check(seq, tail, head, grants)
        if self.load(seq) != expected:
            return False
        return self.grab(tail, head, amount, grants, ops)

    def grabber(
        self, seq: int, expected: int, tail: int, head: int, amount: int, grants: int, ops: int
    ) -> Callable[[], GrabResult]:
        """``grab_if`` with its arguments bound (and checked) once: a callable taking none."""
        self._check(seq, tail, head, grants)
        return functools.partial(self.grab_if, seq, expected, tail, head, amount, grants, ops)

    def try_grab(self, tail: int, head: int, amount: int, grants: int, ops: int) -> bool:
        """Advance the tail by ``amount`` only if the head covers it (CAS); never queue.

        On success ``ops`` is added to the counter cell ``grants``.  On failure
        nothing in the segment has changed.
        """
        self._check(tail, head, grants)
        while True:
            t = self.load(tail)
            new = (t + amount) & MASK64
            if ((self.load(head) - new) & MASK64) >> 63:
                return False
            if self.cas(tail, t, new):
                self.fetch_add(grants, ops)
                return True

    def gate(
        self,
        seq: int,
        expected: int,
        tail: int,
        head: int,
        ceil: int,
        repl_ts: int,
        grants: int,
        amount: int,
        ops: int,
        tpn: int,
        pend_mul: int,
        capped: bool,
        max_reserved_ns: float,
    ) -> "Gate":
        """``try_acquire`` and a timed ``acquire`` of one config, each in one call (see ``Gate``)."""
        self._check(seq, tail, head, ceil, repl_ts, grants)
        return Gate(self, seq, expected, tail, head, ceil, repl_ts, grants, amount, ops, tpn, pend_mul, capped,
                    max_reserved_ns)

    def waiter(
        self, seq: int, expected: int, tail: int, head: int, repl_ts: int, snap_head: int, snap_tail: int,
        lease: int, grants: int, waiting: Optional[int], tpn: int, cap: int, slack_ns: int,
    ) -> None:
        """None: a wait loop is worth having only natively, where it sleeps without the GIL and
        without returning to Python between naps; here waiters wait in Python."""
        self._check(seq, tail, head, repl_ts, snap_head, snap_tail, lease, grants, *([] if waiting is None else [waiting]))
        return None

    def keyed_table(self, *args: int):
        """The keyed slot table's composite (find/insert/evict + a GCRA step): see ``keyed_cells``."""
        from .keyed_cells import KeyedTable

        return KeyedTable(self, *args)

    def _check(self, *offsets: int) -> None:
        """Validate every offset of a composite before its first access."""
        for off in offsets:
            check_offset(off, self.size)


class Gate:
    """The fast path of ``try_acquire`` and of a timed ``acquire``, bound to one config.

    Both methods answer True (granted now, ``ops`` added to ``grants``),
    False (refused for certain, nothing touched) or None (undecided: the
    config changed, or a replenish might grant -- the caller takes the slow
    path, which replenishes and tries again); ``grab_within`` may also answer
    a ticket (queued within the timeout: the caller waits for it).

    A refusal is certain when even every token the next replenish could add
    (the time since ``REPL_TS`` times ``tpn`` times ``pend_mul``, the
    catch-up ratio rounded up) would not change the answer.  That only
    over-estimates, so a certain refusal is never a wrong one.  This is the
    reference version, built from the four primitives; the native backend
    does the same in one C call.
    """

    def __init__(
        self, cells: Primitives, seq: int, expected: int, tail: int, head: int, ceil: int, repl_ts: int, grants: int,
        amount: int, ops: int, tpn: int, pend_mul: int, capped: bool, max_reserved_ns: float,
        clock: Callable[[], int] = time.monotonic_ns,
    ) -> None:
        if tpn < 1 or pend_mul < 1 or not 1 <= amount <= 1 << 62 or not max_reserved_ns >= 0:
            raise ValueError("gate: tpn, pend_mul and amount must be >= 1 (amount < 2**62), max_reserved_ns >= 0")
        self.cells = cells
        self.seq, self.expected, self.tail, self.head, self.ceil = seq, expected, tail, head, ceil
        self.repl_ts, self.grants, self.amount, self.ops = repl_ts, grants, amount, ops
        self.tpn, self.pend_mul, self.capped, self.max_reserved_ns = tpn, pend_mul, bool(capped), max_reserved_ns
        self.clock = clock

    def pending(self) -> int:
        """At most how many tokens a replenish starting now could add."""
        elapsed = self.clock() - self.cells.load(self.repl_ts)
        return max(0, elapsed) * self.tpn * self.pend_mul

    def try_grab(self) -> Optional[bool]:
        c = self.cells
        if c.load(self.seq) != self.expected:
            return None
        while True:
            t = c.load(self.tail)
            want = (t + self.amount) & MASK64
            short = signed(want - c.load(self.head))
            if short > 0:
                return False if short > self.pending() else None
            if c.cas(self.tail, t, want):
                c.fetch_add(self.grants, self.ops)
                return True

    def grab_within(self, timeout: object) -> Union[bool, int, None]:
        c = self.cells
        t = plain_seconds(timeout)
        if t is None or c.load(self.seq) != self.expected:
            return None
        max_wait_ns = min(t * 1e9, self.max_reserved_ns)
        while True:
            tail = c.load(self.tail)
            want = (tail + self.amount) & MASK64
            short = signed(want - c.load(self.head))
            if short > 0:
                if short / self.tpn > max_wait_ns:
                    pend = self.pending()
                    return False if short > pend and (short - pend) / self.tpn > max_wait_ns else None
                if self.capped and signed(want - c.load(self.ceil)) > 0:
                    return False  # beyond the released budget: no computable wait, no replenish helps
                if c.cas(self.tail, tail, want):
                    return want
            elif c.cas(self.tail, tail, want):
                c.fetch_add(self.grants, self.ops)
                return True
