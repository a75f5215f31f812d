"""The keyed slot table and its GCRA step, driven directly with an injected clock, on both backends.

A stateful hypothesis test runs random sequences of acquires (new keys, old keys,
reservations, peeks), clock steps, and inserts killed midway (a slot left BUSY or
PEND by a dead pid), against an exact model of per-key GCRA.  Because eviction is
exact -- only a key whose bucket is full again is ever forgotten, and such a key is
the same as an absent one -- the table must answer exactly as the model does,
except that a key refused for want of a slot must be one the model holds nothing
for; a new key's state is its own, whatever a dead inserter left in its slot.
"""

import mmap
import os
import random
import time

import pytest
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from support.keyed import Stopped, StopsAfterValue, StopsAt
from support.models import on_each_backend

from shmlimit.errors import SegmentError
from shmlimit.keyed import cells as KC
from shmlimit.keyed import layout as K
from shmlimit.keyed.gcra import Overrides, Rate, write_bank
from shmlimit.keyed.window_table import WindowTable
from shmlimit.keyed.windows import CMAX, pack
from shmlimit.shm.cells import native_available, open_cells

# run once in CI: names each backend it checks
pytestmark = pytest.mark.backend_independent

BACKENDS = ["atomics"] + (["native"] if native_available() else [])
T = 100  # ticks per op
DEAD_PID = (
    1 << K.PID_BITS
) - 7  # above this machine's pid_max (checked below): never a live process


def set_params(c, t, tau):
    """The default (T, TAU) in both of its banks, as a config writer publishes it (keyed_gcra)."""
    for line in K.DEFAULT_BANKS:
        write_bank(c, line, (0, 0), (0, 0, 0, t, tau), c.load(K.CFG_SEQ) & ~1)


def slack(tau):
    """What a key's V0 (less BASE) holds above its TAT under a burst of ``tau`` ticks (keyed_cells)."""
    return K.MAX_TICKS - tau


def dead_pid():
    with open("/proc/sys/kernel/pid_max") as f:
        assert int(f.read()) <= DEAD_PID
    return K.owner(DEAD_PID)


class Table:
    """A keyed table in an anonymous mapping, laid out as in a segment."""

    def __init__(self, backend, nkeys, burst, novr=4, probe=None, flags=0):
        self.nkeys, self.novr = nkeys, novr
        self.size = K.segment_size(nkeys, novr)
        self.mm = mmap.mmap(-1, self.size)
        self.c = open_cells(self.mm, self.size, backend)
        set_params(self.c, T, burst * T)
        self.slack = slack(burst * T)  # V0 less BASE less this is a key's TAT
        self.probe = probe or min(K.PROBE, nkeys)
        self.kt = self.c.keyed_table(
            K.CFG_SEQ,
            K.OVR_LIVE,
            K.overrides_offset(),
            novr,
            K.slots_offset(novr),
            nkeys,
            self.probe,
            0x0123456789ABCDEF,
            0x0FEDCBA987654321,
            K.KEYS_LIVE,
            K.EVICTED,
            K.REFUSED,
            K.UNREG_GRANTS,
            K.owner(os.getpid()),
            K.CUT,
            flags,  # refuse when full unless asked (the exact model below needs it)
        )

    def slot(self, i):
        return K.slots_offset(self.novr) + i * K.LINE

    def states(self):
        return [self.c.load(self.slot(i)) & 0xFF for i in range(self.nkeys)]


@pytest.mark.parametrize("backend", BACKENDS)
def test_both_backends_hash_alike(backend):
    t = Table(backend, 64, 2)
    for key in ["", "a", "client-1", "é" * 40, b"\x00\xff" * 9]:
        data = key.encode() if isinstance(key, str) else key
        assert t.kt.digest(key) == KC.siphash128(data, 0x0123456789ABCDEF, 0x0FEDCBA987654321)


def test_the_native_hash_of_any_bytes_is_the_portable_one():
    """Window tables hash prefixed keys with the extension's function on the native backend (a
    hash in Python cost a ``shm://`` hit 35 of its 41 us): it must be the portable function, for
    every length of the last block and any keys."""
    native = pytest.importorskip("shmlimit.shm._native")
    rng = random.Random(7)
    for n in range(0, 70):
        data = bytes(rng.randrange(256) for _ in range(n))
        k0, k1 = rng.getrandbits(64), rng.getrandbits(64)
        assert native.siphash128(data, k0, k1) == KC.siphash128(data, k0, k1)
    for backend in ("native", "atomics"):
        digest = KC.hasher(type("C", (), {"backend": backend})(), 5, 6)
        for data in (b"", b"k", b"x" * 1000, b"k"):  # the portable one remembers: the same twice
            assert digest(data) == KC.siphash128(data, 5, 6)
    for bad in ((b"x", -1, 0), (b"x", 0, 1 << 64), ("x", 0, 0), (b"x", 0)):
        with pytest.raises((TypeError, OverflowError)):
            native.siphash128(*bad)


def test_siphash_reference_vector():
    k = bytes(range(16))
    d = KC.siphash128(b"", int.from_bytes(k[:8], "little"), int.from_bytes(k[8:], "little"))
    assert (
        d[0].to_bytes(8, "little") + d[1].to_bytes(8, "little")
    ).hex() == "a3817f04ba25a8e66df67214c7550293"


