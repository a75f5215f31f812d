"""The atomic layer: both backends behave identically, stay in bounds, and are atomic across processes."""

import multiprocessing as mp
import os
import threading
import time

import pytest
from support.cells import BACKENDS, REQUIRE_NATIVE, SIZE, backend, cells, cells_for, opened, segment  # noqa: F401 (fixtures)
from support.procs import run_processes, wait_exit, wait_for

from shmlimit.shm.cells import MASK64, Cells, native_available, selected_backend

# run once in CI: names each backend it checks
pytestmark = pytest.mark.backend_independent


def test_native_backend_is_built_when_required():
    if REQUIRE_NATIVE:
        assert native_available(), (
            "SHMLIMIT_REQUIRE_NATIVE=1 but shmlimit.shm._native did not build"
        )
        assert selected_backend() == os.environ.get("SHMLIMIT_BACKEND", "native")
    elif not native_available():
        pytest.skip("the native extension is not built here")


def test_load_store_fetch_add_wrap(cells):
    assert cells.backend in BACKENDS and cells.size == SIZE
    cells.store(8, MASK64)
    assert cells.load(8) == MASK64
    assert cells.fetch_add(8, 2) == MASK64
    assert cells.load(8) == 1  # wrapped modulo 2**64
    assert cells.fetch_add(8, MASK64) == 1 and cells.load(8) == 0  # adding 2**64-1 subtracts one


def test_both_backends_satisfy_the_cells_protocol(cells):
    """Every module above the atomic layer is typed against ``Cells``: each backend offers all of it."""
    members = {k for k in vars(Cells) if not k.startswith("_")}
    assert {
        "load",
        "store",
        "fetch_add",
        "cas",
        "grab",
        "grab_if",
        "grabber",
        "try_grab",
        "close",
    } <= members
    assert isinstance(cells, Cells)
    for m in members - {"backend", "size"}:
        assert callable(getattr(cells, m)), m
    public = {k for k in dir(cells) if not k.startswith("_")}
    assert public <= members, f"{cells.backend} offers more than the protocol: {public - members}"


def test_cas(cells):
    cells.store(16, 5)
    assert cells.cas(16, 5, 7) and cells.load(16) == 7
    assert not cells.cas(16, 5, 9) and cells.load(16) == 7


def test_load_many_reads_each_word_as_load_does(cells):
    for i in range(0, 64, 8):
        cells.store(i, (i * 0x9E3779B97F4A7C15) & MASK64)
    offs = (56, 0, 8, 8, 32)
    assert cells.load_many(offs) == tuple(cells.load(o) for o in offs)
    assert cells.load_many(()) == ()
    with pytest.raises(TypeError):
        cells.load_many([0, 8])  # a tuple only: the scan's offsets are fixed once


def test_grab_granted_queued_and_counted(cells):
    tail, head, grants = 0, 64, 128
    cells.store(head, 10)
    assert cells.grab(tail, head, 4, grants, 1) is None  # 4 <= 10
    assert cells.load(grants) == 1
    assert cells.grab(tail, head, 8, grants, 2) == 12  # a ticket past the head: wait for it
    assert cells.load(tail) == 12 and cells.load(grants) == 1


def test_grab_if_and_bound_grabber(cells):
    seq, tail, head, grants = 8, 0, 64, 128
    cells.store(seq, 4)
    cells.store(head, 10)
    assert (
        cells.grab_if(seq, 3, tail, head, 4, grants, 1) is False
    )  # config changed: nothing touched
    assert cells.load(tail) == 0 and cells.load(grants) == 0
    g = cells.grabber(seq, 4, tail, head, 4, grants, 1)
    assert g() is None and g() is None and g() == 12  # 4, 8 granted; 12 > 10 queues
    assert cells.load(tail) == 12 and cells.load(grants) == 2
    cells.store(seq, 6)
    assert g() is False and cells.load(tail) == 12
    with pytest.raises(IndexError):
        cells.grabber(seq, 4, tail, SIZE, 4, grants, 1)
    cells.close()
    with pytest.raises(ValueError):
        g()


