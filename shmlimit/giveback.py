"""Given-back tickets: the schedule of a waiter that leaves before its turn goes to those behind it.

A waiter holds a ticket: the range ``[ticket - tokens, ticket)`` of the rovers.
Left queued when its waiter is gone -- interrupted (KeyboardInterrupt),
cancelled (asyncio, ``wait_for``), its process killed -- the range would hold
everyone behind it for its whole schedule.  It is given back instead:

* **by the process itself** on cancel or interrupt: ``Request.end`` hands the
  range to its attachment's ``Returns``;
* **by the filler for a dead process**: each waiter records its range in its
  process slot (``SLOT_TICKET``, ``SLOT_TICKET_LEN``; one per process, the
  first waiter to find the record free) while it waits; the elected filler
  looks at the slots every ``REAP_EVERY`` seconds, and one whose owner is dead
  and still holds a record has its range given back (``reap``); a process
  that takes over a dead owner's slot first gives back what it finds
  recorded there (``take_over``).  The CAS of ``SLOT_TICKET_LEN`` from the
  record to 0 decides it: only the dead owner's record can be taken, once.
  A process that leaves cleanly clears its record first.

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

A range is skipped by whoever holds it, when the head reaches its start: a
daemon thread of the process (``ReturnsThread``, started at the first range
given back) sleeps until that instant (``Bucket.due_ns``), replenishes, and
skips.  The owner of a range given back never waits on it again (it left, or
it is dead), so no one is ever granted from it.

Not given back: a ``reserve()``.  A reservation is a grant for later, not a
waiter: it is counted as granted when made, and its holder may use it
whether or not its process still runs (the HTTP integrations push a pause
into the schedule this way).
"""
from __future__ import annotations

import threading
from typing import TYPE_CHECKING, List, Optional, Tuple

from . import layout as L
from .bucket import diff
from .cells import MASK64
from .config import MAX_SPAN_TOKENS
from .table import slot_alive

if TYPE_CHECKING:  # pragma: no cover
    from .bucket import Bucket
    from .cells import Cells
    from .table import ProcessTable

