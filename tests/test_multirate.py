"""Several rates at once (rates=), step by step on an injected clock."""

import asyncio
import pickle

import pytest
from support.clock import FakeClock

import shmlimit
import shmlimit.shm.layout as L
from shmlimit.acquire.single import Request
from shmlimit.bucket.rovers import diff
from shmlimit.bucket.schedule import LONGEST_FILL_NS
from shmlimit.multirate import MultiLimiter, MultiRequest
from shmlimit.shm.cells import MASK64

S = 1_000_000_000


@pytest.fixture
def clock():
    return FakeClock()


#: A promise made at the instant of the last replenish, after the head moved past its words' limit,
#: counts the filler's longest pause (s): the next replenish adds nothing (``Schedule.promised_ns``).
LOST = LONGEST_FILL_NS / 1e9


def make(name, rates, clock):
    lim = shmlimit.Limiter(name, rates=rates, clock=clock)
    assert isinstance(lim, MultiLimiter)
    return lim


def advance(lim, clock, seconds, tick=0.001):
    """Move the clock ``seconds`` forward as a filler would see it: a replenish of every rate
    every ``tick`` (one replenish after a long jump loses that interval to the snapshot clamp,
    as the design page says)."""
    steps = max(1, round(seconds / tick))
    for i in range(steps):
        clock.advance(round(seconds * 1e9 * (i + 1) / steps) - round(seconds * 1e9 * i / steps))
        for att in lim._live():
            att.bucket.replenish()


def balance(lim, key):
    """Ops in ``key``'s bucket (negative: owed to the queue), after a replenish to now (a filler's tick)."""
    att = lim._live()[lim.keys.index(key)]
    att.bucket.replenish()
    return att.bucket.balance() / att.bucket.cost


def request(lim, timeout=None, n=1, **costs):
    ops = lim._ops(n, costs)
    return MultiRequest(lim._live(), ops, lim._tokens(ops), timeout)


def test_one_segment_for_every_rate_each_with_its_own_config(name, clock, cleanup):
    lim = make(name, ["5000/h", ("100/min", 10)], clock)
    cleanup.append(lim)
    assert lim.keys == ("0", "1")
    names = set(shmlimit.list_names())
    assert name in names and not {n for n in names if n.startswith(name + ".")}
    cfg = lim.configs
    assert (cfg["0"].rate, cfg["0"].per, cfg["1"].rate, cfg["1"].per, cfg["1"].burst) == (
        5000,
        3600,
        100,
        60,
        10,
    )
    st = lim.stats()
    assert set(st.rates) == {"0", "1"} and st.rates["1"].capacity == 10
    assert "0=5000/3600s" in repr(lim) and "1=100/60s" in repr(lim)
    # the name holds the group: attaching by name gives its rates as created, and a plain
    # Limiter of that name is refused, naming what the segment is
    again = MultiLimiter(name, None, clock=clock)  # by name (shmlimit.attach: test_kinds.py)
    assert again.keys == ("0", "1")
    assert again.configs["1"].rate == 100
    again.close()
    with pytest.raises(shmlimit.SegmentError, match="several rates"):
        shmlimit.Limiter(name, clock=clock)
    # the same rates attach; different ones are refused, naming the rate
    same = make(name, ["5000/h", ("100/min", 10)], clock)
    same.close()
    with pytest.raises(shmlimit.ConfigMismatchError):
        make(name, ["5000/h", "100/min"], clock)


@pytest.mark.parametrize(
    "rates, error",
    [
        ({}, ValueError),
        ([], ValueError),
        (10, TypeError),  # (one string stands for a list or a dict: rates_from_text)
        ({"a-b": "1/s"}, ValueError),
        ({"n": "1/s"}, ValueError),
        ({"timeout": "1/s"}, ValueError),
        ({"self": "1/s"}, ValueError),  # (every call naming it: "multiple values for 'self'")
        ({"a": "1/fortnight"}, ValueError),
        ({"a": 0}, ValueError),
        ([("1/s", 0.5)], ValueError),
        ([("1/s", 2, 3)], ValueError),
        ([("1/s",)], ValueError),
        ([10**400], ValueError),
    ],
)
def test_bad_rates_are_refused_naming_what_is_wrong(name, clock, rates, error):
    with pytest.raises(error) as e:
        shmlimit.Limiter(name, rates=rates, clock=clock)
    assert "rates" in str(e.value)
    assert not [n for n in shmlimit.list_names() if n.startswith(name)]


