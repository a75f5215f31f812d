"""The public surface in one process: creation, attach, errors, stats, pickling, lifecycle."""

import asyncio
import math
import os
import pickle
import struct
import sys
import threading
import time
from types import SimpleNamespace

import pytest
from support.clock import FakeClock
from support.segments import shm_bytes

import shmlimit
from shmlimit.config import validate_timeout
from shmlimit.keyed.window_table import WindowTable
from shmlimit.shm import banks
from shmlimit.shm import layout as L
from shmlimit.shm.banks import ConfigLock


def test_create_attach_and_unlink(name):
    lim = shmlimit.Limiter(name, rate=1000)
    assert lim.created
    assert (lim.rate, lim.per, lim.capacity) == (1000.0, 1.0, 10.0)
    other = shmlimit.attach(name)
    assert other.config == lim.config
    assert shmlimit.Limiter(name, rate=1000).config == lim.config  # same config: attaches
    assert name in shmlimit.list_names()
    lim.unlink()
    assert name not in shmlimit.list_names()
    assert lim.try_acquire()  # mappings outlive the name
    lim.close()
    other.close()
    with pytest.raises(FileNotFoundError, match=name):
        shmlimit.attach(name)
    with pytest.raises(FileNotFoundError, match=name):
        shmlimit.unlink(name)


def test_slow_limit_is_strict(name):
    # on a still injected clock the next slot stays 6 s away, however late this test runs
    slow = shmlimit.Limiter(name, rate=1, per=6, clock=FakeClock())
    assert slow.capacity == 1
    assert slow.try_acquire()
    assert not slow.try_acquire()
    assert slow.acquire(timeout=5.5) is False  # the next slot is ~6 s away: refused at once
    s = slow.stats()
    assert s.grants == 1 and s.deficiency == 0
    slow.close()


def test_config_mismatch_names_both_configs(name):
    first = shmlimit.Limiter(name, rate=1000)  # a live user (a closed one would not be)
    with pytest.raises(shmlimit.ConfigMismatchError) as e:
        shmlimit.Limiter(name, rate=500, burst=3)
    first.close()
    msg = str(e.value)
    assert "rate=1000" in msg and "rate=500" in msg and "burst=3" in msg


def test_acquire_try_acquire_context_manager_and_stats(name):
    lim = shmlimit.Limiter(name, rate=100, burst=5)
    assert lim.acquire() is True
    with lim:
        pass
    assert lim.try_acquire(3)
    assert not lim.try_acquire(6)  # more than the capacity: can never succeed
    s = lim.stats()
    assert isinstance(s, shmlimit.Stats)
    assert s.name == name and s.rate == 100 and s.capacity == 5
    assert s.grants == 5
    assert 0 <= s.available <= 5
    mine = [p for p in s.processes if p.pid == os.getpid()]
    assert len(mine) == 1 and mine[0].alive and mine[0].grants == 5
    assert s.backend == lim.backend
    r = repr(lim)
    assert name in r and "grants=5" in r and "rate=100" in r
    with pytest.raises(Exception):
        s.grants = 0  # frozen
    lim.close()
    assert "closed" in repr(lim)
    with pytest.raises(ValueError, match="closed"):
        lim.acquire()


def test_timed_acquire_takes_nothing_when_it_cannot_fit(name):
    lim = shmlimit.Limiter(name, rate=10, burst=1, initial=0)
    before = lim.stats()
    assert lim.acquire(5, timeout=0.25) is False
    after = lim.stats()
    assert after.grants == before.grants and after.deficiency == 0
    assert lim.acquire(1, timeout=0.5) is True  # one op is ~0.1 s away
    lim.close()


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(per=60),
        dict(burst=50),
        dict(ratio=2.0),
        dict(max_reserved=0.5),
        dict(max_behind=0.5),
        dict(capped=True),
        dict(initial=0),
        dict(slots=8),
    ],
)
def test_options_of_a_new_limiter_without_rate_are_refused(name, kwargs):
    """Without rate= the call only attaches: an option that would configure a new limiter is an
    error naming it, not dropped while the limiter keeps its own configuration."""
    lim = shmlimit.Limiter(name, rate=10)
    (param,) = kwargs
    with pytest.raises(ValueError, match=f"{param}= apply only when rate= creates"):
        shmlimit.Limiter(name, **kwargs)
    assert lim.config == shmlimit.Limiter(name).config  # attaching as it is still works
    lim.close()


