"""``WindowTable``: fixed-window, sliding-window and moving-window counters for many keys in one
shared-memory segment.

The table behind the ``limits`` storage ``shm://NAME``
(``shmlimit.integrations.limits``): a keyed segment (``keyed_segment``, the
same header protocol and trust checks as a ``KeyedLimiter``'s) whose slots
hold the window-counter kinds of ``keyed_windows`` instead of GCRA.  Every
process that opens the same name shares every key's counts.

Data flows one way: WindowTable -> keyed_windows -> keyed_cells.SlotTable ->
cells -> segment.
"""

from __future__ import annotations

import atexit
import os
import threading
import weakref
from typing import Any, Callable, Optional, Tuple

from shmlimit.errors import SegmentError
from shmlimit.keyed import cells as KC
from shmlimit.keyed import layout as K
from shmlimit.keyed.cells import SlotTable
from shmlimit.keyed.segment import (
    Geometry,
    check_geometry,
    check_moving,
    open_segment,
    read_key,
)
from shmlimit.keyed.windows import CMAX, MOVING_MAX, OVER, MovingWindows, WindowCounters
from shmlimit.shm.cells import Cells
from shmlimit.shm.segment import (
    Segment,
    gone,
    validate_mode,
    validate_name,
    validate_trusted_uids,
)
from shmlimit.shm.segment import unlink as _unlink_name
from shmlimit.shm.table import ProcessTable, proc_start

__all__ = ["WindowTable", "CMAX", "MOVING_MAX", "OVER"]


