"""The config as the segment publishes it: two checksummed banks under a sequence lock.

The config is published under a sequence lock (``CFG_SEQ`` odd while a writer
works, and a writer silent for ``CONFIG_LOCK_TIMEOUT_NS`` is taken over) into
two banks, each stamped with the generation it is published as (the even
``CFG_SEQ``) and a checksum over both, its values stored masked by that
generation (``layout.bank_mask``).  A writer writes first the bank that does
not hold the newest valid config, then the other, each word by load, check
that it still holds the lock, CAS from the loaded word (``write_banks``), and
publishes by one CAS of ``CFG_SEQ`` from its lock value: a writer that was
taken over fails there.  Resumed, such a writer has at most one CAS in hand,
and it misses every word a newer writer stored, so however many writers are
late, the newest completed write keeps a whole bank.  Readers take the first
bank valid for the even ``CFG_SEQ`` they saw before and after; with none (an
interrupted writer published nothing new) or while a writer is presumed dead,
the valid bank of the newest generation counted back from it (under a presumed
dead writer, from that writer's own generation).  One piece of code,
``BankCode``, writes and reads these banks for every kind: the plain config
here, the keyed default and each keyed override (``keyed.gcra``) alike.

A reader turns the words into one immutable ``Snapshot``: a thread that reads
a snapshot once never combines a new sequence number with an old price.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple, TypeVar

from shmlimit.config import MAX_SPAN_TOKENS as MAX_SPAN
from shmlimit.config import MAX_TPN, NS_PER_S, Config
from shmlimit.errors import ConfigWriterTakenOver, CorruptWordsError
from shmlimit.shm import layout as L

T = TypeVar("T")
INF_BITS = L.f2u(float("inf"))
_KNOWN_FLAGS = L.FLAG_CAPPED | L.FLAG_STOPPED | L.UPSTREAM_FLAGS
#: CFG_SEQ and the generations count modulo 2**64, as the native keyed composite's do.
MASK64 = (1 << 64) - 1
# ``cells`` is a ``shm.cells.Cells``, not imported: the keyed composite (``keyed.cells``, which
# ``shm.cells`` imports) reads its banks here, and the imports go one way.


#: A config writer that holds the sequence lock longer than this is presumed dead (ns).
CONFIG_LOCK_TIMEOUT_NS = 200_000_000


def _opt(x: Optional[float]) -> int:
    return INF_BITS if x is None else L.f2u(x)


def _unopt(u: int) -> Optional[float]:
    v = L.u2f(u)
    return None if v == float("inf") else v


@dataclass(frozen=True)
class Snapshot:
    """One process's view of the live config, derived once per change and never mutated."""

    seq: int
    tpn: int  #: tokens per nanosecond (fixed at creation)
    cost: int  #: tokens per op
    cap: int  #: capacity, tokens
    cap_ops: int  #: capacity, whole ops (the capped-mode in-flight bound)
    capped: bool
    stopped: bool
    upstream_flags: int
    upstream: bool
    time_fed: bool
    open: bool
    config: Optional[Config]
    burst_pool: int
    catch_up: bool
    wait_cap: int
    max_reserved_ns: float


NO_SNAPSHOT = Snapshot(-1, 1, 1, 1, 1, False, False, 0, False, True, False, None, 0, False, 0, 0.0)


#: The odd sequence words this process waited out (their writers presumed dead), by the cells,
#: the word's offset and what was read under it (``what``), with what it read then: read at once
#: while they hold and read the same.
#: Readers never close a lock (only a writer takes it over), so a process that only reads, as the
#: adaptive rate's reports do, would otherwise wait out the same dead writer on every call.  A
#: writer that was only stalled and writes again under the same value changes what is read: then
#: it is waited for again.  (The cells are held: ids are reused.)
_waited_out: Dict[Tuple[int, int, str], Tuple[Any, int, Any]] = {}


def settled(cells: Any, seq_off: int, read: Callable[[int], T], what: str) -> Tuple[int, T]:
    """``(seq, read(seq))`` under an even ``seq`` of the sequence word at ``seq_off`` that still
    holds after: what one writer left, never words of two.  A writer that holds the lock for
    ``CONFIG_LOCK_TIMEOUT_NS`` is presumed dead: then read once under its odd value (at once
    from then on, while it holds and ``read``, named ``what``, reads the same: ``_waited_out``)."""
    deadline = None
    while True:
        seq = cells.load(seq_off)
        if seq & 1:
            dead = _waited_out.get((id(cells), seq_off, what))
            if dead is not None and dead[0] is cells and dead[1] == seq:
                got = read(seq)
                if got == dead[2]:
                    return seq, got
                del _waited_out[(id(cells), seq_off, what)]  # its writer writes: alive after all
            now = time.monotonic_ns()
            deadline = deadline or now + CONFIG_LOCK_TIMEOUT_NS
            if now < deadline:
                time.sleep(0.0005)
                continue
        got = read(seq)
        if deadline is not None and seq & 1:
            if len(_waited_out) >= 64:
                _waited_out.clear()
            _waited_out[(id(cells), seq_off, what)] = (cells, seq, got)
        if cells.load(seq_off) == seq or deadline is not None:
            return seq, got


