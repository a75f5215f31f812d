"""The acquisition protocol over several rates (``rates=``; see ``multirate``): all or nothing
now (``take_all``: ``all_or_nothing`` over each rate's ``_Grab``), giving back (``give_back``),
and ``MultiRequest``, one acquire as steps that never sleep, run by the acquisition core's drivers (``acquisition.drive``, ``drive_async``).
Every word is touched through each rate's ``Bucket``."""

from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

from shmlimit.acquire import all_or_nothing
from shmlimit.acquire import single as acquisition
from shmlimit.acquire.single import Request
from shmlimit.attachment import Attachment
from shmlimit.bucket.fences import NO_FENCE, FenceHold
from shmlimit.bucket.giveback import NO_RECORD, REFUSED, record_nap, take_ticket
from shmlimit.bucket.rovers import diff
from shmlimit.config import NS_PER_S, validate_timeout
from shmlimit.errors import QueueFullError

_INF = float("inf")


# ---- the protocol ----------------------------------------------------------------------------


#: Tokens taken and covered, not yet used: (attachment, tokens, the head when they were taken at
#: the latest -- for a ticket, the ticket itself).
Held = Tuple[Attachment, int, int]


def give_back(held: Sequence[Held]) -> None:
    """Return tokens taken and not used (a refusal, a timeout, an interruption), less what the
    head gained since they were taken (``Bucket.give_back``): the bucket is never left fuller
    than had they never been taken."""
    for att, tokens, head_then in held:
        att.bucket.give_back(tokens, head_then)


class _Grab:
    """One rate's part of an all-or-nothing try (``all_or_nothing.Rate``): its tokens by CAS
    (replenishing once if short), given back by ``Bucket.give_back``."""

    __slots__ = ("att", "ops", "tokens")

    def __init__(self, att: Attachment, ops: int, tokens: int) -> None:
        self.att, self.ops, self.tokens = att, ops, tokens

    def look(self) -> int:
        """1 when short even after a replenish (the wait is not measured here), else 0."""
        return int(_short(self.att.bucket, self.tokens))

    def take(self) -> Any:
        b, t = self.att.bucket, self.tokens
        h = b.head()
        if not b.try_grab(t, self.att.grants_off, 0):
            if b.replenish() <= 0:
                return 0
            h = b.head()
            if not b.try_grab(t, self.att.grants_off, 0):
                return 0
        return self.att, t, h

    def undo(self, taken: Held) -> None:
        give_back([taken])

    def count(self) -> None:
        self.att.count(self.ops)


def take_all(atts: Sequence[Attachment], ops: Sequence[int], toks: Sequence[int]) -> bool:
    """All or nothing, now (``all_or_nothing.take_all``): each rate by CAS, replenishing once if
    short.  A race's give-back costs those rates' next replenish up to what it gave back (the
    snapshot clamp counts it as tokens already in the bucket): time lost, never an extra grant."""
    return (
        all_or_nothing.take_all([_Grab(a, o, t) for a, o, t in zip(atts, ops, toks) if o], False)
        is None
    )


def covered(atts: Sequence[Attachment], ops: Sequence[int], toks: Sequence[int]) -> bool:
    """Whether every rate's head covers its tokens, each short one replenished once: the look
    ``take_all`` takes first, stopping at the first rate short even then (what its refusal did;
    on an injected clock the gates' certain refusal does it too: ``attachment.OnClock``)."""
    return not any(_short(att.bucket, t) for att, o, t in zip(atts, ops, toks) if o)


def _short(b: Any, t: int) -> bool:
    """Whether the bucket's head is short of ``t`` tokens even after one replenish."""
    return b.balance() < t and (b.replenish() <= 0 or b.balance() < t)


#: A reservation's claim on one rate: (attachment, tokens, its ticket -- None: covered when taken --,
#: the head read just before the take, the LEN offset of the record holding it -- None: none).
Claim = Tuple[Attachment, int, Any, int, Optional[int]]


