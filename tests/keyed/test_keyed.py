"""KeyedLimiter's interface: per-key limits, bad input, overrides, a full table, attach and pickle."""

import asyncio
import os
import pickle
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest

import shmlimit
from shmlimit.keyed import cells as KC
from shmlimit.keyed import layout as K
from shmlimit.keyed.cells import BANKS
from shmlimit.keyed.gcra import bank_values, make_rate
from shmlimit.keyed.limiter import KeyedStats

WORKDIR = tempfile.gettempdir()


@pytest.fixture
def lim(name):
    lim = shmlimit.KeyedLimiter(name, rate=1, per=60, burst=2, keys=1000)
    yield lim
    lim.close()


def test_each_key_has_its_own_bucket(lim):
    assert [lim.try_acquire("a") for _ in range(3)] == [True, True, False]
    assert lim.try_acquire("b") and lim.try_acquire(b"b")  # str keys are their UTF-8 bytes
    assert not lim.try_acquire("b")
    assert lim.try_acquire("c", 2) and not lim.try_acquire("c")
    s = lim.stats()
    assert isinstance(s, KeyedStats)
    assert (s.keys, s.grants, s.slots, s.refused_full) == (3, 6, 1000, 0)
    assert K.SLOT_BYTES == 64 and s.segment_bytes == K.segment_size(1000, K.default_overrides(1000))
    assert (
        K.segment_size(10**6, K.default_overrides(10**6)) <= 64 * 2**20
    )  # a million keys in Docker's /dev/shm
    assert "keys=3/1000" in repr(lim)


def test_exhausting_one_key_never_refuses_another(lim):
    for _ in range(5):
        lim.try_acquire("hot")
    assert all(lim.try_acquire(f"cold-{i}") for i in range(300))


def test_retry_after_reserve_and_timed_acquire(name):
    lim = shmlimit.KeyedLimiter(
        name, rate=1, per=10, burst=1, keys=100
    )  # waits of ~10 s: load cannot blur them
    assert lim.retry_after("k") == 0.0
    assert lim.reserve("k") == 0.0
    assert 9 < lim.retry_after("k") <= 10
    assert lim.reserve("k", max_wait=1) is None  # taking nothing
    assert lim.acquire("k", timeout=1) is False
    assert 9 < lim.reserve("k", max_wait=20) <= 10  # the next slot, reserved
    assert 19 < lim.retry_after("k") <= 20
    assert lim.retry_after("k", 2) == float("inf")  # more than the burst: never
    lim.close()


@pytest.mark.slow
def test_acquire_waits_for_its_turn_never_less(name):
    lim = shmlimit.KeyedLimiter(name, rate=20, burst=1, keys=100)
    t0 = time.monotonic()
    assert lim.acquire("k") and lim.acquire("k") and lim.acquire("k")
    assert time.monotonic() - t0 >= 2 / 20
    lim.close()


# a 1 ms timeout against a turn 20 ms away, both real time
@pytest.mark.slow
def test_acquire_async(name):
    lim = shmlimit.KeyedLimiter(name, rate=50, burst=1, keys=100)

    async def main():
        assert await lim.acquire_async("x")
        assert not await lim.acquire_async("x", timeout=0.001)
        assert await lim.acquire_async("x", timeout=0.5)

    asyncio.run(main())
    lim.close()


@pytest.mark.parametrize("behind", [False, True], ids=["last", "one-behind"])
def test_a_cancelled_wait_gives_its_ops_back_unless_the_key_was_taken_since(name, behind):
    # 1 op a minute, burst 1: the bucket's op, then a waiter whose op is 60 s away, cancelled
    lim = shmlimit.KeyedLimiter(name, rate=1, per=60, burst=1, keys=100)
    assert lim.try_acquire("x")

    async def main():
        waiting = asyncio.ensure_future(lim.acquire_async("x"))
        while lim.retry_after("x") <= 60:  # until its take: the next op 2 min away
            await asyncio.sleep(0.001)
        if behind:
            assert lim.reserve("x") > 60  # taken since: the waiter's take can't be undone
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting

    asyncio.run(main())
    # given back: the key as if the waiter never asked, its count too; else spent, time lost
    wait, grants = lim.retry_after("x"), lim.stats().grants
    assert (120 < wait <= 180 and grants == 3) if behind else (0 < wait <= 60 and grants == 1)
    lim.close()


