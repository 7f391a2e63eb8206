"""The chatd server: one port, served by uvicorn, for the websocket protocol (/ws), the
OpenAI-compatible API (/v1/models, /v1/chat/completions, /v1/responses), the Anthropic Messages API
(/v1/messages), the web pages (/ and /dashboard), metrics (/metrics, /v1/stats) and probes (/healthz)."""

from __future__ import annotations

import asyncio
import contextlib
import http
import logging
import signal
import typing
from collections.abc import Callable
from urllib.parse import urlsplit

import uvicorn
from fastapi import FastAPI, WebSocket
from starlette.responses import Response
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol
from websockets.protocol import State

from cache_store import KVGeometry, kv_bytes_per_token
from chatd.api.admin import FaultRoutes
from chatd.api.admission import Admission
from chatd.api.anthropic.errors import anthropic_response
from chatd.api.anthropic.messages import AnthropicApi
from chatd.api.anthropic.threads import Threads
from chatd.api.auth import KeyRing
from chatd.api.conversations import Conversations
from chatd.api.http_errors import ApiError, install_error_handlers
from chatd.api.http_responses import json_response, static_response, text_response
from chatd.api.kv_blocks import KVBlocksApi
from chatd.api.openai.chat_completions import OpenAIApi
from chatd.api.openai.completions import CompletionsApi
from chatd.api.openai.errors import openai_response
from chatd.api.openai.response_turns import ResponseTurns
from chatd.api.openai.responses import ResponsesApi
from chatd.api.openai.responses_socket import ResponsesSockets
from chatd.api.openai.tokenize import TokenizeApi
from chatd.api.turn_errors import ErrorCode
from chatd.api.turns import TurnRunner
from chatd.api.websocket.client_socket import ClientSocket
from chatd.api.websocket.gateway import Gateway
from chatd.config import Settings
from chatd.engine.engine import Engine
from chatd.engine.turn import TurnResult
from chatd.model.kv_size import kv_report
from chatd.model.loader import LoadedModel, load_model
from chatd.observability.metrics import CONTENT_TYPE, LiveState, Metrics
from chatd.observability.stats import StatsRecorder
from sessions import InMemorySessionStore, SessionStore
from sessions.redis_client import RedisEvents
from sessions.redis_client import topology as redis_topology
from sessions.redis_store import RedisSessionStore
from sessions.responses import InMemoryResponseStore, RedisResponseStore, ResponseStore
from sessions.shared_prefix_index import SharedPrefixIndex
from sessions.threads import InMemoryThreadStore, RedisThreadStore, ThreadStore

log = logging.getLogger(__name__)
SAMPLE_EVERY_S = 5.0  # how often tier occupancy and cache counters are sampled for /v1/stats
FATAL_GRACE_S = 1.0  # after the engine failed: answer 503 this long before exiting
CLOSE_TIMEOUT_S = 5.0  # at exit, how long connections may take to close


class ModelLoadError(RuntimeError):
    """The model could not be loaded; the server cannot serve."""


class EngineFailed(RuntimeError):
    """The engine stopped serving; the process should exit so that its supervisor restarts it."""


class WebSocketProtocol(WebSocketsSansIOProtocol):
    """uvicorn's sans-I/O websocket protocol, except at shutdown for a connection whose client has just
    sent its close frame: websockets has answered it already, so uvicorn's second close frame would
    raise InvalidState and abort the shutdown of every later connection (and the exit code)."""

    def shutdown(self) -> None:
        if self.handshake_complete and self.initial_response is None and self.conn.state is not State.OPEN:
            self.stop_keepalive()
            self.transport.close()
            return
        super().shutdown()


