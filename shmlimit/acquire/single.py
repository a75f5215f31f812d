"""The acquisition core: every way of taking ops, as step functions that never sleep.

``Request(att, n, timeout)`` is one call of ``acquire``.  ``begin()`` answers
True (granted), False (refused, having taken nothing) or a number of seconds
to park before asking again with ``next()``, which answers the same way;
``end()`` must follow, whatever happened (it clears the WAITING flag and gives
back what a request that was not granted still holds).  Every kind's drivers
run it (``acquire.drivers``: ``drive`` sleeps, to a ticket's turn precisely,
``drive_async`` awaits on the loop).  This is the shape trio uses
(``acquire_nowait`` plus parking): the decisions are made once, here, for both.

A request moves through these states, each a step that never blocks:

* ``ADMIT``  -- capped mode: waiting for a place among the ops in flight
  (``Bucket.admit``), holding no ticket, so nobody queues behind it;
* ``JOIN``   -- ``max_reserved`` is set and the queue is too long to join: an
  untimed request (or, in hierarchical mode, a timed one until its deadline)
  waits, taking nothing, until it may take its ticket;
* ``RECORD`` -- it would queue, but its process has no ticket record (beyond
  the table): it naps and tries again, holding nothing.  (A process whose five
  records are all in use queues its caller unrecorded instead, and records the
  ticket once one is free: its FIFO place and at-once refusal never wait for one);
* ``TICKET`` -- it holds a ticket: it waits for the head to reach it,
  replenishing by itself (the lazy refill: nothing waits for the filler) and
  nudging its process's filler when it had to.  While here, its process slot's
  WAITING word counts it (``stats().processes[i].waiting``), and its ticket is
  recorded in one of the slot's records (given back should the process die).
  Leaving unserved (an interrupt, a cancellation) it gives its ticket back: the head
  skips its range (see ``giveback``), so no one waits for it.  In hierarchical
  mode tokens come with leases, so no wait is computable: a timed request
  takes its ticket all the same, and gives it back at its deadline; its waiter
  sleeps on ``UP_WAKE`` until the batch that covers it wakes it
  (``fed_wait``).

Every deadline and nap is measured on the attachment's clock (CLOCK_MONOTONIC
ns, injected in tests), so a request can be driven step by step on a fake clock.
"""

from __future__ import annotations

import time
import weakref
from typing import TYPE_CHECKING, Any, Callable, Optional, Tuple, Union

from shmlimit.acquire.drivers import MIN_NAP, Step, drive, drive_async
from shmlimit.acquire.sleep import at_stop, sleep_until_async
from shmlimit.attachment import Mode, _no_fast
from shmlimit.bucket import fed_wait
from shmlimit.bucket.fences import fenced_ticket
from shmlimit.bucket.giveback import NO_RECORD, REFUSED, record_nap, take_ticket
from shmlimit.bucket.rovers import WAIT_GRANTED
from shmlimit.config import MAX_NAP, MAX_QUEUE_TOKENS, NS_PER_S, validate_n, validate_timeout
from shmlimit.errors import SegmentError, UnsupportedError

if TYPE_CHECKING:  # pragma: no cover
    from shmlimit.attachment import Attachment
    from shmlimit.bucket.rovers import Bucket

#: A waiter whose ticket is due but not yet covered looks again after this long at least (ns).
RETRY_NS = 20_000
MAX_NAP_NS = int(MAX_NAP * NS_PER_S)
#: Hierarchical mode: a request that does not know when tokens come looks this often (seconds) ...
POLL = 0.002
#: ... and one that knows wakes this long after they are due, once the filler has added them (seconds).
ARRIVAL_SLACK = 0.001
#: Capped mode: a request waiting for a release looks again this often (seconds).
CAPPED_NAP = 0.001
_INF = float("inf")

ADMIT, JOIN, RECORD, TICKET, DONE = "admit", "join", "record", "ticket", "done"


def owed_at_most(b: Any, wait_ns: float) -> int:
    """The most tokens the head can be short of a ticket taken with a wait of at most ``wait_ns``
    (``take_within``, a gate's ``grab_within``: its shortfall at the rate, at least, was within it):
    the head only grows, so a ticket it falls further behind was moved by a writer of the words, and
    would be waited for as long as that writer likes.  Any ticket: ``MAX_QUEUE_TOKENS``."""
    if wait_ns == _INF:
        return MAX_QUEUE_TOKENS
    return min(MAX_QUEUE_TOKENS, int(wait_ns * b.tpn * (1 + 1e-9)) + b.tpn + 1)


