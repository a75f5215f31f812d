"""Several rates taken together: what both kinds share, ``Limiter(rates=)`` (``multirate``) and
``KeyedLimiter(rates=)`` (``keyed.multi``), each one segment under its name with a region per rate
(``group``).

``rates=`` is a list, a dict or one string; its rates are named by key (``"0"``, ``"1"``, ...
for a list); a call costs ``n`` ops on every rate or
its keyword costs by name; a live change names one rate by key or index.  How the rates are
taken together is each kind's own.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import (
    Any,
    Dict,
    Iterable,
    Iterator,
    List,
    Mapping,
    Optional,
    Sequence,
    Tuple,
    Union,
)

from shmlimit.adapt import Adapt
from shmlimit.config import Config, carried_per, parse_rate, validate_n
from shmlimit.shm.segment import NAME_MAX
from shmlimit.shm.segment import unlink as _unlink_name

_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
#: Keys that would collide with the calls' own parameters (a keyed limiter's, ``key`` too:
#: ``parse_rates``' ``reserved``).
RESERVED = ("n", "timeout", "max_wait", "which", "self")
#: A limiter holds at most this many rates (``rates=``; its group's header, ``group``, as many).
MAX_RATES = 16
#: One rate of ``rates=``: a rate (``"5000/h"``, ops per second) or a pair (rate, burst in ops).
RateValue = Union[str, float, Tuple[Union[str, float], float]]
#: ``rates=``: a list of rates, a dict of name -> rate, or one string holding either.
Rates = Union[str, Sequence[RateValue], Mapping[str, RateValue]]
#: ``adapt=`` with ``rates=``: by rate name (a dict of rates), or in the rates' order (a list).
AdaptRates = Union[Mapping[str, Optional[Adapt]], Sequence[Optional[Adapt]], None]


#: Between the items of ``rates=`` written as one string: ``limits``' separators.
_SEPARATORS = re.compile(r"[;,|]")


def rates_from_text(text: str) -> Union[List[RateValue], Dict[str, RateValue]]:
    """``rates=`` written as one string, items separated by ``;`` (or ``,`` or ``|``, as
    ``limits.parse_many`` reads them): ``"5000/h; 100/min"`` and ``"10/minute;100/hour"`` (a list),
    ``"requests=500/min; tokens=200K/min burst=20K"`` (a dict: every item named, or none).  Each
    item is a rate string (``config.parse_rate``: ``"10 per second"`` too), with an optional
    ``burst=N`` (ops; K/M/G suffixes)."""
    items = [part.strip() for part in _SEPARATORS.split(text)]
    if not all(items):
        raise ValueError(f"rates: items are separated by ';' and none may be empty, got {text!r}")
    named: Dict[str, RateValue] = {}
    listed: List[RateValue] = []
    for item in items:
        body, _, last = item.rpartition(" ")
        if not last.startswith("burst="):
            body, last = item, ""
        key, sep, rate = body.rpartition("=")
        key, rate = key.strip(), rate.strip()
        if "burst=" in body or not rate:
            raise ValueError(f"rates: each item is [name=]RATE [burst=N], got {item!r}")
        value: RateValue = rate
        if last:
            count = last[len("burst=") :]
            burst, _ = parse_rate(count, "burst")
            if carried_per(count) is not None:  # it carries a window: a rate, not a count
                raise ValueError(
                    f"rates: a burst is a number of ops (e.g. burst=20K), got {last!r}"
                )
            value = (rate, burst)
        if sep:
            if key in named:
                raise ValueError(f"rates: the name {key!r} is given twice")
            named[key] = value
        else:
            listed.append(value)
    if named and listed:
        raise ValueError(f"rates: name every item (name=RATE) or none, got {text!r}")
    return named or listed


def parse_rates(
    name: str, rates: object, reserved: Tuple[str, ...] = RESERVED
) -> Tuple[Tuple[str, ...], Tuple[Config, ...], bool]:
    """``rates=`` as (keys, configs, named).  A list's keys are "0", "1", ...; a dict's are its own,
    none of them ``reserved`` (the names of the calls' own parameters).

    Each value is a rate (``"5000/h"``, ``"200K/min"``, a number of ops per
    second) or a pair ``(rate, burst)``; the capacity defaults as for one rate.
    One string stands for either (``rates_from_text``).
    """
    if isinstance(rates, str):
        rates = rates_from_text(rates)
    if isinstance(rates, Mapping):
        items = list(rates.items())
        named = True
    elif isinstance(rates, (list, tuple)):
        items = [(str(i), v) for i, v in enumerate(rates)]
        named = False
    else:
        raise TypeError(
            f"rates must be a list of rates or a dict of name -> rate, not {type(rates).__name__}"
        )
    if not 1 <= len(items) <= MAX_RATES:
        raise ValueError(f"rates must hold 1 to {MAX_RATES} rates, got {len(items)}")
    keys: List[str] = []
    cfgs: List[Config] = []
    for key, value in items:
        if named and (not isinstance(key, str) or not _KEY.fullmatch(key) or key in reserved):
            raise ValueError(
                f"rates: each name must be a Python identifier of ASCII letters, digits and '_', "
                f"and not one of {', '.join(reserved)}; got {key!r}"
            )
        if len(name) + 1 + len(key) > NAME_MAX:
            raise ValueError(
                f"rates: name {name!r} plus '.{key}' must be at most {NAME_MAX} characters"
            )
        if isinstance(value, tuple) and len(value) != 2:
            raise ValueError(
                f"rates[{key!r}]: a rate with its burst is a pair (rate, burst), got {value!r}"
            )
        rate, burst = value if isinstance(value, tuple) else (value, None)
        try:
            cfgs.append(Config.make(rate, 1.0, burst, plain="each rate of rates="))
        except (TypeError, ValueError) as e:
            raise type(e)(f"rates[{key!r}]: {e}") from None
        keys.append(key)
    return tuple(keys), tuple(cfgs), named


def group_options(
    rate: Any,
    per: Any,
    burst: Any,
    args: Tuple[Any, ...],
    kwargs: Dict[str, Any],
    allowed: Iterable[str],
    *,
    one: str,
    example: str,
    drop_none: bool = False,
) -> Dict[str, Any]:
    """The options of a constructor called with ``rates=``: no single rate (``rate``, ``per``,
    ``burst`` or more positional arguments: TypeError, naming ``one`` rate's kind and an
    ``example`` of ``rates=``), and only ``allowed`` options (TypeError naming the others, as for
    an unexpected keyword; with ``drop_none``, an option left None is dropped, not refused)."""
    single = [k for k, v in (("rate", rate), ("burst", burst)) if v is not None]
    single += ["per"] * (per != 1.0) + ["more positional arguments"] * bool(args)
    if single:
        raise TypeError(
            f"give either rate= ({one}) or rates= (several), not both (got {', '.join(single)} "
            f"with rates=); with rates=, each rate carries its window and its burst: "
            f"rates={example}"
        )
    allowed = set(allowed)
    given = {k: v for k, v in kwargs.items() if not (drop_none and v is None and k not in allowed)}
    extra = sorted(k for k in given if k not in allowed)
    if extra:
        raise TypeError(
            f"{', '.join(extra)} not supported with rates= (allowed: {', '.join(sorted(allowed))})"
        )
    return given


@dataclass(frozen=True)
class MultiStats(Mapping[str, Any]):
    """A snapshot of every rate of a limiter of several rates (``rates`` by key, in order): each
    a ``Stats``, or a ``KeyedStats`` for a keyed one.  It reads as a mapping of ``rates`` too."""

    name: str
    rates: Dict[str, Any]

    def __getitem__(self, key: str) -> Any:
        return self.rates[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.rates)

    def __len__(self) -> int:
        return len(self.rates)

    @property
    def grants(self) -> Dict[str, int]:
        """Ops granted on each rate (charges included; refunds are not subtracted)."""
        return {k: s.grants for k, s in self.rates.items()}

    @property
    def processes(self) -> Tuple[Any, ...]:
        """The processes registered in any rate, once each (alive if alive in any; grants: the
        most it was granted on one rate; waiting or filler, where a rate says so, if in any)."""
        by_pid: Dict[int, Any] = {}
        for s in self.rates.values():
            for p in s.processes:
                q = by_pid.get(p.pid)
                if q is None:
                    by_pid[p.pid] = p
                    continue
                flags = {
                    f: getattr(q, f) or getattr(p, f)
                    for f in ("waiting", "filler")
                    if hasattr(q, f)
                }
                by_pid[p.pid] = replace(
                    q, alive=q.alive or p.alive, grants=max(q.grants, p.grants), **flags
                )
        return tuple(by_pid.values())


class RateGroup:
    """A limiter of several rates, as far as its kind does not matter: its name and its rates'
    keys, a call's ops per rate, a rate named by key or index, its segments unlinked.  A subclass
    sets ``_name``, ``_keys`` (its rates' keys, in order) and ``_named`` (a dict of rates);
    ``_what`` names its kind in errors."""

    _what = "limiter"
    _name: str
    _keys: Tuple[str, ...]
    _named: bool

    @property
    def name(self) -> str:
        return self._name

    @property
    def keys(self) -> Tuple[str, ...]:
        """The rates' keys, in order ("0", "1", ... for a list)."""
        return self._keys

    def unlink(self) -> None:
        """Remove the limiter's segment (every rate's).  Raises ``LimiterNotFoundError`` when none."""
        _unlink_name(self._name)

    def _by_name(
        self, values: Dict[str, object], n: object, n_default: int, what: str
    ) -> List[object]:
        """``values`` given per rate by name, in the rates' order (0 for a rate not named); refused
        on a list of rates, with ``n`` given too (not ``n_default``), or with a name not a rate's."""
        if not self._named:
            raise TypeError(
                f"{self._what} {self._name!r} has a list of rates: give n (ops on every rate), not {sorted(values)}"
            )
        if n != n_default:
            raise TypeError(
                f"give either n (ops on every rate) or a {what} per rate by name, not both"
            )
        unknown = sorted(set(values) - set(self._keys))
        if unknown:
            raise TypeError(
                f"unknown rate(s) {unknown}: the rates of {self._name!r} are {', '.join(self._keys)}"
            )
        return [values.get(k, 0) for k in self._keys]

    def _ops(self, n: object, costs: Dict[str, object]) -> Tuple[int, ...]:
        """Ops on each rate: ``n`` on every one, or the keywords' (rates not named cost nothing)."""
        if not costs:  # (each rate's own check bounds n by what its rovers can hold)
            return tuple(validate_n(n) for _ in self._keys)
        out = []
        for k, v in zip(self._keys, self._by_name(costs, n, 1, "cost")):
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(
                    f"{k} must be an int >= 0 (ops of that rate), not {type(v).__name__}"
                )
            if v < 0:
                raise ValueError(f"{k} must be an int >= 0 (ops of that rate), got {v!r}")
            out.append(v)
        if not any(out):
            raise ValueError(f"at least one cost must be > 0, got {costs!r}")
        return tuple(out)

    def _index(self, which: Union[str, int]) -> int:
        """The position of the rate ``which`` names: its key, or its index (negative from the end)."""
        if isinstance(which, bool) or not isinstance(which, (str, int)):
            raise TypeError(f"which must be a rate's name or index, not {type(which).__name__}")
        if isinstance(which, int):
            if not -len(self._keys) <= which < len(self._keys):
                raise ValueError(
                    f"which must be an index from {-len(self._keys)} to {len(self._keys) - 1}, "
                    f"got {which}"
                )
            return which % len(self._keys)
        if which not in self._keys:
            raise ValueError(f"which must be one of {', '.join(self._keys)}, got {which!r}")
        return self._keys.index(which)

    def _told(self, which: object, adaptive: List[int]) -> List[int]:
        """The rates an outcome is reported to (``feedback``'s ``which``): every rate that adapts
        (``adaptive``, their indices), or those ``which`` names (a rate's name or index, or a list
        of them), each of which must adapt."""
        if not adaptive:
            raise ValueError(
                f"feedback() needs a {self._what} created with adapt=; no rate of "
                f"{self._name!r} adapts"
            )
        if which is None:
            return adaptive
        if isinstance(which, (bytes, bytearray)):  # (a sequence of ints: each taken as an index)
            raise TypeError(f"which must be a rate's name or index, not {type(which).__name__}")
        try:
            named = [which] if isinstance(which, (str, int)) else list(which)  # type: ignore[call-overload]
        except TypeError:  # (not a list of them either)
            raise TypeError(
                f"which must be a rate's name or index, or a list of them, not {type(which).__name__}"
            ) from None
        if not named:  # (an outcome reported to no rate would be lost without a word)
            raise ValueError("which must name at least one rate, got an empty list")
        chosen = sorted({self._index(w) for w in named})
        still = [self._keys[i] for i in chosen if i not in adaptive]
        if still:
            raise ValueError(
                f"which must name rates that adapt ({', '.join(self._keys[i] for i in adaptive)}), "
                f"got {', '.join(still)}"
            )
        return chosen


class RatesSwitch:
    """The ``rates=`` switch of a limiter's constructor: called with it, the class makes a limiter
    of several rates instead (``cls._several``: a different class, so that the single rate's hot
    paths carry no test for it)."""

    def __new__(
        cls,
        name: str = "",
        rate: Any = None,
        per: Any = 1.0,
        burst: Any = None,
        *args: Any,
        rates: Any = None,
        **kwargs: Any,
    ) -> Any:
        if rates is None:
            return super().__new__(cls)
        return cls._several(name, rates, rate, per, burst, args, kwargs)  # type: ignore[attr-defined]
