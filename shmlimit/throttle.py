"""``@throttle``: the distributed-throttle seed's decorator, on a shared limiter.

    @shmlimit.throttle("partner", rate=1, per=6)                  # wait for a slot
    def call_partner(): ...

    @shmlimit.throttle("partner", rate=1, per=6, on_limit="skip")  # return None instead
    async def poll(): ...

The limiter is created (or attached) on the first call, not at import, so
decorating a function at module level has no side effect until it runs, and
``fork``/``spawn`` children attach on their own first call.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Optional, TypeVar, Union

from shmlimit.config import check_arguments, validate_n, validate_timeout
from shmlimit.errors import RateLimited
from shmlimit.keyed.limiter import KeyedLimiter
from shmlimit.limiter import Limiter
from shmlimit.protocol import KeyedRateLimit

F = TypeVar("F", bound=Callable[..., Any])
ON_LIMIT = ("wait", "skip", "raise")


def throttle(
    limiter: Union[str, Any],
    rate: Union[float, str, None] = None,
    per: float = 1.0,
    burst: Optional[float] = None,
    *,
    on_limit: str = "wait",
    max_wait: Optional[float] = None,
    n: int = 1,
    key: Optional[Callable[..., Any]] = None,
    **limiter_options: Any,
) -> Callable[[F], F]:
    """Rate-limit every call of the decorated function (plain or ``async def``) by ``n`` ops;
    a generator's (plain or async) are taken on its first ``next()``.

    ``limiter`` is a limiter name (created with ``rate``/``per``/``burst``
    and ``limiter_options`` on first use, or attached when ``rate`` is None),
    or an existing ``Limiter`` or ``shmlimit.redis.direct.RedisLimiter``.

    ``on_limit`` says what a call does when its ops are not available:

    * ``"wait"``: wait for them; with ``max_wait`` (seconds), raise
      ``RateLimited`` at once when the wait would be longer.
    * ``"skip"``: return None without calling the function (when the ops
      cannot be had within ``max_wait``, default 0: right now).
    * ``"raise"``: raise ``RateLimited`` carrying ``retry_after`` (seconds)
      instead of calling (same ``max_wait`` rule as skip).

    With ``key`` (a callable taking the decorated function's arguments and
    returning a str or bytes), each call is limited per key: ``limiter`` is
    then a keyed limiter (a ``KeyedRateLimit``: a ``KeyedLimiter``, of one
    rate or several, or a ``RedisKeyedLimiter``) or the name of a
    ``KeyedLimiter`` (created on first use, with ``limiter_options`` such as
    ``keys=``).
    """
    if on_limit not in ON_LIMIT:
        raise ValueError(f"on_limit must be one of {', '.join(ON_LIMIT)}, got {on_limit!r}")
    max_wait = validate_timeout(max_wait, "max_wait")
    validate_n(n, 1)
    if key is not None and not callable(key):
        raise TypeError(
            f"key must be a callable taking the function's arguments, not {type(key).__name__}"
        )
    keyed = key is not None
    if isinstance(limiter, str):
        name = limiter
        # refused now what the first call's construction would refuse (nothing is opened yet)
        check_arguments(
            KeyedLimiter if keyed else Limiter, name, rate, per, burst, **limiter_options
        )
    elif rate is not None or per != 1.0 or burst is not None or limiter_options:
        given = [
            p
            for p, v in (("rate", rate), ("per", per != 1.0 or None), ("burst", burst))
            if v is not None
        ]
        raise TypeError(
            f"{', '.join(given + sorted(limiter_options))}: these configure a limiter made by name; "
            f"the {type(limiter).__name__} given is configured already (see its set_rate)"
        )
    elif keyed != isinstance(limiter, KeyedRateLimit):
        raise TypeError(
            f"key= needs a keyed limiter (or a name), not a {type(limiter).__name__}"
            if keyed
            else f"the {type(limiter).__name__} given is keyed: pass key= (a callable taking "
            "the function's arguments and returning the key)"
        )
    elif all(hasattr(limiter, a) for a in ("acquire", "acquire_async", "name")):
        name = limiter.name
    else:
        raise TypeError(
            f"limiter must be a name or a Limiter/RedisLimiter, not {type(limiter).__name__}"
        )
    timeout = max_wait if (on_limit == "wait" or max_wait is not None) else 0.0
    made: dict = {} if isinstance(limiter, str) else {"lim": limiter}

    def get() -> Any:
        # No lock: a thread forking while another held one making the limiter would leave the
        # child's copy held for ever.  Opening by name is idempotent: threads that race each open
        # a handle, the first stored is kept (setdefault is atomic), the others are closed.
        lim = made.get("lim")
        if lim is None:
            new = (KeyedLimiter if keyed else Limiter)(name, rate, per, burst, **limiter_options)
            lim = made.setdefault("lim", new)
            if lim is not new:
                new.close()
        return lim

    def ask(args: Any, kwargs: Any) -> tuple:
        """What a call asks of the limiter: ``(key, n)`` keyed, else ``(n,)``."""
        return (key(*args, **kwargs), n) if keyed else (n,)  # type: ignore[misc]

    def refused(lim: Any, asked: tuple) -> bool:
        """A call whose ops were not had: False to skip it, or ``RateLimited`` raised."""
        if on_limit == "skip":
            return False
        retry = getattr(lim, "retry_after", None)
        raise RateLimited(name, retry(*asked) if callable(retry) else None)

    def taken(args: Any, kwargs: Any) -> bool:
        """Whether a call runs: its ops taken, waiting as ``on_limit`` says."""
        lim = get()
        asked = ask(args, kwargs)
        return lim.acquire(*asked, timeout=timeout) or refused(lim, asked)

    async def taken_async(args: Any, kwargs: Any) -> bool:
        """``taken``, awaited: the event loop runs on meanwhile."""
        lim = get()
        asked = ask(args, kwargs)
        return await lim.acquire_async(*asked, timeout=timeout) or refused(lim, asked)

    def decorate(fn: F) -> F:
        # A generator's ops are taken when its body would begin, on the first next(), not when
        # it is made: skipped, it yields nothing.
        if inspect.isasyncgenfunction(fn):

            @functools.wraps(fn)
            async def async_gen_wrapper(*args: Any, **kwargs: Any) -> Any:
                if not await taken_async(args, kwargs):
                    return
                gen = fn(*args, **kwargs)
                try:  # what ``yield from`` does for a generator: sent and thrown in passed on
                    item = await gen.__anext__()
                    while True:
                        try:
                            sent = yield item
                        except GeneratorExit:
                            await gen.aclose()
                            raise
                        except BaseException as e:
                            item = await gen.athrow(e)
                        else:
                            item = await gen.asend(sent)
                except StopAsyncIteration:
                    return

            wrapper: Any = async_gen_wrapper
        elif inspect.iscoroutinefunction(fn):

            @functools.wraps(fn)
            async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
                return await fn(*args, **kwargs) if await taken_async(args, kwargs) else None

            wrapper = async_wrapper
        elif inspect.isgeneratorfunction(fn):

            @functools.wraps(fn)
            def gen_wrapper(*args: Any, **kwargs: Any) -> Any:
                if taken(args, kwargs):
                    return (yield from fn(*args, **kwargs))

            wrapper = gen_wrapper
        else:

            @functools.wraps(fn)
            def plain_wrapper(*args: Any, **kwargs: Any) -> Any:
                return fn(*args, **kwargs) if taken(args, kwargs) else None

            wrapper = plain_wrapper
        wrapper.limiter = get
        return wrapper  # type: ignore[no-any-return]

    return decorate
