"""A limiter's configuration, its validation, and the token arithmetic derived from it.

Tokens are schedule time.  One token is ``1/tpn`` of a nanosecond, where the
integer ``tpn`` (tokens per nanosecond) is chosen once, when the segment is
created, and never changes (queued tickets and the clock keep their meaning).
It is as fine as the capacity allows, at most 65536, and a multiple of the
smallest denominator that makes the creation rate's op a whole number of tokens
when there is one: 1000 ops/s gets ``tpn`` 65536 and an op of 65 536 000 000
tokens, exactly; 7 000 000 ops/s gets ``tpn`` 57344 (7 * 8192), exactly.  Any
other rate (set later, or with no small denominator) costs ``ceil(ns_per_op *
tpn)`` tokens: rounded *up*, so the limiter is slower than asked by less than
``1 / (ns_per_op * tpn) <= 1 / tpn`` (below 2**-15 whenever ``tpn >= 2**15``,
which holds unless the capacity spans more than ~9.7 hours of schedule), and
never faster.
Replenishing adds exactly ``elapsed_ns * tpn`` tokens, so no fraction of time is
ever dropped and nothing drifts over hours.
"""

from __future__ import annotations

import math
import re
import time
from contextvars import ContextVar
from dataclasses import asdict, dataclass
from fractions import Fraction
from functools import cached_property
from typing import Callable, Optional, Tuple

NS_PER_S = 1_000_000_000
MAX_TPN = 1 << 16
#: Rover differences (capacity, queued work) must stay far below 2**63 for the
#: wrapping comparisons to hold; 2**60 tokens leaves room for a queue 7x as deep.
MAX_SPAN_TOKENS = 1 << 60
#: The queue (tail ahead of head) may hold at most this many tokens: with the capacity below
#: 2**60, every rover difference stays within (-2**62, 2**62], far from the sign flip at 2**63.
MAX_QUEUE_TOKENS = 1 << 62
#: The fastest limit accepted: one op per nanosecond.
MAX_OPS_PER_S = 1e9
#: Default capacity: this much schedule time, and never less than one op.
DEFAULT_BURST_SECONDS = 0.010
#: A parked waiter looks again at least this often, to notice rate changes and stops (seconds).
MAX_NAP = 0.25


def number(param: str, value: object, what: str = "a number (int or float)") -> float:
    """``value``, an int or a float (a bool is neither), as a float: an int beyond every float is
    an infinity of its sign, as ``1e400`` is.  Else TypeError saying ``param`` must be ``what``."""
    if not is_number(value):
        raise TypeError(f"{param} must be {what}, not {type(value).__name__}")
    try:
        return float(value)  # type: ignore[arg-type]
    except OverflowError:
        return math.inf if value > 0 else -math.inf  # type: ignore[operator]


def _positive_finite(param: str, value: object) -> float:
    v = number(param, value)
    if not math.isfinite(v) or v <= 0:
        raise ValueError(f"{param} must be finite and > 0, got {value!r}")
    return v


def default_burst(rate: float, per: float) -> float:
    """Capacity used when none is given: 10 ms of schedule, at least one op.

    Slow limits stay strict (``rate=1, per=6`` gets a capacity of one op, so two
    ops are never granted within 6 s); fast limits get at least ten fill
    intervals of the 1 kHz filler (``rate=1_000_000`` gets 10 000 ops), so a
    filler or waiter that is a few milliseconds late loses nothing.
    """
    return max(1.0, float(math.ceil(rate / per * DEFAULT_BURST_SECONDS)))


def _optional_seconds(param: str, value: object) -> Optional[float]:
    """None (no bound), or a finite number of seconds >= 0: a timeout's rules, but for infinity."""
    if value is None:
        return None
    v = _seconds(value, param)
    if math.isinf(v):
        raise ValueError(f"{param} must be None or a finite number of seconds >= 0, got {value!r}")
    return v


