"""The web console's read queries: lists with the console's filters, and the overview's aggregates.

Every list is keyset-paginated (a cursor of the last row's sort key, never OFFSET) and every query is
served by an index (migration 0008 adds the ones the console's filters need), so each page stays
fast with millions of history rows. Writes go through `Control`, never through this module.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

import asyncpg

from scheduler_grpc.db.executions import _COLUMNS as _EXECUTION_COLUMNS_FULL
from scheduler_grpc.db.executions import _COLUMNS_WITHOUT_OUTPUT as _EXECUTION_COLUMNS
from scheduler_grpc.db.executions import execution_from_row
from scheduler_grpc.db.jobs import _COLUMNS_WITHOUT_PAYLOAD as _JOB_COLUMNS
from scheduler_grpc.db.jobs import job_from_row
from scheduler_grpc.executions import Execution
from scheduler_grpc.jobs import Job


@dataclass(frozen=True)
class JobRow:
    """A job as the console lists it: the definition (no payload) and its latest attempt's status."""

    job: Job
    last_status: str | None


@dataclass(frozen=True)
class ExecutionRow:
    """An attempt as the console lists it, with its job's name and the handler it ran."""

    execution: Execution
    job_name: str
    handler: str


@dataclass(frozen=True)
class Overview:
    """The overview page's aggregates (PostgreSQL's part).

    Attributes:
        per_minute: (minute, status, count) of attempts finished in the last hour.
        open_by_band: (status, priority band, count) of queued and running attempts.
        lateness_p50: Median start lateness (started - scheduled) of scheduled runs in the last hour.
        lateness_p99: Its 99th percentile.
        failures: The latest failed, timed out or dead attempts.
    """

    per_minute: list[tuple[datetime, str, int]]
    open_by_band: list[tuple[str, str, int]]
    lateness_p50: timedelta | None
    lateness_p99: timedelta | None
    failures: list[ExecutionRow]


def _execution_row(row: asyncpg.Record) -> ExecutionRow:
    return ExecutionRow(execution_from_row(row), row["job_name"] or "", row["run_handler"] or "")


