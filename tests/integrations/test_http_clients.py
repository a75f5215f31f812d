"""HTTP clients: the httpx transports (sync, async) and the requests adapter throttle through one
limiter, and a 429 with Retry-After seen by one process pauses that host for every process."""

import asyncio
import email.utils
import multiprocessing as mp
import pickle
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from support.clock import FakeClock
from support.windows import max_excess

import shmlimit

httpx = pytest.importorskip("httpx")
requests = pytest.importorskip("requests")
from shmlimit.integrations._hosts import (  # noqa: E402
    HostThrottle,
    host_key,
    parse_retry_after,
    pause_table_name,
)
from shmlimit.integrations.httpx import AsyncThrottledTransport, ThrottledTransport  # noqa: E402
from shmlimit.integrations.requests import ThrottledAdapter  # noqa: E402

# run once in CI: the HTTP clients' integration; the limiter beneath is the core tests'
pytestmark = pytest.mark.backend_independent

RATE, CAPACITY, RETRY_AFTER = 20, 1, 1


@pytest.fixture
def name(name):
    """The test's limiter name; the pause table a plain limiter's throttle makes beside it goes too."""
    yield name
    try:
        shmlimit.unlink(pause_table_name(name))
    except FileNotFoundError:
        pass


class Recorder(BaseHTTPRequestHandler):
    log = []  # (path, pid header, server monotonic time on arrival)

    def do_GET(self):  # noqa: N802
        # stamped on arrival, before a byte of the answer is sent: a client may act on a 429's
        # headers (end_headers sends them) before its body is written
        Recorder.log.append((self.path, self.headers.get("X-Pid"), time.monotonic()))
        busy = self.path == "/busy"
        self.send_response(429 if busy else 200)
        if busy:
            self.send_header("Retry-After", str(RETRY_AFTER))
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, *args):
        pass


def _requests_busy(name, url, go):
    go.wait(30)
    s = requests.Session()
    s.mount("http://", ThrottledAdapter(shmlimit.attach(name)))
    assert s.get(url + "/busy", timeout=30).status_code == 429


def _httpx_sync(name, url, go, n):
    go.wait(30)
    with httpx.Client(transport=ThrottledTransport(shmlimit.attach(name))) as c:
        for _ in range(n):
            assert c.get(url + "/ok", headers={"X-Pid": "sync"}).status_code == 200


def _httpx_async(name, url, go, n):
    go.wait(30)

    async def main():
        async with httpx.AsyncClient(transport=AsyncThrottledTransport(shmlimit.attach(name))) as c:
            for _ in range(n):
                assert (await c.get(url + "/ok", headers={"X-Pid": "async"})).status_code == 200

    asyncio.run(main())


def test_retry_after_pauses_every_process(name):
    lim = shmlimit.Limiter(name, rate=RATE)
    assert lim.capacity == CAPACITY
    Recorder.log = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    url = f"http://127.0.0.1:{server.server_address[1]}"
    ctx = mp.get_context("fork")
    go_a, go_bc = ctx.Event(), ctx.Event()
    a = ctx.Process(target=_requests_busy, args=(name, url, go_a))
    b = ctx.Process(target=_httpx_sync, args=(name, url, go_bc, 5))
    c = ctx.Process(target=_httpx_async, args=(name, url, go_bc, 5))
    for p in (a, b, c):
        p.start()
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        go_a.set()
        a.join(30)
        assert a.exitcode == 0
        go_bc.set()  # B and C start only once A has been told to back off
        for p in (b, c):
            p.join(60)
            assert p.exitcode == 0
    finally:
        for p in (a, b, c):
            p.kill()
        server.shutdown()
        server.server_close()
        lim.close()
    (busy,) = [t for path, _, t in Recorder.log if path == "/busy"]
    oks = [(t, pid) for path, pid, t in Recorder.log if path == "/ok"]
    assert len(oks) == 10
    # nobody reached the host again before Retry-After had passed since the 429 was sent
    assert min(t for t, _ in oks) - busy >= RETRY_AFTER
    # and then the two processes shared the rate (arrivals are stamped after their grants)
    for width in (0.1, 0.5):
        assert max_excess(oks, width) <= RATE * width + CAPACITY


def _pickled_session_get(pickled, url):
    s = pickle.loads(pickled)
    return s.get(url + "/ok", headers={"X-Pid": "child"}, timeout=30).status_code


def test_a_session_with_a_throttled_adapter_pickles(name):
    lim = shmlimit.Limiter(name, rate=RATE)
    s = requests.Session()
    s.mount("http://", ThrottledAdapter(lim, max_wait=5.0, pool_maxsize=3, max_retries=2))
    pickled = pickle.dumps(s)
    copy = pickle.loads(pickled).get_adapter("http://h")
    assert type(copy) is ThrottledAdapter and copy.throttle.max_wait == 5.0
    assert copy._pool_maxsize == 3 and copy.max_retries.total == 2
    assert copy.max_retries.adapter is copy  # its resends are throttled by the copy itself
    Recorder.log = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:  # in another process: the copy attaches to the same limiter and takes its op there
        with mp.get_context("spawn").Pool(1) as pool:
            assert pool.apply(_pickled_session_get, (pickled, url)) == 200
    finally:
        server.shutdown()
        server.server_close()
    assert [p for p, pid, _ in Recorder.log] == ["/ok"] and lim.stats().grants == 1
    lim.close()


