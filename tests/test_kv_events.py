"""KV events against a real consumer: NVIDIA Dynamo's standalone KV indexer (`python -m dynamo.indexer`, PyPI
`ai-dynamo-runtime`, in `.venv/dynamo`: `make test` installs it) subscribed to two chatd workers serving SmolLM2.
What the indexer scores for a conversation's next prompt is what the worker reads from its tiers for it."""

from __future__ import annotations

import re
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from cache_store.block_ledger import block_chain, public_scope
from chatd.api.auth import key_id
from chatd.api.conversations import salted
from chatd.api.server import ChatServer
from chatd.cli.server_process import ServerProcess, free_port
from chatd.config import Settings

ROOT = Path(__file__).resolve().parent.parent
DYNAMO = ROOT / ".venv" / "dynamo" / "bin" / "python"
BLOCK = 16
MODEL = "smollm2-135m"
SECRET = "the fleet's scope secret"
SYSTEM = ("You are the support desk of a broadband company. Answer in one or two short sentences, be polite, and "
          "ask for the customer's account number before discussing anything specific to their account.")


class Indexer:
    """Dynamo's standalone KV indexer on a free port, its workers registered over HTTP."""

    def __init__(self, folder: Path):
        self.port = free_port()
        self.log = folder / "indexer.log"
        self.process = subprocess.Popen([str(DYNAMO), "-m", "dynamo.indexer", "--port", str(self.port)],
                                        stdout=self.log.open("w"), stderr=subprocess.STDOUT)
        self.http = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=10)
        deadline = time.monotonic() + 30
        while True:
            try:
                self.http.get("/workers").raise_for_status()
                return
            except httpx.HTTPError:
                if time.monotonic() > deadline or self.process.poll() is not None:
                    raise RuntimeError(f"the indexer did not start: {self.log.read_text()[-2000:]}") from None
                time.sleep(0.1)

    def register(self, worker_id: int, worker: Worker) -> None:
        self.http.post("/register", json={
            "instance_id": worker_id, "endpoint": f"tcp://127.0.0.1:{worker.events_port}", "model_name": MODEL,
            "block_size": BLOCK, "replay_endpoint": f"tcp://127.0.0.1:{worker.replay_port}"}).raise_for_status()

    def unregister(self, worker_id: int) -> None:
        self.http.post("/unregister", json={"instance_id": worker_id, "model_name": MODEL}).raise_for_status()

    def scores(self, token_ids: list[int], lora_name: str | None = None) -> dict[str, dict[str, int]]:
        """Each worker's matched prefix in tokens, per medium (`gpu`; `cpu`: the device and host tiers)."""
        answer = self.http.post("/query", json={"token_ids": token_ids, "model_name": MODEL, "lora_name": lora_name})
        answer.raise_for_status()
        return answer.json()["instances"]

    def stop(self) -> None:
        self.http.close()
        self.process.terminate()
        self.process.wait(10)


@dataclass
class Worker:
    """A chatd worker publishing KV events, and an OpenAI client of it."""

    server: ServerProcess
    events_port: int
    replay_port: int
    flags: list[str]

    @classmethod
    def start(cls, *flags: str, events_port: int | None = None, replay_port: int | None = None) -> Worker:
        events_port, replay_port = events_port or free_port(), replay_port or free_port()
        server = ServerProcess(["--model", "smollm2-135m", "--device", "cpu", "--speculation", "off",
                                "--kv-scope-secret", SECRET, "--kv-events-endpoint", f"tcp://*:{events_port}",
                                "--kv-events-replay-endpoint", f"tcp://*:{replay_port}", *flags])
        return cls(server, events_port, replay_port, list(flags))

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.server.port}"

    def chat(self, messages: list[dict], max_tokens: int = 16, **extra) -> tuple[str, int, int]:
        """One turn: the reply, the prompt's tokens and those read from the cache."""
        client = openai.OpenAI(base_url=self.base + "/v1", api_key="unused", max_retries=0)
        completion = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens,
                                                    temperature=0, extra_body=extra or None)
        usage = completion.usage
        return completion.choices[0].message.content, usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens

    def tokenize(self, messages: list[dict]) -> list[int]:
        answer = httpx.post(self.base + "/tokenize", json={"model": MODEL, "messages": messages}, timeout=30)
        answer.raise_for_status()
        return answer.json()["tokens"]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, smollm2_dir) -> Iterator[tuple[Indexer, list[Worker]]]:
    """Two workers (with device budgets of about 700 tokens, so that a long conversation evicts the others to the
    host tier) and the indexer, which registers them once they have served a turn each."""
    if not DYNAMO.exists():
        pytest.skip("ai-dynamo-runtime is not installed in .venv/dynamo (make test installs it from PyPI)")
    indexer = Indexer(tmp_path_factory.mktemp("indexer"))
    with ThreadPoolExecutor(2) as pool:
        workers = list(pool.map(lambda flags: Worker.start(*flags), (SMALL, SMALL)))
    try:
        yield indexer, workers
    finally:
        for worker in workers:
            worker.server.stop()
        indexer.stop()


