"""The window-counter value kinds of the keyed slot table: fixed window, sliding window counter and
moving window.

These are the counters of the ``limits`` library's three strategies,
kept per key in the slot protocol of ``keyed_cells.SlotTable`` (lookup,
insert, exact eviction, reuse), and changed only by CAS through the atomic
layer (either backend).  Time is CLOCK_MONOTONIC in milliseconds, which every
process of the host shares; ``clock`` (nanoseconds) can be injected.

**Fixed window** (key ``F`` + key): ``V0 = end << 25 | count``.  ``incr``
moves ``V0`` by one CAS: within the window it adds to the count; once
``end <= now`` (or on a new key) a new window starts with ``end = now + W + 1 ms``
(the window is never shorter than asked).  So the count of a window is exactly
the number of increments linearized in it, whichever processes made them.

**Sliding window counter** (key ``S`` + W + key): a key's first hit starts
its first window; windows of length W follow on from it, and a key with no
hit for two windows starts afresh at its next hit (as ``limits``' Redis
storage keeps it).  The estimate is ``prev * (time left) / W + cur``.
``V0 = X << 25 | ROLLING << 24 | cur`` where the current window is
``[X - 2W, X - W)`` (the slot holds information until the *next* window
ends, so that is its expiry), and ``V1 = E << 25 | 1 << 24 | n`` records the
final count ``n`` of the window ending at ``E``.  A grant is one CAS of
``V0`` within its window, after reading ``V1`` between two equal reads of
``V0``; ``V1`` is never written while ``V0`` is in the same window and not
ROLLING, so the check and the increment are one atomic step.

Moving on takes three steps that anyone may complete: CAS ``V0`` to ROLLING
(this freezes the count), raise ``V1`` to the snapshot of the window being
left (``(X - W, 1, count)``; ``(now, 1, 0)`` for a fresh start), then CAS
``V0`` to the next window with count 0.  A process killed between them
stalls nobody: the next caller sees ROLLING and finishes the move from ``V0``
alone.  ``V1`` only ever *rises* (a CAS loop to the maximum, each CAS only
while ``V0`` still holds the ROLLING word), and its tag is an absolute time: a
late helper can only leave a smaller value, which changes nothing.  A helper
stalled past its key's eviction finds ``V0`` changed (marked ``DEAD`` before
the next tenant writes its ``V1``) and writes nothing more -- unless the next
tenant's first ``V1`` is the very word it loaded (the evicted key's window
start, count 0, read by an inserter whose clock lags the helper's by a
window or more).  A reader that finds a ``V1`` tag later than its window read
the clock before a helper did: it reads the clock again (it is then at least
as late).

Both kinds keep the slot protocol's contract: ``V0`` (stored plus the slot's
``BASE``: every word below is the value, the stored word less ``BASE``) only
ever increases over a slot's life (``clear``/``reset`` evict a key -- ``V0 |
DEAD``, then TOMB -- instead of lowering it, and a re-insert's ``BASE`` lifts it
above the old word), and ``V0 <= now`` (as ``now << 25 | 2**25 - 1``) exactly
when the key holds no information.  When every slot of a new key's window
holds a key counted in a live window, the table (``evict``, the default)
evicts the one whose ``V0`` is least: the window that ends first (the table
is not told the limits, so "furthest from its limit" cannot be judged).  That
key then starts a fresh window at its next hit: it gains at most the hits its
window had counted, and only as the window ending first of its 32 probed
slots.  With ``when_full="refuse"`` the new key is refused with
``KeyTableFullError`` (and counted) instead.

**Moving window** (key ``M`` + key; a slot of the table's moving-window region, each followed by
its log of ``R`` words, ``R`` a power of two): the exact sliding log of ``limits``' moving
window, one log entry per *grant* (its ``amount`` hits at one instant).  An entry is
``LAP << 63 | t << 20 | cum``: the grant's time ``t`` (in 1/32 ms, so that a hit leaves the
window within 31.25 us of its end, never before), the key's hits up to and including it
(``cum``, modulo 2**20), and the parity of its lap of the ring.  ``V0 = X << 25 | FULL << 24 | g``
(stored plus ``BASE``, as every kind's) holds the number of grants ``g`` (modulo 2**24; ``FULL``
once it reached ``R``) and the expiry ``X``, the first millisecond at which the newest grant is
out of the window.  The entries of grants ``g - R + 1 .. g - 1`` never change while ``V0`` says
``g``: a grant reads them (a binary search finds the newest one out of the window; the hits in
the window are the difference of two ``cum``), checks ``V0`` again, then writes entry ``g`` by
CAS over the entry of grant ``g - R`` (only one writer can), then moves ``V0`` on by CAS.  Anyone
who finds entry ``g`` written while ``V0`` still says ``g`` moves ``V0`` on for its writer, so a
writer killed between its two CASes stalls nobody and its grant is counted.  Times never go back
in a log (an entry's ``t`` is at least its predecessor's), and a grant is checked at the instant
it is logged: a clock read before the newest grant counts at that grant's time.  So every window
holds at most the limit, and so does every window counted (``cum`` never wraps in one).  A key
with ``R - 2`` grants in its window refuses the next one until the oldest leaves (the log holds no
more): exact while a key's grants in one window stay within ``R - 2``, never above its limit.

A new key's first grant is made by its insert, which writes the whole log while the slot is
claimed (``SlotTable.insert``'s ``fill``): entry 0 is the grant, every other word a *wipe*,
``LAP | TMAX << 20 | gen``, a time no grant has, tagged with the slot's new generation.  So no
entry of a previous tenant is ever read, and a previous tenant's writer that read ``V0`` before
the slot changed hands finds its ``V0`` CAS failing (``BASE`` lifted every stored word); its entry
CAS, the step before, lands only on a word equal to the one it read in the old log: never a wipe
(another generation), only a real entry of the same time unit, lap and count.  A full window
evicts (``when_full="evict"``) as for the other kinds the key whose ``V0`` less ``BASE`` is least:
the log whose newest grant is oldest, so whose window ends first.  That key starts a new log at
its next hit: it gains at most the hits its window still held, and only as the window ending
first of its probed slots; ``when_full="refuse"`` refuses the new key instead.

Limits: counts up to ``CMAX`` (16 777 215) per window -- a fixed window's
count saturates there and ``incr`` then answers ``OVER`` (above every
limit); a sliding-window limit above ``CMAX`` is a ``ValueError`` --,
a moving-window limit above ``MOVING_MAX`` (1 048 575) is a ``ValueError``, windows up to ``MAX_WINDOW_MS`` (about 1.1 years), and a monotonic clock
below 2**38 ms (8.7 years of uptime).
"""

