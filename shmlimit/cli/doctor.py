"""``shmlimit doctor``: what on this machine would make shmlimit slow or fail, and why.

Each check returns ``Finding``s: ``ok``, ``warn`` (works, but slower or at
risk) or ``fail`` (shmlimit will not work as it should).  The checks read the
machine only; they create nothing in shared memory and attach to no limiter.
Their inputs (environment, paths, the file-system statistics) are parameters,
so the tests drive them with any machine they like.
"""

from __future__ import annotations

import importlib
import os
import platform
import stat
import sys
from contextlib import closing
from dataclasses import asdict, dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

from shmlimit.header import KINDS_BY_MAGIC  # every kind: the package registers each on import
from shmlimit.shm import layout as L
from shmlimit.shm.cells import open_cells
from shmlimit.shm.segment import _OPEN_FLAGS, PREFIX, SHM_DIR

MiB = 1 << 20
#: Docker gives a container a /dev/shm of this size unless told otherwise (--shm-size).
DOCKER_DEFAULT_SHM = 64 * MiB
#: Room asked for beyond what the limiters present need: this many more limiters of the default size.
SPARE_LIMITERS = 16
#: Clock sources whose reads are system calls (no vDSO): every clock read costs microseconds.
SLOW_CLOCKSOURCES = ("hpet", "acpi_pm", "jiffies", "pit")

OK, WARN, FAIL = "ok", "warn", "fail"


@dataclass(frozen=True)
class Finding:
    level: str  #: "ok", "warn" or "fail"
    topic: str  #: what was checked ("backend", "/dev/shm", ...)
    message: str  #: what was found, and for warn/fail what to do
    #: the segments it is about, every one (the message names the first five)
    names: Tuple[str, ...] = ()


def check_backend(env: Mapping[str, str] = os.environ) -> List[Finding]:
    """Which atomic backend new attachments use, and why."""
    from shmlimit.shm.cells import BACKENDS

    forced = env.get("SHMLIMIT_BACKEND", "").strip().lower()
    native_error: Optional[str] = None
    try:
        importlib.import_module("shmlimit.shm._native")
    except ImportError as e:
        native_error = str(e)
    if forced and forced not in BACKENDS:
        return [
            Finding(
                FAIL,
                "backend",
                f"SHMLIMIT_BACKEND={forced!r} is not one of {', '.join(BACKENDS)}: "
                "every limiter will raise ValueError",
            )
        ]
    if forced == "native" and native_error:
        return [
            Finding(
                FAIL,
                "backend",
                f"SHMLIMIT_BACKEND=native but the C extension does not import "
                f"({native_error}): every limiter will raise ImportError",
            )
        ]
    if native_error is None and forced != "atomics":
        why = (
            "forced by SHMLIMIT_BACKEND=native"
            if forced
            else "the C extension shmlimit.shm._native is built"
        )
        return [Finding(OK, "backend", f"native ({why}): an acquire is one C call")]
    if forced == "atomics":
        why = "forced by SHMLIMIT_BACKEND=atomics" + (
            "" if native_error else " (native is built: unset it)"
        )
    else:
        why = (
            f"the C extension is missing ({native_error}); shmlimit was installed from source without a "
            f"C compiler. Install a wheel (pip install --only-binary shmlimit shmlimit) or install a "
            f"compiler and reinstall"
        )
    level = OK if forced == "atomics" else WARN
    return [Finding(level, "backend", f"atomics: {why}"), *_check_atomics_speed()]


def _check_atomics_speed() -> List[Finding]:
    import mmap

    from shmlimit.shm.atomics_cells import AtomicsCells

    mm = mmap.mmap(-1, mmap.PAGESIZE)
    try:
        c = AtomicsCells(mm, mmap.PAGESIZE)
        direct = c._direct
        c.close()
    except Exception as e:  # the package itself is broken
        return [Finding(FAIL, "backend", f"the atomics package does not work here: {e}")]
    finally:
        try:
            mm.close()
        except BufferError:  # pragma: no cover
            pass
    if direct:
        return [
            Finding(
                OK, "backend", "atomics: its native operations are called directly (~1 us each)"
            )
        ]
    return [
        Finding(
            WARN,
            "backend",
            "atomics: its internals were not found, so every operation goes through its "
            "Python wrapper (8-20 us each): an acquire costs ~50 us",
        )
    ]


