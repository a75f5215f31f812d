"""The live inspector and gc, run as real subprocesses against limiters used by other processes."""

import json
import os
import select
import signal
import subprocess
import sys
import time

import pytest
from support.procs import CLI, ROOT, WORKDIR, start_on_terminal, wait_exit, wait_for
from support.procs import run_cli as cli
from support.procs import start_acquirer as start_worker
from support.segments import run_tools_on
from support.starvation import assert_rate, run_delay

import shmlimit


# top's grants per real second
@pytest.mark.slow
def test_once_json_matches_inspect_and_measures_the_rate(name):
    shmlimit.Limiter(name, rate=200).close()
    workers = [start_worker(name) for _ in range(2)]
    try:
        # what the machine withheld from the workers, read around top's whole run (its 1 s interval
        # lies inside): the rate's floor drops by it only (support.starvation), ~0 on a quiet machine
        starved0, delays0 = (
            shmlimit.inspect(name).starved_seconds,
            [run_delay(w.pid) for w in workers],
        )
        r = cli("top", name, "--once", "--json", "--interval", "1.0")
        starved = shmlimit.inspect(name).starved_seconds - starved0
        delays = [
            None if a is None or b is None else b - a
            for a, b in zip(delays0, (run_delay(w.pid) for w in workers))
        ]
        assert r.returncode == 0, r.stderr
        snap = json.loads(r.stdout.strip())
        [rec] = snap["limiters"]
        live = shmlimit.inspect(name)
        for field in ("name", "rate", "per", "capacity", "capped", "ratio"):
            assert rec[field] == getattr(live, field)
        assert_rate(rec["grants_per_second"], 200, 1.0, 0.1, starved, delays)  # grants in top's 1 s
        assert rec["stale"] is False and rec["filler_pid"] in {w.pid for w in workers}
        procs = {p["pid"]: p for p in rec["processes"]}
        assert set(procs) == {w.pid for w in workers}
        assert all(p["alive"] and p["command"].startswith("python") for p in procs.values())
    finally:
        for w in workers:
            w.kill()
            w.wait()


@pytest.mark.parametrize("sigint", ["default", "ignored"])
@pytest.mark.slow
def test_live_view_refreshes_in_place_under_a_terminal(name, sigint):
    """Ctrl-C ends the live view cleanly, also when the test run itself ignores SIGINT.

    A run started with ``nohup`` (or as a background job of a non-interactive
    shell) ignores SIGINT; the terminal the tool runs on must not inherit that.
    """
    shmlimit.Limiter(name, rate=100).close()
    worker = start_worker(name)
    previous = signal.signal(
        signal.SIGINT, signal.SIG_IGN if sigint == "ignored" else signal.SIG_DFL
    )
    try:
        pid, fd = start_on_terminal(
            [sys.executable, os.path.join(ROOT, "tools", "shmtop"), name, "--interval", "0.2"]
        )
    finally:
        signal.signal(signal.SIGINT, previous)
    out = b""
    try:
        end = time.monotonic() + 10
        while out.count(b"\x1b[H\x1b[2J") < 3 and time.monotonic() < end:
            ready, _, _ = select.select([fd], [], [], 0.5)
            if ready:
                try:
                    out += os.read(fd, 65536)
                except OSError:
                    break
        os.kill(pid, signal.SIGINT)
        status = wait_exit(pid, 10)
    finally:
        os.close(fd)
        worker.kill()
        worker.wait()
    text = out.decode(errors="replace")
    assert out.count(b"\x1b[H\x1b[2J") >= 3, text[-500:]
    assert name in text and "grants/s" in text and "alive" in text
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0  # Ctrl-C is a clean exit
    assert "Traceback" not in text


def test_a_killed_worker_shows_dead_and_the_segment_stale(name):
    shmlimit.Limiter(name, rate=100).close()
    worker = start_worker(name)
    worker.send_signal(signal.SIGKILL)
    worker.wait()
    r = cli("top", name, "--once", "--json", "--interval", "0.1")
    [rec] = json.loads(r.stdout)["limiters"]
    [proc] = [p for p in rec["processes"] if p["pid"] == worker.pid]
    assert proc["alive"] is False and rec["stale"] is True
    text = cli("top", name, "--once", "--interval", "0.1").stdout
    assert "DEAD" in text and "STALE" in text


