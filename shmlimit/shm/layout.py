"""The segment's fixed, versioned layout: byte offsets of every word.

Every word is an unsigned 64-bit cell (see ``cells``).  Words written on every
grant or fill sit alone on their own 64-byte cache line so that grabbers, the
filler and the process table never false-share.

    line  0  header    MAGIC VERSION SIZE STATE SLOTS CREATOR_PID CREATED_NS -
    line  1  config    CFG_SEQ RATE PER BURST TPN COST CAP FLAGS
    line  2  config    RATIO MAX_RESERVED MAX_BEHIND (IEEE-754 bits; +inf = unbounded), then
                       GEN SUM (the live bank's), - -, BEYOND: processes attached beyond the table
    line  3  TAIL      tail rover: advanced by grabbers (fetch-add or CAS)
    line  4  HEAD      head rover: advanced by replenish (CAS)
    line  5  INFLIGHT  capped-release mode only: ops admitted and not yet released; then the
                       backup config bank (continued in line 7; line 2 ends with the live GEN, SUM)
    line  6  REPL_TS SNAP_HEAD SNAP_TAIL: last replenish time and the rovers read just before it;
                       STARVED_NS: schedule time the clamp could not credit while callers queued;
                       SNAP_BASE SNAP_END SNAP_NEXT: the next replenish's clamp, from that snapshot
    line  7  LEASE     filler lease: (expiry_us << 12) | (slot + 1), 0 = free
    line  8  UNREG_GRANTS: grants of processes beyond the table; UP_WANTING: since when callers of
                       hierarchical mode have wanted tokens (the fillers' view, for the starved count);
                       ADAPT_THROTTLED ADAPT_OK: outcomes reported; ADAPT_START ADAPT_SEEN_*: the
                       adaptive rate's window (its start, the counters and the tail then)
    line  9  WAIT      the waiting pool: schedule time not used while the bucket was full (catch-up);
                       UP_WAKE: the futex word hierarchical mode's waiters sleep on; ADAPT_MIN
                       ADAPT_MAX ADAPT_DECREASE ADAPT_INCREASE ADAPT_WINDOW: the adaptive rate's
                       parameters (under the config lock); ADAPT_DECISIONS: its cuts and raises
    line 10  UP_*      upstream (hierarchical mode) state and counters, written by the filler
    line 11  UP_RECORD the ring of lease records, UP_LEASES, UP_NEXT_NS; UP_LINE_TAIL/HEAD (unused: zero)
    lines 12..15 UP_DESC   the upstream's description (JSON), written once by the creator
    then SLOTS process slots of one line each: PID START GRANTS WAITING BASE PIDNS TICKET TICKET_LEN
    then SLOTS ticket lines, one per slot: four more (TICKET, TICKET_LEN) records of its owner's
    then SLOTS in-flight lines, one per slot: SLOT_INFLIGHT, capped mode's ops in flight of its owner
    then the reservation fences: one line (FENCE_HINT: the latest DUE ever stored), then
                       FENCE_RECORDS records of four words, two a line: START LIMIT DUE TOKENS:
                       the head stays at most at LIMIT until DUE

Values that are not integers (rate, per, burst) are stored as IEEE-754 bits.
The ten config values of each bank are stored XOR-ed with ``bank_mask(GEN, i)``:
read them only through ``config_banks``.
"""

from __future__ import annotations

import functools
import struct

MAGIC = int.from_bytes(b"SHMLIMIT", "little")
#: 2: capped mode counts ops in flight (INFLIGHT) instead of a ceil rover in tokens; the config
#: is published in two checksummed banks (a stalled writer that resumes cannot corrupt it).
#: 3: every process slot has five ticket records (one in its line, four in its ticket line).
#: 4: every process slot has a third line: its owner's ops in flight in capped mode (``SLOT_INFLIGHT``).
#: 5: a config bank's values are stored masked by their generation (``bank_mask``) and written
#: word by word by CAS under a lock check, so late config writers, however many, miss newer words.
#: 6: a table of reservation fences after the in-flight lines (``fence_offset``): a reservation
#: holds the head at most at ``t + C - n`` until its promise (docs/design.md, "Reservation fences").
#: 7: the adaptive rate's words (``ADAPT_*``) in the spare words of lines 8 and 9: a process of
#: version 6 would neither count outcomes nor decide, and must not join a fleet that adapts.
#: 8: ADAPT_START's low bit says the window's marks are written (a claimer lost before them
#: costs one decision, never an outcome judged twice); version 7 would judge every window.
#: 9: BEYOND counts the processes attached beyond the process table: gc, not seeing them, took
#: the segment from under them (version 8 neither counts nor looks).
#: 10: a fence record holds its reservation's START and TOKENS (OWNER and FENCE_GEN are gone): a
#: claim keeps a reservation's own time from the callers ahead of it when the head runs late
#: (``words.fence_reserved``); version 9 would neither write them nor keep it.
VERSION = 10
LINE = 64