@pytest.mark.parametrize("key", [1, None, 3.5, ["a"], bytearray(b"a"), object()])
def test_bad_keys_raise_type_error_and_change_nothing(lim, key):
    for call in (lim.try_acquire, lim.acquire, lim.retry_after, lim.reserve):
        with pytest.raises(TypeError, match="key must be a str or bytes"):
            call(key)
    assert lim.stats().keys == 0 and lim.stats().grants == 0


def test_bad_n_and_oversized_keys(lim):
    for n, exc in (
        (0, ValueError),
        (-1, ValueError),
        (1.0, TypeError),
        (True, TypeError),
        ("1", TypeError),
    ):
        with pytest.raises(exc, match="n must be a positive int"):
            lim.try_acquire("k", n)
    with pytest.raises(ValueError, match="at most 4096 bytes"):
        lim.try_acquire("k" * 5000)
    for call in (lim.try_acquire, lim.acquire, lim.retry_after, lim.reserve):
        with pytest.raises(ValueError, match=r"key must be .* UTF-8 \(no lone surrogate\)"):
            call("\udc80")
    assert not lim.try_acquire("k", 3)  # above the capacity: never
    with pytest.raises(ValueError, match="capacity"):
        lim.acquire("k", 3)
    assert lim.stats().grants == 0


def test_n_above_a_keys_capacity_names_that_keys_capacity(name):
    lim = shmlimit.KeyedLimiter(name, rate=100, burst=50, keys=64)
    try:
        lim.set_rate(1, burst=2, key="small")
        lim.set_rate(1, burst=80, key="large")
        with pytest.raises(ValueError, match=r"this key's capacity \(2 ops\), got 3"):
            lim.acquire("small", 3)
        with pytest.raises(ValueError, match=r"this key's capacity \(2 ops\), got 3"):
            lim.reserve("small", 3)
        with pytest.raises(ValueError, match=r"this key's capacity \(80 ops\), got 81"):
            lim.acquire("large", 81)
        with pytest.raises(ValueError, match=r"this key's capacity \(50 ops\), got 51"):
            lim.acquire("other", 51)
    finally:
        lim.close()


def test_a_huge_finite_timeout_is_a_long_wait_not_an_overflow(name):
    """A timeout is any finite number of seconds >= 0: one past about 1e298 s is infinite in ticks
    as a float, and converting it raised OverflowError instead of waiting (or granting now)."""
    lim = shmlimit.KeyedLimiter(name, rate=10, burst=1, keys=64)
    multi = shmlimit.KeyedLimiter(name + "-m", rates=["10/s", "100/min"], keys=64)
    try:
        assert lim.acquire("k", timeout=1e300) is True  # a full bucket: granted now
        assert 0 < lim.reserve("k", max_wait=1e300) <= 0.1  # the next op's wait, claimed
        assert asyncio.run(lim.acquire_async("j", timeout=sys.float_info.max)) is True
        assert multi.acquire("k", timeout=1e300) is True
        assert lim.stats().grants == 3 and multi.stats()["0"].grants == 1
    finally:
        lim.close()
        multi.unlink()
        multi.close()


def test_bad_config(name):
    with pytest.raises(ValueError, match="rate"):
        shmlimit.KeyedLimiter(name, rate=0)
    with pytest.raises(ValueError, match="keys"):
        shmlimit.KeyedLimiter(name, rate=1, keys=0)
    with pytest.raises(ValueError, match="keys"):
        shmlimit.KeyedLimiter(name, rate=1, keys=True)
    with pytest.raises(ValueError, match="overrides"):
        shmlimit.KeyedLimiter(name, rate=1, overrides=-1)
    with pytest.raises(ValueError, match="name"):
        shmlimit.KeyedLimiter("a/b", rate=1)
    assert name not in shmlimit.list_names()


