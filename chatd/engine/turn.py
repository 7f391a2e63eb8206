"""One turn of a conversation: the single state object that the gateway and the engine share."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from chatd.engine.sampling import SamplingParams
from sessions import Message

# "grammar": the reply's grammar allowed no token or failed; what was generated is not a valid reply.
# "steered": stopped at a token boundary for the client's new input (recorded as far as it got); "prefilled": a
# warm-up, whose prompt was prefilled into the cache and nothing sampled.
FinishReason = Literal["stop", "length", "cancelled", "grammar", "steered", "prefilled"]


@dataclass(frozen=True)
class TokenText:
    """Newly released reply text."""

    text: str


@dataclass(frozen=True)
class TurnResult:
    """A finished turn as the engine reports it: the reply, its usage, timings and cache outcome."""

    finish_reason: FinishReason
    content: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    cache_source: str
    miss_reason: str | None
    timings: dict[str, float]
    token_ids: list[int]
    cleared: list[str] = field(default_factory=list)
    conversation_ids: list[int] = field(default_factory=list)  # prompt and reply ids the cache covers
    remote: dict | None = None  # the fetch-or-recompute decision, when a remote cache existed
    quantized: str | None = None  # "int8" when the reused cache came from a quantised copy
    token_times: list[float] = field(default_factory=list)  # perf_counter() when each reply token was sampled
    dropped_turns: int = 0  # oldest turns the prompt left out to fit the context
    reply_ids: list[int] | None = None  # `token_ids` when `content` decodes from exactly them
    grammar_error: str | None = None  # why the reply's grammar could not go on (finish reason "grammar")
    stop_sequence: str | None = None  # the stop string that ended the reply, if one did
    draft_tokens: int = 0  # speculative draft tokens verified for this reply
    accepted_tokens: int = 0  # of those, the ones the model sampled too (each a decode step saved)

    @property
    def sampled(self) -> bool:
        """Whether a first token was sampled (not a turn cancelled before it, nor a warm-up): its TTFT counts."""
        return self.completion_tokens > 0 or self.finish_reason not in ("cancelled", "prefilled")

    @property
    def inter_token_s(self) -> list[float]:
        return [later - earlier for earlier, later in zip(self.token_times[:-1], self.token_times[1:], strict=True)]

    @classmethod
    def cancelled_before_start(cls, queue_ms: float) -> TurnResult:
        timings = dict.fromkeys(("ttft_ms", "prefill_ms", "decode_ms", "tokens_per_s"), 0.0)
        return cls(finish_reason="cancelled", content="", prompt_tokens=0, completion_tokens=0,
                   cached_tokens=0, cache_source="miss", miss_reason=None,
                   timings={"queue_ms": queue_ms, "total_ms": queue_ms, **timings}, token_ids=[])


@dataclass(frozen=True)
class TurnFailed:
    """A turn the engine could not complete, with the error code the client gets."""

    code: Literal["too_long", "context_length_exceeded", "conflict", "busy", "unavailable", "internal"]
    message: str


TurnEvent = TokenText | TurnResult | TurnFailed


@dataclass(frozen=True)
class PromptRead:
    """A turn's prompt once it is prefilled, before its first token: what an API can report at the start of its
    reply (Anthropic's `message_start` usage)."""

    prompt_ids: list[int]
    cached_tokens: int  # of them, read from a cache


@dataclass
class Turn:
    """A request for one reply. The gateway fills the inputs; the engine reports through `emit`,
    which must be safe to call from the engine thread."""

    turn_id: str
    session_id: str
    messages: list[Message]
    params: SamplingParams
    emit: Callable[[TurnEvent], None]
    owner: str | None = None  # the key's id: shared prefixes are shared within one owner only
    tools: list[dict] | None = None  # function definitions, for a chat template that renders them
    session_version: int = 0  # completed turns the messages include; an older cache is stale
    dropped_turns: int = 0  # oldest turns the session's prompts already leave out
    keep_for_s: float | None = None  # keep its cache resident this long ahead of plain LRU (a cache breakpoint)
    generate: bool = True  # False: a warm-up, its prompt (without the generation prompt) prefilled and kept
    truncate: bool = True  # False: a prompt over the context is refused rather than its oldest turns dropped
    raw: bool = False  # the one message is the prompt's text itself, tokenized without a chat template
    call_trigger: str | None = None  # where the model opens a tool call: a steer never stops a reply inside one
    received_at: float = field(default_factory=time.perf_counter)
    prompt_read: PromptRead | None = None  # set by the engine before it emits the first token
    cancelled: threading.Event = field(default_factory=threading.Event)
    steered: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        self.cancelled.set()

    def steer(self) -> None:
        """Stop at the next token boundary outside a tool call, keeping the reply so far (unlike `cancel`)."""
        self.steered.set()
