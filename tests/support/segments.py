"""Segments seen from outside the atomic layer."""
from __future__ import annotations


def shm_bytes(name: str) -> bytes:
    """The segment's raw bytes, read through the filesystem (not the atomic layer)."""
    with open(f"/dev/shm/shmlimit.{name}", "rb") as f:
        return f.read()
