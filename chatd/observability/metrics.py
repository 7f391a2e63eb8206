"""Prometheus metrics under vLLM's names with a `chatd:` prefix, so that dashboards built for vLLM
work after a prefix change. Turn metrics are observed when a turn ends; gauges and the counters the
cache store owns (evictions, corruptions) are read from a `LiveState` taken just before a scrape."""

from __future__ import annotations

import typing
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from cache_store import CHECKS, STAGES
from cache_store.lookup import CacheSource, MissReason
from chatd.engine.turn import TurnResult

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
disable_created_metrics()  # the *_created series only double the scrape
TIERS = ("device", "host", "remote")
FINISH_REASONS = ("stop", "length", "cancelled")
APIS = ("websocket", "openai", "responses", "anthropic")

# Chat latencies: milliseconds for a cached turn's first token, minutes for a long reply under load.
REQUEST_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.35, 0.5, 0.75, 1.0, 1.5, 2.5, 5.0, 7.5,
                   10.0, 20.0, 30.0, 60.0, 120.0, 300.0)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5,
                 0.75, 1.0, 2.5, 5.0, 10.0)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 45.0, 60.0, 120.0, 300.0, 600.0)
WAIT_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
WAIT_OUTCOMES = ("acked", "short", "failed")
COPY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


@dataclass(frozen=True)
class LiveState:
    """What the server is doing now: read by the event loop, from the engine and the gateway."""

    running: int = 0
    waiting: int = 0
    connected_sessions: int = 0
    cache: dict[str, int] = field(default_factory=dict)  # CacheStore.stats(); empty before the model loads
    engine_up: bool = True  # False once the engine has stopped serving
    engine_failures: dict[str, int] = field(default_factory=dict)  # turns failed, by engine stage
    decode_steps: dict[int, int] = field(default_factory=dict)  # batched decode steps, by batch size
    kv_dtypes: dict[str, str] = field(default_factory=dict)  # how each tier stores caches: a dtype, or int8
    kv: dict = field(default_factory=dict)  # the model's layers and windows: `chatd.model.kv_size.kv_report`
    redis: dict = field(default_factory=dict)  # with --redis-url: its mode and nodes (`RedisSessionStore.nodes`)
    prefix_index: dict = field(default_factory=dict)  # this worker's own prefix index: sessions, forgotten
    message_threads: dict[str, int] = field(default_factory=dict)  # Anthropic threads: created, continued, not_found
    # Responses WebSockets: connections, lanes, queued creates now; creates, warm-ups and steers by outcome so far
    responses_websocket: dict[str, int] = field(default_factory=dict)

    def tier_bytes(self, tier: str) -> tuple[int, int]:
        """Bytes in use and the budget of a tier (0, 0 when it does not exist)."""
        return self.cache.get(f"{tier}_bytes", 0), self.cache.get(f"{tier}_budget_bytes", 0)

    def evictions(self) -> dict[str, int]:
        return {"device": self.cache.get("device_evictions", 0) + self.cache.get("prefix_evictions", 0),
                "host": self.cache.get("host_evictions", 0)}

    def corruptions(self) -> dict[str, int]:
        return {check: self.cache.get(f"corrupt_{check}", 0) for check in CHECKS}