@pytest.mark.parametrize("backend", BACKENDS)
def test_full_table_refuses_new_keys_and_counts(backend):
    t = Table(backend, 16, 1)
    now = 1_000_000
    granted = [k for k in range(40) if t.kt.acquire(f"k{k}", 1, 0, now) >= 0]
    assert len(granted) == 16  # every slot holds a limited key: the rest are refused
    assert t.c.load(K.REFUSED) == 24 and t.c.load(K.KEYS_LIVE) == 16
    assert all(t.kt.acquire(f"k{k}", 1, 0, now) < 0 for k in granted)  # still limited, none reset
    assert t.kt.acquire("new", 1, 0, now) == KC.FULL
    now += T  # every bucket is full again: each slot may be reused
    assert all(t.kt.acquire(f"x{k}", 1, 0, now) >= 0 for k in range(16))
    assert t.c.load(K.EVICTED) == 16


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_worn_slot_is_passed_by_for_the_next_of_the_window(backend):
    """A slot whose last word would lift a new tenant's BASE past ``BASE_MAX`` takes no key: the
    insert takes the next slot of the window (it answered FULL with every other slot free)."""
    t = Table(backend, 8, 2)
    now = 1_000_000
    home = (t.kt.digest("k")[0] * 8) >> 64
    worn = [t.slot((home + i) % 8) for i in range(8)]
    for s in worn:
        t.c.store(s + K.S_V0, K.DEAD | 1 << 62)  # 2**61 above now + a slack: worn out
        t.c.store(s, K.ctrl(K.TOMB, 0, 1))
    assert t.kt.acquire("x", 1, 0, now) == KC.FULL  # every slot worn: refused (counted)
    assert t.c.load(K.REFUSED) == 1
    t.c.store(worn[1], K.ctrl(K.EMPTY, 0, 0))
    t.c.store(worn[1] + K.S_V0, 0)
    assert t.kt.acquire("k", 1, 0, now) == 0
    assert t.states()[(home + 1) % 8] == K.LIVE and t.c.load(K.REFUSED) == 1


class _Clock:
    """Stands in for the time module in keyed_cells: answers the given readings, in order."""

    def __init__(self, *readings_ns):
        self.readings = list(readings_ns)

    def monotonic_ns(self):
        return self.readings.pop(0) if len(self.readings) > 1 else self.readings[0]


def test_a_clock_read_before_a_preemption_is_read_again_before_a_new_key_is_refused(monkeypatch):
    """Keys inserted by others while this thread was preempted look in use against the clock it
    read before: before refusing a new key for a full table, the clock is read once more.  (The
    native step does the same with its own clock; the churn test across processes exercises it.)"""
    t = Table("atomics", 16, 1)
    then = 1_000_000  # ns
    assert all(
        t.kt.acquire(f"k{k}", 1, 0, then << K.TICK_SHIFT) >= 0 for k in range(16)
    )  # every slot limited
    monkeypatch.setattr(KC, "time", _Clock(then, then + T))  # preempted after the first reading
    assert (
        t.kt.acquire("new", 1, 0) >= 0
    )  # admitted: every bucket is full again by the second reading
    assert t.c.load(K.REFUSED) == 0 and t.c.load(K.EVICTED) == 1
    monkeypatch.setattr(
        KC, "time", _Clock(then)
    )  # a clock that has not moved: still full, refused at once
    assert t.kt.acquire("other", 1, 0) == KC.FULL
    assert t.c.load(K.REFUSED) == 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_dead_inserters_slots_are_reclaimed(backend):
    t = Table(backend, 16, 1)
    for i in range(16):  # every slot claimed by an inserter that died
        t.c.store(t.slot(i), K.ctrl(K.BUSY if i % 2 else K.PEND, dead_pid(), 7))
    assert all(t.kt.acquire(f"k{k}", 1, 0, 10_000) >= 0 for k in range(16))
    assert set(t.states()) == {K.LIVE}


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_inserter_of_another_pid_namespace_is_never_taken_for_dead(backend):
    t = Table(backend, 16, 1)
    other_ns = dead_pid() ^ (1 << K.PID_BITS)  # the same (absent) pid, another namespace's tag
    for i in range(16):
        t.c.store(t.slot(i), K.ctrl(K.BUSY, other_ns, 3))
    assert t.kt.acquire("k", 1, 0, 10_000) == KC.FULL  # none of its slots is taken from under it
    assert set(t.states()) == {K.BUSY}


@pytest.mark.parametrize("backend", BACKENDS)
def test_peek_and_reserve(backend):
    t = Table(backend, 16, 2)
    now = 5_000
    assert t.kt.acquire("a", 1, -1, now) == 0  # a peek inserts nothing
    assert t.c.load(K.KEYS_LIVE) == 0
    assert t.kt.acquire("a", 2, 0, now) == 0
    assert t.kt.acquire("a", 1, -1, now) == T  # one op is T ticks away
    assert t.kt.acquire("a", 1, 0, now) == KC.REFUSED  # refused, nothing written
    assert t.kt.acquire("a", 1, T, now) == T  # reserved: use it in T ticks
    assert t.kt.acquire("a", 3, 10**9, now) == KC.NEVER  # more than the burst
    with pytest.raises(TypeError):
        t.kt.acquire(1234, 1, 0, now)
    with pytest.raises(TypeError):
        t.kt.acquire("a", True, 0, now)
    with pytest.raises(ValueError):
        t.kt.acquire("a", 0, 0, now)


