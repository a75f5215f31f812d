"""One attachment per name per process, for each kind of limiter.

Every handle for a name in a process shares one attachment (one mapping, one
process slot, one filler thread), counted by ``refs``.  A registry hands it
out (``open``), drops a handle (``release``), runs its kind's hook in a
forked child for every attachment inherited (``after_fork``), and detaches
every attachment at exit, so a held filler lease is dropped and a successor
fills at once.
"""

from __future__ import annotations

import atexit
import os
import threading
from typing import Any, Callable, Dict, Generic, Protocol, TypeVar

from shmlimit.shm.segment import Segment, current_inode


class Attached(Protocol):
    """What a registry needs of an attachment."""

    name: str
    seg: Segment
    refs: int
    closed: bool

    def detach(self) -> None: ...


A = TypeVar("A", bound=Attached)


class Registry(Generic[A]):
    """This process's attachments of one kind, by name."""

    def __init__(self, after_fork: Callable[[A], None]) -> None:
        self._atts: Dict[str, A] = {}
        # Re-entrant: a handle's __del__ run by the garbage collector in the middle of an open
        # (which holds the lock) must be able to take it again to drop its reference.
        self._lock = threading.RLock()
        self._after_fork = after_fork
        os.register_at_fork(after_in_child=self._in_child)
        atexit.register(self._detach_all)

    def open(self, name: str, make: Callable[[], A], check: Callable[[A], None]) -> A:
        """The attachment to ``name``, made (``make``) on first use or checked (``check``) after; one more handle."""
        with self._lock:
            att = self._atts.get(name)
            # a name unlinked and re-created since we mapped it is a different limiter
            if att is not None and (att.closed or current_inode(att.seg.name) != att.seg.inode):
                self._atts.pop(name, None)
                att = None
            if att is None:
                att = make()
                self._atts[name] = att
            else:
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
        for att in list(self._atts.values()):
            if not att.closed:
                self._after_fork(att)

    def _detach_all(self) -> None:
        for att in list(self._atts.values()):
            try:
                att.detach()
            except Exception:  # pragma: no cover - best effort at exit
                pass
        self._atts.clear()


def release_on_gc(handle: Any, release: Callable[[Any, bool], None]) -> None:
    """A handle's ``__del__``: take its attachment (``handle._att``) from it, once, and ``release`` it
    without detaching (the process stays attached, see ``Registry.release``), quietly: at interpreter
    shutdown what the release needs may be gone already."""
    att, handle._att = getattr(handle, "_att", None), None
    if att is not None:
        try:
            release(att, False)
        except Exception:  # pragma: no cover - interpreter shutdown
            pass