class Request:
    """One acquire of ``n`` ops, with ``timeout`` seconds (None: as long as it takes)."""

    __slots__ = (
        "att",
        "bucket",
        "n",
        "tokens",
        "deadline",
        "state",
        "ticket",
        "admitted",
        "granted",
        "wake_ns",
        "turn_ns",
        "_waiting",
        "record",
        "fed",
        "bound",
    )

    def __init__(self, att: "Attachment", n: int, timeout: Optional[float]) -> None:
        b = att.bucket
        if b.refresh() or att.fast_seq != b.seq:
            att.update_fast()
        tokens = validate_n(n, b.cost) * b.cost  # (``price``: the config was just refreshed)
        timeout = validate_timeout(timeout)
        deadline = None if timeout is None else att.clock() + int(timeout * NS_PER_S)
        self._start(att, n, tokens, deadline, DONE, None)

    def _start(
        self,
        att: "Attachment",
        n: int,
        tokens: int,
        deadline: Optional[int],
        state: str,
        ticket: Optional[int],
    ) -> None:
        """The fields every request starts with (``holding``'s: a ticket held already)."""
        self.att = att
        self.bucket = att.bucket
        self.n = n
        self.tokens = tokens
        self.deadline = deadline
        self.state = state
        self.ticket = ticket
        #: the mode that admitted it (``Mode.admit``; capped mode counts it in flight until ``end``)
        self.admitted: Optional[Mode] = None
        self.granted = False
        #: the last nap ends at this CLOCK_MONOTONIC instant, to sleep to precisely (None: roughly)
        self.wake_ns: Optional[int] = None
        #: ... and that nap is to the ticket's turn, come at this instant (None: parked for another
        #: reason): woken after it, it replenishes at once, without working the turn out again
        self.turn_ns: Optional[float] = None
        self._waiting = False
        self.record: Optional[int] = (
            None  # the record of our ticket in our process slot (its LEN offset)
        )
        #: hierarchical mode: the nap to ``wake_ns`` is a sleep on ``UP_WAKE`` (the value read before
        #: the head, the ticket's bit), ended early by the batch that covers the ticket
        self.fed: Optional[Tuple[int, int]] = None
        #: the most tokens the head can be short of its ticket (``owed_at_most``)
        self.bound = MAX_QUEUE_TOKENS

    @classmethod
    def holding(
        cls,
        att: "Attachment",
        n: int,
        ticket: int,
        tokens: int = 0,
        rec: Optional[int] = None,
        deadline: Optional[int] = None,
        counted: bool = False,
        bound: int = MAX_QUEUE_TOKENS,
    ) -> "Request":
        """A request that already holds ``ticket``, ``tokens`` long (the fast path's grab): it only waits.

        ``tokens`` 0: the length is not known for sure (the config changed
        under the grab), and the ticket can then never be given back.
        ``rec``: the record the grab's first wait made of it already.  ``deadline``: hierarchical
        mode's timed grab, given back when not served by then (CLOCK_MONOTONIC ns).  ``counted``:
        its caller is counted in WAITING already (``Acquirer.take``): ``end`` uncounts it; else its
        first step counts it (inside its driver's ``try``, whose ``end`` uncounts it).
        """
        r = cls.__new__(cls)
        r._start(att, n, tokens, deadline, TICKET, ticket)
        r._waiting = counted
        r.bound = bound
        r.record = rec if rec is not None or tokens <= 0 else att.record_ticket(ticket, tokens)
        return r

    def clock(self) -> int:
        """Now on the attachment's clock (CLOCK_MONOTONIC ns; injected in tests)."""
        return self.att.clock()

    # -- the steps ---------------------------------------------------------------------

    def begin(self) -> Step:
        """Try at once: True (granted), False (refused, nothing taken) or seconds to park before ``next``."""
        if self.state == TICKET:  # made ``holding`` its ticket already
            return self._wait_ticket()
        b = self.bucket
        mode = self.att.mode  # bound for the bucket's config when the request was made
        if not mode.admit(b, self.n):
            if self.n > b.cap_ops:
                raise ValueError(
                    f"n must be at most the capacity of {b.cap_ops} ops in capped mode, got {self.n}"
                )
            self.state = ADMIT
            return self._admit_nap()
        self.admitted = mode
        return self._take()

    def next(self) -> Step:
        """After a park: True (granted), False (refused, nothing taken) or seconds to park again."""
        state = self.state
        if state == TICKET:
            return self._wait_ticket()
        if state == ADMIT:
            b = self.bucket
            b.refresh()
            mode = self.att.mode_now()
            if not mode.admit(b, self.n):
                # the ops in flight of a dead holder come back by a filler's reap: if the holder
                # ran the filler, its lease lapsed with it, and this takes it at once (a watcher
                # would look only every WATCH_PERIOD)
                self.att.nudge_filler()
                return self._admit_nap()
            self.admitted = mode
            return self._take()
        if state == JOIN:
            return self._join()
        if state == RECORD:
            self.bucket.refresh()
            return self._take()
        raise RuntimeError(f"request is {state}: nothing to wait for")

    def end(self) -> None:
        """Leave: clear the WAITING count, and give back what a request not granted holds.

        That is its place in flight (capped mode) and its ticket: a request
        that holds one and was not granted left early (an interrupt, a
        cancellation), and the head will skip its range.  Safe to call more
        than once, and after any exception at any step.
        """
        ticket, self.ticket = self.ticket, None
        rec, self.record = self.record, None
        if ticket is not None and self.state == TICKET and not self.granted and self.tokens > 0:
            self.att.give_back(ticket, self.tokens, rec)  # its record stays, marked given
        elif rec is not None:
            self.att.clear_ticket(rec, self.tokens)
        # a ticket the slow path's take queued and a handler kept from reaching ``_hold`` (after ours:
        # a ticket given back above is not found again)
        give_back_handed(self.att)
        if self._waiting:
            self._waiting = False
            self.att.waiting(-1)
        admitted, self.admitted = self.admitted, None
        if admitted is not None and not self.granted:
            admitted.unadmit(self.bucket, self.n)
        self.state = DONE

    # -- states --------------------------------------------------------------------------

    def _take(self) -> Step:
        """Admitted (or not capped): take the tokens now, or a ticket, or start waiting to take one,
        at the price in force now (parked in ``ADMIT`` or ``RECORD``, a ``set_rate`` may have
        changed it since the request was made)."""
        b = self.bucket
        att = self.att
        self.tokens = price(b, self.n)
        if att.opened():  # hierarchical mode, upstream unreachable, on_redis_error="open": no limit
            return self._grant()
        mode = att.mode_now()
        if self.deadline is None and mode.joins:
            self.state = JOIN
            return self._join()
        if self.deadline is not None and mode.leases:
            # no wait is computable (tokens come with leases): hold a ticket until the deadline, given
            # back then if not served (``end``); with max_reserved, join once the queue is short enough
            if take_now(att, self.n, self.tokens):
                return self._done()
            if self.deadline - att.clock() <= 0:
                return self._refuse()
            if mode.joins:
                self.state = JOIN
                return self._join()
            wait = _INF
        else:
            wait = (
                _INF
                if self.deadline is None
                else min(max(0, self.deadline - att.clock()), b.max_reserved_ns)
            )
        # with every record in use, queue unrecorded (``overflow``): the FIFO place and the at-once
        # refusal never depend on a free record (a process with no slot has none, and polls)
        got, rec = take_ticket(
            b, self.tokens, att.grants_off, self.n, att.writers, wait, bool(att.records)
        )  # granted: counted
        if got is None:  # granted at once, counted
            return self._done()
        if got is REFUSED:
            return self._refuse()
        return self._record_nap() if got is NO_RECORD else self._hold(got, rec, wait)

    def _record_nap(self) -> Step:  # no free record to hold a ticket: take nothing, look again
        self.state = RECORD
        return self._admit_nap(
            record_nap(self.bucket, self.tokens, bool(self.att.records), MAX_NAP)
        )

    def _join(self) -> Step:
        """``max_reserved``: take a ticket once the queue is short enough, else park (taking nothing)."""
        b = self.bucket
        left = _INF if self.deadline is None else (self.deadline - self.att.clock()) / NS_PER_S
        if left <= 0:  # hierarchical mode's timed request: not in the queue by its deadline
            return self._refuse()
        att = self.att
        self.tokens = price(b, self.n)  # (parked here, a set_rate may have changed the price)
        got, rec = take_ticket(
            b,
            self.tokens,
            att.grants_off,
            self.n,
            att.writers,
            b.max_reserved_ns,
            bool(att.records),
        )
        if got is None:
            return self._done()
        if got is NO_RECORD:
            return self._record_nap()  # (RECORD goes back to _take, which joins again)
        if got is not REFUSED:
            return self._hold(got, rec, b.max_reserved_ns)
        b.refresh()
        over = -b.balance() + self.tokens - b.max_reserved_ns * b.tpn
        return min(MAX_NAP, left, max(MIN_NAP, over / b.tpn / NS_PER_S))

    def _hold(self, ticket: int, rec: Optional[int], wait_ns: float) -> Step:
        """Hold ``ticket``, taken with a wait of at most ``wait_ns``, and wait for it."""
        bound = owed_at_most(self.bucket, wait_ns)
        # stored (no call between: a handler raises at calls), then taken from where the take left
        # it (``take_tail``): a handler raising before finds it there, and ``end`` gives it back
        self.ticket = ticket
        self.record = rec
        self.bound = bound
        self.state = TICKET
        self.att.cells.handed()
        return self._wait_ticket()

    def _wait_ticket(self) -> Step:
        """Granted once the head covers the ticket.  Its due time at the rate is exact
        (``Bucket.due_ns``), so a waiter parks once, until then (``wake_ns``, to sleep to
        precisely), replenishes and is granted, the turn worked out for the park only
        (``turn_ns``); only when the head still falls short (another process's replenish in flight,
        or tokens that come from leases, releases or a start) does it look again soon, the turn
        worked out afresh.  Each waiter wakes for its own turn only, or every ``MAX_NAP``."""
        b = self.bucket
        att = self.att
        ticket = self.ticket
        assert ticket is not None
        if not self._waiting and att.waiting_off is not None:
            # counted among its process's queued callers until ``end``: flagged, then counted by
            # one call of the cells (a handler raises at calls: none between, so ``end`` never
            # uncounts a count not made)
            self._waiting = True
            att.cells.fetch_add(att.waiting_off, 1)
        turn, self.turn_ns = self.turn_ns, None
        self.wake_ns = None
        self.fed = None
        # hierarchical mode, on the real clock: the wake word is read before the head, so a batch
        # added after this look makes the sleep on it return at once (no wake is lost)
        fed = att.mode_now().fed_wake
        seen = fed_wait.seen(b.cells) if fed else 0
        if b.covered(ticket):
            return self._grant_ticket()
        owed = b.deficiency(ticket)
        if owed > self.bound:  # (the head only grows): moved back by a writer of the words
            raise SegmentError(
                f"segment {att.name!r} is corrupt: its head is {owed} tokens short of a ticket "
                f"taken at most {self.bound} tokens ahead of it"
            )
        if self.record is None and self.tokens > 0 and att.records:
            # queued unrecorded (every record was in use): recorded once one is free again
            self.record = att.record_ticket(ticket, self.tokens)
        b.refresh()
        if att.opened():  # the "open" fallback lets queued callers through too
            return self._grant()
        mode = att.mode_now()
        now = att.clock()
        until = (
            now + MAX_NAP_NS
            if self.deadline is None or not mode.upstream
            else min(now + MAX_NAP_NS, self.deadline)
        )
        if (
            until <= now
        ):  # a timed ticket of hierarchical mode, not served by its deadline: given back (end)
            return False
        # woken at the turn it parked for (a replenish is never early: it adds what time has passed)
        if turn is not None and now >= turn and att.refill() > 0 and b.covered(ticket):
            return self._grant_ticket()
        due = wake = b.due_ns(ticket) if mode.clocked else now
        if due > now and mode.real_clock and b.stops_at(ticket, self.tokens):
            wake, now = at_stop(due, now)  # the head stops at our ticket: replenish at its instant
        if wake > now:  # not our turn yet: no replenish can help, park until it
            # (a wake ahead of a stop is not the turn: it is reached awake, by at_stop, and a
            # replenish made on waking past it would be clamped at the stop, the lateness lost)
            self.turn_ns = due if wake == due else None
            self.wake_ns = min(int(wake) + 1, now + MAX_NAP_NS)  # now and then, to notice changes
            return (self.wake_ns - now) / NS_PER_S
        # our turn (or no clock to tell): replenishing adds whatever time has passed (lazily)
        if att.refill() > 0:
            if b.covered(ticket):
                return self._grant_ticket()
        short = b.deficiency(ticket) / b.tpn
        if mode.upstream:
            att.nudge_filler()  # only a filler leases: make sure one runs
            if mode.leases:  # tokens come with leases: park until a batch is due; a blocking driver
                if (
                    fed and fed_wait.wakes_work()
                ):  # until the batch that covers us wakes it (wake_ns: at most)
                    self.fed = (seen, fed_wait.fed_bit(ticket, b.cost))
                    self.wake_ns = fed_wait.deadline(
                        b.cells, b.tpn, now, b.deficiency(ticket), until
                    )
                return min(self._fed_nap(short / NS_PER_S), (until - now) / NS_PER_S)
        # due, yet short: look again soon, or when the shortfall could have arrived
        self.wake_ns = now + int(min(max(short, RETRY_NS), MAX_NAP_NS))
        return (self.wake_ns - now) / NS_PER_S

    def wait_native(self) -> Optional[Step]:
        """``TICKET``: the wait itself, in one native call that sleeps (``Bucket.waiter``), then the
        next step; None if the backend has no native waiter (the driver sleeps to ``wake_ns``).

        The native loop decides only what ``_wait_ticket`` would, without returning to
        Python between its naps; it returns when granted (already counted), when the
        config changed, on a signal, or after ``MAX_NAP``, and the Python step takes over.
        """
        att = self.att
        if att.fast_seq != self.bucket.seq:  # the config changed: a waiter bound to the new one
            att.update_fast()
        waiter = att.fast.waiter
        fed, self.fed = self.fed, None
        if waiter is None and fed is not None and self.wake_ns is not None:
            # hierarchical mode without a native waiter: the same sleep on the wake word, from Python
            fed_wait.sleep(self.bucket.cells, fed[0], fed[1], self.wake_ns)
            return self.next()
        if waiter is None:
            return None
        ticket = self.ticket
        assert ticket is not None
        self.wake_ns = self.turn_ns = None  # (the native wait works its turn out itself)
        until = time.monotonic_ns() + MAX_NAP_NS
        if self.deadline is not None and att.mode_now().upstream:
            # hierarchical mode's timed ticket, given back at its deadline (the real clock too);
            # elsewhere a ticket taken within the timeout is waited for to its turn, which a stop
            # may have moved past the deadline (a wait bounded by it would return at once)
            until = min(until, self.deadline)
        rc = waiter.wait(ticket, self.n, int(until), False, self.tokens)  # counted by the request
        if rc != WAIT_GRANTED:
            att.after_native_wait(rc)
        if rc & WAIT_GRANTED:
            return self._done()
        return self.next()

    def _fed_nap(self, estimate: float) -> float:
        """Hierarchical mode: how long a queued waiter parks, ``estimate`` being the local rate's guess.

        Tokens come only when a reserved batch falls due: never sooner than
        that, and for a ticket far back not before the local rate would reach
        it.  Unknown, look again after ``POLL``.
        """
        now = self.att.clock()
        nxt = self.bucket.next_lease_ns()
        if nxt <= now:  # not known: a batch may come at any moment (a burst available upstream)
            return POLL
        return min(max((nxt - now) / NS_PER_S, estimate) + ARRIVAL_SLACK, MAX_NAP)

    def _admit_nap(self, nap: float = CAPPED_NAP) -> Step:
        """Park ``nap`` seconds, holding nothing (``ADMIT``, ``RECORD``), or refuse past the deadline."""
        if self.deadline is None:
            return nap
        left = (self.deadline - self.att.clock()) / NS_PER_S
        if left <= 0:
            return self._refuse()
        return min(nap, left)

    # -- outcomes ------------------------------------------------------------------------

    def _grant_ticket(self) -> bool:
        """The head covers our ticket.

        A closed attachment grants nothing: closing unregisters the slot, and
        a ticket recorded there may then be given back by another process
        (whose head skip covers it): it is no longer ours.
        """
        if self.att.closed:
            raise ValueError(f"limiter {self.att.name!r} was closed while this call waited")
        return self._grant()

    def _grant(self) -> bool:
        """Granted: counted in this process's slot."""
        self.att.count(self.n)
        return self._done()

    def _done(self) -> bool:
        self.granted = True
        self.state = DONE
        return True

    def _refuse(self) -> bool:
        self.state = DONE
        return False


