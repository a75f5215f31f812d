"""A key's debt keeps its meaning across a change of price, as a plain ``Limiter``'s bucket does.

A plain ``Limiter`` keeps its bucket's level (seconds of schedule) across ``set_rate``, cut to the
new capacity: at 100/s with burst 100, 100 ops taken, then 1/s with burst 10, it grants 0 more.  A
``KeyedLimiter`` kept each key's TAT, so the key's room was re-read under the new burst: it granted
9 more at once (99 when the default went to 1/s, burst 100), and after a raise to 100/s, burst 100,
a key that had taken its 10 at 1/s waited 9 s instead of 10 ms.  Each key's word now holds the
instant its bucket was last empty, which no price is needed to read (``keyed_cells``).

These run on the backend the run selects (``SHMLIMIT_BACKEND``); ``test_keyed_table`` drives both
backends' steps with an injected clock, racing a change of price.
"""

import time

import pytest

import shmlimit
from shmlimit.keyed.stats import sample_keys


def _more(lim, key):
    more = 0
    while more < 1000 and lim.try_acquire(key):
        more += 1
    return more


def _refilled(rate, start):
    """The most ops ``rate`` (per second) refills in the real time since ``start``
    (``time.monotonic()``, read before the first take): 0 within a test's few ms on a quiet
    machine, and never less than what a busy one's scheduler let pass meanwhile."""
    return int(rate * (time.monotonic() - start))


@pytest.mark.parametrize("with_key", [True, False])
def test_lowering_a_keyed_rate_hands_out_no_burst(name, with_key):
    lim = shmlimit.KeyedLimiter(name, rate=100, burst=100)
    try:
        start = time.monotonic()
        assert sum(lim.try_acquire("K") for _ in range(100)) == 100
        lim.set_rate(1, burst=10 if with_key else 100, key="K" if with_key else None)
        assert _more(lim, "K") <= _refilled(1, start)  # 0; before: 9 (key=), 99 (the default)
        # a new key: a full bucket (burst 100 either way), and what its rate refills meanwhile
        start = time.monotonic()
        assert 100 <= _more(lim, "other") <= 100 + _refilled(100 if with_key else 1, start)
    finally:
        lim.close()


def test_raising_a_keyed_rate_keeps_the_keys_level(name):
    lim = shmlimit.KeyedLimiter(name, rate=1, burst=10)
    try:
        assert sum(lim.try_acquire("K") for _ in range(10)) == 10
        lim.set_rate(100, burst=100, key="K")
        assert lim.retry_after("K") <= 0.011  # an empty bucket at 100/s; before: 9.01 s
    finally:
        lim.close()


@pytest.mark.parametrize("raise_", [False, True])
def test_removing_an_override_keeps_the_keys_level(name, raise_):
    """``remove_override`` is a change of price too: the key keeps its level under the default."""
    lim = shmlimit.KeyedLimiter(name, rate=1 if raise_ else 100, burst=10 if raise_ else 100)
    try:
        start = time.monotonic()
        lim.set_rate(100 if raise_ else 1, burst=100 if raise_ else 10, key="K")
        assert sum(lim.try_acquire("K") for _ in range(100 if raise_ else 10)) == (
            100 if raise_ else 10
        )
        assert lim.remove_override("K")
        if raise_:  # 100/s burst 100 -> the default 1/s burst 10: empty stays empty
            assert _more(lim, "K") <= _refilled(1, start)  # 0; before: 9
        else:  # 1/s burst 10 -> the default 100/s burst 100: an empty bucket at 100/s
            assert lim.retry_after("K") <= 0.011  # before: 9.01 s
    finally:
        lim.close()


def test_a_partly_used_key_keeps_its_level_in_seconds_as_a_limiter_does(name):
    """At 1/s with burst 100, 50 ops taken leave 50 s of schedule; at 0.1/s with burst 20 that is
    5 ops (before: 15, the new 200 s of burst less the 50 s of debt).  A plain Limiter given the
    same sequence grants the same 5 (its tokens are time)."""
    keyed = shmlimit.KeyedLimiter(name, rate=1, burst=100)
    plain = shmlimit.Limiter(name + "-plain", rate=1, burst=100)
    try:
        for lim, take in ((keyed, lambda: keyed.try_acquire("K")), (plain, plain.try_acquire)):
            assert sum(take() for _ in range(50)) == 50
            lim.set_rate(1, per=10, burst=20)
            more = 0
            while more < 100 and take():
                more += 1
            assert more == 5, lim
    finally:
        keyed.close()
        plain.close()
        plain.unlink()


@pytest.mark.parametrize("with_key", [True, False])
def test_several_rates_keep_each_keys_level(name, with_key):
    """A keyed limiter of several rates re-prices each rate's table as a single one does."""
    lim = shmlimit.KeyedLimiter(name, rates=[(100, 100), (1000, 1000)])
    try:
        start = time.monotonic()
        assert sum(lim.try_acquire("K") for _ in range(100)) == 100
        lim.set_rate(0, 1, burst=10 if with_key else 100, key="K" if with_key else None)
        assert _more(lim, "K") <= _refilled(1, start)  # 0; before: 9 (key=), 99 (the default)
        lim.set_rate(0, 100, burst=100, key="K" if with_key else None)
        assert lim.retry_after("K") <= 0.011  # an empty bucket at 100/s again
    finally:
        lim.close()


def test_top_reads_each_keys_wait_under_its_own_price(name):
    """``sample_keys`` (``top``) reads a key's word under its override, else the default."""
    lim = shmlimit.KeyedLimiter(name, rate=100, burst=100, keys=64, store_keys=True)
    try:
        lim.set_rate(1, burst=10, key="slow")
        start = time.monotonic()
        assert sum(lim.try_acquire("slow") for _ in range(10)) == 10
        assert sum(lim.try_acquire("fast") for _ in range(100)) == 100
        waits = {s.key: s.wait for s in sample_keys(name, 0, 64)[0]}
        since = time.monotonic() - start + 0.001  # (1 ms: the clock's rounding)
        # until each bucket is full: 10 s and 1 s, less the real time since the takes began
        assert 10 - since < waits["slow"] <= 10 and 1 - since < waits["fast"] <= 1
    finally:
        lim.close()


def test_a_key_priced_down_from_a_burst_longer_than_the_clocks_reading_is_full(name):
    """CLOCK_MONOTONIC counts from boot: a key that took 1 of 2 ops at 1 per 35e6 s (a burst of
    810 days) emptied its bucket 405 days before the clock's zero on a machine up for less.  At
    10/s with burst 1 it has a full bucket; the native step read its TAT modulo 2**64, for ever in
    the future: refused until the end of time (``retry_after`` negative)."""
    per = 35e6
    if time.monotonic() >= per - 1e6:
        pytest.skip("this machine's clock reads more than the key's debt")
    lim = shmlimit.KeyedLimiter(name, rate=1, per=per, burst=2)
    try:
        assert lim.try_acquire("K")
        lim.set_rate(10, per=1, burst=1)
        assert lim.retry_after("K") == 0.0  # before: -35e6 s
        assert lim.try_acquire("K")  # before: False, for ever
    finally:
        lim.close()