@dataclass(frozen=True)
class Config:
    """What a limiter promises: ``rate`` ops per ``per`` seconds, at most ``burst`` ops at once.

    ``ratio`` > 1 enables nosqlbench's catch-up: time the limiter could not
    use while its bucket was full is kept in a waiting pool (at most
    ``max_behind`` seconds of it; None = unbounded) and granted back at up to
    ``ratio * rate``.  ``max_reserved`` bounds, in seconds of schedule, how
    far ahead callers may queue (None = unbounded).  ``capped`` turns on
    capped release.
    """

    rate: float
    per: float = 1.0
    burst: float = 0.0  # resolved by make(): 0.0 is never stored
    capped: bool = False
    ratio: float = 1.0
    max_reserved: Optional[float] = None
    max_behind: Optional[float] = None

    @staticmethod
    def make(
        rate: object,
        per: object = 1.0,
        burst: object = None,
        capped: bool = False,
        ratio: object = None,
        max_reserved: object = None,
        max_behind: object = None,
        *,
        plain: Optional[str] = None,
    ) -> "Config":
        """Validate user input and resolve defaults.  Raises TypeError/ValueError naming the parameter.

        ``rate`` may also be a rate spec string, ``"12000"`` or ``"12K,1.1"``
        (see ``parse_spec``); a ratio given in both places must agree.  ``plain`` names a kind
        that takes neither a catch-up ratio nor a verb (``spec_values``).
        """
        if isinstance(rate, str):
            rate, per, ratio = spec_values(
                rate, per, ratio, ("configure", "start"), "when creating a limiter", plain
            )
        r = _positive_finite("rate", rate)
        p = _positive_finite("per", per)
        ops = r / p
        if ops > MAX_OPS_PER_S:
            raise ValueError(
                f"rate/per must be at most {MAX_OPS_PER_S:.0e} ops per second, got {ops:.6g}"
            )
        if burst is None:
            b = default_burst(r, p)
        else:
            b = _positive_finite("burst", burst)
            if b < 1:
                raise ValueError(
                    f"burst must be >= 1 op (the capacity must hold one op), got {burst!r}"
                )
        if not isinstance(capped, bool):
            raise TypeError(f"capped must be True or False, not {capped!r}")
        q = 1.0 if ratio is None else _positive_finite("ratio", ratio)
        if not 1.0 <= q <= MAX_RATIO:
            raise ValueError(f"ratio must be between 1.0 and {MAX_RATIO:g}, got {ratio!r}")
        mr = _optional_seconds("max_reserved", max_reserved)
        mb = _optional_seconds("max_behind", max_behind)
        cfg = Config(r, p, b, capped, q, mr, mb)
        cfg.check_at(cfg.tpn)
        return cfg

    def span_error(self, tpn: int) -> Optional[str]:
        """Why this config does not fit the rover arithmetic at ``tpn`` tokens per ns (None: it fits)."""
        if self.cap_at(tpn) + self.burst_pool_at(tpn) > MAX_SPAN_TOKENS:
            most = MAX_SPAN_TOKENS / tpn / NS_PER_S
            return (
                f"burst*per/rate must be at most {most:.6g} s of schedule at this limiter's token unit "
                f"(1/{tpn} ns), got {self.burst * self.per / self.rate:.6g} s "
                f"(burst={self.burst:g}, per={self.per:g}, rate={self.rate:g})"
            )
        for param, v in (("max_reserved", self.max_reserved), ("max_behind", self.max_behind)):
            if v is not None and v * NS_PER_S * tpn > MAX_SPAN_TOKENS:
                return (
                    f"{param} must be at most {MAX_SPAN_TOKENS / tpn / NS_PER_S:.6g} s, got {v:g}"
                )
        return None

    def check_at(self, tpn: int) -> None:
        """Raise ValueError unless every token quantity of this config fits at ``tpn`` (the segment's unit)."""
        err = self.span_error(tpn)
        if err is not None:
            raise ValueError(err)

    def replace(self, **changes: object) -> "Config":
        """A validated copy with some fields changed (None for burst means the rate's default)."""
        return Config.make(**{**asdict(self), **changes})  # type: ignore[arg-type]

    # -- derived token arithmetic -------------------------------------------------

    @property
    def ns_per_op(self) -> Fraction:
        return Fraction(self.per) * NS_PER_S / Fraction(self.rate)

    @cached_property
    def tpn(self) -> int:
        """Tokens per nanosecond for a segment created with this config (see the module docstring).

        A multiple of the smallest denominator (<= 65536) making an op whole,
        scaled up by a power of two as far as 65536; halved (losing exactness
        only then) while the capacity would not fit the rover arithmetic.
        """
        approx = self.ns_per_op.limit_denominator(MAX_TPN)
        t = approx.denominator if approx == self.ns_per_op else 1
        while t * 2 <= MAX_TPN:
            t *= 2
        while t > 1 and self.span_error(t) is not None:
            t //= 2
        return t

    def cost_at(self, tpn: int) -> int:
        """Tokens per op in a segment whose token is 1/tpn ns (rounded up: never faster)."""
        return max(1, math.ceil(self.ns_per_op * tpn))

    @property
    def cost(self) -> int:
        """Tokens per op (rounded up, so the limit is never exceeded)."""
        return self.cost_at(self.tpn)

    def cap_at(self, tpn: int) -> int:
        """The bucket's capacity in tokens: the head never runs further than this ahead of the tail."""
        cost = self.cost_at(tpn)
        return max(cost, math.floor(Fraction(self.burst) * cost))

    def burst_pool_at(self, tpn: int) -> int:
        """Catch-up room on top of the capacity: ``capacity * (ratio - 1)`` tokens."""
        return math.floor(Fraction(self.ratio - 1) * self.cap_at(tpn))

    @property
    def ops_per_second(self) -> float:
        return self.rate / self.per

    def describe(self) -> str:
        s = f"rate={self.rate:g} per={self.per:g}s burst={self.burst:g}"
        if self.ratio != 1.0:
            s += f" ratio={self.ratio:g}"
        if self.max_reserved is not None:
            s += f" max_reserved={self.max_reserved:g}s"
        if self.max_behind is not None:
            s += f" max_behind={self.max_behind:g}s"
        return s + (" capped" if self.capped else "")


