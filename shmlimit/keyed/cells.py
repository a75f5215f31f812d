"""The atomic layer's keyed composite: find, insert or evict a key's slot, then one GCRA step.

This is the reference version, built from the four primitives of ``cells``;
the native backend does the same steps in one C call (the "KEYED TABLE" block
of ``_native.c``).  The two must stay step-for-step equivalent: the property
tests run against both.

**The slot protocol** (insert, lookup, evict, reuse) is independent of what
the value words mean, with one contract: ``V0`` is the value's *expiry word*.

1. A slot whose ``V0 <= now`` holds no information (for GCRA: the key's bucket
   is full again) and may be evicted; ``V0``'s top bit (``DEAD``) marks it
   evicted and keeps the stored word below it.  ``V0`` is stored plus the
   slot's ``BASE``, fixed for as long as one tenant holds the slot; a value kind
   reads and CASes the stored word and works on the word less ``BASE``.  The
   stored words a reader may act on -- those ``V0`` held under a LIVE ``CTRL``
   -- only ever increase over a slot's whole life: an inserter chooses its
   ``BASE`` so that the stored word of every value its key may take (all at or
   after the ``now`` it inserts at) lies above the slot's *floor*, the last word
   the slot held (``DEAD`` stripped), and a value kind only moves it forward --
   but for GCRA's ``undo``, which moves it back to where its own take found it
   (never below that ``now``), and only while no one has taken since.  So a CAS
   on ``V0`` from a word read under one tenant never succeeds under a later one:
   no ABA.  And since the new tenant's *values* start from the clock, not from
   the floor, a new key never starts from another key's state -- an evicted
   key's or a dead inserter's: keys never share state.  ``BASE`` grows only by
   what the slot's last word lies above the new tenant's least value (for GCRA
   the remaining debt of a key evicted while limited; for a window counter,
   whose first value is its least, what the old window ends after the new
   one's), and shrinks again as the clock passes what the slot held.  A slot
   whose ``BASE`` would pass ``BASE_MAX`` is passed by for the next of the
   window; with no other, the new key is refused (``WORN``).
2. **Lookup**: probe at most ``probe`` slots from the key's home slot
   (``D0 * nslots >> 64``); an EMPTY slot ends the chain (a slot never becomes
   EMPTY again, and an inserter takes the first free slot it sees).
3. **Insert**: take the first EMPTY, TOMB, expired LIVE (CAS ``V0 -> V0|DEAD``
   first, then CAS ``CTRL``) or dead inserter's slot; ``CTRL -> BUSY(me)``,
   write the digest, ``BASE`` and the fresh values, ``-> PEND(me)``, then re-scan the
   window: another PEND or LIVE slot with the same digest means a concurrent
   insert of the same key.  Of two PENDs, the one nearer the home slot wins and
   the farther one gives way (TOMB); a later PEND always sees an earlier one,
   so exactly one survives.  Then ``-> LIVE``.  An inserter that dies leaves a
   BUSY/PEND slot with its pid, which any later inserter reclaims once the pid
   is dead (``alive``: gone or a zombie).  One that gives way leaves TOMB with
   its floor, flagged ``DEAD``.
4. **A full window** (no free or expired slot among the ``probe`` slots):
   with ``evict`` (``when_full="evict"``, the default) the live key whose
   ``V0`` less ``BASE`` is least -- the one nearest to holding no information,
   for GCRA the one nearest to a full bucket -- is evicted through the same
   door (CAS of the very stored word that was compared, so a key used
   meanwhile is not evicted: the insert looks again), and counted in ``CUT``.
   Without it, only a slot whose ``V0 <= now`` is ever taken, so a key that is
   still limited is never lost, and the new key is refused (``FULL``).

**The value kind GCRA**: ``V0`` = the key's TAT (theoretical arrival time,
ticks) under a burst of ``MAX_TICKS``, whatever its price: under its own
tolerance ``TAU`` its TAT is that less ``MAX_TICKS - TAU``.  So the word
holds the instant the key's bucket was last empty (plus ``MAX_TICKS``, which
keeps it positive), and its level at ``now`` is the time since, at most its
``TAU``: it needs no price to be read, and a change of price (``set_rate``,
an override set or removed) keeps each key's level in seconds of schedule,
cut to the new burst, as a ``Limiter``'s bucket keeps its own.  A step
priced by a config read before a change is a step under that config, on a
word that means the same under both: no interleaving re-reads old debt under
a new burst.  A key is expired once its TAT under its own price (read after
``V0``: ``expiry``) is past.
``V1`` = grants for that key, ``V3 V4`` = the key's first bytes for display
(only with ``store_keys``).  An evicted key is as absent: its next request
finds a full bucket.  So eviction grants a key at most the debt its entry
still held (``(TAT - now) / T`` ops), and only a key whose entry held the least
debt of its window; ``when_full="refuse"`` never grants that.
A request of ``n`` ops at ``now`` is granted iff
``max(TAT, now) + n*T - now <= TAU + max_wait``; the TAT then moves there by
CAS.  Grants in any window of length W are at most ``W/T + TAU/T``.  ``push``
(a pause) raises a key's TAT in one CAS; it has no native twin and runs here
over either backend's cells, on the same words.
"""

