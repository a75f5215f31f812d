"""Each key adapts on its own: a ``KeyedLimiter``'s adaptive rate, per key (a crawler's hosts).

The controller and who decides are a Limiter's (``adapt.decide``: additive increase,
multiplicative decrease, within ``[min_rate, max_rate]``; ``adapt.report``: the reporter that finds
a window over claims and decides it); what is per key is where its state lives.

* **Where.**  A key's rate is its override (``set_rate(key=)``'s entry), and its window lives in
  the entry's spare words (``layout.A_*``): the outcomes reported for the key by every process
  (one fetch-add), the window's start, and the outcomes and the key's grants then.  A key gets
  its entry, at the default rate, on its first outcome; the default rate is where every key
  starts and does not adapt itself.
* **Who.**  The reporter, as for a Limiter: a window is decided once however many processes
  report on the key, and there is nothing to elect.  A key nobody reports on is never decided:
  an idle key is never raised, and no process walks the keys.
* **Busy.**  As a Limiter's, a clean window raises a key only if its callers took ``DEMAND`` of
  the window's schedule: the key's grants (its slot's count) times its emission interval.  A
  key whose slot was given up meanwhile counts as idle (no raise).

The rate decided is published as ``set_rate(key=)`` publishes one, so the per-key window bound
holds for the rate in force at each instant.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, List, Optional, Sequence, Tuple

from shmlimit.adapt import Adapt, AdaptStats, Window, at_per
from shmlimit.adapt import read as read_params
from shmlimit.adapt import report as report_window
from shmlimit.adapt import restart as restart_window
from shmlimit.adapt import stats as fleet_stats
from shmlimit.config import NS_PER_S
from shmlimit.errors import ConfigWriterTakenOver
from shmlimit.keyed import layout as K
from shmlimit.keyed.gcra import Rate, make_rate, read_default

if TYPE_CHECKING:  # pragma: no cover
    from shmlimit.shm.cells import Cells

#: A keyed limiter's attachment (``keyed.limiter``): its ``cells``, ``overrides`` and
#: ``reference()`` (the table's Python composite).
Attachment = Any

_OK_BITS = 32  #: A_OUT: throttled outcomes above these bits, ok ones below (a window's < 2**31)


def read(c: "Cells") -> Optional[Adapt]:
    """The table's per-key parameters (None: its keys do not adapt)."""
    return read_params(c, K.ADAPT_PARAMS, K.CFG_SEQ)


def check(adapt: Adapt, rate: Rate) -> None:
    """Raise ValueError unless keys can start from ``rate`` (the default) and adapt within
    ``adapt``'s bounds, each bound a rate a key can be given."""
    if not adapt.min_rate <= rate.rate <= adapt.max_rate:
        raise ValueError(
            f"rate must be within adapt's bounds, from {adapt.min_rate:g} to "
            f"{adapt.max_rate:g} ops per {rate.per:g} s, got {rate.rate:g}"
        )
    for bound in (adapt.min_rate, adapt.max_rate):
        make_rate(bound, rate.per, None)


def check_start(adapt: Adapt, rate: Rate) -> None:
    """Raise ValueError unless a table created at ``rate`` (its default) can adapt by ``adapt``: a
    burst of its own is refused (a key's capacity follows its rate), then as ``check``."""
    if rate != make_rate(rate.rate, rate.per, None):
        raise ValueError(
            "burst cannot be combined with adapt: the capacity follows the rate "
            "(10 ms of schedule, at least one op)"
        )
    check(adapt, rate)


def check_rate(adapt: Adapt, cur: Rate, new: Rate) -> None:
    """A rate ``set_rate`` may set on a table whose keys adapt: within the bounds, per and the
    capacity as the bounds assume."""
    if new.per != cur.per:
        raise ValueError(
            f"per cannot change on an adaptive keyed limiter (its bounds are ops per "
            f"{cur.per:g} s), got {new.per:g}"
        )
    if new != make_rate(new.rate, new.per, None):
        raise ValueError(
            "burst cannot be set on an adaptive keyed limiter: the capacity follows the rate "
            "(10 ms of schedule, at least one op)"
        )
    check(adapt, new)


