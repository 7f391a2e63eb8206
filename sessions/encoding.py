"""How sessions and their caches are laid out in Redis, in one place: the key scheme (one hash tag per
session, so that a session's keys live on one Redis Cluster slot), the encoding of token ids, and the
errors that mean Redis cannot be reached. Used by the session store and the remote KV tier."""

from __future__ import annotations

from array import array
from collections.abc import Sequence

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

UNREACHABLE = (RedisConnectionError, RedisTimeoutError, OSError)


def redis_key(session_id: str, part: str) -> str:
    """The Redis key of one part of a session (meta, messages, tokens, lease, fence, kv, kvmeta)."""
    return f"chatd:{{{session_id}}}:{part}"


def pack_ids(token_ids: Sequence[int]) -> bytes:
    """Token ids as little-endian int32: 4 bytes each, not a JSON list."""
    return array("i", token_ids).tobytes()


def unpack_ids(packed: bytes | None) -> list[int]:
    """The token ids `pack_ids` wrote."""
    ids = array("i")
    ids.frombytes(packed or b"")
    return ids.tolist()