class TableMachine(RuleBasedStateMachine):
    backend = "atomics"

    @initialize(
        nkeys=st.sampled_from([4, 8, 24]),
        burst=st.integers(1, 3),
        probe=st.sampled_from([None, 3, 6]),
        evict=st.booleans(),
    )
    def setup(self, nkeys, burst, probe, evict):
        self.probe = min(probe or K.PROBE, nkeys)
        flags = KC.FLAG_EVICT if evict else 0
        self.t = Table(self.backend, nkeys, burst, probe=self.probe, flags=flags)
        self.burst = burst
        self.evict = evict
        self.now = 1 << 20
        self.tat = {}  # the model: key -> TAT (absent = a full bucket)
        self.grants = {}  # key -> [use time of each op]
        self.forgiven = {}  # key -> ops of debt forgotten when it was evicted while limited

    @rule(dt=st.sampled_from([0, 1, T // 2, T, 3 * T, 20 * T]))
    def tick(self, dt):
        self.now += dt

    @rule(
        key=st.integers(0, 30),
        n=st.integers(1, 4),
        mode=st.sampled_from(["try", "reserve", "peek"]),
    )
    def acquire(self, key, n, mode):
        k = f"key-{key}"
        max_wait = {"try": 0, "reserve": 2 * T, "peek": -1}[mode]
        before = self.holders()
        r = self.t.kt.acquire(k, n, max_wait, self.now)
        self.check_evictions(k, before)
        tau = self.burst * T
        old = self.tat.get(k, 0)
        idle = old <= self.now
        event(
            f"answer {'full' if r == KC.FULL else 'never' if r == KC.NEVER else 'granted' if r >= 0 else 'refused'}"
        )
        if self.t.c.load(K.EVICTED):
            event("some key was evicted")
        if r == KC.FULL:
            assert idle, "a limited key was refused as new: it was lost"
            assert mode != "peek"
            # evicting, a window is full only of inserts in flight (dead inserters' slots are taken)
            assert not self.evict or any(
                self.t.c.load(self.t.slot(i)) & 0xFF in (K.BUSY, K.PEND) for i in self.window(k)
            )
            return
        if n > self.burst:
            assert r == KC.NEVER
            return
        base = max(old, self.now)
        wait = max(0, base + n * T - self.now - tau)
        if mode == "peek":
            assert r == wait
            return
        if wait > max_wait:
            assert r == KC.REFUSED, (r, wait)
            return
        assert r == wait, (r, wait)
        new_tat = base + n * T
        # exactly the model's, in a new slot too: never a value a dead inserter left there
        assert self.real_tat(k) == new_tat
        self.tat[k] = new_tat
        self.grants.setdefault(k, []).extend([self.now + r] * n)

    def real_tat(self, k):
        t = self.t
        d = t.kt.digest(k)
        for i in range(t.nkeys):
            s = t.slot(i)
            if (
                t.c.load(s) & 0xFF == K.LIVE
                and (t.c.load(s + K.S_D0), t.c.load(s + K.S_D1)) == d
                and not t.c.load(s + K.S_V0) & K.DEAD
            ):
                return t.c.load(s + K.S_V0) - t.c.load(s + K.S_BASE) - t.slack
        raise AssertionError(f"{k} was granted but holds no slot")

    def window(self, k):
        home = (self.t.kt.digest(k)[0] * self.t.nkeys) >> 64
        return [(home + i) % self.t.nkeys for i in range(self.probe)]

    def holders(self):
        """slot -> (model key, its TAT) for every live key of the table."""
        t, out = self.t, {}
        digests = {t.kt.digest(f"key-{i}"): f"key-{i}" for i in range(31)}
        for i in range(t.nkeys):
            s = t.slot(i)
            d = (t.c.load(s + K.S_D0), t.c.load(s + K.S_D1))
            if t.c.load(s) & 0xFF == K.LIVE and not t.c.load(s + K.S_V0) & K.DEAD:
                out[i] = (digests[d], t.c.load(s + K.S_V0) - t.c.load(s + K.S_BASE) - t.slack)
        return out

    def check_evictions(self, k, before):
        """A limited key lost its slot only to make room for ``k`` (evicting), in ``k``'s window,
        and only as the live key of that window nearest to a full bucket; it is then as absent
        (a full bucket), having gained at most the debt its entry held."""
        after = {v[0] for v in self.holders().values()}
        lost = [
            (i, key, tat)
            for i, (key, tat) in before.items()
            if key not in after and tat > self.now and key != k
        ]
        if not lost:
            return
        assert self.evict, "a limited key was lost"
        assert len(lost) == 1, lost
        i, key, tat = lost[0]
        window = self.window(k)
        assert i in window, "a key outside the new key's window was evicted"
        assert all(tat <= before[j][1] for j in window if j in before), "not the least valuable"
        event("a limited key was evicted")
        self.forgiven[key] = self.forgiven.get(key, 0) + -(-(tat - self.now) // T)
        self.tat.pop(key, None)

    @rule(
        i=st.integers(0, 23),
        state=st.sampled_from([K.BUSY, K.PEND]),
        left=st.sampled_from([1, T, 3 * T]),
    )
    def insert_killed_midway(self, i, state, left):
        """What a dead inserter leaves: a slot claimed (an idle key's slot evicted first) and never published."""
        t = self.t
        s = t.slot(i % t.nkeys)
        ctl = t.c.load(s)
        if ctl & 0xFF == K.LIVE:
            v = t.c.load(s + K.S_V0)
            if v & K.DEAD or v - t.c.load(s + K.S_BASE) - t.slack > self.now:
                return  # a dead inserter of ours took only an expired key's slot
            if not t.c.cas(s + K.S_V0, v, v | K.DEAD):
                return
        elif ctl & 0xFF not in (K.EMPTY, K.TOMB):
            return
        t.c.store(s, K.ctrl(state, dead_pid(), (ctl >> 40) + 1))
        t.c.store(s + K.S_V0, self.now + left + t.slack)  # the first grant it was about to publish
        if state == K.PEND:  # the digest was written: the key of some model key
            d = t.kt.digest(f"key-{i}")
            t.c.store(s + K.S_D0, d[0])
            t.c.store(s + K.S_D1, d[1])

    @invariant()
    def window_bound(self):
        if not hasattr(self, "grants"):
            return
        for key, times in self.grants.items():
            times = sorted(times)
            extra = self.forgiven.get(key, 0)  # the documented bound of eviction
            for a in range(len(times)):
                for b in range(a, len(times)):
                    assert b - a + 1 <= (times[b] - times[a]) / T + self.burst + extra

    @invariant()
    def live_keys_are_distinct(self):
        if not hasattr(self, "t"):
            return
        t = self.t
        seen = set()
        for i in range(t.nkeys):
            s = t.slot(i)
            if t.c.load(s) & 0xFF == K.LIVE and not t.c.load(s + K.S_V0) & K.DEAD:
                d = (t.c.load(s + K.S_D0), t.c.load(s + K.S_D1))
                assert d not in seen, "one key in two slots"
                seen.add(d)


TestAtomicsTable, TestNativeTable = on_each_backend(
    TableMachine,
    settings(max_examples=60, stateful_step_count=60, deadline=None),
    settings(max_examples=150, stateful_step_count=80, deadline=None),
)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_key_whose_bucket_emptied_before_the_clocks_zero_is_full_under_a_shorter_burst(backend):
    """A key's word holds the instant its bucket was last empty: for a new key, now less its burst,
    before the clock's zero while the clock reads less than a burst (CLOCK_MONOTONIC counts from
    boot: a machine up for less than a burst of "100/day").  Priced down to a shorter burst, its
    TAT lies before zero too: a full bucket.  The native step took that TAT modulo 2**64, for
    ever in the future: the key was refused until the end of time (a peek answered a negative
    wait), and its slot never expired, so a table that refuses had no room for a new key."""
    now = 5_000
    for nkeys, then in ((4, "k"), (1, "other")):  # one slot: "other" needs the one "k" holds
        t = Table(backend, nkeys, 1000)  # T = 100, burst 1000 ops: 100_000 ticks
        assert t.kt.acquire("k", 1, 0, now) == 0
        set_params(t.c, T, 2 * T)  # burst 2 ops: the key's TAT, 5_100 - 100_000 + 200, is below 0
        assert t.kt.acquire("k", 2, -1, now) == 0  # a full bucket (native: -99_700)
        assert t.kt.acquire(then, 2, 0, now) == 0  # native: REFUSED, FULL


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.slow
def test_a_config_lock_left_by_a_dead_writer_is_closed(backend):
    t = Table(backend, 16, 1)
    t.c.store(K.CFG_SEQ, 7)  # odd: a writer died holding it
    t0 = time.monotonic()
    assert t.kt.acquire("k", 1, 0, 10_000) == 0
    assert 0.15 < time.monotonic() - t0 < 30 and t.c.load(K.CFG_SEQ) == 8


@pytest.mark.parametrize("backend", BACKENDS)
def test_try_acquire_and_rebind(backend):
    t = Table(backend, 16, 1)
    set_params(t.c, 10**13, 10**13)  # ~10 minutes per op on the real clock
    assert t.kt.try_acquire("k") is True and t.kt.try_acquire("k") is False
    assert t.kt.try_acquire("j", 2) is False  # above the burst
    assert t.c.load(K.UNREG_GRANTS) == 1
    t.kt.rebind(K.EVICTED + 8, 12345)
    assert t.kt.try_acquire("other")
    assert t.c.load(K.EVICTED + 8) == 1 and t.c.load(K.UNREG_GRANTS) == 1
    with pytest.raises(IndexError):
        t.kt.rebind(t.size, 1)


SEQ = 10  # CFG_SEQ of the bank tests below: even, no writer
#: A bank's state: valid at a generation counted back from SEQ (0: SEQ's own; 2: the one before;
#: -2: a generation above SEQ, as a late writer's, the oldest of all counted back) or corrupt.
BANK_STATES = [0, 2, -2, "corrupt"]


def _put_banks(t, states):
    """The default's two banks in ``states``, bank A with a burst of 2 ops, B of 3 (tells them apart)."""
    t.c.store(K.CFG_SEQ, SEQ)
    for line, state, burst in zip(K.DEFAULT_BANKS, states, (2, 3)):
        write_bank(
            t.c, line, (0, 0), (0, 0, 0, T, burst * T), SEQ - (0 if state == "corrupt" else state)
        )
        if state == "corrupt":
            t.c.store(line + K.B_SUM, t.c.load(line + K.B_SUM) ^ 1)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("a", BANK_STATES)
@pytest.mark.parametrize("b", BANK_STATES)
def test_the_valid_bank_of_the_newest_generation_prices_a_key(backend, a, b):
    """Whichever of the two banks is valid and newest (counted back from CFG_SEQ; a tie: bank A)
    prices the key, on both backends; none valid is a corrupt segment."""
    t = Table(backend, 16, 1)
    _put_banks(t, (a, b))
    valid = [(age, burst) for age, burst in ((a, 2), (b, 3)) if age != "corrupt"]
    if not valid:
        with pytest.raises(SegmentError):
            t.kt.acquire("k", 1, -1, 5_000)
        return
    burst = min(valid, key=lambda v: v[0] % (1 << 64))[1]
    assert t.kt.acquire("k", 3, -1, 5_000) == (0 if burst == 3 else KC.NEVER)  # a peek
    assert t.kt.acquire("k", burst, 0, 5_000) == 0 and t.kt.acquire("k", 1, -1, 5_000) == T


class _Loads:
    """Cells that record the offsets loaded through them."""

    def __init__(self, cells):
        self.cells, self.offsets = cells, []

    def load(self, off):
        self.offsets.append(off)
        return self.cells.load(off)

    def load_many(self, offs):
        self.offsets.extend(offs)
        return self.cells.load_many(offs)

    def __getattr__(self, attr):
        return getattr(self.cells, attr)


@pytest.mark.parametrize("b", BANK_STATES)
def test_a_keyed_try_reads_the_backup_bank_only_when_the_first_is_not_current(b):
    """The portable step: a first bank valid at CFG_SEQ's own generation is the newest there can
    be, so the second is not read (after every completed write both hold it); it was read on
    every call, a fifth of a live key's try."""
    t = Table("atomics", 16, 1)
    backup = {K.DEFAULT_BANKS[1] + off for off in range(0, K.LINE, 8)}
    for a, reads_backup in ((0, False), (2, True), ("corrupt", True)):
        if a == "corrupt" and b == "corrupt":
            continue
        _put_banks(t, (a, b))
        t.kt.c = loads = _Loads(t.c)
        assert t.kt.try_acquire(f"k{a}{b}")
        t.kt.c = t.c
        assert bool(backup & set(loads.offsets)) is reads_backup


def _dead_inserter(c, slots, nslots):
    """An inserter under a dead pid that dies right after storing its slot's value word."""
    return KC.SlotTable(
        StopsAfterValue(c, slots), slots, nslots, nslots, K.KEYS_LIVE, K.EVICTED, dead_pid()
    )


class _RaisesAt:
    """Cells through which an insert meets an exception (a signal handler's: KeyboardInterrupt, a
    soft time limit) at its ``left``-th write after claiming its slot (0: the first)."""

    def __init__(self, c, left):
        self.c, self.size, self.left, self.claimed = c, c.size, left, False

    def __getattr__(self, name):
        return getattr(self.c, name)

    def _write(self):
        if self.claimed:
            self.left -= 1
            if self.left == -1:  # once: the handler's own writes go through
                raise KeyboardInterrupt

    def store(self, off, value):
        self._write()
        self.c.store(off, value)

    def fetch_add(self, off, delta):
        self._write()
        return self.c.fetch_add(off, delta)

    def cas(self, off, expected, desired):
        self._write()
        done = self.c.cas(off, expected, desired)
        self.claimed = self.claimed or (done and desired & 0xFF == K.BUSY)
        return done


@pytest.mark.parametrize("left", range(12))
def test_an_insert_interrupted_by_an_exception_gives_its_slot_back(left):
    """An exception raised into the reference insert between its claim and its end (a signal
    handler's) left the slot BUSY or PEND under this process, alive: the slot was lost while it
    lived, and a PEND of the key made every later insert of it wait 0.2 s and answer BUSY --
    an untimed acquire of the key tried again for ever.  (The native insert runs no Python code
    there but the liveness check, whose exception it already gives the slot back on.)"""
    t = Table("atomics", 1, 2)  # one slot: lost, nothing else is ever inserted
    real, t.kt.c = t.kt.c, _RaisesAt(t.c, left)
    try:
        r = t.kt.acquire("k", 1, 0, 1_000)
    except KeyboardInterrupt:
        r = None
    finally:
        t.kt.c = real
    assert t.states()[0] in (K.TOMB, K.LIVE)  # given back, or published before the exception
    assert t.kt.acquire("k", 1, 0, 1_000 + 2 * T) == 0  # before: BUSY after 0.2 s, every time
    assert r is None or r == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_new_key_never_starts_from_a_dead_inserters_value(backend):
    """A keyed inserter that died right after writing its slot's value word left that value to the
    next key placed there: a fresh key got 1 of its burst of 60 ops (its TAT was the dead one's)."""
    t = Table(backend, 1, 60)  # one slot: the next key is placed in the dead inserter's
    now = 1 << 30
    dead = _dead_inserter(t.c, K.slots_offset(t.novr), 1)
    with pytest.raises(Stopped):  # its first grant: the whole burst of a key "a"
        dead.insert(t.kt.digest("a"), 0, now, now + 60 * T + t.slack, (60, 0, 0), low=now + t.slack)
    s = t.slot(0)
    assert t.c.load(s) & 0xFF == K.BUSY and t.c.load(s + K.S_V0) == now + 60 * T + t.slack
    assert [t.kt.acquire("b", 1, 0, now) for _ in range(60)] == [0] * 60  # b's whole burst
    assert t.kt.acquire("b", 1, 0, now) == KC.REFUSED
    assert (
        t.c.load(s) & 0xFF == K.LIVE
        and t.c.load(s + K.S_V0) - t.c.load(s + K.S_BASE) == now + 60 * T + t.slack
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_new_key_never_starts_from_a_dead_inserters_value_on_the_real_clock(backend):
    t = Table(backend, 1, 60)
    per_op = 10**13  # ticks: about ten minutes per op on the real clock
    set_params(t.c, per_op, 60 * per_op)
    up = slack(60 * per_op)
    now = time.monotonic_ns() << K.TICK_SHIFT
    with pytest.raises(Stopped):
        _dead_inserter(t.c, K.slots_offset(t.novr), 1).insert(
            t.kt.digest("a"), 0, now, now + 60 * per_op + up, (60, 0, 0), low=now + up
        )
    assert (
        sum(t.kt.try_acquire("b") for _ in range(61)) == 60
    )  # before: 1, then refused for an hour
    after = time.monotonic_ns() << K.TICK_SHIFT
    raw, base = t.c.load(t.slot(0) + K.S_V0), t.c.load(t.slot(0) + K.S_BASE)
    assert raw > now + 60 * per_op + up  # the stored word rose above the dead inserter's
    assert raw - base <= after + 60 * per_op + up  # and the key's TAT is its own


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_window_client_never_inherits_a_dead_inserters_window(name, backend, monkeypatch):
    """In a window table (``shm://``), a ``10/second`` client placed in the slot of an inserter that
    died right after writing a one-day window had its reset 86 398 s away."""
    monkeypatch.setenv("SHMLIMIT_BACKEND", backend)
    wt = WindowTable(name, keys=1)
    try:
        table = wt.counters.t
        assert table.c.backend == backend
        day = 86_400_000
        now = time.monotonic_ns() // 1_000_000
        d = KC.siphash128(b"F" + b"daily", wt.counters.k0, wt.counters.k1)
        with pytest.raises(Stopped):
            _dead_inserter(table.c, table.slots, table.nslots).insert(
                d, 0, pack(now, CMAX, True), pack(now + day + 1, 1), (0, 0, 0)
            )
        assert [wt.incr("client", 1) for _ in range(3)] == [1, 2, 3]
        assert 0 < wt.counters.expiry_ms("client") <= 1001  # its own one-second window
    finally:
        wt.close()


#: An inserter of another PID namespace: it counts as alive, so its slot is never taken for dead.
STALLED = K.owner(os.getpid()) ^ (1 << K.PID_BITS)


class InsertMachine(TableMachine):
    """TableMachine, with inserts of other processes stopped before each of their steps in turn: dead
    there (their slot reclaimed), or stalled there for good under an owner that counts as alive (a
    stopped process).  A stalled PEND of a key, nearer its home slot than the free slot a new insert
    takes or farther, makes that insert give way and answer BUSY within PEND_NS, taking nothing:
    never a second slot for the key (two buckets: twice the rate), never a wait without end."""

    @initialize(
        nkeys=st.sampled_from([4, 8]),
        burst=st.integers(1, 2),
        probe=st.just(None),
        evict=st.booleans(),
    )
    def setup(self, nkeys, burst, probe, evict):
        self._pend_ns = KC.PEND_NS
        KC.PEND_NS = 2_000_000  # the reference composite's bound (the native one keeps its 0.2 s)
        super().setup(nkeys, burst, probe, evict)

    def teardown(self):
        if hasattr(self, "_pend_ns"):
            KC.PEND_NS = self._pend_ns
        if hasattr(self, "t"):
            self.t.c.close()

    def _window(self, k):
        t = self.t
        d = t.kt.digest(k)
        home = (d[0] * t.nkeys) >> 64
        return d, home, [t.slot((home + i) % t.nkeys) for i in range(t.probe)]

    def _stalled_pend(self, k):
        d, _, window = self._window(k)
        c = self.t.c
        return any(
            c.load(s) & 0xFF == K.PEND
            and (c.load(s) >> 8) & 0xFFFFFFFF == STALLED
            and (c.load(s + K.S_D0), c.load(s + K.S_D1)) == d
            for s in window
        )

    def _holds(self, k):
        try:
            self.real_tat(k)
            return True
        except AssertionError:
            return False

    @rule(
        key=st.integers(0, 5),
        stop=st.one_of(st.integers(0, 16), st.none()),
        stalls=st.sampled_from([False, False, True]),
    )
    def other_insert_stopped(self, key, stop, stalls):
        """Another process inserts ``key`` (absent or idle: nobody inserts a key it finds) and stops before
        its ``stop``-th write (None: right after its PEND); dead there, or stalled for good."""
        k = f"key-{key}"
        if self.tat.get(k, 0) > self.now or self._holds(k):
            return
        t = self.t
        d, home, _ = self._window(k)
        owner = STALLED if stalls else dead_pid()
        other = (
            KC.KeyedTable(  # its slot protocol, judging keys idle by their price as the step does
                StopsAt(t.c, stop),
                K.CFG_SEQ,
                K.OVR_LIVE,
                K.overrides_offset(),
                t.novr,
                K.slots_offset(t.novr),
                t.nkeys,
                t.probe,
                0x0123456789ABCDEF,
                0x0FEDCBA987654321,
                K.KEYS_LIVE,
                K.EVICTED,
                K.REFUSED,
                K.UNREG_GRANTS,
                owner,
                K.CUT,
                KC.FLAG_EVICT if self.evict else 0,
            )
        )
        before = self.holders()
        try:
            other.insert(
                d, home, self.now, self.now + T + t.slack, (1, 0, 0), low=self.now + t.slack
            )
        except Stopped:
            event(f"other insert {'stalled' if stalls else 'died'} at write {stop}")
        self.check_evictions(k, before)
        if self._holds(k):  # it published: a grant of one op, now
            self.tat[k] = self.real_tat(k)
            self.grants.setdefault(k, []).append(self.now)

    @rule(key=st.integers(0, 5), n=st.integers(1, 2), mode=st.sampled_from(["try", "reserve"]))
    def acquire_a_key_others_insert(self, key, n, mode):
        self.acquire(key, n, mode)

    @rule(i=st.integers(0, 7))
    def stalled_inserter_dies(self, i):
        t = self.t
        s = t.slot(i % t.nkeys)
        ctl = t.c.load(s)
        if ctl & 0xFF in (K.BUSY, K.PEND) and (ctl >> 8) & 0xFFFFFFFF == STALLED:
            t.c.cas(s, ctl, K.ctrl(ctl & 0xFF, dead_pid(), ctl >> 40))

    @rule(
        key=st.integers(0, 30),
        n=st.integers(1, 4),
        mode=st.sampled_from(["try", "reserve", "peek"]),
    )
    def acquire(self, key, n, mode):
        k = f"key-{key}"
        if mode == "peek" or not self._stalled_pend(k) or self._holds(k):
            return super().acquire(key, n, mode)
        before = self.holders()
        r = self.t.kt.acquire(k, n, {"try": 0, "reserve": 2 * T}[mode], self.now)
        self.check_evictions(k, before)
        event(f"beside a stalled insert of the key: {'busy' if r == KC.BUSY else r}")
        assert r in (KC.BUSY, KC.NEVER, KC.FULL), (
            r
        )  # given way to within PEND_NS (or no slot), taking nothing
        assert not self._holds(k), "a second slot for a key whose insert is stalled"


TestAtomicsInserts, TestNativeInserts = on_each_backend(
    InsertMachine,
    settings(max_examples=200, stateful_step_count=50, deadline=None),
    settings(max_examples=120, stateful_step_count=40, deadline=None),
)


class _StalePrice:
    """``params`` of a process that read a key's price before the last change and steps after it:
    the old price for its first read (its own key's), then the table's (the expiry of others)."""

    def __init__(self, params, old):
        self.params, self.old = params, old

    def __call__(self, d):
        old, self.old = self.old, None
        return old if old is not None else self.params(d)


#: Prices a key may be given, (T, burst in ops): lowered and raised in ops, in time, or both.
PRICES = [(100, 2), (100, 5), (250, 2), (40, 10), (40, 1)]
MAX_TICKS_PER_S = 1.6e10  # ticks per second (TICK_SHIFT 4): a rate of 1.6e10 / T per second


class RepriceMachine(RuleBasedStateMachine):
    """Steps of the backend's composite and of processes holding a price read before a change,
    against an exact model of the price-free state: each key's instant of last empty bucket ``E``,
    its level at ``now`` the time since, at most the TAU in force.  Prices change (the default, a
    key's override, its removal) between any two steps.  Beside the model, the promise itself:
    from a change on, a key's grants priced by it cost at most the level it kept plus the time
    since -- never the new burst less old debt."""

    backend = "atomics"

    @initialize(price=st.sampled_from(PRICES))
    def setup(self, price):
        self.t = Table(self.backend, 16, 1, novr=16)  # refuse: nothing limited is ever evicted
        self.ovr = Overrides(self.t.c, 16, self.t.probe)
        set_params(self.t.c, price[0], price[0] * price[1])
        self.ref = self._reference()
        self.now = 1 << 40
        self.e = {}  # the model: key -> E (absent: a full bucket under any price)
        self.mark = {}  # key -> [floor, spent, last use]: since the key's last change of price
        self.stale = {}  # key -> the price in force for it before its last change

    def _reference(self):
        t = self.t
        return KC.KeyedTable(
            t.c, K.CFG_SEQ, K.OVR_LIVE, K.overrides_offset(), t.novr, K.slots_offset(t.novr),
            t.nkeys, t.probe, 0x0123456789ABCDEF, 0x0FEDCBA987654321, K.KEYS_LIVE, K.EVICTED,
            K.REFUSED, K.UNREG_GRANTS, K.owner(os.getpid()), K.CUT, 0,
        )  # fmt: skip

    def price(self, k):
        return self.ref.params(self.ref.digest(k))

    def real_e(self, k):
        t, d = self.t, self.t.kt.digest(k)
        for i in range(t.nkeys):
            s = t.slot(i)
            if (
                t.c.load(s) & 0xFF == K.LIVE
                and (t.c.load(s + K.S_D0), t.c.load(s + K.S_D1)) == d
                and not t.c.load(s + K.S_V0) & K.DEAD
            ):
                return t.c.load(s + K.S_V0) - t.c.load(s + K.S_BASE) - K.MAX_TICKS
        return None

    def _changed(self, keys, before):
        """A change of price for ``keys`` (``before``: each one's price until now)."""
        for k in keys:
            t_, tau = self.price(k)
            e = self.e.get(k)
            floor = self.now - tau if e is None else max(e, self.now - tau)
            self.mark[k] = [floor, 0, floor]  # its level now: now - floor, at most TAU
            if before[k] != (t_, tau):
                self.stale[k] = before[k]

    @rule(dt=st.sampled_from([0, 1, 40, 100, 250, 1000]))
    def tick(self, dt):
        self.now += dt

    @rule(price=st.sampled_from(PRICES))
    def set_default(self, price):
        keys = [f"k{i}" for i in range(6)]
        before = {k: self.price(k) for k in keys}
        set_params(self.t.c, price[0], price[0] * price[1])
        self._changed(keys, before)

    @rule(key=st.integers(0, 5), price=st.one_of(st.none(), st.sampled_from(PRICES)))
    def set_override(self, key, price):
        k = f"k{key}"
        before = {k: self.price(k)}
        d = self.t.kt.digest(k)
        if price is None:
            self.ovr.remove(d)
        else:
            self.ovr.set(d, Rate(MAX_TICKS_PER_S / price[0], 1.0, price[1]))
            assert self.price(k) == (price[0], price[0] * price[1])
        self._changed([k], before)

    @rule(
        key=st.integers(0, 5),
        n=st.integers(1, 5),
        mode=st.sampled_from(["try", "reserve", "peek"]),
        stale=st.booleans(),
    )
    def acquire(self, key, n, mode, stale):
        k = f"k{key}"
        max_wait = {"try": 0, "reserve": 300, "peek": -1}[mode]
        price = self.price(k)
        kt = self.t.kt
        if stale and k in self.stale:  # a call that read the price before the key's last change
            price = self.stale[k]
            kt = self._reference()
            kt.params = _StalePrice(kt.params, price)
            event("a step priced before the last change")
        before = {f"k{i}": self.real_e(f"k{i}") for i in range(6)}
        r = kt.acquire(k, n, max_wait, self.now)
        for other, e in before.items():  # an idle key's slot may be had by a new key's insert
            if other != k and e is not None and self.real_e(other) is None:
                assert e + self.price(other)[1] <= self.now, "a limited key was forgotten"
                self.e.pop(other, None)
        t_, tau = price
        if n > tau // t_:
            assert r == KC.NEVER
            return
        e = self.e.get(k)
        base = self.now - tau if e is None else max(e, self.now - tau)
        wait = max(0, base + n * t_ - self.now)
        if mode == "peek" or wait > max_wait:
            assert r == (wait if mode == "peek" else KC.REFUSED), (r, wait)
            return
        assert r == wait, (r, wait)
        self.e[k] = base + n * t_
        assert self.real_e(k) == self.e[k]  # the word holds E, whatever the price
        if kt is self.t.kt and k in self.mark:
            mark = self.mark[k]
            mark[1] += n * t_
            mark[2] = self.now + r
        elif k in self.mark:  # a step under the old price: the promise counts from here on
            self.mark[k] = [max(self.e[k], self.now - self.price(k)[1]), 0, self.now + r]

    @invariant()
    def grants_since_a_change_cost_at_most_the_level_kept_and_the_time_since(self):
        for k, (floor, spent, last) in getattr(self, "mark", {}).items():
            assert spent <= last - floor, (k, floor, spent, last)


TestAtomicsReprice, TestNativeReprice = on_each_backend(
    RepriceMachine, settings(max_examples=50, stateful_step_count=40, deadline=None)
)
