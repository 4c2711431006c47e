"""Each queue's shard count over time (issue 24, migration 0018; see `sharding.py`)."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Final

import asyncpg

from scheduler_grpc import pagetokens
from scheduler_grpc.db.keyset import page_by_name
from scheduler_grpc.errors import FailedPrecondition, InvalidArgument
from scheduler_grpc.rules import QUEUE_NAME_RULE, is_queue_name
from scheduler_grpc.sharding import SHARD_LEAD, ShardChange, ShardHistory, check_shards

_DEFAULT_TIMEOUT: Final = timedelta(seconds=5)
# Changes one queue may record. Every role re-reads the whole table every lead/4, and a change can
# never be removed (runs made under it may still be open), so its size is bounded where it grows.
MAX_CHANGES: Final = 100
_PAGE_KIND: Final = "queue_shards"
# Each queue's changes in one row, with the database clock: what `history` and `list_page` read.
_HISTORIES: Final = """
    SELECT * FROM (
        SELECT queue,
               array_agg((extract(epoch FROM effective_at) * 1000)::bigint ORDER BY effective_at) AS ms,
               array_agg(shards ORDER BY effective_at) AS counts,
               (extract(epoch FROM clock_timestamp()) * 1000)::bigint AS now_ms
          FROM queue_shards GROUP BY queue) AS histories"""


def _history(row: asyncpg.Record) -> ShardHistory:
    changes = tuple(ShardChange(int(ms), int(n)) for ms, n in zip(row["ms"], row["counts"], strict=True))
    return ShardHistory(row["queue"], changes, int(row["now_ms"]))


@dataclass(frozen=True)
class ShardHistoryPage:
    """A page of the queues with a shard history, by name."""

    histories: list[ShardHistory]
    next_page_token: str

    def token_after(self, history: ShardHistory) -> str:
        """The token of the page after `history` (a page cut short, e.g. by its size)."""
        return pagetokens.encode(_PAGE_KIND, {}, [history.queue])


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

    async def history(self, queue: str) -> ShardHistory:
        """`queue`'s changes, oldest first (none: it has one shard), with the database clock."""
        async with asyncio.timeout(self._timeout):
            async with self._pool.acquire() as conn:
                row = await conn.fetchrow(f"{_HISTORIES} WHERE queue = $1", queue)
                if row is None:
                    now_ms = await conn.fetchval("SELECT (extract(epoch FROM clock_timestamp()) * 1000)::bigint")
                    return ShardHistory(queue, (), int(now_ms))
        return _history(row)

    async def list_page(self, *, page_size: int, page_token: str) -> ShardHistoryPage:
        """A page of the queues with a history, by name, and the next page's token ("" at the end).

        Raises:
            InvalidArgument: `page_size` out of range or a `page_token` this server did not issue.
        """
        histories, token = await page_by_name(
            self._pool,
            self._timeout,
            kind=_PAGE_KIND,
            select=_HISTORIES,
            column="queue",
            page_size=page_size,
            page_token=page_token,
            item=_history,
            name_of=lambda history: history.queue,
        )
        return ShardHistoryPage(histories, token)

    async def set_shards(self, queue: str, shards: int, *, lead: timedelta = SHARD_LEAD) -> datetime:
        """Give `queue` `shards` shards for the runs made from `lead` after now (database clock) on.

        `lead` must be the one every role reads the histories with (`SCHEDULER_QUEUE_SHARD_LEAD`),
        so each has read the change before it applies. Returns when it applies.

        Raises:
            InvalidArgument: not a queue name, shards out of range, a negative lead.
            FailedPrecondition: the queue has `MAX_CHANGES` changes already; nothing is written.
        """
        if not is_queue_name(queue):
            raise InvalidArgument("queue", QUEUE_NAME_RULE)
        check_shards(shards)
        if lead < timedelta(0):
            raise InvalidArgument("lead", "must not be negative")
        async with asyncio.timeout(self._timeout), self._pool.acquire() as conn, conn.transaction():
            # One change of a queue at a time, so concurrent sets cannot pass the count together.
            await conn.execute("SELECT pg_advisory_xact_lock(hashtext('queue_shards'), hashtext($1))", queue)
            effective: datetime | None = await conn.fetchval(
                """INSERT INTO queue_shards (queue, effective_at, shards)
                   SELECT $1, clock_timestamp() + $3::interval, $2
                   WHERE (SELECT count(*) FROM queue_shards WHERE queue = $1) < $4
                   RETURNING effective_at""",
                queue,
                shards,
                lead,
                MAX_CHANGES,
            )
        if effective is None:
            raise FailedPrecondition(f"queue {queue!r} has {MAX_CHANGES} shard changes, the most one queue may record")
        return effective
