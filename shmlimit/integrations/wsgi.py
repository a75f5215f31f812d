"""WSGI middleware: one shared rate limit (or one per key) in front of any WSGI app.

    import shmlimit
    from shmlimit.integrations.wsgi import RateLimitMiddleware

    app = RateLimitMiddleware(app, limiter=shmlimit.Limiter("api", rate=100))

Every worker of the server (``gunicorn -w N``, uWSGI processes) shares the
one limit through shared memory.  A refused request gets ``429 Too Many
Requests`` with an integer ``Retry-After`` and the IETF
``RateLimit``/``RateLimit-Policy`` headers; a granted response carries the
same two headers with the quota remaining.  With ``max_wait`` a request waits
(blocking its worker thread, as WSGI does) up to that many seconds for its ops.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Iterable

from shmlimit.integrations._http import BODY, Middleware, client_ip, remote_addr

__all__ = ["RateLimitMiddleware", "client_ip", "remote_addr"]

Environ = Dict[str, Any]
WSGIApp = Callable[[Environ, Callable[..., Any]], Iterable[bytes]]


class RateLimitMiddleware(Middleware):
    """Limit the requests of ``app`` by ``limiter`` (a ``Limiter`` or a ``KeyedLimiter``).

    The parameters are those of ``shmlimit.integrations.asgi.RateLimitMiddleware``,
    with ``key(environ)`` and ``cost(environ)`` taking the WSGI environ.
    """

    app: WSGIApp

    def __call__(self, environ: Environ, start_response: Callable[..., Any]) -> Iterable[bytes]:
        req = self.policy.request(environ, remote_addr)
        if req is None:
            return self.app(environ, start_response)
        args, n = req
        if not self.policy.grant(args, n):
            start_response("429 Too Many Requests", self.policy.refused_headers(args, n))
            return [BODY]

        def start_with_quota(status: str, headers: list, exc_info: Any = None) -> Any:
            headers = [*headers, *self.policy.granted_headers(args)]
            return (
                start_response(status, headers)
                if exc_info is None
                else start_response(status, headers, exc_info)
            )

        return self.app(environ, start_with_quota if self.headers else start_response)
