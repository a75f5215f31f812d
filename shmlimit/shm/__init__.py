"""The shared-memory substrate: layout, atomic cells, segments, the process table."""
