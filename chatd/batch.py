"""One decode step for several sessions at once, each keeping its own cache.

The sessions' caches are left-padded into one batch cache for the step, with an attention mask that
hides the padding and position ids that continue each session's own sequence. After the forward
pass, each session's new key/value column is appended to its own cache, which is therefore whole and
consistent after every step (for write-back, offload and checks) exactly as after a single decode.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from transformers import DynamicCache, PreTrainedModel

from cache_store import CacheEntry
from cache_store.entry import entry_from_tensors


def decode_step(model: PreTrainedModel, entries: Sequence[CacheEntry], tokens: Sequence[int],
                device: torch.device, new_cache: Callable[[], DynamicCache]) -> torch.Tensor:
    """Feed `tokens[i]` after `entries[i]` for every i in one forward pass; return the logits [B, V]."""
    lengths = [entry.num_tokens for entry in entries]
    longest = max(lengths)
    padded = []
    for layer_index in range(len(entries[0].cache.layers)):
        pairs = [(e.cache.layers[layer_index].keys, e.cache.layers[layer_index].values) for e in entries]
        keys = pairs[0][0].new_zeros((len(entries), pairs[0][0].shape[1], longest, pairs[0][0].shape[3]))
        values = torch.zeros_like(keys)
        for row, ((k, v), length) in enumerate(zip(pairs, lengths, strict=True)):
            keys[row, :, longest - length:] = k[0]
            values[row, :, longest - length:] = v[0]
        padded.append((keys, values))
    batch = entry_from_tensors(new_cache, padded, [])
    attention_mask = torch.zeros((len(entries), longest + 1), dtype=torch.long, device=device)
    for row, length in enumerate(lengths):
        attention_mask[row, longest - length:] = 1
    output = model(input_ids=torch.tensor([[t] for t in tokens], dtype=torch.long, device=device),
                   attention_mask=attention_mask, position_ids=torch.tensor([[n] for n in lengths], device=device),
                   cache=batch.cache, use_cache=True, logits_to_keep=1)
    for layer_index, layer in enumerate(batch.cache.layers):
        new_keys, new_values = layer.keys[:, :, longest:], layer.values[:, :, longest:]
        for row, entry in enumerate(entries):
            own = entry.cache.layers[layer_index]
            own.keys = torch.cat([own.keys, new_keys[row:row + 1]], dim=-2)
            own.values = torch.cat([own.values, new_values[row:row + 1]], dim=-2)
    for entry, token in zip(entries, tokens, strict=True):
        entry.extend([token])
    return output.logits[:, -1]