def wait_for_ticket(
    att: "Attachment", ticket: Union[int, Tuple[int, int]], timeout: Optional[float] = None
) -> bool:
    """The fast path's one-op ticket, recorded by its grab with its own price (``find_record``): the
    native wait at once, a ``Request`` only if it hands the wait back; given back if interrupted.
    ``timeout`` (seconds): hierarchical mode's timed grab, given back when not served by then.
    ``(flags, ticket)``: an ``Acquirer``'s wait returned flags to act on (granted with ``WAIT_GRANTED``)."""
    flags = 0
    if isinstance(ticket, tuple):
        flags, ticket = ticket
    waiter = att.fast.waiter
    rec, tokens = att.find_record(ticket) if not flags & WAIT_GRANTED else (None, 0)
    now = time.monotonic_ns()
    deadline = now + int(timeout * NS_PER_S) if timeout is not None and att.mode.upstream else None
    if waiter is not None or flags:
        try:
            if flags:  # an Acquirer's: counted and its record freed if granted
                att.after_native_wait(flags)
                if flags & WAIT_GRANTED:
                    return True
            if waiter is not None:
                rc = waiter.wait(ticket, 1, min(now + MAX_NAP_NS, deadline or _INF), True, tokens)
                if rc & WAIT_GRANTED:
                    if rc != WAIT_GRANTED:
                        att.after_native_wait(rc)
                    if rec is not None:
                        att.clear_ticket(rec, tokens)
                    return True
                att.after_native_wait(rc)
        except BaseException:
            if tokens:
                att.give_back(ticket, tokens, rec)
            elif rec is not None:
                att.clear_ticket(rec, tokens)
            raise
    # (hierarchical mode's timed grab holds a ticket until its deadline, however far: see Request)
    bound = (
        MAX_QUEUE_TOKENS
        if timeout is None or att.mode.upstream
        else owed_at_most(att.bucket, timeout * NS_PER_S)
    )
    return drive(Request.holding(att, 1, ticket, tokens, rec, deadline, bound=bound))


