"""The Redis tier against a real redis-server: the direct RedisLimiter and the hierarchical mode."""

import asyncio
import json
import os
import pickle
import random
import signal
import time
import types

import pytest
from support.clock import FakeClock
from support.procs import (
    ATTACH,
    STAMPER,
    WORKER,
    Stampers,
    collect,
    collect_witnessed,
    configured,
    go,
    run_cli,
    start_workers,
    wait_for,
)
from support.starvation import Stalls, least, run_delay, total
from support.windows import max_excess, max_gap, tag

import shmlimit
from shmlimit.errors import RedisUnavailableError

# The direct limiters (RedisLimiter, RedisKeyedLimiter) hold no segment: their tests are marked
# backend_independent (run once in CI); the hierarchical mode's, which feed a segment, run on each.


@pytest.fixture
def R():
    from support.redis_server import require

    require()
    import shmlimit.redis.direct as R

    return R


@pytest.fixture
def fake_time(R, monkeypatch):
    """The wall clock of ``clock="client"``: the script's time is exactly what the test says."""
    clock = FakeClock(1_800_000_000_000_000_000)
    monkeypatch.setattr(R.time, "time_ns", clock)
    return clock


@pytest.mark.backend_independent
def test_deterministic_sequence_rate_10_burst_3(R, redis_server, name, fake_time):
    lim = R.RedisLimiter(name, rate=10, burst=3, url=redis_server.url, clock="client")
    # three at once (the burst), then one every 100 ms, reserved in order
    assert [lim.reserve() for _ in range(6)] == [0.0, 0.0, 0.0, 0.1, 0.2, 0.3]
    assert lim.try_acquire() is False
    assert lim.retry_after() == pytest.approx(0.4)
    state = redis_server.client().hgetall(lim.key)
    assert lim.reserve(max_wait=0.39) is None  # refused: nothing written
    assert lim.try_acquire() is False
    assert redis_server.client().hgetall(lim.key) == state
    assert lim.reserve(max_wait=0.4) == pytest.approx(0.4)
    fake_time.advance_seconds(0.5)  # the schedule is now 0.0 s ahead: one op per 100 ms again
    assert lim.reserve() == pytest.approx(0.0)
    assert lim.reserve() == pytest.approx(0.1)
    fake_time.advance_seconds(10)  # idle: the bucket refills to the burst, never beyond
    assert [lim.try_acquire() for _ in range(4)] == [True, True, True, False]
    s = lim.stats()
    assert (s.grants, s.refusals, s.available) == (12, 4, 0.0)
    # one per reserve or try, the retry_after, the stats read; and a first load of the script
    # (NOSCRIPT, SCRIPT LOAD, EVALSHA again) if this server had not seen it yet
    assert s.script_loads <= 1 and s.round_trips == 16 + 1 + 1 + 2 * s.script_loads
    assert lim.key == f"shmlimit:{{{name}}}:gcra"  # one hash-tagged key: Redis Cluster safe
    # the key outlives its schedule by one second (it is full again then, as if absent)
    assert 1000 < redis_server.client().pttl(lim.key) <= 1300
    lim.close()


@pytest.mark.backend_independent
def test_times_are_integers_and_the_epoch_moves_forward(R, redis_server, name, fake_time):
    lim = R.RedisLimiter(name, rate=1000, burst=1, url=redis_server.url, clock="client")
    assert lim.reserve() == 0.0
    fake_time.advance_seconds(20 * 86400)  # 20 days of continuous use, in one step
    assert lim.reserve() == 0.0
    assert lim.reserve() == pytest.approx(0.001)
    h = redis_server.client().hgetall(lim.key)
    e, t = int(h[b"e"]), int(h[b"t"])  # both stored as plain integers, no exponent
    assert t < 2**50 and e == fake_time.now // 10**9 - 1
    lim.close()


@pytest.mark.backend_independent
def test_a_schedule_months_ahead_is_valid_and_refused_only_beyond_the_scripts_bound(
    R, redis_server, name, fake_time
):
    """Queues of reservations at 1/7d and 1/day are valid schedules up to ``MAX_BACKLOG_NS`` (~92
    days) ahead, where times are still exact: every answer is read, none is called broken (beyond
    11.6 days one was, a ``RedisDataError`` after the script had written it).  Beyond that bound the
    script refuses, writing nothing."""
    day = 86400
    week = R.RedisLimiter(name, rate="1/7d", url=redis_server.url, clock="client")
    assert [week.reserve(), week.reserve()] == [0.0, 7 * day]
    lim = R.RedisLimiter(f"{name}-d", rate=1, per=day, url=redis_server.url, clock="client")
    fit = R.MAX_BACKLOG_NS // (day * 10**9)  # the last one due fit - 1 days ahead
    assert fit == 92
    assert [lim.reserve() for _ in range(fit)] == [float(i * day) for i in range(fit)]
    state = redis_server.client().hgetall(lim.key)
    assert lim.reserve() is None and lim.acquire(timeout=0) is False
    assert redis_server.client().hgetall(lim.key) == state  # refused: nothing written
    assert lim.retry_after() == fit * day and lim.stats().backlog_seconds == fit * day
    week.unlink()
    lim.unlink()
    week.close()
    lim.close()


@pytest.mark.backend_independent
def test_max_reserved_backpressure_and_timeouts(R, redis_server, name, fake_time):
    lim = R.RedisLimiter(
        name, rate=10, burst=1, url=redis_server.url, clock="client", max_reserved=0.25
    )
    assert [lim.reserve() for _ in range(4)] == [0.0, 0.1, 0.2, None]  # 0.3 s ahead > 0.25 s
    assert lim.acquire(timeout=0.0) is False  # a timed acquire that cannot fit takes nothing
    assert lim.stats().grants == 3


@pytest.mark.backend_independent
def test_acquire_waits_and_a_late_permit_is_void(R, redis_server, name, monkeypatch):
    # One injected clock for the limiter's sleeps, its lateness check and the script's time
    # (clock="client"): a busy machine's late wakes cannot void permits the test does not mean to
    clock = FakeClock(1_800_000_000_000_000_000)
    late = []  # seconds to oversleep, once each

    def sleep(s):
        clock.advance_seconds(s + (late.pop() if late else 0))

    fake = types.SimpleNamespace(monotonic=lambda: clock.now / 1e9, sleep=sleep, time_ns=clock)
    monkeypatch.setattr(R, "time", fake)
    lim = R.RedisLimiter(name, rate=20, burst=1, url=redis_server.url, grace=0.01, clock="client")
    t0 = fake.monotonic()
    for _ in range(5):
        assert lim.acquire()
    assert fake.monotonic() - t0 == pytest.approx(4 / 20)  # one op at once, then one every 50 ms
    assert lim.stats().expired == 0
    late.append(0.05)  # the scheduler wakes us 50 ms late, once
    assert lim.acquire()
    s = lim.stats()
    assert s.expired == 1  # the late permit was voided and a fresh one taken
    assert s.grants == 7
    assert not late
    lim.close()


