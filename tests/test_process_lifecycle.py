"""Processes coming and going with real interpreters: killed while waiting, killed while
registering, a whole fleet that died, and creators, attachers and unlinkers racing."""

import multiprocessing as mp
import os
import random
import signal
import subprocess
import sys
import time

import pytest
from support.procs import WORKDIR, start_acquirer, wait_for

import shmlimit
from shmlimit.shm import layout as L

pytestmark = pytest.mark.slow  # real processes measured in real (wall-clock) time


def test_killed_waiters_leave_no_stuck_queue_and_their_slots_are_reclaimed(name):
    lim = shmlimit.Limiter(name, rate=20, slots=4)
    lim.close()

    first = [start_acquirer(name) for _ in range(4)]  # the table is full, and they queue at 20/s
    wait_for(lambda: sum(p.waiting for p in shmlimit.inspect(name).processes) >= 3)
    for p in first:  # killed while holding tickets and waiting
        p.send_signal(signal.SIGKILL)
        p.wait()
    second = [start_acquirer(name) for _ in range(4)]
    try:
        s = shmlimit.inspect(name)
        assert {p.pid for p in s.processes} == {p.pid for p in second}  # every dead slot reclaimed
        g0 = s.grants
        t0 = time.monotonic()
        wait_for(
            lambda: shmlimit.inspect(name).grants >= g0 + 20
        )  # the dead tickets held nobody up
        assert time.monotonic() - t0 < 2.0
    finally:
        for p in second:
            p.kill()
            p.wait()


ATTACHER = """
import sys, shmlimit
shmlimit.attach(sys.argv[1]).acquire()
"""


def test_processes_killed_while_registering_leak_no_slot(name):
    slots = 8
    lim = shmlimit.Limiter(name, rate=200, slots=slots)
    lim.close()
    rng = random.Random(8)
    for _ in range(24):  # killed anywhere from interpreter start-up to mid-registration
        p = subprocess.Popen([sys.executable, "-c", ATTACHER, name], cwd=WORKDIR)
        time.sleep(rng.uniform(0.0, 0.12))  # a random moment of its start-up, not a synchronisation
        p.kill()
        p.wait()
    fresh = [start_acquirer(name) for _ in range(slots)]
    try:
        s = shmlimit.inspect(name)
        # every slot a killed process held was reclaimed: all eight newcomers are registered
        assert {p.pid for p in s.processes} == {p.pid for p in fresh}
        assert all(p.alive for p in s.processes)
        g0 = s.grants
        wait_for(lambda: shmlimit.inspect(name).grants >= g0 + 100)  # and the grants flow
    finally:
        for p in fresh:
            p.kill()
            p.wait()


FLEET = """
import sys, shmlimit
lim = shmlimit.Limiter(sys.argv[1], rate=100)
for _ in range(5):
    lim.acquire()
print("ready", flush=True)
while True:
    lim.acquire()
"""


def test_every_process_dies_and_a_new_limiter_reattaches(name):
    procs = []
    for _ in range(4):  # the first creates the segment, the others attach with the same config
        p = subprocess.Popen(
            [sys.executable, "-c", FLEET, name], stdout=subprocess.PIPE, text=True, cwd=WORKDIR
        )
        assert p.stdout.readline().strip() == "ready"
        procs.append(p)
    wait_for(lambda: shmlimit.inspect(name).filler_pid in {p.pid for p in procs})
    for p in procs:
        p.kill()
        p.wait()
    before = shmlimit.inspect(name)
    assert before.grants >= 20 and not any(p.alive for p in before.processes)

    # Nothing in the segment is ever half-written (every word is one atomic store, the header
    # was READY long ago), so the documented behaviour is to reattach, keeping the counts.
    lim = shmlimit.Limiter(name, rate=100)
    try:
        assert not lim.created
        lim.retry_after()  # a first use (taking nothing) starts this process's filler thread
        wait_for(lambda: lim.stats().filler_pid == os.getpid())  # the dead filler's lease expired
        t0 = time.monotonic()
        for _ in range(20):
            assert lim.acquire()
        assert time.monotonic() - t0 >= (20 - lim.capacity - 1) / 100  # still limited, never faster
        s = lim.stats()
        assert s.grants == before.grants + 20
        assert [p.pid for p in s.processes if p.alive] == [os.getpid()]
        with pytest.raises(shmlimit.ConfigMismatchError):
            shmlimit.Limiter(name, rate=101)
    finally:
        lim.close()


