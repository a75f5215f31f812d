"""A ``limits`` storage in shared memory: ``shm://NAME``, shared by every process of the host, no server.

Importing this module registers the scheme, so that ``limits``
(``storage_from_string("shm://api")``), Flask-Limiter
(``Limiter(..., storage_uri="shm://api")``) and slowapi count every worker's
hits in one table: 4 gunicorn workers with a limit of 10/second grant 10 per
second, not 40.  ``shm://api?keys=200000`` sizes the table (64-byte slots,
used when the first process creates it).

``async+shm://NAME`` is the same table for ``limits.aio`` (``AsyncShmStorage``:
an async Starlette, FastAPI or aiohttp app, whatever its workers): a hit is
a few atomic operations, never a wait, so it runs on the event loop itself;
only ``reset`` (a scan of every slot) runs in a worker thread.

Strategies: ``fixed-window``, ``sliding-window-counter`` (limits >= 4.1) and
``moving-window`` hold exactly across processes: each hit is one or two
compare-and-swaps on the key's words (``shmlimit.keyed.windows``).  The moving
window keeps a log per key in slots of its own: ``moving_keys`` of them
(default 1024), each logging up to ``moving_log - 2`` grants in one window
(default 256 words: 254 grants; 64 + 8 * moving_log bytes a key); a key with
that many grants in its window is refused more until the oldest leaves, never
granted more than its limit.  Bounds, beside ``limits``' own: a fixed-window or
sliding-window-counter limit is at most 16 777 215 hits per window (2^24 - 1:
``20000000/day`` is refused) and a moving-window one at most 1 048 575 (2^20 - 1);
a larger limit is a ``ValueError`` naming the bound at its first hit (a
fixed window counted through ``WindowTable.incr`` directly stops at 16 777 215
and answers "over"); windows up to about 1.1 years.  Tested with
limits 5.8; written for limits >= 3 (the fixed window; the sliding window
counter exists from 4.1).
"""

from __future__ import annotations

import asyncio
import functools
import time
import urllib.parse
from typing import Any, Awaitable, Callable, Dict, List, Optional, Tuple, Type, TypeVar, Union

from shmlimit.errors import MissingExtraError, ShmlimitError

try:
    from limits.storage import MovingWindowSupport, Storage
except ImportError as e:  # without the limits extra: say what installs it
    raise MissingExtraError(__name__, "limits", e) from e
from shmlimit.keyed.window_table import CMAX, WindowTable

try:  # limits >= 4.1
    from limits.storage import SlidingWindowCounterSupport as _Sliding
except ImportError:  # pragma: no cover - older limits: fixed windows only
    _Sliding = object  # type: ignore[assignment,misc]


R = TypeVar("R")
#: The granularities' names ``RateLimitItem.key_for`` ends a key with.
_GRANULARITIES = frozenset(("year", "month", "day", "hour", "minute", "second"))


def limit_of(key: str) -> Optional[int]:
    """The limit (hits per window) a ``limits`` key names: ``RateLimitItem.key_for`` ends its keys
    with ``/amount/multiples/granularity``.  None for a key of another form.

    A fixed window's storage is told the key and the hits only (the strategy compares the count
    with the limit itself): this is how the table counts the hits it granted apart from those
    it refused."""
    parts = key.rsplit("/", 3)
    # isdecimal, not isdigit: "²" is a digit but no number ``int`` reads
    if (
        len(parts) == 4
        and parts[3] in _GRANULARITIES
        and parts[1].isdecimal()
        and parts[2].isdecimal()
    ):
        return int(parts[1])
    return None


def _fixed_limit(key: str) -> Optional[int]:
    """The limit of a fixed-window key, refused (ValueError) above what a window counts: its
    count would stop at ``CMAX`` and grant no more than that, whatever the limit said."""
    limit = limit_of(key)
    if limit is not None and limit > CMAX:
        raise ValueError(
            f"limit must be at most {CMAX} hits per window on shm://, got {limit} (key {key!r})"
        )
    return limit


__all__ = ["AsyncShmStorage", "ShmStorage", "limit_of", "parse_uri"]


_OPTIONS = ("keys", "mode", "when_full", "store_keys", "moving_keys", "moving_log")


