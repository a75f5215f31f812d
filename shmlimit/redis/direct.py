"""``RedisLimiter``: the same limit shared across hosts, decided by one Lua script in Redis.

    from shmlimit.redis.direct import RedisLimiter
    lim = RedisLimiter("partner-api", rate=100, url="redis://redis.internal:6379/0")
    lim.acquire()

Each decision is one round trip: an ``EVALSHA`` of the script below, which runs
GCRA (the theoretical arrival time, TAT) atomically inside Redis:

* The state is one hash, ``shmlimit:{name}:gcra`` -- the hash tag puts every
  key of a limiter in one Redis Cluster slot -- holding an epoch ``e`` (whole
  seconds of the clock) and ``t``, the TAT in integer nanoseconds after the
  epoch.  Times stay integers below 2**53 (the script moves the epoch
  forward every ~11 days of continuous use, and a reservation due more than
  ``MAX_BACKLOG_NS``, ~92 days, ahead is refused), so nothing is lost to doubles.
* One clock: Redis ``TIME`` by default.  ``clock="client"`` sends the caller's
  wall clock instead, for managed services that refuse ``TIME`` in scripts;
  the hosts' clocks must then agree (their skew adds to the burst).
* An op costs ``interval = ceil(per/rate)`` ns and the burst is a tolerance of
  ``burst * interval``: a request for ``n`` ops is due at
  ``max(TAT, now) + n*interval - tolerance``.  Due now: granted.  Due later:
  granted as a reservation (the caller sleeps until it is due) unless the wait
  exceeds the caller's ``max_wait``/``timeout`` or the limiter's
  ``max_reserved``; then it is refused, the script writes nothing and answers
  how long to back off.
* The key expires once the bucket would be full again (``TAT`` passed, plus a
  second), which is the same as no key at all: idle limiters leave nothing.

Permit expiry (the distributed-throttle seed's point): ``acquire`` sleeps until
its reservation is due; if the process wakes more than ``grace`` seconds late
(an overloaded scheduler), the permit is void -- it stays counted, unused -- and
``acquire`` asks again.  So calls actually start within ``grace`` of their slot,
and in any window T at most ``rate*(T + grace) + burst`` calls start.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import os
import random
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any, Dict, Generator, Optional, Tuple

from shmlimit.acquire.drivers import drive, drive_async
from shmlimit.config import NS_PER_S, Config, validate_n, validate_timeout
from shmlimit.errors import RedisDataError, RedisUnavailableError, UnsupportedError
from shmlimit.protocol import AcquireOnEnter
from shmlimit.redis import urls
from shmlimit.redis.spec import DEFAULT_TIMEOUT, DEFAULT_URL, UpstreamSpec, redis_key
from shmlimit.redis.urls import redact
from shmlimit.shm.segment import validate_name

try:  # the redis extra: pip install 'shmlimit[redis]'
    import redis as _redis
    from redis import exceptions as _rx

    from shmlimit.redis.client import _REDIS_ERRORS, classify, connect
except ImportError:  # pragma: no cover - exercised only without the extra
    _redis = None  # type: ignore[assignment]

__all__ = [
    "RedisLimiter",
    "ClientStats",
    "RedisStats",
    "RedisUnavailableError",
    "RedisDataError",
    "redact",
    "connect",
    "classify",
]

#: A reservation used more than this late is void (seconds).
DEFAULT_GRACE = 0.05
#: Longest single sleep while backing off from a full queue (seconds).
MAX_NAP = 0.25
#: Schedule an op or a reservation may span at most (ns): keeps every time in the script exact.
MAX_SCHEDULE_NS = 10**15
#: Schedule the script holds ahead at most (ns, ~92 days): a reservation due later is refused, writing
#: nothing.  The script moves the epoch once ``now`` passes 10**15 ns after it (``LUA``), so a TAT
#: this far ahead of ``now`` stays below 2**53: every time stays an exact integer in a double.
MAX_BACKLOG_NS = 2**53 - 10**15

MODE_RESERVE, MODE_PEEK = 0, 2

LUA = r"""
-- KEYS[1]: hash {e = epoch (whole seconds), t = theoretical arrival time (ns after e)}
-- ARGV: mode (0 reserve n, 2 peek), n, interval_ns, tolerance_ns, max_wait_ns (-1 = none), clock
--       seconds and microseconds ('' = Redis TIME)
-- Returns {ops granted, wait_ns, backlog_ns, dry_ns}: a refusal grants 0 ops, writes nothing, and its
-- wait is how long until the request could be granted; dry_ns is how long the schedule had run dry
-- (now past the stored tat: time the GCRA did not bank beyond its tolerance), 0 when it had not or
-- the key was gone.
local mode = tonumber(ARGV[1])
local n = tonumber(ARGV[2])
local iv = tonumber(ARGV[3])
local tau = tonumber(ARGV[4])
local max_wait = tonumber(ARGV[5])
local sec, usec
if ARGV[6] == '' then
  local t = redis.call('TIME')
  sec = tonumber(t[1]); usec = tonumber(t[2])
