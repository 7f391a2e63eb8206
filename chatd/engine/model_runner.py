"""Forward passes over session caches in the KV arena: one sequence, or one step for a batch of them (each
row one token, or a draft to verify).

A CUDA out-of-memory error rolls every cache involved back to its length before the call, asks for
room (the engine offloads idle caches) and tries once more; a second failure propagates.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import torch
from transformers import DynamicCache

from cache_store import ArenaCache, CacheEntry, KVArena, TemporaryCache
from chatd.engine.attention import use_arena_attention
from chatd.engine.batch import batched_step
from chatd.engine.chain_attention import ChainPlan
from chatd.model.loader import LoadedModel

log = logging.getLogger(__name__)


class ModelRunner:
    """Forward passes over caches in the KV arena, one sequence or a batched decode step, with an OOM retry."""

    def __init__(self, loaded: LoadedModel, arena: KVArena, make_room: Callable[[], int],
                 on_prefill: Callable[[int, float], None]):
        self.loaded = loaded
        self.arena = arena
        self._make_room = make_room  # frees device memory; returns how many caches it moved
        self._on_prefill = on_prefill  # (tokens, seconds) of every timed prefill
        self.attention = use_arena_attention(loaded.model)  # "sdpa", or "eager" where sdpa cannot serve

    def new_cache(self, tokens: int = 0) -> ArenaCache | TemporaryCache:
        """An empty cache for `tokens`: a region of the arena, or, for more than the whole arena holds, a
        temporary cache outside it (so that no conversation is ever cut to the arena's size)."""
        if tokens > self.arena.tokens:
            return TemporaryCache()
        return ArenaCache(self.arena)

    def scratch_cache(self) -> DynamicCache:
        """A cache outside the arena, for a transient computation (the deep check's recompute, a warm-up)."""
        return DynamicCache(config=self.loaded.model.config)

    def forward(self, entry: CacheEntry, token_ids: list[int]) -> torch.Tensor:
        """Append `token_ids` to the session's cache; return the logits after the last of them."""
        return self._retrying([entry], lambda: self._step(entry, token_ids))[-1]

    def decode(self, entries: Sequence[CacheEntry], inputs: Sequence[Sequence[int]],
               keep: Sequence[int] | None = None) -> list[torch.Tensor]:
        """Feed `inputs[i]` (a token, a token and a draft, or the rest of a prompt) after `entries[i]`; return each
        row's logits after each of its last `keep[i]` tokens (all of them without `keep`) [keep[i], V]. The caches in
        the arena step together in one pass; a lone one, and one in a temporary cache outside the arena, step alone.
        A pass that fails leaves every cache as it was (some layers may already hold the new tokens: cropped
        back)."""
        lengths = [entry.num_tokens for entry in entries]
        try:
            return self._decode(entries, inputs, [len(tokens) for tokens in inputs] if keep is None else keep)
        except BaseException:
            for entry, length in zip(entries, lengths, strict=True):
                entry.crop(length)
            raise

    def _decode(self, entries: Sequence[CacheEntry], inputs: Sequence[Sequence[int]], keep: Sequence[int]
                ) -> list[torch.Tensor]:
        together = [i for i, entry in enumerate(entries) if isinstance(entry.cache, ArenaCache)]
        if len(together) < 2:
            together = []
        logits: list[torch.Tensor | None] = [None] * len(entries)
        if together:
            batch = [entries[i] for i in together]
            rows = self._retrying(batch, lambda: batched_step(self.loaded.model, batch, [inputs[i] for i in together],
                                                              [keep[i] for i in together], self.loaded.device))
            for index, row in zip(together, rows, strict=True):
                logits[index] = row
        for index, entry in enumerate(entries):
            if logits[index] is None:
                logits[index] = self._alone(entry, list(inputs[index]), keep[index])
        return logits

    def _alone(self, entry: CacheEntry, tokens: list[int], keep: int) -> torch.Tensor:
        return self._retrying([entry], lambda: self._step(entry, tokens, keep=keep))

    def timed_prefill(self, entry: CacheEntry, token_ids: list[int]) -> torch.Tensor:
        """A prefill whose speed is reported (the cost model compares it with fetching a cache)."""
        started = time.perf_counter()
        logits = self.forward(entry, token_ids)
        if self.loaded.device.type == "cuda":
            torch.cuda.synchronize(self.loaded.device)
        self._on_prefill(len(token_ids), time.perf_counter() - started)
        return logits

    def _step(self, entry: CacheEntry, token_ids: list[int], keep: int = 1) -> torch.Tensor:
        """Feed `token_ids` after the cache; the logits after each of the last `keep` of them [keep, V]."""
        input_ids = torch.tensor([token_ids], dtype=torch.long, device=self.loaded.device)
        cache, chain = entry.cache, {}
        if isinstance(cache, ArenaCache) and cache.prefix is not None:
            # Its shared segments and its own region are attended apart and merged (chain_attention). The region
            # is reserved first, so that nothing moves in the arena during the pass.
            cache.reserve(cache.get_seq_length() + len(token_ids))
            chain = {"arena_chain": (ChainPlan(self.arena, [cache], len(token_ids), self.loaded.device),
                                     self.arena.windows)}
        output = self.loaded.model(input_ids=input_ids, cache=cache, use_cache=True, logits_to_keep=keep, **chain)
        entry.extend(token_ids)
        return output.logits[0, -keep:]

    def _retrying(self, entries: Sequence[CacheEntry], run: Callable[[], torch.Tensor]) -> torch.Tensor:
        lengths = [entry.num_tokens for entry in entries]
        try:
            return run()
        except torch.cuda.OutOfMemoryError:
            for entry, length in zip(entries, lengths, strict=True):
                entry.crop(length)  # some layers may already hold the new tokens
            moved = self._make_room()
            torch.cuda.empty_cache()
            log.warning("out of device memory: offloaded %d idle caches, retrying once", moved)
            return run()
