"""ASGI and WSGI middleware: headers and modes in process, then real servers with several workers
(Starlette under ``uvicorn --workers 2``, a WSGI app under ``gunicorn -w 2``) sharing one limit."""

import asyncio
import re
import socket
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from support.aio import LoopTicker
from support.servers import BIN, Server, get

import shmlimit
from shmlimit.integrations.asgi import RateLimitMiddleware as ASGILimit
from shmlimit.integrations.wsgi import RateLimitMiddleware as WSGILimit

# run once in CI: ASGI and WSGI middleware under real servers; the limiter is the core tests'
pytestmark = pytest.mark.backend_independent

RATELIMIT = re.compile(r'^"default";r=(\d+);t=(\d+)$')


async def _hello(scope, receive, send):
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-type", b"text/plain")],
        }
    )
    await send({"type": "http.response.body", "body": b"hello"})


async def call(app, path="/", client="127.0.0.1"):
    """(status, {header: value}) of one request through an ASGI app, run in this event loop."""
    sent = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "GET", "path": path, "headers": [], "client": (client, 1234)}
    await app(scope, receive, send)
    start = sent[0]
    return start["status"], {k.decode(): v.decode() for k, v in start["headers"]}


def test_asgi_headers_remaining_and_refusal(name):
    lim = shmlimit.Limiter(name, rate=1, per=60, burst=5)
    app = ASGILimit(
        _hello, limiter=lim, key=lambda scope: None if scope["path"] == "/health" else ""
    )

    async def main():
        seen = []
        for _ in range(5):
            status, h = await call(app)
            assert status == 200 and h["ratelimit-policy"] == '"default";q=1;w=60'
            r, t = map(int, RATELIMIT.match(h["ratelimit"]).groups())
            seen.append(r)
            # seconds until the bucket is full again (+1: a replenish may come 20 ms late)
            assert 0 < t <= 60 * (5 - r) + 1
        assert seen == [4, 3, 2, 1, 0]
        status, h = await call(app)
        assert status == 429 and "content-type" in h
        retry = int(h["retry-after"])  # an integer, or int() raises
        assert 1 <= retry <= 61
        assert h["ratelimit"] == f'"default";r=0;t={retry}'
        assert (await call(app, "/health"))[0] == 200  # exempt: key returned None

    asyncio.run(main())
    assert lim.stats().grants == 5
    lim.close()


def test_asgi_keyed_by_client_address_by_default(name):
    lim = shmlimit.KeyedLimiter(name, rate=1, per=60, burst=2, keys=64)
    app = ASGILimit(_hello, limiter=lim)

    async def main():
        return [(await call(app, client=c))[0] for c in ["10.0.0.1"] * 3 + ["10.0.0.2"] * 3]

    assert asyncio.run(main()) == [200, 200, 429, 200, 200, 429]
    assert lim.stats().keys == 2
    lim.close()


# the event loop's ticks per real second while requests wait
@pytest.mark.slow
def test_asgi_wait_mode_queues_without_blocking_the_loop(name):
    lim = shmlimit.Limiter(name, rate=20, burst=1)
    app = ASGILimit(_hello, limiter=lim, max_wait=2.0)

    async def main():
        async with LoopTicker(0.005) as ticker:
            start = time.monotonic()
            statuses = [s for s, _ in await asyncio.gather(*(call(app) for _ in range(16)))]
            elapsed = time.monotonic() - start
        return statuses, elapsed, ticker

    statuses, elapsed, ticker = asyncio.run(main())
    assert statuses == [200] * 16  # queued, none refused: 16 ops at 20/s fit max_wait
    assert elapsed >= 15 / 20 - 0.05  # the rate held: 15 ops after the first need 0.75 s
    # a blocked loop would not tick at all while the requests wait; a free one ticks ~every 5 ms
    # of the time the machine let it run (support.starvation: on a quiet machine, all of it)
    ticker.assert_free(0.25)
    lim.close()


