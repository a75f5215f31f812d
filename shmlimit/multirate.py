"""Several rates at once: ``Limiter(name, rates=[...])`` and ``Limiter(name, rates={...})``.

A limiter of several rates is one segment under its one name (``group``): a
header naming the rates, then one region per rate, each an ordinary limiter's
layout with its own bucket, filler and process table, so each rate keeps every
promise of a single one (``rate*T + capacity`` in any window, FIFO, nothing
lost or stalled by a killed process).  ``shmlimit.attach(name)`` returns it,
and every tool shows it as one entry (its rates labelled ``name[key]``).  This
module only takes the rates together:

* **All or nothing.**  ``acquire.all_or_nothing``, each rate taken by CAS; a
  race gives back what it took from the others (``Bucket.give_back``: never
  fuller than had they never been taken).
* **What a waiter holds.**  A waiter takes a ticket on one rate only: the one
  whose wait was longest when it came (``lead``).  It holds nothing on the
  others while that ticket queues.  Once the ticket is due it joins the
  others' queues, and holds the lead rate's tokens (granted, unused) while it
  waits there: as long as the callers already queued on them at that instant
  need (FIFO), which is nothing when they have room.  A timed waiter whose wait
  there exceeds its time left gives everything back and returns False.  Every
  ticket it queues, on any rate, is recorded in that rate's process slot and
  given back should it leave unserved or die, exactly as one rate's waiter's.
* **Settling.**  ``settle`` charges a rate by a grab it does not wait for
  (never refused: it is debt later callers wait for), and refunds by
  ``Bucket.add`` (what does not fit under the capacity is dropped).

The protocol itself (``take_all``, ``give_back``, ``MultiRequest``) is in
``acquire.multi``; the acquisition core's drivers run it.  What a keyed limiter of several
rates shares with this one (``rates=``, costs per rate, a rate named by key) is ``rate_group``'s.  Every word is touched through each
rate's ``Bucket`` and cells.
"""

from __future__ import annotations

import math
import os
import time
import weakref
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union

from shmlimit import live_changes
from shmlimit.acquire import single as acquisition
from shmlimit.acquire.drivers import drive, drive_async
from shmlimit.acquire.multi import (
    NO_RECORD,
    REFUSED,
    Claim,
    MultiRequest,
    claim,
    covered,
    give_back_claims,
    record_nap,
    take_all,
    wait_ns,
)
from shmlimit.adapt import check_config, per_rate
from shmlimit.adapt import feedback as adapt_feedback
from shmlimit.attachment import Attachment, gate_all, on_clock, open_attachment, release
from shmlimit.bucket.fences import FenceHold, beyond_hold, held_ns
from shmlimit.config import (
    NS_PER_S,
    Config,
    arguments_checked,
    validate_clock,
    validate_timeout,
)
from shmlimit.errors import LimiterNotFoundError
from shmlimit.group import GroupCreation, copy_regions, open_rates
from shmlimit.header import Creation
from shmlimit.protocol import AcquireOnEnter
from shmlimit.rate_group import MultiStats, RateGroup, parse_rates, rates_from_text
from shmlimit.registry import Held, described, pickled
from shmlimit.shm import layout as L
from shmlimit.shm.segment import validate_mode, validate_name, validate_slots, validate_trusted_uids
from shmlimit.stats import copied_snapshot, snapshot

_INF = float("inf")
_ONE = 1


def _plain_timeout(timeout: object) -> bool:
    """None, or a number of seconds the fast path may take as valid (the slow path checks the rest)."""
    return timeout is None or (type(timeout) in (int, float) and 0 <= timeout < _INF)  # type: ignore[operator]


class _EachRate:
    """What releases a handle on several rates (``Held._registry``): each rate's attachment."""

    @staticmethod
    def release(atts: Sequence[Attachment], detach: bool) -> None:
        for att in reversed(atts):  # (a tuple: requests in flight keep holding every rate)
            release(att, detach)


