"""The admin routes of fault injection (`--enable-fault-injection`), for drills and the tests: corrupt a session's
cache on a tier, or make an engine stage raise. Off by default; with API keys, only a session's own key."""

from __future__ import annotations

import asyncio
import http
import logging

from fastapi import APIRouter, Request
from starlette.responses import Response

from cache_store import STAGES
from cache_store.faults import FAULT_KINDS, TIERS, NoCache, corrupt
from chatd.api.auth import KeyRing
from chatd.api.http_responses import json_response
from chatd.config import Settings
from chatd.engine.engine import Engine
from sessions import SessionStore

log = logging.getLogger(__name__)


class FaultRoutes:
    """`POST /admin/sessions/{id}/corrupt` and `POST /admin/engine/fault`."""

    def __init__(self, engine: Engine, sessions: SessionStore, settings: Settings, keys: KeyRing):
        self.engine, self.sessions, self.settings, self.keys = engine, sessions, settings, keys
        self.router = APIRouter(prefix="/admin")
        self.router.add_api_route("/sessions/{session_id}/corrupt", self.corrupt, methods=["POST"])
        self.router.add_api_route("/engine/fault", self.arm_engine_fault, methods=["POST"])

    def _refusal(self, request: Request) -> tuple[Response | None, str | None]:
        """Fault injection only when enabled, and with API keys only with a key: (refusal, the key's id)."""
        if not self.settings.enable_fault_injection:
            return json_response(http.HTTPStatus.FORBIDDEN, {
                "error": "fault injection is disabled; start the server with --enable-fault-injection"}), None
        _, owner = self.keys.bearer(request.headers)
        if self.keys.required and owner is None:
            return json_response(http.HTTPStatus.UNAUTHORIZED,
                                 {"error": "send the session owner's key as Authorization: Bearer <key>"}), None
        return None, owner

    async def arm_engine_fault(self, request: Request) -> Response:
        """POST /admin/engine/fault?stage=…[&session=…][&fatal=true]: the next time that engine stage
        runs (for that session, until its turn has failed; or for any, once), it raises."""
        refusal, owner = self._refusal(request)
        if refusal is not None:
            return refusal
        query = request.query_params
        stage, session_id = query.get("stage", ""), query.get("session")
        fatal = query.get("fatal", "false").lower() in ("1", "true", "yes")
        if stage not in STAGES:
            return json_response(http.HTTPStatus.BAD_REQUEST, {"error": f"stage must be one of {', '.join(STAGES)}"})
        if session_id is not None:
            session = await self.sessions.get(session_id)
            if session is None or session.owner != owner:
                return json_response(http.HTTPStatus.NOT_FOUND, {"error": f"no session {session_id!r}"})
        elif self.keys.required:
            return json_response(http.HTTPStatus.BAD_REQUEST, {"error": "with API keys, name one of your sessions"})
        self.engine.faults.arm(stage, session_id, fatal)
        log.warning("fault armed at the engine's %s stage (%s%s)", stage, session_id or "any session",
                    ", fatal" if fatal else "")
        return json_response(http.HTTPStatus.OK, {"stage": stage, "session_id": session_id, "fatal": fatal})

    async def corrupt(self, session_id: str, request: Request) -> Response:
        """POST /admin/sessions/{id}/corrupt?kind=…&tier=…: another key's session is answered as missing."""
        refusal, owner = self._refusal(request)
        if refusal is not None:
            return refusal
        kind, tier = request.query_params.get("kind", ""), request.query_params.get("tier", "device")
        if kind not in FAULT_KINDS or tier not in TIERS:
            return json_response(http.HTTPStatus.BAD_REQUEST,
                                 {"error": f"kind must be one of {', '.join(FAULT_KINDS)}; tier one of "
                                           f"{', '.join(TIERS)}"})
        session = await self.sessions.get(session_id)
        if session is None or session.owner != owner:
            return json_response(http.HTTPStatus.NOT_FOUND, {"error": f"no session {session_id!r}"})
        try:
            done = await asyncio.wrap_future(
                self.engine.call(lambda store: corrupt(store, session_id, kind, tier), session_id=session_id))
        except NoCache as error:
            return json_response(http.HTTPStatus.NOT_FOUND, {"error": str(error)})
        log.warning("fault injected into session %s (%s tier): %s", session_id, tier, done)
        return json_response(http.HTTPStatus.OK, {"session_id": session_id, "kind": kind, "tier": tier, "done": done})
