"""The moving window (``limits``' exact sliding log) of the keyed table, on both backends.

Simulated processes (each its own ``MovingWindows`` and cells over one mapping) hit keys on an
injected clock, against an exact model of the sliding log, with writers killed between their two
compare-and-swaps (the entry written, V0 not moved on).  Then real processes hit one key at
once: exactly the limit is granted, whoever asks.
"""

import mmap
import multiprocessing as mp
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.clock import FakeClock
from support.procs import run_processes

from shmlimit.errors import KeyTableFullError
from shmlimit.keyed import cells as KC
from shmlimit.keyed import layout as K
from shmlimit.keyed import windows as W
from shmlimit.keyed.window_table import WindowTable
from shmlimit.shm.cells import native_available, open_cells

BACKENDS = ["atomics"] + (["native"] if native_available() else [])
SECRET = (0x0123456789ABCDEF, 0x0FEDCBA987654321)


class Mapping:
    """The moving-window region of a window table in an anonymous mapping, laid out as in a segment."""

    def __init__(self, mkeys, ring, evict=True):
        self.mkeys, self.ring, self.evict = mkeys, ring, evict
        self.size = K.segment_size(1, 0, K.PSLOTS, mkeys, ring)
        self.mm = mmap.mmap(-1, self.size)

    def process(self, backend, clock, pid=None):
        c = open_cells(self.mm, self.size, backend)
        t = KC.SlotTable(
            c,
            K.moving_offset(1, 0),
            self.mkeys,
            min(K.PROBE, self.mkeys),
            K.KEYS_LIVE,
            K.EVICTED,
            K.owner(pid or os.getpid()),
            K.CUT,
            self.evict,
            K.moving_stride(self.ring),
        )
        p = W.MovingWindows(t, self.ring, *SECRET, K.REFUSED, clock)
        p.c = t.c = Killable(c, K.moving_offset(1, 0), K.moving_stride(self.ring))
        return p


class Killable:
    """Cells that kill their process right after it wrote a log entry (``die_next``): before the
    grant's move of V0."""

    def __init__(self, cells, base, stride):
        self._c, self._base, self._stride = cells, base, stride
        self.die_next = False

    def __getattr__(self, attr):
        return getattr(self._c, attr)

    def cas(self, off, old, new):
        done = self._c.cas(off, old, new)
        if done and self.die_next and (off - self._base) % self._stride >= K.LINE:
            self.die_next = False
            raise SystemExit("killed between the entry and V0")
        return done