def test_rates_and_rate_or_other_options_do_not_mix(name, clock):
    with pytest.raises(TypeError, match="not both"):
        shmlimit.Limiter(name, 10, rates=["1/s"])
    with pytest.raises(TypeError, match=r"not both \(got burst with rates=\)"):
        shmlimit.Limiter(name, rates=["1/s"], burst=3)  # (each rate carries its own)
    with pytest.raises(TypeError, match="capped not supported with rates="):
        shmlimit.Limiter(name, rates=["1/s"], capped=True)  # as KeyedLimiter(rates=) does


def test_costs_by_name(name, clock, cleanup):
    lim = make(name, {"requests": ("10/s", 2), "tokens": ("1000/s", 1000)}, clock)
    cleanup.append(lim)
    with pytest.raises(TypeError, match="unknown rate"):
        lim.try_acquire(tokenz=1)
    with pytest.raises(TypeError, match="not both"):
        lim.try_acquire(2, tokens=1)
    with pytest.raises(ValueError, match="at least one"):
        lim.try_acquire(tokens=0)
    with pytest.raises(ValueError, match="tokens must be an int"):
        lim.try_acquire(tokens=-1)
    assert lim.try_acquire(requests=1, tokens=600)
    assert not lim.try_acquire(requests=1, tokens=600)  # tokens short: all or nothing
    assert balance(lim, "requests") == 1  # the request it took was given back
    assert lim.try_acquire(tokens=400)  # a rate not named costs nothing
    assert balance(lim, "requests") == 1
    assert lim.stats().grants == {"requests": 1, "tokens": 1000}


def test_a_refused_try_leaves_every_rate_as_it_was(name, clock, cleanup):
    lim = make(name, [("10/s", 3), ("1/s", 1)], clock)
    cleanup.append(lim)
    assert lim.try_acquire()
    for _ in range(5):
        assert not lim.try_acquire()
        assert (balance(lim, "0"), balance(lim, "1")) == (2, 0)
    advance(lim, clock, 0.5)
    assert not lim.try_acquire()
    assert balance(lim, "0") == pytest.approx(3)  # full again: nothing was held away from it
    advance(
        lim, clock, 0.501
    )  # (the first replenish after a drain loses its tick: the snapshot clamp)
    assert lim.try_acquire()
    assert lim.stats().grants == {"0": 2, "1": 2}


def test_a_timed_acquire_fails_at_once_when_any_rate_is_too_slow(name, clock, cleanup):
    lim = make(name, [("100/s", 5), ("1/s", 1)], clock)
    cleanup.append(lim)
    assert lim.acquire()
    before = (balance(lim, "0"), balance(lim, "1"))
    r = request(lim, timeout=0.5)
    assert r.begin() is False  # 1 s on the slow rate: no wait at all
    r.end()
    assert (balance(lim, "0"), balance(lim, "1")) == before
    assert lim.retry_after() == pytest.approx(1.0, abs=0.01)


def test_a_waiter_holds_nothing_on_the_other_rates_while_it_queues(name, clock, cleanup):
    lim = make(name, {"slow": ("1/s", 1), "fast": ("100/s", 10)}, clock)
    cleanup.append(lim)
    assert lim.try_acquire(slow=1)
    r = request(lim, slow=1, fast=5)
    assert r.begin() is not True
    assert r.state == "lead" and [i for i, _ in r.waits] == [0]  # queued on the slow rate only
    assert balance(lim, "fast") == 10  # the fast rate is untouched: others take it all
    assert lim.try_acquire(fast=10)
    advance(lim, clock, 0.5)
    assert r.next() is not True
    assert balance(lim, "fast") == pytest.approx(10)  # refilled, still untouched
    advance(lim, clock, 0.501)
    assert r.next() is True  # the slow ticket is due, the fast rate has room: both at once
    r.end()
    assert balance(lim, "fast") == pytest.approx(5)
    assert lim.stats().grants == {"slow": 2, "fast": 15}


