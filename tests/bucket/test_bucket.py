"""Rover arithmetic with an injected clock: exact, capped, FIFO, and never over-granting."""

import os
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.buckets import make_bucket
from support.cells import Before
from support.windows import check_windows

from shmlimit.bucket.rovers import NO_RECORD, REFUSED, Bucket, diff
from shmlimit.config import NS_PER_S, Config
from shmlimit.shm import layout as L
from shmlimit.shm.cells import MASK64, native_available

BACKENDS = ["atomics"] + (["native"] if native_available() else [])


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param


def test_token_unit_makes_every_op_whole():
    # the finest unit, a multiple of the smallest denominator that makes the op exact
    assert (Config.make(1000).tpn, Config.make(1000).cost) == (65536, 65536 * 1_000_000)
    assert (Config.make(7_000_000).tpn, Config.make(7_000_000).cost) == (7 * 8192, 8192 * 1000)
    assert (Config.make(1, per=6).tpn, Config.make(1, per=6).cost) == (65536, 65536 * 6 * NS_PER_S)
    # coarser only when the capacity would not fit the rover arithmetic at the finest
    assert Config.make(1, per=86400, burst=14).tpn == 512
    third = Config.make(3)
    assert third.cost * NS_PER_S == third.tpn * NS_PER_S * NS_PER_S // 3  # exactly 1/3 s per op
    # an awkward float rate is rounded so the limiter is slower, never faster
    odd = Config.make(1234.567)
    assert odd.cost / odd.tpn >= NS_PER_S / 1234.567


def test_default_burst_is_strict_for_slow_and_roomy_for_fast():
    assert Config.make(1, per=6).burst == 1
    assert Config.make(100).burst == 1
    assert Config.make(1000).burst == 10
    assert Config.make(1_000_000).burst == 10_000


def test_replenish_adds_exactly_elapsed_and_caps_at_capacity(backend):
    b, clock = make_bucket(Config.make(1000, burst=5), backend, initial=0)
    assert b.balance() == 0
    clock.advance(2_500_000)  # 2.5 ms -> 2.5 ops of tokens
    assert b.replenish() == 2_500_000 * b.tpn
    assert b.balance() == 2_500_000 * b.tpn == 2.5 * b.cost
    clock.advance(10 * NS_PER_S)  # far more than the capacity
    b.replenish()
    assert b.balance() == 5 * b.cost
    assert diff(b.cells.load(L.HEAD), b.cells.load(L.TAIL)) <= b.cap


def test_time_the_clamp_drops_while_callers_queue_is_counted_as_starved(backend):
    b, clock = make_bucket(Config.make(1000, burst=5), backend, initial=0)
    c = b.cells
    clock.advance(20_000_000)  # idle: the bucket fills up and the rest is dropped, owed to nobody
    b.replenish()
    clock.advance(1)
    b.replenish()
    assert b.balance() == b.cap and c.load(L.STARVED_NS) == 0
    ticket = b.grab(100 * b.cost, L.UNREG_GRANTS, 100)  # a queue 95 ms deep
    clock.advance(1_000_000)  # began with a full bucket: dropped by design, owed to nobody yet
    assert b.replenish() == 0 and c.load(L.STARVED_NS) == 0
    clock.advance(1_000_000)  # on time: all of it credited
    assert b.replenish() == 1_000_000 * b.tpn and c.load(L.STARVED_NS) == 0
    clock.advance(
        20_000_000
    )  # no replenish for 20 ms, more than a capacity: the clamp drops the rest
    added = b.replenish()
    assert 0 < added < 20_000_000 * b.tpn
    lost = c.load(L.STARVED_NS)
    assert lost == (20_000_000 * b.tpn - added) // b.tpn  # every dropped ns was owed to the queue
    assert 10_000_000 <= lost < 20_000_000
    clock.advance(1_000_000)
    b.replenish()
    assert c.load(L.STARVED_NS) == lost  # on time again: nothing more lost
    while b.deficiency(ticket) > 0:  # the queue served on time: nothing more lost
        clock.advance(1_000_000)
        b.replenish()
    assert c.load(L.STARVED_NS) == lost
    clock.advance(50_000_000)  # idle again: what the clamp drops is owed to nobody
    b.replenish()
    clock.advance(50_000_000)
    b.replenish()
    assert b.balance() <= b.cap and c.load(L.STARVED_NS) == lost


