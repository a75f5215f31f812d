"""The value kind GCRA: one theoretical-arrival-time word per key, and the config it is priced by.

A key's state is one word, its TAT (``V0`` of its slot, in ticks of 1/16 ns of
CLOCK_MONOTONIC); the GCRA step itself is part of the atomic layer's keyed
composite (``keyed_cells``).  This module holds what prices it: the default
``(T, TAU)`` in the header and the per-key overrides in a bounded table of
their own, both published under one sequence lock (``CFG_SEQ``, odd while a
writer works) so that a reader never prices a grant with a torn pair.

Overrides are found by the key's digest, not through its slot, so they apply
from the next call in every process, survive the key's eviction, and are
removed by marking their entry TOMB.
"""
from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from typing import Optional, Tuple

from . import keyed_layout as K
from . import layout as L
from .cells import Cells

#: Ticks of schedule arithmetic stay below this (2**60 ticks = 2.3 years).
MAX_TICKS = 1 << 60
TICKS_PER_S = 1e9 * (1 << K.TICK_SHIFT)
#: A config lock held longer than this (seconds) was left by a dead writer and is taken over.
LOCK_TIMEOUT = 0.2
_MASK64 = (1 << 64) - 1  # CFG_SEQ counts modulo 2**64, as the native composite's does


def _next(seq: int, by: int = 1) -> int:
    return (seq + by) & _MASK64


def wait_unlocked(c: Cells) -> int:
    """``CFG_SEQ`` once no writer holds it: an even value.

    A writer holds it for microseconds; one that held it for ``LOCK_TIMEOUT``
    died there (killed in ``set_rate``), and the lock is closed by CAS to the
    next even value, as the keyed composite's readers close it.  Without this
    the Python readers (the default rate, an override, ``_adopt`` when a
    process opens with ``rate=``) waited for that writer forever: after a
    writer was killed in a set_rate, every process opening the limiter with
    its rate hung until some other process acquired through it.
    """
    seen, since = None, 0.0
    while True:
        s = c.load(K.CFG_SEQ)
        if not s & 1:
            return s
        now = time.monotonic()
        if s != seen:
            seen, since = s, now
        elif now - since > LOCK_TIMEOUT:
            c.cas(K.CFG_SEQ, s, _next(s))
            continue
        os.sched_yield()


@dataclass(frozen=True)
class Rate:
    """One GCRA configuration: ``rate`` ops per ``per`` seconds, ``burst`` ops at once."""

    rate: float
    per: float
    burst: float

    @property
    def t(self) -> int:
        """Emission interval in ticks per op, rounded up: never faster than asked."""
        return max(1, math.ceil(self.per * TICKS_PER_S / self.rate))

    @property
    def tau(self) -> int:
        """Burst tolerance in ticks: the bucket holds ``burst`` ops."""
        return int(self.burst * self.t)

    def describe(self) -> str:
        return f"rate={self.rate:g}/{self.per:g}s burst={self.burst:g}"


def make_rate(rate: object, per: object, burst: object) -> Rate:
    """Validate as ``Config.make`` does (same messages, same ranges), then check the tick arithmetic."""
    from .config import Config

    cfg = Config.make(rate, per, burst)
    r = Rate(cfg.rate, cfg.per, cfg.burst)
    if r.tau >= MAX_TICKS:
        raise ValueError(f"burst * per / rate must be below {MAX_TICKS / TICKS_PER_S:.0f} seconds, got {r.describe()}")
    return r


def read_rate(c: Cells, base: int = K.CFG_RATE) -> Rate:
    return Rate(L.u2f(c.load(base)), L.u2f(c.load(base + 8)), L.u2f(c.load(base + 16)))


class ConfigLock:
    """The writers' side of ``CFG_SEQ``: CAS even -> odd, write, store even; a dead holder is taken over."""

    def __init__(self, c: Cells) -> None:
        self.c = c

    def __enter__(self) -> int:
        c = self.c
        seen, since = None, time.monotonic()
        while True:
            s = c.load(K.CFG_SEQ)
            if not s & 1:
                if c.cas(K.CFG_SEQ, s, _next(s)):
                    self.seq = _next(s)
                    return self.seq
                continue
            if s != seen:
                seen, since = s, time.monotonic()
            elif time.monotonic() - since > LOCK_TIMEOUT and c.cas(K.CFG_SEQ, s, _next(s, 2)):
                self.seq = _next(s, 2)  # still odd: ours now; we rewrite what we came to write
                return self.seq
            os.sched_yield()

    def __exit__(self, *exc: object) -> None:
        self.c.store(K.CFG_SEQ, _next(self.seq))


