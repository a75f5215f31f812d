"""A waiting thread asks the kernel for its shortest slice, so that it preempts a busy CPU when due.

On a busy CPU a woken waiter runs once the running task's request ends (about 1.4 ms by default),
unless its own slice is shorter (Linux 6.12+: sched_attr.sched_runtime of a fair task).  The native
wait and the precise sleep set the slice of their thread to 0.1 ms, once, and nothing else:
the policy and the nice value stay as they were, a thread of another policy is left alone, and
the threads and processes the waiting thread starts afterwards begin with the default slice.
On the ``atomics`` backend the Python wait's sleep does the same through libc.
"""

import ast
import ctypes
import multiprocessing as mp
import os
import platform
import struct
import sys
import threading
import time

import pytest

import shmlimit

#: (sched_setattr, sched_getattr) by machine
_NR = {"x86_64": (314, 315), "aarch64": (274, 275)}
_ATTR = "IIQiIQQQII"  # struct sched_attr, version 1 (56 bytes)
SCHED_OTHER, SCHED_BATCH = 0, 3
WAIT_SLICE_NS = 100_000
LONG_SLICE_NS = 3_000_000

pytestmark = [
    pytest.mark.skipif(
        not sys.platform.startswith("linux") or platform.machine() not in _NR,
        reason="sched_setattr of Linux on a known machine",
    ),
]


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def get_attr():
    """(policy, nice, slice ns) of the calling thread."""
    buf = ctypes.create_string_buffer(56)
    if _libc().syscall(_NR[platform.machine()][1], 0, buf, 56, 0) != 0:
        raise OSError(ctypes.get_errno(), "sched_getattr")
    size, policy, flags, nice, prio, runtime, *_ = struct.unpack(_ATTR, buf.raw)
    return policy, nice, runtime


def set_attr(policy: int, nice: int, slice_ns: int) -> None:
    buf = ctypes.create_string_buffer(
        struct.pack(_ATTR, 56, policy, 0, nice, 0, slice_ns, 0, 0, 0, 0), 56
    )
    if _libc().syscall(_NR[platform.machine()][0], 0, buf, 0) != 0:
        raise OSError(ctypes.get_errno(), "sched_setattr")


def _in_fresh_thread(mode: str, name: str, conn) -> None:
    """In a thread of its own (the wait's once-per-thread state is fresh there): the thread's
    scheduling as the test sets it, then after it waited, sent back as (before, after)."""
    out = {}

    def run():
        try:
            policy, nice = (
                (SCHED_BATCH, 0) if mode == "batch" else (SCHED_OTHER, 5 if mode == "nice" else 0)
            )
            try:
                set_attr(policy, nice, LONG_SLICE_NS)
            except OSError as e:  # a seccomp filter, say: the wait's own call is refused alike
                out["refused"] = repr(e)
                return
            out["before"] = get_attr()
            if (
                mode == "sleep"
            ):  # the precise sleep of this backend (native, or Python's on atomics)
                from shmlimit.acquire.sleep import sleeper

                sleeper()(time.monotonic_ns() + 2_000_000)
            else:
                lim = shmlimit.attach(name)
                try:
                    for _ in range(25):  # the capacity (10) first, then natively waited turns
                        lim.acquire()
                finally:
                    lim.close()
            out["after"] = get_attr()
            if mode == "wait":  # what the waiting thread starts afterwards begins with the default
                seen = {}
                t = threading.Thread(target=lambda: seen.setdefault("thread", get_attr()))
                t.start()
                t.join()
                out["thread"] = seen["thread"]
                r, w = os.pipe()
                pid = os.fork()
                if (
                    pid == 0
                ):  # the child's thread: the default, then its own first sleep shortens it
                    try:
                        first = get_attr()
                        from shmlimit.acquire.sleep import sleeper

                        sleeper()(time.monotonic_ns() + 1_000_000)
                        os.write(w, repr((first, get_attr())).encode())
                    finally:
                        os._exit(0)
                os.close(w)
                with os.fdopen(r) as f:
                    out["child"] = ast.literal_eval(f.read())
                os.waitpid(pid, 0)
        except Exception as e:  # sent to the test, which fails with it
            out["error"] = repr(e)

    t = threading.Thread(target=run)
    t.start()
    t.join()
    conn.send(out)


def run_mode(mode: str, name: str) -> dict:
    ctx = mp.get_context("fork")
    ours, theirs = ctx.Pipe()
    p = ctx.Process(target=_in_fresh_thread, args=(mode, name, theirs))
    p.start()
    try:
        assert ours.poll(60), "the child did not answer"
        return ours.recv()
    finally:
        p.join(10)
        if p.is_alive():
            p.kill()
            p.join()


def kernel_tells_slices() -> bool:
    try:
        return get_attr()[2] > 0
    except OSError:
        return False


@pytest.fixture
def limiter(name):
    lim = shmlimit.Limiter(name, rate=1000)  # capacity 10: the 11th acquire waits for its turn
    lim.close()
    return name


@pytest.mark.parametrize("mode", ["wait", "nice", "sleep"])
def test_a_waiting_thread_gets_the_shortest_slice_and_keeps_its_policy_and_nice(mode, limiter):
    if not kernel_tells_slices():
        pytest.skip("this kernel tells no slice of a fair task (before Linux 6.12)")
    out = run_mode(mode, limiter)
    if "refused" in out:
        pytest.skip(f"sched_setattr refused here: {out['refused']}")
    assert "error" not in out, out
    policy, nice, slice_ns = out["before"]
    assert slice_ns == LONG_SLICE_NS, out
    assert out["after"] == (policy, nice, WAIT_SLICE_NS), out
    assert out["after"][1] == (5 if mode == "nice" else 0)
    if mode == "wait":  # set reset-on-fork: a thread or process it starts is not shortened with it
        assert out["thread"][:2] == (SCHED_OTHER, 0) and out["thread"][2] > WAIT_SLICE_NS, out
        first, later = out["child"]
        assert first[:2] == (SCHED_OTHER, 0) and first[2] > WAIT_SLICE_NS, out
        assert later == (SCHED_OTHER, 0, WAIT_SLICE_NS), out  # its own first sleep asks again


def test_a_thread_of_another_policy_is_left_alone(limiter):
    if not kernel_tells_slices():
        pytest.skip("this kernel tells no slice of a fair task (before Linux 6.12)")
    out = run_mode("batch", limiter)
    if "refused" in out:
        pytest.skip(f"sched_setattr refused here: {out['refused']}")
    assert "error" not in out, out
    assert out["before"] == (SCHED_BATCH, 0, LONG_SLICE_NS), out
    assert out["after"] == out["before"], out
