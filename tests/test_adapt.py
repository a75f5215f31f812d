"""The adaptive rate: the controller's rules on a fake clock, its words in the segment, the
reporter deciding.

``decide`` is pure: each rule is checked on its own.  ``feedback`` decides a window it finds over
from the segment alone (a CAS on the window's start), so any process (here real other processes,
on the same fake instants) decides a window another began, and many reporting at once decide it
once.  Run on both backends (``SHMLIMIT_BACKEND``).
"""

import json
import subprocess
import sys
import textwrap
import threading

import pytest
from support.cells import Before, WritesSeen
from support.clock import FakeClock

import shmlimit
from shmlimit import adapt as A
from shmlimit.bucket.rovers import Bucket, diff
from shmlimit.shm import banks
from shmlimit.shm import layout as L

S = 10**9
ADAPT = shmlimit.Adapt(min_rate=10, max_rate=2000)


def window(throttled=0, ok=0, busy=0.0, seconds=ADAPT.window):
    """A window's counts: ``busy`` is the share of its schedule callers took."""
    return A.Window(throttled, ok, busy * seconds * S)


# ---- the option ---------------------------------------------------------------------------------


def test_defaults():
    a = shmlimit.Adapt(min_rate=10, max_rate=2000)
    assert (a.decrease, a.increase, a.window) == (0.8, 20.0, 0.25)


@pytest.mark.parametrize(
    "kwargs, param",
    [
        (dict(min_rate=0, max_rate=10), "min_rate"),
        (dict(min_rate=-1, max_rate=10), "min_rate"),
        (dict(min_rate=float("nan"), max_rate=10), "min_rate"),
        (dict(min_rate=10, max_rate=5), "max_rate"),
        (dict(min_rate=10, max_rate=float("inf")), "max_rate"),
        (dict(min_rate=1, max_rate=10, decrease=1.0), "decrease"),
        (dict(min_rate=1, max_rate=10, decrease=0), "decrease"),
        (dict(min_rate=1, max_rate=10, increase=0), "increase"),
        (dict(min_rate=1, max_rate=10, increase=float("inf")), "increase"),
        (dict(min_rate=1, max_rate=10, window=0.001), "window"),
        (dict(min_rate=1, max_rate=10, window=4000), "window"),
        # ints beyond every float: named, not an OverflowError from float()
        (dict(min_rate=10**400, max_rate=10), "min_rate"),
        (dict(min_rate=1, max_rate=10**400), "max_rate"),
        (dict(min_rate=1, max_rate=10, decrease=-(10**400)), "decrease"),
        (dict(min_rate=1, max_rate=10, increase=10**400), "increase"),
        (dict(min_rate=1, max_rate=10, window=10**400), "window"),
    ],
)
def test_bad_parameters_name_themselves(kwargs, param):
    with pytest.raises(ValueError, match=param):
        shmlimit.Adapt(**kwargs)


@pytest.mark.parametrize("param", ["min_rate", "max_rate", "decrease", "increase", "window"])
def test_parameters_must_be_numbers(param):
    kwargs = dict(min_rate=1, max_rate=10)
    kwargs[param] = "5"
    with pytest.raises(TypeError, match=param):
        shmlimit.Adapt(**kwargs)


def test_limiter_refuses_what_cannot_adapt(name):
    with pytest.raises(ValueError, match="rate must be within adapt's bounds, from 10 to 2000"):
        shmlimit.Limiter(name, rate=5000, adapt=ADAPT)
    with pytest.raises(ValueError, match="burst cannot be combined with adapt"):
        shmlimit.Limiter(name, rate=100, burst=5, adapt=ADAPT)
    with pytest.raises(TypeError, match="adapt must be a shmlimit.Adapt"):
        shmlimit.Limiter(name, rate=100, adapt={"min_rate": 1})
    with pytest.raises(ValueError, match="burst\\*per/rate must be at most"):  # min_rate's capacity
        shmlimit.Limiter(name, rate=100, adapt=shmlimit.Adapt(min_rate=1e-9, max_rate=200))
    with pytest.raises(ValueError, match="adapt is not supported with upstream="):
        shmlimit.Limiter(name, rate=100, upstream="redis://127.0.0.1:1/0", adapt=ADAPT)
    with pytest.raises(FileNotFoundError):  # nothing was created by the refused calls
        shmlimit.inspect(name)


