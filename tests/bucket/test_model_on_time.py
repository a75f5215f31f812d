"""A stateful model of a healthy host: nothing is late, so no queued request may lose time.

tests/bucket/test_model.py searches for over-grants and deadlocks under every kind of late, stalled or
dead actor; its "no request waits longer than its schedule plus the queue ahead" is loose on
purpose there.  This model asks the opposite question, sharply: when every replenish comes on
time, is every queued request served exactly on schedule?  It reuses that model's simulated
processes (``LimiterModel``: real ``Limiter`` handles on their own attachments over one shared
mapping, both cell backends, an injected clock, production ``Request`` steps); in half the
examples every replenish is the native waiter's (``replenish(now_ns, again_ns)``: the native
backend's refill at given clock readings, its refresh included), in the others
``Bucket.replenish``.  It runs:

* ``acquire(n)`` of any ``n`` from one op to two ops above the capacity (a waiter that queues
  holds a recorded ticket), ``try_acquire``, and ``set_rate`` between them (rates whose op is a
  whole number of ns, capacities of one op to the default, whole ops and not);
* the clock moving only in small steps, each at most a ``fraction`` (under one) of an op's time
  and of half the capacity's time at the config in force, with a replenish at every step's end
  (the filler's), and every queued waiter replenishing at its turn: the first whole ns at or
  after its ticket's due instant (``Bucket.due_ns``), as a waiter at whose ticket the head stops
  does on the real clock (``sleep.at_stop``; one elsewhere wakes up to a ns later, which changes
  nothing where the head does not stop).  The clock moves on a ns at every reading, as a real
  one does, so that a replenish that claims again at once (the refresh) has time to claim.

Checked after every replenish:

* no time is counted starved (``STARVED_NS``) but a refresh's own: a replenish whose add reached
  a stop (the end of a request of the capacity or more: the clamp's limit) claims again at once,
  and the ns between its two clock readings are clamped by the words its first claim read, which
  hold the head at that stop.  That interval is lost, and counted: one ns here (the clock's tick
  between two readings), the few ns between them on a real clock.  Nothing else may be lost: the
  only other time a replenish drops is owed to nobody (a full bucket's idle time, and the
  interval after a full bucket is drained), and is not counted.
* every queued request is covered by the first replenish whose clock reading is at or after
  ``d + r``, so no later than ``d + r`` plus one step: ``d`` is its ticket's due instant read
  after the first replenish that follows its take (that one may drop the interval after a full
  bucket is drained, owed to nobody), ``r`` the ns the refreshes lost since (above).  Why it
  holds (docs/design.md, "The clamp counts from the request's start" and "The refresh"): a
  replenish adds its whole interval unless its limit ``min(max(base + CAP, end), next)``, from
  the words the last claim left, is below the head plus its tokens.  Those words name the
  request the snapshot's head stood in, its capacity counted from its start; a step is under an
  op and under half the capacity, so an add that starts inside that request and ends past its
  limit must cross the request's end first, or stop there when the request alone fills the
  capacity; the request's waiter replenishes exactly at that end (every rover boundary is a
  whole ns of schedule here, the ops and capacities being whole ns); and an add that reaches the
  limit, or passes the end of the request the words name, claims again at once, leaving words
  that name the request the head then stands in.  So past ``d`` the head holds every token of
  the schedule up to ``REPL_TS`` less ``r``, and a ticket whose instant has come is covered.
  Before the fix that made an add that passes the end of the request the words name claim again,
  the words still named the granted request after its waiter's replenish, and the next step's
  add stopped the head inside the next, longer request at ``base + CAP``: that step's time past
  the stop was lost and counted starved, and the request covered late.
"""

import random

import hypothesis.strategies as st
import pytest
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from support.models import model_settings
from test_model import LimiterModel

from shmlimit.acquire.sleep import SLACK_NS
from shmlimit.bucket.rovers import WAIT_BURN, Bucket
from shmlimit.shm import layout as L
from shmlimit.shm.cells import native_available, open_cells
from shmlimit.shm.words import diff

# run once in CI: names each backend it checks (its simulated processes mix both)
pytestmark = pytest.mark.backend_independent

