"""Celery: one rate shared by every worker process of a host, without blocking worker slots.

    import shmlimit
    from shmlimit.integrations.celery import rate_limited

    partner = shmlimit.Limiter("partner-api", rate=50)

    @app.task(bind=True)
    @rate_limited(partner)
    def call_partner(self, item): ...

Celery's own ``rate_limit`` is per worker process; a ``Limiter`` is shared by
all of them (and by any other program of the host).  A task whose op is not
available now is not held in its worker slot: it is retried (``task.retry``)
with ``countdown`` set to the limiter's ``retry_after``, plus a random spread
that doubles with every retry, so that tasks refused together do not come
back together and flood the broker.  Each run takes its op when it runs, so
the runs of a host never exceed ``rate*T + capacity`` in any window of T.

``max_block`` (seconds) is the blocking mode for short waits: a task whose op
can be had within that long waits for it in its slot instead of retrying.

The trade-off: a retry costs a broker round trip and a pass through the pool,
and an op nobody asks for while the bucket is full is lost (a token bucket
drops idle time).  With a small capacity and many tasks queued, pure retrying
therefore grants below the rate; a ``max_block`` of a few ops' worth of
schedule per worker process (or a larger ``burst``) keeps the pool at the
rate, still never above it.

Throttling retries count in ``self.request.retries`` like any retry, but not
against the task's ``max_retries``: they use their own ``max_retries``
(default: no limit).
"""

from __future__ import annotations

import functools
import math
import random
import sys
from typing import Any, Callable, Optional, TypeVar

from shmlimit.errors import MissingExtraError

try:  # the helper drives Celery's task API (retry, request): checked here, with a hint
    import celery  # noqa: F401
except ImportError as e:  # without the celery extra: say what installs it
    raise MissingExtraError(__name__, "celery", e) from e

__all__ = ["acquire_or_retry", "rate_limited"]

F = TypeVar("F", bound=Callable[..., Any])
#: The random spread of a retry's countdown starts at this share of the wait, and doubles per retry.
SPREAD_CAP_RETRIES = 8


def _check_limiter(limiter: Any, keyed: bool) -> None:
    """A limiter (``Limiter``, ``KeyedLimiter``, ``RedisLimiter``) and ``key=`` given exactly for a keyed one."""
    from shmlimit import KeyedLimiter

    if not all(
        callable(getattr(limiter, a, None)) for a in ("try_acquire", "acquire", "retry_after")
    ):
        raise TypeError(
            f"limiter must be a shmlimit Limiter, KeyedLimiter or RedisLimiter, got {type(limiter).__name__}"
        )
    if keyed != isinstance(limiter, KeyedLimiter):
        raise TypeError(
            "key is needed with a KeyedLimiter (it picks each run's key), and only with one"
        )


def _check(n: int, max_block: float, max_countdown: float, max_retries: Optional[int]) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be an int >= 1, got {n!r}")
    if (
        isinstance(max_block, bool)
        or not isinstance(max_block, (int, float))
        or not 0 <= max_block < math.inf
    ):
        raise ValueError(f"max_block must be a finite number of seconds >= 0, got {max_block!r}")
    if (
        isinstance(max_countdown, bool)
        or not isinstance(max_countdown, (int, float))
        or not 0 < max_countdown < math.inf
    ):
        raise ValueError(
            f"max_countdown must be a finite number of seconds > 0, got {max_countdown!r}"
        )
    if max_retries is not None and (
        isinstance(max_retries, bool) or not isinstance(max_retries, int) or max_retries < 0
    ):
        raise ValueError(f"max_retries must be None (no limit) or an int >= 0, got {max_retries!r}")


def countdown(wait: float, retries: int, max_countdown: float = 60.0) -> float:
    """The retry's countdown (seconds): the wait, plus a random spread doubling with every retry.

    The spread is uniform in [0, wait * 2**retries) (at least 1 ms of schedule
    per retry), capped with the whole countdown at ``max_countdown``.
    """
    base = max(wait, 0.001)
    spread = base * (2 ** min(retries, SPREAD_CAP_RETRIES))
    return min(max_countdown, wait + random.uniform(0, spread))


def acquire_or_retry(
    task: Any,
    limiter: Any,
    n: int = 1,
    *,
    key: Optional[str] = None,
    max_block: float = 0.0,
    max_countdown: float = 60.0,
    max_retries: Optional[int] = None,
) -> None:
    """Take ``n`` ops of ``limiter`` for the running ``task`` (a bound task's ``self``), or retry it later.

    Returns once the ops are granted.  Otherwise raises the ``Retry`` of
    ``task.retry(countdown=...)``: the task leaves its worker slot and comes
    back after about ``retry_after`` seconds (see ``countdown``), never more
    than ``max_countdown``.  With ``max_block`` > 0, a wait that short is
    waited out in the slot instead.  ``key`` is the key of a ``KeyedLimiter``.
    A task called directly (not by a worker) simply waits for its ops.
    """
    _check(n, max_block, max_countdown, max_retries)
    args = () if key is None else (key,)
    if limiter.try_acquire(*args, n):
        return
    request = task.request
    if getattr(
        request, "called_directly", False
    ):  # no worker to retry with: wait, as a plain call would
        limiter.acquire(*args, n)
        return
    if max_block > 0 and limiter.acquire(*args, n, timeout=max_block):
        return
    wait = limiter.retry_after(*args, n)
    if not math.isfinite(wait):  # stopped: look again in a while
        wait = max_countdown
    raise task.retry(
        countdown=countdown(wait, request.retries or 0, max_countdown),
        max_retries=sys.maxsize if max_retries is None else max_retries,
    )


def rate_limited(
    limiter: Any,
    n: int = 1,
    *,
    key: Optional[Callable[..., str]] = None,
    max_block: float = 0.0,
    max_countdown: float = 60.0,
    max_retries: Optional[int] = None,
) -> Callable[[F], F]:
    """Decorate a bound task's function (under ``@app.task(bind=True)``): each run first takes ``n`` ops.

    ``key(*args, **kwargs)`` picks the key of a ``KeyedLimiter`` from the
    task's arguments.  The other parameters are those of ``acquire_or_retry``.
    """
    _check(n, max_block, max_countdown, max_retries)
    if key is not None and not callable(key):
        raise TypeError(f"key must be a callable taking the task's arguments, got {key!r}")
    _check_limiter(limiter, key is not None)

    def decorate(fn: F) -> F:
        @functools.wraps(fn)
        def run(self: Any, *args: Any, **kwargs: Any) -> Any:
            acquire_or_retry(
                self,
                limiter,
                n,
                key=None if key is None else key(*args, **kwargs),
                max_block=max_block,
                max_countdown=max_countdown,
                max_retries=max_retries,
            )
            return fn(self, *args, **kwargs)

        run.limiter = limiter  # type: ignore[attr-defined]
        return run  # type: ignore[return-value]

    return decorate