# ---- the controller, pure -----------------------------------------------------------------------


def test_no_decision_before_the_window_ends():
    s = A.State(1000.0, 5 * S)
    assert A.decide(ADAPT, s, window(throttled=50), 5 * S + int(0.249 * S)) is s


def test_a_throttled_window_cuts_once_however_many_throttled():
    s = A.State(1000.0, 0)
    now = int(0.25 * S)
    one = A.decide(ADAPT, s, window(throttled=1, ok=100, busy=1.0), now)
    many = A.decide(ADAPT, s, window(throttled=10_000, ok=0, busy=1.0), now)
    assert one == many == A.State(800.0, now, A.CUT)


def test_a_clean_busy_window_raises():
    s = A.State(1000.0, 0)
    now = int(0.25 * S)
    assert A.decide(ADAPT, s, window(ok=10, busy=0.95), now) == A.State(1020.0, now, A.RAISE)


@pytest.mark.parametrize(
    "seen",
    [
        window(ok=10, busy=0.5),  # callers never reached the rate: it does not bind them
        window(ok=0, busy=0.0),  # an idle fleet
        window(ok=0, busy=1.0),  # busy, but nothing reported: no evidence the upstream copes
    ],
    ids=["under-used", "idle", "unreported"],
)
def test_no_increase_without_demand_and_outcomes(seen):
    s = A.State(1000.0, 0)
    now = int(0.25 * S)
    assert A.decide(ADAPT, s, seen, now) == A.State(1000.0, now, A.HOLD)


def test_an_idle_fleet_keeps_its_rate_for_ever():
    s = A.State(300.0, 0)
    for k in range(1, 1000):
        s = A.decide(ADAPT, s, window(), k * S)
    assert s.rate == 300.0


def test_the_rate_stays_within_the_bounds():
    a = shmlimit.Adapt(min_rate=100, max_rate=130, increase=20)
    s = A.State(120.0, 0)
    s = A.decide(a, s, window(ok=1, busy=1.0, seconds=1), S)
    assert s.rate == 130.0
    s = A.decide(a, s, window(ok=1, busy=1.0, seconds=1), 2 * S)
    assert s.rate == 130.0
    for k in range(3, 10):
        s = A.decide(a, s, window(throttled=1), k * S)
    assert s.rate == 100.0


def test_busy_is_measured_against_the_window_actually_elapsed():
    """A late decision (no report came at the window's end) judges the whole elapsed time, not
    one window."""
    s = A.State(1000.0, 0)
    late = 2 * S
    assert A.decide(ADAPT, s, window(ok=5, busy=0.95), late).verdict == A.HOLD  # 0.24 s of 2 s
    seen = A.Window(0, 5, 0.95 * late)
    assert A.decide(ADAPT, s, seen, late).verdict == A.RAISE


# ---- the segment --------------------------------------------------------------------------------


def _lim(name, clock, **kw):
    return shmlimit.Limiter(name, rate=1000, adapt=ADAPT, clock=clock, **kw)


def test_outcomes_are_counted_and_shown(name, cleanup):
    clock = FakeClock()
    lim = _lim(name, clock)
    cleanup.append(lim)
    for _ in range(3):
        lim.feedback(throttled=True)
    lim.feedback(throttled=False)
    st = shmlimit.inspect(name).adapt
    assert (st.throttled, st.ok, st.cuts, st.raises) == (3, 1, 0, 0)
    assert (st.min_rate, st.max_rate, st.window) == (10.0, 2000.0, 0.25)
    with pytest.raises(TypeError, match="throttled must be True or False"):
        lim.feedback(throttled=1)


def test_feedback_needs_adapt(name, cleanup):
    lim = shmlimit.Limiter(name, rate=10)
    cleanup.append(lim)
    with pytest.raises(ValueError, match="feedback\\(\\) needs a limiter created with adapt="):
        lim.feedback(throttled=True)
    assert lim.stats().adapt is None