# ---- rate specs: "12000", "12K,1.1", "12000,1.1,configure" ------------------------

MAX_RATIO = 100.0
VERBS = ("configure", "start", "restart", "stop")
_SUFFIX = {"K": 1e3, "M": 1e6, "G": 1e9}


#: The units of a rate string's window, in seconds ("N/unit", "N/<count>unit", "N per unit").
#: ``limits``' own units (second, minute, hour, day, month, year and their plurals) are also
#: accepted in any case, with its lengths: a month is 30 days, a year 360.
UNITS = {
    "s": 1.0, "sec": 1.0, "second": 1.0, "seconds": 1.0,
    "m": 60.0, "min": 60.0, "minute": 60.0, "minutes": 60.0,
    "h": 3600.0, "hour": 3600.0, "hours": 3600.0,
    "d": 86400.0, "day": 86400.0, "days": 86400.0,
    "month": 2_592_000.0, "months": 2_592_000.0,
    "year": 31_104_000.0, "years": 31_104_000.0,
}  # fmt: skip
_LIMITS_UNITS = frozenset(
    u + plural for u in ("second", "minute", "hour", "day", "month", "year") for plural in ("", "s")
)
RATE_FORMS = (
    "'N/unit', 'N/<count>unit' or 'N per <count> unit' (e.g. '10/s', '50/5s', '200K/min', "
    "'10 per second', '5 per 2 seconds'; N is ASCII digits with an optional '.', perhaps "
    "ending in K, M or G; unit one of s, sec, second, "
    "m, min, minute, h, hour, d, day, month, year, plurals allowed)"
)
#: A number in a rate string: ASCII digits with an optional '.' (no sign, exponent or '_').
_NUMBER = r"(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)"
#: A count, ratio or burst: a number, perhaps ending in K, M or G.
_COUNT = re.compile(rf"\s*({_NUMBER})([KMGkmg]?)\s*")
_WINDOW = re.compile(rf"^\s*({_NUMBER})?\s*([A-Za-z]+)\s*$")
#: Between a rate string's count and its window: "/" or the word "per" (``limits``' syntax).
_PER = re.compile(r"\s*(?:/|per)\s*", re.IGNORECASE)


