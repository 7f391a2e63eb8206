"""The step planner without a model (as vLLM's scheduler tests run theirs): admission, the prefill budget, riders, a
full arena and a fetch, over a real cache store and KV arena of hand-made sizes. A chunk is "run" by taking its
tokens off the turn's pending prompt, as the updater does after the forward pass."""

import time
from concurrent.futures import Future

import pytest
import torch

from cache_store import ArenaCache, RemoteFetch, TemporaryCache
from cache_store.checks.stage_faults import FaultPoints
from chatd.config import Settings
from chatd.engine.drafts import ReplyBooks, Speculator
from chatd.engine.endings import TurnEndings
from chatd.engine.planner import StepPlanner
from chatd.engine.running_turn import RunningTurn
from chatd.engine.sampling import SamplingParams
from chatd.engine.step_plan import PrefillChunk, StepCounts
from chatd.engine.turn import Turn, TurnFailed, TurnResult
from chatd.engine.turn_queues import TurnQueues
from chatd.engine.turn_setup import CacheFinder
from tests.test_cache_store import BYTES_PER_TOKEN, arena_store


class Runner:
    """What the cache finder asks of the model runner: new caches, in the arena or beside it."""

    def __init__(self, arena):
        self.arena = arena

    def new_cache(self, tokens: int = 0) -> ArenaCache:
        return ArenaCache(self.arena)

    def scratch_cache(self) -> TemporaryCache:
        return TemporaryCache()


class Preparer:
    """Renders a turn as its session id says: `<name>:<prompt tokens>:<max new tokens>`."""

    def __init__(self, reserve: bool):
        self.reserve = reserve

    def prepare(self, turn: Turn) -> RunningTurn:
        _, prompt, new = turn.session_id.split(":")
        prompt_ids = list(range(100, 100 + int(prompt)))
        nbytes = (len(prompt_ids) + int(new)) * BYTES_PER_TOKEN if self.reserve else 0
        return RunningTurn(turn, prompt_ids, 0, int(new), None, None, time.perf_counter(), reserve_bytes=nbytes)


class Desk:
    """A planner over a real store and arena, the turns' states, and what ended."""

    def __init__(self, arena_tokens: int = 1000, reserve: bool = True, **settings):
        self.store, self.arena = arena_store(arena_tokens)
        self.arena.make_room = lambda tokens: self.store.evict_one()  # (as the engine wires it)
        self.settings = Settings(speculation="off", verify_sample_rate=0.0, **settings)
        self.faults, self.speculator, self.counts = FaultPoints(), Speculator(0, ReplyBooks()), StepCounts()
        self.queues = TurnQueues(wake=lambda: None)
        self.endings = TurnEndings(self.store, self.faults, self.speculator)
        self.finder = CacheFinder(self.store, Runner(self.arena), self.settings, torch.float32)
        self.planner = StepPlanner(self.settings, self.queues, self.store, self.arena, Preparer(reserve), self.finder,
                                   None, self.speculator, self.faults, self.endings, self.counts, lambda: None)
        self.events: dict[str, list] = {}

    def submit(self, session_id: str) -> Turn:
        events = self.events.setdefault(session_id, [])
        turn = Turn("t-" + session_id, session_id, [], SamplingParams(), events.append)
        self.queues.take(turn)
        self.endings.took(turn)
        return turn

    def step(self, riders: list[RunningTurn] | None = None) -> list[PrefillChunk]:
        """Admission and this step's prefill chunks, each run as it is planned; a prompt all fed goes on to decode."""
        self.planner.collect_fetches()
        self.planner.admit()
        chunks = []
        for chunk in self.planner.prefill_chunks([] if riders is None else riders):
            chunks.append(chunk)
            running = chunk.running
            running.pending = running.pending[len(chunk.tokens):]
            if not running.pending:
                self.queues.left_prefill(running)
                running.next_input = running.prompt_ids[-1]
                self.queues.to_decode(running)
        self.endings.announce()
        return chunks

    def names(self, turns) -> list[str]:
        return [running.turn.session_id.split(":")[0] for running in turns]


def test_turns_are_admitted_oldest_first_under_the_batch_size_and_the_device_budget():
    desk = Desk(arena_tokens=100, max_batch=2, prefill_chunk=512)
    for session in ("a:30:20", "b:20:20", "c:10:10"):
        desk.submit(session)
    desk.planner.admit()  # the batch holds two: c waits in the queue
    assert desk.names(desk.queues.prefilling) == ["a", "b"] and len(desk.queues.queued) == 1
    desk = Desk(arena_tokens=100, max_batch=4, prefill_chunk=512)
    for session in ("a:30:30", "b:30:20", "c:10:10"):
        desk.submit(session)
    desk.planner.admit()  # b may reach 50 tokens, over what a's 60 leave of the 100: b waits first, c behind it
    assert desk.names(desk.queues.prefilling) == ["a"]
    assert desk.queues.head.turn.session_id == "b:30:20" and len(desk.queues.queued) == 1
    assert desk.queues.has_work(4)  # (a has its prompt to feed)


