"""The acquisition core, step by step on a fake clock: no test here sleeps to make time pass.

A ``Request`` never sleeps: each step answers granted, refused, or how long to
park.  Here the test parks by advancing the limiter's injected clock in 1 ms
steps, replenishing at each as the filler would, so every schedule (tickets,
backpressure, capped admission, stop/start, reservations, catch-up, a rate
change) is checked exactly.  (The clock jumping far in one step with nobody
replenishing would lose that interval: the documented price of the
replenish clamp after a drained bucket.)
"""

import asyncio
import os
import threading

import pytest
from support.clock import FakeClock
from support.windows import excess_over_rate

import shmlimit
from shmlimit.acquire.single import CAPPED_NAP, Request
from shmlimit.bucket.rovers import Bucket, diff
from shmlimit.bucket.schedule import LONGEST_FILL_NS, stop_ns

MS = 1_000_000  # ns


@pytest.fixture
def clock():
    return FakeClock()


def open_limiter(name, clock, **kw):
    return shmlimit.Limiter(name, clock=clock, **kw)


def me(lim):
    [p] = [p for p in lim.stats().processes if p.pid == os.getpid()]
    return p


def on_time(parked, due):
    """Parked until ``due``: a waiter sleeps to 1 ns past its turn, so that its turn has come."""
    return due <= parked <= due + 10


def tick(lim, clock, ns):
    """Let ``ns`` of time pass in steps of at most 1 ms, replenishing after each (the filler's work)."""
    while ns > 0:
        step = min(ns, MS)
        clock.advance(step)
        lim._att.bucket.replenish()
        ns -= step


def drive(lim, req, clock, limit=10_000):
    """Park by letting time pass exactly as long as the request asks; return (result, ns parked)."""
    parked = 0
    step = req.begin()
    try:
        for _ in range(limit):
            if step is True or step is False:
                return step, parked
            ns = max(1, int(round(step * 1e9)))
            tick(lim, clock, ns)
            parked += ns
            step = req.next()
        raise AssertionError("the request never finished")
    finally:
        req.end()


def test_a_ticket_waits_exactly_its_deficiency_and_shows_waiting(name, clock):
    lim = open_limiter(name, clock, rate=1000, burst=10, initial=1)  # one op now, then one per ms
    try:
        att = lim._att
        req = Request(att, 3, None)
        nap = req.begin()
        assert nap == pytest.approx(0.002)  # 2 ops short at 1 ms each
        assert me(lim).waiting is True  # queued: its slot says so
        clock.advance(1 * MS)
        assert req.next() == pytest.approx(0.001)  # it replenished by itself: one op short now
        clock.advance(1 * MS)
        assert req.next() is True
        req.end()
        assert me(lim).waiting is False
        assert me(lim).grants == 3
    finally:
        lim.close()


def test_a_timed_request_that_cannot_fit_takes_nothing(name, clock):
    lim = open_limiter(name, clock, rate=1000, burst=10, initial=1)
    try:
        att = lim._att
        tail = att.bucket.balance()
        assert drive(lim, Request(att, 5, 0.0035), clock) == (False, 0)  # 4 ms short > 3.5 ms
        assert att.bucket.balance() == tail and me(lim).grants == 0
        ok, parked = drive(
            lim, Request(att, 5, 0.004), clock
        )  # exactly fits: a ticket, then the wait
        assert ok and on_time(parked, 4 * MS) and me(lim).grants == 5
    finally:
        lim.close()


def test_max_reserved_waits_to_join_taking_nothing(name, clock):
    lim = open_limiter(name, clock, rate=1000, burst=10, initial=0, max_reserved=0.002)
    try:
        att = lim._att
        assert [lim.reserve(), lim.reserve()] == [pytest.approx(0.001), pytest.approx(0.002)]
        assert lim.reserve() is None  # the queue is 2 ms deep: full
        req = Request(att, 1, None)
        nap = req.begin()
        assert nap == pytest.approx(0.001) and req.ticket is None  # backpressure: no ticket yet
        assert me(lim).waiting is False  # not queued while it waits to join
        ok, parked = drive(lim, req, clock)
        assert ok and on_time(
            parked, 3 * MS
        )  # joins after 1 ms (the queue is 2 ms deep again), served at 3 ms
    finally:
        lim.close()