#: Each attachment's fast grab for ``acquire_async``, without the native wait (``(fast.grab, grab)``:
#: made again whenever ``update_fast`` replaced ``fast.grab``, which decides when a fast grab is valid).
_async_grabs: "weakref.WeakKeyDictionary[Attachment, Tuple[object, Callable[[], object]]]" = (
    weakref.WeakKeyDictionary()
)


def _async_grab(att: "Attachment") -> Optional[Callable[[], object]]:
    """``acquire``'s fast grab for one op, untimed (recorded, counted), but never waiting: with the
    native wait ``fast.grab`` is an ``Acquirer``, whose wait would block the loop.  None: no fast path
    for the config in force (the slow path's ``Request`` decides)."""
    fast_grab = att.fast.grab
    hit = _async_grabs.get(att)
    if hit is not None and hit[0] is fast_grab:
        return hit[1]
    b = att.bucket
    if att.fast_seq != b.seq:  # fast.grab belongs to another config: the slow path rebinds it
        return None
    grab: Optional[Callable[[], object]] = None
    if fast_grab is not _no_fast and att.fast.waiter is None:
        grab = fast_grab  # no native wait: fast.grab is the grab itself
    elif fast_grab is not _no_fast:
        grab = b.grabber(b.snap, att.grants_off, att.rec_lens)
    _async_grabs[att] = (fast_grab, grab)  # type: ignore[assignment]
    return grab


