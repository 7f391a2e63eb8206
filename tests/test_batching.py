"""Batched decoding across sessions in the KV arena (tiny model, and SmolLM2 on the bench scenarios):
the same tokens as one turn at a time, FIFO admission, and a cancel that leaves the rest of the batch alone."""

import json
import threading
from pathlib import Path

from chatd.engine import engine as engine_module
from sessions import Session
from tests.support import run_together, run_turn, running_engine

SCENARIOS = Path(__file__).resolve().parent.parent / "bench" / "scenarios"
QUESTIONS = ["Where is my parcel?", "My invoice is wrong.", "I need a new password.", "Cancel my order 12.",
             "Is the shop open on Sunday?", "Do you ship to Norway?"]


def test_batched_turns_generate_exactly_what_one_at_a_time_does(tiny):
    with running_engine(tiny, max_batch=4) as batched, running_engine(tiny, max_batch=1) as serial:
        together = [Session(f"b{i}", system="Be brief.") for i in range(6)]
        alone = [Session(f"s{i}", system="Be brief.") for i in range(6)]
        lengths = [8 + 3 * i for i in range(6)]  # sessions join and leave the batch at different steps
        for round_index in range(2):
            contents = [f"{q} (round {round_index})" for q in QUESTIONS]
            got = run_together(batched, together, contents, lengths)
            for session, content, length, result in zip(alone, contents, lengths, got, strict=True):
                expected, _ = run_turn(serial, session, content, max_new_tokens=length)
                assert result.token_ids == expected.token_ids
                assert result.cached_tokens == expected.cached_tokens
        assert max(batched.counts.batch_sizes) == 4, "the batch filled up to --max-batch"
        assert set(serial.counts.batch_sizes) == {1}


def test_a_returning_customers_message_rides_the_others_decode_step_exactly(tiny):
    """Its new message, on top of its cache, is fed as one more row of the decode step (one pass for both)."""
    with running_engine(tiny, max_batch=4) as batched, running_engine(tiny, max_batch=1) as serial:
        sessions = [Session(f"r{i}", system="Be brief.") for i in range(3)]
        alone = [Session(f"r{i}", system="Be brief.") for i in range(3)]
        for round_index in range(3):
            contents = [f"{question} (round {round_index})" for question in QUESTIONS[:3]]
            lengths = [30, 6, 8]  # the first decodes on while the others' next messages arrive
            for session, content, length, result in zip(alone, contents, lengths,
                                                        run_together(batched, sessions, contents, lengths),
                                                        strict=True):
                expected, _ = run_turn(serial, session, content, max_new_tokens=length)
                assert result.token_ids == expected.token_ids and result.cached_tokens == expected.cached_tokens
        assert batched.counts.riding_prefills > 0, "a prompt's last chunk was fed in a decode step"
        assert serial.counts.riding_prefills == 0, "with nothing decoding, a prompt is fed on its own"


def test_a_cancel_leaves_the_rest_of_the_batch_alone(tiny):
    with running_engine(tiny, max_batch=4) as batched, running_engine(tiny, max_batch=1) as serial:
        sessions = [Session(f"b{i}") for i in range(3)]

        def cancel_the_middle_one(turn, _):
            if turn.turn_id == "t1":
                turn.cancel()

        got = run_together(batched, sessions, QUESTIONS[:3], [20] * 3, on_text=cancel_the_middle_one)
        assert [r.finish_reason for r in got] == ["length", "cancelled", "length"]
        for index in (0, 2):
            expected, _ = run_turn(serial, Session(f"s{index}"), QUESTIONS[index], max_new_tokens=20)
            assert got[index].token_ids == expected.token_ids
        assert batched.cache.device.get("b1") is None, "a cancelled first turn leaves no cache"
        assert batched.cache.device.get("b0").is_consistent()


def test_admission_is_first_in_first_out(tiny):
    """Told by the order in which the turns streamed, not by their clocks (each turn's clock starts when it is
    made: on a crowded CPU the test thread itself can pause between two turns)."""
    streamed = []
    with running_engine(tiny, max_batch=1) as engine:
        run_together(engine, [Session(f"s{i}") for i in range(4)], QUESTIONS[:4], [6] * 4,
                     on_text=lambda turn, _: streamed.append(turn.turn_id))
    assert set(streamed) == {"t0", "t1", "t2", "t3"}
    assert streamed == sorted(streamed), "each turn streamed after the one submitted before it"


