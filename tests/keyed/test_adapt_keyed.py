"""Each key of a KeyedLimiter adapts on its own: the decisions on a fake clock, per key.

``keyed.adapt.report`` is what ``feedback(throttled, key)`` runs, on an injected clock: the
report that finds its key's window over decides it (a CAS on the window's start), then counts
itself.  Grants are taken at fake instants through the table's Python composite.  Run on both
backends (``SHMLIMIT_BACKEND``).
"""

import subprocess
import sys
import threading

import pytest
from support.cells import Before, WritesSeen
from support.clock import FakeClock

import shmlimit
from shmlimit.keyed import adapt as KA
from shmlimit.keyed import layout as K
from shmlimit.shm import banks

S = 10**9
ADAPT = shmlimit.Adapt(min_rate=10, max_rate=1000, increase=10)


def _lim(name, **kw):
    kw.setdefault("keys", 1000)
    return shmlimit.KeyedLimiter(name, rate=100, adapt=kw.pop("adapt", ADAPT), **kw)


class Keys:
    """Reports and grants for one keyed limiter at the instants of one fake clock."""

    def __init__(self, lim):
        self.lim = lim
        self.att = lim._use()
        self.clock = FakeClock()
        self.adapt = KA.read(self.att.cells)

    def report(self, key, throttled=False, times=1):
        d = self.att.kt.digest(key)
        return [KA.report(self.att, self.adapt, d, throttled, self.clock) for _ in range(times)]

    def take(self, key):
        """One op on ``key`` now, if its schedule has room (never waits)."""
        r = self.att.reference().acquire(key, 1, 0, self.clock.now << K.TICK_SHIFT)
        return r == 0

    def advance(self, seconds):
        self.clock.advance(int(seconds * S))

    def rate(self, key):
        over = self.lim.override(key)
        return None if over is None else over[0]


# ---- the option ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(rate=100, adapt={"min_rate": 1}), TypeError, "adapt must be a shmlimit.Adapt"),
        (dict(adapt=ADAPT), ValueError, "adapt needs rate="),
        (dict(rate=100, burst=5, adapt=ADAPT), ValueError, "burst cannot be combined with adapt"),
        (dict(rate=5000, adapt=ADAPT), ValueError, "rate must be within adapt's bounds"),
        (dict(rate=100, overrides=0, adapt=ADAPT), ValueError, "adapt needs overrides= > 0"),
    ],
)
def test_bad_adapt_is_refused_and_creates_nothing(name, kwargs, error, match):
    with pytest.raises(error, match=match):
        shmlimit.KeyedLimiter(name, keys=1000, **kwargs)
    with pytest.raises(FileNotFoundError):
        shmlimit.inspect(name)


def test_a_table_without_adapt_takes_no_feedback(name, cleanup):
    lim = shmlimit.KeyedLimiter(name, rate=100, keys=1000)
    cleanup.append(lim)
    assert not lim.adaptive and lim.stats().adapt is None
    with pytest.raises(
        ValueError, match="feedback\\(\\) needs a keyed limiter created with adapt="
    ):
        lim.feedback(True, "a.example")
    with pytest.raises(TypeError, match="throttled must be True or False"):
        _lim(name + "-x").feedback(1, "a.example")
    shmlimit.unlink(name + "-x")


def test_the_same_call_again_and_a_different_one(name, cleanup):
    lim = _lim(name)
    cleanup.append(lim)
    again = _lim(name)
    cleanup.append(again)
    with pytest.raises(shmlimit.ConfigMismatchError, match="no adaptive rate"):
        shmlimit.KeyedLimiter(name, rate=100, keys=1000)
    with pytest.raises(shmlimit.ConfigMismatchError, match="max_rate=500"):
        _lim(name, adapt=shmlimit.Adapt(min_rate=10, max_rate=500))


# ---- each key decides on its own ----------------------------------------------------------------


