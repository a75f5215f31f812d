"""The atomic layer: every shared-memory word is read and written here, and only here.

A *cell* is an aligned, unsigned 64-bit word of the segment, named by its byte
offset.  All arithmetic wraps modulo 2**64 (the rovers rely on it, as Seastar's
do).  Every operation is sequentially consistent.

Two backends implement the same four operations (and the composites built on
them), and both satisfy the ``Cells`` protocol:

* ``native``  -- the optional C extension ``shmlimit._native`` (built with the
  package when a compiler is present): one C call per operation.
* ``atomics`` -- the portable ``atomics`` package: the reference, and the
  fallback when the extension is missing.

``SHMLIMIT_BACKEND=atomics`` or ``=native`` forces one; by default the native
backend is used when it imports.  Bounds are checked by every backend: an offset
that is not 8-aligned or not inside the mapping raises ``IndexError`` before any
memory is touched.
"""
from __future__ import annotations

import functools
import mmap
import os
import platform
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Protocol, Tuple, Union, runtime_checkable

MASK64 = (1 << 64) - 1
#: Tokens the queue (TAIL - HEAD) may hold at most: far below 2**63, so every signed comparison
#: of rovers holds whatever is queued.  The native backend has the same constant.
MAX_QUEUE = 1 << 62
WORD = 8

BACKENDS = ("native", "atomics")


#: What a grab of the fast path answers: None (granted), a ticket to wait for, or False (not tried).
GrabResult = Union[None, int, bool]


@runtime_checkable
class Cells(Protocol):
    """An atomic backend over one mapping: what every module above this one may call.

    Offsets are byte offsets of 8-aligned words inside the mapping; values are
    unsigned 64-bit.  Every operation is sequentially consistent.  The
    composites (``grab`` ... ``try_grab``) are specified by the reference
    versions in ``CompositesFromPrimitives``.
    """

    @property
    def backend(self) -> str:
        """The backend's name: "native" or "atomics"."""
        ...

    @property
    def size(self) -> int:
        """Bytes of the mapping the cells may touch."""
        ...

    def load(self, off: int) -> int: ...

    def store(self, off: int, value: int) -> None: ...

    def fetch_add(self, off: int, delta: int) -> int:
        """Add ``delta`` (0 <= delta < 2**64) modulo 2**64; return the previous value."""
        ...

    def cas(self, off: int, expected: int, desired: int) -> bool:
        """Store ``desired`` if the word equals ``expected``; say whether it did."""
        ...

    def close(self) -> None: ...

    def grab(self, tail: int, head: int, amount: int, grants: int, ops: int) -> GrabResult: ...

    def grab_if(
        self, seq: int, expected: int, tail: int, head: int, amount: int, grants: int, ops: int
    ) -> GrabResult: ...

    def grabber(
        self, seq: int, expected: int, tail: int, head: int, amount: int, grants: int, ops: int
    ) -> Callable[[], GrabResult]: ...

    def try_grab(self, tail: int, head: int, amount: int, grants: int, ops: int) -> bool: ...

    def keyed_table(self, *offsets_and_params: int) -> Any:
        """The keyed slot table's composite (find/insert/evict + a GCRA step): see ``keyed_cells``."""
        ...

    def gate(
        self, seq: int, expected: int, tail: int, head: int, ceil: int, repl_ts: int, grants: int, amount: int,
        ops: int, tpn: int, pend_mul: int, capped: bool, max_reserved_ns: float,
    ) -> Any:
        """``try_grab()`` and ``grab_within(timeout)`` of one config, bound once (see ``Gate``)."""
        ...


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
        self, cells: Cells, seq: int, expected: int, tail: int, head: int, ceil: int, repl_ts: int, grants: int,
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


def signed(d: int) -> int:
    """A difference of two rovers as a signed 64-bit number."""
    d &= MASK64
    return d - (1 << 64) if d >> 63 else d


