"""Stateless OpenAI clients across workers: real worker processes on one real Redis (sessions, the prefix
index and caches), behind the shipped nginx configuration, talked to by the official `openai` SDK with no
session hints. Every turn lands wherever nginx sends it, continues its conversation from a cache, and
answers exactly like a single server without a session cache."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import anthropic
import openai
import pytest

from chatd.cli.nginx_process import NginxProcess, nginx_binary
from chatd.cli.server_process import ServerProcess
from tests.redis_server import RedisServer

TURNS = 6
KEYS = ("key-alpha", "key-beta")
POLICY = (" Answer in one or two short sentences, be polite, never promise refunds you cannot grant, and ask for the "
          "customer's account number before discussing anything specific to their account.")
CONVERSATIONS = [  # system prompts of the length a customer-service bot has, and short questions
    ("You are the billing desk of a phone company." + POLICY, "My bill is higher this month, question {}."),
    ("You are a helpful travel agent for a small agency." + POLICY, "I want to fly somewhere warm, idea {}."),
    ("You answer questions about the recipes on our cooking site." + POLICY, "How long do I boil an egg, try {}?"),
]


def worker(checkpoint, redis_url: str, *flags: str) -> ServerProcess:
    """A `--remote-kv` worker that always fetches: the tiny model's prefill is as fast as a round trip to Redis,
    and what is tested is that the caches carry across workers, not the cost model."""
    return ServerProcess(["--model", str(checkpoint), "--device", "cpu", "--redis-url", redis_url, "--remote-kv",
                          "--remote-kv-fetch", "always",
                          "--lease-ttl-s", "2", *[f"--api-key={key}" for key in KEYS], *flags])


@dataclass
class Cluster:
    """Worker processes on one Redis, behind the shipped nginx configuration."""

    redis: RedisServer
    workers: list[ServerProcess]
    nginx: NginxProcess


@contextmanager
def cluster(checkpoint, folder: Path) -> Iterator[Cluster]:
    if nginx_binary() is None:
        pytest.skip("nginx is not installed (make test installs Debian's nginx-light where it can)")
    redis_server = RedisServer(folder)
    redis_server.start()
    with ThreadPoolExecutor(2) as pool:  # both start at once: most of a start is importing torch
        workers = list(pool.map(lambda _: worker(checkpoint, redis_server.url), range(2)))
    nginx = NginxProcess(workers, folder)
    try:
        yield Cluster(redis_server, workers, nginx)
    finally:
        nginx.stop()
        for running in workers:
            running.stop()
        redis_server.stop()


@pytest.fixture(scope="module")
def shared(tiny_checkpoint, tmp_path_factory):
    """For the tests that leave every worker running."""
    with cluster(tiny_checkpoint, tmp_path_factory.mktemp("cluster")) as started:
        yield started


@pytest.fixture
def own(tiny_checkpoint, tmp_path):
    """For a test that kills or restarts a worker."""
    with cluster(tiny_checkpoint, tmp_path) as started:
        yield started


@pytest.fixture(scope="module")
def reference(tiny_checkpoint):
    """One server, no Redis, no session cache: every reply recomputed from the whole prompt."""
    server = ServerProcess(["--model", str(tiny_checkpoint), "--device", "cpu", "--no-session-cache",
                            *[f"--api-key={key}" for key in KEYS]])
    yield server
    server.stop()


@dataclass
class Client:
    """The official SDK against one URL, as one key, naming the model as served (its path)."""

    api: openai.OpenAI
    model: str

    def ask(self, messages: list[dict], **headers: str):
        """One turn: the completion and the headers it came with."""
        raw = self.api.chat.completions.with_raw_response.create(
            model=self.model, messages=messages, max_tokens=8, temperature=0, extra_headers=headers or None)
        return raw.parse(), raw.headers


def client(base_url: str, model, key: str = KEYS[0]) -> Client:
    return Client(openai.OpenAI(base_url=f"{base_url}/v1", api_key=key, max_retries=3, timeout=60), str(model))


def _interleave(started: Cluster, reference: ServerProcess, checkpoint, kill_after_turn: int | None = None
                ) -> tuple[list[list[dict]], list[str]]:
    """The three conversations, turn by turn, each turn through nginx and on the reference: equal replies, and from
    turn 3 on at least 80% of every prompt read from a cache. The histories, and the session each last ran in."""
    balanced = client(started.nginx.http_url, checkpoint)
    solo = client(f"http://127.0.0.1:{reference.port}", checkpoint)
    histories = [[{"role": "system", "content": system}] for system, _ in CONVERSATIONS]
    served_by: set[str] = set()
    sessions = [""] * len(CONVERSATIONS)
    for turn in range(1, TURNS + 1):
        if turn == (kill_after_turn or TURNS) + 1:
            started.workers[0].kill()
        for number, (history, (_, question)) in enumerate(zip(histories, CONVERSATIONS, strict=True)):
            history.append({"role": "user", "content": question.format(turn)})
            completion, headers = balanced.ask(history)
            expected, _ = solo.ask(history)
            reply = completion.choices[0].message.content
            assert reply == expected.choices[0].message.content, f"turn {turn}: {history[0]['content']}"
            usage = completion.usage
            if turn >= 3:
                assert usage.prompt_tokens_details.cached_tokens >= 0.8 * usage.prompt_tokens, (turn, usage)
            served_by.add(headers["x-chatd-worker"])
            history.append({"role": "assistant", "content": reply})
            sessions[number] = headers["x-chatd-session-id"]
    assert len(served_by) >= 2, "nginx balanced the requests that name no session over both workers"
    return histories, sessions


def test_interleaved_conversations_through_nginx_continue_from_their_caches(shared, reference, tiny_checkpoint):
    _interleave(shared, reference, tiny_checkpoint)


def test_a_worker_killed_then_restarted_its_conversations_go_on_from_redis(own, reference, tiny_checkpoint):
    """Worker 0 is killed after turn 4: the rest land on worker 1, from the caches in Redis. Then worker 0 starts
    again, with nothing in its memory, and continues a conversation worker 1 served last: the same session, its
    cache read from Redis."""
    histories, sessions = _interleave(own, reference, tiny_checkpoint, kill_after_turn=4)
    own.workers[0] = worker(tiny_checkpoint, own.redis.url)
    completion, headers = client(f"http://127.0.0.1:{own.workers[0].port}", tiny_checkpoint).ask(
        [*histories[2], {"role": "user", "content": "Thanks, and the last question?"}])
    assert headers["x-chatd-session-id"] == sessions[2]
    assert completion.usage.prompt_tokens_details.cached_tokens >= 0.8 * completion.usage.prompt_tokens


def test_a_session_header_pins_a_conversation_to_one_worker(shared, tiny_checkpoint):
    balanced = client(shared.nginx.http_url, tiny_checkpoint)
    history = [{"role": "system", "content": CONVERSATIONS[0][0]}, {"role": "user", "content": "Hello there."}]
    completion, headers = balanced.ask(history)
    session_id, workers_seen = headers["x-chatd-session-id"], set()
    for turn in range(4):
        history += [{"role": "assistant", "content": completion.choices[0].message.content},
                    {"role": "user", "content": f"And question {turn}?"}]
        completion, headers = balanced.ask(history, **{"X-Session-Id": session_id})
        workers_seen.add(headers["x-chatd-worker"])
        assert headers["x-chatd-session-id"] == session_id
        assert completion.usage.prompt_tokens_details.cached_tokens >= 0.8 * completion.usage.prompt_tokens
    assert len(workers_seen) == 1, "the session header's hash sent every request to one worker"


def test_another_keys_requests_never_reach_a_keys_sessions(shared, reference, tiny_checkpoint):
    url = shared.nginx.http_url
    alpha, beta = client(url, tiny_checkpoint, KEYS[0]), client(url, tiny_checkpoint, KEYS[1])
    history = [{"role": "system", "content": CONVERSATIONS[1][0]}]
    for turn in range(3):
        history.append({"role": "user", "content": CONVERSATIONS[1][1].format(turn)})
        completion, alpha_headers = alpha.ask(history)
        history.append({"role": "assistant", "content": completion.choices[0].message.content})
    history.append({"role": "user", "content": "One more thing."})
    completion, beta_headers = beta.ask(history)  # the same conversation, word for word, from another key
    assert completion.usage.prompt_tokens_details.cached_tokens == 0, "nothing of the other key's was reused"
    assert beta_headers["x-chatd-session-id"] != alpha_headers["x-chatd-session-id"]
    expected, _ = client(f"http://127.0.0.1:{reference.port}", tiny_checkpoint, KEYS[1]).ask(history)
    assert completion.choices[0].message.content == expected.choices[0].message.content


def test_the_same_conversation_sent_to_two_workers_at_once_answers_both(shared, reference, tiny_checkpoint):
    """Two stateless clients with word-for-word the same conversation, at the same moment, on two workers:
    both match one session; the one that finds it taken (or moved on) branches, and both get the reply."""
    direct = [client(f"http://127.0.0.1:{worker.port}", tiny_checkpoint) for worker in shared.workers]
    solo = client(f"http://127.0.0.1:{reference.port}", tiny_checkpoint)  # follows along: it knows the reply ids
    history = [{"role": "system", "content": CONVERSATIONS[0][0]}]
    for turn in range(2):
        history.append({"role": "user", "content": f"Twin question {turn}."})
        completion, _ = direct[0].ask(history)
        assert completion.choices[0].message.content == solo.ask(history)[0].choices[0].message.content
        history.append({"role": "assistant", "content": completion.choices[0].message.content})
    history.append({"role": "user", "content": "And the twin follow-up?"})
    with ThreadPoolExecutor(2) as pool:
        answers = list(pool.map(lambda api: api.ask(history), direct))
    expected, _ = solo.ask(history)
    for completion, _ in answers:
        assert completion.choices[0].message.content == expected.choices[0].message.content
    assert len({headers["x-chatd-session-id"] for _, headers in answers}) == 2, "one continued, one branched"


def test_an_anthropic_thread_continues_on_whichever_worker_nginx_sends_it_to(shared, reference, tiny_checkpoint):
    """A thread's continues name no session: nginx balances them over the workers, and each finds the thread and its
    session in Redis and its cache in the remote tier; every reply equals the reference server's to the whole
    conversation."""
    model, beta = str(tiny_checkpoint), ["message-threads-2026-08-12"]
    balanced = anthropic.Anthropic(base_url=shared.nginx.http_url, api_key=KEYS[0], max_retries=3, timeout=60)
    solo = anthropic.Anthropic(base_url=f"http://127.0.0.1:{reference.port}", api_key=KEYS[0], timeout=60)
    system, question = CONVERSATIONS[1]
    history, previous, served_by = [], None, set()
    for turn in range(1, 7):
        asked = {"role": "user", "content": question.format(turn)}
        thread = {"type": "continue", "previous_message_id": previous.id} if previous else {"type": "create"}
        raw = balanced.beta.messages.with_raw_response.create(
            model=model, max_tokens=8, messages=[asked], thread=thread, betas=beta, extra_body={"temperature": 0},
            **({} if previous else {"system": system}))
        previous = raw.parse()
        served_by.add(raw.headers["x-chatd-worker"])
        history.append(asked)
        expected = solo.messages.create(model=model, max_tokens=8, system=system, messages=history,
                                        extra_body={"temperature": 0})
        assert [b.model_dump() for b in previous.content] == [b.model_dump() for b in expected.content], turn
        history.append({"role": "assistant", "content": [b.model_dump() for b in expected.content]})
    assert len(served_by) >= 2, "nginx balanced the continues over both workers"
