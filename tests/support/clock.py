"""The one injected clock of the test suite."""
from __future__ import annotations


class FakeClock:
    """A clock in integer nanoseconds that moves only when the test moves it.

    Pass it wherever shmlimit takes a ``clock`` (CLOCK_MONOTONIC ns), or
    monkeypatch it over ``time.time_ns`` for code that reads the wall clock.
    """

    def __init__(self, start_ns: int = 10**12) -> None:
        self.now = start_ns
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
