"""The engine with a tiny random model: cached turns must generate exactly what uncached turns do."""

from cache_store import common_prefix_length
from chatd.engine.turn import TurnFailed
from chatd.model.prompt import PromptRenderer
from sessions import Message, Session
from tests.support import TINY_CONTEXT, run_turn, running_engine

CONVERSATION = [
    "Hi, I was charged twice for my subscription this month.",
    "The charges are from the 3rd and the 5th.",
    "My account email is ana@example.com.",
    "Can you refund the second one?",
    "How long does a refund take?",
    "Thanks, that's all.",
]


def assert_cache_matches(engine, session_id, prompt_ids, result):
    """The stored cache covers exactly the ids that were fed: the prompt and the reply tokens
    (the last sampled token is only fed when the reply ended on an end-of-turn token)."""
    entry = engine.cache.device.get(session_id)
    fed = result.token_ids if result.finish_reason == "stop" else result.token_ids[:-1]
    assert entry.token_ids == prompt_ids + fed
    assert entry.seq_lengths() == [len(entry.token_ids)] * len(entry.cache.layers)


def test_cached_and_uncached_generation_are_identical_over_six_turns(tiny):
    renderer = PromptRenderer(tiny.tokenizer)
    with running_engine(tiny) as cached, running_engine(tiny, session_cache=False) as uncached:
        system = "You are a billing agent."
        with_cache, without_cache = Session("a", system=system), Session("b", system=system)
        for turn, content in enumerate(CONVERSATION):
            prompt_ids = renderer.render(with_cache.prompt_messages(content))
            hit, _ = run_turn(cached, with_cache, content, max_new_tokens=24)
            miss, _ = run_turn(uncached, without_cache, content, max_new_tokens=24)
            assert hit.token_ids == miss.token_ids, f"turn {turn + 1} differs"
            assert hit.prompt_tokens == miss.prompt_tokens == len(prompt_ids)
            assert miss.cached_tokens == 0 and miss.miss_reason == "disabled"
            if turn == 0:
                assert (hit.cache_source, hit.miss_reason) == ("miss", "new")
            else:
                assert hit.cache_source == "device" and hit.cached_tokens > 0
            assert_cache_matches(cached, "a", prompt_ids, hit)
        assert len(uncached.cache.device) == 0


def cached_ids(engine, session_id) -> list[int]:
    return list(engine.cache.device.get(session_id).token_ids)


def test_the_next_turn_reuses_the_longest_common_prefix(tiny):
    renderer = PromptRenderer(tiny.tokenizer)
    with running_engine(tiny) as engine:
        session = Session("s")
        first, _ = run_turn(engine, session, CONVERSATION[0], max_new_tokens=8)
        covered = cached_ids(engine, "s")
        prompt_ids = renderer.render(session.prompt_messages(CONVERSATION[1]))
        second, _ = run_turn(engine, session, CONVERSATION[1], max_new_tokens=8)
        assert second.cached_tokens == common_prefix_length(covered, prompt_ids)
        # The first prompt is always reusable; the reply too unless its re-tokenization differs.
        assert second.cached_tokens >= first.prompt_tokens


def test_divergent_history_is_cropped_and_still_answers_like_a_fresh_prefill(tiny):
    renderer = PromptRenderer(tiny.tokenizer)
    with running_engine(tiny) as engine, running_engine(tiny, session_cache=False) as reference:
        session = Session("s", system="You are a travel agent.")
        for content in CONVERSATION[:3]:
            run_turn(engine, session, content, max_new_tokens=12)
        covered = cached_ids(engine, "s")
        # An operator edits the second reply: everything after it must be recomputed.
        session.messages[3] = Message("assistant", "I have noted both dates.")
        prompt_ids = renderer.render(session.prompt_messages("What now?"))
        keep = common_prefix_length(covered, prompt_ids)
        assert 0 < keep < len(covered) - 20
        result, _ = run_turn(engine, session, "What now?", max_new_tokens=12, record=False)
        expected, _ = run_turn(reference, session, "What now?", max_new_tokens=12, record=False)
        assert (result.cache_source, result.cached_tokens) == ("device", keep)
        assert result.token_ids == expected.token_ids


def test_cancel_mid_turn_leaves_a_usable_session(tiny):
    with running_engine(tiny) as engine, running_engine(tiny, session_cache=False) as reference:
        session, twin = Session("s"), Session("t")
        for content in CONVERSATION[:2]:
            done, _ = run_turn(engine, session, content, max_new_tokens=10)
            run_turn(reference, twin, content, max_new_tokens=10)
        ids_before = cached_ids(engine, "s")

        cancelled, deltas = run_turn(engine, session, "Please write me a long essay.", max_new_tokens=200,
                                     on_text=lambda turn, text: turn.cancel())
        assert cancelled.finish_reason == "cancelled"
        assert 1 <= cancelled.completion_tokens < 200 and deltas
        entry = engine.cache.device.get("s")
        assert entry.is_consistent() and ids_before[:entry.num_tokens] == entry.token_ids
        assert len(session.messages) == 4, "a cancelled turn is not recorded"

        after, _ = run_turn(engine, session, CONVERSATION[2], max_new_tokens=10)
        expected, _ = run_turn(reference, twin, CONVERSATION[2], max_new_tokens=10)
        assert after.cache_source == "device" and after.token_ids == expected.token_ids


