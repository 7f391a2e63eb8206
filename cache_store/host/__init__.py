"""The host room: offloaded caches in pinned CPU memory (exact or int8), their buffers, copies between device and
host."""
