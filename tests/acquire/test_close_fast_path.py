"""``close`` against the fast paths of another thread: no ticket is taken into a slot being left.

An acquire's fast path (``Limiter.acquire``: ``grab = self._fast.grab; grab()``, and the timed one's
``_fast.within``) is bound to its process slot's ticket records: when it queues, it claims a record,
takes the ticket, and stores the ticket's length there.  ``close`` leaves the slot.  Had a grab
run into the slot after ``close`` began -- a thread switched out between loading the fast path and
calling it, or (the ``atomics`` backend, whose grab is Python) between its record's claim and its
length store -- its ticket would be recorded in a slot nobody owns (or that another process has
taken since): a range no reap takes while that process lives, queued for its whole schedule.

Both tests fail on a close that only waits for the slow path's record writes.
"""

import threading

import pytest

import shmlimit
import shmlimit.shm.composites as composites
from shmlimit.shm import layout as L
from shmlimit.shm.cells import selected_backend

MINUTE = dict(rate=1, per=60, burst=1)  # one op a minute: the next grab after the first queues


def queued_limiter(name):
    """A limiter in use (its fast paths bound to its slot's records) with an empty bucket."""
    lim = shmlimit.Limiter(name, **MINUTE)
    assert (
        lim.try_acquire()
    )  # the first use registers and binds the fast paths; the bucket is empty
    att = lim._att
    assert att.records and att.slot is not None
    return lim, att


def slot_words(att, records):
    return [(att.cells.load(end), att.cells.load(length)) for end, length in records]


@pytest.mark.parametrize("path", ["untimed", "timed"])
def test_a_fast_path_loaded_before_close_and_called_after_its_slot_was_left_takes_nothing(
    name, monkeypatch, path
):
    # A thread loads the fast path (as Limiter.acquire does) and is switched out; another thread
    # closes the limiter; the first then calls what it loaded, while the mapping is still open.
    lim, att = queued_limiter(name)
    records = att.records
    loaded, called, answers = threading.Event(), threading.Event(), []
    try:
        fast = lim._fast.grab if path == "untimed" else lim._fast.within

        def late_caller():
            assert loaded.wait(30)
            try:
                answers.append(fast() if path == "untimed" else fast(3600.0))
            except ValueError as e:  # a refusal for the closed limiter is an answer too
                answers.append(e)
            finally:
                called.set()

        real_unregister = att.table.unregister
        seen = {}

        def unregister(*args):  # close has left the slot: the late call comes now
            real_unregister(*args)
            seen["tail"] = att.cells.load(L.TAIL)
            loaded.set()
            assert called.wait(30)
            seen["after"] = att.cells.load(L.TAIL), slot_words(att, records)

        monkeypatch.setattr(att.table, "unregister", unregister)
        t = threading.Thread(target=late_caller)
        t.start()
        lim.close()
        t.join(30)
        assert not t.is_alive() and answers
        tail, words = seen["after"]
        assert tail == seen["tail"], f"a grab after the slot was left took a ticket: {answers}"
        assert words == [(0, 0)] * len(records), f"the left slot's records were written: {words}"
        assert answers[0] is False or answers[0] is None or isinstance(answers[0], ValueError), (
            answers
        )
    finally:
        loaded.set()
        if not lim.closed:
            lim.close()


@pytest.mark.skipif(
    selected_backend() != "atomics",
    reason="the native grab runs whole under the GIL: no thread switch inside it",
)
def test_close_waits_for_a_fast_grab_between_its_records_claim_and_its_length_store(
    name, monkeypatch
):
    # The atomics backend's grab is Python: a thread switch can come between its record's claim
    # (LEN = BUSY) and its length store.  Were the slot left meanwhile, the length would land in a
    # slot nobody owns; close waits for the grab instead, and then marks its record given.
    lim, att = queued_limiter(name)
    records = att.records
    paused, resume, progress = threading.Event(), threading.Event(), threading.Event()
    answers = []
    try:
        grab = lim._fast.grab
        real_claim = composites.claim_record

        def claim(c, recs, ticket):  # the injected thread switch, in the grabbing thread only
            off = real_claim(c, recs, ticket)
            if threading.current_thread() is grabber:
                paused.set()
                assert resume.wait(30)
            return off

        monkeypatch.setattr(composites, "claim_record", claim)
        real_unregister = att.table.unregister
        at_leave = []

        def unregister(*args):
            at_leave.append(slot_words(att, records))
            progress.set()
            real_unregister(*args)

        monkeypatch.setattr(att.table, "unregister", unregister)
        idle = att.cells._idle
        real_wait_for = idle.wait_for

        def wait_for(predicate, timeout=None):  # close waits for the grab: let it go on
            progress.set()
            return real_wait_for(predicate, timeout)

        monkeypatch.setattr(idle, "wait_for", wait_for, raising=False)

        def grab_and_tell():
            try:
                answers.append(grab())
            except ValueError as e:  # (the mapping closed under the grab)
                answers.append(e)

        grabber = threading.Thread(target=grab_and_tell)
        grabber.start()
        assert paused.wait(30)  # its record claimed (BUSY), its ticket not yet taken
        closer = threading.Thread(target=lim.close)
        closer.start()
        assert progress.wait(30)
        resume.set()
        grabber.join(30)
        closer.join(30)
        assert not grabber.is_alive() and not closer.is_alive()
        ticket = answers[0]
        assert isinstance(ticket, int) and ticket is not True, answers  # queued before close began
        (words,) = at_leave
        assert not any(v & L.TICKET_BUSY for _, v in words), (
            f"the slot was left under a half-written record: {words}"
        )
        # its ticket stays recorded, given back, for the next filler's reap to skip
        assert (ticket, att.bucket.cost | L.TICKET_GIVEN) in words, words
    finally:
        resume.set()
        if not lim.closed:
            lim.close()
