"""Refunds and reservation fences: a refund (``settle`` of a negative delta, a give-back) is cut by
a reservation's fence only where giving it back would let the head grant someone before the
reservation's promise; over ranges no one is granted by the head's reaching them (debt, other
reservations) it lands whole.  On an injected clock, on the backend the suite runs."""

import pytest
from support.clock import FakeClock
from support.feeder_hosts import Host, R, clock  # noqa: F401  (fixtures: a hierarchical host on a fake clock)
from support.windows import check_windows

import shmlimit
import shmlimit.shm.layout as L
from shmlimit.acquire.single import Request
from shmlimit.bucket.rovers import diff

MS = 1_000_000


def _balance(b):
    """HEAD - TAIL in tokens (negative: owed to the queue)."""
    return diff(b.head(), b.taken())


def test_a_charge_then_its_refund_lose_nothing_behind_a_reservation(name, cleanup):
    """``settle(+1000)`` then ``settle(-1000)`` while a ``reserve()`` is outstanding leave the rovers
    where they were: the refund goes back over the debt the charge queued behind the reservation,
    which no one is granted.  It was cut at the reservation's fence (``t + C - n``): 800 of the
    1000 tokens lost, the schedule of everyone after 0.8 s late."""
    clock = FakeClock()
    lim = shmlimit.Limiter(name, rates=[(1000, 500)], clock=clock)
    cleanup.append(lim)
    b = lim._live()[0].bucket
    clock.advance(200 * MS)
    wait = lim.reserve(700)  # 200 ops short of a full bucket: a fence until its promise
    assert wait and wait > 0
    before = _balance(b)
    tail = b.taken()
    lim.settle(1000)
    assert diff(b.taken(), tail) == 1000 * b.cost
    lim.settle(-1000)
    assert _balance(b) == before, (
        f"{(before - _balance(b)) / b.cost:g} ops of the refund lost behind the reservation's fence"
    )


