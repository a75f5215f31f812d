"""Rate strings "N/unit": parsed exactly, accepted wherever a rate is, refused clearly."""

import pytest
from support.clock import FakeClock
from support.procs import run_cli as run

import shmlimit
from shmlimit.config import Config, parse_rate


@pytest.mark.parametrize(
    "text, expected",
    [
        ("10/s", (10.0, 1.0)),
        ("50/5s", (50.0, 5.0)),
        ("200K/min", (200_000.0, 60.0)),
        ("5000/h", (5000.0, 3600.0)),
        ("100/minute", (100.0, 60.0)),
        ("3/sec", (3.0, 1.0)),
        ("7/second", (7.0, 1.0)),
        ("2M/m", (2_000_000.0, 60.0)),
        ("1G/hour", (1e9, 3600.0)),
        ("1/d", (1.0, 86400.0)),
        ("10/day", (10.0, 86400.0)),
        ("10/2days", (10.0, 172800.0)),
        (" 1.5k / 0.5 s ", (1500.0, 0.5)),
        ("12K", (12000.0, 1.0)),  # a bare number is per second
    ],
)
def test_rate_strings_parse_to_rate_and_window(text, expected):
    assert parse_rate(text) == expected


@pytest.mark.parametrize(
    "bad", ["10/x", "/s", "10/0s", "abc", "10/-1s", "10//s", "10/S", "inf/s", "0/s", "10/1e3s", ""]
)
def test_bad_rate_strings_name_the_parameter_and_the_forms(bad):
    with pytest.raises(ValueError) as e:
        Config.make(bad)
    assert "rate" in str(e.value)
    assert "'N/unit'" in str(e.value) or "must look like" in str(e.value) or "> 0" in str(e.value)


def test_a_rate_string_and_a_contradicting_per_are_refused():
    assert Config.make("50/5s", per=5) == Config.make(50, 5)
    with pytest.raises(ValueError, match="per given twice"):
        Config.make("50/5s", per=2)


def test_limiter_takes_rate_strings_and_the_window_binds(name):
    clock = FakeClock()
    lim = shmlimit.Limiter(name, rate="50/5s", burst=1, clock=clock)
    try:
        # the filler thread replenishes on the real clock's pace, from the injected clock: a claim of
        # it just before a try, not yet added, leaves the try nothing to claim (refused): stopped here
        lim.retry_after()
        lim._att.filler.stop()
        lim._att.filler.join(10)
        assert (lim.rate, lim.per) == (50, 5.0)
        assert lim.try_acquire() and not lim.try_acquire()
        clock.advance_seconds(0.099)  # one op per 0.1 s: never sooner
        assert not lim.try_acquire()
        clock.advance_seconds(0.101)  # (a drained one-op bucket may lose up to one fill interval)
        assert lim.try_acquire()
        assert not lim.try_acquire()
        # the string and the numbers it stands for are the same config: attaching succeeds
        same = shmlimit.Limiter(name, rate=50, per=5, burst=1, clock=clock)
        same.close()
        with pytest.raises(shmlimit.ConfigMismatchError):
            shmlimit.Limiter(name, rate="50/s", burst=1, clock=clock)
    finally:
        lim.close()


def test_set_rate_and_apply_take_rate_strings(name):
    lim = shmlimit.Limiter(name, rate=10)
    try:
        lim.set_rate("200K/min")
        assert (lim.rate, lim.per) == (200_000, 60.0)
        lim.apply("5/2s,configure")
        assert (lim.rate, lim.per) == (5, 2.0)
        before = lim.config
        with pytest.raises(ValueError, match="per given twice"):
            lim.set_rate("10/s", per=3)
        with pytest.raises(ValueError, match="N/unit"):
            lim.set_rate("10/fortnight")
        assert lim.config == before  # a refused change writes nothing
    finally:
        lim.close()


def test_keyed_limiter_takes_rate_strings(name):
    lim = shmlimit.KeyedLimiter(name, rate="2/min", burst=2, keys=100)
    try:
        assert (lim.rate, lim.per) == (2, 60.0)
        assert [lim.try_acquire("k") for _ in range(3)] == [True, True, False]
        lim.set_rate("600/h", key="k")
        assert lim.override("k") == (600, 3600.0, lim.override("k")[2])
        lim.set_rate("30/30s")
        assert (lim.rate, lim.per) == (30, 30.0)
        with pytest.raises(ValueError, match="N/unit"):
            lim.set_rate("3/weeks")
        assert (lim.rate, lim.per) == (30, 30.0)
    finally:
        lim.close()


def test_cli_create_and_set_rate_take_rate_strings(name):
    r = run("create", name, "--rate", "50/5s")
    assert r.returncode == 0, r.stderr
    assert "rate=50 per=5s" in r.stdout
    assert run("set-rate", name, "200K/min").returncode == 0
    lim = shmlimit.attach(name)
    try:
        assert (lim.rate, lim.per) == (200_000, 60.0)
    finally:
        lim.close()
    r = run("set-rate", name, "10/fortnight")
    assert r.returncode == 2 and "N/unit" in r.stderr and "Traceback" not in r.stderr