def test_a_window_is_cut_once_and_published_for_every_process(name, cleanup):
    clock = FakeClock()
    lim = _lim(name, clock)
    cleanup.append(lim)
    c = lim._peek().cells
    for _ in range(7):
        lim.feedback(throttled=True)  # the first report begins the first window, then counts
    assert c.load(L.ADAPT_START) == clock.now | 1  # (the low bit: its marks are written)
    clock.advance(int(0.1 * S))
    lim.feedback(throttled=False)  # mid-window: nothing decided
    assert lim.rate == 1000.0
    clock.advance(int(0.15 * S))
    lim.feedback(throttled=False)  # the first report after the window's end decides it ...
    lim.feedback(throttled=True)  # ... and a second at that instant decides nothing more
    assert lim.rate == 800.0 and lim.capacity == 8.0  # the capacity follows the rate
    st = lim.stats().adapt
    assert (st.cuts, st.raises, st.throttled, st.ok) == (1, 0, 8, 2)
    assert c.load(L.ADAPT_START) == clock.now | 1


def test_the_report_that_decides_counts_in_the_next_window(name, cleanup):
    clock = FakeClock()
    lim = _lim(name, clock)
    cleanup.append(lim)
    lim.feedback(throttled=False)
    clock.advance(int(0.25 * S))
    lim.feedback(throttled=True)  # decides a clean window (idle: it holds), then counts
    assert lim.rate == 1000.0
    clock.advance(int(0.25 * S))
    lim.feedback(throttled=False)  # the window it was counted in is cut
    assert lim.rate == 800.0 and lim.stats().adapt.cuts == 1


def test_no_report_no_decision(name, cleanup):
    """A window is decided by a report: while none comes, nothing is decided, however busy the
    callers and however many windows pass; the next report decides once, over the whole time."""
    clock = FakeClock()
    lim = _lim(name, clock, initial=0)
    cleanup.append(lim)
    c = lim._peek().cells
    for _ in range(1000):  # callers take the whole schedule for 1 s, nobody reports: no window
        clock.advance(10**6)
        lim.try_acquire()
    assert c.load(L.ADAPT_START) == 0 and lim.rate == 1000.0
    lim.feedback(throttled=True)  # begins a window
    clock.advance(10 * S)  # ten windows' time, no report
    assert lim.rate == 1000.0 and lim.stats().adapt.cuts == 0
    lim.feedback(throttled=False)  # one cut for the whole silence
    lim.feedback(throttled=False)
    assert lim.rate == 800.0 and lim.stats().adapt.cuts == 1


def test_a_busy_clean_window_raises_and_an_idle_one_does_not(name, cleanup):
    clock = FakeClock()
    lim = _lim(name, clock, initial=0)
    cleanup.append(lim)
    # idle: outcomes reported, nobody took tokens
    lim.feedback(throttled=False)
    clock.advance(int(0.25 * S))
    lim.feedback(throttled=False)  # decides the idle window: it holds
    assert lim.rate == 1000.0
    # busy: an op tried every ms at 1000/s takes the whole schedule
    for _ in range(250):
        clock.advance(10**6)
        lim.try_acquire()
    lim.feedback(throttled=False)
    assert lim.rate == 1020.0
    assert lim.stats().adapt.raises == 1


def test_set_rate_within_the_bounds(name, cleanup):
    clock = FakeClock()
    lim = _lim(name, clock)
    cleanup.append(lim)
    lim.set_rate(50)
    assert lim.rate == 50.0
    with pytest.raises(ValueError, match="from 10 to 2000"):
        lim.set_rate(3000)
    with pytest.raises(ValueError, match="burst cannot be set on an adaptive limiter"):
        lim.set_rate(50, burst=20)
    with pytest.raises(ValueError, match="per cannot change on an adaptive limiter"):
        lim.set_rate("50/min")
    assert lim.rate == 50.0 and lim.per == 1.0


def test_a_new_limiter_starts_from_the_learned_rate(name, cleanup):
    clock = FakeClock()
    lim = _lim(name, clock)
    cleanup.append(lim)
    lim.set_rate(321)
    again = _lim(name, clock)  # the same creating call: no mismatch, the learned rate
    cleanup.append(again)
    assert again.rate == 321.0
    with pytest.raises(shmlimit.ConfigMismatchError, match="no adaptive rate"):
        shmlimit.Limiter(name, rate=1000, clock=clock)
    other = shmlimit.Adapt(min_rate=10, max_rate=500)
    with pytest.raises(shmlimit.ConfigMismatchError, match="max_rate=500"):
        shmlimit.Limiter(name, rate=100, adapt=other, clock=clock)


