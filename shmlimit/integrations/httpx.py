"""``httpx`` transports that throttle per host and pause a host fleet-wide on 429/503 ``Retry-After``.

    import httpx, shmlimit
    from shmlimit.integrations.httpx import ThrottledTransport, AsyncThrottledTransport

    per_host = shmlimit.KeyedLimiter("crawler", rate=2)     # or a Limiter: one limit for every host
    client = httpx.Client(transport=ThrottledTransport(per_host))
    aclient = httpx.AsyncClient(transport=AsyncThrottledTransport(per_host))

Each request first takes one op of the limiter, under its host's key for a
``KeyedLimiter`` (see ``shmlimit.integrations._hosts``).  The async transport
waits with ``asyncio.sleep``.  A response 429 or 503 with ``Retry-After``
pushes that host's schedule that far ahead for every process on the machine.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, Optional

import httpx

from ._hosts import HostThrottle

__all__ = ["AsyncThrottledTransport", "ThrottledTransport"]


class ThrottledTransport(httpx.BaseTransport):
    """Wraps ``transport`` (default ``httpx.HTTPTransport()``): one op per request, a pause on Retry-After.

    ``key(url) -> str | None`` overrides the key (default: the host; None: not
    throttled).  ``max_wait`` (seconds, default None: as long as needed) bounds
    the wait, beyond which ``shmlimit.RateLimited`` is raised without sending.
    ``pause_on`` are the statuses whose ``Retry-After`` pauses the host
    (default 429 and 503), for at most ``max_pause`` seconds (default 300).
    """

    def __init__(
        self,
        limiter: Any,
        transport: Optional[httpx.BaseTransport] = None,
        *,
        key: Optional[Callable[[str], Optional[str]]] = None,
        max_wait: Optional[float] = None,
        pause_on: Iterable[int] = (429, 503),
        max_pause: float = 300.0,
    ) -> None:
        self.throttle = HostThrottle(limiter, key, max_wait, pause_on, max_pause)
        self.transport = transport if transport is not None else httpx.HTTPTransport()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        args = self.throttle.args(str(request.url))
        if args is None:
            return self.transport.handle_request(request)
        self.throttle.before(args)
        response = self.transport.handle_request(request)
        self.throttle.after(args, response.status_code, response.headers.get("retry-after"))
        return response

    def close(self) -> None:
        self.transport.close()


class AsyncThrottledTransport(httpx.AsyncBaseTransport):
    """The asyncio form of ``ThrottledTransport`` (default inner transport ``httpx.AsyncHTTPTransport()``)."""

    def __init__(
        self,
        limiter: Any,
        transport: Optional[httpx.AsyncBaseTransport] = None,
        *,
        key: Optional[Callable[[str], Optional[str]]] = None,
        max_wait: Optional[float] = None,
        pause_on: Iterable[int] = (429, 503),
        max_pause: float = 300.0,
    ) -> None:
        self.throttle = HostThrottle(limiter, key, max_wait, pause_on, max_pause)
        self.transport = transport if transport is not None else httpx.AsyncHTTPTransport()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        args = self.throttle.args(str(request.url))
        if args is None:
            return await self.transport.handle_async_request(request)
        await self.throttle.before_async(args)
        response = await self.transport.handle_async_request(request)
        self.throttle.after(args, response.status_code, response.headers.get("retry-after"))
        return response

    async def aclose(self) -> None:
        await self.transport.aclose()
