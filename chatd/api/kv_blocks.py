"""`GET /kv/blocks`: the blocks this worker's tiers hold, read from the tiers themselves, as the ids its KV events
use. A fleet's operator (and the tests) compare it with what a KV-aware router believes (Dynamo's `/dump`): the two
must be equal once the events are delivered."""

from __future__ import annotations

import asyncio
import hmac

from fastapi import APIRouter, Request
from pydantic import BaseModel

from cache_store.block_ledger import blocks_of, held_tokens
from chatd.api.admission import Admission
from chatd.api.http_errors import ApiError
from chatd.config import Settings
from chatd.engine.engine import Engine
from chatd.engine.supervision import EngineUnavailable


class KVBlocksResponse(BaseModel):
    """The published block ids per medium (`GPU`: the device tier, `CPU`: the host tier), sorted."""

    block_size: int
    blocks: dict[str, list[int]]


class KVBlocksApi:
    """The route, answered only where KV events are published (`--kv-events-endpoint`)."""

    def __init__(self, admission: Admission, engine: Engine, settings: Settings):
        self.admission, self.engine, self.settings = admission, engine, settings
        self.router = APIRouter()
        self.router.add_api_route("/kv/blocks", self.blocks, methods=["GET"], response_model=KVBlocksResponse)

    async def blocks(self, request: Request) -> KVBlocksResponse:
        """The operator's alone (`--admin-key`; without one, only a server without API keys answers): every tenant's
        blocks are here. The engine thread only copies what the tiers hold; the blocks are hashed in a thread."""
        self._operator(request)
        if self.settings.kv_events_endpoint is None:
            raise ApiError(404, "this worker publishes no KV events; start it with --kv-events-endpoint",
                           code="not_found")
        size, secret = self.settings.kv_block_size, self.settings.kv_scope_secret.get_secret_value()
        try:
            held = await asyncio.wrap_future(self.engine.call(held_tokens))
        except EngineUnavailable as error:
            raise ApiError(503, str(error), code="unavailable") from None
        blocks = await asyncio.to_thread(blocks_of, held, size, secret)
        return KVBlocksResponse(block_size=size, blocks={medium: sorted(ids) for medium, ids in blocks.items()})

    def _operator(self, request: Request) -> None:
        """A 401 unless the request carries the admin key (or, without one, the server has no API keys)."""
        admin = self.settings.admin_key
        if admin is None:
            if self.admission.keys.required:
                raise ApiError(401, "/kv/blocks is the operator's: start the server with --admin-key and send it",
                               code="unauthorized")
            return
        sent = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
        if not hmac.compare_digest(sent.encode(), admin.get_secret_value().encode()):
            raise ApiError(401, "/kv/blocks takes the admin key (--admin-key)", code="unauthorized")
