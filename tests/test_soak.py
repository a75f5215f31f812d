"""The soak tool, run briefly: workers killed, stopped and restarted, and the promise kept."""

import os
import subprocess
import sys

import pytest
from support.procs import ROOT, WORKDIR

pytestmark = pytest.mark.slow  # real processes measured in real (wall-clock) time


def test_short_soak_keeps_the_promise():
    r = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "tools", "soak.py"),
            "--seconds",
            "8",
            "--rate",
            "1000",
            "--seed",
            "7",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=WORKDIR,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "promise kept" in r.stdout and "faults:" in r.stdout
