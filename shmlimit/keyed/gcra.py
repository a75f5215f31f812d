"""The value kind GCRA: one theoretical-arrival-time word per key, and the config it is priced by.

A key's state is one word, its TAT under a burst of ``MAX_TICKS`` (``V0`` of its
slot, in ticks of 1/16 ns of CLOCK_MONOTONIC: no price is needed to read it, see
``keyed_cells``); the GCRA step itself is part of the atomic layer's keyed
composite (``keyed_cells``).  This module holds what prices it: the default
``(T, TAU)`` and the per-key overrides in a bounded table of their own.

**Publication** (the plain limiter's, by its one code: ``shm.banks.BankCode``, per config).
Writers take ``CFG_SEQ`` as a lock (even -> odd by CAS; one silent for
``keyed.cells.LOCK_NS`` is taken over, odd -> odd + 2, or closed by a reader, odd
-> even) and publish by one CAS from their lock value to the next even
value, the generation they wrote.  Every config (the default, each override)
has two banks, each stamped with the generation that wrote it and a checksum
over that generation, the key's digest and the values (stored masked by the
generation: ``keyed_layout.bank_mask``).  A writer writes first the bank that
does not hold the config's newest valid copy, then the other, each word by
load, check that ``CFG_SEQ`` still holds its lock, CAS from the loaded word.
Readers wait for an even ``CFG_SEQ``, take the valid bank of the newest
generation (counted back from ``CFG_SEQ``, modulo 2**64) and check
``CFG_SEQ`` again (``keyed.cells.consistent``, the composite's own read).

So a writer stalled past the timeout and taken over resumes with at most one
CAS in hand, expecting a word loaded before any newer writer took the lock; no
newer writer ever stores that word again (masks and tags are per generation),
so the CAS misses every word a newer writer wrote.  However many writers are
late, a bank completed by a writer is never touched by an older one, each
config keeps a whole bank of its newest completed write, and whoever
publishes completed both; the late writers' publishing CAS fails
(``ConfigWriterTakenOver``).  A writer killed while it writes leaves its
config's newest bank whole: readers take the old config or the new one --
never words of both.

Overrides are found by the key's digest, not through its slot, so they apply
from the next call in every process and survive the key's eviction.  An entry
is claimed by CAS (CLAIM | owner | tag) before its digest is written and made
LIVE by CAS after its writer published, so a late writer never writes into an
entry another writer took; removal publishes a bank with ``T == 0``, so it is
ordered by generation like any other change, and a removed entry is reused.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Iterator, Optional, Tuple

from shmlimit.errors import SegmentError
from shmlimit.keyed import cells as KC
from shmlimit.keyed import layout as K
from shmlimit.keyed.cells import BANKS, alive, bank_offsets, consistent, pick
from shmlimit.shm import layout as L
from shmlimit.shm.banks import ConfigLock
from shmlimit.shm.cells import Cells

#: Ticks of schedule arithmetic stay below this (2**60 ticks = 2.3 years).
MAX_TICKS = K.MAX_TICKS
TICKS_PER_S = 1e9 * (1 << K.TICK_SHIFT)


def wait_ticks(seconds: float) -> int:
    """A wait in ticks, at most ``MAX_WAIT``: a finite wait past about 1e298 s is infinite in ticks
    (its float product), which ``int`` refuses, so the product is compared before converting."""
    ticks = seconds * TICKS_PER_S
    return KC.MAX_WAIT if ticks >= KC.MAX_WAIT else int(ticks)


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
    """Validate as ``Config.make`` does (same messages, same ranges; a rate spec's catch-up ratio
    or verb is refused: a key has neither), then check the tick arithmetic."""
    from shmlimit.config import Config

    cfg = Config.make(rate, per, burst, plain="a KeyedLimiter")
    r = Rate(cfg.rate, cfg.per, cfg.burst)
    if r.tau >= MAX_TICKS:
        raise ValueError(
            f"burst * per / rate must be below {MAX_TICKS / TICKS_PER_S:.0f} seconds, got {r.describe()}"
        )
    return r


def bank_values(rate: Optional[Rate]) -> Tuple[int, int, int, int, int]:
    """A bank's five values (RATE PER BURST T TAU) for ``rate``; all zero (T == 0: removed) for None."""
    if rate is None:
        return (0, 0, 0, 0, 0)
    return (L.f2u(rate.rate), L.f2u(rate.per), L.f2u(rate.burst), rate.t, rate.tau)