def test_deficiency_and_fifo_tickets(backend):
    b, clock = make_bucket(Config.make(1000, burst=3), backend, initial=0)
    tickets = [b.grab(b.cost, L.UNREG_GRANTS, 1) for _ in range(3)]
    assert [b.deficiency(t) for t in tickets] == [b.cost, 2 * b.cost, 3 * b.cost]
    clock.advance(1_000_000)
    b.replenish()
    assert [b.deficiency(t) for t in tickets] == [0, b.cost, 2 * b.cost]
    clock.advance(1_500_000)
    b.replenish()
    assert b.deficiency(tickets[1]) == 0 and b.deficiency(tickets[2]) == b.cost // 2


def test_try_grab_respects_queue_and_changes_nothing_on_refusal(backend):
    b, clock = make_bucket(Config.make(1000, burst=2), backend, initial=2)
    assert b.try_grab(b.cost, L.UNREG_GRANTS, 1)
    tail = b.cells.load(L.TAIL)
    assert not b.try_grab(2 * b.cost, L.UNREG_GRANTS, 2)
    assert b.cells.load(L.TAIL) == tail
    queued = b.grab(2 * b.cost, L.UNREG_GRANTS, 2)  # puts the bucket in debt
    clock.advance(1_000_000)
    b.replenish()
    assert b.deficiency(queued) == b.cost
    assert not b.try_grab(b.cost, L.UNREG_GRANTS, 1)  # a try never jumps the queue


def test_take_within_takes_only_when_the_wait_fits(backend):
    b, clock = make_bucket(
        Config.make(1000, burst=2), backend, initial=0
    )  # covers two fill intervals
    tail = b.cells.load(L.TAIL)
    assert b.take_within(5 * b.cost, 4.9e6) == (REFUSED, None)  # 5 ms of wait > 4.9 ms
    assert b.cells.load(L.TAIL) == tail
    assert b.take_within(5 * b.cost, 5e6, recs=()) == (
        NO_RECORD,
        None,
    )  # would queue, no record to hold it
    assert b.cells.load(L.TAIL) == tail
    ticket, rec = b.take_within(5 * b.cost, 5e6)
    assert rec is None and b.deficiency(ticket) == 5 * b.cost


@pytest.mark.parametrize("base", [0, (1 << 64) - 3 * 7_000_000_000, (1 << 63) - 5])
def test_exact_accounting_over_simulated_hours(backend, base):
    """A hungry consumer of an empty bucket gets exactly floor(elapsed * rate) ops: no fraction lost, no drift.

    ``base`` starts the rovers near the 2**63 and 2**64 boundaries: wrap-around changes nothing.
    """
    cfg = Config.make(7, per=3, burst=20)  # 2.333... ops/s: tpn 7, not a whole number of ns per op
    b, clock = make_bucket(cfg, backend, initial=0, base=base)
    rng = random.Random(42)
    hours = 3
    end = clock.now + hours * 3600 * NS_PER_S
    start = clock.now
    granted = 0
    while clock.now < end:
        clock.advance(min(rng.randint(1_000, 4 * NS_PER_S), end - clock.now))
        b.replenish()
        avail = b.balance() // b.cost
        if avail and b.try_grab(avail * b.cost, L.UNREG_GRANTS, avail):
            granted += avail
    assert granted == (end - start) * b.tpn // b.cost
    assert granted == hours * 3600 * 7 // 3


# ---- the over-grant property under adversarial interleavings --------------------