def test_each_key_is_cut_once_per_window_on_its_own(name, cleanup):
    lim = _lim(name)
    cleanup.append(lim)
    k = Keys(lim)
    assert k.report("slow.example", throttled=True) == [True]  # a key's first outcome: its entry
    k.report("fast.example")
    assert (k.rate("slow.example"), k.rate("fast.example")) == (100.0, 100.0)
    k.advance(0.1)
    k.report("slow.example", throttled=True, times=50)  # mid-window: nothing decided
    assert k.rate("slow.example") == 100.0
    k.advance(0.15)
    k.report("slow.example", times=20)  # the first report after the window decides it, once
    k.report("fast.example")
    assert (k.rate("slow.example"), k.rate("fast.example")) == (80.0, 100.0)
    assert k.rate("never.example") is None  # a key never reported has no entry
    st = lim.stats().adapt
    assert (st.throttled, st.ok, st.cuts, st.raises) == (51, 22, 1, 0)
    k.advance(0.25)
    k.report("slow.example")  # the window after: only ok outcomes, nobody queued: hold
    assert k.rate("slow.example") == 80.0


@pytest.mark.parametrize("change, after", [("set_rate", 500.0), ("remove", None)])
def test_a_decision_never_undoes_a_change_made_after_it_was_judged(
    name, cleanup, monkeypatch, change, after
):
    """A key's throttled window is judged at 100 (a cut to 80); another process gives the key
    a rate of 500, or removes its override, after the judge and before the cut is published.
    The cut was decided from an override no longer in force: the change stands."""
    lim = _lim(name)
    cleanup.append(lim)
    k = Keys(lim)
    k.report("slow.example", throttled=True, times=3)
    k.advance(0.25)
    overrides = k.att.overrides
    judge = overrides.get

    def judged_then_changed(d):
        got = judge(d)
        monkeypatch.setattr(overrides, "get", judge)
        if change == "set_rate":
            lim.set_rate(500, key="slow.example")
        else:
            lim.remove_override("slow.example")
        return got

    monkeypatch.setattr(overrides, "get", judged_then_changed)
    k.report("slow.example")
    assert k.rate("slow.example") == after


def test_a_keys_first_outcome_never_undoes_a_rate_given_it_meanwhile(name, cleanup, monkeypatch):
    """A key's first outcome finds it without an entry and gives it one at the default rate; if
    another process gave the key a rate in between (``set_rate(key=)``, or a decision of its
    own), that rate stands: the entry is given only to a key that still has no override."""
    lim = _lim(name)
    cleanup.append(lim)
    k = Keys(lim)
    overrides = k.att.overrides
    look = overrides.entry

    def none_then_set(d):
        got = look(d)
        monkeypatch.setattr(overrides, "entry", look)
        lim.set_rate(500, key="new.example")  # another process, right after this look
        return got

    monkeypatch.setattr(overrides, "entry", none_then_set)
    assert k.report("new.example") == [True]
    assert k.rate("new.example") == 500.0


def test_a_reporter_taken_over_while_it_publishes_still_counts_its_outcome(
    name, cleanup, monkeypatch
):
    """A key's reporter that decided a cut stalls holding the config lock past its timeout, and
    another process's ``set_rate(key=)`` takes the lock over and publishes: the cut is abandoned
    (that change stands) and the report counts its outcome, where it raised
    ``ConfigWriterTakenOver`` and counted nothing."""
    lim = _lim(name)
    cleanup.append(lim)
    k = Keys(lim)
    k.report("slow.example", throttled=True, times=3)
    k.advance(0.25)
    write = banks.ConfigLock.write_banks
    stalled = []

    def stall_then_write(lock, *args):
        if not stalled:  # the reporter, holding the lock: another process takes it over
            stalled.append(True)
            other = threading.Thread(
                target=lim.set_rate, args=(500,), kwargs={"key": "slow.example"}
            )
            other.start()
            other.join(timeout=30)
        return write(lock, *args)

    monkeypatch.setattr(banks.ConfigLock, "write_banks", stall_then_write)
    assert k.report("slow.example") == [True]
    assert stalled and k.rate("slow.example") == 500.0
    st = lim.stats().adapt
    assert (st.throttled, st.ok, st.cuts) == (3, 1, 0)  # (the cut made nothing: not counted)