def words(line: int, count: int) -> range:
    """The byte offsets of the first ``count`` words of ``line``, in order (a layout states its lines' words)."""
    return range(line * LINE, line * LINE + count * 8, 8)


# line 0: header, written once by the creator before STATE becomes READY.  Every kind of segment
# (keyed_layout's too) begins with these words, so one protocol creates and checks it
# (segment.start_header, segment.publish) and a reader can tell the kinds apart by MAGIC.
MAGIC_OFF = 0
VERSION_OFF = 8
SIZE_OFF = 16
STATE_OFF = 24
SLOTS_OFF = 32
CREATOR_PID_OFF = 40
CREATED_NS_OFF = 48

STATE_INIT = 0
STATE_READY = 1
#: Claimed by a garbage collector (CAS from READY) that is about to unlink the segment once it has
#: checked again that no process is attached; a process that registers and then finds this state
#: gives its slot back and opens the name again.
STATE_DOOMED = 2

# line 1: configuration (keyed_layout's line 1 begins with the same four words)
CFG_SEQ = 64
CFG_RATE = 72
CFG_PER = 80
CFG_BURST = 88
CFG_TPN = 96
CFG_COST = 104
CFG_CAP = 112
CFG_FLAGS = 120
FLAG_CAPPED = 1
FLAG_STOPPED = 2
#: Fed by an upstream (hierarchical mode): tokens come from leases, not from the clock ...
FLAG_UPSTREAM = 4
#: ... except while the upstream is unreachable and the fallback is "local" (the clock again) ...
FLAG_FALLBACK_LOCAL = 8
#: ... or "open" (no limit at all until the upstream answers again).
FLAG_FALLBACK_OPEN = 16
UPSTREAM_FLAGS = FLAG_UPSTREAM | FLAG_FALLBACK_LOCAL | FLAG_FALLBACK_OPEN
# line 2: configuration of catch-up and reservations
CFG_RATIO = 128
CFG_MAX_RESERVED = 136
CFG_MAX_BEHIND = 144
#: The generation (the even CFG_SEQ it was published as) and checksum of the live config bank.
CFG_GEN = 152
CFG_SUM = 160
#: The processes attached beyond the process table (every slot held by a live process): each adds
#: one when it finds no slot and takes it back when it leaves (``table.ProcessTable``), so that
#: ``gc`` sees them.  The same word in every kind's layout (the keyed one's line 2 too).
BEYOND = 2 * LINE + 56
#: The live bank's ten words, in checksum order.
CFG_BANK = (
    CFG_RATE,
    CFG_PER,
    CFG_BURST,
    CFG_TPN,
    CFG_COST,
    CFG_CAP,
    CFG_FLAGS,
    CFG_RATIO,
    CFG_MAX_RESERVED,
    CFG_MAX_BEHIND,
)

# rovers and the replenish record
TAIL = 3 * LINE
HEAD = 4 * LINE
INFLIGHT = 5 * LINE
REPL_TS = 6 * LINE
SNAP_HEAD = 6 * LINE + 8
SNAP_TAIL = 6 * LINE + 16
#: ns of schedule time a replenish could not credit (the capacity clamp) while callers queued:
#: time owed to them that no replenish came soon enough to credit (filler and waiters starved of
#: the CPU): lost, or with catch-up deferred to WAIT.  Only ever grows; zero in a segment written
#: before it existed.
STARVED_NS = 6 * LINE + 24
#: The clamp of the next replenish, computed by the replenish that left the snapshot (from the
#: ticket records, see ``Bucket.claim``): it may bring the head to
#: ``min(max(SNAP_BASE + CAP, SNAP_END), SNAP_NEXT)``.  SNAP_BASE is the start of the request the
#: snapshot's head stands in (the head itself outside any waiter's), SNAP_END that request's end,
#: SNAP_NEXT the nearest boundary above the head that the records tell.  Each word on its own is
#: a safe bound for any later interval, so a reader that sees words of two replenishes (one
#: still writing) is never looser than either.  Zero in a segment written before they existed:
#: the first replenish there adds nothing and writes them.
SNAP_BASE = 6 * LINE + 32
SNAP_END = 6 * LINE + 40
SNAP_NEXT = 6 * LINE + 48