def _stores_beside(sessions: SessionStore, settings: Settings
                   ) -> tuple[SharedPrefixIndex, ThreadStore, ResponseStore]:
    """The stores kept where sessions are: in Redis when sessions are (any worker finds any conversation, thread
    reply and stored response, and a restart loses none), else in this process."""
    thread_ttl_s, retention_s = settings.thread_ttl_s or settings.session_ttl_s, settings.session_retention_s
    if not isinstance(sessions, RedisSessionStore):
        return (SharedPrefixIndex(None, retention_s, None), InMemoryThreadStore(thread_ttl_s),
                InMemoryResponseStore(retention_s))
    return (SharedPrefixIndex(sessions.client, retention_s, sessions.events),
            RedisThreadStore(sessions, thread_ttl_s, settings.thread_claim_lease_s),
            RedisResponseStore(sessions, retention_s))


class ChatServer:
    """Run with `async with ChatServer(settings) as server:`; `server.url` is the websocket URL.

    The port opens at once and /healthz answers 503 until the model is loaded; turns that arrive
    meanwhile wait in the engine's queue."""

    def __init__(self, settings: Settings, load: Callable[[], LoadedModel] | None = None):
        if settings.redis_url:  # (every store, the engine's included, opens Redis as this says)
            found = redis_topology(settings.redis_url, settings.redis_cluster)
            settings.redis_cluster = found.cluster
            if settings.redis_wait_replicas is None:
                settings.redis_wait_replicas = min(1, found.replicas)
            elif settings.redis_wait_replicas > found.replicas:
                log.warning("--redis-wait-replicas is %d but a Redis primary has %d replica(s): each turn will wait "
                            "the whole --redis-wait-timeout-ms (%d ms) until it has more", settings.redis_wait_replicas,
                            found.replicas, settings.redis_wait_timeout_ms)
        self.settings = settings
        self.metrics = Metrics(settings.model, typing.get_args(ErrorCode))
        self.stats = StatsRecorder(settings.model)
        self.engine = Engine(load or (lambda: load_model(settings.model, settings.device, settings.dtype,
                                                         settings.cache_dir)), settings,
                             on_cache_copy=self.metrics.observe_cache_copy, on_fatal=self._engine_stopped)
        self.engine_failed = asyncio.Event()  # set (from the engine thread) when the engine cannot go on
        self._loop: asyncio.AbstractEventLoop | None = None
        self.sessions: SessionStore = (
            RedisSessionStore(settings.redis_url, settings.session_retention_s, lease_ttl_s=settings.lease_ttl_s,
                              cluster=bool(settings.redis_cluster), wait_replicas=settings.redis_wait_replicas or 0,
                              wait_timeout_ms=settings.redis_wait_timeout_ms, failover_s=settings.redis_failover_s,
                              events=RedisEvents(self.metrics.observe_redis_wait))
            if settings.redis_url else InMemorySessionStore(settings.session_retention_s))
        self.keys = KeyRing(settings.api_keys())
        self.turns = TurnRunner(self.engine, self.sessions, settings, on_turn=self._turn_finished,
                                on_request=self.metrics.observe_request)
        self.gateway = Gateway(self.turns, self.keys, on_error=self._error_sent)
        index, threads, responses = _stores_beside(self.sessions, settings)
        self.conversations = Conversations(self.engine, self.sessions, settings, self.turns, index)
        admission = Admission(self.engine, settings, self.turns, self.keys)
        self.openai = OpenAIApi(admission, self.conversations, self.turns)
        self.completions = CompletionsApi(admission, self.conversations)
        self.tokenize = TokenizeApi(admission, self.conversations)
        self.kv_blocks = KVBlocksApi(admission, self.engine, settings)
        self.threads = Threads(threads, self.conversations)
        self.anthropic = AnthropicApi(admission, self.conversations, self.turns, self.threads)
        self.response_turns = ResponseTurns(admission, self.conversations, responses)
        self.responses = ResponsesApi(self.response_turns)
        self.response_sockets = ResponsesSockets(self.response_turns, settings)
        self.faults = FaultRoutes(self.engine, self.sessions, settings, self.keys)
        self.app = self._build_app()
        self._uvicorn: uvicorn.Server | None = None
        self._socket = None
        self._ticker: asyncio.Task | None = None
        self._websockets = 0  # open websocket connections
        self._sampler: asyncio.Task | None = None
        self._kv: dict = {}

    @property
    def port(self) -> int:
        return self._socket.getsockname()[1]

    @property
    def url(self) -> str:
        return f"ws://{self.settings.host}:{self.port}/ws"

    async def __aenter__(self) -> ChatServer:
        self._loop = asyncio.get_running_loop()
        self.engine.start()
        config = uvicorn.Config(self.app, host=self.settings.host, port=self.settings.port, ws=WebSocketProtocol,
                                ws_max_size=self.settings.max_message_bytes, lifespan="off", log_config=None,
                                access_log=False, timeout_graceful_shutdown=CLOSE_TIMEOUT_S)
        self._socket = config.bind_socket()
        config.load()
        self._uvicorn = uvicorn.Server(config)
        # Not `serve()`: that would take over SIGINT and SIGTERM, which `run` handles (a graceful drain).
        self._uvicorn.lifespan = config.lifespan_class(config)
        await self._uvicorn.startup(sockets=[self._socket])
        self._ticker = asyncio.create_task(self._uvicorn.main_loop())  # keeps the Date header current
        self._sampler = asyncio.create_task(self._sample_forever())
        return self

    async def __aexit__(self, *exc_info) -> None:
        self._sampler.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._sampler
        self._uvicorn.should_exit = True
        await self._ticker
        await self._uvicorn.shutdown(sockets=[self._socket])  # closes every connection, websockets included
        # The conversations' queued writes first: the engine's stop may wait on Redis for the KV caches (up to 30 s)
        # and on the KV events (10 s), and a grace period that runs out must not cost a completed turn.
        await self.sessions.flush()
        await asyncio.to_thread(self.engine.stop)
        await self.sessions.close()

    async def shutdown(self) -> None:
        """Graceful stop: accept no more connections, let running turns finish for up to
        --shutdown-timeout-s and cancel the rest; leaving the context then closes the connections
        and flushes the session store."""
        for listener in self._uvicorn.servers:
            listener.close()  # stop listening; open connections stay until the turns are done
        running = len(self.turns.running_turns)
        log.info("shutting down: %d turns running, waiting up to %.0f s", running, self.settings.shutdown_timeout_s)
        if cancelled := await self.turns.drain(self.settings.shutdown_timeout_s):
            log.warning("shutting down: cancelled %d turns still running after %.0f s", cancelled,
                        self.settings.shutdown_timeout_s)
        await self.response_sockets.close_all(CLOSE_TIMEOUT_S)  # their last events sent, then 1001

    async def wait_ready(self) -> None:
        """Wait until the model is loaded; raise if loading failed."""
        await asyncio.to_thread(self.engine.ready.wait)
        if self.engine.load_error is not None:
            raise ModelLoadError(f"loading model {self.settings.model!r} failed: {self.engine.load_error}")

    def live_state(self) -> LiveState:
        """What the server is doing now. The cache and arena counters are the engine's latest snapshot,
        published between its steps: reading them never waits for the engine."""
        return LiveState(running=self.engine.running, waiting=self.engine.waiting,
                         connected_sessions=self.gateway.connected_sessions, cache=self.engine.cache_stats,
                         engine_up=self.engine.failure is None, engine_failures=dict(self.engine.failures),
                         decode_steps=dict(self.engine.counts.batch_sizes), kv_dtypes=self._kv_dtypes(),
                         kv=self._kv_layout(),
                         redis=self.sessions.state() if isinstance(self.sessions, RedisSessionStore) else {},
                         prefix_index=self.conversations.index.local_state(),
                         message_threads=dict(self.threads.counts),
                         responses_websocket=self.response_sockets.live())

    def _kv_layout(self) -> dict:
        """The model's layers and windows, and what a session of N tokens holds against what its windows need
        (once the model is loaded; it never changes)."""
        loaded = self.engine.loaded
        if not self._kv and loaded is not None:
            config = loaded.model.config
            self._kv = kv_report(KVGeometry.of(config), kv_bytes_per_token(config, loaded.model.dtype))
        return self._kv

    def _kv_dtypes(self) -> dict[str, str]:
        """How each tier stores caches: the model's dtype on the device; its dtype or int8 beyond."""
        loaded, settings = self.engine.loaded, self.settings
        same = str(loaded.model.dtype).removeprefix("torch.") if loaded is not None else "same"
        dtypes = {"device": same, "host": same if settings.host_kv_dtype == "same" else settings.host_kv_dtype}
        if settings.remote_kv:
            dtypes["remote"] = same if settings.remote_kv_dtype == "same" else settings.remote_kv_dtype
        return dtypes

    def _engine_stopped(self, reason: str) -> None:
        """Called from the engine thread once it has failed every turn it had."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self.engine_failed.set)

    def _turn_finished(self, result: TurnResult) -> None:
        self.metrics.observe_turn(result)
        self.stats.record_turn(result)

    def _error_sent(self, code: str) -> None:
        self.metrics.observe_error(code)
        self.stats.record_error(code)

    async def _sample_forever(self) -> None:
        while True:
            try:
                self.stats.sample(self.live_state())
            except Exception:  # the dashboard loses a point; the server goes on
                log.exception("sampling the cache stats failed")
            await asyncio.sleep(SAMPLE_EVERY_S)

    def _build_app(self) -> FastAPI:
        app = FastAPI(title="chatd", version="1", summary="Chat with a KV cache kept alive between turns",
                      redoc_url=None)
        app.include_router(self.openai.router)
        app.include_router(self.completions.router)
        app.include_router(self.responses.router)
        app.include_router(self.tokenize.router)
        app.include_router(self.kv_blocks.router)
        app.include_router(self.anthropic.router)
        app.include_router(self.faults.router)
        install_error_handlers(app, openai_response, {"/v1/messages": anthropic_response})
        app.add_api_websocket_route("/ws", self._websocket)
        app.add_api_websocket_route("/v1/responses", self._responses_socket)
        app.add_api_route("/healthz", self._healthz, methods=["GET"])
        app.add_api_route("/readyz", self._readyz, methods=["GET"])
        app.add_api_route("/livez", lambda: text_response(http.HTTPStatus.OK, "ok\n"), methods=["GET"])
        app.add_api_route("/metrics", self._metrics, methods=["GET"])
        app.add_api_route("/v1/stats", self._stats, methods=["GET"])
        app.add_api_route("/", lambda: static_response(self.settings.web_dir, "index.html"), methods=["GET"])
        app.add_api_route("/index.html", lambda: static_response(self.settings.web_dir, "index.html"),
                          methods=["GET"])
        app.add_api_route("/dashboard", lambda: static_response(self.settings.web_dir, "dashboard.html"),
                          methods=["GET"])
        app.add_api_route("/web/{name:path}", lambda name: static_response(self.settings.web_dir, name),
                          methods=["GET"])
        return app

    async def _websocket(self, websocket: WebSocket) -> None:
        if (refusal := self._refuse_websocket(websocket)) is not None:
            await websocket.send_denial_response(refusal)
            return
        self._websockets += 1  # counted before the first await: concurrent handshakes see each other
        try:
            await websocket.accept()
            await self.gateway.handle(ClientSocket(websocket))
        finally:
            self._websockets -= 1

    async def _responses_socket(self, websocket: WebSocket) -> None:
        """OpenAI's Responses WebSocket mode: the key is checked before the upgrade (an HTTP 401 in OpenAI's error
        body, no socket); no subprotocol or beta header is needed."""
        _, owner = self.keys.bearer(websocket.headers)
        refusal = openai_response(ApiError(401, "missing or unknown API key: send Authorization: Bearer <key>",
                                           code="invalid_api_key")) \
            if self.keys.required and owner is None else self._refuse_connection(websocket)
        if refusal is not None:
            await websocket.send_denial_response(refusal)
            return
        self._websockets += 1
        try:
            await websocket.accept()
            client = owner or (websocket.client.host if websocket.client else "unknown")
            await self.response_sockets.serve(ClientSocket(websocket), owner, client)
        finally:
            self._websockets -= 1

    async def _healthz(self) -> Response:
        if self.engine.failure is not None:
            return text_response(http.HTTPStatus.SERVICE_UNAVAILABLE, f"engine failed: {self.engine.failure}\n")
        if self.engine.ready.is_set() and self.engine.load_error is None:
            return text_response(http.HTTPStatus.OK, "ok\n")
        return text_response(http.HTTPStatus.SERVICE_UNAVAILABLE, "loading\n")

    async def _readyz(self) -> Response:
        """Ready for turns: the model loaded and the engine up. A Redis outage does not take a worker out of the
        pool: it keeps serving the sessions it holds and queues their writes (one shared Redis blinking would
        otherwise empty the whole Service at once); `chatd:redis_reachable` and `/v1/stats` say where Redis stands.
        Only with durable writes (--redis-wait-replicas), which cannot be queued, is an unreachable Redis not ready."""
        health = await self._healthz()
        if health.status_code != http.HTTPStatus.OK:
            return health
        if self.sessions.durable and not await self.sessions.reachable():
            return text_response(http.HTTPStatus.SERVICE_UNAVAILABLE, "the session store (Redis) is unreachable and "
                                                                      "turns are durable\n")
        return text_response(http.HTTPStatus.OK, "ready\n")

    async def _metrics(self) -> Response:
        return Response(self.metrics.exposition(self.live_state()), media_type=CONTENT_TYPE)

    async def _stats(self) -> Response:
        return json_response(http.HTTPStatus.OK, self.stats.snapshot(self.live_state()))

    def _refuse_websocket(self, websocket: WebSocket) -> Response | None:
        """Refuse a handshake from a browser page of another origin (403), over --max-connections
        (503), or with a wrong Bearer key (401)."""
        if (refusal := self._refuse_connection(websocket)) is not None:
            return refusal
        sent, owner = self.keys.bearer(websocket.headers)
        if sent and owner is None:
            return text_response(http.HTTPStatus.UNAUTHORIZED, "unknown API key\n")
        return None

    def _refuse_connection(self, websocket: WebSocket) -> Response | None:
        """Refuse a handshake from a browser page of another origin (403), or over --max-connections (503)."""
        origin = websocket.headers.get("Origin")
        if (self.settings.allowed_origins and origin is not None and origin not in self.settings.allowed_origins
                and urlsplit(origin).netloc != websocket.headers.get("Host")):  # chatd's own pages may connect
            return text_response(http.HTTPStatus.FORBIDDEN, f"origin {origin!r} is not allowed\n")
        if self._websockets >= self.settings.max_connections:
            return text_response(http.HTTPStatus.SERVICE_UNAVAILABLE,
                                 f"too many connections (the limit is {self.settings.max_connections}); retry later\n")
        return None


async def run(settings: Settings) -> None:
    """Serve until SIGINT or SIGTERM."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    async with ChatServer(settings) as server:
        log.info("loading model %s on %s", settings.model, settings.device)
        await server.wait_ready()
        loaded = server.engine.loaded
        threads = server.engine.governor.max_threads  # (what the engine's thread set: torch's count is per thread)
        print(f"chatd listening on {server.url} (model {loaded.name}, {loaded.device}, "
              f"{loaded.model.dtype}, {threads} thread{'s' if threads > 1 else ''}); "
              f"chat UI at http://{settings.host}:{server.port}/, dashboard at /dashboard, metrics at /metrics",
              flush=True)
        stopping = asyncio.create_task(stop.wait())
        failed = asyncio.create_task(server.engine_failed.wait())
        await asyncio.wait({stopping, failed}, return_when=asyncio.FIRST_COMPLETED)
        stopping.cancel()
        failed.cancel()
        if server.engine_failed.is_set():
            # /healthz says 503 meanwhile, so that a load balancer stops sending turns here.
            await asyncio.sleep(FATAL_GRACE_S)
        await server.shutdown()
    if server.engine.failure is not None:
        raise EngineFailed(f"the engine stopped: {server.engine.failure}")
    log.info("stopped")