OPS = st.lists(
    st.one_of(
        st.tuples(st.just("advance"), st.integers(1, 40_000_000)),
        st.tuples(st.just("claim"), st.integers(0, 2)),
        st.tuples(st.just("apply"), st.integers(0, 2)),
        st.tuples(st.just("replenish"), st.just(0)),
        st.tuples(st.just("take"), st.integers(1, 5)),
        st.tuples(st.just("queue"), st.integers(1, 3)),
    ),
    min_size=1,
    max_size=120,
)


@settings(max_examples=300, deadline=None)
@given(ops=OPS, burst=st.sampled_from([1, 2, 5]))
def test_no_interleaving_of_replenishers_and_grabbers_over_grants(ops, burst):
    """Stalled replenishers (claimed, not yet added), lazy replenishers, takers and queued grabs,
    in any order: no window ever sees more than rate*T + capacity."""
    cfg = Config.make(100, burst=burst)  # 10 ms per op
    b, clock = make_bucket(cfg)
    pending = {}
    queued = []
    grants = []

    def settle():
        head = b.cells.load(L.HEAD)
        while queued and diff(head, queued[0][0]) >= 0:
            grants.append((clock.now, queued.pop(0)[1]))

    for op, arg in ops:
        if op == "advance":
            clock.advance(arg)
        elif op == "claim" and arg not in pending:
            claim = b.claim()
            if claim is not None:
                pending[arg] = claim
        elif op == "apply" and arg in pending:
            b.apply(pending.pop(arg))
        elif op == "replenish":
            b.replenish()
        elif op == "take":
            if b.try_grab(arg * b.cost, L.UNREG_GRANTS, arg):
                grants.append((clock.now, arg))
        elif op == "queue":
            for _ in range(arg):
                ticket = b.grab(
                    b.cost, L.UNREG_GRANTS, 1
                )  # the acquire path: granted now, or queued
                if ticket is None:
                    grants.append((clock.now, 1))
                else:
                    queued.append((ticket, 1))
        settle()
        assert diff(b.cells.load(L.HEAD), b.cells.load(L.TAIL)) <= b.cap
    for claim in pending.values():
        b.apply(claim)
        settle()
    check_windows(grants, b.tpn, b.cost, b.cap)


# ---- the clamp counts from the start of the request the head stands in (invariant 1) -------------


def _recorded_bucket(cfg, backend, slots=2, base=0):
    """An empty bucket whose segment names its table (``slots``), each slot held by a process (this
    one): replenishes read their ticket records."""
    b, clock = make_bucket(cfg, backend, initial=0, base=base, slots=slots)
    b.cells.store(L.SLOTS_OFF, slots)
    for i in range(slots):
        b.cells.store(L.slot_offset(i) + L.SLOT_PID, os.getpid())
    return b, clock


def _lens(slot, slots=2):
    return tuple(len_off for _, len_off in L.ticket_records(slots, slot))


def _queue(b, ops, slot):
    """A waiter's ticket of ``ops`` ops, recorded in ``slot``'s records as every waiter's is."""
    ticket, rec = b.take_within(ops * b.cost, float("inf"), _lens(slot), 0, ops)
    assert rec is not None
    return ticket


def test_a_request_over_the_capacity_is_granted_alone_and_nothing_waits_forever(backend):
    """10 ops at burst 2 (1000/s), one op queued behind: replenished every ms, the head reaches the
    request's end (no deadlock: the clamp allows its whole length from its start) and stops there,
    also when an add lands 50 ms late with the request 9.5 ops accrued: the op behind it is granted
    an op's time later or a little more, never at the same instant."""
    b, clock = _recorded_bucket(Config.make(1000, burst=2), backend)
    big = _queue(b, 10, 0)
    one = _queue(b, 1, 1)
    for _ in range(9):
        clock.advance(1_000_000)
        b.replenish()
    clock.advance(500_000)
    b.replenish()
    assert 0 < diff(big, b.head()) <= b.cost  # 9.5 ops accrued
    clock.advance(50_000_000)  # the host stalled: the next add is late
    b.replenish()
    assert b.covered(big) and b.head() == big  # granted, and not an op beyond its end
    waited = 0
    while not b.covered(one):
        assert waited < 3_000_000, "the op behind the request is never granted"
        clock.advance(500_000)
        waited += 500_000
        b.replenish()
    # not before an op's time (the bound's rate term); an interval later at most (the snapshot of
    # the late add stood inside the request: its clamp lets the head no further than its end)
    assert 1_000_000 <= waited <= 1_500_000


