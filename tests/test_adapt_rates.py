"""Adaptive rates of a limiter of several rates: each rate adapts on its own, within its bounds.

``Limiter(name, rates={...}, adapt={name: Adapt(...)})``: every rate's region holds its own
adaptive words, so each rate is decided from the outcomes reported to it, once per window, by the
first report to it after the window's end.  Reports are made at fake instants.  Run on both
backends (``SHMLIMIT_BACKEND``).
"""

import json
import pickle
import subprocess
import sys

import pytest
from support.clock import FakeClock
from support.procs import run_cli

import shmlimit

S = 10**9
REQ = shmlimit.Adapt(min_rate=10, max_rate=200, increase=10)
TOK = shmlimit.Adapt(min_rate=100, max_rate=5000, increase=100)
RATES = {"requests": 100, "tokens": 1000, "hourly": "1M/h"}


_ADAPTS = {"requests": REQ, "tokens": TOK}


def _lim(name, clock, adapt=None, **kw):
    adapt = _ADAPTS if adapt is None else adapt
    return shmlimit.Limiter(name, rates=RATES, adapt=adapt, clock=clock, **kw)


def _rates(lim):
    return {k: c.rate for k, c in lim.configs.items()}


# ---- the option ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "rates, adapt, error, match",
    [
        (RATES, REQ, TypeError, "each rate its own bounds"),
        (RATES, [REQ, TOK, None], TypeError, "dict of rate name"),
        (RATES, {"request": REQ}, ValueError, r"unknown rate\(s\) \['request'\]"),
        (RATES, {"requests": {"min_rate": 1}}, TypeError, r"adapt\['requests'\] must be"),
        (RATES, {"tokens": REQ}, ValueError, r"adapt\['tokens'\]: rate must be within"),
        (RATES, {"requests": None}, ValueError, "no rate adapts"),
        ([100, 1000], [REQ], TypeError, "a list of 2"),
        ([100, (1000, 50)], [None, TOK], ValueError, r"adapt\['1'\]: burst cannot be combined"),
    ],
)
def test_bad_adapt_names_the_rate_and_creates_nothing(name, rates, adapt, error, match):
    with pytest.raises(error, match=match):
        shmlimit.Limiter(name, rates=rates, adapt=adapt)
    with pytest.raises(FileNotFoundError):
        shmlimit.inspect(name)


def test_adapt_needs_rates_to_start_from(name):
    with pytest.raises(ValueError, match="adapt needs rates="):
        shmlimit.multirate.MultiLimiter(name, None, adapt={"requests": REQ})


# ---- each rate decides on its own ---------------------------------------------------------------


def test_every_adapting_rate_cuts_once_per_window_the_others_keep_theirs(name, cleanup):
    clock = FakeClock()
    lim = _lim(name, clock)
    cleanup.append(lim)
    assert lim.adaptive
    for _ in range(30):
        lim.feedback(throttled=True)  # every rate that adapts is told (the first begins windows)
    clock.advance(int(0.25 * S))
    lim.feedback(throttled=False)  # decides each rate's window
    lim.feedback(throttled=True)  # decided: a second report cuts nothing more
    assert _rates(lim) == {"requests": 80.0, "tokens": 800.0, "hourly": 1000000.0}
    st = lim.stats()
    assert (st["requests"].adapt.cuts, st["tokens"].adapt.cuts) == (1, 1)
    assert st["requests"].adapt.throttled == 31 and st["hourly"].adapt is None