def report(
    att: Attachment, adapt: Adapt, d: Tuple[int, int], throttled: bool, clock: Callable[[], int]
) -> bool:
    """Count one outcome for the key of digest ``d``, first deciding its window if it is over (on
    ``clock``: CLOCK_MONOTONIC ns, or an injected one).  False (nothing counted) when the key has
    no override entry and none is free near it: it keeps the rate it has."""
    e = _entry(att, d)
    if e is None:
        return False
    c = att.cells
    words = (e + K.A_START, K.ADAPT_DECISIONS, (e + K.A_SEEN_OUT, e + K.A_SEEN_GRANTS))

    def counts() -> Tuple[int, int]:
        return c.load(e + K.A_OUT), _grants(att, d)

    owner = c.load(e + K.A_OWNER)
    if owner != d[0] and c.cas(e + K.A_OWNER, owner, d[0]):
        # an entry another key held (or none): its window starts afresh (a reporter that read the
        # words before this restart decides at most one window from the old ones, within the
        # bounds, and publishes nothing: the entry is not its key's any more)
        restart_window(c, clock, words, counts)
    judged: List[Tuple[Optional[Rate], float]] = []  # the key's override judged, the per decided at

    def publish(rate: float) -> bool:
        if att.overrides.entry(d) != e:  # (no longer the key's)
            return False
        over, per = judged[0]  # only over that override: a change published since then stands
        try:
            return att.overrides.set(d, make_rate(rate, per, None), over)
        except ConfigWriterTakenOver:
            return False  # stalled past the lock's timeout: the writer that took over stands

    report_window(
        c, adapt, clock, words, counts, lambda seen: _judge(att, d, seen, judged), publish
    )
    c.fetch_add(e + K.A_OUT, 1 << _OK_BITS if throttled else 1)
    c.fetch_add(K.ADAPT_THROTTLED if throttled else K.ADAPT_OK, 1)
    return True


def _entry(att: Attachment, d: Tuple[int, int]) -> Optional[int]:
    """The key's override entry, given one at the default rate if it has none (None: no room)."""
    e = att.overrides.entry(d)
    if e is not None:
        return e
    cur = read_default(att.cells)
    try:  # only while it has none: a rate another process gave it since the look above stands
        att.overrides.set(d, make_rate(cur.rate, cur.per, None), None)
    except ValueError:  # the override table is full near this key
        return None
    except ConfigWriterTakenOver:
        pass  # stalled past the lock's timeout: whatever the writer that took over left
    return att.overrides.entry(d)


def _grants(att: Attachment, d: Tuple[int, int]) -> int:
    """The grants the key's slot counts (0 when it holds none)."""
    kt = att.reference()
    s, _ = kt.find(d, (d[0] * kt.nslots) >> 64)  # (the slot's home, as every lookup computes it)
    return 0 if s is None else att.cells.load(s + K.S_V1)


def _judge(
    att: Attachment,
    d: Tuple[int, int],
    seen: Sequence[int],
    judged: List[Tuple[Optional[Rate], float]],
) -> Tuple[float, Window]:
    """The key's window: its outcomes, and its grants at its rate in force (a count that went back:
    the slot changed tenants, the key was idle long enough to give it up: no grant); the key's
    override and the per it is decided at are added to ``judged``.  That is the default's, the
    bounds' per: an override left at another per by a redeploy is judged at its pace in it."""
    over = att.overrides.get(d)
    default = read_default(att.cells)
    rate = over or default
    judged.append((over, default.per))
    out, took = seen
    ok = out & ((1 << _OK_BITS) - 1)
    return at_per(rate.rate, rate.per, default.per), Window(
        out >> _OK_BITS, ok, took * rate.per / rate.rate * NS_PER_S
    )


def stats(c: "Cells") -> Optional[AdaptStats]:
    """The per-key parameters, and the outcomes and decisions of every key (None: no adapt)."""
    return fleet_stats(
        c, K.ADAPT_PARAMS, (K.ADAPT_THROTTLED, K.ADAPT_OK, K.ADAPT_DECISIONS), K.CFG_SEQ
    )
