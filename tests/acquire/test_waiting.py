"""Waiting for a ticket: a precise sleep to the moment it is due, and one wake-up per turn.
(How cheap and how late is measured by tools/bench.py.)"""

import asyncio
import gc
import multiprocessing as mp
import os
import sys
import threading
import time

import pytest
from support.procs import acquire_for, run_processes, wait_for
from support.starvation import floor, run_delay

import shmlimit
from shmlimit.acquire import drivers as D
from shmlimit.acquire import sleep as S
from shmlimit.shm import layout as L
from shmlimit.shm.cells import native_available

LINUX = sys.platform.startswith("linux")


def sleepers():
    out = [("python", S._sleep_until_py)]
    if native_available():
        from shmlimit.shm._native import sleep_until

        out.append(("native", lambda deadline, slack=S.SLACK_NS: sleep_until(deadline, slack)))
    return out


def process_slack(pid="self"):
    """The timer slack of a process's main thread (Linux shows no other thread's)."""
    with open(f"/proc/{pid}/timerslack_ns") as f:
        return int(f.read())


@pytest.mark.parametrize("kind, sleep_until", sleepers())
def test_sleep_until_never_returns_early(kind, sleep_until):
    for delay in (0, 1_000, 200_000, 2_000_000):
        deadline = time.monotonic_ns() + delay
        sleep_until(deadline)
        assert time.monotonic_ns() >= deadline
    sleep_until(time.monotonic_ns() - 10**9)  # a deadline in the past returns at once


def _sleep_in_main_thread(kind, conn):
    sleep_until = dict(sleepers())[kind]
    conn.send(process_slack())
    sleep_until(time.monotonic_ns() + 400_000_000)
    conn.send(process_slack())


# whether the parent looks within the child's 400 ms real sleep
@pytest.mark.slow
@pytest.mark.skipif(not LINUX, reason="timer slack is Linux's")
@pytest.mark.parametrize("kind", [k for k, _ in sleepers()])
def test_the_slack_is_lowered_for_the_sleep_only(kind):
    ctx = mp.get_context("fork")
    ours, theirs = ctx.Pipe()
    p = ctx.Process(target=_sleep_in_main_thread, args=(kind, theirs))
    p.start()
    try:
        before = ours.recv()
        assert before != S.SLACK_NS  # (the default is 50 us)
        # observed from outside while it sleeps: the sleeping thread runs with the low slack
        assert wait_for(lambda: process_slack(p.pid) == S.SLACK_NS, timeout=5, every=0.001)
        assert ours.recv() == before  # restored after the sleep
    finally:
        p.join(10)


def _thread_slack() -> int:
    """The calling thread's timer slack (prctl PR_GET_TIMERSLACK)."""
    import ctypes

    return ctypes.CDLL(None).prctl(30, 0, 0, 0, 0)


def _set_thread_slack(ns: int) -> None:
    import ctypes

    assert ctypes.CDLL(None).prctl(29, ns, 0, 0, 0) == 0


def _native_waits_in_a_thread(name, conn):
    """In a fresh thread: its slack before and after natively waited turns, and that of a process
    it forks then; then the slack of a second thread, which never waited."""
    out = {}

    def run():
        _set_thread_slack(50_000)
        out["before"] = _thread_slack()
        lim = shmlimit.attach(name)
        try:
            naps = lim._att.fast.waiter.naps if lim._att.fast.waiter is not None else None
            for _ in range(25):  # the capacity (10), then turns waited for natively
                lim.acquire()
            out["slept"] = lim._att.fast.waiter.naps - naps if naps is not None else None
            out["after"] = _thread_slack()
        finally:
            lim.close()
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child's thread: the slack from before the wait
            try:
                os.write(w, str(_thread_slack()).encode())
            finally:
                os._exit(0)
        os.close(w)
        with os.fdopen(r) as f:
            out["child"] = int(f.read())
        os.waitpid(pid, 0)

    t = threading.Thread(target=run)
    t.start()
    t.join()
    seen = []
    other = threading.Thread(target=lambda: seen.append(_thread_slack()))
    other.start()
    other.join()
    out["other"] = seen[0]
    conn.send(out)


