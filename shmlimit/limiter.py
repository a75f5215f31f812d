"""The public ``Limiter``: one rate limit shared by every process that attaches to a name.

Data flows one way: Limiter -> Bucket (rover arithmetic) -> Cells (atomic words)
-> Segment (the mapping).  Each process attaches to a name once (an
``_Attachment``, shared by every ``Limiter`` handle for that name in the
process): it maps the segment, registers in the process table and starts the
filler thread that may be elected.
"""
from __future__ import annotations

import atexit
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

from . import layout as L
from .bucket import Bucket, diff
from .cells import Cells, open_cells
from .config import NS_PER_S, Config, validate_n, validate_timeout
from .errors import ConfigMismatchError, LimiterNotFoundError, SegmentError
from .filler import LEASE_TIMEOUT, FillerThread, Lease, lease_expiry_us, lease_slot, now_us
from .segment import Segment, current_inode, validate_name
from .segment import unlink as _unlink_name
from .table import ProcessTable, is_alive, proc_start

#: How long an opener waits for a segment's creator to finish initialising it (seconds).
INIT_WAIT = 2.0
#: Waiters sleep until this close to their turn, then yield the CPU in a loop (ns).
SPIN_NS = 200_000
#: A sleeping waiter wakes at least this often to notice rate changes and stops (seconds).
MAX_NAP = 0.050


@dataclass(frozen=True)
class ProcessStats:
    """One attached process, as the process table shows it."""

    pid: int
    alive: bool
    grants: int  #: ops granted to this process since it attached
    waiting: bool  #: queued for tokens right now
    filler: bool  #: holds the filler lease


@dataclass(frozen=True)
class Stats:
    """A snapshot of a limiter's live state.  Ops are grants; seconds are schedule time."""

    name: str
    rate: float  #: ops per ``per`` seconds
    per: float  #: seconds
    capacity: float  #: ops the bucket holds at most (the burst)
    available: float  #: ops that could be granted at once, counting time not yet replenished
    deficiency: float  #: ops owed to queued callers
    deficiency_seconds: float  #: schedule time until the queue is served
    grants: int  #: ops granted so far, by every process that ever attached
    filler_pid: Optional[int]  #: the process running the filler, if any holds a live lease
    heartbeat_age: Optional[float]  #: seconds since the filler last renewed its lease
    processes: Tuple[ProcessStats, ...]
    capped: bool
    backend: str  #: atomic backend of the process that took the snapshot

    @property
    def ops_per_second(self) -> float:
        return self.rate / self.per


# ---------------------------------------------------------------------------------
# per-process attachments