def test_gc_removes_only_stale_segments(name, monkeypatch):
    # gc run over this test's segments only: over every one on the machine it would also collect
    # those of another test run between a close and its next attach (as it should: nobody uses them)
    stale, used = name + "-stale", name + "-used"
    shmlimit.Limiter(stale, rate=10).close()
    shmlimit.Limiter(used, rate=10).close()
    worker = start_worker(used)
    try:
        code, out = run_tools_on(monkeypatch, name, "gc", "--dry-run")
        assert code == 0 and f"stale: {stale}" in out and used not in out
        assert stale in shmlimit.list_names()  # dry run removes nothing
        code, out = run_tools_on(monkeypatch, name, "gc")
        assert code == 0 and f"removed: {stale}" in out
        names = shmlimit.list_names()
        assert stale not in names and used in names
    finally:
        worker.kill()
        worker.wait()
        shmlimit.unlink(used)


def test_inspecting_never_registers_or_changes_anything(name):
    lim = shmlimit.Limiter(name, rate=10)
    lim.acquire()
    before = shmlimit.inspect(name)
    for args in (("top", name, "--once", "--interval", "0.05"), ("inspect", name), ("list",)):
        assert cli(*args).returncode == 0
    after = shmlimit.inspect(name)
    assert [p.pid for p in after.processes] == [os.getpid()] and after.grants == before.grants
    lim.close()


@pytest.mark.parametrize(
    "args",
    [["top", "no-such-limiter"]]
    + [["top", "--once", "--interval", v] for v in ("0", "x", "inf", "nan", "1e300", "86401")],
)
def test_top_mistakes_exit_2_without_traceback(args):
    r = cli(*args)
    assert r.returncode == 2 and "Traceback" not in r.stderr and r.stderr.strip()
    if "--interval" in args:
        assert (
            r.stderr.strip()
            .splitlines()[-1]
            .endswith(f"--interval: must be a positive number at most 86400, got {args[-1]!r}")
        )


def _records(n_live, n_stale):
    """Snapshots as the Inspector makes them: ``n_live`` limiters in use, the i-th at i grants per
    second, and ``n_stale`` that no live process uses."""
    out = []
    for i in range(n_live + n_stale):
        stale = i >= n_live
        out.append(
            {"name": f"lim-{i:03d}-" + "x" * 40, "kind": "", "rate": 100.0, "per": 1.0,
             "grants": i, "grants_per_second": float(i) if not stale else 0.0, "history": [1.0, 2.0],
             "stale": stale, "stopped": False,
             "processes": [] if stale else [{"alive": True, "pid": 1, "grants": i}]}
        )  # fmt: skip
    return out


def test_table_fits_sorts_by_activity_and_hides_the_stale():
    from shmlimit.cli.top import table

    text = table(_records(50, 10), 1.0, width=80, height=24)
    lines = text.splitlines()
    assert len(lines) == 24 and max(map(len, lines)) <= 80
    assert lines[1].split()[:3] == ["NAME", "KIND", "RATE"]  # the header
    rows = lines[2:-1]
    assert [r.split()[0][:7] for r in rows] == [f"lim-{i:03d}" for i in range(49, 28, -1)]
    assert lines[-1] == "... 29 more below, 10 stale hidden (--all shows them)"
    shown = table(_records(50, 10), 1.0, width=80, height=None, show_stale=True).splitlines()
    assert len(shown) == 62 and sum("STALE" in line for line in shown) == 10
    assert max(map(len, table(_records(3, 0), 1.0, width=40).splitlines())) <= 40