def _read(path: str, parse: Callable[[str], Any] = str.strip) -> Any:
    """What ``parse`` makes of the text of the file at ``path``; None when it cannot be read, or
    parsed (a ``ValueError``)."""
    try:
        with open(path) as f:
            return parse(f.read())
    except (OSError, ValueError):
        return None


def _mounts(path: str = "/proc/mounts") -> Dict[str, str]:
    """Mount point -> file-system type."""
    out: Dict[str, str] = {}
    for line in (_read(path, str) or "").splitlines():
        parts = line.split()
        if len(parts) >= 3:
            out[parts[1].replace("\\040", " ")] = parts[2]
    return out


def segments_need(shm_dir: str = SHM_DIR) -> tuple:
    """(limiters present, bytes they may still claim): a segment's pages are allocated when first
    touched, and only those within the size its header declares ever are.  A file that is not a
    limiter (not regular, unreadable, of no kind, declaring no size, larger than any of its kind)
    is never mapped by a limiter, so it claims nothing."""
    count = unbacked = 0
    try:
        entries = [e for e in os.listdir(shm_dir) if e.startswith(PREFIX)]
    except OSError:
        return 0, 0
    for e in entries:
        try:
            # the entry itself (never a symlink's target, never waiting on a FIFO), read, not mapped
            fd = os.open(os.path.join(shm_dir, e), os.O_RDONLY | _OPEN_FLAGS)
        except OSError:
            continue
        try:
            st = os.fstat(fd)
            head = os.pread(fd, L.LINE, 0) if stat.S_ISREG(st.st_mode) else b""
            kind = KINDS_BY_MAGIC.get(int.from_bytes(head[:8], "little")) if head else None
            head += os.pread(fd, kind.header_bytes - len(head), len(head)) if kind else b""
        except OSError:
            continue
        finally:
            os.close(fd)
        if kind is None or len(head) < kind.header_bytes:
            continue
        if kind.max_bytes is not None and st.st_size > kind.max_bytes:
            continue  # refused by every opener
        with closing(open_cells(bytearray(head), len(head))) as c:  # type: ignore[arg-type]
            declared = kind.declared_size(c)
        if declared is None:
            continue
        count += 1
        unbacked += max(0, min(st.st_size, declared) - st.st_blocks * 512)
    return count, unbacked


def check_shm(
    shm_dir: str = SHM_DIR,
    mounts: Optional[Mapping[str, str]] = None,
    statvfs: Callable[[str], os.statvfs_result] = os.statvfs,
    in_container: Optional[bool] = None,
) -> List[Finding]:
    """Is the shared-memory file system there, writable, and big enough for the limiters?"""
    if not sys.platform.startswith("linux"):
        return [
            Finding(
                OK,
                "/dev/shm",
                f"{sys.platform}: POSIX shared memory has no file system to check here",
            )
        ]
    mounts = _mounts() if mounts is None else mounts
    if not os.path.isdir(shm_dir):
        return [
            Finding(
                FAIL,
                "/dev/shm",
                f"{shm_dir} does not exist: no limiter can be created "
                f"(mount a tmpfs there: mount -t tmpfs tmpfs {shm_dir})",
            )
        ]
    fstype = mounts.get(shm_dir)
    st = statvfs(shm_dir)
    total = st.f_blocks * st.f_frsize
    free = st.f_bavail * st.f_frsize
    count, unbacked = segments_need(shm_dir)
    spare = SPARE_LIMITERS * L.segment_size(L.DEFAULT_SLOTS)
    need = unbacked + spare
    summary = (
        f"{shm_dir}: {fstype or 'mounted'}, {free / MiB:.1f} MiB free of {total / MiB:.1f} MiB; "
        f"{count} limiter(s) present"
    )
    if in_container is None:
        in_container = os.path.exists("/.dockerenv") or os.path.exists("/run/.containerenv")
    where = "this container's" if in_container else "this"
    # what is found, each (whether it is, its level, what it says), in the order they are shown
    rules = (
        (
            fstype is None,
            WARN,
            f"{shm_dir} is not a mount point: segments live on whatever "
            f"file system holds it (a tmpfs there is expected)",
        ),
        (
            fstype not in (None, "tmpfs"),
            WARN,
            f"{shm_dir} is a {fstype}, not a tmpfs: segments may be written to disk",
        ),
        (
            not os.access(shm_dir, os.W_OK | os.X_OK),
            FAIL,
            f"{shm_dir} is not writable by this user (uid {os.getuid()}): "
            "no limiter can be created",
        ),
        (
            free < unbacked,
            FAIL,
            f"{summary}, whose pages not yet allocated need {unbacked} bytes: "
            f"a process touching one may be killed by SIGBUS. Free space there",
        ),
        (
            unbacked <= free < need,
            WARN,
            f"{summary}: less than the {need} bytes they and "
            f"{SPARE_LIMITERS} more limiters of the default size need",
        ),
        (need <= free, OK, summary),
        (
            total <= DOCKER_DEFAULT_SHM,
            WARN,
            f"{where} /dev/shm is {total / MiB:.0f} MiB, Docker's default size: "
            "other programs (browsers, PyTorch DataLoader, Postgres) share it; "
            "run the container with --shm-size=256m or more",
        ),
    )
    return [Finding(level, "/dev/shm", message) for found, level, message in rules if found]


