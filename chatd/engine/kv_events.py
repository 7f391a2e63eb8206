"""KV events in vLLM's wire format (`vllm/distributed/kv_events.py`), for KV-aware routers (NVIDIA Dynamo's KV
router, llm-d's endpoint picker): what this worker's device and host tiers hold, as `BlockLedger` states it.

Each batch is one message of three frames on a ZMQ PUB socket: the topic, its sequence number (8 bytes, big-endian,
from 0) and `[ts, events, data_parallel_rank]` in msgpack. The engine thread only queues a batch (bounded: when full,
the batch is dropped and counted, and the ledger sends `AllBlocksCleared` and its full state next); a thread of its
own encodes and sends it, keeps the last 10,000 for the replay socket (a ROUTER that answers `[b"", start_seq]` with
each buffered batch from that seq, then seq -1), and never touches the engine's state.

A key's (or a salt's) blocks carry its scope's public name in `extra_keys` (a sequence's first block's, as vLLM's
`cache_salt`) and as `lora_name`: consumers rehash the token ids and, Dynamo among them, ignore `extra_keys` but key
their trees by adapter, so one key's conversation never matches another key's prompt. The events carry every
conversation's token ids: a * endpoint binds on loopback unless `--kv-events-bind-all`."""

from __future__ import annotations

import logging
import queue
import socket
import threading
import time
from collections import deque

import msgpack
import zmq

from cache_store.block_ledger import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

QUEUED_BATCHES = 4096  # batches waiting for the sender thread, at most (beyond: dropped, the full state sent next)
QUEUED_BYTES = 64 << 20  # and their size, at most (a batch of a 100K-token prompt holds 100K token ids)
REPLAY_BATCHES = 10_000  # vLLM's buffer for the replay socket
REPLAY_BYTES = 256 << 20  # and its size, at most (the oldest batches leave first)
RESTART_S = 1.0  # a sender that failed starts again after this
END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
log = logging.getLogger(__name__)


def default_topic(model: str) -> str:
    """llm-d's topic: `kv@<pod>@<model>`."""
    return f"kv@{socket.gethostname()}@{model}"


def batch_bytes(events: list[KVEvent]) -> int:
    """About what a batch weighs in memory and on the wire: its token ids and block ids (8 bytes each), and a little
    for each event."""
    return sum(64 + 8 * (len(event.block_ids) + len(getattr(event, "token_ids", ())))
               for event in events if not isinstance(event, AllBlocksCleared)) + 64


