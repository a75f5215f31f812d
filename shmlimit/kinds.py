"""Entry points that work for every kind of limiter a name may hold: attach, inspect, find the stale
ones and collect them.

A segment's first word says its kind (``layout.MAGIC`` for a ``Limiter``,
``layout.GROUP_MAGIC`` for one of several rates, ``keyed_layout.MAGIC`` for a
``KeyedLimiter``), and a group's ``GROUP_REGIONS`` word whether its rates are
plain or keyed; they are read with ``pread``, without mapping, and each kind's
own module then opens and validates it.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable, Iterable, Iterator, List, Tuple, Union

from shmlimit.attachment import collect as collect_attached
from shmlimit.errors import LimiterNotFoundError, SegmentError, ShmlimitError
from shmlimit.group import collect as collect_group
from shmlimit.group import copy_geometry
from shmlimit.header import LIMITER, open_existing, wait_ready
from shmlimit.keyed import layout as K
from shmlimit.keyed.limiter import KeyedLimiter, KeyedStats, inspect_keyed
from shmlimit.keyed.multi import MultiKeyedLimiter
from shmlimit.keyed.segment import KEYED
from shmlimit.keyed.segment import collect as collect_keyed
from shmlimit.keyed.stats import inspect_keyed_group
from shmlimit.limiter import Limiter
from shmlimit.limiter import attach as attach_limiter
from shmlimit.multirate import MultiLimiter, MultiStats, inspect_group
from shmlimit.shm import layout as L
from shmlimit.shm.segment import peek_word, validate_name
from shmlimit.stats import Stats
from shmlimit.stats import inspect as inspect_limiter


def _word(name: str, offset: int = L.MAGIC_OFF) -> int:
    """A word of ``name``'s segment (``peek_word``), 0 if it cannot be read: absent or unreadable,
    the kind's own open says which, and why (a FIFO or a directory planted under the name, too)."""
    try:
        return peek_word(name, offset)
    except (OSError, SegmentError):
        return 0


def _by_kind(name: str, keyed: Any, keyed_group: Any, group: Any, plain: Any) -> Any:
    """The one of the four given that serves the kind ``name`` holds (a ``Limiter``'s when no
    segment, or no readable one, is there: its own open then says why)."""
    validate_name(name)
    magic = _word(name)
    if magic == K.MAGIC:
        return keyed
    if magic == L.GROUP_MAGIC:
        return keyed_group if _word(name, L.GROUP_REGIONS) == L.REGIONS_KEYED else group
    return plain


def attach(
    name: str, *, mode: int = 0o600, trusted_uids: Iterable[int] = ()
) -> Union[Limiter, MultiLimiter, KeyedLimiter, MultiKeyedLimiter]:
    """Attach to an existing limiter by name, whatever its kind and configuration.

    Returns a ``KeyedLimiter`` for a keyed segment, the limiter of several rates for a group
    (plain or keyed; its rates a list or a dict, as created), else a ``Limiter``.  Raises
    ``LimiterNotFoundError`` (a ``FileNotFoundError``) naming it when none exists,
    and ``UntrustedSegmentError`` (a ``SegmentError``) for a segment of any kind
    owned by another user (other than root and ``trusted_uids``) or
    writable by group or others beyond ``mode``.  A window table is no limiter: it is opened as
    the ``limits`` storage ``shm://NAME`` (a ``SegmentError`` says so).
    """
    make = _by_kind(
        name,
        KeyedLimiter,
        partial(MultiKeyedLimiter, KeyedLimiter, rates=None),
        partial(MultiLimiter, rates=None),
        attach_limiter,
    )
    try:
        return make(name, mode=mode, trusted_uids=trusted_uids)
    except LimiterNotFoundError as e:  # (a constructor's advice is its rate=, which attach has not)
        e.args = (
            f"{LimiterNotFoundError(name)}; create it with its kind's constructor, e.g. "
            "shmlimit.Limiter(name, rate=...) or shmlimit.KeyedLimiter(name, rate=...)",
        )
        raise