def test_asgi_wait_mode_refuses_at_once_past_max_wait(name):
    lim = shmlimit.Limiter(name, rate=1, per=60, burst=1)
    app = ASGILimit(_hello, limiter=lim, max_wait=5.0)

    async def main():
        assert (await call(app))[0] == 200
        start = time.monotonic()
        status, h = await call(app)  # the next op is ~60 s away: refused now, not after 5 s
        return status, h, time.monotonic() - start

    status, h, took = asyncio.run(main())
    assert status == 429 and int(h["retry-after"]) >= 50 and took < 5.0
    lim.close()


class _Client:
    """An ASGI ``receive`` for a client that sends ``body`` in the chunks given, then stays
    connected until ``leave()``: only a disconnect follows a whole body (the ASGI spec)."""

    def __init__(self, *chunks):
        self.messages = [
            {"type": "http.request", "body": c, "more_body": k < len(chunks) - 1}
            for k, c in enumerate(chunks or (b"",))
        ]
        self.gone = asyncio.Event()

    def leave(self):
        self.gone.set()

    async def receive(self):
        if self.messages:
            return self.messages.pop(0)
        await self.gone.wait()
        return {"type": "http.disconnect"}


async def _echo(scope, receive, send):
    """Answers with the request's body, read through ``receive`` to its end."""
    body, more = b"", True
    while more:
        message = await receive()
        body, more = body + message.get("body", b""), message.get("more_body", False)
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": body})


def test_asgi_a_client_gone_while_waiting_is_not_served(name):
    # a wait of ~60 s: the client leaves long before, and its wait ends then, its place given up
    lim = shmlimit.Limiter(name, rate=1, per=60, burst=1)
    served = []

    async def app(scope, receive, send):
        served.append(scope["path"])
        await _hello(scope, receive, send)

    limited = ASGILimit(app, limiter=lim, max_wait=90.0)
    scope = {"type": "http", "method": "GET", "path": "/b", "headers": [], "client": ("1", 1)}

    async def main():
        assert (await call(limited, "/a"))[0] == 200
        client, sent = _Client(), []

        async def send(message):
            sent.append(message)

        waiting = asyncio.ensure_future(limited(scope, client.receive, send))
        while lim.stats().deficiency < 1:  # its ticket is taken: it waits for its turn
            await asyncio.sleep(0.001)
        assert not waiting.done()
        client.leave()
        await asyncio.wait_for(waiting, 10)  # not the ~60 s its turn is away
        return sent

    assert asyncio.run(main()) == []  # no one to answer
    assert served == ["/a"] and lim.stats().grants == 1
    lim.close()


def test_asgi_the_body_read_while_waiting_reaches_the_app(name):
    lim = shmlimit.Limiter(name, rate=50, burst=1)
    limited = ASGILimit(_echo, limiter=lim, max_wait=5.0)

    async def main():
        bodies = []
        many = (b"",) * 300 + (b"end",)  # empty chunks past MAX_HELD_MESSAGES
        for chunks in [(b"first",), (b"ab", b"", b"cd"), (b"x" * 70_000, b"y", b"z"), many]:
            client, sent = _Client(*chunks), []

            async def send(message, sent=sent):
                sent.append(message)

            scope = {"type": "http", "method": "POST", "path": "/", "headers": [], "client": None}
            await limited(scope, client.receive, send)
            assert sent[0]["status"] == 200
            bodies.append(sent[1]["body"])
        return bodies

    # each after the first waits its turn (50/s, burst 1), reading its body meanwhile: past
    # MAX_HELD_BODY bytes or MAX_HELD_MESSAGES messages, the rest only once its turn comes
    assert asyncio.run(main()) == [b"first", b"abcd", b"x" * 70_000 + b"yz", b"end"]
    lim.close()