@pytest.mark.backend_independent
def test_acquire_async_and_throttle(R, redis_server, name, monkeypatch):
    # One injected clock for the waits (the loop's and a thread's), the lateness check and the
    # script's time (clock="client"): the spacing measured is the limiter's, never the machine's
    clock = FakeClock(1_800_000_000_000_000_000)
    slept = {"loop": 0, "thread": 0}

    def sleep(s):  # a blocking sleep: acquire_async must never take one
        slept["thread"] += 1
        clock.advance_seconds(s)

    async def loop_sleep(s):  # the loop's: the time passes, and the loop is free meanwhile
        slept["loop"] += 1
        clock.advance_seconds(s)
        await asyncio.sleep(0)

    monkeypatch.setattr(
        R,
        "time",
        types.SimpleNamespace(monotonic=lambda: clock.now / 1e9, sleep=sleep, time_ns=clock),
    )
    monkeypatch.setattr(
        R,
        "asyncio",
        types.SimpleNamespace(**{**vars(asyncio), "sleep": loop_sleep}),
    )
    lim = R.RedisLimiter(name, rate=20, burst=1, url=redis_server.url, clock="client")

    async def main():
        t0 = clock.now
        for _ in range(5):
            assert await lim.acquire_async()
        async with lim:
            pass
        return t0, clock.now

    t0, end1 = asyncio.run(main())
    assert (end1 - t0) / 1e9 == pytest.approx(
        5 / 20, abs=1e-5
    )  # one op at once, then one every 50 ms
    # A second event loop gets its own connection, and its six grants come 50 ms apart after the
    # first loop's last
    _, end2 = asyncio.run(main())
    assert (end2 - end1) / 1e9 == pytest.approx(6 / 20, abs=1e-5)
    assert slept == {"loop": 5 + 6, "thread": 0}  # every wait awaited on the loop, none blocked it

    calls = []

    @shmlimit.throttle(lim, on_limit="skip")
    def f(x):
        calls.append(x)
        return x

    assert [f(i) for i in range(3)] == [
        None
    ] * 3  # the last op was granted just now: 50 ms to the next
    clock.advance_seconds(0.05)
    assert [f(i) for i in range(3, 6)] == [3, None, None]  # one op per 50 ms, never more
    assert calls == [3]
    with pytest.raises(shmlimit.RateLimited) as e:
        shmlimit.throttle(lim, on_limit="raise")(lambda: None)()
    assert e.value.retry_after == pytest.approx(0.05, abs=1e-5)
    assert slept["thread"] == 0  # skip and raise never wait
    lim.close()


@pytest.mark.backend_independent
def test_each_event_loop_keeps_its_own_client_until_close(R, redis_server, name, monkeypatch):
    """Loops taking turns (threads, each with its own) keep one client each: before, each new
    loop's call replaced every other loop's client (495 clients for 518 calls from three
    threads), leaving their connections open.  ``close`` closes every loop's connections: at once
    on this thread's running loop, on its own loop for another."""
    made = []
    connect = R.connect

    def counted(*a, **kw):
        client = connect(*a, **kw)
        if kw.get("is_async"):
            made.append(client)
        return client

    monkeypatch.setattr(R, "connect", counted)
    lim = R.RedisLimiter(name, rate=1e6, burst=1000, url=redis_server.url)
    loops = [asyncio.new_event_loop(), asyncio.new_event_loop()]
    try:
        for _ in range(3):
            for loop in loops:
                assert loop.run_until_complete(lim.acquire_async())
        assert len(made) == 2  # one client per loop, kept

        def connections(client):
            pool = client.connection_pool
            return [*pool._available_connections, *pool._in_use_connections]

        async def close_here():
            here = lim._aclient()
            lim.close()
            return [c.is_connected for c in connections(here)]

        assert loops[1].run_until_complete(close_here()) == [False]  # closed at once
        other = made[0]  # loops[0]'s: closed on loops[0], as its next callback
        assert [c.is_connected for c in connections(other)] == [True]
        loops[0].run_until_complete(asyncio.sleep(0))
        assert [c.is_connected for c in connections(other)] == [False]
    finally:
        for loop in loops:
            loop.close()


@pytest.mark.slow
def test_a_close_from_another_thread_ends_its_loops_calls_as_closed(R, redis_server, name):
    """``close()`` from one thread while calls run on another thread's loop: each call ends as a
    closed limiter's (``ValueError``), none as a bad answer from Redis (its connection dropped
    under it: ``RedisDataError``, which fails a hierarchical limiter closed)."""
    import threading

    lim = R.RedisLimiter(name, rate=1e6, burst=1000, url=redis_server.url)
    granted, errors = threading.Event(), []

    async def calls():
        async def one():
            while True:
                try:
                    await lim.acquire_async()
                    granted.set()
                except Exception as e:  # noqa: BLE001 - what ends it is the test's subject
                    errors.append(e)
                    return

        await asyncio.gather(*(one() for _ in range(8)))
        await asyncio.gather(*(t for t in asyncio.all_tasks() if t is not asyncio.current_task()))

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_until_complete, args=(calls(),))
    thread.start()
    try:
        assert granted.wait(10)
        lim.close()
        thread.join(10)
        assert not thread.is_alive()
        assert len(errors) == 8 and all(
            type(e) is ValueError and "closed" in str(e) for e in errors
        ), errors
    finally:
        loop.close()


def test_a_close_as_the_last_act_of_asyncio_run_closes_its_connections(R, redis_server, name):
    """``close()`` as the last act of ``asyncio.run``'s main (an ASGI lifespan's shutdown does the
    same): the loop's connections are closed before it ends, not left to a task the loop's end
    cancels (they were then reported unclosed when collected)."""
    lim = R.RedisLimiter(name, rate=1e6, burst=1000, url=redis_server.url)

    async def main():
        assert await lim.acquire_async()
        client = lim._aclient()
        lim.close()
        return client

    pool = asyncio.run(main()).connection_pool
    conns = [*pool._available_connections, *pool._in_use_connections]
    assert conns and not any(c.is_connected for c in conns)


@pytest.mark.backend_independent
def test_a_cancellation_of_acquire_async_during_its_round_trip_always_ends_the_call(
    R, redis_server, name, monkeypatch
):
    """A caller cancelled in the step its round trip ends is cancelled, whatever Python runs it.

    The loop's client here answers as redis-py's did before Python 3.12, whose
    ``asyncio.wait_for`` (around every write, for its socket timeout) drops a
    cancellation that lands as the write ends.  Awaited in the caller's task, that
    dropped it: the steps went on, reserved and slept out the whole wait (3 s of
    backlog: 3001 ms for a ``wait_for`` of 0.3 ms).  Now the cancellation ends the
    call at once; the reservation its trip made is spent, as a cancelled waiter's is."""

    class Swallowing:  # a client whose round trip drops a cancellation as redis-py's may
        def __init__(self, client):
            self.client = client

        def script_load(self, script):
            return self.client.script_load(script)

        async def evalsha(self, *args):
            answer = await self.client.evalsha(*args)
            written = asyncio.get_running_loop().create_future()
            written.set_result(answer)  # the write is done ...
            caller.cancel()  # ... in the step the caller is cancelled
            try:
                await asyncio.sleep(0)
            except asyncio.CancelledError:
                if written.done():  # (asyncio.wait_for, Python 3.9 to 3.11)
                    return written.result()
                raise
            return answer

    lim = R.RedisLimiter(name, rate=1, per=100, burst=1, url=redis_server.url)
    caller = None

    async def main():
        nonlocal caller
        assert await lim.acquire_async()  # the burst: the next slot is 100 s away
        client = lim._aclient()
        monkeypatch.setattr(lim, "_aclient", lambda: Swallowing(client))
        caller = asyncio.ensure_future(lim.acquire_async())
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(caller, 10)  # (before: a TimeoutError, the caller asleep)
        assert caller.cancelled()
        monkeypatch.undo()
        return await lim.call_async(R.MODE_PEEK, 1)  # the slot its trip reserved is spent

    _, wait, _, _ = asyncio.run(main())
    assert 100e9 < wait <= 200e9
    lim.close()


