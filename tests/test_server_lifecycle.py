"""How limiters live in servers: a pre-fork master that only opened a limiter forks without threads
(the filler starts on first use), and workers share the limit.  Real gunicorn on 127.0.0.1."""
import os
import sys
import textwrap
import threading

import pytest

import shmlimit
from support.servers import BIN, Server, get


def _threads(pid):
    with open(f"/proc/{pid}/status") as f:
        return int(next(line for line in f if line.startswith("Threads:")).split()[1])


def test_opening_starts_no_thread_until_first_use(name):
    before = threading.active_count()
    lim = shmlimit.Limiter(name, rate=100)
    assert lim.rate == 100 and lim.stats().grants == 0  # observing is not using
    assert threading.active_count() == before
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child forked from a process with no filler thread: uses the limiter, reports
        try:
            ok = lim.acquire(timeout=5)
            os.write(w, b"%d %d" % (ok, threading.active_count()))
        finally:
            os._exit(0)
    os.close(w)
    got = os.read(r, 100).split()
    os.waitpid(pid, 0)
    os.close(r)
    assert got[0] == b"1" and int(got[1]) == 2  # granted, and its own filler thread started on that use
    assert threading.active_count() == before  # the parent still has none
    assert lim.acquire(timeout=5)
    assert threading.active_count() == before + 1  # first use here: this process's filler
    lim.close()


PRELOAD_APP = """
import os
import shmlimit
from shmlimit.integrations.wsgi import RateLimitMiddleware

LIM = shmlimit.Limiter(os.environ["LIM"], rate=1, per=60, burst=4)   # created once, in the master

def hello(environ, start_response):
    start_response("200 OK", [("Content-Type", "text/plain")])
    return [str(os.getpid()).encode()]

app = RateLimitMiddleware(hello, limiter=LIM, key=lambda e: None if e["PATH_INFO"] == "/health" else "")
"""


def test_gunicorn_preload_master_forks_without_threads(name, tmp_path):
    pytest.importorskip("gunicorn")
    (tmp_path / "preload_app.py").write_text(textwrap.dedent(PRELOAD_APP))
    argv = [f"{BIN}/gunicorn", "--preload", "-w", "2", "-b", "127.0.0.1:{port}", "--log-level", "warning",
            "preload_app:app"]
    with Server(argv, str(tmp_path), env={"LIM": name}) as srv:
        statuses = sorted(get(srv.url + "/")[0] for _ in range(10))
        assert statuses == [200] * 4 + [429] * 6  # the workers share the master's limiter exactly
        assert _threads(srv.proc.pid) == 1  # the master created the limiter, never used it: no thread
        assert "fork" not in srv.output().lower()
    assert shmlimit.inspect(name).grants == 4
