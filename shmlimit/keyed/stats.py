"""What a keyed segment holds, read without joining: ``KeyedStats`` snapshots and key samples.

For ``inspect``, ``list``, ``top`` and the metrics: every figure comes from a
private copy read with ``pread`` (the header and process table, and a bounded
run of key slots per call), never a mapping, so looking never registers,
writes or faults on a truncated segment.  Both kinds of keyed segment are
read here: a ``KeyedLimiter``'s GCRA keys, and the window counters of the
``limits`` storage (``kind`` "windows"; ``sample_windows``).
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass
from typing import List, Optional, Tuple

from shmlimit.adapt import AdaptStats
from shmlimit.config import Config
from shmlimit.errors import SegmentError
from shmlimit.group import copy_geometry
from shmlimit.keyed import cells as KC
from shmlimit.keyed import layout as K
from shmlimit.keyed.adapt import stats as adapt_stats
from shmlimit.keyed.gcra import TICKS_PER_S, Overrides, Rate, peek_default, rate_of
from shmlimit.keyed.segment import Geometry, check_kind, read_copy, validate_header
from shmlimit.keyed.windows import FLAG, unpack
from shmlimit.rate_group import MultiStats
from shmlimit.shm import layout as L
from shmlimit.shm.banks import settle_copy
from shmlimit.shm.cells import Cells, open_cells
from shmlimit.shm.segment import validate_name
from shmlimit.shm.table import ProcessTable, slot_alive


@dataclass(frozen=True)
class KeyedProcess:
    pid: int
    alive: bool
    grants: int


@dataclass(frozen=True)
class KeyedStats:
    """A snapshot of a keyed limiter.  Rates are ops per ``per`` seconds; counts are ops or keys."""

    name: str
    rate: float
    per: float
    capacity: float
    slots: int  #: key slots in the table: every slot a key can hold (a window table's moving too)
    keys: int  #: keys live now (a key whose bucket refilled may still hold its slot until reused)
    evicted: int  #: keys whose slot a new key took (their bucket full again, or see ``cut``)
    refused_full: int  #: new keys refused: no slot of their window could be taken
    grants: int  #: ops granted for all keys by every process that ever attached
    overrides: int  #: keys with a rate of their own
    override_slots: int
    segment_bytes: int
    processes: Tuple[KeyedProcess, ...]
    backend: str
    #: "keyed" (a KeyedLimiter), or "windows": a table of window counters (the ``limits`` storage
    #: ``shm://``), with no rate of its own (rate, per, capacity 0); its ``grants`` are the hits
    #: it granted (a fixed-window hit within the limit its ``limits`` key names, a granted
    #: sliding- or moving-window hit)
    kind: str = "keyed"
    #: of ``evicted``, keys still limited when a new key took their slot (the table was full
    #: there: each lost its remaining debt; a nonzero count says the table is too small)
    cut: int = 0
    #: a table of window counters: every hit asked of it, granted or refused (None for a
    #: KeyedLimiter, whose refusals take nothing)
    hits: Optional[int] = None
    #: each key's adaptive rate: its parameters, and every key's outcomes and decisions (None:
    #: the keys do not adapt); a key's rate in force is its override (``override(key)``)
    adapt: Optional[AdaptStats] = None

    @property
    def bytes_per_key(self) -> float:
        return self.segment_bytes / self.slots

    def describe(self) -> str:
        """Its settings as ``Config.describe`` words them (each key's), and its key slots; a
        window table, which has no rate of its own, says so."""
        if self.kind == "windows":
            return f"windows keys={self.slots}"
        return f"{Config(self.rate, self.per, self.capacity).describe()} keys={self.slots}"


def snapshot_of(name: str, c: Cells, geo: Geometry, size: int) -> KeyedStats:
    """A snapshot from the header and process table in ``c`` (a mapping or a private copy)."""
    r = peek_default(
        c
    )  # no wait: a copy taken while a writer worked would never change (display only)
    table = ProcessTable(c, K.PSLOTS)
    procs = tuple(
        KeyedProcess(e.pid, slot_alive(e.pid, e.start, e.pidns), e.grants) for e in table.entries()
    )
    keys = c.load(K.KEYS_LIVE)
    return KeyedStats(
        name=name,
        rate=r.rate,
        per=r.per,
        capacity=r.burst,
        slots=geo.keys + geo.moving,  # ``keys`` counts the keys of both
        keys=keys if keys < 1 << 63 else 0,
        evicted=c.load(K.EVICTED),
        refused_full=c.load(K.REFUSED),
        grants=c.load(K.UNREG_GRANTS) + table.total_grants(),
        overrides=c.load(K.OVR_LIVE),
        override_slots=geo.overrides,
        segment_bytes=size,
        processes=procs,
        backend=c.backend,
        kind="windows" if geo.kind == K.KIND_WINDOWS else "keyed",
        cut=c.load(K.CUT),
        hits=_hits(c) if geo.kind == K.KIND_WINDOWS else None,
        adapt=adapt_stats(c) if geo.kind == K.KIND_GCRA else None,
    )


def _hits(c: Cells) -> int:
    """A window table's hits: those of processes beyond the process table, and every slot's."""
    return c.load(K.UNREG_HITS) + sum(
        c.load(K.HEADER_BYTES + i * K.LINE + K.P_HITS) for i in range(K.PSLOTS)
    )


@dataclass(frozen=True)
class KeySample:
    key: str  #: the key's first bytes if stored (``store_keys``), else ``#`` and its digest's first hex
    grants: int  #: ops granted to this key since it took its slot
    wait: float  #: seconds until the key's bucket is full again (0.0: idle)
    #: the key's own rate (its override: an adaptive key's rate in force), ops per ``per``
    #: seconds; None while it follows the default
    rate: Optional[float] = None
    per: Optional[float] = None


def sample_keys(name: str, start: int, count: int) -> Tuple[List[KeySample], int]:
    """Read ``count`` key slots from ``start`` (wrapping) without joining: the live keys found there.

    Returns them with the next start, so a caller (``shmlimit top``) covers the
    whole table over several refreshes at a bounded cost per refresh.  The
    slots are read with ``pread`` into a private copy: nothing is mapped.
    ``name`` may be a rate's label (``group[key]``): that rate's table.
    """
    now = time.monotonic_ns() << K.TICK_SHIFT
    slots, nxt = _live_slots(name, K.KIND_GCRA, start, count)
    owns = _own(name, [(w[K.S_D0 // 8], w[K.S_D1 // 8]) for w in slots]) if slots else []
    return [_sample(words, default, vals, now) for words, (default, vals) in zip(slots, owns)], nxt


def _sample(
    words: Tuple[int, ...], tau: int, own: Optional[Tuple[int, ...]], now: int
) -> KeySample:
    """The key in a LIVE slot's ``words`` at ``now`` (ticks): its own rate's values ``own`` (RATE
    PER BURST T TAU; None: it follows the default, of burst tolerance ``tau`` ticks)."""
    if own is not None:
        tau = own[4]
    # V0 less BASE is the key's TAT under a burst of MAX_TICKS (keyed_cells): under its own, less
    tat = words[K.S_V0 // 8] - words[K.S_BASE // 8] - (K.MAX_TICKS - tau)
    r = None if own is None else rate_of(own)
    return KeySample(
        KC.display_key(words[K.S_V3 // 8 :], words[K.S_D0 // 8]),
        words[K.S_V1 // 8],
        max(0, tat - now) / TICKS_PER_S,
        None if r is None else r.rate,
        None if r is None else r.per,
    )


def _overrides_copy(name: str) -> Tuple[Cells, Overrides, Geometry]:
    """A private copy of table ``name``'s header and process table, and of its override entries
    when it has live ones (``OVR_LIVE``: read it before the entries; nothing mapped): cells over
    it, its override table (of no entries when none was copied), and its geometry."""
    seg, at = _where(name)
    c, geo, _ = _header_copy(seg, at)
    if not geo.overrides or not c.load(K.OVR_LIVE):
        return c, Overrides(c, 0, 0), geo
    c.close()
    data, _ = read_copy(seg, at, K.slots_offset(geo.overrides))
    c = open_cells(data, len(data))  # type: ignore[arg-type]  # a private copy
    return c, Overrides(c, geo.overrides, geo.probe), geo


def _own(name: str, digests: List[Tuple[int, int]]) -> List[Tuple[int, Optional[Tuple[int, ...]]]]:
    """For each of table ``name``'s keys ``digests``: the default's TAU (ticks) and the values of
    the key's override (None: it has none), from a private copy of its config and overrides."""
    c, ovr, _ = _overrides_copy(name)
    try:
        default = peek_default(c).tau
        return [(default, ovr.peek(d)) for d in digests]
    finally:
        c.close()


def _per_second(r: Rate) -> float:
    """``r`` in ops per second; inf for values no writer stores (a forged entry sorts last)."""
    ops = r.rate / r.per if r.per > 0 else math.inf
    return ops if math.isfinite(ops) and ops > 0 else math.inf


#: Keys ``adapted_keys`` gives at most: the lowest rates, the keys cut the most.
ADAPTED_SHOWN = 20


def adapted_keys(name: str, count: int = ADAPTED_SHOWN) -> List[KeySample]:
    """The keys of table ``name`` with a rate of their own (an adaptive table's: every key that
    adapts, at its rate in force), the ``count`` lowest rates (ops per second) first, read without
    joining: a private copy of its override entries, then of each key's window of slots.

    A key is named by its slot (its bytes when ``store_keys``, else ``#`` and its digest's first
    hex), with its grants and wait; a key that holds no slot now shows as ``#`` and its digest,
    idle.  ``name`` may be a rate's label (``group[key]``)."""
    c, ovr, geo = _overrides_copy(name)
    try:
        check_kind(name, geo.kind, K.KIND_GCRA)
        found = list(ovr.peek_all())
    finally:
        c.close()
    lowest = sorted(found, key=lambda dv: _per_second(rate_of(dv[1])))[:count]
    now = time.monotonic_ns() << K.TICK_SHIFT
    out = []
    for d, vals in lowest:
        # the key's window of slots, as every lookup probes it from its home
        slots, _ = _live_slots(name, K.KIND_GCRA, (d[0] * geo.keys) >> 64, geo.probe)
        words = next((w for w in slots if (w[K.S_D0 // 8], w[K.S_D1 // 8]) == d), None)
        if words is not None:
            out.append(_sample(words, vals[4], vals, now))
            continue
        r = rate_of(vals)
        out.append(KeySample(KC.display_key((0, 0), d[0]), 0, 0.0, r.rate, r.per))
    return out


def _live_slots(name: str, kind: int, start: int, count: int) -> Tuple[List[Tuple[int, ...]], int]:
    """``count`` key slots from ``start`` (wrapping), read with ``pread`` into a private copy (nothing
    mapped): the words of each LIVE slot whose value is not evicted, and the next start.  A segment
    of another value kind than ``kind`` is refused with ``SegmentError``."""
    name, at = _where(name)
    cells, geo, _ = _header_copy(name, at)
    cells.close()
    check_kind(name, geo.kind, kind)
    base = K.slots_offset(geo.overrides)
    count = min(count, geo.keys)
    start %= geo.keys
    first = min(count, geo.keys - start)
    out = []
    for off, n in ((base + start * K.LINE, first), (base, count - first)):
        if not n:
            continue
        data, _ = read_copy(name, at + off, n * K.LINE)
        c = open_cells(data, len(data))  # type: ignore[arg-type]  # a private copy, not a mapping
        try:
            for i in range(min(n, len(data) // K.LINE)):
                s = i * K.LINE
                if c.load(s) & 0xFF != K.LIVE:
                    continue
                words = tuple(c.load(s + o) for o in range(0, K.LINE, 8))
                if not words[K.S_V0 // 8] & K.DEAD:
                    out.append(words)
        finally:
            c.close()
    return out, (start + count) % geo.keys


#: A rate of a keyed limiter of several rates, as the tools label it: ``group[key]``.
_RATE_LABEL = re.compile(r"(.+)\[([A-Za-z0-9_]+)\]")


def _where(name: str) -> Tuple[str, int]:
    """The segment and the offset of the table ``name`` names: its own (at 0), or a rate's region
    of a keyed group when ``name`` is a rate's label (``group[key]``)."""
    m = _RATE_LABEL.fullmatch(name)
    if m is None:
        return name, 0
    group, key = m.groups()
    geo = copy_geometry(group, L.REGIONS_KEYED)
    if key not in geo.keys:
        raise SegmentError(f"limiter {group!r} has no rate {key!r}")
    return group, geo.offset(geo.keys.index(key))


def _header_copy(name: str, at: int = 0) -> Tuple[Cells, Geometry, int]:
    """A private, validated copy of the header and the process table of the table at ``at`` in
    segment ``name``: (cells over it, geometry, the bytes from ``at`` to the file's end)."""
    validate_name(name)
    data, size = read_copy(name, at, K.overrides_offset())
    size -= at
    c = open_cells(data, len(data))  # type: ignore[arg-type]  # a private copy, not a mapping
    try:
        if (
            len(data) < K.overrides_offset()
            or c.load(K.MAGIC_OFF) != K.MAGIC
            or c.load(K.STATE_OFF) != K.STATE_READY
        ):
            raise SegmentError(f"segment {name!r} is not a ready keyed limiter")
        settle_copy(c, K.CFG_SEQ)  # (a dead writer's lock in it: read at once)
        return c, validate_header(name, c, size), size
    except BaseException:
        c.close()
        raise


def _snapshot(name: str, label: str, at: int = 0, size: Optional[int] = None) -> KeyedStats:
    """``snapshot_of`` the table at ``at`` in segment ``name`` (``size`` bytes; default: to the
    file's end), labelled ``label``, from a private copy of its header and process table."""
    c, geo, left = _header_copy(name, at)
    try:
        return snapshot_of(label, c, geo, left if size is None else size)
    finally:
        c.close()


def inspect_keyed_group(name: str) -> MultiStats:
    """A snapshot of every rate of the keyed limiter of several rates ``name``, read as
    ``inspect_keyed`` reads one table: each region's header and process table, copied."""
    geo = copy_geometry(name, L.REGIONS_KEYED)
    return MultiStats(
        name,
        {
            key: _snapshot(name, f"{name}[{key}]", geo.offset(i), geo.region_bytes)
            for i, key in enumerate(geo.keys)
        },
    )


def inspect_keyed(name: str) -> KeyedStats:
    """A snapshot of a keyed limiter, read without joining it: a private copy of its header, nothing mapped."""
    return _snapshot(name, name)


@dataclass(frozen=True)
class WindowSample:
    """One key of a table of window counters (the ``limits`` storage), as read at one instant."""

    key: str  #: as ``KeySample.key`` (``limits`` puts the limit in a key's first bytes)
    strategy: str  #: "fixed" (fixed window) or "sliding" (sliding window counter)
    count: int  #: hits counted in the current window
    previous: int  #: the previous window's final count (sliding; 0 for a fixed window)
    window: Optional[float]  #: the window's length in seconds (sliding; None for a fixed window)
    ends_in: float  #: seconds until the current window ends


def sample_windows(
    name: str, start: int, count: int, now_ns: Optional[int] = None
) -> Tuple[List[WindowSample], int]:
    """``sample_keys`` for a table of window counters: the keys with a window still counting.

    A fixed-window slot holds ``V0 = end << 25 | count`` and ``V1 = 0``; a
    sliding one ``V0 = X << 25 | ROLLING << 24 | count`` (its window is
    ``[X - 2W, X - W)``) and ``V1 = E << 25 | 1 << 24 | previous``, the
    phase bit telling the kinds apart (``keyed_windows``).  A key whose
    windows are over is left out: it holds nothing any more.  ``now_ns``
    (CLOCK_MONOTONIC ns, default now) is for tests with an injected clock.
    """
    now_ms = (time.monotonic_ns() if now_ns is None else now_ns) / 1e6
    out = []
    slots, nxt = _live_slots(name, K.KIND_WINDOWS, start, count)
    for words in slots:
        (t, rolling, cnt) = unpack(words[K.S_V0 // 8] - words[K.S_BASE // 8])
        v1 = words[K.S_V1 // 8]
        key = KC.display_key(words[K.S_V3 // 8 :], words[K.S_D0 // 8])
        if not v1 & FLAG:  # a fixed window ending at t
            if t > now_ms:
                out.append(WindowSample(key, "fixed", cnt, 0, None, (t - now_ms) / 1000))
            continue
        tag, _, prev = unpack(v1)
        w = (t - tag) / 2  # V1's tag is the current window's start, V0's t is two windows on
        if rolling or w <= 0 or now_ms >= t:
            continue  # mid-move (look next time), or both windows over
        end = t - w
        if now_ms >= end:  # the window ended without a hit since: what it counted is the previous
            prev, cnt, end = cnt, 0, t
        out.append(WindowSample(key, "sliding", cnt, prev, w / 1000, (end - now_ms) / 1000))
    return out, nxt
