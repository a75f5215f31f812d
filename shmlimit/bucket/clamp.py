"""The replenish clamp's words: what a snapshot lets the next replenish add, read from the ticket records.

A replenish that leaves the snapshot ``(head, tail)`` (``Bucket.claim``) leaves
beside it the clamp the next replenish applies: ``SNAP_BASE``, ``SNAP_END``,
``SNAP_NEXT`` (``layout``), which allow the head up to
``min(max(SNAP_BASE + CAP, SNAP_END), SNAP_NEXT)`` (``words.clamp_limit``).
Invariant 1 of the bucket: a capacity counted from the start of the request
the head stands in, never from the head (docs/design.md, "The clamp counts
from the request's start").
"""

from __future__ import annotations

import itertools
from typing import Optional, Tuple

from shmlimit.shm import layout as L
from shmlimit.shm.cells import Cells
from shmlimit.shm.words import MASK64, clamp_reach, diff

#: The clamp words a replenish leaves for the next one: base, end, next.
CLAMP_WORDS = (L.SNAP_BASE, L.SNAP_END, L.SNAP_NEXT)


def clamp_words(
    c: Cells, lens: Tuple[int, ...], head: int, tail: int
) -> Optional[Tuple[int, int, int]]:
    """The clamp the snapshot ``(head, tail)`` allows the next interval: ``(base, end, next)``.

    ``base`` is the start of the waiter's request the head stands in, read from the ticket
    records (``lens``: their LEN offsets; every queued waiter's ticket is recorded, its record
    claimed before the CAS that takes it), ``end`` that request's end; outside any recorded
    request both are the head.  So a request is never granted together with more than
    ``max(cap, its length)`` counted from its start.  Outside a recorded request, ``next`` is where
    the records let the head go: a token short of the end of the first recorded request after
    it, or the tail, whichever is nearest: so a range no record tells (a reservation, a waiter's
    whose record is being written) is never granted together with a recorded request after it,
    nor with tokens beyond the tail (a grant at once).
    Not queued (``head >= tail``), the tail is a boundary and no record is read.  None when the
    head moved while the records were read (a request around the snapshot's head may then have
    been granted and its record freed): the caller keeps the older words, which only ever allow
    less.  One call of the atomic layer (``words.clamp_words``; natively, one C loop).
    """
    return c.clamp_words(L.HEAD, head, tail, lens)


def held_records(c: Cells, lens: Tuple[int, ...]) -> Tuple[int, ...]:
    """Of ``lens`` (every slot's records, ``TICKET_RECORDS`` per slot in order), those of slots a
    process holds (PID not 0): a slot no process holds keeps no waiter's record (a clean leave
    gives its waiters' ranges back, marked given, and a range given back is nobody's grant)."""
    per = L.TICKET_RECORDS
    slots = len(lens) // per
    pids = c.load_many(tuple(L.slot_offset(i) + L.SLOT_PID for i in range(slots)))
    return tuple(
        off for i in itertools.compress(range(slots), pids) for off in lens[i * per : (i + 1) * per]
    )


def words_now(
    c: Cells, lens: Tuple[int, ...], head: int, tail: int
) -> Optional[Tuple[int, int, int]]:
    """The clamp words for the snapshot ``(head, tail)`` (``lens``: every record's LEN offset),
    None when the head moved during the read.  Natively every record is read in one C loop; on
    the ``atomics`` backend only those of slots a process holds (``held_records``: one load per
    slot and five per one held)."""
    if diff(head, tail) < 0 and c.backend != "native":
        lens = held_records(c, lens)
    return clamp_words(c, lens, head, tail)


def fill_limit(c: Cells, lens: Tuple[int, ...], head: int, tail: int, cap: int) -> Optional[int]:
    """How far tokens put back at once may bring the head from ``head``: a capacity from the start
    of the request it stands in (or that request's end, if longer), as the next replenish's clamp
    would count it from a snapshot taken now (``words_now``; its stop at the next recorded
    request aside: tokens put back pass it).  None when the head moved during the read."""
    words = words_now(c, lens, head, tail)
    return None if words is None else (head + clamp_reach(*words, cap, head, tail)) & MASK64


def leave_words(c: Cells, lens: Tuple[int, ...], head: int, tail: int) -> None:
    """Store the clamp words for the snapshot ``(head, tail)`` (``words_now``).  When the head
    moved during the read the older words stay: from an older snapshot, they bound any later
    interval too.
    """
    words = words_now(c, lens, head, tail)
    if words is not None:
        for off, value in zip(CLAMP_WORDS, words):
            c.store(off, value)


def left_named(c: Cells, head: int) -> bool:
    """Whether ``head`` is at or past the end of the recorded request the clamp words name.

    The words count the capacity from that request's start; once it is granted, the next
    request's capacity would count from a start behind it, and a next request longer than the
    room left (a cost raised by ``set_rate``, a larger ``n``) would stop inside it, its time past
    the stop lost.  A claim then takes a snapshot at the head (``Bucket.replenish``): always
    safe, whatever the words hold.
    """
    base, end = c.load(L.SNAP_BASE), c.load(L.SNAP_END)
    return diff(end, base) > 0 and diff(head, end) >= 0
