"""Runs that need the leader's or an operator's hand, in PostgreSQL: the recovery scans (open,
stale and dead runs), marking runs dead, cancels, dead-letter requeues and purge marks.

The leader's writes here run inside `RecoveryRepository.fenced` (one transaction that checks its
term first), so a deposed leader changes nothing.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import replace
from datetime import timedelta

import asyncpg

from scheduler_grpc import outputs
from scheduler_grpc.db.attempts import latest_attempt
from scheduler_grpc.db.executions import (
    COLUMNS,
    LOST_WORKER_ERROR,
    SNAPSHOT_COLUMNS,
    DeadRun,
    Queryable,
    Queued,
    execution_from_row,
    ids,
    key_error_of,
    keys_of,
    queued_from_row,
    resolved_limit_keys,
    snapshot_of_run,
)
from scheduler_grpc.db.leadership import assert_current_term
from scheduler_grpc.db.runs import end_and_continue
from scheduler_grpc.executions import Execution, ExecutionStatus

_FENCED_IDLE_LIMIT = "SET LOCAL idle_in_transaction_session_timeout = '1s'"


class RecoveryRepository:
    """Recovery scans and run-level writes of `job_executions` (`ports.RecoveryStore`, `ports.CancelStore`).

    Over a pool (each call on a connection of its own) or over the one connection of a transaction.
    """

    def __init__(self, pool: Queryable, *, scope: str = "scheduler") -> None:
        self._pool = pool
        self._scope = scope  # the leader_state scope `fenced` checks

    @asynccontextmanager
    async def fenced(self, term: int) -> AsyncIterator[RecoveryRepository]:
        """A repository whose writes commit together only while `term` is the current leader term.

        The leader's writes other than `fire` (which fences itself in its one statement) run in
        here: one transaction that first checks the term FOR SHARE (`assert_current_term`), so a
        deposed leader changes nothing and a new term waits until the transaction ends. Keep the
        block to PostgreSQL calls: Redis moves belong after it, once the writes are committed.

        Raises:
            Fenced: `term` is no longer current; nothing in the block was committed.
        """
        if not isinstance(self._pool, asyncpg.Pool):
            raise TypeError("fenced() needs a repository over a pool")
        async with self._pool.acquire() as conn, conn.transaction():
            # The term check holds the leader_state row FOR SHARE until commit, which makes a new
            # leader's begin_term wait: if this process stops between statements (SIGSTOP, a
            # stalled loop), PostgreSQL ends the session after 1 s instead of blocking the election.
            await conn.execute(_FENCED_IDLE_LIMIT)
            await assert_current_term(conn, self._scope, term)
            yield RecoveryRepository(conn, scope=self._scope)

    async def open_runs(self, *, older_than: timedelta, after_run_id: str | None, limit: int) -> list[Queued]:
        """Runs whose latest attempt is `queued` (created more than `older_than` ago), by run id.

        The reconcile loop pages through these and re-enqueues the ones Redis does not know.
        """
        rows = await self._pool.fetch(
            """
            SELECT e.run_id, e.job_id, e.priority, e.due_at, coalesce(e.handler, j.handler) AS handler,
                   coalesce(e.queue, j.queue) AS queue, coalesce(e.payload, j.payload) AS payload, e.limit_keys,
                   e.scheduled_for
            FROM job_executions e JOIN jobs j ON j.id = e.job_id
            WHERE e.status = 'queued' AND e.finished_at IS NULL AND e.created_at < now() - $1::interval
              AND ($2::uuid IS NULL OR e.run_id > $2)
            ORDER BY e.run_id LIMIT $3
            """,
            older_than,
            uuid.UUID(after_run_id) if after_run_id else None,
            limit,
        )
        return [queued_from_row(row) for row in rows]

    async def abandon_expired(self, leases: Sequence[tuple[str, str]]) -> int:
        """End the attempts whose leases the queue found expired, `(run_id, lease token)`: each still
        `running` under that claim token is recorded `abandoned` (its worker is gone) and its run
        gets the next attempt, `queued`, as a worker that lost its lease records it. So a run whose
        worker vanished does not read `running` until some worker claims it again (with none
        connected, that could be never). Token-conditional, so safe from any term and to resend:
        a claim that took the run since, under a new token, is untouched. Returns how many ended."""
        return await end_and_continue(
            self._pool, leases, ExecutionStatus.ABANDONED, LOST_WORKER_ERROR, timedelta(0), by_run=True
        )

    async def stale_running_runs(self, *, grace: timedelta, limit: int) -> list[Queued]:
        """Runs `running` for longer than their job's timeout plus `grace`: their worker is gone."""
        rows = await self._pool.fetch(
            """
            SELECT e.run_id, e.job_id, e.priority, e.due_at, coalesce(e.handler, j.handler) AS handler,
                   coalesce(e.queue, j.queue) AS queue, coalesce(e.payload, j.payload) AS payload, e.limit_keys,
                   e.scheduled_for
            FROM job_executions e JOIN jobs j ON j.id = e.job_id
            WHERE e.status = 'running' AND e.finished_at IS NULL
              AND e.started_at < now() - coalesce(e.timeout, j.timeout) - $1::interval
            ORDER BY e.started_at LIMIT $2
            """,
            grace,
            limit,
        )
        return [queued_from_row(row) for row in rows]

    async def dead_runs(self, *, after_run_id: str | None, limit: int) -> list[DeadRun]:
        """Runs whose latest attempt is `dead` and not purged from the dead-letter queue, by run id.

        The reconcile loop pages through these to rebuild a dead-letter queue Redis lost. A requeued
        run has a newer attempt, and a purged one is marked (`mark_dead_letters_purged`): neither
        comes back.
        """
        rows = await self._pool.fetch(
            f"""
            SELECT e.run_id, e.job_id, e.scheduled_for, e.priority, e.due_at, e.error, e.limit_keys,
                   {snapshot_of_run("e")}
            FROM job_executions e JOIN jobs j ON j.id = e.job_id
            WHERE e.final_status = 'dead' AND e.dlq_purged_at IS NULL AND ($1::uuid IS NULL OR e.run_id > $1)
              AND e.id = {latest_attempt("e.run_id", "a.id", slot="e.scheduled_for")}
            ORDER BY e.run_id LIMIT $2
            """,
            uuid.UUID(after_run_id) if after_run_id else None,
            limit,
        )
        return [DeadRun(queued_from_row(row), row["error"] or "dead") for row in rows]

    async def mark_runs_dead(self, run_ids: Sequence[str], reason: str) -> list[Execution]:
        """The latest open attempt of each run becomes `dead` (e.g. stalled past the limit)."""
        if not run_ids:
            return []
        rows = await self._pool.fetch(
            f"""
            WITH latest AS (
                SELECT x.id
                FROM unnest($1::uuid[]) AS r(run_id) CROSS JOIN LATERAL {latest_attempt("r.run_id", lock=True)} x
                WHERE x.status IN ('queued', 'running', 'abandoned')
            )
            UPDATE job_executions e SET status = 'dead', finished_at = now(), error = $2
            FROM latest WHERE e.id = latest.id
            RETURNING {COLUMNS}
            """,
            ids(run_ids),
            outputs.bound_error(reason),
        )
        return [execution_from_row(row) for row in rows]

    async def cancel_runs(self, run_ids: Sequence[str]) -> tuple[list[Execution], list[Execution]]:
        """Cancel runs: a `queued` latest attempt becomes `cancelled` here; a `running` one is left to
        its worker, which records `cancelled` once it has stopped the handler.

        Returns:
            (attempts cancelled now, attempts running that their workers must cancel).
        """
        if not run_ids:
            return [], []
        rows = await self._pool.fetch(
            f"""
            WITH latest AS (
                SELECT x.id, x.status
                FROM unnest($1::uuid[]) AS r(run_id) CROSS JOIN LATERAL {latest_attempt("r.run_id", lock=True)} x
                WHERE x.status IN ('queued', 'running')
            ), cancelled AS (
                UPDATE job_executions e SET status = 'cancelled', finished_at = now(), error = 'cancelled'
                FROM latest WHERE e.id = latest.id AND latest.status = 'queued'
                RETURNING e.id
            ), requested AS (
                -- Persisted, so a worker that missed the pub/sub message still finds it (its poll, a claim).
                UPDATE job_executions e SET cancel_requested_at = coalesce(e.cancel_requested_at, now())
                FROM latest WHERE e.id = latest.id AND latest.status = 'running'
                RETURNING e.id
            )
            SELECT {COLUMNS}, (e.id IN (SELECT id FROM cancelled)) AS cancelled_now
            FROM job_executions e JOIN latest ON latest.id = e.id
            """,
            ids(run_ids),
        )
        now, running = [], []
        for row in rows:
            execution = execution_from_row(row)
            if row["cancelled_now"]:
                now.append(replace(execution, status=ExecutionStatus.CANCELLED))
            else:
                running.append(execution)
        return now, running

    async def requeue_runs(self, run_ids: Sequence[str]) -> list[Queued]:
        """Runs requeued from the dead-letter queue get a new `queued` attempt (trigger dlq_requeue),
        with the run's limit keys (resolved now for a run without any whose job has limits; a run
        whose keys still cannot be resolved gets a `dead` attempt instead and is not returned)."""
        if not run_ids:
            return []
        rows = await self._pool.fetch(
            f"""
            WITH latest AS (
                SELECT x.* FROM unnest($1::uuid[]) AS r(run_id)
                CROSS JOIN LATERAL {latest_attempt("r.run_id", lock=True)} x
                WHERE x.status IN ('dead', 'failed', 'timed_out', 'abandoned', 'cancelled')
            )
            INSERT INTO job_executions (id, run_id, job_id, scheduled_for, attempt, status, trigger, priority,
                                        trace_context, limit_keys, error, finished_at, {SNAPSHOT_COLUMNS})
            SELECT uuid_v7(), l.run_id, l.job_id, l.scheduled_for, l.attempt + 1,
                   CASE WHEN jsonb_typeof(r.resolved) = 'string' THEN 'dead' ELSE 'queued' END, 'dlq_requeue',
                   l.priority, l.trace_context, {keys_of("r.resolved")}, {key_error_of("r.resolved")},
                   CASE WHEN jsonb_typeof(r.resolved) = 'string' THEN now() END, {snapshot_of_run("l")}
            FROM latest l JOIN jobs j ON j.id = l.job_id
            -- The run's own keys; a run without any whose job has limits (it died because they could
            -- not be resolved, or was made before its job had limits) resolves them now, from its
            -- own payload and its job's refs as they are now: still unresolvable, it is dead again.
            CROSS JOIN LATERAL (
                SELECT coalesce(l.limit_keys, {resolved_limit_keys("j.limits", "coalesce(l.payload, j.payload)")})
                    AS resolved
            ) r
            ON CONFLICT DO NOTHING  -- a concurrent requeue of the same run added that attempt first
            RETURNING run_id, job_id, scheduled_for, priority, due_at, handler, queue, payload, limit_keys, status
            """,
            ids(run_ids),
        )
        return [queued_from_row(row) for row in rows if row["status"] == ExecutionStatus.QUEUED]

    async def mark_dead_letters_purged(self, run_ids: Sequence[str]) -> int:
        """Record that an operator purged these runs from the dead-letter queue (so no rebuild restores them)."""
        if not run_ids:
            return 0
        result = await self._pool.execute(
            """UPDATE job_executions SET dlq_purged_at = now()
               WHERE run_id = ANY($1::uuid[]) AND final_status = 'dead' AND dlq_purged_at IS NULL""",
            ids(run_ids),
        )
        return int(result.split()[-1])
