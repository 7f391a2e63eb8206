"""The turns the engine has taken, by state: the one place a turn changes state (vLLM's scheduler queues, which only
the scheduler and its `update_from_output` move requests between).

queued → (rendered) head → prefilling ⇄ fetching → decoding → ended. The planner reads the states and moves a turn
on when it plans it (admitted, off to fetch, riding the decode pass); the updater moves it on when its logits come
(prefilled, back to its prefill, on to the next decode step). A turn leaves them when it ends (`TurnEndings`); the
turns of one step's decode pass are the plan's (`DecodePlan`) until the updater moves each on.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from cache_store import CacheStore, FetchRequest
from chatd.engine.fetching import FetchingTurns
from chatd.engine.running_turn import RunningTurn
from chatd.engine.turn import Turn


class TurnQueues:
    """The turns by state, oldest first in each; the engine thread's alone."""

    def __init__(self, wake: Callable[[], None]):
        self.queued: deque[Turn] = deque()  # submitted, not started: admitted oldest first
        self.head: RunningTurn | None = None  # the oldest, rendered, waiting for device memory
        self.prefilling: deque[RunningTurn] = deque()  # admitted, prompt being fed chunk by chunk
        self.fetching = FetchingTurns(wake)  # admitted, their cache on its way from Redis
        self.decoding: list[RunningTurn] = []  # the next decode pass's batch

    def started(self) -> list[RunningTurn]:
        """The turns admitted and not ended: decoding, prefilling, or fetching their cache from Redis."""
        return [*self.decoding, *self.prefilling, *self.fetching]

    def has_work(self, max_batch: int) -> bool:
        """Whether the next step has a turn to run: one prefilling or decoding, one waiting for room, or a queued one
        the batch has room for (a turn waiting on a full batch, or on Redis, gives the engine nothing to do)."""
        return bool(self.decoding or self.prefilling or self.head
                    or (self.queued and len(self.started()) < max_batch))

    @property
    def busy(self) -> bool:
        """Whether the model has work (what the thread governor counts as working)."""
        return bool(self.decoding or self.prefilling)

    def take(self, turn: Turn) -> None:
        """A submitted turn joins the queue (first come, first served)."""
        self.queued.append(turn)

    def next_to_admit(self) -> Turn | RunningTurn:
        """The oldest turn not admitted: the rendered head that waited for room, or the next queued one."""
        head, self.head = self.head, None
        return head or self.queued.popleft()

    def wait_for_room(self, running: RunningTurn) -> None:
        """The oldest turn does not fit the device budget yet: it stays first in line."""
        self.head = running

    def admitted(self, running: RunningTurn) -> None:
        self.prefilling.append(running)

    def left_prefill(self, running: RunningTurn) -> None:
        """A prefilling turn leaves that state: it is prefilled, rides the decode pass, or ended."""
        self.prefilling.remove(running)

    def back_to_prefill(self, running: RunningTurn) -> None:
        """A turn to prefill again first (its fetch is done, or its reused cache failed a check): at the front."""
        self.prefilling.appendleft(running)

    def to_fetch(self, running: RunningTurn, cache: CacheStore, request: FetchRequest) -> None:
        """A prefilling turn waits for its cache from Redis while the batch decodes on."""
        self.prefilling.remove(running)
        self.fetching.start(running, cache, request)

    def fetched(self) -> list[RunningTurn]:
        """The fetching turns whose fetch has finished or given up, back at the front of the prefilling ones (oldest
        first), and those cancelled meanwhile, which leave the states (to be ended)."""
        done = self.fetching.take_done()
        cancelled = [running for running in done if running.turn.cancelled.is_set()]
        for running in reversed(done):
            if running not in cancelled:
                self.prefilling.appendleft(running)
        return cancelled

    def to_decode(self, running: RunningTurn) -> None:
        """On to the next decode pass."""
        self.decoding.append(running)

    def take_decoding(self) -> list[RunningTurn]:
        """The decode batch, now the step's: each comes back through `to_decode` or ends."""
        batch, self.decoding = self.decoding, []
        return batch

    def clear(self) -> None:
        """The engine stops: no turn is in any state (the endings answer them)."""
        self.queued.clear()
        self.head, self.prefilling, self.decoding = None, deque(), []
        self.fetching.clear()