async def _until(condition, timeout=10.0):
    """Polls ``condition()`` on the loop until it holds; fails past ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "the condition never held"
        await asyncio.sleep(0.001)


@pytest.mark.parametrize("behind", [False, True], ids=["last", "one-behind"])
def test_asgi_a_keyed_client_gone_while_waiting_gives_its_ops_back(name, behind):
    # a keyed waiter's ops are taken when it asks; one that leaves gives them back when no one
    # took the key since (its key as if it never asked), else spends them (KeyedLimiter.acquire)
    lim = shmlimit.KeyedLimiter(name, rate=1, per=60, burst=1)
    served, sent = [], []

    async def app(scope, receive, send):
        served.append(scope["path"])
        await _hello(scope, receive, send)

    limited = ASGILimit(app, limiter=lim, max_wait=200.0, key=lambda scope: "k")
    scope = {"type": "http", "method": "GET", "path": "/", "headers": [], "client": ("1", 1)}

    async def send(message):
        sent.append(message)

    async def main():
        assert lim.try_acquire("k")
        client = _Client()
        waiting = asyncio.ensure_future(limited(scope, client.receive, send))
        await _until(lambda: lim.retry_after("k") > 60)  # its op taken: the next one 2 min away
        if behind:  # another caller's op queued behind it: the take can no longer be undone
            assert lim.reserve("k") > 60
        client.leave()
        await asyncio.wait_for(waiting, 10)

    asyncio.run(main())
    assert served == [] and sent == []
    wait = lim.retry_after("k")
    assert (120 < wait <= 180) if behind else (0 < wait <= 60)
    lim.close()


@pytest.mark.parametrize("again", [False, True], ids=["cancelled-once", "cancelled-at-each-step"])
def test_asgi_a_request_cancelled_while_waiting_leaves_no_wait_behind(name, again):
    # the server cancels a waiting request (uvicorn at the end of a graceful shutdown: once; an
    # anyio cancel scope: again at each step until the task ends): its ticket is given back at
    # once and nothing of it is left waiting, to take the turn later for no one
    lim = shmlimit.Limiter(name, rate=1, per=60, burst=1)
    assert lim.try_acquire()
    limited = ASGILimit(_hello, limiter=lim, max_wait=90.0)
    scope = {"type": "http", "method": "GET", "path": "/", "headers": [], "client": ("1", 1)}

    async def send(message):
        raise AssertionError(f"a cancelled request answered {message}")

    async def main():
        waiting = asyncio.ensure_future(limited(scope, _Client().receive, send))
        await _until(lambda: lim.stats().deficiency >= 1)  # its ticket is taken
        waiting.cancel()
        while again and not waiting.done():
            await asyncio.sleep(0)
            waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        left = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        return left, lim.stats().deficiency

    assert asyncio.run(main()) == ([], 0)
    assert lim.stats().grants == 1
    lim.close()


def test_asgi_a_request_granted_or_refused_at_once_reads_nothing(name):
    # a read asks a client that sent "Expect: 100-continue" for its body (uvicorn answers 100
    # Continue at the first): a request decided without waiting, a refusal above all, reads
    # nothing, as with max_wait=0
    lim = shmlimit.Limiter(name, rate=1, per=60, burst=1)
    limited = ASGILimit(_hello, limiter=lim, max_wait=1.0)
    scope = {"type": "http", "method": "POST", "path": "/", "headers": [], "client": ("1", 1)}

    async def main():
        statuses, reads = [], []
        for _ in range(2):  # the bucket's op at once, then a refusal at once (60 s > 1 s)
            client, sent = _Client(b"body"), []

            async def receive(client=client):
                reads.append(1)
                return await client.receive()

            async def send(message, sent=sent):
                sent.append(message)

            await limited(scope, receive, send)
            statuses.append(sent[0]["status"])
        return statuses, reads

    assert asyncio.run(main()) == ([200, 429], [])
    lim.close()


def test_asgi_a_read_in_flight_when_the_turn_comes_is_the_apps(name):
    # a receive may take its message off the stream before it waits (httpx's ASGITransport does,
    # reading a streamed body from an async generator): cancelled then, that message is lost.
    # The read in flight when the request's turn comes is handed to the app, never cancelled.
    lim = shmlimit.Limiter(name, rate=20, burst=1)
    assert lim.try_acquire()
    scope = {"type": "http", "method": "POST", "path": "/", "headers": [], "client": ("1", 1)}
    stream = [
        {"type": "http.request", "body": c, "more_body": c != b"c"} for c in (b"a", b"b", b"c")
    ]
    sent = []

    async def send(message):
        sent.append(message)

    async def main():
        late, read = asyncio.Event(), []

        async def receive():
            message = stream.pop(0)  # off the stream, then the client's bytes
            if message["body"] == b"b":
                await late.wait()  # "b" arrives late: the turn comes while it is read
            return message

        async def app(scope, app_receive, send):
            async def counted():
                read.append(await app_receive())
                return read[-1]

            await _echo(scope, counted, send)

        limited = ASGILimit(app, limiter=lim, max_wait=5.0)
        served = asyncio.ensure_future(limited(scope, receive, send))
        await _until(lambda: read)  # the turn came: the app has "a", and "b" is in flight
        late.set()
        await asyncio.wait_for(served, 10)

    asyncio.run(main())
    assert [m.get("body") for m in sent[1:]] == [b"abc"]
    lim.close()


@pytest.mark.parametrize(
    "kwargs, err",
    [
        (dict(cost=0), ValueError),
        (dict(max_wait=-1), ValueError),
        (dict(max_wait=float("inf")), ValueError),
        (dict(policy='a"b'), ValueError),
        (dict(key="not callable"), TypeError),
        (dict(limiter=object()), TypeError),
        # above the capacity (1 op at 10/s) and no wait allowed: every request was refused, for ever
        (dict(cost=2), ValueError),
    ],
)
def test_bad_parameters_are_refused(name, kwargs, err):
    """Each refused with an error naming the parameter."""
    lim = shmlimit.Limiter(name, rate=10)
    args = {"limiter": lim, **kwargs}
    param = next(iter(kwargs))
    with pytest.raises(err, match=rf"^{param}\b"):
        ASGILimit(_hello, **args)
    with pytest.raises(err, match=rf"^{param}\b"):
        WSGILimit(lambda e, s: [], **args)
    ASGILimit(_hello, limiter=lim, cost=2, max_wait=1.0)  # may wait for it: accepted
    lim.close()


def test_a_limiter_of_several_rates_is_refused_saying_one_rate_is_needed(name):
    for lim in (
        shmlimit.Limiter(name, rates=["10/s", "100/min"]),
        shmlimit.KeyedLimiter(f"{name}-k", rates=["10/s", "100/min"], keys=64),
    ):
        for make in (ASGILimit, WSGILimit):
            with pytest.raises(TypeError, match=r"^limiter .* of one rate \(rate=, not rates="):
                make(_hello, limiter=lim)
        lim.close()
        lim.unlink()


def test_a_capped_limiter_is_refused_saying_it_needs_release(name):
    """A capped Limiter grants only as ops are released, and the middleware releases none: after
    ``capacity`` requests every one was refused for ever, told ``r=2`` and ``Retry-After: 1``."""
    lim = shmlimit.Limiter(name, rate=100, burst=2, capped=True)
    for make in (ASGILimit, WSGILimit):
        with pytest.raises(ValueError, match=r"^limiter .* capped"):
            make(_hello, limiter=lim)
    lim.close()


def test_a_cost_that_can_never_pass_is_an_error_not_a_retry_after(name):
    """cost=6 on a Limiter of capacity 5 (even with max_wait=1 s: 0.1 op accrues in it), or a
    KeyedLimiter's key of capacity 3 asked 4, was answered 429 with a finite Retry-After,
    for ever: no wait could keep it.  A constant cost is refused when made, a cost from
    ``cost(request)`` when it is asked; a request above the capacity that ``max_wait`` lets
    queue for (a Limiter grants it once enough accrues) is accepted."""
    lim = shmlimit.Limiter(name, rate=1, per=10, burst=5)
    keyed = shmlimit.KeyedLimiter(f"{name}-k", rate=1, per=10, burst=3, keys=64)
    environ = {"PATH_INFO": "/", "REMOTE_ADDR": "10.0.0.1"}
    try:
        for make in (ASGILimit, WSGILimit):
            for cost, max_wait in [(6, 0.0), (6, 1.0), (7, 10.0)]:
                with pytest.raises(ValueError, match=r"^cost must be "):
                    make(_hello, limiter=lim, cost=cost, max_wait=max_wait)
            make(_hello, limiter=lim, cost=6, max_wait=10.0)  # 1 op accrues in 10 s: accepted
        apps = [
            ASGILimit(_hello, limiter=lim, cost=lambda scope: 6),
            ASGILimit(_hello, limiter=keyed, cost=4, max_wait=5.0),
            ASGILimit(_hello, limiter=keyed, cost=lambda scope: 4),
        ]
        for app in apps:
            with pytest.raises(ValueError, match="^cost must be from 1 to [35] ops"):
                asyncio.run(call(app))
        wsgi = WSGILimit(lambda e, s: [], limiter=lim, cost=lambda environ: 6)
        with pytest.raises(ValueError, match="^cost must be from 1 to 5 ops"):
            wsgi(environ, lambda *a: None)
        assert lim.stats().grants == 0 and keyed.stats().grants == 0
        # a cost that can pass is granted, then refused with a Retry-After it keeps
        app = ASGILimit(_hello, limiter=lim, cost=lambda scope: 5)
        assert asyncio.run(call(app))[0] == 200
        status, h = asyncio.run(call(app))
        assert status == 429 and 49 <= int(h["retry-after"]) <= 51  # (+1: 20 ms late)
        # a key whose own rate holds more passes where the default would never
        keyed.set_rate(1, per=10, burst=4, key="127.0.0.1")
        assert asyncio.run(call(apps[2]))[0] == 200
        # catch-up (ratio 2) grants up to ratio * (capacity + rate * max_wait): 7 of 2 * 6.5 may
        # pass (once behind schedule), 14 never
        catch_up = shmlimit.Limiter(f"{name}-c", rate="10,2", burst=5, max_behind=1)
        try:
            ASGILimit(_hello, limiter=catch_up, cost=7, max_wait=0.15)
            with pytest.raises(ValueError, match=r"^cost must be from 1 to 13 ops .*ratio"):
                ASGILimit(_hello, limiter=catch_up, cost=14, max_wait=0.15)
        finally:
            catch_up.close()
            catch_up.unlink()
    finally:
        lim.close()
        keyed.close()
        keyed.unlink()


def test_wsgi_in_process(name):
    lim = shmlimit.Limiter(name, rate=1, per=60, burst=2)

    def hello(environ, start_response):
        start_response("200 OK", [("Content-Type", "text/plain")])
        return [b"hello"]

    app = WSGILimit(
        hello, limiter=lim, cost=lambda environ: 2 if environ["PATH_INFO"] == "/big" else 1
    )
    got = []

    def start_response(status, headers, exc_info=None):
        got.append((status, dict(headers)))

    assert b"".join(app({"PATH_INFO": "/big", "REMOTE_ADDR": "x"}, start_response)) == b"hello"
    assert got[-1][0] == "200 OK" and got[-1][1]["RateLimit"].startswith('"default";r=0;')
    assert (
        b"".join(app({"PATH_INFO": "/", "REMOTE_ADDR": "x"}, start_response))
        == b"Too Many Requests\n"
    )
    assert got[-1][0].startswith("429") and 1 <= int(got[-1][1]["Retry-After"]) <= 61
    assert lim.stats().grants == 2
    lim.close()


def test_headers_false_and_other_scopes_pass_through(name):
    """``headers=False`` grants and refuses as ever but adds no ``RateLimit`` header to a granted
    response; an ASGI scope other than http (lifespan, websocket) reaches the app untouched, taking
    no op."""
    lim = shmlimit.Limiter(name, rate=1, per=60, burst=2)
    asgi = ASGILimit(_hello, limiter=lim, headers=False)
    seen = []

    async def app(scope, receive, send):
        seen.append(scope["type"])

    async def main():
        status, h = await call(asgi)
        assert status == 200 and h == {"content-type": "text/plain"}
        for kind in ("lifespan", "websocket"):
            await ASGILimit(app, limiter=lim)({"type": kind}, None, None)

    asyncio.run(main())
    assert seen == ["lifespan", "websocket"] and lim.stats().grants == 1

    def hello(environ, start_response):
        start_response("200 OK", [("Content-Type", "text/plain")])
        return [b"hello"]

    got = []
    wsgi = WSGILimit(hello, limiter=lim, headers=False)
    assert b"".join(wsgi({"REMOTE_ADDR": "x"}, lambda s, h, e=None: got.append(h))) == b"hello"
    assert got == [[("Content-Type", "text/plain")]] and lim.stats().grants == 2
    wsgi({"REMOTE_ADDR": "x"}, lambda s, h, e=None: got.append((s, h)))
    assert got[-1][0].startswith("429")  # refused as ever, with its headers
    lim.close()


# ---- real servers ------------------------------------------------------------------------

ASGI_APP = """
import os
import shmlimit
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route
from shmlimit.integrations.asgi import RateLimitMiddleware, client_host