def test_a_waiter_of_a_limiter_closed_under_it_raises_as_a_closed_limiters_does(
    name, clock, cleanup
):
    # Another thread closes the handle while this waiter is queued: its next look must raise the
    # ValueError of a closed limiter (not an IndexError from rates taken from under it).
    lim = make(name, {"slow": ("1/s", 1), "fast": ("100/s", 10)}, clock)
    assert lim.try_acquire(slow=1)
    ahead = [request(lim, slow=1) for _ in range(L.TICKET_RECORDS)]  # every record of the slot
    assert all(a.begin() is not True for a in ahead)
    r = request(lim, slow=1)
    assert r.begin() is not True and r.joining  # it looks again for a free record at each step
    lim.close()
    clock.advance(2 * S)
    with pytest.raises(ValueError, match="closed"):
        r.next()
    with pytest.raises(ValueError, match="closed"):
        lim.acquire(slow=1)


def _queue_on(lim, key, seconds):
    """Someone reserves ``seconds`` of ``key``'s schedule: a queue there."""
    att = lim._live()[lim.keys.index(key)]
    ops = round(seconds * att.bucket.config.rate / att.bucket.config.per)
    wait = shmlimit.multirate.acquisition.reserve(att, ops, None)
    assert wait is not None and wait >= seconds - 0.1  # (one op of the schedule was in the bucket)
    return wait  # its promise: the fence holds those behind it until then


def test_once_its_lead_rate_is_due_a_waiter_holds_it_only_for_the_others_queue(
    name, clock, cleanup
):
    lim = make(name, {"a": ("1/s", 1), "b": ("10/s", 1)}, clock)
    cleanup.append(lim)
    assert lim.try_acquire(a=1, b=1)
    r = request(lim, a=1, b=1)
    assert r.begin() is not True
    assert r.state == "lead" and [i for i, _ in r.waits] == [0]  # a is the lead
    promised = _queue_on(lim, "b", 1.5)  # meanwhile a queue forms on b, held until its promise
    advance(lim, clock, 1.002)
    assert r.next() is not True  # a is due: it joins b's queue, holding a's op
    assert r.state == "others"
    a = lim._live()[0]
    assert [att for att, _, _ in r.held] == [a]  # it holds a's op (taken, not yet used) ...
    assert [i for i, _ in r.waits] == [1]  # ... while it queues on b
    advance(lim, clock, promised + 0.1 - 1.002 - 0.02)
    assert r.next() is not True  # b's queue, up to its promise, then its own op on b (0.1 s)
    assert [att for att, _, _ in r.held] == [a]  # still held: for b's queue, no longer
    advance(lim, clock, 0.022)
    assert r.next() is True
    r.end()
    # a's op is used now, 0.6 s after its tokens were covered: a's next op is a second after
    # now, not 0.4 s (2 ops within 0.4 s were over a's 1/s with a burst of 1: rate*T + capacity)
    advance(lim, clock, 0.38)
    assert not lim.try_acquire(a=1)
    advance(lim, clock, 0.62)
    assert lim.try_acquire(a=1)


def test_waiters_queued_on_the_lead_rate_are_not_charged_for_their_holds(name, clock, cleanup):
    """Three waiters queue on a (1/s, the lead) and each, once covered, holds a's op 0.6 s for
    b's queue: their returns are spaced a second apart, as their tickets on a are.  The bucket
    had the waiters behind it to feed while the first two held, and dropped nothing: charging
    their holds (0.6 s each) pushed the next caller on a 1.2 s past its second, a loss that grows
    with the queue.  The last one's hold, behind which the bucket refills, is charged."""
    lim = make(name, {"a": ("1/s", 1), "b": ("10/s", 1)}, clock)
    cleanup.append(lim)
    assert lim.try_acquire(a=1, b=1)
    waiting = [request(lim, a=1, b=1) for _ in range(3)]
    for r in waiting:
        assert r.begin() is not True and r.lead == 0
    returned = []
    ticks = 0  # of 10 ms
    while waiting:
        advance(lim, clock, 0.01)
        ticks += 1
        if ticks % 100 == 50:  # a queue on b till the next one on a is due, and 0.6 s more
            _queue_on(lim, "b", 1.0)
        for r in list(waiting):
            if r.next() is True:
                returned.append(ticks / 100)
                waiting.remove(r)
                r.end()
    # each covered on a at its second, each returned over 0.5 s later (b's queue)
    assert [round(r) for r in returned] == [2, 3, 4] and min(returned) > 1.5
    last = returned[-1]
    advance(lim, clock, last + 0.95 - ticks / 100)
    assert not lim.try_acquire(a=1)  # the last one's op is used at its return: a's next 1 s on
    advance(lim, clock, 0.1)
    assert lim.try_acquire(a=1)  # (charged for the first two's holds too, 1.2 s later)


