"""Hostile clamp words: any 64-bit values in SNAP_BASE/SNAP_END/SNAP_NEXT and in a ticket record.

The clamp words are derived data a replenish leaves for the next one; a corrupt or hostile segment
may hold anything there.  Whatever they hold, a replenish neither grants tokens beyond the capacity
past the tail (an over-grant), nor stops the head for good (a hang): at worst it loses an interval.
The native waiter's replenish is the reference one word for word (tests/acquire/test_native_wait.py), so
the Python replenish on both backends' cells stands for all three.
"""

import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.buckets import make_bucket

from shmlimit.config import Config
from shmlimit.shm import layout as L
from shmlimit.shm.cells import MASK64, native_available
from shmlimit.shm.words import SPAN_MAX, diff

# run once in CI: names each backend it checks
pytestmark = pytest.mark.backend_independent

BACKENDS = ["atomics"] + (["native"] if native_available() else [])
MS = 1_000_000
SLOTS = 2


def _bucket(backend):
    """1000/s, burst 5, empty; a table of two slots held by this process, so replenishes read its records."""
    b, clock = make_bucket(Config.make(1000, burst=5), backend, initial=0, slots=SLOTS)
    b.cells.store(L.SLOTS_OFF, SLOTS)
    for i in range(SLOTS):
        b.cells.store(L.slot_offset(i) + L.SLOT_PID, os.getpid())
    return b, clock


def _queue(b, ops, slot):
    lens = tuple(len_off for _, len_off in L.ticket_records(SLOTS, slot))
    ticket, rec = b.take_within(ops * b.cost, float("inf"), lens, 0, ops)
    assert rec is not None
    return ticket


def _free(b):
    """Tokens available past the tail (negative while callers queue)."""
    return diff(b.cells.load(L.HEAD), b.cells.load(L.TAIL))


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_far_snap_end_grants_no_idle_time(backend):
    """SNAP_END 2^61 past the head of an idle bucket: the next replenish after 10 s idle gave
    10 000 ops at once (capacity 5); a word no snapshot leaves allows nothing."""
    b, clock = _bucket(backend)
    c = b.cells
    clock.advance(MS)
    b.replenish()
    h = c.load(L.HEAD)
    c.store(L.SNAP_BASE, h)
    c.store(L.SNAP_END, (h + (1 << 61)) & MASK64)
    c.store(L.SNAP_NEXT, (h + (1 << 62)) & MASK64)
    clock.advance(10_000 * MS)
    b.replenish()
    assert _free(b) <= b.cap
    for _ in range(10):  # and the words are written again: the bucket refills as before
        clock.advance(MS)
        b.replenish()
    assert _free(b) == b.cap


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_snap_next_below_its_request_end_stops_nothing_for_good(backend):
    """Words naming a request around the head with SNAP_NEXT at the head: kept while the head
    stands in that request, they allowed nothing, and the queue never moved again (a hang)."""
    b, clock = _bucket(backend)
    c = b.cells
    ticket = _queue(b, 100, 0)
    clock.advance(MS)
    b.replenish()
    h = c.load(L.HEAD)
    c.store(L.SNAP_BASE, h)
    c.store(L.SNAP_END, (h + 1) & MASK64)
    c.store(L.SNAP_NEXT, h)
    for _ in range(200):
        clock.advance(MS)
        b.replenish()
    assert diff(c.load(L.HEAD), ticket) >= 0  # 100 ops queued at 1000/s: due within 200 ms


