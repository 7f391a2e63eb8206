"""The support desk: sessions that start with the same system prompt hold it once on the device and read it
once per batched step, through every tier, branch and check, and every reply equals a cacheless engine's
(the tiny model: what is checked is the caches, not the words)."""

from __future__ import annotations

import copy

import pytest
import torch

from cache_store.device import chain
from cache_store.device.segments import segment_key
from cache_store.faults import corrupt
from chatd.engine.turn import TurnResult
from chatd.model.loader import LoadedModel
from chatd.model.prompt import PromptRenderer
from sessions import Message, Session
from tests.families import FAMILIES, _config, family_model, reference_reply
from tests.support import kv_budget_mb, run_together, run_turn, running_engine

POLICY = ("You are the support agent of Northwind Internet. Refunds take 14 days. Never promise a date. "
          "Ask for the order number first. Be brief, be kind, and sign every reply as Northwind Support.")
QUESTIONS = ["Where is my parcel?", "My invoice is wrong, it says 40 euros twice.", "I need a new password.",
             "Cancel my order 12.", "Is the shop open on Sunday?", "Do you ship to Norway?", "My router blinks.",
             "Can I change my plan?"]


def system_tokens(loaded: LoadedModel, system: str) -> int:
    return len(PromptRenderer(loaded.tokenizer).render([Message("system", system)], add_generation_prompt=False))


def shared_tokens(loaded: LoadedModel, system: str) -> int:
    """What a segment of the system prompt holds: its whole 16-token units."""
    return system_tokens(loaded, system) // 16 * 16


def stats_of(engine) -> dict:
    return engine.call(lambda store: store.stats()).result()


def converse(engine, sessions: list[Session], rounds: int, offload: bool = False) -> list[list[int]]:
    """`rounds` turns of every session decoded together; the replies' token ids, round by round."""
    replies = []
    for round_index in range(rounds):
        if offload:
            engine.offload_idle()
        contents = [f"{QUESTIONS[(i + round_index) % len(QUESTIONS)]} (customer {i})" for i in range(len(sessions))]
        results = run_together(engine, sessions, contents, [6 + (i % 3) * 4 for i in range(len(sessions))])
        replies.append([result.token_ids for result in results])
    return replies


def test_eight_sessions_hold_the_policy_once_read_it_once_per_step_and_answer_like_a_cacheless_engine(tiny):
    with running_engine(tiny, max_batch=8, shared_prompt_min_tokens=16) as shared, \
            running_engine(tiny, session_cache=False) as cacheless:
        sessions = [Session(f"s{i}", system=POLICY) for i in range(8)]
        got = converse(shared, sessions, 3)
        assert got == converse(cacheless, [Session(f"s{i}", system=POLICY) for i in range(8)], 3)
        stats = stats_of(shared)
        assert max(shared.counts.batch_sizes) == 8
        assert (stats["prefixes"], stats["shared_sessions"], stats["segment_users"]) == (1, 8, 8)
        policy_bytes = shared_tokens(tiny, POLICY) * kv_budget_mb(tiny, 1) * 2**20
        assert stats["segment_bytes"] == policy_bytes, "its whole units (the rest, under 16 tokens, each session's)"
        assert stats["device_kv_bytes"] <= stats["device_bytes"] <= 1.25 * stats["device_kv_bytes"]
        assert stats["device_private_kv_bytes"] > stats["device_kv_bytes"] + 6 * policy_bytes, "held once, not 8x"


def test_restores_from_the_host_tier_attach_the_resident_policy_exact_and_int8(tiny):
    """Every idle cache is offloaded before each round: the policy leaves the device once (its host copy is
    kept and reused), each session's own tokens go and come back on their own, and the replies are a cacheless
    engine's (exact copies) or come from int8 copies of the sessions' own tokens only."""
    for kv_dtype in ("same", "int8"):
        with running_engine(tiny, max_batch=4, host_kv_dtype=kv_dtype, shared_prompt_min_tokens=16) as engine, \
                running_engine(tiny, session_cache=False) as cacheless:
            sessions = [Session(f"s{i}", system=POLICY) for i in range(4)]
            got = converse(engine, sessions, 3, offload=True)
            stats = stats_of(engine)
            assert stats["restores"] == 8 and stats["segment_offloads"] == 1, stats
            assert stats["host_segments"] == 1 and stats["device_sessions"] == 4
            if kv_dtype == "same":
                assert got == converse(cacheless, [Session(f"s{i}", system=POLICY) for i in range(4)], 3)
            else:
                host = engine.call(lambda store: [store.host.get(k) for k in store.host.keys()]).result()
                assert not host or all(e.tensors[0][0].dtype in (torch.int8, tiny.model.dtype) for e in host)


