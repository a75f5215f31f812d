"""The fed wait: hierarchical mode's waiters asleep on ``UP_WAKE``, woken across processes by the batch
that covers their tickets.  Asserted by counts (who was woken, how often a waiter slept), never by
how long anything took; both backends (CI runs this file under each).
"""

import subprocess
import sys
import textwrap
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.procs import WORKDIR, wait_for

import shmlimit
import shmlimit.shm.layout as L
from shmlimit.shm.cells import FED_ALL, MASK64, fed_bit, fed_mask, native_available

linux = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="futexes and /proc are Linux's"
)


@settings(max_examples=200, deadline=None)
@given(
    old=st.one_of(st.integers(0, 1000), st.integers(MASK64 - 1000, MASK64)),
    ops=st.integers(0, 40),
    cost=st.integers(1, 7),
    extra=st.integers(0, 6),
)
def test_a_move_of_the_head_wakes_the_bit_of_every_ticket_it_covered(old, ops, cost, extra):
    new = (old + ops * cost + extra) & MASK64
    mask = fed_mask(old, new, cost)
    assert 1 <= mask <= FED_ALL
    span = (new - old) & MASK64
    for d in range(1, span + 1):  # every ticket t with old < t <= new (wrapping)
        assert fed_bit((old + d) & MASK64, cost) & mask
    if native_available():  # the bits a native delivery wakes (``_native.c``, DELIVER)
        from shmlimit.shm import _native

        assert _native.fed_mask(old, new, cost) == mask


def asleep_on(pid, cells, bit):
    """The thread of ``pid`` asleep in a futex wait (shared, bitset ``bit``) on ``UP_WAKE``, if any."""
    import os

    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/syscall") as f:
                fields = f.read().split()
        except OSError:
            continue
        # nr, uaddr, op, val, timeout, uaddr2, val3 (the bitset): FUTEX_WAIT_BITSET (9), not private
        if (
            len(fields) >= 7
            and fields[0] != "running"
            and int(fields[2], 16) == 9
            and int(fields[6], 16) == bit
        ):
            return True
    return False


SLEEPER = textwrap.dedent(
    """
    import sys, time
    import shmlimit, shmlimit.shm.layout as L
    lim = shmlimit.attach(sys.argv[1])
    cells = lim._att.cells
    seen = cells.load(L.UP_WAKE)
    print("ready", flush=True)
    print(cells.futex_wait(L.UP_WAKE, seen, int(sys.argv[2]), time.monotonic_ns() + 60_000_000_000), flush=True)
    lim.close()
    """
)


