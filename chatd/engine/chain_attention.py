"""Attention over caches that start with shared segments of the KV arena, read once per forward pass.

A cache's keys and values are a chain of pieces: the shared segments it starts with and its own region
(`cache_store/device/chain.py`). Each piece is attended separately, giving an output and the log-sum-exp of its
scores per query, and the parts are merged exactly by their log-sum-exps (Hydragen's `combine_lse`,
FlashInfer's `merge_state`, vLLM's `merge_attn_states`):

    lse = log sum_i e^(lse_i),    out = sum_i e^(lse_i - lse) out_i

In a batched step the rows that start with the same segment attend to it in one call with their queries
stacked (Hydragen; vLLM's cascade attention), so a shared segment is read once per step whatever the batch;
each row's own piece is attended over a view of its region, as before. What each family does to the scores
is done here too: the module's scaling, attention-logit soft-capping (Gemma 2), and attention sinks (gpt-oss),
which join the merge once, as one more part whose value is zero. A sliding-window layer sees in each piece
only the positions within the window of each query (`kv > q - window`, transformers' rule), so a window may
end inside a segment or beyond it. Scores are computed in float32 (float64 for a float64 model); on a CPU
without soft-capping, torch's fused flash kernel (`_scaled_dot_product_flash_attention_for_cpu`), which
returns the log-sum-exp, computes each part (the public call that returns it, flex attention, runs only eagerly
on a CPU, 10-50x slower: `bench/chain_attention_api.py`).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from cache_store import ArenaCache, KVArena, segments


def partial_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float,
                      visible: torch.Tensor | None = None, softcap: float | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of `query` [R, Hq, Lq, D] over one piece, `keys`/`values` [Hkv, Lk, D] shared by every row
    (grouped-query heads read their key head without a copy: the rows and groups are stacked as one matrix
    product per key head). `visible` [R, Lq, Lk] says which keys each query may see (None: all).
    Returns the output [R, Hq, Lq, D] and the log-sum-exp of the scores [R, Hq, Lq] (-inf where a query
    sees nothing; its output is then 0)."""
    if softcap is None and query.device.type == "cpu" and query.dtype in (torch.float32, torch.float64):
        return _fused_cpu(query, keys, values, scaling, visible)
    return matmul_attention(query, keys, values, scaling, visible, softcap)


def matmul_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float,
                     visible: torch.Tensor | None = None, softcap: float | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """`partial_attention` as two matrix products (any device, dtype and soft-capping)."""
    rows, heads, length, dim = query.shape
    kv_heads = keys.shape[0]
    groups = heads // kv_heads
    work = torch.promote_types(query.dtype, torch.float32)
    stacked = query.to(work).reshape(rows, kv_heads, groups * length, dim).transpose(0, 1)
    stacked = stacked.reshape(kv_heads, rows * groups * length, dim)
    scores = torch.matmul(stacked, keys.to(work).transpose(1, 2)) * scaling
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if visible is not None:
        scores = scores.view(kv_heads, rows, groups, length, -1).masked_fill(
            ~visible[None, :, None], float("-inf")).view(kv_heads, rows * groups * length, -1)
    lse = torch.logsumexp(scores, dim=-1)
    finite = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))  # a query that sees nothing: 0, not NaN
    output = torch.matmul(torch.exp(scores - finite.unsqueeze(-1)), values.to(work))
    output = output.view(kv_heads, rows, groups * length, dim).transpose(0, 1).reshape(rows, heads, length, dim)
    lse = lse.view(kv_heads, rows, groups * length).transpose(0, 1).reshape(rows, heads, length)
    return output, lse


def _fused_cpu(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float,
               visible: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """`partial_attention` through torch's fused CPU flash kernel, which returns the log-sum-exp (3x faster here
    than the matrix products above at 4,000 keys); a query that sees nothing gets -inf, not the kernel's 0."""
    rows, heads, length, dim = query.shape
    kv_heads = keys.shape[0]
    groups = heads // kv_heads
    stacked = query.reshape(rows, kv_heads, groups * length, dim)
    if rows > 1:  # (one row: already in the order the kernel takes)
        stacked = stacked.transpose(0, 1).reshape(1, kv_heads, rows * groups * length, dim)
    mask = seen = None
    if visible is not None:
        flat = visible[:, None].expand(rows, groups, length, visible.shape[-1])
        flat = flat.reshape(1, 1, rows * groups * length, -1)
        mask = torch.zeros(flat.shape, dtype=query.dtype).masked_fill_(~flat, float("-inf"))
        seen = flat.any(dim=-1)  # [1, 1, R*G*L]
    output, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        stacked, keys.unsqueeze(0), values.unsqueeze(0), attn_mask=mask, scale=scaling)[:2]
    if seen is not None:
        lse = lse.masked_fill(~seen, float("-inf"))
    if rows == 1:
        return output.reshape(1, heads, length, dim), lse.reshape(1, heads, length)
    output = output.view(kv_heads, rows, groups * length, dim).transpose(0, 1).reshape(rows, heads, length, dim)
    lse = lse.view(kv_heads, rows, groups * length).transpose(0, 1).reshape(rows, heads, length)
    return output, lse


