"""``KeyedLimiter``: thousands of independent limits, one per key, in one shared-memory segment.

Each key (a str or bytes: a client IP, an API key, a domain) has its own GCRA
state -- one theoretical-arrival-time word in a 64-byte slot -- so there is no
filler thread per key.  Slots are found by a keyed 128-bit digest of the key
under a per-segment random secret, within a bounded window of slots; a key
whose bucket is full again holds no information and its slot may be reused,
while a key that is still limited is never evicted (see ``keyed_cells``).

Data flows one way: KeyedLimiter -> keyed_gcra (config, overrides) and the
atomic layer's keyed composite (``keyed_cells`` / the native ``KeyedTable``)
-> cells -> segment.
"""

from __future__ import annotations

import math
import mmap
import os
import time
import weakref
from typing import TYPE_CHECKING, Any, Callable, Dict, Optional, Tuple, Union, overload

from shmlimit.acquire.drivers import Step, drive, drive_async
from shmlimit.adapt import Adapt
from shmlimit.adapt import describe as describe_adapt
from shmlimit.adapt import write as write_adapt
from shmlimit.config import (
    arguments_checked,
    carried_per,
    creation_only,
    validate_reconfigure,
    validate_timeout,
)
from shmlimit.errors import ConfigMismatchError, KeyTableFullError
from shmlimit.keyed import cells as KC
from shmlimit.keyed import layout as K
from shmlimit.keyed.adapt import check_rate
from shmlimit.keyed.adapt import check_start as check_keyed_adapt
from shmlimit.keyed.adapt import read as read_keyed_adapt
from shmlimit.keyed.adapt import report as report_outcome
from shmlimit.keyed.gcra import (
    TICKS_PER_S,
    Overrides,
    Rate,
    config_lock,
    make_rate,
    publish_default,
    read_default,
    wait_ticks,
)
from shmlimit.keyed.segment import (
    Geometry,
    check_geometry,
    open_keyed,
)
from shmlimit.keyed.stats import (
    KeyedProcess,
    KeyedStats,
    KeySample,
    inspect_keyed,
    sample_keys,
    snapshot_of,
)
from shmlimit.protocol import Keyed
from shmlimit.rate_group import AdaptRates, Rates, RatesSwitch, group_options
from shmlimit.registry import Attached, Handle, Registry, attach, attaching, described, pickled
from shmlimit.shm.cells import Cells
from shmlimit.shm.segment import (
    Segment,
    validate_mode,
    validate_name,
    validate_trusted_uids,
)

__all__ = [
    "KeyedLimiter",
    "KeyedProcess",
    "KeyedStats",
    "KeySample",
    "attach_keyed",
    "inspect_keyed",
    "sample_keys",
]


class _Closed:
    """An attachment's keyed composite before its first join and once shut: every use refuses."""

    def __getattr__(self, name: str) -> Any:
        raise ValueError("keyed limiter is closed in this process")


_CLOSED = _Closed()


