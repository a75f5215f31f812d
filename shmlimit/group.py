"""A limiter of several rates is one segment, under its one name.

The segment begins with a header (line 0 as every kind's, then the count of
rates, whether they are named, where their regions are, and their keys), then
holds one region per rate, each a whole limiter layout starting on an mmap
boundary (``layout.group_geometry``).  A process maps each region on its own
and attaches to it as to a single limiter's segment: every promise of one rate
(its bucket, its filler, its process table, its fences) is the region's, and
nothing below the limiters knows about groups.

Start-up is the one protocol (``header.open_segment`` with ``GROUP``): the
creator writes the group's header, initialises every region (each READY), and
stores the group's READY last, so a group an opener sees READY has every region
ready.  A collector claims each region's STATE (``collect``); an opener that
finds a region claimed opens the whole group again (``Collected``).
"""

from __future__ import annotations

import mmap
import re
from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

from shmlimit.errors import LimiterNotFoundError, SegmentError
from shmlimit.header import (
    DOOMED,
    KINDS_BY_MAGIC,
    Creation,
    Kind,
    initialise,
    open_segment,
    ready_creator,
)
from shmlimit.shm import layout as L
from shmlimit.shm.cells import Cells, open_cells
from shmlimit.shm.segment import (
    Segment,
    opened,
    pread_file,
    publish,
    start_header,
)

#: A group holds at most this many rates (``rates=``).
MAX_RATES = 16
_KEY = re.compile(rb"[A-Za-z0-9_]+")


class Collected(Exception):
    """A region of the group was claimed by a collector, or the name now holds another segment:
    open the group again."""


@dataclass(frozen=True)
class GroupCreation:
    """What a creating call asks for: one ``Creation`` per rate, in the order of ``keys``."""

    rates: Tuple[Creation, ...]
    keys: Tuple[str, ...]
    named: bool
    mode: int
    slots: int


@dataclass(frozen=True)
class Geometry:
    """Where a group's regions are: ``count`` regions of a table of ``slots``, ``first`` and
    ``stride`` in bytes; ``keys`` name the rates, in order."""

    keys: Tuple[str, ...]
    named: bool
    slots: int
    first: int
    stride: int

    def offset(self, index: int) -> int:
        return self.first + index * self.stride

    @property
    def region_bytes(self) -> int:
        return L.segment_size(self.slots)


def _geometry(slots: int) -> Tuple[int, int]:
    return L.group_geometry(slots, mmap.ALLOCATIONGRANULARITY)


def _encode_keys(keys: Tuple[str, ...]) -> bytes:
    raw = b"".join(k.encode("ascii") + b"\0" for k in keys)
    if len(raw) > L.GROUP_KEYS_BYTES:
        raise ValueError(
            f"rates: the keys take {len(raw)} bytes with a NUL each; at most {L.GROUP_KEYS_BYTES}"
        )
    return raw


def _declared_size(c: Cells) -> Optional[int]:
    """The size a group header's words declare, or None if they make no sense here."""
    slots, count, first, stride = (
        c.load(off) for off in (L.SLOTS_OFF, L.GROUP_COUNT, L.GROUP_FIRST, L.GROUP_STRIDE)
    )
    if not 1 <= slots <= L.MAX_SLOTS or not 1 <= count <= MAX_RATES:
        return None
    if (first, stride) != _geometry(slots):
        return None
    return L.group_size(first, stride, count)


def _size_of(create: GroupCreation) -> int:
    first, stride = _geometry(create.slots)
    return L.group_size(first, stride, len(create.rates))


def _initialise(seg: Segment, create: GroupCreation, now_ns: int) -> Cells:
    """Write the group's header, initialise every region, then publish the group (READY last)."""
    c = start_header(seg, L.GROUP_VERSION, create.slots)
    first, stride = _geometry(create.slots)
    c.store(L.GROUP_COUNT, len(create.rates))
    c.store(L.GROUP_NAMED, int(create.named))
    c.store(L.GROUP_FIRST, first)
    c.store(L.GROUP_STRIDE, stride)
    raw = _encode_keys(create.keys)
    raw += bytes(-len(raw) % 8)
    for i in range(0, len(raw), 8):
        c.store(L.GROUP_KEYS + i, int.from_bytes(raw[i : i + 8], "little"))
    geo = Geometry(create.keys, create.named, create.slots, first, stride)
    for i, rate in enumerate(create.rates):
        region = map_region(seg, geo, i)
        try:
            initialise(region, rate, now_ns).close()
        finally:
            region.close()
    publish(c, L.GROUP_MAGIC)
    return c


def _cells_bytes(seg: Segment) -> int:
    return L.GROUP_HEADER_BYTES


GROUP = Kind(
    "a limiter of several rates",
    L.GROUP_MAGIC,
    L.GROUP_VERSION,
    L.GROUP_HEADER_BYTES,
    _declared_size,
    _size_of,
    _initialise,
    _cells_bytes,
)
KINDS_BY_MAGIC[GROUP.magic] = GROUP


