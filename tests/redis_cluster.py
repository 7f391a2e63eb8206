"""A real Redis Cluster for the tests: six redis-server processes (three primaries, three replicas) on free
ports, joined by `redis-cli --cluster create`, in a folder of their own."""

from __future__ import annotations

import random
import shutil
import socket
import subprocess
import time
from pathlib import Path

import redis

NODES = 6
BUS_OFFSET = 10_000  # a node's cluster bus listens on its port plus this


class RedisClusterNodes:
    def __init__(self, folder: Path, nodes: int = NODES):
        self.folder = folder
        self.ports = [_node_port() for _ in range(nodes)]
        self.processes: list[subprocess.Popen] = []

    @property
    def url(self) -> str:
        """Any node's URL: a cluster client finds the rest."""
        return f"redis://127.0.0.1:{self.ports[0]}/0"

    def start(self, join: bool = True) -> None:
        """Start the nodes and, with `join`, assign the slots (a cluster that is not joined is not ready); nothing is
        left running when it fails."""
        try:
            self._start(join)
        except BaseException:
            self.stop()
            raise

    def _start(self, join: bool) -> None:
        binary = shutil.which("redis-server")
        assert binary, "redis-server is not installed"
        for port in self.ports:
            folder = self.folder / str(port)
            folder.mkdir(parents=True, exist_ok=True)
            self.processes.append(subprocess.Popen(
                [binary, "--port", str(port), "--bind", "127.0.0.1", "--cluster-enabled", "yes",
                 "--cluster-config-file", str(folder / "nodes.conf"), "--dir", str(folder), "--save", "",
                 "--appendonly", "no", "--protected-mode", "no", "--cluster-node-timeout", "2000"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        for port in self.ports:
            self._wait(lambda port=port: _node(port).ping())
        if join:
            subprocess.run(["redis-cli", "--cluster", "create", *(f"127.0.0.1:{port}" for port in self.ports),
                            "--cluster-replicas", "1", "--cluster-yes"], check=True, capture_output=True, timeout=60)
            self._wait(lambda: all(_node(port).execute_command("CLUSTER INFO")["cluster_state"] == "ok"
                                   for port in self.ports))

    def primaries(self) -> list[int]:
        """The ports of the primaries."""
        return [port for port in self.ports if _node(port).info("replication")["role"] == "master"]

    def stop(self) -> None:
        for process in self.processes:
            process.terminate()
        for process in self.processes:
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
        self.processes = []

    @staticmethod
    def _wait(ready, timeout_s: float = 20.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if ready():
                    return
            except (redis.ConnectionError, redis.TimeoutError, OSError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("the Redis Cluster did not come up")
            time.sleep(0.05)


def _node(port: int) -> redis.Redis:
    return redis.Redis(host="127.0.0.1", port=port, socket_timeout=0.5)


def _node_port() -> int:
    """A free port whose cluster bus port is free too (and below 65536)."""
    while True:
        port = random.randrange(20_000, 50_000)
        try:
            for candidate in (port, port + BUS_OFFSET):
                with socket.socket() as probe:
                    probe.bind(("127.0.0.1", candidate))
        except OSError:
            continue
        return port
