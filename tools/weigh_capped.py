#!/usr/bin/env python3
"""Capped mode against what a user would write instead: a plain limiter plus a semaphore.

    python tools/weigh_capped.py

A capacity of 4 ops in flight (``burst=4``) at 1 000 ops/s, so the rate never binds:

1. the cap across processes: 4 processes each take ops while their side of the cap lets them
   (``try_acquire`` in capped mode; a plain ``try_acquire`` behind a per-process
   ``threading.Semaphore(4)``), none released; the ops in flight together;
2. a holder killed: 4 processes each hold one op, one is SIGKILLed (the one running the filler,
   then another), and the parent asks for one
   more (capped mode: ``acquire``; a plain limiter behind a ``multiprocessing.BoundedSemaphore(4)``
   inherited by every process: the semaphore first, then ``acquire``); how long until it is
   granted (never, within 3 s, counts as lost), then whether a second op is refused (the 3 live
   holders and the parent's fill the cap).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time
import uuid

import shmlimit

CAP = 4
RATE = 1000.0
ctx = mp.get_context("fork")


def _fill_capped(name: str, q) -> None:
    lim = shmlimit.attach(name)
    n = 0
    while lim.try_acquire():  # capped: refused once the ops in flight reach the capacity
        n += 1
    q.put(n)


def _fill_thread_sem(name: str, q) -> None:
    lim = shmlimit.attach(name)
    sem = threading.Semaphore(CAP)  # this process's own cap
    n = 0
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline and sem.acquire(blocking=False):
        if not lim.acquire(timeout=0.5):
            break
        n += 1
    q.put(n)


def cap_across_processes() -> dict:
    out = {}
    for label, target, capped in (
        ("capped=True", _fill_capped, True),
        ("plain + threading.Semaphore per process", _fill_thread_sem, False),
    ):
        name = f"weigh-{uuid.uuid4().hex[:8]}"
        lim = shmlimit.Limiter(name, rate=RATE, burst=CAP, capped=capped)
        lim.close()
        q = ctx.Queue()
        procs = [ctx.Process(target=target, args=(name, q)) for _ in range(4)]
        for p in procs:
            p.start()
        total = sum(q.get(timeout=30) for _ in procs)
        for p in procs:
            p.join()
        shmlimit.unlink(name)
        out[label] = total
    return out


def _hold_capped(name: str, ready) -> None:
    lim = shmlimit.attach(name)
    assert lim.acquire(timeout=5)
    ready.put(os.getpid())
    time.sleep(60)


def _hold_sem(name: str, sem, ready) -> None:
    lim = shmlimit.attach(name)
    assert sem.acquire(timeout=5) and lim.acquire(timeout=5)
    ready.put(os.getpid())
    time.sleep(60)


def holder_killed(capped: bool, filler: bool) -> dict:
    name = f"weigh-{uuid.uuid4().hex[:8]}"
    lim = shmlimit.Limiter(name, rate=RATE, burst=CAP, capped=capped)
    sem = None if capped else ctx.BoundedSemaphore(CAP)
    ready = ctx.Queue()
    procs = [
        ctx.Process(
            target=_hold_capped if capped else _hold_sem,
            args=(name, ready) if capped else (name, sem, ready),
        )
        for _ in range(CAP)
    ]
    for p in procs:
        p.start()
    for _ in procs:
        ready.get(timeout=30)
    # the holder killed: the one running the filler (elected), or another
    pid = None
    deadline = time.monotonic() + 5
    while pid is None and time.monotonic() < deadline:
        pid = shmlimit.inspect(name).filler_pid
    victim = next(p for p in procs if (p.pid == pid) == filler)
    os.kill(victim.pid, signal.SIGKILL)
    victim.join()

    def one(timeout: float) -> bool:
        if capped:
            return lim.acquire(timeout=timeout)
        return sem.acquire(timeout=timeout) and lim.acquire(timeout=timeout)

    t0 = time.monotonic()
    got = one(3.0)
    waited = time.monotonic() - t0
    second = one(0.5)  # must be refused: 3 live holders and ours fill the cap
    for p in procs:
        if p is victim:
            continue
        os.kill(p.pid, signal.SIGKILL)
        p.join()
    lim.close()
    lim.unlink()
    return dict(granted=got, waited_s=round(waited, 3), second_refused=not second)


def main() -> int:
    print(f"shmlimit capped mode against a plain limiter plus a semaphore (capacity {CAP} ops)")
    print("1. ops in flight together, 4 processes each taking what its side of the cap allows:")
    for label, total in cap_across_processes().items():
        print(f"   {label:42} {total:3d}  (cap {CAP})")
    print("2. one of 4 holders SIGKILLed, then one more op asked for (3 s at most):")
    for label, capped in (("capped=True", True), ("plain + multiprocessing semaphore", False)):
        for filler in (False, True):
            r = holder_killed(capped, filler)
            who = "the filler's" if filler else "another"
            when = (
                f"granted after {r['waited_s'] * 1000:.0f} ms" if r["granted"] else "never (lost)"
            )
            print(f"   {label:34} {who:13} {when}; a second op refused: {r['second_refused']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
