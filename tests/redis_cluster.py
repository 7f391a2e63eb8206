"""A real Redis Cluster for the tests: six redis-server processes (three primaries, three replicas) on free
ports, joined by `redis-cli --cluster create`, in a folder of their own; ready once every replica has synced
and every node sees the replicas (so that a primary killed by a test fails over to its replica)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import redis

from chatd.cli.server_process import free_port
from sessions.redis_client import RedisSetupError

NODES = 6
BUS_OFFSET = 10_000  # a node's cluster bus listens on its port plus this


class RedisClusterNodes:
    def __init__(self, folder: Path, nodes: int = NODES):
        self.folder = folder
        self.ports = [free_port(BUS_OFFSET) for _ in range(nodes)]
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
                 "--appendonly", "no", "--protected-mode", "no", "--cluster-node-timeout", "1500",
                 "--repl-diskless-sync-delay", "0", "--repl-ping-replica-period", "1",
                 "--logfile", str(folder / "redis.log")],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        for port, process in zip(self.ports, self.processes, strict=True):
            self._wait(lambda port=port, process=process: _answers(port, process))
        if join:
            subprocess.run(["redis-cli", "--cluster", "create", *(f"127.0.0.1:{port}" for port in self.ports),
                            "--cluster-replicas", "1", "--cluster-yes"], check=True, capture_output=True, timeout=60)
            self._wait(lambda: all(_node(port).execute_command("CLUSTER INFO")["cluster_state"] == "ok"
                                   for port in self.ports))
            self._wait(self._replicated)

    def _replicated(self) -> bool:
        """Every primary's replica has synced, and every node's slot map names it."""
        primaries = [_node(port).info("replication") for port in self.primaries()]
        synced = all(info["connected_slaves"] >= 1 and info["slave0"]["state"] == "online" for info in primaries)
        return synced and all(len(slots) > 3 for port in self.ports
                              for slots in _node(port).execute_command("CLUSTER SLOTS"))

    def kill(self, port: int) -> None:
        """SIGKILL one node (no chance to hand anything over): its replica takes over once the others see it fail."""
        process = self.processes[self.ports.index(port)]
        os.kill(process.pid, signal.SIGKILL)
        process.wait(10)

    def wait_failed_over(self, port: int, timeout_s: float = 30.0) -> None:
        """Until a replica of the killed node `port` is a primary and the cluster is ok again."""
        alive = [other for other in self.ports if other != port]
        self._wait(lambda: len([p for p in alive if _node(p).info("replication")["role"] == "master"]) == 3
                   and all(_node(p).execute_command("CLUSTER INFO")["cluster_state"] == "ok" for p in alive),
                   timeout_s)

    def primaries(self) -> list[int]:
        """The ports of the primaries (of the nodes still running)."""
        return [port for port, process in zip(self.ports, self.processes, strict=True)
                if process.poll() is None and _node(port).info("replication")["role"] == "master"]

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
        """Until `ready()` is true; a node that refuses, cannot answer yet (loading, cluster down) or is not ready for
        chatd (`RedisSetupError`) is waited for like one that says no."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if ready():
                    return
            except (redis.ConnectionError, redis.TimeoutError, redis.ResponseError, RedisSetupError, OSError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("the Redis Cluster did not come up")
            time.sleep(0.05)


def _node(port: int) -> redis.Redis:
    return redis.Redis(host="127.0.0.1", port=port, socket_timeout=0.5)


def _answers(port: int, process: subprocess.Popen) -> bool:
    """Whether the node on `port` answers; one that exited says why (its log's last lines) instead of being waited
    for."""
    if process.poll() is not None:
        log = Path(process.args[process.args.index("--logfile") + 1])
        tail = log.read_text(errors="replace").splitlines()[-5:] if log.exists() else []
        raise RuntimeError(f"redis-server on port {port} exited ({process.returncode}): " + " | ".join(tail))
    return _node(port).ping()
