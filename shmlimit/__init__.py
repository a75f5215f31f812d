"""shmlimit: one rate limit shared by many processes, through a token bucket in POSIX shared memory.

import shmlimit
lim = shmlimit.Limiter("api", rate=1000)   # 1000 ops per second, shared by every process
lim.acquire()                              # blocks until granted
"""

from importlib.util import find_spec as _find_spec

from shmlimit.adapt import Adapt, AdaptStats
from shmlimit.config import Config, RateSpec, parse_spec
from shmlimit.errors import (
    ConfigMismatchError,
    ConfigWriterTakenOver,
    KeyTableFullError,
    LimiterNotFoundError,
    QueueFullError,
    RateLimited,
    SegmentError,
    SharedMemoryFullError,
    ShmlimitError,
    UnsupportedError,
    UntrustedSegmentError,
)
from shmlimit.keyed.limiter import KeyedLimiter, KeyedStats
from shmlimit.kinds import attach, inspect
from shmlimit.limiter import Limiter, unlink
from shmlimit.protocol import KeyedRateLimit, RateLimit
from shmlimit.shm.cells import warm_backend as _warm_backend
from shmlimit.shm.segment import list_names
from shmlimit.stats import ProcessStats, Stats, UpstreamStats
from shmlimit.throttle import throttle

#: The one version: pyproject.toml reads it from here, ``shmlimit --version`` prints it.
__version__ = "0.1.0"

# The portable backend's package is imported with shmlimit, not at the first limiter: its import
# (cffi parsing declarations) costs 40-100 ms of CPU, which a pre-fork server's master then pays once
# and every worker inherits, instead of each recycled worker at its first limiter, on cores its
# peers need to keep the rate.  A bad SHMLIMIT_BACKEND or a missing backend is told at open.
try:
    _warm_backend()
except (ImportError, ValueError):
    pass

# The limits storages shm:// and async+shm:// (Flask-Limiter, slowapi) exist once their module is
# imported: limits has no entry points, only the registration a Storage subclass makes when it is
# defined.  So `import shmlimit` registers them wherever limits is installed.
if _find_spec("limits") is not None:
    try:
        import shmlimit.integrations.limits  # noqa: F401
    except ImportError:  # a limits this integration cannot use: importing it directly says why
        pass

__all__ = [
    "Adapt",
    "AdaptStats",
    "Config",
    "ConfigMismatchError",
    "ConfigWriterTakenOver",
    "KeyTableFullError",
    "KeyedLimiter",
    "KeyedRateLimit",
    "KeyedStats",
    "Limiter",
    "LimiterNotFoundError",
    "ProcessStats",
    "QueueFullError",
    "RateLimit",
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
    "UnsupportedError",
    "UpstreamStats",
    "UntrustedSegmentError",
]
