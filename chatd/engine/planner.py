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
import time
from collections import deque
from collections.abc import Callable, Iterator

import torch

from cache_store import CacheEntry, CacheLookup, CacheStore, SessionRunning
from cache_store.checks.stage_faults import FaultPoints
from cache_store.device.arena import ArenaCache, ArenaFull
from cache_store.failure_log import log_failure
from chatd.config import Settings
from chatd.engine.drafts import Speculator
from chatd.engine.endings import TurnEndings
from chatd.engine.fetching import FetchingTurns
from chatd.engine.grammar import GrammarCompiler
from chatd.engine.model_runner import ModelRunner
from chatd.engine.running_turn import RunningTurn
from chatd.engine.step_plan import DecodePlan, DecodeRow, PrefillChunk, StepCounts
from chatd.engine.turn import Turn, TurnFailed
from chatd.engine.turn_setup import CacheFinder, TurnPreparer

log = logging.getLogger(__name__)


class StepPlanner:
    """The turns by state, and what each step runs of them. The engine thread's alone."""

    def __init__(self, settings: Settings, cache: CacheStore, runner: ModelRunner, preparer: TurnPreparer,
                 finder: CacheFinder, grammars: GrammarCompiler, speculator: Speculator, faults: FaultPoints,
                 endings: TurnEndings, counts: StepCounts, left_queue: Callable[[], None], wake: Callable[[], None]):
        self._settings, self._cache, self._runner, self._arena = settings, cache, runner, runner.arena
        self._preparer, self._finder, self._grammars, self._speculator = preparer, finder, grammars, speculator
        self._faults, self._endings, self._counts, self._left_queue = faults, endings, counts, left_queue
        self.queued: deque[Turn] = deque()  # submitted, not started: admitted oldest first
        self._head: RunningTurn | None = None  # the oldest, rendered, waiting for device memory
        self.prefilling: deque[RunningTurn] = deque()  # admitted, prompt being fed chunk by chunk
        self.fetching = FetchingTurns(wake)  # admitted, their cache on its way from Redis
        self.decoding: list[RunningTurn] = []  # the decode batch
        self._riders: list[RunningTurn] = []  # prefilling turns whose last chunk rides this step's decode pass

    def started(self) -> list[RunningTurn]:
        """The turns admitted and not ended: decoding, prefilling, or fetching their cache from Redis."""
        return [*self.decoding, *self.prefilling, *self.fetching]

    def has_work(self) -> bool:
        """Whether the next step has a turn to run: one prefilling or decoding, one waiting for room, or a queued one
        the batch has room for (a turn waiting on a full batch, or on Redis, gives the engine nothing to do)."""
        return bool(self.decoding or self.prefilling or self._head
                    or (self.queued and len(self.started()) < self._settings.max_batch))

    @property
    def busy(self) -> bool:
        """Whether the model has work (what the thread governor counts as working)."""
        return bool(self.decoding or self.prefilling)

    def clear(self) -> None:
        """The engine stops: no turn is planned again (the endings answer them)."""
        self.queued.clear()
        self._head, self.prefilling, self.decoding, self._riders = None, deque(), [], []
        self.fetching.clear()

    # ----- admission and the fetch state -----

    def collect_fetches(self) -> None:
        """Turns whose fetch has finished, or that waited for it as long as recomputing would take, go back to the
        front of the prefilling turns (oldest first), to look up their cache; cancelled ones end."""
        for running in reversed(self.fetching.take_done()):
            if running.turn.cancelled.is_set():
                running.fetch.job.cancel()
                self._cache.release(running.turn.session_id)
                self._endings.cancelled_before_start(running.turn)
            else:
                self.prefilling.appendleft(running)

    def admit(self) -> None:
        """Start waiting turns, oldest first, while the batch has room and the device budget can hold
        what their caches may reach; each is then looked up and prefilled chunk by chunk before it
        joins the decode batch. The oldest that does not fit waits, and the others behind it, for a
        running turn to finish (first come, first served)."""
        while (self._head or self.queued) and len(self.started()) < self._settings.max_batch:
            running, self._head = self._head or self._render(self.queued.popleft()), None
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
                                             alone=not self.started())
            except SessionRunning as error:  # a second turn of a session: never let it near the cache
                self._left_queue()
                self._endings.end(turn, TurnFailed("busy", f"{error}; retry when it has finished"))
                continue
            except Exception as error:
                self._left_queue()
                self._endings.fail(turn, error, "admission")
                continue
            if not admitted:
                self._head = running
                return
            self._left_queue()
            self.prefilling.append(running)

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

    def prefill_chunks(self) -> Iterator[PrefillChunk]:
        """This step's chunks fed alone, up to --prefill-chunk prompt tokens on the oldest prefilling turns (so that
        prefill shares the engine with the others' decode steps, and several short prefills, a returning customer's
        new message on top of its cache, start in the same step). Each is run and taken before the next is planned."""
        budget = self._settings.prefill_chunk
        while self.prefilling and budget > 0:
            head = self.prefilling[0]
            if (chunk := self._next_chunk(head, budget)) is not None:
                budget -= len(chunk.tokens)
                if not chunk.rides:
                    yield chunk
            if self.prefilling and self.prefilling[0] is head and not head.has_room:
                return  # it waits for a decoding turn to finish and free its region (first come, first served)

    def _next_chunk(self, running: RunningTurn, budget: int) -> PrefillChunk | None:
        """What the turn at the front feeds next (at most `budget` tokens): a chunk of its deep check or of its prompt,
        or the rest of its prompt riding the decode step; None when it feeds nothing now (it ended, waits for room, or
        waits for its cache from Redis)."""
        if running.turn.cancelled.is_set():
            self.prefilling.popleft()
            self._cancel(running)
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
            self.prefilling.popleft()
            self._endings.fail(running, error, stage)
            return None
        if self._rides(running, budget):
            self.prefilling.popleft()
            self._riders.append(running)
            return PrefillChunk(running, running.pending, rides=True)
        if running.share_prefix:  # the system prompt alone first (in chunks too), to be shared with later sessions
            return PrefillChunk(running, running.pending[:min(budget, running.prefix_len - running.entry.num_tokens)])
        return PrefillChunk(running, running.pending[:budget])

    def _cancel(self, running: RunningTurn) -> None:
        if running.lookup is None:  # its cache was never touched
            self._cache.release(running.turn.session_id)
            self._endings.cancelled_before_start(running.turn)
        else:
            running.first_token_at = time.perf_counter()
            self._endings.finish(running, "cancelled")

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
        self.begin_prefill(running, lookup)
        return True

    def _fetch(self, running: RunningTurn) -> bool:
        """Start fetching the turn's cache from Redis when it should (on the remote tier's threads); the turn then
        waits among the fetching turns, and the batch goes on. Whether it does."""
        request = self._finder.remote_request(running)
        if request is None:
            return False
        self.prefilling.popleft()
        self.fetching.start(running, self._cache, request)
        return True

    def begin_prefill(self, running: RunningTurn, lookup: CacheLookup) -> None:
        """Take the cache the lookup found (or a new one) and line up the prompt tokens it does not cover."""
        running.lookup = lookup
        running.hold(lookup.entry or CacheEntry(self._runner.new_cache()))
        running.has_room = False
        running.rollback_to = lookup.cached_tokens
        running.pending = running.prompt_ids[lookup.cached_tokens:]
        running.share_prefix = lookup.source == "miss" and running.prefix_len > 0

    def _rides(self, running: RunningTurn, budget: int) -> bool:
        """Whether the turn's last chunk is fed in this step's decode pass, as one more row of it (one pass for the
        decoding turns and a returning customer's new message): when there is a decode step, the rest of its prompt
        fits the budget, its cache is in the arena, and no system prompt is to be split off and shared."""
        return (bool(self.decoding) and len(running.pending) <= budget and not running.share_prefix
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
        if self.decoding:
            return
        self.prefilling.popleft()
        session_id = running.turn.session_id
        if running.entry is not None:
            running.entry.crop(running.rollback_to)
            self._cache.put(session_id, running.entry, running.turn.session_version)
            running.let_go()
        else:
            self._cache.release(session_id)
        self._endings.end(running.turn, TurnFailed("busy", "the device has no room for this conversation's cache "
                                                           "right now; retry shortly"))

    # ----- the decode step -----

    def decode_plan(self) -> DecodePlan | None:
        """The step's packed pass: every decoding turn's next token with its draft, then each riding turn's rest of
        its prompt; None when no turn decodes or rides."""
        batch, self.decoding = self.decoding, []
        riders, self._riders = self._riders, []
        if not batch and not riders:
            return None
        self._counts.batch_sizes[len(batch)] += 1
        self._counts.steps_beside_fetches += bool(self.fetching)
        needed = self._speculator.cost.break_even(len(batch))
        self._speculator.new_step()
        rows = []
        for running in batch:  # (each draft checked against its grammar first)
            draft = self._draft(running, needed)
            rows.append(DecodeRow(running, [running.next_input, *draft], draft))
        rows += [DecodeRow(running, running.pending, rides=True) for running in riders]
        constrained = [r for r in batch if r.grammar is not None and r.grammar.active]
        masks = self._grammars.masks_ahead([r.grammar for r in constrained]) if constrained else None
        return DecodePlan(rows, len(batch), constrained, masks)

    def _draft(self, running: RunningTurn, needed: float) -> list[int]:
        """The turn's draft for this step: what its conversation or its owner's replies say follows its last
        token (when it is likely enough to be accepted: `needed`), cut to what its grammar (when one constrains it
        now) accepts."""
        if running.drafts is None:
            running.drafts = self._speculator.start(running.prompt_ids)
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
