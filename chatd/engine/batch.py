"""One step for several sessions at once, each reading and writing its own region of the KV arena in place.

Each row feeds one token or several (its next token and a draft to verify): the rows' tokens are packed into
one sequence, so the model's linear layers run once over all of them. The step's cache (`_ArenaStep`) writes
each row's new keys and values at that row's own positions in the arena, one indexed store per layer, and
hands attention the arena's buffers; chatd's arena attention (`chatd.engine.attention`) then runs each row
over a view of its own region, exactly as a single sequence attends: the layer's own window, its own causal
order among its new tokens, through the attention transformers chose for the model. Rows whose caches start
with shared segments attend through one `ChainPlan`, which reads each segment once for all the rows that start
with it. Nothing proportional to the cached tokens is copied or
allocated, rows of any lengths share the step, and a session joins or leaves the batch between two steps
without touching the others.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import Cache, CacheLayerMixin

from cache_store import ArenaCache, CacheEntry, KVArena
from chatd.engine.attention import ArenaRows
from chatd.engine.chain_attention import ChainPlan


class _StepLayer(CacheLayerMixin):
    """One layer of a batched step: stores each row's new keys and values at their positions, in place."""

    is_sliding = False

    def __init__(self, arena: KVArena, index: int, caches: Sequence[ArenaCache], counts: Sequence[int],
                 positions: torch.Tensor):
        self._arena, self._index, self._caches, self._counts, self._positions = arena, index, caches, counts, positions
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        return None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        keys, values = self._arena.keys[self._index], self._arena.values[self._index]
        keys[:, self._positions] = key_states[0]  # [heads, packed tokens, dim]
        values[:, self._positions] = value_states[0]
        for cache, count in zip(self._caches, self._counts, strict=True):
            cache.layers[self._index].length += count
        return keys, values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return query_length, 0

    def get_seq_length(self) -> int:
        return 0

    def get_max_length(self) -> int:
        return -1


class _ArenaStep(Cache):
    def __init__(self, arena: KVArena, caches: Sequence[ArenaCache], counts: Sequence[int], device: torch.device):
        positions = torch.tensor([cache.region.start + cache.used_tokens() + offset
                                  for cache, count in zip(caches, counts, strict=True) for offset in range(count)],
                                 device=device)
        super().__init__(layers=[_StepLayer(arena, index, caches, counts, positions)
                                 for index in range(len(arena.keys))])


def batched_step(model: PreTrainedModel, entries: Sequence[CacheEntry], inputs: Sequence[Sequence[int]],
                 keep: Sequence[int], device: torch.device) -> list[torch.Tensor]:
    """Feed `inputs[i]` after `entries[i]` for every i in one forward pass; return each row's logits after each of
    its last `keep[i]` tokens [keep[i], V] (a draft's every position, a prompt's last)."""
    caches = [entry.cache for entry in entries]
    counts = [len(tokens) for tokens in inputs]
    for cache, count in zip(caches, counts, strict=True):
        cache.reserve(cache.get_seq_length() + count)
    lengths = [cache.get_seq_length() for cache in caches]
    arena = caches[0].arena
    chained = [index for index, cache in enumerate(caches) if cache.prefix is not None]
    rows = ArenaRows([None if cache.prefix is not None else (cache.region.start, cache.used_tokens() + count)
                      for cache, count in zip(caches, counts, strict=True)], counts, arena.windows,
                     ChainPlan(arena, [caches[i] for i in chained], [counts[i] for i in chained], device)
                     if chained else None, device)
    ends = [sum(counts[:index + 1]) for index in range(len(counts))]
    kept = torch.tensor([end - kept + offset for end, kept in zip(ends, keep, strict=True) for offset in range(kept)],
                        device=device)
    output = model(input_ids=torch.tensor([[t for tokens in inputs for t in tokens]], dtype=torch.long, device=device),
                   position_ids=torch.tensor([[n + offset for n, count in zip(lengths, counts, strict=True)
                                               for offset in range(count)]], device=device),
                   cache=_ArenaStep(arena, caches, counts, device), use_cache=True, logits_to_keep=kept,
                   arena_rows=rows)
    for entry, tokens in zip(entries, inputs, strict=True):
        entry.extend(list(tokens))
    return list(output.logits[0].split(list(keep)))
