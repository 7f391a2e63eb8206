"""The sizes and choices that the settings name: a region's unit, a chunk's positions, how a tier keeps keys and
values. Nothing here imports torch, so that `chatd serve --help` and a bad flag answer at once."""

from typing import Literal

UNIT = 16  # tokens: regions are whole units

# Positions per chunk: whole key-scale groups (an int8 chunk is quantised alone, once), small enough that a turn
# rewrites little besides what it added, large enough that a long history is few keys (docs/benchmarks.md).
CHUNK_TOKENS = 32

KVDtype = Literal["same", "int8"]  # same: exact, the model's dtype; int8: quantised (cache_store/quantize.py)