def plain_seconds(timeout: object) -> Optional[float]:
    """A timeout the fast path can use (an int or float, finite, >= 0), else None (the slow path decides)."""
    if type(timeout) is not float and type(timeout) is not int:
        return None
    try:
        t = float(timeout)  # type: ignore[arg-type]
    except OverflowError:
        return None
    return t if 0 <= t < float("inf") else None


def check_value(value: int) -> int:
    if not 0 <= value <= MASK64:
        raise OverflowError(f"cell values are unsigned 64-bit: {value} is out of range")
    return value


def check_offset(off: int, size: int) -> None:
    """Refuse any offset that would touch memory outside the mapping."""
    if off % WORD or off < 0 or off + WORD > size:
        raise IndexError(f"cell offset {off} outside the mapping of {size} bytes (must be 8-aligned, < {size - WORD + 1})")


#: An aligned 8-byte load compiles to one instruction, single-copy atomic, on these machines.
_PLAIN_LOADS_ATOMIC = platform.machine().lower() in ("x86_64", "amd64", "aarch64", "arm64")
_SEQ_CST = 5  # the atomics package's (patomic's) number for memory_order_seq_cst


class _Scratch:
    """Per-thread argument and result words for direct calls (another thread may run between
    a call and the read of its result, so two threads never share these)."""

    __slots__ = ("a", "b", "pa", "pb")

    def __init__(self) -> None:
        import ctypes

        self.a = ctypes.c_uint64()
        self.b = ctypes.c_uint64()
        self.pa = ctypes.addressof(self.a)
        self.pb = ctypes.addressof(self.b)


class _Patomic:
    """The ``atomics`` package's own native operations on 8-byte words, called directly.

    Its public wrapper spends 8-20 us per operation building buffers and
    checking arguments; the operation itself is one call into its patomic
    library.  This takes the function pointers the package resolved for an
    8-byte word and calls them (holding the GIL, as the wrapper's own calls
    hardly last) at the word's address: about 0.6 us each.  It reaches into
    the package's internals, so any failure to find them makes the backend use
    the public API instead (``AtomicsCells`` tests both).
    """

    def __init__(self, buf: memoryview) -> None:
        import ctypes
        import threading

        import atomics
        from atomics._impl.enums import OpType

        ctx = atomics.atomicview(buffer=buf[:WORD], atype=atomics.UINT)
        view = ctx.__enter__()
        try:
            core = view._core
            base = core.address

            def raw(op: Any, *sig: Any) -> Any:
                fp = core.get_op_func(op)
                if fp is None:
                    raise LookupError(f"atomics has no native {op.name} for 8-byte words here")
                return ctypes.PYFUNCTYPE(*sig)(ctypes.cast(fp, ctypes.c_void_p).value)

            vp, i = ctypes.c_void_p, ctypes.c_int
            self._ld = raw(OpType.LOAD, None, vp, i, vp)
            self._st = raw(OpType.STORE, None, vp, vp, i)
            self._fa = raw(OpType.FETCH_ADD, None, vp, vp, i, vp)
            self._cx = raw(OpType.CMPXCHG_STRONG, i, vp, vp, vp, i, i)
        except BaseException:
            ctx.__exit__(None, None, None)
            raise
        self.base = base
        self._ctx = ctx  # keeps the buffer exported (the mapping cannot be closed) until close()
        self._tls = threading.local()

    def _scratch(self) -> _Scratch:
        try:
            return self._tls.s
        except AttributeError:
            s = self._tls.s = _Scratch()
            return s

    def load(self, addr: int) -> int:
        s = self._scratch()
        self._ld(addr, _SEQ_CST, s.pa)
        return s.a.value

    def store(self, addr: int, value: int) -> None:
        s = self._scratch()
        s.a.value = value
        self._st(addr, s.pa, _SEQ_CST)

    def fetch_add(self, addr: int, delta: int) -> int:
        s = self._scratch()
        s.a.value = delta
        self._fa(addr, s.pa, _SEQ_CST, s.pb)
        return s.b.value

    def cas(self, addr: int, expected: int, desired: int) -> int:
        """Compare-and-swap; returns the value found (``expected`` exactly when it succeeded)."""
        s = self._scratch()
        s.a.value = expected
        s.b.value = desired
        self._cx(addr, s.pa, s.pb, _SEQ_CST, _SEQ_CST)
        return s.a.value

    def close(self) -> None:
        self._ctx.__exit__(None, None, None)