@pytest.mark.parametrize("spec", ["1K,1.5", "2K,3,start", "2K,stop", "2K/s,configure"])
def test_a_rate_specs_ratio_or_verb_is_refused_not_dropped(name, spec):
    """A key has no catch-up and no verbs: ``KeyedLimiter(rate="1K,1.5")`` and ``set_rate``
    dropped them silently (and "2K,stop" was refused as "not allowed when creating a limiter")."""
    refused = "applies only to a Limiter of one rate.*; a KeyedLimiter takes a number or a rate"
    with pytest.raises(ValueError, match=refused):
        shmlimit.KeyedLimiter(name, rate=spec, keys=64)
    assert name not in shmlimit.list_names()
    lim = shmlimit.KeyedLimiter(name, rate="1K", keys=64)
    try:
        for key in (None, "k"):
            with pytest.raises(ValueError, match=refused):
                lim.set_rate(spec, key=key)
        assert (lim.rate, lim.override("k")) == (1000, None)
        lim.set_rate("2K,1")  # a ratio of 1 is no catch-up: a plain rate
        lim.set_rate("3K,1", key="k")
        assert (lim.rate, lim.override("k")[0]) == (2000, 3000)
    finally:
        lim.unlink()
        lim.close()


def test_full_table_try_timed_untimed(name):
    lim = shmlimit.KeyedLimiter(name, rate=1, per=3600, burst=1, keys=16, when_full="refuse")
    admitted = [k for k in range(64) if lim.try_acquire(f"k{k}")]
    assert len(admitted) == 16  # 16 slots, each with a key limited for an hour
    refused = 64 - 16
    assert lim.acquire("new", timeout=1.0) is False
    assert lim.reserve("new", max_wait=1.0) is None
    with pytest.raises(shmlimit.KeyTableFullError, match="no free slot"):
        lim.acquire("new")
    assert isinstance(shmlimit.KeyTableFullError("x", 1), shmlimit.ShmlimitError)
    assert lim.stats().refused_full == refused + 3
    assert not any(lim.try_acquire(f"k{k}") for k in admitted)  # none was reset
    lim.close()


def test_overrides_are_per_key_removable_and_bounded(name):
    lim = shmlimit.KeyedLimiter(name, rate=1000, keys=100, overrides=2)
    lim.set_rate(1, per=60, burst=1, key="slow")
    assert lim.override("slow") == (1.0, 60.0, 1.0)
    assert lim.override("other") is None
    assert lim.try_acquire("slow") and not lim.try_acquire("slow")
    assert all(lim.try_acquire("other") for _ in range(5))
    lim.set_rate(5, per=60, burst=3, key="slow2")
    with pytest.raises(ValueError, match="override table is full"):
        lim.set_rate(1, key="third")
    assert lim.remove_override("slow2") and not lim.remove_override("slow2")
    lim.set_rate(1, key="third")  # the freed entry is reused
    assert lim.stats().overrides == 2
    lim.set_rate(2000)  # the default changes for every other key
    assert lim.rate == 2000 and lim.override("slow") == (1.0, 60.0, 1.0)
    lim.close()


def test_a_small_tables_overrides_are_all_in_force(name):
    # A table of 4 keys probes 4 entries from a key's home: an override placed beyond them would
    # be invisible to the composite, and its key granted at the default rate
    lim = shmlimit.KeyedLimiter(name, rate=1000, keys=4, overrides=16)
    placed = []
    for k in range(16):
        try:
            lim.set_rate(1, per=3600, burst=1, key=f"k{k}")
        except ValueError as e:  # no entry free in its window: said, never placed out of reach
            assert "override table is full" in str(e)
            continue
        placed.append(f"k{k}")
    assert len(placed) >= 4
    for key in placed:
        assert lim.override(key) == (1.0, 3600.0, 1.0)
        assert lim.try_acquire(key) and not lim.try_acquire(key), key
    lim.close()