def read_geometry(name: str, c: Cells) -> Geometry:
    """The geometry a ready group header states; ``SegmentError`` for keys that make no sense."""
    slots, count, named, first, stride = (
        c.load(off)
        for off in (L.SLOTS_OFF, L.GROUP_COUNT, L.GROUP_NAMED, L.GROUP_FIRST, L.GROUP_STRIDE)
    )
    raw = b"".join(
        c.load(L.GROUP_KEYS + i).to_bytes(8, "little") for i in range(0, L.GROUP_KEYS_BYTES, 8)
    )
    keys = tuple(raw.split(b"\0")[:count])
    if named not in (0, 1) or len(keys) != count or not all(_KEY.fullmatch(k) for k in keys):
        raise SegmentError(f"segment {name!r} is corrupt: its rates' keys make no sense")
    return Geometry(tuple(k.decode() for k in keys), bool(named), slots, first, stride)


def map_region(group: Segment, geo: Geometry, index: int) -> Segment:
    """Map rate ``index``'s region of ``group`` on its own (the same file: ``Collected`` if the name
    now holds another)."""
    try:
        with opened(group.name, write=True) as (fd, st):
            if st.st_ino != group.inode:
                raise Collected()
            off, size = geo.offset(index), geo.region_bytes
            if st.st_size < off + size:
                raise SegmentError(
                    f"segment {group.name!r} is truncated: rate {geo.keys[index]!r} needs "
                    f"{off + size} bytes, the file has {st.st_size}"
                )
            mm = mmap.mmap(fd, size, offset=off)
    except LimiterNotFoundError:
        raise Collected() from None
    return Segment(
        group.name, mm, size, group.created, group.inode, group.ctime_ns, group.owner, group.mode
    )


def open_group(
    name: str,
    create: Optional[GroupCreation],
    mode: Optional[int],
    trusted: frozenset,
    clock: Callable[[], int],
) -> Tuple[Segment, Geometry]:
    """Create the group, or open the ready one: its header segment and its geometry."""
    seg, c = open_segment(name, create, mode, trusted, clock, GROUP)
    try:
        try:
            geo = read_geometry(name, c)
        finally:
            c.close()  # before the mapping it exports
    except BaseException:
        seg.close()
        raise
    return seg, geo


def region_opener(group: Segment, geo: Geometry, index: int) -> Callable[[], Tuple[Segment, Cells]]:
    """What ``attachment.map_attachment`` calls to open rate ``index``: its region, ready."""

    def open_region() -> Tuple[Segment, Cells]:
        region = map_region(group, geo, index)
        try:
            verdict = ready_creator(f"{group.name}[{geo.keys[index]}]", region, 0.0)
        except BaseException:
            region.close()
            raise
        if verdict == DOOMED:
            region.close()
            raise Collected()
        if verdict != 0:  # the group was READY, so every region was: only a forger does this
            region.close()
            raise SegmentError(f"segment {group.name!r} is corrupt: a rate's region is not ready")
        return region, open_cells(region.mm, region.size)

    return open_region


def peek_magic(name: str) -> int:
    """The first word of ``name``'s segment, read without mapping (0 if it is shorter)."""
    data, _ = pread_file(name, 0, 8, None)
    return int.from_bytes(bytes(data[:8]).ljust(8, b"\0"), "little")


def is_group(name: str) -> bool:
    try:
        return peek_magic(name) == L.GROUP_MAGIC
    except OSError:
        return False


def copy_regions(name: str) -> Tuple[Geometry, List[Segment]]:
    """A private copy of every region of a ready group, read with ``pread`` (nothing mapped), for
    the tools that only look."""
    head, st = pread_file(name, 0, L.GROUP_HEADER_BYTES, None)
    # the header's copy, judged against the file's whole size (the regions are read below)
    seg = Segment(name, bytearray(head.ljust(L.GROUP_HEADER_BYTES, b"\0")), st.st_size, False, 0)
    verdict = ready_creator(name, seg, 0.0, GROUP)
    if verdict != 0:
        raise SegmentError(
            f"segment {name!r} is {'being removed' if verdict == DOOMED else 'still being initialised'}"
        )
    c = open_cells(seg.mm, L.GROUP_HEADER_BYTES)
    try:
        geo = read_geometry(name, c)
    finally:
        c.close()
    regions = []
    for i in range(len(geo.keys)):
        data, st = pread_file(name, geo.offset(i), geo.region_bytes, None)
        size = len(data) & ~7
        buf = bytearray(max(size, 8))
        buf[:size] = data[:size]
        regions.append(
            Segment(name, buf, size, False, st.st_ino, st.st_ctime_ns, st.st_uid, st.st_mode)
        )
    return geo, regions
