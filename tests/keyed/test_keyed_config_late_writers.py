"""Two keyed config writers late at once: each stalled past the lock's timeout, taken over, resumed.

tests/keyed/test_keyed_config_writer.py stalls one writer; here a first writer stops before one of its
writes, a second takes its lock over and stops before one of its own, a third takes the lock over
and publishes the newest rate, then the two late ones resume, in either order, each running to its
end before the other goes on.  Every pair of stopping points and both orders are tried.  After the
newest publication and after each resumption the config in force must be the newest one, whole:
read the same by the Python readers and by the keyed composite (native or atomics), never refused
as corrupt, and ``CFG_SEQ`` even and never moved back.
"""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.cells import Writer, every_two_late, release

import shmlimit
from shmlimit.keyed import cells as KC
from shmlimit.keyed import layout as K
from shmlimit.keyed.gcra import Overrides, make_rate, publish_default, read_default

FIRST = make_rate(1000, 1.0, 50)  # what the first late writer came to write
SECOND = make_rate(500, 1.0, 20)  # what the second late writer came to write
NEWER = (10, 1.0, 2)  # the newest set_rate, published while both are stopped
NEWER_SEEN = (True, True, False, False, False)


def _bursts_seen(lim, key):
    """Which request sizes the keyed composite grants ``key`` at once (a peek: nothing taken)."""
    return tuple(lim._att.kt.acquire(key, n, -1) != KC.NEVER for n in (1, 2, 3, 50, 51))


def _two_late(lim, write_first, write_second, newer, check, prepare):
    """``support.cells.every_two_late`` on the limiter's cells, ``prepare()`` setting the config up
    again; ``check(where)`` after each step, with ``CFG_SEQ`` even and moved on."""
    c = lim._att.cells
    seq0 = None

    def prepared():
        nonlocal seq0
        prepare()
        seq0 = c.load(K.CFG_SEQ)
        return c

    def checked(where):
        check(where)
        seq = c.load(K.CFG_SEQ)
        assert seq % 2 == 0 and 0 < (seq - seq0) % 2**64 < 2**63, (where, seq0, seq)

    cases = every_two_late(write_first, write_second, prepared, newer, checked)
    assert cases > 100, cases  # the stopping points were reached


def test_two_late_default_writers_leave_the_newest_rate_whole(name, monkeypatch):
    monkeypatch.setattr(KC, "LOCK_NS", 0)  # taken over at the second look
    lim = shmlimit.KeyedLimiter(name, rate=1000, keys=64)
    keys = iter(range(10**6))
    try:

        def check(where):
            assert read_default(lim._att.cells) == make_rate(*NEWER), where
            assert _bursts_seen(lim, f"new-{next(keys)}") == NEWER_SEEN, where

        _two_late(
            lim,
            lambda cells: publish_default(cells, FIRST),
            lambda cells: publish_default(cells, SECOND),
            lambda: lim.set_rate(*NEWER),
            check,
            lambda: lim.set_rate(5, 1.0, 5),
        )
    finally:
        lim.close()


@pytest.mark.parametrize("existing", [True, False], ids=["override-changed", "override-added"])
def test_two_late_override_writers_leave_the_newest_rate_whole(name, monkeypatch, existing):
    monkeypatch.setattr(KC, "LOCK_NS", 0)
    lim = shmlimit.KeyedLimiter(name, rate=1000, burst=50, keys=64, overrides=64)
    try:
        novr = lim._att.geo.overrides
        keys = iter(range(10**6))
        current = [None]

        def prepare():
            k = current[0] = f"k{next(keys)}"
            if existing:
                lim.set_rate(5, key=k)

        def writer(rate):
            return lambda cells: Overrides(cells, novr, lim._att.geo.probe).set(
                lim._att.kt.digest(current[0]), rate
            )

        def check(where):
            k = current[0]
            assert lim.override(k) == NEWER, where
            assert _bursts_seen(lim, k) == NEWER_SEEN, where

        def newer():
            lim.set_rate(*NEWER, key=current[0])

        def prepare_and_free():
            if current[0] is not None:
                lim.remove_override(current[0])  # its entry is reused: the table never fills
            prepare()

        _two_late(lim, writer(FIRST), writer(SECOND), newer, check, prepare_and_free)
    finally:
        lim.close()


# -- any number of late writers, on any of three configs -------------------------------------------

RATES = [
    make_rate(1000, 1.0, 50),
    make_rate(500, 1.0, 20),
    make_rate(200, 1.0, 8),
    make_rate(100, 1.0, 4),
]
SIZES = (1, 2, 3, 4, 5, 8, 9, 20, 21, 50, 51)
TARGETS = (None, "a", "b")  # the default, a key with an override, a key without one at first


def _sizes_granted(lim, key):
    return tuple(lim._att.kt.acquire(key, n, -1) != KC.NEVER for n in SIZES)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    late=st.lists(
        st.tuples(st.sampled_from(TARGETS), st.integers(0, len(RATES) - 1), st.integers(1, 24)),
        min_size=2,
        max_size=4,
    ),
    newest=st.sampled_from(TARGETS),
    order=st.randoms(use_true_random=False),
)
def test_any_number_of_late_writers_leave_every_config_whole(
    name, monkeypatch, late, newest, order
):
    """Writers one after another, each stopped before one of its writes (or run to its end when it
    has fewer) and taken over by the next; then the newest set_rate; then the stopped ones resume
    in a random order.  After each step every config reads as one rate that was written to it,
    the same for the composite, never refused as corrupt; the newest set_rate's config reads as
    that rate."""
    monkeypatch.setattr(KC, "LOCK_NS", 0)
    lim = shmlimit.KeyedLimiter(
        f"{name}-{order.getrandbits(32)}", rate=5, burst=5, keys=64, overrides=16
    )
    writers = []
    try:
        c, novr = lim._att.cells, lim._att.geo.overrides
        lim.set_rate(3, 1.0, 3, key="a")
        written = {None: {make_rate(5, 1.0, 5)}, "a": {make_rate(3, 1.0, 3)}, "b": {None}}
        fresh = iter(range(10**6))

        def writer(target, rate):
            if target is None:
                return lambda cells: publish_default(cells, rate)
            return lambda cells: Overrides(cells, novr, lim._att.geo.probe).set(
                lim._att.kt.digest(target), rate
            )

        for target, r, at in late:
            written[target].add(RATES[r])
            writers.append(Writer(writer(target, RATES[r]), c, at))
        lim.set_rate(10, 1.0, 2, key=newest)
        written[newest] = {make_rate(10, 1.0, 2)}

        def check(where):
            default = read_default(c)
            assert default in written[None], where
            for key in ("a", "b"):
                own = lim._att.overrides.get(lim._att.kt.digest(key))
                assert own in written[key], (where, key, own)
                rate = own or default
                assert _sizes_granted(lim, key) == tuple(n <= rate.burst for n in SIZES), (
                    where,
                    key,
                    rate,
                )
            assert _sizes_granted(lim, f"fresh-{next(fresh)}") == tuple(
                n <= default.burst for n in SIZES
            ), where
            assert c.load(K.CFG_SEQ) % 2 == 0, where

        check("published")
        stopped = [w for w in writers if w.late]
        order.shuffle(stopped)
        for k, w in enumerate(stopped):
            w.resume()
            check(f"resumed {k + 1} of {len(stopped)}")
    finally:
        release(*writers)
        lim.unlink()
        lim.close()
