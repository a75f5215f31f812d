"""Live changes: a new configuration, a stop or a start, for every attached process at once.

A change is published through the attachment's ``Bucket`` (``publish``,
``set_stopped``: the config banks' sequence lock), so every process sees it
at its next ``refresh`` without re-attaching: ops already granted stay
granted, queued callers keep their place, new grabs pay the new price.  A
start also gives back dead processes' tickets at once.  One set of rules
serves the ``Limiter`` facade and each rate of a ``MultiLimiter``: what
``set_rate``'s arguments ask for (``requested``), the stop/start/restart
verbs, and ``apply`` of a rate spec (``parse_spec``: ``shmlimit set-rate``'s too).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Union

from shmlimit import config
from shmlimit.adapt import adapted
from shmlimit.adapt import read as read_adapt
from shmlimit.config import Config, RateSpec, spec_values

if TYPE_CHECKING:  # pragma: no cover
    from shmlimit.attachment import Attachment


def requested(
    cur: Config,
    rate: Union[float, str],
    per: Optional[float],
    burst: Optional[float],
    ratio: Optional[float],
    plain: Optional[str] = None,
) -> Config:
    """The config ``set_rate(rate, per, burst, ratio=...)`` asks for, validated (``cur``: the one in force).

    ``rate`` is a number, a rate string ``"200K/min"`` (which sets ``per``
    too) or a rate spec ``"12K,1.1"`` (its ratio, if it has one, is the one
    to use; no verb but ``configure``); ``plain`` names a kind that takes no
    ratio and no verb (``config.spec_values``).  ``per`` and ``ratio`` default
    to ``cur``'s; ``burst`` to the new rate's default.
    """
    if isinstance(rate, str):
        rate, per, ratio = spec_values(  # type: ignore[assignment]
            rate, per, ratio, ("configure",), "in set_rate (use apply)", plain
        )
    return cur.replace(
        rate=rate,
        per=cur.per if per is None else per,
        burst=burst,
        ratio=cur.ratio if ratio is None else ratio,
    )


def set_rate(
    att: "Attachment",
    rate: Union[float, str],
    per: Optional[float],
    burst: Optional[float],
    ratio: Optional[float],
    plain: Optional[str] = None,
) -> None:
    """Publish the config ``requested`` asks for; re-applying the config in force changes nothing.

    An adaptive limiter's rate must be within its bounds (its controller goes on from there),
    and its capacity follows the rate: ``burst`` is refused unless it is the rate's default.
    """
    b = att.bucket
    b.refresh()
    cur = b.config
    new = requested(cur, rate, per, burst, ratio, plain)
    bounds = read_adapt(att.cells)
    if bounds is not None:
        if new.per != cur.per:
            raise ValueError(
                f"per cannot change on an adaptive limiter (its bounds are ops per {cur.per:g} s), "
                f"got {new.per:g}"
            )
        bounds.check(new)
        if new != adapted(new, new.rate):
            raise ValueError(
                f"burst cannot be set on an adaptive limiter: its capacity follows the rate "
                f"(the default, {adapted(new, new.rate).burst:g} ops at {new.rate:g}), got {burst!r}"
            )
    if new != cur:
        b.check_price(cur, new)
        b.publish(new)


def stop(att: "Attachment") -> None:
    """Pause every acquirer in every process until ``start``."""
    b = att.bucket
    b.refresh()
    if not b.stopped:
        b.set_stopped(True)


def start(att: "Attachment") -> None:
    """Resume after ``stop``, from an empty bucket: the paused time is not owed to anyone."""
    b = att.bucket
    b.refresh()
    if b.stopped:
        b.set_stopped(False)
    _clear_dead_backlog(att)


def restart(att: "Attachment") -> None:
    """Start (if stopped) with the pools zeroed: an empty bucket and nothing behind schedule."""
    b = att.bucket
    b.refresh()
    b.set_stopped(False, reset=True)
    _clear_dead_backlog(att)


def _clear_dead_backlog(att: "Attachment") -> None:
    # without waiting for the filler's next look: a queue of dead waiters does not outlive a start
    att.reap()
    att.returns.step()


def parse_spec(spec: str) -> RateSpec:
    """A rate spec for a live change (``apply``): ``config.parse_spec``'s ``rate[,ratio][,verb]``,
    or a stop alone, ``"stop"`` or ``"0,stop"`` (a stop keeps the configuration: no rate is used)."""
    if isinstance(spec, str) and spec.strip().lower() in ("stop", "0,stop"):
        spec = "1,stop"
    return config.parse_spec(spec)


def apply(att: "Attachment", parsed: RateSpec) -> None:
    """A parsed rate spec ``rate[,ratio][,verb]``: ``configure`` (the default) changes rate and ratio
    in place (keeping the capacity when the rate and window stay), ``start`` also resumes,
    ``restart`` also zeroes the pools, ``stop`` only pauses."""
    if parsed.verb == "stop":
        stop(att)
        return
    b = att.bucket
    b.refresh()
    cur = b.config
    same = parsed.rate == cur.rate and parsed.per in (None, cur.per)
    set_rate(att, parsed.rate, parsed.per, None if not same else cur.burst, parsed.ratio)
    if parsed.verb == "start":
        start(att)
    elif parsed.verb == "restart":
        restart(att)
