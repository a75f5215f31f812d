#!/usr/bin/env python3
"""The performance page and its plots, made from one run of the benchmark.

    python tools/bench.py --json > docs/img/bench.json   # the run (about five minutes)
    python tools/perf_page.py                            # docs/performance.md, docs/img/perf-*.svg

``python tools/perf_page.py RUN.json --docs DIR`` writes ``DIR/performance.md`` and
``DIR/img/perf-*.svg`` instead.  Every figure on the page comes from the run; the prose around
them is here.  A run missing a section (an ``--only-*`` run, say) is refused, naming the key;
the sections in ``OPTIONAL`` (newer than some committed runs) are said not measured instead.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Callable, Dict, List, Optional, Sequence, Tuple
from xml.sax.saxutils import escape

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench import (  # noqa: E402  (the benchmark's own ratios)
    floor_ratios,
    hierarchy_ratios,
    limits_ratios,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_RUN = os.path.join(ROOT, "docs", "img", "bench.json")

#: What a whole run of ``tools/bench.py --json`` holds: the page needs every one of these.
REQUIRED = [
    "machine.python", "machine.cpus", "machine.platform", "machine.native", "machine.backend",
    "machine.shmlimit", "machine.date", "machine.args", "machine.load_start", "machine.load_end",
    "single_ns", "tries_ns", "aggregate_per_s", "fidelity", "lateness", "cpu_waiting", "waiting",
    "filler_under_load", "asyncio", "rates", "redis", "hierarchy", "latency", "keyed",
]  # fmt: skip

#: Sections a run may lack (a run of an older bench.py): the page says they were not measured.
OPTIONAL = ["hierarchy_cpu", "limits_hits"]
NOT_MEASURED = "Not measured in this run (its JSON has no `{key}`)."

FLOOR = "floor: native fetch_add"
BUCKET = "baseline: Value+Lock bucket"
COLOURS = ["#24c", "#999", "#2a2", "#c62"]


class RunError(ValueError):
    """The benchmark's JSON lacks what the page is made from."""


def need(run: dict, path: str):
    """``run``'s value at the dotted ``path``; a RunError naming the key when it is missing."""
    node = run
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            raise RunError(
                f"the benchmark's JSON has no {path!r}: the page is made from a whole run of "
                "`python tools/bench.py --json` (no --only-* flag) by this version of bench.py"
            )
        node = node[part]
    return node


# ---- numbers -----------------------------------------------------------------------------------


def count(x: float) -> str:
    """An amount (ops, ops/s): millions with one decimal, else whole, thousands spaced."""
    return f"{x / 1e6:.1f} M" if x >= 1e7 else f"{x:,.0f}".replace(",", " ")


def ratio(x: float) -> str:
    """A multiple, to three significant figures (no fewer than two decimals below 10)."""
    if x >= 100:
        return f"{x:,.0f}".replace(",", " ")
    return f"{x:.1f}" if x >= 10 else f"{x:.2f}"


def ns(x: float) -> str:
    """A cost given in nanoseconds, in ns or µs."""
    return f"{x:.0f} ns" if x < 1000 else f"{x / 1e3:.1f} µs"


def ms(x: float) -> str:
    """A time given in milliseconds."""
    return f"{x:.3f} ms" if x < 1 else f"{x:.1f} ms"


def pct(x: float) -> str:
    """An error given in per cent, signed."""
    return f"{x:+.2f} %".replace("-", "−")


def us(x: float) -> str:
    """A cost given in microseconds, in µs or ms."""
    if x >= 1000:
        return f"{x / 1e3:.1f} ms"
    return f"{x:.0f} µs" if x >= 100 else f"{x:.1f} µs"


def cpu(x: float) -> str:
    """CPU-seconds per wall second."""
    return f"{x:.4f}"


def load(la: Sequence[float]) -> str:
    """A load average (1, 5 and 15 minutes)."""
    return ", ".join(f"{x:.2f}" for x in la)


