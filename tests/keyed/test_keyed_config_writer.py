"""A keyed limiter's config writer stalled past the lock's timeout, taken over, then resumed.

As the plain limiter's (tests/test_promises.py, "a stalled config writer"), the keyed limiter's
default rate and overrides are double-buffered: two checksummed banks per config, stamped with
the generation that wrote them, and publication by one CAS of ``CFG_SEQ`` (keyed_gcra).  A writer
taken over writes at most one bank, with a generation older than the newer writer's, and its
publication fails.  (Written in place, the late stores landed over the newer config, and the
late release moved ``CFG_SEQ`` back.)

Each test stalls one writer before each of its writes in turn (every store, CAS and add after it
took the lock), lets another writer take the lock over and publish there, then lets the stalled
one resume; the config in force must be the newer one, read the same by the Python readers and
by the keyed composite (native or atomics, as ``SHMLIMIT_BACKEND`` selects).
"""

import contextlib
import mmap

import pytest
from support.cells import BeforeWrite

import shmlimit
from shmlimit.errors import ConfigWriterTakenOver
from shmlimit.keyed import cells as KC
from shmlimit.keyed import layout as K
from shmlimit.keyed.gcra import Overrides, make_rate, publish_default, read_default
from shmlimit.shm import layout as L

LATE = make_rate(1000, 1.0, 50)  # what the stalled writer came to write
NEWER = (10, 1.0, 2)  # what the writer that took over publishes meanwhile


#: Cells whose ``at``-th write (the 0th takes the lock) first runs ``meanwhile``: the writer stops
#: there for longer than the lock's timeout.
Stalls = BeforeWrite


def _writes(write, cells):
    """How many writes ``write`` makes when nothing stalls it."""
    counter = Stalls(cells, -1, None)
    write(counter)
    return counter.writes


def _bursts_seen(lim, key):
    """Which request sizes the keyed composite would grant ``key`` at once (a peek: nothing taken).
    The late config grants up to 50, the newer one up to 2; a pair of one's T and the other's TAU
    would grant 0 or up to 200."""
    return tuple(lim._att.kt.acquire(key, n, -1) != KC.NEVER for n in (1, 2, 3, 50, 51))


NEWER_SEEN = (True, True, False, False, False)
LATE_SEEN = (True, True, True, True, False)


def _run_stalled(lim, write, newer, check, prepare=lambda: None):
    """Stall ``write`` before each of its writes in turn, run ``newer`` there, resume it, then ``check``
    (``prepare`` runs before each write, the uncounted first one included)."""
    c = lim._att.cells
    prepare()
    for at in range(1, _writes(write, c) + 1):
        prepare()
        seqs = []

        def meanwhile():
            newer()
            seqs.append(c.load(K.CFG_SEQ))

        stalled = Stalls(c, at, meanwhile)
        with contextlib.suppress(ConfigWriterTakenOver):  # the right answer for a writer taken over
            write(stalled)
        if not stalled.reached:  # its last write was before ``at`` (it stopped early)
            continue
        seq = c.load(K.CFG_SEQ)
        assert seq % 2 == 0 and (seq - seqs[0]) % 2**64 < 2**63, (at, seqs, seq)  # never back
        check(at)


def test_a_stalled_keyed_config_writer_that_resumes_publishes_nothing(name, monkeypatch):
    monkeypatch.setattr(KC, "LOCK_NS", 0)  # taken over at the second look
    lim = shmlimit.KeyedLimiter(name, rate=1000, keys=64)
    try:

        def check(at):
            assert read_default(lim._att.cells) == make_rate(*NEWER), at
            assert _bursts_seen(lim, f"new-{at}") == NEWER_SEEN, at

        _run_stalled(
            lim, lambda cells: publish_default(cells, LATE), lambda: lim.set_rate(*NEWER), check
        )
    finally:
        lim.close()


@pytest.mark.parametrize("existing", [True, False], ids=["override-changed", "override-added"])
def test_a_stalled_override_writer_that_resumes_publishes_nothing(name, monkeypatch, existing):
    monkeypatch.setattr(KC, "LOCK_NS", 0)
    lim = shmlimit.KeyedLimiter(name, rate=1000, burst=50, keys=64, overrides=16)
    try:
        novr = lim._att.geo.overrides
        keys = iter(range(10**6))

        def key():
            k = f"k{next(keys)}"
            if existing:
                lim.set_rate(5, key=k)
            return k

        current = [None]

        def prepare():
            current[0] = key()

        def write(cells):
            Overrides(cells, novr, lim._att.geo.probe).set(lim._att.kt.digest(current[0]), LATE)

        def check(at):
            k = current[0]
            assert lim.override(k) == NEWER, at
            assert _bursts_seen(lim, k) == NEWER_SEEN, at
            assert lim.remove_override(k) and lim.override(k) is None, at  # its entry is reused

        _run_stalled(lim, write, lambda: lim.set_rate(*NEWER, key=current[0]), check, prepare)
    finally:
        lim.close()


