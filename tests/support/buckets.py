"""A bucket of its own for a test: a private anonymous mapping, the segment's layout, a fake clock."""

import mmap
from typing import Optional, Tuple

from shmlimit.bucket.rovers import Bucket
from shmlimit.config import Config
from shmlimit.shm import layout as L
from shmlimit.shm.cells import Cells, open_cells

from .clock import FakeClock


def private_cells(backend: str = "atomics", slots: int = 1) -> Cells:
    """The cells of a segment of ``slots`` process slots, on an anonymous mapping no other process sees."""
    size = L.segment_size(slots)
    return open_cells(mmap.mmap(-1, size), size, backend)


def make_bucket(
    cfg: Config,
    backend: str = "atomics",
    initial: Optional[int] = None,
    base: int = 0,
    slots: int = 1,
) -> Tuple[Bucket, FakeClock]:
    """A bucket initialised with ``cfg`` (``initial`` ops in it; the rovers start at ``base``) on
    private cells, and the fake clock it reads."""
    cells = private_cells(backend, slots)
    clock = FakeClock()
    Bucket.initialise(cells, cfg, clock(), initial, base)
    return Bucket(cells, clock), clock