def table(head: str, rows: Sequence[Sequence[str]]) -> str:
    """A Markdown table: ``head`` is its header row, the cells apart by " | "."""
    lines = [f"| {head} |", "|" + " --- |" * len(head.split(" | "))]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


# ---- the plots ---------------------------------------------------------------------------------


def _ticks(top: float, log: bool) -> List[float]:
    if log:
        return [10.0**k for k in range(0, round(math.log10(top)) + 1)]
    step = 10 ** math.floor(math.log10(top / 5))
    step *= next(m for m in (1, 2, 5, 10) if top / (step * m) <= 6)
    return [k * step for k in range(int(top / step) + 1)]


def bar_chart(
    title: str,
    axis: str,
    groups: List[Tuple[str, List[Tuple[str, float]]]],
    label: Callable[[float], str],
    log: bool = False,
) -> str:
    """A horizontal bar chart as SVG text: one row of bars per group, one bar per (series, value),
    each labelled ``label(value)``; ``log``: a logarithmic axis from 1 (no bar below 1)."""
    series = list(dict.fromkeys(s for _, bars in groups for s, _ in bars))
    W, L, R, BAR, GAP = 720, 260, 60, 16, 14
    top_y = 40 + (18 if len(series) > 1 else 0)
    H = top_y + sum(len(b) * BAR + GAP for _, b in groups) + 36
    hi = max(v for _, bars in groups for _, v in bars)
    top = 10 ** math.ceil(math.log10(hi)) if log else hi * 1.15

    def x(v: float) -> float:
        if log:
            return L + (W - L - R) * max(0.0, math.log10(max(v, 1.0))) / math.log10(top)
        return L + (W - L - R) * v / top

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" '
        'font-family="sans-serif" font-size="12">',
        f'<rect width="{W}" height="{H}" fill="white"/>',
        f'<text x="{W / 2:.0f}" y="22" text-anchor="middle" font-size="14">{escape(title)}</text>',
    ]
    if len(series) > 1:
        for i, s in enumerate(series):
            lx = L + i * 200
            out.append(
                f'<rect x="{lx}" y="{top_y - 22}" width="12" height="12" fill="{COLOURS[i]}"/>'
            )
            out.append(f'<text x="{lx + 16}" y="{top_y - 12}">{escape(s)}</text>')
    y = top_y
    for name, bars in groups:
        mid = y + len(bars) * BAR / 2
        out.append(f'<text x="{L - 8}" y="{mid + 4:.0f}" text-anchor="end">{escape(name)}</text>')
        for s, v in bars:
            c = COLOURS[series.index(s)]
            out.append(
                f'<rect x="{L}" y="{y}" width="{x(v) - L:.1f}" height="{BAR - 2}" fill="{c}"/>'
            )
            out.append(f'<text x="{x(v) + 4:.1f}" y="{y + BAR - 4}">{escape(label(v))}</text>')
            y += BAR
        y += GAP
    out.append(f'<line x1="{L}" y1="{top_y - 4}" x2="{L}" y2="{y}" stroke="black"/>')
    out.append(f'<line x1="{L}" y1="{y}" x2="{W - R}" y2="{y}" stroke="black"/>')
    for t in _ticks(top, log):
        out.append(f'<text x="{x(t):.1f}" y="{y + 16}" text-anchor="middle">{t:g}</text>')
    out.append(f'<text x="{(L + W - R) / 2:.0f}" y="{y + 32}" text-anchor="middle">{axis}</text>')
    return "\n".join(out + ["</svg>"]) + "\n"


