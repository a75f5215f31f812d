"""The hierarchical filler's global limiter (``RedisLimiter.from_spec``): its script calls keep one
connection of their own (``_eval_pinned``) instead of taking one from the pool at every call, and
behave as the pool's calls did: a dropped connection is reconnected once, a forgotten script is
loaded again, an unreachable server is ``RedisUnavailableError``, and a forked child never writes
to its parent's socket."""

import multiprocessing as mp
import time

import pytest
from support.procs import wait_for

# run once in CI: the Redis tier's connections: no atomic word involved
pytestmark = pytest.mark.backend_independent


@pytest.fixture
def R():
    from support.redis_server import require

    require()
    import shmlimit.redis.direct as R

    return R


def clients(probe) -> int:
    """Connections the server has open, the probe's among them."""
    return int(probe.info("clients")["connected_clients"])


def spec_of(R, name, url):
    glob = R.RedisLimiter(name, rate=1000, burst=10, url=url)
    try:
        return glob.upstream_spec(on_error="closed", lease_ttl=0.1, batch_seconds=0.02)
    finally:
        glob.close()


def test_the_fillers_limiter_keeps_one_connection_and_recovers_as_the_pool_did(R, own_redis, name):
    lim = R.RedisLimiter.from_spec(spec_of(R, name, own_redis.url))
    probe = own_redis.client()
    base = clients(probe)
    try:
        for _ in range(30):
            assert lim.call(R.MODE_RESERVE, 1)[0] == 1
        assert clients(probe) == base + 1  # one connection for every call
        conn = lim._conn
        assert conn is not None and conn not in lim._client.connection_pool.pool.queue  # (in use)

        # the server drops every connection but the probe's: the next call reconnects once
        probe.client_kill_filter(_type="normal", skipme=True)
        assert lim.call(R.MODE_RESERVE, 1)[0] == 1
        # the server forgets the script: loaded again (two more round trips) and asked again
        before = lim._counters()
        probe.script_flush()
        assert lim.call(R.MODE_RESERVE, 1)[0] == 1
        counts = lim._counters()
        assert counts["errors"] == 0 and counts["script_loads"] == before["script_loads"] + 1
        assert counts["round_trips"] == before["round_trips"] + 3
        assert clients(probe) == base + 1  # the script loaded on the same connection

        own_redis.stop()
        with pytest.raises(R.RedisUnavailableError, match="unavailable"):
            lim.call(R.MODE_RESERVE, 1)
        own_redis.start()
        assert (
            lim.call(R.MODE_RESERVE, 1)[0] == 1
        )  # reconnected, the script loaded on the new server
        base = clients(probe)  # (the probe reconnects too)
    finally:
        lim.close()
    wait_for(lambda: clients(probe) == base - 1)  # closed: its connection went with the client


def _call_in_child(lim, q) -> None:
    from shmlimit.redis.direct import MODE_RESERVE

    q.put((lim.call(MODE_RESERVE, 3)[0], lim._conn._sock.getsockname()))


def test_a_forked_child_never_uses_its_parents_pinned_connection(R, redis_server, name):
    lim = R.RedisLimiter.from_spec(spec_of(R, name, redis_server.url))
    try:
        assert lim.call(R.MODE_RESERVE, 1)[0] == 1
        parent = lim._conn
        ctx = mp.get_context("fork")
        q = ctx.Queue()
        p = ctx.Process(target=_call_in_child, args=(lim, q))
        p.start()
        granted, where = q.get(timeout=30)
        assert granted == 3  # the child's answer ...
        assert where != parent._sock.getsockname()  # ... on a connection of its own
        p.join(timeout=30)
        assert p.exitcode == 0
        # the parent's connection holds no stray answer of the child's: its next answers are its own
        for n in (2, 5, 1):
            assert lim.call(R.MODE_RESERVE, n)[0] == n
        assert lim._conn is parent
    finally:
        lim.close()


def test_a_limiter_built_with_url_keeps_using_the_pool(R, redis_server, name):
    """Only the filler's limiter (one thread) is pinned: any other may be shared by threads."""
    lim = R.RedisLimiter(name, rate=1000, url=redis_server.url)
    try:
        t0 = time.monotonic()
        assert lim.acquire(timeout=1.0)
        assert time.monotonic() - t0 < 1.0
        assert not lim._pinned and lim._conn is None
    finally:
        lim.close()
