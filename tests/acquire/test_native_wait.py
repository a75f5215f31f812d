"""The native wait (``Bucket.waiter``, ``_native.c`` WAITER): a ticket's whole wait in one call.

Its replenish must be the reference one (``Bucket.replenish``) word for word;
it must give way to Python whenever the config changes, on a signal and on
``close()``; and waiters must use it, waking about once per turn.
(How cheap and how late is measured by tools/bench.py.)
"""

import asyncio
import multiprocessing as mp
import signal
import subprocess
import sys
import threading
import time
from contextlib import closing

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.clock import FakeClock
from support.limiters import quiet_limiter
from support.procs import WORKDIR, acquire_for, run_processes, wait_for
from support.starvation import floor, run_delay

import shmlimit
from shmlimit.acquire.single import Request
from shmlimit.acquire.sleep import SLACK_NS
from shmlimit.shm import layout as L
from shmlimit.shm.cells import MASK64, native_available, selected_backend

pytestmark = pytest.mark.skipif(
    not native_available() or selected_backend() != "native",
    reason="the native wait is the native backend's",
)

ROVERS = (
    L.REPL_TS,
    L.SNAP_HEAD,
    L.SNAP_TAIL,
    L.HEAD,
    L.TAIL,
    L.STARVED_NS,  # and the count of time lost
    L.SNAP_BASE,
    L.SNAP_END,
    L.SNAP_NEXT,
)  # and the clamp left for the next replenish


def waiter_of(lim):
    att = lim._att
    b = att.bucket
    w = b.waiter(b.snap, att.grants_off, att.waiting_off, SLACK_NS)
    assert w is not None
    return w


@pytest.fixture(scope="module")
def limiters():
    """One quiet limiter per rate (a fine, a coarse and a slow token unit), shared by the examples."""
    import uuid

    clock = FakeClock(start_ns=10**15)  # room for REPL_TS up to ~11 days back
    out = []
    for rate, burst in ((1000, None), (7e6, None), (50, 3)):
        name = f"test-nw-{uuid.uuid4().hex[:10]}"
        kw = {} if burst is None else {"burst": burst}
        out.append((quiet_limiter(name, clock, rate=rate, **kw), clock))
    yield out
    for lim, _ in out:
        lim.close()
        shmlimit.unlink(lim.name)


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    which=st.integers(0, 2),
    base=st.one_of(st.integers(0, MASK64), st.integers(MASK64 - 2**40, MASK64)),
    queued=st.integers(-(2**42), 2**50),
    snap_back=st.integers(0, 2**44),
    snap_q=st.integers(-(2**44), 2**44),
    elapsed=st.one_of(st.integers(-(10**6), 10**4), st.integers(0, 10**13)),
    clamp=st.tuples(
        st.integers(-(2**44), 2**44), st.integers(0, 2**45), st.integers(-(2**44), 2**46)
    ),
    record=st.one_of(
        st.none(),
        st.tuples(
            st.integers(-(2**44), 2**44),
            st.integers(0, 2**45),
            st.sampled_from([0, L.TICKET_GIVEN, L.TICKET_BUSY]),
        ),
    ),
    fence=st.one_of(
        st.none(),
        st.tuples(
            st.integers(-(2**44), 2**44),  # START, from the head
            st.integers(-(2**44), 2**46),  # LIMIT, from the head
            st.integers(-(10**9), 10**10),  # DUE, from the clock reading
            st.one_of(st.integers(0, 2**45), st.integers(0, MASK64)),  # TOKENS (LATE bit or not)
        ),
        st.tuples(  # a reservation just ahead, due about now: late or on its schedule
            st.integers(1, 2**40),
            st.integers(0, 2**44),
            st.integers(-(10**7), 10**7),
            st.integers(1, 2**42).map(lambda n: n | (1 << 63)) | st.integers(1, 2**42),
        ),
    ),
)
def test_the_native_replenish_is_the_reference_one(
    limiters, which, base, queued, snap_back, snap_q, elapsed, clamp, record, fence
):
    """Same words in, same clock reading: the same tokens added and the same words out, wrap
    included; with a ticket recorded (or being written, or given back) anywhere around the head,
    and a reservation's fence record anywhere around it (the time a late one owns, its mark)."""
    lim, clock = limiters[which]
    c = lim._att.cells
    b = lim._att.bucket
    now = clock.now
    head = base
    x = (head - snap_back) & MASK64
    rec_ticket, rec_len = lim._att.records[0]
    words = {
        L.HEAD: head,
        L.TAIL: (head + queued) & MASK64,
        L.SNAP_HEAD: x,
        L.SNAP_TAIL: (head - snap_back + snap_q) & MASK64,
        L.REPL_TS: now - elapsed,
        L.STARVED_NS: base >> 3,  # any count so far: the clamped time owed to the queue adds to it
        L.SNAP_BASE: (x - clamp[1]) & MASK64,
        L.SNAP_END: (x + clamp[0]) & MASK64,
        L.SNAP_NEXT: (x + clamp[2]) & MASK64,
        rec_ticket: 0 if record is None else (head + record[0]) & MASK64,
        rec_len: 0 if record is None else record[1] | record[2],
    }
    f = b.fences
    rec = f.recs[0]
    fence_words = (f.hint, rec + L.FENCE_START, rec + L.FENCE_LIMIT, rec + L.FENCE_DUE)
    fence_words += (rec + L.FENCE_TOKENS,)
    if fence is None:
        words.update(dict.fromkeys(fence_words, 0))
    else:
        due = max(1, now + fence[2])
        words.update(
            zip(
                fence_words,
                (due, (head + fence[0]) & MASK64, (head + fence[1]) & MASK64, due, fence[3]),
            )
        )

    def put():
        for off, v in words.items():
            c.store(off, v)

    put()
    ref = b.replenish()
    ref_words = [c.load(o) for o in ROVERS + fence_words]
    put()
    added, burn = waiter_of(lim).replenish(now)
    assert (added, burn) == (ref, False)
    assert [c.load(o) for o in ROVERS + fence_words] == ref_words