def test_a_live_reconfigure_writes_the_parameters_under_the_config_lock(name, cleanup, monkeypatch):
    """KeyedLimiter(name, adapt=..., reconfigure=True) with processes using it: every word of the
    keys' adaptive parameters is written while the keyed config lock is held, so a reader never
    takes half of them."""
    lim = _lim(name)
    cleanup.append(lim)
    att = lim._use()
    seen = WritesSeen(att.cells, K.ADAPT_PARAMS, K.CFG_SEQ)
    monkeypatch.setattr(att, "cells", seen)
    other = shmlimit.Adapt(min_rate=50, max_rate=500)
    _lim(name, adapt=other, reconfigure=True).close()
    monkeypatch.undo()
    assert seen.locked and all(seen.locked)
    assert KA.read(att.cells) == other


def test_a_busy_clean_key_rises_and_an_idle_one_never_does(name, cleanup):
    lim = _lim(name)
    cleanup.append(lim)
    k = Keys(lim)
    k.report("busy.example")
    k.report("idle.example")
    for _ in range(20):  # 20 windows
        for _ in range(250):  # an op tried every ms: at 100/s the key's schedule is all taken
            k.advance(0.001)
            k.take("busy.example")
        k.report("busy.example")
        k.report("idle.example")  # answers, but nobody queues for it
    assert k.rate("busy.example") == 100.0 + 20 * 10
    assert k.rate("idle.example") == 100.0
    k.advance(3600)  # an hour without a report: nothing is decided, nothing rises
    assert k.rate("busy.example") == 300.0
    k.report("busy.example")  # the window that ends now held ~no grants: hold
    assert k.rate("busy.example") == 300.0


def test_a_key_stays_within_the_bounds(name, cleanup):
    lim = _lim(name)
    cleanup.append(lim)
    k = Keys(lim)
    for _ in range(30):
        k.report("a.example", throttled=True)
        k.advance(0.25)
    assert k.rate("a.example") == 10.0
    lim.set_rate(1000, key="a.example")
    with pytest.raises(ValueError, match="from 10 to 1000"):
        lim.set_rate(1001, key="a.example")
    with pytest.raises(ValueError, match="from 10 to 1000"):
        lim.set_rate(5)
    with pytest.raises(ValueError, match="burst cannot be set"):
        lim.set_rate(50, burst=20, key="a.example")
    with pytest.raises(ValueError, match="per cannot change"):
        lim.set_rate("50/min", key="a.example")
    assert k.rate("a.example") == 1000.0 and lim.rate == 100.0


def test_outcomes_of_every_process_count_one_cut_per_window(name, cleanup):
    """Another process reports for the key at the same instants; the window is decided once,
    from every process's outcomes."""
    lim = _lim(name)
    cleanup.append(lim)
    k = Keys(lim)
    k.report("a.example")
    code = (
        "import sys, shmlimit\n"
        "from shmlimit.keyed import adapt as KA\n"
        "lim = shmlimit.KeyedLimiter(sys.argv[1])\n"
        "att = lim._use()\n"
        "d = att.kt.digest('a.example')\n"
        "for _ in range(int(sys.argv[3])):\n"
        "    KA.report(att, KA.read(att.cells), d, True, lambda: int(sys.argv[2]))\n"
    )

    def other(times):
        subprocess.run([sys.executable, "-c", code, name, str(k.clock.now), str(times)], check=True)

    other(5)  # mid-window, in the other process
    k.advance(0.25)
    other(3)  # the other process's first report after the window decides it ...
    k.report("a.example", throttled=True)  # ... and this one's, at the same instant, does not
    assert k.rate("a.example") == 80.0
    st = lim.stats().adapt
    assert (st.throttled, st.cuts) == (9, 1)


def test_an_entry_another_key_held_starts_afresh(name, cleanup):
    lim = _lim(name)
    cleanup.append(lim)
    k = Keys(lim)
    k.report("a.example", throttled=True, times=3)
    e = k.att.overrides.entry(k.att.kt.digest("a.example"))
    k.att.cells.store(e + K.A_OWNER, 12345)  # as if the entry were another key's before
    k.advance(0.25)
    k.report("a.example")  # a new window begins: the old outcomes are not this key's
    assert k.rate("a.example") == 100.0
    assert lim.stats().adapt.cuts == 0


