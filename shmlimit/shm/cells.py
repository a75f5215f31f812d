"""The atomic layer: every shared-memory word is read and written here, and only here.

A *cell* is an aligned, unsigned 64-bit word of the segment, named by its byte
offset.  All arithmetic wraps modulo 2**64 (the rovers rely on it, as Seastar's
do).  Every operation is sequentially consistent.

Two backends implement the same four operations (and the composites built on
them), and both satisfy the ``Cells`` protocol:

* ``native``  -- the optional C extension ``shmlimit.shm._native`` (built with the
  package when a compiler is present): one C call per operation.
* ``atomics`` -- the portable ``atomics`` package: the reference, and the
  fallback when the extension is missing.

``SHMLIMIT_BACKEND=atomics`` or ``=native`` forces one; by default the native
backend is used when it imports.  Bounds are checked by every backend: an offset
that is not 8-aligned or not inside the mapping raises ``IndexError`` before any
memory is touched.

This module is the layer's face: the ``Cells`` protocol and the choice of a
backend.  The word's constants and checks live in words.py, the reference
composites (and ``Gate``, ``MultiGate``) in composites.py, the ``atomics`` backend in
atomics_cells.py; the native one is ``_native.c``.
"""

from __future__ import annotations

import mmap
import os
from typing import Any, Callable, Optional, Protocol, Sequence, Tuple, runtime_checkable

# The words' constants are part of this layer's face: modules above import them from here.
from shmlimit.shm.words import (
    FED_ALL,
    MASK64,
    MAX_QUEUE,
    WORD,
    GrabResult,
    claim_record,  # noqa: F401 (for the layers above)
    fed_bit,
    fed_mask,
)

__all__ = [
    "BACKENDS",
    "Cells",
    "FED_ALL",
    "GrabResult",
    "MASK64",
    "MAX_QUEUE",
    "WORD",
    "fed_bit",
    "fed_mask",
    "multi_gate",
    "native_available",
    "open_cells",
    "selected_backend",
    "warm_backend",
]

BACKENDS = ("native", "atomics")


@runtime_checkable
class Cells(Protocol):
    """An atomic backend over one mapping: what every module above this one may call.

    Offsets are byte offsets of 8-aligned words inside the mapping; values are
    unsigned 64-bit.  Every operation is sequentially consistent.  The
    composites (``grab`` ... ``try_grab``) are specified by the reference
    versions in ``composites.CompositesFromPrimitives``.
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

    def load_many(self, offsets: Tuple[int, ...]) -> Tuple[int, ...]:
        """The words at ``offsets``, each loaded as ``load`` does (not a snapshot of them together)."""
        ...

    def store(self, off: int, value: int) -> None: ...

    def clamp_words(
        self, head_off: int, head: int, tail: int, records: Tuple[int, ...]
    ) -> Optional[Tuple[int, int, int]]:
        """The clamp words a replenish leaves for the snapshot ``(head, tail)``, from the ticket
        ``records`` (LEN offsets); None when HEAD moved during the read (``words.clamp_words``)."""
        ...

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
        """The reservation fences in force for a claim of ``[ts, now]`` (``words.fence_scan``)."""
        ...

    def fetch_add(self, off: int, delta: int) -> int:
        """Add ``delta`` (0 <= delta < 2**64) modulo 2**64; return the previous value."""
        ...

    def cas(self, off: int, expected: int, desired: int) -> bool:
        """Store ``desired`` if the word equals ``expected``; say whether it did."""
        ...

    def leave_waiters(self) -> None:
        """Every native wait of this process returns, and any later one at once, the mapping kept
        (``close``'s first half): from then on no native loop grants a ticket, and no grab bound to
        ticket records (a ``grabber``'s, a ``gate``'s ``grab_within``) takes anything: it answers as
        when every record is in use, so nothing is written into a slot its process is leaving."""
        ...

    def close(self) -> None: ...

    def grab(self, tail: int, head: int, amount: int, grants: int, ops: int) -> GrabResult: ...

    def grab_if(
        self, seq: int, expected: int, tail: int, head: int, amount: int, grants: int, ops: int
    ) -> GrabResult: ...

    def grabber(
        self,
        seq: int,
        expected: int,
        tail: int,
        head: int,
        amount: int,
        grants: int,
        ops: int,
        *recs: tuple,
    ) -> Callable[[], GrabResult]:
        """``grab_if`` bound once; with a tuple of ticket records' LEN offsets (``recs``) it queues only
        holding one of them (``words.claim_record``), and answers False when all are in use."""
        ...

    def try_grab(self, tail: int, head: int, amount: int, grants: int, ops: int) -> bool: ...

    def keyed_table(self, *offsets_and_params: int) -> Any:
        """The keyed slot table's composite (find/insert/evict + a GCRA step): see ``keyed_cells``."""
        ...

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
        *recs: Any,
    ) -> Any:
        """``try_grab()`` and ``grab_within(timeout)`` of one config, bound once (see ``Gate``); with
        ticket records (``recs``: the records, or None, then FENCE_HINT) ``grab_within`` queues only
        holding one, else answers None; with FENCE_HINT it answers None rather than queue while a
        reservation's fence may be in force."""
        ...

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
    ) -> Any:
        """A ticket's whole wait in one call without the GIL (see ``Bucket.waiter``), or None when
        the backend has none: its callers wait in Python (``acquisition.Request``)."""
        ...

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
    ) -> Any:
        """Hierarchical mode's wait for a ticket in one call without the GIL, asleep on the futex word
        ``wake`` (see ``Bucket.waiter``), or None when the backend has none (``Request`` waits in
        Python, on the same word through ``futex_wait``)."""
        ...

    def futex_wait(self, off: int, expected: int, bitset: int, deadline_ns: int) -> bool:
        """Sleep while the low 32 bits of the word hold ``expected``'s, for the bits of ``bitset``, until
        ``deadline_ns`` (CLOCK_MONOTONIC): False once the deadline passed, else True (look again).
        A non-private futex: wakes from any process mapping the word reach it."""
        ...

    def futex_wake(self, off: int, bitset: int) -> int:
        """Wake the sleepers on the word, in any process, whose bitset meets ``bitset``; how many."""
        ...


