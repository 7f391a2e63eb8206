"""Rolling-window statistics for `GET /v1/stats` and the built-in dashboard: percentiles over the last
one and five minutes, and a ten-second series for the charts. The Prometheus histograms answer the
same questions for Grafana; this answers them without a Prometheus server. Event-loop only."""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

from chatd.engine.turn import TurnResult
from chatd.observability.metrics import TIERS, LiveState

WINDOWS = {"1m": 60.0, "5m": 300.0}
SERIES_STEP_S = 10.0
SERIES_POINTS = 30
KEEP_S = max(WINDOWS.values()) + SERIES_STEP_S
MAX_RECORDS = 100_000  # a bound on memory whatever the traffic
SNAPSHOT_MAX_AGE_S = 1.0  # dashboards polling at once share one snapshot (tens of ms under heavy traffic)


@dataclass(frozen=True)
class TurnRecord:
    """What the stats windows keep of one finished turn."""

    finished_at: float
    first_token_at: float | None  # None for a turn cancelled before its first token
    ttft_s: float
    e2e_s: float
    token_times: np.ndarray  # perf_counter() of each reply token
    prompt_tokens: int
    cached_tokens: int
    source: str
    miss_reason: str | None


def percentile(values: Iterable[float] | np.ndarray, q: float) -> float | None:
    """The q-th percentile by nearest rank (a value that occurred), or None when there are none. The one
    definition chatd uses: /v1/stats, the dashboard and every benchmark."""
    values = np.fromiter(values, dtype=float) if not isinstance(values, np.ndarray) else values
    return float(np.percentile(values, q, method="inverted_cdf")) if values.size else None


def percentiles(values: Iterable[float] | np.ndarray, scale: float = 1000.0) -> dict[str, float | None]:
    """p50, p95 and p99 by nearest rank, scaled (seconds to milliseconds by default); None when empty."""
    values = np.fromiter(values, dtype=float) if not isinstance(values, np.ndarray) else values
    return {f"p{q}": None if (found := percentile(values, q)) is None else round(found * scale, 3)
            for q in (50, 95, 99)}


