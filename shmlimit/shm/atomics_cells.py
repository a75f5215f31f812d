"""The ``atomics`` backend of the atomic layer: the portable reference, and the fallback
when the native extension is missing (``SHMLIMIT_BACKEND=atomics`` forces it).

It runs the composites of composites.py over its words (``_raw``): at most two atomic
operations for an uncontended grant.
"""

from __future__ import annotations

import mmap
import os
import platform
import threading
import weakref
from typing import Any, Callable, Dict, List, Optional, Tuple

from shmlimit.shm import futex
from shmlimit.shm.composites import Cells, Loads, Raw, checked_raw
from shmlimit.shm.words import WORD, check_bitset, check_offset, check_value

#: An aligned 8-byte load compiles to one instruction, single-copy atomic, on these machines.
_PLAIN_LOADS_ATOMIC = platform.machine().lower() in ("x86_64", "amd64", "aarch64", "arm64")
#: ... and on these it is also a sequentially consistent load (x86-64 orders every load, and a
#: sequentially consistent store is a locked instruction there: a plain load is what C11's
#: seq_cst load compiles to), so ``load`` itself may be one, without a call into the package.
_PLAIN_LOADS_SEQ_CST = platform.machine().lower() in ("x86_64", "amd64")
#: ``leave_waiters`` waits at most this long (seconds) for other threads' grabs bound to records.
SETTLE_S = 1.0
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
        finally:
            # Left at once: the view was needed only to find the word's address and the package's
            # functions (its library's, not the view's).  Kept entered, it outlived us whenever the
            # cells were collected in a cycle, and the package printed "Cannot call 'release'
            # while context is open" from its __del__.
            ctx.__exit__(None, None, None)
        self.base = base
        self._keep = buf[:WORD]  # an export: the mapping cannot be closed under our raw pointers
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
        self._keep.release()