def test_a_timed_waiter_whose_other_rates_queued_gives_everything_back(name, clock, cleanup):
    lim = make(name, {"a": ("1/s", 1), "b": ("10/s", 1)}, clock)
    cleanup.append(lim)
    assert lim.try_acquire(a=1, b=1)
    r = request(lim, timeout=1.5, a=1, b=1)
    assert r.begin() is not True
    assert r.state == "lead" and [i for i, _ in r.waits] == [0]
    _queue_on(lim, "b", 2.0)
    advance(lim, clock, 1.002)
    assert r.next() is False  # b would take 1.1 s more, under 0.5 s left: refused at once
    r.end()
    # a's op is back in the bucket, less the time the head gained since it was covered
    assert balance(lim, "a") == pytest.approx(1, abs=0.003)
    advance(lim, clock, 0.003)
    assert lim.try_acquire(a=1)


def test_settle_refunds_and_charges(name, clock, cleanup):
    lim = make(name, {"requests": ("100/s", 10), "tokens": ("1000/s", 1000)}, clock)
    cleanup.append(lim)
    assert lim.acquire(requests=1, tokens=900, timeout=0)
    lim.settle(tokens=-700)  # used 200
    assert balance(lim, "tokens") == pytest.approx(800)
    lim.settle(tokens=-5000)  # a refund beyond the capacity is dropped
    assert balance(lim, "tokens") == pytest.approx(1000)
    assert lim.acquire(tokens=1000, timeout=0)
    lim.settle(tokens=500)  # used 500 more than estimated: debt, never refused
    assert balance(lim, "tokens") == pytest.approx(-500)
    assert lim.retry_after(tokens=100) == pytest.approx(
        0.6, abs=0.002
    )  # the debt delays the next caller
    assert not lim.acquire(tokens=100, timeout=0.59)
    with pytest.raises(TypeError):
        lim.settle(tokenz=1)
    with pytest.raises(TypeError):
        lim.settle(tokens=1.5)
    assert balance(lim, "tokens") == pytest.approx(-500)  # refused settles changed nothing


def test_list_rates_settle_every_rate(name, clock, cleanup):
    lim = make(name, [("10/s", 5), ("100/s", 5)], clock)
    cleanup.append(lim)
    assert lim.acquire(4)
    lim.settle(-3)
    assert (balance(lim, "0"), balance(lim, "1")) == (4, 4)
    lim.settle(2)
    assert (balance(lim, "0"), balance(lim, "1")) == (2, 2)


def test_reserve_is_all_or_nothing(name, clock, cleanup):
    lim = make(name, [("10/s", 1), ("1/s", 1)], clock)
    cleanup.append(lim)
    assert lim.reserve() == 0.0
    assert lim.reserve(max_wait=0.5) is None  # the 1/s rate would need 1 s
    assert (balance(lim, "0"), balance(lim, "1")) == (0, 0)
    # and the replenish that adds nothing: the clock stood still since the full bucket's last one
    assert lim.reserve(max_wait=1.0) is None  # promised 1 s + LOST: past the bound
    assert lim.reserve(max_wait=1.0 + LOST + 0.01) == pytest.approx(1.0 + LOST, abs=0.01)
    assert lim.stats().grants == {"0": 2, "1": 2}


