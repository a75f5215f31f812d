"""Several rates per key (KeyedLimiter(rates=)), hammered by real processes on real shared memory."""

import textwrap

import pytest
from support.procs import collect, go, start_workers
from support.windows import max_excess, tag

import shmlimit

pytestmark = pytest.mark.slow

#: A worker: tries, timed and untimed acquires (support.procs.take_in_mode) in turn over two keys
#: for ``seconds``; prints each key's grant stamps (monotonic seconds).
WORKER = textwrap.dedent(
    """
    import json, sys, time
    import shmlimit
    sys.path.insert(0, sys.argv[3])  # the tests' folder, for support (shmlimit stays the installed one)
    from support.procs import MODES, take_in_mode
    name, seconds = sys.argv[1], float(sys.argv[2])
    lim = shmlimit.KeyedLimiter(name, rates={rates!r}, keys=64)
    print("ready", flush=True)
    sys.stdin.readline()  # go
    end = time.monotonic() + seconds
    stamps = {{"a": [], "b": []}}
    i = 0
    while True:
        key = "ab"[i % 2]
        ok = take_in_mode(lim, MODES[(i // 2) % 3], key)
        i += 1
        t = time.monotonic()
        if t > end:
            break
        if ok:
            stamps[key].append(t)
    print(json.dumps(stamps), flush=True)
    """
)


def test_every_key_holds_both_windows_under_four_processes(name):
    rates = ["20/s", "50/5s"]  # per key; the second (one op per 0.1 s) binds; bursts of one op
    lim = shmlimit.KeyedLimiter(name, rates=rates, keys=64)
    procs = []
    try:
        procs = start_workers(name, 4, 2.5, WORKER.format(rates=rates))
        go(procs)
        out = collect(procs)
        for key in "ab":
            stamps = [w[key] for w in out]
            for w in (0.05, 0.2, 1.0, 2.0):  # less one late stamp per worker (see max_excess)
                assert max_excess(tag(stamps), w) <= 20 * w + 1, (key, w)
                assert max_excess(tag(stamps), w) <= 10 * w + 1, (key, w)
        total = sum(len(w[k]) for w in out for k in "ab")
        g = {k: s.grants for k, s in lim.stats().items()}
        # every grant counted on both rates (a lost race's take is undone, or left spent: then
        # counted on the first rate only); each worker's last grant is not stamped
        assert total <= g["1"] <= total + 4 and g["1"] <= g["0"]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        lim.unlink()
        lim.close()
