"""Exceptions raised by shmlimit.  Every one names what was wrong and what is allowed."""
from __future__ import annotations


class ShmlimitError(Exception):
    """Base class of shmlimit's own errors."""


class LimiterNotFoundError(ShmlimitError, FileNotFoundError):
    """No limiter segment exists under that name."""

    def __init__(self, name: str) -> None:
        super().__init__(f"no shmlimit limiter named {name!r} exists on this machine")
        self.name = name


class ConfigMismatchError(ShmlimitError, ValueError):
    """The segment exists with a configuration different from the one asked for."""

    def __init__(self, name: str, existing: object, requested: object) -> None:
        super().__init__(
            f"limiter {name!r} already exists with {existing}; this call asked for {requested}. "
            f"Attach with shmlimit.attach({name!r}) to use it as it is, or unlink it first."
        )
        self.name = name
        self.existing = existing
        self.requested = requested


class SegmentError(ShmlimitError):
    """A segment under that name is corrupt, foreign, truncated or of another layout version."""
