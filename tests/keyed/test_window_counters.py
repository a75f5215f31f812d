"""The window-counter kinds (fixed window, sliding window counter) of the keyed table, on both backends.

A stateful hypothesis test drives several simulated processes (each its own
``WindowCounters`` and cells over one mapping) with an injected clock against
exact models of the two ``limits`` strategies, with processes killed in the
middle of a window roll (V0 left ROLLING, with or without the snapshot
written) and inserts left BUSY by a dead pid.  Then real processes (fork) hit
one key at once: every increment is counted exactly once.
"""

import math
import mmap
import multiprocessing as mp
import os
import unittest

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, rule
from support.cells import Before
from support.clock import FakeClock
from support.models import on_each_backend
from support.procs import run_processes

from shmlimit.errors import KeyTableFullError, SegmentError
from shmlimit.keyed import cells as KC
from shmlimit.keyed import layout as K
from shmlimit.keyed import windows as W
from shmlimit.keyed.stats import sample_windows
from shmlimit.keyed.window_table import WindowTable
from shmlimit.shm.cells import native_available, open_cells

BACKENDS = ["atomics"] + (["native"] if native_available() else [])
DEAD_PID = (1 << K.PID_BITS) - 7  # above pid_max: never a live process
SECRET = (0x0123456789ABCDEF, 0x0FEDCBA987654321)


class Mapping:
    """A keyed table of window counters in an anonymous mapping, laid out as in a segment."""

    def __init__(self, nkeys):
        self.nkeys = nkeys
        self.size = K.segment_size(nkeys, 0)
        self.mm = mmap.mmap(-1, self.size)

    def process(self, backend, clock, pid=None, evict=False, store_keys=False):
        c = open_cells(self.mm, self.size, backend)
        t = KC.SlotTable(
            c,
            K.slots_offset(0),
            self.nkeys,
            min(K.PROBE, self.nkeys),
            K.KEYS_LIVE,
            K.EVICTED,
            K.owner(pid or os.getpid()),
            K.CUT,
            evict,  # by default refuse when full: the exact models below keep every live window
        )
        return W.WindowCounters(t, *SECRET, K.REFUSED, clock, store_keys=store_keys)


class FixedModel:
    """limits' fixed window: a window starts at the first hit after the last one ended."""

    def __init__(self):
        self.windows = {}  # key -> [end_ms, count]
        self.floor = {}  # key -> the end a cleared key's next window may be raised to (see clear)

    def incr(self, key, w, now, amount):
        e = self.windows.get(key)
        if e is None or e[0] <= now:
            e = self.windows[key] = [now + w + 1, 0]
        e[1] += amount
        return e[1]

    def allowed_ends(self, key, w, now):
        """A key cleared and hit again in the same ms may reuse its slot above the old value: 1 ms later."""
        return {now + w + 1, max(now + w + 1, self.floor.get(key, 0))}

    def clear(self, key, now):
        e = self.windows.pop(key, None)
        if e is not None:
            self.floor[key] = e[0] + 1

    def get(self, key, now):
        e = self.windows.get(key)
        return e[1] if e and e[0] > now else 0


class SlidingModel:
    """limits' sliding window counter, exact, one process: a key's first hit starts its windows;
    a key with no hit for two windows starts afresh (as limits' Redis storage keeps it)."""

    def __init__(self):
        self.keys = {}  # (key, w) -> [start_ms, prev, cur]
        self.floor = {}  # (key, w) -> a later start a cleared key's slot may be re-inserted at

    def state(self, key, w, ns):
        now = ns // 1_000_000
        e = self.keys.get((key, w))
        if e is None or now >= e[0] + 2 * w:
            return now, 0, 0
        if now >= e[0] + w:
            return e[0] + w, e[2], 0
        return e[0], e[1], e[2]

    @staticmethod
    def weight(start, w, ns):
        return min(1.0, max(0.0, ((start + w) * 1_000_000 - ns) / (w * 1_000_000)))

    def acquire(self, key, w, ns, limit, amount, actual_start):
        if amount > limit:
            return False
        start, prev, cur = self.state(key, w, ns)
        if (key, w) not in self.keys and (key, w) in self.floor:
            start = (
                actual_start()
            )  # re-inserted above its cleared slot's value (at most 2W + 1 ms on)
            assert ns // 1_000_000 <= start <= max(ns // 1_000_000, self.floor.pop((key, w)))
        if math.floor(prev * self.weight(start, w, ns) + cur) + amount > limit:
            self.keys[(key, w)] = [start, prev, cur]
            return False
        self.keys[(key, w)] = [start, prev, cur + amount]
        return True

    def clear(self, key, w, ns):
        e = self.keys.pop((key, w), None)
        if e is not None:
            self.floor[(key, w)] = e[0] + 2 * w + 1


