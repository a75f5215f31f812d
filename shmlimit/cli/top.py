"""The live inspector behind ``shmlimit top`` and ``tools/shmtop``.

It only reads: every snapshot comes from ``shmlimit.inspect``, which reads a copy of a
segment without registering, never joins the filler election and writes
nothing.  Grants per second are measured between two snapshots, so the first
figures appear after one interval.

``--json`` prints one JSON object per refresh, on one line:

    {"time": <unix seconds>, "interval": <seconds>, "limiters": [<limiter>, ...]}

where each <limiter> has every field of ``shmlimit.Stats`` (``processes`` as a
list of objects with ``pid``, ``alive``, ``grants``, ``waiting``, ``filler``
and ``command``), plus ``grants_per_second`` (over the last interval),
``history`` (the recent grants per second, oldest first) and ``stale`` (no
live process attached, nor any counted beyond its process table: as ``gc``
judges); or, for a segment that cannot be read, just ``name`` and ``error``.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time
from collections import deque
from dataclasses import asdict
from typing import Any, Deque, Dict, List, Optional, Sequence, Tuple

from shmlimit.errors import ShmlimitError
from shmlimit.keyed.stats import KeyedStats, KeySample, sample_keys, sample_windows
from shmlimit.kinds import beyond, inspect_each
from shmlimit.multirate import MultiStats
from shmlimit.shm.segment import scan
from shmlimit.stats import Stats

SPARKS = "▁▂▃▄▅▆▇█"
#: Key slots a refresh reads from each keyed limiter: the busiest keys are found over several
#: refreshes by a rotating cursor, never by a scan of the whole table at once.
KEY_SAMPLE = 4096
BUSIEST = 5
HISTORY = 30
#: The longest ``--interval`` (seconds): a day between refreshes.
MAX_INTERVAL = 86400.0
CLEAR = "\x1b[H\x1b[2J"
#: What a listing of no limiter says.
NONE_HERE = "no shmlimit limiters on this machine"
#: What a listing says of a segment named unlike a limiter.
BAD_NAME = "not a valid limiter name: skipped"


def printable(text: str) -> str:
    """``text`` with every control character escaped (``\\x1b``), so no stored string can drive a terminal.

    URLs, keys, error messages and process names come from segments and from
    other users' processes: printed raw, an escape sequence in one could
    rewrite the operator's screen or title, or hide a line.
    """
    if text.isprintable():
        return text
    return "".join(
        ch if ch.isprintable() else ch.encode("unicode_escape").decode("ascii") for ch in text
    )


#: A rate as the tools write it: ops per window, ``100/1s``.
RATE = "{rate:g}/{per:g}s"
_KEYS = "keys {keys}/{slots}  evicted {evicted}  refused (table full) {refused_full}  "
#: How the tools show each kind of snapshot (by its ``kind``; a ``Stats`` has none: "plain"), the
#: same in every view (``list``, ``inspect``, ``top``'s table and detailed view): what differs
#: between kinds is written here once, never in a view.  Templates that a record fills (``show``;
#: a record is ``asdict`` of a snapshot, or an ``Inspector`` row): ``rate`` (or what it is
#: instead: a table of window counters has none), ``capacity``, ``level`` (what it holds now: ops
#: available, or the keys live of its slots), ``title`` and ``counters`` (the detailed view's
#: first two lines).  And ``label`` (``top``'s KIND column), ``note`` (after its line in
#: ``list``), ``counted`` (what its grants are: a table of window counters counts hits),
#: ``adapts`` (what an adaptive rate adapts in it), ``hidden`` (the fields ``inspect`` leaves
#: out) and ``fills`` (its processes wait for tokens, and one fills them: a ``Limiter``'s).
KINDS: Dict[str, Dict[str, Any]] = {
    "plain": dict(
        label="plain",
        rate=RATE,
        capacity="{capacity:g}",
        level="{available:.1f}",
        title=f"rate {RATE} ratio {{ratio:g}}  capacity {{capacity:g}}",
        counters="available {available:.1f}  deficiency {deficiency:.1f} ops / "
        "{deficiency_seconds:.4f} s  behind {behind_seconds:.3f} s  "
        "starved {starved_seconds:.3f} s  grants {grants}",
        note="",
        counted="grants",
        adapts="the rate",
        hidden={"processes"},
        fills=True,
    ),
    "keyed": dict(
        label="keyed",
        rate=RATE,
        capacity="{capacity:g}",
        level="{keys}/{slots} keys",
        title=f"keyed: rate {RATE} capacity {{capacity:g}} per key",
        counters=_KEYS + "overrides {overrides}/{override_slots}  grants {grants}",
        note="  keyed",
        counted="grants",
        adapts="each key's rate",
        hidden={"processes"},
        fills=False,
    ),
    "windows": dict(
        label="shm://",
        rate="windows",
        capacity="-",
        level="{keys}/{slots} keys",
        title="windows: a limits storage (shm://{name}), the limits are its users'",
        counters=_KEYS + "hits {grants}",
        note="  limits storage (grants: hits)",
        counted="hits",
        adapts="each key's rate",
        hidden={"processes", "rate", "per", "capacity", "overrides", "override_slots"},
        fills=False,
    ),
}


def kind_of(r: dict) -> Dict[str, Any]:
    """How the tools show the record ``r`` (``KINDS``)."""
    return KINDS[r.get("kind") or "plain"]


def show(r: dict, field: str) -> str:
    """The text of ``field``, one of the templates of ``KINDS``, for the record ``r``."""
    return kind_of(r)[field].format_map(r)


def sparkline(values: Sequence[float]) -> str:
    """Unicode blocks scaled from 0 to the largest value."""
    if not values:
        return ""
    top = max(values)
    if top <= 0:
        return SPARKS[0] * len(values)
    return "".join(
        SPARKS[min(len(SPARKS) - 1, int(v / top * (len(SPARKS) - 1) + 0.5))] for v in values
    )


@functools.lru_cache(maxsize=None)
def command_of(pid: int, alive: bool) -> str:
    """The process's command name (psutil), cached; '?' when it cannot be read (or it is gone)."""
    if not alive:
        return "?"
    try:
        import psutil

        return psutil.Process(pid).name()
    except Exception:  # gone or not ours to read
        return "?"


