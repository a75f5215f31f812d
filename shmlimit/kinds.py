"""Entry points that work for every kind of limiter a name may hold: attach and inspect.

A segment's first word says its kind (``layout.MAGIC`` for a ``Limiter``,
``keyed_layout.MAGIC`` for a ``KeyedLimiter``); it is read with ``pread``,
without mapping, and each kind's own module then opens and validates it.
"""

from __future__ import annotations

from typing import Iterable, Union

from shmlimit.keyed.limiter import KeyedLimiter, KeyedStats, inspect_keyed
from shmlimit.keyed.segment import is_keyed
from shmlimit.limiter import Limiter
from shmlimit.limiter import attach as attach_limiter
from shmlimit.shm.segment import validate_name
from shmlimit.stats import Stats
from shmlimit.stats import inspect as inspect_limiter


def attach(
    name: str, *, mode: int = 0o600, trusted_uids: Iterable[int] = ()
) -> Union[Limiter, KeyedLimiter]:
    """Attach to an existing limiter by name, whatever its kind and configuration.

    Returns a ``KeyedLimiter`` for a keyed segment, else a ``Limiter``.  Raises
    ``LimiterNotFoundError`` (a ``FileNotFoundError``) naming it when none exists,
    and a ``SegmentError`` (``UntrustedSegmentError`` for a ``Limiter``) for a
    segment owned by another user (other than root and ``trusted_uids``) or
    writable by group or others beyond ``mode``.
    """
    validate_name(name)
    if is_keyed(name):
        return KeyedLimiter(name, mode=mode, trusted_uids=trusted_uids)
    return attach_limiter(name, mode=mode, trusted_uids=trusted_uids)


def inspect(name: str) -> Union[Stats, KeyedStats]:
    """A snapshot of a limiter of either kind, read without joining it (nothing is written)."""
    validate_name(name)
    return inspect_keyed(name) if is_keyed(name) else inspect_limiter(name)
