"""``shmlimit top`` and ``shmlimit inspect`` of an adaptive keyed limiter: each key's rate in force.

A key's adapted rate is its override: ``top`` shows it for the busiest keys it samples,
``inspect`` for the keys at a rate of their own (the lowest first), both with the adaptive
totals.  Decisions are made on a fake clock (``KeyedLimiter._report``, what ``feedback`` runs);
the tools run as real subprocesses, reading copies.  Run on both backends (``SHMLIMIT_BACKEND``).
"""

import json

from support.clock import FakeClock
from support.procs import run_cli

import shmlimit
from shmlimit.cli import top
from shmlimit.keyed import layout as K
from shmlimit.keyed.gcra import write_bank

S = 10**9
ADAPT = shmlimit.Adapt(min_rate=10, max_rate=1000, increase=10)


def _cut(lim, key, clock):
    """One throttled window for ``key``: 100/s becomes 80/s."""
    lim._report(True, key, clock)
    clock.advance(S // 4)
    lim._report(False, key, clock)


def _adaptive(name, **kw):
    return shmlimit.KeyedLimiter(name, rate=100, keys=1000, adapt=ADAPT, **kw)


def test_top_shows_each_busy_keys_rate_in_force_and_the_totals(name, cleanup):
    lim = _adaptive(name, store_keys=True)
    cleanup.append(lim)
    clock = FakeClock()
    for key, n in (("slow.example", 3), ("fast.example", 2), ("plain.example", 1)):
        for _ in range(n):
            assert lim.acquire(key)  # (a key's capacity is one op: 10 ms of schedule)
    _cut(lim, "slow.example", clock)
    lim._report(False, "fast.example", clock)  # an entry at the default: its rate in force
    r = run_cli("top", name, "--once", "--json", "--interval", "0.1")
    assert r.returncode == 0, r.stderr
    (rec,) = json.loads(r.stdout)["limiters"]
    rates = {k["key"]: (k["grants"], k["rate"]) for k in rec["busiest"]}
    assert rates == {
        "slow.example": (3, 80.0),
        "fast.example": (2, 100.0),
        "plain.example": (1, None),  # no outcome reported: it follows the default
    }
    a = rec["adapt"]
    assert (a["throttled"], a["ok"], a["cuts"], a["raises"]) == (1, 2, 1, 0)
    text = top.render([rec], 0.1)
    assert "adaptive: each key's rate from 10 to 1000 every 0.25 s" in text
    assert "outcomes 1 throttled, 2 ok  cuts 1  raises 0" in text
    lines = {line.split()[0]: line for line in text.splitlines() if ".example" in line}
    assert lines["slow.example"].endswith("80/1s")
    assert lines["plain.example"].endswith("default")


def test_top_shows_each_rate_of_a_keyed_group_per_key(name, cleanup):
    clock = FakeClock()
    lim = shmlimit.KeyedLimiter(
        name,
        rates={"requests": 100, "tokens": 1000},
        adapt={"requests": ADAPT, "tokens": shmlimit.Adapt(100, 5000)},
        keys=1000,
        clock=clock,
    )
    cleanup.append(lim)
    assert lim.try_acquire("a.example")
    lim.feedback(True, "a.example", which="requests")
    clock.advance(S // 4)
    lim.feedback(False, "a.example")
    rows = {r["name"]: r for r in top.Inspector([name]).sample()}
    (req,) = rows[f"{name}[requests]"]["busiest"]
    (tok,) = rows[f"{name}[tokens]"]["busiest"]
    assert (req["rate"], tok["rate"]) == (80.0, 1000.0)  # each rate's own window for the key
    assert rows[f"{name}[requests]"]["adapt"]["cuts"] == 1
    assert rows[f"{name}[tokens]"]["adapt"]["cuts"] == 0
    r = run_cli("inspect", name, "--json")
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)["rates"]
    assert [k["rate"] for k in got["requests"]["adapted_keys"]] == [80.0]
    assert [k["rate"] for k in got["tokens"]["adapted_keys"]] == [1000.0]


def test_inspect_lists_the_keys_at_their_own_rate_lowest_first(name, cleanup):
    lim = _adaptive(name, store_keys=True)
    cleanup.append(lim)
    clock = FakeClock()
    assert lim.try_acquire("slow.example")
    _cut(lim, "slow.example", clock)
    _cut(lim, "slow.example", clock)  # 64/s
    lim._report(False, "quiet.example", clock)  # an entry, but no slot: never acquired
    lim.set_rate(500, key="fast.example")
    assert lim.acquire("fast.example") and lim.acquire("fast.example")
    r = run_cli("inspect", name, "--json")
    assert r.returncode == 0, r.stderr
    snap = json.loads(r.stdout)
    assert snap["adapt"]["cuts"] == 2
    keys = [(k["key"], k["rate"], k["grants"]) for k in snap["adapted_keys"]]
    assert keys[0] == ("slow.example", 64.0, 1) and keys[2] == ("fast.example", 500.0, 2)
    assert keys[1][1:] == (100.0, 0) and keys[1][0].startswith("#")  # no slot: its digest
    r = run_cli("inspect", name)
    assert r.returncode == 0, r.stderr
    assert "keys at their own rate, lowest first (3 of 3)" in r.stdout
    assert "outcomes 2 throttled, 3 ok  cuts 2  raises 0" in r.stdout
    slow = next(line for line in r.stdout.splitlines() if "slow.example" in line)
    assert "rate          64/1s" in slow


def test_inspect_of_a_table_that_does_not_adapt_lists_no_keys(name, cleanup):
    lim = shmlimit.KeyedLimiter(name, rate=100, keys=1000)
    cleanup.append(lim)
    lim.set_rate(5, key="a.example")
    r = run_cli("inspect", name, "--json")
    assert r.returncode == 0, r.stderr
    snap = json.loads(r.stdout)
    assert snap["adapt"] is None and "adapted_keys" not in snap


def test_a_forged_override_is_skipped_and_crashes_nothing(name, cleanup):
    """An override whose banks a forger wrote with valid checksums but a per of 0 and a NaN rate:
    inspect and top still run, and that entry is read as corrupt, as a bad checksum: not shown."""
    lim = _adaptive(name, store_keys=True)
    cleanup.append(lim)
    clock = FakeClock()
    assert lim.try_acquire("real.example")
    _cut(lim, "real.example", clock)
    lim.set_rate(200, key="forged.example")
    assert lim.try_acquire("forged.example")
    att = lim._use()
    d = att.kt.digest("forged.example")
    e = att.overrides.entry(d)
    nan, zero = 0x7FF8000000000000, 0
    for line in (e + K.O_BANKS[0], e + K.O_BANKS[1]):
        write_bank(att.cells, line, d, (nan, zero, zero, 1, 1), att.cells.load(K.CFG_SEQ) & ~1)
    r = run_cli("inspect", name, "--json")
    assert r.returncode == 0, r.stderr
    keys = json.loads(r.stdout)["adapted_keys"]
    assert [k["key"] for k in keys] == ["real.example"]
    r = run_cli("top", name, "--once", "--interval", "0.1")
    assert r.returncode == 0, r.stderr