def inspect(name: str) -> Union[Stats, MultiStats, KeyedStats]:
    """A snapshot of a limiter of any kind, read without joining it (nothing is written).  A window
    table (the ``limits`` storage ``shm://``) gives a ``KeyedStats`` of ``kind`` "windows", with no
    rate of its own (its rate, per and capacity read 0)."""
    return _by_kind(name, inspect_keyed, inspect_keyed_group, inspect_group, inspect_limiter)(name)


def collect(name: str) -> bool:
    """Unlink the segment, whatever its kind, if no live process is attached to it; True if it did
    (each kind's claim, check, then unlink: a process attaching meanwhile keeps it)."""
    return _by_kind(name, collect_keyed, collect_group, collect_group, collect_attached)(name)


def inspect_each(
    names: Iterable[str], unreadable: Callable[[str, Exception], None]
) -> Iterator[Tuple[str, Union[Stats, MultiStats, KeyedStats]]]:
    """Each name with its snapshot (``inspect``); a segment that cannot be read (gone since listed,
    foreign, corrupt, not ours) is handed to ``unreadable`` with the error instead, never fatal."""
    for name in names:
        try:
            s = inspect(name)
        except (ShmlimitError, OSError, ValueError) as e:
            unreadable(name, e)
            continue
        yield name, s


def reopen(name: str) -> None:
    """Open ``name`` as its kind's opener does, then close it: a claim its collector died holding
    is given back after ``DOOMED_WAIT``, a live collector's is waited out (then
    ``LimiterNotFoundError``: it unlinked the name).  For ``gc``, of every kind: a window table
    too, which ``attach`` refuses; a plain or keyed segment is not joined."""
    magic = _word(name)
    if magic == L.GROUP_MAGIC:  # (its regions' claims: the group's opener, in attach)
        attach(name).close()
        return
    kind = KEYED if magic == K.MAGIC else LIMITER
    seg = open_existing(name, 0o600, frozenset(), kind)  # (trusted as attach: ours, 0o600)
    wait_ready(name, seg, 0o600, frozenset(), kind).close()


def beyond(name: str) -> int:
    """The processes counted beyond the process table of ``name``'s segment, whatever its kind (of
    a group: the most of any rate's, each process counted in every rate it joined;
    ``ProcessTable.beyond``): live ones, and any killed while attached."""
    regions = _by_kind(name, None, L.REGIONS_KEYED, L.REGIONS_LIMITER, None)
    if regions is None:
        return _word(name, L.BEYOND)
    geo = copy_geometry(name, regions)
    return max(_word(name, geo.offset(i) + L.BEYOND) for i in range(len(geo.keys)))


def claimed(name: str) -> bool:
    """A collector claimed ``name``'s segment (of a group: a rate) and has not unlinked it: it is
    unlinking it now, or it died between its claim and its unlink (an opener gives such a claim
    back after ``DOOMED_WAIT``: ``reopen`` does, for ``gc``)."""
    regions = _by_kind(name, None, L.REGIONS_KEYED, L.REGIONS_LIMITER, None)
    try:
        geo = None if regions is None else copy_geometry(name, regions)
    except (ShmlimitError, OSError):
        return False
    offsets = [0] if geo is None else [geo.offset(i) for i in range(len(geo.keys))]
    return any(_word(name, off + L.STATE_OFF) == L.STATE_DOOMED for off in offsets)


def stale(
    names: Iterable[str],
    unreadable: Callable[[str, Exception], None],
    unlisted: Callable[[str, int], None] = lambda name, count: None,
) -> Tuple[List[str], int]:
    """The names no live process uses, whatever their kind (what ``collect`` removes), and how many
    of the others are in use; a segment that cannot be read goes to ``unreadable`` instead
    (``inspect_each``).  One whose only users are counted beyond its process table (``beyond``)
    is in use, and goes to ``unlisted`` with the count too: a process killed while attached there
    leaves its count for good, so that only ``unlink`` removes it."""
    found, used = [], 0
    for n, s in inspect_each(names, unreadable):
        if any(p.alive for p in s.processes):
            used += 1
            continue
        try:
            count = beyond(n)
        except (ShmlimitError, OSError, ValueError) as e:
            unreadable(n, e)
            continue
        if count:
            unlisted(n, count)
            used += 1
        else:
            found.append(n)
    return found, used
