"""Stored responses and conversations of the Responses API, as points in chatd sessions.

A stored response names its session and where in it the response ended (the session's version and
message count after it), so that `previous_response_id` continues the session when that is its latest
point and branches from it otherwise. A conversation is a session; what the Conversations API adds
(its metadata, its creation time) is kept beside it. Each output item's id names the response that made it, so that
a client that refers to an earlier reply by its id (`item_reference`, as the AI SDK does) is answered with it. In
memory, or in Redis (`chatd:response:{<id>}`, `chatd:response_item:{<item id>}`, `chatd:{<session id>}:conversation`,
one hash tag each) with the sessions' retention TTL, so that responses survive restarts and every worker sees them.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from typing import Protocol

from cachetools import LRUCache

from sessions.encoding import redis_key
from sessions.redis_store import RedisSessionStore

LOCAL_RESPONSES = 100_000  # the in-memory store forgets the oldest beyond this many


@dataclass
class StoredResponse:
    """A response as `GET /v1/responses/{id}` returns it, and its point in its session."""

    response_id: str
    owner: str | None
    session_id: str
    version: int  # the session's version once this response was recorded
    messages: int  # the session's message count then
    body: dict  # the response object
    input: list[dict] = field(default_factory=list)  # the input items: {"role", "content"}


@dataclass
class ConversationInfo:
    """What the Conversations API keeps of a conversation beyond its session."""

    conversation_id: str
    owner: str | None
    created_at: int
    metadata: dict[str, str] = field(default_factory=dict)


class ResponseStore(Protocol):
    """Where responses and conversations are kept: this process, or Redis."""

    async def put(self, response: StoredResponse) -> None: ...

    async def get(self, response_id: str) -> StoredResponse | None: ...

    async def find_item(self, item_id: str) -> StoredResponse | None:
        """The stored response whose output holds the item `item_id`."""

    async def delete(self, response_id: str) -> bool: ...

    async def put_conversation(self, conversation: ConversationInfo) -> None: ...

    async def get_conversation(self, conversation_id: str) -> ConversationInfo | None: ...

    async def delete_conversation(self, conversation_id: str) -> bool: ...


class InMemoryResponseStore:
    """Responses and conversations in this process, kept for the sessions' retention."""

    def __init__(self, retention_s: float, clock=time.monotonic):
        self.retention_s, self._clock = retention_s, clock
        self._responses: LRUCache[str, tuple[float, StoredResponse]] = LRUCache(LOCAL_RESPONSES)
        self._conversations: dict[str, ConversationInfo] = {}
        self._items: LRUCache[str, str] = LRUCache(4 * LOCAL_RESPONSES)  # output item id -> response id

    async def put(self, response: StoredResponse) -> None:
        self._responses[response.response_id] = (self._clock(), response)
        for item_id in output_item_ids(response):
            self._items[item_id] = response.response_id

    async def find_item(self, item_id: str) -> StoredResponse | None:
        response_id = self._items.get(item_id)
        return await self.get(response_id) if response_id is not None else None

    async def get(self, response_id: str) -> StoredResponse | None:
        kept = self._responses.get(response_id)
        if kept is None or self._clock() - kept[0] > self.retention_s:
            self._responses.pop(response_id, None)
            return None
        return kept[1]

    async def delete(self, response_id: str) -> bool:
        return self._responses.pop(response_id, None) is not None

    async def put_conversation(self, conversation: ConversationInfo) -> None:
        self._conversations[conversation.conversation_id] = conversation

    async def get_conversation(self, conversation_id: str) -> ConversationInfo | None:
        return self._conversations.get(conversation_id)

    async def delete_conversation(self, conversation_id: str) -> bool:
        return self._conversations.pop(conversation_id, None) is not None


class RedisResponseStore:
    """Responses and conversations in Redis, shared by every worker and kept across restarts; written as the
    sessions' turns are (acknowledged once replicas hold them, where the session store waits for replicas)."""

    def __init__(self, sessions: RedisSessionStore, retention_s: float):
        self._sessions, self._redis, self._ttl_s = sessions, sessions.client, max(1, int(retention_s))

    async def put(self, response: StoredResponse) -> None:
        key = _response_key(response.response_id)
        await self._call(self._sessions.write(key, ("SET", key, json.dumps(asdict(response)), "EX", self._ttl_s)))
        for item_id in output_item_ids(response):
            item_key = _item_key(item_id)
            await self._call(self._sessions.write(item_key, ("SET", item_key, response.response_id, "EX",
                                                             self._ttl_s)))

    async def get(self, response_id: str) -> StoredResponse | None:
        raw = await self._call(self._redis.get(_response_key(response_id)))
        return StoredResponse(**json.loads(raw)) if raw is not None else None

    async def find_item(self, item_id: str) -> StoredResponse | None:
        raw = await self._call(self._redis.get(_item_key(item_id)))
        return await self.get(raw.decode()) if raw is not None else None

    async def delete(self, response_id: str) -> bool:
        return bool(await self._call(self._redis.delete(_response_key(response_id))))

    async def put_conversation(self, conversation: ConversationInfo) -> None:
        key = redis_key(conversation.conversation_id, "conversation")
        await self._call(self._sessions.write(key, ("SET", key, json.dumps(asdict(conversation)), "EX", self._ttl_s)))

    async def get_conversation(self, conversation_id: str) -> ConversationInfo | None:
        raw = await self._call(self._redis.get(redis_key(conversation_id, "conversation")))
        return ConversationInfo(**json.loads(raw)) if raw is not None else None

    async def delete_conversation(self, conversation_id: str) -> bool:
        return bool(await self._call(self._redis.delete(redis_key(conversation_id, "conversation"))))

    def _call(self, command):
        return self._sessions.beside(command, "response")


def _response_key(response_id: str) -> str:
    return f"chatd:response:{{{response_id}}}"


def _item_key(item_id: str) -> str:
    return f"chatd:response_item:{{{item_id}}}"


def output_item_ids(response: StoredResponse) -> list[str]:
    """The ids of a response's output items, by which a later request may refer to them."""
    return [item["id"] for item in response.body.get("output", []) if isinstance(item.get("id"), str)]
