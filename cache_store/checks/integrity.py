"""Consistency checks for caches. Each check returns the name of what failed, or nothing.

Checks on every reuse of a resident cache: the identity fingerprint, the per-layer lengths, the shapes
and dtype, and the checksum of its bytes taken at write-back. A cache that comes back from host memory
or Redis also has its values checked for NaN and Inf.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import xxhash

from cache_store.identity import CacheLayout, Fingerprint
from cache_store.units import key_groups
from sessions.encoding import token_hash

if TYPE_CHECKING:  # (the checks sit below the device room: they read an entry, and never need its module)
    from cache_store.device.entry import CacheEntry, KVTensors

Check = str  # one of CHECKS
CHECKS = ("fingerprint", "length", "shape", "checksum", "finite", "deep")


def token_digest(token_ids: Sequence[int]) -> str:
    """A digest of token ids, for fingerprints."""
    return token_hash(token_ids)


def fingerprint(entry: CacheEntry, model_key: str, owner: str, layout: CacheLayout) -> Fingerprint:
    """The identity a cache is written back with and checked against on every reuse."""
    return Fingerprint(model_key, owner, token_digest(entry.token_ids), entry.num_tokens, layout, entry.quantized)


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


def check_scales(scales: KVTensors, num_tokens: int, layout: CacheLayout) -> Check | None:
    """A quantised cache's scales: float32, per key channel within each group of tokens
    [1, heads, groups, head_dim] and per value token [1, heads, tokens, 1], one pair per layer."""
    if len(scales) != layout.layers:
        return "shape"
    groups = key_groups(num_tokens)
    for key_scale, value_scale in scales:
        if (tuple(key_scale.shape) != (1, layout.kv_heads, groups, layout.head_dim)
                or tuple(value_scale.shape) != (1, layout.kv_heads, num_tokens, 1)
                or key_scale.dtype != torch.float32 or value_scale.dtype != torch.float32):
            return "shape"
    return None


def check_finite(tensors: KVTensors) -> Check | None:
    """No NaN or Inf: one float32 sum per tensor, whose result is finite only if every value is."""
    sums = torch.stack([t.sum(dtype=torch.float32) for pair in tensors for t in pair])
    return None if bool(torch.isfinite(sums).all()) else "finite"


def checksum(tensors: KVTensors) -> str:
    """A digest of the raw bytes of a cache's tensors, in layer order, read in place: xxh3 where the
    tensors are in CPU memory, a weighted integer sum computed on the device where they are not (the
    bytes never cross to the host). The two kinds are told apart by their prefix."""
    if tensors and tensors[0][0].device.type != "cpu":
        return weighted_sum_checksum(tensors)
    digest = xxhash.xxh3_64()
    for pair in tensors:
        for tensor in pair:
            for run in _contiguous_runs(tensor):
                digest.update(run.view(torch.uint8).numpy().data)
    return "xxh3:" + digest.hexdigest()


def _contiguous_runs(tensor: torch.Tensor) -> list[torch.Tensor]:
    """The tensor as contiguous pieces, without a copy where it is a prefix view of a longer cache
    ([batch, heads, tokens, head_dim] cropped along tokens: each head's rows are contiguous)."""
    if tensor.is_contiguous():
        return [tensor]
    if tensor.dim() == 4 and tensor[0, 0].is_contiguous():
        return [tensor[b, h] for b in range(tensor.shape[0]) for h in range(tensor.shape[1])]
    return [tensor.contiguous()]


SAME_SIZE_INT = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}  # to read a float's bits
_GOLDEN = -0x61C8864680B583EB  # 0x9E3779B97F4A7C15 as a signed 64-bit integer


def weighted_sum_checksum(tensors: KVTensors) -> str:
    """Sum over every element of its bits (as an integer) times an odd weight that depends on its
    position, modulo 2**64, per tensor: any changed element changes the sum unless the changes cancel
    exactly, which for distinct odd weights is a 1 in 2**40-or-so event. Runs wherever the tensors
    are; one transfer of the sums at the end."""
    sums = []
    for pair in tensors:
        for tensor in pair:
            bits = tensor.reshape(-1).view(SAME_SIZE_INT[tensor.element_size()]).to(torch.int64)
            weights = torch.arange(1, 2 * bits.numel(), 2, dtype=torch.int64, device=bits.device) * _GOLDEN
            sums.append((bits * weights).sum())
    digest = xxhash.xxh3_64(torch.stack(sums).cpu().numpy().tobytes()) if sums else xxhash.xxh3_64()
    return "wsum:" + digest.hexdigest()
