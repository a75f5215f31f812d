"""The atomic layer: every shared-memory word is read and written here, and only here.

A *cell* is an aligned, unsigned 64-bit word of the segment, named by its byte
offset.  All arithmetic wraps modulo 2**64 (the rovers rely on it, as Seastar's
do).  Every operation is sequentially consistent.

Two backends implement the same four operations (and the composites built on
them), and both are ``Cells`` (composites.py):

* ``native``  -- the optional C extension ``shmlimit.shm._native`` (built with the
  package when a compiler is present): one C call per operation.
* ``atomics`` -- the portable ``atomics`` package: the reference, and the
  fallback when the extension is missing.

``SHMLIMIT_BACKEND=atomics`` or ``=native`` forces one; by default the native
backend is used when it imports.  Bounds are checked by every backend: an offset
that is not 8-aligned or not inside the mapping raises ``IndexError`` before any
memory is touched.

This module is the layer's face: ``Cells`` and the choice of a backend.  The word's
constants and checks live in words.py, ``Cells`` with the composites (``Gate``,
``MultiGate``) in composites.py, the ``atomics`` backend in atomics_cells.py; the
native one is ``_native.c``.
"""

from __future__ import annotations

import mmap
import os
from typing import Any, Optional, Sequence

from shmlimit.shm.composites import Cells

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

try:
    from shmlimit.shm._native import NativeCells
except ImportError:  # not built: the atomics backend serves
    NativeCells = None
else:
    Cells.register(NativeCells)  # the composites' same steps, in C


def native_available() -> bool:
    """Whether the native extension imported (built with the package when a compiler was present)."""
    return NativeCells is not None


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