def test_a_prompt_beyond_the_context_is_too_long_and_the_session_survives(tiny):
    with running_engine(tiny) as engine:
        session = Session("s")
        run_turn(engine, session, "hello", max_new_tokens=4)
        failed, _ = run_turn(engine, session, "word " * TINY_CONTEXT, max_new_tokens=4)
        assert isinstance(failed, TurnFailed) and failed.code == "too_long"
        ok, _ = run_turn(engine, session, "still there?", max_new_tokens=4)
        assert ok.cache_source == "device" and ok.completion_tokens == 4


def test_reply_length_is_capped_by_the_context(tiny):
    """The prompt fits with a quarter of the context left for the reply; a longer reply stops at the end."""
    with running_engine(tiny) as engine:
        session = Session("s")
        result, _ = run_turn(engine, session, "word " * (TINY_CONTEXT - 180), max_new_tokens=200)
        assert result.finish_reason == "length"
        assert result.prompt_tokens + result.completion_tokens == TINY_CONTEXT


def test_seeded_sampling_is_reproducible_and_differs_from_greedy(tiny):
    with running_engine(tiny, session_cache=False) as engine:
        params = {"max_new_tokens": 16, "temperature": 1.0, "top_p": 0.9, "seed": 7}
        first, _ = run_turn(engine, Session("a"), "Tell me a story.", **params)
        again, _ = run_turn(engine, Session("b"), "Tell me a story.", **params)
        greedy, _ = run_turn(engine, Session("c"), "Tell me a story.", max_new_tokens=16)
        assert first.token_ids == again.token_ids
        assert first.token_ids != greedy.token_ids


def test_stop_string_ends_the_reply(tiny):
    with running_engine(tiny, session_cache=False) as engine:
        free, _ = run_turn(engine, Session("a"), "Say something.", max_new_tokens=30)
        stop = free.content[5:8]
        stopped, deltas = run_turn(engine, Session("b"), "Say something.", max_new_tokens=30, stop=[stop])
        assert stopped.finish_reason == "stop"
        assert stopped.content == free.content[:free.content.index(stop)]
        assert "".join(deltas) == stopped.content


def test_a_long_system_prompt_is_prefilled_in_chunks_between_the_others_decode_steps(smollm2_dir):
    """A 20,000-token policy is prefilled --prefill-chunk tokens at a time, like any long prompt, with another
    conversation's decode steps between its chunks (it once took one pass that every stream waited for); it is
    still shared as a segment by the next session with that policy, whose sampled deep check (20,000 tokens
    recomputed from scratch) runs in chunks between the other's steps too."""
    import threading

    import torch

    from tests.support import tiny_model

    long_context = tiny_model(smollm2_dir, context=32_768)
    long_context.model.to(torch.float32)  # (what is tested is the order of the work: float32 is 8x faster here)
    policy = " ".join(f"Rule {number}: refunds for order class {number} take {number % 9 + 5} days."
                      for number in range(990))
    assert len(PromptRenderer(long_context.tokenizer).render([Message("system", policy)])) > 20_000

    def beside_a_stream(engine, session, content):
        """`session`'s turn, started while another conversation streams: its result, and how many of the other's
        tokens came while it was before its first token."""
        first_piece, results = threading.Event(), {}

        def stream():
            results["other"] = run_turn(engine, Session(f"other-{session.session_id}", system="Be brief."),
                                        "Tell me a long story.", lambda turn, text: first_piece.set(),
                                        max_new_tokens=300)[0]

        streamer = threading.Thread(target=stream)
        streamer.start()
        assert first_piece.wait(60)
        result, _ = run_turn(engine, session, content, max_new_tokens=4)
        streamer.join(120)
        prefill_end = result.token_times[0]
        prefill_start = prefill_end - result.timings["prefill_ms"] / 1000
        return result, sum(prefill_start < t < prefill_end for t in results["other"].token_times)

    with running_engine(long_context, prefill_chunk=256, verify_sample_rate=1.0) as engine:
        chunks_before = engine.counts.prefill_chunks
        read, between = beside_a_stream(engine, Session("reading", system=policy), "How long does a refund take?")
        assert engine.counts.prefill_chunks - chunks_before >= 20_000 // 256, "the policy went in chunks"
        assert between >= 50, "the other conversation decoded between the policy's chunks"
        again, between = beside_a_stream(engine, Session("next", system=policy), "And for class 7?")
        assert again.cache_source == "prefix" and again.cached_tokens > 20_000
        # (checked: this reuse of the policy, and the other conversation's of its short prompt, copied)
        assert len(engine.deep_check_distances) == 2 and max(engine.deep_check_distances) < 1e-3
        assert between >= 50, "the other conversation decoded between the deep check's chunks"
