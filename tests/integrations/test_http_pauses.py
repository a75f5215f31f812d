"""HTTP client pauses: a hostile ``Retry-After`` never loses the response, a pause is one move of a
schedule whatever the rate, and one host's 429 pauses that host only, under one shared rate too."""

import asyncio
import email.utils
import glob
import math
import os
import pwd
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

import shmlimit
from shmlimit.keyed import cells as KC
from shmlimit.keyed.gcra import TICKS_PER_S

httpx = pytest.importorskip("httpx")
requests = pytest.importorskip("requests")
from shmlimit.integrations._hosts import (  # noqa: E402
    MAX_RETRY_AFTER,
    HostThrottle,
    host_key,
    parse_retry_after,
    pause_table_name,
)
from shmlimit.integrations.httpx import AsyncThrottledTransport, ThrottledTransport  # noqa: E402
from shmlimit.integrations.requests import ThrottledAdapter  # noqa: E402

# run once in CI: the HTTP clients' pauses; the tables beneath are the keyed tests' subject
pytestmark = pytest.mark.backend_independent


@pytest.fixture
def name(name):
    """The test's limiter name; the pause table a plain limiter's throttle makes beside it goes too."""
    yield name
    try:
        shmlimit.unlink(pause_table_name(name))
    except FileNotFoundError:
        pass


class Remote(BaseHTTPRequestHandler):
    """Answers every request with the server's ``status`` and raw ``Retry-After`` bytes; counts hits."""

    def do_GET(self):  # noqa: N802
        srv = self.server
        srv.hits += 1
        head = f"HTTP/1.1 {srv.status} X\r\nContent-Length: 2\r\nConnection: close\r\n".encode()
        if srv.retry_after is not None:
            head += b"Retry-After: " + srv.retry_after + b"\r\n"
        self.wfile.write(head + b"\r\nok")
        self.close_connection = True

    def log_message(self, *args):
        pass


@pytest.fixture
def serve():
    """serve(status, retry_after bytes or None) -> a real HTTP server on 127.0.0.1 (its own port)."""
    servers = []

    def start(status, retry_after=None):
        srv = ThreadingHTTPServer(("127.0.0.1", 0), Remote)
        srv.status, srv.retry_after, srv.hits = status, retry_after, 0
        srv.url = f"http://127.0.0.1:{srv.server_address[1]}"
        srv.host = f"127.0.0.1:{srv.server_address[1]}"
        threading.Thread(target=srv.serve_forever, args=(0.05,), daemon=True).start()
        servers.append(srv)
        return srv

    yield start
    for srv in servers:
        srv.shutdown()
        srv.server_close()


def _get(client, limiter, url, **options):
    """One GET through ``client`` ("httpx", "httpx-async" or "requests") throttled by ``limiter``;
    the response's status."""
    if client == "httpx":
        with httpx.Client(transport=ThrottledTransport(limiter, **options)) as c:
            return c.get(url).status_code
    if client == "requests":
        with requests.Session() as s:
            s.mount("http://", ThrottledAdapter(limiter, **options))
            return s.get(url, timeout=10).status_code

    async def main():
        async with httpx.AsyncClient(transport=AsyncThrottledTransport(limiter, **options)) as c:
            return (await c.get(url)).status_code

    return asyncio.run(main())


CLIENTS = ["httpx", "httpx-async", "requests"]

# -- item: a hostile Retry-After ---------------------------------------------------------------


