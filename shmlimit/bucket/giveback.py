"""Given-back tickets: the schedule of a waiter that leaves before its turn goes to those behind it.

A waiter holds a ticket: the range ``[ticket - tokens, ticket)`` of the rovers.
Left queued when its waiter is gone -- interrupted (KeyboardInterrupt),
cancelled (asyncio, ``wait_for``), its process killed -- the range would hold
everyone behind it for its whole schedule.  It is given back instead:

* **by the process itself** on cancel or interrupt: ``Request.end`` hands the
  range to its attachment's ``Returns``;
* **by the filler for a dead process**: each waiter records its range in one
  of its process slot's records (``layout.ticket_records``: five per slot,
  the first free one) while it waits; the elected filler looks at the
  records every ``REAP_EVERY`` seconds, and one whose owner is dead has its
  range given back (``reap``); a process that takes over a slot first gives
  back what it finds recorded there (``take_over``).  The CAS of the
  record's length to 0 decides it: only a dead owner's record can be taken,
  once, and only once the range is recorded in the taker's slot too
  (``Returns.adopt``; with none free there, the range is skipped where it is
  once the head reaches it): no range is ever held in no record.
* **after its process is gone**: a range given back stays recorded (marked
  ``TICKET_GIVEN``) until the head has skipped it, and a close keeps such
  records and marks its waiters' ones given (``keep_on_leave``: once none of
  its waiters can be granted), so a process that exits or closes before the
  head reaches a range it gave back, or under a waiter still queued, leaves
  the range to the next filler's ``reap``.

Giving back never moves the tail, which never moves backwards (so no range is
ever handed out twice, and the replenish snapshots stay lower bounds: moving
the tail back could let the bucket hold more than its capacity).  The head
*skips* the range instead (``skip``): once it has reached the range's
start -- every ticket ahead of it served -- one CAS moves it to the range's
end.  The skip grants no one, leaves nothing available, and loses the tokens
that reached the range before it (lost time, never a grant): in any window
the grants are what they would have been had the range never been taken, less
that time, so the window bound ``rate*T + capacity`` holds.  Nothing is put
back into the bucket.

A range is skipped by whoever holds it, when the head reaches its start (its
record, if any, is then freed): a daemon thread of the process
(``ReturnsThread``, started at the first range given back) sleeps until that
instant (``Bucket.due_ns``), replenishes, and skips.  The owner of a range given back never waits on it again (it left, or
it is dead), so no one is ever granted from it.

Not given back: a ``reserve()``.  A reservation is a grant for later, not a
waiter: it is counted as granted when made, and its holder may use it
whether or not its process still runs (the HTTP integrations push a pause
into the schedule this way).  Until it is made, though, a reservation over
several rates holds its claims as waiters' tickets (recorded), and gives them
back if refused part-way, interrupted or killed (``multirate_request.claim``).
"""

from __future__ import annotations

import functools
import itertools
import threading
import weakref
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterator, List, Optional, Tuple, Union

from shmlimit.bucket.rovers import NO_RECORD, REFUSED, diff
from shmlimit.config import MAX_SPAN_TOKENS
from shmlimit.shm import layout as L
from shmlimit.shm.cells import MASK64, claim_record
from shmlimit.shm.table import slot_alive
from shmlimit.shm.words import recorded_ranges

if TYPE_CHECKING:  # pragma: no cover
    from shmlimit.bucket.rovers import Bucket
    from shmlimit.shm.cells import Cells
    from shmlimit.shm.table import ProcessTable

#: A slot's records: (TICKET, TICKET_LEN) offsets (``layout.ticket_records``).
Records = Tuple[Tuple[int, int], ...]
#: Takes a range found recorded -- its end, its tokens, and ``take``: the CAS that frees the record it
#: was found in (True once) -- to give it back; True if it did (``Returns.adopt``: it then took it).
Give = Callable[[int, int, Callable[[], bool]], Any]

#: The filler looks for dead processes' recorded tickets this often (seconds).
REAP_EVERY = 0.1
#: A range whose start is not due at a known time (hierarchical mode) is looked at this often (s) ...
LOOK_EVERY = 0.005
#: ... one due later (or while stopped) at least this often, to notice changes, as a waiter does (s) ...
LOOK_AT_LEAST = 0.25
#: ... and one due now (another process's replenish in flight) again after this long (seconds).
RETRY = 20e-6
_INF = float("inf")


# ---- the skip ------------------------------------------------------------------------------------