def test_take_tail_claims_takes_and_records_in_one_operation(cells):
    """The slow path's take: one CAS of the tail, a record claimed before it when the ticket would
    queue and its length stored after it, the queued ticket left in ``handed()``; nothing held when
    the tail moved or no record is free; covered, counted, its record free."""
    tail, head, grants = 0, 8, 16
    recs = (40, 56)  # LEN offsets, each with its TICKET word before it
    cells.store(head, 10)
    assert cells.take_tail(tail, head, grants, recs, 0, 4, 4, 1) is None  # 4 <= 10: covered
    assert [cells.load(o) for o in (tail, grants, 40, 56)] == [4, 1, 0, 0]
    assert cells.handed() is None  # a grant hands nothing
    assert cells.take_tail(tail, head, grants, recs, 4, 16, 12, 3) == 40  # queued, recorded
    assert [cells.load(o) for o in (tail, grants, 32, 40, 56)] == [16, 1, 16, 12, 0]
    assert cells.handed() == 16 and cells.handed() is None  # once
    assert cells.take_tail(tail, head, grants, recs, 4, 20, 4, 1) is False  # the tail moved on
    assert [cells.load(o) for o in (tail, grants, 40, 56)] == [16, 1, 12, 0]  # nothing held
    cells.store(56, 7)  # every record in use: it would queue, so it takes nothing
    assert cells.take_tail(tail, head, grants, recs, 16, 20, 4, 1) == 0
    assert cells.take_tail(tail, head, grants, (), 16, 20, 4, 1) == 0
    assert [cells.load(o) for o in (tail, grants, 40, 56)] == [16, 1, 12, 7]
    assert cells.handed() is None


def test_try_grab_refusal_changes_nothing(cells):
    tail, head, grants = 0, 64, 128
    cells.store(tail, MASK64 - 1)  # across the wrap point
    cells.store(head, 3)
    assert cells.try_grab(tail, head, 5, grants, 1)  # tail -> 3 (mod 2**64)
    assert cells.load(tail) == 3 and cells.load(grants) == 1
    before = [cells.load(o) for o in (tail, head, grants)]
    assert not cells.try_grab(tail, head, 1, grants, 1)
    assert [cells.load(o) for o in (tail, head, grants)] == before


@pytest.mark.parametrize("off", [-8, 3, SIZE - 4, SIZE, 1 << 40])
def test_out_of_bounds_and_misaligned_offsets_touch_nothing(cells, off):
    for i in range(0, SIZE, 8):
        cells.store(i, i + 1)
    for call in (
        lambda: cells.load(off),
        lambda: cells.store(off, 1),
        lambda: cells.fetch_add(off, 1),
        lambda: cells.cas(off, 0, 1),
        lambda: cells.load_many((0, off)),
    ):
        with pytest.raises(IndexError):
            call()
    # every offset of every composite, each checked before the first access to any word
    for method, args, words in (
        ("grab", [0, 8, 1, 16, 1], (0, 1, 3)),
        ("try_grab", [0, 8, 1, 16, 1], (0, 1, 3)),
        ("grab_if", [24, 25, 0, 8, 1, 16, 1], (0, 2, 3, 5)),
        ("grabber", [24, 25, 0, 8, 1, 16, 1], (0, 2, 3, 5)),
    ):
        for i in words:
            bad = list(args)
            bad[i] = off
            with pytest.raises(IndexError):
                getattr(cells, method)(*bad)
    assert all(cells.load(i) == i + 1 for i in range(0, SIZE, 8))


