"""The ``shmlimit`` command line.

User mistakes (an unknown name, a bad rate) print one clear line on stderr and
exit with status 2; they never print a traceback.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import sys
import time
from dataclasses import asdict
from typing import Callable, List, Optional, Sequence

from shmlimit import __version__, live_changes
from shmlimit.cli.metrics import CONTENT_TYPE, MAX_SEGMENTS, exposition, families, omitted_note
from shmlimit.cli.top import (
    BAD_NAME,
    MAX_INTERVAL,
    NONE_HERE,
    RATE,
    adapt_line,
    kind_of,
    printable,
    show,
)
from shmlimit.cli.top import run as run_top
from shmlimit.config import parse_spec
from shmlimit.errors import (
    ConfigMismatchError,
    LimiterNotFoundError,
    SegmentError,
    ShmlimitError,
)
from shmlimit.keyed.limiter import KeyedLimiter
from shmlimit.keyed.stats import KeyedStats, KeySample, adapted_keys
from shmlimit.kinds import claimed, collect, inspect, inspect_each, reopen, stale
from shmlimit.limiter import Limiter, unlink
from shmlimit.multirate import MultiStats
from shmlimit.rate_group import parse_rates
from shmlimit.shm.segment import drop_secret, orphan_secrets, scan, validate_name
from shmlimit.stats import Stats


class UserError(Exception):
    """A mistake in the command line, reported as one line."""


# ---- demo --------------------------------------------------------------------------


_demo_limiter: Optional[Limiter] = None


def _demo_ready(barrier, lim: Limiter) -> None:
    global _demo_limiter
    _demo_limiter = lim  # attached here, before the clock starts
    barrier.wait(timeout=120)  # the clock starts when every worker is up


def _run_delay() -> float:
    """Seconds this process's threads have waited runnable for a CPU so far (the kernel's
    schedstat; 0.0 where it does not say)."""
    total = 0
    try:
        for tid in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                total += int(f.read().split()[1])
    except (OSError, ValueError, IndexError):
        return 0.0
    return total / 1e9


def _demo_worker(end: float) -> tuple:
    lim = _demo_limiter
    assert lim is not None
    n = 0
    began, held0 = time.monotonic(), _run_delay()
    while True:
        lim.acquire()
        if time.monotonic() > end:  # granted after the run: not counted
            return os.getpid(), n, _run_delay() - held0, began
        n += 1


def cmd_demo(args: argparse.Namespace) -> int:
    """W pool workers share one rate for S seconds; print progress, then achieved vs target."""
    name = f"demo-{os.getpid()}"
    lim = Limiter(name, rate=args.rate, burst=args.burst)
    cfg = lim.config
    ctx = mp.get_context(args.start_method)
    print(
        f"shmlimit demo: {args.workers} {args.start_method} workers share {lim.rate:g} ops/s "
        f"(capacity {lim.capacity:g}) for {args.seconds:g} s, backend {lim.backend}"
    )
    try:
        barrier = ctx.Barrier(args.workers + 1)
        with ctx.Pool(args.workers, initializer=_demo_ready, initargs=(barrier, lim)) as pool:
            barrier.wait(timeout=120)
            starved0 = inspect(name).starved_seconds
            start = time.monotonic()
            end = start + args.seconds
            jobs = [pool.apply_async(_demo_worker, (end,)) for _ in range(args.workers)]
            last_t, last_g = start, inspect(name).grants
            while time.monotonic() < end:
                time.sleep(min(0.5, max(0.0, end - time.monotonic())))
                s = inspect(name)
                now = time.monotonic()
                rate = (s.grants - last_g) / (now - last_t) if now > last_t else 0.0
                print(
                    f"  t={now - start:5.1f}s  grants={s.grants:8d}  rate={rate:10.1f}/s  "
                    f"waiting={sum(p.waiting for p in s.processes):2d}  filler={s.filler_pid}",
                    flush=True,
                )
                last_t, last_g = now, s.grants
            results = [j.get(timeout=args.seconds + 60) for j in jobs]
            starved = inspect(name).starved_seconds - starved0
        elapsed = end - start
    finally:
        lim.close()
        lim.unlink()
    total = sum(r[1] for r in results)
    print(f"\n  {'worker pid':>10}  {'grants':>8}  {'share':>6}")
    for pid, n, *_ in sorted(results):
        print(f"  {pid:>10}  {n:>8}  {100.0 * n / max(total, 1):5.1f}%")
    target = cfg.ops_per_second
    bound = target * elapsed + cfg.burst
    print(
        f"\n  total {total} grants in {elapsed:.2f} s: {total / elapsed:.1f} ops/s, target {target:g} ops/s "
        f"({100.0 * total / elapsed / target:.1f}%); never more than rate*T + capacity = {bound:.0f}: "
        f"{'yes' if total <= bound else 'NO'}"
    )
    # What a busy machine withheld: no worker takes a grant before the pool hands the first one its
    # job, nor while none of them runs (the least of their run-queue waits); and the time the
    # limiter could not credit while they queued (one worker at least: --workers is positive)
    late = max(0.0, min(r[3] for r in results) - start)
    least = min(r[2] for r in results)
    print(
        f"  held up: the first worker started {late:.3f} s late, every worker was off the CPU at most "
        f"{least:.3f} s; the limiter starved {starved:.3f} s"
    )
    return 0 if total <= bound else 1


# ---- list / inspect / create / unlink --------------------------------------------------


def _check_names(names: Sequence[str], exist: bool) -> None:
    """Names given on the command line: valid ones (a ``ValueError``), and with ``exist`` the names
    of limiters that exist and can be read (``inspect``: an unknown one is a user error)."""
    for n in names:
        (inspect if exist else validate_name)(n)


def cmd_list(args: argparse.Namespace) -> int:
    names, bad = scan()
    if args.json:
        out: list = []
        for _, s in inspect_each(names, lambda n, e: out.append({"name": n, "error": str(e)})):
            out.append(asdict(s))
        out.extend({"name": n, "error": BAD_NAME} for n in bad)
        print(json.dumps(out, allow_nan=False))
        return 0
    for n in bad:
        print(printable(f"{n!r}: {BAD_NAME}"))
    if not names:
        print(NONE_HERE)
        return 0
    print(f"{'name':24} {'rate':>12} {'capacity':>9} {'available':>10} {'grants':>10} {'procs':>5}")
    for n, s in inspect_each(names, lambda n, e: print(printable(f"{n:24} unreadable: {e}"))):
        alive = sum(p.alive for p in s.processes)
        if isinstance(s, MultiStats):  # several rates, one limiter: its rates on one line
            rates = ", ".join(
                f"{k}={RATE.format(rate=r.rate, per=r.per)}" for k, r in s.rates.items()
            )
            print(printable(f"{n:24} {len(s.rates):>8} rates {rates}  procs {alive}"))
            continue
        r = asdict(s)  # its rate (or what it is), capacity and level, as every view shows them
        print(
            printable(
                f"{n:24} {show(r, 'rate'):>12} {show(r, 'capacity'):>9} {show(r, 'level'):>10} "
                f"{s.grants:>10} {alive:>5}{kind_of(r)['note']}"
            )
        )
    return 0


def _adapted(s: object) -> "Optional[List[KeySample]]":
    """An adaptive keyed table's keys with their rate in force (``adapted_keys``, the lowest
    first); None for any other limiter."""
    if not isinstance(s, KeyedStats) or s.adapt is None:
        return None
    try:
        return adapted_keys(s.name)
    except (ShmlimitError, OSError):  # changed under us since its snapshot: none shown
        return []


def _inspect_json(s: "Stats | KeyedStats | MultiStats") -> dict:
    """``inspect --json``: the snapshot, and an adaptive keyed table's ``adapted_keys``."""
    d = asdict(s)
    for stats, out in (
        zip(s.rates.values(), d["rates"].values()) if isinstance(s, MultiStats) else [(s, d)]
    ):
        keys = _adapted(stats)
        if keys is not None:
            out["adapted_keys"] = [asdict(k) for k in keys]
    return d


