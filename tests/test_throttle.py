"""The ``@throttle`` decorator (shmlimit/throttle.py): its limiter made on the first call, from
any thread, in a process forked at any time."""

import importlib
import os
import threading

from support.procs import wait_exit

import shmlimit

# the module: ``shmlimit.throttle`` is the function
T = importlib.import_module("shmlimit.throttle")


def test_a_child_forked_while_a_thread_makes_the_limiter_makes_its_own(name, monkeypatch):
    """A thread makes the limiter on the first call while another forks: the child inherited the
    decorator's creation lock held, and hung for ever on its first call.  The making is held open
    here until the child has run."""
    parent, entered, release = os.getpid(), threading.Event(), threading.Event()
    real = T.Limiter

    def slow_make(*args, **kwargs):
        if os.getpid() == parent:
            entered.set()
            release.wait(30)
        return real(*args, **kwargs)

    f = shmlimit.throttle(name, rate=1000)(lambda: "called")
    monkeypatch.setattr(T, "Limiter", slow_make)
    t = threading.Thread(target=f)
    t.start()
    try:
        assert entered.wait(10)
        pid = os.fork()
        if pid == 0:
            try:
                os._exit(0 if f() == "called" else 1)
            finally:
                os._exit(2)
        status = wait_exit(pid, 10)
    finally:
        release.set()
        t.join(30)
    assert status == 0
    assert f.limiter().stats().grants == 2  # the child's call and the thread's
    f.limiter().close()


def test_threads_racing_to_make_the_limiter_keep_one_and_close_the_others(name, monkeypatch):
    both, made = threading.Barrier(2), []
    real = T.Limiter

    def racing_make(*args, **kwargs):
        both.wait(10)  # each thread has found no limiter yet
        made.append(real(*args, **kwargs))
        return made[-1]

    f = shmlimit.throttle(name, rate=1000)(lambda: "called")
    monkeypatch.setattr(T, "Limiter", racing_make)
    threads = [threading.Thread(target=f) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    kept = f.limiter()
    assert kept in made and len(made) == 2
    assert [h.closed for h in made] == [h is not kept for h in made]
    assert kept.stats().grants == 2
    kept.close()
