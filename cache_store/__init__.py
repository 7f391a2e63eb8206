"""KV cache storage for sessions: entries, tiers, eviction policy, offload and the lookup boundary.
Never imports chatd.

Its names are imported when first used, so that a module that needs only `cache_store.units` (the settings) does
not load torch."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_HOMES = {
    "CacheEntry": "device.entry", "CacheLayout": "identity", "CacheLookup": "lookup", "CacheQuery": "lookup",
    "CacheStore": "store",
    "ConnectedLRUPolicy": "device.eviction", "DeviceTier": "device.device_tier", "EvictionPolicy": "device.eviction",
    "Fingerprint": "identity", "HostEntry": "host.offload", "HostTier": "host.host_tier", "KVGeometry": "sizing",
    "LRUPolicy": "device.eviction", "Offloader": "host.offload", "Residency": "device.eviction",
    "SessionRunning": "lookup", "common_prefix_length": "lookup", "kv_bytes_per_token": "sizing",
    "ArenaCache": "device.arena", "ArenaFull": "device.arena", "KVArena": "device.arena",
    "TemporaryCache": "device.arena", "FetchRequest": "remote.remote_moves", "RemoteFetch": "remote.remote_moves",
    "FaultPoints": "checks.stage_faults", "InjectedFatalFault": "checks.stage_faults", "STAGES": "checks.stage_faults",
    "CHECKS": "checks.integrity", "holding": "device.entry", "segments": "device.chain",
    "RemoteTier": "remote.remote_tier",
}

__all__ = ["ArenaCache", "ArenaFull", "CHECKS", "CacheEntry", "CacheLayout", "CacheLookup", "CacheQuery", "CacheStore",
           "ConnectedLRUPolicy", "DeviceTier", "EvictionPolicy", "FaultPoints", "FetchRequest", "Fingerprint",
           "HostEntry", "HostTier", "InjectedFatalFault", "KVArena", "KVGeometry", "LRUPolicy", "Offloader",
           "RemoteFetch", "RemoteTier", "Residency", "STAGES", "SessionRunning", "TemporaryCache",
           "common_prefix_length", "holding", "kv_bytes_per_token", "segments"]

if TYPE_CHECKING:
    from cache_store.checks.integrity import CHECKS
    from cache_store.checks.stage_faults import STAGES, FaultPoints, InjectedFatalFault
    from cache_store.device.arena import ArenaCache, ArenaFull, KVArena, TemporaryCache
    from cache_store.device.chain import segments
    from cache_store.device.device_tier import DeviceTier
    from cache_store.device.entry import CacheEntry, holding
    from cache_store.device.eviction import ConnectedLRUPolicy, EvictionPolicy, LRUPolicy, Residency
    from cache_store.host.host_tier import HostTier
    from cache_store.host.offload import HostEntry, Offloader
    from cache_store.identity import CacheLayout, Fingerprint
    from cache_store.lookup import CacheLookup, CacheQuery, SessionRunning, common_prefix_length
    from cache_store.remote.remote_moves import FetchRequest, RemoteFetch
    from cache_store.remote.remote_tier import RemoteTier
    from cache_store.sizing import KVGeometry, kv_bytes_per_token
    from cache_store.store import CacheStore


def __getattr__(name: str) -> object:
    if name not in _HOMES:
        raise AttributeError(f"module 'cache_store' has no attribute {name!r}")
    return getattr(importlib.import_module(f"cache_store.{_HOMES[name]}"), name)
