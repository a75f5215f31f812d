"""The public surface: exactly these names, each documented.  A change here is a change of the API."""

import inspect

import pytest

import shmlimit

# run once in CI: the public names and their docstrings: no segment
pytestmark = pytest.mark.backend_independent

PUBLIC = [
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
    "UnsupportedError",
    "UntrustedSegmentError",
    "UpstreamStats",
    "attach",
    "inspect",
    "list_names",
    "parse_spec",
    "throttle",
    "unlink",
]


def test_all_is_pinned():
    assert sorted(shmlimit.__all__) == PUBLIC
    assert len(set(shmlimit.__all__)) == len(shmlimit.__all__)


def test_star_import_gives_exactly_the_public_names():
    ns: dict = {}
    exec("from shmlimit import *", ns)
    assert sorted(k for k in ns if not k.startswith("__")) == PUBLIC


def test_every_public_name_is_documented():
    for n in PUBLIC:
        obj = getattr(shmlimit, n)
        assert inspect.getdoc(obj), f"shmlimit.{n} has no docstring"
