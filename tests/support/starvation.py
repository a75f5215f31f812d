"""How much CPU the machine withheld: the witness that lets wall-clock lower bounds be honest.

A limiter can only deliver its rate while some process of it runs: the filler
thread, or a waiter whose ticket is due (it replenishes for itself).  On a busy
machine every one of them may sit runnable on a run queue for tens of
milliseconds, and time that no replenish credits within a capacity is lost by
design ("lose a little time, never grant early").  The limiter counts what it
could not credit while callers were queued (``Stats.starved_seconds``); the
kernel counts how long each thread waited runnable for a CPU
(``/proc/<pid>/task/<tid>/schedstat``, second field, ns), and on a virtual machine
how long the hypervisor ran something else on the machine's CPUs while its threads
were due to run (``steal`` in ``/proc/stat``, which no run queue sees).  A test then asserts
its lower bound relative to both, and that the limiter was starved no longer
than the machine withheld the CPU from its processes: on a quiet machine both
are ~0 and the bound is as tight as ever.
"""

from __future__ import annotations

from typing import Iterable, Optional

#: The witness as program text, for the worker scripts (they run outside the source tree and
#: cannot import this module); this module defines ``run_delay`` from the same text.
RUN_DELAY_SCRIPT = '''
def run_delay(pid="self"):
    """Seconds process ``pid`` has been kept from running so far: its threads' waits runnable for
    a CPU (the kernel's schedstat, summed over its live threads), plus the time the hypervisor
    took the machine's CPUs away (steal, summed over the CPUs: the process ran on one of them at a
    time, so it was held up by at most that); None where the kernel does not say.  Only the
    difference of two readings means anything; on a machine without steal it is the schedstat's."""
    import os
    total = 0
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return total / 1e9 + steal_seconds()


def steal_seconds():
    """Seconds the hypervisor has taken the machine's CPUs away so far (steal, summed over the
    CPUs); 0 where the kernel does not say (the strict reading: nothing stolen)."""
    import os
    stolen = 0
    try:
        with open("/proc/stat") as f:
            for line in f:
                fields = line.split()
                if fields[0].startswith("cpu") and fields[0] != "cpu" and len(fields) > 8:
                    stolen += int(fields[8])  # clock ticks
        return stolen / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0
'''
exec(RUN_DELAY_SCRIPT)  # run_delay, from the very text the workers run


def total(delays: Iterable[Optional[float]]) -> float:
    """Several processes' run delays added up; where the kernel does not say, 0 (the strict
    reading: the machine is presumed to have withheld nothing)."""
    return sum(d for d in delays if d is not None and d > 0)


def least(delays: Iterable[Optional[float]]) -> float:
    """The least of several workers' run delays (0 where one is unknown): no worker can take a
    grant while none of them runs, and all of them were off the CPU together at most this long."""
    known = [d if d is not None and d > 0 else 0.0 for d in delays]
    return min(known) if known else 0.0


def floor(full: float, rate: float, starved: float, delays: Iterable[Optional[float]]) -> float:
    """The fewest grants workers honestly get where ``full`` is what the rate gives on a quiet machine.

    Less the time the limiter could not credit while they queued (its own count, ``starved``
    seconds: ``Stats.starved_seconds``), and the time none of the workers ran to take what it
    had credited (``least(delays)``); each is ~0 on a quiet machine, where the bound is ``full``.
    """
    return full - rate * (starved + least(delays))


def assert_rate(
    count: int,
    rate: float,
    span: float,
    rel: float,
    starved: float,
    delays: Iterable[Optional[float]],
) -> None:
    """``count`` grants in ``span`` seconds at ``rate`` ops/s, within ``rel`` of it: never more than
    ``rate*span*(1+rel)``; no fewer than ``rate*span*(1-rel)`` less what the machine took (``floor``)."""
    delays = list(delays)
    high = rate * span * (1 + rel)
    low = floor(rate * span * (1 - rel), rate, starved, delays)
    assert count <= high, f"{count} grants in {span:.3f} s: more than {high:.1f}"
    assert count >= low, (
        f"{count} grants in {span:.3f} s: fewer than {low:.1f} ({rate:g}/s within {rel:g}, less "
        f"{starved:.3f} s starved and {least(delays):.3f} s when none of the workers ran)"
    )


class Stalls:
    """The run delays of a changing set of processes, sampled at chosen instants (kills, say).

    Between two samples, ``candidates`` are processes any one of which can do the work (take over
    a filler, take a grant), and ``servers`` processes that all must run (a Redis server): the time
    the work was held up by the machine is at most the least candidate's delay plus every server's.
    """

    def __init__(self, servers: Iterable[int] = ()) -> None:
        self.servers = list(servers)
        self.samples: list = []

    def sample(self, candidates: Iterable[int]) -> None:
        pids = list(candidates)
        self.samples.append(({p: run_delay(p) for p in pids}, [run_delay(p) for p in self.servers]))  # noqa: F821 (exec above)

    def spans(self) -> list:
        """For each span between two samples, the seconds the machine may have held the work up."""
        out = []
        for (c0, s0), (c1, s1) in zip(self.samples, self.samples[1:]):
            both = [
                c1[p] - c0[p] for p in c0 if p in c1 and c0[p] is not None and c1[p] is not None
            ]
            servers = [b - a for a, b in zip(s0, s1) if a is not None and b is not None]
            out.append(least(both) + sum(servers))
        return out