def cost_plot(run: dict) -> str:
    """Each call's cost as a multiple of the floor (else of the Value+Lock bucket), log scale."""
    single, tries = need(run, "single_ns"), need(run, "tries_ns")
    base_key = FLOOR if FLOOR in single else BUCKET
    rows = [(k, v) for k, v in single.items() if k != base_key]
    for backend, r in tries.items():
        rows += [
            (f"{k} ({backend})", v)
            for k, v in r.items()
            if k != "acquire granted" and not k.startswith("atomic ops")
        ]
    rows.sort(key=lambda kv: kv[1])
    base = single[base_key]
    what = "a native fetch-add from Python" if base_key == FLOOR else "the Value+Lock bucket"
    return bar_chart(
        "The cost of a call, one process, unlimited rate",
        f"× {what} (log scale)",
        [(LABELS.get(k, k), [("", v / base)]) for k, v in rows],
        lambda v: f"{ratio(v)}×",
        log=True,
    )


def waiting_plot(run: dict) -> str:
    """CPU per wall second of 8 waiters next to 8 bare sleepers waking at the same instants."""
    rows = need(run, "waiting")
    floors = {w["rate"]: w["cpu_s_per_wall_s"] for w in rows if w["driver"] == "bare sleep"}
    # blocking waiters against blocking sleepers; asyncio ones against asyncio sleepers (section 12)
    groups = [
        (f"{count(w['rate'])}/s, {driver(w)}", w["cpu_s_per_wall_s"], floors[w["rate"]])
        for w in rows
        if w["driver"] in ("sync", "sync, atomics") and w["rate"] in floors
    ]
    a = need(run, "asyncio")
    t = need(run, "asyncio.turns")  # taking turns: the pair the ratio is of
    groups.append(
        (f"{count(a['rows'][0]['rate'])}/s, {driver(a['rows'][0])}", t["waiters"], t["sleepers"])
    )
    pair = ("8 waiting on the limiter", "8 bare sleepers, no limiter")
    return bar_chart(
        "CPU while waiting: 8 processes, against 8 bare sleepers",
        "CPU-seconds per wall second, all 8 processes together",
        [(g, [(pair[0], v), (pair[1], f)]) for g, v, f in groups],
        lambda v: f"{v:.3f}",
    )


# ---- the page ----------------------------------------------------------------------------------

LABELS = {
    FLOOR: "the floor: a native fetch-add",
    BUCKET: "a multiprocessing.Value + Lock bucket",
    "shmlimit acquire (native)": "acquire() granted (native)",
    "shmlimit acquire (atomics)": "acquire() granted (atomics)",
}


#: The benchmark's ``driver`` of a waiting row: who waits, and how.
DRIVERS = {
    "sync": "acquire()",
    "async": "acquire_async()",
    "sync, atomics": "acquire(), atomics backend",
    "bare sleep": "bare sleepers",
    "bare asyncio": "bare asyncio sleepers, precise",
    "bare asyncio.sleep": "bare asyncio.sleep",
}


def driver(row: dict) -> str:
    return DRIVERS.get(row["driver"], row["driver"])


def machine(run: dict) -> str:
    m = need(run, "machine")
    lo, hi = need(run, "machine.load_start"), need(run, "machine.load_end")
    rows = [
        ("date", m["date"]),
        ("cores", str(m["cpus"])),
        ("load average (1, 5, 15 min) at the start", load(lo)),
        ("load average at the end", load(hi)),
        ("Python", m["python"]),
        ("platform", f"`{m['platform']}`"),
        ("backend", f"{m['backend']} (native extension built: {'yes' if m['native'] else 'no'})"),
        ("shmlimit", m["shmlimit"]),
        ("command", f"`tools/bench.py {' '.join(m['args'])}`"),
    ]
    text = table("the run | ", [list(r) for r in rows])
    text += (
        "\n\nThe load average at the start is other work's; the benchmark's own processes raise it"
        " as it runs."
    )
    if lo[0] > m["cpus"]:
        text += (
            "\n\n!!! note\n    The machine was busy when this run began (a load average above"
            " its cores): the\n    ratios hold better than the absolute figures; compare rows"
            " within a table."
        )
    return text


