"""Every kind of limiter lives under its one name: created in one process, attached by that name
from an unrelated interpreter, listed as one entry, collected as one, refused when forged."""

import json
import os
import struct
import subprocess
import sys
import textwrap

import pytest
from support.segments import shm_path

import shmlimit
from shmlimit.attachment import collect
from shmlimit.errors import SegmentError
from shmlimit.kinds import inspect
from shmlimit.multirate import MultiLimiter, MultiStats
from shmlimit.shm import layout as L

KINDS = {
    "one rate": lambda n: shmlimit.Limiter(n, rate=50),
    "rates as a list": lambda n: shmlimit.Limiter(n, rates=["50/s", "1000/min"]),
    "rates as a dict": lambda n: shmlimit.Limiter(n, rates={"requests": "50/s", "tokens": "2K/s"}),
    "keyed": lambda n: shmlimit.KeyedLimiter(n, rate=50, keys=64),
    "keyed with several rates": lambda n: shmlimit.KeyedLimiter(
        n, rates=["50/s", "1000/min"], keys=64
    ),
}
#: what the other interpreter passes to each call, per kind: (arguments, keyword arguments)
CALLS = {
    "one rate": ([], {}),
    "rates as a list": ([], {}),
    "rates as a dict": ([], {"requests": 1, "tokens": 10}),
    "keyed": (["client-1"], {}),
    "keyed with several rates": (["client-1"], {}),
}

ATTACHES = textwrap.dedent(
    """
    import asyncio, json, sys
    import shmlimit

    lim = shmlimit.attach(sys.argv[1])
    args, kw = json.loads(sys.argv[2])
    out = {
        "kind": type(lim).__name__,
        "try": lim.try_acquire(*args, **kw),
        "acquire": lim.acquire(*args, timeout=1.0, **kw),
        "acquire_async": asyncio.run(lim.acquire_async(*args, timeout=1.0, **kw)),
        "stats": type(lim.stats()).__name__,
    }
    lim.close()
    print(json.dumps(out))
    """
)


def attach_elsewhere(name: str, kind: str) -> dict:
    r = subprocess.run(
        [sys.executable, "-c", ATTACHES, name, json.dumps(CALLS[kind])],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def listed(name: str) -> list:
    r = subprocess.run(
        [sys.executable, "-c", "from shmlimit.cli.main import main; main()", "list", "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    return [e["name"] for e in json.loads(r.stdout) if e["name"].startswith(name)]


@pytest.mark.parametrize("kind", list(KINDS))
def test_every_kind_is_attached_by_its_name_elsewhere_and_listed_once(name, kind):
    lim = KINDS[kind](name)
    try:
        got = attach_elsewhere(name, kind)
        assert got["try"] is True and got["acquire"] is True and got["acquire_async"] is True
        assert got["stats"].endswith("Stats")
        assert listed(name) == [name]
    finally:
        lim.unlink()
        lim.close()


def test_a_group_of_rates_is_collected_whole_when_idle_and_kept_while_used(name):
    lim = shmlimit.Limiter(name, rates={"a": "10/s", "b": "1/s"})
    lim.try_acquire()
    assert not collect(name)  # this process is registered in its rates: in use
    assert name in shmlimit.list_names()
    lim.close()
    assert collect(name)
    assert name not in shmlimit.list_names()


def test_a_group_is_inspected_as_one_limiter_of_its_rates(name):
    lim = shmlimit.Limiter(name, rates={"a": ("10/s", 5), "b": "1/s"})
    try:
        assert lim.try_acquire(a=3, b=1)
        s = inspect(name)
        assert isinstance(s, MultiStats) and list(s.rates) == ["a", "b"]
        assert s.grants == {"a": 3, "b": 1} and s.rates["a"].capacity == 5
        assert [p.pid for p in s.processes] == [os.getpid()]
    finally:
        lim.unlink()
        lim.close()


def test_different_rates_under_a_group_name_are_refused(name):
    lim = shmlimit.Limiter(name, rates={"a": "10/s", "b": "1/s"})
    try:
        with pytest.raises(shmlimit.ConfigMismatchError, match="rates"):
            shmlimit.Limiter(name, rates={"a": "10/s", "c": "1/s"})
        with pytest.raises(shmlimit.ConfigMismatchError, match="rates"):
            shmlimit.Limiter(name, rates=["10/s", "1/s"])
        with pytest.raises(SegmentError, match="several rates"):
            shmlimit.Limiter(name, rate=10)
    finally:
        lim.unlink()
        lim.close()


def _forge(name: str, offset: int, value: bytes) -> None:
    with open(shm_path(name), "r+b") as f:
        f.seek(offset)
        f.write(value)


@pytest.mark.parametrize(
    "offset, value, match",
    [
        (L.GROUP_COUNT, struct.pack("<Q", 0), "corrupt"),
        (L.GROUP_COUNT, struct.pack("<Q", 17), "corrupt"),
        (L.GROUP_COUNT, struct.pack("<Q", 3), "corrupt"),  # more than the file holds
        (L.GROUP_STRIDE, struct.pack("<Q", 8), "corrupt"),
        (L.GROUP_KEYS, b"a-b\0", "keys"),
        (L.GROUP_NAMED, struct.pack("<Q", 7), "keys"),
        (L.VERSION_OFF, struct.pack("<Q", 99), "version"),
    ],
)
def test_a_forged_group_header_is_refused_by_every_reader(name, offset, value, match):
    lim = shmlimit.Limiter(name, rates={"a": "10/s", "b": "1/s"})
    lim.close()
    try:
        _forge(name, offset, value)
        with pytest.raises(SegmentError, match=match):
            shmlimit.attach(name)
        with pytest.raises(SegmentError, match=match):
            inspect(name)
        assert listed(name) == [name]  # shown as unreadable, never fatal
        with pytest.raises(SegmentError, match=match):
            collect(name)  # a forged group is no one's to collect: left for unlink
    finally:
        try:
            shmlimit.unlink(name)
        except FileNotFoundError:
            pass


def test_a_truncated_group_is_refused(name):
    lim = shmlimit.Limiter(name, rates={"a": "10/s", "b": "1/s"})
    lim.close()
    try:
        os.truncate(shm_path(name), L.GROUP_HEADER_BYTES + 64)
        with pytest.raises(SegmentError, match="truncated"):
            MultiLimiter(name, None)
        with pytest.raises(SegmentError):
            inspect(name)
    finally:
        shmlimit.unlink(name)
