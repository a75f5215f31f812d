"""The one segment start-up protocol: create and initialise a segment, or open one that is ready.

Every kind of segment starts up by it (a ``Limiter``'s, a group's, a keyed table's), told what
differs by its ``Kind``.

Creation is ``shm_open(O_CREAT|O_EXCL)``, so of many racing creators exactly
one initialises.  It writes its pid first (``CREATOR_PID``), then the header,
the upstream's description, the config and the rovers (``Bucket.initialise``),
then ``MAGIC``, and ``STATE = READY`` last.  Openers wait for ``READY``, then
check the magic, the version and that ``SIZE`` matches ``SLOTS`` and the
mapping; anything else raises ``SegmentError``.  A segment whose creator died
mid-initialisation is refused when attaching, and replaced when creating.

The upstream's description (hierarchical mode, without secrets) is written
by the creator too (``UpstreamSpec.write``), before ``READY``.
"""

from __future__ import annotations

import os
import time
from contextlib import closing, contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Tuple

from shmlimit.adapt import Adapt
from shmlimit.adapt import write as write_adapt
from shmlimit.bucket.rovers import Bucket
from shmlimit.config import Config
from shmlimit.errors import AbandonedSegmentError, LimiterNotFoundError, SegmentError
from shmlimit.redis.spec import UpstreamSpec
from shmlimit.shm import layout as L
from shmlimit.shm.cells import Cells, open_cells, warm_backend
from shmlimit.shm.segment import (
    INIT_WAIT,
    LIVE_CREATOR_WAIT,
    MAX_BYTES,
    Segment,
    current_inode,
    drop_secret,
    give_back_claim,
    publish,
    reopening,
    start_header,
)
from shmlimit.shm.segment import unlink as unlink_name
from shmlimit.shm.table import is_alive


@dataclass(frozen=True)
class Creation:
    """What a creating call asks for: the segment is made with these if it does not exist."""

    config: Config
    mode: int = 0o600
    initial: Optional[float] = None  #: ops in the bucket at creation (None: full)
    slots: int = L.DEFAULT_SLOTS
    upstream: Optional[UpstreamSpec] = (
        None  #: hierarchical mode: the upstream, as stored (no secrets)
    )
    adapt: Optional[Adapt] = None  #: the adaptive rate's parameters (``adapt``)


#: ready_creator's answer for a segment a collector has claimed (STATE_DOOMED).
DOOMED = -2


@dataclass(frozen=True)
class Kind:
    """What the start-up protocol needs of one kind of segment: its magic and version, the size
    its header's words declare (None if they make no sense), and how a creator sizes and
    initialises one (READY last).  Every kind's line 0 is ``shm.layout``'s (MAGIC, VERSION, SIZE,
    STATE, SLOTS, CREATOR_PID at the same offsets), so only these differ."""

    what: str  #: what errors call a segment of this kind ("a Limiter")
    magic: int
    version: int
    header_bytes: int
    declared_size: Callable[[Cells], Optional[int]]
    size_of: Callable[[Any], int]
    initialise: Callable[[Segment, Any, int], Cells]
    cells_bytes: Callable[[Segment], int]
    noun: str = "limiter"  #: what creating one makes ("creating the keyed limiter again")
    #: no segment of this kind is larger (bytes): a bigger one is refused before it is mapped
    max_bytes: Optional[int] = None
    #: what segment ``name`` of this kind is and how to open it, from the words of its line 0 in
    #: ``c``, for another kind's opener to say; None: ``what``, opened by ``shmlimit.attach``
    described: Optional[Callable[[str, Cells], Tuple[str, str]]] = None

    def describe(self, name: str, c: Cells) -> Tuple[str, str]:
        if self.described is None:
            return self.what, "use shmlimit.attach"
        return self.described(name, c)


def _limiter_size(c: Cells) -> Optional[int]:
    slots = c.load(L.SLOTS_OFF)
    return L.segment_size(slots) if 1 <= slots <= L.MAX_SLOTS else None


@contextmanager
def closed_on_failure(c: Cells) -> Iterator[Cells]:
    """A creator's cells while it writes a new segment: closed if a write fails, so that the
    segment's mapping (which they export) can be closed too (``open_segment`` discards it)."""
    try:
        yield c
    except BaseException:
        c.close()
        raise


