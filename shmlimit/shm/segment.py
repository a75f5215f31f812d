"""Named POSIX shared-memory segments: names, creation, opening, unlinking, listing.

Lifecycle rules (as in ``multiprocessing.shared_memory``): a segment lives until
it is unlinked, even when no process has it mapped; unlinking removes the name
at once, while processes that still have it mapped keep using their mapping.
Creation is exclusive (``O_CREAT | O_EXCL``), so of many processes racing to
create one name exactly one creates and initialises it; the others open it.
"""

from __future__ import annotations

import errno
import mmap
import os
import random
import re
import stat
import time
from contextlib import closing, contextmanager
from typing import (
    AbstractSet,
    Any,
    Iterable,
    Iterator,
    List,
    Optional,
    Sequence,
    Tuple,
    Union,
)

import posix_ipc  # creation and unlinking; opening is ``opened``

from shmlimit.errors import (
    LimiterNotFoundError,
    SegmentError,
    SharedMemoryFullError,
    UntrustedSegmentError,
)
from shmlimit.shm import layout as L
from shmlimit.shm.cells import Cells, open_cells
from shmlimit.shm.table import ProcessTable

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


#: A segment this old (seconds) with no creator pid in its header was abandoned by its creator
#: (both kinds of segment: one header protocol).
INIT_WAIT = 2.0
#: How long an opener waits for a live creator to finish initialising (seconds); a creator is
#: never replaced while it lives, however slow, but an opener gives up with an error after this.
LIVE_CREATOR_WAIT = 30.0
#: No limiter is larger than this (bytes): a bigger file is not read or mapped.
MAX_BYTES = L.segment_size(L.MAX_SLOTS)
#: Write bits another user could hold.
_WRITE_BITS = 0o022


def validate_trusted_uids(uids: Iterable[int]) -> frozenset:
    """``trusted_uids`` as a frozenset, each a uid from 0 to 2**32-1; TypeError/ValueError naming it otherwise."""
    if isinstance(uids, (str, bytes, int)):
        raise TypeError(
            f"trusted_uids must be an iterable of uids (ints), not {type(uids).__name__}"
        )
    out = []
    for u in uids:
        if isinstance(u, bool) or not isinstance(u, int) or not 0 <= u <= 0xFFFFFFFF:
            raise ValueError(f"trusted_uids must hold uids from 0 to 4294967295, got {u!r}")
        out.append(u)
    return frozenset(out)


def validate_mode(mode: object) -> int:
    """A segment's ``mode``: permission bits from 0 to 0o777; ValueError naming it otherwise."""
    if isinstance(mode, bool) or not isinstance(mode, int) or not 0 <= mode <= 0o777:
        raise ValueError(f"mode must be permission bits between 0 and 0o777, got {mode!r}")
    return mode


def validate_slots(slots: object) -> int:
    """A limiter's process table size, ``slots``: an int from 1 to ``MAX_SLOTS``; ValueError naming it otherwise."""
    if isinstance(slots, bool) or not isinstance(slots, int) or not 1 <= slots <= L.MAX_SLOTS:
        raise ValueError(f"slots must be an int from 1 to {L.MAX_SLOTS}, got {slots!r}")
    return slots


#: How every existing segment is opened: never through a symlink, never waiting on a FIFO or a
#: device (a FIFO opened for reading blocks until a writer comes: forever, if planted), never
#: inherited by a child that execs.
_OPEN_FLAGS = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
#: What an open refused with these errors found under the name.
_NOT_REGULAR = {
    errno.ELOOP: "a symbolic link",
    errno.EISDIR: "a directory",
    errno.ENXIO: "a device or socket",
}


