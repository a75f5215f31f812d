"""The public ``Limiter``: one rate limit shared by every process that attaches to a name.

Data flows one way: Limiter -> Bucket (rover arithmetic) -> Cells (atomic words)
-> Segment (the mapping).  Each process attaches to a name once (an
``_Attachment``, shared by every ``Limiter`` handle for that name in the
process): it maps the segment, registers in the process table and starts the
filler thread that may be elected.
"""
from __future__ import annotations

import asyncio
import atexit
import math
import os
import random
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, Iterable, Optional, Tuple, Union

from . import layout as L
from .bucket import Bucket, diff
from .cells import MASK64, Cells, open_cells, warm_backend
from .config import NS_PER_S, Config, parse_spec, validate_n, validate_timeout
from .errors import ConfigMismatchError, LimiterNotFoundError, QueueFullError, SegmentError
from .filler import LEASE_TIMEOUT, FillerThread, Lease, lease_expiry_us, lease_slot, now_us
from .segment import Segment, check_trust, current_inode, validate_name
from .segment import unlink as _unlink_name
from .table import ProcessTable, is_alive, pid_namespace, proc_start, slot_alive
from .upstream_spec import DEFAULT_BATCH_SECONDS, DEFAULT_LEASE_TTL, ON_ERROR, STATE_NAMES, UpstreamSpec

if TYPE_CHECKING:  # pragma: no cover
    from .redis import RedisLimiter

#: A segment this old (seconds) with no creator pid in its header was abandoned by its creator.
INIT_WAIT = 2.0
#: How long an opener waits for a live creator to finish initialising (seconds); a creator is
#: never replaced while it lives, however slow, but an opener gives up with an error after this.
LIVE_CREATOR_WAIT = 30.0
#: A segment left claimed by a garbage collector this long (seconds) lost its collector.
DOOMED_WAIT = 2.0
#: A waiter whose ticket is due but not yet covered looks again after this long at least (ns).
RETRY_NS = 20_000
#: Hierarchical mode: a timed acquire that does not know when tokens come looks this often (seconds) ...
POLL = 0.002
#: ... and one that knows wakes this long after they are due, once the filler has added them (seconds).
ARRIVAL_SLACK = 0.0003
#: A sleeping waiter wakes at least this often to notice rate changes and stops (seconds).
MAX_NAP = 0.25
MAX_NAP_NS = int(MAX_NAP * NS_PER_S)
#: Capped mode: a caller waiting for a release looks again this often (seconds).
CAPPED_NAP = 0.001
_INF = float("inf")
_ONE = 1  # `n is _ONE`: the cheapest test that n is the int 1 (True is not)
_sleeper: list = []


def _sleep_until():
    """This process's precise sleeper (chosen once: the backend does not change in a process)."""
    if not _sleeper:
        from .sleep import sleeper

        _sleeper.append(sleeper())
    return _sleeper[0]


@dataclass(frozen=True)
class ProcessStats:
    """One attached process, as the process table shows it."""

    pid: int
    alive: bool
    grants: int  #: ops granted to this process since it attached
    waiting: bool  #: queued for tokens right now
    filler: bool  #: holds the filler lease


@dataclass(frozen=True)
class UpstreamStats:
    """Hierarchical mode: how this host's bucket is fed from the global Redis limiter."""

    url: str  #: the Redis server, without its password
    key: str  #: the global limiter's Redis key
    state: str  #: "ok"; the fallback while Redis is unreachable ("local", "open", "closed"); "error": it answered with an error (closed)
    on_redis_error: str  #: the configured fallback
    lease_ttl: float  #: seconds a leased token stays usable
    round_trips: int  #: Redis round trips by this host's fillers
    leased: int  #: ops leased from Redis
    leases: int  #: successful lease requests (``leased / leases`` is the average batch)
    expired: int  #: leased ops never used (void after ``lease_ttl``, or not fitting the bucket)
    refused: int  #: lease requests that found nothing available globally
    errors: int  #: Redis calls that failed
    fallbacks: int  #: times a fallback was entered


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
    ratio: float = 1.0  #: catch-up ratio (1.0 = off)
    behind_seconds: float = 0.0  #: the waiting pool: schedule time owed back through catch-up
    stopped: bool = False  #: paused by stop() until start()
    upstream: Optional[UpstreamStats] = None  #: hierarchical mode only

    @property
    def ops_per_second(self) -> float:
        return self.rate / self.per


# ---------------------------------------------------------------------------------
# per-process attachments


def _no_fast() -> bool:
    return False


def _undecided() -> None:
    return None


def _undecided_within(timeout: object) -> None:
    return None


#: The fast path when there is none: [grab for acquire, try for try_acquire, grab within a timeout].
_NO_FAST = (_no_fast, _undecided, _undecided_within)


