"""The websocket gateway: parses client messages, maps them onto sessions and turns, and streams
engine events back. It does no model work; everything slow happens in the engine thread.

A connection first proves its API key (when the server has keys); every session belongs to the key
that created it, and any other key is told it does not exist.
"""

from __future__ import annotations

import itertools
import logging
import secrets
from collections import Counter
from collections.abc import Callable

from chatd.api.auth import KeyRing
from chatd.api.constants import WORKER
from chatd.api.tool_calling import RequestRefused, ToolFormat, compile_grammar, format_for
from chatd.api.turns import StartedTurn, TurnPlan, TurnRequest, TurnRunner
from chatd.api.websocket.client_socket import ClientGone, ClientSocket
from chatd.api.websocket.protocol import (
    Auth,
    AuthOk,
    CacheReport,
    ChatCancel,
    ChatDelta,
    ChatDone,
    ChatRequest,
    ChatResume,
    Delta,
    ErrorMessage,
    HistoryMessage,
    ProtocolError,
    SessionClose,
    SessionClosed,
    SessionOpen,
    SessionReady,
    SpeculationReport,
    Timings,
    ToolCallOut,
    Typing,
    Usage,
    parse_client_message,
)
from chatd.api.websocket.turn_log import TurnLogs
from chatd.api.websocket.turn_tools import result_messages, setup_for
from chatd.engine.sampling import SamplingParams
from chatd.engine.turn import TurnFailed, TurnResult
from sessions import Session, StoreUnavailable, ToolCall

log = logging.getLogger(__name__)
MAX_FAILED_AUTH = 5
POLICY_VIOLATION = 1008  # the websocket close code


class Connection:
    """One websocket client: who it is (its key's id), and the sessions it has used (whose caches
    are evicted last while it stays connected)."""

    def __init__(self, websocket: ClientSocket, on_error: Callable[[str], None], owner: str | None,
                 authenticated: bool):
        self.websocket = websocket
        self.owner = owner
        self.authenticated = authenticated
        self.failed_auth = 0
        self.sessions: set[str] = set()
        self._on_error = on_error

    @property
    def client(self) -> str:
        """Whom the rate limit counts: the key, or the address without keys."""
        return self.owner or str(self.websocket.remote_address[0])

    async def send(self, message) -> None:
        """Send, ignoring a client that has gone: its turns still run to completion and are recorded."""
        if isinstance(message, ErrorMessage):
            self._on_error(message.code)
        try:
            await self.websocket.send(message.model_dump_json())
        except ClientGone:
            pass


