"""Reservation fences: a reservation holds the head at most at its fence until its promise.

A reservation ``(t, n, p)`` -- its ticket, its tokens, the moment ``reserve()``
promised -- is counted as granted at ``p``, whenever the head covers ``t``.  If
the head got there sooner (a range ahead given back, tokens put back by
``Bucket.add``, the promise's own margins), the waiters behind would be granted
from the head before ``p`` and fall together with the holder's use.  So every
reservation not yet due keeps a record ``(OWNER, LIMIT, DUE)`` in the segment
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
import os
import time
from typing import Callable, List, Optional, Tuple

from . import layout as L
from .cells import Cells
from .config import MAX_NAP
from .words import MASK64, fence_horizon_ns, signed

#: ``Bucket.take_within`` for a reservation took nothing: every fence record in use.
NO_FENCE = "no fence"
#: A ``reserve()`` that finds every fence record in use naps until the soonest DUE, at least this
#: long (s) and at most ``MAX_NAP`` at a time.
FENCE_NAP = 0.001


class Fences:
    """The fence table of one segment (``slots`` process slots)."""

    def __init__(self, cells: Cells, slots: int) -> None:
        self.cells = cells
        self.hint = L.fence_offset(slots)
        self.gen = self.hint + 8
        self.recs = L.fence_records(slots)
        #: what a native waiter is bound to: FENCE_HINT, the first record, how many
        self.args = (self.hint, self.recs[0], len(self.recs))

    def scan(self, ts: int, now: int, tpn: int, head: int, ticket: Optional[int] = None) -> Optional[Tuple[int, float]]:
        """``(room above head, due of ticket)`` under the fences in force for a claim of ``[ts, now]``,
        None when none is (one load: FENCE_HINT not after ``ts``).  ``words.fence_scan``."""
        return self.cells.fence_scan(self.hint, self.recs[0], len(self.recs), ts, now, tpn, head,
                                     head if ticket is None else ticket)

    def in_force(self, ts: int, tpn: int, head: int) -> List[Tuple[int, int]]:
        """``(LIMIT, DUE)`` of every record in force after ``ts`` (for a promise: ``Schedule.promised_ns``)."""
        c = self.cells
        if c.load(self.hint) <= ts:
            return []
        out = []
        horizon = ts + fence_horizon_ns(tpn)
        for off in self.recs:
            due = c.load(off + L.FENCE_DUE)
            if ts < due <= horizon:
                limit = c.load(off + L.FENCE_LIMIT)
                if abs(signed(limit - head)) <= 1 << 62:
                    out.append((limit, due))
        return out

    def take(self, repl_ts: int) -> Optional[int]:
        """A free record (DUE 0, or before ``repl_ts``, the last claim's time: no claim still to come
        can have it in force), made this process's by one CAS of its OWNER to a new generation (two
        takers never share it); its offset, or None when every record is in use."""
        c = self.cells
        owner = None
        for off in self.recs:
            due = c.load(off + L.FENCE_DUE)
            if due != 0 and due >= repl_ts:
                continue
            was = c.load(off + L.FENCE_OWNER)
            if c.load(off + L.FENCE_DUE) != due:
                continue
            if owner is None:
                owner = (os.getpid() & 0xFFFFFFFF) << 32 | (c.fetch_add(self.gen, 1) + 1) & 0xFFFFFFFF
            if c.cas(off + L.FENCE_OWNER, was, owner):
                return off
        return None

    def store(self, rec: int, limit: int, due: int) -> None:
        """The fence ``(limit, due)`` in ``rec``: LIMIT first, then DUE (a reader that sees the new DUE
        sees the new LIMIT), then FENCE_HINT raised to ``due`` (every claim before it reads the records)."""
        c = self.cells
        c.store(rec + L.FENCE_LIMIT, limit)
        c.store(rec + L.FENCE_DUE, due)
        while True:
            hint = c.load(self.hint)
            if hint >= due or c.cas(self.hint, hint, due):
                return

    def free(self, rec: int, due: int) -> None:
        """``rec`` no longer fences (a reservation refused after storing it): DUE 0, unless taken since."""
        c = self.cells
        d = c.load(rec + L.FENCE_DUE)
        if d == due and due != 0:
            c.cas(rec + L.FENCE_DUE, due, 0)

    def earliest_due(self) -> int:
        """The soonest DUE of the records in use (0: none): when one is free again."""
        dues = [d for d in self.cells.load_many(tuple(off + L.FENCE_DUE for off in self.recs)) if d]
        return min(dues) if dues else 0


class FenceHold:
    """A reservation's fence while its ticket is taken (``Bucket.take_within``): the record it holds
    (``rec``), its DUE (``due``), the promise (``promise``, None: covered at once) and the ticket.
    ``want``: the DUE to store (a reservation over several rates, whose promise is known only once
    every rate is claimed: ``multirate``), else the promise for the ticket about to be taken."""

    __slots__ = ("rec", "want", "due", "promise", "ticket")

    def __init__(self, want: Optional[int] = None) -> None:
        self.rec: Optional[int] = None
        self.want = want
        self.due = 0
        self.promise: Optional[int] = None
        self.ticket: Optional[int] = None

    def put(self, b, new: int, tokens: int, snap) -> bool:
        """Store the fence of the ticket ``new`` (``tokens`` long) before the CAS that takes it: a free
        record (taken once), LIMIT ``new + max(0, C - tokens)`` (``C`` with catch-up's room), then DUE;
        False, storing nothing, when every record is in use.  A DUE beyond the scan's horizon is
        fenced up to it only (twice the longest queue's schedule: a promise that far is never used)."""
        f = b.fences
        if self.rec is None and (rec := f.take(b.cells.load(L.REPL_TS))) is None:
            return False
        self.rec = rec if self.rec is None else self.rec
        self.promise = math.ceil(b.promised_ns(new)) if self.want is None else self.want
        self.due = min(self.promise, b.clock() + fence_horizon_ns(snap.tpn) - 10**9)
        f.store(self.rec, (new + max(0, snap.cap + snap.burst_pool - tokens)) & MASK64, self.due)
        return True

    def settle(self, f: "Fences", due: int) -> None:
        """The reservation over several rates is made: its DUE becomes ``due``, its promise (lowered,
        or raised while the stored one is still ahead: no claim has yet read it past its DUE)."""
        if self.rec is not None:
            f.store(self.rec, f.cells.load(self.rec + L.FENCE_LIMIT), due)
            self.due = due

    def release(self, f: "Fences") -> None:
        """No longer held (refused, given back, or covered at once): the record is free again."""
        if self.rec is not None:
            f.free(self.rec, self.due)
        self.rec, self.promise = None, None


def fenced_ticket(b, clock: Callable[[], int], refill: Callable[[], object], tokens: int,
                  max_wait_ns: float) -> Tuple[Optional[int], Optional[int]]:
    """A reservation's ticket whose wait fits ``max_wait_ns`` (replenishing once if it does not) and
    its promise, its fence stored (``Bucket.take_within``); ``(None, None)`` having taken nothing.
    With every fence record in use it waits until the soonest DUE has passed and a claim after it
    (``refill``: a record is free then), that wait counted against ``max_wait_ns``: refused at once
    when that DUE is beyond it.  (A promise is rarely sooner than the soonest DUE of 64 before it.)"""
    since = clock()
    while True:
        hold = FenceHold()
        ticket, _ = b.take_within(tokens, max_wait_ns, fence=hold)
        if not isinstance(ticket, int) and ticket != NO_FENCE and b.replenish() > 0:
            ticket, _ = b.take_within(tokens, max_wait_ns, fence=hold)
        if ticket != NO_FENCE:
            return (ticket, hold.promise) if isinstance(ticket, int) else (None, None)
        free_at = b.fences.earliest_due()
        if free_at - since > max_wait_ns:
            return None, None
        time.sleep(min(MAX_NAP, max(FENCE_NAP, (free_at - clock()) / 1e9)))
        refill()
