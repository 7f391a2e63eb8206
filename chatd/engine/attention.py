"""How each layer attends when its keys and values live in the KV arena.

The model is unmodified: chatd registers its own attention implementations with transformers and routes
the model's attention through the one that wraps what transformers chose for it:

- `chatd_arena` wraps sdpa (every family whose attention sdpa can compute);
- `chatd_arena_eager` wraps the family's own eager attention, for models that sdpa cannot serve:
  attention-logit soft-capping (Gemma 2) and attention sinks (gpt-oss). transformers picks eager for them.

Every call but a batched step goes straight to the wrapped function with the mask transformers built for
the layer (sliding or full, as the model's config says), so a single sequence attends exactly as in
transformers. A batched step packs its rows' tokens into one sequence (a row feeds one token, a draft to
verify, or the rest of a prompt) and gives each row a view of its own region: a full layer sees the whole
region, a sliding-window layer the positions its first query's window reaches, and a row of several queries
a mask of what each of them sees, which is transformers' rule (`kv_idx <= q_idx`,
`kv_idx > q_idx - sliding_window`).

A cache that starts with shared segments (`cache_store/device/chain.py`), alone or in a batch, attends through
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
    """The rows of a batched step, their queries packed one after another (`queries[i]` of row i: one token, a
    draft to verify, or the rest of a prompt). For each row whose cache has no shared segments, the arena
    positions it attends to in each layer (its region's start and length, the new tokens included, cut to what
    its first query's sliding window reaches) and, for a row of several queries, which of them each query sees
    (its own position and those before it, within its window); the rows whose caches start with shared
    segments (`chained`, in order) attend through `chain`."""

    def __init__(self, rows: Sequence[tuple[int, int] | None], queries: Sequence[int],
                 windows: Sequence[int | None], chain: ChainPlan | None = None, device: torch.device | None = None):
        self.windows = windows
        firsts = [sum(queries[:index]) for index in range(len(queries))]
        self.pieces = [slice(first, first + count) for first, count in zip(firsts, queries, strict=True)]
        self.plain = [index for index, row in enumerate(rows) if row is not None]
        self.chained = [index for index, row in enumerate(rows) if row is None]
        self.chain = chain
        self.chained_queries = torch.tensor([q for index in self.chained for q in range(
            self.pieces[index].start, self.pieces[index].stop)], device=device) if self.chained else None
        self._spans = {window: [_span(*rows[index], queries[index], window, device) for index in self.plain]
                       for window in set(windows)}
        self._additive: dict[tuple[int | None, torch.dtype], list] = {}

    def spans(self, layer: int, additive: torch.dtype | None = None) -> list[tuple[slice, torch.Tensor | None]]:
        """Per plain row, the positions it attends to in `layer`, and which each of its queries sees: a boolean
        mask, or with `additive` a float one of that dtype as eager attention adds it (made once a step)."""
        window = self.windows[layer]
        if additive is None:
            return self._spans[window]
        if (window, additive) not in self._additive:
            self._additive[window, additive] = [
                (span, None if visible is None else torch.zeros(visible.shape, dtype=additive, device=visible.device)
                 .masked_fill_(~visible, torch.finfo(additive).min)) for span, visible in self._spans[window]]
        return self._additive[window, additive]


def _span(start: int, length: int, queries: int, window: int | None, device: torch.device | None
          ) -> tuple[slice, torch.Tensor | None]:
    """The arena positions a row of `queries` queries (the last of its `length` positions) attends to, and for
    several queries the mask [1, 1, queries, keys] of what each sees (None: every query sees every key)."""
    low = max(0, length - queries - window + 1) if window else 0
    if queries == 1:
        return slice(start + low, start + length), None
    query_at = torch.arange(length - queries, length, device=device)[:, None]
    key_at = torch.arange(low, length, device=device)[None, :]
    visible = key_at <= query_at
    if window:
        visible &= key_at > query_at - window
    return slice(start + low, start + length), visible[None, None]


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


def _rows_attention(inner: Callable[[nn.Module], Callable], additive: bool) -> Callable:
    """The attention of the model's layers in the KV arena, wrapping `inner` (whose masks are boolean, or
    `additive` floats as eager attention takes them)."""
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
        outputs: list[torch.Tensor | None] = [None] * len(step.pieces)
        spans = step.spans(module.layer_idx, query.dtype if additive else None)
        for row, (span, mask) in zip(step.plain, spans, strict=True):
            outputs[row] = forward(module, query[:, :, step.pieces[row]], key[:, span].unsqueeze(0),
                                   value[:, span].unsqueeze(0), mask, **kwargs)[0]
        if step.chained:
            chained = _chained(module, step.chain, query[:, :, step.chained_queries], step.windows, kwargs)
            first = 0
            for row in step.chained:
                count = step.pieces[row].stop - step.pieces[row].start
                outputs[row] = chained[:, first:first + count]
                first += count
        return torch.cat(outputs, dim=1), None
    return attention


AttentionInterface.register(ARENA_ATTENTION["sdpa"], _rows_attention(lambda module: sdpa_attention_forward, False))
AttentionMaskInterface.register(ARENA_ATTENTION["sdpa"], ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
AttentionInterface.register(ARENA_ATTENTION["eager"], _rows_attention(lambda module: _family_eager(type(module)),
                                                                      True))
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