def test_which_reports_to_the_rates_named_only(name, cleanup):
    clock = FakeClock()
    lim = _lim(name, clock)
    cleanup.append(lim)
    lim.feedback(throttled=True, which="tokens")
    lim.feedback(throttled=False, which=["requests", 1])
    clock.advance(int(0.25 * S))
    lim.feedback(throttled=False)  # decides both
    assert _rates(lim) == {"requests": 100.0, "tokens": 800.0, "hourly": 1000000.0}
    with pytest.raises(ValueError, match=r"which must name rates that adapt \(requests, tokens\)"):
        lim.feedback(throttled=True, which="hourly")
    with pytest.raises(ValueError, match="which must be one of"):
        lim.feedback(throttled=True, which="nope")
    with pytest.raises(ValueError, match="which must name at least one rate"):
        lim.feedback(throttled=True, which=[])  # (was dropped without a word)
    with pytest.raises(TypeError, match="not bytes"):
        lim.feedback(throttled=True, which=b"tokens")  # (was taken as indices 116, 111, ...)
    assert lim.stats()["tokens"].adapt.throttled == 1  # the refused calls counted nothing


@pytest.mark.parametrize("which", [1.0, float("nan"), None.__class__, object()])
@pytest.mark.parametrize("keyed", [False, True])
def test_a_which_that_names_no_rate_is_refused_by_name(name, cleanup, which, keyed):
    """A ``which`` neither a name, an index nor a list of them is a TypeError that names ``which``
    (a float was "'float' object is not iterable"), and counts nothing on any rate."""
    clock = FakeClock()
    if keyed:
        lim = shmlimit.KeyedLimiter(name, rates=RATES, adapt=_ADAPTS, clock=clock)
        args = ("k",)
    else:
        lim = _lim(name, clock)
        args = ()
    cleanup.append(lim)
    with pytest.raises(TypeError, match="which must be a rate's name or index"):
        lim.feedback(True, *args, which=which)
    assert [lim.stats()[k].adapt.throttled for k in _ADAPTS] == [0, 0]


def test_only_the_binding_rate_raises(name, cleanup):
    """Callers queue on requests (100/s) and take a tenth of tokens' schedule (1000/s): a clean
    window raises requests, and holds tokens (it does not bind them).  The window is 5 s of the
    fake clock: the reports that begin and end it decide nothing else."""
    clock = FakeClock()
    slow = {"requests": REQ, "tokens": TOK}
    slow = {k: shmlimit.Adapt(a.min_rate, a.max_rate, increase=a.increase, window=5.0)
            for k, a in slow.items()}  # fmt: skip
    lim = _lim(name, clock, adapt=slow)
    cleanup.append(lim)
    lim.feedback(throttled=False)
    for _ in range(5000):
        clock.advance(10**6)
        lim.try_acquire()
    lim.feedback(throttled=False)
    assert _rates(lim) == {"requests": 110.0, "tokens": 1000.0, "hourly": 1000000.0}
    st = lim.stats()
    assert (st["requests"].adapt.raises, st["tokens"].adapt.raises) == (1, 0)


def test_an_idle_fleet_raises_no_rate(name, cleanup):
    clock = FakeClock()
    lim = _lim(name, clock)
    cleanup.append(lim)
    for _ in range(40):
        lim.feedback(throttled=False)  # answers, but nobody queues for tokens
        clock.advance(int(0.25 * S))
    assert _rates(lim) == {"requests": 100.0, "tokens": 1000.0, "hourly": 1000000.0}


def test_each_rate_stays_within_its_own_bounds(name, cleanup):
    clock = FakeClock()
    lim = _lim(name, clock)
    cleanup.append(lim)
    for _ in range(40):
        lim.feedback(throttled=True)  # each decides the window before it: 39 cuts
        clock.advance(int(0.25 * S))
    assert _rates(lim) == {"requests": 10.0, "tokens": 100.0, "hourly": 1000000.0}
    lim.set_rate("requests", 200)
    with pytest.raises(ValueError, match="from 10 to 200"):
        lim.set_rate("requests", 201)
    assert lim.configs["requests"].rate == 200.0


