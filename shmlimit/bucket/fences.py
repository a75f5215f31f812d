"""Reservation fences: a reservation holds the head at most at its fence until its promise.

A reservation ``(t, n, p)`` -- its ticket, its tokens, the moment ``reserve()``
promised -- is counted as granted at ``p``, whenever the head covers ``t``.  If
the head got there sooner (a range ahead given back, tokens put back by
``Bucket.add``, the promise's own margins), the waiters behind would be granted
from the head before ``p`` and fall together with the holder's use.  So every
reservation not yet due keeps a record ``(START, LIMIT, DUE, TOKENS)`` in the segment
(``layout.fence_records``), ``LIMIT = t + max(0, C - n)`` (``C`` the capacity,
with catch-up's room) and ``DUE = p``, and every move of the head keeps

    head <= LIMIT + max(0, now - DUE) * tpn

for each record in force (its DUE after the start of the claim's interval):
held at the fence until ``p``, then gaining on it only at the rate.  A window
holding ``p`` then counts ``n`` and at most ``C - n`` tokens granted behind it
before ``p`` and the rate's after it (docs/design.md, "Reservation fences").

The record is taken before the tail's CAS and its LIMIT then DUE stored
before it: a replenish that read the records before they were stored clamps
against words from a snapshot whose tail was read before that CAS, so it
stops at most a capacity past ``t - n``, which is ``LIMIT``.
"""

from __future__ import annotations

import math
import time
from typing import Callable, List, Optional, Tuple

from shmlimit.config import MAX_NAP
from shmlimit.shm import layout as L
from shmlimit.shm.cells import Cells
from shmlimit.shm.words import (
    MASK64,
    Claim,
    fence_horizon_ns,
    fence_reserved,
    fences_in_force,
    mark_late,
)

#: ``Bucket.take_within`` for a reservation took nothing: every fence record in use.
NO_FENCE = "no fence"
#: A ``reserve()`` that finds every fence record in use naps until the soonest DUE, at least this
#: long (s) and at most ``MAX_NAP`` at a time.
FENCE_NAP = 0.001


