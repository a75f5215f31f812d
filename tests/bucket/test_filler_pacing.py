"""The filler's pace while callers queue, on a fake clock (no test here sleeps).

Queued waiters refill the bucket at their own turns, so a filler that sees the
head keep the rate without it backs off (`ClockFeed.queued`).  These tests run
the filler's ticks and the waiters' turns as events on one injected clock and
check the two sides of that: it does back off when waiters keep the pace, and
no schedule it backs off on loses more than a sliver of time to the capacity
clamp -- tickets nobody refills for, tickets of many ops, a capacity under three ops.
"""

import heapq

import pytest
from support.clock import FakeClock

import shmlimit
from shmlimit.bucket import filler as F
from shmlimit.shm import layout as L

RETRY_NS = 20_000  # a due waiter still short looks again this much later (acquisition.RETRY_NS)


def simulate(
    name,
    rate,
    seconds,
    waiters=8,
    ops=1,
    burst=None,
    refill=True,
    late_ns=30_000,
    stop_refilling=None,
):
    """Run ``waiters`` callers saturating ``rate`` with the filler's ClockFeed for ``seconds`` of fake time.

    Each waiter holds one ticket of ``ops`` ops, wakes 1 ns after its due instant
    and, if still short, refills (``refill``: as the drivers do; without it the
    tickets are like reservations, which nobody refills for) and looks again at
    its new due instant; after ``stop_refilling`` seconds they stop refilling.  The filler ticks out of phase with the waiters and ``late_ns``
    after each pause it asks for, as a thread's sleeps end.  Returns (grants, the filler's
    pauses in seconds, the feed, the schedule time lost to the clamp under the queue in ns:
    ``STARVED_NS``).
    """
    clock = FakeClock()
    clock.tick_ns = (
        1  # a real clock moves between readings: a refill's second claim (the refresh) has its ns
    )
    kw = {} if burst is None else {"burst": burst}
    lim = shmlimit.Limiter(name, rate=rate, clock=clock, **kw)  # opening starts no filler thread
    try:
        b = lim._att.bucket
        feed = F.ClockFeed(b, None)
        tokens = b.cost * ops
        end = clock.now + int(seconds * 1e9)
        stop = end if stop_refilling is None else clock.now + int(stop_refilling * 1e9)
        grants = 0
        events = [(clock.now + 370_000, 0, -1)]  # (when, order, who): who -1 is the filler
        tickets = {}

        def take(w):
            nonlocal grants
            while True:
                t = b.grab(tokens, L.UNREG_GRANTS, ops)
                if t is not None:
                    tickets[w] = t
                    return
                grants += ops  # granted at once (the bucket's burst)

        for w in range(waiters):
            take(w)
            heapq.heappush(events, (int(b.due_ns(tickets[w])) + 1, w + 1, w))
        pauses = []
        while events:
            when, order, who = heapq.heappop(events)
            if when > end:
                break
            clock.advance(max(0, when - clock.now))
            if who < 0:
                pause = feed.tick()
                pauses.append(pause)
                heapq.heappush(events, (clock.now + int(pause * 1e9) + late_ns, order, -1))
                continue
            if not b.covered(tickets[who]) and refill and clock.now < stop:
                b.replenish()
            if b.covered(tickets[who]):
                grants += ops
                take(who)
                due = int(b.due_ns(tickets[who])) + 1
            else:
                due = max(int(b.due_ns(tickets[who])) + 1, clock.now + RETRY_NS)
            heapq.heappush(events, (max(due, clock.now + 1), order, who))
        return grants, pauses, feed, b.cells.load(L.STARVED_NS)
    finally:
        lim.close()


def owed(rate, seconds, burst_ops):
    """The grants a saturated limiter makes in ``seconds``: its burst, then the rate."""
    return burst_ops + rate * seconds


def test_the_filler_backs_off_while_waiters_keep_the_pace_and_no_time_is_lost(name):
    grants, pauses, feed, starved = simulate(name, rate=1000, seconds=5.0)
    # the head kept the rate (8 tickets still held at the end are not counted)
    assert owed(1000, 5.0, 10) - 8 - 1 <= grants <= owed(1000, 5.0, 10)
    # after a few doublings the filler looks only every MAX_FILL_PERIOD: ~250 ticks, not ~5000
    assert pauses[-1] == F.MAX_FILL_PERIOD
    assert len(pauses) < 400
    assert starved == 0  # no time lost


