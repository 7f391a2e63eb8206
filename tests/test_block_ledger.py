"""The ledger of blocks behind KV events: each block published once however many keys hold it, removed when the
last lets it go, a write-back costing only its new blocks, the full state after a lost batch; and, on a running
engine, what it states equals what the tiers hold."""

from __future__ import annotations

from cache_store.block_ledger import (
    AllBlocksCleared,
    BlockLedger,
    BlockRemoved,
    BlockStored,
    block_chain,
    blocks_of,
    held_tokens,
    public_scope,
)
from chatd.engine.kv_events import encode
from sessions import Session
from tests.support import run_turn, running_engine

BLOCK = 4


def ledger(accept: list[bool] | None = None) -> tuple[BlockLedger, list[list]]:
    batches: list[list] = []

    def send(events: list) -> bool:
        if accept is not None and not accept.pop(0):
            return False
        batches.append(events)
        return True

    return BlockLedger(BLOCK, send), batches


def chain(tokens: list[int], scope: str | None = None) -> list[int]:
    return block_chain(tokens, BLOCK, scope)


def test_shared_blocks_are_stated_once_and_removed_with_their_last_holder():
    book, batches = ledger()
    assert batches == [[AllBlocksCleared()]]
    system, first, second = list(range(8)), [*range(8), 50, 51, 52, 53, 54], [*range(8), 60, 61, 62, 63]
    book.held("GPU", "segment", system)
    book.held("GPU", "a", first)
    book.flush()
    ids = chain(first)
    assert batches[-1] == [BlockStored("GPU", ids[:2], None, system, None),
                           BlockStored("GPU", ids[2:], ids[1], first[8:12], None)]
    book.held("GPU", "b", second)
    book.flush()
    assert batches[-1] == [BlockStored("GPU", chain(second)[2:], ids[1], second[8:12], None)], "only its own block"
    book.let_go("GPU", "a")
    book.let_go("GPU", "segment")
    book.flush()
    assert batches[-1] == [BlockRemoved("GPU", [ids[2]])], "the system prompt's blocks stay while b holds them"
    book.let_go("GPU", "b")
    book.flush()
    assert batches[-1] == [BlockRemoved("GPU", chain(second))]
    assert book.blocks("GPU") == set()


def test_a_write_back_costs_its_new_blocks_and_a_crop_removes_the_rest():
    book, batches = ledger()
    history = list(range(100, 112))
    book.held("GPU", "s", history)
    book.flush()
    longer = [*history, 1, 2, 3, 4, 5]
    book.let_go("GPU", "s")  # (the store takes the entry back, then the tier holds it again)
    book.held("GPU", "s", longer)
    book.flush()
    assert batches[-1] == [BlockStored("GPU", chain(longer)[3:], chain(longer)[2], longer[12:16], None)]
    book.held("GPU", "s", longer[:6])  # cropped: what the prompt shares with it
    book.flush()
    assert batches[-1] == [BlockRemoved("GPU", chain(longer)[1:])]
    assert book.blocks("GPU") == set(chain(longer)[:1])


def test_each_medium_counts_apart_and_a_salted_scope_has_blocks_of_its_own():
    book, batches = ledger()
    tokens = list(range(8))
    book.held("GPU", "a", tokens)
    book.held("CPU", "a", tokens)
    book.flush()
    assert [event.medium for event in batches[-1]] == ["GPU", "CPU"]
    scoped = BlockLedger(BLOCK, lambda events: batches.append(events) or True,
                         scope_of=lambda key: public_scope("key-abc", "fleet secret"))
    scoped.held("GPU", "a", tokens)
    scoped.flush()
    stored = batches[-1][0]
    assert stored.scope is not None and "abc" not in stored.scope and stored.block_ids != chain(tokens)
    assert public_scope("key-abc", "another secret") != stored.scope, "the name depends on the fleet's secret"
    assert public_scope(None, "fleet secret") is None


def test_a_lost_batch_is_followed_by_everything_held():
    book, batches = ledger(accept=[True, False, True])
    book.held("GPU", "a", list(range(8)))
    book.flush()  # refused: the queue was full
    book.held("CPU", "b", list(range(20, 28)))
    book.flush()
    assert book.batches_dropped == 1
    assert batches[-1] == [AllBlocksCleared(), BlockStored("GPU", chain(list(range(8))), None, list(range(8)), None),
                           BlockStored("CPU", chain(list(range(20, 28))), None, list(range(20, 28)), None)]


def test_what_a_running_engine_states_is_what_its_tiers_hold(tiny):
    """A churn of 200 turns over twelve sessions on a small device budget and a smaller host one (shared system
    prompts, evictions to the host, restores, caches dropped from the host, a session deleted, one offload of
    everything): after each turn, the blocks stated per medium are those of the caches the tiers hold."""
    with running_engine(tiny, device_cache_mb=0.3, host_cache_mb=0.4, shared_prompt_min_tokens=16) as engine:
        batches: list[list] = []
        book = engine.call(lambda store: _observe(store, engine, batches)).result()
        systems = ["You are the help desk of a library. " * 3, "You answer questions about trains. " * 3]
        sessions = [Session(f"s{i}", system=systems[i % 2]) for i in range(12)]
        offloaded = 0
        for turn in range(200):
            session = sessions[(turn * 7) % len(sessions)]
            run_turn(engine, session, f"Question {turn} about books", max_new_tokens=6)
            _, held = engine.call(lambda store: _stated_and_held(store, book)).result()
            offloaded += bool(held["CPU"])
        engine.close_session("s0")
        engine.offload_idle()
        engine.call(lambda store: _stated_and_held(store, book)).result()
        assert offloaded > 50, "the host tier held caches through the churn"
        assert any(isinstance(event, BlockRemoved) for batch in batches for event in batch)


def _observe(store, engine, batches):
    book = BlockLedger(16, lambda events: batches.append(events) or True,
                       lambda key: public_scope(store.owner_of(key), "secret"))
    store.device.events = store.host.events = book
    engine.ledger = book
    return book


def _stated_and_held(store, book):
    book.flush()
    stated = {medium: book.blocks(medium) for medium in ("GPU", "CPU")}
    held = blocks_of(held_tokens(store), 16, "secret")
    assert stated == held, (stated, held)
    return stated, held



def test_events_are_encoded_as_vllm_encodes_them_in_both_forms():
    stored = BlockStored("CPU", [7, 8], 6, list(range(32)), "salt-1")
    as_map = encode(stored, 16, as_map=True)
    assert as_map == {"type": "BlockStored", "block_hashes": [7, 8], "parent_block_hash": 6,
                      "token_ids": list(range(32)), "block_size": 16, "lora_id": None, "medium": "CPU",
                      "lora_name": "salt-1", "extra_keys": None}  # (a run that continues a sequence: no extra keys)
    first = encode(BlockStored("CPU", [6, 7], None, list(range(32)), "salt-1"), 16, as_map=True)
    assert first["extra_keys"] == [["salt-1"], None], "the scope on a sequence's first block, as vLLM's cache_salt"
    assert encode(stored, 16, as_map=False) == ["BlockStored", [7, 8], 6, list(range(32)), 16, None, "CPU", "salt-1"]
    assert encode(BlockRemoved("GPU", [7]), 16, as_map=False) == ["BlockRemoved", [7], "GPU"]
    assert encode(AllBlocksCleared(), 16, as_map=True) == {"type": "AllBlocksCleared"}
    assert encode(BlockStored("GPU", [1], None, list(range(16)), None), 16, True)["extra_keys"] is None