KEYS = st.sampled_from(["a", "b", "c", "client-7", "é"])
SKEYS = st.sampled_from(
    ["a", "é"]
)  # few keys for the sliding windows, so that their counts carry over
SLIDE = st.sampled_from([1000, 3000])  # window lengths (ms)


class Counters(RuleBasedStateMachine):
    backend = "atomics"

    @initialize(nprocs=st.integers(1, 4))
    def setup(self, nprocs):
        self.clock = FakeClock(10**12 + 123_456_789)
        self.map = Mapping(256)
        self.procs = [self.map.process(self.backend, self.clock) for _ in range(nprocs)]
        self.fixed, self.sliding = FixedModel(), SlidingModel()

    def now_ms(self):
        return self.clock() // 1_000_000

    @rule(p=st.integers(0, 3), key=KEYS, w=st.sampled_from([1000, 2000]), amount=st.integers(1, 3))
    def incr(self, p, key, w, amount):
        proc = self.procs[p % len(self.procs)]
        fresh = self.fixed.get(key, self.now_ms()) == 0
        allowed = self.fixed.allowed_ends(key, w, self.now_ms())
        got = proc.incr(key, w / 1000, amount)
        assert got == self.fixed.incr(key, w, self.now_ms(), amount)
        if fresh:
            end = self.now_ms() + proc.expiry_ms(key)
            assert end in allowed
            self.fixed.windows[key][0] = end
            self.fixed.floor.pop(key, None)

    @rule(p=st.integers(0, 3), key=KEYS)
    def get_fixed(self, p, key):
        proc = self.procs[p % len(self.procs)]
        assert proc.get(key) == self.fixed.get(key, self.now_ms())
        e = self.fixed.windows.get(key)
        assert proc.expiry_ms(key) == (e[0] - self.now_ms() if e and e[0] > self.now_ms() else 0)

    @rule(p=st.integers(0, 3), key=KEYS)
    def clear_fixed(self, p, key):
        self.procs[p % len(self.procs)].clear(key)
        self.fixed.clear(key, self.now_ms())

    def slot_start(self, proc, key, w):
        d, home, _ = proc._sliding_key(key, w)
        s, _ = proc.t.find(d, home)
        return W.unpack(proc.c.load(s + K.S_V0) - proc.c.load(s + K.S_BASE))[0] - 2 * w

    @rule(
        p=st.integers(0, 3), key=SKEYS, w=SLIDE, limit=st.integers(0, 5), amount=st.integers(1, 2)
    )
    def acquire_sliding(self, p, key, w, limit, amount):
        proc = self.procs[p % len(self.procs)]
        got = proc.acquire_sliding(key, limit, w / 1000, amount)
        assert got == self.sliding.acquire(
            key, w, self.clock(), limit, amount, lambda: self.slot_start(proc, key, w)
        )

    @rule(p=st.integers(0, 3), key=SKEYS, w=SLIDE)
    def read_sliding(self, p, key, w):
        prev, prev_ttl, cur, cur_ttl = self.procs[p % len(self.procs)].sliding(key, w / 1000)
        start, mprev, mcur = self.sliding.state(key, w, self.clock())
        assert (prev, cur) == (mprev, mcur)
        left = ((start + w) * 1_000_000 - self.clock()) / 1e9
        assert prev_ttl == pytest.approx(left if mprev else 0.0) and cur_ttl == pytest.approx(
            left + w / 1000
        )

    @rule(p=st.integers(0, 3), key=SKEYS, w=SLIDE)
    def clear_sliding(self, p, key, w):
        self.procs[p % len(self.procs)].clear_sliding(key, w / 1000)
        self.sliding.clear(key, w, self.clock())

    @rule(key=SKEYS, w=SLIDE, snapshot=st.booleans())
    def die_mid_roll(self, key, w, snapshot):
        """A process that began moving a key on from an ended window (V0 -> ROLLING) and was killed."""
        proc = self.procs[0]
        d, home, _ = proc._sliding_key(key, w)
        s, ctl = proc.t.find(d, home)
        if s is None:
            return
        v, base = proc.c.load(s + K.S_V0), proc.c.load(s + K.S_BASE)
        x, rolling, cnt = W.unpack(v - base)
        now = self.now_ms()
        if rolling or now < x - w:
            return
        assert proc.c.cas(s + K.S_V0, v, ((v - base) | W.FLAG) + base)
        if snapshot:  # it even wrote the snapshot: everything but the last CAS
            snap = W.pack(x - w, cnt, True) if now < x else W.pack(now, 0, True)
            if proc.c.load(s + K.S_V1) < snap:
                proc.c.store(s + K.S_V1, snap)

    @rule(key=st.sampled_from(["dead-1", "dead-2"]))
    def die_mid_insert(self, key):
        """A slot left BUSY by an inserter killed before it wrote anything: later inserters reclaim it."""
        dead = self.map.process(self.backend, self.clock, DEAD_PID)
        d, home, _ = dead._key(b"F", key)
        for i in range(dead.t.probe):
            s = dead.t._slot(home, i)
            ctl = dead.c.load(s)
            if ctl & 0xFF in (K.EMPTY, K.TOMB):
                dead.c.cas(s, ctl, K.ctrl(K.BUSY, K.owner(DEAD_PID), (ctl >> 40) + 1))
                return

    @rule(ms=st.sampled_from([1, 7, 100, 250, 999, 1000, 1001, 2500, 6000]))
    def tick(self, ms):
        self.clock.advance(ms * 1_000_000 + 17)


