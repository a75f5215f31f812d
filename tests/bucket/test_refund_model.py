"""Stateful property test: reservations, settles (charges and refunds), acquires, tries and the clock,
over several rates on an injected clock (``tests/test_multirate_model.py``'s machine, with
reservations added).  After every step, on every rate and in every window, grants (a
reservation's at its promise) less refunds stay within ``rate*T + capacity``; and no schedule is
lost to a refund beyond the stated tolerance:

    a refund lands whole, but for what would fill the bucket beyond ``tail + capacity``, and
    before a reservation's promise what would pass its fence: the schedule of everything behind
    it, the slots promised since included, counts from there.  A charge is no grant: it moves
    the fences before its debt past it, so a refund of it lands whole behind a reservation.

Checked at each refund made while no waiter is queued on its rate: the head moves by exactly
the refund, up to ``tail + capacity`` and each fence not yet due.  (Refunds were cut at every
fence in force, a refund over a charge queued behind a reservation lost; then passed them up
to the tail, over other reservations, and a later slot was promised too early: the window
check finds that with ``SHMLIMIT_MODEL_EXAMPLES=300``.)  Runs on the backend the suite runs
(``SHMLIMIT_BACKEND``); an injected clock leaves the native try and wait paths to the Python ones
(they read CLOCK_MONOTONIC in C), the native grab and every native composite still run.
"""

import hypothesis.strategies as st
from hypothesis.stateful import precondition, rule
from support.models import model_settings
from test_multirate_model import MultiRateModel

import shmlimit.shm.layout as L
from shmlimit.bucket.rovers import behind, diff
from shmlimit.shm.cells import MASK64
from shmlimit.shm.words import REC_GIVEN


class ReservingModel(MultiRateModel):
    @precondition(lambda self: len(self.pending) < 3)  # (records left for a reservation's claims)
    @rule(data=st.data(), big=st.booleans())
    def reserve(self, data, big):
        costs = self._costs(data)
        if big:  # beyond a capacity: queued, fenced until its promise
            costs = {k: o * 3 for k, o in costs.items()}
        wait = self.lim.reserve(**costs)
        assert wait is not None and wait >= 0
        at = self.clock.now + round(wait * 1e9)
        for k, o in costs.items():
            if o:
                self.events[k].append((at, o * self.atts[k].bucket.cost))
                self.events[k].sort(key=lambda e: e[0])
        self._step_all()

    @rule(data=st.data(), delta=st.integers(min_value=-12, max_value=8).filter(bool))
    def settle(self, data, delta):
        self._settle(data.draw(st.sampled_from(self.keys)), delta)

    @precondition(lambda self: len(self.pending) < 3)
    @rule(data=st.data(), debt=st.integers(min_value=1, max_value=30), big=st.booleans())
    def charge_reserve_refund(self, data, debt, big):
        """A charge queued ahead of a reservation, refunded before its slot: the slot stays where the
        debt put it, and the refund is kept up to the room of the fences it lands before."""
        k = data.draw(st.sampled_from(self.keys))
        self._settle(k, debt)
        self.reserve(data, big)
        self._settle(k, -debt)

    def _settle(self, k, delta):
        att = self.atts[k]
        b, c = att.bucket, att.cells
        b.replenish()  # (a claim now: a fence whose promise has passed lifted, as the refund would)
        head, tail = b.head(), b.taken()
        waiting = any(  # a ticket record not given back, ahead of the head: a waiter's
            c.load(off) and not c.load(off) & REC_GIVEN and diff(c.load(off - 8), head) > 0
            for off in b._record_lens()
        )
        self.lim.settle(**{k: delta})
        if delta < 0:
            self.events[k].append((self.clock.now, delta * b.cost))
            if not waiting:
                # up to the capacity, and before a reservation's promise up to its fence (which
                # every charge queued behind the reservation moved past its debt)
                top = (tail + b.cap) & MASK64
                ts = c.load(L.REPL_TS)
                for limit, due in b.fences.in_force(ts, max(ts, self.clock.now), b.tpn, head):
                    if due > self.clock.now:
                        top = behind(top, limit)
                room = max(0, diff(top, head))
                gained = diff(b.head(), head)
                assert gained == min(-delta * b.cost, room), (
                    f"rate {k}: a refund of {-delta} ops moved the head {gained / b.cost:g} ops "
                    f"(room {room / b.cost:g}): schedule lost with no waiter to protect"
                )
            self._step_all()


ReservingModel.TestCase.settings = model_settings(25)
TestReservingModel = ReservingModel.TestCase
