"""Regression tests: every promise holds off the well-trodden paths too (unusual but valid sequences)."""

import multiprocessing as mp
import os
import random
import subprocess
import sys
import threading
import time
from fractions import Fraction

import pytest
from support.buckets import private_cells
from support.clock import FakeClock
from support.procs import WORKDIR
from support.starvation import run_delay

import shmlimit
from shmlimit.bucket.filler import FILL_PERIOD, ClockFeed
from shmlimit.bucket.rovers import Bucket, diff
from shmlimit.config import MAX_QUEUE_TOKENS, MAX_SPAN_TOKENS, NS_PER_S, Config
from shmlimit.errors import QueueFullError
from shmlimit.shm import layout as L
from shmlimit.shm.cells import native_available

FILL_PERIOD_NS = round(FILL_PERIOD * NS_PER_S)

BACKENDS = ["atomics"] + (["native"] if native_available() else [])
CONFIG_WORDS = [
    L.CFG_SEQ,
    L.CFG_RATE,
    L.CFG_PER,
    L.CFG_BURST,
    L.CFG_TPN,
    L.CFG_COST,
    L.CFG_CAP,
    L.CFG_FLAGS,
    L.CFG_RATIO,
    L.CFG_MAX_RESERVED,
    L.CFG_MAX_BEHIND,
]


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param


def words(lim):
    c = lim._att.cells
    return [c.load(off) for off in CONFIG_WORDS + [L.TAIL, L.HEAD, L.INFLIGHT, L.WAIT]]


# ---- 1. the queue depth is bounded on every path that queues ------------------------------------


def test_queue_never_wraps_past_2_63(name):
    lim = shmlimit.Limiter(name, rate=1000)
    b = lim._att.bucket
    biggest = MAX_SPAN_TOKENS // b.cost
    taken = 0
    with pytest.raises(QueueFullError, match="queue is full"):
        for _ in range(9):  # 9 * 2**60 tokens would pass 2**63
            assert lim.reserve(biggest) is not None
            taken += 1
    assert taken == 4  # 4 * 2**60 = 2**62: the fifth would pass the bound
    c = lim._att.cells
    tail = c.load(L.TAIL)
    assert 0 < diff(tail, c.load(L.HEAD)) <= MAX_QUEUE_TOKENS
    # the untimed acquire (the native grab) and the fast path refuse too, taking nothing
    with pytest.raises(QueueFullError):
        lim.acquire(biggest)
    assert c.load(L.TAIL) == tail
    assert c.grab(L.TAIL, L.HEAD, biggest * b.cost, L.UNREG_GRANTS, 1) is False
    assert c.load(L.TAIL) == tail
    # the bound grabber of each backend (the acquire fast path) refuses as well
    grab = c.grabber(
        L.CFG_SEQ, c.load(L.CFG_SEQ), L.TAIL, L.HEAD, biggest * b.cost, L.UNREG_GRANTS, 1
    )
    assert grab() is False
    assert c.load(L.TAIL) == tail
    # the limit still holds: nothing is available to anyone
    assert lim.try_acquire() is False
    assert lim.acquire(1, timeout=0.01) is False
    lim.close()


# ---- 2-4. capped mode counts ops in flight, whatever happens to the tokens ----------------------


def _acquire_in_thread(lim, n=1):
    done = threading.Event()

    def run():
        lim.acquire(n)
        done.set()

    threading.Thread(target=run, daemon=True).start()
    return done


@pytest.mark.parametrize("verb", ["stop-start", "restart"])
def test_capped_no_deadlock_after_stop_start_restart(name, verb):
    lim = shmlimit.Limiter(name, rate=1000, burst=2, capped=True)
    if verb == "restart":
        lim.restart()
    else:
        lim.stop()
        lim.start()
    assert lim.acquire(timeout=2.0)  # nothing in flight: a grant comes within the rate's time
    lim.release()
    assert _acquire_in_thread(lim).wait(5.0)
    lim.release()
    lim.close()


def test_capped_rate_down_does_not_deadlock(name):
    lim = shmlimit.Limiter(name, rate=1000, burst=2, capped=True)
    lim.set_rate(10, burst=2)
    assert _acquire_in_thread(lim).wait(5.0)
    lim.close()


