"""Celery: one rate shared by every worker process of a host, without blocking worker slots.

    import shmlimit
    from shmlimit.integrations.celery import rate_limited

    partner = shmlimit.Limiter("partner-api", rate=50)

    @app.task(bind=True)
    @rate_limited(partner)
    def call_partner(self, item): ...

Celery's own ``rate_limit`` is per worker instance (each ``celery worker``
holds its own, whatever its pool's size); a ``Limiter`` is shared by every
worker process of the host (and by any other program of it).

A run whose op is not available now does not hold its worker slot: it
*reserves* the next slot (``limiter.reserve``) and is retried once
(``task.retry``) with the countdown set to when that slot is due; the retried
run owns the slot (a message header says so) and takes nothing more.  So a
refused task costs one retry, not one per look.  The countdown lands a
little before the slot, by the pool's lag as this process has seen it (a
retry is handed to the pool late by the worker's timer and queue); a run back
early waits out the rest in its slot, so it never runs before its slot.

A reserved slot is a grant at its due time, and a run may start up to one
op's schedule after it, so a window of T holds at most one run more than
``rate*T + capacity``.  A run back later than that leaves its slot unused
(time lost, never a burst: run late, it would run beside the ops due then)
and reserves once more; a task reserves at most ``MAX_SLOTS`` slots.  A
burst of refusals larger than the worker handles before the first slots fall
due costs those tasks their second slot.  Slots are not reserved for ops of
less than ``MIN_SLOT`` of schedule (a pool's lag misses them as often as it
keeps them), when no slot is due within ``max_countdown``, by a limiter that
reserves nothing (hierarchical), or by a process that missed most of its
slots lately: then the task looks again after ``retry_after`` plus a random
spread that doubles with every retry, so that tasks refused together do not
come back together.  The header names the host's boot and the limiter: a
retry run on another host, or for another limiter, takes its op afresh, as
does one whose slot is due more than ``max_countdown`` ahead (none is
reserved that far).

``max_block`` (seconds) is the blocking mode for short waits: a task whose op
can be had within that long waits for it in its slot instead of retrying.

Throttling retries count in ``self.request.retries`` like any retry, but not
against the task's ``max_retries``: they use their own ``max_retries``
(default: no limit).

``throttling=(SomeError, ...)`` reports outcomes to an adaptive limiter
(``adapt=``): a run that raises one of them is "throttled", one that returns
is "ok" (other exceptions report nothing).

Without ``bind=True``, or with ``@rate_limited`` above ``@app.task``, the task is
refused with a ``TypeError`` that says what to write.
"""

from __future__ import annotations

import functools
import math
import random
import sys
import time
from typing import Any, Callable, Optional, Tuple, Type, TypeVar

from shmlimit.adapt import tell
from shmlimit.config import is_int, is_number
from shmlimit.errors import MissingExtraError
from shmlimit.protocol import Keyed

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
#: A countdown lands ahead of its slot by the pool's lag, at most this long (seconds) and at most
#: LEAD_OPS ops of schedule: a run back early waits out the rest in its worker slot, so a longer
#: lead would hold the pool's processes idle.
MAX_LEAD = 0.5
LEAD_OPS = 2.0
#: The slots one task reserves at most: a task whose retries came back too late to use its slots
#: looks again instead, so a lagging pool cannot waste slot after slot.
MAX_SLOTS = 2
#: The lag assumed before any was seen (seconds).
FIRST_LAG = 0.02
#: Slots are reserved only for ops of at least this much schedule (seconds; up to 25 ops a
#: second): a pool hands retries back a few to some tens of ms late, so a shorter slot is missed
#: about as often as it is kept, and looking again serves such a rate better.
MIN_SLOT = 0.04
#: Each owned run back moves the lag and the share of slots missed this far towards what it saw.
SEEN_WEIGHT = 0.1
#: A process that missed more than this share of its slots lately reserves no more: its pool runs
#: behind its schedule (a high rate for its processes), and looking again wastes no slot.
MISSED_SHARE = 0.5
#: The share missed halves every this long (seconds), so that a pool that caught up reserves again.
MISSED_HALF_LIFE = 5.0

_BIND = (
    "rate_limited needs a bound task: write @app.task(bind=True) above @rate_limited(...), "
    "and give the function self as its first parameter"
)