SMALL = ["--device-cache-mb", "32", "--host-cache-mb", "64"]  # (a churn evicts to the host and drops from it)


def blocks(tokens: int) -> int:
    return tokens // BLOCK * BLOCK


def common(first: list[int], second: list[int]) -> int:
    return next((i for i, (a, b) in enumerate(zip(first, second, strict=False)) if a != b), min(len(first),
                                                                                                  len(second)))


def eventually(check, timeout_s: float = 10.0):
    """`check()` once it holds (events reach the indexer a step later), or its last failure."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return check()
        except AssertionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def test_each_workers_score_is_what_it_reads_from_its_tiers(fleet):
    """Conversations on each worker, the indexer registered after their first turns (it replays what it missed):
    for each next prompt the worker that holds the conversation scores what its next turn then reads from the
    cache, to a block; the other scores the shared system prompt it also holds."""
    indexer, (first, second) = fleet
    opening = [{"role": "system", "content": SYSTEM}]
    asks = {0: "My router blinks orange since this morning.", 1: "Why is my bill higher this month?"}
    conversations = {}
    for index, worker in enumerate((first, second)):
        messages = [*opening, {"role": "user", "content": asks[index]}]
        reply, _, _ = worker.chat(messages)
        conversations[index] = [*messages, {"role": "assistant", "content": reply}]
    indexer.register(1, first)
    indexer.register(2, second)
    for worker in (first, second):  # (what they publish next shows the indexer what it missed: it asks for it)
        worker.chat([{"role": "user", "content": "Hello"}])
    for index, worker in enumerate((first, second)):
        nxt = [*conversations[index], {"role": "user", "content": "Thank you. What should I do next?"}]
        prompt = worker.tokenize(nxt)
        other_prompt = (second, first)[index].tokenize([*opening, {"role": "user", "content": asks[1 - index]}])
        holder, other = str(index + 1), str(2 - index)
        scores = eventually(lambda prompt=prompt, holder=holder, other=other: _both(indexer, prompt, holder, other))
        _, prompt_tokens, cached = worker.chat(nxt)
        assert prompt_tokens == len(prompt), "/tokenize renders the prompt as the turn does"
        assert cached > blocks(len(prompt) // 2), "the conversation continued from its cache"
        assert scores[holder]["gpu"] == blocks(cached)
        assert scores[other]["gpu"] == blocks(common(prompt, other_prompt)) > 0, \
            "the other worker holds the system prompt, and nothing of this conversation after it"


def _both(indexer: Indexer, prompt: list[int], holder: str, other: str) -> dict:
    scores = indexer.scores(prompt)
    assert holder in scores and other in scores, scores
    assert scores[holder]["gpu"] > scores[other]["gpu"], scores
    return scores


def test_a_cache_evicted_to_the_host_is_scored_on_the_cpu(fleet):
    """A conversation evicted from the device by a longer one: the indexer's GPU score for its next prompt drops,
    its CPU score holds what the host copy covers, and the next turn reads that back."""
    indexer, (first, _) = fleet
    messages = [{"role": "system", "content": "You are a travel agent."},
                {"role": "user", "content": "I would like a week somewhere warm in March."}]
    reply, _, _ = first.chat(messages)
    nxt = [*messages, {"role": "assistant", "content": reply}, {"role": "user", "content": "And in April?"}]
    prompt = first.tokenize(nxt)
    before = eventually(lambda: _scored(indexer, prompt, "gpu"))
    first.chat([{"role": "user", "content": _filling(first)}])
    after = eventually(lambda: _evicted(indexer, prompt, before))
    _, _, cached = first.chat(nxt)
    assert after["cpu"] == blocks(cached) == before["gpu"]


def _filling(worker: Worker) -> str:
    """A message whose turn needs nearly the whole arena: every other cache must leave the device for it."""
    metrics = httpx.get(worker.base + "/metrics", timeout=10).text
    arena = sum(float(v) for v in re.findall(r"^chatd:kv_arena_tokens\{[^}]*\} (\S+)$", metrics, re.MULTILINE))
    target = int(arena) - 16 - 2 * BLOCK  # (its 16 reply tokens, and a region rounded up to whole units)
    text = "Summarise:"
    for _ in range(3):
        text += " parcel" * (target - len(worker.tokenize([{"role": "user", "content": text}])))
    return text


def _scored(indexer: Indexer, prompt: list[int], medium: str) -> dict:
    score = indexer.scores(prompt).get("1", {})
    assert score.get(medium, 0) > 0, score
    return score


def _evicted(indexer: Indexer, prompt: list[int], before: dict) -> dict:
    score = indexer.scores(prompt).get("1", {})
    assert score.get("gpu", 0) < before["gpu"] and score.get("cpu", 0) == before["gpu"], (score, before)
    return score


def test_a_salted_conversation_never_matches_an_unsalted_prompt(fleet):
    """The same conversation with a cache_salt: its blocks carry the salt's scope (a digest), so the indexer keeps
    them apart; only a query in that scope matches them."""
    indexer, (_, second) = fleet
    messages = [{"role": "system", "content": "You are a pharmacy's help line. Be brief."},
                {"role": "user", "content": "Can I take ibuprofen with my blood pressure pills?"}]
    reply, _, _ = second.chat(messages, cache_salt="tenant-7")
    prompt = second.tokenize([*messages, {"role": "assistant", "content": reply},
                              {"role": "user", "content": "And paracetamol?"}])
    scope = public_scope(salted(None, "tenant-7"), SECRET)
    assert "tenant-7" not in scope
    salted_score = eventually(lambda: _scored_in(indexer, prompt, scope))
    assert salted_score["gpu"] >= blocks(len(prompt)) - 2 * BLOCK
    assert indexer.scores(prompt).get("2", {}).get("gpu", 0) == 0, "an unsalted prompt matches none of its blocks"


def _scored_in(indexer: Indexer, prompt: list[int], scope: str) -> dict:
    score = indexer.scores(prompt, lora_name=scope).get("2", {})
    assert score.get("gpu", 0) > 0, score
    return score


async def test_one_key_finds_nothing_of_another_keys_prompt_in_the_blocks_or_the_events(fleet, tiny):
    """Key A's conversation on one worker, key B's identical one on another (each key's blocks carry its own scope,
    named by a digest seeded by the fleet's secret): key B, which can tokenize a guessed prompt and hash it, finds
    none of A's block ids; `/kv/blocks` is the operator's (B's key refused, the admin key answered); Dynamo's indexer,
    reading the events, scores B's prompt in B's scope 0 on A's worker and A's in A's scope on it."""
    indexer, _ = fleet
    keys = {"a": "key-tenant-a", "b": "key-tenant-b"}
    ports = [(free_port(), free_port()) for _ in range(2)]
    settings = [Settings(port=0, model=MODEL, api_key=list(keys.values()), admin_key="ops-key", kv_scope_secret=SECRET,
                         kv_events_endpoint=f"tcp://*:{events}", kv_events_replay_endpoint=f"tcp://*:{replay}")
                for events, replay in ports]
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Is there an outage in Leeds?"}]
    async with ChatServer(settings[0], load=lambda: tiny) as of_a, ChatServer(settings[1], load=lambda: tiny) as of_b:
        for worker_id, (events, replay) in zip((3, 4), ports, strict=True):
            indexer.http.post("/register", json={
                "instance_id": worker_id, "endpoint": f"tcp://127.0.0.1:{events}", "model_name": MODEL,
                "block_size": BLOCK, "replay_endpoint": f"tcp://127.0.0.1:{replay}"}).raise_for_status()
        for server, key in ((of_a, "a"), (of_b, "b")):
            await server.wait_ready()
            client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key=keys[key])
            await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{of_a.port}") as http:
            prompt = (await http.post("/tokenize", json={"messages": messages},
                                      headers={"Authorization": f"Bearer {keys['b']}"})).json()["tokens"]
            refused = await http.get("/kv/blocks", headers={"Authorization": f"Bearer {keys['b']}"})
            held = (await http.get("/kv/blocks", headers={"Authorization": "Bearer ops-key"})).json()["blocks"]["GPU"]
        assert refused.status_code == 401
        assert held and not set(block_chain(prompt, BLOCK, None)) & set(held), "B cannot compute A's ids"
        scope_a, scope_b = (public_scope(key_id(keys[key]), SECRET) for key in ("a", "b"))
        assert set(block_chain(prompt, BLOCK, scope_a)) & set(held), "(the operator, with the secret, can)"
        try:
            mine = eventually(lambda: _scored_by(indexer, prompt, scope_a, "3"))
            assert mine >= blocks(len(prompt)) - BLOCK
            assert eventually(lambda: _scored_by(indexer, prompt, scope_b, "4")) == mine, "B's on B's worker"
            assert indexer.scores(prompt, lora_name=scope_b).get("3", {}).get("gpu", 0) == 0, "none of A's for B"
            assert indexer.scores(prompt).get("3", {}).get("gpu", 0) == 0, "nor for an unscoped query"
        finally:
            for worker_id in (3, 4):
                indexer.unregister(worker_id)


def _scored_by(indexer: Indexer, prompt: list[int], scope: str, worker_id: str) -> int:
    score = indexer.scores(prompt, lora_name=scope).get(worker_id, {}).get("gpu", 0)
    assert score > 0
    return score


def test_vllm_gauges_equal_chatds_own(fleet):
    """The gauges and counters routers scrape, under vLLM's names, beside chatd's."""
    _, (first, _) = fleet
    text = httpx.get(first.base + "/metrics", timeout=10).text

    def value(name: str) -> float:
        match = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE)
        assert match, name
        return float(match.group(1))

    assert value("vllm:num_requests_running") == value("chatd:num_requests_running")
    assert value("vllm:num_requests_waiting") == value("chatd:num_requests_waiting")
    device = re.search(r'^chatd:kv_cache_usage_perc\{[^}]*tier="device"[^}]*\} (\S+)$', text, re.MULTILINE)
    # vLLM counts a block used only while a running request references it: idle cached sessions are free room
    assert value("vllm:kv_cache_usage_perc") == 0 < float(device.group(1)), "idle caches are free, as vLLM's"
    assert value("vllm:prefix_cache_queries_total") == value("chatd:prefix_cache_queries_total") > 0
    assert value("vllm:prefix_cache_hits_total") == value("chatd:prefix_cache_hits_total") > 0
    assert re.search(r'^vllm:cache_config_info\{[^}]*block_size="16"[^}]*\} 1\.0$', text, re.MULTILINE)
    assert value('chatd:kv_event_batches_total{model_name="smollm2-135m",outcome="sent"}') > 0


