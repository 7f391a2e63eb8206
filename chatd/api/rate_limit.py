"""Turns per minute per client (API key, or address without keys), as a token bucket: a client may
spend a minute's allowance at once, then one turn per 60/rate seconds."""

from __future__ import annotations

import time
from collections.abc import Callable

MAX_CLIENTS = 100_000  # beyond this, clients with a full allowance are forgotten


class RateLimiter:
    """Turns per minute per client, as token buckets."""

    def __init__(self, per_minute: float | None, clock: Callable[[], float] = time.monotonic):
        self.per_minute = per_minute
        self._clock = clock
        self._buckets: dict[str, tuple[float, float]] = {}  # client -> (tokens, when counted)

    def acquire(self, client: str) -> float | None:
        """Take one turn; None if allowed, else the seconds until the next one is."""
        if self.per_minute is None:
            return None
        now, capacity, per_second = self._clock(), self.per_minute, self.per_minute / 60.0
        tokens, counted = self._buckets.get(client, (capacity, now))
        tokens = min(capacity, tokens + (now - counted) * per_second)
        if tokens < 1.0:
            self._buckets[client] = (tokens, now)
            return (1.0 - tokens) / per_second
        self._buckets[client] = (tokens - 1.0, now)
        if len(self._buckets) > MAX_CLIENTS:
            self._forget_full(now, capacity, per_second)
        return None

    def _forget_full(self, now: float, capacity: float, per_second: float) -> None:
        self._buckets = {client: (tokens, counted) for client, (tokens, counted) in self._buckets.items()
                         if tokens + (now - counted) * per_second < capacity}
