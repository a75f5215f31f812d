"""Real servers for the integration tests: started on a free 127.0.0.1 port in a session of their own,
stopped by their process group (only ever the processes the test started)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from typing import Dict, List, Optional

BIN = os.path.dirname(sys.executable)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str, timeout: float = 30.0, headers: Optional[Dict[str, str]] = None):
    """(status, headers as a dict with lower-case names, body) -- 4xx/5xx included, never raised."""
    try:
        with urllib.request.urlopen(
            urllib.request.Request(url, headers=headers or {}), timeout=timeout
        ) as r:
            return r.status, {k.lower(): v for k, v in r.headers.items()}, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, {k.lower(): v for k, v in e.headers.items()}, e.read().decode()


class Server:
    """``argv`` run with ``{port}`` filled in; ready once ``ready_path`` answers 200."""

    def __init__(
        self,
        argv: List[str],
        cwd: str,
        env: Optional[Dict[str, str]] = None,
        ready_path: str = "/health",
    ):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(os.path.join(cwd, f"server-{self.port}.log"), "w+")
        full_env = dict(
            os.environ,
            PYTHONPATH=cwd + os.pathsep + os.environ.get("PYTHONPATH", ""),
            **(env or {}),
        )
        self.proc = subprocess.Popen(
            [a.format(port=self.port) for a in argv],
            cwd=cwd,
            env=full_env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.ready_path = ready_path

    def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.output()}")
            try:
                if get(self.url + self.ready_path, timeout=2)[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"server not ready after {timeout} s:\n{self.output()}")

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # stragglers of our own session only
        except ProcessLookupError:
            pass
        self.proc.wait(15)
        self.log.close()

    def __enter__(self) -> "Server":
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
