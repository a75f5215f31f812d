"""When tickets are due: the bucket's clock arithmetic, read from its rovers (a base of ``Bucket``).

``due_ns`` is a waiter's wake time, the earliest a replenish could cover a
ticket; ``promised_ns`` is a reservation's moment, never earlier than the head
can get there (see docs/design.md, "When a reservation is due"); both count
the reservations' fences before the ticket (``fences``).
"""

from __future__ import annotations

from typing import Callable, List, Optional, Tuple

from shmlimit.bucket.fences import Fences
from shmlimit.shm import layout as L
from shmlimit.shm.banks import Snapshot
from shmlimit.shm.cells import MASK64, Cells
from shmlimit.shm.table import table_slots
from shmlimit.shm.words import (
    FAR,
    FENCE_LATE,
    REC_BUSY,
    REC_GIVEN,
    SPAN_MAX,
    behind,
    callers_between,
    claim_of,
    clamp_limit,
    diff,
    late_window,
    recorded_ranges,
)

#: The filler replenishes this often (ns): the pace a queued head can count on (see estimate_wait_ns).
FILL_NS = 1_000_000
#: The filler's longest pause while callers queue (ns; ``filler.MAX_FILL_PERIOD``): a replenish
#: comes at least this often, however slow the rate, while the filler gets the CPU.
LONGEST_FILL_NS = 20_000_000


def stop_ns(snap: Snapshot) -> float:
    """What a stop (``count_stops``) may cost the head, in ns: two replenishes, at the filler's
    pace or every half capacity, whichever is longer."""
    return max(2.0 * FILL_NS, snap.cap / snap.tpn / 2)


def count_stops(c: Cells, lens: Tuple[int, ...], head: int, ticket: int, cap: int) -> int:
    """How many times the head may stop between ``head`` and ``ticket`` (``bucket.clamp_words``).

    Where a snapshot's head stands in a range no record tells (a reservation), the clamp lets the
    head go no further than a token short of the end of the first recorded request after it (or
    the tail): each recorded request that follows no recorded one.  The head stops there
    until a snapshot taken there: up to two replenishes.  So may it at the end of a recorded
    request of half the capacity ``cap`` or more (the clamp of a snapshot inside it allows
    ``max(cap, its length)`` from its start, which a replenish may reach within it or just after
    it).  Counted from the ticket records (``lens`` their LEN offsets): each such boundary strictly
    between ``head`` and ``ticket``.
    """
    if diff(ticket, head) <= 0 or not lens:
        return 0
    span = diff(ticket, head)
    starts, ends, big = set(), set(), set()
    for st, e, n in recorded_ranges(c, lens):
        ends.add(e)
        if 0 < diff(st, head) < span:
            starts.add(st)
        if 2 * n >= cap and 0 < diff(e, head) < span:
            big.add(e)
    return len(starts - ends) + len(big)


def first_granted(granting: List[Tuple[Optional[int], int]], after: int, tail: int) -> int:
    """The first rover past ``after`` the head may not pass before a reservation's promise: the
    start of the first of the ``granting`` ranges (``Schedule.granting``) that ends past it
    (``after`` itself if one straddles it or its start is not known), else ``tail``."""
    stop = tail
    for start, end in granting:
        if diff(end, after) <= 0:
            continue
        if start is None or diff(start, after) <= 0:
            return after
        stop = behind(stop, start)
    return stop


