"""Other users' processes: a limiter is opened only as its mode allows."""

import multiprocessing as mp
import os
import pwd

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
