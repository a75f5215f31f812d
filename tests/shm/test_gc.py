"""gc on every kind of segment: the same claim-check-unlink, and openers that see a claim."""

import json
import mmap
import multiprocessing
import os
import subprocess
import sys

import pytest
from support.procs import WORKDIR
from support.procs import run_cli as cli
from support.procs import start_acquirer as start_worker
from support.segments import run_tools_on, shm_path

import shmlimit
from shmlimit import group
from shmlimit.keyed import layout as K
from shmlimit.keyed import segment as keyed_segment
from shmlimit.keyed.window_table import WindowTable
from shmlimit.kinds import collect, stale
from shmlimit.shm import layout as L
from shmlimit.shm import segment
from shmlimit.shm.cells import open_cells
from shmlimit.shm.segment import current_inode
from shmlimit.shm.table import ProcessTable, proc_start


def _state(name):
    with open(shm_path(name), "rb") as f:
        return int.from_bytes(os.pread(f.fileno(), 8, L.STATE_OFF), "little")


def test_gc_removes_idle_keyed_window_and_plain_tables_and_keeps_used_ones(name, monkeypatch):
    idle_plain, used_plain = name + "-plain", name + "-plain-used"
    idle_keyed, used_keyed, idle_windows = name + "-keyed", name + "-keyed-used", name + "-win"
    shmlimit.Limiter(idle_plain, rate=10).close()
    shmlimit.Limiter(used_plain, rate=10).close()
    shmlimit.KeyedLimiter(idle_keyed, rate=10, keys=100).close()
    WindowTable(idle_windows, keys=100).close()
    held = shmlimit.KeyedLimiter(used_keyed, rate=10, keys=100)  # this live process uses it
    worker = start_worker(used_plain)  # and another one uses this
    try:
        code, out = run_tools_on(monkeypatch, name, "gc", "--dry-run")
        assert code == 0
        assert {line for line in out.splitlines() if line.startswith("stale: ")} == {
            f"stale: {n}" for n in (idle_plain, idle_keyed, idle_windows)
        }
        assert out.splitlines()[-1] == "3 stale, 2 in use"
        code, out = run_tools_on(monkeypatch, name, "gc")
        assert code == 0 and out.splitlines()[-1] == "3 removed, 2 in use", out
        left = {n for n in shmlimit.list_names() if n.startswith(name)}
        assert left == {used_plain, used_keyed}
        assert held.try_acquire("k")  # the one in use still works, on the segment named
    finally:
        held.close()
        worker.kill()
        worker.wait()
        for n in (used_plain, used_keyed):
            shmlimit.unlink(n)


def test_gc_command_lists_an_idle_keyed_table_as_stale(name):
    shmlimit.KeyedLimiter(name, rate=10, keys=100).close()
    r = cli("gc", "--dry-run")
    assert r.returncode == 0 and f"stale: {name}" in r.stdout.splitlines()
    assert "left alone" not in "".join(line for line in r.stdout.splitlines() if name in line)


@pytest.mark.parametrize("kind", ["keyed", "windows"])
def test_an_opener_that_registers_after_a_claim_opens_the_name_again(name, monkeypatch, kind):
    """A collector claims (READY -> DOOMED) and unlinks between an opener's open and its register:
    the opener sees the claim after registering, leaves, and opens the name again (a new table),
    never staying on the one unlinked."""
    real = keyed_segment.open_segment
    orphans = []

    def collected_once(nm, *args):
        seg, cells, geo = real(nm, *args)
        if not orphans:  # the collector's whole run, between this open and the register
            orphans.append(seg.inode)
            assert cells.cas(L.STATE_OFF, L.STATE_READY, L.STATE_DOOMED)
            shmlimit.unlink(nm)
        return seg, cells, geo

    (
        shmlimit.KeyedLimiter(name, rate=10, keys=100)
        if kind == "keyed"
        else WindowTable(name, keys=100)
    ).close()
    monkeypatch.setattr(keyed_segment, "open_segment", collected_once)  # (``open_keyed``'s)
    opened = (
        shmlimit.KeyedLimiter(name, rate=10, keys=100) if kind == "keyed" else WindowTable(name)
    )
    try:
        assert orphans and current_inode(name) not in (None, orphans[0])
        s = shmlimit.inspect(name)
        assert [p.pid for p in s.processes if p.alive] == [os.getpid()]
        if kind == "keyed":
            assert opened.try_acquire("k")
            assert shmlimit.inspect(name).grants == 1  # counted in the table under the name
        else:
            assert opened.incr("k", 60) == 1
    finally:
        opened.close()


