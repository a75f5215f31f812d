"""A reservation over several rates by a process beyond the rates' process tables.

Such a process has no slot, so no ticket records, on those rates: a claim it queued there would be
held in no record, and killed before the reservation was made it would stay queued -- whoever comes
next on that rate waits for its whole schedule.  So a claim that is not the last is taken there
only when covered at once (tokens: a death loses them, stalling no one), and the reservation waits
(polls) for that; only the last claim, which makes the reservation, may queue unrecorded.

The table of each rate has one slot, this process's; a child is beyond it on both rates.
"""

import subprocess
import sys
import textwrap

import pytest
from support.procs import WORKDIR, wait_for
from support.reservations import PREAMBLE, killed_part_way, queued

import shmlimit

RATES = {"a": ("1/min", 1), "b": ("1/h", 1)}

RESERVES_BEYOND_THE_TABLE = PREAMBLE + textwrap.dedent(
    """
    lim = shmlimit.Limiter(sys.argv[1], rates={"a": ("1/min", 1), "b": ("1/h", 1)}, slots=1)
    atts = lim._live()
    assert all(not t.records for t in atts), "the child has a slot"
    # a claim queued on some rate, or many looks: killed there
    stop_part_way(lim, lambda looks: "claimed" if queued(atts) else "looked" if looks == 20 else None)
    lim.reserve()
    """
)


def empty(lim):
    while lim.try_acquire():
        pass


@pytest.mark.slow
def test_a_process_beyond_the_table_killed_part_way_through_a_reservation_leaves_no_claim_queued(
    name, cleanup
):
    lim = shmlimit.Limiter(name, rates=RATES, slots=1)
    cleanup.append(lim)
    empty(lim)  # this process holds the one slot of each rate's table
    atts = lim._live()
    assert all(t.records for t in atts)
    with killed_part_way(RESERVES_BEYOND_THE_TABLE, name) as said:
        assert said in ("claimed", "looked"), said
        # part-way (one rate looked at many times, or claimed): nothing queued on a rate where the
        # child could record nothing
        assert not queued(atts), said
    wait_for(lambda: not queued(atts), timeout=5)
    assert lim.reserve(a=1) < 61  # a's next slot, not one behind a dead claim


RESERVES_TWICE_BEYOND_THE_TABLE = textwrap.dedent(
    """
    import sys, time
    import shmlimit
    lim = shmlimit.Limiter(sys.argv[1], rates={"a": ("20/s", 1), "b": ("10/s", 1)}, slots=1)
    assert not any(t.records for t in lim._live()), "the child has a slot"
    while lim.try_acquire():
        pass
    t0 = time.monotonic()
    first = lim.reserve()  # a covered at once only (it polls for it), b (the last) queued
    print(first, time.monotonic() - t0, flush=True)
    lim.close()
    """
)


@pytest.mark.slow
def test_a_process_beyond_the_table_still_makes_its_reservations(name, cleanup):
    lim = shmlimit.Limiter(name, rates={"a": ("20/s", 1), "b": ("10/s", 1)}, slots=1)
    cleanup.append(lim)
    lim.try_acquire()  # this process holds the one slot of each rate's table
    out = subprocess.run(
        [sys.executable, "-c", RESERVES_TWICE_BEYOND_THE_TABLE, name],
        capture_output=True,
        text=True,
        cwd=WORKDIR,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    first, took = out.stdout.split()
    assert 0.0 <= float(first) <= 0.2, out.stdout  # at most b's one slot (0.1 s) ahead
    assert float(took) < 30, took  # it polled for a's tokens, and got them
