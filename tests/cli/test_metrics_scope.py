"""Which segments the metrics export: this user's, root's and trusted uids', at most a cap of them;
and a bad port or address is one line, exit 2.

Another local user can create any number of segments with any values in them (a forged
``stopped=1``): exported by default, they became series of the operator's dashboards.
"""

import os
import socket
import subprocess
import sys
import tempfile

import pytest
from support.segments import shm_path, unique_name

import shmlimit

parser = pytest.importorskip("prometheus_client.parser")
CLI = [sys.executable, "-m", "shmlimit.cli.main"]
#: A uid no account on a test machine has: the owner of the "other user's" segments.
OTHER_UID = 4243


def metrics(*args, env=None):
    return subprocess.run(
        [*CLI, "metrics", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tempfile.gettempdir(),
        env=env,
    )


def series(text):
    """{(sample name, its labels as a sorted tuple): value}."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in parser.text_string_to_metric_families(text)
        for s in fam.samples
    }


def limiters_in(values):
    return {dict(labels)["limiter"] for _, labels in values if "limiter" in dict(labels)}


def omitted(values, reason):
    return values[("shmlimit_omitted_segments", (("reason", reason),))]


@pytest.fixture
def made():
    """Names of the limiters a test makes, each unlinked after it."""
    names = []
    yield names
    for n in names:
        try:
            shmlimit.unlink(n)
        except FileNotFoundError:
            pass


def _limiter(made, stopped=False, owner=None):
    name = unique_name("scope")
    lim = shmlimit.Limiter(name, rate=10)
    made.append(name)
    if stopped:
        lim.stop()
    lim.close()
    if owner is not None:
        os.chown(shm_path(name), owner, -1)
    return name


@pytest.mark.backend_independent  # names each backend it checks
@pytest.mark.skipif(os.geteuid() != 0, reason="giving a segment to another uid needs root")
@pytest.mark.parametrize("backend", ["native", "atomics"])
def test_another_users_segments_are_left_out_unless_trusted(made, backend):
    env = dict(os.environ, SHMLIMIT_BACKEND=backend)
    mine = _limiter(made)
    forged = _limiter(made, stopped=True, owner=OTHER_UID)  # a forged stopped=1, another user's
    r = metrics("--max-segments", "100000", env=env)  # the owner rule alone, however many exist
    assert r.returncode == 0, r.stderr
    values = series(r.stdout)
    assert mine in limiters_in(values) and forged not in limiters_in(values)
    assert omitted(values, "untrusted_owner") >= 1
    assert "left out" in r.stderr and "--all-users" in r.stderr
    # named: the same rule, counted exactly
    r = metrics(mine, forged, env=env)
    values = series(r.stdout)
    assert limiters_in(values) == {mine} and omitted(values, "untrusted_owner") == 1
    for more in (["--trust-uid", str(OTHER_UID)], ["--all-users"]):
        r = metrics(mine, forged, *more, env=env)
        assert r.returncode == 0 and r.stderr == "", r.stderr
        values = series(r.stdout)
        assert limiters_in(values) == {mine, forged}
        assert values[("shmlimit_stopped", (("limiter", forged),))] == 1
        assert omitted(values, "untrusted_owner") == 0


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a segment to another uid needs root")
def test_the_collector_keeps_the_same_scope(made):
    from prometheus_client import CollectorRegistry, generate_latest

    from shmlimit.integrations.prometheus import ShmlimitCollector

    mine, theirs = _limiter(made), _limiter(made, owner=OTHER_UID)

    def scraped(**scope):
        reg = CollectorRegistry()
        reg.register(ShmlimitCollector([mine, theirs], **scope))
        return series(generate_latest(reg).decode())

    values = scraped()
    assert limiters_in(values) == {mine} and omitted(values, "untrusted_owner") == 1
    assert limiters_in(scraped(trusted_uids=[OTHER_UID])) == {mine, theirs}
    assert limiters_in(scraped(all_users=True)) == {mine, theirs}


def test_a_scrape_exports_at_most_max_segments(made):
    names = sorted(_limiter(made) for _ in range(5))
    r = metrics(*names, "--max-segments", "3")
    assert r.returncode == 0, r.stderr
    values = series(r.stdout)
    assert limiters_in(values) == set(names[:3])  # the first ones, in the order given
    assert omitted(values, "over_cap") == 2
    assert "2 segment(s) beyond --max-segments" in r.stderr
    # the whole machine: one segment read, whatever other segments exist (another test's may be
    # unreadable, or gone by the time it is read)
    r = metrics("--max-segments", "1")
    values = series(r.stdout)
    # (a limiter of several rates is one segment whose rates are series of their own: NAME[KEY])
    segments = {name.partition("[")[0] for name in limiters_in(values)}
    read = len(segments) + values[("shmlimit_unreadable_segments", ())]
    assert read <= 1 and omitted(values, "over_cap") >= 4


def test_a_name_listed_twice_is_exported_once(made):
    """A repeated series is an invalid exposition (OpenMetrics refuses it, Prometheus drops it as
    a duplicate sample), and the copy took a place of --max-segments."""
    from prometheus_client import CollectorRegistry, generate_latest

    from shmlimit.integrations.prometheus import ShmlimitCollector

    a, b = _limiter(made), _limiter(made)
    reg = CollectorRegistry()
    reg.register(ShmlimitCollector([a, a, b], max_segments=2))
    text = generate_latest(reg).decode()
    grants = [line for line in text.splitlines() if line.startswith("shmlimit_grants_total")]
    assert len(grants) == 2 and limiters_in(series(text)) == {a, b}, grants
    assert omitted(series(text), "over_cap") == 0
    r = metrics(a, b, a)
    assert r.returncode == 0, r.stderr
    assert sum(line.startswith("shmlimit_grants_total") for line in r.stdout.splitlines()) == 2


@pytest.mark.backend_independent  # argument checks
def test_scope_options_are_checked():
    from shmlimit.cli.metrics import select
    from shmlimit.integrations.prometheus import ShmlimitCollector

    with pytest.raises(ValueError, match="max_segments"):
        ShmlimitCollector(max_segments=0)
    with pytest.raises(TypeError, match="trusted_uids"):
        ShmlimitCollector(trusted_uids="1000")
    with pytest.raises(ValueError, match="trusted_uids"):
        select([], trusted_uids=[-1])
    # a lone name was iterated into its characters (nothing exported, no error); "false" from a
    # config file is truthy, and exported every user's segments
    for bad in ("api", b"api", 5, ["api", 5]):
        with pytest.raises(TypeError, match="names"):
            ShmlimitCollector(bad)
    # a name no limiter has was exported as nothing; a NUL made every scrape raise
    for bad in (["bad name!"], ["api", "a\x00b"], [""], ["-x"], ["x" * 65]):
        with pytest.raises(ValueError, match="^names must hold limiter names: .*got"):
            ShmlimitCollector(bad)
        with pytest.raises(ValueError, match="^names"):
            select(bad)
    for bad in ("false", 0, None):
        with pytest.raises(TypeError, match="all_users"):
            ShmlimitCollector(all_users=bad)
        with pytest.raises(TypeError, match="all_users"):
            select([], all_users=bad)
    assert ShmlimitCollector(("api",), all_users=True).names == ["api"]


def _one_line_error(r, *words):
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and all(w in lines[0] for w in words), r.stderr


@pytest.mark.backend_independent  # argument checks
@pytest.mark.parametrize("port", ["99999", "-1", "65536"])
def test_a_port_out_of_range_is_one_line(port):
    _one_line_error(metrics("--port", port), "--port", "0 to 65535", port)


@pytest.mark.backend_independent  # argument checks
def test_a_port_in_use_or_a_bad_address_is_one_line():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        _one_line_error(metrics("--port", port), "cannot listen", "--port " + port)
    _one_line_error(metrics("--port", "0", "--bind", "256.0.0.1"), "cannot listen", "--bind")