def test_a_redeploy_keeps_the_learned_rate_within_its_new_bounds(name):
    """No live process: a new configuration is taken (``adopt_config``), the learned rate kept."""
    code = textwrap.dedent(
        f"""
        import shmlimit
        lim = shmlimit.Limiter({name!r}, rate=1000, adapt=shmlimit.Adapt(min_rate=10, max_rate=2000))
        lim.set_rate(700)
        """
    )
    subprocess.run([sys.executable, "-c", code], check=True)
    lim = shmlimit.Limiter(name, rate=100, adapt=shmlimit.Adapt(min_rate=10, max_rate=500))
    try:
        assert lim.rate == 500.0  # 700 learned, within the new bounds
        assert lim.stats().adapt.max_rate == 500.0
    finally:
        lim.close()


def test_a_redeploy_in_another_window_keeps_the_learned_rate_in_ops_per_second(name, cleanup):
    """The learned rate is a pace, not a number: a redeploy (here live, ``reconfigure=True``) whose
    ``per`` differs takes it in its own ``per``, then within its bounds.  500/s learned, asked
    for per second within [10, 2000], stays 500/s (read as 30000 per second it was clamped to
    2000/s, 4 times the pace the upstream was found to allow); and back per minute, 30000/min."""
    per_min = shmlimit.Adapt(min_rate=600, max_rate=120_000)
    lim = shmlimit.Limiter(name, rate=48_000, per=60, adapt=per_min)
    cleanup.append(lim)
    lim.set_rate(30_000)  # learned: 30000/min, 500/s
    per_s = shmlimit.Adapt(min_rate=10, max_rate=2000)
    again = shmlimit.Limiter(name, rate=800, adapt=per_s, reconfigure=True)
    assert (again.rate, again.per) == (500.0, 1.0)
    assert shmlimit.Limiter(name, rate=800, adapt=per_s).rate == 500.0  # the same call: no mismatch
    back = shmlimit.Limiter(name, rate=48_000, per=60, adapt=per_min, reconfigure=True)
    assert (back.rate, back.per) == (30_000.0, 60.0)


X = shmlimit.Adapt(min_rate=50, max_rate=2000)
Y = shmlimit.Adapt(min_rate=1, max_rate=40)


def test_a_live_reconfigure_writes_the_parameters_under_the_config_lock(name, cleanup, monkeypatch):
    """Limiter(name, adapt=..., reconfigure=True) with processes using it: every word of the
    adaptive rate's parameters is written while the config lock is held, so a reader (``read``,
    between two equal even sequence numbers) never takes half of them."""
    lim = shmlimit.Limiter(name, rate=100, adapt=X)
    cleanup.append(lim)
    att = lim._peek()
    seen = WritesSeen(att.cells, L.ADAPT_PARAMS, L.CFG_SEQ)
    monkeypatch.setattr(att, "cells", seen)
    shmlimit.Limiter(name, rate=20, adapt=Y, reconfigure=True).close()
    monkeypatch.undo()
    assert seen.locked and all(seen.locked)
    assert (A.read(att.cells), lim.rate) == (Y, 40.0)


def test_a_reader_never_mixes_two_parameter_sets(name, cleanup):
    """A reader of the parameters has loaded min_rate and max_rate of X when a live reconfigure
    writes Y whole: it reads them again, and takes Y (not X's bounds with Y's increase)."""
    lim = shmlimit.Limiter(name, rate=100, adapt=X)
    cleanup.append(lim)
    cells = lim._peek().cells

    def reconfigure():
        shmlimit.Limiter(name, rate=20, adapt=Y, reconfigure=True).close()

    reader = Before(
        cells, lambda op, args: op == "load" and args[0] == L.ADAPT_PARAMS[2], reconfigure
    )
    assert A.read(reader) == Y


def test_a_decision_is_not_published_over_parameters_changed_since_it_read_them(name, cleanup):
    """A reporter reads the parameters (X: 50 to 2000); a live reconfigure to Y (1 to 40, rate
    40) lands before it judges its window, idle at 40.  Held within X's bounds the rate would
    become 50, outside Y's: the decision is dropped, the rate stays 40."""
    clock = FakeClock()
    lim = shmlimit.Limiter(name, rate=100, adapt=X, clock=clock)
    cleanup.append(lim)
    bucket = lim._peek().bucket
    lim.feedback(throttled=False)  # the first window begins

    class ReconfiguredBeforeTheJudge(_Through):
        def refresh(self):
            if A.read(bucket.cells) != Y:
                shmlimit.Limiter(name, rate=20, adapt=Y, reconfigure=True, clock=clock).close()
            return self._bucket.refresh()

    clock.advance(int(0.25 * S))
    A.feedback(ReconfiguredBeforeTheJudge(bucket, bucket.cells), False, clock)
    assert lim.rate == 40.0