def _churn(name, iterations, seed, q):
    rng = random.Random(seed)
    seen = {}
    for _ in range(iterations):
        try:
            lim = shmlimit.Limiter(name, rate=1000)
            lim.try_acquire()
            lim.close()
            if rng.random() < 0.3:
                shmlimit.unlink(name)
        except shmlimit.LimiterNotFoundError:  # documented: unlink of a name already unlinked
            seen["LimiterNotFoundError"] = seen.get("LimiterNotFoundError", 0) + 1
        except BaseException as e:  # anything else is a failure, reported by type and message
            seen[f"{type(e).__name__}: {e}"] = seen.get(f"{type(e).__name__}: {e}", 0) + 1
    q.put(seen)


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_sixteen_processes_create_attach_close_unlink_concurrently(name, method):
    ctx = mp.get_context(method)
    q = ctx.Queue()
    procs = [ctx.Process(target=_churn, args=(name, 25, i, q)) for i in range(16)]
    for p in procs:
        p.start()
    seen = [q.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    unexpected = {k: v for s in seen for k, v in s.items() if k != "LimiterNotFoundError"}
    assert unexpected == {}
    try:
        shmlimit.unlink(name)
    except shmlimit.LimiterNotFoundError:
        pass
    assert not [f for f in os.listdir("/dev/shm") if f.startswith(f"shmlimit.{name}")]


# ---- the filler's watch of slot owners (table.OwnerWatch) ------------------------------------------


def _open_fds():
    return len(os.listdir("/proc/self/fd"))


def test_the_owner_watch_answers_as_slot_alive_does_and_leaks_no_descriptor():
    """One pidfd per owner, kept only for the process the slot names: a recycled pid (another
    start), a start not yet known, a zombie, a reaped process and another namespace's owner are
    judged as ``slot_alive`` judges them, and ``close`` (or a fork's ``forked``) leaves no descriptor."""
    from shmlimit.shm.table import OwnerWatch, proc_start, slot_alive

    fds0 = _open_fds()
    w = OwnerWatch()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        start = wait_for(lambda: proc_start(child.pid))
        cases = [
            (child.pid, start, 0),
            (child.pid, start + 1, 0),
            (child.pid, 0, 0),
            (os.getpid(), proc_start(os.getpid()), 0),
            (child.pid, start, 1),
        ]  # the last: recorded in another PID namespace (inode 1: not ours)
        for _ in range(2):  # the second time from the descriptors kept
            for i, (pid, st, ns) in enumerate(cases):
                assert w.alive(i, pid, st, ns) == slot_alive(pid, st, ns), (pid, st, ns)
        assert w.alive(0, child.pid, start, 0) and _open_fds() > fds0
        child.kill()
        wait_for(lambda: proc_start(child.pid) is None)  # a zombie: dead to both
        assert not w.alive(0, child.pid, start, 0) and not slot_alive(child.pid, start, 0)
        child.wait()
        assert not w.alive(0, child.pid, start, 0)
        forked = OwnerWatch()
        assert forked.alive(5, os.getpid(), proc_start(os.getpid()), 0)
        forked.forked()  # as a forked child does with its parent's watch
        w.close()
        assert _open_fds() == fds0
    finally:
        child.kill()
        child.wait()
        w.close()


def test_a_pid_no_process_can_have_is_dead_and_the_reap_goes_on(name):
    """A slot's PID word outside 1..PID_MAX_LIMIT (a forged or torn word: 2**31 and up made
    ``os.pidfd_open`` raise OverflowError, and every reap pass stopped there) names no process in
    any namespace: dead to every judge, and the filler's reap gives its records back."""
    from shmlimit.shm.table import PID_MAX_LIMIT, OwnerWatch, is_alive, slot_alive

    w = OwnerWatch()
    try:
        for pid in (PID_MAX_LIMIT + 1, (1 << 31) + 5, (1 << 64) - 1):
            for ns in (0, 1):  # ours, and another namespace's
                assert not slot_alive(pid, 12345, ns) and not w.alive(3, pid, 12345, ns)
                assert not w.round()(3, pid, 12345, ns)
            assert not is_alive(pid, 0)
    finally:
        w.close()
    lim = shmlimit.Limiter(name, rate=1000, slots=4)
    try:
        lim.acquire()
        att = lim._att
        base = L.slot_offset(3)
        att.cells.store(base + L.SLOT_START, 12345)
        att.cells.store(base + L.SLOT_PID, (1 << 31) + 5)
        tail = att.cells.load(L.TAIL)
        att.cells.store(base + L.SLOT_TICKET, tail + 7)  # a ticket of 7 tokens, queued
        att.cells.store(base + L.SLOT_TICKET_LEN, 7)
        att.cells.store(L.TAIL, tail + 7)
        assert att.reap() == 1  # given back, not an OverflowError
    finally:
        lim.close()


class _CountingPoll:
    """A ``select.poll`` that counts its polls (the watch's own, wrapped)."""

    def __init__(self, inner):
        self.inner, self.polls = inner, 0

    def register(self, fd, mask):
        self.inner.register(fd, mask)

    def unregister(self, fd):
        self.inner.unregister(fd)

    def poll(self, timeout):
        self.polls += 1
        return self.inner.poll(timeout)


def test_a_reaps_pass_polls_the_owners_once_and_judges_as_slot_alive_does():
    """``OwnerWatch.round``: one poll for every owner already watched in a pass (a reap), not one
    per owner; an owner gone before the pass is dead in it, one that exits after the pass's poll
    is alive in that pass (its records wait for the next one) and dead in the next."""
    from shmlimit.shm.table import OwnerWatch, proc_start, slot_alive

    w = OwnerWatch()
    kids = [
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for _ in range(3)
    ]
    try:
        owners = [(k.pid, wait_for(lambda k=k: proc_start(k.pid))) for k in kids]
        first = w.round()  # opens a descriptor per owner: alive from the start read after opening
        assert all(first(i, pid, st, 0) for i, (pid, st) in enumerate(owners))
        if not w._fds:
            pytest.skip("no pidfd here: the watch answers as slot_alive does, polling nothing")
        w._poll = counting = _CountingPoll(w._poll)
        kids[0].kill()
        wait_for(lambda: proc_start(kids[0].pid) is None)  # a zombie: dead to slot_alive too
        alive = w.round()
        answers = [alive(i, pid, st, 0) for i, (pid, st) in enumerate(owners)]
        assert answers == [slot_alive(pid, st, 0) for pid, st in owners] == [False, True, True]
        assert counting.polls == 1  # one poll for the pass, however many owners it asked about
        late = w.round()
        assert late(2, *owners[2], 0)  # this pass's poll is taken now ...
        kids[1].kill()
        wait_for(lambda: proc_start(kids[1].pid) is None)
        assert late(1, *owners[1], 0)  # ... so an exit after it is seen by the next pass only
        assert not w.round()(1, *owners[1], 0) and not slot_alive(*owners[1], 0)
    finally:
        for k in kids:
            k.kill()
            k.wait()
        w.close()


def _hold_one(name, ready):
    lim = shmlimit.Limiter(name)
    assert lim.acquire(timeout=5)  # capped: one op in flight, never released
    ready.put(os.getpid())
    time.sleep(60)


@pytest.mark.parametrize("victim", ["filler", "other"])
def test_a_killed_holders_ops_come_back_at_once_even_from_the_filler(name, victim):
    """Capped mode: a SIGKILLed holder's ops in flight come back by a filler's reap.  When the
    holder ran the filler, a caller waiting for admission took 0.44-0.50 s (a watcher's next look)
    instead of the 0.1 s promised: it never nudged its own filler, which takes the lapsed lease."""
    ctx = mp.get_context("fork")
    lim = shmlimit.Limiter(name, rate=1000, burst=2, capped=True)
    lim.close()  # this process holds nothing and runs no filler until it asks below
    ready = ctx.Queue()
    holders = [ctx.Process(target=_hold_one, args=(name, ready)) for _ in range(2)]
    try:
        for p in holders:
            p.start()
        pids = {ready.get(timeout=30) for _ in holders}
        filler = wait_for(
            lambda: shmlimit.inspect(name).filler_pid in pids and shmlimit.inspect(name).filler_pid
        )
        killed = next(p for p in holders if (p.pid == filler) == (victim == "filler"))
        os.kill(killed.pid, signal.SIGKILL)
        killed.join()
        lim = shmlimit.Limiter(name)
        t0 = time.monotonic()
        assert lim.acquire(timeout=3)  # the dead holder's op, back
        waited = time.monotonic() - t0
        assert not lim.try_acquire()  # the live holder's and ours fill the capacity of 2
        lim.close()
        # the reap within REAP_EVERY (0.1 s) and a lease takeover (50 ms) of a process that runs
        assert waited < 0.3, waited
    finally:
        for p in holders:
            if p.is_alive():
                p.kill()
            p.join()


class _LoadHook:
    """Cells whose first load of word ``at`` runs ``hook`` just before it: another process's step
    landing between two loads of a registration, made deterministic."""

    def __init__(self, cells, at, hook):
        self._cells, self._at, self._hook = cells, at, hook

    def load(self, off):
        if off == self._at and self._hook is not None:
            hook, self._hook = self._hook, None
            hook()
        return self._cells.load(off)

    def __getattr__(self, attr):
        return getattr(self._cells, attr)


def test_a_reclaimer_that_read_a_dead_pid_never_zeroes_its_successors_start(name):
    """A registration reclaiming a dead owner's slot reads PID, then START: a successor that took
    the slot in between (its START written) must keep it.  The late reclaimer zeroed it (its CAS
    of START matched the successor's word, its CAS of PID then failed), leaving a live owner that
    reads "registering" for good: its slot judged by pid alone, so a process that reused its pid
    after it died held the slot (and kept ``gc`` away) as if it were that owner."""
    from shmlimit.shm.table import ProcessTable, pid_namespace, proc_start

    lim = shmlimit.Limiter(name, rate=10, slots=1)
    att = lim._att
    c = att.cells
    att.leave()  # slot 0 free, then a dead owner's
    dead = subprocess.Popen([sys.executable, "-c", "pass"], cwd=WORKDIR)
    dead.wait()
    base = L.slot_offset(0)
    ns = pid_namespace()
    c.store(base + L.SLOT_PIDNS, ns)
    c.store(base + L.SLOT_START, 12345)
    c.store(base + L.SLOT_PID, dead.pid)
    owner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], cwd=WORKDIR)
    late = -1
    try:
        start = wait_for(lambda: proc_start(owner.pid))

        def successor():  # the whole registration of another process, between two loads
            assert ProcessTable(c, 1).register(owner.pid, start, ns) == 0

        late = ProcessTable(_LoadHook(c, base + L.SLOT_START, successor), 1).register(
            os.getpid(), proc_start(os.getpid()), ns
        )
        assert late is None  # the one slot is the successor's: counted beyond the table
        assert (c.load(base + L.SLOT_PID), c.load(base + L.SLOT_START)) == (owner.pid, start)
    finally:
        if late is None:
            c.fetch_add(L.BEYOND, (1 << 64) - 1)  # (the late registration's count, taken back)
        owner.kill()
        owner.wait()
        lim.close()