class Metrics:
    """One registry per server (tests run several servers in one process)."""

    def __init__(self, model_name: str, error_codes: tuple[str, ...] = ()):
        """`error_codes`: the codes clients can be sent, whose error series exist from the start."""
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self.live = LiveState()
        label, reg = ["model_name"], self.registry

        def histogram(name: str, doc: str, buckets: tuple[float, ...], labels: list[str] = label) -> Histogram:
            return Histogram(f"chatd:{name}", doc, labels, buckets=buckets, registry=reg)

        def counter(name: str, doc: str, labels: list[str] = label) -> Counter:
            return Counter(f"chatd:{name}", doc, labels, registry=reg)

        self.ttft = histogram("time_to_first_token_seconds", "Time from request to first reply token.",
                              REQUEST_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between consecutive reply tokens.", TOKEN_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Time from request to the last reply token.",
                             E2E_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds", "Time a turn waited before the engine took it.",
                                    REQUEST_BUCKETS)
        self.prefill_time = histogram("request_prefill_time_seconds",
                                      "Time from the engine taking a turn to its first token.", REQUEST_BUCKETS)
        self.offload_time = histogram("cache_offload_seconds", "Time to copy an evicted cache to host memory.",
                                      COPY_BUCKETS, [*label, "tier"])
        self.restore_time = histogram("cache_restore_seconds", "Time to bring a cache back to the device.",
                                      COPY_BUCKETS, [*label, "tier"])
        self.redis_wait = histogram("redis_wait_seconds", "Time from sending a write to Redis to its WAIT's answer "
                                    "(one round trip: the write, then its replicas' acknowledgement), by outcome: "
                                    "acked, short (fewer replicas within the timeout), failed.", WAIT_BUCKETS,
                                    [*label, "outcome"])
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished turns (cached or prefilled).")
        self.generation_tokens = counter("generation_tokens", "Reply tokens generated.")
        self.prefix_cache_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the session caches.")
        self.prefix_cache_hits = counter("prefix_cache_hits", "Prompt tokens found in a cache (not prefilled).")
        self.cached_tokens = counter("cached_tokens", "Prompt tokens reused, by where the cache came from.",
                                     [*label, "cache_source"])
        self.cache_misses = counter("cache_misses", "Turns that found no cache, by reason.", [*label, "reason"])
        self.request_success = counter("request_success", "Finished turns, by finish reason.",
                                       [*label, "finished_reason"])
        self.errors = counter("errors", "Error messages sent to clients, by code.", [*label, "code"])
        self.api_requests = counter("api_requests", "Turns started, by the API they came through.", [*label, "api"])
        for metric in (self.ttft, self.itl, self.e2e, self.queue_time, self.prefill_time, self.prompt_tokens,
                       self.generation_tokens, self.prefix_cache_queries, self.prefix_cache_hits):
            metric.labels(model_name)  # every series exists from the start, at zero
        for source in typing.get_args(CacheSource):
            if source != "miss":
                self.cached_tokens.labels(model_name, source)
        for reason in typing.get_args(MissReason):
            self.cache_misses.labels(model_name, reason)
        for reason in FINISH_REASONS:
            self.request_success.labels(model_name, reason)
        for code in error_codes:
            self.errors.labels(model_name, code)
        for api in APIS:
            self.api_requests.labels(model_name, api)
        self.offload_time.labels(model_name, "host")
        for outcome in WAIT_OUTCOMES:
            self.redis_wait.labels(model_name, outcome)
        for tier in ("host", "remote"):
            self.restore_time.labels(model_name, tier)
        self.prefix_cache_totals = [0, 0]  # prompt tokens looked up, and found: vLLM's counters as well as chatd's
        self.registry.register(_LiveCollector(self))

    def observe_turn(self, result: TurnResult) -> None:
        """A finished turn (cancelled included): its latencies, tokens and cache outcome."""
        name, seconds = self.model_name, result.timings
        if result.sampled:
            self.ttft.labels(name).observe(seconds["ttft_ms"] / 1000)
            self.e2e.labels(name).observe(seconds["total_ms"] / 1000)
            self.prefill_time.labels(name).observe(seconds["prefill_ms"] / 1000)
        self.queue_time.labels(name).observe(seconds["queue_ms"] / 1000)
        itl = self.itl.labels(name)  # one label lookup per turn, not per token
        for gap in result.inter_token_s:
            itl.observe(gap)
        self.prompt_tokens.labels(name).inc(result.prompt_tokens)
        self.generation_tokens.labels(name).inc(result.completion_tokens)
        if result.prompt_tokens:  # a turn cancelled before it started looked nothing up
            self.prefix_cache_queries.labels(name).inc(result.prompt_tokens)
            self.prefix_cache_hits.labels(name).inc(result.cached_tokens)
            self.prefix_cache_totals[0] += result.prompt_tokens
            self.prefix_cache_totals[1] += result.cached_tokens
            if result.cache_source == "miss":
                self.cache_misses.labels(name, result.miss_reason).inc()
            else:
                self.cached_tokens.labels(name, result.cache_source).inc(result.cached_tokens)
        self.request_success.labels(name, result.finish_reason).inc()

    def observe_request(self, api: str) -> None:
        self.api_requests.labels(self.model_name, api).inc()

    def observe_redis_wait(self, seconds: float, outcome: str) -> None:
        self.redis_wait.labels(self.model_name, outcome).observe(seconds)

    def observe_error(self, code: str) -> None:
        self.errors.labels(self.model_name, code).inc()

    def observe_cache_copy(self, direction: str, tier: str, seconds: float) -> None:
        """Called from the engine thread (prometheus-client is thread-safe)."""
        (self.offload_time if direction == "offload" else self.restore_time).labels(self.model_name, tier).observe(
            seconds)

    def exposition(self, live: LiveState) -> bytes:
        self.live = live
        return generate_latest(self.registry)


