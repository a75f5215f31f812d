"""Prometheus metrics: ``shmlimit metrics`` (printed and served) and the prometheus_client collector.

Every exposition is parsed with prometheus_client's own parser, and reading must never join a
limiter: the reading process is never listed in the process table and never runs the filler.
"""

import multiprocessing as mp
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

import pytest

import shmlimit

parser = pytest.importorskip("prometheus_client.parser")
CLI = [sys.executable, "-m", "shmlimit.cli.main"]


def parse(text):
    """{(sample name, limiter label or None): value}, and the family types, via prometheus_client."""
    values, types = {}, {}
    for fam in parser.text_string_to_metric_families(text):
        types[fam.name] = fam.type
        for s in fam.samples:
            values[(s.name, s.labels.get("limiter"))] = s.value
    return values, types


def _queue_forever(name, ready):
    lim = shmlimit.attach(name)
    ready.set()
    lim.acquire()  # rate 1 per 60 s with the bucket drained: queues for a minute


def _wait_for(pred, timeout=20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.01)
    return False


@pytest.fixture
def busy(name):
    """A limiter with 3 grants, a drained bucket and one other process queued on it."""
    lim = shmlimit.Limiter(name, rate=1, per=60, burst=3)
    assert lim.try_acquire(3)
    ctx = mp.get_context("fork")
    ready = ctx.Event()
    p = ctx.Process(target=_queue_forever, args=(name, ready), daemon=True)
    p.start()
    assert ready.wait(30)
    assert _wait_for(lambda: any(x.waiting for x in shmlimit.inspect(name).processes))
    yield lim, p
    p.kill()
    p.join(10)
    lim.close()


def scrape_with_a_live_filler(scrape, name):
    """Parsed metrics from a scrape taken while some process held the filler lease.

    On a busy machine a filler thread can miss its 50 ms lease renewal; the
    heartbeat gauge is then absent, as documented, until a filler holds it again.
    """
    deadline = time.monotonic() + 30  # (a loaded machine's filler takes its lease back by then)
    while True:
        values, types = parse(scrape())
        if ("shmlimit_filler_heartbeat_age_seconds", name) in values:
            return values, types
        assert time.monotonic() < deadline, "no scrape saw a live filler in 30 s"
        time.sleep(0.01)  # (a scrape is a whole segment scan: no busy loop against the filler)


def check(values, types, name, child_pid):
    live = shmlimit.inspect(name)
    assert values[("shmlimit_grants_total", name)] == live.grants == 3
    assert types["shmlimit_grants"] == "counter"
    assert values[("shmlimit_rate_ops_per_second", name)] == pytest.approx(1 / 60)
    assert values[("shmlimit_capacity_ops", name)] == 3
    assert values[("shmlimit_available_ops", name)] == 0
    assert values[("shmlimit_waiting_processes", name)] == 1
    assert values[("shmlimit_processes", name)] == 2
    assert 0 < values[("shmlimit_deficiency_seconds", name)] <= 60
    assert (
        0.9 < values[("shmlimit_deficiency_ops", name)] <= 1
    )  # one op owed, shrinking as time passes
    assert 0 <= values[("shmlimit_filler_heartbeat_age_seconds", name)] < 5
    assert values[("shmlimit_stopped", name)] == 0
    assert (
        values[("shmlimit_starved_seconds_total", name)] == live.starved_seconds == 0
    )  # a healthy host
    assert types["shmlimit_starved_seconds"] == "counter"
    # reading never joined: only this process and the queued child are listed
    assert sorted(p.pid for p in live.processes) == sorted([os.getpid(), child_pid])
    assert _wait_for(lambda: shmlimit.inspect(name).filler_pid in (os.getpid(), child_pid))


def test_cli_prints_exposition_and_never_joins(busy, name):
    lim, child = busy

    def scrape():
        r = subprocess.run(
            [*CLI, "metrics", name],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=tempfile.gettempdir(),
        )
        assert r.returncode == 0, r.stderr
        return r.stdout

    values, types = scrape_with_a_live_filler(scrape, name)
    check(values, types, name, child.pid)
    assert {k[1] for k in values if k[1] is not None} == {name}  # only the one named
    assert values[("shmlimit_unreadable_segments", None)] == 0


def test_cli_serves_metrics_on_a_port(busy, name, tmp_path):
    lim, child = busy
    junk = f"{name}-junk"
    with open(f"/dev/shm/shmlimit.{junk}", "wb") as f:  # a foreign segment: counted, never fatal
        f.write(b"\x01" * 4096)
    proc = subprocess.Popen(
        # (every segment on the machine: other runs' must not push this one past the cap)
        [*CLI, "metrics", "--port", "0", "--max-segments", "100000"],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
        cwd=tempfile.gettempdir(),
    )
    try:
        line = proc.stderr.readline()
        m = re.search(r"http://([\d.]+):(\d+)/metrics", line)
        assert m, line
        url = f"http://{m.group(1)}:{m.group(2)}"

        def scrape():
            with urllib.request.urlopen(url + "/metrics", timeout=30) as resp:
                assert resp.status == 200
                assert resp.headers["Content-Type"].startswith("text/plain; version=0.0.4")
                return resp.read().decode()

        values, types = scrape_with_a_live_filler(scrape, name)
        check(values, types, name, child.pid)
        assert values[("shmlimit_unreadable_segments", None)] >= 1
        assert all(p.pid != proc.pid for p in shmlimit.inspect(name).processes)
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(url + "/other", timeout=30)
        assert e.value.code == 404
    finally:
        proc.kill()
        proc.wait(10)
        os.unlink(f"/dev/shm/shmlimit.{junk}")


