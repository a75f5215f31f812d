"""The one injected clock of the test suite."""

from __future__ import annotations

import time
from typing import Optional


class FakeClock:
    """A clock in integer nanoseconds that moves only when the test moves it.

    Pass it wherever shmlimit takes a ``clock`` (CLOCK_MONOTONIC ns), or
    monkeypatch it over ``time.time_ns`` for code that reads the wall clock.

    By default it starts 1000 s ahead of the real CLOCK_MONOTONIC, on every machine: code that
    mixes in a real clock reading where the injected clock should decide then fails everywhere,
    not only on a machine up for less than the fixed start that was used before (1000 s: a
    fresh CI machine).  It starts on a whole second, as the fixed start did: tests that compare
    instants stored at a coarser resolution (a lease record's milliseconds) see the same phase.
    """

    def __init__(self, start_ns: Optional[int] = None) -> None:
        self.now = (time.monotonic_ns() // 10**9 + 1000) * 10**9 if start_ns is None else start_ns
        #: ns the clock moves on before each reading (0: still): a real clock moves between two
        #: readings.  The last reading is always ``now``.
        self.tick_ns = 0

    def __call__(self) -> int:
        self.now += self.tick_ns
        return self.now

    def advance(self, ns: int) -> None:
        """Move the clock ``ns`` nanoseconds forward."""
        if ns < 0:
            raise ValueError(f"a clock never goes back: advance({ns})")
        self.now += ns

    def advance_seconds(self, seconds: float) -> None:
        """Move the clock ``seconds`` forward (rounded to the nanosecond)."""
        self.advance(int(round(seconds * 1e9)))