def native_available() -> bool:
    try:
        from shmlimit.shm import _native  # noqa: F401
    except ImportError:
        return False
    return True


def selected_backend() -> str:
    """The backend new attachments use: ``SHMLIMIT_BACKEND`` if set, else native when built."""
    forced = os.environ.get("SHMLIMIT_BACKEND", "").strip().lower()
    if forced:
        if forced not in BACKENDS:
            raise ValueError(
                f"SHMLIMIT_BACKEND must be one of {', '.join(BACKENDS)}, not {forced!r}"
            )
        if forced == "native" and not native_available():
            raise ImportError(
                "SHMLIMIT_BACKEND=native but the extension shmlimit.shm._native is not built"
            )
        return forced
    return "native" if native_available() else "atomics"


def warm_backend(backend: str | None = None) -> None:
    """Import the backend's module now, so that a first store into a new segment is not delayed."""
    if (backend or selected_backend()) == "atomics":
        import atomics  # noqa: F401

        from shmlimit.shm import atomics_cells  # noqa: F401


def multi_gate(
    gates: Sequence[Any], caps: Sequence[int], decide: bool, names: Optional[Sequence[str]] = None
) -> Any:
    """One try over several rates' gates, all or nothing, in one call (see ``composites.MultiGate``):
    the native one when every gate is native, else the reference built from the gates' steps.
    ``names`` (one per gate) lets ``try_grab_ops`` take the ops per rate as a dict by name."""
    if native_available():
        from shmlimit.shm import _native

        if gates and all(
            type(g).__name__ == "Gate" and type(g).__module__ == "shmlimit.shm._native"
            for g in gates
        ):
            return _native.multi_gate(
                tuple(gates), tuple(caps), decide, None if names is None else tuple(names)
            )
    from shmlimit.shm.composites import MultiGate

    return MultiGate(gates, caps, decide, names)


def open_cells(mm: mmap.mmap, size: int, backend: str | None = None) -> Cells:
    """Wrap ``size`` bytes of ``mm`` in the selected (or the named) backend."""
    backend = backend or selected_backend()
    if backend == "native":
        from shmlimit.shm._native import NativeCells

        return NativeCells(mm, size)
    if backend == "atomics":
        from shmlimit.shm.atomics_cells import AtomicsCells

        return AtomicsCells(mm, size)
    raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, not {backend!r}")
