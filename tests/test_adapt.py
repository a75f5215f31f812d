"""The adaptive rate: the controller's rules on a fake clock, its words in the segment, failover.

``decide`` is pure: each rule is checked on its own.  ``step`` reads and writes only the
segment, so a process that takes over (here a real other process, on the same fake instants)
continues the window its predecessor began.  Run on both backends (``SHMLIMIT_BACKEND``).
"""

import json
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from support.clock import FakeClock
from support.procs import start_idle, wait_for

import shmlimit
from shmlimit import adapt as A
from shmlimit.bucket.rovers import diff
from shmlimit.shm import layout as L

S = 10**9
ADAPT = shmlimit.Adapt(min_rate=10, max_rate=2000)


def window(throttled=0, ok=0, busy=0.0, seconds=ADAPT.window):
    """A window's counts: ``busy`` is the share of its schedule callers took."""
    return A.Window(throttled, ok, busy * seconds * S)


# ---- the option ---------------------------------------------------------------------------------


def test_defaults():
    a = shmlimit.Adapt(min_rate=10, max_rate=2000)
    assert (a.decrease, a.increase, a.window) == (0.8, 20.0, 0.25)


@pytest.mark.parametrize(
    "kwargs, param",
    [
        (dict(min_rate=0, max_rate=10), "min_rate"),
        (dict(min_rate=-1, max_rate=10), "min_rate"),
        (dict(min_rate=float("nan"), max_rate=10), "min_rate"),
        (dict(min_rate=10, max_rate=5), "max_rate"),
        (dict(min_rate=10, max_rate=float("inf")), "max_rate"),
        (dict(min_rate=1, max_rate=10, decrease=1.0), "decrease"),
        (dict(min_rate=1, max_rate=10, decrease=0), "decrease"),
        (dict(min_rate=1, max_rate=10, increase=0), "increase"),
        (dict(min_rate=1, max_rate=10, increase=float("inf")), "increase"),
        (dict(min_rate=1, max_rate=10, window=0.001), "window"),
        (dict(min_rate=1, max_rate=10, window=4000), "window"),
    ],
)
def test_bad_parameters_name_themselves(kwargs, param):
    with pytest.raises(ValueError, match=param):
        shmlimit.Adapt(**kwargs)


@pytest.mark.parametrize("param", ["min_rate", "max_rate", "decrease", "increase", "window"])
def test_parameters_must_be_numbers(param):
    kwargs = dict(min_rate=1, max_rate=10)
    kwargs[param] = "5"
    with pytest.raises(TypeError, match=param):
        shmlimit.Adapt(**kwargs)


def test_limiter_refuses_what_cannot_adapt(name):
    with pytest.raises(ValueError, match="rate must be within adapt's bounds, from 10 to 2000"):
        shmlimit.Limiter(name, rate=5000, adapt=ADAPT)
    with pytest.raises(ValueError, match="burst cannot be combined with adapt"):
        shmlimit.Limiter(name, rate=100, burst=5, adapt=ADAPT)
    with pytest.raises(TypeError, match="adapt must be a shmlimit.Adapt"):
        shmlimit.Limiter(name, rate=100, adapt={"min_rate": 1})
    with pytest.raises(ValueError, match="burst\\*per/rate must be at most"):  # min_rate's capacity
        shmlimit.Limiter(name, rate=100, adapt=shmlimit.Adapt(min_rate=1e-9, max_rate=200))
    with pytest.raises(ValueError, match="adapt is not supported with upstream="):
        shmlimit.Limiter(name, rate=100, upstream="redis://127.0.0.1:1/0", adapt=ADAPT)
    with pytest.raises(FileNotFoundError):  # nothing was created by the refused calls
        shmlimit.inspect(name)


# ---- the controller, pure -----------------------------------------------------------------------


def test_no_decision_before_the_window_ends():
    s = A.State(1000.0, 5 * S)
    assert A.decide(ADAPT, s, window(throttled=50), 5 * S + int(0.249 * S)) is s


def test_a_throttled_window_cuts_once_however_many_throttled():
    s = A.State(1000.0, 0)
    now = int(0.25 * S)
    one = A.decide(ADAPT, s, window(throttled=1, ok=100, busy=1.0), now)
    many = A.decide(ADAPT, s, window(throttled=10_000, ok=0, busy=1.0), now)
    assert one == many == A.State(800.0, now, A.CUT)