def skip(b: "Bucket", start: int, end: int) -> Optional[int]:
    """Give back ``[start, end)``, the range of a ticket nobody will be granted: the head skips it.

    Returns None while the head is still before ``start`` (the tickets
    ahead are not yet served: try again when it gets there); else the
    tokens skipped, 0 when there is nothing to do (the head passed
    ``end`` already, or the range is not in the queue: a corrupt record).

    Invariant: the head moves by a skip only from inside a given-back
    range to its end, and that end is within the queue (``end <= TAIL``):
    every ticket before ``start`` is covered already and every ticket at
    or after ``end`` stays exactly as uncovered as before, so the skip
    grants no one; afterwards ``HEAD <= TAIL``, nothing is available.
    (The tail never moves backwards, so a range once handed out is never
    handed out again: a given-back range stays nobody's.)
    The tokens that had reached the range before the skip (since the last
    replenish, at most) are lost, never passed on: carried over, they would
    cover the tickets behind it all at once, a burst above the capacity.
    In any window the grants are thus what they would have been had the
    range never been taken, less that lost time: the window bound holds.
    The skip then replenishes, leaving a snapshot of the head past the
    range: the next replenish clamps against it, not against a head before
    the range, which would make it add nothing (a whole interval lost).
    Tickets' ranges never overlap, so a range another record holds part of
    (``overlapped``) is corrupt, hostile or not: 0, not skipped (the head
    crosses it at the rate: its time lost), never a queued waiter granted.
    """
    head = b.cells.load(L.HEAD)
    if diff(head, start) >= 0 and diff(head, end) < 0 and overlapped(b, start, end):
        return 0
    return b.skip(start, end)


def overlapped(b: "Bucket", start: int, end: int) -> bool:
    """Some ticket record holds a range overlapping ``[start, end)`` other than that range itself
    (its own record, or a copy of it: an adopted range is recorded twice).  Read only when a skip
    is due (the head inside the range): one ``load_many`` of every record's length."""
    tokens = diff(end, start)
    return any(
        not (e == end and n == tokens) and diff(e, start) > 0 and diff(end, s) > 0
        for s, e, n in recorded_ranges(b.cells, b._record_lens())
    )


# ---- the records in the process slot -------------------------------------------------------------


#: ``close`` waits at most this long (seconds) for the record writes of its process's other threads.
SETTLE_MAX = 1.0


class Writers:
    """The threads of this process writing its slot's ticket records now (a grab between its
    record's claim and its length store, a range recorded as given), so that leaving the slot
    waits for them: a write that ended after the slot was left would land in a slot nobody owns
    or in another process's (see ``settle``)."""

    def __init__(self, records: Callable[[], Records], cells: Any = None) -> None:
        self._records = records
        # this thread inside a grab bound to the records, and the hook run when it ends: the atomics
        # backend's own (its grab is Python; the native grab runs no Python inside: not in Cells)
        self._here: Callable[[], bool] = getattr(cells, "_recording_here", lambda: False)
        if hasattr(cells, "_after_recording"):
            cells._after_recording = self.ended
        self._cv = threading.Condition()
        self._held: Dict[int, int] = {}  # thread ident -> writes it has under way
        self.shut = False
        self._deferred: Tuple[int, Optional[Callable[[], None]]] = (0, None)

    def mine(self) -> bool:
        """Whether this thread is inside its own write of the records (its grab between a record's
        claim and its length store): a close run by a signal handler that interrupted it."""
        with self._cv:
            return threading.get_ident() in self._held or self._here()

    def defer(self, leave: Callable[[], None]) -> bool:
        """Run on a thread inside its own write of the records (``mine``), a close can neither
        wait for that write (it waits for the close) nor leave the slot under it (the record
        would be written into a slot another process may take, or stay claimed for good): True,
        and ``leave`` runs on this thread when the write ends (``ended``).  Else False."""
        if not self.mine():
            return False
        self._deferred = (threading.get_ident(), leave)
        return True

    def ended(self) -> None:
        """One write of this thread ended (a ``writing`` block, a grab bound to records): the leave
        deferred by its close, if any, runs once none of its writes is under way."""
        me, leave = self._deferred
        if leave is not None and me == threading.get_ident() and not self.mine():
            self._deferred = (0, None)
            leave()

    @contextmanager
    def writing(self) -> Iterator[Tuple[int, ...]]:
        """The slot's records' LEN offsets, held for one write of them; none once ``settle`` began."""
        me = threading.get_ident()
        with self._cv:
            lens = () if self.shut else tuple(len_off for _, len_off in self._records())
            if lens:
                self._held[me] = self._held.get(me, 0) + 1
        try:
            yield lens
        finally:
            if lens:
                with self._cv:
                    left = self._held.pop(me) - 1
                    if left:
                        self._held[me] = left
                    self._cv.notify_all()
                self.ended()

    def settle(self, timeout: float = SETTLE_MAX) -> bool:
        """No write of the records begins from now on; wait until those of other threads ended
        (each is a few atomic operations; one stalled past ``timeout`` is left as it is; this
        thread has none: a close inside its own write waits for it to end, ``defer``).  True if
        none was left under way."""
        me = threading.get_ident()
        with self._cv:
            self.shut = True
            return self._cv.wait_for(lambda: not any(t != me for t in self._held), timeout)