def test_a_request_parked_before_its_take_pays_the_price_in_force_at_the_take(name, clock):
    """A request waiting to join (``max_reserved``), to be admitted (capped) or for a record takes
    nothing while it parks; a ``set_rate`` meanwhile re-prices its ops.  Priced when it was made,
    it took its ticket at the old price: 1 op of 1 ms at 1000/s where 500/s charges 2 ms."""
    lim = open_limiter(name, clock, rate=1000, burst=10, initial=0, max_reserved=0.002)
    try:
        b = lim._att.bucket
        assert lim.reserve() is not None and lim.reserve() is not None  # the queue is full
        req = Request(lim._att, 1, None)
        assert req.begin() == pytest.approx(0.001) and req.ticket is None  # waits to join
        lim.set_rate(500, burst=10)  # an op costs twice as many tokens now
        tick(lim, clock, 2 * MS)  # the queue served: room for an op of 2 ms
        tail = b.taken()
        assert req.next() is not True and req.ticket is not None  # joins, at the new price
        assert diff(b.taken(), tail) == b.cost == req.tokens
        req.end()
    finally:
        lim.close()


def test_capped_requests_wait_for_a_release_holding_no_ticket(name, clock):
    lim = open_limiter(name, clock, rate=1000, burst=2, capped=True)
    try:
        att = lim._att
        assert lim.acquire(2)
        req = Request(att, 1, None)
        assert req.begin() == CAPPED_NAP and req.ticket is None
        tick(lim, clock, 10 * MS)
        assert req.next() == CAPPED_NAP  # time alone does not admit it: only a release does
        lim.release(1)
        assert req.next() is True  # admitted, and the tokens had accrued
        req.end()
        timed = Request(att, 1, 0.0)
        assert timed.begin() is False  # no room and no time to wait: refused, nothing held
        timed.end()
        assert att.bucket.in_flight() == 2
    finally:
        lim.close()


def test_stop_and_start_on_a_fake_clock(name, clock):
    lim = open_limiter(name, clock, rate=100, burst=1)
    try:
        assert lim.try_acquire()
        lim.stop()
        tick(lim, clock, 10**9)  # a second stopped: no time accrues
        assert not lim.try_acquire()
        assert lim.reserve(max_wait=10) is None  # no computable wait while stopped
        assert lim.retry_after() == float("inf")
        lim.start()  # from an empty bucket: the paused second is not owed
        assert not lim.try_acquire()
        tick(lim, clock, 10 * MS - 1)
        assert not lim.try_acquire()
        tick(lim, clock, 1)
        assert lim.try_acquire()
    finally:
        lim.close()


def test_reservations_are_spaced_exactly_on_a_fake_clock(name, clock):
    lim = open_limiter(name, clock, rate=100, burst=5, initial=1)
    try:
        assert [lim.reserve() for _ in range(3)] == [0.0, pytest.approx(0.01), pytest.approx(0.02)]
        tick(lim, clock, 15 * MS)
        assert lim.reserve() == pytest.approx(0.015)  # 30 ms after the first, 15 of them gone
        assert lim.reserve(max_wait=0.0249) is None  # taking nothing
        assert lim.reserve(max_wait=0.025) == pytest.approx(0.025)
    finally:
        lim.close()