def _write_pair(c: Cells, t_off: int, tau_off: int, t: int, tau: int) -> None:
    """Move (T, TAU) to (t, tau) so that every intermediate pair is no more permissive than the old
    or the new one: first the slower T and the smaller TAU of the two, then the new values.

    Readers never use a pair read while the lock is held, but a writer killed here leaves the
    lock to be closed by readers after LOCK_TIMEOUT, and then its last pair is the one in force.
    """
    old_t, old_tau = c.load(t_off), c.load(tau_off)
    c.store(t_off, max(old_t, t))
    c.store(tau_off, min(old_tau, tau))
    c.store(t_off, t)
    c.store(tau_off, tau)


def publish_default(c: Cells, rate: Rate) -> None:
    with ConfigLock(c):
        _write_pair(c, K.CFG_T, K.CFG_TAU, rate.t, rate.tau)
        c.store(K.CFG_RATE, L.f2u(rate.rate))
        c.store(K.CFG_PER, L.f2u(rate.per))
        c.store(K.CFG_BURST, L.f2u(rate.burst))


def read_default(c: Cells) -> Rate:
    while True:
        s = wait_unlocked(c)
        r = read_rate(c)
        if c.load(K.CFG_SEQ) == s:
            return r
        os.sched_yield()


class Overrides:
    """The bounded override table: ``novr`` entries probed from the digest's home (``D1``)."""

    def __init__(self, c: Cells, novr: int) -> None:
        self.c = c
        self.novr = novr
        self.base = K.overrides_offset()

    def _entries(self, d: Tuple[int, int]):
        home = (d[1] * self.novr) >> 64
        for i in range(min(K.PROBE, self.novr)):
            yield self.base + ((home + i) % self.novr) * K.LINE

    def _find(self, d: Tuple[int, int]) -> Optional[int]:
        c = self.c
        for e in self._entries(d):
            state = c.load(e + K.O_CTRL)
            if state == K.O_EMPTY:
                return None
            if state == K.O_LIVE and c.load(e + K.O_D0) == d[0] and c.load(e + K.O_D1) == d[1]:
                return e
        return None

    def get(self, d: Tuple[int, int]) -> Optional[Rate]:
        while True:
            s = wait_unlocked(self.c)
            e = self._find(d) if self.novr else None
            r = read_rate(self.c, e + K.O_RATE) if e is not None else None
            if self.c.load(K.CFG_SEQ) == s:
                return r
            os.sched_yield()

    def set(self, d: Tuple[int, int], rate: Rate) -> None:
        if not self.novr:
            raise ValueError("this keyed limiter was created with overrides=0: it has no room for per-key rates")
        c = self.c
        with ConfigLock(c):
            e = self._find(d)
            if e is None:
                for cand in self._entries(d):
                    if c.load(cand + K.O_CTRL) != K.O_LIVE:
                        e = cand
                        break
                if e is None:
                    raise ValueError(
                        f"the override table is full near this key ({self.novr} entries): remove overrides, "
                        f"or create the keyed limiter with a larger overrides="
                    )
                # a new entry is complete before it is LIVE: a writer killed here leaves no half override
                c.store(e + K.O_T, rate.t)
                c.store(e + K.O_TAU, rate.tau)
                c.store(e + K.O_D0, d[0])
                c.store(e + K.O_D1, d[1])
                c.store(e + K.O_CTRL, K.O_LIVE)
                c.fetch_add(K.OVR_LIVE, 1)
            else:
                _write_pair(c, e + K.O_T, e + K.O_TAU, rate.t, rate.tau)
            c.store(e + K.O_RATE, L.f2u(rate.rate))
            c.store(e + K.O_PER, L.f2u(rate.per))
            c.store(e + K.O_BURST, L.f2u(rate.burst))

    def remove(self, d: Tuple[int, int]) -> bool:
        c = self.c
        with ConfigLock(c):
            e = self._find(d) if self.novr else None
            if e is None:
                return False
            c.store(e + K.O_CTRL, K.O_TOMB)
            c.fetch_add(K.OVR_LIVE, (1 << 64) - 1)
            return True

    def count(self) -> int:
        return self.c.load(K.OVR_LIVE)
