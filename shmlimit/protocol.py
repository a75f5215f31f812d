"""One interface for every kind of limiter: ``RateLimit``, and ``KeyedRateLimit`` for keyed kinds.

Every limiter that holds one limit is a ``RateLimit``: ``Limiter`` (hierarchical
mode too), a limiter of several rates (``Limiter(name, rates=...)``) and
``RedisLimiter``.  Code written against ``RateLimit`` runs on any of them.

A keyed limiter holds one limit per key, so each of its verbs takes the key
first: ``KeyedLimiter``, ``KeyedLimiter(name, rates=...)`` and
``RedisKeyedLimiter`` are ``KeyedRateLimit``.  ``lim[key]`` is that key's limit
as a ``RateLimit``: a ``KeyView``, one small class for every keyed kind, whose
verbs are the limiter's own for that key (nothing is copied or cached; a view
costs one object).  So a keyed kind keeps its key-first verbs, and still
implements the one interface, through its views.  What a view's verbs mean:

* ``set_rate(...)`` gives that key a rate of its own (the limiter's
  ``set_rate(..., key=key)``); ``stats()`` is the limiter's snapshot (a keyed
  table counts per table, not per key; a key's wait is ``retry_after``);
  ``unlink()`` removes the limiter's name, every key's state with it.
* ``close()`` closes the view only: the limiter and its other keys' views go
  on.  The context managers acquire one op of that key.

Every verb either keeps its promise or raises ``shmlimit.UnsupportedError``,
naming the kind, the verb and why (for example ``reserve`` on a keyed limiter
of several rates, ``set_rate`` on the Redis kinds, whose rate is not stored in
Redis).  A closed handle raises ``ValueError`` ("... is closed in this
process") from every verb that uses it.  Units: ``n`` is in ops, every time in
seconds.
"""

from __future__ import annotations

from typing import Any, Optional, Protocol, TypeVar, runtime_checkable

#: A key's most bytes, for every keyed kind but a window table (which keeps only digests).
KEY_MAX = 4096
#: A str key with a lone surrogate has no UTF-8 (the same words in _native.c's kt_key)
NOT_UTF8 = "key must be bytes or a str encodable as UTF-8 (no lone surrogate)"


def key_bytes(key: object, most: Optional[int] = KEY_MAX) -> bytes:
    """A key's bytes: a str is its UTF-8, bytes are themselves; anything else is a TypeError.
    More than ``most`` bytes is a ValueError (None: any length, as a window table takes)."""
    if isinstance(key, str):
        try:
            data = key.encode("utf-8")
        except UnicodeEncodeError as err:  # a lone surrogate (os.fsdecode's, say)
            raise ValueError(NOT_UTF8) from err
    elif isinstance(key, bytes):
        data = key
    else:
        raise TypeError(f"key must be a str or bytes, not {type(key).__name__}")
    if most is not None and len(data) > most:
        raise ValueError(f"key must be at most {most} bytes (UTF-8), got {len(data)}")
    return data


_H = TypeVar("_H", bound="AcquireOnEnter")


class AcquireOnEnter:
    """The context managers of every kind that holds one limit: entering acquires one op (waiting
    as needed; ``async with``: on the event loop), leaving gives nothing back."""

    __slots__ = ()

    def __enter__(self: _H) -> _H:
        self.acquire()  # type: ignore[attr-defined]
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    async def __aenter__(self: _H) -> _H:
        await self.acquire_async()  # type: ignore[attr-defined]
        return self

    async def __aexit__(self, *exc: Any) -> None:
        return None


@runtime_checkable
class RateLimit(Protocol):
    """One rate limit, whatever its kind: ``n`` in ops, times in seconds."""

    @property
    def name(self) -> str:
        """The limiter's name (its segment's, or its Redis key's)."""
        ...

    @property
    def closed(self) -> bool:
        """True once ``close`` was called on this handle."""
        ...

    def try_acquire(self, n: int = 1) -> bool:
        """Take ``n`` ops only if they are available now; never waits.  False takes nothing."""
        ...

    def acquire(self, n: int = 1, timeout: Optional[float] = None) -> bool:
        """Take ``n`` ops, waiting as needed; True once granted.  With ``timeout`` (seconds):
        False, taking nothing, when the wait would exceed it."""
        ...

    async def acquire_async(self, n: int = 1, timeout: Optional[float] = None) -> bool:
        """``acquire`` for asyncio: waits on the event loop, never blocking it."""
        ...

    def retry_after(self, n: int = 1) -> float:
        """Seconds until ``n`` ops could be granted to a new caller (0.0: now).  Takes nothing."""
        ...

    def reserve(self, n: int = 1, max_wait: Optional[float] = None) -> Optional[float]:
        """Claim ``n`` ops now and return the seconds to wait before using them (0.0: now);
        None, taking nothing, when that wait would exceed ``max_wait`` (seconds)."""
        ...

    def set_rate(self, *args: Any, **kwargs: Any) -> None:
        """Change the rate for every user of the name, at once (arguments: the kind's own)."""
        ...

    def stats(self) -> Any:
        """A snapshot of the limiter (the kind's own type; reads only)."""
        ...

    def close(self) -> None:
        """Detach this handle; the shared state stays (``unlink`` removes it)."""
        ...

    def unlink(self) -> None:
        """Remove the shared state under the name: a new handle creates it afresh."""
        ...

    def __enter__(self) -> Any:
        """Acquire one op (waiting as needed)."""
        ...

    def __exit__(self, *exc: Any) -> Optional[bool]: ...

    async def __aenter__(self) -> Any:
        """Acquire one op on the event loop."""
        ...

    async def __aexit__(self, *exc: Any) -> Optional[bool]: ...