def test_a_reservation_is_never_promised_past_its_max_wait(name, clock):
    """A ticket of 2 ops at 50/s, burst 1, behind an empty bucket is promised 60 ms away (longer
    than the 40 ms its tokens take: the head moves a capacity at most per replenish).  The bound
    was checked against the shorter estimate, and ``reserve(2, max_wait=0.05)`` returned 0.06."""
    lim = open_limiter(name, clock, rate=50, burst=1)
    try:
        assert lim.reserve() == 0.0
        grants = lim.stats().grants
        assert lim.reserve(2, max_wait=0.05) is None  # taking nothing
        assert lim.stats().grants == grants
        assert lim.reserve(2, max_wait=0.061) == pytest.approx(0.06)
    finally:
        lim.close()


def test_retry_after_is_the_soonest_and_a_promise_at_most_a_fill_pause_later(name, clock):
    """``retry_after(n)`` is advice: the soonest ``n`` ops could come.  A promise is a grant, so
    where no replenish can add tokens before the next one (a full bucket, ``n`` above the burst)
    it counts the filler's longest pause too (docs/kinds/limiter.md): ``reserve(n,
    max_wait=retry_after(n))`` refuses there, taking nothing, and the promise is at most that
    pause later."""
    lim = open_limiter(name, clock, rate=50, burst=1)
    try:
        tick(lim, clock, 100 * MS)  # idle: the bucket is full
        soonest = lim.retry_after(2)
        assert soonest == pytest.approx(0.02)
        grants = lim.stats().grants
        assert lim.reserve(2, max_wait=soonest) is None
        assert lim.stats().grants == grants  # nothing taken
        promise = lim.reserve(2, max_wait=soonest + LONGEST_FILL_NS / 1e9)
        assert soonest < promise <= soonest + LONGEST_FILL_NS / 1e9
    finally:
        lim.close()


def test_a_reservation_longer_than_its_fence_can_hold_is_refused_taking_nothing(name):
    # burst 1 at 100 000/s: a capacity under two fill intervals moves the head at the filler's
    # pace (half an op a ms), so reserve(n) waits 2 ms an op.  A fence holds at most twice the
    # longest queue's schedule at the rate (here 39 h): a promise past that would lift its fence
    # early, and a head moved faster by waiters would grant those behind it before it.
    lim = shmlimit.Limiter(name, rate=100_000, burst=1)
    try:
        lim.drain()
        assert 19_000 < lim.reserve(10**7) < 21_000  # 5.6 h: held
        grants = lim.stats().grants  # (a reservation counts as granted when made)
        for max_wait in (None, 1e7):
            with pytest.raises(ValueError, match=r"longer than a reservation can be held \(1407"):
                lim.reserve(10**8, max_wait=max_wait)  # 61 h
        assert lim.stats().grants == grants  # nothing taken
    finally:
        lim.close()


class PreemptedReplenisher:
    """Another process's replenisher (the production ``Bucket.claim``, in a thread) that read
    REPL_TS, the snapshot, the rovers and the clock, and was preempted before its CAS on REPL_TS;
    ``land()`` lets it go on (its CAS, its snapshot) and adds what it claimed."""

    def __init__(self, lim, clock):
        self.read, self.go = threading.Event(), threading.Event()
        at = clock.now

        def parked_clock():
            self.read.set()
            self.go.wait(10)
            return at

        self.bucket = Bucket(lim._att.cells, parked_clock)
        self.claim = None
        self.thread = threading.Thread(
            target=lambda: setattr(self, "claim", self.bucket.claim()), daemon=True
        )
        self.thread.start()
        assert self.read.wait(10)

    def land(self):
        self.go.set()
        self.thread.join(10)
        assert not self.thread.is_alive()
        if self.claim is not None:
            self.bucket.apply(self.claim)


