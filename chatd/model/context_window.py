"""Fit a conversation into the model's context: keep the system prompt, drop the oldest whole turns.

The number of dropped turns is remembered in the session, so later turns render the same window and
reuse its cache; the window only moves when the conversation outgrows the context again, and then it
moves far enough (to REFILL_SHARE of the context) that several turns fit before the next move.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from chatd.model.prompt import PromptRenderer
from sessions import Message

REFILL_SHARE = 0.75


@dataclass(frozen=True)
class Window:
    """The part of a conversation that fits the context: its messages, their ids, and the turns left out."""

    messages: list[Message]  # what the prompt renders
    prompt_ids: list[int]
    dropped_turns: int  # oldest turns left out, from the start of the conversation


class DoesNotFit(ValueError):
    """Even with every earlier turn dropped, the prompt leaves no room for the reply."""


def fit(renderer: PromptRenderer, messages: list[Message], dropped_turns: int, context: int, room: int,
        tools: Sequence[dict] | None = None, add_generation_prompt: bool = True) -> Window:
    """The window of `messages` (system prompt, history, new message) to render: the history after
    `dropped_turns` turns, or fewer of them when the prompt plus `room` tokens would overflow `context`. A turn
    ends with a reply; the window never starts with a tool's result, whose call it would leave out. Without
    `add_generation_prompt` (a warm-up), the last message may be the system prompt itself."""
    system = messages[:1] if messages and messages[0].role == "system" else []
    history, new = messages[len(system):-1], messages[len(system):][-1:]
    starts = [0] + [index + 1 for index, message in enumerate(history) if message.role == "assistant"]
    # Where a window may start: the whole history, or a later turn that does not start with a tool's result.
    cuts = [0] + [drop for drop, start in enumerate(starts) if drop and (history + new)[start].role != "tool"]

    def render(drop: int) -> Window:
        kept = system + history[starts[drop]:] + new
        return Window(kept, renderer.render(kept, add_generation_prompt, tools=tools), drop)

    window = render(next((drop for drop in cuts if drop >= dropped_turns), cuts[-1]))
    if len(window.prompt_ids) + room <= context:
        return window
    target = int(context * REFILL_SHARE)
    for drop in (drop for drop in cuts if drop > window.dropped_turns):
        if len(window.prompt_ids) + room <= target:
            break
        window = render(drop)
    if len(window.prompt_ids) + room > context:
        raise DoesNotFit(f"the message is too long: with the system prompt it takes {len(window.prompt_ids)} "
                         f"tokens and the reply needs {room} more; the model's context is {context}")
    return window