def test_cli_unknown_name_is_a_user_error():
    r = subprocess.run(
        [*CLI, "metrics", "no-such-limiter-here"], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 2 and "no limiter named" in r.stderr


def test_collector_in_a_registry(busy, name):
    from prometheus_client import CollectorRegistry, generate_latest

    from shmlimit.integrations.prometheus import ShmlimitCollector

    lim, child = busy
    reg = CollectorRegistry()
    reg.register(ShmlimitCollector([name]))
    values, types = scrape_with_a_live_filler(lambda: generate_latest(reg).decode(), name)
    check(values, types, name, child.pid)


def test_collector_upstream_counters(name, redis_server):
    from prometheus_client import CollectorRegistry, generate_latest

    from shmlimit.integrations.prometheus import ShmlimitCollector
    from shmlimit.redis.direct import RedisLimiter

    up = RedisLimiter(name, rate=1000, burst=100, url=redis_server.url)
    lim = shmlimit.Limiter(name, upstream=up)
    try:
        for _ in range(50):
            assert lim.acquire(timeout=5)
        reg = CollectorRegistry()
        reg.register(ShmlimitCollector([name]))
        values, _ = parse(generate_latest(reg).decode())
        live = lim.stats().upstream
        assert values[("shmlimit_upstream_leased_ops_total", name)] >= 50
        assert values[("shmlimit_upstream_round_trips_total", name)] >= 1
        assert values[("shmlimit_upstream_leases_total", name)] <= live.leases
        assert values[("shmlimit_upstream_fallback", name)] == 0
        assert values[("shmlimit_upstream_errors_total", name)] == live.errors
    finally:
        lim.close()
        up.close()


def test_keyed_limiter_metrics_never_join(name):
    lim = shmlimit.KeyedLimiter(name, rate=1, per=60, burst=2, keys=64)
    for key in ("alice", "bob", "carol"):
        assert lim.try_acquire(key)
    assert lim.try_acquire("alice") and not lim.try_acquire("alice")
    r = subprocess.run(
        [*CLI, "metrics", name],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tempfile.gettempdir(),
    )
    assert r.returncode == 0, r.stderr
    values, types = parse(r.stdout)
    live = shmlimit.inspect(name)
    assert values[("shmlimit_grants_total", name)] == live.grants == 4
    assert values[("shmlimit_rate_ops_per_second", name)] == pytest.approx(1 / 60)
    assert values[("shmlimit_capacity_ops", name)] == 2
    assert values[("shmlimit_keyed_keys", name)] == live.keys == 3
    assert values[("shmlimit_keyed_slots", name)] == live.slots
    assert values[("shmlimit_keyed_evictions_total", name)] == live.evicted
    assert values[("shmlimit_keyed_refusals_total", name)] == live.refused_full == 0
    assert types["shmlimit_keyed_evictions"] == "counter"
    assert (
        "shmlimit_available_ops",
        name,
    ) not in values  # no per-key figures, no bucket of its own
    assert values[("shmlimit_unreadable_segments", None)] == 0
    assert [p.pid for p in live.processes if p.alive] == [os.getpid()]
    lim.close()


def test_adaptive_keyed_limiters_export_their_fleet_wide_counters(name):
    """A keyed limiter's adaptive counters (every key's, every process's) under its name, and each
    rate's of a keyed group under NAME[KEY]; a limiter that does not adapt has none."""
    adapt = shmlimit.Adapt(min_rate=10, max_rate=1000)
    lim = shmlimit.KeyedLimiter(name, rate=100, keys=64, adapt=adapt)
    group = shmlimit.KeyedLimiter(
        name + "-g",
        rates={"requests": 100, "daily": "100M/day"},
        keys=64,
        adapt={"requests": adapt},
    )
    plain = shmlimit.KeyedLimiter(name + "-p", rate=100, keys=64)
    try:
        t0 = time.monotonic_ns()
        for key in ("a.example", "b.example"):
            lim._report(True, key, lambda: t0)
        lim._report(False, "a.example", lambda: t0)
        lim._report(False, "a.example", lambda: t0 + 10**9)  # a's window is over: one cut
        group.feedback(True, "a.example")
        r = subprocess.run(
            [*CLI, "metrics", name, name + "-g", name + "-p"],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=tempfile.gettempdir(),
        )
        assert r.returncode == 0, r.stderr
        values, types = parse(r.stdout)
        assert values[("shmlimit_adapt_throttled_outcomes_total", name)] == 2
        assert values[("shmlimit_adapt_ok_outcomes_total", name)] == 2
        assert values[("shmlimit_adapt_cuts_total", name)] == 1
        assert values[("shmlimit_adapt_raises_total", name)] == 0
        assert types["shmlimit_adapt_cuts"] == "counter"
        assert values[("shmlimit_adapt_throttled_outcomes_total", f"{name}-g[requests]")] == 1
        for limiter in (f"{name}-g[daily]", name + "-p"):  # neither adapts: no series
            assert ("shmlimit_adapt_throttled_outcomes_total", limiter) not in values
        assert values[("shmlimit_keyed_overrides", name)] == 2  # each key's rate: its override
    finally:
        for lim_ in (lim, group, plain):
            lim_.unlink()
            lim_.close()
