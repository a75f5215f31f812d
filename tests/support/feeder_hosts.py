"""A hierarchical host on a fake clock whose feeder a test ticks itself, and its fixtures: what the
feeder's tests (tests/redis/test_feeder.py) and the refunds' (tests/bucket/test_refund_fences.py)
share."""

import pytest

import shmlimit
from support.clock import FakeClock


@pytest.fixture
def R():
    from support.redis_server import require

    require()
    import shmlimit.redis.direct as R

    return R


@pytest.fixture
def clock(R, monkeypatch):
    clock = (
        FakeClock()
    )  # 1000 s: a lease record holds the monotonic ms of ~34 years, not an epoch's
    monkeypatch.setattr(R.time, "time_ns", clock)
    return clock


class Host:
    """One host: a hierarchical limiter on the fake clock whose feeder the test ticks."""

    def __init__(
        self, R, name, url, clock, rate, burst=None, glob=None, local_burst=None, local=None, **up
    ):
        """``rate``, ``burst``: the global limiter's; ``local``, ``local_burst``: the host's
        bucket's (the global rate and its default burst if None)."""
        from shmlimit.redis.feeder import Feeder

        self.clock = clock
        self.glob = R.RedisLimiter(
            glob or f"{name}-g", rate=rate, burst=burst, url=url, clock="client"
        )
        if local_burst is not None:
            up["burst"] = local_burst
        if local is not None:
            up["rate"] = local
        self.lim = shmlimit.Limiter(name, upstream=self.glob, clock=clock, **up)
        att = self.lim._att
        self.lim.retry_after()  # a first use (taking nothing): this process's filler thread runs...
        att.filler.stop()  # ... and stops: the test is the filler
        att.filler.join()
        att.lease.drop()
        assert att.lease.try_take()
        self.att = att
        self.feeder = Feeder(att.bucket, att.lease, att.feed_spec, clock=clock)
        self.grants = []

    def take_all(self):
        """A saturating caller: everything the bucket holds now."""
        while self.lim.try_acquire():
            self.grants.append(self.clock.now)

    def close(self):
        self.feeder.close()
        self.lim.close()
        self.glob.close()
        shmlimit.unlink(self.lim.name)
