"""A table of window counters (the ``limits`` storage ``shm://``) as the tools show it: what it is
(windows, keys, counts, the processes counting), never a limiter with a rate of 0; and its users
listed as a keyed limiter's are (a forked child on its first hit, a killed one as dead)."""

import json
import os
import signal
import time

import pytest
from support.clock import FakeClock
from support.procs import kill_all, read_exactly
from support.procs import run_cli as cli
from support.segments import run_tools_on

import shmlimit
from shmlimit.keyed.stats import sample_windows
from shmlimit.keyed.window_table import WindowTable


@pytest.fixture
def table(name):
    # top shows the first bytes of its keys; 512 slots, and 1024 of moving windows
    t = WindowTable(name, keys=512, moving_keys=1024, store_keys=True)
    yield t
    t.close()


def _fill(t):
    for _ in range(5):
        t.incr("LIMITER/a/3/1/minute", 60, limit=3)
    for _ in range(7):
        t.acquire_sliding("LIMITER/b/5/10/second", 5, 10)
    return 3 + 5  # the hits granted: 3 of the fixed window's 5, 5 of the sliding window's 7


def test_inspect_shows_windows_keys_and_the_hits_counted(table, name):
    hits = _fill(table)
    s = shmlimit.inspect(name)
    assert s.kind == "windows" and s.keys == 2 and s.slots == 1536 and s.grants == hits
    assert s.hits == 5 + 7  # every hit asked, granted or not
    assert [(p.pid, p.alive, p.grants) for p in s.processes] == [(os.getpid(), True, hits)]
    r = cli("inspect", name)
    assert r.returncode == 0, r.stderr
    fields = dict(line.split(None, 1) for line in r.stdout.splitlines() if not line.startswith(" "))
    assert fields["kind"] == "windows" and fields["keys"] == "2" and fields["grants"] == str(hits)
    assert not {"rate", "per", "capacity", "overrides"} & set(fields)  # no rate of 0 shown


def test_keys_of_moving_windows_count_among_the_slots(name, monkeypatch):
    """Every slot a key can hold is counted in ``slots``, moving windows' too: the keys live (of
    every kind of window) are never more than the slots, in inspect, list and metrics alike."""
    t = WindowTable(name, keys=8, moving_keys=256, moving_log=8)
    try:
        for i in range(200):
            assert t.acquire_entry(f"k{i}", 5, 60)
        s = shmlimit.inspect(name)  # a few keys evicted where their windows of slots met
        assert s.slots == 8 + 256 and 150 < s.keys <= 200 and t.keys_live == s.keys
        assert f"{s.keys}/264 keys" in cli("list").stdout
        code, out = run_tools_on(monkeypatch, name, "metrics", name)
        assert code == 0
        assert f'shmlimit_keyed_keys{{limiter="{name}"}} {s.keys}.0' in out
        assert f'shmlimit_keyed_slots{{limiter="{name}"}} 264.0' in out
        assert f"keys={s.keys}/264 " in repr(t)
    finally:
        t.close()


def test_tables_of_one_name_in_a_process_share_its_one_slot(table, name):
    """Every handle of a name in a process is one attachment, as for every kind: one slot, one
    entry in the tools, the hits of each counted there; closing one leaves the others working."""
    other = WindowTable(name, keys=512, moving_keys=1024)
    try:
        table.incr("a", 60, limit=5)
        other.incr("a", 60, limit=5)  # the same key's window: the table is one
        assert [(p.pid, p.grants) for p in shmlimit.inspect(name).processes] == [(os.getpid(), 2)]
        table.close()
        assert other.incr("a", 60) == 3 and other.get("a") == 3
        assert [p.pid for p in shmlimit.inspect(name).processes] == [os.getpid()]
    finally:
        other.close()
    assert not shmlimit.inspect(name).processes  # the last handle closed: the slot given back


def test_list_shows_a_window_table_as_one(table, name):
    hits = _fill(table)
    [row] = [line for line in cli("list").stdout.splitlines() if line.startswith(name)]
    assert (
        row.split()[1:6] == ["windows", "-", "2/1536", "keys", str(hits)]
        and "limits storage" in row
    )
    assert "0/0s" not in row
    [rec] = [r for r in json.loads(cli("list", "--json").stdout) if r["name"] == name]
    assert rec["kind"] == "windows" and rec["keys"] == 2 and rec["grants"] == hits