def claim(
    att: Attachment,
    ops: int,
    max_ns: float,
    last: bool = True,
    fence: Optional[FenceHold] = None,
) -> Claim:
    """One rate's claim of a reservation over several rates (``MultiLimiter.reserve``), within
    ``max_ns``, replenishing once if refused; ``REFUSED`` as its ticket when refused, taking nothing.
    Its ``ops`` are priced at the claim (``acquisition.price``: the config in force now).

    Queued, it is recorded in a free record of this process's slot on that rate, claimed before
    the CAS that takes it (``Bucket.take_within``'s protocol, as a waiter's ticket): until the
    reservation is made (every rate claimed, the records freed) the claim is a waiter's ticket,
    and should the reservation be refused on a later rate, or this process die or be interrupted
    first, it is given back (``give_back_claims``; a dead process's by the filler's ``reap``).
    With every record in use (five waiters of this process queue there) a claim that is not the
    ``last`` takes nothing: ``NO_RECORD`` as its ticket (the reservation claims another rate first,
    or waits for a record: ``MultiLimiter.reserve``).  The last claim makes the reservation, so it
    needs no record to be given back by: with none free it is taken unrecorded.  A process beyond
    the rate's table has no records at all: a claim there that is not the ``last`` is taken only
    if covered now (``(None, None)``: tokens, which a death part-way loses, stalling no one), else
    nothing (``NO_RECORD``, as with every record in use: the reservation claims the other rates
    first, then polls); never queued, where a death part-way would leave it, in no record, for its
    whole schedule.  On a rate whose attachment is closing (its records no longer handed out) it
    takes nothing and raises ``ValueError``: taken unrecorded there, a claim given back when the
    reservation fails would be held in no record, skipped by no one.
    With ``fence`` the claim's fence is stored
    before its CAS, covered or not (its tokens are used at the reservation's promise); with every
    fence record in use it takes nothing (``NO_RECORD``: the reservation claims another rate first,
    or waits).
    """
    b = att.bucket
    tokens = acquisition.price(b, ops)
    for attempt in range(2):
        h = b.head()
        got, rec = NO_RECORD, None
        with att.writers.writing() as lens:  # (none once the process leaves its slot: close)
            if lens:
                got, rec = b.take_within(tokens, max_ns, lens, att.grants_off, 0, fence)
        if lens and got is NO_RECORD and not last:
            return att, tokens, NO_RECORD, h, None
        if (
            not lens and att.closed
        ):  # its slot is being left: a claim taken now would be in no record
            raise ValueError(f"limiter {att.name!r} was closed while this call ran")
        if (
            got is NO_RECORD and not last
        ):  # no records here: covered now, or nothing (no record to queue in)
            got, rec = b.take_within(tokens, max_ns, (), att.grants_off, 0, fence)
            if got is NO_RECORD and (attempt or b.replenish() <= 0):
                return att, tokens, NO_RECORD, h, None
            if got is NO_RECORD:
                continue
        if got is NO_RECORD:
            got, rec = b.take_within(tokens, max_ns, fence=fence)
        if got is not REFUSED or attempt or b.replenish() <= 0:
            break
    return att, tokens, NO_RECORD if got == NO_FENCE else got, h, rec


def give_back_claims(claims: Sequence[Claim]) -> None:
    """A reservation over several rates refused part-way (or interrupted): every claim it took goes
    back through the give-back mechanism.  A covered one to the head (``give_back``: less the
    head's gain since the take, so the bucket is never fuller than had it never been taken); a
    queued one by the skip (``Attachment.give_back``: its record marked given, the head skips its
    range once every ticket ahead is served), never by moving the head, which would serve the
    tickets ahead of it early.  A claim covered between the look and the skip is lost (time, never
    a grant)."""
    covered: List[Held] = []
    for att, tokens, ticket, h, rec in claims:
        if ticket is not None and not att.bucket.covered(ticket):
            att.give_back(ticket, tokens, rec)
            continue
        att.clear_ticket(rec, tokens)
        covered.append((att, tokens, h if ticket is None or diff(ticket, h) <= 0 else ticket))
    give_back(covered)