#: Rates whose op is a whole number of ns (so every rover boundary is a whole ns of schedule, and
#: a waiter's replenish at its turn lands exactly on it), within a factor of 10 of each other:
#: a set_rate keeps a queued request within ten ops' steps at the new price.
RATES = st.sampled_from([100.0, 200.0, 250.0, 500.0, 1000.0])
#: From one op to the default capacity (10 ms: one op at 100/s, two and a half at 250/s, ten at
#: 1000/s), whole ops and not; each a whole number of ns (binary fractions of an op: the capacity
#: in tokens is exact).  A capacity an eighth of an op above a whole number of ops leaves the words
#: of a request of those ops a short way to go into the next one.
BURSTS = st.sampled_from([None, 1.0, 1.125, 1.5, 2.0, 2.125, 3.125, 5.0])
#: The most a step may be of the shorter of an op's time and half the capacity's time; each step
#: is a share drawn at random below it (the seed is the rule's), so that the filler's steps fall
#: anywhere between the waiters' turns.
FRACTIONS = st.sampled_from([0.97, 0.75, 0.5, 0.25])
SEEDS = st.integers(0, 2**32 - 1)
#: Whose replenish every process runs: ``Bucket.replenish`` (over its own cells, of either backend),
#: or the native waiter's (``Attachment.refill`` on the native backend), word for word the same.
REFILLS = ["python", "native"] if native_available() else ["python"]


