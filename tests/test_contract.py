"""One contract, every kind: each kind of limiter implements ``shmlimit.RateLimit`` (a keyed kind
through ``lim[key]``), or raises ``shmlimit.UnsupportedError`` for a verb it cannot keep.

Each kind is made at 1 op/s with a burst of 3 (``FAST``: a refusal is then about a second from
any grant, far beyond a test's own delays), or at 10 ops/s with a burst of 1 for the tests that
wait for a real grant (``slow``).  The Redis kinds run on the suite's real redis-server.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import pytest

import shmlimit
from shmlimit import KeyedRateLimit, RateLimit, UnsupportedError

RATE, BURST = 1, 3  # the fast tests' kinds: 1 op/s, 3 at once
SLOW_RATE = 10  # the slow tests' kinds: 10 ops/s, 1 at once
KEYS = 1024


@dataclass
class Kind:
    id: str
    #: (name, rate in ops/s, burst in ops, the Redis server's URL or None) -> a handle
    make: Callable[[str, int, int, Optional[str]], Any]
    #: a call of ``set_rate`` making the rate 2 ops/s (None: the kind raises UnsupportedError)
    set_rate: Optional[Callable[[Any], None]]
    #: what ``stats()`` shows of that change: a function of a snapshot
    seen: Callable[[Any], Any] = lambda s: None
    #: ``seen`` after ``set_rate``
    after: Any = None
    reserve: bool = True  #: False: ``reserve`` raises UnsupportedError
    redis: bool = False  #: needs the Redis server
    leased: bool = False  #: its tokens come from leases (hierarchical mode)


def _rates(rate: int, burst: int) -> list:
    return [(f"{rate}/s", burst), ("6000/min", 500)]  # the second never binds


def _named(rate: int, burst: int) -> dict:
    return {"requests": (f"{rate}/s", burst), "tokens": ("6000/min", 500)}


def _redis_limiter(n, r, b, url):
    from shmlimit.redis.direct import RedisLimiter

    return RedisLimiter(n, rate=r, burst=b, url=url)


def _redis_keyed(n, r, b, url):
    from shmlimit.redis.keyed import RedisKeyedLimiter

    return RedisKeyedLimiter(n, rate=r, burst=b, url=url)["alice"]


KINDS = [
    Kind(
        "limiter",
        lambda n, r, b, url: shmlimit.Limiter(n, rate=r, burst=b),
        lambda h: h.set_rate(2, burst=BURST),
        lambda s: s.rate,
        2.0,
    ),
    Kind(
        "rates-list",
        lambda n, r, b, url: shmlimit.Limiter(n, rates=_rates(r, b)),
        lambda h: h.set_rate("0", 2, burst=BURST),
        lambda s: s.rates["0"].rate,
        2.0,
    ),
    Kind(
        "rates-dict",
        lambda n, r, b, url: shmlimit.Limiter(n, rates=_named(r, b)),
        lambda h: h.set_rate("requests", 2, burst=BURST),
        lambda s: s.rates["requests"].rate,
        2.0,
    ),
    Kind(  # a view's set_rate gives its key a rate of its own: an override
        "keyed",
        lambda n, r, b, url: shmlimit.KeyedLimiter(n, rate=r, burst=b, keys=KEYS)["alice"],
        lambda h: h.set_rate(2, burst=BURST),
        lambda s: s.overrides,
        1,
    ),
    Kind(
        "keyed-rates",
        lambda n, r, b, url: shmlimit.KeyedLimiter(n, rates=_rates(r, b), keys=KEYS)["alice"],
        lambda h: h.set_rate("0", 2, burst=BURST),
        lambda s: s["0"].overrides,
        1,
        reserve=False,
    ),
    Kind("redis", _redis_limiter, None, redis=True),
    Kind("redis-keyed", _redis_keyed, None, redis=True),
    Kind(  # its price of an op is fixed while in use (``Bucket.check_price``): its burst changes
        "hierarchical",
        lambda n, r, b, url: shmlimit.Limiter(n, rate=r, burst=b, upstream=url),
        lambda h: h.set_rate(RATE, burst=2),
        lambda s: s.capacity,
        2.0,
        reserve=False,
        redis=True,
        leased=True,
    ),
]


class Maker:
    """Makes the handles of one kind under the test's name; unlinks and closes them after it."""

    def __init__(self, kind: Kind, name: str, url: Optional[str]) -> None:
        self.kind, self.name, self.url = kind, name, url
        self.made: list = []

    def __call__(self, rate: int = RATE, burst: int = BURST) -> Any:
        h = self.kind.make(self.name, rate, burst, self.url)
        self.made.append(h)
        return h

    def cleanup(self) -> None:
        for h in reversed(self.made):
            try:
                h.unlink()
            except (FileNotFoundError, ValueError):  # gone already; a closed Redis handle
                pass
            (h.limiter if isinstance(h, shmlimit.protocol.KeyView) else h).close()


@pytest.fixture(params=KINDS, ids=[k.id for k in KINDS])
def make(request, name):
    kind = request.param
    url = request.getfixturevalue("redis_server").url if kind.redis else None
    m = Maker(kind, name, url)
    yield m
    m.cleanup()


