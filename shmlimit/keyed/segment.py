"""A keyed segment's header: its kind for the one start-up protocol, its initialisation and the
validation of every header field, never half-made.

Start-up is a ``Limiter`` segment's (``header.open_segment`` with ``KEYED``):
exclusive creation, the creator's pid first, the header, then ``MAGIC`` and
``STATE = READY`` last; openers wait for a live creator and refuse an
abandoned, truncated, foreign or corrupt segment with ``SegmentError``; an
existing one is mapped only if ``segment.check_trust`` accepts its owner and
mode, and, once it says it is ready, only if its ``SIZE`` fits the file.  A
keyed segment is also allocated in full at creation (``posix_fallocate``), so
a full ``/dev/shm`` is a clear error at once rather than a bus error later
(``Segment.create``, after ``_check_space`` says how large the table is and
how to enlarge ``/dev/shm``).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import AbstractSet, Callable, Optional, Tuple

from shmlimit.adapt import Adapt
from shmlimit.adapt import read as read_adapt
from shmlimit.adapt import write as write_adapt
from shmlimit.errors import LimiterNotFoundError, SegmentError, SharedMemoryFullError
from shmlimit.header import KINDS_BY_MAGIC, Kind, open_existing
from shmlimit.header import open_segment as open_header
from shmlimit.keyed import layout as K
from shmlimit.keyed.cells import pick
from shmlimit.keyed.gcra import MAX_TICKS, Rate, bank_values, rate_of, write_bank
from shmlimit.shm import layout as L
from shmlimit.shm.cells import Cells, open_cells
from shmlimit.shm.segment import (
    SHM_DIR,
    Segment,
    claim_and_unlink,
    current_inode,
    gone,
    pread_file,
    publish,
    read_secret,
    start_header,
    write_secret,
)
from shmlimit.shm.segment import unlink as _unlink_name
from shmlimit.shm.table import ProcessTable

assert (
    K.HEADER_BYTES == L.HEADER_BYTES and K.LINE == L.SLOT_BYTES
)  # ProcessTable reads the same offsets


@dataclass(frozen=True)
class Geometry:
    keys: int
    overrides: int
    kind: int = K.KIND_GCRA  #: the value kind of the slots (``keyed_layout.KINDS``)
    moving: int = 0  #: moving-window slots (a table of window counters only)
    ring: int = 0  #: words of each moving-window log (a power of two; 0 with no moving slots)

    @property
    def size(self) -> int:
        return K.segment_size(self.keys, self.overrides, K.PSLOTS, self.moving, self.ring)

    @property
    def probe(self) -> int:
        return min(K.PROBE, self.keys)


def check_geometry(keys: object, overrides: object) -> Geometry:
    for param, v, lo, hi in (
        ("keys", keys, 1, K.MAX_KEYS),
        ("overrides", overrides, 0, K.MAX_OVERRIDES),
    ):
        if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
            raise ValueError(f"{param} must be an int from {lo} to {hi}, got {v!r}")
    return Geometry(keys, overrides)  # type: ignore[arg-type]


def _check_space(name: str, size: int) -> None:
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:  # pragma: no cover - no /dev/shm to ask
        return
    free = st.f_bavail * st.f_frsize
    if size > free:
        raise SharedMemoryFullError(
            f"keyed limiter {name!r} needs {size / 2**20:.1f} MiB of shared memory, but {SHM_DIR} has "
            f"{free / 2**20:.1f} MiB free (of {st.f_blocks * st.f_frsize / 2**20:.0f} MiB): use fewer keys=, "
            f"or enlarge {SHM_DIR} (Docker: --shm-size=256m; Kubernetes: an emptyDir with medium Memory)"
        )


#: The keyed hash's secret: SipHash's k0 and k1, 16 bytes in the segment's secret file
#: (``shm.segment.write_secret``), readable only by those who may write the segment: a reader of
#: a 0o640 segment cannot compute keys that crowd one key's window of slots.
SECRET_BYTES = 16


def new_secret(seg: Segment) -> None:
    """Draw the new segment's secret and write its secret file (before READY); a creator that
    cannot gives its segment's name back and raises ``SegmentError``."""
    try:
        write_secret(seg, os.urandom(SECRET_BYTES))
    except OSError as e:
        if current_inode(seg.name) == seg.inode:  # ours, never published: take the name back
            try:
                _unlink_name(seg.name)
            except LimiterNotFoundError:  # pragma: no cover - removed meanwhile
                pass
        raise SegmentError(
            f"cannot create the secret file of keyed limiter {seg.name!r}: {e.strerror or e}"
        ) from None


