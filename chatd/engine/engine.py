"""The engine thread: all model work happens here, off the event loop.

Each step is plan → execute → update (vLLM v1's `EngineCore.step`, nano-vllm's `LLMEngine.step`): the planner
(`planner.py`) admits turns, starts and collects fetches from Redis, looks caches up and says what runs (prefill
chunks, then one packed decode pass with drafts and riding prompts); the executor (`executor.py`) runs those
forward passes; the updater (`updater.py`) samples, verifies drafts, checks stops and moves each turn on. A turn
changes state in one place (`turn_queues.py`) and ends in one place (`endings.py`); every part is built at once
when the model is loaded (`wiring.py`). This thread never waits on the network: a turn whose cache must come from
Redis waits in its own state (fetching) while the batch decodes on.

Supervision: a failure at any stage fails only the turns of that stage (each gets `internal`, its
cache is dropped from every tier) and the engine goes on. A failure it cannot go on from (its thread
ending, a CUDA error that poisons the context) answers every waiting and running turn `unavailable`,
refuses new ones at once, and is reported to `on_fatal` so that the process can exit for its
supervisor to restart it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

from cache_store import CacheStore, FaultPoints, KVArena
from cache_store.block_ledger import BlockLedger
from cache_store.lookup import CopyObserver
from chatd.config import Settings
from chatd.engine.commands import CacheCommand, EngineInbox, housekeep
from chatd.engine.cpu_share import ThreadGovernor
from chatd.engine.drafts import ReplyBooks, Speculator
from chatd.engine.grammar import GrammarCompiler
from chatd.engine.kv_events import KVEventPublisher
from chatd.engine.model_runner import ModelRunner
from chatd.engine.running_turn import RunningTurn
from chatd.engine.step_plan import StepCounts
from chatd.engine.supervision import EngineUnavailable, is_fatal
from chatd.engine.turn import Turn, TurnFailed
from chatd.engine.wiring import EngineParts, build
from chatd.model.loader import LoadedModel

T = TypeVar("T")
log = logging.getLogger(__name__)

EXPIRE_EVERY_S = 1.0
PUBLISH_EVERY_S = 0.1  # while busy, how often the counters are published for /metrics and /v1/stats


class Engine:
    """Owns the model and the session caches. Talk to it only through `submit`, `cancel` (on the turn) and the cache
    commands (`drop_cache`, `close_session`, `session_connected`, `prefetch`, `call`, ...); all are safe from any
    thread."""

    def __init__(self, load: Callable[[], LoadedModel], settings: Settings | None = None,
                 on_cache_copy: CopyObserver | None = None, on_fatal: Callable[[str], None] | None = None):
        self._load = load
        self.settings = settings or Settings()
        self._on_cache_copy = on_cache_copy
        self._on_fatal = on_fatal or (lambda reason: None)
        self.faults = FaultPoints()  # armed only through --enable-fault-injection (and by tests)
        self.failure: str | None = None  # why the engine could not go on, once it could not
        self._closed: str | None = None  # why it takes no more turns: its failure, or a stop
        self._inbox = EngineInbox()
        self._thread = threading.Thread(target=self._run, name="chatd-engine", daemon=True)
        self.ready = threading.Event()
        self.load_error: BaseException | None = None
        books_mb = self.settings.speculation_books_mb
        self.speculator = Speculator(self.settings.speculation_tokens if self.settings.speculation == "on" else 0,
                                     ReplyBooks(budget_bytes=None if books_mb is None else int(books_mb * 2**20)))
        self.counts = StepCounts()
        self.parts: EngineParts | None = None  # what loading the model makes, all at once (`wiring.build`)
        self.cache_stats: dict[str, int | float] = {}  # published between steps: `_publish`
        self._published_at = 0.0
        self._waiting = 0
        self._lock = threading.Lock()  # the waiting count, and submissions against a failure

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._inbox.stop()
        self._thread.join()
        if self.parts is not None:
            self.parts.close()

    # ----- what loading made (None before) -----

    @property
    def loaded(self) -> LoadedModel | None:
        return self.parts.loaded if self.parts else None

    @property
    def cache(self) -> CacheStore | None:
        return self.parts.cache if self.parts else None

    @property
    def runner(self) -> ModelRunner | None:
        return self.parts.runner if self.parts else None

    @property
    def arena(self) -> KVArena | None:
        return self.parts.arena if self.parts else None

    @property
    def grammars(self) -> GrammarCompiler | None:
        return self.parts.grammars if self.parts else None

    @property
    def governor(self) -> ThreadGovernor | None:
        return self.parts.governor if self.parts else None

    @property
    def kv_events(self) -> KVEventPublisher | None:
        return self.parts.kv_events if self.parts else None

    @property
    def ledger(self) -> BlockLedger | None:
        return self.parts.ledger if self.parts else None

    @ledger.setter
    def ledger(self, ledger: BlockLedger | None) -> None:
        """Which ledger the loop flushes after each step (a bench or test swaps it, from the engine thread)."""
        self.parts.ledger = ledger

    @property
    def waiting(self) -> int:
        """Turns submitted that the engine has not started yet."""
        return self._waiting

    @property
    def running(self) -> int:
        """Turns started and not finished (prefilling, fetching or decoding), as of the last engine step."""
        return self.parts.endings.running if self.parts else 0

    @property
    def failures(self) -> Counter[str]:
        """Turns failed, by stage."""
        return self.parts.endings.failures if self.parts else Counter()

    @property
    def deep_check_distances(self) -> deque[float]:
        """The deep check's latest distances (for tests and benchmarks)."""
        return self.parts.finder.deep_check_distances

    # ----- turns and cache commands, from any thread -----

    def submit(self, turn: Turn) -> None:
        with self._lock:
            if self._closed is None:
                self._waiting += 1
                self._inbox.put(turn)
                return
        turn.emit(TurnFailed("unavailable", self._unavailable()))

    def drop_cache(self, session_id: str, remote_up_to: int | None = None) -> None:
        """Drop a session's cache on this worker (its next turn recomputes, or fetches it from Redis), and in Redis
        when its copy there is of version `remote_up_to` or older, once the turns queued before this call have
        finished."""
        self._inbox.put(CacheCommand(lambda store: store.drop(session_id, remote_up_to), session_id=session_id))

    def close_session(self, session_id: str) -> None:
        """The session is closed: drop its cache and everything the cache store knows about it, once the
        turns queued before this call have finished."""
        self._inbox.put(CacheCommand(lambda store: store.forget(session_id), session_id=session_id))

    def wait_shared(self, session_id: str, timeout_s: float) -> bool:
        """With `--remote-kv`, wait (off the engine thread) until the session's cache is written to Redis, so that
        the next turn can continue from it on any worker; whether it was within `timeout_s`."""
        remote = self.cache.remote if self.cache is not None else None
        return remote is None or remote.wait_written(session_id, timeout_s)

    def fork_session(self, source: str, target: str, prompt_ids: list[int]) -> None:
        """Start `target`'s cache as a copy of the part of `source`'s that `prompt_ids` begins with
        (a branch of a conversation); runs before any turn submitted after it."""
        self._inbox.put(CacheCommand(lambda store: store.fork(source, target, prompt_ids)))

    def carry_cache_forward(self, session_id: str, from_version: int, to_version: int) -> None:
        """The session's history was edited without a turn (a conversation item deleted): its cache of `from_version`
        stays of use as far as the next prompt shares it (the lookup crops it there) instead of being stale."""
        def restamp(store: CacheStore) -> None:
            for entry in (store.device.get(session_id), store.host.get(session_id)):
                if entry is not None and entry.session_version == from_version:
                    entry.session_version = to_version

        self._inbox.put(CacheCommand(restamp, session_id=session_id))

    def session_connected(self, session_id: str, connected: bool) -> None:
        self._inbox.put(CacheCommand(lambda store: store.touch(session_id, connected)))

    def prefetch(self, session_id: str) -> None:
        """Hint that a turn of this session is coming: restore its cache to the device now."""
        self._inbox.put(CacheCommand(lambda store: store.prefetch(session_id), session_id=session_id))

    def offload_idle(self) -> None:
        """Move every cache that is not running to the host tier (to free the device, or to measure)."""
        self._inbox.put(CacheCommand(CacheStore.evict_idle))

    def call(self, action: Callable[[CacheStore], T], session_id: str | None = None) -> Future[T]:
        """Run `action` on the cache store in the engine thread, between decode steps (and, with a
        `session_id`, once no turn of that session is running)."""
        result: Future[T] = Future()
        with self._lock:
            if self._closed is None:
                self._inbox.put(CacheCommand(action, result, session_id))
                return result
        result.set_exception(EngineUnavailable(self._unavailable()))
        return result

    # ----- the engine thread -----

    def _run(self) -> None:
        try:
            self.parts = build(self._load(), self.settings, self.faults, self.speculator, self.counts,
                               self._on_cache_copy, self._left_queue, self._inbox.wake)
        except BaseException as error:  # reported to whoever waits for `ready`
            log.exception("loading the model failed")
            self.load_error = error
            self.failure = f"loading the model failed: {type(error).__name__}: {error}"
            self._stop_serving(self.failure)  # turns sent while it loaded get an answer too
            self.ready.set()
            return
        self.ready.set()
        try:
            self._serve(self.parts)
        except BaseException as error:  # whatever ends the loop ends the engine: say so, to everyone
            reason = f"{type(error).__name__}: {error}"
            log.critical("the engine cannot go on (%s); failing every turn and stopping", reason, exc_info=error)
            with self._lock:
                self.failure = reason
            self._stop_serving(reason)
            self._on_fatal(reason)
        else:
            self._stop_serving("it was stopped")

    def _serve(self, parts: EngineParts) -> None:
        """The loop: commands, then a step, then what the step leaves running counted and published."""
        expired_at = time.monotonic()
        while True:
            idle = not parts.queues.has_work(self.settings.max_batch)
            if idle or time.monotonic() - self._published_at >= PUBLISH_EVERY_S:
                self._publish()  # before waiting: what /metrics reads while the engine is idle is current
            if not self._take_commands(parts, block=idle):
                break
            self._step(parts)
            self._announce_endings()
            parts.endings.count(parts.queues.started())
            parts.governor.tick(working=parts.queues.busy)
            if time.monotonic() - expired_at >= EXPIRE_EVERY_S:
                housekeep(parts.cache, CacheStore.expire, None, self._publish)
                expired_at = time.monotonic()
            if parts.ledger is not None:
                parts.ledger.flush()  # what the step and the housekeeping changed in the tiers, as one batch

    @staticmethod
    def _step(parts: EngineParts) -> None:
        """One step: plan, execute, update. The prefill chunks one at a time (each planned once those ahead of it
        ran), then the packed decode pass with its drafts and the prompts riding it."""
        planner, executor, updater = parts.planner, parts.executor, parts.updater
        planner.collect_fetches()
        planner.admit()
        riders: list[RunningTurn] = []
        for chunk in planner.prefill_chunks(riders):
            updater.chunk_fed(chunk, executor.prefill(chunk))
        if (plan := planner.decode_plan(riders)) is not None:
            updater.stepped(plan, executor.decode(plan))

    def _take_commands(self, parts: EngineParts, block: bool) -> bool:
        """Queue new turns (FIFO) and run the cache commands that may run; False once asked to stop. Waits for a
        command only when no turn is running (and, with turns fetching, at most until the first gives up)."""
        turns = self._inbox.take(parts.queues.fetching.wait_s(EXPIRE_EVERY_S) if block else None)
        if turns is None:
            return False
        for turn in turns:
            parts.queues.take(turn)
            parts.endings.took(turn)
        for command in self._inbox.ready({r.turn.session_id for r in parts.queues.started()}):
            housekeep(parts.cache, command.action, command.result, self._publish)
        return True

    def _stop_serving(self, reason: str) -> None:
        """Every turn the engine still has, or is sent from now on, gets `unavailable`."""
        with self._lock:
            self._closed = reason
        turns, commands = self._inbox.drain()
        for command in commands:
            if command.result is not None:
                command.result.set_exception(EngineUnavailable(self._unavailable()))
        failed = TurnFailed("unavailable", self._unavailable())
        if self.parts is None:  # (it never loaded: no turn was taken)
            for turn in turns:
                turn.emit(failed)
        else:
            turns = [*self.parts.endings.forget_all(), *turns]  # wherever each was when the engine stopped
            self.parts.queues.clear()
            for turn in turns:
                self.parts.endings.end(turn, failed)
            self._announce_endings()
        with self._lock:
            self._waiting = 0

    def _announce_endings(self) -> None:
        """The turns that ended, told once the counters are published (once, not at each ending): a client that
        has its answer reads them with its turn counted."""
        if self.parts.endings.ended:
            self._publish()
            self.parts.endings.announce()

    def _publish(self) -> None:
        """Publish the cache store's and the arena's counters for /metrics and /v1/stats, which read the latest
        snapshot and never wait for the engine."""
        self._published_at = time.monotonic()
        if (parts := self.parts) is None:  # (the model is not loaded)
            return
        try:
            self.cache_stats = {**parts.cache.stats(), **parts.arena.stats(),
                                "outside_arena_turns": self.counts.outside_arena_turns,
                                "fetching_turns": len(parts.queues.fetching),
                                "decode_steps_beside_fetches": self.counts.steps_beside_fetches,
                                **parts.governor.stats(), "riding_prefills": self.counts.riding_prefills,
                                **self.speculator.published(), **self._kv_event_stats(parts)}
        except Exception as error:  # figures for /metrics: never worth a turn, let alone the engine
            if is_fatal(error):
                raise
            log.exception("reading the cache figures failed; /metrics keeps the last ones")

    def _kv_event_stats(self, parts: EngineParts) -> dict[str, int]:
        stats = {"kv_block_size": self.settings.kv_block_size}
        if parts.kv_events is not None:
            stats.update(kv_event_batches_sent=parts.kv_events.batches_sent,
                         kv_event_sender_failures=parts.kv_events.sender_failures,
                         kv_event_batches_dropped=parts.kv_events.batches_dropped)
        return stats

    def _unavailable(self) -> str:
        return f"the engine has stopped ({self._closed}); retry on another worker or after its restart"

    def _left_queue(self) -> None:
        with self._lock:
            self._waiting -= 1
