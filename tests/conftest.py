import itertools
import os
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import torch

from chatd.api.server import ChatServer
from chatd.config import Settings
from chatd.model.loader import LoadedModel, converted_checkpoint, default_cache_dir, load_model
from tests.redis_server import DATABASES, RedisDatabase, RedisServer
from tests.support import openai_client, tiny_model


def pytest_configure(config) -> None:
    """Under pytest-xdist each worker gets its own share of the cores, and so does everything it starts
    (servers, Redis, nginx, Chromium inherit the affinity; chatd's default --threads reads it): two
    workers on two cores then never fight over one core, which collapses torch's threads."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER"), os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if not (worker and count and hasattr(os, "sched_setaffinity")):  # one process, or not Linux
        return
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) > 1:
        share = cores[int(worker.removeprefix("gw")) % int(count)::int(count)] or cores
        os.sched_setaffinity(0, share)
        torch.set_num_threads(len(share))


@pytest.fixture(scope="session")
def model_cache_dir() -> Path:
    return Path(os.environ.get("CHATD_CACHE_DIR", default_cache_dir()))


@pytest.fixture(scope="session")
def smollm2_dir(model_cache_dir) -> Path:
    """The bundled SmolLM2 converted to a transformers checkpoint (converted once per machine)."""
    return converted_checkpoint("smollm2-135m", model_cache_dir)


@pytest.fixture(scope="session")
def tiny(smollm2_dir) -> LoadedModel:
    return tiny_model(smollm2_dir)


@pytest.fixture(scope="session")
def tiny_checkpoint(tiny, tmp_path_factory) -> Path:
    """The tiny model saved as a local checkpoint, as a user's own model would be."""
    path = tmp_path_factory.mktemp("tiny-model")
    tiny.model.save_pretrained(path)
    tiny.tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def smollm2(model_cache_dir) -> LoadedModel:
    return load_model("smollm2-135m", device="cpu", dtype="float32", cache_dir=model_cache_dir)


@pytest.fixture
async def openai_pair(smollm2) -> tuple[openai.AsyncOpenAI, openai.AsyncOpenAI]:
    """SmolLM2 served with and without the session cache, an `openai` client on each (closed on the test's
    event loop): (client, uncached)."""
    async with ChatServer(Settings(port=0), load=lambda: smollm2) as server, \
            ChatServer(Settings(port=0, session_cache=False), load=lambda: smollm2) as uncached:
        await server.wait_ready()
        await uncached.wait_ready()
        async with openai_client(server) as client, openai_client(uncached) as reference:
            yield client, reference


@pytest.fixture(scope="session")
def shared_redis(tmp_path_factory) -> Iterator[RedisServer]:
    """One redis-server for the run (for each xdist worker): tests that leave it running use `redis_db`."""
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()


_database_numbers = itertools.count(1)


@pytest.fixture
def redis_db(shared_redis) -> RedisDatabase:
    """A database of the shared redis-server that no other test uses."""
    number = next(_database_numbers)
    assert number < DATABASES, "more tests use Redis than the shared server has databases"
    return RedisDatabase(shared_redis, number)


@pytest.fixture
def redis_server(tmp_path) -> Iterator[RedisServer]:
    """A redis-server of the test's own, for a test that stops, restarts or freezes it, or reconfigures it."""
    server = RedisServer(tmp_path)
    server.start()
    yield server
    server.stop()


@pytest.fixture
def redis_with_replica(tmp_path) -> Iterator[tuple[RedisServer, RedisServer]]:
    """A redis-server of the test's own and a replica of it, synced: (primary, replica)."""
    folders = [tmp_path / "primary", tmp_path / "replica"]
    for folder in folders:
        folder.mkdir()
    primary = RedisServer(folders[0])
    primary.start()
    replica = RedisServer(folders[1], "--replicaof", "127.0.0.1", str(primary.port))
    replica.start()
    primary.wait_replicated()
    try:
        yield primary, replica
    finally:
        replica.stop()
        primary.stop()