class _LiveCollector(Collector):
    """Gauges and the cache store's own counters, from the latest `LiveState`."""

    def __init__(self, metrics: Metrics):
        self._metrics = metrics

    def collect(self):
        live, name = self._metrics.live, [self._metrics.model_name]
        label = ["model_name"]
        running = GaugeMetricFamily("chatd:num_requests_running", "Turns prefilling or decoding.", labels=label)
        running.add_metric(name, live.running)
        waiting = GaugeMetricFamily("chatd:num_requests_waiting", "Turns waiting for the engine.", labels=label)
        waiting.add_metric(name, live.waiting)
        usage = GaugeMetricFamily("chatd:kv_cache_usage_perc", "Share of each cache tier's budget in use (0-1).",
                                  labels=[*label, "tier"])
        for tier in TIERS:
            used, budget = live.tier_bytes(tier)
            usage.add_metric([*name, tier], used / budget if budget else 0.0)
        sessions = GaugeMetricFamily("chatd:sessions", "Sessions with a client connected, and sessions with a "
                                                       "cache here but no client.", labels=[*label, "state"])
        sessions.add_metric([*name, "connected"], live.connected_sessions)
        sessions.add_metric([*name, "idle"], live.cache.get("idle_sessions", 0))
        evictions = CounterMetricFamily("chatd:cache_evictions", "Caches evicted from a tier: offloaded from the "
                                        "device, dropped from the host.", labels=[*label, "tier"])
        for tier, count in live.evictions().items():
            evictions.add_metric([*name, tier], count)
        corruptions = CounterMetricFamily("chatd:cache_corruptions", "Caches cleared by a failed consistency check.",
                                          labels=[*label, "check"])
        for check, count in live.corruptions().items():
            corruptions.add_metric([*name, check], count)
        engine_up = GaugeMetricFamily("chatd:engine_up", "1 while the engine serves; 0 once it has stopped "
                                      "(the process then exits).", labels=label)
        engine_up.add_metric(name, 1.0 if live.engine_up else 0.0)
        failures = CounterMetricFamily("chatd:engine_turn_failures", "Turns failed by an error at an engine stage "
                                       "(each got internal; the engine went on).", labels=[*label, "stage"])
        for stage in ("admission", *STAGES):
            failures.add_metric([*name, stage], live.engine_failures.get(stage, 0))
        remote_errors = CounterMetricFamily("chatd:remote_kv_errors", "Remote KV tier operations that failed "
                                            "(Redis unreachable, out of memory, refused).", labels=[*label, "op"])
        remote_errors.add_metric([*name, "read"], live.cache.get("remote_read_errors", 0))
        remote_errors.add_metric([*name, "write"], live.cache.get("remote_write_errors", 0))
        offload_failures = CounterMetricFamily("chatd:cache_offload_failures", "Evicted caches whose copy to the "
                                               "host failed; each was dropped.", labels=label)
        offload_failures.add_metric(name, live.cache.get("offload_failures", 0))
        offload_bytes = CounterMetricFamily("chatd:cache_offload_bytes", "Bytes offloads to the host tier wrote, and "
                                            "bytes they did not have to write (already in the host copy the cache was "
                                            "restored from).", labels=[*label, "kind"])
        for kind, key in (("written", "host_offload_bytes"), ("skipped", "host_offload_bytes_skipped")):
            offload_bytes.add_metric([*name, kind], live.cache.get(key, 0))
        steps = CounterMetricFamily("chatd:decode_steps", "Decode steps, by how many turns each advanced at once.",
                                    labels=[*label, "batch_size"])
        for batch_size, count in sorted(live.decode_steps.items()):
            steps.add_metric([*name, str(batch_size)], count)
        tier_info = GaugeMetricFamily("chatd:cache_tier_info", "How each cache tier stores keys and values (1 for "
                                      "its kv_dtype).", labels=[*label, "tier", "kv_dtype"])
        tier_sessions = GaugeMetricFamily("chatd:cache_tier_sessions", "Sessions with a cache in each tier.",
                                          labels=[*label, "tier"])
        for tier, kv_dtype in live.kv_dtypes.items():
            tier_info.add_metric([*name, tier, kv_dtype], 1.0)
            if f"{tier}_sessions" in live.cache:
                tier_sessions.add_metric([*name, tier], live.cache[f"{tier}_sessions"])
        yield from _arena_families(live, name, label)
        yield from _segment_families(live, name, label)
        yield from _remote_chunks(live, name, label)
        yield from _redis_families(live, name, label)
        yield from _engine_families(live, name, label)
        yield from _remote_io_families(live, name, label)
        yield from _speculation_families(live, name, label)
        yield from _vllm_families(live, self._metrics.prefix_cache_totals, name, label)
        yield from _kv_event_families(live, name, label)
        yield from (running, waiting, usage, sessions, evictions, corruptions, engine_up, failures, remote_errors,
                    offload_failures, offload_bytes, steps, tier_info, tier_sessions)


