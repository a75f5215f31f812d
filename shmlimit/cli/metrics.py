"""Prometheus metrics for the limiters of this machine, read without joining any of them.

Every figure comes from ``shmlimit.inspect``, which reads a copy of a segment (pread, never a mapping) without
registering in its process table, never takes part in the filler election and
writes nothing: scraping a limiter cannot change it, start a thread in it or
hold one of its 128 process slots.

``families(names)`` gathers the metric families as plain data; ``exposition``
renders them in the Prometheus text format (version 0.0.4), which is what
``shmlimit metrics`` prints and serves.  ``shmlimit.integrations.prometheus``
turns the same families into ``prometheus_client`` metrics.  This module itself
needs nothing beyond the standard library.

Cardinality is bounded: one label, ``limiter``, whose values are the limiter
names; no label per process or per key.  Which segments are exported is
bounded too (``select``): by default only those owned by this user, root or
``trusted_uids`` (another local user can create any number of segments, with
any values in them), and at most ``max_segments`` of them (``MAX_SEGMENTS``),
the first by name; what is left out is counted in
``shmlimit_omitted_segments{reason="untrusted_owner"|"over_cap"}``.  Keyed limiters share the families
that apply to them (grants, rate, capacity, processes) and have their own
(``shmlimit_keyed_*``: live keys, slots, evictions, refusals of new keys).
An adaptive rate (``adapt=``) adds ``shmlimit_adapt_*``: the outcomes reported
and the windows that cut or raised it (a keyed limiter's: of all its keys,
each key's own rate being its override, never a label).
A table of window counters (the ``limits`` storage ``shm://``) has no rate of
its own: it gets grants (the hits it granted), ``shmlimit_window_hits`` (every
hit asked, granted or refused), processes and the ``shmlimit_keyed_*`` families
but overrides, never a rate or capacity of 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Sequence, Tuple, Union

from shmlimit.config import is_int
from shmlimit.keyed.stats import KeyedStats
from shmlimit.kinds import inspect_each
from shmlimit.multirate import MultiStats
from shmlimit.shm.segment import (
    list_names,
    owner,
    trusted_owner,
    validate_name,
    validate_trusted_uids,
)
from shmlimit.stats import Stats

#: ``Content-Type`` of the text exposition format.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
#: Segments one scrape exports at most (some 15 series each), unless told otherwise.
MAX_SEGMENTS = 100
#: The reasons a segment is left out of a scrape (``shmlimit_omitted_segments``'s label).
UNTRUSTED, OVER_CAP = "untrusted_owner", "over_cap"

Labels = Tuple[Tuple[str, str], ...]


@dataclass
class Family:
    """One metric family: a name (counters without their ``_total``), a type, help and samples."""

    name: str
    type: str  #: "counter" or "gauge"
    help: str
    samples: List[Tuple[Labels, float]] = field(default_factory=list)

    @property
    def sample_name(self) -> str:
        return self.name + "_total" if self.type == "counter" else self.name


# (name, type, help, value of a Stats or None to leave the sample out)
_LIMITER_METRICS = (
    (
        "shmlimit_grants",
        "counter",
        "Ops granted by every process that ever attached (a limits storage: hits granted).",
        lambda s: s.grants,
    ),
    (
        "shmlimit_rate_ops_per_second",
        "gauge",
        "The configured rate, in ops per second.",
        lambda s: s.rate / s.per,
    ),
    (
        "shmlimit_capacity_ops",
        "gauge",
        "The bucket's capacity (burst), in ops.",
        lambda s: s.capacity,
    ),
    (
        "shmlimit_available_ops",
        "gauge",
        "Ops that could be granted at once.",
        lambda s: s.available,
    ),
    ("shmlimit_deficiency_ops", "gauge", "Ops owed to queued callers.", lambda s: s.deficiency),
    (
        "shmlimit_deficiency_seconds",
        "gauge",
        "Schedule time until the queued callers are served, in seconds.",
        lambda s: s.deficiency_seconds,
    ),
    (
        "shmlimit_behind_seconds",
        "gauge",
        "Schedule time owed back through catch-up (the waiting pool), in seconds.",
        lambda s: s.behind_seconds,
    ),
    (
        "shmlimit_starved_seconds",
        "counter",
        "Schedule time the limiter could not credit while callers were queued (its filler and waiters starved of CPU): lost, or with catch-up deferred, in seconds.",
        lambda s: s.starved_seconds,
    ),
    (
        "shmlimit_processes",
        "gauge",
        "Live processes attached (listed in the process table).",
        lambda s: sum(p.alive for p in s.processes),
    ),
    (
        "shmlimit_waiting_processes",
        "gauge",
        "Live attached processes queued for tokens right now.",
        lambda s: sum(p.alive and p.waiting for p in s.processes),
    ),
    (
        "shmlimit_filler_heartbeat_age_seconds",
        "gauge",
        "Seconds since the filler last renewed its lease; absent while no process holds a live lease.",
        lambda s: s.heartbeat_age,
    ),
    (
        "shmlimit_stopped",
        "gauge",
        "1 while the limiter is paused by stop().",
        lambda s: int(s.stopped),
    ),
)

# hierarchical limiters only: (name, type, help, value of its UpstreamStats or the attribute)
_UPSTREAM_METRICS = (
    (
        "shmlimit_upstream_fallback",
        "gauge",
        "Hierarchical limiters: 1 while a fallback is in force because Redis is unreachable.",
        lambda up: up.state != "ok",
    ),
    (
        "shmlimit_upstream_round_trips",
        "counter",
        "Redis round trips by this host's fillers.",
        "round_trips",
    ),
    (
        "shmlimit_upstream_leases",
        "counter",
        "Successful lease requests to the global Redis limiter.",
        "leases",
    ),
    (
        "shmlimit_upstream_leased_ops",
        "counter",
        "Ops leased from the global Redis limiter.",
        "leased",
    ),
    (
        "shmlimit_upstream_expired_ops",
        "counter",
        "Leased ops never used (void after their ttl, or reserved by a process that closed).",
        "expired",
    ),
    (
        "shmlimit_upstream_refused_ops",
        "counter",
        "Ops asked for that the global limiter had not available.",
        "refused",
    ),
    ("shmlimit_upstream_errors", "counter", "Redis calls that failed.", "errors"),
    (
        "shmlimit_upstream_fallbacks",
        "counter",
        "Times a fallback was entered while Redis was unreachable.",
        "fallbacks",
    ),
)


AnyStats = Union[Stats, KeyedStats]

# keyed limiters only: (name, type, help, KeyedStats attribute)
_KEYED_METRICS = (
    ("shmlimit_keyed_keys", "gauge", "Keys live in the table now.", "keys"),
    (
        "shmlimit_keyed_slots",
        "gauge",
        "Key slots in the table (a window table's moving-window slots too).",
        "slots",
    ),
    (
        "shmlimit_keyed_evictions",
        "counter",
        "Keys whose slot was reused after their bucket was full again.",
        "evicted",
    ),
    (
        "shmlimit_keyed_refusals",
        "counter",
        "New keys refused because every slot of their window held a limited key.",
        "refused_full",
    ),
    ("shmlimit_keyed_overrides", "gauge", "Keys with a rate of their own.", "overrides"),
)
# adaptive rates only (``adapt=``): (name, type, help, AdaptStats attribute); a keyed limiter's
# count every key's, a rate of several its own (NAME[KEY])
_ADAPT_METRICS = (
    (
        "shmlimit_adapt_throttled_outcomes",
        "counter",
        "Outcomes reported throttled to an adaptive rate, by every process (keyed: of every key).",
        "throttled",
    ),
    (
        "shmlimit_adapt_ok_outcomes",
        "counter",
        "Outcomes reported not throttled to an adaptive rate, by every process (keyed: of every key).",
        "ok",
    ),
    (
        "shmlimit_adapt_cuts",
        "counter",
        "Windows that cut an adaptive rate (keyed: a key's rate).",
        "cuts",
    ),
    (
        "shmlimit_adapt_raises",
        "counter",
        "Windows that raised an adaptive rate (keyed: a key's rate).",
        "raises",
    ),
)

# tables of window counters only
_WINDOW_METRICS = (
    (
        "shmlimit_window_hits",
        "counter",
        "Hits asked of a limits storage (shm://), granted or refused.",
        "hits",
    ),
)

#: The kinds of snapshot (``kind``; a ``Stats`` has none: "plain") a family samples, where it
#: samples others than its table's: the families keyed tables share with limiters, those
#: tables of window counters share (they have no rate), the one they lack
_EVERY, _RATED = ("plain", "keyed", "windows"), ("plain", "keyed")
_SAMPLED = {
    "shmlimit_grants": _EVERY,
    "shmlimit_rate_ops_per_second": _RATED,
    "shmlimit_capacity_ops": _RATED,
    "shmlimit_processes": _EVERY,
    "shmlimit_keyed_overrides": ("keyed",),
}
# (a table of families, the part of a snapshot their values come from, the kinds they sample)
_TABLES = (
    (_LIMITER_METRICS, "", ("plain",)),
    (_UPSTREAM_METRICS, "upstream", ("plain",)),
    (_KEYED_METRICS, "", ("keyed", "windows")),
    (_ADAPT_METRICS, "adapt", _EVERY),
    (_WINDOW_METRICS, "", ("windows",)),
)


def snapshots(names: Optional[Sequence[str]] = None) -> Tuple[List[AnyStats], List[str]]:
    """Snapshots of the named limiters (all of the machine's by default), and the names that could not be read."""
    stats: List[AnyStats] = []
    unreadable: List[str] = []

    def count(name: str, e: Exception) -> None:
        # unlinked since listed, or named and not (yet) created: no samples; else counted
        if not isinstance(e, FileNotFoundError):
            unreadable.append(name)

    for _, s in inspect_each(list_names() if names is None else names, count):
        # several rates: each rate's series, named NAME[KEY]
        stats.extend(s.rates.values() if isinstance(s, MultiStats) else (s,))
    return stats, unreadable


def validate_names(names: Optional[Iterable[str]]) -> Optional[List[str]]:
    """``names`` as a list of limiter names (None: every one of the machine's); a lone ``str`` or
    ``bytes`` (whose characters would be taken for names), or anything but names, a TypeError; a
    str that is no limiter name (``validate_name``), a ValueError: at construction, never at
    every scrape.  A name listed twice is kept once, where it first appears."""
    if names is None:
        return None
    if isinstance(names, (str, bytes)) or not hasattr(names, "__iter__"):
        raise TypeError(
            f"names must be a list of limiter names (or None: every one), got {names!r}"
        )
    out = list(names)
    for n in out:
        if not isinstance(n, str):
            raise TypeError(f"names must hold limiter names (str), got {n!r}")
        try:
            validate_name(n)
        except ValueError as e:
            raise ValueError(f"names must hold limiter names: {e}") from None
    return list(dict.fromkeys(out))  # once each: a repeated series is an invalid exposition


def select(
    names: Optional[Sequence[str]] = None,
    *,
    trusted_uids: Iterable[int] = (),
    all_users: bool = False,
    max_segments: int = MAX_SEGMENTS,
) -> Tuple[List[str], Dict[str, int]]:
    """The names a scrape exports (of ``names``, or all of the machine's) and how many it leaves out, by reason.

    Kept: the segments owned by this process's user, root or ``trusted_uids``
    (every owner with ``all_users``), the first ``max_segments`` of them in
    the order given (by name when listed).  Another user's segments, and
    whatever they planted, would otherwise be exported with the values they
    chose, in any number.
    """
    names = validate_names(names)
    trusted = validate_trusted_uids(trusted_uids)
    if not isinstance(all_users, bool):
        raise TypeError(f"all_users must be True or False, got {all_users!r}")
    if not is_int(max_segments, 1):
        raise ValueError(f"max_segments must be an int of at least 1, got {max_segments!r}")
    kept: List[str] = []
    omitted = {UNTRUSTED: 0, OVER_CAP: 0}
    for name in list_names() if names is None else names:
        # The owner of the entry itself (lstat): in /dev/shm (sticky, like /tmp) only its owner
        # can replace it, so the segment read next has the owner seen here, or is gone.
        uid = owner(name)
        if uid is None:  # gone since listed, or named and not (yet) created: no samples
            continue
        if not all_users and not trusted_owner(uid, trusted):
            omitted[UNTRUSTED] += 1
        elif len(kept) >= max_segments:
            omitted[OVER_CAP] += 1
        else:
            kept.append(name)
    return kept, omitted


def families(
    names: Optional[Sequence[str]] = None,
    *,
    trusted_uids: Iterable[int] = (),
    all_users: bool = False,
    max_segments: int = MAX_SEGMENTS,
) -> List[Family]:
    """The metric families for the named limiters (all of this machine's by default), as ``select`` picks them."""
    kept, omitted = select(
        names, trusted_uids=trusted_uids, all_users=all_users, max_segments=max_segments
    )
    stats, unreadable = snapshots(kept)
    return families_of(stats, unreadable, omitted)


def omitted_note(fams: Iterable[Family]) -> Optional[str]:
    """One line saying what a scrape left out (None: nothing), with the options that include it."""
    counts = {
        dict(labels)["reason"]: int(v)
        for fam in fams
        if fam.name == "shmlimit_omitted_segments"
        for labels, v in fam.samples
    }
    parts = []
    if counts.get(UNTRUSTED):
        parts.append(
            f"{counts[UNTRUSTED]} segment(s) of other users (--trust-uid UID or --all-users "
            "exports them)"
        )
    if counts.get(OVER_CAP):
        parts.append(f"{counts[OVER_CAP]} segment(s) beyond --max-segments")
    return "left out " + " and ".join(parts) if parts else None


def families_of(
    stats: Iterable[AnyStats],
    unreadable: Sequence[str] = (),
    omitted: Optional[Dict[str, int]] = None,
) -> List[Family]:
    everything = list(stats)
    out = [
        _family(
            meta,
            [s for s in everything if getattr(s, "kind", "plain") in _SAMPLED.get(meta[0], kinds)],
            part,
        )
        for table, part, kinds in _TABLES
        for meta in table
    ]
    out.append(
        Family(
            "shmlimit_unreadable_segments",
            "gauge",
            "Segments named like limiters that could not be read (foreign, corrupt or not ours).",
            [((), float(len(unreadable)))],
        )
    )
    out.append(
        Family(
            "shmlimit_omitted_segments",
            "gauge",
            "Segments left out of this scrape: owned by an untrusted user, or beyond the cap.",
            [((("reason", r),), float((omitted or {}).get(r, 0))) for r in (UNTRUSTED, OVER_CAP)],
        )
    )
    return out


def _family(meta: tuple, stats: Iterable[AnyStats], part: str = "") -> Family:
    """The family ``meta`` describes, ``(name, type, help, value)``, sampled from each of ``stats``
    by its limiter's name; ``value`` is a function of a snapshot or the name of one of its fields
    (of its ``part``, ``upstream`` or ``adapt``, when given: a snapshot without one has no sample);
    a value of None is no sample."""
    name, kind, help_, value = meta
    fam = Family(name, kind, help_)
    for s in stats:
        of = getattr(s, part) if part else s
        v = None if of is None else getattr(of, value) if isinstance(value, str) else value(of)
        if v is not None:
            fam.samples.append(((("limiter", s.name),), float(v)))
    return fam


def _escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _value(v: float) -> str:
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(float(v))


def exposition(fams: Iterable[Family]) -> str:
    """The Prometheus text exposition format (0.0.4) of ``fams``."""
    lines = []
    for fam in fams:
        sample = fam.sample_name
        lines.append(f"# HELP {sample} {fam.help}")
        lines.append(f"# TYPE {sample} {fam.type}")
        for labels, v in fam.samples:
            text = ",".join(f'{k}="{_escape_label(val)}"' for k, val in labels)
            lines.append(f"{sample}{{{text}}} {_value(v)}" if text else f"{sample} {_value(v)}")
    return "\n".join(lines) + "\n"
