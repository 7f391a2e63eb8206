"""Caches in Redis as runs of chunks, between two cache stores (two workers) on a real redis-server: a prefix
shared by an owner's sessions is stored once, a turn writes only its new chunks, a worker fetches only the chunks
it lacks, and a chunk that is damaged, gone or another owner's ends what is restored at the chunk before it."""

import json
import struct
import threading

import pytest
import safetensors.torch
import torch

import cache_store.remote.chunks as chunks
from cache_store import CacheEntry, CacheQuery, CacheStore, Offloader
from cache_store.device.arena import ArenaCache, KVArena
from cache_store.remote.chunks import chunk_identity
from cache_store.remote.remote_format import FORMAT_VERSION, RemoteHeader, chunk_key
from cache_store.remote.remote_tier import RemoteTier
from tests.support import lookup_through_redis
from tests.test_cache_store import BYTES_PER_TOKEN, HEAD_DIM, HEADS, LAYERS, LAYOUT, Clock, make_entry

CHUNK = 16
POLICY = list(range(1000, 1040))  # 40 tokens: two whole chunks, and part of a third


def worker(url: str, tokens: int = 2000, tier: type[RemoteTier] = RemoteTier, **kwargs
           ) -> tuple[CacheStore, RemoteTier]:
    """A cache store on a KV arena, with a remote tier of 16-token chunks."""
    arena = KVArena(LAYERS, HEADS, HEAD_DIM, torch.float32, torch.device("cpu"), tokens=tokens)
    remote = tier(url, ttl_s=600, chunk_tokens=CHUNK)
    store = CacheStore(new_cache=lambda n: ArenaCache(arena), offloader=Offloader(torch.device("cpu")), layout=LAYOUT,
                       model_key="test-model", device_budget_bytes=tokens * BYTES_PER_TOKEN,
                       host_budget_bytes=tokens * BYTES_PER_TOKEN, clock=Clock(), remote=remote,
                       always_fetch=True, **kwargs)  # (what is tested is the chain, not the cost model)
    return store, remote


def history(session: int, tokens: int) -> list[int]:
    """The policy, then the session's own ids."""
    return (POLICY + list(range(session * 10_000, session * 10_000 + tokens)))[:tokens]


def write_turn(store: CacheStore, remote: RemoteTier, session_id: str, token_ids: list[int], version: int,
               scope: str | None = None) -> CacheEntry:
    """A turn of `session_id` that ends with a cache of `token_ids` (the same bytes for the same ids), written to
    Redis before this returns."""
    store.lookup(CacheQuery(session_id, [*token_ids, 7], session_version=version - 1, owner=scope))
    entry = CacheEntry(store.new_cache(len(token_ids)), list(token_ids))  # a region of the arena, as turns have
    entry.cache.load(keyed_entry(token_ids).tensors())
    store.put(session_id, entry, session_version=version)
    assert remote.wait_written(session_id, 10)
    return store.device.peek(session_id)


def keyed_entry(token_ids: list[int]) -> CacheEntry:
    """A cache whose every position's keys and values depend only on its id and place: two sessions with the same
    ids have the same bytes, as a model would give them."""
    entry = make_entry(token_ids)
    for keys, values in entry.tensors():
        for position, token in enumerate(token_ids):
            keys[..., position, :] = token + position / 100
            values[..., position, :] = -token - position / 100
    return entry


def chunk_names(token_ids: list[int], scope: str = "owner:*", kind: str = "exact") -> list[str]:
    return chunks.chunk_names(token_ids, chunk_identity("test-model", scope, LAYOUT, kind), CHUNK)


def same_tensors(entry: CacheEntry, expected: CacheEntry, tokens: int) -> bool:
    from cache_store.device import chain
    got = chain.full_tensors(entry.cache) if isinstance(entry.cache, ArenaCache) else entry.tensors()
    want = expected.tensors()
    return all(k.equal(wk[..., :tokens, :]) and v.equal(wv[..., :tokens, :])
               for (k, v), (wk, wv) in zip(got, want, strict=True))


@pytest.fixture
def workers(redis_db):
    made = []

    def make(**kwargs):
        made.append(worker(redis_db.url, **kwargs))
        return made[-1]

    yield make
    for _, remote in made:
        remote.close()


