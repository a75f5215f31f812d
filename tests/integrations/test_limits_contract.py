"""The ``limits`` storage contract, run against ``shm://`` and ``async+shm://`` beside ``limits``' own
reference storage (``memory://``, ``async+memory://``): the same calls, the same answers.

``limits`` does not ship its test-suite in its wheel, so this is the contract its storage tests
check, written against its public API (``limits.storage``, ``limits.strategies``,
``limits.aio.strategies``): counts and amounts, expiries, clear and reset, health checks, errors
wrapped on request, and the fixed-window, sliding-window-counter and moving-window strategies'
answers (hit, test, cost, window stats, clear).  ``limits``' own tests, from its source
distribution, run against ``shm://`` too: ``tools/limits_suite.py`` (in CI).  Windows are long (a minute, an hour) so that the wall clock
never crosses one during a test; what happens when windows end is checked on ``shm://`` with an
injected clock, where it can be made to happen at an exact instant.
"""

import asyncio
import inspect
import time

import pytest

pytest.importorskip("limits")
from limits import RateLimitItemPerHour, RateLimitItemPerMinute, parse, storage, strategies  # noqa: E402
from limits.aio import strategies as aio_strategies  # noqa: E402
from limits.errors import StorageError  # noqa: E402
from support.clock import FakeClock  # noqa: E402

import shmlimit  # noqa: E402
import shmlimit.integrations.limits  # noqa: E402,F401  (registers shm:// and async+shm://)

# run once in CI: the limits storage contract; the windows are tests/test_window_*.py's
pytestmark = pytest.mark.backend_independent

SCHEMES = ["memory", "shm", "async+memory", "async+shm"]


def run(value):
    """The answer of a storage or strategy call, awaited when it is a coroutine (the async API)."""
    return asyncio.run(value) if inspect.isawaitable(value) else value


class Subject:
    """One storage of a scheme, with the strategies of its API (sync or ``limits.aio``)."""

    def __init__(self, scheme, name, **options):
        self.scheme = scheme
        if scheme.endswith("shm"):
            self.store = storage.storage_from_string(
                f"{scheme}://{name}", **{"keys": 4096, **options}
            )
        else:
            self.store = storage.storage_from_string(f"{scheme}://", **options)
        api = aio_strategies if scheme.startswith("async+") else strategies
        self.fixed = api.FixedWindowRateLimiter(self.store)
        self.sliding = api.SlidingWindowCounterRateLimiter(self.store)
        self.moving = api.MovingWindowRateLimiter(self.store)

    def __call__(self, method, *args, **kwargs):
        return run(getattr(self.store, method)(*args, **kwargs))

    def close(self):
        if hasattr(self.store, "table"):
            self.store.table.close()


@pytest.fixture(params=SCHEMES)
def subject(request, name):
    s = Subject(request.param, name)
    yield s
    s.close()


def test_counts_add_the_amount_and_start_from_zero(subject):
    assert subject("get", "k") == 0
    assert subject("incr", "k", 60) == 1
    assert subject("incr", "k", 60, amount=10) == 11
    assert subject("get", "k") == 11 and subject("get", "other") == 0


def test_a_hit_of_cost_0_starts_no_window_the_next_paid_hit_does(subject):
    """``limits``' storages restart a window whenever its count equals the amount added, so the
    window a hit of cost 0 started on an empty key restarts at the next paid hit; ``shm://`` kept
    the cost-0 hit's window (here an hour's), and its end came at a time ``limits`` never gives."""
    assert subject("incr", "k", 3600, amount=0) == 0 and subject("get", "k") == 0
    assert subject("incr", "k", 60) == 1
    assert subject("get_expiry", "k") <= time.time() + 60.5
    assert subject("incr", "k", 3600, amount=0) == 1  # a live window: its count, unchanged
    assert subject("get", "k") == 1 and subject("get_expiry", "k") <= time.time() + 60.5


