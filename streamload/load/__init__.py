"""load: the load_checkpoint driver: prepare, run a reader strategy, finalize."""
