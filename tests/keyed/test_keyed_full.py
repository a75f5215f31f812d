"""A full keyed table makes room (issue items 7 and 9), on both backends.

A table filled with one-request keys (IPv6 clients, forged headers) refused every
new client for the whole window: a day for ``200/day``, a 429 under
``KeyedLimiter`` and a 500 under Flask-Limiter with ``shm://``.  Now the new key
takes the slot of its window's least valuable key (``when_full="evict"``, the
default); ``when_full="refuse"`` keeps the old answer.  A key's bytes are stored
only when asked (``store_keys``), and one who knows the hash's secret can
crowd a key's window but no longer lock it out.  The bound on what eviction may
grant is checked by the stateful tests of tests/keyed/test_keyed_table.py.
"""

import time

import pytest

from shmlimit import KeyedLimiter
from shmlimit.errors import KeyTableFullError
from shmlimit.keyed import cells as KC
from shmlimit.keyed import layout as K
from shmlimit.keyed.stats import sample_keys
from shmlimit.keyed.window_table import WindowTable
from shmlimit.shm.cells import native_available

BACKENDS = ["atomics"] + (["native"] if native_available() else [])
KEYS = 64


def _raw(name):
    with open(f"/dev/shm/shmlimit.{name}", "rb") as f:
        return f.read()


def _since(start):
    """Real seconds since ``start`` (``time.monotonic()``), plus 1 ms for the clock's rounding:
    what a key's wait may have run down since before its take, read after the wait was."""
    return time.monotonic() - start + 0.001


def _fill(try_one, n=8 * KEYS):
    """One request each from many new clients (far more than the slots): how many were admitted."""
    return sum(bool(try_one(f"2001:db8::{i:x}")) for i in range(n))


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_full_keyed_table_admits_a_new_client(name, backend, monkeypatch):
    monkeypatch.setenv("SHMLIMIT_BACKEND", backend)
    kl = KeyedLimiter(name, rate=200, per=86_400, burst=200, keys=KEYS)  # 432 s per op
    try:
        assert kl.backend == backend
        assert _fill(kl.try_acquire) == 8 * KEYS  # before: 64 at most, the rest refused for a day
        assert kl.try_acquire("new-client")
        s = kl.stats()
        assert s.refused_full == 0 and s.cut >= 7 * KEYS and s.keys <= KEYS
        # a limited key with more debt than the one-request keys around it keeps its state
        assert sum(kl.try_acquire("heavy") for _ in range(250)) == 200
        _fill(kl.try_acquire)
        assert not kl.try_acquire("heavy")
    finally:
        kl.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_when_full_refuse_keeps_refusing_new_keys(name, backend, monkeypatch):
    monkeypatch.setenv("SHMLIMIT_BACKEND", backend)
    kl = KeyedLimiter(name, rate=200, per=86_400, keys=KEYS, when_full="refuse")
    try:
        assert _fill(kl.try_acquire) <= KEYS
        assert not kl.try_acquire("new-client")
        s = kl.stats()
        assert s.refused_full > 0 and s.cut == 0
    finally:
        kl.close()
    with pytest.raises(ValueError, match="when_full"):
        KeyedLimiter(name, rate=1, when_full="drop")


