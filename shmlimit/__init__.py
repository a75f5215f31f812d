"""shmlimit: one rate limit shared by many processes, through a token bucket in POSIX shared memory.

    import shmlimit
    lim = shmlimit.Limiter("api", rate=1000)   # 1000 ops per second, shared by every process
    lim.acquire()                              # blocks until granted
"""
from .config import Config, RateSpec, parse_spec
from .errors import (
    ConfigMismatchError,
    ConfigWriterTakenOver,
    KeyTableFullError,
    LimiterNotFoundError,
    QueueFullError,
    RateLimited,
    SegmentError,
    SharedMemoryFullError,
    ShmlimitError,
    UntrustedSegmentError,
)
from .keyed import KeyedLimiter, KeyedStats
from .kinds import attach, inspect
from .limiter import Limiter, unlink
from .segment import list_names
from .stats import ProcessStats, Stats, UpstreamStats
from .throttle import throttle

__version__ = "0.1.0"

__all__ = [
    "Config",
    "ConfigMismatchError",
    "ConfigWriterTakenOver",
    "KeyTableFullError",
    "KeyedLimiter",
    "KeyedStats",
    "Limiter",
    "LimiterNotFoundError",
    "ProcessStats",
    "QueueFullError",
    "RateLimited",
    "RateSpec",
    "SegmentError",
    "SharedMemoryFullError",
    "ShmlimitError",
    "Stats",
    "attach",
    "inspect",
    "list_names",
    "parse_spec",
    "throttle",
    "unlink",
    "UpstreamStats",
    "UntrustedSegmentError",
]
