#!/usr/bin/env python3
"""The adaptive rate against a server whose capacity changes: a real run, measured at the server.

    python tools/adapt_demo.py                       # 200/s for 10 s, then 400/s for 10 s
    python tools/adapt_demo.py --phases 200:10,400:10,150:10 --out docs/img
    python tools/adapt_demo.py --keyed 100,300 --seconds 15   # two hosts, one KeyedLimiter

A local HTTP server (127.0.0.1) has a hidden capacity: a token bucket that
answers 429, without ``Retry-After``, beyond it.  Client processes share one
``Limiter(name, rate=1000, adapt=shmlimit.Adapt(min_rate=10, max_rate=2000))``
through the httpx transport, several threads each, sending as fast as the
limiter lets them.  The server counts its answers per 100 ms; this process
samples the limiter's rate (``shmlimit.inspect``) as often.  In the settled
seconds of each phase (its last ``--settled`` seconds) it reports the goodput
(answers 200 per second, against the capacity) and the share of 429s.

With ``--keyed``, one server per capacity listed (each its own host, ``127.0.0.1:PORT``),
and the clients share one ``KeyedLimiter(name, rate=500, adapt=...)`` keyed by host, their
threads spread over the hosts: each host's rate adapts on its own (``keyed.adapt``).  It reports
each host's goodput and share of 429s in the last ``--settled`` seconds, and writes nothing.

It writes ``adapt.csv`` (per 100 ms: time, capacity, the limiter's rate,
answers 200, answers 429) and ``adapt.svg`` (the rate and the goodput against
the capacity, over time) into ``--out``.  matplotlib is not needed: the SVG is
written by hand.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import threading
import time
from typing import Callable, Dict, List, Optional, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = 0.1  #: seconds per bin of the server's counts and the rate's samples
#: seconds every process gets to start (imports, the limiter, the server's socket) before the run
STARTUP = 5.0
#: the server's bucket holds this much of its capacity (seconds): a small burst, as upstreams have
SERVER_BURST = 0.05


def parse_phases(text: str) -> List[Tuple[float, float]]:
    """``"200:10,400:10"`` -> [(capacity per second, seconds), ...]."""
    out = []
    for part in text.split(","):
        cap, _, secs = part.partition(":")
        out.append((float(cap), float(secs)))
    return out


# ---- the server ---------------------------------------------------------------------------------


class Capacity:
    """The server's hidden capacity: a token bucket whose rate follows the phases from ``t0``
    (epoch seconds), full then."""

    def __init__(self, phases: List[Tuple[float, float]], t0: float = 0.0) -> None:
        self.phases = phases
        self.t0 = t0
        self.tokens = self.capacity(0) * SERVER_BURST
        self.last = t0
        total = sum(s for _, s in phases)
        self.ok = [0] * (int(total / BIN) + 40)
        self.refused = [0] * len(self.ok)

    def capacity(self, t: float) -> float:
        for cap, secs in self.phases:
            if t < secs:
                return cap
            t -= secs
        return self.phases[-1][0]

    def take(self, now: float) -> bool:
        t = max(0.0, now - self.t0)
        cap = self.capacity(t)
        self.tokens = min(cap * SERVER_BURST, self.tokens + max(0.0, now - self.last) * cap)
        self.last = max(self.last, now)
        k = min(int(t / BIN), len(self.ok) - 1)
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            self.ok[k] += 1
            return True
        self.refused[k] += 1
        return False


OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Type: text/plain\r\n\r\nok"
REFUSED = (
    b"HTTP/1.1 429 Too Many Requests\r\nContent-Length: 4\r\nContent-Type: text/plain\r\n\r\nslow"
)


def serve(port: int, phases: List[Tuple[float, float]], start: float, out: str) -> None:
    """Answer on 127.0.0.1:``port`` until the phases (from ``start``, epoch seconds) and 2 s more
    have passed; then write the counts per bin to ``out`` (JSON)."""
    cap = Capacity(phases, start)
    total = sum(s for _, s in phases)

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                line = await reader.readline()
                if not line:
                    break
                length = 0
                while True:
                    h = await reader.readline()
                    if h in (b"\r\n", b"\n", b""):
                        break
                    if h.lower().startswith(b"content-length:"):
                        length = int(h.split(b":", 1)[1])
                if length:
                    await reader.readexactly(length)
                writer.write(OK if cap.take(time.time()) else REFUSED)
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def main() -> None:
        server = await asyncio.start_server(handle, "127.0.0.1", port, backlog=256)
        async with server:
            while time.time() < start + total + 2.0:
                await asyncio.sleep(0.1)

    asyncio.run(main())
    with open(out, "w") as f:
        json.dump({"t0": cap.t0, "ok": cap.ok, "refused": cap.refused}, f)


# ---- the clients --------------------------------------------------------------------------------


#: The keyed run's limiter: every host starts at KEYED_RATE and adapts within KEYED_ADAPT's bounds.
KEYED_RATE = 500.0
KEYED_ADAPT = dict(min_rate=5, max_rate=1000, increase=5)


def client(
    name: str, urls: List[str], threads: int, start: float, until: float, keyed: bool = False
) -> None:
    """Send GETs from ``threads`` threads (spread over ``urls``) from ``start`` until ``until``
    (epoch seconds), each through the httpx transport under the shared adaptive limiter: a
    ``Limiter``, or with ``keyed`` a ``KeyedLimiter`` keyed by host."""
    import httpx

    import shmlimit
    from shmlimit.integrations.httpx import ThrottledTransport

    lim: object
    if keyed:
        lim = shmlimit.KeyedLimiter(
            name, rate=KEYED_RATE, keys=1000, adapt=shmlimit.Adapt(**KEYED_ADAPT)
        )
    else:
        lim = shmlimit.Limiter(name, rate=1000, adapt=shmlimit.Adapt(min_rate=10, max_rate=2000))

    def loop(url: str) -> None:
        with httpx.Client(transport=ThrottledTransport(lim), timeout=10.0) as c:
            time.sleep(max(0.0, start - time.time()))
            while time.time() < until:
                try:
                    c.get(url)
                except httpx.HTTPError:
                    pass

    ts = [threading.Thread(target=loop, args=(urls[i % len(urls)],)) for i in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    lim.close()  # type: ignore[attr-defined]


# ---- the run ------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_listening(port: int, deadline: float) -> None:
    while time.time() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"the server did not listen on port {port}")


def _fleet(
    name: str,
    hosts: List[List[Tuple[float, float]]],
    procs: int,
    threads: int,
    workdir: str,
    keyed: bool,
    sample: Callable[[List[str]], Optional[List[float]]],
) -> Tuple[List[Dict[str, list]], List[Tuple[float, List[float]]]]:
    """One server per entry of ``hosts`` (its phases), ``procs`` client processes sending to all
    of them; every server's counts, and ``sample(urls)`` (the rates) every ``BIN`` seconds."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    me = os.path.abspath(__file__)
    ports = [_free_port() for _ in hosts]
    counts = [os.path.join(workdir, f"adapt-server-{port}.json") for port in ports]
    total = max(sum(s for _, s in phases) for phases in hosts)
    # every process starts its part at one instant, after its imports (slow on a busy machine)
    start = time.time() + STARTUP
    until = start + total
    servers = [
        subprocess.Popen(
            [
                sys.executable,
                me,
                "--role",
                "server",
                "--port",
                str(port),
                "--counts",
                out,
                "--phases",
                ",".join(f"{c:g}:{s:g}" for c, s in phases),
                "--start",
                repr(start),
            ],
            env=env,
        )  # fmt: skip
        for port, out, phases in zip(ports, counts, hosts)
    ]
    clients: List[subprocess.Popen] = []
    samples: List[Tuple[float, List[float]]] = []
    urls = [f"http://127.0.0.1:{port}/" for port in ports]
    try:
        for _ in range(procs):
            clients.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        me,
                        "--role",
                        "client",
                        "--name",
                        name,
                        "--url",
                        ",".join(urls),
                        "--threads",
                        str(threads),
                        "--start",
                        repr(start),
                        "--until",
                        repr(until),
                    ]
                    + (["--keyed", "-"] if keyed else []),
                    env=env,
                )  # fmt: skip
            )
        for port in ports:
            _wait_listening(port, start + 10)
        while time.time() < until:
            got = sample(urls)
            if got is not None:
                samples.append((time.time(), got))
            time.sleep(BIN)
        for p in clients + servers:
            p.wait(timeout=60)
    finally:
        for p in clients + servers:
            if p.poll() is None:
                p.kill()
                p.wait()
    seen = []
    for out in counts:
        with open(out) as f:
            seen.append(json.load(f))
        os.unlink(out)
    return seen, samples


