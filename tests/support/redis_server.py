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

    def __init__(
        self, password: "str | None" = None, tls: "CertAuthority | None" = None, args: tuple = ()
    ) -> None:
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
            cmd += [
                "--port",
                "0",
                "--tls-port",
                str(self.port),
                "--tls-cert-file",
                self.tls.cert,
                "--tls-key-file",
                self.tls.key,
                "--tls-ca-cert-file",
                self.tls.ca,
                "--tls-auth-clients",
                "no",
            ]
        if self.password is not None:
            cmd += ["--requirepass", self.password]
        self.proc = subprocess.Popen(
            cmd + list(self.args), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
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
            return redis.Redis(
                port=self.port,
                socket_timeout=timeout,
                socket_connect_timeout=timeout,
                password=self.password,
            )
        return redis.Redis(
            host="localhost",
            port=self.port,
            socket_timeout=timeout,
            socket_connect_timeout=timeout,
            password=self.password,
            ssl=True,
            ssl_ca_certs=self.tls.ca,
        )


class CertAuthority:
    """A throwaway certificate authority and a server certificate for ``localhost`` only, made with openssl."""

    def __init__(self) -> None:
        openssl = shutil.which("openssl")
        if openssl is None:
            if REQUIRED:
                pytest.fail(
                    "SHMLIMIT_REQUIRE_REDIS=1 but openssl is missing (apt-get install openssl)"
                )
            pytest.skip("openssl is missing")
        self.dir = tempfile.mkdtemp(prefix="shmlimit-ca-")
        p = lambda f: os.path.join(self.dir, f)  # noqa: E731
        self.ca, self.cert, self.key = p("ca.crt"), p("server.crt"), p("server.key")
        ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
        run = lambda *a: subprocess.run([openssl, *a], check=True, capture_output=True)  # noqa: E731
        run(
            "req",
            "-x509",
            *ec,
            "-keyout",
            p("ca.key"),
            "-out",
            self.ca,
            "-days",
            "2",
            "-subj",
            "/CN=shmlimit test CA",
        )
        run("req", *ec, "-keyout", self.key, "-out", p("server.csr"), "-subj", "/CN=localhost")
        with open(p("ext"), "w") as f:
            f.write("subjectAltName=DNS:localhost\n")
        run(
            "x509",
            "-req",
            "-in",
            p("server.csr"),
            "-CA",
            self.ca,
            "-CAkey",
            p("ca.key"),
            "-CAcreateserial",
            "-out",
            self.cert,
            "-days",
            "2",
            "-extfile",
            p("ext"),
        )


class RedisClusterServers:
    """A real Redis Cluster of ``masters`` nodes on free ports, made by ``redis-cli --cluster create``."""

    def __init__(self, masters: int = 3) -> None:
        # the cluster bus port defaults to port + 10000, which may be taken or beyond 65535: pick one
        self.nodes = [
            RedisServer(
                args=(
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    "nodes.conf",
                    "--cluster-node-timeout",
                    "2000",
                    "--cluster-port",
                    str(free_port()),
                )
            )
            for _ in range(masters)
        ]

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    def start(self) -> None:
        cli = shutil.which("redis-cli")
        if cli is None:
            if REQUIRED:
                pytest.fail(
                    "SHMLIMIT_REQUIRE_REDIS=1 but redis-cli is missing (apt-get install redis-tools)"
                )
            pytest.skip("redis-cli is missing")
        for n in self.nodes:
            n.start()
        subprocess.run(
            [
                cli,
                "--cluster",
                "create",
                *(f"127.0.0.1:{n.port}" for n in self.nodes),
                "--cluster-replicas",
                "0",
                "--cluster-yes",
            ],
            check=True,
            capture_output=True,
            timeout=60,
        )
        deadline = time.monotonic() + 30
        while not all(self._state(n) == "ok" for n in self.nodes):
            if time.monotonic() > deadline:
                raise RuntimeError("the cluster did not reach cluster_state:ok")
            time.sleep(0.05)  # polling the cluster's own state: nothing else to wait on

    @staticmethod
    def _state(node: RedisServer) -> str:
        info = node.client().execute_command("CLUSTER INFO")  # parsed by redis-py into a dict
        state = info.get("cluster_state") if isinstance(info, dict) else None
        return state.decode() if isinstance(state, bytes) else str(state)

    def stop(self) -> None:
        for n in self.nodes:
            n.stop()

    def node_id(self, node: RedisServer) -> str:
        myid = node.client().execute_command("CLUSTER MYID")
        return myid.decode() if isinstance(myid, bytes) else str(myid)

    def owner(self, key: str) -> RedisServer:
        """The master that serves ``key`` now, as the first node sees the slots."""
        client = self.nodes[0].client()
        slot = client.execute_command("CLUSTER KEYSLOT", key)
        for lo, hi, master, *_ in client.execute_command("CLUSTER SLOTS"):
            if lo <= slot <= hi:
                return next(n for n in self.nodes if n.port == master[1])
        raise RuntimeError(f"no node serves slot {slot}")

    def migrate(self, key: str, dst: RedisServer) -> None:
        """Move ``key``'s slot to ``dst`` the way ``redis-cli --cluster reshard`` does, key by key."""
        src = self.owner(key)
        slot = src.client().execute_command("CLUSTER KEYSLOT", key)
        src_id, dst_id = self.node_id(src), self.node_id(dst)
        dst.client().execute_command("CLUSTER SETSLOT", slot, "IMPORTING", src_id)
        src.client().execute_command("CLUSTER SETSLOT", slot, "MIGRATING", dst_id)
        while True:
            keys = src.client().execute_command("CLUSTER GETKEYSINSLOT", slot, 100)
            if not keys:
                break
            src.client().execute_command(
                "MIGRATE", "127.0.0.1", dst.port, "", 0, 5000, "KEYS", *keys
            )
        for n in self.nodes:
            n.client().execute_command("CLUSTER SETSLOT", slot, "NODE", dst_id)


class SentinelServers:
    """A master, a replica and one sentinel watching them as ``service`` (quorum 1, fast failover)."""

    def __init__(self, service: str = "shmlimit-test") -> None:
        self.service = service
        self.master = RedisServer()
        self.replica = RedisServer()
        self.port = free_port()
        self.dir = tempfile.mkdtemp(prefix="shmlimit-sentinel-")
        self.proc: "subprocess.Popen | None" = None

    @property
    def url(self) -> str:
        return f"redis+sentinel://127.0.0.1:{self.port}/{self.service}"

    def start(self) -> None:
        self.master.start()
        self.replica.args = ("--replicaof", "127.0.0.1", str(self.master.port))
        self.replica.start()
        conf = os.path.join(self.dir, "sentinel.conf")
        with open(conf, "w") as f:
            f.write(
                f"port {self.port}\nbind 127.0.0.1\ndir {self.dir}\n"
                f"sentinel monitor {self.service} 127.0.0.1 {self.master.port} 1\n"
                f"sentinel down-after-milliseconds {self.service} 300\n"
                f"sentinel failover-timeout {self.service} 3000\n"
            )
        self.proc = subprocess.Popen(
            [BINARY, conf, "--sentinel"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        import redis

        s = redis.Redis(port=self.port, socket_timeout=0.5, socket_connect_timeout=0.5)
        deadline = time.monotonic() + 15
        while True:  # polling until the sentinel knows the master and its replica
            try:
                if int(s.sentinel_master(self.service).get("num-slaves", 0)) >= 1:
                    break
            except redis.RedisError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("the sentinel did not see the master and its replica")
            time.sleep(0.05)
        s.close()

    def current_master_port(self) -> int:
        import redis

        s = redis.Redis(port=self.port, socket_timeout=0.5)
        try:
            return int(s.sentinel_get_master_addr_by_name(self.service)[1])
        finally:
            s.close()

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None
        self.master.stop()
        self.replica.stop()
