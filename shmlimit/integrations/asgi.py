"""ASGI middleware: one shared rate limit (or one per key) in front of any ASGI app.

    import shmlimit
    from shmlimit.integrations.asgi import RateLimitMiddleware

    app = RateLimitMiddleware(app, limiter=shmlimit.Limiter("api", rate=100))

Every worker process of the server (``uvicorn --workers N``, ``gunicorn -k
uvicorn.workers.UvicornWorker``) shares the one limit through shared memory.
A refused request gets ``429 Too Many Requests`` with an integer
``Retry-After`` and the IETF ``RateLimit``/``RateLimit-Policy`` headers
(see ``shmlimit.integrations._http``); a granted response carries the same two
headers with the quota remaining.  Only ``http`` requests are limited;
``lifespan`` and ``websocket`` pass through.

The event loop is never blocked: a grant or refusal is a few atomic
operations on shared memory, and the wait-up-to mode (``max_wait`` seconds)
waits with ``asyncio.sleep`` through ``acquire_async``.
"""

from __future__ import annotations

from typing import Any, Awaitable, Callable, MutableMapping

from shmlimit.integrations._http import (
    BODY,
    STATUS,
    Middleware,
    ascii_headers,
    client_host,
    client_ip,
)

__all__ = ["RateLimitMiddleware", "client_host", "client_ip"]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class RateLimitMiddleware(Middleware):
    """Limit the HTTP requests of ``app`` by ``limiter`` (a ``Limiter``, or a ``KeyedLimiter`` or
    ``RedisKeyedLimiter``: one limit per key).

    * ``key(scope) -> str | None`` picks the key of a ``KeyedLimiter`` (default:
      the client's address); returning None exempts the request (health checks,
      metrics).  With a plain ``Limiter`` every request shares the one limit and
      only a None from ``key`` matters.
    * ``cost``: ops per request, an int or ``cost(scope) -> int`` (default 1).
    * ``max_wait``: seconds a request may wait for its ops before being
      refused (default 0: refuse at once).  Waiting never blocks the loop.
    * ``policy``: the policy name in the ``RateLimit`` headers (default "default").
    * ``headers``: add the ``RateLimit`` headers to granted responses (default True).
    """

    app: ASGIApp

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # only http requests are limited: lifespan and websocket pass, as do exempt requests
        req = self.policy.request(scope, client_host) if scope["type"] == "http" else None
        if req is None:
            await self.app(scope, receive, send)
            return
        args, n = req
        if not await self.policy.grant_async(args, n):
            await send(
                {
                    "type": "http.response.start",
                    "status": STATUS,
                    "headers": ascii_headers(self.policy.refused_headers(args, n)),
                }
            )
            await send({"type": "http.response.body", "body": BODY})
            return

        async def send_with_quota(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = dict(message)
                message["headers"] = [
                    *message.get("headers", ()),
                    *ascii_headers(self.policy.granted_headers(args)),
                ]
            await send(message)

        await self.app(scope, receive, send_with_quota if self.headers else send)
