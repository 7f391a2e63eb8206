"""One place that opens Redis for every store: a single server or a Redis Cluster (found by itself at start, or
forced), with redis-py's own clients (sync and asyncio), whose slot maps, redirections and retries a cluster
needs; one-line errors for a Redis that cannot be used, naming the setting to fix; a write acknowledged once
replicas hold it (`WAIT`); and the counts of what the clients met, for /metrics."""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

import redis
import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster
from redis.cluster import RedisCluster
from redis.event import AsyncAfterSlotsCacheRefreshEvent, AsyncEventListenerInterface, EventDispatcher

from sessions.encoding import UNREACHABLE

log = logging.getLogger(__name__)


class RedisSetupError(RuntimeError):
    """Redis cannot be used as `--redis-url` says: the message is one line naming Redis and the setting."""


@dataclass(frozen=True)
class RedisTopology:
    """What `--redis-url` leads to, as its node said at start."""

    cluster: bool
    replicas: int  # the fewest replicas a primary holding slots has (a single server: its replicas); 0 if none


def topology(url: str, forced: bool | None = None, timeout_s: float = 2.0) -> RedisTopology:
    """Whether `url` is a node of a Redis Cluster (asked of the node; `forced` says what it must be), and how many
    replicas each primary has; a cluster must be ready, and database 0 is its only database. A Redis that cannot be
    reached is taken for a single server without replicas (its sessions wait out the outage), unless a cluster is
    `forced`."""
    try:
        node = urlparse(url)._replace(path="/0").geturl()  # (a cluster node refuses any other database)
        with redis.Redis.from_url(node, socket_timeout=timeout_s, socket_connect_timeout=timeout_s) as client:
            info = client.info("cluster")
            enabled = bool(info.get("cluster_enabled"))
            if forced is not None and forced != enabled:
                raise RedisSetupError(f"Redis at {_where(url)} is {'' if enabled else 'not '}a cluster node, but "
                                      f"--redis-cluster is {'on' if forced else 'off'} (CHATD_REDIS_CLUSTER)")
            state = client.execute_command("CLUSTER INFO").get("cluster_state") if enabled else None
            replicas = (_fewest_replicas(client) if enabled
                        else int(client.info("replication").get("connected_slaves", 0)))
    except UNREACHABLE as error:  # (a worker may start before Redis: its sessions wait out the outage)
        if forced:
            raise RedisSetupError(f"the Redis Cluster at {_where(url)} cannot be reached ({error}); check "
                                  "--redis-url (CHATD_REDIS_URL) and that the cluster is running") from None
        log.warning("Redis at %s cannot be reached (%s): starting as with a single Redis server, whose sessions "
                    "wait out the outage; check --redis-url (CHATD_REDIS_URL)", _where(url), error)
        return RedisTopology(cluster=False, replicas=0)
    except redis.ResponseError as error:
        raise RedisSetupError(f"Redis at {_where(url)} refused chatd ({error}); check --redis-url "
                              "(CHATD_REDIS_URL): its password and database") from None
    if enabled:
        if state not in ("ok", b"ok"):
            raise RedisSetupError(f"the Redis Cluster at {_where(url)} is not ready (cluster_state is not ok): "
                                  "wait for it, or check its slots (redis-cli --cluster check)")
        if _database(url) != 0:
            raise RedisSetupError(f"--redis-url {url} names database {_database(url)}, but a Redis Cluster has "
                                  "only database 0: use /0 (CHATD_REDIS_URL)")
    return RedisTopology(cluster=enabled, replicas=replicas)


def _fewest_replicas(client: redis.Redis) -> int:
    """The fewest replicas any primary holding slots has, as each primary says (`INFO replication`: the nodes'
    gossip about replicas lags their start by seconds)."""
    nodes = client.execute_command("CLUSTER NODES")
    counts = []
    for address, node in nodes.items():
        if "master" in node["flags"] and node["slots"]:
            host, port = address.rsplit(":", 1)
            pool = client.connection_pool
            primary = redis.ConnectionPool(connection_class=pool.connection_class, **pool.connection_kwargs
                                           | {"host": host, "port": int(port.split("@")[0])})
            try:
                counts.append(int(redis.Redis(connection_pool=primary).info("replication").get("connected_slaves", 0)))
            finally:
                primary.disconnect()
    return min(counts, default=0)


