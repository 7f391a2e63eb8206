"""How each layer attends when its keys and values live in the KV arena.

The model is unmodified: chatd registers its own attention implementations with transformers and routes
the model's attention through the one that wraps what transformers chose for it:

- `chatd_arena` wraps sdpa (every family whose attention sdpa can compute);
- `chatd_arena_eager` wraps the family's own eager attention, for models that sdpa cannot serve:
  attention-logit soft-capping (Gemma 2) and attention sinks (gpt-oss). transformers picks eager for them.

Every call but a batched decode step goes straight to the wrapped function with the mask transformers
built for the layer (sliding or full, as the model's config says), so a single sequence attends exactly as
in transformers. A batched step instead gives each row a view of its own region: a full layer sees the
whole region, a sliding-window layer its last `window` positions (the current token included), which is
transformers' rule (`kv_idx > q_idx - sliding_window`) for a query at the end of the region.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Sequence

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import AttentionInterface

# What transformers chose for the model -> chatd's wrapper of it
ARENA_ATTENTION = {"sdpa": "chatd_arena", "eager": "chatd_arena_eager"}


class ArenaRows:
    """The rows of a batched decode step: for each row, the arena positions it attends to in each layer
    (its region's start and length, the new token included, cut to the layer's sliding window)."""

    def __init__(self, rows: Sequence[tuple[int, int]], windows: Sequence[int | None]):
        self._windows = windows
        self._spans = {window: [slice(start + (max(0, length - window) if window else 0), start + length)
                                for start, length in rows] for window in set(windows)}

    def spans(self, layer: int) -> list[slice]:
        """Per row, the positions it attends to in `layer`."""
        return self._spans[self._windows[layer]]


@functools.cache
def _family_eager(module_type: type[nn.Module]) -> Callable:
    """The eager attention of the family `module_type` belongs to (the one transformers itself would run)."""
    function = getattr(sys.modules[module_type.__module__], "eager_attention_forward", None)
    if function is None:
        raise ValueError(f"{module_type.__name__} has no eager attention function to run in the KV arena")
    return function


def _rows_attention(inner: Callable[[nn.Module], Callable]) -> Callable:
    def attention(module, query, key, value, attention_mask, **kwargs):
        step: ArenaRows | None = kwargs.pop("arena_rows", None)
        forward = inner(module)
        if step is None:
            return forward(module, query, key, value, attention_mask, **kwargs)
        outputs = [forward(module, query[row:row + 1], key[:, span].unsqueeze(0), value[:, span].unsqueeze(0), None,
                           **kwargs)[0] for row, span in enumerate(step.spans(module.layer_idx))]
        return torch.cat(outputs), None
    return attention


AttentionInterface.register(ARENA_ATTENTION["sdpa"], _rows_attention(lambda module: sdpa_attention_forward))
AttentionMaskInterface.register(ARENA_ATTENTION["sdpa"], ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
AttentionInterface.register(ARENA_ATTENTION["eager"], _rows_attention(lambda module: _family_eager(type(module))))
AttentionMaskInterface.register(ARENA_ATTENTION["eager"], ALL_MASK_ATTENTION_FUNCTIONS["eager"])


def use_arena_attention(model: PreTrainedModel) -> str:
    """Route the model's attention through chatd's wrapper of the implementation transformers chose;
    return the wrapped one ("sdpa" or "eager")."""
    chosen = model.config._attn_implementation
    for wrapped, name in ARENA_ATTENTION.items():
        if chosen in (wrapped, name):
            model.config._attn_implementation = name
            return wrapped
    raise ValueError(f"the KV arena runs sdpa or eager attention, not {chosen!r}")