def parse_uri(uri: str, scheme: str = "shm") -> Tuple[str, Dict[str, Any]]:
    """``shm://NAME[?keys=N&mode=600&when_full=evict&store_keys=false&moving_keys=N&moving_log=N]``
    -> (name, WindowTable options); ValueError names what is wrong.  ``mode`` is octal (``600``,
    ``0600`` or ``0o600``), the other numbers Python literals."""
    parts = urllib.parse.urlparse(uri)
    if parts.scheme != scheme:
        raise ValueError(f"storage uri must start with {scheme}://, got {uri!r}")
    name = (parts.netloc + parts.path).strip("/")
    if not name:
        raise ValueError(f"storage uri must name the table, as shm://NAME; got {uri!r}")
    opts: Dict[str, Any] = {}
    for k, vs in urllib.parse.parse_qs(parts.query, keep_blank_values=True).items():
        if k not in _OPTIONS:
            raise ValueError(
                f"unknown option {k!r} in storage uri {uri!r}: allowed are {', '.join(_OPTIONS)}"
            )
        if k == "when_full":
            opts[k] = vs[-1]  # checked by WindowTable
            continue
        if k == "mode":  # permission bits are octal, as chmod reads them: 600, 0600 or 0o600
            digits = vs[-1][2:] if vs[-1][:2].lower() == "0o" else vs[-1]
            if not digits or digits.strip("01234567"):
                raise ValueError(
                    f"mode must be octal permission bits (as 600 or 0o600) in storage uri "
                    f"{uri!r}, got {vs[-1]!r}"
                )
            opts[k] = int(digits, 8)
            continue
        if k == "store_keys":
            if vs[-1].lower() not in ("true", "false", "1", "0"):
                raise ValueError(f"store_keys must be true or false in storage uri {uri!r}")
            opts[k] = vs[-1].lower() in ("true", "1")
            continue
        try:
            opts[k] = int(vs[-1], 0)
        except ValueError:
            raise ValueError(
                f"{k} must be an integer in storage uri {uri!r}, got {vs[-1]!r}"
            ) from None
    return name, opts


def _table(uri: str, scheme: str, options: Dict[str, Any]) -> WindowTable:
    """The ``WindowTable`` a storage uri names; its options are taken out of ``options``."""
    name, opts = parse_uri(uri, scheme)
    for k in (*_OPTIONS, "trusted_uids", "clock"):
        if k in options:
            opts[k] = options.pop(k)
    if options:  # a typo (key= for keys=) would otherwise be dropped in silence
        raise TypeError(
            f"{', '.join(sorted(options))}: not an option of the {scheme}:// storage "
            f"(allowed are {', '.join(_OPTIONS)}, trusted_uids and clock)"
        )
    return WindowTable(name, **opts)


class _Table:
    """What both storages are: the ``WindowTable`` their uri names, ``ShmlimitError`` their base
    exception."""

    STORAGE_SCHEME: List[str]

    def __init__(
        self, uri: Optional[str] = None, wrap_exceptions: bool = False, **options: Any
    ) -> None:
        """``uri``: ``<scheme>://NAME`` (default ``<scheme>://limits``)."""
        scheme = self.STORAGE_SCHEME[0]
        uri = f"{scheme}://limits" if uri is None else uri
        self.table = _table(uri, scheme, options)
        super().__init__(uri, wrap_exceptions=wrap_exceptions, **options)  # type: ignore[call-arg]

    @property
    def base_exceptions(self) -> Union[Type[Exception], Tuple[Type[Exception], ...]]:
        return ShmlimitError

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.table!r}>"