@pytest.mark.backend_independent
def test_a_cancelled_acquire_async_ends_its_steps_and_leaves_the_limiter_usable(
    R, redis_server, name, monkeypatch
):
    """A cancellation while acquire_async naps for its reservation propagates at once, closes
    the steps (the driver's end), and the loop's connection serves the next call."""
    steps = {"closed": 0}
    acquire_steps = R._GcraClient._acquire_steps

    def counted_steps(self, *a, **kw):
        try:
            return (yield from acquire_steps(self, *a, **kw))
        except GeneratorExit:
            steps["closed"] += 1
            raise

    async def main():
        napping = asyncio.Event()

        async def loop_sleep(s):  # a nap that never ends by itself
            napping.set()
            await asyncio.Event().wait()

        monkeypatch.setattr(
            R,
            "asyncio",
            types.SimpleNamespace(**{**vars(asyncio), "sleep": loop_sleep}),
        )
        assert await lim.acquire_async()  # the burst: granted without a nap
        task = asyncio.ensure_future(lim.acquire_async())
        await asyncio.wait_for(napping.wait(), 10)  # its slot reserved, napping until it is due
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # the reservation stays counted (as an unused one): the next slot is two intervals away
        return await lim.call_async(R.MODE_PEEK, 1)

    monkeypatch.setattr(R._GcraClient, "_acquire_steps", counted_steps)
    lim = R.RedisLimiter(name, rate=1, per=100, burst=1, url=redis_server.url)
    _, wait, _, _ = asyncio.run(main())
    assert steps["closed"] == 1
    assert 100e9 < wait <= 200e9
    s = lim.stats()  # (one more round trip; a NOSCRIPT recovery counts two more)
    assert s.grants == 2 and s.round_trips - 2 * s.script_loads == 4 and s.errors == 0
    lim.close()


@pytest.mark.backend_independent
def test_calls_beyond_the_pools_connections_wait_for_one(R, redis_server, name):
    """More calls at once than the pool's connections (``?max_connections=``, default 100) wait
    for a free one, up to ``timeout``, as for an answer: 200 coroutines on a healthy server are
    all granted (before: 100 raised RedisUnavailableError, MaxConnectionsError: Too many
    connections), and only a pool still full after ``timeout`` counts as unavailable."""
    # (a timeout of 10 s, not the default 0.25 s: the waits for a connection and for an answer,
    # behind 200 calls on one event loop, are then not this test's subject on a busy machine)
    lim = R.RedisLimiter(name, rate=1e6, burst=1000, url=redis_server.url, timeout=10)

    async def main():
        return await asyncio.gather(*(lim.acquire_async() for _ in range(200)))

    assert asyncio.run(main()) == [True] * 200
    assert lim.stats().grants == 200
    lim.close()
    # a thread's calls: the same pool, the same wait
    one = R.RedisLimiter(
        f"{name}-1", rate=1e6, url=redis_server.url + "?max_connections=1", timeout=0.2
    )
    pool = one._client.connection_pool
    held = pool.get_connection()  # every connection in use
    with pytest.raises(RedisUnavailableError, match="No connection available"):  # (after 0.2 s)
        one.try_acquire()  # (before: at once, "Too many connections")
    pool.release(held)
    assert one.try_acquire()
    one.close()


@pytest.mark.backend_independent
def test_script_flush_mid_run_is_survived(R, redis_server, name):
    lim = R.RedisLimiter(name, rate=1000, burst=10, url=redis_server.url)
    for _ in range(5):
        assert lim.acquire()
    redis_server.client().script_flush()
    for _ in range(5):
        assert lim.acquire()
    s = lim.stats()
    assert s.script_loads == 1 and s.grants == 10 and s.errors == 0


# how long a call to a stopped server takes to fail, in real time (< 2 s)
@pytest.mark.backend_independent
@pytest.mark.slow
def test_restart_mid_run_fails_fast_then_recovers(R, own_redis, name):
    lim = R.RedisLimiter(name, rate=1000, url=own_redis.url, timeout=0.25)
    assert lim.acquire()
    own_redis.stop()
    t0 = time.monotonic()
    with pytest.raises(R.RedisUnavailableError, match="unavailable") as e:
        lim.acquire()
    assert isinstance(e.value, ConnectionError)
    assert (
        time.monotonic() - t0 < 2.0
    )  # short timeouts: redis-py's defaults would retry for seconds
    own_redis.start()  # same port, empty: the script must be loaded again too
    assert lim.acquire()
    s = lim.stats()
    assert (
        s.errors == 1 and s.script_loads == 2
    )  # loaded on the fresh server, and again after the restart


def test_bad_input_is_refused(R, redis_server, name):
    url = redis_server.url
    with pytest.raises(ValueError, match="rate"):
        R.RedisLimiter(name, rate=-1, url=url)
    with pytest.raises(ValueError, match="clock"):
        R.RedisLimiter(name, rate=1, url=url, clock="ntp")
    with pytest.raises(ValueError, match="url"):
        R.RedisLimiter(name, rate=1, url="http://localhost")
    with pytest.raises(ValueError, match="timeout"):
        R.RedisLimiter(name, rate=1, url=url, timeout=0)
    with pytest.raises(ValueError, match="burst"):
        R.RedisLimiter(name, rate=1, per=1e9, burst=10**9, url=url)
    lim = R.RedisLimiter(name, rate=1, url=url)
    for bad in (0, -1, 1.5, True):
        with pytest.raises((TypeError, ValueError), match="n must"):
            lim.acquire(bad)
    with pytest.raises(ValueError, match="timeout"):
        lim.acquire(timeout=float("nan"))
    assert redis_server.client().exists(lim.key) == 0  # nothing was written
    assert pickle.loads(pickle.dumps(lim)).upstream_spec() == lim.upstream_spec()
    with pytest.raises(ValueError, match="on_redis_error"):
        shmlimit.Limiter(name, rate=10, upstream=url, on_redis_error="maybe")
    with pytest.raises(ValueError, match="capped"):
        shmlimit.Limiter(name, rate=10, upstream=url, capped=True)
    with pytest.raises(ValueError, match="lease_ttl"):
        shmlimit.Limiter(name, rate=10, upstream=url, lease_ttl=0)
    with pytest.raises(ValueError, match="at most"):
        shmlimit.Limiter(name, rate=10, upstream="redis://" + "h" * 300 + ":6379/0")
    assert name not in shmlimit.list_names()


@pytest.mark.parametrize("spec", ["10,2", "10,start"])
def test_a_rate_specs_ratio_or_verb_is_refused(R, redis_server, name, spec):
    """Redis has no catch-up and no verbs (nor has a limiter leasing from it): a spec's ratio was
    taken into the config, and a hierarchical limiter granted catch-up beyond the global rate."""
    url = redis_server.url
    from shmlimit.redis.keyed import RedisKeyedLimiter

    for kind in (R.RedisLimiter, RedisKeyedLimiter):
        with pytest.raises(ValueError, match=f"one rate.*; a {kind.__name__} takes a number"):
            kind(name, rate=spec, url=url)
    with pytest.raises(ValueError, match="one rate.*; a Limiter with upstream= takes a number"):
        shmlimit.Limiter(name, rate=spec, upstream=url)
    assert name not in shmlimit.list_names()


class AnsweringClient:
    """A redis-py client as the limiter sees it, whose script calls answer ``reply`` (a list, or a
    function of the request's ops) or raise it (an exception): a broken or hostile server."""

    def __init__(self, reply):
        self.reply, self.calls = reply, 0

    def evalsha(self, sha, numkeys, key, mode, n, *args):
        self.calls += 1
        if isinstance(self.reply, Exception):
            raise self.reply
        return self.reply(n) if callable(self.reply) else self.reply