@contextmanager
def opened(
    name: str,
    *,
    write: bool = False,
    mode: Optional[int] = None,
    trusted_uids: AbstractSet[int] = frozenset(),
    max_bytes: Optional[int] = None,
) -> Iterator[Tuple[int, os.stat_result]]:
    """The one way an existing segment is opened, by every kind and every tool: ``(fd, fstat)``.

    Whatever another local user planted under the name (a FIFO, a symlink, a
    directory, a device) is refused with ``SegmentError`` at once, never waited
    on or followed.  The checks run on the descriptor the caller then reads or
    maps, so they hold for what it reads: a regular file, at most ``max_bytes``
    (None: any size), and with ``mode``, one ``check_trust`` accepts.  The
    descriptor is closed on leaving (a mapping made from it stays valid).
    """
    path = os.path.join(SHM_DIR, PREFIX + name)
    try:
        fd = os.open(path, (os.O_RDWR if write else os.O_RDONLY) | _OPEN_FLAGS)
    except FileNotFoundError:
        raise LimiterNotFoundError(name) from None
    except PermissionError as e:
        raise PermissionError(f"not allowed to open limiter {name!r}: {e.strerror}") from None
    except OSError as e:
        what = _NOT_REGULAR.get(e.errno)
        if what:
            raise SegmentError(f"segment {name!r} is not a regular file: {what}") from None
        raise SegmentError(f"segment {name!r} cannot be opened: {e.strerror or e}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            what = (
                "a FIFO"
                if stat.S_ISFIFO(st.st_mode)
                else "a directory"
                if stat.S_ISDIR(st.st_mode)
                else "a device or socket"
            )
            raise SegmentError(f"segment {name!r} is not a regular file: {what}")
        if mode is not None:
            check_trust(name, st, mode, trusted_uids)
        if max_bytes is not None and st.st_size > max_bytes:
            raise SegmentError(
                f"segment {name!r} is {st.st_size} bytes; no limiter of its kind is larger "
                f"than {max_bytes}"
            )
        yield fd, st
    finally:
        os.close(fd)


def trusted_owner(uid: int, trusted_uids: AbstractSet[int]) -> bool:
    """Whether a segment owned by ``uid`` is trusted: this process's effective uid, root (who can
    write any segment anyway) or one of ``trusted_uids``."""
    return uid in (os.geteuid(), 0) or uid in trusted_uids


def check_trust(name: str, st: os.stat_result, mode: int, trusted_uids: AbstractSet[int]) -> None:
    """Refuse a segment that someone this process does not trust could have written.

    Trusted owners: this process's effective uid, root (who can write any
    segment anyway) and ``trusted_uids``.  Whatever the owner, the segment may
    not be writable by group or others beyond what ``mode`` asks for: a 0666
    segment is writable by every local user, so attaching to it would hand
    them the limit.  Checked on the descriptor that is then mapped, so the
    answer holds for the mapping (a name replaced afterwards is another segment).
    """
    owner = st.st_uid
    bits = st.st_mode & 0o7777
    if not trusted_owner(owner, trusted_uids):
        raise UntrustedSegmentError(
            name,
            owner,
            bits,
            f"another user owns it; pass trusted_uids=[{owner}] only if you trust that user",
        )
    extra = bits & _WRITE_BITS & ~mode
    if extra:
        raise UntrustedSegmentError(
            name,
            owner,
            bits,
            f"it is writable by {'group and others' if extra == _WRITE_BITS else 'group' if extra & 0o020 else 'others'}"
            f" beyond the mode asked for ({mode:#o}); pass mode={bits & 0o777:#o} only if that is intended",
        )


def _check_header_size(
    name: str, fd: int, size: int, magic_of_kind: int, max_bytes: Optional[int]
) -> None:
    """Before mapping: a segment of the expected kind (``magic_of_kind``) must be at most
    ``max_bytes`` (None: any), and a ready header must not claim more bytes than the file has.

    A mapping longer than its file raises SIGBUS on the first access past the
    end; reading the header with ``pread`` first keeps that from ever happening
    to a segment that was truncated (or forged) before we opened it.  A segment
    of another kind is left to the opener, which names its kind.
    """
    if size < L.LINE:
        return
    head = os.pread(fd, L.LINE, 0)
    if len(head) < L.LINE:
        raise SegmentError(f"segment {name!r} shrank while it was being opened")
    magic, state, declared = (
        int.from_bytes(head[o : o + 8], "little") for o in (L.MAGIC_OFF, L.STATE_OFF, L.SIZE_OFF)
    )
    if magic != magic_of_kind:
        return
    if max_bytes is not None and size > max_bytes:
        raise SegmentError(
            f"segment {name!r} is {size} bytes; no limiter of its kind is larger than {max_bytes}"
        )
    if state == L.STATE_READY and declared > size:
        raise SegmentError(
            f"segment {name!r} is truncated: its header says {declared} bytes, the file has {size}"
        )


