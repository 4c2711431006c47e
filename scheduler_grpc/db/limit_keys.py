"""Where limit keys live, read from PostgreSQL for the key reads (issue 22): the queues of the jobs
that name a limit, and the queue of each queued run that takes limits (`Control.limit_keys`)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Sequence
from datetime import timedelta
from typing import Final

import asyncpg

_DEFAULT_TIMEOUT: Final = timedelta(seconds=5)


class LimitKeyQueries:
    """Reads for limit keys; each under `timeout`."""

    def __init__(self, pool: asyncpg.Pool, *, timeout: timedelta = _DEFAULT_TIMEOUT) -> None:
        self._pool = pool
        self._timeout = timeout.total_seconds()

    async def queues_of_limits(self, names: Sequence[str]) -> dict[str, list[str]]:
        """Per limit name, the queues of the jobs naming it now, sorted (limits no job names are
        left out)."""
        if not names:
            return {}
        async with asyncio.timeout(self._timeout):
            rows = await self._pool.fetch(
                """SELECT DISTINCT ref->>'limit' AS name, j.queue FROM jobs j, jsonb_array_elements(j.limits) ref
                    WHERE j.limits <> '[]'::jsonb AND ref->>'limit' = ANY($1::text[])
                    ORDER BY 1, 2""",
                list(names),
            )
        queues: dict[str, list[str]] = {}
        for row in rows:
            queues.setdefault(row["name"], []).append(row["queue"])
        return queues

    async def queues_of_queued_runs(self, execution_ids: Sequence[str]) -> dict[str, str]:
        """Execution id -> its run's queue, for those of `execution_ids` that are queued and take
        limits (the others are left out)."""
        if not execution_ids:
            return {}
        async with asyncio.timeout(self._timeout):
            rows = await self._pool.fetch(
                """SELECT e.id, coalesce(e.queue, j.queue) AS queue
                     FROM job_executions e LEFT JOIN jobs j ON j.id = e.job_id
                    WHERE e.id = ANY($1::uuid[]) AND e.status = 'queued' AND e.limit_keys IS NOT NULL""",
                [uuid.UUID(value) for value in execution_ids],
            )
        return {str(row["id"]): row["queue"] for row in rows if row["queue"] is not None}
