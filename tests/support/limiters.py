"""Limiters set up the way several test modules need them."""

from typing import Any, Optional

import shmlimit

from .clock import FakeClock


def quiet_limiter(name: str, clock: Optional[FakeClock] = None, **options: Any) -> shmlimit.Limiter:
    """A limiter (``options`` as ``Limiter``'s) whose filler thread is stopped, its lease dropped:
    only the test replenishes.  Close it (``contextlib.closing``)."""
    lim = shmlimit.Limiter(name, clock=clock, **options)
    lim.retry_after()  # a first use (taking nothing): its filler thread starts, to be stopped here
    f = lim._att.filler
    f.stop()
    f.join(10)
    assert not f.is_alive()
    return lim