class _Attachment(Attached):
    """One process's mapping of one keyed segment, shared by all its handles (``Attached``): its
    keyed composite (``kt``), bound to this process's slot."""

    what = "keyed limiter"

    def __init__(
        self,
        name: str,
        seg: Segment,
        cells: Cells,
        geo: Geometry,
        secret: Tuple[int, int],
        flags: int = KC.FLAG_EVICT,
    ) -> None:
        super().__init__(name, seg, cells, K.PSLOTS)
        self.geo = geo
        self.flags = flags  #: ``keyed_cells.table_flags``: this process's when_full and store_keys
        self.overrides = Overrides(cells, geo.overrides, geo.probe)
        self.secret = secret  #: the hash's (k0, k1), from the segment's secret file
        self.kt: Any = _CLOSED
        #: Every handle on this attachment in this process: after fork, the child points their
        #: ``try_acquire`` back at the slow path (``KeyedLimiter._use``), which registers on the
        #: first call.
        self.handles: "weakref.WeakSet[KeyedLimiter]" = weakref.WeakSet()

    def _table(self, grants: int, pid: int) -> Tuple[Any, ...]:
        """The keyed composite's arguments over this mapping: grants counted at ``grants``, keys
        inserted as ``pid``."""
        g, (k0, k1) = self.geo, self.secret
        return (
            K.CFG_SEQ,
            K.OVR_LIVE,
            K.overrides_offset(),
            g.overrides,
            K.slots_offset(g.overrides),
            g.keys,
            g.probe,
            k0,
            k1,
            K.KEYS_LIVE,
            K.EVICTED,
            K.REFUSED,
            grants,
            K.owner(pid),
            K.CUT,
            self.flags,
        )

    def bind(self) -> None:
        """The keyed composite bound to this process's slot (made at the first join).

        In a forked child the same object is rebound at once, not at the first
        use (so every handle's bound calls follow): it must insert keys as
        *this* pid, so that an insert this child dies in the middle of is
        reclaimed by the next inserter (the parent, still alive, would make the
        slot look held forever); and its grants must not land in the parent's slot.
        """
        grants = K.UNREG_GRANTS if self.slot is None else K.HEADER_BYTES + self.slot * K.LINE + 16
        if self.kt is _CLOSED:
            _prefault(self.seg)
            self.kt = self.cells.keyed_table(*self._table(grants, self.pid))
        else:
            self.kt.rebind(grants, K.owner(self.pid))

    def reference(self) -> KC.KeyedTable:
        """The keyed composite in Python over this mapping (either backend's cells), inserting as
        this process: for the step the native one does not have (``push``)."""
        return KC.KeyedTable(
            self.cells, *self._table(K.UNREG_GRANTS, os.getpid())
        )  # grants nothing

    def after_fork_in_child(self) -> None:
        super().after_fork_in_child()
        for h in list(self.handles):
            h.__dict__.pop("try_acquire", None)  # back to the class's method: the slow path

    def shut(self) -> None:
        self.kt = _CLOSED
        super().shut()


#: madvise(MADV_POPULATE_WRITE), Linux 5.14+: map every page of the table now (about 12 ms per
#: 50 MB), so that a new key's first use pays no page fault (about a third of its cost).
_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)


def _prefault(seg: Segment) -> None:
    try:
        seg.mm.madvise(_POPULATE_WRITE)
    except (OSError, ValueError, AttributeError):  # an older kernel: pages fault in on first use
        pass


registry: Registry[_Attachment] = Registry()


def _open(
    name: str,
    rate: Optional[Rate],
    geo: Optional[Geometry],
    mode: int,
    trusted: frozenset,
    reconfigure: bool = False,
    flags: Optional[int] = None,
    opener: Optional[Callable[[], Tuple[Segment, Cells]]] = None,
    adapt: Optional[Adapt] = None,
) -> _Attachment:
    """This process's attachment to the keyed segment ``name``, with one more handle counted.

    With ``opener`` (a rate's region of a group: ``group.region_opener``), ``name`` only labels
    the table, and the region is validated as a keyed segment's header is."""

    def make() -> Optional[_Attachment]:
        opened = open_keyed(name, K.KIND_GCRA, geo, rate, mode, trusted, adapt, opener)
        return opened and _Attachment(name, *opened, KC.FLAG_EVICT if flags is None else flags)

    def adopt(att: _Attachment) -> None:  # as attachment.adopt_config
        if rate is not None and not att.created:
            _adopt(att, rate, geo, reconfigure, adapt)

    def check(att: _Attachment) -> None:
        if flags is not None and att.flags != flags:
            raise ValueError(
                f"keyed limiter {name!r} is open in this process with other when_full/store_keys"
            )
        if reconfigure and rate is not None:
            _adopt(att, rate, geo, True, adapt)
        _check(name, att, rate, geo, adapt)

    def new() -> _Attachment:
        return attach(name, make, adopt, lambda att: _check(name, att, rate, geo, adapt))

    return registry.open(name, new, check, mode, trusted)


