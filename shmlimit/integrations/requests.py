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

urllib3's retries (``max_retries=``) resend a request inside one ``send``: each
resend is throttled as a request is, taking its op after the host's pause (the
answer's ``Retry-After``, as the throttle reads it: ``pause_on``, at most
``max_pause``, within ``max_wait``), never after urllib3's own ``Retry-After``
sleep; its backoff stays.
"""

from __future__ import annotations

import threading
from typing import Any, Dict, Optional

from shmlimit.errors import MissingExtraError
from shmlimit.integrations._hosts import HostThrottle

try:
    from requests.adapters import HTTPAdapter
except ImportError as e:  # without the requests extra: say what installs it
    raise MissingExtraError(__name__, "requests", e) from e

__all__ = ["ThrottledAdapter"]

#: HostThrottle's options; every other keyword argument is HTTPAdapter's
THROTTLE_OPTIONS = ("key", "max_wait", "pause_on", "max_pause", "pauses")


class _Resend:
    """Mixed into the adapter's urllib3 ``Retry``: urllib3 calls ``sleep`` before each resend,
    which is where the resend is throttled (``ThrottledAdapter.resend``)."""

    adapter: Any = None

    def new(self, **kw: Any) -> Any:
        retry = super().new(**kw)  # type: ignore[misc]
        retry.adapter = self.adapter
        return retry

    def sleep(self, response: Any = None) -> None:
        if not self.adapter.resend(response, self._sleep_backoff):  # type: ignore[attr-defined]
            super().sleep(response)  # type: ignore[misc]  # not throttled: urllib3's own


def _remade(cls: Any, limiter: Any, options: Dict[str, Any]) -> Any:
    return cls(limiter, **options)


class ThrottledAdapter(HTTPAdapter):
    """An ``HTTPAdapter`` that takes one op per request and pauses a host on 429/503 ``Retry-After``.

    It pickles (with the ``Session`` it is mounted in) as its limiter and options: unpickled, it
    is made again, attached to the same limiter (a ``key`` must then be a picklable function)."""

    def __init__(self, limiter: Any, **options: Any) -> None:
        self._made = (limiter, dict(options))
        throttle = {k: options.pop(k) for k in THROTTLE_OPTIONS if k in options}
        super().__init__(**options)  # first: a wrong option makes no pause table
        self.throttle = HostThrottle(limiter, **throttle)
        self.sending = threading.local()  # the url each thread is sending (urllib3 resends it)
        retry = self.max_retries.new()
        retry.__class__ = type(type(retry).__name__, (_Resend, type(retry)), {})
        retry.adapter = self
        self.max_retries = retry

    def __reduce__(self) -> Any:
        return _remade, (type(self), *self._made)

    def send(self, request: Any, *args: Any, **kwargs: Any) -> Any:
        self.sending.url = request.url
        return self.throttle.around(
            request.url, lambda: HTTPAdapter.send(self, request, *args, **kwargs)
        )

    def resend(self, response: Optional[Any], backoff: Any) -> bool:
        """Before urllib3 resends this thread's request: react to the ``response`` it retries
        (None after an error) as to any answer, back off unless that paused the host, then wait
        out the pause and take the resend's op.  False: the request is not throttled."""
        req = self.throttle.args(self.sending.url)
        if req is None:
            return False
        args, host = req
        paused = None
        if response is not None:
            retry_after = response.headers.get("retry-after")
            paused = self.throttle.after(host, response.status, retry_after, args=args)
        if paused is None:
            backoff()
        self.throttle.before(args, host)
        return True
