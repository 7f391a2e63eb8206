"""Fetch a remote cache or recompute the history? Whichever the running server measured to be faster."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


class Throughput:
    """A moving average of bytes per second, measured on real transfers."""

    def __init__(self) -> None:
        self.bytes_per_s: float | None = None

    def record(self, nbytes: int, seconds: float) -> None:
        if nbytes < 64 * 1024 or seconds <= 0:
            return  # too small to say anything about bandwidth
        rate = nbytes / seconds
        self.bytes_per_s = rate if self.bytes_per_s is None else 0.7 * self.bytes_per_s + 0.3 * rate


@dataclass(frozen=True)
class RemoteDecision:
    """Fetch a remote cache or recompute, and the estimates behind the choice."""

    choice: Literal["fetch", "recompute"]
    fetch_ms: float | None  # estimated: bytes over the measured Redis throughput
    prefill_ms: float | None  # estimated: tokens over the measured prefill rate


class CostModel:
    """Chooses between fetching a remote cache and recomputing it, from measured rates."""

    def __init__(self, throughput: Throughput):
        self.throughput = throughput
        self.prefill_tokens_per_s: float | None = None

    def record_prefill(self, tokens: int, seconds: float) -> None:
        if tokens < 16 or seconds <= 0:
            return  # single-token steps measure overhead, not prefill
        rate = tokens / seconds
        current = self.prefill_tokens_per_s
        self.prefill_tokens_per_s = rate if current is None else 0.7 * current + 0.3 * rate

    def decide(self, nbytes: int, tokens: int) -> RemoteDecision:
        fetch_ms = 1000 * nbytes / self.throughput.bytes_per_s if self.throughput.bytes_per_s else None
        prefill_ms = 1000 * tokens / self.prefill_tokens_per_s if self.prefill_tokens_per_s else None
        if fetch_ms is None or prefill_ms is None:
            return RemoteDecision("fetch", fetch_ms, prefill_ms)  # nothing measured yet: try it, and measure
        return RemoteDecision("fetch" if fetch_ms < prefill_ms else "recompute", fetch_ms, prefill_ms)
