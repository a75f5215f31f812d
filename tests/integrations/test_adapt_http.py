"""The adaptive rate through the HTTP clients: every answer is reported, and the fleet follows a
real server's hidden capacity.

The transports report 429 and 503 as throttled and any other answer as not, only under a limiter
that adapts; a ``Retry-After`` still pauses the host.  The Done-when run (``tools/adapt_demo.py``,
slow): 4 processes through the httpx transport against a local server whose capacity is 200/s,
then 400/s, measured at the server in the settled seconds of each phase.
"""

import importlib.util
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from support.procs import ROOT

import shmlimit

httpx = pytest.importorskip("httpx")
requests = pytest.importorskip("requests")
from shmlimit.integrations._hosts import host_key, pause_table_name  # noqa: E402
from shmlimit.integrations.httpx import ThrottledTransport  # noqa: E402
from shmlimit.integrations.requests import ThrottledAdapter  # noqa: E402
from shmlimit.keyed import layout as KL  # noqa: E402

# run once in CI: the HTTP clients' reports; the adaptive words are tests/test_adapt*.py's
pytestmark = pytest.mark.backend_independent

ADAPT = shmlimit.Adapt(min_rate=10, max_rate=2000)


@pytest.fixture
def name(name):
    yield name
    try:
        shmlimit.unlink(pause_table_name(name))
    except FileNotFoundError:
        pass


class Statuses(BaseHTTPRequestHandler):
    """Answers ``/<status>`` with that status; ``/429-retry`` with 429 and ``Retry-After: 1``."""

    def do_GET(self):  # noqa: N802
        path = self.path.strip("/")
        self.send_response(int(path.split("-")[0]))
        if path.endswith("-retry"):
            self.send_header("Retry-After", "1")
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), Statuses)
    # shutdown() waits for the serving loop's next poll: 0.5 s by default, at every teardown
    t = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


STATUSES = [200, 201, 404, 500, 429, 503, 429]


def _counts(name):
    st = shmlimit.inspect(name).adapt
    return st.throttled, st.ok


def test_httpx_reports_every_answer(name, server, cleanup):
    lim = shmlimit.Limiter(name, rate=1000, adapt=ADAPT)
    cleanup.append(lim)
    with httpx.Client(transport=ThrottledTransport(lim)) as c:
        for s in STATUSES:
            assert c.get(f"{server}/{s}").status_code == s
    assert _counts(name) == (3, 4)


def test_requests_reports_every_answer(name, server, cleanup):
    lim = shmlimit.Limiter(name, rate=1000, adapt=ADAPT)
    cleanup.append(lim)
    with requests.Session() as s:
        s.mount("http://", ThrottledAdapter(lim))
        for st in STATUSES:
            assert s.get(f"{server}/{st}").status_code == st
    assert _counts(name) == (3, 4)


def test_retry_after_still_pauses_the_host(name, server, cleanup):
    lim = shmlimit.Limiter(name, rate=1000, adapt=ADAPT)
    cleanup.append(lim)
    transport = ThrottledTransport(lim)
    with httpx.Client(transport=transport) as c:
        assert c.get(f"{server}/429-retry").status_code == 429
    assert _counts(name) == (1, 0)
    assert transport.throttle.pauses.retry_after(host_key(server)) > 0.5


def test_a_limiter_that_does_not_adapt_is_told_nothing(name, server, cleanup):
    lim = shmlimit.Limiter(name, rate=1000)
    cleanup.append(lim)
    with httpx.Client(transport=ThrottledTransport(lim)) as c:
        assert c.get(f"{server}/429").status_code == 429  # no feedback() raised
    assert lim.stats().adapt is None


def _key_outcomes(lim, key):
    """(throttled, ok) reported for ``key`` (its override entry's outcome word)."""
    att = lim._use()
    e = att.overrides.entry(att.kt.digest(key))
    out = att.cells.load(e + KL.A_OUT)
    return out >> 32, out & 0xFFFFFFFF