def _vllm_families(live: LiveState, prefix_cache: list[int], name: list[str], label: list[str]):
    """The gauges and counters KV-aware routers and benchmarks read, under vLLM's names (llm-d's endpoint picker
    scrapes the first four): each equal to chatd's own."""
    budget = live.tier_bytes("device")[1]
    singles = [
        (GaugeMetricFamily, "vllm:num_requests_running", "Turns prefilling or decoding (chatd's "
         "num_requests_running).", live.running),
        (GaugeMetricFamily, "vllm:num_requests_waiting", "Turns waiting for the engine (chatd's "
         "num_requests_waiting).", live.waiting),
        (GaugeMetricFamily, "vllm:kv_cache_usage_perc", "Share of the device tier's budget that no eviction can "
         "free, as vLLM counts it (0-1): running turns' caches and pinned prompts; idle cached sessions count as "
         "free, as vLLM's unreferenced prefix-cache blocks do (chatd's kv_cache_usage_perc counts them used).",
         live.cache.get("device_active_bytes", 0) / budget if budget else 0.0),
        (CounterMetricFamily, "vllm:prefix_cache_queries", "Prompt tokens looked up in the caches.", prefix_cache[0]),
        (CounterMetricFamily, "vllm:prefix_cache_hits", "Prompt tokens found in a cache.", prefix_cache[1]),
    ]
    config = GaugeMetricFamily("vllm:cache_config_info", "The block size KV events report in (--kv-block-size).",
                               labels=[*label, "block_size"])
    config.add_metric([*name, str(live.cache.get("kv_block_size", 16))], 1.0)
    yield config
    yield from (_single(family, metric, text, name, label, value) for family, metric, text, value in singles)