def gathered_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float,
                       mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's queries [R, Hq, Lq, D] (padded to one count) over its own keys and values [R, Hkv, L, D]
    (gathered and padded to one length; `mask` [R, 1, G * Lq, L], additive, says which each query of each of the
    G query heads of a key head sees: the row's, before it and in its window; None: all), in one call of torch's
    fused CPU flash kernel: the output [R, Hq, Lq, D] and the log-sum-exp [R, Hq, Lq]."""
    rows, heads, length, dim = query.shape
    kv_heads = keys.shape[1]
    output, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query.reshape(rows, kv_heads, heads // kv_heads * length, dim), keys, values, attn_mask=mask,
        scale=scaling)[:2]
    return output.reshape(rows, heads, length, dim), lse.reshape(rows, heads, length)


def merge_partials(outputs: Sequence[torch.Tensor], lses: Sequence[torch.Tensor],
                   sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Merge partial attentions `outputs` [R, H, L, D] with their log-sum-exps `lses` [R, H, L] into the
    attention over all their keys together; `sinks` [H] (gpt-oss) are one more key per head whose value is
    zero: they weigh in the denominator once. Each part's weight is e^(lse_i - lse), where lse is the
    log-sum-exp of all of them (a query that sees nothing at all gets 0)."""
    if len(outputs) == 1 and sinks is None:
        return outputs[0]
    total = functools.reduce(torch.logaddexp, lses)
    if sinks is not None:
        total = torch.logaddexp(total, sinks.to(total.dtype).view(1, -1, 1))
    total = total.clamp_min(torch.finfo(total.dtype).min)
    merged = None
    for output, lse in zip(outputs, lses, strict=True):
        weighted = output * torch.exp(lse - total).unsqueeze(-1)
        merged = weighted if merged is None else merged.add_(weighted)
    return merged


GATHER_LIMIT = 8192  # own positions of a whole batch below which they are gathered into one call
FOLD_LIMIT = 1024  # gathered positions of a whole batch (segments included) below which segments are gathered too


@dataclass(frozen=True)
class _Row:
    """One row of a pass: the segments its cache starts with, its own cache, and its queries' positions."""

    segments: tuple[ArenaCache, ...]
    own: ArenaCache
    own_length: int  # its own positions once this pass has written its new keys
    positions: tuple[int, ...]  # the positions of its queries (the last `len(positions)` of the sequence)
    first: int  # where its queries start in the pass's packed queries


class ChainPlan:
    """The pieces every row of one forward pass attends to, and which keys each query sees in each layer's
    window; built once per pass (the arena's regions cannot move during it: every region is reserved
    before the pass starts). A row feeds any number of tokens (`new_tokens`, one per cache, or one count for
    all); the queries of the rows are packed one after another, as the batched step feeds them."""

    def __init__(self, arena: KVArena, caches: Sequence[ArenaCache], new_tokens: int | Sequence[int],
                 device: torch.device):
        self.arena = arena
        self.device = device
        counts = [new_tokens] * len(caches) if isinstance(new_tokens, int) else list(new_tokens)
        firsts = [sum(counts[:index]) for index in range(len(counts))]
        self.rows = [_Row(tuple(segments(cache)), cache, cache.used_tokens() + count,
                          tuple(range(cache.get_seq_length(), cache.get_seq_length() + count)), first)
                     for cache, count, first in zip(caches, counts, firsts, strict=True)]
        self.queries = sum(counts)
        shared: dict[int, list[int]] = {}  # segment -> the rows that start with it
        by_id: dict[int, ArenaCache] = {}
        for index, row in enumerate(self.rows):
            for segment in row.segments:
                shared.setdefault(id(segment), []).append(index)
                by_id[id(segment)] = segment
        self.groups = [(by_id[key], self._query_index(rows)) for key, rows in shared.items()]
        self._masks: dict[object, object] = {}
        # Own pieces are read in one call, gathered from their regions (a call per row costs more than the copy when
        # they are short): arena slots per row, padded to the longest; each row's queries padded to the most any
        # row has (a padding slot repeats its row's last query, and is dropped). Segments that few rows read and
        # that are short are gathered with them (`folded`): one call and no merge costs less than reading them once.
        chains = [[(segment, segment.used_tokens()) for segment in row.segments] + [(row.own, row.own_length)]
                  for row in self.rows]
        self.folded = bool(self.groups) and sum(length for row in chains for _, length in row) <= FOLD_LIMIT
        pieces = chains if self.folded else [row[-1:] for row in chains]
        longest = max(sum(length for _, length in row) for row in pieces)
        most = max(len(row.positions) for row in self.rows)
        self._gather = self._gathered_positions = self._slots = self._real = None
        if device.type == "cpu" and (len(self.rows) > 1 or self.folded) and longest * len(self.rows) <= GATHER_LIMIT:
            slots = [[piece.region.start + j for piece, length in row for j in range(length)] for row in pieces]
            positions = [[piece.offset + j for piece, length in row for j in range(length)] for row in pieces]
            self._gather = torch.tensor([row + row[-1:] * (longest - len(row)) for row in slots],
                                        device=device).view(-1)
            self._gathered_positions = torch.tensor([row + [-1] * (longest - len(row)) for row in positions],
                                                    device=device)  # -1: padding, seen by no query
            if most > 1:
                self._slots = torch.tensor([row.first + min(j, len(row.positions) - 1) for row in self.rows
                                            for j in range(most)], device=device)
                self._real = torch.tensor([number * most + j for number, row in enumerate(self.rows)
                                           for j in range(len(row.positions))], device=device)

    def _query_index(self, members: list[int]) -> tuple[list[int], torch.Tensor | None]:
        """The members of a segment's group, and where their queries are among the packed ones (None: all)."""
        if len(members) == len(self.rows):
            return members, None
        where = [self.rows[m].first + j for m in members for j in range(len(self.rows[m].positions))]
        return members, torch.tensor(where, device=self.device)

    def attend(self, layer: int, window: int | None, query: torch.Tensor, scaling: float,
               softcap: float | None, sinks: torch.Tensor | None) -> torch.Tensor:
        """Every row's attention in `layer`: the packed queries `query` [1, Hq, Q, D] -> [1, Q, Hq, D]."""
        keys, values = self.arena.keys[layer], self.arena.values[layer]
        gathered = self._gather is not None and softcap is None and query.dtype in (torch.float32, torch.float64)
        parts = [] if gathered and self.folded else self._segment_parts(window, query, keys, values, scaling, softcap)
        if gathered:
            parts.append(self._gathered(query, keys, values, scaling, window))
        else:
            parts.append(self._own_parts(window, query, keys, values, scaling, softcap))
        merged = merge_partials([output for output, _ in parts], [lse for _, lse in parts], sinks)
        return merged.transpose(1, 2).to(query.dtype)

    def _segment_parts(self, window: int | None, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                       scaling: float, softcap: float | None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each shared segment attended once by the queries of every row that starts with it: (output, lse) over
        all the packed queries (a query of a row that does not start with it sees nothing of it)."""
        parts = []
        for (segment, (_, index)), (visible, lo, hi) in zip(self.groups, self._visibility(window)[0], strict=True):
            if hi <= lo:
                continue  # outside every member's window
            start = segment.region.start
            output, lse = partial_attention(query if index is None else query[:, :, index],
                                            keys[:, start + lo:start + hi], values[:, start + lo:start + hi],
                                            scaling, visible, softcap)
            if index is not None:
                output = output.new_zeros(query.shape).index_copy_(2, index, output)
                lse = lse.new_full(query.shape[:3], float("-inf")).index_copy_(2, index, lse)
            parts.append((output, lse))
        return parts

    def _own_parts(self, window: int | None, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                   scaling: float, softcap: float | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Every row's own piece, a call a row (soft-capping, another dtype, a GPU): (output, lse) packed."""
        own = []
        for row, (visible, lo, hi) in zip(self.rows, self._visibility(window)[1], strict=True):
            start = row.own.region.start
            own.append(partial_attention(query[:, :, row.first:row.first + len(row.positions)],
                                         keys[:, start + lo:start + hi], values[:, start + lo:start + hi],
                                         scaling, visible, softcap))
        return torch.cat([output for output, _ in own], dim=2), torch.cat([lse for _, lse in own], dim=2)

    def _gathered(self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float,
                  window: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Every row's own piece in one call: the packed queries [1, Hq, Q, D] -> output [1, Hq, Q, D], log-sum-exp
        [1, Hq, Q]."""
        rows, heads, dim = len(self.rows), query.shape[1], query.shape[-1]
        padded = query[0] if self._slots is None else query[0][:, self._slots]  # [Hq, R * most, D]
        padded = padded.reshape(heads, rows, -1, dim).transpose(0, 1)
        output, lse = gathered_attention(padded, *(buffer.index_select(1, self._gather).view(
            buffer.shape[0], rows, -1, buffer.shape[-1]).transpose(0, 1) for buffer in (keys, values)),
            scaling, self._gathered_mask(window, heads // keys.shape[0], query.dtype))
        output, lse = output.transpose(0, 1).reshape(heads, -1, dim), lse.transpose(0, 1).reshape(heads, -1)
        if self._real is not None:
            output, lse = output[:, self._real], lse[:, self._real]
        return output.unsqueeze(0), lse.unsqueeze(0)

    def _gathered_visibility(self, window: int | None) -> torch.Tensor:
        """For gathered pieces: [R, Lq, L], which of its row's gathered positions each (padded) query sees: the
        row's, up to its own position, within its window (a padding slot sees what its row's last query sees)."""
        key = ("gathered", window)
        if key not in self._masks:
            most = 1 if self._slots is None else len(self._slots) // len(self.rows)
            at = torch.tensor([[row.positions[min(slot, len(row.positions) - 1)] for slot in range(most)]
                               for row in self.rows], device=self.device)[:, :, None]  # [R, Lq, 1]
            kv = self._gathered_positions[:, None, :]  # [R, 1, L]
            visible = (kv >= 0) & (kv <= at)
            if window is not None:
                visible &= kv > at - window
            self._masks[key] = visible
        return self._masks[key]

    def _gathered_mask(self, window: int | None, groups: int, dtype: torch.dtype) -> torch.Tensor | None:
        """`_gathered_visibility` as the fused kernel's additive mask for `groups` query heads a key head."""
        key = ("additive", window, groups, dtype)
        if key not in self._masks:
            visible = self._gathered_visibility(window)
            rows, length = visible.shape[:2]
            flat = visible[:, None].expand(rows, groups, length, visible.shape[-1])
            flat = flat.reshape(rows, 1, groups * length, -1)
            self._masks[key] = None if bool(flat.all()) else torch.zeros(flat.shape, dtype=dtype).masked_fill_(
                ~flat, float("-inf"))
        return self._masks[key]

    def _visibility(self, window: int | None) -> tuple[list, list]:
        """Per shared segment and per row's own piece, for `window`: (visible mask or None, lo, hi), the keys
        [lo, hi) of the piece that any of its queries may see and which of them each query sees."""
        if window not in self._masks:
            segment_masks = []
            for segment, (members, _) in self.groups:
                positions = [p for m in members for p in self.rows[m].positions]
                segment_masks.append(self._piece(positions, segment.offset, segment.used_tokens(), window))
            own = [self._piece(row.positions, row.own.offset, row.own_length, window) for row in self.rows]
            self._masks[window] = (segment_masks, own)
        return self._masks[window]

    def _piece(self, positions: Sequence[int], first: int, length: int, window: int | None) -> tuple:
        """(visible [1, Lq, hi - lo] or None when every query sees every key of [lo, hi), lo, hi) for a piece
        holding positions [first, first + length) and queries at `positions` (packed)."""
        queries = torch.tensor(positions, device=self.device)[None]  # [1, Lq]
        keys = torch.arange(first, first + length, device=self.device)
        visible = keys[None, None, :] <= queries[:, :, None]
        if window is not None:
            visible &= keys[None, None, :] > queries[:, :, None] - window
        seen = visible.any(dim=0).any(dim=0).nonzero()
        if seen.numel() == 0:
            return None, 0, 0
        lo, hi = int(seen[0]), int(seen[-1]) + 1
        visible = visible[:, :, lo:hi]
        return (None if bool(visible.all()) else visible), lo, hi