@contextmanager
def _lens(recs: Union[Tuple[int, ...], Writers]) -> Iterator[Tuple[int, ...]]:
    if isinstance(recs, Writers):
        with recs.writing() as lens:
            yield lens
    else:
        yield recs


def take_ticket(
    b: "Bucket",
    tokens: int,
    grants: int,
    ops: int,
    recs: Union[Tuple[int, ...], Writers],
    max_wait_ns: float = _INF,
    overflow: bool = False,
) -> Tuple[Any, Optional[int]]:
    """``take_once``, and once more after a replenish that added tokens if it took nothing.  ``recs``:
    records' LEN offsets, or a process's ``Writers`` (its slot's, held for the take).

    ``overflow``: with every record in use, queue unrecorded rather than answer ``NO_RECORD``: the
    caller keeps its FIFO place and its at-once refusal, and should its process die, the ticket
    costs those behind it its own schedule (``tokens / rate``), once (see the design page)."""
    with _lens(recs) as lens:
        got = take_once(b, tokens, grants, ops, lens, max_wait_ns)
        if (got[0] is REFUSED or got[0] is NO_RECORD) and b.replenish() > 0:
            got = take_once(b, tokens, grants, ops, lens, max_wait_ns)
    if got[0] is NO_RECORD and overflow:
        got = take_once(b, tokens, grants, ops, None, max_wait_ns)
    return got


def take_once(
    b: "Bucket",
    tokens: int,
    grants: int,
    ops: int,
    recs: Optional[Tuple[int, ...]],
    max_wait_ns: float = _INF,
) -> Tuple[Any, Optional[int]]:
    """Take ``tokens`` now, or a ticket recorded in one of ``recs`` (ticket records' LEN offsets).

    Answers ``(None, None)`` granted (``ops`` added to ``grants``), ``(ticket, rec)``
    queued with the ticket recorded at ``rec`` (its exact length in tokens), or, having taken
    nothing, ``(REFUSED, None)`` when the wait would exceed a finite ``max_wait_ns`` and
    ``(NO_RECORD, None)`` when it would queue while every record is in use: one composite of
    the cells when the head covers the tokens now, else ``Bucket.take_within`` bound to the
    records (no ticket taken without a record to hold it, claimed before the CAS that takes it).
    Raises ``QueueFullError`` (taking nothing) beyond ``MAX_QUEUE_TOKENS``.
    """
    if b.try_grab(tokens, grants, ops):  # granted at once: one composite
        return None, None
    return b.take_within(tokens, max_wait_ns, recs, grants, ops)


#: A request that found its process's ticket records all in use looks again this often (seconds).
RECORD_NAP = 0.001


def record_nap(b: "Bucket", tokens: int, has_records: bool, longest: float) -> float:
    """How long a request that found no free record naps (seconds): ``RECORD_NAP`` while its process
    has records (one is freed as each of its waiters is granted); without any (beyond the table)
    until ``tokens`` could be there, the queue ahead served, within ``[RECORD_NAP, longest]``."""
    if has_records or not b.time_fed or b.stopped:
        return RECORD_NAP
    short = -b.balance() + tokens - min(b.pending(), b.cap)
    return min(longest, max(RECORD_NAP, short / b.tpn / 1e9))


def record(
    cells: "Cells", records: Records, ticket: int, tokens: int, given: bool = False
) -> Optional[int]:
    """Record ``ticket`` (``tokens`` long) in the first free one of ``records``; its LEN offset, None if none is free.

    The pair is written under ``TICKET_BUSY`` (``claim_record``, a grab's own protocol), so a
    reader never combines one ticket's end with another's length.  ``given``: a range given back (any
    process may take it once its owner is gone), not a waiter's.
    """
    if not 0 < tokens <= MAX_SPAN_TOKENS:
        return None
    rec = claim_record(cells, tuple(len_off for _, len_off in records), ticket & MASK64)
    if rec is not None:
        cells.store(rec, tokens | (L.TICKET_GIVEN if given else 0))
    return rec