def test_top_shows_the_fullest_windows_and_their_counts(table, name):
    hits = _fill(table)
    r = cli("top", name, "--once", "--interval", "0.05")
    assert r.returncode == 0, r.stderr
    assert "rate 0" not in r.stdout and f"windows: a limits storage (shm://{name})" in r.stdout
    assert "keys 2/1536" in r.stdout and f"hits {hits}" in r.stdout and "STALE" not in r.stdout
    fixed = next(line for line in r.stdout.splitlines() if "LIMITER/a/3/1/m..." in line).split()
    sliding = next(line for line in r.stdout.splitlines() if "LIMITER/b/5/10/..." in line).split()
    assert fixed[1:4] == ["fixed", "5", "-"] and sliding[1:4] == ["sliding", "5", "0"]
    assert 0 < float(fixed[4]) <= 60.001 and 0 < float(sliding[4]) <= 10.001
    snap = json.loads(cli("top", name, "--once", "--json", "--interval", "0.05").stdout)
    [rec] = snap["limiters"]
    assert rec["kind"] == "windows" and rec["stale"] is False
    assert {(w["key"], w["strategy"], w["count"]) for w in rec["windows"]} == {
        ("LIMITER/a/3/1/m...", "fixed", 5),  # the first 15 bytes kept (store_keys=True)
        ("LIMITER/b/5/10/...", "sliding", 5),
    }


def test_sampled_windows_follow_the_clock(name):
    """The sample reads the counters as the strategies do: a sliding window that ended is the
    previous one; a fixed window that ended, or a sliding key two windows old, is not listed."""
    clock = FakeClock(
        time.monotonic_ns() // 10**6 * 10**6
    )  # on a whole millisecond, as the counters count
    t = WindowTable(name, keys=64, clock=clock, store_keys=True)

    def sample():
        return {
            w.key: (w.strategy, w.count, w.previous, w.window, round(w.ends_in, 3))
            for w in sample_windows(name, 0, 64, now_ns=clock())[0]
        }

    try:
        assert t.incr("f", 1) == 1 and t.acquire_sliding("s", 10, 2, 3)
        first = sample()
        assert first["f"] == (
            "fixed",
            1,
            0,
            None,
            1.001,
        )  # a fixed window lasts 1 ms more than asked
        assert first["s"] == ("sliding", 3, 0, 2.0, 2.0)
        clock.advance_seconds(1.5)
        assert set(sample()) == {"s"} and sample()["s"] == (
            "sliding",
            3,
            0,
            2.0,
            0.5,
        )  # f's window ended
        clock.advance_seconds(
            1.0
        )  # the sliding window ended without another hit: it is the previous
        assert sample()["s"] == ("sliding", 0, 3, 2.0, 1.5)
        assert t.acquire_sliding(
            "s", 10, 2, 1
        )  # a hit moves the slot on: the same counts, now stored
        assert sample()["s"] == ("sliding", 1, 3, 2.0, 1.5)
        clock.advance_seconds(4.0)  # two windows without a hit: nothing left to show
        assert sample() == {}
    finally:
        t.close()


def test_metrics_give_a_window_table_no_rate(table, name):
    from shmlimit.cli.metrics import families

    hits = _fill(table)
    fams = {
        f.name: {dict(labels).get("limiter"): v for labels, v in f.samples}
        for f in families([name])
    }
    assert fams["shmlimit_grants"][name] == hits and fams["shmlimit_processes"][name] == 1
    assert fams["shmlimit_window_hits"][name] == 12
    assert fams["shmlimit_keyed_keys"][name] == 2
    assert (
        name not in fams["shmlimit_rate_ops_per_second"]
        and name not in fams["shmlimit_capacity_ops"]
    )
    assert name not in fams["shmlimit_keyed_overrides"]


def _listed(name):
    return {p.pid: p.alive for p in shmlimit.inspect(name).processes}


