"""How limiters live in servers: a pre-fork master that only opened a limiter forks without threads
(the filler starts on first use), and workers share the limit.  Real gunicorn on 127.0.0.1."""

import contextlib
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import textwrap
import threading

import pytest
from support.procs import WORKDIR, run_processes, wait_for
from support.servers import BIN, Server, get

import shmlimit

# run once in CI: limiters under a pre-fork server; the limiter is the core tests' subject
pytestmark = pytest.mark.backend_independent


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
    assert (
        got[0] == b"1" and int(got[1]) == 2
    )  # granted, and its own filler thread started on that use
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
    argv = [
        f"{BIN}/gunicorn",
        "--preload",
        "-w",
        "2",
        "-b",
        "127.0.0.1:{port}",
        "--log-level",
        "warning",
        "preload_app:app",
    ]
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


# ---- registering on first use ----------------------------------------------------------------


def _listed(name):
    return {p.pid for p in shmlimit.inspect(name).processes}


def test_forked_child_is_listed_only_once_it_uses_the_limiter(name):
    lim = shmlimit.Limiter(name, rate=100)
    to_child, from_parent = os.pipe()
    to_parent, from_child = os.pipe()
    pid = os.fork()
    if pid == 0:  # waits for the parent's word, uses the limiter once, reports, waits again
        try:
            os.read(to_child, 1)
            ok = lim.try_acquire()
            os.write(from_child, b"1" if ok else b"0")
            os.read(to_child, 1)
        finally:
            os._exit(0)
    try:
        assert _listed(name) == {os.getpid()}  # the parent opened it; the child only inherited it
        os.write(from_parent, b"g")
        assert os.read(to_parent, 1) == b"1"
        assert _listed(name) == {os.getpid(), pid}  # its first use registered it
        assert shmlimit.inspect(name).grants == 1
    finally:
        os.write(from_parent, b"x")
        os.waitpid(pid, 0)
        for fd in (to_child, from_parent, to_parent, from_child):
            os.close(fd)
    lim.close()


def test_children_that_leave_with_os_exit_unused_leave_no_entry(name):
    lim = shmlimit.Limiter(name, rate=100)
    pids = []
    for _ in range(3):  # Celery's pool children leave with os._exit: no exit hook runs
        pid = os.fork()
        if pid == 0:
            lim.stats()  # observing is not using
            os._exit(0)
        pids.append(pid)
    for pid in pids:
        os.waitpid(pid, 0)
    assert [p.pid for p in shmlimit.inspect(name).processes] == [os.getpid()]
    lim.close()


@contextlib.contextmanager
def forked_user(use):
    """A forked child that calls ``use()`` once told to: yields ``(pid, go)``; ``go()`` lets it run and
    returns what it reports ("granted", or its ``SegmentError``'s message).  The child leaves with
    ``os._exit``: no exit hook, so whatever its use left stays as it left it.  Never told, it is
    killed."""
    r, w = os.pipe()
    go_r, go_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.read(go_r, 1)
            try:
                use()
                os.write(w, b"granted")
            except shmlimit.SegmentError as e:
                os.write(w, str(e).encode()[:500])
        finally:
            os._exit(0)
    told = []

    def go():
        told.append(True)
        os.write(go_w, b"g")
        return os.read(r, 600).decode()

    try:
        yield pid, go
    finally:
        if not told:
            os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        for fd in (r, w, go_r, go_w):
            os.close(fd)


def test_child_using_a_limiter_collected_meanwhile_gets_a_clear_error(name):
    from shmlimit.attachment import collect

    lim = shmlimit.Limiter(name, rate=100)
    with forked_user(lim.try_acquire) as (_, go):
        lim.close()  # the only registered process leaves: nothing keeps the segment
        assert collect(name)  # what `shmlimit gc` does: no live process is listed, so it goes
        msg = go()
    assert name in msg and "collected" in msg, msg