def test_set_rate_by_name_or_index_live(name, clock, cleanup):
    lim = make(name, {"requests": "500/min", "tokens": "200K/min"}, clock)
    cleanup.append(lim)
    other = make(name, {"requests": "500/min", "tokens": "200K/min"}, clock)
    lim.set_rate("tokens", "100K/min")
    assert other.configs["tokens"].rate == 100_000
    lim.set_rate(0, 10, per=1)
    assert (other.configs["requests"].rate, other.configs["requests"].per) == (10, 1)
    with pytest.raises(ValueError, match="which must be one of"):
        lim.set_rate("tokenz", 1)
    with pytest.raises(ValueError, match="an index from -2 to 1, got 2"):
        lim.set_rate(2, 1)
    lim.set_rate(-2, 20, per=1)  # (negative: from the end)
    assert other.configs["requests"].rate == 20
    other.close()


@pytest.mark.parametrize("spec", ["100,2", "100,2,start", "100,start", "100/s,configure"])
def test_a_rate_specs_ratio_or_verb_is_refused_at_creation_and_in_set_rate(
    name, clock, cleanup, spec
):
    """Several rates have no catch-up and no verbs: a spec "100,2,start" given as one of them was
    taken, ratio and all (151 grants in 1 s at 100/s after 0.6 s idle, against rate*T + capacity
    = 101); refused now, at creation and live, and a ratio of 1 is a plain rate."""
    refused = r"rates\['a'\]: rate .*applies only to a Limiter of one rate.*; each rate of rates="
    with pytest.raises(ValueError, match=refused):
        make(name, {"a": spec, "b": "1M/s"}, clock)
    assert not [n for n in shmlimit.list_names() if n.startswith(name)]
    lim = make(name, {"a": "100", "b": "1M/s"}, clock)
    cleanup.append(lim)
    before = lim.configs
    with pytest.raises(ValueError, match="one rate.*; a Limiter of several rates takes"):
        lim.set_rate("a", spec)
    assert lim.configs == before
    lim.set_rate("a", "200/s,1")
    assert (lim.configs["a"].rate, lim.configs["a"].ratio) == (200, 1.0)


def test_a_waiter_pays_each_rate_the_price_in_force_when_it_takes_that_rate(name, clock, cleanup):
    """A waiter queued on its lead rate takes its other rates' tickets later: a ``set_rate`` of
    one of them meanwhile re-prices its ops there.  Priced when the call began, it took "fast"'s
    10 ops at 100/s (0.1 s of schedule) after "fast" became 1/s: with a burst used just before,
    20 ops granted in 0.1 s where rate*T + burst allows 10.1."""
    lim = make(name, {"slow": ("3/min", 1), "fast": ("100/s", 10)}, clock)
    cleanup.append(lim)
    fast = lim._live()[1].bucket
    assert lim.try_acquire(slow=1)  # slow is empty: the next op there is 20 s away
    r = request(lim, slow=1, fast=10)
    assert r.begin() is not True and r.state == "lead"  # queued on "slow" only
    lim.set_rate("fast", "1/s", burst=10)  # an op on "fast" costs a hundred times as much now
    advance(lim, clock, 19.99)
    assert r.next() is not True
    assert lim.try_acquire(fast=10)  # someone uses fast's burst
    tail = fast.taken()
    advance(lim, clock, 0.011)
    assert r.next() is not True and r.state == "others"  # slow is due: it joins fast's queue
    assert diff(fast.taken(), tail) == 10 * fast.cost  # 10 ops at the new price: 10 s
    r.end()


def test_a_reservation_is_never_promised_past_its_max_wait(name, clock, cleanup):
    """Two rates of 50/s, burst 1, just emptied: 2 ops on both are promised 60 ms away, beyond
    the 40 ms their tokens take (the head moves a capacity at most per replenish).  Each claim's
    bound was checked against the shorter estimate, and ``max_wait=0.05`` returned 0.06."""
    lim = make(name, {"a": ("50/s", 1), "b": ("50/s", 1)}, clock)
    cleanup.append(lim)
    assert lim.reserve(a=1, b=1) == 0.0
    assert lim.reserve(a=2, b=2, max_wait=0.05) is None  # every claim given back
    assert lim.stats().grants == {"a": 1, "b": 1}
    assert lim.reserve(a=2, b=2, max_wait=0.061) == pytest.approx(0.06)