@pytest.mark.skipif(
    not LINUX or not native_available(), reason="the native wait's timer slack (Linux)"
)
def test_the_native_wait_lowers_its_thread_slack_once_and_keeps_it(name):
    from shmlimit.shm.cells import selected_backend

    if selected_backend() != "native":
        pytest.skip("the native wait is the native backend's")
    lim = shmlimit.Limiter(name, rate=1000)  # capacity 10: the 11th acquire waits for its turn
    lim.close()
    ctx = mp.get_context("fork")
    ours, theirs = ctx.Pipe()
    p = ctx.Process(target=_native_waits_in_a_thread, args=(name, theirs))
    p.start()
    try:
        assert ours.poll(60), "the child did not answer"
        out = ours.recv()
    finally:
        p.join(10)
        if p.is_alive():
            p.kill()
            p.join()
    assert out["before"] == 50_000, out
    assert out["slept"], out  # the waits slept (natively): the slack is theirs to set
    assert out["after"] == S.SLACK_NS, out  # kept after the wait: no prctl per wait to restore it
    assert out["child"] == 50_000, (
        out
    )  # a process forked afterwards begins with the slack from before
    assert out["other"] != S.SLACK_NS, out  # per thread: one that never waited keeps its own


def _counting_worker(name, seconds, q):
    """Acquire for a while; count every time the waiting loop sleeps or yields, per grant."""
    counts = {"wakes": 0}
    real = D.sleep_until()
    yield_ = os.sched_yield

    def sleep_until(*a):
        counts["wakes"] += 1
        return real(*a)

    def counted_yield():
        counts["wakes"] += 1
        return yield_()

    D._sleeper[:] = [sleep_until]
    os.sched_yield = counted_yield
    lim = shmlimit.attach(name)
    delay0 = run_delay()
    grants = acquire_for(lim.acquire, seconds)
    delay1 = run_delay()
    q.put((grants, counts["wakes"], None if delay0 is None or delay1 is None else delay1 - delay0))


# grants per real second of four saturating processes
@pytest.mark.slow
def test_a_waiter_wakes_about_once_per_turn(name):
    """4 processes saturating 400/s: each grant costs a sleep to its turn, not a spin before it."""
    lim = shmlimit.Limiter(name, rate=400)
    lim.close()
    starved0 = shmlimit.inspect(name).starved_seconds
    out = run_processes(mp.get_context("fork"), _counting_worker, [(name, 1.5)] * 4, timeout=60)
    starved = shmlimit.inspect(name).starved_seconds - starved0
    grants = sum(g for g, _, _ in out)
    wakes = sum(w for _, w, _ in out)
    # they were saturating: a second's worth of the rate at least, less what the machine withheld
    # (support.starvation; ~0 on a quiet machine)
    assert grants >= floor(400, 400, starved, [d for _, _, d in out]), (grants, starved, out)
    # one sleep per grant, plus a retry now and then when another process's replenish was in flight
    assert wakes <= 2 * grants, (wakes, grants)