else
  sec = tonumber(ARGV[6]); usec = tonumber(ARGV[7])
end
local st = redis.call('HMGET', KEYS[1], 'e', 't')
local e = tonumber(st[1]) or sec
local now = (sec - e) * 1000000000 + usec * 1000
local tat = tonumber(st[2]) or now
local dry = 0
if tat < now then dry = now - tat; tat = now end
local backlog = tat - now
if mode == 2 then
  local avail = math.floor((tau - backlog) / iv)
  if avail < 0 then avail = 0 end
  return {avail, math.max(0, backlog + n * iv - tau), backlog, dry}
end
local wait = backlog + n * iv - tau
if wait > 0 and max_wait >= 0 and wait > max_wait then return {0, wait, backlog, dry} end
tat = tat + n * iv
if now > 1000000000000000 then
  -- move the epoch forward so every time stays an exact integer in a double
  local s = math.floor(now / 1000000000) - 1
  e = e + s; now = now - s * 1000000000; tat = tat - s * 1000000000
end
redis.call('HSET', KEYS[1], 'e', string.format('%.0f', e), 't', string.format('%.0f', tat))
redis.call('PEXPIRE', KEYS[1], math.ceil((tat - now) / 1000000) + 1000)
return {n, math.max(0, tat - tau - now), tat - now, dry}
"""
#: What EVALSHA names the script by (redis-py computes the same).
LUA_SHA = hashlib.sha1(LUA.encode()).hexdigest()


@dataclass(frozen=True)
class ClientStats:
    """A Redis limiter's configuration and this client's counters (``RedisKeyedLimiter.stats``)."""

    name: str
    rate: float  #: ops per ``per`` seconds (each key's, for a keyed limiter)
    per: float  #: seconds
    capacity: float  #: ops at most at once (the burst)
    round_trips: int  #: script calls by this client (a NOSCRIPT recovery counts its extra two)
    grants: int  #: ops granted to this client (reservations included, voided ones too)
    refusals: int  #: requests refused (timeout, ``max_reserved``, ``try_acquire``)
    expired: int  #: reservations voided because they were used more than ``grace`` late
    script_loads: int  #: times the script had to be loaded again (NOSCRIPT)
    errors: int  #: calls that failed to reach Redis

    @property
    def ops_per_second(self) -> float:
        return self.rate / self.per


@dataclass(frozen=True)
class RedisStats(ClientStats):
    """A snapshot of a Redis limiter: the shared state read from Redis, and this client's counters."""

    key: str
    available: float  #: ops that could be granted now (whole ops)
    backlog_seconds: float  #: schedule already reserved beyond now, by every client


# ---------------------------------------------------------------------------------
# the limiter: steps that never block, run by every kind's drivers (``acquire.drivers``)

#: Steps that yield a nap (seconds) or a round trip (``(key, args)``: the script's ``EVALSHA``
#: on ``key``; a None key: ``SCRIPT LOAD``), and return the call's value.
Gen = Generator[Any, Any, Any]


def _send(client: Any, key: Optional[str], args: Tuple[Any, ...]) -> Any:
    """The round trip a step names, on ``client`` (sync, or asyncio: then awaitable): ``EVALSHA``
    of the script on ``key`` with ``args``, or for a None key ``SCRIPT LOAD`` of it."""
    return client.script_load(LUA) if key is None else client.evalsha(LUA_SHA, 1, key, *args)


async def _send_async(
    client: Any, timeout: float, key: Optional[str], args: Tuple[Any, ...]
) -> Any:
    """``_send`` on an asyncio ``client``; one whose calls in flight are bounded
    (``client._calls_wait``: a cluster's or a sentinel's) waits up to ``timeout`` for a free
    place first, as a server's blocking pool waits for a connection."""
    calls = getattr(client, "shmlimit_calls", None)
    if calls is None:
        return await _send(client, key, args)
    try:
        await asyncio.wait_for(calls.acquire(), timeout)
    except asyncio.TimeoutError:
        raise _rx.ConnectionError("No connection available.") from None  # (the pool's words)
    try:
        return await _send(client, key, args)
    finally:
        calls.release()


#: the closes of connections in use that ``_disconnect_on`` started, held until done
_CLOSING: "set[asyncio.Task[Any]]" = set()


