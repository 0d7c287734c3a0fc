"""KV block cache: chained block hashes, the hot block pool (RAM) and the cold tier (SSD)."""
