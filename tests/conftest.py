import gc
import os
import re
import threading
import uuid

import psutil
import pytest

import shmlimit

_SHM_DIR = "/dev/shm"
_PREFIX = "shmlimit."


def _segments(startswith=""):
    try:
        return {
            f[len(_PREFIX) :] for f in os.listdir(_SHM_DIR) if f.startswith(_PREFIX + startswith)
        }
    except OSError:
        return set()


@pytest.fixture
def name():
    """A fresh limiter name, unlinked after the test whatever happened, with every segment named
    after it (``NAME.KEY`` of several rates, ``NAME-used``, a throttle's ``NAME.pauses``)."""
    n = f"test-{os.getpid()}-{uuid.uuid4().hex[:10]}"
    yield n
    for seg in _segments(n):
        if seg == n or seg[len(n)] in ".-":
            try:
                shmlimit.unlink(seg)
            except (FileNotFoundError, ValueError):
                pass


# ---- the run leaves nothing in /dev/shm ----------------------------------------------------------
# A segment is this run's when its name holds the run's pid as a word ("test-<pid>-...",
# "model-<pid>-...", "top-<pid>-..."): other runs on the machine, which create and remove their
# own segments meanwhile, are never counted.  Each one left is reported with the test that made it.
_THIS_RUN = re.compile(rf"(?:^|[-_.]){os.getpid()}(?:$|[-_.])")
_made_by = {}


def _this_runs_segments():
    return {n for n in _segments() if _THIS_RUN.search(n)}


@pytest.fixture(autouse=True)
def _segments_made(request):
    before = _this_runs_segments()
    yield
    for seg in _this_runs_segments() - before:
        _made_by.setdefault(seg, request.node.nodeid)


@pytest.fixture(scope="session", autouse=True)
def _leaves_nothing_in_dev_shm():
    before = _this_runs_segments()
    yield
    left = sorted(_this_runs_segments() - before)
    for seg in left:  # removed, so that a failed run does not fill /dev/shm either
        try:
            shmlimit.unlink(seg)
        except (FileNotFoundError, ValueError):
            pass
    assert not left, "the run left segments in /dev/shm: " + ", ".join(
        f"{seg} (made by {_made_by.get(seg, '?')})" for seg in left
    )


@pytest.fixture
def cleanup():
    """A list for the handles a test makes; after the test, each one still open is unlinked (if
    another handle of its name has not unlinked it already), then closed."""
    made = []
    yield made
    for lim in made:
        if not lim.closed:
            try:
                lim.unlink()
            except FileNotFoundError:
                pass
            lim.close()


def _redis():
    from support.redis_server import RedisServer, require

    require()
    server = RedisServer()
    server.start()
    return server


@pytest.fixture(scope="session")
def redis_server():
    """One real redis-server for the session (skipped, or failed under SHMLIMIT_REQUIRE_REDIS=1, without one)."""
    server = _redis()
    yield server
    server.stop()


@pytest.fixture
def own_redis():
    """A redis-server of the test's own, which the test may kill and restart."""
    server = _redis()
    yield server
    server.stop()


# ---- every test starts with the runner's own heap out of the way -------------------------------
# The test process runs filler threads of its own limiters, and late in a full run its heap is
# large: one full collection of it held the GIL for up to 0.6 s, long enough for a filler thread
# of this process to miss its lease renewals (50 ms).  The tests measure the limiter, not the
# runner's heap: what earlier tests left alive is collected once and then frozen (never scanned
# again), so a collection during a test scans only what that test allocated.
@pytest.fixture(autouse=True)
def _earlier_tests_heap_frozen():
    gc.collect()
    gc.freeze()
    yield


# ---- no test leaves a process or a filler thread behind ------------------------------------------
# Every process a test starts inherits this mark (through any number of forks and execs), so one
# that outlives its test is found even after it was orphaned and adopted by init.  A leftover busy
# process, or a filler thread of a limiter never closed, slows every later timing test of the run.
_RUN_MARK = "SHMLIMIT_TEST_RUN"
os.environ[_RUN_MARK] = uuid.uuid4().hex
_SESSION_HELPERS = (  # started once, each lives as long as the run
    "multiprocessing.resource_tracker",
    "multiprocessing.forkserver",
)


def _carrying_the_mark(mark):
    """The pids whose environment holds ``_RUN_MARK=mark``, read straight from /proc: a superset of
    the marked processes (psutil then checks each), found in a tenth of psutil's time -- this runs
    twice a test.  Every pid where there is no /proc."""
    try:
        entries = os.listdir("/proc")
    except OSError:
        return psutil.pids()
    needle = f"{_RUN_MARK}={mark}".encode()
    pids = []
    for entry in entries:
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if needle in f.read():
                        pids.append(int(entry))
            except OSError:
                continue  # gone, or not ours to read
    return pids


def _marked_processes():
    me, mark, uid = os.getpid(), os.environ[_RUN_MARK], os.getuid()
    found = {}
    for pid in _carrying_the_mark(mark):
        try:
            p = psutil.Process(pid)
            if pid == me or p.status() == psutil.STATUS_ZOMBIE or p.uids().real != uid:
                continue
            if p.environ().get(_RUN_MARK) == mark:
                found[pid] = " ".join(p.cmdline())
        except (psutil.Error, OSError):
            continue  # gone, or not ours to read
    return found


def _filler_threads():
    return {t for t in threading.enumerate() if t.name.startswith("shmlimit-filler-")}


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.when == "call":
        item.call_failed = (
            report.failed
        )  # a failed test's leftovers are cleaned, not reported twice
    return report


@pytest.fixture(autouse=True)
def _leaves_no_process_behind(request):
    processes, threads = _marked_processes(), _filler_threads()
    yield
    left = {
        pid: cmd
        for pid, cmd in _marked_processes().items()
        if pid not in processes and not any(h in cmd for h in _SESSION_HELPERS)
    }
    for pid in left:
        try:
            psutil.Process(pid).kill()  # so that one leak does not slow the rest of the run
        except psutil.Error:
            pass
    if getattr(request.node, "call_failed", True):
        return
    assert not left, f"the test left processes running: {left}"
    fillers = _filler_threads() - threads
    assert not fillers, (
        f"the test left limiters open (their filler threads run): {sorted(t.name for t in fillers)}"
    )
