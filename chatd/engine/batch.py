"""One decode step for several sessions at once, each reading and writing its own region of the KV
arena in place.

The step's cache (`_ArenaStep`) writes each row's new key and value at that row's own position in the
arena, one indexed store per layer, and hands attention the arena's buffers; chatd's arena attention
(`chatd.engine.attention`) then runs each row over a view of its own region, exactly as a single
sequence's decode attends: the layer's own window, through the attention transformers chose for the
model. Rows whose caches start with shared segments attend through one `ChainPlan`, which reads each
segment once for all the rows that start with it. Nothing proportional to the cached tokens is copied or
allocated, rows of any lengths share the step, and a session joins or leaves the batch between two steps
without touching the others.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import Cache, CacheLayerMixin

from cache_store import CacheEntry
from cache_store.arena import ArenaCache, KVArena
from chatd.engine.attention import ArenaRows
from chatd.engine.chain_attention import ChainPlan


class _StepLayer(CacheLayerMixin):
    """One layer of a batched step: stores each row's new key and value at its position, in place."""

    is_sliding = False

    def __init__(self, arena: KVArena, index: int, caches: Sequence[ArenaCache], positions: torch.Tensor):
        self._arena, self._index, self._caches, self._positions = arena, index, caches, positions
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        return None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        keys, values = self._arena.keys[self._index], self._arena.values[self._index]
        keys[:, self._positions] = key_states[:, :, 0].transpose(0, 1)  # [rows, heads, dim] -> [heads, rows, dim]
        values[:, self._positions] = value_states[:, :, 0].transpose(0, 1)
        for cache in self._caches:
            cache.layers[self._index].length += 1
        return keys, values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return query_length, 0

    def get_seq_length(self) -> int:
        return 0

    def get_max_length(self) -> int:
        return -1


class _ArenaStep(Cache):
    def __init__(self, arena: KVArena, caches: Sequence[ArenaCache], device: torch.device):
        positions = torch.tensor([cache.region.start + cache.used_tokens() for cache in caches], device=device)
        super().__init__(layers=[_StepLayer(arena, index, caches, positions) for index in range(len(arena.keys))])


def decode_step(model: PreTrainedModel, entries: Sequence[CacheEntry], tokens: Sequence[int],
                device: torch.device) -> torch.Tensor:
    """Feed `tokens[i]` after `entries[i]` for every i in one forward pass; return the logits [B, V]."""
    caches = [entry.cache for entry in entries]
    for cache in caches:
        cache.reserve(cache.get_seq_length() + 1)
    lengths = [cache.get_seq_length() for cache in caches]
    arena = caches[0].arena
    chained = [cache for cache in caches if cache.prefix is not None]
    rows = ArenaRows([None if cache.prefix is not None else (cache.region.start, cache.used_tokens() + 1)
                      for cache in caches], arena.windows,
                     ChainPlan(arena, chained, 1, device) if chained else None)
    output = model(input_ids=torch.tensor([[t] for t in tokens], dtype=torch.long, device=device),
                   position_ids=torch.tensor([[n] for n in lengths], device=device),
                   cache=_ArenaStep(arena, caches, device), use_cache=True, logits_to_keep=1,
                   arena_rows=rows)
    for entry, token in zip(entries, tokens, strict=True):
        entry.extend([token])
    return output.logits[:, -1]