def _kv_event_families(live: LiveState, name: list[str], label: list[str]):
    """KV events (with --kv-events-endpoint): batches published, and dropped by a full queue (each followed by the
    full state)."""
    batches = CounterMetricFamily("chatd:kv_event_batches", "KV event batches, by outcome: sent, or dropped by a "
                                  "full queue (the next carries the full state).", labels=[*label, "outcome"])
    batches.add_metric([*name, "sent"], live.cache.get("kv_event_batches_sent", 0))
    batches.add_metric([*name, "dropped"], live.cache.get("kv_event_batches_dropped", 0))
    yield batches
    failures = CounterMetricFamily("chatd:kv_event_sender_failures", "Times the KV event sender failed and was "
                                   "started again (its next batch carries the full state).", labels=label)
    failures.add_metric(name, live.cache.get("kv_event_sender_failures", 0))
    yield failures


def _redis_families(live: LiveState, name: list[str], label: list[str]):
    """Redis (with --redis-url): the nodes this worker routes to, the errors its clients met, the writes retried
    through an outage or a failover, and a cluster client's slot-map changes."""
    redis = live.redis
    nodes = GaugeMetricFamily("chatd:redis_nodes", "The Redis nodes this worker routes to (with --redis-url), "
                              "by role: a cluster's primaries and replicas, or one server.", labels=[*label, "role"])
    for role in ("primary", "replica"):
        nodes.add_metric([*name, role], sum(node["role"] == role for node in redis.get("nodes", [])))
    errors = CounterMetricFamily("chatd:redis_errors", "Redis calls of the session, response and prefix-index "
                                 "stores that failed, by error (ConnectionError, TimeoutError, ClusterDownError, "
                                 "...): an outage, or a node failing over.", labels=[*label, "error"])
    for error, count in sorted(redis.get("errors", {}).items()):
        errors.add_metric([*name, error], count)
    retries = CounterMetricFamily("chatd:redis_retries", "Session-store calls retried because their Redis node could "
                                  "not answer (with --redis-wait-replicas: through a failover).", labels=label)
    retries.add_metric(name, redis.get("retries", 0))
    slot_map = CounterMetricFamily("chatd:redis_slot_map_changes", "Times a cluster client changed its slot "
                                   "map: at start, after a MOVED or ASK redirection to another node, or after a "
                                   "failover.", labels=label)
    slot_map.add_metric(name, redis.get("slot_map_changes", 0))
    refused = CounterMetricFamily("chatd:redis_queued_turns_refused", "Turns recorded here through an outage (queued) "
                                  "that Redis refused once back, because another worker moved the session on: the "
                                  "session is read again from Redis.", labels=label)
    refused.add_metric(name, redis.get("queued_turns_refused", 0))
    reachable = GaugeMetricFamily("chatd:redis_reachable", "1 while the session store's Redis answers (its last call "
                                  "did and no write waits for it), 0 through an outage, when turns are recorded here "
                                  "and queued (readiness does not depend on it).", labels=label)
    pending = GaugeMetricFamily("chatd:redis_pending_writes", "Session writes queued in this worker until Redis "
                                "answers again.", labels=label)
    if redis.get("mode"):
        reachable.add_metric(name, float(redis.get("reachable", True)))
        pending.add_metric(name, redis.get("pending_writes", 0))
    return nodes, errors, retries, slot_map, refused, reachable, pending


def _single(family: type, metric: str, help_text: str, name: list[str], label: list[str], value: float):
    """A metric family with one series."""
    made = family(metric, help_text, labels=label)
    made.add_metric(name, value)
    return made