@dataclass(frozen=True)
class RateSpec:
    """A parsed rate spec: ``rate[,ratio][,verb]``; ratio and verb are None when absent.

    ``per`` is the window in seconds when the rate was written ``"N/unit"``
    (``"50/5s"``: rate 50, per 5.0), and None when it was a bare number.
    """

    rate: float
    ratio: Optional[float] = None
    verb: Optional[str] = None
    per: Optional[float] = None

    def per_with(self, per: object, param: str = "per") -> object:
        """The window to use with a ``per`` also passed: the string's, which ``per`` may not contradict."""
        if self.per is None:
            return per
        if per is not None and not (is_number(per) and per in (1.0, self.per)):
            raise ValueError(
                f"{param} given twice: {per!r} and {self.per:g} s in the rate string; "
                f"leave {param} out (or 1.0) when the rate is written {RATE_FORMS}"
            )
        return self.per


def spec_values(
    text: str,
    per: object,
    ratio: object,
    verbs: Tuple[str, ...],
    where: str,
    plain: Optional[str] = None,
) -> Tuple[float, object, object]:
    """A rate given as a rate spec string, with the ``per`` and ``ratio`` also passed: its rate,
    its window (``RateSpec.per_with``) and its ratio (``ratio`` when it has none; a different one
    given twice is refused).  Its verb, if any, must be one of ``verbs`` (``where`` says where it
    is refused).  With ``plain`` (a kind's name: ``"a KeyedLimiter"``), the kind has no catch-up
    and no verbs: a ratio other than 1 or any verb is refused, not dropped."""
    spec = parse_spec(text)
    if plain is not None and (spec.verb is not None or spec.ratio not in (None, 1.0)):
        extra = (
            f"a catch-up ratio (',{spec.ratio:g}') applies only to a Limiter of one rate"
            if spec.ratio not in (None, 1.0)
            else f"a verb (',{spec.verb}') applies only to a Limiter of one rate (its apply(); "
            "stop() and start() pause and resume it)"
        )
        raise ValueError(
            f"rate {text!r}: {extra}; {plain} takes a number or a rate string such as '200K/min'"
        )
    if spec.verb not in (None, *verbs):
        raise ValueError(f"rate spec verb {spec.verb!r} is not allowed {where}")
    if (
        ratio is not None
        and spec.ratio is not None
        and _positive_finite("ratio", ratio) != spec.ratio
    ):
        raise ValueError(f"ratio given twice: {ratio!r} and {spec.ratio!r} in the rate spec")
    return spec.rate, spec.per_with(per), (spec.ratio if spec.ratio is not None else ratio)


def carried_per(rate: object) -> Optional[float]:
    """The window (seconds) a rate string ``"N/unit"`` carries; None for a number or a bare spec."""
    return parse_spec(rate).per if isinstance(rate, str) else None


def parse_rate(text: str, param: str = "rate") -> Tuple[float, float]:
    """Parse a rate string into ``(rate, per)``: ``"10/s"`` is (10, 1.0), ``"50/5s"`` (50, 5.0),
    ``"200K/min"`` (200000, 60.0), ``"5000/h"`` (5000, 3600.0); and ``limits``' syntax, as
    Flask-Limiter users write it: ``"10 per second"`` (10, 1.0), ``"5 per 2 seconds"`` (5, 2.0),
    ``"10/minute"`` (10, 60.0).

    A bare number (``"12K"``) is ops per second: (12000, 1.0).  Anything else raises ValueError
    naming ``param`` and the allowed forms.

    Every string ``limits.parse`` also accepts gives the same amount and window (tested).  What
    differs: ``limits`` allows ``amount`` hits in each window (its strategies count them), while a
    ``Limiter`` spreads them evenly, ``amount / window`` ops per second, with a burst of 10 ms of
    schedule (at least one op) unless ``burst=`` says more: ``burst=10`` for ``"10/minute"``
    gives its 10 at once.  Here the count may be fractional or end in K, M or G, the window may
    be fractional and the short units (s, m, h, d) are accepted; a count or window of 0 is
    refused (``limits`` reads a window of 0 as 1).  Several rates (``limits.parse_many``) go in
    ``rates=`` (``rate_group.rates_from_text``).
    """
    if not isinstance(text, str):
        raise TypeError(
            f"{param} must be a number or a string {RATE_FORMS}, not {type(text).__name__}"
        )
    if any(sep in text for sep in ";|"):
        raise ValueError(
            f"{param} holds one rate, got {text!r}: several rates taken together go in rates= "
            "(e.g. rates='10/minute; 100/hour')"
        )
    count, *rest = _PER.split(text, maxsplit=1)
    try:
        n = _spec_number(count, "the count", text)
    except ValueError:
        raise ValueError(
            f"{param} must be a positive number or {RATE_FORMS}; got {text!r}"
        ) from None
    if not rest:
        return n, 1.0
    window = rest[0]
    m = _WINDOW.match(window)
    unit = None if m is None else m.group(2)
    if unit is not None and unit not in UNITS and unit.lower() in _LIMITS_UNITS:
        unit = unit.lower()  # limits' units in any case: "10/Minute"; the short ones as written
    if unit not in UNITS:
        raise ValueError(
            f"{param} {text!r}: the window must be {RATE_FORMS}; got {window.strip()!r}"
        )
    k = 1.0 if m.group(1) is None else float(m.group(1))
    if not math.isfinite(k) or k <= 0:
        raise ValueError(f"{param} {text!r}: the window's count must be > 0, got {m.group(1)!r}")
    return n, k * UNITS[unit]