@pytest.mark.parametrize("kind", ["keyed", "windows"])
def test_a_claim_whose_collector_died_is_given_back(name, monkeypatch, kind):
    """A keyed table left DOOMED (its collector died between the claim and the unlink) is whole:
    an opener waits ``DOOMED_WAIT``, restores READY and uses it (it waited 30 s, then failed)."""
    (
        shmlimit.KeyedLimiter(name, rate=10, keys=100)
        if kind == "keyed"
        else WindowTable(name, keys=100)
    ).close()
    with open(shm_path(name), "r+b") as f:
        os.pwrite(f.fileno(), L.STATE_DOOMED.to_bytes(8, "little"), L.STATE_OFF)
    monkeypatch.setattr(segment, "DOOMED_WAIT", 0.05)  # every opener's (give_back_claim)
    opened = shmlimit.KeyedLimiter(name) if kind == "keyed" else WindowTable(name)
    try:
        assert _state(name) == L.STATE_READY
        assert opened.try_acquire("k") if kind == "keyed" else opened.incr("k", 60) == 1
    finally:
        opened.close()


def test_a_fifo_under_a_limiters_name_never_hangs_the_tools(name):
    """Reading which kind a segment is opened it for reading without O_NONBLOCK: a FIFO there
    (left by anyone who can write /dev/shm) hung list, top, gc and inspect, waiting for a writer."""
    os.mkfifo(shm_path(name), 0o600)
    try:
        for args in (("inspect", name), ("list",), ("gc", "--dry-run")):
            r = cli(*args, timeout=30)
            assert "Traceback" not in r.stderr, r.stderr
        assert cli("inspect", name, timeout=30).returncode == 2
    finally:
        os.unlink(shm_path(name))


def test_gc_leaves_a_planted_fifo_alone_and_collects_the_rest(name, monkeypatch):
    """A FIFO planted under a limiter's name (by anyone who can write /dev/shm) is left alone and
    reported, and gc goes on: asking whether a collector had claimed it (``kinds.claimed``) raised
    "not a regular file", and the whole gc ended, exit 2, removing nothing (the dry run, which
    never asks, listed the rest)."""
    fifo, dead = name + "-fifo", name + "-stale"
    os.mkfifo(shm_path(fifo), 0o600)
    try:
        shmlimit.Limiter(dead, rate=10).close()
        for argv in (("gc", "--dry-run"), ("gc",)):
            code, out = run_tools_on(monkeypatch, name, *argv)
            assert code == 0, out
            assert f"left alone (unreadable): {fifo}: segment {fifo!r} is not a regular file" in out
        assert f"removed: {dead}" in out.splitlines() and current_inode(dead) is None
        assert os.path.exists(shm_path(fifo))  # never gc's to remove
    finally:
        os.unlink(shm_path(fifo))


@pytest.mark.parametrize("kind", ["plain", "keyed"])
def test_a_group_claimed_while_opening_is_opened_again_from_the_start(name, monkeypatch, kind):
    """A collector claims a rate's region while an opener attaches to the group (``Collected``):
    the opener closes the rates it attached and opens the group again, every kind of group alike;
    one that stays claimed is a ``SegmentError`` naming it, nothing left mapped."""

    def make():
        if kind == "plain":
            return shmlimit.Limiter(name, rates=["10/s", "5/s"])
        return shmlimit.KeyedLimiter(name, rates=["10/s", "5/s"], keys=100)

    make().close()
    real, mapped, claims = group.region_opener, [], [1]

    # the opener is called once per rate per attempt: count the regions it maps
    def counting(seg, geo, i):
        opener = real(seg, geo, i)

        def open_region():
            if i == 1 and claims:
                claims.pop()
                raise group.Collected()
            got = opener()
            mapped.append(got[0])
            return got

        return open_region

    monkeypatch.setattr(group, "region_opener", counting)
    lim = make()
    try:
        assert len(mapped) == 3  # rate 0, then (claimed) both again
        assert mapped[0].mm is None and all(r.mm is not None for r in mapped[1:])
        assert lim.try_acquire() if kind == "plain" else lim.try_acquire("k")
    finally:
        lim.close()
    # more races lost in a row than the 16 tries an opener makes at once: it keeps trying
    claims[:] = [1] * 40
    mapped.clear()
    lim = make()
    lim.close()
    assert len(mapped) == 42  # rate 0 in each of the 41 tries, rate 1 in the last
    # claimed for good: reported once its time is up, nothing left mapped
    monkeypatch.setattr(segment, "REOPEN_FOR", 0.05)
    claims[:] = [1] * 10**6
    mapped.clear()
    with pytest.raises(shmlimit.SegmentError, match="kept being collected"):
        make()
    assert len(mapped) >= 16 and all(r.mm is None for r in mapped)


