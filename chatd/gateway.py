"""The websocket gateway: parses client messages, maps them onto sessions and turns, and streams
engine events back. It does no model work; everything slow happens in the engine thread."""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import socket
from collections import Counter
from collections.abc import Callable

from websockets.asyncio.server import ServerConnection
from websockets.exceptions import ConnectionClosed

from chatd.engine import Engine
from chatd.protocol import (
    CacheReport,
    ChatCancel,
    ChatDelta,
    ChatDone,
    ChatRequest,
    Delta,
    ErrorMessage,
    HistoryMessage,
    ProtocolError,
    SessionClose,
    SessionClosed,
    SessionOpen,
    SessionReady,
    Timings,
    Typing,
    Usage,
    parse_client_message,
)
from chatd.sampling import SamplingParams
from chatd.turn import TokenText, Turn, TurnEvent, TurnFailed, TurnResult
from sessions import Lease, Session, SessionBusy, SessionStore, StoreUnavailable, VersionConflict

log = logging.getLogger(__name__)
WORKER = f"{socket.gethostname()}:{os.getpid()}"


class Connection:
    """One websocket client, the turns it started (so that it can cancel them) and the sessions it
    has used (whose caches are evicted last while it stays connected)."""

    def __init__(self, websocket: ServerConnection, on_error: Callable[[str], None]):
        self.websocket = websocket
        self.turns: dict[str, Turn] = {}
        self.sessions: set[str] = set()
        self._on_error = on_error

    async def send(self, message) -> None:
        """Send, ignoring a client that has gone: its turns still run to completion and are recorded."""
        if isinstance(message, ErrorMessage):
            self._on_error(message.code)
        try:
            await self.websocket.send(message.model_dump_json())
        except ConnectionClosed:
            pass


