"""The MultiGate: one try over several rates, all or nothing, in one call, on every backend.

It answers True (every rate granted and counted), False (refused for certain
on some rate, nothing touched; only when bound to decide) or None (the slow
path decides).  These tests check each answer against the words it leaves,
that a rate's queued ticket is never passed, that a race gives the earlier
rates back exactly (real processes), and that the native gate and the
reference built from the four primitives agree on any state of the words.
"""

import mmap
import multiprocessing as mp
import time

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, given, settings
from support.cells import BACKENDS, backend, cells, cells_for, opened, segment  # noqa: F401 (fixtures)

from shmlimit.shm.cells import MASK64, multi_gate, native_available, open_cells
from shmlimit.shm.composites import Gate, MultiGate

# run once in CI: names each backend it checks
pytestmark = pytest.mark.backend_independent

INF = float("inf")
# two rates' words in one segment: (seq, tail, head, ceil, repl_ts, grants)
A = (8, 64, 128, 192, 256, 320)
B = (392, 448, 512, 576, 640, 704)
SEQ, TAIL, HEAD, CEIL, TS, GRANTS = range(6)


def now_ns():
    return time.monotonic_ns()


def gate(c, words, amount, tpn=1):
    c.store(words[SEQ], 2)
    return c.gate(
        words[SEQ],
        2,
        words[TAIL],
        words[HEAD],
        words[CEIL],
        words[TS],
        words[GRANTS],
        amount,
        1,
        tpn,
        1,
        False,
        INF,
    )


def setup(
    c,
    a_room,
    b_room,
    amount_a=10,
    amount_b=1,
    caps=(1000, 1000),
    decide=True,
    names=("requests", "tokens"),
    pending=False,
):
    """Two rates with ``a_room`` and ``b_room`` tokens in their buckets; nothing pending unless asked."""
    ts = now_ns() - 10**9 if pending else now_ns() + 10**12
    for words, room in ((A, a_room), (B, b_room)):
        c.store(words[TAIL], 1000)
        c.store(words[HEAD], (1000 + room) & MASK64)
        c.store(words[TS], ts)
    gates = [gate(c, A, amount_a), gate(c, B, amount_b)]
    return multi_gate(gates, caps, decide, names)


def words(c):
    return [c.load(off) for off in A + B]


def test_granted_on_every_rate_and_counted_on_each(cells):
    m = setup(cells, 25, 3)
    assert m.try_grab() is True and m.try_grab() is True
    assert [cells.load(A[TAIL]), cells.load(B[TAIL])] == [1020, 1002]
    assert [cells.load(A[GRANTS]), cells.load(B[GRANTS])] == [2, 2]


def test_one_rate_short_refuses_touching_nothing(cells):
    m = setup(cells, 25, 0)  # the second rate has no token, and none is pending
    before = words(cells)
    assert m.try_grab() is False
    assert words(cells) == before


def test_a_refusal_is_judged_at_the_reading_passed(cells):
    """``now_ns`` (an injected clock's reading) stands for the clock, on every rate: the second
    rate's one token short is certain up to 0 ns after its TS, undecided 1 ns later (tpn 1)."""
    m = setup(cells, 25, 0)
    ts = cells.load(B[TS])  # far ahead of the real clock: it must not be read
    before = words(cells)
    assert m.try_grab(ts) is False and m.try_grab_ops((1, 1), ts) is False
    assert m.try_grab(ts + 1) is None and m.try_grab_ops({"tokens": 1}, ts + 1) is None
    assert m.try_grab_ops((1, 0), ts) is True  # the first rate alone has room: granted
    with pytest.raises(ValueError, match="now_ns"):
        m.try_grab(0)
    with pytest.raises(ValueError, match="now_ns"):
        m.try_grab_ops(1, -1)
    assert words(cells)[6:] == before[6:]  # the second rate untouched


def test_without_decide_a_refusal_is_left_to_the_slow_path(cells):
    m = setup(cells, 25, 0, decide=False)  # rates on different clocks: the slow path judges
    before = words(cells)
    assert m.try_grab() is None
    assert words(cells) == before