def cost(run: dict) -> str:
    single, tries, agg = need(run, "single_ns"), need(run, "tries_ns"), need(run, "aggregate_per_s")
    floor, bucket = single.get(FLOOR), single[BUCKET]
    rows = [
        [LABELS.get(k, k), ns(v), ratio(v / floor) if floor else "—", ratio(v / bucket)]
        for k, v in single.items()
    ]
    out = [
        table("one process, unlimited rate | cost | × the floor | × the Value+Lock bucket", rows),
        "The floor is a bare native atomic fetch-add called from Python: no call into a limiter"
        " costs less. The Value+Lock bucket is the token bucket users write themselves.",
    ]
    for backend, r in tries.items():
        base = r["acquire granted"]
        rows = [[k, ns(v), ratio(v / base)] for k, v in r.items() if not k.startswith("atomic ops")]
        out.append(table(f"{backend} backend | cost | × a granted `acquire()`", rows))
        ops = [f"{v:.1f} {k}" for k, v in r.items() if k.startswith("atomic ops")]
        if ops:
            out.append(f"On the `{backend}` backend, counted (not assumed): {', '.join(ops)}.")
    out.append(
        "On the native backend a granted `acquire()` is one native call: a fetch-add on the tail"
        " and a load of the head. A refusal is decided in the same call, so a flood of refusals"
        " costs about what a flood of grants does."
    )
    ours, theirs = agg["shmlimit"], agg["Value+Lock"]
    rows = [[k, count(ours[k]), ratio(ours[k] / theirs[k])] for k in ours]
    head = "processes on one unlimited limiter | acquires/s, all together | × the Value+Lock bucket"
    out.append(table(head, rows))
    out.append("![the cost of each call as a multiple of the floor](img/perf-cost.svg)")
    return "\n\n".join(out)


def rate(run: dict) -> str:
    fid, late, fl = need(run, "fidelity"), need(run, "lateness"), need(run, "filler_under_load")
    rows = [
        [f"{count(r['target'])}/s", pct(r["error_pct"]), count(r["max_1s_window"]),
         count(r["bound"]), "yes" if r["within_bound"] else "**no**"]
        for r in fid
    ]  # fmt: skip
    head = (
        "4 processes, target | achieved (after the first second) | worst 1 s window"
        " | bound `rate + capacity` | within"
    )
    return "\n\n".join(
        [
            table(head, rows),
            "The worst 1 s window is the most grants any second of the run saw; the promise is"
            " that it never exceeds the rate plus the capacity.",
            f"At 1 000/s over 4 processes ({count(late['grants'])} grants), a grant comes"
            f" {ms(late['p50_ms'])} after its turn at the median, {ms(late['p99_ms'])} at the 99th"
            f" percentile and {ms(late['max_ms'])} at worst.",
            f"With the filler's own process running a CPU-bound Python loop"
            f" ({'it stayed the filler' if fl['filler_was_busy_process'] else 'the filler moved'}),"
            f" {count(fl['target'])}/s achieved {fl['achieved']:.1f}/s ({pct(fl['error_pct'])}):"
            " waiters refill for themselves.",
        ]
    )