def _beyond(name: str) -> int:
    """The processes counted beyond ``name``'s process table (``kinds.beyond``; 0 unread)."""
    try:
        return beyond(name)
    except (ShmlimitError, OSError, ValueError):
        return 0


class Inspector:
    """Successive snapshots of some (or all) limiters, with rates and history."""

    def __init__(self, names: Optional[List[str]] = None) -> None:
        self.names = names
        self.prev: Dict[str, Tuple[float, int]] = {}
        self.history: Dict[str, Deque[float]] = {}
        self.cursor: Dict[str, int] = {}
        self.seen_keys: Dict[str, Dict[str, KeySample]] = {}

    def sample(self) -> List[dict]:
        names, bad = (self.names, []) if self.names is not None else scan()
        now = time.monotonic()
        out: List[dict] = [{"name": n, "error": BAD_NAME} for n in bad]
        for seg, s in inspect_each(names, lambda n, e: out.append({"name": n, "error": str(e)})):
            # several rates: a row per rate, NAME[KEY]
            rows = s.rates.values() if isinstance(s, MultiStats) else (s,)
            records = [self._record(r.name, r, now) for r in rows]
            if any(r["stale"] for r in records) and _beyond(seg):
                for r in records:  # in use, as ``gc`` judges it: by processes beyond its table
                    r["stale"] = False
            out.extend(records)
        # memory for the limiters read now only: one gone (or unreadable) is forgotten
        here = {r["name"] for r in out if "error" not in r}
        for kept in (self.prev, self.history, self.cursor, self.seen_keys):
            for gone in kept.keys() - here:
                del kept[gone]
        return out

    def _busiest(self, name: str) -> List[dict]:
        """The busiest keys seen so far, refreshed KEY_SAMPLE slots at a time."""
        found, self.cursor[name] = sample_keys(name, self.cursor.get(name, 0), KEY_SAMPLE)
        seen = self.seen_keys.setdefault(name, {})
        for k in found:
            seen[k.key] = k
        if len(seen) > 4 * KEY_SAMPLE:  # bounded memory: keep the busiest
            for k in sorted(seen, key=lambda k: seen[k].grants)[: len(seen) - 2 * KEY_SAMPLE]:
                del seen[k]
        # each key's rate is its own (an adaptive key's rate in force) as last read, or None
        return [asdict(k) for k in sorted(seen.values(), key=lambda k: -k.grants)[:BUSIEST]]

    def _windows(self, name: str) -> List[dict]:
        """The fullest windows (by count) among the next KEY_SAMPLE slots: those now counting."""
        found, self.cursor[name] = sample_windows(name, self.cursor.get(name, 0), KEY_SAMPLE)
        return [
            asdict(w) for w in sorted(found, key=lambda w: (-w.count, -w.previous, w.key))[:BUSIEST]
        ]

    def _record(self, name: str, s: "Stats | KeyedStats", now: float) -> dict:
        """One row (``name`` a rate's label, ``group[key]``, for a rate of a group)."""
        d = asdict(s)
        d["processes"] = [dict(asdict(p), command=command_of(p.pid, p.alive)) for p in s.processes]
        if isinstance(s, KeyedStats):  # its busiest keys, or a limits storage's fullest windows
            field, read = (
                ("windows", self._windows) if s.kind == "windows" else ("busiest", self._busiest)
            )
            try:
                d[field] = read(name)
            except (ShmlimitError, OSError):
                d[field] = []
        last = self.prev.get(name)
        gps = None
        if last is not None and now > last[0]:
            gps = max(0.0, (s.grants - last[1]) / (now - last[0]))
            self.history.setdefault(name, deque(maxlen=HISTORY)).append(gps)
        self.prev[name] = (now, s.grants)
        d["grants_per_second"] = gps
        d["history"] = list(self.history.get(name, ()))
        d["stale"] = not any(p.alive for p in s.processes)
        return d