def test_a_long_prompt_is_prefilled_in_chunks_between_the_others_decode_steps(tiny):
    with running_engine(tiny, max_batch=4, prefill_chunk=8) as chunked, \
            running_engine(tiny, max_batch=1, prefill_chunk=10_000) as whole:
        pasted = "Here is the full text of my contract: " + "clause " * 150
        streamed = []  # (each piece's turn, and the prompt chunks fed so far)
        counts = chunked.counts
        short, long = run_together(chunked, [Session("short"), Session("long")], ["hi", pasted], [10, 5],
                                   on_text=lambda turn, _: streamed.append((turn.turn_id, counts.prefill_chunks)))
        # (told by the order of the streamed pieces: the engine's steps, not the clocks of turns made at two moments)
        order = [turn_id for turn_id, _ in streamed]
        assert order.index("t1") == order.count("t0") > 0, "the short reply streamed before the long one's first token"
        short_chunks = [chunks for turn_id, chunks in streamed if turn_id == "t0"]
        assert short_chunks[-1] - short_chunks[0] >= len(short_chunks) - 1, "a chunk of the long prompt each step"
        assert chunked.counts.prefill_chunks >= long.prompt_tokens // 8
        for session, content, length, result in (("s", "hi", 10, short), ("l", pasted, 5, long)):
            expected, _ = run_turn(whole, Session(session), content, max_new_tokens=length)
            assert result.token_ids == expected.token_ids


def test_a_cancel_during_a_long_prefill_ends_the_turn(tiny):
    with running_engine(tiny, max_batch=2, prefill_chunk=4) as engine:
        streamed = []

        def cancel_the_long_one(turn, turns):
            # Once the short turn decodes, each engine step feeds one chunk of the long prompt and
            # decodes one token of the short turn: by its fourth piece of text, the long prefill is
            # under way.
            if turn.turn_id == "t0":
                streamed.append(turn)
                if len(streamed) == 4:
                    turns[1].cancel()

        got = run_together(engine, [Session("a"), Session("b")], ["hi", "clause " * 200], [12, 5],
                           on_text=cancel_the_long_one)
        assert (got[1].finish_reason, got[1].completion_tokens) == ("cancelled", 0)
        assert got[1].prompt_tokens > 200 and engine.cache.device.get("b") is None
        assert engine.counts.prefill_chunks < 200 / 4, "the prefill stopped early"


def test_smollm2_batched_in_the_arena_answers_the_bench_scenarios_like_one_at_a_time(smollm2):
    """The real model in float32, the bench's scenarios, two turns each (the second resuming each session's cache):
    the batched arena step gives the greedy tokens of `--max-batch 1`, token for token."""
    scenarios = [json.loads(path.read_text()) for path in sorted(SCENARIOS.glob("*.json"))]
    with running_engine(smollm2) as batched, running_engine(smollm2, max_batch=1) as alone:
        together = [Session(s["name"], system=s["system"]) for s in scenarios]
        one_by_one = [Session(s["name"], system=s["system"]) for s in scenarios]
        for turn in range(2):
            contents = [s["turns"][turn] for s in scenarios]
            got = run_together(batched, together, contents, [16] * len(scenarios))
            expected = run_together(alone, one_by_one, contents, [16] * len(scenarios))
            for scenario, a, b in zip(scenarios, got, expected, strict=True):
                assert a.token_ids == b.token_ids, f"{scenario['name']}, turn {turn + 1}"
        assert max(batched.counts.batch_sizes) == len(scenarios) and set(alone.counts.batch_sizes) == {1}


def test_turns_queued_behind_a_full_batch_start_as_soon_as_it_empties(tiny, monkeypatch):
    """With --max-batch 1 the turns behind the first wait in the queue; once the batch is empty the engine starts the
    next at once. (Before, it slept until its housekeeping wake-up, a second each time: made a minute here, so that
    only an engine that idles with work queued runs into the wait's limit.)"""
    monkeypatch.setattr(engine_module, "EXPIRE_EVERY_S", 60.0)
    with running_engine(tiny, max_batch=1) as engine:
        sessions = [Session(f"q{i}") for i in range(3)]
        done = threading.Event()
        threading.Thread(target=lambda: (run_together(engine, sessions, QUESTIONS[:3], [4] * 3), done.set()),
                         daemon=True).start()
        assert done.wait(30), "a queued turn waited for the engine's housekeeping wake-up"
    assert [len(session.messages) for session in sessions] == [2, 2, 2]