def _in_flight_after_burst(lim, seconds):
    """Ops granted (never released) while trying as fast as possible for ``seconds``."""
    granted = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        granted += lim.try_acquire()
    return granted


def test_capped_rate_up_keeps_capacity_in_ops(name):
    lim = shmlimit.Limiter(
        name, rate=10, burst=2, capped=True, initial=0
    )  # 0.2 s of tokens to come
    lim.set_rate(1000, burst=2)  # ... are 200 ops now
    assert _in_flight_after_burst(lim, 0.3) == 2
    lim.close()


@pytest.mark.slow
def test_capped_with_catch_up_keeps_capacity_in_ops(name):
    lim = shmlimit.Limiter(name, rate=1000, burst=2, capped=True, ratio=3.0)
    lim.retry_after()  # a first use (taking nothing): the filler runs, and moves unused time to the pool
    deadline = time.monotonic() + 5
    while lim.stats().behind_seconds < 0.05 and time.monotonic() < deadline:
        time.sleep(0.01)  # time passes with a full bucket: the waiting pool fills
    assert lim.stats().behind_seconds >= 0.05
    assert _in_flight_after_burst(lim, 0.2) == 2
    lim.close()


def test_capped_release_beyond_in_flight_changes_nothing(name):
    lim = shmlimit.Limiter(name, rate=1000, burst=3, capped=True)
    assert lim.try_acquire(2)
    before = words(lim)
    with pytest.raises(ValueError, match="in flight"):
        lim.release(3)
    assert words(lim) == before
    lim.release(2)
    assert lim._att.bucket.in_flight() == 0
    lim.close()


# ---- 5. set_rate is validated at the segment's token unit, before anything is written ----------


@pytest.mark.parametrize("burst", [14, 250])
def test_set_rate_validated_at_the_segments_unit(name, burst):
    lim = shmlimit.Limiter(name, rate=999)
    before = words(lim)
    with pytest.raises(ValueError, match="burst"):
        lim.set_rate(1, per=86400, burst=burst)
    assert words(lim) == before  # not one word written
    other = shmlimit.attach(name)  # nobody is bricked
    assert other.rate == 999 and lim.try_acquire()
    other.close()
    lim.close()


# ---- 9. op-cost rounding is within the documented bound, at creation and after set_rate --------


def test_op_cost_error_bound_over_random_rates():
    rng = random.Random(11)
    rates = [1e9 / 3, 9.9e8, 1e9, 7e6, 1234.567, 1 / 3] + [
        10 ** rng.uniform(-3, 9) for _ in range(300)
    ]
    for first in rates:
        cfg = Config.make(first)
        for r in [first] + [10 ** rng.uniform(-3, 9) for _ in range(3)]:
            new = Config.make(r)
            if new.span_error(cfg.tpn):
                continue  # refused by set_rate (tested above)
            cost = new.cost_at(cfg.tpn)
            asked = new.ns_per_op * cfg.tpn  # tokens per op, exactly
            assert cost >= asked  # never faster
            assert (cost - asked) / asked < 1 / asked <= Fraction(1, cfg.tpn)  # slower by < 1/tpn
            if cfg.tpn >= 2**15:
                assert (cost - asked) / asked < Fraction(1, 2**15)


def test_set_rate_to_near_1e9_is_enforced_within_bound(backend):
    cells = private_cells(backend)
    clock = FakeClock()
    Bucket.initialise(cells, Config.make(1000), clock())
    b = Bucket(cells, clock)
    b.publish(Config.make(9.9e8))
    enforced = b.tpn * NS_PER_S / b.cost
    assert 9.9e8 * (1 - 2**-15) < enforced <= 9.9e8


# ---- 10. replenish clamps with the capacity in force, not a cached one ------------------------


def test_replenish_clamps_with_the_live_capacity(backend):
    cells = private_cells(backend)
    clock = FakeClock()
    Bucket.initialise(cells, Config.make(1000, burst=100), clock(), initial_ops=0)
    stale = Bucket(cells, clock)  # another process's view, cached before the change
    writer = Bucket(cells, clock)
    writer.publish(Config.make(1000, burst=5))
    clock.now += 10 * NS_PER_S
    stale.replenish()
    assert diff(cells.load(L.HEAD), cells.load(L.TAIL)) <= writer.cap