def interrupted(att: Any) -> Callable[[int, int, int, int], None]:
    """What a native acquire (``_native.c``'s Acquirer) calls when a signal handler raised while
    it held a queued ticket: ``give(ticket, tokens, rec, flags)`` gives it back through ``att``
    (its record marked given) and acts on the wait's ``flags``, as ``wait_for_ticket``'s except
    clause does.  ``att`` is held weakly: the acquirer is one of its fast paths."""
    ref = weakref.ref(att)

    def give(ticket: int, tokens: int, rec: int, flags: int) -> None:
        a = ref()
        if a is not None:
            a.give_back(ticket, tokens, rec)
            a.after_native_wait(flags)

    return give


def clear(cells: "Cells", len_off: Optional[int], tokens: int) -> None:
    """The waiter that recorded its ticket at ``len_off`` leaves granted: the record is free."""
    if len_off is not None:
        cells.cas(len_off, tokens, 0)


def mark_given(cells: "Cells", len_off: Optional[int], tokens: int) -> bool:
    """The waiter that recorded its ticket at ``len_off`` gives it back: the record stays, marked given."""
    return len_off is not None and cells.cas(len_off, tokens, tokens | L.TICKET_GIVEN)


def free_given(cells: "Cells", len_off: int, end: int, tokens: int) -> None:
    """The range ending at ``end`` recorded (given back) at ``len_off`` was skipped: free its record.

    Only if the record still holds that range: one taken meanwhile (a filler's ``reap`` of a slot
    this process left) may hold another's range of the same length, which must stay recorded.
    """
    if cells.load(len_off - 8) == end & MASK64:  # the record's TICKET: the word before its LEN
        cells.cas(len_off, tokens | L.TICKET_GIVEN, 0)


def keep_on_leave(cells: "Cells", records: Records, returns: "Returns", waiters_out: bool) -> None:
    """Before a process gives its slot back: every range it gave back and the head has not yet
    passed stays recorded (those held in no record are recorded as given, while one is free), for
    the next filler's ``reap`` (which takes given-back records from a slot nobody owns).

    Its waiters' records: with ``waiters_out`` (``Attachment.detach``: ``closed`` set and every native
    wait of the process out of its loop, after ``leave_waiters``, so none of its waiters can be
    granted any more) each is marked given where it is (one CAS): the ticket of a waiter still
    mid-call when its process closes the limiter outlives the slot, for the next filler's ``reap``
    to skip, never held in no record.  A record still being written (``TICKET_BUSY``: a grab between
    its claim and its length store) is then left as it is; ``close`` waits for such writes of its
    other threads first (``Writers.settle``), and for its own thread's (under a signal handler) by
    running after it (``Writers.defer``), so only one it could not wait for (stalled past
    ``SETTLE_MAX``) stays: its grab either fails (and frees it) or stores the length over it, a
    waiter's record in a slot left cleanly, which no ``reap`` takes (the design page's "Not given
    back").  Without ``waiters_out`` (leaving a segment collected since a fork, before any use) they
    are cleared: a waiter that might still be granted must never be granted from a range another
    process skipped.  Given-back records stay either way, for whoever finds them.
    """
    left = L.TICKET_GIVEN | (L.TICKET_BUSY if waiters_out else 0)  # records left as they are
    for _, len_off in records:
        v = cells.load(len_off)
        if v and not v & left:
            cells.cas(len_off, v, v | L.TICKET_GIVEN if waiters_out else 0)
    for end, tokens in returns.unrecorded():
        record(cells, records, end, tokens, given=True)


def slot_alive_at(index: int, pid: int, start: int, pidns: int) -> bool:
    """``table.slot_alive``, asked about slot ``index`` (the signature of ``OwnerWatch.alive``)."""
    return slot_alive(pid, start, pidns)


