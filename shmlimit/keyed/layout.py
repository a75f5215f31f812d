"""The keyed segment's fixed, versioned layout: byte offsets of every word.

A keyed segment holds many independent limits, one per key, in a table of
64-byte slots.  Every word is an unsigned 64-bit cell (see ``cells``).

    line  0  header     MAGIC VERSION SIZE STATE PSLOTS CREATOR_PID CREATED_NS KIND (1 GCRA, 2 windows)
    line  1  config     CFG_SEQ, then the default rate's bank A: RATE PER BURST T TAU GEN SUM
    line  2  geometry   NKEYS NOVR PROBE - - MKEYS MRING BEYOND (a Limiter's: ``layout.BEYOND``)
    line  3  KEYS_LIVE  keys in LIVE slots
    line  4  EVICTED    keys given up to make room (expired, or the least valuable: see CUT)
    line  5  REFUSED    new keys refused: every slot of their window held a limited key
    line  6  OVR_LIVE   live overrides (the override table is probed only when nonzero)
    line  7  UNREG_GRANTS: grants of processes beyond the process table; UNREG_HITS: their hits
             asked (a table of window counters: granted or not)
    line  8  -, then the default rate's bank B: RATE PER BURST T TAU GEN SUM
    line  9  CUT        of EVICTED, keys still limited when given up (each lost its remaining debt)
    line 10  ADAPT_MIN ADAPT_MAX ADAPT_DECREASE ADAPT_INCREASE ADAPT_WINDOW: each key's adaptive
             rate's parameters (IEEE-754 bits, under the config lock; ADAPT_MAX 0: none)
    line 11  ADAPT_THROTTLED ADAPT_OK ADAPT_DECISIONS: outcomes reported and decisions made, all keys
    lines 12..15 reserved (zero)
    then PSLOTS process slots of one line each: PID START GRANTS WAITING BASE PIDNS HITS -
         (the format of ``table.ProcessTable``, at the same offset as in a Limiter segment)
    then NOVR override entries of three lines: CTRL D0 D1 A_OWNER A_OUT A_START A_SEEN_OUT
         A_SEEN_GRANTS (the key's adaptive rate: ``keyed.adapt``), then its bank A, then its bank B
         (CTRL state | owner << 8 | tag << 40: state 0 empty, 1 live, 2 tomb, 3 claimed by the writer
         owner; tag the low 24 bits of the storing writer's generation: see ``o_ctrl``)
    then NKEYS key slots:        CTRL D0 D1 V0 V1 BASE V3 V4
    then (a table of window counters only) MKEYS moving-window slots of ``1 + MRING/8`` lines each:
         a key slot's line, then its log of MRING words (``keyed.windows``; MKEYS = MRING = 0: none)

A *bank* is words 1..7 of a line: ``RATE PER BURST`` (IEEE-754 bits, for
display), ``T`` the emission interval (ticks per op), ``TAU`` the burst
tolerance (ticks), each stored XOR-ed with ``bank_mask(GEN, i)``, ``GEN`` the
even ``CFG_SEQ`` its writer publishes as, and ``SUM`` a checksum over GEN, the
key's digest (zero for the default) and the five (unmasked) values.  Every config (the default, each override) has two banks; readers
take the valid bank of the newest generation (``keyed_gcra``).  An override
whose newest bank has ``T == 0`` was removed.  A tick is 1/16 ns of
CLOCK_MONOTONIC.  A slot's words: ``CTRL`` = state | owner pid << 8 |
generation << 40, ``D0 D1`` the key's 128-bit keyed digest (SipHash-2-4-128
under the segment's secret, kept in its secret file, never in the segment: ``keyed_segment``), ``V0 V1 V3 V4`` the value kind's words, ``BASE``
the slot protocol's: ``V0`` is stored plus ``BASE`` (the tenant's offset,
fixed while it holds the slot), so the stored word rises over the slot's whole
life while each tenant's own values start from the clock.  The slot protocol
(``keyed_cells``) knows one thing about values: ``V0`` is the expiry word (see
there).  ``V3 V4`` hold the key's first bytes only when the table's users ask
(``store_keys``); by default they are zero.
"""

from __future__ import annotations

# Line 0 is the header every kind of segment shares (see layout), with the process slots' count
# in its SLOTS word and the value kind in its last one; line 1 begins, as in every kind, with the
# config's sequence word and the rate (IEEE-754 bits).
from shmlimit.shm.layout import (  # noqa: F401 (this layout's names too)  # bank_mask: the keyed banks are masked alike
    BEYOND,
    CFG_BURST,
    CFG_PER,
    CFG_RATE,
    CFG_SEQ,
    CREATED_NS_OFF,
    CREATOR_PID_OFF,
    LINE,
    MAGIC_OFF,
    SIZE_OFF,
    STATE_INIT,
    STATE_OFF,
    STATE_READY,
    VERSION_OFF,
    bank_mask,
    config_sum,
    words,
)
from shmlimit.shm.layout import SLOTS_OFF as PSLOTS_OFF  # noqa: F401 (for the layers above)
from shmlimit.shm.table import pid_namespace

