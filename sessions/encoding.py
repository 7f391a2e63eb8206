"""How sessions and their caches are laid out in Redis, in one place: the key scheme (one hash tag per
session, so that a session's keys live on one Redis Cluster slot; one per block of the prefix index), the
encoding of token ids, the one hash of token ids (every index of them: segments, chunks, the prefix index, the
checks), and the errors that mean Redis cannot be reached. Used by the session store, the prefix index and the
cache tiers."""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import xxhash
from redis.exceptions import ClusterDownError, RedisClusterUnreachableError, SlotNotCoveredError, TryAgainError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

# Redis (or, on a cluster, the node holding a key) cannot answer now: down, out of reach, or failing over.
UNREACHABLE = (RedisConnectionError, RedisTimeoutError, OSError, ClusterDownError, TryAgainError, SlotNotCoveredError,
               RedisClusterUnreachableError)


def redis_key(session_id: str, part: str) -> str:
    """The Redis key of one part of a session (meta, messages, tokens, lease, fence, kv, kvmeta)."""
    return f"chatd:{{{session_id}}}:{part}"


def prefix_block_key(chained: str) -> str:
    """The set of sessions whose conversation reaches the block with this chained hash (the shared prefix
    index): a hash tag of its own, so that the index spreads over a Redis Cluster."""
    return f"chatd:prefix:{{{chained}}}"


def token_hash(token_ids: Sequence[int], *keys: str, after: str = "") -> str:
    """The one hash of token ids (xxh3-128, hex) for every index of them: segments, chunks, the prefix index and
    the checks. `keys` say whose and what they are (the owner, a salt, the model, the layout, how bytes are
    stored), so that ids alike under other keys never collide; `after` chains it to the hash of the ids before."""
    keyed = b"\x00".join(key.encode() for key in (after, *keys))
    return xxhash.xxh3_128_hexdigest(keyed + b"\x01" + pack_ids(token_ids))


def chained_token_hashes(token_ids: Sequence[int], block: int, *keys: str) -> list[str]:
    """`token_hash` of every whole block of `block` ids, each chained after the one before it: a block's hash
    stands for every id up to its end (under `keys`)."""
    hashes, previous = [], token_hash((), *keys)
    for start in range(0, len(token_ids) - block + 1, block):
        previous = token_hash(token_ids[start:start + block], after=previous)
        hashes.append(previous)
    return hashes


def pack_hashes(hashes: Sequence[str]) -> bytes:
    """Token hashes as their 16 bytes each."""
    return b"".join(bytes.fromhex(chained) for chained in hashes)


def unpack_hashes(packed: bytes | None) -> list[str]:
    """The hashes `pack_hashes` wrote."""
    packed = packed or b""
    return [packed[start:start + 16].hex() for start in range(0, len(packed) - 15, 16)]


def pack_ids(token_ids: Sequence[int]) -> bytes:
    """Token ids as little-endian int32: 4 bytes each, not a JSON list."""
    return array("i", token_ids).tobytes()


def unpack_ids(packed: bytes | None) -> list[int]:
    """The token ids `pack_ids` wrote."""
    ids = array("i")
    ids.frombytes(packed or b"")
    return ids.tolist()