def test_a_clean_busy_window_raises():
    s = A.State(1000.0, 0)
    now = int(0.25 * S)
    assert A.decide(ADAPT, s, window(ok=10, busy=0.95), now) == A.State(1020.0, now, A.RAISE)


@pytest.mark.parametrize(
    "seen",
    [
        window(ok=10, busy=0.5),  # callers never reached the rate: it does not bind them
        window(ok=0, busy=0.0),  # an idle fleet
        window(ok=0, busy=1.0),  # busy, but nothing reported: no evidence the upstream copes
    ],
    ids=["under-used", "idle", "unreported"],
)
def test_no_increase_without_demand_and_outcomes(seen):
    s = A.State(1000.0, 0)
    now = int(0.25 * S)
    assert A.decide(ADAPT, s, seen, now) == A.State(1000.0, now, A.HOLD)


def test_an_idle_fleet_keeps_its_rate_for_ever():
    s = A.State(300.0, 0)
    for k in range(1, 1000):
        s = A.decide(ADAPT, s, window(), k * S)
    assert s.rate == 300.0


def test_the_rate_stays_within_the_bounds():
    a = shmlimit.Adapt(min_rate=100, max_rate=130, increase=20)
    s = A.State(120.0, 0)
    s = A.decide(a, s, window(ok=1, busy=1.0, seconds=1), S)
    assert s.rate == 130.0
    s = A.decide(a, s, window(ok=1, busy=1.0, seconds=1), 2 * S)
    assert s.rate == 130.0
    for k in range(3, 10):
        s = A.decide(a, s, window(throttled=1), k * S)
    assert s.rate == 100.0


def test_busy_is_measured_against_the_window_actually_elapsed():
    """A late look (the filler was away) judges the whole elapsed time, not one window."""
    s = A.State(1000.0, 0)
    late = 2 * S
    assert A.decide(ADAPT, s, window(ok=5, busy=0.95), late).verdict == A.HOLD  # 0.24 s of 2 s
    seen = A.Window(0, 5, 0.95 * late)
    assert A.decide(ADAPT, s, seen, late).verdict == A.RAISE


# ---- the segment --------------------------------------------------------------------------------


def _lim(name, clock, **kw):
    return shmlimit.Limiter(name, rate=1000, adapt=ADAPT, clock=clock, **kw)


def test_outcomes_are_counted_and_shown(name, cleanup):
    clock = FakeClock()
    lim = _lim(name, clock)
    cleanup.append(lim)
    for _ in range(3):
        lim.feedback(throttled=True)
    lim.feedback(throttled=False)
    st = shmlimit.inspect(name).adapt
    assert (st.throttled, st.ok, st.cuts, st.raises) == (3, 1, 0, 0)
    assert (st.min_rate, st.max_rate, st.window) == (10.0, 2000.0, 0.25)
    with pytest.raises(TypeError, match="throttled must be True or False"):
        lim.feedback(throttled=1)


def test_feedback_needs_adapt(name, cleanup):
    lim = shmlimit.Limiter(name, rate=10)
    cleanup.append(lim)
    with pytest.raises(ValueError, match="feedback\\(\\) needs a limiter created with adapt="):
        lim.feedback(throttled=True)
    assert lim.stats().adapt is None


def test_a_window_is_cut_once_and_published_for_every_process(name, cleanup):
    clock = FakeClock()
    lim = _lim(name, clock)
    cleanup.append(lim)
    b = lim._peek().bucket
    t0 = clock.now
    assert A.step(b, t0) == ADAPT.window  # the first look starts the first window
    for _ in range(7):
        lim.feedback(throttled=True)
    clock.advance(int(0.1 * S))
    assert A.step(b, clock.now) == pytest.approx(0.15)  # mid-window: nothing decided
    assert lim.rate == 1000.0
    clock.advance(int(0.15 * S))
    A.step(b, clock.now)
    A.step(b, clock.now)  # the window is decided: a second look decides nothing more
    assert lim.rate == 800.0 and lim.capacity == 8.0  # the capacity follows the rate
    st = lim.stats().adapt
    assert (st.cuts, st.raises) == (1, 0)
    clock.advance(int(0.25 * S))
    A.step(b, clock.now)  # a window without outcomes: the rate holds
    assert lim.rate == 800.0