def _disconnect_on(loop: Any, client: Any) -> None:
    """Close an asyncio ``client``'s connections on its event ``loop``, from any thread: at once
    on this thread's loop, else as that loop's next callback.  A closed loop's are left to be
    closed when collected (closing a transport needs its loop).

    The idle ones at once, not by an ``aclose()`` task: ``close()`` is synchronous, and a task
    started by the last act of ``asyncio.run``'s main (or of an ASGI lifespan's shutdown) is
    cancelled unfinished as the loop ends, its connections then reported unclosed.  Each is closed
    as redis-py closes a connection collected unclosed (its ``_close``).  One in use by a call
    suspended on that loop is closed by ``aclose()`` (a task), which ends that call as a lost
    connection would: dropped under it at once, the call would fail as a bad answer.  Should a
    redis-py release lack those names, all are left to ``aclose()``."""

    def disconnect() -> None:
        try:
            pool = getattr(client, "connection_pool", None)  # (a cluster's: each node's)
            if pool is not None:
                idle, used = list(pool._available_connections), pool._in_use_connections
            else:
                nodes = client.get_nodes()
                idle = [c for node in nodes for c in node._free]
                used = [c for node in nodes for c in node._connections if c not in idle]
            for conn in idle:
                conn._close()
        except AttributeError:  # pragma: no cover - another redis-py's internals
            used = True
        if used:
            task = loop.create_task(client.aclose())
            _CLOSING.add(task)
            task.add_done_callback(_CLOSING.discard)

    try:
        here = asyncio.get_running_loop()
    except RuntimeError:
        here = None
    if loop is here:
        disconnect()
    elif not loop.is_closed():
        try:
            loop.call_soon_threadsafe(disconnect)
        except RuntimeError:  # closed by its thread meanwhile: nobody waits on it
            pass


def _retrieved(trip: "asyncio.Future[Any]") -> None:
    """Mark a round trip's error as seen: one its cancelled caller left behind is nobody's."""
    if not trip.cancelled():
        trip.exception()


class _Call:
    """A Redis call's steps (``_GcraClient._script`` and those built on it) as the drivers run
    them (``acquire.drivers.Steps``): ``nap`` (``nap_async``: on this event loop's own client)
    makes the round trip a step names, keeping the answer, or the error for the steps to
    classify or let through, for ``next`` to send in.  ``value``: what the steps returned."""

    __slots__ = ("owner", "steps", "aclient", "answer", "error", "value")
    wake_ns = None
    clock = staticmethod(time.monotonic_ns)

    def __init__(self, owner: "_GcraClient", steps: Gen, aio: bool = False) -> None:
        owner._open()
        self.owner, self.steps, self.aclient = owner, steps, owner._aclient() if aio else None
        self.answer: Any = None
        self.error: Optional[Exception] = None
        self.value: Any = None

    def next(self) -> Any:
        answer, error, self.answer, self.error = self.answer, self.error, None, None
        try:
            return self.steps.throw(error) if error is not None else self.steps.send(answer)
        except StopIteration as done:
            self.value = done.value
            return True

    begin = next

    def nap(self, step: Any) -> None:
        if step.__class__ is not tuple:
            return time.sleep(step)
        self.owner._open()  # (a call going on across close(): its client would reconnect)
        try:
            self.answer = self.owner._do(*step)
        except Exception as e:
            self.error = e
        if self.owner._closed:  # closed during the trip: what redis-py reconnected is closed too
            self.owner._close_sync()
            self.owner._open()

    async def nap_async(self, step: Any) -> None:
        """The nap or round trip ``step`` names.  The round trip runs as a task of its own, awaited
        through a shield: a cancellation of the caller ends the call at once, whatever Python runs
        it.  Awaited directly, the cancellation reached redis-py's ``asyncio.wait_for`` (its
        socket timeout), which before Python 3.12 drops it when the write ends in the same step:
        the steps went on, reserved and slept out the whole wait.  A trip left behind ends on
        its own (within the timeout, its connection back in the pool); whatever it reserved is
        spent, as a cancelled waiter's slot is."""
        if step.__class__ is not tuple:
            return await asyncio.sleep(step)
        self.owner._open()  # (a call going on across close(): its client would reconnect)
        trip = asyncio.ensure_future(_send_async(self.aclient, self.owner._timeout, *step))
        trip.add_done_callback(_retrieved)
        try:
            self.answer = await asyncio.shield(trip)
        except Exception as e:
            self.error = e
        if self.owner._closed:  # closed during the trip: what redis-py reconnected is closed too
            _disconnect_on(asyncio.get_running_loop(), self.aclient)
            self.owner._open()

    def end(self) -> None:
        self.steps.close()

    def wait_native(self) -> None:
        return None


