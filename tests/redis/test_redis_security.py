"""The Redis tier on a host with other users: secrets never shown or stored, TLS verified, the key's
contents never open the gates, and a segment never chooses anyone's Redis endpoint or fallback."""

import json
import logging
import pickle
import socket
import subprocess
import sys
import time

import pytest
from support.procs import WORKDIR, run_cli, wait_for
from support.redis_server import CertAuthority, RedisServer, require
from support.segments import shm_bytes

import shmlimit

# run once in CI: secrets, TLS and endpoints of the Redis tier: no atomic word involved
pytestmark = pytest.mark.backend_independent

SECRET = "s3cr3t-pw"


@pytest.fixture
def R():
    require()
    import shmlimit.redis.direct as R

    return R


@pytest.fixture
def locked_redis():
    """A redis-server that requires the password SECRET."""
    require()
    server = RedisServer(password=SECRET)
    server.start()
    yield server
    server.stop()


def test_redact_hides_every_form_and_never_raises():
    from shmlimit.redis.urls import redact, split_secrets

    cases = {
        "redis://user:secret@host:6379/0": "redis://user:***@host:6379/0",
        "redis://:secret@host/1": "redis://:***@host/1",
        "redis://host:6379/0": "redis://host:6379/0",
        "redis://:secret@host:99999/0": "redis://:***@host:99999/0",  # a bad port: still no raise
        "redis://:secret@[::1]:6379/0": "redis://:***@[::1]:6379/0",  # IPv6 brackets kept
        "redis://:secret@[::1/0": "redis://:***@[::1/0",  # a malformed literal: kept as written
        "redis://host/0?password=secret&db=1": "redis://host/0?password=***&db=1",
        "rediss://u:p%40secret@h/0?sentinel_password=secret": "rediss://u:***@h/0?sentinel_password=***",
        "unix://:secret@/tmp/r.sock?db=0": "unix://:***@/tmp/r.sock?db=0",
        "redis+cluster://:secret@h1:7000,h2:7001": "redis+cluster://:***@h1:7000,h2:7001",
        "redis://:sec@ret@host/0": "redis://:***@host/0",  # an unescaped @ in the password
        "secret@host": ":***@host",  # no scheme at all
    }
    for url, shown in cases.items():
        assert redact(url) == shown
        assert "secret" not in redact(url) and "ret@" not in redact(url)
    assert redact(12) == "<int>" and redact(None) == "<NoneType>"
    assert split_secrets("redis://u:p%40w@h:1/0?password=x&db=2") == (
        "redis://u@h:1/0?db=2",
        {"password": "x"},
    )
    assert split_secrets("redis://:pw@[::1]:7/0") == ("redis://[::1]:7/0", {"password": "pw"})


def test_errors_about_urls_never_echo_the_password(R, name):
    for bad in (
        "http://:secret@host/0",
        "redis://:secret@host:99999/0",
        "redis://:secret@/0",
        "redis://:secret@h1:1,h2:2/0",
        "rediss://:secret@h/0?ssl_cert_reqs=none",
        12,
    ):
        with pytest.raises(ValueError) as e:
            R.RedisLimiter(name, rate=1, url=bad)
        assert "secret" not in str(e.value)
        with pytest.raises(ValueError) as e:
            shmlimit.Limiter(name, rate=1, upstream=bad) if isinstance(
                bad, str
            ) else R.RedisLimiter(name, 1, url=bad)
        assert "secret" not in str(e.value)
    with pytest.raises(ValueError, match="fit the segment header") as e:
        shmlimit.Limiter(name, rate=10, upstream="redis://:secret@" + "h" * 300 + ":6379/0")
    assert "secret" not in str(e.value)
    assert name not in shmlimit.list_names()


