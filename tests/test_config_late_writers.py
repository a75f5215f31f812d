"""Two plain config writers late at once: each stalled past the lock's timeout, taken over, resumed.

A first writer stops before one of its writes, a second takes its lock over and stops before one
of its own, a third takes the lock over and publishes the newest ``set_rate``; then the two late
ones resume, in either order, each running to its end before the other goes on.  Every pair of
stopping points and both orders are tried, on each backend.  After the newest publication and
after each resumption the config in force must be the newest one, whole: read the same by the
Python reader and accepted by the backend's fast path (which prices by the snapshot whose
``CFG_SEQ`` it checks), never refused as corrupt, and ``CFG_SEQ`` even and never moved back.
A stateful search then runs the same check with two to four late writers, newer publications
among them.
"""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.buckets import private_cells
from support.cells import Writer, every_two_late, release
from support.clock import FakeClock

from shmlimit.bucket.rovers import Bucket
from shmlimit.config import Config
from shmlimit.errors import SegmentError
from shmlimit.shm import banks as config_banks
from shmlimit.shm import layout as L
from shmlimit.shm.banks import config_words, read_snapshot, write_under_lock
from shmlimit.shm.cells import native_available

# run once in CI: names each backend it checks
pytestmark = pytest.mark.backend_independent

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


def check_in_force(c, clock, cfg, tpn, where, seq_before):
    """``cfg`` is the config in force, whole, at the segment's token unit ``tpn``, and ``CFG_SEQ`` is
    even and not behind ``seq_before``; returns ``CFG_SEQ``."""
    seq = c.load(L.CFG_SEQ)
    assert seq % 2 == 0 and 0 <= (seq - seq_before) % 2**64 < 2**63, (where, seq_before, seq)
    snap = read_snapshot(c)  # SegmentError here: the limiter refused fleet-wide
    assert snap.config == cfg, (where, snap.config)
    assert (snap.cost, snap.cap, snap.tpn) == (cfg.cost_at(tpn), cfg.cap_at(tpn), tpn), where
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


def test_two_late_config_writers_leave_the_newest_config_whole(backend, monkeypatch):
    monkeypatch.setattr(config_banks, "CONFIG_LOCK_TIMEOUT_NS", 0)  # taken over at the second look
    clock = FakeClock()
    cells = seq = None

    def prepare():
        nonlocal cells
        cells = private_cells(backend)
        Bucket.initialise(cells, START, clock())
        return cells

    def newer():
        nonlocal seq
        Bucket(cells, clock).publish(NEWEST)
        seq = cells.load(L.CFG_SEQ)

    def check(where):
        nonlocal seq
        seq = check_in_force(cells, clock, NEWEST, tpn, where, seq)

    tpn = Bucket(prepare(), clock).tpn
    cases = every_two_late(writer(FIRST, tpn), writer(SECOND, tpn), prepare, newer, check)
    assert cases > 100, cases  # the stopping points were reached


# -- any number of late writers, newer publications among them -------------------------------------

CONFIGS = [
    FIRST,
    SECOND,
    Config.make(200, burst=8),
    Config.make(100, per=2.0, burst=4),
    NEWEST,
    Config.make(50, burst=3, ratio=2.0),
]
#: ``at`` beyond a writer's writes (about 26: the lock, two banks of twelve words, the publication)
#: lets it run to its end: a publication of its own
MAX_AT = 30


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    late=st.lists(
        st.tuples(st.integers(0, len(CONFIGS) - 1), st.integers(1, MAX_AT), st.booleans()),
        min_size=2,
        max_size=4,
    ),
    newest=st.integers(0, len(CONFIGS) - 1),
    also=st.none() | st.tuples(st.integers(0, 3), st.integers(0, len(CONFIGS) - 1)),
    order=st.randoms(use_true_random=False),
)
def test_any_number_of_late_config_writers_leave_the_newest_config_whole(
    backend, monkeypatch, late, newest, also, order
):
    """Writers one after another, each stopped before one of its writes (or run to its end when it
    has fewer) and taken over by the next, a set_rate after any of them (``True``) and always one
    after the last; then the stopped ones resume in a random order, ``also`` another set_rate
    among them.  After every publication and every resumption the config in force is the one the
    newest completed publication wrote, whole (the pairwise test's check)."""
    monkeypatch.setattr(config_banks, "CONFIG_LOCK_TIMEOUT_NS", 0)  # taken over at the second look
    clock = FakeClock()
    c = private_cells(backend)
    Bucket.initialise(c, START, clock())
    tpn = Bucket(c, clock).tpn
    writers = []
    try:
        newest_cfg, seq = START, c.load(L.CFG_SEQ)

        def publish(cfg, where):
            nonlocal newest_cfg, seq
            Bucket(c, clock).publish(cfg)
            newest_cfg = cfg
            seq = check_in_force(c, clock, newest_cfg, tpn, where, seq)

        for k, (i, at, then_publish) in enumerate(late):
            w = Writer(writer(CONFIGS[i], tpn), c, at)
            writers.append(w)
            if not w.late:  # it ran to its end: its config is published
                assert not w.errors, w.errors
                newest_cfg = CONFIGS[i]
            if then_publish or k == len(late) - 1:
                publish(CONFIGS[newest], f"published after writer {k + 1}")
        stopped = [w for w in writers if w.late]
        order.shuffle(stopped)
        for k, w in enumerate(stopped):
            if also is not None and also[0] == k:
                publish(CONFIGS[also[1]], f"published before resumption {k + 1}")
            w.resume()  # taken over: it fails, and must damage nothing
            seq = check_in_force(
                c, clock, newest_cfg, tpn, f"resumed {k + 1} of {len(stopped)}", seq
            )
    finally:
        release(*writers)


