"""Every Python example in the README runs as written (in a fresh interpreter, as a script)."""

import fcntl
import os
import re
import subprocess
import sys
import tempfile

import pytest

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")
BLOCKS = re.findall(r"```python\n(.*?)```", open(README).read(), re.S)
#: The examples name their limiters as a user would ("api", "per-domain"), so two runs of this file
#: at once on one machine would share those segments.  Each example runs holding this lock: runs
#: on one machine take their turns, and every example starts from the segments the last one left.
LOCK = os.path.join(tempfile.gettempdir(), "shmlimit-readme-examples.lock")


def test_readme_has_examples():
    assert len(BLOCKS) >= 3


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_example_runs(index, request):
    env = dict(os.environ)
    if "REDIS_URL" in BLOCKS[index]:  # the Redis examples run against a real server of the tests'
        env["REDIS_URL"] = request.getfixturevalue("redis_server").url
    with open(LOCK, "a") as lock, tempfile.TemporaryDirectory() as d:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, whatever happens
        path = os.path.join(d, f"example_{index}.py")
        with open(path, "w") as f:
            f.write(BLOCKS[index])
        proc = subprocess.run(
            [sys.executable, path], cwd=d, capture_output=True, text=True, timeout=120, env=env
        )
    assert proc.returncode == 0, proc.stderr