def test_hostile_parameters_are_refused(name, cleanup):
    clock = FakeClock()
    lim = _lim(name, clock)
    cleanup.append(lim)
    c = lim._peek().cells
    c.store(L.ADAPT_DECREASE, L.f2u(float("nan")))
    with pytest.raises(shmlimit.SegmentError, match="adaptive rate's parameters are not valid"):
        shmlimit.inspect(name)
    with pytest.raises(shmlimit.SegmentError):
        lim.feedback(throttled=True)
    assert lim.rate == 1000.0 and c.load(L.ADAPT_THROTTLED) == 0


def _claimed(cells, then):
    """A claimer's cells, stopped right after its claim (before its first mark) for ``then``."""
    return Before(cells, lambda op, args: op == "cas" and args[0] == L.ADAPT_SEEN_THROTTLED, then)


class _Through:
    """A limiter's bucket whose words are read and written through ``cells``."""

    def __init__(self, bucket, cells):
        self._bucket, self.cells = bucket, cells

    def __getattr__(self, attr):
        return getattr(self._bucket, attr)


def test_a_claimer_stalled_for_a_window_judges_nothing_twice(name, cleanup):
    """A reporter claims a throttled window and stalls, for a whole window, before it writes the
    marks the next window is judged from.  Another reporter that finds the next window over must
    not judge it against the old marks (its throttled outcomes counted again: a second cut); the
    stalled one, resuming after the fleet went on, decides nothing (a stale rate published late
    would undo newer decisions) and takes no newer mark back."""
    clock = FakeClock()
    lim = _lim(name, clock)
    cleanup.append(lim)
    bucket = lim._peek().bucket
    for _ in range(3):
        lim.feedback(throttled=True)  # the first window, throttled

    def other_reporter():
        clock.advance(int(0.25 * S))
        lim.feedback(throttled=False)  # finds the next window over while the claimer stalls

    clock.advance(int(0.25 * S))
    A.feedback(_Through(bucket, _claimed(bucket.cells, other_reporter)), False, clock)
    st = lim.stats().adapt
    assert (st.cuts, lim.rate) == (0, 1000.0)  # the two windows the stall spanned: no decision
    for throttled in (False, True, False):  # a clean window holds, a throttled one cuts once
        clock.advance(int(0.25 * S))
        lim.feedback(throttled=throttled)
    st = lim.stats().adapt
    assert (st.cuts, st.raises, st.throttled, st.ok, lim.rate) == (1, 0, 4, 4, 800.0)


def test_a_claimer_resuming_late_does_not_undo_the_fleets_decisions(name, cleanup):
    """A reporter claims a throttled window and stalls while the fleet cuts three windows more;
    when it resumes, its decision (a cut from the rate it read, 1000 to 800) is stale: it must
    not be published over the fleet's 512."""
    clock = FakeClock()
    lim = _lim(name, clock)
    cleanup.append(lim)
    bucket = lim._peek().bucket
    for _ in range(3):
        lim.feedback(throttled=True)

    def the_fleet():
        for _ in range(4):  # the first begins afresh; each after it finds a throttled window
            clock.advance(int(0.25 * S))
            lim.feedback(throttled=True)
        assert lim.rate == 512.0

    clock.advance(int(0.25 * S))
    A.feedback(_Through(bucket, _claimed(bucket.cells, the_fleet)), False, clock)
    assert (lim.rate, lim.stats().adapt.cuts) == (512.0, 3)


def test_a_decision_never_undoes_a_set_rate_published_after_it_was_judged(name, cleanup):
    """A reporter judges a throttled window at 1000 (a cut to 800); another process's
    set_rate(1500) is published after the judge, before the reporter's publish.  The cut was
    decided from a config no longer in force: the set_rate stands."""
    clock = FakeClock()
    lim = _lim(name, clock)
    cleanup.append(lim)
    bucket = lim._peek().bucket
    other = Bucket(bucket.cells, clock)  # another process's view
    for _ in range(3):
        lim.feedback(throttled=True)

    class JudgedThenSetRate(_Through):
        def refresh(self):
            changed = self._bucket.refresh()
            if other.config.rate != 1500:
                other.publish(A.adapted(other.config, 1500))
            return changed

    clock.advance(int(0.25 * S))
    A.feedback(JudgedThenSetRate(bucket, bucket.cells), False, clock)
    assert lim.rate == 1500.0 and lim.capacity == 15.0


