"""The 64-bit word of the atomic layer: its wrap-around arithmetic and the bounds every backend checks.

A cell is an aligned, unsigned 64-bit word of the segment, named by its byte
offset.  All arithmetic on it wraps modulo 2**64 (the rovers rely on it, as
Seastar's do).  These constants and checks are shared by the reference
composites (composites.py), the ``atomics`` backend (atomics_cells.py) and the
face of the layer (cells.py); the native backend has the same constants.
"""

from __future__ import annotations

import itertools
from typing import Callable, Iterator, List, NamedTuple, Optional, Tuple, Union

MASK64 = (1 << 64) - 1
#: Tokens the queue (TAIL - HEAD) may hold at most: far below 2**63, so every signed comparison
#: of rovers holds whatever is queued.  The native backend has the same constant.
MAX_QUEUE = 1 << 62
WORD = 8


#: A ticket record's LEN while claimed (see ``claim_record``); the segment layout names it TICKET_BUSY.
REC_BUSY = 1 << 63
#: ... and its flag once the range is given back (the layout's TICKET_GIVEN).
REC_GIVEN = 1 << 62
#: A record's length is never more than this (config.MAX_SPAN_TOKENS): more is corrupt, no range.
SPAN_MAX = 1 << 60
#: A grab bound to records takes none of more than this many.
MAX_RECS = 8


#: What a grab of the fast path answers: None (granted), a ticket to wait for, or False (not tried).
GrabResult = Union[None, int, bool]


#: A clamp word's "no bound": as far above the head as the queue may reach (2**62 tokens).
FAR = 1 << 62


def signed(d: int) -> int:
    """A difference of two rovers as a signed 64-bit number."""
    d &= MASK64
    return d - (1 << 64) if d >> 63 else d


def diff(a: int, b: int) -> int:
    """``a - b`` for wrapping 64-bit rovers, as a signed number."""
    return signed(a - b)


def behind(a: int, b: int) -> int:
    """Whichever of two rovers is behind the other."""
    return a if diff(a, b) <= 0 else b


def plain_seconds(timeout: object) -> Optional[float]:
    """A timeout the fast path can use (an int or float, finite, >= 0), else None (the slow path decides)."""
    if type(timeout) is not float and type(timeout) is not int:
        return None
    try:
        t = float(timeout)  # type: ignore[arg-type]
    except OverflowError:
        return None
    return t if 0 <= t < float("inf") else None


def check_value(value: int) -> int:
    if not 0 <= value <= MASK64:
        raise OverflowError(f"cell values are unsigned 64-bit: {value} is out of range")
    return value


def check_offset(off: int, size: int) -> None:
    """Refuse any offset that would touch memory outside the mapping."""
    if off % WORD or off < 0 or off + WORD > size:
        raise IndexError(
            f"cell offset {off} outside the mapping of {size} bytes (must be 8-aligned, < {size - WORD + 1})"
        )


#: A futex bitset has 32 bits: a waiter of the fed wait sleeps with the bit of its ticket's op index.
FED_BITS = 32
FED_ALL = (1 << FED_BITS) - 1


def check_bitset(bitset: int) -> int:
    if not 1 <= bitset <= FED_ALL:
        raise ValueError(f"bitset must be in [1, 2**32), got {bitset}")
    return bitset