def terminal_size(out) -> Tuple[Optional[int], Optional[int]]:
    """(columns, lines) to fit the view to: ``COLUMNS``/``LINES`` when set, else the terminal's
    when ``out`` is one; None for a dimension not known (a pipe: nothing is cut)."""
    size = None
    try:
        if out.isatty():
            size = os.get_terminal_size(out.fileno())
    except (AttributeError, OSError, ValueError):
        size = None
    dims: List[Optional[int]] = []
    for var, i in (("COLUMNS", 0), ("LINES", 1)):
        try:
            v = int(os.environ.get(var, ""))
        except ValueError:
            v = 0
        dims.append(v if v > 0 else (size[i] if size is not None else None))
    return dims[0], dims[1]


def _activity(r: dict) -> Tuple[int, float, int, str]:
    """The sort key of the table: the busiest first (grants per second, then grants), unreadable
    segments last."""
    if "error" in r:
        return (1, 0.0, 0, r["name"])
    return (0, -(r.get("grants_per_second") or 0.0), -r.get("grants", 0), r["name"])


def _per_second(gps: Optional[float]) -> str:
    """Grants per second over the last interval ('-' before the second snapshot)."""
    return "-" if gps is None else f"{gps:,.1f}"


def _state_of(r: dict) -> str:
    if "error" in r:
        return "UNREADABLE"
    dead = sum(not p["alive"] for p in r["processes"])
    state = "STALE" if r["stale"] else "STOPPED" if r.get("stopped") else "ok"
    return state + (f" {dead} dead" if dead else "")


