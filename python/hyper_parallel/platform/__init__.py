"""The original's platform package: only the import paths its fully_shard users write."""