def grab_one_async(att: "Attachment") -> Union[bool, Request, None]:
    """``acquire_async()`` of one op, untimed: ``acquire``'s fast grab (one native call).  True:
    granted (counted); a request holding its queued ticket, for ``drive_async``; None: no fast grab
    now (the config changed, the queue is full, no record free): the slow path's ``Request``."""
    grab = _async_grab(att)
    try:
        ticket = grab() if grab is not None else False
    except BaseException:
        give_back_handed(att)
        raise
    if ticket is None:
        return True
    if ticket is False:
        return None
    try:
        att.cells.handed()  # stored: this call's own (see give_back_handed)
        rec, tokens = att.find_record(ticket)  # type: ignore[arg-type]
        return Request.holding(att, 1, ticket, tokens, rec)  # type: ignore[arg-type]
    except BaseException:
        give_back_unowned(att, ticket)
        raise


def give_back_unowned(att: Optional["Attachment"], ticket: Any, counted: bool = False) -> None:
    """The except clause of every hand-off of a queued ticket from a fast path (``Limiter.acquire``,
    ``acquire_async``, ``grab_one_async``): an exception (a signal handler's, raised at any call
    between the grab and the driver's ``try``) left with ``ticket`` (or an ``Acquirer``'s
    ``(flags, ticket)``; None: nothing held) maybe owned by nobody.  Its record tells: still in use
    and not given, nobody gave it back, so this does (and uncounts its caller from WAITING if
    ``counted``: ``Acquirer.take``'s); given back, or freed at its grant, its owner let it go
    already.  Tickets end where no other range ends, so the record is this caller's."""
    if att is None or ticket is None or ticket is False:
        return
    if isinstance(ticket, tuple):
        ticket = ticket[1]
    rec, tokens = att.find_record(ticket)
    if rec is not None:
        att.give_back(ticket, tokens, rec)
        if counted:
            att.waiting(-1)