def _settled(seen: Dict[str, list], phases: List[Tuple[float, float]], settled: float) -> list:
    """Each phase's goodput and share of 429s at the server, in its last ``settled`` seconds."""
    out, start = [], 0.0
    for cap, secs in phases:
        lo, hi = int(round((start + secs - settled) / BIN)), int(round((start + secs) / BIN))
        ok, refused = sum(seen["ok"][lo:hi]), sum(seen["refused"][lo:hi])
        out.append(
            {
                "capacity": cap,
                "settled_seconds": settled,
                "goodput": ok / settled,
                "goodput_share": ok / settled / cap,
                "throttled_share": refused / max(1, ok + refused),
            }
        )
        start += secs
    return out


def run(
    name: str,
    phases: List[Tuple[float, float]],
    procs: int = 4,
    threads: int = 4,
    settled: float = 5.0,
    workdir: str = ".",
) -> Dict[str, object]:
    """Run the scenario; the server's counts, the rate's samples and each phase's settled figures."""
    import shmlimit

    def sample(urls: List[str]) -> Optional[List[float]]:
        try:
            return [shmlimit.inspect(name).rate]
        except (FileNotFoundError, shmlimit.SegmentError):
            return None

    [seen], samples = _fleet(name, [phases], procs, threads, workdir, False, sample)
    t0 = seen["t0"]
    return {
        "t0": t0,
        "ok": seen["ok"],
        "refused": seen["refused"],
        "rates": [(t - t0, r[0]) for t, r in samples],
        "phases": _settled(seen, phases, settled),
    }


