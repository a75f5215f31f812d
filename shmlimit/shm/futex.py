"""Futex wait and wake on a shared word, through libc: the ``atomics`` backend's half of the fed wait.

The native backend has the same two calls in ``_native.c`` (FED WAIT).  A
waiter sleeps while the low 32 bits of a 64-bit word hold the value it read,
until an absolute ``CLOCK_MONOTONIC`` deadline, and only for the bits of its
``bitset``; a waker wakes the sleepers whose bitset meets its own, in any
process that maps the word (a non-private futex).  Where the system call is
unknown (not Linux, or an architecture not listed) a wait is a plain sleep to
its deadline and a wake does nothing: callers bound every wait by a deadline
that is correct without the wake.
"""

from __future__ import annotations

import ctypes
import platform
import sys
import time
from typing import Any, Optional

#: SYS_futex by machine (Linux)
_SYS_FUTEX = {
    "x86_64": 202,
    "amd64": 202,
    "aarch64": 98,
    "arm64": 98,
    "riscv64": 98,
    "i386": 240,
    "i686": 240,
    "armv7l": 240,
    "armv6l": 240,
    "ppc64le": 221,
    "ppc64": 221,
    "s390x": 238,
}
_FUTEX_WAIT_BITSET = 9
_FUTEX_WAKE_BITSET = 10
_ETIMEDOUT = 110
_INT_MAX = 2**31 - 1
#: the low 32 bits of a 64-bit word start here (bytes into the word)
LOW_HALF = 4 if sys.byteorder == "big" else 0


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_calls: list = []


def _load() -> Optional[tuple]:
    if not _calls:
        nr = (
            _SYS_FUTEX.get(platform.machine().lower()) if sys.platform.startswith("linux") else None
        )
        fns: Optional[tuple] = None
        if nr is not None:
            try:
                # a wait releases the GIL (CDLL: it sleeps); a wake keeps it (PyDLL: taking the GIL
                # back from a busy thread, the filler's process, waits up to the switch interval)
                wait = ctypes.CDLL(None, use_errno=True).syscall
                wake = ctypes.PyDLL(None, use_errno=True).syscall
                for fn in (wait, wake):
                    fn.restype = ctypes.c_long
                fns = (nr, wait, wake)
            except (OSError, AttributeError):  # pragma: no cover - no libc syscall
                fns = None
        _calls.append(fns)
    return _calls[0]


def available() -> bool:
    """True when waits can be woken (Linux, a known architecture)."""
    return _load() is not None


def wait(addr: int, expected: int, bitset: int, deadline_ns: int) -> bool:
    """Sleep while the 32-bit word at ``addr`` holds ``expected`` (its low 32 bits), until ``deadline_ns``.

    False once the deadline passed; True when woken, when the word differed
    or on a signal (the caller looks again).
    """
    fns = _load()
    if fns is None:
        left = deadline_ns - time.monotonic_ns()
        if left > 0:
            time.sleep(left / 1e9)
        return False
    nr, fn, _ = fns
    ts = _Timespec(deadline_ns // 1_000_000_000, deadline_ns % 1_000_000_000)
    # syscall() is variadic: every argument goes as a whole register (the kernel reads its low 32 bits)
    r = fn(
        ctypes.c_long(nr),
        ctypes.c_void_p(addr),
        ctypes.c_long(_FUTEX_WAIT_BITSET),
        ctypes.c_ulong(expected & 0xFFFFFFFF),
        ctypes.byref(ts),
        ctypes.c_void_p(None),
        ctypes.c_ulong(bitset),
    )
    return not (r != 0 and ctypes.get_errno() == _ETIMEDOUT)


def wake(addr: int, bitset: int) -> int:
    """Wake the sleepers on the word at ``addr`` whose bitset meets ``bitset``; how many."""
    fns = _load()
    if fns is None:
        return 0
    nr, _, fn = fns
    r = fn(
        ctypes.c_long(nr),
        ctypes.c_void_p(addr),
        ctypes.c_long(_FUTEX_WAKE_BITSET),
        ctypes.c_long(_INT_MAX),
        ctypes.c_void_p(None),
        ctypes.c_void_p(None),
        ctypes.c_ulong(bitset),
    )
    return max(0, r)


def address_of(buf: Any) -> int:
    """The address of a writable buffer's first byte (the buffer stays exported only during the call)."""
    c = ctypes.c_char.from_buffer(buf)
    try:
        return ctypes.addressof(c)
    finally:
        del c