def _engine_families(live: LiveState, name: list[str], label: list[str]):
    """The engine's threads (fewer while other processes take its CPUs) and the turns waiting for Redis beside it."""
    threads = GaugeMetricFamily("chatd:engine_threads", "Threads the engine's CPU work runs with: now, and at most "
                                "(the cores this process may use, or --threads).", labels=[*label, "state"])
    threads.add_metric([*name, "now"], live.cache.get("engine_threads", 0))
    threads.add_metric([*name, "max"], live.cache.get("engine_threads_max", 0))
    singles = [
        (CounterMetricFamily, "chatd:engine_thread_changes", "Times the engine changed its thread count (other "
         "processes took, or gave back, its CPUs).", live.cache.get("engine_thread_changes", 0)),
        (GaugeMetricFamily, "chatd:cpu_taken_by_others", "CPUs of this process's own that other processes used at "
         "the engine's last look (half-second windows).", live.cache.get("cpu_taken_by_others", 0.0)),
        (GaugeMetricFamily, "chatd:num_requests_fetching", "Turns waiting in their own state for their cache from "
         "Redis while the batch decodes on.", live.cache.get("fetching_turns", 0)),
        (CounterMetricFamily, "chatd:prefills_in_decode_steps", "Prompts whose last chunk (a returning customer's "
         "new message) was fed in a decode step, as one more row of it.", live.cache.get("riding_prefills", 0)),
        (CounterMetricFamily, "chatd:decode_steps_beside_fetches", "Decode steps taken while at least one turn "
         "waited for its cache from Redis.", live.cache.get("decode_steps_beside_fetches", 0)),
        (GaugeMetricFamily, "chatd:prefix_index_sessions", "Sessions in this worker's own prefix index (bounded; "
         "with Redis, the shared index has them all).", live.prefix_index.get("sessions", 0)),
        (CounterMetricFamily, "chatd:prefix_index_forgotten", "Sessions this worker's prefix index forgot to stay "
         "within its bounds (expired, or the least recently indexed).", live.prefix_index.get("forgotten", 0)),
        (CounterMetricFamily, "chatd:message_threads_created", "Anthropic message threads created on this worker "
         "(a reply held under its id).", live.message_threads.get("created", 0)),
        (CounterMetricFamily, "chatd:message_threads_continued", "Replies of Anthropic message threads continued on "
         "this worker (only the new messages prefilled).", live.message_threads.get("continued", 0)),
        (CounterMetricFamily, "chatd:message_threads_not_found", "Continues of an Anthropic message thread that was "
         "not found (unknown, expired, another key's).", live.message_threads.get("not_found", 0)),
    ]
    ws = live.responses_websocket
    singles += [
        (GaugeMetricFamily, "chatd:responses_ws_connections", "Open Responses WebSocket connections.",
         ws.get("connections", 0)),
        (GaugeMetricFamily, "chatd:responses_ws_lanes", "Lanes (stream_id) of the open Responses WebSockets.",
         ws.get("lanes", 0)),
        (GaugeMetricFamily, "chatd:responses_ws_queued_creates", "response.create events waiting in their lanes.",
         ws.get("queued", 0)),
        (CounterMetricFamily, "chatd:responses_ws_creates", "response.create events taken (steered successors "
         "not counted).", ws.get("creates", 0)),
        (CounterMetricFamily, "chatd:responses_ws_warmups", "Warm-ups (generate: false) run: prompts prefilled into "
         "a session's cache with nothing generated.", ws.get("warmups", 0)),
    ]
    steers = CounterMetricFamily("chatd:responses_ws_steers", "response.steer events, by outcome: accepted, then "
                                 "successors, pending (waiting for tool outputs), or a failure's code.",
                                 labels=[*label, "outcome"])
    for key, value in sorted(ws.items()):
        if key.startswith("steers_"):
            steers.add_metric([*name, key.removeprefix("steers_")], value)
    return threads, steers, *(_single(family, metric, text, name, label, value)
                              for family, metric, text, value in singles)


def _speculation_families(live: LiveState, name: list[str], label: list[str]):
    """Speculative decoding under vLLM's names: drafts verified, their tokens, those accepted, by position."""
    yield from (_single(CounterMetricFamily, f"chatd:spec_decode_num_{metric}", text, name, label,
                        live.cache.get(key, 0)) for metric, key, text in (
        ("drafts", "spec_drafts", "Drafts verified (a decoding turn's guess of its next tokens, from its "
         "conversation or its owner's recent replies)."),
        ("draft_tokens", "spec_draft_tokens", "Draft tokens verified."),
        ("accepted_tokens", "spec_accepted_tokens", "Draft tokens the model sampled too (each a decode step "
         "saved).")))
    yield _single(GaugeMetricFamily, "chatd:spec_books_bytes", "Host memory the owners' recent replies take, that "
                  "drafts are found in (estimated).", name, label, live.cache.get("spec_books_bytes", 0))
    yield _single(GaugeMetricFamily, "chatd:spec_books_limit_bytes", "The most the owners' recent replies may take "
                  "(--speculation-books-mb).", name, label, live.cache.get("spec_books_limit_bytes", 0))
    per_position = CounterMetricFamily("chatd:spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted, by "
                                       "their position in the draft (0: its first).", labels=[*label, "position"])
    for key, count in sorted(live.cache.items()):
        if key.startswith("spec_accepted_at_"):
            per_position.add_metric([*name, key.removeprefix("spec_accepted_at_")], count)
    yield per_position