def test_a_reservation_is_never_promised_time_the_bucket_spent_full(name, clock):
    """A full bucket of one op at 50/s; a replenisher reads it and is preempted before its CAS; an
    op is granted from the bucket 18.8 ms later (no replenish: the filler backed off while full);
    then a reserve() whose replenish loses its claim to that replenisher's CAS, landing meanwhile.
    REPL_TS is then 18.8 ms old and the snapshot predates the grant: the next replenish drops that
    time (the bucket was full).  The reservation is due 1/rate after the grant, never sooner
    (counted from REPL_TS it was promised 1.2 ms after the grant: two ops within 1.2 ms, where
    the bound allows 1.06), and the head reaches it then, filled every ms."""
    lim = open_limiter(name, clock, rate=50, burst=1)
    try:
        lim.retry_after()  # a first use (taking nothing) starts the filler thread, stopped here:
        lim._att.filler.stop()  # this test plays the filler
        lim._att.filler.join(10)
        clock.advance(1 * MS)
        late = PreemptedReplenisher(lim, clock)
        clock.advance(18_800_000)
        assert lim.try_acquire()  # from the full bucket, replenishing nothing
        granted = clock.now
        bucket = lim._att.bucket
        own_clock = bucket.clock

        def landing():  # the reserve's replenish read REPL_TS; the preempted CAS lands first
            bucket.clock = own_clock
            late.land()
            return own_clock()

        bucket.clock = landing
        wait = lim.reserve()
        assert bucket.clock is own_clock  # the race happened inside reserve()
        promised = clock.now + wait * 1e9
        assert promised - granted >= 20 * MS - 1  # one op per 20 ms, the bucket holding one
        ticket = bucket.taken()
        tick(lim, clock, int(promised - clock.now) + 1)  # the filler's 1 ms replenishes
        assert bucket.covered(ticket)  # the head is there when promised
        assert lim.retry_after() == pytest.approx(0.02)  # and the next op 20 ms later still
    finally:
        lim.close()


def test_set_rate_reprices_new_grabs_and_keeps_queued_tickets(name, clock):
    lim = open_limiter(name, clock, rate=1000, burst=10, initial=0)
    try:
        att = lim._att
        queued = Request(att, 2, None)
        assert queued.begin() == pytest.approx(0.002)
        lim.set_rate(100, burst=10)  # ten times slower: 10 ms per op from now on
        ok, parked = drive(lim, queued, clock)
        assert ok and on_time(parked, 2 * MS)  # the queued ticket keeps its schedule
        ok, parked = drive(lim, Request(att, 1, None), clock)
        assert ok and on_time(parked, 10 * MS)
    finally:
        lim.close()


def test_catch_up_pays_back_at_most_ratio_times_the_rate(name, clock):
    rate, ratio = 1000, 2.0
    lim = open_limiter(name, clock, rate=rate, burst=10, ratio=ratio, initial=0)
    try:
        # nobody takes for 100 ms: the bucket holds its 10 ops plus the catch-up room of
        # capacity * (ratio - 1) = 10 more, and the other 80 ms go to the waiting pool
        tick(lim, clock, 100 * MS)
        assert lim.stats().behind_seconds == pytest.approx(0.08, abs=0.001)
        got = [lim.drain()]
        assert got == [20]
        for _ in range(50):  # 50 ms in 1 ms steps, taking everything each time
            tick(lim, clock, MS)
            got.append(lim.drain())
        # the interval after a drained bucket is lost (the clamp's price), then the backlog is
        # paid at exactly ratio x rate: 2 ops per ms, within ratio * (rate*T + capacity)
        assert got == [20, 0] + [2] * 49
        assert sum(got) <= ratio * (rate * 0.05 + 10)
        assert lim.stats().behind_seconds < 0.08 - 0.02
    finally:
        lim.close()