from __future__ import annotations

import math
import time
from typing import Callable, Optional, Tuple

from shmlimit.errors import KeyTableFullError
from shmlimit.keyed import cells as KC
from shmlimit.keyed import layout as K
from shmlimit.protocol import KEY_MAX, key_bytes

CB = 24  #: count bits
CMAX = (1 << CB) - 1  #: the largest count a window holds
FLAG = 1 << CB  #: ROLLING in V0, the phase (1 = a window's final count) in V1
TSHIFT = CB + 1
TMAX = (1 << (63 - TSHIFT)) - 1  #: the largest time (ms) a word holds: V0's top bit is DEAD
OVER = 1 << 62  #: what ``incr`` answers once a window's count is saturated (above every limit)
MAX_WINDOW_MS = 1 << 35
_MAX_WINDOW_S = MAX_WINDOW_MS // 1000  #: the longest window a whole number of seconds gives
_MAX_NOW_MS = TMAX - 2 * MAX_WINDOW_MS - 2  #: the latest clock (ms) every window's end fits after
MOVING_MAX = (1 << 20) - 1  #: the largest moving-window limit (hits per window)
E_TSHIFT = 20  #: a log entry: LAP << 63 | t << 20 | cum, t in units of 1/32 ms
E_CUM = (1 << E_TSHIFT) - 1
E_TMAX = (1 << (63 - E_TSHIFT)) - 1  #: above every grant's time (a clock below 2**38 ms): wipes
E_LAP = 1 << 63
E_NS = 31_250  #: ns per unit of a log entry's time (1/32 ms): 2**43 of them are 8.7 years