def test_a_key_whose_override_was_removed_starts_afresh(name, cleanup):
    """``remove_override(K)``: the key starts again from the default, its window too.  The 429s
    reported before the removal are not judged against the fresh start (they cut it to 80 at
    the key's first report after, the entry being the key's own still)."""
    lim = _lim(name)
    cleanup.append(lim)
    k = Keys(lim)
    k.report("a.example", throttled=True, times=4)
    assert lim.remove_override("a.example")
    k.advance(0.25)
    k.report("a.example")  # the first report after the removal: a new window, nothing decided
    assert k.rate("a.example") in (None, 100.0)
    assert lim.stats().adapt.cuts == 0
    k.advance(0.25)
    k.report("a.example")  # its first window since the removal: clean and idle, it holds
    assert k.rate("a.example") in (None, 100.0)
    k.report("a.example", throttled=True)
    k.advance(0.25)
    k.report("a.example")  # and the key goes on adapting
    assert k.rate("a.example") == 80.0 and lim.stats().adapt.cuts == 1


def test_an_operators_rate_for_a_key_starts_its_window_afresh(name, cleanup):
    """``set_rate(key=K)`` mid-window: the grants made at the old rate are not judged at the new
    one.  Half a window's schedule at 100/s, then a cut to 20/s, read as 0.7 s of schedule at 20/s
    in a 0.25 s window: busy, and the key was raised to 30 at once over the operator's cut."""
    lim = _lim(name)
    cleanup.append(lim)
    k = Keys(lim)
    k.report("a.example")  # its window begins
    granted = 0
    for _ in range(125):  # half the window, an op tried every ms: half its schedule at 100/s
        k.advance(0.001)
        granted += k.take("a.example")
    lim.set_rate(20, key="a.example")
    for _ in range(125):
        k.advance(0.001)
        granted += k.take("a.example")
    assert granted >= 12
    k.report("a.example")  # the window since the cut is the key's first: nothing decided
    assert k.rate("a.example") == 20.0 and lim.stats().adapt.raises == 0


@pytest.mark.parametrize(
    "old, new, learned, kept",
    [  # (the table's rate, per and bounds before; after; the key's rate learned; kept after a hold)
        ((48_000, 60, 600, 120_000), (800, 1, 10, 2000), 30_000, 500.0),  # 500/s: not 2000/min
        ((100, 1, 1, 500), (6000, 60, 600, 120_000), 5, 600.0),  # 5/s, at the floor: not 600/s
    ],
)
def test_a_key_decides_at_the_pace_it_learned_after_a_redeploy_changed_per(
    name, cleanup, old, new, learned, kept
):
    """A redeploy (``reconfigure=True``) whose ``per`` differs leaves each key's override in the
    old ``per`` until its next decision, which is judged and published at the new ``per``, the
    bounds': a held window keeps the key's pace.  The old override's number was clamped into
    the new bounds as is and published at the old ``per``: a hold moved a key learned at 500/s
    to 2000/min, or one held at 5/s to 600/s, 120 times what its host allowed."""
    rate, per, lo, hi = old
    lim = shmlimit.KeyedLimiter(
        name, rate=rate, per=per, adapt=shmlimit.Adapt(min_rate=lo, max_rate=hi), keys=1000
    )
    cleanup.append(lim)
    lim.set_rate(learned, key="h")
    rate, per, lo, hi = new
    again = shmlimit.KeyedLimiter(
        name,
        rate=rate,
        per=per,
        adapt=shmlimit.Adapt(min_rate=lo, max_rate=hi),
        keys=1000,
        reconfigure=True,
    )
    cleanup.append(again)
    k = Keys(again)
    k.report("h")
    k.advance(0.25)
    k.report("h")  # an idle window: it holds
    got = again.override("h")
    assert got[0] / got[1] * per == pytest.approx(kept)


def test_a_full_override_table_counts_nothing(name, cleanup):
    lim = _lim(name, keys=64, overrides=1)
    cleanup.append(lim)
    k = Keys(lim)
    assert k.report("a.example") == [True]
    assert k.report("b.example") == [False]  # no entry free near it: keeps the default rate
    assert lim.stats().adapt.ok == 1 and k.rate("b.example") is None


