"""One attachment per name per process, for each kind of limiter.

Every handle for a name in a process shares one attachment (one mapping, one
process slot, one filler thread), counted by ``refs``.  A registry hands it
out (``open``), drops a handle (``release``), runs the fork hook of every
attachment a forked child inherited (``after_fork_in_child``), and detaches
every attachment at exit, so a held filler lease is dropped and a successor
fills at once.

``Attached`` is every kind's per-process lifecycle, once: opened (``attach``: registered, then
its STATE looked at, so a collector never takes a segment from under its opener), joined to the
process table (``join``), registered again on a forked child's first use (``use``), its slot
given back (``leave``, ``detach``).  A kind adds only its own words and objects (``bind``).
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import weakref
from contextlib import contextmanager
from typing import Any, Callable, Dict, FrozenSet, Generic, Iterator, Optional, Tuple, TypeVar

from shmlimit.errors import LimiterNotFoundError, SegmentError, ShmlimitError
from shmlimit.shm import layout as L
from shmlimit.shm.cells import Cells
from shmlimit.shm.segment import (
    Segment,
    check_trust,
    current_inode,
    gone,
    reopening,
    unlink,
)
from shmlimit.shm.table import ProcessTable, is_alive, pid_namespace, proc_start


class Attached:
    """One process's mapping of one segment (or a group's region), shared by its handles.

    Opening registers this process in the segment's process table, or counts it beyond the
    table when every slot is held (so ``gc`` never takes a segment from under its opener); a
    forked child is not registered until its first use (``use``), so a child that never uses an
    inherited limiter is never listed and one that leaves with ``os._exit`` leaves no dead entry
    (nor a count beyond the table, which only its own ``leave`` takes back).
    """

    #: the kind, as errors name it
    what = "limiter"

    def __init__(self, name: str, seg: Segment, cells: Cells, slots: int) -> None:
        self.name, self.seg, self.cells = name, seg, cells
        self.created = seg.created
        self.table = ProcessTable(cells, slots)
        self.refs = 0
        self.closed = False
        self.pid = os.getpid()
        #: this process's slot in the process table (None: unregistered, or the table is full)
        self.slot: Optional[int] = None
        #: this process registered (or found the table full): False in a forked child until its use
        self.joined = False
        #: this process found the table full and is counted beyond it (``ProcessTable.register``),
        #: until it leaves; a forked child's is its own (the parent's count is the parent's)
        self.beyond = False
        #: the exit hook that leaves (detaches) as a ``multiprocessing`` child ends, while joined
        #: (``count_out_at_exit``)
        self.count_out: Any = None
        #: This process used it (``use``): it is registered and the kind's threads run (``start``).
        #: Opening registers but starts no thread: a pre-fork server's master that only opened it
        #: never forks with one running.
        self.in_use = False
        self._use_lock = threading.Lock()

    def bind(self) -> None:
        """The kind's words and objects for ``slot`` (None: unregistered), after every change of it."""

    def join(self) -> None:
        """Register this process in the process table (``bind`` its slot's words)."""
        self.pid = os.getpid()
        start = proc_start(self.pid)
        self.slot = self.table.register(
            self.pid, start if start and start > 0 else 0, pid_namespace()
        )
        self.joined, self.beyond = True, self.slot is None
        if self.count_out is None:
            self.count_out = count_out_at_exit(self)
        # the table counts the creator from now on (``may_adopt``): once it closes, it is no user
        self.cells.cas(L.CREATOR_PID_OFF, self.pid, 0)
        self.bind()

    def start(self) -> None:
        """The kind's threads, at this process's first use."""

    def use(self) -> None:
        """This process uses the segment: register it if it is not yet (a forked child's first use),
        then ``start`` (once).

        Raises ``SegmentError`` when the segment was collected (``gc``) or its
        name unlinked (perhaps another's now) since it was inherited; seen
        before registering, nothing is touched.
        """
        with self._use_lock:
            if self.in_use or self.closed or self.pid != os.getpid():
                return
            if not self.joined:
                if not self.gone():  # registered, then STATE: a collector that claimed the segment
                    self.join()  # before it saw us unlinks it (see claim_and_unlink): a claim
                    if self.gone():  # seen now means it is gone or going
                        self.leave()
                if not self.joined:
                    raise SegmentError(
                        f"{self.what} {self.name!r} was collected or removed while this process "
                        "held it unused (no live process was registered); open it again"
                    )
            self.start()
            self.in_use = True

    def gone(self) -> bool:
        """Collected (or going), or its name unlinked or another segment's now."""
        return gone(self.seg.name, self.seg.inode, self.cells)

    def _unregister(self) -> None:
        if self.pid != os.getpid():
            return
        if self.count_out is not None:
            self.count_out.cancel()  # (its exit hook: one a process opens and closes often)
            self.count_out = None
        if self.slot is not None:
            self.table.unregister(self.slot, self.pid)
        elif self.beyond:
            self.beyond = False  # counted out once, whoever calls (close, exit, detach)
            self.table.unregister(None, self.pid)

    def leave(self) -> None:
        """Give this process's slot back, keeping the mapping (it registers again on its next use)."""
        self._unregister()
        self.slot, self.joined = None, False
        self.bind()

    def after_fork_in_child(self) -> None:
        """The parent's slot is not ours: unregistered until the first use."""
        self._use_lock = threading.Lock()  # the parent's may have been held by a thread not copied
        self.pid = os.getpid()
        self.slot, self.joined, self.in_use, self.beyond = None, False, False, False
        self.count_out = None  # (the parent's: its process's exit hook)
        self.bind()

    def shut(self) -> None:
        """Close's part on the shared words: this process's slot given back."""
        self.closed = True
        self._unregister()

    def detach(self) -> None:
        """Shut and unmap (once)."""
        if self.closed:
            return
        self.shut()
        self.cells.close()
        self.seg.close()

    def may_adopt(self, reconfigure: bool) -> bool:
        """A creating call may publish its config: with ``reconfigure`` (fleet-wide), or when no live
        process uses the segment (a redeploy boots).  A live creator counts as a user until it
        registers, just after the segment becomes ready (``join`` clears its pid): it must find
        the config it created (a pid reused since counts as alive: the safe side)."""
        creator = self.cells.load(L.CREATOR_PID_OFF)
        return reconfigure or not (
            self.table.live() or 0 < creator <= 0xFFFFFFFF and is_alive(creator, 0)
        )

    def vet(self, mode: int, trusted: FrozenSet[int]) -> None:
        """The trust check of a call that finds this segment open in this process already (it was
        vetted when this process first opened it, perhaps under a wider trust than this call's)."""
        seg = self.seg
        st = os.stat_result((seg.mode, 0, 0, 0, seg.owner, 0, seg.size, 0, 0, 0))
        check_trust(self.name, st, mode, trusted)


