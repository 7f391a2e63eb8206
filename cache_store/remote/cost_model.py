"""Fetch a remote cache or recompute the history? Whichever the running server measured to be faster."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

MIN_PATIENCE_S = 0.25  # however short the history, a turn waits this long for Redis before recomputing
# A fetch runs beside the batch and costs only its own turn's wait; a recompute takes the engine from every stream
# for its prefill: a fetch is chosen while it is estimated at under this many prefills (the turn's patience too).
FETCH_ADVANTAGE = 2.0


class Throughput:
    """Moving averages of the link to Redis, measured on real calls: its round trip (small calls) and its bytes per
    second once the round trip is taken out (large transfers)."""

    def __init__(self) -> None:
        self.bytes_per_s: float | None = None
        self.round_trip_s: float | None = None

    def record(self, nbytes: int, seconds: float) -> None:
        """A transfer of `nbytes` that took `seconds`, its round trip included."""
        if nbytes < 64 * 1024 or seconds <= 0:
            return  # too small to say anything about bandwidth
        rate = nbytes / max(seconds - (self.round_trip_s or 0.0), seconds / 10)
        self.bytes_per_s = rate if self.bytes_per_s is None else 0.7 * self.bytes_per_s + 0.3 * rate

    def record_round_trip(self, seconds: float) -> None:
        """A call that moved next to nothing (a header): how far Redis is."""
        if seconds <= 0:
            return
        current = self.round_trip_s
        self.round_trip_s = seconds if current is None else 0.7 * current + 0.3 * seconds

    def transfer_s(self, nbytes: int) -> float | None:
        """The estimated time of one round trip that moves `nbytes`; None before any measure."""
        if self.bytes_per_s is None:
            return None
        return (self.round_trip_s or 0.0) + nbytes / self.bytes_per_s


@dataclass(frozen=True)
class RemoteDecision:
    """Fetch a remote cache or recompute, and the estimates behind the choice; `timeout`: Redis did not answer in
    the time recomputing was estimated to take, so the turn recomputed without waiting any longer."""

    choice: Literal["fetch", "recompute", "timeout"]
    fetch_ms: float | None  # estimated: a round trip, then the bytes over the measured Redis throughput
    prefill_ms: float | None  # estimated: tokens over the measured prefill rate
    waited_ms: float | None = None  # how long the turn waited for Redis (its header, then its chunks)


class CostModel:
    """Chooses between fetching a remote cache and recomputing it, from measured rates; `always_fetch`
    (`--remote-kv-fetch always`) fetches whatever the estimates, and waits as long as the Redis calls may take."""

    def __init__(self, throughput: Throughput, always_fetch: bool = False):
        self.throughput = throughput
        self.always_fetch = always_fetch
        self.prefill_tokens_per_s: float | None = None

    def record_prefill(self, tokens: int, seconds: float) -> None:
        if tokens < 16 or seconds <= 0:
            return  # single-token steps measure overhead, not prefill
        rate = tokens / seconds
        current = self.prefill_tokens_per_s
        self.prefill_tokens_per_s = rate if current is None else 0.7 * current + 0.3 * rate

    def prefill_s(self, tokens: int) -> float | None:
        return tokens / self.prefill_tokens_per_s if self.prefill_tokens_per_s else None

    def decide(self, nbytes: int, tokens: int) -> RemoteDecision:
        """Fetch `nbytes` (one more round trip) or prefill `tokens`."""
        fetch_s, prefill_s = self.throughput.transfer_s(nbytes), self.prefill_s(tokens)
        fetch_ms = 1000 * fetch_s if fetch_s is not None else None
        prefill_ms = 1000 * prefill_s if prefill_s is not None else None
        if self.always_fetch or fetch_ms is None or prefill_ms is None:
            return RemoteDecision("fetch", fetch_ms, prefill_ms)  # (nothing measured yet: try it, and measure)
        return RemoteDecision("fetch" if fetch_ms < FETCH_ADVANTAGE * prefill_ms else "recompute", fetch_ms, prefill_ms)

    def patience_s(self, tokens: int, timeout_s: float) -> float:
        """How long a turn of `tokens` waits for Redis (its header, then its chunks) before it recomputes instead:
        `FETCH_ADVANTAGE` times the estimated prefill (the batch decodes on meanwhile: only this turn waits), at
        least `MIN_PATIENCE_S`, and never past what the Redis calls may take (`timeout_s` each)."""
        prefill_s = self.prefill_s(tokens)
        if self.always_fetch or prefill_s is None:
            return 2 * timeout_s
        return min(max(MIN_PATIENCE_S, FETCH_ADVANTAGE * prefill_s), 2 * timeout_s)
