"""Side-by-side benchmarks: streamload against the existing ways of loading."""