def _print_fields(s: "Stats | KeyedStats", key: str = "") -> None:
    """A snapshot's fields, a line each, but those its kind leaves out (``KINDS``); a rate of
    several under its ``key``, indented.  ``adapt``: its bounds and totals, then an adaptive keyed
    table's keys at their rate in force."""
    indent = "  " if key else ""
    if key:
        print(printable(f"rate {key}"))
    fields = asdict(s)
    kind = kind_of(fields)
    for f, v in fields.items():
        if f in kind["hidden"]:
            continue
        if f == "adapt" and v is not None:
            print(printable(indent + adapt_line(v, kind["adapts"]).strip()))
            continue
        print(printable(f"{indent}{f:20} {v}"))
    keys = _adapted(s)
    if keys:
        assert isinstance(s, KeyedStats)
        print(
            printable(
                f"{indent}keys at their own rate, lowest first ({len(keys)} of {s.overrides})"
            )
        )
        for k in keys:
            rate = "default" if k.rate is None else RATE.format(rate=k.rate, per=k.per)
            print(
                printable(
                    f"{indent}  {k.key:28} rate {rate:>14}  grants {k.grants:>10}  "
                    f"limited for {k.wait:.3f} s"
                )
            )


def cmd_inspect(args: argparse.Namespace) -> int:
    s = inspect(args.name)
    if args.json:
        print(json.dumps(_inspect_json(s), allow_nan=False))
        return 0
    several = isinstance(s, MultiStats)
    for key, r in s.rates.items() if several else [("", s)]:  # each rate as a limiter of its own
        _print_fields(r, key)
    print(f"{'processes':20} {len(s.processes)}")
    # (several rates: each process once; a keyed table's are neither filler nor waiting)
    for p in s.processes:
        flags = ("alive" if p.alive else "dead") + "".join(
            f" {role}" for role in ("filler", "waiting") if getattr(p, role, False)
        )
        print(f"  pid {p.pid:>8}  grants {p.grants:>10}  {flags}")
    return 0


