"""A small delaying TCP proxy on 127.0.0.1: a "remote" Redis for hosts on one machine.

The kernels here have no ``netem``, so latency is added in user space: every
chunk read from one side is written to the other ``delay`` seconds after it
arrived, in order, in both directions.  ``drop(seconds)`` closes every
connection and refuses new ones for that long (a host cut off from Redis).
"""

from __future__ import annotations

import collections
import socket
import threading
import time
from typing import Deque, List, Tuple


class DelayProxy:
    def __init__(self, target_port: int, delay: float, target_host: str = "127.0.0.1") -> None:
        self.target = (target_host, target_port)
        self.delay = delay
        self.listener = socket.socket()
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(128)
        self.port = self.listener.getsockname()[1]
        self._conns: List[socket.socket] = []
        self._lock = threading.Lock()
        self._refuse_until = 0.0
        self._closed = False
        threading.Thread(target=self._accept, name=f"proxy-{self.port}", daemon=True).start()

    def url(self, db: int = 0) -> str:
        return f"redis://127.0.0.1:{self.port}/{db}"

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            if time.monotonic() < self._refuse_until:
                client.close()
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            for s in (client, upstream):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self._conns += [client, upstream]
            for src, dst in ((client, upstream), (upstream, client)):
                self._pipe(src, dst)

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        queue: Deque[Tuple[float, bytes]] = collections.deque()
        ready = threading.Condition()

        def reader() -> None:
            try:
                while True:
                    data = src.recv(65536)
                    with ready:
                        queue.append((time.monotonic() + self.delay, data))
                        ready.notify()
                    if not data:
                        return
            except OSError:
                with ready:
                    queue.append((0.0, b""))
                    ready.notify()

        def writer() -> None:
            try:
                while True:
                    with ready:
                        while not queue:
                            ready.wait()
                        due, data = queue.popleft()
                    pause = due - time.monotonic()
                    if pause > 0:
                        time.sleep(pause)
                    if not data:
                        break
                    dst.sendall(data)
            except OSError:
                pass
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

        threading.Thread(target=reader, daemon=True).start()
        threading.Thread(target=writer, daemon=True).start()

    def drop(self, seconds: float) -> None:
        """Cut every connection now and refuse new ones for ``seconds``."""
        self._refuse_until = time.monotonic() + seconds
        with self._lock:
            conns, self._conns = self._conns, []
        for s in conns:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def close(self) -> None:
        self._closed = True
        self.drop(0)
        self.listener.close()
