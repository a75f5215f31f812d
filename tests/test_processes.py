"""Real processes sharing one limit: pools (fork and spawn), fork inheritance,
independent interpreters, rovers wrapping mid-run, and racing creators."""

import json
import multiprocessing as mp
import os
import subprocess
import sys
import time

import pytest
from support.procs import (
    TESTS,
    WORKDIR,
    collect_witnessed,
    go,
    run_processes,
    stamp_until,
    start_workers,
    wait_for,
)
from support.starvation import floor, least, run_delay, total
from support.windows import max_excess, max_gap, tag

import shmlimit
from shmlimit.bucket.filler import lease_slot
from shmlimit.shm import layout as L

pytestmark = pytest.mark.slow  # real processes measured in real (wall-clock) time


# ---- pool workers ----------------------------------------------------------------


_barrier = None


def _init_worker(barrier):
    global _barrier
    _barrier = barrier
    barrier.wait(timeout=60)  # every worker is up before any task starts


def _grab_for(lim, seconds):
    """Grant times for ``seconds``, and how long this worker waited runnable for a CPU meanwhile."""
    delay0 = run_delay()
    stamps = stamp_until(lim.acquire, time.monotonic() + seconds)
    delay1 = run_delay()
    return stamps, None if delay0 is None or delay1 is None else delay1 - delay0


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_pool_workers_share_one_rate(name, method):
    rate, seconds, workers = 200, 3.0, 4
    lim = shmlimit.Limiter(name, rate=rate)
    cap = lim.capacity
    ctx = mp.get_context(method)
    barrier = ctx.Barrier(workers)
    lost0 = lim.stats().starved_seconds
    with ctx.Pool(workers, initializer=_init_worker, initargs=(barrier,)) as pool:
        witnessed = pool.starmap(_grab_for, [(lim, seconds)] * workers)
    s = lim.stats()
    lim.close()
    results = [r for r, _ in witnessed]
    stamps = [t for r in results for t in r]
    assert all(len(r) > 0 for r in results), "every worker gets a share"
    assert max_excess(tag(results), 1.0) <= rate + cap
    span = max(stamps) - min(stamps)
    # the whole run as one window, judged as every window is (support.windows: a worker preempted
    # between its grant and its stamp leaves at most one late stamp in a window)
    assert max_excess(tag(results), span + 1e-9) <= rate * span + cap + 1
    # The rate, less the time the limiter lost while callers queued (its own count: no replenish
    # came within a capacity) and the time none of the workers ran (the kernel's count); and it
    # may lose only while the machine kept its processes off the CPU at least that long.  On a
    # quiet machine both are ~0: the rate.
    lost, delays = s.starved_seconds - lost0, [d for _, d in witnessed]
    assert len(stamps) >= floor(0.97 * (rate * seconds + cap), rate, lost, delays)
    assert lost <= total(delays)
    assert s.grants >= len(stamps)


# ---- a limiter inherited through fork, not pickled ---------------------------------


_inherited = None


def _use_inherited(q):
    lim = _inherited
    att = lim._att
    q.put((os.getpid(), att.pid, att.lease, att.slot))  # inherited, not used yet
    for _ in range(5):
        lim.acquire()
    q.put((att.lease.word, att.slot, {p.pid: p.grants for p in lim.stats().processes}))


def test_limiter_inherited_through_fork_registers_the_child(name):
    global _inherited
    _inherited = shmlimit.Limiter(name, rate=1000)
    _inherited.retry_after()  # a first use: the parent's filler runs and takes the lease
    wait_for(lambda: _inherited.stats().filler_pid == os.getpid())
    parent_slot = _inherited._att.slot
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_use_inherited, args=(q,))
    p.start()
    child_pid, att_pid, lease_before, slot_before = q.get(timeout=30)
    word, child_slot, pids = q.get(timeout=30)
    p.join(30)
    assert p.exitcode == 0
    assert (
        att_pid == child_pid and lease_before is None and slot_before is None
    )  # registers on first use
    assert child_slot is not None and child_slot != parent_slot
    # Never believes it holds the parent's lease: a lease it holds is one it took itself, in its
    # own slot (a busy machine may keep the parent's filler thread from renewing in time, and
    # the child then takes the lease over, rightly)
    assert word == 0 or lease_slot(word) == child_slot
    assert os.getpid() in pids and child_pid in pids
    assert pids[child_pid] == 5  # counted in the child's own slot, not the parent's
    assert pids[os.getpid()] == 0
    _inherited.close()
    _inherited = None