def test_a_missing_limiter_opened_without_rate_says_rate_creates_it(name):
    with pytest.raises(shmlimit.LimiterNotFoundError, match="pass rate= to create it") as e:
        shmlimit.Limiter(name)
    assert e.value.name == name and name not in shmlimit.list_names()


def test_pickles_as_its_name(name):
    lim = shmlimit.Limiter(name, rate=50)
    data = pickle.dumps(lim)
    assert name.encode() in data and len(data) < 200
    clone = pickle.loads(data)
    assert clone.name == name and clone.config == lim.config
    clone.close()
    lim.close()


def test_inspect_reads_without_joining(name):
    lim = shmlimit.Limiter(name, rate=50)
    lim.acquire()
    s = shmlimit.inspect(name)
    assert s.grants == 1 and [p.pid for p in s.processes] == [os.getpid()]
    lim.close()
    with pytest.raises(FileNotFoundError):
        shmlimit.inspect(name + "-missing")


def test_available_counts_only_the_places_free_in_flight_when_capped(name):
    clock = FakeClock()
    lim = shmlimit.Limiter(name, rate=100, burst=5, capped=True, clock=clock)
    assert all(lim.try_acquire() for _ in range(5))
    for _ in range(50):  # the bucket full again (the filler's work, 1 ms at a time) ...
        clock.advance(1_000_000)
        lim._att.bucket.replenish()
    # ... but every place in flight is taken
    assert lim.stats().available == 0 and not lim.try_acquire()
    lim.release(2)
    assert lim.stats().available == 2 and lim.try_acquire(2) and not lim.try_acquire()
    lim.close()


def test_retry_after_is_infinite_for_more_than_a_capped_limiter_ever_admits(name):
    """A capped limiter never admits more than its capacity in ops (``acquire`` raises, a try is
    refused), yet ``retry_after`` named a wait of the schedule's, as if it could be granted then:
    a ``KeyedLimiter`` says ``inf`` for an ``n`` it can never grant, and so does this now."""
    lim = shmlimit.Limiter(name, rate=100, burst=2, capped=True)
    other = shmlimit.attach(name)  # the capacity is the segment's, for every user
    assert lim.retry_after(2) == 0.0 and math.isinf(other.retry_after(3))
    lim.set_rate(100, burst=3)
    assert other.retry_after(3) < 0.1 and math.isinf(other.retry_after(4))  # (3: as it refills)
    with pytest.raises(ValueError, match="at most the capacity"):
        other.acquire(4)
    other.close()
    lim.close()


def test_inspect_never_waits_on_a_config_lock_a_dead_writer_holds(name, monkeypatch):
    lim = shmlimit.Limiter(name, rate=50)
    cells = lim._peek().cells
    lock = ConfigLock(cells, L.CFG_SEQ, banks.CONFIG_LOCK_TIMEOUT_NS).__enter__()  # never left
    seq = cells.load(L.CFG_SEQ)
    assert seq & 1

    def waited(seconds):
        raise AssertionError(f"inspect waited {seconds} s on a private copy")

    monkeypatch.setattr(
        banks, "time", SimpleNamespace(monotonic_ns=time.monotonic_ns, sleep=waited)
    )
    s = shmlimit.inspect(name)
    assert (s.rate, s.per, s.capacity) == (50, 1, 1)
    assert cells.load(L.CFG_SEQ) == seq  # the segment is untouched: only the copy was read
    monkeypatch.undo()
    lock.__exit__(None, None, None)
    lim.close()


# ---- bad input: a clear error naming the parameter, and nothing changed -----------