class _Words:
    """Index -> value of the mapping's words by atomic load: the peek when plain loads are not atomic."""

    def __init__(self, p: _Patomic, cells: "AtomicsCells") -> None:
        self.p = p
        self.cells = cells

    def __getitem__(self, i: int) -> int:
        if self.cells._closed:
            raise ValueError("cells are closed")
        return self.p.load(self.p.base + i * WORD)


class AtomicsCells(CompositesFromPrimitives):
    """Backend on the ``atomics`` package.

    Each operation is one call into the package's native library (see
    ``_Patomic``), or, where its internals are not found, one call of its
    public API on a view of the word.  The hot-path composites need at most
    two atomic operations for an uncontended grant (the tail's CAS and the
    grant count): every other word they read only grows (the rovers,
    ``REPL_TS``) or is re-checked by the protocol (``CFG_SEQ``), so a plain
    load, which may be stale, is safe -- a stale rover only makes a grant look
    further away, never nearer.

    Operations work on raw pointers, so a ``close`` (which unmaps) racing
    another thread's operation would touch freed memory.  Every operation (a
    composite counts as one) therefore counts itself in ``_active`` while it
    runs, and ``close`` waits until none is running: every later operation
    raises ValueError, as on the native backend.  The lock guards only the
    count (no allocation that could run the garbage collector, and with it a
    ``__del__`` taking other locks, happens under it).
    """

    backend = "atomics"

    def __init__(self, mm: mmap.mmap, size: int, direct: bool = True) -> None:
        import atomics  # imported here so the native path never pays for it

        self._atomics = atomics
        self.size = size
        self._buf = memoryview(mm)[:size]
        self._views: Dict[int, object] = {}
        self._contexts: List[Tuple[Any, memoryview]] = []
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._active = 0
        self._closed = False
        self._p: Optional[_Patomic] = None
        self._words: Any = None
        if direct and size >= WORD:
            try:
                self._p = _Patomic(self._buf)
            except Exception:  # another version of the package: its public API still works
                self._p = None
        if self._p is not None:
            self._base = self._p.base
            if _PLAIN_LOADS_ATOMIC and size % WORD == 0:
                self._words = self._buf.cast("Q")
            else:
                self._words = _Words(self._p, self)

    @property
    def _direct(self) -> bool:
        """True when operations call the package's native library directly (the fast way)."""
        return self._p is not None

    def _enter(self) -> None:
        with self._lock:
            closed = self._closed
            if not closed:
                self._active += 1
        if closed:
            raise ValueError("cells are closed")

    def _exit(self) -> None:
        with self._lock:
            self._active -= 1
            if self._closed and not self._active:
                self._idle.notify_all()

    def _view(self, off: int):
        view = self._views.get(off)
        if view is None:
            check_offset(off, self.size)
            sub = self._buf[off:off + WORD]
            ctx = self._atomics.atomicview(buffer=sub, atype=self._atomics.UINT)
            view = ctx.__enter__()
            self._contexts.append((ctx, sub))
            self._views[off] = view
        return view

    def load(self, off: int) -> int:
        self._enter()
        try:
            if self._p is None:
                return self._view(off).load()
            check_offset(off, self.size)
            return self._p.load(self._base + off)
        finally:
            self._exit()

    def store(self, off: int, value: int) -> None:
        check_value(value)
        self._enter()
        try:
            if self._p is None:
                self._view(off).store(value)
            else:
                check_offset(off, self.size)
                self._p.store(self._base + off, value)
        finally:
            self._exit()

    def fetch_add(self, off: int, delta: int) -> int:
        check_value(delta)
        self._enter()
        try:
            if self._p is None:
                return self._view(off).fetch_add(delta)
            check_offset(off, self.size)
            return self._p.fetch_add(self._base + off, delta)
        finally:
            self._exit()

    def cas(self, off: int, expected: int, desired: int) -> bool:
        check_value(expected)
        check_value(desired)
        self._enter()
        try:
            if self._p is None:
                return self._view(off).cmpxchg_strong(expected, desired).success
            check_offset(off, self.size)
            return self._p.cas(self._base + off, expected, desired) == expected
        finally:
            self._exit()

    # -- the hot-path composites: at most two atomic operations for an uncontended grant

    def grabber(self, seq: int, expected: int, tail: int, head: int, amount: int, grants: int, ops: int):
        if self._p is None:
            return super().grabber(seq, expected, tail, head, amount, grants, ops)
        self._check(seq, tail, head, grants)
        check_value(expected), check_value(amount), check_value(ops)
        return _AtomicsGrabber(self, seq, expected, tail, head, amount, grants, ops)

    def gate(self, seq, expected, tail, head, ceil, repl_ts, grants, amount, ops, tpn, pend_mul, capped,
             max_reserved_ns):
        if self._p is None:
            return super().gate(seq, expected, tail, head, ceil, repl_ts, grants, amount, ops, tpn, pend_mul,
                                capped, max_reserved_ns)
        self._check(seq, tail, head, ceil, repl_ts, grants)
        return _AtomicsGate(self, seq, expected, tail, head, ceil, repl_ts, grants, amount, ops, tpn, pend_mul,
                            capped, max_reserved_ns)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            while self._active:  # an operation in progress in another thread: let it finish
                self._idle.wait()
        # closed, and no operation runs: nobody touches the words any more
        if isinstance(self._words, memoryview):
            self._words.release()
        if self._p is not None:
            self._p.close()
        for ctx, sub in self._contexts:
            ctx.__exit__(None, None, None)
            sub.release()
        self._contexts.clear()
        self._views.clear()
        self._buf.release()

    def __del__(self) -> None:
        # the atomics package complains when a view is collected while still entered
        try:
            self.close()
        except Exception:
            pass


