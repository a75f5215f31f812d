"""Several rates per key: ``KeyedLimiter(name, rates=[...])`` and ``KeyedLimiter(name, rates={...})``.

A keyed limiter of several rates is one segment under its one name (``group``):
a header naming the rates, then one region per rate, each an ordinary keyed
table (its own GCRA word per key, its own process table), as ``multirate``
holds a ``Limiter`` per rate.  Each region holds every key to its rate
(``rate*T/per + burst`` in any window of T seconds), across every process.
``shmlimit.attach(name)`` returns it, and every tool shows it as one entry (its
rates labelled ``name[key]``).  This module only takes the rates together:

* **All or nothing, now** (``acquire.all_or_nothing``, each rate a ``_KeyRate``).
  A try looks at every rate at one instant (what a take would wait, taking and
  inserting nothing), then takes each, in order, each at the instant of its own
  take; a race undoes the earlier takes (``undo``: exact, when no one took that
  key on that rate since; otherwise the take stays spent -- time lost, never an
  extra grant).
* **What a waiter holds: nothing.**  An ``acquire`` that cannot be granted now
  sleeps until the longest of its rates' waits is over, holding nothing on any
  rate (no GCRA reservation: reserving one rate's slot while sleeping for
  another's would let that slot be used late, bunched with later ones), then
  tries again.  A timed acquire returns False at once when the wait on any
  rate exceeds what is left of its timeout.  There is no queue across rates:
  under contention for one key a waiter may be overtaken (it is never granted
  early).
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable, Iterable, List, Optional, Sequence, Tuple, Union

from shmlimit.acquire import all_or_nothing
from shmlimit.acquire.drivers import Step, drive, drive_async
from shmlimit.adapt import Adapt, per_rate
from shmlimit.config import (
    arguments_checked,
    validate_clock,
    validate_reconfigure,
    validate_timeout,
)
from shmlimit.errors import KeyTableFullError, UnsupportedError
from shmlimit.group import GroupCreation, open_rates
from shmlimit.keyed import cells as KC
from shmlimit.keyed import layout as K
from shmlimit.keyed.adapt import check_start
from shmlimit.keyed.gcra import TICKS_PER_S, make_rate, wait_ticks
from shmlimit.keyed.segment import check_geometry
from shmlimit.protocol import Keyed
from shmlimit.rate_group import (
    RESERVED,
    MultiStats,
    RateGroup,
    parse_rates,
    rates_from_text,
)
from shmlimit.registry import described, pickled
from shmlimit.shm import layout as L
from shmlimit.shm.segment import validate_mode, validate_name, validate_trusted_uids


class MultiKeyedLimiter(RateGroup, Keyed):
    """Several rates per key, taken together; made by ``KeyedLimiter(name, rates=...)`` (see the module).

    ``rates=["10/s", "100/min"]``: every op of a key must fit every rate; ``n``
    ops cost ``n`` on each.  ``rates={"requests": "60/min", "tokens": "10K/min"}``:
    each call says its cost per rate by keyword (``acquire(key, requests=1,
    tokens=500)``; rates not named cost nothing).  ``keys``, ``overrides``,
    ``mode``, ``trusted_uids`` and ``reconfigure`` apply to every rate's
    table.  ``adapt=`` (a dict by rate name, or a list in the rates' order, of
    ``shmlimit.Adapt`` or None) makes those rates adapt each key's rate on
    its own, from the outcomes ``feedback(throttled, key, which=)`` reports to
    them (``keyed.adapt``, in each rate's table).  ``rates=None`` attaches to
    the limiter by its name, its rates as it holds them.  ``clock`` (CLOCK_MONOTONIC nanoseconds, below 2**58) is for tests.
    ``keyed`` is the class of each rate's limiter (``KeyedLimiter``: given
    by it, so that this module never imports it back).
    """

    _what = "keyed limiter"

    def __init__(
        self,
        keyed: Any,
        name: str,
        rates: object,
        keys: int = 100_000,
        *,
        overrides: Optional[int] = None,
        mode: int = 0o600,
        trusted_uids: Iterable[int] = (),
        reconfigure: bool = False,
        clock: Optional[Callable[[], int]] = None,
        adapt: object = None,
    ) -> None:
        validate_name(name)
        validate_mode(mode)
        trusted = validate_trusted_uids(trusted_uids)
        validate_clock(clock)
        self._name, self._mode, self._trusted = name, mode, trusted
        self._keys: Tuple[str, ...] = ()
        self._named = False
        self._clock = clock
        self._keyed = keyed
        self._lims: List[Any] = []  # each rate's KeyedLimiter, on its region of the group
        self._now()  # a clock out of the keyed range is refused before any segment is opened
        create: Optional[GroupCreation] = None
        table = (
            None  # the table asked for: another than the group's is each rate's ConfigMismatchError
        )
        validate_reconfigure(reconfigure, rates is not None, "the rates to apply")
        if rates is None and adapt is not None:
            raise ValueError("adapt needs rates= (the rates every key starts from)")
        if rates is not None:  # None: attach by name, the rates as the limiter holds them
            if isinstance(rates, str):
                rates = rates_from_text(rates)
            # names and values checked as a Limiter's; a rate named "key" could never be costed
            rkeys, _, named = parse_rates(name, rates, RESERVED + ("key",))
            values = list(rates.values()) if named else list(rates)  # type: ignore[union-attr, call-overload]
            table = check_geometry(
                keys,
                K.default_overrides(keys)
                if overrides is None and isinstance(keys, int)
                else overrides,
            )
            made = []
            for v in values:
                rate, burst = v if isinstance(v, tuple) else (v, None)
                made.append(make_rate(rate, 1.0, burst))
            adapts: Tuple[Optional[Adapt], ...] = ()
            if adapt is not None:
                adapts = per_rate(adapt, rkeys, named, made, check_start)
                if not table.overrides:
                    raise ValueError(
                        "adapt needs overrides= > 0: each key's adapted rate is its override"
                    )
            create = GroupCreation(
                tuple(made),
                rkeys,
                named,
                mode,
                K.PSLOTS,
                L.REGIONS_KEYED,
                (table.keys, table.overrides),
                adapts,
            )

        arguments_checked()

        # create the group or open it, then attach to every rate's table (all again, if a
        # collector took a region meanwhile)
        def attach(i: int, label: str, opener: Callable[[], Any]) -> None:
            rate, each = (None, ()) if create is None else (create.rates[i], create.adapts)
            lim = self._keyed._region(
                label, rate, table, mode, trusted, reconfigure, opener, each[i] if each else None
            )
            self._lims.append(lim)

        args = (name, create, mode, trusted, time.monotonic_ns, L.REGIONS_KEYED)
        group = open_rates(*args, attach, self.close)
        self._keys, self._named = group.keys, group.named

    # -- identity and lifecycle ----------------------------------------------------------

    @property
    def closed(self) -> bool:
        return not self._lims

    def _live(self) -> List[Any]:
        if not self._lims:
            raise ValueError(f"keyed limiter {self._name!r} is closed in this process")
        return self._lims

    def close(self) -> None:
        """Detach this handle from every rate.  The segment stays (use ``unlink``)."""
        lims, self._lims = self._lims, []
        for lim in lims:
            lim.close()

    def __reduce__(self):
        return pickled(self, _unpickle, self._keyed)

    def _now(self) -> int:
        """Now in the tables' ticks; ValueError for a reading past what a key's words hold (an
        injected clock: over it, every key looked evicted, and every call was granted)."""
        ns = (self._clock or time.monotonic_ns)()
        if ns >= K.MAX_NOW_NS:
            raise ValueError(
                f"clock must return nanoseconds below 2**58 for a keyed limiter, got {ns}"
            )
        return ns << K.TICK_SHIFT

    # -- the protocol ----------------------------------------------------------------------

    def _rates(self, key: object, ops: Tuple[int, ...]) -> List["_KeyRate"]:
        """Each rate's part of a call for ``ops`` of ``key``, looked at at one instant."""
        now = self._now()
        return [_KeyRate(self, lim, key, o, now) for lim, o in zip(self._live(), ops) if o]

    def try_acquire(self, key: object, n: int = 1, **costs: int) -> bool:
        """Take the ops of ``key`` from every rate only if all have them now; never waits.

        False takes nothing (a race's earlier takes are undone, or stay spent
        when another caller took that key since): when any rate is short, when
        a cost exceeds a rate's burst, or when the key is new and a table has
        no slot for it.
        """
        return all_or_nothing.take_all(self._rates(key, self._ops(n, costs))) is None

    def _deadline(self, timeout: Optional[float]) -> Optional[int]:
        t = validate_timeout(timeout)
        if t is None:
            return None
        return self._now() + wait_ticks(t)

    def acquire(
        self, key: object, n: int = 1, timeout: Optional[float] = None, **costs: int
    ) -> bool:
        """Take the ops of ``key`` from every rate, waiting until all allow them; True once granted.

        While it waits it holds nothing.  With ``timeout`` (seconds): False,
        taking nothing, as soon as the wait on any rate exceeds what is left of
        it.  Untimed, a cost above a rate's burst raises ``ValueError`` and a
        full table ``KeyTableFullError``; timed, both return False.
        """
        return drive(_Tries(self, key, self._ops(n, costs), self._deadline(timeout)))

    async def acquire_async(
        self, key: object, n: int = 1, timeout: Optional[float] = None, **costs: int
    ) -> bool:
        """``acquire`` for asyncio: waits on the event loop, never blocking it."""
        return await drive_async(_Tries(self, key, self._ops(n, costs), self._deadline(timeout)))

    #: How ``acquire`` sleeps a nap (seconds); tests on an injected clock move the clock instead.
    _sleep = staticmethod(time.sleep)

    def reserve(
        self, key: object, n: int = 1, max_wait: Optional[float] = None, **costs: int
    ) -> Optional[float]:
        """Not supported (``UnsupportedError``): a slot claimed on each rate at once would be used
        late on every rate but the slowest, bunched with later ones (see the module)."""
        self._live()  # closed first: ValueError, as every call of a closed handle
        raise UnsupportedError(
            "KeyedLimiter(rates=...)",
            "reserve",
            "a key's rates cannot promise one slot together: a slot reserved on a rate while "
            "waiting for another's is used late, bunched with later ones; use acquire(timeout=...)",
        )

    def retry_after(self, key: object, n: int = 1, **costs: int) -> float:
        """Seconds until the ops of ``key`` could be granted on every rate (0.0: now; inf: never).  Takes nothing."""
        looks = [r.look() for r in self._rates(key, self._ops(n, costs))]
        return max(looks, default=0) / TICKS_PER_S

    # -- the adaptive rates, per key ---------------------------------------------------------

    def feedback(
        self,
        throttled: bool,
        key: object,
        which: Union[str, int, Sequence[Union[str, int]], None] = None,
    ) -> bool:
        """Report one outcome of an op on ``key`` to the rates that adapt (``adapt=``), for every
        process: each rate adapts each key on its own (``keyed.adapt``, in that rate's table).

        ``throttled=True``: the upstream refused it for its rate (an HTTP 429 or 503); False: it
        answered.  The outcome goes to every rate that adapts, or with ``which`` (a rate's name
        or index, or a list of them) to those only.  False when a rate's table had no override
        entry free for the key (that rate keeps its rate for it; the others counted).
        """
        if not isinstance(throttled, bool):
            raise TypeError(f"throttled must be True or False, got {throttled!r}")
        lims = self._live()
        chosen = self._told(which, [i for i, lim in enumerate(lims) if lim.adaptive])
        clock = self._clock or time.monotonic_ns
        counted = [lims[i]._report(throttled, key, clock) for i in chosen]
        return all(counted)

    @property
    def adaptive(self) -> bool:
        """Some rate adapts each key's rate (created with ``adapt=``)."""
        return any(lim.adaptive for lim in self._live())

    def override(self, which: Union[str, int], key: object) -> Optional[Tuple[float, float, float]]:
        """``(rate, per, burst)`` of ``key``'s own rate on one rate (by name or index), or None
        when it follows that rate's default: an adapting key's rate in force."""
        return self._live()[self._index(which)].override(key)

    # -- live changes and observation ------------------------------------------------------

    def set_rate(
        self,
        which: Union[str, int],
        rate: Any,
        per: Optional[float] = None,
        burst: Optional[float] = None,
        key: object = None,
    ) -> None:
        """Change one rate (by name or index) for every key, or with ``key`` for that key only
        (see ``KeyedLimiter.set_rate``); every attached process, at once."""
        self._live()[self._index(which)].set_rate(rate, per, burst, key=key)

    def stats(self) -> MultiStats:
        """Every rate's ``KeyedStats``, by its key (reads only)."""
        return MultiStats(self._name, {k: lim.stats() for k, lim in zip(self._keys, self._live())})

    def __repr__(self) -> str:
        head = f"shmlimit.KeyedLimiter {self._name!r}"
        if not self._lims:
            return f"<{head} rates={list(self._keys)} closed>"
        return described(head, self._described)

    def _described(self) -> str:
        parts = " ".join(
            f"{k}={s.rate:g}/{s.per:g}s(capacity={s.capacity:g} keys={s.keys}/{s.slots} grants={s.grants})"
            for k, s in self.stats().items()
        )
        return f"{parts} per key backend={self._live()[0].backend}"


