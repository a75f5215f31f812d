"""A ``requests`` adapter that throttles per host and pauses a host fleet-wide on 429/503 ``Retry-After``.

    import requests, shmlimit
    from shmlimit.integrations.requests import ThrottledAdapter

    session = requests.Session()
    adapter = ThrottledAdapter(shmlimit.KeyedLimiter("crawler", rate=2))  # or a Limiter
    session.mount("http://", adapter)
    session.mount("https://", adapter)

The throttle's keyword options (``key``, ``max_wait``, ``pause_on``,
``max_pause``, ``pauses``) and its behaviour are those of
``shmlimit.integrations.httpx.ThrottledTransport``; the other keyword
arguments go to ``requests.adapters.HTTPAdapter`` (pool sizes, retries).
"""

from __future__ import annotations

from typing import Any

from shmlimit.errors import MissingExtraError
from shmlimit.integrations._hosts import HostThrottle

try:
    from requests.adapters import HTTPAdapter
except ImportError as e:  # without the requests extra: say what installs it
    raise MissingExtraError(__name__, "requests", e) from e

__all__ = ["ThrottledAdapter"]

#: HostThrottle's options; every other keyword argument is HTTPAdapter's
THROTTLE_OPTIONS = ("key", "max_wait", "pause_on", "max_pause", "pauses")


class ThrottledAdapter(HTTPAdapter):
    """An ``HTTPAdapter`` that takes one op per request and pauses a host on 429/503 ``Retry-After``."""

    def __init__(self, limiter: Any, **options: Any) -> None:
        self.throttle = HostThrottle(
            limiter, **{k: options.pop(k) for k in THROTTLE_OPTIONS if k in options}
        )
        super().__init__(**options)

    def send(self, request: Any, *args: Any, **kwargs: Any) -> Any:
        return self.throttle.around(
            request.url, lambda: HTTPAdapter.send(self, request, *args, **kwargs)
        )