def test_tickets_nobody_refills_for_keep_the_filler_at_its_pace(name):
    # reservations, debt: only the filler refills, so it must keep every two refills within a capacity
    grants, pauses, feed, starved = simulate(name, rate=1000, seconds=2.0, refill=False)
    assert owed(1000, 2.0, 10) - 8 - 1 <= grants <= owed(1000, 2.0, 10)
    assert max(pauses[5:]) <= F.FILL_PERIOD


@pytest.mark.parametrize("rate, burst", [(50, None), (200, None), (1000, 1.5), (1000, 2.5)])
def test_under_three_ops_too_the_filler_backs_off_while_waiters_keep_the_pace(name, rate, burst):
    # the clamp counts a capacity from the start of the request the head stands in, and a refill
    # that brings the head to a stop claims again at once from there: refills once per op, at the
    # turns, keep the rate whatever the capacity, and the filler, seeing it, looks only every
    # MAX_FILL_PERIOD (the stops' own ns, 1 ns each here, are no loss).  (Not at a capacity of one
    # op at 1000/s: these tickets have no records, so a tick of ours inside a request leaves a clamp
    # counted from there, and the next refill at a turn loses what the tick had added; the real
    # waiters' records name their requests.  There the live filler goes back to its pace at the
    # first loss, which the test after next checks.)
    seconds = 4.0
    grants, pauses, feed, starved = simulate(name, rate=rate, seconds=seconds, burst=burst)
    b = feed.bucket
    assert b.cap < 3 * b.cost
    assert pauses[-1] == F.MAX_FILL_PERIOD and sum(
        p == F.MAX_FILL_PERIOD for p in pauses
    ) >= 0.9 * len(pauses)
    assert len(pauses) <= seconds / F.MAX_FILL_PERIOD + 5
    assert starved == 0  # no time lost
    # the rate kept: everything owed but the tickets still held at the end
    assert (
        owed(rate, seconds, b.cap / b.cost) - 8 - 2 <= grants <= owed(rate, seconds, b.cap / b.cost)
    )


@pytest.mark.parametrize("rate, burst", [(50, None), (200, None)])
def test_under_three_ops_tickets_nobody_refills_for_keep_the_filler_at_its_pace(name, rate, burst):
    grants, pauses, feed, starved = simulate(
        name, rate=rate, seconds=2.0, burst=burst, refill=False
    )
    b = feed.bucket
    assert max(pauses[5:]) <= max(F.FILL_PERIOD, 0.5 / rate) + 1e-9  # the usual pace: half an op
    assert feed.pace == F.FIXED  # kept natively between the thread's Python passes
    assert owed(rate, 2.0, b.cap / b.cost) - 8 - 1 <= grants <= owed(rate, 2.0, b.cap / b.cost)


def test_a_loss_beyond_the_slack_sends_the_backed_off_filler_back_to_its_pace(name):
    # a capacity of one op (50/s): every ticket is a stop, and the clamp drops what a refill at a turn
    # is late by.  A stop's own ns are no loss; a wake later than LOSS_SLACK of the usual pace is,
    # and the filler that had backed off ticks at its usual pace next
    clock = FakeClock()
    lim = shmlimit.Limiter(name, rate=50, clock=clock)
    try:
        feed = F.ClockFeed(lim._att.bucket, None)
        b = feed.bucket
        period = feed.usual()
        assert period == 0.01 and b.cap == b.cost
        ts0, head0 = 10**12, 5 * b.cost
        interval = 20_000_000  # backed off: a pause of MAX_FILL_PERIOD since our last tick
        for lost_ns, seen in [
            (0, False),
            (400, False),
            (F.slack_ns(period), False),
            (F.slack_ns(period) + 1, True),
            (8_000_000, True),
        ]:
            feed.idle = F.MAX_FILL_PERIOD
            feed.mark = (ts0 + interval, head0 + (interval - lost_ns) * b.tpn, True)
            assert feed.lost(period, (ts0, head0, True)) is seen, lost_ns
            before = ts0 + interval - 1  # someone else refilled since our last tick
            pause = feed.queued(period, before, (ts0, head0, True))
            assert pause == (period if seen else F.MAX_FILL_PERIOD), lost_ns
    finally:
        lim.close()