class _KeyRate:
    """One rate's part of a keyed call (``all_or_nothing.Rate``): a GCRA take of the key's ops on
    that rate's table, undone exactly when no one took the key there since (``undo``)."""

    __slots__ = ("group", "lim", "key", "ops", "now")

    def __init__(self, group: MultiKeyedLimiter, lim: Any, key: object, ops: int, now: int) -> None:
        self.group, self.lim, self.key, self.ops, self.now = group, lim, key, ops, now

    def look(self) -> float:
        """A peek at the group's one instant (ticks; inf: the ops exceed the burst)."""
        w = self.lim._live().kt.acquire(self.key, self.ops, -1, self.now)
        return math.inf if w == KC.NEVER else w

    def take(self) -> Any:
        kt = self.lim._use().kt  # a use: a forked child registers on its first
        # Each take reads the clock itself (on the real clock, inside the native call): the
        # look's reading may be long past (the GIL given to another thread, the process off the
        # CPU), and a take priced then would record a grant made now as made then, handing the
        # key's room back early by that much.  A later reading never refuses what the look
        # allowed, but for another caller's take since (a race, undone as any).
        g = self.group
        r = kt.take(self.key, self.ops, 0, None if g._clock is None else g._now())
        return r if isinstance(r, int) else (kt, r)  # an int: a race, or no slot for a new key

    def undo(self, taken: Any) -> None:
        kt, r = taken
        kt.undo(r[1], r[2], r[3], r[4], self.ops)

    def count(self) -> None:
        """(The take counted, on its table; an undo uncounts.)"""