def pack(t_ms: int, count: int, flag: bool = False) -> int:
    return t_ms << TSHIFT | (FLAG if flag else 0) | count


def unpack(v: int) -> Tuple[int, bool, int]:
    return (v & ~K.DEAD) >> TSHIFT, bool(v & FLAG), v & CMAX


def window_ms(expiry: object) -> int:
    """A window's length in whole milliseconds (rounded up), from seconds; ValueError names the range."""
    if type(expiry) is int and 0 < expiry <= _MAX_WINDOW_S:  # what ``limits`` passes: no rounding
        return expiry * 1000
    if (
        isinstance(expiry, bool)
        or not isinstance(expiry, (int, float))
        or not 0 < expiry < math.inf
    ):
        raise ValueError(f"expiry must be a number of seconds > 0, got {expiry!r}")
    w = math.ceil(expiry * 1000)
    if w > MAX_WINDOW_MS:
        raise ValueError(
            f"expiry must be at most {MAX_WINDOW_MS / 1000:.0f} seconds, got {expiry!r}"
        )
    return w


def _bounded(name: str, v: object, top: int, unit: str = "") -> int:
    """``v`` if it is an int from 0 to ``top`` (an amount, a limit); else ValueError naming it."""
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= top:
        raise ValueError(f"{name} must be an int from 0 to {top}{unit}, got {v!r}")
    return v


def native_fits(key: object) -> bool:
    """Whether the native ``incr`` takes ``key``: at most ``KEY_MAX`` bytes (its buffer).  A
    longer key takes the portable step, which hashes the same bytes to the same digest."""
    if isinstance(key, str) and len(key) > KEY_MAX // 4:  # (UTF-8: at most 4 bytes a char)
        return len(key_bytes(key, None)) <= KEY_MAX
    return not isinstance(key, bytes) or len(key) <= KEY_MAX