def _empty(h: Any, kind: Kind, burst: int) -> None:
    """Take a fresh handle's whole burst: ``burst`` grants, then a refusal at once."""
    if kind.leased:  # the burst is the global one in Redis, leased as it is asked for
        for _ in range(burst):
            assert h.acquire(timeout=5.0)
    else:
        assert [h.try_acquire() for _ in range(burst)] == [True] * burst
    t = time.monotonic()
    assert h.try_acquire() is False
    assert time.monotonic() - t < 0.5  # at once: never waits


# ---- the interface ----------------------------------------------------------------------------


def test_every_kind_is_a_rate_limit(make):
    h = make()
    assert isinstance(h, RateLimit)
    assert h.name == make.name and h.closed is False


def test_a_keyed_limiter_is_keyed_and_its_views_are_rate_limits(make):
    h = make()
    if not isinstance(h, shmlimit.protocol.KeyView):
        assert not isinstance(h, KeyedRateLimit)  # no __getitem__: one limit, no keys
        return
    lim = h.limiter
    assert isinstance(lim, KeyedRateLimit) and not isinstance(lim, RateLimit)  # no key: no `with`
    assert h.key == "alice" and isinstance(lim["bob"], RateLimit)


# ---- acquiring --------------------------------------------------------------------------------


def test_try_acquire_grants_the_burst_then_refuses_at_once(make):
    h = make()
    _empty(h, make.kind, BURST)


# how long a refusal takes, in real time (< 0.5 s)
@pytest.mark.slow
def test_a_bad_n_is_refused_alike_by_every_kind_taking_nothing(make):
    h = make()
    for n, exc in (
        (0, ValueError),
        (-1, ValueError),
        (1.5, TypeError),
        (True, TypeError),
        ("1", TypeError),
    ):
        for verb in (h.try_acquire, h.retry_after, lambda n: h.acquire(n, timeout=0)):
            with pytest.raises(exc, match="n must be"):
                verb(n)
    if not make.kind.leased:  # (a hierarchical limiter's tokens come with its leases)
        assert [h.try_acquire() for _ in range(BURST)] == [True] * BURST  # nothing was taken


def test_a_bad_key_is_refused_alike_by_every_keyed_kind_taking_nothing(make):
    """A key is a str with UTF-8 or bytes of at most 4096 (``protocol.key_bytes``), on every keyed
    kind: a lone surrogate (``os.fsdecode``'s) raised a bare UnicodeEncodeError, and the Redis
    kind alone took a ``bytearray``."""
    h = make()
    if not isinstance(h, shmlimit.protocol.KeyView):
        return
    lim = h.limiter
    for key, exc, words in (
        ("\udc80", ValueError, r"key must be .* UTF-8 \(no lone surrogate\)"),
        ("x" * 4097, ValueError, "key must be at most 4096 bytes"),
        (bytearray(b"k"), TypeError, "key must be a str or bytes, not bytearray"),
        (5, TypeError, "key must be a str or bytes, not int"),
    ):
        for verb in (lim.try_acquire, lim.retry_after, lambda k: lim.acquire(k, timeout=0)):
            with pytest.raises(exc, match=words):
                verb(key)
    assert [h.try_acquire() for _ in range(BURST)] == [True] * BURST  # nothing was taken


def test_a_timed_acquire_returns_false_at_once_when_the_wait_exceeds_it(make):
    h = make()
    _empty(h, make.kind, BURST)
    t = time.monotonic()
    assert h.acquire(timeout=0.05) is False  # the next op is about a second away
    assert time.monotonic() - t < 0.5
    t = time.monotonic()
    assert asyncio.run(h.acquire_async(timeout=0.05)) is False
    assert time.monotonic() - t < 0.5


def test_retry_after_is_zero_with_room_and_the_wait_without(make):
    h = make()
    if not make.kind.leased:  # (a hierarchical limiter's room is what its leases brought)
        assert h.retry_after() == 0.0
    _empty(h, make.kind, BURST)
    r = h.retry_after()
    assert 0.0 < r <= 1.0 / RATE + 0.01  # one op's schedule at most
    assert h.retry_after() <= r + 0.001  # it takes nothing (an estimate: within 1 ms)
    assert h.try_acquire() is False


def test_reserve_claims_a_slot_or_is_unsupported(make):
    h = make()
    if not make.kind.reserve:
        with pytest.raises(UnsupportedError, match=r"\.reserve is not supported") as e:
            h.reserve()
        assert e.value.verb == "reserve" and isinstance(e.value, NotImplementedError)
        return
    assert h.reserve() == 0.0  # a full bucket: now
    assert [h.try_acquire() for _ in range(BURST)] == [True] * (BURST - 1) + [False]
    assert h.reserve(max_wait=0.01) is None  # about a second away: refused, nothing taken
    d = h.reserve()
    assert isinstance(d, float) and 0.0 < d <= 1.0 / RATE + 0.01
    assert h.retry_after() > d  # the slot is taken: the next one is later