MAGIC = int.from_bytes(b"SHMLKEYS", "little")
#: 2: every config in two checksummed banks (a config writer taken over cannot publish late);
#: 3: a bank's values stored masked by their generation and written by CAS (late writers miss);
#: 4: a slot's BASE word (a still-limited key may be evicted), key bytes only when asked;
#: 5: a window table's moving-window slots, each followed by its log (MKEYS, MRING);
#: 6: a GCRA key's V0 is its TAT under a burst of MAX_TICKS, whatever its price (was: its own);
#: 7: the hash's secret in the segment's secret file, line 2's words 3 and 4 zero (were: it)
#: 8: A_START's low bit says the key's window's marks are written (``adapt.report``)
#: 9: BEYOND counts the processes attached beyond the process table (gc took it from under them)
#: 10: the secret file is named by the segment's CREATED_NS too (``shm.segment.secret_entry``)
VERSION = 10

KIND_OFF = words(0, 8)[7]

#: Value kinds a keyed table may hold.  The slot protocol is the same for all of them.
KIND_GCRA = 1
#: Window counters (fixed window, sliding window counter: ``keyed_windows``), the ``limits`` storage's
#: table; its config line is zero and it has no override entries.
KIND_WINDOWS = 2
KINDS = (KIND_GCRA, KIND_WINDOWS)

# a bank: words 1..7 of its line (byte offsets within the line)
B_RATE, B_PER, B_BURST, B_T, B_TAU, B_GEN, B_SUM = words(0, 8)[1:]
B_VALUES = (B_RATE, B_PER, B_BURST, B_T, B_TAU)

# line 1 after CFG_SEQ is the default's bank A; its backup, bank B, is line 8
DEFAULT_BANKS = (1 * LINE, 8 * LINE)
#: The default's bank B lies this many lines after CFG_SEQ's (the composite is given CFG_SEQ's offset).
DEFAULT_BACKUP_LINES = 7

# line 2: the geometry; MKEYS, MRING: a window table's moving-window logs (words 3, 4: zero); then
# BEYOND, the processes attached beyond the process table, at a Limiter's offset (``ProcessTable``)
NKEYS_OFF, NOVR_OFF, PROBE_OFF, _, _, MKEYS_OFF, MRING_OFF = words(2, 7)

#: Each key's adaptive rate (``keyed.adapt``): the parameters, as a Limiter's (``adapt.write``) ...
ADAPT_PARAMS = tuple(words(10, 5))
#: ... and, over every key, outcomes reported and decisions made (cuts << 32 | raises).
ADAPT_THROTTLED, ADAPT_OK, ADAPT_DECISIONS = words(11, 3)

KEYS_LIVE = 3 * LINE
EVICTED = 4 * LINE
REFUSED = 5 * LINE
#: Of EVICTED: keys evicted while still limited, to make room for a new key (``when_full="evict"``).
CUT = 9 * LINE
OVR_LIVE = 6 * LINE
UNREG_GRANTS = 7 * LINE
UNREG_HITS = 7 * LINE + 8
#: A table of window counters counts each process's hits asked (granted or not) in this word of
#: its process slot (a Limiter's ticket record, unused in a keyed segment), and its grants in
#: GRANTS: each only ever grows, across the slot's owners, as GRANTS does.
P_HITS = 48

HEADER_BYTES = 16 * LINE
PSLOTS = 128

# a key slot (word offsets within its line)
S_CTRL, S_D0, S_D1, S_V0, S_V1, S_BASE, S_V3, S_V4 = words(0, 8)
SLOT_BYTES = LINE

# slot states (CTRL & 0xff)
EMPTY = 0
BUSY = 1  #: claimed by its owner; the digest is not valid yet
PEND = 2  #: digest valid; the owner checks for a concurrent insert of the same key
LIVE = 3
TOMB = 4

# an override entry: three lines (CTRL D0 D1 in the first, then bank A, then bank B)
OVR_LINES = 3
O_CTRL, O_D0, O_D1 = words(0, 3)
#: The key's adaptive rate, in the entry's spare words (``keyed.adapt``): A_OWNER the D0 of the key
#: the other four belong to (an entry given to another key starts afresh); A_OUT its outcomes
#: (throttled << 32 + ok, one fetch-add each); A_START the window's start (ns, 0: none; its low
#: bit set once the marks are written), claimed by CAS; A_SEEN_OUT and A_SEEN_GRANTS (the marks)
#: A_OUT and the key's grants when the window began.
A_OWNER, A_OUT, A_START, A_SEEN_OUT, A_SEEN_GRANTS = words(0, 8)[3:]
O_BANKS = (1 * LINE, 2 * LINE)
#: CTRL: ``state | owner << 8 | tag << 40``, the state in its low byte: EMPTY (the whole word zero)
#: ends a probe; LIVE an entry in use; TOMB one a writer gave back; CLAIM taken by the writer
#: ``owner`` that has not published it yet.  ``tag`` is the low 24 bits of the generation of the
#: writer that stored the word, so the word never comes back to a value a late writer loaded.
O_EMPTY, O_LIVE, O_TOMB, O_CLAIM = 0, 1, 2, 3


