"""Server settings: defaults, overridden by CHATD_* environment variables, overridden by flags."""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Literal

from pydantic import BeforeValidator, Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from cache_store.units import CHUNK_TOKENS, KVDtype
from chatd.model.cache_dir import default_cache_dir

if TYPE_CHECKING:
    import torch

DEFAULT_WEB_DIR = Path(__file__).resolve().parent.parent / "web"

CPU_DEVICE_CACHE_MB = 2048


def _list_from_text(value: object) -> object:
    """A list setting from the environment: one value, comma-separated values, or a JSON list."""
    if not isinstance(value, str):
        return value
    text = value.strip()
    if text.startswith("["):
        try:
            parsed = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"not a JSON list ({error.msg} at character {error.pos})") from None
        if not isinstance(parsed, list) or not all(isinstance(item, str) for item in parsed):
            raise ValueError("a JSON list here must hold strings only")
        return parsed
    return [item.strip() for item in text.split(",") if item.strip()]


# pydantic-settings would parse a list from the environment only as JSON; NoDecode hands us the text.
TextList = Annotated[list[str], NoDecode, BeforeValidator(_list_from_text)]


class Settings(BaseSettings):
    """Every setting of `chatd serve`, from flags or `CHATD_*` environment variables, validated in one place."""

    model_config = SettingsConfigDict(env_prefix="CHATD_", protected_namespaces=())

    host: str = Field("127.0.0.1", description="interface to listen on")
    port: int = Field(8765, ge=0, le=65535, description="port to listen on (0: any free port)")
    model: str = Field("smollm2-135m", description="bundled alias, local checkpoint path or Hugging Face id")
    device: str = Field("auto", pattern=r"^(auto|cpu|cuda(:\d+)?)$", description="auto, cpu, cuda or cuda:N")
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = Field(
        "auto", description="auto: bfloat16 (or float16) on CUDA, float32 on CPU")
    cache_dir: Path = Field(default_factory=default_cache_dir,
                            description="where bundled models are converted once")
    session_cache: bool = Field(True, description="reuse each session's KV cache between turns")
    threads: int | None = Field(None, ge=1, description="threads for the model's CPU work (torch.set_num_threads; "
                                                        "default: the cores this process may use, by its affinity "
                                                        "and its cgroup's CPU quota)")
    adaptive_threads: bool = Field(True, description="run the model's CPU work with fewer threads while other "
                                                     "processes take this process's cores (its threads spin-wait "
                                                     "for each other: a busy neighbour would stall every step)")
    max_batch: int = Field(16, ge=1, description="turns decoded together in one batched step (like max_num_seqs)")
    speculation: Literal["on", "off"] = Field("on", description=(
        "speculative decoding with no draft model: each decoding turn proposes a draft from its own conversation "
        "and its owner's recent replies, verified in the batched step (replies equal plain decoding's; a turn whose "
        "drafts are not accepted stops drafting)"))
    speculation_tokens: int = Field(6, ge=1, le=32, description="the longest draft a turn proposes in one step")
    speculation_books_mb: float | None = Field(None, ge=0, description=(
        "host memory for the owners' recent replies that drafts are found in (default: 1% of the host's memory, at "
        "most 256); beyond it the least recently used owner's replies are forgotten (0: none kept)"))
    prefill_chunk: int = Field(256, ge=1, description="prompt tokens fed per engine step (across the turns "
                                                      "being prefilled), between decode steps of the others")
    max_waiting: int = Field(64, ge=1, description="turns waiting for the engine beyond which a new request is "
                                                   "answered busy at once")
    device_cache_mb: float | None = Field(
        None, gt=0, description="budget for caches on the compute device (default: half the free GPU memory "
                                "on CUDA, 2048 on CPU)")
    host_cache_mb: float = Field(4096, ge=0, description="budget for caches offloaded to host memory")
    host_kv_dtype: KVDtype = Field("same", description="how offloaded caches are kept in host memory: same (the "
                                                       "model's dtype, exact) or int8 (about 4x the sessions per GB "
                                                       "in float32, 2x in bf16; replies may differ slightly)")
    session_ttl_s: float = Field(1800.0, gt=0, description="drop a disconnected session's cache after this idle time")
    verify_sample_rate: float = Field(
        0.002, ge=0, le=1, description="share of cache reuses whose last token's logits are recomputed from "
                                      "scratch and compared (the deep consistency check)")
    enable_fault_injection: bool = Field(
        False, description="open POST /admin/sessions/{id}/corrupt for tests and chaos drills")
    redis_url: str | None = Field(None, description="keep sessions in Redis (redis://host:port/db) instead of memory")
    redis_cluster: bool | None = Field(None, description="--redis-url is a node of a Redis Cluster (on) or a single "
                                                        "server (off); unset: the node is asked at start")
    redis_wait_replicas: int | None = Field(None, ge=0, description=(
        "acknowledge a completed turn once this many replicas hold it (Redis WAIT), so that a failover loses no "
        "acknowledged turn; 0: do not wait (a worker then keeps chatting through an outage on its own copy); unset: "
        "1 where each primary had a replica at start, else 0 (docs/architecture.md)"))
    redis_wait_timeout_ms: int = Field(500, gt=0, description=(
        "at most this long a turn waits for its replicas; a turn they did not confirm in time is acknowledged "
        "anyway (it is on its primary) and counted on /metrics"))
    redis_failover_s: float = Field(10.0, gt=0, description=(
        "with --redis-wait-replicas, how long a turn's write is retried while its Redis node cannot answer (a "
        "cluster's failover) before the turn is answered unavailable (retryable) and not kept"))
    thread_ttl_s: float | None = Field(None, gt=0, description="how long an Anthropic message thread's latest reply "
                                       "can be continued once it was held (default: --session-ttl-s; Anthropic's "
                                       "own: 5 minutes)")
    thread_claim_lease_s: float = Field(30.0, gt=0, description=(
        "how long a thread reply's claim outlives a worker that stopped renewing it (killed mid-turn): a running "
        "turn renews it every third of this; after it, the reply may be continued again on any worker"))
    session_retention_s: float = Field(7 * 24 * 3600, gt=0,
                                       description="how long an unused session is kept (in memory or in Redis)")
    remote_kv: bool = Field(False, description="also keep every session's cache in Redis, shared by all workers "
                                               "(needs --redis-url)")
    remote_kv_ttl_s: float = Field(3600.0, gt=0, description="how long Redis keeps a session's cache")
    remote_kv_dtype: KVDtype = Field("same", description="how caches are kept in Redis: same (exact) or int8 "
                                                         "(a quarter of the bytes in float32; with same, int8 "
                                                         "copies written by other workers are not used)")
    remote_kv_fetch: Literal["auto", "always"] = Field("auto", description=(
        "whether a turn fetches its cache from Redis: auto, while that is estimated to cost under two prefills of "
        "what it holds (from the measured round trip, Redis throughput and prefill rate; a fetch leaves the batch "
        "decoding, a prefill does not), or always (spare the compute; a Redis that fails or times out is still "
        "recomputed)"))
    remote_kv_queue_mb: float = Field(256, gt=0, description=(
        "host memory for snapshots waiting to be written to Redis (while it is slow or down); beyond it the oldest "
        "are dropped, and a snapshot queued over 30 s is too (counted on /metrics)"))
    remote_kv_chunk_tokens: int = Field(CHUNK_TOKENS, ge=16, multiple_of=16, description=(
        "positions per chunk of a cache in Redis: a chunk Redis holds (a shared system prompt, earlier turns) is not "
        "written or fetched again (docs/benchmarks-history.md)"))
    shared_prompt_min_tokens: int = Field(
        32, ge=16, description="a system prompt of at least this many tokens is held once on the device, a "
                               "segment that its sessions start with and that a batched step reads once (a short "
                               "one gathered with each row's own tokens); a shorter one is copied into each "
                               "session that uses it (docs/benchmarks-history.md)")
    warm_prompt: TextList = Field(default_factory=list, description="a file holding a system prompt (its text, "
                                  "without a final newline) to prefill at start and keep on the device through any "
                                  "eviction, shared by every session and key that uses it (repeatable)")
    kv_events_endpoint: str | None = Field(None, description=(
        "publish KV events in vLLM's wire format on this ZMQ PUB endpoint (e.g. tcp://*:5557: binds where it has *, "
        "on the loopback interface unless --kv-events-bind-all; connects otherwise), for KV-aware routers (Dynamo, "
        "llm-d); the events carry every conversation's token ids: unset: off"))
    kv_events_bind_all: bool = Field(False, description=(
        "bind a * KV events endpoint (and its replay endpoint) on every interface, for routers on other hosts (the "
        "events carry every tenant's token ids: a network only the fleet reaches)"))
    kv_scope_secret: SecretStr = Field(default_factory=lambda: SecretStr(secrets.token_hex(16)), description=(
        "seeds the public name of each key's scope in KV events and /kv/blocks, so that no client can compute another "
        "key's block ids from tokens; set the same on every worker of a fleet (and in a router that scopes its "
        "queries); default: a random one per process"))
    admin_key: SecretStr | None = Field(None, description=(
        "the bearer key of the operator's routes (/kv/blocks); unset: they answer only on a server without API keys"))
    kv_events_replay_endpoint: str | None = Field(None, description=(
        "a ZMQ ROUTER endpoint that answers a consumer's replay request with the buffered batches from a seq on "
        "(vLLM's; the last 10,000 batches)"))
    kv_events_topic: str | None = Field(None, description="the topic of every KV event message (default: "
                                                          "kv@<host>@<model>, llm-d's)")
    kv_block_size: int = Field(16, ge=1, description=(
        "tokens per block in the KV events (vLLM's default, 16): the device and host tiers report the full blocks "
        "of what they hold; must equal the router's block size"))
    kv_events_format: Literal["map", "array"] = Field("map", description=(
        "map: each event a map with its type (vLLM's current encoding); array: positional arrays (older consumers)"))
    lease_ttl_s: float = Field(15.0, gt=0, description="how long a worker that died mid-turn keeps a session locked")
    web_dir: Path = Field(DEFAULT_WEB_DIR, description="folder of the chat UI and dashboard pages")
    api_key: TextList = Field(default_factory=list, description="an API key clients must present (repeatable); "
                                                                 "none: no authentication")
    api_key_file: Path | None = Field(None, description="a file of API keys, one per line (# comments)")
    allowed_origins: TextList = Field(default_factory=list, description="Origin headers accepted from browsers "
                                                                         "(repeatable); none: any origin")
    max_message_bytes: int = Field(1 << 20, ge=1024, description="largest websocket frame; a larger one closes "
                                                                 "the connection with 1009")
    max_prompt_tokens: int = Field(4096, ge=1, description="most tokens one user message may have")
    max_new_tokens: int = Field(1024, ge=1, le=4096, description="the cap on a request's max_new_tokens")
    max_connections: int = Field(1024, ge=1, description="open websocket connections beyond which the handshake "
                                                         "gets HTTP 503")
    max_sessions_per_connection: int = Field(16, ge=1, description="sessions one connection may open or use")
    responses_ws_max_age_s: float = Field(3600.0, gt=0, description="how long a Responses WebSocket connection "
                                          "lasts (OpenAI's: 60 minutes); then websocket_connection_limit_reached and "
                                          "close code 1001, once its responses have finished")
    rate_limit_per_min: float | None = Field(None, gt=0, description="turns per minute per API key (per client "
                                                                     "address without keys); none: unlimited")
    turn_log_ttl_s: float = Field(60.0, gt=0, description="how long a finished turn's events stay available "
                                                          "to chat.resume")
    shutdown_timeout_s: float = Field(30.0, ge=0, description="on SIGTERM, how long running turns may take to "
                                                              "finish before they are cancelled")
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="log verbosity")

    def device_budget_mb(self, device: torch.device) -> float:
        """The configured budget, or half the free memory of a CUDA device, or a fixed size on CPU."""
        if self.device_cache_mb is not None:
            return self.device_cache_mb
        if device.type == "cuda":
            import torch  # (not at the top: a bad flag is answered before torch loads)

            free, _ = torch.cuda.mem_get_info(device)
            return max(1.0, free / 2 / 2**20)
        return CPU_DEVICE_CACHE_MB

    def api_keys(self) -> list[str]:
        """The keys from --api-key and --api-key-file."""
        keys = list(self.api_key)
        if self.api_key_file is not None:
            for line in self.api_key_file.read_text().splitlines():
                if (key := line.split("#", 1)[0].strip()):
                    keys.append(key)
        return keys

    def warm_prompts(self) -> list[str]:
        """The text of each --warm-prompt file, without its final newline."""
        return [Path(path).read_text().removesuffix("\n") for path in self.warm_prompt]

    @field_validator("warm_prompt")
    @classmethod
    def _warm_prompts_readable(cls, paths: list[str]) -> list[str]:
        for path in paths:
            if not Path(path).is_file() or not os.access(path, os.R_OK):
                raise ValueError(f"{path}: no such readable file")
        return paths

    @model_validator(mode="after")
    def _remote_kv_needs_redis(self) -> Settings:
        if self.remote_kv and not self.redis_url:
            raise ValueError("--remote-kv needs --redis-url")
        return self
