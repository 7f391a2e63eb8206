"""Before a turn's prefill: its prompt rendered within the context, the part a session may share (its
system prompt), the arena region it may reach; then its cache found and checked."""

from __future__ import annotations

import dataclasses
import functools
import logging
import random
import time
from collections import deque

import torch

from cache_store import (
    CacheEntry,
    CacheLookup,
    CacheQuery,
    CacheStore,
    FetchRequest,
    KVArena,
    TemporaryCache,
    kv_bytes_per_token,
)
from chatd.config import Settings
from chatd.engine.deep_check import DEEP_CHECK_TOLERANCE, DEEP_CHECK_TOLERANCE_INT8, DeepCheck
from chatd.engine.grammar import GrammarCompiler
from chatd.engine.model_runner import ModelRunner
from chatd.engine.running_turn import RunningTurn
from chatd.engine.sampling import TokenSampler
from chatd.engine.text_stream import TextStream
from chatd.engine.turn import Turn, TurnFailed
from chatd.model.context_window import DoesNotFit, Window, fit
from chatd.model.loader import LoadedModel
from chatd.model.prompt import PromptRenderer
from sessions import Message

log = logging.getLogger(__name__)


class TurnPreparer:
    """Render a queued turn into a `RunningTurn`, or say why it cannot run (`too_long`)."""

    def __init__(self, loaded: LoadedModel, arena: KVArena, settings: Settings, grammars: GrammarCompiler):
        self._loaded, self._arena, self._settings, self._grammars = loaded, arena, settings, grammars
        self._renderer = PromptRenderer(loaded.tokenizer)
        self.system_ids = functools.lru_cache(maxsize=1024)(
            lambda text: self._renderer.render([Message("system", text)], add_generation_prompt=False))
        self._bytes_per_token = kv_bytes_per_token(loaded.model.config, loaded.model.dtype)
        self.max_context = loaded.max_context  # the model's: the device budget never shortens a conversation

    def prepare(self, turn: Turn) -> RunningTurn | TurnFailed:
        """The prompt within the context (the oldest turns dropped if they must be); `too_long` if the new
        message cannot fit."""
        started_at = time.perf_counter()
        message_tokens = self._renderer.count(turn.messages[-1].content)
        if message_tokens > self._settings.max_prompt_tokens:
            return TurnFailed("too_long", f"the message is {message_tokens} tokens; this server takes at most "
                                          f"{self._settings.max_prompt_tokens} per message")
        room = min(turn.params.max_new_tokens, self.max_context // 4)
        try:
            window = self._raw_window(turn, room) if turn.raw else \
                fit(self._renderer, turn.messages, turn.dropped_turns, self.max_context, room, turn.tools,
                    add_generation_prompt=turn.generate)
        except DoesNotFit as error:
            return TurnFailed("too_long", str(error))
        if not turn.truncate and window.dropped_turns > turn.dropped_turns:
            return TurnFailed("context_length_exceeded", f"the conversation does not fit the model's context of "
                                                         f"{self.max_context} tokens with room for the reply, and "
                                                         "truncation is disabled")
        prompt_ids = window.prompt_ids
        max_new_tokens = min(turn.params.max_new_tokens, self.max_context - len(prompt_ids))
        # What its region may reach; a turn longer than the whole arena runs in a temporary cache outside it,
        # which the budget does not count.
        region_tokens = self._arena.region_tokens(len(prompt_ids) + max_new_tokens)
        if region_tokens > self._arena.tokens:
            region_tokens = 0
        grammar = turn.params.grammar
        return RunningTurn(turn, prompt_ids, self._shared_prefix_length(window.messages, prompt_ids), max_new_tokens,
                           TokenSampler(turn.params), TextStream(self._loaded.tokenizer, turn.params.stop),
                           started_at, messages=window.messages, dropped_turns=window.dropped_turns,
                           reserve_bytes=region_tokens * self._bytes_per_token,
                           grammar=self._grammars.start(grammar, turn.session_id) if grammar is not None else None)

    def _raw_window(self, turn: Turn, room: int) -> Window:
        """A text completion's prompt: its text tokenized as transformers' tokenizer does (no chat template)."""
        prompt_ids = self._loaded.tokenizer(turn.messages[-1].content)["input_ids"]
        if len(prompt_ids) + room > self.max_context:
            raise DoesNotFit(f"the prompt is {len(prompt_ids)} tokens and the reply needs {room} more; the model's "
                             f"context is {self.max_context}")
        return Window(turn.messages, prompt_ids, 0)

    def _shared_prefix_length(self, messages: list[Message], prompt_ids: list[int]) -> int:
        """Length of the system prompt's tokens at the start of the prompt, which sessions share."""
        if not messages or messages[0].role != "system":
            return 0
        system_ids = self.system_ids(messages[0].content)
        return len(system_ids) if prompt_ids[:len(system_ids)] == system_ids else 0


class CacheFinder:
    """The turn's cache from the cache store (with its cheap checks), plus the deep check on a sample
    of reuses (`--verify-sample-rate`)."""

    def __init__(self, cache: CacheStore, runner: ModelRunner, settings: Settings, dtype: torch.dtype):
        self._cache, self._runner, self._settings, self._dtype = cache, runner, settings, dtype
        self._sampling = random.Random()
        self.deep_check_distances: deque[float] = deque(maxlen=256)

    def remote_request(self, running: RunningTurn) -> FetchRequest | None:
        """What to fetch from Redis before the turn's lookup, if anything."""
        if running.dropped_turns > running.turn.dropped_turns:
            return None  # (nothing of its cache is reused)
        return self._cache.remote_request(_query(running))

    def find(self, running: RunningTurn) -> CacheLookup:
        """The turn's cache; on a sampled reuse, the deep check it must pass first (`running.deep_check`, run in
        chunks like a prefill, then `judge`). None to reuse when the turn's window just moved past turns the cache
        covered (`truncated`)."""
        turn = running.turn
        if running.dropped_turns > turn.dropped_turns:
            self._cache.drop(turn.session_id, turn.session_version)
            return CacheLookup("miss", 0, miss_reason="truncated")
        lookup = self._cache.lookup(_query(running), turn=turn, fetch=running.fetch)
        if lookup.miss_reason == "new" and any(m.role == "assistant" for m in running.messages):
            lookup = dataclasses.replace(lookup, miss_reason="cold")  # history, but no cache here yet
        if (lookup.entry is not None and lookup.cached_tokens >= 2
                and self._sampling.random() < self._settings.verify_sample_rate):
            # The check feeds the last cached token again; a cache that holds no tokens of its own beyond the shared
            # segments it starts with is checked on a copy, so that the crop into a segment does not unshare it.
            checked = lookup.entry if lookup.entry.own_tokens else lookup.entry.clone(lambda tokens: TemporaryCache())
            running.deep_check = DeepCheck(checked, CacheEntry(self._runner.scratch_cache()))
        return lookup

    def begin_prefill(self, running: RunningTurn, lookup: CacheLookup) -> None:
        """Take the cache the lookup found (or a new one) and line up the prompt tokens it does not cover."""
        running.lookup = lookup
        running.hold(lookup.entry or CacheEntry(self._runner.new_cache()))
        running.has_room = False
        running.rollback_to = lookup.cached_tokens
        running.pending = running.prompt_ids[lookup.cached_tokens:]
        running.share_prefix = lookup.source == "miss" and running.prefix_len > 0

    def judge(self, running: RunningTurn) -> CacheLookup:
        """The turn's deep check, all of its tokens recomputed: its lookup, or a `corrupt` miss."""
        check, lookup, turn = running.deep_check, running.lookup, running.turn
        running.deep_check = None
        distance = check.distance(self._runner.forward)
        self.deep_check_distances.append(distance)
        tolerance = DEEP_CHECK_TOLERANCE_INT8 if lookup.quantized else DEEP_CHECK_TOLERANCE.get(self._dtype, 5e-2)
        if distance > tolerance:
            log.warning("session %s: deep check distance %.3g over %.3g", turn.session_id, distance, tolerance)
            return self._cache.report_corruption(turn.session_id, ("deep",), turn.session_version)
        return lookup


def _query(running: RunningTurn) -> CacheQuery:
    """What the turn asks of the cache store, the same for its request to Redis and its lookup."""
    turn = running.turn
    return CacheQuery(turn.session_id, running.prompt_ids, running.prefix_len, turn.session_version, turn.owner)
