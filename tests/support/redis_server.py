"""A real redis-server for the tests: started on a free port, no persistence, stopped by pid."""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time

import pytest

BINARY = shutil.which("redis-server")
#: Set by CI: a missing server binary (or redis-py) fails the Redis tests instead of skipping them.
REQUIRED = os.environ.get("SHMLIMIT_REQUIRE_REDIS") == "1"


def require() -> None:
    try:
        import redis  # noqa: F401
    except ImportError:
        missing = "redis-py (pip install 'shmlimit[redis]')"
    else:
        missing = None if BINARY else "the redis-server binary (apt-get install redis-server)"
    if missing:
        if REQUIRED:
            pytest.fail(f"SHMLIMIT_REQUIRE_REDIS=1 but {missing} is missing")
        pytest.skip(f"{missing} is missing")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    def __init__(self) -> None:
        self.port = free_port()
        self.dir = tempfile.mkdtemp(prefix="shmlimit-redis-")
        self.proc: "subprocess.Popen | None" = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [BINARY, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", self.dir],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        import redis

        client = redis.Redis(port=self.port, socket_timeout=0.5, socket_connect_timeout=0.5)
        deadline = time.monotonic() + 15
        while True:
            try:
                if client.ping():
                    break
            except redis.ConnectionError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server did not start on port {self.port}")
                time.sleep(0.01)  # polling for the server to listen: nothing else to wait on
        client.close()

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def client(self):
        import redis

        return redis.Redis(port=self.port, socket_timeout=2)