def fed_bit(ticket: int, cost: int) -> int:
    """The futex bit a waiter for ``ticket`` sleeps with: its op index (``ticket // cost``) mod 32."""
    return 1 << ((ticket // cost) % FED_BITS)


def fed_mask(old_head: int, new_head: int, cost: int) -> int:
    """The bits of every ticket a head moved from ``old_head`` to ``new_head`` covered (all 32 for a
    move of 31 ops or more, or one that wrapped): a ticket ``t`` with old < t <= new has its op index
    ``t // cost`` between ``old // cost`` and ``new // cost``."""
    lo, hi = old_head // cost, new_head // cost
    if hi < lo or hi - lo >= FED_BITS - 1:
        return FED_ALL
    mask = 0
    for k in range(lo, hi + 1):
        mask |= 1 << (k % FED_BITS)
    return mask


def claim_record(cells, recs, ticket: int) -> Optional[int]:
    """A free ticket record claimed (LEN 0 -> ``REC_BUSY``), ``ticket`` written in its TICKET word
    (the word before LEN): its LEN offset, or None when every one of ``recs`` is in use.

    The protocol of a grab bound to records (every backend's): it queues only once it holds a
    record, claimed and written before the CAS that takes the ticket, whose LEN it stores (the
    exact tokens taken) right after; a grant frees the record again.
    """
    for off in recs:
        if cells.load(off) == 0 and cells.cas(off, 0, REC_BUSY):
            cells.store(off - WORD, ticket)
            return off
    return None


def take_some(cells, off: int, want: int) -> int:
    """Up to ``want`` from the count at ``off``, by CAS (retried while the count changes); how many
    were taken (0 when ``want`` or the count is not positive)."""
    while True:
        v = cells.load(off)
        k = min(v, want)
        if k <= 0 or cells.cas(off, v, v - k):
            return max(0, k)


def check_records(recs: object, size: int) -> tuple:
    """The records argument of a grab: a tuple of at most ``MAX_RECS`` LEN offsets, each with its TICKET before it."""
    if not isinstance(recs, tuple) or len(recs) > MAX_RECS:
        raise TypeError(f"records must be a tuple of at most {MAX_RECS} LEN offsets")
    for off in recs:
        check_offset(off, size)
        check_offset(off - WORD, size)
    return recs


def clamp_sane(base: int, end: int, nxt: int, head: int, tail: int) -> bool:
    """Whether clamp words could have been left by a snapshot at or before ``(head, tail)`` (the
    rovers read after them): ``base`` not above the head (and within ``FAR`` of it), ``end`` at
    most ``SPAN_MAX`` past ``base`` (one request) and not past the tail (a recorded request was
    taken, and the tail only grows), ``next`` not below a request's ``end`` (inside a request it is
    far).  Words no snapshot leaves (a corrupt or hostile segment) allow nothing (``clamp_limit``)
    and are written again by the claim that reads them: lost time, one interval, never a grant."""
    if not 0 <= diff(head, base) <= FAR:
        return False
    span = diff(end, base)
    if not 0 <= span <= SPAN_MAX or diff(tail, end) < 0:
        return False
    return span == 0 or diff(nxt, end) >= 0


def clamp_kept(base: int, end: int, nxt: int, head: int, tail: int) -> bool:
    """Whether a claim keeps the older clamp words instead of writing new ones: only while they
    name a recorded request the head still stands in, callers queued (the records would name it
    again), and could have been left by a snapshot (``clamp_sane``: others, kept, could stop the
    head for good)."""
    return (
        diff(head, tail) < 0
        and base != end
        and diff(head, base) >= 0
        and diff(end, head) > 0
        and clamp_sane(base, end, nxt, head, tail)
    )


def clamp_limit(base: int, end: int, nxt: int, room: int, head: int, tail: int) -> int:
    """The limit of a replenish from clamp words: ``min(max(base + room, end), next)``; the head
    itself (nothing added) when the words are not below it (zero in a segment that predates them)
    or no snapshot could have left them (``clamp_sane``; ``tail`` read after the words)."""
    if not clamp_sane(base, end, nxt, head, tail):
        return head
    limit = (base + room) & MASK64
    if diff(end, limit) > 0:
        limit = end
    if diff(nxt, limit) < 0:
        limit = nxt
    return limit


def clamp_reach(base: int, end: int, nxt: int, room: int, head: int, tail: int) -> int:
    """How far past ``head`` the capacity alone lets a replenish go (``clamp_limit`` without its
    stop at the next recorded request, which a promise counts as a stop on the way): what a
    head on its schedule can gain in one claim.  0 for words no snapshot could have left."""
    if not clamp_sane(base, end, nxt, head, tail):
        return 0
    limit = (base + room) & MASK64
    return max(0, diff(end if diff(end, limit) > 0 else limit, head))


def recorded_ranges(cells, records: Tuple[int, ...]) -> Iterator[Tuple[int, int, int]]:
    """``(start, end, length)`` of each range the ticket records ``records`` (their LEN offsets, each
    with its TICKET word before it) tell: a record being written, changed under the read, or whose
    length is corrupt tells none.  The native backend reads records the same way (``_native.c``)."""
    vals = cells.load_many(records) if records else ()
    for k in itertools.compress(range(len(vals)), vals):
        len_off, v = records[k], vals[k]
        e = cells.load(len_off - WORD)
        if v & REC_BUSY or cells.load(len_off) != v:
            continue  # being written, or changed under the read: its range is told by no record
        n = v & ~REC_GIVEN
        if not 0 < n <= SPAN_MAX:
            continue  # corrupt: no range
        yield (e - n) & MASK64, e, n


def clamp_words(
    cells, head_off: int, head: int, tail: int, records: Tuple[int, ...]
) -> Optional[Tuple[int, int, int]]:
    """The clamp the snapshot ``(head, tail)`` leaves the next replenish: ``(base, end, next)``, or
    None when the word at ``head_off`` (HEAD) moved during the read.  ``records``: ticket records'
    LEN offsets, each with its TICKET word before it.  See ``Bucket.claim`` and docs/design.md
    ("The clamp counts from the request's start"); the native backend does the same steps in C.

    The next replenish may bring the head to ``min(max(base + cap, end), next)`` (``clamp_limit``).
    Not queued (``head >= tail``): the tail is a boundary, ``(tail, tail, far)``, no record read.
    Else ``base``/``end`` name the recorded request the head stands in (``next`` far), or are the
    head itself outside any; there ``next`` is where the records let the head go: a token short of
    the end of the first recorded request after it, the ticket of a record being written (or
    changed under the read), or the tail, whichever is nearest.
    """
    if signed(head - tail) >= 0:
        return tail, tail, (tail + FAR) & MASK64
    base = end = head
    nxt = tail
    for s, e, _ in recorded_ranges(cells, records):
        if signed(head - s) >= 0 and signed(e - head) > 0 and signed(tail - e) >= 0:
            # (the head stands in it, taken: a range ending past the tail no grab took, and words
            # naming it allow nothing, ever)
            base, end = s, e
        elif 0 < signed(s - head) and signed(e - head) <= signed(nxt - head):
            nxt = (e - 1) & MASK64  # into the request, not to its end
    if cells.load(head_off) != head:
        return None
    if base != end:  # in a recorded request: it alone decides
        nxt = (head + FAR) & MASK64
    return base, end, nxt


#: A fence record's words after its START (layout.FENCE_LIMIT, FENCE_DUE, FENCE_TOKENS) and its size.
FENCE_LIMIT_W, FENCE_DUE_W, FENCE_TOKENS_W, FENCE_STRIDE = 8, 16, 24, 32
#: TOKENS's bit for a reservation the head was found late for (``fence_reserved``).
FENCE_LATE = 1 << 63
#: Where no fence holds the head: as far above it as the queue may reach.
NO_FENCE = FAR


def fence_horizon_ns(tpn: int) -> int:
    """How far ahead of now a fence's DUE can be: twice the longest queue's schedule and 10 s.
    A DUE beyond it no reservation stored (a corrupt or hostile segment): that record is ignored,
    so a hostile table stalls the head no longer than a full queue would."""
    return 2 * (MAX_QUEUE // max(1, tpn)) + 10_000_000_000


def fence_due_counts(due: int, ts: int, horizon: int) -> bool:
    """Is a record with this DUE in force for a claim whose interval starts at ``ts``: after ``ts``,
    and not beyond ``horizon`` (``now + fence_horizon_ns``: no reservation stores a DUE that far)?
    Every reader of the fences asks this (the scan, natively too, and ``Fences.in_force``)."""
    return ts < due <= horizon


def fence_limit_counts(rel: int) -> bool:
    """Is a LIMIT ``rel`` tokens from the head one a reservation left (within ``FAR`` of it)?"""
    return -FAR <= rel <= FAR


def fences_in_force(
    cells, hint_off: int, first: int, count: int, ts: int, now: int, tpn: int, head: int
) -> Iterator[Tuple[int, int, int]]:
    """``(record, LIMIT, DUE)`` of each of the ``count`` fence records from ``first`` (``record``:
    its first word, START) in force for a claim whose interval is ``[ts, now]``: its DUE after
    ``ts`` and within ``fence_horizon_ns`` of ``now`` (``fence_due_counts``), its LIMIT within
    ``FAR`` of ``head`` (``fence_limit_counts``).  None at all when FENCE_HINT (at ``hint_off``) is
    not after ``ts``: one load.  Every reader of the fences reads them here (``fence_scan``,
    ``Fences.held``); the native scan does the same in C."""
    if cells.load(hint_off) <= ts:
        return
    dues = cells.load_many(tuple(first + k * FENCE_STRIDE + FENCE_DUE_W for k in range(count)))
    horizon = now + fence_horizon_ns(tpn)
    for k, due in enumerate(dues):
        if fence_due_counts(due, ts, horizon):
            rec = first + k * FENCE_STRIDE
            limit = cells.load(rec + FENCE_LIMIT_W)
            if fence_limit_counts(signed(limit - head)):
                yield rec, limit, due


#: How long after a reservation's time begins a claim may land and still find the head on its
#: schedule, if its tokens reach START by then: a waiter's wake, the filler's tick (``FILL_NS``).
#: The callers ahead it grants overlap the reservation's time by at most that much of the rate,
#: and never by more than the capacity leaves room for (``late_window``).
LATE_SLACK_NS = 1_000_000


class Claim(NamedTuple):
    """What a replenish claim of ``[ts, now]`` judges reservations by: the head it read, the
    tokens per ns, how far the capacity lets it move the head (``clamp_reach``), where the
    request the head stands in starts (``base``: the head, outside one) and the capacity (with
    catch-up's room)."""

    ts: int
    now: int
    head: int
    tpn: int
    reach: int
    base: int
    cap: int


def claim_of(
    ts: int,
    now: int,
    head: int,
    tail: int,
    words: Tuple[int, int, int],
    tpn: int,
    cap: int,
    room: int,
) -> Claim:
    """The ``Claim`` of ``[ts, now]`` from ``head`` (``tail`` read after the clamp ``words``, whose
    ``cap`` gives the reach; ``room``: the capacity with catch-up's room)."""
    base, end, nxt = words
    sane = clamp_sane(base, end, nxt, head, tail)
    return Claim(
        ts, now, head, tpn, clamp_reach(*words, cap, head, tail), base if sane else head, room
    )


def late_window(start: int, word: int, due: int, c: Claim) -> Optional[Tuple[int, int, bool]]:
    """The time a reservation (its record's START, TOKENS word and DUE) owns of the head's
    schedule for the claim ``c``, ``(opens, ends, newly late)``, or None when it owns none
    (``fence_reserved``).  Newly late only if callers lie between the head and START: the
    caller checks (``callers_between``)."""
    tokens, ahead = word & ~FENCE_LATE, signed(start - c.head)
    if not 0 < tokens <= SPAN_MAX or not c.tpn < ahead <= FAR:
        # the head is at or past START, or within the ns a promise is rounded to (a float moment,
        # rounded up): nobody ahead is granted late
        return None
    span = tokens // c.tpn
    if word & FENCE_LATE:
        return due - min(due, 2 * span), due, False
    opens = due - min(due, span)
    lands = c.now - opens
    if lands <= 0 or (
        lands <= LATE_SLACK_NS
        and min(max(0, opens - c.ts) * c.tpn, c.reach) + c.tpn >= ahead
        and lands * c.tpn + signed(start - c.base) <= c.cap
    ):
        # its time has not begun; or this claim lands within a tick of it, its tokens reaching
        # START by then (its stops counted, to the ns a promise is rounded to), the callers it
        # grants and that much of the rate within a capacity: on the schedule
        return None
    return opens, due + span, True


def callers_between(ranges, head: int, start: int) -> bool:
    """Whether any of the ``(start or None, end)`` ranges (``Schedule.granting``: the requests the
    head grants by reaching them, recorded) lies between ``head`` and ``start``.  A range whose
    start is not known counts if it ends past the head."""
    return any(signed(e - head) > 0 and (s is None or signed(start - s) > 0) for s, e in ranges)


def fence_reserved(
    cells, hint_off: int, first: int, count: int, c: Claim, callers: Callable[[int], bool]
) -> Tuple[int, List[Tuple[int, int, int]]]:
    """The tokens of the claim ``c`` that reservations the head runs late for own, none of them
    granted, and the records the claim finds late first: ``(tokens, [(record, TOKENS, DUE)])``,
    each to be marked (``mark_late``) before the claim's CAS.  ``callers(start)``: whether a
    recorded request lies between the head and ``start`` (``callers_between``).

    A reservation of ``n`` tokens from START, used at its DUE ``p``: on the promised schedule the
    head passes its range, granting no one, over ``[p - n / tpn, p]``, so the windows that hold
    ``p`` hold ``n`` more than the head grants.  A head still short of START once that time has
    begun, with callers between (it lost time: the limiter stopped, no one replenished for longer
    than the clamp's slack, a waiter woke late), would grant them within it, together with the
    reservation.  So a claim that lands within it adds nothing, its tokens from before that time
    included (they would be granted now, within it); one that lands after it adds none of its
    own.  A claim landing within ``LATE_SLACK_NS`` of the start, whose tokens reach START by then
    and whose grants fit a capacity with that much of the rate, finds the head on its schedule (a
    waiter's wake, the filler's tick).  Only other reservations' ranges, or ranges given back,
    between the head and START grant no one: the head is then on its schedule however late it
    passes them.  Found late, the record is marked and its DUE moved ``n / tpn`` on, and the
    time up to the new DUE is the reservation's too: what the head had accrued towards the
    callers ahead (at most a capacity) is granted later, where a full bucket would have lost it
    -- the head keeps it, so the windows from ``p`` on would count it and ``n`` both.  Claims'
    intervals are disjoint: each token of that time is taken once (the native replenish does
    the same in C)."""
    reserved, found = 0, []
    for rec, _, due in fences_in_force(cells, hint_off, first, count, c.ts, c.now, c.tpn, c.head):
        start, word = cells.load(rec), cells.load(rec + FENCE_TOKENS_W)
        got = late_window(start, word, due, c)
        if got is None or got[0] >= c.now or got[2] and not callers(start):
            continue
        if got[2]:
            found.append((rec, word, due))
        reserved += (c.now - c.ts if c.now <= got[1] else got[1] - max(c.ts, got[0])) * c.tpn
    return reserved, found


def mark_late(cells, hint_off: int, tpn: int, found: List[Tuple[int, int, int]]) -> None:
    """Mark the records ``fence_reserved`` found late: TOKENS's ``FENCE_LATE`` bit, then DUE moved
    ``n / tpn`` on (a reader between the two reserves time from earlier on: lost, never granted),
    then FENCE_HINT raised to it.  Each by CAS from what was read: a record changed since is
    left as it is."""
    for rec, word, due in found:
        new = due + word // tpn
        if cells.cas(rec + FENCE_TOKENS_W, word, word | FENCE_LATE) and cells.cas(
            rec + FENCE_DUE_W, due, new
        ):
            while True:
                hint = cells.load(hint_off)
                if hint >= new or cells.cas(hint_off, hint, new):
                    break


def fence_scan(
    cells,
    hint_off: int,
    first: int,
    count: int,
    ts: int,
    now: int,
    tpn: int,
    head: int,
    ticket: int,
) -> Optional[Tuple[int, float]]:
    """The reservation fences in force for a claim whose interval is ``[ts, now]``, read from the
    ``count`` records from ``first`` (each ``FENCE_STRIDE`` bytes: START, LIMIT, DUE, TOKENS): ``(room,
    due)``, or None when none is (FENCE_HINT at ``hint_off``, the latest DUE ever stored, is not
    after ``ts``: one load, no record read).

    A record is in force (``fences_in_force``) when its DUE is after ``ts``: the head may then stand at most at
    ``LIMIT + max(0, now - DUE) * tpn``.  ``room`` is the least such bound over the records in
    force, less ``head`` (negative: the head is past it, add nothing; ``NO_FENCE`` at most).
    ``due`` is when the head can reach ``ticket`` at the soonest under them: the latest
    ``DUE + (ticket - LIMIT) / tpn`` over those whose LIMIT is before ``ticket`` (0.0: none).
    A record whose LIMIT is more than ``FAR`` from the head, or whose DUE is beyond
    ``fence_horizon_ns`` from ``now``, no reservation left: ignored.  The native backend does the
    same in one C loop.  Every offset it may read is checked first.
    """
    if count < 0 or tpn <= 0:
        raise ValueError("fence_scan: count must be >= 0 and tpn >= 1")
    for off in (hint_off, first, first + max(0, count - 1) * FENCE_STRIDE + FENCE_TOKENS_W):
        check_offset(off, cells.size)
    room, due, found = NO_FENCE, 0.0, False
    for _, lim, d in fences_in_force(cells, hint_off, first, count, ts, now, tpn, head):
        found = True
        room = min(room, signed(lim - head) + max(0, now - d) * tpn)
        ahead = signed(ticket - lim)
        if ahead > 0:
            due = max(due, d + ahead / tpn)
    return (min(room, NO_FENCE), due) if found else None
