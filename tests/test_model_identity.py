"""The model identity every cache is stamped with covers the weights' content: a checkpoint changed under the
same name (a fine-tune rolled out over the old one) never reuses a cache, and its digest is computed once per file."""

import asyncio
import json

import redis.asyncio as redis
import torch
from transformers import LlamaForCausalLM
from websockets.asyncio.client import connect

from chatd.api.server import ChatServer
from chatd.cli.client import ChatClient
from chatd.config import Settings
from chatd.model.weights_digest import file_digest, weights_digest


def save_weights(tiny, folder, seed: int) -> None:
    """The tiny model's config and tokenizer with weights drawn from `seed`, saved as a checkpoint in `folder`."""
    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny.model.config).to(torch.float32).eval()
    model.save_pretrained(folder)
    tiny.tokenizer.save_pretrained(folder)


def test_a_weight_file_is_hashed_once_and_again_when_it_changes(tiny, tmp_path):
    folder, cache = tmp_path / "model", tmp_path / "cache"
    save_weights(tiny, folder, seed=1)
    weights = folder / "model.safetensors"
    first = file_digest(weights, cache)
    record = next((cache / "weight-digests").glob("*.json"))
    kept = json.loads(record.read_text())
    record.write_text(json.dumps({**kept, "digest": "kept"}))
    assert file_digest(weights, cache) == "kept", "an unchanged file is not hashed again"
    save_weights(tiny, folder, seed=2)
    assert file_digest(weights, cache) not in (first, "kept"), "a changed file is"
    assert weights_digest(folder, tiny.model, cache) != weights_digest(tmp_path / "nothing", tiny.model, cache)


async def test_a_checkpoint_whose_weights_changed_under_the_same_name_starts_with_fresh_caches(tiny, tmp_path,
                                                                                                redis_db):
    folder = tmp_path / "support-model"
    save_weights(tiny, folder, seed=1)
    settings = Settings(port=0, model=str(folder), device="cpu", redis_url=redis_db.url, remote_kv=True,
                        remote_kv_fetch="always",
                        cache_dir=tmp_path / "cache")
    async with ChatServer(settings) as before:
        await before.wait_ready()
        async with ChatClient(await connect(before.url)) as client:
            session_id = (await client.open_session(system="Be brief.")).session_id
            for question in ("My parcel is late.", "It was sent on Monday."):
                await (await client.chat(session_id, question, max_new_tokens=6)).result()
        old_key = before.engine.cache.model_key
    save_weights(tiny, folder, seed=2)  # the same name, config and shapes; other weights
    async with ChatServer(settings) as after:
        await after.wait_ready()
        assert after.engine.cache.model_key != old_key
        async with ChatClient(await connect(after.url)) as client:
            await client.open_session(session_id=session_id)
            turn = await client.chat(session_id, "Where is it now?", max_new_tokens=6)
            done = await turn.result()
        assert (done.cache.source, done.cache.miss_reason, done.cache.remote, done.cache.cleared) == \
            ("miss", "cold", None, []), "the old checkpoint's copy in Redis is not this model's: not even looked at"
        ids = await asyncio.wrap_future(after.engine.call(lambda store: list(store.device.peek(session_id).token_ids)))
        prompt = torch.tensor([ids[:done.usage.prompt_tokens]])
        expected = after.engine.loaded.model.generate(prompt, max_new_tokens=6, do_sample=False, min_new_tokens=6)
        reply = expected[0, prompt.shape[1]:].tolist()
        assert ids[done.usage.prompt_tokens:] == reply[:len(ids) - done.usage.prompt_tokens], "the new weights' reply"
        assert done.content == after.engine.loaded.tokenizer.decode(reply)
        header = json.loads(await redis.Redis.from_url(redis_db.url).get(f"chatd:{{{session_id}}}:kvmeta"))
        assert header["fingerprint"]["model_key"] == after.engine.cache.model_key, "its own copy replaced the old"