def test_expiry_is_the_end_of_the_window(subject):
    before = time.time()
    assert subject("get_expiry", "k") <= time.time() + 0.01  # no window: now
    subject("incr", "k", 60)
    exp = subject("get_expiry", "k")
    assert (
        before + 60 - 0.01 <= exp <= time.time() + 60 + 0.01
    )  # (shm's window is 1 ms longer: never shorter)


def test_clear_forgets_one_key(subject):
    subject("incr", "k", 60, amount=3)
    subject("incr", "j", 60)
    subject("clear", "k")
    assert subject("get", "k") == 0 and subject("get", "j") == 1
    assert subject("incr", "k", 60) == 1


def test_reset_forgets_every_key_of_every_namespace_and_counts_them(subject):
    a, b = RateLimitItemPerMinute(10), RateLimitItemPerMinute(10, namespace="OTHER")
    for i in range(10):
        subject("incr", a.key_for(str(i)), a.get_expiry())
        subject("incr", b.key_for(str(i)), b.get_expiry())
    assert subject("reset") == 20
    assert all(subject("get", a.key_for(str(i))) == 0 for i in range(10))


def test_check_says_healthy(subject):
    assert subject("check") is True


def test_fixed_window_hit_test_and_stats(subject):
    item = RateLimitItemPerHour(10)
    stats = run(subject.fixed.get_window_stats(item))
    assert (
        stats.remaining == 10 and stats.reset_time <= time.time() + 0.01
    )  # no window yet: resets now
    assert all([run(subject.fixed.hit(item)) for _ in range(10)])
    assert not run(subject.fixed.hit(item)) and not run(subject.fixed.test(item))
    stats = run(subject.fixed.get_window_stats(item))
    assert stats.remaining == 0 and time.time() < stats.reset_time <= time.time() + 3600 + 0.01
    run(subject.fixed.clear(item))
    assert (
        run(subject.fixed.test(item)) and run(subject.fixed.get_window_stats(item)).remaining == 10
    )


def test_fixed_window_costs(subject):
    item = RateLimitItemPerMinute(10)
    assert not run(subject.fixed.hit(item, "k1", cost=11))
    assert run(subject.fixed.hit(item, "k2", cost=5))
    assert run(subject.fixed.get_window_stats(item, "k2")).remaining == 5
    assert run(subject.fixed.test(item, "k2", cost=5)) and not run(
        subject.fixed.test(item, "k2", cost=6)
    )
    # a refused hit of a fixed window is counted all the same (limits increments, then compares)
    assert not run(subject.fixed.hit(item, "k2", cost=6))
    assert (
        run(subject.fixed.get_window_stats(item, "k2")).remaining == 0
        and subject("get", item.key_for("k2")) == 11
    )


def test_test_takes_nothing(subject):
    item = RateLimitItemPerHour(2)
    for limiter in (subject.fixed, subject.sliding):
        assert run(limiter.hit(item, "t")) and run(limiter.test(item, "t"))
        assert run(limiter.hit(item, "t")) and not run(limiter.test(item, "t"))
        assert not run(limiter.hit(item, "t"))


def test_sliding_window_counter_hit_costs_stats_and_clear(subject):
    item = parse("10/hour")
    assert run(subject.sliding.get_window_stats(item, "s")).remaining == 10
    assert [run(subject.sliding.hit(item, "s", cost=3)) for _ in range(4)] == [
        True,
        True,
        True,
        False,
    ]
    stats = run(subject.sliding.get_window_stats(item, "s"))
    assert stats.remaining == 1 and time.time() < stats.reset_time <= time.time() + 3600 + 0.01
    assert not run(subject.sliding.test(item, "s", cost=2)) and run(subject.sliding.test(item, "s"))
    assert not run(subject.sliding.hit(item, "s", cost=11))
    run(subject.sliding.clear(item, "s"))
    assert run(subject.sliding.get_window_stats(item, "s")).remaining == 10
    assert run(subject.sliding.hit(item, "s", cost=10))


def test_sliding_window_of_an_unknown_key_is_empty(subject):
    prev, prev_ttl, cur, cur_ttl = subject("get_sliding_window", "nobody", 60)
    assert (prev, prev_ttl, cur) == (0, 0, 0) and 60 <= cur_ttl <= 120 + 0.01