def test_retry_after_parses_digits_and_dates_and_nothing_else():
    day = MAX_RETRY_AFTER
    assert parse_retry_after("120") == 120.0 and parse_retry_after(" 7\t") == 7.0
    assert parse_retry_after(b"15") == 15.0
    assert parse_retry_after("0" * 400 + "5") == 5.0  # leading zeros: still 5
    # huge delta-seconds are capped, never converted whole (float(int(400 digits)) overflowed;
    # int() of 5000 digits raised ValueError)
    for huge in ("9" * 400, "9" * 5000, "1" + "0" * 399, "86401", "99999999999999999999"):
        assert parse_retry_after(huge) == day
    assert parse_retry_after("86400") == day and parse_retry_after("86399") == day - 1
    # unparseable: absent
    for bad in (
        "-3",
        "+3",
        "1.5",
        "1e3",
        "",
        "soon",
        "\u0661\u0662\u0663",  # Arabic-Indic digits: int() took them as 123
        "\u00b2",  # a superscript two: str.isdigit(), int() raised ValueError
        "12\u00a0",
        b"\xff\xfe12",
        "x" * 100_000,
        "Mon, 99 Foo 99999999 99:99:99 GMT",
        "Fri, 31 Dec 99999 23:59:59 GMT",
        None,
        12,
    ):
        assert parse_retry_after(bad) is None, bad
    date = email.utils.formatdate(1_000_030, usegmt=True)
    assert parse_retry_after(date, now=1_000_000) == pytest.approx(30)
    assert parse_retry_after(date, now=1_000_100) == 0.0  # already past
    far = email.utils.formatdate(4_000_000_000, usegmt=True)  # year 2096
    assert parse_retry_after(far, now=1_000_000) == day
    # the obsolete forms, which a recipient must accept (RFC 9110 5.6.7), GMT all: asctime's
    # has no zone, and was absent
    t = 784_111_777  # Sun, 06 Nov 1994 08:49:37 GMT
    for form in ("Sunday, 06-Nov-94 08:49:37 GMT", "Sun Nov  6 08:49:37 1994"):
        assert parse_retry_after(form, now=t - 90) == pytest.approx(90), form
    assert parse_retry_after("Sun Nov 06 09:49:37 1994", now=t) == pytest.approx(3600)
    for bad in ("Sun Nov 6 08:49:37 1994", "Sun Nov 31 08:49:37 1994", "Sun Nov  6 08:49:37 94"):
        assert parse_retry_after(bad, now=t) is None, bad


HOSTILE = {
    "400 digits": (b"9" * 400, "capped"),
    "5000 digits": (b"9" * 5000, "capped"),
    "non-ASCII digits": ("\u0661\u0662\u0663".encode(), None),
    "latin-1 bytes": (b"\xff\xfe12", None),
    "negative": (b"-5", None),
    "a bad date": (b"Mon, 99 Foo 99999999 99:99:99 GMT", None),
}


@pytest.mark.parametrize("client", CLIENTS)
@pytest.mark.parametrize("hostile", list(HOSTILE))
def test_a_hostile_retry_after_keeps_the_response(name, serve, client, hostile):
    """The 429 reaches the caller (it raised OverflowError or ValueError and was lost); a huge value
    pauses the host for max_pause, an unparseable one not at all."""
    value, pause = HOSTILE[hostile]
    srv = serve(429, value)
    lim = shmlimit.KeyedLimiter(name, rate=100, burst=5, keys=64)
    assert _get(client, lim, srv.url + "/x", max_pause=2.0) == 429
    paused = lim.retry_after(srv.host)
    if pause == "capped":
        assert 1.9 <= paused <= 2.0
    else:
        assert paused == 0.0
    lim.close()


# -- item: a pause costs time in proportion to rate --------------------------------------------


class Counted:
    """Counts the calls to a limiter's methods (instance attributes over the class's); fails fast."""

    def __init__(self, lim, limit=1000):
        self.calls, self.limit = 0, limit
        for attr in ("acquire", "try_acquire", "reserve", "retry_after", "pause"):
            if hasattr(lim, attr):
                setattr(lim, attr, self.wrap(getattr(lim, attr)))

    def wrap(self, method):
        def counted(*args, **kwargs):
            self.calls += 1
            assert self.calls <= self.limit, "a pause made more calls than a constant"
            return method(*args, **kwargs)

        return counted


class CountedCells:
    """A cells object counting its atomic operations."""

    def __init__(self, cells):
        self.cells, self.ops = cells, 0
        self.size = cells.size

    def __getattr__(self, attr):
        op = getattr(self.cells, attr)

        def counted(*args):
            self.ops += 1
            return op(*args)

        return counted


# the pause left after the 429: within 0.1 real second of 300 s
@pytest.mark.slow
@pytest.mark.parametrize("rate", [5000, 20000])
def test_a_pause_is_one_call_whatever_the_rate(name, rate):
    """One 429 with Retry-After 300 at 5 000/s with a burst of one reserved 1.5 million times (3.6 s
    of an event loop); at 20 000/s, 6 million: now one or two calls of the limiter."""
    lim = shmlimit.KeyedLimiter(name, rate=rate, burst=1, keys=64)
    throttle = HostThrottle(lim)
    counted = Counted(lim)
    assert throttle.after("busy.example", 429, "300") == 300.0
    assert counted.calls <= 2
    assert 299.9 <= lim.retry_after("busy.example") <= 300.0
    lim.close()