class _Hits(_Table):
    """The storage's verbs on the table: each a few atomic operations, never a wait (``reset``
    excepted: a scan of every slot)."""

    table: WindowTable

    # -- fixed window ---------------------------------------------------------------------

    def incr(self, key: str, expiry: float, amount: int = 1, elastic_expiry: bool = False) -> int:
        """Add ``amount`` to ``key``'s window of ``expiry`` seconds; the count after it."""
        if elastic_expiry:
            raise NotImplementedError("the shm:// storage has no elastic expiry (use fixed-window)")
        return self.table.incr(key, expiry, amount, _fixed_limit(key))

    def get(self, key: str) -> int:
        return self.table.get(key)

    def get_expiry(self, key: str) -> float:
        """When ``key``'s window ends, as a ``time.time()`` timestamp (now if it has none)."""
        return time.time() + self.table.expires_in(key)

    def clear(self, key: str) -> None:
        """Forget ``key``'s fixed window and moving window."""
        self.table.clear(key)
        if self.table.moving_slots:
            self.table.clear_moving(key)

    def check(self) -> bool:
        return not self.table.closed

    # -- moving window --------------------------------------------------------------------------

    def acquire_entry(self, key: str, limit: int, expiry: int, amount: int = 1) -> bool:
        return self.table.acquire_entry(key, limit, expiry, amount)

    def get_moving_window(self, key: str, limit: int, expiry: int) -> Tuple[float, int]:
        """(when the oldest hit in the window was, as a ``time.time()`` timestamp -- now if there
        is none --, hits in the window)."""
        age, hits = self.table.moving_window(key, expiry)
        now = time.time()
        return (now if age is None else now - age), hits

    def reset(self) -> int:
        return self.table.reset()

    # -- sliding window counter (limits >= 4.1) ------------------------------------------------

    def acquire_sliding_window_entry(
        self, key: str, limit: int, expiry: int, amount: int = 1
    ) -> bool:
        return self.table.acquire_sliding(key, limit, expiry, amount)

    def get_sliding_window(self, key: str, expiry: int) -> Tuple[int, float, int, float]:
        return self.table.sliding(key, expiry)

    def clear_sliding_window(self, key: str, expiry: int) -> None:
        self.table.clear_sliding(key, expiry)


class ShmStorage(_Hits, Storage, MovingWindowSupport, _Sliding):  # type: ignore[misc,valid-type]
    """The ``shm://`` storage: fixed-window, sliding-window-counter and moving-window counters in
    a ``WindowTable``.

    Options (URI query or keyword arguments, e.g. Flask-Limiter's
    ``storage_options``): ``keys`` (slots, default 100 000), ``mode``
    (permission bits of the segment, default 0o600; octal in a URI, as chmod
    reads them: ``?mode=660``), ``trusted_uids``,
    ``when_full`` ("evict", the default: a new key takes the slot of the
    window ending first when none is free; "refuse": it is refused),
    ``store_keys`` (keep keys' first bytes for ``top``; default false),
    ``moving_keys`` (moving-window slots, default 1024) and ``moving_log``
    (words of each one's log, default 256); the sizes are used when the first
    process creates the table.
    """

    STORAGE_SCHEME = ["shm"]


def _on_loop(verb: Callable[..., R]) -> Callable[..., Awaitable[R]]:
    """``verb`` of the sync storage as the async one's: run on the event loop itself."""

    @functools.wraps(verb)
    async def run(self: Any, *args: Any, **kwargs: Any) -> R:
        return verb(self, *args, **kwargs)

    return run


try:  # limits.aio (limits >= 2.1; its sliding window counter from 4.1)
    from limits.aio.storage import MovingWindowSupport as _AsyncMoving
    from limits.aio.storage import SlidingWindowCounterSupport as _AsyncSliding
    from limits.aio.storage import Storage as _AsyncStorage
except ImportError:  # pragma: no cover - a limits without the asyncio API
    _AsyncStorage = None  # type: ignore[assignment,misc]

if _AsyncStorage is not None:

    class AsyncShmStorage(  # type: ignore[misc,valid-type]
        _Table, _AsyncStorage, _AsyncMoving, _AsyncSliding
    ):
        """The ``async+shm://NAME`` storage for ``limits.aio``: the table ``shm://NAME`` names, shared alike.

        Every method but ``reset`` works on the event loop: a hit is a few
        compare-and-swaps on the key's words and never waits for another
        process (one that lost an insert race yields its time slice once, as
        the sync storage does).  ``reset`` scans every slot, so it runs in a
        worker thread.  Options as ``ShmStorage``'s.
        """

        STORAGE_SCHEME = ["async+shm"]

        incr = _on_loop(_Hits.incr)
        get = _on_loop(_Hits.get)
        get_expiry = _on_loop(_Hits.get_expiry)
        clear = _on_loop(_Hits.clear)
        check = _on_loop(_Hits.check)
        acquire_entry = _on_loop(_Hits.acquire_entry)
        get_moving_window = _on_loop(_Hits.get_moving_window)
        acquire_sliding_window_entry = _on_loop(_Hits.acquire_sliding_window_entry)
        get_sliding_window = _on_loop(_Hits.get_sliding_window)
        clear_sliding_window = _on_loop(_Hits.clear_sliding_window)

        async def reset(self) -> int:
            return await asyncio.to_thread(self.table.reset)
