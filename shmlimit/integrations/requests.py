"""A ``requests`` adapter that throttles per host and pauses a host fleet-wide on 429/503 ``Retry-After``.

    import requests, shmlimit
    from shmlimit.integrations.requests import ThrottledAdapter

    session = requests.Session()
    adapter = ThrottledAdapter(shmlimit.KeyedLimiter("crawler", rate=2))  # or a Limiter
    session.mount("http://", adapter)
    session.mount("https://", adapter)

The parameters and behaviour are those of
``shmlimit.integrations.httpx.ThrottledTransport``; the other keyword
arguments go to ``requests.adapters.HTTPAdapter`` (pool sizes, retries).
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, Optional

from requests.adapters import HTTPAdapter

from ._hosts import HostThrottle

__all__ = ["ThrottledAdapter"]


class ThrottledAdapter(HTTPAdapter):
    """An ``HTTPAdapter`` that takes one op per request and pauses a host on 429/503 ``Retry-After``."""

    def __init__(
        self,
        limiter: Any,
        *,
        key: Optional[Callable[[str], Optional[str]]] = None,
        max_wait: Optional[float] = None,
        pause_on: Iterable[int] = (429, 503),
        max_pause: float = 300.0,
        **adapter_options: Any,
    ) -> None:
        self.throttle = HostThrottle(limiter, key, max_wait, pause_on, max_pause)
        super().__init__(**adapter_options)

    def send(self, request: Any, *args: Any, **kwargs: Any) -> Any:
        throttle_args = self.throttle.args(request.url)
        if throttle_args is None:
            return super().send(request, *args, **kwargs)
        self.throttle.before(throttle_args)
        response = super().send(request, *args, **kwargs)
        self.throttle.after(throttle_args, response.status_code, response.headers.get("Retry-After"))
        return response
