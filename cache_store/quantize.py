"""int8 keys and values for the host and remote tiers: about a quarter of float32's bytes (half of
bf16's), so four (two) times the idle sessions per gigabyte.

The layout is KIVI's (Liu et al., 2024): keys are scaled per channel (each head-dim column over all
tokens, since key outliers sit in fixed channels) and values per token (each token's row), both
symmetric absmax / 127 with float32 scales. A quantised cache is a lossy copy: the device tier always
holds the model's dtype, and whoever restores one knows it was quantised (see `CacheEntry.quantized`).
"""

from __future__ import annotations

from typing import Literal

import torch

from cache_store.entry import KVTensors

KVDtype = Literal["same", "int8"]
QMAX = 127.0


def quantize(tensors: KVTensors) -> tuple[KVTensors, KVTensors]:
    """(int8 keys and values, their float32 scales) per layer, on the tensors' own device. Key scales
    are [1, heads, 1, head_dim], value scales [1, heads, tokens, 1]."""
    quantized, scales = [], []
    for keys, values in tensors:
        key_scale = _scale(keys.float().abs().amax(dim=2, keepdim=True))
        value_scale = _scale(values.float().abs().amax(dim=3, keepdim=True))
        quantized.append((_round(keys, key_scale), _round(values, value_scale)))
        scales.append((key_scale, value_scale))
    return quantized, scales


def dequantize(quantized: KVTensors, scales: KVTensors, dtype: torch.dtype) -> KVTensors:
    """Keys and values in `dtype`, on the quantised tensors' device."""
    return [((keys.float() * key_scale).to(dtype), (values.float() * value_scale).to(dtype))
            for (keys, values), (key_scale, value_scale) in zip(quantized, scales, strict=True)]


def quantized_nbytes(tensors: KVTensors) -> int:
    """The bytes of `tensors` once quantised: one per element, plus the scales."""
    total = 0
    for keys, values in tensors:
        _, heads, tokens, head_dim = keys.shape
        total += keys.numel() + values.numel() + 4 * heads * (head_dim + tokens)
    return total


def _scale(absmax: torch.Tensor) -> torch.Tensor:
    return torch.where(absmax > 0, absmax / QMAX, torch.ones_like(absmax))  # an all-zero row stays zero


def _round(tensor: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return torch.round(tensor.float() / scale).clamp_(-QMAX, QMAX).to(torch.int8)
