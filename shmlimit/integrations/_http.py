"""What the ASGI and WSGI middleware share: their options, the limiter adapter and the rate-limit headers.

The headers follow the IETF httpapi draft "RateLimit header fields for HTTP"
(structured fields):

* ``RateLimit-Policy: "default";q=<quota>;w=<window seconds>`` -- the fixed policy;
* ``RateLimit: "default";r=<remaining>;t=<seconds>`` -- the live state: ops left
  now, and seconds until the bucket is full again (on a refusal: until the
  request could be granted, the same as ``Retry-After``).

Seconds are whole, rounded up; a ``Limiter``'s are counted from ``retry_after``
plus the filler's longest pause (20 ms), the latest its op may come.

A token bucket of ``rate`` ops per ``per`` seconds is advertised as the whole
number of ops it grants per whole number of seconds: ``q`` ops per ``w``
seconds with ``w`` the smallest whole window at least ``per`` in which at least
one op fits, and ``q`` rounded down, so the policy never promises more than
the limiter grants.
"""

from __future__ import annotations

import math
import re
from typing import Any, Callable, List, Optional, Tuple, Union

from shmlimit.bucket.schedule import LONGEST_FILL_NS
from shmlimit.config import is_int, is_number
from shmlimit.limiter import Limiter
from shmlimit.protocol import Keyed

#: What a refusal answers: the status, and a short plain-text body.
STATUS = 429
BODY = b"Too Many Requests\n"
_POLICY_RE = re.compile(r"[A-Za-z0-9_.:/+-]{1,64}")

KeyFunc = Callable[[Any], Optional[str]]
CostArg = Union[int, Callable[[Any], int]]


class Middleware:
    """The options both middleware take (see ``shmlimit.integrations.asgi.RateLimitMiddleware``).

    Each subclass only adds its server interface's ``__call__``.
    """

    def __init__(
        self,
        app: Any,
        limiter: Any,
        key: Optional[KeyFunc] = None,
        cost: CostArg = 1,
        *,
        max_wait: float = 0.0,
        policy: str = "default",
        headers: bool = True,
    ) -> None:
        self.app = app
        self.policy = Policy(limiter, key, cost, max_wait, policy)
        self.headers = headers

    def __repr__(self) -> str:
        cls = type(self)
        return f"<{cls.__module__}.{cls.__qualname__} limiter={self.policy.limiter!r} max_wait={self.policy.max_wait:g}>"


def client_host(scope: Any) -> str:
    """The default key of a keyed limiter under ASGI: the client's address as the server saw it."""
    client = scope.get("client")
    return str(client[0]) if client else ""


def remote_addr(environ: Any) -> str:
    """The default key of a keyed limiter under WSGI: the client's address as the server saw it."""
    return str(environ.get("REMOTE_ADDR", ""))


def client_ip(request: Any, trusted_hops: int = 1) -> str:
    """The client's address behind ``trusted_hops`` proxies, from an ASGI scope or a WSGI environ.

    Each trusted proxy appends the address it received the request from to
    ``X-Forwarded-For``, so the client is the entry ``trusted_hops`` from the
    *right* (as nginx ``real_ip_recursive``, Envoy ``xff_num_trusted_hops`` and
    werkzeug's ``ProxyFix(x_for=N)`` count): the entries to its left are the
    client's own writing and never count.  ``trusted_hops=0`` (no proxy), or
    fewer entries than hops, gives the address the server saw.  Set it to the
    number of proxies in front of the server, no more.
    """
    if not is_int(trusted_hops, 0):
        raise ValueError(
            f"trusted_hops must be an int >= 0 (proxies in front), got {trusted_hops!r}"
        )
    if "headers" in request and "type" in request:  # an ASGI scope
        seen = client_host(request)
        raw = b",".join(v for k, v in request["headers"] if k.lower() == b"x-forwarded-for")
        forwarded = raw.decode("latin-1")
    else:  # a WSGI environ: the server joined repeated headers with commas
        seen = remote_addr(request)
        forwarded = str(request.get("HTTP_X_FORWARDED_FOR", ""))
    if not trusted_hops:
        return seen
    hops = [h.strip() for h in forwarded.split(",")] if forwarded else []
    return hops[-trusted_hops] if len(hops) >= trusted_hops and hops[-trusted_hops] else seen


