"""The KV event sender on its own: its replay buffer bounded in bytes, and a sender that fails logged, counted and
started again, its next batch the ledger's full state."""

from __future__ import annotations

import time

import msgpack
import zmq

import chatd.engine.kv_events as kv_events
from cache_store.block_ledger import BlockStored
from chatd.cli.server_process import free_port
from chatd.engine.kv_events import KVEventPublisher, batch_bytes


def stored(tokens: int, first_block: int = 1) -> list[BlockStored]:
    return [BlockStored("GPU", list(range(first_block, first_block + tokens // 16)), None, list(range(tokens)), None)]


def replayed(port: int, start: int) -> list[int]:
    """The seqs the replay socket answers from `start` on."""
    socket = zmq.Context.instance().socket(zmq.DEALER)
    socket.connect(f"tcp://127.0.0.1:{port}")
    socket.send_multipart([b"", start.to_bytes(8, "big")])
    seqs = []
    while True:
        assert socket.poll(5000), "the replay socket did not answer"
        frames = socket.recv_multipart()
        seq = int.from_bytes(frames[-2], "big", signed=True)
        if seq == -1:
            socket.close(linger=0)
            return seqs
        seqs.append(seq)


def test_the_replay_buffer_keeps_the_newest_batches_within_its_bytes():
    """Batches of 2,048 token ids each (about 16 KB): a replay buffer of 100 KB keeps the newest few, not 10,000 of
    them, however large they are."""
    replay = free_port()
    publisher = KVEventPublisher("tcp://127.0.0.1:*", "kv@test", 16, replay_endpoint=f"tcp://*:{replay}",
                                 replay_bytes=100_000)
    try:
        for index in range(40):
            assert publisher.send(stored(2048, first_block=1000 * index))
        for _ in range(200):
            if publisher.batches_sent == 40:
                break
            time.sleep(0.01)
        seqs = replayed(replay, 0)
        assert seqs and seqs[-1] == 39 and seqs[0] > 0, seqs
        assert publisher._buffered_bytes <= 100_000 < batch_bytes(stored(2048)) * 40
    finally:
        publisher.close()


def test_a_failed_sender_is_started_again_and_its_next_batch_is_the_full_state(monkeypatch, caplog):
    """One batch cannot be encoded (the sender thread raises): it is logged and counted, the sender starts again on
    the same endpoint, the next batch is refused (so that the ledger sends everything it holds), and the batches
    after it reach a subscriber with their sequence numbers going on."""
    port = free_port()
    monkeypatch.setattr(kv_events, "RESTART_S", 0.05)
    publisher = KVEventPublisher(f"tcp://*:{port}", "kv@test", 16)
    subscriber = zmq.Context.instance().socket(zmq.SUB)
    subscriber.connect(f"tcp://127.0.0.1:{port}")
    subscriber.setsockopt(zmq.SUBSCRIBE, b"")
    real = msgpack.packb
    calls = {"n": 0}

    def failing_once(value, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("cannot encode")
        return real(value, *args, **kwargs)

    monkeypatch.setattr(kv_events.msgpack, "packb", failing_once)
    try:
        assert publisher.send(stored(32))
        for _ in range(200):
            if publisher.sender_failures:
                break
            time.sleep(0.01)
        assert publisher.sender_failures == 1 and "the sender failed" in caplog.text
        assert not publisher.send(stored(32)), "refused once: the ledger sends its full state next"
        time.sleep(0.3)  # (the subscriber joins the restarted publisher)
        received = []
        for _ in range(50):
            publisher.send(stored(32))
            if subscriber.poll(100):
                received.append(subscriber.recv_multipart())
                break
        assert received and received[0][0] == b"kv@test"
    finally:
        subscriber.close(linger=0)
        publisher.close()