@pytest.mark.parametrize("how", ["collected", "unlinked and re-created"])
def test_a_child_whose_inherited_limiter_is_gone_touches_nothing_of_it(name, how):
    # A forked child's first use of a limiter inherited unused, once the segment was collected
    # (`shmlimit gc`) or its name unlinked and re-created, must neither register nor record a
    # waiter's ticket there: the segment is nobody's (or no longer the name's), so its limit
    # would silently double, and what it left there no filler would ever look at.
    import mmap

    from shmlimit.attachment import collect
    from shmlimit.shm import layout as L
    from shmlimit.shm.segment import unlink

    lim = shmlimit.Limiter(name, rate=100, burst=1)
    lim.try_acquire()  # the next acquire queues: a waiter's ticket would be recorded
    with open(f"/dev/shm/shmlimit.{name}", "rb") as f:  # the old segment, as it stays mapped
        old = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    again = None
    with forked_user(lambda: lim.acquire(3)) as (pid, go):
        lim.close()  # the only registered process leaves: nothing keeps the segment
        if how == "collected":
            assert collect(name)  # what `shmlimit gc` does
        else:
            unlink(name)  # what `shmlimit unlink` does
            again = shmlimit.Limiter(name, rate=100, burst=1)  # another segment under the name
            again.try_acquire()
        msg = go()
    try:
        assert name in msg and "open it again" in msg, msg

        def word(off):
            return int.from_bytes(old[off : off + 8], "little")

        slots = word(L.SLOTS_OFF)
        pids = [word(L.slot_offset(i) + L.SLOT_PID) for i in range(slots)]
        lens = [word(off) for i in range(slots) for _, off in L.ticket_records(slots, i)]
        assert pid not in pids and lens == [0] * len(lens), (
            pids,
            lens,
        )  # nothing of the child there
        if again is not None:
            assert _listed(name) == {os.getpid()}
    finally:
        old.close()
        if again is not None:
            again.close()


# ---- a new configuration: redeploys, and live changes ------------------------------------------

OPENER = """
import sys, shmlimit
lim = shmlimit.Limiter(sys.argv[1], rate=float(sys.argv[2]))
lim.try_acquire()
print("ready", flush=True)
sys.stdin.readline()
"""


