"""What a cache must look like and whom it belongs to: plain records, so that entries, checks, tiers
and the remote format can all name them without importing each other."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CacheLayout:
    """What every cache of the running model must look like."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def token_bytes(self) -> int:
        """The bytes of one position's keys and values over every layer."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype.itemsize


@dataclass(frozen=True)
class Fingerprint:
    """Who a cache belongs to and what it covers, taken when the cache is written back."""

    model_key: str
    owner: str
    token_digest: str
    num_tokens: int
    layout: CacheLayout
    quantized: str | None = None  # "int8" once the cache's values came from a quantised copy: never exact again
