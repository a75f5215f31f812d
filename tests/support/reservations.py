"""A reservation over several rates stopped part-way in a child process, and killed there.

The child script makes a ``MultiLimiter``, calls ``stop_part_way`` and reserves; the test runs it
with ``killed_part_way``, looks at the rates while the child is stopped, and finds after its death
what it left queued.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
from typing import Any, Callable, Iterator, Optional

from shmlimit.bucket.rovers import diff
from shmlimit.shm import layout as L

from .procs import TESTS, WORKDIR


def queued(atts: Any) -> bool:
    """Whether any of the rates (their attachments) has a claim queued: its tail past its head."""
    return any(diff(t.cells.load(L.TAIL), t.cells.load(L.HEAD)) > 0 for t in atts)


def stop_part_way(lim: Any, say: Callable[[int], Optional[str]]) -> None:
    """In the child: before each claim of ``lim``'s reservations on any rate (``take_within``),
    ``say(looks)`` (the claims looked at so far, this one included) tells whether to stop there:
    what it returns is printed, and the child blocks on its stdin (the test kills it there)."""
    looks = [0]
    for t in lim._live():
        b = t.bucket

        def take_within(*args: Any, real: Callable[..., Any] = b.take_within, **kwargs: Any) -> Any:
            looks[0] += 1
            said = say(looks[0])
            if said:
                print(said, flush=True)
                sys.stdin.readline()
            return real(*args, **kwargs)

        b.take_within = take_within


#: The child scripts' first lines: argv[1] is the limiter's name, argv[2] the tests' folder.
PREAMBLE = """
import sys
sys.path.insert(0, sys.argv[2])  # the tests' folder, for support (shmlimit stays the installed one)
import shmlimit
from support.reservations import queued, stop_part_way
"""


@contextlib.contextmanager
def killed_part_way(script: str, name: str) -> Iterator[str]:
    """Run ``script`` (PREAMBLE, then a reservation that ``stop_part_way`` stops) on limiter
    ``name``; the body runs while it is stopped, given what it printed there, and the child is
    killed (SIGKILL) and reaped after."""
    p = subprocess.Popen(
        [sys.executable, "-c", script, name, TESTS],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=WORKDIR,
    )
    try:
        yield p.stdout.readline().strip()
    finally:
        p.kill()
        p.wait()
        p.stdout.close()
        p.stdin.close()
