"""A keyed limiter of several rates adapts each key on each rate on its own.

``KeyedLimiter(name, rates={...}, adapt={name: Adapt(...)})``: each rate's region is a keyed table
of its own, with its own per-key adaptive words, so a key's window on one rate is decided from the
outcomes reported to that rate only.  Reports and grants run on the limiter's injected clock
(``feedback`` reads it).  Run on both backends (``SHMLIMIT_BACKEND``).
"""

import pickle
import subprocess
import sys

import pytest
from support.clock import FakeClock

import shmlimit
from shmlimit.keyed.multi import MultiKeyedLimiter

S = 10**9
REQ = shmlimit.Adapt(min_rate=10, max_rate=200, increase=10)
TOK = shmlimit.Adapt(min_rate=100, max_rate=5000, increase=100)
RATES = {"requests": 100, "tokens": 1000, "daily": "100M/day"}  # daily never binds


def _lim(name, clock, adapt=None, **kw):
    adapt = {"requests": REQ, "tokens": TOK} if adapt is None else adapt
    kw.setdefault("keys", 1000)
    return shmlimit.KeyedLimiter(name, rates=RATES, adapt=adapt, clock=clock, **kw)


def _rates(lim, key):
    """Each rate's rate in force for ``key``: its override's, None while it follows the default."""
    return {k: (None if (o := lim.override(k, key)) is None else o[0]) for k in lim.keys}


def _advance(clock, seconds):
    clock.advance(int(seconds * S))


# ---- the option ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "rates, adapt, kw, error, match",
    [
        (RATES, REQ, {}, TypeError, "each rate its own bounds"),
        (RATES, [REQ, TOK, None], {}, TypeError, "dict of rate name"),
        (RATES, {"request": REQ}, {}, ValueError, r"unknown rate\(s\) \['request'\]"),
        (RATES, {"requests": {"min_rate": 1}}, {}, TypeError, r"adapt\['requests'\] must be"),
        (RATES, {"tokens": REQ}, {}, ValueError, r"adapt\['tokens'\]: rate must be within"),
        (RATES, {"requests": None}, {}, ValueError, "no rate adapts"),
        ([100, 1000], [REQ], {}, TypeError, "a list of 2"),
        ([100, (1000, 50)], [None, TOK], {}, ValueError, r"adapt\['1'\]: burst cannot be"),
        (RATES, {"requests": REQ}, {"overrides": 0}, ValueError, "adapt needs overrides= > 0"),
    ],
)
def test_bad_adapt_names_the_rate_and_creates_nothing(name, rates, adapt, kw, error, match):
    with pytest.raises(error, match=match):
        shmlimit.KeyedLimiter(name, rates=rates, adapt=adapt, keys=1000, **kw)
    with pytest.raises(FileNotFoundError):
        shmlimit.inspect(name)


def test_adapt_needs_rates_to_start_from(name):
    with pytest.raises(ValueError, match="adapt needs rates="):
        MultiKeyedLimiter(shmlimit.KeyedLimiter, name, None, adapt={"requests": REQ})


def test_the_same_call_again_and_a_different_one(name, cleanup):
    clock = FakeClock()
    lim = _lim(name, clock)
    cleanup.append(lim)
    again = _lim(name, clock)
    cleanup.append(again)
    assert again.adaptive
    with pytest.raises(shmlimit.ConfigMismatchError, match="no adaptive rate"):
        shmlimit.KeyedLimiter(name, rates=RATES, keys=1000)
    with pytest.raises(shmlimit.ConfigMismatchError, match="max_rate=1900"):
        _lim(name, clock, adapt={"requests": REQ, "tokens": shmlimit.Adapt(100, 1900)})


def test_a_group_without_adapt_takes_no_feedback(name, cleanup):
    lim = shmlimit.KeyedLimiter(name, rates=RATES, keys=1000)
    cleanup.append(lim)
    assert not lim.adaptive
    with pytest.raises(ValueError, match="needs a keyed limiter created with adapt=; no rate"):
        lim.feedback(True, "a.example")
    with pytest.raises(TypeError, match="throttled must be True or False"):
        lim.feedback(1, "a.example")


# ---- each key on each rate decides on its own ---------------------------------------------------


def test_each_rate_cuts_each_key_once_per_window(name, cleanup):
    clock = FakeClock()
    lim = _lim(name, clock)
    cleanup.append(lim)
    assert lim.feedback(True, "slow.example")  # a key's first outcome: its entry on each rate
    lim.feedback(False, "fast.example")
    _advance(clock, 0.1)
    for _ in range(30):  # mid-window: nothing decided
        lim.feedback(True, "slow.example")
    assert _rates(lim, "slow.example") == {"requests": 100.0, "tokens": 1000.0, "daily": None}
    _advance(clock, 0.15)
    for _ in range(5):  # the first report after the window decides it, once per rate
        lim.feedback(False, "slow.example")
    lim.feedback(False, "fast.example")
    assert _rates(lim, "slow.example") == {"requests": 80.0, "tokens": 800.0, "daily": None}
    assert _rates(lim, "fast.example") == {"requests": 100.0, "tokens": 1000.0, "daily": None}
    st = lim.stats()
    for k in ("requests", "tokens"):
        a = st[k].adapt
        assert (a.throttled, a.ok, a.cuts, a.raises) == (31, 7, 1, 0)
    assert st["daily"].adapt is None  # a contract: it never adapts
    assert [s.rate for s in st.rates.values()] == [100.0, 1000.0, 1e8]  # the defaults stay


