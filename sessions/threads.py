"""Anthropic message threads as points in chatd sessions.

A thread's reply is held under its message id: the session it was recorded in, the session's version and message
count right after it, what the thread was created with (its system prompt and tools, which a `continue` does not
resend), and whose it is. Each reply can be continued once: `claim` moves it from open to running atomically (one
turn per reply across workers; the same round trip reads the reply, for its own key and scope only), `settle` to
continued when that turn's reply is held, or back to open when it was not (a failed or cut turn leaves the id
usable); a claim is leased, renewed while its turn runs, so that one whose worker died ends. In memory, or in
Redis (`chatd:thread:{<id>}` and its `:state`, one hash tag) for the thread TTL, renewed when a reply is continued,
so that any worker continues any thread and a restart loses none.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from typing import Literal, Protocol

from cachetools import TTLCache

from sessions import redis_scripts as scripts
from sessions.redis_store import RedisSessionStore

LOCAL_THREADS = 100_000  # the in-memory store forgets the oldest beyond this many replies
CLAIM_LEASE_S = 30.0  # a claim not renewed for this long (its worker died) ends: the reply may be continued again
Claim = Literal["claimed", "not_found", "continued", "in_flight"]


@dataclass
class ThreadReply:
    """A reply a thread may continue from."""

    message_id: str
    owner: str | None  # the API key's id
    scope: str | None  # whose sessions and caches (the key's, or its cache_salt's)
    session_id: str
    version: int  # the session's version once this reply was recorded
    messages: int  # the session's message count then
    model: str
    system: str | None  # what the thread was created with
    tools: list[dict] | None


class ThreadStore(Protocol):
    """Where thread replies are held: this process, or Redis."""

    ttl_s: float
    lease_s: float  # a claim not renewed for this long ends

    async def put(self, reply: ThreadReply) -> None: ...

    async def claim(self, message_id: str, owner: str | None, scope: str | None
                    ) -> tuple[Claim, ThreadReply | None]: ...

    async def settle(self, message_id: str, continued: bool) -> None: ...

    async def renew(self, message_id: str) -> None:
        """The claim's turn is still running: its lease starts again."""


class InMemoryThreadStore:
    """Thread replies in this process, each kept for the TTL after it was held or last continued."""

    def __init__(self, ttl_s: float, clock=time.monotonic):
        self.ttl_s, self.lease_s = ttl_s, CLAIM_LEASE_S  # (a claim here dies with its process)
        self._replies: TTLCache[str, ThreadReply] = TTLCache(LOCAL_THREADS, ttl_s, timer=clock)
        self._states: TTLCache[str, str] = TTLCache(LOCAL_THREADS, ttl_s, timer=clock)

    async def put(self, reply: ThreadReply) -> None:
        self._replies[reply.message_id] = reply

    async def claim(self, message_id: str, owner: str | None, scope: str | None
                    ) -> tuple[Claim, ThreadReply | None]:
        reply = self._replies.get(message_id)
        if reply is None or reply.owner != owner or reply.scope != scope:
            return "not_found", None
        state = self._states.get(message_id)
        if state is not None:
            return ("continued" if state == "continued" else "in_flight"), None
        self._states[message_id] = "running"
        return "claimed", reply

    async def settle(self, message_id: str, continued: bool) -> None:
        if continued:
            self._states[message_id] = "continued"
            if (reply := self._replies.get(message_id)) is not None:
                self._replies[message_id] = reply  # (the thread was used: its TTL starts again)
        else:
            self._states.pop(message_id, None)

    async def renew(self, message_id: str) -> None:
        return None  # (a claim here dies with its process, which holds every claim)


# KEYS: the reply, its state. ARGV: the claim's lease in ms, then owner and scope, each as its text and '1' when it is
# None. Open -> running (for the lease, renewed while the turn runs: a worker that dies lets it go), atomically, for
# the reply's own key and scope only (another's is not found, and left alone): {'claimed', the reply}, or what it
# found.
_CLAIM = """
local raw = redis.call('GET', KEYS[1])
if not raw then return {'not_found'} end
local reply = cjson.decode(raw)
local function same(value, text, none)
  if none == '1' then return value == cjson.null end
  return value == text
end
if not same(reply['owner'], ARGV[2], ARGV[3]) or not same(reply['scope'], ARGV[4], ARGV[5]) then
  return {'not_found'}
end
local state = redis.call('GET', KEYS[2])
if state == 'continued' then return {'continued'} end
if state then return {'in_flight'} end
redis.call('SET', KEYS[2], 'running', 'PX', ARGV[1])
return {'claimed', raw}
"""
# KEYS: the reply, its state. ARGV: the TTL in ms. Continued: said so, and the reply kept the TTL again.
_CONTINUED = """
redis.call('SET', KEYS[2], 'continued', 'PX', ARGV[1])
redis.call('PEXPIRE', KEYS[1], ARGV[1])
return 'ok'
"""


class RedisThreadStore:
    """Thread replies in Redis, shared by every worker and kept across restarts; written as the sessions' turns are
    (acknowledged once replicas hold them, where the session store waits for replicas)."""

    def __init__(self, sessions: RedisSessionStore, ttl_s: float, lease_s: float = CLAIM_LEASE_S):
        self.ttl_s, self.lease_s = ttl_s, lease_s
        self._sessions, self._redis, self._ttl_ms = sessions, sessions.client, max(1000, int(ttl_s * 1000))

    async def put(self, reply: ThreadReply) -> None:
        key = _reply_key(reply.message_id)
        await self._call(self._sessions.write(key, ("SET", key, json.dumps(asdict(reply)), "PX", self._ttl_ms)))

    async def claim(self, message_id: str, owner: str | None, scope: str | None
                    ) -> tuple[Claim, ThreadReply | None]:
        """One script; acknowledged once replicas hold it where the session store waits for replicas."""
        if "{" in message_id or "}" in message_id:
            return "not_found", None  # (never an id chatd made; its keys' hash tags would name two cluster slots)
        key = _reply_key(message_id)
        found = await self._call(self._sessions.write(key, (
            "EVAL", _CLAIM, 2, key, _state_key(message_id), int(self.lease_s * 1000),
            owner or "", "1" if owner is None else "0", scope or "", "1" if scope is None else "0")))
        claim = found[0].decode() if isinstance(found[0], bytes) else found[0]
        return claim, ThreadReply(**json.loads(found[1])) if claim == "claimed" else None

    async def settle(self, message_id: str, continued: bool) -> None:
        key, state = _reply_key(message_id), _state_key(message_id)
        if continued:
            await self._call(self._sessions.write(key, ("EVAL", _CONTINUED, 2, key, state, self._ttl_ms)))
        else:
            await self._call(self._sessions.write(key, ("DEL", state)))

    async def renew(self, message_id: str) -> None:
        state = _state_key(message_id)
        # (the session lease's script: a running claim's lease starts again, a settled one is left alone)
        await self._call(self._redis.eval(scripts.RENEW, 1, state, "running", int(self.lease_s * 1000)))

    def _call(self, command):
        return self._sessions.beside(command, "thread")


def _reply_key(message_id: str) -> str:
    return f"chatd:thread:{{{message_id}}}"


def _state_key(message_id: str) -> str:
    return f"chatd:thread:{{{message_id}}}:state"
