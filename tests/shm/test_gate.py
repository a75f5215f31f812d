"""The Gate: try_acquire and timed acquire in one call, on both backends.

A Gate answers True (granted), False (refused for certain), a ticket (queued
within the timeout) or None (undecided: the slow path decides).  These tests
check each answer against the words it leaves, that a certain refusal is
never one a replenish could have turned into a grant (a stateful search
against the slow path's arithmetic, with an injected clock), and that the
Limiter's public calls take the gate and keep their meaning.
"""

import mmap
import time

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, given, settings
from support.cells import BACKENDS, backend, cells, cells_for, opened, segment  # noqa: F401 (fixtures)
from support.procs import run_processes

import shmlimit
from shmlimit.shm.cells import MASK64, native_available, open_cells
from shmlimit.shm.composites import Gate

SEQ, TAIL, HEAD, CEIL, TS, GRANTS = 8, 64, 128, 192, 256, 320
INF = float("inf")


def make_gate(c, amount=10, tpn=1, pend_mul=1, capped=False, max_reserved_ns=INF, expected=2):
    c.store(SEQ, 2)
    return c.gate(
        SEQ,
        expected,
        TAIL,
        HEAD,
        CEIL,
        TS,
        GRANTS,
        amount,
        1,
        tpn,
        pend_mul,
        capped,
        max_reserved_ns,
    )


def now_ns():
    return time.monotonic_ns()


def state(c):
    return [c.load(off) for off in (SEQ, TAIL, HEAD, CEIL, TS, GRANTS)]


def test_try_grab_granted_counts_and_moves_the_tail(cells):
    g = make_gate(cells)
    cells.store(HEAD, 25)
    cells.store(TS, now_ns())
    assert g.try_grab() is True and g.try_grab() is True
    assert cells.load(TAIL) == 20 and cells.load(GRANTS) == 2


def test_try_grab_certain_refusal_touches_nothing(cells):
    g = make_gate(cells)
    cells.store(HEAD, 5)
    cells.store(TS, now_ns() + 10**12)  # the replenish time is ahead: nothing is pending
    before = state(cells)
    assert g.try_grab() is False
    assert state(cells) == before


def test_try_grab_undecided_when_a_replenish_could_grant(cells):
    g = make_gate(cells, amount=1000)
    cells.store(HEAD, 0)
    cells.store(TS, now_ns() - 10**9)  # a second is pending: 10**9 tokens at tpn=1
    before = state(cells)
    assert g.try_grab() is None
    assert state(cells) == before


def test_pending_counts_tpn_and_the_catch_up_ratio(cells):
    # TS 1 ms ago: at least 10**6 ns * tpn * mul tokens are pending, and (allowing this test up to
    # 0.1 s between the two reads of the clock) at most 1.01e8 * tpn * mul
    cells.store(HEAD, 0)
    for tpn, mul in ((1, 1), (3, 1), (3, 2), (7, 4)):
        most = (10**6 + 10**8) * tpn * mul
        g = make_gate(cells, amount=most, tpn=tpn, pend_mul=mul)
        cells.store(TS, now_ns() - 10**6)
        assert g.try_grab() is False
        # 90 % of the least pending: undecided -- and refused, were tpn or mul left out
        g = make_gate(cells, amount=9 * 10**5 * tpn * mul, tpn=tpn, pend_mul=mul)
        assert g.try_grab() is None


def test_a_refusal_is_judged_at_the_reading_passed(cells):
    """``now_ns`` (an injected clock's reading) stands for the clock: 10 tokens short with TS at
    T are certain at T + 9 ns (tpn 1) and undecided at T + 10 ns, whatever the real clock says."""
    t = now_ns() + 10**15  # far from the real clock: it must not be read
    g = make_gate(cells)
    cells.store(HEAD, 0)
    cells.store(TS, t)
    before = state(cells)
    assert g.try_grab(t + 9) is False and g.grab_within(0, t + 9) is False
    assert g.try_grab(t + 10) is None and g.grab_within(0, t + 10) is None
    assert g.try_grab(t - 10**9) is False  # a reading before TS: nothing is pending
    assert state(cells) == before
    cells.store(TS, now_ns() - 10**9)  # None, as no reading: the real clock, a second pending
    assert g.try_grab(None) is None and g.grab_within(0, None) is None
    assert g.try_grab(cells.load(TS) + 9) is False


