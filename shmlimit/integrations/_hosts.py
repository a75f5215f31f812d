"""What the HTTP client integrations share: throttling per host, and the fleet-wide pause.

A ``HostThrottle`` takes one op of its limiter before each request: of a
``KeyedLimiter`` under the request's host (``host`` or ``host:port``), so every
host has a limit of its own, or of a plain ``Limiter``, one limit for every
host.  When a response is 429 or 503 with a ``Retry-After`` (seconds or an
HTTP date), the host's schedule is pushed that far ahead: ops are reserved
until the next free one is ``Retry-After`` seconds away, so every process
throttled by that limiter pauses that host for that long, with nothing to
undo afterwards (a process that dies while paused leaves nothing stuck).  The
reserved ops count as grants.  Several processes told at once push together
only up to the longest ``Retry-After`` (plus at most one capacity each).
"""

from __future__ import annotations

import email.utils
import math
import time
from typing import Any, Awaitable, Callable, Iterable, Optional, Tuple, TypeVar
from urllib.parse import urlsplit

from shmlimit import KeyedLimiter
from shmlimit.errors import RateLimited

_DEFAULT_PORTS = {"http": 80, "https": 443}
R = TypeVar("R")
#: A response's status and ``Retry-After`` header (None when absent).
Answer = Callable[[Any], Tuple[int, Optional[str]]]


def host_key(url: str) -> str:
    """The default key of a request: its host, lower-case, with the port unless it is the scheme's default."""
    parts = urlsplit(url)
    host = (parts.hostname or "").lower()
    try:
        port = parts.port
    except ValueError:
        port = None
    if port is not None and port != _DEFAULT_PORTS.get(parts.scheme.lower()):
        return f"{host}:{port}"
    return host


def parse_retry_after(value: Optional[str], now: Optional[float] = None) -> Optional[float]:
    """``Retry-After`` in seconds from now: an integer of seconds or an HTTP date; None if absent or invalid."""
    if value is None:
        return None
    value = value.strip()
    if value.isdigit():
        return float(int(value))
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if when is None or when.tzinfo is None:
        return None
    return max(0.0, when.timestamp() - (time.time() if now is None else now))


def _statuses(pause_on: Any) -> frozenset:
    """``pause_on`` as a set of HTTP statuses (ints 100-599), or an error naming it."""
    if isinstance(pause_on, (str, bytes)) or not hasattr(pause_on, "__iter__"):
        raise TypeError(
            f"pause_on must be an iterable of HTTP statuses (ints 100-599), got {pause_on!r}"
        )
    out = frozenset(pause_on)
    for s in out:
        if isinstance(s, bool) or not isinstance(s, int) or not 100 <= s <= 599:
            raise ValueError(f"pause_on must hold HTTP statuses (ints 100-599), got {s!r}")
    return out