class Fences:
    """The fence table of one segment (``slots`` process slots)."""

    def __init__(self, cells: Cells, slots: int) -> None:
        self.cells = cells
        self.slots = slots
        self.hint = L.fence_offset(slots)
        self.recs = L.fence_records(slots)
        #: what a native waiter is bound to: FENCE_HINT, the first record, how many
        self.args = (self.hint, self.recs[0], len(self.recs))

    def scan(
        self, ts: int, now: int, tpn: int, head: int, ticket: Optional[int] = None
    ) -> Optional[Tuple[int, float]]:
        """``(room above head, due of ticket)`` under the fences in force for a claim of ``[ts, now]``,
        None when none is (one load: FENCE_HINT not after ``ts``).  ``words.fence_scan``."""
        return self.cells.fence_scan(
            *self.args, ts, now, tpn, head, head if ticket is None else ticket
        )

    def reserved(self, claim: Claim, callers: Callable[[int], bool]) -> int:
        """The tokens of ``claim`` owned by reservations the head runs late for
        (``words.fence_reserved``): the claim adds none of them.  Call it before the claim's CAS:
        the records it finds late first are marked here, while still in force for it."""
        tokens, found = fence_reserved(self.cells, *self.args, claim, callers)
        if found:
            mark_late(self.cells, self.hint, claim.tpn, found)
        return tokens

    def in_force(self, ts: int, now: int, tpn: int, head: int) -> List[Tuple[int, int]]:
        """``(LIMIT, DUE)`` of every record in force for a claim of ``[ts, now]``, by the scan's own
        tests (``words.fence_due_counts``, ``fence_limit_counts``: the horizon counted from ``now``, as
        the scan counts it; for a promise, ``Schedule.promised_ns``)."""
        return [(limit, due) for _, limit, due in self.held(ts, now, tpn, head)]

    def held(self, ts: int, now: int, tpn: int, head: int) -> List[Tuple[int, int, int]]:
        """``(record, LIMIT, DUE)`` of every record in force for a claim of ``[ts, now]`` (``in_force``;
        ``words.fences_in_force``, the scan's own reader)."""
        return list(fences_in_force(self.cells, *self.args, ts, now, tpn, head))

    def pass_over(self, rec: int, limit: int, to: int) -> bool:
        """The fence in ``rec`` moves from ``limit`` to ``to`` (one CAS; False when its LIMIT changed
        meanwhile): past a charge's debt, which grants no one (``Schedule.over_debt``), so the
        grants behind the reservation before its promise stay within ``C - n``; or, its promise
        passed, as far as tokens given back take the head (``Schedule.refund_to``).  Valid
        whoever owns the record: it says where those tokens lie, not whose the fence is."""
        return self.cells.cas(rec + L.FENCE_LIMIT, limit, to)

    def take(self, repl_ts: int, horizon: int = 1 << 63) -> Optional[Tuple[int, int]]:
        """A free record, claimed by one CAS of its DUE: ``(offset, pending)``, or None when every
        record is in use.

        Free: DUE 0, before ``repl_ts`` (the last claim's time: no claim still to come can have it in
        force), or beyond ``horizon`` (no reservation stored it: every scan ignores it).  The claim
        stores ``pending`` there, ``repl_ts`` itself (1 for 0): in force for no claim, and free again
        once a replenish moves ``REPL_TS`` past it.  So two takers never both own a record: a second
        CAS from the free value fails; and a taker whose pending record was claimed again
        meanwhile learns it from its own CAS of LIMIT or DUE (``put``), which then fails."""
        c = self.cells
        pending = max(1, repl_ts)
        for off in self.recs:
            due = c.load(off + L.FENCE_DUE)
            if due != 0 and repl_ts <= due <= horizon:
                continue
            if due == pending or not c.cas(off + L.FENCE_DUE, due, pending):
                continue
            return off, pending
        return None

    def store(self, rec: int, limit: tuple, due: tuple, span: tuple = ((0, 0), (0, 0))) -> bool:
        """The fence in ``rec``: START and TOKENS (``span``), LIMIT, then DUE, each by one CAS from
        the value this owner last saw there (each ``(expected, new)``), then FENCE_HINT raised to
        the new DUE (every claim before it reads the records).  False when a CAS failed: the record
        was claimed again since (its DUE had passed ``REPL_TS``), and is no longer this owner's;
        what it wrote is then in force for no claim (the new owner's pending DUE stands, or its own
        CAS fails in turn).  A reader that sees the new DUE sees the other new words."""
        c = self.cells
        for off, (old, new) in zip(
            (L.FENCE_START, L.FENCE_TOKENS, L.FENCE_LIMIT), (span[0], span[1], limit)
        ):
            if old != new and not c.cas(rec + off, old, new):
                return False
        if not (
            c.cas(rec + L.FENCE_DUE, due[0], due[1])
            if due[0] != due[1]
            else c.load(rec + L.FENCE_DUE) == due[0]
        ):
            return False  # (a record claimed again holds a DUE other than this owner's: a newer REPL_TS)
        while True:
            hint = c.load(self.hint)
            if hint >= due[1] or c.cas(self.hint, hint, due[1]):
                return True

    def free(self, rec: int, due: int) -> None:
        """``rec`` no longer fences (a reservation refused after storing it): DUE 0, by one CAS from
        the DUE this owner stored (taken since by another: left as it is)."""
        if due != 0:
            self.cells.cas(rec + L.FENCE_DUE, due, 0)

    def earliest_due(self) -> int:
        """The soonest DUE of the records in use (0: none): when one is free again."""
        dues = [d for d in self.cells.load_many(tuple(off + L.FENCE_DUE for off in self.recs)) if d]
        return min(dues) if dues else 0


def held_ns(tpn: int) -> int:
    """How far ahead of now (ns) a reservation's fence holds: its DUE's horizon, less a second."""
    return fence_horizon_ns(tpn) - 10**9


def beyond_hold(wait_ns: float, hold_ns: float) -> ValueError:
    """The refusal of a reservation whose wait (ns) is longer than its fence can hold (``hold_ns``)."""
    return ValueError(
        f"reserve: the wait would be {wait_ns / 1e9:.0f} s, longer than a reservation can be "
        f"held ({hold_ns / 1e9:.0f} s at this rate): reserve fewer ops at once, or give the "
        "limiter a larger burst"
    )


