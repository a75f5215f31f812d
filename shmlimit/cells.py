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


class AtomicsCells(CompositesFromPrimitives):
    """Backend on the ``atomics`` package: one atomic view per word, opened on first use.

    The package releases the GIL inside each operation and works on a raw
    pointer, so a ``close`` (which unmaps) racing another thread's operation
    would touch freed memory.  Every operation therefore counts itself in
    ``_active`` while it runs, and ``close`` waits until none is running:
    every later operation raises ValueError, as on the native backend.  The
    lock guards only the count (no allocation that could run the garbage
    collector, and with it a ``__del__`` taking other locks, happens under it).
    """

    backend = "atomics"

    def __init__(self, mm: mmap.mmap, size: int) -> None:
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
            return self._view(off).load()
        finally:
            self._exit()

    def store(self, off: int, value: int) -> None:
        check_value(value)
        self._enter()
        try:
            self._view(off).store(value)
        finally:
            self._exit()

    def fetch_add(self, off: int, delta: int) -> int:
        check_value(delta)
        self._enter()
        try:
            return self._view(off).fetch_add(delta)
        finally:
            self._exit()

    def cas(self, off: int, expected: int, desired: int) -> bool:
        check_value(expected)
        check_value(desired)
        self._enter()
        try:
            return self._view(off).cmpxchg_strong(expected, desired).success
        finally:
            self._exit()

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            while self._active:  # an operation in progress in another thread: let it finish
                self._idle.wait()
        # closed, and no operation runs: nobody touches the views any more
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
