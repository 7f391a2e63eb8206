"""KV cache storage for sessions: entries, tiers, eviction policy, offload and the lookup boundary.
Never imports chatd."""

from cache_store.device_tier import DeviceTier
from cache_store.entry import CacheEntry
from cache_store.eviction import ConnectedLRUPolicy, EvictionPolicy, LRUPolicy, Residency
from cache_store.host_tier import HostTier
from cache_store.identity import CacheLayout, Fingerprint
from cache_store.lookup import CacheLookup, SessionRunning, common_prefix_length
from cache_store.offload import HostEntry, Offloader
from cache_store.sizing import KVGeometry, kv_bytes_per_token
from cache_store.store import CacheStore

__all__ = ["CacheEntry", "CacheLayout", "CacheLookup", "CacheStore", "ConnectedLRUPolicy", "DeviceTier",
           "EvictionPolicy", "Fingerprint", "HostEntry", "HostTier", "KVGeometry", "LRUPolicy", "Offloader",
           "Residency", "SessionRunning", "common_prefix_length", "kv_bytes_per_token"]
