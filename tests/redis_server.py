"""A real redis-server for the tests, on a free port, that they can stop and start again.
It persists to an append-only file in its own folder, so a restart keeps what was written.
Tests that leave the server running share one and each gets a database of its own."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import redis

from chatd.cli.server_process import free_port

DATABASES = 4096  # one per test that shares the server: a test's keys are never another's


class RedisServer:
    def __init__(self, folder: Path, *options: str):
        """`options`: more redis-server arguments (`--replicaof host port` for a replica)."""
        self.folder, self.options = folder, options
        self.port = free_port()
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        binary = shutil.which("redis-server")
        assert binary, "redis-server is not installed"
        self.process = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.folder),
             "--save", "", "--appendonly", "yes", "--appendfsync", "always", "--protected-mode", "no",
             "--databases", str(DATABASES), "--repl-diskless-sync-delay", "0", *self.options],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as connection:
                    connection.sendall(b"PING\r\n")
                    if connection.recv(64).startswith(b"+PONG"):
                        return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"redis-server did not start on port {self.port}")

    def wait_replicated(self, timeout_s: float = 20.0) -> None:
        """Until a replica of this server has synced with it and acknowledges writes (a replica still loading what
        it was sent answers a first WAIT late)."""
        deadline = time.monotonic() + timeout_s
        client = redis.Redis(port=self.port)
        while True:
            info = client.info("replication")
            if info["connected_slaves"] and info["slave0"]["state"] == "online":
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"no replica of the redis-server on port {self.port} synced")
            time.sleep(0.05)
        client.set("chatd-test:replicated", 1)
        if client.wait(1, int(timeout_s * 1000)) < 1:
            raise RuntimeError(f"the replica of the redis-server on port {self.port} acknowledges no write")
        client.delete("chatd-test:replicated")
        client.close()

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(10)
            self.process = None


@dataclass(frozen=True)
class RedisDatabase:
    """One numbered database of a shared redis-server: a test's own keyspace without a process of its
    own (pub/sub and server settings are shared, so tests that change them, stop or freeze Redis start
    their own `RedisServer`)."""

    server: RedisServer
    number: int

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.server.port}/{self.number}"