@pytest.mark.parametrize(
    "when_full, rates",
    [("evict", None), ("refuse", None), (None, [("1/min", 1), ("2/min", 1)])],
)
@pytest.mark.parametrize("backend", BACKENDS)
def test_retry_after_for_a_new_key_in_a_full_table_is_when_it_is_granted(
    name, backend, monkeypatch, when_full, rates
):
    """A table full of limited keys: a new key is granted at once when it evicts ("evict", and
    always with several rates), and waits for the first slot to free when it is refused
    ("refuse"); ``retry_after`` says so, for one rate and several alike.  One rate's answered the
    time until a slot frees (60 s) in "evict" mode too, its new key granted at once."""
    monkeypatch.setenv("SHMLIMIT_BACKEND", backend)
    kw = dict(rate="1/min", burst=1, when_full=when_full) if rates is None else dict(rates=rates)
    kl = KeyedLimiter(name, keys=KEYS, **kw)
    try:
        start = time.monotonic()
        _fill(kl.try_acquire)  # every slot holds a key limited for a minute
        wait = kl.retry_after("new-client")
        granted = kl.try_acquire("new-client")
        if when_full != "refuse":
            assert (wait, granted) == (0.0, True)
        else:
            # a minute from the take of the first key to free a slot, less the real time since:
            # a few ms on a quiet machine, however long filling the table took on a busy one
            assert 60 - _since(start) < wait <= 60 and not granted
    finally:
        kl.unlink()
        kl.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_own_wait_is_a_keys_own_schedule_not_a_wait_for_a_slot(name, backend, monkeypatch):
    """``retry_after`` of a key refused by a full table is the wait for a slot; ``own_wait`` is
    the key's own schedule only: 0.0 without a slot, the same as ``retry_after`` with one."""
    monkeypatch.setenv("SHMLIMIT_BACKEND", backend)
    kl = KeyedLimiter(name, rate=200, per=86_400, burst=1, keys=KEYS, when_full="refuse")
    try:
        start = time.monotonic()
        _fill(kl.try_acquire)
        assert not kl.try_acquire("new-client")
        assert kl.retry_after("new-client") > 0  # until a slot of its window frees
        assert kl.own_wait("new-client") == 0.0
        held = next(f"2001:db8::{i:x}" for i in range(8 * KEYS) if kl.own_wait(f"2001:db8::{i:x}"))
        between = time.monotonic()
        own, wait = kl.own_wait(held), kl.retry_after(held)
        assert -0.001 <= own - wait <= _since(between)  # the same wait, read a moment apart
        assert 432 - _since(start) < kl.own_wait(held) <= 432  # its op's 432 s, less the time since
        assert kl.own_wait(held, 2) == float("inf")  # above the capacity: never
    finally:
        kl.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_full_window_table_admits_a_new_client(name, backend, monkeypatch):
    """Under Flask-Limiter with ``shm://`` a full table was a 500 (KeyTableFullError) for a day."""
    monkeypatch.setenv("SHMLIMIT_BACKEND", backend)
    now = [10**15]
    wt = WindowTable(name, keys=KEYS, clock=lambda: now[0])
    try:
        assert wt.counters.t.c.backend == backend
        for i in range(4 * KEYS):  # one hit each in a one-day window
            assert wt.incr(f"LIMITER/ip{i}/200/1/day", 86_400) == 1
        assert wt.incr("LIMITER/new/200/1/day", 86_400) == 1
        assert wt.acquire_sliding("new", 200, 86_400)  # the sliding window counter alike
        assert wt.refused == 0
        # the key whose window ends first is the one evicted: one ending later keeps its count
        now[0] += 10**9
        assert [wt.incr("late", 86_400) for _ in range(3)] == [1, 2, 3]
        for i in range(4 * KEYS):  # windows of the same end as late's, with fewer hits
            wt.incr(f"more{i}", 86_400)
        assert wt.incr("late", 86_400) == 4
    finally:
        wt.close()
    wt = WindowTable(name, keys=KEYS, clock=lambda: now[0], when_full="refuse")
    try:
        with pytest.raises(KeyTableFullError):
            for i in range(4 * KEYS):
                wt.incr(f"other{i}", 86_400)
    finally:
        wt.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_key_bytes_in_the_segment_unless_asked(name, backend, monkeypatch):
    """The first 23 bytes of every key were stored in plain text: an API key's prefix was shown by
    ``top`` to a group reader."""
    monkeypatch.setenv("SHMLIMIT_BACKEND", backend)
    secret = b"sk_live_4f9a"
    kl = KeyedLimiter(name, rate=10, keys=KEYS)
    wt = WindowTable(f"{name}-w", keys=KEYS)
    try:
        assert kl.try_acquire(secret) and wt.incr(secret, 60) == 1
        assert secret not in _raw(name) and secret not in _raw(f"{name}-w")
    finally:
        kl.close()
        wt.close()
        wt.unlink()
    (only,) = sample_keys(name, 0, KEYS)[0]
    assert only.key.startswith("#") and secret.decode() not in only.key
    kl = KeyedLimiter(f"{name}-k", rate=10, keys=KEYS, store_keys=True)
    try:
        assert kl.try_acquire(secret)
        assert secret in _raw(f"{name}-k")
        (only,) = sample_keys(f"{name}-k", 0, KEYS)[0]
        assert only.key == secret.decode()
    finally:
        kl.close()
        kl.unlink()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_reader_who_knows_the_secret_cannot_lock_a_key_out(name, backend, monkeypatch):
    """Who knows the hash's secret (a writer: tests/keyed/test_keyed_secret.py keeps it from readers)
    can compute keys that crowd a chosen key's window: 32 requests locked it out while the table
    was 98 % empty.  Under eviction a crowded window costs the crowding keys their slots, never
    the victim its admission."""
    monkeypatch.setenv("SHMLIMIT_BACKEND", backend)
    kl = KeyedLimiter(name, rate=200, per=86_400, burst=200, keys=256)
    try:
        k0, k1 = kl._live().secret

        def home(key):
            return (KC.siphash128(key.encode(), k0, k1)[0] * 256) >> 64

        victim = home("victim")
        crowd, i = [], 0
        while len(crowd) < K.PROBE:  # keys of the victim's home slot: they fill its whole window
            i += 1
            if home(f"x{i}") == victim:
                crowd.append(f"x{i}")
        for k in crowd:  # each with a large debt, so that the victim's is the least
            assert kl.try_acquire(k) and all(kl.try_acquire(k) for _ in range(20))
        assert kl.try_acquire("victim")  # before: refused for a day
        assert kl.stats().cut == 1
    finally:
        kl.close()