# ---- REPL_TS ahead of the clock is corrupt, not a reason to stop ------------------------------


def test_repl_ts_in_the_future_does_not_stop_replenishment(backend):
    cells = private_cells(backend)
    clock = FakeClock()
    Bucket.initialise(cells, Config.make(1000, burst=5), clock(), initial_ops=0)
    b = Bucket(cells, clock)
    cells.store(L.REPL_TS, clock() + 10**15)  # corrupt: ~11 days ahead
    assert b.replenish() == 0  # nothing granted for an unknown past
    clock.now += 2_000_000
    assert b.replenish() == 2_000_000 * b.tpn  # and time counts again from now


def test_a_limiter_whose_repl_ts_is_in_the_future_grants_again_at_its_rate(name):
    """End to end, through the facade and the fast paths: the filler's replenish repairs the word.
    On an injected clock: the filler thread is stopped and its feed ticked here at its period (1 ms),
    a caller polling ``try_acquire`` after each tick.  The first tick credits nothing for the
    unknown past, and from then on the ops come at the rate, less the clamp's documented price
    (after a full bucket is drained, up to one fill interval is lost: docs/design.md)."""
    clock = FakeClock(10**15)
    lim = shmlimit.Limiter(name, rate=100, burst=1, clock=clock)
    try:
        lim.retry_after()  # a first use (taking nothing): its filler thread starts, to be stopped here
        lim._att.filler.stop()
        lim._att.filler.join(10)
        filler = ClockFeed(lim._att.bucket, None)  # the filler's tick, run here
        lim.drain()
        lim._att.cells.store(L.REPL_TS, clock.now + 10**15)  # corrupt: ~11 days ahead
        filler.tick()
        repaired = clock.now
        assert lim._att.cells.load(L.REPL_TS) == repaired  # time counts again from now ...
        assert lim.try_acquire() is False  # ... and nothing was credited for the unknown past
        stamps = [repaired]
        while clock.now < repaired + NS_PER_S:
            clock.advance(FILL_PERIOD_NS)
            filler.tick()
            if lim.try_acquire():
                stamps.append(clock.now)
                assert lim.try_acquire() is False  # one op at a time: the capacity
        gaps = [b - a for a, b in zip(stamps, stamps[1:])]
        # replenishment never stopped: an op every 10 ms (100/s), never sooner, and at most one
        # fill interval later (the bucket of one op was drained by each grant)
        assert all(10**7 <= g <= 10**7 + FILL_PERIOD_NS for g in gaps), gaps
        assert len(gaps) >= NS_PER_S // (10**7 + FILL_PERIOD_NS)
    finally:
        lim.close()


# ---- 11. Limiter(name, rate=...) compares against the live config ------------------------------


def _set_rate_child(name, rate):
    shmlimit.attach(name).set_rate(rate)


def test_create_compares_against_the_live_config(name):
    lim = shmlimit.Limiter(name, rate=100)
    p = mp.get_context("fork").Process(target=_set_rate_child, args=(name, 200))
    p.start()
    p.join(30)
    assert p.exitcode == 0
    shmlimit.Limiter(name, rate=200).close()  # what is in force: accepted
    with pytest.raises(shmlimit.ConfigMismatchError):
        shmlimit.Limiter(name, rate=100)  # what was in force: refused
    lim.close()


def _killed_after_publishing(name, change, clock):
    lim = shmlimit.Limiter(name, clock=clock)
    Bucket.burn = lambda self, *args, **kwargs: os._exit(9)  # killed at its first burn
    lim.set_rate(10, burst=1) if change == "set_rate" else lim.stop()


