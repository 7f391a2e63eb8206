"""The device room: the KV arena and its regions, cache entries (the device's handle on a cache), chains of shared
segments, the device tier and its eviction policy."""
