"""Where a turn ends, whatever ends it: its reply written back, a failure at some stage, a cancellation, a refusal.
Every write-back and release of a turn's cache at its end happens here, and every turn the engine took is tracked
here until its last event, so that a stopping engine can answer each."""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Iterable

import torch

from cache_store import CacheStore, FaultPoints
from cache_store.failure_log import log_failure
from chatd.engine.drafts import Speculator
from chatd.engine.running_turn import RunningTurn
from chatd.engine.supervision import is_fatal
from chatd.engine.turn import FinishReason, Turn, TurnFailed, TurnResult

log = logging.getLogger(__name__)


class TurnEndings:
    """The turns the engine has taken and not ended, and the ways they end. The engine thread's alone, but for
    `running`, which any thread may read."""

    def __init__(self, cache: CacheStore, faults: FaultPoints, speculator: Speculator):
        self._cache, self._faults, self._speculator = cache, faults, speculator
        self.live: dict[int, Turn] = {}  # every turn taken from the queue and not yet ended, by id
        self.failures: Counter[str] = Counter()  # turns failed, by stage
        self._counted: set[int] = set()  # the started turns (by id), as of the last step, less those ended since
        self._ended: list[tuple[Turn, TurnResult | TurnFailed]] = []  # ended since the last `announce`

    @property
    def running(self) -> int:
        """Turns started and not finished (prefilling, fetching or decoding), as of the last engine step."""
        return len(self._counted)

    def took(self, turn: Turn) -> None:
        self.live[id(turn)] = turn

    def count(self, started: Iterable[RunningTurn]) -> None:
        """After a step: the turns it leaves started."""
        self._counted = {id(running.turn) for running in started}

    def forget_all(self) -> list[Turn]:
        """The engine stops: every turn it still has, to be answered."""
        turns = list(self.live.values())
        self._counted = set()
        return turns

    def end(self, turn: Turn, event: TurnResult | TurnFailed) -> None:
        """A turn's last event: it is no longer the engine's. Its client is told at `announce`, once the loop has
        published the counters, so that a client that has its answer reads them with its turn counted."""
        self.live.pop(id(turn), None)
        self._counted.discard(id(turn))
        self._ended.append((turn, event))

    @property
    def ended(self) -> bool:
        """Whether turns ended since the last `announce`."""
        return bool(self._ended)

    def announce(self) -> None:
        """Tell each turn that ended its last event (after the step, or when the engine stops)."""
        ended, self._ended = self._ended, []
        for turn, event in ended:
            turn.emit(event)

    def cancelled_before_start(self, turn: Turn) -> None:
        """A turn cancelled before it was admitted: it ends with nothing generated and nothing written."""
        queue_ms = (time.perf_counter() - turn.received_at) * 1000.0
        self.end(turn, TurnResult.cancelled_before_start(queue_ms))

    def cancelled(self, running: RunningTurn) -> None:
        """An admitted turn cancelled before its first token: its session's claim on the cache let go when it never
        looked its cache up (a fetch under way is dropped), or its cache written back as it found it."""
        if running.lookup is None:
            if running.fetch is not None:
                running.fetch.job.cancel()
            self._cache.release(running.turn.session_id)
            self.cancelled_before_start(running.turn)
        else:
            running.first_token_at = time.perf_counter()
            self.finish(running, "cancelled")

    def turned_away(self, running: RunningTurn, refusal: TurnFailed) -> None:
        """An admitted turn that cannot run now (`busy`): its cache written back as it found it, or its session's
        claim on the cache let go when it had none yet."""
        session_id = running.turn.session_id
        if running.entry is not None:
            running.entry.crop(running.rollback_to)
            self._cache.put(session_id, running.entry, running.turn.session_version)
            running.let_go()
        else:
            self._cache.release(session_id)
        self.end(running.turn, refusal)

    def finish(self, running: RunningTurn, finish: FinishReason) -> None:
        """Write the cache back (rolled back first if cancelled) and report the result."""
        turn, entry = running.turn, running.entry
        try:
            self._faults.check("write-back", turn.session_id)
            if finish == "cancelled":
                entry.crop(running.rollback_to)  # the turn is not recorded: roll its tokens back
            result = running.result(finish)
            if finish in ("stop", "length"):
                self._speculator.finished(turn.owner or "", running.prompt_ids, running.generated)
            with torch.inference_mode():
                self._cache.put(turn.session_id, entry, turn.session_version + (finish != "cancelled"),
                               keep_for_s=turn.keep_for_s)
            running.let_go()
        except Exception as error:
            self.fail(running, error, "write-back")
            return
        self.end(turn, result)

    def fail(self, failed: RunningTurn | Turn, error: Exception, stage: str) -> None:
        """One turn failed at `stage`: it gets `internal`, and its cache, which the failure may have left
        half-written, is dropped from every tier. An error the engine cannot go on from propagates."""
        if is_fatal(error):
            raise error
        turn = failed.turn if isinstance(failed, RunningTurn) else failed
        log_failure(log, error, "turn %s of session %s failed at the %s stage; its cache is dropped", turn.turn_id,
                    turn.session_id, stage)
        self.failures[stage] += 1
        self._faults.disarm(turn.session_id)
        if isinstance(failed, RunningTurn) or not self._cache.device.is_running(turn.session_id):
            self._cache.abandon(turn.session_id)  # never another turn's running cache
        if isinstance(failed, RunningTurn):
            failed.let_go()
        self.end(turn, TurnFailed("internal", f"the turn failed at the {stage} stage: {type(error).__name__}"))