def wait_ns(att: Attachment, tokens: int) -> float:
    """The wait (ns) a ticket of ``tokens`` taken now would have on this rate (0: none)."""
    b = att.bucket
    short = -b.balance() + tokens - min(b.pending(), b.cap)
    return b.estimate_wait_ns(short) if short > 0 else 0.0


LEAD, OTHERS, DONE = "lead", "others", "done"


class MultiRequest:
    """One acquire over several rates, as steps that never sleep (``begin``/``next``/``end``, as
    ``acquisition.Request``; run by the same drivers, ``acquisition.drive`` and ``drive_async``)."""

    def __init__(
        self,
        atts: Sequence[Attachment],
        ops: Sequence[int],
        toks: Sequence[int],
        timeout: Optional[float],
    ) -> None:
        timeout = validate_timeout(timeout)
        self.atts = atts
        self.ops = ops
        self.toks = toks
        self.clock = atts[0].clock
        self.deadline: Optional[int] = (
            None if timeout is None else self.clock() + int(timeout * NS_PER_S)
        )
        self.state = DONE
        self.waits: List[
            Tuple[int, Request]
        ] = []  # (rate index, the request waiting for its ticket)
        self.held: List[Held] = []  # tokens granted and not yet used
        # when each was seen covered (the clock's ns), and its rate's tail then
        self.since: List[Tuple[int, int]] = []
        self.lead = -1
        self.joining: List[int] = []  # rates still to join, whose records were all in use (RECORD)
        self.granted = False
        self.wake_ns: Optional[int] = None

    def _left_ns(self) -> float:
        return _INF if self.deadline is None else max(0, self.deadline - self.clock())

    def begin(self) -> acquisition.Step:
        if take_all(self.atts, self.ops, self.toks):
            return self._granted(count=False)
        active = [i for i, o in enumerate(self.ops) if o]
        waits = {i: wait_ns(self.atts[i], self.toks[i]) for i in active}
        left = self._left_ns()
        if any(w > left for w in waits.values()):
            return False  # fails fast: the wait on some rate exceeds the timeout
        self.lead = max(active, key=lambda i: waits[i])
        self.state = LEAD
        return self._join([self.lead])

    def _join(self, which: Sequence[int]) -> acquisition.Step:
        """Take a ticket on each rate of ``which`` (within the time left), each recorded in its rate's
        process slot as a single rate's is (``giveback.take_ticket``): a rate whose records are all in
        use takes nothing, and it and the rest are joined later (``joining``); one that refuses ends
        the request, giving back what it holds (``end``: its queued tickets too).  Each rate's ops
        are priced at its take (``acquisition.price``): a ``set_rate`` while the request waited on
        another rate re-prices them."""
        left = self._left_ns()
        self.joining = []
        for k, i in enumerate(which):
            att = self.atts[i]
            b = att.bucket
            t = self.toks[i] = acquisition.price(b, self.ops[i])
            h = b.head()
            got, rec = take_ticket(
                b, t, att.grants_off, 0, att.writers, left
            )  # counted once all are granted
            if got is REFUSED:
                return self._refuse()
            if got is NO_RECORD:
                self.joining = list(which[k:])
                break
            if got is None:
                self._hold((att, t, h))
            else:
                bound = acquisition.owed_at_most(b, left)  # (taken within it)
                self.waits.append((i, Request.holding(att, 0, got, t, rec, bound=bound)))
                att.cells.handed()  # stored: taken from where the take left it (see ``end``)
        return self._step()

    def _step(self) -> acquisition.Step:
        naps = []
        wakes = []
        still = []
        for i, req in self.waits:
            s = req.next()
            if s is True:
                ticket = req.ticket  # ending the request forgets it
                req.end()
                self._hold((self.atts[i], req.tokens, ticket))  # covered: the head passed it
                continue
            still.append((i, req))
            naps.append(s)
            wakes.append(req.wake_ns)
        self.waits = still
        if self.joining:  # a rate found no free record: look again soon, holding what it holds
            return self._record_nap(naps)
        if still:
            self.wake_ns = min(wakes) if all(w is not None for w in wakes) else None
            return min(naps)  # type: ignore[type-var]
        self.wake_ns = None
        if self.state == LEAD:  # the lead rate's ticket is due: now join the others' queues
            self.state = OTHERS
            rest = [i for i, o in enumerate(self.ops) if o and i != self.lead]
            if rest:
                return self._join(rest)
        return self._granted(count=True)

    def _record_nap(self, naps: List[acquisition.Step]) -> acquisition.Step:
        """``joining``: park as a single rate's request does in ``RECORD`` (``giveback.record_nap``;
        roughly: ``wake_ns`` None), at most until a ticket's turn; refused at the deadline."""
        i = self.joining[0]
        att = self.atts[i]
        nap = record_nap(att.bucket, self.toks[i], bool(att.records), acquisition.MAX_NAP)
        self.wake_ns = None
        if self.deadline is not None:
            left = (self.deadline - self.clock()) / NS_PER_S
            if left <= 0:
                return self._refuse()
            nap = min(nap, left)
        return min([nap, *naps])  # type: ignore[type-var]

    def wait_native(self) -> None:
        """No native wait: a request over several rates waits on each rate's turn in Python, each
        looked at once it is due (the driver sleeps to the earliest, ``wake_ns``)."""
        return None

    def next(self) -> acquisition.Step:
        if self.state == DONE:
            raise RuntimeError("request is done: nothing to wait for")
        if self.joining:  # the rates that found no free record: try them again
            for i in self.joining:
                self.atts[i].bucket.refresh()
            return self._join(self.joining)
        return self._step()

    def _hold(self, held: Held) -> None:
        self.held.append(held)
        self.since.append((self.clock(), held[0].bucket.taken()))

    def _granted(self, count: bool) -> bool:
        if count:
            now = self.clock()
            for (att, tokens, _), (since, tail) in zip(self.held, self.since):
                self._redate(att, tokens, now - since, tail)
            for att, o in zip(self.atts, self.ops):
                if o:
                    att.count(o)
        self.held, self.since = [], []
        self.granted = True
        self.state = DONE
        return True

    @staticmethod
    def _redate(att: Attachment, tokens: int, held_ns: int, tail: int) -> None:
        """The op is used when the call returns, not when its tokens were covered: tokens held
        ``held_ns`` while the other rates' turns came are charged again, up to ``tokens``, so that
        rate's bucket is no fuller than had they been taken now.  (Held, they let the bucket
        refill meanwhile, which a full bucket would have dropped: a lead rate of 1/s, held 0.6 s
        for another rate's queue, granted its next op 0.4 s after the call returned.)  The
        bucket's level differs by at most ``tokens`` and by at most the refill over ``held_ns``:
        charging the lesser loses that little time when it was not full, never grants early.
        Only what the held tokens could have pushed over the capacity is charged: the head now
        (its refill pending counted) less the ``tail`` when they were covered bounds the level
        meanwhile (the tail never moves back).  With a queue behind them on that rate the bucket
        fed it and dropped nothing, and charging every hold there took up to an op's time per
        waiter from all who came after: a throughput lost, not one op's time."""
        b = att.bucket
        now = b.clock()
        top = diff(b.head(), tail) + b.pending(now)
        charge = min(tokens, int(held_ns * b.snap.tpn), top + tokens - b.cap)
        if charge > 0:
            try:
                b.charge(charge, att.grants_off, 0)
            except QueueFullError:  # (a queue that long delays the next callers more already)
                pass

    def _refuse(self) -> bool:
        self.end()
        return False

    def end(self) -> None:
        """Leave: a request not granted gives back the tokens it was granted and did not use,
        and its tickets still queued, as a single rate's are (each ``Request.end``: the head
        skips their ranges, so no later caller waits for them and none jumps the queue)."""
        for _, req in self.waits:
            req.end()
        self.waits = []
        for att in self.atts:  # a ticket a handler kept from reaching ``waits`` (``_join``)
            acquisition.give_back_handed(att)
        if not self.granted:
            held, self.held, self.since = self.held, [], []
            give_back(held)
        self.state = DONE
