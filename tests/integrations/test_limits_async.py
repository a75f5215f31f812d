"""``async+shm://``: the ``shm://`` table for ``limits.aio``, through its own async strategies and
then under a real ``uvicorn --workers 2`` on 127.0.0.1 (a Starlette app limiting each client with
``limits.aio``): both workers share one count per window and client."""

import asyncio
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("limits.aio")
from limits import parse, storage  # noqa: E402
from limits.aio import strategies  # noqa: E402
from limits.errors import StorageError  # noqa: E402
from support.clock import FakeClock  # noqa: E402
from support.servers import Server, get  # noqa: E402

import shmlimit  # noqa: E402
import shmlimit.integrations.limits as shm_limits  # noqa: E402

# run once in CI: limits.aio over async+shm://; the windows are tests/test_window_*.py's
pytestmark = pytest.mark.backend_independent


def test_the_async_scheme_is_registered_and_shares_the_sync_table(name):
    sync = storage.storage_from_string(f"shm://{name}?keys=512")
    store = storage.storage_from_string(f"async+shm://{name}?keys=512")
    try:
        assert isinstance(store, shm_limits.AsyncShmStorage) and store.table.slots == 512
        item = parse("3/minute")

        async def scenario():
            lim = strategies.FixedWindowRateLimiter(store)
            hits = [await lim.hit(item, "a") for _ in range(2)]
            return (
                hits,
                await lim.test(item, "a"),
                (await lim.get_window_stats(item, "a")).remaining,
            )

        assert asyncio.run(scenario()) == ([True, True], True, 1)
        assert sync.get(item.key_for("a")) == 2  # one table, whichever API counted
        assert sync.incr(item.key_for("a"), 60) == 3
        assert asyncio.run(strategies.FixedWindowRateLimiter(store).hit(item, "a")) is False
        assert asyncio.run(store.check()) and asyncio.run(store.reset()) == 1
        for bad, msg in [
            ("async+shm://", "name the table"),
            (f"async+shm://{name}?size=3", "unknown option"),
        ]:
            with pytest.raises(ValueError, match=msg):
                storage.storage_from_string(bad)
    finally:
        store.table.close()
        sync.table.close()


def test_async_sliding_window_counter_weights_the_previous_window(name):
    clock = FakeClock(3600 * 10**9 * 1000)  # on a window boundary of every length
    store = storage.storage_from_string(f"async+shm://{name}", clock=clock)
    lim = strategies.SlidingWindowCounterRateLimiter(store)
    item = parse("10/10 seconds")

    async def hits(n):
        return sum([await lim.hit(item, "k") for _ in range(n)])

    try:
        assert asyncio.run(hits(12)) == 10
        clock.advance_seconds(12.5)  # a quarter into the next window: the previous counts 3/4
        assert asyncio.run(store.get_sliding_window(item.key_for("k"), 10))[:3:2] == (10, 0)
        assert asyncio.run(hits(5)) == 3  # floor(7.5) + n <= 10
        asyncio.run(lim.clear(item, "k"))
        assert asyncio.run(hits(1)) == 1
    finally:
        store.table.close()


def test_async_errors_are_wrapped_on_request(name):
    store = storage.storage_from_string(
        f"async+shm://{name}?keys=32&when_full=refuse", wrap_exceptions=True
    )
    raw = storage.storage_from_string(f"async+shm://{name}?keys=32&when_full=refuse")
    try:

        async def fill(s, prefix):
            for i in range(
                64
            ):  # more keys than slots, each counted in a live window: the table fills
                await s.incr(f"{prefix}-{i}", 600)

        with pytest.raises(StorageError) as e:
            asyncio.run(fill(store, "w"))
        assert isinstance(e.value.storage_error, shmlimit.KeyTableFullError)
        with pytest.raises(shmlimit.KeyTableFullError):
            asyncio.run(fill(raw, "r"))
    finally:
        store.table.close()
        raw.table.close()


APP = """
import os
import time
import shmlimit.integrations.limits
from limits import parse, storage
from limits.aio import strategies
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route

STORE = storage.storage_from_string("async+shm://" + os.environ["LIM"])
LIMITER = {"fixed-window": strategies.FixedWindowRateLimiter,
           "sliding-window-counter": strategies.SlidingWindowCounterRateLimiter}[os.environ["STRATEGY"]](STORE)
PER_CLIENT = parse(os.environ["LIMIT"])

async def index(request):
    client = request.headers.get("x-client", "anonymous")
    if not await LIMITER.hit(PER_CLIENT, client):
        reset = (await LIMITER.get_window_stats(PER_CLIENT, client)).reset_time
        return PlainTextResponse(str(os.getpid()), status_code=429, headers={"x-reset": str(reset)})
    return PlainTextResponse(str(os.getpid()))

async def health(request):
    return PlainTextResponse("ok")

async def busy(request):
    time.sleep(0.2)  # holds this worker's event loop: connections arriving meanwhile go to the other
    return PlainTextResponse(str(os.getpid()))

app = Starlette(routes=[Route("/", index), Route("/health", health), Route("/busy", busy)])
"""


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["fixed-window", "sliding-window-counter"])
def test_limits_aio_under_uvicorn_two_workers(name, tmp_path, strategy):
    pytest.importorskip("starlette")
    pytest.importorskip("uvicorn")
    (tmp_path / "aio_app.py").write_text(textwrap.dedent(APP))
    argv = [
        sys.executable,
        "-m",
        "uvicorn",
        "aio_app:app",
        "--host",
        "127.0.0.1",
        "--port",
        "{port}",
        "--workers",
        "2",
        "--log-level",
        "warning",
    ]
    env = {"LIM": name, "STRATEGY": strategy, "LIMIT": "15 per 10 minutes"}
    alice, bob = {"X-Client": "alice"}, {"X-Client": "bob"}
    a = []
    with Server(argv, str(tmp_path), env=env) as srv:
        with ThreadPoolExecutor(9) as pool:
            # Which worker accepts a connection is the kernel's choice, and an idle one may take
            # them all: so in each round one request holds a worker's loop while alice's arrive.
            # Every answer, 429 included, names its worker.
            for _ in range(40):
                held = pool.submit(get, srv.url + "/busy")
                a += pool.map(lambda _: get(srv.url + "/", headers=alice), range(8))
                held.result()
                if (
                    len({body for _, _, body in a}) == 2 and len(a) >= 40
                ):  # past alice's 15, from both
                    break
            b = list(pool.map(lambda _: get(srv.url + "/", headers=bob), range(30)))
        assert all(
            get(srv.url + "/health")[0] == 200 for _ in range(5)
        )  # answers while both are saturated
        live = shmlimit.inspect(name)
        assert srv.proc.pid not in {
            p.pid for p in live.processes if p.alive
        }  # the master never counted
    # both workers answered alice: with a count per process, each would have granted her up to 15
    assert len({body for _, _, body in a}) == 2, "one worker answered every request"
    # one window for the whole run (10 minutes): exactly each client's limit, shared by the workers
    statuses = [s for s, _, _ in a]
    assert statuses.count(200) == 15 and statuses.count(429) == len(a) - 15
    assert [s for s, _, _ in b].count(200) == 15 and [s for s, _, _ in b].count(429) == 15
    assert live.kind == "windows" and live.keys == 2
    assert 1 <= sum(p.alive for p in live.processes) <= 2
