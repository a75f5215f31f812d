"""Keyed segments whose slots another process left mid-insert and never finishes, on both backends.

An insert of a key that finds a *farther* PEND slot of the same key waits for
that one to see it and give way: the protocol's way of keeping exactly one.
Its owner does so within microseconds -- if it runs.  A process stopped
mid-insert (SIGSTOP, a frozen container), or a PEND written into the segment
by hand under a pid that is alive (or of another PID namespace, which counts
as alive), never does.  Every call on that key then waited without end, a
``try_acquire`` included, and on the native backend in one C call that no
signal could interrupt.  The waiter now gives way itself after
``keyed_cells.PEND_NS``: nothing taken, nothing of its insert left, a try or
a timed call refused, an untimed one waiting interruptibly until the stalled
process dies or moves on.

The calls run in fresh interpreters with a time limit, so that a hang fails
the test instead of the run.
"""

import json
import os
import select
import signal
import subprocess
import sys

import pytest
from support.procs import WORKDIR

import shmlimit
from shmlimit.keyed import cells as KC
from shmlimit.keyed import layout as K
from shmlimit.keyed.window_table import WindowTable
from shmlimit.shm.cells import native_available

# run once in CI: names each backend it checks (the readers it runs)
pytestmark = pytest.mark.backend_independent

BACKENDS = ["atomics"] + (["native"] if native_available() else [])
KEYS = 64

CALLS = r"""
import json, sys, time
import shmlimit
from shmlimit.keyed.window_table import WindowTable
name, kind = sys.argv[1], sys.argv[2]
out = {}
def timed(label, call):
    t = time.monotonic()
    try:
        out[label] = call()
    except shmlimit.ShmlimitError as e:
        out[label] = f"{type(e).__name__}: {e}"
    out[label + "_s"] = time.monotonic() - t
if kind == "gcra":
    lim = shmlimit.KeyedLimiter(name)
    timed("try", lambda: lim.try_acquire("k"))
    timed("timed", lambda: lim.acquire("k", timeout=5))
    timed("reserve", lambda: lim.reserve("k", max_wait=5))
    timed("other", lambda: lim.try_acquire("other"))
    lim.close()
else:
    wt = WindowTable(name)
    timed("incr", lambda: wt.incr("k", 60))
    timed("other", lambda: wt.incr("other", 60))
    wt.close()
print(json.dumps(out))
"""

UNTIMED = r"""
import sys
import shmlimit
lim = shmlimit.KeyedLimiter(sys.argv[1])
print("calling", flush=True)
print(lim.acquire("k"), flush=True)
lim.close()
"""


def _path(name):
    return f"/dev/shm/shmlimit.{name}"


def _word(name, off):
    with open(_path(name), "rb") as f:
        return int.from_bytes(os.pread(f.fileno(), 8, off), "little")


def _put(name, off, value):
    with open(_path(name), "r+b") as f:
        os.pwrite(f.fileno(), value.to_bytes(8, "little"), off)


def _stall(name, digest, novr, owner, at=1):
    """Leave the slot ``at`` slots after the key's home slot PEND under ``owner``, as an insert stopped
    right after its ``-> PEND`` would (at 1 the home slot stays EMPTY: a later insert takes it,
    nearer the home)."""
    home = (digest[0] * KEYS) >> 64
    s = K.slots_offset(novr) + ((home + at) % KEYS) * K.LINE
    _put(name, s + K.S_D0, digest[0])
    _put(name, s + K.S_D1, digest[1])
    _put(name, s + K.S_V0, 1)
    ctrl = K.ctrl(K.PEND, owner, 7)
    _put(name, s, ctrl)
    return s, ctrl


def _window_slots(name, digest, novr):
    home = (digest[0] * KEYS) >> 64
    return [K.slots_offset(novr) + ((home + i) % KEYS) * K.LINE for i in range(min(K.PROBE, KEYS))]


def _run(script, name, kind, backend):
    """``script`` in a fresh interpreter on ``backend``: its JSON answer (a hang fails after 60 s)."""
    env = dict(os.environ, SHMLIMIT_BACKEND=backend)
    out = subprocess.run(
        [sys.executable, "-c", script, name, kind],
        cwd=WORKDIR,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.fixture
def stopped():
    """A live process that never runs: a stand-in for an inserter stopped mid-insert."""
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], cwd=WORKDIR)
    os.kill(p.pid, signal.SIGSTOP)
    yield p
    p.kill()
    p.wait()


def _owners(stopped):
    other_ns = K.owner(stopped.pid) ^ (
        1 << K.PID_BITS
    )  # another PID namespace's tag: counts as alive
    return {"stopped": K.owner(stopped.pid), "other-namespace": other_ns}


