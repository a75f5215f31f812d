"""Helpers shared by the test modules (and, for the window checks, by tools/soak.py and tools/bench.py).

* ``clock``         -- ``FakeClock``, the one injected clock of the tests;
* ``windows``       -- the over-grant checks: every window of a run against its bound;
* ``procs``         -- real processes: interpreters that acquire, stamp or idle, the command line,
                       a program on a pseudo-terminal, and ``wait_for``;
* ``segments``      -- a segment's raw bytes, read around the atomic layer; a real one's bytes
                       captured, hostile bytes planted under a fresh name; the command line's
                       tools (``gc``) run over the test's own segments only;
* ``limiters``      -- limiters set up as several modules need them (the filler stopped);
* ``cells``         -- every atomic backend over a real POSIX segment (fixtures);
* ``redis_server``  -- a real redis-server on a free port;
* ``servers``       -- real servers (uvicorn, gunicorn, a Celery worker) on a free 127.0.0.1 port,
                       stopped by their own process group, and ``get`` for plain HTTP requests.

Test modules import from here, never from one another.
"""
