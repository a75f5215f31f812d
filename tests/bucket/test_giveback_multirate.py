"""Abandoned tickets over several rates (``rates=``): every queued ticket of a request over several
rates is recorded in its rate's process slot, as a single rate's is, and given back when its waiter
is interrupted, cancelled or killed.  Each test fails on a limiter that leaves the range queued:
whoever comes next on that rate waits for the abandoned request's whole schedule.
"""

import asyncio
import mmap
import subprocess
import sys
import textwrap
import threading
import time

import pytest
from support.aio import until
from support.clock import FakeClock
from support.procs import WORKDIR, interrupted_after, wait_for
from support.reservations import PREAMBLE, killed_part_way, queued
from support.segments import shm_bytes

import shmlimit
from shmlimit.bucket.giveback import record
from shmlimit.bucket.rovers import diff
from shmlimit.bucket.schedule import LONGEST_FILL_NS
from shmlimit.multirate import MultiLimiter, MultiRequest
from shmlimit.shm import layout as L

#: a promise after a skip on a clock that stood still counts the filler's longest pause (s)
LOST = LONGEST_FILL_NS / 1e9


def make(name, rates, clock=None):
    lim = shmlimit.Limiter(name, rates=rates, clock=clock)
    assert isinstance(lim, MultiLimiter)
    return lim


def empty(lim):
    """Take every op every rate holds now (one op on all at a time), so that the next request queues."""
    while lim.try_acquire():
        pass


def request(lim, timeout=None, n=1, **costs):
    ops = lim._ops(n, costs)
    return MultiRequest(lim._live(), ops, lim._tokens(ops), timeout)


def advance(lim, clock, seconds, tick=0.001):
    """Move the fake clock as a filler would see it (a replenish of every rate every ``tick``), each
    process's skipper skipping the ranges it gave back as the head reaches them."""
    for _ in range(max(1, round(seconds / tick))):
        clock.advance(round(tick * 1e9))
        for att in lim._live():
            att.bucket.replenish()
            att.returns.step()


def assert_recorded(req):
    """``req`` (one rate's ``Request``) holds its ticket in one of its process slot's records, exactly."""
    att = req.att
    assert req.record is not None and req.record in {off for _, off in att.records}
    assert att.cells.load(req.record) == req.tokens > 0
    assert att.cells.load(req.record - 8) == req.ticket


def test_an_interrupted_lead_ticket_is_recorded_and_given_back(name, cleanup):
    clock = FakeClock()
    lim = make(name, {"a": ("1/s", 1), "b": ("10/s", 1)}, clock)
    cleanup.append(lim)
    empty(lim)
    r = request(lim, a=5, b=1)  # five seconds of a's schedule
    assert r.begin() is not True
    assert r.state == "lead" and [i for i, _ in r.waits] == [0]
    assert_recorded(r.waits[0][1])
    a = lim._live()[0]
    behind = request(lim, a=1)
    assert behind.begin() is not True  # queued behind it on a
    r.end()  # interrupted (the driver's finally): its ticket is given back, the head skips it
    assert [a.cells.load(off) for _, off in a.records].count(
        0
    ) == L.TICKET_RECORDS - 1  # behind's only
    advance(lim, clock, 1.001)
    assert behind.next() is True  # one op's schedule, not six
    behind.end()


def test_a_ticket_queued_on_another_rate_is_recorded_and_given_back(name, cleanup):
    clock = FakeClock()
    lim = make(name, {"a": ("1/s", 1), "b": ("10/s", 1)}, clock)
    cleanup.append(lim)
    empty(lim)
    r = request(lim, a=1, b=1)
    assert r.begin() is not True and r.state == "lead"  # a leads
    b = lim._live()[1]
    promised = shmlimit.multirate.acquisition.reserve(b, 15, None)  # 1.5 s of b's schedule ...
    assert promised >= 1.5  # ... its fence holding those behind it until its promise
    advance(lim, clock, 1.002)
    assert (
        r.next() is not True and r.state == "others"
    )  # a is due: it queues on b behind the reservation
    assert [i for i, _ in r.waits] == [1]
    assert_recorded(r.waits[0][1])
    bystander = request(lim, b=1)
    assert (
        bystander.begin() is not True
    )  # behind it on b: due an op after the promise without it, two with it
    r.end()  # interrupted: its ticket on b is given back (and a's op it held), skipped once the fence lifts
    advance(lim, clock, promised + 0.1 - 1.002 - 0.004)
    assert bystander.next() is not True
    advance(lim, clock, 0.006)
    assert bystander.next() is True
    bystander.end()


