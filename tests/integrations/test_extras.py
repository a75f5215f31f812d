"""Missing extras give hints that lead somewhere; shm:// is found by limits after `import shmlimit`."""

import json
import os
import re
import subprocess
import sys
import textwrap
import uuid

import pytest
from support.procs import ROOT, WORKDIR

# run once in CI: hints for missing extras, and limits finding shm://
pytestmark = pytest.mark.backend_independent


def _python(code):
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True, text=True, timeout=120, cwd=WORKDIR,
    )  # fmt: skip


@pytest.mark.parametrize(
    "module, dependency, extra",
    [
        ("shmlimit.integrations.limits", "limits", "limits"),
        ("shmlimit.integrations.prometheus", "prometheus_client", "prometheus"),
        ("shmlimit.integrations.celery", "celery", "celery"),
        ("shmlimit.integrations.httpx", "httpx", "httpx"),
        ("shmlimit.integrations.requests", "requests", "requests"),
        ("shmlimit.redis.client", "redis", "redis"),
    ],
)
def test_importing_without_the_extra_names_the_pip_command(module, dependency, extra):
    r = _python(
        f"""
        import json, sys
        sys.modules[{dependency!r}] = None  # as if it were not installed
        import shmlimit  # the package itself never needs an extra
        try:
            import {module}
        except ImportError as e:
            print(json.dumps([type(e).__name__, e.name, e.extra, str(e)]))
        """
    )
    assert r.returncode == 0, r.stderr
    kind, name, said, message = json.loads(r.stdout)
    assert (kind, name, said) == ("MissingExtraError", dependency, extra), message
    assert f"pip install 'shmlimit[{extra}]'" in message, message


def test_every_install_hint_in_the_code_is_spelled_one_way():
    pyproject = open(os.path.join(ROOT, "pyproject.toml")).read()
    section = pyproject.split("[project.optional-dependencies]")[1].split("\n[")[0]
    extras = set(re.findall(r"^(\w+) = \[", section, re.M))
    assert {"limits", "prometheus", "celery", "httpx", "requests", "redis"} <= extras
    for dirpath, _, files in os.walk(os.path.join(ROOT, "shmlimit")):
        for f in files:
            if f.endswith(".py"):
                text = open(os.path.join(dirpath, f)).read()
                for m in re.finditer(r"shmlimit\[[^\]]*\]", text):
                    around = text[max(0, m.start() - 13) : m.end() + 1]
                    assert around.startswith("pip install '") and around.endswith("'"), (f, around)
                    assert m.group(0)[9:-1] in extras | {"{extra}", "<extra>"}, (f, m.group(0))


@pytest.mark.parametrize("order", ["limits first", "shmlimit first"])
def test_limits_finds_shm_storage_after_import_shmlimit(order):
    """Flask-Limiter's storage_uri="shm://..." works with `import shmlimit` anywhere in the app: no
    import of shmlimit.integrations.limits (limits has no entry points to find it otherwise)."""
    table = f"test-extras-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    first, second = (
        ("import limits.storage", "import shmlimit")
        if order == "limits first"
        else ("import shmlimit", "import limits.storage")
    )
    r = _python(
        f"""
        import sys
        {first}
        {second}
        assert "shmlimit.integrations.limits" in sys.modules
        from limits import parse
        from limits.storage import storage_from_string
        from limits.strategies import FixedWindowRateLimiter
        storage = storage_from_string("shm://{table}?keys=64")
        try:
            hits = FixedWindowRateLimiter(storage)
            print([hits.hit(parse("2/minute"), "k") for _ in range(3)])
            print(type(storage_from_string("async+shm://{table}")).__name__)
        finally:
            shmlimit.unlink("{table}")
        """
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("\n")[:2] == ["[True, True, False]", "AsyncShmStorage"]
