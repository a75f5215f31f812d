"""The table of attached processes: who is attached, alive or dead, and how many grants each had.

A slot is claimed by CAS on its PID word (0 = free).  A process is identified
by pid *and* start time (clock ticks since boot, from /proc), so a recycled pid
is never mistaken for the process that held the slot.  A slot whose process is
dead (gone, a zombie, or a different process under the same pid) is reclaimed
by the next process that registers.  A slot's GRANTS only ever grows, across
its owners; each owner's own count is GRANTS - BASE.  The limiter's total is
the sum of every slot's GRANTS, so it never goes backwards and nothing is lost
when a process dies at any instant.

The table has ``SLOTS`` entries (128 by default).  A process arriving when every
slot is held by a live process still shares the limit exactly -- the rovers are
global -- but it is not listed, cannot be elected filler, and its grants are
counted in UNREG_GRANTS.  It is counted in BEYOND (``register`` adds it,
``unregister`` takes it back), so the table is ``live`` while it is attached and
``gc`` never takes the segment from under it; one killed while attached leaves
the count up for good (the segment is then never collected: ``shmlimit unlink``).

This module alone decides whether a process is alive, for every kind (the
process table, the keyed slots' inserters, a segment's creator, ``gc``): a
process is dead when it is gone or a zombie (it never runs again); a pid
recorded with its start time is dead when another process holds that pid
now; an owner recorded in another PID namespace counts as alive.  The native
keyed composite asks ``keyed.cells.alive``, which asks ``is_alive`` here.
"""

from __future__ import annotations

import functools
import os
import threading
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Set, Tuple

from shmlimit.errors import CorruptWordsError
from shmlimit.shm import layout as L
from shmlimit.shm.words import MASK64

#: The largest pid Linux ever gives (``PID_MAX_LIMIT``): a larger one, read from a segment, is none.
PID_MAX_LIMIT = 1 << 22

#: proc_start's answer when /proc cannot tell (a read error other than "no such process").
UNKNOWN = -1


def possible_pid(pid: int) -> bool:
    """Whether ``pid`` (read from a segment: any 64-bit word) can be a process's at all: a pid
    outside 1..PID_MAX_LIMIT names no process, in any PID namespace, and is dead."""
    return 0 < pid <= PID_MAX_LIMIT


def proc_start(pid: int) -> Optional[int]:
    """Start time of a live (non-zombie) process in clock ticks since boot; None if there is none.

    UNKNOWN when /proc could not be read for another reason (too many open
    files, a torn read, a /proc mounted ``hidepid=2`` hiding another user's
    process that ``kill(pid, 0)`` still finds): callers must then treat the
    process as alive, since taking a live process for dead would let its slot,
    lease or segment be taken from under it.
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except (FileNotFoundError, ProcessLookupError):
        if not possible_pid(pid):  # (and kill() would signal a group)
            return None
        try:
            os.kill(pid, 0)  # signal 0: only asks whether the pid exists
        except ProcessLookupError:
            return None
        except OSError:
            return UNKNOWN  # it exists, but is not ours to see
        return UNKNOWN  # it exists (hidden from /proc, or born since the open)
    except OSError:
        return UNKNOWN
    # the command name may contain spaces and parentheses: fields resume after the last ')'
    try:
        fields = data[data.rindex(b")") + 2 :].split()
        if fields[0] in (b"Z", b"X"):  # zombie or dead: it will never grab again
            return None
        return int(fields[19])
    except (ValueError, IndexError):
        return UNKNOWN


_own_pidns: Tuple[int, int] = (0, 0)  # (pid it was read in, namespace inode)


def pid_namespace() -> int:
    """The inode of this process's PID namespace (0 if /proc cannot tell)."""
    global _own_pidns
    me = os.getpid()
    if _own_pidns[0] != me:  # read again after fork: a child may live in a new namespace
        try:
            ino = os.stat("/proc/self/ns/pid").st_ino
        except OSError:
            ino = 0
        _own_pidns = (me, ino)
    return _own_pidns[1]


def slot_alive(pid: int, start: int, pidns: int) -> bool:
    """``is_alive`` for a slot's owner: one recorded in another PID namespace counts as alive.

    Its pid means another process (or none) here, so this process cannot tell
    it is dead; taking it for dead would reclaim a live slot, or let ``gc``
    remove a segment a container still uses, and the limit would double.
    """
    if pidns and pidns != pid_namespace():
        return possible_pid(pid)
    return is_alive(pid, start)


def is_alive(pid: int, start: int) -> bool:
    """True if ``pid`` is running and is the process that started at ``start`` (0: not yet known)."""
    if not possible_pid(pid):
        return False
    now_start = proc_start(pid)
    if now_start is None:
        return False
    return start == 0 or now_start in (start, UNKNOWN)


