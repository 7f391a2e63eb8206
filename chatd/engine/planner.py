"""Plan: what each engine step runs, from the turns waiting, fetching, prefilling and decoding.

Admission (oldest first, under the batch size and the device budget), the fetch state (a turn whose cache comes from
Redis waits in its own state while the batch decodes on), each turn's cache lookup and its room in the arena, the
prefill chunks under `--prefill-chunk` (a chunk alone, or a prompt's last chunk riding the decode step), and the
decode step's rows with their drafts. Nothing here runs the model: the executor does, and the updater takes what it
returns.

The prefill chunks are planned one at a time, each after the ones ahead of it ran: a turn looks its cache up as late
as possible, so that a turn ahead that shared its system prompt in this very step has shared it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

import torch

from cache_store import ArenaCache, ArenaFull, CacheStore, FaultPoints, KVArena, SessionRunning, segments
from cache_store.failure_log import log_failure
from chatd.config import Settings
from chatd.engine.drafts import Speculator
from chatd.engine.endings import TurnEndings
from chatd.engine.grammar import GrammarCompiler
from chatd.engine.running_turn import RunningTurn
from chatd.engine.step_plan import DecodePlan, DecodeRow, PrefillChunk, StepCounts
from chatd.engine.turn import Turn, TurnFailed
from chatd.engine.turn_queues import TurnQueues
from chatd.engine.turn_setup import CacheFinder, TurnPreparer

log = logging.getLogger(__name__)


class StepPlanner:
    """What each step runs of the turns in `queues`, which it reads and moves on as it plans. The engine thread's
    alone."""

    def __init__(self, settings: Settings, queues: TurnQueues, cache: CacheStore, arena: KVArena,
                 preparer: TurnPreparer, finder: CacheFinder, grammars: GrammarCompiler, speculator: Speculator,
                 faults: FaultPoints, endings: TurnEndings, counts: StepCounts, left_queue: Callable[[], None]):
        self._settings, self._queues, self._cache, self._arena = settings, queues, cache, arena
        self._preparer, self._finder, self._grammars, self._speculator = preparer, finder, grammars, speculator
        self._faults, self._endings, self._counts, self._left_queue = faults, endings, counts, left_queue

    # ----- admission and the fetch state -----

    def collect_fetches(self) -> None:
        """Turns whose fetch has finished, or that waited for it as long as recomputing would take, go back to the
        front of the prefilling turns (oldest first), to look up their cache; cancelled ones end."""
        for running in self._queues.fetched():
            self._endings.cancelled(running)

    def admit(self) -> None:
        """Start waiting turns, oldest first, while the batch has room and the device budget can hold
        what their caches may reach; each is then looked up and prefilled chunk by chunk before it
        joins the decode batch. The oldest that does not fit waits, and the others behind it, for a
        running turn to finish (first come, first served)."""
        queues = self._queues
        while (queues.head or queues.queued) and len(queues.started()) < self._settings.max_batch:
            waiting = queues.next_to_admit()
            running = waiting if isinstance(waiting, RunningTurn) else self._render(waiting)
            if running is None:
                self._left_queue()
                continue
            turn = running.turn
            if turn.cancelled.is_set():
                self._left_queue()
                self._endings.cancelled_before_start(turn)
                continue
            try:
                admitted = self._cache.admit(turn.session_id, turn, running.reserve_bytes,
                                             alone=not queues.started())
            except SessionRunning as error:  # a second turn of a session: never let it near the cache
                self._left_queue()
                self._endings.end(turn, TurnFailed("busy", f"{error}; retry when it has finished"))
                continue
            except Exception as error:
                self._left_queue()
                self._endings.fail(turn, error, "admission")
                continue
            if not admitted:
                queues.wait_for_room(running)
                return
            self._left_queue()
            queues.admitted(running)

    def _render(self, turn: Turn) -> RunningTurn | None:
        try:
            self._faults.check("render", turn.session_id)
            with torch.inference_mode():
                prepared = self._preparer.prepare(turn)
        except Exception as error:
            self._endings.fail(turn, error, "render")
            return None
        if isinstance(prepared, TurnFailed):
            self._endings.end(turn, prepared)
            return None
        return prepared

    # ----- prefill -----

    def prefill_chunks(self, riders: list[RunningTurn]) -> Iterator[PrefillChunk]:
        """This step's chunks fed alone, up to --prefill-chunk prompt tokens on the oldest prefilling turns (so that
        prefill shares the engine with the others' decode steps, and several short prefills, a returning customer's
        new message on top of its cache, start in the same step). Each is run and taken before the next is planned.
        A turn whose last chunk rides the decode pass instead is added to `riders`, for `decode_plan`."""
        budget, prefilling = self._settings.prefill_chunk, self._queues.prefilling
        while prefilling and budget > 0:
            head = prefilling[0]
            if (chunk := self._next_chunk(head, budget)) is not None:
                budget -= len(chunk.tokens)
                if chunk.rides:
                    riders.append(head)
                else:
                    yield chunk
            if prefilling and prefilling[0] is head and not head.has_room:
                return  # it waits for a decoding turn to finish and free its region (first come, first served)

    def _next_chunk(self, running: RunningTurn, budget: int) -> PrefillChunk | None:
        """What the turn at the front feeds next (at most `budget` tokens): a chunk of its deep check or of its prompt,
        or the rest of its prompt riding the decode step; None when it feeds nothing now (it ended, waits for room, or
        waits for its cache from Redis)."""
        if running.turn.cancelled.is_set():
            self._queues.left_prefill(running)
            self._endings.cancelled(running)
            return None
        session_id = running.turn.session_id
        stage = "lookup"
        try:
            with torch.inference_mode():
                if running.lookup is None and not self._look_up(running):
                    return None
                if running.deep_check is not None:  # (a sampled reuse: checked first, in chunks like a prefill)
                    start = running.deep_check.scratch.num_tokens
                    return PrefillChunk(running, running.deep_check.entry.token_ids[start:start + budget], check=True)
                if not running.has_room and not self._make_room(running):
                    return None
                stage = "prefill"
                self._faults.check("prefill", session_id)
        except Exception as error:
            self._queues.left_prefill(running)
            self._endings.fail(running, error, stage)
            return None
        if self._rides(running, budget):
            self._queues.left_prefill(running)
            return PrefillChunk(running, running.pending, rides=True)
        if running.share_prefix:  # the system prompt alone first (in chunks too), to be shared with later sessions
            return PrefillChunk(running, running.pending[:min(budget, running.prefix_len - running.entry.num_tokens)])
        return PrefillChunk(running, running.pending[:budget])

    def _look_up(self, running: RunningTurn) -> bool:
        """Find the turn's cache (as late as possible: turns ahead may have shared a prefix), once what should come
        from Redis has come; whether its prefill can begin now (it may start a fetch, or wait for room)."""
        self._faults.check("lookup", running.turn.session_id)
        try:
            if running.fetch is None and self._fetch(running):
                return False
            lookup = self._finder.find(running)
        except ArenaFull:  # no room on the device for its cache (restored, fetched, or its segment)
            self._wait_for_room(running)
            return False
        self._finder.begin_prefill(running, lookup)
        return True

    def _fetch(self, running: RunningTurn) -> bool:
        """Start fetching the turn's cache from Redis when it should (on the remote tier's threads); the turn then
        waits among the fetching turns, and the batch goes on. Whether it does."""
        request = self._finder.remote_request(running)
        if request is None:
            return False
        self._queues.to_fetch(running, self._cache, request)
        return True

    def _rides(self, running: RunningTurn, budget: int) -> bool:
        """Whether the turn's last chunk is fed in this step's decode pass, as one more row of it (one pass for the
        decoding turns and a returning customer's new message): when there is a decode step, the rest of its prompt
        fits the budget, its cache is in the arena, and no system prompt is to be split off and shared."""
        return (bool(self._queues.decoding) and len(running.pending) <= budget and not running.share_prefix
                and isinstance(running.entry.cache, ArenaCache))

    # ----- room in the arena -----

    def _make_room(self, running: RunningTurn) -> bool:
        """Give the turn's cache a region for all it may reach. With no region free even after compaction and
        evicting every idle cache, it waits for a decoding turn to finish; with none decoding, it is answered
        `busy` (its cache written back as it found it). A turn longer than the whole arena runs in a temporary
        cache outside it instead, so that the device budget never shortens what the model is shown."""
        tokens = len(running.prompt_ids) + running.max_new_tokens
        if tokens > self._arena.tokens:
            if isinstance(running.entry.cache, ArenaCache):
                running.entry.move_out_of_arena()
            self._counts.outside_arena_turns += 1
            log.info("session %s: its turn may reach %d tokens, more than the whole KV arena (%d): it runs in a "
                     "temporary cache outside the arena, which leaves the device at write-back",
                     running.turn.session_id, tokens, self._arena.tokens)
            running.has_room = True
            return True
        try:
            running.entry.cache.reserve(tokens)
        except ArenaFull:
            self._wait_for_room(running)
            return False
        running.has_room = True
        return True

    def _wait_for_room(self, running: RunningTurn) -> None:
        """The turn stays first in line while a decoding turn may still free a region; with none
        decoding it can only wait forever, so it is answered `busy`, its cache kept as it found it."""
        if self._queues.decoding:
            return
        self._queues.left_prefill(running)
        self._endings.turned_away(running, TurnFailed("busy", "the device has no room for this conversation's cache "
                                                              "right now; retry shortly"))

    # ----- the decode step -----

    def decode_plan(self, riders: list[RunningTurn]) -> DecodePlan | None:
        """The step's packed pass: every decoding turn's next token with its draft, then each riding turn's rest of
        its prompt; None when no turn decodes or rides."""
        batch = self._queues.take_decoding()
        if not batch and not riders:
            return None
        self._counts.batch_sizes[len(batch)] += 1
        self._counts.steps_beside_fetches += bool(self._queues.fetching)
        positions = positions_read(batch)
        needed = self._speculator.cost.break_even(len(batch), positions)
        self._speculator.new_step()
        rows = []
        for running in batch:  # (each draft checked against its grammar first)
            draft = self._draft(running, needed)
            rows.append(DecodeRow(running, [running.next_input, *draft], draft))
        rows += [DecodeRow(running, running.pending, rides=True) for running in riders]
        constrained = [r for r in batch if r.grammar is not None and r.grammar.active]
        masks = self._grammars.masks_ahead([r.grammar for r in constrained]) if constrained else None
        return DecodePlan(rows, len(batch), constrained, masks, positions)

    def _draft(self, running: RunningTurn, needed: float) -> list[int]:
        """The turn's draft for this step: what its conversation or its owner's replies say follows its last
        token (when it is likely enough to be accepted: `needed`), cut to what its grammar (when one constrains it
        now) accepts."""
        if running.drafts is None:
            running.drafts = self._speculator.start(running.prompt_ids, running.prefix_len, running.turn.owner or "")
        draft = self._speculator.propose(running.drafts, running.turn.owner or "", running.generated,
                                         running.max_new_tokens - len(running.generated) - 1, needed)
        if draft and running.grammar is not None and running.grammar.active:
            try:
                draft = draft[:running.grammar.accepted_prefix(draft)]
            except Exception as error:
                # No draft then: a grammar that truly fails fails its turn when its mask is filled.
                log_failure(log, error, "checking a draft against the grammar of session %s failed; no draft this "
                                        "step", running.turn.session_id, level=logging.WARNING)
                return []
        return draft


def positions_read(batch: list[RunningTurn]) -> int:
    """The key and value positions a step of `batch` reads: each row's own, each shared segment once."""
    shared = {id(segment): segment.used_tokens() for running in batch if isinstance(running.entry.cache, ArenaCache)
              for segment in segments(running.entry.cache)}
    return sum(running.entry.own_tokens for running in batch) + sum(shared.values())
