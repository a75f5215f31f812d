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
is not served, and its ops go to those queued behind it (a ``KeyedLimiter``'s key
gets them back if no one took it since, else spends them, as a ``RedisKeyedLimiter``'s does).
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


async def _until_disconnect(
    receive: Receive, held: List[Message], grant: asyncio.Future[bool]
) -> bool:
    """Read ``receive`` into ``held`` until the client disconnects (True), or stop (False) past
    ``MAX_HELD_BODY`` bytes or ``MAX_HELD_MESSAGES`` messages, or at a second message after the
    whole body: by the ASGI spec only a disconnect follows it, so a server that answers again is
    not listened to.  Once ``grant`` is decided, the read in flight is the last: it is never
    cancelled, as a read may take its message off the stream before it waits."""
    size, whole = 0, False
    while not grant.done():
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
    return False


async def _ended(tasks: List[asyncio.Future[Any]]) -> None:
    """Cancel the request's tasks still running, every one before any wait (a second
    cancellation of the request may end the wait, not the tasks), and wait for them."""
    for task in tasks:
        task.cancel()  # (none if done)
    if tasks:
        await asyncio.gather(*tasks, return_exceptions=True)


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
        tasks: List[asyncio.Future[Any]] = []
        try:
            await self._served(scope, receive, send, args, n, tasks)
        finally:
            await _ended(tasks)  # a grant still waiting gives its ticket back; a read ends

    async def _served(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        args: Tuple[Any, ...],
        n: int,
        tasks: List[asyncio.Future[Any]],
    ) -> None:
        granted, receive = await self._grant(args, n, receive, tasks)
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
        self, args: Tuple[Any, ...], n: int, receive: Receive, tasks: List[asyncio.Future[Any]]
    ) -> Tuple[Optional[bool], Receive]:
        """The policy's grant, and the ``receive`` the app is to read.  While the request waits
        (``max_wait``) the client is listened to: a disconnect gives the wait up (None), its
        ticket given back; the messages read meanwhile are the app's first, the read in flight
        when the wait ended among them.  The request's tasks go to ``tasks``, for its end."""
        if self.policy.max_wait <= 0:
            return await self.policy.grant_async(args, n), receive
        grant = asyncio.ensure_future(self.policy.grant_async(args, n))
        tasks.append(grant)
        # the grant's first step runs first: a request granted or refused without waiting reads
        # nothing (a read would ask a client that expects "100 Continue" for its body)
        await asyncio.sleep(0)
        if grant.done():
            return grant.result(), receive
        held: List[Message] = []
        listen = asyncio.ensure_future(_until_disconnect(receive, held, grant))
        tasks.append(listen)
        await asyncio.wait((grant, listen), return_when=asyncio.FIRST_COMPLETED)
        if listen.done() and listen.result():  # (a read's error is raised)
            return None, receive  # gone (a grant in the same step is spent for no one)
        granted = await grant

        async def replay() -> Message:
            if not held and not listen.done():
                await asyncio.shield(listen)  # the read in flight: its message is the app's next
            if held:
                return held.pop(0)
            listen.result()  # a read that failed fails the app's
            return await receive()

        return granted, replay
