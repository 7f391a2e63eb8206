"""How many bytes a session's KV cache takes, from the model config alone (GQA-aware), and how many of
them its sliding-window layers actually need."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import get_layer_types_and_kwargs


@dataclass(frozen=True)
class KVGeometry:
    """The shape of a model's KV cache: layers, KV heads, head size, and each layer's sliding window
    (None for a layer that attends to every earlier token)."""

    layers: int
    attention_heads: int
    kv_heads: int
    head_dim: int
    windows: tuple[int | None, ...] = ()

    @classmethod
    def of(cls, config) -> KVGeometry:
        text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        heads = text.num_attention_heads
        return cls(layers=text.num_hidden_layers, attention_heads=heads,
                   kv_heads=getattr(text, "num_key_value_heads", None) or heads,
                   head_dim=getattr(text, "head_dim", None) or text.hidden_size // heads,
                   windows=layer_windows(text))

    @property
    def sliding_layers(self) -> int:
        return sum(window is not None for window in self.windows)

    def needed_share(self, tokens: int) -> float:
        """The share of a `tokens`-long cache that its layers' windows need (1.0 without sliding layers)."""
        return layer_tokens_needed(self.windows or (None,) * self.layers, tokens) / (self.layers * tokens)


def layer_tokens_needed(windows: tuple[int | None, ...], tokens: int) -> int:
    """Token-layers a cache of `tokens` must keep for the next token: all of them in a full layer, the last
    `window - 1` in a sliding one (the next token makes its window whole), as transformers'
    `DynamicSlidingWindowLayer` keeps them. The arena keeps every token in every layer."""
    return sum(tokens if window is None else min(tokens, window - 1) for window in windows)


def layer_windows(text_config) -> tuple[int | None, ...]:
    """Each layer's sliding window, by transformers' own reading of the config (`layer_types`, or
    `sliding_window` on every layer where the config has no layer types; Qwen2's `use_sliding_window` and
    `max_window_layers` are already folded into its `layer_types`), the rule by which it builds a layer's
    mask and a `DynamicCache`'s layers."""
    layer_types, kwargs = get_layer_types_and_kwargs(text_config)
    return tuple(options.get("sliding_window") if kind == "sliding_attention" else None
                 for kind, options in zip(layer_types, kwargs, strict=True))


def kv_bytes_per_token(config, dtype: torch.dtype) -> int:
    """2 (keys and values) x layers x key/value heads x head_dim x bytes per element.

    With grouped-query attention only the key/value heads are cached, not every attention head:
    SmolLM2-135M in float16 is 2 x 30 x 3 x 64 x 2 = 23,040 bytes per token."""
    geometry = KVGeometry.of(config)
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * geometry.layers * geometry.kv_heads * geometry.head_dim * element
