"""The ``shm://`` storage through ``limits``' own strategies and Flask-Limiter, then under a real
``gunicorn -w 4`` on 127.0.0.1: the four workers share one count per window."""

import os
import textwrap
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("limits")
from limits import parse, storage, strategies  # noqa: E402
from support.clock import FakeClock  # noqa: E402
from support.procs import wait_for  # noqa: E402
from support.servers import BIN, Server, get  # noqa: E402

import shmlimit  # noqa: E402
import shmlimit.integrations.limits as shm_limits  # noqa: E402

# run once in CI: limits and Flask-Limiter over shm://; the windows are test_window_*'s
pytestmark = pytest.mark.backend_independent


@pytest.fixture
def store(name):
    s = storage.storage_from_string(f"shm://{name}?keys=4096")
    yield s
    s.table.close()


def test_the_scheme_is_registered_and_options_are_checked(name):
    s = storage.storage_from_string(f"shm://{name}?keys=512")
    assert isinstance(s, shm_limits.ShmStorage) and s.table.slots == 512 and s.check()
    s.table.close()
    for bad, msg in [
        ("shm://", "name the table"),
        (f"shm://{name}?size=3", "unknown option"),
        (f"shm://{name}?keys=many", "keys must be an integer"),
        ("shm://bad name", "name must be"),
    ]:
        with pytest.raises(ValueError, match=msg):
            storage.storage_from_string(bad)


def test_a_uri_mode_is_octal_as_chmod_reads_it(name):
    """``?mode=`` was read as a decimal Python literal: ``mode=400`` made the segment 0o620
    (group-writable) and ``mode=0600`` was refused as "not an integer".  Octal, as chmod reads
    permission bits, in any of its spellings; anything else is refused naming mode."""
    for spelled in ("400", "0400", "0o400", "0O400"):
        assert shm_limits.parse_uri(f"shm://{name}?mode={spelled}") == (name, {"mode": 0o400})
    s = storage.storage_from_string(f"shm://{name}?mode=640&keys=64")
    assert os.stat(f"/dev/shm/shmlimit.{name}").st_mode & 0o777 == 0o640
    s.table.close()
    for bad in ("384", "0x180", "rw", "", "0o", "-600", "6 0 0"):
        with pytest.raises(ValueError, match="mode must be octal"):
            shm_limits.parse_uri(f"shm://{name}?mode={bad}")


def test_an_unknown_storage_option_is_refused(name):
    """An option the shm:// storage does not know (``key=`` for ``keys=``, as Flask-Limiter's
    ``storage_options`` pass it) was silently dropped: the table got 100 000 slots.  Refused,
    naming it, before any table is made; sync and asyncio alike."""
    for make in (
        lambda **kw: storage.storage_from_string(f"shm://{name}", **kw),
        lambda **kw: storage.storage_from_string(f"async+shm://{name}", **kw),
    ):
        with pytest.raises(TypeError, match=r"^key\b.*keys"):
            make(key=512)
    assert name not in shmlimit.list_names()
    s = storage.storage_from_string(f"shm://{name}", keys=512)  # a known one still works
    assert s.table.slots == 512
    s.table.close()


def test_fixed_window_through_limits(store):
    lim = strategies.FixedWindowRateLimiter(store)
    item = parse("3/minute")
    assert [lim.hit(item, "a") for _ in range(5)] == [True] * 3 + [False] * 2
    assert lim.hit(item, "b") and not lim.test(item, "a") and lim.test(item, "b")
    stats = lim.get_window_stats(item, "a")
    assert stats.remaining == 0 and 0 < stats.reset_time - __import__("time").time() <= 60.01
    lim.clear(item, "a")
    assert lim.hit(item, "a") and store.get(item.key_for("a")) == 1
    assert store.reset() >= 2 and store.get(item.key_for("b")) == 0


def test_sliding_window_counter_through_limits(store):
    lim = strategies.SlidingWindowCounterRateLimiter(store)
    item = parse("4/hour")
    assert [lim.hit(item, "a", cost=2) for _ in range(3)] == [True, True, False]
    assert lim.get_window_stats(item, "a").remaining == 0
    lim.clear(item, "a")
    assert lim.test(item, "a") and lim.hit(item, "a")