def check_machine(
    clocksource_path: str = "/sys/devices/system/clocksource/clocksource0/current_clocksource",
    cpus: Optional[int] = None,
    timerslack_path: str = "/proc/self/timerslack_ns",
) -> List[Finding]:
    """Clock, cores and timer slack: what makes waiting slow or late."""
    out: List[Finding] = []
    source = _read(clocksource_path)
    if source in SLOW_CLOCKSOURCES:
        out.append(
            Finding(
                WARN,
                "clock",
                f"clock source {source}: every clock read is a system call, so "
                "replenishing and waiting cost microseconds more (tsc is the fast one)",
            )
        )
    elif source:
        out.append(Finding(OK, "clock", f"clock source {source}"))
    cpus = os.cpu_count() if cpus is None else cpus
    if cpus is not None and cpus < 2:
        out.append(
            Finding(
                WARN,
                "cpu",
                "one CPU: the filler thread and the waiters take turns with the work; "
                "expect more lateness",
            )
        )
    slack = _read(timerslack_path, int)  # (int takes the text with its newline)
    if slack is not None:
        level = OK if slack <= 50_000 else WARN
        out.append(
            Finding(
                level, "timers", f"timer slack {slack / 1000:g} us: sleeps may end that much late"
            )
        )
    return out


def check_segments(names: Optional[List[str]] = None) -> List[Finding]:
    """Limiters no live process uses, and segments this user cannot read (all of them, or
    ``names``); of all of them, secret files whose segment is gone."""
    from shmlimit.errors import ShmlimitError
    from shmlimit.kinds import stale  # every kind: a Limiter's segment, a keyed one
    from shmlimit.shm.segment import list_names, orphan_secrets

    every = names is None
    if names is None:
        try:
            names = list_names()
        except (ShmlimitError, OSError):
            return []
    unreadable: List[str] = []
    unused, _ = stale(names, lambda n, e: unreadable.append(n))  # what gc removes
    orphans = sorted({n for n, _ in orphan_secrets()}) if every else []
    out = [
        Finding(WARN, "limiters", message.format(len(found), _first_five(found)), tuple(found))
        for found, message in (
            (unused, "{} limiter(s) no live process uses ({}): 'shmlimit gc' removes them"),
            (unreadable, "{} segment(s) this user cannot read or that are not valid limiters: {}"),
            (
                orphans,
                "{} secret file(s) of keyed limiters whose segment is gone ({}): "
                "'shmlimit gc' removes them",
            ),
        )
        if found
    ]
    if not out:
        out.append(Finding(OK, "limiters", f"{len(names)} limiter(s), all in use"))
    return out


def _first_five(names: List[str]) -> str:
    """The names a finding's message shows: the first five, and '...' for more."""
    return ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")


def run_all() -> List[Finding]:
    return [
        Finding(
            OK,
            "python",
            f"Python {platform.python_version()} on {platform.machine()} {platform.system()}",
        ),
        *check_backend(),
        *check_shm(),
        *check_machine(),
        *check_segments(),
    ]


def report(findings: List[Finding]) -> str:
    return "\n".join(f"{f.level:4}  {f.topic:9} {f.message}" for f in findings)


def as_json(findings: List[Finding]) -> List[dict]:
    return [asdict(f) for f in findings]