def test_keyed_transports_report_each_host_under_its_key(name, server, cleanup):
    """Under a KeyedLimiter(adapt=) keyed by host, every answer is reported for its host only."""
    lim = shmlimit.KeyedLimiter(name, rate=1000, keys=1000, adapt=ADAPT)
    cleanup.append(lim)
    other = server.replace("127.0.0.1", "localhost")  # the same server, another host key
    with httpx.Client(transport=ThrottledTransport(lim)) as c:
        for s in STATUSES:
            assert c.get(f"{server}/{s}").status_code == s
    with requests.Session() as sess:
        sess.mount("http://", ThrottledAdapter(lim))
        assert sess.get(f"{other}/429").status_code == 429
        assert sess.get(f"{other}/200").status_code == 200
    assert _key_outcomes(lim, host_key(server)) == (3, 4)
    assert _key_outcomes(lim, host_key(other)) == (1, 1)
    st = lim.stats().adapt
    assert (st.throttled, st.ok) == (4, 5)


def _demo():
    spec = importlib.util.spec_from_file_location(
        "adapt_demo", os.path.join(ROOT, "tools", "adapt_demo.py")
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    # every process starts its part this long after the run begins: the clients' imports take
    # about 2 s on a busy 2-core machine (the tool's own 5 s is for any machine); a client late
    # still converges within a phase's first 3 s
    mod.STARTUP = 3.0
    return mod


@pytest.mark.slow
def test_four_processes_find_a_servers_capacity_as_it_changes(name, tmp_path):
    """The Done-when run: ``Limiter(name, rate=1000, adapt=Adapt(min_rate=10, max_rate=2000))`` in
    4 processes of 4 threads each, through the httpx transport, against 200/s then 400/s (8 s
    each: the rate converges in about 2 s); in each phase's last 5 s, at the server: goodput >=
    80 % of the capacity, <= 10 % of the answers 429."""
    demo = _demo()
    result = demo.run(name, [(200, 8), (400, 8)], procs=4, threads=4, settled=5.0,
                      workdir=str(tmp_path))  # fmt: skip
    for p in result["phases"]:
        assert p["goodput_share"] >= 0.8, result["phases"]
        assert p["throttled_share"] <= 0.10, result["phases"]


@pytest.mark.slow
def test_one_keyed_limiter_finds_two_hosts_capacities_at_once(name, tmp_path):
    """``KeyedLimiter(name, rate=500, adapt=Adapt(min_rate=5, max_rate=1000, increase=5))`` keyed
    by host, in 4 processes of 8 threads spread over two local servers of 100/s and 300/s at
    once (10 s: each rate is down to its host's within 2.5 s); in the last 5 s, at each server:
    goodput >= 75 % of its capacity, <= 10 % of the answers 429.  (Measured 82 to 93 % and under
    2.5 % on a busy 2-core machine.)"""
    demo = _demo()
    result = demo.run_keyed(name, [100, 300], 10, procs=4, threads=8, settled=5.0,
                            workdir=str(tmp_path))  # fmt: skip
    for h in result["hosts"]:
        figures = {k: v for k, v in h.items() if k != "rates"}
        assert h["goodput_share"] >= 0.75, figures
        assert h["throttled_share"] <= 0.10, figures
        assert h["rates"][-1][1] < 2 * h["capacity"], figures  # each host's own rate


@pytest.mark.parametrize("kind", ["limiter", "keyed"])
def test_running_transports_follow_a_live_reconfigure_of_adapt(name, server, kind, cleanup):
    """Another process drops ``adapt=`` with ``reconfigure=True`` while a client is running: its
    next request is answered, not turned into the ValueError ``feedback`` raises on a limiter
    that no longer adapts; adapt= given back, its answers are reported again."""
    make = shmlimit.Limiter if kind == "limiter" else shmlimit.KeyedLimiter
    lim = make(name, rate=1000, adapt=ADAPT)
    cleanup.append(lim)
    with httpx.Client(transport=ThrottledTransport(lim)) as c:
        assert c.get(f"{server}/200").status_code == 200
        make(name, rate=1000, reconfigure=True).close()
        assert not lim.adaptive
        assert c.get(f"{server}/429").status_code == 429
        make(name, rate=1000, adapt=ADAPT, reconfigure=True).close()
        assert c.get(f"{server}/429").status_code == 429
    assert _counts(name) == (1, 1)