def test_a_reporter_taken_over_while_it_publishes_still_counts_its_outcome(
    name, cleanup, monkeypatch
):
    """A reporter that decided a cut stalls holding the config lock past its timeout, and another
    process's ``set_rate`` takes the lock over and publishes: the cut is abandoned (the newer
    change stands), and the reporter's ``feedback`` counts its outcome and returns, as a
    decision lost to a stall costs nothing else.  It raised ``ConfigWriterTakenOver`` ("apply
    it again", a change the caller never asked for), its outcome uncounted: an integration's
    answer was lost to that exception."""
    clock = FakeClock()
    lim = _lim(name, clock)
    cleanup.append(lim)
    for _ in range(3):
        lim.feedback(throttled=True)
    clock.advance(int(0.25 * S))
    write = banks.ConfigLock.write_banks
    stalled = []

    def stall_then_write(lock, *args):
        if not stalled:  # the reporter, holding the lock: another process takes it over
            stalled.append(True)
            other = threading.Thread(target=lim.set_rate, args=(1500,))
            other.start()
            other.join(timeout=30)
        return write(lock, *args)

    monkeypatch.setattr(banks.ConfigLock, "write_banks", stall_then_write)
    lim.feedback(throttled=False)  # decides the throttled window: a cut, taken over
    assert stalled and lim.rate == 1500.0
    st = lim.stats().adapt
    assert (st.throttled, st.ok, st.cuts) == (3, 1, 0)  # (the cut made nothing: not counted)


def test_a_claimer_that_dies_before_its_marks_stops_nothing(name, cleanup):
    """A reporter dies right after claiming a window, its marks unwritten: the next report begins
    a window afresh (the one the dead claimer held is not judged), and the fleet decides again."""
    clock = FakeClock()
    lim = _lim(name, clock)
    cleanup.append(lim)
    bucket = lim._peek().bucket
    lim.feedback(throttled=True)

    class Died(Exception):
        pass

    def die():
        raise Died

    clock.advance(int(0.25 * S))
    with pytest.raises(Died):  # claims the throttled window, then dies
        A.feedback(_Through(bucket, _claimed(bucket.cells, die)), False, clock)
    assert lim.rate == 1000.0
    clock.advance(int(0.25 * S))
    lim.feedback(throttled=True)  # begins a window afresh, then counts in it
    assert lim.rate == 1000.0
    clock.advance(int(0.25 * S))
    lim.feedback(throttled=False)  # decides it
    st = lim.stats().adapt
    assert (st.cuts, st.throttled, lim.rate) == (1, 2, 800.0)


class _Words(dict):
    """A segment's words in a dict: the cells ``report`` needs, with no segment."""

    def load(self, off):
        return self.get(off, 0)

    def store(self, off, value):
        self[off] = value

    def cas(self, off, old, new):
        if self.load(off) != old:
            return False
        self[off] = new
        return True

    def fetch_add(self, off, delta):
        self[off] = self.load(off) + delta
        return self[off] - delta


@pytest.mark.parametrize("later", [1, 2, 3])
def test_no_outcome_is_judged_twice_wherever_a_reporter_stops(later):
    """Every outcome is throttled, and every report judges the outcomes since its window's marks.
    One reporter stops between any two of its word operations while ``later`` others report, a
    window apart; then two more windows are reported on.  The outcomes each decision judged
    (the counter's values from its marks to its reading) never overlap: no outcome is judged
    twice, and the cuts counted are the judgements made."""
    START, DECISIONS, MARK, COUNT = 0, 8, 16, 24
    win = int(ADAPT.window * S)
    words = (START, DECISIONS, (MARK,))
    for at in range(12):  # beyond the last operation: a reporter that does not stop
        cells, judged, clock = _Words(), [], FakeClock()

        def one(via, cells=cells, judged=judged, clock=clock):
            mine = []  # what this report judged, kept if it decided (a cut: a new rate)

            def judge(seen):
                mine.append((cells.load(COUNT) - seen[0], cells.load(COUNT)))
                return 1000.0, A.Window(seen[0], 0, 0.0)

            if A.report(via, ADAPT, clock, words, lambda: [cells.load(COUNT)], judge) is not None:
                judged.extend(mine)
            cells.fetch_add(COUNT, 1)  # then counts its own outcome

        def others(cells=cells, one=one, clock=clock):
            for _ in range(later):
                clock.advance(win)
                one(cells)

        one(cells)  # begins the first window
        clock.advance(win)
        one(Before(cells, Before.nth(at), others))
        for _ in range(2):
            clock.advance(win)
            one(cells)
        spans = sorted(judged)
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), (at, spans)
        assert cells.load(DECISIONS) >> 32 == len(spans), at


