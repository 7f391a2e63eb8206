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

A cache that starts with shared segments (`cache_store/chain.py`), alone or in a batch, attends through
`chatd.engine.chain_attention` instead: each piece apart, merged by log-sum-exp, a shared segment once for
every row that starts with it.
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

from chatd.engine.chain_attention import ChainPlan

# What transformers chose for the model -> chatd's wrapper of it
ARENA_ATTENTION = {"sdpa": "chatd_arena", "eager": "chatd_arena_eager"}


class ArenaRows:
    """The rows of a batched decode step. For each row whose cache has no shared segments, the arena positions
    it attends to in each layer (its region's start and length, the new token included, cut to the layer's
    sliding window); the rows whose caches start with shared segments (`chained`, in order) attend through
    `chain`."""

    def __init__(self, rows: Sequence[tuple[int, int] | None], windows: Sequence[int | None],
                 chain: ChainPlan | None = None):
        self.windows = windows
        self.plain = [index for index, row in enumerate(rows) if row is not None]
        self.chained = [index for index, row in enumerate(rows) if row is None]
        self.chain = chain
        self._spans = {window: [slice(start + (max(0, length - window) if window else 0), start + length)
                                for start, length in (rows[index] for index in self.plain)]
                       for window in set(windows)}

    def spans(self, layer: int) -> list[slice]:
        """Per plain row, the positions it attends to in `layer`."""
        return self._spans[self.windows[layer]]


@functools.cache
def _family_eager(module_type: type[nn.Module]) -> Callable:
    """The eager attention of the family `module_type` belongs to (the one transformers itself would run)."""
    function = getattr(sys.modules[module_type.__module__], "eager_attention_forward", None)
    if function is None:
        raise ValueError(f"{module_type.__name__} has no eager attention function to run in the KV arena")
    return function


def _chained(module: nn.Module, plan: ChainPlan, query: torch.Tensor, windows: Sequence[int | None],
             kwargs: dict) -> torch.Tensor:
    """Attention of caches that start with shared segments, with what the family does to the scores."""
    scaling = kwargs.get("scaling")
    return plan.attend(module.layer_idx, windows[module.layer_idx], query,
                       query.shape[-1] ** -0.5 if scaling is None else scaling, kwargs.get("softcap"),
                       kwargs.get("s_aux"))


def _rows_attention(inner: Callable[[nn.Module], Callable]) -> Callable:
    def attention(module, query, key, value, attention_mask, **kwargs):
        step: ArenaRows | None = kwargs.pop("arena_rows", None)
        chain: tuple[ChainPlan, Sequence[int | None]] | None = kwargs.pop("arena_chain", None)
        forward = inner(module)
        if chain is not None:  # one sequence whose cache starts with shared segments
            return _chained(module, chain[0], query, chain[1], kwargs), None
        if step is None:
            return forward(module, query, key, value, attention_mask, **kwargs)
        if not step.plain:  # every row starts with shared segments: one plan, no reassembly
            return _chained(module, step.chain, query, step.windows, kwargs), None
        outputs: list[torch.Tensor | None] = [None] * query.shape[0]
        for row, span in zip(step.plain, step.spans(module.layer_idx), strict=True):
            outputs[row] = forward(module, query[row:row + 1], key[:, span].unsqueeze(0), value[:, span].unsqueeze(0),
                                   None, **kwargs)[0]
        if step.chained:
            chained = _chained(module, step.chain, query[step.chained], step.windows, kwargs)
            for number, row in enumerate(step.chained):
                outputs[row] = chained[number:number + 1]
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