def test_sliding_window_weights_the_previous_window(name):
    clock = FakeClock(3600 * 10**9 * 1000)  # on a window boundary of every length
    s = storage.storage_from_string(f"shm://{name}", clock=clock)
    try:
        assert sum(s.acquire_sliding_window_entry("k", 10, 10) for _ in range(12)) == 10
        clock.advance_seconds(12.5)  # a quarter into the next window: the previous counts 3/4
        assert s.get_sliding_window("k", 10)[:3:2] == (10, 0)
        assert (
            sum(s.acquire_sliding_window_entry("k", 10, 10) for _ in range(5)) == 3
        )  # floor(7.5)+n <= 10
    finally:
        s.table.close()


def test_moving_window_is_shared_by_every_storage_of_a_table(name):
    a = storage.storage_from_string(f"shm://{name}")
    b = storage.storage_from_string(f"shm://{name}")
    try:
        limiter_a, limiter_b = (
            strategies.MovingWindowRateLimiter(a),
            strategies.MovingWindowRateLimiter(b),
        )
        item = parse("3/minute")
        assert limiter_a.hit(item, "k") and limiter_b.hit(item, "k") and limiter_a.hit(item, "k")
        assert not limiter_b.hit(item, "k") and not limiter_a.test(item, "k")
        assert b.get_moving_window(item.key_for("k"), 3, 60)[1] == 3
    finally:
        a.table.close()
        b.table.close()


def test_moving_window_sizes_come_from_the_uri(name):
    s = storage.storage_from_string(f"shm://{name}?keys=64&moving_keys=16&moving_log=64")
    try:
        assert (s.table.slots, s.table.moving_slots, s.table.moving_log) == (64, 16, 64)
    finally:
        s.table.close()
    with pytest.raises(ValueError, match="moving_log"):
        storage.storage_from_string(f"shm://{name}-bad?moving_log=100")


APP = """
import os
import shmlimit.integrations.limits
from flask import Flask
from flask_limiter import Limiter

app = Flask(__name__)
limiter = Limiter(lambda: "everyone", app=app, storage_uri="shm://" + os.environ["LIM"],
                  strategy=os.environ["STRATEGY"], headers_enabled=True)

@app.route("/")
@limiter.limit(os.environ["LIMIT"])
def index():
    return str(os.getpid())

@app.errorhandler(429)
def refused(e):
    return str(os.getpid()), 429

if os.environ.get("BOOTED"):  # this worker has imported the app: it is about to accept
    open(os.path.join(os.environ["BOOTED"], str(os.getpid())), "w").close()

@app.route("/health")
@limiter.exempt
def health():
    return "ok"
"""


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["fixed-window", "sliding-window-counter", "moving-window"])
def test_flask_limiter_under_gunicorn_four_workers(name, tmp_path, strategy):
    pytest.importorskip("flask_limiter")
    (tmp_path / "limits_app.py").write_text(textwrap.dedent(APP))
    argv = [
        f"{BIN}/gunicorn",
        "-w",
        "4",
        "-b",
        "127.0.0.1:{port}",
        "--log-level",
        "warning",
        "limits_app:app",
    ]
    booted = tmp_path / "booted"
    booted.mkdir()
    env = {"LIM": name, "STRATEGY": strategy, "LIMIT": "25 per 10 minutes", "BOOTED": str(booted)}
    with Server(argv, str(tmp_path), env=env) as srv:
        # The server answers once one worker has booted; the others were still importing the app
        # 0.05 to 0.7 s later on a busy machine, while the 200 requests took 0.4 to 1 s: a slower
        # machine's run was over before a second worker could accept.  So: every worker first.
        wait_for(lambda: len(os.listdir(booted)) >= 4, timeout=60)
        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(lambda _: get(srv.url + "/"), range(200)))
            # which worker accepts is still the kernel's choice: more, bounded, until a second one did
            for _ in range(20):
                if len({body for _, _, body in results}) >= 2:
                    break
                results += pool.map(lambda _: get(srv.url + "/"), range(50))
        assert all(get(srv.url + "/health")[0] == 200 for _ in range(3))
    statuses = [s for s, _, _ in results]
    # one window for the whole run (it lasts 10 minutes): exactly the limit, shared by the workers
    assert statuses.count(200) == 25 and statuses.count(429) == len(results) - 25
    # with counts per process, any second worker would have granted requests of its own
    assert len({body for _, _, body in results}) >= 2, "one worker served every request"
    assert all(h.get("x-ratelimit-remaining") == "0" for s, h, _ in results if s == 429)