def _start_opener(name, rate):
    p = subprocess.Popen(
        [sys.executable, "-c", OPENER, name, str(rate)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=WORKDIR,
    )
    assert p.stdout.readline().strip() == "ready"
    return p


def test_a_segment_no_live_process_uses_takes_the_new_config(name):
    p = _start_opener(name, 10)
    p.kill()  # killed: its entry stays in the table, dead
    p.wait()
    assert [q.alive for q in shmlimit.inspect(name).processes] == [False]
    with pytest.raises(shmlimit.ConfigMismatchError, match="capped"):
        shmlimit.Limiter(name, rate=20, capped=True)  # fixed at creation: never taken
    lim = shmlimit.Limiter(name, rate=20)  # a redeploy with a changed rate boots
    assert not lim.created and lim.rate == 20 and shmlimit.inspect(name).rate == 20
    assert shmlimit.inspect(name).grants == 1  # the same segment: its counts are kept
    lim.close()


def test_live_processes_keep_their_config_unless_reconfigure(name):
    p = _start_opener(name, 10)
    try:
        with pytest.raises(shmlimit.ConfigMismatchError, match="reconfigure=True"):
            shmlimit.Limiter(name, rate=20)
        assert shmlimit.inspect(name).rate == 10  # refused: nothing changed
        with pytest.raises(ValueError, match="reconfigure"):
            shmlimit.Limiter(name, rate=20, reconfigure="yes")
        with pytest.raises(ValueError, match="reconfigure"):
            shmlimit.Limiter(name, reconfigure=True)  # nothing to apply
        assert shmlimit.inspect(name).rate == 10
        lim = shmlimit.Limiter(name, rate=20, reconfigure=True)  # fleet-wide, as set_rate
        assert lim.rate == 20 and shmlimit.inspect(name).rate == 20
        again = shmlimit.Limiter(
            name, rate=30, reconfigure=True
        )  # through this process's own attachment
        assert lim.rate == again.rate == 30
        with pytest.raises(shmlimit.ConfigMismatchError):
            shmlimit.Limiter(name, rate=40)  # this process and the other one use it
        again.close()
        lim.close()
    finally:
        p.kill()
        p.wait()


def _race_to_open(name, rate, barrier, out):
    barrier.wait(30)
    try:
        lim = shmlimit.Limiter(name, rate=rate)
        out.put(lim.rate)
        barrier.wait(30)  # everyone holds it before anyone leaves
        lim.close()
    except Exception as e:  # reported, not raised: the parent asserts
        out.put(repr(e))
        barrier.abort()


def test_workers_booting_together_on_an_old_config_all_boot(name):
    ctx = mp.get_context("fork")
    create = f"import shmlimit; shmlimit.Limiter({name!r}, rate=10).close()"
    subprocess.run([sys.executable, "-c", create], check=True, cwd=WORKDIR)  # its creator is gone
    for rnd in range(
        6
    ):  # the workers of a redeploy start at once: none may see another as an old user
        old = shmlimit.attach(name)
        old.set_rate(10)
        old.close()
        barrier = ctx.Barrier(4)
        got = run_processes(ctx, _race_to_open, [(name, 20 + rnd, barrier)] * 4, timeout=60)
        assert got == [20.0 + rnd] * 4, got


REDEPLOY_APP = """
import os
import shmlimit
from shmlimit.integrations.wsgi import RateLimitMiddleware

LIM = shmlimit.Limiter(os.environ["LIM"], rate=float(os.environ["RATE"]), per=60)

def hello(environ, start_response):
    start_response("200 OK", [("Content-Type", "text/plain")])
    return [str(os.getpid()).encode()]

app = RateLimitMiddleware(hello, limiter=LIM, key=lambda e: None if e["PATH_INFO"] == "/health" else "")
"""


@pytest.mark.slow
def test_gunicorn_redeploy_with_a_changed_rate_boots(name, tmp_path):
    pytest.importorskip("gunicorn")
    (tmp_path / "redeploy_app.py").write_text(textwrap.dedent(REDEPLOY_APP))
    argv = [
        f"{BIN}/gunicorn",
        "-w",
        "2",
        "-b",
        "127.0.0.1:{port}",
        "--log-level",
        "warning",
        "redeploy_app:app",
    ]
    with Server(argv, str(tmp_path), env={"LIM": name, "RATE": "2"}) as srv:
        assert get(srv.url + "/")[1]["ratelimit-policy"] == '"default";q=2;w=60'
        os.killpg(srv.proc.pid, signal.SIGKILL)  # gone without a word: its entries stay, dead
        srv.proc.wait(15)
    # the killed workers are gone once reaped (their new parent does it)
    wait_for(lambda: not any(p.alive for p in shmlimit.inspect(name).processes), timeout=30)
    assert shmlimit.inspect(name).processes  # their entries stay, dead
    with Server(
        argv, str(tmp_path), env={"LIM": name, "RATE": "5"}
    ) as srv:  # boots: no ConfigMismatchError
        policies = {get(srv.url + "/")[1]["ratelimit-policy"] for _ in range(8)}
        assert policies == {'"default";q=5;w=60'}  # every worker runs the new rate
        assert "Worker failed to boot" not in srv.output()
    assert shmlimit.inspect(name).rate == 5


KEYED_OPENER = """
import sys, shmlimit
lim = shmlimit.KeyedLimiter(sys.argv[1], rate=float(sys.argv[2]), keys=64)
lim.try_acquire("a")
print("ready", flush=True)
sys.stdin.readline()
"""


def test_keyed_redeploy_takes_the_new_rate_and_live_users_need_reconfigure(name):
    p = subprocess.Popen(
        [sys.executable, "-c", KEYED_OPENER, name, "10"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=WORKDIR,
    )
    assert p.stdout.readline().strip() == "ready"
    try:
        with pytest.raises(shmlimit.ConfigMismatchError, match="reconfigure=True"):
            shmlimit.KeyedLimiter(name, rate=20, keys=64)
        with pytest.raises(shmlimit.ConfigMismatchError, match="unlink"):  # the size never changes
            shmlimit.KeyedLimiter(name, rate=20, keys=128, reconfigure=True)
        assert shmlimit.inspect(name).rate == 10
        lim = shmlimit.KeyedLimiter(name, rate=20, keys=64, reconfigure=True)
        assert lim.rate == 20
        lim.close()
    finally:
        p.kill()
        p.wait()
    lim = shmlimit.KeyedLimiter(
        name, rate=30, keys=64
    )  # every user gone (one killed): a redeploy boots
    assert lim.rate == 30 and not lim.created
    lim.close()
