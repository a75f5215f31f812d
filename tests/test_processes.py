"""Real processes sharing one limit: pools (fork and spawn), fork inheritance,
independent interpreters, a killed filler, and racing creators."""
import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest

import shmlimit

# Independent interpreters run outside the source tree, so they import the installed package.
WORKDIR = tempfile.gettempdir()


def tag(results):
    """Per-worker lists of stamps -> (stamp, worker) pairs."""
    return [(t, w) for w, r in enumerate(results) for t in r]


def max_excess(stamps, width):
    """The largest (stamps - distinct workers stamping) in any window [t, t+width).

    ``stamps`` are (time, worker) pairs, each taken just after an acquire
    returned.  A worker's stamps are sequential and its next acquire starts
    after its last stamp, so a window holds at most one stamp per worker from
    a grant made before the window began.  Hence the grants in a window are at
    least this excess: asserting ``max_excess <= rate*T + capacity`` can never
    fail for a correct limiter, however the workers are scheduled.
    """
    stamps = sorted(stamps)
    best = lo = 0
    inside = {}
    for hi, (t, w) in enumerate(stamps):
        inside[w] = inside.get(w, 0) + 1
        while stamps[lo][0] <= t - width:
            v = stamps[lo][1]
            inside[v] -= 1
            if not inside[v]:
                del inside[v]
            lo += 1
        best = max(best, hi - lo + 1 - len(inside))
    return best


def max_gap(times):
    times = sorted(times)
    return max((b - a for a, b in zip(times, times[1:])), default=0.0)


# ---- pool workers ----------------------------------------------------------------

_barrier = None


def _init_worker(barrier):
    global _barrier
    _barrier = barrier
    barrier.wait(timeout=60)  # every worker is up before any task starts


def _grab_for(lim, seconds):
    end = time.monotonic() + seconds
    stamps = []
    while True:
        lim.acquire()
        t = time.monotonic()
        if t > end:
            return stamps
        stamps.append(t)


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_pool_workers_share_one_rate(name, method):
    rate, seconds, workers = 200, 3.0, 4
    lim = shmlimit.Limiter(name, rate=rate)
    cap = lim.capacity
    ctx = mp.get_context(method)
    barrier = ctx.Barrier(workers)
    with ctx.Pool(workers, initializer=_init_worker, initargs=(barrier,)) as pool:
        results = pool.starmap(_grab_for, [(lim, seconds)] * workers)
    stamps = [t for r in results for t in r]
    assert all(len(r) > 0 for r in results), "every worker gets a share"
    assert max_excess(tag(results), 1.0) <= rate + cap
    span = max(stamps) - min(stamps)
    assert len(stamps) <= rate * span + cap + 1
    assert len(stamps) >= 0.97 * (rate * seconds + cap)
    s = lim.stats()
    assert s.grants >= len(stamps)
    lim.close()


# ---- a limiter inherited through fork, not pickled ---------------------------------

_inherited = None


def _use_inherited(q):
    lim = _inherited
    att = lim._att
    q.put((os.getpid(), att.pid, att.lease.held if att.lease else None, att.slot))
    for _ in range(5):
        lim.acquire()
    q.put({p.pid: p.grants for p in lim.stats().processes})


def test_limiter_inherited_through_fork_registers_the_child(name):
    global _inherited
    _inherited = shmlimit.Limiter(name, rate=1000)
    parent_slot = _inherited._att.slot
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_use_inherited, args=(q,))
    p.start()
    child_pid, att_pid, held, child_slot = q.get(timeout=30)
    pids = q.get(timeout=30)
    p.join(30)
    assert p.exitcode == 0
    assert att_pid == child_pid and child_slot != parent_slot
    assert held is False  # never believes it holds the parent's lease
    assert os.getpid() in pids and child_pid in pids
    assert pids[child_pid] == 5  # counted in the child's own slot, not the parent's
    assert pids[os.getpid()] == 0
    _inherited.close()
    _inherited = None


# ---- independent interpreters -------------------------------------------------------

WORKER = textwrap.dedent(
    """
    import json, sys, time
    import shmlimit
    lim = shmlimit.attach(sys.argv[1])
    seconds = float(sys.argv[2])
    print("ready", flush=True)
    sys.stdin.readline()  # go
    end = time.monotonic() + seconds
    stamps = []
    while True:
        lim.acquire()
        t = time.monotonic()
        if t > end:
            break
        stamps.append(t)
    print(json.dumps(stamps), flush=True)
    """
)


def start_workers(name, count, seconds, script=WORKER):
    """``count`` interpreters running ``script`` (argv: name, seconds), each once it printed "ready"."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script, name, str(seconds)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=WORKDIR,
        )
        for _ in range(count)
    ]
    for p in procs:
        assert p.stdout.readline().strip() == "ready"
    return procs


def go(procs):
    for p in procs:
        p.stdin.write("\n")
        p.stdin.flush()


def collect(procs):
    out = []
    for p in procs:
        line = p.stdout.readline()
        p.wait(30)
        out.append(json.loads(line))
    return out


ACQUIRER = """
import sys, shmlimit
lim = shmlimit.attach(sys.argv[1])
print("ready", flush=True)
while True:
    lim.acquire()
