"""The life of a turn, shared by every API (the websocket gateway, chat completions, Responses over HTTP and its
WebSocket mode, Messages): one way it starts (`TurnRunner.start`: one turn per session, claimed before the first
await, the rate limit, the session's lease and a fresh read, the version check, the engine), the relay of its events
in a task of its own, recording the completed turn, and the drain at shutdown."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from chatd.api.rate_limit import RateLimiter
from chatd.api.tool_calling import ToolSetup
from chatd.api.turn_errors import ErrorMessage
from chatd.config import Settings
from chatd.engine.engine import Engine
from chatd.engine.sampling import SamplingParams
from chatd.engine.turn import TokenText, Turn, TurnEvent, TurnFailed, TurnResult
from sessions import (
    Lease,
    Message,
    Session,
    SessionBusy,
    SessionStore,
    StoreUnavailable,
    ToolCall,
    VersionConflict,
    as_inputs,
)

log = logging.getLogger(__name__)
# Why a matched session cannot take a request's turn, so that the request branches from it instead: a turn holds it,
# another worker moved it on, or it is gone.
MOVED_ON = ("busy", "conflict", "unknown_session")
SHARE_WAIT_S = 2.0  # at most this long a reply waits for its cache to reach Redis (--remote-kv)


@dataclass
class StartedTurn:
    """A turn the engine has: what its forwarder needs to relay it and record it."""

    turn: Turn
    session: Session
    inputs: list[Message]  # the turn's new messages, recorded with the reply
    events: asyncio.Queue[TurnEvent]
    lease: Lease
    setup: ToolSetup | None = None  # how the model sees tools and how the reply is read
    parse: Callable[[str], tuple[str, list[ToolCall]]] = lambda text: (text, [])  # the reply's prose and calls
    reply: tuple[str, list[ToolCall]] = ("", [])  # as recorded: prose and calls (with their ids)


@dataclass
class TurnPlan:
    """What a turn runs: its new input, how it samples, how the model sees tools and how its reply is read, how long
    its cache stays resident ahead of plain LRU (an Anthropic breakpoint's ttl, OpenAI's prompt cache ttl), and
    whether it samples at all (without `generate`, a warm-up: the prompt prefilled into the session's cache and
    recorded)."""

    new: str | Sequence[Message]
    params: SamplingParams
    setup: ToolSetup | None = None
    keep_for_s: float | None = None
    generate: bool = True
    truncate: bool = True  # False: a conversation over the context is refused, not shortened
    raw: bool = False  # a text completion: `new` is the prompt's text, no chat template


@dataclass
class TurnRequest:
    """A turn asked of a session: `owner` is whose caches it reads and writes (a key, or its `cache_salt`'s scope),
    `client` whose rate limit it counts against. `plan` is fixed, or made from the session as the lease reads it
    (the websocket's turn depends on the session's tools). With `expected_version`, a session another worker moved
    past it is `conflict`: a stateless request matched it at that version and must run on exactly that history."""

    session_id: str
    turn_id: str
    owner: str | None
    client: str
    api: str
    plan: TurnPlan | Callable[[Session], Awaitable[TurnPlan | ErrorMessage]]
    expected_version: int | None = None


class TurnRunner:
    """`on_request` sees the API of every turn started and `on_turn` every finished turn, for metrics."""

    def __init__(self, engine: Engine, store: SessionStore, settings: Settings,
                 on_turn: Callable[[TurnResult], None] = lambda result: None,
                 on_request: Callable[[str], None] = lambda api: None):
        self.engine, self.store, self.settings = engine, store, settings
        self.rate_limit = RateLimiter(settings.rate_limit_per_min)
        self.draining = False
        self._on_turn, self._on_request = on_turn, on_request
        self._claims: set[str] = set()  # sessions a turn holds, from before its first await: one turn per session
        self._turns: dict[str, Turn] = {}  # session id -> its turn in the engine
        self._forwarders: set[asyncio.Task] = set()
        self._cut_by_shutdown: set[str] = set()  # sessions whose turn the drain cancelled: told to send it again

    @property
    def running_turns(self) -> list[Turn]:
        return list(self._turns.values())

    def turn_of(self, session_id: str) -> Turn | None:
        """The session's turn in the engine, if it has one."""
        return self._turns.get(session_id)

    def is_claimed(self, session_id: str) -> bool:
        """Whether a turn holds the session now (a request choosing among sessions passes over a claimed one)."""
        return session_id in self._claims

    async def start(self, request: TurnRequest) -> StartedTurn | ErrorMessage:
        """The one way a turn starts, for every API: the session claimed (one turn per session, before the first
        await), the client's rate limit, the session's lease and a fresh copy of the session read with it, the
        version the request was matched at, the plan made against that copy, then the engine; or why not. The claim
        and the lease are released here when the turn does not start, and by its forwarder when it does."""
        session_id = request.session_id
        if self.draining:
            return _shutting_down(request.turn_id)
        if session_id in self._claims:
            return ErrorMessage(turn_id=request.turn_id, code="busy", retryable=True,
                                message=f"session {session_id} is already running a turn")
        self._claims.add(session_id)
        lease: Lease | None = None
        outcome: StartedTurn | ErrorMessage | None = None
        try:
            outcome = self._over_rate_limit(request)
            if outcome is None:
                try:
                    lease = await self.store.lease(session_id)
                except SessionBusy as error:
                    outcome = ErrorMessage(turn_id=request.turn_id, code="busy", retryable=True, message=str(error))
            if lease is not None:
                outcome = await self._submit(request, lease, lease.session or await self.store.get(session_id))
        finally:
            if not isinstance(outcome, StartedTurn):
                if lease is not None:
                    await lease.release()
                self._claims.discard(session_id)
        return outcome

    def _over_rate_limit(self, request: TurnRequest) -> ErrorMessage | None:
        if (wait := self.rate_limit.acquire(request.client)) is None:
            return None
        return ErrorMessage(turn_id=request.turn_id, code="rate_limited", retryable=True,
                            retry_after_s=round(wait, 2), message=f"over {self.settings.rate_limit_per_min:g} turns "
                                                                  f"per minute; retry in {wait:.1f} s")

    async def _submit(self, request: TurnRequest, lease: Lease, session: Session | None
                      ) -> StartedTurn | ErrorMessage:
        """The leased session's turn into the engine, or why not: the session gone, moved past the version the
        request was matched at (another worker's turn: it must run on exactly that history), the plan refused, or
        the shutdown begun while the store answered."""
        turn_id = request.turn_id
        if session is None:
            return ErrorMessage(turn_id=turn_id, code="unknown_session", message=f"no session {request.session_id!r}")
        if request.expected_version is not None and session.version != request.expected_version:
            return ErrorMessage(turn_id=turn_id, code="conflict", retryable=True,
                                message="another worker completed a turn of this session meanwhile")
        plan = request.plan if isinstance(request.plan, TurnPlan) else await request.plan(session)
        if isinstance(plan, ErrorMessage):
            return plan
        if self.draining:
            return _shutting_down(turn_id)
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[TurnEvent] = asyncio.Queue()
        tools = plan.setup
        turn = Turn(
            turn_id=turn_id,
            session_id=session.session_id,
            messages=tools.engine_messages(session.prompt_messages(plan.new)) if tools else
            session.prompt_messages(plan.new),
            params=plan.params,
            owner=request.owner,
            tools=tools.template_tools() if tools else None,
            emit=lambda event: loop.call_soon_threadsafe(events.put_nowait, event),
            session_version=session.version,
            dropped_turns=session.dropped_turns,
            keep_for_s=plan.keep_for_s,
            generate=plan.generate,
            truncate=plan.truncate,
            raw=plan.raw,
            call_trigger=tools.call_trigger if tools else None,
        )
        self._turns[session.session_id] = turn
        self._on_request(request.api)
        self.engine.submit(turn)
        started = StartedTurn(turn, session, as_inputs(plan.new), events, lease, tools)
        if tools is not None:
            started.parse = tools.parse
        return started

    def forward(self, started: StartedTurn, on_text: Callable[[str], Awaitable[None]],
                on_end: Callable[[TurnResult | TurnFailed], Awaitable[None]]) -> None:
        """Relay a started turn's events in a task of their own (so that a slow or gone client never
        holds the session), record the turn when it completes, and free the session."""
        task = asyncio.create_task(self._forward(started, on_text, on_end))
        self._forwarders.add(task)
        task.add_done_callback(self._forwarders.discard)

    async def _forward(self, started: StartedTurn, on_text: Callable[[str], Awaitable[None]],
                       on_end: Callable[[TurnResult | TurnFailed], Awaitable[None]]) -> None:
        session_id = started.session.session_id
        try:
            while isinstance(event := await started.events.get(), TokenText):
                await on_text(event.text)
            if isinstance(event, TurnResult) and event.finish_reason == "cancelled" \
                    and session_id in self._cut_by_shutdown:
                event = TurnFailed("unavailable", "the server shut down before this reply finished (nothing of it "
                                                  "was recorded); send the message again")
            if isinstance(event, TurnResult):
                self._on_turn(event)
                started.reply = started.parse(event.content)  # (a cancelled reply is read too: as far as it got)
                if event.finish_reason != "cancelled":
                    event = await self._record(started, event)
                if isinstance(event, TurnResult) and self.settings.remote_kv:
                    # (the lease goes while the cache reaches Redis: the client hears of its turn after both)
                    await asyncio.gather(self._await_shared(session_id), started.lease.release())
        finally:
            # Free the session before the reply goes out, so the client's next request is never `busy`.
            del self._turns[session_id]
            self._claims.discard(session_id)
            await started.lease.release()
        try:
            await on_end(event)
        except Exception:  # (a reply that cannot be put in its API's shape: the client still hears of its turn)
            log.exception("answering the end of turn %s of session %s failed", started.turn.turn_id, session_id)
            await on_end(TurnFailed("internal", "the end of this reply could not be sent; send the message again"))

    async def _await_shared(self, session_id: str) -> None:
        """Answer once the turn's cache is in Redis: a stateless client's next request may reach another
        worker at once, and it should continue from this cache rather than recompute it."""
        if not await asyncio.to_thread(self.engine.wait_shared, session_id, SHARE_WAIT_S):
            log.warning("session %s: its cache was not in Redis within %.0f s; answering anyway (another worker "
                        "would recompute it)", session_id, SHARE_WAIT_S)

    async def _record(self, started: StartedTurn, result: TurnResult) -> TurnResult | TurnFailed:
        """Append the completed turn to the session; what the client is told if that fails."""
        session, (content, calls) = started.session, started.reply
        reply = None if result.finish_reason == "prefilled" else content  # (a warm-up adds its input alone)
        # The reply's ids say what the model wrote; a reply recorded as less (its prose, a call cut by the token
        # limit dropped) is rendered from its text next time, as the client that holds it sends it back.
        reply_ids = result.reply_ids if calls or content == result.content else None
        try:
            await self.store.append_turn(session, started.inputs, reply, result.conversation_ids, started.lease,
                                         dropped_turns=result.dropped_turns, reply_ids=reply_ids, tool_calls=calls)
        except VersionConflict:  # (Redis's copy of that version may be the other worker's: it stays)
            self.engine.drop_cache(session.session_id)
            return TurnFailed("conflict", "another worker recorded a turn of this session first; "
                                          "this reply was not recorded")
        except StoreUnavailable:  # (only where turns wait for replicas: otherwise a turn is queued in this worker)
            # (in Redis: the copy its write-back made, never a later one)
            self.engine.drop_cache(session.session_id, started.turn.session_version + 1)
            return TurnFailed("unavailable", "the session store (Redis) could not record this reply; send the "
                                             "message again shortly")
        except Exception:
            log.exception("recording a turn of session %s failed", session.session_id)
            self.engine.drop_cache(session.session_id, started.turn.session_version + 1)
            return TurnFailed("internal", "the reply could not be recorded in the session; send the message again")
        return result

    async def drain(self, timeout_s: float) -> int:
        """Refuse new turns, let running ones finish for up to `timeout_s`, then cancel the rest (their clients are
        told to send the message again: `unavailable`, retryable) and wait for them to stop. Returns how many were
        cancelled."""
        self.draining = True
        deadline = asyncio.get_running_loop().time() + timeout_s
        while self._forwarders and asyncio.get_running_loop().time() < deadline:
            await asyncio.wait(set(self._forwarders), timeout=max(0.0, deadline - asyncio.get_running_loop().time()))
        late = list(self._turns.values())
        self._cut_by_shutdown.update(self._turns)
        for turn in late:
            turn.cancel()
        if self._forwarders:
            await asyncio.wait(set(self._forwarders))
        return len(late)


def _shutting_down(turn_id: str) -> ErrorMessage:
    return ErrorMessage(turn_id=turn_id, code="unavailable", retryable=True,
                        message="the server is shutting down; reconnect and send the message again")