def _before(name: str) -> "Optional[Stats | KeyedStats | MultiStats]":
    """The limiter's settings before ``create`` opens it (None: there is none, or it is unreadable,
    which opening it reports)."""
    try:
        return inspect(name)
    except (ShmlimitError, OSError):
        return None


def _created(name: str, before: "Optional[Stats | KeyedStats]", after: "Stats | KeyedStats") -> str:
    """One line: created, exists (unchanged), or changed (old settings, then new); ``after`` is
    what the limiter holds now."""
    now = after.describe()
    if before is None:
        return printable(f"created: {name} {now}")
    if before.describe() == now:
        return printable(f"exists: {name} {now}")
    return printable(f"changed: {name} {before.describe()} -> {now} (no live process used it)")


def cmd_create(args: argparse.Namespace) -> int:
    """Create a limiter, or open the existing one: unchanged, or changed to these settings when no
    live process uses it (a live one's settings are never changed here: a mismatch exits 2).
    With several rates, a line for each (``NAME[KEY]``)."""
    kind = KeyedLimiter if args.keys is not None else Limiter
    options = dict(mode=int(args.mode, 8), trusted_uids=args.trust_uid)
    options.update({} if args.keys is None else {"keys": args.keys})
    if args.rates is None:
        options.update(rate=args.rate, per=args.per, burst=args.burst)
    elif args.per != 1.0 or args.burst is not None:
        raise UserError(
            "--per and --burst go with --rate; with --rates each item carries its window "
            "and its burst: 'requests=500/min; tokens=200K/min burst=20K'"
        )
    else:  # several rates: one segment, its rates NAME[KEY]
        options["rates"] = args.rates
    keys = None if args.rates is None else parse_rates(args.name, args.rates)[0]

    def rows(s: "Optional[Stats | KeyedStats | MultiStats]") -> list:
        """Each rate's label and its snapshot in ``s`` (None: there is none)."""
        if keys is None:
            return [(args.name, s)]
        rates = s.rates if isinstance(s, MultiStats) else {}
        return [(f"{args.name}[{k}]", rates.get(k)) for k in keys]

    before = rows(_before(args.name))
    try:
        lim = kind(args.name, **options)
    except ConfigMismatchError as e:
        if not e.live:
            raise
        raise UserError(  # (the Python advice, reconfigure=True, is no option here)
            f"limiter {e.name!r} is in use with {e.existing}; this asked for {e.requested}. "
            f"Change it for every process with 'shmlimit set-rate' (a limiter of one rate), or "
            f"create it once no live process uses it"
        ) from None
    try:
        for (name, old), (_, new) in zip(before, rows(inspect(args.name))):
            print(_created(name, old, new))
    finally:
        lim.close()
    return 0