def test_tokenize_and_detokenize_answer_like_vllm_and_refuse_bad_input(fleet):
    _, (first, _) = fleet
    answer = httpx.post(first.base + "/tokenize", json={"model": MODEL, "prompt": "Hello there"}).json()
    assert answer["count"] == len(answer["tokens"]) > 0 and answer["max_model_len"] > 0
    text = httpx.post(first.base + "/detokenize", json={"model": MODEL, "tokens": answer["tokens"]}).json()
    assert text["prompt"].endswith("Hello there")
    for body in ({"model": MODEL}, {"model": MODEL, "prompt": "a", "messages": [{"role": "user", "content": "b"}]}):
        refused = httpx.post(first.base + "/tokenize", json=body)
        assert refused.status_code == 400 and "prompt" in refused.json()["error"]["message"]
    refused = httpx.post(first.base + "/detokenize", json={"model": MODEL, "tokens": [-1]})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "tokens"


def test_a_restarted_worker_claims_nothing_until_it_holds_it_again(fleet):
    """A worker stopped (SIGTERM) says it holds nothing; restarted and registered again (as a fleet's discovery does:
    the indexer's subscription does not outlive the process it connected to), the indexer holds nothing of what it
    held before, and follows what it holds from then on."""
    indexer, workers = fleet
    second = workers[1]
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hello"}]
    prompt = second.tokenize(messages)
    eventually(lambda: _scored_worker(indexer, prompt, "2"))
    second.server.stop()
    eventually(lambda: _cleared(indexer, prompt, "2"))
    workers[1] = restarted = Worker.start(*second.flags, events_port=second.events_port,
                                          replay_port=second.replay_port)
    indexer.unregister(2)
    indexer.register(2, restarted)
    assert indexer.scores(prompt).get("2", {}).get("gpu", 0) == 0
    reply, _, _ = restarted.chat(messages)
    restarted.chat([*messages, {"role": "assistant", "content": reply},
                                   {"role": "user", "content": "Are you there?"}])
    eventually(lambda: _scored_worker(indexer, prompt, "2"))


