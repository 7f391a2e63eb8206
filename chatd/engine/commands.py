"""The engine's cache commands: housekeeping that any thread may ask for, queued and run in the engine thread
in order with the turns (and, for a session, once no turn of it runs)."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TypeVar

import torch

from cache_store import CacheStore
from cache_store.failure_log import log_failure
from chatd.engine.supervision import EngineUnavailable, is_fatal

T = TypeVar("T")
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CacheCommand:
    """Cache housekeeping, run in the engine thread in order with the turns."""

    action: Callable[[CacheStore], object]
    result: Future | None = None
    session_id: str | None = None  # waits while this session's turn runs



class CacheCommands:
    """Cache housekeeping for the engine's callers; safe from any thread. The engine thread runs each command
    between two steps."""

    _commands: queue.Queue[object]
    _lock: threading.Lock
    _closed: str | None
    cache: CacheStore | None

    def _unavailable(self) -> str:
        raise NotImplementedError

    def _publish(self) -> None:
        raise NotImplementedError

    def drop_cache(self, session_id: str, remote_up_to: int | None = None) -> None:
        """Drop a session's cache on this worker (its next turn recomputes, or fetches it from Redis), and in Redis
        when its copy there is of version `remote_up_to` or older, once the turns queued before this call have
        finished."""
        self._commands.put(CacheCommand(lambda store: store.drop(session_id, remote_up_to), session_id=session_id))

    def close_session(self, session_id: str) -> None:
        """The session is closed: drop its cache and everything the cache store knows about it, once the
        turns queued before this call have finished."""
        self._commands.put(CacheCommand(lambda store: store.forget(session_id), session_id=session_id))

    def wait_shared(self, session_id: str, timeout_s: float) -> bool:
        """With `--remote-kv`, wait (off the engine thread) until the session's cache is written to Redis, so that
        the next turn can continue from it on any worker; whether it was within `timeout_s`."""
        remote = self.cache.remote if self.cache is not None else None
        return remote is None or remote.wait_written(session_id, timeout_s)

    def fork_session(self, source: str, target: str, prompt_ids: list[int]) -> None:
        """Start `target`'s cache as a copy of the part of `source`'s that `prompt_ids` begins with
        (a branch of a conversation); runs before any turn submitted after it."""
        self._commands.put(CacheCommand(lambda store: store.fork(source, target, prompt_ids)))

    def carry_cache_forward(self, session_id: str, from_version: int, to_version: int) -> None:
        """The session's history was edited without a turn (a conversation item deleted): its cache of `from_version`
        stays of use as far as the next prompt shares it (the lookup crops it there) instead of being stale."""
        def restamp(store: CacheStore) -> None:
            for entry in (store.device.get(session_id), store.host.get(session_id)):
                if entry is not None and entry.session_version == from_version:
                    entry.session_version = to_version

        self._commands.put(CacheCommand(restamp, session_id=session_id))

    def session_connected(self, session_id: str, connected: bool) -> None:
        self._commands.put(CacheCommand(lambda store: store.touch(session_id, connected)))

    def prefetch(self, session_id: str) -> None:
        """Hint that a turn of this session is coming: restore its cache to the device now."""
        self._commands.put(CacheCommand(lambda store: store.prefetch(session_id), session_id=session_id))

    def offload_idle(self) -> None:
        """Move every cache that is not running to the host tier (to free the device, or to measure)."""
        self._commands.put(CacheCommand(CacheStore.evict_idle))

    def call(self, action: Callable[[CacheStore], T], session_id: str | None = None) -> Future[T]:
        """Run `action` on the cache store in the engine thread, between decode steps (and, with a
        `session_id`, once no turn of that session is running)."""
        result: Future[T] = Future()
        with self._lock:
            if self._closed is None:
                self._commands.put(CacheCommand(action, result, session_id))
                return result
        result.set_exception(EngineUnavailable(self._unavailable()))
        return result

    def _housekeep(self, action: Callable[[CacheStore], object], result: Future | None = None) -> None:
        """Cache housekeeping is best effort: a failure is logged (and handed to a caller that waits
        for the result), and the engine keeps serving. A caller that stopped waiting cancels it."""
        if result is not None and not result.set_running_or_notify_cancel():
            return
        try:
            with torch.inference_mode():
                value = action(self.cache)
        except Exception as error:
            if is_fatal(error):
                raise
            log_failure(log, error, "cache housekeeping failed")
            if result is not None:
                result.set_exception(error)
            return
        if result is not None:
            self._publish()
            result.set_result(value)
