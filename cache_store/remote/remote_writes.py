"""One snapshot written to Redis: the chunks Redis lacks that the snapshot carries, renewals of those it holds, then
the session's token ids and tail, then its header (so that a reader that finds a header finds its bytes)."""

from __future__ import annotations

from collections import Counter

from redis import Redis
from redis.cluster import RedisCluster

from cache_store.remote.remote_format import (
    WRITE_SESSION,
    RemoteSnapshot,
    chunk_key,
    encode_chunk,
    session_bytes,
    split,
)
from sessions.encoding import redis_key


def write_snapshot(redis: Redis | RedisCluster, session_id: str, snapshot: RemoteSnapshot, ahead: bool,
                   chunk_tokens: int, ttl_s: int) -> tuple[int, list[str], Counter[str]]:
    """Write `snapshot`: the bytes sent, the chunks found gone from Redis that it does not carry (the next snapshot
    will), and what it wrote, renewed and did not send. A session's later turn, whose carried chunks all come after
    those its last written snapshot named (`ahead`: its new positions), is written in one round trip that renews the
    others as it goes; otherwise (a first write: its system prompt's chunks may be another session's or worker's) one
    round trip asks Redis which it holds, and a second sends only the others."""
    in_redis = None if ahead else _renew_known(redis, snapshot.chunks, ttl_s)
    pieces = split(snapshot, chunk_tokens)
    tail = pieces.pop()
    write = redis.pipeline(transaction=False)
    renewing = snapshot.chunks[:snapshot.start] if ahead else []
    for name in renewing:  # (their answers come first: whether Redis still held each)
        write.expire(chunk_key(name), ttl_s)
    sent, lost, chunk_nbytes, counts = 0, [], 0, Counter()
    for index, name in enumerate(snapshot.chunks):
        piece = pieces[index - snapshot.start] if index >= snapshot.start else None
        blob = encode_chunk(name, piece) if piece is not None else None
        chunk_nbytes = len(blob) if blob is not None else chunk_nbytes
        if in_redis is not None and in_redis[index]:
            counts["chunks_renewed"] += 1
            if blob is not None:
                counts["chunk_bytes_not_sent"] += len(blob)  # another session or worker wrote it
        elif blob is not None:
            write.set(chunk_key(name), blob, ex=ttl_s)
            sent += len(blob)
            counts["chunks_written"] += 1
        elif in_redis is not None:
            lost.append(name)  # gone from Redis, and this snapshot does not carry it: the next one will
    blob, meta = session_bytes(snapshot, tail, chunk_tokens, chunk_nbytes)
    write.execute_command("EVAL", WRITE_SESSION, 2, redis_key(session_id, "kv"), redis_key(session_id, "kvmeta"),
                          snapshot.session_version, blob, meta, ttl_s)  # (a cluster's pipeline too)
    *answers, newest = write.execute()
    renewed = answers[:len(renewing)]
    counts["snapshots_superseded"] += not newest
    counts["chunks_renewed"] += sum(map(bool, renewed))
    lost += [name for name, found in zip(renewing, renewed, strict=True) if not found]
    counts["chunk_bytes_written"] += sent
    return sent + len(blob), lost, counts


def _renew_known(redis: Redis | RedisCluster, chunks: list[str], ttl_s: int) -> list[bool]:
    """Which of `chunks` Redis holds, each renewed (one round trip)."""
    renew = redis.pipeline(transaction=False)
    for name in chunks:
        renew.expire(chunk_key(name), ttl_s)
    return [bool(found) for found in renew.execute()]