def initialise(seg: Segment, create: Creation, now_ns: int) -> Cells:
    """Write a new segment's header, upstream description, adapt's parameters, config and rovers;
    READY last."""
    with closed_on_failure(start_header(seg, L.VERSION, create.slots)) as c:
        base = os.environ.get("SHMLIMIT_TEST_ROVER_BASE", "0")  # tests: rovers anywhere
        try:
            rovers = int(base)  # (any integer: the rovers wrap, mod 2**64)
        except ValueError:
            raise ValueError(
                f"SHMLIMIT_TEST_ROVER_BASE must be an integer (a test hook), got {base!r}"
            ) from None
        if create.upstream is not None:
            create.upstream.write(c)
        write_adapt(c, create.adapt)
        initial, fed = create.initial, create.upstream is not None
        Bucket.initialise(c, create.config, now_ns, initial, rovers, fed)
        publish(c, L.MAGIC)
    return c


def discard(seg: Segment) -> None:
    """Undo a creation whose initialisation failed: the name taken back, if it is still this
    segment's (an opener may have replaced it as abandoned meanwhile), with its secret file if it
    wrote one, then the mapping closed.  Shared state is as before the creating call."""
    if current_inode(seg.name) == seg.inode:
        try:
            unlink_name(seg.name)
        except LimiterNotFoundError:  # pragma: no cover - removed meanwhile
            pass
    drop_secret(seg.name, seg.inode)
    seg.close()


def cells_size(seg: Segment) -> int:
    with closing(open_cells(seg.mm, L.HEADER_BYTES)) as c:
        return min(seg.size, L.segment_size(c.load(L.SLOTS_OFF)))


LIMITER = Kind(
    "a Limiter",
    L.MAGIC,
    L.VERSION,
    L.HEADER_BYTES,
    _limiter_size,
    lambda create: L.segment_size(create.slots),
    initialise,
    cells_size,
    max_bytes=MAX_BYTES,
)
#: Every kind the start-up protocol knows, by magic (another kind's segment is named in errors).
KINDS_BY_MAGIC = {LIMITER.magic: LIMITER}


def ready_creator(name: str, seg: Segment, waited: float, kind: Kind = LIMITER) -> int:
    """0 if the segment is fully initialised (and its header sound), ``DOOMED`` if a collector
    claimed it, else the pid of its live creator (-1: not yet known).

    Raises ``SegmentError`` for a foreign or corrupt header and ``AbandonedSegmentError``
    for an initialisation nobody will finish.  A creator gets ``INIT_WAIT``
    seconds to write its pid, counted from the segment's creation (its ctime)
    *or* from when this caller first looked (``waited``, monotonic), whichever
    ends first: a ctime anyone with write access can keep refreshing must not
    keep an opener waiting.
    """
    if seg.size == 0:
        if (time.time_ns() - seg.ctime_ns) / 1e9 > INIT_WAIT or waited > INIT_WAIT:
            raise AbandonedSegmentError(name, seg.inode, 0, kind.noun)
        return -1
    if seg.size < kind.header_bytes:
        raise SegmentError(
            f"segment {name!r} is truncated: {seg.size} bytes, {kind.what} needs {kind.header_bytes}"
        )
    with closing(open_cells(seg.mm, kind.header_bytes)) as cells:
        magic, state, version, size, slots, creator = (
            cells.load(off)
            for off in (
                L.MAGIC_OFF,
                L.STATE_OFF,
                L.VERSION_OFF,
                L.SIZE_OFF,
                L.SLOTS_OFF,
                L.CREATOR_PID_OFF,
            )
        )
        declared = kind.declared_size(cells) if magic == kind.magic else None
        other = KINDS_BY_MAGIC.get(magic) if magic not in (0, kind.magic) else None
        if other is not None:
            what, how = other.describe(name, cells)
            raise SegmentError(f"segment {name!r} is {what}, not {kind.what}: {how}")
    if magic not in (0, kind.magic):
        raise SegmentError(f"segment {name!r} is not a shmlimit limiter (bad magic {magic:#018x})")
    if magic == kind.magic and state == L.STATE_READY:
        if version != kind.version:
            raise SegmentError(
                f"segment {name!r} has layout version {version}; this shmlimit reads version {kind.version}"
            )
        if declared is not None and size == declared and seg.size < size:
            raise SegmentError(
                f"segment {name!r} is truncated: its header says {size} bytes, the file has {seg.size}"
            )
        if declared is None or size != declared or seg.size < size:
            raise SegmentError(
                f"segment {name!r} is corrupt: header says {size} bytes and {slots} slots, "
                f"the mapping has {seg.size} bytes"
            )
        return 0
    if magic == kind.magic and state == L.STATE_DOOMED:
        return DOOMED  # a collector is unlinking it (or it restores READY)
    if magic == kind.magic and state != L.STATE_INIT:
        raise SegmentError(f"segment {name!r} is corrupt: unknown state {state}")
    age = (time.time_ns() - seg.ctime_ns) / 1e9
    if (
        creator > 0xFFFFFFFF
        or (creator and not is_alive(creator, 0))
        or (not creator and (age > INIT_WAIT or waited > INIT_WAIT))
    ):
        raise AbandonedSegmentError(name, seg.inode, creator, kind.noun)
    return creator or -1