@pytest.mark.parametrize(
    "records, error",
    [
        ((0,), IndexError),  # a LEN word with no TICKET word before it
        ((40, SIZE), IndexError),
        ((40, 44), IndexError),
        ([40], TypeError),
    ],
)
def test_every_records_argument_is_checked_before_any_word_is_touched(cells, records, error):
    for i in range(0, SIZE, 8):
        cells.store(i, i + 1)
    seq, tail, head, grants = 24, 0, 8, 16
    words = (seq, tail, head, 48, 56, 64, 72, 80, 88, 96, 104)
    waiter_args = [words, 25, grants, None, 1, 10, 1000]
    calls = [
        lambda: cells.grabber(seq, 25, tail, head, 1, grants, 1, records),
        lambda: cells.take_tail(tail, head, grants, records, 1, 2**40, 1, 1),  # (short: it claims)
        lambda: cells.clamp_words(
            head, 1, 9, records
        ),  # callers queued (head before tail): records read
    ]
    fences = (112, 120, 1)  # FENCE_HINT, one fence record
    if cells.waiter(*waiter_args, (40,), fences) is not None:  # the backend waits in one call
        calls.append(lambda: cells.waiter(*waiter_args, records, fences))
    for call in calls:
        with pytest.raises(error):
            call()
    with pytest.raises(TypeError):  # a grab holds at most MAX_RECS (8) records
        cells.grabber(seq, 25, tail, head, 1, grants, 1, tuple(range(40, 40 + 9 * 16, 16)))
    assert all(cells.load(i) == i + 1 for i in range(0, SIZE, 8))


@pytest.mark.parametrize(
    "words, fences",
    [
        ((24, 0, 8, 48, 56, 64, 72, 80, 88, 96), (112, 120, 1)),  # a word short
        ((24, 0, 8, 48, 56, 64, 72, 80, 88, 96, 104), (112, 120)),  # no fence count
        ((24, 0, 8, 48, 56, 64, 72, 80, 88, 96, SIZE), (112, 120, 1)),  # SNAP_NEXT past the end
    ],
)
def test_a_waiter_refuses_words_it_cannot_bind(cells, words, fences):
    """Both backends refuse a bad ``words`` or ``fences`` (the native one's word by word), touching
    nothing."""
    for i in range(0, SIZE, 8):
        cells.store(i, i + 1)
    with pytest.raises(TypeError if len(words) != 11 or len(fences) != 3 else IndexError):
        cells.waiter(words, 25, 16, None, 1, 10, 1000, (40,), fences)
    assert all(cells.load(i) == i + 1 for i in range(0, SIZE, 8))


@pytest.mark.parametrize("value", [-1, 1 << 64])
def test_values_outside_64_bits_are_refused(cells, value):
    cells.store(0, 7)
    for call in (
        lambda: cells.store(0, value),
        lambda: cells.fetch_add(0, value),
        lambda: cells.cas(0, 7, value),
    ):
        with pytest.raises(OverflowError):
            call()
    assert cells.load(0) == 7


def test_closed_cells_refuse_every_call(backend, segment):
    c = cells_for(segment[1], SIZE, backend)
    c.close()
    with pytest.raises(ValueError):
        c.load(0)
    with pytest.raises(ValueError):
        c.load_many((0,))


def _adder(name, backend, n):
    with opened(name, backend) as c:
        for _ in range(n):
            c.fetch_add(0, 1)


