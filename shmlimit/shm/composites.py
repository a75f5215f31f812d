"""The composites of the atomic layer (the hot path in one call), built from its four primitives.

This is the reference every backend must match: the ``atomics`` backend
(atomics_cells.py) inherits it, and the native one (``_native.c``) does the
same steps in C.  ``Gate`` binds the fast paths of ``try_acquire`` and of a
timed ``acquire`` to one config; ``MultiGate`` takes several rates' gates
together, all or nothing, in one call.
"""

from __future__ import annotations

import functools
import time
from typing import Callable, List, Optional, Protocol, Sequence, Tuple, Union

from shmlimit.shm.words import (
    FENCE_DUE_W,
    FENCE_STRIDE,
    MASK64,
    MAX_QUEUE,
    WORD,
    GrabResult,
    check_offset,
    check_records,
    claim_record,
    clamp_words,
    fence_scan,
    plain_seconds,
    signed,
)


class Primitives(Protocol):
    """What a ``Gate`` uses of its cells: the atomic primitives (any backend has them)."""

    def load(self, off: int) -> int: ...

    def store(self, off: int, value: int) -> None: ...

    def fetch_add(self, off: int, delta: int) -> int: ...

    def cas(self, off: int, expected: int, desired: int) -> bool: ...


class CompositesFromPrimitives:
    """The composites (the hot path in one call), built from the four primitives.

    The reference every backend must match: the ``atomics`` backend uses
    these; the native one does the same in C.
    """

    #: the last records tuple ``clamp_words`` checked every offset of (see there)
    _clamp_checked: Tuple[int, ...] = ()

    size: int = 0

    def load(self, off: int) -> int:  # pragma: no cover - provided by the backend
        raise NotImplementedError

    def store(self, off: int, value: int) -> None:  # pragma: no cover - provided by the backend
        raise NotImplementedError

    def fetch_add(self, off: int, delta: int) -> int:  # pragma: no cover - provided by the backend
        raise NotImplementedError

    def load_many(self, offsets: Tuple[int, ...]) -> Tuple[int, ...]:
        """The words at ``offsets``, each one ``load`` (not a snapshot of them together): a scan
        of many words in one call (the native backend makes it one C loop)."""
        if not isinstance(offsets, tuple):
            raise TypeError("load_many: offsets must be a tuple of ints")
        return tuple(self.load(off) for off in offsets)

    def cas(
        self, off: int, expected: int, desired: int
    ) -> bool:  # pragma: no cover - provided by the backend
        raise NotImplementedError

    def clamp_words(
        self, head_off: int, head: int, tail: int, records: Tuple[int, ...]
    ) -> Optional[Tuple[int, int, int]]:
        """The clamp words a replenish leaves for the snapshot ``(head, tail)``, read from the ticket
        ``records`` (LEN offsets), or None when HEAD (at ``head_off``) moved: ``words.clamp_words``."""
        if not isinstance(records, tuple):
            raise TypeError("clamp_words: records must be a tuple of LEN offsets")
        self._check(head_off)
        if signed(head - tail) < 0 and records is not self._clamp_checked:  # read only when queued;
            self._check(*records, *(off - WORD for off in records))  # the same tuple: checked once
            self._clamp_checked = records
        return clamp_words(self, head_off, head, tail, records)

    def fence_scan(
        self,
        hint_off: int,
        first: int,
        count: int,
        ts: int,
        now: int,
        tpn: int,
        head: int,
        ticket: int,
    ) -> Optional[Tuple[int, float]]:
        """The reservation fences in force for a claim of ``[ts, now]``: ``(room above head, due of
        ticket)`` or None (``words.fence_scan``)."""
        if count < 0 or tpn <= 0:
            raise ValueError("fence_scan: count must be >= 0 and tpn >= 1")
        self._check(hint_off, first, first + max(0, count - 1) * FENCE_STRIDE + FENCE_DUE_W)
        return fence_scan(self, hint_off, first, count, ts, now, tpn, head, ticket)

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

    def grab_if(
        self, seq: int, expected: int, tail: int, head: int, amount: int, grants: int, ops: int
    ) -> GrabResult:
        """``grab``, unless the word ``seq`` no longer holds ``expected``: then False, nothing touched
        (as when the queue is full: either way the caller takes the slow path).

        The acquire fast path in one call: ``seq`` is the config's sequence
        word, so a grab is never priced with a config another process replaced.
        """
        self._check(seq, tail, head, grants)
        if self.load(seq) != expected:
            return False
        return self.grab(tail, head, amount, grants, ops)

    def _grab_recorded(
        self,
        seq: int,
        expected: int,
        tail: int,
        head: int,
        amount: int,
        grants: int,
        ops: int,
        recs: tuple,
    ) -> GrabResult:
        """``grab_if`` that queues only holding one of the ticket records ``recs`` (LEN offsets):
        False, taking nothing, also when it would queue and every record is in use.

        The record is claimed, and the ticket about to be taken written in it, before the CAS
        that takes it; its LEN (the tokens taken) is stored right after (see ``claim_record``).
        """
        self._check(seq, tail, head, grants)
        if self.load(seq) != expected:
            return False
        rec = None
        while True:
            t = self.load(tail)
            ticket = (t + amount) & MASK64
            depth = signed(ticket - self.load(head))
            if depth > MAX_QUEUE:
                if rec is not None:
                    self.store(rec, 0)
                return False
            if depth > 0:
                if rec is None:
                    rec = claim_record(self, recs, ticket)
                    if rec is None:
                        return False
                self.store(rec - 8, ticket)
            if self.cas(tail, t, ticket):
                break
        if ((self.load(head) - ticket) & MASK64) >> 63:
            self.store(rec, amount)  # uncovered: it was at the last look, so a record is held
            return ticket
        if rec is not None:
            self.store(rec, 0)
        self.fetch_add(grants, ops)
        return None

    def grabber(
        self,
        seq: int,
        expected: int,
        tail: int,
        head: int,
        amount: int,
        grants: int,
        ops: int,
        recs: Optional[tuple] = None,
    ) -> Callable[[], GrabResult]:
        """``grab_if`` with its arguments bound (and checked) once: a callable taking none.

        With ``recs`` (a tuple of ticket records' LEN offsets) it is ``grab_recorded``: every ticket
        it hands out is recorded in one of them, and it queues none while all are in use.
        """
        self._check(seq, tail, head, grants)
        if recs is not None:
            check_records(recs, self.size)
            return functools.partial(
                self._grab_recorded, seq, expected, tail, head, amount, grants, ops, recs
            )
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
        recs: Optional[tuple] = None,
        fence_hint: Optional[int] = None,
    ) -> "Gate":
        """``try_acquire`` and a timed ``acquire`` of one config, each in one call (see ``Gate``)."""
        self._check(
            seq, tail, head, ceil, repl_ts, grants, *([] if fence_hint is None else [fence_hint])
        )
        if recs is not None:
            check_records(recs, self.size)
        return Gate(
            self,
            seq,
            expected,
            tail,
            head,
            ceil,
            repl_ts,
            grants,
            amount,
            ops,
            tpn,
            pend_mul,
            capped,
            max_reserved_ns,
            recs=recs,
            fence_hint=fence_hint,
        )

    def waiter(
        self,
        seq: int,
        expected: int,
        tail: int,
        head: int,
        repl_ts: int,
        snap_head: int,
        snap_tail: int,
        lease: int,
        grants: int,
        waiting: Optional[int],
        tpn: int,
        cap: int,
        slack_ns: int,
        lost: int,
        snap_base: int,
        snap_end: int,
        snap_next: int,
        records: Tuple[int, ...],
        fence_hint: int = 0,
        fence_first: int = 0,
        fence_count: int = 0,
    ) -> None:
        """None: a wait loop is worth having only natively, where it sleeps without the GIL and
        without returning to Python between naps; here waiters wait in Python."""
        self._check(
            seq,
            tail,
            head,
            repl_ts,
            snap_head,
            snap_tail,
            lease,
            grants,
            snap_base,
            snap_end,
            snap_next,
            *records,
            *([] if waiting is None else [waiting]),
            fence_hint,
            fence_first + max(0, fence_count - 1) * FENCE_STRIDE + FENCE_DUE_W,
        )
        return None

    def fed_waiter(
        self,
        seq: int,
        expected: int,
        head: int,
        lease: int,
        grants: int,
        waiting: Optional[int],
        wake: int,
        next_ns: int,
        cost: int,
        tpn: int,
        grace_ns: int,
    ) -> None:
        """None: here a fed waiter waits in Python, on the same futex word (``futex_wait``)."""
        self._check(
            seq, head, lease, grants, wake, next_ns, *([] if waiting is None else [waiting])
        )
        return None

    def keyed_table(self, *args: int):
        """The keyed slot table's composite (find/insert/evict + a GCRA step): see ``keyed_cells``."""
        from shmlimit.keyed.cells import KeyedTable

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
        self,
        cells: Primitives,
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
        clock: Callable[[], int] = time.monotonic_ns,
        recs: Optional[tuple] = None,
        fence_hint: Optional[int] = None,
    ) -> None:
        if tpn < 1 or pend_mul < 1 or not 1 <= amount <= 1 << 62 or not max_reserved_ns >= 0:
            raise ValueError(
                "gate: tpn, pend_mul and amount must be >= 1 (amount < 2**62), max_reserved_ns >= 0"
            )
        self.cells = cells
        self.seq, self.expected, self.tail, self.head, self.ceil = seq, expected, tail, head, ceil
        self.repl_ts, self.grants, self.amount, self.ops = repl_ts, grants, amount, ops
        self.tpn, self.pend_mul, self.capped, self.max_reserved_ns = (
            tpn,
            pend_mul,
            bool(capped),
            max_reserved_ns,
        )
        self.clock = clock
        #: the ticket records a queued ticket must hold one of (None: it queues unrecorded)
        self.recs = recs
        #: FENCE_HINT (None: none): a grab that would queue is undecided while a reservation's fence
        #: may be in force (the slow path counts it in the wait: ``Schedule.wait_ns``)
        self.fence_hint = fence_hint

    def fenced(self) -> bool:
        """May a reservation's fence be in force (its DUE after the last replenish)?"""
        return self.fence_hint is not None and self.cells.load(self.fence_hint) > self.cells.load(
            self.repl_ts
        )

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
        rec = None  # the record claimed for the ticket, once it would queue
        try:
            while True:
                tail = c.load(self.tail)
                want = (tail + self.amount) & MASK64
                short = signed(want - c.load(self.head))
                if short > 0:
                    if short / self.tpn > max_wait_ns:
                        pend = self.pending()
                        return (
                            False
                            if short > pend and (short - pend) / self.tpn > max_wait_ns
                            else None
                        )
                    if self.fenced():
                        return None  # the slow path's wait counts the fences
                    if self.capped and signed(want - c.load(self.ceil)) > 0:
                        return False  # beyond the released budget: no computable wait, no replenish helps
                    if self.recs is not None:  # no queued ticket without a record (claim_record)
                        if rec is None:
                            rec = claim_record(c, self.recs, want)
                            if rec is None:
                                return None
                        c.store(rec - 8, want)
                    if c.cas(self.tail, tail, want):
                        if rec is not None:
                            c.store(rec, self.amount)
                            rec = None
                        return want
                elif c.cas(self.tail, tail, want):
                    c.fetch_add(self.grants, self.ops)
                    return True
        finally:
            if rec is not None:  # claimed and not used: free again
                c.store(rec, 0)

    # -- the steps of a try over several rates (``MultiGate``), each on this gate's words ----------

    def enter(self) -> None:
        """Hold the cells open while a ``MultiGate`` works on them (the primitives here check
        for themselves; a backend whose steps use raw words overrides this)."""

    def exit(self) -> None:
        """Undo ``enter``."""

    def short(self, amount: int) -> Optional[int]:
        """Tokens this rate lacks for ``amount`` now (<= 0: it has room), or None when the config
        is no longer the gate's.  Touches nothing."""
        c = self.cells
        if c.load(self.seq) != self.expected:
            return None
        return signed(c.load(self.tail) + amount - c.load(self.head))

    def take(self, amount: int) -> Optional[int]:
        """Advance the tail by ``amount`` only while the head covers it (CAS); the head read
        before, or None when short (nothing taken).  Not counted: see ``count``."""
        c = self.cells
        head_then = c.load(self.head)
        while True:
            t = c.load(self.tail)
            want = (t + amount) & MASK64
            if signed(want - c.load(self.head)) > 0:
                return None
            if c.cas(self.tail, t, want):
                return head_then

    def count(self, mult: int) -> None:
        """Count ``mult`` grants of this gate's ``ops``."""
        self.cells.fetch_add(self.grants, self.ops * mult)

    def give_back(self, amount: int, head_then: int, cap: int) -> None:
        """Return ``amount`` tokens taken when the head was ``head_then``, unused, less what the
        head gained since, never beyond ``tail + cap`` (as ``Bucket.give_back``).

        The gain is read again with the head after every failed CAS: a replenish that landed
        meanwhile added time the taken tokens may have kept out of a full bucket, so it counts
        against what goes back.  The head then ends at most at ``max(head, head_then + amount)``
        (the head as others left it, or as it stood before the take plus the tokens taken),
        never the tokens on top of a replenish that landed meanwhile (past a fence that
        replenish kept: design.md, "Reservation fences").
        """
        c = self.cells
        while True:
            head = c.load(self.head)
            back = amount - max(0, signed(head - head_then))
            if back <= 0:
                return
            add = min(back, signed(c.load(self.tail) + cap - head))
            if add <= 0 or c.cas(self.head, head, (head + add) & MASK64):
                return


