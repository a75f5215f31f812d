"""The atomic layer's test fixtures: every backend over a real POSIX shared-memory segment."""

import mmap
import os
import threading
import uuid
from contextlib import contextmanager

import posix_ipc
import pytest

from shmlimit.errors import ConfigWriterTakenOver
from shmlimit.shm.atomics_cells import AtomicsCells
from shmlimit.shm.cells import native_available, open_cells

REQUIRE_NATIVE = os.environ.get("SHMLIMIT_REQUIRE_NATIVE") == "1"
#: "atomics-api": the atomics backend on the package's public API (where its internals are not found)
BACKENDS = ["atomics", "atomics-api", "native"]
SIZE = 4096


def cells_for(mm, size, backend):
    if backend == "atomics-api":
        c = AtomicsCells(mm, size, direct=False)
        assert not c._direct
        return c
    c = open_cells(mm, size, backend)
    assert backend != "atomics" or c._direct  # the fast way is found in the package we test with
    return c


@contextmanager
def opened(name, backend):
    """The cells over the test segment ``name``, mapped as another process maps it (for a worker
    process); the cells, then the mapping, closed on leaving."""
    shm = posix_ipc.SharedMemory(name)
    mm = mmap.mmap(shm.fd, SIZE)
    shm.close_fd()
    c = cells_for(mm, SIZE, backend)
    try:
        yield c
    finally:
        c.close()
        mm.close()


@pytest.fixture(params=BACKENDS)
def backend(request):
    if request.param == "native" and not native_available():
        if REQUIRE_NATIVE:
            pytest.fail("SHMLIMIT_REQUIRE_NATIVE=1 but shmlimit.shm._native did not build")
        pytest.skip("the native extension is not built here")
    return request.param


@pytest.fixture
def segment():
    name = f"/shmlimit-test-cells-{uuid.uuid4().hex[:10]}"
    shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, size=SIZE)
    mm = mmap.mmap(shm.fd, SIZE)
    shm.close_fd()
    yield name, mm
    mm.close()
    posix_ipc.unlink_shared_memory(name)


@pytest.fixture
def cells(backend, segment):
    c = cells_for(segment[1], SIZE, backend)
    yield c
    try:
        c.close()
    except ValueError:
        pass


class Before:
    """Cells that run ``then()`` once, before the first operation ``when(op, args)`` picks (op:
    "load", "cas", ...; loads too, unlike ``BeforeWrite``): a process stopped, stalled or killed
    (``then`` raising) right there, while ``then`` lets others run.  ``nth(k)`` picks the k-th
    operation, whatever it is."""

    def __init__(self, cells, when, then):
        self._cells, self._when, self._then = cells, when, then

    @staticmethod
    def nth(k):
        seen = iter(range(k + 1))
        return lambda op, args: next(seen, None) == k

    def __getattr__(self, op):
        run = getattr(self._cells, op)
        if not callable(run):  # (an attribute: the mapping's size)
            return run

        def step(*args):
            if self._then is not None and self._when(op, args):
                then, self._then = self._then, None
                then()
            return run(*args)

        return step


class WritesSeen:
    """A process's cells that note, at each write to the words ``offs``, whether the config
    sequence word ``seq`` was odd then (a writer held the lock)."""

    def __init__(self, cells, offs, seq):
        self._cells, self._offs, self._seq, self.locked = cells, set(offs), seq, []

    def __getattr__(self, op):
        return getattr(self._cells, op)

    def _note(self, off):
        if off in self._offs:
            self.locked.append(bool(self._cells.load(self._seq) & 1))

    def store(self, off, value):
        self._note(off)
        self._cells.store(off, value)

    def cas(self, off, expected, desired):
        self._note(off)
        return self._cells.cas(off, expected, desired)