class FenceHold:
    """A reservation's fence while its ticket is taken (``Bucket.take_within``): the record it holds
    (``rec``), its DUE (``due``) and the promise (``promise``, None: covered at once).
    ``want``: the DUE to store (a reservation over several rates, whose promise is known only once
    every rate is claimed: ``multirate``), else the promise for the ticket about to be taken."""

    __slots__ = ("rec", "want", "due", "limit", "span", "promise")

    def __init__(self, want: Optional[int] = None) -> None:
        self.rec: Optional[int] = None
        self.want = want
        self.due = 0  # the DUE this owner last stored in ``rec`` (its pending claim at first)
        self.limit = 0  # the LIMIT it last saw or stored there
        self.span = (0, 0)  # the START and TOKENS it last saw or stored there
        self.promise: Optional[int] = None

    def put(self, b, new: int, tokens: int, snap) -> bool:
        """Store the fence of the ticket ``new`` (``tokens`` long) before the CAS that takes it: a free
        record (taken once, ``Fences.take``), LIMIT ``new + max(0, C - tokens)`` (``C`` with catch-up's
        room), then DUE, each by a CAS from what this owner saw (a record claimed again meanwhile is
        left as it is, and another taken); False, storing nothing, when every record is in use.  A
        promise beyond the scan's horizon (twice the longest queue's schedule at the rate: reachable
        only at the slower pace of a small capacity) is a ValueError, taking nothing; a provisional
        DUE that far (``want``: several rates, which refuse a final one that far) is fenced up to
        it only."""
        f = b.fences
        while True:
            now = b.clock()
            horizon = now + fence_horizon_ns(snap.tpn)
            if self.rec is None:
                got = f.take(b.cells.load(L.REPL_TS), horizon)
                if got is None:
                    return False
                self.rec, self.due = got
                start, tokens_seen, self.limit = b.cells.load_many(
                    (self.rec + L.FENCE_START, self.rec + L.FENCE_TOKENS, self.rec + L.FENCE_LIMIT)
                )
                self.span = (start, tokens_seen)
            promise = math.ceil(b.promised_ns(new)) if self.want is None else self.want
            held = held_ns(snap.tpn)
            if self.want is None and promise - now > held:
                # its fence would lift before the promise, and the head, moving faster than the
                # pace promised (a capacity under two fill intervals, waiters replenishing), would
                # grant those behind it first: refused, as a wait that long is never meant
                raise beyond_hold(promise - now, held)
            due = min(promise, now + held)
            limit = (new + max(0, snap.cap + snap.burst_pool - tokens)) & MASK64
            span = ((new - tokens) & MASK64, tokens)
            if f.store(
                self.rec,
                (self.limit, limit),
                (self.due, due),
                ((self.span[0], span[0]), (self.span[1], span[1])),
            ):
                self.limit, self.due, self.span, self.promise = limit, due, span, promise
                return True
            # claimed again by another while this owner was off the CPU (its DUE then differs: left
            # as it is), or its LIMIT moved by a charge (``Fences.pass_over``: a fence for a ticket
            # this owner never took, freed): take another
            f.free(self.rec, self.due)
            self.rec = None

    def settle(self, f: "Fences", due: int) -> bool:
        """The reservation over several rates is made: its DUE becomes ``due``, its promise (lowered,
        or raised while the stored one is still ahead: no claim has yet read it past its DUE).  False
        when the record was claimed again by another meanwhile (its provisional DUE had passed): the
        reservation then holds no fence there, and must be made again."""
        if self.rec is None:
            return True
        if not f.store(self.rec, (self.limit, self.limit), (self.due, due)):
            self.rec = None
            return False
        self.due = due
        return True

    def release(self, f: "Fences") -> None:
        """No longer held (refused, given back, or covered at once): the record is free again."""
        if self.rec is not None:
            f.free(self.rec, self.due)
        self.rec, self.promise = None, None


def fenced_ticket(
    b, clock: Callable[[], int], refill: Callable[[], object], tokens: int, max_wait_ns: float
) -> Tuple[Optional[int], Optional[int]]:
    """A reservation's ticket whose wait fits ``max_wait_ns`` (replenishing once if it does not) and
    its promise, its fence stored (``Bucket.take_within``); ``(None, None)`` having taken nothing.
    With every fence record in use it waits until the soonest DUE has passed and a claim after it
    (``refill``: a record is free then), that wait counted against ``max_wait_ns``: refused at once
    when that DUE is beyond it.  (A promise is rarely sooner than the soonest DUE of 64 before it.)"""
    since = clock()
    while True:
        hold = FenceHold()
        left = max_wait_ns - (clock() - since)  # (what a nap for a record took is waited already)
        ticket, _ = b.take_within(tokens, left, fence=hold)
        if not isinstance(ticket, int) and ticket != NO_FENCE and b.replenish() > 0:
            ticket, _ = b.take_within(tokens, left, fence=hold)
        if ticket != NO_FENCE:
            return (ticket, hold.promise) if isinstance(ticket, int) else (None, None)
        free_at = b.fences.earliest_due()
        if free_at - since > max_wait_ns:
            return None, None
        time.sleep(min(MAX_NAP, max(FENCE_NAP, (free_at - clock()) / 1e9)))
        refill()