class Gateway:
    """The websocket protocol over `TurnRunner`: `on_error` sees every error code sent, for metrics."""

    def __init__(self, turns: TurnRunner, keys: KeyRing, on_error: Callable[[str], None] = lambda code: None):
        self.turns, self.keys = turns, keys
        self.engine, self.store, self.settings = turns.engine, turns.store, turns.settings
        self.turn_logs = TurnLogs(self.settings.turn_log_ttl_s)
        self._on_error = on_error
        self._attached: Counter[str] = Counter()  # session id -> connections using it

    @property
    def connected_sessions(self) -> int:
        """Sessions that at least one open connection has used."""
        return len(self._attached)

    async def handle(self, websocket: ClientSocket) -> None:
        _, owner = self.keys.bearer(websocket.headers)
        connection = Connection(websocket, self._on_error, owner,
                                authenticated=not self.keys.required or owner is not None)
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
                if connection.failed_auth >= MAX_FAILED_AUTH:
                    await websocket.close(POLICY_VIOLATION, "too many failed authentications")
                    break
        finally:  # a client that went away mid-turn: its running turns still complete and are recorded
            for session_id in connection.sessions:
                self._detach(session_id)

    def _detach(self, session_id: str) -> None:
        """One connection stopped using the session; after the last, its cache is evicted like any idle one."""
        self._attached[session_id] -= 1
        if self._attached[session_id] == 0:
            del self._attached[session_id]
            self.engine.session_connected(session_id, False)

    async def dispatch(self, connection: Connection, message) -> None:
        if isinstance(message, Auth):
            await self.authenticate(connection, message)
            return
        if not connection.authenticated:
            await connection.send(ErrorMessage(
                turn_id=getattr(message, "turn_id", None), code="unauthorized",
                message='authenticate first: send {"type": "auth", "token": "<API key>"} '
                        "or connect with an Authorization: Bearer header"))
            return
        match message:
            case SessionOpen():
                await self.open_session(connection, message)
            case ChatRequest():
                await self.start_turn(connection, message)
            case ChatCancel():
                await self.cancel_turn(connection, message)
            case ChatResume():
                await self.resume_turn(connection, message)
            case Typing():
                await self.prefetch(connection, message)
            case SessionClose():
                await self.close_session(connection, message)

    async def authenticate(self, connection: Connection, message: Auth) -> None:
        owner = self.keys.identify(message.token) if self.keys.required else None
        if self.keys.required and (owner is None or (connection.authenticated and owner != connection.owner)):
            connection.failed_auth += 1
            log.warning("failed authentication from %s", connection.websocket.remote_address[0])
            await connection.send(ErrorMessage(code="unauthorized", message="unknown API key"))
            return
        connection.owner, connection.authenticated = owner, True
        await connection.send(AuthOk())

    async def _owned_session(self, connection: Connection, session_id: str) -> Session | None:
        """The session, if it exists and belongs to this connection's key; another key's session is
        answered exactly like a missing one."""
        session = await self.store.get(session_id)
        return session if session is not None and session.owner == connection.owner else None

    def _attach(self, connection: Connection, session_id: str | None, turn_id: str | None = None
                ) -> ErrorMessage | None:
        """Count the session (None: a new one) against the connection's limit; the error to send if over it."""
        if session_id in connection.sessions:
            return None
        limit = self.settings.max_sessions_per_connection
        if len(connection.sessions) >= limit:
            return ErrorMessage(turn_id=turn_id, code="limit_exceeded",
                                message=f"this connection already uses {limit} sessions, the most allowed; "
                                        "close one (session.close) or open another connection")
        if session_id is None:
            return None
        connection.sessions.add(session_id)
        self._attached[session_id] += 1
        if self._attached[session_id] == 1:
            self.engine.session_connected(session_id, True)
        return None

    async def open_session(self, connection: Connection, message: SessionOpen) -> None:
        if message.session_id is None:
            if refusal := self._attach(connection, None):
                await connection.send(refusal)
                return
            try:
                setup_for(ToolFormat(), message.tool_options())  # checked now, not at the first turn
            except RequestRefused as error:
                await connection.send(ErrorMessage(code="bad_request", message=_naming(error)))
                return
            session = await self.store.create(message.system, owner=connection.owner,
                                              tool_options=message.tool_options() or None)
            self._attach(connection, session.session_id)  # (room for it was checked above)
            await connection.send(SessionReady(session_id=session.session_id, turns=0, resumed=False, worker=WORKER))
            return
        session = await self._owned_session(connection, message.session_id)
        if session is None:
            await connection.send(_unknown_session(message.session_id))
            return
        if refusal := self._attach(connection, session.session_id):
            await connection.send(refusal)
            return
        history = [HistoryMessage(role=m.role, content=m.content, tool_calls=_calls_out(m.tool_calls),
                                  tool_call_id=m.tool_call_id) for m in session.messages]
        await connection.send(SessionReady(session_id=session.session_id, turns=session.turns, resumed=True,
                                           worker=WORKER, history=history))

    async def start_turn(self, connection: Connection, message: ChatRequest) -> None:
        """Start the turn (`TurnRunner.start`: claim, rate limit, lease, fresh read) and relay it, or send why not;
        another key's session is answered as a missing one."""
        turn_id = message.turn_id or secrets.token_urlsafe(8)
        refusal = self._refuse_turn(connection, message, turn_id)
        if refusal is not None:
            await connection.send(refusal)
            return

        async def plan(session: Session) -> TurnPlan | ErrorMessage:
            """The turn as the session read with its lease says (its tools), or why not."""
            if session.owner != connection.owner:
                return _unknown_session(message.session_id, turn_id)
            if refusal := self._attach(connection, session.session_id, turn_id):
                return refusal
            try:
                setup = setup_for(self._tool_format(session, message), session.tool_options, message)
                new = message.content or result_messages(session.messages, message.tool_results or ())
                grammar = await compile_grammar(self.engine.grammars, setup, "response_format") \
                    if setup.grammar() is not None else None
            except RequestRefused as error:
                return ErrorMessage(turn_id=turn_id, code="bad_request", message=_naming(error))
            except ModelLoading:
                return ErrorMessage(turn_id=turn_id, code="unavailable", retryable=True,
                                    message="the model is still loading; tools need it: retry shortly")
            return TurnPlan(new, SamplingParams(**message.params.model_dump(), grammar=grammar), setup)

        started = await self.turns.start(TurnRequest(message.session_id, turn_id, connection.owner,
                                                     connection.client, "websocket", plan))
        if isinstance(started, ErrorMessage):
            if started.code == "busy" and await self._owned_session(connection, message.session_id) is None:
                started = _unknown_session(message.session_id, turn_id)  # (another key's session: as a missing one)
            await connection.send(started)
            return
        self._relay(connection, started)

    def _relay(self, connection: Connection, started: StartedTurn) -> None:
        """The turn's deltas (its prose: tool calls are held back for `chat.done`) and its end, through its turn log
        (which a reconnecting client resumes)."""
        turn_id = started.turn.turn_id
        turn_log = self.turn_logs.start(started.turn, connection.owner, connection)
        seq = itertools.count()
        prose = started.setup.prose_stream()

        async def publish_text(text: str) -> None:
            if text:
                await turn_log.publish(ChatDelta(turn_id=turn_id, seq=next(seq), delta=Delta(content=text)))

        async def on_text(text: str) -> None:
            await publish_text(prose.push(text))

        async def on_end(event: TurnResult | TurnFailed) -> None:
            if isinstance(event, TurnResult):
                await publish_text(prose.rest(started.reply[0], bool(started.reply[1]) or prose.opened))
            self.turn_logs.finish(turn_log)
            await turn_log.publish(_reply(turn_id, event, started))

        self.turns.forward(started, on_text, on_end)

    def _tool_format(self, session: Session, message: ChatRequest) -> ToolFormat:
        """How the served model sees tools; `ModelLoading` until it is loaded, for a turn that involves them
        (a turn without tools anywhere queues while the model loads, as always)."""
        if self.engine.loaded is not None and self.engine.grammars is not None:
            return format_for(self.engine.loaded.tokenizer.chat_template)
        if session.tool_options or message.tool_options() or message.tool_results or \
                any(m.tool_calls or m.role == "tool" for m in session.messages):
            raise ModelLoading
        return ToolFormat()

    def _refuse_turn(self, connection: Connection, message: ChatRequest, turn_id: str) -> ErrorMessage | None:
        """The checks that need no session: limits, capacity, a duplicate turn id (the shutdown: `TurnRunner.start`)."""
        cap = self.settings.max_new_tokens
        if message.params.max_new_tokens > cap:
            return ErrorMessage(turn_id=turn_id, code="limit_exceeded",
                                message=f"max_new_tokens {message.params.max_new_tokens} is over this "
                                        f"server's cap of {cap}")
        existing = self.turn_logs.get(connection.owner, turn_id)
        if existing is not None and existing.running:
            return ErrorMessage(turn_id=turn_id, code="bad_request", message=f"turn_id {turn_id!r} is already running")
        if self.engine.waiting >= self.settings.max_waiting:  # admission control: refuse now, not queue forever
            return ErrorMessage(turn_id=turn_id, code="busy", retryable=True,
                                message=f"the server is at capacity ({self.engine.waiting} turns waiting); "
                                        "retry shortly")
        return None

    async def cancel_turn(self, connection: Connection, message: ChatCancel) -> None:
        turn_log = self.turn_logs.get(connection.owner, message.turn_id)
        if turn_log is None or not turn_log.running:
            await connection.send(ErrorMessage(turn_id=message.turn_id, code="unknown_turn",
                                               message=f"no running turn {message.turn_id!r}"))
            return
        turn_log.turn.cancel()  # the engine stops at its next step and answers chat.done with finish_reason cancelled

    async def resume_turn(self, connection: Connection, message: ChatResume) -> None:
        """Make this connection the one the turn's stream goes to, then send it what it missed."""
        turn_log = self.turn_logs.get(connection.owner, message.turn_id)
        if turn_log is None:
            await connection.send(ErrorMessage(
                turn_id=message.turn_id, code="unknown_turn",
                message=f"no turn {message.turn_id!r} to resume: it never ran here or finished more than "
                        f"{self.settings.turn_log_ttl_s:g} s ago"))
            return
        if refusal := self._attach(connection, turn_log.turn.session_id, message.turn_id):
            await connection.send(refusal)
            return
        await turn_log.subscribe(connection, message.last_seq)

    async def prefetch(self, connection: Connection, message: Typing) -> None:
        """A hint, so it answers nothing, not even for an unknown session."""
        if not self.turns.is_claimed(message.session_id) and await self._owned_session(connection, message.session_id):
            self.engine.prefetch(message.session_id)

    async def close_session(self, connection: Connection, message: SessionClose) -> None:
        session = await self._owned_session(connection, message.session_id)
        if session is None:
            await connection.send(_unknown_session(message.session_id))
            return
        if running := self.turns.turn_of(session.session_id):
            running.cancel()
        await self.store.delete(session.session_id)
        self.engine.close_session(session.session_id)
        if session.session_id in connection.sessions:
            connection.sessions.discard(session.session_id)
            self._detach(session.session_id)
        await connection.send(SessionClosed(session_id=session.session_id))