def test_a_late_add_never_passes_a_partly_accrued_request_with_a_capacity_more(backend):
    """acquire(10) then nine single ops at 1000/s, burst 10: 9.9 ops accrued, then 10 ms late the
    add may bring the head only to a capacity from the request's start: the request, no op behind."""
    b, clock = _recorded_bucket(Config.make(1000, burst=10), backend, slots=2)
    big = _queue(b, 10, 0)
    ones = [_queue(b, 1, 1 if k < 5 else 0) for k in range(4)]
    for _ in range(99):
        clock.advance(100_000)
        b.replenish()
    assert 0 < diff(big, b.head()) <= b.cost
    clock.advance(10_000_000)
    b.replenish()
    assert b.covered(big) and b.head() == big
    assert not any(b.covered(t) for t in ones)


def test_a_longer_request_after_a_granted_one_gets_its_whole_capacity_on_time(backend):
    """acquire(1) then acquire(5) at 1000/s, burst 5 (what a ``set_rate`` that raises an op's cost
    leaves in the queue too).  The add that grants the first leaves clamp words naming it: counted
    from its start, a capacity would stop the head an op inside the second, and the second's own
    replenish at its due instant would lose that op's time (starved, granted 1 ms late).  An add
    that leaves the named request claims again: the second is granted at its due instant."""
    b, clock = _recorded_bucket(Config.make(1000, burst=5), backend)
    c = b.cells
    clock.tick_ns = (
        1  # a real clock moves between two readings: a claim right after an add has time
    )
    one = _queue(b, 1, 0)
    five = _queue(b, 5, 1)
    b.replenish()  # a snapshot with both queued: the words name the first request
    clock.advance(1_000_000)  # under a quarter of the capacity: no second claim for its size
    b.replenish()
    assert b.covered(one) and not b.covered(five)
    clock.advance(5_000_000)  # the second's due instant
    b.replenish()
    assert b.covered(five) and c.load(L.STARVED_NS) == 0


def test_a_record_being_written_is_granted_alone_and_never_stalls_the_queue(backend):
    """A waiter between its CAS on the tail and the store of its record's length (BUSY): the clamp
    cannot tell where its request starts, but lets the head no further than a token short of the
    end of the recorded request after it: after a late add the BUSY request is granted alone,
    nothing behind it with it.  Should the writer die there, the head still passes it: a range a
    BUSY record holds never stalls the queue."""
    b, clock = _recorded_bucket(Config.make(1000, burst=2), backend)
    c = b.cells
    rec = _lens(0)[0]
    tail = c.load(L.TAIL)
    end = (tail + 2 * b.cost) & MASK64
    c.store(
        rec, L.TICKET_BUSY
    )  # claimed, its ticket written, the tail taken: its length never stored
    c.store(rec - 8, end)
    assert c.cas(L.TAIL, tail, end)
    behind = _queue(b, 1, 1)
    for step in (1_000_000, 500_000):
        clock.advance(step)
        b.replenish()
    assert 0 < diff(end, b.head()) <= b.cost  # 1.5 of its 2 ops accrued
    clock.advance(50_000_000)  # a late add
    b.replenish()
    assert b.covered(end) and not b.covered(behind)  # granted, and not the op behind with it
    waited = 0
    while not b.covered(behind):  # the writer never stores its length (killed): the head goes on
        assert waited < 5_000_000, "a BUSY record stalls the queue"
        clock.advance(500_000)
        waited += 500_000
        b.replenish()


