"""Shared pieces of the gRPC API tests (no tests here): an in-process server, stubs and tokens.

The server runs inside the test's event loop on a free port, on its own Redis client and the test's
PostgreSQL pool, with a cheap argon2 hasher so logins cost microseconds. `Harness` holds a channel,
one stub per service, and bearer metadata for an admin, an operator and a viewer.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import asyncpg
import grpc
import pytest
from argon2 import PasswordHasher
from redis.asyncio import Redis
from scheduler_client.v1 import (
    auth_pb2,
    auth_pb2_grpc,
    cluster_pb2_grpc,
    executions_pb2_grpc,
    jobs_pb2,
    jobs_pb2_grpc,
    queue_pb2_grpc,
)

from scheduler_grpc.auth import Role
from scheduler_grpc.connections import redis_client
from scheduler_grpc.db.users import UserRepository
from scheduler_grpc.server import RunningServer, serve
from tests.engine_helpers import make_settings

FAST_HASHER = PasswordHasher(time_cost=1, memory_cost=1024, parallelism=1)
ADMIN_PASSWORD = "admin123"
Metadata = Sequence[tuple[str, str]]


def bearer(token: str) -> Metadata:
    return (("authorization", f"Bearer {token}"),)


@dataclass
class Harness:
    """A running in-process server and what a test needs to call it."""

    server: RunningServer
    channel: grpc.aio.Channel
    admin: Metadata = ()
    operator: Metadata = ()
    viewer: Metadata = ()
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def auth(self) -> auth_pb2_grpc.AuthServiceStub:
        return auth_pb2_grpc.AuthServiceStub(self.channel)

    @property
    def jobs(self) -> jobs_pb2_grpc.JobServiceStub:
        return jobs_pb2_grpc.JobServiceStub(self.channel)

    @property
    def executions(self) -> executions_pb2_grpc.ExecutionServiceStub:
        return executions_pb2_grpc.ExecutionServiceStub(self.channel)

    @property
    def queue(self) -> queue_pb2_grpc.QueueServiceStub:
        return queue_pb2_grpc.QueueServiceStub(self.channel)

    @property
    def cluster(self) -> cluster_pb2_grpc.ClusterServiceStub:
        return cluster_pb2_grpc.ClusterServiceStub(self.channel)

    async def token_for(self, username: str, role: Role) -> Metadata:
        """A session for a user with `role` (created directly: no password check needed)."""
        users = UserRepository(self.server.api.control._pool)
        user = await users.upsert(username, FAST_HASHER.hash("irrelevant-password"), role.value)
        session = await self.server.api.auth.open_session(user)
        return bearer(session.token)


@contextlib.asynccontextmanager
async def running_api(redis_url: str, database_url: str, pool: asyncpg.Pool, **env: str) -> AsyncIterator[Harness]:
    """Start a server on a free port with `env` settings; log in an admin, operator and viewer."""
    settings = make_settings(redis_url, database_url, SCHEDULER_GRPC_PORT="0", SCHEDULER_SHUTDOWN_GRACE="2s", **env)
    client: Redis = redis_client(redis_url)
    try:
        async with serve(settings, client, pool, hasher=FAST_HASHER) as server:
            channel = grpc.aio.insecure_channel(server.address)
            try:
                harness = Harness(server, channel)
                login = await harness.auth.Login(auth_pb2.LoginRequest(username="admin", password=ADMIN_PASSWORD))
                harness.admin = bearer(login.token)
                harness.operator = await harness.token_for("olivia", Role.OPERATOR)
                harness.viewer = await harness.token_for("victor", Role.VIEWER)
                yield harness
            finally:
                await channel.close()
    finally:
        await client.aclose()


@pytest.fixture
async def api(redis_url: str, database_url: str, redis: Redis, pool: asyncpg.Pool) -> AsyncIterator[Harness]:
    """An in-process server on the flushed Redis and the emptied database."""
    async with running_api(redis_url, database_url, pool) as harness:
        yield harness


def echo_job(name: str = "echo", **fields: Any) -> jobs_pb2.Job:
    """A valid manual job message."""
    return jobs_pb2.Job(name=name, handler="test.echo", **fields)


def cron_job(name: str = "tick", cron: str = "*/5 * * * *", **fields: Any) -> jobs_pb2.Job:
    return jobs_pb2.Job(name=name, handler="test.echo", schedule=jobs_pb2.Schedule(cron=cron), **fields)