class Segment:
    """One mapping of a named segment.  ``created`` says whether this call made it."""

    def __init__(
        self,
        name: str,
        mm: Union[mmap.mmap, bytearray],
        size: int,
        created: bool,
        inode: int,
        ctime_ns: int = 0,
        owner: int = -1,
        mode: int = 0,
    ) -> None:
        self.name = name
        self.mm = mm
        self.size = size
        self.created = created
        self.inode = inode
        self.ctime_ns = ctime_ns  #: when the segment was created and sized (CLOCK_REALTIME ns)
        self.owner = owner  #: uid owning the segment when it was opened
        self.mode = mode  #: its permission bits then

    @classmethod
    def create(cls, name: str, size: int, mode: int) -> Optional["Segment"]:
        """Create and map a new zero-filled segment; None if the name exists already.

        Its pages are allocated here (``posix_fallocate``): a full ``/dev/shm``
        raises ``SharedMemoryFullError`` now, instead of SIGBUS at the first write.
        """
        try:
            shm = posix_ipc.SharedMemory(posix_name(name), posix_ipc.O_CREX, mode=mode, size=0)
        except posix_ipc.ExistentialError:
            return None
        try:
            os.fchmod(shm.fd, mode)  # the umask must not narrow an explicit mode
            st = os.fstat(shm.fd)
            try:
                os.posix_fallocate(shm.fd, 0, size)
            except OSError as e:
                if current_inode(name) == st.st_ino:  # ours, never initialised: take the name back
                    try:
                        posix_ipc.unlink_shared_memory(posix_name(name))
                    except posix_ipc.ExistentialError:  # pragma: no cover - removed meanwhile
                        pass
                if e.errno == errno.ENOSPC:
                    raise SharedMemoryFullError(
                        errno.ENOSPC,
                        f"cannot create limiter {name!r}: shared memory ({SHM_DIR}) has no room for {size} bytes",
                    ) from None
                raise
            mm = mmap.mmap(shm.fd, size)
        finally:
            shm.close_fd()
        return cls(name, mm, size, True, st.st_ino, st.st_ctime_ns, st.st_uid, st.st_mode & 0o7777)

    @classmethod
    def open(
        cls,
        name: str,
        mode: Optional[int] = None,
        trusted_uids: AbstractSet[int] = frozenset(),
        magic: int = L.MAGIC,
        max_bytes: Optional[int] = MAX_BYTES,
    ) -> "Segment":
        """Map an existing segment at its current size (which may still be 0 while its creator sizes it).

        With ``mode``, the segment must pass ``check_trust`` first: nothing of
        an untrusted segment is read or mapped.  One whose first word is ``magic`` (the kind
        the caller expects) is checked with ``pread`` before it is mapped (``_check_header_size``).
        """
        with opened(name, write=True, mode=mode, trusted_uids=trusted_uids) as (fd, st):
            size = st.st_size
            _check_header_size(name, fd, size, magic, max_bytes)
            mm = map_sized(name, fd, size) if size else None
        return cls(name, mm, size, False, st.st_ino, st.st_ctime_ns, st.st_uid, st.st_mode & 0o7777)  # type: ignore[arg-type]

    @classmethod
    def copy(cls, name: str) -> "Segment":
        """A private copy of the segment's bytes, read with ``pread``: nothing is mapped.

        For the tools that only look (``inspect``, ``list``, ``top``, ``gc``): a
        segment truncated or replaced under them cannot raise SIGBUS, and a
        FIFO, symlink or directory under a limiter's name is refused, never
        waited on.
        """
        data, st = pread_file(name, 0, None)
        size = len(data) & ~7  # whole words only
        buf = bytearray(max(size, 8))  # a fresh, 8-aligned buffer for the atomic layer
        buf[:size] = data[:size]
        return cls(
            name, buf, size, False, st.st_ino, st.st_ctime_ns, st.st_uid, st.st_mode & 0o7777
        )

    def close(self) -> None:
        if isinstance(self.mm, mmap.mmap):
            self.mm.close()
        self.mm = None  # type: ignore[assignment]


def pread_file(
    name: str, offset: int, length: Optional[int], max_bytes: Optional[int] = MAX_BYTES
) -> Tuple[bytearray, os.stat_result]:
    """``length`` bytes (None: to the end) from ``offset`` of the segment, read with ``pread``; and its stat.

    Nothing is mapped, so a segment truncated under the reader cannot raise
    SIGBUS (it is judged on what is there), and a FIFO, symlink or directory
    under a limiter's name is refused, never waited on.  A file larger than
    ``max_bytes`` (a ``Limiter``'s largest by default; None: any) is refused.
    """
    with opened(name, max_bytes=max_bytes) as (fd, st):
        want = st.st_size - offset if length is None else length
        data = bytearray()
        while len(data) < want:
            chunk = os.pread(fd, want - len(data), offset + len(data))
            if not chunk:
                break  # truncated while we read: judged on what is there
            data += chunk
    return data, st