def test_set_rate_shows_in_stats_or_is_unsupported(make):
    h = make()
    kind = make.kind
    if kind.set_rate is None:
        with pytest.raises(UnsupportedError, match=r"\.set_rate is not supported") as e:
            h.set_rate(2)
        assert e.value.verb == "set_rate"
        assert h.stats() is not None  # a snapshot all the same
        return
    before = kind.seen(h.stats())
    kind.set_rate(h)
    assert before != kind.after and kind.seen(h.stats()) == kind.after


def test_the_context_managers_take_one_op_each(make):
    h = make()
    if make.kind.leased:
        with h:
            pass
        return  # (its room is what its leases brought: counted by the acquires only)

    async def enter_async():
        async with h as got:
            assert got is h

    with h as got:
        assert got is h
    asyncio.run(enter_async())
    assert [h.try_acquire() for _ in range(BURST - 1)] == [True] * (BURST - 2) + [False]


# ---- the handle's life ------------------------------------------------------------------------


def test_close_makes_every_later_call_raise_the_closed_error(make):
    h = make()
    h.close()
    assert h.closed
    for call in (
        h.try_acquire,
        lambda: h.acquire(timeout=0.01),
        lambda: asyncio.run(h.acquire_async(timeout=0.01)),
        h.retry_after,
        h.stats,
    ):
        with pytest.raises(ValueError, match="closed") as e:
            call()
        assert not isinstance(e.value, UnsupportedError)
    h.close()  # twice: nothing more
    assert h.closed


def test_closing_a_view_leaves_its_limiter_and_closing_the_limiter_closes_its_views(make):
    h = make()
    if not isinstance(h, shmlimit.protocol.KeyView):
        pytest.skip("not a keyed kind")
    lim = h.limiter
    h.close()
    assert h.closed and not lim.closed and lim["alice"].try_acquire()
    other = lim["bob"]
    lim.close()
    assert other.closed
    with pytest.raises(ValueError, match="closed"):
        other.try_acquire()


def test_unlink_removes_the_name_and_a_new_handle_starts_afresh(make):
    h = make()
    _empty(h, make.kind, BURST)
    shm = not (make.kind.redis and not make.kind.leased)  # no segment: its keys in Redis
    assert not shm or make.name in {n.split(".")[0] for n in shmlimit.list_names()}
    h.unlink()
    again = make()
    if make.kind.leased:
        assert again.acquire(timeout=5.0)
    else:
        assert [again.try_acquire() for _ in range(BURST)] == [True] * BURST
    again.unlink()
    if not shm:
        return  # its keys are gone (the test below)
    mine = [n for n in shmlimit.list_names() if n.split(".")[0] == make.name]
    assert mine == []  # (a keyed limiter of several rates: every one of its segments)


def test_unlink_of_a_redis_kind_deletes_its_keys(make, redis_server):
    if not (make.kind.redis and not make.kind.leased):
        pytest.skip("not a direct Redis kind")
    h = make()
    lim = h.limiter if isinstance(h, shmlimit.protocol.KeyView) else h
    assert lim["bob"].try_acquire() if make.kind.id == "redis-keyed" else h.try_acquire()
    assert h.try_acquire()
    client = redis_server.client()
    pattern = f"shmlimit:{{{make.name}*"
    assert len(list(client.scan_iter(match=pattern))) == (2 if make.kind.id == "redis-keyed" else 1)
    h.unlink()
    assert list(client.scan_iter(match=pattern)) == []


def test_an_unsupported_verb_names_the_kind_the_verb_and_why():
    e = UnsupportedError("RedisLimiter", "set_rate", "the rate is not stored in Redis")
    assert str(e) == "RedisLimiter.set_rate is not supported: the rate is not stored in Redis"
    assert isinstance(e, shmlimit.ShmlimitError) and isinstance(e, NotImplementedError)
    assert isinstance(e, ValueError)  # what the hierarchical reserve raised before it
    assert (e.kind, e.verb) == ("RedisLimiter", "set_rate")


# ---- real waits -------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_timed_acquire_is_granted_when_the_wait_fits_no_earlier_than_retry_after(make):
    h = make(SLOW_RATE, 1)
    _empty(h, make.kind, 1)
    r = h.retry_after()
    assert 0.0 < r <= 1.0 / SLOW_RATE + 0.01
    t = time.monotonic()
    assert h.acquire(timeout=r + 1.0)
    waited = time.monotonic() - t
    assert waited < r + 1.0
    if not make.kind.leased:  # the next grant comes when retry_after said, not before
        assert waited >= r - 0.005


@pytest.mark.slow
def test_a_timed_acquire_async_is_granted_when_the_wait_fits(make):
    h = make(SLOW_RATE, 1)
    _empty(h, make.kind, 1)
    r = h.retry_after()
    t = time.monotonic()
    assert asyncio.run(h.acquire_async(timeout=r + 1.0))
    waited = time.monotonic() - t
    assert waited < r + 1.0
    if not make.kind.leased:
        assert waited >= r - 0.005
    assert not math.isinf(h.retry_after())