def test_a_busy_clean_window_raises_and_an_idle_one_does_not(name, cleanup):
    clock = FakeClock()
    lim = _lim(name, clock, initial=0)
    cleanup.append(lim)
    b = lim._peek().bucket
    A.step(b, clock.now)
    # idle: outcomes reported, nobody took tokens
    lim.feedback(throttled=False)
    clock.advance(int(0.25 * S))
    A.step(b, clock.now)
    assert lim.rate == 1000.0
    # busy: an op tried every ms at 1000/s takes the whole schedule
    for _ in range(250):
        clock.advance(10**6)
        lim.try_acquire()
    lim.feedback(throttled=False)
    A.step(b, clock.now)
    assert lim.rate == 1020.0
    assert lim.stats().adapt.raises == 1


def test_set_rate_within_the_bounds(name, cleanup):
    clock = FakeClock()
    lim = _lim(name, clock)
    cleanup.append(lim)
    lim.set_rate(50)
    assert lim.rate == 50.0
    with pytest.raises(ValueError, match="from 10 to 2000"):
        lim.set_rate(3000)
    with pytest.raises(ValueError, match="burst cannot be set on an adaptive limiter"):
        lim.set_rate(50, burst=20)
    with pytest.raises(ValueError, match="per cannot change on an adaptive limiter"):
        lim.set_rate("50/min")
    assert lim.rate == 50.0 and lim.per == 1.0


def test_a_new_limiter_starts_from_the_learned_rate(name, cleanup):
    clock = FakeClock()
    lim = _lim(name, clock)
    cleanup.append(lim)
    lim.set_rate(321)
    again = _lim(name, clock)  # the same creating call: no mismatch, the learned rate
    cleanup.append(again)
    assert again.rate == 321.0
    with pytest.raises(shmlimit.ConfigMismatchError, match="no adaptive rate"):
        shmlimit.Limiter(name, rate=1000, clock=clock)
    other = shmlimit.Adapt(min_rate=10, max_rate=500)
    with pytest.raises(shmlimit.ConfigMismatchError, match="max_rate=500"):
        shmlimit.Limiter(name, rate=100, adapt=other, clock=clock)


def test_a_redeploy_keeps_the_learned_rate_within_its_new_bounds(name):
    """No live process: a new configuration is taken (``adopt_config``), the learned rate kept."""
    code = textwrap.dedent(
        f"""
        import shmlimit
        lim = shmlimit.Limiter({name!r}, rate=1000, adapt=shmlimit.Adapt(min_rate=10, max_rate=2000))
        lim.set_rate(700)
        """
    )
    subprocess.run([sys.executable, "-c", code], check=True)
    lim = shmlimit.Limiter(name, rate=100, adapt=shmlimit.Adapt(min_rate=10, max_rate=500))
    try:
        assert lim.rate == 500.0  # 700 learned, within the new bounds
        assert lim.stats().adapt.max_rate == 500.0
    finally:
        lim.close()


def test_hostile_parameters_are_refused(name, cleanup):
    clock = FakeClock()
    lim = _lim(name, clock)
    cleanup.append(lim)
    c = lim._peek().cells
    c.store(L.ADAPT_DECREASE, L.f2u(float("nan")))
    with pytest.raises(shmlimit.SegmentError, match="adaptive rate's parameters are not valid"):
        shmlimit.inspect(name)
    with pytest.raises(shmlimit.SegmentError):
        A.step(lim._peek().bucket, clock.now)
    assert lim.rate == 1000.0


SUCCESSOR = """
import sys
import shmlimit
from shmlimit import adapt
name, now = sys.argv[1], int(sys.argv[2])
lim = shmlimit.Limiter(name, clock=lambda: now)  # attached by name: no filler thread runs
adapt.step(lim._peek().bucket, now)
print(lim.rate)
"""


def test_a_successor_continues_the_window_its_predecessor_began(name, cleanup):
    """The filler that began the window stops mid-window; another process's filler decides it from
    the segment alone (the window's start and its counts), once."""
    clock = FakeClock()
    lim = _lim(name, clock)
    cleanup.append(lim)
    b = lim._peek().bucket
    A.step(b, clock.now)  # this process's filler begins the window ...
    clock.advance(int(0.1 * S))
    lim.feedback(throttled=True)
    A.step(b, clock.now)  # ... looks once mid-window, and is gone
    later = clock.now + int(0.2 * S)

    def successor(now):
        out = subprocess.run(
            [sys.executable, "-c", SUCCESSOR, name, str(now)],
            check=True,
            capture_output=True,
            text=True,
        )
        return float(out.stdout)

    assert successor(later) == 800.0
    assert successor(later) == 800.0  # decided once: another look at that instant cuts nothing
    assert lim.rate == 800.0 and lim.stats().adapt.cuts == 1


