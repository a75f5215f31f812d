"""One liveness check for every kind: a keyed inserter that died and is not yet reaped (a zombie)
is dead, as it is to the process table.

The keyed slots asked ``kill(pid, 0)``, which a zombie answers as alive: an insert it left half
done held its key until the zombie was reaped -- ``try_acquire`` refused every time, an untimed
``acquire`` waited, and in the parent that should reap it, waited forever.  The keyed check now
asks ``shm.table`` (the native backend calls it back), on both backends.
"""

import os
import signal
import subprocess
import sys
import threading

import pytest
from support.keyed import Stopped, StopsAt
from support.procs import WORKDIR

import shmlimit
from shmlimit.keyed import cells as KC
from shmlimit.keyed import layout as K
from shmlimit.shm import table
from shmlimit.shm.cells import native_available

BACKENDS = ["atomics"] + (["native"] if native_available() else [])
KEYS = 64


def _state(pid):
    with open(f"/proc/{pid}/stat", "rb") as f:
        data = f.read()
    return data[data.rindex(b")") + 2 :].split()[0]


def _zombie_inserting(lim, keys):
    """A child that inserts each key of ``keys`` up to its PEND, then exits, left unreaped: its pid."""
    att = lim._att
    slots = K.slots_offset(att.geo.overrides)
    now = 1 << 40  # the values it stores matter not: its inserts are never published
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            for key in keys:
                d = att.kt.digest(key)
                inserter = KC.SlotTable(
                    StopsAt(att.cells, None),
                    slots,
                    KEYS,
                    min(K.PROBE, KEYS),
                    K.KEYS_LIVE,
                    K.EVICTED,
                    K.owner(os.getpid()),
                )
                try:
                    inserter.insert(d, (d[0] * KEYS) >> 64, now, now + 1, (1, 0, 0))
                except Stopped:
                    pass
            code = 0
        finally:
            os._exit(code)
    os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)  # it has exited, and stays unreaped
    return pid


def _pending(lim, key, pid):
    att = lim._att
    d = att.kt.digest(key)
    slots = K.slots_offset(att.geo.overrides)
    return [
        i
        for i in range(KEYS)
        if att.cells.load(slots + i * K.LINE) & 0xFF == K.PEND
        and (att.cells.load(slots + i * K.LINE) >> 8) & 0xFFFFFFFF == K.owner(pid)
        and att.cells.load(slots + i * K.LINE + K.S_D0) == d[0]
    ]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_zombie_inserters_keys_are_granted_at_once(name, backend, monkeypatch):
    monkeypatch.setenv("SHMLIMIT_BACKEND", backend)
    lim = shmlimit.KeyedLimiter(name, rate=1, keys=KEYS)
    pid = _zombie_inserting(lim, ["k", "j"])
    waiter = None
    try:
        assert lim.backend == backend
        assert _state(pid) == b"Z"
        assert _pending(lim, "k", pid) and _pending(lim, "j", pid)
        # before: refused every time, after waiting 0.2 s for the zombie to move
        assert lim.try_acquire("k") is True
        # an untimed acquire by the parent that should reap it: before, it waited forever
        got = []
        waiter = threading.Thread(target=lambda: got.append(lim.acquire("j")))
        waiter.start()
        waiter.join(timeout=30)
        assert got == [True]
        assert _state(pid) == b"Z"  # still unreaped: judged dead as a zombie
        assert lim.stats().grants == 2
    finally:
        os.waitpid(pid, 0)  # reaped: a waiter still blocked on the zombie moves on
        if waiter is not None:
            waiter.join()
        lim.close()


def test_liveness_is_decided_once_for_every_kind():
    """The process table and the keyed owners agree: live, zombie, gone, another PID namespace."""
    me = os.getpid()
    child = subprocess.Popen([sys.executable, "-c", "pass"], cwd=WORKDIR)
    os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)
    try:
        assert _state(child.pid) == b"Z"
        gone = 1 << 22  # above any pid_max: no such process
        with open("/proc/sys/kernel/pid_max") as f:
            assert int(f.read()) < gone
        cases = {me: True, child.pid: False}
        for pid, live in cases.items():
            assert table.is_alive(pid, 0) is live
            assert table.slot_alive(pid, table.proc_start(pid) or 0, table.pid_namespace()) is live
            assert KC.alive(K.owner(pid), K.owner(me)) is live
        assert not table.is_alive(gone - 1, 0) and not KC.alive(K.owner(gone - 1), K.owner(me))
        other_ns = K.owner(child.pid) ^ (1 << K.PID_BITS)  # cannot be asked about: alive
        assert KC.alive(other_ns, K.owner(me)) is True
    finally:
        child.wait()


def test_a_pid_hidden_from_proc_is_asked_by_signal(monkeypatch):
    """With /proc mounted ``hidepid=2`` another user's process has no /proc entry: it exists (the
    signal check says so), so it counts as alive, start time unknown."""
    import builtins

    real_open = builtins.open

    def hidden(path, *a, **kw):
        if str(path).startswith("/proc/") and str(path).endswith("/stat"):
            raise FileNotFoundError(path)
        return real_open(path, *a, **kw)

    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], cwd=WORKDIR)
    try:
        monkeypatch.setattr(builtins, "open", hidden)
        assert table.proc_start(sleeper.pid) == table.UNKNOWN
        assert table.is_alive(sleeper.pid, 12345)
        sleeper.send_signal(signal.SIGKILL)
        sleeper.wait()
        assert table.proc_start(sleeper.pid) is None
    finally:
        monkeypatch.undo()
        if sleeper.poll() is None:
            sleeper.kill()
            sleeper.wait()
