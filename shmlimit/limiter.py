"""The public ``Limiter``: one rate limit shared by every process that attaches to a name.

A handle is thin: every call goes through this process's ``Attachment`` to a
name (shared by all its handles), whose ``Bucket`` is the only code that
touches the rovers.  Acquiring is a ``Request`` of the acquisition core, run
by its sync driver (``acquire``) or its asyncio driver (``acquire_async``).
"""

from __future__ import annotations

import random
import time
from typing import (
    TYPE_CHECKING,
    Any,
    Callable,
    Dict,
    Iterable,
    Optional,
    Tuple,
    Union,
    overload,
)

from shmlimit import live_changes
from shmlimit.acquire import single as acquisition
from shmlimit.acquire.drivers import drive, drive_async
from shmlimit.acquire.single import (
    MAX_NAP,
    Request,
    give_back_handed,
    give_back_unowned,
    wait_for_ticket,
)
from shmlimit.adapt import Adapt
from shmlimit.adapt import feedback as adapt_feedback
from shmlimit.attachment import Attachment, FastPaths, check_upstream, open_attachment, registry
from shmlimit.config import (
    Config,
    arguments_checked,
    creation_only,
    validate_clock,
    validate_n,
    validate_reconfigure,
    validate_timeout,
)
from shmlimit.header import Creation
from shmlimit.protocol import AcquireOnEnter
from shmlimit.rate_group import AdaptRates, Rates, RatesSwitch, group_options
from shmlimit.redis.option import Upstream, resolve_upstream
from shmlimit.redis.spec import DEFAULT_BATCH_SECONDS, DEFAULT_LEASE_TTL, UpstreamSpec
from shmlimit.registry import Handle, attaching, described, pickled
from shmlimit.shm import layout as L
from shmlimit.shm.segment import unlink as _unlink_name
from shmlimit.shm.segment import validate_mode, validate_name, validate_slots, validate_trusted_uids
from shmlimit.stats import Stats, snapshot

if TYPE_CHECKING:  # pragma: no cover
    from shmlimit.multirate import MultiLimiter

_INF = float("inf")
_ONE = 1  # `n is _ONE`: the cheapest test that n is the int 1 (True is not)


