"""The one all-or-nothing protocol over several rates (``acquire.all_or_nothing``): its steps on
recording rates, and each kind's race between the looks and the takes on a real segment."""

import math

import pytest
from support.clock import FakeClock

import shmlimit
from shmlimit.acquire import all_or_nothing
from shmlimit.acquire import multi as plain_multi

S = 1_000_000_000


class Recorded:
    """A rate that records every step in ``log``: ``wait`` is its look; ``refuse`` makes its take
    answer that code."""

    def __init__(self, name, log, wait=0, refuse=None):
        self.name, self.log, self.wait, self.refuse = name, log, wait, refuse

    def look(self):
        self.log.append(("look", self.name))
        return self.wait

    def take(self):
        self.log.append(("take", self.name))
        return self.refuse if self.refuse is not None else (self.name,)

    def undo(self, taken):
        self.log.append(("undo", taken[0]))

    def count(self):
        self.log.append(("count", self.name))


@pytest.mark.backend_independent
def test_every_rate_is_looked_at_then_taken_then_counted():
    log = []
    assert all_or_nothing.take_all([Recorded(x, log) for x in "abc"]) is None
    assert log == [(step, x) for step in ("look", "take", "count") for x in "abc"]


@pytest.mark.backend_independent
@pytest.mark.parametrize("waits, answer", [((0, 3, 7), 7), ((0, math.inf, 7), math.inf)])
def test_a_short_look_refuses_with_the_longest_wait_taking_nothing(waits, answer):
    log = []
    rates = [Recorded(x, log, w) for x, w in zip("abc", waits)]
    assert all_or_nothing.take_all(rates) == answer
    assert log == [("look", x) for x in "abc"]  # every rate looked at, none taken


@pytest.mark.backend_independent
def test_a_refused_take_undoes_the_rates_taken_newest_first_and_counts_none():
    log = []
    rates = [Recorded("a", log), Recorded("b", log), Recorded("c", log, refuse=-5)]
    assert all_or_nothing.take_all(rates) == -5  # the take's own code
    assert log[3:] == [("take", "a"), ("take", "b"), ("take", "c"), ("undo", "b"), ("undo", "a")]


def test_a_plain_race_between_the_looks_and_the_takes_gives_the_earlier_rate_back(
    name, cleanup, monkeypatch
):
    """The slow path's try (``acquire.multi.take_all``): every rate looked at with room, then
    another caller takes the second rate's room before the takes: the first rate's tokens go
    back (``Bucket.give_back``, no replenish between: all of them), and neither rate counts."""
    clock = FakeClock()
    lim = shmlimit.Limiter(name, rates=[("10/s", 3), ("10/s", 2)], clock=clock)
    cleanup.append(lim)
    atts = lim._live()
    ops = (2, 2)
    toks = lim._tokens(ops)
    first, second = (att.bucket for att in atts)
    before = first.balance()
    real = plain_multi._Grab.take
    raced = []

    def take(self):
        if not raced:  # another caller, after the looks, before the first take
            raced.append(second.try_grab(toks[1], atts[1].grants_off, 0))
        return real(self)

    monkeypatch.setattr(plain_multi._Grab, "take", take)
    assert not plain_multi.take_all(atts, ops, toks)
    monkeypatch.undo()
    assert raced == [True]
    assert first.balance() == before  # given back in full
    assert lim.stats().grants == {"0": 0, "1": 0}
