"""Helpers shared by the tests: a tiny random model, and running turns on an engine directly."""

from __future__ import annotations

import threading
from contextlib import asynccontextmanager, contextmanager

import openai
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
from websockets.asyncio.client import connect

from cache_store import CacheLookup, CacheQuery, CacheStore, kv_bytes_per_token
from chatd.api.server import ChatServer
from chatd.cli.client import ChatClient
from chatd.config import Settings
from chatd.engine.engine import Engine
from chatd.engine.sampling import SamplingParams
from chatd.engine.turn import TokenText, Turn, TurnEvent, TurnFailed, TurnResult
from chatd.model.loader import LoadedModel, stop_token_ids
from sessions import Session

TINY_CONTEXT = 512


def tiny_model(tokenizer_dir, context: int = TINY_CONTEXT) -> LoadedModel:
    """A 2-layer GQA Llama with random weights and the real SmolLM2 tokenizer. float64, so that
    cached and uncached prefills agree to the last bit that matters for argmax."""
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         max_position_embeddings=context, tie_word_embeddings=True, initializer_range=0.2,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.float64).eval()
    return LoadedModel(name="tiny", model=model, tokenizer=tokenizer, device=torch.device("cpu"),
                       stop_token_ids=stop_token_ids(tokenizer, model))


def lookup_through_redis(store: CacheStore, session_id: str, prompt_ids: list[int], prefix_len: int = 0,
                         session_version: int = 0, scope: str | None = None) -> CacheLookup:
    """A turn's lookup as the engine makes it: what the turn asks of Redis fetched first (on the remote tier's
    threads, waited for here), then the lookup with what it brought."""
    query = CacheQuery(session_id, prompt_ids, prefix_len, session_version, scope)
    request = store.remote_request(query)
    fetch = store.start_fetch(request, len(prompt_ids)) if request is not None else None
    if fetch is not None:
        fetch.job.result(timeout=30)
    return store.lookup(query, fetch=fetch)


def kv_budget_mb(loaded: LoadedModel, tokens: int) -> float:
    """A cache budget (--device-cache-mb, --host-cache-mb) of `tokens` of this model's keys and values."""
    return tokens * kv_bytes_per_token(loaded.model.config, loaded.model.dtype) / 2**20


@asynccontextmanager
async def beside_a_reference(loaded: LoadedModel, settings: Settings, reference: Settings):
    """A server on `settings` and a reference server to compare it with, both ready, a websocket client
    on each: (server, client, reference_client)."""
    async with ChatServer(settings, load=lambda: loaded) as server, \
            ChatServer(reference, load=lambda: loaded) as compared:
        await server.wait_ready()
        await compared.wait_ready()
        async with ChatClient(await connect(server.url)) as client, \
                ChatClient(await connect(compared.url)) as reference_client:
            yield server, client, reference_client


@asynccontextmanager
async def two_workers_and_a_reference(loaded: LoadedModel, settings: Settings):
    """Two servers sharing `settings` (one Redis), a third alone in memory to compare with, and a
    client on each: (on_a, on_b, reference, servers)."""
    async with ChatServer(settings, load=lambda: loaded) as a, ChatServer(settings, load=lambda: loaded) as b, \
            ChatServer(Settings(port=0), load=lambda: loaded) as alone:
        for server in (a, b, alone):
            await server.wait_ready()
        async with ChatClient(await connect(a.url)) as on_a, ChatClient(await connect(b.url)) as on_b, \
                ChatClient(await connect(alone.url)) as reference:
            yield on_a, on_b, reference, (a, b, alone)


@contextmanager
def running_engine(loaded: LoadedModel, **settings):
    engine = Engine(lambda: loaded, Settings(**settings))
    engine.start()
    engine.ready.wait()
    try:
        yield engine
    finally:
        engine.stop()


def run_turn(engine: Engine, session: Session, content: str, on_text=None, record: bool = True,
             owner: str | None = None, **params) -> tuple[TurnResult | TurnFailed, list[str]]:
    """Run one turn (of `owner`'s key) to its end; record it in `session` when it completed. `on_text(turn, text)`
    runs in the engine thread for every streamed piece."""
    events: list[TurnEvent] = []
    finished = threading.Event()
    turn: Turn

    def emit(event: TurnEvent) -> None:
        events.append(event)
        if isinstance(event, TokenText):
            if on_text:
                on_text(turn, event.text)
        else:
            finished.set()

    turn = Turn(turn_id=f"t{len(session.messages)}", session_id=session.session_id,
                messages=session.prompt_messages(content), params=SamplingParams(**params), emit=emit,
                session_version=session.version, owner=owner)
    engine.submit(turn)
    assert finished.wait(120), "the engine did not finish the turn"
    final = events[-1]
    if record and isinstance(final, TurnResult) and final.finish_reason != "cancelled":
        session.record_turn(content, final.content)
    return final, [e.text for e in events[:-1]]


def run_together(engine, sessions, contents, lengths, on_text=None) -> list[TurnResult]:
    """Submit one turn per session at once (reply lengths `lengths`); wait for all; record them.
    `on_text(turn, turns)` runs in the engine thread whenever `turn` streams text."""
    results, finished, turns = {}, threading.Event(), []

    def emitter(index):
        def emit(event):
            if isinstance(event, TokenText):
                if on_text:
                    on_text(turns[index], turns)
                return
            results[index] = event
            if len(results) == len(sessions):
                finished.set()
        return emit

    for index, (session, content, length) in enumerate(zip(sessions, contents, lengths, strict=True)):
        turns.append(Turn(turn_id=f"t{index}", session_id=session.session_id,
                          messages=session.prompt_messages(content), params=SamplingParams(max_new_tokens=length),
                          emit=emitter(index), session_version=session.version))
    for turn in turns:
        engine.submit(turn)
    assert finished.wait(120)
    ordered = [results[i] for i in range(len(sessions))]
    for session, content, result in zip(sessions, contents, ordered, strict=True):
        if result.finish_reason != "cancelled":
            session.record_turn(content, result.content, result.conversation_ids)
    return ordered


def openai_client(server: ChatServer) -> openai.AsyncOpenAI:
    """An `openai` client of `server`, which fails at once rather than retrying."""
    return openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="unused", max_retries=0)