#: The filler looks for dead processes' recorded tickets this often (seconds).
REAP_EVERY = 0.1
#: A range whose start is not due at a known time (hierarchical mode) is looked at this often (s) ...
LOOK_EVERY = 0.005
#: ... one due later (or while stopped) at least this often, to notice changes, as a waiter does (s) ...
LOOK_AT_LEAST = 0.25
#: ... and one due now (another process's replenish in flight) again after this long (seconds).
RETRY = 20e-6


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
    cover the tickets behind it all at once, a burst above the capacity.  In any window the grants are thus
    what they would have been had the range never been taken, less that
    lost time: the window bound holds.
    """
    c = b.cells
    while True:
        head = c.load(L.HEAD)
        if diff(head, end) >= 0:
            return 0
        if diff(end, c.load(L.TAIL)) > 0 or diff(end, start) <= 0:
            return 0  # no ticket ever handed out (the tail only grows): a corrupt record
        if diff(head, start) < 0:
            return None
        if c.cas(L.HEAD, head, end):
            # A replenish now leaves a snapshot of the head past the range: the clamp of the
            # next one is then relative to it, not to a head before the range, which would
            # make it add nothing (a whole interval of time lost instead of this instant's).
            b.replenish()
            return diff(end, head)


# ---- the record in the process slot --------------------------------------------------------------


def record(cells: "Cells", slot: Optional[int], ticket: int, tokens: int) -> bool:
    """Record ``ticket`` (``tokens`` long) in this process's slot, if the record is free; True if it was.

    The pair is written under ``TICKET_BUSY``, so a reader never combines one
    ticket's end with another's length.
    """
    if slot is None or not 0 < tokens <= MAX_SPAN_TOKENS:
        return False
    base = L.slot_offset(slot)
    if cells.load(base + L.SLOT_TICKET_LEN) != 0 or not cells.cas(base + L.SLOT_TICKET_LEN, 0, L.TICKET_BUSY):
        return False
    cells.store(base + L.SLOT_TICKET, ticket & MASK64)
    cells.store(base + L.SLOT_TICKET_LEN, tokens)
    return True


def clear(cells: "Cells", slot: Optional[int], tokens: int) -> None:
    """The waiter that recorded its ticket leaves (granted or giving it back): the record is free."""
    if slot is not None:
        cells.cas(L.slot_offset(slot) + L.SLOT_TICKET_LEN, tokens, 0)


def reap(cells: "Cells", table: "ProcessTable", returns: "Returns") -> int:
    """Give back every dead process's recorded ticket (into ``returns``); return how many.

    The record is read (length, end, length again: a consistent pair) before
    the owner is judged, so a record read while the owner's pid and start
    say dead is the dead owner's: a new owner takes the slot (and may record)
    only after changing them.  The CAS of the length to 0 takes the record
    once; were it a new owner's equal length, the range given back is still
    the dead owner's one that was read.
    """
    found = 0
    for i in range(table.slots):
        base = L.slot_offset(i)
        tokens = cells.load(base + L.SLOT_TICKET_LEN)
        if tokens == 0 or tokens & L.TICKET_BUSY:
            continue
        end = cells.load(base + L.SLOT_TICKET)
        if cells.load(base + L.SLOT_TICKET_LEN) != tokens:
            continue
        pid = cells.load(base + L.SLOT_PID)
        # a slot given back cleanly (pid 0) holds no record; one whose owner lives is the owner's
        if not pid or slot_alive(pid, cells.load(base + L.SLOT_START), cells.load(base + L.SLOT_PIDNS)):
            continue
        if not cells.cas(base + L.SLOT_TICKET_LEN, tokens, 0):
            continue
        if tokens <= MAX_SPAN_TOKENS:  # anything longer is no ticket (corrupt): drop the record
            returns.give_back(end, tokens)
            found += 1
    return found


def take_over(cells: "Cells", slot: int, returns: "Returns") -> bool:
    """A process that just took ``slot`` gives back the ticket its predecessor left recorded there.

    A slot is taken from a dead owner (one that left cleanly clears its
    record first), and the new owner has not recorded anything yet: a record
    found here is the dead one's.  True if a range was given back.
    """
    off = L.slot_offset(slot) + L.SLOT_TICKET_LEN
    tokens = cells.load(off)
    if tokens == 0:
        return False
    end = cells.load(L.slot_offset(slot) + L.SLOT_TICKET)
    if not cells.cas(off, tokens, 0) or tokens & L.TICKET_BUSY or tokens > MAX_SPAN_TOKENS:
        return False  # killed while writing its record (or a corrupt one): nothing to give back
    returns.give_back(end, tokens)
    return True


# ---- the ranges a process gives back, and the thread that skips them ------------------------------


class Returns:
    """The ticket ranges this process gave back and the head has not yet passed.

    ``step`` skips those the head has reached and answers when to look again;
    a ``ReturnsThread`` calls it (tests call it directly, on a fake clock).
    """

    def __init__(self, bucket: "Bucket") -> None:
        self.bucket = bucket
        self._lock = threading.Lock()
        self._ranges: List[Tuple[int, int]] = []  # (start, end)
        self.skipped = 0  # tokens skipped by this process (shown in tests)
        self._wake = threading.Event()

    def give_back(self, ticket: int, tokens: int) -> None:
        """The range ``[ticket - tokens, ticket)`` will be granted to no one: skip it when it is reached."""
        with self._lock:
            self._ranges.append(((ticket - tokens) & MASK64, ticket & MASK64))
        self._wake.set()

    def pending(self) -> List[Tuple[int, int]]:
        """The ranges not yet skipped, ``(start, end)``."""
        with self._lock:
            return list(self._ranges)

    def step(self) -> Optional[float]:
        """Skip every range the head has reached; return the seconds until the next is due, None if none is left."""
        b = self.bucket
        with self._lock:
            ranges = list(self._ranges)
        if not ranges:
            return None
        head = b.cells.load(L.HEAD)
        ranges.sort(key=lambda r: diff(r[0], head))  # in queue order: a skip may reach the next one
        done = set()
        replenished = False
        nap: Optional[float] = None
        for r in ranges:
            got = skip(b, *r)
            if got is None and not replenished:
                replenished = True  # the time up to now may bring the head there
                b.refresh()
                b.replenish()
                got = skip(b, *r)
            if got is not None:
                self.skipped += got
                done.add(r)
                continue
            nap = self._due_in(r[0])
            break  # the head is before this one: those behind it are further still
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
        now = b.clock()
        return max(0.0, (b.due_ns(start) - now) / 1e9)


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