class Limiter(RatesSwitch, AcquireOnEnter, Handle):
    """A rate limit of ``rate`` ops per ``per`` seconds shared by every process using ``name``.

    ``Limiter(name, rate=..., per=1.0, burst=None)`` creates the limiter, or
    attaches to it if it exists with the same configuration (a different one
    raises ``ConfigMismatchError``).  Without ``rate`` (or ``upstream``) it only
    attaches, to the limiter as it is (``LimiterNotFoundError`` if there is
    none), and refuses with ``ValueError`` the options that configure a new one
    (``per``, ``burst``, ``ratio``, ``max_reserved``, ``max_behind``,
    ``capped``, ``initial``, ``slots``) rather than dropping them.  ``rate`` may be a rate string
    ``"N/unit"`` (``"10/s"``, ``"50/5s"``, ``"200K/min"``: it sets ``per``
    too), or a rate spec string such as ``"12K,1.1"`` (rate 12000, catch-up
    ratio 1.1).  ``burst`` is the
    bucket capacity in ops (default: 10 ms of schedule, at least one op).

    Keyword-only options: ``ratio`` (catch-up, >= 1.0; default 1.0 = off),
    ``max_behind`` (seconds of schedule the waiting pool may hold; default
    unbounded), ``max_reserved`` (seconds of schedule callers may queue
    ahead; default unbounded), ``capped`` (capped release, see ``release``),
    ``mode`` (the segment's permission bits, default 0o600), ``initial``
    (ops in the bucket at creation; default full), ``slots`` (process table
    size, default 128).

    Trust: a segment that already exists is used only if it is owned by this
    process's user, by root, or by a uid in ``trusted_uids``, and is not
    writable by group or others beyond ``mode``; otherwise
    ``UntrustedSegmentError`` (a ``PermissionError``) names its owner and mode.
    So ``Limiter(name, rate=5)`` never silently joins a segment another user
    created first under that name.  To share a limiter with a group, create
    and attach it with ``mode=0o660`` (and ``trusted_uids=`` naming the
    creator's uid in the other users' processes).  See SECURITY.md.

    Hierarchical mode (one limit across hosts): ``upstream`` is a Redis URL
    (the global limit then has this limiter's name, rate, per and burst) or
    a ``shmlimit.redis.direct.RedisLimiter`` (whose config is the default for this
    one's).  The elected filler leases batches from it; ``lease_ttl``
    (seconds a leased token stays usable, default 0.1), ``batch_seconds``
    (the demand a batch covers, default 0.02) and ``on_redis_error``
    (``"closed"``, the default, ``"local"`` or ``"open"``) are described in
    ``shmlimit.redis.feeder`` and docs/kinds/redis.md.  Its rate is fixed while in use
    (``set_rate`` changes its burst only).

    A new configuration for an existing segment: if no live process uses
    it (a redeploy after the old fleet stopped, killed or not), it takes the
    new configuration, keeping its counts.  With live processes
    ``ConfigMismatchError`` is raised, unless ``reconfigure=True``, which
    applies it to every attached process at once, as ``set_rate`` does.

    ``clock`` is this process's CLOCK_MONOTONIC source in nanoseconds
    (default ``time.monotonic_ns``): tests inject a fake one to drive every
    schedule step by step.  All the handles of a name in a process share it.

    ``adapt=shmlimit.Adapt(min_rate=..., max_rate=...)`` makes the rate adaptive: ``rate`` is
    where it starts (a limiter created again on the name starts from the rate learned), outcomes
    reported by ``feedback`` (the HTTP transports report theirs) move it, once per window for the
    whole fleet, within the bounds (``shmlimit.adapt``).

    ``rates=["5000/h", "100/min"]`` or ``rates={"requests": "500/min",
    "tokens": "200K/min"}`` (instead of ``rate``) makes a limiter of several
    rates taken together, all or nothing (``shmlimit.multirate.MultiLimiter``); with
    ``adapt={"requests": shmlimit.Adapt(...)}`` (a list for a list of rates) each rate named
    adapts on its own, within its own bounds.

    A Limiter pickles as its name, ``mode`` and ``trusted_uids``: a child process that unpickles
    it attaches to the same segment, trusting it as this one did.  One inherited through ``fork`` works as well: the
    child registers itself as its own process.
    """

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
        """``Limiter(name, rates=...)``: a limiter of several rates (multirate.py), one segment."""
        from shmlimit.multirate import MultiLimiter

        return MultiLimiter(
            name,
            rates,
            **group_options(
                rate,
                per,
                burst,
                args,
                kwargs,
                ("mode", "slots", "trusted_uids", "clock", "adapt"),
                one="one rate",
                example="['5000/h', ('100/min', 20)]",
                drop_none=True,
            ),
        )

    # To a type checker, ``rates=`` makes a ``MultiLimiter`` (``RatesSwitch.__new__``): mypy reads
    # a class's signature from its ``__init__``, whose ``self`` must be a ``Limiter``, so the
    # overload with ``rates=`` declares one that is both (``_SeveralRates``, for type checkers only).
    @overload
    def __init__(
        self,
        name: str,
        rate: Union[float, str, None] = None,
        per: float = 1.0,
        burst: Optional[float] = None,
        *,
        ratio: Optional[float] = None,
        max_reserved: Optional[float] = None,
        max_behind: Optional[float] = None,
        capped: bool = False,
        mode: int = 0o600,
        initial: Optional[float] = None,
        slots: int = L.DEFAULT_SLOTS,
        upstream: Union[str, Upstream, None] = None,
        on_redis_error: str = "closed",
        lease_ttl: float = DEFAULT_LEASE_TTL,
        batch_seconds: float = DEFAULT_BATCH_SECONDS,
        trusted_uids: Iterable[int] = (),
        clock: Optional[Callable[[], int]] = None,
        reconfigure: bool = False,
        adapt: Optional[Adapt] = None,
        rates: None = None,
    ) -> None: ...
    @overload
    def __init__(  # type: ignore[misc]  # (self: see the comment above)
        self: _SeveralRates,
        name: str,
        *,
        rates: Rates,
        mode: int = 0o600,
        slots: int = L.DEFAULT_SLOTS,
        trusted_uids: Iterable[int] = (),
        clock: Optional[Callable[[], int]] = None,
        adapt: AdaptRates = None,
    ) -> None: ...
    def __init__(
        self,
        name: str,
        rate: Union[float, str, None] = None,
        per: float = 1.0,
        burst: Optional[float] = None,
        *,
        ratio: Optional[float] = None,
        max_reserved: Optional[float] = None,
        max_behind: Optional[float] = None,
        capped: bool = False,
        mode: int = 0o600,
        initial: Optional[float] = None,
        slots: int = L.DEFAULT_SLOTS,
        upstream: Union[str, Upstream, None] = None,
        on_redis_error: str = "closed",
        lease_ttl: float = DEFAULT_LEASE_TTL,
        batch_seconds: float = DEFAULT_BATCH_SECONDS,
        trusted_uids: Iterable[int] = (),
        clock: Optional[Callable[[], int]] = None,
        reconfigure: bool = False,
        adapt: Union[Adapt, AdaptRates] = None,
        rates: Optional[Rates] = None,
    ) -> None:
        validate_name(name)
        validate_reconfigure(
            reconfigure, rate is not None or upstream is not None, "the configuration to apply"
        )
        trusted = validate_trusted_uids(trusted_uids)
        desc = None
        if upstream is not None:
            rate, per, burst, desc = resolve_upstream(
                name, rate, per, burst, upstream, on_redis_error, lease_ttl, batch_seconds
            )
            if capped or (ratio is not None and ratio != 1.0):
                raise ValueError(
                    "capped and ratio are not supported with upstream= (hierarchical mode)"
                )
        cfg = (
            None
            if rate is None
            else Config.make(
                rate,
                per,
                burst,
                capped,
                ratio,
                max_reserved,
                max_behind,
                plain=None if upstream is None else "a Limiter with upstream=",
            )
        )
        if adapt is not None:
            if not isinstance(adapt, Adapt):
                raise TypeError(f"adapt must be a shmlimit.Adapt or None, got {adapt!r}")
            if cfg is None:
                raise ValueError("adapt needs rate= (the rate it starts from)")
            if upstream is not None:
                raise ValueError(
                    "adapt is not supported with upstream= (the upstream sets the rate)"
                )
            if burst is not None:
                raise ValueError(
                    "burst cannot be combined with adapt: the capacity follows the rate "
                    "(10 ms of schedule, at least one op)"
                )
            adapt.check(cfg)
        if rate is None:
            creation_only(
                per=per != 1.0,
                burst=burst is not None,
                ratio=ratio is not None,
                max_reserved=max_reserved is not None,
                max_behind=max_behind is not None,
                capped=capped is not False,
                initial=initial is not None,
                slots=slots != L.DEFAULT_SLOTS,
            )
        validate_mode(mode)
        if initial is not None:
            if (
                isinstance(initial, bool)
                or not isinstance(initial, (int, float))
                or not 0 <= initial < float("inf")
            ):
                raise ValueError(f"initial must be a finite number of ops >= 0, got {initial!r}")
        validate_slots(slots)
        clock = validate_clock(clock)
        arguments_checked()
        self._name = name
        self._mode = mode
        self._trusted = trusted
        create = None if cfg is None else Creation(cfg, mode, initial, slots, desc, adapt)
        with attaching(create is None):
            self._att = open_attachment(name, create, mode, trusted, clock, reconfigure)
        self._fast = self._att.fast

    # -- identity and lifecycle ----------------------------------------------------

    @property
    def config(self) -> Config:
        """The live configuration (changes made by any process show here)."""
        b = self._peek().bucket
        b.refresh()
        return b.config

    @property
    def rate(self) -> float:
        """Ops per ``per`` seconds."""
        return self.config.rate

    @property
    def per(self) -> float:
        """Seconds."""
        return self.config.per

    @property
    def capacity(self) -> float:
        """Ops the bucket holds at most (the burst)."""
        return self.config.burst

    def _live(self) -> Attachment:
        """The attachment, for a use: the first one in this process registers it and starts its filler."""
        att = self._peek()
        if not att.in_use:
            att.use()
        return att

    def close(self) -> None:
        """Detach this handle.  The segment stays (use ``unlink``); other processes are unaffected."""
        self._fast = FastPaths()
        super().close()

    def __reduce__(self):
        # The trust travels with the handle: the unpickling process vets the segment the same way.
        # A hierarchical handle also carries the upstream its process configured (secrets
        # included), so a pool worker that unpickles it may feed as its parent would.
        return pickled(self, _unpickle, None if self._att is None else self._att.feed_spec)

    # -- acquiring -------------------------------------------------------------------
    #
    # Every acquire is a ``Request`` of the acquisition core; these methods only park it.

    def acquire(self, n: int = 1, timeout: Optional[float] = None) -> bool:
        """Take ``n`` ops, waiting as needed; return True once they are granted.

        With ``timeout`` (seconds), return False at once, taking nothing, when
        the wait the current schedule implies exceeds it.  Untimed, a request
        larger than the capacity queues and is granted once that much schedule
        time has accrued; timed, it is granted only if that fits the timeout.
        With ``max_reserved`` set, an untimed acquire waits (taking nothing)
        until the queue is short enough to join.
        """
        # The fast paths: one op, the config unchanged -- a single native call.
        if n is _ONE:
            try:  # (a handler raising as the call returns a queued ticket: see give_back_handed)
                if timeout is None:
                    grab = self._fast.grab
                    ticket = grab()
                    if ticket is None:
                        return True
                else:
                    grab = self._fast.within
                    ticket = grab(timeout)
                    if ticket is False or ticket is True:  # refused first: mostly refusals
                        return ticket
            except BaseException:
                give_back_handed(self._att)
                raise
            if ticket is not False and ticket is not None:  # (a fast path: a live attachment)
                try:  # (from the store of the ticket on: no call between that could raise)
                    self._att.cells.handed()  # stored: this call's own
                    return wait_for_ticket(self._live(), ticket, timeout)
                except BaseException:
                    give_back_unowned(self._att, ticket)
                    raise
        return drive(Request(self._live(), n, timeout))

    def try_acquire(self, n: int = 1) -> bool:
        """Take ``n`` ops only if they are available now; never waits.  False takes nothing.

        ``n`` larger than the capacity can never succeed.
        """
        if n is _ONE:  # the fast path: one native call, granted or refused
            # read, then called: ``.try_now()`` would be a method lookup, never specialised for a slot
            try_now = self._fast.try_now
            granted = try_now()
            if granted is not None:
                return granted
        return acquisition.try_acquire(self._live(), n)

    def reserve(self, n: int = 1, max_wait: Optional[float] = None) -> Optional[float]:
        """Claim the next slot for ``n`` ops; return the seconds to wait before using it.

        0.0 means now.  Returns None, taking nothing, when the wait would
        exceed ``max_wait`` (seconds) or the limiter-wide ``max_reserved``.
        The caller owns the slot once this returns a number: it is granted
        (and counted) whether or not the caller uses it.  While the limiter is
        stopped the wait is not computable: a bounded reservation returns None,
        an unbounded one returns ``math.inf``.  A capped limiter with no room
        among its ops in flight returns None.  Not available in hierarchical
        mode (ValueError).  A wait longer than a reservation can be held (twice the longest
        queue's schedule at the rate: reached only where a capacity under two fill intervals
        slows the head) is a ValueError, taking nothing.
        """
        return acquisition.reserve(self._live(), n, max_wait)

    def retry_after(self, n: int = 1) -> float:
        """Seconds until ``n`` ops could be granted to a new caller at the current rate (0.0: now)."""
        return acquisition.retry_after(self._live(), n)

    def acquire_with_backoff(self, n: int = 1, timeout: Optional[float] = None) -> bool:
        """The pessimistic mode: ``try_acquire``, and on refusal sleep a random share of the wait, then retry.

        Takes no place in the queue while backing off.  Each sleep is uniform in
        [0.5, 1.5] times the current ``retry_after`` (at least 0.1 ms), so
        processes that were refused together do not retry together.  Returns
        False, having taken nothing, once ``timeout`` seconds have passed.  A
        try never takes more than the capacity (with catch-up, its room too):
        such an ``n`` returns False at once, or untimed raises ``ValueError``.
        """
        timeout = validate_timeout(timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if self.try_acquire(n):
                return True
            most = acquisition.most_a_try_takes(self._live(), n)
            if most is not None:  # never: timed, False at once; untimed, as a capped acquire
                if deadline is None:
                    raise ValueError(
                        f"n must be at most {most} ops, the most a try of {self._name!r} can take "
                        f"(acquire queues for more), got {n}"
                    )
                return False
            nap = max(1e-4, self.retry_after(n) if not self._live().mode_now().stopped else MAX_NAP)
            nap = min(MAX_NAP, nap) * random.uniform(0.5, 1.5)
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                nap = min(nap, left)
            time.sleep(nap)

    def drain(self) -> int:
        """Take every whole op available now (counted as granted to this process); return how many.

        Queued callers are untouched: a drain never cancels or jumps reservations.
        """
        att = self._live()
        b = att.bucket
        b.refresh()
        b.replenish()
        return b.take_available(att.grants_off)

    def release(self, n: int = 1) -> None:
        """Capped mode: report ``n`` completed ops, letting ``n`` more be replenished.

        With ``capped=True`` every acquire first takes a place among the ops
        in flight, counted in ops: at most ``capacity`` (whole) ops are ever
        granted and not yet released, whatever ``set_rate``, ``stop``,
        ``restart`` or catch-up do to the tokens, and grants still never exceed
        the rate.  A downstream that stops completing stops the grants.
        Releasing more ops than are in flight raises ValueError and changes
        nothing.
        """
        att = self._live()
        b = att.bucket
        b.refresh()
        if not b.capped:
            raise ValueError(
                f"release() needs a limiter created with capped=True; {self._name!r} is not capped"
            )
        b.release(validate_n(n, b.cost))

    # -- the adaptive rate ---------------------------------------------------------------

    def feedback(self, throttled: bool) -> None:
        """Report one outcome of an op to an adaptive limiter (``adapt=``), for every process.

        ``throttled=True``: the upstream refused it for its rate (an HTTP 429 or 503); False:
        it answered.  One atomic add in the segment; the report that finds the window over
        decides it, once for every process (``shmlimit.adapt``).
        """
        if not isinstance(throttled, bool):
            raise TypeError(f"throttled must be True or False, got {throttled!r}")
        att = self._peek()
        if not adapt_feedback(att.bucket, throttled, att.clock):
            raise ValueError(
                f"feedback() needs a limiter created with adapt=; {self._name!r} does not adapt"
            )

    @property
    def adaptive(self) -> bool:
        """The limiter adapts its rate (created with ``adapt=``)."""
        return self._peek().cells.load(L.ADAPT_MAX) != 0

    # -- live changes ------------------------------------------------------------------

    def set_rate(
        self,
        rate: Union[float, str],
        per: Optional[float] = None,
        burst: Optional[float] = None,
        *,
        ratio: Optional[float] = None,
    ) -> None:
        """Change the limit for every attached process, at once, without re-attaching.

        ``rate`` may be a rate string, ``"200K/min"`` (which sets ``per`` too),
        or a spec ``"12K,1.1"``.

        ``per`` and ``ratio`` default to their current values; ``burst`` to the
        default for the new rate, as in the constructor.  Ops already granted
        stay granted and queued callers keep their place; new grabs pay the new
        price, and a capacity that shrinks takes effect at once (tokens beyond
        it are dropped).  Re-applying the current config changes nothing.  A hierarchical
        limiter's rate is fixed while in use (``ValueError``): only its burst changes.
        """
        live_changes.set_rate(self._live(), rate, per, burst, ratio)

    def stop(self) -> None:
        """Pause the whole fleet: every acquirer in every process waits until ``start``."""
        live_changes.stop(self._live())

    def start(self) -> None:
        """Resume after ``stop``, from an empty bucket; the paused time is not owed to anyone.

        Tickets of dead processes are given back at once (the head skips them).
        """
        live_changes.start(self._live())

    def restart(self) -> None:
        """Start (if stopped) with the pools zeroed: an empty bucket and nothing behind schedule.

        Tickets of dead processes are given back at once (the head skips them).
        """
        live_changes.restart(self._live())

    @property
    def stopped(self) -> bool:
        b = self._peek().bucket
        b.refresh()
        return b.stopped

    def apply(self, spec: str) -> None:
        """Apply a rate spec ``rate[,ratio][,verb]`` (nosqlbench's syntax, K/M/G allowed), or
        ``"stop"`` (``"0,stop"``) alone.

        ``configure`` (the default) changes rate and ratio in place, ``start``
        does so and resumes a stopped limiter, ``restart`` does so and zeroes
        the pools, ``stop`` pauses every process.  Applying the spec that is
        already in force changes nothing.
        """
        parsed = live_changes.parse_spec(spec)  # first: a spec refused has registered nothing
        live_changes.apply(self._live(), parsed)

    # -- asyncio -----------------------------------------------------------------------

    async def acquire_async(self, n: int = 1, timeout: Optional[float] = None) -> bool:
        """``acquire`` for asyncio: waits with ``asyncio.sleep``, never blocking the event loop.

        The same request as ``acquire``, parked on the event loop: while it
        holds a ticket its process shows as waiting.  Cancelled before it has
        its ticket, it takes nothing.  Cancelled while waiting for a ticket it
        already holds (``asyncio.wait_for`` timing out included), it gives the
        ticket back: those queued behind it do not wait for its ``n`` ops.
        """
        if n is _ONE and timeout is None:  # acquire's fast grab, then its ticket's wait on the loop
            acq = self._fast.grab
            # the native Acquirer: its grab, then its wait a step at a time on the loop
            take = getattr(acq, "take", None)
            if take is not None:
                try:
                    ticket = take()
                except BaseException:
                    give_back_handed(self._att, counted=True)
                    raise
                if ticket is None:
                    return True
                if ticket is not False:  # (a fast path exists only for a live attachment)
                    try:
                        self._att.cells.handed()  # stored: this call's own
                        return await acquisition.wait_ticket_async(self._live(), acq, ticket)
                    except BaseException:
                        give_back_unowned(self._att, ticket, counted=True)
                        raise
            held = acquisition.grab_one_async(self._live())
            if held is True:
                return True
            if held is not None:
                try:
                    return await drive_async(held)
                except BaseException:
                    give_back_unowned(self._att, held.ticket)
                    raise
        return await drive_async(Request(self._live(), n, timeout))

    # -- observation -------------------------------------------------------------------

    def stats(self) -> Stats:
        """A snapshot of the live pool state (reads only; changes nothing)."""
        return snapshot(self._name, self._peek())

    def __repr__(self) -> str:
        head = f"shmlimit.Limiter {self._name!r}"
        return f"<{head} closed>" if self._att is None else described(head, self._described)

    def _described(self) -> str:
        s = self.stats()
        extra = f" ratio={s.ratio:g} behind={s.behind_seconds:.3f}s" if s.ratio != 1.0 else ""
        if s.upstream is not None:
            extra += f" upstream={s.upstream.url} ({s.upstream.state})"
        return (
            f"rate={s.rate:g}/{s.per:g}s capacity={s.capacity:g}{extra} "
            f"available={s.available:.1f} deficiency={s.deficiency:.1f} grants={s.grants} "
            f"filler_pid={s.filler_pid} processes={len(s.processes)}{' stopped' if s.stopped else ''} "
            f"backend={s.backend}"
        )


if TYPE_CHECKING:  # pragma: no cover

    class _SeveralRates(MultiLimiter, Limiter):  # type: ignore[misc]
        """What ``Limiter(name, rates=...)`` is to a type checker: a ``MultiLimiter``."""


def attach(name: str, *, mode: int = 0o600, trusted_uids: Iterable[int] = ()) -> Limiter:
    """Attach to an existing limiter by name, whatever its configuration.

    Raises ``LimiterNotFoundError`` (a ``FileNotFoundError``) naming it when
    none exists, and ``UntrustedSegmentError`` when it is owned by a user
    other than this one, root and ``trusted_uids``, or writable by group or
    others beyond ``mode`` (see ``Limiter``).
    """
    return Limiter(name, mode=mode, trusted_uids=trusted_uids)


def _unpickle(
    name: str, spec: Optional[UpstreamSpec], *, mode: int, trusted_uids: Tuple[int, ...]
) -> Limiter:
    """Unpickling a handle (``registry.pickled``): attach; a hierarchical handle's sender
    configured the upstream (``spec``), so this process feeds with it too (the segment's must be
    the same)."""
    lim = Limiter(name, mode=mode, trusted_uids=trusted_uids)
    if spec is not None:
        check_upstream(name, lim._peek(), spec)
    return lim


def unlink(name: str) -> None:
    """Remove the limiter's segment by name.  Raises ``LimiterNotFoundError`` when there is none."""
    _unlink_name(name)