def write_bank(c: Cells, line: int, d: Tuple[int, int], vals, gen: int) -> None:
    """Store one bank with plain stores: only for a segment no other process sees yet."""
    for off, w in zip(bank_offsets(line, line)[0], BANKS.stored(gen, vals, d)):
        c.store(off, w)


def rate_of(vals: Tuple[int, ...]) -> Rate:
    return Rate(L.u2f(vals[0]), L.u2f(vals[1]), L.u2f(vals[2]))


def peek_default(c: Cells) -> Rate:
    """The default rate for display, without waiting for a writer (all zero if no bank is valid)."""
    vals = pick(c, K.DEFAULT_BANKS, (0, 0), c.load(K.CFG_SEQ) & ~1)
    return rate_of(vals or (0, 0, 0, 0, 0))


def _corrupt(what: str) -> SegmentError:
    return SegmentError(f"keyed segment is corrupt: no copy of {what} passes its checksum")


def config_lock(c: Cells) -> ConfigLock:
    """The keyed segment's config lock (``shm.banks.ConfigLock``)."""
    return ConfigLock(c, K.CFG_SEQ, KC.LOCK_NS, "keyed config")


def publish_default(c: Cells, rate: Rate) -> None:
    with config_lock(c) as lock:
        lock.write_banks(BANKS, bank_offsets(*K.DEFAULT_BANKS), (0, 0), bank_values(rate))


def read_default(c: Cells) -> Rate:
    vals = consistent(c, K.CFG_SEQ, lambda s: pick(c, K.DEFAULT_BANKS, (0, 0), s))
    if vals is None:
        raise _corrupt("the default rate")
    return rate_of(vals)


#: ``Overrides.set``'s ``over`` when the rate is set whatever the override in force.
ANY = object()