def _scored_worker(indexer: Indexer, prompt: list[int], worker: str) -> None:
    assert indexer.scores(prompt).get(worker, {}).get("gpu", 0) > 0


def _cleared(indexer: Indexer, prompt: list[int], worker: str) -> None:
    assert indexer.scores(prompt).get(worker, {}).get("gpu", 0) == 0


def test_after_a_churn_the_indexers_view_of_each_worker_is_what_its_tiers_hold(fleet):
    """Sixty turns across both workers (conversations continued, evicted to the host and dropped from it, salted
    ones beside, new ones started; `bench/kv_events.py --part churn` runs hundreds): once the events are delivered,
    the blocks the indexer holds for each worker, per medium (its `/dump`), are the blocks that worker's tiers hold
    (`GET /kv/blocks`, read from them)."""
    indexer, workers = fleet
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(_churn, workers, (0, 5)))
    for worker_id, worker in zip((1, 2), workers, strict=True):
        views = eventually(lambda worker_id=worker_id, worker=worker: _views_agree(indexer, worker_id, worker))
        assert views["GPU"] and views["CPU"], "the churn left caches on both tiers"


DYNAMO_TIERS = {"device": "GPU", "host_pinned": "CPU"}  # (how Dynamo names the media in its dump)
CHURN_TURNS = 30  # per worker (bench/kv_events.py --part churn runs hundreds)
SYSTEMS = [SYSTEM, "You are a travel agent. Answer briefly.", "You answer questions about trains, briefly."]


