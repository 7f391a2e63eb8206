"""The deployment as shipped: the compose file and Dockerfile name files that exist, and the nginx
configuration routes sessions across real chatd worker processes sharing a real Redis."""

import asyncio
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import anthropic
import httpx
import pytest
import yaml
from websockets.asyncio.client import connect

from chatd.cli.client import ChatClient, ChatError
from chatd.cli.nginx_process import NginxProcess, nginx_binary
from chatd.cli.server_process import ServerProcess
from chatd.config import Settings
from sessions.redis_store import RedisSessionStore

ROOT = Path(__file__).resolve().parent.parent


def test_compose_file_parses_and_names_files_that_exist():
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    assert {"redis", "chatd-1", "chatd-2", "nginx"} <= set(services)
    assert "redis-cli" in services["redis"]["healthcheck"]["test"]
    for worker in ("chatd-1", "chatd-2"):
        assert services[worker]["environment"]["CHATD_REDIS_URL"].startswith("${CHATD_REDIS_URL:-redis://redis:")
        assert services[worker]["depends_on"]["redis"]["condition"] == "service_healthy"
        assert (ROOT / services[worker]["build"] / "Dockerfile").exists()
        gpu = yaml.safe_load((ROOT / "docker-compose.gpu.yml").read_text())["services"][worker]
        devices = gpu["deploy"]["resources"]["reservations"]["devices"]
        assert devices[0]["driver"] == "nvidia" and devices[0]["count"] == 1
        assert "/whl/cu" in gpu["build"]["args"]["TORCH_INDEX_URL"]
    for volume in services["nginx"]["volumes"]:
        assert (ROOT / volume.split(":")[0]).exists()
    for source in re.findall(r"^COPY (\S+)", (ROOT / "Dockerfile").read_text(), re.MULTILINE):
        assert (ROOT / source).exists(), source
    nginx_conf = (ROOT / "deploy/nginx/chatd.conf").read_text()
    for upstream in ("chatd-1", "chatd-2"):
        assert f"server {upstream}:8765" in nginx_conf
    assert "hash $chatd_session_key consistent;" in nginx_conf and "least_conn;" in nginx_conf
    # A Responses WebSocket lasts --responses-ws-max-age-s: the proxy never cuts it first.
    for timeout in re.findall(r"proxy_(?:read|send)_timeout (\d+)s;", nginx_conf):
        assert int(timeout) > Settings().responses_ws_max_age_s


def start_worker(checkpoint: Path, redis_url: str, *flags: str) -> ServerProcess:
    """`chatd serve` as its own process, as deployed."""
    return ServerProcess(["--model", str(checkpoint), "--device", "cpu", "--redis-url", redis_url,
                          "--lease-ttl-s", "2", "--thread-claim-lease-s", "2", *flags])


@pytest.fixture
def workers(tiny_checkpoint, redis_db):
    with ThreadPoolExecutor(2) as pool:  # both at once: most of a start is importing torch
        started = list(pool.map(lambda _: start_worker(tiny_checkpoint, redis_db.url), range(2)))
    yield started
    for running in started:
        running.stop()


@pytest.fixture
def nginx(workers, tmp_path):
    """Debian's nginx with the shipped configuration, its upstreams pointed at the two workers."""
    if nginx_binary() is None:
        pytest.skip("nginx is not installed (make test installs Debian's nginx-light where it can)")
    server = NginxProcess(workers, tmp_path)
    yield server.ws_url
    server.stop()


async def one_turn(url: str, session_id: str, content: str, **params):
    """A fresh connection through the proxy for every turn, as a reconnecting widget would."""
    async with ChatClient(await connect(f"{url}?session_id={session_id}")) as client:
        ready = await client.open_session(session_id=session_id)
        for _ in range(50):  # a lease left by a killed worker expires within its TTL
            try:
                return ready, await (await client.chat(session_id, content, **params)).result()
            except ChatError as error:
                if error.code != "busy":
                    raise
                await asyncio.sleep(0.2)
        raise AssertionError("the session stayed busy")


