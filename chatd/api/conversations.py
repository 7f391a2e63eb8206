"""Which session a stateless request continues: the conversation matching and branching every HTTP API shares.

A stateless client (OpenAI's chat completions, the Responses API without a stored response) sends the whole
conversation every time and no session id. The request is rendered to token ids and matched, through the
prefix index (in Redis when sessions are, so any worker finds any conversation), against the conversations of
the same key; the session whose cached ids it shares the most with is continued when the request extends it
exactly, and otherwise branched: a new session whose cache starts as a copy of the shared part. Either way only
the tokens after the reused prefix are prefilled. A reply the client resends carries the ids the model
generated for it wherever a session knows them (`_splice`), so that a re-tokenised reply does not break the
match.
"""

from __future__ import annotations

import asyncio
import hashlib
import json

from cache_store.lookup import common_prefix_length
from chatd.api.http_errors import ApiError
from chatd.api.tool_calling import ToolFormat, ToolSetup, format_for
from chatd.api.turn_errors import ErrorMessage
from chatd.api.turns import MOVED_ON, StartedTurn, TurnPlan, TurnRequest, TurnRunner
from chatd.config import Settings
from chatd.engine.engine import Engine
from chatd.engine.turn import TurnFailed, TurnResult
from chatd.model.prompt import PromptRenderer
from sessions import Message, Session, SessionStore, StoreUnavailable
from sessions.prefix_index import BLOCK
from sessions.shared_prefix_index import SharedPrefixIndex