TestCountersAtomics, TestCountersNative = on_each_backend(
    Counters, settings(max_examples=40, stateful_step_count=50, deadline=None)
)


TWIN_KEYS = st.sampled_from(["a", "b", "c", "d", "e", "f", "é", b"raw", "k" * 40])


class FixedTwins(RuleBasedStateMachine):
    """The native fixed-window step (``FixedWindows`` in ``_native.c``) against its reference, the
    portable backend's ``WindowCounters.incr``, on twin mappings driven alike: after every step
    both gave the same answer and every word of both mappings is the same.  Small tables, more
    keys than slots, eviction on or off, keys stored or not, saturated windows, cleared keys and
    slots left BUSY or PEND (with a key's digest) by dead inserters."""

    @initialize(evict=st.booleans(), store=st.booleans(), nkeys=st.sampled_from([2, 4, 8]))
    def setup(self, evict, store, nkeys):
        self.clock = FakeClock(10**12 + 123_456_789)
        self.maps = [Mapping(nkeys), Mapping(nkeys)]
        self.ref, self.nat = (
            m.process(b, self.clock, evict=evict, store_keys=store)
            for m, b in zip(self.maps, ("atomics", "native"))
        )
        assert self.ref._native is None and self.nat._native is not None

    def both(self, step):
        answers = []
        for p in (self.ref, self.nat):
            try:
                answers.append(step(p))
            except KeyTableFullError as e:
                answers.append(("full", e.busy, str(e)))
        assert answers[0] == answers[1]
        assert bytes(self.maps[0].mm) == bytes(self.maps[1].mm)
        return answers[0]

    @rule(
        key=TWIN_KEYS,
        w=st.sampled_from([1, 1000, 1500, 60_000]),
        amount=st.integers(0, 3) | st.just(W.CMAX - 1),
    )
    def incr(self, key, w, amount):
        self.both(lambda p: p.incr(key, w / 1000, amount))

    @rule(key=TWIN_KEYS)
    def clear(self, key):
        self.both(lambda p: p.clear(key))

    @rule(ms=st.sampled_from([0, 1, 2, 999, 1000, 1501, 60_001]))
    def tick(self, ms):
        self.clock.advance(ms * 1_000_000 + 17)

    @rule(key=TWIN_KEYS, pend=st.booleans(), skip=st.integers(0, 2))
    def die_mid_insert(self, key, pend, skip):
        """A dead inserter left the ``skip``-th free slot of ``key``'s window BUSY, or PEND with the
        key's digest and a first window (it died in its re-scan)."""

        def leave(p):
            d, home, _ = p._key(b"F", key)
            free = [
                s
                for s in (p.t._slot(home, i) for i in range(p.t.probe))
                if p.c.load(s) & 0xFF in (K.EMPTY, K.TOMB)
            ]
            if len(free) <= skip:
                return None
            s = free[skip]
            ctl = p.c.load(s)
            gen = (ctl >> 40) + 1
            if pend:
                p.c.store(s + K.S_D0, d[0])
                p.c.store(s + K.S_D1, d[1])
                p.c.store(s + K.S_V0, p.c.load(s + K.S_V0) + W.pack(1, 1))
            p.c.store(s, K.ctrl(K.PEND if pend else K.BUSY, K.owner(DEAD_PID), gen))
            return s

        self.both(leave)

    @rule(key=TWIN_KEYS, skip=st.integers(0, 2))
    def wear_out(self, key, skip):
        """The ``skip``-th free slot of ``key``'s window worn out (``wear``): inserts pass it by."""

        def leave(p):
            d, home, _ = p._key(b"F", key)
            free = [
                s
                for s in (p.t._slot(home, i) for i in range(p.t.probe))
                if p.c.load(s) & 0xFF in (K.EMPTY, K.TOMB)
            ]
            return wear(p, free[skip]) if len(free) > skip else None

        self.both(leave)