@pytest.mark.parametrize(
    "url, named",
    [
        (
            "redis://:secret@127.0.0.1:1/0?timeout=1",
            "unknown query parameter 'timeout'.*timeout= argument",
        ),
        (
            "redis://:secret@127.0.0.1:1/0?socket_timeout=abc",
            "socket_timeout must be seconds > 0, got 'abc'",
        ),
        ("redis://:secret@127.0.0.1:1/0?socket_timeout=-1", "socket_timeout must be seconds > 0"),
        ("redis://:secret@127.0.0.1:1/0?db=x", "db must be an integer >= 0, got 'x'"),
        (
            "redis://:secret@127.0.0.1:1/0?socket_keepalive=maybe",
            "socket_keepalive must be true or false",
        ),
        ("redis://:secret@127.0.0.1:1/0?protocol=4", "protocol must be 2 or 3"),
        (
            "redis://:secret@127.0.0.1:1/0?sentinel_password=secret",
            "sentinel_password= belongs on a redis\\+sentinel",
        ),
        (
            "redis://:secret@127.0.0.1:1/0?ssl_ca_certs=/ca.pem",
            "ssl_ca_certs= belongs on a rediss://",
        ),
        ("redis+cluster://:secret@127.0.0.1:1?db=0", "a cluster has one database, so no db="),
        ("redis+cluster://:secret@127.0.0.1:1/0", "a cluster has one database, so no path /0"),
        ("redis+sentinel://:secret@127.0.0.1:1/m/x", "a sentinel URL's path is /service\\[/db\\]"),
        ("redis+sentinel://:secret@127.0.0.1:1", "a sentinel URL's path is /service\\[/db\\]"),
        ("rediss://:secret@h:1/0?ssl_min_version=3", "unknown query parameter 'ssl_min_version'"),
    ],
)
def test_a_bad_url_is_refused_when_the_limiter_is_built(R, name, url, named):
    """redis-py refuses these only when it connects (a query parameter, a db on a cluster as
    ``?db=`` or a path, a sentinel path other than ``/service[/db]``): a hierarchical limiter's
    filler thread then met the error, and the limiter never granted.  Refused at once, naming
    the part."""
    with pytest.raises(ValueError, match=f"^url: {named}") as e:
        R.RedisLimiter(name, rate=1, url=url)
    assert "secret" not in str(e.value)
    with pytest.raises(ValueError, match=f"^upstream: {named}"):
        shmlimit.Limiter(name, rate=1, upstream=url)
    assert name not in shmlimit.list_names()


def test_known_query_parameters_are_read_once_for_every_deployment(R):
    from shmlimit.redis.urls import options

    url = "redis+sentinel://h:1/m?db=2&socket_timeout=0.5&socket_keepalive=no&sentinel_password=x"
    assert options(url) == dict(
        db=2, socket_timeout=0.5, socket_keepalive=False, sentinel_password="x"
    )
    assert options("rediss://h/0?ssl_ca_certs=/ca.pem&client_name=a") == dict(
        ssl_ca_certs="/ca.pem", client_name="a"
    )
    # an empty value is absent, as redis-py reads it
    assert options("redis+cluster://h:1?db=&socket_timeout=") == {}
    R.RedisLimiter("empty-values", rate=1, url="redis://127.0.0.1:1/0?db=").close()


def test_a_server_busy_or_without_its_master_is_unavailable_not_a_data_error(R):
    """``BUSY`` (another client's script runs long) and ``MASTERDOWN`` (a replica lost its master)
    say nothing about the key: the fallback the user chose applies, not the closed "error"."""
    from redis import exceptions as rx

    from shmlimit.redis.client import classify

    busy = rx.ResponseError("BUSY Redis is busy running a script. You can only call SCRIPT KILL")
    down = rx.MasterDownError(
        "Link with MASTER is down and replica-serve-stale-data is set to 'no'"
    )
    for e in (busy, down):
        assert isinstance(classify(e, "redis at redis://h/0"), R.RedisUnavailableError)
    wrong = rx.ResponseError("WRONGTYPE Operation against a key holding the wrong kind of value")
    assert isinstance(classify(wrong, "redis at redis://h/0"), R.RedisDataError)


def test_a_password_holding_a_question_mark_is_hidden_and_refused(R, name):
    """An unescaped ``?`` in the password once began the query for the parser: ``redact`` showed
    the password whole, and ``admin:123?abc@host`` passed the check as host ``admin`` port 123, so
    the upstream description kept it in the segment and every message showed it.  Hidden when
    shown; refused (naming the parameter) when used, since no reading of it is sure."""
    from shmlimit.redis.urls import redact

    cases = {
        "redis://admin:123?abc@127.0.0.1:6379/0": ("123?abc", "redis://admin:***@127.0.0.1:6379/0"),
        "redis://:pa?ss@127.0.0.1:6379": ("pa?ss", "redis://:***@127.0.0.1:6379"),
        "rediss://u:p?w@h:1?ssl_cert_reqs=none": ("p?w", "rediss://u:***@h:1?ssl_cert_reqs=none"),
        "redis+cluster://:s?x@h1:7000,h2:7001": ("s?x", "redis+cluster://:***@h1:7000,h2:7001"),
    }
    for url, (secret, shown) in cases.items():
        assert redact(url) == shown
        with pytest.raises(ValueError, match=r"^url\b") as e:
            R.RedisLimiter(name, rate=1, url=url)
        assert secret not in str(e.value) and ":" + secret.split("?")[0] not in str(e.value)
        with pytest.raises(ValueError, match=r"^upstream\b") as e:
            shmlimit.Limiter(name, rate=1, upstream=url)
        assert secret not in str(e.value) and ":" + secret.split("?")[0] not in str(e.value)
    assert name not in shmlimit.list_names()
    # a URL that is not ambiguous still means what it says
    assert redact("redis://host:6379/0?client_name=a") == "redis://host:6379/0?client_name=a"