class _Attachment:
    """One process's mapping of one limiter segment (shared by all its Limiter handles)."""

    def __init__(self, name: str, seg: Segment, cells: Cells, join: bool = True) -> None:
        self.name = name
        self.seg = seg
        self.cells = cells
        self.bucket = Bucket(cells)
        self.slots = cells.load(L.SLOTS_OFF)
        self.table = ProcessTable(cells, self.slots)
        #: hierarchical mode: the upstream as the segment describes it (no secrets; shown, compared)
        self.upstream = UpstreamSpec.read(cells) if self.bucket.upstream else None
        #: ... and as this process configured it itself (with its secrets): only then does it feed
        self.feed_spec: Optional[UpstreamSpec] = None
        self.refs = 0
        self.closed = False
        self.created = seg.created
        self.slot: Optional[int] = None
        self.filler: Optional[FillerThread] = None
        self.lease: Optional[Lease] = None
        self.grants_off = L.UNREG_GRANTS
        self.waiting_off: Optional[int] = None
        self.pid = os.getpid()
        # The fast paths: [grabber, try, grab within a timeout], shared by reference with every
        # handle and updated in place.  A grabber does one grab_if priced under the config it was
        # made for; it answers False (nothing touched) once the config changed, and _no_fast always
        # answers False.  The other two are a Gate's methods (see cells.Gate): they answer None
        # when the config changed or they cannot decide, and so do their stand-ins in _NO_FAST.
        self.fast: list = list(_NO_FAST)
        if join:
            self._join_process()
        self.update_fast()

    def update_fast(self) -> None:
        s = self.bucket.snap  # one snapshot: the grabber's seq and price always belong together
        self.fast_seq = s.seq
        if self.closed or s.max_reserved_ns != _INF or s.open or s.capped:  # these take the slow path
            self.fast[0] = _no_fast
        else:
            self.fast[0] = self.cells.grabber(L.CFG_SEQ, s.seq, L.TAIL, L.HEAD, s.cost, self.grants_off, 1)
        # tries and timed acquires: not in hierarchical mode (a refusal there is demand the filler
        # must see, and a timed acquire polls), nor while stopped (no wait is computable), nor
        # capped (every grant must be admitted against the in-flight bound first)
        if self.closed or s.upstream or s.stopped or s.capped or s.config is None:
            self.fast[1:] = _NO_FAST[1:]
        else:
            # (no ceiling word to bound: a capped limiter has no gate, so HEAD stands in for it)
            gate = self.cells.gate(
                L.CFG_SEQ, s.seq, L.TAIL, L.HEAD, L.HEAD, L.REPL_TS, self.grants_off, s.cost, 1, s.tpn,
                math.ceil(s.config.ratio), False, s.max_reserved_ns,
            )
            self.fast[1:] = (gate.try_grab, gate.grab_within)

    def _join_process(self) -> None:
        """Register this process and start its filler thread (also after fork, in the child)."""
        self.pid = os.getpid()
        start = proc_start(self.pid)
        self.slot = self.table.register(self.pid, start if start and start > 0 else 0, pid_namespace())
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
            self.filler = FillerThread(self.bucket, self.lease, self.name, self._feed())
            self.filler.start()
        self.update_fast()

    def _feed(self) -> Any:
        if self.feed_spec is None:
            return None
        from .upstream import feed_for  # the Redis tier: only processes that configured it get here

        return feed_for(self.feed_spec)

    def opened(self) -> bool:
        """The "open" fallback is in force *and* this process asked for it.

        A process that did not configure the upstream (it attached by name)
        never lets calls through on the segment's word: for it, the open
        fallback is closed.  Call after ``bucket.refresh()``.
        """
        return self.bucket.open and self.feed_spec is not None and self.feed_spec.on_error == "open"

    def configure_upstream(self, spec: UpstreamSpec) -> None:
        """This process configured the upstream (equal to the stored one): it may feed from now on.

        The endpoint and the secrets used are ``spec``'s, never the
        segment's; the first configuration given in this process stays.
        """
        if self.feed_spec is None:
            self.feed_spec = spec
            if self.filler is not None:
                self.filler.set_feed(self._feed())

    def after_fork_in_child(self) -> None:
        # The parent's filler thread does not exist here, and its lease is the parent's.
        if self.lease is not None:
            self.lease.forget()
        self._join_process()

    def detach(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.fast[:] = _NO_FAST
        if self.filler is not None:
            self.filler.stop()
            if self.filler.is_alive():
                self.filler.join()
        if self.slot is not None and self.pid == os.getpid():
            self.table.unregister(self.slot, self.pid)
        self.cells.close()
        self.seg.close()


_registry: Dict[str, _Attachment] = {}
# Re-entrant: a Limiter.__del__ run by the garbage collector in the middle of an attach (which
# holds the lock) must be able to take it again to drop its reference.
_registry_lock = threading.RLock()


def _after_fork_in_child() -> None:
    global _registry_lock
    _registry_lock = threading.RLock()
    for att in list(_registry.values()):
        if not att.closed:
            att.after_fork_in_child()


os.register_at_fork(after_in_child=_after_fork_in_child)


class _Abandoned(SegmentError):
    """A segment whose creator died (or vanished) before finishing its initialisation."""

    def __init__(self, name: str, inode: int, creator: int) -> None:
        who = f"its creator (pid {creator}) died" if creator else "no creator ever wrote its header"
        super().__init__(
            f"segment {name!r} was never initialised: {who}; creating the limiter again replaces it, "
            f"or remove it with shmlimit.unlink({name!r})"
        )
        self.inode = inode




#: _ready_creator's answer for a segment a collector has claimed (STATE_DOOMED).
_DOOMED = -2


def _ready_creator(name: str, seg: Segment, waited: float) -> int:
    """0 if the segment is fully initialised (and its header sound), ``_DOOMED`` if a collector
    claimed it, else the pid of its live creator (-1: not yet known).

    Raises ``SegmentError`` for a foreign or corrupt header and ``_Abandoned``
    for an initialisation nobody will finish.  A creator gets ``INIT_WAIT``
    seconds to write its pid, counted from the segment's creation (its ctime)
    *or* from when this caller first looked (``waited``, monotonic), whichever
    ends first: a ctime anyone with write access can keep refreshing must not
    keep an opener waiting.
    """
    if seg.size == 0:
        if (time.time_ns() - seg.ctime_ns) / 1e9 > INIT_WAIT or waited > INIT_WAIT:
            raise _Abandoned(name, seg.inode, 0)
        return -1
    if seg.size < L.HEADER_BYTES:
        raise SegmentError(f"segment {name!r} is truncated: {seg.size} bytes, a limiter needs {L.HEADER_BYTES}")
    cells = open_cells(seg.mm, L.HEADER_BYTES)
    try:
        magic, state, version, size, slots, creator = (
            cells.load(off)
            for off in (L.MAGIC_OFF, L.STATE_OFF, L.VERSION_OFF, L.SIZE_OFF, L.SLOTS_OFF, L.CREATOR_PID_OFF)
        )
    finally:
        cells.close()
    if magic not in (0, L.MAGIC):
        raise SegmentError(f"segment {name!r} is not a shmlimit limiter (bad magic {magic:#018x})")
    if magic == L.MAGIC and state == L.STATE_READY:
        if version != L.VERSION:
            raise SegmentError(
                f"segment {name!r} has layout version {version}; this shmlimit reads version {L.VERSION}"
            )
        if 1 <= slots <= L.MAX_SLOTS and size == L.segment_size(slots) and seg.size < size:
            raise SegmentError(f"segment {name!r} is truncated: its header says {size} bytes, the file has {seg.size}")
        if not 1 <= slots <= L.MAX_SLOTS or size != L.segment_size(slots) or seg.size < size:
            raise SegmentError(
                f"segment {name!r} is corrupt: header says {size} bytes and {slots} slots, "
                f"the mapping has {seg.size} bytes"
            )
        return 0
    if magic == L.MAGIC and state == L.STATE_DOOMED:
        return _DOOMED  # a collector is unlinking it (or it restores READY)
    if magic == L.MAGIC and state != L.STATE_INIT:
        raise SegmentError(f"segment {name!r} is corrupt: unknown state {state}")
    age = (time.time_ns() - seg.ctime_ns) / 1e9
    if creator > 0xFFFFFFFF or (creator and not is_alive(creator, 0)) or (
        not creator and (age > INIT_WAIT or waited > INIT_WAIT)
    ):
        raise _Abandoned(name, seg.inode, creator)
    return creator or -1


def _wait_ready(name: str, seg: Segment, mode: Optional[int] = None, trusted: frozenset = frozenset()) -> Segment:
    """Return a mapping of a fully initialised segment, re-opening while its creator works.

    A live creator is waited for (up to ``LIVE_CREATOR_WAIT``, by the
    monotonic clock), never replaced; see ``_ready_creator`` for the rest.
    Re-opening repeats the trust check of the first open.
    """
    start = time.monotonic()
    while True:
        waited = time.monotonic() - start
        try:
            creator = _ready_creator(name, seg, waited)
        except BaseException:
            seg.close()
            raise
        if creator == 0:
            return seg
        if creator == _DOOMED:
            # a collector is unlinking it (or it restores READY): wait, then open the name again
            if waited > DOOMED_WAIT:
                # the collector died between its claim and its unlink: the segment is whole
                c = open_cells(seg.mm, L.HEADER_BYTES)
                try:
                    c.cas(L.STATE_OFF, L.STATE_DOOMED, L.STATE_READY)
                finally:
                    c.close()
        elif waited > LIVE_CREATOR_WAIT:
            seg.close()
            raise SegmentError(f"segment {name!r} is still being initialised by pid {creator} after {waited:.0f} s")
        time.sleep(0.001)
        seg.close()
        seg = Segment.open(name, mode, trusted)


def _check_upstream(name: str, att: _Attachment, cfg: Optional[Config], upstream: Optional[UpstreamSpec]) -> None:
    """A creating call (one with a config) must agree with the segment on its upstream too.

    A call that configured the upstream then feeds with its own (``configure_upstream``).
    """
    if cfg is not None and att.upstream != upstream:
        raise ConfigMismatchError(name, f"upstream {_show(att.upstream)}", f"upstream {_show(upstream)}")
    if upstream is not None:
        att.configure_upstream(upstream)


def _show(spec: Optional[UpstreamSpec]) -> str:
    return "none" if spec is None else spec.describe()


def _open_attachment(
    name: str,
    cfg: Optional[Config],
    mode: int,
    initial: Optional[float],
    slots: int,
    upstream: Optional[UpstreamSpec] = None,
    trusted: frozenset = frozenset(),
) -> _Attachment:
    with _registry_lock:
        att = _registry.get(name)
        # a name unlinked and re-created since we mapped it is a different limiter
        if att is not None and (att.closed or current_inode(name) != att.seg.inode):
            _registry.pop(name, None)
            att = None
        if att is None:
            att = _map(name, cfg, mode, initial, slots, upstream=upstream, trusted=trusted)
            _registry[name] = att
        else:
            # vetted when this process first opened it, but perhaps under a wider trust than this call's
            check_trust(name, _owner_stat(att.seg), mode, trusted)
            if cfg is not None and _live_config(att) != cfg:
                raise ConfigMismatchError(name, att.bucket.config.describe(), cfg.describe())
            _check_upstream(name, att, cfg, upstream)
        att.refs += 1
        return att


def _still_ready(att: _Attachment) -> bool:
    """After registering: False (the attachment undone) if a collector claimed the segment meanwhile.

    The collector claims (STATE READY -> DOOMED by CAS) and then looks for
    live processes; we register and then look at STATE.  With sequentially
    consistent words one of the two sees the other: either the collector
    sees us and gives the segment back, or we see its claim and leave.
    """
    if att.cells.load(L.STATE_OFF) == L.STATE_READY:
        return True
    att.detach()
    return False


def collect(name: str) -> bool:
    """Unlink the segment if no live process is attached to it; True if it did.

    Never orphans a process that attaches meanwhile (see ``_still_ready``).
    """
    validate_name(name)
    att = _map(name, None, None, None, 0, join=False)  # no trust check: it only unlinks, as the filesystem allows
    try:
        c = att.cells

        def in_use() -> bool:
            return any(slot_alive(e.pid, e.start, e.pidns) for e in att.table.entries())

        if in_use() or not c.cas(L.STATE_OFF, L.STATE_READY, L.STATE_DOOMED):
            return False
        if in_use():
            c.cas(L.STATE_OFF, L.STATE_DOOMED, L.STATE_READY)
            return False
        if current_inode(name) == att.seg.inode:
            try:
                _unlink_name(name)
            except LimiterNotFoundError:
                return False
            return True
        return False
    finally:
        att.detach()


def _live_config(att: _Attachment) -> Optional[Config]:
    """The config in force now: another process may have changed it since this one last looked."""
    att.bucket.refresh()
    return att.bucket.config


def _owner_stat(seg: Segment) -> os.stat_result:
    """The owner and mode a segment had when this process opened it, in ``os.stat_result`` form."""
    return os.stat_result((seg.mode, 0, 0, 0, seg.owner, 0, seg.size, 0, 0, 0))


def _map(
    name: str,
    cfg: Optional[Config],
    mode: Optional[int],
    initial: Optional[float],
    slots: int,
    join: bool = True,
    upstream: Optional[UpstreamSpec] = None,
    trusted: frozenset = frozenset(),
) -> _Attachment:
    """Create and initialise the segment, or map the existing one; never a half-initialised header.

    With a config (create intent), a segment abandoned mid-initialisation is
    replaced, and a name unlinked between our failed create and our open is
    created again.  Without one, both raise.
    """
    warm_backend()  # a creator's first store must not wait for an import
    for _ in range(16):
        if cfg is not None:
            seg = Segment.create(name, L.segment_size(slots), mode)
            if seg is not None:
                att = _initialise(name, seg, cfg, initial, slots, upstream)
                if _still_ready(att):
                    return att
                continue
        try:
            seg = _wait_ready(name, Segment.open(name, mode, trusted), mode, trusted)
        except LimiterNotFoundError:
            if cfg is None:
                raise
            continue
        except _Abandoned as e:
            if cfg is None:
                raise
            time.sleep(0.05)  # replacing destroys a segment: confirm the verdict once more first
            try:
                _wait_ready(name, Segment.open(name, mode, trusted), mode, trusted).close()
                continue  # it became ready (or another took its place): attach normally
            except _Abandoned as again:
                if again.inode != e.inode:
                    continue
            except (LimiterNotFoundError, SegmentError):
                continue
            if current_inode(name) == e.inode:  # still the abandoned one, not a newer segment
                try:
                    _unlink_name(name)
                except LimiterNotFoundError:
                    pass
            continue
        cells = open_cells(seg.mm, cells_size(seg))
        att = None
        try:
            att = _Attachment(name, seg, cells, join)
            if not _still_ready(att):
                att = None
                continue
            if cfg is not None and att.bucket.config != cfg:
                raise ConfigMismatchError(name, att.bucket.config.describe(), cfg.describe())
            _check_upstream(name, att, cfg, upstream)
        except BaseException:
            if att is not None:
                att.detach()
            else:
                cells.close()
                seg.close()
            raise
        return att
    raise SegmentError(f"could not create or open limiter {name!r}: it kept being unlinked and re-created")


def _initialise(
    name: str, seg: Segment, cfg: Config, initial: Optional[float], slots: int, upstream: Optional[UpstreamSpec]
) -> _Attachment:
    c = open_cells(seg.mm, seg.size)
    c.store(L.CREATOR_PID_OFF, os.getpid())  # first: openers tell a working creator from a dead one
    c.store(L.VERSION_OFF, L.VERSION)
    c.store(L.SIZE_OFF, seg.size)
    c.store(L.SLOTS_OFF, slots)
    c.store(L.CREATED_NS_OFF, time.time_ns())
    base = int(os.environ.get("SHMLIMIT_TEST_ROVER_BASE", "0"))  # tests: start the rovers anywhere
    if upstream is not None:
        upstream.write(c)
    Bucket.initialise(c, cfg, time.monotonic_ns(), initial, base, upstream is not None)
    c.store(L.MAGIC_OFF, L.MAGIC)
    c.store(L.STATE_OFF, L.STATE_READY)  # last: openers wait for this
    att = _Attachment(name, seg, c)
    if upstream is not None:
        att.configure_upstream(upstream)
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


def _upstream(
    name: str, rate: Any, per: float, burst: Optional[float], upstream: Any, on_error: str, ttl: Any, batch: Any
) -> Tuple[Any, float, Optional[float], UpstreamSpec]:
    """Resolve ``upstream=``: the local config to use and the upstream this process leases from."""
    if on_error not in ON_ERROR:
        raise ValueError(f"on_redis_error must be one of {', '.join(ON_ERROR)}, got {on_error!r}")
    for param, v in (("lease_ttl", ttl), ("batch_seconds", batch)):
        t = validate_timeout(v, param)
        if t is None or not 0.001 <= t <= 60:
            raise ValueError(f"{param} must be between 0.001 and 60 seconds, got {v!r}")
    from .redis import RedisLimiter  # the Redis tier: only a process that configures it imports it

    options = dict(on_error=on_error, lease_ttl=float(ttl), batch_seconds=float(batch))
    if isinstance(upstream, str):
        if rate is None:
            raise ValueError("upstream= as a URL needs rate= (the global limit); or pass a RedisLimiter")
        cfg = Config.make(rate, per, burst)
        redis = RedisLimiter(name, cfg.rate, cfg.per, cfg.burst, url=upstream)
        redis.close()
    elif isinstance(upstream, RedisLimiter):
        redis = upstream
        if rate is None:
            rate, per, burst = redis.rate, redis.per, redis.capacity
    else:
        raise TypeError(f"upstream must be a Redis URL or a RedisLimiter, not {type(upstream).__name__}")
    spec = redis.upstream_spec(**options)
    spec.encode()  # too long for the header: refused before anything is created
    return rate, per, burst, spec


class Limiter:
    """A rate limit of ``rate`` ops per ``per`` seconds shared by every process using ``name``.

    ``Limiter(name, rate=..., per=1.0, burst=None)`` creates the limiter, or
    attaches to it if it exists with the same configuration (a different one
    raises ``ConfigMismatchError``).  ``rate`` may be a rate spec string such
    as ``"12K,1.1"`` (rate 12000, catch-up ratio 1.1).  ``burst`` is the
    bucket capacity in ops (default: 10 ms of schedule, at least one op).

    Keyword-only options: ``ratio`` (catch-up, >= 1.0; default 1.0 = off),
    ``max_behind`` (seconds of schedule the waiting pool may hold; default
    unbounded), ``max_reserved`` (seconds of schedule callers may queue
    ahead; default unbounded), ``capped`` (capped release, see ``release``),
    ``mode`` (the segment's permission bits, default 0o600), ``initial``
    (ops in the bucket at creation; default full), ``slots`` (process table
    size, default 128).

    Trust: a segment that already exists is used only if it is owned by this
    process's user, by root, or by a uid in ``trusted_uids``, and is not
    writable by group or others beyond ``mode``; otherwise
    ``UntrustedSegmentError`` (a ``PermissionError``) names its owner and mode.
    So ``Limiter(name, rate=5)`` never silently joins a segment another user
    created first under that name.  To share a limiter with a group, create
    and attach it with ``mode=0o660`` (and ``trusted_uids=`` naming the
    creator's uid in the other users' processes).  See SECURITY.md.

    Hierarchical mode (one limit across hosts): ``upstream`` is a Redis URL
    (the global limit then has this limiter's name, rate, per and burst) or
    a ``shmlimit.redis.RedisLimiter`` (whose config is the default for this
    one's).  The elected filler leases batches from it; ``lease_ttl``
    (seconds a leased token stays usable, default 0.1), ``batch_seconds``
    (the demand a batch covers, default 0.02) and ``on_redis_error``
    (``"closed"``, the default, ``"local"`` or ``"open"``) are described in
    ``shmlimit.upstream`` and the README.

    A Limiter pickles as its name: a child process that unpickles it attaches
    to the same segment.  One inherited through ``fork`` works as well: the
    child registers itself as its own process.
    """

    def __init__(
        self,
        name: str,
        rate: Union[float, str, None] = None,
        per: float = 1.0,
        burst: Optional[float] = None,
        *,
        ratio: Optional[float] = None,
        max_reserved: Optional[float] = None,
        max_behind: Optional[float] = None,
        capped: bool = False,
        mode: int = 0o600,
        initial: Optional[float] = None,
        slots: int = L.DEFAULT_SLOTS,
        upstream: Union[str, "RedisLimiter", None] = None,
        on_redis_error: str = "closed",
        lease_ttl: float = DEFAULT_LEASE_TTL,
        batch_seconds: float = DEFAULT_BATCH_SECONDS,
        trusted_uids: Iterable[int] = (),
    ) -> None:
        validate_name(name)
        trusted = _trusted_uids(trusted_uids)
        desc = None
        if upstream is not None:
            rate, per, burst, desc = _upstream(name, rate, per, burst, upstream, on_redis_error, lease_ttl, batch_seconds)
            if capped or (ratio is not None and ratio != 1.0):
                raise ValueError("capped and ratio are not supported with upstream= (hierarchical mode)")
        cfg = None if rate is None else Config.make(rate, per, burst, capped, ratio, max_reserved, max_behind)
        if isinstance(mode, bool) or not isinstance(mode, int) or not 0 <= mode <= 0o777:
            raise ValueError(f"mode must be permission bits between 0 and 0o777, got {mode!r}")
        if initial is not None:
            if isinstance(initial, bool) or not isinstance(initial, (int, float)) or not 0 <= initial < float("inf"):
                raise ValueError(f"initial must be a finite number of ops >= 0, got {initial!r}")
        if isinstance(slots, bool) or not isinstance(slots, int) or not 1 <= slots <= L.MAX_SLOTS:
            raise ValueError(f"slots must be an int from 1 to {L.MAX_SLOTS}, got {slots!r}")
        self._name = name
        self._mode = mode
        self._trusted = trusted
        self._att: Optional[_Attachment] = None
        self._fast: list = list(_NO_FAST)
        self._att = _open_attachment(name, cfg, mode, initial, slots, desc, trusted)
        self._fast = self._att.fast

    # -- identity and lifecycle ----------------------------------------------------

    @property
    def name(self) -> str:
        return self._name

    @property
    def config(self) -> Config:
        """The live configuration (changes made by any process show here)."""
        b = self._live().bucket
        b.refresh()
        return b.config

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
        self._fast = list(_NO_FAST)
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

    async def __aenter__(self) -> "Limiter":
        await self.acquire_async()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        return None

    def __reduce__(self):
        # The trust travels with the handle: the unpickling process vets the segment the same way.
        # A hierarchical handle also carries the upstream its process configured (secrets
        # included), so a pool worker that unpickles it may feed as its parent would.
        att = self._att
        trusted = tuple(sorted(self._trusted))
        if att is not None and att.feed_spec is not None:
            return (_attach_configured, (self._name, att.feed_spec, self._mode, trusted))
        return (_unpickle, (self._name, self._mode, trusted))

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
        With ``max_reserved`` set, an untimed acquire waits (taking nothing)
        until the queue is short enough to join.
        """
        # The fast paths: one op, the config unchanged -- a single native call.
        if n is _ONE:
            if timeout is None:
                ticket = self._fast[0]()
                if ticket is None:
                    return True
            else:
                ticket = self._fast[2](timeout)
                if ticket is False or ticket is True:  # refused first: a flood is mostly refusals
                    return ticket
            if ticket is not False and ticket is not None:
                att = self._live()
                self._wait(att, ticket)
                att.cells.fetch_add(att.grants_off, 1)
                return True
        return self._acquire(n, timeout)

    def _acquire(self, n: int, timeout: Optional[float]) -> bool:
        att = self._live()
        b = att.bucket
        if b.refresh() or att.fast_seq != b.seq:
            att.update_fast()
        validate_n(n, b.cost)
        timeout = validate_timeout(timeout)
        if not b.capped:
            return self._acquire_tokens(att, n, timeout)
        # Capped mode: first a place among the ops in flight (taking no ticket while waiting for
        # one, so nobody queues behind a caller that waits for a release), then the tokens.
        deadline = None if timeout is None else time.monotonic() + timeout
        while not b.admit(n):
            if n > b.cap_ops:
                raise ValueError(f"n must be at most the capacity of {b.cap_ops} ops in capped mode, got {n}")
            if deadline is not None and time.monotonic() >= deadline:
                return False
            time.sleep(CAPPED_NAP if deadline is None else min(CAPPED_NAP, max(0.0, deadline - time.monotonic())))
            b.refresh()
        granted = False
        try:
            granted = self._acquire_tokens(att, n, None if deadline is None else max(0.0, deadline - time.monotonic()))
        finally:
            if not granted:
                b.unadmit(n)
        return granted

    def _acquire_tokens(self, att: _Attachment, n: int, timeout: Optional[float]) -> bool:
        b = att.bucket
        c = att.cells
        tokens = validate_n(n, b.cost) * b.cost
        if att.opened():  # hierarchical mode, Redis unreachable, on_redis_error="open": no limit
            c.fetch_add(att.grants_off, n)
            return True
        if timeout is None:
            if b.max_reserved_ns == _INF:
                ticket = c.grab(L.TAIL, L.HEAD, tokens, att.grants_off, n)
                if ticket is None:
                    return True
                if ticket is False:
                    raise QueueFullError(tokens, b.tpn)
            else:
                ticket = self._take(att, tokens, b.max_reserved_ns)
                while ticket is None:  # backpressure: the queue is full, wait for room
                    time.sleep(self._nap(att, tokens))
                    ticket = self._take(att, tokens, b.max_reserved_ns)
        elif b.upstream:
            deadline = time.monotonic() + timeout
            place = None
            try:
                while True:
                    nap, place = self._poll(att, tokens, n, deadline, place)
                    if nap is None or nap is True:
                        return nap is True
                    time.sleep(nap)
            finally:
                if place is not None:
                    c.fetch_add(L.UP_LINE_HEAD, n)
        else:
            ticket = self._take(att, tokens, min(timeout * NS_PER_S, b.max_reserved_ns))
            if ticket is None:
                return False
        self._wait(att, ticket)
        c.fetch_add(att.grants_off, n)
        return True

    def try_acquire(self, n: int = 1) -> bool:
        """Take ``n`` ops only if they are available now; never waits.  False takes nothing.

        ``n`` larger than the capacity can never succeed.
        """
        if n is _ONE:  # the fast path: one native call, granted or refused
            granted = self._fast[1]()
            if granted is not None:
                return granted
        return self._try_acquire(n)

    def _try_acquire(self, n: int) -> bool:
        att = self._live()
        b = att.bucket
        if b.refresh() or att.fast_seq != b.seq:
            att.update_fast()
        validate_n(n, b.cost)
        if not b.capped:
            return self._try_tokens(att, n)
        if not b.admit(n):
            return False
        granted = False
        try:
            granted = self._try_tokens(att, n)
        finally:
            if not granted:
                b.unadmit(n)
        return granted

    def _try_tokens(self, att: _Attachment, n: int) -> bool:
        b = att.bucket
        tokens = n * b.cost
        c = att.cells
        if c.try_grab(L.TAIL, L.HEAD, tokens, att.grants_off, n):
            return True
        if att.opened():
            c.fetch_add(att.grants_off, n)
            return True
        if b.replenish() > 0:
            return c.try_grab(L.TAIL, L.HEAD, tokens, att.grants_off, n)
        if b.upstream:
            c.store(L.UP_HUNGRY, time.monotonic_ns())  # a refused try is demand the filler should see
        return False

    def reserve(self, n: int = 1, max_wait: Optional[float] = None) -> Optional[float]:
        """Claim the next slot for ``n`` ops; return the seconds to wait before using it.

        0.0 means now.  Returns None, taking nothing, when the wait would
        exceed ``max_wait`` (seconds) or the limiter-wide ``max_reserved``.
        The caller owns the slot once this returns a number: it is granted
        (and counted) whether or not the caller uses it.  While the limiter is
        stopped the wait is not computable: a bounded reservation returns None,
        an unbounded one returns ``math.inf``.  A capped limiter with no room
        among its ops in flight returns None.  Not available in hierarchical
        mode (ValueError).
        """
        att = self._live()
        b = att.bucket
        b.refresh()
        if b.upstream:
            # Paced by the local rate, each host would promise slots of the global rate: two hosts
            # of a global 100/s handed out 200 usable slots in 1 s.  Leases have no known time.
            raise ValueError(
                f"reserve() is not available on the hierarchical limiter {self._name!r}: its tokens come "
                f"from leases, whose time is not known in advance; use acquire(timeout=...) or try_acquire()"
            )
        tokens = validate_n(n, b.cost) * b.cost
        limit = validate_timeout(max_wait, "max_wait")
        if att.opened():
            att.cells.fetch_add(att.grants_off, n)
            return 0.0
        if b.capped and not b.admit(n):
            return None  # no room among the ops in flight: nothing taken
        try:
            ticket = self._take(att, tokens, min(_INF if limit is None else limit * NS_PER_S, b.max_reserved_ns))
        except BaseException:
            if b.capped:
                b.unadmit(n)
            raise
        if ticket is None:
            if b.capped:
                b.unadmit(n)
            return None
        att.cells.fetch_add(att.grants_off, n)
        if b.deficiency(ticket) and b.stopped:
            return _INF
        # Replenish just before reading the head and its time: a replenish by another process
        # landing between the two reads makes the answer late by its interval, which is now
        # only as long as the time since ours.
        b.replenish()
        return max(0.0, b.due_ns(ticket) - time.monotonic_ns()) / NS_PER_S

    def retry_after(self, n: int = 1) -> float:
        """Seconds until ``n`` ops could be granted to a new caller at the current rate (0.0: now)."""
        att = self._live()
        b = att.bucket
        b.refresh()
        tokens = validate_n(n, b.cost) * b.cost
        if b.stopped:
            return _INF
        short = -b.balance() + tokens - min(b.pending(), b.cap)
        return max(0, short) / b.tpn / NS_PER_S

    def acquire_with_backoff(self, n: int = 1, timeout: Optional[float] = None) -> bool:
        """The pessimistic mode: ``try_acquire``, and on refusal sleep a random share of the wait, then retry.

        Takes no place in the queue while backing off.  Each sleep is uniform in
        [0.5, 1.5] times the current ``retry_after`` (at least 0.1 ms), so
        processes that were refused together do not retry together.  Returns
        False, having taken nothing, once ``timeout`` seconds have passed.
        """
        timeout = validate_timeout(timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if self.try_acquire(n):
                return True
            nap = max(1e-4, self.retry_after(n) if not self._live().bucket.stopped else MAX_NAP)
            nap = min(MAX_NAP, nap) * random.uniform(0.5, 1.5)
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                nap = min(nap, left)
            time.sleep(nap)

    def drain(self) -> int:
        """Take every whole op available now (counted as granted to this process); return how many.

        Queued callers are untouched: a drain never cancels or jumps reservations.
        """
        att = self._live()
        b = att.bucket
        b.refresh()
        b.replenish()
        c = att.cells
        snap = b.snap
        while True:
            tail = c.load(L.TAIL)
            ops = diff(c.load(L.HEAD), tail) // snap.cost
            if snap.capped:  # no more than the room among the ops in flight
                ops = min(ops, snap.cap_ops - b.in_flight())
            if ops <= 0:
                return 0
            if snap.capped and not b.admit(ops):
                continue
            if c.cas(L.TAIL, tail, (tail + ops * snap.cost) & MASK64):
                c.fetch_add(att.grants_off, ops)
                return ops
            if snap.capped:
                b.unadmit(ops)

    def release(self, n: int = 1) -> None:
        """Capped mode: report ``n`` completed ops, letting ``n`` more be replenished.

        With ``capped=True`` every acquire first takes a place among the ops
        in flight, counted in ops: at most ``capacity`` (whole) ops are ever
        granted and not yet released, whatever ``set_rate``, ``stop``,
        ``restart`` or catch-up do to the tokens, and grants still never exceed
        the rate.  A downstream that stops completing stops the grants.
        Releasing more ops than are in flight raises ValueError and changes
        nothing.
        """
        att = self._live()
        b = att.bucket
        b.refresh()
        if not b.capped:
            raise ValueError(f"release() needs a limiter created with capped=True; {self._name!r} is not capped")
        b.release(validate_n(n, b.cost))

    # -- live changes ------------------------------------------------------------------

    def set_rate(
        self,
        rate: float,
        per: Optional[float] = None,
        burst: Optional[float] = None,
        *,
        ratio: Optional[float] = None,
    ) -> None:
        """Change the limit for every attached process, at once, without re-attaching.

        ``per`` and ``ratio`` default to their current values; ``burst`` to the
        default for the new rate, as in the constructor.  Ops already granted
        stay granted and queued callers keep their place; new grabs pay the new
        price, and a capacity that shrinks takes effect at once (tokens beyond
        it are dropped).  Re-applying the current config changes nothing.
        """
        att = self._live()
        b = att.bucket
        b.refresh()
        cur = b.config
        if isinstance(rate, str):  # a rate spec: its ratio, if it has one, is the one to use
            spec = parse_spec(rate)
            if spec.verb not in (None, "configure"):
                raise ValueError(f"rate spec verb {spec.verb!r} is not allowed in set_rate (use apply)")
            if spec.ratio is not None and ratio is not None and float(ratio) != spec.ratio:
                raise ValueError(f"ratio given twice: {ratio!r} and {spec.ratio!r} in the rate spec")
            rate, ratio = spec.rate, (spec.ratio if spec.ratio is not None else ratio)
        new = cur.replace(
            rate=rate,
            per=cur.per if per is None else per,
            burst=burst,
            ratio=cur.ratio if ratio is None else ratio,
        )
        if new != cur:
            b.publish(new)

    def stop(self) -> None:
        """Pause the whole fleet: every acquirer in every process waits until ``start``."""
        b = self._live().bucket
        b.refresh()
        if not b.stopped:
            b.set_stopped(True)

    def start(self) -> None:
        """Resume after ``stop``, from an empty bucket; the paused time is not owed to anyone."""
        b = self._live().bucket
        b.refresh()
        if b.stopped:
            b.set_stopped(False)

    def restart(self) -> None:
        """Start (if stopped) with the pools zeroed: an empty bucket and nothing behind schedule."""
        b = self._live().bucket
        b.refresh()
        b.set_stopped(False, reset=True)

    @property
    def stopped(self) -> bool:
        b = self._live().bucket
        b.refresh()
        return b.stopped

    def apply(self, spec: str) -> None:
        """Apply a rate spec ``rate[,ratio][,verb]`` (nosqlbench's syntax, K/M/G allowed).

        ``configure`` (the default) changes rate and ratio in place, ``start``
        does so and resumes a stopped limiter, ``restart`` does so and zeroes
        the pools, ``stop`` pauses every process.  Applying the spec that is
        already in force changes nothing.
        """
        parsed = parse_spec(spec)
        if parsed.verb == "stop":
            self.stop()
            return
        self.set_rate(parsed.rate, burst=None if parsed.rate != self.rate else self.capacity, ratio=parsed.ratio)
        if parsed.verb == "start":
            self.start()
        elif parsed.verb == "restart":
            self.restart()

    # -- asyncio -----------------------------------------------------------------------

    async def acquire_async(self, n: int = 1, timeout: Optional[float] = None) -> bool:
        """``acquire`` for asyncio: waits with ``asyncio.sleep``, never blocking the event loop.

        Cancelled before it has its ticket, it takes nothing.  Cancelled while
        waiting for a ticket it already holds, the ticket's ``n`` ops of
        schedule are spent unused: they cannot be handed back without letting
        later callers jump the queue.
        """
        att = self._live()
        b = att.bucket
        b.refresh()
        validate_n(n, b.cost)
        timeout = validate_timeout(timeout)
        if not b.capped:
            return await self._acquire_tokens_async(att, n, timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        while not b.admit(n):
            if n > b.cap_ops:
                raise ValueError(f"n must be at most the capacity of {b.cap_ops} ops in capped mode, got {n}")
            if deadline is not None and time.monotonic() >= deadline:
                return False
            await asyncio.sleep(CAPPED_NAP)
            b.refresh()
        granted = False
        try:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            granted = await self._acquire_tokens_async(att, n, left)
        finally:
            if not granted:
                b.unadmit(n)
        return granted

    async def _acquire_tokens_async(self, att: _Attachment, n: int, timeout: Optional[float]) -> bool:
        b = att.bucket
        tokens = n * b.cost
        c = att.cells
        if att.opened():
            c.fetch_add(att.grants_off, n)
            return True
        if timeout is None and b.max_reserved_ns == _INF:
            ticket = c.grab(L.TAIL, L.HEAD, tokens, att.grants_off, n)
            if ticket is None:
                return True
            if ticket is False:
                raise QueueFullError(tokens, b.tpn)
        elif timeout is None:
            ticket = self._take(att, tokens, b.max_reserved_ns)
            while ticket is None:
                await asyncio.sleep(self._nap(att, tokens))
                ticket = self._take(att, tokens, b.max_reserved_ns)
        elif b.upstream:
            deadline = time.monotonic() + timeout
            place = None
            try:
                while True:
                    nap, place = self._poll(att, tokens, n, deadline, place)
                    if nap is None or nap is True:
                        return nap is True
                    await asyncio.sleep(nap)
            finally:
                if place is not None:
                    c.fetch_add(L.UP_LINE_HEAD, n)
        else:
            ticket = self._take(att, tokens, min(timeout * NS_PER_S, b.max_reserved_ns))
            if ticket is None:
                return False
        while True:
            # replenishing adds whatever time has passed, however little: re-check, then sleep
            if b.deficiency(ticket) <= 0 or (b.replenish() > 0 and b.deficiency(ticket) <= 0):
                break
            b.refresh()
            if att.opened():
                break
            if b.upstream and att.filler is not None:
                att.filler.nudge()
            short = b.deficiency(ticket)
            if b.upstream and not b.time_fed:
                await asyncio.sleep(_fed_nap(c, short / b.tpn / NS_PER_S))
                continue
            await asyncio.sleep(min(max(short / b.tpn / NS_PER_S, 1e-4), MAX_NAP))
        c.fetch_add(att.grants_off, n)
        return True

    # -- internals -----------------------------------------------------------------------

    def _take(self, att: _Attachment, tokens: int, max_wait_ns: float) -> Optional[int]:
        """A ticket for ``tokens`` whose wait fits ``max_wait_ns``, or None having taken nothing."""
        b = att.bucket
        ticket = b.try_grab_within(tokens, max_wait_ns)
        if ticket is None and b.replenish() > 0:
            ticket = b.try_grab_within(tokens, max_wait_ns)
        return ticket

    def _poll(
        self, att: _Attachment, tokens: int, n: int, deadline: float, place: Optional[int]
    ) -> Tuple[Union[bool, float, None], Optional[int]]:
        """Hierarchical mode, a timed acquire: (True if granted now, None past the deadline, else a nap; place).

        Tokens arrive when leases do, not on a clock, so a ticket's wait has
        no bound: a timed acquire takes no ticket, and takes nothing unless it
        succeeds.  Refused once, it joins the line of timed waiters
        (``UP_LINE_TAIL``; it leaves through ``UP_LINE_HEAD`` whatever the
        outcome) only to know how many ops wait ahead of it: it sleeps until
        the filler next expects tokens (``UP_NEXT_NS``), plus the time the
        local rate takes to serve those ahead, plus a little so the filler has
        added them.  So the waiters do not all wake for every
        batch.  Not knowing when tokens come, it looks again after ``POLL``.
        """
        b = att.bucket
        c = att.cells
        if c.try_grab(L.TAIL, L.HEAD, tokens, att.grants_off, n):
            return True, place
        b.refresh()
        if att.opened():
            c.fetch_add(att.grants_off, n)
            return True, place
        if b.time_fed and b.replenish() > 0 and c.try_grab(L.TAIL, L.HEAD, tokens, att.grants_off, n):
            return True, place
        now = time.monotonic_ns()
        left = deadline - now / NS_PER_S
        if left <= 0:
            return None, place
        c.store(L.UP_HUNGRY, now)  # no ticket shows our demand: tell the filler
        if att.filler is not None:
            att.filler.nudge()
        if place is None:
            place = c.fetch_add(L.UP_LINE_TAIL, n)
        ahead = max(0, diff(place, c.load(L.UP_LINE_HEAD)))  # ops of waiters that came before us
        turn = ahead * b.config.per / b.config.rate
        nxt = c.load(L.UP_NEXT_NS)
        nap = ((nxt - now) / NS_PER_S + turn if nxt > now else max(POLL, turn)) + ARRIVAL_SLACK
        return min(left, nap, MAX_NAP), place

    def _nap(self, att: _Attachment, tokens: int) -> float:
        """How long a caller refused by ``max_reserved`` sleeps before trying to join again (s)."""
        b = att.bucket
        b.refresh()
        over = -b.balance() + tokens - b.max_reserved_ns * b.tpn
        return min(MAX_NAP, max(1e-4, over / b.tpn / NS_PER_S))

    def _wait(self, att: _Attachment, ticket: int) -> None:
        """Wait until the head covers ``ticket``: sleep to the moment it is due, precisely, then look.

        The ticket's due time (``Bucket.due_ns``) is exact at the current
        rate, so a waiter sleeps once, to that absolute deadline with a low
        timer slack (``sleep.sleep_until``), replenishes and is granted; only
        when the head still falls short (another process's replenish in
        flight, or tokens that come from leases, releases or a start) does it
        look again after a short sleep.  Each waiter wakes for its own turn
        only: the queue's head near its turn, the others when theirs comes
        (or every ``MAX_NAP``, to notice changes).
        """
        b = att.bucket
        c = att.cells
        waiting = att.waiting_off
        filler = att.filler
        sleep_until = _sleep_until()
        if waiting is not None:
            c.store(waiting, 1)
        try:
            while True:
                if diff(ticket, c.load(L.HEAD)) <= 0:
                    return
                b.refresh()
                if att.opened():  # the "open" fallback lets queued callers through too
                    return
                now = time.monotonic_ns()
                due = b.due_ns(ticket) if b.time_fed and not b.stopped else now
                if due > now:  # not our turn yet: no replenish can help, sleep to it
                    if due - now > MAX_NAP_NS:
                        sleep_until(now + MAX_NAP_NS)  # wake now and then to notice changes
                        continue
                    sleep_until(int(due) + 1)
                    if diff(ticket, c.load(L.HEAD)) <= 0:  # the filler was there first
                        return
                # our turn (or no clock to tell): replenishing adds whatever time has passed
                if b.replenish() > 0:
                    if filler is not None:
                        filler.nudge()  # we did the filler's work: make sure a filler runs
                    if diff(ticket, c.load(L.HEAD)) <= 0:
                        return
                if b.upstream and filler is not None:
                    filler.nudge()  # only a filler leases: make sure one runs
                short = diff(ticket, c.load(L.HEAD)) / b.tpn
                if b.upstream and not b.time_fed:  # tokens come with leases: sleep until a batch is due
                    time.sleep(_fed_nap(c, short / NS_PER_S))
                    continue
                # due, yet short: look again soon, or when the shortfall could have arrived
                sleep_until(time.monotonic_ns() + int(min(max(short, RETRY_NS), MAX_NAP_NS)))
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
        extra = f" ratio={s.ratio:g} behind={s.behind_seconds:.3f}s" if s.ratio != 1.0 else ""
        if s.upstream is not None:
            extra += f" upstream={s.upstream.url} ({s.upstream.state})"
        return (
            f"<shmlimit.Limiter {s.name!r} rate={s.rate:g}/{s.per:g}s capacity={s.capacity:g}{extra} "
            f"available={s.available:.1f} deficiency={s.deficiency:.1f} grants={s.grants} "
            f"filler_pid={s.filler_pid} processes={len(s.processes)}{' stopped' if s.stopped else ''} "
            f"backend={s.backend}>"
        )


def _fed_nap(c: Cells, estimate: float) -> float:
    """Hierarchical mode: how long a queued waiter sleeps, ``estimate`` being the local rate's guess.

    Tokens come only when a reserved batch falls due (``UP_NEXT_NS``): never
    sooner than that, and for a ticket far back not before the local rate
    would reach it.  Unknown, look again after ``POLL``.
    """
    now = time.monotonic_ns()
    nxt = c.load(L.UP_NEXT_NS)
    if nxt <= now:  # not known: a batch may come at any moment (a burst available upstream)
        return POLL
    return min(max((nxt - now) / NS_PER_S, estimate) + ARRIVAL_SLACK, MAX_NAP)


def snapshot(name: str, att: _Attachment) -> Stats:
    c = att.cells
    b = att.bucket
    b.refresh()
    cfg = b.config
    balance = b.balance()
    pending = b.pending() if b.time_fed else 0  # hierarchical mode: only leases add tokens
    available = max(0, min(b.cap, balance + pending)) if balance >= 0 else 0
    word = c.load(L.LEASE)
    slot = lease_slot(word)
    filler_pid = None
    heartbeat_age = None
    now = now_us()
    if slot is not None and lease_expiry_us(word) > now:
        filler_pid = att.table.pid_of(slot) or None
        heartbeat_age = max(0.0, (now - (lease_expiry_us(word) - int(LEASE_TIMEOUT * 1e6))) / 1e6)
    procs = []
    total = c.load(L.UNREG_GRANTS) + att.table.total_grants()
    for e in att.table.entries():
        procs.append(ProcessStats(e.pid, slot_alive(e.pid, e.start, e.pidns), e.grants, e.waiting, e.index == slot and filler_pid is not None))
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
        ratio=cfg.ratio,
        behind_seconds=b.behind_ns() / NS_PER_S,
        stopped=b.stopped,
        upstream=_upstream_stats(att),
    )


def _upstream_stats(att: _Attachment) -> Optional[UpstreamStats]:
    spec = att.upstream
    if spec is None:
        return None
    c = att.cells
    return UpstreamStats(
        url=spec.url,  # stored without secrets
        key=spec.key,
        state=STATE_NAMES.get(c.load(L.UP_STATE), "unknown"),
        on_redis_error=spec.on_error,
        lease_ttl=spec.lease_ttl,
        round_trips=c.load(L.UP_ROUND_TRIPS),
        leased=c.load(L.UP_LEASED),
        leases=c.load(L.UP_LEASES),
        expired=c.load(L.UP_EXPIRED),
        refused=c.load(L.UP_REFUSED),
        errors=c.load(L.UP_ERRORS),
        fallbacks=c.load(L.UP_FALLBACKS),
    )


def inspect(name: str) -> Stats:
    """A snapshot of a limiter's live state, read without joining it.

    The caller is not registered in the process table, never takes part in
    the filler election and writes nothing to the segment.
    """
    validate_name(name)
    seg = Segment.copy(name)  # read with pread, never mapped: no SIGBUS, no wait, nothing written
    verdict = _ready_creator(name, seg, 0.0)
    if verdict != 0:
        seg.close()
        what = "being removed" if verdict == _DOOMED else "still being initialised"
        raise SegmentError(f"segment {name!r} is {what}")
    cells = open_cells(seg.mm, cells_size(seg))
    att = _Attachment(name, seg, cells, join=False)
    try:
        return snapshot(name, att)
    finally:
        att.detach()


def attach(name: str, *, mode: int = 0o600, trusted_uids: Iterable[int] = ()) -> Limiter:
    """Attach to an existing limiter by name, whatever its configuration.

    Raises ``LimiterNotFoundError`` (a ``FileNotFoundError``) naming it when
    none exists, and ``UntrustedSegmentError`` when it is owned by a user
    other than this one, root and ``trusted_uids``, or writable by group or
    others beyond ``mode`` (see ``Limiter``).
    """
    return Limiter(name, mode=mode, trusted_uids=trusted_uids)


def _unpickle(name: str, mode: int, trusted: Tuple[int, ...]) -> Limiter:
    return Limiter(name, mode=mode, trusted_uids=trusted)


def _trusted_uids(uids: Iterable[int]) -> frozenset:
    if isinstance(uids, (str, bytes, int)):
        raise TypeError(f"trusted_uids must be an iterable of uids (ints), not {type(uids).__name__}")
    out = []
    for u in uids:
        if isinstance(u, bool) or not isinstance(u, int) or not 0 <= u <= 0xFFFFFFFF:
            raise ValueError(f"trusted_uids must hold uids from 0 to 4294967295, got {u!r}")
        out.append(u)
    return frozenset(out)


def unlink(name: str) -> None:
    """Remove the limiter's segment by name.  Raises ``LimiterNotFoundError`` when there is none."""
    _unlink_name(name)


def _attach_configured(name: str, spec: UpstreamSpec, mode: int = 0o600, trusted: Tuple[int, ...] = ()) -> Limiter:
    """Unpickling a hierarchical handle: attach, and feed with the upstream its sender configured."""
    lim = Limiter(name, mode=mode, trusted_uids=trusted)
    att = lim._live()
    if att.upstream != spec:
        raise ConfigMismatchError(name, f"upstream {_show(att.upstream)}", f"upstream {_show(spec)}")
    att.configure_upstream(spec)
    return lim
