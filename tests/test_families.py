"""Every decoder family chatd serves answers exactly as transformers does, on every path a cache takes:
a long conversation (chunked prefill on a cached prefix, the deep check on every reuse), six conversations
decoding together, a cache restored from the host tier (exact and int8), and a stateless OpenAI request
that branches from a conversation. The reference is transformers' greedy `generate` on the prompt ids
chatd rendered, recomputing the whole prompt, run on an untouched copy of the model."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import httpx
import openai
import pytest
from transformers import PreTrainedModel

from cache_store import KVGeometry
from chatd.api.server import ChatServer
from chatd.config import Settings
from chatd.engine import chain_attention
from chatd.engine.turn import TurnResult
from chatd.model.loader import LoadedModel
from chatd.model.prompt import PromptRenderer
from sessions import Message, Session
from tests.families import FAMILIES, WINDOW, Int8Reference, family_model, reference_reply
from tests.support import run_together, run_turn, running_engine

QUESTIONS = ["Where is my parcel?", "My invoice is wrong, it says 40 euros twice.", "I need a new password.",
             "Cancel my order 12.", "Is the shop open on Sunday afternoon, or only in the morning?",
             "Do you ship to Norway?"]


@dataclass
class Family:
    name: str
    loaded: LoadedModel
    reference: PreTrainedModel  # never served by chatd: its attention is transformers' own

    @property
    def untouched(self) -> LoadedModel:
        return LoadedModel(self.name, self.reference, self.loaded.tokenizer, self.loaded.device,
                           self.loaded.stop_token_ids)

    def expected(self, result: TurnResult, max_new_tokens: int) -> list[int]:
        """transformers' reply to the prompt chatd rendered for this turn."""
        return reference_reply(self.untouched, result.conversation_ids[:result.prompt_tokens], max_new_tokens)


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, smollm2_dir) -> Family:
    loaded = family_model(request.param, smollm2_dir)
    return Family(request.param, loaded, copy.deepcopy(loaded.model))


def test_a_long_conversation(family):
    """Five turns, the prompt fed in chunks of 16 on top of the cached prefix, every reuse deep-checked."""
    with running_engine(family.loaded, prefill_chunk=16, verify_sample_rate=1.0) as engine:
        session = Session("long", system="You are a support agent for Northwind Internet.")
        for turn, content in enumerate(QUESTIONS[:5]):
            result, _ = run_turn(engine, session, content, max_new_tokens=12)
            assert result.token_ids == family.expected(result, 12), f"turn {turn + 1}"
            if turn:
                assert result.cache_source == "device" and result.cached_tokens > WINDOW, result
        assert result.prompt_tokens > 8 * WINDOW, "the conversation is much longer than the window"
        assert len(engine.deep_check_distances) == 4 and max(engine.deep_check_distances) < 1e-6


def test_six_conversations_decode_together(family):
    with running_engine(family.loaded, max_batch=6) as engine:
        sessions = [Session(f"s{i}", system="Be brief.") for i in range(6)]
        lengths = [6 + 3 * i for i in range(6)]  # rows join and leave the batch at different steps
        for round_index in range(2):
            contents = [f"{question} (round {round_index})" * (1 + i % 3) for i, question in enumerate(QUESTIONS)]
            for session, result, length in zip(sessions, run_together(engine, sessions, contents, lengths),
                                               lengths, strict=True):
                assert result.token_ids == family.expected(result, length), session.session_id
        assert max(engine.counts.batch_sizes) == 6


POLICY = ("You are a support agent for Northwind Internet. Refunds take fourteen days; never promise a date, and "
          "always ask for the order number first.")  # a segment of two or more units: longer than the windows


def test_conversations_that_share_a_policy_decode_together_and_alone(family, monkeypatch):
    """The policy is a shared segment longer than the 12-token windows (a window ends inside it for the first
    tokens after it, beyond it later); four conversations decode together, gathering it with their own tokens in
    the first round and reading it once per step in the second, then one goes on alone, every reuse deep-checked
    (without unsharing the policy): every reply is transformers'."""
    with running_engine(family.loaded, max_batch=4, shared_prompt_min_tokens=16, verify_sample_rate=1.0) as engine:
        sessions = [Session(f"p{i}", system=POLICY) for i in range(4)]
        lengths = [5 + 3 * i for i in range(4)]
        for round_index, fold_limit in enumerate((chain_attention.FOLD_LIMIT, 0)):
            monkeypatch.setattr(chain_attention, "FOLD_LIMIT", fold_limit)
            contents = [QUESTIONS[(i + round_index) % len(QUESTIONS)] for i in range(4)]
            for session, result, length in zip(sessions, run_together(engine, sessions, contents, lengths),
                                               lengths, strict=True):
                assert result.token_ids == family.expected(result, length), f"{session.session_id}, {round_index}"
        alone, _ = run_turn(engine, sessions[0], QUESTIONS[5], max_new_tokens=8)
        assert alone.token_ids == family.expected(alone, 8)
        stats = engine.call(lambda store: store.stats()).result()
        assert stats["prefixes"] == 1 and stats["shared_sessions"] == 4 and stats["segment_bytes"] > 0