def test_moving_window_hit_costs_stats_and_clear(subject):
    """limits' own moving-window cases (TestMovingWindow) within one long window."""
    item = RateLimitItemPerMinute(10)
    before = time.time()
    stats = run(subject.moving.get_window_stats(item, "m"))
    # a minute from the call, read around it: however long the call took on a busy machine
    assert stats.remaining == 10 and before - 0.05 + 60 <= stats.reset_time <= time.time() + 60.05
    assert not run(subject.moving.hit(item, "m", cost=11))
    assert run(subject.moving.hit(item, "m", cost=5))
    before = time.time()
    assert all([run(subject.moving.hit(item, "m")) for _ in range(4)])
    assert not run(subject.moving.test(item, "m", cost=2))
    assert not run(subject.moving.hit(item, "m", cost=2))
    assert run(subject.moving.test(item, "m")) and run(subject.moving.hit(item, "m"))
    assert not run(subject.moving.hit(item, "m"))
    stats = run(subject.moving.get_window_stats(item, "m"))
    # the window resets a minute after its oldest hit (the first, of cost 5)
    assert stats.remaining == 0 and before - 0.05 + 60 <= stats.reset_time <= time.time() + 60
    assert subject("get_moving_window", item.key_for("m"), 10, 60)[1] == 10
    run(subject.moving.clear(item, "m"))
    assert run(subject.moving.get_window_stats(item, "m")).remaining == 10
    assert run(subject.moving.hit(item, "m", cost=10)) and not run(subject.moving.test(item, "m"))
    huge = parse("1000000 per 2 seconds")
    assert run(subject.moving.hit(huge, "h")) and run(subject.moving.hit(huge, "h", cost=999_999))
    assert run(subject.moving.get_window_stats(huge, "h")).remaining == 0


def test_moving_window_entries_and_expiry(subject):
    """The storage calls of limits' moving-window tests (the end of a window: on an injected clock
    in test_window_moving)."""
    assert not subject("acquire_entry", "e", 10, 60, amount=11)
    assert subject("acquire_entry", "e", 10, 60, amount=1)
    assert not subject("acquire_entry", "e", 10, 60, amount=10)
    assert subject("acquire_entry", "e", 10, 60, amount=9)
    assert subject("get_moving_window", "e", 10, 60)[1] == 10
    assert subject("get_moving_window", "nobody", 10, 60)[1] == 0


@pytest.mark.parametrize("scheme", ["shm", "async+shm"])
def test_moving_window_limit_above_the_bound_is_refused_by_name(scheme, name):
    from shmlimit.keyed.windows import MOVING_MAX

    s = Subject(scheme, name)
    try:
        with pytest.raises(ValueError, match="limit must be an int from 0 to 1048575"):
            s("acquire_entry", "k", MOVING_MAX + 1, 60)
        assert s("acquire_entry", "k", MOVING_MAX, 60, amount=MOVING_MAX)
    finally:
        s.close()


# ---- errors ---------------------------------------------------------------------------------


@pytest.mark.parametrize("scheme", ["shm", "async+shm"])
@pytest.mark.parametrize("wrap", [True, False])
def test_storage_errors_are_wrapped_on_request_and_change_nothing(scheme, wrap, name):
    s = Subject(scheme, name, keys=32, wrap_exceptions=wrap, when_full="refuse")
    try:
        counted = 0
        with pytest.raises(StorageError if wrap else shmlimit.KeyTableFullError) as e:
            for i in range(64):  # more keys than slots, each in a live window: the table fills
                s("incr", f"k{i}", 600)
                counted += 1
        if wrap:
            assert isinstance(e.value.storage_error, shmlimit.KeyTableFullError)
        assert 16 <= counted < 64
        assert [s("get", f"k{i}") for i in range(counted)] == [
            1
        ] * counted  # the refusal touched nothing
    finally:
        s.close()


# ---- windows ending, at exact instants (an injected clock: shm only) ------------------------


@pytest.fixture(params=["shm", "async+shm"])
def timed(request, name):
    clock = FakeClock(3600 * 10**9 * 1000)  # on a boundary of every window length
    s = Subject(request.param, name, clock=clock)
    s.clock = clock
    yield s
    s.close()


