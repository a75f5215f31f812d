"""What ``stats()``, ``inspect`` and the tools show: snapshots of a limiter's live state.

Reading only: a snapshot loads words and writes none.  ``inspect`` maps a
segment without registering, never joins the filler election and writes
nothing to the segment.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

from shmlimit.adapt import AdaptStats
from shmlimit.adapt import stats as adapt_stats
from shmlimit.attachment import Attachment
from shmlimit.bucket.filler import LEASE_TIMEOUT, lease_expiry_us, lease_slot, now_us
from shmlimit.config import NS_PER_S, Config
from shmlimit.errors import naming
from shmlimit.header import cells_size, check_copied
from shmlimit.redis.spec import STATE_NAMES
from shmlimit.shm import layout as L
from shmlimit.shm.banks import settle_copy
from shmlimit.shm.cells import open_cells
from shmlimit.shm.segment import Segment, validate_name
from shmlimit.shm.table import slot_alive


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
    leases: int  #: batches delivered, each with its lease record (``leased / leases`` is the average batch; one request reserves several)
    expired: int  #: leased ops never used (void after ``lease_ttl``, or still reserved when the process that leased them closed)
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
    #: ops that could be granted at once, counting time not yet replenished (capped: at most the
    #: places left free by the ops in flight)
    available: float
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
    #: schedule time (seconds, since creation) the limiter could not credit while callers were
    #: queued: no replenish ran within ``capacity`` of schedule because the filler and the waiters
    #: did not get the CPU (a starved host).  The rate fell short by this much (with catch-up, it
    #: went to the waiting pool, ``behind_seconds``, to be paid back); 0 on a healthy host.  In
    #: hierarchical mode: the global schedule lost while callers wanted tokens, because the filler
    #: asked for it late, Redis ran the request late, or a reserved batch was delivered past its ttl.
    starved_seconds: float = 0.0
    upstream: Optional[UpstreamStats] = None  #: hierarchical mode only
    #: an adaptive rate's parameters, outcomes and decisions (``rate`` is the one in force)
    adapt: Optional[AdaptStats] = None

    @property
    def ops_per_second(self) -> float:
        return self.rate / self.per

    def describe(self) -> str:
        """Its settings as ``Config.describe`` words them (those a snapshot holds)."""
        return Config(self.rate, self.per, self.capacity, self.capped, self.ratio).describe()


def snapshot(name: str, att: Attachment) -> Stats:
    """The live state of ``name`` as ``att`` maps it (reads only)."""
    c = att.cells
    b = att.bucket
    b.refresh()
    cfg = b.config
    balance = b.balance()
    pending = b.pending() if b.time_fed else 0  # hierarchical mode: only leases add tokens
    available = (max(0, min(b.cap, balance + pending)) if balance >= 0 else 0) / b.cost
    if b.capped:  # no more than the places in flight left free: a try is refused beyond them
        available = min(available, float(max(0, b.cap_ops - b.in_flight())))
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
        procs.append(
            ProcessStats(
                e.pid,
                slot_alive(e.pid, e.start, e.pidns),
                e.grants,
                e.waiting,
                e.index == slot and filler_pid is not None,
            )
        )
    short = max(0, -balance)
    return Stats(
        name=name,
        rate=cfg.rate,
        per=cfg.per,
        capacity=cfg.burst,
        available=available,
        deficiency=short / b.cost,
        deficiency_seconds=short / b.tpn / NS_PER_S,
        grants=total,
        filler_pid=filler_pid,
        heartbeat_age=heartbeat_age,
        processes=tuple(procs),
        capped=cfg.capped,
        backend=c.backend,
        ratio=cfg.ratio,
        behind_seconds=c.load(L.WAIT) / b.tpn / NS_PER_S,
        stopped=b.stopped,
        starved_seconds=c.load(L.STARVED_NS) / NS_PER_S,
        upstream=_upstream_stats(att),
        adapt=adapt_stats(c),
    )


def _upstream_stats(att: Attachment) -> Optional[UpstreamStats]:
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
    # read with pread, never mapped: no SIGBUS, no wait, nothing written
    return copied_snapshot(name, name, Segment.copy(name))


def copied_snapshot(name: str, label: str, seg: Segment) -> Stats:
    """The snapshot of ``label`` in ``seg``, a private copy of a limiter's segment or of a rate's
    region of the group ``name``; ``SegmentError`` naming ``name`` unless it is ready."""
    check_copied(name, label, seg)
    cells = open_cells(seg.mm, cells_size(seg))
    settle_copy(cells, L.CFG_SEQ)  # (a dead writer's lock in it: read at once)
    att = Attachment(label, seg, cells)
    try:
        with naming(label):  # (its adaptive rate's words, read without a name)
            return snapshot(label, att)
    finally:
        att.detach()
