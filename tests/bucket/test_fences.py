"""Reservation fences (shmlimit/bucket/fences.py): what the waiters behind one do, and hostile fence words."""

import time
import types

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.clock import FakeClock

import shmlimit
import shmlimit.shm.layout as L
from shmlimit.acquire.single import Request
from shmlimit.bucket.rovers import diff
from shmlimit.shm.words import fence_horizon_ns

MS = 1_000_000


def _late_fence(lim):
    """At 100/s, burst 1: a waiter queues 0.5 s, a reservation of one op behind it, and the waiter
    leaves (its range skipped at once): the head may reach the reservation's ticket an op on, but its
    fence holds it there until the promise, about 0.5 s on.  Answers (ticket, promise ns)."""
    att = lim._att
    b = att.bucket
    lim.drain()
    ahead = Request(att, 50, None)
    assert ahead.begin() is not True
    wait = lim.reserve()
    promise = att.clock() + wait * 1e9
    ticket = b.taken()
    ahead.end()  # interrupted: its range is given back and skipped (the head is at its start)
    assert wait >= 0.5
    return ticket, promise


def test_a_python_waiter_behind_a_fence_is_due_when_it_lifts(name):
    """``due_ns`` counts the fence: a waiter an op behind the reservation looks once, an op after the
    promise, not every op's time until then (each look a replenish that adds nothing)."""
    clock = FakeClock()
    lim = shmlimit.Limiter(name, rate=100, burst=1, clock=clock)
    try:
        b = lim._att.bucket
        ticket, promise = _late_fence(lim)
        mine = b.grab(b.cost, lim._att.grants_off, 1)
        assert mine == (ticket + b.cost) & (2**64 - 1)
        clock.advance(
            20 * MS
        )  # the head could be at the reservation's ticket and past it by now ...
        b.replenish()
        assert diff(b.head(), ticket) <= 0  # ... the fence holds it at the ticket
        assert b.due_ns(mine) >= promise + 10 * MS - 1  # due an op after the promise
        while (
            clock.now < promise + 9 * MS
        ):  # the filler's ticks: held at the ticket until the promise
            clock.advance(MS)
            b.replenish()
            assert diff(b.head(), mine) < 0
        clock.now = int(promise) + 10 * MS + 1
        b.replenish()
        assert diff(b.head(), mine) >= 0  # and covered an op after it
    finally:
        lim.close()


# the native wait's naps over 0.2 real seconds, ended before a promise ~0.5 s away
@pytest.mark.slow
def test_a_native_waiter_behind_a_fence_sleeps_until_it_lifts(name):
    """The native wait's deadline counts the fence too: waiting 0.2 s behind a fence that lifts in
    about 0.5 s, it sleeps once (or twice), where a deadline at the head's linear time had it wake
    and replenish in vain every op's time (10 ms) until then: 20 naps."""
    lim = shmlimit.Limiter(name, rate=100, burst=1)
    try:
        att = lim._att
        b = att.bucket
        waiter = b.waiter(b.snap, att.grants_off, None, 1000)
        if waiter is None:
            pytest.skip("the atomics backend waits in Python (due_ns: the test above)")
        ticket, promise = _late_fence(lim)
        mine = b.grab(b.cost, att.grants_off, 0)
        before = waiter.naps
        until = time.monotonic_ns() + 200 * MS
        flags = waiter.wait(mine, 1, until, False)
        assert not flags & 1  # not granted: the fence holds it past the wait's end
        assert time.monotonic_ns() >= until
        assert waiter.naps - before <= 3, f"{waiter.naps - before} naps in 0.2 s behind a fence"
        assert time.monotonic_ns() < promise  # (the reservation's promise had not come yet)
    finally:
        lim.close()


def _fence_words(slots):
    base = L.fence_offset(slots)
    return [base, base + 8] + [
        off + w
        for off in L.fence_records(slots)
        for w in (L.FENCE_START, L.FENCE_LIMIT, L.FENCE_DUE, L.FENCE_TOKENS)
    ]


