"""Execute: the forward passes of a step's plan (`ModelRunner`), and nothing else. A failed packed pass is tried row
by row, so that only the rows that fail by themselves fail; what failed each is handed to the updater. An error the
engine cannot go on from (`is_fatal`) propagates at once."""

from __future__ import annotations

import logging
import time

import torch

from cache_store import FaultPoints
from chatd.engine.model_runner import ModelRunner
from chatd.engine.step_cost import StepCost
from chatd.engine.step_plan import DecodePlan, DecodeRow, PrefillChunk, RowOutcome
from chatd.engine.supervision import is_fatal

log = logging.getLogger(__name__)


class StepExecutor:
    """Runs a step's prefill chunks and its packed decode pass; times the pass for the drafts' cost model."""

    def __init__(self, runner: ModelRunner, faults: FaultPoints, cost: StepCost):
        self._runner, self._faults, self._cost = runner, faults, cost

    def prefill(self, chunk: PrefillChunk) -> torch.Tensor | Exception | None:
        """Feed a chunk alone: the logits after its last token (None for a deep check's, which keeps its own), or what
        failed it (a pass that fails leaves the cache as it was)."""
        running = chunk.running
        try:
            with torch.inference_mode():
                if chunk.check:
                    running.deep_check.advance(self._runner.forward, len(chunk.tokens))
                    return None
                return self._runner.timed_prefill(running.entry, chunk.tokens)
        except Exception as error:
            if is_fatal(error):
                raise
            return error

    def decode(self, plan: DecodePlan) -> list[RowOutcome]:
        """The plan's one pass: each row's logits after each of its kept positions, or what failed it."""
        try:
            started = time.perf_counter()
            logits = self._forward(plan.rows)
            self._took(plan, started)
            return list(zip(plan.rows, logits, strict=True))
        except Exception as error:
            if is_fatal(error):
                raise
            if len(plan.rows) == 1:
                return [(row, error) for row in plan.rows]
            log.warning("a batched decode step of %d turns failed (%s: %s); trying each turn alone", len(plan.rows),
                        type(error).__name__, error)
        outcomes: list[RowOutcome] = []
        for row in plan.rows:
            try:
                outcomes.append((row, self._forward([row])[0]))
            except Exception as alone_error:
                if is_fatal(alone_error):
                    raise
                outcomes.append((row, alone_error))
        return outcomes

    def _forward(self, rows: list[DecodeRow]) -> list[torch.Tensor]:
        """One pass over `rows` (a pass that fails leaves every cache as it was)."""
        for row in rows:
            if not row.rides:  # (a riding turn was checked as it prefilled)
                self._faults.check("decode", row.running.turn.session_id)
        with torch.inference_mode():
            return self._runner.decode([row.running.entry for row in rows], [row.inputs for row in rows],
                                       [row.keep for row in rows])

    def _took(self, plan: DecodePlan, started: float) -> None:
        """The pass has run: its cost for its shape tells whether drafts pay (on CUDA, once its kernels have
        finished: sampling waits for them next anyway). A pass a prompt rode is another shape: not recorded."""
        if self._runner.loaded.device.type == "cuda":
            torch.cuda.synchronize(self._runner.loaded.device)
        if len(plan.rows) == plan.decoding:
            self._cost.record(time.perf_counter() - started, plan.decoding, plan.drafted, plan.positions)
