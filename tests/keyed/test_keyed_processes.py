"""KeyedLimiter across real processes: the per-key window bound (fork and spawn), churn through
20x more keys than slots, overrides seen everywhere and surviving eviction, and inserters
SIGKILLed midway."""

import multiprocessing as mp
import os
import random
import signal
import time

import pytest
from support.procs import kill_all, read_exactly, run_processes

import shmlimit
from shmlimit.keyed import layout as K

RATE, BURST, KEYS, WORKERS, SECONDS = 20.0, 2, 200, 4, 1.0


def hammer(lim, seed, seconds, calls=400, nkeys=KEYS):
    """try_acquire / timed acquire on random keys for ``seconds`` and at least ``calls`` calls
    (a loaded machine or the slow backend still covers the keys); (key, before, after) per grant."""
    rnd = random.Random(seed)
    out = []
    end = time.monotonic() + seconds
    done = 0
    while time.monotonic() < end or done < calls:
        done += 1
        key = f"client-{rnd.randrange(nkeys)}"
        before = time.monotonic()
        ok = lim.try_acquire(key) if rnd.random() < 0.8 else lim.acquire(key, timeout=0.02)
        if ok:
            out.append((key, before, time.monotonic()))
    return out


def check_window_bound(grants, rate, burst):
    """Per key: any run of grants (sorted by start) spans at least (count - burst) / rate.

    Each grant happened at an instant inside [before, after], so a run of them
    spanned at most max(after) - min(before): if the limiter is correct,
    count <= rate * that + burst can never fail, however processes were scheduled.
    """
    by_key = {}
    for key, b, a in grants:
        by_key.setdefault(key, []).append((b, a))
    worst = 0.0
    for key, stamps in by_key.items():
        stamps.sort()
        for i in range(len(stamps)):
            hi = stamps[i][1]
            for j in range(i, len(stamps)):
                hi = max(hi, stamps[j][1])
                allowed = rate * (hi - stamps[i][0]) + burst
                worst = max(worst, (j - i + 1) - allowed)
                assert j - i + 1 <= allowed + 1e-9, (
                    f"{key}: {j - i + 1} grants within {hi - stamps[i][0]:.4f} s"
                )
    return by_key


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_per_key_window_bound_across_processes(name, method):
    lim = shmlimit.KeyedLimiter(name, rate=RATE, burst=BURST, keys=4 * KEYS)
    ctx = mp.get_context(method)
    with ctx.Pool(WORKERS) as pool:
        results = pool.starmap(hammer, [(lim, seed, SECONDS) for seed in range(WORKERS)])
    grants = [g for r in results for g in r]
    by_key = check_window_bound(grants, RATE, BURST)
    assert len(by_key) >= KEYS // 2  # keys were served ...
    per_key = [len(v) for v in by_key.values()]
    assert max(per_key) >= BURST + 2  # ... some beyond their burst (the limit is a rate, not a cap)
    assert sum(per_key) <= KEYS * (RATE * (SECONDS + 5) + BURST)  # pool start-up included, loosely
    assert lim.stats().grants >= len(grants)
    lim.close()


def test_per_key_window_bound_while_keys_are_evicted_and_reused(name):
    """50 000 keys through 64 slots: each key is used less often than its rate, so slots change
    tenant all the time -- and no key, evicted or not, ever gets more than its rate."""
    lim = shmlimit.KeyedLimiter(name, rate=50, burst=1, keys=64, when_full="refuse")
    ctx = mp.get_context("fork")
    with ctx.Pool(WORKERS) as pool:
        results = pool.starmap(
            hammer, [(lim, seed, SECONDS, 400, 50_000) for seed in range(WORKERS)]
        )
    check_window_bound([g for r in results for g in r], 50, 1)
    assert lim.stats().evicted > 64  # tenants did change
    lim.close()


def churn(name, start, count):
    lim = shmlimit.attach(name)
    return [lim.try_acquire(f"k{i}") for i in range(start, start + count)]


def test_churn_fast_rate_admits_every_new_key(name):
    slots = 64
    lim = shmlimit.KeyedLimiter(
        name, rate=1_000_000, keys=slots
    )  # a key is idle again 1 us after use
    ctx = mp.get_context("fork")
    with ctx.Pool(2) as pool:
        results = pool.starmap(churn, [(name, 0, 10 * slots), (name, 10 * slots, 10 * slots)])
    assert all(r for res in results for r in res)  # 20x more keys than slots, all admitted
    s = lim.stats()
    assert s.refused_full == 0 and s.evicted >= 20 * slots - slots and s.grants == 20 * slots
    lim.close()