def run_keyed(
    name: str,
    capacities: List[float],
    seconds: float,
    procs: int = 4,
    threads: int = 8,
    settled: float = 5.0,
    workdir: str = ".",
) -> Dict[str, object]:
    """The keyed scenario: one server per capacity, all at once, under one KeyedLimiter keyed by
    host; each host's settled figures and its rate's samples."""
    import shmlimit
    from shmlimit.integrations._hosts import host_key

    watch: List[object] = []

    def sample(urls: List[str]) -> Optional[List[float]]:
        try:
            if not watch:
                watch.append(shmlimit.KeyedLimiter(name))
            lim = watch[0]
            return [(lim.override(host_key(u)) or (KEYED_RATE,))[0] for u in urls]  # type: ignore[attr-defined]
        except (FileNotFoundError, shmlimit.SegmentError):
            return None

    hosts = [[(cap, seconds)] for cap in capacities]
    try:
        seen, samples = _fleet(name, hosts, procs, threads, workdir, True, sample)
    finally:
        for lim in watch:
            lim.close()  # type: ignore[attr-defined]
    return {
        "hosts": [
            {
                **_settled(s, phases, settled)[0],
                "rates": [(t - s["t0"], r[i]) for t, r in samples],
            }
            for i, (s, phases) in enumerate(zip(seen, hosts))
        ]
    }


# ---- the plot -----------------------------------------------------------------------------------


def write_csv(result: Dict[str, object], phases: List[Tuple[float, float]], path: str) -> None:
    cap = Capacity(phases)
    rates = result["rates"]
    with open(path, "w") as f:
        f.write("t,capacity,rate,ok_per_s,throttled_per_s\n")
        for k, (ok, ref) in enumerate(zip(result["ok"], result["refused"])):  # type: ignore[call-overload]
            t = k * BIN
            if t > sum(s for _, s in phases):
                break
            near = [r for tt, r in rates if t <= tt < t + BIN]  # type: ignore[union-attr]
            rate = f"{near[-1]:g}" if near else ""
            f.write(f"{t:.1f},{cap.capacity(t):g},{rate},{ok / BIN:g},{ref / BIN:g}\n")


