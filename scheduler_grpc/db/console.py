"""The web console's read queries: lists with the console's filters, and the overview's aggregates.

Every list is keyset-paginated (a cursor of the last row's sort key, never OFFSET) and every query is
served by an index (migration 0008 adds the ones the console's filters need), so each page stays
fast with millions of history rows. Writes go through `Control`, never through this module.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

import asyncpg

from scheduler_grpc.db.attempts import latest_attempt
from scheduler_grpc.db.bulk import like_pattern
from scheduler_grpc.db.executions import COLUMNS as _EXECUTION_COLUMNS_FULL
from scheduler_grpc.db.executions import COLUMNS_WITHOUT_OUTPUT as _EXECUTION_COLUMNS
from scheduler_grpc.db.executions import execution_from_row
from scheduler_grpc.db.jobs import _COLUMNS_WITHOUT_PAYLOAD as _JOB_COLUMNS
from scheduler_grpc.db.jobs import job_from_row
from scheduler_grpc.executions import Execution
from scheduler_grpc.jobs import Job

# The states of an unfinished attempt (`finished_at IS NULL`); every other one is final.
_OPEN_STATES = frozenset({"queued", "running"})

ERROR_SCAN = 50_000
"""Most rows (newest first, after the other filters) an error text search of the executions list reads."""

CHOICES_TTL = 10.0
"""Seconds the filters' handler and queue choices are reused (a DISTINCT over every job otherwise)."""


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
        self._choices: tuple[float, tuple[list[str], list[str]]] | None = None

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
                       (SELECT x.status FROM job_executions r
                        CROSS JOIN LATERAL {latest_attempt("r.run_id", "a.status")} x
                        WHERE r.job_id = jobs.id AND r.attempt = 1
                        ORDER BY r.scheduled_for DESC LIMIT 1) AS last_status
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
        job_ids: Sequence[str] | None = None,
        error: str | None = None,
    ) -> list[ExecutionRow]:
        """Attempts newest first (by creation), before the keyset cursor `before`, with the filters.

        Only the filters given are in the SQL (no `$n IS NULL OR ...`), so the planner picks the index
        that serves them: (final_status, created_at), the open rows' created_at, (handler, created_at), the
        job's key, or created_at. `job_ids` are the jobs a name search found; `error` is a part of the
        error text (case-insensitive; a filter on the rows the other conditions reach).
        """
        conditions: list[str] = []
        args: list[object] = []

        def where(condition: str, *values: object) -> None:
            args.extend(values)
            conditions.append(condition.format(*(f"${len(args) - len(values) + i + 1}" for i in range(len(values)))))

        if job_id:
            where("e.job_id = {}", uuid.UUID(job_id))
        if job_ids is not None:
            where("e.job_id = ANY({}::uuid[])", [uuid.UUID(i) for i in job_ids])
        # No index reads `status` (the claim must stay a HOT update, migration 0009): a finished
        # state is found by `final_status`, an open one among the open rows (`finished_at IS NULL`).
        finished = [state for state in statuses if state not in _OPEN_STATES]
        opened = [state for state in statuses if state in _OPEN_STATES]
        if len(finished) == 1 and not opened:
            where("e.final_status = {}", finished[0])
        elif finished and not opened:
            where("e.final_status = ANY({}::text[])", finished)
        elif opened and not finished:
            where("e.finished_at IS NULL AND e.status = ANY({}::text[])", opened)
        elif statuses:
            where("(e.final_status = ANY({}::text[]) OR (e.finished_at IS NULL AND e.status = ANY({}::text[])))",
                  finished, opened)  # fmt: skip
        if handler:
            where("e.handler = {}", handler)
        if since:
            where("e.created_at >= {}", since)
        if until:
            where("e.created_at < {}", until)
        if before:
            where("(e.created_at, e.id) < ({}, {}::uuid)", before[0], uuid.UUID(before[1]))
        where_sql = "WHERE " + " AND ".join(conditions) if conditions else ""
        source = "job_executions e"
        if error:
            # No index can find a part of a text (pg_trgm is not everywhere): the error is looked for
            # among the newest ERROR_SCAN rows the other filters select (ids, times and errors only),
            # so a rare text costs a bounded scan, not the whole history; the rows found are then
            # read whole. Narrow the time range to look further back.
            args.extend([like_pattern(error), limit])
            source = f"""job_executions e JOIN (
                    SELECT s.id FROM (SELECT e.id, e.created_at, e.error FROM job_executions e {where_sql}
                                      ORDER BY e.created_at DESC, e.id DESC LIMIT {ERROR_SCAN}) AS s
                    WHERE s.error ILIKE ${len(args) - 1} ORDER BY s.created_at DESC, s.id DESC LIMIT ${len(args)}
                ) AS hits ON hits.id = e.id"""
            where_sql = ""
        else:
            args.append(limit)
        # An error search reads the errors too: the console shows a row by the error as its
        # caller may read it (redaction.error_matches), not by the stored text alone.
        columns = _EXECUTION_COLUMNS.replace("NULL::text AS error", "e.error") if error else _EXECUTION_COLUMNS
        selected = f"""SELECT {columns}, j.name AS job_name, coalesce(e.handler, j.handler) AS run_handler
                FROM {source} LEFT JOIN jobs j ON j.id = e.job_id {where_sql}
                ORDER BY e.created_at DESC, e.id DESC LIMIT ${len(args)}"""
        rows = await self._pool.fetch(selected, *args, timeout=self._timeout)
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
        """The overview's aggregates over the hour before `now` (four queries at once)."""
        since = now - timedelta(hours=1)
        # One index range per failing state (newest first), merged: bounded however rare failures are.
        one_state = (
            f"(SELECT {_EXECUTION_COLUMNS_FULL}, e.handler AS snapshot FROM job_executions e"
            " WHERE e.final_status = '{}'"
            " ORDER BY e.created_at DESC, e.id DESC LIMIT $1)"
        )
        states = " UNION ALL ".join(one_state.format(state) for state in ("failed", "timed_out", "dead"))
        # The last hour's finished attempts (the finished_at index): per minute and status (the
        # chart), and the start lateness of first attempts of scheduled runs.
        per_minute, lateness, open_rows, failed = await asyncio.gather(
            self._pool.fetch(
                """SELECT date_trunc('minute', finished_at) AS minute, status, count(*) AS n
                   FROM job_executions WHERE finished_at >= $1 AND finished_at IS NOT NULL
                   GROUP BY 1, 2 ORDER BY 1""",
                since,
                timeout=self._timeout,
            ),
            self._pool.fetchrow(
                """SELECT percentile_cont(0.5) WITHIN GROUP (ORDER BY started_at - scheduled_for) AS p50,
                          percentile_cont(0.99) WITHIN GROUP (ORDER BY started_at - scheduled_for) AS p99
                   FROM job_executions
                   WHERE finished_at >= $1 AND finished_at IS NOT NULL AND trigger = 'schedule'
                     AND started_at IS NOT NULL AND attempt = 1""",
                since,
                timeout=self._timeout,
            ),
            self._pool.fetch(
                """SELECT status, CASE WHEN priority > 0 THEN 'high' WHEN priority < 0 THEN 'low' ELSE 'normal' END
                          AS band, count(*) AS n
                   FROM job_executions WHERE finished_at IS NULL GROUP BY 1, 2 ORDER BY 1, 2""",
                timeout=self._timeout,
            ),
            self._pool.fetch(
                f"""SELECT * FROM ({states}) AS f
                    CROSS JOIN LATERAL (SELECT j.name AS job_name, coalesce(f.snapshot, j.handler) AS run_handler
                                        FROM jobs j WHERE j.id = f.job_id) AS j
                    ORDER BY f.created_at DESC LIMIT $1""",
                failures,
                timeout=self._timeout,
            ),
        )
        return Overview(
            per_minute=[(row["minute"], row["status"], row["n"]) for row in per_minute],
            open_by_band=[(row["status"], row["band"], row["n"]) for row in open_rows],
            lateness_p50=lateness["p50"] if lateness else None,
            lateness_p99=lateness["p99"] if lateness else None,
            failures=[_execution_row(row) for row in failed],
        )

    async def handlers_and_queues(self) -> tuple[list[str], list[str]]:
        """The handlers and queues jobs use (the filters' choices), remembered for CHOICES_TTL."""
        if self._choices is not None and time.monotonic() < self._choices[0]:
            return self._choices[1]
        rows = await self._pool.fetch(
            "SELECT array(SELECT DISTINCT handler FROM jobs ORDER BY 1) AS h, "
            "array(SELECT DISTINCT queue FROM jobs ORDER BY 1) AS q",
            timeout=self._timeout,
        )
        choices = (list(rows[0]["h"]), list(rows[0]["q"]))
        self._choices = (time.monotonic() + CHOICES_TTL, choices)
        return choices