TestFixedTwins = unittest.skipUnless(native_available(), "the native extension is not built here")(
    FixedTwins.TestCase
)
TestFixedTwins.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


def test_the_native_step_refuses_bad_arguments_and_regions():
    """Its caller validates; a direct call out of range is refused, nothing written."""
    if not native_available():
        pytest.skip("the native extension is not built here")
    from shmlimit.shm._native import fixed_windows

    m = Mapping(8)
    p = m.process("native", FakeClock())
    for args in [
        ("k", 0, 1, 5),
        ("k", W.MAX_WINDOW_MS + 1, 1, 5),
        ("k", 1000, W.CMAX + 1, 5),
        ("k", 1000, 1, W._MAX_NOW_MS + 1),
    ]:
        with pytest.raises(ValueError, match="window_ms"):
            p._native.incr(*args)
    with pytest.raises(TypeError, match="key must be a str or bytes"):
        p._native.incr(3, 1000, 1, 5)
    assert bytes(m.mm[K.slots_offset(0) :]) == bytes(m.size - K.slots_offset(0))
    good = (K.slots_offset(0), 8, 8, *SECRET, K.KEYS_LIVE, K.EVICTED, K.REFUSED, 1, K.CUT, 0)
    for i, bad in [(0, m.size), (1, m.size // 64), (2, 9), (5, m.size), (9, 4)]:
        with pytest.raises(IndexError, match="outside the mapping"):
            fixed_windows(p.c, *good[:i], bad, *good[i + 1 :])
    with pytest.raises(TypeError, match="NativeCells"):
        fixed_windows(open_cells(m.mm, m.size, "atomics"), *good)


def _forked_hit(name, out):
    t = _inherited[name]
    t.incr("child", 60)
    me = K.owner(os.getpid())
    native = t.counters._native
    out.put((t.counters.t.pid == me, native is None or native.pid == me, t.moving.t.pid == me))


_inherited = {}


def test_a_forked_child_inserts_as_itself(name):
    """Its first use rebinds every inserter of the table (the reference's and the native one)
    to its own pid: a slot it leaves mid-insert is judged by its own life, not its parent's."""
    t = WindowTable(name, keys=64)
    t.incr("parent", 60)
    _inherited[name] = t
    try:
        [got] = run_processes(mp.get_context("fork"), _forked_hit, [(name,)])
        assert got == (True, True, True)
        assert t.get("child") == 1
    finally:
        _inherited.pop(name)
        t.close()


def _forked_read(name, out):
    t = _inherited[name]
    seen = (t.keys_live, t.evicted, t.refused, "keys=1/" in repr(t))
    out.put((seen, t._att.joined))


def test_a_forked_childs_counts_and_repr_only_read(name):
    """A forked child that reads a table's counts (and its repr) is not registered by it: its
    reads are no use of the table (a child that never uses it is never listed)."""
    t = WindowTable(name, keys=64)
    t.incr("parent", 60)
    _inherited[name] = t
    try:
        [got] = run_processes(mp.get_context("fork"), _forked_read, [(name,)])
        assert got == ((1, 0, 0, True), False)
    finally:
        _inherited.pop(name)
        t.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_live_window_is_never_evicted_a_full_table_refuses(backend):
    clock = FakeClock()
    m = Mapping(8)
    p = m.process(backend, clock)
    assert [p.incr(f"k{i}", 10) for i in range(8)] == [1] * 8
    live = [f"k{i}" for i in range(40) if p.get(f"k{i}")]
    assert len(live) == 8
    with pytest.raises(KeyTableFullError):
        for i in range(8, 40):
            p.incr(f"k{i}", 10)
    assert all(p.get(k) >= 1 for k in live)  # none lost
    assert p.c.load(K.REFUSED) >= 1
    clock.advance_seconds(10.002)  # every window ended: their slots may be reused
    assert p.incr("new", 10) == 1 and p.c.load(K.EVICTED) == 1


def stall(p, d, home):
    """A live process's insert of digest ``d`` stalled in the key's home slot (PEND, not moving)."""
    s = p.t._slot(home, 0)
    p.c.store(s + K.S_D0, d[0])
    p.c.store(s + K.S_D1, d[1])
    p.c.store(s, K.ctrl(K.PEND, K.owner(os.getppid()), 1))
    return s


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["fixed", "sliding"])
def test_a_new_key_gives_way_to_a_live_stalled_insert_of_it(backend, kind, monkeypatch):
    """The first hit of a key whose insert a live process left half done gives way (busy), counts
    nothing, and is granted once that insert is gone."""
    monkeypatch.setattr(KC, "PEND_NS", 2_000_000)  # the reference's bound (the native one: 0.2 s)
    p = Mapping(8).process(backend, FakeClock())
    if kind == "fixed":
        d, home, _ = p._key(b"F", "k")
        hit = lambda: p.incr("k", 10, 2)  # noqa: E731
    else:
        d, home, _ = p._sliding_key("k", 10_000)
        hit = lambda: p.acquire_sliding("k", 5, 10, 2)  # noqa: E731
    s = stall(p, d, home)
    with pytest.raises(KeyTableFullError) as e:
        hit()
    assert e.value.busy and p.c.load(K.REFUSED) == 0 and p.c.load(K.KEYS_LIVE) == 0
    p.c.store(s, K.ctrl(K.TOMB, 0, 1))  # the stalled insert gave way at last
    assert hit() in (2, True)
    assert (p.get("k") if kind == "fixed" else p.sliding("k", 10)[2]) == 2


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_arguments_name_the_range_and_change_nothing(backend):
    m = Mapping(8)
    p = m.process(backend, FakeClock())
    for call, msg in [
        (lambda: p.incr("k", 0), "expiry"),
        (lambda: p.incr("k", 1, -1), "amount"),
        (lambda: p.incr("k", 1, W.CMAX + 1), "amount"),
        (lambda: p.acquire_sliding("k", W.CMAX + 1, 1), "limit"),
        (lambda: p.acquire_sliding("k", 3, float("nan")), "expiry"),
    ]:
        with pytest.raises(ValueError, match=msg):
            call()
    with pytest.raises(TypeError):
        p.incr(3, 1)
    assert bytes(m.mm[K.slots_offset(0) :]) == bytes(m.size - K.slots_offset(0))


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_saturated_window_refuses(backend):
    p = Mapping(8).process(backend, FakeClock())
    assert p.incr("k", 5, W.CMAX) == W.CMAX
    assert p.incr("k", 5) == W.OVER and p.get("k") == W.CMAX


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_key_of_any_length_is_counted_under_its_whole_bytes(name, backend, monkeypatch):
    """A ``limits`` key over 4096 bytes (a client's API key header in it) raised ValueError: a
    500 under Flask-Limiter, or no limit at all with ``swallow_errors``.  The table keeps only
    digests: a window key may be any length, told apart by all its bytes, stored for display
    (``store_keys``) by its first ones; the same bytes count as the same key on either backend."""
    monkeypatch.setenv("SHMLIMIT_BACKEND", backend)
    now = [10**15]
    wt = WindowTable(name, keys=64, clock=lambda: now[0], store_keys=True)
    long_a, long_b = "k" * 5000 + "a", ("k" * 5000 + "b").encode()
    try:
        assert [wt.incr(long_a, 60) for _ in range(3)] == [1, 2, 3]
        assert wt.incr(long_b, 60) == 1  # the same first 4096 bytes: another key
        assert wt.incr(long_a.encode(), 60) == 4  # a str is its UTF-8 bytes
        assert wt.get(long_a) == 4 and 59 < wt.expires_in(long_a) <= 60.001
        assert [wt.acquire_sliding(long_a, 2, 60) for _ in range(3)] == [True, True, False]
        assert [wt.acquire_entry(long_b, 2, 60) for _ in range(3)] == [True, True, False]
        assert wt.moving_window(long_b, 60)[1] == 2
        keys = {s.key for s in sample_windows(name, 0, 64, now[0])[0]}
        assert keys == {"k" * K.DISPLAY_BYTES + "..."}
        assert wt.clear(long_a) and wt.get(long_a) == 0
        with pytest.raises(TypeError, match="key must be a str or bytes"):
            wt.incr(5, 60)
        for key in ("\udc80", "k" * 5000 + "\udc80"):  # the native step's, and the portable one's
            with pytest.raises(ValueError, match=r"key must be .* UTF-8 \(no lone surrogate\)"):
                wt.incr(key, 60)
        # around the native step's 4096-byte buffer (longer keys take the portable step)
        for key in ("k" * 4096, b"k" * 4097, "\u00e9" * 2048, "\u00e9" * 2049):
            assert [wt.incr(key, 60) for _ in range(2)] == [1, 2]
    finally:
        wt.close()


def _hammer(name, n, out):
    t = WindowTable(name)
    out.put(
        (
            [t.incr("shared", 600) for _ in range(n)],
            sum(t.acquire_sliding("slide", 777, 600) for _ in range(n)),
        )
    )
    t.close()


@pytest.mark.parametrize("start", ["fork", "spawn"])
def test_real_processes_count_every_hit_exactly_once(name, start):
    table = WindowTable(name, keys=1024)
    results = run_processes(mp.get_context(start), _hammer, [(name, 1500)] * 4)
    counts = sorted(c for r, _ in results for c in r)
    assert counts == list(
        range(1, 6001)
    )  # every increment linearized once: no lost or doubled update
    assert sum(g for _, g in results) == 777  # the sliding limit, exactly, across the processes
    assert table.get("shared") == 6000
    table.close()


def test_segment_kinds_are_not_mixed_up(name):
    import shmlimit
    from shmlimit.keyed.stats import adapted_keys, sample_keys, sample_windows

    kl = shmlimit.KeyedLimiter(name, rate=10, keys=64)
    with pytest.raises(SegmentError, match="KeyedLimiter"):
        WindowTable(name)
    with pytest.raises(SegmentError, match="is a KeyedLimiter of one rate, not a window table"):
        sample_windows(name, 0, 8)  # the tools read without joining: the same refusal
    kl.close()
    kl.unlink()
    t = WindowTable(name, keys=64)
    with pytest.raises(SegmentError, match="window counters"):
        shmlimit.KeyedLimiter(name)
    for look in (lambda: sample_keys(name, 0, 8), lambda: adapted_keys(name)):
        with pytest.raises(SegmentError, match="is a window table .*, not a KeyedLimiter"):
            look()
    t.close()


def test_a_corrupt_header_is_refused(name):
    t = WindowTable(name, keys=64)
    t.close()
    path = f"/dev/shm/shmlimit.{name}"
    with open(path, "r+b") as f:
        f.seek(K.NOVR_OFF)
        f.write((5).to_bytes(8, "little"))  # a window table with override entries: not one we wrote
    with pytest.raises(SegmentError, match="corrupt"):
        WindowTable(name)


def wear(p, s):
    """Slot ``s`` a TOMB whose last word would lift any new tenant's BASE past ``BASE_MAX``: a slot
    worn out by keys of long windows cleared or evicted early for keys of short ones."""
    p.c.store(s + K.S_V0, K.DEAD | 1 << 62)  # 2**61 above any first value a key takes here
    p.c.store(s, K.ctrl(K.TOMB, 0, (p.c.load(s) >> 40) + 1))
    return s


def _kind(p, kind, w_s):
    """(digest and home of a key, a hit of it, a clear of it) for ``kind``'s windows of ``w_s`` s."""
    if kind == "fixed":
        return (
            lambda key: p._key(b"F", key),
            lambda key: p.incr(key, w_s) >= 1,
            lambda key: p.clear(key),
        )
    return (
        lambda key: p._sliding_key(key, w_s * 1000),
        lambda key: p.acquire_sliding(key, 1000, w_s),
        lambda key: p.clear_sliding(key, w_s),
    )


DAY = 86_400


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["fixed", "sliding"])
def test_keys_cleared_or_evicted_early_never_wear_their_slots_out(backend, kind):
    """A new tenant's BASE lifts its words above the last one its slot held, and was charged from
    the clock: every key cleared or evicted while its window ran took that window's rest from the
    slot's ``BASE_MAX`` (795 days of a window's ms).  So 3 evictions of 300-day keys made a slot
    refuse every key (a churn of new keys wore the whole table out), as 27 clears of a month-long
    one did.  Charged from the new key's first value, a window of one length takes nothing."""
    clock = FakeClock()
    p = Mapping(8).process(backend, clock, evict=True)
    _, hit, clear = _kind(p, kind, 300 * DAY)
    for i in range(200):  # a new key a second: 25 evictions a slot
        clock.advance_seconds(1)
        assert hit(f"ip-{i}")
    for _ in range(100):
        clock.advance_seconds(1)
        assert hit("alice") and clear("alice")
    assert p.c.load(K.REFUSED) == 0 and p.c.load(K.CUT) == 200 - 8 + 1  # and "alice" once
    slots = [p.t._slot(0, i) for i in range(8)]
    assert max(p.c.load(s + K.S_BASE) for s in slots) < 1 << 26  # 2 ms of a window's words


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["fixed", "sliding"])
def test_a_worn_slot_is_passed_by_for_the_next_of_the_window(backend, kind):
    """A slot whose last word would lift a new tenant's BASE past ``BASE_MAX`` takes no key; the
    insert takes the next slot of the window (it answered FULL, "full of keys that are still
    limited", with every other slot free).  With every slot worn out the error says so."""
    p = Mapping(8).process(backend, FakeClock())
    key, hit, _ = _kind(p, kind, 10)
    d, home, _ = key("k")
    wear(p, p.t._slot(home, 0))
    assert hit("k")
    assert p.t.find(d, home)[0] == p.t._slot(home, 1)
    assert p.c.load(K.REFUSED) == 0
    for i in range(8):
        if p.c.load(p.t._slot(home, i)) & 0xFF != K.LIVE:
            wear(p, p.t._slot(home, i))
    with pytest.raises(KeyTableFullError, match="takes no key until the clock passes") as e:
        hit("other")
    assert not e.value.busy and p.c.load(K.REFUSED) == 1 and p.c.load(K.KEYS_LIVE) == 1
    assert hit("k")  # the key that holds a slot is counted as ever


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_roller_stalled_past_its_keys_eviction_writes_nothing_on_the_next_tenant(backend):
    """A process moving key "old" on (V0 ROLLING) stalls before its V1 loop; one whose clock was
    read earlier takes the slot for "new" and grants its whole limit.  The roller resumed and
    raised the new tenant's V1 to its own snapshot, tagged after "new"'s start: "new"'s second
    window then took that stale snapshot (0) for its first window's count and granted the limit
    again 2 ms into it (100 of 100; 1 is right: 100 * 0.998 + 1 > 100)."""
    m = Mapping(1)  # one slot: every key's
    t0 = 10**6  # ms
    old = m.process(backend, FakeClock(t0 * 10**6))
    assert old.acquire_sliding("old", 100, 1)  # windows of 1 s: "old" holds nothing from t0 + 2 s
    new = m.process(backend, FakeClock((t0 + 2000) * 10**6))
    roller = m.process(backend, FakeClock((t0 + 3001) * 10**6))
    v1 = m.process(backend, FakeClock()).t._slot(0, 0) + K.S_V1
    roller.c = roller.t.c = Before(
        roller.c,
        lambda op, args: op == "load" and args[0] == v1,
        lambda: new.acquire_sliding("new", 100, 1, 100),
    )
    with pytest.raises(KeyTableFullError):  # "old" has no slot now: "new" holds it
        roller.acquire_sliding("old", 100, 1)
    assert new.sliding("new", 1)[2] == 100  # the insert's grant was made
    later = m.process(backend, FakeClock((t0 + 3002) * 10**6))  # 2 ms into "new"'s 2nd window
    assert later.sliding("new", 1)[0] == 100
    assert sum(later.acquire_sliding("new", 100, 1) for _ in range(100)) == 1


