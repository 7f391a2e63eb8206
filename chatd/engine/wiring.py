"""What the engine works with once its model is loaded, built in one piece (`build`): the KV arena within the
device budget, the model runner over it, the cache store with its tiers, the warm prompts in it, the KV events that
tell outside routers what its tiers hold, and the step's planner, executor and updater over the turns' states."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from cache_store import (
    CacheEntry,
    CacheLayout,
    CacheStore,
    FaultPoints,
    KVArena,
    KVGeometry,
    Offloader,
    RemoteTier,
    holding,
    kv_bytes_per_token,
)
from cache_store.block_ledger import BlockLedger, public_scope
from cache_store.lookup import CopyObserver
from chatd.config import Settings
from chatd.engine.cpu_share import ThreadGovernor, usable_cpus
from chatd.engine.drafts import Speculator
from chatd.engine.endings import TurnEndings
from chatd.engine.executor import StepExecutor
from chatd.engine.grammar import GrammarCompiler
from chatd.engine.kv_events import KVEventPublisher, default_topic
from chatd.engine.model_runner import ModelRunner
from chatd.engine.planner import StepPlanner
from chatd.engine.step_plan import StepCounts
from chatd.engine.turn_queues import TurnQueues
from chatd.engine.turn_setup import CacheFinder, TurnPreparer
from chatd.engine.updater import StepUpdater
from chatd.model.loader import LoadedModel

MB = 1024 * 1024
log = logging.getLogger(__name__)


@dataclass
class EngineParts:
    """What loading the model makes, all at once: the engine has every part or none."""

    loaded: LoadedModel
    governor: ThreadGovernor  # fewer threads while other processes take this one's CPUs
    arena: KVArena
    runner: ModelRunner
    cache: CacheStore
    grammars: GrammarCompiler  # compiles what constrained replies follow, off the engine thread
    queues: TurnQueues
    endings: TurnEndings
    finder: CacheFinder
    planner: StepPlanner
    executor: StepExecutor
    updater: StepUpdater
    kv_events: KVEventPublisher | None  # with --kv-events-endpoint: what the tiers hold, published
    ledger: BlockLedger | None

    def close(self) -> None:
        """Stop the threads the parts run (the remote tier's, the grammar compiler's, the KV events' sender)."""
        if self.cache.remote is not None:
            self.cache.remote.close()
        self.grammars.close()
        if self.kv_events is not None:
            self.kv_events.close()


def build(loaded: LoadedModel, settings: Settings, faults: FaultPoints, speculator: Speculator, counts: StepCounts,
          on_cache_copy: CopyObserver | None, left_queue: Callable[[], None], wake: Callable[[], None]) -> EngineParts:
    """Every part of the engine for `loaded`, as `settings` size them, with the warm prompts prefilled.
    `left_queue`: a queued turn was taken; `wake`: a fetch finished."""
    threads = settings.threads or usable_cpus()
    torch.set_num_threads(threads)
    governor = ThreadGovernor(threads, adaptive=settings.adaptive_threads)
    arena, runner, cache = wire(loaded, settings, faults, on_cache_copy)
    kv_events, ledger = publish_kv_events(cache, settings) or (None, None)
    grammars = GrammarCompiler(loaded.tokenizer, loaded.model.config.get_text_config().vocab_size,
                               loaded.stop_token_ids, faults)
    queues, endings = TurnQueues(wake), TurnEndings(cache, faults, speculator)
    preparer = TurnPreparer(loaded, arena, settings, grammars)
    finder = CacheFinder(cache, runner, settings, loaded.model.dtype)
    planner = StepPlanner(settings, queues, cache, arena, preparer, finder, grammars, speculator, faults, endings,
                          counts, left_queue)
    updater = StepUpdater(queues, cache, finder, grammars, speculator, loaded.stop_token_ids, faults, endings, counts)
    for text in settings.warm_prompts():
        warm_prompt(runner, cache, preparer.system_ids(text))
    return EngineParts(loaded, governor, arena, runner, cache, grammars, queues, endings, finder, planner,
                       StepExecutor(runner, faults, speculator.cost), updater, kv_events, ledger)


def wire(loaded: LoadedModel, settings: Settings, faults: FaultPoints,
         on_cache_copy: CopyObserver | None) -> tuple[KVArena, ModelRunner, CacheStore]:
    """The arena, the runner and the cache store for `loaded`, as `settings` size them. The arena and the
    runner make room by asking the cache store to evict; the store allocates its caches in the arena."""
    geometry = KVGeometry.of(loaded.model.config)
    bytes_per_token = kv_bytes_per_token(loaded.model.config, loaded.model.dtype)
    remote = RemoteTier(settings.redis_url, settings.remote_kv_ttl_s, chunk_tokens=settings.remote_kv_chunk_tokens,
                        cluster=bool(settings.redis_cluster), pending_bytes=int(settings.remote_kv_queue_mb * MB)
                        ) if settings.remote_kv else None
    budget_bytes = int(settings.device_budget_mb(loaded.device) * MB)
    # The arena and the runner call back into the store, which is built last (the lambdas bind it late).
    arena = KVArena(geometry.layers, geometry.kv_heads, geometry.head_dim, loaded.model.dtype, loaded.device,
                    tokens=budget_bytes // bytes_per_token, make_room=lambda tokens: store.evict_one(),
                    windows=geometry.windows)
    runner = ModelRunner(loaded, arena, make_room=lambda: store.evict_idle(),
                         on_prefill=lambda tokens, seconds: store.cost.record_prefill(tokens, seconds))
    store = CacheStore(
        new_cache=runner.new_cache, offloader=Offloader(loaded.device), enabled=settings.session_cache,
        layout=CacheLayout(geometry.layers, geometry.kv_heads, geometry.head_dim, loaded.model.dtype),
        model_key=loaded.identity(), device_budget_bytes=arena.nbytes(),
        host_budget_bytes=int(settings.host_cache_mb * MB), ttl_s=settings.session_ttl_s, remote=remote,
        on_copy=on_cache_copy, faults=faults, host_kv_dtype=settings.host_kv_dtype,
        remote_kv_dtype=settings.remote_kv_dtype, layer_windows=geometry.windows,
        min_shared_tokens=settings.shared_prompt_min_tokens, always_fetch=settings.remote_kv_fetch == "always")
    if remote is not None:
        remote.probe()
        _measure_prefill(loaded, runner, loaded.max_context)
    return arena, runner, store


def publish_kv_events(store: CacheStore, settings: Settings) -> tuple[KVEventPublisher, BlockLedger] | None:
    """With --kv-events-endpoint: the sender of KV events and the ledger the store's tiers tell what they hold."""
    if settings.kv_events_endpoint is None:
        return None
    publisher = KVEventPublisher(settings.kv_events_endpoint, settings.kv_events_topic or default_topic(settings.model),
                                 settings.kv_block_size, settings.kv_events_format == "map",
                                 settings.kv_events_replay_endpoint, bind_all=settings.kv_events_bind_all)
    secret = settings.kv_scope_secret.get_secret_value()
    ledger = BlockLedger(settings.kv_block_size, publisher.send, lambda key: public_scope(store.owner_of(key), secret))
    store.device.events = store.host.events = ledger
    return publisher, ledger


def _measure_prefill(loaded: LoadedModel, runner: ModelRunner, max_context: int, tokens: int = 256) -> None:
    """Seed the cost model's prefill rate (fetch a remote cache, or recompute?) with one real prefill."""
    vocab = loaded.model.config.get_text_config(decoder=True).vocab_size
    ids = torch.randint(100, vocab, (min(tokens, max_context - 1),))
    with torch.inference_mode():
        runner.timed_prefill(CacheEntry(runner.scratch_cache()), ids.tolist())


def warm_prompt(runner: ModelRunner, store: CacheStore, token_ids: list[int]) -> None:
    """Prefill a system prompt (--warm-prompt) into a pinned shared segment: resident through any eviction, so
    that the first session that uses it pays no prefill for it, and counted in the device budget."""
    with holding(CacheEntry(runner.new_cache(len(token_ids)))) as entry, torch.inference_mode():
        runner.forward(entry, token_ids)
        shared = store.put_prefix(entry, pinned=True)  # (the segment it held is the device tier's now)
    if not shared:
        raise ValueError(f"a warm prompt of {len(token_ids)} tokens cannot be held on the device (--device-cache-mb)")
    log.info("warm prompt of %d tokens resident on the device", len(token_ids))