# ---- processes beyond the process table --------------------------------------------------------

#: Each kind as a child opens it (``NAME``: the limiter's name); a Limiter's own tables hold one slot.
_BEYOND_KINDS = {
    "limiter": "shmlimit.Limiter(NAME, rate=10, burst=1, slots=1)",
    "rates": "shmlimit.Limiter(NAME, rates={'a': ('10/s', 1), 'b': ('20/s', 1)}, slots=1)",
    "keyed": "shmlimit.KeyedLimiter(NAME, rate=10, burst=1, keys=100)",
    "keyed-rates": "shmlimit.KeyedLimiter(NAME, rates={'a': ('10/s', 1), 'b': ('20/s', 1)}, keys=100)",
    "windows": "WindowTable(NAME, keys=100)",
}

_rows = {"limiter": 1, "rates": 2, "keyed": 1, "keyed-rates": 2, "windows": 1}  # top's rows


def _top(monkeypatch, name):
    """``shmlimit top NAME --once --json``'s rows."""
    code, out = run_tools_on(
        monkeypatch, name, "top", name, "--once", "--json", "--interval", "0.01"
    )
    assert code == 0
    return json.loads(out)["limiters"]


_HOLDER = """
import sys
import shmlimit
from shmlimit.keyed.window_table import WindowTable
NAME = sys.argv[1]
lim = {}
print("ready", flush=True)
sys.stdin.readline()
lim.close()
print("closed", flush=True)
sys.stdin.readline()
"""


def _table(name, slots, offset=0):
    """The process table of ``name``'s segment (or of its region at ``offset``), mapped on its own."""
    with open(shm_path(name), "r+b") as f:
        mm = mmap.mmap(f.fileno(), L.slot_offset(slots), offset=offset)
    return ProcessTable(open_cells(mm, len(mm)), slots)


def _fill_tables(name, kind):
    """Every free slot of the keyed tables of ``name`` taken by this live process: each table with
    the slots it took (none for a Limiter's, whose one slot this process holds)."""
    if kind in ("limiter", "rates"):
        return []
    offsets = [0]
    if kind == "keyed-rates":
        geo = group.copy_geometry(name, L.REGIONS_KEYED)
        offsets = [geo.offset(i) for i in range(len(geo.keys))]
    out = []
    for offset in offsets:
        table = _table(name, K.PSLOTS, offset)
        free = K.PSLOTS - len(table.entries())
        out.append(
            (table, [table.register(os.getpid(), proc_start(os.getpid())) for _ in range(free)])
        )
    return out


