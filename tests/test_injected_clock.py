"""An injected clock decides alone, wherever it stands against the real one.

``Limiter(clock=...)`` drives every schedule from the caller's clock.  A gate that counted the
time since ``REPL_TS`` (written from the injected clock) on the real clock saw no time at all
when the injected clock ran ahead of the real one, and refused a try that the injected clock's
schedule granted.  The tests' own clocks start at 1000 s, so this showed only on a machine up for
less than that (a fresh CI machine); here the clock is put far ahead of the real one, and behind
it, whatever the uptime.  The gates still decide on an injected clock, at its reading
(``attachment.on_clock``): the state machines drive the native fast path, not only the slow one.
"""

import time

import pytest
from support.clock import FakeClock

import shmlimit
from shmlimit import limiter as limiter_module
from shmlimit import multirate as multirate_module
from shmlimit.attachment import OnClock
from shmlimit.shm.cells import selected_backend

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
    """10/s (burst one) and 20/min (burst two) together, tried every 10 ms for 7 s: two grants 0.1 s
    apart (the slow rate's burst), then one more each time the slow rate refilled an op, 3 s apart.
    The gate refuses on the injected clock without replenishing, so the first replenish after the
    drain may add nothing (its interval began with the bucket full: the clamp), and the third
    grant may come a whole op later (6 s); never sooner than 3 s."""
    clock = FakeClock(time.monotonic_ns() + offset_ns)
    lim = shmlimit.Limiter(name, rates={"fast": ("10/s", 1), "slow": ("20/min", 2)}, clock=clock)
    try:
        times = _grant_times(clock, [lim.try_acquire], 7.0)
        assert 3 <= len(times) <= 4 and times[0] == 0, times
        assert 0.1 - 1e-9 <= times[1] <= 0.5, times
        assert 3.0 - 1e-9 <= times[2] <= 6.5, times
        assert all(b - a >= 3.0 - 1e-9 for a, b in zip(times[1:], times[2:])), times
    finally:
        lim.close()


def _counting(monkeypatch, module, attr):
    """Count the calls of ``module.attr`` (the slow path) in the list returned."""
    calls = []
    real = getattr(module, attr)

    def counted(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, attr, counted)
    return calls


def _native_gate(call):
    """The gate a fast path's call was bound to: native on the native backend."""
    assert type(call) is OnClock, call  # (the real clock's calls are the gate's own methods)
    return type(call.call.__self__).__module__ == "shmlimit.shm._native"


@pytest.mark.parametrize("offset_ns", OFFSETS, ids=["ahead", "behind"])
def test_the_gate_refuses_on_an_injected_clock_without_the_slow_path(name, monkeypatch, offset_ns):
    """Drained at 10/s (burst one): the tries and timed acquires of the next 0.1 s are refused by
    the gate at the injected clock's reading (on the native backend, in C), never by the slow
    path; once the op has accrued the gate is undecided and the slow path replenishes (it may
    add nothing: that interval began with the bucket full, the clamp), and grants it by 0.2 s."""
    clock = FakeClock(time.monotonic_ns() + offset_ns)
    lim = shmlimit.Limiter(name, rate=10, burst=1, clock=clock)
    try:
        assert lim.try_acquire()  # the first use: registered, the fast paths bound
        att = lim._live()
        assert (
            _native_gate(att.fast[1])
            == _native_gate(att.fast[2])
            == (selected_backend() == "native")
        )
        tries = _counting(monkeypatch, limiter_module.acquisition, "try_acquire")
        acquires = _counting(monkeypatch, limiter_module, "drive")
        for _ in range(9):
            clock.advance(10_000_000)
            assert lim.try_acquire() is False
            assert lim.acquire(timeout=0) is False
        assert tries == [] and acquires == []
        clock.advance(10_000_000)
        lim.try_acquire()
        assert len(tries) == 1
        clock.advance(100_000_000)
        assert lim.try_acquire() is True
    finally:
        lim.close()


def test_the_multi_gate_refuses_on_an_injected_clock_without_the_slow_path(name, monkeypatch):
    """Two rates on one injected clock: a try the slower one cannot grant before its next op is
    refused by the gates over both (native on the native backend), never by the slow path."""
    clock = FakeClock()
    lim = shmlimit.Limiter(name, rates={"fast": ("10/s", 1), "slow": ("20/min", 1)}, clock=clock)
    try:
        assert lim.try_acquire()
        native = selected_backend() == "native"
        assert _native_gate(lim._fast) == _native_gate(lim._fast_ops) == native
        slow = _counting(monkeypatch, multirate_module, "take_all")
        for _ in range(20):
            clock.advance(100_000_000)
            assert lim.try_acquire() is False
            assert lim.try_acquire(fast=1, slow=1) is False
        assert slow == []
    finally:
        lim.close()
