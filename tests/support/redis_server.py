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
    """``password``: the server requires it (``requirepass``).  ``tls``: a ``CertAuthority``; the server then
    listens with TLS only, with a certificate for ``localhost`` signed by that CA."""

    def __init__(self, password: "str | None" = None, tls: "CertAuthority | None" = None, args: tuple = ()) -> None:
        self.port = free_port()
        self.dir = tempfile.mkdtemp(prefix="shmlimit-redis-")
        self.proc: "subprocess.Popen | None" = None
        self.password = password
        self.tls = tls
        self.args = tuple(args)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        cmd = [BINARY, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", self.dir]
        if self.tls is None:
            cmd += ["--port", str(self.port)]
        else:
            cmd += ["--port", "0", "--tls-port", str(self.port), "--tls-cert-file", self.tls.cert,
                    "--tls-key-file", self.tls.key, "--tls-ca-cert-file", self.tls.ca, "--tls-auth-clients", "no"]
        if self.password is not None:
            cmd += ["--requirepass", self.password]
        self.proc = subprocess.Popen(cmd + list(self.args), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        import redis

        client = self.client(timeout=0.5)
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

    def client(self, timeout: float = 2):
        import redis

        if self.tls is None:
            return redis.Redis(port=self.port, socket_timeout=timeout, socket_connect_timeout=timeout,
                               password=self.password)
        return redis.Redis(host="localhost", port=self.port, socket_timeout=timeout, socket_connect_timeout=timeout,
                           password=self.password, ssl=True, ssl_ca_certs=self.tls.ca)


class CertAuthority:
    """A throwaway certificate authority and a server certificate for ``localhost`` only, made with openssl."""

    def __init__(self) -> None:
        openssl = shutil.which("openssl")
        if openssl is None:
            if REQUIRED:
                pytest.fail("SHMLIMIT_REQUIRE_REDIS=1 but openssl is missing (apt-get install openssl)")
            pytest.skip("openssl is missing")
        self.dir = tempfile.mkdtemp(prefix="shmlimit-ca-")
        p = lambda f: os.path.join(self.dir, f)  # noqa: E731
        self.ca, self.cert, self.key = p("ca.crt"), p("server.crt"), p("server.key")
        ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
        run = lambda *a: subprocess.run([openssl, *a], check=True, capture_output=True)  # noqa: E731
        run("req", "-x509", *ec, "-keyout", p("ca.key"), "-out", self.ca, "-days", "2", "-subj", "/CN=shmlimit test CA")
        run("req", *ec, "-keyout", self.key, "-out", p("server.csr"), "-subj", "/CN=localhost")
        with open(p("ext"), "w") as f:
            f.write("subjectAltName=DNS:localhost\n")
        run("x509", "-req", "-in", p("server.csr"), "-CA", self.ca, "-CAkey", p("ca.key"), "-CAcreateserial",
            "-out", self.cert, "-days", "2", "-extfile", p("ext"))