def test_a_rate_whose_records_are_all_in_use_is_joined_once_one_is_free(name, cleanup):
    clock = FakeClock()
    lim = make(name, {"a": ("1/s", 1), "b": ("10/s", 1)}, clock)
    cleanup.append(lim)
    empty(lim)
    a = lim._live()[0]
    cells = a.cells
    far = (cells.load(L.TAIL) - 10**12) % 2**64  # long passed: no range of the queue
    for _ in range(L.TICKET_RECORDS):  # every record of this process's slot on a is in use
        assert record(cells, a.records, far, 1) is not None
    tail = cells.load(L.TAIL)
    r = request(lim, a=1, b=1)
    nap = r.begin()
    assert nap is not True and nap is not False and 0 < nap <= 0.25
    assert r.joining == [0] and r.waits == [] and cells.load(L.TAIL) == tail  # took nothing on a
    assert r.next() is not True and cells.load(L.TAIL) == tail  # still none free: still nothing
    cells.store(a.records[0][1], 0)  # one is freed (a waiter of this process was served)
    assert r.next() is not True
    assert r.joining == [] and [i for i, _ in r.waits] == [0]
    assert_recorded(r.waits[0][1])
    r.end()
    # a timed request refuses at its deadline, holding nothing, if no record frees meanwhile
    for _, off in a.records:
        cells.store(off, 0)
    for _ in range(L.TICKET_RECORDS):
        record(cells, a.records, far, 1)
    t = request(lim, timeout=2.0, a=1, b=1)
    assert t.begin() is not True
    clock.advance(2_000_000_001)
    assert t.next() is False
    assert t.waits == [] and t.held == []
    for _, off in a.records:
        cells.store(off, 0)


# ---- real processes, real time -------------------------------------------------------------------

RATES = [("10/s", 1), ("20/s", 1)]


@pytest.mark.slow
def test_keyboard_interrupt_in_a_multirate_waiter_gives_its_tickets_back(name, cleanup):
    lim = make(name, RATES)
    cleanup.append(lim)
    empty(lim)
    with interrupted_after(0.1), pytest.raises(KeyboardInterrupt):
        lim.acquire(600)  # a minute of the first rate's schedule
    assert lim.acquire(1, timeout=0.5)  # one op's schedule away, not a minute
    assert all(s.processes[0].waiting == 0 for s in lim.stats().rates.values())


@pytest.mark.slow
def test_a_cancelled_async_multirate_waiter_gives_its_tickets_back(name, cleanup):
    lim = make(name, RATES)
    cleanup.append(lim)

    async def main():
        empty(lim)
        task = asyncio.ensure_future(lim.acquire_async(600))
        await until(
            lambda: lim.stats().rates["0"].processes[0].waiting == 1
        )  # queued on the lead rate (waited for, not slept on)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return await lim.acquire_async(1, timeout=0.5)

    assert asyncio.run(main())


KILLED_MULTI_WAITER = textwrap.dedent(
    """
    import sys
    import shmlimit
    lim = shmlimit.Limiter(sys.argv[1], rates=[("10/s", 1), ("20/s", 1)])
    print("ready", flush=True)
    lim.acquire(int(sys.argv[2]))
    print("granted", flush=True)
    """
)


@pytest.mark.slow
def test_a_killed_multirate_waiter_does_not_stall_those_behind_it(name, cleanup):
    lim = make(name, RATES)
    cleanup.append(lim)
    empty(lim)
    p = subprocess.Popen(
        [sys.executable, "-c", KILLED_MULTI_WAITER, name, "600"],
        stdout=subprocess.PIPE,
        text=True,
        cwd=WORKDIR,
    )
    try:
        assert p.stdout.readline().strip() == "ready"

        def queued():  # the child waits on some rate: its ticket is taken (a minute of the first rate's)
            return any(
                pr.pid == p.pid and pr.waiting
                for s in lim.stats().rates.values()
                for pr in s.processes
            )

        wait_for(queued, timeout=30)
        cells = lim._live()[0].cells
        assert diff(cells.load(L.TAIL), cells.load(L.HEAD)) > 500 * lim._live()[0].bucket.cost
    finally:
        p.kill()
        p.wait()
        p.stdout.close()
    t0 = time.monotonic()
    while not lim.acquire(1, timeout=0.2):
        assert time.monotonic() < t0 + 5.0, "still behind the killed waiter's minute"
    waited = time.monotonic() - t0
    # as for one rate: the filler gives the dead ticket back within REAP_EVERY (0.1 s), plus a lease
    # takeover (50 ms, and a watcher's look) if the dead process was the filler, plus this op's 0.1 s
    assert waited < 2.0, waited


