"""Fault injection for tests and chaos drills: corrupt one session's cache in one tier, the way
real failures do, so that the consistency checks can be seen to catch each one."""

from __future__ import annotations

import dataclasses
from typing import Literal

import torch
from transformers.cache_utils import DynamicLayer

from cache_store.checks.integrity import SAME_SIZE_INT
from cache_store.device.entry import KVTensors, holding
from cache_store.store import CacheStore

FaultKind = Literal["nan", "bitflip", "truncate", "shape", "foreign", "tokens"]
Tier = Literal["device", "host"]
FAULT_KINDS: tuple[str, ...] = FaultKind.__args__
TIERS: tuple[str, ...] = Tier.__args__
_MANTISSA_BITS = {torch.float64: 52, torch.float32: 23, torch.float16: 10, torch.bfloat16: 7}


class NoCache(LookupError):
    """The session has no cache in that tier (or, for `foreign`, no other session has one there)."""


def corrupt(store: CacheStore, session_id: str, kind: FaultKind, tier: Tier) -> str:
    """Corrupt `session_id`'s cache in `tier`; return what was done. Runs in the engine thread."""
    if tier == "device":
        entry = store.device.get(session_id)
        if entry is None:
            raise NoCache(f"session {session_id} has no cache on the device")
        tensors, token_ids = entry.tensors(), entry.token_ids
    else:
        host_entry = store.host.get(session_id)
        if host_entry is None:
            raise NoCache(f"session {session_id} has no cache in the host tier")
        tensors, token_ids = host_entry.tensors, host_entry.token_ids
    layer = len(tensors) // 2
    keys, values = tensors[layer]
    match kind:
        case "nan":
            keys[0, 0, -1, 0] = float("nan")
            return f"wrote NaN into the keys of layer {layer}"
        case "bitflip":
            values.view(SAME_SIZE_INT[values.element_size()]).bitwise_xor_(1 << _MANTISSA_BITS[values.dtype])
            return f"flipped the lowest exponent bit of every value in layer {layer}"
        case "truncate":
            _replace(store, session_id, tier, layer, (keys[..., :-2, :], values[..., :-2, :]))
            return f"dropped the last 2 positions of layer {layer}"
        case "shape":
            _replace(store, session_id, tier, layer, (keys[:, :-1], values[:, :-1]))
            return f"dropped one key/value head from layer {layer}"
        case "tokens":
            token_ids[-1] = (token_ids[-1] + 1) % 32_000
            return "changed the last token id the cache claims to cover"
        case "foreign":
            donor = next((key for key in (store.device if tier == "device" else store.host.keys())
                          if key != session_id and not key.startswith("prefix:")), None)
            if donor is None:
                raise NoCache(f"no other session has a cache in the {tier} tier to swap in")
            if tier == "device":
                with holding(store.device.get(donor).clone(store.new_cache)) as copy:
                    store.device.put(session_id, copy)
            else:
                theirs = store.host.get(donor)
                store.host.put(session_id, dataclasses.replace(
                    theirs, tensors=[(k.clone(), v.clone()) for k, v in theirs.tensors],
                    token_ids=list(theirs.token_ids), buffer=None))
            return f"swapped in the cache of session {donor}"
    raise ValueError(f"unknown fault kind {kind!r}")


def _replace(store: CacheStore, session_id: str, tier: Tier, layer: int, pair: tuple) -> None:
    if tier == "device":  # the layer now holds tensors of its own, not a view of the arena
        replaced = DynamicLayer()
        replaced.lazy_initialization(*pair)
        replaced.keys, replaced.values = pair[0].clone(), pair[1].clone()
        store.device.get(session_id).cache.layers[layer] = replaced
    else:
        tensors: KVTensors = store.host.get(session_id).tensors
        tensors[layer] = pair