def write_svg(result: Dict[str, object], phases: List[Tuple[float, float]], path: str) -> None:
    """The rate (blue), the goodput per 0.5 s (green) and the capacity (grey, dashed) over time."""
    W, H, M = 720, 360, 48
    total = sum(s for _, s in phases)
    rates = [(t, r) for t, r in result["rates"] if 0 <= t <= total]  # type: ignore[union-attr]
    top = max([c for c, _ in phases] + [r for _, r in rates]) * 1.1

    def x(t: float) -> float:
        return M + (W - 2 * M) * t / total

    def y(v: float) -> float:
        return H - M - (H - 2 * M) * min(v, top) / top

    def poly(points: List[Tuple[float, float]], colour: str, dash: str = "") -> str:
        pts = " ".join(f"{x(t):.1f},{y(v):.1f}" for t, v in points)
        extra = f' stroke-dasharray="{dash}"' if dash else ""
        return f'<polyline fill="none" stroke="{colour}" stroke-width="2"{extra} points="{pts}"/>'

    caps, start = [], 0.0
    for c, s in phases:
        caps += [(start, c), (start + s, c)]
        start += s
    per = int(0.5 / BIN)
    ok: List[int] = result["ok"]  # type: ignore[assignment]
    good = [
        ((k + 0.5) * BIN * per, sum(ok[k * per : (k + 1) * per]) / (per * BIN))
        for k in range(int(total / BIN) // per)
    ]
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="12">',
        f'<rect width="{W}" height="{H}" fill="white"/>',
        f'<line x1="{M}" y1="{H - M}" x2="{W - M}" y2="{H - M}" stroke="black"/>',
        f'<line x1="{M}" y1="{M}" x2="{M}" y2="{H - M}" stroke="black"/>',
    ]
    for k in range(0, int(total) + 1, max(1, int(total) // 10)):
        parts.append(f'<text x="{x(k):.1f}" y="{H - M + 16}" text-anchor="middle">{k}</text>')
    step = 10 ** max(0, len(str(int(top))) - 1)
    for v in range(0, int(top) + 1, step if top / step >= 3 else step // 2 or 1):
        parts.append(f'<text x="{M - 6}" y="{y(v) + 4:.1f}" text-anchor="end">{v}</text>')
    parts += [
        f'<text x="{W / 2}" y="{H - 12}" text-anchor="middle">seconds</text>',
        f'<text x="{M}" y="{M - 20}">ops per second</text>',
        poly(caps, "#888", "6,4"),
        poly(good, "#2a2"),
        poly(rates, "#24c"),
        f'<text x="{W - M}" y="{M - 20}" text-anchor="end" fill="#24c">the limiter\'s rate</text>',
        f'<text x="{W - M}" y="{M - 6}" text-anchor="end" fill="#2a2">goodput at the server</text>',
        f'<text x="{W - M - 160}" y="{M - 6}" text-anchor="end" fill="#888">capacity</text>',
        "</svg>",
    ]
    with open(path, "w") as f:
        f.write("\n".join(parts) + "\n")


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--role", choices=("run", "server", "client"), default="run")
    ap.add_argument("--phases", default="200:10,400:10", help="capacity:seconds,... (per second)")
    ap.add_argument("--procs", type=int, default=4)
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--settled", type=float, default=5.0, help="seconds at each phase's end")
    ap.add_argument("--out", default=".")
    ap.add_argument("--port", type=int)
    ap.add_argument("--counts")
    ap.add_argument("--name")
    ap.add_argument("--url")
    ap.add_argument("--start", type=float)
    ap.add_argument("--until", type=float)
    ap.add_argument("--keyed", help="capacities per second, one host each: 100,300")
    ap.add_argument("--seconds", type=float, default=15.0, help="the keyed run's length")
    a = ap.parse_args(argv)
    phases = parse_phases(a.phases)
    if a.role == "server":
        serve(a.port, phases, a.start, a.counts)
        return 0
    if a.role == "client":
        client(a.name, a.url.split(","), a.threads, a.start, a.until, keyed=bool(a.keyed))
        return 0

    name = f"adapt-demo-{os.getpid()}"
    if a.keyed:
        try:
            caps = [float(c) for c in a.keyed.split(",")]
            keyed = run_keyed(name, caps, a.seconds, a.procs, 2 * a.threads, a.settled, a.out)
        finally:
            _unlink(name)
        for h in keyed["hosts"]:  # type: ignore[attr-defined]
            print(
                f"host of capacity {h['capacity']:g}/s: goodput {h['goodput']:.1f}/s "
                f"({h['goodput_share']:.0%}), {h['throttled_share']:.1%} answered 429, "
                f"rate at the end {h['rates'][-1][1]:g} (the last {h['settled_seconds']:g} s)"
            )
        return 0
    os.makedirs(a.out, exist_ok=True)
    try:
        result = run(name, phases, a.procs, a.threads, a.settled, a.out)
    finally:
        _unlink(name)
    write_csv(result, phases, os.path.join(a.out, "adapt.csv"))
    write_svg(result, phases, os.path.join(a.out, "adapt.svg"))
    for p in result["phases"]:  # type: ignore[attr-defined]
        print(
            f"capacity {p['capacity']:g}/s: goodput {p['goodput']:.1f}/s "
            f"({p['goodput_share']:.0%} of capacity), {p['throttled_share']:.1%} answered 429 "
            f"(the last {p['settled_seconds']:g} s)"
        )
    return 0


def _unlink(name: str) -> None:
    """The run's limiter and the table of hosts its clients paused, beside it."""
    import shmlimit
    from shmlimit.integrations._hosts import pause_table_name

    for n in (name, pause_table_name(name)):
        try:
            shmlimit.unlink(n)
        except FileNotFoundError:
            pass


if __name__ == "__main__":
    sys.exit(main())
