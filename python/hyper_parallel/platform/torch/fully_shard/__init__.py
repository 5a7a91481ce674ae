"""The original's torch fully_shard package (import paths only)."""