# ---- a handle kept past its name's re-creation ------------------------------------


def _use_superseded(q):
    out = []
    for use in (_inherited[0].acquire, lambda: _inherited[1].try_acquire("k")):
        try:
            out.append(use())
        except shmlimit.SegmentError:
            out.append("SegmentError")
    q.put(out)


def test_a_handle_kept_past_its_names_recreation_is_inherited_as_any_other(name):
    """The registry hands out the name's new segment; a handle still holding the old attachment
    is reached by the fork hook all the same: a forked child neither counts its grants in its
    parent's slot nor inserts keys as its parent, but, as with any limiter whose name was
    unlinked since, is told so at its first use."""
    global _inherited
    kname = name + "-keyed"
    old = shmlimit.Limiter(name, rate=1000)
    old_keyed = shmlimit.KeyedLimiter(kname, rate=1000)
    old.acquire()
    old_keyed.acquire("k")
    for n in (name, kname):
        shmlimit.unlink(n)
    new = shmlimit.Limiter(name, rate=1000)
    new_keyed = shmlimit.KeyedLimiter(kname, rate=1000)
    _inherited = (old, old_keyed)
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_use_superseded, args=(q,))
    p.start()
    assert q.get(timeout=30) == ["SegmentError", "SegmentError"]
    p.join(30)
    assert p.exitcode == 0
    assert {pr.pid: pr.grants for pr in old.stats().processes} == {os.getpid(): 1}
    assert [pr.pid for pr in old_keyed.stats().processes] == [os.getpid()]
    _inherited = None
    for h in (old, old_keyed, new, new_keyed):
        h.close()


#: A child's first lines: it opens the limiter named by its first argument and, its first use,
#: takes the filler's lease.
_FILLING = """
import os, sys
import shmlimit
from shmlimit import attachment
sys.path.insert(0, sys.argv[2])
from support.procs import wait_for
lim = shmlimit.Limiter(sys.argv[1], rate=1000)
lim.retry_after()
wait_for(lambda: lim.stats().filler_pid == os.getpid())
"""


def _exits_detached(name, then):
    """A child filling ``name`` runs ``then`` and exits cleanly: its slot and lease given back."""
    lim = shmlimit.Limiter(name, rate=1000)  # mapped before the child acts on the name
    child = [sys.executable, "-c", _FILLING + then, name, TESTS]
    done = subprocess.run(child, timeout=60, capture_output=True)
    assert done.returncode == 0 and b"Traceback" not in done.stderr, done.stderr
    s = lim.stats()
    assert [p.pid for p in s.processes] == [os.getpid()] and s.filler_pid is None
    lim.close()


def test_an_attachment_kept_past_its_names_recreation_is_detached_at_exit(name):
    """At exit every attachment detaches, the one a handle kept past its name's re-creation
    too: its slot is given back and the lease it held dropped, so a process still working on
    that segment's mapping fills at once."""
    _exits_detached(
        name,
        "shmlimit.unlink(sys.argv[1])\n"
        "new = shmlimit.Limiter(sys.argv[1], rate=1000)  # the name made again, lim still held\n",
    )


_OPENED_MEANWHILE = """
class OpenedMeanwhile:
    # What another thread opening a limiter during the exit hook's copy does to a WeakSet:
    # the first copy fails, "Set changed size during iteration"
    def __init__(self, held):
        self.held, self.copies = held, 0

    def __iter__(self):
        self.copies += 1
        if self.copies == 1:
            raise RuntimeError("Set changed size during iteration")
        return iter(self.held)


attachment.registry._every = OpenedMeanwhile(attachment.registry._every)
"""


