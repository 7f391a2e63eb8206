"""The chatd server: one port for the websocket protocol (/ws) and plain HTTP probes (/healthz)."""

from __future__ import annotations

import asyncio
import http
import json
import logging
import re
import signal
from collections.abc import Callable
from urllib.parse import parse_qs, urlsplit

from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.http11 import Request, Response

from cache_store.faults import FAULT_KINDS, TIERS, NoCache, corrupt
from chatd.config import Settings
from chatd.engine import Engine
from chatd.gateway import Gateway
from chatd.model_loader import LoadedModel, load_model
from sessions import InMemorySessionStore, SessionStore
from sessions.redis_store import RedisSessionStore

log = logging.getLogger(__name__)


class ModelLoadError(RuntimeError):
    """The model could not be loaded; the server cannot serve."""


class ChatServer:
    """Run with `async with ChatServer(settings) as server:`; `server.url` is the websocket URL.

    The port opens at once and /healthz answers 503 until the model is loaded; turns that arrive
    meanwhile wait in the engine's queue."""

    def __init__(self, settings: Settings, load: Callable[[], LoadedModel] | None = None):
        self.settings = settings
        self.engine = Engine(load or (lambda: load_model(settings.model, settings.device, settings.dtype,
                                                         settings.cache_dir)), settings)
        self.sessions: SessionStore = (
            RedisSessionStore(settings.redis_url, settings.session_retention_s, lease_ttl_s=settings.lease_ttl_s)
            if settings.redis_url else InMemorySessionStore())
        self.gateway = Gateway(self.engine, self.sessions, settings.max_waiting)
        self._server: Server | None = None

    @property
    def port(self) -> int:
        return self._server.sockets[0].getsockname()[1]

    @property
    def url(self) -> str:
        return f"ws://{self.settings.host}:{self.port}/ws"

    async def __aenter__(self) -> ChatServer:
        self.engine.start()
        self._server = await serve(self.gateway.handle, self.settings.host, self.settings.port,
                                   process_request=self._process_request)
        return self

    async def __aexit__(self, *exc_info) -> None:
        self._server.close()
        await self._server.wait_closed()
        await asyncio.to_thread(self.engine.stop)
        await self.sessions.close()

    async def wait_ready(self) -> None:
        """Wait until the model is loaded; raise if loading failed."""
        await asyncio.to_thread(self.engine.ready.wait)
        if self.engine.load_error is not None:
            raise ModelLoadError(f"loading model {self.settings.model!r} failed: {self.engine.load_error}")

    async def _process_request(self, connection: ServerConnection, request: Request) -> Response | None:
        url = urlsplit(request.path)
        path = url.path
        if (corrupt := _CORRUPT_PATH.fullmatch(path)) and request.method == "POST":
            return await self._corrupt(connection, corrupt.group(1), parse_qs(url.query))
        if path == "/healthz":
            if self.engine.ready.is_set() and self.engine.load_error is None:
                return connection.respond(http.HTTPStatus.OK, "ok\n")
            return connection.respond(http.HTTPStatus.SERVICE_UNAVAILABLE, "loading\n")
        if path != "/ws":
            return connection.respond(http.HTTPStatus.NOT_FOUND, "not found: the websocket endpoint is /ws\n")
        return None


    async def _corrupt(self, connection: ServerConnection, session_id: str, query: dict[str, list[str]]) -> Response:
        """POST /admin/sessions/{id}/corrupt?kind=…&tier=…: fault injection, only when enabled."""
        if not self.settings.enable_fault_injection:
            return _json(connection, http.HTTPStatus.FORBIDDEN,
                         {"error": "fault injection is disabled; start the server with --enable-fault-injection"})
        kind, tier = query.get("kind", [""])[0], query.get("tier", ["device"])[0]
        if kind not in FAULT_KINDS or tier not in TIERS:
            return _json(connection, http.HTTPStatus.BAD_REQUEST,
                         {"error": f"kind must be one of {', '.join(FAULT_KINDS)}; tier one of {', '.join(TIERS)}"})
        if await self.sessions.get(session_id) is None:
            return _json(connection, http.HTTPStatus.NOT_FOUND, {"error": f"no session {session_id!r}"})
        try:
            done = await asyncio.wrap_future(
                self.engine.call(lambda store: corrupt(store, session_id, kind, tier), session_id=session_id))
        except NoCache as error:
            return _json(connection, http.HTTPStatus.NOT_FOUND, {"error": str(error)})
        log.warning("fault injected into session %s (%s tier): %s", session_id, tier, done)
        return _json(connection, http.HTTPStatus.OK,
                     {"session_id": session_id, "kind": kind, "tier": tier, "done": done})


_CORRUPT_PATH = re.compile(r"/admin/sessions/([^/]+)/corrupt")


def _json(connection: ServerConnection, status: http.HTTPStatus, body: dict) -> Response:
    response = connection.respond(status, json.dumps(body) + "\n")
    del response.headers["Content-Type"]
    response.headers["Content-Type"] = "application/json"
    return response


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
        print(f"chatd listening on {server.url} (model {loaded.name}, {loaded.device}, "
              f"{loaded.model.dtype})", flush=True)
        await stop.wait()
        log.info("shutting down")