def test_a_stalled_override_remover_that_resumes_removes_nothing(name, monkeypatch):
    monkeypatch.setattr(KC, "LOCK_NS", 0)
    lim = shmlimit.KeyedLimiter(name, rate=1000, burst=50, keys=64, overrides=16)
    try:
        novr = lim._att.geo.overrides

        def write(cells):
            Overrides(cells, novr, lim._att.geo.probe).remove(lim._att.kt.digest("k"))

        def check(at):
            assert lim.override("k") == NEWER, at
            assert _bursts_seen(lim, "k") == NEWER_SEEN, at

        _run_stalled(
            lim,
            write,
            lambda: lim.set_rate(*NEWER, key="k"),
            check,
            lambda: lim.set_rate(5, key="k"),
        )
    finally:
        lim.close()


def test_a_reader_that_meets_a_stalled_writer_prices_by_one_config(name, monkeypatch):
    """A writer stopped before any of its writes: a reader closes its lock after the timeout and sees
    the old config or the new one, never a pair of words from both (Python readers and the composite)."""
    # the Python readers and the reference composite close a held lock at their second look
    monkeypatch.setattr(KC, "LOCK_NS", 0)
    lim = shmlimit.KeyedLimiter(name, rate=10, burst=2, keys=64)
    c = lim._att.cells
    try:
        for at in range(1, _writes(lambda cells: publish_default(cells, LATE), c) + 1):
            seen = []

            def meanwhile():
                seen.append((_bursts_seen(lim, f"new-{at}"), read_default(c)))

            stalled = Stalls(c, at, meanwhile)
            with contextlib.suppress(ConfigWriterTakenOver):
                publish_default(stalled, LATE)
            if stalled.reached:
                assert seen[0] in ((NEWER_SEEN, make_rate(*NEWER)), (LATE_SEEN, LATE)), (at, seen)
            lim.set_rate(*NEWER)
    finally:
        lim.close()


@pytest.mark.parametrize("kind", ["keyed", "keyed-rates", "adapt"])
def test_inspect_never_waits_on_a_keyed_config_lock_a_dead_writer_holds(name, monkeypatch, kind):
    """A keyed table whose config writer died holding the lock (its sequence word left odd) is
    inspected at once, as a plain limiter is: the tools read a private copy, which never changes,
    so a wait for its writer could only time out (200 ms a table, each refresh of ``top``)."""
    import time as _time
    from types import SimpleNamespace

    from shmlimit.adapt import Adapt
    from shmlimit.shm import banks

    made = {
        "keyed": lambda: shmlimit.KeyedLimiter(name, rate=50),
        "keyed-rates": lambda: shmlimit.KeyedLimiter(name, rates=[10, "100/min"]),
        "adapt": lambda: shmlimit.KeyedLimiter(
            name, rate=50, adapt=Adapt(min_rate=1, max_rate=100)
        ),
    }[kind]()
    regions = [0]
    if kind == "keyed-rates":
        from shmlimit import group

        geo = group.copy_geometry(name, L.REGIONS_KEYED)
        regions = [geo.offset(i) for i in range(len(geo.keys))]
    with open(f"/dev/shm/shmlimit.{name}", "r+b") as f:
        mm = mmap.mmap(f.fileno(), 0)
    try:
        odd = []
        for at in regions:  # every table's lock held by a writer gone
            off = at + K.CFG_SEQ
            seq = int.from_bytes(mm[off : off + 8], "little") | 1
            mm[off : off + 8] = seq.to_bytes(8, "little")
            odd.append(seq)

        def waited(seconds):
            raise AssertionError(f"inspect waited {seconds} s on a private copy")

        monkeypatch.setattr(
            banks, "time", SimpleNamespace(monotonic_ns=_time.monotonic_ns, sleep=waited)
        )
        s = shmlimit.inspect(name)
        monkeypatch.undo()
        assert s is not None
        seen = [int.from_bytes(mm[at + K.CFG_SEQ : at + K.CFG_SEQ + 8], "little") for at in regions]
        assert seen == odd  # the segment is untouched: only the copy was read
    finally:
        mm.close()
        made.close()
