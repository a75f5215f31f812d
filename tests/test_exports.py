"""The public surface: exactly these names, each documented.  A change here is a change of the API."""

import importlib.util
import inspect
import typing

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


def test_every_annotation_resolves_at_runtime():
    """typing.get_type_hints (pydantic, typer, sphinx-autodoc-typehints) on every public function
    and every public method of every kind: no annotation names a class the module does not have."""
    from shmlimit.keyed.multi import MultiKeyedLimiter
    from shmlimit.multirate import MultiLimiter
    from shmlimit.protocol import KeyView

    kinds = [MultiLimiter, MultiKeyedLimiter, KeyView]
    if importlib.util.find_spec("redis") is not None:
        from shmlimit.redis.direct import RedisLimiter
        from shmlimit.redis.keyed import RedisKeyedLimiter

        kinds += [RedisLimiter, RedisKeyedLimiter]
    checked = 0
    for obj in [getattr(shmlimit, n) for n in PUBLIC] + kinds:
        members = inspect.getmembers(obj) if inspect.isclass(obj) else [("", obj)]
        for n, f in members:
            if n.startswith("_") and n not in ("__init__", "__new__", ""):
                continue
            f = f.fget if isinstance(f, property) else f
            if inspect.isfunction(f) or inspect.ismethod(f):
                typing.get_type_hints(f)  # raises NameError on a name the module lacks
                checked += 1
    assert checked > 100