BAD_CONFIGS = [
    (dict(rate=0), "rate"),
    (dict(rate=-1), "rate"),
    (dict(rate=math.inf), "rate"),
    (dict(rate=math.nan), "rate"),
    (dict(rate="ten"), "rate"),
    (dict(rate="10,0.5"), "ratio"),
    (dict(rate="10,1.1,stop"), "verb"),
    (dict(rate=10, ratio=0.9), "ratio"),
    (dict(rate=10, max_reserved=-1), "max_reserved"),
    (dict(rate=10, max_behind=math.nan), "max_behind"),
    (dict(rate=[10]), "rate"),
    (dict(rate=True), "rate"),
    (dict(rate=1e18), "rate/per"),
    (dict(rate=1, per=1e-12), "rate/per"),
    (dict(rate=10, per=0), "per"),
    (dict(rate=10, per=-2), "per"),
    (dict(rate=10, burst=0), "burst"),
    (dict(rate=10, burst=0.5), "burst"),
    (dict(rate=10, burst=math.inf), "burst"),
    (dict(rate=1e-9, burst=1e12), "burst"),
    (dict(rate=10, mode=0o1777), "mode"),
    (dict(rate=10, initial=-1), "initial"),
    (dict(rate=10, slots=0), "slots"),
    # an int beyond every float is no number of ops or seconds (not an OverflowError)
    (dict(rate=10**400), "rate"),
    (dict(rate=10, per=10**400), "per"),
    (dict(rate=10, burst=10**400), "burst"),
    (dict(rate=10, ratio=10**400), "ratio"),
    (dict(rate=10, max_reserved=10**400), "max_reserved"),
    (dict(rate="10/s", per=10**400), "per"),
    (dict(rate="10,1.5", ratio=10**400), "ratio"),
    # a bool is no number, even where it equals one
    (dict(rate=10, max_reserved=False), "max_reserved"),
    (dict(rate=10, max_behind=False), "max_behind"),
    (dict(rate="10,1", ratio=True), "ratio"),
    (dict(rate="10,1", ratio="1"), "ratio"),
]


@pytest.mark.parametrize("kwargs,param", BAD_CONFIGS)
def test_bad_config_is_refused_and_creates_nothing(name, kwargs, param):
    with pytest.raises((ValueError, TypeError), match=param.replace("/", ".")):
        shmlimit.Limiter(name, **kwargs)
    assert name not in shmlimit.list_names()


@pytest.mark.parametrize(
    "bad", ["", "a/b", "../x", ".hidden", "-x", "x" * 65, "naïve", "sp ace", None, 3]
)
def test_bad_names_are_refused(bad):
    with pytest.raises((ValueError, TypeError), match="name"):
        shmlimit.Limiter(bad, rate=1)


# What a bad call could touch: the config line, the tail, and the counters.
GUARDED = [(L.CFG_SEQ, L.CFG_FLAGS + 8), (L.TAIL, L.TAIL + 8), (L.UNREG_GRANTS, L.UNREG_GRANTS + 8)]


def guarded(name):
    raw = shm_bytes(name)
    return [raw[a:b] for a, b in GUARDED] + [raw[L.HEADER_BYTES :]]


@pytest.mark.parametrize(
    "call,param",
    [
        (lambda l: l.acquire(0), "n"),
        (lambda l: l.acquire(-3), "n"),
        (lambda l: l.acquire(1.5), "n"),
        (lambda l: l.acquire(True), "n"),
        (lambda l: l.acquire(2**62), "n"),
        (lambda l: l.try_acquire(0), "n"),
        (lambda l: l.try_acquire(2**62), "n"),
        (lambda l: l.acquire(1, timeout=-1), "timeout"),
        (lambda l: l.acquire(1, timeout=math.nan), "timeout"),
        (lambda l: l.acquire(1, timeout="1"), "timeout"),
    ],
)
def test_bad_calls_raise_and_leave_the_segment_untouched(name, call, param):
    lim = shmlimit.Limiter(name, rate=10, burst=2)
    lim.acquire()
    before = guarded(name)
    with pytest.raises((ValueError, TypeError), match=param):
        call(lim)
    assert guarded(name) == before
    lim.close()


def test_infinite_timeout_means_no_timeout(name):
    lim = shmlimit.Limiter(name, rate=1000)
    assert lim.acquire(1, timeout=math.inf)
    assert lim.acquire(1, timeout=10**400)  # beyond every float: as infinite as inf
    assert lim.reserve(1, max_wait=10**400) is not None
    lim.close()