def check_copied(name: str, label: str, seg: Segment, kind: Kind = LIMITER) -> None:
    """A private copy (``label``: the segment ``name``, or a rate's region of that group) is read
    only if it is ready, never waited for: else ``SegmentError`` naming ``name`` (``ready_creator``
    raises for the rest)."""
    verdict = ready_creator(label, seg, 0.0, kind)
    if verdict != 0:
        what = "being removed" if verdict == DOOMED else "still being initialised"
        raise SegmentError(f"segment {name!r} is {what}")


def open_existing(
    name: str, mode: Optional[int], trusted: frozenset = frozenset(), kind: Kind = LIMITER
) -> Segment:
    """Map the existing segment ``name`` (``Segment.open``) as one of ``kind``: one that says it
    is ready and of this kind is refused before mapping if it claims more bytes than the file has
    (no SIGBUS) or is larger than any of its kind."""
    return Segment.open(name, mode, trusted, kind.magic, kind.max_bytes)


def wait_ready(
    name: str,
    seg: Segment,
    mode: Optional[int] = None,
    trusted: frozenset = frozenset(),
    kind: Kind = LIMITER,
) -> Segment:
    """Return a mapping of a fully initialised segment, re-opening while its creator works.

    A live creator is waited for (up to ``LIVE_CREATOR_WAIT``, by the
    monotonic clock), never replaced; see ``ready_creator`` for the rest.
    Re-opening repeats the trust check of the first open.
    """
    start = time.monotonic()
    while True:
        waited = time.monotonic() - start
        try:
            creator = ready_creator(name, seg, waited, kind)
        except BaseException:
            seg.close()
            raise
        if creator == 0:
            return seg
        if creator == DOOMED:
            # a collector is unlinking it (or it restores READY): wait, then open the name again
            give_back_claim(seg.mm, waited)
        elif waited > LIVE_CREATOR_WAIT:
            seg.close()
            raise SegmentError(
                f"segment {name!r} is still being initialised by pid {creator} after {waited:.0f} s"
            )
        time.sleep(0.001)
        seg.close()
        seg = open_existing(name, mode, trusted, kind)


def open_segment(
    name: str,
    create: Optional[Creation],
    mode: Optional[int],
    trusted: frozenset = frozenset(),
    clock: Callable[[], int] = time.monotonic_ns,
    kind: Kind = LIMITER,
) -> Tuple[Segment, Cells]:
    """Create and initialise the segment, or map the existing one; never a half-initialised header.

    With ``create`` (create intent), a segment abandoned mid-initialisation is
    replaced, and a name unlinked between our failed create and our open is
    created again.  Without it, both raise.  An existing segment is opened
    only if it passes the trust check for ``mode`` and ``trusted`` (uids);
    ``mode`` None skips it (``collect``, which only unlinks, as the filesystem
    allows).  ``clock`` (CLOCK_MONOTONIC ns) starts a new bucket's schedule.  ``kind`` is the
    kind of segment (a limiter's by default; ``group.GROUP`` for several rates).
    """
    warm_backend()  # a creator's first store must not wait for an import
    for _ in reopening():
        if create is not None:
            seg = Segment.create(name, kind.size_of(create), create.mode)
            if seg is not None:
                try:
                    return seg, kind.initialise(seg, create, clock())
                except BaseException:
                    discard(seg)
                    raise
        try:
            seg = wait_ready(name, open_existing(name, mode, trusted, kind), mode, trusted, kind)
        except LimiterNotFoundError:
            if create is None:
                raise
            continue
        except AbandonedSegmentError as e:
            if create is None:
                raise
            time.sleep(0.05)  # replacing destroys a segment: confirm the verdict once more first
            try:
                wait_ready(
                    name, open_existing(name, mode, trusted, kind), mode, trusted, kind
                ).close()
                continue  # it became ready (or another took its place): attach normally
            except AbandonedSegmentError as again:
                if again.inode != e.inode:
                    continue
            except (LimiterNotFoundError, SegmentError):
                continue
            if current_inode(name) == e.inode:  # still the abandoned one, not a newer segment
                try:
                    unlink_name(name)
                except LimiterNotFoundError:
                    pass
            continue
        return seg, open_cells(seg.mm, kind.cells_bytes(seg))
    raise SegmentError(
        f"could not create or open {kind.noun} {name!r}: it kept being unlinked and re-created"
    )
