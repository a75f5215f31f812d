"""A limiter of several rates, plain or keyed, is one segment, under its one name.

The segment begins with a header (line 0 as every kind's, then the count of
rates, whether they are named, where their regions are, which layout they hold,
and their keys), then holds one region per rate, each a whole layout starting on
an mmap boundary (``layout.group_geometry``): a limiter's (``Limiter(rates=)``)
or a keyed table's (``KeyedLimiter(rates=)``), every region of a group the same.
A process maps each region on its own and attaches to it as to a single
limiter's segment (``attachment.map_attachment``, or the keyed ``_open``, given
an opener): every promise of one rate (its bucket or its table, its process
table, its fences) is the region's, and nothing below the limiters knows about
groups.

Start-up is the one protocol (``header.open_segment`` with ``GROUP``): the
creator writes the group's header, initialises every region (each READY), and
stores the group's READY last, so a group an opener sees READY has every region
ready.  A collector claims each region's STATE (``collect``); an opener that
finds a region claimed waits for it, and opens the whole group again once the
name is unlinked (``Collected``, ``open_rates``); a claim left for
``DOOMED_WAIT`` by a collector that died it gives back (``region_opener``).
"""

from __future__ import annotations

import mmap
import re
import time
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Tuple

from shmlimit.errors import ConfigMismatchError, LimiterNotFoundError, SegmentError
from shmlimit.header import (
    DOOMED,
    KINDS_BY_MAGIC,
    Kind,
    check_copied,
    closed_on_failure,
    initialise,
    open_segment,
    ready_creator,
)
from shmlimit.keyed import layout as K
from shmlimit.keyed.segment import Geometry as TableGeometry
from shmlimit.keyed.segment import initialise as initialise_table
from shmlimit.keyed.segment import new_secret
from shmlimit.rate_group import MAX_RATES  # a group holds at most this many rates
from shmlimit.shm import layout as L
from shmlimit.shm.cells import Cells, open_cells
from shmlimit.shm.segment import (
    Segment,
    claim_and_unlink,
    give_back_claim,
    map_sized,
    opened,
    pread_file,
    publish,
    reopening,
    start_header,
)
from shmlimit.shm.table import ProcessTable

_KEY = re.compile(rb"[A-Za-z0-9_]+")
#: What each kind of region is called in errors.
_REGIONS = {
    L.REGIONS_LIMITER: "a limiter of several rates",
    L.REGIONS_KEYED: "a keyed limiter of several rates",
}


class Collected(Exception):
    """A region of the group was claimed by a collector, or the name now holds another segment:
    open the group again."""


@dataclass(frozen=True)
class GroupCreation:
    """What a creating call asks for: one creation per rate, in the order of ``keys`` (a
    ``header.Creation`` for limiter regions, a keyed ``Rate`` for keyed ones), the regions' layout
    (``layout.REGIONS_*``), a keyed table's ``(keys, overrides)``, and each keyed rate's
    ``Adapt`` or None (empty: none adapts; a limiter region's is in its ``Creation``)."""

    rates: Tuple[Any, ...]
    keys: Tuple[str, ...]
    named: bool
    mode: int
    slots: int
    regions: int = L.REGIONS_LIMITER
    table: Tuple[int, int] = (0, 0)
    adapts: Tuple[Any, ...] = ()


@dataclass(frozen=True)
class Geometry:
    """Where a group's regions are and what they hold: ``count`` regions of ``regions`` layout
    (a table of ``slots`` process slots; keyed: ``table`` = (key slots, override slots)),
    ``first`` and ``stride`` in bytes; ``keys`` name the rates, in order."""

    keys: Tuple[str, ...]
    named: bool
    slots: int
    first: int
    stride: int
    regions: int = L.REGIONS_LIMITER
    table: Tuple[int, int] = (0, 0)

    def offset(self, index: int) -> int:
        return self.first + index * self.stride

    @property
    def region_bytes(self) -> int:
        size = region_bytes(self.regions, self.slots, self.table)
        assert size is not None  # a Geometry is made from a checked header
        return size