def test_a_timeout_too_large_for_nanoseconds_means_no_timeout(name):
    """A finite timeout past about 1.8e299 s has no finite count of nanoseconds: it raised a bare
    OverflowError from the slow path of a Limiter (of one rate or several), where the keyed
    kinds granted.  It means no limit, for every kind."""
    lims = [
        shmlimit.Limiter(name, rate=10, burst=5),
        shmlimit.Limiter(name + "-m", rates=[("10/s", 5), ("100/min", 5)]),
        shmlimit.KeyedLimiter(name + "-k", rate=10, burst=5, keys=64),
        shmlimit.KeyedLimiter(name + "-km", rates=[("10/s", 5), ("100/min", 5)], keys=64),
    ]
    try:
        for lim in lims:
            key = ("k",) if "Keyed" in type(lim).__name__ else ()
            for huge in (1e300, sys.float_info.max):
                assert lim.acquire(*key, timeout=huge) is True  # a full bucket: granted now
            assert asyncio.run(lim.acquire_async(*key, timeout=1e300)) is True
        assert validate_timeout(1e300) is None and validate_timeout(1e299) == 1e299
    finally:
        for lim in lims:
            lim.unlink()
            lim.close()


# ---- corrupt or foreign segments are refused -------------------------------------


def _write(name, offset, data):
    with open(f"/dev/shm/shmlimit.{name}", "r+b") as f:
        f.seek(offset)
        f.write(data)


def _make_segment(name):
    lim = shmlimit.Limiter(name, rate=10)
    lim.close()


@pytest.mark.parametrize(
    "offset,value,message",
    [
        (L.MAGIC_OFF, b"NOTSHMLM", "not a shmlimit limiter"),
        (L.VERSION_OFF, struct.pack("<Q", 99), "layout version 99"),
        (L.SIZE_OFF, struct.pack("<Q", 123), "corrupt"),
        (L.SLOTS_OFF, struct.pack("<Q", 10**6), "corrupt"),
    ],
)
def test_corrupt_header_is_refused(name, offset, value, message):
    _make_segment(name)
    _write(name, offset, value)
    with pytest.raises(shmlimit.SegmentError, match=message):
        shmlimit.attach(name)


def test_truncated_segment_is_refused(name):
    _make_segment(name)
    os.truncate(f"/dev/shm/shmlimit.{name}", 100)
    with pytest.raises(shmlimit.SegmentError, match="truncated"):
        shmlimit.attach(name)


def test_default_mode_is_owner_only(name):
    shmlimit.Limiter(name, rate=10).close()
    assert os.stat(f"/dev/shm/shmlimit.{name}").st_mode & 0o777 == 0o600


def test_explicit_mode_is_applied_despite_umask(name):
    old = os.umask(0o077)
    try:
        shmlimit.Limiter(name, rate=10, mode=0o660).close()
    finally:
        os.umask(old)
    assert os.stat(f"/dev/shm/shmlimit.{name}").st_mode & 0o777 == 0o660


def _abandoned_segment(name, creator_pid):
    """What a creator killed mid-initialisation leaves: a sized segment, no magic, no READY."""
    size = L.segment_size(L.DEFAULT_SLOTS)
    with open(f"/dev/shm/shmlimit.{name}", "wb") as f:
        f.write(struct.pack("<Q", 0) * 5 + struct.pack("<Q", creator_pid) + bytes(size - 48))
    os.chmod(f"/dev/shm/shmlimit.{name}", 0o600)


def _dead_pid():
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    return pid


@pytest.mark.parametrize("creator", ["none", "dead"])
def test_abandoned_segment_is_refused_on_attach_and_replaced_on_create(name, creator):
    _abandoned_segment(name, 0 if creator == "none" else _dead_pid())
    with pytest.raises(shmlimit.SegmentError, match="never initialised"):
        shmlimit.attach(name)
    lim = shmlimit.Limiter(name, rate=10)  # create intent: the abandoned segment is replaced
    assert lim.created and lim.try_acquire()
    lim.close()


def test_create_retries_when_the_name_vanishes_between_create_and_open(name, monkeypatch):
    from shmlimit import header as limmod
    from shmlimit.shm.segment import Segment

    real_create = Segment.create
    calls = []

    def racing_create(n, size, mode):
        calls.append(n)
        if len(calls) == 1:  # someone else holds the name ... and unlinks it before we open it
            real_create(n, size, mode).close()
            shmlimit.unlink(n)
            return None
        return real_create(n, size, mode)

    monkeypatch.setattr(limmod.Segment, "create", staticmethod(racing_create))
    lim = shmlimit.Limiter(name, rate=10)
    assert lim.created and len(calls) == 2
    lim.close()