from __future__ import annotations

import functools
import os
import time
from typing import Callable, Dict, Optional, Tuple, TypeVar

from shmlimit.errors import SegmentError
from shmlimit.keyed import layout as K
from shmlimit.protocol import key_bytes
from shmlimit.shm.banks import BankCode
from shmlimit.shm.table import is_alive

MASK64 = (1 << 64) - 1
T = TypeVar("T")
REFUSED = -1  #: the wait exceeds max_wait: nothing written
NEVER = -(1 << 62)  #: n exceeds the burst: never grantable
FULL = NEVER - 1  #: no slot for a new key (every slot of its window holds a limited key)
#: Another live process's insert of the same key has not moved for ``PEND_NS``: nothing taken.
BUSY = NEVER - 2
#: No slot for a new key but for their ``BASE``: each slot of its window that could be had would
#: lift its ``BASE`` past ``BASE_MAX`` (see ``SlotTable.insert``); it passes as the clock does.
WORN = NEVER - 4
#: A config lock held this long (ns) was left by a dead writer: readers close it, and a writer
#: takes it over (``keyed.gcra.config_lock``).
LOCK_NS = 200_000_000
#: An inserter waits this long (ns) at most for a farther PEND of the same key to give way.  Its
#: owner normally does within microseconds; one that is alive but never runs (stopped by SIGSTOP,
#: a frozen container) or a PEND written into the segment by hand would hold every insert of that
#: key forever -- ``try_acquire`` included, uninterruptibly in the native call.  So past this
#: the waiter gives way itself (TOMB) and answers ``BUSY``: no insert survives twice, nothing is
#: taken, and the caller decides (a try or a timed call refuses, an untimed one tries again).
PEND_NS = 200_000_000
#: An untimed call (of any keyed kind) whose key's insert is held by a stalled inserter (``BUSY``, after
#: ``PEND_NS`` of waiting inside the call) tries again after this nap (seconds), back in Python
#: each time so that a signal can interrupt it.
BUSY_NAP = 0.001
MAX_WAIT = 1 << 60
#: keyed_table's flags: when a key's window is full, evict its least valuable key (else refuse)...
FLAG_EVICT = 1
#: ... and keep each key's first bytes in its slot, for ``top`` and ``inspect`` (else none).
FLAG_STORE_KEYS = 2
WHEN_FULL = ("evict", "refuse")


def table_flags(when_full: object = "evict", store_keys: object = False) -> int:
    """A table's flags from its users' options; ValueError names a bad one.

    ``when_full``: "evict" (a new key takes the slot of the least valuable key of
    its window when none is free) or "refuse" (the new key is refused, as
    ``KeyTableFullError``, until a slot of its window frees).  ``store_keys``:
    keep each key's first bytes in its slot for ``top`` and ``inspect``.
    """
    if when_full not in WHEN_FULL:
        raise ValueError(f'when_full must be "evict" or "refuse", got {when_full!r}')
    if not isinstance(store_keys, bool):
        raise ValueError(f"store_keys must be True or False, got {store_keys!r}")
    return (FLAG_EVICT if when_full == "evict" else 0) | (FLAG_STORE_KEYS if store_keys else 0)


def _sipround(v0: int, v1: int, v2: int, v3: int, r: int) -> Tuple[int, int, int, int]:
    """``r`` SipRounds, the rotations written out (a call per rotation cost most of a hash)."""
    m = MASK64
    for _ in range(r):
        v0 = (v0 + v1) & m
        v1 = ((v1 << 13) | (v1 >> 51)) & m ^ v0
        v0 = ((v0 << 32) | (v0 >> 32)) & m
        v2 = (v2 + v3) & m
        v3 = ((v3 << 16) | (v3 >> 48)) & m ^ v2
        v0 = (v0 + v3) & m
        v3 = ((v3 << 21) | (v3 >> 43)) & m ^ v0
        v2 = (v2 + v1) & m
        v1 = ((v1 << 17) | (v1 >> 47)) & m ^ v2
        v2 = ((v2 << 32) | (v2 >> 32)) & m
    return v0, v1, v2, v3


def siphash128(data: bytes, k0: int, k1: int) -> Tuple[int, int]:
    """SipHash-2-4 with a 128-bit output: the same function as the native backend's."""
    v0 = 0x736F6D6570736575 ^ k0
    v1 = 0x646F72616E646F6D ^ k1 ^ 0xEE
    v2 = 0x6C7967656E657261 ^ k0
    v3 = 0x7465646279746573 ^ k1
    n = len(data)
    end = n - n % 8
    for i in range(0, end, 8):
        m = int.from_bytes(data[i : i + 8], "little")
        v0, v1, v2, v3 = _sipround(v0, v1, v2, v3 ^ m, 2)
        v0 ^= m
    b = ((n & 0xFF) << 56) | int.from_bytes(data[end:], "little")
    v0, v1, v2, v3 = _sipround(v0, v1, v2, v3 ^ b, 2)
    v0, v1, v2, v3 = _sipround(v0 ^ b, v1, v2 ^ 0xEE, v3, 4)
    d0 = v0 ^ v1 ^ v2 ^ v3
    v0, v1, v2, v3 = _sipround(v0, v1 ^ 0xDD, v2, v3, 4)
    return d0, v0 ^ v1 ^ v2 ^ v3