def test_forked_users_are_listed_on_first_use_and_a_killed_one_as_dead(table, name):
    table.incr("k", 60)
    r_go, w_go = os.pipe()
    r_done, w_done = os.pipe()
    r_end, w_end = os.pipe()
    pids = []
    for use in (None, "inherited", "its own"):
        pid = os.fork()
        if pid == 0:  # a worker forked from the master holding the storage
            try:
                os.read(r_go, 1)
                if (
                    use
                ):  # the table inherited, or a handle of its own (sharing the inherited mapping)
                    (table if use == "inherited" else WindowTable(name)).incr("k", 60)
                os.write(w_done, b"1")
                os.read(r_end, 1)  # until the master lets go (or kills us)
            finally:
                os._exit(0)
        pids.append(pid)
    try:
        assert _listed(name) == {os.getpid(): True}
        os.write(w_go, b"ggg")
        read_exactly(r_done, 3)  # each answers after its hit
        # the one that never counted is not listed; the two that did are, alive
        assert _listed(name) == {os.getpid(): True, pids[1]: True, pids[2]: True}
        os.kill(pids[1], signal.SIGKILL)
        os.waitpid(pids[1], 0)
        assert _listed(name) == {os.getpid(): True, pids[1]: False, pids[2]: True}
        assert shmlimit.inspect(name).hits == 3  # the dead one's hit stays counted
    finally:
        os.write(w_end, b"xxx")
        kill_all(pids)
        for fd in (r_go, w_go, r_done, w_done, r_end, w_end):
            os.close(fd)


def test_gc_and_doctor_count_unused_keyed_tables_as_stale(name, monkeypatch):
    from shmlimit.cli import doctor

    windows, keyed = name + "-w", name + "-k"
    WindowTable(windows, keys=64).close()  # no process uses either now
    shmlimit.KeyedLimiter(keyed, rate=10, keys=64).close()
    [found] = doctor.check_segments(names=[windows, keyed])  # neither unreadable
    assert found.level == "warn" and found.message == (
        f"2 limiter(s) no live process uses ({windows}, {keyed}): 'shmlimit gc' removes them"
    )
    out = run_tools_on(monkeypatch, name, "gc", "--dry-run")[1]  # this test's segments only
    assert f"stale: {windows}" in out and f"stale: {keyed}" in out and "2 stale, 0 in use" in out
    assert {windows, keyed} <= set(shmlimit.list_names())
    out = run_tools_on(monkeypatch, name, "gc")[1]
    assert f"removed: {windows}" in out and f"removed: {keyed}" in out
    assert not {windows, keyed} & set(shmlimit.list_names())


@pytest.mark.parametrize("strategy", ["fixed-window", "sliding-window-counter", "moving-window"])
def test_metrics_count_grants_and_hits_apart(name, strategy):
    """10 granted of 50 hits: shmlimit_grants_total says 10, shmlimit_window_hits_total 50."""
    limits = pytest.importorskip("limits")
    parser = pytest.importorskip("prometheus_client.parser")
    import shmlimit.integrations.limits  # noqa: F401  (registers shm://)
    from shmlimit.cli import metrics

    store = limits.storage.storage_from_string(f"shm://{name}?keys=64&moving_keys=8")
    try:
        limiter = limits.strategies.STRATEGIES[strategy](store)
        item = limits.parse("10/minute")
        assert sum(limiter.hit(item, "client") for _ in range(50)) == 10
        text = metrics.exposition(metrics.families([name]))
    finally:
        store.table.close()
    values, helps = {}, {}
    for fam in parser.text_string_to_metric_families(text):
        helps[fam.name] = fam.documentation
        for sample in fam.samples:
            values[(sample.name, sample.labels.get("limiter"))] = sample.value
    assert values[("shmlimit_grants_total", name)] == 10
    assert values[("shmlimit_window_hits_total", name)] == 50
    assert "granted" in helps["shmlimit_grants"] and "refused" in helps["shmlimit_window_hits"]


def test_set_rate_says_a_window_table_has_no_rate_to_change(table, name):
    """``set-rate`` called a window table "a keyed limiter or one of several rates" and sent its
    user to ``create`` (which refuses a window table) or to a ``set_rate`` it does not have."""
    _fill(table)
    r = cli("set-rate", name, "10")
    assert r.returncode == 2
    assert "is a window table (window counters)" in r.stderr and f"shm://{name}" in r.stderr
    assert "keyed limiter or one of several rates" not in r.stderr
    assert "set_rate" not in r.stderr and "shmlimit create" not in r.stderr
    assert shmlimit.inspect(name).grants == 8  # nothing changed