class OnTimeModel(RuleBasedStateMachine):
    """One limiter, three simulated processes, one clock moved in small steps with a replenish at each."""

    def __init__(self) -> None:
        super().__init__()
        self.m = None
        #: ticket -> (its due instant (ns), read after the first replenish following its take; ``lost`` then)
        self.due = {}
        #: ns the refreshes at stops lost (and counted starved): each one's own interval, a tick
        self.lost = 0
        self.steps = 0
        self.longest_step = 0
        self.native = {}  # (attachment, config seq) -> its native waiter, or None (the atomics backend)

    @initialize(rate=RATES, burst=BURSTS, refills=st.sampled_from(REFILLS))
    def create(self, rate, burst, refills):
        self.refills = refills
        self.m = LimiterModel()
        self.m.create(rate=rate, burst=burst, capped=False, ratio=1.0)
        self.m.clock.tick_ns = (
            1  # a real clock moves between two readings: the refresh finds time to claim
        )

    def teardown(self):
        if self.m is not None:
            self.m.teardown()

    # -- the clock, in steps ----------------------------------------------------------

    def _bucket(self):
        return self.m.procs[0]._att.bucket

    def _step_ns(self, fraction):
        """The most a step may be: ``fraction`` of an op's time and of half the capacity's time."""
        b = self._bucket()
        b.refresh()
        op_ns, half_cap_ns = b.snap.cost / b.tpn, b.snap.cap / b.tpn / 2
        return max(1, int(min(op_ns, half_cap_ns) * fraction))

    def _replenish_at(self, att, at, who):
        """``att``'s process replenishes with its first clock reading at ``at`` (later if the clock
        is already there); then the checks."""
        clock = self.m.clock
        clock.now = max(clock.now, at - clock.tick_ns)
        reading = clock.now + clock.tick_ns
        c = self.m.cells
        starved = c.load(L.STARVED_NS)
        self._replenish(att, reading)
        # a second claim (the refresh) converts the ns since the first one's reading under the words
        # the first one read: at a stop they hold the head where the first add left it, and those
        # ns are lost, counted starved.  Nothing else may be.
        refresh_ns = max(0, c.load(L.REPL_TS) - reading)
        lost = c.load(L.STARVED_NS) - starved
        assert lost <= refresh_ns, (
            f"{lost} ns counted starved by a {who}'s replenish at {reading - self.m.created_ns} ns "
            f"(its refresh claimed {refresh_ns} ns)"
        )
        self.lost += lost
        self._check(reading, who)

    def _replenish(self, att, reading):
        """As the process does: on the native backend one call of its native waiter (the waiters'
        and the filler's refill, ``Attachment.refill``), at ``reading`` and its second claim, if
        any, a tick later; else ``Bucket.replenish`` (the clock read at each claim)."""
        b = att.bucket
        b.refresh()
        key = (
            id(att),
            b.snap.seq,
        )  # a native waiter is bound to one config: a new one after a set_rate
        if self.refills == "native" and key not in self.native:
            if att.cells.backend != "native":
                b = Bucket(open_cells(self.m.mm, len(self.m.mm), "native"), self.m.clock)
            self.native[key] = b.waiter(b.snap, att.grants_off, att.waiting_off, SLACK_NS)
        waiter = self.native.get(key)
        if waiter is None:
            att.bucket.replenish()
            return
        clock = self.m.clock
        _, burn = waiter.replenish(reading, reading + clock.tick_ns)
        clock.now = max(clock.now, self.m.cells.load(L.REPL_TS))  # its readings, as the clock's
        if burn:
            att.after_native_wait(WAIT_BURN)

    def _check(self, reading, who):
        m = self.m
        c = m.cells
        head = c.load(L.HEAD)
        for ticket, tokens, req in m.pending:
            due, lost = self.due.get(ticket, (None, 0))
            if due is not None and due + self.lost - lost <= reading:
                assert diff(head, ticket) >= 0, (
                    f"a request of {tokens} tokens due at {due - m.created_ns} ns (and {self.lost - lost} ns "
                    f"lost by refreshes) is still {diff(ticket, head)} tokens short after a {who}'s replenish "
                    f"at {reading - m.created_ns} ns"
                )
        m._observe()
        for ticket, _, _ in m.pending:
            self.due.setdefault(ticket, (self._turn(ticket), self.lost))

    def _turn(self, ticket):
        """The ticket's due instant, ``Bucket.due_ns`` in whole ns (exact: REPL_TS is far beyond a
        float's whole ns): when the head holds every token of the schedule to ``REPL_TS``, when the
        schedule reaches the ticket."""
        c = self.m.cells
        head, ts = c.load(L.HEAD), c.load(L.REPL_TS)
        return ts + max(0, -(-diff(ticket, head) // self.m.tpn))

    def _waiters(self):
        """(turn, attachment) of each queued live waiter: the first whole ns at or after its due instant."""
        return [(self._turn(t), req.att) for t, _, req in self.m.pending if req is not None]

    def _advance(self, fraction, filler, rng):
        """One step of the clock, of a share drawn by ``rng`` below ``fraction``: every waiter whose
        turn comes within it replenishes at its turn, then the filler at the step's end."""
        clock = self.m.clock
        step = max(1, int(self._step_ns(fraction) * rng.uniform(0.02, 1.0)))
        self.longest_step = max(self.longest_step, step)
        end = clock.now + step
        while True:
            turns = [(turn, att) for turn, att in self._waiters() if clock.now < turn <= end]
            if not turns:
                break
            turn, att = min(turns, key=lambda w: w[0])
            self._replenish_at(att, turn, "waiter")
        self._replenish_at(self.m._proc(filler)._att, end, "filler")
        self.steps += 1

    # -- rules ------------------------------------------------------------------------

    @rule(i=st.integers(0, 2), data=st.data())
    def acquire(self, i, data):
        m = self.m
        lim = m._proc(i)
        b = lim._att.bucket
        b.refresh()
        n = data.draw(st.integers(1, max(1, b.cap // b.cost) + 2), label="n")
        m._taking(lambda: m._acquire(lim, n), n, lim)

    @rule(i=st.integers(0, 2), n=st.integers(1, 3))
    def try_acquire(self, i, n):
        m = self.m
        lim = m._proc(i)
        result, tail, _ = m._call(lim.try_acquire, n)
        m._note_taken(tail, n, now=True, lim=lim)

    @rule(i=st.integers(0, 2), rate=RATES, burst=BURSTS)
    def set_rate(self, i, rate, burst):
        self.m.set_rate(i=i, rate=rate, burst=burst, ratio=None)

    @rule(k=st.integers(1, 30), fraction=FRACTIONS, filler=st.integers(0, 2), seed=SEEDS)
    def advance(self, k, fraction, filler, seed):
        rng = random.Random(seed)
        for _ in range(k):
            self._advance(fraction, filler, rng)

    @rule(fraction=FRACTIONS, filler=st.integers(0, 2), seed=SEEDS)
    def serve_all(self, fraction, filler, seed):
        """Step on until every queued request is served: by the last one's due instant (and the ns
        refreshes lose on the way) and a step."""
        m = self.m
        if not m.pending:
            return
        rng = random.Random(seed)
        last, lost = max(self._turn(t) for t, _, _ in m.pending), self.lost
        for _ in range(100_000):
            if (
                not m.pending
                or m.clock.now
                > last + self.lost - lost + self.longest_step + self._step_ns(fraction)
            ):
                break
            self._advance(fraction, filler, rng)
        assert not m.pending, (
            f"{len(m.pending)} requests still queued a step after the last one's due instant"
        )

    @invariant()
    def nothing_starved(self):
        if self.m is not None:
            assert self.m.cells.load(L.STARVED_NS) == self.lost, (
                "time counted starved, not by a refresh at a stop"
            )


OnTimeModel.TestCase.settings = model_settings(600)
TestOnTimeModel = OnTimeModel.TestCase