REPORTER = """
import sys
import shmlimit
name, now = sys.argv[1], int(sys.argv[2])
lim = shmlimit.Limiter(name, clock=lambda: now)  # attached by name, at one fake instant
sys.stdin.readline()  # every reporter is ready: go
for _ in range(int(sys.argv[3])):
    lim.feedback(throttled=False)
print(lim.rate)
"""


def _reporters(name, now, count, reports):
    """``count`` processes, each reporting ``reports`` outcomes at the instant ``now``, all at once
    (each waits for a line on its stdin); their rates after."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", REPORTER, name, str(now), str(reports)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(count)
    ]
    for p in procs:
        p.stdin.write("go\n")
        p.stdin.flush()
    rates = [float(p.communicate(timeout=60)[0]) for p in procs]
    assert [p.returncode for p in procs] == [0] * count
    return rates


def test_many_processes_reporting_at_a_windows_end_decide_it_once(name, cleanup):
    """This process begins the window and is then silent; four others report 200 outcomes each,
    all at once, at an instant after its end: the window is decided exactly once, from the segment
    alone (its start and the counts then), and every process sees the rate decided."""
    clock = FakeClock()
    lim = _lim(name, clock)
    cleanup.append(lim)
    lim.feedback(throttled=True)  # begins the window ...
    clock.advance(int(0.1 * S))
    lim.feedback(throttled=True)  # ... reports once mid-window, and is silent from now on
    later = clock.now + int(0.2 * S)
    assert _reporters(name, later, 4, 200) == [800.0] * 4
    st = lim.stats().adapt
    assert (st.cuts, st.raises, st.throttled, st.ok) == (1, 0, 2, 800)
    assert lim.rate == 800.0 and lim._peek().cells.load(L.ADAPT_START) == later | 1
    assert _reporters(name, later, 2, 10) == [800.0] * 2  # the new window is not over: no more
    assert lim.stats().adapt.cuts == 1


def test_top_and_metrics_show_the_rate_in_force(name, cleanup):
    from support.procs import run_cli as cli

    clock = FakeClock()
    lim = _lim(name, clock)
    cleanup.append(lim)
    lim.feedback(throttled=True)
    clock.advance(int(0.25 * S))
    lim.feedback(throttled=False)  # cut: 800
    r = cli("top", name, "--once", "--json", "--interval", "0.1")
    [rec] = json.loads(r.stdout)["limiters"]
    assert rec["rate"] == 800.0
    assert (rec["adapt"]["cuts"], rec["adapt"]["throttled"]) == (1, 1)
    r = cli("metrics", name)
    assert f'shmlimit_rate_ops_per_second{{limiter="{name}"}} 800.0' in r.stdout.splitlines()


def test_grants_stay_within_the_rate_in_force_while_it_adapts(name, cleanup):
    """Cuts and raises every 50 ms for 2 s, ops tried faster than any rate, idle now and then (a
    full bucket): in every window, the tokens
    taken (each op at the price in force when it was granted) stay within ``T * tpn + capacity``,
    the bound ``set_rate`` keeps, at the largest capacity the run had."""
    clock = FakeClock()
    fast = shmlimit.Adapt(min_rate=100, max_rate=2000, increase=300, window=0.05)
    lim = shmlimit.Limiter(name, rate=1000, adapt=fast, clock=clock, initial=0)
    cleanup.append(lim)
    att = lim._peek()
    b, c = att.bucket, att.cells
    grants, caps, rates = [], set(), set()
    for k in range(4000):
        clock.advance(500_000)
        for _ in range(3 if k % 300 >= 40 else 0):  # up to 6000/s, idle 20 ms in every 150
            before = c.load(L.TAIL)
            if not lim.try_acquire():
                break
            grants.append((clock.now, diff(c.load(L.TAIL), before)))
        lim.feedback(throttled=(k // 300) % 2 == 1)  # 150 ms throttled, 150 ms not, in turn
        b.refresh()
        caps.add(b.cap)
        rates.add(b.config.rate)
    st = lim.stats().adapt
    assert st.cuts >= 5 and st.raises >= 5 and len(rates) >= 8, (st, sorted(rates))
    # the largest (tokens in [t_i, t_j]) - (t_j - t_i) * tpn over every pair i <= j, in one pass
    worst, best_start, taken = -(1 << 62), -(1 << 62), 0
    for t, tokens in grants:
        best_start = max(best_start, t * b.tpn - taken)
        taken += tokens
        worst = max(worst, taken - t * b.tpn + best_start)
    assert worst <= max(caps), (worst, max(caps))


HAMMER = """
import sys, time
import shmlimit
lim = shmlimit.Limiter(sys.argv[1])  # attached by name, on the real clock
sys.stdin.readline()  # every reporter is ready: go
end, n = time.monotonic_ns() + int(float(sys.argv[2]) * 1e9), 0
while time.monotonic_ns() < end:
    lim.feedback(throttled=True)
    n += 1