class Model:
    """The sliding log: a grant is its hits at one instant (never before the key's last one)."""

    def __init__(self, ring):
        self.ring = ring
        self.logs = {}  # key -> [(t in 1/32 ms, amount)]

    def window(self, key, wu, nu):
        return [(t, a) for t, a in self.logs.get(key, []) if t + wu >= nu]

    def acquire(self, key, limit, w_ms, amount, ns):
        nu, wu = ns // W.E_NS, w_ms * 32
        inside = self.window(key, wu, nu)
        if amount > limit or sum(a for _, a in inside) + amount > limit:
            return False
        if len(inside) >= self.ring - 2:  # the log holds no more in one window
            return False
        log = self.logs.setdefault(key, [])
        log.append((max([nu] + [t for t, _ in log[-1:]]), amount))
        return True

    def moving_window(self, key, w_ms, ns):
        inside = self.window(key, w_ms * 32, ns // W.E_NS)
        if not inside:
            return None, 0
        return max(0.0, (ns - inside[0][0] * W.E_NS) / 1e9), sum(a for _, a in inside)

    def clear(self, key):
        self.logs.pop(key, None)


KEYS = ["a", "b", "c"]
WINDOWS = {"a": 1000, "b": 50, "c": 7}  # ms; one window per key, as limits uses them
OPS = st.lists(
    st.tuples(
        st.sampled_from(["hit", "hit", "hit", "die", "look", "clear"]),
        st.integers(0, 2),  # process
        st.sampled_from(KEYS),
        st.integers(1, 4),  # amount
        st.integers(1, 12),  # limit
        st.integers(0, 400_000),  # ns the clock moves first (up to 0.4 ms)
    ),
    max_size=120,
)


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=60, deadline=None)
@given(ops=OPS, ring=st.sampled_from([8, 16]))
def test_the_log_is_the_exact_sliding_log(backend, ops, ring):
    m = Mapping(16, ring)
    clock = FakeClock()
    procs = [m.process(backend, clock, pid) for pid in (os.getpid(), 1, 2)]
    model = Model(ring)
    for op, who, key, amount, limit, dt in ops:
        clock.advance(dt * (1 if key != "a" else 25))  # the long window sees seconds go by
        p, w = procs[who], WINDOWS[key]
        if op == "look":
            assert p.moving_window(key, w / 1000) == model.moving_window(key, w, clock.now)
        elif op == "clear":
            p.clear_moving(key)
            model.clear(key)
        else:
            want = model.acquire(key, limit, w, amount, clock.now)
            if op == "die":  # its grant is written: it counts, whoever moves V0 on for it
                p.c.die_next = True
                try:
                    got = p.acquire_entry(key, limit, w / 1000, amount)
                except SystemExit:
                    got = True
                p.c.die_next = False
                # a new key's first grant is made by its insert (nothing to die between)
            else:
                got = p.acquire_entry(key, limit, w / 1000, amount)
            assert got == want, (op, key, amount, limit)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_writer_killed_between_its_two_steps_stalls_nobody(backend):
    m = Mapping(4, 8)
    clock = FakeClock()
    a, b = m.process(backend, clock), m.process(backend, clock, 7)
    assert a.acquire_entry("k", 3, 10)
    a.c.die_next = True
    with pytest.raises(SystemExit):
        a.acquire_entry("k", 3, 10)  # its entry written, V0 still before it
    clock.advance_seconds(1)
    assert b.acquire_entry("k", 3, 10)  # moves V0 on for the dead one, then takes the third
    assert not b.acquire_entry("k", 3, 10)
    assert b.moving_window("k", 10) == (1.0, 3)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_full_log_refuses_until_its_oldest_grant_leaves(backend):
    m = Mapping(4, 8)
    clock = FakeClock()
    p = m.process(backend, clock)
    granted = 0
    for _ in range(10):
        clock.advance(1_000_000)
        granted += p.acquire_entry("k", 100, 1.0)
    assert granted == 8 - 2  # ring - 2 grants in one window, whatever the limit
    assert p.moving_window("k", 1.0)[1] == 6
    clock.advance(1_000_000_000 - 9_000_000)  # the first grant (at +1 ms) leaves at +1001 ms
    assert not p.acquire_entry("k", 100, 1.0)
    clock.advance(1_000_000)
    assert p.acquire_entry("k", 100, 1.0) and not p.acquire_entry("k", 100, 1.0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_hit_leaves_the_window_within_a_unit_of_its_end_never_before(backend):
    m = Mapping(4, 8)
    clock = FakeClock()
    p = m.process(backend, clock)
    assert p.acquire_entry("k", 1, 2.0)
    clock.advance(2_000_000_000)  # exactly the window later: still in it
    assert not p.acquire_entry("k", 1, 2.0)
    clock.advance(W.E_NS)  # one unit (31.25 us) on
    assert p.acquire_entry("k", 1, 2.0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_reused_slot_starts_with_an_empty_log(backend):
    m = Mapping(1, 8, evict=False)
    clock = FakeClock()
    p = m.process(backend, clock)
    assert all(p.acquire_entry("old", 10, 0.01) for _ in range(5))
    with pytest.raises(KeyTableFullError):
        p.acquire_entry("new", 10, 1.0)  # "old" is still in its window: never evicted
    clock.advance_seconds(0.011)
    assert p.acquire_entry("new", 2, 1.0, 2)  # the slot is reused...
    assert p.moving_window("new", 1.0) == (0.0, 2)  # ...with none of the old key's entries
    assert p.c.load(K.EVICTED) == 1
    assert p.moving_window("old", 0.01) == (None, 0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_new_key_gives_way_to_a_live_stalled_insert_of_it(backend, monkeypatch):
    """The first grant of a key whose insert a live process left half done gives way (busy),
    counts nothing, and is made once that insert is gone: the one insert path of every kind."""
    monkeypatch.setattr(KC, "PEND_NS", 2_000_000)
    p = Mapping(8, 8).process(backend, FakeClock())
    d, home, _ = p._key(b"M", "k")
    s = p.t._slot(home, 0)
    p.c.store(s + K.S_D0, d[0])
    p.c.store(s + K.S_D1, d[1])
    p.c.store(s, K.ctrl(K.PEND, K.owner(os.getppid()), 1))
    with pytest.raises(KeyTableFullError) as e:
        p.acquire_entry("k", 5, 10, 2)
    assert e.value.busy and p.c.load(K.REFUSED) == 0 and p.c.load(K.KEYS_LIVE) == 0
    p.c.store(s, K.ctrl(K.TOMB, 0, 1))  # the stalled insert gave way at last
    assert p.acquire_entry("k", 5, 10, 2) and p.moving_window("k", 10) == (0.0, 2)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_arguments_name_the_range_and_change_nothing(backend):
    m = Mapping(4, 8)
    p = m.process(backend, FakeClock())
    for call, msg in [
        (
            lambda: p.acquire_entry("k", W.MOVING_MAX + 1, 1),
            "limit must be an int from 0 to 1048575",
        ),
        (lambda: p.acquire_entry("k", -1, 1), "limit"),
        (lambda: p.acquire_entry("k", 5, 0), "expiry"),
        (lambda: p.acquire_entry("k", 5, 1, -1), "amount"),
    ]:
        with pytest.raises(ValueError, match=msg):
            call()
    off = K.moving_offset(1, 0)
    assert bytes(m.mm[off:]) == bytes(m.size - off)
    assert p.acquire_entry("k", W.MOVING_MAX, 1, W.MOVING_MAX)  # the largest limit holds


def test_table_options_are_checked_and_kept(name):
    for kw in (
        {"moving_log": 100},
        {"moving_log": 4},
        {"moving_log": 1 << 16},
        {"moving_keys": -1},
    ):
        with pytest.raises(ValueError, match="moving_keys must be from 0"):
            WindowTable(name, keys=64, **kw)
    t = WindowTable(name, keys=64, moving_keys=10, moving_log=32)
    other = WindowTable(name, moving_keys=999, moving_log=8)  # an existing table keeps its sizes
    assert (other.moving_slots, other.moving_log) == (10, 32)
    assert os.path.getsize(f"/dev/shm/shmlimit.{name}") == K.segment_size(64, 0, K.PSLOTS, 10, 32)
    other.close()
    t.close()


def test_a_table_without_moving_windows_says_how_to_make_one(name):
    t = WindowTable(name, keys=64, moving_keys=0)
    with pytest.raises(ValueError, match="moving_keys=0"):
        t.acquire_entry("k", 1, 1)
    assert t.incr("k", 1) == 1
    t.close()


def _hammer(name, n, out):
    t = WindowTable(name)
    out.put(sum(t.acquire_entry("shared", 500, 600) for _ in range(n)))
    t.close()


@pytest.mark.parametrize("start", ["fork", "spawn"])
def test_real_processes_are_granted_the_limit_exactly(name, start):
    table = WindowTable(name, keys=64, moving_keys=8, moving_log=1024)
    results = run_processes(mp.get_context(start), _hammer, [(name, 400)] * 4)
    assert sum(results) == 500  # 1600 asked for within one window, by four processes at once
    assert table.moving_window("shared", 600)[1] == 500
    table.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_full_window_evicts_the_log_whose_window_ends_first(backend):
    m = Mapping(2, 8)  # both slots are every key's window (probe 2)
    clock = FakeClock()
    p = m.process(backend, clock)
    assert p.acquire_entry("short", 3, 1.0) and p.acquire_entry("short", 3, 1.0)
    assert p.acquire_entry("long", 3, 60.0)
    assert p.acquire_entry("new", 3, 10.0)  # no slot free: "short" (its window ends first) goes
    assert (p.c.load(K.EVICTED), p.c.load(K.CUT)) == (1, 1)
    assert p.moving_window("long", 60.0) == (0.0, 1)
    assert p.moving_window("new", 10.0) == (0.0, 1)  # none of "short"'s entries
    assert p.moving_window("short", 1.0) == (None, 0)
    # "short" starts a new log at its next hit: it gains at most the hits its window held
    assert p.acquire_entry("short", 3, 1.0, 3)  # takes "new"'s slot (it ends before "long")
    assert p.moving_window("long", 60.0)[1] == 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_writer_of_an_evicted_key_never_lands_on_the_next_tenant(backend):
    """A grant of a key evicted between its reads and its entry CAS: the CAS misses the next
    tenant's log (a wipe of another generation), and the grant is made afresh for its key."""
    m = Mapping(1, 8)
    clock = FakeClock()
    a, b = m.process(backend, clock), m.process(backend, clock, 7)
    assert a.acquire_entry("old", 5, 1.0)
    seen = []
    cas = a.c.cas

    def hooked(off, old, new):
        if not seen and (off - K.moving_offset(1, 0)) % K.moving_stride(8) >= K.LINE:
            assert b.acquire_entry("new", 5, 10.0)  # evicts "old" under a's feet
            before = a.c.load(off)
            done = cas(off, old, new)
            seen.append((done, before, a.c.load(off)))
            return done
        return cas(off, old, new)

    a.c.cas = hooked
    assert a.acquire_entry("old", 5, 1.0)
    done, before, after = seen[0]
    assert not done and before == after
    assert a.moving_window("old", 1.0) == (0.0, 1)  # a new log: the evicted one's hit is gone
    assert a.c.load(K.EVICTED) == 2  # "old" for "new", then "new" for "old" again


@pytest.mark.parametrize(
    "off, value",
    [(K.MRING_OFF, 100), (K.MRING_OFF, 1 << 16), (K.MKEYS_OFF, 11), (K.MKEYS_OFF, 1 << 40)],
)
def test_a_hostile_moving_region_is_refused(name, off, value):
    """A header whose moving-window region is not one we write (a ring that is no power of two
    or too large, more logs than the file holds) is refused before anything is mapped on it."""
    from shmlimit.errors import SegmentError

    WindowTable(name, keys=64, moving_keys=10, moving_log=32).close()
    with open(f"/dev/shm/shmlimit.{name}", "r+b") as f:
        f.seek(off)
        f.write(value.to_bytes(8, "little"))
    with pytest.raises(SegmentError, match="corrupt"):
        WindowTable(name)


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=60, deadline=None)
@given(ops=OPS)
def test_evicting_loses_only_the_log_whose_window_ends_first(backend, ops):
    """Three keys over two slots (both in every key's window), evicting: each answer is the
    exact sliding log's, where a key evicted starts a new log; and a key is only ever lost
    when its window ended, or as the live key whose V0 (window end, then grants) is least."""
    m = Mapping(2, 8)
    clock = FakeClock()
    p = m.process(backend, clock)
    model = Model(8)
    v0 = {}  # key -> the value its V0 holds: (window end in ms, FULL, grants since inserted)

    def present(key):
        d, home, _ = p._key(b"M", key)
        return p.t.find(d, home)[0] is not None

    for op, _, key, amount, limit, dt in ops:
        clock.advance(dt * (1 if key != "a" else 25))
        w = WINDOWS[key]
        if op == "look":
            assert p.moving_window(key, w / 1000) == model.moving_window(key, w, clock.now)
            continue
        if op == "clear":
            p.clear_moving(key)
            model.clear(key)
            v0.pop(key, None)
            continue
        before = {k for k in KEYS if present(k)}
        assert before == set(v0)
        want = model.acquire(key, limit, w, amount, clock.now)
        assert p.acquire_entry(key, limit, w / 1000, amount) == want, (key, amount, limit)
        now_ms = clock.now // 1_000_000
        for gone in before - {k for k in KEYS if present(k)}:
            live = [v0[k] for k in before - {key} if v0[k][0] > now_ms]
            assert v0[gone][0] <= now_ms or v0[gone] == min(live), (gone, v0)
            model.clear(gone)
            del v0[gone]
        if want:
            t = model.logs[key][-1][0]
            end = -(-(t + w * 32 + 1) // 32)
            x, _, g = v0.get(key, (0, False, 0))
            v0[key] = (max(x, end), g + 1 >= 8, g + 1)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_hit_whose_clock_was_read_before_the_newest_grant_counts_at_it(backend):
    """A process whose clock reading is older than the log's newest grant summed the hits of more
    than one window: 1 200 000 > 2**20, kept modulo 2**20 (151 424), so its 600 000 were granted,
    and then 600 000 more on the current clock: 2 400 000 in one window of limit 1 000 000."""
    m = Mapping(4, 16)
    now = FakeClock(100 * 10**9)
    stale = FakeClock(105 * 10**9)  # read its clock at 105 s, resumes at 110.001 s
    p, q = m.process(backend, now), m.process(backend, stale)
    assert p.acquire_entry("k", 1_000_000, 10, 600_000)
    now.advance(10 * 10**9 + 10**6)
    assert p.acquire_entry("k", 1_000_000, 10, 600_000)  # the first one left the window
    assert not q.acquire_entry("k", 1_000_000, 10, 600_000)
    assert p.moving_window("k", 10) == (0.0, 600_000)
    assert q.moving_window("k", 10) == (0.0, 600_000)  # counted at the newest grant's time
    granted = 0
    for _ in range(10):
        now.advance(10**6)
        granted += p.acquire_entry("k", 1_000_000, 10, 600_000)
    assert not granted


@pytest.mark.parametrize("backend", BACKENDS)
def test_logs_cleared_or_evicted_early_never_wear_their_slots_out(backend):
    """Each log cleared or evicted while its window ran took the window's rest from its slot's
    ``BASE_MAX`` (795 days of window): 3 evictions of 300-day logs made a slot refuse every key.
    Charged from the new key's first value, a window of one length takes nothing."""
    m = Mapping(8, 8)
    clock = FakeClock()
    p = m.process(backend, clock)
    w = 300 * 86_400
    for i in range(200):
        clock.advance(10**9)
        assert p.acquire_entry(f"ip-{i}", 1000, w)
    for _ in range(100):
        clock.advance(10**9)
        assert p.acquire_entry("alice", 1000, w) and p.clear_moving("alice")
    assert p.c.load(K.REFUSED) == 0
    slots = [p.t._slot(0, i) for i in range(8)]
    assert max(p.c.load(s + K.S_BASE) for s in slots) < 1 << 26


@pytest.mark.parametrize("backend", BACKENDS)
def test_hits_of_no_cost_take_no_word_of_the_log(backend):
    """A hit of cost 0 (a free request: ``cost=lambda: 0``) is granted and logs nothing, as in
    ``limits``' memory storage: it neither fills the log nor becomes the window's oldest hit."""
    m = Mapping(4, 8)
    clock = FakeClock()
    p = m.process(backend, clock)
    assert all(p.acquire_entry("k", 10, 60.0, 0) for _ in range(20))
    assert p.moving_window("k", 60.0) == (None, 0)
    clock.advance(1_000_000_000)
    assert p.acquire_entry("k", 10, 60.0)
    clock.advance(1_000_000_000)
    assert p.acquire_entry("k", 10, 60.0, 0)
    assert p.moving_window("k", 60.0) == (1.0, 1)  # its oldest hit is the paid one
    assert p.acquire_entry("k", 10, 60.0, 9) and p.acquire_entry("k", 10, 60.0, 0)
    assert not p.acquire_entry("k", 10, 60.0)