def test_a_waiter_bound_to_a_replaced_config_touches_nothing(name):
    clock = FakeClock()
    with closing(quiet_limiter(name, clock, rate=1000)) as lim:
        c = lim._att.cells
        w = waiter_of(lim)
        ticket = (c.load(L.TAIL) + 10**12) & MASK64
        lim.set_rate(2000)
        clock.advance(10**6)
        before = [c.load(o) for o in ROVERS]
        assert w.replenish(clock.now) == (0, False)
        assert w.wait(ticket, 1, time.monotonic_ns() + 10**9, True) == 0  # back to Python at once
        assert [c.load(o) for o in ROVERS] == before and w.naps == 0
        assert c.load(lim._att.waiting_off) == 0  # counted while inside only


def _counting_worker(name, seconds, q):
    lim = shmlimit.attach(name)
    delay0 = run_delay()
    grants = acquire_for(lim.acquire, seconds)
    delay1 = run_delay()
    w = lim._att.fast.waiter
    q.put(
        (
            grants,
            w.naps if w is not None else None,
            None if delay0 is None or delay1 is None else delay1 - delay0,
        )
    )


@pytest.mark.slow
def test_waiters_wait_natively_about_once_per_turn(name):
    """4 processes saturating 400/s: each waits in the native loop, one sleep per grant or so."""
    lim = shmlimit.Limiter(name, rate=400)
    lim.close()
    starved0 = shmlimit.inspect(name).starved_seconds
    out = run_processes(mp.get_context("fork"), _counting_worker, [(name, 1.5)] * 4, timeout=60)
    starved = shmlimit.inspect(name).starved_seconds - starved0
    assert all(naps is not None for _, naps, _ in out), out
    grants = sum(g for g, _, _ in out)
    naps = sum(n for _, n, _ in out)
    # they were saturating: a second's worth of the rate at least, less what the machine withheld
    # (support.starvation; ~0 on a quiet machine)
    assert grants >= floor(400, 400, starved, [d for _, _, d in out]), (grants, starved, out)
    assert grants / 2 <= naps <= 2 * grants, (
        naps,
        grants,
    )  # they did wait, natively, once per turn


