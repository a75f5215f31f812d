"""An injected clock decides alone, wherever it stands against the real one.

``Limiter(clock=...)`` drives every schedule from the caller's clock.  The native fast paths read
the real CLOCK_MONOTONIC, so none of them may decide for a limiter with an injected clock: a gate
that counted the time since ``REPL_TS`` (written from the injected clock) on the real clock saw
no time at all when the injected clock ran ahead of the real one, and refused a try that the
injected clock's schedule granted.  The tests' own clocks start at 1000 s, so this showed only on
a machine up for less than that (a fresh CI machine); here the clock is put far ahead of the real
one, and behind it, whatever the uptime.
"""

import time

import pytest
from support.clock import FakeClock

import shmlimit

#: far ahead of the real clock (a day), and behind it (as far as the real clock allows)
OFFSETS = [86_400 * 10**9, -min(10**12, time.monotonic_ns() // 2)]


def _grant_times(clock, calls, seconds, step_ns=10_000_000):
    """Step the clock by ``step_ns`` for ``seconds``, calling ``calls`` in turn, one per step; the
    instants (s, from the start) at which a call was granted."""
    start, times = clock.now, []
    for k in range(int(seconds * 1e9) // step_ns + 1):
        if calls[k % len(calls)]():
            times.append((clock.now - start) / 1e9)
        clock.advance(step_ns)
    return times


@pytest.mark.parametrize("offset_ns", OFFSETS, ids=["ahead", "behind"])
def test_tries_and_timed_acquires_follow_the_injected_clock(name, offset_ns):
    """10/s with a burst of one, tried every 10 ms for 1 s: a grant every 0.1 s, never sooner, and
    not much later.  (A drained bucket may lose a fill interval, and the filler thread, on the real
    clock's pace, replenishes at instants of the injected one that the test does not choose: the
    upper bound is loose.)"""
    clock = FakeClock(time.monotonic_ns() + offset_ns)
    lim = shmlimit.Limiter(name, rate=10, burst=1, clock=clock)
    try:
        times = _grant_times(clock, [lim.try_acquire, lambda: lim.acquire(timeout=0)], 1.0)
        gaps = [b - a for a, b in zip(times, times[1:])]
        assert times[0] == 0 and len(times) >= 6, times
        assert all(g >= 0.1 - 1e-9 for g in gaps), times
    finally:
        lim.close()


@pytest.mark.parametrize("offset_ns", OFFSETS, ids=["ahead", "behind"])
def test_several_rates_follow_the_injected_clock(name, offset_ns):
    """10/s (burst one) and 20/min (burst two) together, tried every 10 ms for 4 s: two grants 0.1 s
    apart (the slow rate's burst), then one more once the slow rate refilled an op (3 s; later by
    what a drained bucket and the filler thread's replenishes may lose, as above)."""
    clock = FakeClock(time.monotonic_ns() + offset_ns)
    lim = shmlimit.Limiter(name, rates={"fast": ("10/s", 1), "slow": ("20/min", 2)}, clock=clock)
    try:
        times = _grant_times(clock, [lim.try_acquire], 4.0)
        assert len(times) == 3 and times[0] == 0, times
        assert 0.1 - 1e-9 <= times[1] <= 0.5, times
        assert 3.0 - 1e-9 <= times[2], times
    finally:
        lim.close()