class _GcraClient:
    """What ``RedisLimiter`` and ``RedisKeyedLimiter`` share: the validated configuration, the
    connections, the identity, and the script's steps, run by every kind's drivers."""

    def __init__(
        self,
        name: str,
        rate: float,
        per: float = 1.0,
        burst: Optional[float] = None,
        *,
        url: str = DEFAULT_URL,
        max_reserved: Optional[float] = None,
        grace: Optional[float] = DEFAULT_GRACE,
        clock: str = "server",
        timeout: float = DEFAULT_TIMEOUT,
        client: Any = None,
    ) -> None:
        if _redis is None:  # pragma: no cover
            raise ImportError("shmlimit.redis.direct needs redis-py: pip install 'shmlimit[redis]'")
        validate_name(name)
        cfg = Config.make(
            rate, per, burst, False, None, max_reserved, None, plain=f"a {type(self).__name__}"
        )
        interval = math.ceil(cfg.per * NS_PER_S / cfg.rate)
        if interval * max(1.0, cfg.burst) > MAX_SCHEDULE_NS:
            raise ValueError(
                f"burst*per/rate must be at most {MAX_SCHEDULE_NS / NS_PER_S:g} s on Redis, "
                f"got {cfg.burst * cfg.per / cfg.rate:g} s"
            )
        if clock not in ("server", "client"):
            raise ValueError(f"clock must be 'server' or 'client', got {clock!r}")
        self._grace = validate_timeout(grace, "grace")
        t = validate_timeout(timeout, "timeout")
        if t is None or t == 0:
            raise ValueError(f"timeout must be a finite number of seconds > 0, got {timeout!r}")
        urls.check(url)
        self._url, self._secrets = urls.split_secrets(url)
        self._name = name
        self._config = cfg
        self._clock = clock
        self._timeout = t
        self.key = redis_key(name)
        self._interval = interval  # ns per op, rounded up: never faster than asked
        self._tolerance = int(cfg.burst * interval)  # rounded down: never more burst than asked
        self._own_client = client is None
        self._closed = False
        self._client = client if client is not None else connect(self._url, self._secrets, t)
        #: the script call on one connection of its own (``_pinned_call``): set for the hierarchical
        #: filler's limiter, which one thread uses, unless its client is a cluster's
        self._pinned = False
        self._conn: Any = None
        self._packed: Tuple[Any, Any] = (None, None)  # (key, args) -> the command, as last packed
        #: each event loop's asyncio client (``_aclient``)
        self._aclients: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()
        self._counts = {
            "round_trips": 0,
            "grants": 0,
            "refusals": 0,
            "expired": 0,
            "script_loads": 0,
            "errors": 0,
        }

    # -- identity --------------------------------------------------------------------

    @property
    def name(self) -> str:
        return self._name

    @property
    def config(self) -> Config:
        return self._config

    @property
    def rate(self) -> float:
        """Ops per ``per`` seconds."""
        return self._config.rate

    @property
    def per(self) -> float:
        """Seconds."""
        return self._config.per

    @property
    def capacity(self) -> float:
        """Ops granted at most at once (the burst)."""
        return self._config.burst

    @property
    def url(self) -> str:
        """The server's URL, without its password."""
        return self._url

    @property
    def round_trips(self) -> int:
        """Script calls made by this client so far (a NOSCRIPT recovery counts its extra two)."""
        with self._lock:
            return self._counts["round_trips"]

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Close this limiter's connections (the shared state in Redis stays); a caller's
        ``client=`` stays open.  Every later call raises ``ValueError``."""
        self._closed = True
        self._unpin()
        self._close_sync()
        with self._lock:
            aclients, self._aclients = list(self._aclients.items()), weakref.WeakKeyDictionary()
        for loop, client in aclients:
            _disconnect_on(loop, client)

    def _close_sync(self) -> None:
        """Close the sync client's connections (``close``; again after a round trip that
        ``close()`` met in flight, which redis-py may have retried on a new connection)."""
        if self._own_client:
            self._client.close()

    def _open(self) -> None:
        if self._closed:  # redis-py would reconnect a closed client silently
            raise ValueError(f"limiter {self._name!r} is closed in this process")

    def unlink(self) -> None:
        """Delete the shared state in Redis (every client's): the next call finds a full bucket,
        as a new limiter would.  Clients go on with their configuration.  After ``close``, on a
        connection of its own, closed again (``close()`` then ``unlink()``, as for every kind)."""
        client = self._client
        try:
            if self._closed and self._own_client:
                client = connect(self._url, self._secrets, self._timeout)
            for key in self._stored_keys(client):
                client.delete(key)
        except _REDIS_ERRORS as e:
            where = f"redis at {self.url} for limiter {self._name!r}"
            err = classify(e, where, self._secrets.values())
            raise err from err.__cause__  # e, or nothing when its message held a secret
        finally:
            if client is not self._client:
                client.close()

    def _stored_keys(self, client: Any) -> Any:
        return (self.key,)

    def set_rate(self, *args: Any, **kwargs: Any) -> None:
        """Not supported (``UnsupportedError``): the rate is not stored in Redis."""
        raise UnsupportedError(
            type(self).__name__,
            "set_rate",
            "the rate is not stored in Redis: every client passes its own to the script, and they "
            "must agree; create the limiter again with the new rate in every client",
        )

    def _counters(self) -> Dict[str, int]:
        """This client's counters, by name (``ClientStats``'s fields)."""
        with self._lock:
            return dict(self._counts)

    def __reduce__(self) -> Any:
        if not self._own_client:
            raise TypeError(
                f"a {type(self).__name__} built on a caller's client cannot be pickled; pass url= instead"
            )
        c = self._config
        kw = dict(
            url=self._url,
            max_reserved=c.max_reserved,
            grace=self._grace,
            clock=self._clock,
            timeout=self._timeout,
        )
        return (
            _connected,
            (type(self), tuple(self._secrets.items()), (self._name, c.rate, c.per, c.burst), kw),
        )

    # -- the script: steps, and the round trips they name ---------------------------------

    def _args(self, mode: int, n: int, max_wait_ns: Optional[int]) -> Tuple[Any, ...]:
        if self._clock == "server":
            sec, usec = "", ""
        else:
            ns = time.time_ns()
            sec, usec = str(ns // NS_PER_S), str(ns % NS_PER_S // 1000)
        # the TAT a grant leaves is its wait plus the tolerance ahead: within ``MAX_BACKLOG_NS``
        mw = MAX_BACKLOG_NS - self._tolerance
        if max_wait_ns is not None:
            mw = min(mw, max_wait_ns)
        return (mode, n, self._interval, self._tolerance, mw, sec, usec)

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for k, v in deltas.items():
                self._counts[k] += v

    def _script(
        self,
        mode: int,
        n: int,
        max_wait_ns: Optional[int] = None,
        key: Optional[str] = None,
    ) -> Gen:
        """Steps of one script call; returns ``(ops granted, wait_ns, backlog_ns, dry_ns)``.

        A NOSCRIPT answer (the scripts were flushed, or a failover or slot
        migration reached a server that never saw ours) loads it and asks
        again.  redis-py's errors are classified (``classify``); any other
        error of the round trip (a client redis-py could not build) and an
        answer that is not one the script gives (granted outside ``[0, n]``,
        a negative time, a backlog beyond ``MAX_BACKLOG_NS``, a grant due
        later than ``max_wait_ns``: a broken key, or not Redis) raise
        ``RedisDataError``.
        """
        args = self._args(mode, n, max_wait_ns)
        key = self.key if key is None else key
        where = f"redis at {self.url} for limiter {self._name!r}"
        trips = 1
        try:
            try:
                r = yield (key, args)
            except _rx.NoScriptError:
                trips += 2
                self._count(script_loads=1)
                yield (None, ())
                r = yield (key, args)
        except _REDIS_ERRORS as e:
            self._count(round_trips=trips, errors=1)
            err = classify(e, where, self._secrets.values())
            raise err from err.__cause__  # e, or nothing when its message held a secret
        except Exception as e:
            self._count(round_trips=trips, errors=1)
            raise RedisDataError(f"{where} failed: {type(e).__name__}: {e}") from e
        try:
            granted, wait, backlog, dry = int(r[0]), int(r[1]), int(r[2]), int(r[3])
            ok = (
                0 <= granted <= (n if mode == MODE_RESERVE else granted)
                and 0 <= backlog <= MAX_BACKLOG_NS
                and 0 <= wait <= backlog + n * self._interval
                and dry >= 0
                # a reservation due later than max_wait is refused by the script, never granted
                and not (granted and mode == MODE_RESERVE and wait > args[4])
            )
        except (TypeError, ValueError, LookupError, OverflowError):  # (RESP3: a map, a double)
            ok = False
        if not ok:
            self._count(round_trips=trips, errors=1)
            raise RedisDataError(f"{where} answered {r!r}, not an answer of the script")
        self._count(round_trips=trips)
        return granted, wait, backlog, dry

    def _drive(self, steps: Gen) -> Any:
        """Run ``steps`` to their value in this thread, on its connection."""
        call = _Call(self, steps)
        drive(call)
        return call.value

    async def _drive_async(self, steps: Gen) -> Any:
        """Run ``steps`` to their value on this event loop, on its own connection."""
        call = _Call(self, steps, aio=True)
        await drive_async(call)
        return call.value

    def _do(self, key: Optional[str], args: Tuple[Any, ...]) -> Any:
        """One round trip: the script on ``key`` with ``args`` (a None key: load it)."""
        if self._pinned:
            return self._pinned_call(key, args)
        return _send(self._client, key, args)

    def _pinned_call(self, key: Optional[str], args: Tuple[Any, ...]) -> Any:
        """``EVALSHA`` of the script on ``key`` with ``args`` (``SCRIPT LOAD`` of it for a None
        key) on a connection taken from the pool once and kept: one send and one read.

        For a limiter one thread uses (the hierarchical filler's).  Through the
        pool each call also took and returned a connection, polled it for stray
        data, checked the pid and recorded metrics: about 40 of the 60 us of CPU
        a call cost.  The command is packed again only when its arguments
        change.  As the pool's clients do, a connection error or timeout drops
        the connection and sends once more on one taken from the pool again: the
        pool connects it (``connect``), and a sentinel-managed connection asks the
        sentinels where the master is then (a demoted master's ``READONLY`` is
        such an error too).  A connection only reconnected went back to the
        address it had: after a failover, the dead or demoted master for ever.
        A child process takes a connection of its own; a cluster client, which
        routes each call itself, keeps the usual calls.
        """
        for retry in (False, True):
            conn = self._conn
            if (
                conn is None or conn.pid != os.getpid()
            ):  # (a connection's pid: the process that made it)
                conn = self._conn = self._client.connection_pool.get_connection()  # (redis >= 5.3)
                self._packed = (None, None)
            last, packed = self._packed
            if key is None:
                packed = conn.pack_command("SCRIPT", "LOAD", LUA)
            elif last != (key, args):
                packed = conn.pack_command("EVALSHA", LUA_SHA, 1, key, *args)
                self._packed = ((key, args), packed)
            try:
                conn.send_packed_command(packed, check_health=False)
                return conn.read_response()
            except _rx.ResponseError:
                raise  # an answer read whole: the connection is in step
            except (_rx.ConnectionError, _rx.TimeoutError):
                self._unpin(broken=True)
                if retry:
                    raise
            except BaseException:
                self._unpin(broken=True)  # (an answer may be left half read)
                raise
        raise AssertionError("unreachable")  # pragma: no cover

    def _unpin(self, broken: bool = False) -> None:
        """Give the pinned connection back to its pool (which closes it with the client); a
        ``broken`` one closed first, so the pool connects it again, wherever the master is then."""
        conn, self._conn = self._conn, None
        if conn is None:
            return
        if broken:
            conn.disconnect()
        try:
            self._client.connection_pool.release(conn)
        except Exception:  # pragma: no cover - a pool already closed, or after a fork
            conn.disconnect()

    def _aclient(self) -> Any:
        """This event loop's asyncio client, made on its first call: one per loop, so loops in
        several threads each keep theirs.  A closed loop's client is forgotten (its connections
        are useless, and closed when collected)."""
        loop = asyncio.get_running_loop()
        client = self._aclients.get(loop)
        if client is None:
            if not self._own_client:
                raise TypeError("acquire_async needs a RedisLimiter built with url=, not client=")
            client = connect(self._url, self._secrets, self._timeout, is_async=True)
            with self._lock:
                for ended in [other for other in self._aclients if other.is_closed()]:
                    del self._aclients[ended]
                self._aclients[loop] = client
        return client

    # -- the steps of acquiring ----------------------------------------------------------

    def _bound(self, n: int, limit_s: Optional[float]) -> Optional[int]:
        """The script's max_wait for ``n`` ops: the caller's limit and ``max_reserved``, in ns."""
        if n * self._interval > MAX_SCHEDULE_NS:
            raise ValueError(
                f"n must be at most {MAX_SCHEDULE_NS // self._interval} ops for this limiter, got {n}"
            )
        bounds = [b for b in (limit_s, self._config.max_reserved) if b is not None]
        return int(min(bounds) * NS_PER_S) if bounds else None

    def _reserve_steps(self, n: int, max_wait: Optional[float], key: Optional[str] = None) -> Gen:
        validate_n(n, 1)
        bound = self._bound(n, validate_timeout(max_wait, "max_wait"))
        granted, wait, _, _ = yield from self._script(MODE_RESERVE, n, bound, key=key)
        if not granted:
            self._count(refusals=1)
            return None
        self._count(grants=n)
        return wait / NS_PER_S

    def _acquire_steps(self, n: int, timeout: Optional[float], key: Optional[str] = None) -> Gen:
        """Steps of ``acquire``: reserve, sleep until due, void a slot woken too late, back off."""
        validate_n(n, 1)
        timeout = validate_timeout(timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            granted, wait, _, _ = yield from self._script(
                MODE_RESERVE, n, self._bound(n, left), key=key
            )
            received = time.monotonic()
            if granted:
                self._count(grants=n)
                due = received + wait / NS_PER_S
                if wait:
                    yield wait / NS_PER_S
                if self._grace is None or time.monotonic() - due <= self._grace:
                    return True
                self._count(expired=1)  # woke too late: the slot is void, ask for a new one
                continue
            self._count(refusals=1)
            nap = self._backoff(wait, left)
            if nap is None:
                return False
            yield nap

    def _backoff(self, wait_ns: int, left: Optional[float]) -> Optional[float]:
        """After a refusal: None when the caller's own limit refused it, else how long to back off.

        Refused by ``max_reserved`` only, the caller sleeps until the queue
        should have room, jittered in [0.5, 1.5] so refused callers spread out.
        """
        wait = wait_ns / NS_PER_S
        if left is not None and wait > left:
            return None
        over = wait - (self._config.max_reserved or 0)
        nap = min(MAX_NAP, max(1e-4, over)) * random.uniform(0.5, 1.5)
        return nap if left is None else min(nap, left)


class RedisLimiter(_GcraClient, AcquireOnEnter):
    """A rate limit of ``rate`` ops per ``per`` seconds shared through Redis by every client of ``name``.

    The same interface and semantics as ``shmlimit.Limiter``: ``acquire``,
    ``try_acquire``, ``reserve``, ``retry_after``, ``acquire_async``,
    ``stats``, usable by ``shmlimit.throttle``.  Every client of one name must
    pass the same ``rate``, ``per`` and ``burst`` (the script trusts them).

    ``url``: a Redis server, cluster or sentinel-managed master (see
    ``connect``); its password never leaves this object (``url`` shows it
    redacted, and a segment stores the URL without it).  ``burst`` (ops,
    default 10 ms of rate and at least one); ``max_reserved`` (seconds of
    schedule callers may reserve ahead; default unbounded); ``grace``
    (seconds a reservation may be used late before it is void; None = never
    void); ``clock`` (``"server"``: Redis ``TIME``, or ``"client"``: this
    host's wall clock); ``timeout`` (connect and socket timeout, seconds: an
    answer is read whole within it, but for a cluster's connections, which bound
    each read only; a call tries once more on a new connection,
    so it may take about twice that, four times at worst, plus up to that
    waiting for a free connection: docs/kinds/redis.md, "Fails fast").
    ``client`` may be an existing redis-py client to use instead of ``url``
    (the limiter then cannot be pickled nor be an ``upstream=``).

    Errors: ``RedisUnavailableError`` when Redis cannot be reached in time
    (a connection error or timeout: callers may fall back), and
    ``RedisDataError`` when it answers with an error (the key holds another
    type, the credentials are refused): never a reason to let calls through.
    """

    def upstream_spec(self, **options: Any) -> UpstreamSpec:
        """This limiter as the upstream of a hierarchical ``Limiter`` (``options``: ``on_error``,
        ``lease_ttl``, ``batch_seconds``).  Refused for a limiter built on a caller's ``client``:
        its endpoint is unknown, and the default URL would silently lease from another server."""
        if not self._own_client:
            raise ValueError(
                "a RedisLimiter built on a caller's client= cannot be an upstream (its endpoint is unknown "
                "to the filler); build it with url="
            )
        c = self._config
        return UpstreamSpec(
            self._name,
            self._url,
            c.rate,
            c.per,
            c.burst,
            clock=self._clock,
            timeout=self._timeout,
            secrets=tuple(sorted(self._secrets.items())),
            **options,
        )

    @classmethod
    def from_spec(cls, spec: UpstreamSpec) -> "RedisLimiter":
        """The global limiter of a hierarchical limiter, with the secrets its configuring process gave;
        for one thread (the filler's): its script calls keep one connection (``_pinned_call``)."""
        lim = _connected(
            cls,
            spec.secrets,
            (spec.name, spec.rate, spec.per, spec.burst),
            dict(url=spec.url, clock=spec.clock, timeout=spec.timeout),
        )
        lim._pinned = hasattr(lim._client, "connection_pool")  # (a cluster client routes each call)
        return lim

    def call(
        self, mode: int, n: int, max_wait_ns: Optional[int] = None
    ) -> Tuple[int, int, int, int]:
        """One script call: ``(ops granted, wait_ns, backlog_ns, dry_ns)``: ``dry_ns`` is how long the
        global schedule had run dry before it (schedule the GCRA did not bank), 0 if it had not.

        Raises ``RedisUnavailableError`` or ``RedisDataError``.
        """
        return self._drive(self._script(mode, n, max_wait_ns))

    async def call_async(
        self, mode: int, n: int, max_wait_ns: Optional[int] = None
    ) -> Tuple[int, int, int, int]:
        """``call`` on this event loop's own connection."""
        return await self._drive_async(self._script(mode, n, max_wait_ns))

    # -- acquiring ---------------------------------------------------------------------

    def reserve(self, n: int = 1, max_wait: Optional[float] = None) -> Optional[float]:
        """Reserve the next slot for ``n`` ops; return the seconds until it is due (0.0: now).

        None, having reserved nothing, when the wait would exceed ``max_wait``
        (seconds) or ``max_reserved``.  A reservation is counted whether or
        not the caller uses it.
        """
        return self._drive(self._reserve_steps(n, max_wait))

    def try_acquire(self, n: int = 1) -> bool:
        """Take ``n`` ops only if they are available now (one round trip).  False takes nothing."""
        return self.reserve(n, 0.0) == 0.0

    def retry_after(self, n: int = 1) -> float:
        """Seconds until ``n`` ops could be granted to a new caller (0.0: now).  One round trip."""
        validate_n(n, 1)
        return self.call(MODE_PEEK, n)[1] / NS_PER_S

    def acquire(self, n: int = 1, timeout: Optional[float] = None) -> bool:
        """Take ``n`` ops, sleeping until their reservation is due; True once granted.

        With ``timeout`` (seconds), return False, having taken nothing, when the
        wait would exceed it.  With ``max_reserved``, an acquire that finds the
        queue full backs off (with jitter) and asks again until ``timeout``.
        Raises ``RedisUnavailableError`` when Redis cannot be reached in time,
        ``RedisDataError`` when it answers with an error.
        """
        return self._drive(self._acquire_steps(n, timeout))

    async def acquire_async(self, n: int = 1, timeout: Optional[float] = None) -> bool:
        """``acquire`` for asyncio (its own connection per event loop; never blocks the loop)."""
        return await self._drive_async(self._acquire_steps(n, timeout))

    # -- observation -------------------------------------------------------------------

    def stats(self) -> RedisStats:
        """The shared state (one round trip, writes nothing) and this client's counters."""
        avail, _, backlog, _ = self.call(MODE_PEEK, 1)
        counts = self._counters()
        c = self._config
        return RedisStats(
            name=self._name,
            key=self.key,
            rate=c.rate,
            per=c.per,
            capacity=c.burst,
            available=float(avail),
            backlog_seconds=backlog / NS_PER_S,
            **counts,
        )

    def __repr__(self) -> str:
        c = self._config
        head = f"<shmlimit.redis.direct.RedisLimiter {self._name!r} rate={c.rate:g}/{c.per:g}s capacity={c.burst:g} url={self.url}"
        if self._closed:
            return f"{head} closed>"
        try:
            s = self.stats()
        except (RedisUnavailableError, RedisDataError) as e:
            return f"{head} {e}>"
        return (
            f"{head} available={s.available:g} backlog={s.backlog_seconds:.3f}s round_trips={s.round_trips} "
            f"grants={s.grants} refusals={s.refusals} expired={s.expired}>"
        )


#: ``client=`` while a limiter is built whose own client is made later, or never (``unconnected``).
_Deferred = object()


def unconnected(cls: Any, args: Tuple[Any, ...], kw: Dict[str, Any]) -> Any:
    """``cls(*args, **kw)``, checked, with a client of its own not made yet: nothing is reached (a
    cluster's client reaches its nodes when made).  ``Limiter(upstream=URL)`` takes its spec from
    one, so that its filler connects, and falls back if it cannot."""
    lim = cls(*args, client=_Deferred, **kw)
    lim._own_client = True
    return lim


def _connected(
    cls: Any, secrets: Tuple[Tuple[str, str], ...], args: Tuple[Any, ...], kw: Dict[str, Any]
) -> Any:
    """``cls(*args, **kw)`` connected with ``secrets`` (kept out of its URL, as ``url=`` would):
    ``from_spec``'s limiter, and an unpickled one."""
    lim = unconnected(cls, args, kw)
    lim._secrets = dict(secrets)
    lim._client = connect(lim._url, lim._secrets, lim._timeout)
    return lim
