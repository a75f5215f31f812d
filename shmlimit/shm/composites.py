"""The composites of the atomic layer (the hot path in one call): their one Python copy.

The ``atomics`` backend runs these (atomics_cells.py); the native one (``_native.c``) does the
same steps in C, and the tests hold both to the same answers.  They reach the words through a
``Raw``: the ``atomics`` backend's plain reads and the package's operations called directly (at
most two atomic operations for an uncontended grant), or any cells' checked primitives.
``Gate`` binds the fast paths of ``try_acquire`` and of a timed ``acquire`` to one config;
``MultiGate`` takes several rates' gates together, all or nothing, in one call.
"""

from __future__ import annotations

import abc
import functools
import threading
import time
from typing import Any, Callable, List, NamedTuple, Optional, Sequence, Tuple, Union

from shmlimit.shm.words import (
    FENCE_STRIDE,
    FENCE_TOKENS_W,
    MASK64,
    MAX_QUEUE,
    REC_BUSY,
    WORD,
    GrabResult,
    check_offset,
    check_records,
    check_value,
    claim_record,
    clamp_words,
    fence_scan,
    plain_seconds,
    signed,
)


class Raw(NamedTuple):
    """The words of some cells as the composites reach them.

    ``w[i]`` reads the word at byte ``i * WORD`` (a plain read may be stale: every word read so
    only grows or is checked again, see ``AtomicsCells``); ``cas(addr, expected, desired)`` answers
    the value it found (``expected`` exactly when it stored); ``add(addr, delta)`` is a fetch-add;
    an address is ``base`` + the word's offset.  ``enter(recorded)`` and ``exit(recorded)`` bracket
    every composite (``AtomicsCells._enter``: ``close`` waits for it; False: take nothing).
    """

    w: Any
    cas: Callable[[int, int, int], int]
    add: Callable[[int, int], int]
    base: int
    enter: Callable[..., bool]
    exit: Callable[..., None]


class Loads:
    """Index -> value of words, each read by ``load(base + index * WORD)``."""

    __slots__ = ("load", "base")

    def __init__(self, load: Callable[[int], int], base: int = 0) -> None:
        self.load, self.base = load, base

    def __getitem__(self, i: int) -> int:
        return self.load(self.base + i * WORD)


def raw_words(cells: Any) -> Raw:
    """``cells``' own ``Raw`` (its ``_raw()``), else ``checked_raw(cells)``."""
    own = getattr(cells, "_raw", None)
    return checked_raw(cells) if own is None else own()


def _unguarded(recorded: bool = False) -> bool:
    return True


def checked_raw(cells: Any, enter: Callable = _unguarded, exit: Callable = _unguarded) -> Raw:
    """A ``Raw`` over ``cells``' checked primitives (``load``, ``cas``, ``fetch_add``), which guard
    themselves: ``enter`` and ``exit`` (by default, no guard) bracket each composite."""

    def cas(off: int, expected: int, desired: int) -> int:
        while not cells.cas(off, expected, desired):
            found = cells.load(off)
            if found != expected:
                return found
        return expected

    return Raw(Loads(cells.load), cas, lambda off, d: cells.fetch_add(off, d), 0, enter, exit)


def take(
    w: Any, cas: Callable, i_tail: int, i_head: int, a_tail: int, amount: int
) -> Optional[int]:
    """Advance the tail (word ``i_tail``, address ``a_tail``) by ``amount`` only while the head
    (word ``i_head``) covers it (CAS); the head read before, or None when short (nothing taken).
    Not counted."""
    head_then = w[i_head]
    t = w[i_tail]
    while True:
        want = (t + amount) & MASK64
        if signed(want - w[i_head]) > 0:
            return None
        found = cas(a_tail, t, want)
        if found == t:
            return head_then
        t = found


#: the queued ticket a fast-path call of this thread returned last, ``(cells, ticket)``, until taken
#: back (``Cells.handed``: the native ``HANDED``); stored without a call, so no handler runs between
_handed = threading.local()