def test_drafts_from_the_desks_replies_are_verified_exactly_together_and_alone(family):
    """Four customers ask, then four more ask the same: the first ones' replies are proposed as drafts and
    verified in the batched step (several tokens per row, in the rows' own regions and, with a shared policy, in
    chained rows), then in one conversation alone: every reply is transformers' all the same."""
    with running_engine(family.loaded, max_batch=4, shared_prompt_min_tokens=16) as engine:
        lengths = [10, 14, 8, 12]
        for system in ("Be brief.", POLICY):
            contents = QUESTIONS[:4]
            run_together(engine, [Session(f"{system[:4]}a{i}", system=system) for i in range(4)], contents, lengths)
            later = [Session(f"{system[:4]}b{i}", system=system) for i in range(4)]
            for session, result, length in zip(later, run_together(engine, later, contents, lengths), lengths,
                                               strict=True):
                assert result.token_ids == family.expected(result, length), session.session_id
            alone, _ = run_turn(engine, Session(f"{system[:4]}c", system=system), contents[1], max_new_tokens=14)
            assert alone.token_ids == family.expected(alone, 14)
        assert engine.speculator.counters.accepted_tokens > 0


@pytest.mark.parametrize("kv_dtype", ["same", "int8"])
def test_a_cache_restored_from_the_host_tier(family, kv_dtype):
    """Evicted after every turn and restored for the next. Exact copies answer as a recompute does; int8
    copies as transformers continuing from the same int8 keys and values (`Int8Reference`)."""
    int8_reference = Int8Reference(family.untouched)
    system = "You are a support agent."
    # (the system prompt's whole 16-token units are a shared segment: exact on the host; the rest is the session's)
    segment = len(PromptRenderer(family.loaded.tokenizer).render([Message("system", system)],
                                                                 add_generation_prompt=False)) // 16 * 16
    with running_engine(family.loaded, host_kv_dtype=kv_dtype) as engine:
        session = Session("restored", system=system)
        for turn, content in enumerate(QUESTIONS[:3]):
            engine.offload_idle()
            result, _ = run_turn(engine, session, content, max_new_tokens=10)
            if kv_dtype == "same":
                expected = family.expected(result, 10)
            else:
                expected = int8_reference.reply(result.conversation_ids[:result.prompt_tokens],
                                                result.cached_tokens, 10, exact=segment)
            assert result.token_ids == expected, f"turn {turn + 1}"
            if turn:
                assert result.cache_source == "host" and result.cached_tokens > WINDOW, result
                assert result.quantized == (None if kv_dtype == "same" else "int8")


async def test_an_openai_request_that_branches_from_a_conversation(family):
    async with ChatServer(Settings(port=0, model=family.name, verify_sample_rate=0.0),
                          load=lambda: family.loaded) as server:
        await server.wait_ready()
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="none", max_retries=0)
        history = [{"role": "system", "content": "You are a support agent."}]
        for content in QUESTIONS[:2]:
            history.append({"role": "user", "content": content})
            reply = await client.chat.completions.create(model=family.name, messages=history, max_tokens=8,
                                                         temperature=0)
            history.append({"role": "assistant", "content": reply.choices[0].message.content})
        edited = [*history[:-2], {"role": "user", "content": "Actually, my invoice is right."}]  # regenerate
        raw = await client.chat.completions.with_raw_response.create(model=family.name, messages=edited,
                                                                     max_tokens=10, temperature=0)
        branch = raw.parse()
        session = await server.sessions.get(raw.headers["X-Chatd-Session-Id"])
        assert branch.usage.prompt_tokens_details.cached_tokens > WINDOW, "the branch started from a copied prefix"
        prompt_ids = session.token_ids[:branch.usage.prompt_tokens]
        expected = reference_reply(family.untouched, prompt_ids, 10)
        assert list(session.messages[-1].token_ids) == expected
        assert branch.choices[0].message.content == family.loaded.tokenizer.decode(expected)

        stats = (await httpx.AsyncClient().get(f"http://127.0.0.1:{server.port}/v1/stats")).json()["now"]
        geometry = KVGeometry.of(family.loaded.model.config)
        assert stats["kv"]["sliding_layers"] == geometry.sliding_layers
        assert stats["kv"]["windows"] == ([WINDOW] if geometry.sliding_layers else [])
        device = stats["tiers"]["device"]
        assert 0 < device["kv_bytes"] <= device["bytes"]
        if geometry.sliding_layers:  # most of a long conversation is outside the windows
            assert device["window_bytes"] < device["kv_bytes"]
        else:
            assert device["window_bytes"] == device["kv_bytes"]