def peek_word(name: str, offset: int = L.MAGIC_OFF) -> int:
    """A word of ``name``'s segment, read with ``pread`` (nothing mapped; 0 past its end): its first,
    ``MAGIC``, says which kind of limiter it is."""
    data, _ = pread_file(name, offset, 8, None)
    return int.from_bytes(bytes(data[:8]).ljust(8, b"\0"), "little")


def unlink(name: str) -> None:
    """Remove the segment's name, and its secret file if it has one.  Raises
    LimiterNotFoundError when there is none, PermissionError when this user may not remove it."""
    validate_name(name)
    inode = current_inode(name)
    try:
        posix_ipc.unlink_shared_memory(posix_name(name))
    except posix_ipc.ExistentialError:
        raise LimiterNotFoundError(name) from None
    except posix_ipc.PermissionsError as e:  # not an OSError: said as the one the callers catch
        raise PermissionError(
            f"not allowed to remove limiter {name!r}: {e} (in {SHM_DIR} only its owner or root "
            "may remove a segment)"
        ) from None
    if inode is not None:
        drop_secret(name, inode)


# ---- a segment's secret file: what its writers know and its readers must not
#
# A keyed table's hash secret is kept out of the segment, which a group may read (mode 0o640),
# in a file beside it that only the classes that may write the segment can read
# (``secret_mode``).  It is named by the segment's name, inode and creation instant (its
# ``CREATED_NS``), ``shmlimit.<name>~secret-<ino>-<ns>`` ('~' is in no limiter's name), so that
# it belongs to one segment: a segment created again under the name has another inode or
# instant, hence another file, and no remover of one can take the other's.  The instant is what
# no other user can foresee: inodes come one after another, and files planted under the names
# of inodes to come (which the sticky directory keeps their creator from removing) made every
# new keyed table fail.  Its creator writes it before the segment is READY; ``unlink`` removes
# it with the name; ``orphan_secrets`` finds those whose segment is gone (``gc`` removes them).

_SECRET_SEP = "~secret-"
_SECRET_RE = re.compile(r"(.+)" + re.escape(_SECRET_SEP) + r"(0|[1-9][0-9]*)-(0|[1-9][0-9]*)")


def secret_entry(name: str, inode: int, created: int) -> str:
    """The secret file of segment ``name`` whose inode is ``inode`` and ``CREATED_NS``
    ``created``, as a name under ``PREFIX``."""
    return f"{name}{_SECRET_SEP}{inode}-{created}"


def created_ns(seg: Segment) -> int:
    """The ``CREATED_NS`` of the segment ``seg`` maps (its creator's, written once)."""
    with closing(open_cells(seg.mm, L.HEADER_BYTES)) as c:
        return c.load(L.CREATED_NS_OFF)


def _secret_of(entry: str) -> Optional[Tuple[str, int]]:
    """``(name, inode)`` if ``entry`` (less ``PREFIX``) is a segment's secret file, else None."""
    m = _SECRET_RE.fullmatch(entry)
    return (m.group(1), int(m.group(2))) if m and _valid(m.group(1)) else None


def secret_mode(mode: int) -> int:
    """A secret file's mode: the segment's, less the read bit of each class that cannot write it
    (0o640 -> 0o600, 0o660 -> 0o660, 0o644 -> 0o600)."""
    mode &= 0o666
    return mode & ~(0o444 & ~(mode << 1))


def write_secret(seg: Segment, data: bytes) -> None:
    """Create the secret file of the new segment ``seg`` (its creator's, before READY) holding ``data``."""
    path = os.path.join(SHM_DIR, PREFIX + secret_entry(seg.name, seg.inode, created_ns(seg)))
    mode = secret_mode(seg.mode)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _OPEN_FLAGS
    try:
        fd = os.open(path, flags, mode)
    except FileExistsError:
        # left by a removed segment whose inode this one reuses (the name is ours): that one is
        # gone, and so is what its secret hashed; another user's file here is refused (EPERM)
        os.unlink(path)
        fd = os.open(path, flags, mode)
    try:
        os.fchmod(fd, mode)  # the umask must not narrow it, as a segment's
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)