def test_inspect_shows_the_parameters_and_the_counts(name, cleanup):
    lim = _lim(name)
    cleanup.append(lim)
    k = Keys(lim)
    k.report("a.example", throttled=True, times=2)
    st = shmlimit.inspect(name).adapt
    assert (st.min_rate, st.max_rate, st.increase, st.throttled, st.ok) == (10, 1000, 10, 2, 0)


def test_hostile_parameters_are_refused(name, cleanup):
    lim = _lim(name)
    cleanup.append(lim)
    lim._use().cells.store(K.ADAPT_PARAMS[2], 0x7FF8000000000000)  # decrease: NaN
    with pytest.raises(shmlimit.SegmentError, match="adaptive rate's parameters are not valid"):
        shmlimit.inspect(name)
    with pytest.raises(shmlimit.SegmentError):
        lim.feedback(True, "a.example")
    assert lim.override("a.example") is None  # nothing written for the key
    # another process is refused at the door, not by its first stats() or repr()
    code = (
        "import shmlimit, sys\n"
        "try:\n"
        "    shmlimit.attach(sys.argv[1])\n"
        "except shmlimit.SegmentError as e:\n"
        "    print('refused:', e)\n"
    )
    r = subprocess.run([sys.executable, "-c", code, name], capture_output=True, text=True)
    assert r.stdout.startswith("refused:") and "parameters are not valid" in r.stdout, r


class _Parked:
    """A reporter on its own thread, through cells that stop it before the first word operation
    ``stop(op, args)`` picks (``support.cells.Before``), until ``resume``: a process stalled
    there.  One that ends without stopping there fails the test."""

    def __init__(self, keys, key, stop):
        self.go, self.parked, self.ended = threading.Event(), threading.Event(), False
        att = keys.att

        def park():
            self.parked.set()
            assert self.go.wait(60), "the test never let this reporter go on"

        class Att:
            cells = Before(att.cells, stop, park)

            def __getattr__(self, attr):
                return getattr(att, attr)

        def run():
            try:
                KA.report(Att(), keys.adapt, att.kt.digest(key), False, keys.clock)
            finally:
                self.ended = True
                self.parked.set()

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        assert self.parked.wait(60) and not self.ended, "the reporter never reached its stop"

    def resume(self):
        self.go.set()
        self.thread.join(timeout=60)
        assert not self.thread.is_alive()


def test_an_entry_given_to_another_key_is_not_judged_from_its_old_key(name, cleanup):
    """Key a's throttled window is claimed and its claimer stalls; a's entry is removed and given
    to key b; right after b's first report takes the entry, a reporter stalled since a's first
    report (it read the entry's start as 0, none yet) resumes.  b never saw a throttled
    outcome: it keeps its rate, and a's three outcomes cut at most once."""
    lim = _lim(name, keys=64, overrides=2)
    cleanup.append(lim)
    k = Keys(lim)
    home = lambda key: (k.att.kt.digest(key)[1] * 2) >> 64  # noqa: E731  (an entry's home)
    b = next(f"b{i}.example" for i in range(100) if home(f"b{i}.example") == home("a.example"))
    start = lambda op, args: op == "cas" and args[0] % (K.OVR_LINES * K.LINE) == K.A_START  # noqa: E731
    stale = _Parked(k, "a.example", lambda op, args: start(op, args) and args[1] == 0)
    e = lim._use().overrides.entry(k.att.kt.digest("a.example"))
    k.report("a.example", throttled=True, times=3)
    k.advance(0.25)
    claimer = _Parked(k, "a.example", lambda op, args: op == "cas" and args[0] == e + K.A_SEEN_OUT)
    lim.remove_override("a.example")
    taker = _Parked(k, b, lambda op, args: op == "load" and args[0] == e + K.A_START)
    stale.resume()  # after b took the entry, before b went on
    taker.resume()
    claimer.resume()
    k.advance(0.25)
    k.report(b)  # b's first window is decided: clean, idle
    assert k.rate(b) == 100.0
    assert lim.stats().adapt.cuts <= 1