def test_parse_retry_after_and_host_keys():
    assert parse_retry_after("120") == 120.0
    assert (
        parse_retry_after(None) is None
        and parse_retry_after("soon") is None
        and parse_retry_after("-3") is None
    )
    date = email.utils.formatdate(1_000_030, usegmt=True)
    assert parse_retry_after(date, now=1_000_000) == pytest.approx(30)
    assert parse_retry_after(date, now=1_000_100) == 0.0  # already past
    # an email's date of unknown zone (``-0000``) is read as HTTP's GMT (RFC 9110, 5.6.7: be
    # robust); one with no zone at all is not a form HTTP has: absent
    assert parse_retry_after(date.replace("GMT", "-0000"), now=1_000_000) == pytest.approx(30)
    assert parse_retry_after(date.replace(" GMT", ""), now=1_000_000) is None
    assert parse_retry_after(date.replace("GMT", "+0100"), now=1_000_000 - 3600) == 30
    assert host_key("https://Example.COM/a?b") == "example.com"
    assert host_key("https://example.com:443/") == "example.com"
    assert host_key("http://example.com:8080/") == "example.com:8080"
    # a fully qualified name (a trailing dot) is the same host: it had a limit and pauses of its own
    assert host_key("https://Example.com./a") == "example.com"
    assert host_key("http://example.com.:8080/") == "example.com:8080"


# the pause left after the 503: within 10 ms of real time of max_pause
@pytest.mark.slow
def test_pause_moves_the_host_once_and_is_capped(name):
    """Under a plain Limiter a pause is the host's, in the pause table: the shared rate is untouched."""
    lim = shmlimit.Limiter(name, rate=100, burst=5)
    t = HostThrottle(lim, max_pause=2.0)
    host = "partner.example"
    assert t.after(host, 200, "5") is None and t.after(host, 429, None) is None  # nothing to do
    assert t.after(host, 503, "30") == 2.0  # capped at max_pause
    ra = t.pauses.retry_after(host)
    assert 1.99 <= ra <= 2.0  # the host's next op is max_pause away
    assert lim.retry_after() == 0.0  # and nobody else's
    t.after(host, 429, "1")  # a shorter pause, told by another process meanwhile: shortens nothing
    assert ra - 0.05 <= t.pauses.retry_after(host) <= ra
    with pytest.raises(shmlimit.RateLimited) as e:
        HostThrottle(lim, max_wait=0.1).before((), host)
    assert e.value.retry_after > 1.5 and e.value.name == f"{name}[{host}]"
    assert lim.stats().grants == 0  # refused before taking the shared rate's op
    HostThrottle(lim, max_wait=0.1).before((), "other.example")  # another host goes on
    assert lim.stats().grants == 1
    t.pauses.close()
    lim.close()


@pytest.mark.parametrize(
    "kwargs, err",
    [
        (dict(max_wait=-1), ValueError),
        (dict(max_pause=float("inf")), ValueError),
        (dict(key=5), TypeError),
        # pause_on: a bare status raised "'int' object is not iterable", a word int()'s own message
        (dict(pause_on=429), TypeError),
        (dict(pause_on=["soon"]), ValueError),
        (dict(pause_on=[4290]), ValueError),
        (dict(max_pause=86_401), ValueError),
        (dict(pauses=5), TypeError),
    ],
)
def test_bad_parameters(name, kwargs, err):
    """Each refused with an error naming the parameter."""
    lim = shmlimit.Limiter(name, rate=10)
    param = next(iter(kwargs))
    with pytest.raises(err, match=rf"^{param}\b"):
        ThrottledTransport(lim, **kwargs)
    with pytest.raises(err, match=rf"^{param}\b"):
        ThrottledAdapter(lim, **kwargs)
    with pytest.raises(TypeError):
        AsyncThrottledTransport(object())
    lim.close()


def test_a_limiter_of_several_rates_is_refused_saying_one_rate_is_needed(name):
    """A limiter of several rates was refused as "must be a shmlimit Limiter or KeyedLimiter, got
    <shmlimit.KeyedLimiter ...>": what it is, said to be what it is not."""
    for lim in (
        shmlimit.Limiter(name, rates=["10/s", "100/min"]),
        shmlimit.KeyedLimiter(f"{name}-k", rates=["10/s", "100/min"], keys=64),
    ):
        for make in (ThrottledTransport, ThrottledAdapter, AsyncThrottledTransport):
            with pytest.raises(TypeError, match=r"^limiter .* of one rate \(rate=, not rates="):
                make(lim)
        lim.close()
        lim.unlink()


