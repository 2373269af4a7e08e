"""plan: regions, key matching, conversions and per-rank bucket segments (pure: no I/O)."""
