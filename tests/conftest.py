import os
import uuid

import pytest

import shmlimit


@pytest.fixture
def name():
    """A fresh limiter name, unlinked after the test whatever happened."""
    n = f"test-{os.getpid()}-{uuid.uuid4().hex[:10]}"
    yield n
    try:
        shmlimit.unlink(n)
    except FileNotFoundError:
        pass


def _redis():
    from support.redis_server import RedisServer, require

    require()
    server = RedisServer()
    server.start()
    return server


@pytest.fixture(scope="session")
def redis_server():
    """One real redis-server for the session (skipped, or failed under SHMLIMIT_REQUIRE_REDIS=1, without one)."""
    server = _redis()
    yield server
    server.stop()


@pytest.fixture
def own_redis():
    """A redis-server of the test's own, which the test may kill and restart."""
    server = _redis()
    yield server
    server.stop()