def _adopt(
    att: _Attachment,
    rate: Rate,
    geo: Optional[Geometry],
    reconfigure: bool,
    adapt: Optional[Adapt] = None,
) -> None:
    """Publish ``rate`` as the default, and ``adapt`` as the keys' parameters, if no live process
    uses the segment (or ``reconfigure``).

    The same rule as a ``Limiter``'s (``attachment.adopt_config``): a
    redeploy with a changed rate boots.  The geometry (keys, overrides) is
    the segment's size and never changes: a different one stays a mismatch.
    Keys keep the rates they learned (clamped to new bounds as they next decide).
    """
    same = read_default(att.cells) == rate and read_keyed_adapt(att.cells) == adapt
    if same or (geo is not None and geo != att.geo):
        return
    if att.may_adopt(reconfigure):
        write_adapt(att.cells, adapt, K.ADAPT_PARAMS, config_lock(att.cells))
        publish_default(att.cells, rate)


def _check(
    name: str,
    att: _Attachment,
    rate: Optional[Rate],
    geo: Optional[Geometry],
    adapt: Optional[Adapt] = None,
) -> None:
    if rate is None:
        return
    have = read_keyed_adapt(att.cells)
    if have != adapt:
        raise ConfigMismatchError(name, describe_adapt(have), describe_adapt(adapt), live=True)
    cur = read_default(att.cells)
    if cur != rate or (geo is not None and geo != att.geo):
        raise ConfigMismatchError(
            name,
            f"{cur.describe()} keys={att.geo.keys} overrides={att.geo.overrides}",
            f"{rate.describe()} keys={geo.keys if geo else att.geo.keys} overrides={geo.overrides if geo else att.geo.overrides}",
            live=geo is None or geo == att.geo,  # only the rate can be reconfigured
        )


#: The longest pause (seconds): a wait the keyed schedule can hold (``MAX_WAIT`` ticks, 2.3 years).
MAX_PAUSE = KC.MAX_WAIT / TICKS_PER_S


class _Due:
    """A keyed ``acquire`` as the drivers run it (``acquire.drivers.Steps``): one call that takes
    the key's ops (reserving its slot) or refuses, then a wait to the instant they are due.  A
    wait that ends ungranted (cancelled, interrupted) gives the take back if no one took the key
    since (``undo``: exact, so never an extra grant); else the ops stay spent."""

    wake_ns: Optional[int] = None
    clock = staticmethod(time.monotonic_ns)
    taken: Optional[Tuple[Any, Tuple[int, ...]]] = None  # (table, what ``undo`` needs) while due

    def __init__(self, lim: "KeyedLimiter", key: object, n: int, timeout: Optional[float]):
        self.lim, self.key, self.n, self.timeout = lim, key, n, timeout

    def begin(self) -> Step:
        """Take the ops (True: now; seconds: due then, ``wake_ns`` set), or refuse (False; an
        untimed call raises instead).  An insert of the key stalled by another live process
        (``BUSY``) is looked at again after ``KC.BUSY_NAP`` by an untimed call."""
        t, lim = self.timeout, self.lim
        kt = lim._use().kt
        r = kt.take(self.key, self.n, KC.MAX_WAIT if t is None else wait_ticks(t))
        if not isinstance(r, int):
            r, self.taken = r[0], (kt, r[1:]) if r[0] > 0 else None
        if r == KC.BUSY and t is None:
            return KC.BUSY_NAP
        if r < 0:
            if t is None:
                lim._untimed_failure(r, self.key, self.n)
            return False
        if r == 0:
            return True
        self.wake_ns = time.monotonic_ns() + (r >> K.TICK_SHIFT) + 1
        return (self.wake_ns - time.monotonic_ns()) / 1e9

    def next(self) -> Step:
        if self.wake_ns is None:  # a nap after BUSY: ask again
            return self.begin()
        left = self.wake_ns - time.monotonic_ns()
        if left <= 0:
            self.taken = None  # granted: the ops are the caller's
            return True
        return left / 1e9

    def end(self) -> None:
        if self.taken is not None:
            kt, (slot, ctrl, tat, cost) = self.taken
            self.taken = None
            kt.undo(slot, ctrl, tat, cost, self.n)

    def wait_native(self) -> None:
        return None


