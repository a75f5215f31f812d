"""What the HTTP client integrations share: throttling per host, and the fleet-wide pause per host.

A ``HostThrottle`` takes one op of its limiter before each request: of a
``KeyedLimiter`` (or ``RedisKeyedLimiter``) under the request's host (``host`` or ``host:port``), so every
host has a limit of its own, or of a plain ``Limiter``, one limit for every
host.  When a response is 429 or 503 with a ``Retry-After`` (seconds or an
HTTP date), *that host* is paused that long for every process, and no other:

* under a ``KeyedLimiter`` the host's own schedule is moved (``KeyedLimiter.pause``);
* under any other limiter the pause is kept per host in a keyed table of its
  own, ``<limiter name>.pauses`` (``pause_table``), which every process of the
  limiter shares; the shared rate itself is not touched.

A pause is one constant-time move of a schedule, whatever the rate; it ends on
its own (a process that dies while paused leaves nothing stuck), counts no
grant, and is never lengthened by adding: several processes told at once, or a
host answering several requests in flight, pause it until the latest end
asked, at most ``max_pause`` from now.  No request is sent to a paused host,
so it cannot renew its pause without being asked again.

Under a limiter with an adaptive rate (``Limiter(adapt=...)``) every answer is
also reported (``Limiter.feedback``): 429 and 503 as throttled, any other as
not, with or without ``Retry-After``; the fleet's rate follows (``shmlimit.adapt``).
Under a ``KeyedLimiter(adapt=...)`` each answer is reported under its request's
key (the host), and each host's rate follows its own answers (``keyed.adapt``).

A ``Retry-After`` that cannot be parsed (not ASCII digits nor an HTTP date) is
treated as absent, as urllib3 does; one above ``MAX_RETRY_AFTER`` counts as that.
"""

from __future__ import annotations

import asyncio
import datetime
import email.utils
import hashlib
import math
import re
import time
from typing import Any, Awaitable, Callable, Iterable, Optional, Tuple, TypeVar
from urllib.parse import urlsplit

from shmlimit import KeyedLimiter, Limiter
from shmlimit.adapt import tell
from shmlimit.config import is_int, is_number
from shmlimit.errors import RateLimited
from shmlimit.protocol import Keyed
from shmlimit.shm.segment import NAME_MAX

_DEFAULT_PORTS = {"http": 80, "https": 443}
R = TypeVar("R")

#: The statuses reported to an adaptive limiter as throttled (every other answer is reported ok).
THROTTLED = frozenset({429, 503})
#: The longest ``Retry-After`` taken from a response (seconds, a day): longer ones count as this.
MAX_RETRY_AFTER = 86_400.0
#: Key slots of a ``pause_table``: hosts paused at the same time (a slot frees when its pause ends).
PAUSE_SLOTS = 4096
_DIGITS = re.compile(r"[0-9]+", re.ASCII)
#: An HTTP date is 29 characters (IMF-fixdate); the obsolete forms are no longer.
_DATE_MAX = 64
_MONTHS = ("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec")
#: C's asctime() form of an HTTP date (RFC 9110 5.6.7): no zone, which HTTP dates all have GMT.
_ASCTIME = re.compile(
    rf"(?:Mon|Tue|Wed|Thu|Fri|Sat|Sun) ({'|'.join(_MONTHS)}) ([0-9]{{2}}| [0-9]) "
    r"([0-9]{2}):([0-9]{2}):([0-9]{2}) ([0-9]{4})",
    re.ASCII,
)


def host_key(url: str) -> str:
    """The default key of a request: its host, lower-case and without the trailing dot of a fully
    qualified name (``example.com.`` is ``example.com``), an IPv6 address in brackets (``[::1]:8080``
    is not the address ``::1:8080``), with the port unless it is the scheme's default."""
    parts = urlsplit(url)
    host = (parts.hostname or "").lower().removesuffix(".")
    if ":" in host:
        host = f"[{host}]"
    try:
        port = parts.port
    except ValueError:
        port = None
    if port is not None and port != _DEFAULT_PORTS.get(parts.scheme.lower()):
        return f"{host}:{port}"
    return host


