"""Choose the next token from the logits: greedy at temperature 0, otherwise top-k and top-p sampling."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from chatd.engine.grammar import CompiledGrammar


@dataclass(frozen=True)
class SamplingParams:
    """How one reply is sampled: length, temperature, top-k, top-p, seed, stop strings, the grammar it follows and
    the tokens that may end it."""

    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int | None = None  # sample among the k likeliest tokens only (None: all)
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    grammar: CompiledGrammar | None = None
    # vLLM's extensions, which benchmark clients send to fix a reply's length: the model's end-of-sequence tokens
    # never end it (`ignore_eos`), no ending token before `min_tokens`, and more token ids that end it.
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()


class TokenSampler:
    """Per-turn sampler. Sampling runs on the CPU in float32 so that a seed gives the same
    reply on any device."""

    def __init__(self, params: SamplingParams):
        self.params = params
        self._generator = torch.Generator()
        if params.seed is not None:
            self._generator.manual_seed(params.seed)
        else:
            self._generator.seed()

    def next_token(self, logits: torch.Tensor) -> int:
        if self.params.temperature == 0:
            return int(torch.argmax(logits).item())
        probs = torch.softmax(logits.float().cpu() / self.params.temperature, dim=-1)
        if self.params.top_k is not None and self.params.top_k < probs.shape[-1]:
            kept = torch.zeros_like(probs)
            top = torch.topk(probs, self.params.top_k)
            probs = kept.scatter_(-1, top.indices, top.values)
        if self.params.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            # Keep the smallest head of the distribution whose mass reaches top_p (at least one token).
            outside = torch.cumsum(sorted_probs, dim=-1) - sorted_probs >= self.params.top_p
            sorted_probs[outside] = 0.0
            choice = torch.multinomial(sorted_probs, 1, generator=self._generator)
            return int(order[choice].item())
        return int(torch.multinomial(probs, 1, generator=self._generator).item())