def test_which_reports_to_the_rates_named_only(name, cleanup):
    clock = FakeClock()
    lim = _lim(name, clock)
    cleanup.append(lim)
    lim.feedback(True, "a.example", which="tokens")
    lim.feedback(False, "a.example", which=["requests", 1])
    _advance(clock, 0.25)
    lim.feedback(False, "a.example")
    assert _rates(lim, "a.example") == {"requests": 100.0, "tokens": 800.0, "daily": None}
    with pytest.raises(ValueError, match=r"which must name rates that adapt \(requests, tokens\)"):
        lim.feedback(True, "a.example", which="daily")
    with pytest.raises(ValueError, match="which must be one of"):
        lim.feedback(True, "a.example", which="nope")
    with pytest.raises(ValueError, match="which must name at least one rate"):
        lim.feedback(True, "a.example", which=[])  # (was dropped without a word)
    with pytest.raises(TypeError, match="not bytes"):
        lim.feedback(True, "a.example", which=b"tokens")  # (was taken as indices 116, 111, ...)
    st = lim.stats()
    assert (st["tokens"].adapt.throttled, st["requests"].adapt.throttled) == (1, 0)


def test_only_the_binding_rate_raises_and_an_idle_key_never_does(name, cleanup):
    """A caller tries ``busy.example`` every ms: requests (100/s) binds it and rises each clean
    window; tokens (1000/s) grants the same ops, a tenth of its schedule, and holds.  A key that
    answers but is never asked for rises on no rate."""
    clock = FakeClock()
    lim = _lim(name, clock)
    cleanup.append(lim)
    for key in ("busy.example", "idle.example"):
        lim.feedback(False, key)
    for _ in range(5):  # 5 windows
        for _ in range(250):
            _advance(clock, 0.001)
            lim.try_acquire("busy.example")
        lim.feedback(False, "busy.example")
        lim.feedback(False, "idle.example")
    assert _rates(lim, "busy.example") == {"requests": 150.0, "tokens": 1000.0, "daily": None}
    assert _rates(lim, "idle.example") == {"requests": 100.0, "tokens": 1000.0, "daily": None}
    _advance(clock, 3600)  # an hour without a report: nothing decided, nothing rises
    lim.feedback(False, "busy.example")  # the window ending now held no grants: hold
    assert _rates(lim, "busy.example")["requests"] == 150.0
    st = lim.stats()
    assert (st["requests"].adapt.raises, st["tokens"].adapt.raises) == (5, 0)


def test_each_rate_keeps_each_key_within_its_own_bounds(name, cleanup):
    clock = FakeClock()
    lim = _lim(name, clock)
    cleanup.append(lim)
    for _ in range(40):
        lim.feedback(True, "a.example")
        _advance(clock, 0.25)
    lim.feedback(True, "a.example")
    assert _rates(lim, "a.example") == {"requests": 10.0, "tokens": 100.0, "daily": None}
    lim.set_rate("requests", 200, key="a.example")
    with pytest.raises(ValueError, match="from 10 to 200"):
        lim.set_rate("requests", 201, key="a.example")
    with pytest.raises(ValueError, match="from 100 to 5000"):
        lim.set_rate("tokens", 50)
    lim.set_rate("daily", "200M/day", key="a.example")  # a rate that does not adapt: unbounded
    assert _rates(lim, "a.example") == {"requests": 200.0, "tokens": 100.0, "daily": 2e8}


def test_outcomes_of_another_process_count(name, cleanup):
    """Another process reports through its own handle (a pickle: attached by name, on the real
    clock: its reports fall in this window, begun on the real clock too)."""
    lim = _lim(name, None)
    cleanup.append(lim)
    lim.feedback(False, "a.example")
    code = (
        "import pickle, sys\n"
        "lim = pickle.loads(sys.stdin.buffer.read())\n"
        "assert lim.feedback(True, 'a.example', which='requests')\n"
        "assert lim.feedback(False, 'a.example')\n"
    )
    subprocess.run([sys.executable, "-c", code], input=pickle.dumps(lim), check=True)
    st = lim.stats()
    assert (st["requests"].adapt.throttled, st["requests"].adapt.ok) == (1, 2)
    assert (st["tokens"].adapt.throttled, st["tokens"].adapt.ok) == (0, 2)


def test_a_full_override_table_counts_nothing_for_a_new_key(name, cleanup):
    clock = FakeClock()
    lim = _lim(name, clock, keys=64, overrides=1)
    cleanup.append(lim)
    assert lim.feedback(False, "a.example")
    assert not lim.feedback(False, "b.example")  # no entry free near it on either rate
    assert lim.stats()["requests"].adapt.ok == 1
    assert _rates(lim, "b.example") == {"requests": None, "tokens": None, "daily": None}