class OwnerWatch:
    """``slot_alive`` for a caller that asks about the same owners again and again (the filler's
    reap, every ``REAP_EVERY``): a poll of a pidfd per owner instead of a read of /proc each time.

    A slot owner's pidfd is opened once, and kept only if, read *after* opening it, the pid's
    start time is still the one the slot names: the owner was registered before the slot was
    read, so if it is still alive then, it held the pid all along and the descriptor is its own,
    never that of a process that reused the pid.  The descriptor turns readable when the owner
    exits (a zombie included, as ``proc_start`` says dead).  A start not yet known (0) or
    unreadable, an owner in another PID namespace, or no pidfd (not Linux, an old kernel, no
    descriptor left): it answers as ``slot_alive`` does.  ``close`` closes the descriptors.
    One lock: a live change's reap may run beside the filler's, and a descriptor closed twice
    could close another one that took its number.
    """

    def __init__(self) -> None:
        self._fds: dict = {}  # slot index -> (pid, start, pidfd)
        self._poll: Optional[object] = None
        self._lock = threading.Lock()

    def alive(
        self, index: int, pid: int, start: int, pidns: int, seen: Optional[List[Set[int]]] = None
    ) -> bool:
        if pidns and pidns != pid_namespace():
            return possible_pid(pid)
        with self._lock:
            return self._alive(index, pid, start, seen)

    def round(self) -> Callable[[int, int, int, int], bool]:
        """``alive`` for one pass over the owners (a reap): the descriptors are polled once, at the
        first owner already watched, instead of once per owner (a reap with eight waiting owners
        made eight polls, about half its CPU).  An owner that exits after that poll is judged alive
        until the next pass, so its records wait for the next reap: never taken from a live owner.
        A descriptor seen readable stays so (an exit is for good), and one opened during the pass
        answers from the start time read after opening it, as ``alive`` does."""
        return functools.partial(
            self.alive, seen=[]
        )  # (seen: the readable descriptors, once polled)

    def _alive(
        self, index: int, pid: int, start: int, seen: Optional[List[Set[int]]] = None
    ) -> bool:
        held = self._fds.get(index)
        if held is not None and held[:2] != (pid, start):
            self._drop(index)
            held = None
        if held is None:
            if not possible_pid(pid):
                return False
            fd = _pidfd(pid) if start else None
            if fd is None:
                return is_alive(pid, start)
            if proc_start(pid) != start:  # gone, or another process now, or /proc cannot tell
                os.close(fd)
                return is_alive(pid, start)
            if self._poll is None:
                import select

                self._poll = select.poll()
            self._poll.register(fd, 1)  # type: ignore[attr-defined]  # POLLIN: the process exited
            self._fds[index] = held = (pid, start, fd)
            if (
                seen is not None
            ):  # alive when its start was read, after opening: not from the pass's poll
                if seen:
                    seen[0].discard(fd)  # (a number closed earlier in the pass, taken again)
                return True
        if seen is not None:
            if not seen:
                seen.append({fd for fd, _ in self._poll.poll(0)})  # type: ignore[attr-defined]
            if held[2] in seen[0]:
                self._drop(index)
                return False
            return True
        ready = self._poll.poll(0)  # type: ignore[attr-defined]  # one syscall, every owner watched
        if ready and any(fd == held[2] for fd, _ in ready):
            self._drop(index)
            return False
        return True

    def _drop(self, index: int) -> None:
        _, _, fd = self._fds.pop(index)
        self._poll.unregister(fd)  # type: ignore[attr-defined]
        os.close(fd)

    def close(self) -> None:
        with self._lock:
            for index in list(self._fds):
                self._drop(index)

    def forked(self) -> "OwnerWatch":
        """In a forked child: a new watch, the parent's descriptors (copies, here) closed without
        its lock, which a thread that does not exist here may have held at the fork."""
        for _, _, fd in self._fds.values():
            try:
                os.close(fd)
            except OSError:
                pass
        return OwnerWatch()


def _pidfd(pid: int) -> Optional[int]:
    """A pidfd of ``pid`` (close-on-exec), or None where there is none (or no descriptor left, or
    ``pid`` is no process's: os.pidfd_open would raise OverflowError past 2**31)."""
    if not possible_pid(pid):
        return None
    try:
        return os.pidfd_open(pid)  # type: ignore[attr-defined]
    except (AttributeError, OSError):
        return None


@dataclass(frozen=True)
class SlotInfo:
    index: int
    pid: int
    start: int
    grants: int
    waiting: bool
    pidns: int = 0