def region_bytes(regions: int, slots: int, table: Tuple[int, int]) -> Optional[int]:
    """The bytes of one region of ``regions`` layout, or None if the words make no sense."""
    keys, overrides = table
    if regions == L.REGIONS_LIMITER:
        ok = 1 <= slots <= L.MAX_SLOTS and keys == overrides == 0
        return L.segment_size(slots) if ok else None
    if regions == L.REGIONS_KEYED:
        ok = slots == K.PSLOTS and 1 <= keys <= K.MAX_KEYS and 0 <= overrides <= K.MAX_OVERRIDES
        return K.segment_size(keys, overrides) if ok else None
    return None


def _geometry(region: int) -> Tuple[int, int]:
    return L.group_geometry(region, mmap.ALLOCATIONGRANULARITY)


def _encode_keys(keys: Tuple[str, ...]) -> bytes:
    raw = b"".join(k.encode("ascii") + b"\0" for k in keys)
    if len(raw) > L.GROUP_KEYS_BYTES:
        raise ValueError(
            f"rates: the keys take {len(raw)} bytes with a NUL each; at most {L.GROUP_KEYS_BYTES}"
        )
    return raw


def _layout_words(c: Cells) -> Tuple[int, int, Tuple[int, int]]:
    return (
        c.load(L.GROUP_REGIONS),
        c.load(L.SLOTS_OFF),
        (c.load(L.GROUP_TABLE_KEYS), c.load(L.GROUP_TABLE_OVR)),
    )


def _declared_size(c: Cells) -> Optional[int]:
    """The size a group header's words declare, or None if they make no sense here."""
    count, first, stride = (c.load(off) for off in (L.GROUP_COUNT, L.GROUP_FIRST, L.GROUP_STRIDE))
    region = region_bytes(*_layout_words(c))
    if region is None or not 1 <= count <= MAX_RATES:
        return None
    if (first, stride) != _geometry(region):
        return None
    return L.group_size(first, stride, count)


def _placement(create: GroupCreation) -> Tuple[int, int]:
    """Where a created group's regions go: the first's offset and the stride (bytes)."""
    region = region_bytes(create.regions, create.slots, create.table)
    assert region is not None  # the callers check the table's geometry first
    return _geometry(region)


def _size_of(create: GroupCreation) -> int:
    return L.group_size(*_placement(create), len(create.rates))


def _initialise(seg: Segment, create: GroupCreation, now_ns: int) -> Cells:
    """Write the group's header, initialise every region, then publish the group (READY last)."""
    with closed_on_failure(start_header(seg, L.GROUP_VERSION, create.slots)) as c:
        first, stride = _placement(create)
        c.store(L.GROUP_COUNT, len(create.rates))
        c.store(L.GROUP_NAMED, int(create.named))
        c.store(L.GROUP_FIRST, first)
        c.store(L.GROUP_STRIDE, stride)
        c.store(L.GROUP_REGIONS, create.regions)
        c.store(L.GROUP_TABLE_KEYS, create.table[0])
        c.store(L.GROUP_TABLE_OVR, create.table[1])
        raw = _encode_keys(create.keys)
        raw += bytes(-len(raw) % 8)
        for i in range(0, len(raw), 8):
            c.store(L.GROUP_KEYS + i, int.from_bytes(raw[i : i + 8], "little"))
        geo = Geometry(
            create.keys, create.named, create.slots, first, stride, create.regions, create.table
        )
        if create.regions == L.REGIONS_KEYED:  # one secret file, every rate's table's
            new_secret(seg)
        for i, rate in enumerate(create.rates):
            mapped = map_region(seg, geo, i)
            try:
                if create.regions == L.REGIONS_KEYED:
                    adapt = create.adapts[i] if create.adapts else None
                    rc = initialise_table(
                        mapped, TableGeometry(*create.table), rate, adapt, secret=False
                    )
                else:
                    rc = initialise(mapped, rate, now_ns)
                # created with its group: the group's instant names the secret file they share
                # (``secret_entry``), and the group is not READY yet
                rc.store(L.CREATED_NS_OFF, c.load(L.CREATED_NS_OFF))
                rc.close()
            finally:
                mapped.close()
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