class _AtomicsGrabber:
    """``grab_if`` bound to its words on the atomics backend: plain loads, the tail's CAS, the count.

    Tickets come from the tail in CAS order, as from a fetch-add: FIFO holds.  Each call counts
    as one operation of its cells (``close`` waits for it; a call after ``close`` raises).
    """

    __slots__ = ("c", "w", "p", "i_seq", "i_tail", "i_head", "a_tail", "a_grants", "expected", "amount", "ops")

    def __init__(self, c: AtomicsCells, seq: int, expected: int, tail: int, head: int, amount: int, grants: int,
                 ops: int) -> None:
        self.c, self.w, self.p = c, c._words, c._p
        self.i_seq, self.i_tail, self.i_head = seq // WORD, tail // WORD, head // WORD
        self.a_tail, self.a_grants = c._base + tail, c._base + grants
        self.expected, self.amount, self.ops = expected, amount, ops

    def __call__(self) -> GrabResult:
        self.c._enter()
        try:
            w = self.w
            if w[self.i_seq] != self.expected:
                return False
            cas = self.p.cas
            t = w[self.i_tail]
            while True:
                ticket = (t + self.amount) & MASK64
                depth = (ticket - w[self.i_head]) & MASK64
                if depth < 1 << 63 and depth > MAX_QUEUE:
                    return False  # the queue is full: the slow path raises, nothing touched
                found = cas(self.a_tail, t, ticket)
                if found == t:
                    break
                t = found
            if ((w[self.i_head] - ticket) & MASK64) >> 63:
                return ticket  # (a stale head only sends the caller to wait, where it loads it again)
            self.p.fetch_add(self.a_grants, self.ops)
            return None
        finally:
            self.c._exit()