class Conversations:
    """Finds, claims and starts the session of a request that carries its whole conversation."""

    def __init__(self, engine: Engine, sessions: SessionStore, settings: Settings, turns: TurnRunner,
                 index: SharedPrefixIndex):
        """`index` lives where sessions do (the server's choice): in Redis, every worker finds every conversation."""
        self.engine, self.sessions, self.settings, self.turns, self.index = engine, sessions, settings, turns, index
        self._renderer: PromptRenderer | None = None

    def tool_format(self) -> ToolFormat:
        """How the served model's template renders tools and how it writes calls."""
        return format_for(self.engine.loaded.tokenizer.chat_template)

    def render(self, system: str | None, history: list[Message], content: str | list[Message],
               setup: ToolSetup | None = None, add_generation_prompt: bool = True) -> list[int]:
        """The prompt's ids, as the engine renders the session's turn."""
        if self._renderer is None:
            self._renderer = PromptRenderer(self.engine.loaded.tokenizer)
        setup = setup or ToolSetup(self.tool_format())
        messages = Session("", system=system, messages=history).prompt_messages(content)
        return self._renderer.render(setup.engine_messages(messages), add_generation_prompt,
                                     tools=setup.template_tools())

    async def place(self, owner: str | None, system: str | None, history: list[Message], content: str | list[Message],
                    hint: str | None, setup: ToolSetup | None = None, cache_key: str | None = None
                    ) -> tuple[Session, list[int], bool]:
        """The session this request runs in, the request's plain prompt ids, and whether the session is one it
        continues: a candidate the request extends exactly, when no turn holds it and the prompt keeps its cache
        (`_keeps_cache`); otherwise a new one, branched from the candidate whose cache shares the longest token prefix
        with the prompt. (A session that holds the same messages but was asked with other tools shares only the start
        of the system prompt: continuing it would throw away the cache that a client switching tools on and off asks
        for again, while a branch keeps both.)"""
        plain_ids = self.render(system, history, content, setup)
        matches = []
        for session in await self._candidates(owner, plain_ids, hint, cache_key):
            spliced = _splice(history, session.messages)
            prompt_ids = plain_ids if spliced == history and _ids_of(spliced) == _ids_of(history) else \
                self.render(system, spliced, content, setup)
            if session.system == system and _same(session.messages, history) and \
                    _keeps_cache(session, common_prefix_length(session.token_ids, prompt_ids)) and \
                    not self.turns.is_claimed(session.session_id):
                return session, plain_ids, True  # (before rendering the candidates after it)
            matches.append((session, spliced, prompt_ids))
        return await self.branch(owner, system, history, plain_ids, matches), plain_ids, False

    async def branch(self, owner: str | None, system: str | None, history: list[Message], plain_ids: list[int],
                     matches: list[tuple[Session, list[Message], list[int]]]) -> Session:
        """A new session for `history`: its cache starts as a copy of the part it shares with the match (session,
        spliced history, prompt ids) that shares the most, when that is a block or more."""
        best, best_history, best_ids, shared = None, history, plain_ids, 0
        for session, spliced, prompt_ids in matches:
            if (reach := common_prefix_length(session.token_ids, prompt_ids)) > shared:
                best, best_history, best_ids, shared = session, spliced, prompt_ids, reach
        session = await self.sessions.create(system, owner=owner, messages=best_history)
        if best is not None and shared >= BLOCK:
            self.engine.fork_session(best.session_id, session.session_id, best_ids)
        return session

    async def place_text(self, owner: str | None, prompt_ids: list[int]) -> Session:
        """A new session for a text completion's prompt (no chat template), its cache a copy of the longest prefix
        it shares with one of the owner's sessions (a client resending its growing prompt prefills only what is
        new)."""
        candidates = await self._candidates(owner, prompt_ids, None)
        return await self.branch(owner, None, [], prompt_ids, [(session, [], prompt_ids) for session in candidates])

    async def branch_from(self, owner: str | None, system: str | None, history: list[Message],
                          content: str | list[Message], source: Session, setup: ToolSetup | None = None) -> Session:
        """A new session for `history` (its replies spliced with `source`'s ids), its cache a copy of the part it
        shares with `source`'s."""
        spliced = _splice(history, source.messages)
        prompt_ids = self.render(system, spliced, content, setup)
        return await self.branch(owner, system, history, prompt_ids, [(source, spliced, prompt_ids)])

    async def start(self, owner: str | None, client: str, system: str | None, history: list[Message],
                    content: list[Message], hint: str | None, plan: TurnPlan, turn_id: str, api: str,
                    cache_key: str | None = None) -> tuple[Session, StartedTurn]:
        """The request's session and its started turn: the session it continues, or a branch of its own when
        another turn holds it or another worker ran one of it meanwhile (an identical conversation elsewhere).
        An `ApiError` when it cannot start. `cache_key`: OpenAI's `prompt_cache_key`."""
        try:
            session, _, matched = await self.place(owner, system, history, content, hint, plan.setup, cache_key)
            started = await self.turns.start(TurnRequest(session.session_id, turn_id, owner, client, api, plan,
                                                         expected_version=session.version if matched else None))
            if isinstance(started, ErrorMessage) and started.code in MOVED_ON and matched:
                session = await self.branch_from(owner, system, history, content, session, plan.setup)
                started = await self.turns.start(TurnRequest(session.session_id, turn_id, owner, client, api, plan))
        except StoreUnavailable as error:
            raise ApiError(503, f"{error}; try again shortly", code="unavailable") from None
        if isinstance(started, ErrorMessage):
            raise ApiError.of(started)
        return session, started

    async def relay(self, owner: str | None, started: StartedTurn, cache_key: str | None = None
                    ) -> tuple[str | TurnResult, asyncio.Queue]:
        """Relay a started turn's events into a queue (the conversation it reaches indexed when it ends) and wait
        for the first: text, or the result. A turn that fails before its first token is an `ApiError` with its own
        status."""
        events: asyncio.Queue[str | TurnResult | TurnFailed] = asyncio.Queue()

        async def end(event: TurnResult | TurnFailed) -> None:
            await self.ended(owner, started.session.session_id, event, cache_key)
            await events.put(event)

        self.turns.forward(started, events.put, end)
        first = await events.get()
        if isinstance(first, TurnFailed):
            raise ApiError.of(first)
        return first, events

    @staticmethod
    async def result(first: str | TurnResult, events: asyncio.Queue) -> TurnResult:
        """The turn's result, once its text has come (a non-streamed reply); an `ApiError` when it failed."""
        while isinstance(first, str):  # the text comes whole with the result
            first = await events.get()
        if isinstance(first, TurnFailed):
            raise ApiError.of(first)
        return first

    async def ended(self, owner: str | None, session_id: str, event: TurnResult | TurnFailed,
                    cache_key: str | None = None) -> None:
        """A turn ended: index the conversation it reached, so that the next request that resends it finds it (and
        the next with its `prompt_cache_key` tries it first)."""
        if isinstance(event, TurnResult) and event.finish_reason != "cancelled":
            await self.index.add(owner, session_id, event.conversation_ids)
            if cache_key is not None:
                await self.index.note_cache_key(owner, cache_key, session_id)

    async def _candidates(self, owner: str | None, prompt_ids: list[int], hint: str | None,
                          cache_key: str | None = None) -> list[Session]:
        """The owner's sessions that may hold this conversation: the hinted one, the one its prompt cache key last
        ran in, then the index's matches, each verified against its real ids, longest shared prefix first (on a
        tie, in that order)."""
        keyed = await self.index.cache_key_session(owner, cache_key) if cache_key is not None else None
        found: list[Session] = []
        for session_id in [known for known in (hint, keyed) if known] + await self.index.candidates(owner, prompt_ids):
            session = await self.sessions.get(session_id)
            if session is None:
                await self.index.remove(session_id, owner, prompt_ids)
            elif session.owner == owner and all(s.session_id != session_id for s in found):
                found.append(session)
        found.sort(key=lambda s: common_prefix_length(s.token_ids, prompt_ids), reverse=True)
        return found