def test_a_limiter_opened_by_another_thread_at_exit_leaves_every_other_detached(name):
    """The exit hook copies the attachments held (a WeakSet: copied item by item) while another
    thread may open one: a copy that fails is taken again, and every attachment detaches."""
    _exits_detached(name, _OPENED_MEANWHILE)


# ---- independent interpreters -------------------------------------------------------


def test_independent_interpreters_share_the_rate(name):
    rate, seconds = 150, 2.5
    lim = shmlimit.Limiter(name, rate=rate)
    cap = lim.capacity
    lim.close()  # the test process itself takes no part
    procs = start_workers(name, 3, seconds)
    go(procs)
    results, delays = collect_witnessed(procs)
    lost = shmlimit.inspect(
        name
    ).starved_seconds  # time the limiter could not credit (as in the pool test)
    stamps = [t for r in results for t in r]
    assert all(results)
    assert max_excess(tag(results), 1.0) <= rate + cap
    # 50 ms for the go-signal to spread
    assert len(stamps) >= floor(0.97 * (rate * seconds + cap) - rate * 0.05, rate, lost, delays)
    assert lost <= total(delays)


def test_a_rover_base_that_is_no_integer_is_named_and_creates_nothing(name):
    env = dict(os.environ, SHMLIMIT_TEST_ROVER_BASE="abc")
    code = f"import shmlimit; shmlimit.Limiter({name!r}, rate=5)"
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert r.returncode == 1
    assert "SHMLIMIT_TEST_ROVER_BASE must be an integer (a test hook), got 'abc'" in r.stderr
    assert name not in shmlimit.list_names()


@pytest.mark.parametrize("base", [(1 << 64) - 1_000_000_000, (1 << 63) - 1_000_000_000])
def test_rovers_wrapping_mid_run_change_nothing(name, base):
    """At 1000/s with 1 ns tokens, 1e9 tokens flow per second: the rovers wrap ~1 s into the run."""
    rate, seconds = 1000, 3.0
    env = dict(os.environ, SHMLIMIT_TEST_ROVER_BASE=str(base))
    subprocess.run(
        [sys.executable, "-c", f"import shmlimit; shmlimit.Limiter({name!r}, rate={rate}).close()"],
        env=env,
        check=True,
        cwd=WORKDIR,
    )
    lim = shmlimit.attach(name)
    assert lim._att.cells.load(192) >= base - 10**8  # the tail really starts near the boundary
    cap = lim.capacity
    lim.close()
    procs = start_workers(name, 3, seconds)
    go(procs)
    results, delays = collect_witnessed(procs)
    lost = shmlimit.inspect(
        name
    ).starved_seconds  # time the limiter could not credit (as in the pool test)
    stamps = sorted(t for r in results for t in r)
    assert max_excess(tag(results), 1.0) <= rate + cap
    assert len(stamps) <= rate * seconds * 1.03
    # The rate, less what the machine withheld (as in the pool test): ~0 on a quiet machine
    assert len(stamps) >= floor(rate * seconds * 0.97, rate, lost, delays)
    assert lost <= total(delays)
    # no pause longer than the machine kept every worker off the CPU
    assert max_gap(stamps) < 0.1 + least(delays)


# ---- racing creators ------------------------------------------------------------------


def _create(name, barrier, rate, q):
    barrier.wait(timeout=60)
    lim = None
    try:
        lim = shmlimit.Limiter(name, rate=rate, burst=3)
        q.put(("ok", lim.created, repr(lim.config)))
    except shmlimit.ConfigMismatchError as e:
        q.put(("mismatch", False, str(e)))
    finally:
        # Every creator has tried before any closes: they all overlap.  Closing at once let a
        # creator that a busy machine started late find nobody attached and the creator gone,
        # and adopt its own config (a redeploy, by design), where the test means a live conflict.
        barrier.wait(timeout=60)
        if lim is not None:
            lim.close()


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_concurrent_creation_initialises_once(name, method):
    ctx = mp.get_context(method)
    n = 8
    barrier = ctx.Barrier(n)
    results = run_processes(ctx, _create, [(name, barrier, 100)] * n, timeout=60)
    assert [r[0] for r in results] == ["ok"] * n
    assert sum(1 for r in results if r[1]) == 1
    assert len({r[2] for r in results}) == 1
    assert shmlimit.list_names().count(name) == 1


