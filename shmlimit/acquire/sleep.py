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

On an event loop (``sleep_until_async``) a timed ``asyncio.sleep`` ends late by
up to a millisecond: the selector's timeout is whole milliseconds, rounded up.
So a waiter awaits a ``timerfd`` instead (Linux, through libc): armed at the
absolute ``CLOCK_MONOTONIC`` deadline, it becomes readable at that instant,
which wakes the loop's selector whatever its own timeout; a kernel timer of a
timerfd has no slack.  One timerfd per loop, watched once, armed at the
earliest deadline of the coroutines waiting on it.  Elsewhere, or on a loop
without ``add_reader``, it is ``asyncio.sleep``.
"""

from __future__ import annotations

import asyncio
import functools
import heapq
import os
import platform
import struct
import sys
import threading
import time
import weakref
from typing import Any, Callable, List, Optional

from shmlimit.shm.cells import native_available, selected_backend

#: The timer slack a waiter's sleep runs with (ns): wake-ups end within about this of the deadline
#: plus the kernel's own latency.
SLACK_NS = 1_000
#: A waiter at whose ticket the head stops wakes this long before its turn and stays awake for the
#: rest (ns): a sleep ends tens of microseconds late, and at a stop that lateness is lost to every
#: request behind (``Bucket.stops_at``; the native waiter's WAIT_STOP_LEAD_NS).
STOP_LEAD_NS = 100_000
_PR_SET_TIMERSLACK = 29
_PR_GET_TIMERSLACK = 30

_prctl: Optional[Any] = None


def _load_prctl() -> Optional[Any]:
    global _prctl
    if _prctl is None and sys.platform.startswith("linux"):
        try:
            import ctypes

            # PyDLL: the call keeps the GIL.  A CDLL call releases it, and taking it back
            # from a busy thread (the filler) waits up to the switch interval (5 ms).
            libc = ctypes.PyDLL(None, use_errno=True)
            fn = libc.prctl
            fn.restype = ctypes.c_int
            fn.argtypes = [
                ctypes.c_int,
                ctypes.c_ulong,
                ctypes.c_ulong,
                ctypes.c_ulong,
                ctypes.c_ulong,
            ]
            _prctl = fn
        except (OSError, AttributeError):  # pragma: no cover - no libc prctl
            _prctl = False
    return _prctl or None


#: The slice a waiting thread asks the kernel for (ns): the shortest it takes.  On a busy CPU a woken
#: thread runs once the running task's request ends (about 1.4 ms by default) unless its own slice
#: is shorter (Linux 6.12+); a slice changes no share of the CPU.  Set once per thread and kept, with
#: the reset-on-fork flag (threads and processes it starts begin with the default), as the native
#: wait does (``WAIT_SLICE_NS`` in ``_native.c``, which says why).
SLICE_NS = 100_000
#: (sched_setattr, sched_getattr) by machine (Linux)
_SYS_SCHED_ATTR = {
    "x86_64": (314, 315),
    "amd64": (314, 315),
    "aarch64": (274, 275),
    "arm64": (274, 275),
    "riscv64": (274, 275),
}
_SCHED_ATTR = "IIQiIQQQII"  # struct sched_attr, its first version (56 bytes)
_SCHED_OTHER = 0
_SCHED_RESET_ON_FORK = 1
_sliced = threading.local()


def _short_slice() -> None:
    """This thread's slice down to ``SLICE_NS``, once per thread, reset on fork: only a thread of the
    normal policy at a nice value of 0 or more whose kernel tells a longer slice; its policy and
    nice value are written back as read, so no privilege is needed.  A refusal changes nothing and
    is not tried again."""
    if getattr(_sliced, "tried", False):
        return
    _sliced.tried = True
    nrs = (
        _SYS_SCHED_ATTR.get(platform.machine().lower())
        if sys.platform.startswith("linux")
        else None
    )
    if nrs is None:
        return
    try:
        import ctypes

        call = ctypes.PyDLL(None, use_errno=True).syscall  # keeps the GIL: two short system calls
        call.restype = ctypes.c_long
        L = ctypes.c_long
        buf = ctypes.create_string_buffer(56)
        if call(L(nrs[1]), L(0), buf, L(56), L(0)) != 0:
            return
        _, policy, flags, nice, prio, runtime, *_ = struct.unpack(_SCHED_ATTR, buf.raw)
        if policy != _SCHED_OTHER or nice < 0 or runtime <= SLICE_NS:
            return
        attr = struct.pack(
            _SCHED_ATTR, 56, policy, _SCHED_RESET_ON_FORK, nice, prio, SLICE_NS, 0, 0, 0, 0
        )
        call(L(nrs[0]), L(0), ctypes.create_string_buffer(attr, 56), L(0))
    except (OSError, AttributeError):  # pragma: no cover - no libc syscall
        return


#: Bumped in a forked child: a loop's timer made before the fork is the parent's (``_loop_timer``),
#: told apart without a ``getpid`` system call per wait.
_fork_gen = 0


def _forked() -> None:
    global _fork_gen, _woken, _timers_lock
    _sliced.tried = False  # the kernel reset the slice of the child's thread (reset-on-fork)
    _fork_gen += 1
    _woken, _timers_lock = threading.Condition(), threading.RLock()  # maybe held by another thread


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forked)


def _sleep_until_py(deadline_ns: int, slack_ns: int = SLACK_NS, seen: Optional[int] = None) -> None:
    _short_slice()
    prctl = _load_prctl()
    old = prctl(_PR_GET_TIMERSLACK, 0, 0, 0, 0) if prctl else -1
    if old > 0 and old != slack_ns:
        prctl(_PR_SET_TIMERSLACK, slack_ns, 0, 0, 0)  # type: ignore[misc]
    try:
        left = deadline_ns - time.monotonic_ns()
        if left > 0 and seen is None:
            time.sleep(left / 1e9)
        elif left > 0:  # ... or until woken (``wake_waiters``) since ``seen`` was read
            with _woken:
                while _wakes == seen and left > 0:
                    _woken.wait(left / 1e9)
                    left = deadline_ns - time.monotonic_ns()
    finally:
        if old > 0 and old != slack_ns:
            prctl(_PR_SET_TIMERSLACK, old, 0, 0, 0)  # type: ignore[misc]


def at_stop(due: float, now: int) -> "tuple[float, int]":
    """``(wake, now)`` for a waiter at whose ticket the head stops, due at ``due`` (real clock, ns):
    its turn less ``STOP_LEAD_NS`` to sleep to; or, that near, its turn itself, reached awake (the
    replenish then covers the ticket at its instant, not a wake's lateness after it)."""
    if due - now > STOP_LEAD_NS:
        return due - STOP_LEAD_NS, now
    while time.monotonic_ns() < due:
        pass
    return due, time.monotonic_ns()


@functools.lru_cache(maxsize=None)
def _native_sleep() -> Any:
    """The native module when this process sleeps natively (the native backend, built), else None:
    chosen once, so that ``wakes`` and the sleeper count the same wakes."""
    if selected_backend() == "native" and native_available():
        from shmlimit.shm import _native

        return _native
    return None


def sleeper() -> Callable[..., None]:
    """``sleep_until(deadline_ns, seen=None)`` for this process: native with the native backend,
    else Python; given ``seen`` (``wakes()`` read before the step that chose the deadline), it also
    ends at a ``wake_waiters`` since."""
    native = _native_sleep()
    if native is not None:
        sleep = native.sleep_until

        def sleep_until(deadline_ns: int, seen: Optional[int] = None) -> None:
            sleep(max(0, deadline_ns), SLACK_NS, -1 if seen is None else seen)

        return sleep_until
    return lambda deadline_ns, seen=None: _sleep_until_py(deadline_ns, SLACK_NS, seen)


# ---- waking this process's waiters: the head skipped a range given back -------------------------

#: Bumped by every ``wake_waiters``: a Python sleeper that read it before the step that chose its
#: deadline sleeps only while it is unchanged (a wake between that step and the sleep is not missed).
#: A native sleeper counts the native module's (``_native.wakes``) the same way.
_wakes = 0
_woken = threading.Condition()  # (reentrant: a signal handler on a sleeping thread may give back)


def wakes() -> int:
    """The count of ``wake_waiters`` so far, to read before a step whose sleep a wake should end."""
    native = _native_sleep()
    return _wakes if native is None else native.wakes()


def wake_waiters(cells: Any) -> None:
    """Every waiter of this process looks again now: the head skipped a range given back
    (``giveback.Returns``), so those behind it are due sooner than the turn they sleep to.

    The native waits on ``cells`` (``Cells.wake_waiters``), the Python sleepers (``wakes``), and
    every coroutine awaiting a loop's timer (each loop's ``_LoopTimer.wake_all``, run on that loop).
    A waiter ahead of the range looks, finds its turn unchanged, and sleeps again: the cost is one
    step per waiter per skip, and none when nothing is given back."""
    global _wakes
    cells.wake_waiters()
    native = _native_sleep()
    if native is not None:
        native.wake_sleepers()
    else:
        with _woken:
            _wakes += 1
            _woken.notify_all()
    with _timers_lock:
        timers = [
            (loop, t)
            for loop, t in _timers.items()
            if t is not None and t.gen == _fork_gen and loop.is_running()
        ]  # (a loop not running has no coroutine waiting: a callback would only pile up)
    for loop, timer in timers:
        try:
            loop.call_soon_threadsafe(timer.wake_all)
        except RuntimeError:  # a closed loop: nobody waits on it
            pass


# ---- on an event loop: a timerfd per waiting coroutine ------------------------------------------

_TFD_TIMER_ABSTIME = 1
_TFD_NONBLOCK = os.O_NONBLOCK
_TFD_CLOEXEC = os.O_CLOEXEC
_CLOCK_MONOTONIC = 1

_timerfd: Optional[Any] = None


def _load_timerfd() -> Optional[Any]:
    """``(create, arm)``: the extension's, else libc's through ctypes; None where there is none."""
    global _timerfd
    if _timerfd is None:
        _timerfd = False
        if selected_backend() == "native" and native_available():
            from shmlimit.shm import _native

            if hasattr(_native, "timerfd_arm"):
                _timerfd = (lambda clock, flags: _native.timerfd(), _native.timerfd_arm)
        if not _timerfd and sys.platform.startswith("linux"):
            try:
                import ctypes

                libc = ctypes.PyDLL(None, use_errno=True)  # keeping the GIL, as _load_prctl's
                create = libc.timerfd_create
                create.restype = ctypes.c_int
                create.argtypes = [ctypes.c_int, ctypes.c_int]
                settime = libc.timerfd_settime
                settime.restype = ctypes.c_int
                settime.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
                spec = (ctypes.c_long * 4)()  # struct itimerspec: interval (0), then the value

                def arm(fd: int, deadline_ns: int) -> None:
                    spec[2], spec[3] = divmod(deadline_ns, 1_000_000_000)  # 0, 0 disarms
                    if settime(fd, _TFD_TIMER_ABSTIME, ctypes.addressof(spec), None) != 0:
                        raise OSError(ctypes.get_errno(), "timerfd_settime")

                _timerfd = (create, arm)
            except (OSError, AttributeError):  # pragma: no cover - a libc without timerfd
                pass
    return _timerfd or None


class _LoopTimer:
    """One event loop's timerfd, watched by that loop once: it wakes every coroutine whose
    deadline has come, then is armed at the earliest deadline left (ours alone call it)."""

    def __init__(
        self, loop: asyncio.AbstractEventLoop, fd: int, arm: Callable[[int, int], None]
    ) -> None:
        self.fd = fd
        self.arm = arm
        self.armed = 0  # the deadline the timerfd is armed at (0: not armed)
        self.heap: List[Any] = []  # (deadline_ns, seq, future)
        self.seq = 0
        self.pid = os.getpid()
        self.gen = _fork_gen
        loop.add_reader(fd, self.fired)
        weakref.finalize(loop, _close_fd, fd, self.pid)

    def wait(self, loop: asyncio.AbstractEventLoop, deadline_ns: int) -> "asyncio.Future[None]":
        fut = loop.create_future()
        self.seq += 1
        heapq.heappush(self.heap, (deadline_ns, self.seq, fut))
        if not self.armed or deadline_ns < self.armed:
            self.arm(self.fd, deadline_ns)
            self.armed = deadline_ns
        return fut

    def wake_all(self) -> None:
        """Every coroutine waiting on this timer resumes now (``wake_waiters``), the timer disarmed."""
        heap, self.heap = self.heap, []
        for _, _, fut in heap:
            if not fut.done():
                fut.set_result(None)
        if self.armed:
            self.armed = 0
            self.arm(self.fd, 0)

    def fired(self) -> None:
        # One system call per wake: the timer is one-shot, so once it fired it is disarmed, and
        # either re-arming it (which zeroes its count of expirations: no longer readable) or
        # reading that count leaves the descriptor unreadable again for the selector.
        now = time.monotonic_ns()
        heap = self.heap
        while heap and (heap[0][0] <= now or heap[0][2].done()):
            fut = heapq.heappop(heap)[2]
            if not fut.done():
                fut.set_result(None)
        if heap:
            self.armed = heap[0][0]
            self.arm(self.fd, self.armed)
            return
        self.armed = 0
        try:
            os.read(self.fd, 8)
        except BlockingIOError:  # re-armed after it fired, and not due again yet
            pass


def _close_fd(fd: int, pid: int) -> None:
    if os.getpid() == pid:
        try:
            os.close(fd)
        except OSError:  # pragma: no cover
            pass


#: Each event loop's timer, made at its first precise wait (weakly: a closed loop takes it along).
_timers: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Optional[_LoopTimer]]" = (
    weakref.WeakKeyDictionary()
)
_timers_lock = threading.RLock()  # ``wake_waiters`` reads them from any thread (a handler too)