class WindowCounters:
    """Both kinds over one ``SlotTable``: ``incr``/``get``/``expiry_ms``/``clear`` (fixed window) and
    ``acquire_sliding``/``sliding``/``clear_sliding`` (sliding window counter), ``reset``.

    ``clock()`` returns CLOCK_MONOTONIC nanoseconds (injectable for tests).  A forked child calls
    ``rebind`` before its first use (``WindowTable`` does), so that it inserts as itself.  On the
    native backend ``incr`` is one call of the extension's twin of its step below (``FixedWindows``
    in ``_native.c``); this one is the portable backend's and the reference they are tested against.
    """

    def __init__(
        self,
        table: KC.SlotTable,
        k0: int,
        k1: int,
        refused: int,
        clock: Optional[Callable[[], int]] = None,
        name: str = "window counters",
        store_keys: bool = False,
    ) -> None:
        KC.check_offsets(table.c, refused)
        self.name = name
        self.store_keys = store_keys
        self.t, self.c = table, table.c
        self.k0, self.k1, self.refused = k0, k1, refused
        self.clock = clock or time.monotonic_ns
        self._hash = KC.hasher(self.c, k0, k1)
        self._native = None
        if getattr(self.c, "backend", None) == "native" and table.stride == K.LINE:
            from shmlimit.shm._native import fixed_windows

            flags = (KC.FLAG_EVICT if table.evict else 0) | (
                KC.FLAG_STORE_KEYS if store_keys else 0
            )
            self._native = fixed_windows(
                self.c,
                *(table.slots, table.nslots, table.probe, k0, k1, table.keys_live),
                *(table.evicted, refused, table.pid, table.cut, flags),
            )

    def rebind(self, pid: int) -> None:
        """After fork: insert as process ``pid``, so that a dead inserter is judged right."""
        self.t.pid = K.owner(pid)
        if self._native is not None:
            self._native.rebind(self.t.pid)

    # -- plumbing -------------------------------------------------------------------------

    def _now(self) -> Tuple[int, int]:
        ns = self.clock()
        ms = ns // 1_000_000
        if not 0 <= ms <= _MAX_NOW_MS:
            raise OverflowError(f"CLOCK_MONOTONIC ({ms} ms) is beyond what a window counter holds")
        return ns, ms

    def _key(self, prefix: bytes, key: object) -> Tuple[Tuple[int, int], int, bytes]:
        data = key_bytes(key, None)  # any length: only its digest is kept
        d = self._hash(prefix + data)
        return d, (d[0] * self.t.nslots) >> 64, data

    def _visit(self, kd, step: Callable, absent: object, first=None, fill=None):
        """``step(s, v, base)`` on the value of key ``kd`` (``_key``'s): its slot, ``V0`` less
        ``BASE``, and ``BASE``; until it answers (None: read it again).  ``absent`` when the table
        holds no such key; with ``first`` (now ms, V0, V1) that key is inserted with those values
        first (``fill(slot, gen)`` writes its words beyond the line): the insert is its first
        grant, answered ``absent`` (``SlotTable.visit``).  No slot for it raises
        ``KeyTableFullError``."""
        d, home, data = kd
        insert = None
        if first is not None:
            now, v0, v1 = first
            disp = KC.display_words(data) if self.store_keys else (0, 0)
            # a key's first value is the least it ever takes (every kind only moves V0 on): its
            # BASE is charged from there, by what the slot's last window ends after its first one;
            # so clears and evictions keep BASE within the longest window (two: sliding), < 2**61
            insert = (pack(now, CMAX, True), v0, (v1, *disp), fill, v0)
        got = self.t.visit(d, home, step, absent, insert, self.refused)
        if got in (KC.FULL, KC.WORN, KC.BUSY):
            raise self._full(got)
        return got

    def _full(self, code: int) -> KeyTableFullError:
        """The error for an insert's ``FULL`` or ``WORN`` (counted in ``refused``) or ``BUSY`` (a
        stalled insert of the key)."""
        err = KeyTableFullError(self.name, self.t.nslots, busy=code == KC.BUSY)
        if code == KC.WORN:
            err.args = (
                f"window table {self.name!r}: no slot for this new key now: each slot near its "
                f"home slot that could be had last held a window ending so far after this key's "
                f"that it takes no key until the clock passes that end; nothing was counted",
            )
        return err

    def _evict(self, kd) -> bool:
        """Forget key ``kd`` (``_key``'s) now (``clear``): ``V0 | DEAD`` by CAS, then TOMB.  True if
        one was there."""
        c = self.c
        d, home, _ = kd
        while True:
            s, ctl = self.t.find(d, home)
            if s is None:
                return False
            got = self.t.value(s, ctl)
            if got is not None and c.cas(s + K.S_V0, sum(got), sum(got) | K.DEAD):
                if c.cas(s, ctl, K.ctrl(K.TOMB, 0, ctl >> 40)):
                    c.fetch_add(self.t.keys_live, KC.MASK64)  # -1
                return True

    # -- fixed window ---------------------------------------------------------------------

    def incr(self, key: object, expiry: float, amount: int = 1) -> int:
        """Add ``amount`` to ``key``'s current window of ``expiry`` seconds; the count after it.

        A window starts at the first increment after the previous one ended, of an ``amount``
        above 0: a hit of cost 0 starts none (``limits``' storages restart the window it would
        start at the next paid hit).  Answers ``OVER`` once the window's count would pass ``CMAX``.
        """
        w, amount = window_ms(expiry), _bounded("amount", amount, CMAX)
        if amount == 0:
            return self.get(key)
        _, now = self._now()
        if self._native is not None and native_fits(key):
            got = self._native.incr(key, w, amount, now)
            if got < 0:  # FULL, WORN or BUSY, as ``_visit`` raises them
                raise self._full(got)
            return got

        def step(s: int, v: int, base: int) -> Optional[int]:
            end, _, cnt = unpack(v)
            if end <= now:
                new, ret = pack(max(now + w + 1, end + 1), amount), amount
            elif cnt + amount > CMAX:
                new, ret = pack(end, CMAX), OVER
            else:
                new, ret = pack(end, cnt + amount), cnt + amount
            # modulo 2**64, as the native step writes it: only a forged BASE takes it past
            return ret if self.c.cas(s + K.S_V0, v + base, (new + base) & KC.MASK64) else None

        first = (now, pack(now + w + 1, amount), 0)
        return self._visit(self._key(b"F", key), step, amount, first)

    def _fixed(self, key: object) -> Tuple[int, int, int]:
        """(count, end ms, now ms) of ``key``'s current fixed window; (0, 0, now) when it has none."""
        _, now = self._now()

        def step(s: int, v: int, base: int) -> Tuple[int, int, int]:
            end, _, cnt = unpack(v)
            return (cnt, end, now) if end > now else (0, 0, now)

        return self._visit(self._key(b"F", key), step, (0, 0, now))

    def get(self, key: object) -> int:
        """The count of ``key``'s current fixed window (0 if none).  Reads only."""
        return self._fixed(key)[0]

    def expiry_ms(self, key: object) -> int:
        """Milliseconds until ``key``'s fixed window ends (0 if it has none).  Reads only."""
        _, end, now = self._fixed(key)
        return max(0, end - now)

    def clear(self, key: object) -> bool:
        """Forget ``key``'s fixed window: its next increment starts a new one."""
        return self._evict(self._key(b"F", key))

    # -- sliding window counter --------------------------------------------------------------

    def _sliding_key(self, key: object, w: int):
        return self._key(b"S" + w.to_bytes(8, "little"), key)

    def _roll(self, s: int, v: int, base: int, w: int, now: int) -> None:
        """Finish moving slot s (V0 = v, ROLLING, stored plus ``base``) on from its window; anyone may.

        To the next window while ``now`` is before the slot's expiry (the count
        becomes the previous one), else to a fresh window starting at ``now``
        (both windows ended: the key holds nothing, as a new key).
        """
        c = self.c
        x, _, cnt = unpack(v)
        start = x - 2 * w
        if now < x:
            nxt, snap = start + w, pack(start + w, cnt, True)
        else:
            nxt, snap = now, pack(now, 0, True)
        while True:
            cur = c.load(s + K.S_V1)
            # only while V0 holds the word rolled: the slot's next tenant writes its V1 after V0
            # was marked DEAD, so a roller stalled past the key's eviction writes nothing there
            if cur >= snap or c.load(s + K.S_V0) != v + base or c.cas(s + K.S_V1, cur, snap):
                break
        c.cas(s + K.S_V0, v + base, pack(nxt + 2 * w, 0) + base)

    def _state(self, s: int, v: int, base: int, w: int, clk: "_Reading", write: bool):
        """Slot s's counts now from its value ``v`` (``V0`` less ``base``): ``(start, prev, cur)``,
        ``start`` the current window's start (ms); None to read the value again.

        With ``write`` the slot is first moved on to the window holding ``clk``'s now; without,
        the answer for a slot left in an earlier window is computed.
        """
        c = self.c
        x, rolling, cnt = unpack(v)
        start = x - 2 * w
        if clk.ms < start + (w if rolling else 0):
            if clk.again():  # another process read the clock after us: so do we, once
                return None
            # only a slot re-inserted above a dead inserter's value starts in the future: count there
            clk.ms = start + (w if rolling else 0)
        now = clk.ms
        if now >= start + w or rolling:
            if not write:
                return (now, 0, 0) if now >= start + 2 * w else (start + w, cnt, 0)
            if rolling or c.cas(s + K.S_V0, v + base, (v | FLAG) + base):
                self._roll(s, v | FLAG, base, w, now)
            return None
        v1 = c.load(s + K.S_V1)
        if c.load(s + K.S_V0) != v + base:
            return None
        tag, phase, n = unpack(v1)
        if tag == start and phase:
            return start, n, cnt  # n: the final count of the window before
        if tag < start:  # a key whose first window this is (inserted above a dead inserter's value)
            return start, 0, cnt
        if clk.again():  # a helper moved on with a later clock than ours
            return None
        return (
            start,
            n,
            cnt,
        )  # a stale write from a previous tenant, in a fresh key's first window: over-counts

    @staticmethod
    def _weight(start: int, w: int, ns: int) -> float:
        """The previous window's weight: the time left in the current one over its length (at most 1)."""
        left = (start + w) * 1_000_000 - ns
        return min(1.0, max(0.0, left / (w * 1_000_000)))

    def acquire_sliding(self, key: object, limit: int, expiry: float, amount: int = 1) -> bool:
        """Count ``amount`` hits for ``key`` iff ``floor(prev * left / W + cur) + amount <= limit``.

        ``cur`` counts the current window of ``expiry`` seconds and ``prev`` the
        one before; ``left`` is the time left in the current one.  A key's
        first hit starts its first window; when two windows pass without a
        hit it starts afresh (the ``limits`` sliding window counter, as its
        Redis storage keeps it).  Check and count are one CAS.
        """
        w, amount, limit = (
            window_ms(expiry),
            _bounded("amount", amount, CMAX),
            _bounded("limit", limit, CMAX, " (hits per window)"),
        )
        if amount > limit:
            return False
        clk = _Reading(self._now)
        now = clk.ms

        def step(s: int, v: int, base: int) -> Optional[bool]:
            st = self._state(s, v, base, w, clk, True)
            if st is None:
                return None
            start, prev, cur = st
            if math.floor(prev * self._weight(start, w, clk.ns) + cur) + amount > limit:
                return False
            if self.c.cas(s + K.S_V0, v + base, pack(start + 2 * w, cur + amount) + base):
                return True
            clk.fresh = False  # the slot moved on: the clock may be read again, once
            return None

        # a new key's windows are empty: amount <= limit is granted by the insert itself
        first = (now, pack(now + 2 * w, amount), pack(now, 0, True))
        return self._visit(self._sliding_key(key, w), step, True, first)

    def sliding(self, key: object, expiry: float) -> Tuple[int, float, int, float]:
        """``(prev, prev_ttl, cur, cur_ttl)`` for ``key`` now (seconds; prev_ttl 0.0 when prev is 0).  Reads only."""
        w = window_ms(expiry)
        clk = _Reading(self._now)
        kd = self._sliding_key(key, w)
        start, prev, cur = self._visit(
            kd, lambda *sv: self._state(*sv, w, clk, False), (clk.ms, 0, 0)
        )
        left = max(0, (start + w) * 1_000_000 - clk.ns) / 1e9
        return prev, (left if prev else 0.0), cur, left + w / 1000

    def clear_sliding(self, key: object, expiry: float) -> bool:
        """Forget ``key``'s sliding windows of ``expiry`` seconds: its next hit starts afresh."""
        return self._evict(self._sliding_key(key, window_ms(expiry)))

    # -- every key ----------------------------------------------------------------------------

    def reset(self) -> int:
        """Forget every key of the table; the number forgotten.  A scan of every slot."""
        c, n = self.c, 0
        for i in range(self.t.nslots):
            s = self.t.slots + i * self.t.stride
            ctl = c.load(s)
            if ctl & 0xFF != K.LIVE:
                continue
            v = c.load(s + K.S_V0)
            if not v & K.DEAD and c.cas(s + K.S_V0, v, v | K.DEAD):
                n += 1
                if c.cas(s, ctl, K.ctrl(K.TOMB, 0, ctl >> 40)):
                    c.fetch_add(self.t.keys_live, KC.MASK64)
        return n


