"""OpenAI's Responses WebSocket mode: `GET /v1/responses` upgraded, one JSON event per text frame, as the `openai`
SDK's `client.responses.connect()` speaks it.

A socket is an adapter: each `response.create` opens a response through `ResponseTurns` exactly as `POST
/v1/responses` does, and its events are `response_events`, each sent as a frame. The reader never waits on
generation: it checks an event and hands a create to its lane (`stream_id`), a FIFO worked by a task of its own;
lanes run at once, so their turns decode in the same batched engine steps. A steer stops the running reply at a token
boundary (`Turn.steer`) and its successor continues the same session from its cache.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import Counter, OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from chatd.api.http_errors import ApiError
from chatd.api.openai.response_events import response_events
from chatd.api.openai.response_turns import ResponseTurns, SocketResponses
from chatd.api.openai.responses_schema import OutputFunctionCall
from chatd.api.openai.socket_events import (
    SocketCreate,
    SocketError,
    parse_create,
    required_input,
    steer_event,
    steer_failed,
    steer_id,
    steer_messages,
    with_lane,
)
from chatd.config import Settings

log = logging.getLogger(__name__)
MAX_LANES = 32  # distinct named lanes per connection
MAX_ACTIVE = 16  # responses running at once per connection; more wait in their lanes
MAX_STEERS = 8  # steers queued for one response
ENDED_KEPT = 256  # ended responses remembered per connection, so that a late steer is told why
GOING_AWAY = 1001  # the close code the SDK reconnects on


class Socket(Protocol):
    """The server's websocket as this mode uses it (`chatd.api.websocket.client_socket.ClientSocket`)."""

    def __aiter__(self) -> AsyncIterator[str | bytes]: ...

    async def send(self, text: str) -> None: ...

    async def close(self, code: int, reason: str) -> None: ...


@dataclass
class Steer:
    """Accepted steering input, waiting for its response to stop."""

    steer_id: str
    value: Any  # as sent, returned if it cannot be committed
    messages: list  # the user messages it adds


@dataclass
class Running:
    """A response this connection is running: where its steers go."""

    response_id: str
    lane: str | None
    body: SocketCreate
    steer: Callable[[], None]  # stops its turn at the next token boundary
    cancel: Callable[[], None]  # stops it, nothing of it kept (its client left)
    steers: list[Steer] = field(default_factory=list)


@dataclass
class Lane:
    """A `stream_id`'s FIFO of creates and the task that works it; steers a tool-calling parent left for its next
    create."""

    queue: asyncio.Queue[SocketCreate | None] = field(default_factory=asyncio.Queue)  # None: the lane ends
    task: asyncio.Task | None = None
    pending: list[Steer] = field(default_factory=list)


class ResponsesSockets:
    """Every open Responses WebSocket of this worker: their counts for metrics, and their close at shutdown."""

    def __init__(self, response_turns: ResponseTurns, settings: Settings):
        self.response_turns, self.settings = response_turns, settings
        self.open: set[ResponsesSocket] = set()
        self.counts: Counter[str] = Counter()  # creates, warmups, steers by outcome

    def live(self) -> dict[str, int]:
        """Connections, lanes and queued creates now, and the counters."""
        return {"connections": len(self.open), "lanes": sum(len(s.lanes) for s in self.open),
                "queued": sum(lane.queue.qsize() for s in self.open for lane in s.lanes.values()), **self.counts}

    async def serve(self, websocket: Socket, owner: str | None, client: str) -> None:
        """One connection, until the client leaves, its age runs out or the server shuts down."""
        socket = ResponsesSocket(self, websocket, owner, client)
        self.open.add(socket)
        try:
            await socket.run()
        finally:
            self.open.discard(socket)

    async def close_all(self, timeout_s: float) -> None:
        """At shutdown, after the drain: each socket's responses finish sending, then it closes with 1001."""
        if self.open:
            await asyncio.wait([asyncio.create_task(s.going_away("the server is shutting down", timeout_s))
                                for s in list(self.open)])