def test_a_refund_never_grants_a_waiter_behind_a_reservation_before_its_promise(name, cleanup):
    """What the fence protects stays protected: a waiter queued behind a reservation is not granted
    by a refund before the reservation's promise, however large the refund; the refund goes back up
    to the fence (and over the debt before the waiter), and the waiter comes after the promise."""
    clock = FakeClock()
    lim = shmlimit.Limiter(name, rates=[(1000, 500)], clock=clock)
    cleanup.append(lim)
    att = lim._live()[0]
    b = att.bucket
    clock.advance(200 * MS)
    promise = clock.now + lim.reserve(700) * 1e9
    lim.settle(300)  # debt behind the reservation
    w = Request(att, 1, None)
    assert w.begin() is not True  # a waiter queued behind the debt
    lim.settle(-5000)  # a refund far beyond what the bucket could ever hold
    assert not b.covered(w.ticket), (
        "a refund granted a waiter behind a reservation before its promise"
    )
    assert diff(b.head(), w.ticket) == -b.cost  # it stands at the waiter's start: the debt covered
    while not b.covered(w.ticket):
        clock.advance(MS // 10)
        b.replenish()
    assert clock.now >= promise  # not before the reservation's slot
    assert w.next() is True
    w.end()


def test_lease_deliveries_are_never_cut_by_a_fence(R, redis_server, name, clock):  # noqa: F811
    """Hierarchical mode delivers leased tokens through the same ``Bucket.add`` as refunds, and no
    reservation fence can be in force there: ``reserve()`` is refused (a lease's time is not known
    in advance) and stores no record, so a delivery lands whole up to the capacity."""
    host = Host(R, name, redis_server.url, clock, rate=1000, burst=50)
    try:
        b = host.att.bucket
        f = b.fences
        with pytest.raises(ValueError, match="reserve"):
            host.lim.reserve(5)
        assert b.cells.load(f.hint) == 0
        assert all(b.cells.load(off + L.FENCE_DUE) == 0 for off in f.recs)
        head = b.head()
        assert b.add(30 * b.cost) == 30 * b.cost  # the feeder's delivery (feeder.py)
        assert diff(b.head(), head) == 30 * b.cost
    finally:
        host.close()


def test_a_refund_never_lets_a_later_slot_be_promised_early(name, cleanup):
    """A refund is owed to the windows that hold it: one landing ahead of reservations not yet due
    stops at their fences, which anchor every slot promised behind them.  Passed over another
    reservation's range (refunds went up to the tail), a 1-op refund let the next 1-op slot be
    promised 300 ms early, with the 2-op and 3-op slots before it: 6 ops in 100 ms at 10/s with a
    burst of 4 (the refund model's find)."""
    clock = FakeClock()
    lim = shmlimit.Limiter(name, rates={"a": ("10/s", 1), "b": ("10/s", 4)}, clock=clock)
    cleanup.append(lim)
    b = lim._live()[1].bucket
    slots = []

    def step():
        for att in lim._live():
            att.bucket.replenish()

    for costs in ({"a": 2, "b": 2}, {"a": 0, "b": 3}):
        slots.append((clock.now + round(lim.reserve(**costs) * 1e9), costs["b"]))
        step()
    step()
    lim.settle(b=-1)
    step()
    slots.append((clock.now + round(lim.reserve(a=0, b=1) * 1e9), 1))
    # the refund precedes every slot: no window of them holds it
    check_windows(slots, b.tpn, b.cost, b.cap)


def test_a_reservation_on_one_rate_is_promised_no_stop_late(name, cleanup):
    """A limiter of several rates reserving on one rate makes one rate's reservation: promised when
    the head gets there.  Its claim protocol (for several rates) held the ticket as a waiter's,
    recorded, while the promise was computed, and the record counted as a stop on the way
    (``count_stops``): every such slot was promised a stop late (half the capacity, 250 ms here),
    and its fence held the head that long behind it."""
    clock = FakeClock()
    lim = shmlimit.Limiter(name, rates=[(1000, 500)], clock=clock)
    cleanup.append(lim)
    b = lim._live()[0].bucket
    assert lim.reserve(500) == 0.0  # the full bucket
    first = lim.reserve(100)
    second = lim.reserve(100)  # its claim's start is between the head and its ticket
    assert second - first == pytest.approx(0.1, abs=1e-6)  # 100 ops later, at 1 000/s
    assert b.promised_ns(b.taken()) - clock.now == pytest.approx(second * 1e9, abs=1e3)


def test_a_refund_past_the_clamp_loses_no_time(name, cleanup):
    """Tokens given back that take the head more than a capacity past the last snapshot's head
    claim the time so far first and take a snapshot after: the next claim adds its interval.
    Left to it, that claim's words (a capacity from the head before the refund) let it add nothing:
    the time since the last claim lost at every such refund (at 5 000/s, up to a filler interval
    of 1 ms per refund of a charge)."""
    clock = FakeClock()
    clock.tick_ns = 1  # (a real clock moves between two readings)
    lim = shmlimit.Limiter(name, rates=[(1000, 50)], clock=clock)
    cleanup.append(lim)
    b = lim._live()[0].bucket
    lim.settle(450)  # debt: 450 ops queued, no one waiting
    b.replenish()
    head = b.head()
    clock.advance(MS)
    lim.settle(-300)  # over the debt: 250 ops past the words' limit
    clock.advance(MS)
    b.replenish()
    gained = diff(b.head(), head) / b.cost
    assert gained >= 300 + 2 - 0.01, f"the head gained {gained:g} ops: 300 + 2 ms expected"


def test_a_fence_whose_ticket_was_not_taken_is_freed_before_the_next_try(name, cleanup):
    """A reservation stores its fence before the CAS that takes its ticket; when another caller's
    CAS moves the tail first, that fence (for a ticket never taken) is freed at once, not left in
    force while the next try computes its promise.  Left there, with the tail and then the head
    moved a capacity meanwhile (charges and their refunds from other processes), its LIMIT stood
    behind the head: every promise made meanwhile counted from it, seconds late (1.4 to 11 s at
    5 000/s, capacity 50 ops), and their own fences held the head that long."""
    clock = FakeClock()
    lim = shmlimit.Limiter(name, rates=[(1000, 50)], clock=clock)
    cleanup.append(lim)
    b = lim._live()[0].bucket
    assert lim.reserve(50) == 0.0  # the full bucket
    real = b.cells
    raced, in_force = [], []

    class Racing:
        """The cells, but another caller's grab lands just before the reservation's first CAS."""

        def __getattr__(self, attr):
            return getattr(real, attr)

        def cas(self, off, old, new):
            if off == L.TAIL and not raced:
                raced.append(real.fetch_add(L.TAIL, 5 * b.cost))
            return real.cas(off, old, new)

    promised = b.promised_ns

    def promised_ns(ticket, pause=True):
        ts = real.load(L.REPL_TS)
        in_force.append(b.fences.in_force(ts, max(ts, clock.now), b.tpn, b.head()))
        return promised(ticket, pause)

    b.cells, b.promised_ns = Racing(), promised_ns
    try:
        assert lim.reserve(10) is not None
    finally:
        b.cells = real
        del b.promised_ns
    assert raced and len(in_force) == 2, "the race did not happen as staged"
    assert in_force[1] == [], f"a fence for a ticket never taken still in force: {in_force[1]}"


def _held_until_the_slot(lim, b, clock, promise, n, room):
    """Replenished every ms up to 0.1 ms before the slot ``promise`` (ns) of ``n`` ops, the bucket
    holds ``room`` ops behind it, and no more: a caller then takes them all and not one more.  With
    the slot that is ``C`` ops in 0.1 ms, at the bound (``rate*T + C``): one op more banked before
    the slot, by a refund or by the time since it, is an over-grant."""
    while clock.now + MS < promise - MS // 10:
        clock.advance(MS)
        b.replenish()
    clock.advance(promise - MS // 10 - clock.now)
    b.replenish()
    assert _balance(b) == room * b.cost, f"{_balance(b) / b.cost:g} ops banked, {room} expected"
    assert room == 0 or lim.try_acquire(room)
    assert not lim.try_acquire(1)
    check_windows([(clock.now, room), (promise, n)], b.tpn, b.cost, b.cap)
    with pytest.raises(AssertionError):
        check_windows([(clock.now, room + 1), (promise, n)], b.tpn, b.cost, b.cap)


def test_a_charge_ahead_of_a_reservation_refunded_banks_no_more_than_its_room(name, cleanup):
    """A charge queued ahead of a reservation and refunded before its slot: the slot was promised
    behind the debt (400 ops at 1 000/s: 0.41 s away), and the bucket can hold no more than the
    reservation's room (``C - n``: 40 ops) behind it until then; the time from the refund to the
    slot beyond that adds nothing.  Inherent to a slot fixed at its promise under
    ``rate*T + C``: banked, one op more is taken just before the slot, with the slot's ops."""
    clock = FakeClock()
    lim = shmlimit.Limiter(name, rates=[(1000, 50)], clock=clock)
    cleanup.append(lim)
    b = lim._live()[0].bucket
    assert lim.reserve(50) == 0.0  # the full bucket, used now
    lim.settle(400)
    promise = clock.now + round(lim.reserve(10) * 1e9)
    assert promise - clock.now >= 410 * MS
    lim.settle(-400)  # the debt ahead given back: the slot stays where it was promised
    _held_until_the_slot(lim, b, clock, promise, 10, 40)


def test_a_reservations_unused_part_refunded_banks_no_more_than_the_next_slots_room(name, cleanup):
    """A reservation's unused part refunded before the next reservation's slot: that slot (50 ops,
    the whole capacity) leaves no room behind it until its promise, so the refund (30 ops) and the
    time it saved are dropped there, as tokens beyond the capacity of any token bucket; a caller
    behind is served from the slot on, at the rate.  Banked, one op is taken just before the slot,
    with its 50."""
    clock = FakeClock()
    lim = shmlimit.Limiter(name, rates=[(1000, 50)], clock=clock)
    cleanup.append(lim)
    b = lim._live()[0].bucket
    assert lim.reserve(50) == 0.0  # used now: 20 of the 50
    promise = clock.now + round(lim.reserve(50) * 1e9)
    assert promise - clock.now >= 50 * MS
    lim.settle(-30)  # the unused 30, before the next slot
    _held_until_the_slot(lim, b, clock, promise, 50, 0)


def test_a_charge_never_moves_a_fence_over_another_reservations_range(name, cleanup):
    """A charge moves only the fences whose LIMIT its debt starts at or before.  It moved one
    before its debt too, over the ranges no record tells up to the first waiter's: another
    reservation's range among them, which is granted at its own promise.  At 10/s with a capacity
    of 4: a 6-op slot's fence (at its ticket) moved over the 3-op slot behind it, so the head
    covered that slot as the fence lifted, and the 1-op waiter behind it was granted 100 ms after
    the 6-op slot and 200 ms before the 3-op one: 10 ops in 300 ms (the refund model's find)."""
    clock = FakeClock()
    lim = shmlimit.Limiter(name, rates=[(10, 4)], clock=clock)
    cleanup.append(lim)
    att = lim._live()[0]
    b = att.bucket
    grants = []
    for n in (6, 3):  # the 6-op slot needs 2 ops more than the full bucket: queued, fenced
        grants.append((clock.now + round(lim.reserve(n) * 1e9), n))
    w = Request(att, 1, None)
    assert w.begin() is not True  # a waiter behind both, recorded
    lim.settle(4)  # debt behind the waiter: no fence's room holds it
    while not b.covered(w.ticket):
        clock.advance(MS)
        b.replenish()
    assert w.next() is True
    w.end()
    grants.append((clock.now, 1))
    check_windows(grants, b.tpn, b.cost, 6 * b.cost)  # rate*T + max(C, the largest request)


def test_a_charge_moves_a_fence_over_a_range_given_back_before_its_debt(name, cleanup):
    """A fence before a charge's debt moves past it over ranges no one is granted (a waiter's range
    given back), so the charge's refund still lands whole: the rovers end where they were."""
    clock = FakeClock()
    lim = shmlimit.Limiter(name, rates=[(1000, 500)], clock=clock)
    cleanup.append(lim)
    att = lim._live()[0]
    b = att.bucket
    clock.advance(200 * MS)
    assert lim.reserve(600) > 0  # 100 ops short, fenced at its ticket: no room behind it
    w = Request(att, 5, None)
    assert w.begin() is not True
    w.end()  # the waiter leaves: its range given back, between the fence and the debt
    before = _balance(b)
    lim.settle(150)
    lim.settle(-150)  # 50 ops past the fence's LIMIT, the room the debt moved it by
    assert _balance(b) == before, f"{(before - _balance(b)) / b.cost:g} ops of the refund lost"