def test_churn_slow_rate_never_resets_a_limited_key(name):
    slots = 64
    lim = shmlimit.KeyedLimiter(name, rate=1, per=3600, burst=1, keys=slots, when_full="refuse")
    answers = churn(name, 0, 20 * slots)
    admitted = [i for i, ok in enumerate(answers) if ok]
    refused = len(answers) - len(admitted)
    assert slots // 2 <= len(admitted) <= slots and refused >= 19 * slots
    s = lim.stats()
    assert s.refused_full == refused and s.evicted == 0 and s.keys == len(admitted)
    # from another process: every admitted key is still limited, none was reset
    ctx = mp.get_context("spawn")
    with ctx.Pool(1) as pool:
        again = pool.apply(_try_keys, (name, [f"k{i}" for i in admitted]))
    assert not any(again)
    with pytest.raises(shmlimit.KeyTableFullError):
        lim.acquire(f"k{admitted[-1] + 10_000}")
    lim.close()


def _try_keys(name, keys):
    lim = shmlimit.attach(name)
    return [lim.try_acquire(k) for k in keys]


def _override_then_report(name):
    lim = shmlimit.attach(name)
    before = (lim.override("vip"), lim.try_acquire("vip", 5))
    lim.set_rate(1, per=3600, burst=1, key="slow")
    return before


@pytest.mark.slow
def test_overrides_live_across_processes_and_eviction(name):
    lim = shmlimit.KeyedLimiter(name, rate=1_000_000, burst=1, keys=32)
    lim.set_rate(10, per=1, burst=5, key="vip")
    ctx = mp.get_context("spawn")
    with ctx.Pool(1) as pool:
        seen = pool.apply(_override_then_report, (name,))
    assert seen == ((10.0, 1.0, 5.0), True)  # the child saw the parent's override at once
    assert lim.override("slow") == (1.0, 3600.0, 1.0)  # and the parent the child's
    assert lim.try_acquire("slow") and not lim.try_acquire("slow")
    # churn 20x the table through: "vip" (idle again by now) is evicted, its override is not
    time.sleep(0.5)
    assert all(churn(name, 0, 20 * 32))
    assert lim.stats().evicted >= 19 * 32
    assert [lim.try_acquire("vip") for _ in range(6)] == [True] * 5 + [False]
    assert not lim.try_acquire("slow")  # limited for an hour: never evicted, still limited
    assert lim.remove_override("vip")
    lim.close()


def _insert_forever(name, seed, started):
    _worker_inserting_forever(shmlimit.attach(name), seed, started)


@pytest.mark.slow  # where a kill lands is the machine's timing: a busy one may need more rounds
def test_inserters_killed_midway_leave_no_slot_stuck(name):
    slots = 32
    lim = shmlimit.KeyedLimiter(name, rate=1_000_000, keys=slots)
    ctx = mp.get_context("fork")
    rnd = random.Random(7)
    left_midway = 0
    for round in range(300):
        if round >= 30 and left_midway >= 1:  # (30 rounds leave about six on an idle machine)
            break
        started = ctx.Event()
        p = ctx.Process(target=_insert_forever, args=(name, round, started))
        p.start()
        assert started.wait(60)
        time.sleep(rnd.uniform(0.001, 0.02))
        os.kill(p.pid, signal.SIGKILL)
        p.join()
        left_midway += sum(s in (K.BUSY, K.PEND) for s in _slot_states(name, slots))
    assert left_midway >= 1  # some deaths did land inside an insert (about one in five on native)
    # whatever each death left (a slot BUSY or PEND under a dead pid) is reclaimed by inserters
    assert all(churn(name, 0, 50 * slots))
    states = _slot_states(name, slots)
    assert set(states) <= {K.LIVE, K.TOMB}, states
    assert lim.stats().refused_full == 0
    lim.close()


def _slot_states(name, slots):
    with open(f"/dev/shm/shmlimit.{name}", "rb") as f:
        data = f.read()
    base = K.slots_offset(K.default_overrides(slots))
    return [data[base + i * K.LINE] for i in range(slots)]


def _race(name, keys, barrier, q):
    lim = shmlimit.attach(name)
    barrier.wait(timeout=60)
    q.put([lim.try_acquire(k) for k in keys])


def test_concurrent_first_uses_of_the_same_keys_insert_each_once(name):
    """4 processes insert the same 300 new keys at once: each key is granted once and holds one slot."""
    lim = shmlimit.KeyedLimiter(name, rate=1, per=3600, burst=1, keys=1024)
    keys = [f"same-{i}" for i in range(300)]
    ctx = mp.get_context("fork")
    barrier = ctx.Barrier(WORKERS)
    results = run_processes(ctx, _race, [(name, keys, barrier)] * WORKERS)
    per_key = [sum(r[i] for r in results) for i in range(len(keys))]
    assert per_key == [1] * len(keys)  # one grant per key: never two slots, never two full buckets
    states = _slot_states(name, 1024)
    assert states.count(K.LIVE) == len(keys) == lim.stats().keys
    lim.close()


# ---- a pre-fork server: the master opens, forked workers use the inherited handle ----------------


def _listed(name):
    return {p.pid: p.alive for p in shmlimit.inspect(name).processes}


def _worker_inserting_forever(lim, tag, started):
    """A worker that uses the handle its master opened (inherited by fork, never re-opened)."""
    lim.try_acquire(f"{tag}-first")
    started.set()
    i = 0
    while True:
        lim.try_acquire(f"{tag}-{i}")
        i += 1