def test_undecided_when_a_replenish_could_grant(cells):
    m = setup(cells, 25, 0, pending=True)  # a second of tokens is pending on both
    before = words(cells)
    assert m.try_grab() is None
    assert words(cells) == before


def test_a_changed_config_on_any_rate_is_undecided(cells):
    m = setup(cells, 25, 3)
    cells.store(B[SEQ], 3)
    before = words(cells)
    assert m.try_grab() is None and m.try_grab_ops((1, 1)) is None
    assert words(cells) == before


def test_a_ticket_queued_on_any_rate_is_never_passed(cells):
    m = setup(cells, 25, 3)
    cells.store(B[TAIL], 1000 + 3 + 5)  # someone queued for 5 tokens beyond the head: FIFO
    before = words(cells)
    assert m.try_grab() is False
    assert words(cells) == before


def test_ops_per_rate_as_a_tuple_a_dict_or_one_int(cells):
    m = setup(cells, 100, 100)
    assert m.try_grab_ops((2, 50)) is True  # 20 tokens of A, 50 of B
    assert [cells.load(A[TAIL]), cells.load(B[TAIL])] == [1020, 1050]
    assert [cells.load(A[GRANTS]), cells.load(B[GRANTS])] == [2, 50]
    assert m.try_grab_ops({"tokens": 30}) is True  # a rate not named costs nothing
    assert [cells.load(A[TAIL]), cells.load(B[TAIL])] == [1020, 1080]
    assert m.try_grab_ops(3) is True  # 3 ops on every rate
    assert [cells.load(A[TAIL]), cells.load(B[TAIL])] == [1050, 1083]
    assert (
        m.try_grab_ops({"requests": 1, "tokens": 18}) is False
    )  # 17 left on B: refused, nothing taken
    assert [cells.load(A[TAIL]), cells.load(B[TAIL])] == [1050, 1083]


@pytest.mark.parametrize(
    "ops",
    [
        (1,),
        (1, 1, 1),
        (True, 1),
        (1, -1),
        (1.0, 1),
        (0, 0),
        0,
        -1,
        True,
        1.5,
        "1",
        None,
        [1, 1],
        {"requests": 1, "other": 1},
        {"requests": True},
        {"requests": 0},
        {},
        (101, 1),
        (1, 2**70),
        (1, 1001),
    ],
)
def test_anything_but_plain_counts_within_the_capacities_is_left_to_the_slow_path(cells, ops):
    m = setup(cells, 1000, 1000)
    before = words(cells)
    assert m.try_grab_ops(ops) is None
    assert words(cells) == before


def test_costs_by_name_need_the_names(cells):
    m = setup(cells, 100, 100, names=None)
    assert m.try_grab_ops({"requests": 1}) is None
    assert m.try_grab_ops((1, 1)) is True


@pytest.mark.parametrize(
    "args, error",
    [
        (((), (), True, None), ValueError),
        (((0,), (10, 10), True, None), ValueError),  # one capacity per gate
        (((0, 1), (10, 10), True, ("a",)), ValueError),  # one name per gate
        (((0, 1), (5, 10), True, None), ValueError),  # a capacity below its gate's amount
        (((0, 1), (10, 1 << 62), True, None), ValueError),
    ],
)
def test_bad_bindings_are_refused(cells, args, error):
    gates = (gate(cells, A, 10), gate(cells, B, 1))
    bound = (tuple(gates[i] for i in args[0]),) + args[1:]
    with pytest.raises(error):
        multi_gate(*bound)


def test_refuses_to_run_once_any_cells_are_closed(backend, segment):  # noqa: F811
    c = cells_for(segment[1], 4096, backend)
    mm2 = mmap.mmap(-1, 4096)
    c2 = cells_for(mm2, 4096, backend)
    c.store(A[HEAD], 100)
    c2.store(B[HEAD], 100)
    c.store(A[TS], now_ns() + 10**12)
    c2.store(B[TS], now_ns() + 10**12)
    m = multi_gate([gate(c, A, 1), gate(c2, B, 1)], [100, 100], True)
    assert m.try_grab() is True
    c2.close()
    if backend != "atomics-api":  # (the public API's views refuse on their own terms)
        with pytest.raises(ValueError):
            m.try_grab()
        assert c.load(A[TAIL]) == 1  # nothing taken from the rate still open
    c.close()
    mm2.close()


