"""Watching an event loop from inside: is it free while a call waits?"""
from __future__ import annotations

import asyncio
from typing import Any, Optional


class LoopTicker:
    """``async with LoopTicker() as t:`` counts how often a task that sleeps ``every`` seconds got
    to run meanwhile (``t.ticks``).  A call that blocks the loop stops the count; a loop left
    free ticks about once per ``every``."""

    def __init__(self, every: float = 0.005) -> None:
        self.every = every
        self.ticks = 0
        self._stop = False
        self._task: Optional[asyncio.Future] = None

    async def _run(self) -> None:
        while not self._stop:
            self.ticks += 1
            await asyncio.sleep(self.every)

    async def __aenter__(self) -> "LoopTicker":
        self._task = asyncio.ensure_future(self._run())
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self._stop = True
        assert self._task is not None
        await self._task
