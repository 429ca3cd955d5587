"""The process's Redis client, and the one place a Redis failure becomes a harness error.

A method of the store that talks to Redis is wrapped in `@translated`: a `RedisError` (or an
`OSError` from the socket) leaves it as `harness.errors.Unavailable`, so nothing outside this
package knows what a Redis error looks like. Channels map `Unavailable` to 503 + Retry-After,
a websocket error frame, or close 1013.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable
from typing import ParamSpec, TypeVar

import redis as sync_redis
from redis.asyncio import ConnectionPool, Redis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import RedisError
from redis.maint_notifications import MaintNotificationsConfig

from harness.errors import Unavailable
from harness.telemetry.metrics import count_redis_error

Client = Redis | RedisCluster  # one server, or a Redis / Valkey Cluster (any node's URL)
P = ParamSpec("P")
T = TypeVar("T")
MAX_CONNECTIONS = 4096


def connect(url: str, *, cluster: bool | None = None) -> Client:
    """The process's Redis client: a cluster client when `url` is a node of a Redis Cluster
    (asked once, here, unless `cluster` says), else a plain one. The pool may hold up to 4,096
    connections (per node): a burst (a thousand sockets opening together) gets more
    connections rather than errors, and a plain pool costs a turn about 7% less than a blocking
    one. Maintenance notifications off: redis-py 8.1's default ("auto") skips the liveness
    check of pooled connections, so after a Redis restart every old connection failed once, as
    a 5xx."""
    if cluster is None:
        cluster = is_cluster_node(url)
    if cluster:
        return RedisCluster.from_url(url, max_connections=MAX_CONNECTIONS, health_check_interval=30)
    pool = ConnectionPool.from_url(
        url,
        max_connections=MAX_CONNECTIONS,
        health_check_interval=30,
        maint_notifications_config=MaintNotificationsConfig(enabled=False),
    )
    return Redis.from_pool(pool)


def is_cluster_node(url: str, timeout: float = 2.0) -> bool:
    """Whether the Redis at `url` runs in cluster mode (one INFO, blocking: called once at
    start). One that does not answer is taken for a plain server: its calls then fail as any
    call to an absent Redis does."""
    client = sync_redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout)
    try:
        return bool(client.info("cluster").get("cluster_enabled"))
    except (RedisError, OSError):
        return False
    finally:
        client.close()


async def reachable(url: str, timeout: float = 5.0) -> bool:
    """Whether a Redis answers at `url`: whether it is a Redis Cluster node, or `Unavailable`
    saying why not."""
    client = connect(url, cluster=False)
    try:
        async with asyncio.timeout(timeout):
            await client.ping()
            info = await client.info("cluster")
            return bool(info.get("cluster_enabled"))
    except (RedisError, OSError) as exc:
        raise Unavailable(f"{type(exc).__name__}: {exc}") from exc
    finally:
        await client.aclose()


def unavailable(exc: BaseException) -> Unavailable:
    count_redis_error()
    return Unavailable(f"storage is unavailable: {type(exc).__name__}; retry")


def translated(fn: Callable[P, Awaitable[T]]) -> Callable[P, Awaitable[T]]:
    """`fn` with Redis failures raised as `Unavailable` (the Redis error as its cause)."""

    @functools.wraps(fn)
    async def call(*args: P.args, **kwargs: P.kwargs) -> T:
        try:
            return await fn(*args, **kwargs)
        except (RedisError, OSError) as exc:
            raise unavailable(exc) from exc

    return call