# every client has a limit of its own: 5 requests, then 1 per minute
PER_CLIENT = shmlimit.KeyedLimiter(os.environ["LIM"], rate=1, per=60, burst=5, keys=1000)

def client(scope):
    if scope["path"] == "/health":
        return None  # never limited
    return dict(scope["headers"]).get(b"x-client", b"").decode() or client_host(scope)

async def hello(request):
    return PlainTextResponse(str(os.getpid()))

app = RateLimitMiddleware(Starlette(routes=[Route("/", hello), Route("/health", hello)]), limiter=PER_CLIENT, key=client)
"""


def test_starlette_under_uvicorn_two_workers_per_client(name, tmp_path):
    pytest.importorskip("starlette")
    pytest.importorskip("uvicorn")
    (tmp_path / "asgi_app.py").write_text(textwrap.dedent(ASGI_APP))
    argv = [
        sys.executable,
        "-m",
        "uvicorn",
        "asgi_app:app",
        "--host",
        "127.0.0.1",
        "--port",
        "{port}",
        "--workers",
        "2",
        "--log-level",
        "warning",
    ]
    alice, bob = {"X-Client": "alice"}, {"X-Client": "bob"}
    with Server(argv, str(tmp_path), env={"LIM": name}) as srv:
        # alice, one request at a time: 5 granted with her quota counting down, then refused
        seen = []
        for _ in range(5):
            status, h, _ = get(srv.url + "/", headers=alice)
            assert status == 200, (status, h)
            seen.append(int(RATELIMIT.match(h["ratelimit"]).group(1)))
            assert h["ratelimit-policy"] == '"default";q=1;w=60'
        assert seen == [4, 3, 2, 1, 0]
        # then alice hammers, concurrently, on fresh connections spread over both workers
        with ThreadPoolExecutor(8) as pool:
            burst = list(pool.map(lambda _: get(srv.url + "/", headers=alice), range(40)))
        assert all(s == 429 for s, _, _ in burst)
        for _, h, _ in burst:
            retry = int(h["retry-after"])
            assert 1 <= retry <= 60 and h["ratelimit"] == f'"default";r=0;t={retry}'
        # bob is limited separately: his 5 requests are granted while alice is saturated
        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(lambda _: get(srv.url + "/", headers=bob), range(20)))
        assert sorted(s for s, _, _ in results) == [200] * 5 + [429] * 15
        # health answers while both are saturated
        assert all(get(srv.url + "/health")[0] == 200 for _ in range(10))
        # exactly each client's burst, across every worker process of the server
        live = shmlimit.inspect(name)
        assert live.grants == 10 and live.keys == 2
        assert srv.proc.pid not in {p.pid for p in live.processes if p.alive}


WAITING_APP = """
import os
import shmlimit
from shmlimit.integrations.asgi import RateLimitMiddleware

