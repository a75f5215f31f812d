"""Several rates at once, hammered by real processes on real shared memory."""

import json
import subprocess
import sys
import textwrap

import pytest
from support.procs import WORKDIR, collect_witnessed, go, start_workers
from support.starvation import floor
from support.windows import max_excess, tag

import shmlimit

pytestmark = pytest.mark.slow

#: A worker: ``mode`` (support.procs.take_in_mode's) acquires with ``costs`` for ``seconds``, settling
#: ``settle`` after each grant; prints its grant stamps (monotonic seconds), then how long the
#: machine kept it off the CPU meanwhile (the starvation witness).
WORKER = textwrap.dedent(
    """
    import json, sys, time
    import shmlimit
    sys.path.insert(0, sys.argv[3])  # the tests' folder, for support (shmlimit stays the installed one)
    from support.procs import take_in_mode
    from support.starvation import run_delay
    name, seconds = sys.argv[1], float(sys.argv[2])
    rates, mode, costs, settle = json.loads({spec!r})
    if isinstance(rates, list):
        rates = [tuple(r) if isinstance(r, list) else r for r in rates]
    else:
        rates = {{k: tuple(v) if isinstance(v, list) else v for k, v in rates.items()}}
    lim = shmlimit.Limiter(name, rates=rates)
    print("ready", flush=True)
    sys.stdin.readline()  # go
    delay0 = run_delay()
    end = time.monotonic() + seconds
    stamps = []
    while True:
        ok = take_in_mode(lim, mode, **costs)
        t = time.monotonic()
        if t > end:
            break
        if ok:
            stamps.append(t)
            if settle:
                lim.settle(**settle)
    delay1 = run_delay()
    print(json.dumps(stamps), flush=True)
    print(json.dumps(None if delay0 is None or delay1 is None else delay1 - delay0), flush=True)
    """
)


def run(name, rates, seconds, modes, costs=None, settle=None):
    """One worker per entry of ``modes``; each one's grant stamps."""
    return run_witnessed(name, rates, seconds, modes, costs, settle)[0]


def run_witnessed(name, rates, seconds, modes, costs=None, settle=None):
    """One worker per entry of ``modes``; each one's grant stamps, and the seconds the machine
    kept it off the CPU meanwhile (support.starvation)."""
    procs = []
    try:
        for mode in modes:
            script = WORKER.format(spec=json.dumps([rates, mode, costs or {}, settle or {}]))
            procs += start_workers(name, 1, seconds, script)
        go(procs)
        return collect_witnessed(procs)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()


def check_bound(stamps, ops_per_s, capacity, widths):
    """In every window of each width, grants (less one late stamp per worker) <= rate*T + capacity."""
    for w in widths:
        assert max_excess(tag(stamps), w) <= ops_per_s * w + capacity, f"window {w} s"


def test_two_windows_hold_both_bounds_under_four_processes(name):
    rates = ["20/s", "50/5s"]  # the second (10/s) binds
    lim = shmlimit.Limiter(name, rates=rates)
    try:
        stamps, delays = run_witnessed(name, rates, 3.0, ["untimed"] * 4)
        total = sum(map(len, stamps))
        check_bound(stamps, 20, 1, (0.05, 0.2, 1.0, 2.0))
        check_bound(stamps, 10, 1, (0.05, 0.2, 1.0, 2.5))
        assert total <= 31  # ~10/s for 3 s, plus the one op the bucket starts with
        # ... and no fewer but for what the machine withheld (support.starvation): the binding rate's
        # starved time and the time none of the workers ran, ~0 on a quiet machine
        assert total >= floor(0.75 * 30, 10, lim.stats().rates["1"].starved_seconds, delays)
        g = lim.stats().grants
        assert (
            g["0"] == g["1"] and total <= g["0"] <= total + 4
        )  # each worker's last grant is not stamped
    finally:
        lim.unlink()
        lim.close()