class StatsRecorder:
    """Rolling windows over finished turns and tier samples, for /v1/stats and the dashboard."""

    def __init__(self, model_name: str, clock: Callable[[], float] = time.perf_counter):
        self.model_name = model_name
        self._clock = clock
        self._started = clock()
        self._turns: deque[TurnRecord] = deque(maxlen=MAX_RECORDS)
        self._errors: deque[tuple[float, str]] = deque(maxlen=MAX_RECORDS)
        self._samples: deque[tuple[float, LiveState]] = deque()
        self._snapshot: tuple[float, dict] | None = None

    def record_turn(self, result: TurnResult) -> None:
        now, ms = self._clock(), result.timings
        started = result.sampled
        self._turns.append(TurnRecord(
            finished_at=now, first_token_at=now - (ms["total_ms"] - ms["ttft_ms"]) / 1000 if started else None,
            ttft_s=ms["ttft_ms"] / 1000, e2e_s=ms["total_ms"] / 1000,
            token_times=np.asarray(result.token_times, dtype=float),
            prompt_tokens=result.prompt_tokens, cached_tokens=result.cached_tokens, source=result.cache_source,
            miss_reason=result.miss_reason))
        self._forget_before(now - KEEP_S)

    def record_error(self, code: str) -> None:
        self._errors.append((self._clock(), code))

    def sample(self, live: LiveState) -> None:
        """Remember the tiers and the cache counters now, for window deltas and the occupancy series."""
        now = self._clock()
        self._samples.append((now, live))
        self._forget_before(now - KEEP_S)

    def snapshot(self, live: LiveState) -> dict:
        now = self._clock()
        if self._snapshot is not None and now - self._snapshot[0] < SNAPSHOT_MAX_AGE_S:
            return self._snapshot[1]
        self.sample(live)
        tokens = self._tokens()
        snapshot = {
            "model": self.model_name,
            "uptime_s": round(now - self._started, 1),
            "now": self._now(live),
            "windows": {name: self._window(now - span, now, live, tokens) for name, span in WINDOWS.items()},
            "series": {"step_s": SERIES_STEP_S, "points": self._series(now, tokens[0])},
        }
        self._snapshot = (now, snapshot)
        return snapshot

    def _now(self, live: LiveState) -> dict:
        tiers = {}
        for tier in TIERS:
            used, budget = live.tier_bytes(tier)
            tiers[tier] = {"bytes": used, "budget_bytes": budget, "usage": round(used / budget, 4) if budget else 0.0,
                           "sessions": live.cache.get(f"{tier}_sessions"), "kv_dtype": live.kv_dtypes.get(tier)}
        tiers["device"]["kv_bytes"] = live.cache.get("device_kv_bytes", 0)  # keys and values of resident caches
        tiers["device"]["window_bytes"] = live.cache.get("device_window_bytes", 0)  # what their windows need
        tiers["device"]["private_kv_bytes"] = live.cache.get("device_private_kv_bytes", 0)  # without sharing
        tiers["device"]["shared"] = {key: live.cache.get(stat, 0) for key, stat in (
            ("segments", "prefixes"), ("pinned", "segments_pinned"), ("sessions", "shared_sessions"),
            ("users", "segment_users"), ("bytes", "segment_bytes"), ("host_segments", "host_segments"))}
        # Offloads that continued the host copy a cache was restored from wrote only what its turns added.
        tiers["host"]["offload"] = {"written_bytes": live.cache.get("host_offload_bytes", 0),
                                    "skipped_bytes": live.cache.get("host_offload_bytes_skipped", 0)}
        # Copies of system prompts' chunks, held once for every session of their owner.
        tiers["host"]["chunks"] = {"held": live.cache.get("host_chunk_copies", 0),
                                   "shared": live.cache.get("host_chunk_copies_shared", 0)}
        # Caches in Redis are chains of chunks: one Redis holds is renewed, not written again, nor fetched by a
        # worker that holds its positions.
        tiers["remote"]["chunks"] = {key: live.cache.get(f"remote_{stat}", 0) for key, stat in (
            ("known", "chunks_known"), ("written", "chunks_written"), ("written_bytes", "chunk_bytes_written"),
            ("renewed", "chunks_renewed"), ("not_sent_bytes", "chunk_bytes_not_sent"),
            ("not_copied_bytes", "snapshot_kv_bytes_skipped"), ("fetched", "chunks_fetched"),
            ("not_fetched_bytes", "bytes_not_fetched"), ("missing", "chunks_missing"), ("lost", "chunks_lost"))}
        # The remote tier's I/O beside the engine: what turns whose cache was in Redis did, the round trip, the queue.
        tiers["remote"]["fetches"] = {choice: live.cache.get(f"remote_decisions_{choice}", 0)
                                      for choice in ("fetch", "recompute", "timeout")}
        tiers["remote"]["round_trip_ms"] = live.cache.get("remote_round_trip_ms")
        tiers["remote"]["queue"] = {
            "writes": live.cache.get("remote_pending_writes", 0), "bytes": live.cache.get("remote_pending_bytes", 0),
            "deletes": live.cache.get("remote_pending_deletes", 0),
            "dropped": {reason: live.cache.get(f"remote_dropped_{reason}", 0)
                        for reason in ("full", "expired", "deletes")}}
        engine = {"threads": live.cache.get("engine_threads"), "threads_max": live.cache.get("engine_threads_max"),
                  "thread_changes": live.cache.get("engine_thread_changes", 0),
                  "cpu_taken_by_others": live.cache.get("cpu_taken_by_others", 0.0),
                  "fetching": live.cache.get("fetching_turns", 0),
                  "decode_steps_beside_fetches": live.cache.get("decode_steps_beside_fetches", 0),
                  "riding_prefills": live.cache.get("riding_prefills", 0), "speculation": _speculation(live.cache)}
        arena = {key.removeprefix("arena_"): value for key, value in live.cache.items() if key.startswith("arena_")}
        if arena:
            arena["outside_arena_turns"] = live.cache.get("outside_arena_turns", 0)
        return {"running": live.running, "waiting": live.waiting, "tiers": tiers, "kv": live.kv, "arena": arena,
                "redis": live.redis, "engine": engine, "prefix_index": live.prefix_index,
                "threads": {kind: live.message_threads.get(kind, 0) for kind in ("created", "continued", "not_found")},
                "responses_websocket": {"connections": 0, "lanes": 0, "queued": 0, "creates": 0, "warmups": 0,
                                        **live.responses_websocket},
                "sessions": {"connected": live.connected_sessions, "idle": live.cache.get("idle_sessions", 0)}}

    def _window(self, start: float, end: float, live: LiveState, tokens: tuple[np.ndarray, np.ndarray]) -> dict:
        finished = [t for t in self._turns if start < t.finished_at <= end]
        first = [t.ttft_s for t in self._turns if t.first_token_at is not None and start < t.first_token_at <= end]
        times, gaps = tokens
        in_window = (times > start) & (times <= end)
        span = min(end - start, end - self._started)
        before = self._sample_at(start)
        return {
            "seconds": round(span, 1),
            "turns": len(finished),
            "ttft_ms": percentiles(first),
            "inter_token_ms": percentiles(gaps[in_window & ~np.isnan(gaps)]),
            "e2e_ms": percentiles(t.e2e_s for t in finished if t.first_token_at is not None),
            "tokens_per_s": round(int(in_window.sum()) / span, 3) if span > 0 else 0.0,
            "cache": _cache_outcomes(finished),
            "evictions": _delta(live.evictions(), before.evictions() if before else None),
            "corruptions": _delta(live.corruptions(), before.corruptions() if before else None),
            "errors": dict(Counter(code for at, code in self._errors if start < at <= end)),
        }

    def _series(self, now: float, token_times: np.ndarray) -> list[dict]:
        """One point per step over the last SERIES_POINTS steps, each over (start, end]; None where
        nothing was measured."""
        offset = time.time() - now  # perf_counter -> unix time, for the charts' axes
        edges = now - SERIES_STEP_S * np.arange(SERIES_POINTS, -1, -1)
        bucket = lambda moment: int(np.searchsorted(edges, moment, side="left")) - 1  # noqa: E731
        first: list[list[float]] = [[] for _ in range(SERIES_POINTS)]
        finished: list[list[TurnRecord]] = [[] for _ in range(SERIES_POINTS)]
        for turn in self._turns:
            if turn.first_token_at is not None and 0 <= (index := bucket(turn.first_token_at)) < SERIES_POINTS:
                first[index].append(turn.ttft_s)
            if 0 <= (index := bucket(turn.finished_at)) < SERIES_POINTS:
                finished[index].append(turn)
        tokens, _ = np.histogram(token_times, bins=edges)
        points = []
        for index in range(SERIES_POINTS):
            at_start, at_end = self._sample_at(edges[index]), self._sample_at(edges[index + 1])
            point = {"t": round(float(edges[index + 1]) + offset, 3), "ttft_ms": percentiles(first[index]),
                     "tokens_per_s": round(int(tokens[index]) / SERIES_STEP_S, 3),
                     "cached_token_ratio": _cache_outcomes(finished[index])["cached_token_ratio"]
                     if finished[index] else None,
                     "tier_bytes": None, "arena_tokens": None, "evictions": None, "corruptions": None}
            if at_end is not None:
                point["tier_bytes"] = {tier: at_end.tier_bytes(tier)[0] for tier in TIERS}
                point["arena_tokens"] = {state: at_end.cache.get(f"arena_{state}_tokens", 0)
                                         for state in ("used", "reserved", "free")}
                point["evictions"] = _delta(at_end.evictions(), at_start.evictions() if at_start else None)
                point["corruptions"] = sum(_delta(at_end.corruptions(),
                                                  at_start.corruptions() if at_start else None).values())
            points.append(point)
        return points

    def _tokens(self) -> tuple[np.ndarray, np.ndarray]:
        """Every remembered reply token's time, and the gap since the same turn's previous token
        (NaN for a turn's first token)."""
        if not self._turns:
            return np.empty(0), np.empty(0)
        times = np.concatenate([t.token_times for t in self._turns])
        gaps = np.concatenate([np.diff(t.token_times, prepend=np.nan) for t in self._turns])
        return times, gaps

    def _sample_at(self, moment: float) -> LiveState | None:
        """The latest sample taken at or before `moment`."""
        found = None
        for at, live in self._samples:
            if at > moment:
                break
            found = live
        return found

    def _forget_before(self, moment: float) -> None:
        while self._turns and self._turns[0].finished_at < moment:
            self._turns.popleft()
        while self._errors and self._errors[0][0] < moment:
            self._errors.popleft()
        while len(self._samples) > 1 and self._samples[1][0] < moment:  # keep one sample before the window
            self._samples.popleft()