#: The digests a table's Python path keeps per process (its recent keys), at most.
DIGESTS_KEPT = 4096


def hasher(cells: object, k0: int, k1: int) -> Callable[[bytes], Tuple[int, int]]:
    """The keyed digest of any bytes for paths over ``cells``: the native extension's SipHash on
    the native backend; the portable one otherwise, remembering the digests of its last
    ``DIGESTS_KEPT`` keys (a hash in Python cost 30 of a keyed try's 45 us on a live key)."""
    if getattr(cells, "backend", None) == "native":
        from shmlimit.shm._native import siphash128 as native

        return lambda data: native(data, k0, k1)
    kept: Dict[bytes, Tuple[int, int]] = {}

    def digest(data: bytes) -> Tuple[int, int]:
        d = kept.get(data)
        if d is None:
            if len(kept) >= DIGESTS_KEPT:
                kept.clear()  # a new generation: live keys come back at their next call
            d = kept[data] = siphash128(data, k0, k1)
        return d

    return digest


#: A bank's words in the order ``shm.banks.BankCode`` reads them: its values, then GEN and SUM.
_BANK_WORDS = (*K.B_VALUES, K.B_GEN, K.B_SUM)
#: The keyed banks' code: the checksum covers the digest, then T TAU RATE PER BURST.
BANKS = BankCode((3, 4, 0, 1, 2))


@functools.lru_cache(maxsize=4096)  # read on every call: the default's, and each override's
def bank_offsets(a: int, b: int) -> Tuple[Tuple[int, ...], Tuple[int, ...]]:
    """The offsets of the words (``_BANK_WORDS``) of a config's two banks, at lines ``a`` and ``b``."""
    return tuple(a + off for off in _BANK_WORDS), tuple(b + off for off in _BANK_WORDS)


def pick(c, lines: Tuple[int, int], d: Tuple[int, int], seq: int) -> Optional[Tuple[int, ...]]:
    """The values of the config whose two banks are at ``lines``, for digest ``d``: its valid bank
    of the newest generation, counted back from ``seq`` (``BankCode.pick``); None if none is."""
    got = BANKS.pick(c.load_many, bank_offsets(*lines), d, seq)[1]
    return None if got is None else got[1]


def consistent(c, seq: int, read: Callable[..., T], *args: object) -> T:
    """``read(*args, s)`` under an even ``s`` of the config sequence word at ``seq`` that still holds it
    after: a config as one writer published it, never words of two.

    A writer holds the word odd for microseconds; one that stays odd for
    ``LOCK_NS`` (its writer died) is closed by CAS to the next even value,
    modulo 2**64, as the native composite's readers close it: a writer killed
    in ``set_rate`` never hangs a reader (the default rate, an override, a
    process opening with ``rate=``).  The composite's ``params`` and every
    Python reader of a keyed config (``keyed.gcra``) read through here.
    """
    seen, since = 0, 0
    while True:
        s = c.load(seq)
        if s & 1:
            now = time.monotonic_ns()
            if s != seen:
                seen, since = s, now
            elif now - since > LOCK_NS:
                c.cas(seq, s, (s + 1) & MASK64)
            os.sched_yield()
            continue
        got = read(*args, s)
        if c.load(seq) == s:
            return got


def display_words(data: bytes) -> Tuple[int, int]:
    """V3 V4 of a key stored for display (``store_keys``): its length + 1 (at most 255), then its
    first ``DISPLAY_BYTES`` bytes.  A slot without them holds zeros."""
    b = bytes([min(len(data), 254) + 1]) + data[: K.DISPLAY_BYTES]
    b = b.ljust(16, b"\0")
    return int.from_bytes(b[:8], "little"), int.from_bytes(b[8:], "little")


def display_key(words: Tuple[int, ...], digest: int = 0) -> str:
    """The key as stored for display (its first bytes; '...' when it was longer); a key stored
    without them (the default) shows as ``#`` and the first 8 hex digits of its keyed digest,
    which tells keys apart without revealing them."""
    b = b"".join(w.to_bytes(8, "little") for w in words[:2])
    if not b[0]:
        return f"#{digest >> 32:08x}"
    n = b[0] - 1
    text = b[1 : 1 + min(n, K.DISPLAY_BYTES)].decode("utf-8", "replace")
    return text + ("..." if n > K.DISPLAY_BYTES else "")


