"""A key's debt keeps its meaning across a change of price, as a plain ``Limiter``'s bucket does.

A plain ``Limiter`` keeps its bucket's level (seconds of schedule) across ``set_rate``, cut to the
new capacity: at 100/s with burst 100, 100 ops taken, then 1/s with burst 10, it grants 0 more.  A
``KeyedLimiter`` keeps each key's TAT, so the key's room is re-read under the new burst: it granted
9 more at once (99 when the default went to 1/s, burst 100), and after a raise to 100/s, burst 100,
a key that had taken its 10 at 1/s waited 9 s instead of 10 ms.

Not fixed yet: re-pricing a key's TAT needs the burst it was written under, which the slot does
not keep (see the report of the change that added this file).  Strict: passing fails the run.
"""

import pytest

import shmlimit

FIXED = pytest.mark.xfail(strict=True, reason="a keyed TAT is not re-priced by set_rate yet")


def _more(lim, key):
    more = 0
    while more < 1000 and lim.try_acquire(key):
        more += 1
    return more


@FIXED
@pytest.mark.parametrize("with_key", [True, False])
def test_lowering_a_keyed_rate_hands_out_no_burst(name, with_key):
    lim = shmlimit.KeyedLimiter(name, rate=100, burst=100)
    try:
        assert sum(lim.try_acquire("K") for _ in range(100)) == 100
        lim.set_rate(1, burst=10 if with_key else 100, key="K" if with_key else None)
        assert _more(lim, "K") == 0  # today: 9 (key=), 99 (the default)
    finally:
        lim.close()


@FIXED
def test_raising_a_keyed_rate_keeps_the_keys_level(name):
    lim = shmlimit.KeyedLimiter(name, rate=1, burst=10)
    try:
        assert sum(lim.try_acquire("K") for _ in range(10)) == 10
        lim.set_rate(100, burst=100, key="K")
        assert lim.retry_after("K") <= 0.011  # an empty bucket at 100/s; today: 9.01 s
    finally:
        lim.close()
