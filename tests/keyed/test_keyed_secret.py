"""A keyed table's hash secret is kept from readers who are not writers (issue item 9), on both
backends.

The secret was in the segment, so a group reader of a 0o640 keyed segment (a ``shmlimit top``
user) could compute offline keys that land in a chosen key's window of 32 slots: 32 requests
locked that key out (``when_full="refuse"``) while the table was 98 % empty.  The secret is now
in the segment's secret file, which only the classes that may write the segment can read.
"""

import multiprocessing
import os
import stat

import pytest
from support.segments import secret_path

from shmlimit import KeyedLimiter
from shmlimit.errors import SegmentError
from shmlimit.keyed import cells as KC
from shmlimit.keyed import layout as K
from shmlimit.keyed.window_table import WindowTable
from shmlimit.shm import segment as S
from shmlimit.shm.cells import native_available

BACKENDS = ["atomics"] + (["native"] if native_available() else [])
KEYS = 2048
#: line 2's words 3 and 4, where layout 6 kept the secret
OLD_SECRET = (2 * K.LINE + 24, 2 * K.LINE + 32)
NOBODY = 65534


def _read_as_group_reader(conn, name):
    """In a child: become another user in the segment's group, then read every entry of the
    limiter as ``top`` does (``pread``, read-only, no mapping): its bytes, or the error."""
    try:
        os.setgroups([])
        os.setgid(os.stat(f"{S.SHM_DIR}/{S.PREFIX}{name}").st_gid)
        os.setuid(NOBODY)
        out = {}
        for e in sorted(os.listdir(S.SHM_DIR)):
            if e.startswith(S.PREFIX + name) and e[len(S.PREFIX + name) :][:1] in ("", "~"):
                try:
                    with open(os.path.join(S.SHM_DIR, e), "rb") as f:
                        out[e] = f.read()
                except PermissionError as err:
                    out[e] = type(err).__name__
        conn.send(out)
    except BaseException as err:  # pragma: no cover - reported to the parent
        conn.send(repr(err))


def _group_reader_sees(name):
    """What a group reader (another uid, in the segment's group) can read, entry by entry: real
    permission checks need root to become that user; otherwise the test is skipped."""
    if os.geteuid() != 0:
        pytest.skip("becoming another user to read as a group reader needs root")
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=_read_as_group_reader, args=(child, name))
    p.start()
    try:
        assert parent.poll(60)
        out = parent.recv()
    finally:
        p.join(60)
    assert isinstance(out, dict), out
    return out


def _word(raw, off):
    return int.from_bytes(raw[off : off + 8], "little")


def _crowd(k0, k1, slots, victim="victim"):
    """``PROBE`` keys whose home slot is the victim's under the secret ``(k0, k1)``: computed
    offline, they fill the victim's whole window of slots."""

    def home(key):
        return (KC.siphash128(key.encode(), k0, k1)[0] * slots) >> 64

    target, crowd, i = home(victim), [], 0
    while len(crowd) < K.PROBE:
        i += 1
        if home(f"x{i}") == target:
            crowd.append(f"x{i}")
    return crowd


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_group_reader_cannot_lock_a_key_out(name, backend, monkeypatch):
    """The reader takes what it can read of a 0o640 segment as the secret (layout 6's words, or
    any other), crowds the victim's window with 32 keys, and the victim is still admitted."""
    monkeypatch.setenv("SHMLIMIT_BACKEND", backend)
    kl = KeyedLimiter(
        name, rate=200, per=86_400, burst=200, keys=KEYS, mode=0o640, when_full="refuse"
    )
    try:
        seen = _group_reader_sees(name)
        raw = seen[S.PREFIX + name]
        assert (
            isinstance(raw, bytes) and len(raw) == os.stat(f"{S.SHM_DIR}/{S.PREFIX}{name}").st_size
        )
        guess = tuple(_word(raw, o) for o in OLD_SECRET)
        for k in _crowd(*guess, KEYS):
            assert kl.try_acquire(k)
        assert kl.stats().keys == K.PROBE  # 32 of 2048 slots: the table is 98 % empty
        assert kl.try_acquire("victim")  # before: refused for a day
        assert kl.stats().refused_full == 0
        # the writers' secret, as the table hashes with it, is in none of the bytes a reader sees
        k0, k1 = kl._live().secret
        words = [_word(raw, o) for o in range(0, len(raw) - 7, 8)]
        assert k0 not in words and k1 not in words
        assert all(v == "PermissionError" for e, v in seen.items() if e != S.PREFIX + name)
        assert len(seen) == 2  # the segment and its secret file
    finally:
        kl.close()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("what", ["keyed", "windows", "group"])