def read_secret(
    seg: Segment,
    size: int,
    mode: Optional[int],
    trusted_uids: AbstractSet[int] = frozenset(),
) -> bytes:
    """The ``size`` bytes of the secret file of segment ``seg``, opened as a segment is
    (``opened``: the same trust check with ``mode``); ``PermissionError`` for a process that may
    not read it, ``SegmentError`` when it is missing or not ``size`` bytes."""
    name = seg.name
    entry = secret_entry(name, seg.inode, created_ns(seg))
    try:
        with opened(entry, mode=mode, trusted_uids=trusted_uids, max_bytes=size) as (fd, _):
            data = os.pread(fd, size, 0)
    except LimiterNotFoundError:
        raise SegmentError(
            f"segment {name!r} has lost its secret file ({PREFIX}{entry}): "
            "remove the segment (shmlimit unlink) to start afresh"
        ) from None
    except UntrustedSegmentError:
        raise
    except PermissionError:
        raise PermissionError(
            f"not allowed to read the secret of limiter {name!r} ({PREFIX}{entry}): only the "
            "users who may write a keyed limiter may read its secret (chgrp it with the segment)"
        ) from None
    if len(data) != size:
        raise SegmentError(f"segment {name!r} is corrupt: its secret file is not {size} bytes")
    return data


def drop_secret(name: str, inode: int) -> bool:
    """Remove the secret file of segment ``name`` (inode ``inode``), whatever its instant; False
    if there was none (every kind but a keyed table has none) or it is another user's."""
    try:
        entries = os.listdir(SHM_DIR)
    except OSError:  # pragma: no cover - non-Linux
        return False
    dropped = False
    for e in entries:
        if e.startswith(PREFIX) and _secret_of(e[len(PREFIX) :]) == (name, inode):
            try:
                os.unlink(os.path.join(SHM_DIR, e))
                dropped = True
            except OSError:
                pass
    return dropped


def orphan_secrets() -> List[Tuple[str, int]]:
    """``(name, inode)`` of each secret file whose segment is gone (sorted).

    Listed before each name is looked up: a segment is created before its secret file, so a
    file listed while its segment is being made is seen with its segment.
    """
    try:
        entries = os.listdir(SHM_DIR)
    except OSError:  # pragma: no cover - non-Linux
        return []
    found = [
        s for e in entries if e.startswith(PREFIX) for s in [_secret_of(e[len(PREFIX) :])] if s
    ]
    return sorted((n, ino) for n, ino in found if current_inode(n) != ino)


def current_inode(name: str) -> Optional[int]:
    """The inode the name holds now (None: no entry): the entry itself, never a link's target."""
    try:
        return os.lstat(os.path.join(SHM_DIR, PREFIX + name)).st_ino
    except OSError:
        return None


def map_sized(name: str, fd: int, size: int, offset: int = 0) -> mmap.mmap:
    """Map ``size`` bytes at ``offset`` of segment ``name``'s open file ``fd``, whose size was
    checked: ``SegmentError`` when another process cut it since (mmap refuses a length past the
    end; mapped, a cut page would be a SIGBUS at its first touch instead)."""
    try:
        return mmap.mmap(fd, size, offset=offset)
    except ValueError:
        raise SegmentError(f"segment {name!r} shrank while it was being opened") from None


#: A segment left claimed by a garbage collector this long (seconds) lost its collector.
DOOMED_WAIT = 2.0


def give_back_claim(mm: Any, waited: float) -> None:
    """An opener's answer to a claim it has waited on ``waited`` seconds (``mm``: the claimed
    segment's mapping, or a group's rate's): past ``DOOMED_WAIT`` its collector was killed
    between its claim and its unlink, and the segment, whole, is READY again (else every opener,
    and ``gc``, would find it being removed for ever)."""
    if waited > DOOMED_WAIT:
        with closing(open_cells(mm, L.HEADER_BYTES)) as c:
            c.cas(L.STATE_OFF, L.STATE_DOOMED, L.STATE_READY)


#: An open that another process keeps undoing (a collector's claim, an unlink, the name created
#: again) tries again for at least this long (seconds) before it reports it.  Each failed try is a
#: race lost to another process's step, so under churn some try wins: a count of tries cannot be
#: the bound (16 processes creating, closing and unlinking one name on 2 cores made one opener
#: lose 16 races in a row), time can.
REOPEN_FOR = 2.0