def cmd_set_rate(args: argparse.Namespace) -> int:
    """Change a live limiter for every attached process: a spec rate[,ratio][,verb]."""
    spec = live_changes.parse_spec(args.spec)
    try:
        lim = Limiter(args.name, mode=int(args.mode, 8), trusted_uids=args.trust_uid)
    except SegmentError:
        s = inspect(args.name)
        if isinstance(s, Stats) or getattr(s, "kind", "") == "windows":
            raise  # (a window table's error says what it is: it has no rate to change)
        raise UserError(
            f"{args.name!r} is a keyed limiter or one of several rates: set-rate changes a "
            f"limiter of one rate; give this one new settings with 'shmlimit create' once no live "
            f"process uses it, or change it live from Python (set_rate)"
        ) from None
    try:
        if spec.verb == "stop":
            lim.stop()
        else:
            lim.set_rate(
                spec.rate, per=spec.per_with(args.per, "--per"), burst=args.burst, ratio=spec.ratio
            )
            if spec.verb == "start":
                lim.start()
            elif spec.verb == "restart":
                lim.restart()
        state = "stopped" if lim.stopped else "running"
        print(f"{args.name}: {lim.config.describe()} ({state})")
    finally:
        lim.close()
    return 0


def cmd_top(args: argparse.Namespace) -> int:
    """The live view (see shmlimit.cli.top)."""
    _check_names(args.names, exist=True)  # reported before the first refresh
    return run_top(args.names or None, args.interval, args.once, args.json, show_stale=args.all)


def cmd_metrics(args: argparse.Namespace) -> int:
    """The Prometheus text exposition of the limiters (read without joining): printed, or served on /metrics."""
    _check_names(args.names, exist=args.port is None)  # served: they may be created later
    names = args.names or None
    scope = dict(
        trusted_uids=args.trust_uid, all_users=args.all_users, max_segments=args.max_segments
    )
    if args.port is None:
        fams = families(names, **scope)
        sys.stdout.write(exposition(fams))
        note = omitted_note(fams)
        if note:
            print(f"shmlimit metrics: {note}", file=sys.stderr)
        return 0
    if not 0 <= args.port <= 65535:
        raise UserError(f"--port must be from 0 to 65535 (0: any free port), got {args.port}")
    return _serve_metrics(names, args.bind, args.port, scope)


def _serve_metrics(names, host: str, port: int, scope) -> int:
    """Serve /metrics until interrupted; a missing limiter has no samples (it may be created later)."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (the http.server interface)
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                body, ctype, code = exposition(families(names, **scope)).encode(), CONTENT_TYPE, 200
            elif path == "/":
                body, ctype, code = (
                    b"shmlimit metrics: see /metrics\n",
                    "text/plain; charset=utf-8",
                    200,
                )
            else:
                body, ctype, code = b"not found\n", "text/plain; charset=utf-8", 404
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args) -> None:  # noqa: A002 -- a scrape per interval is not news
            pass

    try:
        server = ThreadingHTTPServer((host, port), Handler)
    except (OSError, OverflowError, ValueError) as e:  # in use, not ours, no such address
        raise UserError(
            f"cannot listen on --bind {host} --port {port}: {getattr(e, 'strerror', None) or e}"
        ) from None
    server.daemon_threads = True
    bound_host, bound_port = server.server_address[:2]
    print(f"serving http://{bound_host}:{bound_port}/metrics", file=sys.stderr, flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


def cmd_gc(args: argparse.Namespace) -> int:
    """Remove segments no live process is attached to (--dry-run: only list them)."""
    names, bad = scan()
    for n in bad:
        print(printable(f"left alone ({BAD_NAME}): {n!r}"))

    doomed: List[str] = []

    def unreadable(n: str, e: Exception) -> None:
        if not args.dry_run and n not in doomed and claimed(n):
            doomed.append(n)  # looked at again below
            return
        print(printable(f"left alone (unreadable): {n}: {e}"))

    def unlisted(n: str, count: int) -> None:
        print(
            printable(
                f"kept: {n}: {count} process(es) attached beyond its process table (one killed "
                f"while attached leaves its count: once none uses it, 'shmlimit unlink {n}')"
            )
        )

    found, kept = stale(names, unreadable, unlisted)
    for n in doomed:  # claimed by a collector: opened, as an opener would, it is given back
        try:  # when that collector died claiming it (after DOOMED_WAIT), or goes with it
            reopen(n)
        except LimiterNotFoundError:
            continue
        except (ShmlimitError, OSError, ValueError) as e:
            unreadable(n, e)
            continue
        more, used = stale([n], unreadable, unlisted)
        found, kept = found + more, kept + used
    verb = "stale" if args.dry_run else "removed"
    removed = 0
    for n in found:
        try:
            # every kind: claims the segment, checks again, then unlinks, so that a process
            # attaching meanwhile is kept (shm.segment.claim_and_unlink)
            if not (args.dry_run or collect(n)):
                kept += 1
                continue
        except (ShmlimitError, OSError) as e:
            unreadable(n, e)
            continue
        print(f"{verb}: {n}")
        removed += 1
    for n, ino in orphan_secrets():  # a keyed table's secret file left when its segment went
        if args.dry_run or drop_secret(n, ino):
            print(printable(f"{verb}: the secret file of {n} (its segment is gone)"))
    print(f"{removed} {verb}, {kept} in use")
    return 0


def cmd_unlink(args: argparse.Namespace) -> int:
    unlink(args.name)
    print(f"unlinked {args.name}")
    return 0


def cmd_doctor(args: argparse.Namespace) -> int:
    """What on this machine would make shmlimit slow or fail: exit 1 when anything fails."""
    from shmlimit.cli import doctor

    findings = doctor.run_all()
    if args.json:
        print(json.dumps(doctor.as_json(findings), allow_nan=False))
    else:
        print(doctor.report(findings))
    return 1 if any(f.level == doctor.FAIL for f in findings) else 0


# ---- argument parsing ------------------------------------------------------------------


def _checked(check: Callable[[str], object]) -> Callable[[str], str]:
    """An argument's text, checked (``check``) at parse time so a bad one is a usage error."""

    def parse(text: str) -> str:
        try:
            check(text)
        except (TypeError, ValueError) as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        return text

    return parse