def give_back_handed(att: Optional["Attachment"], counted: bool = False) -> None:
    """The except clause around a fast path's call that may return a queued ticket: a signal
    handler may raise at the interpreter's check that ends the call, after it returned the ticket
    and before its caller stored it.  The call left it in ``cells.handed()`` first (the queued
    branch only), and this gives it back unless its owner let it go (``give_back_unowned``).  A
    caller that stored the ticket takes it from there at once (``handed()``), before anything else
    of its thread may grab: a ticket left there is given back by the next except clause.  The slow
    path's take (``Bucket.take_within``) leaves its queued ticket there too, until ``Request._hold``
    (or a request over several rates, or a reservation's claim) stores it; ``Request.end`` is its
    except clause.  Once the attachment is closed the slot is only emptied: its close marked the
    records of its waiters given (``keep_on_leave``), and its cells may be gone."""
    if att is not None:
        ticket = att.cells.handed()
        if ticket is not None and not att.closed:
            give_back_unowned(att, ticket, counted)


async def wait_ticket_async(att: "Attachment", acq: Any, ticket: int) -> bool:
    """``acquire_async()``'s wait for the ticket the native ``Acquirer``'s ``take()`` queued (its
    caller counted in WAITING): the wait's own steps (``acq.step``: one native call each, which
    never sleeps) with the precise sleep on the loop between them, so a wake costs one call and
    decides what ``acquire``'s native wait would.  A step that cannot decide (the config changed,
    close began) hands the ticket to a ``Request``; leaving early (a cancellation) gives it back,
    as ``Request.end`` does."""
    step = acq.step
    nxt: object = False
    flags = 0
    try:
        nxt = step(ticket)
        while True:
            flags = 0
            if nxt.__class__ is tuple:
                flags, nxt = nxt  # type: ignore[misc]
            if nxt is None:  # granted: counted, its record freed, no longer counted waiting
                break
            if flags:
                att.after_native_wait(flags)
            if nxt is False:
                break
            await sleep_until_async(nxt)  # type: ignore[arg-type]
            nxt = step(ticket)
    except BaseException:
        # still held: given back, its caller uncounted (a step that granted freed its record and
        # uncounted it already: nothing more)
        give_back_unowned(att, ticket, counted=True)
        raise
    if nxt is None:
        if flags:
            att.after_native_wait(flags)
        return True
    return await drive_async(_adopt(att, ticket))


