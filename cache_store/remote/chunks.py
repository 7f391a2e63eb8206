"""A cache below the device as a run of immutable chunks, as LMCache stores KV: fixed runs of positions, each
named by the chained hash of the token ids up to its end and the identity of what its bytes are (whose, which
model, which layout, exact or int8). A chunk is the same for every session of one owner whose history starts
with the same ids, so a prefix many sessions share is stored once, and a chunk a tier already holds is not
written (or fetched) again. The positions after the last whole chunk (the tail) travel with their session.
"""

from __future__ import annotations

from collections.abc import Sequence

from cache_store.identity import CacheLayout
from cache_store.units import CHUNK_TOKENS, UNIT
from sessions.encoding import chained_token_hashes


def chunk_identity(model_key: str, scope: str, layout: CacheLayout, kind: str) -> str:
    """What, besides its token ids, makes two chunks interchangeable: the owner scope (a chunk is never served
    across keys), the model, the layout and how its bytes are stored (`kind`: exact, int8, or exact bytes of a
    cache restored from int8, which never stand in for exact ones)."""
    return f"{scope}\x00{model_key}\x00{layout.layers}x{layout.kv_heads}x{layout.head_dim}:{layout.dtype}\x00{kind}"


def chunk_names(token_ids: Sequence[int], identity: str, chunk_tokens: int = CHUNK_TOKENS) -> list[str]:
    """The names of the whole chunks of a cache holding `token_ids`: each hashes the one before it, the identity
    and its own ids, so a name stands for every position up to its chunk's end."""
    if chunk_tokens <= 0 or chunk_tokens % UNIT:
        raise ValueError(f"a chunk is a whole number of {UNIT}-token units, not {chunk_tokens} tokens")
    return chained_token_hashes(token_ids, chunk_tokens, identity)


def shared_chunks(a: Sequence[str], b: Sequence[str]) -> int:
    """How many leading chunks two runs of chunk names share (the same name: the same ids up to there)."""
    count = 0
    for mine, theirs in zip(a, b, strict=False):
        if mine != theirs:
            break
        count += 1
    return count