class _AtomicsGate(Gate):
    """The ``Gate`` on the atomics backend: plain loads; a grant is the tail's CAS and the count.

    Each call counts as one operation of its cells, as ``_AtomicsGrabber``'s.
    """

    def __init__(self, c: AtomicsCells, *args: Any) -> None:
        super().__init__(c, *args)
        base = c._base
        self.c, self.w, self.p = c, c._words, c._p
        self.i_seq, self.i_tail, self.i_head = self.seq // WORD, self.tail // WORD, self.head // WORD
        self.i_ceil, self.i_ts = self.ceil // WORD, self.repl_ts // WORD
        self.a_tail, self.a_grants = base + self.tail, base + self.grants

    def pending(self) -> int:
        elapsed = self.clock() - self.w[self.i_ts]  # a stale REPL_TS only over-estimates
        return max(0, elapsed) * self.tpn * self.pend_mul

    def try_grab(self) -> Optional[bool]:
        self.c._enter()
        try:
            w = self.w
            if w[self.i_seq] != self.expected:
                return None
            cas = self.p.cas
            t = w[self.i_tail]
            while True:
                want = (t + self.amount) & MASK64
                short = signed(want - w[self.i_head])
                if short > 0:
                    return False if short > self.pending() else None
                found = cas(self.a_tail, t, want)
                if found == t:
                    self.p.fetch_add(self.a_grants, self.ops)
                    return True
                t = found
        finally:
            self.c._exit()

    def grab_within(self, timeout: object) -> Union[bool, int, None]:
        t = plain_seconds(timeout)
        if t is None:
            return None
        self.c._enter()
        try:
            w = self.w
            if w[self.i_seq] != self.expected:
                return None
            max_wait_ns = min(t * 1e9, self.max_reserved_ns)
            cas = self.p.cas
            tail = w[self.i_tail]
            while True:
                want = (tail + self.amount) & MASK64
                short = signed(want - w[self.i_head])
                if short > 0:
                    if short / self.tpn > max_wait_ns:
                        pend = self.pending()
                        return False if short > pend and (short - pend) / self.tpn > max_wait_ns else None
                    if self.capped and signed(want - w[self.i_ceil]) > 0:
                        return False
                    found = cas(self.a_tail, tail, want)
                    if found == tail:
                        return want
                else:
                    found = cas(self.a_tail, tail, want)
                    if found == tail:
                        self.p.fetch_add(self.a_grants, self.ops)
                        return True
                tail = found
        finally:
            self.c._exit()


def native_available() -> bool:
    try:
        from . import _native  # noqa: F401
    except ImportError:
        return False
    return True


def selected_backend() -> str:
    """The backend new attachments use: ``SHMLIMIT_BACKEND`` if set, else native when built."""
    forced = os.environ.get("SHMLIMIT_BACKEND", "").strip().lower()
    if forced:
        if forced not in BACKENDS:
            raise ValueError(f"SHMLIMIT_BACKEND must be one of {', '.join(BACKENDS)}, not {forced!r}")
        if forced == "native" and not native_available():
            raise ImportError("SHMLIMIT_BACKEND=native but the extension shmlimit._native is not built")
        return forced
    return "native" if native_available() else "atomics"


def warm_backend(backend: str | None = None) -> None:
    """Import the backend's module now, so that a first store into a new segment is not delayed."""
    if (backend or selected_backend()) == "atomics":
        import atomics  # noqa: F401


def open_cells(mm: mmap.mmap, size: int, backend: str | None = None) -> Cells:
    """Wrap ``size`` bytes of ``mm`` in the selected (or the named) backend."""
    backend = backend or selected_backend()
    if backend == "native":
        from ._native import NativeCells

        return NativeCells(mm, size)
    if backend == "atomics":
        return AtomicsCells(mm, size)
    raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, not {backend!r}")
