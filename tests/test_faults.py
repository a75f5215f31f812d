"""Faults with real processes: stopped fillers, killed waiters, rovers wrapping, and a short soak."""
import os
import signal
import subprocess
import sys
import tempfile
import time

import pytest

import shmlimit
from test_processes import collect, go, max_excess, max_gap, start_acquirer, start_workers, tag, wait_for

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
IDLE = """
import sys, shmlimit
lim = shmlimit.attach(sys.argv[1])
print("ready", flush=True)
sys.stdin.readline()
"""


def start_idle(name):
    p = subprocess.Popen(
        [sys.executable, "-c", IDLE, name], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        cwd=tempfile.gettempdir(),
    )
    assert p.stdout.readline().strip() == "ready"
    return p


def test_stopped_filler_loses_the_lease_and_nothing_is_double_filled(name):
    rate, seconds = 500, 4.0
    lim = shmlimit.Limiter(name, rate=rate)
    cap = lim.capacity
    lim.close()
    filler = start_idle(name)  # attached first: it takes the lease and does nothing else
    wait_for(lambda: shmlimit.inspect(name).filler_pid == filler.pid)
    procs = start_workers(name, 3, seconds)
    go(procs)
    wait_for(lambda: shmlimit.inspect(name).grants >= rate // 2)
    filler.send_signal(signal.SIGSTOP)
    stopped = time.monotonic()
    def new_filler():
        pid = shmlimit.inspect(name).filler_pid
        return pid if pid not in (None, filler.pid) else None

    assert wait_for(new_filler) in {p.pid for p in procs}  # another process took over while it was stopped
    wait_for(lambda: time.monotonic() > stopped + 2.0)
    filler.send_signal(signal.SIGCONT)
    resumed = time.monotonic()
    results = collect(procs)
    stamps = sorted(t for r in results for t in r)
    filler.stdin.write("\n")
    filler.stdin.flush()
    filler.wait(30)
    # across the stop and the resume: never more than the promise, never a stall
    assert max_excess(tag(results), 1.0) <= rate + cap
    assert max_excess(tag(results), 0.1) <= rate * 0.1 + cap
    assert max_gap([t for t in stamps if t > stopped]) < 0.1
    after = [t for t in stamps if t > resumed + 0.05]
    assert (len(after) - 1) / (after[-1] - after[0]) == pytest.approx(rate, rel=0.03)


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
        wait_for(lambda: shmlimit.inspect(name).grants >= g0 + 20)  # the dead tickets held nobody up
        assert time.monotonic() - t0 < 2.0
    finally:
        for p in second:
            p.kill()
            p.wait()


@pytest.mark.parametrize("base", [(1 << 64) - 1_000_000_000, (1 << 63) - 1_000_000_000])
def test_rovers_wrapping_mid_run_change_nothing(name, base):
    """At 1000/s with 1 ns tokens, 1e9 tokens flow per second: the rovers wrap ~1 s into the run."""
    rate, seconds = 1000, 3.0
    env = dict(os.environ, SHMLIMIT_TEST_ROVER_BASE=str(base))
    subprocess.run(
        [sys.executable, "-c", f"import shmlimit; shmlimit.Limiter({name!r}, rate={rate}).close()"],
        env=env, check=True, cwd=tempfile.gettempdir(),
    )
    lim = shmlimit.attach(name)
    assert lim._att.cells.load(192) >= base - 10**8  # the tail really starts near the boundary
    cap = lim.capacity
    lim.close()
    procs = start_workers(name, 3, seconds)
    go(procs)
    results = collect(procs)
    stamps = sorted(t for r in results for t in r)
    assert max_excess(tag(results), 1.0) <= rate + cap
    assert len(stamps) == pytest.approx(rate * seconds, rel=0.03)
    assert max_gap(stamps) < 0.1


def test_short_soak_keeps_the_promise():
    r = subprocess.run(
        [sys.executable, os.path.join(ROOT, "tools", "soak.py"), "--seconds", "8", "--rate", "1000", "--seed", "7"],
        capture_output=True, text=True, timeout=120, cwd=tempfile.gettempdir(),
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "promise kept" in r.stdout and "faults:" in r.stdout