# the first lease from Redis within 2 real seconds
@pytest.mark.slow
def test_the_password_stays_out_of_the_segment_and_every_output(R, locked_redis, name, caplog):
    run = run_cli
    url = f"redis://:{SECRET}@127.0.0.1:{locked_redis.port}/0"
    clean = locked_redis.url
    direct = R.RedisLimiter(f"{name}-direct", rate=100, url=url)
    assert direct.acquire() and direct.url == clean
    assert SECRET not in repr(direct) and SECRET not in str(direct.stats())
    assert pickle.loads(pickle.dumps(direct)).acquire()  # a pickled limiter still authenticates
    for form in (url, f"{clean}?password={SECRET}"):  # both URL forms
        lim = shmlimit.Limiter(name, rate=50, upstream=form)
        try:
            assert lim.acquire(
                timeout=2.0
            )  # the filler authenticated with the password it was given
            up = lim.stats().upstream
            assert up.url == clean and up.state == "ok"
            assert SECRET.encode() not in shm_bytes(name)
            outputs = [
                repr(lim),
                str(lim.stats()),
                str(shmlimit.inspect(name)),
                run("inspect", "--json", name).stdout,
                run("top", "--once", name).stdout,
                run("list", "--json").stdout,
            ]
            assert all(SECRET not in o for o in outputs)
            assert json.loads(outputs[3])["upstream"]["url"] == clean
        finally:
            lim.close()
            shmlimit.unlink(name)
    # the wrong password is refused by Redis: an error answer, never "unavailable", never open
    wrong = R.RedisLimiter(
        f"{name}-wrong", rate=100, url=f"redis://:nope-{SECRET}@127.0.0.1:{locked_redis.port}/0"
    )
    with pytest.raises(shmlimit.errors.RedisDataError) as e:
        wrong.acquire()
    assert SECRET not in str(e.value)
    with caplog.at_level(logging.ERROR, logger="shmlimit.redis.feeder"):
        lim = shmlimit.Limiter(
            name,
            rate=50,
            upstream=f"redis://:nope@127.0.0.1:{locked_redis.port}/0",
            on_redis_error="open",
        )
        try:
            assert not lim.acquire(timeout=0.5) and not lim.try_acquire()
            assert lim.stats().upstream.state == "error"
        finally:
            lim.close()
    assert any("error" in r.getMessage() for r in caplog.records)
    assert all("nope" not in r.getMessage() for r in caplog.records)


# leases from Redis within 2 real seconds, before and after the bad value
@pytest.mark.slow
def test_a_value_of_another_type_under_the_key_fails_closed(R, redis_server, name):
    """Whoever can write the key (SET shmlimit:{name}:gcra x) must not unlimit anyone."""
    direct = R.RedisLimiter(name, rate=100, url=redis_server.url)
    assert direct.acquire()
    redis_server.client().set(direct.key, "x")
    with pytest.raises(shmlimit.errors.RedisDataError, match="WRONGTYPE"):
        direct.acquire()
    with pytest.raises(shmlimit.errors.RedisDataError):
        direct.try_acquire()
    redis_server.client().delete(direct.key)

    rate = 100
    lim = shmlimit.Limiter(
        name, rate=rate, burst=10, upstream=redis_server.url, on_redis_error="open", lease_ttl=0.1
    )
    try:
        assert lim.acquire(timeout=2.0)
        redis_server.client().delete(direct.key)
        redis_server.client().set(direct.key, "x")
        wait_for(lambda: [lim.try_acquire(), lim.stats().upstream.state == "error"][1])
        up = lim.stats().upstream
        assert up.errors >= 1 and up.fallbacks == 1
        # closed, although the fallback is "open": leased tokens expire, then nothing is granted
        wait_for(lambda: not lim.try_acquire())
        granted = sum(lim.acquire(timeout=0.02) for _ in range(20))
        assert granted <= 1
        redis_server.client().delete(direct.key)  # a correct answer again: leasing resumes
        wait_for(lambda: lim.stats().upstream.state == "ok", timeout=10)
        assert lim.acquire(timeout=2.0)
    finally:
        lim.close()


CREATOR = """
import sys, shmlimit
lim = shmlimit.Limiter(sys.argv[1], rate=5, upstream=sys.argv[2], on_redis_error="open")
assert lim.acquire(timeout=5.0)  # wanted: the filler asks, times out, and falls back to "open"
print("ready", flush=True)
sys.stdin.readline()
"""