def _forge_below_base(p, key, base, v0):
    """``key``'s slot (fixed window) holds ``BASE = base`` and a word ``v0`` under it: only a hostile
    or corrupted segment has it (an honest tenant's words are its values plus its BASE)."""
    d, home, _ = p._key(b"F", key)
    s = p.t.find(d, home)[0]
    p.c.store(s + K.S_BASE, base)
    p.c.store(s + K.S_V0, v0)
    return s


M64 = (1 << 64) - 1
#: (BASE, V0) forged: a word just under BASE (the value's window end read as 2**39 - 1 without
#: the DEAD mask), further under it, and a BASE so high that every window written over it wraps
BELOW = [
    (1 << 56, (1 << 56) - 1),
    (1 << 56, (1 << 56) - (1 << 25) + 5),
    (1 << 56, (1 << 56) - (1 << 55)),
    (1 << 60, 0),
    (M64, 0),
    (M64, (1 << 63) - 1),
]


@pytest.mark.skipif(not native_available(), reason="the native extension is not built here")
@pytest.mark.parametrize("base, v0", BELOW)
def test_a_word_below_its_base_is_a_fresh_window_on_both_backends(base, v0):
    """The reference reads a value below its key's BASE as negative: a window that ended, so the
    next hit starts a new one.  The native step took the value modulo 2**64: a window ending in
    2**38 ms with an arbitrary count, answered that count (or OVER), and wrote a word with DEAD
    set under a LIVE control word, so the key moved to another slot and ``keys_live`` counted
    both.  And the reference's new word, the window plus a BASE near 2**64, was no 64-bit word:
    it raised OverflowError where the native step wrote it modulo 2**64.  Either way only the
    forged key's count may be wrong; the two must agree, and no other key is touched."""
    maps = [Mapping(8), Mapping(8)]
    answers = []
    for m, backend in zip(maps, ("atomics", "native")):
        p = m.process(backend, FakeClock(10**12))
        assert p.incr("k", 10) == 1 and p.incr("other", 10, 3) == 3
        _forge_below_base(p, "k", base, v0)
        answers.append([p.incr("k", 10) for _ in range(3)])
        assert p.get("other") == 3 and p.c.load(K.KEYS_LIVE) == 2
    assert answers[0] == answers[1]
    # a BASE near 2**64 lifts no window above it: each hit starts one
    assert answers[0] == ([1, 1, 1] if base == M64 else [1, 2, 3])
    assert bytes(maps[0].mm) == bytes(maps[1].mm)


@pytest.mark.skipif(not native_available(), reason="the native extension is not built here")
@pytest.mark.parametrize("base, v0", BELOW[:-1])  # (the last one's word wears the slot out)
def test_a_slot_whose_word_is_below_its_base_is_free_to_a_new_key_on_both_backends(base, v0):
    """A new key's insert reads such a slot's value as the reference does: below every now, a
    slot that holds no information, taken (the native insert read it as a window ending far in
    the future, so a full table that refuses refused the new key)."""
    maps = [Mapping(2), Mapping(2)]
    answers = []
    for m, backend in zip(maps, ("atomics", "native")):
        p = m.process(backend, FakeClock(10**12))
        assert p.incr("a", 10) == 1 and p.incr("b", 10) == 1
        _forge_below_base(p, "a", base, v0)
        try:
            answers.append((p.incr("c", 10), p.get("b"), p.c.load(K.KEYS_LIVE)))
        except KeyTableFullError as e:
            answers.append(("full", str(e)))
    assert answers[0] == answers[1] == (1, 1, 2)
    assert bytes(maps[0].mm) == bytes(maps[1].mm)
