"""The small pieces on their own, with fake clocks: stats windows, the rate limiter, turn-log expiry,
key identification, the context window and the in-memory store's retention."""

import pytest
from websockets.datastructures import Headers

from chatd.api.auth import KeyRing, key_id
from chatd.api.rate_limit import RateLimiter
from chatd.api.websocket.turn_log import TurnLogs
from chatd.engine.turn import TurnResult
from chatd.model.context_window import DoesNotFit, fit
from chatd.model.prompt import PromptRenderer
from chatd.observability.metrics import LiveState
from chatd.observability.stats import StatsRecorder, percentiles
from sessions import InMemorySessionStore, Message


class Clock:
    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def turn_at(clock: Clock, ttft_s: float, tokens: int, source: str = "device") -> TurnResult:
    times = [clock.now - (tokens - 1 - i) * 0.05 for i in range(tokens)]
    total = ttft_s + (tokens - 1) * 0.05
    return TurnResult(finish_reason="stop", content="", prompt_tokens=100, completion_tokens=tokens,
                      cached_tokens=0 if source == "miss" else 90, cache_source=source,
                      miss_reason="new" if source == "miss" else None, token_ids=[], token_times=times,
                      timings={"queue_ms": 0.0, "ttft_ms": ttft_s * 1000, "prefill_ms": 0.0, "decode_ms": 0.0,
                               "total_ms": total * 1000, "tokens_per_s": 20.0})


def test_percentiles_are_nearest_rank():
    assert percentiles([0.1, 0.2, 0.3, 0.4]) == {"p50": 200.0, "p95": 400.0, "p99": 400.0}
    assert percentiles([]) == {"p50": None, "p95": None, "p99": None}


def test_stats_windows_count_only_their_own_minutes():
    clock = Clock()
    stats = StatsRecorder("m", clock=clock)
    live = LiveState(cache={"device_evictions": 2})
    stats.sample(live)
    stats.record_turn(turn_at(clock, 2.0, 5, "miss"))  # will be 2 minutes old
    clock.now += 120
    stats.sample(LiveState(cache={"device_evictions": 5}))
    stats.record_turn(turn_at(clock, 0.1, 11, "device"))
    stats.record_error("busy")
    snapshot = stats.snapshot(LiveState(cache={"device_evictions": 7, "corrupt_checksum": 1}))
    one, five = snapshot["windows"]["1m"], snapshot["windows"]["5m"]
    assert (one["turns"], five["turns"]) == (1, 2)
    assert one["ttft_ms"]["p50"] == 100.0 and five["ttft_ms"]["p99"] == 2000.0
    assert one["inter_token_ms"]["p50"] == pytest.approx(50.0)
    assert one["tokens_per_s"] == round(11 / 60, 3) and one["seconds"] == 60.0
    assert one["cache"]["turns_by_source"] == {"device": 1} and five["cache"]["miss_reasons"] == {"new": 1}
    assert five["cache"]["hit_ratio"] == 0.5 and five["cache"]["cached_token_ratio"] == {"device": 0.45}
    assert one["evictions"]["device"] == 7 - 2 and five["evictions"]["device"] == 7  # since the sample before each
    assert one["corruptions"]["checksum"] == 1 and one["errors"] == {"busy": 1}
    points = snapshot["series"]["points"]
    assert len(points) == 30 and points[-1]["ttft_ms"]["p50"] == 100.0 and points[-1]["tokens_per_s"] == 1.1
    clock.now += 0.5  # polls within a second share one snapshot
    assert stats.snapshot(LiveState()) is snapshot


def test_rate_limiter_allows_a_minutes_burst_then_refills():
    clock = Clock()
    limiter = RateLimiter(6, clock=clock)
    assert [limiter.acquire("a") for _ in range(6)] == [None] * 6
    assert limiter.acquire("a") == pytest.approx(10.0)  # one turn every 10 s at 6 a minute
    assert limiter.acquire("b") is None  # clients are counted apart
    clock.now += 10
    assert limiter.acquire("a") is None and limiter.acquire("a") == pytest.approx(10.0)
    assert RateLimiter(None).acquire("a") is None


def test_turn_logs_expire_after_their_ttl_and_are_per_owner():
    clock = Clock()
    logs = TurnLogs(ttl_s=60, clock=clock)
    turn = type("T", (), {"turn_id": "t1"})()
    log = logs.start(turn, "key-a", subscriber=None)
    assert logs.get("key-b", "t1") is None and logs.get("key-a", "t1") is log
    clock.now += 600
    assert logs.get("key-a", "t1") is log  # running: kept however long it takes
    logs.finish(log)
    clock.now += 59
    assert logs.get("key-a", "t1") is log
    clock.now += 2
    assert logs.get("key-a", "t1") is None


def test_keys_identify_by_digest_and_bearer_header():
    ring = KeyRing(["sk-1", "sk-2", "sk-1"])
    assert ring.required and ring.identify("sk-2") == key_id("sk-2") and ring.identify("sk-3") is None
    assert key_id("sk-1").startswith("key-") and "sk-1" not in key_id("sk-1")
    assert ring.bearer(Headers({"Authorization": "Bearer sk-1"})) == (True, key_id("sk-1"))
    assert ring.bearer(Headers({"Authorization": "Basic sk-1"})) == (True, None)
    assert ring.bearer(Headers()) == (False, None)
    assert not KeyRing([]).required


def test_context_window_drops_whole_turns_and_keeps_the_system_prompt(tiny):
    renderer = PromptRenderer(tiny.tokenizer)
    system = Message("system", "Be brief.")
    history = []
    for index in range(6):
        history += [Message("user", f"question {index} " + "pedal " * 40), Message("assistant", "answer " * 30)]
    new = Message("user", "and now?")
    whole = len(renderer.render([system, *history, new]))
    window = fit(renderer, [system, *history, new], dropped_turns=0, context=whole + 10, room=10)
    assert window.dropped_turns == 0 and len(window.prompt_ids) == whole
    window = fit(renderer, [system, *history, new], dropped_turns=0, context=whole, room=10)
    assert window.dropped_turns >= 1 and window.messages[0] == system and window.messages[-1] == new
    assert window.messages[1:-1] == history[2 * window.dropped_turns:]  # whole turns, oldest first
    assert len(window.prompt_ids) + 10 <= 0.75 * whole  # refilled to three quarters
    again = fit(renderer, [system, *history, new], dropped_turns=window.dropped_turns, context=whole, room=10)
    assert again.prompt_ids == window.prompt_ids  # the next turn renders the same window
    with pytest.raises(DoesNotFit):
        fit(renderer, [system, Message("user", "spoke " * 200)], dropped_turns=0, context=100, room=10)


async def test_the_memory_store_forgets_sessions_unused_for_the_retention_time():
    clock = Clock()
    store = InMemorySessionStore(retention_s=60, clock=clock)
    idle, active = await store.create(None), await store.create("sys")
    clock.now += 40
    await store.append_turn(active, "hi", "hello", [1, 2])  # a turn counts as use
    clock.now += 30  # idle: 70 s unused; active: 30 s
    assert await store.get(idle.session_id) is None
    assert (await store.get(active.session_id)).turns == 1
    clock.now += 59  # a read counts as use too
    assert await store.get(active.session_id) is not None
    clock.now += 61
    await store.create(None)  # creating sweeps as well
    assert len(store) == 1 and await store.get(active.session_id) is None