@pytest.mark.parametrize("bad", [0, -1, 1 << 64, 1.5, "1", True])
def test_a_bad_reading_is_refused_naming_now_ns(cells, bad):
    g = make_gate(cells)
    cells.store(HEAD, 0)
    before = state(cells)
    with pytest.raises(ValueError, match="now_ns"):
        g.try_grab(bad)
    with pytest.raises(ValueError, match="now_ns"):
        g.grab_within(0, bad)
    assert state(cells) == before


def test_config_change_makes_every_answer_undecided(cells):
    g = make_gate(cells)
    cells.store(HEAD, 100)
    cells.store(SEQ, 4)
    before = state(cells)
    assert g.try_grab() is None and g.grab_within(1.0) is None
    assert state(cells) == before


def test_grab_within_granted_ticket_and_refused(cells):
    g = make_gate(cells, amount=1000)  # tpn 1: 1000 tokens = 1 us of schedule
    cells.store(TS, now_ns() + 10**12)
    cells.store(HEAD, 1500)
    assert g.grab_within(0) is True and cells.load(GRANTS) == 1
    # 500 short = 0.5 us: within 1 us, a ticket (not counted until the caller's wait ends)
    assert g.grab_within(1e-6) == 2000 and cells.load(TAIL) == 2000 and cells.load(GRANTS) == 1
    before = state(cells)
    assert g.grab_within(1e-6) is False  # now 1500 short: 1.5 us > 1 us
    assert g.grab_within(0) is False
    assert state(cells) == before
    assert g.grab_within(2e-6) == 3000


def test_grab_within_respects_max_reserved(cells):
    g = make_gate(cells, amount=1000, max_reserved_ns=500.0)
    cells.store(TS, now_ns() + 10**12)
    cells.store(HEAD, 0)
    assert (
        g.grab_within(10.0) is False
    )  # 1000 ns of wait > max_reserved 500 ns, whatever the timeout
    g = make_gate(cells, amount=400, max_reserved_ns=500.0)
    assert g.grab_within(10.0) == 400


def test_grab_within_refuses_beyond_the_released_budget(cells):
    g = make_gate(cells, amount=1000, capped=True)
    cells.store(TS, now_ns() + 10**12)
    cells.store(HEAD, 0)
    cells.store(CEIL, 500)
    before = state(cells)
    assert g.grab_within(1.0) is False  # the ticket would be past CEIL: no computable wait
    assert state(cells) == before
    cells.store(CEIL, 1000)
    assert g.grab_within(1.0) == 1000


@pytest.mark.parametrize("bad", [-1, -0.5, float("nan"), INF, True, "1", None, 10**400])
def test_grab_within_leaves_unusual_timeouts_to_the_slow_path(cells, bad):
    g = make_gate(cells)
    cells.store(HEAD, 100)
    before = state(cells)
    assert g.grab_within(bad) is None
    assert state(cells) == before


def test_gate_checks_every_offset_and_parameter(cells):
    for i in (0, 2, 3, 4, 5, 6):
        args = [SEQ, 2, TAIL, HEAD, CEIL, TS, GRANTS, 10, 1, 1, 1, False, INF]
        args[i] = cells.size  # one past the end
        with pytest.raises(IndexError):
            cells.gate(*args)
    for i, v in ((7, 0), (9, 0), (10, 0), (12, -1.0)):
        args = [SEQ, 2, TAIL, HEAD, CEIL, TS, GRANTS, 10, 1, 1, 1, False, INF]
        args[i] = v
        with pytest.raises(ValueError):
            cells.gate(*args)


def test_gate_refuses_to_run_once_closed(backend, segment):  # noqa: F811
    c = cells_for(segment[1], 4096, backend)
    g = make_gate(c)
    c.close()
    if backend != "atomics-api":  # (the public API's views refuse on their own terms)
        with pytest.raises(ValueError):
            g.try_grab()
        with pytest.raises(ValueError):
            g.grab_within(1.0)


# ---- a certain refusal is never wrong: search against the slow path's arithmetic ------------------


