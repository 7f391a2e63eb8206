"""The Redis room: caches as chains of chunks in Redis, their format, fetches and write-backs, and whether to fetch
or recompute."""
