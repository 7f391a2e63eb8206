"""Consistency checks for caches. Each check returns the name of what failed, or nothing.

Cheap checks run on every reuse: the identity fingerprint, the per-layer lengths, and the shapes and
dtype. A cache that comes back from host memory also has its byte checksum and its values checked.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import xxhash

from cache_store.entry import CacheEntry, KVTensors

Check = str  # one of CHECKS
CHECKS = ("fingerprint", "length", "shape", "checksum", "finite", "deep")


@dataclass(frozen=True)
class CacheLayout:
    """What every cache of the running model must look like."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype


@dataclass(frozen=True)
class Fingerprint:
    """Who a cache belongs to and what it covers, taken when the cache is written back."""

    model_key: str
    owner: str
    token_digest: str
    num_tokens: int
    layout: CacheLayout


def token_digest(token_ids: Sequence[int]) -> str:
    return xxhash.xxh3_64_hexdigest(array("q", token_ids).tobytes())


def fingerprint(entry: CacheEntry, model_key: str, owner: str, layout: CacheLayout) -> Fingerprint:
    return Fingerprint(model_key, owner, token_digest(entry.token_ids), entry.num_tokens, layout)


def check_identity(expected: Fingerprint | None, model_key: str, owner: str, token_ids: Sequence[int],
                   layout: CacheLayout) -> Check | None:
    """The cache belongs to this owner and this model, and covers exactly the ids it claims."""
    if (expected is None or expected.model_key != model_key or expected.owner != owner
            or expected.layout != layout or expected.num_tokens != len(token_ids)
            or expected.token_digest != token_digest(token_ids)):
        return "fingerprint"
    return None


def check_tensors(tensors: KVTensors, num_tokens: int, layout: CacheLayout) -> Check | None:
    """Every layer is present, with the model's shape and dtype, and as long as the ids it covers."""
    if len(tensors) != layout.layers:
        return "shape"
    for keys, values in tensors:
        for tensor in (keys, values):
            if (tensor.dim() != 4 or tensor.shape[0] != 1 or tensor.shape[1] != layout.kv_heads
                    or tensor.shape[3] != layout.head_dim or tensor.dtype != layout.dtype):
                return "shape"
    if any(k.shape[2] != num_tokens or v.shape[2] != num_tokens for k, v in tensors):
        return "length"
    return None


def check_finite(tensors: KVTensors) -> Check | None:
    """No NaN or Inf: one float32 sum per tensor, whose result is finite only if every value is."""
    sums = torch.stack([t.sum(dtype=torch.float32) for pair in tensors for t in pair])
    return None if bool(torch.isfinite(sums).all()) else "finite"


def checksum(tensors: KVTensors) -> str:
    """xxh3 of the raw bytes of host tensors, in layer order."""
    digest = xxhash.xxh3_64()
    for pair in tensors:
        for tensor in pair:
            digest.update(tensor.contiguous().view(torch.uint8).numpy().data)
    return digest.hexdigest()