@pytest.mark.backend_independent
@pytest.mark.parametrize(
    "reply",
    [
        [-5, 0, 0, 0],  # granted < 0
        [10**15, 0, 0, 0],  # granted more than asked
        lambda n: [n, -(10**12), 0, 0],  # a negative wait
        lambda n: [n, 0, 10**18, 0],  # a schedule decades ahead (t far beyond the bound)
        lambda n: [n, 10**12, 0, 0],  # a wait beyond the backlog and the request
        lambda n: [n, 0, 0, -1],  # a negative dry time
        [1, 0],  # not four numbers
        "PONG",
        {b"granted": 1, b"wait": 0, b"backlog": 0, b"dry": 0},  # a RESP3 map
        [float("inf"), 0, 0, 0],  # a RESP3 double that is no integer
        lambda n: [n, 0, 0, float("-inf")],
    ],
)
def test_an_answer_the_script_cannot_give_is_a_data_error(R, name, reply):
    lim = R.RedisLimiter(name, rate=10, client=AnsweringClient(reply))
    for call in (lim.try_acquire, lim.acquire, lambda: lim.acquire(timeout=1)):
        with pytest.raises(R.RedisDataError, match="not an answer of the script"):
            call()
    assert lim._counters()["errors"] == 3


@pytest.mark.backend_independent
def test_a_grant_due_beyond_the_wait_asked_is_a_data_error_not_a_sleep(R, name):
    """The script refuses a reservation due later than its ``max_wait``, writing nothing: a grant
    due later is not its answer.  Taken as one, ``acquire(timeout=0.5)`` slept out the whole wait
    a broken or hostile server named (here 3 s; any wait up to the script's bound, ~92 days)."""
    late = int(3e9)
    lim = R.RedisLimiter(name, rate=10, client=AnsweringClient(lambda n: [n, late, late, 0]))
    t0 = time.monotonic()
    for call in (
        lambda: lim.acquire(timeout=0.5),
        lambda: lim.reserve(max_wait=0.5),
        lim.try_acquire,
    ):
        with pytest.raises(R.RedisDataError, match="not an answer of the script"):
            call()
    assert time.monotonic() - t0 < 1.0  # (no sleep for the wait named)
    assert lim._counters()["errors"] == 3


@pytest.mark.backend_independent
def test_an_error_of_the_round_trip_itself_is_a_data_error_naming_it(R, name):
    """What redis-py raises when it cannot build a connection from the URL (a query parameter its
    connection does not take) is neither a connection error nor an answer."""
    boom = TypeError("AbstractConnection.__init__() got an unexpected keyword argument 'timeout'")
    lim = R.RedisLimiter(name, rate=10, client=AnsweringClient(boom))
    with pytest.raises(R.RedisDataError, match="TypeError.*'timeout'") as e:
        lim.try_acquire()
    assert e.value.__cause__ is boom
    assert lim._counters()["errors"] == 1


def test_a_filler_thread_that_fails_says_so(R, redis_server, name, monkeypatch, caplog):
    """A bug that ends the filler thread is logged, never swallowed."""
    import shmlimit.redis.feeder as U

    def tick(self):
        raise RuntimeError("a bug in the feeder")

    monkeypatch.setattr(U.Feeder, "tick", tick)
    lim = shmlimit.Limiter(name, rate=100, upstream=redis_server.url)
    try:
        assert not lim.try_acquire()  # its first use starts the filler thread
        lim._att.filler.join(timeout=10)
        assert not lim._att.filler.is_alive()
    finally:
        lim.close()
        shmlimit.unlink(name)
    logged = [r for r in caplog.records if r.name == "shmlimit.filler"]
    assert logged and "a bug in the feeder" in str(logged[0].exc_info[1])


@pytest.mark.backend_independent
def test_password_is_never_shown(R):
    assert R.redact("redis://user:secret@host:6379/0") == "redis://user:***@host:6379/0"
    assert R.redact("redis://:secret@host/1") == "redis://:***@host/1"
    assert R.redact("redis://host:6379/0") == "redis://host:6379/0"


# ---- several processes ------------------------------------------------------------------


def direct_worker(rate, burst, url):
    """The WORKER of support.procs, on a RedisLimiter instead of a shared-memory limiter."""
    make = f"lim = RedisLimiter(sys.argv[1], rate={rate}, burst={burst}, url={url!r}); lim.retry_after()"
    assert ATTACH in WORKER
    return WORKER.replace(ATTACH, "from shmlimit.redis.direct import RedisLimiter\n" + make)


def run_workers(name, count, seconds, script=WORKER):
    procs = start_workers(name, count, seconds, script)
    go(procs)
    return collect(procs)


# grants per real second of four processes
@pytest.mark.backend_independent
@pytest.mark.slow
def test_four_processes_on_the_direct_limiter_keep_the_rate(R, redis_server, name):
    rate, burst, seconds = 100, 5, 3.0
    grace = R.DEFAULT_GRACE
    # each worker also tells how many of its permits it voided, woken more than ``grace`` late
    script = (
        direct_worker(rate, burst, redis_server.url)
        + "print(json.dumps(lim.stats().expired), flush=True)\n"
    )
    procs = start_workers(name, 4, seconds, script)
    server0 = run_delay(redis_server.proc.pid)
    go(procs)
    results, delays = collect_witnessed(procs)
    server1 = run_delay(redis_server.proc.pid)
    expired = sum(json.loads(p.stdout.readline()) for p in procs)
    assert all(results)
    stamps = sorted(t for r in results for t in r)
    assert max_excess(tag(results), 1.0) <= rate + burst
    # The rate is used, not starved, but for what the machine withheld (support.starvation): each
    # voided permit is an op of the schedule nobody used, and is voided only when its worker was
    # kept off the CPU past the grace; the schedule runs idle only while none of the workers ran
    # or the server did not answer.  On a quiet machine all are ~0: the old floor.
    server = server1 - server0 if server0 is not None and server1 is not None else 0.0
    assert expired * grace <= total(delays)
    assert len(stamps) >= 0.95 * rate * seconds - expired - rate * (least(delays) + server)


# grants per real second of two hosts
@pytest.mark.slow
def test_two_hosts_share_one_global_rate(R, redis_server, name):
    """Two shared-memory limiters (two "hosts"), two workers each, one Redis key."""
    rate, burst, seconds, ttl = 400, 40, 3.0, 0.1
    hosts = [f"{name}-a", f"{name}-b"]
    glob = R.RedisLimiter(name, rate=rate, burst=burst, url=redis_server.url)
    for h in hosts:
        shmlimit.Limiter(
            h, upstream=glob, lease_ttl=ttl
        ).close()  # created, then left to the workers
    try:
        # each worker configures the upstream itself: whichever is elected leases with its own config
        procs = [
            p
            for h in hosts
            for p in start_workers(
                h,
                2,
                seconds,
                configured(WORKER, name, redis_server.url, rate, burst, lease_ttl=ttl),
            )
        ]
        server0 = run_delay(redis_server.proc.pid)
        go(procs)
        # mid-run, Redis forgets the script: the fillers load it again and carry on
        wait_for(lambda: sum(shmlimit.inspect(h).upstream.leased for h in hosts) >= rate)
        redis_server.client().script_flush()
        results, delays = collect_witnessed(procs)
        server1 = run_delay(redis_server.proc.pid)
        stats = [shmlimit.inspect(h) for h in hosts]
    finally:
        for h in hosts:
            shmlimit.unlink(h)
    stamps = sorted(t for r in results for t in r)
    # the documented bound: rate*(T + lease_ttl + d) + burst, d = one tick plus one round trip (50 ms here)
    assert max_excess(tag(results), 1.0) <= rate * (1.0 + ttl + 0.05) + burst
    # the rate, but for the time the machine kept a host's filler (in one of its two workers: off
    # the CPU at most the longer of their delays; each host leases half the rate) or the server
    # off the CPU (support.starvation); on a quiet machine both are ~0
    held_up = [max([d for d in delays[i : i + 2] if d is not None], default=0.0) for i in (0, 2)]
    server = server1 - server0 if server0 is not None and server1 is not None else 0.0
    assert len(stamps) >= 0.9 * rate * seconds - rate / 2 * sum(held_up) - rate * server
    per_host = [len(results[0]) + len(results[1]), len(results[2]) + len(results[3])]
    assert min(per_host) >= 0.25 * sum(per_host)  # both hosts are fed
    for s in stats:
        up = s.upstream
        assert up.state == "ok" and up.errors == 0 and up.round_trips >= 1
        assert (
            up.leased >= s.grants
        )  # every grant came from a lease (some leased ops expire unused)
        # every leased op is accounted for: granted, expired (void after its ttl, or still reserved
        # when its filler's process exited), or still in the bucket, which no filler empties once
        # the workers are gone.  (Bounded by grants + burst instead, this failed once the batches
        # reserved ahead by the fillers that exited, up to the lead and a batch each, exceeded it.)
        assert up.leased - up.expired == s.grants + s.available
    # the script Redis forgot is there again: a filler loaded it (NOSCRIPT) and went on
    assert redis_server.client().script_exists(R.LUA_SHA) == [True]
    total_leased = sum(s.upstream.leased for s in stats)
    assert total_leased <= rate * (seconds + 2) + burst  # Redis never handed out more than the rate


