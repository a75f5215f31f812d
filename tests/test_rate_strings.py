"""Rate strings "N/unit": parsed exactly, accepted wherever a rate is, refused clearly."""

import pytest
from support.clock import FakeClock
from support.procs import run_cli as run

import shmlimit
from shmlimit.config import Config, parse_rate
from shmlimit.rate_group import parse_rates

# run once in CI: rate strings parsed; the grants they price are the core tests' subject
pytestmark = pytest.mark.backend_independent


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


@pytest.mark.parametrize(
    "bad",
    ["1_000", "\uff11\uff10", "1e3", "10,1_1", "1_0/s", "10/\uff11s", "\u0661\u0660/s", "1K,1e0"],
)
def test_numbers_in_rate_strings_are_ascii_digits_with_an_optional_point(name, cleanup, bad):
    """One number grammar for counts, ratios and windows: ASCII digits, an optional '.', K/M/G
    (the window refused '_' and exponents already); ``float`` took "1_000", full-width "10" and "1e3" as counts."""
    lim = shmlimit.Limiter(name, rate=10)
    cleanup.append(lim)
    for call in (Config.make, lim.apply, lim.set_rate):
        with pytest.raises(ValueError, match="ASCII digits"):
            call(bad)
    assert (lim.rate, lim.config.ratio) == (10, 1.0)
    assert parse_rate(" 1.5k / 0.5 s ") == (1500.0, 0.5) and Config.make(".5,5.").ratio == 5.0


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


# ---- limits' syntax: "10 per second", "5 per 2 seconds", "10/minute;100/hour" -------------------


def _limits_strings():
    """Many strings in limits' notation, and near misses: every unit (singular, plural, any
    case), '/' and 'per' with and without spaces, with and without a count of units."""
    out = []
    for amount in ("1", "5", "10", "2500", "0"):
        for sep in ("/", " / ", " per ", "per", " PER ", "  per  "):
            for multiple in ("", "1 ", "2 ", "30 ", "0 ", "2"):
                for unit in ("second", "seconds", "Minute", "minutes", "HOUR", "hours", "day",
                             "Days", "DAY", "month", "months", "year", "years", "s", "min", "fortnight"):  # fmt: skip
                    out.append(f"{amount}{sep}{multiple}{unit}")
    return out


def test_every_string_both_parsers_accept_gives_limits_amount_and_window():
    limits = pytest.importorskip("limits")
    from limits.util import SINGLE_EXPR

    both = 0
    for text in _limits_strings():
        try:
            item = limits.parse(text)
        except ValueError:
            continue
        try:
            got = parse_rate(text)
        except ValueError:
            # refused here only where parse_rate's docstring says: a count or a window of 0
            amount, _, multiples, _ = SINGLE_EXPR.match(text).groups()
            assert int(amount) == 0 or (multiples is not None and int(multiples) == 0), text
            continue
        assert got == (float(item.amount), float(item.get_expiry())), text
        assert Config.make(text).ops_per_second == item.amount / item.get_expiry(), text
        both += 1
    assert both > 1000  # the strings above exercise both parsers


@pytest.mark.parametrize(
    "text",
    ["10/minute;100/hour", "10 per second; 5 per 2 seconds", "1/second,5/minute|100/day",
     "2 per 3 hours;1/Day"],
)  # fmt: skip
def test_several_rates_parse_as_limits_parse_many(text):
    limits = pytest.importorskip("limits")
    keys, cfgs, named = parse_rates("x", text)
    want = [(float(i.amount), float(i.get_expiry())) for i in limits.parse_many(text)]
    assert [(c.rate, c.per) for c in cfgs] == want and not named


def test_limits_syntax_wherever_a_rate_is_accepted(name, cleanup):
    lim = shmlimit.Limiter(name, rate="10 per second")
    cleanup.append(lim)
    assert (lim.rate, lim.per) == (10, 1.0)
    lim2 = shmlimit.Limiter(name + "-2", rate="5 per 2 seconds")
    cleanup.append(lim2)
    assert (lim2.rate, lim2.per) == (5, 2.0)
    multi = shmlimit.Limiter(name + "-m", rates="10/minute;100/hour")
    cleanup.append(multi)
    assert [(c.rate, c.per) for c in multi.configs.values()] == [(10, 60.0), (100, 3600.0)]
    keyed = shmlimit.KeyedLimiter(name + "-k", rate="3 per 2 minutes", keys=100)
    cleanup.append(keyed)
    assert (keyed.rate, keyed.per) == (3, 120.0)

    @shmlimit.throttle(name + "-t", rate="2 per Hour", on_limit="skip")
    def call():
        return "ran"

    try:
        assert [call(), call()] == ["ran", None]  # a burst of one op: the second waits 30 min
        assert (call.limiter().rate, call.limiter().per) == (2, 3600.0)
    finally:
        call.limiter().close()
        shmlimit.unlink(name + "-t")
    with pytest.raises(ValueError, match="rates="):
        shmlimit.Limiter(name + "-x", rate="10/minute;100/hour")
    assert name + "-x" not in shmlimit.list_names()


def test_cli_takes_limits_syntax(name):
    r = run("create", name, "--rate", "5 per 2 seconds")
    try:
        assert r.returncode == 0, r.stderr
        assert "rate=5 per=2s" in r.stdout
    finally:
        shmlimit.unlink(name)
    r = run("create", name, "--rates", "10/minute;100/hour")
    try:
        assert r.returncode == 0, r.stderr
        assert [line.split()[2:4] for line in r.stdout.splitlines()] == [
            ["rate=10", "per=60s"],
            ["rate=100", "per=3600s"],
        ]
    finally:
        shmlimit.unlink(name)  # one segment, both rates
