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

import os
from typing import Any, Callable, Optional, Tuple

from shmlimit.config import validate_clock
from shmlimit.keyed import cells as KC
from shmlimit.keyed import layout as K
from shmlimit.keyed.cells import SlotTable
from shmlimit.keyed.segment import Geometry, check_geometry, check_moving, open_keyed
from shmlimit.keyed.windows import CMAX, MOVING_MAX, OVER, MovingWindows, WindowCounters
from shmlimit.registry import Attached, Handle, Registry, attach, described, pickled
from shmlimit.shm.cells import Cells
from shmlimit.shm.segment import (
    Segment,
    validate_mode,
    validate_name,
    validate_trusted_uids,
)

__all__ = ["WindowTable", "CMAX", "MOVING_MAX", "OVER"]


class _Attachment(Attached):
    """One process's mapping of one table of window counters, shared by its handles: the words
    its hits are counted in (its slot's, or the unregistered's)."""

    what = "window table"

    def __init__(
        self, name: str, seg: Segment, cells: Cells, geo: Geometry, secret: Tuple[int, int]
    ) -> None:
        super().__init__(name, seg, cells, K.PSLOTS)
        self.geo, self.secret = geo, secret

    def bind(self) -> None:
        line = None if self.slot is None else K.HEADER_BYTES + self.slot * K.LINE
        # hits granted in the slot's GRANTS word, every hit asked in its P_HITS word
        self.grants = K.UNREG_GRANTS if line is None else line + 16
        self.hits = K.UNREG_HITS if line is None else line + K.P_HITS

    def count(self, hits: int, granted: int) -> None:
        """Count ``hits`` asked, ``granted`` of them granted, in this process's words."""
        if hits:
            self.cells.fetch_add(self.hits, hits)
        if granted:
            self.cells.fetch_add(self.grants, granted)


registry: Registry[_Attachment] = Registry()


def _open(name: str, geo: Geometry, mode: int, trusted: frozenset) -> _Attachment:
    """This process's attachment to the table ``name`` (one per name, ``registry``); one more handle."""

    def make() -> Optional[_Attachment]:
        opened = open_keyed(name, K.KIND_WINDOWS, geo, None, mode, trusted)
        return opened and _Attachment(name, *opened)

    return registry.open(name, lambda: attach(name, make), lambda att: None, mode, trusted)


class WindowTable(Handle):
    """Window counters per key, shared by every process that opens ``name``.

    A key is a ``str`` (its UTF-8 bytes) or ``bytes`` of any length: only its digest is kept.
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

    what = "window table"
    _registry = registry

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
        validate_clock(clock)
        flags = KC.table_flags(when_full, store_keys)
        trusted = validate_trusted_uids(trusted_uids)
        self._name, self._mode, self._trusted = name, mode, trusted
        att = _open(name, Geometry(geo.keys, 0, K.KIND_WINDOWS, moving_keys, ring), mode, trusted)
        self._att: Optional[_Attachment] = att
        self._geo = real = att.geo
        cells, (k0, k1) = att.cells, att.secret
        #: the process the counters insert as: none yet, so that the first use (``_live``)
        #: registers this process (a forked child's, in a table it inherited) and binds them
        self._pid = 0
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

    def _live(self) -> "_Attachment":
        att = self._peek()
        if self._pid != att.pid:  # this handle's first use in this process: registered, and the
            att.use()  # counters insert as this pid (see ``KeyedLimiter``'s ``bind``)
            for counters in (self.counters, self.moving):
                if counters is not None:
                    counters.rebind(att.pid)
            self._pid = att.pid
        return att

    # The counters (see keyed_windows.WindowCounters for the exact semantics).

    def incr(self, key: object, expiry: float, amount: int = 1, limit: Optional[int] = None) -> int:
        """Add ``amount`` hits to ``key``'s fixed window of ``expiry`` seconds; its count after that.

        With ``limit`` (hits per window, as the caller will compare the count with it), the
        hits are counted as granted when the count stays within it (the table's ``grants``);
        without, they are counted as hits only."""
        att = self._live()
        count = self.counters.incr(key, expiry, amount)
        att.count(amount, amount if limit is not None and count <= limit else 0)
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
        att = self._live()
        granted = self.counters.acquire_sliding(key, limit, expiry, amount)
        att.count(amount, amount if granted else 0)
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
        self._att.count(amount, amount if granted else 0)  # type: ignore[union-attr]
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
        v = self._peek().cells.load(K.KEYS_LIVE)
        return v if v < 1 << 63 else 0

    @property
    def evicted(self) -> int:
        """Keys whose slot was reused after their windows ended."""
        return self._peek().cells.load(K.EVICTED)

    @property
    def refused(self) -> int:
        """New keys refused because every slot near their home held a key still counted."""
        return self._peek().cells.load(K.REFUSED)

    def __reduce__(self):
        return pickled(self, WindowTable)

    def __repr__(self) -> str:
        head = f"shmlimit.WindowTable {self._name!r}"
        return f"<{head} closed>" if self._att is None else described(head, self._described)

    def _described(self) -> str:
        return (
            f"keys={self.keys_live}/{self.slots + self.moving_slots} "
            f"evicted={self.evicted} refused={self.refused} backend={self.backend}"
        )