def read_key(
    seg: Segment, c: Cells, mode: Optional[int], trusted_uids: AbstractSet[int]
) -> Optional[Tuple[int, int]]:
    """The hash's secret ``(k0, k1)`` of the segment (or group) ``seg`` is mapped from, from its
    secret file, under the trust check of ``mode`` (``shm.segment.read_secret``); None if a
    collector took the segment (``c``, its table's cells) since it was opened: its secret file
    goes after its name, so one missing while the name still holds a READY ``seg`` is lost."""
    try:
        data = read_secret(seg, SECRET_BYTES, mode, trusted_uids)
    except SegmentError:
        if gone(seg.name, seg.inode, c):
            return None
        raise
    return int.from_bytes(data[:8], "little"), int.from_bytes(data[8:], "little")


def initialise(
    seg: Segment,
    geo: Geometry,
    rate: Optional[Rate],
    adapt: Optional[Adapt] = None,
    secret: bool = True,
) -> Cells:
    """Write a new keyed header (the rate's banks, the geometry, each key's adaptive rate's
    parameters) and, with ``secret``, the segment's secret file (a group's regions share the one
    their group writes); READY last."""
    c = start_header(seg, K.VERSION, K.PSLOTS)  # the creator's pid first, then the secret file
    if secret:
        try:
            new_secret(seg)
        except BaseException:
            c.close()
            raise
    write_adapt(c, adapt, K.ADAPT_PARAMS)
    c.store(K.KIND_OFF, geo.kind)
    if rate is not None:  # a table of window counters has no rate: its config line stays zero
        for line in K.DEFAULT_BANKS:  # both banks, generation 0 (CFG_SEQ's first value)
            write_bank(c, line, (0, 0), bank_values(rate), 0)
    c.store(K.NKEYS_OFF, geo.keys)
    c.store(K.NOVR_OFF, geo.overrides)
    c.store(K.PROBE_OFF, geo.probe)
    c.store(K.MKEYS_OFF, geo.moving)
    c.store(K.MRING_OFF, geo.ring)
    publish(c, K.MAGIC)
    return c


def validate_header(name: str, c: Cells, mapped: int) -> Geometry:
    """Refuse a corrupt or hostile header before any region is used (SegmentError)."""
    version, size, pslots = c.load(K.VERSION_OFF), c.load(K.SIZE_OFF), c.load(K.PSLOTS_OFF)
    if version != K.VERSION:
        raise SegmentError(
            f"segment {name!r} has keyed layout version {version}; this shmlimit reads {K.VERSION}"
        )
    keys, novr, probe, kind, mkeys, ring = (
        c.load(K.NKEYS_OFF),
        c.load(K.NOVR_OFF),
        c.load(K.PROBE_OFF),
        c.load(K.KIND_OFF),
        c.load(K.MKEYS_OFF),
        c.load(K.MRING_OFF),
    )
    if not check_moving(mkeys, ring, kind):
        raise SegmentError(
            f"segment {name!r} is corrupt: header says {mkeys} moving-window keys of {ring} words"
        )
    if (
        pslots != K.PSLOTS
        or not 1 <= keys <= K.MAX_KEYS
        or novr > K.MAX_OVERRIDES
        or probe != min(K.PROBE, keys)
        or size != K.segment_size(keys, novr, K.PSLOTS, mkeys, ring)
        or mapped < size
        or kind not in K.KINDS
        or (kind == K.KIND_WINDOWS and novr)
    ):
        raise SegmentError(
            f"segment {name!r} is corrupt: header says {size} bytes, {keys} keys, {novr} overrides, "
            f"probe {probe}, kind {kind}; the mapping has {mapped} bytes"
        )
    if kind == K.KIND_WINDOWS:
        return Geometry(keys, novr, kind, mkeys, ring)
    vals = pick(c, K.DEFAULT_BANKS, (0, 0), c.load(K.CFG_SEQ) & ~1)
    if vals is None:
        raise SegmentError(
            f"segment {name!r} is corrupt: no copy of its configuration passes its checksum"
        )
    r, t, tau = rate_of(vals), vals[3], vals[4]
    if (
        not all(math.isfinite(x) and x > 0 for x in (r.rate, r.per, r.burst))
        or not 1 <= t <= tau < MAX_TICKS
    ):
        raise SegmentError(f"segment {name!r} is corrupt: its configuration is out of range")
    read_adapt(
        c, K.ADAPT_PARAMS, K.CFG_SEQ
    )  # its keys' adaptive rate, if any: valid, or SegmentError
    return Geometry(keys, novr)


