"""Keyed tables: one value per key in one segment (GCRA, window counters)."""