def table(
    records: List[dict],
    interval: float,
    width: Optional[int] = None,
    height: Optional[int] = None,
    show_stale: bool = False,
) -> str:
    """The whole machine's view: a title, a header, one line per limiter, busiest first; stale
    limiters hidden unless ``show_stale``; cut to ``width`` columns and ``height`` lines, with a
    count of the limiters not shown."""
    shown = sorted(
        (r for r in records if show_stale or "error" in r or not r["stale"]), key=_activity
    )
    stale = len(records) - len(shown)
    room = len(shown) if height is None else max(0, height - 3)  # title, header, what is left
    rows, rest = shown[:room], len(shown) - min(room, len(shown))
    title = (
        f"shmlimit top {time.strftime('%H:%M:%S')}, every {interval:g} s: "
        f"{_limiters(records)} limiter(s)"
    )
    fixed = 7 + 13 + 11 + 6 + 14  # kind, rate, grants/s, procs and state, with their spaces
    name_w = max(12, (width or 80) - fixed - 1 - 8)  # 8 columns of history when room allows
    spark_w = max(0, (width or 80) - fixed - 1 - name_w)
    lines = [
        title,
        f"{'NAME':{name_w}} {'KIND':6} {'RATE':>12} {'GRANTS/S':>10} {'PROCS':>5} {'STATE':13} "
        + ("HISTORY" if spark_w >= 7 else ""),
    ]
    for r in rows:
        name = _cut(r["name"], name_w)
        if "error" in r:
            lines.append(f"{name:{name_w}} {'?':6} {'-':>12} {'-':>10} {'-':>5} {_state_of(r):13}")
            continue
        alive = sum(p["alive"] for p in r["processes"])
        lines.append(
            f"{name:{name_w}} {kind_of(r)['label']:6} {show(r, 'rate')[:12]:>12} "
            f"{_per_second(r['grants_per_second']):>10} {alive:>5} {_state_of(r)[:13]:13} "
            f"{sparkline(r['history'][-spark_w:]) if spark_w else ''}"
        )
    if not records:
        lines.append(NONE_HERE)
    hidden = [  # what is left out, where anything is
        text
        for count, text in (
            (rest, f"{rest} more below"),
            (stale, f"{stale} stale hidden (--all shows them)"),
        )
        if count
    ]
    if hidden:
        lines.append("... " + ", ".join(hidden))
    return "".join(_fit(printable(line.rstrip()), width) + "\n" for line in lines)


def _limiters(records: List[dict]) -> int:
    """The limiters the rows are of: a limiter of several rates has a row per rate, ``NAME[KEY]``."""
    return len({r["name"].partition("[")[0] for r in records})


def _cut(name: str, width: int) -> str:
    """``name`` in ``width`` columns; a rate's row (``NAME[KEY]``) keeps its key, its name cut."""
    if len(name) <= width:
        return name
    base, _, key = name.partition("[")
    if key and len(key) + 3 <= width:
        return base[: width - len(key) - 2] + "~[" + key
    return name[: width - 1] + "~"


def _fit(line: str, width: Optional[int]) -> str:
    return line if width is None or len(line) <= width else line[: max(0, width - 1)] + "~"


def render(records: List[dict], interval: float) -> str:
    """The detailed view of the limiters named (not cut to the terminal: a line per fact)."""
    lines = [
        f"shmlimit top — {time.strftime('%H:%M:%S')}, every {interval:g} s, "
        f"{_limiters(records)} limiter(s)",
        "",
    ]
    if not records:
        lines.append(NONE_HERE)
    for r in records:
        if "error" in r:
            lines += [f"{r['name']}: unreadable: {r['error']}", ""]
            continue
        lines += _detail(r)
    return "\n".join(printable(line) for line in lines) + "\n"


