"""Capped mode's ops in flight, per process: the ops a gone process held are released for it.

``INFLIGHT`` counts every op admitted and not yet released; the capped bound is that it never
exceeds the capacity in ops (``admit`` is a CAS that checks it), so at most ``capacity`` ops are
ever granted and not released.  Each process slot's ``SLOT_INFLIGHT``
(``layout.inflight_offset``) counts its owner's share, so that the ops of a process that is
killed (or leaves) holding them are released for it by a filler's ``reap``, or by the next owner
of its slot (``take_over``) -- otherwise they would stay counted forever and the capacity would
shrink by them with every such death.

**Invariant**: the slots' counts sum to at most ``INFLIGHT``.  So a reap, which subtracts from
``INFLIGHT`` exactly what it took (by one CAS to 0) from a gone owner's slot, never takes it
below what the live processes hold: the capped bound holds.  Each step keeps the invariant at
every instant, whatever process dies between two of its words:

* ``admit``: ``INFLIGHT`` first, then the owner's slot.  A death in between leaves the ops in
  ``INFLIGHT`` only: that capacity is lost (as before this count existed), never gained;
* ``release`` and ``unadmit``: the slots first -- the caller's own, then (ops it releases on
  another process's behalf) other slots' -- then ``INFLIGHT``.  A death in between leaves
  ``INFLIGHT`` higher than the slots: capacity lost, never gained;
* ``reap`` / ``take_over``: a gone owner's count, taken by one CAS to 0, then subtracted.

Not released for it: the ops of a process beyond the table (no slot: they count in
``INFLIGHT`` only), and the few ops of a process killed between the two words of an admit.
The ops a process held are the process's: ops released by another process after their owner
was killed and reaped are released twice (the count cannot tell), so in capped mode the process
that acquired ops releases them (or another does so while it still runs).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional, Sequence

from shmlimit.shm import layout as L
from shmlimit.shm.words import take_some

if TYPE_CHECKING:  # pragma: no cover
    from shmlimit.shm.cells import Cells
    from shmlimit.shm.table import ProcessTable


def admit(c: "Cells", ops: int, cap_ops: int, own: Optional[int]) -> bool:
    """Count ``ops`` in flight (``INFLIGHT``, then the caller's slot ``own``) if the capacity allows."""
    while True:
        cur = c.load(L.INFLIGHT)
        if cur + ops > cap_ops:
            return False
        if c.cas(L.INFLIGHT, cur, cur + ops):
            if own is not None:
                c.fetch_add(own, ops)
            return True


def release(c: "Cells", ops: int, own: Optional[int], slots: Sequence[int], check: bool) -> None:
    """``ops`` no longer in flight: from the slots (``own`` first, then the others in ``slots``),
    then from ``INFLIGHT``.  With ``check``, more than ``INFLIGHT`` holds raises ValueError, every
    count as it was (what was taken from slots is put back where it was)."""
    taken = []
    left = ops
    for off in ([own] if own is not None else []) + [s for s in slots if s != own]:
        if left <= 0:
            break
        k = take_some(c, off, left)
        if k:
            taken.append((off, k))
            left -= k
    while True:
        cur = c.load(L.INFLIGHT)
        if check and ops > cur:
            for off, k in taken:
                c.fetch_add(off, k)
            raise ValueError(
                f"n must be at most the {cur} ops in flight (granted and not released), got {ops}"
            )
        if c.cas(L.INFLIGHT, cur, max(0, cur - ops)):
            return


def _give_up(c: "Cells", off: int, k: int, still: Callable[[], bool] = lambda: True) -> int:
    """A gone owner's count ``k`` at ``off``, taken (CAS to 0) and released from ``INFLIGHT``, if
    ``still()`` says afterwards that the slot is still that owner's (else put back); how many ops."""
    if k <= 0 or not c.cas(off, k, 0):
        return 0
    if not still():  # a new owner came meanwhile: what was taken may be its own; it stays counted
        c.fetch_add(off, k)
        return 0
    take_some(c, L.INFLIGHT, k)
    return k


def take_over(c: "Cells", slots: int, index: int) -> int:
    """A process that just took slot ``index`` releases the ops its predecessor left in flight there."""
    off = L.inflight_offset(slots, index)
    return _give_up(c, off, c.load(off))


def reap(c: "Cells", table: "ProcessTable", alive: Callable[[int, int, int, int], bool]) -> int:
    """Release the ops in flight of every slot whose owner is dead or gone (pid 0); how many ops.

    A new owner counts in the slot only after registering (changing ``START``, then ``PID``) and
    releasing its predecessor's count (``take_over``): the count taken is kept only if ``PID`` and
    ``START`` still read as judged after the CAS that took it, so it was the gone owner's.
    """
    offs = tuple(L.inflight_offset(table.slots, i) for i in range(table.slots))
    done = 0
    for i, v in enumerate(c.load_many(offs)):
        if not v:
            continue
        base = L.slot_offset(i)
        pid, start = c.load(base + L.SLOT_PID), c.load(base + L.SLOT_START)
        if pid and alive(i, pid, start, c.load(base + L.SLOT_PIDNS)):
            continue
        done += _give_up(
            c,
            offs[i],
            v,
            # called at once, for this slot: the owner it judged gone still holds the slot
            lambda base=base, owner=(pid, start): (
                (c.load(base + L.SLOT_PID), c.load(base + L.SLOT_START)) == owner
            ),
        )
    return done
