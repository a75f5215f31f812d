"""Segments seen from outside the atomic layer: raw bytes, hostile files, and the tools' view of them."""

from __future__ import annotations

import io
import os
import uuid
from contextlib import contextmanager, redirect_stderr, redirect_stdout
from typing import Any, Callable, Iterable, Iterator, Tuple


def shm_path(name: str) -> str:
    return f"/dev/shm/shmlimit.{name}"


def shm_bytes(name: str) -> bytes:
    """The segment's raw bytes, read through the filesystem (not the atomic layer)."""
    with open(shm_path(name), "rb") as f:
        return f.read()


def unique_name(prefix: str) -> str:
    """A limiter name no other test (of this run or another) uses: ``prefix``, this pid, a random tail."""
    return f"{prefix}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def captured(create: Callable[[str], Any], prefix: str = "test-template") -> bytes:
    """The raw bytes of a real segment: ``create(name)`` makes it and returns what it opened, which
    is then closed, the segment unlinked."""
    import shmlimit

    name = unique_name(prefix)
    opened = create(name)
    try:
        data = shm_bytes(name)
    finally:
        opened.close()
        shmlimit.unlink(name)
    return data


def secret_path(name: str) -> str:
    """The path of segment ``name``'s secret file: by its inode and its header's CREATED_NS."""
    from shmlimit.shm import layout as L
    from shmlimit.shm.segment import PREFIX, SHM_DIR, secret_entry

    with open(shm_path(name), "rb") as f:
        created = int.from_bytes(os.pread(f.fileno(), 8, L.CREATED_NS_OFF), "little")
        return os.path.join(
            SHM_DIR, PREFIX + secret_entry(name, os.fstat(f.fileno()).st_ino, created)
        )


def secret_of(name: str) -> bytes:
    """The bytes of segment ``name``'s secret file (a keyed segment's: its hash's key)."""
    with open(secret_path(name), "rb") as f:
        return f.read()


def with_words(data: bytes, changes: Iterable[Tuple[int, int]]) -> bytearray:
    """A copy of a segment's bytes with each ``(word index, 64-bit value)`` of ``changes`` written."""
    out = bytearray(data)
    for word, value in changes:
        out[word * 8 : word * 8 + 8] = value.to_bytes(8, "little")
    return out


@contextmanager
def planted(data: bytes, prefix: str, secret: bytes = b"") -> Iterator[str]:
    """``data`` where a segment's file would be, under a new name (yielded), removed on leaving.
    The file is made here (O_EXCL, mode 0600): no segment of anyone else is touched.  With
    ``secret``, its secret file beside it holding those bytes (``secret_of``; a keyed segment's:
    without it, an attach is refused before it reads a word of the table)."""
    from shmlimit.shm import layout as L
    from shmlimit.shm.segment import PREFIX, SHM_DIR, secret_entry

    name = unique_name(prefix)
    path = shm_path(name)
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    created = int.from_bytes(
        data[L.CREATED_NS_OFF : L.CREATED_NS_OFF + 8].ljust(8, b"\0"), "little"
    )
    key = os.path.join(SHM_DIR, PREFIX + secret_entry(name, os.fstat(fd).st_ino, created))
    try:
        os.write(fd, data)
        if secret:
            kfd = os.open(key, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
            os.write(kfd, secret)
            os.close(kfd)
        yield name
    finally:
        os.close(fd)
        os.unlink(path)
        if secret and os.path.exists(key):
            os.unlink(key)


def no_opener_waits(monkeypatch: Any, *modules: Any) -> None:
    """A zero magic looks like a segment still being initialised, so an opener waits for its creator:
    where no creator exists, the waits of ``modules`` (``header`` and the like) are cut to nothing (the
    judgement is the same)."""
    for module in modules:
        monkeypatch.setattr(module, "INIT_WAIT", 0.0)
        monkeypatch.setattr(module, "LIVE_CREATOR_WAIT", 0.0)


def run_tools_on(monkeypatch: Any, prefix: str, *argv: str) -> Tuple[int, str]:
    """``shmlimit argv...`` run in this process as if the segments named ``prefix``... were the only
    ones on the machine: ``(exit code, stdout)``.  A test's ``gc`` then never collects a segment of
    another test run (one whose processes are between a close and the next attach, say), nor the
    secret file another run left on purpose, and never lists theirs."""
    from shmlimit.cli import main as cli

    real, real_secrets = cli.scan, cli.orphan_secrets

    def own() -> Tuple[list, list]:
        good, bad = real()
        return [n for n in good if n.startswith(prefix)], [n for n in bad if n.startswith(prefix)]

    out = io.StringIO()
    with monkeypatch.context() as m:
        m.setattr(cli, "scan", own)
        m.setattr(
            cli, "orphan_secrets", lambda: [s for s in real_secrets() if s[0].startswith(prefix)]
        )
        with redirect_stdout(out), redirect_stderr(io.StringIO()):
            code = cli.main(list(argv))
    return code, out.getvalue()