def hold_record(cells: Any, recs: tuple, rec: Optional[int], ticket: int) -> Optional[int]:
    """The ticket record a grab about to queue ``ticket`` holds, ``ticket`` in its TICKET word:
    ``rec``, or one of ``recs`` claimed when ``rec`` is None (``claim_record``); None when every
    one is in use.  The grab stores its LEN right after its CAS, or frees it."""
    if rec is None:
        return claim_record(cells, recs, ticket)
    cells.store(rec - WORD, ticket)
    return rec


class Cells(abc.ABC):
    """An atomic backend over one mapping: what every module above the atomic layer may call.

    Offsets are byte offsets of 8-aligned words inside the mapping; values are unsigned 64-bit.
    Every operation is sequentially consistent.  A backend provides the primitives (the abstract
    methods); the composites here are the one Python copy, which the ``atomics`` backend runs and
    the native one (registered, not derived) does in C, the same steps.
    """

    #: the backend's name: "native" or "atomics"
    backend: str = ""
    #: bytes of the mapping the cells may touch
    size: int = 0
    #: the last records tuple ``clamp_words`` checked every offset of (see there)
    _clamp_checked: Tuple[int, ...] = ()

    @abc.abstractmethod
    def load(self, off: int) -> int: ...

    def handed(self) -> Optional[int]:
        """The queued ticket the last fast-path call of this thread on these cells returned (a
        recorded ``Grabber``'s, a ``Gate``'s ``grab_within``, the slow path's ``take_tail``), once;
        else None.  A signal handler may raise after that call stored it here and before its
        caller stored the value: the caller's except clause finds it here (``give_back_unowned``)."""
        last = getattr(_handed, "last", None)
        if last is None or last[0] is not self:
            return None
        _handed.last = None
        return last[1]

    @abc.abstractmethod
    def store(self, off: int, value: int) -> None: ...

    @abc.abstractmethod
    def fetch_add(self, off: int, delta: int) -> int:
        """Add ``delta`` (0 <= delta < 2**64) modulo 2**64; return the previous value."""

    @abc.abstractmethod
    def cas(self, off: int, expected: int, desired: int) -> bool:
        """Store ``desired`` if the word equals ``expected``; say whether it did."""

    @abc.abstractmethod
    def leave_waiters(self) -> None:
        """Every native wait of this process returns, and any later one at once, the mapping kept
        (``close``'s first half): from then on no native loop grants a ticket, and no grab bound to
        ticket records (a ``grabber``'s, a ``gate``'s ``grab_within``) takes anything: it answers as
        when every record is in use, so nothing is written into a slot its process is leaving."""

    @abc.abstractmethod
    def close(self) -> None: ...

    def wake_waiters(self) -> None:
        """Every native wait of this process on these cells steps again now (the head skipped a
        range given back: ``giveback``).  The ``atomics`` backend has no native wait."""
        return None

    @abc.abstractmethod
    def futex_wait(self, off: int, expected: int, bitset: int, deadline_ns: int) -> bool:
        """Sleep while the low 32 bits of the word hold ``expected``'s, for the bits of ``bitset``, until
        ``deadline_ns`` (CLOCK_MONOTONIC): False once the deadline passed, else True (look again).
        A non-private futex: wakes from any process mapping the word reach it."""

    @abc.abstractmethod
    def futex_wake(self, off: int, bitset: int) -> int:
        """Wake the sleepers on the word, in any process, whose bitset meets ``bitset``; how many."""

    # -- the composites ------------------------------------------------------------------------

    def take_tail(
        self,
        tail: int,
        head: int,
        grants: int,
        recs: Tuple[int, ...],
        expected: int,
        ticket: int,
        amount: int,
        ops: int,
    ) -> Union[None, bool, int]:
        """The slow path's take (``Bucket.take_within`` bound to ``recs``): one try of its CAS of the
        word ``tail`` from ``expected`` to ``ticket``, by a grab's record protocol (``claim_record``
        before the CAS when the head is short of ``ticket``, LEN ``amount`` stored after it), the
        queued ticket left in ``handed()``.  Natively one call, so no claim outlives it and no ticket
        it takes leaves it unrecorded or out of ``handed()``: a handler raising as it returns finds
        the ticket there (``Request.end`` gives it back).  Here, in Python, a handler raising inside
        it may still leave the ticket unrecorded (its record is freed), as it could before.

        False: the tail was no longer ``expected`` (nothing taken, the record freed again); 0: it
        would queue and every record is in use (nothing taken); None: covered (``ops`` counted at
        ``grants``, the record freed); True: queued without a record (only on words that went
        back); else the LEN offset of the record that holds the queued ticket."""
        check_records(recs, self.size)  # (all of them before any word is touched)
        rec = None
        try:
            if signed(ticket - self.load(head)) > 0:
                rec = claim_record(self, recs, ticket)
                if rec is None:
                    return 0
            if not self.cas(tail, expected, ticket):
                return False
            if signed(self.load(head) - ticket) >= 0:  # covered: granted (its record freed below)
                self.fetch_add(grants, ops)
                return None
            if rec is None:
                return True
            _handed.last = (self, ticket)  # (before the LEN store: see Cells.handed)
            self.store(rec, amount)
            held, rec = rec, None
            return held
        finally:
            if rec is not None:  # claimed and not holding a ticket (a CAS lost, covered, a raise)
                self.cas(rec, REC_BUSY, 0)

    def load_many(self, offsets: Tuple[int, ...]) -> Tuple[int, ...]:
        """The words at ``offsets``, each one ``load`` (not a snapshot of them together): a scan
        of many words in one call (the native backend makes it one C loop)."""
        if not isinstance(offsets, tuple):
            raise TypeError("load_many: offsets must be a tuple of ints")
        return tuple(self.load(off) for off in offsets)

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

    fence_scan = fence_scan

    def grab(self, tail: int, head: int, amount: int, grants: int, ops: int) -> GrabResult:
        """Advance the tail rover by ``amount`` (CAS), unless the queue would exceed ``MAX_QUEUE``.

        Returns ``None`` when the head already covers the new tail (granted at
        once; ``ops`` is then added to the counter cell ``grants``), ``False``
        when ``TAIL - HEAD`` would exceed ``MAX_QUEUE`` tokens (nothing
        touched), else the ticket (the new tail) that the caller must wait for.
        The head only grows, so a depth measured against a head read before
        the CAS is never smaller than the true one.
        """
        return self.grabber(None, 0, tail, head, amount, grants, ops)()

    def grab_if(
        self, seq: int, expected: int, tail: int, head: int, amount: int, grants: int, ops: int
    ) -> GrabResult:
        """``grab``, unless the word ``seq`` no longer holds ``expected``: then False, nothing touched
        (as when the queue is full: either way the caller takes the slow path).

        The acquire fast path in one call: ``seq`` is the config's sequence
        word, so a grab is never priced with a config another process replaced.
        """
        return self.grabber(seq, expected, tail, head, amount, grants, ops)()

    def grabber(self, *args: Any) -> "Grabber":
        """``grab_if`` with its arguments bound (and checked) once: a ``Grabber``."""
        return Grabber(self, *args)

    def try_grab(self, tail: int, head: int, amount: int, grants: int, ops: int) -> bool:
        """Advance the tail by ``amount`` only if the head covers it (CAS); never queue.

        On success ``ops`` is added to the counter cell ``grants``.  On failure
        nothing in the segment has changed.
        """
        self._check(tail, head, grants)
        check_value(ops)
        r = raw_words(self)
        r.enter()
        try:
            if take(r.w, r.cas, tail // WORD, head // WORD, r.base + tail, amount) is None:
                return False
            r.add(r.base + grants, ops)
            return True
        finally:
            r.exit()

    def gate(self, *args: Any) -> "Gate":
        """``try_acquire`` and a timed ``acquire`` of one config, each in one call: a ``Gate``."""
        return Gate(self, *args)

    def waiter(
        self,
        words: Tuple[int, ...],
        expected: int,
        grants: int,
        waiting: Optional[int],
        tpn: int,
        cap: int,
        slack_ns: int,
        records: Tuple[int, ...],
        fences: Tuple[int, int, int],
    ) -> None:
        """None: a wait loop is worth having only natively, where it sleeps without the GIL and
        without returning to Python between naps; here waiters wait in Python.  ``words``: the
        bucket's word offsets (``rovers.WAITER_WORDS``); ``fences``: (FENCE_HINT, the first
        record's START, how many records)."""
        if len(words) != 11 or len(fences) != 3:
            raise TypeError("waiter: words must be 11 word offsets, fences (hint, first, count)")
        hint, first, count = fences
        self._check(
            *words,
            grants,
            *records,
            *([] if waiting is None else [waiting]),
            hint,
            first + max(0, count - 1) * FENCE_STRIDE + FENCE_TOKENS_W,
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


class Grabber:
    """``grab_if`` bound to its words (``grabber``): a callable taking none, answering as ``grab``.

    Tickets come from the tail in CAS order, as from a fetch-add: FIFO holds.  With ``recs`` (a
    tuple of ticket records' LEN offsets) it queues only holding one of them (``claim_record``),
    and answers False, taking nothing, while all are in use or the slot is being left (close).
    Without ``seq`` (None) it is ``grab``: no config word to check.
    """

    __slots__ = (
        "c",
        "w",
        "cas",
        "add",
        "enter",
        "exit",
        "i_seq",
        "i_tail",
        "i_head",
        "a_tail",
        "a_grants",
        "expected",
        "amount",
        "ops",
        "recs",
    )

    def __init__(
        self,
        cells: Any,
        seq: Optional[int],
        expected: int,
        tail: int,
        head: int,
        amount: int,
        grants: int,
        ops: int,
        recs: Optional[tuple] = None,
    ) -> None:
        for off in (tail, head, grants) if seq is None else (seq, tail, head, grants):
            check_offset(off, cells.size)
        check_value(expected), check_value(amount), check_value(ops)
        if recs is not None:
            check_records(recs, cells.size)
        r = raw_words(cells)
        self.c, self.w, self.cas, self.add, self.enter, self.exit = (cells,) + r[:3] + r[4:]
        self.i_seq = None if seq is None else seq // WORD
        self.i_tail, self.i_head = tail // WORD, head // WORD
        self.a_tail, self.a_grants = r.base + tail, r.base + grants
        self.expected, self.amount, self.ops, self.recs = expected, amount, ops, recs

    def __call__(self) -> GrabResult:
        recorded = self.recs is not None
        if not self.enter(recorded):
            return False  # the slot is being left (close): the slow path refuses
        try:
            w = self.w
            if self.i_seq is not None and w[self.i_seq] != self.expected:
                return False
            cas = self.cas
            t = w[self.i_tail]
            rec = None
            while True:
                ticket = (t + self.amount) & MASK64
                depth = (ticket - w[self.i_head]) & MASK64
                if depth < 1 << 63 and depth:
                    if depth > MAX_QUEUE:
                        if rec is not None:
                            self.c.store(rec, 0)
                        return False  # the queue is full: the slow path raises, nothing touched
                    if recorded:  # it would queue: not without a record
                        rec = hold_record(self.c, self.recs, rec, ticket)
                        if rec is None:
                            return False
                found = cas(self.a_tail, t, ticket)
                if found == t:
                    break
                t = found
            if ((w[self.i_head] - ticket) & MASK64) >> 63:
                # uncovered now, so it was at the last look: recorded if bound to records (a
                # stale head only sends the caller to wait, where it loads it again).  Only a head
                # moved back by a writer of the words finds no record here: one is claimed now, or,
                # none free, the taken ticket counts as granted, as the native grab does
                if recorded and rec is None:
                    rec = claim_record(self.c, self.recs, ticket)
                    if rec is None:
                        self.add(self.a_grants, self.ops)
                        return None
                if rec is not None:
                    _handed.last = (
                        self.c,
                        ticket,
                    )  # (before the call: a handler may raise after it)
                    self.c.store(rec, self.amount)
                return ticket
            if rec is not None:
                self.c.store(rec, 0)
            self.add(self.a_grants, self.ops)
            return None
        finally:
            self.exit(recorded)


def check_now(now_ns: Optional[int]) -> None:
    """A gate's ``now_ns``: None (the gate's clock), or a CLOCK_MONOTONIC reading >= 1 (ns)."""
    if now_ns is not None and not (type(now_ns) is int and 1 <= now_ns <= MASK64):
        raise ValueError(
            f"now_ns must be an int from 1 to 2**64 - 1 (a CLOCK_MONOTONIC reading), not {now_ns!r}"
        )


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
    over-estimates, so a certain refusal is never a wrong one.  "Now" is
    ``clock()``, read only when a refusal is weighed, or the reading ``now_ns``
    a caller on an injected clock passes (CLOCK_MONOTONIC ns, >= 1).  With ticket
    records (``recs``) ``grab_within`` queues only holding one, else answers
    None; with ``fence_hint`` (FENCE_HINT) it answers None rather than queue
    while a reservation's fence may be in force (the slow path's wait counts
    it: ``Schedule.wait_ns``).  ``enter``, ``exit``, ``short``, ``take``,
    ``count`` and ``give_back`` are the steps of a ``MultiGate``.
    """

    def __init__(
        self,
        cells: Any,
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
        clock: Callable[[], int] = time.monotonic_ns,
    ) -> None:
        for off in (seq, tail, head, ceil, repl_ts, grants) + (
            () if fence_hint is None else (fence_hint,)
        ):
            check_offset(off, cells.size)
        if recs is not None:
            check_records(recs, cells.size)
        if tpn < 1 or pend_mul < 1 or not 1 <= amount <= 1 << 62 or not max_reserved_ns >= 0:
            raise ValueError(
                "gate: tpn, pend_mul and amount must be >= 1 (amount < 2**62), max_reserved_ns >= 0"
            )
        r = raw_words(cells)
        self.c, self.w, self.cas, self.add, self.enter, self.exit = (cells,) + r[:3] + r[4:]
        self.i_seq, self.i_tail, self.i_head = seq // WORD, tail // WORD, head // WORD
        self.i_ceil, self.i_ts = ceil // WORD, repl_ts // WORD
        self.i_hint = None if fence_hint is None else fence_hint // WORD
        self.a_tail, self.a_head, self.a_grants = r.base + tail, r.base + head, r.base + grants
        self.expected, self.amount, self.ops, self.recs = expected, amount, ops, recs
        self.tpn, self.pend_mul, self.capped = tpn, pend_mul, bool(capped)
        self.max_reserved_ns, self.clock = max_reserved_ns, clock
        #: ``take(amount)``: the tail advanced by ``amount`` while the head covers it (``take``)
        self.take = functools.partial(take, r.w, r.cas, self.i_tail, self.i_head, self.a_tail)

    def pending(self, now_ns: Optional[int] = None) -> int:
        """At most how many tokens a replenish starting at ``now_ns`` (None: now) could add."""
        now = self.clock() if now_ns is None else now_ns
        # a stale REPL_TS only over-estimates
        return max(0, now - self.w[self.i_ts]) * self.tpn * self.pend_mul

    def try_grab(self, now_ns: Optional[int] = None) -> Optional[bool]:
        check_now(now_ns)
        self.enter()
        try:
            w = self.w
            if w[self.i_seq] != self.expected:
                return None
            cas = self.cas
            t = w[self.i_tail]
            while True:
                want = (t + self.amount) & MASK64
                short = signed(want - w[self.i_head])
                if short > 0:
                    return False if short > self.pending(now_ns) else None
                found = cas(self.a_tail, t, want)
                if found == t:
                    self.add(self.a_grants, self.ops)
                    return True
                t = found
        finally:
            self.exit()

    def grab_within(self, timeout: object, now_ns: Optional[int] = None) -> Union[bool, int, None]:
        check_now(now_ns)
        t = plain_seconds(timeout)
        if t is None:
            return None
        recorded = self.recs is not None
        rec = None  # the record claimed for the ticket, once it would queue
        if not self.enter(recorded):
            return None  # the slot is being left (close): undecided, the slow path refuses
        try:
            w = self.w
            if w[self.i_seq] != self.expected:
                return None
            max_wait_ns = min(t * 1e9, self.max_reserved_ns)
            cas = self.cas
            tail = w[self.i_tail]
            while True:
                want = (tail + self.amount) & MASK64
                short = signed(want - w[self.i_head])
                if short > 0:
                    if short / self.tpn > max_wait_ns:
                        pend = self.pending(now_ns)
                        return (
                            False
                            if short > pend and (short - pend) / self.tpn > max_wait_ns
                            else None
                        )
                    if self.i_hint is not None and w[self.i_hint] > w[self.i_ts]:
                        return None  # a reservation's fence may hold it (its DUE after REPL_TS)
                    if self.capped and signed(want - w[self.i_ceil]) > 0:
                        return False  # beyond the released budget: no computable wait, no replenish helps
                    if recorded:  # no queued ticket without a record
                        rec = hold_record(self.c, self.recs, rec, want)
                        if rec is None:
                            return None
                    found = cas(self.a_tail, tail, want)
                    if found == tail:
                        if rec is not None:
                            _handed.last = (self.c, want)  # (no call before: see Cells.handed)
                            held, rec = rec, None
                            self.c.store(held, self.amount)
                        return want
                else:
                    found = cas(self.a_tail, tail, want)
                    if found == tail:
                        self.add(self.a_grants, self.ops)
                        return True
                tail = found
        finally:
            if rec is not None:  # claimed and not used: free again
                self.c.store(rec, 0)
            self.exit(recorded)

    # -- the steps of a try over several rates (``MultiGate``), under one ``enter``/``exit`` --------

    def short(self, amount: int) -> Optional[int]:
        """Tokens this rate lacks for ``amount`` now (<= 0: it has room), or None when the config
        is no longer the gate's.  Touches nothing."""
        w = self.w
        if w[self.i_seq] != self.expected:
            return None
        return signed(w[self.i_tail] + amount - w[self.i_head])

    def count(self, mult: int) -> None:
        """Count ``mult`` grants of this gate's ``ops``."""
        self.add(self.a_grants, self.ops * mult)

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
        w = self.w
        head = w[self.i_head]
        while True:
            back = amount - max(0, signed(head - head_then))
            if back <= 0:
                return
            add = min(back, signed(w[self.i_tail] + cap - head))
            if add <= 0:
                return
            found = self.cas(self.a_head, head, (head + add) & MASK64)
            if found == head:
                return
            head = found


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

    def try_grab(self, now_ns: Optional[int] = None) -> Optional[bool]:
        """One op on every rate (a refusal judged at ``now_ns``, an injected clock's reading, if given)."""
        check_now(now_ns)
        return self._try(self._ones, now_ns)

    def try_grab_ops(self, ops: object, now_ns: Optional[int] = None) -> Optional[bool]:
        """``ops`` per rate (a tuple, 0 for a rate not taken; a dict by the rates' names, those
        not named 0) or one int for every rate; None, touching nothing, for anything but plain
        ints >= 0 with one > 0, a name not a rate's, or more tokens than a rate's capacity (the
        slow path queues that or raises)."""
        check_now(now_ns)
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
        return self._try(mult, now_ns)

    def _try(self, mult: Sequence[int], now_ns: Optional[int]) -> Optional[bool]:
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
                        certain = certain or short > g.pending(now_ns)
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
