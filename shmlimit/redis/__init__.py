"""The Redis tier: direct limiters across hosts, and hierarchical mode's feeder."""