def test_concurrent_creators_with_different_configs_get_a_clear_error(name):
    ctx = mp.get_context("fork")
    n = 6
    barrier = ctx.Barrier(n)
    results = run_processes(
        ctx, _create, [(name, barrier, 100 if i % 2 else 200) for i in range(n)], timeout=60
    )
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


class _ForkOnStore(dict):
    """A registry's names, whose store of ``name`` forks first: a fork from another thread that
    lands between the two stores of an open, made deterministic.  The child's answer (its pid,
    the pids in the table after it used the limiter) comes back on a pipe."""

    def __init__(self, items, name, out):
        super().__init__(items)
        self.name, self.out, self.child = name, out, None

    def __setitem__(self, key, value):
        if key == self.name and self.child is None:
            self.child = os.fork()
            if self.child == 0:  # the child goes on only to hand back its answer (below)
                try:
                    dict.__setitem__(self, key, value)
                    lim = shmlimit.attach(self.name)
                    lim.acquire()
                    pids = [p.pid for p in shmlimit.inspect(self.name).processes]
                    os.write(self.out, json.dumps([os.getpid(), pids]).encode())
                finally:
                    os._exit(0)
        super().__setitem__(key, value)


def test_a_fork_amid_an_open_leaves_the_child_its_own_slot(name):
    """A fork landing inside an open, after the new attachment is named and before the fork hook
    can reach it: the child's first use must register it in a slot of its own.  It used the
    parent's slot as its own (its grants counted there, its tickets recorded there), never
    registered, as the fork hook never ran on an attachment it could not see."""
    from shmlimit.attachment import registry

    shmlimit.Limiter(name, rate=1000).close()
    r, w = os.pipe()
    saved = registry._atts
    registry._atts = hooked = _ForkOnStore(saved, name, w)
    try:
        lim = shmlimit.attach(name)
    finally:
        registry._atts = saved
        os.close(w)
    if hooked.child == 0:  # pragma: no cover - the child left in __setitem__
        os._exit(1)
    try:
        with os.fdopen(r) as f:
            child, pids = json.loads(f.read())
        os.waitpid(hooked.child, 0)
        assert child in pids and os.getpid() in pids
    finally:
        lim.close()


def _fill_then_end(name):
    """A multiprocessing child's work: use the limiter until this process is its filler, then end."""
    lim = shmlimit.attach(name)
    lim.acquire()
    wait_for(lambda: lim.stats().filler_pid == os.getpid())
    return os.getpid()


@pytest.mark.parametrize("method", ["fork", "forkserver", "spawn"])
def test_a_multiprocessing_child_that_fills_drops_its_lease_and_slot_as_it_ends(name, method):
    """A ``multiprocessing`` child of the fork and forkserver methods ends with ``os._exit`` after
    its finalizers, running no ``atexit`` hook: it must still leave as any process's exit does,
    its filler lease dropped (a successor fills at once) and its slot given back.  It left both:
    the lease held by a dead process until it expired, and a dead entry in the table."""
    keep = shmlimit.Limiter(name, rate=1000)  # registered, never used: no filler of its own
    try:
        with mp.get_context(method).Pool(1) as pool:
            child = pool.apply(_fill_then_end, (name,))
            pool.close()
            pool.join()
        assert child != os.getpid()
        assert lease_slot(keep._att.cells.load(L.LEASE)) is None
        assert [p.pid for p in shmlimit.inspect(name).processes] == [os.getpid()]
    finally:
        keep.close()
