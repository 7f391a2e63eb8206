"""The messages of running and recently finished turns, so that a client whose socket dropped can
reconnect and resume a reply where it lost it (`chat.resume`)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from chatd.api.websocket.protocol import ChatDelta, ChatDone, ErrorMessage
from chatd.engine.turn import Turn

OutMessage = ChatDelta | ChatDone | ErrorMessage


class Sink(Protocol):
    """Whoever a turn log delivers to: a websocket connection."""

    async def send(self, message: OutMessage) -> None: ...


@dataclass
class TurnLog:
    """Every message a turn sent, in order: its deltas (message i has seq i), then its end. They go
    to `subscriber`: the connection that started the turn, or the last one that resumed it.

    One delivery loop at a time sends the subscriber every message from its cursor on, so that a
    resume (a new subscriber and cursor) and the turn's own publishing can interleave in any order
    without a message being lost or sent twice to the subscriber."""

    turn: Turn
    owner: str | None
    subscriber: Sink
    messages: list[OutMessage] = field(default_factory=list)
    finished_at: float | None = None
    _next: int = 0  # the index of the next message the subscriber has not been sent
    _delivering: bool = False

    @property
    def running(self) -> bool:
        return self.finished_at is None

    async def publish(self, message: OutMessage) -> None:
        self.messages.append(message)
        await self._deliver()

    async def subscribe(self, subscriber: Sink, last_seq: int) -> None:
        """Switch the stream to `subscriber` first, then replay it everything after its `last_seq`."""
        self.subscriber = subscriber
        self._next = min(last_seq + 1, len(self.messages))
        await self._deliver()

    async def _deliver(self) -> None:
        if self._delivering:
            return  # the loop already sending will send this too
        self._delivering = True
        try:
            while self._next < len(self.messages):
                message = self.messages[self._next]
                self._next += 1
                await self.subscriber.send(message)
        finally:
            self._delivering = False


class TurnLogs:
    """Logs by (owner, turn id): another key cannot see or resume a turn, even knowing its id."""

    def __init__(self, ttl_s: float, clock: Callable[[], float] = time.monotonic):
        self.ttl_s = ttl_s
        self._clock = clock
        self._logs: dict[tuple[str | None, str], TurnLog] = {}

    def start(self, turn: Turn, owner: str | None, subscriber: Sink) -> TurnLog:
        self._expire()
        log = self._logs[owner, turn.turn_id] = TurnLog(turn, owner, subscriber)
        return log

    def get(self, owner: str | None, turn_id: str) -> TurnLog | None:
        self._expire()
        return self._logs.get((owner, turn_id))

    def finish(self, log: TurnLog) -> None:
        log.finished_at = self._clock()

    def _expire(self) -> None:
        deadline = self._clock() - self.ttl_s
        for key in [key for key, log in self._logs.items() if not log.running and log.finished_at < deadline]:
            del self._logs[key]