def reap(
    cells: "Cells",
    table: "ProcessTable",
    give: Give,
    alive: Callable[[int, int, int, int], bool] = slot_alive_at,
) -> int:
    """Give back (``give(end, tokens, take)``) the ranges recorded by processes that are gone; return how many.

    A waiter's record is taken from a dead owner; a given-back one from a dead
    owner or from a slot left cleanly (its owner gave it back, then left or
    exited before the head reached it).  A live owner's records are its own.
    The record is read (length, end, length again: a consistent pair) before
    the owner is judged, so a record read while the owner's pid and start say
    dead is the dead owner's: a new owner takes the slot (and may record) only
    after changing them.  The CAS of the length to 0 (``take``, which ``give``
    calls once the range is held elsewhere: ``Returns.adopt``) takes the record
    once; were it a new owner's equal length, the range given back is still the
    dead owner's one that was read (giving back a range twice is giving it
    once: the head skips it once).  A range ``give`` declines stays recorded
    where it was found, for the next reap.  ``alive(slot, pid, start, pidns)``
    judges an owner (the filler passes its ``table.OwnerWatch``'s, which keeps
    a pidfd per owner).
    """
    found = 0
    lens = L.record_lens(table.slots)  # (each slot's records in order: k's slot is k // per)
    # one call reads every record's length: most are free (0), and only those that are not are
    # looked at, word by word, below (a scan of them one load at a time cost the filler ~0.3 ms;
    # a Python loop over all the lengths ~0.1 ms, where compress skips the free ones in C)
    owners: dict = {}  # slot -> its owner is alive (looked at once per reap)
    vals = cells.load_many(lens)
    for k in itertools.compress(range(len(vals)), vals):
        v = vals[k]
        if v & L.TICKET_BUSY:
            continue
        i, len_off = k // L.TICKET_RECORDS, lens[k]
        end_off = len_off - 8  # a record's TICKET: the word before its LEN
        base = L.slot_offset(i)
        owner: Optional[bool] = owners.get(i)
        end = cells.load(end_off)
        if cells.load(len_off) != v:
            continue
        pid = cells.load(base + L.SLOT_PID)
        if owner is None:
            owner = owners[i] = bool(pid) and alive(
                i, pid, cells.load(base + L.SLOT_START), cells.load(base + L.SLOT_PIDNS)
            )
        # a live owner skips its own; a slot left cleanly (pid 0) holds no waiter's record
        if owner or (not pid and not v & L.TICKET_GIVEN):
            continue
        tokens = v & ~L.TICKET_GIVEN
        if tokens > MAX_SPAN_TOKENS:  # no ticket (corrupt): drop the record
            cells.cas(len_off, v, 0)
            continue
        if give(end, tokens, functools.partial(cells.cas, len_off, v, 0)):
            found += 1
    return found


def take_over(cells: "Cells", records: Records, give: Callable[[int, int, int], None]) -> int:
    """A process that just took a slot gives back the ranges its predecessor left recorded there.

    A slot is taken from a dead owner or one that left cleanly (whose waiters'
    records it cleared, keeping those given back), and the new owner has not
    recorded anything yet: a record found here is a predecessor's.  Each is
    marked given *where it is* (one CAS: the range is never held in no record,
    whatever instant the taker dies at) and handed to ``give(end, tokens, its
    record's LEN offset)`` (``Returns.give_back``).  Returns how many.
    """
    found = 0
    for end_off, len_off in records:
        v = cells.load(len_off)
        if v == 0:
            continue
        end = cells.load(end_off)
        tokens = v & ~L.TICKET_GIVEN
        if v & L.TICKET_BUSY or tokens > MAX_SPAN_TOKENS:
            cells.cas(
                len_off, v, 0
            )  # killed while writing its record, or corrupt: nothing to give back
            continue
        if cells.cas(len_off, v, tokens | L.TICKET_GIVEN):
            give(end, tokens, len_off)
            found += 1
    return found


# ---- the ranges a process gives back, and the thread that skips them ------------------------------