def test_a_branch_of_a_branch_shares_its_history_and_answers_exactly(tiny):
    """A conversation is branched at its second turn (the history it shares becomes a segment of its own, after
    the policy's), and the branch is branched again: every reply equals a cacheless engine's."""
    renderer = PromptRenderer(tiny.tokenizer)
    with running_engine(tiny, shared_prompt_min_tokens=16) as engine, \
            running_engine(tiny, session_cache=False) as cacheless:
        trunk, reference = Session("trunk", system=POLICY), Session("trunk", system=POLICY)
        for question in QUESTIONS[:3]:
            assert run_turn(engine, trunk, question, max_new_tokens=16)[0].token_ids == \
                run_turn(cacheless, reference, question, max_new_tokens=16)[0].token_ids
        depth = []
        source = trunk
        for level, (keep, question) in enumerate(((4, "Actually, my invoice is right."), (4, "And my parcel?"))):
            branch = Session(f"branch{level}", system=POLICY)
            branch.messages = copy.deepcopy(source.messages[:keep])
            prompt_ids = renderer.render([Message("system", POLICY), *branch.prompt_messages(question)[1:]])
            engine.fork_session(source.session_id, branch.session_id, prompt_ids)
            twin = Session(f"branch{level}", system=POLICY)
            twin.messages = copy.deepcopy(branch.messages)
            got, _ = run_turn(engine, branch, question, max_new_tokens=16)
            expected, _ = run_turn(cacheless, twin, question, max_new_tokens=16)
            assert got.token_ids == expected.token_ids, f"branch {level}"
            assert got.cache_source == "device" and got.cached_tokens > system_tokens(tiny, POLICY) + 16
            depth.append(engine.call(lambda store, b=branch: len(chain.segments(store.device.get(b.session_id).cache))
                                     ).result())
            branch.messages = branch.messages[:keep + 2]
            source = branch
        assert depth[0] >= 2, "the branch starts with the policy and the history it shares with the trunk"
        after = run_turn(engine, trunk, QUESTIONS[4], max_new_tokens=16)[0]  # the trunk, split, goes on exactly
        assert after.token_ids == run_turn(cacheless, reference, QUESTIONS[4], max_new_tokens=16)[0].token_ids


@pytest.mark.parametrize(("kind", "tier"), [("bitflip", "device"), ("nan", "host")])
def test_a_corrupted_policy_is_caught_and_every_session_on_it_answers_right(tiny, kind, tier):
    """On the device, the policy is dropped with the caches that start with it; in the host tier, its copy is
    dropped, the first session recomputes and shares the policy anew, and the others find that new copy and
    restore their own tokens on top of it (the same ids give the same keys)."""
    with running_engine(tiny, max_batch=4, shared_prompt_min_tokens=16) as engine, \
            running_engine(tiny, session_cache=False) as cacheless:
        sessions = [Session(f"s{i}", system=POLICY) for i in range(3)]
        references = [Session(f"s{i}", system=POLICY) for i in range(3)]
        assert converse(engine, sessions, 1) == converse(cacheless, references, 1)
        if tier == "host":
            engine.offload_idle()
        key = segment_key(PromptRenderer(tiny.tokenizer).render([Message("system", POLICY)],
                                                                add_generation_prompt=False), None)
        engine.call(lambda store: corrupt(store, key, kind, tier)).result()
        for questions in (QUESTIONS[3:6], QUESTIONS[6:8] + QUESTIONS[:1]):
            results = run_together(engine, sessions, questions, [8, 8, 8])
            expected = run_together(cacheless, references, questions, [8, 8, 8])
            assert [r.token_ids for r in results] == [r.token_ids for r in expected]
            if questions == QUESTIONS[3:6]:
                assert results[0].cache_source == "miss" and (tier == "host" or (
                    results[0].miss_reason, results[0].cleared) == ("corrupt", ["checksum"]))
                assert engine.cache.counters["corrupt_checksum"] == 1, "one corruption, counted once"
        assert all(r.cache_source == "device" for r in results), "the policy was found (or made) again"
        stats = stats_of(engine)
        assert (stats["prefixes"], stats["shared_sessions"], stats["host_segments"]) == (1, 3, 0)


def test_a_warm_prompt_is_resident_from_the_start_and_stays_through_an_eviction_flood(tiny, tmp_path):
    warm = tmp_path / "policy.txt"
    warm.write_text(POLICY + "\n")
    budget = kv_budget_mb(tiny, 320)
    with running_engine(tiny, warm_prompt=[str(warm)], device_cache_mb=budget, max_batch=4) as engine, \
            running_engine(tiny, session_cache=False) as cacheless:
        stats = stats_of(engine)
        assert (stats["prefixes"], stats["segments_pinned"]) == (1, 1)
        first = Session("first", system=POLICY)
        done, _ = run_turn(engine, first, QUESTIONS[0], max_new_tokens=8)
        assert (done.cache_source, done.cached_tokens) == ("prefix", shared_tokens(tiny, POLICY))
        flood = [Session(f"f{i}", system=f"Another prompt {i}. " * 6) for i in range(8)]
        converse(engine, flood, 2)  # far more than the budget: everything else is evicted
        assert engine.cache.counters["device_evictions"] > 0
        again, _ = run_turn(engine, Session("late", system=POLICY), QUESTIONS[1], max_new_tokens=8)
        assert again.cache_source == "prefix"
        expected, _ = run_turn(cacheless, Session("late", system=POLICY), QUESTIONS[1], max_new_tokens=8)
        assert again.token_ids == expected.token_ids
        assert stats_of(engine)["segments_pinned"] == 1