# -- the reader: the same pick as the keyed banks' (tests/keyed/test_keyed_table.py) -----------------------

SEQ = 10  # CFG_SEQ of the bank test below: even, no writer
#: A bank's state: valid at a generation counted back from SEQ (0: SEQ's own; 2: the one before;
#: -2: a generation above SEQ, as a writer's in progress, the oldest of all counted back) or corrupt.
BANK_STATES = [0, 2, -2, "corrupt"]


@pytest.mark.parametrize("a", BANK_STATES)
@pytest.mark.parametrize("b", BANK_STATES)
def test_the_valid_bank_of_the_newest_generation_is_the_config(backend, a, b):
    """Whichever of the two banks is valid and newest (counted back from CFG_SEQ; a tie: the
    first) is the config in force, as for the keyed banks; none valid is a corrupt segment."""
    c = private_cells(backend)
    Bucket.initialise(c, START, FakeClock()())
    tpn = Bucket(c, FakeClock()).tpn
    c.store(L.CFG_SEQ, SEQ)
    for bank, state, cfg in zip(config_banks.BANKS, (a, b), (FIRST, SECOND)):
        vals = [v for _, v in config_words(cfg, tpn, False, 0)]
        gen = SEQ - (0 if state == "corrupt" else state)
        words = config_banks.PLAIN.stored(gen, vals)
        for off, w in zip(bank, words[:-1] + (words[-1] ^ (state == "corrupt"),)):
            c.store(off, w)
    valid = [(age, cfg) for age, cfg in ((a, FIRST), (b, SECOND)) if age != "corrupt"]
    if not valid:
        with pytest.raises(SegmentError):
            read_snapshot(c)
        return
    assert read_snapshot(c).config == min(valid, key=lambda v: v[0] % (1 << 64))[1]


def test_a_stalled_writer_that_writes_again_is_waited_for_again(monkeypatch):
    """A reader waits a writer that holds the lock past its timeout out once, then reads at once
    while the lock's value holds (``settled``'s ``_waited_out``); but a writer only stalled (a
    stopped process, resumed) writes again under the same value: what is read changes, and the
    reader waits for it again instead of reading its half-written words at once."""
    import time

    from shmlimit import adapt as A

    c = private_cells()
    A.write(c, A.Adapt(min_rate=1, max_rate=100))
    lock = config_banks.ConfigLock(c, L.CFG_SEQ, config_banks.CONFIG_LOCK_TIMEOUT_NS).__enter__()
    waits = []
    sleep = time.sleep
    monkeypatch.setattr(config_banks.time, "sleep", lambda s: (waits.append(s), sleep(s)))
    assert A.read(c).max_rate == 100  # waited out once
    first = len(waits)
    assert first > 0 and A.read(c).max_rate == 100 and len(waits) == first  # then at once
    lock.store(
        L.ADAPT_PARAMS[1], 0
    )  # the writer resumes: its first word (no adapt while it writes)
    A.read(c)
    assert len(waits) > first  # waited for again, not read half-written at once