def encode(event: KVEvent, block_size: int, as_map: bool) -> dict | list:
    """One event as vLLM encodes it: a map with its type, or (`as_map` False) a positional array."""
    if isinstance(event, BlockStored):
        # (as vLLM's `cache_salt`: on a sequence's first block only, not on the first of a run that continues one)
        extra = [[event.scope], *[None] * (len(event.block_ids) - 1)] if event.scope and event.parent is None else None
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
                 replay_endpoint: str | None = None, queued_batches: int = QUEUED_BATCHES, bind_all: bool = False,
                 queued_bytes: int = QUEUED_BYTES, replay_bytes: int = REPLAY_BYTES):
        self.endpoint, self.replay_endpoint, self.topic = endpoint, replay_endpoint, topic.encode()
        self.bind_all = bind_all  # a * endpoint on every interface (else on loopback: the events hold every prompt)
        self.block_size, self.as_map = block_size, as_map
        self.batches_sent = 0
        self.batches_dropped = 0  # batches the queue had no room for (the ledger then sends its full state)
        self.sender_failures = 0  # times the sender thread failed and was started again
        self._queue: queue.Queue[tuple[list[KVEvent], int] | None] = queue.Queue(maxsize=queued_batches)
        self._queued_bytes, self._queued_limit, self._lock = 0, queued_bytes, threading.Lock()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=REPLAY_BATCHES)
        self._buffered_bytes, self._replay_limit = 0, replay_bytes
        self._seq = 0
        self._resync = False  # the sender failed: the next batch is refused, so that the ledger sends its full state
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._supervise, name="chatd-kv-events", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise self._error

    def send(self, events: list[KVEvent]) -> bool:
        """Queue one batch (never waits); False when the queue is full, in batches or bytes (the batch is dropped, and
        counted)."""
        size = batch_bytes(events)
        with self._lock:
            if self._resync or self._queued_bytes + size > self._queued_limit and self._queued_bytes:
                self._resync = False  # (after a failed sender: what it was sending is lost, the full state next)
                self.batches_dropped += 1
                return False
            try:
                self._queue.put_nowait((events, size))
            except queue.Full:
                self.batches_dropped += 1
                return False
            self._queued_bytes += size
        return True

    def close(self) -> None:
        """Send what is queued and, since a stopped worker holds nothing, `AllBlocksCleared`; then close the sockets,
        within 10 s even if the sender cannot go on. (A worker that crashed cannot say so: its successor's
        `AllBlocksCleared` at start reaches only consumers already subscribed, so a router unregisters a worker it
        lost, as Dynamo's discovery does.)"""
        deadline = time.monotonic() + 10
        for last in (([AllBlocksCleared()], 0), None):
            try:
                self._queue.put(last, timeout=max(0.0, deadline - time.monotonic()))
            except queue.Full:
                break
        self._thread.join(timeout=max(0.0, deadline - time.monotonic()))

    def _supervise(self) -> None:
        """The sender, started again after a failure (logged and counted): a dead sender would leave the ledger's
        batches to pile up and the full state rebuilt at every step."""
        while not self._run():
            self.sender_failures += 1
            with self._lock:
                self._resync = True
            time.sleep(RESTART_S)

    def _run(self) -> bool:
        """Open the sockets and send until `close`: True; False when sending failed (the sockets are closed)."""
        context = zmq.Context()
        try:
            publisher = context.socket(zmq.PUB)
            self._open(publisher, self.endpoint)
            router = None
            if self.replay_endpoint is not None:
                router = context.socket(zmq.ROUTER)
                self._open(router, self.replay_endpoint)
        except zmq.ZMQError as error:
            context.destroy(linger=0)
            if not self._ready.is_set():  # (at start: the worker does not start with a bad endpoint)
                self._error = error
                self._ready.set()
                return True
            log.exception("KV events: the sockets could not be opened again")
            return False
        self._ready.set()
        try:
            self._serve(publisher, router)
            return True
        except Exception:
            log.exception("KV events: the sender failed; it starts again (the next batch carries the full state)")
            return False
        finally:
            context.destroy(linger=1000)

    def _open(self, sock: zmq.Socket, endpoint: str) -> None:
        """Bind an endpoint with a * (its host: loopback unless `bind_all`; a * port: a free one), connect another."""
        if "*" not in endpoint:
            sock.connect(endpoint)
        elif endpoint.startswith("tcp://*:") and not self.bind_all:
            sock.bind(endpoint.replace("tcp://*:", "tcp://127.0.0.1:", 1))
        else:
            sock.bind(endpoint)

    def _serve(self, publisher: zmq.Socket, router: zmq.Socket | None) -> None:
        while True:
            try:  # (with a replay socket to answer, a look at it every 50 ms; else asleep until a batch comes)
                queued = self._queue.get(timeout=0.05 if router is not None else None)
            except queue.Empty:
                queued = ([], 0)
            if queued is None:
                return
            events, size = queued
            if events:
                with self._lock:
                    self._queued_bytes -= size  # (as `send` counted it)
                payload = msgpack.packb([time.time(), [encode(e, self.block_size, self.as_map) for e in events], 0])
                publisher.send_multipart([self.topic, self._seq.to_bytes(8, "big"), payload])
                self._keep(self._seq, payload)
                self._seq += 1
                self.batches_sent += 1
            while router is not None and router.poll(0):
                self._replay(router)

    def _keep(self, seq: int, payload: bytes) -> None:
        """A sent batch into the replay buffer, the oldest leaving while it holds more than its limit in bytes."""
        if len(self._buffer) == self._buffer.maxlen:
            self._buffered_bytes -= len(self._buffer[0][1])
        self._buffer.append((seq, payload))
        self._buffered_bytes += len(payload)
        while self._buffered_bytes > self._replay_limit and len(self._buffer) > 1:
            self._buffered_bytes -= len(self._buffer.popleft()[1])

    def _replay(self, router: zmq.Socket) -> None:
        """Answer one replay request: every buffered batch from its start seq, then the end marker."""
        frames = router.recv_multipart()
        identity, start = frames[0], int.from_bytes(frames[-1], "big") if len(frames[-1]) == 8 else 0
        for seq, payload in list(self._buffer):
            if seq >= start:
                router.send_multipart([identity, b"", seq.to_bytes(8, "big"), payload])
        router.send_multipart([identity, b"", END_OF_REPLAY, b""])