@pytest.mark.parametrize("kind", sorted(_BEYOND_KINDS))
def test_gc_keeps_a_limiter_whose_only_user_is_beyond_its_process_table(name, monkeypatch, kind):
    """A live process that found every slot held (by live processes) shares the limit: when the
    listed ones are gone, ``gc`` keeps the segment while it is attached (were it removed, a new
    deploy would make a second limit beside it), says why, and collects it once it closed."""
    expr = _BEYOND_KINDS[kind]
    ours = eval(expr, {"shmlimit": shmlimit, "WindowTable": WindowTable, "NAME": name})
    filled = _fill_tables(name, kind)
    child = subprocess.Popen(
        [sys.executable, "-c", _HOLDER.format(expr), name],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=WORKDIR,
    )
    try:
        assert child.stdout.readline().strip() == "ready"
        for table, slots in filled:
            for i in slots:
                table.unregister(i, os.getpid())
        ours.close()  # every listed process gone: only the child, beyond the tables, uses it
        assert not any(p.alive for p in shmlimit.inspect(name).processes)
        inode = current_inode(name)
        assert stale([name], pytest.fail) == ([], 1)
        assert not collect(name)  # what gc runs for a stale name: it keeps the segment
        code, out = run_tools_on(monkeypatch, name, "gc")
        assert code == 0 and f"kept: {name}: 1 process(es) attached beyond its process" in out
        assert out.splitlines()[-1] == "0 removed, 1 in use" and current_inode(name) == inode
        # and top, judging as gc does, shows it in use, not stale
        assert [r["stale"] for r in _top(monkeypatch, name)] == [False] * _rows[kind]
        # a new deploy shares the child's limit: one segment, not a second beside it
        eval(expr, {"shmlimit": shmlimit, "WindowTable": WindowTable, "NAME": name}).close()
        assert current_inode(name) == inode
        child.stdin.write("\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "closed"  # alive, and counted out
        assert stale([name], pytest.fail) == ([name], 0)
        assert [r["stale"] for r in _top(monkeypatch, name)] == [True] * _rows[kind]
        assert collect(name) and current_inode(name) is None
    finally:
        child.stdin.close()
        child.wait()


def test_a_process_beyond_the_table_keeps_it_live_until_it_closes(name):
    """A process that gets no slot (the one slot held by a live process) is counted beyond the
    table: the table is ``live`` while it is attached, as for a registered one, and not once it
    closed; counted out once (a close after its leave takes nothing more), a forked child's count
    its own."""
    shmlimit.Limiter(name, rate=10, slots=1).close()
    child = subprocess.Popen(
        [sys.executable, "-c", _HOLDER.format("shmlimit.Limiter(NAME)"), name],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=WORKDIR,
    )
    try:
        assert child.stdout.readline().strip() == "ready"  # it holds the one slot
        table = _table(name, 1)
        lim = shmlimit.Limiter(name)
        assert lim._att.slot is None and table.beyond() == 1
        child.stdin.write("\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "closed"
        assert not table.entries() and table.live()  # nobody listed, yet in use
        pid = os.fork()
        if pid == 0:  # a forked child: not counted until its use, then counted itself
            ok = table.beyond() == 1
            lim.try_acquire()
            ok = ok and lim._att.slot == 0 and table.beyond() == 1  # (the slot is free now)
            lim.close()
            os._exit(0 if ok and table.beyond() == 1 and not table.entries() else 1)
        assert os.waitpid(pid, 0)[1] == 0
        assert table.beyond() == 1 and table.live()  # the parent's count is the parent's
        lim._att.leave()
        assert table.beyond() == 0 and not table.live()
        lim.close()
        assert table.beyond() == 0 and not table.live()
    finally:
        child.stdin.close()
        child.wait()


def _use_beyond(name):
    """A multiprocessing child's work: one grant, taken beyond the table (its one slot held)."""
    lim = shmlimit.Limiter(name)
    assert lim.try_acquire() and lim._att.slot is None
    return lim._att.pid


@pytest.mark.parametrize("how", ["process", "pool"])
def test_a_multiprocessing_child_beyond_the_table_is_counted_out_as_it_ends(name, how):
    """A ``multiprocessing`` child ends with ``os._exit`` (no ``atexit`` hook): one that used a
    limiter beyond its process table takes its count back as it ends, or ``gc`` would keep the
    segment for good and a redeploy with a new config would be refused."""
    ours = shmlimit.Limiter(name, rate=1000, slots=1)
    assert ours.try_acquire() and ours._att.slot == 0  # the one slot: the children go beyond
    table = _table(name, 1)
    ctx = multiprocessing.get_context("fork")
    if how == "process":
        child = ctx.Process(target=_use_beyond, args=(name,))
        child.start()
        child.join()
        assert child.exitcode == 0
    else:
        with ctx.Pool(2) as pool:
            pids = set(pool.map(_use_beyond, [name] * 4))
            pool.close()
            pool.join()
        assert pids and os.getpid() not in pids
    assert table.beyond() == 0
    ours.close()
    assert stale([name], pytest.fail) == ([name], 0)


def test_opening_and_closing_beyond_the_table_leaves_no_exit_hook_behind(name):
    """Each open beyond the table registers the exit hook that counts it out in a
    ``multiprocessing`` child; a close that counts it out cancels it, so a process that opens and
    closes such a limiter often does not pile them up."""
    ours = shmlimit.Limiter(name, rate=1000, slots=1)
    assert ours.try_acquire() and ours._att.slot == 0  # the one slot: the child goes beyond
    script = (
        "import sys, multiprocessing.util as u, shmlimit\n"
        "before = len(u._finalizer_registry)\n"
        "for _ in range(50):\n"
        "    lim = shmlimit.Limiter(sys.argv[1])\n"
        "    assert lim.acquire() and lim._att.slot is None\n"
        "    lim.close()\n"
        "print(len(u._finalizer_registry) - before)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script, name], capture_output=True, text=True, cwd=WORKDIR
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "0"
    assert _table(name, 1).beyond() == 0
    ours.close()