class WindowTable:
    """Window counters per key, shared by every process that opens ``name``.

    ``keys`` is the number of 64-byte slots, used when this call creates the
    segment (an existing table keeps its size).  A key holds its slot while a
    window it was counted in still matters (a fixed window until it ends; a
    sliding one until the window after it ends) and gives it up afterwards;
    a new key that finds every slot near its home held by such keys takes the
    slot of the one whose window ends first (``when_full="evict"``, the
    default: that key starts afresh at its next hit), or with
    ``when_full="refuse"`` raises ``KeyTableFullError`` (counted in
    ``refused``).  ``store_keys`` keeps each key's first 15 bytes for ``top``
    (by default none).  ``clock`` returns CLOCK_MONOTONIC nanoseconds (for tests).

    Moving windows (``acquire_entry``) have slots of their own: ``moving_keys`` of them, each
    with a log of ``moving_log`` words (a power of two from 8 to 32 768), 64 + 8 * moving_log
    bytes a key.  A key is counted exactly while it has at most ``moving_log - 2`` grants in
    one window (more are refused until the oldest leaves); its limit may be up to
    ``MOVING_MAX`` hits.  ``when_full`` applies to them alike: the key evicted is the one whose
    window ends first.  ``moving_keys=0`` makes a table without moving windows.
    """

    def __init__(
        self,
        name: str,
        keys: int = 100_000,
        *,
        mode: int = 0o600,
        trusted_uids: Any = (),
        clock: Optional[Callable[[], int]] = None,
        when_full: str = "evict",
        store_keys: bool = False,
        moving_keys: int = 1024,
        moving_log: int = 256,
    ) -> None:
        validate_name(name)
        geo = check_geometry(keys, 0)
        for param, v in (("moving_keys", moving_keys), ("moving_log", moving_log)):
            if isinstance(v, bool) or not isinstance(v, int):
                raise ValueError(f"{param} must be an int, got {v!r}")
        ring = moving_log if moving_keys else 0
        if not check_moving(moving_keys, ring, K.KIND_WINDOWS):
            raise ValueError(
                f"moving_keys must be from 0 to {K.MAX_KEYS} and moving_log a power of two from "
                f"{K.MIN_RING} to {K.MAX_RING} (words), at most {K.MAX_MOVING_BYTES} bytes in "
                f"all; got moving_keys={moving_keys!r}, moving_log={moving_log!r}"
            )
        validate_mode(mode)
        flags = KC.table_flags(when_full, store_keys)
        trusted = validate_trusted_uids(trusted_uids)
        self._name = name
        self._seg: Optional[Segment] = None
        for _ in range(16):
            seg, cells, real = open_segment(
                name,
                Geometry(geo.keys, 0, K.KIND_WINDOWS, moving_keys, ring),
                None,
                mode,
                trusted,
            )
            try:
                if real.kind != K.KIND_WINDOWS:
                    raise SegmentError(
                        f"segment {name!r} is a KeyedLimiter, not a table of window counters"
                    )
                secret = read_key(seg, cells, mode, trusted)
            except BaseException:
                cells.close()
                seg.close()
                raise
            if secret is None:  # collected since it was opened: open the name again
                cells.close()
                seg.close()
                continue
            k0, k1 = secret
            # registered, then STATE (see shm.segment.claim_and_unlink): a table a collector
            # claimed meanwhile is left, and the name opened again
            procs = ProcessTable(cells, K.PSLOTS)
            pid = os.getpid()
            start = proc_start(pid)
            slot = procs.register(pid, start if start and start > 0 else 0)
            if not gone(name, seg.inode, cells):
                break
            if slot is not None:
                procs.unregister(slot, pid)
            cells.close()
            seg.close()
        else:
            raise SegmentError(f"could not open window table {name!r}: it kept being collected")
        self._seg, self._cells, self._geo = seg, cells, real
        table = SlotTable(
            cells,
            K.slots_offset(0),
            real.keys,
            real.probe,
            K.KEYS_LIVE,
            K.EVICTED,
            K.owner(os.getpid()),
            K.CUT,
            bool(flags & KC.FLAG_EVICT),
        )
        store = bool(flags & KC.FLAG_STORE_KEYS)
        self.counters = WindowCounters(table, k0, k1, K.REFUSED, clock, name, store)
        # the moving-window slots: the same protocol (and counts of keys) over their own region
        self.moving: Optional[MovingWindows] = None
        if real.moving:
            mtable = SlotTable(
                cells,
                K.moving_offset(real.keys, 0),
                real.moving,
                min(K.PROBE, real.moving),
                K.KEYS_LIVE,
                K.EVICTED,
                K.owner(os.getpid()),
                K.CUT,
                bool(flags & KC.FLAG_EVICT),
                K.moving_stride(real.ring),
            )
            self.moving = MovingWindows(mtable, real.ring, k0, k1, K.REFUSED, clock, name, store)
        # This process in the segment's process table, as a KeyedLimiter's user: listed (alive or
        # dead) by `shmlimit list`/`top`, with the hits it counted.  Registered on opening; a forked
        # child on its first call (``_live``), so a child that never counts is never listed.
        self._procs = procs
        self._lock = threading.Lock()
        #: A forked child's first use registers it (``_live``): set by the fork hook below, so that
        #: no call pays a ``getpid`` system call to tell.
        self._forked = False
        self._joined(pid, slot)
        _open_tables.add(self)

    def _joined(self, pid: int, slot: Optional[int]) -> None:
        self._slot, self._pid = slot, pid
        line = None if slot is None else K.HEADER_BYTES + slot * K.LINE
        # hits granted in the slot's GRANTS word, every hit asked in its P_HITS word
        self._grants = K.UNREG_GRANTS if line is None else line + 16
        self._hits = K.UNREG_HITS if line is None else line + K.P_HITS

    def _register(self) -> None:
        """A forked child's first use: it registers as itself, in the table still under the name."""
        with self._lock:
            pid = os.getpid()
            if self._pid == pid:
                self._forked = False
                return
            self._joined(self._pid, None)  # the parent's slot is not ours
            seg = self._seg
            if seg is not None and not gone(self._name, seg.inode, self._cells):
                start = proc_start(pid)
                slot = self._procs.register(pid, start if start and start > 0 else 0)
                if not gone(self._name, seg.inode, self._cells):
                    self._joined(pid, slot)
                    for counters in (self.counters, self.moving):
                        if counters is not None:  # insert as ourselves
                            counters.rebind(pid)
                    self._forked = False
                    return
                if slot is not None:
                    self._procs.unregister(slot, pid)
            raise SegmentError(
                f"window table {self._name!r} was collected or removed while this process held "
                "it unused (no live process was registered); open it again"
            )

    def _count(self, hits: int, granted: int) -> None:
        """Count ``hits`` asked, ``granted`` of them granted, in this process's words."""
        if hits:
            self._cells.fetch_add(self._hits, hits)
        if granted:
            self._cells.fetch_add(self._grants, granted)

    @property
    def name(self) -> str:
        return self._name

    @property
    def slots(self) -> int:
        """Key slots in the table (fixed and sliding windows)."""
        return self._geo.keys

    @property
    def moving_slots(self) -> int:
        """Moving-window key slots in the table (0: it has no moving windows)."""
        return self._geo.moving

    @property
    def moving_log(self) -> int:
        """Words of each moving-window key's log (0: no moving windows)."""
        return self._geo.ring

    @property
    def closed(self) -> bool:
        return self._seg is None

    def _live(self) -> Cells:
        if self._seg is None:
            raise ValueError(f"window table {self._name!r} is closed in this process")
        if self._forked:  # a forked child's first use: it registers as itself
            self._register()
        return self._cells

    # The counters (see keyed_windows.WindowCounters for the exact semantics).

    def incr(self, key: object, expiry: float, amount: int = 1, limit: Optional[int] = None) -> int:
        """Add ``amount`` hits to ``key``'s fixed window of ``expiry`` seconds; its count after that.

        With ``limit`` (hits per window, as the caller will compare the count with it), the
        hits are counted as granted when the count stays within it (the table's ``grants``);
        without, they are counted as hits only."""
        self._live()
        count = self.counters.incr(key, expiry, amount)
        self._count(amount, amount if limit is not None and count <= limit else 0)
        return count

    def get(self, key: object) -> int:
        """Hits in ``key``'s current fixed window (0 if none)."""
        self._live()
        return self.counters.get(key)

    def expires_in(self, key: object) -> float:
        """Seconds until ``key``'s fixed window ends (0.0 if it has none)."""
        self._live()
        return self.counters.expiry_ms(key) / 1000

    def clear(self, key: object) -> bool:
        """Forget ``key``'s fixed window; True if it had one."""
        self._live()
        return self.counters.clear(key)

    def acquire_sliding(self, key: object, limit: int, expiry: float, amount: int = 1) -> bool:
        """Count ``amount`` hits in ``key``'s sliding window of ``expiry`` seconds iff the estimate stays <= limit."""
        self._live()
        granted = self.counters.acquire_sliding(key, limit, expiry, amount)
        self._count(amount, amount if granted else 0)
        return granted

    def sliding(self, key: object, expiry: float):
        """``(previous count, its weight in seconds, current count, seconds until it expires)``."""
        self._live()
        return self.counters.sliding(key, expiry)

    def clear_sliding(self, key: object, expiry: float) -> bool:
        self._live()
        return self.counters.clear_sliding(key, expiry)

    def _moving(self) -> MovingWindows:
        self._live()
        if self.moving is None:
            raise ValueError(
                f"window table {self._name!r} was made without moving windows (moving_keys=0): "
                "unlink it and make it again with moving_keys > 0"
            )
        return self.moving

    def acquire_entry(self, key: object, limit: int, expiry: float, amount: int = 1) -> bool:
        """Count ``amount`` hits for ``key`` iff its hits in the last ``expiry`` seconds plus
        ``amount`` stay within ``limit`` (at most ``MOVING_MAX``): the moving window."""
        granted = self._moving().acquire_entry(key, limit, expiry, amount)
        self._count(amount, amount if granted else 0)
        return granted

    def moving_window(self, key: object, expiry: float) -> Tuple[Optional[float], int]:
        """``(seconds since the oldest hit in the window or None, hits in the window)``."""
        return self._moving().moving_window(key, expiry)

    def clear_moving(self, key: object) -> bool:
        """Forget ``key``'s moving window; True if it had one."""
        return self._moving().clear_moving(key)

    def reset(self) -> int:
        """Forget every key; how many were forgotten."""
        self._live()
        return self.counters.reset() + (self.moving.reset() if self.moving else 0)

    @property
    def keys_live(self) -> int:
        """Slots holding a key now (a key whose windows ended may hold its slot until reused)."""
        v = self._live().load(K.KEYS_LIVE)
        return v if v < 1 << 63 else 0

    @property
    def evicted(self) -> int:
        """Keys whose slot was reused after their windows ended."""
        return self._live().load(K.EVICTED)

    @property
    def refused(self) -> int:
        """New keys refused because every slot near their home held a key still counted."""
        return self._live().load(K.REFUSED)

    def close(self) -> None:
        """Unmap the segment in this process; the table stays for the others (``unlink`` removes it)."""
        seg, self._seg = self._seg, None
        if seg is not None:
            if self._slot is not None and self._pid == os.getpid():
                self._procs.unregister(self._slot, self._pid)
            self._cells.close()
            seg.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # pragma: no cover - interpreter shutdown
            pass

    def unlink(self) -> None:
        """Remove the segment's name; processes still attached keep working on their mapping."""
        _unlink_name(self._name)

    def __reduce__(self):
        return (WindowTable, (self._name,))

    def __repr__(self) -> str:
        if self._seg is None:
            return f"<shmlimit.WindowTable {self._name!r} closed>"
        return (
            f"<shmlimit.WindowTable {self._name!r} keys={self.keys_live}/{self.slots} "
            f"evicted={self.evicted} refused={self.refused} backend={self._cells.backend}>"
        )


#: Every table open in this process: at exit each gives its process slot back; in a forked child
#: each registers as itself on its first use.
_open_tables: "weakref.WeakSet[WindowTable]" = weakref.WeakSet()


def _after_fork() -> None:
    for t in list(_open_tables):
        t._forked = True


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)


@atexit.register
def _close_all() -> None:
    for t in list(_open_tables):
        try:
            t.close()
        except Exception:  # pragma: no cover - best effort at exit
            pass
