"""The fed wait: hierarchical mode's waiters, asleep on one shared word until the batch that covers them lands.

Tokens come with leased batches there, not with the clock, so no waiter can
compute its turn.  Each sleeps on ``UP_WAKE`` (a futex on the word's low 32
bits, shared by every process that maps the segment) with the bit of its
ticket's op index (``words.fed_bit``), and whoever moves the head -- an added
batch (``Bucket.add``), ``forgive``, a config change -- bumps the word and wakes
the bits of every ticket the move covered (``words.fed_mask``): a waiter wakes
once, when it is served.  It reads the word before it looks at the head, and the
kernel sleeps only while the word still holds what it read, so a move between
its look and its sleep is never missed.

Every sleep still ends at a deadline (``deadline``): the batch the filler
expects next or the ticket's turn at the local rate, whichever is later, plus
``GRACE_NS``.  A living filler's batch wakes the waiter before; a dead one's
does not, and the waiter then looks at the lease and nudges (in this mode only
waiters notice a dead filler).  The native backend runs the same loop without
the GIL (``_native.c``, FED WAIT); the ``atomics`` backend's waiters sleep
through ``futex.py``.
"""

from __future__ import annotations

from shmlimit.shm import futex
from shmlimit.shm import layout as L
from shmlimit.shm.cells import Cells, fed_bit

__all__ = ["GRACE_NS", "deadline", "fed_bit", "seen", "sleep", "wake", "wakes_work"]

#: A fed waiter sleeps at most this long (ns) past the batch it expects: how late it notices a dead
#: filler, beyond the filler lease's timeout.
GRACE_NS = 30_000_000


def wakes_work() -> bool:
    """Can a fed waiter be woken (futexes: Linux)?  Else it sleeps only to its estimated time."""
    return futex.available()


def seen(cells: Cells) -> int:
    """``UP_WAKE`` now: read before the head, it is what a sleep on the word compares with."""
    return cells.load(L.UP_WAKE)


def deadline(cells: Cells, tpn: int, now: int, short: int, until: int) -> int:
    """Until when (CLOCK_MONOTONIC ns) a waiter ``short`` tokens from its turn sleeps without a wake:
    ``UP_NEXT_NS`` or its turn at the local rate (``tpn`` tokens per ns), whichever is later, plus
    ``GRACE_NS``; never after ``until``.  The native fed waiter computes the same."""
    return min(until, int(max(cells.load(L.UP_NEXT_NS), now + short / tpn) + GRACE_NS))


def sleep(cells: Cells, expected: int, bit: int, deadline_ns: int) -> bool:
    """Sleep while ``UP_WAKE`` holds ``expected``, until a wake with ``bit`` or ``deadline_ns``;
    False once the deadline passed."""
    return cells.futex_wait(L.UP_WAKE, expected, bit, deadline_ns)


def wake(cells: Cells, mask: int) -> int:
    """The head moved (or the config changed): bump ``UP_WAKE``, then wake the sleepers, in every
    process, whose bit is in ``mask``; how many were woken."""
    cells.fetch_add(L.UP_WAKE, 1)
    return cells.futex_wake(L.UP_WAKE, mask)