def test_the_clamp_keeps_the_older_words_when_the_head_moves_while_it_reads_the_records(backend):
    """A request around the snapshot's head may be granted (its record freed) while the records are
    read: the words are then not written (None), and the older ones, which allow less, stay."""
    from shmlimit.bucket.clamp import clamp_words
    from shmlimit.shm.words import (
        clamp_words as reference,  # the atomic layer's steps, on any cells
    )

    b, clock = _recorded_bucket(Config.make(1000, burst=2), backend)
    c = b.cells
    _queue(b, 3, 0)
    head, tail = c.load(L.HEAD), c.load(L.TAIL)
    assert clamp_words(c, b._record_lens(), head, tail) == (
        head,
        (head + 3 * b.cost) & MASK64,
        (head + (1 << 62)) & MASK64,
    )

    class Moving:
        def __init__(self, cells):
            self.cells = cells

        def load_many(self, offs):
            out = self.cells.load_many(offs)
            self.cells.store(
                L.HEAD, (self.cells.load(L.HEAD) + 1) & MASK64
            )  # an add lands meanwhile
            return out

        def __getattr__(self, attr):
            return getattr(self.cells, attr)

    assert reference(Moving(c), L.HEAD, head, tail, b._record_lens()) is None
    assert reference(c, L.HEAD, head, tail, b._record_lens()) == clamp_words(
        c, b._record_lens(), head, tail
    )


@pytest.mark.parametrize("base", [0, (1 << 64) - 5 * 10**12])
def test_a_segment_without_the_clamp_words_adds_nothing_once_then_replenishes(backend, base):
    """A segment written before the clamp words existed (zero): its first replenish adds nothing
    (zero words allow nothing wherever the rovers are) and writes them; the next one adds."""
    b, clock = _recorded_bucket(Config.make(1000, burst=5), backend, base=base)
    c = b.cells
    for off in (L.SNAP_BASE, L.SNAP_END, L.SNAP_NEXT):
        c.store(off, 0)
    clock.advance(2_000_000)
    assert b.replenish() == 0
    clock.advance(2_000_000)
    assert b.replenish() == 2_000_000 * b.tpn


def test_an_add_claimed_before_a_stop_and_landing_after_it_leaves_nothing(backend):
    """10/s, burst 5: another replenisher claims a second (5 ops, clamped) and is preempted; stop()
    burns the bucket; the add lands after it.  The config changed under the add: it burns down to
    what the config in force allows, nothing while stopped (not the capacity: 5 ops taken while
    stopped, and start() resuming from a full bucket).  Nor does a refund meanwhile outlive start()."""
    b, clock = make_bucket(Config.make(10, burst=5), backend, initial=0)
    other = Bucket(b.cells, clock)
    clock.advance(NS_PER_S)
    claim = other.claim()
    b.set_stopped(True)
    assert other.apply(claim) == 5 * b.cost  # added, then burned
    assert b.balance() == 0 and b.take_available(L.UNREG_GRANTS) == 0
    b.add(2 * b.cost)  # a refund while stopped: start() resumes from an empty bucket all the same
    b.set_stopped(False)
    assert b.balance() == 0


def test_tokens_given_while_stopped_add_nothing(backend):
    """10/s, burst 5, 2 ops taken; another process stops the limiter.  Tokens given to the
    bucket while stopped (a refund, a lease, the 2 ops given back) add nothing, read from the
    config in force (this bucket last loaded the running one): nothing is granted until start."""
    b, clock = make_bucket(Config.make(10, burst=5), backend, initial=5)
    head_then = b.head()
    assert b.try_grab(2 * b.cost, L.UNREG_GRANTS, 2)
    Bucket(b.cells, clock).set_stopped(True)
    assert b.give_back(2 * b.cost, head_then) == 0 and b.add(2 * b.cost) == 0
    assert b.stopped and b.balance() == 0
    assert not b.try_grab(b.cost, L.UNREG_GRANTS, 1) and b.take_available(L.UNREG_GRANTS) == 0


