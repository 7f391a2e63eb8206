"""How sessions and their caches are laid out in Redis, in one place: the key scheme (one hash tag per
session, so that a session's keys live on one Redis Cluster slot; one per block of the prefix index), the
encoding of token ids and block hashes, and the errors that mean Redis cannot be reached. Used by the
session store, the prefix index and the remote KV tier."""

from __future__ import annotations

from array import array
from collections.abc import Sequence

from redis.exceptions import ClusterDownError, RedisClusterUnreachableError, SlotNotCoveredError, TryAgainError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

# Redis (or, on a cluster, the node holding a key) cannot answer now: down, out of reach, or failing over.
UNREACHABLE = (RedisConnectionError, RedisTimeoutError, OSError, ClusterDownError, TryAgainError, SlotNotCoveredError,
               RedisClusterUnreachableError)


def redis_key(session_id: str, part: str) -> str:
    """The Redis key of one part of a session (meta, messages, tokens, lease, fence, kv, kvmeta)."""
    return f"chatd:{{{session_id}}}:{part}"


def prefix_block_key(chained: int) -> str:
    """The set of sessions whose conversation reaches the block with this chained hash (the shared prefix
    index): a hash tag of its own, so that the index spreads over a Redis Cluster."""
    return f"chatd:prefix:{{{chained:016x}}}"


def pack_hashes(hashes: Sequence[int]) -> bytes:
    """Chained block hashes as little-endian uint64."""
    return array("Q", hashes).tobytes()


def unpack_hashes(packed: bytes | None) -> list[int]:
    """The hashes `pack_hashes` wrote."""
    hashes = array("Q")
    hashes.frombytes(packed or b"")
    return hashes.tolist()


def pack_ids(token_ids: Sequence[int]) -> bytes:
    """Token ids as little-endian int32: 4 bytes each, not a JSON list."""
    return array("i", token_ids).tobytes()


def unpack_ids(packed: bytes | None) -> list[int]:
    """The token ids `pack_ids` wrote."""
    ids = array("i")
    ids.frombytes(packed or b"")
    return ids.tolist()