def _remote_io_families(live: LiveState, name: list[str], label: list[str]):
    """The remote KV tier's I/O beside the engine: what fetches decided, the measured round trip, the bounded write
    queue and what it dropped."""
    decisions = CounterMetricFamily("chatd:remote_kv_fetch_decisions", "Turns whose cache was in Redis, by what "
                                    "they did: fetch, recompute (estimated faster), timeout (Redis did not answer "
                                    "in time: recomputed).", labels=[*label, "choice"])
    for choice in ("fetch", "recompute", "timeout"):
        decisions.add_metric([*name, choice], live.cache.get(f"remote_decisions_{choice}", 0))
    round_trip = GaugeMetricFamily("chatd:remote_kv_round_trip_seconds", "The measured round trip to Redis of the "
                                   "remote KV tier (a moving average; the cost model adds it to every fetch).",
                                   labels=label)
    round_trip.add_metric(name, live.cache.get("remote_round_trip_ms", 0.0) / 1000)
    pending = GaugeMetricFamily("chatd:remote_kv_pending", "The remote KV tier's queue: snapshots waiting to be "
                                "written (writes), their bytes, and deletes.", labels=[*label, "kind"])
    for kind in ("writes", "bytes", "deletes"):
        pending.add_metric([*name, kind], live.cache.get(f"remote_pending_{kind}", 0))
    dropped = CounterMetricFamily("chatd:remote_kv_dropped", "Queued snapshots and deletes never sent to Redis, by "
                                  "why: full (over the queue's byte budget), expired (queued too long), deletes (the "
                                  "delete queue was full).", labels=[*label, "reason"])
    for reason in ("full", "expired", "deletes"):
        dropped.add_metric([*name, reason], live.cache.get(f"remote_dropped_{reason}", 0))
    return decisions, round_trip, pending, dropped


_ARENA_COUNTERS = [  # (metric, help, key of the engine's published counters)
    ("chatd:kv_arena_compactions", "Times the KV arena slid caches together for a long enough run, before "
     "evicting anyone.", "arena_compactions"),
    ("chatd:kv_arena_compaction_bytes", "Bytes of keys and values compactions moved (device to device).",
     "arena_compaction_bytes"),
    ("chatd:kv_arena_compaction_seconds", "Time the engine spent compacting the KV arena (a pause between two "
     "steps).", "arena_compaction_seconds"),
    ("chatd:kv_outside_arena_turns", "Turns longer than the whole KV arena, run in a temporary cache outside it.",
     "outside_arena_turns"),
]


def _arena_families(live: LiveState, name: list[str], label: list[str]):
    """The KV arena: its tokens by state, its longest free run, compactions and turns run outside it."""
    tokens = GaugeMetricFamily("chatd:kv_arena_tokens", "Tokens of the KV arena: holding keys and values (used), "
                               "held by regions beyond that (reserved: what running turns may reach, and rounding "
                               "to a 16-token unit), and in no region (free).", labels=[*label, "state"])
    for state in ("used", "reserved", "free"):
        tokens.add_metric([*name, state], live.cache.get(f"arena_{state}_tokens", 0))
    largest = GaugeMetricFamily("chatd:kv_arena_largest_free_tokens", "The longest free run of the KV arena: the "
                                "longest region it can give without compacting or evicting.", labels=label)
    largest.add_metric(name, live.cache.get("arena_largest_free_tokens", 0))
    counters = []
    for metric, help_text, key in _ARENA_COUNTERS:
        counter = CounterMetricFamily(metric, help_text, labels=label)
        counter.add_metric(name, live.cache.get(key, 0))
        counters.append(counter)
    return tokens, largest, *counters


