"""Connecting to Redis and naming what went wrong: the redis-py side of the Redis tier.

``connect`` builds a client for a server, a cluster or a sentinel-managed
master from one URL syntax (the ``limits`` library's); ``classify`` turns a
redis-py error into ``RedisUnavailableError`` (no answer in time: fallbacks
apply) or ``RedisDataError`` (an answer that is an error: never a reason to
let calls through).  Needs redis-py (the ``redis`` extra).
"""

from __future__ import annotations

import math
import os
import socket
import threading
import time
from contextlib import contextmanager
from typing import Any, Dict, Iterable, Iterator, Tuple, Type
from urllib.parse import unquote

from shmlimit.errors import MissingExtraError, RedisDataError, RedisUnavailableError
from shmlimit.redis import urls
from shmlimit.redis.urls import redact

try:
    import redis as _redis
    import redis.asyncio as _aredis
    from redis import exceptions as _rx
    from redis.asyncio.retry import Retry as _ARetry
    from redis.backoff import NoBackoff
    from redis.retry import Retry
except ImportError as e:  # without the redis extra: say what installs it
    raise MissingExtraError(__name__, "redis", e) from e

# ---------------------------------------------------------------------------------
# a deadline for a whole answer


class ReadDeadlines:
    """Shuts the socket of a read that outlives its deadline (``bound``), so that it fails as a
    dropped connection does.

    redis-py's ``socket_timeout`` bounds each read of the socket, not an answer: a server that
    trickles its answer a byte a read held a call for as long as it liked, and a hierarchical
    filler in that call expired no lease (18 ops leased 2 s earlier, at a ttl of 0.1 s, were
    granted) and kept ``close()`` waiting for ever.  One watcher thread per process, asleep but
    for the first deadline while a read is bound; made again in a forked child.
    """

    def __init__(self) -> None:
        self._forked()
        os.register_at_fork(after_in_child=self._forked)

    def _forked(self) -> None:
        self._cv = threading.Condition()
        self._armed: Dict[int, Tuple[float, Any]] = {}  # id(conn) -> (deadline, conn)
        self._watcher = False
        self._wake = math.inf  # when the watcher wakes by itself (inf: asleep until notified)

    @contextmanager
    def bound(self, conn: Any, seconds: float) -> Iterator[None]:
        """Within ``seconds`` the read on ``conn`` (a redis-py connection) ends, or its socket is
        shut (redis-py then raises ``ConnectionError``)."""
        at = time.monotonic() + seconds
        with self._cv:
            if not self._watcher:
                self._watcher = True
                threading.Thread(
                    target=self._watch, name="shmlimit-redis-reads", daemon=True
                ).start()
            if at < self._wake:  # (the first deadline now: the watcher sleeps until it)
                self._wake = at
                self._cv.notify()
            self._armed[id(conn)] = (at, conn)
        try:
            yield
        finally:
            with self._cv:
                self._armed.pop(id(conn), None)

    def _watch(self) -> None:
        cv = self._cv
        with cv:
            while cv is self._cv:
                now = time.monotonic()
                for key, (at, conn) in list(self._armed.items()):
                    if at <= now:
                        del self._armed[key]
                        sock = getattr(conn, "_sock", None)
                        try:
                            sock.shutdown(socket.SHUT_RDWR)
                        except (AttributeError, OSError):
                            pass  # (closed meanwhile: its read has ended)
                # woken only for a deadline earlier than the one it sleeps until, kept with none
                # left (a read that ended in time): one thread's reads do not wake it each
                keep = self._wake if self._wake > now else math.inf
                self._wake = min((at for at, _ in self._armed.values()), default=keep)
                cv.wait(None if self._wake == math.inf else max(0.0, self._wake - now))


#: this process's read deadlines
READS = ReadDeadlines()
_BOUNDED: Dict[type, type] = {}


def bounded(cls: type) -> type:
    """redis-py's connection class ``cls``, reading every answer whole within its socket timeout
    (``READS``).  (redis-py's asyncio connections bound the whole answer already.)"""
    sub = _BOUNDED.get(cls)
    if sub is None:

        def read_response(self: Any, *args: Any, **kwargs: Any) -> Any:
            with READS.bound(self, self.socket_timeout):
                return cls.read_response(self, *args, **kwargs)  # type: ignore[attr-defined]

        sub = _BOUNDED[cls] = type(cls.__name__, (cls,), {"read_response": read_response})
    return sub