def test_sessions_of_one_owner_share_their_policy_chunks_and_write_them_once(workers, redis_db):
    store, remote = workers()
    for session in range(3):
        write_turn(store, remote, f"s{session}", history(session, 64), 1)
    client = remote._redis
    held = {key.decode() for key in client.scan_iter("chatd:kvchunk:*")}
    # each 64-token history is four chunks: the first two (policy only) shared, then two of its own
    assert held == {chunk_key(name) for session in range(3) for name in chunk_names(history(session, 64))}
    assert len(held) == 2 + 3 * 2
    assert remote.counters["chunks_written"] == 8
    stats = store.stats()
    assert stats["remote_snapshot_kv_bytes_skipped"] == 2 * 2 * CHUNK * BYTES_PER_TOKEN, "policy chunks not copied"
    assert stats["remote_chunks_renewed"] == 2 * 2


def test_a_later_turn_copies_and_writes_only_its_new_chunks(workers):
    store, remote = workers()
    write_turn(store, remote, "s", history(0, 40), 1)
    snapshot_bytes = store.counters["remote_snapshot_bytes"]
    assert remote.counters["chunks_written"] == 2
    write_turn(store, remote, "s", history(0, 100), 2)
    assert remote.counters["chunks_written"] == 100 // CHUNK, "chunks 2 to 5: only the new ones"
    assert store.counters["remote_snapshot_bytes"] - snapshot_bytes == (100 - 32) * BYTES_PER_TOKEN


def test_a_cache_of_whole_chunks_that_redis_holds_is_written_with_an_empty_tail_and_restored(workers):
    writer, writer_remote = workers()
    reader, _ = workers()
    write_turn(writer, writer_remote, "s", history(0, 2 * CHUNK), 1)
    write_turn(writer, writer_remote, "s", history(0, 2 * CHUNK), 2)  # every chunk known: nothing to copy
    assert writer.counters["remote_snapshot_failures"] == 0 and writer_remote.counters["chunks_renewed"] == 2
    found = lookup_through_redis(reader, "s", [*history(0, 2 * CHUNK), 7], session_version=2)
    assert (found.source, found.cached_tokens, found.cleared) == ("remote", 2 * CHUNK, ())
    assert same_tensors(found.entry, keyed_entry(history(0, 2 * CHUNK)), 2 * CHUNK)