def test_a_capped_limiter_is_refused_saying_it_needs_release(name):
    """A capped Limiter grants only as ops are released, and the throttle releases none: past
    ``capacity`` requests every one waited for ever (or, within max_wait, was refused "retry after
    0 s")."""
    lim = shmlimit.Limiter(name, rate=100, burst=2, capped=True)
    for make in (ThrottledTransport, ThrottledAdapter, AsyncThrottledTransport):
        with pytest.raises(ValueError, match=r"^limiter .* capped"):
            make(lim)
    lim.close()


# four requests 0.9 s apart
@pytest.mark.slow
def test_a_hierarchical_limiter_needs_a_wait_above_0(name, redis_server):
    """A Limiter with upstream= gets its ops in batches leased for waiters, which expire unused:
    with max_wait=0 a request 0.9 s after the last (at 2/s) raised RateLimited "retry after
    0 s", every time.  Now max_wait=0 is a ValueError there; with a wait every request is sent."""
    lim = shmlimit.Limiter(name, rate=2, per=1.0, burst=1, upstream=redis_server.url)

    class Answer:
        status_code, headers = 200, {}

    try:
        for make in (ThrottledTransport, ThrottledAdapter, AsyncThrottledTransport):
            with pytest.raises(ValueError, match=r"^max_wait must be above 0 .* upstream="):
                make(lim, max_wait=0)
        throttle = HostThrottle(lim, max_wait=0.2)
        for _ in range(4):
            throttle.around("http://a.example/", Answer)  # RateLimited if not granted
            time.sleep(0.9)
        throttle.pauses.close()
    finally:
        lim.close()
        shmlimit.unlink(name)


# three requests at 10/s within 1 real second
@pytest.mark.slow
def test_keyed_limiter_throttles_and_pauses_per_host(name):
    lim = shmlimit.KeyedLimiter(name, rate=10, burst=1, keys=64)

    def remote(request):
        if request.url.host == "busy.example":
            return httpx.Response(429, headers={"Retry-After": "30"})
        return httpx.Response(200)

    with httpx.Client(
        transport=ThrottledTransport(lim, transport=httpx.MockTransport(remote), max_wait=0.5)
    ) as c:
        assert c.get("https://busy.example/").status_code == 429
        assert (
            29.9 <= lim.retry_after("busy.example") <= 30
        )  # that host is paused for every process...
        with pytest.raises(shmlimit.RateLimited) as e:
            c.get("https://busy.example/again")  # ...so this one is not even sent
        assert e.value.retry_after >= 29
        t0 = time.monotonic()
        assert [c.get("http://calm.example:8080/").status_code for _ in range(3)] == [
            200
        ] * 3  # other hosts go on
        assert time.monotonic() - t0 < 1.0
    assert lim.retry_after("calm.example:8080") > 0  # keyed by host:port
    assert lim.stats().keys == 2
    lim.close()


def test_a_redis_keyed_limiter_throttles_per_host(name, redis_server, monkeypatch):
    """A ``RedisKeyedLimiter`` (KeyedLimiter's methods, keys in Redis) passed the throttle's
    checks, then was called without a key: every request raised TypeError ("key must be str or
    bytes, not int").  Each host now has its limit in Redis, and a 429's pause is kept in the
    pause table beside it (the kind has no schedule of its own to move).  (The Redis limit runs on
    a still client clock; the pause table on the real one, its wait bounded by the time since.)"""
    import shmlimit.redis.direct as direct
    from shmlimit.redis.keyed import RedisKeyedLimiter

    monkeypatch.setattr(direct.time, "time_ns", FakeClock(1_800_000_000_000_000_000))
    lim = RedisKeyedLimiter(name, rate=1, per=60, burst=1, url=redis_server.url, clock="client")

    def remote(request):
        if request.url.host == "busy.example":
            return httpx.Response(429, headers={"Retry-After": "30"})
        return httpx.Response(200)

    transport = ThrottledTransport(lim, transport=httpx.MockTransport(remote), max_wait=0)
    try:
        with httpx.Client(transport=transport) as c:
            assert c.get("https://calm.example/").status_code == 200
            with pytest.raises(shmlimit.RateLimited):  # that host's one op a minute is taken
                c.get("https://calm.example/")
            before = time.monotonic()
            assert c.get("https://busy.example/").status_code == 429
            paused = transport.throttle.pauses.own_wait("busy.example")
            assert 30 - (time.monotonic() - before) - 0.001 <= paused <= 30  # 30 s from the 429 on
            assert c.get("https://other.example/").status_code == 200
        assert lim.retry_after("calm.example") == 60  # its next op a minute away: the clock stood
    finally:
        transport.throttle.pauses.close()
        lim.unlink()
        lim.close()