def test_top_and_metrics_show_the_rate_in_force(name, cleanup):
    from support.procs import run_cli as cli

    clock = FakeClock()
    lim = _lim(name, clock)
    cleanup.append(lim)
    b = lim._peek().bucket
    A.step(b, clock.now)
    lim.feedback(throttled=True)
    clock.advance(int(0.25 * S))
    A.step(b, clock.now)  # cut: 800
    r = cli("top", name, "--once", "--json", "--interval", "0.1")
    [rec] = json.loads(r.stdout)["limiters"]
    assert rec["rate"] == 800.0
    assert (rec["adapt"]["cuts"], rec["adapt"]["throttled"]) == (1, 1)
    r = cli("metrics", name)
    assert f'shmlimit_rate_ops_per_second{{limiter="{name}"}} 800.0' in r.stdout.splitlines()


def test_grants_stay_within_the_rate_in_force_while_it_adapts(name, cleanup):
    """Cuts and raises every 50 ms for 2 s, ops tried faster than any rate, idle now and then (a
    full bucket): in every window, the tokens
    taken (each op at the price in force when it was granted) stay within ``T * tpn + capacity``,
    the bound ``set_rate`` keeps, at the largest capacity the run had."""
    clock = FakeClock()
    fast = shmlimit.Adapt(min_rate=100, max_rate=2000, increase=300, window=0.05)
    lim = shmlimit.Limiter(name, rate=1000, adapt=fast, clock=clock, initial=0)
    cleanup.append(lim)
    att = lim._peek()
    b, c = att.bucket, att.cells
    A.step(b, clock.now)
    grants, caps, rates = [], set(), set()
    for k in range(4000):
        clock.advance(500_000)
        for _ in range(3 if k % 300 >= 40 else 0):  # up to 6000/s, idle 20 ms in every 150
            before = c.load(L.TAIL)
            if not lim.try_acquire():
                break
            grants.append((clock.now, diff(c.load(L.TAIL), before)))
        lim.feedback(throttled=(k // 300) % 2 == 1)  # 150 ms throttled, 150 ms not, in turn
        A.step(b, clock.now)
        b.refresh()
        caps.add(b.cap)
        rates.add(b.config.rate)
    st = lim.stats().adapt
    assert st.cuts >= 5 and st.raises >= 5 and len(rates) >= 8, (st, sorted(rates))
    # the largest (tokens in [t_i, t_j]) - (t_j - t_i) * tpn over every pair i <= j, in one pass
    worst, best_start, taken = -(1 << 62), -(1 << 62), 0
    for t, tokens in grants:
        best_start = max(best_start, t * b.tpn - taken)
        taken += tokens
        worst = max(worst, taken - t * b.tpn + best_start)
    assert worst <= max(caps), (worst, max(caps))


@pytest.mark.slow
def test_a_killed_fillers_window_is_decided_by_its_successor(name, cleanup):
    """Real processes on the real clock: the filler that began a window is killed mid-window; the
    process that takes its lease decides that window from the segment, once."""
    slow = shmlimit.Adapt(min_rate=10, max_rate=2000, window=2.0)
    lim = shmlimit.Limiter(name, rate=1000, adapt=slow)  # registered, never used: no filler here
    cleanup.append(lim)
    cells = lim._peek().cells
    first = start_idle(name)
    wait_for(lambda: shmlimit.inspect(name).filler_pid == first.pid)
    start = wait_for(lambda: cells.load(L.ADAPT_START))
    lim.feedback(throttled=True)
    first.send_signal(signal.SIGKILL)
    first.wait()
    assert time.monotonic_ns() < start + 2 * 10**9  # it died mid-window, before deciding it
    assert lim.stats().adapt.cuts == 0
    second = start_idle(name)
    try:
        wait_for(lambda: shmlimit.inspect(name).filler_pid == second.pid)
        wait_for(lambda: lim.stats().adapt.cuts == 1, timeout=10)
        assert cells.load(L.ADAPT_START) != start and lim.rate == 800.0
        later = cells.load(L.ADAPT_START)
        wait_for(lambda: cells.load(L.ADAPT_START) != later, timeout=10)  # one window more
        assert lim.stats().adapt.cuts == 1 and lim.rate == 800.0  # nothing new: no second cut
    finally:
        second.stdin.write("\n")
        second.stdin.flush()
        second.wait(timeout=30)