def test_a_worker_holding_an_older_copy_fetches_only_the_chunks_it_lacks(workers):
    writer, writer_remote = workers()
    reader, _ = workers()
    write_turn(writer, writer_remote, "s", history(0, 50), 1)
    first = lookup_through_redis(reader, "s", [*history(0, 50), 7], session_version=1)
    assert first.source == "remote" and first.cached_tokens == 50
    assert reader.counters["remote_chunks_fetched"] == 3
    reader.put("s", first.entry, session_version=1)  # (its turn ends; the writer goes on with the next turns)
    write_turn(writer, writer_remote, "s", history(0, 130), 3)
    later = lookup_through_redis(reader, "s", [*history(0, 130), 7], session_version=3)
    assert later.source == "remote" and later.cached_tokens == 130
    assert reader.counters["remote_chunks_fetched"] == 3 + (130 // CHUNK - 3), "chunks 3 to 7 only"
    assert reader.counters["remote_bytes_not_fetched"] > 0
    assert same_tensors(later.entry, keyed_entry(history(0, 130)), 130)


def test_a_restored_policy_becomes_a_segment_and_the_next_session_fetches_none_of_its_chunks(workers):
    writer, writer_remote = workers()
    reader, _ = workers(min_shared_tokens=16)
    for session in range(2):
        write_turn(writer, writer_remote, f"s{session}", history(session, 80), 1)
    first = lookup_through_redis(reader, "s0", [*history(0, 80), 7], prefix_len=len(POLICY), session_version=1)
    assert first.source == "remote" and reader.counters["remote_policies_held"] == 1
    assert first.entry.prefix_tokens == 32, "the policy's whole units: a segment here now"
    fetched = reader.counters["remote_chunks_fetched"]
    second = lookup_through_redis(reader, "s1", [*history(1, 80), 7], prefix_len=len(POLICY), session_version=1)
    assert second.source == "remote" and second.entry.cache.prefix is first.entry.cache.prefix
    assert reader.counters["remote_chunks_fetched"] - fetched == 80 // CHUNK - 2
    assert same_tensors(second.entry, keyed_entry(history(1, 80)), 80)


def test_a_damaged_chunk_shared_by_several_sessions_ends_each_restore_at_the_chunk_before_it(workers):
    writer, writer_remote = workers()
    reader, reader_remote = workers()
    for session in range(3):
        write_turn(writer, writer_remote, f"s{session}", history(session, 64), 1)
    shared = chunk_key(chunk_names(history(0, 64))[1])
    blob = bytearray(reader_remote._redis.get(shared))
    blob[-5] ^= 0x01
    reader_remote._redis.set(shared, bytes(blob))
    lookups = []
    for session in range(3):
        lookups.append(lookup_through_redis(reader, f"s{session}", [*history(session, 64), 7], session_version=1))
        assert reader_remote.drain(10)  # (a damaged chunk's deletion is queued; the next fetch finds it gone)
    assert [(found.source, found.cached_tokens, found.cleared) for found in lookups] == [
        ("remote", CHUNK, ("checksum",)), ("remote", CHUNK, ()), ("remote", CHUNK, ())]
    assert reader.counters["corrupt_checksum"] == 1 and reader.counters["remote_chunks_missing"] == 2
    assert all(same_tensors(found.entry, keyed_entry(history(session, 64)), CHUNK)
               for session, found in enumerate(lookups))
    # The turn recomputes the rest; its write-back sends the chunk again (this worker never wrote it): healed.
    reader.put("s0", keyed_entry(history(0, 64)), session_version=2)
    assert reader_remote.wait_written("s0", 10)
    assert reader_remote._redis.get(shared) not in (None, bytes(blob))


def test_a_chunk_is_safetensors_bytes_and_a_frame_of_an_older_format_is_refused_cleanly(workers):
    """A chunk in Redis is what any safetensors reader opens (its name and checksum in the header's metadata); a
    chunk as format 6 wrote it (a JSON frame, then raw bytes) is unreadable, so not the chunk asked for (the
    fingerprint check), and the restore ends at the chunk before it."""
    writer, writer_remote = workers()
    reader, _ = workers()
    write_turn(writer, writer_remote, "s0", history(0, 64), 1)
    name = chunk_names(history(0, 64))[1]
    blob = writer_remote._redis.get(chunk_key(name))
    tensors = safetensors.torch.load(blob)
    assert set(tensors) == {"keys", "values"} and tensors["keys"].shape == (LAYERS, 1, HEADS, CHUNK, HEAD_DIM)
    (length,) = struct.unpack_from("<Q", blob)
    metadata = json.loads(blob[8:8 + length])["__metadata__"]
    assert (metadata["name"], metadata["format"]) == (name, str(FORMAT_VERSION)) and metadata["checksum"]
    layers = [tensor for pair in zip(tensors["keys"], tensors["values"], strict=True) for tensor in pair]
    frame = json.dumps({"name": name, "shapes": [list(t.shape) for t in layers], "dtype": "torch.float32",
                        "scale_shapes": [], "checksum": metadata["checksum"]}).encode()
    writer_remote._redis.set(chunk_key(name), struct.pack("<I", len(frame)) + frame + b"".join(
        tensor.numpy().tobytes() for tensor in layers))
    found = lookup_through_redis(reader, "s0", [*history(0, 64), 7], session_version=1)
    assert (found.source, found.cached_tokens, found.cleared) == ("remote", CHUNK, ("fingerprint",))
    assert same_tensors(found.entry, keyed_entry(history(0, 64)), CHUNK)


def test_a_chunk_gone_from_redis_is_sent_again_by_the_next_write(workers):
    writer, writer_remote = workers()
    write_turn(writer, writer_remote, "s", history(0, 64), 1)
    gone = chunk_key(chunk_names(history(0, 64))[2])
    writer_remote._redis.delete(gone)
    write_turn(writer, writer_remote, "s", history(0, 70), 2)  # renews the chunks: finds the third gone
    assert writer_remote.counters["chunks_lost"] == 1 and writer_remote._redis.get(gone) is None
    write_turn(writer, writer_remote, "s", history(0, 75), 3)  # no longer known held: carried and written
    assert writer_remote._redis.get(gone) is not None


def test_a_chunk_of_another_owners_chain_is_never_served(workers):
    writer, writer_remote = workers()
    reader, _ = workers()
    write_turn(writer, writer_remote, "a", history(0, 48), 1, scope="key-a")
    write_turn(writer, writer_remote, "b", history(0, 48), 1, scope="key-b")
    names_a, names_b = chunk_names(history(0, 48), "owner:key-a"), chunk_names(history(0, 48), "owner:key-b")
    assert not set(names_a) & set(names_b), "the same ids under two keys: two chains"
    client = writer_remote._redis
    client.set(chunk_key(names_b[0]), client.get(chunk_key(names_a[0])))
    found = lookup_through_redis(reader, "b", [*history(0, 48), 7], session_version=1, scope="key-b")
    assert (found.source, found.miss_reason, found.cleared) == ("miss", "corrupt", ("fingerprint",))
    assert reader.remote.drain(10) and client.get(chunk_key(names_b[0])) is None, \
        "deleted: the next write of that chain sends its own"


def test_an_int8_chunk_is_quantised_once_when_first_written(workers):
    writer, writer_remote = workers(remote_kv_dtype="int8")
    reader, reader_remote = workers(remote_kv_dtype="int8")
    write_turn(writer, writer_remote, "s", history(0, 50), 1)
    names = chunk_names(history(0, 50), kind="int8")
    written = [writer_remote._redis.get(chunk_key(name)) for name in names]
    found = lookup_through_redis(reader, "s", [*history(0, 50), 7], session_version=1)
    assert found.source == "remote" and found.quantized == "int8"
    grown = found.entry.clone(reader.new_cache)  # its next turn: the restored (dequantised) positions, then more
    more = keyed_entry(history(0, 90))
    for (keys, values), (new_keys, new_values) in zip(grown.tensors(), more.tensors(), strict=True):
        new_keys[..., :50, :], new_values[..., :50, :] = keys, values
    more.fingerprint = found.entry.fingerprint
    reader.put("s", more, session_version=2)
    assert reader_remote.wait_written("s", 10)
    assert [reader_remote._redis.get(chunk_key(name)) for name in names] == written, "never quantised again"
    assert reader_remote.counters["chunks_renewed"] == len(names)


def test_a_chunk_missing_right_after_the_held_policy_leaves_the_turn_the_policy(workers):
    writer, writer_remote = workers()
    reader, _ = workers(min_shared_tokens=16)
    for session in range(2):
        write_turn(writer, writer_remote, f"s{session}", history(session, 80), 1)
    # (it holds the policy now)
    lookup_through_redis(reader, "s0", [*history(0, 80), 7], prefix_len=len(POLICY), session_version=1)
    writer_remote._redis.delete(chunk_key(chunk_names(history(1, 80))[2]))  # the first after the policy's 32
    found = lookup_through_redis(reader, "s1", [*history(1, 80), 7], prefix_len=len(POLICY), session_version=1)
    assert (found.source, found.cached_tokens, found.cleared) == ("prefix", 32, ())
    assert reader.counters["remote_chunks_missing"] == 1


def test_a_late_write_of_an_older_turn_never_replaces_a_newer_copy(workers):
    """Two workers write the same session: the one whose write-back of an older turn reaches Redis last leaves the
    newer copy in place (its chunks may land; the session's own keys do not)."""
    newer, newer_remote = workers()
    older, older_remote = workers()
    write_turn(newer, newer_remote, "s", history(0, 90), 3)
    write_turn(older, older_remote, "s", history(0, 40), 1)
    assert older_remote.counters["snapshots_superseded"] == 1
    found = lookup_through_redis(workers()[0], "s", [*history(0, 90), 7], session_version=3)
    assert (found.source, found.cached_tokens) == ("remote", 90)


class LateReader(RemoteTier):
    """A Redis reader that read a session's header long ago and answers only once told to (`answer`): the header
    then returned is the one Redis held before (`stale`)."""

    stale: RemoteHeader | None = None
    answer = threading.Event()

    def head(self, session_id: str) -> RemoteHeader | None:
        assert self.answer.wait(10)
        return self.stale


def test_a_fetch_that_finishes_after_its_turn_gave_up_never_deletes_the_copy_written_since(workers):
    """A turn of version 2 asks Redis, which held version 1; its fetch reads that header but answers only after the
    turn stopped waiting, recomputed, and wrote version 3. The fetch then deletes the stale copy it read: only that
    one (and not the queued or written version 3), so that the next worker continues from version 3."""
    first, first_remote = workers()
    write_turn(first, first_remote, "s", history(0, 40), 1)
    LateReader.stale = first_remote.head("s")
    late, late_remote = workers(tier=LateReader)
    prompt = [*history(0, 70), 7]
    query = CacheQuery("s", prompt, session_version=2)
    fetch = late.start_fetch(late.remote_request(query), len(prompt))
    gave_up = late.lookup(query, fetch=fetch)  # (its patience ran out: it recomputes)
    assert gave_up.source == "miss" and gave_up.remote.choice == "timeout"
    entry = CacheEntry(late.new_cache(70), history(0, 70))
    entry.cache.load(keyed_entry(history(0, 70)).tensors())
    late.put("s", entry, session_version=3)
    LateReader.answer.set()
    fetch.job.result(timeout=10)
    assert late_remote.wait_written("s", 10) and late_remote.drain(10)
    assert first_remote.head("s").session_version == 3, "the copy written since is still there"
    found = lookup_through_redis(workers()[0], "s", [*history(0, 70), 7], session_version=3)
    assert (found.source, found.cached_tokens) == ("remote", 70)
