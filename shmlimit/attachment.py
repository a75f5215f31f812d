"""One process's attachment to one limiter: the mapping, its process slot, its filler thread.

Every ``Limiter`` handle for a name in a process shares one ``Attachment``
(the registry here), so a process registers once in the process table and
runs one filler thread per limiter however many handles it makes.  After
``fork``, a hook registers the child in a slot of its own and forgets any
lease the parent held; the filler thread starts on the process's first use of
the limiter (never at open or fork, so a pre-fork master runs none); at exit, every attachment
detaches (its slot is given back and a held lease dropped, so a successor
fills at once).

The attachment owns this process's words of the process table: the grants
counter it adds to (``count``) and the WAITING count of its queued callers
(``waiting``).  Everything else goes through the bucket.
"""
from __future__ import annotations

import os
import threading
import time
from typing import Any, Callable, Optional

from . import layout as L
from .bucket import Bucket, GrabResult
from .cells import MASK64, Cells
from .errors import ConfigMismatchError, LimiterNotFoundError, SegmentError
from .filler import FillerThread, Lease
from .header import Creation, open_segment
from .registry import Registry
from .segment import Segment, check_trust, current_inode, validate_name
from .segment import unlink as unlink_name
from .sleep import SLACK_NS
from .table import ProcessTable, pid_namespace, proc_start, slot_alive
from .upstream_spec import UpstreamSpec

_INF = float("inf")


def _no_fast() -> GrabResult:
    return False


def _undecided() -> None:
    return None


def _undecided_within(timeout: object) -> None:
    return None


#: The fast path when there is none: [grab for acquire, try for try_acquire, grab within a timeout,
#: the native wait for a ticket (None: waiters wait in Python)].
NO_FAST = (_no_fast, _undecided, _undecided_within, None)