def check_moving(mkeys: int, ring: int, kind: int) -> bool:
    """Whether a moving-window region is in range: none (both 0), or in a table of window
    counters, 1 to ``MAX_KEYS`` logs of a power-of-two ``MIN_RING..MAX_RING`` words, all of them at
    most ``MAX_MOVING_BYTES``."""
    if not mkeys and not ring:
        return True
    return (
        kind == K.KIND_WINDOWS
        and 1 <= mkeys <= K.MAX_KEYS
        and K.MIN_RING <= ring <= K.MAX_RING
        and not ring & (ring - 1)
        and mkeys * K.moving_stride(ring) <= K.MAX_MOVING_BYTES
    )


#: No keyed segment is larger than this (bytes): a bigger file is neither read nor mapped.
MAX_BYTES = K.segment_size(K.MAX_KEYS, K.MAX_OVERRIDES) + K.MAX_MOVING_BYTES


def read_copy(name: str, offset: int, length: int) -> Tuple[bytearray, int]:
    """``length`` bytes from ``offset`` (fewer at the end of the file) with ``pread``, and the file's size.

    For the tools that only look (inspect, top): nothing is mapped, so a
    segment truncated under them cannot raise SIGBUS, and a FIFO or directory
    under a limiter's name is refused, never waited on.
    """
    data, st = pread_file(name, offset, length, max_bytes=None)
    buf = bytearray(max(8, len(data) + 7 & ~7))  # whole, 8-aligned words for the atomic layer
    buf[: len(data)] = data
    return buf, st.st_size


@dataclass(frozen=True)
class Creation:
    """What a creating call asks for: a keyed segment of ``geo``, made with ``mode`` if none exists
    (``rate``: a KeyedLimiter's default rate; None for a table of window counters)."""

    geo: Geometry
    rate: Optional[Rate]
    adapt: Optional[Adapt]
    mode: int


def _declared_size(c: Cells) -> int:
    # the geometry's words are checked against SIZE by validate_header, which every reader of a
    # keyed table runs (a group's regions too); the start-up protocol only needs SIZE to fit the file
    return c.load(K.SIZE_OFF)


#: The keyed segment as the one start-up protocol (``header.open_segment``) knows it: both value
#: kinds, a KeyedLimiter's table and a table of window counters, share its magic.
KEYED = Kind(
    "a KeyedLimiter of one rate",
    K.MAGIC,
    K.VERSION,
    K.HEADER_BYTES,
    _declared_size,
    lambda create: create.geo.size,
    lambda seg, create, now_ns: initialise(seg, create.geo, create.rate, create.adapt),
    lambda seg: seg.size,
    noun="keyed limiter",
    max_bytes=MAX_BYTES,
    described=lambda name, c: kind_of(name, c.load(K.KIND_OFF)),
)
KINDS_BY_MAGIC[KEYED.magic] = KEYED


