"""Celery: one rate shared by every worker process of a host, without blocking worker slots.

    import shmlimit
    from shmlimit.integrations.celery import rate_limited

    partner = shmlimit.Limiter("partner-api", rate=50)

    @app.task(bind=True)
    @rate_limited(partner)
    def call_partner(self, item): ...

Celery's own ``rate_limit`` is per worker instance (each ``celery worker``
holds its own, whatever its pool's size); a ``Limiter`` is shared by every
worker process of the host (and by any other program of it).  A task whose op
is not available now is not held in its worker slot: it *reserves* the next
slot (``limiter.reserve``) and is retried once (``task.retry``) with
``countdown`` set to exactly when that slot is due; its next run owns the slot
(a message header says so) and takes nothing more.  So a refused task costs
one retry, not one per look.  A run that comes back later than one request's
schedule after its slot (a pool that fell behind) leaves the slot unused and
asks afresh, so that missed slots never run together.  Where no slot can be reserved within
``max_countdown`` (or the limiter has no ``reserve``: a hierarchical one), it
falls back to a retry after ``retry_after`` plus a random spread that doubles
with every retry, so that tasks refused together do not come back together.
Either way the runs of a host never exceed ``rate*T + capacity`` in any window
of T (a reserved slot is a grant at its due time).  A limiter holds at most 64
reservations pending: a refused task beyond them waits in its slot until the
soonest falls due (about one op of schedule).  The header names the host's
boot and the limiter: a retry run by a worker of another host, or of another
limiter, takes its op again.

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

Without ``bind=True``, or with ``@rate_limited`` above ``@app.task``, the task is
refused with a ``TypeError`` that says what to write.
"""

from __future__ import annotations

import functools
import math
import random
import sys
import time
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
#: The message header by which a retried run owns the slot its refused run reserved.
HEADER = "shmlimit_reserved"

_BIND = (
    "rate_limited needs a bound task: write @app.task(bind=True) above @rate_limited(...), "
    "and give the function self as its first parameter"
)


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:  # pragma: no cover - no /proc: a reservation is then never carried over
        return ""


def _owner(limiter: Any, key: Optional[str], n: int) -> str:
    """What a reservation header names: this host's boot, the limiter, the key and the ops."""
    return f"{_boot_id()} {getattr(limiter, 'name', '')} {key or ''} {n}"


def _check_task(task: Any) -> Any:
    """The task's request; a TypeError saying what to write when ``task`` is not a bound task."""
    request = getattr(task, "request", None)
    if request is None or not callable(getattr(task, "retry", None)):
        raise TypeError(f"{_BIND} (got {type(task).__name__!r} where the task should be)")
    return request


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

    Returns once the ops are granted.  Otherwise reserves the next slot and
    raises the ``Retry`` of ``task.retry(countdown=...)``: the task leaves its
    worker slot and comes back when the slot is due, owning it (so this
    returns at once then).  With no slot within ``max_countdown`` seconds it
    comes back after about ``retry_after`` (see ``countdown``), to look again.
    With ``max_block`` > 0, a wait that short is waited out in the slot
    instead.  ``key`` is the key of a ``KeyedLimiter``.  A task called
    directly (not by a worker) simply waits for its ops.  ``task`` must be a
    bound task's ``self`` (TypeError otherwise, saying what to write).
    """
    _check(n, max_block, max_countdown, max_retries)
    request = _check_task(task)
    args = () if key is None else (key,)
    owner = _owner(limiter, key, n)
    held = _held(request)
    # this run's refused one reserved its slot (a header copied onto a later retry names an
    # earlier retry count: it is not this run's)
    late = held is not None and held[0] == f"{owner} {request.retries or 0}"
    if late:
        early = held[1] - time.monotonic_ns()
        if early > 0:  # the broker's countdown is in ms of the wall clock: the slot's own time
            time.sleep(early / 1e9)
            return
        # Used late, a slot's op would run beside later ones (a pool that fell behind runs every
        # slot it missed at once): later than one request's schedule, it is left unused (time
        # lost, never a burst) and this run asks afresh -- without reserving again, so that a
        # pool that stays behind never wastes more than one slot a task.
        if -early <= _schedule_ns(limiter, n):
            return
    if limiter.try_acquire(*args, n):
        return
    if getattr(
        request, "called_directly", False
    ):  # no worker to retry with: wait, as a plain call would
        limiter.acquire(*args, n)
        return
    if max_block > 0 and limiter.acquire(*args, n, timeout=max_block):
        return
    limit = sys.maxsize if max_retries is None else max_retries
    due = None if late or held is not None else _reserve(limiter, args, n, max_countdown)
    if due == 0.0:  # the slot reserved is due now (the op came free meanwhile): run
        return
    if due is not None:  # the slot is ours: one retry, at the moment it is due
        due_ns = time.monotonic_ns() + int(due * 1e9)
        headers = {**(getattr(request, "headers", None) or {})}
        headers[HEADER] = f"{owner} {(request.retries or 0) + 1} {due_ns}"
        raise task.retry(countdown=due, max_retries=limit, headers=headers)
    wait = limiter.retry_after(*args, n)
    if not math.isfinite(wait):  # stopped: look again in a while
        wait = max_countdown
    raise task.retry(
        countdown=countdown(wait, request.retries or 0, max_countdown), max_retries=limit
    )


def _held(request: Any) -> Optional[tuple]:
    """``(owner and retry count, due ns)`` of the slot a retried run's header says it owns, or
    None."""
    value = getattr(request, HEADER, None)
    if value is None:
        value = (getattr(request, "headers", None) or {}).get(HEADER)
    if not isinstance(value, str):
        return None
    owner, _, due = value.rpartition(" ")
    return (owner, int(due)) if due.isdigit() else None


def _schedule_ns(limiter: Any, n: int) -> float:
    """``n`` ops of the limiter's rate, in ns (its default rate for a KeyedLimiter); 50 ms for a
    limiter that does not say its rate."""
    try:
        return n * float(limiter.per) / float(limiter.rate) * 1e9
    except (AttributeError, TypeError, ValueError, ZeroDivisionError):
        return 50e6


def _reserve(limiter: Any, args: tuple, n: int, within: float) -> Optional[float]:
    """Seconds until a slot reserved now for ``n`` ops is due, or None (none within ``within``
    seconds, or a limiter that reserves nothing: hierarchical, capped without room)."""
    reserve = getattr(limiter, "reserve", None)
    if reserve is None:
        return None
    try:
        due = reserve(*args, n, max_wait=within)
    except ValueError:  # a hierarchical limiter: its tokens come from leases, at no known time
        return None
    return due if due is not None and math.isfinite(due) else None


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
        if callable(getattr(fn, "apply_async", None)):  # a task already: the decorators' order
            raise TypeError(
                "@rate_limited(...) must be below @app.task(bind=True), not above it: "
                "write @app.task(bind=True), then @rate_limited(...), then the function"
            )

        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            if not args:  # no self at all: a task without bind=True, called without arguments
                raise TypeError(_BIND)
            self, args = args[0], args[1:]
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