# filler lease
LEASE = 7 * LINE
LEASE_SLOT_BITS = 12

# counters
UNREG_GRANTS = 8 * LINE
#: Hierarchical mode: CLOCK_MONOTONIC ns since when callers have wanted tokens without a pause any
#: filler saw (0: they did not at the filler's last look).  In the segment, not in the filler, so a
#: filler that takes over knows how long a gap it finds in the global schedule has been starving
#: them.  Zero in a segment written before it existed: such gaps are then counted from the
#: new filler's first look only.
UP_WANTING = 8 * LINE + 8

# catch-up
WAIT = 9 * LINE
#: Hierarchical mode: bumped by whoever moves the head (an added batch, forgive, a fallback switch),
#: which then wakes the waiters asleep on its low 32 bits (a futex) whose tickets it covered.
#: Zero in a segment written before it existed: a wait on it is still bounded by its deadline.
UP_WAKE = 9 * LINE + 8

# The adaptive rate (``adapt``); all zero for a limiter without ``adapt=``.  Every process counts
# the outcomes it is told of (one fetch-add); the report that finds the window over decides it,
# claiming it by a CAS on ADAPT_START, and publishes the rate through the config banks.
ADAPT_THROTTLED = 8 * LINE + 16  #: outcomes reported as throttled (429, 503), ever
ADAPT_OK = 8 * LINE + 24  #: outcomes reported as not throttled, ever
#: CLOCK_MONOTONIC ns the current window began, its low bit set once the marks below are
#: written (0: none yet)
ADAPT_START = 8 * LINE + 32
ADAPT_SEEN_THROTTLED = 8 * LINE + 40  #: ADAPT_THROTTLED when the current window began
ADAPT_SEEN_OK = 8 * LINE + 48  #: ADAPT_OK when the current window began
ADAPT_SEEN_TAIL = 8 * LINE + 56  #: TAIL when the current window began
#: The parameters (IEEE-754 bits), written by the creator before READY, or by a reconfigure
#: under the config lock (``adapt.write``, ``adapt.read``); ADAPT_MAX 0: no adapt.
ADAPT_MIN = 9 * LINE + 16
ADAPT_MAX = 9 * LINE + 24
ADAPT_DECREASE = 9 * LINE + 32
ADAPT_INCREASE = 9 * LINE + 40
ADAPT_WINDOW = 9 * LINE + 48
#: The decisions made: cuts << 32 | raises (each wrapping at 2**32).
ADAPT_DECISIONS = 9 * LINE + 56
ADAPT_PARAMS = (ADAPT_MIN, ADAPT_MAX, ADAPT_DECREASE, ADAPT_INCREASE, ADAPT_WINDOW)

# upstream (hierarchical mode); all zero otherwise
UP_STATE = 10 * LINE  # 0 ok, else the fallback in force: 1 local, 2 open, 3 closed
UP_ROUND_TRIPS = 10 * LINE + 8
UP_LEASED = 10 * LINE + 16  # ops leased from upstream
UP_EXPIRED = 10 * LINE + 24  # ops leased but void: unused within the lease's time to live
UP_ERRORS = 10 * LINE + 32  # upstream calls that failed
UP_FALLBACKS = 10 * LINE + 40  # times a fallback was entered
UP_REFUSED = 10 * LINE + 48  # lease requests that found nothing available upstream
UP_HUNGRY = 10 * LINE + 56  # CLOCK_MONOTONIC ns when a caller last found no token without queueing
#: A ring of lease records, one word each: (CLOCK_MONOTONIC ms when the batch was due, at the
#: earliest) << 24 | its ops; written with one store into slot UP_LEASES % UP_RECORDS.
UP_RECORD = 11 * LINE
UP_RECORDS = 4
UP_LEASES = (
    11 * LINE + 32
)  # leases delivered (UP_LEASED / UP_LEASES = the average batch); the ring's index
UP_NEXT_NS = 11 * LINE + 40  # CLOCK_MONOTONIC ns when the filler next expects tokens (0: unknown)
#: Unused (zero) since hierarchical mode's timed waiters hold tickets: they counted the ops of the
#: timed waiters that joined its line and of those that left it.
UP_LINE_TAIL = 11 * LINE + 48
UP_LINE_HEAD = 11 * LINE + 56
UP_DESC_LEN = 12 * LINE  # bytes of JSON that follow
UP_DESC = 12 * LINE + 8
UP_DESC_MAX = 4 * LINE - 8