def test_an_async_waiter_shows_waiting_and_is_counted(name, clock):
    # on the injected clock the next op stays 50 ms away until the test moves it: however late
    # the task starts, it has a turn to wait for
    lim = shmlimit.Limiter(name, rate=20, burst=1, clock=clock)
    try:
        assert lim.try_acquire()  # empty now: the next op is 50 ms away

        async def main():
            task = asyncio.ensure_future(lim.acquire_async())
            for _ in range(100):  # until the task has taken its ticket
                await asyncio.sleep(0.001)
                if me(lim).waiting:
                    break
            seen = me(lim).waiting
            for _ in range(100):  # its turn: the clock moved on (a drained bucket may lose a step)
                if task.done():
                    break
                clock.advance(10 * MS)
                await asyncio.sleep(0.001)
            assert await task is True
            return seen

        assert asyncio.run(main()) is True
        assert me(lim).waiting is False and me(lim).grants == 2
    finally:
        lim.close()


def test_a_request_interrupted_while_queued_stops_showing_waiting(name, clock):
    lim = open_limiter(name, clock, rate=1000, burst=1)
    try:
        assert lim.try_acquire()
        req = Request(lim._att, 1, None)
        assert req.begin() > 0 and me(lim).waiting
        req.end()  # what the drivers do on KeyboardInterrupt or cancellation
        req.end()  # twice is harmless
        assert me(lim).waiting is False
    finally:
        lim.close()


class _BusyClock(FakeClock):
    """Every reading finds 1 us gone: the event loop runs other work between any two steps."""

    def __call__(self):
        self.now += 1_000
        return self.now


def test_an_async_ticket_wait_sleeps_to_its_instant_without_a_floor(name, monkeypatch):
    """acquire_async parks a ticket until exactly its due instant, measured when the sleep
    starts (time spent before the await is not added), even when that is under MIN_NAP away."""
    from shmlimit.acquire import drivers as A

    clock = _BusyClock()
    lim = open_limiter(name, clock, rate=20_000, burst=1)  # an op is 50 us: less than MIN_NAP
    lim.acquire()  # the bucket is empty
    req = Request(lim._att, 1, None)
    naps = []

    async def fake_sleep(seconds):
        left = req.wake_ns - clock.now  # how far the due instant is, as the sleep starts
        naps.append((seconds, left))
        clock.advance(max(1, int(round(seconds * 1e9))))
        lim._att.bucket.replenish()

    monkeypatch.setattr(A.asyncio, "sleep", fake_sleep)
    assert asyncio.run(A.drive_async(req)) is True
    seconds, left = naps[0]
    assert seconds == left / 1e9 and 0 < seconds < A.MIN_NAP
    lim.close()


@pytest.mark.parametrize(
    "rate, burst, ahead", [(5000, 5, 1), (5000, 5, 50), (1000, 10, 3), (100_000, 1, 400)]
)
def test_a_reservation_right_after_a_skip_is_never_promised_before_the_head_gets_there(
    name, clock, rate, burst, ahead
):
    """A waiter leaves with the head at its start: the head skips its range at once, and the skip's
    own replenish claims nothing (the clock stood still), so the replenish words still name a head
    before the range and the next replenish adds nothing, whenever it comes.  A reservation made
    right then is due only after that replenish and the time after it: with the filler ticking
    every fill interval from now, a replenish at the promised moment (its holder's waiters behind
    it look then) covers its ticket.  Promised from now, it was a fill interval early."""
    lim = open_limiter(name, clock, rate=rate, burst=burst)
    try:
        att = lim._att
        b = att.bucket
        lim.drain()
        waiter = Request(att, ahead, None)
        assert waiter.begin() is not True
        waiter.end()  # interrupted: given back, skipped at once (the head was at its start)
        assert diff(b.taken(), b.head()) <= 0
        t0 = clock.now
        promise = t0 + lim.reserve() * 1e9
        ticket = b.taken()
        tick = t0
        while tick + MS < promise:  # the filler's ticks before the promised moment ...
            tick += MS
            clock.now = tick
            b.replenish()
        clock.now = (
            int(promise) + 1
        )  # ... and a replenish at it (1 ns for the float moment's rounding)
        b.replenish()
        assert diff(b.head(), ticket) >= 0, f"promised {promise - t0:.0f} ns after the skip: early"
        # later than from now by the filler's longest pause and a stop at most: lost time, nothing more
        assert promise - t0 <= b.estimate_wait_ns(b.cost) + LONGEST_FILL_NS + stop_ns(b.snap) + 2
    finally:
        lim.close()