def count_out_at_exit(att: Attached) -> Any:
    """``att`` detached (as the ``atexit`` hook does) when this process ends as a
    ``multiprocessing`` child of the fork or forkserver method: it ends with ``os._exit`` after its
    finalizers, running no ``atexit`` hook.  Its slot is given back and a filler lease it holds
    dropped (a successor fills at once), or its count beyond the table taken back: a count left up
    keeps ``gc`` from ever collecting the segment.  (Outside such a child the ``atexit`` hook does
    it; a killed process leaves its count, see ``ProcessTable.beyond``.)  The finalizer, cancelled
    when the process leaves sooner; None without ``multiprocessing``."""
    util = sys.modules.get("multiprocessing.util")  # loaded in every multiprocessing child
    if util is None:
        return None
    return util.Finalize(None, _count_out, args=(weakref.ref(att),), exitpriority=0)


def _count_out(ref: "weakref.ref[Attached]") -> None:
    att = ref()
    if att is not None and att.joined and att.pid == os.getpid():
        att.detach()


A = TypeVar("A", bound=Attached)


def attach(
    name: str,
    make: Callable[[], Optional[A]],
    adopt: Callable[[A], None] = lambda att: None,
    check: Callable[[A], None] = lambda att: None,
    join: bool = True,
) -> A:
    """A new attachment (``make``: not joined yet, or None if a collector took the segment since it
    was opened), ``adopt`` run before registering, ``check`` after; opened again while a collector
    takes it meanwhile (``shm.segment.reopening``: 2 s at least).  Undone (detached) if any step
    fails."""
    what = "limiter"
    for _ in reopening():
        att = make()
        if att is None:
            continue
        what = att.what
        try:
            adopt(att)  # before registering: see attachment.adopt_config
            if join:
                att.join()
            # registered, then STATE (see shm.segment.claim_and_unlink): either the collector
            # sees us and gives the segment back, or we see its claim and open the name again
            if att.gone():
                att.detach()
                continue
            check(att)
        except BaseException:
            att.detach()
            raise
        return att
    raise SegmentError(f"could not open {what} {name!r}: it kept being collected")


