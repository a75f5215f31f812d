"""The promise fence: no reservation, and no refund, behind a reservation before its promised moment.

A reservation (``reserve()``) is used by its holder at the moment promised to it
(``Schedule.promised_ns``), which may come later than the head's arrival at its
ticket: the promise allows for stops and a pause the head may not make.  A
reservation behind it promised from the head would then fall together with the
late slot: ``rate * (T + L) + capacity`` in a window ``T`` (``L`` the lateness).

So every reservation leaves a line in one shared word, ``FENCE`` (``layout``):
the head may be at most ``ticket + slack`` at its promised moment, and gain at
most the rate's tokens (``TPN`` per ns) from then on; ``slack`` is the capacity
less the reservation's own tokens, the burst the bucket may hand out at once
anyway.  Lines of different reservations have the same slope, so the lowest
of them is the only one that matters: one word holds the line's position at
clock reading 0, ``ticket + slack - promised * TPN`` (mod 2**64), and a new
line replaces it only when it is lower (``hold``).  A promise is never before
the line reaches its ticket (``arrival_ns``): the reservations behind a late
one are promised after it, each its own tokens' time later.  A refund or a
leased batch (``Bucket.add``) fits under the line.  Replenishes and the skips
of ranges given back do not keep it (docs/design.md, "The promise fence"):
waiters behind a late promise may still be granted beside it.

The word means something only relative to the head and the clock: its *room*
(``room``), the tokens the line allows above the head now, is read as
``diff(word + REPL_TS * TPN, HEAD) + (now - REPL_TS) * TPN``, exact while the
room at ``REPL_TS`` is within ``2**63`` of the head.  Each claim that finds the
room above ``REFRESH_AT`` (the line far above anything the head could reach)
writes a free line again (``free_word``: ``FREE_AT`` above the head), so the
room at ``REPL_TS`` never exceeds that.  A room of ``FREE_AT`` (2**62, more
than an add can ever move the head at once) or more holds nothing back; a room
below ``-FREE_AT`` no reservation leaves (``hold`` writes no lower) and is
corrupt: it holds nothing back and the next claim writes a free line.  Any
other value only makes promises later and adds smaller: lost time, never a
grant.
"""
from __future__ import annotations

import math
from typing import Callable, Optional

from . import layout as L
from .cells import Cells
from .words import MASK64, diff

#: A room (tokens) at or above which the fence holds nothing back: no add (at most a capacity,
#: 2**60) moves the head that far at once.
FREE_AT = 1 << 62
#: A claim that finds the room above this writes a free line again (``free_word``).
REFRESH_AT = FREE_AT + (FREE_AT >> 1)


def free_word(head: int, now_ns: int, tpn: int) -> int:
    """A line that holds nothing back: ``FREE_AT`` above ``head`` at ``now_ns``."""
    return (head + FREE_AT - now_ns * tpn) & MASK64


def line_word(ticket: int, slack: int, promised_ns: int, tpn: int) -> int:
    """The line of a reservation: the head at most ``ticket + slack`` at ``promised_ns``, then the rate."""
    return (ticket + slack - promised_ns * tpn) & MASK64


def room(word: int, ts: int, now_ns: int, head: int, tpn: int) -> Optional[int]:
    """Tokens the line ``word`` lets the head gain above ``head`` by ``now_ns`` (``ts``: ``REPL_TS``,
    read before the head); negative when the head stands above the line (it then gains nothing
    until the line passes it); None when the line holds nothing back (free, or corrupt)."""
    r = diff((word + ts * tpn) & MASK64, head) + max(0, now_ns - ts) * tpn
    return r if -FREE_AT <= r < FREE_AT else None


def limit(word: int, ts: int, now_ns: int, head: int, tpn: int, upto: int) -> int:
    """``upto`` (a rover at or above ``head``), lowered to where the line lets the head go by ``now_ns``."""
    r = room(word, ts, now_ns, head, tpn)
    if r is None or r >= diff(upto, head):
        return upto
    return (head + max(0, r)) & MASK64


def start(c: Cells, head: int, now_ns: int, tpn: int) -> None:
    """A new segment's fence: free (``head`` at ``now_ns``)."""
    c.store(L.FENCE, free_word(head, now_ns, tpn))


def keep_free(c: Cells, word: int, ts: int, now_ns: int, head: int, tpn: int) -> None:
    """A claim's care of the word (``word`` as read after its claim): a line far above the head, or
    a corrupt one, is written free again (one CAS, lost to a reservation's newer line: kept)."""
    r = diff((word + ts * tpn) & MASK64, head) + max(0, now_ns - ts) * tpn
    if r >= REFRESH_AT or r < -FREE_AT:
        c.cas(L.FENCE, word, free_word(head, now_ns, tpn))


def hold(c: Cells, ticket: int, slack: int, promised_ns: float, tpn: int, clock: Callable[[], int]) -> None:
    """Leave the line of a reservation of ``ticket`` promised at ``promised_ns``, unless a lower line
    is there already.  A promise so late that its line would sit more than ``FREE_AT`` below the
    head (over 2**62 tokens of schedule time behind it) is held at ``-FREE_AT``: the word cannot
    say more."""
    at = max(0, math.ceil(promised_ns))
    while True:
        word = c.load(L.FENCE)
        ts = c.load(L.REPL_TS)
        head = c.load(L.HEAD)
        now = clock()
        old = room(word, ts, now, head, tpn)
        new = diff(ticket, head) + slack - (at - now) * tpn
        if new >= FREE_AT or (old is not None and old <= new):
            return
        want = line_word(ticket, slack, at, tpn) if new >= -FREE_AT else (head - FREE_AT - now * tpn) & MASK64
        if c.cas(L.FENCE, word, want):
            return


def arrival_ns(c: Cells, ticket: int, head: int, tpn: int, now_ns: int) -> Optional[float]:
    """When the line passes ``ticket`` (the head read first): the earliest a reservation of it may be
    used; None: the fence holds nothing back."""
    ts = c.load(L.REPL_TS)
    at = max(now_ns, ts)  # a REPL_TS read after the clock: the line's room counted from it
    r = room(c.load(L.FENCE), ts, at, head, tpn)
    if r is None:
        return None
    return at + (diff(ticket, head) - r) / tpn
