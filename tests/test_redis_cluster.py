"""chatd on a real six-node Redis Cluster (three primaries, three replicas): found by itself from any node, every
store on it (sessions and leases, the prefix index, the chunked KV tier), turns acknowledged once a replica holds
them, a failover drill, and one-line errors for a cluster it cannot use."""

import asyncio
import json
import re
import subprocess
import sys
import urllib.request
from collections import Counter
from pathlib import Path

import pytest
import redis
import yaml

from chatd.cli.client import ChatError
from chatd.cli.server_process import free_port
from chatd.config import Settings
from sessions.redis_client import RedisSetupError, RedisTopology, topology
from tests.redis_cluster import BUS_OFFSET, RedisClusterNodes
from tests.support import two_workers_and_a_reference

QUESTIONS = ["My parcel is late.", "It was sent on Monday.", "Where is it now?", "Can you check again?",
             "Thanks.", "One more thing."]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    nodes = RedisClusterNodes(tmp_path_factory.mktemp("cluster"))
    nodes.start()
    try:
        yield nodes
    finally:
        nodes.stop()


async def test_a_conversation_alternating_workers_on_a_cluster_answers_like_a_cacheless_server(tiny, cluster):
    """Two workers given one node's URL find the cluster; a websocket conversation alternates between them turn by
    turn, each later turn continuing from the chunks in Redis; the keys spread over every primary."""
    assert topology(cluster.url) == RedisTopology(cluster=True, replicas=1)
    settings = Settings(port=0, redis_url=cluster.url, remote_kv=True,
                        remote_kv_fetch="always", remote_kv_chunk_tokens=16)
    async with two_workers_and_a_reference(tiny, settings) as (on_a, on_b, reference, servers):
        session_id = (await on_a.open_session(system="Be brief.")).session_id
        reference_id = (await reference.open_session(system="Be brief.")).session_id
        for number, question in enumerate(QUESTIONS):
            turn = await (on_a, on_b)[number % 2].chat(session_id, question, max_new_tokens=6)
            done = await turn.result()
            expected = await reference.chat(reference_id, question, max_new_tokens=6)
            await expected.result()
            assert turn.deltas == expected.deltas
            if number:
                assert done.cache.source == "remote" and done.usage.cached_tokens > 0
        assert servers[0].settings.redis_cluster is True
        stats = json.loads((await asyncio.to_thread(urllib.request.urlopen,
                                                    f"http://127.0.0.1:{servers[0].port}/v1/stats")).read())
        redis_now = stats["now"]["redis"]
        roles = Counter(node["role"] for node in redis_now["nodes"])
        assert redis_now["mode"] == "cluster" and roles == {"primary": 3, "replica": 3}, redis_now
        assert redis_now["wait_replicas"] == 1 and redis_now["waits"]["acked"] >= 4, redis_now  # every turn waited
        metrics = (await asyncio.to_thread(urllib.request.urlopen,
                                           f"http://127.0.0.1:{servers[0].port}/metrics")).read().decode()
        for role in ("primary", "replica"):
            assert re.search(rf'chatd:redis_nodes\{{model_name="[^"]+",role="{role}"\}} 3\.0', metrics)
        assert re.search(r'chatd:redis_slot_map_changes_total\{model_name="[^"]+"\} [1-9]', metrics)
        servers[0].engine.cache.remote._usage_at = float("-inf")  # (read now, not the last few seconds' figure)
        used, limit = servers[0].engine.cache.remote.usage()
        memory = [redis.Redis(host="127.0.0.1", port=port).info("memory") for port in cluster.primaries()]
        assert limit == sum(info["total_system_memory"] for info in memory)  # every primary's, not one node's
        assert used > max(info["used_memory"] for info in memory)
    held = {port: redis.Redis(host="127.0.0.1", port=port).dbsize() for port in cluster.primaries()}
    assert len(held) == 3 and all(count > 0 for count in held.values()), held


def test_a_cluster_url_for_another_database_or_a_cluster_not_ready_is_one_clear_line(cluster, tmp_path, redis_db):
    with pytest.raises(RedisSetupError, match="only database 0: use /0"):
        topology(cluster.url.removesuffix("/0") + "/3")
    with pytest.raises(RedisSetupError, match="is not a cluster node, but --redis-cluster is on"):
        topology(redis_db.url, forced=True)
    assert topology(redis_db.url) == RedisTopology(cluster=False, replicas=0)
    lonely = RedisClusterNodes(tmp_path, nodes=1)
    lonely.start(join=False)
    try:
        with pytest.raises(RedisSetupError, match="not ready"):
            topology(lonely.url)
    finally:
        lonely.stop()