@pytest.mark.slow
def test_a_native_waiter_counts_as_waiting_until_granted(name):
    """acquire() of one op waits in the native call straight from the fast path: its process
    shows it as waiting meanwhile, and not after."""
    lim = shmlimit.Limiter(name, rate=2, burst=1)
    lim.acquire()  # the bucket is empty: the next op is half a second away
    att = lim._att
    w = att.fast.waiter
    done = []
    t = threading.Thread(target=lambda: done.append(lim.acquire()))
    t.start()
    try:
        wait_for(lambda: w.naps >= 1)  # asleep in the native loop
        assert att.cells.load(att.waiting_off) == 1 and [
            p.waiting for p in lim.stats().processes
        ] == [True]
        t.join(10)
        assert done == [True] and att.cells.load(att.waiting_off) == 0
    finally:
        t.join(10)
        lim.close()


@pytest.mark.slow
def test_a_config_change_hands_a_native_waiter_back_to_python_on_schedule(name):
    """Another process's set_rate: the waiter leaves its loop (bound to the old capacity), the
    Python step rebinds one for the new config, and the ticket is served at its schedule time."""
    lim = shmlimit.Limiter(name, rate=2, burst=1)
    lim.acquire()  # the bucket is empty
    att = lim._att
    first = att.fast.waiter
    done = []
    t0 = time.monotonic()
    t = threading.Thread(
        target=lambda: done.append((lim.acquire(3), time.monotonic() - t0))
    )  # 1.5 s away
    t.start()
    try:
        wait_for(lambda: first.naps >= 1)  # asleep in the native loop
        other = shmlimit.attach(name)
        other.set_rate(4, burst=1)  # tickets keep their schedule time; the capacity halves
        t.join(10)
        [(granted, took)] = done
        # never early; late only by a loaded machine's scheduling
        assert granted and 1.5 - 0.01 <= took < 1.5 + 1.0, took
        assert (
            att.fast.waiter is not first and att.fast.waiter.naps >= 1
        )  # rebound, and waited in it again
        other.close()
    finally:
        lim.set_rate(1e6)
        t.join(10)
        lim.close()


_CLOSE_WHILE_WAITING = """
import sys, threading, time, shmlimit
name = sys.argv[1]
lim = shmlimit.Limiter(name, rate=1, burst=1)
lim.acquire()
out = []
def wait():
    try:
        out.append(lim.acquire(30))  # 30 s away
    except ValueError as e:
        out.append(str(e))
threads = [threading.Thread(target=wait) for _ in range(3)]
for t in threads:
    t.start()
att = lim._att
while att.cells.load(att.waiting_off) < 3:  # this process's queued callers
    time.sleep(0.005)
t0 = time.monotonic()
lim.close()  # the waiters are in the native loop, without the GIL: they leave before the unmap
for t in threads:
    t.join(5)
assert time.monotonic() - t0 < 2, time.monotonic() - t0
assert len(out) == 3 and all("closed" in str(o) for o in out), out
print("ok")
"""


@pytest.mark.slow
def test_close_wakes_the_native_waiters_before_the_mapping_goes(name):
    r = subprocess.run(
        [sys.executable, "-c", _CLOSE_WHILE_WAITING, name],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=WORKDIR,
    )
    assert r.returncode == 0 and r.stdout.strip() == "ok", (r.returncode, r.stderr[-2000:])


_INTERRUPTED = """
import sys, shmlimit
name = sys.argv[1]
lim = shmlimit.Limiter(name, rate=1, burst=1)
lim.acquire()
print("waiting", flush=True)
try:
    lim.acquire(60)
except KeyboardInterrupt:
    print("interrupted", flush=True)
"""