@pytest.mark.parametrize("mode", [0o600, 0o640, 0o660, 0o644])
def test_the_secret_file_is_readable_only_by_writers(name, backend, what, mode, monkeypatch):
    """Each kind of keyed table keeps its secret in one file beside it, whose read bits are the
    segment's only where that class may also write it; the segment holds none of it."""
    monkeypatch.setenv("SHMLIMIT_BACKEND", backend)
    if what == "keyed":
        lim = KeyedLimiter(name, rate=5, keys=64, mode=mode)
        secrets = [lim._live().secret]
    elif what == "group":
        lim = KeyedLimiter(name, rates={"s": 5, "m": 100}, keys=64, mode=mode)
        secrets = [r._live().secret for r in lim._live()]
    else:
        lim = WindowTable(name, keys=64, moving_keys=8, mode=mode)
        secrets = [(lim.counters.k0, lim.counters.k1), (lim.moving.k0, lim.moving.k1)]
    try:
        seg = os.stat(f"{S.SHM_DIR}/{S.PREFIX}{name}")
        entry = secret_path(name)
        st = os.lstat(entry)
        want = {0o600: 0o600, 0o640: 0o600, 0o660: 0o660, 0o644: 0o600}[mode]
        assert stat.S_ISREG(st.st_mode) and st.st_mode & 0o7777 == want == S.secret_mode(mode)
        assert st.st_uid == seg.st_uid and st.st_size == 16
        with open(entry, "rb") as f:
            data = f.read()
        assert len(set(secrets)) == 1  # one secret, every table of the segment's
        assert secrets[0] == (_word(data, 0), _word(data, 8))
        with open(f"{S.SHM_DIR}/{S.PREFIX}{name}", "rb") as f:
            raw = f.read()
        assert data[:8] not in raw and data[8:] not in raw
        assert name in S.list_names() and not any(name in n for n in S.scan()[1])
    finally:
        lim.close()
    S.unlink(name)
    assert not os.path.lexists(entry)  # removed with its segment


def _attach_as_group_writer(conn, name):
    """In a child: another user in the segment's group attaches (mode 0o660) and counts a key."""
    try:
        os.setgroups([])
        os.setgid(os.stat(f"{S.SHM_DIR}/{S.PREFIX}{name}").st_gid)
        os.setuid(NOBODY)
        lim = KeyedLimiter(name, mode=0o660, trusted_uids=[0])
        conn.send((lim._live().secret, lim.try_acquire("from-the-group")))
        lim.close()
    except BaseException as err:
        conn.send(repr(err))


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_group_writer_reads_the_secret_and_shares_the_table(name, backend, monkeypatch):
    monkeypatch.setenv("SHMLIMIT_BACKEND", backend)
    if os.geteuid() != 0:
        pytest.skip("becoming another user needs root")
    kl = KeyedLimiter(name, rate=1, per=3600, keys=64, mode=0o660)
    try:
        ctx = multiprocessing.get_context("fork")
        parent, child = ctx.Pipe()
        p = ctx.Process(target=_attach_as_group_writer, args=(child, name))
        p.start()
        assert parent.poll(60)
        out = parent.recv()
        p.join(60)
        assert out == (kl._live().secret, True)
        assert not kl.try_acquire("from-the-group")  # the same key, in the same slot
    finally:
        kl.close()


def test_a_secret_file_left_by_a_removed_segment_is_found_and_collected(name, monkeypatch):
    """A segment removed behind shmlimit's back (``rm``) leaves its secret file: no tool calls it
    foreign, ``doctor`` points at it, ``gc`` removes it; a table made afresh has its own.  (gc runs
    over this test's names only: over the whole machine it collected other test runs' idle
    segments, and another run's gc could collect this one's secret file before it looked.)"""
    from support.segments import run_tools_on

    from shmlimit.cli import doctor

    KeyedLimiter(name, rate=5, keys=64).close()
    ino = os.stat(f"{S.SHM_DIR}/{S.PREFIX}{name}").st_ino
    entry = secret_path(name)
    os.unlink(f"{S.SHM_DIR}/{S.PREFIX}{name}")
    assert os.path.exists(entry) and (name, ino) in S.orphan_secrets()
    assert not any(name in n for ns in S.scan() for n in ns)
    [f] = [x for x in doctor.check_segments() if name in x.message]
    assert f.level == "warn" and "secret file" in f.message and "shmlimit gc" in f.message
    kl = KeyedLimiter(name, rate=5, keys=64)  # a new table: its own secret, the old one still stale
    try:
        assert (name, ino) in S.orphan_secrets() and len(
            [n for n, _ in S.orphan_secrets() if n == name]
        ) == 1
        code, out = run_tools_on(monkeypatch, name, "gc", "--dry-run")
        assert (
            code == 0
            and f"stale: the secret file of {name} (its segment is gone)" in out.splitlines()
        )
        assert os.path.exists(entry)
        code, out = run_tools_on(monkeypatch, name, "gc")
        assert (
            code == 0
            and f"removed: the secret file of {name} (its segment is gone)" in out.splitlines()
        )
        assert not os.path.exists(entry) and kl.try_acquire("k")
        assert f"removed: {name}" not in out  # the table in use is kept, with its secret
        assert KeyedLimiter(name)._live().secret == kl._live().secret
    finally:
        kl.close()


@pytest.mark.parametrize("kind", [KeyedLimiter, WindowTable])
def test_a_lost_secret_file_is_a_clear_error(name, kind):
    kind(name, **({"rate": 5} if kind is KeyedLimiter else {}), keys=64).close()
    os.unlink(secret_path(name))
    with pytest.raises(SegmentError, match="lost its secret file"):
        kind(name)
