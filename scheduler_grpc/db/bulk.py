"""Bulk selections and batched writes: which executions or jobs a filter matches, and acting on up
to `BATCH` of them per statement.

A selection is read in keyset order (executions newest first by (created_at, id), jobs by name), one
batch at a time, so no statement touches more than `BATCH` rows and an action on thousands of rows
never holds one long transaction. Filters reuse the console's indexes (migration 0008); the
conditions are built only from the filters given, so the planner sees the shape it can serve.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Final

import asyncpg

from scheduler_grpc.db.attempts import latest_attempt
from scheduler_grpc.db.jobs import _API_COLUMNS, GRAPH_LOCK, JOBS_CHANGED_CHANNEL, job_from_row
from scheduler_grpc.jobs import Job

BATCH: Final = 500
"""Rows per statement of a bulk action."""
MAX_NAME_MATCHES: Final = 1000
"""Most jobs a `job_name` filter of executions may match (their ids go into one `= ANY(...)`)."""

# The states of an unfinished attempt (`finished_at IS NULL`); every other one is final.
_OPEN_STATES: Final = frozenset({"queued", "running"})


def like_pattern(text: str) -> str:
    """`text` as an ILIKE pattern matching it anywhere (its own % _ \\ taken literally)."""
    return "%" + text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"


@dataclass(frozen=True)
class ExecutionFilter:
    """Which executions (attempts) a search or a bulk action is about; empty fields do not filter.

    Attributes:
        job_ids: Only these jobs' executions (a job name search resolves to these).
        states: Only attempts in these states.
        handler: Only attempts of runs of this handler.
        queue: Only attempts of runs on this queue.
        since: Created at or after this time.
        until: Created before this time.
        error: Only attempts whose error contains this text (case-insensitive).
    """

    job_ids: tuple[str, ...] | None = None
    states: tuple[str, ...] = ()
    handler: str | None = None
    queue: str | None = None
    since: datetime | None = None
    until: datetime | None = None
    error: str | None = None


@dataclass
class _Where:
    conditions: list[str] = field(default_factory=list)
    args: list[object] = field(default_factory=list)

    def add(self, condition: str, *values: object) -> None:
        first = len(self.args) + 1
        self.args.extend(values)
        self.conditions.append(condition.format(*(f"${first + i}" for i in range(len(values)))))

    def sql(self) -> str:
        return "WHERE " + " AND ".join(self.conditions) if self.conditions else ""


def execution_where(selected: ExecutionFilter) -> _Where:
    """The WHERE conditions (over `job_executions e`) of a filter, with their arguments."""
    where = _Where()
    if selected.job_ids is not None:
        where.add("e.job_id = ANY({}::uuid[])", [uuid.UUID(i) for i in selected.job_ids])
    # No index reads `status` (the claim must stay a HOT update, migration 0009): a finished state
    # is found by `final_status`, an open one among the open rows (`finished_at IS NULL`).
    finished = [state for state in selected.states if state not in _OPEN_STATES]
    opened = [state for state in selected.states if state in _OPEN_STATES]
    if len(finished) == 1 and not opened:
        where.add("e.final_status = {}", finished[0])
    elif finished and not opened:
        where.add("e.final_status = ANY({}::text[])", finished)
    elif opened and not finished:
        where.add("e.finished_at IS NULL AND e.status = ANY({}::text[])", opened)
    elif selected.states:
        where.add(
            "(e.final_status = ANY({}::text[]) OR (e.finished_at IS NULL AND e.status = ANY({}::text[])))",
            finished,
            opened,
        )
    if selected.handler:
        where.add("e.handler = {}", selected.handler)
    if selected.queue:
        where.add("e.queue = {}", selected.queue)
    if selected.since:
        where.add("e.created_at >= {}", selected.since)
    if selected.until:
        where.add("e.created_at < {}", selected.until)
    if selected.error:
        where.add("e.error ILIKE {}", like_pattern(selected.error))
    return where


@dataclass(frozen=True)
class JobFilter:
    """Which jobs a bulk action is about (the jobs page's filters); empty fields do not filter.

    Attributes:
        name: Only jobs whose name contains this text (case-insensitive).
        state: Only jobs in this state (active or paused).
        handler: Only jobs of this handler.
        queue: Only jobs on this queue.
    """

    name: str | None = None
    state: str | None = None
    handler: str | None = None
    queue: str | None = None


def _job_where(selected: JobFilter) -> _Where:
    where = _Where()
    if selected.name:
        where.add("name ILIKE {}", like_pattern(selected.name))
    if selected.state:
        where.add("status = {}", selected.state)
    if selected.handler:
        where.add("handler = {}", selected.handler)
    if selected.queue:
        where.add("queue = {}", selected.queue)
    return where


@dataclass(frozen=True)
class Selected:
    """One batch of a selection: the runs (with their queue) and the keyset position after it."""

    runs: list[tuple[str, str]]
    cursor: tuple[datetime, uuid.UUID] | None


class BulkQueries:
    """Selections by filter and the batched job writes of bulk actions, each bounded by `timeout`."""

    def __init__(self, pool: asyncpg.Pool, *, timeout: float = 5.0) -> None:
        self._pool = pool
        self._timeout = timeout

    async def job_ids_named(self, text: str) -> list[str]:
        """Ids of the jobs whose name contains `text`, at most MAX_NAME_MATCHES + 1 (an exact name first)."""
        rows = await self._pool.fetch(
            """SELECT id FROM jobs WHERE name ILIKE $1 ORDER BY (name = $2) DESC, name LIMIT $3""",
            like_pattern(text),
            text,
            MAX_NAME_MATCHES + 1,
            timeout=self._timeout,
        )
        return [str(row["id"]) for row in rows]

    async def count_executions(self, selected: ExecutionFilter, cap: int) -> int:
        """How many attempts match, counted up to `cap` + 1 (more says "over the cap")."""
        where = execution_where(selected)
        where.args.append(cap + 1)
        value = await self._pool.fetchval(
            f"SELECT count(*) FROM (SELECT 1 FROM job_executions e {where.sql()} LIMIT ${len(where.args)}) AS m",
            *where.args,
            timeout=self._timeout,
        )
        return int(value)

    async def errors_of_matches(self, selected: ExecutionFilter, cap: int) -> list[tuple[str, str]]:
        """(execution id, error) of the matching attempts, newest first, up to `cap` + 1 (more says
        "over the cap"): for a caller that may not read every error to decide on what it reads."""
        where = execution_where(selected)
        where.args.append(cap + 1)
        rows = await self._pool.fetch(
            f"""SELECT e.id, coalesce(e.error, '') AS error FROM job_executions e {where.sql()}
                ORDER BY e.created_at DESC, e.id DESC LIMIT ${len(where.args)}""",
            *where.args,
            timeout=self._timeout,
        )
        return [(str(row["id"]), str(row["error"])) for row in rows]

    async def select_runs(
        self, selected: ExecutionFilter, after: tuple[datetime, uuid.UUID] | None, limit: int = BATCH
    ) -> Selected:
        """The next `limit` matching attempts after the keyset cursor `after`, newest first, as
        (run id, queue) of their runs (a run once, even if several of its attempts match)."""
        where = execution_where(selected)
        if after is not None:
            where.add("(e.created_at, e.id) < ({}, {}::uuid)", after[0], after[1])
        where.args.append(limit)
        rows = await self._pool.fetch(
            f"""SELECT e.created_at, e.id, e.run_id, coalesce(e.queue, j.queue, 'default') AS queue
                FROM job_executions e LEFT JOIN jobs j ON j.id = e.job_id {where.sql()}
                ORDER BY e.created_at DESC, e.id DESC LIMIT ${len(where.args)}""",
            *where.args,
            timeout=self._timeout,
        )
        runs = list(dict.fromkeys((str(row["run_id"]), str(row["queue"])) for row in rows))
        cursor = (rows[-1]["created_at"], rows[-1]["id"]) if len(rows) == limit else None
        return Selected(runs, cursor)

    async def runs_of(self, execution_ids: Sequence[str]) -> list[tuple[str, str]]:
        """(run id, queue) of these attempts (unknown ids are left out)."""
        rows = await self._pool.fetch(
            """SELECT DISTINCT e.run_id, coalesce(e.queue, j.queue, 'default') AS queue
               FROM job_executions e LEFT JOIN jobs j ON j.id = e.job_id WHERE e.id = ANY($1::uuid[])""",
            [uuid.UUID(i) for i in execution_ids],
            timeout=self._timeout,
        )
        return [(str(row["run_id"]), str(row["queue"])) for row in rows]

    async def latest_states(self, run_ids: Sequence[str]) -> dict[str, str]:
        """The state of each run's latest attempt (unknown runs are left out)."""
        rows = await self._pool.fetch(
            f"""SELECT r.run_id, x.status FROM unnest($1::uuid[]) AS r(run_id)
                CROSS JOIN LATERAL {latest_attempt("r.run_id", "a.status")} x""",
            [uuid.UUID(i) for i in run_ids],
            timeout=self._timeout,
        )
        return {str(row["run_id"]): str(row["status"]) for row in rows}

    async def count_jobs(self, selected: JobFilter, cap: int) -> int:
        """How many jobs match, counted up to `cap` + 1."""
        where = _job_where(selected)
        where.args.append(cap + 1)
        value = await self._pool.fetchval(
            f"SELECT count(*) FROM (SELECT 1 FROM jobs {where.sql()} LIMIT ${len(where.args)}) AS m",
            *where.args,
            timeout=self._timeout,
        )
        return int(value)

    async def select_jobs(self, selected: JobFilter, after: str | None, limit: int = BATCH) -> list[Job]:
        """The next `limit` matching jobs by name after `after` (keyset)."""
        where = _job_where(selected)
        if after is not None:
            where.add("name > {}", after)
        where.args.append(limit)
        rows = await self._pool.fetch(
            f"SELECT {_API_COLUMNS} FROM jobs {where.sql()} ORDER BY name LIMIT ${len(where.args)}",
            *where.args,
            timeout=self._timeout,
        )
        return [job_from_row(row) for row in rows]

    async def jobs_by_id(self, job_ids: Sequence[str]) -> list[Job]:
        """These jobs (unknown ids are left out), by name."""
        rows = await self._pool.fetch(
            f"SELECT {_API_COLUMNS} FROM jobs WHERE id = ANY($1::uuid[]) ORDER BY name",
            [uuid.UUID(i) for i in job_ids],
            timeout=self._timeout,
        )
        return [job_from_row(row) for row in rows]

    async def set_statuses(self, changes: Sequence[tuple[str, str, datetime | None]], from_status: str) -> list[str]:
        """Pause or resume jobs in one statement: (id, new status, next run time) each, applied only
        to jobs still in `from_status`; returns the ids changed."""
        if not changes:
            return []
        rows = await self._pool.fetch(
            """UPDATE jobs SET status = c.status, next_run_time = c.next_run, version = version + 1,
                              updated_at = now()
               FROM unnest($1::uuid[], $2::text[], $3::timestamptz[]) AS c(id, status, next_run)
               WHERE jobs.id = c.id AND jobs.status = $4
               RETURNING jobs.id""",
            [uuid.UUID(i) for i, _, _ in changes],
            [status for _, status, _ in changes],
            [moment for _, _, moment in changes],
            from_status,
            timeout=self._timeout,
        )
        if rows:
            # A resumed job's schedule changed: a sleeping leader re-plans its next scan at once.
            await self._pool.execute("SELECT pg_notify($1, '')", JOBS_CHANGED_CHANNEL, timeout=self._timeout)
        return [str(row["id"]) for row in rows]

    async def delete_jobs(self, job_ids: Sequence[str], *, detach_dependents: bool) -> tuple[list[str], list[str]]:
        """Delete jobs (with their history) in one statement; without `detach_dependents` a job that
        a job outside this batch depends on is kept.

        Returns:
            (ids deleted, ids kept because others depend on them).
        """
        keys = [uuid.UUID(i) for i in job_ids]
        async with self._pool.acquire() as conn, conn.transaction():
            await conn.execute("SELECT pg_advisory_xact_lock($1)", GRAPH_LOCK, timeout=self._timeout)
            kept: list[Any] = []
            if not detach_dependents:
                kept = await conn.fetch(
                    """SELECT DISTINCT d.upstream_id FROM job_dependencies d
                       WHERE d.upstream_id = ANY($1::uuid[]) AND NOT d.job_id = ANY($1::uuid[])""",
                    keys,
                    timeout=self._timeout,
                )
            kept_ids = {row["upstream_id"] for row in kept}
            rows = await conn.fetch(
                "DELETE FROM jobs WHERE id = ANY($1::uuid[]) RETURNING id",
                [key for key in keys if key not in kept_ids],
                timeout=self._timeout,
            )
        return [str(row["id"]) for row in rows], sorted(str(key) for key in kept_ids)
