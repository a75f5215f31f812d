"""Every kind of limiter lives under its one name: created in one process, attached by that name
from an unrelated interpreter, listed as one entry, collected as one, refused when forged."""

import json
import os
import re
import signal
import struct
import subprocess
import sys
import textwrap
import time

import pytest
from support.segments import shm_path

import shmlimit
from shmlimit import header
from shmlimit.errors import AbandonedSegmentError, SegmentError
from shmlimit.keyed import layout as K
from shmlimit.keyed.multi import MultiKeyedLimiter
from shmlimit.keyed.stats import KeyedStats
from shmlimit.keyed.window_table import WindowTable
from shmlimit.kinds import collect, inspect
from shmlimit.multirate import MultiStats
from shmlimit.shm import layout as L
from shmlimit.shm.table import pid_namespace
from shmlimit.stats import Stats

#: each kind's maker, as source: this interpreter's and the other ones' (``USES``)
MAKERS = """{
    "one rate": lambda n: shmlimit.Limiter(n, rate=50),
    "rates as a list": lambda n: shmlimit.Limiter(n, rates=["50/s", "1000/min"]),
    "rates as a dict": lambda n: shmlimit.Limiter(n, rates={"requests": "50/s", "tokens": "2K/s"}),
    "keyed": lambda n: shmlimit.KeyedLimiter(n, rate=50, keys=64),
    "keyed with several rates": lambda n: shmlimit.KeyedLimiter(
        n, rates=["50/s", "1000/min"], keys=64
    ),
}"""
KINDS = eval(MAKERS)
#: what the other interpreter passes to each call, per kind: (arguments, keyword arguments)
CALLS = {
    "one rate": ([], {}),
    "rates as a list": ([], {}),
    "rates as a dict": ([], {"requests": 1, "tokens": 10}),
    "keyed": (["client-1"], {}),
    "keyed with several rates": (["client-1"], {}),
}

ATTACHES = textwrap.dedent(
    """
    import asyncio, json, sys
    import shmlimit

    lim = shmlimit.attach(sys.argv[1])
    args, kw = json.loads(sys.argv[2])
    out = {
        "kind": type(lim).__name__,
        "try": lim.try_acquire(*args, **kw),
        "acquire": lim.acquire(*args, timeout=1.0, **kw),
        "acquire_async": asyncio.run(lim.acquire_async(*args, timeout=1.0, **kw)),
        "stats": type(lim.stats()).__name__,
    }
    lim.close()
    print(json.dumps(out))
    """
)