def alive(owner: int, mine: int) -> bool:
    """Whether an inserter may still be running: ``shm.table.is_alive`` (a zombie is dead), for an
    owner field.  The native backend calls this very function.

    An owner field is ``pid | namespace tag << 22`` (see ``keyed.layout.owner``):
    an inserter of another PID namespace cannot be asked about, so it counts as
    alive -- taking a live inserter's slot would let its late stores land on
    the next tenant.  The field holds no start time: a pid reused since the
    inserter died counts as alive (its slot waits for that process to end).
    """
    if owner >> K.PID_BITS != mine >> K.PID_BITS:
        return True
    pid = owner & ((1 << K.PID_BITS) - 1)
    return is_alive(pid, 0)


def _ticks_now() -> int:
    """CLOCK_MONOTONIC in ticks."""
    return time.monotonic_ns() << K.TICK_SHIFT


def check_offsets(cells, *offsets: int) -> None:
    """Refuse an offset that is not an aligned word of the mapping (IndexError), whatever the backend."""
    for off in offsets:
        if (
            isinstance(off, bool)
            or not isinstance(off, int)
            or off % 8
            or not 0 <= off <= cells.size - 8
        ):
            raise IndexError(
                f"offset {off!r} is not an aligned word inside the mapping of {cells.size} bytes"
            )


def _worn(floor: int, low: int) -> bool:
    """Whether a slot whose last word was ``floor`` (``DEAD`` or not) would lift the ``BASE`` of a
    tenant whose values are all at least ``low`` past ``BASE_MAX``: such a slot is passed by."""
    return (floor & ~K.DEAD) - low >= K.BASE_MAX


