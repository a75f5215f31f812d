"""Other users' processes: a limiter is opened only as its mode allows."""

import io
import multiprocessing as mp
import os
import pwd
from contextlib import redirect_stderr, redirect_stdout

import posix_ipc
import pytest

import shmlimit


def _as_nobody(name, gid, q):
    try:
        nobody = pwd.getpwnam("nobody")
        os.setgroups([gid] if gid is not None else [])
        os.setgid(gid if gid is not None else nobody.pw_gid)
        os.setuid(nobody.pw_uid)
        # root owns the segment (trusted: root can write any segment anyway); the group's write
        # bit is accepted because this attach asks for it
        lim = shmlimit.attach(name, mode=0o660)
        lim.acquire()
        q.put("attached")
        lim.close()
    except PermissionError as e:
        q.put(f"PermissionError: {e}")
    except BaseException as e:
        q.put(f"{type(e).__name__}: {e}")


def _run_as_nobody(name, gid=None):
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_as_nobody, args=(name, gid, q))
    p.start()
    r = q.get(timeout=60)
    p.join(30)
    return r


@pytest.mark.skipif(os.geteuid() != 0, reason="dropping privileges to another user needs root")
def test_another_user_cannot_attach_unless_the_mode_allows_it(name):
    try:
        pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("no user 'nobody' on this machine")
    # Closed before forking: a child that inherits an open attachment keeps using its mapping
    # (like an inherited file descriptor), whoever it becomes; only opening is checked.
    shmlimit.Limiter(name, rate=100).close()  # default mode 0600
    r = _run_as_nobody(name)
    assert r.startswith("PermissionError") and name in r
    shmlimit.unlink(name)
    # an explicit mode shares the limiter with a group: nobody, as a member of the segment's group
    group = 4242
    shmlimit.Limiter(name, rate=100, mode=0o660).close()
    os.chown(f"/dev/shm/shmlimit.{name}", -1, group)
    assert _run_as_nobody(name, gid=group) == "attached"
    assert _run_as_nobody(name, gid=None).startswith("PermissionError")  # not in the group: refused


def _refused(name):
    raise posix_ipc.PermissionsError("Permission denied")


def test_a_segment_this_user_may_not_remove_is_a_permission_error(name, monkeypatch):
    """``unlink`` of another user's segment (in /dev/shm, sticky, only its owner or root may remove
    it) is a ``PermissionError`` naming it, which every caller catches (posix_ipc's own is not an
    OSError)."""
    shmlimit.Limiter(name, rate=10).close()
    monkeypatch.setattr(posix_ipc, "unlink_shared_memory", _refused)
    with pytest.raises(PermissionError, match=f"not allowed to remove limiter '{name}'"):
        shmlimit.unlink(name)
    code, out, err = _cli(monkeypatch, name, "unlink", name)
    assert code == 2 and out == ""
    assert err.splitlines() == [err.strip()] and "not allowed to remove limiter" in err


def test_gc_goes_on_past_a_segment_it_may_not_remove(name, monkeypatch):
    """gc reports a stale segment it may not remove and removes the next ones."""
    for n in (name + "-a", name + "-b"):
        shmlimit.Limiter(n, rate=10).close()
    real = posix_ipc.unlink_shared_memory

    def refuse_a(posix):
        if posix.endswith(name + "-a"):
            _refused(posix)
        real(posix)

    monkeypatch.setattr(posix_ipc, "unlink_shared_memory", refuse_a)
    code, out, _ = _cli(monkeypatch, name, "gc")
    assert code == 0
    assert f"left alone (unreadable): {name}-a: not allowed to remove limiter" in out
    assert f"removed: {name}-b" in out.splitlines()
    assert [n for n in shmlimit.list_names() if n.startswith(name)] == [name + "-a"]


def _cli(monkeypatch, prefix, *argv):
    """``shmlimit argv...`` in this process, seeing only the segments named ``prefix``...:
    (exit code, stdout, stderr)."""
    from shmlimit.cli import main as cli

    real, real_secrets = cli.scan, cli.orphan_secrets
    monkeypatch.setattr(cli, "scan", lambda: ([n for n in real()[0] if n.startswith(prefix)], []))
    monkeypatch.setattr(
        cli, "orphan_secrets", lambda: [s for s in real_secrets() if s[0].startswith(prefix)]
    )
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = cli.main(list(argv))
    return code, out.getvalue(), err.getvalue()
