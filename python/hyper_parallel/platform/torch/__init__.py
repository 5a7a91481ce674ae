"""The original's torch platform package (import paths only)."""