def test_a_fence_no_reservation_left_is_ignored(name):
    """A record whose DUE is beyond any promise (twice the longest queue's schedule and 10 s on) or
    whose LIMIT is further than a queue from the head was left by no reservation (a corrupt or
    hostile segment): it holds nothing, and the head moves at the rate."""
    clock = FakeClock()
    lim = shmlimit.Limiter(name, rate=1000, burst=1, clock=clock)
    try:
        b = lim._att.bucket
        c = b.cells
        lim.drain()
        clock.advance(MS)
        b.replenish()  # (the interval after the drain is lost to the clamp: the next is whole)
        lim.drain()
        rec0, rec1 = L.fence_records(L.DEFAULT_SLOTS)[:2]
        c.store(rec0 + L.FENCE_LIMIT, b.head())
        c.store(rec0 + L.FENCE_DUE, clock.now + fence_horizon_ns(b.tpn) + 10**9)
        c.store(rec1 + L.FENCE_LIMIT, (b.head() + (1 << 63)) & (2**64 - 1))
        c.store(rec1 + L.FENCE_DUE, clock.now + 10**9)
        c.store(
            L.fence_offset(L.DEFAULT_SLOTS), 2**64 - 1
        )  # the hint: every claim reads the records
        head = b.head()
        clock.advance(MS)
        assert b.replenish() > 0 and diff(b.head(), head) == b.cost
    finally:
        lim.close()


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    words=st.lists(st.tuples(st.integers(0, 2 + 4 * 64 - 1), st.integers(0, 2**64 - 1)), max_size=8)
)
def test_any_fence_words_leave_every_call_working(name, words):
    """Any 64-bit values in the fence table (hint, starts, limits, dues, tokens): every call answers (no
    crash, no hang, nothing outside the mapping); a bogus fence holds the head, never moves it."""
    clock = FakeClock()
    lim = shmlimit.Limiter(name, rate=1000, burst=2, clock=clock)
    try:
        b = lim._att.bucket
        offs = _fence_words(L.DEFAULT_SLOTS)
        for k, value in words:
            b.cells.store(offs[k], value)
        head = b.head()
        clock.advance(5 * MS)
        b.replenish()
        assert 0 <= diff(b.head(), head) <= b.cap  # never beyond the clamp
        lim.try_acquire()
        lim.acquire(timeout=0)
        lim.reserve(max_wait=0.01)
        b.due_ns(b.taken())
        b.promised_ns(b.taken())
        lim.stats()
    finally:
        lim.close()


def test_a_timed_acquire_behind_a_fence_takes_nothing_when_it_would_outwait_its_timeout(name):
    """The gate of the timed fast path does not queue while a fence may be in force (undecided), and
    the slow path's wait counts the fence: 50 ms behind a fence that lifts in about 0.5 s, a timed
    acquire of 0.1 s is refused at once, its ticket never taken (the head's linear time said 10 ms)."""
    clock = FakeClock()
    lim = shmlimit.Limiter(name, rate=100, burst=1, clock=clock)
    try:
        att = lim._att
        b = att.bucket
        _late_fence(lim)
        clock.advance(20 * MS)
        b.replenish()
        gate = b.gate(b.snap, att.grants_off)
        tail = b.taken()
        assert gate.grab_within(0.1) is None  # undecided: the slow path decides
        assert lim.acquire(timeout=0.1) is False
        assert b.taken() == tail  # nothing taken
    finally:
        lim.close()


def test_a_reservation_with_every_fence_record_in_use_waits_for_the_soonest_due(name, monkeypatch):
    """64 reservations pending hold every record: a 65th with a ``max_wait`` shorter than the soonest
    DUE is refused at once, taking nothing; without one it waits (naps, the clock moving with them)
    until that DUE has passed and a claim after it frees the record, and is promised after it."""
    import shmlimit.bucket.fences as fences

    clock = FakeClock()
    lim = shmlimit.Limiter(name, rate=1000, burst=1, clock=clock)
    try:
        b = lim._att.bucket
        lim.drain()
        promises = [clock.now + lim.reserve() * 1e9 for _ in range(L.FENCE_RECORDS)]
        assert b.fences.take(b.cells.load(L.REPL_TS)) is None  # every record in use
        soonest = b.fences.earliest_due()
        assert soonest == pytest.approx(min(promises), abs=2)
        tail = b.taken()
        assert lim.reserve(max_wait=(soonest - clock.now) / 1e9 / 2) is None
        assert b.taken() == tail
        naps = []

        def nap(seconds):  # the reserving thread sleeps: the clock moves, the filler ticks
            naps.append(seconds)
            clock.advance(max(1, int(seconds * 1e9)))
            b.replenish()

        monkeypatch.setattr(
            fences, "time", types.SimpleNamespace(sleep=nap)
        )  # (this module's naps only)
        wait = lim.reserve()
        at = clock.now + wait * 1e9
        assert naps and clock.now > soonest
        assert at >= max(promises) + MS  # its ticket is an op behind all 64
    finally:
        lim.close()


def test_a_reservation_that_napped_for_a_fence_record_has_that_much_less_to_wait(monkeypatch):
    """With every fence record in use a reservation naps until the soonest DUE has passed (read on
    the clock), then takes its ticket: its nap is part of its wait, so the ticket's bound is what
    is left of ``max_wait``.  It was the whole ``max_wait`` again: ``reserve`` could answer a wait
    within the bound whose op came later than that after the call."""
    import shmlimit.bucket.fences as fences

    now = [10**12]
    bounds = []

    class Bucket:  # the few calls fenced_ticket makes: the first take finds every record in use
        fences = types.SimpleNamespace(earliest_due=lambda: now[0] + 30 * MS)

        def take_within(self, tokens, max_wait_ns, fence):
            bounds.append(max_wait_ns)
            if len(bounds) == 1:
                return fences.NO_FENCE, None
            fence.promise = now[0] + 10 * MS
            return 7, None

        def replenish(self):
            return 0

    def nap(seconds):
        now[0] += int(seconds * 1e9)

    monkeypatch.setattr(fences, "time", types.SimpleNamespace(sleep=nap))
    assert fences.fenced_ticket(Bucket(), lambda: now[0], lambda: None, 1, 100 * MS)[0] == 7
    assert bounds == [100 * MS, 100 * MS - 30 * MS]  # the 30 ms napped, counted