def _unknown_session(session_id: str, turn_id: str | None = None) -> ErrorMessage:
    return ErrorMessage(turn_id=turn_id, code="unknown_session", message=f"no session {session_id!r}")


class ModelLoading(Exception):
    """The model is not loaded yet: how it sees tools is not known."""


def _naming(error: RequestRefused) -> str:
    """The refusal's text, starting with the field it is about."""
    return str(error) if str(error).startswith(error.param) else f"{error.param}: {error}"


def _calls_out(calls: tuple[ToolCall, ...] | list[ToolCall]) -> list[ToolCallOut]:
    return [ToolCallOut(id=call.id, name=call.name, arguments=call.arguments) for call in calls]


def _reply(turn_id: str, event: TurnResult | TurnFailed, started: StartedTurn) -> ChatDone | ErrorMessage:
    """The turn's last message: a reply with calls says its prose as content and its calls apart."""
    if isinstance(event, TurnFailed):
        return ErrorMessage(turn_id=turn_id, code=event.code, message=event.message,
                            retryable=event.code in ("conflict", "busy", "unavailable"))
    prose, calls = started.reply
    return ChatDone(
        turn_id=turn_id,
        finish_reason="tool_calls" if calls else "grammar_error" if event.finish_reason == "grammar" else
        event.finish_reason,
        content=prose,
        tool_calls=_calls_out(calls),
        usage=Usage(prompt_tokens=event.prompt_tokens, completion_tokens=event.completion_tokens,
                    cached_tokens=event.cached_tokens),
        timings=Timings(**{name: round(value, 3) for name, value in event.timings.items()}),
        cache=CacheReport(source=event.cache_source, miss_reason=event.miss_reason, cleared=event.cleared,
                          remote=event.remote, quantized=event.quantized),
        dropped_turns=event.dropped_turns,
        speculation=SpeculationReport(draft_tokens=event.draft_tokens, accepted_tokens=event.accepted_tokens),
    )