def test_a_reservation_longer_than_a_fence_can_hold_is_refused_on_every_rate(name, cleanup):
    # as one rate's (test_acquisition): burst 1 at 100 000/s paces the head at the filler's
    # half an op a ms, and 10**8 ops would be promised past the ~39 h a fence holds
    lim = shmlimit.Limiter(name, rates=[("100000/s", 1), ("1000000/s", 1)])
    cleanup.append(lim)
    assert lim.reserve(10**6) > 0
    grants = lim.stats().grants
    with pytest.raises(ValueError, match="longer than a reservation can be held"):
        lim.reserve(10**8)
    assert lim.stats().grants == grants  # every rate's claim given back


def test_a_reservation_prices_each_claim_when_it_takes_it(name, clock, cleanup, monkeypatch):
    """A reservation whose rates all found their records in use waits for one
    (``_wait_for_record``); a ``set_rate`` meanwhile re-prices the claims it takes after."""
    lim = make(name, {"a": ("10/s", 1), "b": ("10/s", 1)}, clock)
    cleanup.append(lim)
    atts = lim._live()
    assert lim.try_acquire(a=1, b=1)
    waiters = [Request(att, 1, None) for att in atts for _ in range(5)]
    assert all(w.begin() is not True and w.record is not None for w in waiters)  # records in use
    waited = []

    def wait_for_record(att, tokens, since, max_ns):  # meanwhile: b re-priced, a record freed
        if not waited:
            lim.set_rate("b", "1/s", burst=1)
            for w in waiters:
                w.end()
        waited.append(tokens)
        return clock() if since is None else since

    monkeypatch.setattr(MultiLimiter, "_wait_for_record", staticmethod(wait_for_record))
    b = atts[1].bucket
    tail = b.taken()
    assert lim.reserve(a=1, b=1) is not None and waited
    assert diff(b.taken(), tail) == b.cost  # one op at the new price (a second of schedule)


def test_pickles_and_works_with_asyncio(name, clock, cleanup):
    lim = shmlimit.Limiter(name, rates={"a": ("100/s", 5)})
    cleanup.append(lim)
    copy = pickle.loads(pickle.dumps(lim))
    assert copy.keys == ("a",)
    assert asyncio.run(copy.acquire_async(a=5))
    assert not lim.try_acquire(a=1)
    copy.close()


def test_a_handle_pickles_after_a_live_change_of_a_rate(name, cleanup):
    """A handle pickled after ``set_rate`` (by any process) opens the limiter as it is now: made
    again with the rates it was created with, the unpickling raised ConfigMismatchError, so a
    pool worker could not take a limiter whose rate had ever been changed live."""
    lim = shmlimit.Limiter(name, rates={"a": ("10/s", 5), "b": "100/s"})
    cleanup.append(lim)
    lim.set_rate("a", "20/s", burst=5)
    copy = pickle.loads(pickle.dumps(lim))
    cleanup.append(copy)
    assert copy.configs == lim.configs
    assert copy.configs["a"].rate == 20
    lim.unlink()  # gone: the pickle still makes it again, with the rates it was created with
    again = pickle.loads(pickle.dumps(lim))
    cleanup.append(again)
    assert again.configs["a"].rate == 10


def test_the_fast_path_is_all_or_nothing_and_follows_live_changes(name, clock, cleanup):
    lim = make(name, [("10/s", 2), ("1/s", 1)], clock)
    cleanup.append(lim)
    assert lim.acquire() and lim._fast is not None  # bound on first use
    for _ in range(3):
        assert not lim.try_acquire()  # the second rate refuses: the first gets its op back
        assert (balance(lim, "0"), balance(lim, "1")) == (1, 0)
    assert lim.stats().grants == {"0": 1, "1": 1}
    lim.set_rate(1, "100/s", burst=5)  # another config: the bound gates refuse to decide
    advance(lim, clock, 0.2)  # the first rate full again (2), the second too (5)
    assert lim.try_acquire() and lim.try_acquire()
    assert lim._seqs == tuple(att.bucket.seq for att in lim._live())  # rebound
    assert lim.stats().grants == {"0": 3, "1": 3}


