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

import shmlimit

httpx = pytest.importorskip("httpx")
requests = pytest.importorskip("requests")
from shmlimit.integrations._hosts import host_key, pause_table_name  # noqa: E402
from shmlimit.integrations.httpx import ThrottledTransport  # noqa: E402
from shmlimit.integrations.requests import ThrottledAdapter  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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
    t = threading.Thread(target=srv.serve_forever, daemon=True)
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


def _demo():
    spec = importlib.util.spec_from_file_location(
        "adapt_demo", os.path.join(ROOT, "tools", "adapt_demo.py")
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
def test_four_processes_find_a_servers_capacity_as_it_changes(name, tmp_path):
    """The Done-when run: ``Limiter(name, rate=1000, adapt=Adapt(min_rate=10, max_rate=2000))`` in
    4 processes of 4 threads each, through the httpx transport, against 200/s then 400/s (10 s
    each); in each phase's last 5 s, at the server: goodput >= 80 % of the capacity, <= 10 % of
    the answers 429."""
    demo = _demo()
    result = demo.run(name, [(200, 10), (400, 10)], procs=4, threads=4, settled=5.0,
                      workdir=str(tmp_path))  # fmt: skip
    for p in result["phases"]:
        assert p["goodput_share"] >= 0.8, result["phases"]
        assert p["throttled_share"] <= 0.10, result["phases"]
