"""``httpx`` transports that throttle per host and pause a host fleet-wide on 429/503 ``Retry-After``.

    import httpx, shmlimit
    from shmlimit.integrations.httpx import ThrottledTransport, AsyncThrottledTransport

    per_host = shmlimit.KeyedLimiter("crawler", rate=2)     # or a Limiter: one limit for every host
    client = httpx.Client(transport=ThrottledTransport(per_host))
    aclient = httpx.AsyncClient(transport=AsyncThrottledTransport(per_host))

Each request first takes one op of the limiter, under its host's key for a
``KeyedLimiter`` (see ``shmlimit.integrations._hosts``).  The async transport
waits with ``asyncio.sleep``.  A response 429 or 503 with ``Retry-After``
pauses that host, and no other, for every process on the machine.
"""

from __future__ import annotations

from typing import Any, Optional

from shmlimit.errors import MissingExtraError
from shmlimit.integrations._hosts import HostThrottle

try:
    import httpx
except ImportError as e:  # without the httpx extra: say what installs it
    raise MissingExtraError(__name__, "httpx", e) from e

__all__ = ["AsyncThrottledTransport", "ThrottledTransport"]


class ThrottledTransport(httpx.BaseTransport):
    """Wraps ``transport`` (default ``httpx.HTTPTransport()``): one op per request, a pause on Retry-After.

    The keyword options (``key``, ``max_wait``, ``pause_on``, ``max_pause``,
    ``pauses``) are those of ``shmlimit.integrations._hosts.HostThrottle``.
    """

    def __init__(
        self, limiter: Any, transport: Optional[httpx.BaseTransport] = None, **options: Any
    ) -> None:
        self.throttle = HostThrottle(limiter, **options)
        self.transport = transport if transport is not None else httpx.HTTPTransport()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        return self.throttle.around(
            str(request.url), lambda: self.transport.handle_request(request)
        )

    def close(self) -> None:
        self.transport.close()


class AsyncThrottledTransport(httpx.AsyncBaseTransport):
    """The asyncio form of ``ThrottledTransport`` (default inner transport ``httpx.AsyncHTTPTransport()``)."""

    def __init__(
        self, limiter: Any, transport: Optional[httpx.AsyncBaseTransport] = None, **options: Any
    ) -> None:
        self.throttle = HostThrottle(limiter, **options)
        self.transport = transport if transport is not None else httpx.AsyncHTTPTransport()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        send = lambda: self.transport.handle_async_request(request)  # noqa: E731
        return await self.throttle.around_async(str(request.url), send)

    async def aclose(self) -> None:
        await self.transport.aclose()
