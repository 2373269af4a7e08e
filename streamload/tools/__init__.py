"""tools: the command line, ingest, demo, synthetic checkpoints and the benchmark harness."""
