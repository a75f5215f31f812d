"""The one sync and one async driver: every kind's acquire is a step object that never blocks.

A step object (``Steps``) answers ``begin()`` and then each ``next()`` with True (granted), False
(refused) or a step to park on before asking again; ``end()`` follows, whatever happened.  The
drivers only park: ``drive`` in this thread, ``drive_async`` on the event loop, so each kind's
decisions are made once, in its steps, for both.  They run ``acquire.single.Request`` (one rate),
``acquire.multi.MultiRequest`` (several), ``keyed.limiter._Due`` and ``keyed.multi._Tries``
(keyed) and ``redis.direct._Call`` (a call to Redis, whose steps may name a round trip).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Callable, Optional, Protocol, Union

from shmlimit.acquire.sleep import sleep_until_async, sleeper, wakes
from shmlimit.config import NS_PER_S

#: A nap is never shorter than this, unless a turn is due sooner (seconds).
MIN_NAP = 1e-4

#: True (granted), False (refused), or seconds to park (a step object may name other things).
Step = Union[bool, float]


class Steps(Protocol):
    """What the drivers run (this module's docstring names them).

    A wait for a turn sets ``wake_ns``.  One may also have ``nap(step)`` and ``async
    nap_async(step)``: how the drivers pass any other step (``time.sleep``; in tests on an injected
    clock, a move of that clock).  Such a step need not be seconds: a Redis call's may name a round
    trip, which its ``nap`` makes, keeping the answer for ``next``."""

    #: the current nap ends at this CLOCK_MONOTONIC instant, to sleep to precisely (None: roughly)
    wake_ns: Optional[int]

    def clock(self) -> int: ...
    def begin(self) -> Any: ...
    def next(self) -> Any: ...
    def end(self) -> None: ...
    def wait_native(self) -> Optional[Step]: ...


def drive(req: Steps) -> bool:
    """Run ``req`` to its end in this thread, sleeping between steps.

    A wait for a turn (``wake_ns`` set) is the request's native wait when it
    has one (``Request.wait_native``: the whole wait without returning to
    Python), else a sleep to its instant with a low timer slack
    (``sleep.sleep_until``), which a skip of a range given back ends (``sleep.wake_waiters``);
    every other step is its ``nap``, or sleeps.
    """
    try:
        seen = wakes()  # before the step looks at the head: a skip after it ends the sleep
        step = req.begin()
        while step is not True and step is not False:
            if req.wake_ns is not None:
                native = req.wait_native()
                if native is not None:
                    step = native
                    continue
                sleep_until()(req.wake_ns, seen)
            else:
                getattr(req, "nap", time.sleep)(step)
            seen = wakes()
            step = req.next()
        return step
    finally:
        req.end()


async def drive_async(req: Steps) -> bool:
    """Run ``req`` to its end on the event loop, awaiting between steps (never spinning).

    A wait for a turn (``wake_ns`` set) awaits that instant on the loop's timerfd
    (``sleep.sleep_until_async``): ``asyncio.sleep`` would end up to a millisecond
    late, the selector's timeout being whole milliseconds.  With an injected
    clock it is ``asyncio.sleep`` of the time left, as is every other nap.
    """
    att = getattr(req, "att", None)  # a Request's; a MultiRequest's clock is its attachments'
    real = (att.clock if att is not None else req.clock) is time.monotonic_ns
    try:
        step = req.begin()
        while step is not True and step is not False:
            if getattr(req, "fed", None) is not None:  # no futex on a loop: the fed wait's estimate
                req.fed = None  # type: ignore[attr-defined]
                await asyncio.sleep(max(step, MIN_NAP))
            elif req.wake_ns is not None and real:
                await sleep_until_async(req.wake_ns)  # to its instant, not the selector's next ms
            elif req.wake_ns is not None:
                await asyncio.sleep(max(0, req.wake_ns - req.clock()) / NS_PER_S)
            else:
                nap = getattr(req, "nap_async", None)
                await (asyncio.sleep(max(step, MIN_NAP)) if nap is None else nap(step))
            step = req.next()
        return step
    finally:
        req.end()


_sleeper: list = []


def sleep_until() -> Callable[[int, Optional[int]], None]:
    """This process's precise sleeper (chosen once: the backend does not change in a process)."""
    if not _sleeper:
        _sleeper.append(sleeper())
    return _sleeper[0]
