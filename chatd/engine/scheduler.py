"""The engine thread: all model work happens here, off the event loop.

The data path of a turn, top to bottom: render the prompt, admit it under the device budget, look up
the session's cache (device, host, Redis, shared prefix, miss), prefill only the tokens the cache does not
cover, stream the reply token by token, write the cache back. This thread never waits on the network: a turn
whose cache must come from Redis waits in its own state (fetching) while the batch decodes on.

Supervision: a failure at any stage fails only the turns of that stage (each gets `internal`, its
cache is dropped from every tier) and the engine goes on. A failure it cannot go on from (its thread
ending, a CUDA error that poisons the context) answers every waiting and running turn `unavailable`,
refuses new ones at once, and is reported to `on_fatal` so that the process can exit for its
supervisor to restart it.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter, deque
from collections.abc import Callable

import torch

from cache_store import (
    CacheEntry,
    CacheLookup,
    CacheStore,
    SessionRunning,
)
from cache_store.checks.stage_faults import FaultPoints, Stage
from cache_store.device.arena import ArenaCache, ArenaFull
from cache_store.failure_log import log_failure
from cache_store.lookup import CopyObserver
from chatd.config import Settings
from chatd.engine.commands import CacheCommand, CacheCommands
from chatd.engine.cpu_share import ThreadGovernor, usable_cpus
from chatd.engine.drafts import ReplyBooks, Speculator
from chatd.engine.fetching import FetchingTurns
from chatd.engine.grammar import GrammarCompiler, fill_masks, masked_logits, masks_by_row
from chatd.engine.model_runner import ModelRunner
from chatd.engine.running_turn import RunningTurn
from chatd.engine.supervision import EngineUnavailable, is_fatal
from chatd.engine.turn import FinishReason, PromptRead, Turn, TurnFailed, TurnResult
from chatd.engine.turn_setup import CacheFinder, TurnPreparer
from chatd.engine.wiring import warm_prompt, wire
from chatd.model.loader import LoadedModel

log = logging.getLogger(__name__)

EXPIRE_EVERY_S = 1.0
PUBLISH_EVERY_S = 0.1  # while busy, how often the counters are published for /metrics and /v1/stats


_STOP = object()
_WAKE = object()  # a fetch finished: look at the fetching turns now


def _queue_ms(turn: Turn) -> float:
    return (time.perf_counter() - turn.received_at) * 1000.0


class Engine(CacheCommands):
    """Owns the model and the session caches. Talk to it only through `submit`, `cancel` (on the
    turn), `drop_cache`, `close_session`, `session_connected`, `prefetch` and `call`; all are safe from any thread."""

    def __init__(self, load: Callable[[], LoadedModel], settings: Settings | None = None,
                 on_cache_copy: CopyObserver | None = None, on_fatal: Callable[[str], None] | None = None):
        self._load = load
        self.settings = settings or Settings()
        self._on_cache_copy = on_cache_copy
        self._on_fatal = on_fatal or (lambda reason: None)
        self.faults = FaultPoints()  # armed only through --enable-fault-injection (and by tests)
        self.failure: str | None = None  # why the engine could not go on, once it could not
        self._closed: str | None = None  # why it takes no more turns: its failure, or a stop
        self.failures: Counter[str] = Counter()  # turns failed, by stage
        self._commands: queue.Queue[object] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="chatd-engine", daemon=True)
        self.ready = threading.Event()
        self.load_error: BaseException | None = None
        self.loaded: LoadedModel | None = None
        self.cache: CacheStore | None = None
        self.runner: ModelRunner | None = None
        self.grammars: GrammarCompiler | None = None  # compiles what constrained replies follow, off this thread
        self.governor: ThreadGovernor | None = None  # fewer threads while other processes take this one's CPUs
        books_mb = self.settings.speculation_books_mb
        self.speculator = Speculator(self.settings.speculation_tokens if self.settings.speculation == "on" else 0,
                                     ReplyBooks(budget_bytes=None if books_mb is None else int(books_mb * 2**20)))
        self._queued: deque[Turn] = deque()  # submitted, not started: admitted oldest first
        self._head: RunningTurn | None = None  # the oldest, rendered, waiting for device memory
        self._live: dict[int, Turn] = {}  # every turn taken from the queue and not yet ended, by id
        self._prefilling: deque[RunningTurn] = deque()  # admitted, prompt being fed chunk by chunk
        self._fetching = FetchingTurns(lambda: self._commands.put(_WAKE))  # admitted, their cache on its way
        self._decoding: list[RunningTurn] = []  # the decode batch
        self._riders: list[RunningTurn] = []  # prefilling turns whose last chunk rides this iteration's decode step
        self.prefill_chunks = 0
        self.riding_prefills = 0  # prompts whose last chunk was fed in a decode step, as one more row of it
        self.outside_arena_turns = 0  # turns longer than the whole arena, run in a temporary cache outside it
        self.cache_stats: dict[str, int | float] = {}  # published between steps: `_publish`
        self._published_at = 0.0
        self.batch_sizes: Counter[int] = Counter()  # decode steps by batch size
        self.steps_beside_fetches = 0  # decode steps taken while a turn waited for its cache from Redis
        self._deferred: list[CacheCommand] = []
        self._waiting = 0
        self._active = 0
        self._counted: set[int] = set()  # the turns `_active` counts (by id), so that one that ends leaves it at once
        self._lock = threading.Lock()  # the waiting count, and submissions against a failure

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._commands.put(_STOP)
        self._thread.join()
        if self.cache is not None and self.cache.remote is not None:
            self.cache.remote.close()
        if self.grammars is not None:
            self.grammars.close()

    @property
    def waiting(self) -> int:
        """Turns submitted that the engine has not started yet."""
        return self._waiting

    @property
    def running(self) -> int:
        """Turns started and not finished (prefilling or decoding), as of the last engine step."""
        return self._active

    def submit(self, turn: Turn) -> None:
        with self._lock:
            if self._closed is None:
                self._waiting += 1
                self._commands.put(turn)
                return
        turn.emit(TurnFailed("unavailable", self._unavailable()))

    def _run(self) -> None:
        try:
            self._prepare(self._load())
        except BaseException as error:  # reported to whoever waits for `ready`
            log.exception("loading the model failed")
            self.load_error = error
            self.failure = f"loading the model failed: {type(error).__name__}: {error}"
            self._stop_serving(self.failure)  # turns sent while it loaded get an answer too
            self.ready.set()
            return
        self.ready.set()
        try:
            self._serve()
        except BaseException as error:  # whatever ends the loop ends the engine: say so, to everyone
            reason = f"{type(error).__name__}: {error}"
            log.critical("the engine cannot go on (%s); failing every turn and stopping", reason, exc_info=error)
            with self._lock:
                self.failure = reason
            self._stop_serving(reason)
            self._on_fatal(reason)
        else:
            self._stop_serving("it was stopped")

    def _serve(self) -> None:
        expired_at = time.monotonic()
        while True:
            idle = not self._has_work()
            if idle or time.monotonic() - self._published_at >= PUBLISH_EVERY_S:
                self._publish()  # before waiting: what /metrics reads while the engine is idle is current
            if not self._take_commands(block=idle):
                break
            self._fetched()
            self._admit()
            if self._prefilling:
                self._prefill_step()
            if self._decoding or self._riders:
                self._decode_step()
            self._counted = {id(running.turn) for running in self._started()}
            self._active = len(self._counted)
            self.governor.tick(working=bool(self._decoding or self._prefilling))
            if time.monotonic() - expired_at >= EXPIRE_EVERY_S:
                self._housekeep(CacheStore.expire)
                expired_at = time.monotonic()

    def _has_work(self) -> bool:
        """Whether this iteration has a turn to run: one prefilling or decoding, one waiting for room, or a queued one
        the batch has room for (a turn waiting on a full batch, or on Redis, gives the engine nothing to do)."""
        return bool(self._decoding or self._prefilling or self._head
                    or (self._queued and len(self._started()) < self.settings.max_batch))

    def _stop_serving(self, reason: str) -> None:
        """Every turn the engine still has, or is sent from now on, gets `unavailable`."""
        with self._lock:
            self._closed = reason
        turns = list(self._live.values())  # wherever each was when the engine stopped
        self._queued.clear()
        self._head, self._prefilling, self._decoding = None, deque(), []
        self._fetching.clear()
        commands = [*self._deferred]
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            (turns if isinstance(command, Turn) else commands).append(command)
        for command in commands:
            if isinstance(command, CacheCommand) and command.result is not None:
                command.result.set_exception(EngineUnavailable(self._unavailable()))
        for turn in turns:
            self._end(turn, TurnFailed("unavailable", self._unavailable()))
        with self._lock:
            self._waiting = 0
        self._counted.clear()
        self._active = 0

    def _end(self, turn: Turn, event: TurnResult | TurnFailed) -> None:
        """A turn's last event: it is no longer the engine's. The counters are published first, so that a
        client that has its answer reads them with its turn counted."""
        self._live.pop(id(turn), None)
        if id(turn) in self._counted:
            self._counted.discard(id(turn))
            self._active -= 1
        self._publish()
        turn.emit(event)

    def _publish(self) -> None:
        """Publish the cache store's and the arena's counters for /metrics and /v1/stats, which read the latest
        snapshot and never wait for the engine."""
        self._published_at = time.monotonic()
        if self.cache is None:
            return
        try:
            self.cache_stats = {**self.cache.stats(), **self.arena.stats(),
                                "outside_arena_turns": self.outside_arena_turns,
                                "fetching_turns": len(self._fetching),
                                "decode_steps_beside_fetches": self.steps_beside_fetches, **self.governor.stats(),
                                "riding_prefills": self.riding_prefills,
                                **self.speculator.published()}
        except Exception as error:  # figures for /metrics: never worth a turn, let alone the engine
            if is_fatal(error):
                raise
            log.exception("reading the cache figures failed; /metrics keeps the last ones")

    def _unavailable(self) -> str:
        return f"the engine has stopped ({self._closed}); retry on another worker or after its restart"

    def _take_commands(self, block: bool) -> bool:
        """Queue new turns (FIFO) and run cache housekeeping; False once asked to stop. Waits for a
        command only when no turn is running (and, with turns fetching, at most until the first gives up)."""
        timeout = self._fetching.wait_s(EXPIRE_EVERY_S)
        try:
            command = self._commands.get(timeout=timeout) if block else self._commands.get_nowait()
        except queue.Empty:
            command = None
        while command is not None:
            if command is _STOP:
                return False
            if isinstance(command, Turn):
                self._queued.append(command)
                self._live[id(command)] = command
            elif command is not _WAKE:  # (a wake-up has nothing to run: the fetching turns are looked at next)
                self._deferred.append(command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                command = None
        running = {r.turn.session_id for r in self._started()}
        ready = [c for c in self._deferred if c.session_id not in running]
        self._deferred = [c for c in self._deferred if c.session_id in running]
        for command in ready:
            self._housekeep(command.action, command.result)
        return True

    def _admit(self) -> None:
        """Start waiting turns, oldest first, while the batch has room and the device budget can hold
        what their caches may reach; each is then looked up and prefilled chunk by chunk before it
        joins the decode batch. The oldest that does not fit waits, and the others behind it, for a
        running turn to finish (first come, first served)."""
        while (self._head or self._queued) and len(self._started()) < self.settings.max_batch:
            running, self._head = self._head or self._render(self._queued.popleft()), None
            if running is None:
                self._left_queue()
                continue
            turn = running.turn
            if turn.cancelled.is_set():
                self._left_queue()
                self._end(turn, TurnResult.cancelled_before_start(_queue_ms(turn)))
                continue
            try:
                admitted = self.cache.admit(turn.session_id, turn, running.reserve_bytes,
                                            alone=not self._started())
            except SessionRunning as error:  # a second turn of a session: never let it near the cache
                self._left_queue()
                self._end(turn, TurnFailed("busy", f"{error}; retry when it has finished"))
                continue
            except Exception as error:
                self._left_queue()
                self._fail(turn, error, "admission")
                continue
            if not admitted:
                self._head = running
                return
            self._left_queue()
            self._prefilling.append(running)

    def _render(self, turn: Turn) -> RunningTurn | None:
        try:
            self.faults.check("render", turn.session_id)
            with torch.inference_mode():
                prepared = self._preparer.prepare(turn)
        except Exception as error:
            self._fail(turn, error, "render")
            return None
        if isinstance(prepared, TurnFailed):
            self._end(turn, prepared)
            return None
        return prepared

    def _left_queue(self) -> None:
        with self._lock:
            self._waiting -= 1

    def _started(self) -> list[RunningTurn]:
        """The turns admitted and not ended: decoding, prefilling, or fetching their cache from Redis."""
        return [*self._decoding, *self._prefilling, *self._fetching]

    def _fetch(self, running: RunningTurn) -> bool:
        """Start fetching the turn's cache from Redis when it should (on the remote tier's threads); the turn then
        waits among the fetching turns, and the batch goes on. Whether it does."""
        request = self._finder.remote_request(running)
        if request is None:
            return False
        self._prefilling.popleft()
        self._fetching.start(running, self.cache, request)
        return True

    def _fetched(self) -> None:
        """Turns whose fetch has finished, or that waited for it as long as recomputing would take, go back to the
        front of the prefilling turns (oldest first), to look up their cache; cancelled ones end."""
        for running in reversed(self._fetching.take_done()):
            if running.turn.cancelled.is_set():
                running.fetch.job.cancel()
                self.cache.release(running.turn.session_id)
                self._end(running.turn, TurnResult.cancelled_before_start(_queue_ms(running.turn)))
            else:
                self._prefilling.appendleft(running)

    def _prefill_step(self) -> None:
        """Spend up to --prefill-chunk prompt tokens on the oldest prefilling turns, so that prefill
        shares the engine with the others' decode steps and several short prefills (a returning
        customer's new message on top of its cache) start in the same step."""
        budget = self.settings.prefill_chunk
        while self._prefilling and budget > 0:
            head = self._prefilling[0]
            budget -= self._prefill_one(head, budget)
            if self._prefilling and self._prefilling[0] is head and not head.has_room:
                return  # it waits for a decoding turn to finish and free its region (first come, first served)

    def _prefill_one(self, running: RunningTurn, budget: int) -> int:
        """Feed the turn's next chunk (at most `budget` tokens); on its last chunk, sample its first
        token and move it to the decode batch. Returns the tokens fed."""
        if running.turn.cancelled.is_set():
            self._prefilling.popleft()
            if running.lookup is None:  # its cache was never touched
                self.cache.release(running.turn.session_id)
                self._end(running.turn, TurnResult.cancelled_before_start(_queue_ms(running.turn)))
                return 0
            running.first_token_at = time.perf_counter()
            self._finish(running, "cancelled")
            return 0
        session_id = running.turn.session_id
        stage: Stage = "lookup"
        try:
            with torch.inference_mode():
                if running.lookup is None:  # as late as possible: turns ahead may have shared a prefix
                    self.faults.check("lookup", session_id)
                    try:
                        if running.fetch is None and self._fetch(running):
                            return 0
                        lookup = self._finder.find(running)
                    except ArenaFull:  # no room on the device for its cache (restored, fetched, or its segment)
                        self._wait_for_room(running)
                        return 0
                    self._begin_prefill(running, lookup)
                if running.deep_check is not None:  # (a sampled reuse: checked first, in chunks like a prefill)
                    fed = running.deep_check.advance(self.runner.forward, budget)
                    if not running.deep_check.done:
                        return fed
                    self._begin_prefill(running, self._finder.judge(running))
                    return fed
                if not running.has_room and not self._make_room(running):
                    return 0
                stage = "prefill"
                self.faults.check("prefill", session_id)
                if self._rides(running, budget):
                    self._prefilling.popleft()
                    self._riders.append(running)
                    return len(running.pending)
                first_logits, fed = self._prefill_chunk(running, budget)
        except Exception as error:
            self._prefilling.popleft()
            self._fail(running, error, stage)
            return 0
        if first_logits is None:
            return fed
        self._prefilling.popleft()
        self._prefilled(running, first_logits)
        return fed

    def _rides(self, running: RunningTurn, budget: int) -> bool:
        """Whether the turn's last chunk is fed in this iteration's decode step, as one more row of it (one pass for
        the decoding turns and a returning customer's new message): when there is a decode step, the rest of its
        prompt fits the budget, its cache is in the arena, and no system prompt is to be split off and shared."""
        return (bool(self._decoding) and len(running.pending) <= budget and not running.share_prefix
                and isinstance(running.entry.cache, ArenaCache))

    def _prefilled(self, running: RunningTurn, first_logits: torch.Tensor) -> None:
        """The turn's prompt is all fed: check what it reused, then sample its first token."""
        if running.lookup.cached_tokens and not bool(torch.isfinite(first_logits).all()):
            # A NaN or Inf anywhere in the reused keys and values reaches these logits: the cheapest
            # finite check there is, on every turn. Start over from scratch.
            self._begin_prefill(running, self.cache.report_corruption(running.turn.session_id, ("finite",),
                                                                      running.turn.session_version))
            self._prefilling.appendleft(running)
            return
        running.first_token_at = time.perf_counter()
        running.turn.prompt_read = PromptRead(running.prompt_ids, running.lookup.cached_tokens)
        self._sample(running, first_logits)

    def _make_room(self, running: RunningTurn) -> bool:
        """Give the turn's cache a region for all it may reach. With no region free even after compaction and
        evicting every idle cache, it waits for a decoding turn to finish; with none decoding, it is answered
        `busy` (its cache written back as it found it). A turn longer than the whole arena runs in a temporary
        cache outside it instead, so that the device budget never shortens what the model is shown."""
        tokens = len(running.prompt_ids) + running.max_new_tokens
        if tokens > self.arena.tokens:
            if isinstance(running.entry.cache, ArenaCache):
                running.entry.move_out_of_arena()
            self.outside_arena_turns += 1
            log.info("session %s: its turn may reach %d tokens, more than the whole KV arena (%d): it runs in a "
                     "temporary cache outside the arena, which leaves the device at write-back",
                     running.turn.session_id, tokens, self.arena.tokens)
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
        if self._decoding:
            return
        self._prefilling.popleft()
        session_id = running.turn.session_id
        if running.entry is not None:
            running.entry.crop(running.rollback_to)
            self.cache.put(session_id, running.entry, running.turn.session_version)
            running.let_go()
        else:
            self.cache.release(session_id)
        self._end(running.turn, TurnFailed("busy", "the device has no room for this conversation's cache right "
                                                   "now; retry shortly"))

    def _sample(self, running: RunningTurn, logits: torch.Tensor, mask: torch.Tensor | None = None) -> None:
        """Pick the turn's next token (among those its grammar allows, `mask` if computed ahead) and stream it;
        it then decodes on, or ends and writes back."""
        alive, finish = self._take(running, logits, mask)
        if not alive:
            return
        if finish:
            self._finish(running, finish)
        else:
            self._decoding.append(running)

    def _take(self, running: RunningTurn, logits: torch.Tensor, mask: torch.Tensor | None
              ) -> tuple[bool, FinishReason | None]:
        """Sample one token from `logits` (its grammar's mask computed now when not ahead) and stream it: whether
        the turn is still alive (a failure ends it here), and whether it finishes with this token."""
        if mask is None and running.grammar is not None and running.grammar.active:  # (not computed ahead)
            try:
                mask = fill_masks(self.grammars, [running.grammar])[0]
            except Exception as error:
                self._fail(running, error, "grammar")
                return False, None
        try:
            self.faults.check("sampling", running.turn.session_id)
            if (allowed := masked_logits(self.grammars, running.grammar, logits, mask)) is None:
                running.grammar.error = running.grammar.error or "the grammar allows no next token"
                return True, "grammar"
            return True, running.accept(running.sampler.next_token(allowed), self.loaded.stop_token_ids)
        except Exception as error:
            self._fail(running, error, "sampling")
            return False, None

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
            self.speculator.verified(running.drafts, len(draft), position)
        if finish:
            self._finish(running, finish)
        else:
            self._decoding.append(running)

    def _prefill_chunk(self, running: RunningTurn, budget: int) -> tuple[torch.Tensor | None, int]:
        """Feed the next chunk; return the logits after the prompt's last token (None before it)
        and the number of tokens fed."""
        if running.share_prefix:  # the system prompt alone first (in chunks too), to be shared with later sessions
            chunk = running.pending[:min(budget, running.prefix_len - running.entry.num_tokens)]
        else:
            chunk = running.pending[:budget]
        logits = self.runner.timed_prefill(running.entry, chunk)
        running.pending = running.pending[len(chunk):]
        if running.share_prefix and running.entry.num_tokens == running.prefix_len:
            # The system prompt's tokens become a shared segment that the turn's cache starts with; its region
            # gave them up, so it is made whole again before the next chunk.
            if self.cache.put_prefix(running.entry, running.turn.owner, source=running.turn.session_id):
                running.has_room = False
            running.share_prefix, running.rollback_to = False, running.prefix_len
        self.prefill_chunks += 1
        return (None if running.pending else logits), len(chunk)

    def _decode_step(self) -> None:
        """Advance every running turn by one token, in one forward pass. If the batched pass fails, each
        turn is tried alone, so that only the turns that fail by themselves are failed."""
        batch, self._decoding = self._decoding, []
        riders, self._riders = self._riders, []
        self.batch_sizes[len(batch)] += 1
        self.steps_beside_fetches += bool(self._fetching)
        needed = self.speculator.cost.break_even(len(batch))
        self.speculator.new_step()
        drafts = {id(running): self._draft(running, needed) for running in batch}  # (checked against grammars first)
        # The constrained rows' masks are computed while the model computes the logits (llguidance frees the GIL).
        constrained = [r for r in batch if r.grammar is not None and r.grammar.active]
        masks = self.grammars.masks_ahead([r.grammar for r in constrained]) if constrained else None
        inputs = {id(running): [running.next_input, *drafts[id(running)]] for running in batch}
        inputs.update({id(running): running.pending for running in riders})
        everyone, riding = [*batch, *riders], {id(running) for running in riders}
        try:
            started = time.perf_counter()
            logits = self._forward_decode(everyone, inputs, riding)
            self._step_took(sum(map(len, inputs.values())), started, None if riders else len(batch),
                            sum(map(len, drafts.values())))
            rows = list(zip(everyone, logits, strict=True))
        except Exception as error:
            if len(everyone) == 1 or is_fatal(error):
                for running in everyone:
                    self._fail(running, error, "prefill" if id(running) in riding else "decode")
                return
            log.warning("a batched decode step of %d turns failed (%s: %s); trying each turn alone", len(everyone),
                        type(error).__name__, error)
            rows = []
            for running in everyone:
                try:
                    rows.append((running, self._forward_decode([running], inputs, riding)[0]))
                except Exception as alone_error:
                    self._fail(running, alone_error, "prefill" if id(running) in riding else "decode")
        # (a row whose grammar failed to fill its mask fails alone: the grammar stage)
        row_masks = dict(zip(map(id, constrained), masks_by_row(self.grammars, [r.grammar for r in constrained], masks),
                             strict=True)) if masks is not None else {}
        for running, logits in rows:
            if id(running) in riding:
                running.pending = []
                self.prefill_chunks += 1
                self.riding_prefills += 1
                self._prefilled(running, logits[-1])
            elif isinstance(mask := row_masks.get(id(running)), Exception):
                self._fail(running, mask, "grammar")
            else:
                self._advance(running, logits, drafts[id(running)], mask)

    def _draft(self, running: RunningTurn, needed: float) -> list[int]:
        """The turn's draft for this step: what its conversation or its owner's replies say follows its last
        token (when it is likely enough to be accepted: `needed`), cut to what its grammar (when one constrains it
        now) accepts."""
        if running.drafts is None:
            running.drafts = self.speculator.start(running.prompt_ids)
        draft = self.speculator.propose(running.drafts, running.turn.owner or "", running.generated,
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

    def _step_took(self, tokens: int, started: float, batch: int | None, drafted: int) -> None:
        """A decode step of `tokens` packed tokens (`batch` decoding rows and `drafted` draft tokens, when no prompt
        rode it), begun at `started`, has run: its cost tells whether drafts pay (on CUDA, once its kernels have
        finished: sampling waits for them next anyway)."""
        if self.loaded.device.type == "cuda":
            torch.cuda.synchronize(self.loaded.device)
        self.speculator.cost.record(tokens, time.perf_counter() - started, batch, drafted)

    def _forward_decode(self, rows: list[RunningTurn], inputs: dict[int, list[int]], riding: set[int]
                        ) -> list[torch.Tensor]:
        """One pass over `rows`, each fed its `inputs` (a decoding turn its next token and draft, a riding one the
        rest of its prompt): each row's logits after each of its inputs (a pass that fails leaves every cache as it
        was)."""
        for running in rows:
            if id(running) not in riding:  # (a riding turn was checked as it prefilled)
                self.faults.check("decode", running.turn.session_id)
        with torch.inference_mode():
            return self.runner.decode([r.entry for r in rows], [inputs[id(r)] for r in rows],
                                      [1 if id(r) in riding else len(inputs[id(r)]) for r in rows])

    def _fail(self, failed: RunningTurn | Turn, error: Exception, stage: str) -> None:
        """One turn failed at `stage`: it gets `internal`, and its cache, which the failure may have left
        half-written, is dropped from every tier. An error the engine cannot go on from propagates."""
        if is_fatal(error):
            raise error
        turn = failed.turn if isinstance(failed, RunningTurn) else failed
        log_failure(log, error, "turn %s of session %s failed at the %s stage; its cache is dropped", turn.turn_id,
                    turn.session_id, stage)
        self.failures[stage] += 1
        self.faults.disarm(turn.session_id)
        if isinstance(failed, RunningTurn) or not self.cache.device.is_running(turn.session_id):
            self.cache.abandon(turn.session_id)  # never another turn's running cache
        if isinstance(failed, RunningTurn):
            failed.let_go()
        self._end(turn, TurnFailed("internal", f"the turn failed at the {stage} stage: {type(error).__name__}"))

    def _prepare(self, loaded: LoadedModel) -> None:
        threads = self.settings.threads or usable_cpus()
        torch.set_num_threads(threads)
        self.governor = ThreadGovernor(threads, adaptive=self.settings.adaptive_threads)
        self.loaded = loaded
        self.arena, self.runner, self.cache = wire(loaded, self.settings, self.faults, self._on_cache_copy)
        self.grammars = GrammarCompiler(loaded.tokenizer, loaded.model.config.get_text_config().vocab_size,
                                        loaded.stop_token_ids, self.faults)
        self._preparer = TurnPreparer(loaded, self.arena, self.settings, self.grammars)
        self._finder = CacheFinder(self.cache, self.runner, self.settings, loaded.model.dtype)
        for text in self.settings.warm_prompts():
            warm_prompt(self.runner, self.cache, self._preparer.system_ids(text))

    @property
    def deep_check_distances(self) -> deque[float]:
        """The deep check's latest distances (for tests and benchmarks)."""
        return self._finder.deep_check_distances

    def _begin_prefill(self, running: RunningTurn, lookup: CacheLookup) -> None:
        """Take the cache the lookup found (or a new one) and line up the prompt tokens it does not cover."""
        running.lookup = lookup
        running.hold(lookup.entry or CacheEntry(self.runner.new_cache()))
        running.has_room = False
        running.rollback_to = lookup.cached_tokens
        running.pending = running.prompt_ids[lookup.cached_tokens:]
        running.share_prefix = lookup.source == "miss" and running.prefix_len > 0

    def _finish(self, running: RunningTurn, finish: FinishReason) -> None:
        """Write the cache back (rolled back first if cancelled) and report the result."""
        turn, entry = running.turn, running.entry
        try:
            self.faults.check("write-back", turn.session_id)
            if finish == "cancelled":
                entry.crop(running.rollback_to)  # the turn is not recorded: roll its tokens back
            result = running.result(finish)
            if finish in ("stop", "length"):
                self.speculator.finished(turn.owner or "", running.prompt_ids, running.generated)
            with torch.inference_mode():
                self.cache.put(turn.session_id, entry, turn.session_version + (finish != "cancelled"),
                               keep_for_s=turn.keep_for_s)
            running.let_go()
        except Exception as error:
            self._fail(running, error, "write-back")
            return
        self._end(turn, result)
