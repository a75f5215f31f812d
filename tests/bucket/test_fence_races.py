"""Races on the reservation fences: takers of one record, late owners, hostile tables, the native
scan at its edges, claims that straddle a fence's store.  Each once broke the fences' promise (or
was tried and held): a reservation holds the waiters behind it to its promise."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.clock import FakeClock
from support.windows import excess_over_rate

import shmlimit
import shmlimit.shm.layout as L
from shmlimit.acquire.single import Request
from shmlimit.bucket.rovers import diff
from shmlimit.shm.words import MASK64

MS = 1_000_000


def test_two_takers_never_share_a_fence_record(name):
    """Two takers never share a record: a take claims it by one CAS of its DUE (to a pending value).
    Once, the take CASed only OWNER and a record was in use only once its DUE was stored, so a second
    take before the first taker's store (a reserver preempted between take and store, another
    process reserving meanwhile) returned the same record."""
    clock = FakeClock()
    lim = shmlimit.Limiter(name, rate=100, burst=1, clock=clock)
    try:
        f = lim._att.bucket.fences
        repl = f.cells.load(L.REPL_TS)
        first = f.take(repl)
        second = f.take(repl)
        assert first is not None and second is not None
        assert first != second, "two takers hold the same fence record"
    finally:
        lim.close()


def test_a_refused_reserver_sharing_the_record_does_not_free_anothers_fence(name):
    """Reserver B takes a record and is preempted before storing its fence; reserver A (another
    process) takes the same record (its DUE is still 0), stores its fence and queues behind a waiter
    (promise about 0.5 s on).  B resumes: stores its fence over A's, its tail CAS fails (A moved the
    tail), its wait is now an op longer than its max_wait: refused, it frees the record (DUE 0).
    (That was so when both could take the record; now B's stores are CASes from what it saw after its
    own take, so they fail and B takes another record.)  Had it been so, A's reservation would be
    left with no fence: the waiter ahead leaves, and the reservations after A are
    promised before A's promise, the defect the fences were added to close (rate*T + capacity)."""
    clock = FakeClock()
    lim = shmlimit.Limiter(name, rate=100, burst=1, clock=clock)
    other = shmlimit.Limiter(name, rate=100, burst=1, clock=clock)
    try:
        att = lim._att
        b = att.bucket
        lim.drain()
        ahead = Request(att, 50, None)
        assert ahead.begin() is not True
        tail = b.taken()
        new = (tail + b.cost) & MASK64
        wait_b = b.wait_ns(new, diff(new, b.head()), b.snap)  # B's wait before A queues
        promise_a = []
        fences = b.fences
        take = fences.take

        def preempted_take(*args):
            rec = take(*args)
            if not promise_a:  # B is preempted here: A reserves meanwhile
                promise_a.append(None)
                promise_a[0] = clock.now + other.reserve() * 1e9
            return rec

        fences.take = preempted_take
        assert lim.reserve(max_wait=(wait_b + 5 * MS) / 1e9) is None  # B: refused, an op too late
        fences.take = take
        ticket_a = b.taken()
        ahead.end()  # the waiter ahead leaves: its range is given back and skipped
        promises = [promise_a[0]]
        while len(promises) == 1 or promises[-1] < promise_a[0] - 1:  # until one is promised at A's
            promises.append(clock.now + lim.reserve() * 1e9)
        assert diff(ticket_a, b.cells.load(L.TAIL)) < 0  # (they are all behind A's ticket)
        excess = excess_over_rate(promises, 100, 1)
        assert excess <= 1e-6, (
            f"{len(promises) - 1} reservations behind A promised from "
            f"{(promises[1] - promise_a[0]) / 1e6:+.0f} ms of A's promise: {excess:.2f} ops over "
            f"rate*T + capacity (A's fence is gone)"
        )
    finally:
        other.close()
        lim.close()


def _far_dues(lim, clock):
    """Every fence record's DUE 1000 s beyond the scan's horizon (a hostile table); answers that DUE."""
    from shmlimit.shm.words import fence_horizon_ns

    b = lim._att.bucket
    far = clock.now + fence_horizon_ns(b.tpn) + 10**12
    for off in L.fence_records(L.DEFAULT_SLOTS):
        b.cells.store(off + L.FENCE_DUE, far)
    lim.drain()  # (a reservation covered at once takes no record)
    return far