def test_chatd_serve_names_the_setting_instead_of_a_traceback(cluster, tiny_checkpoint):
    run = subprocess.run([sys.executable, "-m", "chatd", "serve", "--model", str(tiny_checkpoint), "--port", "0",
                          "--redis-url", cluster.url.removesuffix("/0") + "/2"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 1 and "Traceback" not in run.stderr, run.stderr
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("chatd serve: --redis-url") and "CHATD_REDIS_URL" in last, run.stderr


async def test_openai_clients_continue_on_either_worker_of_a_cluster(tiny, cluster):
    """Stateless chat completions sent to either worker find their conversation through the prefix index in the
    cluster, and stored responses are continued by `previous_response_id` on the other worker: every reply is a
    cacheless server's, and every later request reads its history from a cache."""
    import openai

    from chatd.api.server import ChatServer

    def client(server) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="none", max_retries=0)

    shared = Settings(port=0, model="tiny-test", redis_url=cluster.url, remote_kv=True,
                      remote_kv_fetch="always", remote_kv_chunk_tokens=16)
    async with ChatServer(shared, load=lambda: tiny) as a, ChatServer(shared.model_copy(), load=lambda: tiny) as b, \
            ChatServer(Settings(port=0, model="tiny-test", session_cache=False), load=lambda: tiny) as alone:
        for server in (a, b, alone):
            await server.wait_ready()
        workers, reference = [client(a), client(b)], client(alone)
        messages = [{"role": "system", "content": "Be brief."}]
        for number, question in enumerate(QUESTIONS[:4]):
            messages.append({"role": "user", "content": question})
            arguments = dict(model="tiny-test", messages=messages, max_tokens=6, temperature=0)
            got = await workers[number % 2].chat.completions.create(**arguments)
            expected = await reference.chat.completions.create(**arguments)
            assert got.choices[0].message.content == expected.choices[0].message.content
            if number:
                assert got.usage.prompt_tokens_details.cached_tokens > 0
            messages.append({"role": "assistant", "content": got.choices[0].message.content})
        previous = expected_previous = None
        for number, question in enumerate(QUESTIONS[:4]):  # stored on A, continued on B, then A, then B
            arguments = dict(model="tiny-test", input=question, max_output_tokens=6, temperature=0)
            got = await workers[number % 2].responses.create(**arguments, previous_response_id=previous)
            expected = await reference.responses.create(**arguments, previous_response_id=expected_previous)
            assert got.output_text == expected.output_text
            if number:
                assert got.usage.input_tokens_details.cached_tokens > 0
            previous, expected_previous = got.id, expected.id
        for connection in (*workers, reference):
            await connection.close()


async def test_the_primary_with_the_most_keys_killed_mid_conversation_loses_no_completed_turn(tiny, tmp_path):
    """The failover drill: two workers alternate three conversations, one on each primary, on a cluster of their own;
    while a turn of the conversation on the primary holding the most keys streams, that primary is SIGKILLed. Its
    replica takes over; the turn in flight waits it out, every turn answered before is still in Redis, every later
    turn is served (after at most one retryable error each), and every reply is a cacheless server's."""
    nodes = RedisClusterNodes(tmp_path / "drill")
    nodes.start()
    try:
        settings = Settings(port=0, redis_url=nodes.url, remote_kv=True,
                            remote_kv_fetch="always", remote_kv_chunk_tokens=16)
        async with two_workers_and_a_reference(tiny, settings) as (on_a, on_b, reference, servers):
            conversations = await _one_conversation_per_primary(on_a, reference, nodes)
            killed = None
            for number, question in enumerate(QUESTIONS):
                worker = (on_a, on_b)[number % 2]
                if number == 3:  # mid-conversation: the primary with the most keys, while a reply of its streams
                    keys = {port: redis.Redis(host="127.0.0.1", port=port).dbsize() for port in nodes.primaries()}
                    killed = max(keys, key=keys.get)
                    conversations.sort(key=lambda conversation: conversation[2] != killed)
                for session_id, reference_id, primary in conversations:
                    turn = await worker.chat(session_id, question, max_new_tokens=6)
                    if primary == killed and number == 3:
                        async for _ in turn:
                            nodes.kill(killed)
                            break
                    turn, errors = await _served_after_retries(worker, session_id, question, turn)
                    assert len(errors) <= 1 and all(error.retryable for error in errors), errors
                    expected = await reference.chat(reference_id, question, max_new_tokens=6)
                    await expected.result()
                    assert turn.deltas == expected.deltas, number
                    stored = await servers[number % 2].sessions.get(session_id)
                    assert len(stored.messages) == 2 * (number + 1)  # every completed turn, each once
            nodes.wait_failed_over(killed)
            assert killed not in nodes.primaries() and len(nodes.primaries()) == 3
            assert servers[1].sessions.state()["retries"] > 0  # the turn in flight waited out the failover
    finally:
        nodes.stop()


async def _one_conversation_per_primary(client, reference, nodes: RedisClusterNodes) -> list[list]:
    """Sessions opened until each primary holds one: [session id, its reference's, the primary's port] each."""
    slots = redis.RedisCluster.from_url(nodes.url)
    found: dict[int, list] = {}
    while len(found) < 3:
        session_id = (await client.open_session(system="Be brief.")).session_id
        port = slots.get_node_from_key(f"chatd:{{{session_id}}}:meta").port
        if port not in found:
            found[port] = [session_id, (await reference.open_session(system="Be brief.")).session_id, port]
    slots.close()
    return list(found.values())


async def _served_after_retries(worker, session_id: str, question: str, turn):
    """Send `question` until it is answered (a retryable error is waited out): the turn, and the errors met."""
    errors = []
    while True:
        try:
            await turn.result()
            return turn, errors
        except ChatError as error:
            errors.append(error)
            assert error.retryable and len(errors) <= 3, errors
            await asyncio.sleep(1.0)
            turn = await worker.chat(session_id, question, max_new_tokens=6)


def test_the_compose_cluster_profile_starts_a_cluster_chatd_finds(tmp_path):
    """The compose file's cluster profile, run as it says on real redis-servers (service names mapped to local
    ports): six nodes with its options, joined by its init command (which a second start leaves alone), found by
    chatd as a cluster whose primaries each have a replica; the workers reach it through CHATD_REDIS_URL."""
    compose = yaml.safe_load((Path(__file__).resolve().parent.parent / "docker-compose.yml").read_text())
    services = compose["services"]
    names = [f"redis-node-{number}" for number in range(1, 7)]
    assert all(services[name]["profiles"] == ["cluster"] for name in [*names, "redis-cluster-init"])
    for worker in ("chatd-1", "chatd-2"):
        assert services[worker]["environment"]["CHATD_REDIS_URL"] == "${CHATD_REDIS_URL:-redis://redis:6379/0}"
        assert services[worker]["restart"] == "unless-stopped", "restarted until the cluster is joined"
    ports = {name: free_port(BUS_OFFSET) for name in names}
    processes = []
    try:
        for name in names:
            service = services[name]
            assert service["hostname"] == name and service["image"] == "redis:7"
            command = service["command"][2].removeprefix("exec ").replace("$$HOSTNAME", "127.0.0.1").split()
            folder = tmp_path / name
            folder.mkdir()
            processes.append(subprocess.Popen([*command, "--port", str(ports[name]), "--dir", str(folder)],
                                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        init = services["redis-cluster-init"]["command"][2].replace("$$", "$")  # (compose's escape of $)
        init = init.replace("-h redis-node-1", f"-p {ports[names[0]]}")
        for name in names:
            init = init.replace(f"{name}:6379", f"127.0.0.1:{ports[name]}")
        RedisClusterNodes._wait(lambda: all(redis.Redis(port=port).ping() for port in ports.values()))
        for _ in range(2):  # (the second start finds the cluster joined)
            done = subprocess.run(["sh", "-c", init], capture_output=True, text=True, timeout=60)
            assert done.returncode == 0, done.stdout + done.stderr
        url = f"redis://127.0.0.1:{ports[names[0]]}/0"
        # (slots are covered, replicas synced and gossiped some seconds after the init: "not ready" until then)
        RedisClusterNodes._wait(lambda: topology(url) == RedisTopology(cluster=True, replicas=1), timeout_s=60)
    finally:
        for process in processes:
            process.kill()
            process.wait(10)