def reopening() -> Iterator[int]:
    """The tries of an open another process may undo: 16 at once, then each after a random pause
    of up to a millisecond (racing openers part), until ``REOPEN_FOR`` seconds have passed."""
    deadline = time.monotonic() + REOPEN_FOR
    tries = 0
    while tries < 16 or time.monotonic() < deadline:
        if tries >= 16:
            time.sleep(random.random() / 1000)
        yield tries
        tries += 1


def claim_and_unlink(name: str, inode: int, tables: Sequence[ProcessTable]) -> bool:
    """The collector's half of gc, for a segment of any kind (its file ``inode``), whose process
    tables are ``tables`` (one, or a group's: each of its regions'): claim it (STATE READY ->
    DOOMED, in each table's cells), look for a live process (``ProcessTable.live``), then unlink
    the name if it is still this segment's; True if it did.

    An opener registers, then looks at STATE (``gone``): with sequentially consistent words one
    of the two sees the other, so either the collector sees the opener and gives the segment back
    (DOOMED -> READY), or the opener sees the claim and opens the name again.  A group's regions
    are claimed one by one, looking for a live process before each: any in use gives every claim
    back, so an opener of any one region is seen, or sees its region's claim.
    """
    claimed: List[Cells] = []
    try:
        for t in tables:
            if any(u.live() for u in tables) or not t.cells.cas(
                L.STATE_OFF, L.STATE_READY, L.STATE_DOOMED
            ):
                return False
            claimed.append(t.cells)
        if any(t.live() for t in tables) or current_inode(name) != inode:
            return False
        try:
            unlink(name)
        except LimiterNotFoundError:
            return False
        claimed.clear()  # the name is gone: the claims stay, so a late opener opens afresh
        return True
    finally:
        for c in claimed:
            c.cas(L.STATE_OFF, L.STATE_DOOMED, L.STATE_READY)


def gone(name: str, inode: int, c: Cells) -> bool:
    """The opener's half of gc, after it registered: the segment was claimed by a collector (or
    is not READY), or its name was unlinked or now names another segment."""
    return c.load(L.STATE_OFF) != L.STATE_READY or current_inode(name) != inode


def scan() -> Tuple[List[str], List[str]]:
    """(valid limiter names, other entries named ``shmlimit.*``), both sorted; secret files
    (``secret_entry``) are in neither.

    Any user can create ``/dev/shm/shmlimit.-x``: such an entry is reported by
    the tools and skipped, never allowed to stop them.
    """
    try:
        entries = os.listdir(SHM_DIR)
    except OSError as e:  # pragma: no cover - non-Linux
        raise SegmentError(f"cannot list shared-memory segments: {e}") from None
    good, bad = [], []
    for e in entries:
        if e.startswith(PREFIX):
            n = e[len(PREFIX) :]
            if _secret_of(n) is None:  # a segment's secret file is its segment's (``gc``)
                (good if _valid(n) else bad).append(n)
    return sorted(good), sorted(bad)


def _valid(name: str) -> bool:
    try:
        validate_name(name)
        return True
    except ValueError:
        return False


def list_names() -> List[str]:
    """Names of every shmlimit segment on this machine (Linux: read from /dev/shm), sorted.

    Entries whose names are not valid limiter names are left out (see ``scan``).
    """
    return scan()[0]


def owner(name: str) -> Optional[int]:
    """The uid owning the name's entry (None: no entry), never a link's target; nothing is opened."""
    try:
        return os.lstat(os.path.join(SHM_DIR, PREFIX + name)).st_uid
    except OSError:
        return None


# ---- the header line every kind of segment begins with (layout's line 0)


def start_header(seg: Segment, version: int, slots: int) -> Cells:
    """Open a new segment's cells and write its header line, all but MAGIC and STATE (``publish``).

    The creator's pid goes first: an opener tells a working creator from a dead one by it.
    """
    c = open_cells(seg.mm, seg.size)
    c.store(L.CREATOR_PID_OFF, os.getpid())
    c.store(L.VERSION_OFF, version)
    c.store(L.SIZE_OFF, seg.size)
    c.store(L.SLOTS_OFF, slots)
    c.store(L.CREATED_NS_OFF, time.time_ns())
    return c


def publish(c: Cells, magic: int) -> None:
    """The creator's last writes, once every other word is in place: ``MAGIC``, then ``STATE = READY``.

    Openers wait for ``READY``, so nothing written before it is ever seen half-done.
    """
    c.store(L.MAGIC_OFF, magic)
    c.store(L.STATE_OFF, L.STATE_READY)