def attach_elsewhere(name: str, kind: str) -> dict:
    r = subprocess.run(
        [sys.executable, "-c", ATTACHES, name, json.dumps(CALLS[kind])],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def listed(name: str) -> list:
    r = subprocess.run(
        [sys.executable, "-c", "from shmlimit.cli.main import main; main()", "list", "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    return [e["name"] for e in json.loads(r.stdout) if e["name"].startswith(name)]


@pytest.mark.parametrize("kind", [*KINDS, "a key's view"])
def test_every_kinds_repr_says_a_corrupt_segment_is_unreadable_and_never_raises(name, kind):
    """A segment overwritten with 0xff: every kind's repr raised SegmentError (a KeyView's, from
    its limiter's), in a log line or a debugger, where it is shown rather than used."""
    lim = KINDS.get(kind, KINDS["keyed"])(name)
    shown = lim["client-1"] if kind == "a key's view" else lim
    assert "unreadable" not in repr(shown)
    with open(shm_path(name), "r+b") as f:
        whole = f.read()
        f.seek(0)
        f.write(b"\xff" * len(whole))
        try:
            assert re.search(rf"'{name}' unreadable: segment is corrupt: .*>+$", repr(shown))
        finally:
            f.seek(0)
            f.write(whole)
    lim.close()
    assert repr(lim).endswith("closed>")


@pytest.mark.parametrize("kind", list(KINDS))
def test_every_kind_is_attached_by_its_name_elsewhere_and_listed_once(name, kind):
    lim = KINDS[kind](name)
    try:
        got = attach_elsewhere(name, kind)
        assert got["try"] is True and got["acquire"] is True and got["acquire_async"] is True
        assert got["stats"].endswith("Stats")
        assert listed(name) == [name]
    finally:
        lim.unlink()
        lim.close()


@pytest.mark.parametrize("kind", ["one rate", "keyed", "window table"])
def test_every_kind_records_its_users_pid_namespace(name, kind):
    """A process slot of another PID namespace counts as alive (its pid means nothing here): every
    kind's slot must say which namespace its owner is in.  Keyed tables and window tables
    registered without it, so another namespace's users looked dead to ``gc`` and to reclaimers."""
    lim = WindowTable(name, keys=64) if kind == "window table" else KINDS[kind](name)
    try:
        if kind != "window table":
            lim.try_acquire(*CALLS[kind][0])
        with open(shm_path(name), "rb") as f:
            data = f.read()
        word = lambda off: struct.unpack_from("<Q", data, off)[0]  # noqa: E731
        mine = [
            word(L.slot_offset(i) + L.SLOT_PIDNS)
            for i in range(word(L.SLOTS_OFF))
            if word(L.slot_offset(i) + L.SLOT_PID) == os.getpid()
        ]
        assert mine == [pid_namespace()] and pid_namespace() != 0
    finally:
        lim.unlink()
        lim.close()


TRUSTING = {
    "one rate": lambda n, mode: shmlimit.Limiter(n, rate=50, mode=mode),
    "keyed": lambda n, mode: shmlimit.KeyedLimiter(n, rate=50, keys=64, mode=mode),
    "window table": lambda n, mode: WindowTable(n, keys=64, mode=mode),
}


@pytest.mark.parametrize("kind", list(TRUSTING))
def test_a_second_handle_in_a_process_is_vetted_with_its_own_trust(name, kind):
    """A handle on a name this process has open already shares its attachment, but only if the
    segment passes this call's own trust check (a keyed table's was not checked again)."""
    first = TRUSTING[kind](name, 0o602)  # writable by others, as asked for
    try:
        with pytest.raises(shmlimit.UntrustedSegmentError, match="writable by others"):
            TRUSTING[kind](name, 0o600)
        TRUSTING[kind](name, 0o602).close()  # asked for: accepted
    finally:
        first.unlink()
        first.close()


#: A group of two rates "a" and "b", of each layout; what a call passes to take from every rate.
GROUPS = {
    "plain": lambda n: shmlimit.Limiter(n, rates={"a": ("10/s", 5), "b": "1/s"}),
    "keyed": lambda n: shmlimit.KeyedLimiter(n, rates={"a": ("10/s", 5), "b": "1/s"}, keys=64),
}
GROUP_ARGS = {"plain": [], "keyed": ["client-1"]}


@pytest.mark.parametrize("kind", list(GROUPS))
def test_a_group_of_rates_is_collected_whole_when_idle_and_kept_while_used(name, kind):
    lim = GROUPS[kind](name)
    assert lim.try_acquire(*GROUP_ARGS[kind], a=1)
    assert not collect(name)  # this process is registered in its rates: in use
    assert name in shmlimit.list_names()
    lim.close()
    assert collect(name)
    assert name not in shmlimit.list_names()


HOLDS = textwrap.dedent(
    """
    import sys
    import shmlimit

    lim = shmlimit.attach(sys.argv[1])
    lim.try_acquire(*sys.argv[2:], a=1)  # a use: registered in every rate
    print("ready", flush=True)
    sys.stdin.read()  # held until the parent closes the pipe
    """
)


@pytest.mark.parametrize("kind", list(GROUPS))
def test_a_group_used_by_another_process_is_kept_then_collected_once_it_exits(name, kind):
    GROUPS[kind](name).close()
    p = subprocess.Popen(
        [sys.executable, "-c", HOLDS, name, *GROUP_ARGS[kind]],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert p.stdout.readline() == "ready\n"
        assert not collect(name)  # the other process is registered in its rates
        assert isinstance(inspect(name), MultiStats)  # every region given back whole
        mine = shmlimit.attach(name)
        assert mine.try_acquire(*GROUP_ARGS[kind], b=1)
        mine.close()
    finally:
        p.stdin.close()
        assert p.wait(timeout=60) == 0
    assert collect(name)  # its holder is dead, and this process's handle closed
    assert name not in shmlimit.list_names()


@pytest.mark.parametrize("kind", list(GROUPS))
def test_a_group_is_inspected_as_one_limiter_of_its_rates(name, kind):
    lim = GROUPS[kind](name)
    try:
        assert lim.try_acquire(*GROUP_ARGS[kind], a=3, b=1)
        s = inspect(name)
        assert isinstance(s, MultiStats) and list(s.rates) == ["a", "b"]
        each = KeyedStats if kind == "keyed" else Stats
        assert all(isinstance(r, each) for r in s.rates.values())
        assert [r.name for r in s.rates.values()] == [f"{name}[a]", f"{name}[b]"]
        assert s.grants == {"a": 3, "b": 1} and s.rates["a"].capacity == 5
        assert [p.pid for p in s.processes] == [os.getpid()]
    finally:
        lim.unlink()
        lim.close()


def test_different_rates_under_a_group_name_are_refused(name):
    lim = shmlimit.Limiter(name, rates={"a": "10/s", "b": "1/s"})
    try:
        with pytest.raises(shmlimit.ConfigMismatchError, match="rates"):
            shmlimit.Limiter(name, rates={"a": "10/s", "c": "1/s"})
        with pytest.raises(shmlimit.ConfigMismatchError, match="rates"):
            shmlimit.Limiter(name, rates=["10/s", "1/s"])
        with pytest.raises(SegmentError, match="several rates"):
            shmlimit.Limiter(name, rate=10)
        with pytest.raises(SegmentError, match="not a keyed limiter of several rates"):
            shmlimit.KeyedLimiter(name, rates={"a": "10/s", "b": "1/s"})
    finally:
        lim.unlink()
        lim.close()


@pytest.mark.parametrize("kind", ["rates as a dict", "keyed with several rates"])
def test_a_rates_mismatch_advises_what_works_for_the_group(name, kind):
    """A rate of a group created with another config said: attach with
    ``shmlimit.attach('NAME[a]')`` (not a name: ValueError) or pass ``reconfigure=True`` (which
    ``Limiter(rates=)`` does not take: TypeError).  The advice now works, each of its ways."""
    keyed = kind.startswith("keyed")
    make = shmlimit.KeyedLimiter if keyed else shmlimit.Limiter
    table = {"keys": 64} if keyed else {}
    user = make(name, rates={"a": "10/s", "b": "1/s"}, **table)  # a live user
    try:
        with pytest.raises(shmlimit.ConfigMismatchError) as e:
            make(name, rates={"a": "20/s", "b": "1/s"}, **table)
        said = str(e.value)
        assert f"limiter '{name}[a]' already exists" in said  # the rate that differs ...
        assert f"shmlimit.attach('{name}')" in said  # ... and the group's name to attach it by
        other = shmlimit.attach(re.search(r"shmlimit\.attach\('(.*?)'\)", said).group(1))
        assert type(other) is type(user)
        other.close()
        if keyed:
            assert "reconfigure=True" in said
            make(name, rates={"a": "20/s", "b": "1/s"}, reconfigure=True, **table).close()
        else:
            assert "reconfigure" not in said and "set_rate('a', ...)" in said
            user.set_rate("a", "20/s")
        assert user.stats()["a"].rate == 20  # ... for every process using it
    finally:
        user.unlink()
        user.close()


def test_a_keyed_group_is_refused_to_other_kinds_and_other_tables(name):
    lim = shmlimit.KeyedLimiter(name, rates={"a": "10/s", "b": "1/s"}, keys=64)
    try:
        assert isinstance(shmlimit.attach(name), MultiKeyedLimiter)
        with pytest.raises(
            SegmentError, match="is a keyed limiter of several rates, not a limiter"
        ):
            shmlimit.Limiter(name, rates={"a": "10/s", "b": "1/s"})
        with pytest.raises(SegmentError, match="several rates, not a KeyedLimiter of one rate"):
            shmlimit.KeyedLimiter(name, rate=10)
        with pytest.raises(shmlimit.ConfigMismatchError, match="rates"):
            shmlimit.KeyedLimiter(name, rates=["10/s", "1/s"], keys=64)
        with pytest.raises(shmlimit.ConfigMismatchError, match="keys=64"):
            shmlimit.KeyedLimiter(name, rates={"a": "10/s", "b": "1/s"}, keys=128)
        same = shmlimit.KeyedLimiter(name, rates={"a": "10/s", "b": "1/s"}, keys=64)
        assert (
            same.keys == ("a", "b") and same._lims[0]._att is lim._lims[0]._att
        )  # one per process
        same.close()
    finally:
        lim.unlink()
        lim.close()


def _forge(name: str, offset: int, value: bytes) -> None:
    with open(shm_path(name), "r+b") as f:
        f.seek(offset)
        f.write(value)


@pytest.mark.parametrize(
    "offset, value, match",
    [
        (L.GROUP_COUNT, struct.pack("<Q", 0), "corrupt"),
        (L.GROUP_COUNT, struct.pack("<Q", 17), "corrupt"),
        (L.GROUP_COUNT, struct.pack("<Q", 3), "corrupt"),  # more than the file holds
        (L.GROUP_STRIDE, struct.pack("<Q", 8), "corrupt"),
        (L.GROUP_KEYS, b"a-b\0", "keys"),
        (L.GROUP_KEYS, b"a\0a\0", "keys"),  # one key for two rates
        (L.GROUP_NAMED, struct.pack("<Q", 7), "keys"),
        (L.VERSION_OFF, struct.pack("<Q", 99), "version"),
    ],
)
@pytest.mark.parametrize("kind", list(GROUPS))
def test_a_forged_group_header_is_refused_by_every_reader(name, kind, offset, value, match):
    GROUPS[kind](name).close()
    try:
        _forge(name, offset, value)
        with pytest.raises(SegmentError, match=match):
            shmlimit.attach(name)
        with pytest.raises(SegmentError, match=match):
            inspect(name)
        assert listed(name) == [name]  # shown as unreadable, never fatal
        with pytest.raises(SegmentError, match=match):
            collect(name)  # a forged group is no one's to collect: left for unlink
    finally:
        try:
            shmlimit.unlink(name)
        except FileNotFoundError:
            pass


@pytest.mark.parametrize("kind", list(GROUPS))
def test_a_truncated_group_is_refused(name, kind):
    GROUPS[kind](name).close()
    try:
        os.truncate(shm_path(name), L.GROUP_HEADER_BYTES + 64)
        with pytest.raises(SegmentError, match="truncated"):
            shmlimit.attach(name)
        with pytest.raises(SegmentError):
            inspect(name)
    finally:
        shmlimit.unlink(name)


def _region_offset(name: str, index: int) -> int:
    with open(shm_path(name), "rb") as f:
        head = f.read(L.GROUP_HEADER_BYTES)
    first, stride = (struct.unpack_from("<Q", head, o)[0] for o in (L.GROUP_FIRST, L.GROUP_STRIDE))
    return first + index * stride


@pytest.mark.parametrize(
    "offset, value, match",
    [
        (L.GROUP_REGIONS, struct.pack("<Q", 7), "corrupt"),  # a layout no reader knows
        (L.GROUP_REGIONS, struct.pack("<Q", L.REGIONS_LIMITER), "corrupt"),  # limiters' sizes
        (L.GROUP_TABLE_KEYS, struct.pack("<Q", 0), "corrupt"),
        (L.GROUP_TABLE_KEYS, struct.pack("<Q", 1 << 40), "corrupt"),
        (L.GROUP_TABLE_KEYS, struct.pack("<Q", 128), "corrupt"),  # more than its regions hold
        (L.GROUP_TABLE_OVR, struct.pack("<Q", 1 << 40), "corrupt"),
        (L.SLOTS_OFF, struct.pack("<Q", 5), "corrupt"),  # a keyed table's process slots are fixed
    ],
)
def test_a_forged_keyed_group_header_is_refused_by_every_reader(name, offset, value, match):
    GROUPS["keyed"](name).close()
    try:
        _forge(name, offset, value)
        with pytest.raises(SegmentError, match=match):
            shmlimit.attach(name)
        with pytest.raises(SegmentError, match=match):
            inspect(name)
        assert listed(name) == [name]  # shown as unreadable, never fatal
        with pytest.raises(SegmentError, match=match):
            collect(name)
    finally:
        shmlimit.unlink(name)


@pytest.mark.parametrize(
    "offset, value, match",
    [
        (K.NKEYS_OFF, struct.pack("<Q", 65), "corrupt"),  # another table than the group says
        (K.VERSION_OFF, struct.pack("<Q", 99), "version"),
        (K.MAGIC_OFF, struct.pack("<Q", L.MAGIC), "ready|corrupt"),  # a limiter's region
        (K.STATE_OFF, struct.pack("<Q", 9), "ready|corrupt"),
    ],
)
def test_a_forged_keyed_region_is_refused(name, offset, value, match):
    GROUPS["keyed"](name).close()
    try:
        _forge(name, _region_offset(name, 1) + offset, value)
        with pytest.raises(SegmentError, match=match):
            shmlimit.attach(name)
        with pytest.raises(SegmentError, match=match):
            inspect(name)
        assert listed(name) == [name]
    finally:
        shmlimit.unlink(name)


def test_a_keyed_group_pickles_to_a_handle_on_the_same_tables(name):
    import pickle

    lim = GROUPS["keyed"](name)
    try:
        copy = pickle.loads(pickle.dumps(lim))
        assert isinstance(copy, MultiKeyedLimiter) and copy.keys == ("a", "b")
        assert copy.try_acquire("k", a=5) and not lim.try_acquire("k", a=1)  # one table
        copy.close()
    finally:
        lim.unlink()
        lim.close()


def test_top_shows_each_rate_of_a_keyed_group_with_its_busiest_keys(name):
    from shmlimit.cli import top

    lim = GROUPS["keyed"](name)
    try:
        for _ in range(3):
            assert lim.try_acquire("client-1", a=1)
        assert lim.try_acquire("client-2", a=1, b=1)
        rows = {r["name"]: r for r in top.Inspector([name]).sample()}
        assert list(rows) == [f"{name}[a]", f"{name}[b]"]
        # each rate's keys, read from its own region of the group's segment
        assert sorted(k["grants"] for k in rows[f"{name}[a]"]["busiest"]) == [1, 3]
        assert [k["grants"] for k in rows[f"{name}[b]"]["busiest"]] == [1]
    finally:
        lim.unlink()
        lim.close()


# ---- one start-up protocol for every kind (``header.open_segment``, each kind's ``Kind``)

#: Each kind's opener without create intent, and with it (a table of window counters always has it).
OPENERS = {
    "Limiter": (lambda n: shmlimit.Limiter(n), lambda n: shmlimit.Limiter(n, rate=10)),
    "KeyedLimiter": (
        lambda n: shmlimit.KeyedLimiter(n),
        lambda n: shmlimit.KeyedLimiter(n, rate=10, keys=64),
    ),
    "WindowTable": (None, lambda n: WindowTable(n, keys=64)),
}


def _initialising(name: str, creator: int) -> None:
    """What a creator leaves while it works (or when killed at work): a sized file, its pid, no
    magic, no READY."""
    path = shm_path(name)
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.pwrite(fd, bytes(K.segment_size(64, 16)), 0)
        os.pwrite(fd, struct.pack("<Q", creator), L.CREATOR_PID_OFF)
    finally:
        os.close(fd)


def test_a_window_table_or_a_missing_name_is_refused_with_advice_that_works(name):
    """A Limiter opened on a window table said "is a KeyedLimiter of one rate, not a Limiter: use
    shmlimit.attach", and attach then refused it as window counters; ``inspect`` described it as
    a rate of 0 per 0 s; attach of a missing name said "pass rate= to create it", though attach
    has no rate=."""
    table = WindowTable(name, keys=64)
    try:
        for opener in (shmlimit.Limiter, shmlimit.KeyedLimiter, shmlimit.attach):
            with pytest.raises(SegmentError) as e:
                opener(name)
            assert "is a window table (window counters), not a" in str(e.value)
            assert f"open it as the limits storage 'shm://{name}'" in str(e.value)
            assert "shmlimit.attach" not in str(e.value)
        s = inspect(name)
        assert s.kind == "windows" and s.describe() == f"windows keys={s.slots}"
    finally:
        table.close()
        table.unlink()
    with pytest.raises(shmlimit.LimiterNotFoundError) as e:
        shmlimit.attach(name)
    assert "pass rate=" not in str(e.value) and "shmlimit.Limiter(name, rate=...)" in str(e.value)


def test_a_limiter_opened_on_a_keyed_table_names_the_tables_kind(name):
    """A plain opener knows the keyed kind (before: "not a shmlimit limiter (bad magic ...)")."""
    shmlimit.KeyedLimiter(name, rate=10, keys=64).close()
    with pytest.raises(SegmentError, match="is a KeyedLimiter of one rate, not a Limiter"):
        shmlimit.Limiter(name, rate=10)
    with pytest.raises(
        SegmentError, match="is a KeyedLimiter of one rate, not a limiter of several rates"
    ):
        shmlimit.Limiter(name, rates=["10/s", "100/min"])
    assert isinstance(shmlimit.attach(name), shmlimit.KeyedLimiter)  # as the error says


@pytest.mark.parametrize(
    "opener",
    [o for pair in OPENERS.values() for o in pair if o is not None],
    ids=[
        f"{k}-{i}"
        for k, pair in OPENERS.items()
        for i, o in zip(("attach", "create"), pair)
        if o is not None
    ],
)
def test_every_kind_waits_for_a_live_creator_by_the_one_protocol(name, monkeypatch, opener):
    """A live creator is waited for, ``header.LIVE_CREATOR_WAIT`` (cut to nothing here), never
    replaced, and the error names it (before: a keyed table waited its own 30 s, unnamed)."""
    monkeypatch.setattr(header, "LIVE_CREATOR_WAIT", 0.0)
    _initialising(name, os.getpid())  # this process: alive
    with pytest.raises(SegmentError, match=f"still being initialised by pid {os.getpid()}"):
        opener(name)
    assert os.path.exists(shm_path(name))  # never replaced while its creator lives


@pytest.mark.parametrize("kind", list(OPENERS))
def test_every_kind_refuses_an_abandoned_segment_and_replaces_it_when_creating(name, kind):
    attach, create = OPENERS[kind]
    child = os.fork()
    if child == 0:  # pragma: no cover - a creator that dies before writing anything but its pid
        os._exit(0)
    os.waitpid(child, 0)
    _initialising(name, child)
    noun = "keyed limiter" if kind != "Limiter" else "limiter"
    if attach is not None:
        with pytest.raises(
            AbandonedSegmentError, match=f"its creator \\(pid {child}\\) died; creating the {noun}"
        ):
            attach(name)
    lim = create(name)
    try:
        assert lim.created if kind != "WindowTable" else lim.incr("k", 60) == 1
    finally:
        lim.close()


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["KeyedLimiter", "Limiter"])
def test_an_empty_file_with_a_refreshed_ctime_stalls_no_opener_of_any_kind(name, kind):
    """A creator gets ``INIT_WAIT`` from the opener's first look too, not only from the file's
    ctime, which anyone who can chmod it keeps young (before: a keyed opener waited 30 s)."""
    path = shm_path(name)
    os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600))
    child = os.fork()
    if child == 0:  # pragma: no cover - keeps the ctime young
        try:
            end = time.monotonic() + 20
            while time.monotonic() < end:
                os.chmod(path, 0o600)
                time.sleep(0.1)
        finally:
            os._exit(0)
    try:
        t0 = time.monotonic()
        with pytest.raises(AbandonedSegmentError, match="never initialised"):
            OPENERS[kind][0](name)
        assert time.monotonic() - t0 < header.INIT_WAIT + 5  # the margin: a loaded machine
    finally:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)