def _adopt(att: "Attachment", ticket: int) -> Request:
    """A request holding the ticket ``Acquirer.take()`` queued and recorded, counted waiting."""
    rec, tokens = att.find_record(ticket)
    return Request.holding(att, 1, ticket, tokens, rec, counted=True)


# ---- the calls that never wait ------------------------------------------------------------------


def price(b: "Bucket", n: int) -> int:
    """The tokens of ``n`` ops at the price in force (the config reloaded if it changed), ``n``
    validated at it: what a take pays, computed just before it.  A ``set_rate`` re-prices new
    takes only (queued tickets keep theirs), so a caller that parks before taking (waiting to be
    admitted, to join, for a record, or on another rate) prices its ops again at each take."""
    b.refresh()
    return validate_n(n, b.cost) * b.cost


def take_now(att: "Attachment", n: int, tokens: int) -> bool:
    """``n`` ops (``tokens``) if the head covers them now, replenishing once if it does not; counted."""
    b = att.bucket
    if b.try_grab(tokens, att.grants_off, n):
        return True
    b.refresh()
    if att.opened():  # the "open" fallback: no limit
        att.count(n)
        return True
    # (the refill nudges the filler: a filler that left drops its lease, and a watcher looks only
    # every WATCH_PERIOD; without one, tries that replenish only for themselves lose time to the
    # clamp, its snapshots as old as the last refused try: 12-18 % at 200/s)
    if att.refill() <= 0:
        return False
    if not b.try_grab(tokens, att.grants_off, n):
        return False
    # ... and refill once more, past our grant.  Not queued, a refill's clamp counts from the tail
    # it saw (``clamp``): ours saw the tail before our grant, so the next refill could bring the head
    # only an op less than a capacity past the tail after it, and tries that refill for themselves
    # (every filler gone) lost per op what the first try after it came late by: 17 % of the rate at
    # 1 ms late.  A claim is safe at any moment (invariant 2); this one is a few us of time.
    att.refill()
    return True


