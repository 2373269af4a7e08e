"""save: the plan run backwards (layout, per-rank write pieces, writers, atomic commit)."""
