"""What one engine step runs, as plain values: the planner decides them, the executor runs their forward passes, the
updater takes their logits (vLLM v1's `SchedulerOutput`, between `schedule` and `update_from_output`)."""

from __future__ import annotations

from collections import Counter
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Literal

import torch

from chatd.engine.running_turn import RunningTurn


@dataclass(frozen=True)
class PrefillChunk:
    """A chunk the turn at the front of the prefilling turns feeds: `tokens` of its prompt, alone or (`rides`) as one
    more row of the decode pass, or of its deep check's recompute (`check`: a sampled reuse is checked before its
    prefill, in chunks like one)."""

    running: RunningTurn
    tokens: list[int]
    check: bool = False
    rides: bool = False

    @property
    def stage(self) -> Literal["lookup", "prefill"]:
        """The stage that fails with it: a deep check is part of the lookup."""
        return "lookup" if self.check else "prefill"


@dataclass(frozen=True)
class DecodeRow:
    """One row of the packed decode step: a decoding turn's next token and its draft, or a riding turn's rest of its
    prompt (whose last chunk rides the step as one more row)."""

    running: RunningTurn
    inputs: list[int]
    draft: list[int] = field(default_factory=list)
    rides: bool = False

    @property
    def keep(self) -> int:
        """How many of the row's positions give logits: each of a decoding row's (its draft is verified), a riding
        row's last."""
        return 1 if self.rides else len(self.inputs)

    @property
    def stage(self) -> Literal["prefill", "decode"]:
        return "prefill" if self.rides else "decode"


@dataclass(frozen=True)
class DecodePlan:
    """The step's one forward pass: the decoding rows, then the riding ones; the constrained rows' grammar masks,
    filled while the model computes the logits (llguidance frees the GIL)."""

    rows: list[DecodeRow]
    decoding: int  # rows that decode (the batch size), the riders after them
    constrained: list[RunningTurn]
    masks: Future[torch.Tensor] | None
    positions: int = 0  # key and value positions the decoding rows read (each shared segment once)

    @property
    def tokens(self) -> int:
        return sum(len(row.inputs) for row in self.rows)

    @property
    def drafted(self) -> int:
        return sum(len(row.draft) for row in self.rows)


# A row's outcome from the executor: its logits after each of its kept positions [keep, V], or what failed it.
RowOutcome = tuple[DecodeRow, "torch.Tensor | Exception"]


@dataclass
class StepCounts:
    """What the steps did, for /metrics, /v1/stats and tests."""

    prefill_chunks: int = 0
    riding_prefills: int = 0  # prompts whose last chunk was fed in a decode step, as one more row of it
    outside_arena_turns: int = 0  # turns longer than the whole arena, run in a temporary cache outside it
    steps_beside_fetches: int = 0  # decode steps taken while a turn waited for its cache from Redis
    batch_sizes: Counter[int] = field(default_factory=Counter)  # decode steps by batch size