def table_slots(cells: Any) -> int:
    """A limiter's process slots (SLOTS), read from ``cells`` and checked against them: the open
    checked the word before it mapped the segment, but a writer may have changed it since, and
    every offset of the process table, the ticket records and the fences is computed from it (a
    count past the mapping would index out of it, a huge one be looped over for ever)."""
    slots = cells.load(L.SLOTS_OFF)
    if slots > L.MAX_SLOTS or L.segment_size(slots) > cells.size:
        raise CorruptWordsError(
            f"its header says {slots} process slots, its mapping has {cells.size} bytes"
        )
    return slots


class ProcessTable:
    # ``cells`` is a ``shm.cells.Cells``, not imported: the keyed composite (``keyed.cells``, which
    # ``shm.cells`` imports) asks this module about liveness, and the imports go one way.
    def __init__(self, cells: Any, slots: int) -> None:
        self.cells = cells
        self.slots = slots

    def register(self, pid: int, start: int, pidns: int = 0) -> Optional[int]:
        """Claim a free slot, else reclaim a dead process's slot; None when all are live, the
        process then counted beyond the table (BEYOND) until ``unregister(None, pid)``: counted
        before the caller looks at STATE, as a slot is claimed (``segment.claim_and_unlink``)."""
        c = self.cells
        for i in range(self.slots):
            base = L.slot_offset(i)
            if c.load(base + L.SLOT_PID) == 0 and c.cas(base + L.SLOT_PID, 0, pid):
                self._fill(base, start, pidns)
                return i
        for i in range(self.slots):
            base = L.slot_offset(i)
            old = c.load(base + L.SLOT_PID)
            old_start = c.load(base + L.SLOT_START)
            old_ns = c.load(base + L.SLOT_PIDNS)
            # START and PIDNS are the judged owner's only if PID still names it: read after a
            # successor took the slot, they are the successor's, and our CAS of START would zero it
            if not old or c.load(base + L.SLOT_PID) != old or slot_alive(old, old_start, old_ns):
                continue
            # Zero START first: while (PID, START) reads (new pid, 0) the slot counts as
            # "registering, alive", so nobody can mistake the new owner for the dead one.
            if not c.cas(base + L.SLOT_START, old_start, 0):
                continue
            if c.cas(base + L.SLOT_PID, old, pid):
                self._fill(base, start, pidns)
                return i
        c.fetch_add(L.BEYOND, 1)
        return None

    def _fill(self, base: int, start: int, pidns: int) -> None:
        c = self.cells
        c.store(base + L.SLOT_BASE, c.load(base + L.SLOT_GRANTS))
        c.store(base + L.SLOT_WAITING, 0)
        # before START: while START is 0 the slot reads "registering, alive", so the namespace a
        # reader sees next to a non-zero START is always the current owner's
        c.store(base + L.SLOT_PIDNS, pidns)
        c.store(base + L.SLOT_START, start)

    def unregister(self, index: Optional[int], pid: int) -> None:
        """Give the slot back (its grants stay in the total); None: leave BEYOND, once, in the
        process ``register`` counted."""
        c = self.cells
        if index is None:
            c.fetch_add(L.BEYOND, MASK64)  # -1
            return
        base = L.slot_offset(index)
        if c.load(base + L.SLOT_PID) != pid:
            return  # reclaimed already (we were taken for dead)
        c.store(base + L.SLOT_WAITING, 0)
        c.store(base + L.SLOT_START, 0)
        c.cas(base + L.SLOT_PID, pid, 0)

    def entries(self) -> List[SlotInfo]:
        """The occupied slots; ``grants`` is each current owner's own count."""
        c = self.cells
        out = []
        for i in range(self.slots):
            base = L.slot_offset(i)
            pid = c.load(base + L.SLOT_PID)
            if pid:
                own = c.load(base + L.SLOT_GRANTS) - c.load(base + L.SLOT_BASE)
                out.append(
                    SlotInfo(
                        i,
                        pid,
                        c.load(base + L.SLOT_START),
                        max(0, own),
                        bool(c.load(base + L.SLOT_WAITING)),
                        c.load(base + L.SLOT_PIDNS),
                    )
                )
        return out

    def beyond(self) -> int:
        """The processes attached beyond the table (BEYOND): live ones, and any killed while
        attached (whose count stays)."""
        return self.cells.load(L.BEYOND)

    def live(self) -> bool:
        """Some process is attached beyond the table, or some live process is registered
        (``slot_alive``: another namespace's counts as alive)."""
        return self.beyond() != 0 or any(
            slot_alive(e.pid, e.start, e.pidns) for e in self.entries()
        )

    def total_grants(self) -> int:
        """Every grant ever made through any slot, by current and departed owners alike."""
        c = self.cells
        return sum(c.load(L.slot_offset(i) + L.SLOT_GRANTS) for i in range(self.slots))

    def pid_of(self, index: int) -> int:
        if not 0 <= index < self.slots:
            return 0
        return self.cells.load(L.slot_offset(index) + L.SLOT_PID)