# A promise is computed once, from the queue ahead as it stands then.  When the head could later
# reach the ticket sooner -- a range ahead given back and skipped (or, over several rates, tokens
# refunded) -- the reservation's fence (``shmlimit.bucket.fences``) holds the head at ``t + C - n`` until the
# promise: the holder's slot, used at its promise, never falls together with those behind it.


def _late_promise(lim, clock):
    """At 10/s, burst 1: 1 s of schedule queues (a waiter), a reservation behind it is promised at
    1.17 s (its op, the head's stop at the waiter's end, and the filler's longest pause: the clock
    stood still since the drain, so the next replenish adds nothing), the waiter leaves (its range is given back and skipped at once: the head is at its
    start), and reservations follow until one is promised as late as the first.  Their promised
    moments (ns, the first one's first) and the first one's lateness (ns): its promise less the
    head's arrival at its ticket, filled continuously from now on."""
    att = lim._att
    b = att.bucket
    lim.drain()
    ahead = Request(att, 10, None)
    assert ahead.begin() is not True
    first = clock.now + lim.reserve() * 1e9
    ticket = b.taken()
    ahead.end()  # interrupted: its range is given back
    arrival = clock.now + max(0, diff(ticket, b.head())) / b.tpn
    promises = [first]
    while len(promises) == 1 or promises[-1] < first - 1:
        promises.append(clock.now + lim.reserve() * 1e9)
    return promises, first - arrival


def test_a_late_promise_holds_those_behind_it_to_its_promise(name, clock):
    """A promise is never early (the model checks it) and late by what moved the head ahead of its
    ticket after it was made: here the 1 s given back ahead of it.  The fence holds the head at the
    ticket (burst 1: ``t + C - n`` is ``t``) until the promise, and lets it gain only at the rate
    after it: the next reservation is promised an op after the first, and a waiter behind both is
    granted an op after that, however soon the head could have got there."""
    lim = open_limiter(name, clock, rate=10, burst=1)
    try:
        att = lim._att
        promises, late = _late_promise(lim, clock)
        assert promises[0] - clock.now == pytest.approx(1.17e9, abs=1e3)
        assert late == pytest.approx(1.07e9, abs=1e3)  # the head could get there 1.07 s sooner
        assert len(promises) == 2  # the next one is promised after the first, no longer before it
        assert promises[1] - promises[0] == pytest.approx(1e8, abs=1e3)
        waiter = Request(att, 1, None)
        step = waiter.begin()
        granted = None
        for _ in range(2000):
            if step is True:
                granted = clock.now
                break
            tick(lim, clock, MS)
            step = waiter.next()
        waiter.end()
        assert granted is not None
        # the head reaches the waiter an op after the second promise (and a tick of 1 ms): not sooner
        assert promises[1] + 1e8 <= granted <= promises[1] + 1e8 + 2 * MS
        assert excess_over_rate(promises + [granted], 10, 1) <= 1e-6
    finally:
        lim.close()


def test_slots_used_at_their_promises_stay_within_rate_times_t_plus_capacity(name, clock):
    """The sequence of the defect fixed by the fences: the first reservation's slot, used at its
    promise (1.17 s), and those promised after it, stay within ``rate*T + capacity``; before the
    fences eleven more were promised 0.22 s to 1.22 s, three ops in 0.1 s where it allows two."""
    lim = open_limiter(name, clock, rate=10, burst=1)
    try:
        promises, _ = _late_promise(lim, clock)
        while len(promises) < 12:
            promises.append(clock.now + lim.reserve() * 1e9)
        assert excess_over_rate(promises, 10, 1) <= 1e-6
    finally:
        lim.close()