@pytest.mark.slow
def test_a_waiter_at_a_stop_replenishes_at_its_turn_not_a_wake_later(name):
    """Capacity one op: the head stops at the end of every request until a snapshot is taken
    there, so a replenish that covers a ticket a wake's lateness after its turn drops that
    lateness (the request behind accrues only from then): every grant of the grid would come
    later by it.  The waiter at a stop wakes a little before its turn and replenishes at it,
    so the grants keep their grid: two threads saturating 200/s, each grant later than the one
    before by the replenish itself and the claim after it (the median: now and then one is
    late by what the machine withheld), where a wake-up's lateness is tens of microseconds."""
    lim = shmlimit.Limiter(name, rate=200, burst=1)
    lim.retry_after()  # its filler thread starts, to be stopped: only the waiters replenish
    lim._att.filler.stop()
    lim._att.filler.join(10)
    c = lim._att.cells
    stamps = []

    def waiter():
        for _ in range(25):
            lim.acquire()
            stamps.append(
                c.load(L.REPL_TS)
            )  # the claim taken where the head stopped, right after it

    lim.acquire()  # the bucket's one op: from here on every grant is a stop
    threads = [threading.Thread(target=waiter) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    lim.close()
    # from the third on (both threads queued); a thread held off the CPU for a turn or more after
    # its grant reads the next claim instead of its own: counted once, its own gap then doubled
    stamps = sorted(set(stamps))[2:]
    late = sorted(b - a - 5_000_000 for a, b in zip(stamps, stamps[1:]))
    assert len(late) >= 40 and late[0] >= 0, late  # never a grant before its turn
    if c.backend == "native":  # under a microsecond; a wake-up's lateness is 10-50 us
        assert late[len(late) // 2] <= 10_000, late  # ns
    # (the atomics backend's replenish runs in Python, tens of microseconds, its threads share
    # one GIL and wake in Python: there the median follows the machine's load, not the stop)


# ---- on an event loop: a timerfd armed at the instant, not the selector's millisecond ---------------


def test_sleep_until_async_never_returns_early():
    async def run():
        for delay in (0, 1_000, 200_000, 2_000_000):
            deadline = time.monotonic_ns() + delay
            await S.sleep_until_async(deadline)
            assert time.monotonic_ns() >= deadline
        await S.sleep_until_async(
            time.monotonic_ns() - 10**9
        )  # a deadline in the past returns at once

    asyncio.run(run())


# whether a 20 ms real sleep ends before a 300 ms one fires
@pytest.mark.slow
@pytest.mark.skipif(not LINUX, reason="timerfd is Linux's")
def test_a_loop_waits_on_one_timerfd_armed_at_the_earliest_deadline():
    async def run():
        loop = asyncio.get_running_loop()
        now = time.monotonic_ns()
        late = asyncio.ensure_future(S.sleep_until_async(now + 300_000_000))
        await asyncio.sleep(0)
        timer = S._timers[loop]
        assert timer.armed == now + 300_000_000
        early = time.monotonic_ns() + 20_000_000
        await S.sleep_until_async(early)  # armed earlier for it, then at the later one again
        assert time.monotonic_ns() >= early and not late.done()
        assert timer.armed == now + 300_000_000
        await late
        assert time.monotonic_ns() >= now + 300_000_000
        assert (
            S._timers[loop] is timer and timer.armed == 0 and timer.heap == []
        )  # disarmed, drained
        with pytest.raises(BlockingIOError):
            os.read(timer.fd, 8)  # nothing pending: the next waiter will not wake early
        return timer.fd

    fd = asyncio.run(run())
    gc.collect()
    with pytest.raises(OSError):
        os.fstat(fd)  # closed with its loop


@pytest.mark.skipif(not LINUX, reason="timerfd is Linux's")
def test_a_cancelled_async_sleep_wakes_nobody_else_early():
    async def run():
        now = time.monotonic_ns()
        cancelled = asyncio.ensure_future(S.sleep_until_async(now + 5_000_000))
        await asyncio.sleep(0)
        cancelled.cancel()
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        await S.sleep_until_async(now + 30_000_000)  # the cancelled deadline passes meanwhile
        assert time.monotonic_ns() >= now + 30_000_000
        assert S._timers[asyncio.get_running_loop()].heap == []

    asyncio.run(run())


# whether some of a 50 ms real deadline is left when the sleep starts
@pytest.mark.slow
def test_without_a_timerfd_the_async_sleep_is_asyncio_sleep(monkeypatch):
    monkeypatch.setattr(S, "_timerfd", False)
    slept = []
    real = asyncio.sleep

    async def sleep(seconds, *a):
        slept.append(seconds)
        await real(seconds, *a)

    monkeypatch.setattr(asyncio, "sleep", sleep)

    async def run():
        deadline = time.monotonic_ns() + 50_000_000
        await S.sleep_until_async(deadline)
        assert time.monotonic_ns() >= deadline

    asyncio.run(run())
    assert len(slept) == 1 and 0 < slept[0] <= 0.05


@pytest.mark.skipif(not LINUX, reason="timerfd is Linux's")
def test_an_async_waiter_waits_for_its_turn_on_a_timerfd(name, monkeypatch):
    lim = shmlimit.Limiter(name, rate=200)
    try:

        async def run():
            for _ in range(int(lim.capacity)):  # the burst
                assert await lim.acquire_async()

            async def no_coarse_sleep(
                *a,
            ):  # a ticket's wait must not take the selector's granularity
                raise AssertionError("asyncio.sleep used for a ticket's wait")

            monkeypatch.setattr(asyncio, "sleep", no_coarse_sleep)
            before = time.monotonic_ns()
            for _ in range(3):
                assert await lim.acquire_async()
            return time.monotonic_ns() - before

        took = asyncio.run(run())
        assert (
            took >= 2 * 5_000_000 - 1_000_000
        )  # three turns 5 ms apart, the first one maybe partly past
    finally:
        lim.close()


@pytest.mark.skipif(not LINUX, reason="timerfd is Linux's")
def test_a_loop_timer_makes_one_system_call_per_wake(monkeypatch):
    """A one-shot timerfd that fired is disarmed: each wake re-arms it at the next deadline (which
    also leaves it unreadable) or, none left, reads it; never both, and never a disarm."""
    calls = []
    real_read = os.read

    def read(fd, n):
        calls.append(("read", fd))
        return real_read(fd, n)

    async def run():
        loop = asyncio.get_running_loop()
        now = time.monotonic_ns()
        await S.sleep_until_async(now + 1_000_000)  # makes the loop's timer
        timer = S._timers[loop]
        real_arm = timer.arm
        timer.arm = lambda fd, at: (calls.append(("arm", at)), real_arm(fd, at))[1]
        monkeypatch.setattr(os, "read", read)
        now = time.monotonic_ns()
        first, second = now + 10_000_000, now + 20_000_000
        later = asyncio.ensure_future(S.sleep_until_async(second))
        await S.sleep_until_async(first)
        await later
        monkeypatch.setattr(os, "read", real_read)
        return timer, first, second

    timer, first, second = asyncio.run(run())
    # armed for the first wait (the second, later, needs no arming); at its wake, re-armed for the
    # second; at that one's, read
    assert calls == [("arm", first), ("arm", second), ("read", timer.fd)]
    assert timer.armed == 0 and timer.heap == []


@pytest.mark.slow
@pytest.mark.parametrize("driver", ["sync", "async"])
def test_a_waiter_replenishes_at_its_turn_without_working_it_out_again(name, monkeypatch, driver):
    """``acquire()`` and ``acquire_async()`` park once per grant, working out the turn (``due_ns``)
    for the park only: woken at that instant, the request replenishes at once (``turn_ns``).
    Otherwise every wake would work the turn out again, to find it reached: two ``due_ns`` a grant."""
    from shmlimit.bucket.rovers import Bucket

    # the Python steps: with the native backend a wake is one native step (test_native_wait)
    monkeypatch.setenv("SHMLIMIT_BACKEND", "atomics")
    lim = shmlimit.Limiter(name, rate=200, burst=5)
    assert lim.backend == "atomics"
    counts = {"due": 0, "sleeps": 0}
    due_ns, sleep, sleep_until = Bucket.due_ns, D.sleep_until_async, D.sleep_until()

    def counted_due(self, ticket):
        counts["due"] += 1
        return due_ns(self, ticket)

    async def counted_sleep(deadline):
        counts["sleeps"] += 1
        await sleep(deadline)

    def counted_sleep_until(deadline, seen=None):
        counts["sleeps"] += 1
        sleep_until(deadline, seen)

    async def run():
        for _ in range(20):
            assert await lim.acquire_async()

    try:
        for _ in range(int(lim.capacity)):  # the burst
            assert lim.acquire()
        monkeypatch.setattr(Bucket, "due_ns", counted_due)
        monkeypatch.setattr(D, "sleep_until_async", counted_sleep)
        monkeypatch.setattr(D, "sleep_until", lambda: counted_sleep_until)
        if driver == "async":
            asyncio.run(run())
        else:
            for _ in range(20):
                assert lim.acquire()
    finally:
        lim.close()
    assert 19 <= counts["sleeps"] <= 22  # one park per grant (a ticket short at its turn: one more)
    # one turn worked out per park; a ticket short at its turn (a replenish in flight) works out
    # its retry in next(), which parks again: still one per park
    assert counts["due"] <= counts["sleeps"] + 1


def test_a_wake_queues_nothing_on_a_loop_that_is_not_running():
    """A skip wakes the coroutines waiting on each loop's timer (``wake_waiters``); a loop kept open
    but not running has none waiting, and is left alone: before, each skip queued one callback on
    it, for as long as it stayed open (20 000 skips, 20 000 callbacks)."""
    from types import SimpleNamespace

    from shmlimit.acquire import sleep as S

    loop = asyncio.new_event_loop()
    try:  # a timer made for it by a wait it ran
        loop.run_until_complete(S.sleep_until_async(time.monotonic_ns() + 1_000_000))
        cells = SimpleNamespace(wake_waiters=lambda: None)
        for _ in range(100):
            S.wake_waiters(cells)
        assert len(loop._ready) == 0
    finally:
        loop.close()


def test_a_sleep_to_a_turn_ends_at_a_wake_since_its_step_and_not_early_otherwise():
    """The precise sleep of a turn (``drive``'s, native or Python): given the wake count read before
    the step that chose its deadline, it ends at once on a ``wake_waiters`` since (a skip made the
    turn sooner), and otherwise never before its deadline."""
    from types import SimpleNamespace

    from shmlimit.acquire import sleep as S

    sleep_until = S.sleeper()
    cells = SimpleNamespace(wake_waiters=lambda: None)
    seen = S.wakes()
    S.wake_waiters(cells)  # between the step and the sleep: not missed
    t = time.monotonic_ns()
    sleep_until(t + 60_000_000_000, seen)  # (a minute: a wake, not its deadline, can end it ...)
    assert time.monotonic_ns() - t < 30_000_000_000  # (... however busy the machine)
    deadline = time.monotonic_ns() + 20_000_000
    sleep_until(deadline, S.wakes())
    assert time.monotonic_ns() >= deadline