def _loop_timer(loop: asyncio.AbstractEventLoop) -> Optional[_LoopTimer]:
    t = _timers.get(loop, False)
    if t is not False and (t is None or t.gen == _fork_gen):
        return t
    timer = None
    timerfd = _load_timerfd()
    if timerfd is not None:
        create, arm = timerfd
        try:
            fd = create(_CLOCK_MONOTONIC, _TFD_NONBLOCK | _TFD_CLOEXEC)
        except OSError:  # out of descriptors: the coarse sleep, which never ends early either
            fd = -1
        if fd >= 0:
            try:
                timer = _LoopTimer(loop, fd, arm)
            except (NotImplementedError, OSError):  # a loop that cannot watch descriptors
                os.close(fd)
    with _timers_lock:
        _timers[loop] = timer
    return timer


async def sleep_until_async(deadline_ns: int) -> None:
    """Await, on the running loop, until ``CLOCK_MONOTONIC`` (``time.monotonic_ns``) reaches ``deadline_ns``.

    Never returns early but at a ``wake_waiters`` (on the timer); late by the loop's own latency
    rather than its millisecond timeout (see the module's docstring).  Cancellable.
    """
    left = deadline_ns - time.monotonic_ns()
    if left <= 0:
        return
    loop = asyncio.get_running_loop()
    timer = _loop_timer(loop)
    if timer is None:
        await asyncio.sleep(left / 1e9)
        return
    await timer.wait(loop, deadline_ns)