def test_fence_records_with_a_due_beyond_the_horizon_do_not_refuse_reserve(name):
    """A hostile table: every record's DUE far beyond any promise (beyond ``fence_horizon_ns``).
    The scan ignores such a record (no reservation left it: it holds nothing), and so does
    ``Fences.take``: counted in use, it refused every reservation with a max_wait."""
    clock = FakeClock()
    lim = shmlimit.Limiter(name, rate=1000, burst=1, clock=clock)
    try:
        _far_dues(lim, clock)
        assert lim.reserve(max_wait=1.0) is not None, (
            "refused: every (ignored) record counted in use"
        )
    finally:
        lim.close()


def test_fence_records_with_a_due_beyond_the_horizon_do_not_block_reserve(name, monkeypatch):
    """The same hostile table: ``reserve()`` without a max_wait, behind 50 ms of queue, should
    answer at once (a promise about 50 ms on: the scan ignores those records).  With those records
    counted in use it napped (MAX_NAP at a time, the soonest DUE 1000 s past the horizon) until
    the queue ahead was covered: a reservation that blocked like an acquire.  The naps are counted
    (the clock moves with them, the filler ticks after each)."""
    import types

    import shmlimit.bucket.fences as fences

    clock = FakeClock()
    lim = shmlimit.Limiter(name, rate=1000, burst=1, clock=clock)
    try:
        b = lim._att.bucket
        _far_dues(lim, clock)
        ahead = Request(lim._att, 50, None)
        assert ahead.begin() is not True
        naps = []

        def nap(seconds):
            naps.append(seconds)
            clock.advance(max(1, int(seconds * 1e9)))
            b.replenish()

        monkeypatch.setattr(fences, "time", types.SimpleNamespace(sleep=nap))
        wait = lim.reserve()
        assert naps == [], f"reserve() napped {naps} and answered {wait}"
        # promised behind the 50 ms queue (with the margins a clean table's promise has too: the
        # filler's longest pause, the stop at the waiter's end), not covered after naps
        assert 0.051 <= wait <= 0.2
    finally:
        lim.close()


def test_the_native_fence_scan_answers_as_words_fence_scan_at_the_edge_of_far(name):
    """A record LIMIT exactly FAR (2**62) above the head is still counted, and a DUE long past
    gives a gain clamped at 2**62: the native scan once added them in int64 (``rel + gain``, 2**63:
    signed overflow, undefined, in practice -2**63: 'the head is past the fence, add nothing'),
    where ``words.fence_scan`` (Python ints) answers a room of NO_FENCE.  A hostile record then
    stopped a claim the Python code let through.  Both answer NO_FENCE now."""
    from shmlimit.shm.words import FAR, fence_scan

    clock = FakeClock()
    lim = shmlimit.Limiter(name, rate=1000, burst=1, clock=clock)
    try:
        b = lim._att.bucket
        c = b.cells
        f = b.fences
        ts = c.load(L.REPL_TS)
        rec = f.recs[0]
        head = b.head()
        c.store(rec + L.FENCE_LIMIT, (head + FAR) & MASK64)
        c.store(rec + L.FENCE_DUE, ts + 1)
        c.store(f.hint, ts + 1)
        now = ts + 1 + -(-FAR // b.tpn)  # late * tpn >= 2**62: the gain clamped at 2**62
        want = fence_scan(c, f.hint, f.recs[0], len(f.recs), ts, now, b.tpn, head, head)
        got = f.scan(ts, now, b.tpn, head)
        assert got == want
    finally:
        lim.close()


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    recs=st.lists(
        st.tuples(st.integers(-(1 << 63), (1 << 63) - 1), st.integers(-(1 << 40), 1 << 40)),
        min_size=1,
        max_size=4,
    ),
    late=st.integers(0, 1 << 50),
    tpn=st.integers(1, 1 << 40),
    ahead=st.integers(-(1 << 63), (1 << 63) - 1),
)
def test_every_backends_fence_scan_answers_as_words_fence_scan(name, recs, late, tpn, ahead):
    """The scan each backend uses (``cells.fence_scan``: native C, or words.fence_scan on atomics)
    answers as ``words.fence_scan`` for any records: LIMIT anywhere around the head, DUE around the
    claim's interval, any rate."""
    from shmlimit.shm.words import fence_scan

    clock = FakeClock()
    lim = shmlimit.Limiter(name, rate=1000, burst=1, clock=clock)
    try:
        b = lim._att.bucket
        c, f = b.cells, b.fences
        ts = c.load(L.REPL_TS)
        now = ts + late
        head = b.head()
        for off in f.recs:
            c.store(off + L.FENCE_DUE, 0)
        for off, (rel, due) in zip(f.recs, recs):
            c.store(off + L.FENCE_LIMIT, (head + rel) & MASK64)
            c.store(off + L.FENCE_DUE, max(1, ts + due))
        c.store(f.hint, 2**64 - 1)
        ticket = (head + ahead) & MASK64
        want = fence_scan(c, f.hint, f.recs[0], len(f.recs), ts, now, tpn, head, ticket)
        got = c.fence_scan(f.hint, f.recs[0], len(f.recs), ts, now, tpn, head, ticket)
        if want is None or got is None:
            assert got == want
        else:
            unbound = 1 << 61  # (a room this large binds nothing: the native clamps the gain first)
            assert got[0] == want[0] or min(got[0], want[0]) >= unbound
            assert got[1] == pytest.approx(want[1], rel=1e-12)
    finally:
        lim.close()