class Returns:
    """The ticket ranges this process gave back and the head has not yet passed.

    ``step`` skips those the head has reached and answers when to look again;
    a ``ReturnsThread`` calls it (tests call it directly, on a fake clock).
    """

    def __init__(self, bucket: "Bucket", wake: Optional[Callable[[], None]] = None) -> None:
        self.bucket = bucket
        #: run after a skip moved the head: this process's waiters look again (those behind the
        #: range sleep to a turn that counted it); by default only the native waits on these cells
        self.wake = wake if wake is not None else bucket.cells.wake_waiters
        self._lock = threading.Lock()
        self._ranges: List[
            Tuple[int, int, Optional[int], int]
        ] = []  # (start, end, its record's LEN offset, tokens)
        self.skipped = 0  # tokens skipped by this process (shown in tests)
        self._wake = threading.Event()

    def give_back(self, ticket: int, tokens: int, rec: Optional[int] = None) -> None:
        """The range ``[ticket - tokens, ticket)`` will be granted to no one: skip it when it is reached.

        ``rec``: the LEN offset of the record that holds it, marked given (freed once skipped).
        """
        with self._lock:
            self._ranges.append(((ticket - tokens) & MASK64, ticket & MASK64, rec, tokens))
        self._wake.set()

    def adopt(self, end: int, tokens: int, take: Callable[[], bool], records: Records) -> bool:
        """A range another process left recorded (``reap``): skip it, never holding it in no record.

        Recorded first in a free one of ``records`` (this process's, marked given), and only then
        taken from where it was found (``take``): a death at any instant leaves it recorded in one
        slot or both (giving back twice is giving back once).  With none free, it is skipped at once
        if the head has reached it (then taken), else left where it was found for the next reap:
        held elsewhere it would be lost should this process die, and waiting here for a record could
        wait for the range itself (this process's waiters may queue behind it).  True if taken.
        """
        cells = self.bucket.cells
        rec = record(cells, records, end, tokens, given=True)
        if rec is not None:
            if take():
                self.give_back(end, tokens, rec)
                return True
            cells.cas(rec, tokens | L.TICKET_GIVEN, 0)  # taken by another first: it holds the range
            return False
        b = self.bucket
        start = (end - tokens) & MASK64
        got = skip(b, start, end)
        if got is None and b.replenish() > 0:
            got = skip(b, start, end)
        if got is None:  # the head is not there yet
            return False
        self.skipped += got
        take()
        if got:
            self.wake()
        return True

    def pending(self) -> List[Tuple[int, int]]:
        """The ranges not yet skipped, ``(start, end)``."""
        with self._lock:
            return [r[:2] for r in self._ranges]

    def unrecorded(self) -> List[Tuple[int, int]]:
        """The ranges not yet skipped and held in no record, ``(end, tokens)``: lost if this process goes."""
        with self._lock:
            return [(r[1], r[3]) for r in self._ranges if r[2] is None]

    def step(self) -> Optional[float]:
        """Skip every range the head has reached; return the seconds until the next is due, None if none is left."""
        b = self.bucket
        with self._lock:
            ranges = list(self._ranges)
        if not ranges:
            return None
        head = b.head()
        ranges.sort(key=lambda r: diff(r[0], head))  # in queue order: a skip may reach the next one
        done = set()
        skipped = self.skipped
        replenished = False
        nap: Optional[float] = None
        for r in ranges:
            got = skip(b, r[0], r[1])
            if got is None and not replenished:
                replenished = True  # the time up to now may bring the head there
                b.refresh()
                b.replenish()
                got = skip(b, r[0], r[1])
            if got is not None:
                self.skipped += got
                done.add(r)
                if r[2] is not None:  # skipped: its record is free (unless someone took it already)
                    free_given(b.cells, r[2], r[1], r[3])
                continue
            nap = self._due_in(r[0])
            break  # the head is before this one: those behind it are further still
        if self.skipped != skipped:
            self.wake()  # the head jumped: waiters behind look again now, not at the turn they slept to
        with self._lock:
            self._ranges = [r for r in self._ranges if r not in done]
            if not self._ranges:
                return None
        return nap if nap is not None else 0.0

    def _due_in(self, start: int) -> float:
        b = self.bucket
        if b.stopped:
            return LOOK_AT_LEAST  # no time accrues: nothing to skip before a start
        if not b.time_fed:
            return LOOK_EVERY
        head = b.head()  # past the start, a fence holds the skip: due once it lets the head on
        return max(
            0.0,
            (b.due_ns(start if diff(head, start) < 0 else (head + 1) & MASK64) - b.clock()) / 1e9,
        )


class ReturnsThread(threading.Thread):
    """Skips this process's given-back ranges, each when the head reaches it; idle when there are none."""

    def __init__(self, returns: Returns, name: str) -> None:
        super().__init__(name=f"shmlimit-giveback-{name}", daemon=True)
        self.returns = returns
        self._stopping = False

    def stop(self) -> None:
        self._stopping = True
        self.returns._wake.set()

    def run(self) -> None:
        r = self.returns
        try:
            while not self._stopping:
                r._wake.clear()  # before looking: a range given back meanwhile wakes the next wait
                nap = r.step()
                if nap is None:
                    r._wake.wait()
                else:
                    r._wake.wait(min(max(nap, RETRY), LOOK_AT_LEAST))
        except Exception:  # pragma: no cover - a closed mapping at interpreter exit
            pass
