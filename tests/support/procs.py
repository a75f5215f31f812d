"""Real processes for the tests: independent interpreters, the command line, a terminal.

Every interpreter runs outside the source tree (``WORKDIR``), so it imports
the installed package, as a user's program would.
"""

from __future__ import annotations

import json
import os
import pty
import signal
import struct
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from contextlib import contextmanager
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

WORKDIR = tempfile.gettempdir()
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CLI = [sys.executable, "-m", "shmlimit.cli.main"]


def wait_for(predicate: Callable[[], Any], timeout: float = 10.0, every: float = 0.005) -> Any:
    """Poll a condition until it holds (returning its value); fail after ``timeout`` seconds."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        v = predicate()
        if v:
            return v
        time.sleep(every)
    raise AssertionError("condition not reached in time")


@contextmanager
def interrupted_after(seconds: float) -> Iterator[None]:
    """A ``KeyboardInterrupt`` raised in this (main) thread after ``seconds``, as a user's Ctrl-C
    would be, unless the block ended first; the timer and the SIGALRM handler are restored on exit."""

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, seconds)
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """The ``shmlimit`` command, run to completion in a fresh interpreter."""
    return subprocess.run(
        [*CLI, *args], capture_output=True, text=True, timeout=timeout, cwd=WORKDIR
    )


#: Run in a fresh interpreter: each command line of ``argv[1]`` (JSON) through the ``shmlimit``
#: command's ``main``, its output and exit status captured as the command's would be; printed as
#: JSON, one ``[status, stdout, stderr]`` each.
_CLI_EACH = textwrap.dedent(
    """
    import contextlib, io, json, sys, traceback
    from shmlimit.cli.main import main

    said = []
    for argv in json.loads(sys.argv[1]):
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                status = main(argv)
            except SystemExit as e:  # argparse's: as the command would exit
                status = e.code if isinstance(e.code, int) else int(e.code is not None)
            except BaseException:  # what the interpreter would print, and its status
                traceback.print_exc()
                status = 1
        said.append([status, out.getvalue(), err.getvalue()])
    print(json.dumps(said))
    """
)


def run_cli_each(
    argvs: Sequence[Sequence[str]], timeout: float = 120
) -> List[subprocess.CompletedProcess]:
    """Each ``shmlimit`` command line of ``argvs``, one after another in one fresh interpreter:
    what ``run_cli`` gives for each (status, output, a traceback in stderr), at the cost of one
    interpreter's start; ``timeout`` is for them all."""
    r = subprocess.run(
        [sys.executable, "-c", _CLI_EACH, json.dumps([list(a) for a in argvs])],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=WORKDIR,
    )
    assert r.returncode == 0, r.stderr
    said = json.loads(r.stdout.splitlines()[-1])
    return [
        subprocess.CompletedProcess([*CLI, *argv], status, out, err)
        for argv, (status, out, err) in zip(argvs, said)
    ]


# ---- forked (or spawned) workers that report one result each ------------------------------------


def run_processes(
    ctx: Any, target: Callable[..., None], argss: Sequence[Tuple[Any, ...]], timeout: float = 120.0
) -> List[Any]:
    """One process of ``ctx`` (a multiprocessing context) per ``args`` in ``argss``, running
    ``target(*args, q)``, which puts one result on the queue ``q``; the results, in the order they
    came.  Every process is joined, and killed if it outlives its result by 30 s, even on failure."""
    q = ctx.Queue()
    procs = [ctx.Process(target=target, args=(*args, q)) for args in argss]
    try:
        for p in procs:
            p.start()
        return [q.get(timeout=timeout) for _ in procs]
    finally:
        for p in procs:
            if p.pid is None:  # never started
                continue
            p.join(30)
            if p.is_alive():
                p.kill()
                p.join()