def _taker(name, backend, q):
    got = 0
    with opened(name, backend) as c:
        while c.try_grab(64, 128, 3, 192, 1):
            got += 1
    q.put(got)


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_fetch_add_is_atomic_across_processes(backend, segment, method):
    name, mm = segment
    c = cells_for(mm, SIZE, backend)
    c.store(0, 0)
    n = 20_000 if backend == "native" else 1_000
    ctx = mp.get_context(method)
    procs = [ctx.Process(target=_adder, args=(name, backend, n)) for _ in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert c.load(0) == 4 * n
    c.close()


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_racing_try_grabs_never_over_grant(backend, segment, method):
    name, mm = segment
    c = cells_for(mm, SIZE, backend)
    c.store(64, 0)  # tail
    c.store(128, 3 * 500 + 2)  # head: 500 grabs of 3 fit, the remainder 2 does not
    got = run_processes(mp.get_context(method), _taker, [(name, backend)] * 4)
    assert sum(got) == 500 and c.load(192) == 500 and c.load(64) == 1500
    c.close()


@pytest.mark.parametrize("backend", ["atomics", "atomics-api"])
@pytest.mark.parametrize("held", ["an operation", "the lock"])
def test_a_child_forked_while_another_thread_is_inside_closes(backend, segment, held):
    """A thread of the parent inside an operation (a futex wait, here) or holding the lock that
    counts them when another thread forks: the child has no such thread, so its close (run at
    exit) must not wait for it, as the native backend's does not (its count is per process)."""
    c = cells_for(segment[1], SIZE, backend)
    c.store(0, 0)
    release = threading.Event()

    def inside():
        if held == "the lock":
            with c._lock:
                release.wait(30)
        else:
            c.futex_wait(0, 0, 1, time.monotonic_ns() + 30 * 10**9)

    t = threading.Thread(target=inside, daemon=True)
    t.start()
    wait_for(lambda: c._lock.locked() if held == "the lock" else c._active == 1)
    pid = os.fork()
    if pid == 0:
        try:
            c.store(8, 1)
            c.close()
        finally:
            os._exit(0)
    try:
        assert wait_exit(pid, 10) == 0
    finally:
        release.set()
        c.futex_wake(0, 1)
        t.join(30)
    assert c.load(8) == 1
    c.close()


def test_grabs_bound_to_records_take_nothing_once_leave_waiters_began(cells):
    # close's first half (leave_waiters) comes before its process leaves the slot whose records
    # the fast paths are bound to: a grab called after it (its fast path loaded before) must take
    # no ticket and write no record, on every backend (the atomics one's reference grab too).
    seq, tail, head, grants, repl_ts = 0, 8, 16, 24, 32
    records = (56, 72)  # LEN offsets, each with its TICKET word before it
    cells.store(tail, 100)
    cells.store(head, 100)  # nothing available: a grab of one would queue
    cells.store(repl_ts, 1 << 62)  # a replenish time far ahead: no pending tokens counted
    grab = cells.grabber(seq, 0, tail, head, 1, grants, 1, records)
    gate = cells.gate(
        seq, 0, tail, head, head, repl_ts, grants, 1, 1, 1, 1, False, float("inf"), records
    )
    cells.leave_waiters()
    assert grab() is False
    assert gate.grab_within(3600.0) is None
    assert (cells.load(tail), cells.load(grants)) == (100, 0)
    assert [cells.load(off) for off in (48, 56, 64, 72)] == [0, 0, 0, 0]


def test_the_atomics_backends_word_functions_hold_no_view_open(segment, monkeypatch):
    """The ``atomics`` backend's direct calls (``_Patomic``) need the package's view of a word only
    to find its address and functions.  Kept entered, the view outlived its owner whenever a close
    did not run to its end (its cells dropped in a cycle, or a close stopped by an exported
    buffer), and the package printed "Cannot call 'release' while context is open" from its
    ``__del__``; it is left at once now, and the words stay usable."""
    import gc

    pytest.importorskip("atomics")
    from shmlimit.shm.atomics_cells import _Patomic

    raised = []
    monkeypatch.setattr("sys.unraisablehook", raised.append)
    buf = memoryview(segment[1])
    p = _Patomic(buf)
    p.store(p.base, 41)
    assert p.fetch_add(p.base, 1) == 41 and p.load(p.base) == 42
    p.close()
    q = _Patomic(buf)
    del q  # dropped without its close
    gc.collect()
    assert [str(u.exc_value) for u in raised] == []
    buf.release()