class BeforeWrite:
    """Cells (a config writer's) that run ``before()`` once, before their ``at``-th write (store, CAS
    or add; counted from 0, -1: never) -- a writer stopped or stalled at that write -- and count
    every write in ``writes``.  Loads pass through."""

    def __init__(self, cells, at, before):
        self.c, self.at, self.before, self.writes, self.reached = cells, at, before, 0, False

    def _write(self):
        if self.writes == self.at and not self.reached:
            self.reached = True
            self.before()
        self.writes += 1

    def load(self, off):
        return self.c.load(off)

    def load_many(self, offsets):
        return self.c.load_many(offsets)  # reads only: never where a writer stops

    def store(self, off, value):
        self._write()
        self.c.store(off, value)

    def cas(self, off, expected, desired):
        self._write()
        return self.c.cas(off, expected, desired)

    def fetch_add(self, off, delta):
        self._write()
        return self.c.fetch_add(off, delta)


class Gate(BeforeWrite):
    """Cells whose ``at``-th write (store, CAS or add; the 0th takes the lock) waits for ``go``."""

    def __init__(self, cells, at):
        self.stopped, self.go = threading.Event(), threading.Event()
        super().__init__(cells, at, self._stop)

    def _stop(self):
        self.stopped.set()
        assert self.go.wait(30), "the test never let this writer go on"


class Writer:
    """``write(cells)`` in a thread of its own, stopped before its ``at``-th write."""

    def __init__(self, write, cells, at):
        self.gate, self.errors = Gate(cells, at), []
        self.thread = threading.Thread(target=self._run, args=(write,), daemon=True)
        self.thread.start()
        self.gate.stopped.wait(30)
        self.late = self.thread.is_alive()  # stopped before write ``at``, not ended before it

    def _run(self, write):
        try:
            write(self.gate)
        except ConfigWriterTakenOver:
            pass  # the right answer for a writer taken over
        except BaseException as e:  # noqa: BLE001 - reported by the test
            self.errors.append(e)
        finally:
            self.gate.stopped.set()

    def resume(self):
        """Let it go on and run to its end, which must raise nothing but ``ConfigWriterTakenOver``."""
        self.release()
        assert not self.thread.is_alive() and not self.errors, self.errors

    def release(self):
        """Let it go on, wherever it stopped, and wait for its end (a test's clean-up: nothing checked)."""
        self.gate.go.set()
        self.thread.join(30)


def release(*writers):
    """``Writer.release`` each of ``writers`` (None: a writer never started)."""
    for w in writers:
        if w is not None:
            w.release()


def writes(write, cells):
    """How many writes (store, CAS or add) ``write(cells)`` makes when nothing stops it."""
    gate = Gate(cells, -1)
    write(gate)
    return gate.writes


def every_two_late(write_first, write_second, prepare, newer, check):
    """Two config writers late at once, at every pair of their stopping points, resumed in either order.

    ``prepare()`` sets the config up again and returns the cells to write; ``write_first(cells)``
    is stopped before one of its writes and taken over by ``write_second(cells)``, stopped before
    one of its own and taken over by ``newer()``, the newest publication; then the two late ones
    resume, each running to its end before the other goes on.  ``check(where)`` runs after the
    newest publication and after each resumption.  Returns how many cases ran (pairs where both
    writers stopped, times two orders).
    """
    n1, n2 = writes(write_first, prepare()), writes(write_second, prepare())
    cases = 0
    for i in range(1, n1):  # 0: not late, it has not taken the lock yet
        for j in range(1, n2):
            for order in ("first-resumes-first", "second-resumes-first"):
                c = prepare()
                w1 = Writer(write_first, c, i)
                w2 = Writer(write_second, c, j) if w1.late else None
                try:
                    if not (w1.late and w2.late):
                        continue
                    newer()
                    where = (i, j, order)
                    check(where + ("published",))
                    late = (w1, w2) if order == "first-resumes-first" else (w2, w1)
                    for k, w in enumerate(late):
                        w.resume()
                        check(where + (f"resumed {k + 1}",))
                    cases += 1
                finally:
                    release(w1, w2)
    return cases
