"""How limiters live in servers: a pre-fork master that only opened a limiter forks without threads
(the filler starts on first use), and workers share the limit.  Real gunicorn on 127.0.0.1."""
import os
import sys
import textwrap
import threading

import pytest

import shmlimit
from support.servers import BIN, Server, get


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
import threading
import shmlimit
from shmlimit.integrations.wsgi import RateLimitMiddleware

LIM = shmlimit.Limiter(os.environ["LIM"], rate=1, per=60, burst=4)   # created once, in the master


def _threads_at_fork():  # what runs in the master whenever it forks a worker
    with open(os.environ["FORKS"], "a") as f:
        f.write(",".join(sorted(t.name for t in threading.enumerate())) + "\\n")

os.register_at_fork(before=_threads_at_fork)

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
    forks = tmp_path / "forks.txt"
    with Server(argv, str(tmp_path), env={"LIM": name, "FORKS": str(forks)}) as srv:
        statuses = sorted(get(srv.url + "/")[0] for _ in range(10))
        assert statuses == [200] * 4 + [429] * 6  # the workers share the master's limiter exactly
        assert "fork" not in srv.output().lower()
    # the master created the limiter and never used it: no filler thread ran when it forked the
    # workers (the server may run threads of its own: gunicorn's control socket)
    at_forks = forks.read_text().splitlines()
    assert len(at_forks) >= 2 and all("MainThread" in line for line in at_forks)
    assert not any("shmlimit" in line for line in at_forks), at_forks
    assert shmlimit.inspect(name).grants == 4
