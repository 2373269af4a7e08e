"""model: model state, ties, non-persistent buffers and shards mapped from the files."""
