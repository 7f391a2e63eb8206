"""int8 keys and values for the host and remote tiers: 29% of float32's bytes (58% of bf16's), so 3.4
(1.7) times the idle sessions per gigabyte.

The layout is KIVI's (Liu et al., 2024): keys are scaled per channel (each head-dim column, since key
outliers sit in fixed channels) within groups of `GROUP_TOKENS` tokens counted from the cache's first
position, and values per token (each token's row), both symmetric absmax / 127 with float32 scales.
Groups keep a long cache's error at that of a short one (one outlier token no longer coarsens every
token's step), and they make quantisation idempotent where it matters: a cache restored from int8, grown
by a turn and offloaded again gets the same bytes for every whole group it had (the group's largest value
is exactly 127 steps, so its scale comes out the same), so round trips do not add up. The group is the
arena's unit, so a shared segment (whole units) always ends on a group boundary. A quantised cache is a
lossy copy: the device tier always holds the model's dtype, and whoever restores one knows it was
quantised (see `CacheEntry.quantized`).
"""

from __future__ import annotations

import torch

from cache_store.device.entry import KVTensors
from cache_store.units import GROUP_TOKENS, key_groups

QMAX = 127.0


def quantize(tensors: KVTensors, group_tokens: int = GROUP_TOKENS) -> tuple[KVTensors, KVTensors]:
    """(int8 keys and values, their float32 scales) per layer, on the tensors' own device. Key scales
    are [1, heads, groups, head_dim], value scales [1, heads, tokens, 1]."""
    quantized, scales = [], []
    for keys, values in tensors:
        key_scale = _scale(_group_absmax(keys, group_tokens))
        value_scale = _scale(values.float().abs().amax(dim=3, keepdim=True))
        quantized.append((_round(keys, _per_token(key_scale, keys.shape[2], group_tokens)),
                          _round(values, value_scale)))
        scales.append((key_scale, value_scale))
    return quantized, scales


def dequantize(quantized: KVTensors, scales: KVTensors, dtype: torch.dtype,
               group_tokens: int = GROUP_TOKENS) -> KVTensors:
    """Keys and values in `dtype`, on the quantised tensors' device."""
    return [((keys.float() * _per_token(key_scale, keys.shape[2], group_tokens)).to(dtype),
             (values.float() * value_scale).to(dtype))
            for (keys, values), (key_scale, value_scale) in zip(quantized, scales, strict=True)]


def quantized_nbytes(tensors: KVTensors) -> int:
    """The bytes of `tensors` once quantised: one per element, plus the scales."""
    total = 0
    for keys, values in tensors:
        _, heads, tokens, head_dim = keys.shape
        total += keys.numel() + values.numel() + 4 * heads * (key_groups(tokens) * head_dim + tokens)
    return total


def _group_absmax(keys: torch.Tensor, group_tokens: int) -> torch.Tensor:
    """Each channel's largest magnitude within each group of tokens: [1, heads, groups, head_dim]."""
    batch, heads, tokens, head_dim = keys.shape
    groups = key_groups(tokens, group_tokens)
    padded = torch.nn.functional.pad(keys.float().abs(), (0, 0, 0, groups * group_tokens - tokens))
    return padded.view(batch, heads, groups, group_tokens, head_dim).amax(dim=3)


def _per_token(key_scale: torch.Tensor, tokens: int, group_tokens: int) -> torch.Tensor:
    """Group scales repeated for each token of their group."""
    return key_scale.repeat_interleave(group_tokens, dim=2)[:, :, :tokens]


def _scale(absmax: torch.Tensor) -> torch.Tensor:
    return torch.where(absmax > 0, absmax / QMAX, torch.ones_like(absmax))  # an all-zero row stays zero


def _round(tensor: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return torch.round(tensor.float() / scale).clamp_(-QMAX, QMAX).to(torch.int8)
