"""Update: what a step's logits make of its turns. Sampling (under each reply's grammar), draft verification, stop
strings and `max_tokens` (`RunningTurn.accept`), the finite check of a reused cache, the shared system prompt split
off, and each turn's next state: on to the decode batch, back to its prefill, or ended (`TurnEndings`)."""

from __future__ import annotations

import time

import torch

from cache_store import CacheStore, FaultPoints
from chatd.engine.drafts import Speculator
from chatd.engine.endings import TurnEndings
from chatd.engine.grammar import GrammarCompiler, fill_masks, masked_logits, masks_by_row
from chatd.engine.running_turn import RunningTurn
from chatd.engine.step_plan import DecodePlan, PrefillChunk, RowOutcome, StepCounts
from chatd.engine.turn import FinishReason, PromptRead
from chatd.engine.turn_queues import TurnQueues
from chatd.engine.turn_setup import CacheFinder


class StepUpdater:
    """Takes each executed chunk and pass, and moves each turn on in `queues`; the engine thread's alone."""

    def __init__(self, queues: TurnQueues, cache: CacheStore, finder: CacheFinder, grammars: GrammarCompiler,
                 speculator: Speculator, stop_token_ids: frozenset[int], faults: FaultPoints, endings: TurnEndings,
                 counts: StepCounts):
        self._queues, self._cache, self._finder, self._grammars = queues, cache, finder, grammars
        self._speculator, self._stop_token_ids, self._faults = speculator, stop_token_ids, faults
        self._endings, self._counts = endings, counts

    def chunk_fed(self, chunk: PrefillChunk, outcome: torch.Tensor | Exception | None) -> None:
        """A chunk fed alone has run (`outcome`: its logits, or what failed it): a deep check that has recomputed
        everything judges the lookup; a prompt whose last chunk this was samples its first token."""
        running = chunk.running
        if isinstance(outcome, Exception):
            self._fail_prefilling(running, outcome, chunk.stage)
            return
        try:
            with torch.inference_mode():
                if chunk.check:
                    if running.deep_check.done:
                        self._finder.begin_prefill(running, self._finder.judge(running))
                    return
                self._fed(running, chunk.tokens)
        except Exception as error:
            self._fail_prefilling(running, error, chunk.stage)
            return
        if not running.pending:
            self._queues.left_prefill(running)
            self._prefilled(running, outcome)

    def _fail_prefilling(self, running: RunningTurn, error: Exception, stage: str) -> None:
        self._queues.left_prefill(running)
        self._endings.fail(running, error, stage)

    def _fed(self, running: RunningTurn, tokens: list[int]) -> None:
        running.pending = running.pending[len(tokens):]
        if running.share_prefix and running.entry.num_tokens == running.prefix_len:
            # The system prompt's tokens become a shared segment that the turn's cache starts with; its region
            # gave them up, so it is made whole again before the next chunk.
            if self._cache.put_prefix(running.entry, running.turn.owner, source=running.turn.session_id):
                running.has_room = False
            running.share_prefix, running.rollback_to = False, running.prefix_len
        self._counts.prefill_chunks += 1

    def stepped(self, plan: DecodePlan, outcomes: list[RowOutcome]) -> None:
        """The decode pass has run: a riding turn samples its first token; a decoding turn its next ones, as many as
        its draft had right; a row that failed fails alone (at its grammar, when its mask could not be filled)."""
        done = []
        for row, outcome in outcomes:
            if isinstance(outcome, Exception):
                self._endings.fail(row.running, outcome, row.stage)
            else:
                done.append((row, outcome))
        if not done:
            return
        row_masks = {}
        if plan.masks is not None:  # (a row whose grammar failed to fill its mask fails alone: the grammar stage)
            masks = masks_by_row(self._grammars, [r.grammar for r in plan.constrained], plan.masks)
            row_masks = dict(zip(map(id, plan.constrained), masks, strict=True))
        for row, logits in done:
            running = row.running
            if row.rides:
                running.pending = []
                self._counts.prefill_chunks += 1
                self._counts.riding_prefills += 1
                self._prefilled(running, logits[-1])
            elif isinstance(mask := row_masks.get(id(running)), Exception):
                self._endings.fail(running, mask, "grammar")
            else:
                self._advance(running, logits, row.draft, mask)

    def _prefilled(self, running: RunningTurn, first_logits: torch.Tensor) -> None:
        """The turn's prompt is all fed: check what it reused, then sample its first token."""
        if running.lookup.cached_tokens and not bool(torch.isfinite(first_logits).all()):
            # A NaN or Inf anywhere in the reused keys and values reaches these logits: the cheapest
            # finite check there is, on every turn. Start over from scratch.
            self._finder.begin_prefill(running, self._cache.report_corruption(
                running.turn.session_id, ("finite",), running.turn.session_version))
            self._queues.back_to_prefill(running)
            return
        running.first_token_at = time.perf_counter()
        running.turn.prompt_read = PromptRead(running.prompt_ids, running.lookup.cached_tokens)
        if not running.turn.generate:  # a warm-up: its prompt is in the cache, and that was all it asked
            self._endings.finish(running, "prefilled")
            return
        alive, finish = self._take(running, first_logits, None)
        if alive:
            self._next_state(running, finish)

    def _advance(self, running: RunningTurn, logits: torch.Tensor, draft: list[int], mask: torch.Tensor | None
                 ) -> None:
        """Sample the turn's tokens from a step's `logits` [1 + len(draft), V]: the first after its last token,
        then, while each sampled token is the draft's next, the one after it. The first that differs (or ends the
        turn) is the last kept; the draft's positions after it leave the cache as if never written. Greedy, this
        is plain decoding's reply token for token; sampled, each kept token is drawn from the model's own
        distribution at its position, exactly as plain decoding draws it (a draft of one certain token is
        accepted with the probability the model gives it, and a rejection samples the rest)."""
        before = running.entry.num_tokens - len(draft) - 1  # the cache's length before the step
        for position in range(len(draft) + 1):
            alive, finish = self._take(running, logits[position], mask if position == 0 else None)
            if not alive:
                return
            if finish or position == len(draft) or running.next_input != draft[position]:
                break
        if running.entry.num_tokens > before + 1 + position:
            running.entry.crop(before + 1 + position)
        if draft:
            self._speculator.verified(running.drafts, len(draft), position)
        self._next_state(running, finish)

    def _next_state(self, running: RunningTurn, finish: FinishReason | None) -> None:
        """On to the next decode step, or ended with its cache written back."""
        if finish:
            self._endings.finish(running, finish)
        else:
            self._queues.to_decode(running)

    def _take(self, running: RunningTurn, logits: torch.Tensor, mask: torch.Tensor | None
              ) -> tuple[bool, FinishReason | None]:
        """Sample one token from `logits` (its grammar's mask computed now when not ahead) and stream it: whether
        the turn is still alive (a failure ends it here), and whether it finishes with this token."""
        if mask is None and running.grammar is not None and running.grammar.active:  # (not computed ahead)
            try:
                mask = fill_masks(self._grammars, [running.grammar])[0]
            except Exception as error:
                self._endings.fail(running, error, "grammar")
                return False, None
        try:
            self._faults.check("sampling", running.turn.session_id)
            if (allowed := masked_logits(self._grammars, running.grammar, logits, mask)) is None:
                running.grammar.error = running.grammar.error or "the grammar allows no next token"
                return True, "grammar"
            if held := running.held_back(self._stop_token_ids):
                allowed = allowed.clone()
                allowed[..., held] = float("-inf")
            return True, running.accept(running.sampler.next_token(allowed), self._stop_token_ids)
        except Exception as error:
            self._endings.fail(running, error, "sampling")
            return False, None