def waiting(run: dict) -> str:
    cw, rows, a = need(run, "cpu_waiting"), need(run, "waiting"), need(run, "asyncio")
    t = need(run, "asyncio.turns")
    ratios = floor_ratios(rows)
    body = []
    for w in rows:
        x = ratios.get(w["driver"], {}).get(w["rate"])
        body.append(
            [f"{count(w['rate'])}/s", driver(w), cpu(w["cpu_s_per_wall_s"]),
             ratio(x) if x else "—",
             cpu(w["filler_cpu_s_per_wall_s"]) if "filler_cpu_s_per_wall_s" in w else "—",
             f"{w['wakes_per_grant']:.2f}" if "wakes_per_grant" in w else "—",
             ms(w["p50_ms"]), ms(w["p99_ms"]), f"{w['load']:.1f}"]
        )  # fmt: skip
    head = (
        "rate | who waits | CPU-s per wall-s, all 8 | × bare sleepers | filler threads' share"
        " | wakes per grant | p50 lateness | p99 lateness | load"
    )
    arows = [
        [driver(r), cpu(r["cpu_s_per_wall_s"]),
         f"{r['wakes_per_grant']:.2f}" if "wakes_per_grant" in r else "—",
         ms(r["p50_ms"]), ms(r["p99_ms"]), ms(r["max_ms"])]
        for r in a["rows"]
    ]  # fmt: skip
    return "\n\n".join(
        [
            f"8 processes waiting on a 50/s limit burn {cpu(cw['cpu_s_per_wall_s'])} CPU-seconds"
            " per wall second together.",
            "8 processes saturating a rate, against 8 bare sleepers (an absolute deadline, no"
            " limiter) waking at the same instants, measured right after in the same run:",
            table(head, body),
            "CPU-s per wall-s is the CPU time of all 8 processes (every thread) over the wall time:"
            " the limiter's cost of waiting is the waiters' row over the bare sleepers' at the same"
            " rate. The filler threads' share is included in it; wakes per grant counts the waiting"
            " threads' sleeps (1.00: one wake per grant). Lateness is how long after its turn each"
            " grant came; load is the 1-minute load average as the row ended.",
            "A queued waiter sleeps in one native call to the instant its turn is due and wakes"
            " once per grant; on the `atomics` backend it has no native wait.",
            "![CPU per wall second of 8 waiters and of 8 bare sleepers](img/perf-waiting.svg)",
            f"With asyncio (section 12), 8 processes each run one event loop saturating"
            f" {count(a['rows'][0]['rate'])}/s through `acquire_async`, beside 8 bare asyncio"
            " sleepers on the loop's own precise timer and 8 on plain `asyncio.sleep`:",
            table(
                "who waits | CPU-s per wall-s, all 8 | wakes per grant | p50 lateness"
                " | p99 lateness | max lateness",
                arows,
            ),
            f"Taking {t['turns']} turns of {t['turn_s']:g} s each, side by"
            " side, each after a pause nobody measures (the waiters' filler thread refills the"
            " bucket after their turn; a waiter stops once its next grant would come after its"
            f" turn's end), the waiters burned {cpu(t['waiters'])} CPU-s per wall-s of"
            f" their turns, their filler threads' {cpu(t['filler'])} included, and the"
            f" sleepers {cpu(t['sleepers'])}: `acquire_async` burned {ratio(a['ratio'])}"
            " times the precise sleepers' CPU (the target: at most 1.25; load average"
            f" {load(a['load'])}), with a 90 % interval of"
            f" {ratio(t['interval'][0])}-{ratio(t['interval'][1])} over the"
            " pairs of turns. Each quarter of the turns on its own gave"
            f" {', '.join(ratio(r) for r in t['quarters'])}. Whole runs minutes apart"
            " move by more than that interval: what a run's processes land on moves it too. In"
            " their turns the waiters were granted a little"
            " over the rate, the bucket's capacity at each turn's start. The rows above ran one"
            " after the other, each alone, for its lateness; their CPU is compared in turns,"
            " under the same neighbours, because two rows of the same bare sleepers, one right"
            " after the other, differed by up to 1.31 times. The chart's asyncio pair is the"
            " turns'.",
        ]
    )


def several(run: dict) -> str:
    out = []
    for backend, rows in need(run, "rates").items():
        base = rows["one rate: acquire()"]
        body = [[f"`{k}`", ns(v), ratio(v / base)] for k, v in rows.items()]
        out.append(table(f"{backend} backend | cost | × one rate's `acquire()`", body))
    out.append(
        "One process at an unlimited rate, each call interleaved with the others and the best of"
        " seven rounds kept, as a multiple of one rate's `acquire()` in the same process (the"
        " target: a granted `acquire()` over two rates at most 2.5 times one rate's, native)."
    )
    return "\n\n".join(out)


