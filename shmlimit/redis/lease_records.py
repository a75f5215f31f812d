"""Hierarchical mode's lease records: when leased tokens expire, and when the feeder must look.

Each delivered batch leaves a record in the segment: one word, (the earliest
moment it could be due, in whole ms, rounded down: expiry only earlier) <<
``RECORD_OPS_BITS`` | its ops, stored with one store into a ring of
``UP_RECORDS`` slots chosen by a fetch-add, so racing fillers never mix one
batch's time with another's size.  A record ends ``ttl`` after its stamp.
The bucket may hold at most the ops of the records young at any instant:
``expire`` burns the rest, ``next_expiry`` finds when that would next be
broken and ``nap_for_end`` when to wake for it.

The feeder naps no shorter than a floor (``upstream.MIN_TICK``), so a check
burns, with the records that ended, those ending within that floor
(``ahead_ns``): a little early, never late.  The wake for a record's end is
planned that long before it and is never floored past it: with every nap
floored, a record ending less than the floor after a wake outlived its end
until the next one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, Optional

from shmlimit.shm import layout as L

if TYPE_CHECKING:  # pragma: no cover
    from shmlimit.bucket.rovers import Bucket

__all__ = ["RECORD_OPS_BITS", "RECORD_MAX_OPS", "LeaseRecords", "record"]

#: A lease record: (stamp in ms << RECORD_OPS_BITS) | ops; a batch holds at most RECORD_MAX_OPS.
RECORD_OPS_BITS = 24
RECORD_MAX_OPS = (1 << RECORD_OPS_BITS) - 1


def record(stamp_ns: int, ops: int) -> int:
    """One lease record word: the stamp in whole ms (rounded down: expiry only earlier) and the ops."""
    return ((stamp_ns // 1_000_000) << RECORD_OPS_BITS) | ops


class LeaseRecords:
    """The ring of lease records of one bucket, read and written through its cells."""

    def __init__(self, bucket: "Bucket", ttl_ns: int, ahead_ns: int) -> None:
        self.bucket = bucket
        self.cells = bucket.cells
        self.ttl_ns = ttl_ns
        #: a check counts ended the records ending within this long (the feeder's shortest nap)
        self.ahead_ns = ahead_ns

    def write(self, stamp_ns: int, ops: int) -> int:
        """Store the record of a batch about to be delivered, in the next slot of the ring; its word."""
        c = self.cells
        slot = c.fetch_add(L.UP_LEASES, 1) % L.UP_RECORDS
        word = record(stamp_ns, ops)
        c.store(L.UP_RECORD + 8 * slot, word)
        return word

    def end(self, word: int) -> int:
        """When the lease record ``word`` ends (monotonic ns)."""
        return (word >> RECORD_OPS_BITS) * 1_000_000 + self.ttl_ns

    def young_from(self, now: int) -> int:
        """The least record word a check at ``now`` counts young: one comparison per record (its end
        is ``ms * 1e6 + ttl``, ended when at most ``now + ahead_ns``, its ops below the ms)."""
        return ((now + self.ahead_ns - self.ttl_ns) // 1_000_000 + 1) << RECORD_OPS_BITS

    def expire(self, now: int) -> int:
        """Burn the tokens beyond those of the ring's records still young ``ahead_ns`` after ``now``,
        counted in ``UP_EXPIRED``; return the tokens burned.

        Those ending sooner are burned now, a little early rather than late:
        the feeder may not wake again sooner.  A record pushed out of the ring
        before its end no longer counts here (its tokens burn early); the
        feeder that wrote it still plans a wake for its end (``next_expiry``).
        """
        b = self.bucket
        if b.balance() <= 0:  # nothing held (callers queued: saturation): no ring to read
            return 0
        c = self.cells
        keep = 0
        young = self.young_from(now)
        for i in range(L.UP_RECORDS):
            word = c.load(L.UP_RECORD + 8 * i)
            if word >= young:
                keep += word & RECORD_MAX_OPS
        burned = b.burn(keep * b.cost)
        if burned:
            c.fetch_add(L.UP_EXPIRED, burned // b.cost)
        return burned

    def next_expiry(self, now: int, mine: Iterable[int] = ()) -> Optional[int]:
        """When the bucket first holds more than the records young then cover: a record's end (the
        check for it is planned ``ahead_ns`` before: ``nap_for_end``), or None.

        Tokens enter the bucket only with a record, so only a record ending
        while the bucket holds more than the younger records cover needs a
        wake; a delivery after this plans the next one.  The records are the
        ring's and ``mine``, those this process wrote (one pushed out of the
        ring still covers its tokens until it ends: the check at its end burns
        them, as the ring no longer covers them).
        """
        held = self.bucket.balance()
        if held <= 0:
            return None  # nothing held: only a delivery puts tokens in, and it plans again
        c = self.cells
        words = {c.load(L.UP_RECORD + 8 * i) for i in range(L.UP_RECORDS)} | set(mine)
        live = [(self.end(w), w & RECORD_MAX_OPS) for w in words if w and self.end(w) > now]
        keep = sum(ops for _, ops in live)
        for end, ops in sorted(live):
            keep -= ops
            if held > keep * self.bucket.cost:
                return end
        return None

    def nap_for_end(self, now: int, end: int) -> int:
        """How long (ns) to sleep at ``now`` for the check that burns the tokens of a record ending at
        ``end`` (later than ``now``).

        A check burns what ends within ``ahead_ns``, so the wake is planned
        that long before the end: one that comes up to that much late still
        checks in time.  The nap is no shorter than ``ahead_ns`` unless the
        end itself is nearer (tokens added since the last check, whose record
        ends within ``ahead_ns`` of it: rare, and once per such record):
        flooring it would carry the wake past the end, and tokens would
        outlive their record by up to the floor.
        """
        ahead = self.ahead_ns
        return min(end - now, max(ahead, end - ahead - now))
