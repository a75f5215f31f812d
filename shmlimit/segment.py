"""Named POSIX shared-memory segments: names, creation, opening, unlinking, listing.

Lifecycle rules (as in ``multiprocessing.shared_memory``): a segment lives until
it is unlinked, even when no process has it mapped; unlinking removes the name
at once, while processes that still have it mapped keep using their mapping.
Creation is exclusive (``O_CREAT | O_EXCL``), so of many processes racing to
create one name exactly one creates and initialises it; the others open it.
"""
from __future__ import annotations

import mmap
import os
import re
from typing import List, Optional, Tuple

import posix_ipc

from .errors import LimiterNotFoundError, SegmentError

PREFIX = "shmlimit."
NAME_MAX = 64
_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]*")
SHM_DIR = "/dev/shm"


def validate_name(name: object) -> str:
    """Names are 1-64 characters of ASCII letters, digits, ``_``, ``.`` and ``-``, not starting with ``.`` or ``-``."""
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, not {type(name).__name__}")
    if not 1 <= len(name) <= NAME_MAX or not _NAME_RE.fullmatch(name) or not name.isascii():
        raise ValueError(
            f"name must be 1-{NAME_MAX} ASCII letters, digits, '_', '.' or '-', "
            f"not starting with '.' or '-'; got {name!r}"
        )
    return name


def posix_name(name: str) -> str:
    return "/" + PREFIX + name


class Segment:
    """One mapping of a named segment.  ``created`` says whether this call made it."""

    def __init__(self, name: str, mm: mmap.mmap, size: int, created: bool, inode: int, ctime_ns: int = 0) -> None:
        self.name = name
        self.mm = mm
        self.size = size
        self.created = created
        self.inode = inode
        self.ctime_ns = ctime_ns  #: when the segment was created and sized (CLOCK_REALTIME ns)

    @classmethod
    def create(cls, name: str, size: int, mode: int) -> Optional["Segment"]:
        """Create and map a new zero-filled segment; None if the name exists already."""
        try:
            shm = posix_ipc.SharedMemory(posix_name(name), posix_ipc.O_CREX, mode=mode, size=size)
        except posix_ipc.ExistentialError:
            return None
        try:
            os.fchmod(shm.fd, mode)  # the umask must not narrow an explicit mode
            mm = mmap.mmap(shm.fd, size)
            inode = os.fstat(shm.fd).st_ino
        finally:
            shm.close_fd()
        return cls(name, mm, size, True, inode)

    @classmethod
    def open(cls, name: str) -> "Segment":
        """Map an existing segment at its current size (which may still be 0 while its creator sizes it)."""
        try:
            shm = posix_ipc.SharedMemory(posix_name(name))
        except posix_ipc.ExistentialError:
            raise LimiterNotFoundError(name) from None
        except posix_ipc.PermissionsError as e:
            raise PermissionError(f"not allowed to open limiter {name!r}: {e}") from None
        try:
            st = os.fstat(shm.fd)
            size = st.st_size
            mm = mmap.mmap(shm.fd, size) if size else None
        finally:
            shm.close_fd()
        return cls(name, mm, size, False, st.st_ino, st.st_ctime_ns)  # type: ignore[arg-type]

    def close(self) -> None:
        if self.mm is not None:
            self.mm.close()
            self.mm = None  # type: ignore[assignment]


def unlink(name: str) -> None:
    """Remove the segment's name.  Raises LimiterNotFoundError when there is none."""
    validate_name(name)
    try:
        posix_ipc.unlink_shared_memory(posix_name(name))
    except posix_ipc.ExistentialError:
        raise LimiterNotFoundError(name) from None


def current_inode(name: str) -> Optional[int]:
    try:
        return os.stat(os.path.join(SHM_DIR, PREFIX + name)).st_ino
    except OSError:
        return None


def list_names() -> List[str]:
    """Names of every shmlimit segment on this machine (Linux: read from /dev/shm), sorted."""
    try:
        entries = os.listdir(SHM_DIR)
    except OSError as e:  # pragma: no cover - non-Linux
        raise SegmentError(f"cannot list shared-memory segments: {e}") from None
    return sorted(e[len(PREFIX):] for e in entries if e.startswith(PREFIX))


def describe_mode(name: str) -> Tuple[int, int]:
    st = os.stat(os.path.join(SHM_DIR, PREFIX + name))
    return st.st_mode & 0o777, st.st_uid
