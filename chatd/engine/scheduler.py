"""The engine thread: all model work happens here, off the event loop.

Each step is plan → execute → update (vLLM v1's `EngineCore.step`, nano-vllm's `LLMEngine.step`): the planner
(`planner.py`) admits turns, starts and collects fetches from Redis, looks caches up and says what runs (prefill
chunks, then one packed decode pass with drafts and riding prompts); the executor (`executor.py`) runs those
forward passes; the updater (`updater.py`) samples, verifies drafts, checks stops and moves each turn on, and every
turn ends in one place (`endings.py`). This thread never waits on the network: a turn whose cache must come from
Redis waits in its own state (fetching) while the batch decodes on.

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

from cache_store import CacheStore
from cache_store.block_ledger import BlockLedger
from cache_store.checks.stage_faults import FaultPoints
from cache_store.lookup import CopyObserver
from chatd.config import Settings
from chatd.engine.commands import CacheCommand, CacheCommands
from chatd.engine.cpu_share import ThreadGovernor, usable_cpus
from chatd.engine.drafts import ReplyBooks, Speculator
from chatd.engine.endings import TurnEndings
from chatd.engine.executor import StepExecutor
from chatd.engine.grammar import GrammarCompiler
from chatd.engine.kv_events import KVEventPublisher
from chatd.engine.model_runner import ModelRunner
from chatd.engine.planner import StepPlanner
from chatd.engine.step_plan import StepCounts
from chatd.engine.supervision import EngineUnavailable, is_fatal
from chatd.engine.turn import Turn, TurnFailed
from chatd.engine.turn_setup import CacheFinder, TurnPreparer
from chatd.engine.updater import StepUpdater
from chatd.engine.wiring import publish_kv_events, warm_prompt, wire
from chatd.model.loader import LoadedModel

log = logging.getLogger(__name__)

EXPIRE_EVERY_S = 1.0
PUBLISH_EVERY_S = 0.1  # while busy, how often the counters are published for /metrics and /v1/stats


_STOP = object()
_WAKE = object()  # a fetch finished: look at the fetching turns now


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
        self._commands: queue.Queue[object] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="chatd-engine", daemon=True)
        self.ready = threading.Event()
        self.load_error: BaseException | None = None
        self.loaded: LoadedModel | None = None
        self.cache: CacheStore | None = None
        self.runner: ModelRunner | None = None
        self.grammars: GrammarCompiler | None = None  # compiles what constrained replies follow, off this thread
        self.governor: ThreadGovernor | None = None  # fewer threads while other processes take this one's CPUs
        self.kv_events: KVEventPublisher | None = None  # with --kv-events-endpoint: what the tiers hold, published
        self.ledger: BlockLedger | None = None
        books_mb = self.settings.speculation_books_mb
        self.speculator = Speculator(self.settings.speculation_tokens if self.settings.speculation == "on" else 0,
                                     ReplyBooks(budget_bytes=None if books_mb is None else int(books_mb * 2**20)))
        self.counts = StepCounts()
        self.endings = TurnEndings(self.faults, self.speculator)
        self.planner: StepPlanner | None = None  # plan, execute, update: once the model is loaded
        self._executor: StepExecutor | None = None
        self._updater: StepUpdater | None = None
        self.cache_stats: dict[str, int | float] = {}  # published between steps: `_publish`
        self._published_at = 0.0
        self._deferred: list[CacheCommand] = []
        self._waiting = 0
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
        if self.kv_events is not None:
            self.kv_events.close()

    @property
    def waiting(self) -> int:
        """Turns submitted that the engine has not started yet."""
        return self._waiting

    @property
    def running(self) -> int:
        """Turns started and not finished (prefilling, fetching or decoding), as of the last engine step."""
        return self.endings.running

    @property
    def failures(self) -> Counter[str]:
        """Turns failed, by stage."""
        return self.endings.failures

    @property
    def deep_check_distances(self) -> deque[float]:
        """The deep check's latest distances (for tests and benchmarks)."""
        return self._finder.deep_check_distances

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
        """The loop: commands, then a step, then what the step leaves running counted and published."""
        expired_at = time.monotonic()
        while True:
            idle = not self.planner.has_work()
            if idle or time.monotonic() - self._published_at >= PUBLISH_EVERY_S:
                self._publish()  # before waiting: what /metrics reads while the engine is idle is current
            if not self._take_commands(block=idle):
                break
            self._step()
            self._announce_endings()
            self.endings.count(self.planner.started())
            self.governor.tick(working=self.planner.busy)
            if time.monotonic() - expired_at >= EXPIRE_EVERY_S:
                self._housekeep(CacheStore.expire)
                expired_at = time.monotonic()
            if self.ledger is not None:
                self.ledger.flush()  # what the step and the housekeeping changed in the tiers, as one batch

    def _step(self) -> None:
        """One step: plan, execute, update. The prefill chunks one at a time (each planned once those ahead of it
        ran), then the packed decode pass with its drafts and the prompts riding it."""
        self.planner.collect_fetches()
        self.planner.admit()
        for chunk in self.planner.prefill_chunks():
            self._updater.chunk_fed(chunk, self._executor.prefill(chunk))
        if (plan := self.planner.decode_plan()) is not None:
            self._updater.stepped(plan, self._executor.decode(plan))

    def _stop_serving(self, reason: str) -> None:
        """Every turn the engine still has, or is sent from now on, gets `unavailable`."""
        with self._lock:
            self._closed = reason
        turns = self.endings.forget_all()  # wherever each was when the engine stopped
        if self.planner is not None:
            self.planner.clear()
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
            self.endings.end(turn, TurnFailed("unavailable", self._unavailable()))
        self._announce_endings()
        with self._lock:
            self._waiting = 0

    def _announce_endings(self) -> None:
        """The turns that ended, told once the counters are published (once, not at each ending): a client that
        has its answer reads them with its turn counted."""
        if self.endings.ended:
            self._publish()
            self.endings.announce()

    def _publish(self) -> None:
        """Publish the cache store's and the arena's counters for /metrics and /v1/stats, which read the latest
        snapshot and never wait for the engine."""
        self._published_at = time.monotonic()
        if self.planner is None:  # (the model is not loaded)
            return
        try:
            self.cache_stats = {**self.cache.stats(), **self.arena.stats(),
                                "outside_arena_turns": self.counts.outside_arena_turns,
                                "fetching_turns": len(self.planner.fetching),
                                "decode_steps_beside_fetches": self.counts.steps_beside_fetches,
                                **self.governor.stats(), "riding_prefills": self.counts.riding_prefills,
                                **self.speculator.published(), **self._kv_event_stats()}
        except Exception as error:  # figures for /metrics: never worth a turn, let alone the engine
            if is_fatal(error):
                raise
            log.exception("reading the cache figures failed; /metrics keeps the last ones")

    def _kv_event_stats(self) -> dict[str, int]:
        stats = {"kv_block_size": self.settings.kv_block_size}
        if self.kv_events is not None:
            stats.update(kv_event_batches_sent=self.kv_events.batches_sent,
                         kv_event_sender_failures=self.kv_events.sender_failures,
                         kv_event_batches_dropped=self.kv_events.batches_dropped)
        return stats

    def _unavailable(self) -> str:
        return f"the engine has stopped ({self._closed}); retry on another worker or after its restart"

    def _take_commands(self, block: bool) -> bool:
        """Queue new turns (FIFO) and run cache housekeeping; False once asked to stop. Waits for a
        command only when no turn is running (and, with turns fetching, at most until the first gives up)."""
        timeout = self.planner.fetching.wait_s(EXPIRE_EVERY_S)
        try:
            command = self._commands.get(timeout=timeout) if block else self._commands.get_nowait()
        except queue.Empty:
            command = None
        while command is not None:
            if command is _STOP:
                return False
            if isinstance(command, Turn):
                self.planner.queued.append(command)
                self.endings.took(command)
            elif command is not _WAKE:  # (a wake-up has nothing to run: the fetching turns are looked at next)
                self._deferred.append(command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                command = None
        running = {r.turn.session_id for r in self.planner.started()}
        ready = [c for c in self._deferred if c.session_id not in running]
        self._deferred = [c for c in self._deferred if c.session_id in running]
        for command in ready:
            self._housekeep(command.action, command.result)
        return True

    def _left_queue(self) -> None:
        with self._lock:
            self._waiting -= 1

    def _prepare(self, loaded: LoadedModel) -> None:
        threads = self.settings.threads or usable_cpus()
        torch.set_num_threads(threads)
        self.governor = ThreadGovernor(threads, adaptive=self.settings.adaptive_threads)
        self.loaded = loaded
        self.arena, self.runner, self.cache = wire(loaded, self.settings, self.faults, self._on_cache_copy)
        self.endings.cache = self.cache
        if (events := publish_kv_events(self.cache, self.settings)) is not None:
            self.kv_events, self.ledger = events
        self.grammars = GrammarCompiler(loaded.tokenizer, loaded.model.config.get_text_config().vocab_size,
                                        loaded.stop_token_ids, self.faults)
        preparer = TurnPreparer(loaded, self.arena, self.settings, self.grammars)
        self._finder = CacheFinder(self.cache, self.runner, self.settings, loaded.model.dtype)
        self.planner = StepPlanner(self.settings, self.cache, self.runner, preparer, self._finder, self.grammars,
                                   self.speculator, self.faults, self.endings, self.counts, self._left_queue,
                                   lambda: self._commands.put(_WAKE))
        self._executor = StepExecutor(self.runner, self.faults, self.speculator.cost)
        self._updater = StepUpdater(self.cache, self._finder, self.grammars, self.speculator, loaded.stop_token_ids,
                                    self.faults, self.planner, self.endings, self.counts)
        for text in self.settings.warm_prompts():
            warm_prompt(self.runner, self.cache, preparer.system_ids(text))