# ---- a race gives the earlier rates back exactly: real processes, nothing replenishes ------------


def _racer(name, backend, kind, q):
    granted = 0
    with opened(name, backend) as c:
        if kind == "multi":
            m = multi_gate([gate(c, A, 2), gate(c, B, 1)], [1 << 40, 1 << 40], True)
            for _ in range(4000):
                r = m.try_grab()
                granted += r is True
        else:  # takes B alone, racing the multis between their look and their take
            g = gate(c, B, 1)
            for _ in range(4000):
                granted += g.try_grab() is True
    q.put((kind, granted))


def test_racing_processes_keep_every_rate_exact(backend, segment):  # noqa: F811
    name, mm = segment
    c = cells_for(mm, 4096, backend)
    try:
        for words_, room in ((A, 4000), (B, 1500)):
            c.store(words_[SEQ], 2)
            c.store(words_[TAIL], 0)
            c.store(words_[HEAD], room)
            c.store(words_[TS], now_ns() + 10**12)  # nothing pending: every answer is certain
        ctx = mp.get_context("fork")
        q = ctx.Queue()
        kinds = ["multi", "multi", "single"]
        procs = [ctx.Process(target=_racer, args=(name, backend, k, q)) for k in kinds]
        try:
            for p in procs:
                p.start()
            out = [q.get(timeout=120) for _ in procs]
        finally:
            for p in procs:
                p.join(60)
                if p.is_alive():
                    p.kill()
                    p.join()
        multi = sum(g for k, g in out if k == "multi")
        single = sum(g for k, g in out if k == "single")
        # B: every token taken once, by a grant, and none beyond its head
        assert c.load(B[TAIL]) == multi + single == 1500 and c.load(B[HEAD]) == 1500
        assert c.load(B[GRANTS]) == multi + single
        # A: a race's take goes back to the head, less whatever the head gained since it was read
        # (another give-back counts as gain too: time lost, never an extra token), so the tail
        # less the head's gain covers at least the grants, and the bucket never holds more than
        # its start less the grants
        gain = c.load(A[HEAD]) - 4000
        assert c.load(A[GRANTS]) == multi and c.load(A[TAIL]) - gain >= 2 * multi
        assert 0 <= c.load(A[HEAD]) - c.load(A[TAIL]) <= 4000 - 2 * multi
    finally:
        c.close()


# ---- a give-back whose CAS a replenish beat recomputes what it returns from the new head -------------


class _RacedWords:
    """Cells of a few words (a dict) whose first CAS on ``raced`` finds another move landed first:
    ``land`` is stored there just before that CAS (a replenish's add, up to a fence)."""

    size = 64

    def __init__(self, words, raced, land):
        self.words, self.raced, self.land = dict(words), raced, land

    def load(self, off):
        return self.words[off]

    def cas(self, off, expected, new):
        if off == self.raced and self.land is not None:
            self.words[off], self.land = self.land, None
        if self.words[off] != expected:
            return False
        self.words[off] = new
        return True


@pytest.mark.parametrize("land", [108, 103, 100])
def test_the_race_give_back_never_returns_what_the_head_gained_meanwhile(land):
    """The race give-back of a try over several rates (``Gate.give_back``; natively
    ``multi_give_back``, the same loop) returns ``amount`` less what the head gained since the
    take, and a replenish landing between its read and its CAS is such a gain: the retry counts
    it.  5 taken at head 100, the replenish lands the head at ``land``: the head ends at
    ``max(land, 105)``, never 5 past the replenish (with the old retry, 113 from 108: past a
    reservation's fence the replenish kept).  Tail 200 (a queue) so ``tail + cap`` is no clamp."""
    TAIL, HEAD = 8, 16
    cells = _RacedWords({0: 0, TAIL: 200, HEAD: 100, 24: 0, 32: 0}, HEAD, land=land)
    gate = Gate(cells, 0, 0, TAIL, HEAD, HEAD, 24, 32, 1, 1, 1, 1, False, INF)
    gate.give_back(5, 100, 10)  # taken when the head was at 100; no gain at its first look
    assert cells.land is None  # the replenish did land between the read and the CAS
    assert cells.words[HEAD] == max(land, 100 + 5)
    assert cells.words[TAIL] == 200  # the tail is never touched