def slow_path_could_grant(tail, head, ts, now, amount, tpn, mul, max_wait_ns):
    """Could a replenish at ``now`` make this grab fit ``max_wait_ns`` (None: granted at once)?"""
    most = max(0, now - ts) * tpn * mul  # the most a replenish adds, before its clamps
    short = (tail + amount - head - most) & MASK64
    short = short - (1 << 64) if short >> 63 else short
    if max_wait_ns is None:
        return short <= 0
    return short <= 0 or short / tpn <= max_wait_ns


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    base=st.integers(0, MASK64),
    avail=st.integers(-(1 << 40), 1 << 40),
    amount=st.integers(1, 1 << 40),
    tpn=st.integers(1, 1 << 16),
    mul=st.integers(1, 4),
    idle=st.integers(0, 1 << 30),
    timeout=st.one_of(st.none(), st.floats(0, 10, allow_nan=False)),
)
def test_a_certain_refusal_is_never_one_a_replenish_could_grant(
    base, avail, amount, tpn, mul, idle, timeout
):
    mm = mmap.mmap(-1, 4096)
    c = open_cells(mm, 4096, "atomics")
    try:
        clock = [10**15]
        c.store(SEQ, 2)
        c.store(TAIL, base)
        c.store(HEAD, (base + avail) & MASK64)
        c.store(TS, clock[0] - idle)
        g = Gate(
            c,
            SEQ,
            2,
            TAIL,
            HEAD,
            CEIL,
            TS,
            GRANTS,
            amount,
            1,
            tpn,
            mul,
            False,
            INF,
            clock=lambda: clock[0],
        )
        before = state(c)
        # every backend's gate, bound to the same words, judges at the reading now_ns as the
        # reference does on its clock: the same answer, the same words left
        twins = []
        for kind in [b for b in BACKENDS if b != "native" or native_available()]:
            mm2 = mmap.mmap(-1, 4096)
            mm2[:] = mm[:]
            c2 = cells_for(mm2, 4096, kind)
            g2 = c2.gate(SEQ, 2, TAIL, HEAD, CEIL, TS, GRANTS, amount, 1, tpn, mul, False, INF)
            r2 = g2.try_grab(clock[0]) if timeout is None else g2.grab_within(timeout, clock[0])
            twins.append((kind, r2, state(c2)))
            c2.close()
        r = g.try_grab() if timeout is None else g.grab_within(timeout)
        assert all(r2 == r and type(r2) is type(r) and s2 == state(c) for _, r2, s2 in twins), (
            r,
            twins,
        )
        if r is False:
            assert state(c) == before
            assert not slow_path_could_grant(
                base,
                (base + avail) & MASK64,
                clock[0] - idle,
                clock[0],
                amount,
                tpn,
                mul,
                None if timeout is None else timeout * 1e9,
            )
        elif r is True:
            assert (
                avail >= amount and c.load(TAIL) == (base + amount) & MASK64 and c.load(GRANTS) == 1
            )
        elif r is not None:  # a ticket: queued, within the timeout
            assert timeout is not None and r == (base + amount) & MASK64
            assert (amount - avail) / tpn <= timeout * 1e9
        else:  # undecided: only when a replenish could change the answer
            assert slow_path_could_grant(
                base,
                (base + avail) & MASK64,
                clock[0] - idle,
                clock[0],
                amount,
                tpn,
                mul,
                None if timeout is None else timeout * 1e9,
            )
            assert state(c) == before
    finally:
        c.close()


# ---- the public calls ------------------------------------------------------------------------------


@pytest.mark.slow
def test_try_acquire_and_timed_acquire_take_the_gate(name):
    lim = shmlimit.Limiter(name, rate=10, burst=2)
    try:
        assert (
            lim._fast.try_now.__name__ == "_undecided"
        )  # unused yet: the first call takes the slow path
        lim.retry_after()  # a first use (taking nothing) starts the filler and binds the fast paths
        assert (
            lim._fast.try_now.__name__ == "try_grab" and lim._fast.within.__name__ == "grab_within"
        )
        assert [lim.try_acquire() for _ in range(3)] == [True, True, False]
        assert lim.acquire(timeout=0) is False
        t0 = time.monotonic()
        assert lim.acquire(timeout=1.0) is True  # queued for ~0.1 s
        assert time.monotonic() - t0 >= 0.05
        assert lim.stats().grants == 3
        # a config change sends both to the slow path once, which re-binds them to the new config
        old_gate = lim._fast.try_now.__self__
        lim.set_rate(1000, burst=5)
        assert (
            lim._fast.try_now() is None and lim._fast.within(0.5) is None
        )  # the old config: undecided
        lim.try_acquire()  # granted or not (the bucket may still be empty), it re-binds
        assert lim._fast.try_now.__self__ is not old_gate
        assert lim.acquire(timeout=0.5) is True  # a wait of at most 1 ms at the new rate
    finally:
        lim.close()