def test_requests_and_tokens_bind_on_tokens(name):
    rates = {"requests": "100/s", "tokens": ["1000/s", 50]}
    lim = shmlimit.Limiter(name, rates={"requests": "100/s", "tokens": ("1000/s", 50)})
    try:
        stamps, delays = run_witnessed(
            name, rates, 2.5, ["untimed"] * 3, costs={"requests": 1, "tokens": 50}
        )
        calls = sum(map(len, stamps))
        assert calls <= 50 + 1  # 1000 tokens/s at 50 a call: ~20 calls/s, not 100
        # ... and no fewer but for what the machine withheld (support.starvation)
        assert calls >= floor(0.75 * 50, 20, lim.stats().rates["tokens"].starved_seconds, delays)
        check_bound(stamps, 20, 1, (0.1, 0.5, 1.0))
    finally:
        lim.unlink()
        lim.close()


def test_refunds_let_more_calls_through(name):
    """Estimates of 500 tokens at 1000 tokens/s: 2 calls/s; settled to 100 each: ~10 calls/s."""
    rates = {"tokens": ["1000/s", 500]}
    lim = shmlimit.Limiter(name, rates={"tokens": ("1000/s", 500)})
    try:
        plain = sum(map(len, run(name, rates, 2.0, ["untimed"] * 2, costs={"tokens": 500})))
        lim.settle(tokens=-500)  # start the second phase from a full bucket too
        starved0 = lim.stats().rates["tokens"].starved_seconds
        settled, delays = run_witnessed(
            name, rates, 2.0, ["untimed"] * 2, costs={"tokens": 500}, settle={"tokens": -400}
        )
        starved = lim.stats().rates["tokens"].starved_seconds - starved0
        calls = sum(map(len, settled))
        assert plain <= 2 * 2 + 1
        assert calls >= floor(
            0.7 * 20, 10, starved, delays
        )  # ~10 calls/s, but for what the machine withheld
        # net usage (100 a call) never exceeds the rate: 1000*T + 500 tokens in any window
        check_bound(settled, 10, 5, (0.2, 0.5, 1.0))
    finally:
        lim.unlink()
        lim.close()


SETTLER = """
import sys, shmlimit
lim = shmlimit.Limiter(sys.argv[1], rates={"requests": "10/s", "tokens": ("1000/min", 1000)})
lim.settle(tokens=int(sys.argv[2]))
"""


def test_a_charge_from_another_process_delays_the_next_callers(name):
    lim = shmlimit.Limiter(name, rates={"requests": "10/s", "tokens": ("1000/min", 1000)})
    try:
        assert lim.acquire(requests=1, tokens=1000, timeout=0)
        subprocess.run(
            [sys.executable, "-c", SETTLER, name, "600"], cwd=WORKDIR, check=True, timeout=60
        )
        # 600 tokens of debt, then 100 of its own: 42 s at 1000/min, less the time since the take
        assert 42 - 15 <= lim.retry_after(tokens=100) <= 42.001
        assert not lim.acquire(tokens=100, timeout=5)  # fails at once, taking nothing
        subprocess.run(
            [sys.executable, "-c", SETTLER, name, "-1000"], cwd=WORKDIR, check=True, timeout=60
        )
        assert lim.retry_after(tokens=100) <= 0.1  # the refund paid the debt off
    finally:
        lim.unlink()
        lim.close()


def test_mixed_try_timed_and_untimed_callers_never_over_grant_any_rate(name):
    rates = {"a": ["20/s", 2], "b": ["50/5s", 1]}
    lim = shmlimit.Limiter(name, rates={"a": ("20/s", 2), "b": ("50/5s", 1)})
    try:
        stamps, delays = run_witnessed(
            name, rates, 2.5, ["try", "timed", "untimed", "untimed"], costs={"a": 1, "b": 1}
        )
        check_bound(stamps, 20, 2, (0.05, 0.2, 1.0))
        check_bound(stamps, 10, 1, (0.05, 0.2, 1.0, 2.0))
        # no fewer but for what the machine withheld (support.starvation)
        assert sum(map(len, stamps)) >= floor(
            0.75 * 25, 10, lim.stats().rates["b"].starved_seconds, delays
        )
    finally:
        lim.unlink()
        lim.close()