def parse_retry_after(value: Any, now: Optional[float] = None) -> Optional[float]:
    """``Retry-After`` in seconds from now, at most ``MAX_RETRY_AFTER``; None if absent or unparseable.

    Delta-seconds are ASCII digits only (however many: a long run is capped,
    never converted whole); an HTTP date (IMF-fixdate, or the obsolete RFC 850
    and asctime forms, all GMT; an email's ``-0000`` read as GMT) is counted
    from ``now`` (seconds of the epoch, default the current time).  Anything else -- a sign, a
    fraction, non-ASCII characters, an impossible date -- is None.
    """
    if isinstance(value, (bytes, bytearray)):
        value = bytes(value).decode("latin-1")
    if not isinstance(value, str):
        return None
    value = value.strip(" \t")
    if _DIGITS.fullmatch(value):
        digits = value.lstrip("0")
        if len(digits) > len(str(int(MAX_RETRY_AFTER))):
            return MAX_RETRY_AFTER
        return min(float(int(digits or "0")), MAX_RETRY_AFTER)
    if not value or len(value) > _DATE_MAX or not value.isascii() or not value.isprintable():
        return None
    try:
        if m := _ASCTIME.fullmatch(value):  # month, day, hour, minute, second, year
            year, month = int(m[6]), _MONTHS.index(m[1]) + 1
            utc = datetime.timezone.utc
            when = datetime.datetime(year, month, *map(int, m.group(2, 3, 4, 5)), tzinfo=utc)
        else:
            when = email.utils.parsedate_to_datetime(value)
        if when is None:
            return None
        if when.tzinfo is None:  # no zone (asctime-like, not the form): absent; ``-0000`` is GMT
            if not value.endswith(" -0000"):  # (an email's date of unknown zone: RFC 9110, 5.6.7)
                return None
            when = when.replace(tzinfo=datetime.timezone.utc)
        left = when.timestamp() - (time.time() if now is None else now)
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
    return min(max(0.0, left), MAX_RETRY_AFTER)


def answer(response: Any) -> Tuple[int, Optional[str]]:
    """A response's status and ``Retry-After`` header (None when absent), as ``httpx`` and
    ``requests`` both give them (headers by any case)."""
    return response.status_code, response.headers.get("retry-after")


def pause_table_name(name: str) -> str:
    """The name of the pause table of the limiter ``name``: ``<name>.pauses`` (shortened to fit)."""
    full = f"{name}.pauses"
    if len(full) <= NAME_MAX:
        return full
    tag = hashlib.blake2b(name.encode(), digest_size=4).hexdigest()
    return f"{name[: NAME_MAX - len(tag) - 8]}.{tag}.pauses"


def pause_table(limiter: Any) -> KeyedLimiter:
    """The keyed table, keyed by host, that holds the pauses of the hosts throttled by ``limiter``.

    Created (or attached) beside the limiter with its segment's mode, trusting the uids the
    limiter was opened trusting (``trusted_uids``); each host's entry is a schedule of one op
    at a time, moved by ``KeyedLimiter.pause``.
    """
    att = getattr(limiter, "_att", None)
    mode = getattr(getattr(att, "seg", None), "mode", 0o600) & 0o777
    return KeyedLimiter(
        pause_table_name(limiter.name),
        rate=1,
        per=1.0,
        burst=1,
        keys=PAUSE_SLOTS,
        mode=mode,
        trusted_uids=getattr(att, "trusted", ()),
    )