class Registry(Generic[A]):
    """This process's attachments of one kind, by name."""

    def __init__(self) -> None:
        self._atts: Dict[str, A] = {}
        #: every attachment made and still held (by a handle, or a thread), the current one of each
        #: name and those of a name unlinked and made again since: the fork and exit hooks reach
        #: them all, so a handle that kept its attachment past the name's re-creation registers
        #: in a forked child on its first use as any other
        self._every: "weakref.WeakSet[A]" = weakref.WeakSet()
        # Re-entrant: a handle's __del__ run by the garbage collector in the middle of an open
        # (which holds the lock) must be able to take it again to drop its reference.
        self._lock = threading.RLock()
        os.register_at_fork(after_in_child=self._in_child)
        atexit.register(self._detach_all)

    def open(
        self,
        name: str,
        make: Callable[[], A],
        check: Callable[[A], None],
        mode: int,
        trusted: FrozenSet[int],
    ) -> A:
        """The attachment to ``name``, made (``make``) on first use or vetted under ``mode`` and
        ``trusted`` and checked (``check``) after; one more handle."""
        with self._lock:
            att = self._atts.get(name)
            # a name unlinked and re-created since we mapped it is a different limiter (its
            # attachment stays its handles')
            if att is None or att.closed or current_inode(att.seg.name) != att.seg.inode:
                att = make()
                # reachable by the fork hook before it is handed out: a fork from another thread
                # between the two stores left a child using the parent's slot as its own
                self._every.add(att)
                self._atts[name] = att
            else:
                att.vet(mode, trusted)
                check(att)
            att.refs += 1
            return att

    def release(self, att: A, detach: bool) -> None:
        """Drop one handle.  The attachment ends only when its last handle is closed explicitly.

        A handle that is merely garbage-collected keeps the process attached (and
        registered) until exit: a pool worker that unpickles a fresh handle for
        every task must not re-register and restart its filler thread each time.
        """
        with self._lock:
            att.refs -= 1
            if att.refs > 0 or not detach:
                return
            if self._atts.get(att.name) is att:
                del self._atts[att.name]
        att.detach()

    def _in_child(self) -> None:
        self._lock = threading.RLock()
        for att in list(self._every):
            if not att.closed:
                att.after_fork_in_child()

    def _held(self) -> list:
        """Every attachment held, copied.  A WeakSet is copied item by item: a thread that opens a
        limiter meanwhile makes the copy fail ("changed size"), so it is taken again; the lock is
        not taken, as at exit a daemon thread may hold it for good."""
        for _ in range(1000):
            try:
                return list(self._every)
            except RuntimeError:
                continue
        return list(self._atts.values())  # (opened without end: each name's current one)

    def _detach_all(self) -> None:
        for att in self._held():
            try:
                att.detach()
            except Exception:  # pragma: no cover - best effort at exit
                pass
        self._atts.clear()


@contextmanager
def attaching(only: bool) -> Iterator[None]:
    """A constructor's open; ``only``: called without ``rate=``, it attaches and never creates, so
    a missing limiter's error says what creates one."""
    try:
        yield
    except LimiterNotFoundError as e:
        if only:
            e.args = (f"{e.args[0]}; pass rate= to create it",)
        raise


def pickled(handle: Any, make: Callable[..., Any], *args: Any) -> Tuple[Any, ...]:
    """Every kind's ``__reduce__``: the handle opened again by ``make(name, *args, mode=,
    trusted_uids=)`` (``reopen``) with the trust it was opened with (its ``_mode`` and
    ``_trusted``), so that the unpickling process accepts the segment the sender did."""
    return (reopen, (make, handle._name, handle._mode, tuple(sorted(handle._trusted))) + args)


def reopen(
    make: Callable[..., Any], name: str, mode: int, trusted: Tuple[int, ...], *args: Any
) -> Any:
    """A pickled handle (``pickled``), opened again in the unpickling process."""
    return make(name, *args, mode=mode, trusted_uids=trusted)


def described(head: str, read: Callable[[], str]) -> str:
    """A handle's repr, ``<head ...>``: ``read()``, its live state, or ``unreadable: why`` when that
    cannot be read (a corrupt segment, say): a repr never raises."""
    try:
        return f"<{head} {read()}>"
    except (ShmlimitError, OSError, ValueError) as e:
        return f"<{head} unreadable: {e}>"


class Held:
    """A handle on what it holds of a registry's, whatever its kind: its name, what it holds
    (``_att``, None once closed in this process), ``close``, ``unlink``, its release when
    collected.  A kind sets ``_registry`` (what releases what it holds: a registry, for one
    attachment) and ``what`` (its name in errors), and keeps the trust it was opened with
    (``_mode``, ``_trusted``: a pickled handle carries it, ``pickled``)."""

    _name: str
    _mode: int
    _trusted: FrozenSet[int]
    _att: Any
    _registry: Any
    what = "limiter"

    @property
    def name(self) -> str:
        return self._name

    @property
    def closed(self) -> bool:
        return self._att is None

    def _peek(self) -> Any:
        """What it holds, for reading (ValueError once this handle is closed)."""
        att = self._att
        if att is None:
            raise ValueError(f"{self.what} {self._name!r} is closed in this process")
        return att

    def close(self) -> None:
        """Detach this handle.  The segment stays (use ``unlink``); other processes are unaffected."""
        att, self._att = self._att, None
        if att is not None:
            self._registry.release(att, True)

    def unlink(self) -> None:
        """Remove the segment's name (``LimiterNotFoundError`` when there is none).  Processes still
        attached keep working on their mapping."""
        unlink(self._name)

    def __del__(self) -> None:
        """Take what it holds from the handle, once, and release it without detaching (the process
        stays attached, see ``Registry.release``), quietly: at interpreter shutdown what the release
        needs may be gone already."""
        att, self._att = getattr(self, "_att", None), None
        if att is not None:
            try:
                self._registry.release(att, False)
            except Exception:  # pragma: no cover - interpreter shutdown
                pass


class Handle(Held):
    """A handle on one attachment (``_att``), ``_registry`` its kind's registry."""

    _att: Optional[Attached]
    _registry: "Registry[Any]"

    @property
    def created(self) -> bool:
        """True if this process created (and initialised) the segment."""
        return self._peek().created

    @property
    def backend(self) -> str:
        """The atomic layer's backend ("native" or "atomics")."""
        return self._peek().cells.backend