class ResponsesSocket:
    """One connection: its lanes, its running responses and their steers, its own responses' points."""

    def __init__(self, sockets: ResponsesSockets, websocket: Socket, owner: str | None, client: str):
        self.sockets, self.websocket, self.owner, self.client = sockets, websocket, owner, client
        self.turns = sockets.response_turns
        self.responses = SocketResponses()
        self.lanes: dict[str | None, Lane] = {}
        self.running: dict[str, Running] = {}
        self.ended: OrderedDict[str, str] = OrderedDict()  # response id -> how it ended
        self.active = asyncio.Semaphore(MAX_ACTIVE)
        self.closing = False
        self.sequence = 0  # steering events' numbers
        self._send_lock = asyncio.Lock()
        self._closed = asyncio.Event()

    async def run(self) -> None:
        """Read events until the client leaves or the connection is closed (its age, or shutdown); then its lanes
        end, a gone client's running responses cancelled (nothing half-made is kept)."""
        reader = asyncio.create_task(self._read())
        age = asyncio.create_task(asyncio.sleep(self.sockets.settings.responses_ws_max_age_s))
        await asyncio.wait({reader, age}, return_when=asyncio.FIRST_COMPLETED)
        if not reader.done():  # its age ran out: its responses finish first
            await self.going_away("this connection reached its time limit; reconnect to go on",
                                  self.sockets.settings.shutdown_timeout_s, code="websocket_connection_limit_reached")
        age.cancel()
        await reader
        self._end_lanes()
        for running in list(self.running.values()):
            running.cancel()
        await asyncio.gather(*(lane.task for lane in self.lanes.values() if lane.task), return_exceptions=True)
        await self.turns.close_socket(self.responses)

    async def going_away(self, reason: str, timeout_s: float, code: str | None = None) -> None:
        """Take no more creates, let the running responses finish sending (up to `timeout_s`), then close with
        1001 (after an error event with `code`, if given)."""
        self._end_lanes()
        tasks = [lane.task for lane in self.lanes.values() if lane.task is not None and not lane.task.done()]
        if tasks:
            await asyncio.wait(tasks, timeout=timeout_s)
        if code is not None:
            await self.send({"type": "error", "status": 400, "error": {
                "type": "invalid_request_error", "code": code, "message": reason, "param": None}})
        await self.websocket.close(GOING_AWAY, reason[:120])

    def _end_lanes(self) -> None:
        """No more creates: what waits in the lanes is dropped, and each lane ends after its running response."""
        self.closing = True
        for lane in self.lanes.values():
            while not lane.queue.empty():
                lane.queue.get_nowait()
            lane.queue.put_nowait(None)

    async def send(self, event: dict) -> None:
        """One event as one text frame; a client that has gone is not an error (its responses were cancelled)."""
        async with self._send_lock:
            try:
                await self.websocket.send(json.dumps(event, separators=(",", ":")))
            except Exception:  # (the socket's own "client gone": whatever the server library raised)
                log.debug("a Responses WebSocket client left before an event reached it")

    async def _read(self) -> None:
        async for frame in self.websocket:
            try:
                event = json.loads(frame)
                if not isinstance(event, dict):
                    raise ValueError("not an object")
            except ValueError:
                await self.send(SocketError(400, "invalid_json", "each frame must be one JSON object").event())
                continue
            kind = event.get("type")
            if kind == "response.create":
                await self._create(event)
            elif kind == "response.steer":
                await self._steer(event)
            else:
                await self.send(SocketError(400, "invalid_event", f"unknown event type {kind!r}: this socket "
                                            "takes response.create and response.steer", param="type").event())

    # ##### Creates and lanes #####

    async def _create(self, event: dict) -> None:
        """Check a create and queue it on its lane (a new lane gets a worker)."""
        try:
            body = parse_create(event)
            if body.background:
                raise SocketError(400, "unsupported_parameter", "background responses are not supported over a "
                                  "WebSocket", "background", body.stream_id)
            if self.closing:
                raise SocketError(503, "unavailable", "this connection is closing; reconnect", lane=body.stream_id)
            lane = self.lanes.get(body.stream_id)
            if lane is None:
                if body.stream_id is not None and sum(key is not None for key in self.lanes) >= MAX_LANES:
                    raise SocketError(400, "websocket_stream_limit_reached", f"this connection already has "
                                      f"{MAX_LANES} lanes, the most allowed", "stream_id", body.stream_id)
                lane = self.lanes[body.stream_id] = Lane()
                lane.task = asyncio.create_task(self._work(body.stream_id, lane))
        except SocketError as error:
            await self.send(error.event())
            return
        self.sockets.counts["creates"] += 1
        lane.queue.put_nowait(body)

    async def _work(self, name: str | None, lane: Lane) -> None:
        """A lane's creates, one after another; each one's steers may run a successor before the next."""
        while (body := await lane.queue.get()) is not None:
            steers: list[Steer] = []
            if lane.pending:  # steers a tool-calling parent left: prepended to this explicit create
                body = body.model_copy(update={"input": [m for s in lane.pending for m in s.messages] + body.items()})
                steers, lane.pending = lane.pending, []
            while body is not None and not self.closing:
                body, steers = await self._respond(name, lane, body, steers)

    async def _respond(self, lane_name: str | None, lane: Lane, body: SocketCreate, steers: list[Steer]
                       ) -> tuple[SocketCreate | None, list[Steer]]:
        """Run one response to its end and send its events (`steers`: those its input commits); then the steered
        successor to run next and its steers, if any."""
        async with self.active:
            try:
                opened = await self.turns.open(self.owner, self.client, body, self.responses, lane_name)
            except ApiError as error:
                self._failed_continuation(lane_name, body)
                for steer in steers:  # (a successor, or a create the queued steers were prepended to)
                    self.sockets.counts["steers_successor_creation_failed"] += 1
                    await self.send(steer_failed(self._next(), "successor_creation_failed", error.message,
                                                 body.previous_response_id or "", steer.value, lane_name,
                                                 steer.steer_id))
                await self.send(SocketError.of(error, lane_name).event())
                return None, []
            if body.warm_up:
                self.sockets.counts["warmups"] += 1
            turn = opened.started.turn
            running = Running(opened.created.id, lane_name, body, turn.steer, turn.cancel)
            self.running[running.response_id] = running
            last: dict = {}
            try:
                async for event in response_events(opened):
                    last = event
                    await self.send(with_lane(event, lane_name))
            finally:
                del self.running[running.response_id]
                self._remember_end(running.response_id, last.get("type", "response.failed"))
        if last.get("type") == "response.failed":
            self._failed_continuation(lane_name, body)
        return await self._after(running, lane, last), running.steers

    def _failed_continuation(self, lane: str | None, body: SocketCreate) -> None:
        """A failed continuation of its own lane's latest response evicts that parent from the connection's cache;
        a failed fork (another lane's parent) does not."""
        latest = self.responses.latest.get(lane)
        if body.previous_response_id and latest is not None and latest.response_id == body.previous_response_id:
            self.responses.evict(body.previous_response_id)

    def _remember_end(self, response_id: str, kind: str) -> None:
        self.ended[response_id] = kind.removeprefix("response.")
        while len(self.ended) > ENDED_KEPT:
            self.ended.popitem(last=False)

    # ##### Steering #####

    async def _steer(self, event: dict) -> None:
        """Queue steering input for a running response of this connection, and stop its reply at a token boundary."""
        previous, value = event.get("previous_response_id"), event.get("input")
        running = self.running.get(previous) if isinstance(previous, str) else None
        lane = running.lane if running else None
        messages = steer_messages(value)
        failure = None
        if not isinstance(previous, str) or set(event) - {"type", "previous_response_id", "input"} or not messages:
            failure = ("invalid_input", "response.steer takes previous_response_id and input: user text, or user "
                                        "messages of text")
        elif running is None:
            ended = self.ended.get(previous)
            failure = ("response_already_completed", "the response has completed") if ended == "completed" else \
                ("response_not_active", f"the response has ended ({ended})") if ended else \
                ("response_not_found", "no running response with this id on this connection")
        elif len(running.steers) >= MAX_STEERS:
            failure = ("too_many_pending_steers", f"{MAX_STEERS} steers already wait for this response")
        if failure is not None:
            self.sockets.counts[f"steers_{failure[0]}"] += 1
            await self.send(steer_failed(self._next(), *failure, str(previous), value, lane))
            return
        steer = Steer(steer_id(), value, messages)
        running.steers.append(steer)
        self.sockets.counts["steers_accepted"] += 1
        await self.send(steer_event("accepted", self._next(), {"id": steer.steer_id, "previous_response_id": previous},
                                    lane))
        running.steer()

    async def _after(self, parent: Running, lane: Lane, last: dict) -> SocketCreate | None:
        """A steered response's end: its successor (the steers' input, the parent's settings, continuing it); or,
        when it stopped for its tools' outputs, the steers kept for the lane's next create (`pending`); or, when
        it failed, the steers returned."""
        if not parent.steers:
            return None
        response = last.get("response") or {}
        calls = [OutputFunctionCall.model_validate(item) for item in response.get("output", [])
                 if item.get("type") == "function_call"]
        if last.get("type") == "response.completed" and calls:
            for steer in parent.steers:
                self.sockets.counts["steers_pending"] += 1
                await self.send(steer_event("pending", self._next(), {"id": steer.steer_id,
                                                                      "previous_response_id": parent.response_id},
                                            parent.lane, reason="waiting_for_required_input",
                                            required_input=required_input(calls)))
            lane.pending += parent.steers
            return None
        if last.get("type") not in ("response.completed", "response.incomplete") or self.closing:
            for steer in parent.steers:
                self.sockets.counts["steers_response_not_active"] += 1
                await self.send(steer_failed(self._next(), "response_not_active", "the response ended without a "
                                             "reply to continue", parent.response_id, steer.value, parent.lane,
                                             steer.steer_id))
            return None
        self.sockets.counts["steers_successors"] += 1
        return parent.body.model_copy(update={
            "input": [m for steer in parent.steers for m in steer.messages], "previous_response_id": parent.response_id,
            "generate": True, "prompt_cache_options": None})

    def _next(self) -> int:
        self.sequence += 1
        return self.sequence - 1