def test_a_handle_collected_during_an_attach_does_not_deadlock(name, monkeypatch):
    """The garbage collector may run a dropped Limiter's __del__ inside another attach."""
    import gc

    from shmlimit import header as limmod

    dropped = shmlimit.Limiter(name, rate=10)
    cycle = [dropped]
    cycle.append(cycle)  # only the cycle collector can free it
    del dropped, cycle
    real_create = limmod.Segment.create

    def create_then_collect(n, size, mode):
        gc.collect()  # runs the dropped handle's __del__ while the registry lock is held
        return real_create(n, size, mode)

    monkeypatch.setattr(limmod.Segment, "create", staticmethod(create_then_collect))
    done = []

    def attach_other():
        other = shmlimit.Limiter(name + "-b", rate=10)
        other.close()
        other.unlink()
        done.append(True)

    t = threading.Thread(target=attach_other, daemon=True)
    t.start()
    t.join(20)
    assert done, "the attach deadlocked on the registry lock"
    shmlimit.Limiter(name).close()  # a collected handle stays attached; closing one more ends it


# Every kind of limiter takes the same segment options, checked by the same rules (segment.py).
KINDS = {
    "Limiter": lambda name, **kw: shmlimit.Limiter(name, rate=10, **kw),
    "several rates": lambda name, **kw: shmlimit.Limiter(name, rates=["10/s", "100/min"], **kw),
    "KeyedLimiter": lambda name, **kw: shmlimit.KeyedLimiter(name, rate=10, keys=100, **kw),
    "WindowTable": lambda name, **kw: WindowTable(name, 100, **kw),
}


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize(
    "kwargs,param",
    [
        (dict(mode=0o1000), "mode"),
        (dict(mode=True), "mode"),
        (dict(trusted_uids="0"), "trusted_uids"),
        (dict(trusted_uids=[-1]), "trusted_uids"),
        (dict(trusted_uids=[2**32]), "trusted_uids"),
    ],
)
def test_every_kind_refuses_bad_segment_options_and_creates_nothing(name, kind, kwargs, param):
    with pytest.raises((ValueError, TypeError), match=param):
        KINDS[kind](name, **kwargs)
    assert not any(n == name or n.startswith(name + ".") for n in shmlimit.list_names())


@pytest.mark.parametrize("kind", ["Limiter", "several rates"])
@pytest.mark.parametrize("slots", [0, L.MAX_SLOTS + 1, 2.0, True])
def test_slots_are_checked_alike_by_one_rate_and_several(name, kind, slots):
    with pytest.raises(ValueError, match="slots"):
        KINDS[kind](name, slots=slots)
    assert not any(n == name or n.startswith(name + ".") for n in shmlimit.list_names())


#: Every kind that takes clock= (CLOCK_MONOTONIC nanoseconds, an int).
CLOCKED = {
    "Limiter": KINDS["Limiter"],
    "several rates": KINDS["several rates"],
    "keyed, several rates": lambda name, **kw: shmlimit.KeyedLimiter(
        name, rates=["10/s", "100/min"], keys=100, **kw
    ),
    "WindowTable": KINDS["WindowTable"],
}


@pytest.mark.parametrize("kind", sorted(CLOCKED))
@pytest.mark.parametrize(
    "clock,error",
    [
        (time.time, TypeError),  # seconds, a float
        (lambda: 1.5e9, TypeError),
        (lambda: True, TypeError),
        (1_000, TypeError),  # a reading, not a clock
        (lambda: -1, ValueError),
        (lambda: 1 << 63, ValueError),
    ],
)
def test_a_bad_clock_is_refused_before_anything_is_opened(name, kind, clock, error):
    with pytest.raises(error, match="clock"):
        CLOCKED[kind](name, clock=clock)
    assert not any(n == name or n.startswith(name + ".") for n in shmlimit.list_names())