# the first lease from Redis within 1 real second
@pytest.mark.slow
def test_hierarchical_mode_validates_and_matches_its_upstream(R, redis_server, name):
    url = redis_server.url
    lim = shmlimit.Limiter(name, rate=50, upstream=url)
    try:
        assert lim.stats().upstream.url == url
        assert (
            shmlimit.Limiter(name, rate=50, upstream=url)._att is lim._att
        )  # same upstream: attaches
        with pytest.raises(shmlimit.ConfigMismatchError, match="upstream"):
            shmlimit.Limiter(name, rate=50)  # asked for a plain limiter, found a hierarchical one
        with pytest.raises(shmlimit.ConfigMismatchError, match="on_redis_error=local"):
            shmlimit.Limiter(name, rate=50, upstream=url, on_redis_error="local")
        assert lim.acquire(timeout=1.0)
        assert f"upstream={url} (ok)" in repr(lim)
        out = run_cli("top", "--once", name).stdout  # the live view shows how the host is fed
        assert f"upstream {url} shmlimit:{{{name}}}:gcra  state ok" in out
        assert json.loads(run_cli("inspect", "--json", name).stdout)["upstream"]["leased"] >= 1
    finally:
        lim.close()


# ---- Redis unreachable ------------------------------------------------------------------


def _grants_in(lim, seconds):
    n = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if lim.acquire(timeout=0.05):
            n += 1
    return n


# grants per real second in each fallback, and leases expiring in real time
@pytest.mark.slow
@pytest.mark.parametrize("mode", ["closed", "local", "open"])
def test_on_redis_error_modes(R, own_redis, name, mode):
    rate = 100
    lim = shmlimit.Limiter(
        name, rate=rate, burst=10, upstream=own_redis.url, on_redis_error=mode, lease_ttl=0.1
    )
    try:
        assert lim.acquire(timeout=2.0)  # fed from Redis
        wait_for(lambda: lim.stats().upstream.round_trips >= 1)
        own_redis.stop()
        # the filler asks Redis only when tokens are wanted: keep wanting them, as callers would
        wait_for(lambda: [lim.try_acquire(), lim.stats().upstream.state == mode][1])
        up = lim.stats().upstream
        assert up.errors >= 1 and up.fallbacks == 1
        if mode == "closed":
            # leased tokens expire within lease_ttl; then nothing is granted until Redis returns
            wait_for(lambda: not lim.try_acquire())
            assert _grants_in(lim, 0.5) <= 1
        elif mode == "local":
            n = _grants_in(lim, 2.0)
            assert 0.85 * rate * 2 <= n <= rate * 2 + 10 + 1  # the host keeps its own clock's rate
        else:
            t0 = time.monotonic()
            for _ in range(5000):  # 50 s of this rate, if it were still limited
                assert lim.acquire(timeout=0.0)
            assert time.monotonic() - t0 < 10
        own_redis.start()
        wait_for(lambda: lim.stats().upstream.state == "ok", timeout=10)
        assert lim.acquire(timeout=2.0)  # recovered: leasing again
        n = _grants_in(lim, 1.5)
        assert n <= rate * 1.5 + 10 + 1  # limited again, whatever the fallback let through
        assert lim.stats().upstream.fallbacks == 1
    finally:
        lim.close()


