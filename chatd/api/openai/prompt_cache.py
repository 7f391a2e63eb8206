"""OpenAI's prompt-cache controls, as chatd honours them on chat completions and the Responses API: how long what a
request writes stays cached (`prompt_cache_options.ttl`, a breakpoint's own `ttl`, the older
`prompt_cache_retention`), what its usage counts as written (`mode: explicit`: only up to its last
`prompt_cache_breakpoint`), and `prompt_cache_diagnostics` against an earlier response, from chatd's own account of
the turn's cache."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from chatd.api.cache_writes import written_tokens
from chatd.api.tool_calling import RequestRefused
from chatd.engine.turn import TurnResult

TTL_SECONDS = {"30m": 1800.0, "12h": 43200.0}
RETENTION_SECONDS = {"24h": 86400.0}  # (`in_memory`: as any idle cache)
MAX_BREAKPOINTS = 4  # as OpenAI's: a request writes at most four breakpoints


class PromptCacheBreakpoint(BaseModel):
    """`prompt_cache_breakpoint` on a text part: the conversation up to its message stays cached for `ttl` (the
    request's when omitted)."""

    model_config = ConfigDict(extra="ignore")

    mode: Literal["explicit"] = "explicit"
    ttl: Literal["30m", "12h"] | None = None


class PromptCacheOptions(BaseModel):
    """`prompt_cache_options`: `ttl`, the least time what the request writes stays cached; `mode: explicit`, only its
    breakpoints are written; `prewarm`, prefill without generating (a warm-up); `comparison_response_id`, the
    response whose cache use this one's diagnostics compare with."""

    model_config = ConfigDict(extra="ignore")

    mode: Literal["implicit", "explicit"] = "implicit"
    ttl: Literal["30m", "12h"] | None = None
    prewarm: bool = False
    comparison_response_id: str | None = Field(None, max_length=128)


class PromptCacheControls(BaseModel):
    """The prompt-cache fields both OpenAI request bodies take, and what they mean for the turn."""

    prompt_cache_options: PromptCacheOptions | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None  # (deprecated by prompt_cache_options.ttl)

    def breakpoints(self) -> list[tuple[int, PromptCacheBreakpoint]]:
        """Each `prompt_cache_breakpoint`, with the index of the message it ends (as the body numbers them)."""
        raise NotImplementedError

    def keep_for_s(self) -> float | None:
        """How long what the request writes stays cached at least, ahead of plain LRU (`keep_for_s`)."""
        return keep_for_s(self.prompt_cache_options, self.prompt_cache_retention,
                          [mark for _, mark in self.breakpoints()])

    @property
    def explicit_cache(self) -> bool:
        """Whether only the request's breakpoints count as written (`prompt_cache_options.mode: explicit`)."""
        return self.prompt_cache_options is not None and self.prompt_cache_options.mode == "explicit"


def keep_for_s(options: PromptCacheOptions | None, retention: str | None,
               breakpoints: list[PromptCacheBreakpoint]) -> float | None:
    """How long what the request writes stays cached at least, ahead of plain LRU (the longest of the request's ttl,
    its breakpoints' and `prompt_cache_retention`); None: as any idle cache. Refuses `ttl` given with
    `prompt_cache_retention`, and more than four breakpoints."""
    request_ttl = options.ttl if options is not None else None
    if request_ttl is not None and retention is not None:
        raise RequestRefused("prompt_cache_retention", "give prompt_cache_options.ttl or prompt_cache_retention, "
                                                       "not both")
    if len(breakpoints) > MAX_BREAKPOINTS:
        raise RequestRefused("prompt_cache_breakpoint", f"at most {MAX_BREAKPOINTS} content blocks may have "
                                                        f"prompt_cache_breakpoint, not {len(breakpoints)}")
    seconds = [TTL_SECONDS[mark.ttl or request_ttl or "30m"] for mark in breakpoints]
    seconds += [TTL_SECONDS[request_ttl]] if request_ttl is not None else []
    seconds += [RETENTION_SECONDS[retention]] if retention in RETENTION_SECONDS else []
    return max(seconds, default=None)


@dataclass(frozen=True)
class CacheAccount:
    """A request's account of its cache: what its usage counts as written (everything it prefilled in implicit mode;
    in explicit mode what it prefilled up to its last breakpoint, `breakpoint_ids` being the conversation's ids up to
    there, [] without one), and, when it named a `comparison_response_id`, that response's object (None: not
    found) for its diagnostics."""

    explicit: bool = False
    breakpoint_ids: list[int] | None = None
    compared: bool = False
    comparison: dict[str, Any] | None = None

    def write_tokens(self, result: TurnResult) -> int:
        if not self.explicit:
            return result.prompt_tokens - result.cached_tokens
        prompt_ids = result.conversation_ids[:result.prompt_tokens]
        return written_tokens(prompt_ids, result.cached_tokens, self.breakpoint_ids or [])

    def diagnostics(self, result: TurnResult, response: dict[str, Any]) -> dict[str, Any] | None:
        return diagnostics(result, response, self.comparison) if self.compared else None


IMPLICIT = CacheAccount()  # a request without breakpoints or a comparison: all it prefilled counts as written

# chatd's miss reasons that say why a cache a client could expect was not there (OpenAI has no reason for them)
_UNAVAILABLE = ("evicted", "stale", "corrupt", "disabled")


def diagnostics(result: TurnResult, response: dict[str, Any], comparison: dict[str, Any] | None) -> dict[str, Any]:
    """`prompt_cache_diagnostics` of `response` (this response's object) against `comparison` (the earlier one's,
    None: not found for this key): a hit when the turn read at least what the earlier response's prompt could give
    it; else the first setting that changes the prompt's cache (`model`, `prompt_cache_key`, `tools`, `text`), the
    context compacted (chatd dropped the oldest turns), `unavailable` when the cache was lost rather than missed
    (evicted, stale, corrupt, off), or the input itself."""
    if comparison is None:
        return {"type": "comparison_response_not_found"}
    reusable = int((comparison.get("usage") or {}).get("input_tokens") or 0)
    if result.cached_tokens > 0 and result.cached_tokens >= min(reusable, result.prompt_tokens) - 1:
        return {"type": "cache_hit"}
    changed = next((reason for field, reason in (("model", "model_changed"),
                                                 ("prompt_cache_key", "prompt_cache_key_changed"),
                                                 ("tools", "tools_changed"), ("text", "text_format_changed"))
                    if comparison.get(field) != response.get(field)), None)
    if changed is None and result.miss_reason in _UNAVAILABLE:
        return {"type": "unavailable"}
    reason = changed or ("context_compacted" if result.miss_reason == "truncated" else "input_changed")
    return {"type": "cache_miss", "reason": reason, "cache_missed_tokens": result.prompt_tokens - result.cached_tokens,
            "comparison_reusable_tokens": reusable}