def _push_ops(name, rate, pause_s):
    """Atomic operations of one push on an empty table (no probe can collide): a new key, then the
    same key pushed again, ``pause_s`` seconds, on an injected clock."""
    lim = shmlimit.KeyedLimiter(name, rate=rate, burst=1, keys=64)
    try:
        ref = lim._live().reference()
        ref.c = CountedCells(ref.c)
        s = int(TICKS_PER_S)
        now = 10**6 * s  # any instant: the clock is injected
        assert ref.push("other.example", now + pause_s * s, now) == 0
        new_key, ref.c.ops = ref.c.ops, 0
        assert ref.push("other.example", now + 10 * pause_s * s, now) == 0
        return new_key, ref.c.ops
    finally:
        lim.close()
        shmlimit.unlink(name)


def test_a_pause_is_one_move_whatever_the_rate(name):
    """The move itself: a handful of atomic operations, the same at any rate and any pause (the
    count once grew with pause * rate / burst).  Counted on an empty table, so that no other key's
    probe sequence adds reads (a random hash secret would make that count vary)."""
    counts = {(r, p): _push_ops(name, r, p) for r in (5000, 20000, 10**6) for p in (1, 300, 3000)}
    assert len(set(counts.values())) == 1, counts  # neither the rate nor the pause changes it
    new_key, again = counts[5000, 300]
    assert new_key <= 40 and again <= 40, (new_key, again)


def test_a_pause_holds_then_resumes_at_the_rate(name):
    """On an injected clock: no grant before the pause's end, one at its end, then the key's rate
    (5 000/s with a burst of one), without a burst; a shorter pause shortens nothing, a longer one
    extends to its own end (pauses never add up)."""
    rate = 5000
    lim = shmlimit.KeyedLimiter(name, rate=rate, burst=1, keys=64)
    att = lim._live()
    kt, ref = att.kt, att.reference()  # the backend's composite, and the push over the same words
    t = math.ceil(TICKS_PER_S / rate)  # one op of schedule, in ticks
    s = int(TICKS_PER_S)
    now = 10**6 * s  # any instant: the clock is injected
    assert kt.acquire("h", 1, 0, now) == 0
    end = now + 300 * s
    assert ref.push("h", end, now) == 0
    assert kt.acquire("h", 1, -1, now) == end - now  # a peek: the wait is the pause, exactly
    for x in (now + 1, now + t, now + 150 * s, end - t, end - 1):
        assert kt.acquire("h", 1, 0, x) == KC.REFUSED
    assert ref.push("h", now + 10 * s, now) == 0  # shorter: changes nothing
    assert kt.acquire("h", 1, -1, now) == end - now
    assert kt.acquire("h", 1, 0, end) == 0  # granted at the end
    grants, x = 1, end + 1
    while x < end + s:  # the next second, tried every quarter op: the rate, no more
        grants += kt.acquire("h", 1, 0, x) == 0
        x += t // 4
    assert rate - 1 <= grants <= rate + 1
    later = end + 2 * s
    assert ref.push("h", later + 5 * s, later) == 0  # a new pause from `later`: 5 s, not added
    assert kt.acquire("h", 1, -1, later) == 5 * s
    assert lim.stats().grants == grants + 1  # a pause grants nothing
    lim.close()


def test_pause_refuses_bad_seconds(name):
    lim = shmlimit.KeyedLimiter(name, rate=10, keys=64)
    for bad in (-1, float("nan"), float("inf"), True, "5", 10**9):
        with pytest.raises(ValueError, match=r"^seconds\b"):
            lim.pause("k", bad)
    assert lim.stats().keys == 0
    lim.close()


# -- item: one host's 429 pauses every host ----------------------------------------------------