def read_geometry(seg: Segment, regions: Optional[int]) -> Geometry:
    """The geometry the ready group header of ``seg`` (mapped or copied) states; ``SegmentError``
    for keys that make no sense, or for a group of another layout than ``regions`` (None: any)."""
    c = open_cells(seg.mm, L.GROUP_HEADER_BYTES)
    try:
        count, named, first, stride = (
            c.load(off) for off in (L.GROUP_COUNT, L.GROUP_NAMED, L.GROUP_FIRST, L.GROUP_STRIDE)
        )
        layout, slots, table = _layout_words(c)
        raw = b"".join(
            c.load(L.GROUP_KEYS + i).to_bytes(8, "little") for i in range(0, L.GROUP_KEYS_BYTES, 8)
        )
    finally:
        c.close()
    keys = tuple(raw.split(b"\0")[:count])
    if named not in (0, 1) or len(set(keys)) != count or not all(_KEY.fullmatch(k) for k in keys):
        # (a key twice: one name for two rates, as ``parse_rates`` refuses)
        raise SegmentError(f"segment {seg.name!r} is corrupt: its rates' keys make no sense")
    if regions is not None and layout != regions:
        raise SegmentError(f"segment {seg.name!r} is {_REGIONS[layout]}, not {_REGIONS[regions]}")
    region = region_bytes(layout, slots, table)
    if region is None or (first, stride) != _geometry(region):
        # (the open checked these words, but a writer may have changed them since)
        raise SegmentError(f"segment {seg.name!r} is corrupt: its rates' geometry makes no sense")
    return Geometry(
        tuple(k.decode() for k in keys), bool(named), slots, first, stride, layout, table
    )


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
            mm = map_sized(group.name, fd, size, off)
    except LimiterNotFoundError:
        raise Collected() from None
    return Segment(
        group.name, mm, size, group.created, group.inode, group.ctime_ns, group.owner, group.mode
    )


def shown(keys: Tuple[str, ...], named: bool) -> str:
    """A group's rates as errors show them."""
    return "{" + ", ".join(keys) + "}" if named else f"[{len(keys)} rates]"


def open_group(
    name: str,
    create: Optional[GroupCreation],
    mode: Optional[int],
    trusted: frozenset,
    clock: Callable[[], int],
    regions: Optional[int] = L.REGIONS_LIMITER,
) -> Tuple[Segment, Geometry]:
    """Create the group, or open the ready one: its header segment and its geometry.

    ``regions`` is the layout the caller reads (None: any); a group of the other is refused
    (``SegmentError``), and one created with other rates' keys is a ``ConfigMismatchError``."""
    seg, c = open_segment(name, create, mode, trusted, clock, GROUP)
    c.close()  # before the mapping it exports (read_geometry reads the header on its own)
    try:
        geo = read_geometry(seg, regions)
        if create is not None and (geo.keys, geo.named) != (create.keys, create.named):
            raise ConfigMismatchError(
                name,
                f"rates {shown(geo.keys, geo.named)}",
                f"rates {shown(create.keys, create.named)}",
            )
    except BaseException:
        seg.close()
        raise
    return seg, geo


def open_rates(
    name: str,
    create: Optional[GroupCreation],
    mode: Optional[int],
    trusted: frozenset,
    clock: Callable[[], int],
    regions: int,
    attach: Callable[[int, str, Callable[[], Tuple[Segment, Cells]]], None],
    close: Callable[[], None],
) -> Geometry:
    """Create the group or open it (``open_group``), then ``attach(i, label, opener)`` to each
    rate's region; all again (after ``close``) if a collector took a region meanwhile
    (``Collected``).  The group's geometry."""
    for _ in reopening():
        seg, geo = open_group(name, create, mode, trusted, clock, regions)
        try:
            for i, key in enumerate(geo.keys):
                try:
                    attach(i, f"{name}[{key}]", region_opener(seg, geo, i))
                except ConfigMismatchError as e:  # (its advice: the group's name, what it takes)
                    raise e.of_group(name, key, regions == L.REGIONS_KEYED) from None
            return geo
        except Collected:
            close()
        except BaseException:
            close()
            raise
        finally:
            seg.close()
    raise SegmentError(f"could not open {_REGIONS[regions]} {name!r}: it kept being collected")