LIM = shmlimit.Limiter(os.environ["LIM"], rate=1, per=2, burst=1)

async def hello(scope, receive, send):
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"hello"})

app = RateLimitMiddleware(hello, limiter=LIM, max_wait=30.0, key=lambda scope: None if scope["path"] == "/health" else "")
"""


def test_uvicorn_a_client_gone_while_waiting_gives_its_turn_up(name, tmp_path):
    """A real server hears the client hang up: the request waiting for its turn (1 op per 2 s)
    is never served, and the next one has that turn, 2 s on, not 4."""
    pytest.importorskip("uvicorn")
    (tmp_path / "waiting_app.py").write_text(textwrap.dedent(WAITING_APP))
    argv = [sys.executable, "-m", "uvicorn", "waiting_app:app", "--host", "127.0.0.1"]
    argv += ["--port", "{port}", "--log-level", "warning"]
    with Server(argv, str(tmp_path), env={"LIM": name}) as srv:
        lim = shmlimit.Limiter(name)
        assert get(srv.url + "/")[0] == 200  # the bucket's one op
        with socket.create_connection(("127.0.0.1", srv.port)) as gone:
            gone.sendall(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            deadline = time.monotonic() + 10
            while lim.stats().deficiency < 1 and time.monotonic() < deadline:
                time.sleep(0.005)  # until its ticket is taken: it waits for its turn
            assert lim.stats().deficiency >= 1
        status, _, _ = get(srv.url + "/")  # queued behind the one that left
        assert status == 200
        # served: the first and this one; the client that left never was, whatever the timing
        assert lim.stats().grants == 2
        lim.close()


WSGI_APP = """
import os
import shmlimit
from shmlimit.integrations.wsgi import RateLimitMiddleware

LIM = shmlimit.Limiter(os.environ["LIM"], rate=1, per=60, burst=3)

def hello(environ, start_response):
    start_response("200 OK", [("Content-Type", "text/plain")])
    return [str(os.getpid()).encode()]

app = RateLimitMiddleware(hello, limiter=LIM, key=lambda environ: None if environ["PATH_INFO"] == "/health" else "")
"""


def test_wsgi_under_gunicorn_two_workers(name, tmp_path):
    pytest.importorskip("gunicorn")
    (tmp_path / "wsgi_app.py").write_text(textwrap.dedent(WSGI_APP))
    argv = [
        f"{BIN}/gunicorn",
        "-w",
        "2",
        "-b",
        "127.0.0.1:{port}",
        "--log-level",
        "warning",
        "wsgi_app:app",
    ]
    with Server(argv, str(tmp_path), env={"LIM": name}) as srv:
        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(lambda _: get(srv.url + "/"), range(30)))
        assert sorted(s for s, _, _ in results) == [200] * 3 + [429] * 27
        assert all(1 <= int(h["retry-after"]) <= 61 for s, h, _ in results if s == 429)
        assert all(get(srv.url + "/health")[0] == 200 for _ in range(5))
        assert shmlimit.inspect(name).grants == 3