#: The demo's workers at most: each is a process with its pipes, and past a few hundred a machine's
#: open files run out (thousands stopped the demo with "too many open files", a traceback).
MAX_DEMO_WORKERS = 256


def _positive(kind, most: float = math.inf):
    """A finite number of ``kind`` (int or float) above 0 (and at most ``most``), checked at parse
    time."""

    def parse(text: str):
        try:
            v = kind(text)
        except ValueError:
            v = 0  # not a number: the same answer as one not above 0
        if not 0 < v < math.inf or v > most:
            bound = "" if most == math.inf else f" at most {most:g}"
            raise argparse.ArgumentTypeError(f"must be a positive number{bound}, got {text!r}")
        return v

    return parse


#: A rate spec, checked at parse time so a bad one is a usage error (``set-rate``'s: a live change).
_spec = _checked(parse_spec)
_live_spec = _checked(live_changes.parse_spec)


#: Several rates in one string.
_rates = _checked(lambda text: parse_rates("x", text))


#: ``--trust-uid UID``, repeatable: a segment this uid owns is accepted (each command says how).
_TRUST_UID = dict(type=int, action="append", default=[], metavar="UID")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="shmlimit", description="Rate limits shared by processes through shared memory."
    )
    p.add_argument("--version", action="version", version=f"shmlimit {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    named = argparse.ArgumentParser(add_help=False)  # what the commands about one limiter take
    named.add_argument("name")

    def command(
        name: str, func: Callable[[argparse.Namespace], int], help: str, *parents
    ) -> argparse.ArgumentParser:
        """The sub-command ``name``, which ``func`` runs."""
        c = sub.add_parser(name, help=help, description=help, parents=list(parents))
        c.set_defaults(func=func)
        return c

    d = command(
        "demo", cmd_demo, "pool workers sharing one rate: live progress, then achieved vs target"
    )
    d.add_argument(
        "--workers",
        type=_positive(int, MAX_DEMO_WORKERS),
        default=4,
        help=f"worker processes (default 4, at most {MAX_DEMO_WORKERS})",
    )
    d.add_argument(
        "--rate", type=_positive(float), default=200.0, help="shared ops per second (default 200)"
    )
    d.add_argument(
        "--burst",
        type=_positive(float),
        default=None,
        help="capacity in ops (default: 10 ms of rate)",
    )
    d.add_argument(
        "--seconds", type=_positive(float), default=5.0, help="how long to run (default 5)"
    )
    d.add_argument("--start-method", choices=["fork", "spawn", "forkserver"], default="fork")

    ls = command("list", cmd_list, "every limiter on this machine")
    ls.add_argument("--json", action="store_true", help="one JSON array of snapshots")

    i = command("inspect", cmd_inspect, "one limiter's live state", named)
    i.add_argument(
        "--json", action="store_true", help="one JSON object (the fields of shmlimit.Stats)"
    )

    c = command(
        "create",
        cmd_create,
        "create a limiter; an existing one no live process uses takes these settings "
        "(printed: old -> new)",
        named,
    )
    which = c.add_mutually_exclusive_group(required=True)
    which.add_argument(
        "--rate",
        type=_spec,
        help="ops per --per seconds, a rate string like 10/s, 50/5s or 200K/min, or a spec like 12K,1.1",
    )
    which.add_argument(
        "--rates",
        type=_rates,
        metavar="'R1; R2'",
        help="several rates taken together in one segment (rates NAME[0], NAME[1] or NAME[KEY]): "
        "'5000/h; 100/min' or 'requests=500/min; tokens=200K/min burst=20K'",
    )
    c.add_argument("--per", type=_positive(float), default=1.0, help="seconds (default 1)")
    c.add_argument("--burst", type=_positive(float), default=None, help="capacity in ops")
    c.add_argument(
        "--keys",
        type=_positive(int),
        default=None,
        metavar="N",
        help="a keyed limiter: the rate for each key, in a table of N key slots",
    )
    c.add_argument("--mode", default="600", help="permission bits in octal (default 600)")
    c.add_argument(
        "--trust-uid",
        **_TRUST_UID,
        help="accept an existing segment owned by this uid (repeatable)",
    )

    r = command(
        "set-rate",
        cmd_set_rate,
        "change a live limiter in every process: rate[,ratio][,verb] with verb configure|start|restart|stop",
        named,
    )
    r.add_argument(
        "spec", type=_live_spec, help="e.g. 12000, 200K/min, 12K,1.1 or 12K,1.1,restart or 0,stop"
    )
    r.add_argument(
        "--per", type=_positive(float), default=None, help="seconds (default: unchanged)"
    )
    r.add_argument(
        "--burst",
        type=_positive(float),
        default=None,
        help="capacity in ops (default: 10 ms of the rate)",
    )
    r.add_argument(
        "--mode",
        default="600",
        help="the group/other write bits the segment may have, octal (default 600)",
    )
    r.add_argument(
        "--trust-uid", **_TRUST_UID, help="accept a segment owned by this uid (repeatable)"
    )

    t = command(
        "top",
        cmd_top,
        "the live view, refreshing in place: every limiter, busiest first, in one table "
        "that fits the terminal (COLUMNS and LINES when set); or the ones named, in detail",
    )
    t.add_argument("names", nargs="*", metavar="NAME")
    t.add_argument(
        "--interval",
        type=_positive(float, MAX_INTERVAL),
        default=1.0,
        help=f"seconds between refreshes (default 1, at most {MAX_INTERVAL:g})",
    )
    t.add_argument(
        "--once", action="store_true", help="print one snapshot (rates over one interval) and exit"
    )
    t.add_argument("--json", action="store_true", help="one JSON object per refresh, one per line")
    t.add_argument(
        "--all",
        action="store_true",
        help="also the stale limiters (no live process), hidden from the table by default",
    )

    m = command(
        "metrics", cmd_metrics, "Prometheus text exposition of every limiter (or the ones named)"
    )
    m.add_argument("names", nargs="*", metavar="NAME")
    m.add_argument(
        "--port",
        type=int,
        default=None,
        help="serve /metrics on this port instead of printing (0 to 65535; 0: any free port)",
    )
    m.add_argument(
        "--bind",
        default="127.0.0.1",
        help="address to serve on (default 127.0.0.1; 0.0.0.0 for every interface)",
    )
    m.add_argument(
        "--trust-uid",
        **_TRUST_UID,
        help="also export the segments this uid owns (repeatable; default: only this user's and root's)",
    )
    m.add_argument("--all-users", action="store_true", help="export the segments of every owner")
    m.add_argument(
        "--max-segments",
        type=_positive(int),
        default=MAX_SEGMENTS,
        metavar="N",
        help=f"export at most N segments, the first by name (default {MAX_SEGMENTS}); "
        "the rest are counted",
    )

    g = command("gc", cmd_gc, "remove segments that no live process is attached to")
    g.add_argument("--dry-run", action="store_true", help="only list them")

    dr = command(
        "doctor",
        cmd_doctor,
        "which backend is in use and why, /dev/shm's space, and what else would make shmlimit slow or fail",
    )
    dr.add_argument("--json", action="store_true", help="one JSON array of findings")

    command("unlink", cmd_unlink, "remove a limiter's segment", named)
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (UserError, ShmlimitError, ValueError, TypeError, PermissionError) as e:
        # no limiter under a name given: said as the command line's mistake it is
        what = (
            f"no limiter named {e.name!r} (see 'shmlimit list')"
            if isinstance(e, LimiterNotFoundError)
            else e
        )
        print(printable(f"shmlimit: {what}"), file=sys.stderr)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # the reader (head, less) went away: not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