def _spec_number(text: str, what: str, spec: str) -> float:
    m = _COUNT.fullmatch(text)
    if m is None:
        forms = f", or {RATE_FORMS}" if what == "rate" else ""
        raise ValueError(
            f"rate spec {spec!r}: {what} must be a number > 0, ASCII digits with an optional '.' "
            f"(K/M/G suffixes allowed){forms}; got {text!r}"
        )
    v = float(m.group(1)) * (_SUFFIX[m.group(2).upper()] if m.group(2) else 1.0)
    if not math.isfinite(v) or v <= 0:
        raise ValueError(f"rate spec {spec!r}: {what} must be finite and > 0, got {text!r}")
    return v


def parse_spec(spec: str) -> RateSpec:
    """Parse nosqlbench's ``rate[,ratio][,verb]``: ``"12000"``, ``"12K,1.1"``, ``"5M,1.05,configure"``, ``"1000,stop"``.

    ``rate`` is in ops per second (per the limiter's ``per``), with K, M or G
    meaning 1e3, 1e6, 1e9, or a rate string ``"N/unit"`` (``parse_rate``:
    ``"200K/min,1.1"``) that carries its own window (``RateSpec.per``); ``ratio`` >= 1 is the catch-up ratio; ``verb`` is
    one of configure, start, restart, stop.
    """
    if not isinstance(spec, str):
        raise TypeError(f"rate spec must be a str, not {type(spec).__name__}")
    parts = [p.strip() for p in spec.split(",")]
    verb = None
    if parts and parts[-1].lower() in VERBS:
        verb = parts.pop().lower()
    if not 1 <= len(parts) <= 2 or not parts[0]:
        raise ValueError(
            f"rate spec must look like 'rate[,ratio][,verb]' with verb one of {', '.join(VERBS)}; got {spec!r}"
        )
    per = None
    if _PER.search(parts[0]):
        rate, per = parse_rate(parts[0])
    else:
        rate = _spec_number(parts[0], "rate", spec)
    ratio = _spec_number(parts[1], "ratio", spec) if len(parts) == 2 else None
    if ratio is not None and not 1.0 <= ratio <= MAX_RATIO:
        raise ValueError(
            f"rate spec {spec!r}: ratio must be between 1.0 and {MAX_RATIO:g}, got {ratio:g}"
        )
    return RateSpec(rate, ratio, verb, per)