def _region_ready(label: str, region: Segment, regions: int) -> int:
    """0 if the region (mapped or copied) is ready, ``DOOMED`` if a collector claimed it, else
    nonzero: its group was READY, so every region was, and only a forger leaves one otherwise.
    A keyed region's header is validated by its reader (``keyed.segment.validate_header``)."""
    if regions == L.REGIONS_LIMITER:
        return ready_creator(label, region, 0.0)
    c = open_cells(region.mm, K.HEADER_BYTES)
    try:
        magic, state = c.load(K.MAGIC_OFF), c.load(K.STATE_OFF)
    finally:
        c.close()
    if magic == K.MAGIC and state == L.STATE_DOOMED:
        return DOOMED
    return 0 if (magic, state) == (K.MAGIC, K.STATE_READY) else -1


def region_opener(
    group: Segment, geo: Geometry, index: int, wait: bool = True
) -> Callable[[], Tuple[Segment, Cells]]:
    """What a rate's attachment calls to open rate ``index`` (``attachment.map_attachment``, or the
    keyed ``_open``): its region, ready.

    A region a collector claimed (DOOMED) is waited for while the name still holds this group: its
    collector unlinks the name (``Collected``) or gives the claim back within microseconds.  One
    claimed for ``DOOMED_WAIT`` lost its collector (killed between its claim and its unlink) and is
    given back (READY), as ``header.wait_ready`` gives back a limiter's: else every opener, and
    ``gc``, would find the group being removed for ever.  ``wait`` False (a collector's own open):
    ``Collected`` at once."""

    def open_region() -> Tuple[Segment, Cells]:
        since = time.monotonic()
        while True:
            region = map_region(group, geo, index)  # (Collected once the name is unlinked)
            try:
                verdict = _region_ready(f"{group.name}[{geo.keys[index]}]", region, geo.regions)
                if verdict == 0:
                    return region, open_cells(region.mm, region.size)
                if verdict != DOOMED:
                    raise SegmentError(
                        f"segment {group.name!r} is corrupt: a rate's region is not ready"
                    )
                if not wait:
                    raise Collected()
                give_back_claim(region.mm, time.monotonic() - since)
            except BaseException:
                region.close()
                raise
            region.close()
            time.sleep(0.001)

    return open_region


def collect(name: str) -> bool:
    """Unlink the group if no live process is registered in any of its rates; True if it did.

    Every rate's region is claimed (STATE READY -> DOOMED), then checked unused, then the name
    unlinked; any rate in use gives every claim back.  A process attaching to a rate meanwhile
    registers, then reads that rate's STATE (``segment.gone``): it sees the claim, or the claim's
    check sees it, as for one rate (``segment.claim_and_unlink``).  Either layout: a keyed
    table's process table has a limiter's offsets."""
    try:
        seg, geo = open_group(name, None, None, frozenset(), time.monotonic_ns, None)
    except (LimiterNotFoundError, Collected):
        return False
    regions: List[Tuple[Segment, Cells]] = []
    try:
        for i in range(len(geo.keys)):
            regions.append(region_opener(seg, geo, i, wait=False)())
        return claim_and_unlink(name, seg.inode, [ProcessTable(c, geo.slots) for _, c in regions])
    except Collected:
        return False
    finally:
        for region, c in regions:
            c.close()
            region.close()
        seg.close()


def copy_geometry(name: str, regions: int) -> Geometry:
    """The geometry of a ready group of ``regions`` layout, from a private copy of its header read
    with ``pread`` (nothing mapped), judged against the file's whole size."""
    head, st = pread_file(name, 0, L.GROUP_HEADER_BYTES, None)
    # the header's copy, judged against the file's whole size (the regions are read below)
    seg = Segment(name, bytearray(head.ljust(L.GROUP_HEADER_BYTES, b"\0")), st.st_size, False, 0)
    check_copied(name, name, seg, GROUP)
    return read_geometry(seg, regions)


def copy_regions(name: str, regions: int) -> Tuple[Geometry, List[Segment]]:
    """A private copy of every region of a ready group of ``regions`` layout, read with ``pread``
    (nothing mapped), for the tools that only look."""
    geo = copy_geometry(name, regions)
    out = []
    for i in range(len(geo.keys)):
        data, st = pread_file(name, geo.offset(i), geo.region_bytes, None)
        size = len(data) & ~7
        buf = bytearray(max(size, 8))
        buf[:size] = data[:size]
        out.append(
            Segment(name, buf, size, False, st.st_ino, st.st_ctime_ns, st.st_uid, st.st_mode)
        )
    return geo, out