class _Pool:
    """What this process saw of its pool handing back retries: their lag, and the slots missed.

    A retry is handed to the pool after its countdown by the worker's timer and queue, later
    under load.  The countdown lands ahead of the slot by the lag (an average, so that one
    late retry does not hold every later one idle), and a pool that misses most of its slots
    (it cannot run the rate) stops reserving until that share has decayed.
    """

    def __init__(self) -> None:
        self.lag, self.missed, self.at = FIRST_LAG, 0.0, _clock()

    def missed_share(self) -> float:
        return self.missed * 0.5 ** ((_clock() - self.at) / 1e9 / MISSED_HALF_LIFE)

    def seen(self, lag: float, missed: bool) -> None:
        share = self.missed_share()
        self.missed = share + SEEN_WEIGHT * (missed - share)
        self.lag += SEEN_WEIGHT * (max(lag, 0.0) - self.lag)
        self.at = _clock()

    def keeps(self, schedule: float) -> bool:
        """Slots of ``schedule`` seconds of ops are worth reserving: long enough, and the pool
        has not missed most of its slots lately."""
        return schedule >= MIN_SLOT and self.missed_share() <= MISSED_SHARE

    def lead(self, schedule: float) -> float:
        """Seconds a countdown lands ahead of a slot of ``schedule`` seconds of ops."""
        return min(self.lag, MAX_LEAD, LEAD_OPS * schedule)


#: The clock of reservation headers (ns) and the sleep of a run back early: this host's.
_clock = time.monotonic_ns
_sleep = time.sleep
_POOL = _Pool()


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


#: What a task without a reservation header of its own carries: no run, no slot, no misses.
_NO_HEADER = (-1, 0, 0, 0)


def _decimal(word: str) -> bool:
    """``word`` is a whole number in ASCII digits, as this module writes them."""
    return word.isascii() and word.isdecimal()


def _header(request: Any, owner: str) -> Tuple[int, ...]:
    """``(retries, due, landing, misses)`` of this task's reservation header, or ``_NO_HEADER``.

    ``retries``: the run it was written for (Celery copies headers onto later retries, so a
    run owns the slot only if the count is its own); ``due`` and ``landing`` (ns of this host's
    monotonic clock; 0: no slot); ``misses``: slots the task left unused so far.
    """
    value = getattr(request, HEADER, None)
    if value is None:
        value = (getattr(request, "headers", None) or {}).get(HEADER)
    if not isinstance(value, str):
        return _NO_HEADER
    parts = value.rsplit(" ", 4)
    # ASCII decimals: "²" is a digit to ``isdigit`` but no number to ``int`` (a forged header)
    if len(parts) != 5 or parts[0] != owner or not all(_decimal(p) for p in parts[1:]):
        return _NO_HEADER
    return tuple(map(int, parts[1:]))


def _schedule_ns(limiter: Any, n: int) -> float:
    """``n`` ops of the limiter's rate, in ns (its default rate for a KeyedLimiter); 50 ms for a
    limiter that does not say its rate."""
    try:
        return n * float(limiter.per) / float(limiter.rate) * 1e9
    except (AttributeError, TypeError, ValueError, ZeroDivisionError):
        return 50e6


def _reserve(limiter: Any, args: tuple, n: int, within: float) -> Optional[float]:
    """Seconds until a slot reserved now for ``n`` ops is due, or None (none within ``within``
    seconds, or a limiter that reserves nothing: hierarchical, capped without room, keyed of
    several rates)."""
    try:
        due = limiter.reserve(*args, n, max_wait=within)
    except ValueError:  # hierarchical: its tokens come from leases, at no known time (and the
        # UnsupportedError, a ValueError, of a kind that cannot promise one slot)
        return None
    return due if due is not None and math.isfinite(due) else None


def _check_limiter(limiter: Any, keyed: bool) -> None:
    """A limiter (``Limiter``, ``KeyedLimiter``, ``RedisLimiter``, ``RedisKeyedLimiter``) and
    ``key=`` given exactly for a keyed one (any keyed kind)."""
    if not all(
        callable(getattr(limiter, a, None))
        for a in ("try_acquire", "acquire", "retry_after", "reserve")
    ):
        raise TypeError(
            f"limiter must be a shmlimit Limiter, KeyedLimiter or RedisLimiter, got {type(limiter).__name__}"
        )
    if keyed != isinstance(limiter, Keyed):
        raise TypeError(
            f"key is needed with a keyed limiter (it picks each run's key), and only with one; "
            f"got {'a key' if keyed else 'no key'} for a {type(limiter).__name__}"
        )


def _check(n: int, max_block: float, max_countdown: float, max_retries: Optional[int]) -> None:
    if not is_int(n, 1):
        raise ValueError(f"n must be an int >= 1, got {n!r}")
    if not (is_number(max_block) and 0 <= max_block < math.inf):
        raise ValueError(f"max_block must be a finite number of seconds >= 0, got {max_block!r}")
    if not (is_number(max_countdown) and 0 < max_countdown < math.inf):
        raise ValueError(
            f"max_countdown must be a finite number of seconds > 0, got {max_countdown!r}"
        )
    if max_retries is not None and not is_int(max_retries, 0):
        raise ValueError(f"max_retries must be None (no limit) or an int >= 0, got {max_retries!r}")