def test_gpt_oss_answers_exactly_when_its_system_prompt_is_prefilled_alone_and_the_rest_attends_across_it(
        smollm2_dir, monkeypatch):
    """The shape that went wrong: attention sinks, 32-token windows, top-2 of 4 experts, a 55-token system prompt
    prefilled as a chunk of its own and 23 tokens after it whose windows reach back into it, one turn at a time."""
    monkeypatch.setitem(FAMILIES, "gpt_oss", _config("GptOssConfig", sliding_window=32, num_local_experts=4,
                                                      num_experts_per_tok=2,
                                                      layer_types=["sliding_attention", "full_attention"] * 2))
    loaded = family_model("gpt_oss", smollm2_dir)
    untouched = LoadedModel("reference", copy.deepcopy(loaded.model), loaded.tokenizer, loaded.device,
                            loaded.stop_token_ids)
    system = ("You are a support agent for Northwind Internet. Be brief, be kind, never promise refunds, and always "
              "ask for the order number first before anything else please. Thank you for being here with us today "
              "and tomorrow and every day of the week")
    assert system_tokens(loaded, system) == 55
    with running_engine(loaded, max_batch=1, shared_prompt_min_tokens=16) as engine:
        for question in ("Where is my parcel? It was due on Monday, not today.",  # 23 tokens after the system prompt
                         "Do you ship to Norway and Sweden, and how long does it take?"):
            result, _ = run_turn(engine, Session("gpt-oss", system=system), question, max_new_tokens=24)
            prompt = result.conversation_ids[:result.prompt_tokens]
            assert result.token_ids == reference_reply(untouched, prompt, 24), question


def test_a_short_prompt_is_copied_from_the_session_that_prefilled_it_not_chained(tiny):
    """Below --shared-prompt-min-tokens a system prompt is no segment: a later session copies it from the cache of
    the session that prefilled it."""
    with running_engine(tiny, max_batch=4, shared_prompt_min_tokens=256) as engine, \
            running_engine(tiny, session_cache=False) as cacheless:
        sessions = [Session(f"s{i}", system=POLICY) for i in range(4)]
        first, _ = run_turn(engine, sessions[0], QUESTIONS[0], max_new_tokens=8)
        later = run_together(engine, sessions[1:], QUESTIONS[1:4], [8, 8, 8])
        expected = run_together(cacheless, [Session(f"s{i}", system=POLICY) for i in range(1, 4)], QUESTIONS[1:4],
                                [8, 8, 8])
        assert [r.token_ids for r in later] == [r.token_ids for r in expected]
        assert first.cache_source == "miss" and {(r.cache_source, r.cached_tokens) for r in later} == {
            ("prefix", system_tokens(tiny, POLICY))}
        stats = stats_of(engine)
        assert stats["prefixes"] == 0 and stats["shared_sessions"] == 0


@pytest.mark.parametrize(("host_tokens", "source"), [(200, "host"), (150, "prefix")])
def test_a_policy_whose_host_copy_must_go_to_make_room_for_its_own_restore_is_read_first(tiny, host_tokens, source):
    """A session and its policy offloaded, then two other sessions fill the device. Its next turn takes the session's
    copy out (so nothing on the host needs the policy any more; with a smaller host tier that copy was dropped
    already and the turn starts from the policy), restores the policy, and the room made for it offloads another
    session, for which the host drops its first candidate: that policy's copy, being read. The copy is held until it
    is read: the turn restores it (and the session) and answers as a cacheless engine does."""
    long_question = " ".join(QUESTIONS)
    with running_engine(tiny, shared_prompt_min_tokens=16, device_cache_mb=kv_budget_mb(tiny, 220),
                        host_cache_mb=kv_budget_mb(tiny, host_tokens)) as engine, \
            running_engine(tiny, session_cache=False) as cacheless:
        replies = []
        for runner in (engine, cacheless):
            first, others = Session("a", system=POLICY), [Session("b"), Session("c")]
            run_turn(runner, first, QUESTIONS[0], max_new_tokens=6)
            runner.offload_idle()
            for other in others:
                run_turn(runner, other, long_question, max_new_tokens=6)
            result, _ = run_turn(runner, first, QUESTIONS[1], max_new_tokens=6)
            replies.append(result)
        got, expected = replies
        assert isinstance(got, TurnResult), got
        assert got.cache_source == source and got.token_ids == expected.token_ids
        stats = stats_of(engine)
        assert stats["host_evictions"] >= 1 and stats["segment_restores"] == 1, stats
        assert stats.get("restores", 0) == (source == "host")
        assert stats["host_segments"] == 0, "the policy's copy was dropped while it was read"