def test_config_mismatch_and_attach(name):
    lim = shmlimit.KeyedLimiter(name, rate=5, keys=100)
    with pytest.raises(shmlimit.ConfigMismatchError):
        shmlimit.KeyedLimiter(name, rate=6, keys=100)
    with pytest.raises(shmlimit.ConfigMismatchError):
        shmlimit.KeyedLimiter(name, rate=5, keys=101)
    other = shmlimit.attach(name)
    assert isinstance(other, shmlimit.KeyedLimiter) and other.rate == 5
    with pytest.raises(shmlimit.SegmentError):
        shmlimit.Limiter(name, rate=5)
    plain = shmlimit.Limiter(name + "-plain", rate=5)
    with pytest.raises(shmlimit.SegmentError, match="is a Limiter"):
        shmlimit.KeyedLimiter(name + "-plain", rate=5)
    assert isinstance(shmlimit.attach(name + "-plain"), shmlimit.Limiter)
    plain.close()
    plain.unlink()
    assert isinstance(shmlimit.inspect(name), KeyedStats)
    with pytest.raises(shmlimit.LimiterNotFoundError):
        shmlimit.attach(name + "-none")
    lim.close()


@pytest.mark.parametrize("kwargs", [dict(per=60), dict(burst=9), dict(keys=64), dict(overrides=16)])
def test_options_of_a_new_table_without_rate_are_refused(name, kwargs):
    """Without rate= the call only attaches: an option that would configure a new table is an
    error naming it, not dropped."""
    lim = shmlimit.KeyedLimiter(name, rate=10, keys=100)
    (param,) = kwargs
    with pytest.raises(ValueError, match=f"{param}= apply only when rate= creates"):
        shmlimit.KeyedLimiter(name, **kwargs)
    other = shmlimit.KeyedLimiter(name)  # attaching as it is still works
    assert (other.rate, other.capacity, other.slots) == (lim.rate, lim.capacity, lim.slots)
    other.close()
    lim.close()


def test_a_missing_table_opened_without_rate_says_rate_creates_it(name):
    with pytest.raises(shmlimit.LimiterNotFoundError, match="pass rate= to create it"):
        shmlimit.KeyedLimiter(name)
    assert name not in shmlimit.list_names()


def test_pickles_by_name(name):
    lim = shmlimit.KeyedLimiter(name, rate=1, per=60, burst=1, keys=100)
    assert lim.try_acquire("k")
    clone = pickle.loads(pickle.dumps(lim))
    assert isinstance(clone, shmlimit.KeyedLimiter) and not clone.try_acquire("k")
    lim.close()


