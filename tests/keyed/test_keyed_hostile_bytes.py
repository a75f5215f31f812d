"""Random words in a keyed segment (header, config, process table, overrides, key slots): every call
and every tool answers or refuses with one of shmlimit's errors, never a crash, a hang or another
exception."""

import contextlib
import functools
import io
import json
import math
import os

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from support.segments import (
    captured,
    no_opener_waits,
    planted,
    run_tools_on,
    secret_of,
    with_words,
)

import shmlimit
from shmlimit import header
from shmlimit.cli import main as cli
from shmlimit.keyed import layout as K
from shmlimit.keyed.cells import BANKS, bank_offsets
from shmlimit.keyed.stats import sample_keys
from shmlimit.shm import layout as L

KEYS, OVR = 64, 4
SIZE = K.segment_size(KEYS, OVR)
WORDS = SIZE // 8


def _used(name):
    lim = shmlimit.KeyedLimiter(name, rate=10, burst=3, keys=KEYS, overrides=OVR)
    for k in ("a", "b", "c", "d" * 40):
        lim.try_acquire(k, 2)
    lim.set_rate(1, key="a")
    _secret.append(secret_of(name))
    return lim


_secret: list = []


@functools.lru_cache(maxsize=None)
def _template():
    """A real keyed segment with live keys, one override and this process registered (then unlinked)."""
    return captured(_used, "test-ktmpl")


def _planted(data):
    """``data`` planted with the template's secret file: an attach reads the table, its keys found."""
    _template()
    return planted(data, "test-khostile", secret=_secret[0])


DEAD_OWNER = K.owner((1 << K.PID_BITS) - 7)  # above any pid_max: never a live process


def _no_live_inserter(data):
    """Every BUSY or PEND slot under a dead owner.  A slot of a key left PEND by an owner that is
    alive and never moves (a stopped process) is test_keyed_hostile's subject: nearer the key's home
    than a new insert's slot or farther, it is given way to after 0.2 s, which here would be paid by
    every call on that key."""
    data = bytearray(data)
    first = K.slots_offset(OVR)
    for off in range(first, len(data) - 7, K.LINE):
        ctrl = int.from_bytes(data[off : off + 8], "little")
        if ctrl & 0xFF in (K.BUSY, K.PEND):
            ctrl = K.ctrl(ctrl & 0xFF, DEAD_OWNER, ctrl >> 40)
            data[off : off + 8] = ctrl.to_bytes(8, "little")
    return bytes(data)


def _mutated(changes):
    return _no_live_inserter(with_words(_template(), changes))


def _slot_words():
    first = K.slots_offset(OVR) // 8
    return st.integers(first, WORDS - 1)


interesting = st.one_of(
    st.integers(0, 2**64 - 1),
    st.sampled_from([0, 1, 2, 3, 4, 5, 2**63, 2**63 - 1, 2**64 - 1, 2**62]),
    # control words: any state, any owner (this process, init, none), any generation
    st.builds(
        K.ctrl,
        st.integers(0, 255),
        st.sampled_from([0, 1, K.owner(os.getpid()), 2**22 - 7]),
        st.integers(0, 2**24 - 1),
    ),
)
segment_bytes = st.one_of(
    st.builds(_mutated, st.lists(st.tuples(st.integers(1, WORDS - 1), interesting), max_size=8)),
    st.builds(_mutated, st.lists(st.tuples(_slot_words(), interesting), min_size=1, max_size=24)),
    st.builds(
        _mutated, st.lists(st.tuples(st.integers(8, 47), interesting), min_size=1, max_size=4)
    ),  # config lines
    st.builds(
        lambda tail: _no_live_inserter(_template()[:64] + tail),
        st.binary(min_size=SIZE - 64, max_size=SIZE - 64),
    ),
    st.binary(max_size=2048),
)