def test_prefill_chunks_share_the_step_budget_oldest_first():
    desk = Desk(prefill_chunk=8)
    desk.submit("a:20:4")
    desk.submit("b:5:4")
    sizes = [[(desk.names([c.running])[0], len(c.tokens)) for c in desk.step()] for _ in range(3)]
    assert sizes == [[("a", 8)], [("a", 8)], [("a", 4), ("b", 4)]]
    assert desk.names(desk.queues.decoding) == ["a"] and desk.names(desk.queues.prefilling) == ["b"]


def test_a_short_prompt_rides_the_decode_pass_as_one_more_row():
    desk = Desk(prefill_chunk=16)
    desk.submit("a:6:8")
    desk.step()
    assert desk.names(desk.queues.decoding) == ["a"]
    desk.submit("b:5:8")
    riders: list[RunningTurn] = []
    assert desk.step(riders) == [] and desk.names(riders) == ["b"]  # no chunk alone: it rides
    plan = desk.planner.decode_plan(riders)
    assert [(row.inputs, row.rides) for row in plan.rows] == [([105], False), (list(range(100, 105)), True)]
    assert plan.decoding == 1 and not desk.queues.decoding and not desk.queues.prefilling  # the plan's, until taken
    assert desk.counts.batch_sizes[1] == 1


def test_a_full_arena_makes_a_turn_wait_while_one_decodes_and_answers_busy_when_none_does():
    desk = Desk(arena_tokens=64, reserve=False, prefill_chunk=64)
    desk.submit("a:10:40")
    desk.step()
    desk.submit("b:10:40")  # 50 more tokens do not fit beside a's 50
    assert desk.step() == [] and desk.names(desk.queues.prefilling) == ["b"]  # it waits first in line
    a = desk.queues.take_decoding()[0]
    desk.endings.turned_away(a, TurnFailed("busy", "made to end here"))  # a ends: its region is free again
    assert [len(c.tokens) for c in desk.step()] == [10]
    desk.submit("c:10:40")
    desk.queues.take_decoding()  # none decodes now: c can only be refused
    assert desk.step() == [] and not desk.queues.prefilling
    (refused,) = desk.events["c:10:40"]
    assert isinstance(refused, TurnFailed) and refused.code == "busy"
    assert not desk.store.device.is_running("c:10:40")  # its claim on the cache let go


def test_a_turn_longer_than_the_whole_arena_runs_beside_it():
    desk = Desk(arena_tokens=64, reserve=False, prefill_chunk=512)
    desk.submit("long:30:100")
    (chunk,) = desk.step()
    assert len(chunk.tokens) == 30 and desk.counts.outside_arena_turns == 1
    assert not isinstance(chunk.running.entry.cache, ArenaCache)


@pytest.mark.parametrize("cancel", [False, True])
def test_a_fetching_turn_waits_beside_the_batch_and_comes_back_first(monkeypatch, cancel):
    desk = Desk(prefill_chunk=512)
    jobs: list[Future] = []

    def start_fetch(request, prompt_tokens, done):
        jobs.append(Future())
        return RemoteFetch(jobs[-1], time.monotonic(), 60.0, None)

    monkeypatch.setattr(desk.store, "start_fetch", start_fetch)
    monkeypatch.setattr(desk.finder, "remote_request", lambda running: object() if not jobs else None)
    desk.submit("far:10:4")
    desk.submit("near:10:4")
    chunks = desk.step()  # far's cache is on its way: near is prefilled meanwhile
    assert desk.names([c.running for c in chunks]) == ["near"] and desk.names(desk.queues.fetching) == ["far"]
    assert desk.step() == [] and len(desk.queues.fetching) == 1  # still fetching
    if cancel:
        desk.queues.fetching._turns[0].turn.cancel()
    else:
        jobs[0].set_result(None)
    desk.planner.collect_fetches()
    desk.endings.announce()
    assert not desk.queues.fetching
    if cancel:
        (ended,) = desk.events["far:10:4"]
        assert isinstance(ended, TurnResult) and ended.finish_reason == "cancelled" and jobs[0].cancelled()
        assert not desk.store.device.is_running("far:10:4") and not desk.queues.prefilling
    else:
        assert desk.names(desk.queues.prefilling) == ["far"]