def _check_throttling(throttling: Any, limiter: Any) -> Tuple[Type[BaseException], ...]:
    if not isinstance(throttling, tuple) or not all(
        isinstance(t, type) and issubclass(t, BaseException) for t in throttling
    ):
        raise TypeError(f"throttling must be a tuple of exception classes, got {throttling!r}")
    if throttling and not getattr(limiter, "adaptive", False):
        raise ValueError(
            "throttling reports outcomes to an adaptive limiter: create it with adapt="
        )
    return throttling


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
    returns then, taking nothing more).  With no slot within ``max_countdown``
    seconds it comes back after about ``retry_after`` (see ``countdown``) to
    look again.  With ``max_block`` > 0, a wait that short is waited out in
    the slot instead.  ``key`` is the key of a ``KeyedLimiter``.  A task called
    directly (not by a worker) simply waits for its ops.  ``task`` must be a
    bound task's ``self`` (TypeError otherwise, saying what to write).
    """
    _check(n, max_block, max_countdown, max_retries)
    _check_limiter(limiter, key is not None)
    request = _check_task(task)
    args = () if key is None else (key,)
    owner = _owner(limiter, key, n)
    retries = request.retries or 0
    written_for, due, landing, misses = _header(request, owner)
    schedule = _schedule_ns(limiter, n) / 1e9
    now = _clock()
    # this run owns a slot: one reserved within max_countdown, so one due later was never
    # reserved (a forged header would hold the worker slot asleep until it)
    if written_for == retries and 0 < due <= now + max_countdown * 1e9:
        late = (now - due) / 1e9 > schedule
        _POOL.seen((now - landing) / 1e9, late)
        if now < due:  # back early: the slot's own time (both on this host's monotonic clock)
            _sleep((due - now) / 1e9)
        if not late:  # (a run back early is never late)
            return
        # Run later than one op's schedule, the slot's op would run beside the ops due now (a
        # pool that fell behind runs what it missed at once): it stays unused (time lost, never
        # a burst), and this run asks afresh.  A task reserves at most MAX_SLOTS slots.
        misses += 1
    if limiter.try_acquire(*args, n):
        return
    if getattr(request, "called_directly", False):  # no worker to retry with: wait, as a call would
        limiter.acquire(*args, n)
        return
    if max_block > 0 and limiter.acquire(*args, n, timeout=max_block):
        return
    limit = sys.maxsize if max_retries is None else max_retries
    keeps = misses < MAX_SLOTS and _POOL.keeps(schedule)
    wait = _reserve(limiter, args, n, max_countdown) if keeps else None
    if wait == 0.0:  # the slot reserved is due now (an op came free meanwhile): run
        return
    due = landing = 0  # no slot: the retry looks again, the misses going on with the task
    if wait is not None:  # the slot is ours: one retry, landing the pool's lag before it
        lead = min(_POOL.lead(schedule), wait)
        due = _clock() + int(wait * 1e9)
        landing = due - int(lead * 1e9)
        after = wait - lead
    else:
        wait = limiter.retry_after(*args, n)
        if not math.isfinite(wait):  # stopped: look again in a while
            wait = max_countdown
        after = countdown(wait, retries, max_countdown)
    slot = f"{owner} {retries + 1} {due} {landing} {misses}"
    headers = {**(getattr(request, "headers", None) or {}), HEADER: slot}
    raise task.retry(countdown=after, max_retries=limit, headers=headers)


def rate_limited(
    limiter: Any,
    n: int = 1,
    *,
    key: Optional[Callable[..., str]] = None,
    max_block: float = 0.0,
    max_countdown: float = 60.0,
    max_retries: Optional[int] = None,
    throttling: Tuple[Type[BaseException], ...] = (),
) -> Callable[[F], F]:
    """Decorate a bound task's function (under ``@app.task(bind=True)``): each run first takes ``n`` ops.

    ``key(*args, **kwargs)`` picks the key of a ``KeyedLimiter`` from the
    task's arguments.  ``throttling``: the exceptions that mean the upstream
    refused for its rate, reported to an adaptive limiter (``adapt=``) as
    ``feedback(throttled=True)``; a run that returns reports ``throttled=False``.
    The other parameters are those of ``acquire_or_retry``.
    """
    _check(n, max_block, max_countdown, max_retries)
    if key is not None and not callable(key):
        raise TypeError(f"key must be a callable taking the task's arguments, got {key!r}")
    _check_limiter(limiter, key is not None)
    throttling = _check_throttling(throttling, limiter)

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
            k = None if key is None else key(*args, **kwargs)
            acquire_or_retry(
                self,
                limiter,
                n,
                key=k,
                max_block=max_block,
                max_countdown=max_countdown,
                max_retries=max_retries,
            )
            if not throttling:
                return fn(self, *args, **kwargs)
            told = () if k is None else (k,)
            try:
                result = fn(self, *args, **kwargs)
            except throttling:
                tell(limiter, True, *told)
                raise
            tell(limiter, False, *told)
            return result

        run.limiter = limiter  # type: ignore[attr-defined]
        return run  # type: ignore[return-value]

    return decorate
