"""Device memory of captured graphs: fixed buffers, the ledger of released graphs, and compaction."""
