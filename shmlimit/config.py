"""A limiter's configuration, its validation, and the token arithmetic derived from it.

Tokens are schedule time.  One token is ``1/tpn`` of a nanosecond, where the
integer ``tpn`` (tokens per nanosecond) is chosen once, when the segment is
created, so that one op costs a whole number of tokens: for 1000 ops/s one op
is 1 000 000 tokens of 1 ns; for 7 000 000 ops/s ``tpn`` is 7 and an op costs
1000 tokens.  Replenishing adds exactly ``elapsed_ns * tpn`` tokens, so no
fraction of time is ever dropped and nothing drifts over hours.  When the exact
fraction would need ``tpn`` above 65536, the op cost is rounded *up*: the
limiter is then slower than asked by less than one part in 2**32, never faster.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Optional

NS_PER_S = 1_000_000_000
MAX_TPN = 1 << 16
#: Rover differences (capacity, queued work) must stay far below 2**63 for the
#: wrapping comparisons to hold; 2**60 tokens leaves room for a queue 7x as deep.
MAX_SPAN_TOKENS = 1 << 60
#: The fastest limit accepted: one op per nanosecond.
MAX_OPS_PER_S = 1e9
#: Default capacity: this much schedule time, and never less than one op.
DEFAULT_BURST_SECONDS = 0.010


def _positive_finite(param: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{param} must be a number (int or float), not {type(value).__name__}")
    v = float(value)
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


@dataclass(frozen=True)
class Config:
    """What a limiter promises: ``rate`` ops per ``per`` seconds, at most ``burst`` ops at once."""

    rate: float
    per: float = 1.0
    burst: float = 0.0  # 0.0 means "the default for this rate"; resolved by make()
    capped: bool = False

    @staticmethod
    def make(rate: object, per: object = 1.0, burst: object = None, capped: bool = False) -> "Config":
        """Validate user input and resolve the default burst.  Raises TypeError/ValueError naming the parameter."""
        r = _positive_finite("rate", rate)
        p = _positive_finite("per", per)
        ops = r / p
        if ops > MAX_OPS_PER_S:
            raise ValueError(f"rate/per must be at most {MAX_OPS_PER_S:.0e} ops per second, got {ops:.6g}")
        if burst is None:
            b = default_burst(r, p)
        else:
            b = _positive_finite("burst", burst)
            if b < 1:
                raise ValueError(f"burst must be >= 1 op (the capacity must hold one op), got {burst!r}")
        if not isinstance(capped, bool):
            raise TypeError(f"capped must be True or False, not {capped!r}")
        cfg = Config(r, p, b, capped)
        span = cfg.cap_tokens
        if span > MAX_SPAN_TOKENS:
            most = MAX_SPAN_TOKENS / cfg.tpn / NS_PER_S
            raise ValueError(
                f"burst*per/rate must be at most {most:.6g} s of schedule, got {b * p / r:.6g} s "
                f"(burst={b:g}, per={p:g}, rate={r:g})"
            )
        return cfg

    # -- derived token arithmetic -------------------------------------------------

    @property
    def ns_per_op(self) -> Fraction:
        return Fraction(self.per) * NS_PER_S / Fraction(self.rate)

    @property
    def tpn(self) -> int:
        """Tokens per nanosecond: the smallest denominator (<= 65536) making an op whole."""
        return self.ns_per_op.limit_denominator(MAX_TPN).denominator

    @property
    def cost(self) -> int:
        """Tokens per op (rounded up, so the limit is never exceeded)."""
        return max(1, math.ceil(self.ns_per_op * self.tpn))

    @property
    def cap_tokens(self) -> int:
        """The bucket's capacity in tokens: the head never runs further than this ahead of the tail."""
        return max(self.cost, math.floor(Fraction(self.burst) * self.cost))

    @property
    def ops_per_second(self) -> float:
        return self.rate / self.per

    def describe(self) -> str:
        s = f"rate={self.rate:g} per={self.per:g}s burst={self.burst:g}"
        return s + (" capped" if self.capped else "")


def validate_n(n: object, cost: int) -> int:
    """``n`` must be a positive int small enough that n ops of tokens fit the rover arithmetic."""
    if isinstance(n, bool) or not isinstance(n, int):
        raise TypeError(f"n must be a positive int (ops), not {type(n).__name__}")
    if n < 1:
        raise ValueError(f"n must be a positive int (ops), got {n}")
    if n * cost > MAX_SPAN_TOKENS:
        raise ValueError(f"n must be at most {MAX_SPAN_TOKENS // cost} ops for this limiter, got {n}")
    return n


def validate_timeout(timeout: object, param: str = "timeout") -> Optional[float]:
    """None (wait as long as it takes) or a finite number of seconds >= 0; +inf means None."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(f"{param} must be None or a number of seconds >= 0, not {type(timeout).__name__}")
    t = float(timeout)
    if math.isnan(t) or t < 0:
        raise ValueError(f"{param} must be None or a number of seconds >= 0, got {timeout!r}")
    return None if math.isinf(t) else t