def test_the_loss_slack_is_a_share_of_the_usual_pace():
    assert F.slack_ns(0.01) == 1_250_000 and F.slack_ns(F.FILL_PERIOD) == 125_000


def test_tickets_of_many_ops_keep_their_pace(name):
    # 8-op tickets are 8 ms apart at 1000/s, more than half the 10 ms capacity: the waiters'
    # own refills could not keep the rate alone, and nothing is lost
    grants, pauses, feed, starved = simulate(name, rate=1000, seconds=5.0, ops=8)
    assert owed(1000, 5.0, 10) - 8 * 8 - 8 <= grants <= owed(1000, 5.0, 10)


def test_a_pace_lost_while_backed_off_costs_at_most_one_pause(name):
    # waiters keep the pace, the filler backs off to 20 ms; then nobody else refills (the
    # callers became reservations): 20 ms pauses under a 10 ms capacity lose time, once
    grants, pauses, feed, starved = simulate(name, rate=1000, seconds=2.0, stop_refilling=1.5)
    assert F.MAX_FILL_PERIOD in pauses
    assert 0 < starved <= (F.MAX_FILL_PERIOD - 0.010) * 1e9  # one pause beyond the capacity
    assert max(pauses[-100:]) <= F.FILL_PERIOD  # back at its pace: only the filler refills now
    # the loss: at most one capacity of schedule (10 ops)
    assert owed(1000, 2.0, 10) - 10 - 8 - 1 <= grants <= owed(1000, 2.0, 10)


def test_the_filler_refills_in_one_native_call_bound_to_the_config_in_force(name):
    lim = shmlimit.Limiter(name, rate=1000)  # the real clock; opening starts no filler thread
    try:
        b = lim._att.bucket
        feed = F.ClockFeed(b, None)
        native = b.waiter(b.snap, L.UNREG_GRANTS, None, 1) is not None  # the native backend's
        assert b.grab(b.cap + 5 * b.cost, L.UNREG_GRANTS, 1) is not None  # a queue
        ts0, head0 = F._refilled(b)
        added = feed.refill()
        ts1, head1 = F._refilled(b)
        assert (feed.native is not None) == native
        assert ts1 > ts0 and added == head1 - head0 and 0 <= added <= (ts1 - ts0) * b.tpn
        seq = b.snap.seq
        lim.set_rate(500)  # a new config: the next refill binds to it (or refills in Python)
        b.refresh()
        feed.refill()
        assert feed.native_seq == b.snap.seq != seq
        assert (feed.native is not None) == native
        lim.stop()  # stopped: no native refill is made for it, and the Python one adds nothing
        b.refresh()
        ts0, head0 = F._refilled(b)
        assert feed.refill() == 0 and feed.native is None and F._refilled(b)[1] == head0
    finally:
        lim.close()


def test_promises_count_the_fillers_longest_pause():
    # promised_ns counts the filler's longest pause for a replenish that adds nothing: the two agree
    from shmlimit.bucket import filler, schedule

    assert schedule.LONGEST_FILL_NS == round(filler.MAX_FILL_PERIOD * 1e9)


def test_a_watchers_wake_sets_waits_and_clears_as_an_event():
    """The watcher's wait (``filler._Wake``, one lock held while not set): a set before the wait
    ends it at once; two sets make one wake, not two; a clear after a set leaves the next wait to
    its timeout, as does a clear of nothing; a set from another thread ends a wait in progress."""
    import threading

    w = F._Wake()
    assert w.wait(0) is False
    w.set()
    w.set()
    assert w.wait(0) is True
    assert w.wait(0) is False  # not counted: one wake for both
    w.set()
    w.clear()
    assert w.wait(0) is False
    w.clear()
    assert w.wait(0) is False
    t = threading.Thread(target=w.set)
    t.start()
    assert w.wait(60) is True  # the set ended it (a timeout answers False)
    t.join(10)