@pytest.mark.parametrize("owner_kind", ["stopped", "other-namespace"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_stalled_insert_of_the_key_is_given_way_to_not_waited_for(
    name, backend, stopped, owner_kind
):
    lim = shmlimit.KeyedLimiter(name, rate=1, keys=KEYS)
    try:
        novr = lim._att.geo.overrides
        d = lim._att.kt.digest("k")
        s, ctrl = _stall(name, d, novr, _owners(stopped)[owner_kind])
        out = _run(CALLS, name, "gcra", backend)
        # refused after waiting PEND_NS for the stalled insert (before: no answer at all)
        assert out["try"] is False and KC.PEND_NS / 1e9 <= out["try_s"] < 30
        assert out["timed"] is False and out["reserve"] is None
        assert out["other"] is True  # other keys are not held up
        # the stalled slot is as it was, and nothing of the waiters' inserts is left: no grant for "k"
        assert _word(name, s) == ctrl
        live = [
            o
            for o in _window_slots(name, d, novr)
            if _word(name, o) & 0xFF == K.LIVE
            and (_word(name, o + K.S_D0), _word(name, o + K.S_D1)) == d
        ]
        assert live == []
        assert lim.stats().keys == 1 and lim.stats().grants == 1  # "other" alone
    finally:
        lim.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_untimed_acquire_waits_for_a_stalled_insert_until_its_process_dies(
    name, backend, stopped
):
    lim = shmlimit.KeyedLimiter(name, rate=1, keys=KEYS)
    p = None
    try:
        d = lim._att.kt.digest("k")
        _stall(name, d, lim._att.geo.overrides, K.owner(stopped.pid))
        env = dict(os.environ, SHMLIMIT_BACKEND=backend)
        p = subprocess.Popen(
            [sys.executable, "-c", UNTIMED, name],
            cwd=WORKDIR,
            env=env,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert p.stdout.readline().strip() == "calling"
        # it neither returns nor fails while the stalled inserter lives (several PEND_NS)
        ready, _, _ = select.select([p.stdout], [], [], 3 * KC.PEND_NS / 1e9)
        assert not ready
        stopped.kill()
        stopped.wait()
        # the dead inserter's slot is reclaimed: the key is inserted and granted
        assert p.stdout.readline().strip() == "True"
        assert p.wait(timeout=60) == 0
        assert lim.stats().grants == 1
    finally:
        if p is not None and p.poll() is None:
            p.kill()
        if p is not None:
            p.wait()
        lim.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_window_counter_on_a_stalled_insert_is_a_clear_error(name, backend, stopped):
    wt = WindowTable(name, keys=KEYS)
    try:
        k0, k1 = wt.counters.k0, wt.counters.k1
        d = KC.siphash128(b"F" + b"k", k0, k1)  # the fixed window's digest of "k"
        _stall(name, d, 0, K.owner(stopped.pid))
        out = _run(CALLS, name, "windows", backend)
        assert (
            out["incr"].startswith("KeyTableFullError")
            and "inserting it for over 0.2 s" in out["incr"]
        )
        assert KC.PEND_NS / 1e9 <= out["incr_s"] < 30
        assert out["other"] == 1
    finally:
        wt.close()


OPEN_WITH_RATE = r"""
import json, sys, time
import shmlimit
t = time.monotonic()
lim = shmlimit.KeyedLimiter(sys.argv[1], rate=10, keys=64)  # a redeploy: opens with its rate (_adopt reads it)
out = dict(rate=lim.rate, override=lim.override("k"), granted=lim.try_acquire("k"), seconds=time.monotonic() - t)
lim.set_rate(20)
out["after"] = lim.rate
lim.close()
print(json.dumps(out))
"""


@pytest.mark.parametrize("seq", [5, 2**64 - 1])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_writer_killed_holding_the_config_lock_stalls_no_opener(name, backend, seq):
    """A process killed inside ``set_rate`` leaves ``CFG_SEQ`` odd.  The keyed composite's readers close
    such a lock after 200 ms, but the Python readers (the default rate, an override, the adoption of
    a redeploy's rate) waited for it forever: a process opening the limiter with its rate hung until
    some other process acquired through it.  At 2**64 - 1 the reference composite's close overflowed."""
    shmlimit.KeyedLimiter(name, rate=10, keys=64).close()
    _put(name, K.CFG_SEQ, seq)  # as a writer killed between taking the lock and releasing it
    out = _run(OPEN_WITH_RATE, name, "", backend)
    assert out["rate"] == 10 and out["override"] is None and out["granted"] is True
    assert 0.2 <= out["seconds"] < 30  # the lock was taken over after its timeout, not waited for
    assert out["after"] == 20
    assert _word(name, K.CFG_SEQ) % 2 == 0


TRY_ONCE = r"""
import sys
import shmlimit
lim = shmlimit.KeyedLimiter(sys.argv[1])
print(lim.try_acquire("k"), lim.try_acquire("other"))
lim.close()
"""


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_stalled_insert_nearer_the_home_is_not_waited_for(name, backend, stopped):
    lim = shmlimit.KeyedLimiter(name, rate=1, keys=KEYS)
    try:
        d = lim._att.kt.digest("k")
        _stall(
            name, d, lim._att.geo.overrides, K.owner(stopped.pid), at=0
        )  # the home slot; the next is EMPTY
        env = dict(os.environ, SHMLIMIT_BACKEND=backend)
        out = subprocess.run(
            [sys.executable, "-c", TRY_ONCE, name],
            cwd=WORKDIR,
            env=env,
            capture_output=True,
            text=True,
            timeout=5,
        )  # given way to within 0.2 s, were it bounded
        assert out.stdout.split() == ["False", "True"]
    finally:
        lim.close()
