"""`GET /kv/blocks`: the blocks this worker's tiers hold, read from the tiers themselves, as the ids its KV events
use. A fleet's operator (and the tests) compare it with what a KV-aware router believes (Dynamo's `/dump`): the two
must be equal once the events are delivered."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from pydantic import BaseModel

from cache_store.block_ledger import blocks_in_tiers
from chatd.api.admission import Admission
from chatd.api.http_errors import ApiError
from chatd.config import Settings
from chatd.engine.scheduler import Engine
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
        self.admission.authenticate(request)
        if self.settings.kv_events_endpoint is None:
            raise ApiError(404, "this worker publishes no KV events; start it with --kv-events-endpoint",
                           code="not_found")
        size = self.settings.kv_block_size
        try:
            held = await asyncio.wrap_future(self.engine.call(lambda store: blocks_in_tiers(store, size)))
        except EngineUnavailable as error:
            raise ApiError(503, str(error), code="unavailable") from None
        return KVBlocksResponse(block_size=size, blocks={medium: sorted(ids) for medium, ids in held.items()})