def settle_copy(cells: Any, seq_off: int) -> None:
    """A private copy's sequence word at ``seq_off``, closed in the copy if a writer held it: a copy
    never changes, so its writer never publishes, and a read would only wait out the lock's
    timeout.  Closed to the next even value, the copy reads as a lock left odd is read (the banks
    counted back from the generation that writer would publish; a keyed reader closes a live one
    so, ``keyed.cells.consistent``), at once."""
    seq = cells.load(seq_off)
    if seq & 1:
        cells.store(seq_off, (seq + 1) & MASK64)


def read_snapshot(cells: Any) -> Snapshot:
    """The config in force, read under the sequence lock and checked; ``SegmentError`` if corrupt."""
    c = cells
    seq, vals = settled(c, L.CFG_SEQ, lambda s: published_values(c, s), "config")
    if vals is None:
        raise CorruptWordsError("no copy of its configuration passes its checksum")
    rate, per, burst, tpn, cost, cap, flags, ratio, max_reserved, max_behind = vals
    try:  # words from a corrupt or foreign segment must not reach the arithmetic
        cfg = Config.make(
            L.u2f(rate),
            L.u2f(per),
            L.u2f(burst),
            bool(flags & L.FLAG_CAPPED),
            L.u2f(ratio),
            _unopt(max_reserved),
            _unopt(max_behind),
        )
    except (TypeError, ValueError) as e:
        raise CorruptWordsError(f"its configuration is invalid ({e})") from None
    if (
        not 1 <= tpn <= MAX_TPN
        or not 1 <= cost <= MAX_SPAN
        or not 1 <= cap <= MAX_SPAN
        or flags & ~_KNOWN_FLAGS
    ):
        raise CorruptWordsError(
            f"token unit {tpn}, op cost {cost}, capacity {cap} or flags {flags:#x} out of range"
        )
    mb = cfg.max_behind
    mr = cfg.max_reserved
    return Snapshot(
        seq=seq,
        tpn=tpn,
        cost=cost,
        cap=cap,
        cap_ops=max(1, cap // cost),
        capped=bool(flags & L.FLAG_CAPPED),
        stopped=bool(flags & L.FLAG_STOPPED),
        upstream_flags=flags & L.UPSTREAM_FLAGS,
        upstream=bool(flags & L.FLAG_UPSTREAM),
        time_fed=not flags & L.FLAG_UPSTREAM or bool(flags & L.FLAG_FALLBACK_LOCAL),
        open=bool(flags & L.FLAG_UPSTREAM) and bool(flags & L.FLAG_FALLBACK_OPEN),
        config=cfg,
        burst_pool=cfg.burst_pool_at(tpn),
        catch_up=cfg.ratio > 1.0,
        wait_cap=MAX_SPAN if mb is None else int(mb * NS_PER_S * tpn),
        max_reserved_ns=float("inf") if mr is None else mr * NS_PER_S,
    )


def published_values(cells: Any, seq: int) -> Optional[List[int]]:
    """The config words published as of ``seq``: the first bank valid for it, else the newest older one."""
    # Under a writer presumed dead (``seq`` odd), a bank it completed (its generation, seq + 1) is
    # whole too: it may be the only one (it wrote the other first, and stopped in this one).
    got = PLAIN.pick(cells.load_many, BANKS, (), seq + (seq & 1))[1]
    return None if got is None else list(got[1])


def config_words(
    cfg: Config, tpn: int, stopped: bool, upstream_flags: int
) -> List[Tuple[int, int]]:
    """Every config word of ``cfg`` at the segment's token unit ``tpn``, computed before any is written.

    Raises ValueError (naming the parameter) if a quantity does not fit at
    ``tpn``: a config is validated at the unit it will be stored in, never
    at the unit it would have chosen for itself.
    """
    cfg.check_at(tpn)
    flags = (
        (L.FLAG_CAPPED if cfg.capped else 0) | (L.FLAG_STOPPED if stopped else 0) | upstream_flags
    )
    return [
        (L.CFG_RATE, L.f2u(cfg.rate)),
        (L.CFG_PER, L.f2u(cfg.per)),
        (L.CFG_BURST, L.f2u(cfg.burst)),
        (L.CFG_TPN, tpn),
        (L.CFG_COST, cfg.cost_at(tpn)),
        (L.CFG_CAP, cfg.cap_at(tpn)),
        (L.CFG_FLAGS, flags),
        (L.CFG_RATIO, L.f2u(cfg.ratio)),
        (L.CFG_MAX_RESERVED, _opt(cfg.max_reserved)),
        (L.CFG_MAX_BEHIND, _opt(cfg.max_behind)),
    ]


class BankCode:
    """How one kind's configs sit in their two banks, and the one writer and reader of them all
    (the plain config: ``PLAIN``; the keyed default and each override: ``keyed.cells.BANKS``).

    A bank is a tuple of word offsets: its values, then ``GEN``, then ``SUM``.  Value ``i`` is
    stored XOR-ed with ``bank_mask(GEN, i)``; ``SUM`` is ``config_sum`` over ``GEN``, a salt (the
    keyed override's digest: a bank is valid only for its own key) and the values in ``order``.
    Generations, like ``CFG_SEQ``, count modulo 2**64: the newest bank is the one whose
    generation lies least far back from the sequence number it is read under.
    """

    def __init__(self, order: Tuple[int, ...]) -> None:
        self.order = order
        # A pure function of what was loaded, so the last 256 banks read are kept: unmasking and
        # checking a bank cost two thirds of a keyed try on the portable backend, where the words
        # are read again every call.
        self.decode = functools.lru_cache(maxsize=256)(self._decode)

    def _decode(
        self, words: Tuple[int, ...], salt: Tuple[int, ...]
    ) -> Optional[Tuple[int, Tuple[int, ...]]]:
        """``(GEN, values)`` of a bank loaded as ``words``, or None if its checksum does not hold."""
        *raw, gen, stored_sum = words
        vals = tuple(w ^ L.bank_mask(gen, i) for i, w in enumerate(raw))
        ok = stored_sum == L.config_sum(gen, salt + tuple(vals[i] for i in self.order))
        return (gen, vals) if ok else None

    def stored(self, gen: int, vals, salt: Tuple[int, ...] = ()) -> Tuple[int, ...]:
        """A bank's words for generation ``gen`` as stored, in bank order (values, GEN, SUM)."""
        out = tuple(v ^ L.bank_mask(gen, i) for i, v in enumerate(vals))
        return (*out, gen, L.config_sum(gen, salt + tuple(vals[i] for i in self.order)))

    def pick(self, load_many: Callable, banks, salt: Tuple[int, ...], seq: int):
        """``(k, (GEN, values))`` of the valid bank ``banks[k]`` of the newest generation counted
        back from ``seq`` (a tie: the first), or ``(0, None)`` if neither is valid.

        A valid first bank of generation ``seq`` itself is the newest there can be (age 0): the
        second is then not read -- the same answer as reading both, in half the loads (after
        every completed write both banks hold its generation).  A bank of a generation above
        ``seq`` (only a writer's in progress, or a hostile one) counts as the oldest.
        """
        decode = self.decode
        a = decode(load_many(banks[0]), salt)
        if a is not None and a[0] == seq:
            return 0, a
        b = decode(load_many(banks[1]), salt)
        if b is None or (a is not None and (seq - a[0]) & MASK64 <= (seq - b[0]) & MASK64):
            return 0, a
        return 1, b

    def write_banks(
        self, cells: Any, banks, salt: Tuple[int, ...], vals, gen: int, seq_off: int, lock
    ) -> bool:
        """Write both ``banks`` for ``gen``, first the one that does not hold the newest valid copy.

        Every word is written by load, check that ``seq_off`` still holds ``lock``,
        CAS from the loaded word (retried only while the lock is ours; ``lock``
        None: a creator alone with its segment, no check).  A writer stopped
        between its check and its CAS, taken over, resumes with that one CAS in
        hand, which expects a word loaded before any newer writer took the lock:
        it misses every word a newer writer stored (values are stored masked by
        their generation, so no newer writer stores that word again), and its
        next check stops it.  So a bank a writer completed is never touched by an
        older writer, and the bank a writer keeps while it writes the other is
        never one an older writer may still reach: the older writers that came
        after its own writer chose the other bank first too.  However many
        writers are late, a whole bank of the newest completed write survives.

        Returns False, having stopped at that check, if the lock was taken over.
        """
        c = cells
        bound = c.load(seq_off) if lock is None else lock
        keep = self.pick(c.load_many, banks, salt, bound)[0]
        stored = self.stored(gen, vals, salt)
        for bank in (banks[1 - keep], banks[keep]):
            for off, want in zip(bank, stored):
                while True:
                    seen = c.load(off)
                    if lock is not None and c.load(seq_off) != lock:
                        return False
                    if seen == want or c.cas(off, seen, want):
                        break
        return True


#: The plain config's banks: ten values, a checksum over them in bank order, no salt.
PLAIN = BankCode(tuple(range(len(L.CFG_BANK))))
BANKS = (
    (L.CFG_BANK + (L.CFG_GEN, L.CFG_SUM)),
    (L.CFG_BACKUP_BANK + (L.CFG_BACKUP_GEN, L.CFG_BACKUP_SUM)),
)


def write_banks(
    cells: Any, words: List[Tuple[int, int]], gen: int, lock: Optional[int] = None
) -> bool:
    """Write the plain config ``words`` (in ``CFG_BANK`` order) into both banks for ``gen``
    (``BankCode.write_banks``); False if the lock was taken over."""
    return PLAIN.write_banks(cells, BANKS, (), [v for _, v in words], gen, L.CFG_SEQ, lock)


class ConfigLock:
    """The writers' side of a ``CFG_SEQ`` (the plain config's, a keyed segment's): CAS even -> odd,
    write banks, publish by CAS odd -> even, the generation written.

    A holder whose lock value stays ``timeout_ns`` is presumed dead and taken over (odd -> odd +
    2).  Leaving the ``with`` publishes, interrupted half-way too (readers then take the old
    config or the new one); a writer taken over meanwhile raises ``ConfigWriterTakenOver`` there
    (unless another exception is on its way): nothing of its own is published.
    """

    def __init__(self, cells: Any, seq_off: int, timeout_ns: int, what: str = "config") -> None:
        self.c, self.seq_off, self.timeout_ns, self.what = cells, seq_off, timeout_ns, what
        self.published = False

    def __enter__(self) -> "ConfigLock":
        c, off = self.c, self.seq_off
        seen, since = None, 0
        while True:
            s = c.load(off)
            if not s & 1:
                if c.cas(off, s, (s + 1) & MASK64):
                    self.seq = (s + 1) & MASK64
                    return self
                continue
            now = time.monotonic_ns()
            if s != seen:
                seen, since = s, now
            elif now - since >= self.timeout_ns and c.cas(off, s, (s + 2) & MASK64):
                self.seq = (s + 2) & MASK64  # still odd: ours now; we rewrite what we came to write
                return self
            time.sleep(0.0005)

    @property
    def gen(self) -> int:
        """The generation this writer publishes: the even value after its lock."""
        return (self.seq + 1) & MASK64

    def held(self) -> bool:
        return self.c.load(self.seq_off) == self.seq

    def store(self, off: int, value: int) -> None:
        """One word outside the banks (the adaptive rate's parameters), stored as ``write_banks``
        stores each: load, check this writer still holds the lock, CAS from the loaded word;
        ``ConfigWriterTakenOver`` if it does not."""
        while True:
            seen = self.c.load(off)
            if not self.held():
                raise self.taken_over()
            if seen == value or self.c.cas(off, seen, value):
                return

    def write_banks(self, code: BankCode, banks, salt: Tuple[int, ...], vals) -> None:
        """Both ``banks`` of one config (``BankCode.write_banks``); ``ConfigWriterTakenOver`` if
        this writer was taken over meanwhile."""
        if not code.write_banks(self.c, banks, salt, vals, self.gen, self.seq_off, self.seq):
            raise self.taken_over()

    def taken_over(self) -> ConfigWriterTakenOver:
        return ConfigWriterTakenOver(
            f"this {self.what} change was abandoned: the writer stalled longer than the lock's "
            f"{self.timeout_ns // 1_000_000} ms and another took over; apply it again"
        )

    def __exit__(self, exc_type, exc, tb) -> None:
        # Publish by CAS from our lock value: if we were taken over, ours is not the config.
        self.published = published = self.c.cas(self.seq_off, self.seq, self.gen)
        if exc_type is None and not published:
            raise self.taken_over()


def write_under_lock(cells: Any, words: Callable[[Any], List[Tuple[int, int]]]) -> None:
    """Take the config seqlock (CFG_SEQ odd), write ``words(cells)`` into both banks, publish by CAS.

    Raises ``ConfigWriterTakenOver`` if this writer stalled past the lock's
    timeout and another took over: then nothing of ours is published.
    """
    with ConfigLock(cells, L.CFG_SEQ, CONFIG_LOCK_TIMEOUT_NS) as lock:
        lock.write_banks(PLAIN, BANKS, (), [v for _, v in words(cells)])