def _cache_outcomes(turns: list[TurnRecord]) -> dict:
    """Where the caches of these turns came from: turns by source, the share of turns that reused a
    cache, and the share of prompt tokens each source covered."""
    looked_up = [t for t in turns if t.prompt_tokens]
    prompt_tokens = sum(t.prompt_tokens for t in looked_up)
    cached = Counter()
    for t in looked_up:
        if t.source != "miss":
            cached[t.source] += t.cached_tokens
    return {
        "turns_by_source": dict(Counter(t.source for t in looked_up)),
        "hit_ratio": round(sum(t.source != "miss" for t in looked_up) / len(looked_up), 4) if looked_up else None,
        "cached_token_ratio": {source: round(n / prompt_tokens, 4) for source, n in cached.items()}
        if prompt_tokens else {},
        "miss_reasons": dict(Counter(t.miss_reason for t in looked_up if t.source == "miss")),
    }


def _delta(now: dict[str, int], before: dict[str, int] | None) -> dict[str, int]:
    """Counter increase since `before` (everything so far when there is no earlier sample)."""
    return {key: value - (before or {}).get(key, 0) for key, value in now.items()}


def _speculation(cache: dict) -> dict:
    """Drafts verified, their tokens, those accepted (and the share: the acceptance rate), by position."""
    drafted, accepted = cache.get("spec_draft_tokens", 0), cache.get("spec_accepted_tokens", 0)
    return {"max_tokens": cache.get("spec_max_tokens", 0), "drafts": cache.get("spec_drafts", 0),
            "draft_tokens": drafted, "accepted_tokens": accepted,
            "acceptance": round(accepted / drafted, 4) if drafted else None,
            "accepted_per_position": {key.removeprefix("spec_accepted_at_"): count for key, count in sorted(
                cache.items()) if key.startswith("spec_accepted_at_")}}
