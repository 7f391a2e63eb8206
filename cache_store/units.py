"""The sizes and choices every room of the store shares, and the settings name: a region's unit, a chunk's
positions, int8's key-scale groups, how a tier keeps keys and values. Nothing here imports torch, so that `chatd
serve --help` and a bad flag answer at once."""

from typing import Literal

UNIT = 16  # tokens: regions are whole units

# Positions per chunk: whole key-scale groups (an int8 chunk is quantised alone, once), small enough that a turn
# rewrites little besides what it added, large enough that a long history is few keys (docs/benchmarks.md).
CHUNK_TOKENS = 32

GROUP_TOKENS = UNIT  # tokens per int8 key-scale group (measured against 32, 64 and whole caches: docs/benchmarks.md)

KVDtype = Literal["same", "int8"]  # same: exact, the model's dtype; int8: quantised (cache_store/host/quantize.py)


def key_groups(tokens: int, group_tokens: int = GROUP_TOKENS) -> int:
    """How many int8 key-scale groups a cache of `tokens` positions has."""
    return -(-tokens // group_tokens)