@pytest.mark.parametrize("change, left", [("set_rate", 1), ("stop", 0)])
def test_a_change_whose_writer_is_killed_before_its_burn_takes_effect_at_once(name, change, left):
    """1000/s, burst 1000, full: a process killed between publishing set_rate(10, burst=1), or a
    stop, and its burn.  The others burn for it when they see the change: a smaller capacity
    takes effect at once (one op, not the 10 the old tokens buy), a stop pauses every acquirer."""
    clock = FakeClock()  # no time accrues
    lim = shmlimit.Limiter(name, rate=1000, burst=1000, clock=clock)
    p = mp.get_context("fork").Process(target=_killed_after_publishing, args=(name, change, clock))
    p.start()
    p.join(30)
    assert p.exitcode == 9
    assert lim.stopped == (change == "stop") and lim.capacity == (1000 if change == "stop" else 1)
    assert sum(lim.try_acquire() for _ in range(2000)) == left
    lim.close()


# ---- 13. rate specs in set_rate; close() while another thread is mid-call --------------------


def test_set_rate_takes_a_spec_with_a_ratio(name):
    lim = shmlimit.Limiter(name, rate=1000)
    lim.set_rate("2K,1.1")
    assert (lim.rate, lim.config.ratio) == (2000, 1.1)
    lim.set_rate("3K")  # no ratio in the spec: the current one stays
    assert (lim.rate, lim.config.ratio) == (3000, 1.1)
    with pytest.raises(ValueError, match="ratio given twice"):
        lim.set_rate("2K,1.1", ratio=1.2)
    lim.close()


# ---- 7. a config change is published to the process as one snapshot --------------------------


def test_config_snapshot_is_never_torn_by_a_thread_switch(name):
    """Switch threads at every line of the config reload: the fast path is never priced by another config."""
    lim = shmlimit.Limiter(name, rate=1000, burst=10**6, initial=10**6)
    att = lim._att
    b = att.bucket
    c = att.cells
    other = Bucket(c)
    other.publish(other.config.replace(rate=10, burst=1000))
    new_seq, new_cost = c.load(L.CFG_SEQ), other.cost
    torn = []

    def switch(frame, event, arg):
        if frame.f_code.co_name == "load_config" and event == "line":
            att.update_fast()  # what another thread (an acquire) would do right now
            tail = c.load(L.TAIL)
            if att.fast.grab() is not False and att.fast_seq == new_seq:
                if diff(c.load(L.TAIL), tail) != new_cost:
                    torn.append(diff(c.load(L.TAIL), tail))
        return switch

    sys.settrace(switch)
    try:
        b.refresh()
    finally:
        sys.settrace(None)
    assert torn == []
    lim.close()


# ---- 8. a timed acquire never overshoots its timeout by more than scheduling noise --------------


@pytest.mark.slow
def test_timed_acquire_counts_the_real_refill_speed(name):
    lim = shmlimit.Limiter(
        name, rate=100_000, burst=1
    )  # capacity 10 us: far below two fill intervals
    for _ in range(5):
        d0, t0 = run_delay(), time.monotonic()
        lim.acquire(
            400, timeout=0.01
        )  # 4 ms of schedule at the rate, ~0.8 s at the real refill speed
        elapsed, held = time.monotonic() - t0, run_delay()
        # the timeout plus an honest margin, plus the time the machine kept this process off the CPU
        assert elapsed < 0.01 + 0.1 + (held - d0 if held is not None and d0 is not None else 0.0)
    lim.close()


_CLOSE_MID_CALL = """
import sys, threading, shmlimit
name = sys.argv[1]
for _ in range(30):
    lim = shmlimit.Limiter(name, rate=1e6)
    go = threading.Event()
    def hammer():
        go.set()
        try:
            while True:
                lim.acquire(); lim.try_acquire()
        except ValueError as e:  # closed in this process: the only acceptable outcome
            assert "closed" in str(e), e
    threads = [threading.Thread(target=hammer) for _ in range(3)]
    for t in threads:
        t.start()
    go.wait()
    att = lim._att
    lim.close()  # another thread is mid-call: must neither raise nor crash
    for t in threads:
        t.join()
    assert att.closed
print("ok")
"""


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_close_while_another_thread_is_mid_call(name, backend_name):
    import os
    import subprocess

    env = dict(os.environ, SHMLIMIT_BACKEND=backend_name)
    r = subprocess.run(
        [sys.executable, "-c", _CLOSE_MID_CALL, name],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=WORKDIR,
    )
    assert r.returncode == 0 and r.stdout.strip() == "ok", (r.returncode, r.stderr[-2000:])