class KeyedLimiter(RatesSwitch, Keyed, Handle):
    """One rate limit per key -- ``rate`` ops per ``per`` seconds for each -- shared by every process.

    ``KeyedLimiter(name, rate=10, per=1.0, burst=None, keys=100_000)``
    creates the segment, or attaches if it exists with the same configuration
    (a different one raises ``ConfigMismatchError``; without ``rate`` it
    attaches to whatever is there, and refuses with ``ValueError`` the options
    that configure a new one: ``per``, ``burst``, ``keys``, ``overrides``).  ``rate`` may be a rate string such as
    ``"10/s"`` or ``"600/min"`` (it sets ``per`` too).  A different default
    rate is taken when no live process uses the segment (a redeploy), or with
    ``reconfigure=True`` (every attached process at once, as ``set_rate``).
    ``burst`` is each key's capacity in ops
    (default: 10 ms of schedule, at least one op).  ``keys`` is the number of
    64-byte key slots: size it for the keys that may be *limited at the same
    time*; a key whose bucket is full again gives its slot up.  ``overrides``
    bounds the per-key rates set with ``set_rate(..., key=)``; ``mode`` is the
    segment's permission bits.  ``when_full``: "evict" (default) lets a new key
    take the slot of its window's least valuable key when none is free (that key
    is then as new: it gains at most the debt its entry held, the least of its
    window); "refuse" refuses the new key (``KeyTableFullError``) instead.
    ``store_keys`` keeps each key's first 15 bytes for ``top``; by default no
    key bytes are stored.  Both are this process's (unset: as this process already has the
    table open, else "evict" and no keys): give the same in every process.

    A key is a ``str`` (its UTF-8 bytes) or ``bytes``, at most 4096 bytes.
    Per key, grants in any window of T seconds never exceed
    ``rate*T/per + capacity``, across every attached process.

    ``KeyedLimiter(name, rates=["10/s", "600/h"])`` (or a dict of named
    rates, each call naming its costs) holds every key to several rates at
    once, all or nothing: see ``keyed_multi``.

    ``adapt=shmlimit.Adapt(min_rate=..., max_rate=...)`` makes each key's rate adaptive on its
    own (per host, for a crawler): ``rate`` is where every key starts, and outcomes reported by
    ``feedback(throttled, key)`` (the HTTP transports report theirs) move that key's override,
    once per window for every process (``keyed.adapt``).

    ``lim[key]`` is one key's limit as a ``shmlimit.RateLimit`` (``shmlimit.protocol``).
    """

    what = "keyed limiter"
    _registry = registry

    @classmethod
    def _several(
        cls,
        name: str,
        rates: Any,
        rate: Any,
        per: Any,
        burst: Any,
        args: Tuple[Any, ...],
        kwargs: Dict[str, Any],
    ) -> Any:
        """``KeyedLimiter(name, rates=...)``: several rates per key (``keyed.multi``), one segment."""
        from shmlimit.keyed.multi import MultiKeyedLimiter

        return MultiKeyedLimiter(
            cls,
            name,
            rates,
            **group_options(
                rate,
                per,
                burst,
                args,
                kwargs,
                ("keys", "overrides", "mode", "trusted_uids", "reconfigure", "clock", "adapt"),
                one="one rate per key",
                example="['10/s', ('600/min', 20)]",
            ),
        )

    # To a type checker, ``rates=`` makes a ``MultiKeyedLimiter`` (as ``Limiter.__init__`` says).
    @overload
    def __init__(
        self,
        name: str,
        rate: Any = None,
        per: float = 1.0,
        burst: Optional[float] = None,
        keys: int = 100_000,
        *,
        overrides: Optional[int] = None,
        mode: int = 0o600,
        trusted_uids: Any = (),
        reconfigure: bool = False,
        rates: None = None,
        when_full: Optional[str] = None,
        store_keys: Optional[bool] = None,
        adapt: Optional[Adapt] = None,
    ) -> None: ...
    @overload
    def __init__(  # type: ignore[misc]  # (self: see the comment above)
        self: _SeveralKeyedRates,
        name: str,
        *,
        rates: Rates,
        keys: int = 100_000,
        overrides: Optional[int] = None,
        mode: int = 0o600,
        trusted_uids: Any = (),
        reconfigure: bool = False,
        adapt: AdaptRates = None,
    ) -> None: ...
    def __init__(
        self,
        name: str,
        rate: Any = None,
        per: float = 1.0,
        burst: Optional[float] = None,
        keys: int = 100_000,
        *,
        overrides: Optional[int] = None,
        mode: int = 0o600,
        trusted_uids: Any = (),
        reconfigure: bool = False,
        rates: Optional[Rates] = None,
        when_full: Optional[str] = None,
        store_keys: Optional[bool] = None,
        adapt: Union[Adapt, AdaptRates] = None,
    ) -> None:
        validate_name(name)
        validate_reconfigure(reconfigure, rate is not None, "the default rate to apply")
        geo = check_geometry(
            keys,
            K.default_overrides(keys) if overrides is None and isinstance(keys, int) else overrides,
        )
        r = None if rate is None else make_rate(rate, per, burst)
        if adapt is not None:
            if not isinstance(adapt, Adapt):
                raise TypeError(f"adapt must be a shmlimit.Adapt or None, got {adapt!r}")
            if r is None:
                raise ValueError("adapt needs rate= (the rate every key starts from)")
            check_keyed_adapt(adapt, r)
            if not geo.overrides:
                raise ValueError(
                    "adapt needs overrides= > 0: each key's adapted rate is its override"
                )
        if rate is None:
            creation_only(
                per=per != 1.0,
                burst=burst is not None,
                keys=keys != 100_000,
                overrides=overrides is not None,
            )
        validate_mode(mode)
        flags = (  # None: as this process already has the table open, else "evict", no keys
            None
            if when_full is None and store_keys is None
            else KC.table_flags(when_full or "evict", False if store_keys is None else store_keys)
        )
        trusted = validate_trusted_uids(trusted_uids)
        arguments_checked()
        with attaching(r is None):
            att = _open(
                name,
                r,
                geo if r is not None else None,
                mode,
                trusted,
                reconfigure,
                flags,
                adapt=adapt,
            )
        self._attach(name, mode, trusted, att)

    def _attach(self, name: str, mode: int, trusted: frozenset, att: _Attachment) -> None:
        self._name, self._mode, self._trusted = name, mode, trusted
        self._att = att
        att.handles.add(self)
        if att.joined:
            self._bind_fast(att)

    @classmethod
    def _region(
        cls,
        label: str,
        rate: Optional[Rate],
        geo: Optional[Geometry],
        mode: int,
        trusted: frozenset,
        reconfigure: bool,
        opener: Callable[[], Tuple[Segment, Cells]],
        adapt: Optional[Adapt] = None,
    ) -> "KeyedLimiter":
        """A handle on one rate's table of a keyed limiter of several rates (``keyed.multi``):
        its region of the group, opened by ``opener``, labelled ``label`` (``name[key]``); with
        ``rate``, ``adapt`` is the one its table must hold (its keys' adaptive rate, or None)."""
        self = super().__new__(cls)
        self._att = None
        self._attach(
            label,
            mode,
            trusted,
            _open(label, rate, geo, mode, trusted, reconfigure, None, opener, adapt),
        )
        return self

    def _bind_fast(self, att: _Attachment) -> None:
        # The hot path without a Python frame: the native composite's own try_acquire, bound to
        # this attachment (rebound in place after fork; it refuses to run once the cells are
        # closed).  A forked child's handles lose it until the child registers (``_use``).
        self.try_acquire = att.kt.try_acquire  # type: ignore[method-assign]

    def _use(self) -> _Attachment:
        """The live attachment, this process registered in it (a forked child's first use registers)."""
        att = self._live()
        if not att.joined:
            att.use()
        if att.joined and "try_acquire" not in self.__dict__ and self._att is att:
            self._bind_fast(att)
        return att

    # -- identity and lifecycle ----------------------------------------------------

    @property
    def slots(self) -> int:
        """Key slots in the table."""
        return self._live().geo.keys

    #: the attachment (ValueError once closed): the same for reading and for a use (which
    #: registers a forked child's process: ``_use``)
    _live = Handle._peek

    def _rate(self) -> Rate:
        return read_default(self._live().cells)

    @property
    def rate(self) -> float:
        """The default rate: ops per ``per`` seconds, for every key without an override."""
        return self._rate().rate

    @property
    def per(self) -> float:
        """Seconds."""
        return self._rate().per

    @property
    def capacity(self) -> float:
        """Each key's default burst (ops)."""
        return self._rate().burst

    def close(self) -> None:
        """Detach this handle.  The segment stays (use ``unlink``); other processes are unaffected."""
        self.__dict__.pop("try_acquire", None)
        super().close()

    def __reduce__(self):
        # this process's when_full and store_keys too (None: a closed handle, opened as attach is)
        return pickled(self, _unpickle, None if self._att is None else self._att.flags)

    # -- acquiring ---------------------------------------------------------------------

    def _call(self, key: object, n: int, max_wait: int) -> int:
        return self._use().kt.acquire(key, n, max_wait)

    def _call_untimed(self, key: object, n: int) -> int:
        """An untimed call: a key whose insert another live process has stalled (``KC.BUSY``) is
        tried again until that process moves on or dies (a try or a timed call refuses instead)."""
        while (r := self._call(key, n, KC.MAX_WAIT)) == KC.BUSY:
            time.sleep(KC.BUSY_NAP)
        return r

    def try_acquire(self, key: object, n: int = 1) -> bool:
        """Take ``n`` ops for ``key`` only if they are available now; never waits.

        False (taking nothing) when the key is limited, when ``n`` exceeds the
        key's capacity, or when the key is new and the table has no slot for it
        (counted in ``stats().refused_full``).  A new key whose insert another
        live process has left half-done (stopped mid-insert) is refused after
        0.2 s of waiting for it, not waited for without end.
        """
        # (a handle of a registered process calls the native one directly: this is the slow path)
        return self._use().kt.try_acquire(key, n)

    def reserve(self, key: object, n: int = 1, max_wait: Optional[float] = None) -> Optional[float]:
        """Claim ``n`` ops for ``key`` and return the seconds to wait before using them (0.0: now).

        None, taking nothing, when the wait would exceed ``max_wait`` (seconds)
        or the table has no slot for a new key; untimed, a full table raises
        ``KeyTableFullError`` and an ``n`` above the capacity ``ValueError``.
        """
        mw = validate_timeout(max_wait, "max_wait")
        r = self._call_untimed(key, n) if mw is None else self._call(key, n, wait_ticks(mw))
        if r >= 0:
            return r / TICKS_PER_S
        if mw is None:
            self._untimed_failure(r, key, n)
        return None

    def _untimed_failure(self, r: int, key: object, n: int) -> None:
        if r == KC.FULL:
            raise KeyTableFullError(self._name, self.slots)
        if r == KC.NEVER:
            att = self._live()  # the key's capacity: its override's, else the default's
            rate = att.overrides.get(att.kt.digest(key)) or read_default(att.cells)
            raise ValueError(f"n must be at most this key's capacity ({rate.burst:g} ops), got {n}")
        raise ValueError(f"the wait for n={n} exceeds {KC.MAX_WAIT / TICKS_PER_S:.0f} s")

    def acquire(self, key: object, n: int = 1, timeout: Optional[float] = None) -> bool:
        """Take ``n`` ops for ``key``, waiting as needed; True once granted.

        With ``timeout`` (seconds) it returns False at once, taking nothing,
        when the wait the key's schedule implies exceeds it, or when the key is
        new and the table is full (or its insert is held by a process stopped
        midway, for 0.2 s).  Untimed, a full table raises ``KeyTableFullError``
        and ``n`` above the key's capacity ``ValueError``; a stalled insert of the
        same key is waited for, interruptibly.
        """
        return drive(_Due(self, key, n, validate_timeout(timeout)))

    async def acquire_async(self, key: object, n: int = 1, timeout: Optional[float] = None) -> bool:
        """``acquire`` for asyncio: waits on the event loop, never blocking it.

        A waiter cancelled after its ops were taken gives them back if no one took the key
        since (the key then as if it never asked); else it spends them unused (handing them
        back behind a later caller would let that caller's successor in early).
        """
        return await drive_async(_Due(self, key, n, validate_timeout(timeout)))

    def retry_after(self, key: object, n: int = 1) -> float:
        """Seconds until ``n`` ops could be granted for ``key`` (0.0 if now; inf if never).  Takes nothing.

        For a key without a slot in a full table: 0.0 when a new key takes the slot of another
        (``when_full="evict"``), else the seconds until a slot frees.
        """
        r = self._call(key, n, -1)
        att = self._live()
        if r == 0 and not att.flags & KC.FLAG_EVICT:
            # an absent key peeks as 0: refused in a full window, it waits for the first slot to
            # free (evicting, as this process's table does by default, it takes one at once)
            r = att.reference().vacancy(att.kt.digest(key), time.monotonic_ns() << K.TICK_SHIFT)
        return math.inf if r == KC.NEVER else r / TICKS_PER_S

    def own_wait(self, key: object, n: int = 1) -> float:
        """Seconds until ``key``'s own schedule could grant ``n`` ops (0.0 if now; inf if never).
        Takes nothing.

        Unlike ``retry_after``, a key without a slot answers 0.0 however full the table: its
        schedule is empty (a pause table asks whether a host is paused, not whether it could
        get a slot).
        """
        r = self._call(key, n, -1)
        return math.inf if r == KC.NEVER else r / TICKS_PER_S

    def pause(self, key: object, seconds: float) -> bool:
        """Grant ``key`` nothing for ``seconds`` from now, in every process: one move of its schedule.

        Constant work whatever the rate, burst and pause.  A later end already
        set stays (pauses told at once do not add up, and none is shortened);
        after the pause the key's ops resume at its rate, without a burst.
        The pause is a move of the key's schedule, priced at its rate now: a
        ``set_rate`` that lowers the key's price meanwhile ends it sooner, by
        the difference of one op's time, as it would for any other key's wait.
        Nothing counts as a grant.  False (nothing written) when the key is new
        and the table has no slot for it, or its insert is held by a stalled process.
        """
        if (
            isinstance(seconds, bool)
            or not isinstance(seconds, (int, float))
            or not 0 <= seconds <= MAX_PAUSE
        ):
            raise ValueError(
                f"seconds must be a number of seconds from 0 to {MAX_PAUSE:.0f}, got {seconds!r}"
            )
        att = self._use()
        now = time.monotonic_ns() << K.TICK_SHIFT
        return att.reference().push(key, now + wait_ticks(seconds), now) == 0

    # -- configuration -------------------------------------------------------------------

    def set_rate(
        self,
        rate: Any,
        per: Optional[float] = None,
        burst: Optional[float] = None,
        key: object = None,
    ) -> None:
        """Change the default rate of every key, or (with ``key``) give one key a rate of its own.

        Applies from the next call in every attached process.  ``rate`` may be
        a rate string (``"10/s"``, ``"600/min"``: it sets ``per`` too).  ``per``
        defaults to the current value, ``burst`` to the default for the new
        rate.  A key's override lives in a table of its own (``overrides=``
        entries), so it survives the key's eviction; ``remove_override``
        drops it.  Each key keeps its level (seconds of schedule), cut to the
        new burst, as a ``Limiter``'s bucket does: only new grants are priced
        by the new rate.
        """
        att = self._live()
        cur = read_default(att.cells)
        adapt = read_keyed_adapt(att.cells)
        if per is None:  # a rate string "N/unit" carries its window
            per = carried_per(rate)
        d = None if key is None else att.kt.digest(key)
        # the rate in force: the key's override, else (and for the default) the default
        old = (None if d is None else att.overrides.get(d)) or cur
        new = make_rate(rate, old.per if per is None else per, burst)
        if adapt is not None:
            check_rate(adapt, old, new)
        if d is None:
            publish_default(att.cells, new)
        else:
            att.overrides.set(d, new)

    # -- the adaptive rate, per key -------------------------------------------------------

    def feedback(self, throttled: bool, key: object) -> bool:
        """Report one outcome of an op on ``key`` to its adaptive rate (``adapt=``), for every
        process: each key adapts on its own (``keyed.adapt``).

        ``throttled=True``: the upstream refused it for its rate (an HTTP 429 or 503); False: it
        answered.  A fetch-add in the key's override entry; the report that finds the key's
        window over decides it, once.  False (nothing counted) when the key has no override and
        the table has none free near it: it keeps its rate.
        """
        if not isinstance(throttled, bool):
            raise TypeError(f"throttled must be True or False, got {throttled!r}")
        return self._report(throttled, key, time.monotonic_ns)

    def _report(self, throttled: bool, key: object, clock: Callable[[], int]) -> bool:
        """``feedback`` on ``clock`` (CLOCK_MONOTONIC ns; a keyed limiter of several rates may run
        on an injected clock)."""
        att = self._use()
        adapt = read_keyed_adapt(att.cells)
        if adapt is None:
            raise ValueError(
                f"feedback() needs a keyed limiter created with adapt=; {self._name!r} does not adapt"
            )
        return report_outcome(att, adapt, att.kt.digest(key), throttled, clock)

    @property
    def adaptive(self) -> bool:
        """Each key adapts its rate (created with ``adapt=``)."""
        return self._live().cells.load(K.ADAPT_PARAMS[1]) != 0

    def override(self, key: object) -> Optional[Tuple[float, float, float]]:
        """``(rate, per, burst)`` of ``key``'s own rate, or None when it follows the default."""
        att = self._live()
        r = att.overrides.get(att.kt.digest(key))
        return None if r is None else (r.rate, r.per, r.burst)

    def remove_override(self, key: object) -> bool:
        """Make ``key`` follow the default rate again, keeping its level as ``set_rate`` does; False
        if it had no override."""
        att = self._live()
        return att.overrides.remove(att.kt.digest(key))

    # -- observation ---------------------------------------------------------------------

    def stats(self) -> KeyedStats:
        """A snapshot of the table and its counters (reads only; never a scan of the key slots)."""
        att = self._live()
        return snapshot_of(self._name, att.cells, att.geo, att.seg.size)

    def __repr__(self) -> str:
        head = f"shmlimit.KeyedLimiter {self._name!r}"
        return f"<{head} closed>" if self._att is None else described(head, self._described)

    def _described(self) -> str:
        s = self.stats()
        return (
            f"rate={s.rate:g}/{s.per:g}s capacity={s.capacity:g} per key "
            f"keys={s.keys}/{s.slots} evicted={s.evicted} refused_full={s.refused_full} grants={s.grants} "
            f"overrides={s.overrides} processes={len(s.processes)} backend={s.backend}"
        )


if TYPE_CHECKING:  # pragma: no cover
    from shmlimit.keyed.multi import MultiKeyedLimiter

    class _SeveralKeyedRates(MultiKeyedLimiter, KeyedLimiter):  # type: ignore[misc]
        """What ``KeyedLimiter(name, rates=...)`` is to a type checker: a ``MultiKeyedLimiter``."""


def attach_keyed(name: str) -> KeyedLimiter:
    """Attach to an existing keyed limiter by name, whatever its configuration."""
    return KeyedLimiter(name)


def _unpickle(name: str, flags: Optional[int], mode: int, trusted_uids: Any) -> KeyedLimiter:
    """A pickled ``KeyedLimiter`` opened again, with the options of the process that pickled it
    (``flags``: ``when_full`` and ``store_keys``, each process's own)."""
    if flags is None:
        return KeyedLimiter(name, mode=mode, trusted_uids=trusted_uids)
    return KeyedLimiter(
        name,
        mode=mode,
        trusted_uids=trusted_uids,
        when_full="evict" if flags & KC.FLAG_EVICT else "refuse",
        store_keys=bool(flags & KC.FLAG_STORE_KEYS),
    )