class AtomicsCells(Cells):
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

    Those counts are of this process's threads: a forked child starts its own
    (``_forked``), as the native backend's ``busy`` does, so a child forked while
    another thread was inside an operation does not wait for it at its close.
    """

    backend = "atomics"

    def __init__(self, mm: mmap.mmap, size: int, direct: bool = True) -> None:
        import atomics  # imported here so the native path never pays for it

        self._atomics = atomics
        self.size = size
        self._buf = memoryview(mm)[:size]
        self._views: Dict[int, object] = {}
        self._contexts: List[Tuple[Any, memoryview]] = []
        self._closed = False
        #: ``leave_waiters`` begun: a grab bound to records then takes nothing (see ``_enter``)
        self._closing = False
        self._threads()
        #: Run (by the grabbing thread) when its last grab bound to records ends (see ``Writers.after``).
        self._after_recording: Optional[Callable[[], None]] = None
        self._p: Optional[_Patomic] = None
        self._rw: Optional[Raw] = None  # see _raw
        self._words: Any = None
        self._addr: Optional[int] = None
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
                self._words = Loads(self._p.load, self._base)
        #: the words, read by ``load`` itself where a plain load is a sequentially consistent one
        self._plain: Optional[memoryview] = (
            self._words if _PLAIN_LOADS_SEQ_CST and isinstance(self._words, memoryview) else None
        )
        _every.add(self)

    def _threads(self) -> None:
        """This process's count of its threads inside operations, from none: the operations under
        way (``_active``), the grabs bound to ticket records among them (every thread's,
        ``_recording``; ``_mine``: this thread's), and the lock guarding them."""
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._active = 0
        self._recording = 0
        self._mine = threading.local()

    def _forked(self) -> None:
        """In a forked child: the threads counted were the parent's, which do not exist here (one
        of them may even have held the lock).  Closed or closing stays as it was: that is the
        mapping's state, which the child copied."""
        self._threads()
        if self._p is not None:
            self._p._tls = threading.local()

    @property
    def _direct(self) -> bool:
        """True when operations call the package's native library directly (the fast way)."""
        return self._p is not None

    def _enter(self, recorded: bool = False) -> bool:
        """One operation begins (``close`` waits for it); ``recorded``: a grab bound to its process
        slot's ticket records, which answers False (nothing entered: it takes nothing) once
        ``leave_waiters`` began.  Such a grab is Python here, so a thread switch can come between its
        record's claim and its length store: ``leave_waiters`` waits for those under way and none
        begins after it, so the slot is never left under a half-written record, nor written once left."""
        with self._lock:
            closed, closing = self._closed, recorded and self._closing
            if not (closed or closing):
                self._active += 1
                self._recording += recorded
        if closed:
            raise ValueError("cells are closed")
        if recorded and not closing:
            self._mine.n = getattr(self._mine, "n", 0) + 1
        return not closing

    def _exit(self, recorded: bool = False) -> None:
        if recorded:
            self._mine.n -= 1
        with self._lock:
            self._active -= 1
            self._recording -= recorded
            if (self._closed and not self._active) or (recorded and self._closing):
                self._idle.notify_all()
        if recorded and not self._mine.n and self._after_recording is not None:
            self._after_recording()

    def _recording_here(self) -> bool:
        """Whether this thread is inside a grab bound to records (a close run by a signal handler
        that interrupted it: the grab is between its record's claim and its length store)."""
        return getattr(self._mine, "n", 0) > 0

    def _view(self, off: int):
        view = self._views.get(off)
        if view is None:
            check_offset(off, self.size)
            sub = self._buf[off : off + WORD]
            ctx = self._atomics.atomicview(buffer=sub, atype=self._atomics.UINT)
            view = ctx.__enter__()
            self._contexts.append((ctx, sub))
            self._views[off] = view
        return view

    def load(self, off: int) -> int:
        if self._plain is not None:
            # one plain read under the GIL: close() releases the view under the GIL too, so the
            # read either sees the mapping or raises ValueError (released), as a closed load must
            check_offset(off, self.size)
            try:
                return self._plain[off >> 3]
            except ValueError:
                raise ValueError("cells are closed") from None
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

    def _raw(self) -> Raw:
        """The composites' way to the words (``composites.Raw``): plain reads and the package's
        operations called directly (a composite is one operation for ``close``), else the
        checked primitives.  Built at the first composite, then kept."""
        r = self._rw
        if r is None:
            p = self._p
            r = self._rw = (
                checked_raw(self, self._enter, self._exit)
                if p is None
                else Raw(self._words, p.cas, p.fetch_add, self._base, self._enter, self._exit)
            )
        return r

    # -- the fed wait's futex (hierarchical mode): see futex.py

    def futex_wait(self, off: int, expected: int, bitset: int, deadline_ns: int) -> bool:
        check_bitset(bitset)
        check_value(expected), check_value(deadline_ns)
        self._enter()  # close() waits for the sleep to end: it is bounded by its deadline
        try:
            check_offset(off, self.size)
            return futex.wait(self._address() + off + futex.LOW_HALF, expected, bitset, deadline_ns)
        finally:
            self._exit()

    def futex_wake(self, off: int, bitset: int) -> int:
        check_bitset(bitset)
        self._enter()
        try:
            check_offset(off, self.size)
            return futex.wake(self._address() + off + futex.LOW_HALF, bitset)
        finally:
            self._exit()

    def _address(self) -> int:
        if self._addr is None:
            self._addr = self._base if self._p is not None else futex.address_of(self._buf)
        return self._addr

    def leave_waiters(self, timeout: float = SETTLE_S) -> None:
        """Close's first half: no grab bound to records takes anything from now on, and those of other
        threads under way end first (each is a few atomic operations; one stalled past ``timeout``
        seconds cannot; this thread's own, under a signal handler, has ended: the close ran after
        it, ``Writers.defer``).  This backend has no native wait: its waiters decide in Python, where a closed
        attachment grants nothing."""
        mine = getattr(self._mine, "n", 0)
        with self._lock:
            self._closing = True
            self._idle.wait_for(lambda: self._recording <= mine, timeout)

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


#: Every ``AtomicsCells`` of this process, each given its own thread counts in a forked child.
_every: "weakref.WeakSet[AtomicsCells]" = weakref.WeakSet()


def _after_fork() -> None:
    for cells in list(_every):
        cells._forked()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)
