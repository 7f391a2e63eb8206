import os
from pathlib import Path

import pytest

from chatd.model.loader import LoadedModel, converted_checkpoint, default_cache_dir, load_model
from tests.support import tiny_model


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
def redis_server(tmp_path):
    from tests.redis_server import RedisServer

    server = RedisServer(tmp_path)
    server.start()
    yield server
    server.stop()