def most_a_try_takes(att: "Attachment", n: int) -> Optional[int]:
    """The most ops one try could ever take at the config in force, if ``n`` is more (else None):
    a bucket at its fullest holds its capacity and the catch-up room, and a capped limiter admits
    at most its capacity in ops (``acquire_with_backoff``'s tries then never end)."""
    b = att.bucket
    price(b, n)  # (n validated, the config in force loaded)
    most = (b.cap + b.burst_pool) // b.cost
    if b.capped:
        most = min(most, b.cap_ops)
    return most if n > most else None


def try_acquire(att: "Attachment", n: int) -> bool:
    """``Limiter.try_acquire``: granted now, or refused having taken nothing (and the filler told)."""
    b = att.bucket
    if b.refresh() or att.fast_seq != b.seq:
        att.update_fast()
    tokens = validate_n(n, b.cost) * b.cost  # (``price``: the config was just refreshed)
    mode = att.mode
    if not mode.admit(b, n):
        return False
    granted = False
    try:
        granted = take_now(att, n, tokens)
    finally:
        if not granted:
            mode.unadmit(b, n)
    if not granted and mode.upstream:
        b.mark_hungry(att.clock())  # a refused try is demand the filler should see ...
        att.nudge_filler()  # ... and one must run: a dead one's lease is taken here, not by a watcher
    return granted


def reserve(att: "Attachment", n: int, max_wait: Optional[float]) -> Optional[float]:
    """``Limiter.reserve``: a ticket counted as granted, and the seconds until it is due; None takes nothing."""
    b = att.bucket
    b.refresh()
    mode = att.mode_now()
    if mode.upstream:
        # Paced by the local rate, each host would promise slots of the global rate: two hosts
        # of a global 100/s handed out 200 usable slots in 1 s.  Leases have no known time.
        raise UnsupportedError(
            "Limiter",
            "reserve",
            f"{att.name!r} is a hierarchical limiter: its tokens come from leases, whose time is "
            "not known in advance; use acquire(timeout=...) or try_acquire()",
        )
    tokens = price(b, n)
    limit = validate_timeout(max_wait, "max_wait")
    if att.opened():
        att.count(n)
        return 0.0
    if not mode.admit(b, n):
        return None  # no room among the ops in flight: nothing taken
    # A claim of our own before the grab (the promise in the fence counts from a fresh REPL_TS) and
    # after it: a snapshot from before a grab that emptied a full bucket makes the next claim add nothing
    _claim_now(att)
    ticket = due = None
    try:
        bound = min(_INF if limit is None else limit * NS_PER_S, b.max_reserved_ns)
        ticket, due = fenced_ticket(b, att.clock, att.refill, tokens, bound)
    finally:
        if ticket is None:
            mode.unadmit(b, n)
    if ticket is None:
        return None
    att.count(n)
    _claim_now(att)
    if b.deficiency(ticket) and mode.stopped:
        return _INF
    # its fence holds those behind it to its promise (``fences``): a late promise costs time, never a slot
    return 0.0 if due is None else max(0.0, due - att.clock()) / NS_PER_S


def _claim_now(att: "Attachment") -> None:
    """A claim of our own, again (a few times at most) while an older one preempted before its CAS wins."""
    for _ in range(3):
        since = att.clock()
        att.refill()
        if att.bucket.refilled_since(since):
            return


def retry_after(att: "Attachment", n: int) -> float:
    """Seconds until ``n`` ops could be granted to a new caller at the current rate (0.0: now)."""
    b = att.bucket
    tokens = price(b, n)
    if att.mode_now().stopped or (b.capped and n > b.cap_ops):  # (capped: never admitted)
        return _INF
    return max(0.0, b.next_promised_ns(tokens) - att.clock()) / NS_PER_S