def _worker_churning(lim, go, done, q, count):
    go.wait(120)
    q.put((os.getpid(), sum(lim.try_acquire(f"survivor-{os.getpid()}-{i}") for i in range(count))))
    done.wait(120)  # still attached while the master looks


@pytest.mark.slow  # where a kill lands is the machine's timing
def test_prefork_workers_register_on_first_use_and_one_killed_mid_insert_stalls_nobody(name):
    slots = 32
    lim = shmlimit.KeyedLimiter(name, rate=1_000_000, keys=slots)  # the master: opens, never uses
    ctx = mp.get_context("fork")
    # the survivors insert one after the other: two live inserters at once may see each other's
    # fresh keys as live through a clock read before a preemption, and refuse rightly; what is
    # looked for here is a slot held by a dead one
    gos, done, q = [ctx.Event(), ctx.Event()], ctx.Event(), ctx.Queue()
    survivors = [
        ctx.Process(target=_worker_churning, args=(lim, go, done, q, 50 * slots)) for go in gos
    ]
    victims = []
    try:
        for p in survivors:
            p.start()
        assert _listed(name) == {
            os.getpid(): True
        }  # forked workers that have not used it are not listed
        rnd = random.Random(16)
        left_midway = 0
        for round in range(300):
            if round >= 30 and left_midway >= 1:  # a busy machine's timing may need more rounds
                break
            started = ctx.Event()
            p = ctx.Process(target=_worker_inserting_forever, args=(lim, round, started))
            victims.append(p)
            p.start()
            assert started.wait(60)
            assert _listed(name).get(p.pid) is True  # its first use registered it
            time.sleep(
                rnd.uniform(0.001, 0.02)
            )  # a random moment of its inserts, not a synchronisation
            os.kill(p.pid, signal.SIGKILL)
            p.join()
            left_midway += sum(s in (K.BUSY, K.PEND) for s in _slot_states(name, slots))
        # some deaths landed inside an insert, leaving a slot BUSY or PEND: under the dead child's
        # pid, never the master's (alive), which would hold the slot for as long as the master runs
        assert left_midway >= 1
        listed = _listed(name)
        assert all(
            listed[p.pid] is False for p in victims
        )  # tracked: each killed worker shows dead
        results = {}
        for go in gos:
            go.set()
            results.update([q.get(timeout=120)])
        # nobody stalled: every new key of both survivors was granted, reclaiming what the dead left
        assert results == {p.pid: 50 * slots for p in survivors}
        assert set(_slot_states(name, slots)) <= {K.LIVE, K.TOMB}
        assert lim.stats().refused_full == 0
        assert all(_listed(name)[p.pid] for p in survivors)
    finally:
        done.set()
        for p in survivors + victims:
            if p.is_alive():
                p.kill()
            p.join()
    lim.close()


def test_forked_children_that_leave_unused_leave_no_entry_and_observing_is_not_using(name):
    lim = shmlimit.KeyedLimiter(name, rate=100, keys=64)
    pids = []
    for _ in range(3):  # Celery's pool children leave with os._exit: no exit hook runs
        pid = os.fork()
        if pid == 0:
            code = 0 if lim.stats().keys == 0 and lim.override("x") is None else 1
            os._exit(code)
        pids.append(pid)
    for pid in pids:
        assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
    assert _listed(name) == {os.getpid(): True}
    lim.close()


def test_a_killed_workers_slot_is_reaped_by_the_next_worker_when_the_table_is_full(name):
    """Every one of the 128 process slots held (the master and 127 forked workers, each registered by
    its first use): one worker is SIGKILLed, and the next worker's first use reclaims its slot."""
    lim = shmlimit.KeyedLimiter(name, rate=1000, keys=1024)
    r_end, w_end = os.pipe()
    r_up, w_up = os.pipe()

    def fork_worker():
        pid = os.fork()
        if pid == 0:
            try:
                assert lim.acquire(f"worker-{os.getpid()}")  # a new key: granted
                os.write(w_up, b"1")
                os.read(r_end, 1)
            finally:
                os._exit(0)
        return pid

    pids = []
    try:
        for _ in range(K.PSLOTS - 1):
            pids.append(fork_worker())
        read_exactly(r_up, K.PSLOTS - 1)
        assert len(_listed(name)) == K.PSLOTS and all(_listed(name).values())
        os.kill(pids[0], signal.SIGKILL)
        os.waitpid(pids[0], 0)
        assert _listed(name)[pids[0]] is False  # tracked: listed dead, its slot still taken
        pids.append(fork_worker())
        read_exactly(r_up, 1)
        listed = _listed(name)
        # reaped: the newcomer registered in the dead worker's slot (no other was free)
        assert pids[0] not in listed and listed[pids[-1]] is True and len(listed) == K.PSLOTS
        assert lim.stats().grants == K.PSLOTS  # the dead worker's grant stays in the total
    finally:
        os.write(w_end, b"x" * len(pids))
        kill_all(pids)
        for fd in (r_end, w_end, r_up, w_up):
            os.close(fd)
        lim.close()
