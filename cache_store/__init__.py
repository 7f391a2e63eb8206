"""KV cache storage for sessions: entries, tiers and the lookup boundary. Never imports chatd."""

from cache_store.device_tier import DeviceTier
from cache_store.entry import CacheEntry
from cache_store.manager import CacheLookup, CacheManager, common_prefix_length

__all__ = ["CacheEntry", "CacheLookup", "CacheManager", "DeviceTier", "common_prefix_length"]