def test_a_segment_never_chooses_the_endpoint_or_the_fallback_of_who_merely_attaches(R, name):
    """A segment created by someone else names an endpoint (a socket of its own) and the "open"
    fallback.  A process that attaches by name never connects there and is never let through."""
    lure = socket.socket()
    lure.bind(("127.0.0.1", 0))
    lure.listen(64)  # accepts at the TCP level, never answers: Redis "times out" for its creator
    lure.setblocking(False)
    url = f"redis://127.0.0.1:{lure.getsockname()[1]}/0"
    creator = subprocess.Popen(
        [sys.executable, "-c", CREATOR, name, url],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=WORKDIR,
    )
    try:
        assert creator.stdout.readline().strip() == "ready"
        # the creator configured "open" itself: its filler fell back to it when the lure timed out
        assert shmlimit.inspect(name).upstream.state == "open"
        creator.stdin.write("\n")
        creator.stdin.flush()
        creator.wait(10)  # gone: nobody who configured this upstream is left
        while True:  # forget the creator's connections
            try:
                lure.accept()[0].close()
            except BlockingIOError:
                break
        lim = shmlimit.attach(name)
        try:
            assert lim.stats().upstream.state == "open" and lim.stats().upstream.url == url
            assert not lim.try_acquire()
            assert not lim.acquire(timeout=0.3)
            time.sleep(0.2)  # what we assert is an absence: give a connection time to arrive
            with pytest.raises(BlockingIOError):
                lure.accept()
            assert lim.stats().filler_pid is None  # an attach-only process never runs the feeder
        finally:
            lim.close()
    finally:
        creator.kill()
        creator.wait()
        lure.close()


@pytest.fixture(scope="module")
def tls_redis():
    require()
    server = RedisServer(tls=CertAuthority())
    server.start()
    yield server
    server.stop()


# the first lease over TLS within 2 real seconds
@pytest.mark.slow
def test_tls_verifies_the_certificate_and_the_host_name(R, tls_redis, name):
    ca = tls_redis.tls.ca
    good = R.RedisLimiter(
        name, rate=100, url=f"rediss://localhost:{tls_redis.port}/0?ssl_ca_certs={ca}"
    )
    assert good.acquire() and good.stats().round_trips >= 1
    # the certificate names localhost only: the same server reached as 127.0.0.1 is refused
    other_name = R.RedisLimiter(
        name, rate=100, url=f"rediss://127.0.0.1:{tls_redis.port}/0?ssl_ca_certs={ca}"
    )
    with pytest.raises(
        shmlimit.errors.RedisUnavailableError, match="(?i)hostname|certificate|IP address"
    ):
        other_name.acquire()
    unknown_ca = R.RedisLimiter(name, rate=100, url=f"rediss://localhost:{tls_redis.port}/0")
    with pytest.raises(shmlimit.errors.RedisUnavailableError, match="(?i)certificate"):
        unknown_ca.acquire()
    for opt_out in ("ssl_cert_reqs=none", "ssl_check_hostname=false"):
        with pytest.raises(ValueError, match="TLS must verify"):
            R.RedisLimiter(name, rate=100, url=f"rediss://localhost:{tls_redis.port}/0?{opt_out}")
    # hierarchical over TLS
    lim = shmlimit.Limiter(
        f"{name}-h", rate=100, upstream=f"rediss://localhost:{tls_redis.port}/0?ssl_ca_certs={ca}"
    )
    try:
        assert lim.acquire(timeout=2.0) and lim.stats().upstream.state == "ok"
    finally:
        lim.close()
        shmlimit.unlink(f"{name}-h")


class _RaisingClient:
    """A client as the limiter sees it whose script calls raise ``error``."""

    def __init__(self, error):
        self.error = error

    def evalsha(self, *args):
        raise self.error


def test_a_redis_error_quoting_the_password_is_shown_without_it(R, name):
    """redis-py 6.2 to 7.x put every connection keyword, the password too, in a pool's repr, and
    a sentinel that names no master quotes its sentinels' clients in its error: the password must
    stay out of the limiter's error, the chain a traceback or a logger shows, and its repr."""
    import traceback

    from redis.sentinel import MasterNotFoundError

    quoted = (
        "No master found for 'svc' : <redis.client.Redis(<redis.connection.ConnectionPool("
        f"<redis.connection.Connection(db=0,username=None,password={SECRET},socket_timeout=1)>)>)>"
    )
    for url in (
        f"redis+sentinel://:{SECRET}@127.0.0.1:1/svc",
        f"redis+sentinel://127.0.0.1:1/svc?sentinel_password={SECRET}",
    ):
        client = _RaisingClient(MasterNotFoundError(quoted))
        lim = R.RedisLimiter(name, rate=10, url=url, client=client)
        with pytest.raises(shmlimit.errors.RedisUnavailableError, match="No master found") as e:
            lim.try_acquire()
        shown = "".join(traceback.format_exception(e.value)) + repr(lim)
        assert "password=***" in shown and SECRET not in shown