def test_an_add_that_races_a_stop_is_burned(backend):
    """10/s, burst 5, empty: a refund of 3 ops reads the config (running) and is preempted before
    its CAS of the head; another process stops the limiter (publishes, burns an empty bucket).
    The refund lands after the stop's burn: it burns what it added, as a replenish's late add
    does, and nothing is granted while stopped."""
    b, clock = make_bucket(Config.make(10, burst=5), backend, initial=0)
    other = Bucket(b.cells, clock)
    cells = b.cells
    b.cells = Before(
        cells, lambda op, args: op == "cas" and args[0] == L.HEAD, lambda: other.set_stopped(True)
    )
    try:
        b.add(3 * b.cost)
    finally:
        b.cells = cells
    assert b.stopped and b.balance() == 0
    assert not b.try_grab(b.cost, L.UNREG_GRANTS, 1)


def test_a_claim_of_the_paused_time_while_start_runs_adds_nothing(backend):
    """10/s, burst 5, stopped for a second with nobody replenishing; start() runs, and another
    replenisher claims the paused second just before start's claim of it: it claims it while
    stopped (start restarts the clock before it lifts the flag) and adds nothing; start resumes
    from an empty bucket, and the first op accrues 100 ms later."""
    b, clock = make_bucket(Config.make(10, burst=5), backend, initial=0)
    other = Bucket(b.cells, clock)
    b.set_stopped(True)
    clock.advance(NS_PER_S)
    cells = b.cells
    b.cells = Before(cells, lambda op, args: op == "cas" and args[0] == L.REPL_TS, other.replenish)
    try:
        b.set_stopped(False)
    finally:
        b.cells = cells
    assert b.balance() == 0
    clock.advance(NS_PER_S // 10)
    b.replenish()
    assert b.balance() == b.cost


class Died(BaseException):
    """A writer killed at the point it raises: nothing after it runs."""


@pytest.mark.parametrize("change, left", [("set_rate", 1), ("stop", 0)])
@pytest.mark.parametrize("seen_by", ["attached", "attaching"])
def test_a_change_whose_writer_died_before_its_burn_is_applied_by_whoever_loads_it(
    backend, change, left, seen_by
):
    """1000/s, burst 1000, full: a writer publishes set_rate(10, burst=1) or a stop and dies before
    its burn.  A process attached meanwhile (at its next refresh), or one attaching afterwards,
    burns down to what the new config allows before it grabs under it: one op (the capacity), or
    nothing while stopped."""
    b, clock = make_bucket(Config.make(1000, burst=1000), backend)
    writer = Bucket(b.cells, clock)

    def die(*args, **kwargs):
        raise Died

    writer.burn = die
    with pytest.raises(Died):
        writer.set_stopped(True) if change == "stop" else writer.publish(Config.make(10, burst=1))
    assert b.balance() == 1000 * b.cost  # the change is in force, and nothing was burned
    if seen_by == "attached":
        assert b.refresh()
    else:
        b = Bucket(b.cells, clock)
    assert b.take_available(L.UNREG_GRANTS) == left
    assert b.stopped == (change == "stop") and b.balance() == 0


@pytest.mark.parametrize("stop", [True, False])
def test_a_stop_or_start_never_undoes_a_set_rate_published_before_it_took_the_lock(backend, stop):
    """100/s: a process stops (or starts) the limiter; another's set_rate(200) is published just
    before the first takes the config lock, after it last read the config.  The stop flips the
    stopped flag alone: the rate stays 200."""
    b, clock = make_bucket(Config.make(100), backend)
    other = Bucket(b.cells, clock)
    if not stop:
        b.set_stopped(True)
    new = Config.make(200)
    cells = b.cells
    b.cells = Before(
        cells, lambda op, args: op == "cas" and args[0] == L.CFG_SEQ, lambda: other.publish(new)
    )
    try:
        b.set_stopped(stop)
    finally:
        b.cells = cells
    assert (b.config, b.stopped) == (new, stop)
    fresh = Bucket(cells, clock)
    assert (fresh.config, fresh.stopped) == (new, stop)
