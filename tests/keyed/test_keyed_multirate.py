"""Several rates per key (KeyedLimiter(rates=)), step by step on an injected clock, and the
GCRA take/undo pair it is built on, on every backend."""

import asyncio
import pickle
from contextlib import contextmanager

import hypothesis.strategies as st
import pytest
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from support.clock import FakeClock
from support.windows import check_windows

import shmlimit
from shmlimit.keyed import cells as KC
from shmlimit.keyed.multi import MultiKeyedLimiter, _KeyRate

S = 1_000_000_000


@pytest.fixture
def clock():
    return FakeClock()


def make(name, rates, clock, cleanup, **kw):
    lim = shmlimit.KeyedLimiter(name, rates=rates, keys=256, clock=clock, **kw)
    assert isinstance(lim, MultiKeyedLimiter)
    cleanup.append(lim)
    lim._sleep = lambda seconds: clock.advance(
        max(1, round(seconds * S))
    )  # sleeping moves the clock
    return lim


def grants(lim):
    return {k: s.grants for k, s in lim.stats().items()}


def take(lim, i, key, n=1):
    """``n`` ops of ``key`` from rate ``i`` alone, now on the limiter's clock (another caller)."""
    return lim._lims[i]._live().kt.acquire(key, n, 0, lim._now()) >= 0


@contextmanager
def before_the_takes(hook):
    """``hook()`` runs once, in the next try that takes: after its looks, before its first take
    (the window of a race, or of a preemption)."""
    real = _KeyRate.take
    pending = [hook]

    def take(self):
        while pending:
            pending.pop()()
        return real(self)

    _KeyRate.take = take
    try:
        yield
    finally:
        _KeyRate.take = real


def peek(lim, i, key, n=1):
    """Rate ``i``'s wait (ticks) for ``n`` ops of ``key`` now on the limiter's clock; takes nothing."""
    return lim._lims[i]._live().kt.acquire(key, n, -1, lim._now())


