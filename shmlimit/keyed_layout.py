"""The keyed segment's fixed, versioned layout: byte offsets of every word.

A keyed segment holds many independent limits, one per key, in a table of
64-byte slots.  Every word is an unsigned 64-bit cell (see ``cells``).

    line  0  header     MAGIC VERSION SIZE STATE PSLOTS CREATOR_PID CREATED_NS KIND (1 GCRA, 2 windows)
    line  1  config     CFG_SEQ RATE PER BURST T TAU - -   (RATE PER BURST: IEEE-754 bits)
    line  2  geometry   NKEYS NOVR PROBE SECRET0 SECRET1 - - -
    line  3  KEYS_LIVE  keys in LIVE slots
    line  4  EVICTED    keys given up (their bucket was full again)
    line  5  REFUSED    new keys refused: every slot of their window held a limited key
    line  6  OVR_LIVE   live overrides (the override table is probed only when nonzero)
    line  7  UNREG_GRANTS: grants of processes beyond the process table
    lines 8..15  reserved (zero)
    then PSLOTS process slots of one line each: PID START GRANTS WAITING BASE - - -
         (the format of ``table.ProcessTable``, at the same offset as in a Limiter segment)
    then NOVR override entries:  CTRL D0 D1 T TAU RATE PER BURST   (CTRL 0 empty, 1 live, 2 tomb)
    then NKEYS key slots:        CTRL D0 D1 V0 V1 V2 V3 V4

``T`` is the emission interval (ticks per op) and ``TAU`` the burst tolerance
(ticks); a tick is 1/16 ns of CLOCK_MONOTONIC.  A slot's words: ``CTRL`` =
state | owner pid << 8 | generation << 40, ``D0 D1`` the key's 128-bit keyed
digest (SipHash-2-4-128 under the segment's secret), ``V0..V4`` the value
kind's words.  The slot protocol (``keyed_cells``) knows one thing about
values: ``V0`` is the expiry word (see there).
"""
from __future__ import annotations

import os

MAGIC = int.from_bytes(b"SHMLKEYS", "little")
VERSION = 1
LINE = 64

MAGIC_OFF = 0
VERSION_OFF = 8
SIZE_OFF = 16
STATE_OFF = 24
PSLOTS_OFF = 32
CREATOR_PID_OFF = 40
CREATED_NS_OFF = 48
KIND_OFF = 56

STATE_INIT = 0
STATE_READY = 1

#: Value kinds a keyed table may hold.  The slot protocol is the same for all of them.
KIND_GCRA = 1
#: Window counters (fixed window, sliding window counter: ``keyed_windows``), the ``limits`` storage's
#: table; its config line is zero and it has no override entries.
KIND_WINDOWS = 2
KINDS = (KIND_GCRA, KIND_WINDOWS)

CFG_SEQ = 64
CFG_RATE = 72
CFG_PER = 80
CFG_BURST = 88
CFG_T = 96
CFG_TAU = 104

NKEYS_OFF = 128
NOVR_OFF = 136
PROBE_OFF = 144
SECRET0_OFF = 152
SECRET1_OFF = 160

KEYS_LIVE = 3 * LINE
EVICTED = 4 * LINE
REFUSED = 5 * LINE
OVR_LIVE = 6 * LINE
UNREG_GRANTS = 7 * LINE

HEADER_BYTES = 16 * LINE
PSLOTS = 128

# a key slot (word offsets within its line)
S_CTRL = 0
S_D0 = 8
S_D1 = 16
S_V0 = 24
S_V1 = 32
S_V2 = 40
S_V3 = 48
S_V4 = 56
SLOT_BYTES = LINE

# slot states (CTRL & 0xff)
EMPTY = 0
BUSY = 1  #: claimed by its owner; the digest is not valid yet
PEND = 2  #: digest valid; the owner checks for a concurrent insert of the same key
LIVE = 3
TOMB = 4

# an override entry (word offsets within its line)
O_CTRL = 0
O_D0 = 8
O_D1 = 16
O_T = 24
O_TAU = 32
O_RATE = 40
O_PER = 48
O_BURST = 56
O_EMPTY, O_LIVE, O_TOMB = 0, 1, 2

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

# the value kind GCRA: V0 = theoretical arrival time (ticks), V1 = grants, V2..V4 = display
DISPLAY_BYTES = 23


def overrides_offset(pslots: int = PSLOTS) -> int:
    return HEADER_BYTES + pslots * LINE


def slots_offset(novr: int, pslots: int = PSLOTS) -> int:
    return overrides_offset(pslots) + novr * LINE


def segment_size(nkeys: int, novr: int, pslots: int = PSLOTS) -> int:
    return slots_offset(novr, pslots) + nkeys * SLOT_BYTES


def ctrl(state: int, pid: int, gen: int) -> int:
    return state | (pid & 0xFFFFFFFF) << 8 | (gen & 0xFFFFFF) << 40


#: An inserter's owner field in CTRL: its pid (below 2**22, Linux's PID_MAX_LIMIT) and above it a
#: 10-bit tag of its PID namespace, so that processes of another namespace sharing /dev/shm are
#: never judged by a pid that means nothing here.
PID_BITS = 22


def owner(pid: int) -> int:
    """This process's owner field: ``pid | namespace tag << PID_BITS``."""
    try:
        tag = os.stat("/proc/self/ns/pid").st_ino & 0x3FF
    except OSError:  # pragma: no cover - no /proc
        tag = 0
    return (pid & ((1 << PID_BITS) - 1)) | tag << PID_BITS