def kill_all(pids: Sequence[int]) -> None:
    """SIGKILL and reap every forked child in ``pids`` (those already gone are skipped)."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:
            pass


def read_exactly(fd: int, n: int) -> bytes:
    """``n`` bytes from the pipe ``fd`` (a forked worker's answer); fails if the writer died first."""
    got = b""
    while len(got) < n:
        chunk = os.read(fd, n - len(got))
        assert chunk, "a worker died before answering"
        got += chunk
    return got


def stamp_until(
    acquire: Callable[[], object], end: float, clock: Callable[[], Any] = time.monotonic
) -> List[Any]:
    """Call ``acquire`` until ``clock`` passes ``end``; the clock read just after each grant (the
    grant that returned after ``end`` is not kept).  The evidence ``windows.max_excess`` judges."""
    stamps = []
    while True:
        acquire()
        t = clock()
        if t > end:
            return stamps
        stamps.append(t)


#: The ways a worker may call: ``take_in_mode``'s modes.
MODES = ("try", "timed", "untimed")


def take_in_mode(lim: Any, mode: str, *key: str, **costs: int) -> bool:
    """One call as a worker of ``mode`` makes it (``key``: a keyed limiter's): "try" (a refusal naps
    1 ms: a caller that polls), "timed" (50 ms at most) or "untimed"; whether it was granted."""
    if mode == "try":
        ok = lim.try_acquire(*key, **costs)
        if not ok:
            time.sleep(0.001)
        return ok
    if mode == "timed":
        return lim.acquire(*key, timeout=0.05, **costs)
    assert mode == "untimed", mode
    return lim.acquire(*key, **costs)


def acquire_for(acquire: Callable[[], object], seconds: float) -> int:
    """Call ``acquire`` until ``seconds`` have passed on the monotonic clock; how many calls returned."""
    grants = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        acquire()
        grants += 1
    return grants


# ---- workers that acquire for a while and report their grant times ---------------------------

# Prints its stamps on one line, then on a second line how long its threads waited runnable for a
# CPU meanwhile (the starvation witness; null where the kernel does not say).
WORKER = textwrap.dedent(
    """
    import json, sys, time
    import shmlimit
    sys.path.insert(0, sys.argv[3])  # the tests' folder, for support.procs (shmlimit stays the installed one)
    from support.procs import stamp_until
    from support.starvation import run_delay
    lim = shmlimit.attach(sys.argv[1])
    seconds = float(sys.argv[2])
    print("ready", flush=True)
    sys.stdin.readline()  # go
    delay0 = run_delay()
    stamps = stamp_until(lim.acquire, time.monotonic() + seconds)
    delay1 = run_delay()
    print(json.dumps(stamps), flush=True)
    print(json.dumps(None if delay0 is None or delay1 is None else delay1 - delay0), flush=True)
    """
)
#: WORKER's line that makes its limiter: ``configured`` replaces it.
ATTACH = "lim = shmlimit.attach(sys.argv[1])"
TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def configured(
    script: str,
    gname: str,
    url: str,
    rate: float,
    burst: Any = None,
    redis_timeout: Optional[float] = None,
    **options: Any,
) -> str:
    """``script`` (WORKER or a variant) whose process configures the hierarchical limiter itself
    (argv[1] is the host's name), leasing from the RedisLimiter ``gname`` at ``url`` (with the
    client timeout ``redis_timeout``, seconds, when given).

    Only a process that configured the upstream feeds the bucket from Redis:
    one that merely attaches by name never connects anywhere.
    """
    assert ATTACH in script
    timeout = "" if redis_timeout is None else f", timeout={redis_timeout!r}"
    make = (
        f"from shmlimit.redis.direct import RedisLimiter\n"
        f"lim = shmlimit.Limiter(sys.argv[1], upstream=RedisLimiter({gname!r}, rate={rate}, burst={burst}, "
        f"url={url!r}{timeout}), **{options!r})"
    )
    return script.replace(ATTACH, make)


def start_workers(
    name: str, count: int, seconds: float, script: str = WORKER
) -> List[subprocess.Popen]:
    """``count`` interpreters running ``script`` (argv: name, seconds, the tests' folder), each once it printed "ready"."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script, name, str(seconds), TESTS],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=WORKDIR,
        )
        for _ in range(count)
    ]
    for p in procs:
        assert p.stdout.readline().strip() == "ready"
    return procs


def go(procs: Sequence[subprocess.Popen]) -> None:
    """Start the workers' clocks."""
    for p in procs:
        p.stdin.write("\n")
        p.stdin.flush()


def collect(procs: Sequence[subprocess.Popen]) -> List[List[float]]:
    """Each worker's grant times (monotonic seconds), once it finished."""
    return collect_witnessed(procs)[0]


def collect_witnessed(
    procs: Sequence[subprocess.Popen],
) -> Tuple[List[List[float]], List[Optional[float]]]:
    """Each WORKER's grant times, and the seconds its threads waited runnable for a CPU
    meanwhile (``support.starvation``; None where unknown, or for another script)."""
    out, delays = [], []
    for p in procs:
        line = p.stdout.readline()
        witness = p.stdout.readline()
        p.wait(30)
        out.append(json.loads(line))
        delays.append(json.loads(witness) if witness.strip() else None)
    return out, delays


# ---- processes that acquire forever, or only stay attached -------------------------------------

ACQUIRER = """
import sys, shmlimit
lim = shmlimit.attach(sys.argv[1])
print("ready", flush=True)
while True:
    lim.acquire()
"""

IDLE = """
import sys, shmlimit
lim = shmlimit.attach(sys.argv[1])
lim.retry_after()  # a first use, taking nothing: the process's filler thread starts
print("ready", flush=True)
sys.stdin.readline()
"""


def start_acquirer(name: str) -> subprocess.Popen:
    """An interpreter attached to ``name``, acquiring forever (kill it when done)."""
    p = subprocess.Popen(
        [sys.executable, "-c", ACQUIRER, name], stdout=subprocess.PIPE, text=True, cwd=WORKDIR
    )
    assert p.stdout.readline().strip() == "ready"
    return p


def start_idle(name: str) -> subprocess.Popen:
    """An interpreter attached to ``name`` doing nothing (its filler thread runs) until a line on its stdin."""
    p = subprocess.Popen(
        [sys.executable, "-c", IDLE, name],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=WORKDIR,
    )
    assert p.stdout.readline().strip() == "ready"
    return p


# ---- workers that survive being killed with what they recorded ----------------------------------

# Each grant's stamp goes to the kernel with one unbuffered write, just after acquire() returns,
# so a worker killed at any instant has recorded every grant but (at most) the one in flight.
STAMPER = r"""
import os, struct, sys, time
import shmlimit
lim = shmlimit.attach(sys.argv[1])
fd = os.open(sys.argv[2], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
sys.stdout.write("ready\n"); sys.stdout.flush()
while True:
    lim.acquire()
    os.write(fd, struct.pack("<q", time.monotonic_ns()))
"""


class Stampers:
    """A changing set of STAMPER workers on one limiter; their stamps survive their deaths."""

    def __init__(self, name: str, script: str = STAMPER) -> None:
        self.name = name
        self.script = script  # STAMPER, or a variant that attaches another way
        self.dir = tempfile.mkdtemp(prefix="shmlimit-test-")
        self.procs: Dict[int, Tuple[subprocess.Popen, str]] = {}  # pid -> (process, its file)

    def start(self) -> subprocess.Popen:
        path = os.path.join(self.dir, f"{uuid.uuid4().hex}.bin")
        p = subprocess.Popen(
            [sys.executable, "-c", self.script, self.name, path],
            stdout=subprocess.PIPE,
            text=True,
            cwd=WORKDIR,
        )
        assert p.stdout.readline().strip() == "ready"
        self.procs[p.pid] = (p, path)
        return p

    def kill(self, pid: int) -> None:
        p, _ = self.procs[pid]
        p.kill()
        p.wait()

    def live(self) -> List[int]:
        """The pids of the workers still running."""
        return [pid for pid, (p, _) in self.procs.items() if p.poll() is None]

    def stop_all(self) -> None:
        for p, _ in self.procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()

    def results(self) -> List[List[float]]:
        """Per-worker lists of stamps (monotonic seconds), in order."""
        out = []
        for _, path in self.procs.values():
            with open(path, "rb") as f:
                data = f.read()
            out.append([v / 1e9 for (v,) in struct.iter_unpack("<q", data[: len(data) // 8 * 8])])
        return out


# ---- a program on a pseudo-terminal -------------------------------------------------------------


def start_on_terminal(argv: Sequence[str]) -> Tuple[int, int]:
    """Run ``argv`` on a new pseudo-terminal; return (pid, the terminal's master fd).

    The child gets SIGINT's default disposition back before it runs the
    program.  A test run started with SIGINT ignored (``nohup``, or a
    background job of a non-interactive shell) would otherwise hand that on
    through fork and exec, Python would keep it ignored, and the program
    could never be interrupted the way a user at a terminal interrupts it.
    """
    pid, fd = pty.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.chdir(WORKDIR)
            os.execv(argv[0], list(argv))
        finally:
            os._exit(127)
    return pid, fd


def wait_exit(pid: int, timeout: float) -> int:
    """The wait status of child ``pid``; killed (and the test failed) if it is still running after ``timeout``."""
    end = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status
        if time.monotonic() > end:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise AssertionError(f"process {pid} did not exit within {timeout} s")
        time.sleep(0.01)  # polling a child's exit: nothing else to block on with a deadline
