"""Random bytes where a segment should be: refused with a clear error, never a crash or a hang."""

import contextlib
import functools
import os
import struct
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from support.segments import captured, no_opener_waits, planted, with_words

import shmlimit
import shmlimit.header as header
import shmlimit.shm.layout as L
from shmlimit import group
from shmlimit.shm import banks, segment

VALID_HEADER = struct.pack("<QQQQQQ", L.MAGIC, L.VERSION, L.segment_size(1), L.STATE_READY, 1, 1)


SIZE = L.segment_size(1)


def _header_with(word, value):
    return bytes(with_words(VALID_HEADER + bytes(SIZE - len(VALID_HEADER)), [(word, value)]))


def _used(name):
    lim = shmlimit.Limiter(name, rate=1000, slots=1)
    lim.acquire()
    return lim


@functools.lru_cache(maxsize=None)
def _real_segment():
    """The bytes of a real, live-looking segment (created once, then unlinked)."""
    return captured(_used)


def _mutated(changes):
    """A real segment with some words (rovers, lease, slots, anything past the header line) set at random."""
    return bytes(with_words(_real_segment(), changes))


segment_bytes = st.one_of(
    st.builds(
        _mutated,
        st.lists(st.tuples(st.integers(8, SIZE // 8 - 1), st.integers(0, 2**64 - 1)), max_size=6),
    ),
    st.binary(max_size=4096),  # mostly too short
    st.binary(min_size=SIZE, max_size=SIZE),  # the right size, garbage throughout
    # a valid header over garbage: config, rovers, lease and process table all random
    st.builds(
        lambda tail: VALID_HEADER + tail,
        st.binary(min_size=SIZE - len(VALID_HEADER), max_size=SIZE),
    ),
    # a valid header with one header word replaced by any 64-bit value, the rest zero
    st.builds(_header_with, st.integers(0, 5), st.integers(0, 2**64 - 1)),
)


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=segment_bytes)
def test_random_bytes_are_refused_cleanly(data, monkeypatch):
    no_opener_waits(monkeypatch, header)
    # An odd CFG_SEQ (half of the random ones) is a config writer mid-write: a reader waits out the
    # lock's timeout (200 ms), then reads the banks as they are.  1 ms takes the same path, the wait
    # then the read (as in tests/test_promises.py); 200 ms made 80 % of this test's time.
    monkeypatch.setattr(banks, "CONFIG_LOCK_TIMEOUT_NS", 1_000_000)
    with planted(data, "test-hostile") as name:
        for call in (shmlimit.inspect, shmlimit.attach):
            try:
                r = call(name)
            except shmlimit.ShmlimitError as e:
                event(f"refused: {type(e).__name__}")
                continue  # refused with one of our clear errors (LimiterNotFoundError included)
            event("accepted")
            if isinstance(
                r, shmlimit.Limiter
            ):  # a valid header over garbage: calls that cannot wait must work
                try:
                    r.try_acquire()
                    r.acquire(timeout=0)
                    repr(r)
                except shmlimit.ShmlimitError as e:
                    event(f"refused later: {type(e).__name__}")
                finally:
                    r.close()


def _words(offsets, value):
    return [(off // 8, value) for off in offsets]


#: A ready header over words no reader accepts: each reader's own refusal must name the segment,
#: as the header's do (the layers below read words, not names).
_CORRUPT_WORDS = {
    # no config bank passes its checksum
    "config": _words((L.CFG_SUM, L.CFG_BACKUP_SUM), 0x5EED),
    # an adaptive rate whose minimum is 0 ops
    "adapt": _words((L.ADAPT_MIN,), 0) + _words((L.ADAPT_MAX,), L.f2u(10.0)),
}


@pytest.mark.parametrize("what", sorted(_CORRUPT_WORDS))
@pytest.mark.parametrize(
    "call",
    [
        shmlimit.inspect,
        shmlimit.attach,
        lambda n: shmlimit.Limiter(n),
        lambda n: shmlimit.Limiter(n, rate=5),
    ],
    ids=["inspect", "attach", "Limiter attach", "Limiter"],
)
def test_a_corrupt_body_is_refused_naming_the_segment(what, call):
    with planted(bytes(with_words(_real_segment(), _CORRUPT_WORDS[what])), "test-named") as name:
        try:
            got = call(name)
        except shmlimit.SegmentError as e:
            assert repr(name) in str(e), str(e)
            assert "is corrupt" in str(e)
        else:  # (one reader may not need the words: then it must work)
            got.close() if hasattr(got, "close") else None


def _shrunk_after_stat(monkeypatch, module):
    """Every open of ``module`` (``segment``, ``group``) finds the file cut to 64 bytes just after
    it read its size, before it maps it: what another process truncating it then does."""
    real = module.opened

    @contextlib.contextmanager
    def shrinking(*args, **kwargs):
        with real(*args, **kwargs) as (fd, st):
            os.ftruncate(fd, 64)
            yield fd, st

    monkeypatch.setattr(module, "opened", shrinking)


@pytest.mark.parametrize("rates", [None, ["5/s", "100/min"]], ids=["one rate", "several rates"])
def test_a_file_cut_between_its_size_and_its_mapping_is_refused(name, rates, monkeypatch):
    if rates is None:
        shmlimit.Limiter(name, rate=5, slots=1).close()
        _shrunk_after_stat(monkeypatch, segment)
    else:
        shmlimit.Limiter(name, rates=rates, slots=1).close()
        _shrunk_after_stat(
            monkeypatch, group
        )  # (the group's header maps whole; a rate's region not)
    with pytest.raises(shmlimit.SegmentError, match=f"{name!r} shrank"):
        shmlimit.attach(name)


# A process attaching while another rewrites the slot count: the open checks the count against the
# file and maps that many bytes; the count is read again afterwards (the process table, the ticket
# records, the fences).  The child below is such an attach, with the word rewritten between the two.
_ATTACH_AFTER_SLOTS_REWRITTEN = """
import resource, sys
import shmlimit, shmlimit.attachment as A
from shmlimit.shm import layout as L

resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))  # a count looped over: MemoryError, not the machine's
name, value = sys.argv[1], int(sys.argv[2])
shmlimit.Limiter(name, rate=5, slots=4).close()
real = A.open_segment

def rewritten(*args, **kwargs):
    seg, cells = real(*args, **kwargs)
    cells.store(L.SLOTS_OFF, value)  # after the open's check, before the attachment's reads
    return seg, cells

A.open_segment = rewritten
try:
    shmlimit.Limiter(name, rate=5).acquire(timeout=0.1)
except shmlimit.SegmentError as e:
    print("refused:", e)
except BaseException as e:
    print("other:", type(e).__name__, e)
else:
    print("served")
"""


@pytest.mark.parametrize("value", [L.MAX_SLOTS, L.MAX_SLOTS + 1, 2**40, 2**64 - 1])
def test_a_slot_count_rewritten_after_the_open_is_refused_not_looped_over(name, value):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    try:
        out = subprocess.run(
            [sys.executable, "-c", _ATTACH_AFTER_SLOTS_REWRITTEN, name, str(value)],
            capture_output=True,
            text=True,
            timeout=60,
            env=env,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"an attach that read {value} slots after the open hung")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("refused:"), out.stdout + out.stderr
    assert "slot" in out.stdout and repr(name) in out.stdout, out.stdout


@pytest.mark.parametrize(
    "word, value",
    [
        (L.SLOTS_OFF, 0),
        (L.SLOTS_OFF, 2**40),
        (L.GROUP_TABLE_KEYS, 5),
        (L.GROUP_FIRST, 4097),
        (L.GROUP_STRIDE, 2**40),
    ],
    ids=[
        "no slots",
        "2**40 slots",
        "a table's keys",
        "a first region off its page",
        "a far stride",
    ],
)
def test_a_group_header_rewritten_after_the_open_is_refused(name, monkeypatch, word, value):
    """The open checks a group header's geometry, then the geometry is read again: a writer that
    changed a word in between raised AssertionError, or OSError from the mapping of a region."""
    shmlimit.Limiter(name, rates="5/s;100/min").close()
    real = group.open_segment

    def rewritten(*args, **kwargs):
        seg, cells = real(*args, **kwargs)
        cells.store(word, value)  # after the open's check, before the geometry is read again
        return seg, cells

    monkeypatch.setattr(group, "open_segment", rewritten)
    with pytest.raises(shmlimit.SegmentError, match="geometry makes no sense"):
        shmlimit.Limiter(name, rates="5/s;100/min")