# ---------------------------------------------------------------------------------
# errors: only a connection error or a timeout is "unavailable"


#: redis-py's errors that mean "no answer in time": the server is down, unreachable, loading,
#: failing over (``READONLY`` from a demoted master, ``CLUSTERDOWN`` and ``MASTERDOWN``,
#: ``TRYAGAIN`` while a slot migrates), or ``BUSY`` running someone's script (``classify``) --
#: never an answer about the data.  (``redis.sentinel``'s ``MasterNotFoundError`` and
#: ``SlaveNotFoundError`` are ``ConnectionError``s.)  Credentials refused are not among them: a
#: wrong password is a configuration error, and fails closed like a data error (``_REFUSED``).
_UNAVAILABLE = (
    _rx.ConnectionError,
    _rx.TimeoutError,
    _rx.ReadOnlyError,
    _rx.TryAgainError,
    _rx.ClusterDownError,
)
_REFUSED = (_rx.AuthenticationError, _rx.AuthorizationError)


def classify(e: BaseException, where: str, secrets: Iterable[str] = ()) -> Exception:
    """The shmlimit error for a redis-py error ``e``: ``RedisUnavailableError`` or ``RedisDataError``.

    ``where`` (already redacted) names the server and the limiter.  redis-py's
    own message is kept, with any URL in it redacted and each of ``secrets`` (the
    client's passwords) hidden: redis-py 6.2 to 7.x show every connection keyword,
    the password too, in a pool's repr, which a sentinel's "no master" error quotes.
    ``e`` is the cause unless its message held a secret: then nothing chains it, so no
    traceback or log shows it (``raise err from err.__cause__``).
    """
    text = redact(str(e)) if "://" in str(e) else str(e)
    quoted = sorted({s for s in secrets if s and s in text}, key=len, reverse=True)
    for s in quoted:
        text = text.replace(s, urls.HIDDEN)
    # (a cluster client that reached no node raises its own error, from the connection's)
    cause = e.__cause__ if isinstance(e, _rx.RedisClusterException) else e
    busy = isinstance(cause, _rx.ResponseError) and str(cause).startswith("BUSY ")  # (a script)
    if (busy or isinstance(cause, _UNAVAILABLE)) and not isinstance(cause, _REFUSED):
        err: Exception = RedisUnavailableError(f"{where} unavailable: {type(e).__name__}: {text}")
    else:
        err = RedisDataError(f"{where} answered with an error: {type(e).__name__}: {text}")
    err.__cause__ = None if quoted else e
    err.__suppress_context__ = True
    return err


#: Errors that could come from the server or the connection, as opposed to our own bugs.
_REDIS_ERRORS: Tuple[Type[BaseException], ...] = (
    _rx.RedisError,
    _rx.RedisClusterException,
    OSError,
)


# ---------------------------------------------------------------------------------
# connecting: one URL syntax for a server, a cluster and a sentinel-managed master


#: Connections a client keeps at most (one per thread or coroutine in a call at once), unless the
#: URL says ``?max_connections=``: redis-py's default for asyncio.
MAX_CONNECTIONS = 100