def _segment_families(live: LiveState, name: list[str], label: list[str]):
    """Shared segments: how many, the sessions on them, and the device's bytes held against its distinct keys and
    values and against what private copies would take."""
    segments = GaugeMetricFamily("chatd:kv_shared_segments", "Shared segments (system prompts, branch histories) "
                                 "held once: on the device, pinned there (warm prompts), and in the host tier.",
                                 labels=[*label, "state"])
    for state, key in (("device", "prefixes"), ("pinned", "segments_pinned"), ("host", "host_segments")):
        segments.add_metric([*name, state], live.cache.get(key, 0))
    sessions = GaugeMetricFamily("chatd:kv_shared_segment_sessions", "Resident sessions whose cache starts with a "
                                 "shared segment.", labels=label)
    sessions.add_metric(name, live.cache.get("shared_sessions", 0))
    device = GaugeMetricFamily("chatd:kv_device_bytes", "The device tier's bytes: held by its regions (held), the "
                               "distinct keys and values in them (distinct: a shared segment once), and what the "
                               "resident sessions' caches would take as private copies (private).",
                               labels=[*label, "kind"])
    kinds = (("held", "device_bytes"), ("distinct", "device_kv_bytes"), ("private", "device_private_kv_bytes"))
    for kind, key in kinds:
        device.add_metric([*name, kind], live.cache.get(key, 0))
    restores = CounterMetricFamily("chatd:kv_shared_segment_restores", "Shared segments brought back to the "
                                   "device from the host tier.", labels=label)
    restores.add_metric(name, live.cache.get("segment_restores", 0))
    return segments, sessions, device, restores


def _remote_chunks(live: LiveState, name: list[str], label: list[str]):
    """Redis copies as chains of chunks: chunks written, renewed (held already: another session's or turn's),
    fetched and found missing, and the bytes chunks kept from moving."""
    held = GaugeMetricFamily("chatd:kv_remote_chunks_known", "Chunks this worker knows Redis holds (written or "
                             "renewed by it within their retention).", labels=label)
    held.add_metric(name, live.cache.get("remote_chunks_known", 0))
    host = GaugeMetricFamily("chatd:kv_host_chunk_copies", "Host copies of system prompts' chunks, named and held "
                             "once for every session of their owner: held, and shared by more than one session.",
                             labels=[*label, "state"])
    host.add_metric([*name, "held"], live.cache.get("host_chunk_copies", 0))
    host.add_metric([*name, "shared"], live.cache.get("host_chunk_copies_shared", 0))
    chunks = CounterMetricFamily("chatd:kv_remote_chunks", "Chunks of caches in Redis: written (Redis lacked "
                                 "them), renewed (Redis held them: not sent again), fetched, missing at a fetch "
                                 "(the chain ends there), lost (gone when renewed).", labels=[*label, "event"])
    for event in ("written", "renewed", "fetched", "missing", "lost"):
        chunks.add_metric([*name, event], live.cache.get(f"remote_chunks_{event}", 0))
    moved = CounterMetricFamily("chatd:kv_remote_chunk_bytes", "Bytes of caches' chunks: written to Redis, and "
                                "not moved thanks to chunks: carried but held there already (not_sent), not "
                                "copied from the device at all (not_copied, keys and values in the model's "
                                "dtype), and held by the fetching worker (not_fetched).", labels=[*label, "kind"])
    for kind, key in (("written", "remote_chunk_bytes_written"), ("not_sent", "remote_chunk_bytes_not_sent"),
                      ("not_copied", "remote_snapshot_kv_bytes_skipped"), ("not_fetched", "remote_bytes_not_fetched")):
        moved.add_metric([*name, kind], live.cache.get(key, 0))
    return held, host, chunks, moved