def test_the_throttle_decorator_takes_several_rates(name, clock, cleanup):
    @shmlimit.throttle(name, rates=[("10/s", 2), ("100/s", 5)], on_limit="raise", max_wait=0)
    def call():
        return "ok"

    assert call() == "ok" and call() == "ok"
    with pytest.raises(shmlimit.RateLimited):
        call()
    lim = shmlimit.Limiter(name, rates=[("10/s", 2), ("100/s", 5)])
    cleanup.append(lim)
    assert lim.stats().grants == {"0": 2, "1": 2}


def test_the_fast_path_decides_costs_and_leaves_bad_calls_to_the_slow_path(name, cleanup):
    # the real clock: a certain refusal is the gate's own answer here
    lim = shmlimit.Limiter(name, rates={"requests": ("1/h", 2), "tokens": ("1000/h", 1000)})
    cleanup.append(lim)
    assert lim.acquire(requests=1, tokens=600) and lim._fast is not None
    fast = lim._fast
    for call, error in [
        (lambda: lim.try_acquire(tokenz=1), TypeError),  # a name not a rate's
        (lambda: lim.acquire(2, tokens=1), TypeError),  # n and costs
        (lambda: lim.acquire(tokens=0), ValueError),  # nothing to take
        (lambda: lim.acquire(tokens=-1), ValueError),
        (lambda: lim.acquire(tokens=True), TypeError),  # a bool is no count of ops
        (
            lambda: lim.acquire(requests=1, timeout=-1),
            ValueError,
        ),  # grantable now, but a bad timeout
        (lambda: lim.acquire(requests=1, timeout=float("nan")), ValueError),
        (lambda: lim.try_acquire(0), ValueError),
    ]:
        with pytest.raises(error):
            call()
    assert lim.try_acquire(tokens=400) and lim._fast is fast  # granted by the gate
    assert not lim.try_acquire(
        requests=1, tokens=1
    )  # tokens are gone for an hour: refused, all or nothing
    assert not lim.acquire(requests=1, tokens=1, timeout=0.01)
    assert lim.stats().grants == {"requests": 1, "tokens": 1000}
    assert lim.try_acquire(requests=1)  # the request the refusals looked at is still there
    assert lim.stats().grants == {"requests": 2, "tokens": 1000}


@pytest.mark.parametrize(
    "text, expected",
    [
        ("5000/h; 100/min", ["5000/h", "100/min"]),
        (
            "requests=500/min; tokens=200K/min burst=20K",
            {"requests": "500/min", "tokens": ("200K/min", 20000.0)},
        ),
        (" 10/s ;50/5s burst=3 ", ["10/s", ("50/5s", 3.0)]),
    ],
)
def test_rates_as_one_string(name, clock, cleanup, text, expected):
    from shmlimit.rate_group import rates_from_text

    assert rates_from_text(text) == expected
    lim = make(name, text, clock)
    cleanup.append(lim)
    assert lim.keys == (
        tuple(expected)
        if isinstance(expected, dict)
        else tuple(str(i) for i in range(len(expected)))
    )
    assert lim.__reduce__()[1][4] == expected  # a string's rates pickle as the rates they stand for


@pytest.mark.parametrize(
    "text",
    [
        "a=1/s; 2/s",
        "1/s;;2/s",
        "1/s burst",
        "a=1/s; a=2/s",
        "1/s burst=1/min",
        "1/s burst=1/s",
        "1/s x=2",
        "",
    ],
)
def test_bad_rate_strings_are_refused(name, clock, text):
    with pytest.raises(ValueError, match="rates"):
        shmlimit.Limiter(name, rates=text, clock=clock)
    assert not [n for n in shmlimit.list_names() if n.startswith(name)]