def open_segment(
    name: str,
    geo: Optional[Geometry],
    rate: Optional[Rate],
    mode: int,
    trusted_uids: AbstractSet[int] = frozenset(),
    adapt: Optional[Adapt] = None,
) -> Tuple[Segment, Cells, Geometry]:
    """Create (when ``rate`` is given, or ``geo`` is a table of window counters, and the name is free)
    or open a keyed segment, by the one start-up protocol (``header.open_segment``).

    Returns the mapping, cells over the whole segment, and its geometry, validated.  With create
    intent an abandoned segment is replaced; without, every problem raises.
    """
    create = None
    if geo is not None and (rate is not None or geo.kind == K.KIND_WINDOWS):
        _check_space(name, geo.size)  # Segment.create allocates every page: ENOSPC is an error now
        create = Creation(geo, rate, adapt, mode)
    seg, c = open_header(name, create, mode, frozenset(trusted_uids), kind=KEYED)
    if seg.created:
        return seg, c, geo  # type: ignore[return-value]
    try:
        return seg, c, validate_header(name, c, seg.size)
    except BaseException:
        c.close()
        seg.close()
        raise


#: what a keyed segment of each value kind is, as errors name it
_HOLDS = {
    K.KIND_GCRA: "a KeyedLimiter of one rate",
    K.KIND_WINDOWS: "a window table (window counters)",
}


def kind_of(name: str, kind: int) -> Tuple[str, str]:
    """What keyed segment ``name`` of value ``kind`` is, and how to open it, for errors."""
    if kind == K.KIND_WINDOWS:
        how = f"open it as the limits storage 'shm://{name}' (shmlimit.integrations.limits)"
        return _HOLDS[kind], how
    return _HOLDS[K.KIND_GCRA], "use shmlimit.KeyedLimiter or shmlimit.attach"


def check_kind(name: str, have: int, want: int) -> None:
    """Refuse (``SegmentError``) a keyed segment of value kind ``have`` where ``want`` is needed."""
    if have != want:
        what, how = kind_of(name, have)
        raise SegmentError(f"segment {name!r} is {what}, not {_HOLDS[want]}: {how}")


def open_keyed(
    name: str,
    kind: int,
    geo: Optional[Geometry],
    rate: Optional[Rate],
    mode: int,
    trusted_uids: AbstractSet[int],
    adapt: Optional[Adapt] = None,
    opener: Optional[Callable[[], Tuple[Segment, Cells]]] = None,
) -> Optional[Tuple[Segment, Cells, Geometry, Tuple[int, int]]]:
    """A keyed segment of value ``kind`` (``open_segment``; with ``opener``, a group's region,
    its header validated as a segment's) and the hash's secret (``read_key``): its mapping, cells,
    geometry and ``(k0, k1)``.  None, nothing left mapped, if a collector took it meanwhile."""
    if opener is None:
        seg, c, real = open_segment(name, geo, rate, mode, trusted_uids, adapt)
    else:
        seg, c = opener()
    secret = None
    try:
        if opener is not None:
            real = validate_header(name, c, seg.size)
        check_kind(name, real.kind, kind)
        secret = read_key(seg, c, mode, trusted_uids)  # a region's is its group's
    finally:
        if secret is None:  # refused, or collected since it was opened
            c.close()
            seg.close()
    return None if secret is None else (seg, c, real, secret)


def collect(name: str) -> bool:
    """Unlink the keyed segment (either value kind) if no live process is attached to it; True if
    it did.  The same claim-check-unlink as a ``Limiter``'s (``claim_and_unlink``): an opener
    registers, then sees the claim and opens the name again (``registry.attach``)."""
    seg = open_existing(name, None, frozenset(), KEYED)
    try:
        if seg.size < K.HEADER_BYTES + K.PSLOTS * K.LINE:
            return False
        c = open_cells(seg.mm, K.HEADER_BYTES + K.PSLOTS * K.LINE)
        try:
            if c.load(K.MAGIC_OFF) != K.MAGIC:
                return False
            return claim_and_unlink(name, seg.inode, [ProcessTable(c, K.PSLOTS)])
        finally:
            c.close()
    finally:
        seg.close()
