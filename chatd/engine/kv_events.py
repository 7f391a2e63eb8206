"""KV events in vLLM's wire format (`vllm/distributed/kv_events.py`), for KV-aware routers (NVIDIA Dynamo's KV
router, llm-d's endpoint picker): what this worker's device and host tiers hold, as `BlockLedger` states it.

Each batch is one message of three frames on a ZMQ PUB socket: the topic, its sequence number (8 bytes, big-endian,
from 0) and `[ts, events, data_parallel_rank]` in msgpack. The engine thread only queues a batch (bounded: when full,
the batch is dropped and counted, and the ledger sends `AllBlocksCleared` and its full state next); a thread of its
own encodes and sends it, keeps the last 10,000 for the replay socket (a ROUTER that answers `[b"", start_seq]` with
each buffered batch from that seq, then seq -1), and never touches the engine's state.

A salted scope's blocks carry its public name in `extra_keys` (the first block's, as vLLM's `cache_salt`) and as
`lora_name`: consumers rehash the token ids and, Dynamo among them, ignore `extra_keys` but key their trees by adapter,
so a salted conversation's blocks never match an unsalted prompt."""

from __future__ import annotations

import queue
import socket
import threading
import time
from collections import deque

import msgpack
import zmq

from cache_store.block_ledger import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

QUEUED_BATCHES = 4096  # batches waiting for the sender thread, at most (beyond: dropped, the full state sent next)
REPLAY_BATCHES = 10_000  # vLLM's buffer for the replay socket
END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)


def default_topic(model: str) -> str:
    """llm-d's topic: `kv@<pod>@<model>`."""
    return f"kv@{socket.gethostname()}@{model}"


def encode(event: KVEvent, block_size: int, as_map: bool) -> dict | list:
    """One event as vLLM encodes it: a map with its type, or (`as_map` False) a positional array."""
    if isinstance(event, BlockStored):
        extra = [[event.scope], *[None] * (len(event.block_ids) - 1)] if event.scope else None
        fields = {"block_hashes": event.block_ids, "parent_block_hash": event.parent, "token_ids": event.token_ids,
                  "block_size": block_size, "lora_id": None, "medium": event.medium, "lora_name": event.scope}
        if as_map:
            return {"type": "BlockStored", **fields, "extra_keys": extra}
        return ["BlockStored", *fields.values()]
    if isinstance(event, BlockRemoved):
        fields = {"block_hashes": event.block_ids, "medium": event.medium}
        return {"type": "BlockRemoved", **fields} if as_map else ["BlockRemoved", *fields.values()]
    assert isinstance(event, AllBlocksCleared)
    return {"type": "AllBlocksCleared"} if as_map else ["AllBlocksCleared"]


class KVEventPublisher:
    """The sender thread and its sockets. `send` is the engine thread's; everything else runs on the sender's."""

    def __init__(self, endpoint: str, topic: str, block_size: int, as_map: bool = True,
                 replay_endpoint: str | None = None, queued_batches: int = QUEUED_BATCHES):
        self.endpoint, self.replay_endpoint, self.topic = endpoint, replay_endpoint, topic.encode()
        self.block_size, self.as_map = block_size, as_map
        self.batches_sent = 0
        self.batches_dropped = 0  # batches the queue had no room for (the ledger then sends its full state)
        self._queue: queue.Queue[list[KVEvent] | None] = queue.Queue(maxsize=queued_batches)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=REPLAY_BATCHES)
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="chatd-kv-events", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise self._error

    def send(self, events: list[KVEvent]) -> bool:
        """Queue one batch (never waits); False when the queue is full (the batch is dropped, and counted)."""
        try:
            self._queue.put_nowait(events)
        except queue.Full:
            self.batches_dropped += 1
            return False
        return True

    def close(self) -> None:
        """Send what is queued and, since a stopped worker holds nothing, `AllBlocksCleared`; then close the sockets.
        (A worker that crashed cannot say so: its successor's `AllBlocksCleared` at start reaches only consumers
        already subscribed, so a router unregisters a worker it lost, as Dynamo's discovery does.)"""
        self._queue.put([AllBlocksCleared()])
        self._queue.put(None)
        self._thread.join(timeout=10)

    def _run(self) -> None:
        context = zmq.Context()
        try:
            publisher = context.socket(zmq.PUB)
            (publisher.bind if "*" in self.endpoint else publisher.connect)(self.endpoint)
            router = None
            if self.replay_endpoint is not None:
                router = context.socket(zmq.ROUTER)
                (router.bind if "*" in self.replay_endpoint else router.connect)(self.replay_endpoint)
        except zmq.ZMQError as error:
            self._error = error
            context.destroy(linger=0)
            self._ready.set()
            return
        self._ready.set()
        try:
            self._serve(publisher, router)
        finally:
            context.destroy(linger=1000)

    def _serve(self, publisher: zmq.Socket, router: zmq.Socket | None) -> None:
        seq = 0
        while True:
            try:  # (with a replay socket to answer, a look at it every 50 ms; else asleep until a batch comes)
                events = self._queue.get(timeout=0.05 if router is not None else None)
            except queue.Empty:
                events = []
            if events is None:
                return
            if events:
                payload = msgpack.packb([time.time(), [encode(e, self.block_size, self.as_map) for e in events], 0])
                publisher.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])
                self._buffer.append((seq, payload))
                seq += 1
                self.batches_sent += 1
            while router is not None and router.poll(0):
                self._replay(router)

    def _replay(self, router: zmq.Socket) -> None:
        """Answer one replay request: every buffered batch from its start seq, then the end marker."""
        frames = router.recv_multipart()
        identity, start = frames[0], int.from_bytes(frames[-1], "big") if len(frames[-1]) == 8 else 0
        for seq, payload in list(self._buffer):
            if seq >= start:
                router.send_multipart([identity, b"", seq.to_bytes(8, "big"), payload])
        router.send_multipart([identity, b"", END_OF_REPLAY, b""])