@linux
def test_a_wake_reaches_a_sleeper_in_another_process_by_its_bit_only(name):
    lim = shmlimit.Limiter(name, rate=10)
    cells = lim._att.cells
    p = subprocess.Popen(
        [sys.executable, "-c", SLEEPER, name, str(1 << 5)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=WORKDIR,
    )
    try:
        assert p.stdout.readline().strip() == "ready"
        wait_for(lambda: asleep_on(p.pid, cells, 1 << 5), timeout=30)
        assert cells.futex_wake(L.UP_WAKE, 1 << 6) == 0  # another ticket's bit: it sleeps on
        assert asleep_on(p.pid, cells, 1 << 5)
        assert (
            cells.futex_wake(L.UP_WAKE, (1 << 5) | (1 << 9)) == 1
        )  # its own: woken, across processes
        assert p.stdout.readline().strip() == "True"
        assert p.wait(timeout=30) == 0
    finally:
        p.kill()
        p.wait()
        lim.close()


def test_a_sleep_on_a_word_that_moved_returns_at_once_and_one_past_its_deadline_reports_it(name):
    lim = shmlimit.Limiter(name, rate=10)
    cells = lim._att.cells
    try:
        seen = cells.load(L.UP_WAKE)
        cells.fetch_add(L.UP_WAKE, 1)  # a batch landed between the look and the sleep
        assert cells.futex_wait(L.UP_WAKE, seen, 1, time.monotonic_ns() + 60_000_000_000) is True
        assert cells.futex_wait(L.UP_WAKE, seen + 1, 1, time.monotonic_ns() - 1) is False
        with pytest.raises(ValueError, match="bitset"):
            cells.futex_wait(L.UP_WAKE, seen, 0, 0)
        with pytest.raises(IndexError):
            cells.futex_wake(cells.size, 1)
    finally:
        lim.close()


# ---- the whole path: a queued caller of another process, served by an added batch --------------------

#: A waiter process's prelude: it counts its sleeps, and ``acquire_counted`` says "ready", acquires
#: once, prints whether it was granted and how many times it slept, and closes.
COUNTED_WAITER = textwrap.dedent(
    """
    import shmlimit.acquire.single as A, shmlimit.attachment as T, shmlimit.bucket.fed_wait as F
    A.MAX_NAP_NS = 60_000_000_000  # no look but the wake's (nor a deadline's) within the test
    T.MAX_NAP = 60.0  # the same for the native one-call acquire (Acquirer), bound when the fast paths are
    sleeps = [0]
    sleep = F.sleep
    def counted(*args):
        sleeps[0] += 1
        return sleep(*args)
    F.sleep = counted  # the atomics backend's fed sleep (the native one counts its naps)
    def acquire_counted(lim, timeout=None):
        print("ready", flush=True)
        ok = lim.acquire(timeout=timeout)
        waiter = lim._att.fast.waiter
        print(ok, sleeps[0] + (waiter.naps if waiter is not None else 0), flush=True)
        lim.close()
    """
)

WAITER = COUNTED_WAITER + textwrap.dedent(
    """
    import sys
    import shmlimit
    lim = shmlimit.attach(sys.argv[1])
    acquire_counted(lim, None if sys.argv[2] == "-" else float(sys.argv[2]))
    """
)


@pytest.fixture
def fed(redis_server, name):
    """A hierarchical limiter at 1 op per 100 s whose filler is the test: nothing comes but what it adds."""
    from support.redis_server import require

    require()
    from shmlimit.bucket.filler import Lease, now_us
    from shmlimit.redis.direct import RedisLimiter

    glob = RedisLimiter(f"{name}-g", rate=1, per=100, url=redis_server.url)
    lim = shmlimit.Limiter(name, upstream=glob)
    att = lim._att
    lim.retry_after()  # a first use: the filler thread runs, and stops: the test is the filler
    att.filler.stop()
    att.filler.join()
    att.lease.drop()
    lease = Lease(
        att.cells, att.lease.slot, clock_us=lambda: now_us() + 60_000_000
    )  # held through the test
    assert lease.try_take()
    att.bucket.burn()
    att.cells.store(
        L.UP_NEXT_NS, 0
    )  # no batch expected: a sleeper's deadline is its turn, 100 s away
    yield lim
    lease.drop()
    lim.close()
    glob.close()


def start_waiter(name, timeout="-"):
    p = subprocess.Popen(
        [sys.executable, "-c", WAITER, name, timeout],
        stdout=subprocess.PIPE,
        text=True,
        cwd=WORKDIR,
    )
    assert p.stdout.readline().strip() == "ready"
    return p


@linux
@pytest.mark.parametrize("timeout", ["-", "60"])
def test_a_queued_caller_sleeps_once_and_is_woken_by_the_batch_that_covers_it(
    fed, timeout, monkeypatch
):
    import shmlimit.bucket.fed_wait as F

    woken = []
    wake = F.wake
    monkeypatch.setattr(F, "wake", lambda cells, mask: woken.append(wake(cells, mask)) or woken[-1])
    b = fed._att.bucket
    tail = b.cells.load(L.TAIL)
    p = start_waiter(fed.name, timeout)
    try:
        ticket = wait_for(lambda: b.cells.load(L.TAIL) != tail and b.cells.load(L.TAIL))
        bit = fed_bit(ticket, b.cost)
        wait_for(lambda: asleep_on(p.pid, b.cells, bit), timeout=30)
        assert b.add(b.cost) == b.cost  # one op: the batch that covers its ticket, and its wake
        assert woken == [1]  # the add woke it, in the other process
        assert p.stdout.readline().split() == ["True", "1"]  # granted, having slept once
        assert p.wait(timeout=30) == 0
    finally:
        p.kill()
        p.wait()


def test_a_timed_caller_not_served_gives_its_ticket_back_and_the_next_batch_serves_the_next(fed):
    b = fed._att.bucket
    assert fed.acquire(timeout=0.05) is False  # nothing came: its ticket is given back
    assert fed.stats().deficiency == 0  # nobody queued: the head skipped its range
    assert b.add(b.cost) == b.cost
    assert fed.try_acquire()  # the one op went to the next caller, not to the range given back
    assert not fed.try_acquire()


LATE_FILLER_WAITER = COUNTED_WAITER + textwrap.dedent(
    """
    import sys
    import shmlimit, shmlimit.shm.layout as L
    from shmlimit.bucket.filler import lease_word, now_us
    from shmlimit.redis.direct import RedisLimiter
    name, glob, url, other = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    lim = shmlimit.Limiter(name, upstream=RedisLimiter(glob, rate=1, per=100, url=url))  # a filler candidate
    att = lim._att
    lim.retry_after()  # a first use: this process's filler thread runs ...
    att.filler.stop()  # ... and never runs again: as a thread off the CPU
    att.filler.join()
    # it believes it holds the lease, which another process took from it and let lapse in turn
    att.lease.word = lease_word(now_us() - 2_000_000, att.lease.slot)
    att.cells.store(L.LEASE, lease_word(now_us() - 1_000_000, other))
    acquire_counted(lim)
    """
)


@linux
def test_a_waiter_whose_filler_thread_is_late_takes_the_lapsed_lease_and_sleeps_until_the_batch(
    fed, redis_server
):
    """A waiter that finds the filler lease lapsed, held (as its own process's filler thread believes) by
    that late thread, takes the lease and sleeps until the batch, rather than look again every few ms
    until the thread runs: it slept at most three times in 0.3 s (one short look at the lapse)."""
    b = fed._att.bucket
    tail = b.cells.load(L.TAIL)
    glob = fed.stats().upstream.key.split("{")[1].split("}")[0]
    p = subprocess.Popen(
        [
            sys.executable,
            "-c",
            LATE_FILLER_WAITER,
            fed.name,
            glob,
            redis_server.url,
            str(fed._att.lease.slot),
        ],
        stdout=subprocess.PIPE,
        text=True,
        cwd=WORKDIR,
    )
    try:
        assert p.stdout.readline().strip() == "ready"
        ticket = wait_for(lambda: b.cells.load(L.TAIL) != tail and b.cells.load(L.TAIL))
        wait_for(lambda: asleep_on(p.pid, b.cells, fed_bit(ticket, b.cost)), timeout=30)
        time.sleep(0.3)  # the span over which its sleeps are counted: no batch comes meanwhile
        assert b.add(b.cost) == b.cost  # the batch that covers its ticket
        ok, sleeps = p.stdout.readline().split()
        assert ok == "True" and int(sleeps) <= 3, sleeps  # not one look every 2 ms (~150)
        assert p.wait(timeout=30) == 0
    finally:
        p.kill()
        p.wait()


@linux
def test_a_waiter_that_cannot_take_the_lapsed_lease_sleeps_until_the_take_over(fed):
    """A waiter of a process attached by name (no upstream: it may not fill) that finds the filler lease
    lapsed sleeps until the lease's expiry plus the take-over (a watcher's period), not one look every
    few ms that changes nothing: at most three sleeps in 0.3 s (~150 before), and the batch still
    wakes it."""
    from shmlimit.bucket.filler import lease_word, now_us

    b = fed._att.bucket
    tail = b.cells.load(L.TAIL)
    # the lease of another slot, lapsed 10 ms ago: the take-over is due ~0.5 s from now, and no
    # process here may take it (the test's filler thread is stopped, the waiter's has no upstream)
    b.cells.store(L.LEASE, lease_word(now_us() - 10_000, fed._att.lease.slot + 1))
    p = start_waiter(fed.name)
    try:
        ticket = wait_for(lambda: b.cells.load(L.TAIL) != tail and b.cells.load(L.TAIL))
        wait_for(lambda: asleep_on(p.pid, b.cells, fed_bit(ticket, b.cost)), timeout=30)
        time.sleep(0.3)  # the span over which its sleeps are counted: no batch comes meanwhile
        assert b.add(b.cost) == b.cost  # the batch that covers its ticket wakes it
        ok, sleeps = p.stdout.readline().split()
        assert ok == "True" and int(sleeps) <= 3, sleeps
        assert p.wait(timeout=30) == 0
    finally:
        p.kill()
        p.wait()


@linux
def test_an_untimed_acquire_in_hierarchical_mode_is_one_native_call_woken_by_the_batch(
    fed, monkeypatch
):
    """The native backend's untimed one-op acquire is one call here too (an ``Acquirer`` over the fed
    wait: the grab, the sleep on the wake word, the record freed at the grant), not a grab then
    ``wait_for_ticket`` in Python; a wait that ends unserved hands back its ticket, still recorded."""
    import threading

    from shmlimit.shm.cells import native_available

    if not native_available() or fed._att.cells.__class__.__name__ != "NativeCells":
        pytest.skip("the one-call acquire is the native backend's")
    att, b = fed._att, fed._att.bucket
    monkeypatch.setattr(
        "shmlimit.attachment.MAX_NAP", 60.0
    )  # no look but the wake's within the test
    att.update_fast()
    acq, waiter = att.fast.grab, att.fast.waiter
    assert type(acq).__name__ == "Acquirer" and type(waiter).__name__ == "FedWaiter", (acq, waiter)
    # a fed wait has no steps (it sleeps on the wake word): acquire_async's take() takes nothing
    tail = att.cells.load(L.TAIL)
    assert acq.take() is False and att.cells.load(L.TAIL) == tail
    lens = [n for _, n in att.records]
    # a wait whose deadline has passed: the ticket comes back, recorded with its price; given back,
    # the head skips it and its record is freed
    ticket = acq(1)
    assert isinstance(ticket, int) and not isinstance(ticket, bool), ticket
    rec, tokens = att.find_record(ticket)
    assert rec is not None and tokens == b.cost
    att.give_back(ticket, tokens, rec)
    wait_for(lambda: not att.returns.pending())
    assert [att.cells.load(n) for n in lens] == [0] * len(lens)
    # a caller asleep in the one call until the batch that covers it: granted, counted, having slept once
    grants0, naps0 = fed.stats().grants, waiter.naps
    out = []
    t = threading.Thread(target=lambda: out.append(fed.acquire()))
    t.start()
    try:
        wait_for(lambda: waiter.naps > naps0 and att.cells.load(att.waiting_off) == 1, timeout=30)
        assert att.fast.grab is acq and not out
        assert b.add(b.cost) == b.cost
        t.join(timeout=30)
        assert out == [True]
        assert waiter.naps == naps0 + 1  # the batch woke it: no look in between
        assert fed.stats().grants == grants0 + 1
        assert [att.cells.load(n) for n in lens] == [0] * len(lens)  # its record freed at the grant
        assert att.cells.load(att.waiting_off) == 0
    finally:
        if t.is_alive():
            b.add(b.cost)
        t.join(timeout=30)