def connect(url: str, secrets: Dict[str, str], timeout: float, is_async: bool = False) -> Any:
    """A redis-py client for ``url`` (without secrets; they come in ``secrets``).

    ``redis://``, ``rediss://``, ``unix://`` (and ``redis+unix://``): one
    server, as redis-py reads them.  ``redis+cluster://host:port[,host:port]``:
    a Redis Cluster found from any of those nodes.
    ``redis+sentinel://host:port[,host:port]/service[/db]``: the master the
    sentinels name for ``service``.  The URL's password is used for the
    servers and for the sentinels (the ``limits`` library's convention);
    ``?sentinel_password=`` gives the sentinels their own.  ``valkey``
    schemes are the same.  TLS (``rediss``) always verifies the server's
    certificate and host name (``?ssl_ca_certs=/path/ca.pem`` names the CA).  A server's client
    keeps at most ``?max_connections=`` connections (``MAX_CONNECTIONS``) and a call finding them
    all in use waits up to ``timeout`` for one; a cluster's and a sentinel's keep redis-py's pools,
    and with asyncio their calls beyond ``?max_connections=`` wait the same way (``_calls_wait``).
    """
    scheme = urls.scheme_of(urls.check(url))  # (the rules a URL follows, at one place)
    tls = scheme in urls.TLS_SCHEMES
    opts: Dict[str, Any] = dict(socket_timeout=timeout, socket_connect_timeout=timeout)
    # one immediate reconnect (a restarted server), never a back-off: callers must learn fast
    opts["retry"] = (_ARetry if is_async else Retry)(NoBackoff(), 1)
    opts.update(secrets)
    if tls:
        opts.update(ssl_cert_reqs="required", ssl_check_hostname=True)
    lib = _aredis if is_async else _redis
    rest = url[len(scheme) + 3 :]
    if scheme in urls.SINGLE_SCHEMES:
        base = {"redis": "redis", "valkey": "redis", "rediss": "rediss", "valkeys": "rediss"}.get(
            scheme, "unix"
        )
        # a call finding every connection in use waits up to ``timeout`` for one (the URL's
        # ``?max_connections=`` wins), as it waits for an answer: never an error of its own
        if not is_async:  # (the class the URL's scheme names, its answers read whole)
            kind = _redis.connection.parse_url(f"{base}://{rest}").get("connection_class")
            opts["connection_class"] = bounded(kind or _redis.Connection)
        pool = lib.BlockingConnectionPool.from_url(
            f"{base}://{rest}", max_connections=MAX_CONNECTIONS, timeout=timeout, **opts
        )
        client = lib.Redis(connection_pool=pool)
        client.auto_close_connection_pool = True  # (closed with the client, as from_url's)
        return client
    _, user, _, body, query = urls.parts(url)  # (no password: it came in ``secrets``)
    netloc, _, tail = body.partition("/")
    if user:
        opts["username"] = unquote(user)
    for k, v in urls.options(url).items():
        if k not in ("ssl_cert_reqs", "ssl_check_hostname"):  # TLS is always verified (urls.check)
            opts[k] = v
    if tls:
        opts["ssl"] = True
    if scheme in urls.CLUSTER_SCHEMES:
        nodes = [lib.cluster.ClusterNode(h, p) for h, p in urls.hosts(netloc, 6379)]
        try:  # (it reaches its nodes now, where a server's client waits for its first call)
            return _calls_wait(lib.RedisCluster(startup_nodes=nodes, **opts), opts, is_async)
        except _REDIS_ERRORS as e:
            err = classify(e, f"redis at {redact(url)}", secrets.values())
            raise err from err.__cause__  # e, or nothing when its message held a secret
    # sentinel
    service, _, db = tail.partition("/")
    if db:
        opts["db"] = int(db)
    sentinel_opts = {k: v for k, v in opts.items() if k not in ("db", "sentinel_password")}
    if "sentinel_password" in opts:
        sentinel_opts["password"] = opts.pop("sentinel_password")
    if not is_async:  # (a master's connections read their answers whole)
        tls_cls = _redis.sentinel.SentinelManagedSSLConnection
        opts["connection_class"] = bounded(
            tls_cls if opts.pop("ssl", False) else _redis.sentinel.SentinelManagedConnection
        )
    sentinels = lib.Sentinel(urls.hosts(netloc, 26379), sentinel_kwargs=sentinel_opts, **opts)
    return _calls_wait(sentinels.master_for(service), opts, is_async)


def _calls_wait(client: Any, opts: Dict[str, Any], is_async: bool) -> Any:
    """An asyncio cluster's or sentinel's ``client`` whose calls beyond the URL's
    ``?max_connections=`` wait for one in flight to end (``CALLS``, read by ``direct``), as a
    server's blocking pool makes them: redis-py's own pools there refuse them at once, and a
    healthy deployment answered "unavailable" to a burst of coroutines."""
    if is_async and "max_connections" in opts:
        import asyncio

        client.shmlimit_calls = asyncio.Semaphore(int(opts["max_connections"]))
    return client