def keyed(run: dict) -> str:
    k = need(run, "keyed")
    out = []
    for backend in ("native", "atomics"):
        if backend not in k:
            continue
        r = k[backend]
        base = r["Limiter.try_acquire (granted)"]
        body = [
            [name, ns(v), ratio(v / base)]
            for name, v in r.items()
            if name not in ("evictions during churn", "bytes of segment per key slot")
        ]
        out.append(table(f"one process, {backend} | cost | × `Limiter.try_acquire`", body))
        out.append(
            f"On `{backend}`, a key slot takes {r['bytes of segment per key slot']:.0f} bytes of"
            f" the segment; the churn evicted {count(r['evictions during churn'])} idle keys."
        )
        if backend == "atomics":
            out[-1] += (
                " A keyed `try_acquire` on a live key costs"
                f" {ratio(r['keyed try_acquire, live key (granted)'] / base)} times this backend's"
                " `Limiter.try_acquire` (the target: at most 5)."
            )
    agg = k["aggregate_per_s"]
    ours = agg["shmlimit"]
    body = [
        [name, "skipped (`limits` not installed)" if v is None else count(v),
         "—" if v is None else ratio(ours / v)]
        for name, v in agg.items()
    ]  # fmt: skip
    head = "4 processes over 100 000 keys | `try_acquire` calls/s, all together | shmlimit × this"
    out.append(table(head, body))
    out.append(
        "The per-key rate is unlimited, so every call is granted and the figures are the cost of"
        " finding a key's bucket; `limits+redis` is `limits` with its Redis storage (fixed"
        " window, a local `redis-server`)."
    )
    return "\n\n".join(out)


def hosts(run: dict) -> str:
    red, h, lt = need(run, "redis"), need(run, "hierarchy"), need(run, "latency")
    if not red or not h or not lt:
        return "Skipped in this run: no `redis-server` on the PATH and no `--redis` URL."
    body = [
        [r["kind"], f"{count(r['target'])}/s", count(r["ops_per_s"]),
         f"{r['round_trips_per_op']:.4f}"]
        for r in red
    ]  # fmt: skip
    head = "4 processes, local `redis-server` | target | ops/s | Redis round trips per op"
    out = [
        table(head, body),
        "Direct: every decision is a Redis call (`RedisLimiter`). Hierarchical: each host's"
        " shared memory is fed from Redis in batches.",
    ]
    body = [
        [r["mode"], f"{count(r['rate'])}/s", "timed" if r["timed"] else "untimed",
         pct(r["error_pct"]), cpu(r["waiters_cpu"]), cpu(r["filler_cpu"]),
         f"{r['wakes_per_grant']:.2f}", f"{r['load']:.1f}"]
        for r in h["table"]
    ]  # fmt: skip
    head = (
        "8 processes | rate | acquire | achieved | waiters' CPU-s/s | filler threads' CPU-s/s"
        " | wakes per grant | load"
    )
    out.append(table(head, body))
    out.append(
        "Achieved is measured after the first second (the initial burst); timed callers use"
        " `acquire(timeout=0.5)`. As multiples of the local mode at the same rate: "
        + "; ".join(
            f"{label.replace(',', ' ')}: the waiters' CPU {ratio(w)}, with the filler threads"
            f" {ratio(t)}"
            for label, (w, t) in hierarchy_ratios(h).items()
        )
        + "."
    )
    if h["sweep"]:
        body = [
            [f"{count(r['rate'])}/s", pct(r["error_pct"]), f"{r['round_trips_per_op']:.4f}",
             f"{r['load']:.1f}"]
            for r in h["sweep"]
        ]  # fmt: skip
        out.append(table("hierarchical, 4 processes | achieved | round trips per op | load", body))
        out.append(
            "At low rates a batch from Redis is one op, so Redis sees about one round trip per"
            " op; at high rates, about one per 10 ms of schedule (the feeder's batch)."
        )
        loc = h.get("local_1m")
        if loc:
            out.append(
                f"The local limiter right after, at {count(loc['rate'])}/s: {pct(loc['error_pct'])}"
                " (how much of a shortfall at the top rate is the Python processes' own)."
            )
    body = [
        [label, f"{r['achieved']:.1f}/s", count(r["max_1s"]), count(r["bound"]),
         f"{r['round_trips_per_op']:.4f}", ms(r["p99_ms"]), f"{100 * r['host0_share']:.0f} %"]
        for label, r in lt["runs"].items()
    ]  # fmt: skip
    out.append(
        f"Three hosts of {lt['per_host']} processes each, behind proxies adding"
        f" {', '.join(map(str, lt['delays_ms']))} ms each way, sharing a global"
        f" {count(lt['rate'])}/s:"
    )
    head = (
        "run | achieved | worst 1 s window | bound | round trips per op"
        " | p99 latency of `acquire()` | host 0's share"
    )
    out.append(table(head, body))
    out.append(
        "The bound of a hierarchical limiter is `rate × (1 s + lease TTL + 0.05 s) + capacity`."
        " Saturated, callers queue for their turns; at 70 % load they are paced below the rate,"
        " so an `acquire()` seldom waits. Host 0's share is its grants' part of all (a third"
        " when the hosts share evenly)."
    )
    return "\n\n".join(out)