print(n)
"""


@pytest.mark.slow
def test_reporters_on_the_real_clock_decide_each_window_once(name, cleanup):
    """Four processes report as fast as they can for 2 s, in windows of 20 ms: each window's end
    is found over by several of them at once.  A window starts where the last one was decided, a
    window or more after its start, so one decision per window makes at most (last start - first
    start) / window of them; a window decided twice would be counted twice."""
    fast = shmlimit.Adapt(min_rate=1, max_rate=2000, window=0.02)
    lim = shmlimit.Limiter(name, rate=1000, adapt=fast)
    cleanup.append(lim)
    c = lim._peek().cells
    lim.feedback(throttled=True)  # begins the first window
    first = c.load(L.ADAPT_START)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", HAMMER, name, "2"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(4)
    ]
    for p in procs:
        p.stdin.write("go\n")
        p.stdin.flush()
    reports = [int(p.communicate(timeout=60)[0]) for p in procs]
    st = lim.stats().adapt
    assert st.throttled == 1 + sum(reports)
    windows = (c.load(L.ADAPT_START) - first) // int(fast.window * S)
    assert 10 <= st.cuts <= windows, (st.cuts, windows, reports)
    assert lim.rate == 1.0  # cut to the floor, and no further


@pytest.mark.parametrize("kind", ["limiter", "keyed"])
def test_a_dead_config_writer_is_waited_out_once_not_at_every_report(name, monkeypatch, kind):
    """A config writer killed holding the lock leaves its sequence word odd until a writer takes
    it over, and a report that changes nothing writes nothing: the reports, and ``stats()``, read
    at once after the first of each read has waited the writer out (each waited 200 ms before,
    in every process, for as long as the word stayed odd).  (A writer that writes again under it
    is waited for again: ``tests/test_config_late_writers.py``.)"""
    from shmlimit.keyed import layout as K
    from shmlimit.shm import banks

    adapt = shmlimit.Adapt(min_rate=1, max_rate=100, window=60)
    if kind == "limiter":
        lim = shmlimit.Limiter(name, rate=50, adapt=adapt)
        report, seq_off = (lambda: lim.feedback(False)), L.CFG_SEQ
    else:
        lim = shmlimit.KeyedLimiter(name, rate=50, adapt=adapt)
        report, seq_off = (lambda: lim.feedback(False, "k")), K.CFG_SEQ
    cells = lim._peek().cells
    banks.ConfigLock(cells, seq_off, banks.CONFIG_LOCK_TIMEOUT_NS).__enter__()  # never left
    waits = []
    sleep = banks.time.sleep
    monkeypatch.setattr(banks.time, "sleep", lambda s: (waits.append(s), sleep(s)))
    report()  # the first of each read waits the dead writer out
    lim.stats()
    first = len(waits)
    assert first > 0
    for _ in range(3):
        report()
        lim.stats()
    assert len(waits) == first
    monkeypatch.undo()
    lim.close()