"""


def start_acquirer(name):
    """An independent interpreter attached to ``name``, acquiring forever (kill it when done)."""
    p = subprocess.Popen([sys.executable, "-c", ACQUIRER, name], stdout=subprocess.PIPE, text=True, cwd=WORKDIR)
    assert p.stdout.readline().strip() == "ready"
    return p


def test_independent_interpreters_share_the_rate(name):
    rate, seconds = 150, 2.5
    lim = shmlimit.Limiter(name, rate=rate)
    cap = lim.capacity
    lim.close()  # the test process itself takes no part
    procs = start_workers(name, 3, seconds)
    go(procs)
    results = collect(procs)
    stamps = [t for r in results for t in r]
    assert all(results)
    assert max_excess(tag(results), 1.0) <= rate + cap
    assert len(stamps) >= 0.97 * (rate * seconds + cap) - rate * 0.05  # 50 ms for the go-signal to spread


def wait_for(predicate, timeout=10.0, every=0.005):
    """Poll a condition until it holds; fail after ``timeout`` seconds."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        v = predicate()
        if v:
            return v
        time.sleep(every)
    raise AssertionError("condition not reached in time")


def test_killed_filler_is_replaced_and_grants_continue(name):
    rate, seconds = 500, 3.0
    lim = shmlimit.Limiter(name, rate=rate)
    cap = lim.capacity
    lim.close()
    procs = start_workers(name, 3, seconds)
    by_pid = {p.pid: p for p in procs}
    filler = wait_for(lambda: shmlimit.inspect(name).filler_pid)
    assert filler in by_pid
    go(procs)
    wait_for(lambda: shmlimit.inspect(name).grants >= rate)  # a second of work before the fault
    killed_at = time.monotonic()
    by_pid[filler].send_signal(signal.SIGKILL)
    by_pid[filler].wait(10)
    new = wait_for(lambda: (shmlimit.inspect(name).filler_pid or 0) not in (0, filler))
    assert new
    survivors = [p for p in procs if p.pid != filler]
    results = collect(survivors)
    after = sorted(t for r in results for t in r if t > killed_at)
    after_tagged = [(t, w) for t, w in tag(results) if t > killed_at]
    assert after and after[-1] > killed_at + 1.0
    assert max_gap([killed_at] + after) < 0.100
    # the survivors alone kept the rate after the kill
    assert max_excess(after_tagged, 1.0) <= rate + cap
    rate_after = (len(after) - 1) / (after[-1] - after[0])
    assert rate_after == pytest.approx(rate, rel=0.03)
    dead = [p for p in shmlimit.inspect(name).processes if p.pid == filler]
    assert all(not p.alive for p in dead)


# ---- racing creators ------------------------------------------------------------------


def _create(name, barrier, q, rate):
    barrier.wait(timeout=60)
    try:
        lim = shmlimit.Limiter(name, rate=rate, burst=3)
        q.put(("ok", lim.created, repr(lim.config)))
        lim.close()
    except shmlimit.ConfigMismatchError as e:
        q.put(("mismatch", False, str(e)))


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_concurrent_creation_initialises_once(name, method):
    ctx = mp.get_context(method)
    n = 8
    barrier = ctx.Barrier(n)
    q = ctx.Queue()
    procs = [ctx.Process(target=_create, args=(name, barrier, q, 100)) for _ in range(n)]
    for p in procs:
        p.start()
    results = [q.get(timeout=60) for _ in range(n)]
    for p in procs:
        p.join(30)
    assert [r[0] for r in results] == ["ok"] * n
    assert sum(1 for r in results if r[1]) == 1
    assert len({r[2] for r in results}) == 1
    assert shmlimit.list_names().count(name) == 1


def test_concurrent_creators_with_different_configs_get_a_clear_error(name):
    ctx = mp.get_context("fork")
    n = 6
    barrier = ctx.Barrier(n)
    q = ctx.Queue()
    procs = [ctx.Process(target=_create, args=(name, barrier, q, 100 if i % 2 else 200)) for i in range(n)]
    for p in procs:
        p.start()
    results = [q.get(timeout=60) for _ in range(n)]
    for p in procs:
        p.join(30)
    oks = [r for r in results if r[0] == "ok"]
    bad = [r for r in results if r[0] == "mismatch"]
    assert len(oks) == 3 and len(bad) == 3 and sum(r[1] for r in oks) == 1
    assert all("already exists" in r[2] for r in bad)


def _executor_task(lim):
    lim.acquire()
    return os.getpid(), lim.name


def test_process_pool_executor_attaches_by_name(name):
    from concurrent.futures import ProcessPoolExecutor

    lim = shmlimit.Limiter(name, rate=1000)
    with ProcessPoolExecutor(2, mp_context=mp.get_context("spawn")) as ex:
        results = list(ex.map(_executor_task, [lim] * 20))
    assert {n for _, n in results} == {name}
    assert os.getpid() not in {pid for pid, _ in results}
    assert lim.stats().grants == 20  # every grant of the executor's processes, counted once
    lim.close()