def test_top_once_fits_80_by_24_with_60_limiters():
    """Whatever else the machine holds, the view is at most LINES lines of COLUMNS characters;
    of this test's limiters, the busiest (the one a worker uses) comes first."""
    prefix = f"top-{os.getpid()}-"  # short: the 80-column table shows it whole
    lims = [shmlimit.Limiter(f"{prefix}{i:02d}", rate=100) for i in range(60)]
    worker = start_worker(lims[37].name)
    wait_for(lambda: shmlimit.inspect(lims[37].name).grants > 0, timeout=60)  # it is busy now
    env = dict(os.environ, COLUMNS="80", LINES="24")
    try:
        for extra in ([], ["--all"]):
            r = subprocess.run(
                [*CLI, "top", "--once", "--interval", "1.0", *extra],
                env=env, capture_output=True, text=True, timeout=120, cwd=WORKDIR,
            )  # fmt: skip
            lines = r.stdout.splitlines()
            assert r.returncode == 0, r.stderr
            assert len(lines) <= 24 and max(map(len, lines)) <= 80, r.stdout
            assert lines[1].startswith("NAME") and lines[-1].startswith("... ")
            ours = [line.split()[0] for line in lines[2:] if line.startswith(prefix)]
            assert ours and ours[0] == f"{prefix}37", r.stdout  # the busiest first
    finally:
        worker.kill()
        worker.wait()
        for lim in lims:
            lim.close()
            lim.unlink()


def test_detail_escapes_a_key_as_every_other_stored_string():
    """A key's invisible character is shown as its escape, the one ``printable`` writes for every
    string from a segment (a wide one as \\uXXXX: once \\x200b, which reads as a space and 0b)."""
    from shmlimit.cli.top import render

    keyed = {"name": "k", "kind": "keyed", "rate": 5.0, "per": 1.0, "capacity": 5.0,
             "overrides": 0, "override_slots": 8, "grants": 3, "stale": False, "keys": 1,
             "slots": 64, "evicted": 0, "refused_full": 0, "grants_per_second": None,
             "history": [], "adapt": None, "processes": [],
             "busiest": [{"key": "a\u200b\x1b", "grants": 3, "wait": 0.0, "rate": None,
                          "per": None}]}  # fmt: skip
    text = render([keyed], 1.0)
    assert "  a\\u200b\\x1b " in text and "\u200b" not in text and "\x1b" not in text


def test_the_inspector_forgets_a_limiter_that_is_gone(name):
    """Rates, history and the keys sampled are kept for the limiters there at each sample only."""
    from shmlimit.cli.top import Inspector

    names = [f"{name}-plain", f"{name}-keyed"]
    lims = [shmlimit.Limiter(names[0], rate=100), shmlimit.KeyedLimiter(names[1], rate=1, keys=64)]
    insp = Inspector(names)
    for i in range(3):
        lims[1].try_acquire(f"user-{i}")
        insp.sample()
    kept = (insp.prev, insp.history, insp.cursor, insp.seen_keys)
    assert [set(d) for d in kept] == [set(names), set(names), {names[1]}, {names[1]}]
    for lim in lims:
        lim.close()
        lim.unlink()
    assert all("error" in r for r in insp.sample())  # named, so listed: unreadable now
    assert kept == ({}, {}, {}, {})


def test_a_rate_row_keeps_its_key_and_limiters_are_counted_once():
    """A limiter of several rates has a row per rate: a long name is cut before its key, and it
    counts as one limiter."""
    from shmlimit.cli.top import render, table

    recs = _records(3, 0)
    keys = ["[per-second]", "[per-minute]", "[per-hour]"]
    for r, key in zip(recs, keys):
        r["name"] = "a-group-of-several-rates-named-at-length-" + "y" * 20 + key
    lines = table(recs, 1.0, width=80).splitlines()
    assert lines[0].endswith(": 1 limiter(s)")
    assert [line.split()[0].split("~")[1] for line in lines[2:]] == keys[::-1]  # busiest first
    gone = [{"name": r["name"], "error": "gone"} for r in recs]
    assert render(gone, 1.0).splitlines()[0].endswith(", 1 limiter(s)")