@pytest.mark.parametrize("land", [108, 103])
def test_the_atomics_backends_race_give_back_counts_the_gain_too(land, monkeypatch):
    """The same race on the ``atomics`` backend's own words (its CAS called directly, the
    replenish landed just before the first one on HEAD): the head ends at ``max(land, 105)``
    (its gate once kept the first look's ``back`` after a failed CAS: 113 from 108)."""
    mm = mmap.mmap(-1, 4096)
    c = cells_for(mm, 4096, "atomics")
    try:
        for off, v in zip(A, (2, 200, 100, 0, 0, 0)):
            c.store(off, v)
        real_cas, lands = c._p.cas, [land]

        def cas(addr, expected, desired):  # the replenish lands between the read and the CAS
            if addr == c._base + A[HEAD] and lands:
                c.store(A[HEAD], lands.pop())
            return real_cas(addr, expected, desired)

        monkeypatch.setattr(c._p, "cas", cas)
        gate(c, A, 1).give_back(5, 100, 10)
        assert not lands and c.load(A[HEAD]) == max(land, 100 + 5) and c.load(A[TAIL]) == 200
    finally:
        c.close()
        mm.close()


# ---- the native gate and the reference agree on any state of the words --------------------------


@pytest.mark.skipif(not native_available(), reason="the native extension is not built here")
@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    base=st.tuples(st.integers(0, MASK64), st.integers(0, MASK64)),
    room=st.tuples(st.integers(-(1 << 20), 1 << 20), st.integers(-(1 << 20), 1 << 20)),
    amount=st.tuples(st.integers(1, 1 << 10), st.integers(1, 1 << 10)),
    cap_ops=st.tuples(st.integers(1, 1 << 10), st.integers(1, 1 << 10)),
    pending=st.tuples(st.booleans(), st.booleans()),
    seq_changed=st.tuples(st.booleans(), st.booleans()),
    ops=st.one_of(
        st.none(),
        st.integers(-2, 1 << 12),
        st.tuples(st.integers(-1, 1 << 12), st.integers(-1, 1 << 12)),
        st.dictionaries(st.sampled_from(["r", "t", "x"]), st.integers(-1, 1 << 12), max_size=3),
    ),
    decide=st.booleans(),
)
def test_native_and_reference_agree(base, room, amount, cap_ops, pending, seq_changed, ops, decide):
    far = now_ns()
    results = []
    for kind in ("native", "reference"):
        mm = mmap.mmap(-1, 4096)
        c = open_cells(mm, 4096, "native")
        try:
            gates = []
            for i, words_ in enumerate((A, B)):
                c.store(words_[SEQ], 3 if seq_changed[i] else 2)
                c.store(words_[TAIL], base[i])
                c.store(words_[HEAD], (base[i] + room[i]) & MASK64)
                # pending: every ns since boot is a token (far more than any shortfall here); else none
                c.store(words_[TS], 0 if pending[i] else far + 10**12)
                args = (
                    words_[SEQ],
                    2,
                    words_[TAIL],
                    words_[HEAD],
                    words_[CEIL],
                    words_[TS],
                    words_[GRANTS],
                    amount[i],
                    1,
                    1,
                    1,
                    False,
                    INF,
                )
                gates.append(c.gate(*args) if kind == "native" else Gate(c, *args))
            caps = [a * k for a, k in zip(amount, cap_ops)]
            m = (
                multi_gate(gates, caps, decide, ("r", "t"))
                if kind == "native"
                else MultiGate(gates, caps, decide, ("r", "t"))
            )
            assert type(m).__module__ == (
                "shmlimit.shm._native" if kind == "native" else "shmlimit.shm.composites"
            )
            r = m.try_grab() if ops is None else m.try_grab_ops(ops)
            results.append((r, [c.load(off) for off in A + B]))
        finally:
            c.close()
            mm.close()
    assert results[0] == results[1]
    r, after = results[0]
    if r is not True:  # refused or undecided: nothing touched
        assert after[1] == base[0] and after[7] == base[1] and after[5] == after[11] == 0
