#!/usr/bin/env python3
"""Soak test: workers hammer one limiter while processes are killed, stopped and restarted.

    python tools/soak.py                      # 10 minutes, 4 workers, 2000 ops/s
    python tools/soak.py --seconds 60 --rate 5000 --workers 6
    python tools/soak.py --redis redis://localhost:6379/0   # hierarchical mode: the bucket fed from Redis

Every worker is an independent interpreter that appends, for each grant, the
monotonic clock before and after its acquire() to a file of its own.  Faults,
chosen at random every 0.1-0.8 s:

* kill -9 a worker (a replacement starts at once),
* kill -9 the filler (whoever holds the lease; a replacement starts),
* SIGSTOP a worker or the filler for 0.05-2 s, then SIGCONT,
* stop a worker gracefully and start another.

At the end every grant's timestamp is checked against the promise: in any
window of length T, grants <= rate*T + capacity (T = 1 s and 0.1 s).  A grant
whose acquire() overlapped a SIGSTOP of its own process has no knowable grant
time (it was granted while the process was stopped and recorded on resume),
so it is counted but left out of the window check.  The summary gives grants,
faults by kind, the worst window overshoot (must be <= 0), and the longest
stall (the longest time without any grant).  Exit status 1 if the promise was
broken.

With ``--redis URL`` the limiter is hierarchical (its filler leases from a
RedisLimiter of the same rate and burst), and the promise checked is the
documented one for that mode: ``rate*(T + lease_ttl + d) + capacity``, with d
the 50 ms allowed for a tick and a Redis round trip.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import struct
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from typing import Dict, List, Optional, Tuple

import shmlimit

# The window check is the test suite's own, so a soak and the tests judge a run the same way.
sys.path.insert(
    0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests")
)
from support.windows import max_excess  # noqa: E402

#: Hierarchical mode (--redis): leased tokens live this long, and the bound allows this much more.
LEASE_TTL = 0.1
TICK_AND_TRIP = 0.05

WORKER = r"""
import os, struct, sys, time
import shmlimit
lim = shmlimit.attach(sys.argv[1])
fd = os.open(sys.argv[2], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
clock = time.monotonic_ns
sys.stdout.write("ready\n"); sys.stdout.flush()
while True:
    before = clock()
    lim.acquire()
    os.write(fd, struct.pack("<qq", before, clock()))
"""


class Soak:
    def __init__(
        self, rate: float, workers: int, seed: int, redis_url: Optional[str] = None
    ) -> None:
        self.rng = random.Random(seed)
        self.name = f"soak-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.slack = 0.0  # seconds of rate allowed beyond rate*T + capacity
        if redis_url:
            from shmlimit.redis.direct import RedisLimiter

            upstream = RedisLimiter(self.name, rate=rate, url=redis_url)
            self.lim = shmlimit.Limiter(self.name, upstream=upstream, lease_ttl=LEASE_TTL)
            self.slack = LEASE_TTL + TICK_AND_TRIP
        else:
            self.lim = shmlimit.Limiter(self.name, rate=rate)
        self.rate = self.lim.rate / self.lim.per
        self.capacity = self.lim.capacity
        self.lim.close()  # the soak itself takes no part
        self.dir = tempfile.mkdtemp(prefix="shmlimit-soak-")
        self.procs: Dict[int, Tuple[subprocess.Popen, str]] = {}
        self.pid_of: Dict[str, int] = {}  # worker file -> its process
        self.stops: Dict[int, List[Tuple[int, int]]] = {}
        self.faults: Counter = Counter()
        for _ in range(workers):
            self.start_worker()

    def start_worker(self) -> None:
        path = os.path.join(self.dir, f"w{len(os.listdir(self.dir))}-{uuid.uuid4().hex[:6]}.bin")
        p = subprocess.Popen(
            [sys.executable, "-c", WORKER, self.name, path],
            stdout=subprocess.PIPE,
            text=True,
            cwd=self.dir,
        )
        p.stdout.readline()  # "ready": attached
        self.procs[p.pid] = (p, path)
        self.pid_of[os.path.basename(path)] = p.pid

    def kill(self, pid: int) -> None:
        p, _ = self.procs[pid]
        p.send_signal(signal.SIGKILL)
        p.wait()
        del self.procs[pid]
        self.start_worker()

    def stop(self, pid: int, seconds: float) -> None:
        p, _ = self.procs[pid]
        t0 = time.monotonic_ns()
        p.send_signal(signal.SIGSTOP)
        time.sleep(seconds)  # the length of the fault
        p.send_signal(signal.SIGCONT)
        self.stops.setdefault(pid, []).append((t0, time.monotonic_ns()))

    def filler(self) -> int:
        pid = shmlimit.inspect(self.name).filler_pid
        return pid if pid in self.procs else self.rng.choice(list(self.procs))

    def inject(self) -> None:
        kind = self.rng.choice(
            ["kill worker", "kill filler", "stop worker", "stop filler", "restart worker"]
        )
        if kind == "kill worker":
            self.kill(self.rng.choice(list(self.procs)))
        elif kind == "kill filler":
            self.kill(self.filler())
        elif kind in ("stop worker", "stop filler"):
            pid = self.filler() if kind == "stop filler" else self.rng.choice(list(self.procs))
            self.stop(pid, self.rng.uniform(0.05, 2.0))
        else:
            pid = self.rng.choice(list(self.procs))
            p, _ = self.procs.pop(pid)
            p.terminate()
            p.wait()
            self.start_worker()
        self.faults[kind] += 1

    def finish(self) -> List[Tuple[int, int, int]]:
        """Stop every worker; every grant recorded, as (clock before acquire, clock after, pid)."""
        for p, _ in self.procs.values():
            p.kill()
            p.wait()
        grants = []
        for f in os.listdir(self.dir):
            with open(os.path.join(self.dir, f), "rb") as fh:
                data = fh.read()
            # a record cut short by a kill is dropped: it is one grant at most, never invented
            pid = self.pid_of[f]
            grants.extend(
                struct.unpack_from("<qq", data, i) + (pid,)
                for i in range(0, len(data) - len(data) % 16, 16)
            )
            os.unlink(os.path.join(self.dir, f))
        os.rmdir(self.dir)
        shmlimit.unlink(self.name)
        return grants


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=600.0, help="how long to run (default 600)")
    ap.add_argument(
        "--rate", type=float, default=2000.0, help="shared ops per second (default 2000)"
    )
    ap.add_argument(
        "--workers", type=int, default=4, help="worker processes kept running (default 4)"
    )
    ap.add_argument("--seed", type=int, default=None, help="random seed (default: from the clock)")
    ap.add_argument(
        "--redis", metavar="URL", help="hierarchical mode: lease from a RedisLimiter at this URL"
    )
    args = ap.parse_args(argv)
    seed = args.seed if args.seed is not None else time.time_ns() % 2**32
    soak = Soak(args.rate, args.workers, seed, args.redis)
    start = time.monotonic_ns()
    end = time.monotonic() + args.seconds
    while time.monotonic() < end:
        time.sleep(soak.rng.uniform(0.1, 0.8))
        soak.inject()
    grants = soak.finish()
    # a grant whose acquire overlapped a SIGSTOP of its own process may have been recorded late
    certain, uncertain = [], 0
    for before, after, pid in grants:
        if any(s < after and before < c for s, c in soak.stops.get(pid, ())):
            uncertain += 1
        else:
            certain.append((after, pid))
    certain.sort()
    all_after = sorted(g[1] for g in grants)
    # stamps in a window, less one per worker stamping in it (a grant may be stamped late), over the bound
    over_1s = max_excess(certain, 1_000_000_000) - (soak.rate * (1.0 + soak.slack) + soak.capacity)
    over_100ms = max_excess(certain, 100_000_000) - (soak.rate * (0.1 + soak.slack) + soak.capacity)
    stall = max((b - a for a, b in zip(all_after, all_after[1:])), default=0) / 1e6
    elapsed = (time.monotonic_ns() - start) / 1e9
    mode = (
        f", hierarchical via {args.redis}, bound rate*(T + {soak.slack:g} s) + capacity"
        if args.redis
        else ""
    )
    print(
        f"soak: {elapsed:.0f} s at {soak.rate:g} ops/s (capacity {soak.capacity:g}){mode}, seed {seed}"
    )
    print(
        f"  grants: {len(grants)} ({len(grants) / elapsed:.1f}/s), of which {uncertain} overlapped a SIGSTOP of their own process (not window-checked)"
    )
    print(
        f"  faults: {sum(soak.faults.values())} — "
        + ", ".join(f"{k} {v}" for k, v in sorted(soak.faults.items()))
    )
    print(
        f"  max window overshoot: {over_1s:+.1f} ops over 1 s windows, {over_100ms:+.1f} ops over 0.1 s windows "
        f"(must be <= 0; stamps taken after acquire, less one per worker stamping in the window)"
    )
    print(f"  longest stall without any grant: {stall:.1f} ms")
    ok = over_1s <= 0 and over_100ms <= 0
    print("  promise kept" if ok else "  PROMISE BROKEN: more grants than the bound")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