async def test_nginx_routes_a_session_to_one_worker_and_fails_over(nginx, workers):
    async with ChatClient(await connect(nginx)) as client:
        session_id = (await client.open_session(system="Be brief.")).session_id
    served_by, sources = set(), []
    for index in range(3):
        ready, done = await one_turn(nginx, session_id, f"question {index}", max_new_tokens=4)
        served_by.add(ready.worker)
        sources.append(done.cache.source)
    assert len(served_by) == 1 and sources[1:] == ["device", "device"], "every connection hit the same worker"
    pid = int(served_by.pop().rsplit(":", 1)[1])
    victim = next(worker for worker in workers if worker.process.pid == pid)
    victim.kill()
    ready, done = await one_turn(nginx, session_id, "are you still there?", max_new_tokens=4)
    assert int(ready.worker.rsplit(":", 1)[1]) != pid and ready.turns == 3
    assert (done.cache.source, done.cache.miss_reason) == ("miss", "cold")


async def test_a_worker_killed_mid_turn_leaves_every_completed_turn_and_no_trace(workers, redis_db,
                                                                                 tiny_checkpoint):
    first = f"ws://127.0.0.1:{workers[0].port}/ws"
    async with ChatClient(await connect(first)) as client:
        session_id = (await client.open_session()).session_id
        for index in range(2):
            await (await client.chat(session_id, f"completed {index}", max_new_tokens=4)).result()
        interrupted = await client.chat(session_id, "interrupted turn", max_new_tokens=400)
        await anext(interrupted)
        workers[0].kill()
        with pytest.raises(ChatError) as lost:
            await interrupted.result()
        assert (lost.value.code, lost.value.retryable) == ("disconnected", True)
    workers[0] = start_worker(tiny_checkpoint, redis_db.url)  # restarted
    ready, done = await one_turn(f"ws://127.0.0.1:{workers[0].port}/ws", session_id, "after the crash",
                                 max_new_tokens=4)
    assert ready.turns == 2 and done.usage.completion_tokens == 4
    stored = await RedisSessionStore(redis_db.url, retention_s=60).get(session_id)
    assert [m.content for m in stored.messages if m.role == "user"] == ["completed 0", "completed 1",
                                                                         "after the crash"]


async def test_a_thread_reply_claimed_by_a_killed_worker_can_be_continued_once_its_lease_ends(workers):
    """A continue streaming on worker 0 holds the reply's claim; worker 0 is killed mid-reply: on worker 1 the reply
    is still in flight (its claim is not renewed, not released), then, once the lease ends
    (`--thread-claim-lease-s`), continuable there."""
    bases = [f"http://127.0.0.1:{worker.port}" for worker in workers]
    model = httpx.get(bases[0] + "/v1/models").json()["data"][0]["id"]
    claude = [anthropic.AsyncAnthropic(base_url=base, api_key="unused", max_retries=0) for base in bases]
    beta = {"betas": ["message-threads-2026-08-12"], "extra_body": {"temperature": 0}}
    created = await claude[0].beta.messages.create(
        model=model, max_tokens=4, messages=[{"role": "user", "content": "Hello."}], thread={"type": "create"}, **beta)
    continuing = {"model": model, "messages": [{"role": "user", "content": "Go on."}],
                  "thread": {"type": "continue", "previous_message_id": created.id}, **beta}
    async with claude[0].beta.messages.stream(max_tokens=400, **continuing) as stream:
        async for event in stream:
            if event.type == "content_block_delta":
                workers[0].kill()
                break
    with pytest.raises(anthropic.BadRequestError) as in_flight:
        await claude[1].beta.messages.create(max_tokens=4, **continuing)
    assert in_flight.value.body["error"]["details"]["error_code"] == "thread_continue_in_flight"
    for _ in range(60):
        try:
            continued = await claude[1].beta.messages.create(max_tokens=4, **continuing)
            break
        except anthropic.BadRequestError as error:
            assert error.body["error"]["details"]["error_code"] == "thread_continue_in_flight"
            await asyncio.sleep(0.1)
    else:
        raise AssertionError("the dead worker's claim never ended")
    assert continued.usage.output_tokens == 4 and continued.stop_reason == "max_tokens"