def test_a_fixed_window_ends_and_the_next_starts_empty(timed):
    item = RateLimitItemPerMinute(2)
    assert (
        run(timed.fixed.hit(item)) and run(timed.fixed.hit(item)) and not run(timed.fixed.hit(item))
    )
    timed.clock.advance_seconds(60.0)  # the window lasts 60 s and 1 ms: still counted
    assert not run(timed.fixed.hit(item))
    timed.clock.advance_seconds(0.001)
    assert timed("get", item.key_for()) == 0 and run(timed.fixed.hit(item))
    assert timed("get", item.key_for()) == 1


def test_the_sliding_window_counts_the_previous_window_by_the_time_left(timed):
    item = parse("10/10 seconds")
    assert sum(run(timed.sliding.hit(item, "k")) for _ in range(12)) == 10
    timed.clock.advance_seconds(10.0)  # the next window begins: the previous counts in full
    assert not run(timed.sliding.hit(item, "k"))
    timed.clock.advance_seconds(5.0)  # half-way: the previous counts 5
    assert sum(run(timed.sliding.hit(item, "k")) for _ in range(8)) == 5
    assert run(timed.sliding.get_window_stats(item, "k")).remaining == 0
    timed.clock.advance_seconds(5.0)  # the next window begins: the 5 hits are the previous window's
    prev, prev_ttl, cur, cur_ttl = timed("get_sliding_window", item.key_for("k"), 10)
    assert (
        (prev, cur) == (5, 0) and prev_ttl == pytest.approx(10.0) and cur_ttl == pytest.approx(20.0)
    )
    timed.clock.advance_seconds(20.0)  # two windows without a hit: the key starts afresh
    assert timed("get_sliding_window", item.key_for("k"), 10)[:3] == (0, 0, 0)
    assert sum(run(timed.sliding.hit(item, "k")) for _ in range(12)) == 10


# ---- tools/limits_suite.py: limits' wall-clock tests (its `flaky` mark) rerun once, no other ----

FLAKY_SUITE = """
import pathlib

import pytest

RUNS = pathlib.Path(__file__).with_name("runs")


def count(name):
    with RUNS.open("a") as f:
        f.write(name + "\\n")
    return RUNS.read_text().split().count(name)


@pytest.mark.flaky
def test_flaky():
    assert count("flaky") > FLAKY_FAILS


def test_plain():
    assert count("plain") > PLAIN_FAILS
"""


@pytest.mark.parametrize(
    "flaky_fails, plain_fails, status, runs",
    [
        (0, 0, 0, {"flaky": 1, "plain": 1}),  # all pass: nothing rerun
        (1, 0, 0, {"flaky": 2, "plain": 1}),  # a flaky test failed once: rerun, passes
        (2, 0, 1, {"flaky": 2, "plain": 1}),  # ... and twice: fails, never run a third time
        (0, 1, 1, {"flaky": 1, "plain": 1}),  # another failed: fails, never rerun
        (1, 1, 1, {"flaky": 2, "plain": 1}),  # ... whatever the flaky test's rerun gives
    ],
)
def test_the_limits_suite_reruns_once_only_the_tests_limits_marks_flaky(
    tmp_path, flaky_fails, plain_fails, status, runs
):
    import importlib.util
    import sys

    from support.procs import ROOT

    spec = importlib.util.spec_from_file_location("limits_suite", f"{ROOT}/tools/limits_suite.py")
    suite = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(suite)
    body = FLAKY_SUITE.replace("FLAKY_FAILS", str(flaky_fails))
    (tmp_path / "test_it.py").write_text(body.replace("PLAIN_FAILS", str(plain_fails)))
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    flaky: rerun\n")
    cmd = [sys.executable, "-m", "pytest", "-q", "test_it.py"]
    assert suite.run_with_one_rerun(cmd, cwd=tmp_path) == status
    ran = (tmp_path / "runs").read_text().split()
    assert {name: ran.count(name) for name in runs} == runs