class _TurningClock:
    """A clock whose first reading is a good one, and every later one seconds as a float."""

    def __init__(self):
        self.readings = 0

    def __call__(self):
        self.readings += 1
        return FakeClock()() if self.readings == 1 else time.time()


@pytest.mark.parametrize("kind", ["Limiter", "several rates"])
def test_a_creation_that_fails_midway_takes_its_segment_back(name, kind):
    """A creator whose initialisation raises unlinks the segment it made and re-raises: the name
    is free at once, for this process and every other, not half-made for the creator's life."""
    with pytest.raises(TypeError):
        KINDS[kind](name, clock=_TurningClock())  # checked, then read again to initialise
    assert name not in shmlimit.list_names()
    lim = KINDS[kind](name)
    assert all(lim.created.values()) if isinstance(lim.created, dict) else lim.created
    assert lim.try_acquire()
    lim.close()


def test_live_changes_refused_leave_the_config_as_it_was(name):
    """One set of rules for a Limiter's set_rate/apply and for each rate of several: a refusal
    names what was wrong and publishes nothing."""
    one = shmlimit.Limiter(name, rate=10)
    several = shmlimit.Limiter(f"{name}-m", rates=["10/s", "100/min"])
    try:
        before = (one.config, several.configs)
        with pytest.raises(ValueError, match="verb 'stop' is not allowed in set_rate"):
            one.set_rate("20,stop")
        with pytest.raises(ValueError, match="ratio given twice"):
            one.set_rate("20,1.5", ratio=1.2)
        with pytest.raises(ValueError, match="per given twice"):
            one.set_rate("20/min", per=5)
        with pytest.raises(ValueError):
            one.apply("20,sideways")
        with pytest.raises(ValueError, match="rate must be finite"):
            one.set_rate(10**400)  # beyond every float
        with pytest.raises(ValueError, match="burst must be finite"):
            several.set_rate("0", 20, burst=10**400)
        with pytest.raises(ValueError, match="ratio .* applies only to a Limiter of one rate"):
            several.set_rate(0, "20,1.5")
        with pytest.raises(ValueError, match="verb .* applies only to a Limiter of one rate"):
            several.set_rate(1, "20,configure")
        assert (one.config, several.configs) == before
        one.set_rate("20,1.5")  # a spec's ratio applies to one rate
        several.set_rate(1, "200/min")  # a rate string sets the window too
        assert (one.rate, one.config.ratio) == (20.0, 1.5)
        assert (several.configs["1"].rate, several.configs["1"].per) == (200.0, 60.0)
        assert several.configs["0"] == before[1]["0"]
    finally:
        for lim in (one, several):
            lim.close()
            lim.unlink()


def _raise_rate_limited(name):
    raise shmlimit.RateLimited(name, 2.5)


def test_errors_cross_a_pool_as_they_were_raised(name):
    """An error raised in a pool's worker (or a task queue's) is pickled back to the caller: it
    arrives as raised, its message and attributes whole (a ``RateLimited`` failed to unpickle,
    and a missing limiter's message repeated itself inside another)."""
    import multiprocessing
    import pickle

    from shmlimit import errors as E

    made = [
        E.LimiterNotFoundError(name),
        E.RateLimited(name, 2.5),
        E.ConfigMismatchError(name, "rate=1", "rate=2", live=True),
        E.UntrustedSegmentError(name, 1234, 0o666, "writable by others"),
        E.KeyTableFullError(name, 64, busy=True),
        E.QueueFullError(10, 3),
        E.AbandonedSegmentError(name, 7, 42),
        E.UnsupportedError("KeyedLimiter", "reserve", "keys keep no queue"),
        E.SegmentError("corrupt"),
        E.SharedMemoryFullError(28, "no room"),
        E.MissingExtraError("shmlimit.redis", "redis", ImportError("no redis", name="redis")),
    ]
    for e in made:
        back = pickle.loads(pickle.dumps(e))
        assert type(back) is type(e) and str(back) == str(e) and vars(back) == vars(e)
    assert pickle.loads(pickle.dumps(made[-2])).errno == 28  # an OSError's errno kept
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        with pytest.raises(shmlimit.RateLimited) as got:
            pool.apply(_raise_rate_limited, (name,))
    assert got.value.retry_after == 2.5 and name in str(got.value)