class SlotTable:
    """The slot protocol alone (lookup, insert, eviction, reuse), for any value kind.

    A value kind (GCRA here; fixed-window or sliding-window counters for a
    ``limits`` storage) uses ``find`` and ``insert`` and defines what
    ``V0 V1 V3 V4`` mean, under the one contract above: ``V0`` is the expiry
    word, stored plus the slot's ``BASE``, its values only ever increase, and a
    slot whose ``V0 <= now`` may be evicted.  Updates of the values go through
    CAS on the stored ``V0`` (``BASE`` + the value) after checking that ``CTRL``
    still holds the LIVE word ``find`` returned.

    ``evict``: when no slot of a new key's window is free or expired, evict the
    live key whose ``V0`` is least (nearest to holding no information) instead
    of refusing the new key (``when_full="evict"``, the default).
    """

    def __init__(
        self,
        cells,
        slots: int,
        nslots: int,
        probe: int,
        keys_live: int,
        evicted: int,
        pid: int,
        cut: Optional[int] = None,
        evict: bool = True,
        stride: int = K.LINE,
    ) -> None:
        # ``stride``: bytes from one slot to the next -- a slot's line, then (a moving-window log)
        # words of its own that only its tenant uses
        if (
            slots % 8
            or stride % K.LINE
            or stride < K.LINE
            or slots + nslots * stride > cells.size
            or not nslots
            or not probe
            or probe > nslots
        ):
            raise IndexError("keyed_table: a region lies outside the mapping")
        check_offsets(cells, keys_live, evicted, *(() if cut is None else (cut,)))
        self.c = cells
        self.slots, self.nslots, self.probe, self.stride = slots, nslots, probe, stride
        self.keys_live, self.evicted, self.pid = keys_live, evicted, pid
        self.cut, self.evict = (evicted if cut is None else cut), bool(evict)

    def _slot(self, home: int, i: int) -> int:
        return self.slots + ((home + i) % self.nslots) * self.stride

    def find(self, d: Tuple[int, int], home: int):
        c, slots, nslots, stride = self.c, self.slots, self.nslots, self.stride
        for i in range(self.probe):
            s = slots + ((home + i) % nslots) * stride  # ``_slot``, inline on the hot path
            ctl = c.load(s)
            state = ctl & 0xFF
            if state == K.EMPTY:
                return None, 0
            if (
                state == K.LIVE
                and c.load(s + K.S_D0) == d[0]
                and c.load(s + K.S_D1) == d[1]
                and not c.load(s + K.S_V0) & K.DEAD
            ):
                return s, ctl
        return None, 0

    def vacancy(self, d: Tuple[int, int], now: int) -> int:
        """How long (in ``V0``'s units) until a slot of digest ``d``'s window can be had: 0 when
        ``d`` holds one or one is free now, else the earliest expiry among its LIVE keys (0 as
        well when inserts in flight are all it holds: they resolve within ``PEND_NS``).  Reads only."""
        c, home, soonest = self.c, (d[0] * self.nslots) >> 64, None
        for i in range(self.probe):
            s = self._slot(home, i)
            ctl = c.load(s)
            state = ctl & 0xFF
            if state in (K.EMPTY, K.TOMB):
                return 0
            if state != K.LIVE:
                if not alive((ctl >> 8) & 0xFFFFFFFF, self.pid):
                    return 0
                continue
            got = self.value(s, ctl)
            if got is None:
                return 0  # evicted or gone since: its slot is being had now
            v = self.expiry(s, got[0])
            if v <= now or (c.load(s + K.S_D0), c.load(s + K.S_D1)) == d:
                return 0
            soonest = v - now if soonest is None else min(soonest, v - now)
        return soonest or 0

    def expiry(self, s: int, v: int) -> int:
        """When slot ``s``'s value ``v`` (``V0`` less ``BASE``, just loaded) expires, in the units
        of ``now``: ``v`` itself here.  A value kind whose expiry depends on its config reads
        that config after loading ``v`` (so it is never older than the one ``v`` was written under)."""
        return v

    def value(self, s: int, ctl: int) -> Optional[Tuple[int, int]]:
        """``(V0, BASE)`` of slot s while it holds the tenant of LIVE word ``ctl``: the value is the
        stored word less BASE; None when the tenant is evicted or gone (look again)."""
        c = self.c
        base = c.load(s + K.S_BASE)
        raw = c.load(s + K.S_V0)
        if raw & K.DEAD or c.load(s) != ctl:
            return None
        return raw - base, base

    def visit(
        self,
        d: Tuple[int, int],
        home: int,
        step: Callable[..., T],
        absent: T,
        insert: Optional[Tuple[object, ...]] = None,
        refused: int = 0,
    ) -> "T | int":
        """``step(s, v, base)`` on the value of digest ``d`` -- its slot, ``V0`` less ``BASE``, and
        ``BASE`` -- until it answers (None: read it again).  ``absent`` when the table holds no such
        key; with ``insert`` (``insert``'s arguments after ``d`` and ``home``), that key is inserted
        with those values first: the insert is its step, answered ``absent``, or else ``FULL``
        (counted in the word at ``refused``) or ``BUSY``, nothing written.  A value kind's one
        loop but for GCRA's ``acquire`` (the native composite's twin, inline)."""
        while True:
            s, ctl = self.find(d, home)
            if s is None:
                if insert is None:
                    return absent
                s, ctl = self.insert(d, home, *insert)  # type: ignore[arg-type]
                if s is None:
                    if ctl != BUSY:
                        self.c.fetch_add(refused, 1)
                    return ctl or FULL
                if ctl:
                    return absent
                os.sched_yield()  # lost a race, often to an insert of the same key: let it finish
                continue
            while True:
                got = self.value(s, ctl)
                if got is None:
                    break
                answer = step(s, *got)
                if answer is not None:
                    return answer

    def insert(
        self,
        d: Tuple[int, int],
        home: int,
        now: int,
        v0: int,
        rest: Tuple[int, int, int],
        fill: Optional[Callable[[int, int], None]] = None,
        low: Optional[int] = None,
    ):
        """Insert digest d with its first values: V0 = v0 (>= ``low``), V1 V3 V4 = rest.

        ``low`` (default ``now``) is the least value the new tenant's ``V0`` ever takes.

        The new tenant's BASE is what lifts its stored V0 above every word the
        slot held before (``floor``), so it never starts from another key's
        values.  ``fill(slot, gen)``, if given, writes the slot's words beyond
        its line (a stride above ``LINE``) while the slot is claimed (BUSY, its
        new generation ``gen``): nobody reads them before it is published.  Returns (slot, ctrl): ctrl is the LIVE word when we published (the
        grant is made), 0 means "look again"; slot None means the window is full
        (ctrl 0), or (ctrl ``WORN``) that its only slots to be had would lift
        ``BASE`` past ``BASE_MAX`` (a slot that would is passed by for the next),
        or (ctrl ``BUSY``) that a farther PEND of the same key stayed unchanged
        under a live owner for ``PEND_NS`` and we gave way.
        """
        c = self.c
        low = now if low is None else low
        cand, cc, pos, cv = None, 0, 0, 0
        victim, least, worn = None, 0, False
        for i in range(self.probe):
            s = self._slot(home, i)
            ctl = c.load(s)
            state = ctl & 0xFF
            if (
                state == K.LIVE
                and c.load(s + K.S_D0) == d[0]
                and c.load(s + K.S_D1) == d[1]
                and not c.load(s + K.S_V0) & K.DEAD
            ):
                return s, 0
            if cand is not None:
                if state == K.EMPTY:
                    break
                continue
            if state == K.LIVE:
                base = c.load(s + K.S_BASE)
                v = c.load(s + K.S_V0)
                if c.load(s) != ctl:
                    return s, 0  # it changed tenant while we read it: look again
                if v & K.DEAD or self.expiry(s, v - base) <= now:
                    if _worn(v, low):
                        worn = True
                    else:
                        cand, cc, pos, cv = s, ctl, i, v
                elif self.evict and (victim is None or v - base < least):
                    if _worn(v, low):
                        worn = True
                    else:
                        victim, least = (s, ctl, i, v), v - base
            elif state in (K.EMPTY, K.TOMB) or not alive((ctl >> 8) & 0xFFFFFFFF, self.pid):
                # a free slot (or a dead inserter's) -- unless its floor would lift BASE too far
                if _worn(c.load(s + K.S_V0), low):
                    worn = True
                else:
                    cand, cc, pos = s, ctl, i
            if state == K.EMPTY:
                break
        limited = False
        if cand is None:
            # Full: the least valuable live key (its V0 least, so nearest to holding nothing) gives
            # up its slot.  WORN: a slot could be had but for its BASE.
            if victim is None:
                return None, WORN if worn else 0
            cand, cc, pos, cv = victim
            limited = True
        state, gen = cc & 0xFF, (cc >> 40) + 1
        if state == K.LIVE and not cv & K.DEAD and not c.cas(cand + K.S_V0, cv, cv | K.DEAD):
            return cand, 0  # it was used meanwhile: look again
        mine = K.ctrl(K.BUSY, self.pid, gen)
        if not c.cas(cand, cc, mine):
            return cand, 0
        # From the claim on, the slot is ours alone (BUSY, then PEND, under this live process): an
        # exception raised into this code (a signal handler's) would leave it so while we live --
        # lost, and a PEND of the key answering every other insert of it BUSY -- so it gives the
        # slot back as a PEND that gives way does (the native insert runs no Python code here).
        held, floor = mine, None
        try:
            if state == K.LIVE:
                c.fetch_add(self.keys_live, MASK64)  # -1
                c.fetch_add(self.evicted, 1)
                if limited:
                    c.fetch_add(self.cut, 1)
            c.store(cand + K.S_D0, d[0])
            c.store(cand + K.S_D1, d[1])
            c.store(cand + K.S_V1, rest[0])
            c.store(cand + K.S_V3, rest[1])
            c.store(cand + K.S_V4, rest[2])
            if fill is not None:
                fill(cand, gen)
            floor = c.load(cand + K.S_V0) & ~K.DEAD
            if _worn(floor, low):  # a floor the scan did not see (written by hand): passed by next
                return self._abort(cand, mine, gen, floor)
            base = floor + 1 - low if floor >= low else 0
            c.store(cand + K.S_BASE, base)
            c.store(cand + K.S_V0, v0 + base)
            pend = K.ctrl(K.PEND, self.pid, gen)
            if not c.cas(cand, mine, pend):
                return cand, 0
            held = pend
            for i in range(self.probe):
                if i == pos:
                    continue
                s = self._slot(home, i)
                seen, since = 0, 0
                while True:
                    ctl = c.load(s)
                    st = ctl & 0xFF
                    if st == K.EMPTY:
                        return self._publish(cand, pend, gen)
                    if (
                        st not in (K.LIVE, K.PEND)
                        or c.load(s + K.S_D0) != d[0]
                        or c.load(s + K.S_D1) != d[1]
                    ):
                        break
                    if st == K.LIVE:
                        if c.load(s + K.S_V0) & K.DEAD:
                            break
                        return self._abort(cand, pend, gen, floor)
                    if not alive((ctl >> 8) & 0xFFFFFFFF, self.pid):  # (its slot may be worn out)
                        c.cas(s, ctl, K.ctrl(K.TOMB, 0, ctl >> 40))
                        continue
                    if i < pos:  # a PEND nearer the home slot wins: ours gives way
                        self._abort(cand, pend, gen, floor)
                        return self._await_move(s, ctl)
                    # it will see ours and give way -- unless its owner never runs again: bounded
                    t_ns = time.monotonic_ns()
                    if ctl != seen:
                        seen, since = ctl, t_ns
                    elif t_ns - since > PEND_NS:
                        self._abort(cand, pend, gen, floor)
                        return None, BUSY
                    os.sched_yield()
            return self._publish(cand, pend, gen)
        except BaseException:
            if c.load(cand) == held:  # (published: LIVE, the grant made -- it stays)
                self._abort(cand, held, gen, c.load(cand + K.S_V0) if floor is None else floor)
            raise

    def _await_move(self, s: int, ctl: int):
        """After giving way to a nearer PEND of the same key under a live owner: wait, holding
        nothing, until it moves (LIVE, or given way) -- its owner publishes within microseconds --
        but at most ``PEND_NS``: an owner that never runs again would have every insert of the key
        give way and try again without end.  ``(s, 0)``: look again; ``(None, BUSY)``: it did not move."""
        since = time.monotonic_ns()
        while self.c.load(s) == ctl:
            if time.monotonic_ns() - since > PEND_NS:
                return None, BUSY
            os.sched_yield()
        return s, 0

    def _publish(self, cand: int, pend: int, gen: int):
        live = K.ctrl(K.LIVE, 0, gen)
        if not self.c.cas(cand, pend, live):
            return cand, 0
        self.c.fetch_add(self.keys_live, 1)
        return cand, live

    def _abort(self, cand: int, held: int, gen: int, floor: int):
        # never published: no reader holds our value, and the next tenant needs only the floor
        self.c.store(cand + K.S_V0, floor | K.DEAD)
        self.c.cas(cand, held, K.ctrl(K.TOMB, 0, gen))
        return cand, 0


