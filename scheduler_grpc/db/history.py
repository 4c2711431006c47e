"""Reading the execution history in PostgreSQL (by id, by request id, pages, a job's history) and
pruning it by whole days (`system.cleanup`)."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from datetime import datetime
from typing import Any

import asyncpg

from scheduler_grpc import pagetokens
from scheduler_grpc.db.executions import (
    COLUMNS,
    COLUMNS_WITHOUT_OUTPUT,
    FLOW_RUN,
    MAX_PAGE_SIZE,
    ExecutionPage,
    Queryable,
    execution_from_row,
    executions_by_id,
)
from scheduler_grpc.db.partitions import PartitionRepository
from scheduler_grpc.errors import InvalidArgument, NotFound
from scheduler_grpc.executions import Execution, ExecutionStatus


class HistoryRepository:
    """Reads of `job_executions` and the pruning of finished attempts (`ports.HistoryPruning`).

    Over a pool (each call on a connection of its own) or over the one connection of a transaction.
    """

    def __init__(self, pool: Queryable) -> None:
        self._pool = pool

    async def get(self, execution_id: str) -> Execution:
        try:
            key = uuid.UUID(execution_id)
        except ValueError:
            raise InvalidArgument("id", f"{execution_id!r} is not a valid id") from None
        row = await self._pool.fetchrow(f"SELECT {COLUMNS}, {FLOW_RUN} FROM job_executions e WHERE e.id = $1", key)
        if row is None:
            raise NotFound(f"execution {execution_id} not found")
        return execution_from_row(row)

    async def get_many(self, execution_ids: Sequence[str]) -> list[Execution]:
        """These executions in one query, oldest slot first; ids that do not exist are left out."""
        return await executions_by_id(self._pool, execution_ids)

    async def get_by_request_id(self, job_id: str, request_id: str) -> Execution:
        """The first attempt of the run a `trigger(..., request_id=...)` created (idempotent TriggerJob).

        Raises:
            NotFound: no run of this job was created with this request id.
        """
        # The request id's claim names the run's first attempt by its primary key (id, slot): one
        # probe of one partition (run-time pruning), whichever day the run's slot fell on.
        row = await self._pool.fetchrow(
            f"""SELECT {COLUMNS} FROM execution_requests q
                JOIN job_executions e ON e.id = q.run_id AND e.scheduled_for = q.scheduled_for
                WHERE q.job_id = $1 AND q.request_id = $2""",
            uuid.UUID(job_id),
            request_id,
        )
        if row is None:
            raise NotFound(f"no run of job {job_id} was created by request {request_id!r}")
        return execution_from_row(row)

    async def list_page(
        self,
        *,
        job_id: str | None = None,
        statuses: Sequence[ExecutionStatus] = (),
        page_size: int = 100,
        page_token: str = "",
        with_output: bool = True,
        flow_run_id: str | None = None,
    ) -> ExecutionPage:
        """Newest first; by job (served by the (job_id, scheduled_for, attempt) index) or overall.

        Without `with_output` no error and no result are fetched (both read as None).
        """
        if not 0 <= page_size <= MAX_PAGE_SIZE:
            raise InvalidArgument("page_size", f"must be between 0 and {MAX_PAGE_SIZE}")
        size = page_size or 100
        scope: dict[str, Any] = {"job_id": job_id, "states": sorted(status.value for status in statuses)}
        if flow_run_id:
            scope["flow_run_id"] = flow_run_id
        cursor_time: datetime | None = None
        cursor_id: uuid.UUID | None = None
        if page_token:
            cursor_time, cursor_id = _decode_cursor(pagetokens.decode(page_token, "executions", scope))
        rows = await self._pool.fetch(
            f"""SELECT {COLUMNS if with_output else COLUMNS_WITHOUT_OUTPUT}, {FLOW_RUN} FROM job_executions e
                WHERE ($1::uuid IS NULL OR e.job_id = $1)
                  AND (cardinality($2::text[]) = 0 OR e.status = ANY($2))
                  AND ($3::timestamptz IS NULL OR (e.created_at, e.id) < ($3, $4::uuid))
                  -- By flow run: its runs' ids first (one probe), then their rows by the run index.
                  AND ($6::uuid IS NULL
                       OR e.run_id = ANY(ARRAY(SELECT n.run_id FROM flow_nodes n WHERE n.flow_run_id = $6)))
                ORDER BY e.created_at DESC, e.id DESC LIMIT $5""",
            uuid.UUID(job_id) if job_id else None,
            [status.value for status in statuses],
            cursor_time,
            cursor_id,
            size + 1,
            uuid.UUID(flow_run_id) if flow_run_id else None,
        )
        return ExecutionPage([execution_from_row(row) for row in rows[:size]], len(rows) > size, scope)

    async def history(self, job_id: str) -> list[Execution]:
        """Every attempt of a job, oldest slot first (tests, small jobs)."""
        rows = await self._pool.fetch(
            f"""SELECT {COLUMNS}, {FLOW_RUN} FROM job_executions e WHERE e.job_id = $1
                ORDER BY e.scheduled_for, e.attempt""",
            uuid.UUID(job_id),
        )
        return [execution_from_row(row) for row in rows]

    async def prune(self, older_than: datetime) -> int:
        """Drop the day partitions that end by `older_than` and hold no open run (system.cleanup;
        `PartitionRepository.drop_before`): whole days, never a DELETE of executions. Returns the
        number of executions they held (`Retention.executions`: the planner's count of an analyzed
        day). Over a pool only (each day in transactions of its own).
        """
        if not isinstance(self._pool, asyncpg.Pool):
            raise TypeError("pruning needs a pool: each day is dropped in a transaction of its own")
        return (await PartitionRepository(self._pool).drop_before(older_than)).executions


def _decode_cursor(position: list[Any]) -> tuple[datetime, uuid.UUID]:
    try:
        stamp, execution_id = position
        moment, key = datetime.fromisoformat(stamp), uuid.UUID(execution_id)
    except (ValueError, TypeError, AttributeError):
        raise InvalidArgument("page_token", "not a token this server issued") from None
    if moment.tzinfo is None:  # every issued position is aware
        raise InvalidArgument("page_token", "not a token this server issued")
    return moment, key