def o_ctrl(state: int, owner: int, gen: int) -> int:
    """An override entry's CTRL word, stored by the writer of generation ``gen``."""
    return state | (owner & 0xFFFFFFFF) << 8 | (gen >> 1 & 0xFFFFFF) << 40


def o_state(ctl: int) -> int:
    return ctl & 0xFF


def o_owner(ctl: int) -> int:
    return ctl >> 8 & 0xFFFFFFFF


DEFAULT_OVERRIDES = 1024


def default_overrides(keys: int) -> int:
    """Override entries when none are asked for: one per 16 key slots, from 16 up to 1024."""
    return max(16, min(DEFAULT_OVERRIDES, keys // 16))


MAX_KEYS = 1 << 26
MAX_OVERRIDES = 1 << 16
#: Slots a key may sit from its home slot (and the most a lookup ever reads).
PROBE = 32

TICK_SHIFT = 4  #: ticks per ns = 1 << TICK_SHIFT
DEAD = 1 << 63  #: V0's eviction flag (the value below it is kept)
#: The largest BASE a slot takes.  BASE grows only by what a slot's last word lies above its new
#: tenant's least value (a GCRA key's remaining debt; what a window counter's old window ends after
#: the new one's), and shrinks as the clock passes what a slot held; a slot that would pass it is
#: passed by for the next of its window (none left: the new key is refused, ``keyed_cells.WORN``).
BASE_MAX = 1 << 61

# the value kind GCRA: V0 = the TAT under a burst of MAX_TICKS (ticks; see ``keyed_cells``),
# V1 = grants, V3..V4 = display
#: A burst's ticks stay below this (2**60 ticks = 2.3 years); a key's TAT under its own burst TAU
#: is V0 less BASE less ``MAX_TICKS - TAU``.
MAX_TICKS = 1 << 60
#: Clock readings (ns) a key's schedule holds: a word is ``now`` in ticks plus at most a wait
#: (``MAX_WAIT``), a burst (``MAX_TICKS``) and a ``BASE`` (below ``BASE_MAX``), which stays below
#: ``DEAD`` only while ``now`` is below 2**62 ticks (9 years of CLOCK_MONOTONIC).
MAX_NOW_NS = 1 << (62 - TICK_SHIFT)
#: Key bytes kept for display when a table's users ask (``store_keys``): V3..V4 less a length byte.
DISPLAY_BYTES = 15


def overrides_offset(pslots: int = PSLOTS) -> int:
    return HEADER_BYTES + pslots * LINE


def slots_offset(novr: int, pslots: int = PSLOTS) -> int:
    return overrides_offset(pslots) + novr * OVR_LINES * LINE


def moving_stride(ring: int) -> int:
    """Bytes of one moving-window slot: its slot line, then its log of ``ring`` words."""
    return LINE + ring * 8


def moving_offset(nkeys: int, novr: int, pslots: int = PSLOTS) -> int:
    return slots_offset(novr, pslots) + nkeys * SLOT_BYTES


def segment_size(nkeys: int, novr: int, pslots: int = PSLOTS, mkeys: int = 0, ring: int = 0) -> int:
    return moving_offset(nkeys, novr, pslots) + mkeys * moving_stride(ring)


#: A moving-window log holds at most this many words (a power of two, as every ring is): a key
#: holds at most its ring less 2 grants in one window (``keyed.windows``).
MAX_RING = 1 << 15
MIN_RING = 8
#: The moving-window region of a table is at most this many bytes.
MAX_MOVING_BYTES = 1 << 32


def ctrl(state: int, pid: int, gen: int) -> int:
    return state | (pid & 0xFFFFFFFF) << 8 | (gen & 0xFFFFFF) << 40


#: An inserter's owner field in CTRL: its pid (below 2**22, Linux's PID_MAX_LIMIT) and above it a
#: 10-bit tag of its PID namespace, so that processes of another namespace sharing /dev/shm are
#: never judged by a pid that means nothing here.
PID_BITS = 22


def owner(pid: int) -> int:
    """This process's owner field: ``pid | namespace tag << PID_BITS``."""
    tag = pid_namespace() & 0x3FF  # 0 when /proc cannot tell
    return (pid & ((1 << PID_BITS) - 1)) | tag << PID_BITS
