"""What another local user can plant under a limiter's name in /dev/shm: a FIFO, a symlink, a
directory, a device.  Every tool and every constructor refuses it or skips it at once.

The tools run in a fresh interpreter with a timeout, one after another: before every open went
through one non-blocking, no-follow opener, a FIFO hung them all (the magic peek waited for a
writer).
"""

import json
import os
import stat
import subprocess
import sys
import textwrap

import pytest
from support.procs import WORKDIR, run_cli_each
from support.segments import captured, shm_path, unique_name

import shmlimit

# run once in CI: names each backend it checks
pytestmark = pytest.mark.backend_independent

#: Seconds the tools may take, all of them, on a machine shared with other test runs; a hang never
#: ends.
TIMEOUT = 30
KINDS = ["fifo", "symlink", "directory", "device"]
BACKENDS = ["native", "atomics"]


@pytest.fixture
def planted(request, tmp_path):
    """A FIFO, a symlink (to a FIFO elsewhere) a directory or a character device (root only)
    under a fresh limiter name, removed afterwards: ``(name, what the refusal says)``."""
    kind = request.param
    name = unique_name("planted")
    path = shm_path(name)
    if kind == "fifo":
        os.mkfifo(path, 0o600)
    elif kind == "symlink":  # followed, it would lead to a FIFO
        os.mkfifo(tmp_path / "fifo")
        os.symlink(tmp_path / "fifo", path)
    elif kind == "directory":
        os.mkdir(path, 0o700)
    else:
        if os.geteuid() != 0:
            pytest.skip("making a device node needs root")
        os.mknod(path, stat.S_IFCHR | 0o600, os.makedev(1, 3))  # the null device's numbers
    what = {"fifo": "a FIFO", "symlink": "a symbolic link", "directory": "a directory"}
    refusal = f"not a regular file: {what.get(kind, 'a device')}"
    yield name, refusal
    (os.rmdir if kind == "directory" else os.unlink)(path)


@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch):
    monkeypatch.setenv("SHMLIMIT_BACKEND", request.param)
    return request.param


def _no_traceback(r):
    assert "Traceback" not in r.stderr, r.stderr


@pytest.mark.parametrize("planted", KINDS, indirect=True)
def test_the_tools_skip_a_planted_file_at_once(planted, backend):
    name, refusal = planted
    # gc only looks (--dry-run): a real gc here could remove another test run's idle segment
    listing = (["list"], ["gc", "--dry-run"])
    # top samples twice, an interval apart (the rates): each sample skips the planted file
    as_json = (["list", "--json"], ["top", "--once", "--json", "--interval", "0.01"])
    named = (["inspect", name], ["top", "--once", name])  # named: a user error, one line
    runs = iter(
        run_cli_each([*listing, *as_json, *named, ["metrics"], ["doctor", "--json"]], TIMEOUT)
    )
    for args in listing:
        r = next(runs)
        _no_traceback(r)
        assert r.returncode == 0, (args, r.stderr)
        said = [ln for ln in r.stdout.splitlines() if name in ln]
        assert said and refusal in said[0], (args, r.stdout)
    for args in as_json:
        r = next(runs)
        _no_traceback(r)
        entries = json.loads(r.stdout.splitlines()[-1])
        entries = entries["limiters"] if isinstance(entries, dict) else entries
        mine = [e for e in entries if e["name"] == name]
        assert len(mine) == 1 and set(mine[0]) == {"name", "error"}, (args, mine)
        assert refusal in mine[0]["error"], (args, mine)
    for args in named:
        r = next(runs)
        _no_traceback(r)
        assert r.returncode == 2 and refusal in r.stderr and len(r.stderr.splitlines()) == 1
    r = next(runs)
    _no_traceback(r)
    assert r.returncode == 0 and f'limiter="{name}"' not in r.stdout
    r = next(runs)
    _no_traceback(r)
    # listed among the segments it cannot read (the text names the first five of them)
    assert r.returncode in (0, 1) and any(name in f["names"] for f in json.loads(r.stdout))


# Every way a program opens a name, each in a fresh interpreter: what each raised (or "ok").
_OPENERS = textwrap.dedent(
    """
    import json, sys
    import shmlimit
    from shmlimit.cli.metrics import snapshots
    from shmlimit.keyed.window_table import WindowTable

    name = sys.argv[1]
    calls = {
        "attach": lambda: shmlimit.attach(name),
        "inspect": lambda: shmlimit.inspect(name),
        "Limiter": lambda: shmlimit.Limiter(name, rate=5),
        "Limiter attach": lambda: shmlimit.Limiter(name),
        "KeyedLimiter": lambda: shmlimit.KeyedLimiter(name, rate=5),
        "KeyedLimiter attach": lambda: shmlimit.KeyedLimiter(name),
        "WindowTable": lambda: WindowTable(name, keys=64),
        "metrics": lambda: snapshots([name]),
    }
    out = {}
    for what, call in calls.items():
        try:
            got = call()
            out[what] = ["ok", repr(got)]
        except Exception as e:
            out[what] = [type(e).__name__, str(e)]
    print(json.dumps(out))
    """
)


@pytest.mark.parametrize("planted", KINDS, indirect=True)
def test_every_opener_refuses_a_planted_file_at_once(planted, backend):
    name, refusal = planted
    r = subprocess.run(
        [sys.executable, "-c", _OPENERS, name],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        cwd=WORKDIR,
    )
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    metrics = out.pop("metrics")
    assert metrics[0] == "ok" and metrics[1] == f"([], [{name!r}])"  # counted unreadable
    for what, (kind, message) in out.items():
        assert kind == "SegmentError" and refusal in message and name in message, (what, message)
    assert os.path.lexists(shm_path(name))  # refused, never removed or replaced


def test_doctor_counts_only_regular_files_as_limiters(tmp_path):
    from shmlimit.cli import doctor

    shm = tmp_path / "shm"
    shm.mkdir()
    big = tmp_path / "elsewhere"
    with open(big, "wb") as f:
        f.truncate(1 << 30)  # sparse: 1 GiB its pages would claim, if it were counted
    os.symlink(big, shm / "shmlimit.link")
    os.mkfifo(shm / "shmlimit.fifo")
    (shm / "shmlimit.dir").mkdir()
    real = captured(lambda n: shmlimit.Limiter(n, rate=1))
    with open(shm / "shmlimit.real", "wb") as f:
        f.write(real)
    assert doctor.segments_need(str(shm)) == (1, 0)