class Gateway:
    """`on_turn` sees every finished turn and `on_error` every error code sent, for metrics."""

    def __init__(self, engine: Engine, store: SessionStore, max_waiting: int = 64,
                 on_turn: Callable[[TurnResult], None] = lambda result: None,
                 on_error: Callable[[str], None] = lambda code: None):
        self.engine = engine
        self.store = store
        self.max_waiting = max_waiting
        self._on_turn = on_turn
        self._on_error = on_error
        self._running: dict[str, Turn] = {}  # session id -> its running turn: one at a time per session
        self._attached: Counter[str] = Counter()  # session id -> connections using it
        self._forwarders: set[asyncio.Task] = set()

    @property
    def connected_sessions(self) -> int:
        """Sessions that at least one open connection has used."""
        return len(self._attached)

    async def handle(self, websocket: ServerConnection) -> None:
        connection = Connection(websocket, self._on_error)
        try:
            async for frame in websocket:
                try:
                    message = parse_client_message(frame)
                except ProtocolError as error:
                    await connection.send(ErrorMessage(code="bad_request", message=str(error)))
                    continue
                try:
                    await self.dispatch(connection, message)
                except StoreUnavailable as error:
                    await connection.send(ErrorMessage(turn_id=getattr(message, "turn_id", None), code="unavailable",
                                                       message=f"{error}; try again shortly", retryable=True))
                except Exception:
                    log.exception("handling %s failed", message.type)
                    await connection.send(ErrorMessage(code="internal", message=f"{message.type} failed"))
        except ConnectionClosed:
            pass  # the client went away mid-frame; its running turns still complete and are recorded
        finally:
            for session_id in connection.sessions:
                self._attached[session_id] -= 1
                if self._attached[session_id] == 0:
                    del self._attached[session_id]
                    self.engine.session_connected(session_id, False)

    def _attach(self, connection: Connection, session_id: str) -> None:
        if session_id not in connection.sessions:
            connection.sessions.add(session_id)
            self._attached[session_id] += 1
            if self._attached[session_id] == 1:
                self.engine.session_connected(session_id, True)

    async def dispatch(self, connection: Connection, message) -> None:
        match message:
            case SessionOpen():
                await self.open_session(connection, message)
            case ChatRequest():
                await self.start_turn(connection, message)
            case ChatCancel():
                await self.cancel_turn(connection, message)
            case Typing():
                await self.prefetch(connection, message)
            case SessionClose():
                await self.close_session(connection, message)

    async def open_session(self, connection: Connection, message: SessionOpen) -> None:
        if message.session_id is None:
            session = await self.store.create(message.system)
            self._attach(connection, session.session_id)
            await connection.send(SessionReady(session_id=session.session_id, turns=0, resumed=False, worker=WORKER))
            return
        session = await self.store.get(message.session_id)
        if session is None:
            await connection.send(_unknown_session(message.session_id))
            return
        self._attach(connection, session.session_id)
        history = [HistoryMessage(role=m.role, content=m.content) for m in session.messages]
        await connection.send(SessionReady(session_id=session.session_id, turns=session.turns, resumed=True,
                                           worker=WORKER, history=history))

    async def start_turn(self, connection: Connection, message: ChatRequest) -> None:
        turn_id = message.turn_id or secrets.token_urlsafe(8)
        session = await self.store.get(message.session_id)
        if session is None:
            await connection.send(_unknown_session(message.session_id, turn_id))
            return
        if running := self._running.get(session.session_id):
            await connection.send(ErrorMessage(
                turn_id=turn_id, code="busy", retryable=True,
                message=f"session {session.session_id} is already running turn {running.turn_id}"))
            return
        if turn_id in connection.turns:
            await connection.send(ErrorMessage(turn_id=turn_id, code="bad_request",
                                               message=f"turn_id {turn_id!r} is already running"))
            return
        if self.engine.waiting >= self.max_waiting:  # admission control: refuse now rather than queue forever
            await connection.send(ErrorMessage(
                turn_id=turn_id, code="busy", retryable=True,
                message=f"the server is at capacity ({self.engine.waiting} turns waiting); retry shortly"))
            return
        try:
            lease = await self.store.lease(session.session_id)
        except SessionBusy as error:
            await connection.send(ErrorMessage(turn_id=turn_id, code="busy", retryable=True, message=str(error)))
            return
        try:
            session = await self.store.get(session.session_id) or session  # fresh: another worker may have written
        except BaseException:
            await lease.release()
            raise
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[TurnEvent] = asyncio.Queue()
        turn = Turn(
            turn_id=turn_id,
            session_id=session.session_id,
            messages=session.prompt_messages(message.content),
            params=SamplingParams(**message.params.model_dump()),
            emit=lambda event: loop.call_soon_threadsafe(events.put_nowait, event),
            session_version=session.version,
        )
        self._running[session.session_id] = turn
        connection.turns[turn_id] = turn
        self._attach(connection, session.session_id)
        self.engine.submit(turn)
        task = asyncio.create_task(self._forward(connection, session, turn, message.content, events, lease))
        self._forwarders.add(task)
        task.add_done_callback(self._forwarders.discard)

    async def _forward(self, connection: Connection, session: Session, turn: Turn, user_content: str,
                       events: asyncio.Queue[TurnEvent], lease: Lease) -> None:
        """Relay one turn's events to its client; record the turn in the session when it completes."""
        seq = 0
        try:
            while isinstance(event := await events.get(), TokenText):
                await connection.send(ChatDelta(turn_id=turn.turn_id, seq=seq, delta=Delta(content=event.text)))
                seq += 1
            if isinstance(event, TurnResult):
                self._on_turn(event)
                if event.finish_reason != "cancelled":
                    try:
                        await self.store.append_turn(session, user_content, event.content, event.conversation_ids,
                                                     lease)
                    except VersionConflict:
                        self.engine.drop_session(session.session_id)
                        event = TurnFailed("conflict", "another worker recorded a turn of this session first; "
                                                       "this reply was not recorded")
        finally:
            # Free the session before the reply goes out, so the client's next request is never `busy`.
            del self._running[session.session_id]
            del connection.turns[turn.turn_id]
            await lease.release()
        await connection.send(_reply(turn.turn_id, event))

    async def cancel_turn(self, connection: Connection, message: ChatCancel) -> None:
        turn = connection.turns.get(message.turn_id)
        if turn is None:
            await connection.send(ErrorMessage(turn_id=message.turn_id, code="unknown_turn",
                                               message=f"no running turn {message.turn_id!r} on this connection"))
            return
        turn.cancel()  # the engine stops at its next step and answers chat.done with finish_reason cancelled

    async def prefetch(self, connection: Connection, message: Typing) -> None:
        """A hint, so it answers nothing, not even for an unknown session."""
        if message.session_id not in self._running and await self.store.get(message.session_id) is not None:
            self.engine.prefetch(message.session_id)

    async def close_session(self, connection: Connection, message: SessionClose) -> None:
        session = await self.store.get(message.session_id)
        if session is None:
            await connection.send(_unknown_session(message.session_id))
            return
        if running := self._running.get(session.session_id):
            running.cancel()
        await self.store.delete(session.session_id)
        self.engine.drop_session(session.session_id)
        await connection.send(SessionClosed(session_id=session.session_id))


def _unknown_session(session_id: str, turn_id: str | None = None) -> ErrorMessage:
    return ErrorMessage(turn_id=turn_id, code="unknown_session", message=f"no session {session_id!r}")


def _reply(turn_id: str, event: TurnResult | TurnFailed) -> ChatDone | ErrorMessage:
    if isinstance(event, TurnFailed):
        return ErrorMessage(turn_id=turn_id, code=event.code, message=event.message,
                            retryable=event.code == "conflict")
    return ChatDone(
        turn_id=turn_id,
        finish_reason=event.finish_reason,
        content=event.content,
        usage=Usage(prompt_tokens=event.prompt_tokens, completion_tokens=event.completion_tokens,
                    cached_tokens=event.cached_tokens),
        timings=Timings(**{name: round(value, 3) for name, value in event.timings.items()}),
        cache=CacheReport(source=event.cache_source, miss_reason=event.miss_reason, cleared=event.cleared,
                          remote=event.remote),
    )