@pytest.mark.parametrize(
    "burst,idle_ms,ahead_ops", [(1, 30, 50), (5, 30, 50), (5, 200, 3), (10, 500, 2), (3, 1000, 0)]
)
def test_a_claim_taken_before_the_fence_and_added_after_it_keeps_the_fence(
    name, burst, idle_ms, ahead_ops
):
    """A replenisher preempted between its claim (no fence stored yet: it read none) and its add:
    meanwhile a reservation stores its fence and queues behind a waiter that then leaves (skipped).
    The claim's add, clamped against its snapshot from before the reservation's CAS, must keep
    ``head <= LIMIT`` before the promise (design.md: that clamp stops it at t - n + C = LIMIT)."""
    clock = FakeClock()
    lim = shmlimit.Limiter(name, rate=100, burst=burst, clock=clock)
    try:
        att = lim._att
        b = att.bucket
        lim.drain()
        ahead = Request(att, ahead_ops, None) if ahead_ops else None
        if ahead is not None:
            assert ahead.begin() is not True
        clock.advance(idle_ms * MS)
        claim = (
            b.claim()
        )  # the replenisher reads the clock and the words, claims ... and is preempted
        assert claim is not None
        wait = lim.reserve()
        promise = clock.now + wait * 1e9
        ticket = b.taken()
        [(limit, due)] = b.fences.in_force(
            b.cells.load(L.REPL_TS) - 1, clock.now, b.tpn, b.head()
        ) or [(None, None)]
        if limit is None:
            pytest.skip("covered at once: no fence")
        if ahead is not None:
            ahead.end()
        b.apply(claim)  # ... and lands now
        assert clock.now < promise
        assert diff(b.head(), limit) <= 0, (
            f"head {diff(b.head(), ticket) / b.cost:+.2f} ops from the ticket, past LIMIT"
        )
    finally:
        lim.close()


def test_a_reservation_over_several_rates_settles_only_its_own_fence(name, monkeypatch):
    """``_reserve_once`` checks that every provisional DUE is still ahead, then settles each fence
    (``FenceHold.settle``).  Preempted between that check and a settle past its provisional DUE
    (1 s here: covered at once), a claim frees the record (DUE before REPL_TS) and a reservation X
    on that rate takes it and stores its fence (queued 0.5 s behind a waiter).  The settle once
    stored its DUE (now) over X's: X's fence lifted at once, the waiter ahead left, and the
    reservations behind X were promised before X's promise.  Now the settle is a CAS from its own
    DUE: it fails, and the reservation is made again (behind X)."""
    from shmlimit.acquire import single as acquisition
    from shmlimit.bucket.fences import FenceHold

    clock = FakeClock()
    lim = shmlimit.Limiter(name, rates=[("100/s", 1), ("100/s", 1)], clock=clock)
    try:
        att = lim._live()[0]
        b = att.bucket
        settle = FenceHold.settle
        x = {}

        def preempted_settle(hold, f, due):
            if not x and f is b.fences:
                x["hold"] = hold
                clock.advance(
                    1500 * MS
                )  # past the provisional DUE (twice the wait, 0, and a second)
                b.replenish()
                b.take_available(att.grants_off)
                x["ahead"] = Request(att, 50, None)
                assert x["ahead"].begin() is not True
                x["promise"] = clock.now + acquisition.reserve(att, 1, None) * 1e9
                assert x["promise"] > clock.now + 400 * MS
                # X took the record this settle is about to store into (its DUE is X's promise)
                assert b.cells.load(hold.rec + L.FENCE_DUE) == pytest.approx(x["promise"], abs=2)
            return settle(hold, f, due)

        monkeypatch.setattr(FenceHold, "settle", preempted_settle)
        # covered at once on both rates, but its fence on rate 0 was claimed again past its
        # provisional DUE: made again, behind X there
        again = lim.reserve()
        assert again is not None and clock.now + again * 1e9 > x["promise"]
        assert x, "the settle of rate 0 was never reached"
        monkeypatch.setattr(FenceHold, "settle", settle)
        x["ahead"].end()  # the waiter ahead of X leaves: its range skipped
        promises = [x["promise"], clock.now + again * 1e9]
        while len(promises) == 1 or promises[-1] < x["promise"] - 1:  # until one is promised at X's
            promises.append(clock.now + acquisition.reserve(att, 1, None) * 1e9)
        excess = excess_over_rate(promises, 100, 1)
        assert excess <= 1e-6, (
            f"{len(promises) - 1} reservations behind X promised from "
            f"{(promises[1] - x['promise']) / 1e6:+.0f} ms of X's promise: {excess:.2f} ops over "
            f"rate*T + capacity (its fence was settled by another reservation)"
        )
    finally:
        lim.close()