#: Rates a ``MultiGate`` takes at most (``rates=`` holds at most as many).
MULTI_MAX = 16


class MultiGate:
    """One try over several rates' gates, all or nothing (the reference; ``_native.c`` does the
    same steps in one C call).

    It looks at every rate first (config unchanged, room now) and touches
    nothing unless all have room; only then does it take each by CAS, in
    order.  A race (another caller took a later rate's room between the look
    and the take) gives back to the rates already taken what it took, less
    what their heads gained since, never beyond ``tail + cap``.  Every rate's
    grants are counted only once all have granted.  It never queues, so it
    never passes a ticket queued on any rate, and each rate's tail advances
    only over tokens its head covers: each keeps its own window bound.

    Answers True (granted and counted on every rate), False (refused for
    certain on some rate, nothing touched; only with ``decide``), or None
    (undecided: a config changed, a replenish might grant, or a race gave
    back -- the caller takes the slow path).
    """

    def __init__(
        self,
        gates: Sequence[Gate],
        caps: Sequence[int],
        decide: bool,
        names: Optional[Sequence[str]] = None,
    ) -> None:
        if (
            not 1 <= len(gates) <= MULTI_MAX
            or len(caps) != len(gates)
            or (names is not None and len(names) != len(gates))
        ):
            raise ValueError(
                f"multi_gate: 1 to {MULTI_MAX} gates, and one capacity (and name) per gate"
            )
        for g, cap in zip(gates, caps):
            if not g.amount <= cap < 1 << 62:
                raise ValueError(
                    "multi_gate: each capacity must be >= its gate's amount and < 2**62"
                )
        self.gates = tuple(gates)
        self.caps = tuple(caps)
        self.decide = bool(decide)
        self.names = None if names is None else tuple(names)
        self._ones = (1,) * len(gates)

    def try_grab(self) -> Optional[bool]:
        """One op on every rate."""
        return self._try(self._ones)

    def try_grab_ops(self, ops: object) -> Optional[bool]:
        """``ops`` per rate (a tuple, 0 for a rate not taken; a dict by the rates' names, those
        not named 0) or one int for every rate; None, touching nothing, for anything but plain
        ints >= 0 with one > 0, a name not a rate's, or more tokens than a rate's capacity (the
        slow path queues that or raises)."""
        n = len(self.gates)
        if type(ops) is tuple:
            if len(ops) != n:
                return None
            mult = ops
        elif type(ops) is dict:
            if self.names is None or not ops.keys() <= set(self.names):
                return None
            mult = tuple(ops.get(k, 0) for k in self.names)
        else:
            mult = (ops,) * n
        for o, g, cap in zip(mult, self.gates, self.caps):
            if type(o) is not int or not 0 <= o <= cap // g.amount:
                return None
        if not any(mult):
            return None
        return self._try(mult)

    def _try(self, mult: Sequence[int]) -> Optional[bool]:
        entered: List[Gate] = []
        try:
            for g in self.gates:
                g.enter()
                entered.append(g)
            certain = short_any = False
            for g, m in zip(self.gates, mult):  # look: touch nothing unless every rate has room
                if m:
                    short = g.short(g.amount * m)
                    if short is None:
                        return None
                    if short > 0:
                        short_any = True
                        certain = certain or short > g.pending()
            if short_any:
                return False if certain and self.decide else None
            taken: List[Tuple[Gate, int, int, int]] = []
            for g, m, cap in zip(self.gates, mult, self.caps):  # take, in order
                if m:
                    head_then = g.take(g.amount * m)
                    if head_then is None:  # a race: the earlier rates get their tokens back
                        for tg, amount, h, tcap in taken:
                            tg.give_back(amount, h, tcap)
                        return None
                    taken.append((g, g.amount * m, head_then, cap))
            for g, m in zip(self.gates, mult):
                if m:
                    g.count(m)
            return True
        finally:
            for g in entered:
                g.exit()