def is_number(value: object) -> bool:
    """An int or a float, not a bool: ``True`` is no count of seconds or ops."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def is_int(value: object, low: int, high: float = math.inf) -> bool:
    """An int (not a bool) from ``low`` to ``high``."""
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def validate_n(n: object, cost: Optional[int] = None) -> int:
    """``n`` must be a positive int; given the ``cost`` of an op in tokens, small enough that n ops
    of tokens fit the rover arithmetic."""
    if isinstance(n, bool) or not isinstance(n, int):
        raise TypeError(f"n must be a positive int (ops), not {type(n).__name__}")
    if n < 1:
        raise ValueError(f"n must be a positive int (ops), got {n}")
    if (
        cost is not None and n * cost > MAX_SPAN_TOKENS
    ):  # one request; the queue as a whole is bounded by MAX_QUEUE_TOKENS
        raise ValueError(
            f"n must be at most {MAX_SPAN_TOKENS // cost} ops for this limiter, got {n}"
        )
    return n


def _seconds(value: object, param: str) -> float:
    """A number of seconds >= 0 (infinity included), else TypeError or ValueError naming ``param``."""
    t = number(param, value, "None or a number of seconds >= 0")
    if math.isnan(t) or t < 0:
        raise ValueError(f"{param} must be None or a number of seconds >= 0, got {value!r}")
    return t


def validate_timeout(timeout: object, param: str = "timeout") -> Optional[float]:
    """None (wait as long as it takes) or a number of seconds >= 0 whose nanoseconds are finite:
    +inf, and a number too large to count in nanoseconds (past about 1.8e299 s), mean None: no
    limit, for every kind (a deadline computed from it would overflow)."""
    if timeout is None:
        return None
    t = _seconds(timeout, param)
    return None if math.isinf(t * NS_PER_S) else t


def validate_clock(clock: object) -> Callable[[], int]:
    """``clock``: None (``time.monotonic_ns``, returned) or a callable that reads CLOCK_MONOTONIC
    in nanoseconds, an int from 0 to 2**63 - 1, as ``time.monotonic_ns`` does; read once here, so
    that a wrong one (``time.time``: seconds, a float) is refused before any segment is opened."""
    if clock is None:
        return time.monotonic_ns
    if not callable(clock):
        raise TypeError(f"clock must be None or a callable returning nanoseconds, got {clock!r}")
    reading = clock()
    if isinstance(reading, bool) or not isinstance(reading, int):
        raise TypeError(
            "clock must return CLOCK_MONOTONIC nanoseconds as an int (as time.monotonic_ns "
            f"does), got {reading!r}"
        )
    if not 0 <= reading < 1 << 63:
        raise ValueError(f"clock must return nanoseconds from 0 to 2**63 - 1, got {reading!r}")
    return clock  # type: ignore[return-value]


def creation_only(**given: bool) -> None:
    """Options given (by name: True) to a constructor called without ``rate=``, which attaches to
    the limiter as it is: each would configure a limiter this call creates, so each is refused
    (ValueError) rather than dropped unseen."""
    names = [k + "=" for k, v in given.items() if v]
    if names:
        raise ValueError(
            f"{', '.join(names)} apply only when rate= creates the limiter (without rate= this call "
            "attaches to it as it is); to change a running one use set_rate, or pass "
            "rate= with reconfigure=True"
        )


def validate_reconfigure(reconfigure: object, configured: bool, what: str) -> None:
    """``reconfigure``: True or False, and True only given a configuration to apply (``what``, for the message)."""
    if not isinstance(reconfigure, bool):
        raise ValueError(f"reconfigure must be True or False, got {reconfigure!r}")
    if reconfigure and not configured:
        raise ValueError(f"reconfigure=True needs rate= ({what})")


_CHECKING_ONLY: ContextVar[bool] = ContextVar("shmlimit_checking_only", default=False)


class _Checked(Exception):
    """``arguments_checked`` under ``check_arguments``: every argument passed."""


def arguments_checked() -> None:
    """Called by each limiter's constructor once all its arguments are checked, before it opens
    or creates anything: under ``check_arguments`` the construction stops there."""
    if _CHECKING_ONLY.get():
        raise _Checked


def check_arguments(make: Callable[..., object], *args: object, **kwargs: object) -> None:
    """Refuse now what ``make(*args, **kwargs)`` (a limiter's constructor) would, by its own checks,
    opening and creating nothing: the construction runs up to its ``arguments_checked()``."""
    token = _CHECKING_ONLY.set(True)
    try:
        make(*args, **kwargs)
    except _Checked:
        return
    finally:
        _CHECKING_ONLY.reset(token)
    raise AssertionError(f"{make.__name__} opened a limiter before arguments_checked()")