def hierarchy_cpu(run: dict) -> str:
    if "hierarchy_cpu" not in run:
        return NOT_MEASURED.format(key="hierarchy_cpu")
    h = run["hierarchy_cpu"]
    if not h:
        return "Skipped in this run: no `redis-server` on the PATH and no `--redis` URL."
    body = [
        [r["mode"], f"{r['achieved']:.1f}/s", cpu(r["waiters_cpu"]), cpu(r["filler_cpu"]),
         cpu(r["waiters_cpu"] + r["filler_cpu"]),
         "—" if r["round_trips"] is None else f"{r['round_trips'] / h['seconds']:.1f}",
         f"{r['load']:.1f}"]
        for r in h["rows"]
    ]  # fmt: skip
    head = (
        "8 untimed waiters, 50/s | achieved | waiters' CPU-s/s | filler threads' CPU-s/s"
        " | whole tree CPU-s/s | Redis round trips/s | load"
    )
    return "\n\n".join(
        [
            f"Local and hierarchical runs alternating, {h['seconds']:g} s each:",
            table(head, body),
            f"The hierarchical runs' whole process tree (the waiters, and the filler threads with"
            f" their Redis round trips) burned {ratio(h['tree_ratio'])} times the local runs'"
            f" (the target: at most 1.5), the waiters alone {ratio(h['waiters_ratio'])} times."
            f" The filler threads' CPU per lease (one Redis round trip) was"
            f" {us(h['filler_us_per_lease'])}: {us(h['filler_us_per_op'])} per op delivered,"
            f" against {us(h['local_filler_us_per_op'])} per op in local mode. Load average"
            f" {load(h['load'])} as the section ended.",
        ]
    )


def limits_hits(run: dict) -> str:
    if "limits_hits" not in run:
        return NOT_MEASURED.format(key="limits_hits")
    h = run["limits_hits"]
    if h is None:
        return "Skipped in this run: `limits` is not installed (`pip install '.[bench]'`)."
    ratios = limits_ratios(h)
    body = [
        [k, ns(r["memory"]), ns(r["shm"]), ratio(ratios[k]),
         "—" if k == "moving window" else "at most 1.5"]
        for k, r in h["ns_per_hit"].items()
    ]  # fmt: skip
    head = "one process, a hit | `memory://` | `shm://` | `shm://` × `memory://` | the target"
    n = h["processes"]
    agg = [
        [k, count(r["shm"]), count(r["memory"]),
         "skipped (no Redis)" if r["redis"] is None else count(r["redis"])]
        for k, r in h["aggregate_per_s"].items()
    ]  # fmt: skip
    agg_head = (
        f"{n} processes at once | `shm://`, one table shared | `memory://`, each process its own"
        " | `limits` on Redis"
    )
    return "\n\n".join(
        [
            f"`limits`' strategies hitting {h['keys']} keys at `{h['limit']}` (the moving window at"
            f" `{h['moving_limit']}`), a limit never reached, on `shm://` and on `limits`' own"
            f" `memory://` in one process, interleaved, the best of {h['repeats']} kept:",
            table(head, body),
            "A hit is `strategy.hit(item, key)`, the call Flask-Limiter and slowapi make per"
            " request. The moving window is shown with no target: on `memory://` its cost grows"
            " with the hits in a key's window.",
            f"{n} processes hitting the same keys for {h['seconds']:g} s, hits/s all together:",
            table(agg_head, agg),
            "`memory://` is not shared: each process counts its own hits, so its figure is what"
            " a limit per worker costs, not a limit across them. `shm://` and Redis count every"
            f" process's hits in one place. Load average {load(h['load'])} as the section ended.",
        ]
    )