def _detail(r: dict) -> List[str]:
    """A limiter's lines, whatever its kind (``KINDS``): what it is, its counters, its rate of use,
    then what it has (an adaptive rate, an upstream, its busiest keys or its fullest windows), then
    its processes: each user's pid, command, liveness and count, and for a ``Limiter`` whether it
    waits and which one fills."""
    k = kind_of(r)
    flags = (" STOPPED" if r.get("stopped") else "") + (
        " STALE (no live process)" if r["stale"] else ""
    )
    use = f"  {k['counted']}/s {_per_second(r['grants_per_second'])}  {sparkline(r['history'])}"
    if k["fills"]:
        hb = "-" if r["heartbeat_age"] is None else f"{r['heartbeat_age'] * 1000:.0f} ms"
        use += f"  filler {r['filler_pid'] or '-'} (heartbeat {hb})"
    out = [f"{r['name']}  {show(r, 'title')}{flags}", "  " + show(r, "counters"), use]
    if r.get("adapt"):
        out.append(adapt_line(r["adapt"], k["adapts"]))
    up = r.get("upstream")
    if up:
        out.append(
            f"  upstream {up['url']} {up['key']}  state {up['state'].upper() if up['state'] != 'ok' else 'ok'}"
            f"  round trips {up['round_trips']}  leased {up['leased']}  expired {up['expired']}"
            f"  errors {up['errors']}  fallbacks {up['fallbacks']}"
        )
    if r.get("busiest"):
        out.append(f"  {'busiest keys':28} {'grants':>10}  {'limited for':>11}  rate")
        for key in r["busiest"]:
            out.append(
                f"  {printable(key['key'])[:28]:28} {key['grants']:>10}  {key['wait']:>9.3f} s  "
                + ("default" if key["rate"] is None else RATE.format_map(key))
            )
    if r.get("windows"):
        out.append(f"  {'fullest windows':40} {'strategy':8} {'count':>8} {'previous':>8}  ends in")
        for w in r["windows"]:
            out.append(
                f"  {printable(w['key'])[:40]:40} {w['strategy']:8} {w['count']:>8} "
                f"{w['previous'] if w['strategy'] == 'sliding' else '-':>8}  {w['ends_in']:.3f} s"
            )
    out.append(
        f"  {'pid':>8} {'command':16} {'state':6} {k['counted']:>10}"
        + ("  waiting" if k["fills"] else "")
    )
    for p in r["processes"]:
        role = (
            f"  {'yes' if p['waiting'] else 'no'}{' filler' if p['filler'] else ''}"
            if k["fills"]
            else ""
        )
        out.append(
            f"  {p['pid']:>8} {p['command'][:16]:16} {'alive' if p['alive'] else 'DEAD':6} "
            f"{p['grants']:>10}{role}"
        )
    return out + [""]


def adapt_line(a: dict, what: str) -> str:
    """An adaptive rate's bounds and totals (``AdaptStats``, every process's): ``what`` adapts."""
    return (
        f"  adaptive: {what} from {a['min_rate']:g} to {a['max_rate']:g} every "
        f"{a['window']:g} s  outcomes {a['throttled']} throttled, {a['ok']} ok  "
        f"cuts {a['cuts']}  raises {a['raises']}"
    )


def run(
    names: Optional[List[str]],
    interval: float,
    once: bool,
    as_json: bool,
    out=None,
    show_stale: bool = False,
) -> int:
    """Refresh until interrupted (or once).  Returns the exit status.

    Without ``names``, every limiter on the machine in one table (``table``) that fits the
    terminal (``terminal_size``); with them, the detailed view of those (``render``)."""
    out = out or sys.stdout
    tty = out.isatty() and not as_json
    insp = Inspector(names)
    insp.sample()  # the baseline the first rates are measured from
    try:
        while True:
            time.sleep(interval)
            records = insp.sample()
            if as_json:
                out.write(
                    json.dumps(
                        {"time": time.time(), "interval": interval, "limiters": records},
                        allow_nan=False,
                    )
                    + "\n"
                )
            else:
                width, height = terminal_size(out)
                view = (
                    render(records, interval)
                    if names
                    else table(records, interval, width, height, show_stale)
                )
                out.write((CLEAR if tty else "") + view)
            out.flush()
            if once:
                return 0
    except KeyboardInterrupt:
        return 0