# ---- a reservation over several rates refused part-way ------------------------------------------


def _racing_claims(monkeypatch, lim, key, before):
    """Run ``before()`` once, just before the reservation's claim on rate ``key`` (its bucket's
    ``take_within``): another caller acting between the reservation's look and that claim (an
    injected thread switch)."""
    b = lim._live()[lim.keys.index(key)].bucket
    real = b.take_within
    once = []

    def racing(*args, **kwargs):
        if not once:
            once.append(True)
            before()
        return real(*args, **kwargs)

    monkeypatch.setattr(b, "take_within", racing)


def with_another_caller_of_b(name, cleanup):
    """Rates a (10/s) and b (1/s) on a fake clock, emptied (a's next slot in 0.1 s, b's in 1 s), and
    another caller of b: ``(the limiter of both, the other)``."""
    clock = FakeClock()
    lim = make(name, {"a": ("10/s", 1), "b": ("1/s", 1)}, clock)
    cleanup.append(lim)
    other = make(name, {"a": ("10/s", 1), "b": ("1/s", 1)}, clock)  # a caller of b alone
    cleanup.insert(0, other)  # closed before the limiter of both
    empty(lim)
    return lim, other


def test_a_reservation_refused_on_a_later_rate_gives_back_its_earlier_claims(
    name, cleanup, monkeypatch
):
    lim, other = with_another_caller_of_b(name, cleanup)
    a = lim._live()[0]
    # between the reservation's look and its claim on b, the other caller takes b's next slot
    _racing_claims(monkeypatch, lim, "b", lambda: other.reserve(b=1))
    assert lim.reserve(max_wait=1.5) is None  # a claimed (queued: 0.1 s), then b 2 s away: refused
    monkeypatch.undo()
    # a's claim, queued, went back by the skip: nothing queued on a, its record free again
    assert diff(a.cells.load(L.TAIL), a.cells.load(L.HEAD)) <= 0
    assert (
        a.returns.pending() == []
        and [a.cells.load(off) for _, off in a.records] == [0] * L.TICKET_RECORDS
    )
    # so a's next caller is promised a's next slot, not one behind a dead claim (0.2 s) ... (and
    # the replenish after the skip, which adds nothing: the clock stood still since the last one)
    assert lim.reserve(a=1) == pytest.approx(0.1 + LOST, abs=1e-6)
    # ... and nothing was counted for the refusal; b's slot is the other caller's
    assert lim.stats().grants == {"a": 2, "b": 2}


def test_a_reservation_interrupted_part_way_gives_back_its_claims(name, cleanup, monkeypatch):
    clock = FakeClock()
    lim = make(name, {"a": ("10/s", 1), "b": ("1/s", 1)}, clock)
    cleanup.append(lim)
    empty(lim)
    a, b = lim._live()
    advance(lim, clock, 0.05)  # half of a's next op accrued: its claim is part covered, part queued

    def interrupt():
        raise KeyboardInterrupt

    _racing_claims(monkeypatch, lim, "b", interrupt)
    with pytest.raises(KeyboardInterrupt):
        lim.reserve()
    monkeypatch.undo()
    assert diff(a.cells.load(L.TAIL), a.cells.load(L.HEAD)) <= 0  # given back: a queues nothing
    assert a.returns.pending() == []
    assert diff(b.cells.load(L.TAIL), b.cells.load(L.HEAD)) <= 0  # b was never claimed
    # the half op that had accrued on a was lost to the skip, never passed on: a's next slot is
    # 0.1 s from now, not sooner (no grant out of time a dead claim was given), and the replenish
    # after the skip adds nothing (the clock stood still since the last one)
    assert lim.reserve(a=1) == pytest.approx(0.1 + LOST, abs=1e-6)
    assert lim.stats().grants == {"a": 2, "b": 1}