def test_every_key_is_held_to_every_rate(name, clock, cleanup):
    lim = make(name, [("10/s", 2), ("1/s", 1)], clock, cleanup)
    assert [s.rate for s in lim.stats().values()] == [10, 1]
    assert [n for n in shmlimit.list_names() if n.startswith(name)] == [name]  # one segment
    assert lim.try_acquire("a")
    assert not lim.try_acquire("a")  # the second rate (1/s, burst 1) refuses: all or nothing
    assert lim.try_acquire("b")  # another key: its own buckets
    assert grants(lim) == {"0": 2, "1": 2}
    assert lim.retry_after("a") == pytest.approx(1.0)
    clock.advance(S // 2)
    assert not lim.try_acquire("a") and lim.retry_after("a") == pytest.approx(0.5)
    clock.advance(S // 2)
    assert lim.try_acquire("a")
    assert grants(lim) == {"0": 3, "1": 3}


def test_a_refusal_leaves_every_rate_as_it_was(name, clock, cleanup):
    lim = make(name, {"requests": ("10/s", 3), "tokens": ("100/s", 100)}, clock, cleanup)
    assert lim.try_acquire("k", requests=1, tokens=60)
    before = (peek(lim, 0, "k", 3), grants(lim))
    for _ in range(3):
        assert not lim.try_acquire("k", requests=1, tokens=60)  # tokens short
    assert (peek(lim, 0, "k", 3), grants(lim)) == before  # the request was never taken
    assert lim.try_acquire("k", tokens=40)  # a rate not named costs nothing
    assert grants(lim) == {"requests": 1, "tokens": 100}


def test_costs_by_name_and_bad_calls(name, clock, cleanup):
    lim = make(name, {"requests": "10/s", "tokens": ("1000/s", 1000)}, clock, cleanup)
    for call, error in [
        (lambda: lim.try_acquire("k", tokenz=1), TypeError),
        (lambda: lim.try_acquire("k", 2, tokens=1), TypeError),
        (lambda: lim.try_acquire("k", tokens=0), ValueError),
        (lambda: lim.try_acquire("k", tokens=-1), ValueError),
        (lambda: lim.try_acquire("k", tokens=True), TypeError),  # a bool is no count of ops
        (lambda: lim.try_acquire("k", 0), ValueError),
        (lambda: lim.acquire("k", timeout=-1), ValueError),
        (lambda: lim.try_acquire(12, tokens=1), TypeError),  # a key is str or bytes
        (lambda: lim.set_rate("nope", "1/s"), ValueError),
    ]:
        with pytest.raises(error):
            call()
    assert grants(lim) == {"requests": 0, "tokens": 0}
    listed = make(name + "l", ["10/s"], clock, cleanup)
    with pytest.raises(TypeError, match="list of rates"):
        listed.try_acquire("k", tokens=1)


def test_rates_and_rate_or_unknown_options_do_not_mix(name):
    with pytest.raises(TypeError, match="not both"):
        shmlimit.KeyedLimiter(name, 10, rates=["1/s"])
    with pytest.raises(TypeError, match="not supported"):
        shmlimit.KeyedLimiter(name, rates=["1/s"], capped=True)
    with pytest.raises(ValueError, match="rates"):
        shmlimit.KeyedLimiter(name, rates=[])
    # a rate no call could cost by name: acquire("k", key=1) is "multiple values for 'key'"
    for param in ("key", "self"):
        with pytest.raises(ValueError, match="rates: each name must be"):
            shmlimit.KeyedLimiter(name, rates={param: "1/s", "b": "1/s"})
    assert not [n for n in shmlimit.list_names() if n.startswith(name)]


def test_a_cost_above_a_burst_never_fits(name, clock, cleanup):
    lim = make(name, [("10/s", 2), ("100/s", 5)], clock, cleanup)
    assert not lim.try_acquire("k", 3)
    assert not lim.acquire("k", 3, timeout=10)
    assert lim.retry_after("k", 3) == float("inf")
    with pytest.raises(ValueError, match="burst"):
        lim.acquire("k", 3)
    assert grants(lim) == {"0": 0, "1": 0}


def test_acquire_waits_for_the_slowest_rate_holding_nothing(name, clock, cleanup):
    lim = make(name, [("10/s", 1), ("2/s", 1)], clock, cleanup)
    assert lim.acquire("k")
    t0 = clock.now
    assert not lim.acquire("k", timeout=0.4)  # the 2/s rate needs 0.5 s: fails at once
    assert clock.now == t0
    assert not take(lim, 0, "k")  # the fast rate: its own op of t0 still counts
    clock.advance(S // 10)
    assert take(lim, 0, "k")  # and nothing was held on it by the refused waiter
    assert lim.acquire("k")  # waits (the clock moves) until the 2/s rate allows it
    assert clock.now - t0 >= S // 2
    assert grants(lim) == {"0": 3, "1": 2}
    assert clock.now - t0 < S // 2 + S // 100  # and no later than the wait it peeked


def test_acquire_async(name, clock, cleanup):
    lim = make(name, [("1000/s", 1), ("1000/s", 1)], clock, cleanup)

    async def main():
        assert await lim.acquire_async("k")
        assert not await lim.acquire_async("k", timeout=0)

    asyncio.run(main())
    assert grants(lim) == {"0": 1, "1": 1}


def test_acquire_async_naps_on_the_loop_holding_nothing(name, clock, cleanup, monkeypatch):
    """The async acquire is the sync one's step object under the async driver: the same waits,
    each a nap on the event loop (here moving the injected clock), never a blocking sleep."""
    from shmlimit.acquire import drivers

    lim = make(name, [("10/s", 1), ("2/s", 1)], clock, cleanup)
    lim._sleep = None  # the sync hook: never called on the loop
    naps = []

    async def nap(seconds):
        naps.append(seconds)
        clock.advance(max(1, round(seconds * S)))

    monkeypatch.setattr(drivers.asyncio, "sleep", nap)

    async def main():
        assert await lim.acquire_async("k")
        t0 = clock.now
        assert not await lim.acquire_async("k", timeout=0.4)  # the 2/s rate needs 0.5 s
        assert clock.now == t0 and not naps  # refused at once, without a nap
        assert await lim.acquire_async("k")  # naps until the 2/s rate allows it
        return t0

    t0 = asyncio.run(main())
    assert naps and S // 2 <= clock.now - t0 < S // 2 + S // 100
    assert grants(lim) == {"0": 2, "1": 2}


@pytest.mark.parametrize("run", ["sync", "async"])
def test_a_stalled_insert_refuses_a_timed_acquire_and_an_untimed_one_tries_again(
    name, clock, cleanup, monkeypatch, run
):
    """A take that finds an insert of the key stalled by a live process (SIGSTOPped between its
    PEND and LIVE stores) answers ``BUSY`` after waiting ``PEND_NS`` for it.  A timed acquire
    refuses then, as one rate's does; it took a one-tick nap and tried again, each take blocking
    for ``PEND_NS``, past its timeout for as long as the insert stayed stalled.  An untimed one
    naps ``BUSY_NAP`` and tries again until the insert is gone."""
    from shmlimit.acquire import drivers
    from shmlimit.keyed.cells import BUSY_NAP

    lim = make(name, {"a": ("10/s", 5), "b": ("1/s", 5)}, clock, cleanup)
    busy = [0]  # the takes still to find the insert stalled
    real = _KeyRate.take

    def take(rate):
        if busy[0]:
            busy[0] -= 1
            return KC.BUSY
        return real(rate)

    monkeypatch.setattr(_KeyRate, "take", take)
    naps = []

    def nap(seconds):
        naps.append(seconds)
        clock.advance(max(1, round(seconds * S)))

    async def nap_async(seconds):
        nap(seconds)

    lim._sleep = nap
    monkeypatch.setattr(drivers.asyncio, "sleep", nap_async)

    def acquire(**kw):
        if run == "sync":
            return lim.acquire("k", a=1, b=1, **kw)
        return asyncio.run(lim.acquire_async("k", a=1, b=1, **kw))

    busy[0] = 1000
    assert acquire(timeout=0.3) is False
    assert busy[0] == 999 and not naps  # refused at the first stalled take, without a nap
    busy[0] = 3
    assert acquire() is True  # untimed: naps, tries again, granted once the insert is gone
    assert naps == [pytest.approx(BUSY_NAP)] * 3
    assert grants(lim) == {"a": 1, "b": 1}


def test_set_rate_by_name_stats_repr_and_pickle(name, clock, cleanup):
    lim = make(name, {"requests": ("1/s", 1), "tokens": ("100/s", 100)}, clock, cleanup)
    assert lim.try_acquire("k", requests=1) and not lim.try_acquire("k", requests=1)
    lim.set_rate("requests", "10/s", burst=2)  # live; a key's schedule so far is kept
    assert [lim.try_acquire("j", requests=1) for _ in range(3)] == [True, True, False]
    lim.set_rate(0, 5, key="vip")
    assert lim._lims[0].override("vip") == (5, 1.0, 1.0)  # the default burst: at least one op
    assert "requests=10/1s(capacity=2 " in repr(lim) and "tokens=100/1s" in repr(lim)
    copy = pickle.loads(pickle.dumps(lim))
    try:
        assert copy.keys == ("requests", "tokens")
        assert copy.stats()["requests"].rate == 10
    finally:
        copy.close()
    lim.close()
    assert "closed" in repr(lim)
    with pytest.raises(ValueError, match="closed"):
        lim.try_acquire("k")
    with pytest.raises(ValueError, match="closed"):  # closed first, then unsupported
        lim.reserve("k")


@pytest.mark.parametrize("spec", ["1K,1.5", "2K,3,start", "2K,stop"])
def test_a_rate_specs_ratio_or_verb_is_refused_not_dropped(name, clock, cleanup, spec):
    with pytest.raises(ValueError, match=r"rates\['a'\]: .*applies only to a Limiter of one"):
        make(name, {"a": spec, "b": "1/s"}, clock, cleanup)
    assert not [n for n in shmlimit.list_names() if n.startswith(name)]
    lim = make(name, {"a": "1K", "b": "1/s"}, clock, cleanup)
    for key in (None, "k"):
        with pytest.raises(ValueError, match="one rate.*; a KeyedLimiter takes"):
            lim.set_rate("a", spec, key=key)
    assert (lim.stats()["a"].rate, lim.override("a", "k")) == (1000, None)


# ---- take and undo: a take no one followed is given back exactly ---------------------------------


@pytest.fixture(params=["native", "atomics"])
def table(request, name, monkeypatch):
    from shmlimit.shm.cells import native_available

    if request.param == "native" and not native_available():
        pytest.skip("the native extension is not built here")
    monkeypatch.setenv("SHMLIMIT_BACKEND", request.param)
    lim = shmlimit.KeyedLimiter(name, rate=10, burst=3, keys=64)
    assert lim.backend == request.param
    yield lim, lim._live().kt
    lim.unlink()
    lim.close()


TICK = 10**9 * 16  # a second in ticks (the tables' unit: ns << 4)


def test_undo_restores_a_take_exactly(table):
    lim, kt = table
    now = 10**12 * 16
    r = kt.take("k", 1, 0, now)  # a new key: taken by its insert
    assert r[0] == 0
    assert kt.acquire("k", 3, -1, now) > 0  # now short of 3
    assert kt.undo(*r[1:], 1)
    assert kt.acquire("k", 3, -1, now) == 0 and lim.stats().grants == 0  # as if never taken
    r1 = kt.take("k", 2, 0, now)
    r2 = kt.take("k", 1, 0, now)
    assert not kt.undo(*r1[1:], 2)  # someone took since: the first take stays spent
    assert kt.undo(*r2[1:], 1)  # the last one can go back
    assert (
        kt.acquire("k", 2, -1, now) == TICK // 10
    )  # two more need 0.1 s: only the first take is spent
    assert kt.take("k", 1, 0, now)[0] == 0 and kt.take("k", 1, 0, now) == KC.REFUSED
    with pytest.raises(ValueError):
        kt.undo(10**9, r2[2], r2[3], r2[4], 1)
    with pytest.raises(ValueError):
        kt.take("k", 1, -1, now)


def test_a_lost_race_undoes_the_earlier_rates(name, clock, cleanup):
    lim = make(name, [("10/s", 2), ("10/s", 2)], clock, cleanup)

    def race():
        assert take(lim, 1, "k", 2)  # another caller empties the second rate after the looks

    with before_the_takes(race):
        assert not lim.try_acquire("k")
    assert grants(lim) == {"0": 0, "1": 2}  # the first rate's take was undone
    assert take(lim, 0, "k", 2)  # its whole burst is there


def test_a_take_after_a_preemption_is_priced_at_its_own_instant(name, clock, cleanup):
    """A try's takes ran at the instant its peek read the clock: preempted between the two (the GIL
    given to another thread, the process descheduled), it was granted later but recorded as granted
    then, so the key's room came back that much early.  At 1/s, burst 1: granted 0.9 s after its
    reading, then again 0.1 s later -- two ops in 0.1 s where the rate allows 1.1.  Each take reads
    the clock itself now (on the real clock, inside the native call)."""
    lim = make(name, [("1/s", 1), ("1000/s", 1000)], clock, cleanup)

    def preempted():
        clock.advance(9 * S // 10)  # 0.9 s off the CPU between the looks and the takes

    with before_the_takes(preempted):
        assert lim.try_acquire("k")  # granted at t0 + 0.9 s
    clock.advance(S // 10)
    assert not lim.try_acquire("k")  # t0 + 1.0 s: the next op is due at t0 + 1.9 s
    assert lim.retry_after("k") == pytest.approx(0.9)
    assert grants(lim) == {"0": 1, "1": 1}


# ---- a stateful search: every key held to every rate after any sequence of calls -----------------


class KeyedRates(RuleBasedStateMachine):
    """Tries, timed and untimed acquires, and races, on two keys over two rates on an injected clock;
    every grant's instant and ops recorded per key and rate, every window checked."""

    RATES = {"requests": ("20/s", 2), "tokens": ("1000/s", 300)}

    @initialize()
    def setup(self):
        import uuid

        self.clock = FakeClock()
        self.name = f"test-keyed-model-{uuid.uuid4().hex[:10]}"
        self.lim = shmlimit.KeyedLimiter(self.name, rates=self.RATES, keys=64, clock=self.clock)
        self.lim._sleep = lambda seconds: self.clock.advance(max(1, round(seconds * S)))
        self.grants = {(key, rate): [] for key in "ab" for rate in self.RATES}

    def teardown(self):
        if hasattr(self, "lim"):
            self.lim.unlink()
            self.lim.close()

    def _record(self, key, costs):
        for rate, ops in costs.items():
            if ops:
                self.grants[(key, rate)].append((self.clock.now, ops))

    costs = st.fixed_dictionaries(
        {"requests": st.integers(0, 2), "tokens": st.integers(0, 400)}
    ).filter(lambda c: any(c.values()))

    @rule(key=st.sampled_from("ab"), costs=costs)
    def try_acquire(self, key, costs):
        if self.lim.try_acquire(key, **costs):
            self._record(key, costs)

    @rule(key=st.sampled_from("ab"), costs=costs, timeout=st.none() | st.floats(0, 0.5))
    def acquire(self, key, costs, timeout):
        fits = costs["requests"] <= 2 and costs["tokens"] <= 300
        if not fits:
            if timeout is None:
                with pytest.raises(ValueError):
                    self.lim.acquire(key, **costs)
            else:
                assert not self.lim.acquire(key, timeout=timeout, **costs)
            return
        if self.lim.acquire(key, timeout=timeout, **costs):
            self._record(key, costs)  # granted at the clock's instant when it returned

    @rule(key=st.sampled_from("ab"), costs=costs, which=st.sampled_from(["requests", "tokens"]))
    def race(self, key, costs, which):
        """Another caller takes one rate's room between a try's looks and its takes."""
        i = self.lim.keys.index(which)

        def race():
            n = 1 if which == "requests" else 100
            if take(self.lim, i, key, n):
                self.grants[(key, which)].append((self.clock.now, n))

        self._try_with(key, costs, race)

    def _try_with(self, key, costs, hook):
        """A try running ``hook`` between its looks and its takes: recorded when granted."""
        with before_the_takes(hook):
            if self.lim.try_acquire(key, **costs):
                self._record(key, costs)

    @rule(key=st.sampled_from("ab"), costs=costs, ms=st.integers(1, 400))
    def preempted(self, key, costs, ms):
        """A try preempted for ``ms`` between its looks and its takes: granted when it returns."""
        self._try_with(key, costs, lambda: self.clock.advance(ms * 1_000_000))

    @rule(ms=st.integers(1, 400))
    def advance(self, ms):
        self.clock.advance(ms * 1_000_000)

    @invariant()
    def every_key_within_every_rate(self):
        if not hasattr(self, "lim"):
            return
        for (key, rate), gs in self.grants.items():
            per_s, burst = {"requests": (20, 2), "tokens": (1000, 300)}[rate]
            # GCRA: ops in a window of T ns <= T / interval + burst, with the interval rounded up
            interval = -(-S * 16 // per_s)  # ticks per op, as the table computes it
            check_windows(gs, 16, interval, burst * interval)
        counted = {
            r: sum(n for (k, rr), gs in self.grants.items() if rr == r for _, n in gs)
            for r in self.RATES
        }
        assert {
            k: s.grants for k, s in self.lim.stats().items()
        } == counted  # undone takes are not counted


TestKeyedRates = KeyedRates.TestCase
TestKeyedRates.settings = settings(max_examples=40, stateful_step_count=30, deadline=None)


def test_a_forked_child_counts_as_itself_from_its_first_use(name, cleanup):
    import multiprocessing as mp

    lim = shmlimit.KeyedLimiter(name, rates=["100/s", "1000/s"], keys=64)
    cleanup.append(lim)
    assert lim.try_acquire("k")
    ctx = mp.get_context("fork")
    q = ctx.Queue()

    def child():
        q.put([len(s.processes) for s in lim.stats().values()])  # not listed before its first use
        q.put(lim.try_acquire("j"))
        q.put([sorted(p.grants for p in s.processes) for s in lim.stats().values()])

    p = ctx.Process(target=child)
    p.start()
    try:
        before, granted, after = q.get(timeout=60), q.get(timeout=60), q.get(timeout=60)
    finally:
        p.join(60)
        if p.is_alive():
            p.kill()
            p.join()
    assert before == [1, 1] and granted and after == [[1, 1], [1, 1]]


@pytest.mark.parametrize("backend", ["native", "atomics"])
def test_a_clock_that_starts_at_zero_is_a_clock_on_every_backend(
    name, cleanup, backend, monkeypatch
):
    """``clock`` may read 0 (``validate_clock``: 0 to 2**63 - 1), as a test's clock often starts.
    The native step took a ``now`` of 0 for "read your own clock" and refused it (ValueError: now
    must be a positive tick count) where the portable one served it."""
    from shmlimit.shm.cells import native_available

    if backend == "native" and not native_available():
        pytest.skip("the native extension is not built here")
    monkeypatch.setenv("SHMLIMIT_BACKEND", backend)
    clock = FakeClock(0)
    lim = make(name, [("10/s", 1), ("1/s", 2)], clock, cleanup)
    assert lim.try_acquire("k") and not lim.try_acquire("k")
    assert lim.retry_after("k") == pytest.approx(0.1)
    assert lim.acquire("k") and clock.now == S // 10  # it slept on its clock, from 0
    assert not lim.try_acquire("k") and lim.retry_after("k") == pytest.approx(0.9)  # 1/s, 2 taken


def test_a_clock_past_the_keyed_schedules_range_is_refused_not_served(name, cleanup):
    """A key's words hold its clock's reading in ticks (ns << 4) plus up to a wait, a burst and a
    BASE: past 2**58 ns their sum reaches V0's eviction flag, every key looked evicted and each
    try was granted (100 of 100 at 10/s, a clock at 2**59 ns).  Such a clock is refused, naming
    the parameter and its range: at the limiter's creation, and at a call, taking nothing."""
    with pytest.raises(ValueError, match=r"clock must return nanoseconds below 2\*\*58"):
        shmlimit.KeyedLimiter(name, rates=["10/s"], keys=64, clock=FakeClock(1 << 59))
    clock = FakeClock((1 << 58) - S)
    lim = make(name, [("10/s", 1)], clock, cleanup)
    assert sum(lim.try_acquire("k") for _ in range(100)) == 1
    clock.advance(S)
    with pytest.raises(ValueError, match=r"clock must return nanoseconds below 2\*\*58"):
        lim.try_acquire("k")
    assert grants(lim) == {"0": 1}