class Schedule:
    """Reads only: ``Bucket`` provides the cells, its config snapshot, its clock and its records."""

    cells: Cells
    snap: Snapshot
    clock: Callable[[], int]
    tpn: int

    @property
    def fences(self) -> Fences:
        """This segment's reservation fences (``fences``; its table's size read once)."""
        f = getattr(self, "_fences", None)
        if f is None:
            f = self._fences = Fences(self.cells, table_slots(self.cells))
        return f

    def _record_lens(self) -> Tuple[int, ...]:
        """Every ticket record's LEN offset in this segment (its table's size read once, with the
        fences': ``layout.record_lens``)."""
        return L.record_lens(self.fences.slots)

    def fenced(self, head: int, to: int) -> int:
        """``to``, or the fence before it that a move of the head from ``head`` now must keep."""
        ts = self.cells.load(L.REPL_TS)
        f = self.fences.scan(ts, max(ts, self.clock()), self.snap.tpn, head)
        return to if f is None else behind(to, (head + f[0]) & MASK64)

    def refund_to(self, head: int, tail: int, to: int) -> Tuple[int, List[Tuple[int, int, int]]]:
        """Where tokens given back (``Bucket.add``: a refund, a lease) may bring the head from ``head``
        towards ``to`` (``tail`` read before), and the fences whose promise has passed they move:
        ``(record, LIMIT, new LIMIT)``.

        A fence not yet due holds them at its LIMIT: it anchors the schedule of everything behind
        its reservation, the slots promised since included (``_fenced_ns``), and a refund is owed
        only to the windows that hold it, which a window from the promise on does not.  (Passed
        over another reservation's range, a 1-op refund at 10/s with a burst of 4 let a 1-op slot
        be promised 300 ms early, with the 2-op and 3-op slots before it: 6 ops in 100 ms.)  Debt
        is no grant: a charge moves the fences past its own (``over_debt``), so a refund of it
        lands whole.  A fence whose promise has passed -- a claim after its DUE lifts it; one
        due between that claim and this reading holds the head at its slope -- cuts nothing: a
        window that holds its promise and a grant the refund makes holds the refund too.  Its
        LIMIT moves as far first (``Fences.pass_over``): the head never stands past one a claim
        reads."""
        c = self.cells
        ts = c.load(L.REPL_TS)
        now = max(ts, self.clock())
        due_ones = []
        for rec, limit, due in self.fences.held(ts, now, self.snap.tpn, head):
            if due > now:
                to = behind(to, limit)
            else:
                due_ones.append((rec, limit, (limit + (now - due) * self.snap.tpn) & MASK64))
        return to, [
            (rec, limit, (limit + diff(to, at)) & MASK64)
            for rec, limit, at in due_ones
            if diff(to, at) > 0
        ]

    def over_debt(self, start: int, debt: int, tail: int) -> List[Tuple[int, int, int]]:
        """The fences a debt of ``debt`` tokens queued from ``start`` (a ``settle`` charge, ``tail``
        read after it) moves on by as much: ``(record, LIMIT, new LIMIT)``.

        A fence anchors the schedule behind its reservation: its room ``LIMIT - t = C - n`` bounds
        the grants behind it before the promise, and the slots promised behind it count from its
        LIMIT.  Debt is no grant, and counted there it would hold the head at the LIMIT with the
        debt still in the way (once a refund, or the clock, brought it there early), and push
        every slot behind it back: time lost.  Moved by the debt, a fence counts what it counted
        before, for any ticket behind the debt.  A LIMIT at or past ``start`` moves by all of it
        (the room then holds the debt, its grants unchanged); one before it only over ranges the
        head grants no one by reaching them: up to the first recorded range ending past it, or the
        tail (``first_granted``: a waiter's), and not at all while another fence in force has its
        LIMIT past this one's.  That one's reservation may lie between (its range ends at its
        ticket, at or before its LIMIT, and no record tells it), granted at its own promise: moved
        over it, the head covered it as this fence lifted, and reached the callers behind it that
        much early (10/s, capacity 4: a 6-op slot, the 1-op waiter behind a 3-op slot 100 ms after
        it, then that slot: 10 ops in 300 ms).  Every reservation behind this one's LIMIT has a
        fence in force while this one is (stored before its ticket's CAS, its promise counting
        this fence).  Only a fence whose ticket is before ``start`` may move: with ``start`` at
        most ``C`` (with catch-up's room) past its LIMIT; one stored since for a ticket after the
        debt is at least ``debt + C`` past it (its ``C`` then in force: a smaller one, after a
        ``set_rate``, that passes this test is left a room of at most the current ``C - n``)."""
        c = self.cells
        ts = c.load(L.REPL_TS)
        now = max(ts, self.clock())
        room = self.snap.cap + self.snap.burst_pool
        held = [
            (rec, limit)
            for rec, limit, due in self.fences.held(ts, now, self.snap.tpn, c.load(L.HEAD))
            if due > now
        ]
        granting: Optional[List[Tuple[Optional[int], int]]] = None
        moves = []
        for rec, limit in held:
            if diff(limit, start) > room:
                continue
            new = (limit + debt) & MASK64
            if diff(limit, start) < 0:
                if any(diff(other, limit) > 0 for _, other in held):
                    continue  # another reservation's range may lie between
                granting = self.granting(tail) if granting is None else granting
                new = behind(new, first_granted(granting, limit, tail))
            if diff(new, limit) > 0:
                moves.append((rec, limit, new))
        return moves

    def granting(self, tail: int) -> List[Tuple[Optional[int], int]]:
        """The recorded ranges the head grants by reaching them, up to ``tail``: ``(start, end)``,
        ``start`` None where it is not known (being written, changed under the read, corrupt).
        The tail is read before the records: every ticket up to it holds its record's TICKET word
        (stored before the grab's CAS).  One ``load_many`` of the lengths, one load per record in
        use."""
        c = self.cells
        lens = self._record_lens()
        out: List[Tuple[Optional[int], int]] = []
        for len_off, v in zip(lens, c.load_many(lens)):
            if v == 0:
                continue
            end = c.load(len_off - 8)
            if diff(end, tail) > 0:
                continue
            if v & REC_BUSY or c.load(len_off) != v or not 0 < (v & ~REC_GIVEN) <= SPAN_MAX:
                out.append((None, end))
            elif not v & REC_GIVEN:  # (given back: no one is granted it)
                out.append(((end - v) & MASK64, end))
        return out

    def covered(self, ticket: int) -> bool:
        """True once the head has reached ``ticket``: its grab may proceed."""
        return diff(ticket, self.cells.load(L.HEAD)) <= 0

    def deficiency(self, ticket: int) -> int:
        """Tokens the grab holding ``ticket`` is still owed (0 once it may proceed)."""
        return max(0, diff(ticket, self.cells.load(L.HEAD)))

    def head(self) -> int:
        """The head rover now (for ``give_back``)."""
        return self.cells.load(L.HEAD)

    def balance(self) -> int:
        """``HEAD - TAIL`` in tokens: available when positive, owed to waiters when negative."""
        tail = self.cells.load(L.TAIL)
        return diff(self.cells.load(L.HEAD), tail)

    def taken(self) -> int:
        """The tail rover: every token ever taken or queued for (wrapping at 2**64; compare with ``diff``).
        Its advance over a period is that period's demand (grants, tickets, burned tokens alike)."""
        return self.cells.load(L.TAIL)

    def wait_ns(self, ticket: int, short: int, snap: Snapshot) -> float:
        """The wait (ns) of ``ticket``, ``short`` tokens away: at the pace the head can keep
        (``estimate_wait_ns``), no sooner than the fences before it let the head get there, and
        with the time late reservations before it still own (``_reserved_ns``)."""
        wait = self.estimate_wait_ns(short, snap)
        c = self.cells
        ts = c.load(L.REPL_TS)
        head = c.load(L.HEAD)
        # (now for the horizon, as a claim counts it: only the due it answers is used here)
        f = self.fences.scan(ts, max(ts, self.clock()), snap.tpn, head, ticket)
        if f is not None:  # (records in force: none, and no reservation is late either)
            wait = max(wait, f[1] - self.clock()) + self._reserved_ns(ticket, ts, head, snap)
        return wait

    def estimate_wait_ns(self, short: int, snap: Optional[Snapshot] = None) -> float:
        """Nanoseconds until ``short`` more tokens reach the head, at the speed the head can really move.

        The clamp lets one replenish add at most a capacity minus the previous
        interval's tokens, so under a queue the head gains at most about half a
        capacity per replenish.  With replenishes every ``FILL_NS`` (the
        filler), a capacity smaller than two fill intervals moves the head
        slower than the rate, and the wait is that much longer.
        """
        s = snap or self.snap
        return max(short / s.tpn, short / max(1, s.cap // 2) * FILL_NS)

    def pending(self, now: Optional[int] = None) -> int:
        """Tokens a replenish at ``now`` would add at most (before the capacity clamp)."""
        now = self.clock() if now is None else now
        return max(0, now - self.cells.load(L.REPL_TS)) * self.tpn

    def refilled_since(self, since_ns: int) -> bool:
        """Has a replenish claimed time up to ``since_ns`` (CLOCK_MONOTONIC ns) or later?"""
        return diff(self.cells.load(L.REPL_TS), since_ns) >= 0

    def next_promised_ns(self, tokens: int) -> float:
        """When (CLOCK_MONOTONIC ns) a ticket of ``tokens`` taken now would be due (``promised_ns``): advice
        (``retry_after``), not a grant, so without the pause a replenish that adds nothing may take
        (a caller that comes then replenishes itself, and is refused if that one added nothing)."""
        return self.promised_ns((self.cells.load(L.TAIL) + tokens) & MASK64, pause=False)

    def due_ns(self, ticket: int) -> float:
        """The earliest instant (CLOCK_MONOTONIC ns) a replenish could cover ``ticket``: when its waiter looks.

        The head holds every token up to the last replenish time, so the
        ticket is due that long after it.  A replenish claims its time
        before it adds its tokens, so the head is read first: a pair read
        across a replenish then has the newer time and the older head, and
        can only make the answer later, never earlier.  A wake time, never a
        promise: the next replenish's clamp may leave less room than that
        (``promised_ns``), and a waiter that finds its ticket still short
        after replenishing simply looks again.
        """
        c = self.cells
        head = c.load(L.HEAD)
        ts = c.load(L.REPL_TS)
        due = ts + max(0, diff(ticket, head)) / self.tpn
        # a reservation's fence before the ticket holds the head there until its DUE, then lets it
        # gain at the rate: woken sooner, the waiter would replenish in vain until then
        f = self.fences.scan(
            ts, max(ts, self.clock()), self.tpn, head, ticket
        )  # (the horizon from now)
        return due if f is None else max(due, f[1])

    def clamp_limit_at(self, head: int, cap: int) -> int:
        """Where the next replenish may bring the head from ``head``: the limit the clamp words
        left by the last claim give (``words.clamp_limit``), the tail read after the words."""
        c = self.cells
        base, end, nxt = c.load(L.SNAP_BASE), c.load(L.SNAP_END), c.load(L.SNAP_NEXT)
        return clamp_limit(base, end, nxt, cap, head, c.load(L.TAIL))

    def stops_at(self, ticket: int, tokens: int) -> bool:
        """Does the head stop at ``ticket`` (the end of a request ``tokens`` long; 0: not known)?

        There the clamp cuts short a replenish that covers the ticket late: the time since it
        fell due is lost, to it and to every request behind (``Bucket.apply`` counts it starved).
        Always so when the request alone fills the capacity: no snapshot taken at its start or
        before lets the head past its end (``min(max(base + cap, end), next)`` is at most its end);
        else when the clamp words now name the ticket as the limit.  A waiter whose head stops at
        its ticket replenishes at the due instant itself, not a wake's lateness after it.
        """
        if tokens >= self.snap.cap:
            return True
        return self.clamp_limit_at(self.cells.load(L.HEAD), self.snap.cap) == ticket

    def promised_ns(self, ticket: int, pause: bool = True) -> float:
        """When (CLOCK_MONOTONIC ns) the head reaches ``ticket`` at the current rate, if replenished
        as often as needed from now on: the moment a reservation owns its slot, never earlier than
        the head can get there.

        The head holds every token up to the last replenish time (``REPL_TS``),
        and the time since then becomes tokens only up to what the next
        replenish's clamp allows: the room below the limit its clamp words give
        (``bucket.clamp_limit``: a capacity from the start of the request the
        snapshot's head stood in, invariants 1 and 3).  Up to that room the ticket is due that long
        after ``REPL_TS``; beyond it the next replenish drops the rest of its
        interval, and the tokens still short accrue only from then: from now at
        the earliest (and 1 ns after ``REPL_TS``: a claim needs time elapsed),
        at the pace the head can keep (``estimate_wait_ns``).  (A snapshot older than the last grab -- a full bucket
        taken by a grab that did not replenish, whose next claim was lost to a
        replenisher that read the rovers before that grab -- leaves no room:
        counting from ``REPL_TS`` there would promise time the bucket spent
        full, a slot up to a fill interval early.)  The head is read first and
        the snapshot before ``REPL_TS``: read across a replenish, an older head
        and an older snapshot (lower rovers: less room) can only make the
        answer later, never earlier.
        """
        c = self.cells
        snap = self.snap
        head = c.load(L.HEAD)
        limit = self.clamp_limit_at(head, snap.cap)
        ts = c.load(L.REPL_TS)
        short = max(0, diff(ticket, head))
        room = max(0, diff(limit, head))
        if short <= room:
            # one replenish at that moment could reach the ticket, but the filler's, sooner, take
            # snapshots that stop the head before it: two replenishes' time for each such stop
            stops = count_stops(c, self._record_lens(), head, ticket, snap.cap) if short > 0 else 0
            return max(
                ts + short / snap.tpn + stops * stop_ns(snap),
                self._fenced_ns(ticket, ts, head, snap),
            ) + self._reserved_ns(ticket, ts, head, snap)
        # the next replenish claims some time: not before now, nor before REPL_TS + 1 ns; the rest
        # then comes at the pace the head can keep (estimate_wait_ns: slower for a capacity under
        # two fill intervals, where each replenish may add only half a capacity), and each stop
        # on the way costs two replenishes' time more
        stops = count_stops(c, self._record_lens(), head, ticket, snap.cap)
        lost = 0
        if room == 0 and pause:
            # Words that leave no room predate the head (it moved past their limit since they were
            # taken: a skip, an add, a drain of a full bucket, and no claim since -- no time had
            # passed, or another's claim read the rovers before): the next replenish adds nothing,
            # whenever it comes, and only then leaves words at the head.  Its whole interval is
            # lost: counted from now, a promise would be early by as long as that replenish is in
            # coming (the filler's next tick), so it counts the filler's longest pause.
            lost = LONGEST_FILL_NS
        return max(
            self._fenced_ns(ticket, ts, head, snap),
            max(self.clock(), ts + max(1.0, room / snap.tpn))
            + lost
            + self.estimate_wait_ns(short - room, snap)
            + stops * stop_ns(snap),
        ) + self._reserved_ns(ticket, ts, head, snap)

    def _reserved_ns(self, ticket: int, ts: int, head: int, snap: Snapshot) -> int:
        """The time (ns) from now the head will not gain, owned by the reservations before
        ``ticket`` it runs late for (``words.late_window``: as the next claim judges them, or, for
        one whose time has not begun, as the claim then would after replenishes at the filler's
        pace): 0 when none is."""
        if diff(ticket, head) <= 0:
            return 0
        c = self.cells
        now = max(ts, self.clock())
        tail = c.load(L.TAIL)
        words = (c.load(L.SNAP_BASE), c.load(L.SNAP_END), c.load(L.SNAP_NEXT))
        view = claim_of(ts, now, head, tail, words, snap.tpn, snap.cap, snap.cap + snap.burst_pool)
        # where the head can be when a reservation's time begins: the next claim adds at most
        # ``reach`` (from REPL_TS), the claims after it the rate's (the filler's pace)
        soonest = (head + min((now - ts) * snap.tpn, view.reach)) & MASK64
        callers = self._callers(head, tail)
        total = 0
        for rec, _, due in self.fences.held(ts, now, snap.tpn, head):
            start, word = c.load_many((rec + L.FENCE_START, rec + L.FENCE_TOKENS))
            if diff(ticket, start) <= 0:
                continue
            # as the next claim, landing now, judges it; one whose time has not begun, as a claim
            # landing then would, the head where it can be by then
            got = late_window(start, word, due, view)
            if got is None and not word & FENCE_LATE:
                opens = due - min(due, (word // snap.tpn))
                if opens >= now:
                    ahead = view._replace(ts=now, now=opens + 1, head=soonest, reach=FAR, cap=FAR)
                    got = late_window(start, word, due, ahead)
            if got is not None and (not got[2] or callers(start)):
                total += got[1] - max(now, got[0])
        return total

    def _callers(self, head: int, tail: int) -> Callable[[int], bool]:
        """``callers(start)``: whether a recorded request the head grants by reaching it lies
        between ``head`` and ``start`` (``words.callers_between``; the records read once, when
        first asked)."""
        ranges: Optional[List[Tuple[Optional[int], int]]] = None

        def callers(start: int) -> bool:
            nonlocal ranges
            if ranges is None:
                ranges = self.granting(tail)
            return callers_between(ranges, head, start)

        return callers

    def _fenced_ns(self, ticket: int, ts: int, head: int, snap: Snapshot) -> float:
        """The soonest the head reaches ``ticket`` under the reservations' fences before it: each holds
        the head at its LIMIT until its DUE, after which it moves at the pace it can keep, stopping on
        the way (``count_stops``): 0 when none is in force."""
        at = 0.0
        if diff(ticket, head) <= 0:
            return at
        for limit, due in self.fences.in_force(ts, max(ts, self.clock()), snap.tpn, head):
            ahead = diff(ticket, limit)
            if ahead > 0:
                stops = count_stops(self.cells, self._record_lens(), limit, ticket, snap.cap)
                at = max(at, due + self.estimate_wait_ns(ahead, snap) + stops * stop_ns(snap))
        return at
