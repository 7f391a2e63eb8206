"""The cache store's occupancy and cumulative counters, as `/v1/stats` and the metrics read them."""

from __future__ import annotations

from collections.abc import Sequence

from cache_store.device.segments import is_segment
from cache_store.sizing import layer_tokens_needed
from cache_store.tiers import CacheTiers


def store_stats(tiers: CacheTiers, layer_windows: Sequence[int | None]) -> dict[str, int]:
    """Occupancy of the device and host tiers (and Redis, when used), and every counter; `layer_windows`: each
    layer's sliding window (None: full attention)."""
    device_sessions = [key for key in tiers.device if not is_segment(key)]
    cached = {*device_sessions, *(key for key in tiers.host.keys() if not is_segment(key))}
    entries = [tiers.device.peek(key) for key in tiers.device]  # sessions' caches and shared segments
    layout = tiers.segments.layout
    token_bytes, layer_token_bytes = layout.token_bytes, layout.token_bytes // layout.layers
    shared = tiers.segments.stats()
    stats = {
        "device_bytes": tiers.device.used_bytes(), "device_budget_bytes": tiers.device.budget_bytes,
        # the distinct keys and values resident caches hold (a shared segment once), the part of them their
        # layers' windows need, and what the sessions' caches would hold as private copies
        "device_kv_bytes": sum(entry.own_tokens for entry in entries) * token_bytes,
        "device_window_bytes": sum(layer_tokens_needed(layer_windows, entry.num_tokens)
                                   - layer_tokens_needed(layer_windows, entry.prefix_tokens)
                                   for entry in entries) * layer_token_bytes,
        "device_private_kv_bytes": shared["private_tokens"] * token_bytes,
        "device_reserved_bytes": tiers.device.reserved_bytes(), "device_sessions": len(device_sessions),
        "device_active_bytes": tiers.device.active_bytes(),
        "prefixes": shared["segments"], "segments_pinned": shared["segments_pinned"],
        "segment_users": shared["segment_users"], "shared_sessions": shared["shared_sessions"],
        "segment_bytes": shared["segment_tokens"] * token_bytes,
        "host_bytes": tiers.host.used_bytes(), "host_budget_bytes": tiers.host.budget_bytes,
        "host_free_bytes": tiers.host.pool.free_bytes, "host_segments": sum(map(is_segment, tiers.host.keys())),
        "host_sessions": len(tiers.host) - sum(map(is_segment, tiers.host.keys())), **tiers.host.chunk_stats(),
        "idle_sessions": len(cached - tiers.notes.connected), "kept_sessions": tiers.notes.kept_sessions(),
        **tiers.counters,
    }
    if tiers.remote is not None:
        stats["remote_bytes"], stats["remote_budget_bytes"] = tiers.remote.usage()
        stats["remote_read_errors"], stats["remote_write_errors"] = tiers.remote.errors, tiers.remote.write_errors
        stats.update({f"remote_{name}": value for name, value in tiers.remote.counters.items()})
        stats["remote_chunks_known"] = tiers.remote.chunks_known()
        stats.update({f"remote_{name}": value for name, value in tiers.remote.pending().items()})
        stats["remote_round_trip_ms"] = round(1000 * (tiers.remote.throughput.round_trip_s or 0.0), 3)
    return stats
