"""dist: agreement protocol, transport, staging, bucket pipelines and the reader strategies."""
