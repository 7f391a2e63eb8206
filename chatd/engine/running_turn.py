"""A turn the engine is decoding: everything it needs between two decode steps."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

from cache_store import CacheEntry, CacheLookup, RemoteFetch
from chatd.engine.deep_check import DeepCheck
from chatd.engine.drafts import RowDrafts
from chatd.engine.grammar import ReplyGrammar
from chatd.engine.sampling import TokenSampler
from chatd.engine.text_stream import TextStream
from chatd.engine.turn import FinishReason, TokenText, Turn, TurnResult
from sessions import Message


@dataclass
class RunningTurn:
    """A turn between engine steps: its prompt, cache, sampler, text stream and progress."""

    turn: Turn
    prompt_ids: list[int]
    prefix_len: int  # the system prompt's tokens, which sessions with the same one share
    max_new_tokens: int
    sampler: TokenSampler
    stream: TextStream
    started_at: float  # when the engine took the turn
    messages: list[Message] = field(default_factory=list)  # the window the prompt renders
    dropped_turns: int = 0  # oldest turns the window leaves out
    reserve_bytes: int = 0  # what its cache may reach: counted against the device budget while it runs
    fetch: RemoteFetch | None = None  # its cache on its way from Redis (asked once, before its lookup)
    lookup: CacheLookup | None = None
    deep_check: DeepCheck | None = None  # a sampled reuse's deep check, run in chunks before its prefill
    entry: CacheEntry | None = None  # its cache, which it holds (a reference of its own) from its lookup to its end
    rollback_to: int = 0  # the cache's length before this turn fed it: a cancel crops it back to this
    pending: list[int] = field(default_factory=list)  # prompt ids still to prefill
    share_prefix: bool = False  # prefill the system prompt alone first, and share it
    has_room: bool = False  # its cache has a region of the arena for all it may reach
    first_token_at: float = 0.0
    generated: list[int] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)  # when each generated token was sampled
    next_input: int | None = None  # the token to feed at the next decode step
    grammar: ReplyGrammar | None = None  # what the reply must follow, if anything
    drafts: RowDrafts | None = None  # its speculative drafting, from its first decode step (None: off)

    def hold(self, entry: CacheEntry) -> None:
        """Take `entry` (a lookup's reference, or a new cache) as the turn's cache, letting go of the one before (a
        lookup that passed its deep check hands back the cache the turn holds already: still one reference)."""
        if entry is not self.entry:
            self.let_go()
            self.entry = entry

    def let_go(self) -> None:
        """The turn is done with its cache: its reference is released (after a write-back the device tier holds it)."""
        if self.entry is not None:
            self.entry.release()
            self.entry = None

    def held_back(self, stop_token_ids: frozenset[int]) -> list[int]:
        """The ending tokens the reply may not sample now (a grammar, where there is one, decides its end alone):
        every ending token before `min_tokens`, the model's own with `ignore_eos`."""
        params = self.turn.params
        if self.grammar is not None:
            return []
        if len(self.generated) < params.min_tokens:
            return sorted(stop_token_ids | set(params.stop_token_ids))
        return sorted(stop_token_ids) if params.ignore_eos else []

    def accept(self, token: int, stop_token_ids: frozenset[int]) -> FinishReason | None:
        """Take one sampled token: stream its text and say whether the turn ends here."""
        if token in stop_token_ids or token in self.turn.params.stop_token_ids:
            return "stop"
        self.generated.append(token)
        self.token_times.append(time.perf_counter())
        if text := self.stream.push(token):
            self.turn.emit(TokenText(text))
        if self.stream.stopped:
            return "stop"
        if self.grammar is not None:
            self.grammar.accept(token, self.stream.text)
            if self.grammar.error is not None:
                return "grammar"
            if self.grammar.complete:  # nothing but the end of the reply may follow: no step spent on it
                return "stop"
        if len(self.generated) >= self.max_new_tokens:
            return "length"
        if self.turn.cancelled.is_set():
            return "cancelled"
        if self.turn.steered.is_set() and not self._in_call():
            return "steered"
        self.next_input = token
        return None

    def _in_call(self) -> bool:
        """Whether the reply has opened a tool call, or may be opening one (its text ends with the start of the
        trigger): a steer lets the call be finished."""
        trigger, text = self.turn.call_trigger, self.stream.text
        if trigger is None:
            return False
        return trigger in text or any(text.endswith(trigger[:length]) for length in range(1, len(trigger)))

    def result(self, finish: FinishReason) -> TurnResult:
        if text := self.stream.finish():
            self.turn.emit(TokenText(text))
        finished_at = time.perf_counter()
        decode_s = finished_at - self.first_token_at
        generated, lookup, ms = self.generated, self.lookup, 1000.0
        return TurnResult(
            finish_reason=finish, content=self.stream.text, prompt_tokens=len(self.prompt_ids),
            completion_tokens=len(generated), cached_tokens=lookup.cached_tokens, cache_source=lookup.source,
            miss_reason=lookup.miss_reason, token_ids=list(generated), cleared=list(lookup.cleared),
            remote=dataclasses.asdict(lookup.remote) if lookup.remote else None, quantized=lookup.quantized,
            conversation_ids=list(self.entry.token_ids),
            token_times=list(self.token_times), dropped_turns=self.dropped_turns,
            reply_ids=list(generated) if self.stream.decode(generated) == self.stream.text else None,
            grammar_error=self.grammar.error if self.grammar is not None else None,
            stop_sequence=self.stream.stop_sequence,
            draft_tokens=self.drafts.drafted if self.drafts else 0,
            accepted_tokens=self.drafts.accepted if self.drafts else 0,
            timings={
                "queue_ms": (self.started_at - self.turn.received_at) * ms,
                "ttft_ms": (self.first_token_at - self.turn.received_at) * ms,
                "prefill_ms": (self.first_token_at - self.started_at) * ms,
                "decode_ms": decode_s * ms,
                "total_ms": (finished_at - self.turn.received_at) * ms,
                "tokens_per_s": (len(generated) - 1) / decode_s if len(generated) > 1 and decode_s > 0 else 0.0,
            },
        )
