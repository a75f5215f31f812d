"""Hosts that reach Redis through a network with latency: three process groups, each with a segment
of its own, each through a delaying TCP proxy (1, 3 and 5 ms each way), one of them cut off for 2 s."""

import time

import pytest
from support.procs import WORKER, collect_witnessed, configured, go, start_workers, wait_for
from support.proxy import DelayProxy
from support.starvation import run_delay
from support.windows import max_excess, tag

import shmlimit

# run once in CI: Redis behind latency; the segment's side is tests/redis/test_redis.py's
pytestmark = pytest.mark.backend_independent


# grants per real second behind latency and across a cut
@pytest.mark.slow
def test_three_hosts_behind_latency_hold_the_global_rate_and_survive_a_cut(redis_server, name):
    rate, burst, seconds, ttl = 300, 30, 4.0, 0.1
    proxies = [DelayProxy(redis_server.port, d) for d in (0.001, 0.003, 0.005)]
    hosts = [f"{name}-{i}" for i in range(3)]
    procs = []
    try:
        for h, p in zip(hosts, proxies):
            # The proxies are threads of this process: on a machine busy with other test runs a round
            # trip through them took over the client's default timeout of 0.25 s ("Timeout reading
            # from socket" on both proxies not cut), and the hosts meant to keep Redis lost it.  Their
            # 1-5 ms are the latency under test; a cut is seen at once (the proxy closes), not by timeout.
            script = configured(
                WORKER, name, p.url(), rate, burst, redis_timeout=2.0, lease_ttl=ttl
            )
            procs.append(start_workers(h, 2, seconds, script))
        # the server, and this process, whose threads are the proxies: both must run
        servers0 = [run_delay(redis_server.proc.pid), run_delay()]
        go([w for ws in procs for w in ws])
        t0 = time.monotonic()
        wait_for(lambda: all(shmlimit.inspect(h).upstream.leased > 0 for h in hosts))
        time.sleep(
            max(0.0, t0 + 1.0 - time.monotonic())
        )  # a moment of the run, not a synchronisation
        cut = time.monotonic()
        proxies[0].drop(2.0)
        witnessed = [collect_witnessed(ws) for ws in procs]
        servers1 = [run_delay(redis_server.proc.pid), run_delay()]
        results = [r for r, _ in witnessed]
        stats = [shmlimit.inspect(h).upstream for h in hosts]
    finally:
        for ws in procs:
            for w in ws:
                w.kill()
                w.wait()
        for p in proxies:
            p.close()
        for h in hosts:
            try:
                shmlimit.unlink(h)
            except FileNotFoundError:
                pass
    every = [r for rs in results for r in rs]
    # the documented bound: d = a tick plus one round trip through the slowest proxy (10 ms), 50 ms here
    assert max_excess(tag(every), 1.0) <= rate * (1.0 + ttl + 0.05) + burst
    # the others took the cut host's share; and the rate is kept but for the time the machine kept
    # a host's filler (in one of its two workers: off the CPU at most the longer of their delays;
    # each host leases a third of the rate), the server or the proxies off the CPU
    # (support.starvation), as in the two-hosts test.  On a quiet machine both are ~0.
    held_up = [max([x for x in d if x is not None], default=0.0) for _, d in witnessed]
    server = sum(b - a for a, b in zip(servers0, servers1) if a is not None and b is not None)
    assert (
        len([t for r in every for t in r])
        >= 0.85 * rate * seconds - rate / 3 * sum(held_up) - rate * server
    )
    cut_off = sorted(t for r in results[0] for t in r if cut + 0.3 < t < cut + 1.9)
    assert len(cut_off) <= 1  # closed while cut off: its leased tokens expired, no new ones came
    assert stats[0].errors >= 1 and stats[0].fallbacks >= 1 and stats[0].state == "ok"
    assert all(s.state == "ok" and s.errors == 0 for s in stats[1:])