class ConsoleQueries:
    """The console's reads, each bounded by `timeout`."""

    def __init__(self, pool: asyncpg.Pool, *, timeout: timedelta = timedelta(seconds=5)) -> None:
        self._pool = pool
        self._timeout = timeout.total_seconds()

    async def jobs(
        self,
        *,
        search: str | None,
        status: str | None,
        handler: str | None,
        queue: str | None,
        after: str | None,
        limit: int,
    ) -> list[JobRow]:
        """Jobs ordered by name after `after` (keyset); `search` matches a part of the name."""
        pattern = None
        if search:
            pattern = "%" + search.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
        rows = await self._pool.fetch(
            f"""SELECT {_JOB_COLUMNS},
                       (SELECT e.status FROM job_executions e WHERE e.job_id = jobs.id
                        ORDER BY e.scheduled_for DESC, e.attempt DESC LIMIT 1) AS last_status
                FROM jobs
                WHERE ($1::text IS NULL OR name > $1) AND ($2::text IS NULL OR status = $2)
                  AND ($3::text IS NULL OR handler = $3) AND ($4::text IS NULL OR queue = $4)
                  AND ($5::text IS NULL OR name ILIKE $5)
                ORDER BY name LIMIT $6""",
            after,
            status,
            handler,
            queue,
            pattern,
            limit,
            timeout=self._timeout,
        )
        return [JobRow(job_from_row(row), row["last_status"]) for row in rows]

    async def executions(
        self,
        *,
        job_id: str | None,
        statuses: Sequence[str],
        handler: str | None,
        since: datetime | None,
        until: datetime | None,
        before: tuple[datetime, str] | None,
        limit: int,
    ) -> list[ExecutionRow]:
        """Attempts newest first (by creation), before the keyset cursor `before`, with the filters."""
        rows = await self._pool.fetch(
            f"""SELECT {_EXECUTION_COLUMNS}, j.name AS job_name, coalesce(e.handler, j.handler) AS run_handler
                FROM job_executions e LEFT JOIN jobs j ON j.id = e.job_id
                WHERE ($1::uuid IS NULL OR e.job_id = $1)
                  AND (cardinality($2::text[]) = 0 OR e.status = ANY($2))
                  AND ($3::text IS NULL OR e.handler = $3)
                  AND ($4::timestamptz IS NULL OR e.created_at >= $4)
                  AND ($5::timestamptz IS NULL OR e.created_at < $5)
                  AND ($6::timestamptz IS NULL OR (e.created_at, e.id) < ($6, $7::uuid))
                ORDER BY e.created_at DESC, e.id DESC LIMIT $8""",
            uuid.UUID(job_id) if job_id else None,
            list(statuses),
            handler,
            since,
            until,
            before[0] if before else None,
            uuid.UUID(before[1]) if before else None,
            limit,
            timeout=self._timeout,
        )
        return [_execution_row(row) for row in rows]

    async def run_attempts(self, run_id: str) -> list[Execution]:
        """Every attempt of a run, first attempt first."""
        rows = await self._pool.fetch(
            f"SELECT {_EXECUTION_COLUMNS_FULL} FROM job_executions e WHERE e.run_id = $1 ORDER BY e.attempt",
            uuid.UUID(run_id),
            timeout=self._timeout,
        )
        return [execution_from_row(row) for row in rows]

    async def job_slots(self, job_id: str, limit: int) -> list[Execution]:
        """The job's latest attempts, newest slot first (served by its (job_id, scheduled_for, attempt) key)."""
        rows = await self._pool.fetch(
            f"""SELECT {_EXECUTION_COLUMNS} FROM job_executions e WHERE e.job_id = $1
                ORDER BY e.scheduled_for DESC, e.attempt DESC LIMIT $2""",
            uuid.UUID(job_id),
            limit,
            timeout=self._timeout,
        )
        return [execution_from_row(row) for row in rows]

    async def overview(self, now: datetime, failures: int = 10) -> Overview:
        """The overview's aggregates over the hour before `now`."""
        since = now - timedelta(hours=1)
        async with self._pool.acquire() as conn:
            per_minute = await conn.fetch(
                """SELECT date_trunc('minute', finished_at) AS minute, status, count(*) AS n
                   FROM job_executions WHERE finished_at >= $1 AND finished_at IS NOT NULL
                   GROUP BY 1, 2 ORDER BY 1""",
                since,
                timeout=self._timeout,
            )
            open_rows = await conn.fetch(
                """SELECT status, CASE WHEN priority > 0 THEN 'high' WHEN priority < 0 THEN 'low' ELSE 'normal' END
                          AS band, count(*) AS n
                   FROM job_executions WHERE status IN ('queued', 'running') GROUP BY 1, 2 ORDER BY 1, 2""",
                timeout=self._timeout,
            )
            lateness = await conn.fetchrow(
                """SELECT percentile_cont(0.5) WITHIN GROUP (ORDER BY started_at - scheduled_for) AS p50,
                          percentile_cont(0.99) WITHIN GROUP (ORDER BY started_at - scheduled_for) AS p99
                   FROM job_executions
                   WHERE finished_at >= $1 AND finished_at IS NOT NULL AND trigger = 'schedule'
                     AND started_at IS NOT NULL AND attempt = 1""",
                since,
                timeout=self._timeout,
            )
            # One index range per failing state (newest first), merged: bounded however rare failures are.
            one_state = (
                f"(SELECT {_EXECUTION_COLUMNS_FULL}, e.handler AS snapshot FROM job_executions e"
                " WHERE e.status = '{}'"
                " ORDER BY e.created_at DESC, e.id DESC LIMIT $1)"
            )
            states = " UNION ALL ".join(one_state.format(state) for state in ("failed", "timed_out", "dead"))
            failed = await conn.fetch(
                f"""SELECT * FROM ({states}) AS f
                    CROSS JOIN LATERAL (SELECT j.name AS job_name, coalesce(f.snapshot, j.handler) AS run_handler
                                        FROM jobs j WHERE j.id = f.job_id) AS j
                    ORDER BY f.created_at DESC LIMIT $1""",
                failures,
                timeout=self._timeout,
            )
        return Overview(
            per_minute=[(row["minute"], row["status"], row["n"]) for row in per_minute],
            open_by_band=[(row["status"], row["band"], row["n"]) for row in open_rows],
            lateness_p50=lateness["p50"] if lateness else None,
            lateness_p99=lateness["p99"] if lateness else None,
            failures=[_execution_row(row) for row in failed],
        )

    async def handlers_and_queues(self) -> tuple[list[str], list[str]]:
        """The handlers and queues jobs use (the filters' choices)."""
        rows = await self._pool.fetch(
            "SELECT array(SELECT DISTINCT handler FROM jobs ORDER BY 1) AS h, "
            "array(SELECT DISTINCT queue FROM jobs ORDER BY 1) AS q",
            timeout=self._timeout,
        )
        return list(rows[0]["h"]), list(rows[0]["q"])