@runtime_checkable
class KeyedRateLimit(Protocol):
    """One rate limit per key: the verbs of ``RateLimit`` with the key first; ``lim[key]`` is that
    key's limit as a ``RateLimit`` (a ``KeyView``).  A key is a ``str`` or ``bytes``."""

    @property
    def name(self) -> str:
        """The limiter's name."""
        ...

    @property
    def closed(self) -> bool:
        """True once ``close`` was called on this handle."""
        ...

    def __getitem__(self, key: Any) -> RateLimit:
        """``key``'s limit as a ``RateLimit``."""
        ...

    def try_acquire(self, key: Any, n: int = 1) -> bool:
        """Take ``n`` ops of ``key`` only if they are available now.  False takes nothing."""
        ...

    def acquire(self, key: Any, n: int = 1, timeout: Optional[float] = None) -> bool:
        """Take ``n`` ops of ``key``, waiting as needed; False past ``timeout`` seconds."""
        ...

    async def acquire_async(self, key: Any, n: int = 1, timeout: Optional[float] = None) -> bool:
        """``acquire`` for asyncio."""
        ...

    def retry_after(self, key: Any, n: int = 1) -> float:
        """Seconds until ``n`` ops of ``key`` could be granted (0.0: now).  Takes nothing."""
        ...

    def reserve(self, key: Any, n: int = 1, max_wait: Optional[float] = None) -> Optional[float]:
        """Claim ``n`` ops of ``key``; seconds to wait before using them, or None (nothing taken)."""
        ...

    def set_rate(self, *args: Any, **kwargs: Any) -> None:
        """Change the rate of every key, or with ``key=`` of that key only."""
        ...

    def stats(self) -> Any:
        """A snapshot of the limiter (reads only)."""
        ...

    def close(self) -> None:
        """Detach this handle; the shared state stays."""
        ...

    def unlink(self) -> None:
        """Remove the shared state under the name, every key's."""
        ...


class KeyView(AcquireOnEnter):
    """One key of a keyed limiter as a ``RateLimit``: ``lim[key]``.  Every verb is the limiter's own
    for that key, costs by rate name included (``lim[key].acquire(tokens=500)``)."""

    __slots__ = ("_limiter", "_key", "_closed")

    def __init__(self, limiter: KeyedRateLimit, key: Any) -> None:
        self._limiter = limiter
        self._key = key
        self._closed = False

    @property
    def name(self) -> str:
        """The limiter's name."""
        return self._limiter.name

    @property
    def key(self) -> Any:
        return self._key

    @property
    def limiter(self) -> KeyedRateLimit:
        return self._limiter

    @property
    def closed(self) -> bool:
        """True once this view, or its limiter, was closed."""
        return self._closed or self._limiter.closed

    def _open(self) -> Any:
        if self._closed:  # (the key is not shown: it may be a client's secret)
            raise ValueError(f"a key's view of {self.name!r} is closed in this process")
        return self._limiter

    def try_acquire(self, n: int = 1, **costs: int) -> bool:
        """Take ``n`` ops of this key only if they are available now.  False takes nothing."""
        return self._open().try_acquire(self._key, n, **costs)

    def acquire(self, n: int = 1, timeout: Optional[float] = None, **costs: int) -> bool:
        """Take ``n`` ops of this key, waiting as needed; False past ``timeout`` seconds."""
        return self._open().acquire(self._key, n, timeout, **costs)

    async def acquire_async(
        self, n: int = 1, timeout: Optional[float] = None, **costs: int
    ) -> bool:
        """``acquire`` for asyncio."""
        return await self._open().acquire_async(self._key, n, timeout, **costs)

    def retry_after(self, n: int = 1, **costs: int) -> float:
        """Seconds until ``n`` ops of this key could be granted (0.0: now).  Takes nothing."""
        return self._open().retry_after(self._key, n, **costs)

    def reserve(
        self, n: int = 1, max_wait: Optional[float] = None, **costs: int
    ) -> Optional[float]:
        """Claim ``n`` ops of this key; seconds to wait before using them, or None."""
        return self._open().reserve(self._key, n, max_wait, **costs)

    def set_rate(self, *args: Any, **kwargs: Any) -> None:
        """Give this key a rate of its own: the limiter's ``set_rate(..., key=key)``."""
        self._open().set_rate(*args, key=self._key, **kwargs)

    def stats(self) -> Any:
        """The limiter's snapshot (a keyed table counts per table, not per key)."""
        return self._open().stats()

    def close(self) -> None:
        """Close this view; the limiter and its other keys go on."""
        self._closed = True

    def unlink(self) -> None:
        """Remove the limiter's name (every key's state with it)."""
        self._limiter.unlink()

    def __repr__(self) -> str:
        return f"<shmlimit.KeyView of {self._limiter!r}{' closed' if self._closed else ''}>"


class Keyed:
    """What gives a keyed kind its views: ``lim[key]``, that key's limit as a ``RateLimit``."""

    def __getitem__(self, key: Any) -> KeyView:
        return KeyView(self, key)  # type: ignore[arg-type]