class _Reading:
    """A reading of the clock, ``ns`` and ``ms`` (``_now``'s), that a step may take again once."""

    __slots__ = ("read", "ns", "ms", "fresh")

    def __init__(self, read: Callable[[], Tuple[int, int]]) -> None:
        self.read, self.fresh = read, False
        self.ns, self.ms = read()

    def again(self) -> bool:
        """Read the clock again if not yet done; whether it was."""
        if self.fresh:
            return False
        self.fresh = True
        self.ns, self.ms = self.read()
        return True


def _entry(lap: int, t: int, cum: int) -> int:
    return (E_LAP if lap & 1 else 0) | t << E_TSHIFT | (cum & E_CUM)


class MovingWindows(WindowCounters):
    """The moving window over the moving-window slots of a table (a ``SlotTable`` of stride
    ``moving_stride(ring)``): ``acquire_entry``/``moving_window``/``clear_moving``, ``reset``.

    ``ring`` is the words of each key's log (a power of two, at least 8): a key is counted exactly
    while it has at most ``ring - 2`` grants in one window (see the module's docstring).
    """

    def __init__(
        self,
        table: KC.SlotTable,
        ring: int,
        k0: int,
        k1: int,
        refused: int,
        clock: Optional[Callable[[], int]] = None,
        name: str = "window counters",
        store_keys: bool = False,
    ) -> None:
        if ring < K.MIN_RING or ring & (ring - 1) or table.stride != K.moving_stride(ring):
            raise ValueError(f"ring must be a power of two >= {K.MIN_RING} matching the stride")
        super().__init__(table, k0, k1, refused, clock, name, store_keys)
        self.ring = ring

    def _log(self, s: int, i: int) -> int:
        return s + K.LINE + 8 * (i & (self.ring - 1))

    def _lap(self, g: int) -> int:
        return g // self.ring & 1  # 2**24 / ring is even: the parity of the true count's lap

    def _advance(self, s: int, v: int, base: int, t: int, wu: int) -> None:
        """Move V0 (the value ``v``, stored plus ``base``) on past the grant whose entry (at ``t``)
        is written; anyone may do it."""
        x, full, g = unpack(v)
        g2 = (g + 1) & CMAX
        x2 = max(x, -(-(t + wu + 1) // 32))  # the first ms when the entry is out of the window
        if not g2:  # the grant count wraps: the expiry moves 1 ms on, so V0 still only increases
            x2 = max(x2, x + 1)
        self.c.cas(s + K.S_V0, v + base, pack(x2, g2, full or g + 1 >= self.ring) + base)

    def _count(self, s: int, v: int, now: int, wu: int) -> Tuple[int, int, int, int]:
        """The committed log under V0 = v at ``now`` (1/32 ms), or at its newest grant's time if
        that is later (a clock read before it): (grants in the window, their hits, the oldest
        one's time (0 with none), the newest entry).  So a window counted is never longer than
        one that every grant was checked against: it holds at most ``limit < 2**20`` hits (``cum``
        never wraps within it) and ``ring - 2`` grants (``acquire_entry`` refuses the next), so
        the newest entry out of it is kept."""
        c = self.c
        _, full, g = unpack(v)
        avail = self.ring - 1 if full else g
        newest = c.load(self._log(s, g - 1))
        now = max(now, newest >> E_TSHIFT & E_TMAX)
        # entries j = 0 (newest) .. avail - 1 (oldest); those in the window (now <= t + W) come first
        lo, hi = 0, avail
        while lo < hi:
            mid = (lo + hi) // 2
            if (c.load(self._log(s, g - 1 - mid)) >> E_TSHIFT & E_TMAX) + wu >= now:
                lo = mid + 1
            else:
                hi = mid
        k = lo
        if k < avail:
            base = c.load(self._log(s, g - 1 - k)) & E_CUM
        elif full:  # never in a log we wrote (see above); a hand-written one: at least the kept
            base = (c.load(self._log(s, g - avail)) - 1) & E_CUM
        else:
            base = 0  # every grant of the key is in the window
        oldest = 0 if k == 0 else c.load(self._log(s, g - k)) >> E_TSHIFT & E_TMAX
        return k, (newest - base) & E_CUM, oldest, newest

    def _pending(self, s: int, v: int, base: int, wu: int) -> Optional[int]:
        """The word of entry ``g`` (V0's) while grant ``g`` is not written; None if it is though
        V0 does not say so yet, after moving V0 on for its writer (whoever that was: it may have
        died between its two CASes).  A grant CASes over exactly this word: one read, so that a
        grant written meanwhile is never overwritten."""
        g = unpack(v)[2]
        e = self.c.load(self._log(s, g))
        if bool(e & E_LAP) != bool(self._lap(g)):
            return e
        self._advance(s, v, base, e >> E_TSHIFT & E_TMAX, wu)
        return None

    def acquire_entry(self, key: object, limit: int, expiry: float, amount: int = 1) -> bool:
        """Count ``amount`` hits for ``key`` now iff its hits in the last ``expiry`` seconds plus
        ``amount`` stay within ``limit``; check and count are one step for every process."""
        w, amount, limit = (
            window_ms(expiry),
            _bounded("amount", amount, CMAX),
            _bounded("limit", limit, MOVING_MAX, " (hits per moving window)"),
        )
        if amount > limit:
            return False
        if not amount:  # nothing to log (a word of it would be one grant fewer for the window)
            return self.moving_window(key, expiry)[1] <= limit
        ns, now = self._now()
        nu, wu = ns // E_NS, w * 32
        c = self.c

        def fill(slot: int, gen: int) -> None:
            # every word of the log: the first grant, then wipes tagged with this tenant's
            # generation (a time no grant has), so no entry of a previous tenant is ever read
            wipe = _entry(1, E_TMAX, gen)
            for i in range(1, self.ring):
                c.store(self._log(slot, i), wipe)
            c.store(self._log(slot, 0), _entry(0, nu, amount))

        def step(s: int, v: int, base: int) -> Optional[bool]:
            e = self._pending(s, v, base, wu)
            if e is None:
                return None
            g = unpack(v)[2]
            k, hits, _, newest = self._count(s, v, nu, wu)
            if c.load(s + K.S_V0) != v + base:
                return None
            # ring - 2 grants in the window: the log holds no more (the newest one out of the
            # window must stay for the count), so the next is refused until the oldest leaves
            if hits + amount > limit or k >= self.ring - 2:
                return False
            t = max(nu, newest >> E_TSHIFT & E_TMAX)  # the instant ``_count`` counted at
            if not c.cas(self._log(s, g), e, _entry(self._lap(g), t, (newest & E_CUM) + amount)):
                return None
            self._advance(s, v, base, t, wu)
            return True

        # a new key's log is empty: amount <= limit is granted by the insert itself
        first = (now, pack(-(-(nu + wu + 1) // 32), 1), w)
        return self._visit(self._key(b"M", key), step, True, first, fill)

    def moving_window(self, key: object, expiry: float) -> Tuple[Optional[float], int]:
        """``(seconds since the oldest hit in the window, hits in the window)`` for ``key`` now;
        ``(None, 0)`` when it has none.  Writes only to finish a grant whose writer has not
        moved V0 on yet (a grant counts from its entry on)."""
        wu = window_ms(expiry) * 32
        ns, _ = self._now()

        def step(s: int, v: int, base: int) -> Optional[Tuple[Optional[float], int]]:
            if self._pending(s, v, base, wu) is None:
                return None
            k, hits, oldest, _ = self._count(s, v, ns // E_NS, wu)
            if self.c.load(s + K.S_V0) != v + base:
                return None
            return (max(0.0, (ns - oldest * E_NS) / 1e9), hits) if k else (None, 0)

        return self._visit(self._key(b"M", key), step, (None, 0))

    def clear_moving(self, key: object) -> bool:
        """Forget ``key``'s moving window: its next hit starts a new log."""
        return self._evict(self._key(b"M", key))
