"""Sleeping to an absolute deadline, precisely: how a waiter waits for its turn.

A waiter knows when its ticket is due (``Bucket.due_ns``), so it can sleep
exactly that long instead of sleeping short and spinning the rest.  Two
things make such a sleep end late: the thread's *timer slack* (50 us by
default on Linux: the kernel may delay a wake-up that much to batch it with
others), and the time between computing a relative sleep and starting it.
``sleep_until`` lowers the slack of the calling thread for the duration of
the sleep only (restored after, so the caller's other sleeps are untouched)
and sleeps to an absolute ``CLOCK_MONOTONIC`` deadline.

With the native extension this is one C call without the GIL
(``clock_nanosleep(TIMER_ABSTIME)``); on the ``atomics`` backend the slack is
set through libc with ctypes around ``time.sleep``.
"""
from __future__ import annotations

import sys
import time
from typing import Any, Callable, Optional

from .cells import native_available, selected_backend

#: The timer slack a waiter's sleep runs with (ns): wake-ups end within about this of the deadline
#: plus the kernel's own latency.
SLACK_NS = 1_000
_PR_SET_TIMERSLACK = 29
_PR_GET_TIMERSLACK = 30

_prctl: Optional[Any] = None


def _load_prctl() -> Optional[Any]:
    global _prctl
    if _prctl is None and sys.platform.startswith("linux"):
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            fn = libc.prctl
            fn.restype = ctypes.c_int
            fn.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
            _prctl = fn
        except (OSError, AttributeError):  # pragma: no cover - no libc prctl
            _prctl = False
    return _prctl or None


def _sleep_until_py(deadline_ns: int, slack_ns: int = SLACK_NS) -> None:
    prctl = _load_prctl()
    old = prctl(_PR_GET_TIMERSLACK, 0, 0, 0, 0) if prctl else -1
    if old > 0 and old != slack_ns:
        prctl(_PR_SET_TIMERSLACK, slack_ns, 0, 0, 0)  # type: ignore[misc]
    try:
        left = deadline_ns - time.monotonic_ns()
        if left > 0:
            time.sleep(left / 1e9)
    finally:
        if old > 0 and old != slack_ns:
            prctl(_PR_SET_TIMERSLACK, old, 0, 0, 0)  # type: ignore[misc]


def sleeper() -> Callable[..., None]:
    """``sleep_until(deadline_ns)`` for this process: native with the native backend, else Python."""
    if selected_backend() == "native" and native_available():
        from ._native import sleep_until as native

        def sleep_until(deadline_ns: int, slack_ns: int = SLACK_NS) -> None:
            native(max(0, deadline_ns), slack_ns)

        return sleep_until
    return _sleep_until_py