@pytest.mark.slow
def test_a_signal_reaches_a_native_waiter_at_once(name):
    # SIGINT's default disposition back in the child: a run started with SIGINT ignored (a
    # background job of a non-interactive shell) hands that on, and Python keeps it ignored
    p = subprocess.Popen(
        [sys.executable, "-c", _INTERRUPTED, name],
        stdout=subprocess.PIPE,
        text=True,
        cwd=WORKDIR,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        assert p.stdout.readline().strip() == "waiting"
        wait_for(lambda: sum(s.waiting for s in shmlimit.inspect(name).processes) == 1)
        t0 = time.monotonic()
        p.send_signal(signal.SIGINT)
        assert p.stdout.readline().strip() == "interrupted"
        assert time.monotonic() - t0 < 1.0  # not the minute its ticket is away
        assert p.wait(10) == 0
    finally:
        if p.poll() is None:
            p.kill()
        p.wait()


_INTERRUPTED_ONE = """
import signal, sys, time, shmlimit
from shmlimit.shm import layout as L
from shmlimit.bucket.rovers import diff
name = sys.argv[1]
t0 = time.monotonic()  # before the limiter: its third op is due 2 s after its creation at least
lim = shmlimit.Limiter(name, rate=1, burst=1)
lim.acquire()
lim.acquire()  # a second: the fast path is bound (one native call per acquire), the bucket empty
att = lim._att
assert type(att.fast.grab).__name__ == "Acquirer", att.fast.grab
if sys.argv[2] == "usr1":  # a handler that raises nothing: the acquire goes on waiting, to its turn
    signal.signal(signal.SIGUSR1, lambda *a: print("handled", flush=True))
print("waiting", flush=True)
try:
    lim.acquire()  # one op, untimed: a second away
    print("granted", round(time.monotonic() - t0, 3), flush=True)
except KeyboardInterrupt:
    c = att.cells
    print("interrupted", flush=True)
    # given back: the head skipped the ticket's range (it was next: the head is past the tail now,
    # by what accrued since), its record freed, nobody waiting
    assert diff(c.load(L.HEAD), c.load(L.TAIL)) >= 0, (c.load(L.HEAD), c.load(L.TAIL))
    assert [c.load(n) for _, n in att.records] == [0] * L.TICKET_RECORDS
    assert c.load(att.waiting_off) == 0
    print("given back", flush=True)
lim.close()
"""


@pytest.mark.slow
@pytest.mark.parametrize("sig", ["int", "usr1"])
def test_a_signal_during_a_one_call_acquire(name, sig):
    """SIGINT in an untimed acquire() of one op (grab and wait in one native call): the ticket is
    given back before KeyboardInterrupt leaves; a handler that raises nothing: it waits on, to its turn."""
    p = subprocess.Popen(
        [sys.executable, "-c", _INTERRUPTED_ONE, name, sig],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=WORKDIR,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        assert p.stdout.readline().strip() == "waiting"
        wait_for(lambda: sum(s.waiting for s in shmlimit.inspect(name).processes) == 1)
        p.send_signal(signal.SIGINT if sig == "int" else signal.SIGUSR1)
        if sig == "int":
            assert p.stdout.readline().strip() == "interrupted"
            assert p.stdout.readline().strip() == "given back"
        else:
            assert p.stdout.readline().strip() == "handled"
            word, took = p.stdout.readline().split()
            assert word == "granted" and float(took) >= 2.0 - 0.001  # never early
        assert p.wait(10) == 0, p.stderr.read()[-2000:]
    finally:
        if p.poll() is None:
            p.kill()
        p.wait()


# refills at real due instants: a late one counts starved time
@pytest.mark.slow
def test_the_native_replenish_claims_again_past_the_request_its_words_name(name):
    """The native twin of test_bucket's longer-request case, on the real clock (``refill``: both
    claims, as a waiter's and the filler's): one op, then five, at 100/s, burst 5.  The refill
    that grants the first claims again, so the refill at the second's due instant covers it; with
    words still naming the first, the head would stop an op (10 ms) inside the second."""
    with closing(quiet_limiter(name, None, rate=100, burst=5)) as lim:
        att = lim._att
        b, c = att.bucket, att.cells
        while lim.try_acquire():
            pass
        one, five = Request(att, 1, None), Request(att, 5, None)
        try:
            assert one.begin() is not True and five.begin() is not True  # both queued, recorded
            w = waiter_of(lim)
            w.refill()  # a snapshot with both queued: the words name the first request
            wait_for(lambda: time.monotonic_ns() > b.due_ns(one.ticket))
            w.refill()
            assert b.covered(one.ticket)
            if b.covered(
                five.ticket
            ):  # this process was off the CPU for the second's whole due time
                pytest.skip("descheduled past the second request's due instant: nothing to tell")
            starved = c.load(L.STARVED_NS)
            wait_for(lambda: time.monotonic_ns() > b.due_ns(five.ticket))
            w.refill()
            assert b.covered(five.ticket) and c.load(L.STARVED_NS) == starved
        finally:
            one.end()
            five.end()


# ---- on an event loop: the same wait, a step at a time ---------------------------------------------


def _records_free(att):
    return all(att.cells.load(len_off) == 0 for _, len_off in att.records)


def test_an_acquirer_step_hands_its_ticket_to_python_when_the_config_changes(name):
    """``take()`` queues a recorded ticket and counts its caller waiting; ``step()`` answers the
    instant to sleep to, never sleeping itself, and once the config changed, False: the ticket is
    still held, recorded and counted, for the Python steps, whose ``end`` gives it back."""
    from shmlimit.acquire import single
    from shmlimit.acquire.single import MAX_NAP_NS

    lim = shmlimit.Limiter(name, rate=1, per=60, burst=1)
    try:
        assert lim.try_acquire()  # empty: the next op is a minute away
        att = lim._att
        acq = att.fast.grab
        ticket = acq.take()
        assert type(ticket) is int and att.cells.load(att.waiting_off) == 1
        rec, tokens = att.find_record(ticket)
        assert rec is not None and tokens == att.bucket.cost
        t0 = time.monotonic_ns()
        at = acq.step(ticket)
        # its turn is a minute away: it looks again after MAX_NAP (a config change may come)
        assert type(at) is int and t0 < at <= time.monotonic_ns() + MAX_NAP_NS
        assert acq.step(ticket) is not None and lim.stats().grants == 1  # nothing granted early
        lim.set_rate(1, per=30, burst=1)
        assert acq.step(ticket) is False
        assert att.find_record(ticket) == (rec, tokens) and att.cells.load(att.waiting_off) == 1
        single._adopt(att, ticket).end()  # what a cancelled wait does
        assert att.cells.load(att.waiting_off) == 0 and att.find_record(ticket) == (None, 0)
        assert lim.stats().deficiency < 1.5  # its op given back: only the next op's time is owed
    finally:
        lim.close()


@pytest.mark.slow
def test_an_async_acquire_waits_by_the_native_steps_once_per_grant(name, monkeypatch):
    """``acquire_async()`` of one op waits as ``acquire`` does, a native step per wake: no Python
    step (``Request``) runs, one sleep per grant, every grant counted, and nothing left held."""
    from shmlimit.acquire import single

    lim = shmlimit.Limiter(name, rate=200, burst=1)
    sleeps = []
    sleep = single.sleep_until_async

    async def counted(deadline):
        sleeps.append(deadline)
        await sleep(deadline)

    def python_step(*args, **kwargs):
        raise AssertionError("a Python step ran")

    async def run():
        assert await lim.acquire_async()  # binds the fast path
        monkeypatch.setattr(single, "sleep_until_async", counted)
        monkeypatch.setattr(single.Request, "holding", python_step)
        monkeypatch.setattr(single.Request, "__init__", python_step)
        for _ in range(20):
            assert await lim.acquire_async()

    try:
        asyncio.run(run())
        att = lim._att
        assert 20 <= len(sleeps) <= 23  # one wake per grant (a ticket short at its turn: one more)
        assert lim.stats().grants == 21 and att.cells.load(att.waiting_off) == 0
        assert _records_free(att)
    finally:
        lim.close()


@pytest.mark.slow
def test_a_cancelled_async_waiter_gives_its_ticket_back_and_order_holds(name):
    """Three tasks queue in order, half a second apart; the first is cancelled while it waits: its
    ticket is given back (the next is served at its turn, not half a second later), the others are
    granted in their order, and nothing stays counted or recorded."""
    lim = shmlimit.Limiter(name, rate=2, burst=1)
    att = lim._att
    done = []

    async def one(i):
        await lim.acquire_async()
        done.append((i, time.monotonic()))

    async def run():
        assert await lim.acquire_async()  # empty: the next op is half a second away
        tasks = []
        for i in range(3):  # each takes its ticket before the next is started
            tasks.append(asyncio.ensure_future(one(i)))
            while att.cells.load(att.waiting_off) < i + 1:
                await asyncio.sleep(0.001)
        t0 = time.monotonic()
        tasks[0].cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return t0

    try:
        t0 = asyncio.run(run())
        assert [i for i, _ in done] == [1, 2]
        # the first's turn, when the second ticket's was a second away (late only by a loaded machine)
        assert done[0][1] - t0 < 0.9, done
        assert lim.stats().grants == 3 and att.cells.load(att.waiting_off) == 0
    finally:
        lim.close()


@pytest.mark.slow
def test_a_timed_waiter_whose_turn_moved_past_its_timeout_sleeps_to_it(name, monkeypatch):
    """A timed acquire whose wait fitted its timeout holds its ticket to its turn, even when a
    stop moved that turn past the timeout (only hierarchical mode gives a ticket back at its
    deadline).  Started again, the native wait sleeps to the turn: bounded by the timeout, each
    one returned at once past it, and the thread spun a step per 40 us until its turn."""
    lim = shmlimit.Limiter(name, rate=10, burst=1)
    other = shmlimit.attach(name)
    att = lim._att
    waits = []
    wait_native = Request.wait_native

    def counted(self):
        waits.append(time.monotonic())
        return wait_native(self)

    monkeypatch.setattr(Request, "wait_native", counted)
    out = {}

    def waiter():
        out["ok"] = lim.acquire(2, timeout=0.3)  # 0.2 s of schedule: fits, the ticket taken

    try:
        assert lim.try_acquire()  # empty
        t = threading.Thread(target=waiter)
        t.start()
        wait_for(lambda: att.cells.load(att.waiting_off) == 1, timeout=10)
        other.stop()
        time.sleep(
            0.5
        )  # the timeout passes while stopped: the turn is still ~0.2 s of schedule away
        started = time.monotonic()
        other.start()
        t.join(timeout=30)
        assert out["ok"] is True
        after = [w for w in waits if w >= started]
        assert len(after) <= 3, f"{len(after)} native waits in {time.monotonic() - started:.3f} s"
    finally:
        other.close()
        lim.close()


@pytest.mark.slow
def test_a_config_change_hands_an_async_waiter_to_python_on_schedule(name):
    """Another handle's set_rate while a task waits in the native steps: the step hands the ticket
    to a ``Request``, which serves it at its schedule time, and uncounts it once."""
    lim = shmlimit.Limiter(name, rate=2, burst=1)
    att = lim._att

    async def run():
        assert await lim.acquire_async()  # empty: the next op is half a second away
        t0 = time.monotonic()
        task = asyncio.ensure_future(lim.acquire_async())
        while att.cells.load(att.waiting_off) < 1:
            await asyncio.sleep(0.001)
        other = shmlimit.attach(name)
        other.set_rate(4, burst=1)  # tickets keep their schedule time
        other.close()
        assert await task
        return time.monotonic() - t0

    try:
        took = asyncio.run(run())
        assert 0.5 - 0.01 <= took < 0.5 + 1.0, took  # never early; late only by a loaded machine
        assert lim.stats().grants == 2 and att.cells.load(att.waiting_off) == 0
        assert _records_free(att)
    finally:
        lim.close()


def _async_stamper(name, seconds, q):
    lim = shmlimit.attach(name)

    async def task(end, out):
        while True:
            await lim.acquire_async()
            t = time.monotonic()
            if t > end:
                return
            out.append(t)

    async def run():
        end = time.monotonic() + seconds
        outs = [[], []]
        await asyncio.gather(*(task(end, o) for o in outs))
        return outs

    outs = asyncio.run(run())
    att = lim._att
    q.put((outs, att.cells.load(att.waiting_off), _records_free(att)))


@pytest.mark.slow
def test_async_waiters_in_processes_share_one_rate_without_over_grant(name):
    """4 processes, 2 tasks each, saturating 200/s through acquire_async: no window holds more than
    the rate allows, every task gets a share, and each process leaves nothing counted or held."""
    from support.windows import max_excess, tag

    rate = 200
    lim = shmlimit.Limiter(name, rate=rate)
    cap = lim.capacity
    lim.close()
    out = run_processes(mp.get_context("fork"), _async_stamper, [(name, 1.5)] * 4, timeout=60)
    results = [o for outs, _, _ in out for o in outs]
    assert all(len(r) > 0 for r in results), [len(r) for r in results]
    assert max_excess(tag(results), 1.0) <= rate + cap
    stamps = [t for r in results for t in r]
    span = max(stamps) - min(stamps)
    assert max_excess(tag(results), span + 1e-9) <= rate * span + cap + 1
    assert all(waiting == 0 and free for _, waiting, free in out), out
