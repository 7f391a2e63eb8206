"""The life of a turn, shared by the websocket gateway and the OpenAI-compatible API: one turn per
session (claimed before the first await), the rate limit, the session's lease, the engine, the relay of
its events in a task of its own, recording the completed turn, and the drain at shutdown."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from chatd.api.rate_limit import RateLimiter
from chatd.api.turn_errors import ErrorMessage
from chatd.config import Settings
from chatd.engine.sampling import SamplingParams
from chatd.engine.scheduler import Engine
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
SHARE_WAIT_S = 2.0  # at most this long a reply waits for its cache to reach Redis (--remote-kv)


@dataclass
class StartedTurn:
    """A turn the engine has: what its forwarder needs to relay it and record it."""

    turn: Turn
    session: Session
    inputs: list[Message]  # the turn's new messages, recorded with the reply
    events: asyncio.Queue[TurnEvent]
    lease: Lease
    parse: Callable[[str], tuple[str, list[ToolCall]]] = lambda text: (text, [])  # the reply's prose and calls
    reply: tuple[str, list[ToolCall]] = ("", [])  # as recorded: prose and calls (with their ids)


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
        return session_id in self._claims

    def try_claim(self, session_id: str) -> bool:
        """Claim the session for one turn (synchronously: nothing can interleave); False if it has one."""
        if session_id in self._claims:
            return False
        self._claims.add(session_id)
        return True

    def release_claim(self, session_id: str) -> None:
        self._claims.discard(session_id)

    async def take_lease(self, session_id: str, turn_id: str, client: str
                         ) -> tuple[Lease, Session | None] | ErrorMessage:
        """The rate limit, then the session's lease and the session as read with it (fresh: another worker may have
        written; None if it does not exist), or why not."""
        if (wait := self.rate_limit.acquire(client)) is not None:
            return ErrorMessage(turn_id=turn_id, code="rate_limited", retryable=True, retry_after_s=round(wait, 2),
                                message=f"over {self.settings.rate_limit_per_min:g} turns per minute; "
                                        f"retry in {wait:.1f} s")
        try:
            lease = await self.store.lease(session_id)
        except SessionBusy as error:
            return ErrorMessage(turn_id=turn_id, code="busy", retryable=True, message=str(error))
        try:
            return lease, lease.session or await self.store.get(session_id)
        except BaseException:
            await lease.release()
            raise

    async def begin_turn(self, session: Session, new: str | Sequence[Message], params: SamplingParams, turn_id: str,
                         owner: str | None, client: str, api: str = "websocket",
                         expected_version: int | None = None, tools=None,
                         keep_for_s: float | None = None, lease: Lease | None = None,
                         generate: bool = True) -> StartedTurn | ErrorMessage:
        """Start a turn of a claimed session in the engine (rate limit, lease, a fresh copy of the
        session), or say why not. Shared by the websocket and the OpenAI-compatible API. With
        `expected_version`, a session that another worker moved past it is `conflict` (a stateless request
        matched it at that version, and must run on exactly that history). `tools` (a `ToolSetup`) says how
        the model sees the tools and how its reply is read; `keep_for_s`, how long its cache stays resident ahead of
        plain LRU (an Anthropic cache breakpoint's ttl). With `lease` (from `take_lease`), `session` is the copy read
        with it. Without `generate`, a warm-up: the prompt is prefilled into the session's cache and recorded."""
        if lease is None:
            leased = await self.take_lease(session.session_id, turn_id, client)
            if isinstance(leased, ErrorMessage):
                return leased
            lease, session = leased[0], leased[1] or session
        if expected_version is not None and session.version != expected_version:
            await lease.release()
            return ErrorMessage(turn_id=turn_id, code="conflict", retryable=True,
                                message="another worker completed a turn of this session meanwhile")
        if self.draining:  # the shutdown began while the store answered
            await lease.release()
            return ErrorMessage(turn_id=turn_id, code="unavailable", retryable=True,
                                message="the server is shutting down; reconnect and send the message again")
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[TurnEvent] = asyncio.Queue()
        turn = Turn(
            turn_id=turn_id,
            session_id=session.session_id,
            messages=tools.engine_messages(session.prompt_messages(new)) if tools else session.prompt_messages(new),
            params=params,
            owner=owner,
            tools=tools.template_tools() if tools else None,
            emit=lambda event: loop.call_soon_threadsafe(events.put_nowait, event),
            session_version=session.version,
            dropped_turns=session.dropped_turns,
            keep_for_s=keep_for_s,
            generate=generate,
            call_trigger=tools.call_trigger if tools else None,
        )
        self._turns[session.session_id] = turn
        self._on_request(api)
        self.engine.submit(turn)
        started = StartedTurn(turn, session, as_inputs(new), events, lease)
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
                if event.finish_reason != "cancelled":
                    started.reply = started.parse(event.content)
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
        try:
            await self.store.append_turn(session, started.inputs, reply, result.conversation_ids, started.lease,
                                         dropped_turns=result.dropped_turns, reply_ids=result.reply_ids,
                                         tool_calls=calls)
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