def _word(ref):
    """Any 64-bit value, or one near a rover (where a check is most likely to be off by one)."""
    return st.one_of(
        st.integers(0, MASK64),
        st.builds(
            lambda k, d: (k + d) & MASK64,
            st.just(ref),
            st.one_of(
                st.integers(-(2**12), 2**12).map(lambda d: d * 2**16),
                st.sampled_from([-1, 0, 1, SPAN_MAX, SPAN_MAX + 1, 1 << 62, 1 << 63]),
            ),
        ),
    )


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@pytest.mark.parametrize("backend", BACKENDS)
@given(
    data=st.data(),
    queue=st.lists(st.integers(1, 12), max_size=4),
    gap=st.one_of(st.integers(1, 5 * MS), st.integers(1, 10**10)),
)
def test_any_clamp_or_record_words_lose_time_never_grant_or_hang(backend, data, queue, gap):
    """Queued requests (recorded), then arbitrary clamp words and one arbitrary ticket record, then a
    replenish after ``gap`` ns: never more than the capacity free past the tail; then, replenished
    every ms, the head reaches every queued ticket on schedule with at most a few ms lost."""
    b, clock = _bucket(backend)
    c = b.cells
    tickets = [_queue(b, ops, i % SLOTS) for i, ops in enumerate(queue)]
    for _ in range(data.draw(st.integers(0, 6), label="replenishes before")):
        clock.advance(MS)
        b.replenish()
    head, tail = c.load(L.HEAD), c.load(L.TAIL)
    ref = data.draw(st.sampled_from([head, tail]), label="near")
    for off in (L.SNAP_BASE, L.SNAP_END, L.SNAP_NEXT):
        c.store(off, data.draw(_word(ref), label=f"word {off}"))
    if data.draw(st.booleans(), label="hostile record"):
        ticket_off, len_off = L.ticket_records(SLOTS, 1)[-1]  # a slot's last record: free here
        c.store(ticket_off, data.draw(_word(ref), label="record ticket"))
        c.store(
            len_off,
            data.draw(
                st.one_of(st.integers(0, MASK64), st.integers(1, 2 * SPAN_MAX)), label="record len"
            ),
        )
    clock.advance(gap)
    b.replenish()
    assert _free(b) <= b.cap
    for off in L.ticket_records(SLOTS, 1)[-1]:
        c.store(off, 0)  # the hostile record is gone: the queue's own schedule from here
    start = c.load(L.HEAD)
    owed = max([0] + [diff(t, start) for t in tickets])
    for _ in range(
        owed // (b.tpn * MS) + 10
    ):  # the queue's schedule, and 10 ms for stops and the lost interval
        clock.advance(MS)
        b.replenish()
        assert _free(b) <= b.cap
    assert all(diff(c.load(L.HEAD), t) >= 0 for t in tickets)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_hostile_given_record_over_live_waiters_is_not_skipped(backend):
    """A record marked given back whose range covers two live waiters' recorded requests (written
    into a slot by hand): skipping it moved the head past both, granting 20 ops at once on an
    empty bucket.  Ranges of tickets never overlap, so a range another record holds part of is
    corrupt: not skipped (its time is lost instead), and the waiters are served at the rate."""
    from shmlimit.bucket import giveback

    b, clock = _bucket(backend)
    c = b.cells
    start = c.load(L.HEAD)
    first, second = _queue(b, 10, 0), _queue(b, 10, 0)
    ticket_off, len_off = L.ticket_records(SLOTS, 1)[-1]
    c.store(ticket_off, second)
    c.store(len_off, diff(second, start) | L.TICKET_GIVEN)
    assert giveback.skip(b, start, second) == 0
    assert diff(c.load(L.HEAD), first) < 0  # nobody granted without time
    for _ in range(9):
        clock.advance(MS)
        b.replenish()
    assert diff(c.load(L.HEAD), first) < 0  # 9 ms: not even the first one's 10 ops yet
    # the range's own record (a copy of it, as an adopted range has) is no objection
    c.store(ticket_off, 0)
    c.store(len_off, 0)
    rec_t, rec_l = L.ticket_records(SLOTS, 0)[0]
    assert c.load(rec_t) == first and c.load(rec_l) == 10 * b.cost
    c.store(rec_l, 10 * b.cost | L.TICKET_GIVEN)  # the first waiter gave its range back
    before = c.load(L.HEAD)
    assert giveback.skip(b, start, first) == diff(first, before) > 0
    assert c.load(L.HEAD) == first  # skipped to its end, and the second waiter not granted


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("past", [1, 2**50], ids=["1 token", "2**50"])
def test_a_record_around_the_head_ending_past_the_tail_stops_nothing(backend, past):
    """A record (written by hand, and left there) of a request the head stands in that ends past
    the tail: the clamp words named it, which no snapshot leaves, so every replenish added nothing,
    wrote the same words again from the records, and the queue never moved (a timed acquire
    waited for ever).  No grab takes a range the tail has not passed: such a record tells nothing."""
    b, clock = _bucket(backend)
    c = b.cells
    ticket = _queue(b, 100, 0)
    ticket_off, len_off = L.ticket_records(SLOTS, 1)[-1]
    end = (c.load(L.TAIL) + past) & MASK64
    c.store(ticket_off, end)
    c.store(len_off, SPAN_MAX)  # starting far behind the head
    for _ in range(200):
        clock.advance(MS)
        b.replenish()
        assert _free(b) <= b.cap
    assert diff(c.load(L.HEAD), ticket) >= 0  # 100 ops queued at 1000/s: due within 200 ms