class RedisEvents:
    """What this worker's Redis clients met, for /metrics: calls that failed by error, writes retried through an
    outage or a failover, changes of a cluster client's slot map (after a MOVED or ASK redirection, or a
    failover), and the `WAIT`s after completed turns by outcome. Thread-safe."""

    def __init__(self, on_wait: Callable[[float, str], None] = lambda seconds, outcome: None):
        self.errors: Counter[str] = Counter()  # by exception class
        self.retries = 0
        self.slot_map_changes = 0
        self.waits: Counter[str] = Counter()  # acked | short | failed
        self._on_wait = on_wait
        self._lock = threading.Lock()

    def error(self, error: BaseException) -> None:
        with self._lock:
            self.errors[type(error).__name__] += 1

    def retry(self) -> None:
        with self._lock:
            self.retries += 1

    def slot_map_changed(self) -> None:
        with self._lock:
            self.slot_map_changes += 1

    def waited(self, seconds: float, outcome: str) -> None:
        with self._lock:
            self.waits[outcome] += 1
        self._on_wait(seconds, outcome)

    def snapshot(self) -> dict:
        with self._lock:
            return {"errors": dict(self.errors), "retries": self.retries, "slot_map_changes": self.slot_map_changes,
                    "waits": dict(self.waits)}


class _SlotMapListener(AsyncEventListenerInterface):
    def __init__(self, events: RedisEvents):
        self.events = events

    async def listen(self, event: object) -> None:
        self.events.slot_map_changed()


def sync_client(url: str, cluster: bool, **options: Any) -> redis.Redis | RedisCluster:
    """A pooled sync client: a cluster client (every node found from this one) or a plain one."""
    if cluster:
        return RedisCluster.from_url(url, **_cluster_options(options))
    return redis.Redis.from_url(url, **options)


def async_client(url: str, cluster: bool, events: RedisEvents | None = None,
                 **options: Any) -> aioredis.Redis | AsyncRedisCluster:
    """A pooled asyncio client: a cluster client (every node found from this one; its slot-map changes counted in
    `events`) or a plain one."""
    if cluster:
        dispatcher = EventDispatcher()
        if events is not None:
            dispatcher.register_listeners({AsyncAfterSlotsCacheRefreshEvent: [_SlotMapListener(events)]})
        return AsyncRedisCluster.from_url(url, event_dispatcher=dispatcher, **_cluster_options(options))
    return aioredis.Redis.from_url(url, **options)


async def write_and_wait(client: aioredis.Redis | AsyncRedisCluster, key: str, command: tuple, replicas: int,
                         timeout_ms: int, events: RedisEvents) -> Any:
    """Run one write `command` (its keys in `key`'s slot) and, with `replicas`, `WAIT` on the same connection (the
    node counts only that connection's writes) until that many replicas hold it or `timeout_ms` passes: one round
    trip. A short `WAIT` is counted and logged, not raised: the write is on the primary and reaches its replicas
    when they catch up. Raises what the write raised."""
    if replicas <= 0:
        return await client.execute_command(*command)
    started = time.perf_counter()
    node = None
    if isinstance(client, AsyncRedisCluster):
        await client.initialize()  # (at once unless the slot map is missing, or a refresh is due after an error)
        node = client.get_node_from_key(key)
    reply, acked = await _then_wait(client, node, command, replicas, timeout_ms)
    if isinstance(reply, Exception):
        raise reply
    if isinstance(acked, Exception) or (node is not None and client.get_node_from_key(key).name != node.name):
        # The write was redirected (a failover, a moved slot) and the WAIT went elsewhere: a write to the key's slot
        # on its node now orders after ours there, and a WAIT after it covers both.
        if isinstance(acked, Exception):
            events.error(acked)
        node = client.get_node_from_key(key) if node is not None else None
        _, acked = await _then_wait(client, node, ("SET", _marker(key), "1", "PX", 60_000), replicas, timeout_ms)
    outcome = "failed" if isinstance(acked, Exception) else "acked" if acked >= replicas else "short"
    events.waited(time.perf_counter() - started, outcome)
    if outcome != "acked":
        log.warning("Redis WAIT for %d replica(s) of %s: %s (the write is on its primary)", replicas, key,
                    acked if outcome == "failed" else f"{acked} within {timeout_ms} ms")
    return reply


def _marker(key: str) -> str:
    """A key in `key`'s slot (same hash tag), written only to order a `WAIT` after a redirected write."""
    tag = key[key.index("{"):key.index("}") + 1] if "{" in key else key
    return f"chatd:wait:{tag}"


async def _then_wait(client, node, command: tuple, replicas: int, timeout_ms: int) -> list:
    """`command` then `WAIT`, pipelined on one connection (to `node`, on a cluster): their replies or errors."""
    pipe = client.pipeline(transaction=False)
    pipe.execute_command(*command)
    if node is None:
        pipe.execute_command("WAIT", replicas, timeout_ms)
    else:
        pipe.execute_command("WAIT", replicas, timeout_ms, target_nodes=node)
    return await pipe.execute(raise_on_error=False)


def _cluster_options(options: dict[str, Any]) -> dict[str, Any]:
    """A plain client's options as a cluster client takes them (its pool is per node)."""
    return {key: value for key, value in options.items()
            if key not in ("max_connections", "health_check_interval", "retry_on_error")}


def _database(url: str) -> int:
    path = urlparse(url).path.strip("/")
    return int(path) if path.isdigit() else 0


def _where(url: str) -> str:
    parsed = urlparse(url)
    return f"{parsed.hostname or 'localhost'}:{parsed.port or 6379}"
