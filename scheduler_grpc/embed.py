"""Embedding the control plane in a Python program: one call opens the stores and yields a `Control`.

The program then creates, triggers and inspects jobs exactly as the gRPC API does (same validation,
same storage), while roles started elsewhere (`scheduler-grpc up`, or scheduler and worker
processes) run them.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from scheduler_grpc import config
from scheduler_grpc.config import Settings
from scheduler_grpc.connections import connect
from scheduler_grpc.control import Control
from scheduler_grpc.handlers import HandlerRegistry, HandlerSettings, default_registry


@asynccontextmanager
async def open_control(
    settings: Settings | None = None, *, handlers: HandlerRegistry | None = None
) -> AsyncIterator[Control]:
    """Connect to Redis and PostgreSQL, apply pending migrations, and yield a `Control`; close on exit.

    Args:
        settings: As the roles read them (`config.load()`); default: from the environment
            (REDIS_URL, DATABASE_URL, SCHEDULER_*).
        handlers: The handlers jobs are validated against; default: the built-in ones and the
            installed plugins, under `settings` (closed on exit only when created here).

    Raises:
        ConfigError: a setting is invalid or a server cannot be reached (the message names it).
    """
    settings = settings or config.load()
    registry = handlers or default_registry(HandlerSettings.from_settings(settings))
    try:
        async with connect(settings) as conns:
            yield Control(conns.redis, conns.pool, registry, shard_lead=settings.queue_shard_lead)
    finally:
        if handlers is None:
            await registry.aclose()
