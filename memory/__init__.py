"""Block pool, KV storage, weight containers, NUMA placement. No ray."""