class _Attachment:
    """One process's mapping of one limiter segment (shared by all its Limiter handles)."""

    def __init__(self, name: str, seg: Segment, cells: Cells, join: bool = True) -> None:
        self.name = name
        self.seg = seg
        self.cells = cells
        self.bucket = Bucket(cells)
        self.slots = cells.load(L.SLOTS_OFF)
        self.table = ProcessTable(cells, self.slots)
        self.refs = 0
        self.closed = False
        self.created = seg.created
        self.slot: Optional[int] = None
        self.filler: Optional[FillerThread] = None
        self.lease: Optional[Lease] = None
        self.grants_off = L.UNREG_GRANTS
        self.waiting_off: Optional[int] = None
        self.pid = os.getpid()
        if join:
            self._join_process()

    def _join_process(self) -> None:
        """Register this process and start its filler thread (also after fork, in the child)."""
        self.pid = os.getpid()
        self.slot = self.table.register(self.pid, proc_start(self.pid) or 0)
        if self.slot is None:
            self.grants_off = L.UNREG_GRANTS
            self.waiting_off = None
            self.lease = None
            self.filler = None
        else:
            base = L.slot_offset(self.slot)
            self.grants_off = base + L.SLOT_GRANTS
            self.waiting_off = base + L.SLOT_WAITING
            self.lease = Lease(self.cells, self.slot)
            self.filler = FillerThread(self.bucket, self.lease, self.name)
            self.filler.start()

    def after_fork_in_child(self) -> None:
        # The parent's filler thread does not exist here, and its lease is the parent's.
        if self.lease is not None:
            self.lease.forget()
        self._join_process()

    def detach(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.filler is not None:
            self.filler.stop()
            if self.filler.is_alive():
                self.filler.join()
        if self.slot is not None and self.pid == os.getpid():
            self.table.unregister(self.slot, self.pid)
        self.cells.close()
        self.seg.close()


_registry: Dict[str, _Attachment] = {}
_registry_lock = threading.Lock()


def _after_fork_in_child() -> None:
    global _registry_lock
    _registry_lock = threading.Lock()
    for att in list(_registry.values()):
        if not att.closed:
            att.after_fork_in_child()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _wait_ready(name: str, seg: Segment) -> Segment:
    """Return a mapping of a fully initialised segment, re-opening while its creator works."""
    deadline = time.monotonic() + INIT_WAIT
    while True:
        if seg.size >= L.HEADER_BYTES:
            cells = open_cells(seg.mm, L.HEADER_BYTES)
            try:
                magic = cells.load(L.MAGIC_OFF)
                state = cells.load(L.STATE_OFF)
                version = cells.load(L.VERSION_OFF)
                size = cells.load(L.SIZE_OFF)
                slots = cells.load(L.SLOTS_OFF)
            finally:
                cells.close()
            if magic not in (0, L.MAGIC):
                raise SegmentError(f"segment {name!r} is not a shmlimit limiter (bad magic {magic:#018x})")
            if magic == L.MAGIC and state == L.STATE_READY:
                if version != L.VERSION:
                    raise SegmentError(
                        f"segment {name!r} has layout version {version}; this shmlimit reads version {L.VERSION}"
                    )
                if not 1 <= slots <= L.MAX_SLOTS or size != L.segment_size(slots) or seg.size < size:
                    raise SegmentError(
                        f"segment {name!r} is corrupt: header says {size} bytes and {slots} slots, "
                        f"the mapping has {seg.size} bytes"
                    )
                return seg
        elif seg.size and time.monotonic() >= deadline:
            raise SegmentError(f"segment {name!r} is truncated: {seg.size} bytes, a limiter needs {L.HEADER_BYTES}")
        if time.monotonic() >= deadline:
            raise SegmentError(
                f"segment {name!r} was never initialised (its creator died or is stuck); "
                f"remove it with shmlimit.unlink({name!r})"
            )
        time.sleep(0.001)
        seg.close()
        seg = Segment.open(name)


def _open_attachment(name: str, cfg: Optional[Config], mode: int, initial: Optional[float], slots: int) -> _Attachment:
    with _registry_lock:
        att = _registry.get(name)
        # a name unlinked and re-created since we mapped it is a different limiter
        if att is not None and (att.closed or current_inode(name) != att.seg.inode):
            _registry.pop(name, None)
            att = None
        if att is None:
            att = _map(name, cfg, mode, initial, slots)
            _registry[name] = att
        elif cfg is not None and att.bucket.config != cfg:
            raise ConfigMismatchError(name, att.bucket.config.describe(), cfg.describe())
        att.refs += 1
        return att


def _map(
    name: str, cfg: Optional[Config], mode: int, initial: Optional[float], slots: int, join: bool = True
) -> _Attachment:
    seg = None
    if cfg is not None:
        seg = Segment.create(name, L.segment_size(slots), mode)
        if seg is not None:
            cells = open_cells(seg.mm, seg.size)
            c = cells
            c.store(L.VERSION_OFF, L.VERSION)
            c.store(L.SIZE_OFF, seg.size)
            c.store(L.SLOTS_OFF, slots)
            c.store(L.CREATOR_PID_OFF, os.getpid())
            c.store(L.CREATED_NS_OFF, time.time_ns())
            Bucket.initialise(cells, cfg, time.monotonic_ns(), initial, int(os.environ.get("SHMLIMIT_TEST_ROVER_BASE", "0")))
            c.store(L.MAGIC_OFF, L.MAGIC)
            c.store(L.STATE_OFF, L.STATE_READY)  # last: openers wait for this
            return _Attachment(name, seg, cells)
    seg = _wait_ready(name, Segment.open(name))
    cells = open_cells(seg.mm, cells_size(seg))
    att = None
    try:
        att = _Attachment(name, seg, cells, join)
        if cfg is not None and att.bucket.config != cfg:
            raise ConfigMismatchError(name, att.bucket.config.describe(), cfg.describe())
    except BaseException:
        if att is not None:
            att.detach()
        else:
            cells.close()
            seg.close()
        raise
    return att


def cells_size(seg: Segment) -> int:
    return min(seg.size, L.segment_size(_peek_slots(seg)))


def _peek_slots(seg: Segment) -> int:
    c = open_cells(seg.mm, L.HEADER_BYTES)
    try:
        return c.load(L.SLOTS_OFF)
    finally:
        c.close()


def _release(att: _Attachment, detach: bool) -> None:
    """Drop one handle.  The attachment ends only when its last handle is closed explicitly.

    A handle that is merely garbage-collected keeps the process attached (and
    registered) until exit: a pool worker that unpickles a fresh handle for
    every task must not re-register and restart its filler thread each time.
    """
    with _registry_lock:
        att.refs -= 1
        if att.refs > 0 or not detach:
            return
        if _registry.get(att.name) is att:
            del _registry[att.name]
    att.detach()


def _detach_all_at_exit() -> None:
    for att in list(_registry.values()):
        try:
            att.detach()
        except Exception:  # pragma: no cover - best effort at exit
            pass
    _registry.clear()


atexit.register(_detach_all_at_exit)


# ---------------------------------------------------------------------------------
# the public handle


class Limiter:
    """A rate limit of ``rate`` ops per ``per`` seconds shared by every process using ``name``.

    ``Limiter(name, rate=..., per=1.0, burst=None)`` creates the limiter, or
    attaches to it if it exists with the same configuration (a different one
    raises ``ConfigMismatchError``).  ``burst`` is the bucket capacity in ops
    (default: 10 ms of schedule, at least one op).  ``capped=True`` turns on
    capped release (see ``release``).  ``mode`` is the segment's permission
    bits (default 0o600: this user only).  ``initial`` is how many ops the
    bucket holds at creation (default: full).

    A Limiter pickles as its name: a child process that unpickles it attaches
    to the same segment.  One inherited through ``fork`` works as well: the
    child registers itself as its own process.
    """

    def __init__(
        self,
        name: str,
        rate: Optional[float] = None,
        per: float = 1.0,
        burst: Optional[float] = None,
        *,
        capped: bool = False,
        mode: int = 0o600,
        initial: Optional[float] = None,
        slots: int = L.DEFAULT_SLOTS,
    ) -> None:
        validate_name(name)
        cfg = None if rate is None else Config.make(rate, per, burst, capped)
        if isinstance(mode, bool) or not isinstance(mode, int) or not 0 <= mode <= 0o777:
            raise ValueError(f"mode must be permission bits between 0 and 0o777, got {mode!r}")
        if initial is not None:
            if isinstance(initial, bool) or not isinstance(initial, (int, float)) or not 0 <= initial < float("inf"):
                raise ValueError(f"initial must be a finite number of ops >= 0, got {initial!r}")
        if isinstance(slots, bool) or not isinstance(slots, int) or not 1 <= slots <= L.MAX_SLOTS:
            raise ValueError(f"slots must be an int from 1 to {L.MAX_SLOTS}, got {slots!r}")
        self._name = name
        self._att: Optional[_Attachment] = None
        self._att = _open_attachment(name, cfg, mode, initial, slots)

    # -- identity and lifecycle ----------------------------------------------------

    @property
    def name(self) -> str:
        return self._name

    @property
    def config(self) -> Config:
        return self._live().bucket.config

    @property
    def rate(self) -> float:
        """Ops per ``per`` seconds."""
        return self.config.rate

    @property
    def per(self) -> float:
        """Seconds."""
        return self.config.per

    @property
    def capacity(self) -> float:
        """Ops the bucket holds at most (the burst)."""
        return self.config.burst

    @property
    def backend(self) -> str:
        return self._live().cells.backend

    @property
    def created(self) -> bool:
        """True if this process created (and initialised) the segment."""
        return self._live().created

    @property
    def closed(self) -> bool:
        return self._att is None

    def _live(self) -> _Attachment:
        att = self._att
        if att is None:
            raise ValueError(f"limiter {self._name!r} is closed in this process")
        if att.pid != os.getpid():  # pragma: no cover - the fork hook re-registers first
            att.after_fork_in_child()
        return att

    def close(self) -> None:
        """Detach this handle.  The segment stays (use ``unlink``); other processes are unaffected."""
        att, self._att = self._att, None
        if att is not None:
            _release(att, detach=True)

    def unlink(self) -> None:
        """Remove the segment's name.  Processes still attached keep working on their mapping."""
        unlink(self._name)

    def __enter__(self) -> "Limiter":
        self.acquire()
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def __reduce__(self):
        return (attach, (self._name,))

    def __del__(self) -> None:
        att, self._att = getattr(self, "_att", None), None
        if att is not None:
            try:
                _release(att, detach=False)
            except Exception:  # pragma: no cover - interpreter shutdown
                pass

    # -- acquiring -------------------------------------------------------------------

    def acquire(self, n: int = 1, timeout: Optional[float] = None) -> bool:
        """Take ``n`` ops, waiting as needed; return True once they are granted.

        With ``timeout`` (seconds), return False at once, taking nothing, when
        the wait the current schedule implies exceeds it.  Untimed, a request
        larger than the capacity queues and is granted once that much schedule
        time has accrued; timed, it is granted only if that fits the timeout.
        """
        att = self._att
        if att is None:
            att = self._live()
        b = att.bucket
        if n == 1 and timeout is None and n.__class__ is int:
            tokens = b.cost
        else:
            tokens = validate_n(n, b.cost) * b.cost
            timeout = validate_timeout(timeout)
            if timeout is not None:
                return self._acquire_timed(att, n, tokens, timeout)
        ticket = att.cells.grab(L.TAIL, L.HEAD, tokens, att.grants_off, n)
        if ticket is not None:
            self._wait(att, ticket)
            att.cells.fetch_add(att.grants_off, n)
        return True

    def try_acquire(self, n: int = 1) -> bool:
        """Take ``n`` ops only if they are available now; never waits.  False takes nothing.

        ``n`` larger than the capacity can never succeed.
        """
        att = self._live()
        b = att.bucket
        tokens = validate_n(n, b.cost) * b.cost
        c = att.cells
        if c.try_grab(L.TAIL, L.HEAD, tokens, att.grants_off, n):
            return True
        if b.replenish() > 0:
            return c.try_grab(L.TAIL, L.HEAD, tokens, att.grants_off, n)
        return False

    def _acquire_timed(self, att: _Attachment, n: int, tokens: int, timeout: float) -> bool:
        b = att.bucket
        c = att.cells
        if c.try_grab(L.TAIL, L.HEAD, tokens, att.grants_off, n):
            return True
        b.replenish()
        ticket = b.try_grab_within(tokens, timeout * NS_PER_S)
        if ticket is None:
            return False
        self._wait(att, ticket)
        c.fetch_add(att.grants_off, n)
        return True

    def _wait(self, att: _Attachment, ticket: int) -> None:
        """Wait until the head covers ``ticket``: sleep most of the way, then yield in a loop."""
        b = att.bucket
        c = att.cells
        waiting = att.waiting_off
        if waiting is not None:
            c.store(waiting, 1)
        try:
            while True:
                short = diff(ticket, c.load(L.HEAD))
                if short <= 0:
                    return
                if b.replenish() > 0:
                    continue
                wait_ns = short / b.tpn - SPIN_NS
                if wait_ns > 0:
                    time.sleep(min(wait_ns / NS_PER_S, MAX_NAP))
                else:
                    os.sched_yield()
        finally:
            if waiting is not None:
                c.store(waiting, 0)

    # -- observation -------------------------------------------------------------------

    def stats(self) -> Stats:
        """A snapshot of the live pool state (reads only; changes nothing)."""
        return snapshot(self._name, self._live())

    def __repr__(self) -> str:
        if self._att is None:
            return f"<shmlimit.Limiter {self._name!r} closed>"
        s = self.stats()
        return (
            f"<shmlimit.Limiter {s.name!r} rate={s.rate:g}/{s.per:g}s capacity={s.capacity:g} "
            f"available={s.available:.1f} deficiency={s.deficiency:.1f} grants={s.grants} "
            f"filler_pid={s.filler_pid} processes={len(s.processes)} backend={s.backend}>"
        )


def snapshot(name: str, att: _Attachment) -> Stats:
    c = att.cells
    b = att.bucket
    cfg = b.config
    balance = b.balance()
    available = max(0, min(b.cap, balance + b.pending())) if balance >= 0 else 0
    word = c.load(L.LEASE)
    slot = lease_slot(word)
    filler_pid = None
    heartbeat_age = None
    now = now_us()
    if slot is not None and lease_expiry_us(word) > now:
        filler_pid = att.table.pid_of(slot) or None
        heartbeat_age = max(0.0, (now - (lease_expiry_us(word) - int(LEASE_TIMEOUT * 1e6))) / 1e6)
    procs = []
    total = c.load(L.RETIRED_GRANTS) + c.load(L.UNREG_GRANTS)
    for e in att.table.entries():
        total += e.grants
        procs.append(ProcessStats(e.pid, is_alive(e.pid, e.start), e.grants, e.waiting, e.index == slot and filler_pid is not None))
    short = max(0, -balance)
    return Stats(
        name=name,
        rate=cfg.rate,
        per=cfg.per,
        capacity=cfg.burst,
        available=available / b.cost,
        deficiency=short / b.cost,
        deficiency_seconds=short / b.tpn / NS_PER_S,
        grants=total,
        filler_pid=filler_pid,
        heartbeat_age=heartbeat_age,
        processes=tuple(procs),
        capped=cfg.capped,
        backend=c.backend,
    )


def inspect(name: str) -> Stats:
    """A snapshot of a limiter's live state, read without joining it.

    The caller is not registered in the process table, never takes part in
    the filler election and writes nothing to the segment.
    """
    validate_name(name)
    att = _map(name, None, 0, None, 0, join=False)
    try:
        return snapshot(name, att)
    finally:
        att.detach()


def attach(name: str) -> Limiter:
    """Attach to an existing limiter by name, whatever its configuration.

    Raises ``LimiterNotFoundError`` (a ``FileNotFoundError``) naming it when none exists.
    """
    return Limiter(name)


def unlink(name: str) -> None:
    """Remove the limiter's segment by name.  Raises ``LimiterNotFoundError`` when there is none."""
    _unlink_name(name)