# The backup config bank: the same ten words, then its generation and checksum, in the spare
# words of lines 5 and 7 (read and written only when the config changes, so sharing those lines
# with INFLIGHT and LEASE costs nothing on the hot path).  Both banks store their values masked by
# their generation (``bank_mask``); a writer writes first the bank not holding the newest valid
# config, each word by CAS under a lock check; readers take the first bank whose checksum holds for
# the generation in force (see config_banks).
_SPARE = tuple(5 * LINE + 8 * i for i in range(1, 8)) + tuple(7 * LINE + 8 * i for i in range(1, 6))
CFG_BACKUP_BANK = _SPARE[:10]
CFG_BACKUP_GEN = _SPARE[10]
CFG_BACKUP_SUM = _SPARE[11]

HEADER_BYTES = 16 * LINE

# process table
SLOT_BYTES = LINE
SLOT_PID = 0
SLOT_START = 8
SLOT_GRANTS = 16
SLOT_WAITING = 24
#: GRANTS counts every grant ever made through the slot, by all its owners in turn; BASE is
#: GRANTS when the current owner registered.  Nothing is ever moved between words, so a
#: process killed at any instant loses no grant from the total.
SLOT_BASE = 32
#: The inode of the owner's PID namespace (0: not recorded).  PID and START mean something only
#: in that namespace: a process in another one (a container sharing /dev/shm) cannot judge them.
SLOT_PIDNS = 40
#: A ticket one of the owner's waiters holds, recorded so that it can be given back if the owner
#: dies while queued (see ``giveback``): its end (the ticket) and its length in tokens.  LEN is 0
#: when nothing is recorded, TICKET_BUSY while a waiter is writing the pair, and has TICKET_GIVEN
#: set once the owner gave the range back (whoever finds it then may skip it).  This is the
#: slot's first record; its ticket line (``ticket_records``) holds TICKET_RECORDS - 1 more.  In
#: every record TICKET is the word just before TICKET_LEN.
SLOT_TICKET = 48
SLOT_TICKET_LEN = 56
TICKET_BUSY = 1 << 63
TICKET_GIVEN = 1 << 62
TICKET_RECORDS = 5
DEFAULT_SLOTS = 128
#: The table can be no larger than the lease word can name.
MAX_SLOTS = (1 << LEASE_SLOT_BITS) - 1


def slot_offset(index: int) -> int:
    return HEADER_BYTES + index * SLOT_BYTES


#: Reservation fences (``fences``): records of (START, LIMIT, DUE, TOKENS), one per reservation
#: not yet due.  LIMIT is the rover the head may not pass before DUE (CLOCK_MONOTONIC ns), after
#: which it gains on LIMIT only at the rate; DUE 0 or before the last replenish's time (REPL_TS):
#: free (a taker claims one by CAS of its DUE).  START and TOKENS are the reservation's range
#: (TOKENS's high bit: the head was found late for it, ``words.fence_reserved``).  FENCE_HINT is
#: the largest DUE ever stored (raised by CAS): a claim whose interval starts at or after it reads
#: no record.
FENCE_RECORDS = 64
FENCE_RECORD_BYTES = 32
FENCE_START = 0
FENCE_LIMIT = 8
FENCE_DUE = 16
FENCE_TOKENS = 24
FENCE_LINES = 1 + FENCE_RECORDS * FENCE_RECORD_BYTES // LINE


def segment_size(slots: int) -> int:
    return HEADER_BYTES + slots * (SLOT_BYTES + 2 * LINE) + FENCE_LINES * LINE


def fence_offset(slots: int) -> int:
    """The fence table's first line (FENCE_HINT) in a table of ``slots``; its records follow."""
    return HEADER_BYTES + slots * (SLOT_BYTES + 2 * LINE)


def fence_records(slots: int) -> tuple:
    """Every fence record's first word (START; LIMIT, DUE and TOKENS follow) in a table of ``slots``."""
    first = fence_offset(slots) + LINE
    return tuple(first + k * FENCE_RECORD_BYTES for k in range(FENCE_RECORDS))


def inflight_offset(slots: int, index: int) -> int:
    """Slot ``index``'s SLOT_INFLIGHT (in a table of ``slots``): capped mode's ops granted to its
    owner and not released, given back by a filler's reap once the owner is gone (``inflight``)."""
    return HEADER_BYTES + slots * (SLOT_BYTES + LINE) + index * LINE


