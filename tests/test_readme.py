"""Every Python example in README.md and the docs pages runs as written (a fresh interpreter, a script).

An example that needs what the test environment may lack (a package outside the test extra, or
a feature still to come) says so on the line just above its fence, ``<!-- needs: NAME -->``, with
NAME one of ``NEEDS`` below: it runs wherever that is present and is skipped, naming it, elsewhere.
"""

import fcntl
import glob
import importlib
import importlib.util
import os
import re
import subprocess
import sys
import tempfile

import pytest

# run once in CI: the docs' examples run as written; the backends are the core tests' subject
pytestmark = pytest.mark.backend_independent

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = ["README.md"] + sorted(
    os.path.relpath(p, ROOT)
    for p in glob.glob(os.path.join(ROOT, "docs", "**", "*.md"), recursive=True)
)
#: an example: an optional ``<!-- needs: a, b -->`` line, then a ```python fence at the line's start
EXAMPLE = re.compile(
    r"(?:^<!--\s*needs:\s*([\w ,.-]+?)\s*-->\n)?^```python\n(.*?)^```", re.S | re.M
)


def _has_module(name):
    return importlib.util.find_spec(name) is not None


def _parses_limits_rate_syntax():
    try:
        from shmlimit.config import parse_rate

        return parse_rate("10 per second") == (10.0, 1.0)
    except (ImportError, TypeError, ValueError):
        return False


def _has_moving_window():
    """What ``limits`` asks of a storage for its moving window."""
    from shmlimit.integrations.limits import ShmStorage

    return all(hasattr(ShmStorage, m) for m in ("acquire_entry", "get_moving_window"))


def _has_attr(module, name):
    return hasattr(importlib.import_module(module), name)


#: What an example may need, and how to tell whether this environment has it.
NEEDS = {
    "slowapi": lambda: _has_module("slowapi"),
    "fastapi": lambda: _has_module("fastapi"),
    "limits-rate-syntax": _parses_limits_rate_syntax,
    "client-ip": lambda: _has_attr("shmlimit.integrations._http", "client_ip"),
    "moving-window": _has_moving_window,
}


def examples():
    out = []
    for page in PAGES:
        text = open(os.path.join(ROOT, page)).read()
        for i, m in enumerate(EXAMPLE.finditer(text)):
            needs = [n.strip() for n in (m.group(1) or "").split(",") if n.strip()]
            out.append(pytest.param(m.group(2), needs, id=f"{page}:{i}"))
    return out


EXAMPLES = examples()
#: The examples name their limiters as a user would ("api", "per-domain"), so two runs of this file
#: at once on one machine would share those segments.  Each example runs holding this lock: runs
#: on one machine take their turns, and every example starts from the segments the last one left.
LOCK = os.path.join(tempfile.gettempdir(), "shmlimit-readme-examples.lock")


def test_the_pages_have_examples():
    assert sum(1 for p in EXAMPLES if p.id.startswith("README.md:")) >= 3
    assert len({p.id.split(":")[0] for p in EXAMPLES}) >= 10


def test_every_python_fence_is_an_example():
    """A fence spelled otherwise (```py, indented) would escape this test."""
    for page in PAGES:
        text = open(os.path.join(ROOT, page)).read()
        assert not re.search(r"```(py|python3)\s*$", text, re.M), page
        assert not re.search(r"^[ \t]+```python", text, re.M), page


@pytest.mark.parametrize("code, needs", EXAMPLES)
def test_example_runs(code, needs, request):
    unknown = [n for n in needs if n not in NEEDS]
    assert not unknown, f"unknown needs {unknown}: add them to NEEDS"
    missing = [n for n in needs if not NEEDS[n]()]
    if missing:
        pytest.skip(f"needs {', '.join(missing)}, not available here")
    env = dict(os.environ)
    if "REDIS_URL" in code:  # the Redis examples run against a real server of the tests'
        env["REDIS_URL"] = request.getfixturevalue("redis_server").url
    with open(LOCK, "a") as lock, tempfile.TemporaryDirectory() as d:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, whatever happens
        path = os.path.join(d, "example.py")
        with open(path, "w") as f:
            f.write(code)
        proc = subprocess.run(
            [sys.executable, path], cwd=d, capture_output=True, text=True, timeout=120, env=env
        )
    assert proc.returncode == 0, proc.stderr