USES = (
    "import sys, time\nimport shmlimit\n"
    f"made = {MAKERS}[sys.argv[2]](sys.argv[1])\n"
    "print('made', flush=True)\ntime.sleep(60)\n"
)


@pytest.mark.parametrize("kind", list(KINDS))
def test_inspect_shows_each_kinds_processes_alive_then_dead(name, kind):
    """``shmlimit inspect`` listed a limiter's processes (pid, grants, alive or dead) for one rate
    and for keyed tables, but only their count for several rates: a killed user was not told."""
    user = subprocess.Popen(
        [sys.executable, "-c", USES, name, kind], stdout=subprocess.PIPE, text=True
    )
    try:
        assert user.stdout.readline().strip() == "made"

        def line() -> list:
            r = subprocess.run(
                [
                    sys.executable,
                    "-c",
                    "from shmlimit.cli.main import main; main()",
                    "inspect",
                    name,
                ],
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert r.returncode == 0, r.stderr
            return [
                ln.split()
                for ln in r.stdout.splitlines()
                if ln.split()[:2] == ["pid", str(user.pid)]
            ]

        assert [ln[-1] for ln in line()] == ["alive"]
        user.kill()  # not waited for: a zombie, dead all the same
        assert [ln[-1] for ln in line()] == ["dead"]
    finally:
        user.kill()
        user.wait()
        shmlimit.unlink(name)


#: A collector killed between its claim of a group's rates and its unlink (``claim_and_unlink``).
DIES_COLLECTING = textwrap.dedent(
    """
    import os, signal, sys
    import shmlimit.shm.segment as segment
    from shmlimit.kinds import collect

    def killed(name):
        os.kill(os.getpid(), signal.SIGKILL)

    segment.unlink = killed  # (claim_and_unlink's)
    collect(sys.argv[1])
    """
)


@pytest.mark.parametrize("kind", list(GROUPS))
def test_a_group_its_collector_died_claiming_is_given_back_to_its_next_opener(name, kind):
    GROUPS[kind](name).close()
    r = subprocess.run([sys.executable, "-c", DIES_COLLECTING, name], timeout=60)
    assert r.returncode == -signal.SIGKILL  # it died holding every rate's claim
    start = time.monotonic()
    lim = GROUPS[kind](name)  # a collector gone 2 s is given its claim back (DOOMED_WAIT)
    assert time.monotonic() - start < 30
    assert lim.try_acquire(*GROUP_ARGS[kind], a=1)
    lim.close()
    assert collect(name)  # whole again: nobody uses it, so gc takes it


@pytest.mark.parametrize("kind", [*KINDS, "window table"])
def test_gc_removes_a_segment_its_collector_died_claiming(name, kind):
    """``gc`` read a segment whose collector was killed between its claim and its unlink as
    "being removed" and left it alone, for good unless some process opened it.  It now opens it
    as an opener does (the claim given back after ``DOOMED_WAIT``) and removes it: nobody uses
    it.  A window table too, which ``gc`` opened with ``attach`` (that refuses one) and so left
    claimed for good."""
    from support.procs import run_cli

    from shmlimit.keyed.window_table import WindowTable

    (WindowTable if kind == "window table" else KINDS[kind])(name).close()
    r = subprocess.run([sys.executable, "-c", DIES_COLLECTING, name], timeout=60)
    assert r.returncode == -signal.SIGKILL  # it died holding its claim
    r = run_cli("gc", "--dry-run")
    assert f"stale: {name}" not in r.stdout  # (a dry run only looks: being removed)
    r = run_cli("gc")
    assert r.returncode == 0 and f"removed: {name}" in r.stdout.splitlines(), r.stdout
    assert name not in shmlimit.list_names()