# the pause left after four real HTTP requests: within 1 real second of 300 s
@pytest.mark.slow
@pytest.mark.parametrize("client", CLIENTS)
def test_one_hosts_429_pauses_that_host_only(name, serve, client):
    """Under one shared Limiter (the README's HTTP example), host A's 429 with Retry-After 300
    paused every host for 300 s; now A alone is paused (not even sent to), B goes on at once."""
    a, b = serve(429, b"300"), serve(200)
    lim = shmlimit.Limiter(name, rate=50, burst=5)
    opts = dict(max_wait=0.5)
    assert _get(client, lim, a.url + "/", **opts) == 429
    assert [_get(client, lim, b.url + "/", **opts) for _ in range(3)] == [200] * 3
    assert b.hits == 3
    with pytest.raises(shmlimit.RateLimited) as e:
        _get(client, lim, a.url + "/again", **opts)
    assert 299 <= e.value.retry_after <= 300 and a.hits == 1  # refused before it was sent
    assert lim.stats().grants == 4  # A's refused request took none of the shared rate
    lim.close()


# the pause left after 40 answers: within 0.1 real second of 30 s
@pytest.mark.slow
def test_a_host_cannot_renew_its_pause_beyond_what_it_asked(name, serve):
    """Answers in flight, each asking more, pause the host until the latest end asked (capped at
    max_pause from now): they never add up."""
    a = serve(429, b"100000")
    lim = shmlimit.Limiter(name, rate=1000, burst=10)
    throttle = HostThrottle(lim, max_pause=30.0)
    for _ in range(20):
        assert throttle.after(a.host, 429, "100000") == 30.0
        assert throttle.after(a.host, 429, "20") == 20.0
    assert 29.9 <= throttle.pauses.retry_after(a.host) <= 30.0
    assert throttle.pauses.stats().grants == 0
    throttle.pauses.close()
    lim.close()


@pytest.mark.parametrize("kind", ["limiter", "keyed"])
def test_an_ipv6_host_and_port_is_no_other_hosts_key(name, kind):
    """``[::1]:8080`` and the address ``[::1:8080]`` are two hosts: their keys were both
    ``::1:8080``, so one's 429 paused the other, and they shared one limit."""
    assert host_key("http://[::1]:8080/") != host_key("http://[::1:8080]/")
    assert host_key("https://[2001:DB8::1]:443/") == host_key("https://[2001:db8::1]/")
    lim = (
        shmlimit.Limiter(name, rate=1000, burst=10)
        if kind == "limiter"
        else shmlimit.KeyedLimiter(name, rate=1000, burst=10, keys=64)
    )
    throttle = HostThrottle(lim, max_wait=0)
    args, host = throttle.args("http://[::1:8080]/")
    assert throttle.after(host, 429, "300", args=args) == 300.0
    with pytest.raises(shmlimit.RateLimited):
        throttle.before(args, host)
    throttle.before(*throttle.args("http://[::1]:8080/"))  # max_wait=0: a pause would raise
    if throttle.pauses is not lim:
        throttle.pauses.close()
    lim.close()


@pytest.mark.parametrize("when_full", [None, "refuse"])
def test_a_full_pause_table_pauses_only_its_own_hosts(name, when_full):
    """Hostile hosts (one wildcard domain, each answering 429 Retry-After) filled the pause
    table, and every other host then counted as paused until a slot freed (the table's wait for
    a slot read as the host's pause): a host without an entry is not paused."""
    lim = shmlimit.Limiter(name, rate=1000, burst=100)
    pauses = shmlimit.KeyedLimiter(
        f"{name}.p", rate=1, per=1.0, burst=1, keys=16, when_full=when_full
    )
    throttle = HostThrottle(lim, max_wait=0, pauses=pauses)
    for i in range(64):
        throttle.after(f"h{i}.evil.example", 429, "300")
    assert pauses.stats().keys == pauses.slots  # every slot holds a paused hostile host
    assert pauses.retry_after("h0.evil.example") > 0 or pauses.retry_after("h63.evil.example") > 0
    for i in range(20):
        throttle.before((), f"victim{i}.good.example")  # max_wait=0: a pause would raise
        assert pauses.own_wait(f"victim{i}.good.example") == 0.0
    paused = next(f"h{i}.evil.example" for i in range(64) if pauses.own_wait(f"h{i}.evil.example"))
    assert 299 <= pauses.own_wait(paused) <= 300
    with pytest.raises(shmlimit.RateLimited):
        throttle.before((), paused)
    pauses.close()
    lim.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="playing another user needs root")
