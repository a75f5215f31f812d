"""The over-grant checks: in every window of length T, grants <= the documented bound.

Used by the tests, by ``tools/soak.py`` and by ``tools/bench.py``, so that the
suite, the soak and the benchmark judge a run the same way.

Two kinds of evidence:

* grants made on an injected clock (``check_windows``): their times are exact,
  and every window is checked against ``rate*T + capacity`` exactly;
* stamps taken by real processes just after ``acquire`` returned
  (``max_excess``): a worker may be preempted between its grant and its stamp,
  so a window may hold one late stamp per worker whose grant came before the
  window.  ``max_excess`` subtracts that slack, so asserting
  ``max_excess(...) <= bound`` can never fail for a correct limiter, however
  the workers were scheduled.
"""

from __future__ import annotations

from collections import Counter
from typing import Iterable, List, Sequence, Tuple, TypeVar

T = TypeVar("T", int, float)


def tag(results: Iterable[Sequence[T]]) -> List[Tuple[T, int]]:
    """Per-worker lists of stamps -> (stamp, worker index) pairs."""
    return [(t, w) for w, r in enumerate(results) for t in r]


def max_excess(stamps: Iterable[Tuple[T, int]], width: T) -> int:
    """The largest (stamps - distinct workers stamping) in any window ``[t, t + width)``.

    ``stamps`` are (time, worker) pairs, each taken just after an acquire
    returned, in any order and any unit (``width`` in the same unit).  A
    worker's stamps are sequential and its next acquire starts after its
    last stamp, so a window holds at most one stamp per worker from a grant
    made before the window began.  The grants in a window are therefore at
    least this excess: a result above the bound proves an over-grant.
    """
    ordered = sorted(stamps)
    best = lo = 0
    inside: Counter = Counter()
    for hi, (t, worker) in enumerate(ordered):
        inside[worker] += 1
        while ordered[lo][0] <= t - width:
            w = ordered[lo][1]
            inside[w] -= 1
            if not inside[w]:
                del inside[w]
            lo += 1
        best = max(best, hi - lo + 1 - len(inside))
    return best


def max_inside(spans: Iterable[Tuple[float, float, int]], width: float) -> int:
    """The most ops whose whole span lies in one window ``[t, t + width)``: ``spans`` are ``(lo, hi,
    ops)``, each a grant's moment known only to lie in ``[lo, hi]`` (a reservation's promise: the
    clock read before the call plus its wait, and after it plus the wait).  The ops of every span
    counted lie in the window whatever the moment: a result above the bound proves an over-grant."""
    ordered = sorted(spans)
    widest = max((hi - lo for lo, hi, _ in ordered), default=0)
    sums = [0]
    for _, _, ops in ordered:
        sums.append(sums[-1] + ops)
    best = j = 0
    for i, (t, _, _) in enumerate(ordered):
        j = max(j, i)
        while j < len(ordered) and ordered[j][0] < t + width:
            j += 1
        inside = sums[j] - sums[i]
        k = j - 1  # only spans starting within ``widest`` of the end may end past it
        while k >= i and ordered[k][0] >= t + width - widest:
            if ordered[k][1] >= t + width:
                inside -= ordered[k][2]
            k -= 1
        best = max(best, inside)
    return best


def max_in_window(times: Iterable[T], width: T) -> int:
    """The most stamps in any window ``[t, t + width)`` (no slack: for grant times known exactly)."""
    ordered = sorted(times)
    best = lo = 0
    for hi, t in enumerate(ordered):
        while ordered[lo] <= t - width:
            lo += 1
        best = max(best, hi - lo + 1)
    return best


def max_gap(times: Iterable[T]) -> T:
    """The longest time between two consecutive stamps (0 with fewer than two)."""
    ordered = sorted(times)
    return max((b - a for a, b in zip(ordered, ordered[1:])), default=0)


def check_windows(grants: Sequence[Tuple[int, int]], tpn: int, cost: int, cap: int) -> None:
    """Grants made on an injected clock, as (time_ns, ops): every window holds ops*cost <= T*tpn + cap.

    Every pair of grants bounds a window, so all of them are checked
    (quadratic: for the property tests' short runs).
    """
    grants = sorted(grants)
    times = [t for t, _ in grants]
    cum = [0]
    for _, n in grants:
        cum.append(cum[-1] + n)
    for i in range(len(grants)):
        for j in range(i, len(grants)):
            ops = cum[j + 1] - cum[i]
            allowed = (times[j] - times[i]) * tpn + cap
            assert ops * cost <= allowed, (
                f"{ops} ops in {(times[j] - times[i]) / 1e6:.3f} ms (bound {allowed / cost:g})"
            )


def excess_over_rate(moments: Sequence[float], rate: float, slack_ops: float) -> float:
    """The largest excess, over ``rate * T + slack_ops``, of the ops used at ``moments`` (ns, one op
    each) in any window ``T``: at most 0 when they keep that bound."""
    moments = sorted(moments)
    return max(
        (b - a + 1) - (rate * (moments[b] - moments[a]) / 1e9 + slack_ops)
        for a in range(len(moments))
        for b in range(a, len(moments))
    )