def _closed_port():
    """A port on 127.0.0.1 nothing listens on (bound, then given back)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_unreachable_cluster_is_unavailable_and_named_without_its_password(R, name):
    """A cluster client reaches its nodes when it is made: none answering is redis-py's own
    RedisClusterException, which must come out as the library's RedisUnavailableError (what the
    filler falls back on), naming the URL, never its password."""
    url = f"redis+cluster://app:hunter2@127.0.0.1:{_closed_port()}"
    with pytest.raises(RedisUnavailableError, match="unavailable") as err:
        R.RedisLimiter(name, rate=10, url=url)
    assert "redis+cluster://app@127.0.0.1" in str(err.value) and "hunter2" not in str(err.value)
    spec = R.unconnected(R.RedisLimiter, (name, 10), dict(url=url)).upstream_spec()
    with pytest.raises(RedisUnavailableError):
        R.RedisLimiter.from_spec(spec)  # the filler's first connection


# the filler's first lease, on a real thread
@pytest.mark.slow
def test_a_limiter_upstream_of_an_unreachable_cluster_takes_its_fallback(R, name):
    """As for one server down: the limiter is made, and its filler, finding no node, enters the
    fallback (before, the cluster's error escaped the constructor, or ended the filler's thread)."""
    url = f"redis+cluster://127.0.0.1:{_closed_port()}"
    lim = shmlimit.Limiter(name, rate=100, upstream=url, on_redis_error="local")
    try:
        wait_for(lambda: [lim.try_acquire(), lim.stats().upstream.state == "local"][1])
        assert lim.stats().upstream.errors >= 1 and lim.acquire(timeout=1.0)
    finally:
        lim.close()


# leased tokens void within lease_ttl + 1 real second
@pytest.mark.slow
def test_leased_tokens_expire_and_every_leased_op_is_accounted_for(R, redis_server, name):
    rate, ttl = 1000, 0.1
    glob = R.RedisLimiter(name, rate=rate, burst=100, url=redis_server.url)
    lim = shmlimit.Limiter(name, upstream=glob, lease_ttl=ttl)
    try:
        end = time.monotonic() + 0.5
        while time.monotonic() < end:  # busy: the filler leases ahead of demand
            lim.acquire()
        s = lim.stats()
        stopped = time.monotonic()
        # idle now: whatever was leased ahead is void after lease_ttl (plus a tick and some noise)
        wait_for(lambda: lim.stats().available == 0)
        assert time.monotonic() - stopped < ttl + 1.0

        def settled():  # one snapshot: empty, and every leased op was either granted or expired
            t = lim.stats()
            return t.available == 0 and t.upstream.leased == t.grants + t.upstream.expired and t

        t = wait_for(settled)
        assert s.available > 0 or t.upstream.expired > 0  # something was leased ahead of use
    finally:
        lim.close()


# a quiet host: about 50 ops/s
SLOW = WORKER.replace(
    "stamp_until(lim.acquire,", "stamp_until(lambda: lim.acquire() and time.sleep(0.02),"
)


# batch sizes that follow each host's demand per real second
@pytest.mark.slow
def test_busy_hosts_lease_bigger_batches(R, redis_server, name):
    rate, burst, seconds = 1000, 200, 2.0
    glob = R.RedisLimiter(name, rate=rate, burst=burst, url=redis_server.url)
    busy, quiet = f"{name}-busy", f"{name}-quiet"
    for h in (busy, quiet):
        shmlimit.Limiter(h, upstream=glob).close()
    try:
        assert SLOW != WORKER
        procs = start_workers(
            busy, 3, seconds, configured(WORKER, name, redis_server.url, rate, burst)
        ) + start_workers(quiet, 1, seconds, configured(SLOW, name, redis_server.url, rate, burst))
        go(procs)
        collect(procs)
        b, q = shmlimit.inspect(busy).upstream, shmlimit.inspect(quiet).upstream
    finally:
        shmlimit.unlink(busy)
        shmlimit.unlink(quiet)
    # batches follow demand: ~0.02 s of it, capped at half the burst; a quiet host leases one op at a time
    assert b.leased / b.leases >= 3 * (q.leased / q.leases)
    assert b.leased / b.leases <= burst / 2


# the real-time gap between grants across a filler's kill
@pytest.mark.slow
def test_hierarchical_filler_killed_repeatedly(R, redis_server, name):
    """The filler of a hierarchical limiter SIGKILLed 8 times: another leases within ~the lease timeout."""
    rate, ttl = 2000, 0.1
    glob = R.RedisLimiter(name, rate=rate, url=redis_server.url)
    lim = shmlimit.Limiter(name, upstream=glob, lease_ttl=ttl)
    cap = lim.capacity
    lim.close()
    rng = random.Random(7)
    w = Stampers(name, configured(STAMPER, name, redis_server.url, rate, lease_ttl=ttl))
    stalls = Stalls(servers=[redis_server.proc.pid])  # what the machine withheld, kill to kill
    ahead = []  # the global schedule reserved ahead at each kill (seconds): the killed filler's

    def reserved_ahead():
        """How far the global GCRA's schedule runs ahead of Redis's clock now (its TAT, in seconds)."""
        pipe = redis_server.client().pipeline(transaction=True)
        h, (sec, usec) = pipe.hgetall(glob.key).time().execute()
        return (int(h[b"e"]) * 10**9 + int(h[b"t"]) - (sec * 10**9 + usec * 1000)) / 1e9

    try:
        for _ in range(4):
            w.start()
        t_start = time.monotonic()
        stalls.sample(w.live())
        for _ in range(8):
            time.sleep(rng.uniform(0.1, 0.3))  # a random moment, not a synchronisation
            pid = wait_for(lambda: shmlimit.inspect(name).filler_pid)
            stalls.sample(w.live())
            ahead.append(reserved_ahead())
            os.kill(pid, signal.SIGKILL)
            w.procs[pid][0].wait()
            w.start()
        t_end = time.monotonic()
        stalls.sample(w.live())
    finally:
        w.stop_all()
    results = [r for r in w.results() if r]
    stamps = sorted(t for r in results for t in r if t_start < t < t_end)
    held_up = (
        stalls.spans()
    )  # per span between kills: all the survivors, or the server, off the CPU
    # the lease times out in 50 ms, and waiters that expect no batch look every 2 ms and take over;
    # the new filler's first batch is due after the schedule the killed one had reserved ahead (its
    # lead and a batch: ~0.1 s, lost with it), and 0.1 s covers the take-over's first round trip
    # and delivery.  (Bounded by 0.15 s alone, the gap was that schedule and up to 45 ms more,
    # measured kill by kill, at times a few ms under the bound.)  No longer, but for the time the
    # machine kept every survivor (or the server) off the CPU
    assert max_gap(stamps) < max(0.05, *ahead) + 0.1 + max(held_up), ahead
    for width in (1.0, 0.1):
        assert max_excess(tag(results), width) <= rate * (width + ttl + 0.05) + cap
    assert len(stamps) >= 0.7 * rate * (t_end - t_start) - rate * sum(held_up)


# ---- fidelity, reserve(), stale fillers -----------------------------------------------------------


# grants per real second at 20/s
@pytest.mark.slow
def test_low_rate_is_delivered_in_full_by_reservations(R, redis_server, name):
    """At 20/s with one op per lease, blind retries lost a fifth of the rate; reserving the next
    slot ahead delivers it (the bench measures 1 %; the margin here is for a loaded machine)."""
    rate, seconds = 20, 3.0
    glob = R.RedisLimiter(name, rate=rate, url=redis_server.url)
    lim = shmlimit.Limiter(f"{name}-h", upstream=glob)
    try:
        procs = start_workers(
            f"{name}-h", 3, seconds, configured(WORKER, name, redis_server.url, rate, glob.capacity)
        )
        server0 = run_delay(redis_server.proc.pid)
        go(procs)
        results, delays = collect_witnessed(procs)
        server1 = run_delay(redis_server.proc.pid)
        up = lim.stats().upstream
    finally:
        lim.close()
        shmlimit.unlink(f"{name}-h")
    stamps = sorted(t for r in results for t in r)
    steady = [t for t in stamps if t > stamps[0] + 0.5]
    span = steady[-1] - steady[0]
    # the rate, but for the time the machine kept the filler (in one of the workers: off the CPU
    # at most the longest of their delays) or the server off the CPU (support.starvation)
    held_up = max([d for d in delays if d is not None], default=0.0) + (
        server1 - server0 if server0 is not None and server1 is not None else 0.0
    )
    assert len(steady) - 1 >= 0.95 * rate * span - rate * held_up
    # above, the promise is the window bound (the rate from stamps is jittered by late wake-ups)
    assert max_excess(tag(results), 1.0) <= rate * (1.0 + 0.1 + 0.05) + glob.capacity
    # one round trip reserves ``lease_seconds`` of demand (0.25 s: up to five ops at 20/s), delivered
    # a batch (one op here) at a time as its slots fall due: at most half a round trip per op (the
    # first requests, knowing no demand yet, are smaller), and fewer than batches
    # (the last few reserved ahead, the lead, are not delivered by the end)
    assert up.round_trips <= up.leased / 2 + up.refused + 5
    assert up.round_trips <= up.leases + 5


# the first lease from Redis within 2 real seconds
@pytest.mark.slow
def test_reserve_is_refused_in_hierarchical_mode(R, redis_server, name):
    lim = shmlimit.Limiter(name, rate=100, upstream=redis_server.url)
    try:
        with pytest.raises(ValueError, match="reserve.*hierarchical"):
            lim.reserve()
        assert lim.acquire(timeout=2.0)
    finally:
        lim.close()


# the running filler burns the late batch within 1 real second
@pytest.mark.slow
def test_a_stale_filler_cannot_add_an_old_batch(R, redis_server, name):
    """A filler stopped in a delivery and resumed after the batch's ttl: the batch is not added; one
    it added late anyway (its record is old) is burned by the running filler within a tick."""
    import shmlimit.shm.layout as L
    from shmlimit.redis.feeder import Feeder, _Batch, _record

    ttl = 0.1
    lim = shmlimit.Limiter(name, rate=1000, burst=100, upstream=redis_server.url, lease_ttl=ttl)
    try:
        lim.retry_after()  # a first use (taking nothing): this process's filler runs
        att = lim._att
        stale = Feeder(att.bucket, att.lease, att.feed_spec)
        now = time.monotonic_ns()
        stale.pending.append(_Batch(due=now, stamp=now - int(2 * ttl * 1e9), ops=50, left=50))
        before = lim.stats().upstream.expired
        stale._deliver(time.monotonic_ns())
        assert not stale.pending and lim.stats().available == 0
        assert lim.stats().upstream.expired == before + 50
        # the same batch added late by a filler stopped between its check and its add
        slot = att.cells.fetch_add(L.UP_LEASES, 1) % L.UP_RECORDS
        att.cells.store(L.UP_RECORD + 8 * slot, _record(now - int(2 * ttl * 1e9), 50))
        att.bucket.add(50 * att.bucket.cost)
        wait_for(lambda: lim.stats().available == 0, timeout=1.0)  # the running filler burns it
    finally:
        lim.close()


# ---- keyed limits across hosts ---------------------------------------------------------------------


@pytest.mark.backend_independent
def test_keyed_redis_limiter_one_gcra_per_key(R, redis_server, name, fake_time):
    from shmlimit.redis.keyed import RedisKeyedLimiter

    lim = RedisKeyedLimiter(name, rate=10, burst=2, url=redis_server.url, clock="client")
    # each key has its own schedule: two at once, then one per 100 ms
    assert [lim.reserve("alice") for _ in range(3)] == pytest.approx([0.0, 0.0, 0.1])
    assert [lim.reserve(b"bob") for _ in range(2)] == [0.0, 0.0]
    assert not lim.try_acquire("bob") and lim.retry_after("bob") == pytest.approx(0.1)
    assert lim.try_acquire("carol", 2) and not lim.try_acquire("carol")
    client = redis_server.client()
    ka, kb = lim.redis_key("alice"), lim.redis_key(b"bob")
    assert (
        ka != kb and "alice" not in ka and lim.redis_key("bob") == kb
    )  # str and bytes name the same key
    assert (
        0 < client.pttl(ka) <= 1000 + 300
    )  # expires a second after the bucket would be full again
    fake_time.advance_seconds(0.3)
    assert lim.try_acquire("alice")
    with pytest.raises(TypeError, match="key"):
        lim.try_acquire(5)
    with pytest.raises(ValueError, match="4096"):
        lim.try_acquire("x" * 5000)
    copy = pickle.loads(pickle.dumps(lim))
    assert copy.redis_key("alice") == ka
    assert copy.try_acquire("erin", 2) and not lim.try_acquire("erin")  # the same state in Redis
    # the async driver runs the same steps: dave's burst of two, then his next slot is 100 ms away
    assert asyncio.run(lim.acquire_async("dave", 2)) and not asyncio.run(
        lim.acquire_async("dave", timeout=0.05)
    )
    assert lim.retry_after("dave") == pytest.approx(0.1)


@pytest.mark.backend_independent
def test_keyed_redis_limiter_refuses_n_above_the_capacity_as_keyed_limiter(R, redis_server, name):
    """An ``n`` above a key's capacity never succeeds, on both keyed kinds alike: tries and timed
    calls are refused, taking nothing; untimed calls raise the same ``ValueError``; retry_after is
    inf (the Redis kind granted 5 ops at one instant with burst 1, after 0.4 s)."""
    from shmlimit.redis.keyed import RedisKeyedLimiter

    local = shmlimit.KeyedLimiter(f"{name}-local", rate=10, burst=1, keys=64)
    shared = RedisKeyedLimiter(name, rate=10, burst=1, url=redis_server.url)

    def answers(lim):
        out = [lim.try_acquire("k", 5), lim.acquire("k", 5, timeout=10), lim.reserve("k", 5, 10)]
        out += [asyncio.run(lim.acquire_async("k", 5, timeout=10)), lim.retry_after("k", 5)]
        for untimed in (
            lambda: lim.acquire("k", 5),
            lambda: lim.reserve("k", 5),
            lambda: asyncio.run(lim.acquire_async("k", 5)),
        ):
            with pytest.raises(ValueError) as e:
                untimed()
            out.append(str(e.value))
        return out

    try:
        assert (
            answers(shared)
            == answers(local)
            == [False, False, None, False, float("inf")]
            + ["n must be at most this key's capacity (1 ops), got 5"] * 3
        )
        assert shared.retry_after("k") == 0.0  # nothing was taken
        assert shared.stats().refusals == 4 and shared.round_trips == 1
    finally:
        local.close()
        local.unlink()
        shared.close()


# grants per real second of each key
@pytest.mark.backend_independent
@pytest.mark.slow
def test_keyed_redis_limiter_holds_each_key_across_processes(R, redis_server, name):
    rate, burst, seconds = 40, 4, 2.0
    keys = ["a", "b"]
    make = (
        f"from shmlimit.redis.keyed import RedisKeyedLimiter\n"
        f"k = RedisKeyedLimiter(sys.argv[1], rate={rate}, burst={burst}, url={redis_server.url!r})\n"
        f"key = 'a' if os.getpid() % 2 else 'b'\n"
        f"class L:\n"
        f"    def acquire(self):\n"
        f"        return k.acquire(key)\n"
        f"lim = L()\n"
    )
    script = WORKER.replace(ATTACH, "import os\n" + make).replace(
        "print(json.dumps(stamps)", "print(json.dumps([key] + stamps)"
    )
    # each worker also tells how many of its permits it voided, woken more than the grace late
    script += "print(json.dumps(k._counts['expired']), flush=True)\n"
    procs = start_workers(name, 4, seconds, script)
    server0 = run_delay(redis_server.proc.pid)
    go(procs)
    results, delays = collect_witnessed(procs)
    server1 = run_delay(redis_server.proc.pid)
    expired = [json.loads(p.stdout.readline()) for p in procs]
    server = server1 - server0 if server0 is not None and server1 is not None else 0.0
    assert sum(expired) * R.DEFAULT_GRACE <= total(
        delays
    )  # voided only when the machine made a wake late
    for k in keys:
        mine = [i for i, r in enumerate(results) if r[0] == k]
        if mine:
            rs = [results[i][1:] for i in mine]
            assert max_excess(tag(rs), 1.0) <= rate + burst
            # as the direct limiter's four processes: less the permits voided, and the time none
            # of the key's workers ran or the server did not (support.starvation)
            lost = sum(expired[i] for i in mine) + rate * (least(delays[i] for i in mine) + server)
            assert sum(len(r) for r in rs) >= 0.8 * rate * seconds - lost


@pytest.mark.backend_independent
def test_a_closed_redis_limiter_says_so_and_unlinks_as_every_kind(R, redis_server, name):
    """close() then unlink() (README's order) deletes the shared state on a short-lived
    connection; repr of a closed handle says closed, without a round trip."""
    import redis

    from shmlimit.redis.keyed import RedisKeyedLimiter

    server = redis.Redis.from_url(redis_server.url)
    lim = R.RedisLimiter(name, rate=5, burst=1, url=redis_server.url)
    keyed = RedisKeyedLimiter(name, rate=5, burst=1, url=redis_server.url)
    assert lim.try_acquire() and keyed.try_acquire("a") and keyed.try_acquire("b")
    assert server.exists(lim.key) and len(list(server.scan_iter(match=f"*{name}/*"))) == 2
    for each in (lim, keyed):
        each.close()
        assert repr(each).endswith(" closed>"), repr(each)
        each.unlink()
        assert each.closed
        with pytest.raises(ValueError, match="closed"):
            each.try_acquire(*(("a",) if each is keyed else ()))
    assert not server.exists(lim.key) and list(server.scan_iter(match=f"*{name}/*")) == []
    server.close()


class TricklingServer:
    """A hostile server on 127.0.0.1: it answers ``HELLO`` and the client's set-up, then answers
    the script a byte every 50 ms, never to the end (an array of a million integers)."""

    def __init__(self):
        import socket
        import threading

        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.stop = threading.Event()
        self.conns = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        import threading

        while not self.stop.is_set():
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.conns.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn):
        try:
            while not self.stop.is_set():
                data = conn.recv(65536)
                if not data:
                    return
                if b"EVALSHA" in data.upper():
                    conn.sendall(b"*1000000\r\n")
                    while not self.stop.wait(0.05):  # (the hostile pace, not a synchronisation)
                        conn.sendall(b":")
                elif b"HELLO" in data.upper():
                    conn.sendall(b"%2\r\n+server\r\n+redis\r\n+proto\r\n:3\r\n")
                else:
                    conn.sendall(b"+OK\r\n" * data.count(b"*"))
        except OSError:
            return

    def close(self):
        self.stop.set()
        self.listener.close()
        for c in self.conns:
            c.close()


# how long a trickled answer holds a call, in real time (< 1 s, of which ~0.5 s is the tries')
@pytest.mark.backend_independent
@pytest.mark.slow
@pytest.mark.parametrize("pinned", [True, False], ids=["filler", "direct"])
def test_a_trickled_answer_ends_within_the_timeout_of_each_try(R, name, pinned):
    """redis-py's socket timeout bounds each read, not an answer: a server trickling its answer
    a byte at a time held a call for as long as it trickled.  A hierarchical filler in it (its
    calls on one connection of its own) expired no lease and kept ``close()`` waiting for ever;
    a direct ``acquire(timeout=)`` overran its timeout.  Each try's answer is now bounded as a
    whole: the call fails as unavailable after two tries."""
    import threading

    server = TricklingServer()
    lim = R.RedisLimiter(name, rate=10, url=f"redis://127.0.0.1:{server.port}/0", timeout=0.25)
    lim._pinned = pinned  # (the filler's limiter: ``RedisLimiter.from_spec``)
    outcome = []

    def call():
        t0 = time.monotonic()
        try:
            lim.call(0, 1)
        except Exception as e:  # noqa: BLE001 - what it raised is the assertion
            outcome.append((e, time.monotonic() - t0))

    t = threading.Thread(target=call)
    t.start()
    t.join(5.0)
    try:
        assert not t.is_alive()  # before: still reading, for as long as the server trickled
        ((e, took),) = outcome
        assert isinstance(e, RedisUnavailableError), e
        assert took < 4 * 0.25  # two tries, each its connect and its answer's 0.25 s
    finally:
        server.close()
        t.join(5.0)
        lim.close()


def _connections_named(server, client_name):
    return [c for c in server.client().client_list() if c.get("name") == client_name]


@pytest.mark.backend_independent
def test_calls_going_on_across_close_end_as_closed_and_reopen_no_connection(
    R, redis_server, name, fake_time
):
    """``close()`` while threads are in calls: each call ends as a closed limiter's
    (``ValueError``), and no connection of the limiter is left open.  Before, a call backing off
    (``max_reserved``) made its next round trip on the closed client, which redis-py reconnects
    silently, and was granted; a round trip whose socket ``close()`` shut under it failed as a
    bad answer (``RedisDataError``: "I/O operation on closed file") or was retried on a new
    connection; either way connections stayed open after ``close()``."""
    import threading

    url = f"{redis_server.url}?client_name={name}"
    # (a) a caller backing off from a full queue, across close(): on a still client clock the
    # queue stays beyond max_reserved however late the caller runs (on the real one it drained
    # in 0.3 s, and a caller late by that much was granted instead)
    ahead = R.RedisLimiter(name, rate=10, burst=1, url=redis_server.url, clock="client")
    assert [ahead.reserve() for _ in range(4)][-1] > 0.25  # a queue beyond max_reserved
    lim = R.RedisLimiter(name, rate=10, burst=1, url=url, max_reserved=0.05, clock="client")
    outcome = []

    def backing_off():
        try:
            outcome.append(lim.acquire(timeout=60))
        except Exception as e:  # noqa: BLE001 - what ends it is the subject
            outcome.append(e)

    t = threading.Thread(target=backing_off)
    t.start()
    wait_for(lambda: lim.stats().refusals >= 1, 30)  # refused once: napping, to ask again
    lim.close()
    t.join(30)
    assert not t.is_alive()
    ((e,),) = [outcome]
    assert type(e) is ValueError and "closed" in str(e), e
    assert _connections_named(redis_server, name) == []
    ahead.unlink()
    ahead.close()
    # (b) round trips in flight in several threads when close() comes
    for trial in range(10):
        lim = R.RedisLimiter(name, rate=1e6, burst=1000, url=url)
        errors, started = [], threading.Barrier(5)

        def hammering():
            started.wait()
            try:
                while True:
                    lim.try_acquire()
            except Exception as e:  # noqa: BLE001 - what ends it is the subject
                errors.append(e)

        threads = [threading.Thread(target=hammering) for _ in range(4)]
        for t in threads:
            t.start()
        started.wait()
        wait_for(lambda: lim.round_trips >= 20, 30)
        lim.close()
        for t in threads:
            t.join(30)
        assert not any(t.is_alive() for t in threads)
        assert all(type(e) is ValueError and "closed" in str(e) for e in errors), (trial, errors)
        assert _connections_named(redis_server, name) == [], trial


@pytest.mark.backend_independent
def test_an_async_call_napping_across_close_ends_as_closed_and_reopens_nothing(
    R, redis_server, name
):
    """An ``acquire_async`` backing off from a full queue when ``close()`` comes ends as a closed
    limiter's, without a round trip: before, it asked again on its loop's closed client, which
    reconnected, and the connection stayed open on the running loop."""
    url = f"{redis_server.url}?client_name={name}"
    ahead = R.RedisLimiter(name, rate=10, burst=1, url=redis_server.url)
    assert [ahead.reserve() for _ in range(4)][-1] > 0.25  # a queue beyond max_reserved
    lim = R.RedisLimiter(name, rate=10, burst=1, url=url, max_reserved=0.05)

    async def main():
        call = asyncio.ensure_future(lim.acquire_async(timeout=5))
        while lim.stats().refusals < 1:  # (a sync peek: the loop is this one)
            await asyncio.sleep(0.001)
        lim.close()
        with pytest.raises(ValueError, match="closed"):
            await asyncio.wait_for(call, 10)
        deadline = time.monotonic() + 2
        while _connections_named(redis_server, name) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)  # (the loop closes what close() handed it)
        return _connections_named(redis_server, name)

    assert asyncio.run(main()) == []
    ahead.unlink()
    ahead.close()


@pytest.mark.backend_independent
def test_read_deadlines_wake_their_watcher_only_for_an_earlier_deadline(R):
    """Each bound read woke the watcher thread (notified whenever no other read was bound, so on
    every call of one thread), which took the GIL and the lock to sleep again: about 20 us of CPU
    more per round trip (62 us against 43 us without the watcher).  It is woken now only for a
    deadline earlier than the one it sleeps until; reads that end in time cost it nothing."""
    import threading

    from shmlimit.redis.client import ReadDeadlines

    woke = []

    class Counted(threading.Condition):
        def wait(self, timeout=None):
            got = super().wait(timeout)
            woke.append(got)
            return got

    reads = ReadDeadlines()
    reads._cv = Counted()

    class Conn:
        _sock = None

    conn = Conn()
    with reads.bound(conn, 30.0):  # the watcher starts, and sleeps until this deadline
        pass
    wait_for(lambda: reads._cv._waiters, 5)  # (asleep in its wait)
    before = len(woke)
    for _ in range(100):  # one thread's reads, each ended long before its deadline
        with reads.bound(conn, 30.0):
            pass
        wait_for(lambda: reads._cv._waiters, 5)  # (the watcher asleep again, if it woke)
    with reads.bound(conn, 30.0):
        wait_for(lambda: reads._cv._waiters, 5)
    assert len(woke) - before <= 2, len(woke) - before  # (before: 100)
    # an earlier deadline still wakes it, and is kept: the socket of a read past it is shut
    shut = threading.Event()

    class Sock:
        def shutdown(self, how):
            shut.set()

    late = Conn()
    late._sock = Sock()
    with reads.bound(late, 0.05):
        assert shut.wait(5)
