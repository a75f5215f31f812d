"""All or nothing over several rates, now: the one protocol by which every kind of limiter with
several rates takes its rates together (``acquire.multi``'s rates of a bucket, ``keyed.multi``'s
rates of a key).  Each kind gives one ``Rate`` per rate a call costs; this module decides."""

from __future__ import annotations

from typing import Any, List, Optional, Protocol, Sequence


class Rate(Protocol):
    """One rate's part of one call (the rate and what the call costs it)."""

    def look(self) -> float:
        """The wait before it could be taken, writing nothing a take would: 0 (now), > 0 (in the
        kind's unit; ``inf``: never)."""

    def take(self) -> Any:
        """Take it now: what ``undo`` needs, or an int (refused, the kind's code; taking nothing)."""

    def undo(self, taken: Any) -> None:
        """Give back what ``take`` took (as far as the kind's rule allows: never an extra grant)."""

    def count(self) -> None:
        """Count the grant (a kind whose take counts, and whose undo uncounts, does nothing)."""


def take_all(rates: Sequence[Rate], longest: bool = True) -> Optional[float]:
    """None: granted on every rate, counted.  Else refused, holding nothing: the longest wait a
    look found (> 0), or a take's refusal code.

    It looks at every rate first and, if any is short, refuses with nothing taken.  Only a race
    (another caller took a rate's room between the looks and its take) refuses a take: the rates
    already taken are undone, newest first.  Grants are counted only once every rate has granted,
    so a refused call counts on no rate.  With ``longest`` False the looks stop at the first
    short rate, for a kind whose look writes (a plain rate replenishes): the rates after it are
    left as they were, as a try refused by the gates leaves them (``attachment.OnClock``)."""
    wait: float = 0
    for r in rates:
        w = r.look()
        if w > wait:
            wait = w
            if not longest:
                break
    if wait > 0:
        return wait
    taken: List[Any] = []
    for r in rates:
        t = r.take()
        if isinstance(t, int):
            for done, t_done in reversed(list(zip(rates, taken))):
                done.undo(t_done)
            return t
        taken.append(t)
    for r in rates:
        r.count()
    return None
