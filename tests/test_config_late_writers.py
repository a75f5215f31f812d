"""Two plain config writers late at once: each stalled past the lock's timeout, taken over, resumed.

A first writer stops before one of its writes, a second takes its lock over and stops before one
of its own, a third takes the lock over and publishes the newest ``set_rate``; then the two late
ones resume, in either order, each running to its end before the other goes on.  Every pair of
stopping points and both orders are tried, on each backend.  After the newest publication and
after each resumption the config in force must be the newest one, whole: read the same by the
Python reader and accepted by the backend's fast path (which prices by the snapshot whose
``CFG_SEQ`` it checks), never refused as corrupt, and ``CFG_SEQ`` even and never moved back.
"""

import pytest

from shmlimit import config_banks
from shmlimit import layout as L
from shmlimit.bucket import Bucket
from shmlimit.cells import native_available
from shmlimit.config import Config
from shmlimit.config_banks import config_words, read_snapshot, write_under_lock
from support.buckets import private_cells
from support.cells import Gate, Writer
from support.clock import FakeClock

START = Config.make(1000, burst=10)
FIRST = Config.make(1000, burst=50)  # what the first late writer came to write
SECOND = Config.make(500, burst=20)  # what the second late writer came to write
NEWEST = Config.make(10, burst=2)  # the newest set_rate, published while both are stopped


@pytest.fixture(params=["atomics", "native"])
def backend(request):
    if request.param == "native" and not native_available():
        pytest.skip("the native extension is not built here")
    return request.param


def writer(cfg, tpn):
    """A config writer as ``Bucket.publish`` runs one: every word computed, then the locked write."""
    return lambda cells: write_under_lock(cells, lambda c: config_words(cfg, tpn, False, 0))


def _writes(write, cells):
    gate = Gate(cells, -1)
    write(gate)
    return gate.writes


def test_two_late_config_writers_leave_the_newest_config_whole(backend, monkeypatch):
    monkeypatch.setattr(config_banks, "CONFIG_LOCK_TIMEOUT_NS", 0)  # taken over at the first look
    clock = FakeClock()
    cells = None

    def prepare():
        nonlocal cells
        cells = private_cells(backend)
        Bucket.initialise(cells, START, clock())
        return cells

    tpn = Bucket(prepare(), clock).tpn
    write_first, write_second = writer(FIRST, tpn), writer(SECOND, tpn)
    n1, n2 = _writes(write_first, prepare()), _writes(write_second, prepare())

    def check(where, seq_before):
        c = cells
        seq = c.load(L.CFG_SEQ)
        assert seq % 2 == 0 and 0 <= (seq - seq_before) % 2**64 < 2**63, (where, seq_before, seq)
        snap = read_snapshot(c)  # SegmentError here: the limiter refused fleet-wide
        assert snap.config == NEWEST, (where, snap.config)
        assert (snap.cost, snap.cap, snap.tpn) == (NEWEST.cost_at(tpn), NEWEST.cap_at(tpn), tpn), where
        assert read_snapshot(c) == snap, where
        fresh = Bucket(c, clock)  # what a process attaching now prices by
        assert fresh.snap == snap, where
        # the fast path takes the snapshot's CFG_SEQ as current (False: stale, back to the reader) and
        # takes one op at the snapshot's price (granted, or queued for it)
        tail = c.load(L.TAIL)
        grab = c.grabber(L.CFG_SEQ, snap.seq, L.TAIL, L.HEAD, snap.cost, L.UNREG_GRANTS, 1)
        assert grab() is not False, where
        assert (c.load(L.TAIL) - tail) % 2**64 == snap.cost, where
        return seq

    cases = 0
    for i in range(1, n1):
        for j in range(1, n2):
            for order in ("first-resumes-first", "second-resumes-first"):
                c = prepare()
                w1 = Writer(write_first, c, i)
                w2 = Writer(write_second, c, j) if w1.late else None
                try:
                    if not (w1.late and w2.late):
                        continue
                    Bucket(c, clock).publish(NEWEST)
                    where = (i, j, order)
                    seq = check(where + ("published",), c.load(L.CFG_SEQ))
                    late = (w1, w2) if order == "first-resumes-first" else (w2, w1)
                    for k, w in enumerate(late):
                        w.resume()
                        seq = check(where + (f"resumed {k + 1}",), seq)
                    cases += 1
                finally:
                    for w in (w1, w2):
                        if w is not None:
                            w.gate.go.set()
                            w.thread.join(30)
    assert cases > 100, cases  # the stopping points were reached