def test_a_reservation_over_several_rates_holds_each_rate_to_its_promise(name, clock, cleanup):
    """A reservation covered at once on its fast rate and due a second later on its slow one uses
    its fast op at the promise: the fast rate's fence (stored before that claim, covered or not)
    holds the waiters behind it there until the promise, then lets them on at the rate.  Without
    it, a waiter behind on the fast rate was granted 0.1 s on, and the held op with the next one
    at the promise: two fast ops at one instant where the capacity allows one."""
    lim = make(name, {"fast": ("10/s", 1), "slow": ("1/s", 1)}, clock)
    cleanup.append(lim)
    fast = lim._live()[0]
    lim._live()[1].bucket.burn()  # the slow rate empty: its op a second away
    promised = lim.reserve(fast=1, slow=1)
    assert promised >= 1.0
    assert fast.bucket.balance() <= 0  # the fast op taken at once
    behind = request(lim, fast=1)
    assert behind.begin() is not True
    advance(lim, clock, promised + 0.1 - 0.003)
    assert behind.next() is not True  # held: the fence until the promise, then an op at the rate
    advance(lim, clock, 0.005)
    assert behind.next() is True
    behind.end()


def test_reservations_over_several_rates_are_promised_no_stop_late(name, clock, cleanup):
    """A reservation over several rates is promised when the head gets there on each rate: its
    claims' waiters' records are freed (the reservation made) before the promise is computed.
    Computed while they were held, each counted as a stop on the way (``count_stops``: half the
    capacity, 250 ms here): the second of two reservations of 100 ops at 1 000/s was promised
    0.35 s after the first, and its fences held the head that long behind it."""
    lim = make(name, {"a": (1000, 500), "b": (1000, 500)}, clock)
    cleanup.append(lim)
    assert lim.reserve(a=500, b=500) == 0.0  # both full buckets
    first = lim.reserve(a=100, b=100)
    second = lim.reserve(a=100, b=100)
    assert second - first == pytest.approx(0.1, abs=1e-6)  # 100 ops later, at 1 000/s
    for att in lim._live():
        b = att.bucket
        assert b.promised_ns(b.taken()) - clock.now == pytest.approx(second * 1e9, abs=1e3)
        assert not any(att.cells.load(off) for off in b._record_lens())  # every record free


class _ReplenishAtFirstHeadCas:
    """A bucket's cells whose first CAS of the head finds a replenish landed first: ``gain``
    tokens are added to the head just before it (everything else goes to the real cells)."""

    def __init__(self, cells, gain):
        self._cells, self.gain = cells, gain

    def __getattr__(self, attr):
        return getattr(self._cells, attr)

    def cas(self, off, expected, new):
        if off == L.HEAD and self.gain:
            self._cells.store(L.HEAD, (self._cells.load(L.HEAD) + self.gain) & MASK64)
            self.gain = 0
        return self._cells.cas(off, expected, new)


@pytest.mark.parametrize("landed_ops", [3, 8])
def test_a_give_back_counts_a_replenish_that_beat_its_cas(name, clock, landed_ops):
    """``Bucket.give_back`` (the protocol's ``give_back`` of tokens a refused or interrupted
    request held) returns ``tokens`` less what the head gained since they were taken, and a
    replenish landing between its read of the head and its CAS is such a gain: the head ends at
    ``max(where the replenish left it, head_then + tokens)``.  Read once, the give-back put all
    5 ops back on top of the replenish: the head 8 ops past ``head_then`` where 5 is the most, or
    13 where 8 is (the bucket's room, 15 ops, no clamp on either)."""
    lim = shmlimit.Limiter(name, rate=1, burst=15, clock=clock)
    try:
        att = lim._att
        b = att.bucket
        lim.drain()
        for _ in range(6000):  # 6 s as the filler sees it: six ops' time
            clock.advance(S // 1000)
            b.replenish()
        c = b.cost
        assert diff(b.head(), b.taken()) >= 5 * c  # (a little under 6: the replenishes' rounding)
        head_then = b.head()
        assert b.try_grab(5 * c, att.grants_off, 0)  # taken, covered, and then not used
        cells = b.cells
        b.cells = raced = _ReplenishAtFirstHeadCas(cells, landed_ops * c)
        try:
            b.give_back(5 * c, head_then)
        finally:
            b.cells = cells
        assert raced.gain == 0  # the replenish did land between the give-back's read and its CAS
        assert diff(b.head(), head_then) == max(landed_ops, 5) * c
    finally:
        lim.close()