def _statuses(pause_on: Any) -> frozenset:
    """``pause_on`` as a set of HTTP statuses (ints 100-599), or an error naming it."""
    if isinstance(pause_on, (str, bytes)) or not hasattr(pause_on, "__iter__"):
        raise TypeError(
            f"pause_on must be an iterable of HTTP statuses (ints 100-599), got {pause_on!r}"
        )
    out = frozenset(pause_on)
    for s in out:
        if not is_int(s, 100, 599):
            raise ValueError(f"pause_on must hold HTTP statuses (ints 100-599), got {s!r}")
    return out


class HostThrottle:
    """One limiter applied per host, and the reaction to 429/503 ``Retry-After``.

    The options of every HTTP client integration: ``key(url) -> str | None``
    overrides the key (default: the host; None: not throttled); ``max_wait``
    (seconds, default None: as long as needed) bounds the wait, a host's pause
    included, beyond which ``shmlimit.RateLimited`` is raised without sending;
    ``pause_on`` are the statuses whose ``Retry-After`` pauses the host
    (default 429 and 503), for at most ``max_pause`` seconds (default 300, at
    most ``MAX_RETRY_AFTER``); ``pauses`` is the ``KeyedLimiter`` that keeps the
    pauses by host (default: the limiter itself if it is a ``KeyedLimiter``,
    else its ``pause_table``).
    """

    def __init__(
        self,
        limiter: Any,
        *,
        key: Optional[Callable[[str], Optional[str]]] = None,
        max_wait: Optional[float] = None,
        pause_on: Iterable[int] = (429, 503),
        max_pause: float = 300.0,
        pauses: Optional[KeyedLimiter] = None,
    ) -> None:
        for attr in ("acquire", "retry_after", "capacity", "rate", "per", "name"):
            if not hasattr(limiter, attr):
                raise TypeError(
                    f"limiter must be a shmlimit Limiter or KeyedLimiter of one rate (rate=, not "
                    f"rates=: several rates are not supported here), got {limiter!r}"
                )
        if getattr(getattr(limiter, "config", None), "capped", False):
            raise ValueError(
                f"limiter {limiter!r} is capped: it grants only as ops are release()d, and the "
                f"throttle releases none (every request past its capacity would wait for ever)"
            )
        if key is not None and not callable(key):
            raise TypeError(f"key must be a callable (url) -> str or None, got {key!r}")
        if max_wait is not None and not (is_number(max_wait) and 0 <= max_wait):
            raise ValueError(
                f"max_wait must be None (wait as long as needed) or seconds >= 0, got {max_wait!r}"
            )
        if max_wait == 0 and isinstance(limiter, Limiter) and limiter.stats().upstream is not None:
            raise ValueError(
                "max_wait must be above 0 with a Limiter with upstream=: its ops come in batches "
                "leased for waiters (expiring unused), so a request that only tried was refused "
                "for ever; give it a wait for its batch (say 0.1 s)"
            )
        if not (is_number(max_pause) and 0 <= max_pause <= MAX_RETRY_AFTER):
            raise ValueError(
                f"max_pause must be seconds from 0 to {MAX_RETRY_AFTER:.0f}, got {max_pause!r}"
            )
        if pauses is not None and not isinstance(pauses, KeyedLimiter):
            raise TypeError(
                f"pauses must be a shmlimit.KeyedLimiter (keyed by host), got {pauses!r}"
            )
        self.limiter = limiter
        self.keyed = isinstance(limiter, Keyed)  # any keyed kind: KeyedLimiter, RedisKeyedLimiter
        self.key = key
        self.max_wait = None if max_wait is None or max_wait == math.inf else float(max_wait)
        self.pause_on = _statuses(pause_on)
        self.max_pause = float(max_pause)
        if pauses is None:  # a KeyedLimiter's own schedules pause; other kinds have none
            pauses = limiter if isinstance(limiter, KeyedLimiter) else pause_table(limiter)
        self.pauses = pauses
        #: the pauses are the limiter's own schedule: its acquire waits them out
        self.own = pauses is limiter

    def args(self, url: str) -> Optional[Tuple[Tuple[Any, ...], str]]:
        """The limiter's arguments for a request to ``url`` and the key its pause is kept under;
        None: not throttled."""
        key = self.key(url) if self.key is not None else (host_key(url) if self.keyed else "")
        if key is None:
            return None
        if self.keyed:
            return (key,), (key if self.own else host_key(url))
        return (), host_key(url)

    def around(self, url: str, send: Callable[[], R]) -> R:
        """Send a request to ``url`` (``send()``) under the throttle, and react to its response."""
        req = self.args(url)
        if req is None:
            return send()
        self.before(*req)
        response = send()
        self.after(req[1], *answer(response), args=req[0])
        return response

    async def around_async(self, url: str, send: Callable[[], Awaitable[R]]) -> R:
        """``around`` for asyncio: every wait is an ``asyncio.sleep``."""
        req = self.args(url)
        if req is None:
            return await send()
        await self.before_async(*req)
        response = await send()
        self.after(req[1], *answer(response), args=req[0])
        return response

    def _refused(self, key: object, retry_after: float) -> RateLimited:
        name = self.limiter.name
        return RateLimited(name if key is None else f"{name}[{key}]", retry_after)

    def _not_granted(self, args: Tuple[Any, ...]) -> RateLimited:
        """The request's op was not granted within ``max_wait``."""
        return self._refused(args[0] if args else None, self.limiter.retry_after(*args, 1))

    def _deadline(self) -> Optional[float]:
        return None if self.max_wait is None else time.monotonic() + self.max_wait

    def _paused(self, host: str, deadline: Optional[float]) -> float:
        """Seconds ``host`` stays paused (0.0: not); ``RateLimited`` if that ends past ``deadline``."""
        if self.own:
            return 0.0  # the limiter's acquire waits it out
        left = self.pauses.own_wait(host)  # its own pause: a host without an entry has none
        if left > 0 and deadline is not None and time.monotonic() + left > deadline:
            raise self._refused(host, left)
        return left

    def _timeout(self, deadline: Optional[float]) -> Optional[float]:
        return None if deadline is None else max(0.0, deadline - time.monotonic())

    def before(self, args: Tuple[Any, ...], host: str) -> None:
        """Wait out the host's pause, then take the request's op (and any pause told meanwhile),
        blocking at most ``max_wait`` in all; ``RateLimited`` past it."""
        deadline = self._deadline()
        while (left := self._paused(host, deadline)) > 0:
            time.sleep(left)
        if not self.limiter.acquire(*args, 1, timeout=self._timeout(deadline)):
            raise self._not_granted(args)
        while (left := self._paused(host, deadline)) > 0:
            time.sleep(left)

    async def before_async(self, args: Tuple[Any, ...], host: str) -> None:
        """``before`` for asyncio."""
        deadline = self._deadline()
        while (left := self._paused(host, deadline)) > 0:
            await asyncio.sleep(left)
        if not await self.limiter.acquire_async(*args, 1, timeout=self._timeout(deadline)):
            raise self._not_granted(args)
        while (left := self._paused(host, deadline)) > 0:
            await asyncio.sleep(left)

    def after(
        self, host: str, status: int, retry_after: Any, args: Tuple[Any, ...] = ()
    ) -> Optional[float]:
        """React to a response: report its outcome to an adaptive limiter (``THROTTLED`` statuses
        are throttled, any other answer is not; a keyed one's under the request's key, ``args``);
        on a pausing status with ``Retry-After``, pause ``host`` (its pause key); the pause
        (seconds) or None."""
        tell(self.limiter, status in THROTTLED, *args)
        if status not in self.pause_on:
            return None
        seconds = parse_retry_after(retry_after)
        if seconds is None or min(seconds, self.max_pause) <= 0:
            return None  # (a pause of nothing is none: a resend keeps urllib3's backoff)
        seconds = min(seconds, self.max_pause)
        # one move of the host's schedule, in every process; False: no slot for it (not paused)
        return seconds if self.pauses.pause(host, seconds) else None
