"""What other threads hand the engine thread, in order: turns, cache commands (housekeeping that any thread may ask
for), wake-ups and the stop. A cache command for a session waits while a turn of that session runs."""

from __future__ import annotations

import logging
import queue
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from cache_store import CacheStore
from cache_store.failure_log import log_failure
from chatd.engine.supervision import is_fatal
from chatd.engine.turn import Turn

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CacheCommand:
    """Cache housekeeping, run in the engine thread in order with the turns."""

    action: Callable[[CacheStore], object]
    result: Future | None = None
    session_id: str | None = None  # waits while this session's turn runs


_STOP = object()
_WAKE = object()  # a fetch finished: look at the fetching turns now


class EngineInbox:
    """The engine thread's one queue from the other threads; `put`, `wake` and `stop` are safe from any thread, the
    rest is the engine thread's."""

    def __init__(self):
        self._queue: queue.Queue[object] = queue.Queue()
        self._deferred: list[CacheCommand] = []  # commands for sessions a turn was running, in order

    def put(self, item: Turn | CacheCommand) -> None:
        self._queue.put(item)

    def wake(self) -> None:
        """A fetch finished: the engine looks at the fetching turns at once."""
        self._queue.put(_WAKE)

    def stop(self) -> None:
        self._queue.put(_STOP)

    def take(self, timeout: float | None) -> list[Turn] | None:
        """The turns sent since the last call (waiting up to `timeout` for something, none: not at all); the cache
        commands are kept for `ready`. None once asked to stop."""
        turns: list[Turn] = []
        try:
            item = self._queue.get(timeout=timeout) if timeout is not None else self._queue.get_nowait()
        except queue.Empty:
            return turns
        while True:
            if item is _STOP:
                return None
            if isinstance(item, Turn):
                turns.append(item)
            elif isinstance(item, CacheCommand):  # (a wake-up has nothing to run)
                self._deferred.append(item)
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return turns

    def ready(self, running_sessions: set[str]) -> list[CacheCommand]:
        """The cache commands that may run now: those of no session whose turn is running, in order."""
        ready = [c for c in self._deferred if c.session_id not in running_sessions]
        self._deferred = [c for c in self._deferred if c.session_id in running_sessions]
        return ready

    def drain(self) -> tuple[list[Turn], list[CacheCommand]]:
        """The engine stops: every turn and cache command it was sent and has not run."""
        turns, commands = [], [*self._deferred]
        self._deferred = []
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return turns, commands
            if isinstance(item, Turn):
                turns.append(item)
            elif isinstance(item, CacheCommand):
                commands.append(item)


def housekeep(cache: CacheStore, action: Callable[[CacheStore], object], result: Future | None,
              on_done: Callable[[], None]) -> None:
    """Cache housekeeping is best effort: a failure is logged (and handed to a caller that waits for the result),
    and the engine keeps serving. A caller that stopped waiting cancels it; one that waits gets its result after
    `on_done` (the counters published), so that it reads them with the command's effect."""
    if result is not None and not result.set_running_or_notify_cancel():
        return
    try:
        with torch.inference_mode():
            value = action(cache)
    except Exception as error:
        if is_fatal(error):
            raise
        log_failure(log, error, "cache housekeeping failed")
        if result is not None:
            result.set_exception(error)
        return
    if result is not None:
        on_done()
        result.set_result(value)
