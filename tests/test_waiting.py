"""Waiting for a ticket: a precise sleep to the moment it is due, and one wake-up per turn.
(How cheap and how late is measured by tools/bench.py.)"""
import multiprocessing as mp
import os
import sys
import time

import pytest

import shmlimit
from shmlimit import acquisition as LM
from shmlimit import sleep as S
from shmlimit.cells import native_available
from support.procs import wait_for

LINUX = sys.platform.startswith("linux")


def sleepers():
    out = [("python", S._sleep_until_py)]
    if native_available():
        from shmlimit._native import sleep_until

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


def _counting_worker(name, seconds, q):
    """Acquire for a while; count every time the waiting loop sleeps or yields, per grant."""
    counts = {"wakes": 0}
    real = LM.sleep_until()
    yield_ = os.sched_yield

    def sleep_until(*a):
        counts["wakes"] += 1
        return real(*a)

    def counted_yield():
        counts["wakes"] += 1
        return yield_()

    LM._sleeper[:] = [sleep_until]
    os.sched_yield = counted_yield
    lim = shmlimit.attach(name)
    grants = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        lim.acquire()
        grants += 1
    q.put((grants, counts["wakes"]))


def test_a_waiter_wakes_about_once_per_turn(name):
    """4 processes saturating 400/s: each grant costs a sleep to its turn, not a spin before it."""
    lim = shmlimit.Limiter(name, rate=400)
    lim.close()
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    procs = [ctx.Process(target=_counting_worker, args=(name, 1.5, q)) for _ in range(4)]
    for p in procs:
        p.start()
    out = [q.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(30)
    grants = sum(g for g, _ in out)
    wakes = sum(w for _, w in out)
    assert grants >= 400  # they were saturating
    # one sleep per grant, plus a retry now and then when another process's replenish was in flight
    assert wakes <= 2 * grants, (wakes, grants)
