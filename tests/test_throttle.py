"""The ``@throttle`` decorator (shmlimit/throttle.py): its limiter made on the first call, from
any thread, in a process forked at any time."""

import asyncio
import importlib
import inspect
import os
import threading

import pytest
from support.procs import wait_exit

import shmlimit

# the module: ``shmlimit.throttle`` is the function
T = importlib.import_module("shmlimit.throttle")


def test_a_child_forked_while_a_thread_makes_the_limiter_makes_its_own(name, monkeypatch):
    """A thread makes the limiter on the first call while another forks: the child inherited the
    decorator's creation lock held, and hung for ever on its first call.  The making is held open
    here until the child has run."""
    parent, entered, release = os.getpid(), threading.Event(), threading.Event()
    real = T.Limiter

    def slow_make(*args, **kwargs):
        if os.getpid() == parent:
            entered.set()
            release.wait(30)
        return real(*args, **kwargs)

    f = shmlimit.throttle(name, rate=1000)(lambda: "called")
    monkeypatch.setattr(T, "Limiter", slow_make)
    t = threading.Thread(target=f)
    t.start()
    try:
        assert entered.wait(10)
        pid = os.fork()
        if pid == 0:
            try:
                os._exit(0 if f() == "called" else 1)
            finally:
                os._exit(2)
        status = wait_exit(pid, 10)
    finally:
        release.set()
        t.join(30)
    assert status == 0
    assert f.limiter().stats().grants == 2  # the child's call and the thread's
    f.limiter().close()


def test_threads_racing_to_make_the_limiter_keep_one_and_close_the_others(name, monkeypatch):
    both, made = threading.Barrier(2), []
    real = T.Limiter

    def racing_make(*args, **kwargs):
        both.wait(10)  # each thread has found no limiter yet
        made.append(real(*args, **kwargs))
        return made[-1]

    f = shmlimit.throttle(name, rate=1000)(lambda: "called")
    monkeypatch.setattr(T, "Limiter", racing_make)
    threads = [threading.Thread(target=f) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    kept = f.limiter()
    assert kept in made and len(made) == 2
    assert [h.closed for h in made] == [h is not kept for h in made]
    assert kept.stats().grants == 2
    kept.close()


class _AwaitedOnly:
    """A limiter that grants every op, awaited; a blocking ``acquire`` (on the loop) fails."""

    name = "awaited-only"

    def __init__(self):
        self.taken = 0

    def acquire(self, n=1, timeout=None):
        raise AssertionError("a blocking acquire, on the event loop")

    async def acquire_async(self, n=1, timeout=None):
        self.taken += n
        return True


def test_an_async_generator_awaits_its_ops_on_its_first_iteration():
    """``async def`` with ``yield`` is no coroutine function: it was given the plain wrapper, whose
    blocking acquire held the event loop for the whole wait."""
    lim = _AwaitedOnly()

    @shmlimit.throttle(lim, n=2)
    async def numbers(k):
        """Doc."""
        got = yield k
        yield got

    async def main():
        gen = numbers(5)
        assert lim.taken == 0  # made, not begun: nothing taken yet
        first = await gen.__anext__()
        second = await gen.asend("sent")  # what is sent reaches the generator
        rest = [x async for x in gen]
        return first, second, rest, [x async for x in numbers(1)]

    assert inspect.isasyncgenfunction(numbers) and numbers.__doc__ == "Doc."
    assert asyncio.run(main()) == (5, "sent", [], [1, None])
    assert lim.taken == 4


def test_generators_take_their_ops_on_the_first_next_and_skipped_yield_nothing(name):
    @shmlimit.throttle(name, rate=1, per=60, on_limit="skip")
    def numbers():
        got = yield 1
        yield got

    gen = numbers()
    assert numbers.limiter().stats().grants == 0  # made, not begun
    assert (next(gen), gen.send("sent")) == (1, "sent")
    assert list(numbers()) == []  # skipped: the one op of the minute is taken
    raiser = shmlimit.throttle(numbers.limiter(), on_limit="raise")(numbers.__wrapped__)
    with pytest.raises(shmlimit.RateLimited):
        next(raiser())

    @shmlimit.throttle(numbers.limiter(), on_limit="skip")
    async def later():
        yield "never"

    async def main():
        return [x async for x in later()]

    assert asyncio.run(main()) == []
    assert numbers.limiter().stats().grants == 1
    numbers.limiter().close()


def test_a_keyed_limiter_of_several_rates_is_taken_as_an_instance_with_key(name):
    """``KeyedLimiter(name, rates=...)`` is a ``MultiKeyedLimiter``: refused with ``key=`` (the
    message said a KeyedLimiter was needed), and accepted without it, then every call failed
    (``n`` taken for the key).  A keyed limiter is one of the ``KeyedRateLimit`` protocol."""
    lim = shmlimit.KeyedLimiter(name, rates=["1/min", "100/hour"], keys=64)
    try:
        f = shmlimit.throttle(lim, key=lambda user: user, on_limit="skip")(lambda user: user)
        assert [f("ada"), f("ada"), f("bob")] == ["ada", None, "bob"]
        with pytest.raises(TypeError, match="MultiKeyedLimiter given is keyed: pass key="):
            shmlimit.throttle(lim)
        plain = shmlimit.Limiter(name + "-plain", rate=1)
        with pytest.raises(TypeError, match="key= needs a keyed limiter .*not a Limiter"):
            shmlimit.throttle(plain, key=str)
        plain.close()
        plain.unlink()
    finally:
        lim.close()


@pytest.mark.parametrize(
    "options,param",
    [
        (dict(rate=-1, key=str), "rate"),
        (dict(rate=5, per=0, key=str), "per"),
        (dict(rate=5, keys=-3, key=str), "keys"),
        (dict(rates=["nope"]), "rate spec 'nope'"),
        (dict(rates=["nope"], key=str), "rate spec 'nope'"),
        (dict(rate=5, rates=["5/s"]), "rate= .* or rates="),
        (dict(per=6), "per= apply only when rate= creates"),
        (dict(burst=3), "burst= apply only when rate= creates"),
        (dict(per=6, key=str), "per= apply only when rate= creates"),
        (dict(rate=5, capped="yes"), "capped"),
        (dict(rate=5, slots=0), "slots"),
        (dict(rates=["5/s"], slots=0), "slots"),
        (dict(rate=5, bogus=1), "bogus"),
        (dict(rates=["5/s"], bogus=1), "bogus"),
        (dict(rates=["5/s"], bogus=1, key=str), "bogus"),
    ],
)
def test_bad_options_are_refused_when_decorating_by_the_constructors_checks(name, options, param):
    """Only a single-rate Limiter's rate, per and burst were checked when decorating: a keyed
    limiter's, several rates, options given without rate= and the other options of the limiter
    were refused only at the first call.  Each is refused now as the constructor refuses it, and
    nothing is created."""
    with pytest.raises((TypeError, ValueError), match=param):
        shmlimit.throttle(name, **options)
    assert not [n for n in shmlimit.list_names() if n.startswith(name)]