# ---- 12. gc never orphans a process that attaches while it looks -------------------------------


def _attach_and_hold(name, attached, done):
    lim = shmlimit.attach(name)
    attached.set()
    done.wait(60)
    lim.close()


def test_gc_keeps_a_segment_a_process_attached_to_meanwhile(name, monkeypatch, capsys):
    from shmlimit import kinds
    from shmlimit.cli import main as cli
    from shmlimit.shm.segment import current_inode

    shmlimit.Limiter(name, rate=100).close()  # a stale segment: nobody attached
    inode = current_inode(name)
    ctx = mp.get_context("fork")
    attached, done = ctx.Event(), ctx.Event()
    child = ctx.Process(target=_attach_and_hold, args=(name, attached, done))
    real_inspect = kinds.inspect

    def inspect_then_attach(n):
        stats = real_inspect(n)  # gc has looked: no live process ...
        if n == name:
            child.start()  # ... and now one attaches, before gc acts on what it saw
            assert attached.wait(30)
        return stats

    monkeypatch.setattr(kinds, "inspect", inspect_then_attach)  # what gc's inspect_each looks at
    monkeypatch.setattr(
        cli, "scan", lambda: ([name], [])
    )  # leave every other segment on the machine alone
    monkeypatch.setattr(cli, "orphan_secrets", lambda: [])  # and every secret file
    try:
        cli.main(["gc"])
        assert current_inode(name) == inode  # still the segment the child uses: nothing orphaned
    finally:
        done.set()
        child.join(30)
    assert child.exitcode == 0
    capsys.readouterr()


COLLECT = "import sys; from shmlimit.attachment import collect; print(collect(sys.argv[1]))"
INODE = "import sys, shmlimit; lim = shmlimit.attach(sys.argv[1]); print(lim._att.seg.inode); lim.close()"


def test_gc_between_a_creators_ready_and_its_registration_orphans_nothing(name, monkeypatch):
    # The creator has published READY and is not yet registered: a collector (another process) finds
    # nobody attached and unlinks the segment.  The creator sees the collector's claim once it has
    # registered, and opens the name again (a new segment): it never keeps one nobody else can open.
    import subprocess

    from shmlimit.attachment import Attachment
    from shmlimit.shm.segment import current_inode

    join = Attachment.join
    collected = []

    def collector_in_the_gap(att):
        if (
            not collected
        ):  # the creator's first registration: READY is published, no one is registered
            assert att.cells.load(L.STATE_OFF) == L.STATE_READY and not att.table.entries()
            r = subprocess.run(
                [sys.executable, "-c", COLLECT, name],
                capture_output=True,
                text=True,
                cwd=WORKDIR,
                timeout=60,
            )
            collected.append(r.stdout.strip())
        join(att)

    monkeypatch.setattr(Attachment, "join", collector_in_the_gap)
    lim = shmlimit.Limiter(name, rate=100)
    try:
        assert collected == ["True"]  # the collector did unlink the segment in the gap
        assert (
            current_inode(name) == lim._att.seg.inode
        )  # the creator holds the segment at the name ...
        r = subprocess.run(
            [sys.executable, "-c", INODE, name],
            capture_output=True,
            text=True,
            cwd=WORKDIR,
            timeout=60,
        )
        assert r.stdout.strip() == str(lim._att.seg.inode), r.stderr[
            -2000:
        ]  # ... the one others attach to
        assert [e.pid for e in lim._att.table.entries()] == [os.getpid()]
    finally:
        lim.close()


def test_gc_removes_a_stale_segment(name, capsys, monkeypatch):
    from shmlimit.cli import main as cli
    from shmlimit.shm.segment import current_inode

    monkeypatch.setattr(cli, "scan", lambda: ([name], []))
    monkeypatch.setattr(cli, "orphan_secrets", lambda: [])  # another run's are not this test's
    shmlimit.Limiter(name, rate=100).close()
    cli.main(["gc"])
    assert current_inode(name) is None
    assert f"removed: {name}" in capsys.readouterr().out


# ---- 6. a stalled config writer that resumes after being taken over publishes nothing -----------


