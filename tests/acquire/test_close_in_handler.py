"""``close()`` run by a signal handler that interrupted its own thread inside a record write.

A grab bound to ticket records claims a record (LEN = BUSY), takes its ticket, then stores the
length; a range given back is recorded the same way.  ``close`` waits (at most 1 s) for other
threads between a record's claim and its length store before it leaves the process slot.  A
signal handler's ``close`` on the very thread that was interrupted there cannot wait for it (the
write resumes only once the handler returned).  Before, it left the slot under the write anyway:
the write then raised on the closed mapping with its record left claimed (BUSY) in a slot that is
no one's (the next owner finds a record in use for good), and on the ``atomics`` backend, whose
grab is Python, the close waited for that grab to end: for ever.

Now the close returns at once, the handle closed, and the slot is left when the interrupted write
ends: its record whole, marked given (a queued ticket is skipped by the head, as any a close
leaves behind).  A real signal (``os.kill`` to this process) is sent at that exact point.
"""

import mmap
import os
import signal
import threading
import time
from contextlib import contextmanager

import pytest

import shmlimit
import shmlimit.shm.composites as composites
from shmlimit.shm import layout as L
from shmlimit.shm.cells import selected_backend

MINUTE = dict(rate=1, per=60, burst=1)  # one op a minute: the next grab after the first queues


@contextmanager
def handler(fn, watchdog=10.0):
    """``fn`` as this (main) thread's SIGUSR1 handler, and a SIGALRM after ``watchdog`` seconds that
    fails the test (a close that waits for its own thread would hang for ever)."""

    def hung(signum, frame):
        raise AssertionError("close() in the signal handler never returned")

    old = signal.signal(signal.SIGUSR1, lambda signum, frame: fn())
    old_alarm = signal.signal(signal.SIGALRM, hung)
    signal.setitimer(signal.ITIMER_REAL, watchdog)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old_alarm)
        signal.signal(signal.SIGUSR1, old)


def segment_words(name, offsets):
    """Words of the segment as any process sees them (read from its file: this handle is closed)."""
    with (
        open(f"/dev/shm/shmlimit.{name}", "rb") as f,
        mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as m,
    ):
        return [int.from_bytes(m[o : o + 8], "little") for o in offsets]


class Interrupting:
    """The attachment's cells, except that the CAS that claims one of ``lens`` (0 -> BUSY) is
    followed at once by a real signal to this process: its handler runs before the next store."""

    def __init__(self, cells, lens):
        self._c, self._lens, self.sent = cells, set(lens), 0

    def __getattr__(self, attr):
        return getattr(self._c, attr)

    def cas(self, off, expected, desired):
        done = self._c.cas(off, expected, desired)
        if (
            done
            and off in self._lens
            and expected == 0
            and desired == L.TICKET_BUSY
            and not self.sent
        ):
            self.sent += 1
            os.kill(os.getpid(), signal.SIGUSR1)
        return done


def queued_limiter(name):
    lim = shmlimit.Limiter(name, **MINUTE)
    assert lim.try_acquire()  # registered, its records bound; the bucket empty
    att = lim._att
    assert att.records and att.slot is not None
    return lim, att


# how long close takes inside the handler, in real time (< 0.5 s)
@pytest.mark.slow
def test_a_signal_handlers_close_inside_its_threads_record_write_leaves_the_slot_when_it_ends(name):
    lim, att = queued_limiter(name)
    records, slot = att.records, att.slot
    pid_off = L.slot_offset(slot) + L.SLOT_PID
    tokens = att.bucket.cost
    ticket, rec = att.bucket.take_within(tokens, float("inf"))  # a queued ticket, taken unrecorded
    assert isinstance(ticket, int) and rec is None
    inside = []

    def close():
        t0 = time.monotonic()
        lim.close()
        lens = [att.cells.load(off) for _, off in records]
        inside.append((time.monotonic() - t0, att.cells.load(pid_off), lens))

    att.cells = Interrupting(att.cells, [off for _, off in records])
    try:
        with handler(close):
            rec = att.record_ticket(ticket, tokens)  # as a waiter whose grab found no record free
        assert att.cells.sent == 1 and len(inside) == 1, inside
        took, pid_then, lens_then = inside[0]
        assert lim.closed
        assert took < 0.5, (
            f"close in the handler took {took:.3f} s"
        )  # it waited for nothing (1 s before)
        assert pid_then == os.getpid(), "the slot was left under the record being written"
        assert L.TICKET_BUSY in lens_then  # the interrupted write had not ended yet
        assert att.closed and rec is not None  # the write ended whole; the close happened then
        words = segment_words(name, [w for pair in records for w in pair] + [pid_off])
        pid_after, pairs = words[-1], list(zip(words[:-1:2], words[1:-1:2]))
        assert pid_after == 0, "the slot was not left after the interrupted write ended"
        assert not any(v & L.TICKET_BUSY for _, v in pairs), f"a record left claimed: {pairs}"
        assert (ticket, tokens | L.TICKET_GIVEN) in pairs, (
            pairs
        )  # recorded, given: the head skips it
    finally:
        if not lim.closed:
            lim.close()
        if not att.closed:
            att.detach()