def _keeps_cache(session: Session, shared: int) -> bool:
    """Whether a prompt that shares `shared` tokens with the session's cache keeps all of it but its last reply (which
    a template may render otherwise once it is history) and a block's worth of ending tokens."""
    last = session.messages[-1] if session.messages else None
    reply = len(last.token_ids or ()) if last is not None and last.role == "assistant" else 0
    return shared + reply + BLOCK >= len(session.token_ids)


def _splice(sent: list[Message], stored: list[Message]) -> list[Message]:
    """`sent`, with each reply that `stored` holds at the same place with the same text and calls carrying
    the ids the model generated for it."""
    return [known if index < len(stored) and (known := stored[index]).token_ids is not None
            and _key(known) == _key(message) else message
            for index, message in enumerate(sent)]


def _key(message: Message) -> tuple:
    """What makes two messages the same for a client that resends them: role, text, calls (arguments compared as
    JSON, as clients re-serialize them) and the call a result answers; never the ids the model generated."""
    return (message.role, message.content, tuple((call.name, _normal(call.arguments)) for call in message.tool_calls),
            message.tool_call_id)


def _normal(arguments: str) -> str:
    try:
        return json.dumps(json.loads(arguments), sort_keys=True)
    except ValueError:
        return arguments


def _ids_of(messages: list[Message]) -> list[tuple[int, ...] | None]:
    return [message.token_ids for message in messages]


def _same(stored: list[Message], sent: list[Message]) -> bool:
    return [_key(m) for m in stored] == [_key(m) for m in sent]


def salted(owner: str | None, cache_salt: str | None) -> str | None:
    """The owner a request's conversations and caches belong to: its key's, or, with a `cache_salt` (vLLM's
    field), a scope of that key for the salt alone, so that requests of one key with different salts never share a
    session, a prefix match or a cache on any tier or worker. The salt itself is never stored."""
    if cache_salt is None:
        return owner
    return f"{owner or '*'}#salt:{hashlib.sha256(cache_salt.encode()).hexdigest()[:32]}"