@pytest.mark.parametrize("stall_at", range(0, 40, 3))
def test_stalled_config_writer_cannot_corrupt_the_config(backend, monkeypatch, stall_at):
    import shmlimit.shm.banks as config_banks

    monkeypatch.setattr(config_banks, "CONFIG_LOCK_TIMEOUT_NS", 1_000_000)  # take over after 1 ms
    cells = private_cells(backend)
    clock = FakeClock()
    Bucket.initialise(cells, Config.make(1000), clock())
    stalled, other = Bucket(cells, clock), Bucket(cells, clock)
    winner = Config.make(10)
    lines = [0]

    def stall(frame, event, arg):
        if frame.f_code.co_name == "write_banks" and event == "line":
            lines[0] += 1
            if (
                lines[0] == stall_at + 1
            ):  # the writer stops here for longer than the lock's timeout ...
                sys.settrace(None)
                other.publish(winner)  # ... and another writer takes over and publishes
        return stall

    sys.settrace(stall)
    try:
        stalled.publish(Config.make(1000, burst=50))  # ... then the stalled one resumes
    except shmlimit.ShmlimitError:
        pass  # refused: the right outcome for a writer that was taken over
    finally:
        sys.settrace(None)
    if lines[0] <= stall_at:
        return  # the writer finished before the stall point: nothing to test
    fresh = Bucket(cells, clock)
    assert fresh.config == winner
    assert (fresh.cost, fresh.cap) == (winner.cost_at(fresh.tpn), winner.cap_at(fresh.tpn))
    assert cells.load(L.CFG_SEQ) % 2 == 0


# ---- a head moved back behind a queued ticket: refused, not waited for without end ---------------

_HEAD_MOVED_BACK = """
import os, sys, threading, time
import shmlimit
from shmlimit.shm import layout as L

name, back, rates = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "rates"
path = "/dev/shm/shmlimit." + name
if rates:  # the first rate binds: its head is moved
    lim = shmlimit.Limiter(name, rates="10/second;50000/minute")
else:
    lim = shmlimit.Limiter(name, rate=10, burst=1)
fd = os.open(path, os.O_RDWR)
base = int.from_bytes(os.pread(fd, 8, L.GROUP_FIRST), "little") if rates else 0
while lim.try_acquire():
    pass  # empty: the next acquire queues

def word(off):
    return int.from_bytes(os.pread(fd, 8, base + off), "little")

got = []
t = threading.Thread(target=lambda: got.append(_acquire()), daemon=True)

def _acquire():
    try:
        return lim.acquire(timeout=1)
    except shmlimit.SegmentError as e:
        return e

t.start()
end = time.monotonic() + 10
while (word(L.TAIL) - word(L.HEAD)) % 2**64 == 0 and time.monotonic() < end:
    time.sleep(0.001)  # until the ticket is queued (the tail passed the head)
head = word(L.HEAD)
os.pwrite(fd, ((head - back) % 2**64).to_bytes(8, "little"), base + L.HEAD)  # another writer's word
t.join(10)
print("waiting" if t.is_alive() else repr(got[0]))
os._exit(0)
"""


# 2**40 tokens are 17 ms at this rate's unit (tpn 65536): a delay within the timeout, served; 2**61
# are 10 hours, and 3 * 2**61 more than any queue holds
@pytest.mark.parametrize(
    "back, served",
    [(2**40, True), (2**61, False), (3 * 2**61, False)],
    ids=["17ms", "10h", "beyond"],
)
@pytest.mark.parametrize("rates", ["rate", "rates"], ids=["one rate", "several rates"])
@pytest.mark.parametrize("backend_name", BACKENDS)
def test_a_timed_acquire_whose_head_is_moved_back_is_refused_not_waited_for(
    name, backend_name, rates, back, served
):
    env = dict(os.environ, SHMLIMIT_BACKEND=backend_name)
    r = subprocess.run(
        [sys.executable, "-c", _HEAD_MOVED_BACK, name, str(back), rates],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=WORKDIR,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    if served:
        assert r.stdout.strip() == "True", r.stdout
    else:
        assert "SegmentError" in r.stdout and "tokens short of a ticket" in r.stdout, r.stdout
        assert repr(name) in r.stdout or repr(name + "[0]") in r.stdout, r.stdout