def _churn(worker: Worker, offset: int) -> None:
    """Ten conversations, five at a time (decoded together), each continued or begun anew (a salted one beside)."""
    conversations: list[list[dict]] = [[{"role": "system", "content": SYSTEMS[i % 3]}] for i in range(10)]

    def turn(index: int, number: int) -> None:
        messages = conversations[index]
        messages.append({"role": "user", "content": f"Question {number}: what about item {number * 13 % 97}?"})
        reply, _, _ = worker.chat(messages, max_tokens=2, **({"cache_salt": "tenant-3"} if index == 9 else {}))
        messages.append({"role": "assistant", "content": reply})
        if len(messages) > 13:  # a new conversation in its place
            conversations[index] = messages[:1]

    with ThreadPoolExecutor(5) as pool:
        for round_index in range(CHURN_TURNS // 5):
            picked = [(round_index * 3 + offset + step * 2) % 10 for step in range(5)]
            list(pool.map(turn, picked, [round_index * 5 + step for step in range(5)]))


def _views_agree(indexer: Indexer, worker_id: int, worker: Worker) -> dict[str, set[int]]:
    answer = httpx.get(worker.base + "/kv/blocks", timeout=30)
    answer.raise_for_status()
    held = {medium: set(ids) for medium, ids in answer.json()["blocks"].items()}
    seen: dict[str, set[int]] = {}
    for scope in indexer.http.get("/dump").json().values():
        for event in scope["events"]:
            if event["worker_id"] == worker_id:
                medium = DYNAMO_TIERS.get(event["storage_tier"], event["storage_tier"])
                blocks = event["event"]["data"]["stored"]["blocks"]
                seen.setdefault(medium, set()).update(block["block_hash"] for block in blocks)
    assert seen == {medium: ids for medium, ids in held.items() if ids}, (
        {m: len(ids) for m, ids in seen.items()}, {m: len(ids) for m, ids in held.items()})
    return held