def test_no_gate_while_stopped_and_timed_acquire_still_refuses(name):
    lim = shmlimit.Limiter(name, rate=1000, burst=1)
    try:
        lim.stop()
        assert lim.try_acquire() is False
        assert lim._fast.try_now.__name__ == "_undecided"
        assert lim.acquire(timeout=0.05) is False  # stopped: no computable wait
        lim.start()
        assert lim.acquire(timeout=0.5) is True
        assert lim._fast.try_now.__name__ == "try_grab"
    finally:
        lim.close()


def test_timed_acquire_bad_timeouts_still_raise(name):
    lim = shmlimit.Limiter(name, rate=1000)
    try:
        with pytest.raises(ValueError, match="timeout"):
            lim.acquire(timeout=-1)
        with pytest.raises(TypeError, match="timeout"):
            lim.acquire(timeout="1")
        assert lim.acquire(timeout=float("inf")) is True  # +inf means no timeout
    finally:
        lim.close()


# ---- racing processes: FIFO tickets, no grant beyond the head, every grant counted ----------------


def _racer(name, backend, kind, q):
    granted, tickets = 0, []
    with opened(name, backend) as c:
        if kind == "grabber":
            grab = c.grabber(SEQ, 2, TAIL, HEAD, 3, GRANTS, 1)
            for _ in range(300):
                r = grab()
                if r is None:
                    granted += 1
                else:
                    tickets.append(r)
        else:
            g = c.gate(SEQ, 2, TAIL, HEAD, CEIL, TS, GRANTS, 3, 1, 1, 1, False, INF)
            for _ in range(300):
                r = g.try_grab() if kind == "try" else g.grab_within(0)
                assert r is not None  # TS is far ahead: nothing pending, every answer is certain
                granted += r is True
    q.put((granted, tickets))


@pytest.mark.parametrize("kind", ["grabber", "try", "within"])
def test_racing_processes_share_the_head_exactly(backend, segment, kind):  # noqa: F811
    import multiprocessing as mp

    name, mm = segment
    c = cells_for(mm, 4096, backend)
    c.store(SEQ, 2)
    c.store(TAIL, 0)
    c.store(HEAD, 3 * 500 + 2)  # 500 grants of 3 fit, the remainder 2 does not
    c.store(TS, now_ns() + 10**12)
    out = run_processes(mp.get_context("fork"), _racer, [(name, backend, kind)] * 4)
    granted = sum(g for g, _ in out)
    tickets = sorted(t for _, ts in out for t in ts)
    assert granted == 500 and c.load(GRANTS) == 500
    if kind == "grabber":  # the other 700 queued, one ticket each, handed out in tail order
        assert tickets == [1500 + 3 * k for k in range(1, 701)] and c.load(TAIL) == 3 * 1200
    else:  # refusals take nothing
        assert c.load(TAIL) == 1500
    c.close()


# ---- the atomics backend: an uncontended grant is at most two atomic operations --------------------


def count_atomic_ops(cells):
    """Wrap the backend's four native operations; count those made by this thread (not the filler's)."""
    import threading

    me = threading.get_ident()
    counts = {"n": 0}
    p = cells._p
    for attr in ("_ld", "_st", "_fa", "_cx"):
        fn = getattr(p, attr)

        def counted(*args, _fn=fn):
            if threading.get_ident() == me:
                counts["n"] += 1
            return _fn(*args)

        setattr(p, attr, counted)
    return counts


def test_an_uncontended_grant_on_atomics_is_two_atomic_operations(name, monkeypatch):
    monkeypatch.setenv("SHMLIMIT_BACKEND", "atomics")
    lim = shmlimit.Limiter(name, rate=1e6, burst=1e6)
    try:
        assert lim.backend == "atomics" and lim._att.cells._direct
        lim.retry_after()  # a first use (taking nothing) binds the fast paths
        counts = count_atomic_ops(lim._att.cells)
        for call in (lim.acquire, lim.try_acquire, lambda: lim.acquire(timeout=0)):
            counts["n"] = 0
            assert call() is True
            assert counts["n"] == 2  # the tail's CAS and the grant count; the rest are plain loads
        lim.drain()
        lim.set_rate(1, per=3600, burst=1)  # nothing left, and no replenish can help for an hour
        lim.try_acquire()  # re-binds the gate to the new config
        lim.drain()
        for call in (lim.try_acquire, lambda: lim.acquire(timeout=0)):
            counts["n"] = 0
            assert call() is False
            assert counts["n"] == 0  # a certain refusal reads, and writes nothing
    finally:
        lim.close()