def test_outcomes_of_other_processes_count(name, cleanup):
    """Another process reports through its own handle (the same creating call, re-made, on the
    real clock: behind this process's fake one), beginning each rate's window; this process's
    report, a window later, decides from the counts in the segment."""
    clock = FakeClock()
    lim = _lim(name, clock)
    cleanup.append(lim)
    code = (
        "import pickle, sys\n"
        "lim = pickle.loads(sys.stdin.buffer.read())\n"  # the same creating call, re-made
        "lim.feedback(throttled=True, which='requests')\n"
        "lim.feedback(throttled=False)\n"
    )
    subprocess.run([sys.executable, "-c", code], input=pickle.dumps(lim), check=True)
    clock.advance(int(0.25 * S))
    lim.feedback(throttled=False, which="requests")
    lim.feedback(throttled=False, which="tokens")
    assert _rates(lim) == {"requests": 80.0, "tokens": 1000.0, "hourly": 1000000.0}
    st = lim.stats()
    assert (st["requests"].adapt.throttled, st["requests"].adapt.ok) == (1, 2)
    assert (st["tokens"].adapt.throttled, st["tokens"].adapt.ok) == (0, 2)


def test_the_same_creating_call_starts_from_the_learned_rates(name, cleanup):
    clock = FakeClock()
    lim = _lim(name, clock)
    cleanup.append(lim)
    lim.set_rate("tokens", 321)
    again = _lim(name, clock)
    cleanup.append(again)
    assert again.configs["tokens"].rate == 321.0
    with pytest.raises(shmlimit.ConfigMismatchError, match="max_rate=1900"):
        _lim(name, clock, adapt={"requests": REQ, "tokens": shmlimit.Adapt(100, 1900)})


def test_a_live_adapt_mismatch_advises_what_can_change_it(name, cleanup):
    """set_rate cannot change a rate's adapt= (nor take or give one), and a limiter of several
    rates takes no reconfigure=: the mismatch says that only a new fleet, once no process uses
    the limiter, takes other bounds (the rates learned kept within them)."""
    clock = FakeClock()
    lim = _lim(name, clock)
    cleanup.append(lim)
    other = {"requests": REQ, "tokens": shmlimit.Adapt(100, 1900)}
    for adapt in (other, {"requests": REQ}):
        with pytest.raises(shmlimit.ConfigMismatchError) as e:
            _lim(name, clock, adapt=adapt)
        assert "with set_rate(" not in str(e.value), str(e.value)
        assert "once no process uses it" in str(e.value), str(e.value)
    with pytest.raises(shmlimit.ConfigMismatchError, match="set_rate\\('hourly'"):  # a rate's
        shmlimit.Limiter(name, rates={**RATES, "hourly": "2M/h"}, adapt=_ADAPTS, clock=clock)


def test_a_group_without_adapt_takes_no_feedback(name, cleanup):
    lim = shmlimit.Limiter(name, rates=RATES)
    cleanup.append(lim)
    assert not lim.adaptive
    with pytest.raises(ValueError, match="no rate of .* adapts"):
        lim.feedback(throttled=True)


def test_inspect_top_and_metrics_show_each_rate_in_force(name, cleanup):
    clock = FakeClock()
    lim = _lim(name, clock)
    cleanup.append(lim)
    lim.feedback(throttled=True, which="tokens")
    clock.advance(int(0.25 * S))
    lim.feedback(throttled=False, which="tokens")
    assert shmlimit.inspect(name)["tokens"].rate == 800.0
    r = run_cli("top", name, "--once", "--json", "--interval", "0.1")
    recs = {rec["name"]: rec for rec in json.loads(r.stdout)["limiters"]}
    assert recs[f"{name}[tokens]"]["rate"] == 800.0
    assert recs[f"{name}[tokens]"]["adapt"]["cuts"] == 1
    assert recs[f"{name}[requests]"]["rate"] == 100.0
    assert recs[f"{name}[hourly]"]["adapt"] is None
    r = run_cli("metrics", name)
    lines = r.stdout.splitlines()
    assert f'shmlimit_rate_ops_per_second{{limiter="{name}[tokens]"}} 800.0' in lines
    assert f'shmlimit_rate_ops_per_second{{limiter="{name}[requests]"}} 100.0' in lines
