"""Each queue's shard count over time (issue 24, migration 0018; see `sharding.py`)."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta
from typing import Final

import asyncpg

from scheduler_grpc.errors import InvalidArgument
from scheduler_grpc.rules import QUEUE_NAME_RULE, is_queue_name
from scheduler_grpc.sharding import SHARD_LEAD, ShardChange, check_shards

_DEFAULT_TIMEOUT: Final = timedelta(seconds=5)


class QueueShardRepository:
    """Reads and changes of the shard histories; each call under `timeout`."""

    def __init__(self, pool: asyncpg.Pool, *, timeout: timedelta = _DEFAULT_TIMEOUT) -> None:
        self._pool = pool
        self._timeout = timeout.total_seconds()

    async def histories(self) -> tuple[int, Mapping[str, Sequence[ShardChange]]]:
        """(the database clock in ms, every queue's changes oldest first): a `sharding.ShardSource`."""
        async with asyncio.timeout(self._timeout):
            async with self._pool.acquire() as conn:
                now_ms = await conn.fetchval("SELECT (extract(epoch FROM clock_timestamp()) * 1000)::bigint")
                rows = await conn.fetch(
                    """SELECT queue, (extract(epoch FROM effective_at) * 1000)::bigint AS ms, shards
                         FROM queue_shards ORDER BY queue, effective_at"""
                )
        histories: dict[str, list[ShardChange]] = {}
        for row in rows:
            histories.setdefault(row["queue"], []).append(ShardChange(int(row["ms"]), int(row["shards"])))
        return int(now_ms), histories

    async def set_shards(self, queue: str, shards: int, *, lead: timedelta = SHARD_LEAD) -> datetime:
        """Give `queue` `shards` shards for the runs made from `lead` after now (database clock) on.

        `lead` must be the one every role reads the histories with (`SCHEDULER_QUEUE_SHARD_LEAD`),
        so each has read the change before it applies. Returns when it applies.
        """
        if not is_queue_name(queue):
            raise InvalidArgument("queue", QUEUE_NAME_RULE)
        check_shards(shards)
        if lead < timedelta(0):
            raise InvalidArgument("lead", "must not be negative")
        async with asyncio.timeout(self._timeout):
            effective: datetime = await self._pool.fetchval(
                """INSERT INTO queue_shards (queue, effective_at, shards)
                   VALUES ($1, clock_timestamp() + $3::interval, $2) RETURNING effective_at""",
                queue,
                shards,
                lead,
            )
        return effective