def ticket_records(slots: int, index: int) -> tuple:
    """The (TICKET, TICKET_LEN) offsets of slot ``index``'s records, in a table of ``slots``."""
    base = slot_offset(index)
    line = HEADER_BYTES + slots * SLOT_BYTES + index * LINE
    return ((base + SLOT_TICKET, base + SLOT_TICKET_LEN),) + tuple(
        (line + 16 * k, line + 16 * k + 8) for k in range(TICKET_RECORDS - 1)
    )


@functools.lru_cache(maxsize=8)
def record_lens(slots: int) -> tuple:
    """Every ticket record's LEN offset in a table of ``slots`` (its TICKET is the word before),
    each slot's ``TICKET_RECORDS`` in order; kept for the last few sizes (a reap reads it each time)."""
    return tuple(len_off for i in range(slots) for _, len_off in ticket_records(slots, i))


def f2u(x: float) -> int:
    return struct.unpack("<Q", struct.pack("<d", x))[0]


def u2f(u: int) -> float:
    return struct.unpack("<d", struct.pack("<Q", u))[0]


def config_sum(gen: int, values) -> int:
    """Checksum of one config bank for generation ``gen``: any torn or foreign write breaks it."""
    h = (gen * 0x9E3779B97F4A7C15 + 0x632BE59BD9B4E019) & 0xFFFFFFFFFFFFFFFF
    for v in values:
        h ^= v
        h = (h * 0xFF51AFD7ED558CCD) & 0xFFFFFFFFFFFFFFFF
        h ^= h >> 33
    return h


def bank_mask(gen: int, i: int) -> int:
    """What the ``i``-th value word of a config bank of generation ``gen`` is stored XOR-ed with.

    Every writer has a generation of its own, so no two writers store the same
    word (bar a 2**-64 collision) even for the same value: a late writer's CAS,
    which expects a word it loaded before a newer writer took the lock, can
    never land on a word that newer writer stored (``config_banks``, and the keyed
    banks alike: ``keyed_gcra``).
    """
    return config_sum(gen, (i,))


# ---- a limiter of several rates (plain or keyed): one segment, a header, then one whole layout
#      per rate
#
#     offset 0        line 0 as every kind's (MAGIC = GROUP_MAGIC, VERSION = GROUP_VERSION, SIZE,
#                     STATE, SLOTS, CREATOR_PID, CREATED_NS), then GROUP_COUNT GROUP_NAMED
#                     GROUP_FIRST GROUP_STRIDE GROUP_REGIONS GROUP_TABLE_KEYS GROUP_TABLE_OVR,
#                     then the rates' keys (ASCII, NUL-separated)
#     GROUP_FIRST + i * GROUP_STRIDE
#                     rate i: a limiter's layout (line 0 with MAGIC, its own STATE, table, fences),
#                     or a keyed table's (GROUP_REGIONS = REGIONS_KEYED: line 0 with the keyed
#                     MAGIC, GROUP_TABLE_KEYS key slots, GROUP_TABLE_OVR override slots; SLOTS is
#                     then the keyed layout's process slots)
#
# Each rate's region starts on an mmap boundary, so that a process maps it alone and every
# module below the limiters reads it as it reads a limiter's own segment.  The group's STATE says
# whether the regions are ready (READY is stored after every region's); each region's own STATE
# is the one a collector claims (``group.collect``), as for a single rate.
GROUP_MAGIC = int.from_bytes(b"SHMLRATE", "little")
GROUP_VERSION = 2  # 2: GROUP_REGIONS (a version 1 reader would take keyed regions for limiters)
GROUP_COUNT = 64
GROUP_NAMED = 72
GROUP_FIRST = 80
GROUP_STRIDE = 88
GROUP_REGIONS = 96
GROUP_TABLE_KEYS = 104
GROUP_TABLE_OVR = 112
#: GROUP_REGIONS: every region is a limiter's layout, or every region is a keyed table's.
REGIONS_LIMITER = 0
REGIONS_KEYED = 1
GROUP_KEYS = 2 * LINE
#: The keys' bytes: every rate's key and a NUL after it.
GROUP_KEYS_BYTES = 14 * LINE
GROUP_HEADER_BYTES = GROUP_KEYS + GROUP_KEYS_BYTES


def group_geometry(region_bytes: int, granularity: int) -> tuple:
    """(first, stride): where a group's first region starts and the distance between regions, in
    bytes, for regions of ``region_bytes`` on a machine whose mappings start on ``granularity``."""
    first = -(-GROUP_HEADER_BYTES // granularity) * granularity
    stride = -(-region_bytes // granularity) * granularity
    return first, stride


def group_size(first: int, stride: int, count: int) -> int:
    return first + count * stride