def test_a_pickle_carries_when_full_and_store_keys_to_another_interpreter(name):
    """``when_full`` and ``store_keys`` are each process's options, and a pickle (how a pool
    worker gets its handle) carried only the name, mode and trust: a ``when_full="refuse"``
    limiter unpickled in a spawned worker evicted limited keys (a client gained its debt)."""
    lim = shmlimit.KeyedLimiter(
        name, rate=1, per=60, burst=1, keys=16, when_full="refuse", store_keys=True
    )
    code = textwrap.dedent(
        """
        import pickle, sys
        lim = pickle.loads(sys.stdin.buffer.read())
        granted = sum(lim.try_acquire(f"client-{i}") for i in range(64))
        s = lim.stats()
        print(granted, s.evicted, s.refused_full, lim._use().flags)
        """
    )
    r = subprocess.run(
        [sys.executable, "-c", code],
        input=pickle.dumps(lim),
        capture_output=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    granted, evicted, refused, flags = map(int, r.stdout.split())
    assert (granted, evicted) == (16, 0) and refused == 64 - 16  # refused, never evicted
    assert flags == KC.table_flags("refuse", True)
    lim.close()


def test_attach_by_name_from_an_unrelated_interpreter(name):
    lim = shmlimit.KeyedLimiter(name, rate=1, per=60, burst=1, keys=100)
    lim.set_rate(1, per=60, burst=2, key="vip")
    assert lim.try_acquire("client")
    code = textwrap.dedent(
        f"""
        import shmlimit
        lim = shmlimit.attach({name!r})
        print(type(lim).__name__, lim.try_acquire("client"), lim.try_acquire("fresh"),
              lim.try_acquire("vip", 2), lim.stats().grants)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=WORKDIR, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["KeyedLimiter", "False", "True", "True", "4"]
    lim.close()


def test_hostile_headers_are_refused(name):
    lim = shmlimit.KeyedLimiter(name, rate=1, keys=64)
    lim.close()
    path = f"/dev/shm/shmlimit.{name}"
    good = open(path, "rb").read()

    def both_banks(vals, gen=0, flip=0):
        words = dict(zip((*K.B_VALUES, K.B_GEN, K.B_SUM), BANKS.stored(gen, vals, (0, 0))))
        words[K.B_SUM] ^= flip
        return [(line + off, v) for line in K.DEFAULT_BANKS for off, v in words.items()]

    rate = bank_values(make_rate(1, 1, 1))
    for changes in (
        [(K.NKEYS_OFF, 10**9)],
        [(K.PROBE_OFF, 99)],
        [(K.VERSION_OFF, K.VERSION + 1)],
        [(K.KIND_OFF, 7)],
        [(K.SIZE_OFF, 1 << 40)],
        [(K.NOVR_OFF, 1 << 20)],
        both_banks((*rate[:3], 0, rate[4])),  # T == 0, checksums that hold
        both_banks(rate, flip=1),
    ):  # no bank passes its checksum
        bad = bytearray(good)
        for off, value in changes:
            bad[off : off + 8] = value.to_bytes(8, "little")
        with open(path, "r+b") as f:
            f.write(bad)
        with pytest.raises(shmlimit.SegmentError):
            shmlimit.attach(name)
    with open(path, "r+b") as f:
        f.write(good)
        f.truncate(1000)
    with pytest.raises(shmlimit.SegmentError):
        shmlimit.attach(name)


def test_a_table_larger_than_dev_shm_is_a_clear_error(name):
    """In a private mount namespace with a 4 MiB /dev/shm (Docker's is 64 MiB): a clear error, no segment."""
    code = textwrap.dedent(
        f"""
        import os, shmlimit
        try:
            shmlimit.KeyedLimiter({name!r}, rate=1, keys=100_000)
        except shmlimit.SharedMemoryFullError as e:
            print("refused:", e)
        lim = shmlimit.KeyedLimiter({name!r}, rate=1, keys=10_000)  # 0.7 MiB fits
        with open("/dev/shm/shmlimit.{name}", "rb") as f:  # its inode and its CREATED_NS
            ino = f"{{os.fstat(f.fileno()).st_ino}}-{{int.from_bytes(f.read(56)[48:], 'little')}}"
        print("fits", lim.try_acquire("k"), ino, sorted(os.listdir("/dev/shm")))
        """
    )
    script = 'mount -t tmpfs -o size=4m tmpfs /dev/shm && exec "$0" -c "$1"'
    try:
        out = subprocess.run(
            ["unshare", "-m", "sh", "-c", script, sys.executable, code],
            cwd=WORKDIR,
            capture_output=True,
            text=True,
            timeout=60,
        )
    except FileNotFoundError:
        pytest.skip("no unshare(1)")
    if out.returncode != 0 and ("mount" in out.stderr or "unshare" in out.stderr):
        pytest.skip(f"cannot make a private /dev/shm here: {out.stderr.strip()}")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("refused:") and "6.3 MiB" in lines[0] and "--shm-size" in lines[0]
    ino = lines[1].split()[2]  # the table and its secret file, nothing else
    assert lines[1] == f"fits True {ino} ['shmlimit.{name}', 'shmlimit.{name}~secret-{ino}']"
    assert name not in shmlimit.list_names()  # the real /dev/shm was never touched


def test_throttle_with_a_key(name):
    @shmlimit.throttle(
        name, rate=1, per=60, burst=1, on_limit="raise", key=lambda user, **kw: user, keys=100
    )
    def fetch(user, page=1):
        return (user, page)

    assert fetch("alice") == ("alice", 1)
    assert fetch("bob", page=2) == ("bob", 2)
    with pytest.raises(shmlimit.RateLimited) as e:
        fetch("alice")
    assert 50 < e.value.retry_after <= 60
    assert isinstance(fetch.limiter(), shmlimit.KeyedLimiter)
    with pytest.raises(TypeError, match="key="):
        shmlimit.throttle(fetch.limiter())
    plain = shmlimit.Limiter(name + "-p", rate=1)
    with pytest.raises(TypeError, match="key="):
        shmlimit.throttle(plain, key=str)
    plain.close()
    plain.unlink()
    fetch.limiter().close()


def test_throttle_async_with_a_key(name):
    @shmlimit.throttle(
        name, rate=1, per=60, burst=1, on_limit="skip", key=lambda host: host, keys=100
    )
    async def get(host):
        return host

    async def main():
        return [await get("a"), await get("a"), await get("b")]

    assert asyncio.run(main()) == ["a", None, "b"]


def test_cli_and_top_show_keyed_limiters(name, capsys):
    from shmlimit.cli import main as cli
    from shmlimit.cli import top

    lim = shmlimit.KeyedLimiter(name, rate=1, per=60, keys=100, store_keys=True)
    for i in range(30):
        lim.try_acquire(f"client-{i % 3}")
    lim.try_acquire("evil\x1b[2J")
    assert cli.main(["inspect", name]) == 0
    out = capsys.readouterr().out
    assert "keys" in out and "refused_full" in out
    assert cli.main(["list"]) == 0
    assert "4/100 keys" in capsys.readouterr().out
    ins = top.Inspector([name])
    ins.sample()
    text = top.render(ins.sample(), 1.0)
    assert (
        "keys 4/100" in text
        and "client-0" in text
        and "\x1b[2J" not in text
        and "evil\\x1b[2J" in text
    )
    lim.close()


def test_each_segment_has_its_own_secret(name):
    a = shmlimit.KeyedLimiter(name, rate=1, keys=64)
    b = shmlimit.KeyedLimiter(name + "-b", rate=1, keys=64)
    digest = lambda lim, key: lim._live().kt.digest(key)  # noqa: E731
    assert digest(a, "203.0.113.7") != digest(b, "203.0.113.7")  # placement cannot be precomputed
    assert digest(a, "203.0.113.7") == digest(shmlimit.attach(name), "203.0.113.7")  # but is shared
    for lim in (a, b):
        lim.close()
    shmlimit.unlink(name + "-b")


def _inherited(q):
    q.put((os.getpid(), _INHERITED.try_acquire("child-key"), _INHERITED.try_acquire("child-key")))


_INHERITED = None


def test_a_handle_inherited_through_fork_counts_as_the_child(name):
    global _INHERITED
    import multiprocessing as mp

    _INHERITED = lim = shmlimit.KeyedLimiter(name, rate=1, per=60, burst=1, keys=100)
    try:
        ctx = mp.get_context("fork")
        q = ctx.Queue()
        p = ctx.Process(target=_inherited, args=(q,))
        p.start()
        pid, first, second = q.get(timeout=60)
        p.join()
        assert (first, second) == (True, False)
        assert not lim.try_acquire("child-key")  # the child's grant is the parent's limit too
        assert lim.stats().grants == 1  # counted once: in the child's own process slot
    finally:
        _INHERITED = None
        lim.close()


def test_a_config_writer_killed_at_any_write_leaves_the_old_config_or_the_new(name, monkeypatch):
    """Killed before each of its writes in turn (a default rate, an override added, changed or removed),
    a writer leaves each config's other bank whole: once its lock is closed, the Python readers and
    the keyed composite price by the old config or by the new one, never by words of both."""
    from shmlimit.keyed.gcra import Overrides, publish_default, read_default

    monkeypatch.setattr(KC, "LOCK_NS", 0)
    lim = shmlimit.KeyedLimiter(name, rate=10, burst=2, keys=64, overrides=16)
    cells = lim._live().cells
    novr = lim._att.geo.overrides
    new = make_rate(1000, 1, 50)

    class Killed(Exception):
        pass

    class DiesAt:
        def __init__(self, writes):
            self.left = writes

        def load(self, off):
            return cells.load(off)

        def load_many(self, offsets):
            return cells.load_many(offsets)

        def _write(self):
            if not self.left:
                raise Killed
            self.left -= 1

        def store(self, off, value):
            self._write()
            cells.store(off, value)

        def cas(self, off, expected, desired):
            self._write()
            return cells.cas(off, expected, desired)

        def fetch_add(self, off, delta):
            self._write()
            return cells.fetch_add(off, delta)

    def burst(key):  # the largest request the composite would grant at once (a peek)
        return max(n for n in (1, 2, 50) if lim._att.kt.acquire(key, n, -1) != KC.NEVER)

    d = lim._att.kt.digest("k")
    cases = [  # (set up the old config, the writer, what the config is: (a rate or an override, "k"'s burst))
        (lambda: None, lambda c: publish_default(c, new), lambda: (read_default(cells), 50)),
        (
            lambda: lim.remove_override("k"),
            lambda c: Overrides(c, novr, lim._att.geo.probe).set(d, new),
            lambda: (lim.override("k"), 50),
        ),
        (
            lambda: lim.set_rate(10, burst=2, key="k"),
            lambda c: Overrides(c, novr, lim._att.geo.probe).set(d, new),
            lambda: (lim.override("k"), 50),
        ),
        (
            lambda: lim.set_rate(1000, burst=50, key="k"),
            lambda c: Overrides(c, novr, lim._att.geo.probe).remove(d),
            lambda: (lim.override("k"), 2),
        ),
    ]
    for case, (setup, write, seen) in enumerate(cases):
        for writes in range(40):
            lim.set_rate(10, burst=2)
            setup()
            before = (seen()[0], burst("k"))
            try:
                write(DiesAt(writes))
                done = True
            except Killed:
                done = False
            after = (
                seen()[0],
                burst("k"),
            )  # (the Python reader closes the dead writer's lock first)
            newer = {
                0: (new, 50),
                1: ((1000.0, 1.0, 50.0), 50),
                2: ((1000.0, 1.0, 50.0), 50),
                3: (None, 2),
            }[case]
            assert after in (before, newer), (case, writes, before, after)
            if done:
                assert after == newer, (case, writes)
                break
        else:
            raise AssertionError(f"case {case}: the writer never finished")
    lim.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a segment to another user")
def test_a_segment_another_user_owns_or_can_write_is_refused(name):
    lim = shmlimit.KeyedLimiter(name, rate=1, keys=64)
    lim.close()
    path = f"/dev/shm/shmlimit.{name}"
    os.chown(path, 65534, 65534)  # now "nobody" owns it: a squatter could have set its rate
    with pytest.raises(shmlimit.SegmentError, match="another user owns it"):
        shmlimit.KeyedLimiter(name, rate=1, keys=64)
    with pytest.raises(shmlimit.SegmentError, match="trusted_uids"):
        shmlimit.attach(name)
    trusted = shmlimit.KeyedLimiter(name, trusted_uids=[65534])
    assert trusted.try_acquire("k")
    trusted.close()
    os.chown(path, os.geteuid(), os.getegid())
    os.chmod(path, 0o666)  # writable by every local user
    with pytest.raises(shmlimit.SegmentError, match="beyond the mode"):
        shmlimit.KeyedLimiter(name)
    assert shmlimit.KeyedLimiter(name, mode=0o666).rate == 1  # asked for: accepted
    assert shmlimit.inspect(name).slots == 64  # the read-only tools only look, and report