class MultiLimiter(RateGroup, AcquireOnEnter, Held):
    """Several rates taken together; made by ``Limiter(name, rates=...)`` (see the module's docstring).

    ``rates=["5000/h", "100/min"]``: every op must fit every rate; ``n`` ops
    cost ``n`` on each.  ``rates={"requests": "500/min", "tokens": "200K/min"}``:
    each call says its cost per rate by keyword (``acquire(requests=1,
    tokens=1500)``, rates not named cost nothing), or ``n`` on each without
    keywords.  Every process must name the same rates.
    """

    _registry = _EachRate

    def __init__(
        self,
        name: str,
        rates: object,
        *,
        mode: int = 0o600,
        slots: int = L.DEFAULT_SLOTS,
        trusted_uids: Iterable[int] = (),
        clock: Optional[Callable[[], int]] = None,
        adapt: object = None,
    ) -> None:
        validate_name(name)
        trusted = validate_trusted_uids(trusted_uids)
        validate_mode(mode)
        validate_slots(slots)
        clock = validate_clock(clock)
        create: Optional[GroupCreation] = None
        # what a pickled handle makes again if the name is gone (None: by name only; adapt= needs rates=)
        self._rates_arg: object = None
        self._adapt_arg = adapt
        if rates is None and adapt is not None:
            raise ValueError("adapt needs rates= (the rates it starts from)")
        if rates is not None:  # None: attach to the group by its name, its rates as it holds them
            if isinstance(rates, str):
                rates = rates_from_text(rates)
            keys, cfgs, named = parse_rates(name, rates)
            self._rates_arg = dict(rates) if named else list(rates)  # type: ignore[call-overload]
            adapts = (
                (None,) * len(keys)
                if adapt is None
                else per_rate(adapt, keys, named, cfgs, check_config)
            )
            create = GroupCreation(
                tuple(Creation(cfg, mode, None, slots, None, a) for cfg, a in zip(cfgs, adapts)),
                keys,
                named,
                mode,
                slots,
            )
        arguments_checked()
        self._name = name
        self._mode = mode
        self._trusted = trusted
        self._fast: Optional[Callable[[], Optional[bool]]] = (
            None  # one op on every rate (see _bind_fast)
        )
        self._fast_ops: Optional[Callable[[object], Optional[bool]]] = (
            None  # ops per rate, or n on all
        )
        _handles.add(self)

        # create the group or open it, then attach to every rate (all again, if a collector took
        # a region meanwhile)
        atts: List[Attachment] = []

        def attach(i: int, label: str, opener: Callable[[], Any]) -> None:
            rate = None if create is None else create.rates[i]
            atts.append(open_attachment(label, rate, mode, trusted, clock, opener=opener))

        args = (self._name, create, self._mode, self._trusted, clock, L.REGIONS_LIMITER)

        def undo() -> None:  # every rate released, then attached afresh (or raised)
            _EachRate.release(atts, True)
            atts.clear()

        geo = open_rates(*args, attach, undo)
        self._keys, self._named = geo.keys, geo.named
        self._att: Optional[Tuple[Attachment, ...]] = tuple(atts)

    # -- identity and lifecycle ----------------------------------------------------

    @property
    def configs(self) -> Dict[str, Config]:
        """Each rate's live configuration, by key."""
        out = {}
        for k, att in zip(self._keys, self._peek()):
            att.bucket.refresh()
            out[k] = att.bucket.config
        return out

    @property
    def created(self) -> Dict[str, bool]:
        """For each rate, by key: True if this process created (and initialised) its segment."""
        return {k: att.created for k, att in zip(self._keys, self._peek())}

    def _live(self) -> List[Attachment]:
        """The rates' attachments, for a use: the first one in this process registers it in every
        rate and starts their fillers (as ``Limiter._live``)."""
        atts = self._peek()
        for att in atts:
            if not att.in_use:
                att.use()
        return atts

    def close(self) -> None:
        """Detach this handle from every rate.  The segments stay (use ``unlink``)."""
        self._fast = self._fast_ops = None
        super().close()

    def __reduce__(self):
        return pickled(self, _unpickle, self._rates_arg, self._adapt_arg)

    # -- costs -----------------------------------------------------------------------

    def _tokens(self, ops: Sequence[int]) -> List[int]:
        """Each rate's tokens for ``ops``, at the price in force (configs refreshed)."""
        toks = []
        for k, att, o in zip(self._keys, self._live(), ops):
            try:
                toks.append(acquisition.price(att.bucket, o) if o else 0)
            except ValueError as e:
                raise ValueError(f"rate {k!r}: {e}") from None
        return toks

    # -- acquiring -------------------------------------------------------------------

    # The fast path: every rate taken in one call of a ``MultiGate`` (attachment.gate_all; native
    # when the cells are): it looks at every rate (config unchanged, room now) and touches nothing
    # unless all have room, then takes each by CAS, giving the earlier ones back if a race took a
    # later one's room, and counts every rate's grant only once all have granted.  It never
    # queues, so it never passes a ticket queued on any rate, and takes only tokens each head
    # covers: every rate keeps its window bound and its FIFO.  One op on every rate is
    # ``try_grab()``; ``n`` ops or costs by name are ``try_grab_ops``.  Anything it cannot
    # decide (a changed config, a replenish that might grant, a race, odd arguments) takes the
    # slow path, which decides afresh and raises what it must.

    def _bind_fast(self) -> None:
        """Bind the fast path for the configs in force (none while any rate has no gate)."""
        atts = self._live()
        gates = gate_all(atts, self._keys if self._named else None)
        self._seqs = tuple(att.bucket.seq for att in atts)
        clock = atts[0].clock  # every rate's, or the gates never refuse (gate_all's decide)

        handle = weakref.ref(self)  # no cycle through the handle: its __del__ releases the rates

        def refused(ops: object = _ONE) -> None:  # take_all's refusal, at an injected clock's now
            h = handle()
            if h is not None:
                o = h._ops(_ONE, ops) if isinstance(ops, dict) else h._ops(ops, {})
                covered(atts, o, h._tokens(o))

        self._fast, self._fast_ops = (
            (None, None)
            if gates is None
            else (
                on_clock(gates.try_grab, clock, refused),
                on_clock(gates.try_grab_ops, clock, refused),
            )
        )

    def _try_fast(self, n: object, costs: Dict[str, object]) -> Optional[bool]:
        """``n`` ops on every rate, or the costs by name, now, by the bound gates: True (granted),
        False (refused for certain, nothing taken), None (the slow path decides)."""
        fast_ops = self._fast_ops
        if fast_ops is None:
            return None
        if costs:
            # by name (the gate refuses a name not a rate's, or a list of rates' names: the slow
            # path then raises); n given too is the slow path's to refuse
            return fast_ops(costs) if n is _ONE else None
        return fast_ops(n)

    def _refresh_fast(self) -> None:
        """Rebind the fast path if any rate's config changed since it was bound."""
        if self._att is None:
            return
        seqs = []
        for att in self._att:
            att.bucket.refresh()
            seqs.append(att.bucket.seq)
        if self._fast is None or tuple(seqs) != self._seqs:
            self._bind_fast()

    def try_acquire(self, n: int = 1, **costs: int) -> bool:
        """Take the ops from every rate only if all have them now; never waits.  False takes nothing."""
        fast = self._fast
        if fast is not None:
            got = (
                fast() if n is _ONE and not costs else self._try_fast(n, costs)
            )  # `is`: the int 1 (True is not)
            if got is not None:
                return got
        return take_all(*self._priced(n, costs))

    def acquire(self, n: int = 1, timeout: Optional[float] = None, **costs: int) -> bool:
        """Take the ops from every rate, waiting until all allow them; True once granted.

        With ``timeout`` (seconds): False at once, taking nothing, when the
        wait on any rate exceeds it; False, having given everything back, when
        the wait on the other rates once the longest is served exceeds what is
        left of it.
        """
        fast = self._fast  # _granted_now, inlined: a call costs a granted acquire a fifth more
        if fast is not None and (timeout is None or _plain_timeout(timeout)):
            if (fast() if n is _ONE and not costs else self._try_fast(n, costs)) is True:
                return True
        return drive(self._request(n, timeout, costs))

    async def acquire_async(
        self, n: int = 1, timeout: Optional[float] = None, **costs: int
    ) -> bool:
        """``acquire`` for asyncio: parks with ``asyncio.sleep``, never blocking the event loop."""
        return self._granted_now(n, timeout, costs) or await drive_async(
            self._request(n, timeout, costs)
        )

    def _granted_now(self, n: object, timeout: object, costs: Dict[str, object]) -> bool:
        """The fast path (``acquire`` inlines it): granted now by the bound gates, which is within
        any timeout; anything else waits (or fails) on the slow path."""
        fast = self._fast
        if fast is not None and (timeout is None or _plain_timeout(timeout)):
            return (fast() if n is _ONE and not costs else self._try_fast(n, costs)) is True
        return False

    def _priced(
        self, n: object, costs: Dict[str, object]
    ) -> Tuple[List[Attachment], Tuple[int, ...], List[int]]:
        """The slow path's rates, ops per rate and their tokens, on configs refreshed (the fast
        path rebound if any changed)."""
        self._refresh_fast()
        ops = self._ops(n, costs)
        return self._live(), ops, self._tokens(ops)

    def _request(self, n: object, timeout: object, costs: Dict[str, object]) -> MultiRequest:
        """The slow path's request for the ops (or costs)."""
        return MultiRequest(*self._priced(n, costs), timeout)

    def reserve(
        self, n: int = 1, max_wait: Optional[float] = None, **costs: int
    ) -> Optional[float]:
        """Claim the next slot on every rate; the seconds until all are due (0.0: now).

        None, taking nothing, when any rate's wait would exceed ``max_wait``
        seconds.  The caller owns the slots once this returns a number
        (counted as granted).  The rates are claimed shortest wait first, so
        that a refusal by a later one (another caller took its room between
        the look and the claim) mostly finds the earlier claims covered.
        Until the last rate is claimed each claim is held as a waiter's
        ticket, recorded in this process's slot on its rate
        (``multirate_request.claim``); refused part-way, or interrupted, every
        claim is given back (``give_back_claims``: covered tokens to the head,
        a queued range skipped by the head), so no rate keeps a dead claim
        queued, and none is given back beyond what it would have held.  With
        one rate to claim it is that rate's reservation (``Limiter.reserve``).
        """
        atts, ops, toks = self._priced(n, costs)
        limit = validate_timeout(max_wait, "max_wait")
        max_ns = _INF if limit is None else limit * NS_PER_S
        order = sorted((i for i, o in enumerate(ops) if o), key=lambda i: wait_ns(atts[i], toks[i]))
        if len(order) == 1:
            # One rate to claim: one rate's reservation, whose promise is known before its CAS.
            # The claims below hold a provisional fence a second ahead and a waiter's record until
            # every rate is claimed: for the few us that takes, the fence held the head and cut
            # refunds, and the record counted as a stop (``count_stops``) in every promise made
            # meanwhile, its own included: at 5 000/s, 3 processes reserving and settling lost
            # 0.5 to 1.3 s of schedule in 6 s to slots promised that much late.
            return acquisition.reserve(atts[order[0]], ops[order[0]], limit)
        if (
            any(atts[i].bucket.stopped or wait_ns(atts[i], toks[i]) > max_ns for i in order)
            and limit is not None
        ):
            return None
        while True:
            got = self._reserve_once(atts, ops, toks, order, max_ns)
            if got is not False:
                break  # (False: the claims outlasted their provisional fences: given back, claimed again)
        if got is None:
            return None
        for att, o in zip(atts, ops):
            if o:
                att.count(o)
        return got

    def _reserve_once(
        self,
        atts: List[Attachment],
        ops: Sequence[int],
        toks: List[int],
        order: List[int],
        max_ns: float,
    ) -> Any:
        """One try of ``reserve``: the seconds until due, None refused, False to try again.  Each claim's
        fence (``fences``) is stored before its CAS with a provisional DUE well past any promise it may
        get (twice the longest wait estimated, and a second), set to the promise once every rate is
        claimed: lowered, or raised while the provisional one is still ahead (no claim has read it past
        its DUE yet); else everything is given back and claimed again.  A process killed part-way
        leaves fences that hold the head no longer than their provisional DUE."""
        ahead = min(2 * max(wait_ns(atts[i], toks[i]) for i in order) + NS_PER_S, float(1 << 62))
        claims: List[Claim] = []
        holds: List[FenceHold] = []
        due = 0.0
        made = False
        rest = order
        missed = 0  # rates in a row that found every record in use (a whole round: wait for one)
        waited_since: Optional[int] = None
        try:
            while rest:
                i = rest[0]
                hold = FenceHold(want=int(atts[i].clock() + ahead))
                c = claim(atts[i], ops[i], max_ns, last=len(rest) == 1, fence=hold)
                if (
                    c[2] is NO_RECORD
                ):  # five waiters of this process queue on that rate: claim it later
                    rest = rest[1:] + [i]
                    missed += 1
                    if missed >= len(rest):
                        waited_since = self._wait_for_record(atts[i], toks[i], waited_since, max_ns)
                        if waited_since is None:
                            return None  # no record freed within max_wait: refused (the finally gives back)
                        missed = 0
                    continue
                rest, missed = rest[1:], 0
                if c[2] is REFUSED:
                    return None
                claims.append(c)
                c[0].cells.handed()  # stored: taken from where its take left it (see the finally)
                holds.append(hold)
                c[0].bucket.replenish()
            # every fence to the promise, unless one's provisional DUE has passed (it may have been
            # read past it: raised now, the head might have gained on it early)
            # (a settle that finds its record claimed again -- preempted past its provisional DUE
            # after the check -- makes the reservation again, as a passed DUE does)
            if all(h.rec is None or c[0].clock() < h.due for c, h in zip(claims, holds)):
                # made: the claims are a grant, their waiters' records freed before the promise is
                # computed.  Held, each counted as a stop (``count_stops``: half the capacity) in the
                # promise of every claim behind it, its own reservation's included (at 1 000/s,
                # burst 500: the second of two reservations of 100 ops promised 0.35 s after the
                # first, not 0.1 s); clamp words a claim left naming one meanwhile are counted in
                # the promise as the room they give.  Given back from here on, a claim is recorded
                # anew (``Attachment.give_back``).
                for k, (att, tokens, ticket, h, rec) in enumerate(claims):
                    att.clear_ticket(rec, tokens)
                    claims[k] = (att, tokens, ticket, h, None)
                for att, _, ticket, _, _ in claims:
                    if ticket is not None:  # never earlier than the head
                        due = max(due, att.bucket.promised_ns(ticket) - att.clock())
                # (as one rate's: a DUE its fence cannot hold to the end; given back below)
                held = min(held_ns(a.bucket.snap.tpn) for a, *_ in claims)
                if due > held:
                    raise beyond_hold(due, held)
                if due > max_ns:  # each claim was bounded by its estimate: the promise decides
                    return None
                made = all(
                    [
                        h.settle(att.bucket.fences, math.ceil(att.clock() + max(0.0, due)))
                        for (att, *_), h in zip(claims, holds)
                    ]
                )
        finally:
            if not made:  # refused part-way, or an exception (QueueFullError, an interrupt): give every claim back
                for (att, *_), h in zip(
                    claims, holds
                ):  # (its fences first: they would hold its own give-back)
                    h.release(att.bucket.fences)
                give_back_claims(claims)
                for att in atts:  # a claim's ticket a handler kept from reaching ``claims``
                    acquisition.give_back_handed(att)
        if not made:
            return False
        return max(0.0, due) / NS_PER_S

    @staticmethod
    def _wait_for_record(
        att: Attachment, tokens: int, since: Optional[int], max_ns: float
    ) -> Optional[int]:
        """Every rate still to claim found its records all in use, or has none (beyond its table):
        nap until one may be free (one is freed as each waiter of this process is granted), or
        without records until ``tokens`` could be there, the claims already taken held, recorded.
        Answers when the waiting began (``att``'s clock), None once it has lasted ``max_ns``."""
        now = att.clock()
        since = now if since is None else since
        if now - since > max_ns:
            return None
        time.sleep(
            record_nap(
                att.bucket, tokens if not att.records else 0, bool(att.records), acquisition.MAX_NAP
            )
        )
        return since

    def retry_after(self, n: int = 1, **costs: int) -> float:
        """Seconds until the ops could be granted on every rate to a new caller (0.0: now)."""
        ops = self._ops(n, costs)
        return max(acquisition.retry_after(att, o) for att, o in zip(self._live(), ops) if o)

    def settle(self, n: int = 0, **deltas: int) -> None:
        """After the call: correct an estimate.  A positive delta charges, a negative one refunds.

        ``settle(tokens=actual - estimate)``; ``settle(n)`` changes every
        rate by ``n`` ops.  A charge is never refused and never waits: it is
        debt that later callers wait for.  A refund returns its tokens to the
        bucket at once (to the callers waiting now), as far as they fit under
        the capacity; the rest is dropped, as in any token bucket.  Any
        process may settle.  Charges are counted as grants; refunds are not
        subtracted from them.
        """
        atts = self._live()
        if deltas:
            per = self._by_name(deltas, n, 0, "delta")
        else:
            per = [n for _ in self._keys]
        for k, d in zip(self._keys, per):
            if isinstance(d, bool) or not isinstance(d, int):
                raise TypeError(
                    f"{k if deltas else 'n'} must be an int (ops; negative refunds), not {type(d).__name__}"
                )
        toks = self._tokens([abs(d) for d in per])  # every delta validated before any is applied
        for att, d, tokens in zip(atts, per, toks):
            if d > 0:
                att.bucket.charge(tokens, att.grants_off, 0)  # a ticket no one waits for: debt
                att.count(d)
            elif d < 0:
                att.bucket.add(tokens)

    # -- the adaptive rates ----------------------------------------------------------------

    def feedback(
        self, throttled: bool, which: Union[str, int, Sequence[Union[str, int]], None] = None
    ) -> None:
        """Report one outcome of an op to the adaptive rates (``adapt=``), for every process.

        ``throttled=True``: the upstream refused it for its rate (an HTTP 429 or 503); False: it
        answered.  The outcome goes to every rate that adapts, or with ``which`` (a rate's name
        or index, or a list of them) to those only: when the upstream tells which of its limits
        refused.  One atomic add per rate; in each, the report that finds the window over decides
        it, once for every process.
        """
        if not isinstance(throttled, bool):
            raise TypeError(f"throttled must be True or False, got {throttled!r}")
        atts = self._peek()
        chosen = self._told(which, [i for i, a in enumerate(atts) if a.cells.load(L.ADAPT_MAX)])
        for i in chosen:
            adapt_feedback(atts[i].bucket, throttled, atts[i].clock)

    @property
    def adaptive(self) -> bool:
        """Some rate adapts (created with ``adapt=``)."""
        return any(att.cells.load(L.ADAPT_MAX) != 0 for att in self._peek())

    # -- live changes ------------------------------------------------------------------

    def set_rate(
        self,
        which: Union[str, int],
        rate: Union[float, str],
        per: Optional[float] = None,
        burst: Optional[float] = None,
    ) -> None:
        """Change one rate (by name or index) for every attached process, at once (see ``Limiter.set_rate``)."""
        att = self._live()[self._index(which)]
        live_changes.set_rate(att, rate, per, burst, None, "a Limiter of several rates")

    # -- observation -------------------------------------------------------------------

    def stats(self) -> MultiStats:
        """A snapshot of every rate's live state (reads only)."""
        atts = self._peek()
        return MultiStats(
            self._name, {k: snapshot(f"{self._name}[{k}]", att) for k, att in zip(self._keys, atts)}
        )

    def __repr__(self) -> str:
        head = f"shmlimit.Limiter {self._name!r}"
        if self._att is None:
            return f"<{head} rates={list(self._keys)} closed>"
        return described(head, self._described)

    def _described(self) -> str:
        parts = " ".join(
            f"{k}={st.rate:g}/{st.per:g}s(capacity={st.capacity:g} available={st.available:.1f} "
            f"deficiency={st.deficiency:.1f} grants={st.grants})"
            for k, st in self.stats().rates.items()
        )
        return f"{parts} backend={self._peek()[0].cells.backend}"