@pytest.mark.slow
def test_flask_limiter_short_windows_under_gunicorn(name, tmp_path):
    """Windows of one second over about three seconds: no window grants more than the limit."""
    pytest.importorskip("flask_limiter")
    (tmp_path / "limits_app.py").write_text(textwrap.dedent(APP))
    argv = [
        f"{BIN}/gunicorn",
        "-w",
        "4",
        "-b",
        "127.0.0.1:{port}",
        "--log-level",
        "warning",
        "limits_app:app",
    ]
    with Server(
        argv, str(tmp_path), env={"LIM": name, "STRATEGY": "fixed-window", "LIMIT": "5 per second"}
    ) as srv:
        with ThreadPoolExecutor(6) as pool:
            results = list(pool.map(lambda _: get(srv.url + "/"), range(300)))
    windows = {}
    for s, h, _ in results:
        if s == 200:
            reset = h["x-ratelimit-reset"]  # the window's end: one value per window
            windows[reset] = windows.get(reset, 0) + 1
    assert windows and max(windows.values()) <= 5
    assert sum(s == 429 for s, _, _ in results) >= 100


@pytest.mark.parametrize("strategy", ["fixed-window", "sliding-window-counter", "moving-window"])
@pytest.mark.parametrize("rate", ["20000000/day", f"{2**32}/day"])
def test_a_limit_above_the_bound_is_refused_by_name(name, strategy, rate):
    """Above its documented bound a limit is a ValueError naming the bound, never a silent cap
    (a fixed window's count would have stopped at 2^24 - 1 and granted no more than that)."""
    s = storage.storage_from_string(f"shm://{name}?keys=64&moving_keys=8")
    try:
        limiter = strategies.STRATEGIES[strategy](s)
        bound = 2**20 - 1 if strategy == "moving-window" else 2**24 - 1
        with pytest.raises(ValueError, match=f"at most {bound}|from 0 to {bound}"):
            limiter.hit(parse(rate), "k")
        assert limiter.hit(parse(f"{bound}/day"), "k", cost=bound)  # the bound itself holds
        assert not limiter.hit(parse(f"{bound}/day"), "k")
    finally:
        s.table.close()


def test_any_key_counts_even_one_ending_like_a_limit_with_other_digits(store):
    """A key ending ``/²/1/second`` ("²" is a digit to ``str.isdigit``, not a number to ``int``) made
    ``incr`` raise ValueError; any key is a key, its limit read only from decimal digits."""
    assert [store.incr("a/²/1/second", 60) for _ in range(2)] == [1, 2]
    assert shm_limits.limit_of("a/²/1/second") is None
    assert shm_limits.limit_of("a/١٢/1/second") == 12  # decimal digits of any script are numbers
    assert store.get("a/²/1/second") == 2


@pytest.mark.parametrize("strategy", ["fixed-window", "sliding-window-counter", "moving-window"])
def test_a_long_key_is_limited_as_memory_storage_limits_it(name, strategy):
    """An identifier of over 4096 bytes (an API key header) in a ``limits`` key raised ValueError
    at every hit: a 500 under Flask-Limiter, or no limit at all with ``swallow_errors=True``.
    Counted as ``MemoryStorage`` (and Redis) count it."""
    s = storage.storage_from_string(f"shm://{name}?keys=64&moving_keys=8")
    item, who = parse("2/minute"), "k" * 4100
    try:
        for st in (s, storage.MemoryStorage()):
            lim = strategies.STRATEGIES[strategy](st)
            assert [lim.hit(item, who) for _ in range(3)] == [True, True, False]
            assert lim.hit(item, who + "2")  # the same first 4096 bytes: another client
    finally:
        s.table.close()
