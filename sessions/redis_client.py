"""One place that opens Redis for every store: a single server or a Redis Cluster (found by itself at start, or
forced), with redis-py's own clients (sync and asyncio), whose slot maps, redirections and retries a cluster
needs; and one-line errors for a Redis that cannot be used, naming the setting to fix."""

from __future__ import annotations

import logging
from typing import Any
from urllib.parse import urlparse

import redis
import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster
from redis.cluster import RedisCluster

from sessions.encoding import UNREACHABLE

log = logging.getLogger(__name__)


class RedisSetupError(RuntimeError):
    """Redis cannot be used as `--redis-url` says: the message is one line naming Redis and the setting."""


def cluster_mode(url: str, forced: bool | None = None, timeout_s: float = 2.0) -> bool:
    """Whether `url` is a node of a Redis Cluster (asked of the node; `forced` says what it must be); a cluster must
    be ready, and database 0 is its only database. A Redis that cannot be reached is taken for a single server
    (its sessions wait out the outage), unless a cluster is `forced`."""
    try:
        node = urlparse(url)._replace(path="/0").geturl()  # (a cluster node refuses any other database)
        with redis.Redis.from_url(node, socket_timeout=timeout_s, socket_connect_timeout=timeout_s) as client:
            info = client.info("cluster")
            enabled = bool(info.get("cluster_enabled"))
            if forced is not None and forced != enabled:
                raise RedisSetupError(f"Redis at {_where(url)} is {'' if enabled else 'not '}a cluster node, but "
                                      f"--redis-cluster is {'on' if forced else 'off'} (CHATD_REDIS_CLUSTER)")
            state = client.execute_command("CLUSTER INFO").get("cluster_state") if enabled else None
    except UNREACHABLE as error:  # (a worker may start before Redis: its sessions wait out the outage)
        if forced:
            raise RedisSetupError(f"the Redis Cluster at {_where(url)} cannot be reached ({error}); check "
                                  "--redis-url (CHATD_REDIS_URL) and that the cluster is running") from None
        log.warning("Redis at %s cannot be reached (%s): starting as with a single Redis server, whose sessions "
                    "wait out the outage; check --redis-url (CHATD_REDIS_URL)", _where(url), error)
        return False
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
    return enabled


def sync_client(url: str, cluster: bool, **options: Any) -> redis.Redis | RedisCluster:
    """A pooled sync client: a cluster client (every node found from this one) or a plain one."""
    if cluster:
        return RedisCluster.from_url(url, **_cluster_options(options))
    return redis.Redis.from_url(url, **options)


def async_client(url: str, cluster: bool, **options: Any) -> aioredis.Redis | AsyncRedisCluster:
    """A pooled asyncio client: a cluster client (every node found from this one) or a plain one."""
    if cluster:
        return AsyncRedisCluster.from_url(url, **_cluster_options(options))
    return aioredis.Redis.from_url(url, **options)


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