def test_the_pause_table_trusts_whom_its_limiter_trusts(name):
    """A limiter shared between users (``mode=0o660``, ``trusted_uids=[its owner]``): the default
    pause table was opened without the limiter's trusted uids, so every process but its owner's
    raised UntrustedSegmentError building an HTTP client's transport."""
    owner = pwd.getpwnam("nobody").pw_uid
    lim = shmlimit.Limiter(name, rate=5, mode=0o660)
    HostThrottle(lim).pauses.close()  # the owner's crawler makes the pause table
    lim.close()
    for path in glob.glob(f"/dev/shm/shmlimit.{name}*"):
        os.chown(path, owner, -1)  # as if that user had made them
    other = shmlimit.Limiter(name, mode=0o660, trusted_uids=[owner])
    throttle = HostThrottle(other)
    assert throttle.pauses.name == pause_table_name(name)
    assert throttle.after("a.example", 429, "30") == 30.0
    throttle.pauses.close()
    other.close()
    with pytest.raises(shmlimit.UntrustedSegmentError):  # a process that does not trust them
        shmlimit.KeyedLimiter(pause_table_name(name))


# -- item: urllib3's retries resend past the throttle ------------------------------------------


def test_urllib3_retries_take_an_op_each_and_wait_the_pause(name, serve):
    """requests' ``max_retries`` are urllib3's, which resend inside one ``send``: 4 requests went
    out for 1 op, and a 429's Retry-After was slept by urllib3 (0.5 s max_wait or not, at most
    max_pause or not) before sending again.  Each resend now takes its op, after the host's
    pause as the throttle reads it, within max_wait."""
    from urllib3.util.retry import Retry

    lim = shmlimit.Limiter(name, rate=1000, burst=10)
    retries = Retry(total=3, status_forcelist=[429], backoff_factor=0, raise_on_status=False)
    busy = serve(429)  # no Retry-After: urllib3 retries it for its status
    with requests.Session() as s:
        s.mount("http://", ThrottledAdapter(lim, max_retries=retries))
        assert s.get(busy.url + "/x", timeout=10).status_code == 429
    assert busy.hits == 4 and lim.stats().grants == 4
    # urllib3 resends a 429 with Retry-After on a plain max_retries=1 after sleeping it
    paused = serve(429, b"3")
    with requests.Session() as s:
        s.mount("http://", ThrottledAdapter(lim, max_wait=0.5, max_retries=1))
        with pytest.raises(shmlimit.RateLimited) as e:
            s.get(paused.url + "/x", timeout=10)
    assert paused.hits == 1 and 2.5 < e.value.retry_after <= 3
    assert lim.stats().grants == 5
    # a request the key leaves unthrottled keeps urllib3's own retries
    free = serve(429)
    with requests.Session() as s:
        s.mount("http://", ThrottledAdapter(lim, key=lambda url: None, max_retries=retries))
        assert s.get(free.url + "/x", timeout=10).status_code == 429
    assert free.hits == 4 and lim.stats().grants == 5
    lim.close()


def test_a_pause_capped_to_nothing_keeps_urllib3s_backoff(name):
    """max_pause=0 (no pauses): a 429 with Retry-After was said to pause its host 0.0 s, which
    the resend took for a pause and skipped urllib3's backoff, resending at once.  A pause of
    nothing is none: the backoff stays, as for an answer without Retry-After."""
    lim = shmlimit.Limiter(name, rate=1000, burst=10)
    adapter = ThrottledAdapter(lim, max_pause=0)
    adapter.sending.url = "http://a.example/x"

    class Answer:
        status, headers = 429, {"retry-after": "5"}

    backoffs = []
    assert adapter.throttle.after("a.example", 429, "5") is None
    assert adapter.resend(Answer(), lambda: backoffs.append(1)) and backoffs == [1]
    adapter.throttle.pauses.close()
    lim.close()


def test_a_misspelt_adapter_option_makes_no_pause_table(name):
    """``ThrottledAdapter(lim, max_wiat=1)`` made the pause table in /dev/shm, then raised
    HTTPAdapter's TypeError: the shared state changed for a call that failed.  It is refused
    first."""
    lim = shmlimit.Limiter(name, rate=5)
    with pytest.raises(TypeError, match="max_wiat"):
        ThrottledAdapter(lim, max_wiat=1)
    assert pause_table_name(name) not in shmlimit.list_names()
    lim.close()
