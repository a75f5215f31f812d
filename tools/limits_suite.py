"""Run ``limits``' own storage and strategy tests against ``shm://`` and ``async+shm://``.

``limits`` ships its test-suite in its source distribution (not in its wheel).  This fetches the
sdist of the installed version (``pip download``), and runs its storage and strategy tests
(``tests/test_storage.py``, ``tests/test_strategy.py`` and their ``tests/aio`` twins) unchanged,
with two entries added to its table of storages -- ``shm://`` beside ``memory://`` and
``async+shm://`` beside ``async+memory://``, each test on a fresh table -- and its conftest (which
starts docker services) replaced by one that only cleans the tables up.  The tests of the other
servers (redis, memcached, mongodb) are deselected: ``-k "in-memory or shm"``.

    python tools/limits_suite.py [--sdist DIR] [pytest args...]

A few of its tests sleep on the wall clock, and ``limits`` marks them ``flaky`` (its own CI reruns
them with pytest-rerunfailures).  The rule here is the project's own: a failed test not marked
``flaky`` fails the run, never rerun; the ``flaky`` ones that failed run once more, on their own,
and must pass then.  Every rerun is printed.

Needs pytest-asyncio and pytest-lazy-fixtures (the ``test`` extra).  Exits with pytest's status.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

FILES = [
    "tests/test_storage.py",
    "tests/test_strategy.py",
    "tests/aio/test_storage.py",
    "tests/aio/test_strategy.py",
]

#: Added to limits' tests/utils.py just before its parametrize marks are built from its tables.
STORAGES = """
# shmlimit: its two schemes beside memory (each test gets a fresh table: see conftest.py)
ALL_STORAGES["shm"] = pytest.param(
    "shm://limits-suite-table", {}, lf("shm_table"), marks=pytest.mark.shm, id="shm"
)
ALL_STORAGES_ASYNC["shm"] = pytest.param(
    "async+shm://limits-suite-table", {}, lf("shm_table"), marks=pytest.mark.shm, id="async-shm"
)
"""

CONFTEST = """
import pytest

import shmlimit
import shmlimit.integrations.limits  # noqa: F401  (registers shm:// and async+shm://)


def pytest_configure(config):
    config.addinivalue_line("markers", "shm: shmlimit's shm:// storage")
    # pytest-rerunfailures' mark, on its wall-clock tests: run_with_one_rerun below reruns them
    config.addinivalue_line("markers", "flaky: rerun on failure where pytest-rerunfailures is")


@pytest.fixture
def shm_table():
    unlink = shmlimit.unlink
    try:  # a fresh table for the test
        unlink("limits-suite-table")
    except FileNotFoundError:
        pass
    yield None
    try:  # and none left after it
        unlink("limits-suite-table")
    except FileNotFoundError:
        pass
"""


def fetch_sdist(dest: Path) -> Path:
    import limits

    version = limits.__version__
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:"]
        + ["-d", str(dest), f"limits=={version}"],
        check=True,
    )
    (archive,) = dest.glob(f"limits-{version}.tar.gz")
    with tarfile.open(archive) as tar:
        tar.extractall(dest, filter="data")
    return dest / f"limits-{version}"


#: Added before the first entry of the two TestConcreteStorages tables (sync, then async).
CONCRETE = {
    "tests/test_storage.py": (
        '        pytest.param("memory://", {}, MemoryStorage, None, id="in-memory"),\n',
        "        pytest.param(\n"
        '            "shm://limits-suite-table", {}, __import__("shmlimit.integrations.limits")\n'
        '            .integrations.limits.ShmStorage, lf("shm_table"), marks=pytest.mark.shm,\n'
        '            id="shm",\n'
        "        ),\n",
    ),
    "tests/aio/test_storage.py": (
        '        pytest.param(\n            "async+memory://",\n',
        "        pytest.param(\n"
        '            "async+shm://limits-suite-table", {}, __import__("shmlimit.integrations.limits")\n'
        '            .integrations.limits.AsyncShmStorage, lf("shm_table"), marks=pytest.mark.shm,\n'
        '            id="async-shm",\n'
        "        ),\n",
    ),
}


def _insert(path: Path, anchor: str, text: str, before: bool = True) -> None:
    old = path.read_text()
    if anchor not in old:
        raise SystemExit(f"{path}: its table of storages moved; update tools/limits_suite.py")
    path.write_text(old.replace(anchor, text + anchor if before else anchor + text, 1))


def prepare(src: Path) -> None:
    _insert(src / "tests" / "utils.py", "\nall_storage = pytest.mark.parametrize(", STORAGES)
    for rel, (anchor, text) in CONCRETE.items():
        _insert(src / rel, anchor, text)
    (src / "tests" / "conftest.py").write_text(CONFTEST)
    # its pytest.ini asks for coverage and docker; keep its markers, asyncio mode and warnings
    ini = (src / "pytest.ini").read_text()
    ini = ini.replace("    --cov=limits\n", "").replace("    -K\n", "")
    (src / "pytest.ini").write_text(ini)


def main(argv: list) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sdist", type=Path, help="an unpacked limits sdist to use (a copy is made)")
    args, rest = ap.parse_known_args(argv)
    with tempfile.TemporaryDirectory(prefix="limits-suite-") as tmp:
        if args.sdist:
            src = Path(tmp) / "limits"
            subprocess.run(["cp", "-r", str(args.sdist), str(src)], check=True)
        else:
            src = fetch_sdist(Path(tmp))
        prepare(src)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(src), *sys.path])))
        # the storages' ids: limits' own reference storage, and ours (its other servers are left out)
        cmd = [sys.executable, "-m", "pytest", "-k", "in-memory or shm"]
        cmd += ["-o", "asyncio_default_fixture_loop_scope=function"]
        return run_with_one_rerun(cmd + FILES + rest, cwd=src, env=env)


#: pytest's exit statuses: some tests failed; none was selected
TESTS_FAILED, NO_TESTS = 1, 5


def run_with_one_rerun(cmd: list, **kw) -> int:
    """Run ``cmd`` (a pytest command line); rerun once only its failed tests marked ``flaky``.

    The tests not marked ``flaky`` run first, on their own, never rerun; then the ``flaky`` ones,
    and once more those of them that failed (--lf: every test of that run is ``flaky``).
    """
    plain = subprocess.run(cmd + ["-m", "not flaky"], **kw).returncode
    flaky = subprocess.run(cmd + ["-m", "flaky"], **kw).returncode
    if flaky == TESTS_FAILED:
        print("== rerunning, once, only the tests limits marks flaky that failed")
        flaky = subprocess.run(cmd + ["-m", "flaky", "--lf"], **kw).returncode
    if plain == flaky == NO_TESTS:
        return NO_TESTS
    return next((status for status in (plain, flaky) if status not in (0, NO_TESTS)), 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
