"""What a turn wrote into the cache, as both APIs' usage reports it: the prompt tokens it prefilled up to a
breakpoint (Anthropic's `cache_control`, OpenAI's `prompt_cache_breakpoint`), or all it prefilled."""

from __future__ import annotations

from cache_store import common_prefix_length


def written_tokens(prompt_ids: list[int], read: int, breakpoint: list[int] | None) -> int:
    """The prompt tokens a turn that read `read` of them wrote up to `breakpoint`, the ids of the conversation up to
    it (None: the whole prompt; []: none)."""
    through = len(prompt_ids) if breakpoint is None else common_prefix_length(prompt_ids, breakpoint)
    return max(0, through - read)
