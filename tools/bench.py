#!/usr/bin/env python3
"""shmlimit benchmark: every figure measured side by side in one run, as ratios to baselines from the same run.

    python tools/bench.py            # the table (about two minutes on 2 cores)
    python tools/bench.py --json     # the same figures as one JSON object
    python tools/bench.py --quick    # shorter runs, for a smoke test
    python tools/bench.py --only-waiting   # section 5 only (waiting: CPU and lateness)
    python tools/bench.py --only-hierarchy # section 9's table only (local vs hierarchical, a Redis started for it)
    python tools/bench.py --only-asyncio   # section 12 only (acquire_async against bare asyncio sleepers)
    python tools/bench.py --only-hierarchy-cpu # section 9a only (hierarchical vs local CPU at 50/s)
    python tools/bench.py --only-limits-hits   # section 13 only (limits' hits on shm:// vs memory://)

1. cost of acquire() in one process at an effectively unlimited rate, per backend,
   against a bare native atomic fetch-add called from Python (the floor) and a
   multiprocessing.Value + Lock token bucket (what users write themselves);
   1b. try_acquire granted and refused, and acquire(timeout=0) refused, as ns/op and as a
   ratio to a granted acquire, per backend; and the atomic operations (counted) of an
   uncontended acquire on the atomics backend;
2. aggregate acquires/s with 1, 2, 4, 8 processes on one unlimited limiter, against the same baseline;
3. rate fidelity: 4 processes sharing 500, 5000, 100 000 and 1 000 000 ops/s for 5 s;
4. lateness of each grant after its scheduled moment at 1000/s with 4 processes;
5. CPU burned by 8 processes waiting on a 50/s limit; and for 8 processes saturating 50, 1000
   and 10 000/s: CPU per wall second together (the filler threads' share apart, and the waiting
   threads' wakes per grant), lateness p50/p99/max and the load average; then the floors: 8
   processes waking at 1 000/s and at 10 000/s from a bare precise sleep, no limiter, and each
   saturated row's CPU as a multiple of its rate's floor;
6. the rate achieved while the filler's own process runs a CPU-bound Python loop;
7. Redis, 4 processes: ops/s and Redis round trips per op for the direct RedisLimiter and the
   hierarchical mode side by side (with --redis URL, or a redis-server started for the run when
   one is on the PATH; skipped otherwise);
8. keyed limits: KeyedLimiter.try_acquire on a live key (granted and refused), the first use of
   a new key and churn through a full table, as ratios to the single Limiter.try_acquire of the
   same run; 4 processes over 100 000 keys against a Manager().dict() + Lock keyed bucket and
   against `limits` with RedisStorage (when `limits` is installed: pip install '.[bench]').
9. the hierarchical mode against the local one, 8 processes (50/s untimed and timed with their CPU,
   1000/s), and its fidelity and round trips per op from 1/s to 1 000 000/s;
   9a. at 50/s with 8 untimed waiters, local and hierarchical runs alternating: the whole process
   tree's CPU as a ratio (the target: at most 1.5x) and the filler threads' CPU per lease;
11. several rates at once (rates=): acquire(), try_acquire(), acquire(timeout=1.0) and
    acquire(2) over two rates, and acquire(requests=1, tokens=50) over a dict of two, one process
    at an unlimited rate, as ratios to the single-rate acquire() of the same process and run, per
    backend (the target: a granted acquire() over two rates at most 2.5x one rate's, native);
10. three hosts reaching Redis through delaying TCP proxies (1, 3, 5 ms each way): the global rate
    against the window bound, round trips per op, acquire() latency at 70 % load, and one host
    cut off for 2 s (needs a redis-server on 127.0.0.1: the one started for the run, or --redis);
12. asyncio: 8 processes, each one event loop saturating 1000/s through acquire_async, against 8
    bare asyncio sleepers waking at the same instants with the same precise sleep (the loop's
    timerfd), and bare asyncio.sleep ones: CPU per wall second, wakes per grant, lateness, and the
    waiters' CPU as a multiple of the precise sleepers' (the two kinds taking 40 turns of 0.25 s
    each; the target: at most 1.25);
13. `limits` hits on shm:// (when `limits` is installed): one process hitting 64 keys at a limit
    never reached, through limits' fixed window, sliding window counter and moving window, on
    shm:// and on limits' own memory://, interleaved, best of: us per hit and the ratio shm/memory
    (the target: at most 1.5x for the fixed window and the sliding window counter); then 4
    processes hitting at once: aggregate hits/s on shm:// (one table, shared), memory:// (each
    process its own, not shared) and limits' Redis storage (the redis-server of sections 7 and 9).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import math
import mmap
import multiprocessing as mp
import os
import platform
import random
import resource
import sys
import threading
import time
import uuid
from typing import Callable, Dict, Iterator, List, Optional

import shmlimit
from shmlimit.shm.cells import native_available, selected_backend

# The window check and the process helpers are the test suite's own, so the benchmark and the
# tests run and judge processes the same way.
sys.path.insert(
    0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests")
)
from support.procs import acquire_for, run_processes, stamp_until  # noqa: E402
from support.starvation import steal_seconds  # noqa: E402
from support.windows import max_in_window  # noqa: E402

UNLIMITED = dict(
    rate=1e9, burst=1e9
)  # 1e9 ops/s with a second of burst: never waits in a benchmark


# ---- baselines ---------------------------------------------------------------------------------


class ValueLockBucket:
    """The token bucket users write themselves: a multiprocessing.Value guarded by a Lock."""

    def __init__(self, rate: float, burst: float, ctx=mp) -> None:
        self.rate = rate
        self.burst = burst
        self.tokens = ctx.Value("d", burst, lock=False)
        self.stamp = ctx.Value("d", time.monotonic(), lock=False)
        self.lock = ctx.Lock()

    def acquire(self) -> bool:
        while True:
            with self.lock:
                now = time.monotonic()
                t = min(self.burst, self.tokens.value + (now - self.stamp.value) * self.rate)
                self.stamp.value = now
                if t >= 1:
                    self.tokens.value = t - 1
                    return True
                self.tokens.value = t
                wait = (1 - t) / self.rate
            time.sleep(wait)


def best_ns_per_call(fn: Callable[[], object], n: int, repeat: int = 3) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter_ns()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter_ns() - t0) / n)
    return best


def _single_cost(backend: str, n: int, q) -> None:
    os.environ["SHMLIMIT_BACKEND"] = backend
    name = f"bench-{uuid.uuid4().hex[:8]}"
    lim = shmlimit.Limiter(name, **UNLIMITED)
    try:
        q.put(best_ns_per_call(lim.acquire, n))
    finally:
        lim.close()
        lim.unlink()


def _timed_ns(acquire: Callable[..., bool], n: int) -> float:
    """ns per ``acquire(timeout=0)``, called inline (no wrapper frame, as a caller would write it)."""
    t0 = time.perf_counter_ns()
    for _ in range(n):
        acquire(timeout=0)
    return (time.perf_counter_ns() - t0) / n


def _try_costs(backend: str, n: int, q) -> None:
    """try_acquire granted and refused, a timed acquire refused: ns/op, next to a granted acquire."""
    os.environ["SHMLIMIT_BACKEND"] = backend
    free = shmlimit.Limiter(f"bench-{uuid.uuid4().hex[:8]}", **UNLIMITED)
    # one op per hour and its one token taken: every call below is refused (no replenish can help)
    dry = shmlimit.Limiter(f"bench-{uuid.uuid4().hex[:8]}", rate=1, per=3600, burst=1)
    assert dry.try_acquire()
    try:
        runs = {
            "acquire granted": lambda: best_ns_per_call(free.acquire, n, 1),
            "try_acquire granted": lambda: best_ns_per_call(free.try_acquire, n, 1),
            "try_acquire refused": lambda: best_ns_per_call(dry.try_acquire, n, 1),
            "acquire(timeout=0) refused": lambda: _timed_ns(dry.acquire, n),
        }
        # rounds of all four, the best of each: the machine's noise hits them alike
        out = {k: float("inf") for k in runs}
        for _ in range(7):
            for k, run in runs.items():
                out[k] = min(out[k], run())
        assert not dry.try_acquire() and not dry.acquire(timeout=0)
        if backend == "atomics":
            out["atomic ops per grant"] = _atomic_ops_per_grant(free)
            # a grant that waits for its turn (2 000/s, one op of burst): every call queues
            paced = shmlimit.Limiter(f"bench-{uuid.uuid4().hex[:8]}", rate=2000, burst=1)
            try:
                paced.acquire()
                out["atomic ops per waited grant"] = _atomic_ops_per_grant(paced, 400)
            finally:
                paced.close()
                paced.unlink()
        q.put(out)
    finally:
        for lim in (free, dry):
            lim.close()
            lim.unlink()


def _atomic_ops_per_grant(lim, n: int = 1000) -> float:
    """Counted, not assumed: the atomics package's operations an acquire() makes (in the calling
    thread: the filler's are not the call's); its plain loads, where they are sequentially
    consistent (x86-64), are no call into the package and are not counted."""
    cells = lim._att.cells
    p = getattr(cells, "_p", None)
    if p is None:
        return float("nan")  # the package's public API: not counted
    me = threading.get_ident()
    count = [0]
    saved = {}
    for attr in ("_ld", "_st", "_fa", "_cx"):
        fn = saved[attr] = getattr(p, attr)

        def counted(*args, _fn=fn):
            if threading.get_ident() == me:  # not the filler thread's
                count[0] += 1
            return _fn(*args)

        setattr(p, attr, counted)
    try:
        for _ in range(n):
            lim.acquire()
    finally:
        for attr, fn in saved.items():
            setattr(p, attr, fn)
    return count[0] / n


def bench_tries(n: int) -> Dict[str, Dict[str, float]]:
    """Section 1b: the refusal path against a granted acquire, per backend (each in a fresh process)."""
    out: Dict[str, Dict[str, float]] = {}
    ctx = mp.get_context("spawn")
    for backend in ["native", "atomics"] if native_available() else ["atomics"]:
        out[backend] = run_processes(
            ctx, _try_costs, [(backend, n if backend == "native" else max(2000, n // 50))], 300
        )[0]
    return out


def bench_single(n: int) -> Dict[str, float]:
    out: Dict[str, float] = {}
    if native_available():
        from shmlimit.shm._native import NativeCells

        mm = mmap.mmap(-1, 4096)
        cells = NativeCells(mm, 4096)
        add = cells.fetch_add
        out["floor: native fetch_add"] = best_ns_per_call(lambda: add(0, 1), n)
        cells.close()
    bucket = ValueLockBucket(1e9, 1e9)
    out["baseline: Value+Lock bucket"] = best_ns_per_call(bucket.acquire, n)
    ctx = mp.get_context("spawn")
    for backend in ["native", "atomics"] if native_available() else ["atomics"]:
        args = (backend, n if backend == "native" else max(2000, n // 50))
        out[f"shmlimit acquire ({backend})"] = run_processes(ctx, _single_cost, [args], 300)[0]
    return out


# ---- aggregate throughput -------------------------------------------------------------------------


def _hammer(lim, barrier, seconds: float, q) -> None:
    barrier.wait(timeout=120)
    end = time.monotonic() + seconds
    n = 0
    acquire = lim.acquire
    while True:
        for _ in range(200):
            acquire()
        n += 200
        if time.monotonic() >= end:
            break
    q.put(n / seconds)


def bench_aggregate(procs: List[int], seconds: float) -> Dict[str, Dict[int, float]]:
    ctx = mp.get_context("fork")
    out: Dict[str, Dict[int, float]] = {"shmlimit": {}, "Value+Lock": {}}
    for kind in out:
        for k in procs:
            barrier = ctx.Barrier(k)
            if kind == "shmlimit":
                name = f"bench-{uuid.uuid4().hex[:8]}"
                lim = shmlimit.Limiter(name, **UNLIMITED)
                target = lim
            else:
                target = ValueLockBucket(1e9, 1e9, ctx)
            out[kind][k] = sum(run_processes(ctx, _hammer, [(target, barrier, seconds)] * k))
            if kind == "shmlimit":
                lim.close()
                lim.unlink()
    return out


# ---- rate fidelity, lateness ------------------------------------------------------------------------


def _stamp(lim, barrier, seconds: float, q) -> None:
    """Acquire until the end; record grant times into a list (compactly, as offsets in ns)."""
    barrier.wait(timeout=120)
    start = time.monotonic_ns()
    q.put((start, stamp_until(lim.acquire, start + int(seconds * 1e9), time.monotonic_ns)))


def run_stamped(
    rate: float, procs: int, seconds: float, burst: Optional[float] = None, method: str = "fork"
):
    ctx = mp.get_context(method)
    name = f"bench-{uuid.uuid4().hex[:8]}"
    lim = shmlimit.Limiter(name, rate=rate, burst=burst)
    cap = lim.capacity
    results = run_processes(ctx, _stamp, [(lim, ctx.Barrier(procs), seconds)] * procs, 600)
    lim.close()
    lim.unlink()
    # the window in which every process was running: from the last start to the first end
    start = max(r[0] for r in results)
    end = min(r[0] for r in results) + int(seconds * 1e9)
    stamps = sorted(t for r in results for t in r[1])
    return start, end, stamps, cap


def bench_fidelity(rates: List[float], seconds: float) -> List[dict]:
    rows = []
    for rate in rates:
        start, end, stamps, cap = run_stamped(rate, 4, seconds)
        lo = start + 1_000_000_000
        achieved = sum(1 for t in stamps if lo <= t < end) / ((end - lo) / 1e9)
        worst = max_in_window(stamps, 1_000_000_000)
        rows.append(
            dict(
                target=rate,
                achieved=achieved,
                error_pct=100.0 * (achieved - rate) / rate,
                max_1s_window=worst,
                bound=rate + cap,
                within_bound=worst <= rate + cap,
            )
        )
    return rows


def bench_lateness(seconds: float) -> dict:
    rate = 1000.0
    start, end, stamps, cap = run_stamped(rate, 4, seconds)
    return dict(grants=len(stamps), **lateness_ms(stamps, start, rate, int(cap)))


def lateness_ms(stamps: List[int], start: int, rate: float, cap: int) -> Dict[str, float]:
    """p50, p99 and max of how late each grant came after its moment on the grid (ms).

    Saturated FIFO consumers of an exact limiter: once the initial capacity
    is spent, grants fall on a grid 1/rate apart.  The limiter never grants
    early, so the grid is anchored on the earliest grant relative to it.
    """
    offsets = [(t - start) / 1e9 - k / rate for k, t in enumerate(sorted(stamps)) if k >= cap]
    anchor = min(offsets) if offsets else 0.0
    late = sorted(o - anchor for o in offsets) or [0.0]
    pick = lambda p: late[min(len(late) - 1, int(p * len(late)))] * 1e3  # noqa: E731
    return dict(p50_ms=pick(0.50), p99_ms=pick(0.99), max_ms=late[-1] * 1e3)


# ---- CPU while waiting, the filler under load --------------------------------------------------------


def _wait_cpu(lim, barrier, seconds: float, q) -> None:
    barrier.wait(timeout=120)
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    n = acquire_for(lim.acquire, seconds)
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    q.put((r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime, n))


def bench_cpu(seconds: float) -> dict:
    ctx = mp.get_context("fork")
    name = f"bench-{uuid.uuid4().hex[:8]}"
    lim = shmlimit.Limiter(name, rate=50)
    lim.close()  # the measuring process takes no part
    barrier = ctx.Barrier(8)
    res = run_processes(
        ctx, _wait_cpu, [(shmlimit.attach(name), barrier, seconds) for _ in range(8)], 300
    )
    shmlimit.unlink(name)
    cpu = sum(r[0] for r in res)
    return dict(processes=8, rate=50, cpu_s_per_wall_s=cpu / seconds, grants=sum(r[1] for r in res))


def _sleeps(tid: int) -> int:
    """Voluntary context switches of this process's thread ``tid`` so far: its sleeps, so its wakes."""
    try:
        with open(f"/proc/self/task/{tid}/status") as f:
            for line in f:
                if line.startswith("voluntary_ctxt_switches:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def _stamped_with_cpu(barrier, seconds: float, q, stamp: Callable[[int], list], lim=None) -> None:
    """Once every process is up, ``stamp(end)`` (grant times until ``end``, monotonic ns); puts its
    start, the stamps and this process's CPU seconds (every thread) meanwhile, and with ``lim``
    apart: its filler thread's CPU seconds (watching, or filling) and this thread's wakes.

    A waiter's process uses ``lim`` once before the barrier, taking nothing (``retry_after``): it
    registers and starts its filler thread then, once per process, not in the measured wait
    (1.2-2.8 ms of CPU, measured, against the 25 ms a process burns in section 12's 2 s)."""
    if lim is not None:
        lim.retry_after()
    barrier.wait(timeout=120)
    me = threading.get_native_id()
    f0, w0 = (_thread_cpu(lim._att.filler), _sleeps(me)) if lim is not None else (0.0, 0)
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    start = time.monotonic_ns()
    stamps = stamp(start + int(seconds * 1e9))
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    f1, w1 = (_thread_cpu(lim._att.filler), _sleeps(me)) if lim is not None else (0.0, 0)
    q.put((start, stamps, r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime, f1 - f0, w1 - w0))


def _wait_stamped(lim, barrier, seconds: float, q) -> None:
    """Acquire until the end, recording grant times and this process's CPU (its filler's apart)."""
    _stamped_with_cpu(
        barrier, seconds, q, lambda end: stamp_until(lim.acquire, end, time.monotonic_ns), lim
    )


def _wait_stamped_async(lim, barrier, seconds: float, q) -> None:
    """``_wait_stamped`` with ``acquire_async``: one task on this process's event loop."""

    async def run(end: int) -> list:
        stamps, acquire, clock = [], lim.acquire_async, time.monotonic_ns
        while True:
            await acquire()
            t = clock()
            if t > end:
                return stamps
            stamps.append(t)

    _stamped_with_cpu(barrier, seconds, q, lambda end: asyncio.run(run(end)), lim)


#: How far after the floor's processes are all through the barrier their shared grid begins (ns):
#: time for each of them to leave the barrier before its first deadline.
GRID_LEAD_NS = 5_000_000


def _grid_start(t0) -> None:
    """The floor's barrier action (run once, in one process, before any is released): the shared
    grid begins ``GRID_LEAD_NS`` from now."""
    t0.value = time.monotonic_ns() + GRID_LEAD_NS


def _sleep_stamped(rate: float, index: int, procs: int, t0, barrier, seconds: float, q) -> None:
    """The floor: no limiter, a bare precise sleep (``shmlimit.acquire.sleep``'s: an absolute deadline, the
    waiters' timer slack) to every ``procs``-th instant of one grid ``1/rate`` apart that every
    process of the floor shares (it begins at ``t0``, fixed once all of them are up), as the
    waiters' grants fall on one grid; the wake times (monotonic ns), which ``bench_sleep_floor``
    judges as the waiters' grant times are judged (``lateness_ms``).

    The grid begins once every process is through the barrier, so every process sleeps for the
    whole measured time: a grid fixed before the processes were up had them idle until it began,
    and the floor counted fewer wakes than the rows it is read against."""
    from shmlimit.acquire.sleep import sleeper

    sleep_until = sleeper()

    def wakes(end: int) -> list:
        clock, begin = time.monotonic_ns, t0.value
        stamps, k, stop = [], index + 1, begin + int(seconds * 1e9)
        while True:
            at = begin + int(k * 1e9 / rate)
            if at > stop:
                return stamps
            sleep_until(at)
            stamps.append(clock())
            k += procs

    _stamped_with_cpu(barrier, seconds, q, wakes)


def _sleep_stamped_async(
    precise: bool, rate: float, index: int, procs: int, t0, barrier, seconds: float, q
) -> None:
    """``_sleep_stamped`` on an event loop: one task on this process's loop awaits each of its
    instants of the shared grid, with the waiters' precise sleep (``sleep_until_async``: the loop's
    timerfd) when ``precise``, else a plain ``asyncio.sleep`` of the time left (the selector's
    whole milliseconds, rounded up)."""
    from shmlimit.acquire.sleep import sleep_until_async

    async def wakes() -> list:
        clock, begin = time.monotonic_ns, t0.value
        stamps, k, stop = [], index + 1, begin + int(seconds * 1e9)
        while True:
            at = begin + int(k * 1e9 / rate)
            if at > stop:
                return stamps
            if precise:
                await sleep_until_async(at)
            else:
                await asyncio.sleep(max(0, at - clock()) / 1e9)
            stamps.append(clock())
            k += procs

    _stamped_with_cpu(barrier, seconds, q, lambda end: asyncio.run(wakes()))


#: The floors: how each kind of bare sleeper waits (``bench_sleep_floor``'s ``driver``).
FLOORS = {
    "bare sleep": _sleep_stamped,
    "bare asyncio": functools.partial(_sleep_stamped_async, True),
    "bare asyncio.sleep": functools.partial(_sleep_stamped_async, False),
}


def bench_sleep_floor(
    rate: float, seconds: float, procs: int = 8, driver: str = "bare sleep"
) -> dict:
    """Section 5's floor: what ``procs`` processes waking once per op of ``rate`` cost and how late they
    wake on this machine now, without any limiter (the same sleep a waiter's is, minus the limiter).

    Their lateness is measured as the waiters' is, against the same kind of schedule: every wake
    of every process pooled and sorted, the k-th against the k-th instant of one grid ``1/rate``
    apart, anchored on the earliest (``lateness_ms``).  ``driver``: one of ``FLOORS``, a blocking
    sleep by default (section 12: an event loop's)."""
    ctx = mp.get_context("fork")
    t0 = ctx.Value("q", 0)
    barrier = ctx.Barrier(procs, action=functools.partial(_grid_start, t0))
    res = run_processes(
        ctx, FLOORS[driver], [(rate, i, procs, t0, barrier, seconds) for i in range(procs)], 300
    )
    stamps = [t for r in res for t in r[1]]
    return dict(
        processes=procs,
        rate=rate,
        driver=driver,
        cpu_s_per_wall_s=sum(r[2] for r in res) / seconds,
        grants=len(stamps),
        load=os.getloadavg()[0],
        **lateness_ms(stamps, t0.value, rate, 0),
    )


def bench_waiting(
    rate: float, seconds: float, procs: int = 8, driver: str = "sync", backend: str = "native"
) -> dict:
    """Section 5: procs processes saturating ``rate``: CPU per wall second together, and lateness.

    ``driver``: "sync" (``acquire``) or "async" (``acquire_async``, one task per process's loop).
    ``backend``: the waiters' atomic layer ("atomics": no native wait, as without a compiler)."""
    if backend != "native":
        saved = os.environ.get("SHMLIMIT_BACKEND")
        os.environ["SHMLIMIT_BACKEND"] = (
            backend  # the waiters attach and choose their sleep with it
        )
        try:
            return bench_waiting(rate, seconds, procs, driver, "native") | {
                "driver": f"{driver}, {backend}"
            }
        finally:
            if saved is None:
                del os.environ["SHMLIMIT_BACKEND"]
            else:
                os.environ["SHMLIMIT_BACKEND"] = saved
    ctx = mp.get_context("fork")
    name = f"bench-{uuid.uuid4().hex[:8]}"
    lim = shmlimit.Limiter(name, rate=rate)
    cap = int(lim.capacity)
    lim.close()  # the measuring process takes no part
    barrier = ctx.Barrier(procs)
    target = _wait_stamped_async if driver == "async" else _wait_stamped
    res = run_processes(
        ctx, target, [(shmlimit.attach(name), barrier, seconds) for _ in range(procs)], 300
    )
    shmlimit.unlink(name)
    start = max(r[0] for r in res)
    stamps = [t for r in res for t in r[1]]
    split = {}
    if driver in ("sync", "async"):  # apart: the filler threads' share, the waiting threads' wakes
        split = dict(
            filler_cpu_s_per_wall_s=sum(r[3] for r in res) / seconds,
            wakes_per_grant=sum(r[4] for r in res) / max(1, len(stamps)),
        )
    return dict(
        processes=procs,
        rate=rate,
        driver=driver,
        cpu_s_per_wall_s=sum(r[2] for r in res) / seconds,
        grants=len(stamps),
        load=os.getloadavg()[0],
        **split,
        **lateness_ms(stamps, start, rate, cap),
    )  # as in section 4


def waiting_rows(seconds: float) -> List[dict]:
    """Section 5's rows: blocking waiters at 50, 1 000 and 10 000/s, then at 1 000/s async ones and
    blocking ones on the ``atomics`` backend, and the floors: bare sleeps at 1 000 and 10 000/s, no
    limiter (the same wakes, to the same absolute deadlines, with the same timer slack, in the same
    number of Python processes: what this machine charges for them now)."""
    rows = [bench_waiting(r, seconds) for r in (50.0, 1000.0, 10_000.0)]
    rows += [
        bench_waiting(1000.0, seconds, driver="async"),
        bench_waiting(1000.0, seconds, backend="atomics"),
    ]
    return rows + [
        bench_sleep_floor(r, seconds) for r in (1000.0, 10_000.0)
    ]  # the machine's own, right after


def floor_ratios(rows: List[dict]) -> Dict[str, Dict[float, float]]:
    """Each saturated row's CPU per wall second as a multiple of the bare sleeps' at its rate
    (``driver`` -> {rate: ratio}), for the rates the run has a floor of."""
    floors = {w["rate"]: w["cpu_s_per_wall_s"] for w in rows if w.get("driver") == "bare sleep"}
    out: Dict[str, Dict[float, float]] = {}
    for w in rows:
        f = floors.get(w["rate"])
        if w.get("driver") != "bare sleep" and f:
            out.setdefault(w.get("driver", "sync"), {})[w["rate"]] = w["cpu_s_per_wall_s"] / f
    return out


def _busy_filler(name: str, ready, stop) -> None:
    lim = shmlimit.attach(name)
    lim.try_acquire()  # a process runs a filler thread from its first use on, not from opening
    deadline = time.monotonic() + 30
    while shmlimit.inspect(name).filler_pid != os.getpid():  # become the filler first
        if stop.is_set() or time.monotonic() > deadline:
            lim.close()
            return
        time.sleep(0.005)

    def spin() -> None:
        x = 0
        while not stop.is_set():
            for i in range(10000):
                x += i * i

    t = threading.Thread(target=spin, daemon=True)
    t.start()
    ready.set()
    stop.wait()
    t.join()
    lim.close()


def bench_filler_under_load(seconds: float) -> dict:
    ctx = mp.get_context("fork")
    name = f"bench-{uuid.uuid4().hex[:8]}"
    rate = 1000.0
    lim = shmlimit.Limiter(name, rate=rate)
    lim.close()
    ready, stop = ctx.Event(), ctx.Event()
    busy = ctx.Process(target=_busy_filler, args=(name, ready, stop))
    busy.start()
    ready.wait(60)
    barrier = ctx.Barrier(3)
    results = run_processes(
        ctx, _stamp, [(shmlimit.attach(name), barrier, seconds) for _ in range(3)], 300
    )
    filler = shmlimit.inspect(name).filler_pid  # the busy process is alive until ``stop``
    stop.set()
    busy.join()
    shmlimit.unlink(name)
    lo = max(r[0] for r in results) + 1_000_000_000
    end = min(r[0] for r in results) + int(seconds * 1e9)
    stamps = sorted(t for r in results for t in r[1])
    achieved = sum(1 for t in stamps if lo <= t < end) / ((end - lo) / 1e9)
    return dict(
        target=rate,
        achieved=achieved,
        error_pct=100.0 * (achieved - rate) / rate,
        filler_was_busy_process=filler == busy.pid,
    )


# ---- report --------------------------------------------------------------------------------------------


# ---- 7. Redis: direct and hierarchical ---------------------------------------------------------


def _redis_worker(
    kind: str, name: str, url: str, rate: float, burst: float, barrier, seconds: float, q
) -> None:
    if kind == "direct":
        from shmlimit.redis.direct import RedisLimiter

        lim = RedisLimiter(name, rate=rate, burst=burst, url=url)
        lim.retry_after()  # connected and the script loaded before the clock starts
    else:
        lim = shmlimit.attach(name)
    barrier.wait()
    n = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        lim.acquire()
        n += 1
    q.put((n, lim.stats().round_trips if kind == "direct" else 0))


def bench_redis(url: str, seconds: float, procs: int = 4) -> List[dict]:
    from shmlimit.redis.direct import RedisLimiter

    rows = []
    ctx = mp.get_context("fork")
    for rate, burst in ((1e6, 1e5), (2000.0, 200.0)):
        for kind in ("direct", "hierarchical"):
            gname = f"bench-{uuid.uuid4().hex[:8]}"
            host = None
            if kind == "hierarchical":
                host = shmlimit.Limiter(
                    gname + "-host", upstream=RedisLimiter(gname, rate=rate, burst=burst, url=url)
                )
            barrier = ctx.Barrier(procs + 1)
            q = ctx.Queue()
            name = gname if kind == "direct" else gname + "-host"
            ps = [
                ctx.Process(
                    target=_redis_worker, args=(kind, name, url, rate, burst, barrier, seconds, q)
                )
                for _ in range(procs)
            ]
            for p in ps:
                p.start()
            trips0 = host.stats().upstream.round_trips if host else 0
            barrier.wait()
            t0 = time.monotonic()
            out = [q.get(timeout=seconds + 60) for _ in ps]
            wall = time.monotonic() - t0
            for p in ps:
                p.join()
            ops = sum(n for n, _ in out)
            trips = (
                sum(t for _, t in out)
                if host is None
                else host.stats().upstream.round_trips - trips0
            )
            if host is not None:
                host.close()
                shmlimit.unlink(name)
            rows.append(
                dict(
                    kind=kind,
                    target=rate,
                    ops_per_s=ops / wall,
                    round_trips=trips,
                    round_trips_per_op=trips / max(1, ops),
                )
            )
    return rows


# ---- 8. the hierarchical mode at every rate ----------------------------------------------------------


def _fed_worker(
    lim, timed: bool, barrier, seconds: float, skip: float, stamp: bool, q, done=None
) -> None:
    """Acquire (timed: acquire(timeout=0.5)) until the end; count and maybe stamp grants after ``skip``.

    The CPU is read when this worker's loop ends; it then waits (``done``) until every worker's
    has: a worker that exited first would hand the filler to one still measuring, whose CPU
    would then count a takeover (in hierarchical mode, a new Redis connection) that is no part
    of waiting.
    """
    barrier.wait(timeout=120)
    w0 = _sleeps(threading.get_native_id())
    d0 = _run_delay(threading.get_native_id())
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    own0 = time.thread_time()
    start = time.monotonic_ns()
    lo, end = start + int(skip * 1e9), start + int(seconds * 1e9)
    clock = time.monotonic_ns
    acquire = lim.acquire
    stamps: List[int] = []
    n = total = refused = 0
    while True:
        ok = acquire(timeout=0.5) if timed else acquire()
        t = clock()
        if ok:
            total += 1
        else:
            refused += 1
        if t > end:
            break
        if ok and t >= lo:
            n += 1
            if stamp:
                stamps.append(t)
    own = time.thread_time() - own0  # the waiting thread's own CPU
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    wakes = _sleeps(threading.get_native_id()) - w0
    delay = _run_delay(threading.get_native_id()) - d0
    filler = _thread_cpu(
        lim._att.filler
    )  # started by this worker's first use: all of it is in the run
    if done is not None:
        done.wait(timeout=120)
    q.put(
        (
            start,
            n,
            stamps,
            r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime - filler,
            total,
            filler,
            wakes,
            refused,
            delay,
            own,
        )
    )


def _thread_cpu(thread) -> float:
    """CPU seconds of a running thread of this process (0.0 when there is none)."""
    if thread is None or not thread.is_alive() or thread.ident is None:
        return 0.0
    try:
        return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
    except (OSError, AttributeError):
        return 0.0


def run_fed(
    url: Optional[str], rate: float, procs: int, seconds: float, timed: bool = False
) -> dict:
    """``procs`` forked processes on one limiter -- local, or hierarchical through Redis at ``url``.

    The limiter's creator (this process) uses it first and holds the filler
    lease before the workers start, so the filler runs here: the workers' CPU
    is the cost of waiting alone, this process's (the host column) the
    filler's (in hierarchical mode, its Redis round trips).  The achieved
    rate is measured after the first second (the initial burst), over the
    window in which every worker measured: below 20 000/s from grant stamps
    (the grants in it, or with fewer than 200 ops there (grants - 1) /
    (last - first)); from counts above.  ``net_error_pct`` is the error net
    of the starved time (the witness), beside the plain one.
    """
    from shmlimit.redis.direct import RedisLimiter

    ctx = mp.get_context("fork")
    name = f"bench-{uuid.uuid4().hex[:8]}"
    if url:
        lim = shmlimit.Limiter(name, upstream=RedisLimiter(name, rate=rate, url=url))
    else:
        lim = shmlimit.Limiter(name, rate=rate)
    lim.retry_after()  # a first use: this process's filler thread runs and, first, takes the lease
    for _ in range(1000):
        if lim.stats().filler_pid == os.getpid():
            break
        time.sleep(0.005)
    skip = 1.0
    stamp = rate < 20_000
    barrier, done, q = ctx.Barrier(procs + 1), ctx.Barrier(procs), ctx.Queue()
    ps = [
        ctx.Process(target=_fed_worker, args=(lim, timed, barrier, seconds, skip, stamp, q, done))
        for _ in range(procs)
    ]
    for p in ps:
        p.start()
    s0 = lim.stats()
    trips0 = s0.upstream.round_trips if url else 0
    filler = lim._att.filler
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    barrier.wait(timeout=120)
    time.sleep(
        skip
    )  # the witnesses over the span the rate is measured in (the start's burst is not)
    d0, st0 = _run_delay(filler.native_id), steal_seconds()
    s1 = lim.stats()
    res = [q.get(timeout=seconds + 120) for _ in ps]
    # at once: once the callers stop, the batches reserved ahead for them (the lead) expire unused,
    # and while callers wanted tokens a moment ago that counts as starved, though it is after the run
    s = lim.stats()
    d1, st1 = _run_delay(filler.native_id), steal_seconds()
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    for p in ps:
        p.join()
    trips = s.upstream.round_trips - trips0 if url else 0
    lim.close()
    lim.unlink()
    stamps = sorted(t for r in res for t in r[2])
    grants = sum(r[1] for r in res)
    starved = s.starved_seconds - s1.starved_seconds
    lo = max(r[0] for r in res) + int(
        skip * 1e9
    )  # every worker measuring: from the last's skip ...
    hi = min(r[0] for r in res) + int(seconds * 1e9)  # ... to the first's end
    if stamp and rate * (hi - lo) / 1e9 >= 200:
        # the grants in a fixed window: a grant that comes late at either end (its waiter off the CPU)
        # moves one op across the edge, where the span between the first and the last grant moved by
        # the whole lateness (-2 % at 50/s from one grant 80 ms late at the end)
        ops, span = sum(1 for t in stamps if lo <= t < hi), (hi - lo) / 1e9
    elif stamp and len(stamps) >= 2:  # a handful of ops: the grid between the first and the last
        ops, span = len(stamps) - 1, (stamps[-1] - stamps[0]) / 1e9
    else:
        start = max(r[0] for r in res)
        ops, span = grants, seconds - skip - (start - min(r[0] for r in res)) / 1e9
    achieved = ops / span
    # net of the witness: the rate over the span less the schedule the limiter counted lost while
    # callers waited (starved: time the machine withheld from the filler, or from Redis); a
    # shortfall the witness explains is the machine's, one it does not is the limiter's
    net = ops / (span - starved) if span > starved else float("nan")
    return dict(
        mode="hierarchical" if url else "local",
        rate=rate,
        timed=timed,
        achieved=achieved,
        error_pct=100.0 * (achieved - rate) / rate,
        net_error_pct=100.0 * (net - rate) / rate,
        waiters_cpu=sum(r[3] for r in res) / seconds,
        # of that, what the workers' other threads used (not the waiting thread, nor the filler's: a
        # giveback thread skipping a timed-out caller's range, say), apart so a difference is placed
        others_cpu=sum(r[3] - r[9] for r in res) / seconds,
        # the filler's thread, wherever it ran: this process (which does nothing else) and the
        # filler threads of workers that took the lease over
        filler_cpu=(r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime + sum(r[5] for r in res))
        / seconds,
        round_trips_per_op=trips / max(1, sum(r[4] for r in res)) if url else None,
        round_trips=trips if url else None,  # Redis round trips (leases asked) over the run
        # the waiting threads' sleeps per grant, all processes together (1.0: one wake per grant)
        wakes_per_grant=sum(r[6] for r in res) / max(1, sum(r[4] for r in res)),
        refused=sum(r[7] for r in res),  # timed: acquires that timed out
        leases=s.upstream.leases if url else None,
        leased=s.upstream.leased if url else None,
        expired=s.upstream.expired - s1.upstream.expired
        if url
        else None,  # leased ops void, in the span
        # the starvation witnesses: what the limiter could not credit while callers queued, how long
        # this process's filler thread waited runnable for a CPU, the longest pause between grants,
        # and Redis calls that failed (each closes the host until a retry)
        starved=starved,
        filler_delay=d1 - d0,
        # the hypervisor's: the time it ran something else on this machine's CPUs (steal, summed
        # over the CPUs), which no run queue sees; every thread here may have been held up by it
        steal=st1 - st0,
        workers_delay=min(
            r[8] for r in res
        ),  # every waiting thread was off the CPU at most this long
        max_gap=max((b - a for a, b in zip(stamps, stamps[1:])), default=0) / 1e9,
        # the three longest pauses: (seconds after the first measured grant, length in seconds)
        gaps=[
            ((a - stamps[0]) / 1e9, (b - a) / 1e9)
            for a, b in sorted(zip(stamps, stamps[1:]), key=lambda p: p[0] - p[1])[:3]
        ],
        errors=s.upstream.errors - s0.upstream.errors if url else 0,
        load=os.getloadavg()[0],
    )


def bench_hierarchy_cpu(url: str, seconds: float, pairs: int = 2) -> dict:
    """The hierarchical mode's CPU at a low rate: 50/s, 8 untimed waiters, local and hierarchical
    runs alternating (``pairs`` of each), ``seconds`` each.  The whole process tree's CPU (the
    waiters, and the filler threads: in hierarchical mode its Redis round trips) of the
    hierarchical runs over the local ones', and the filler threads' CPU per Redis round trip (a
    lease asked) and per op delivered."""
    rows = []
    for _ in range(pairs):
        rows.append(run_fed(None, 50, 8, seconds))
        rows.append(run_fed(url, 50, 8, seconds))
    local = [r for r in rows if r["mode"] == "local"]
    hier = [r for r in rows if r["mode"] == "hierarchical"]

    def tree(rs: List[dict]) -> float:  # CPU-s/s of the whole process tree, over the runs
        return sum(r["waiters_cpu"] + r["filler_cpu"] for r in rs) / len(rs)

    filler_s = sum(r["filler_cpu"] * seconds for r in hier)
    ops = sum(r["achieved"] * seconds for r in hier)
    return dict(
        rows=rows,
        tree_ratio=tree(hier) / tree(local),
        waiters_ratio=sum(r["waiters_cpu"] for r in hier) / sum(r["waiters_cpu"] for r in local),
        filler_us_per_lease=1e6 * filler_s / max(1, sum(r["round_trips"] for r in hier)),
        filler_us_per_op=1e6 * filler_s / max(1.0, ops),
        local_filler_us_per_op=1e6
        * sum(r["filler_cpu"] * seconds for r in local)
        / max(1.0, sum(r["achieved"] * seconds for r in local)),
        seconds=seconds,
        load=os.getloadavg(),
    )


def print_hierarchy_cpu(h: dict) -> None:
    print(
        "\n9a. hierarchical vs local at 50/s, 8 untimed waiters, alternating runs: CPU-s/s of the whole"
    )
    print(
        "    process tree (waiters and filler threads; in hierarchical mode the Redis round trips)"
    )
    print(
        f"    {'mode':>13} {'achieved/s':>11} {'waiters CPU-s/s':>16} {'filler CPU-s/s':>15} "
        f"{'tree CPU-s/s':>13} {'round trips/s':>14} {'ops/trip':>9} {'load':>5}"
    )
    for r in h["rows"]:
        trips = r["round_trips"]
        per_s = "" if trips is None else f"{trips / h['seconds']:.1f}"
        per_trip = "" if not trips else f"{1 / r['round_trips_per_op']:.1f}"
        print(
            f"    {r['mode']:>13} {r['achieved']:>11.1f} {r['waiters_cpu']:>16.4f} {r['filler_cpu']:>15.4f} "
            f"{r['waiters_cpu'] + r['filler_cpu']:>13.4f} {per_s:>14} {per_trip:>9} {r['load']:>5.1f}"
        )
    print(
        f"    hierarchical / local: whole tree {h['tree_ratio']:.2f}x (target: at most 1.5x), waiters "
        f"{h['waiters_ratio']:.2f}x; the filler threads' CPU per lease (one round trip) "
        f"{h['filler_us_per_lease']:,.0f} us, per op {h['filler_us_per_op']:,.0f} us (local: "
        f"{h['local_filler_us_per_op']:,.0f} us per op); load {h['load'][0]:.1f} {h['load'][1]:.1f} "
        f"{h['load'][2]:.1f} on {os.cpu_count()} CPUs"
    )


def _run_delay(tid: Optional[int]) -> float:
    """Seconds this process's thread ``tid`` has waited runnable for a CPU so far (schedstat; 0 unknown)."""
    try:
        with open(f"/proc/self/task/{tid}/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, ValueError, IndexError, TypeError):
        return 0.0


def hierarchy_ratios(h: dict) -> Dict[str, tuple]:
    """Hierarchical over local CPU at the same rate and waiters, in the same run: (waiters', with the fillers')."""
    out = {}
    for r in h["table"]:
        if r["mode"] != "hierarchical":
            continue
        base = next(
            x
            for x in h["table"]
            if x["mode"] == "local" and x["rate"] == r["rate"] and x["timed"] == r["timed"]
        )
        label = f"{r['rate']:,.0f}/s {'timed' if r['timed'] else 'untimed'}"
        out[label] = (
            r["waiters_cpu"] / base["waiters_cpu"],
            (r["waiters_cpu"] + r["filler_cpu"]) / (base["waiters_cpu"] + base["filler_cpu"]),
        )
    return out


def bench_hierarchy(
    url: str, seconds: float, sweep: bool = True, table_seconds: Optional[float] = None
) -> dict:
    """The issue's table (8 processes: 50/s untimed and timed, 1000/s), local vs hierarchical, and a sweep.

    The table's rows run ``table_seconds`` (default ``seconds``): at 50/s one op is 0.5 % of 4 s."""
    table = []
    ts = table_seconds or seconds
    for u in (None, url):
        table.append(run_fed(u, 50, 8, ts))
        table.append(run_fed(u, 50, 8, ts, timed=True))
        table.append(run_fed(u, 1000, 8, ts))
    if not sweep:
        return dict(table=table, sweep=[], local_1m=None)
    sweep = [
        run_fed(url, rate, 4, max(seconds, 4.0))
        for rate in (1, 10, 100, 1000, 10_000, 100_000, 1_000_000)
    ]
    # at 1 000 000/s four Python processes on a busy machine may not keep up: the local limiter,
    # right after, says how much of a shortfall is theirs
    local = run_fed(None, 1_000_000, 4, max(seconds, 4.0))
    return dict(table=table, sweep=sweep, local_1m=local)


def print_hierarchy(h: dict) -> None:
    print(
        "\n9. hierarchical vs local, 8 processes: achieved rate (after 1 s), CPU of the waiting callers and of"
    )
    print(
        "   the filler threads (every process's, watching or filling: in hierarchical mode the Redis round trips),"
    )
    print(
        "   the waiting threads' sleeps per grant, and what the machine withheld: the schedule the limiter could"
    )
    print(
        "   not credit while callers waited (starved; from the second second on, as the rate), leased ops void"
    )
    print(
        "   unused (expired), how long the filler thread and every waiter (the least of them) waited runnable"
    )
    print(
        "   for a CPU, the longest pause between two grants; of the waiters' CPU, what their processes' other"
    )
    print(
        "   threads used (others: neither the waiting thread nor the filler's), and the timed acquires refused;"
    )
    print(
        "   net: the error over the measured span less the starved time (a shortfall the witness explains);"
    )
    print(
        "   steal: the time the hypervisor ran something else on this machine's CPUs, summed over them"
    )
    print(
        f"   {'mode':>13} {'target/s':>9} {'waiters':>8} {'achieved/s':>11} {'error':>8} {'net':>8} {'waiters CPU-s/s':>16} "
        f"{'others':>7} {'refused':>7} {'filler CPU-s/s':>15} {'sleeps/grant':>13} {'starved s':>10} {'expired':>8} {'filler off s':>13} "
        f"{'waiters off s':>14} {'steal s':>8} {'max gap ms':>11} {'load':>5}"
    )
    for r in h["table"]:
        print(
            f"   {r['mode']:>13} {r['rate']:>9,.0f} {'timed' if r['timed'] else 'untimed':>8} {r['achieved']:>11,.1f} "
            f"{r['error_pct']:>7.2f}% {r['net_error_pct']:>7.2f}% {r['waiters_cpu']:>16.4f} {r['others_cpu']:>7.4f} {r['refused']:>7,} {r['filler_cpu']:>15.4f} {r['wakes_per_grant']:>13.2f} "
            f"{r['starved']:>10.3f} {r['expired'] or 0:>8,} {r['filler_delay']:>13.3f} {r['workers_delay']:>14.3f} "
            f"{r['steal']:>8.3f} {r['max_gap'] * 1e3:>11.1f} "
            f"{r['load']:>5.1f}"
        )
    for label, (w, t) in hierarchy_ratios(h).items():
        print(
            f"   hierarchical / local, {label}: waiters' CPU {w:.2f}x, with the filler threads {t:.2f}x"
        )
    if not h["sweep"]:
        return
    print(
        "\n   hierarchical, 4 processes, untimed: fidelity and Redis round trips per op across rates, with the"
    )
    print("   witnesses as above")
    print(
        f"   {'target/s':>10} {'achieved/s':>12} {'error':>8} {'net':>8} {'trips/op':>9} {'ops/lease':>10} {'expired':>8} "
        f"{'starved s':>10} {'filler off s':>13} {'waiters off s':>14} {'steal s':>8} {'load':>5}"
    )
    for r in h["sweep"]:
        per = r["leased"] / r["leases"] if r["leases"] else 0
        print(
            f"   {r['rate']:>10,.0f} {r['achieved']:>12,.2f} {r['error_pct']:>7.2f}% {r['net_error_pct']:>7.2f}% "
            f"{r['round_trips_per_op']:>9.4f} {per:>10.1f} {r['expired']:>8,} {r['starved']:>10.3f} {r['filler_delay']:>13.3f} "
            f"{r['workers_delay']:>14.3f} {r['steal']:>8.3f} {r['load']:>5.1f}"
        )
    if h.get("local_1m"):
        r = h["local_1m"]
        print(
            f"   local, 4 processes, right after: {r['rate']:,.0f}/s achieved {r['achieved']:,.2f} ({r['error_pct']:.2f}%)"
        )


# ---- 9. hosts behind latency ----------------------------------------------------------------------


def _latency_worker(lim, host: int, paced_rate: float, barrier, seconds: float, q) -> None:
    """Acquire for ``seconds``: saturated (paced_rate 0), or at about ``paced_rate``/s (Poisson).

    Records grant stamps and each acquire's latency (ns).
    """
    import random as _random

    barrier.wait(timeout=120)
    end = time.monotonic_ns() + int(seconds * 1e9)
    stamps: List[int] = []
    lat: List[int] = []
    rng = _random.Random(os.getpid())
    while True:
        t0 = time.monotonic_ns()
        if t0 > end:
            break
        lim.acquire()
        t1 = time.monotonic_ns()
        stamps.append(t1)
        lat.append(t1 - t0)
        if paced_rate:
            time.sleep(rng.expovariate(paced_rate))
    q.put((stamps, lat, host))


def bench_latency(redis_port: int, seconds: float, rate: float = 1000.0, per_host: int = 2) -> dict:
    """Three hosts (a segment and ``per_host`` processes each) reach Redis through delaying proxies
    (1, 3 and 5 ms each way): saturated, paced at 70 % of the rate, and saturated with host 0 cut
    off for 2 s.  Global rate, the worst 1 s window against the bound, round trips per op, and the
    latency of acquire() at 70 % load."""
    sys.path.insert(
        0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests")
    )
    from support.proxy import DelayProxy

    from shmlimit.redis.direct import RedisLimiter

    ctx = mp.get_context("fork")
    out: Dict[str, dict] = {}
    for label, paced, cut in (
        ("saturated", 0.0, False),
        ("70% load", 0.7 * rate / (3 * per_host), False),
        ("saturated, host 0 cut 2 s", 0.0, True),
    ):
        gname = f"bench-{uuid.uuid4().hex[:8]}"
        proxies = [DelayProxy(redis_port, d) for d in (0.001, 0.003, 0.005)]
        hosts = [
            shmlimit.Limiter(f"{gname}-{i}", upstream=RedisLimiter(gname, rate=rate, url=p.url()))
            for i, p in enumerate(proxies)
        ]
        ttl = hosts[0].stats().upstream.lease_ttl
        cap = hosts[0].capacity
        barrier, q = ctx.Barrier(3 * per_host + 1), ctx.Queue()
        ps = [
            ctx.Process(target=_latency_worker, args=(h, i, paced, barrier, seconds, q))
            for i, h in enumerate(hosts)
            for _ in range(per_host)
        ]
        for p in ps:
            p.start()
        trips0 = [h.stats().upstream.round_trips for h in hosts]
        barrier.wait(timeout=120)
        if cut:
            time.sleep(1.0)
            proxies[0].drop(2.0)
        res = [q.get(timeout=seconds + 120) for _ in ps]
        for p in ps:
            p.join()
        ups = [h.stats().upstream for h in hosts]
        for h in hosts:
            h.close()
            h.unlink()
        for p in proxies:
            p.close()
        stamps = sorted(t for r in res for t in r[0])
        lat = sorted(x for r in res for x in r[1])
        grants = len(stamps)
        span = (stamps[-1] - stamps[0]) / 1e9 if grants > 1 else seconds
        trips = sum(u.round_trips for u in ups) - sum(trips0)
        pick = lambda f: lat[min(len(lat) - 1, int(f * len(lat)))] / 1e6  # noqa: E731
        host0 = sorted(t for r in res if r[2] == 0 for t in r[0])
        out[label] = dict(
            achieved=grants / span,
            max_1s=max_in_window(stamps, 1_000_000_000),
            bound=rate * (1 + ttl + 0.05) + cap,
            round_trips_per_op=trips / max(1, grants),
            p50_ms=pick(0.5),
            p99_ms=pick(0.99),
            host0_share=len(host0) / max(1, grants),
            host0_errors=ups[0].errors,
            host0_state=ups[0].state,
        )
    return dict(rate=rate, hosts=3, per_host=per_host, delays_ms=[1, 3, 5], runs=out)


def print_latency(lt: dict) -> None:
    print(
        f"\n10. three hosts x {lt['per_host']} processes through proxies adding 1/3/5 ms each way, "
        f"global {lt['rate']:,.0f}/s"
    )
    print(
        f"   {'run':>27} {'achieved/s':>11} {'max 1s':>7} {'bound':>7} {'trips/op':>9} {'p50 ms':>7} "
        f"{'p99 ms':>7} {'host 0':>7}"
    )
    for label, r in lt["runs"].items():
        print(
            f"   {label:>27} {r['achieved']:>11,.1f} {r['max_1s']:>7,} {r['bound']:>7,.0f} "
            f"{r['round_trips_per_op']:>9.4f} {r['p50_ms']:>7.2f} {r['p99_ms']:>7.2f} {r['host0_share']:>6.0%}"
        )


def start_redis():
    """A throwaway redis-server on a free port (no persistence), or None when there is no binary."""
    import shutil
    import socket
    import subprocess

    binary = shutil.which("redis-server")
    try:
        import redis
    except ImportError:
        return None, None
    if binary is None:
        return None, None
    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
    )
    client = redis.Redis(port=port)
    for _ in range(1000):
        try:
            client.ping()
            break
        except redis.ConnectionError:
            time.sleep(0.01)
    return proc, f"redis://127.0.0.1:{port}/0"


# ---- 8. keyed limits -------------------------------------------------------------------------------


def _keyed_costs(backend: str, n: int, q) -> None:
    """Per-call costs in one process: the single Limiter's try_acquire next to the keyed ones."""
    os.environ["SHMLIMIT_BACKEND"] = backend
    tag = uuid.uuid4().hex[:8]
    out: Dict[str, float] = {}
    single = shmlimit.Limiter(f"bench-{tag}-s", **UNLIMITED)
    fast = shmlimit.KeyedLimiter(f"bench-{tag}-f", rate=1e9, burst=1e9, keys=1024)
    slow = shmlimit.KeyedLimiter(f"bench-{tag}-w", rate=1, per=3600, burst=1, keys=4 * n)
    churn = shmlimit.KeyedLimiter(f"bench-{tag}-c", rate=1e9, burst=1, keys=max(1024, n // 10))
    try:
        out["Limiter.try_acquire (granted)"] = best_ns_per_call(single.try_acquire, n)
        t = fast.try_acquire
        t("client-42")
        out["keyed try_acquire, live key (granted)"] = best_ns_per_call(lambda: t("client-42"), n)
        fast.reserve("client-43", int(1e9))  # two seconds of schedule ahead (one beyond the burst):
        fast.reserve("client-43", int(1e9))  # refused for the next second
        out["keyed try_acquire, live key (refused)"] = best_ns_per_call(
            lambda: t("client-43"), min(n, 100_000)
        )
        s = slow.try_acquire
        keys = [
            f"203.0.{i >> 8 & 255}.{i & 255}:{i}" for i in range(n)
        ]  # new keys, a quarter of the slots
        t0 = time.perf_counter_ns()
        for k in keys:
            s(k)
        out["keyed try_acquire, first use of a new key"] = (time.perf_counter_ns() - t0) / n
        c = churn.try_acquire
        for k in keys[: churn.slots]:
            c(k)  # fill the table: from here on, every new key evicts an idle one
        more = [f"x{k}" for k in keys]
        t0 = time.perf_counter_ns()
        for k in more:
            c(k)
        out["keyed churn: new key through a full table"] = (time.perf_counter_ns() - t0) / n
        out["evictions during churn"] = churn.stats().evicted
        out["bytes of segment per key slot"] = slow.stats().segment_bytes / slow.slots
        q.put(out)
    finally:
        for lim in (single, fast, slow, churn):
            lim.close()
            lim.unlink()


def _keyed_worker(
    kind: str, name: str, nkeys: int, barrier, seconds: float, q, shared=None
) -> None:
    import random

    rnd = random.Random(os.getpid())
    keys = [f"client-{rnd.randrange(nkeys)}" for _ in range(4096)]
    if kind == "shmlimit":
        lim = shmlimit.attach(name)
        call = lim.try_acquire
    elif kind == "limits+redis":
        import limits
        from limits.storage import RedisStorage
        from limits.strategies import FixedWindowRateLimiter

        item = limits.parse("1000000/second")
        hit = FixedWindowRateLimiter(RedisStorage(name)).hit

        def call(k):
            return hit(item, k)
    else:
        d, lock = shared

        def call(k, rate=1e9, burst=1e9):  # the toy: a dict of (tokens, stamp) behind one Lock
            with lock:
                now = time.monotonic()
                tokens, stamp = d.get(k, (burst, now))
                tokens = min(burst, tokens + (now - stamp) * rate)
                ok = tokens >= 1
                d[k] = (tokens - 1 if ok else tokens, now)
                return ok

    barrier.wait(timeout=120)
    end = time.monotonic() + seconds
    n = 0
    while time.monotonic() < end:
        for k in keys[n % 4096 : n % 4096 + 64]:
            call(k)
        n += 64
    q.put(n / seconds)


def bench_keyed_aggregate(
    seconds: float, redis_url: Optional[str], procs: int = 4, nkeys: int = 100_000
) -> dict:
    ctx = mp.get_context("fork")
    out: dict = {}
    kinds = ["shmlimit", "Manager dict+Lock"] + (["limits+redis"] if redis_url else [])
    for kind in kinds:
        barrier, q = ctx.Barrier(procs), ctx.Queue()
        name, shared, lim, manager = f"bench-{uuid.uuid4().hex[:8]}", None, None, None
        if kind == "shmlimit":
            lim = shmlimit.KeyedLimiter(name, rate=1e9, burst=1e9, keys=2 * nkeys)
        elif kind == "limits+redis":
            try:
                import limits  # noqa: F401
            except ImportError:
                out[kind] = None
                continue
            name = redis_url
        else:
            manager = ctx.Manager()
            shared = (manager.dict(), manager.Lock())
        ps = [
            ctx.Process(target=_keyed_worker, args=(kind, name, nkeys, barrier, seconds, q, shared))
            for _ in range(procs)
        ]
        for p in ps:
            p.start()
        out[kind] = sum(q.get(timeout=300) for _ in ps)
        for p in ps:
            p.join()
        if lim is not None:
            lim.close()
            lim.unlink()
        if manager is not None:
            manager.shutdown()
    return out


def bench_keyed(n: int, seconds: float, redis_url: Optional[str]) -> dict:
    res: dict = {}
    ctx = mp.get_context("spawn")
    for backend in ["native", "atomics"] if native_available() else ["atomics"]:
        res[backend] = run_processes(
            ctx, _keyed_costs, [(backend, n if backend == "native" else max(1000, n // 100))], 600
        )[0]
    res["aggregate_per_s"] = bench_keyed_aggregate(seconds, redis_url)
    return res


def print_keyed(k: dict) -> None:
    print(
        "\n8. keyed limits: one process, per call (ratios to the single Limiter.try_acquire of the same run)"
    )
    for backend in ("native", "atomics"):
        if backend not in k:
            continue
        r = k[backend]
        base = r["Limiter.try_acquire (granted)"]
        print(f"   {backend:34} {'ns/op':>10} {'x Limiter.try_acquire':>22}")
        for name, v in r.items():
            if name in ("evictions during churn", "bytes of segment per key slot"):
                continue
            print(f"   {name:42} {v:10.0f} {v / base:14.2f}")
        grant = r["keyed try_acquire, live key (granted)"]
        print(
            f"   refusal / grant: {r['keyed try_acquire, live key (refused)'] / grant:.2f}x;"
            f" churn: {1e9 / r['keyed churn: new key through a full table']:,.0f} new keys/s"
            f" ({r['evictions during churn']:,} evictions); {r['bytes of segment per key slot']:.1f} bytes per key slot"
        )
    agg = k["aggregate_per_s"]
    print(
        "\n   4 processes over 100 000 keys, try_acquire at an unlimited per-key rate: aggregate calls/s"
    )
    ours = agg["shmlimit"]
    for name, v in agg.items():
        if v is None:
            print(f"   {name:24} skipped (pip install limits)")
            continue
        print(f"   {name:24} {v:14,.0f}   shmlimit is {ours / v:,.1f}x")


# ---- 11. several rates at once ---------------------------------------------------------------------


def _rates_costs(backend: str, n: int, q) -> None:
    """Per-call costs in one process: one rate's acquire next to two rates' (interleaved, best of)."""
    os.environ["SHMLIMIT_BACKEND"] = backend
    tag = uuid.uuid4().hex[:8]
    one = shmlimit.Limiter(f"bench-{tag}-1", **UNLIMITED)
    two = shmlimit.Limiter(f"bench-{tag}-2", rates=[(1e9, 1e9), (1e9, 1e9)])
    named = shmlimit.Limiter(f"bench-{tag}-d", rates={"requests": (1e9, 1e9), "tokens": (1e9, 1e9)})
    out: Dict[str, float] = {}
    try:
        rows = {
            "one rate: acquire()": one.acquire,
            "two rates: acquire()": two.acquire,
            "two rates: try_acquire()": two.try_acquire,
            "two rates: acquire(timeout=1.0)": lambda: two.acquire(timeout=1.0),
            "two rates: acquire(2)": lambda: two.acquire(2),
            "dict: acquire(requests=1, tokens=50)": lambda: named.acquire(requests=1, tokens=50),
        }
        for _ in range(7):  # interleaved, best of: a noisy moment (a busy machine) favours no row
            for k, fn in rows.items():
                out[k] = min(out.get(k, float("inf")), best_ns_per_call(fn, n, repeat=2))
        q.put(out)
    finally:
        for lim in (one, two, named):
            lim.unlink()
            lim.close()


def bench_rates(n: int) -> Dict[str, Dict[str, float]]:
    res = {}
    ctx = mp.get_context("spawn")
    for backend in ["native", "atomics"] if native_available() else ["atomics"]:
        q = ctx.Queue()
        p = ctx.Process(
            target=_rates_costs, args=(backend, n if backend == "native" else max(2000, n // 50), q)
        )
        p.start()
        res[backend] = q.get(timeout=300)
        p.join()
    return res


def print_rates(r: Dict[str, Dict[str, float]]) -> None:
    print(
        "\n11. several rates at once, one process, unlimited: ns per call and ratio to one rate's acquire()"
    )
    for backend, rows in r.items():
        base = rows["one rate: acquire()"]
        for k, v in rows.items():
            print(f"   {backend:8} {k:40} {v:10.0f} {v / base:8.2f}x")


# ---- 12. asyncio -----------------------------------------------------------------------------------


#: Section 12's turns: the waiters and the sleepers take turns this long each (seconds) ...
TURN_S = 0.25
#: ... this many times each.  Both kinds burn about 0.1 CPU-s/s, and other tenants' work moves that
#: a lot: two rows of the same bare sleepers, 2 s each, one right after the other, differed by up
#: to 1.31x, and by 2x a minute apart; the median of five pairs of rows (waiters, then sleepers)
#: ranged 1.01-1.38 in four runs minutes apart on the same code.  Turns a quarter of a second
#: long put both kinds under the same neighbours: the ratio of the totals over forty turns each
#: ranged 1.12-1.27 in six runs on that code (a run's 90 % interval is narrower than that: what
#: a run's processes land on moves it too).
TURNS = 40
#: Before each turn, this long measured by nobody (seconds): after the waiters' turn their filler
#: thread refills the bucket a tick a millisecond, then backs off to its idle pace over about 40 ms;
#: without the pause that burst ran in the sleepers' turn, a neighbour the waiters' turns lack.
SETTLE_S = 0.06


def _take_turns_async(kind: str, lim, rate: float, index: int, procs: int, t0, barrier, q) -> None:
    """One process of section 12's turns: ``kind`` "waiter" (``acquire_async`` saturating
    ``rate`` with the other waiters) or "sleeper" (a bare precise sleep to every ``procs``-th
    instant of one grid ``1/rate`` apart, as ``_sleep_stamped_async``), active in its own turns
    only.  Pair ``k`` is two slots of ``SETTLE_S`` then ``TURN_S`` from ``t0`` on, the waiters'
    turn first in even pairs, the sleepers' first in odd ones.  Puts, for each of its turns,
    this process's CPU seconds (every thread: ``process_time``) and a waiter's filler thread's
    share of them, from the turn's start to its last op in it: a waiter stops once its next
    grant (``procs / rate`` after its last) would come after the turn's end."""
    from shmlimit.acquire.sleep import sleep_until_async

    filler = None
    if lim is not None:
        lim.retry_after()  # registers, and starts its filler thread, before the barrier
        filler = lim._att.filler
    barrier.wait(timeout=120)
    slot, settle = int((SETTLE_S + TURN_S) * 1e9), int(SETTLE_S * 1e9)
    turn, step, gap = int(TURN_S * 1e9), 1e9 / rate, int(procs * 1e9 / rate)

    async def turns() -> list:
        clock, begin, out = time.monotonic_ns, t0.value, []
        for k in range(TURNS):
            start = begin + (2 * k + ((kind == "waiter") != (k % 2 == 0))) * slot + settle
            end = start + turn
            await sleep_until_async(start)
            c0, f0 = time.process_time(), _thread_cpu(filler)
            if kind == "waiter":
                acquire = lim.acquire_async
                while True:
                    await acquire()
                    if clock() + gap > end:
                        break
            else:
                j = math.ceil((start - begin) / step)  # its instants: index + 1 + procs * i
                j += (index + 1 - j) % procs
                while begin + int(j * step) <= end:
                    await sleep_until_async(begin + int(j * step))
                    j += procs
            out.append((time.process_time() - c0, _thread_cpu(filler) - f0))
        return out

    q.put((kind, asyncio.run(turns())))


def ratio_interval(pairs: List[tuple], draws: int = 2000) -> List[float]:
    """The 5th and 95th percentiles of ``sum(a) / sum(b)`` over ``pairs`` of ``(a, b)`` drawn again
    with replacement ``draws`` times (a bootstrap; seeded, so a run's page is made again alike)."""
    rng = random.Random(0)
    n = len(pairs)
    ratios = []
    for _ in range(draws):
        drawn = [pairs[rng.randrange(n)] for _ in range(n)]
        ratios.append(sum(a for a, _ in drawn) / sum(b for _, b in drawn))
    ratios.sort()
    return [ratios[draws // 20], ratios[draws - 1 - draws // 20]]


def bench_turns_async(rate: float = 1000.0, procs: int = 8) -> dict:
    """Section 12's ratio: ``procs`` waiters saturating ``rate`` through ``acquire_async`` and
    ``procs`` bare asyncio sleepers waking at the same instants with the same precise sleep,
    taking ``TURNS`` turns each of ``TURN_S`` (``_take_turns_async``): each kind's CPU per wall
    second of its turns (``filler``: the waiters' filler threads' share of theirs), the ratio of
    the totals, that of each quarter of the turns, and a 90 % interval of it (``ratio_interval``
    over the pairs of turns)."""
    ctx = mp.get_context("fork")
    name = f"bench-{uuid.uuid4().hex[:8]}"
    shmlimit.Limiter(name, rate=rate).close()
    t0 = ctx.Value("q", 0)
    barrier = ctx.Barrier(2 * procs, action=functools.partial(_grid_start, t0))
    args = [("waiter", shmlimit.attach(name), rate, i, procs, t0, barrier) for i in range(procs)]
    args += [("sleeper", None, rate, i, procs, t0, barrier) for i in range(procs)]
    res = run_processes(ctx, _take_turns_async, args, 300)
    shmlimit.unlink(name)
    waiters = list(zip(*(out for kind, out in res if kind == "waiter")))
    w = [sum(c for c, _ in turn) for turn in waiters]
    fill = [sum(f for _, f in turn) for turn in waiters]
    s = [sum(c for c, _ in turn) for turn in zip(*(out for kind, out in res if kind == "sleeper"))]
    quarter = TURNS // 4
    return dict(
        turn_s=TURN_S,
        turns=TURNS,
        waiters=sum(w) / (TURNS * TURN_S),
        filler=sum(fill) / (TURNS * TURN_S),
        sleepers=sum(s) / (TURNS * TURN_S),
        ratio=sum(w) / sum(s),
        interval=ratio_interval(list(zip(w, s))),
        quarters=[
            sum(w[i : i + quarter]) / sum(s[i : i + quarter]) for i in range(0, TURNS, quarter)
        ],
    )


def bench_asyncio(seconds: float, rate: float = 1000.0, procs: int = 8) -> dict:
    """Section 12: ``procs`` processes, each one event loop with one task saturating ``rate``
    through ``acquire_async``, against as many bare asyncio sleepers (no limiter) waking at the
    same instants with the same precise sleep (``sleep_until_async``), and bare ``asyncio.sleep``
    sleepers, for the lateness an event loop's own timer gives: a row of each, ``seconds`` long,
    one after the other (lateness, wakes, the filler threads' share); and the CPU ratio, the
    target's (at most 1.25), from the two taking turns (``bench_turns_async``)."""
    rows = [
        bench_waiting(rate, seconds, procs, driver="async"),
        bench_sleep_floor(rate, seconds, procs, driver="bare asyncio"),
        bench_sleep_floor(rate, seconds, procs, driver="bare asyncio.sleep"),
    ]
    turns = bench_turns_async(rate, procs)
    return dict(rows=rows, turns=turns, ratio=turns["ratio"], load=os.getloadavg())


def print_asyncio(a: dict) -> None:
    print(
        f"\n12. asyncio: {a['rows'][0]['processes']} processes, one event loop each, saturating "
        f"{a['rows'][0]['rate']:,.0f}/s through acquire_async,"
    )
    print("    against as many bare asyncio sleepers waking at the same instants (no limiter)")
    print(
        f"    {'waiters':>20} {'CPU-s/s':>9} {'wakes':>6} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8} "
        f"{'grants':>8}"
    )
    for w in a["rows"]:
        wk = f"{w['wakes_per_grant']:>6.2f}" if "wakes_per_grant" in w else f"{'-':>6}"
        print(
            f"    {w['driver']:>20} {w['cpu_s_per_wall_s']:>9.4f} {wk} {w['p50_ms']:>8.3f} "
            f"{w['p99_ms']:>8.3f} {w['max_ms']:>8.3f} {w['grants']:>8,}"
        )
    t = a["turns"]
    print(
        f"    taking {t['turns']} turns of {t['turn_s']:g} s each: the waiters {t['waiters']:.4f} "
        f"CPU-s/s (their filler threads' {t['filler']:.4f} included), the sleepers "
        f"{t['sleepers']:.4f}"
    )
    print(
        f"    acquire_async's CPU: {a['ratio']:.2f}x the bare asyncio sleepers' (target: at most 1.25), "
        f"90% interval {t['interval'][0]:.2f}-{t['interval'][1]:.2f}; "
        f"by quarter {', '.join(f'{r:.2f}' for r in t['quarters'])}; "
        f"load average {a['load'][0]:.1f}, {a['load'][1]:.1f}, {a['load'][2]:.1f}"
    )


# ---- 13. limits' hits on shm:// -------------------------------------------------------------------

#: ``limits``' strategies, by the names the tables give them.  The moving window is shown, with no
#: target: on memory:// its cost grows with the hits in a key's window.
LIMITS_STRATEGIES = {
    "fixed window": "FixedWindowRateLimiter",
    "sliding window counter": "SlidingWindowCounterRateLimiter",  # limits >= 4.1
    "moving window": "MovingWindowRateLimiter",
}
LIMITS_KEYS = 64
LIMITS_LIMIT = "1000000/minute"  # never reached in a run: every hit is granted
# the moving window's limit fits a key's log on shm:// (4096 words: 4094 hits in a window), and a
# run hits a key at most 200 times a repeat
LIMITS_MOVING = "4000/minute"
LIMITS_SHM_OPTIONS = "keys=1024&moving_keys=128&moving_log=4096"


def _hits_ns(hit: Callable[..., bool], item, keys: List[str], rounds: int) -> float:
    """ns per ``hit(item, key)``, ``rounds`` times through ``keys``."""
    t0 = time.perf_counter_ns()
    for _ in range(rounds):
        for k in keys:
            hit(item, k)
    return (time.perf_counter_ns() - t0) / (rounds * len(keys))


def _limits_costs(n: int, repeats: int, q) -> None:
    """ns per hit in one process: each strategy on memory:// and on shm://, ``n`` hits each,
    interleaved (the order alternating) and the best of ``repeats`` kept."""
    import limits
    import limits.strategies as ls
    from limits.storage import storage_from_string

    import shmlimit.integrations.limits  # noqa: F401  (registers shm://)

    shm = storage_from_string(f"shm://bench-{uuid.uuid4().hex[:8]}?{LIMITS_SHM_OPTIONS}")
    storages = {"memory": storage_from_string("memory://"), "shm": shm}
    keys = [f"client-{i}" for i in range(LIMITS_KEYS)]
    strategies = {k: getattr(ls, c) for k, c in LIMITS_STRATEGIES.items() if hasattr(ls, c)}
    items = {
        k: limits.parse(LIMITS_MOVING if k == "moving window" else LIMITS_LIMIT) for k in strategies
    }
    out: Dict[str, Dict[str, float]] = {k: {} for k in strategies}
    try:
        for i in range(repeats):
            for label, cls in strategies.items():
                for where in sorted(storages, reverse=i % 2 == 1):
                    ns = _hits_ns(cls(storages[where]).hit, items[label], keys, n // LIMITS_KEYS)
                    out[label][where] = min(out[label].get(where, float("inf")), ns)
        for label, cls in strategies.items():  # every hit was granted: the figures are grants'
            for where, st in storages.items():
                left = cls(st).get_window_stats(items[label], keys[0]).remaining
                if left <= 0:
                    raise RuntimeError(f"{label} on {where}:// reached its limit: a longer run?")
        q.put(out)
    finally:
        shm.table.close()
        shm.table.unlink()


def _limits_worker(strategy: str, uri: str, tag: str, barrier, seconds: float, q) -> None:
    """One process hitting the 64 keys of ``tag`` through ``uri`` for ``seconds``: its hits/s."""
    import limits
    import limits.strategies as ls
    from limits.storage import storage_from_string

    import shmlimit.integrations.limits  # noqa: F401  (registers shm://)

    hit = getattr(ls, LIMITS_STRATEGIES[strategy])(storage_from_string(uri)).hit
    item = limits.parse(LIMITS_LIMIT)
    keys = [f"{tag}-{i}" for i in range(LIMITS_KEYS)]
    barrier.wait(timeout=120)
    t0 = time.monotonic()
    end, n = t0 + seconds, 0
    while time.monotonic() < end:
        for k in keys:
            hit(item, k)
        n += LIMITS_KEYS
    q.put(n / (time.monotonic() - t0))


def bench_limits_hits(
    n: int, repeats: int, seconds: float, redis_url: Optional[str], procs: int = 4
) -> Optional[dict]:
    """Section 13: ``limits``' hits on shm:// against its memory://, one process (ns per hit) and
    ``procs`` processes at once (aggregate hits/s: shm:// shared, memory:// each process its own,
    Redis when ``redis_url``).  None without ``limits``."""
    try:
        import limits  # noqa: F401
        from limits.storage import storage_from_string

        import shmlimit.integrations.limits  # noqa: F401  (registers shm://)
    except ImportError:
        return None
    one = run_processes(mp.get_context("spawn"), _limits_costs, [(n, repeats)], 600)[0]
    ctx = mp.get_context("fork")
    agg: Dict[str, Dict[str, Optional[float]]] = {}
    for strategy in ("fixed window", "sliding window counter"):
        if strategy not in one:
            continue
        agg[strategy] = {}
        for where in ("shm", "memory", "redis"):
            if where == "redis" and not redis_url:
                agg[strategy][where] = None
                continue
            tag = f"bench-{uuid.uuid4().hex[:8]}"
            uri = {"shm": f"shm://{tag}?keys=1024", "memory": "memory://", "redis": redis_url}[
                where
            ]
            table = storage_from_string(uri).table if where == "shm" else None  # one, shared
            try:
                args = (strategy, uri, tag, ctx.Barrier(procs), seconds)
                agg[strategy][where] = sum(run_processes(ctx, _limits_worker, [args] * procs, 300))
            finally:
                if table is not None:
                    table.close()
                    table.unlink()
    return dict(
        keys=LIMITS_KEYS,
        limit=LIMITS_LIMIT,
        moving_limit=LIMITS_MOVING,
        repeats=repeats,
        ns_per_hit=one,
        processes=procs,
        seconds=seconds,
        aggregate_per_s=agg,
        load=os.getloadavg(),
    )


def limits_ratios(h: dict) -> Dict[str, float]:
    """Each strategy's hit on shm:// as a multiple of its hit on memory://, in the same process."""
    return {k: r["shm"] / r["memory"] for k, r in h["ns_per_hit"].items()}


def print_limits_hits(h: Optional[dict]) -> None:
    if h is None:
        print("\n13. limits' hits on shm://: skipped (pip install limits)")
        return
    print(
        f"\n13. limits' hits, one process, {h['keys']} keys at {h['limit']} (the moving window at "
        f"{h['moving_limit']}), never reached:"
    )
    print(f"    us per hit, interleaved, best of {h['repeats']}")
    print(f"    {'strategy':>24} {'memory://':>10} {'shm://':>10} {'shm/memory':>11}")
    ratios = limits_ratios(h)
    for k, r in h["ns_per_hit"].items():
        target = "" if k == "moving window" else "  (target: at most 1.5x)"
        print(
            f"    {k:>24} {r['memory'] / 1e3:>10.2f} {r['shm'] / 1e3:>10.2f} {ratios[k]:>10.2f}x{target}"
        )
    print(f"    {h['processes']} processes hitting at once: aggregate hits/s")
    print(f"    {'strategy':>24} {'shm:// shared':>14} {'memory:// each':>15} {'Redis':>10}")
    for k, r in h["aggregate_per_s"].items():
        red = "skipped" if r["redis"] is None else f"{r['redis']:,.0f}"
        print(f"    {k:>24} {r['shm']:>14,.0f} {r['memory']:>15,.0f} {red:>10}")
    la = h["load"]
    print(f"    load average {la[0]:.1f}, {la[1]:.1f}, {la[2]:.1f}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--json", action="store_true", help="print one JSON object instead of the table"
    )
    ap.add_argument(
        "--quick", action="store_true", help="shorter runs (a smoke test, not a measurement)"
    )
    ap.add_argument(
        "--redis", metavar="URL", help="Redis server for section 7 (default: start one if possible)"
    )
    ap.add_argument("--only-redis", action="store_true", help="run sections 7, 9 and 10 only")
    ap.add_argument("--only-keyed", action="store_true", help="run section 8 only")
    ap.add_argument(
        "--only-hierarchy",
        action="store_true",
        help="run section 9's table only (local vs hierarchical)",
    )
    ap.add_argument(
        "--only-hierarchy-cpu",
        action="store_true",
        help="run section 9a only (hierarchical vs local CPU at 50/s, a Redis started for it)",
    )
    ap.add_argument("--only-waiting", action="store_true", help="run section 5 only")
    ap.add_argument("--only-rates", action="store_true", help="run section 11 only")
    ap.add_argument("--only-asyncio", action="store_true", help="run section 12 only")
    ap.add_argument(
        "--only-limits-hits",
        action="store_true",
        help="run section 13 only (limits' hits on shm:// and memory://, a Redis started for it)",
    )
    args = ap.parse_args(argv)
    quick = args.quick
    res: dict = dict(
        machine=dict(
            python=platform.python_version(),
            cpus=os.cpu_count(),
            platform=platform.platform(),
            native=native_available(),
            # what the page made from this run states beside the figures: the backend the
            # measuring process selects, the version, when, how, and how busy the machine was
            backend=selected_backend(),
            shmlimit=shmlimit.__version__,
            date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            args=sys.argv[1:] if argv is None else list(argv),
            load_start=list(os.getloadavg()),
        )
    )
    if args.only_waiting:
        res["cpu_waiting"] = bench_cpu(2.0 if quick else 4.0)
        res["waiting"] = waiting_rows(2.0 if quick else 4.0)
        res["machine"]["load_end"] = list(os.getloadavg())
        if args.json:
            print(json.dumps(res, indent=None))
        else:
            m = res["machine"]
            print(
                f"shmlimit benchmark — Python {m['python']}, {m['cpus']} CPUs, {m['platform']}, native={m['native']}\n"
            )
            print_waiting(res)
        return 0
    if args.only_hierarchy:
        with redis_url(args.redis) as url:
            res["hierarchy"] = (
                bench_hierarchy(
                    url, 2.0 if quick else 5.0, sweep=False, table_seconds=2.0 if quick else 9.0
                )
                if url
                else None
            )
        return emit(res, args.json)
    if args.only_hierarchy_cpu:
        with redis_url(args.redis) as url:
            res["hierarchy_cpu"] = bench_hierarchy_cpu(url, 2.0 if quick else 5.0) if url else None
        return emit(res, args.json)
    if args.only_rates:
        res["rates"] = bench_rates(20_000 if quick else 200_000)
        return emit(res, args.json)
    if args.only_asyncio:
        res["asyncio"] = bench_asyncio(1.0 if quick else 2.0)
        return emit(res, args.json)
    if args.only_limits_hits:
        with redis_url(args.redis) as url:
            res["limits_hits"] = limits_hits(quick, url)
        return emit(res, args.json)
    if not (args.only_redis or args.only_keyed):
        res["rates"] = bench_rates(20_000 if quick else 200_000)
        res["single_ns"] = bench_single(20_000 if quick else 300_000)
        res["tries_ns"] = bench_tries(20_000 if quick else 100_000)
        res["aggregate_per_s"] = bench_aggregate([1, 2, 4, 8], 0.5 if quick else 1.5)
        res["fidelity"] = bench_fidelity([500, 5000, 100_000, 1_000_000], 2.0 if quick else 5.0)
        res["lateness"] = bench_lateness(2.0 if quick else 4.0)
        res["cpu_waiting"] = bench_cpu(2.0 if quick else 4.0)
        res["waiting"] = waiting_rows(2.0 if quick else 4.0)
        res["filler_under_load"] = bench_filler_under_load(3.0 if quick else 5.0)
        res["asyncio"] = bench_asyncio(1.0 if quick else 2.0)
    with redis_url(args.redis) as url:
        if not args.only_keyed:
            res["redis"] = bench_redis(url, 1.0 if quick else 3.0) if url else None
            res["hierarchy"] = (
                bench_hierarchy(url, 2.0 if quick else 5.0, table_seconds=2.0 if quick else 9.0)
                if url
                else None
            )
            res["hierarchy_cpu"] = bench_hierarchy_cpu(url, 2.0 if quick else 5.0) if url else None
            local = url and url.startswith("redis://127.0.0.1:")
            port = int(url.rsplit(":", 1)[1].split("/")[0]) if local else None
            res["latency"] = bench_latency(port, 3.0 if quick else 5.0) if port else None
        if not args.only_redis:
            res["keyed"] = bench_keyed(20_000 if quick else 200_000, 0.5 if quick else 1.5, url)
        if not (args.only_redis or args.only_keyed):
            res["limits_hits"] = limits_hits(quick, url)
    return emit(res, args.json)


def limits_hits(quick: bool, url: Optional[str]) -> Optional[dict]:
    """Section 13 at the run's length (about 15 s; 3 s with --quick)."""
    return bench_limits_hits(
        3200 if quick else 12800, 3 if quick else 7, 0.3 if quick else 1.5, url
    )


@contextlib.contextmanager
def redis_url(given: Optional[str]) -> Iterator[Optional[str]]:
    """The Redis server's URL: ``given``, or one started for the run (stopped after it; None if none starts)."""
    server, url = (None, given) if given else start_redis()
    try:
        yield url
    finally:
        if server is not None:
            server.kill()
            server.wait()


def emit(res: dict, as_json: bool) -> int:
    """Print the results, as one JSON object or as the table; the exit status."""
    res["machine"]["load_end"] = list(os.getloadavg())
    if as_json:
        print(json.dumps(res, indent=None))
    else:
        print_table(res)
    return 0


def print_table(res: dict) -> None:
    m = res["machine"]
    print(
        f"shmlimit benchmark — Python {m['python']}, {m['cpus']} CPUs, {m['platform']}, native={m['native']}\n"
    )
    if "single_ns" in res:
        print_local(res)
    if "redis" in res:
        print_redis(res)
    if "keyed" in res:
        print_keyed(res["keyed"])
    if res.get("hierarchy"):
        print_hierarchy(res["hierarchy"])
    if res.get("hierarchy_cpu"):
        print_hierarchy_cpu(res["hierarchy_cpu"])
    if res.get("latency"):
        print_latency(res["latency"])
    if "rates" in res:
        print_rates(res["rates"])
    if res.get("asyncio"):
        print_asyncio(res["asyncio"])
    if "limits_hits" in res:
        print_limits_hits(res["limits_hits"])


def print_redis(res: dict) -> None:
    print(
        "\n7. Redis, 4 processes: direct RedisLimiter vs hierarchical (shared memory fed from Redis)"
    )
    if not res.get("redis"):
        print("   skipped: no redis-server on the PATH and no --redis URL")
        return
    print(f"   {'target/s':>10} {'mode':>13} {'ops/s':>12} {'round trips':>12} {'trips/op':>9}")
    for r in res["redis"]:
        print(
            f"   {r['target']:>10,.0f} {r['kind']:>13} {r['ops_per_s']:>12,.0f} {r['round_trips']:>12,} "
            f"{r['round_trips_per_op']:>9.4f}"
        )


def print_local(res: dict) -> None:
    single = res["single_ns"]
    floor = single.get("floor: native fetch_add")
    base = single["baseline: Value+Lock bucket"]
    print("1. one process, unlimited rate: cost per call")
    print(f"   {'':34} {'ns/op':>10} {'x floor':>8} {'x Value+Lock':>13}")
    for k, v in single.items():
        xf = f"{v / floor:8.2f}" if floor else f"{'-':>8}"
        print(f"   {k:34} {v:10.0f} {xf} {v / base:13.3f}")
    if "tries_ns" in res:
        print("\n1b. refusals and tries, one process: ns per call and ratio to a granted acquire")
        print(f"   {'':12} {'':28} {'ns/op':>10} {'x acquire':>10}")
        for backend, rows in res["tries_ns"].items():
            base_ns = rows["acquire granted"]
            for k, v in rows.items():
                if k.startswith("atomic ops per"):
                    print(f"   {backend:12} {k:28} {v:10.1f}")
                else:
                    print(f"   {backend:12} {k:28} {v:10.0f} {v / base_ns:10.2f}")
    agg = res["aggregate_per_s"]
    print("\n2. aggregate acquires/s, one unlimited limiter")
    print(f"   {'processes':>9} {'shmlimit':>14} {'Value+Lock':>14} {'ratio':>8}")
    for k in agg["shmlimit"]:
        a, b = agg["shmlimit"][k], agg["Value+Lock"][k]
        print(f"   {k:>9} {a:14,.0f} {b:14,.0f} {a / b:8.1f}x")
    print(
        "\n3. rate fidelity, 4 processes (achieved after the first second; worst 1 s window vs rate + capacity)"
    )
    print(f"   {'target/s':>10} {'achieved/s':>12} {'error':>8} {'max 1s':>10} {'bound':>10}")
    for r in res["fidelity"]:
        print(
            f"   {r['target']:>10,.0f} {r['achieved']:>12,.1f} {r['error_pct']:>7.2f}% {r['max_1s_window']:>10,} "
            f"{r['bound']:>10,.0f} {'ok' if r['within_bound'] else 'OVER'}"
        )
    la = res["lateness"]
    print(
        f"\n4. lateness at 1000/s, 4 processes: p50 {la['p50_ms']:.3f} ms, p99 {la['p99_ms']:.3f} ms, max {la['max_ms']:.3f} ms"
    )
    print()
    print_waiting(res)
    fl = res["filler_under_load"]
    print(
        f"\n6. filler's process CPU-bound: {fl['achieved']:.1f}/s of {fl['target']:.0f}/s ({fl['error_pct']:+.2f}%), "
        f"filler stayed in the busy process: {fl['filler_was_busy_process']}"
    )


def print_waiting(res: dict) -> None:
    cw = res["cpu_waiting"]
    print(
        f"5. CPU while waiting: 8 processes on 50/s use {cw['cpu_s_per_wall_s']:.4f} CPU-s per wall-s together"
    )
    if "waiting" in res:
        print(
            "   8 processes saturating a rate: CPU-s per wall-s together, and each grant's lateness after its turn"
        )
        print(
            "   (filler: the filler threads' share of the CPU; wakes: the waiting threads' per grant; load: the"
        )
        print("   machine's load average as the row ended)")
        print(
            f"   {'rate/s':>8} {'waiters':>15} {'CPU-s/s':>9} {'filler':>8} {'wakes':>6} {'p50 ms':>8} {'p99 ms':>8} "
            f"{'max ms':>8} {'grants':>8} {'load':>5}"
        )
        for w in res["waiting"]:
            fl = (
                f"{w['filler_cpu_s_per_wall_s']:>8.4f}"
                if "filler_cpu_s_per_wall_s" in w
                else f"{'-':>8}"
            )
            wk = f"{w['wakes_per_grant']:>6.2f}" if "wakes_per_grant" in w else f"{'-':>6}"
            print(
                f"   {w['rate']:>8,.0f} {w.get('driver', 'sync'):>15} {w['cpu_s_per_wall_s']:>9.4f} {fl} {wk} "
                f"{w['p50_ms']:>8.3f} {w['p99_ms']:>8.3f} {w['max_ms']:>8.3f} {w['grants']:>8,} {w.get('load', 0):>5.1f}"
            )
        ratios = floor_ratios(res["waiting"])
        if ratios:
            parts = [
                f"{rate:,.0f}/s {driver} {x:.2f}"
                for driver, by in ratios.items()
                for rate, x in by.items()
            ]
            print(f"   CPU as a multiple of the bare sleeps' at the same rate: {', '.join(parts)}")


if __name__ == "__main__":
    sys.exit(main())
