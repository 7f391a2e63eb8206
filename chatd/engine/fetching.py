"""The turns whose cache is on its way from Redis (vLLM's `WAITING_FOR_REMOTE_KVS`): each waits in its own state
while the batch decodes on, until its fetch has finished (the remote tier's thread wakes the engine) or it has
waited as long as recomputing was estimated to take."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from cache_store import CacheStore, FetchRequest
from chatd.engine.running_turn import RunningTurn


class FetchingTurns:
    """The fetching turns, oldest first; the engine thread's alone."""

    def __init__(self, wake: Callable[[], None]):
        self._wake = wake
        self._turns: list[RunningTurn] = []

    def __len__(self) -> int:
        return len(self._turns)

    def __iter__(self) -> Iterator[RunningTurn]:
        return iter(self._turns)

    def start(self, running: RunningTurn, cache: CacheStore, request: FetchRequest) -> None:
        """Fetch what `request` asks for on the remote tier's threads; the turn waits here meanwhile."""
        running.fetch = cache.start_fetch(request, len(running.prompt_ids), self._wake)
        self._turns.append(running)

    def wait_s(self, longest: float) -> float:
        """How long the engine may wait for a command before the first of them gives up waiting."""
        if not self._turns:
            return longest
        return max(0.0, min(longest, min(running.fetch.deadline for running in self._turns) - time.monotonic()))

    def take_done(self) -> list[RunningTurn]:
        """Those whose fetch has finished, whose patience has run out, or that were cancelled (oldest first): no
        longer here."""
        now = time.monotonic()
        done = [running for running in self._turns if running.fetch.ready(now) or running.turn.cancelled.is_set()]
        self._turns = [running for running in self._turns if running not in done]
        return done

    def clear(self) -> None:
        self._turns = []
