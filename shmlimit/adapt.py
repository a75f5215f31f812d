"""The adaptive rate: the whole fleet finds the rate its upstream allows, as one client.

Additive increase, multiplicative decrease, decided once per window for every
process at once.  Every process reports outcomes (``Limiter.feedback``, the
HTTP transports on their own): one fetch-add on a counter of the segment.  The
reporter decides (``report``): the report that finds the window over (``window``
seconds since it began) claims it by a CAS on its start and decides it before
counting itself in the next, so a window is decided once however many processes
report, and there is nothing to elect.  A window in which any outcome was
throttled cuts the rate once (times ``decrease``), however many were; a window
with outcomes, none throttled, in which callers took nearly all the schedule
(``DEMAND`` of it: they queued for tokens) raises it by ``increase``; anything
else (an idle fleet, callers that never reach the rate, no outcome reported)
keeps it.  A window is decided at the first report after its end: a limiter
nobody reports on is never decided, so never raised.  The rate stays within
``[min_rate, max_rate]`` and is published as ``set_rate`` publishes it, so the
window bound holds for the rate in force at each instant.

``decide`` is the controller itself, pure: the state and the window's counts
in, the next state out, on whatever clock its caller reads.  ``report`` claims
and decides a window wherever its words live: a limiter's in its segment
(``feedback``), a key's in its override entry (``keyed.adapt``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, List, Mapping, Optional, Sequence, Tuple, TypeVar

from shmlimit.config import MAX_OPS_PER_S, NS_PER_S, Config, number
from shmlimit.errors import ConfigWriterTakenOver, CorruptWordsError
from shmlimit.shm import layout as L
from shmlimit.shm.banks import ConfigLock, settled
from shmlimit.shm.words import diff

if TYPE_CHECKING:  # pragma: no cover
    from shmlimit.bucket.rovers import Bucket
    from shmlimit.shm.banks import Snapshot
    from shmlimit.shm.cells import Cells

R = TypeVar("R")  #: a rate of a limiter of several rates, as ``per_rate``'s check reads it

#: A window is "busy" (callers waited for tokens) when they took at least this share of its
#: schedule: the tail's advance over the window, in schedule time, against the window's length.
DEMAND = 0.9
#: The defaults: a cut keeps this share of the rate ...
DEFAULT_DECREASE = 0.8
#: ... a raise adds this share of ``max_rate`` ...
DEFAULT_INCREASE_SHARE = 0.01
#: ... and the fleet decides this often (seconds).
DEFAULT_WINDOW = 0.25
#: The bounds of ``window`` (seconds).
MIN_WINDOW = 0.01
MAX_WINDOW = 3600.0

#: ``State.verdict``: what the last decision did.
CUT = "cut"
RAISE = "raise"
HOLD = "hold"


@dataclass(frozen=True)
class Adapt:
    """An adaptive rate: ``Limiter(name, rate=1000, adapt=Adapt(min_rate=10, max_rate=2000))``.

    ``min_rate`` and ``max_rate`` bound the rate (ops per the limiter's ``per``
    seconds); ``decrease`` is the share of the rate a throttled window keeps
    (0 < decrease < 1, default 0.8); ``increase`` the ops per ``per`` a busy,
    clean window adds (default 1 % of ``max_rate``); ``window`` the seconds
    between two decisions (default 0.25, from 0.01 to 3600).
    """

    min_rate: float
    max_rate: float
    decrease: float = DEFAULT_DECREASE
    increase: Optional[float] = None
    window: float = DEFAULT_WINDOW

    def __post_init__(self) -> None:
        lo = number("min_rate", self.min_rate)
        hi = number("max_rate", self.max_rate)
        if not math.isfinite(lo) or lo <= 0:
            raise ValueError(f"min_rate must be finite and > 0 ops, got {self.min_rate!r}")
        if not math.isfinite(hi) or not lo <= hi:
            raise ValueError(
                f"max_rate must be finite and >= min_rate ({lo:g}), got {self.max_rate!r}"
            )
        dec = number("decrease", self.decrease)
        if not 0 < dec < 1:
            raise ValueError(f"decrease must be between 0 and 1 (exclusive), got {self.decrease!r}")
        inc = hi * DEFAULT_INCREASE_SHARE if self.increase is None else self.increase
        inc = number("increase", inc)
        if not math.isfinite(inc) or inc <= 0:
            raise ValueError(f"increase must be finite and > 0 ops, got {self.increase!r}")
        win = number("window", self.window)
        if not MIN_WINDOW <= win <= MAX_WINDOW:
            raise ValueError(
                f"window must be from {MIN_WINDOW:g} to {MAX_WINDOW:g} seconds, got {self.window!r}"
            )
        for field, v in (
            ("min_rate", lo),
            ("max_rate", hi),
            ("decrease", dec),
            ("increase", inc),
            ("window", win),
        ):
            object.__setattr__(self, field, v)

    def clamp(self, rate: float) -> float:
        """``rate`` within ``[min_rate, max_rate]``."""
        return min(self.max_rate, max(self.min_rate, rate))

    def check(self, cfg: Config) -> None:
        """Raise ValueError unless ``cfg`` (a limiter's config) can adapt within these bounds."""
        if not self.min_rate <= cfg.rate <= self.max_rate:
            raise ValueError(
                f"rate must be within adapt's bounds, from {self.min_rate:g} to "
                f"{self.max_rate:g} ops per {cfg.per:g} s, got {cfg.rate:g}"
            )
        if self.max_rate / cfg.per > MAX_OPS_PER_S:
            raise ValueError(
                f"max_rate/per must be at most {MAX_OPS_PER_S:.0e} ops per second, "
                f"got {self.max_rate / cfg.per:.6g}"
            )
        for bound in (self.min_rate, self.max_rate):  # every rate decided must be publishable
            adapted(cfg, bound).check_at(cfg.tpn)


def per_rate(
    adapt: object,
    keys: Tuple[str, ...],
    named: bool,
    rates: Sequence[R],
    check: Callable[[Adapt, R], None],
) -> Tuple[Optional[Adapt], ...]:
    """``adapt=`` of a limiter of several rates: one ``Adapt`` or None per rate, in the rates' order.

    A dict by rate name for named rates (a rate it does not name keeps its rate), a list as long
    as the rates for a list of them (None: that rate keeps its rate).  One ``Adapt`` for every
    rate is refused: each rate's bounds are ops per its own window, in its own unit.  ``check``
    raises ValueError unless an ``Adapt`` fits its rate (a ``Config``, or a keyed ``Rate``): the
    error is given the rate's name.
    """
    if isinstance(adapt, Adapt):
        raise TypeError(
            "adapt= of a limiter of several rates gives each rate its own bounds (ops per that "
            "rate's window): a dict by rate name, or a list in the rates' order (None: a rate "
            "that keeps its rate); got one Adapt"
        )
    if named:
        if not isinstance(adapt, Mapping):
            raise TypeError(
                f"adapt must be a dict of rate name -> shmlimit.Adapt for named rates, "
                f"got {type(adapt).__name__}"
            )
        unknown = sorted(str(k) for k in adapt if k not in keys)
        if unknown:
            raise ValueError(f"adapt: unknown rate(s) {unknown}; the rates are {', '.join(keys)}")
        out = tuple(adapt.get(k) for k in keys)
    else:
        if not isinstance(adapt, (list, tuple)) or len(adapt) != len(keys):
            raise TypeError(
                f"adapt must be a list of {len(keys)} shmlimit.Adapt or None, one per rate, "
                f"got {adapt!r}"
            )
        out = tuple(adapt)
    for key, a, rate in zip(keys, out, rates):
        if a is None:
            continue
        if not isinstance(a, Adapt):
            raise TypeError(f"adapt[{key!r}] must be a shmlimit.Adapt or None, got {a!r}")
        try:
            check(a, rate)
        except ValueError as e:
            raise ValueError(f"adapt[{key!r}]: {e}") from None
    if not any(out):
        raise ValueError("adapt: no rate adapts (every entry is None); leave adapt= out")
    return out


def check_config(adapt: Adapt, cfg: Config) -> None:
    """Raise ValueError unless a limiter's rate of ``cfg`` can adapt by ``adapt`` (``per_rate``'s
    check for a ``Limiter``'s rates): no burst of its own, and within the bounds."""
    if cfg != adapted(cfg, cfg.rate):
        raise ValueError(
            "burst cannot be combined with adapt: the capacity follows the rate "
            "(10 ms of schedule, at least one op)"
        )
    adapt.check(cfg)


@dataclass(frozen=True)
class State:
    """The controller's state: the rate in force, when the current window began (ns, the caller's
    clock) and what the last decision did (None: none yet)."""

    rate: float
    start_ns: int
    verdict: Optional[str] = None


@dataclass(frozen=True)
class Window:
    """What one window saw: outcomes reported throttled and not, and the schedule callers took (ns)."""

    throttled: int
    ok: int
    taken_ns: float


def decide(adapt: Adapt, state: State, seen: Window, now_ns: int) -> State:
    """The next state: ``state`` itself while its window runs, else the window's decision.

    One cut per window, however many throttled outcomes; a raise only for a clean window
    (outcomes, none throttled) in which callers took ``DEMAND`` of the schedule or more.
    """
    elapsed = now_ns - state.start_ns
    if elapsed < adapt.window * NS_PER_S:
        return state
    if seen.throttled > 0:
        rate, verdict = adapt.clamp(state.rate * adapt.decrease), CUT
    elif seen.ok > 0 and seen.taken_ns >= DEMAND * elapsed:
        rate, verdict = adapt.clamp(state.rate + adapt.increase), RAISE
    else:
        rate, verdict = adapt.clamp(state.rate), HOLD
    return State(rate, now_ns, verdict)


# ---- the segment's words -----------------------------------------------------------------------


def write(
    cells: "Cells",
    adapt: Optional[Adapt],
    params: Tuple[int, ...] = L.ADAPT_PARAMS,
    lock: Optional[ConfigLock] = None,
) -> None:
    """Store ``adapt``'s parameters, or none, in the words ``params`` (min, max, decrease,
    increase, window: a limiter's, or a keyed table's).

    A live segment's (a redeploy's) under ``lock``, its config lock (``read`` reads them as one
    writer left them), each word as the lock stores it; without, the creator's, before READY.
    ``max_rate`` (0: "no adapt") first goes to 0 and is stored last: a writer that dies half-way
    leaves no adaptive rate, never half of two."""
    top = params[1]
    values = (
        (0,) * 5
        if adapt is None
        else tuple(
            L.f2u(v)  # type: ignore[arg-type]
            for v in (adapt.min_rate, adapt.max_rate, adapt.decrease, adapt.increase, adapt.window)
        )
    )
    steps = [(top, 0), *((o, v) for o, v in zip(params, values) if o != top), (top, values[1])]
    if lock is None:
        for off, v in steps:
            cells.store(off, v)
        return
    with lock:
        for off, v in steps:
            lock.store(off, v)


def describe(adapt: Optional[Adapt]) -> str:
    """``adapt`` as an error message shows it."""
    if adapt is None:
        return "no adaptive rate"
    return (
        f"adapt(min_rate={adapt.min_rate:g}, max_rate={adapt.max_rate:g}, "
        f"decrease={adapt.decrease:g}, increase={adapt.increase:g}, window={adapt.window:g}s)"
    )


def expected(cfg: Config, adapt: Optional[Adapt], cells: "Cells", current: Config) -> Config:
    """The config a creating call with ``cfg`` and ``adapt`` finds acceptable in a segment whose
    config is ``current``: with adapt, on a segment that adapts, at the rate it learned (within
    ``adapt``'s bounds); otherwise ``cfg`` itself.  The rate learned is a pace: under a ``per``
    of its own, ``cfg``'s ops per ``cfg.per`` at that pace."""
    if adapt is None or read(cells) is None:
        return cfg
    return adapted(cfg, adapt.clamp(at_per(current.rate, current.per, cfg.per)))


def at_per(rate: float, per: float, new_per: float) -> float:
    """``rate`` ops per ``per`` seconds as ops per ``new_per`` seconds: the same pace, in the unit
    an ``Adapt``'s bounds are in after a redeploy changed ``per``."""
    return rate if per == new_per else rate / per * new_per


def read(
    cells: "Cells", params: Tuple[int, ...] = L.ADAPT_PARAMS, seq: int = L.CFG_SEQ
) -> Optional[Adapt]:
    """The segment's parameters (None: it does not adapt), as one writer left them (read under
    the config lock whose sequence word is at ``seq``: ``banks.settled``); ``SegmentError`` if
    they are not valid."""
    return read_at(cells, params, seq)[1]


def read_at(
    cells: "Cells", params: Tuple[int, ...] = L.ADAPT_PARAMS, seq: int = L.CFG_SEQ
) -> Tuple[int, Optional[Adapt]]:
    """``read``, and the sequence number they were read under."""
    at, words = settled(cells, seq, lambda s: [cells.load(off) for off in params], "adapt")
    if words[1] == 0:
        return at, None
    lo, hi, dec, inc, win = (L.u2f(w) for w in words)
    try:
        return at, Adapt(lo, hi, dec, inc, win)
    except (TypeError, ValueError) as e:
        raise CorruptWordsError(f"its adaptive rate's parameters are not valid ({e})") from None


def report(
    c: "Cells",
    adapt: Adapt,
    clock: Callable[[], int],
    words: Tuple[int, int, Tuple[int, ...]],
    counts: Callable[[], Sequence[int]],
    judge: Callable[[Sequence[int]], Optional[Tuple[float, Window]]],
    publish: Callable[[float], bool] = lambda rate: True,
) -> Optional[float]:
    """Decide the window if it is over, once for the fleet; the rate this caller decided and
    published (``publish``: False when a change made meanwhile stood), None when none was.  A
    cut or a raise is counted only once published: one that stood aside made nothing.

    ``words`` are the offsets of the window's start, the decisions word (cuts << 32 | raises) and
    the marks: each count (``counts()``) when the window began.  ``judge`` turns the counts since
    then (a count that went back: 0) into the rate in force and the window's ``Window``, or None
    when nothing they say counts (a new window from now).  The window is claimed by a CAS on its
    start: however many processes find it over, one decides it.  ``clock`` is read after the
    start: a monotonic clock never reads before a start another process wrote.  A start of 0
    (none yet) or after the clock's now (a clock behind it, an injected one) begins one.

    The start's low bit says the window's marks are written.  A claimer writes them after its
    claim, by CAS from the values it judged, then sets the bit, and decides only if it could: a
    window whose claimer stalled or died in between is begun afresh, not judged (its marks are an
    older window's, whose outcomes were judged already), and a claimer that resumes later misses
    newer marks and decides nothing.  So no outcome is judged twice, and no stale decision undoes
    newer ones; a claimer lost there costs two decisions.  A start value never comes back (each is
    a fresh clock reading): a reporter that read one long ago cannot claim it again.
    """
    start_off, decisions, marks = words
    start = c.load(start_off)
    began = start & ~1
    now_ns = clock()
    over = start != 0 and now_ns >= began
    if over and now_ns - began < adapt.window * NS_PER_S:
        return None
    olds = [c.load(m) for m in marks]
    now = counts()
    judged = None
    if over and start & 1:
        judged = judge([max(0, diff(n, o)) for n, o in zip(now, olds)])
    if not _begin(c, start_off, start, now_ns, marks, olds, now) or judged is None:
        return None  # another process decided this window, or went on from it while we stalled
    new = decide(adapt, State(judged[0], began), judged[1], now_ns)
    rate = None if new.rate == judged[0] else new.rate
    if rate is not None and not publish(rate):
        return None
    if new.verdict in (CUT, RAISE):
        c.fetch_add(decisions, (1 << 32) if new.verdict == CUT else 1)
    return rate


def restart(
    c: "Cells",
    clock: Callable[[], int],
    words: Tuple[int, int, Tuple[int, ...]],
    counts: Callable[[], Sequence[int]],
) -> None:
    """Begin a window now, whatever the current one (a key's entry given to another key), as
    ``report`` begins one: its start a fresh clock reading, never a value a reporter stalled since
    long ago may have read (0), and may yet claim."""
    start_off, _, marks = words
    start = c.load(start_off)
    olds = [c.load(m) for m in marks]
    _begin(c, start_off, start, clock(), marks, olds, counts())


def _begin(
    c: "Cells",
    start_off: int,
    start: int,
    now_ns: int,
    marks: Tuple[int, ...],
    olds: Sequence[int],
    now: Sequence[int],
) -> bool:
    """Claim the window that began at ``start`` and begin the next at ``now_ns`` (a CAS), write its
    marks (``now``, each by CAS from ``olds``) and set the start's low bit; False if another
    process claimed it first, or claimed the next one while this caller stalled."""
    claim = now_ns & ~1
    if not c.cas(start_off, start, claim):
        return False
    for m, o, n in zip(marks, olds, now):
        c.cas(m, o, n)
    return c.cas(start_off, claim, claim | 1)


def feedback(bucket: "Bucket", throttled: bool, clock: Callable[[], int]) -> bool:
    """Count one outcome in the limiter's segment (one fetch-add), first deciding its window if it
    is over (``report``: from the outcomes and the tail's advance since the window began) and
    publishing a changed rate as ``set_rate`` does.  False (nothing counted) when the limiter
    does not adapt."""
    c = bucket.cells
    at, adapt = read_at(c)
    if adapt is None:
        return False
    marks = (L.ADAPT_SEEN_THROTTLED, L.ADAPT_SEEN_OK, L.ADAPT_SEEN_TAIL)
    judged: List["Snapshot"] = []  # the config the decision is made from

    def publish(rate: float) -> bool:
        # only over the config and the parameters in force when they were read (``at``, the judge
        # came after): a change published since, a set_rate or a reconfigure, stands
        try:
            return bucket.publish(adapted(judged[0].config, rate), at)  # type: ignore[arg-type]
        except ConfigWriterTakenOver:
            return False  # stalled past the lock's timeout: the writer that took over stands

    report(
        c,
        adapt,
        clock,
        (L.ADAPT_START, L.ADAPT_DECISIONS, marks),
        lambda: [c.load(off) for off in (L.ADAPT_THROTTLED, L.ADAPT_OK, L.TAIL)],
        lambda seen: _judge(bucket, seen, judged),
        publish,
    )
    c.fetch_add(L.ADAPT_THROTTLED if throttled else L.ADAPT_OK, 1)
    return True


def tell(limiter: Any, throttled: bool, *args: Any) -> None:
    """``limiter.feedback(throttled, *args)`` if it adapts now (the integrations' reports): any
    process may give or take ``adapt=`` with ``reconfigure=True`` while this one runs, and an
    answer (a task's result) is not lost to the ValueError ``feedback`` raises on a limiter that
    no longer adapts.  A limiter of a kind that does not adapt is told nothing."""
    if not getattr(limiter, "adaptive", False):
        return
    try:
        limiter.feedback(throttled, *args)
    except ValueError:
        if getattr(limiter, "adaptive", False):
            raise  # (adapt= taken away between the two looks: nothing to report)


def _judge(
    bucket: "Bucket", seen: Sequence[int], judged: List["Snapshot"]
) -> Optional[Tuple[float, Window]]:
    """A limiter's window: its outcomes and the schedule its tail advanced (None: the limiter is
    stopped, nothing it saw says anything), judged at the config in force (added to ``judged``)."""
    bucket.refresh()
    snap = bucket.snap
    judged.append(snap)
    if snap.stopped or snap.config is None:
        return None
    throttled, ok, tail = seen
    return snap.config.rate, Window(throttled, ok, tail / snap.tpn)


def adapted(cfg: Config, rate: float) -> Config:
    """``cfg`` at ``rate``: an adaptive limiter's capacity follows its rate (the default burst)."""
    return cfg.replace(rate=rate, burst=None)


@dataclass(frozen=True)
class AdaptStats:
    """An adaptive limiter's parameters and what its controller saw and did."""

    min_rate: float  #: ops per ``per`` seconds
    max_rate: float  #: ops per ``per`` seconds
    decrease: float  #: the share of the rate a throttled window keeps
    increase: float  #: ops per ``per`` seconds a busy, clean window adds
    window: float  #: seconds between two decisions
    throttled: int  #: outcomes reported as throttled, by every process
    ok: int  #: outcomes reported as not throttled, by every process
    cuts: int  #: windows that cut the rate
    raises: int  #: windows that raised it


def stats(
    cells: "Cells",
    params: Tuple[int, ...] = L.ADAPT_PARAMS,
    counts: Tuple[int, int, int] = (L.ADAPT_THROTTLED, L.ADAPT_OK, L.ADAPT_DECISIONS),
    seq: int = L.CFG_SEQ,
) -> Optional[AdaptStats]:
    """What ``stats()`` and ``inspect`` show of the adaptive rate (None: the limiter does not
    adapt), from its parameters' words (under the config lock at ``seq``) and its counts'
    (throttled, ok, decisions): a limiter's by default, a keyed table's for every key
    (``keyed.adapt``)."""
    adapt = read(cells, params, seq)
    if adapt is None:
        return None
    throttled, ok, decisions = (cells.load(off) for off in counts)
    return AdaptStats(
        adapt.min_rate,
        adapt.max_rate,
        adapt.decrease,
        adapt.increase,  # type: ignore[arg-type]
        adapt.window,
        throttled,
        ok,
        decisions >> 32,
        decisions & 0xFFFFFFFF,
    )
