"""Another local user against a limiter that is not theirs, and hostile files against the tools.

Tests run as root; "the other user" is ``nobody`` (a forked child that drops to it, or a file
chowned to it).  Tests that put odd files in /dev/shm, or fill it, do so in a private mount
namespace with a tmpfs of its own, so no real segment (and no other test) ever sees them.
"""

import contextlib
import json
import os
import pwd
import signal
import subprocess
import sys
import textwrap
import time
import uuid

import psutil
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import shmlimit
from shmlimit import header
from shmlimit.cli.top import printable
from shmlimit.keyed.window_table import WindowTable
from shmlimit.shm import layout as L

ROOT = os.geteuid() == 0
needs_root = pytest.mark.skipif(not ROOT, reason="playing another user needs root")


def _nobody():
    try:
        return pwd.getpwnam("nobody")
    except KeyError:  # pragma: no cover
        pytest.skip("no user 'nobody' on this machine")


def _path(name):
    return f"/dev/shm/shmlimit.{name}"


def _as_nobody(fn, *args):
    """Run fn(*args) in a forked child that became nobody; return its exit status."""
    nobody = _nobody()
    return _as_user(nobody.pw_uid, nobody.pw_gid, fn, *args)


def _as_user(uid, gid, fn, *args):
    """Run fn(*args) in a forked child that became ``uid``; return its exit status."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            # imported while still root: the interpreter's own files may not be readable by nobody
            from shmlimit.shm.cells import warm_backend

            warm_backend()
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
            fn(*args)
            code = 0
        except BaseException:
            import traceback

            traceback.print_exc()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def _private_shm(script, size="4m", timeout=60):
    """Run a Python script in a private mount namespace whose /dev/shm is a fresh tmpfs."""
    if not ROOT:
        pytest.skip("a private mount namespace needs root")
    body = textwrap.dedent(script)
    cmd = [
        "unshare",
        "-m",
        "--propagation",
        "private",
        "sh",
        "-c",
        f'mount -t tmpfs -o size={size} tmpfs /dev/shm && exec "$0" -c "$1"',
        sys.executable,
        body,
    ]
    env = dict(
        os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(shmlimit.__file__)))
    )
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


# ---- finding 1: name squatting --------------------------------------------------------------


def _squat(name):
    shmlimit.Limiter(name, rate=5, mode=0o666).close()  # the victim's config, writable by all


@needs_root
def test_a_segment_squatted_by_another_user_is_refused_naming_owner_and_mode(name):
    nobody = _nobody()
    assert _as_nobody(_squat, name) == 0
    assert os.stat(_path(name)).st_uid == nobody.pw_uid
    with pytest.raises(shmlimit.UntrustedSegmentError) as e:
        shmlimit.Limiter(name, rate=5)  # create-or-attach: must not silently join it
    msg = str(e.value)
    assert f"uid {nobody.pw_uid}" in msg and "0o666" in msg and name in msg
    assert isinstance(e.value, PermissionError) and e.value.owner == nobody.pw_uid
    with pytest.raises(shmlimit.UntrustedSegmentError):
        shmlimit.attach(name)
    # trusting the owner is not enough while the segment is writable by everyone ...
    with pytest.raises(shmlimit.UntrustedSegmentError, match="writable by group and others"):
        shmlimit.attach(name, trusted_uids=[nobody.pw_uid])
    # ... asking for that mode as well is an explicit decision
    lim = shmlimit.attach(name, mode=0o666, trusted_uids=[nobody.pw_uid])
    assert lim.rate == 5
    # a second handle in this process is vetted with its own call's trust
    with pytest.raises(shmlimit.UntrustedSegmentError):
        shmlimit.attach(name)
    lim.close()


def test_own_segment_writable_beyond_the_mode_asked_for_is_refused(name):
    shmlimit.Limiter(name, rate=5, mode=0o602).close()
    with pytest.raises(shmlimit.UntrustedSegmentError, match="writable by others"):
        shmlimit.Limiter(name, rate=5)
    shmlimit.Limiter(name, rate=5, mode=0o602).close()  # asked for: accepted


def test_trusted_uids_is_checked():
    with pytest.raises(ValueError, match="trusted_uids"):
        shmlimit.attach("x", trusted_uids=[-1])
    with pytest.raises(TypeError, match="trusted_uids"):
        shmlimit.attach("x", trusted_uids=0)


def _pickled_handle_works(payload, q_path):
    import pickle

    lim = pickle.loads(payload)
    with open(q_path, "w") as f:
        f.write(str(lim.rate))


def test_a_pickled_handle_carries_its_trust(name, tmp_path):
    import pickle

    lim = shmlimit.Limiter(name, rate=7, mode=0o660)
    payload = pickle.dumps(lim)
    lim.close()
    # a fresh interpreter unpickles it with the same mode: the group bit is accepted
    out = tmp_path / "rate"
    code = subprocess.run(
        [
            sys.executable,
            "-c",
            "import pickle,sys; l=pickle.loads(sys.stdin.buffer.read()); open(sys.argv[1],'w').write(str(l.rate)); l.close()",
            str(out),
        ],
        input=payload,
        timeout=60,
    ).returncode
    assert code == 0 and out.read_text() == "7.0"


#: Every kind of handle, created shared with a group and trusting a uid: (kind, make(name)).
_SHARED = {
    "Limiter": lambda name, **kw: shmlimit.Limiter(name, rate=7, **kw),
    "Limiter(rates=)": lambda name, **kw: shmlimit.Limiter(name, rates=["7/s", "70/min"], **kw),
    "KeyedLimiter": lambda name, **kw: shmlimit.KeyedLimiter(name, rate=7, keys=64, **kw),
    "KeyedLimiter(rates=)": lambda name, **kw: shmlimit.KeyedLimiter(
        name, rates=["7/s", "70/min"], keys=64, **kw
    ),
    "WindowTable": lambda name, **kw: WindowTable(name, keys=64, moving_keys=0, **kw),
}


@pytest.mark.parametrize("kind", sorted(_SHARED))
def test_every_kind_of_handle_pickles_with_its_trust(kind, name):
    """A handle unpickled is vetted as its sender's was: a segment created with mode=0o660 is not
    refused as writable by group beyond the default mode (a pool worker would die of it)."""
    import pickle

    lim = _SHARED[kind](name, mode=0o660, trusted_uids=[4242])
    copy = pickle.loads(pickle.dumps(lim))
    try:
        assert type(copy) is type(lim)
        assert (copy._mode, copy._trusted) == (0o660, frozenset({4242}))
    finally:
        copy.close()
        lim.close()


@needs_root
def test_every_kind_of_handle_unpickled_trusts_its_owner(name):
    """Another process unpickles a handle on a segment another user (uid 4242) owns, shared with
    its group: it is accepted because the sender trusted that uid."""
    import pickle

    made = [
        make(f"{name}-{i}", mode=0o660, trusted_uids=[4242])
        for i, make in enumerate(_SHARED[k] for k in sorted(_SHARED))
    ]
    payload = pickle.dumps(made)
    for lim in made:
        lim.close()
        os.chown(_path(lim.name), 4242, -1)
    code = (
        "import pickle, sys\n"
        "for h in pickle.loads(sys.stdin.buffer.read()):\n"
        "    print(type(h).__name__)\n"
        "    h.close()\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], input=payload, capture_output=True, timeout=60
    )
    assert out.returncode == 0, out.stderr.decode()[-2000:]
    kinds = ["Limiter", "MultiLimiter", "KeyedLimiter", "MultiKeyedLimiter", "WindowTable"]
    assert sorted(out.stdout.decode().split()) == sorted(kinds)


# ---- finding 2: SIGBUS ---------------------------------------------------------------------


def test_creating_on_a_full_dev_shm_raises_instead_of_crashing():
    r = _private_shm(
        """
        import errno, shmlimit
        with open("/dev/shm/filler", "wb") as f:
            f.write(b"x" * 12288)
        try:
            shmlimit.Limiter("full", rate=5)  # 9216 bytes; 4096 left
        except shmlimit.SharedMemoryFullError as e:
            assert e.errno == errno.ENOSPC and "full" in str(e), e
            import os
            assert not os.path.exists("/dev/shm/shmlimit.full"), "the name must be given back"
            print("refused:", e)
        else:
            print("created")
        """,
        size="16k",
    )
    assert r.returncode == 0, (r.returncode, r.stderr)  # today: -7 (SIGBUS)
    assert r.stdout.startswith("refused:") and "no room" in r.stdout


@pytest.mark.slow
def test_inspect_and_list_survive_a_segment_truncated_under_them():
    # A writer keeps truncating and regrowing the segment while `list --json` and inspect run:
    # a mapping would fault (SIGBUS) on the pages that vanished.
    r = _private_shm(
        """
        import os, subprocess, sys, time, shmlimit
        from shmlimit.cli import main as cli
        shmlimit.Limiter("victim", rate=1000).close()
        path = "/dev/shm/shmlimit.victim"
        size = os.path.getsize(path)
        pid = os.fork()
        if pid == 0:
            fd = os.open(path, os.O_RDWR)
            end = time.monotonic() + 1.5
            while time.monotonic() < end:
                os.ftruncate(fd, 64)
                os.ftruncate(fd, size)
            os._exit(0)
        end = time.monotonic() + 1.0
        n = 0
        while time.monotonic() < end:
            try:
                shmlimit.inspect("victim")
            except shmlimit.ShmlimitError:
                pass
            cli.main(["list", "--json"])
            n += 1
        os.waitpid(pid, 0)
        print("survived", n, file=sys.stderr)
        """
    )
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])  # today: -7 (SIGBUS)
    assert "survived" in r.stderr


def test_a_header_claiming_more_than_the_file_is_refused_before_mapping(name):
    shmlimit.Limiter(name, rate=10).close()
    size = os.path.getsize(_path(name))
    os.truncate(_path(name), size - L.LINE)
    for call in (shmlimit.inspect, shmlimit.attach):
        with pytest.raises(shmlimit.SegmentError, match="truncated"):
            call(name)


# ---- finding 3: hostile files stop the tools ---------------------------------------------------


def test_a_badly_named_entry_is_skipped_and_reported_and_gc_goes_on():
    r = _private_shm(
        """
        import json, os, subprocess, sys
        open("/dev/shm/shmlimit.-x", "w").close()
        open("/dev/shm/shmlimit.\\x1b[2Jbad", "w").close()
        # a stale limiter, listed after the bad entries: its creator has exited
        subprocess.run([sys.executable, "-c", "import shmlimit; shmlimit.Limiter('stale', rate=5)"], check=True)
        def cli(*args):
            return subprocess.run([sys.executable, "-m", "shmlimit.cli.main", *args], capture_output=True, text=True)
        ls = cli("list")
        js = cli("list", "--json")
        top = cli("top", "--once", "--interval", "0.01")
        gc = cli("gc")
        print(json.dumps({k: [v.returncode, v.stdout, v.stderr] for k, v in
                          dict(ls=ls, js=js, top=top, gc=gc).items()}))
        print(json.dumps(sorted(os.listdir("/dev/shm"))))
        """
    )
    assert r.returncode == 0, r.stderr
    out, left = (json.loads(line) for line in r.stdout.splitlines()[-2:])
    for k, (code, stdout, stderr) in out.items():
        assert code == 0, (k, stdout, stderr)  # today: 2, "name must be ..."
        assert "\x1b" not in stdout
    assert "'-x': not a valid limiter name" in out["ls"][1] and "stale" in out["ls"][1]
    assert {"name": "-x", "error": "not a valid limiter name: skipped"} in json.loads(out["js"][1])
    # top's table: a row for it, marked unreadable, and the rest of the table after it
    assert any(
        line.split()[:1] == ["-x"] and "UNREADABLE" in line for line in out["top"][1].splitlines()
    )
    assert "removed: stale" in out["gc"][1] and "left alone" in out["gc"][1]
    assert "shmlimit.stale" not in left and "shmlimit.-x" in left


_TEMPLATE = []


def _upstream_template():
    """The bytes of a real hierarchical segment (its Redis is never reached), and its description."""
    if not _TEMPLATE:
        tname = f"test-tmpl-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        shmlimit.Limiter(tname, rate=10, upstream="redis://127.0.0.1:1/0").close()
        with open(_path(tname), "rb") as f:
            data = f.read()
        shmlimit.unlink(tname)
        n = int.from_bytes(data[L.UP_DESC_LEN : L.UP_DESC_LEN + 8], "little")
        _TEMPLATE.append((data, json.loads(data[L.UP_DESC : L.UP_DESC + n])))
    return _TEMPLATE[0]


def _desc():
    """A fresh copy of the valid stored description (whatever its format)."""
    return json.loads(json.dumps(_upstream_template()[1]))


def _upstream_segment(name, desc_bytes):
    """A hierarchical segment whose stored upstream description is ``desc_bytes``."""
    data = bytearray(_upstream_template()[0])
    data[L.UP_DESC_LEN : L.UP_DESC_LEN + 8] = len(desc_bytes).to_bytes(8, "little")
    data[L.UP_DESC : L.UP_DESC + L.UP_DESC_MAX] = desc_bytes[: L.UP_DESC_MAX].ljust(
        L.UP_DESC_MAX, b"\0"
    )
    fd = os.open(_path(name), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def _with(**changes):
    d = _desc()
    for k, v in changes.items():
        if v is _DROP:
            d.pop(k, None)
        else:
            d[k] = v
    return d


_DROP = object()


@pytest.mark.parametrize(
    "make",
    [
        lambda: {"redis": {"url": 1}},
        lambda: _with(on_error=_DROP),
        lambda: _with(lease_ttl="0.1"),
        lambda: _with(on_error="sometimes"),
        lambda: _with(rate=float("nan")),
        lambda: _with(url=1),
        lambda: _with(evil=1),
        lambda: [1, 2],
    ],
    ids=[
        "old-format",
        "no-on_error",
        "ttl-str",
        "on_error-bad",
        "rate-nan",
        "url-int",
        "unknown",
        "list",
    ],
)
def test_an_invalid_stored_upstream_description_is_a_segment_error(name, make):
    _upstream_segment(name, json.dumps(make()).encode())
    for call in (shmlimit.inspect, shmlimit.attach):
        with pytest.raises(shmlimit.SegmentError, match="upstream description"):
            call(name)


def test_a_valid_stored_upstream_description_is_accepted(name):
    _upstream_segment(name, json.dumps(_desc()).encode())
    s = shmlimit.inspect(name)
    assert s.upstream is not None and s.upstream.on_redis_error == "closed"


def _refresh_ctime(path, stop_at):
    end = time.monotonic() + stop_at
    while time.monotonic() < end:
        os.chmod(path, 0o600)  # a chmod moves the ctime forward
        time.sleep(0.2)


@pytest.mark.slow
def test_an_empty_file_with_a_refreshed_ctime_does_not_stall_an_opener(name):
    path = _path(name)
    os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600))
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child keeps the ctime young
        try:
            _refresh_ctime(path, 20)
        finally:
            os._exit(0)
    try:
        t0 = time.monotonic()
        with pytest.raises(shmlimit.SegmentError, match="never initialised"):
            shmlimit.attach(name)
        waited = time.monotonic() - t0
        # INIT_WAIT by the monotonic clock (today: forever); the margin is for a loaded machine
        assert waited < header.INIT_WAIT + 5
        t0 = time.monotonic()
        with pytest.raises(shmlimit.SegmentError):
            shmlimit.inspect(name)  # the tools never wait
        assert time.monotonic() - t0 < 1
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


@needs_root
@pytest.mark.slow
def test_a_forged_header_with_a_live_creator_costs_no_wait(name):
    nobody = _nobody()
    path = _path(name)
    size = L.segment_size(L.DEFAULT_SLOTS)
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o644)
    try:
        # STATE=0 (initialising), CREATOR_PID=1: a creator that is always alive
        os.write(fd, (0).to_bytes(8, "little") * 5 + (1).to_bytes(8, "little") + bytes(size - 48))
        os.fchown(fd, nobody.pw_uid, nobody.pw_gid)
    finally:
        os.close(fd)
    t0 = time.monotonic()
    with pytest.raises(shmlimit.UntrustedSegmentError):
        shmlimit.Limiter(name, rate=5)
    with pytest.raises(shmlimit.SegmentError, match="still being initialised"):
        shmlimit.inspect(name)
    assert time.monotonic() - t0 < 2  # today: 30 s for each open
    from shmlimit.cli import main as cli

    assert cli.main(["gc", "--dry-run"]) == 0
    assert time.monotonic() - t0 < 5


# ---- finding 7: PID namespaces ----------------------------------------------------------------


@contextlib.contextmanager
def _in_a_pid_namespace(code):
    """``code`` run in a PID namespace of its own, and its own /proc, as in a container (there it
    is pid 1, with its own start time), once it printed "ready"; killed at the end."""
    p = subprocess.Popen(
        ["unshare", "--pid", "--fork", "--kill-child", "--mount-proc", sys.executable, "-c", code],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert p.stdout.readline().strip() == "ready"
        yield
    finally:
        # unshare, and the namespace's pid 1, which --kill-child kills as unshare dies: after
        # unshare's end, not with it (on a busy machine it still ran when unshare was reaped)
        inside = psutil.Process(p.pid).children()
        p.kill()
        p.wait(30)
        psutil.wait_procs(inside, timeout=30)


@needs_root
def test_a_process_in_another_pid_namespace_counts_as_alive(name, capsys):
    shmlimit.Limiter(name, rate=100).close()
    code = f"import shmlimit,sys,time; l=shmlimit.attach({name!r}); print('ready', flush=True); time.sleep(60)"
    with _in_a_pid_namespace(code):
        procs = shmlimit.inspect(name).processes
        assert len(procs) == 1 and procs[0].pid == 1  # its pid in its own namespace
        assert procs[0].alive  # today: pid 1 here is another process, so "dead"
        from shmlimit.cli import main as cli

        # (a dry run: a real gc here would collect other tests' idle segments too)
        assert cli.main(["gc", "--dry-run"]) == 0
        assert f"stale: {name}\n" not in capsys.readouterr().out  # today: listed, and gc removes it
        assert name in shmlimit.list_names()
        # and its slot is not reclaimed by a process of this namespace
        lim = shmlimit.attach(name)
        assert len(shmlimit.inspect(name).processes) == 2
        lim.close()


@needs_root
def test_a_keyed_tables_process_in_another_pid_namespace_counts_as_alive(name, capsys):
    """A keyed table's snapshot judges its processes as every other reader does (``slot_alive``):
    it asked ``is_alive`` without the namespace, so a live user in a container read "dead" in
    ``list`` and ``top``, and ``gc --dry-run`` called the table stale (``gc`` itself, judging by
    the namespace, kept it)."""
    shmlimit.KeyedLimiter(name, rate=100).close()
    code = (
        f"import shmlimit,time; l=shmlimit.attach({name!r}); l.try_acquire('k'); "
        "print('ready', flush=True); time.sleep(60)"
    )
    with _in_a_pid_namespace(code):
        procs = shmlimit.inspect(name).processes
        assert len(procs) == 1 and procs[0].pid == 1  # its pid in its own namespace
        assert procs[0].alive
        from shmlimit.cli import main as cli

        assert cli.main(["gc", "--dry-run"]) == 0
        assert f"stale: {name}\n" not in capsys.readouterr().out


# ---- finding 8: terminal escapes ------------------------------------------------------------


ESC = "\x1b]0;owned\x07\x1b[2J"


def test_top_escapes_control_characters_from_segments_and_process_names(name, tmp_path):
    # a segment whose error message carries escapes (an unknown field named with them) ...
    bad = f"{name}-bad"
    _upstream_segment(bad, json.dumps(_with(**{ESC: 1})).encode())
    # ... and a process whose command name carries them, attached to a good one
    shmlimit.Limiter(name, rate=10).close()
    # a process whose command name carries escapes, attached to it
    code = (
        "import shmlimit,time; open('/proc/self/comm','w').write('x\\x1b[2Jy');"
        f"l=shmlimit.attach({name!r}); print('ready', flush=True); time.sleep(60)"
    )
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "ready"
        # the detailed view of each: the bad one's error (a named limiter unreadable: exit 2), and
        # the good one's processes with their commands
        bad_r, r = (
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "shmlimit.cli.main",
                    "top",
                    "--once",
                    "--interval",
                    "0.01",
                    n,
                ],
                capture_output=True,
                text=True,
                timeout=60,
            )
            for n in (bad, name)
        )
    finally:
        p.kill()
        p.wait(30)
        shmlimit.unlink(bad)
    assert bad_r.returncode == 2 and "\x1b" not in bad_r.stdout + bad_r.stderr
    assert "\\x1b]0;owned" in bad_r.stderr  # today: printed raw
    assert r.returncode == 0, r.stderr
    assert "\x1b" not in r.stdout and "\x07" not in r.stdout
    assert "x\\x1b[2Jy" in r.stdout


def test_printable():
    assert printable("plain ▁▂ é") == "plain ▁▂ é"
    assert printable("a\x1b[31mb\x9bc\n") == "a\\x1b[31mb\\x9bc\\n"


# ---- finding 9: native re-initialisation --------------------------------------------------------


def test_native_cells_cannot_be_reinitialised():
    native = pytest.importorskip("shmlimit.shm._native")
    buf = bytearray(64)
    c = native.NativeCells(buf, 64)
    g = c.grabber(0, 0, 8, 16, 1, 24, 1)
    c.store(16, 100)
    with pytest.raises(TypeError, match="re-initialised"):
        c.__init__(bytearray(64), 64)  # today: accepted, and g points at released memory
    assert g() is None and c.load(8) == 1 and c.load(24) == 1
    assert int.from_bytes(buf[8:16], "little") == 1  # still the first buffer


# ---- the parser, fuzzed ----------------------------------------------------------------------------


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda kids: (
        st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=10), kids, max_size=4)
    ),
    max_leaves=12,
)


def _paths(d, prefix=()):
    """Every key path of a JSON object, nested ones included."""
    for k, v in d.items():
        yield prefix + (k,)
        if isinstance(v, dict):
            yield from _paths(v, prefix + (k,))


def _mutate(path, value):
    d = _desc()
    target = d
    for k in path[:-1]:
        target = target[k]
    if value is _DROP:
        target.pop(path[-1], None)
    else:
        target[path[-1]] = value
    return d


@st.composite
def descriptions(draw):
    kind = draw(st.integers(0, 2))
    if kind == 0:  # anything JSON
        return json.dumps(draw(json_values)).encode()
    if kind == 1:  # the valid description with one field replaced, dropped or added
        paths = sorted(_paths(_desc())) + [("extra",)]
        path = draw(st.sampled_from(paths))
        return json.dumps(_mutate(path, draw(st.one_of(st.just(_DROP), json_values)))).encode()
    return draw(st.binary(max_size=L.UP_DESC_MAX))  # not even JSON


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=descriptions(), claimed=st.one_of(st.none(), st.integers(0, 2**64 - 1)))
def test_fuzzed_upstream_descriptions_raise_only_segment_errors(data, claimed, monkeypatch):
    monkeypatch.setattr(header, "LIVE_CREATOR_WAIT", 0.0)
    name = f"test-fuzz-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        _upstream_segment(name, data)
        if claimed is not None:  # a length that need not match
            with open(_path(name), "r+b") as f:
                f.seek(L.UP_DESC_LEN)
                f.write(claimed.to_bytes(8, "little"))
        t0 = time.monotonic()
        for call in (shmlimit.inspect, shmlimit.attach):
            try:
                r = call(name)
            except shmlimit.ShmlimitError as e:
                event(f"refused: {type(e).__name__}")
                continue
            event("accepted")
            if isinstance(r, shmlimit.Limiter):
                try:
                    repr(r)
                    r.stats()
                finally:
                    r.close()
        assert time.monotonic() - t0 < 10  # nothing hangs
    finally:
        try:
            shmlimit.unlink(name)
        except FileNotFoundError:
            pass


def test_secret_files_planted_for_the_inodes_to_come_do_not_stop_a_keyed_table(name):
    """A keyed table's secret file was named by its segment's inode alone, and inodes come one
    after another: another user planted files under the names of the next ones, which the
    sticky ``/dev/shm`` kept the table's creator from removing, and every new keyed table of
    that name failed ("cannot create the secret file").  Its name holds the segment's creation
    instant too now, which no one can foresee."""
    if not ROOT:
        pytest.skip("two users other than root need root to become them")
    victim = 54321  # (no passwd entry needed)

    def plant():
        os.sched_setaffinity(0, {0})  # (one CPU: tmpfs hands each CPU its inodes in order)
        probe = f"/dev/shm/shmlimit-probe-{os.getpid()}"
        os.close(os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
        first = os.stat(probe).st_ino + 301  # (the planted files take the 300 before it)
        os.unlink(probe)
        for ino in range(first, first + 300):
            path = f"/dev/shm/shmlimit.{name}~secret-{ino}"
            os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))

    def create():
        os.sched_setaffinity(0, {0})
        shmlimit.KeyedLimiter(name, rate=5, keys=64).close()

    try:
        assert _as_nobody(plant) == 0
        assert _as_user(victim, victim, create) == 0  # before: "Operation not permitted"
        assert shmlimit.inspect(name) is not None
    finally:
        for e in os.listdir("/dev/shm"):
            if e.startswith(f"shmlimit.{name}~secret-"):
                os.unlink(f"/dev/shm/{e}")
        try:
            shmlimit.unlink(name)
        except shmlimit.LimiterNotFoundError:
            pass
