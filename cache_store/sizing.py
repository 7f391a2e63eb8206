"""How many bytes a session's KV cache takes, from the model config alone (GQA-aware)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVGeometry:
    """The shape of a model's KV cache: layers, KV heads, head size."""

    layers: int
    attention_heads: int
    kv_heads: int
    head_dim: int

    @classmethod
    def of(cls, config) -> KVGeometry:
        text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        heads = text.num_attention_heads
        return cls(layers=text.num_hidden_layers, attention_heads=heads,
                   kv_heads=getattr(text, "num_key_value_heads", None) or heads,
                   head_dim=getattr(text, "head_dim", None) or text.hidden_size // heads)


def kv_bytes_per_token(config, dtype: torch.dtype) -> int:
    """2 (keys and values) x layers x key/value heads x head_dim x bytes per element.

    With grouped-query attention only the key/value heads are cached, not every attention head:
    SmolLM2-135M in float16 is 2 x 30 x 3 x 64 x 2 = 23,040 bytes per token."""
    geometry = KVGeometry.of(config)
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * geometry.layers * geometry.kv_heads * geometry.head_dim * element