class KeyedTable(SlotTable):
    """The value kind GCRA on the slot protocol: the reference version of the native ``KeyedTable``.

    ``V0`` = the key's TAT, ``V1`` = its grants, ``V3 V4`` = its first bytes for display when
    ``store_keys``.  The same arguments and the same answers as the native one; ``flags`` is
    ``FLAG_EVICT`` (when full, evict the least valuable key) | ``FLAG_STORE_KEYS``.
    """

    def __init__(
        self,
        cells,
        cfg: int,
        ovr_live: int,
        ovr: int,
        novr: int,
        slots: int,
        nslots: int,
        probe: int,
        k0: int,
        k1: int,
        keys_live: int,
        evicted: int,
        refused: int,
        grants: int,
        pid: int,
        cut: int,
        flags: int,
    ) -> None:
        super().__init__(
            cells, slots, nslots, probe, keys_live, evicted, pid, cut, bool(flags & FLAG_EVICT)
        )
        self.store_keys = bool(flags & FLAG_STORE_KEYS)
        for off, lines in ((cfg, K.DEFAULT_BACKUP_LINES + 1), (ovr, novr * K.OVR_LINES)):
            if off % 8 or off + lines * K.LINE > cells.size:
                raise IndexError("keyed_table: a region lies outside the mapping")
        check_offsets(cells, ovr_live, refused, grants)  # any backend's cells (``push``)
        self.cfg, self.ovr_live, self.ovr, self.novr = cfg, ovr_live, ovr, novr
        self._default = (cfg, cfg + K.DEFAULT_BACKUP_LINES * K.LINE)
        self._hash = hasher(cells, k0, k1)
        self.refused, self.grants = refused, grants

    def digest(self, key: object) -> Tuple[int, int]:
        return self._hash(key_bytes(key))

    def params(self, d: Tuple[int, int]) -> Tuple[int, int]:
        """(T, TAU) for digest d under a consistent config (``consistent``): the key's override if
        it has one, else the default, each from its valid bank of the newest generation.

        No valid bank under a ``CFG_SEQ`` that stayed even is a corrupt segment:
        ``SegmentError`` (a writer leaves one bank of each config whole).
        """
        vals = consistent(self.c, self.cfg, self._config, d)  # (no closure: the hot path)
        if vals is None:
            raise SegmentError(
                "keyed segment is corrupt: no copy of its config passes its checksum"
            )
        return (vals[3] or 1), min(
            vals[4], K.MAX_TICKS
        )  # a segment written by hand: a smaller burst

    def _config(self, d: Tuple[int, int], seq: int) -> Optional[Tuple[int, ...]]:
        """The values in force for digest d at ``seq``: its override's, unless it has none or it
        was removed (T == 0), else the default's; None when that config has no valid bank."""
        c = self.c
        if self.novr and c.load(self.ovr_live):
            home = (d[1] * self.novr) >> 64
            for i in range(min(self.probe, self.novr)):
                e = self.ovr + ((home + i) % self.novr) * K.OVR_LINES * K.LINE
                ctl = c.load(e)
                if ctl == K.O_EMPTY:
                    break
                if (
                    ctl & 0xFF == K.O_LIVE
                    and c.load(e + K.O_D0) == d[0]
                    and c.load(e + K.O_D1) == d[1]
                ):
                    vals = pick(c, (e + K.O_BANKS[0], e + K.O_BANKS[1]), d, seq)
                    if vals is None or vals[3]:
                        return vals
                    break  # removed (T == 0): the default
        return pick(c, self._default, (0, 0), seq)

    def expiry(self, s: int, v: int) -> int:
        """The TAT of slot ``s``'s key (value ``v``) under its own price, read after ``v``: the
        key holds nothing once it is past.  (A price read before ``v`` could be older than the one
        ``v`` was written under, and a raised burst would then make a limited key look idle.)"""
        c = self.c
        d = (c.load(s + K.S_D0), c.load(s + K.S_D1))
        return v - (K.MAX_TICKS - self.params(d)[1])

    def acquire(self, key: object, n: int, max_wait: int, now: "int | None" = None) -> int:
        """Find or insert ``key``'s slot and take ``n`` ops if they fit ``max_wait`` ticks.

        Returns the wait in ticks (>= 0) after taking, ``REFUSED`` when the
        wait would exceed ``max_wait`` (nothing written), ``NEVER``, ``FULL`` or ``BUSY``.
        ``max_wait < 0`` peeks: the wait, taking and inserting nothing.
        """
        return self._step(key, n, max_wait, now, None)

    def take(self, key: object, n: int, max_wait: int, now: "int | None" = None):
        """``acquire`` (never a peek), answering also what ``undo`` needs when taken:
        ``(wait, slot, ctrl, tat, cost)``; a refusal is acquire's code (an int < 0)."""
        if max_wait < 0:
            raise ValueError("take: max_wait must be >= 0 ticks (a peek is acquire's)")
        taken: list = []
        r = self._step(key, n, max_wait, now, taken)
        return r if r < 0 else (r, *taken)

    def undo(self, slot: int, ctrl: int, tat: int, cost: int, n: int) -> bool:
        """Give a take back exactly if no one took the key since: its TAT still the one the take
        set, its slot still the take's tenant.  The TAT goes back to where the take found it
        (``max(TAT, now)`` then, which serves every later call as the TAT before it did), the
        counts lose ``n``.  False changes nothing: the take stays spent (time lost, never an
        extra grant).  A later tenant never holds ``tat`` (its values start above the instant
        the take's TAT had expired), so a stale undo never lands on it."""
        if not 0 <= slot < self.nslots or not 0 < cost <= tat:
            raise ValueError("undo: slot must be below the table's slots, 0 < cost <= tat")
        c = self.c
        s = self.slots + slot * K.LINE
        if c.load(s) != ctrl or not c.cas(s + K.S_V0, tat, tat - cost):
            return False
        c.fetch_add(s + K.S_V1, (-n) & MASK64)
        c.fetch_add(self.grants, (-n) & MASK64)
        return True

    def _step(
        self, key: object, n: int, max_wait: int, now: "int | None", taken: "list | None"
    ) -> int:
        data = key_bytes(key)
        if isinstance(n, bool) or not isinstance(n, int):
            raise TypeError(f"n must be a positive int (ops), not {type(n).__name__}")
        if n < 1:
            raise ValueError(f"n must be a positive int (ops), got {n}")
        # A clock read here may go stale while this thread is preempted: keys inserted meanwhile by
        # others look in use against it.  Before refusing a new key for a full table it is read
        # once more (a later ``now`` only ever makes a grant later, never earlier).
        reread = now is not None
        if now is None:
            now = _ticks_now()
        d = self._hash(data)
        t, tau = self.params(d)
        if n > tau // t:
            return NEVER
        cost = n * t
        slack = K.MAX_TICKS - tau  # V0 less BASE is the TAT under a burst of MAX_TICKS: see there
        maxw = 0 if max_wait < 0 else min(max_wait, MAX_WAIT)
        home = (d[0] * self.nslots) >> 64
        c = self.c
        disp = None
        while True:
            s, ctl = self.find(d, home)
            if s is None:
                if max_wait < 0:
                    return 0
                if disp is None:
                    disp = display_words(data) if self.store_keys else (0, 0)
                # a new key's bucket is full: n <= burst is granted at once, by the insert itself
                s, ctl = self.insert(d, home, now, now + cost + slack, (n, *disp), low=now + slack)
                if s is None and ctl == BUSY:
                    return BUSY
                if s is None:
                    later = _ticks_now()
                    if not reread and later > now:
                        reread, now = True, later
                        continue
                    c.fetch_add(self.refused, 1)
                    return FULL
                if ctl:
                    c.fetch_add(self.grants, n)
                    if taken is not None:
                        base = c.load(s + K.S_BASE)  # the tenant's, fixed while it holds the slot
                        taken.extend(
                            ((s - self.slots) // K.LINE, ctl, now + cost + slack + base, cost)
                        )
                    return 0
                os.sched_yield()  # lost a race (often to an insert of the same key): let it finish
                continue
            while True:
                got = self.value(s, ctl)
                if got is None:
                    break
                v, off = got
                tat = v - slack
                base = max(tat, now)
                wait = base + cost - now
                wait = wait - tau if wait > tau else 0
                if max_wait < 0:
                    return wait
                if wait > maxw:
                    return REFUSED
                new = base + cost + slack + off
                if c.cas(s + K.S_V0, v + off, new):
                    c.fetch_add(s + K.S_V1, n)
                    c.fetch_add(self.grants, n)
                    if taken is not None:
                        taken.extend(((s - self.slots) // K.LINE, ctl, new, cost))
                    return wait

    def push(self, key: object, until: int, now: "int | None" = None) -> int:
        """Hold ``key``'s next op until ``until`` (ticks): one move of its TAT, whatever the rate.

        The TAT is raised to ``until + TAU - T`` (never lowered): no op is granted
        before ``until``, one is at ``until``, and the key's rate follows, without
        a burst.  A new key is inserted holding it (no grant counted).  Constant
        work: a loop only on a lost race.  0 when done (or ``until <= now``),
        ``FULL`` or ``BUSY`` as ``acquire`` (nothing written).
        """
        data = key_bytes(key)
        if now is None:
            now = time.monotonic_ns() << K.TICK_SHIFT
        if until <= now:
            return 0
        d = self._hash(data)
        t, tau = self.params(d)
        target = until - t + K.MAX_TICKS  # the TAT until + TAU - T, as V0 holds it
        disp = display_words(data) if self.store_keys else (0, 0)
        first = (now, target, (0, *disp), None, now + K.MAX_TICKS - tau)  # no grant counted

        def step(s: int, tat: int, off: int) -> Optional[int]:
            # raised (never lowered) by one CAS; None: the word moved, read it again
            return 0 if tat >= target or self.c.cas(s + K.S_V0, tat + off, target + off) else None

        return self.visit(d, (d[0] * self.nslots) >> 64, step, 0, first, self.refused)

    def try_acquire(self, key: object, n: int = 1) -> bool:
        """True if ``n`` ops were taken now for ``key``; False changes nothing."""
        return self._step(key, n, 0, None, None) >= 0  # acquire's, one call fewer

    def rebind(self, grants: int, pid: int) -> None:
        """After fork: count this process's grants in its own word, and insert as itself."""
        check_offsets(self.c, grants)
        self.grants, self.pid = grants, pid