def test_a_reservation_whose_later_rate_takes_all_records_still_gives_back(
    name, cleanup, monkeypatch
):
    # every record of this process's slot on a is in use: the claim there is taken unrecorded,
    # and given back on the refusal all the same
    lim, other = with_another_caller_of_b(name, cleanup)
    a = lim._live()[0]
    cells = a.cells
    far = (cells.load(L.TAIL) - 10**12) % 2**64
    for _ in range(L.TICKET_RECORDS):
        assert record(cells, a.records, far, 1) is not None
    _racing_claims(monkeypatch, lim, "b", lambda: other.reserve(b=1))
    assert lim.reserve(max_wait=1.5) is None
    monkeypatch.undo()
    assert diff(cells.load(L.TAIL), cells.load(L.HEAD)) <= 0 and a.returns.pending() == []
    for _, off in a.records:
        cells.store(off, 0)


RESERVES_AND_IS_KILLED = PREAMBLE + textwrap.dedent(
    """
    lim = shmlimit.Limiter(sys.argv[1], rates={"a": ("1/min", 1), "b": ("1/h", 1)})
    atts = lim._live()
    stop_part_way(lim, lambda looks: "claimed" if queued(atts) else None)  # a claimed (a minute), b not yet
    lim.reserve()
    """
)


@pytest.mark.slow
def test_a_process_killed_part_way_through_a_reservation_leaves_no_claim_queued(name, cleanup):
    lim = make(name, {"a": ("1/min", 1), "b": ("1/h", 1)})
    cleanup.append(lim)
    empty(lim)
    a = lim._live()[0]
    cells = a.cells
    with killed_part_way(RESERVES_AND_IS_KILLED, name) as said:
        assert said == "claimed"
        assert diff(cells.load(L.TAIL), cells.load(L.HEAD)) > 0  # a minute of a's schedule queued
    # the claim was recorded in the child's slot on a: this process's filler reaps it, the head skips it
    wait_for(lambda: diff(cells.load(L.TAIL), cells.load(L.HEAD)) <= 0, timeout=10)


RESERVES_WITH_EVERY_RECORD_IN_USE_AND_IS_KILLED = PREAMBLE + textwrap.dedent(
    """
    from shmlimit.shm import layout as L
    from shmlimit.bucket.giveback import record
    lim = shmlimit.Limiter(sys.argv[1], rates={"a": ("1/min", 1), "b": ("1/h", 1)})
    atts = lim._live()
    a = atts[0]
    far = (a.cells.load(L.TAIL) - 10**12) % 2**64  # long passed: no range of the queue
    for _ in range(L.TICKET_RECORDS):  # every record of this process's slot on a is in use
        assert record(a.cells, a.records, far, 1) is not None
    stop_part_way(lim, lambda looks: "claimed" if queued(atts) else None)  # a claim queued on some rate
    lim.reserve()
    """
)


@pytest.mark.slow
def test_a_process_killed_between_two_claims_with_every_record_in_use_leaves_no_claim_queued(
    name, cleanup
):
    # a (the shorter wait, claimed first) finds all five of the child's records in use: its claim
    # must not be taken unrecorded while another rate is still to claim, or a death there leaves a
    # minute of a's schedule queued that no reap can see
    lim = make(name, {"a": ("1/min", 1), "b": ("1/h", 1)})
    cleanup.append(lim)
    empty(lim)
    atts = lim._live()
    with killed_part_way(RESERVES_WITH_EVERY_RECORD_IN_USE_AND_IS_KILLED, name) as said:
        assert said == "claimed" and queued(atts)  # one claim queued
    # every queued claim was recorded in the child's slot: this process's filler reaps it, the head skips it
    wait_for(
        lambda: all(diff(t.cells.load(L.TAIL), t.cells.load(L.HEAD)) <= 0 for t in atts), timeout=10
    )
    assert lim.reserve(a=1) < 61  # a's next slot, not one behind a dead claim


