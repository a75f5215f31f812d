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
from shmlimit.acquire import single
from shmlimit.acquire.multi import take_all
from shmlimit.acquire.single import Request, drive
from shmlimit.attachment import OnClock
from shmlimit.bucket.clamp import CLAMP_WORDS
from shmlimit.shm import layout as L
from shmlimit.shm.cells import selected_backend
from shmlimit.shm.words import diff

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
    """Drained at 10/s (burst one), tried and acquired with no wait every 10 ms: refused by the gate
    at the injected clock's reading (on the native backend, in C), never by the slow path, and
    each refusal replenishes at that reading as the slow path's does.  The first replenish after
    the drain adds nothing (its interval began with the bucket full: the clamp), the others an
    op's tenth each: at 0.11 s the gate is undecided and the slow path grants the op."""
    clock = FakeClock(time.monotonic_ns() + offset_ns)
    lim = shmlimit.Limiter(name, rate=10, burst=1, clock=clock)
    try:
        att = _quiet(lim)[0]
        assert lim.try_acquire()
        assert (
            _native_gate(att.fast.try_now)
            == _native_gate(att.fast.within)
            == (selected_backend() == "native")
        )
        tries = _counting(monkeypatch, limiter_module.acquisition, "try_acquire")
        acquires = _counting(monkeypatch, limiter_module, "drive")
        for _ in range(10):
            clock.advance(10_000_000)
            assert lim.try_acquire() is False
            assert lim.acquire(timeout=0) is False
            assert att.cells.load(L.REPL_TS) == clock.now  # replenished at the reading
        assert tries == [] and acquires == []
        clock.advance(10_000_000)
        assert lim.try_acquire() is True and len(tries) == 1
    finally:
        lim.close()


def _quiet(lim):
    """``lim``'s attachments (one per rate), in use, their filler threads stopped: they replenish on
    the real clock's pace, at instants of the injected clock the test does not choose."""
    atts = lim._live()
    atts = atts if isinstance(atts, (list, tuple)) else [atts]
    for att in atts:
        att.filler.stop()
        att.filler.join(10)
    return atts


def _words(atts):
    """What a replenish leaves on each rate: the tokens in the bucket, REPL_TS, and the clamp's
    snapshot, counted from the tail (two segments' rovers need not start alike)."""
    out = []
    for att in atts:
        c = att.cells
        tail = c.load(L.TAIL)
        out.append(
            (diff(c.load(L.HEAD), tail), c.load(L.REPL_TS))
            + tuple(diff(c.load(off), tail) for off in (L.SNAP_HEAD, L.SNAP_TAIL) + CLAMP_WORDS)
        )
    return out


@pytest.mark.parametrize("step_ns", [7_000_000, 10_000_000, 33_000_000])
def test_the_gate_on_an_injected_clock_leaves_what_the_slow_path_leaves(name, monkeypatch, step_ns):
    """10/s (burst one) driven for 1.5 s on one injected clock twice: through the limiter (its
    gate's refusals at the clock's reading) and through the slow path alone.  Every answer and
    every word after it are the same: a refusal by the gate replenishes as the slow path's does.
    (Before, the gate refused without replenishing, nothing else did, and the next replenish
    clamped against a snapshot from before the drain: a one-op bucket lost a whole op's time.)"""
    clock = FakeClock()
    lim = shmlimit.Limiter(name, rate=10, burst=1, clock=clock)
    twin = shmlimit.Limiter(name + "-slow", rate=10, burst=1, clock=clock)
    try:
        (att,), (tatt,) = _quiet(lim), _quiet(twin)
        tries = _counting(monkeypatch, limiter_module.acquisition, "try_acquire")
        refusals = 0
        for k in range(int(1.5e9) // step_ns):
            if k % 3 == 2:
                got = lim.acquire(timeout=0)
                assert got == drive(Request(tatt, 1, 0.0)), k
            else:
                got = lim.try_acquire()
                assert got == single.try_acquire(tatt, 1), k
            refusals += got is False
            assert _words([att]) == _words([tatt]), k
            clock.advance(step_ns)
        ours = [a for a in tries if a[0] is att]  # (the twin's are counted too)
        assert refusals - len(ours) >= refusals / 4  # the gate's certain refusals, a fair share
    finally:
        lim.close()
        twin.close()


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


@pytest.mark.parametrize("step_ns", [7_000_000, 10_000_000])
def test_the_multi_gate_on_an_injected_clock_leaves_what_the_slow_path_leaves(
    name, monkeypatch, step_ns
):
    """100/s (burst one) and 10/s (burst two) tried for 1.5 s on one injected clock twice: through
    the limiter (its gates' refusals at the clock's reading) and through ``take_all`` alone.  Every
    answer and every rate's words after it are the same: the gates' refusal replenishes what
    ``take_all``'s does (each rate short, up to the first still short)."""
    clock = FakeClock()
    rates = {"fast": ("100/s", 1), "slow": ("10/s", 2)}
    lim = shmlimit.Limiter(name, rates=rates, clock=clock)
    twin = shmlimit.Limiter(name + "-slow", rates=rates, clock=clock)
    try:
        atts, tatts = _quiet(lim), _quiet(twin)
        slow = _counting(monkeypatch, multirate_module, "take_all")
        refusals = 0
        for k in range(int(1.5e9) // step_ns):
            ops = (1, 1) if k % 2 else (2, 1)
            got = lim.try_acquire() if k % 2 else lim.try_acquire(fast=2, slow=1)
            assert got == take_all(tatts, ops, twin._tokens(ops)), k
            refusals += got is False
            assert _words(atts) == _words(tatts), k
            clock.advance(step_ns)
        assert refusals - len(slow) >= refusals / 4  # the gates' certain refusals, a fair share
    finally:
        lim.close()
        twin.close()