#: Every live handle of this process, so that a forked child drops their fast paths (bound to the
#: parent's process slots) and binds its own on first use.
_handles: "weakref.WeakSet[MultiLimiter]" = weakref.WeakSet()


def _forget_fast_paths() -> None:
    for h in list(_handles):
        h._fast = h._fast_ops = None


os.register_at_fork(after_in_child=_forget_fast_paths)


def inspect_group(name: str) -> MultiStats:
    """A snapshot of every rate of the group ``name``, read without joining it (nothing written)."""
    geo, regions = copy_regions(name, L.REGIONS_LIMITER)
    return MultiStats(
        name,
        {k: copied_snapshot(name, f"{name}[{k}]", seg) for k, seg in zip(geo.keys, regions)},
    )


def _unpickle(
    name: str, rates: object, adapt: object, *, mode: int, trusted_uids: Tuple[int, ...]
) -> MultiLimiter:
    """Unpickling a handle (``registry.pickled``): attached by name, its rates as the limiter holds
    them now (a ``set_rate`` since its creation would make the creating call a mismatch); the
    same creating call, made again, only if no limiter of that name exists."""
    try:
        return MultiLimiter(name, None, mode=mode, trusted_uids=trusted_uids)
    except LimiterNotFoundError:
        if rates is None:
            raise
    return MultiLimiter(name, rates, mode=mode, trusted_uids=trusted_uids, adapt=adapt)
