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
waits with ``asyncio.sleep`` through ``acquire_async``.  A client that
disconnects while its request waits gives its place up at once: the request
is not served, and its ops go to those queued behind it.
"""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable, List, MutableMapping, Optional, Tuple

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

#: Bytes of request body, and messages, read while a request waits for its ops, to hear a
#: disconnect behind them; past either the middleware stops reading, and the server's own flow
#: control holds the rest.
MAX_HELD_BODY = 64 * 1024
MAX_HELD_MESSAGES = 256


async def _until_disconnect(receive: Receive, held: List[Message]) -> bool:
    """Read ``receive`` into ``held`` until the client disconnects (True), or stop (False) past
    ``MAX_HELD_BODY`` bytes or ``MAX_HELD_MESSAGES`` messages, or at a second message after the
    whole body: by the ASGI spec only a disconnect follows it, so a server that answers again is
    not listened to."""
    size, whole = 0, False
    while True:
        message = await receive()
        held.append(message)
        if message.get("type") == "http.disconnect":
            return True
        if whole:
            return False
        size += len(message.get("body", b""))
        whole = not message.get("more_body", False)
        if size > MAX_HELD_BODY or len(held) >= MAX_HELD_MESSAGES:
            return False


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
        granted, receive = await self._grant(args, n, receive)
        if granted is None:
            return  # gone while waiting: no one to answer
        if not granted:
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

    async def _grant(
        self, args: Tuple[Any, ...], n: int, receive: Receive
    ) -> Tuple[Optional[bool], Receive]:
        """The policy's grant, and the ``receive`` the app is to read.  While the request waits
        (``max_wait``) the client is listened to: a disconnect gives the wait up (None), its
        ticket given back; the messages read meanwhile are the app's first."""
        if self.policy.max_wait <= 0:
            return await self.policy.grant_async(args, n), receive
        held: List[Message] = []
        grant = asyncio.ensure_future(self.policy.grant_async(args, n))
        listen = asyncio.ensure_future(_until_disconnect(receive, held))
        try:
            await asyncio.wait((grant, listen), return_when=asyncio.FIRST_COMPLETED)
            if not grant.done() and not (listen.done() and listen.result()):
                await asyncio.wait((grant,))  # stopped listening: the grant alone decides
        finally:
            for task in (listen, grant):  # (cancelled from outside: both end here)
                if not task.done():
                    task.cancel()
                    await asyncio.gather(task, return_exceptions=True)
        if grant.cancelled():
            return None, receive

        async def replay() -> Message:
            return held.pop(0) if held else await receive()

        return grant.result(), replay
