"""One process's attachment to one limiter: the mapping, its process slot, its filler thread.

Every ``Limiter`` handle for a name in a process shares one ``Attachment``
(the registry here), so a process registers once in the process table and
runs one filler thread per limiter however many handles it makes.  After
``fork``, a hook forgets any lease the parent held; the child registers in a
slot of its own only on its first use of the limiter (a child that never uses
it is never listed), and a process's filler thread starts on its first use
too (never at open or fork, so a pre-fork master runs none); at exit, every attachment
detaches (its slot is given back and a held lease dropped, so a successor
fills at once).

The attachment owns this process's words of the process table: the grants
counter it adds to (``count``), the WAITING count of its queued callers
(``waiting``) and the records of its waiters' tickets (``record_ticket``), and
the ticket ranges this process gives back (``give_back``, see ``giveback``).
Everything else goes through the bucket.
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable, Optional, Sequence, Tuple, Union

from shmlimit.acquire.sleep import SLACK_NS, wake_waiters
from shmlimit.adapt import describe as describe_adapt
from shmlimit.adapt import expected
from shmlimit.adapt import read as read_adapt
from shmlimit.adapt import write as write_adapt
from shmlimit.bucket.filler import FillerThread, Lease, takeover_ns
from shmlimit.bucket.giveback import (
    REAP_EVERY,
    Records,
    Returns,
    ReturnsThread,
    Writers,
    clear,
    interrupted,
    keep_on_leave,
    mark_given,
    reap,
    record,
    take_over,
)
from shmlimit.bucket.rovers import WAIT_BURN, WAIT_NUDGE, Bucket, GrabResult
from shmlimit.config import MAX_NAP, NS_PER_S
from shmlimit.errors import ConfigMismatchError, naming
from shmlimit.header import Creation, open_segment
from shmlimit.redis.spec import UpstreamSpec
from shmlimit.registry import Attached, Registry, attach
from shmlimit.shm import inflight
from shmlimit.shm import layout as L
from shmlimit.shm.banks import CONFIG_LOCK_TIMEOUT_NS, ConfigLock
from shmlimit.shm.cells import MASK64, Cells, multi_gate
from shmlimit.shm.segment import (
    Segment,
    claim_and_unlink,
    validate_name,
)
from shmlimit.shm.table import (
    OwnerWatch,
    table_slots,
)
from shmlimit.shm.words import plain_seconds

_INF = float("inf")


def _no_fast() -> GrabResult:
    return False


def _undecided(
    timeout: object = None,
) -> None:  # a try's and a timed acquire's: the slow path decides
    return None


def _fed_within(grab: Callable[[], GrabResult]) -> Callable[[object], Union[bool, int, None]]:
    """Hierarchical mode's timed acquire of one op: the untimed grab, whose ticket the caller waits for
    until its deadline (``wait_for_ticket``) and gives back then.  No wait is computable there (tokens
    come with leases), so none is refused up front; a timeout of 0 or not a plain number: undecided
    (the slow path: a refusal there is demand the filler must see)."""

    def within(timeout: object) -> Union[bool, int, None]:
        t = plain_seconds(timeout)
        if not t:
            return None
        ticket = grab()
        if ticket is None:
            return True
        return None if ticket is False else ticket  # type: ignore[return-value]

    return within


class OnClock:
    """A gate's call on an injected clock: each call passes the clock's reading as its last
    argument (``now_ns``), so the gate judges a refusal at that instant.  A certain refusal then
    does what the slow path's refusal does at that instant (``refused``, given the call's
    arguments): a replenish.  On the real clock a filler keeps REPL_TS and the clamp's snapshot
    near now; nothing keeps an injected clock's pace but its callers, and after refusals that
    skipped it, a replenish would clamp against a snapshot from before the drain (adding nothing
    for the whole time since)."""

    __slots__ = ("call", "clock", "refused")

    def __init__(
        self, call: Callable[..., Any], clock: Callable[[], int], refused: Callable[..., Any]
    ) -> None:
        self.call = call
        self.clock = clock
        self.refused = refused

    def __call__(self, *args: object) -> Any:
        got = self.call(*args, self.clock())
        if got is False:
            self.refused(*args)
        return got


def on_clock(
    call: Callable[..., Any], clock: Callable[[], int], refused: Callable[..., Any]
) -> Callable[..., Any]:
    """``call`` (a gate's method, whose last argument ``now_ns`` is optional) on ``clock``, its
    certain refusals followed by ``refused`` (the slow path's replenish).  The real clock needs
    neither: the gate reads it itself, and the filler replenishes."""
    return call if clock is time.monotonic_ns else OnClock(call, clock, refused)


class FastPaths:
    """An attachment's fast paths for the config in force, shared by reference with every handle
    and rebound in place (``bind``) when the config changes.  ``grab``: one op, untimed (a
    grabber, or the native ``Acquirer``; ``_no_fast``: none); ``try_now``: a try of one op;
    ``within``: one op within a timeout (seconds); ``waiter``: a ticket's whole wait in one native
    call (None: waiters wait in Python).  A grab made for an older config answers False, touching
    nothing; a try or a timed grab that cannot decide answers None (the slow path decides).
    Slots, not a tuple: an attribute read costs what a list index did on the hot path."""

    __slots__ = ("grab", "try_now", "within", "waiter")

    def __init__(self) -> None:
        self.clear()

    def bind(
        self,
        grab: Callable[..., Any],
        try_now: Callable[..., Any],
        within: Callable[..., Any],
        waiter: Any,
    ) -> None:
        self.grab, self.try_now, self.within, self.waiter = grab, try_now, within, waiter

    def clear(self) -> None:
        """No fast path: every call takes the slow path."""
        self.bind(_no_fast, _undecided, _undecided, None)


class Mode:
    """What the config in force means for every call, decided once when it is bound
    (``update_fast``, ``Attachment.mode``) instead of tested flag by flag on each.  This one
    admits every request at once (not capped); ``Capped`` admits against the ops in flight."""

    __slots__ = (
        "upstream",
        "leases",
        "clocked",
        "stopped",
        "joins",
        "real_clock",
        "fed_wake",
        "grabs",
        "gates",
    )

    def __init__(self, snap: Any, real_clock: bool) -> None:
        #: hierarchical mode: a refused try is demand the filler must see; no reserve
        self.upstream: bool = snap.upstream
        #: tokens come with leases, not with time: no wait is computable, and a timed request
        #: holds its ticket until its deadline
        self.leases: bool = snap.upstream and not snap.time_fed
        #: a ticket's due time follows from the rate (time-fed and running)
        self.clocked: bool = snap.time_fed and not snap.stopped
        #: stopped: nothing is added; a wait is not computable
        self.stopped: bool = snap.stopped
        #: ``max_reserved``: an untimed request joins only a queue short enough
        self.joins: bool = snap.max_reserved_ns != _INF
        #: the attachment reads CLOCK_MONOTONIC (not an injected clock): native sleeps may be used
        self.real_clock = real_clock
        #: a leased waiter sleeps on the wake word (``fed_wait``; it reads the real clock)
        self.fed_wake: bool = self.leases and real_clock
        #: an untimed grab of one op may be bound (capped, joining and open decide in Python)
        self.grabs: bool = not (self.joins or snap.open or snap.capped)
        #: a gate's try and timed grab may be bound (a wait is computable, nothing to admit)
        self.gates: bool = not (snap.upstream or snap.stopped or snap.capped or snap.config is None)

    def admit(self, bucket: Bucket, ops: int) -> bool:
        """Take a place for ``ops`` among the ops in flight, if the mode bounds them."""
        return True

    def unadmit(self, bucket: Bucket, ops: int) -> None:
        """Give back what ``admit`` took."""


class Capped(Mode):
    """Capped release: every grant first takes a place among the ops in flight."""

    __slots__ = ()

    def admit(self, bucket: Bucket, ops: int) -> bool:
        return bucket.admit(ops)

    def unadmit(self, bucket: Bucket, ops: int) -> None:
        bucket.unadmit(ops)


class Attachment(Attached):
    """One process's mapping of one limiter segment (shared by all its Limiter handles).

    ``clock`` (CLOCK_MONOTONIC ns) is the one clock of this attachment: its
    bucket, its requests' deadlines and its filler's feed all read it, so a
    test can drive every schedule with a fake one.
    """

    def __init__(
        self,
        name: str,
        seg: Segment,
        cells: Cells,
        clock: Callable[[], int] = time.monotonic_ns,
        trusted: frozenset = frozenset(),
    ) -> None:
        with naming(name):
            slots = table_slots(cells)
        super().__init__(name, seg, cells, slots)
        self.clock = clock
        #: the uids this process's handles trust besides itself and root (``trusted_uids``): a
        #: segment made beside this one for its handles (an HTTP client's pause table) trusts them
        self.trusted = trusted
        with naming(name):  # (its config's words and its upstream's, read without a name)
            self.bucket = Bucket(cells, clock)
            #: hierarchical mode: the upstream as the segment describes it (no secrets; shown, compared)
            self.upstream = UpstreamSpec.read(cells) if self.bucket.upstream else None
        self.bucket.inflights = tuple(
            L.inflight_offset(self.table.slots, i) for i in range(self.table.slots)
        )
        #: ... and as this process configured it itself (with its secrets): only then does it feed
        self.feed_spec: Optional[UpstreamSpec] = None
        self.filler: Optional[FillerThread] = None
        #: the ticket ranges this process gave back, and the thread that skips them (started at the first)
        self.returns = Returns(self.bucket, lambda: wake_waiters(self.cells))
        #: the slot owners the reap looks at, each watched through a pidfd (closed on detach)
        self.owners = OwnerWatch()
        self._returns_thread: Optional[ReturnsThread] = None
        #: the ticket records of this process's slot (none while it has no slot), and its threads writing them
        self.records: Records = ()
        self.writers = Writers(lambda: self.records, self.cells)
        # A grabber does one grab_if priced under the config it was made for; the try and the
        # timed grab are a Gate's methods (see composites.Gate)
        self.fast = FastPaths()
        self.bind()  # unregistered (see Attached): its fast paths bound (``update_fast``)

    def update_fast(self) -> None:
        s = self.bucket.snap  # one snapshot: the grabber's seq and price always belong together
        self.fast_seq = s.seq
        # every ticket a fast path hands out is recorded in one of this process's records (none:
        # beyond the table, it never queues), so a ticket is never queued unrecorded (see giveback)
        recs = self.rec_lens
        real_clock = self.clock is time.monotonic_ns
        #: the mode of the config the fast paths were bound for (``fast_seq``)
        self.mode = mode = (Capped if s.capped else Mode)(s, real_clock)
        # not in use yet: the slow path's first call is the use that registers and starts
        live = self.in_use and not self.closed
        grab: Callable[..., Any] = _no_fast
        if live and mode.grabs:
            grab = self.bucket.grabber(s, self.grants_off, recs)
        # tries and timed acquires: not in hierarchical mode (a refusal there is demand the filler
        # must see, and a timed acquire polls), nor while stopped (no wait is computable), nor
        # capped (every grant must be admitted against the in-flight bound first).  The gate's
        # certain refusal counts the time since REPL_TS: on an injected clock, up to its reading
        # (on_clock), never the real clock's (REPL_TS written by a clock ahead of the real one
        # would look like no time at all)
        try_now: Callable[..., Any] = _undecided
        within: Callable[..., Any] = _undecided
        if live and mode.gates:
            gate = self.bucket.gate(s, self.grants_off, 1, recs)
            # a refusal: what a try refused on the slow path does (``take_now``), a refill
            try_now = on_clock(gate.try_grab, self.clock, self.refill)
            within = on_clock(gate.grab_within, self.clock, self._refused_within)
        if grab is not _no_fast and mode.fed_wake and not mode.stopped:
            within = _fed_within(grab)
        # a ticket's whole wait in one native call, for the configs it handles (Bucket.waiter); it
        # reads the real clock, so an attachment with an injected clock waits in Python
        waiter = (
            None
            if self.closed or not real_clock
            else self.bucket.waiter(s, self.grants_off, self.waiting_off, SLACK_NS)
        )
        if hasattr(
            waiter, "takeover_ns"
        ):  # may this process take a lapsed filler lease? (filler.takeover_ns)
            waiter.takeover_ns = takeover_ns(self.filler)
        if recs and grab is not _no_fast and hasattr(waiter, "acquirer"):
            # an untimed acquire of one op as one native call: the grab (record claimed before its
            # CAS, LEN stored after), the wait, the record freed at the grant (wait_for_ticket's steps)
            grab = waiter.acquirer(grab, interrupted(self), int(MAX_NAP * NS_PER_S))
        self.fast.bind(grab, try_now, within, waiter)

    def mode_now(self) -> Mode:
        """The mode of the config the bucket holds now (bound afresh if it changed)."""
        if self.fast_seq != self.bucket.seq:
            self.update_fast()
        return self.mode

    def refill(self) -> int:
        """``Bucket.replenish`` by a caller, doing the filler's work: as one native call where the
        native wait has one for the config in force (its refill, word for word; one call leaves no
        gap between claiming an interval and adding its tokens: a Python refill preempted there,
        while other processes refill, finds its add clamped against theirs and loses its time),
        and the filler nudged when it added (make sure one runs).  The tokens added."""
        b = self.bucket
        waiter = self.fast.waiter if self.fast_seq == b.seq else None
        if waiter is None:
            added = b.replenish()
        else:
            added, burn = waiter.refill()
            if burn:
                self.after_native_wait(WAIT_BURN)
        if added > 0:
            self.nudge_filler()
        return added

    def _refused_within(self, timeout: object) -> None:
        """What a timed acquire refused on the slow path did (``take_ticket``): a replenish."""
        self.bucket.replenish()

    # -- this process's words ------------------------------------------------------------

    def count(self, ops: int) -> None:
        """Count ``ops`` granted to this process (in its slot, or with the unregistered)."""
        self.cells.fetch_add(self.grants_off, ops)

    def waiting(self, delta: int) -> None:
        """One more (+1) or one fewer (-1) of this process's callers queued for tokens."""
        if self.waiting_off is not None:
            self.cells.fetch_add(self.waiting_off, delta & MASK64)

    @property
    def rec_lens(self) -> tuple:
        """The LEN offsets of this process's ticket records (none while it has no slot)."""
        return tuple(len_off for _, len_off in self.records)

    def find_record(self, ticket: int) -> Tuple[Optional[int], int]:
        """The record a grab of this process made of ``ticket`` (its LEN offset, None if there is
        none) and the exact tokens it took (0: not known).  Tickets end where no other range ends
        (the tail never moves backwards), so the record whose TICKET is ``ticket`` is this one."""
        c = self.cells
        for end_off, len_off in self.records:
            if c.load(end_off) == ticket:
                v = c.load(len_off)
                if v and not v & (L.TICKET_BUSY | L.TICKET_GIVEN) and c.load(end_off) == ticket:
                    return len_off, v
        return None, 0

    def record_ticket(self, ticket: int, tokens: int, given: bool = False) -> Optional[int]:
        """Record a waiter's ticket in a free record of this process's slot, to be given back should
        the process die (``given``: given back already); the record's LEN offset (None: none was
        free, or the slot is being left: close)."""
        with self.writers.writing() as lens:
            return record(self.cells, self.records if lens else (), ticket, tokens, given=given)

    def clear_ticket(self, rec: Optional[int], tokens: int) -> None:
        """The waiter that recorded its ticket at ``rec`` leaves, granted."""
        clear(self.cells, rec, tokens)

    def give_back(self, ticket: int, tokens: int, rec: Optional[int] = None) -> None:
        """A waiter leaves before its turn: the head will skip its range (see ``giveback``).

        The range stays recorded in the slot (its waiter's record, ``rec``,
        marked given; else a free one), so that it is still skipped should
        this process exit or die before the head gets there.  A ticket queued
        unrecorded (every record in use) and given back while none is free is
        held in no record, as it was: killed first, it costs its schedule, once.
        """
        if not mark_given(self.cells, rec, tokens):
            rec = self.record_ticket(ticket, tokens, given=True)
        self.returns.give_back(ticket, tokens, rec)
        if (
            self.returns.step() is not None
        ):  # at once if the head is there already, else when it gets there
            self._skipper()

    def adopt(self, ticket: int, tokens: int, take: Callable[[], bool]) -> bool:
        """Skip a range another process gave back or left recorded (``reap``): recorded in this
        process's slot, marked given, before it is taken from where it was found, so that should
        this process die or leave first, the next filler finds it (``Returns.adopt``)."""
        return self.returns.adopt(ticket, tokens, take, self.records)

    def reap(self) -> int:
        """Give back the tickets recorded by dead processes; return how many (the filler's chore).
        Capped mode: release the ops in flight of processes gone holding them, too (``inflight``)."""
        if self.bucket.capped:  # (each pass polls the owners' descriptors once: OwnerWatch.round)
            inflight.reap(self.cells, self.table, self.owners.round())
        found = reap(self.cells, self.table, self.adopt, self.owners.round())
        if found:
            self._skipper()
        return found

    def _skipper(self) -> None:
        t = self._returns_thread
        # a process that runs threads for this limiter (its filler; or it is beyond the table)
        if (
            self.joined
            and not self.closed
            and (self.filler is not None or self.slot is None)
            and (t is None or not t.is_alive())
        ):
            self._returns_thread = t = ReturnsThread(self.returns, self.name)
            t.start()

    def after_native_wait(self, rc: int) -> None:
        """What a native wait's flags ask of Python: nudge the filler, burn to the capacity in force."""
        if rc & WAIT_NUDGE:
            self.nudge_filler()  # we did the filler's work and the lease lapsed: make sure a filler runs
        if rc & WAIT_BURN:  # our add raced a config change: the config in force applies to it
            self.bucket.burn_late_add()

    def nudge_filler(self) -> None:
        """A caller did the filler's work, or needs a lease: make sure a filler runs."""
        if self.filler is not None:
            self.filler.nudge()

    # -- lifecycle -------------------------------------------------------------------------

    def bind(self) -> None:
        """This process's words of its slot and its filler thread (started by ``use``); none
        while it has no slot (the unregistered's grants word)."""
        self.records = ()
        self.lease, self.filler, self.waiting_off = None, None, None
        self.bucket.own_inflight = None
        self.grants_off = L.UNREG_GRANTS
        if self.slot is not None:
            base = L.slot_offset(self.slot)
            self.grants_off = base + L.SLOT_GRANTS
            self.waiting_off = base + L.SLOT_WAITING
            self.records = L.ticket_records(self.table.slots, self.slot)
            inflight.take_over(
                self.cells, self.table.slots, self.slot
            )  # a predecessor's ops in flight
            self.bucket.own_inflight = L.inflight_offset(self.table.slots, self.slot)
            # a predecessor's tickets: skipped from this process's first use on (``start``)
            take_over(self.cells, self.records, self.returns.give_back)
            self.lease = Lease(self.cells, self.slot)
            self.filler = FillerThread(
                self.bucket,
                self.lease,
                self.name,
                self._feed(),
                self._chore,
            )
        self.update_fast()

    def start(self) -> None:
        """This process's first use: its filler thread, and its skipper when it holds ranges
        given back already (its slot's predecessor's, ``bind``).  Nothing waits for a filler:
        waiters replenish themselves."""
        f = self.filler
        if f is not None and not f.is_alive():
            if f.ident is not None:  # started once and ended: a start cut short (a signal)
                f = self.filler = FillerThread(f.bucket, f.lease, self.name, self._feed(), f.chore)
            f.start()
        if self.returns.pending():
            self._skipper()

    def use(self) -> None:
        """This process uses the limiter (``Attached.use``, raising as it does): its fast paths
        are bound for a process in use."""
        super().use()
        self.update_fast()

    def _unregister(self) -> None:
        # the ranges it gave back stay recorded in the slot; at close its waiters' too, given
        if self.slot is not None and self.pid == os.getpid():
            keep_on_leave(self.cells, self.records, self.returns, self.closed)
        super()._unregister()

    def _chore(self) -> float:
        """What the elected filler does now and then: give back dead processes' tickets."""
        self.reap()
        return REAP_EVERY

    def _feed(self) -> Any:
        if self.feed_spec is None:
            return None
        from shmlimit.redis.feeder import (
            feed_for,  # the Redis tier: only processes that configured it get here
        )

        return feed_for(self.feed_spec)

    def opened(self) -> bool:
        """The "open" fallback is in force *and* this process asked for it.  A process that did not
        configure the upstream (it attached by name) never lets calls through on the segment's word:
        for it, the open fallback is closed.  Call after ``bucket.refresh()``."""
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
                self.update_fast()  # its waiters take a lapsed lease from now on (filler.takeover_ns)

    def shut(self) -> None:
        """Close's part on the shared words: nothing of this process is granted any more (``closed``,
        its fast paths unbound, its threads stopped, its native waits out of their loops), and its
        slot is left with every range it holds still recorded, its waiters' tickets given back."""
        self.closed = True
        self.fast.clear()
        if self.filler is not None:
            self.filler.stop()
            if self.filler.is_alive():
                self.filler.join()
        if self._returns_thread is not None:
            self._returns_thread.stop()
        self.cells.leave_waiters()  # no waiter of ours is granted now: its queued ticket may be given back
        self.writers.settle()  # a grab of another thread between its record's claim and length store ends first
        super().shut()
        self.records = ()

    def after_fork_in_child(self) -> None:
        # The parent's filler thread does not exist here, its lease and its slot are the parent's:
        # the child holds the mapping only, and registers on its first use.
        if self.lease is not None:
            self.lease.forget()
        # the parent skips the ranges it gave back; the child starts afresh (its lock may be held)
        self.returns = Returns(self.bucket, lambda: wake_waiters(self.cells))
        self._returns_thread = None
        self.writers = Writers(
            lambda: self.records, self.cells
        )  # (the parent's threads are not here)
        self.owners = self.owners.forked()  # the parent's pidfds, closed here; its lock may be held
        super().after_fork_in_child()

    def detach(self) -> None:
        if self.closed or self.writers.defer(
            self.detach
        ):  # (inside its own thread's record write: after it)
            self.fast.clear()
            return
        super().detach()
        self.owners.close()


def gate_all(atts: Sequence[Attachment], names: Optional[Sequence[str]] = None) -> Any:
    """One try over several rates' attachments, all or nothing, in one call, bound to their
    configs in force (``composites.MultiGate``; native when every rate's cells are), or None when
    any rate is stopped, leased from upstream or capped (their grants need more than a try).
    ``try_grab()`` takes one op from each, ``try_grab_ops(ops)`` ops per rate (a tuple, one int,
    or a dict by ``names``), each counted in the rate's grants word once all have granted.  A
    certain refusal is judged on the rates' clock (an injected one's reading passed as ``now_ns``:
    ``on_clock``); when the rates have different clocks, the slow path judges."""
    snaps = []
    for att in atts:
        att.bucket.refresh()
        mode = att.mode_now()
        s = att.bucket.snap
        if not mode.gates or s.cap < s.cost:
            return None
        snaps.append(s)
    gates = [att.bucket.gate(s, att.grants_off, 1) for att, s in zip(atts, snaps)]
    decide = all(att.clock is atts[0].clock for att in atts)
    return multi_gate(gates, [s.cap for s in snaps], decide, names)


def map_attachment(
    name: str,
    create: Optional[Creation],
    mode: Optional[int],
    trusted: frozenset = frozenset(),
    join: bool = True,
    clock: Callable[[], int] = time.monotonic_ns,
    reconfigure: bool = False,
    opener: Optional[Callable[[], Tuple[Segment, Cells]]] = None,
) -> Attachment:
    """A new attachment to ``name`` (created with ``create`` if it does not exist), checked against ``create``.

    ``mode`` and ``trusted`` are the trust check of an existing segment (see ``open_segment``).
    An existing segment takes ``create``'s config if no live process uses it, or if ``reconfigure``.
    ``opener`` maps something else than the segment ``name`` (a rate's region of a group, whose
    ``name`` then only labels it).
    """

    def make() -> Attachment:
        seg, cells = (
            open_segment(name, create, mode, trusted, clock) if opener is None else opener()
        )
        try:
            return Attachment(name, seg, cells, clock, trusted)
        except BaseException:
            cells.close()
            seg.close()
            raise

    def adopt(att: Attachment) -> None:
        if create is not None and not att.created:
            with naming(name):  # (its adaptive rate's words, read without a name)
                adopt_config(att, create, reconfigure)

    return attach(name, make, adopt, lambda att: check_matches(name, att, create), join)


def collect(name: str) -> bool:
    """Unlink the limiter's segment if no live process is attached to it; True if it did.

    Never orphans a process that attaches meanwhile (see ``registry.attach``).  The other kinds
    have their own (``group.collect``, ``keyed.segment.collect``); ``kinds.collect`` serves
    every kind.
    """
    validate_name(name)
    att = map_attachment(
        name, None, None, join=False
    )  # no trust check: it only unlinks, as the filesystem allows
    try:
        return claim_and_unlink(name, att.seg.inode, [att.table])
    finally:
        att.detach()


def adopt_config(att: Attachment, create: Creation, reconfigure: bool) -> None:
    """Publish ``create``'s config (as ``set_rate`` does) if it differs and no live process uses the segment.

    A redeploy with a changed rate boots: the old fleet is gone (its dead
    entries do not count), so the new config is nobody's surprise.  With live
    processes only ``reconfigure`` applies it (fleet-wide); otherwise the
    mismatch is reported by ``check_matches``.  Called before this process
    registers, so workers of one deploy opening together each see no live
    user and all publish the same config, instead of each seeing the other
    and refusing (``Attached.may_adopt``).  The upstream is never changed here.
    """
    b = att.bucket
    b.refresh()
    if b.config is None or b.config.capped != create.config.capped:
        return  # capped is fixed at creation: that mismatch stays one
    want = expected(create.config, create.adapt, att.cells, b.config)
    if b.config == want and read_adapt(att.cells) == create.adapt:
        return
    idle = att.may_adopt(False)
    if reconfigure or idle:
        if not idle:
            b.check_price(b.config, want)
        lock = ConfigLock(att.cells, L.CFG_SEQ, CONFIG_LOCK_TIMEOUT_NS, "adaptive rate")
        write_adapt(att.cells, create.adapt, lock=lock)  # (a rate learned is kept: ``expected``)
        if b.config != want:
            old = b.config
            b.publish(want)
            if b.upstream and old.cost_at(b.tpn) != want.cost_at(b.tpn):
                b.burn()  # no one uses it: its tokens were leased at the old price (check_price)
        att.update_fast()


def check_matches(name: str, att: Attachment, create: Optional[Creation]) -> None:
    """A creating call must find the segment with its config and its upstream (any other: a mismatch).

    A call that configured the upstream then feeds with its own (``configure_upstream``).
    """
    if create is None:
        return
    b = att.bucket
    with naming(name):  # (its config's and adaptive rate's words, read without a name)
        b.refresh()  # another process may have changed it since this one last looked
        have = read_adapt(att.cells)
    if have != create.adapt:
        raise ConfigMismatchError(
            name, describe_adapt(have), describe_adapt(create.adapt), live=True, settable=False
        )
    if b.config != expected(create.config, create.adapt, att.cells, b.config):
        raise ConfigMismatchError(name, b.config.describe(), create.config.describe(), live=True)
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

registry: Registry[Attachment] = Registry()


def open_attachment(
    name: str,
    create: Optional[Creation],
    mode: int,
    trusted: frozenset = frozenset(),
    clock: Callable[[], int] = time.monotonic_ns,
    reconfigure: bool = False,
    opener: Optional[Callable[[], Tuple[Segment, Cells]]] = None,
) -> Attachment:
    """This process's attachment to ``name`` (made on first use), with one more handle counted.

    With ``opener`` (a rate of a group), ``name`` is the rate's label (``group[key]``)."""

    def check(att: Attachment) -> None:
        if clock is not att.clock:
            raise ValueError(f"limiter {name!r} is attached in this process with another clock")
        if (
            reconfigure and create is not None
        ):  # this process uses it: only an explicit reconfigure applies
            adopt_config(att, create, True)
        check_matches(name, att, create)
        att.trusted |= trusted  # a handle opened under a wider trust: vetted under it just now

    return registry.open(
        name,
        lambda: map_attachment(
            name, create, mode, trusted, clock=clock, reconfigure=reconfigure, opener=opener
        ),
        check,
        mode,
        trusted,
    )


#: Drop one handle (see ``Registry.release``).
release = registry.release
