"""One session's KV cache together with the exact token ids it covers."""

from __future__ import annotations

from dataclasses import dataclass, field

from transformers import DynamicCache


@dataclass
class CacheEntry:
    """A `DynamicCache` and its token ids. The ids, not the transcript, say what the cache holds:
    whoever appends to the cache appends the same ids here (see `extend`)."""

    cache: DynamicCache
    token_ids: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def seq_lengths(self) -> list[int]:
        """The sequence length of every layer; all equal `num_tokens` in a consistent entry."""
        return [layer.get_seq_length() for layer in self.cache.layers]

    def is_consistent(self) -> bool:
        return all(length == self.num_tokens for length in self.seq_lengths())

    def extend(self, token_ids: list[int]) -> None:
        """Record ids whose keys and values the model just appended to the cache."""
        self.token_ids += token_ids

    def crop(self, keep: int) -> None:
        """Keep the first `keep` tokens; used when a render diverged or a turn is rolled back."""
        if keep < self.num_tokens:
            self.cache.crop(keep - self.num_tokens)
            self.token_ids = self.token_ids[:keep]

    def nbytes(self) -> int:
        """Bytes the key and value tensors occupy."""
        total = 0
        for layer in self.cache.layers:
            for tensor in (getattr(layer, "keys", None), getattr(layer, "values", None)):
                if tensor is not None:
                    total += tensor.untyped_storage().nbytes()
        return total