class _Tries:
    """A keyed acquire of several rates as the drivers run it (``acquire.drivers.Steps``): a try on
    every rate, then, while one is short, a nap holding nothing of the longest wait a look found."""

    wake_ns: Optional[int] = None

    def __init__(
        self, lim: MultiKeyedLimiter, key: object, ops: Tuple[int, ...], deadline: Optional[int]
    ) -> None:
        self.lim, self.key, self.ops, self.deadline = lim, key, ops, deadline
        self.clock = lim._clock or time.monotonic_ns
        self.nap = lim._sleep

    def begin(self) -> Step:
        """True (granted on every rate), False (refused for good, or no time left for the next
        try; an untimed call raises instead), else the seconds to nap before the next try.  An
        insert of the key stalled by another live process (``KC.BUSY``, after the take waited
        ``KC.PEND_NS`` for it) refuses a timed call, as one rate's does; an untimed one naps
        ``KC.BUSY_NAP`` and tries again."""
        lim = self.lim
        # refused: the longest wait a look found (ticks; inf: never), or a take's code (a race:
        # at once; KC.FULL: no slot for a new key; KC.BUSY: a stalled insert of the key)
        w = all_or_nothing.take_all(lim._rates(self.key, self.ops))
        if w is None:
            return True
        if w == KC.BUSY:
            return KC.BUSY_NAP if self.deadline is None else False
        if w in (math.inf, KC.FULL):  # it never can be: False when timed, else raise
            if self.deadline is not None:
                return False
            if w == KC.FULL:
                raise KeyTableFullError(lim._name, lim._lims[0].slots)
            bursts = {k: r.capacity for k, r in zip(lim._keys, lim._lims)}
            shown = dict(zip(lim._keys, self.ops))
            raise ValueError(f"the ops {shown} exceed a rate's burst ({bursts})")
        w = max(w, 1)  # (a race's code: at once)
        if self.deadline is not None and lim._now() + w > self.deadline:
            return False
        return w / TICKS_PER_S

    next = begin

    def end(self) -> None:
        pass

    def wait_native(self) -> None:
        return None


def _unpickle(
    name: str, keyed: Any, *, mode: int, trusted_uids: Tuple[int, ...]
) -> MultiKeyedLimiter:
    """A pickled handle (``registry.pickled``): attached by name, the rates as the limiter holds
    them (as ``KeyedLimiter``'s is)."""
    return MultiKeyedLimiter(keyed, name, None, mode=mode, trusted_uids=trusted_uids)