def test_a_reserver_killed_between_its_fence_and_its_tail_cas_holds_no_one_past_its_due(name):
    """A reserver killed after storing its fence (LIMIT, DUE) and before its tail CAS leaves a fence
    for a ticket nobody holds.  Those queued behind the point are held at most until its DUE, then
    move at the rate: a waiter an op behind it is covered an op after the DUE (and a tick), no later,
    and the record is free again once a claim passes the DUE."""
    from shmlimit.bucket.fences import FenceHold

    clock = FakeClock()
    lim = shmlimit.Limiter(name, rate=100, burst=1, clock=clock)
    try:
        att = lim._att
        b = att.bucket
        lim.drain()
        ahead = Request(att, 30, None)
        assert ahead.begin() is not True
        hold = FenceHold()
        new = (b.taken() + b.cost) & MASK64
        assert hold.put(b, new, b.cost, b.snap)  # stored ... and killed before the CAS
        due = hold.due
        ahead.end()  # the waiter ahead leaves: skipped up to the dead fence
        waiter = Request(att, 1, None)
        step = waiter.begin()
        granted = None
        for _ in range(3000):
            if step is True:
                granted = clock.now
                break
            clock.advance(MS)
            b.replenish()
            step = waiter.next()
        waiter.end()
        assert granted is not None
        assert granted <= due + 10 * MS + 2 * MS, (
            f"granted {(granted - due) / 1e6:.1f} ms after the dead DUE"
        )
        assert b.fences.take(b.cells.load(L.REPL_TS)) is not None  # free again
    finally:
        lim.close()


def test_a_promise_counts_every_fence_the_scan_holds_the_head_to(name):
    """A promise and the scan ask one question of each record (``words.fence_due_counts``): a DUE
    within the horizon of now.  ``Fences.in_force`` once counted its horizon from ``REPL_TS``, so
    on a limiter with no claim for a while (here 2 s) a fence whose DUE lay less than that before
    the scan's horizon held the head (``due_ns`` waits for it) while ``promised_ns`` ignored it:
    a promise before the head could get there, a slot used early."""
    from shmlimit.shm.words import fence_horizon_ns

    clock = FakeClock()
    lim = shmlimit.Limiter(name, rate=1000, burst=1, clock=clock)
    try:
        lim.retry_after()  # its filler thread starts, to be stopped: no claim but the test's
        lim._att.filler.stop()
        lim._att.filler.join(10)
        b = lim._att.bucket
        c = b.cells
        b.replenish()
        clock.advance_seconds(2.0)  # no claim since: REPL_TS 2 s old
        head = b.head()
        due = clock.now + fence_horizon_ns(b.tpn) - 500_000_000  # within the scan's horizon
        rec = b.fences.recs[0]
        c.store(rec + L.FENCE_LIMIT, head)
        c.store(rec + L.FENCE_DUE, due)
        c.store(b.fences.hint, due)
        ticket = (c.load(L.TAIL) + b.cost * 5) & MASK64
        assert b.due_ns(ticket) >= due  # the waiters' wake time counts it ...
        assert b.promised_ns(ticket) >= due  # ... and so does the promise
    finally:
        lim.close()