# how long close takes inside the handler, in real time (< 0.5 s)
@pytest.mark.slow
@pytest.mark.skipif(
    selected_backend() != "atomics",
    reason="the native grab runs whole under the GIL: no signal handler runs inside it",
)
def test_a_signal_handlers_close_inside_its_threads_fast_grab_neither_hangs_nor_leaves_it_half_written(
    name, monkeypatch
):
    lim, att = queued_limiter(name)
    records, slot = att.records, att.slot
    pid_off = L.slot_offset(slot) + L.SLOT_PID
    grab = lim._fast.grab
    real_claim = composites.claim_record
    inside = []

    def claim(
        c, recs, ticket
    ):  # the record claimed (LEN = BUSY), its ticket not yet taken: a signal
        off = real_claim(c, recs, ticket)
        if threading.current_thread() is threading.main_thread() and not inside:
            os.kill(os.getpid(), signal.SIGUSR1)
        return off

    def close():
        t0 = time.monotonic()
        lim.close()
        inside.append((time.monotonic() - t0, att.cells.load(pid_off)))

    monkeypatch.setattr(composites, "claim_record", claim)
    try:
        with handler(close):
            ticket = grab()
        assert len(inside) == 1, inside
        took, pid_then = inside[0]
        assert took < 0.5, f"close in the handler took {took:.3f} s"
        assert pid_then == os.getpid(), "the slot was left under the grab"
        assert isinstance(ticket, int) and ticket is not True, (
            ticket
        )  # queued: its record written whole
        assert att.closed
        words = segment_words(name, [w for pair in records for w in pair] + [pid_off])
        pid_after, pairs = words[-1], list(zip(words[:-1:2], words[1:-1:2]))
        assert pid_after == 0
        assert not any(v & L.TICKET_BUSY for _, v in pairs), pairs
        assert (ticket, att.bucket.cost | L.TICKET_GIVEN) in pairs, pairs
    finally:
        if not lim.closed:
            lim.close()
        if not att.closed:
            att.detach()


@pytest.mark.parametrize("thread", ["running", "ended"])
def test_a_first_use_cut_short_by_a_signal_leaves_the_limiter_usable(name, monkeypatch, thread):
    """A signal whose handler raises can cut a first use short in ``Thread.start``, after its
    thread began (``running``) or once it ended (``ended``, a start that failed after its thread
    was made).  The limiter stays usable: the next use starts no thread twice (before, every
    later call, and every new handle of the name, raised "threads can only be started once")."""
    from shmlimit.bucket.filler import FillerThread

    start = FillerThread.start
    cut = []

    def start_then_signal(self):
        start(self)
        if not cut:
            cut.append(self)
            if thread == "ended":
                self.stop()
                self.join(5)
                assert not self.is_alive()
            raise KeyboardInterrupt

    monkeypatch.setattr(FillerThread, "start", start_then_signal)
    lim = shmlimit.Limiter(name, rate=1000, burst=10)
    try:
        with pytest.raises(KeyboardInterrupt):
            lim.try_acquire()
        assert lim.try_acquire() and lim.acquire(timeout=1)
        assert shmlimit.Limiter(name).try_acquire()
        filler = lim._att.filler
        assert filler.is_alive() and (filler is cut[0]) == (thread == "running")
    finally:
        lim.close()