def ascii_headers(headers: List[Tuple[str, str]]) -> List[Tuple[bytes, bytes]]:
    """ASGI's form: lower-case names, bytes."""
    return [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers]


class Policy:
    """One limiter seen through HTTP: grant, refuse, and the header values of either."""

    def __init__(
        self, limiter: Any, key: Optional[KeyFunc], cost: CostArg, max_wait: float, name: str
    ) -> None:
        if not _POLICY_RE.fullmatch(name):
            raise ValueError(
                f"policy must be 1-64 letters, digits or _.:/+- (a header token), got {name!r}"
            )
        if not (is_number(max_wait) and 0 <= max_wait < math.inf):
            raise ValueError(f"max_wait must be a finite number of seconds >= 0, got {max_wait!r}")
        if not callable(cost) and not is_int(cost, 1):
            raise ValueError(f"cost must be an int >= 1 or a callable returning one, got {cost!r}")
        if key is not None and not callable(key):
            raise TypeError(
                f"key must be a callable (scope or environ) -> str or None, got {key!r}"
            )
        for attr in ("try_acquire", "retry_after", "capacity", "rate", "per"):
            if not hasattr(limiter, attr):
                raise TypeError(
                    f"limiter must be a shmlimit Limiter or KeyedLimiter of one rate (rate=, not "
                    f"rates=: several rates are not supported here), got {limiter!r}"
                )
        if not max_wait and isinstance(limiter, Limiter) and limiter.stats().upstream is not None:
            raise ValueError(
                "max_wait must be above 0 with a Limiter with upstream=: its ops come in batches "
                "leased for waiters (expiring unused), so a request only tried was refused again "
                "after every Retry-After; give it a wait for its batch (say 0.1 s)"
            )
        if getattr(getattr(limiter, "config", None), "capped", False):
            raise ValueError(
                f"limiter {limiter!r} is capped: it grants only as ops are release()d, and the "
                f"middleware releases none (every request past its capacity would be refused)"
            )
        self.limiter = limiter
        # any keyed kind (KeyedLimiter, RedisKeyedLimiter) takes the request's key
        self.keyed = isinstance(limiter, Keyed)
        self.key = key
        self.cost = cost
        self.max_wait = float(max_wait)
        self.name = name
        # a Limiter's op may come up to the filler's longest pause after its ``retry_after``
        # (a replenish that adds nothing): the seconds told are counted from that late end
        self.slack = LONGEST_FILL_NS / 1e9 if isinstance(limiter, Limiter) else 0.0
        # (a keyed limiter's capacity is its default: a key's override may hold more)
        if not callable(cost) and not self.keyed:
            self.check_cost((), cost)

    def request(
        self, request: Any, default_key: Callable[[Any], str]
    ) -> Optional[Tuple[Tuple[Any, ...], int]]:
        """The limiter arguments (``(key,)`` or ``()``) and ops for a request, or None if it is exempt."""
        key = (
            self.key(request)
            if self.key is not None
            else (default_key(request) if self.keyed else "")
        )
        if key is None:
            return None
        n = self.cost(request) if callable(self.cost) else self.cost
        if not is_int(n, 1):
            raise ValueError(f"cost must be an int >= 1, the cost callable returned {n!r}")
        return ((key,) if self.keyed else ()), n

    def most(self, args: Tuple[Any, ...]) -> float:
        """The most ops one request can ever be granted: a key's capacity (a ``KeyedLimiter`` never
        grants more at once); a ``Limiter``'s capacity plus what its rate accrues within
        ``max_wait`` (a larger request queues for the rest, while its wait fits), times its
        catch-up ratio (the bound on any window: ``ratio * (rate*T + capacity)``)."""
        rate, per, capacity = self.rate_of(args)
        if self.keyed:
            return capacity
        return self.limiter.config.ratio * (capacity + self.max_wait * rate / per)

    def check_cost(self, args: Tuple[Any, ...], n: int) -> None:
        """ValueError when ``n`` ops can never be granted: every such request would be refused,
        each with a ``Retry-After`` that no wait can keep."""
        most = self.most(args)
        if n > most:
            what = "the key's capacity" if self.keyed else "the limiter's capacity"
            if not self.keyed and self.max_wait:
                what += f" plus what its rate accrues in max_wait={self.max_wait:g} s"
            if not self.keyed and self.limiter.config.ratio != 1:
                what += ", times its catch-up ratio"
            raise ValueError(
                f"cost must be from 1 to {math.floor(most + 1e-9)} ops ({what}), else no request "
                f"ever passes; got {n}"
            )

    def grant(self, args: Tuple[Any, ...], n: int) -> bool:
        """Take the request's ``n`` ops: at once or not at all, or waiting up to ``max_wait``;
        ValueError (``check_cost``) for a refused ``n`` that could never pass."""
        if self.max_wait > 0:
            granted = self.limiter.acquire(*args, n, timeout=self.max_wait)
        else:
            granted = self.limiter.try_acquire(*args, n)
        if not granted:
            self.check_cost(args, n)
        return granted

    async def grant_async(self, args: Tuple[Any, ...], n: int) -> bool:
        """``grant`` on the event loop: a wait is an ``asyncio.sleep``."""
        if self.max_wait > 0:
            granted = await self.limiter.acquire_async(*args, n, timeout=self.max_wait)
        else:
            granted = self.limiter.try_acquire(*args, n)
        if not granted:
            self.check_cost(args, n)
        return granted

    # -- headers ---------------------------------------------------------------------

    def rate_of(self, args: Tuple[Any, ...]) -> Tuple[float, float, float]:
        """``(rate, per, capacity)`` that prices the request's key: its override if it has one."""
        lim = self.limiter
        override = getattr(lim, "override", None) if self.keyed and args else None
        own = override(args[0]) if override is not None else None  # (a RedisKeyedLimiter has none)
        return own if own is not None else (float(lim.rate), float(lim.per), float(lim.capacity))

    def policy_header(self, args: Tuple[Any, ...] = ()) -> str:
        rate, per, _ = self.rate_of(args)
        window = max(math.ceil(per - 1e-9), math.ceil(per / rate - 1e-9), 1)
        quota = max(1, math.floor(rate * window / per + 1e-9))
        return f'"{self.name}";q={quota};w={window}'

    def state(self, args: Tuple[Any, ...]) -> Tuple[int, int]:
        """(remaining ops now, whole seconds until the bucket is full again), from the public API only.

        Ops are promised only if the next one would be granted now: a key waiting
        for a slot of a full table, or whose next op is due later, has none left.
        """
        lim = self.limiter
        rate, per, capacity = self.rate_of(args)
        full = max(1, math.floor(capacity))
        short = lim.retry_after(*args, full)  # seconds until a full bucket's worth could be granted
        if not math.isfinite(short):  # stopped: nothing until someone starts it again
            return 0, 0
        reset = math.ceil(short + self.slack - 1e-9) if short > 0 else 0
        if lim.retry_after(*args, 1) > 0:
            return 0, reset
        missing = short * rate / per  # ops the bucket lacks for `full`
        return max(0, math.floor(full - missing + 1e-9)), reset

    def granted_headers(self, args: Tuple[Any, ...]) -> List[Tuple[str, str]]:
        return self._quota_headers(args, *self.state(args))

    def _quota_headers(
        self, args: Tuple[Any, ...], remaining: int, t: int
    ) -> List[Tuple[str, str]]:
        """The policy, and the ops ``remaining`` now with the seconds ``t`` of the live state."""
        return [
            ("RateLimit-Policy", self.policy_header(args)),
            ("RateLimit", f'"{self.name}";r={remaining};t={t}'),
        ]

    def refused_headers(self, args: Tuple[Any, ...], n: int) -> List[Tuple[str, str]]:
        # seconds until the request could pass: its key's schedule, or (a new key refused by a
        # full table) until a slot frees
        wait = self.limiter.retry_after(*args, n)
        # an integer, at least 1: the request was refused, so "now" would invite a retry storm
        retry = max(1, math.ceil(wait + self.slack - 1e-9)) if math.isfinite(wait) else 60
        remaining, _ = self.state(args)  # (a smaller request may still pass)
        return [
            ("Content-Type", "text/plain; charset=utf-8"),
            ("Content-Length", str(len(BODY))),
            ("Retry-After", str(retry)),
            *self._quota_headers(args, remaining, retry),
        ]