INTRO = """\
<!-- Made by tools/perf_page.py from img/bench.json: edit those, not this page. -->
# Performance

Every figure on this page comes from one run of the benchmark, [`img/bench.json`](img/bench.json),
and is given as a ratio to baselines measured in the same run: a bare native atomic fetch-add
called from Python (the floor), the `multiprocessing.Value` + `Lock` token bucket users write
themselves, bare sleepers waking at the same instants as the limiter's waiters, and other
libraries. Ratios travel between machines far better than nanoseconds do. From a clone, with a
`redis-server` on the PATH and `.venv/bin/pip install '.[bench]'` (for `limits`), the page is
made again with:

```sh
python tools/bench.py --json > docs/img/bench.json   # the run: about five minutes
python tools/perf_page.py                            # this page and its plots, from that run
```

`python tools/bench.py` alone prints the same figures as a table; `--only-waiting`,
`--only-redis`, `--only-hierarchy`, `--only-hierarchy-cpu`, `--only-keyed`, `--only-rates`,
`--only-asyncio` and `--only-limits-hits` run one part (the page needs a whole run). A hypervisor moves single figures by several per cent between
runs: compare rows within a table.
"""

SECTIONS = [
    ("The machine", machine),
    ("The cost of a call (sections 1, 1b, 2)", cost),
    ("Holding the rate (sections 3, 4, 6)", rate),
    ("CPU while waiting (sections 5, 12)", waiting),
    ("Several rates at once (section 11)", several),
    ("Keyed limits (section 8)", keyed),
    ("`limits` on shared memory (section 13)", limits_hits),
    ("Across hosts (sections 7, 9, 10)", hosts),
    ("The hierarchical mode's CPU at a low rate (section 9a)", hierarchy_cpu),
]

SOAK = """\
## Soak

`python tools/soak.py` runs independent worker interpreters against one limiter while it kills
workers and the filler with SIGKILL, stops them with SIGSTOP, and restarts them at random, then
checks every grant against `rate*T + capacity` ([Development](development.md#the-soak-test)).
"""


def render(run: dict) -> Dict[str, str]:
    """The page and its plots, by path under the docs directory."""
    for path in REQUIRED:
        need(run, path)
    page = [INTRO] + [f"## {title}\n\n{fn(run)}\n" for title, fn in SECTIONS] + [SOAK]
    return {
        "performance.md": "\n".join(page),
        "img/perf-cost.svg": cost_plot(run),
        "img/perf-waiting.svg": waiting_plot(run),
    }


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run", nargs="?", default=DEFAULT_RUN, help="the output of bench.py --json")
    ap.add_argument("--docs", default=os.path.join(ROOT, "docs"), help="the docs directory")
    a = ap.parse_args(argv)
    try:
        with open(a.run) as f:
            files = render(json.load(f))
    except json.JSONDecodeError as e:
        print(f"perf_page: {a.run}: not the JSON of tools/bench.py --json: {e}", file=sys.stderr)
        return 2
    except RunError as e:
        print(f"perf_page: {a.run}: {e}", file=sys.stderr)
        return 2
    for rel, text in files.items():
        path = os.path.join(a.docs, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