class Attachment:
    """One process's mapping of one limiter segment (shared by all its Limiter handles).

    ``clock`` (CLOCK_MONOTONIC ns) is the one clock of this attachment: its
    bucket, its requests' deadlines and its filler's feed all read it, so a
    test can drive every schedule with a fake one.
    """

    def __init__(
        self, name: str, seg: Segment, cells: Cells, join: bool = True, clock: Callable[[], int] = time.monotonic_ns
    ) -> None:
        self.name = name
        self.seg = seg
        self.cells = cells
        self.clock = clock
        self.bucket = Bucket(cells, clock)
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
        # answers False.  The other two are a Gate's methods (see composites.Gate): they answer None
        # when the config changed or they cannot decide, and so do their stand-ins in NO_FAST.
        self.fast: list = list(NO_FAST)
        self.fast_seq = -1
        #: The filler thread starts on this process's first use, not when it opens or forks: a
        #: process that only opened the limiter (a pre-fork server's master) runs no thread, so it
        #: never forks with one running.  Nothing waits for a filler: waiters replenish themselves.
        self.filler_started = False
        self._start_lock = threading.Lock()
        if join:
            self._join_process()
        self.update_fast()

    def update_fast(self) -> None:
        s = self.bucket.snap  # one snapshot: the grabber's seq and price always belong together
        self.fast_seq = s.seq
        unstarted = self.filler is not None and not self.filler_started  # the slow path starts it
        if self.closed or unstarted or s.max_reserved_ns != _INF or s.open or s.capped:  # the slow path
            self.fast[0] = _no_fast
        else:
            self.fast[0] = self.bucket.grabber(s, self.grants_off)
        # tries and timed acquires: not in hierarchical mode (a refusal there is demand the filler
        # must see, and a timed acquire polls), nor while stopped (no wait is computable), nor
        # capped (every grant must be admitted against the in-flight bound first)
        if self.closed or unstarted or s.upstream or s.stopped or s.capped or s.config is None:
            self.fast[1:] = NO_FAST[1:]
        else:
            gate = self.bucket.gate(s, self.grants_off)
            self.fast[1:3] = (gate.try_grab, gate.grab_within)
        # a ticket's whole wait in one native call, for the configs it handles (Bucket.waiter); it
        # reads the real clock, so an attachment with an injected clock waits in Python
        real_clock = self.clock is time.monotonic_ns
        self.fast[3] = None if self.closed or not real_clock else self.bucket.waiter(
            s, self.grants_off, self.waiting_off, SLACK_NS
        )

    # -- this process's words ------------------------------------------------------------

    def count(self, ops: int) -> None:
        """Count ``ops`` granted to this process (in its slot, or with the unregistered)."""
        self.cells.fetch_add(self.grants_off, ops)

    def waiting(self, delta: int) -> None:
        """One more (+1) or one fewer (-1) of this process's callers queued for tokens."""
        if self.waiting_off is not None:
            self.cells.fetch_add(self.waiting_off, delta & MASK64)

    def nudge_filler(self) -> None:
        """A caller did the filler's work, or needs a lease: make sure a filler runs."""
        if self.filler is not None:
            self.filler.nudge()

    # -- lifecycle -------------------------------------------------------------------------

    def _join_process(self) -> None:
        """Register this process and make its filler thread, started on first use (also after fork, in the child)."""
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
        self.filler_started = False
        self.update_fast()

    def start_filler(self) -> None:
        """This process uses the limiter: start its filler thread, once (cheap after the first call)."""
        if self.filler_started or self.filler is None or self.closed:
            return
        with self._start_lock:
            if not self.filler_started and not self.closed and self.pid == os.getpid():
                self.filler.start()
                self.filler_started = True
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
        self._start_lock = threading.Lock()  # the parent's may have been held by a thread not copied
        self._join_process()

    def detach(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.fast[:] = NO_FAST
        if self.filler is not None:
            self.filler.stop()
            if self.filler.is_alive():
                self.filler.join()
        if self.slot is not None and self.pid == os.getpid():
            self.table.unregister(self.slot, self.pid)
        self.cells.close()
        self.seg.close()


def map_attachment(
    name: str,
    create: Optional[Creation],
    mode: Optional[int],
    trusted: frozenset = frozenset(),
    join: bool = True,
    clock: Callable[[], int] = time.monotonic_ns,
) -> Attachment:
    """A new attachment to ``name`` (created with ``create`` if it does not exist), checked against ``create``.

    ``mode`` and ``trusted`` are the trust check of an existing segment (see ``open_segment``).
    """
    for _ in range(16):
        seg, cells = open_segment(name, create, mode, trusted, clock)
        att = None
        try:
            att = Attachment(name, seg, cells, join, clock)
            if not _still_ready(att):
                continue  # a collector took it while we registered: open the name again
            check_matches(name, att, create)
        except BaseException:
            if att is not None:
                att.detach()
            else:
                cells.close()
                seg.close()
            raise
        return att
    raise SegmentError(f"could not create or open limiter {name!r}: it kept being collected")


def _still_ready(att: Attachment) -> bool:
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
    att = map_attachment(name, None, None, join=False)  # no trust check: it only unlinks, as the filesystem allows
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
                unlink_name(name)
            except LimiterNotFoundError:
                return False
            return True
        return False
    finally:
        att.detach()


def check_matches(name: str, att: Attachment, create: Optional[Creation]) -> None:
    """A creating call must find the segment with its config and its upstream (any other: a mismatch).

    A call that configured the upstream then feeds with its own (``configure_upstream``).
    """
    if create is None:
        return
    b = att.bucket
    b.refresh()  # another process may have changed it since this one last looked
    if b.config != create.config:
        raise ConfigMismatchError(name, b.config.describe(), create.config.describe())
    check_upstream(name, att, create.upstream)


def check_upstream(name: str, att: Attachment, spec: Optional[UpstreamSpec]) -> None:
    """The segment's upstream must be ``spec``; this process then feeds with ``spec`` (its secrets)."""
    if att.upstream != spec:
        raise ConfigMismatchError(name, f"upstream {show(att.upstream)}", f"upstream {show(spec)}")
    if spec is not None:
        att.configure_upstream(spec)


def show(spec: Optional[UpstreamSpec]) -> str:
    return "none" if spec is None else spec.describe()


# ---- the registry: one attachment per name per process -------------------------------------

_registry: Registry[Attachment] = Registry(after_fork=lambda att: att.after_fork_in_child())


def open_attachment(
    name: str,
    create: Optional[Creation],
    mode: int,
    trusted: frozenset = frozenset(),
    clock: Callable[[], int] = time.monotonic_ns,
) -> Attachment:
    """This process's attachment to ``name`` (made on first use), with one more handle counted."""

    def check(att: Attachment) -> None:
        if clock is not att.clock:
            raise ValueError(f"limiter {name!r} is attached in this process with another clock")
        # vetted when this process first opened it, but perhaps under a wider trust than this call's
        check_trust(name, _owner_stat(att.seg), mode, trusted)
        check_matches(name, att, create)

    return _registry.open(name, lambda: map_attachment(name, create, mode, trusted, clock=clock), check)


def release(att: Attachment, detach: bool) -> None:
    """Drop one handle (see ``Registry.release``)."""
    _registry.release(att, detach)


def _owner_stat(seg: Segment) -> os.stat_result:
    """The owner and mode a segment had when this process opened it, in ``os.stat_result`` form."""
    return os.stat_result((seg.mode, 0, 0, 0, seg.owner, 0, seg.size, 0, 0, 0))
