"""Opening Redis and PostgreSQL for a role: inside the running loop, bounded, with one-line errors."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, cast
from urllib.parse import urlsplit

import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.connection import Connection
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.connection import HiredisRespSerializer

from scheduler_grpc import stores
from scheduler_grpc.cluster_client import ClusterClient
from scheduler_grpc.config import ClusterUrl, Settings, cluster_url
from scheduler_grpc.db.migrate import migrate
from scheduler_grpc.db.pool import Pool, create_pool
from scheduler_grpc.errors import ConfigError


@dataclass(frozen=True)
class Connections:
    redis: aioredis.Redis
    pool: Pool


class _HiredisPacking:
    """Commands packed by hiredis (C), as redis-py's own synchronous connections do when hiredis is
    installed (its asyncio ones pack in Python, copying the buffer as it grows): a worker's
    completion batch (four arguments per run) and event batches cost ~3x less to pack."""

    _packer = HiredisRespSerializer()

    def pack_command(self, *args: Any) -> list[bytes]:
        return self._packer.pack(*args)  # type: ignore[no-any-return]


class _TcpConnection(_HiredisPacking, Connection):
    """A TCP connection packing with hiredis. (For `rediss://` and `unix://` URLs redis-py puts its
    own SSL or Unix socket class in its place: those pack in Python.)"""


def redis_client(url: str, connect_timeout: timedelta = timedelta(seconds=5)) -> aioredis.Redis:
    """A pooled client that rides out a Redis restart: a call on a connection the server closed is
    retried on a fresh one (briefly, with backoff) instead of failing the caller.

    A cluster URL (`redis+cluster://host:port,host:port`, see `config.cluster_url`) gives a
    `redis.asyncio.cluster.RedisCluster` on those seed nodes: it learns the slot map from the
    first seed that answers and follows MOVED/ASK redirections. Typed as `Redis` because the code
    uses only the commands the two share (each key command, EVALSHA with keys of one slot, pipelines,
    pub/sub, XREAD, BZPOPMIN); what differs is said where it is used.
    """
    cluster = cluster_url(url)
    if cluster is not None:
        return cast(aioredis.Redis, _cluster_client(cluster, connect_timeout))
    return aioredis.Redis.from_url(
        url,
        connection_class=_TcpConnection,
        socket_connect_timeout=connect_timeout.total_seconds(),
        # No socket timeout: on Python 3.11 redis-py wraps each read in asyncio.wait_for, which can
        # swallow a task's cancellation (gh-86296). Callers bound their calls with asyncio.timeout.
        socket_timeout=None,
        health_check_interval=30,
        max_connections=256,
        retry=Retry(ExponentialBackoff(cap=0.5, base=0.05), retries=3),
        retry_on_error=list(stores.REDIS_RETRYABLE),
    )


def _cluster_client(cluster: ClusterUrl, connect_timeout: timedelta) -> RedisCluster:
    """A `ClusterClient`: it checks its slot map when a call times out on a silent node, as the
    roles' own call timeouts keep redis-py from seeing the error it would refresh the map on."""
    return ClusterClient(
        startup_nodes=[ClusterNode(host, port) for host, port in cluster.seeds],
        ssl=cluster.tls,
        username=cluster.username,
        password=cluster.password,
        socket_connect_timeout=connect_timeout.total_seconds(),
        socket_timeout=None,  # as for one server: callers bound their calls
        health_check_interval=30,
        max_connections=256,  # per node
        retry=Retry(ExponentialBackoff(cap=0.5, base=0.05), retries=3),
        retry_on_error=list(stores.REDIS_RETRYABLE),
    )


async def open_redis(url: str, settings: Settings) -> aioredis.Redis:
    """A client whose server has answered PING.

    Raises:
        ConfigError: naming REDIS_URL when the server cannot be reached.
    """
    seconds = settings.connect_timeout.total_seconds()
    client = redis_client(url, settings.connect_timeout)
    try:
        async with asyncio.timeout(seconds * 2):
            await client.ping()
    except Exception as exc:
        if not (stores.is_fault(exc) or stores.store_of(exc) == "redis"):
            raise  # not Redis answering (or failing to): a bug
        await client.aclose()
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ConfigError(
            f"REDIS_URL ({_safe_url(url)}) cannot be reached: {reason}; check the URL and that Redis is running"
        ) from None
    return client


def _safe_url(url: str) -> str:
    """The URL without its credentials, for an error message."""
    cluster = cluster_url(url)
    if cluster is not None:
        scheme = url.partition("://")[0]
        return f"{scheme}://" + ",".join(f"{host}:{port}" for host, port in cluster.seeds)
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.hostname}:{parts.port or 6379}"


@asynccontextmanager
async def connect_database(settings: Settings, *, session_reset: bool = True) -> AsyncIterator[Pool]:
    """A pool on DATABASE_URL, closed on exit (no migrations); `session_reset` as in `create_pool`."""
    if not settings.database_url:
        raise ConfigError("DATABASE_URL must be set (or use `scheduler-grpc up` in dev mode)")
    pool = await create_pool(
        settings.database_url,
        size=settings.db_pool_size,
        connect_timeout=settings.connect_timeout,
        session_reset=session_reset,
    )
    try:
        yield pool
    finally:
        await pool.close()


@asynccontextmanager
async def connect(
    settings: Settings, *, run_migrations: bool = True, session_reset: bool = True
) -> AsyncIterator[Connections]:
    """Open both servers (and apply pending migrations), close them on exit.

    Without `session_reset` (see `db.pool.create_pool`) the connections the migrations used are
    closed afterwards, so whatever session state they left (the advisory lock, a migration's SET)
    is not handed to the process's code.
    """
    if not settings.redis_url:
        raise ConfigError("REDIS_URL must be set (or use `scheduler-grpc up` in dev mode)")
    async with connect_database(settings, session_reset=session_reset) as pool:
        if run_migrations:
            await migrate(pool)
            if not session_reset:
                await pool.expire_connections()
        client = await open_redis(settings.redis_url, settings)
        try:
            yield Connections(redis=client, pool=pool)
        finally:
            await client.aclose()