def _quiet_cli(*argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(list(argv))
    assert code in (0, 2), (argv, code, err.getvalue())
    return code


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=segment_bytes)
def test_random_words_in_a_keyed_segment_are_refused_or_served_cleanly(data, monkeypatch):
    no_opener_waits(monkeypatch, header)
    with _planted(data) as name:
        for argv in (
            ("inspect", name),
            ("inspect", "--json", name),
            ("top", "--once", "--interval", "0.001", name),
            ("metrics", name),
        ):
            _quiet_cli(*argv)
        try:
            sample_keys(name, 0, KEYS)
        except shmlimit.ShmlimitError:
            pass
        try:
            lim = shmlimit.attach(name)
        except shmlimit.ShmlimitError as e:
            event(f"refused: {type(e).__name__}")
            return
        event(f"accepted: {type(lim).__name__}")
        try:
            if isinstance(lim, shmlimit.KeyedLimiter):
                for k in ("a", "b", "c", "d" * 40, "new"):
                    for what, call in (
                        ("try", lambda: lim.try_acquire(k)),
                        ("timed", lambda: lim.acquire(k, timeout=0)),
                        ("reserve", lambda: lim.reserve(k, max_wait=0)),
                        ("retry_after", lambda: lim.retry_after(k)),
                        ("override", lambda: lim.override(k)),
                    ):
                        try:
                            call()
                        except shmlimit.ShmlimitError as e:
                            event(f"refused later: {type(e).__name__}")
                        # (the atomics backend: no operation left open, which close() would wait for)
                        assert getattr(lim._att.cells, "_active", 0) == 0, (what, k)
                repr(lim)
                lim.stats()
        finally:
            lim.close()


def test_the_unchanged_template_is_served(monkeypatch):
    """The random-words test reaches the calls: its template, planted as it plants a mutation (its
    secret file beside it: without one every attach was refused, and no call ever ran)."""
    no_opener_waits(monkeypatch, header)
    with _planted(_no_live_inserter(_template())) as name:
        lim = shmlimit.attach(name)
        try:
            assert isinstance(lim, shmlimit.KeyedLimiter) and lim.try_acquire("new")
            assert lim.override("a") == (1.0, 1.0, 1.0)
        finally:
            lim.close()


def _forge_override(name, field, value):
    """Every live override of table ``name`` stores ``value`` as its value ``field`` (0 RATE, 1 PER,
    2 BURST), in banks that pass their checksum: what no writer stores."""
    with open(f"/dev/shm/shmlimit.{name}", "r+b") as f:
        data = f.read()
        w = lambda off: int.from_bytes(data[off : off + 8], "little")  # noqa: E731
        for i in range(w(K.NOVR_OFF)):
            e = K.overrides_offset() + i * K.OVR_LINES * K.LINE
            if K.o_state(w(e + K.O_CTRL)) != K.O_LIVE:
                continue
            for line in K.O_BANKS:
                offs = bank_offsets(e + line, e + line)[0]
                gen = w(offs[5])
                vals = [w(offs[j]) ^ L.bank_mask(gen, j) for j in range(5)]
                vals[field] = L.f2u(value)
                for off, word in zip(offs, BANKS.stored(gen, vals, (w(e + K.O_D0), w(e + K.O_D1)))):
                    os.pwrite(f.fileno(), word.to_bytes(8, "little"), off)


@pytest.mark.parametrize(
    "field,value", [(0, math.nan), (0, math.inf), (0, -1.0), (1, 0.0), (2, -math.inf)]
)
def test_an_override_of_no_rate_is_shown_as_none_and_json_stays_json(
    name, monkeypatch, field, value
):
    lim = shmlimit.KeyedLimiter(name, rate=10, keys=KEYS, store_keys=True)
    lim.try_acquire("alice")
    lim.set_rate(5, key="alice")
    _forge_override(name, field, value)
    assert [(k.key, k.rate, k.per) for k in sample_keys(name, 0, KEYS)[0]] == [
        ("alice", None, None)
    ]
    code, out = run_tools_on(
        monkeypatch, name, "top", "--once", "--json", "--interval", "0.001", name
    )
    assert code == 0
    (row,) = json.loads(out, parse_constant=lambda c: pytest.fail(f"not JSON: {c}"))["limiters"]
    assert [(k["key"], k["rate"]) for k in row["busiest"]] == [("alice", None)]
    lim.close()