def test_a_reservation_finding_every_record_in_use_on_two_rates_waits_for_one(
    name, cleanup, monkeypatch
):
    # a claim other than the last needs a record: with none free on any rate still to claim, the
    # reservation waits for one (a waiter of this process is granted), or refuses at max_wait
    clock = FakeClock()
    lim = make(name, {"a": ("10/s", 1), "b": ("1/s", 1)}, clock)
    cleanup.append(lim)
    empty(lim)
    a, b = lim._live()
    for att in (a, b):
        far = (att.cells.load(L.TAIL) - 10**12) % 2**64
        for _ in range(L.TICKET_RECORDS):
            assert record(att.cells, att.records, far, 1) is not None
    tails = [a.cells.load(L.TAIL), b.cells.load(L.TAIL)]
    naps = []
    real_sleep, me = time.sleep, threading.current_thread()

    def ours(
        fake,
    ):  # time.sleep is the time module's: this process's filler and skipper threads sleep as before
        return lambda seconds: (
            fake(seconds) if threading.current_thread() is me else real_sleep(seconds)
        )

    def nap(seconds):  # the wait for a record: the fake clock moves past max_wait
        naps.append(seconds)
        clock.advance(round(0.2e9))

    monkeypatch.setattr("shmlimit.multirate.time.sleep", ours(nap))
    assert lim.reserve(max_wait=1.5) is None
    assert (
        naps and [a.cells.load(L.TAIL), b.cells.load(L.TAIL)] == tails
    )  # took nothing on either rate
    empty(lim)  # what accrued meanwhile: the next reservation queues on both rates again

    def freeing(seconds):  # a waiter of this process on b is granted: its record is free
        naps.append(seconds)
        b.cells.store(b.records[0][1], 0)

    naps.clear()
    monkeypatch.setattr("shmlimit.multirate.time.sleep", ours(freeing))
    real = a.bucket.take_within
    seen = []

    def claim_a(*args, **kwargs):  # a is claimed last, b's claim held in the freed record meanwhile
        seen.append(b.cells.load(b.records[0][1]))
        return real(*args, **kwargs)

    monkeypatch.setattr(a.bucket, "take_within", claim_a)
    assert lim.reserve() == pytest.approx(1.0, abs=1e-3)
    assert len(naps) == 1 and seen and seen[-1] == b.bucket.cost
    assert b.cells.load(b.records[0][1]) == 0  # made: no longer a waiter's ticket
    for att in (a, b):
        for _, off in att.records:
            att.cells.store(off, 0)


def test_a_reservation_claiming_on_a_rate_being_closed_takes_nothing_there(name, monkeypatch):
    # One thread reserves over two rates while another closes the limiter.  The first claim comes
    # while its rate's attachment is leaving its slot (its records no longer handed out): taken
    # unrecorded, it would be a range in no record once the reservation fails on the next rate
    # (closed by then), so no one would ever skip it -- every other process waiting on that rate
    # would wait out its schedule.  A claim on a closing rate takes nothing: the call fails.
    import shmlimit.multirate as multirate_module

    lim = make(name, {"a": ("1000/s", 1), "b": ("1/s", 1)})  # a has the shorter wait: claimed first
    empty(lim)
    a, b = lim._live()
    # a's region of the group's one segment, read through the filesystem once a is closed
    a_file, (a_off, _) = (
        a.seg.name,
        L.group_geometry(L.segment_size(a.table.slots), mmap.ALLOCATIONGRANULARITY),
    )
    at_claim, go_a, stepped, b_closed = (threading.Event() for _ in range(4))
    outcome = []
    real_claim = multirate_module.claim

    def claim(att, tokens, max_ns, last=True, fence=None):
        if threading.current_thread() is reserver:
            if att is a:
                at_claim.set()
                assert go_a.wait(30)  # ... until a's close has left its slot
            else:
                stepped.set()
                assert b_closed.wait(30)  # ... until the whole limiter is closed
        return real_claim(att, tokens, max_ns, last, fence)

    def reserve():
        try:
            outcome.append(lim.reserve())
        except ValueError as e:  # closed under the call
            outcome.append(e)
        finally:
            stepped.set()

    def a_tail():
        raw = shm_bytes(a_file)
        return int.from_bytes(raw[a_off + L.TAIL : a_off + L.TAIL + 8], "little")

    monkeypatch.setattr(multirate_module, "claim", claim)
    real_unregister = a.table.unregister

    def unregister(*args):  # a's close: past waiting for its record writers, leaving the slot
        real_unregister(*args)
        go_a.set()
        assert stepped.wait(30)

    monkeypatch.setattr(a.table, "unregister", unregister)
    reserver = threading.Thread(target=reserve)
    try:
        reserver.start()
        assert at_claim.wait(30)
        tail = a_tail()
        lim.close()
        b_closed.set()
        reserver.join(30)
        assert not reserver.is_alive() and outcome
        assert isinstance(outcome[0], ValueError), outcome
        assert a_tail() == tail, "a claim on a closing rate was taken into no record"
    finally:
        go_a.set()
        b_closed.set()
        reserver.join(30)
        if not lim.closed:
            lim.close()