class HostThrottle:
    """One limiter applied per host, and the reaction to 429/503 ``Retry-After``.

    The options of every HTTP client integration: ``key(url) -> str | None``
    overrides the key (default: the host; None: not throttled); ``max_wait``
    (seconds, default None: as long as needed) bounds the wait, beyond which
    ``shmlimit.RateLimited`` is raised without sending; ``pause_on`` are the
    statuses whose ``Retry-After`` pauses the host (default 429 and 503), for
    at most ``max_pause`` seconds (default 300).
    """

    def __init__(
        self,
        limiter: Any,
        *,
        key: Optional[Callable[[str], Optional[str]]] = None,
        max_wait: Optional[float] = None,
        pause_on: Iterable[int] = (429, 503),
        max_pause: float = 300.0,
    ) -> None:
        for attr in ("acquire", "reserve", "retry_after", "capacity", "rate", "per"):
            if not hasattr(limiter, attr):
                raise TypeError(
                    f"limiter must be a shmlimit Limiter or KeyedLimiter, got {limiter!r}"
                )
        if key is not None and not callable(key):
            raise TypeError(f"key must be a callable (url) -> str or None, got {key!r}")
        if max_wait is not None and (
            isinstance(max_wait, bool)
            or not isinstance(max_wait, (int, float))
            or not 0 <= max_wait
        ):
            raise ValueError(
                f"max_wait must be None (wait as long as needed) or seconds >= 0, got {max_wait!r}"
            )
        if (
            isinstance(max_pause, bool)
            or not isinstance(max_pause, (int, float))
            or not 0 <= max_pause < math.inf
        ):
            raise ValueError(
                f"max_pause must be a finite number of seconds >= 0, got {max_pause!r}"
            )
        self.limiter = limiter
        self.keyed = isinstance(limiter, KeyedLimiter)
        self.key = key
        self.max_wait = None if max_wait is None or max_wait == math.inf else float(max_wait)
        self.pause_on = _statuses(pause_on)
        self.max_pause = float(max_pause)

    def args(self, url: str) -> Optional[Tuple[Any, ...]]:
        """The limiter's arguments for a request to ``url``; None: not throttled."""
        key = self.key(url) if self.key is not None else (host_key(url) if self.keyed else "")
        if key is None:
            return None
        return (key,) if self.keyed else ()

    def around(self, url: str, send: Callable[[], R], answer: Answer) -> R:
        """Send a request to ``url`` (``send()``) under the throttle, and react to its response."""
        args = self.args(url)
        if args is None:
            return send()
        self.before(args)
        response = send()
        self.after(args, *answer(response))
        return response

    async def around_async(self, url: str, send: Callable[[], Awaitable[R]], answer: Answer) -> R:
        """``around`` for asyncio: the wait is an ``asyncio.sleep``."""
        args = self.args(url)
        if args is None:
            return await send()
        await self.before_async(args)
        response = await send()
        self.after(args, *answer(response))
        return response

    def _refused(self, args: Tuple[Any, ...]) -> RateLimited:
        name = getattr(self.limiter, "name", "?")
        return RateLimited(
            name if not args else f"{name}[{args[0]}]", self.limiter.retry_after(*args, 1)
        )

    def before(self, args: Tuple[Any, ...]) -> None:
        """Take the request's op, waiting (blocking) at most ``max_wait``; raise ``RateLimited`` past it."""
        if not self.limiter.acquire(*args, 1, timeout=self.max_wait):
            raise self._refused(args)

    async def before_async(self, args: Tuple[Any, ...]) -> None:
        if not await self.limiter.acquire_async(*args, 1, timeout=self.max_wait):
            raise self._refused(args)

    def after(
        self, args: Tuple[Any, ...], status: int, retry_after: Optional[str]
    ) -> Optional[float]:
        """React to a response: on a pausing status with ``Retry-After``, pause the host; the pause (s) or None."""
        if status not in self.pause_on:
            return None
        seconds = parse_retry_after(retry_after)
        if seconds is None or seconds <= 0:
            return None
        seconds = min(seconds, self.max_pause)
        self.pause(args, seconds)
        return seconds

    def pause(self, args: Tuple[Any, ...], seconds: float) -> None:
        """Push the schedule so that the next op is at least ``seconds`` away, for every process.

        Reserves the ops between the next free one and that point (at most a
        capacity at a time for a keyed limiter), so the pushes of processes
        told together overlap instead of adding up.  A
        limiter whose ``max_reserved`` refuses the reservation is pushed as far
        as it allows.  Never waits.
        """
        lim = self.limiter
        interval = float(lim.per) / float(lim.rate)
        cap = max(1, math.floor(float(lim.capacity)))
        while True:
            short = seconds - lim.retry_after(*args, 1)
            if short <= 0:  # paused long enough (by another process, or by the rate itself)
                return
            chunk = max(1, math.ceil(short / interval))
            if self.keyed:
                chunk = min(chunk, cap)  # a key never grants more than its capacity at once
            if lim.reserve(*args, chunk, max_wait=seconds + chunk * interval) is None:
                return  # refused (max_reserved): pushed as far as the limiter allows