class Overrides:
    """The bounded override table: ``novr`` entries of three lines, probed from the digest's home (``D1``)."""

    def __init__(self, c: Cells, novr: int, probe: int) -> None:
        self.c = c
        self.novr = novr
        self.base = K.overrides_offset()
        # the composite looks for a key's override only as far as the table's ``probe`` (min(PROBE,
        # keys): a small table's is shorter), so no entry is ever placed beyond it
        self.probe = min(probe, novr)

    def _entries(self, d: Tuple[int, int]):
        home = (d[1] * self.novr) >> 64
        for i in range(self.probe):
            yield self.base + ((home + i) % self.novr) * K.OVR_LINES * K.LINE

    @staticmethod
    def _banks(e: int) -> Tuple[int, int]:
        return (e + K.O_BANKS[0], e + K.O_BANKS[1])

    def _is(self, e: int, d: Tuple[int, int]) -> bool:
        return self.c.load(e + K.O_D0) == d[0] and self.c.load(e + K.O_D1) == d[1]

    def _find(self, d: Tuple[int, int], claimed: bool = False) -> Optional[int]:
        """The LIVE entry of digest ``d`` (or, with ``claimed``, one a writer claimed for it)."""
        c = self.c
        for e in self._entries(d):
            ctl = c.load(e + K.O_CTRL)
            if ctl == K.O_EMPTY:
                return None
            state = K.o_state(ctl)
            if (state == K.O_LIVE or (claimed and state == K.O_CLAIM)) and self._is(e, d):
                return e
        return None

    def _vals(self, e: int, seq: int) -> Optional[Tuple[int, ...]]:
        return pick(self.c, self._banks(e), (self.c.load(e + K.O_D0), self.c.load(e + K.O_D1)), seq)

    def get(self, d: Tuple[int, int]) -> Optional[Rate]:
        return consistent(self.c, K.CFG_SEQ, self._rate, d)

    def _rate(self, d: Tuple[int, int], seq: int) -> Optional[Rate]:
        """Digest ``d``'s override as of ``seq`` (None: none, or removed)."""
        e = self._find(d) if self.novr else None
        vals = self._vals(e, seq) if e is not None else None
        if e is not None and vals is None:
            raise _corrupt("this key's override")
        return None if vals is None or not vals[3] else rate_of(vals)

    def _free(self, e: int, ctl: int, seq: int, mine: int) -> bool:
        """Whether entry ``e`` (CTRL ``ctl``) may be claimed: empty, freed, claimed by a writer that
        is gone, or LIVE with its override removed (or no bank valid)."""
        state = K.o_state(ctl)
        if ctl == K.O_EMPTY or state == K.O_TOMB:
            return True
        if state == K.O_CLAIM:
            return not alive(K.o_owner(ctl), mine)
        if state == K.O_LIVE:
            vals = self._vals(e, seq)
            return vals is None or not vals[3]
        return False

    def _take(self, e: int, ctl: int, lock: ConfigLock) -> Optional[int]:
        """CAS entry ``e``'s CTRL from ``ctl`` (loaded before this call) to a claim of ours: that
        claim, or None if the word moved.  The lock is checked between the load and the CAS, and
        every CTRL a writer stores carries its generation's tag: a writer taken over that resumes
        with this CAS in hand misses, since the word it expects was loaded before any newer writer
        took the lock and never comes back (before, LIVE -> CLAIM -> LIVE came back, and a late
        claim took over, then gave back, an override a newer writer had just published)."""
        if not lock.held():
            raise lock.taken_over()
        claim = K.o_ctrl(K.O_CLAIM, K.owner(os.getpid()), lock.gen)
        return claim if self.c.cas(e + K.O_CTRL, ctl, claim) else None

    def _claim(self, d: Tuple[int, int], lock: ConfigLock) -> Tuple[int, int]:
        """Claim an entry for digest ``d`` (CAS to CLAIM | us), its digest written: ``(entry, ctrl)``."""
        c = self.c
        mine = K.owner(os.getpid())
        for e in self._entries(d):
            ctl = c.load(e + K.O_CTRL)
            if not self._free(e, ctl, lock.seq, mine):
                continue
            claim = self._take(e, ctl, lock)
            if claim is None:
                continue
            # Our claim, which no one else takes while we live: a late store of ours lands only here.
            c.store(e + K.O_D0, d[0])
            c.store(e + K.O_D1, d[1])
            return e, claim
        raise ValueError(
            f"the override table is full near this key ({self.novr} entries): remove overrides, "
            f"or create the keyed limiter with a larger overrides="
        )

    def set(self, d: Tuple[int, int], rate: Rate, over: object = ANY) -> bool:
        """Give digest ``d`` the rate ``rate``.  ``OVR_LIVE`` may count too many (the composite then
        probes for nothing) but never too few: it counts an override before it can be in force,
        and takes the count back only where it never was.

        With ``over`` (the override a decision was computed from, None: none), only if that is
        still ``d``'s override under the lock: False, nothing written, when another change came
        first (the key's adaptive rate: a ``set_rate(key=)`` or a removal meanwhile stands)."""
        if not self.novr:
            raise ValueError(
                "this keyed limiter was created with overrides=0: it has no room for per-key rates"
            )
        c = self.c
        lock = config_lock(c)
        e, claimed, counted = 0, 0, False
        try:
            with lock:
                if over is not ANY and self._rate(d, lock.seq) != over:
                    return False
                while True:
                    e = self._find(d, claimed=True)
                    if e is None:
                        e, claimed = self._claim(d, lock)
                        counted = True
                        break
                    ctl = c.load(e + K.O_CTRL)
                    if K.o_state(ctl) == K.O_CLAIM:
                        # claimed for this key, never made LIVE: ours now, by CAS (its claimer, if it
                        # is late, then neither publishes it nor gives it back)
                        claimed = self._take(e, ctl, lock) or 0
                        if not claimed:
                            continue
                        counted = True
                        break
                    if K.o_state(ctl) == K.O_LIVE:
                        vals = self._vals(e, lock.seq)
                        counted = vals is None or not vals[3]  # it was removed
                        break
                if counted:
                    c.fetch_add(K.OVR_LIVE, 1)
                lock.write_banks(BANKS, bank_offsets(*self._banks(e)), d, bank_values(rate))
        finally:
            if lock.published and claimed and self._vals(e, lock.gen) is None:
                lock.published = (
                    False  # interrupted before a bank was whole: this entry never goes LIVE
                )
            if not lock.published:
                if counted:
                    c.fetch_add(K.OVR_LIVE, KC.MASK64)  # -1
                if claimed:  # our own claim goes back (unless a newer writer took it)
                    c.cas(e + K.O_CTRL, claimed, K.o_ctrl(K.O_TOMB, 0, lock.gen))
            elif claimed and not c.cas(e + K.O_CTRL, claimed, K.o_ctrl(K.O_LIVE, 0, lock.gen)):
                c.fetch_add(K.OVR_LIVE, KC.MASK64)  # another made it LIVE, and counted it
        if over is ANY and lock.published:
            # an operator's rate: the key's adaptive window starts afresh, as after a removal
            # (grants made at the old rate, judged at the new, would read as a busy window)
            c.cas(e + K.A_OWNER, d[0], 0)
        return True

    def remove(self, d: Tuple[int, int]) -> bool:
        c = self.c
        with config_lock(c) as lock:
            e = self._find(d) if self.novr else None
            if e is None:
                return False
            vals = self._vals(e, lock.seq)
            if vals is not None and not vals[3]:
                return False
            lock.write_banks(BANKS, bank_offsets(*self._banks(e)), d, bank_values(None))
        # the key starts again from the default, its adaptive window too: the entry is no key's
        # (``keyed.adapt.report`` begins a window afresh in an entry another key, or none, held;
        # only if still its: another key may own it by now)
        c.cas(e + K.A_OWNER, d[0], 0)
        if vals is not None:
            c.fetch_add(K.OVR_LIVE, KC.MASK64)
        return True

    def entry(self, d: Tuple[int, int]) -> Optional[int]:
        """The offset of digest ``d``'s LIVE entry (its rate perhaps removed), None if it has
        none: where a key's adaptive rate keeps its window (``keyed.adapt``)."""
        return self._find(d) if self.novr else None

    def peek(self, d: Tuple[int, int]) -> Optional[Tuple[int, ...]]:
        """The values (RATE PER BURST T TAU) of digest ``d``'s override for display, without
        waiting for a writer; None when it has none (or none of its banks is valid)."""
        e = self._find(d) if self.novr else None
        return None if e is None else self._peek_entry(e)

    def _peek_entry(self, e: int) -> Optional[Tuple[int, ...]]:
        vals = self._vals(e, self.c.load(K.CFG_SEQ) & ~1)
        if not vals or not vals[3]:
            return None
        # a rate no writer stores (not finite, or not above 0) is corrupt: none, as a bad checksum
        r = rate_of(vals)
        return vals if all(0 < x < math.inf for x in (r.rate, r.per, r.burst)) else None

    def peek_all(self) -> Iterator[Tuple[Tuple[int, int], Tuple[int, ...]]]:
        """Every live override, for display (a private copy's: ``keyed.stats``): its digest and
        its values (RATE PER BURST T TAU), without waiting for a writer."""
        c = self.c
        for i in range(self.novr):
            e = self.base + i * K.OVR_LINES * K.LINE
            if K.o_state(c.load(e + K.O_CTRL)) != K.O_LIVE:
                continue
            vals = self._peek_entry(e)
            if vals is not None:
                yield (c.load(e + K.O_D0), c.load(e + K.O_D1)), vals
