"""A ``Limiter``'s ``upstream=`` option: a Redis URL or a ``RedisLimiter``, resolved into the
``UpstreamSpec`` its segment records and its filler leases from, and the local config to use.

Only a process that configures an upstream imports the Redis tier (here, lazily).
"""

from __future__ import annotations

from typing import Any, Optional, Protocol, Tuple

from shmlimit.config import Config, validate_timeout
from shmlimit.redis import urls
from shmlimit.redis.spec import ON_ERROR, UpstreamSpec


class Upstream(Protocol):
    """What ``upstream=`` reads of a ``shmlimit.redis.direct.RedisLimiter``, the limiter it takes
    besides a URL (named here, so that a ``Limiter``'s annotations resolve without importing the
    Redis client)."""

    @property
    def rate(self) -> float: ...

    @property
    def per(self) -> float: ...

    @property
    def capacity(self) -> float: ...

    def upstream_spec(self, **options: Any) -> UpstreamSpec: ...


def resolve_upstream(
    name: str,
    rate: Any,
    per: float,
    burst: Optional[float],
    upstream: Any,
    on_error: str,
    ttl: Any,
    batch: Any,
) -> Tuple[Any, float, Optional[float], UpstreamSpec]:
    """Resolve ``upstream=``: the local config to use and the upstream this process leases from."""
    if on_error not in ON_ERROR:
        raise ValueError(f"on_redis_error must be one of {', '.join(ON_ERROR)}, got {on_error!r}")
    for param, v in (("lease_ttl", ttl), ("batch_seconds", batch)):
        t = validate_timeout(v, param)
        if t is None or not 0.001 <= t <= 60:
            raise ValueError(f"{param} must be between 0.001 and 60 seconds, got {v!r}")
    from shmlimit.redis.direct import (  # the Redis tier: only a process that configures it imports it
        RedisLimiter,
        unconnected,
    )

    options = dict(on_error=on_error, lease_ttl=float(ttl), batch_seconds=float(batch))
    if isinstance(upstream, str):
        if rate is None:
            raise ValueError(
                "upstream= as a URL needs rate= (the global limit); or pass a RedisLimiter"
            )
        urls.check(upstream, "upstream")  # its errors name the parameter the caller passed
        cfg = Config.make(rate, per, burst)
        redis = unconnected(RedisLimiter, (name, cfg.rate, cfg.per, cfg.burst), dict(url=upstream))
    elif isinstance(upstream, RedisLimiter):
        redis = upstream
        if rate is None:
            rate, per, burst = redis.rate, redis.per, redis.capacity
    else:
        raise TypeError(
            f"upstream must be a Redis URL or a RedisLimiter, not {type(upstream).__name__}"
        )
    spec = redis.upstream_spec(**options)
    spec.encode()  # too long for the header: refused before anything is created
    return rate, per, burst, spec
