"""Watching an event loop from inside: is it free while a call waits?"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Callable, Optional

from .starvation import run_delay


class LoopTicker:
    """``async with LoopTicker() as t:`` counts how often a task that sleeps ``every`` seconds got
    to run meanwhile (``t.ticks``).  A call that blocks the loop stops the count; a loop left
    free ticks about once per ``every`` -- while the machine lets this process run.

    It also times itself (``t.seconds``, its own lifetime) and takes the starvation witness over
    that time (``t.withheld``: the seconds this process's threads waited runnable for a CPU, plus
    the hypervisor's steal; ``support.starvation``).  A loop kept off the CPU cannot tick, and
    ``assert_free`` expects the ticks of the time the process was given.  A loop blocked in a
    sleeping call is not runnable meanwhile, so ``withheld`` never excuses it; on a quiet machine
    ``withheld`` is ~0 and the bound is the whole lifetime's.
    """

    def __init__(self, every: float = 0.005) -> None:
        self.every = every
        self.ticks = 0
        self.seconds = 0.0
        self.withheld = 0.0
        self._stop = False
        self._task: Optional[asyncio.Future] = None
        self._t0 = 0.0
        self._delay0: Optional[float] = None

    async def _run(self) -> None:
        while not self._stop:
            self.ticks += 1
            await asyncio.sleep(self.every)

    async def __aenter__(self) -> "LoopTicker":
        self._delay0 = run_delay()
        self._t0 = time.monotonic()
        self._task = asyncio.ensure_future(self._run())
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self._stop = True
        assert self._task is not None
        await self._task
        self.seconds = time.monotonic() - self._t0
        delay1 = run_delay()
        if self._delay0 is not None and delay1 is not None:
            self.withheld = max(0.0, delay1 - self._delay0)

    def assert_free(self, share: float) -> None:
        """At least ``share`` of the ticks a free loop makes in the time the machine gave this
        process (its lifetime less ``withheld``); on a quiet machine, of its whole lifetime."""
        given = max(0.0, self.seconds - self.withheld)
        low = share * given / self.every
        assert self.ticks >= low, (
            f"{self.ticks} ticks in {self.seconds:.3f} s (less {self.withheld:.3f} s the machine withheld): "
            f"fewer than {low:.1f}, the loop was blocked"
        )


async def until(predicate: Callable[[], Any], timeout: float = 10.0, every: float = 0.001) -> Any:
    """``support.procs.wait_for`` on the running loop: poll ``predicate`` between awaits until it
    holds (returning its value), so that the tasks it waits for run meanwhile; fail after ``timeout`` s."""
    end = time.monotonic() + timeout
    while True:
        v = predicate()
        if v:
            return v
        if time.monotonic() > end:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(every)
