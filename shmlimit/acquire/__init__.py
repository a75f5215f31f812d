"""Acquisition: one non-blocking step per kind and the drivers that run it."""
