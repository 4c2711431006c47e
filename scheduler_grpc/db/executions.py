"""Execution history in PostgreSQL: one row per attempt, written in batches.

The hot paths (fire, claim, complete) are each ONE statement over arrays (`unnest`), so a batch of
any size costs one round trip and commits atomically.
"""

from __future__ import annotations

import base64
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import Any

import asyncpg
import orjson

from scheduler_grpc.db.leadership import Connection, assert_current_term
from scheduler_grpc.errors import Fenced, InvalidArgument, NotFound
from scheduler_grpc.executions import Execution, ExecutionStatus, Trigger
from scheduler_grpc.jobs import RetryPolicy

_COLUMNS = """e.id, e.run_id, e.job_id, e.scheduled_for, e.attempt, e.status, e.trigger, e.due_at, e.priority,
    e.created_at, e.worker_id, e.started_at, e.finished_at, e.error, e.result, e.term"""

MAX_PAGE_SIZE = 1000
_FENCED_IDLE_LIMIT = "SET LOCAL idle_in_transaction_session_timeout = '1s'"
LOST_WORKER_ERROR = "worker lost: its lease expired before the attempt finished"


def execution_from_row(row: asyncpg.Record) -> Execution:
    return Execution(
        id=str(row["id"]),
        run_id=str(row["run_id"]),
        job_id=str(row["job_id"]),
        scheduled_for=row["scheduled_for"],
        attempt=row["attempt"],
        status=ExecutionStatus(row["status"]),
        trigger=Trigger(row["trigger"]),
        due_at=row["due_at"],
        priority=row["priority"],
        created_at=row["created_at"],
        worker_id=row["worker_id"],
        started_at=row["started_at"],
        finished_at=row["finished_at"],
        error=row["error"],
        result=row["result"],
        term=row["term"],
    )


@dataclass(frozen=True)
class PlannedSlot:
    """A slot the scheduler decided about: `queued` (to run) or `missed` (misfire policy)."""

    job_id: str
    scheduled_for: datetime
    status: ExecutionStatus
    due_at: datetime


@dataclass(frozen=True)
class Advance:
    """Compare-and-set of one job's `next_run_time`: only from `old` (else another scan won)."""

    job_id: str
    old: datetime
    new: datetime | None


@dataclass(frozen=True)
class Queued:
    """A run that is ready to be enqueued in Redis."""

    run_id: str
    job_id: str
    priority: int
    due_at: datetime
    handler: str
    queue: str
    breaker_key: str = ""


@dataclass(frozen=True)
class DeadRun:
    """A run whose latest attempt is `dead` and that no operator purged: it belongs in the DLQ."""

    run: Queued
    reason: str


@dataclass(frozen=True)
class Claim:
    """An attempt a worker now owns, with what it needs to run it."""

    run_id: str
    execution_id: str
    job_id: str
    job_name: str
    attempt: int
    scheduled_for: datetime
    started_at: datetime
    handler: str
    payload: dict[str, Any]
    timeout: timedelta
    retry: RetryPolicy
    queue: str
    due_at: datetime | None = None


@dataclass(frozen=True)
class Outcome:
    """How an attempt ended, as the worker reports it.

    `retry_after` set: the run gets a new `queued` attempt due that long after this one is recorded
    (the worker decided the budget allows it).
    """

    execution_id: str
    claim_token: str
    status: ExecutionStatus
    error: str | None = None
    result: Any = None
    retry_after: timedelta | None = None


@dataclass(frozen=True)
class Completed:
    execution_id: str
    run_id: str
    job_id: str
    attempt: int
    status: ExecutionStatus
    retry_execution_id: str | None


@dataclass(frozen=True)
class ExecutionPage:
    executions: list[Execution]
    next_page_token: str


def _ids(values: Sequence[str]) -> list[uuid.UUID]:
    return [uuid.UUID(value) for value in values]


class ExecutionRepository:
    """Reads and batched writes of `job_executions`.

    Over a pool (each call on a connection of its own) or, inside `fenced`, over the one connection
    of a transaction (its methods use only `fetch`, `fetchrow`, `fetchval` and `execute`, which both
    offer).
    """

    def __init__(self, pool: asyncpg.Pool | Connection, *, scope: str = "scheduler") -> None:
        self._pool = pool
        self._scope = scope

    @asynccontextmanager
    async def fenced(self, term: int) -> AsyncIterator[ExecutionRepository]:
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
            yield ExecutionRepository(conn, scope=self._scope)

    async def fire(self, term: int, advances: Sequence[Advance], slots: Sequence[PlannedSlot]) -> list[Queued]:
        """Record planned slots and advance their jobs, atomically, under leader term `term`.

        One statement: the fence (the term must still be current; FOR SHARE makes a concurrent
        term change wait for us), the compare-and-set of each job's next_run_time (a job whose
        next_run_time moved meanwhile is left alone, and so are its slots), and the inserts
        (`ON CONFLICT DO NOTHING` on (job, slot, attempt): a slot can never fire twice). A job with
        `concurrency_policy = forbid` and a run still open records the slot as `skipped`.

        Returns:
            The runs inserted as `queued`, to be enqueued in Redis (the outbox order: PostgreSQL
            first; if we crash before enqueueing, reconcile finds them).

        Raises:
            Fenced: `term` is no longer the current term; nothing was written.
        """
        ids = [uuid.uuid4() for _ in slots]
        rows = await self._pool.fetch(
            """
            WITH fence AS (
                SELECT term FROM leader_state WHERE scope = $1 AND term = $2 FOR SHARE
            ), advanced AS (
                UPDATE jobs j SET next_run_time = a.new_next, updated_at = now()
                FROM unnest($3::uuid[], $4::timestamptz[], $5::timestamptz[]) AS a(job_id, old_next, new_next)
                WHERE j.id = a.job_id AND j.next_run_time = a.old_next AND j.status = 'active'
                  AND EXISTS (SELECT 1 FROM fence)
                RETURNING j.id, j.priority, j.concurrency_policy, j.handler, j.queue
            ), planned AS (
                SELECT p.*, a.priority, a.handler, a.queue,
                       CASE WHEN p.status = 'queued' AND a.concurrency_policy = 'forbid' AND EXISTS (
                                SELECT 1 FROM job_executions o
                                WHERE o.job_id = p.job_id AND o.status IN ('queued', 'running'))
                            THEN 'skipped' ELSE p.status END AS final_status
                FROM unnest($6::uuid[], $7::uuid[], $8::timestamptz[], $9::text[], $10::timestamptz[])
                     AS p(id, job_id, scheduled_for, status, due_at)
                JOIN advanced a ON a.id = p.job_id
            ), inserted AS (
                INSERT INTO job_executions (id, run_id, job_id, scheduled_for, attempt, status, trigger, due_at,
                                            priority, term, finished_at)
                SELECT id, id, job_id, scheduled_for, 1, final_status, 'schedule', due_at, priority, $2,
                       CASE WHEN final_status = 'queued' THEN NULL ELSE now() END
                FROM planned
                ON CONFLICT DO NOTHING
                RETURNING id, job_id, status, priority, due_at
            )
            SELECT (SELECT count(*) FROM fence) AS fenced_in, i.id, i.job_id, i.status, i.priority, i.due_at,
                   p.handler, p.queue
            FROM (SELECT 1) AS one
            LEFT JOIN inserted i ON true
            LEFT JOIN planned p ON p.id = i.id
            """,
            self._scope,
            term,
            _ids([advance.job_id for advance in advances]),
            [advance.old for advance in advances],
            [advance.new for advance in advances],
            ids,
            _ids([slot.job_id for slot in slots]),
            [slot.scheduled_for for slot in slots],
            [slot.status.value for slot in slots],
            [slot.due_at for slot in slots],
        )
        if not rows or rows[0]["fenced_in"] == 0:
            raise Fenced(f"leader term {term} is no longer current")
        return [
            Queued(str(row["id"]), str(row["job_id"]), row["priority"], row["due_at"], row["handler"], row["queue"])
            for row in rows
            if row["id"] is not None and row["status"] == ExecutionStatus.QUEUED
        ]

    async def trigger(
        self,
        job_id: str,
        trigger: Trigger,
        slots: Sequence[datetime],
        *,
        request_id: str | None = None,
        due_at: datetime | None = None,
    ) -> list[Queued]:
        """Create runs outside the schedule (manual trigger, backfill), idempotent per slot / request_id."""
        ids = [uuid.uuid4() for _ in slots]
        rows = await self._pool.fetch(
            """
            WITH job AS (SELECT id, priority, handler, queue FROM jobs WHERE id = $1)
            INSERT INTO job_executions (id, run_id, job_id, scheduled_for, attempt, status, trigger, due_at,
                                        priority, request_id)
            SELECT s.id, s.id, job.id, s.slot, 1, 'queued', $2, coalesce($5, now()), job.priority, $4
            FROM job, unnest($3::uuid[], $6::timestamptz[]) AS s(id, slot)
            ON CONFLICT DO NOTHING
            RETURNING id, job_id, priority, due_at,
                      (SELECT handler FROM job) AS handler, (SELECT queue FROM job) AS queue
            """,
            uuid.UUID(job_id),
            trigger.value,
            ids,
            request_id,
            due_at,
            list(slots),
        )
        return [
            Queued(str(row["id"]), str(row["job_id"]), row["priority"], row["due_at"], row["handler"], row["queue"])
            for row in rows
        ]

    async def claim(self, items: Sequence[tuple[str, str]], worker_id: str) -> list[Claim]:
        """Claim the current attempt of each run `(run_id, lease_token)` for `worker_id`.

        The lease token becomes the attempt's claim token; only it can complete the attempt. Per run,
        the latest attempt decides:

        * `queued` -> it becomes `running` under this token;
        * `running` under another token (its worker lost the lease) or `abandoned` -> that attempt
          is recorded `abandoned` and a new attempt starts `running` under this token;
        * `running` under this token -> returned again (a repeated claim is harmless);
        * finished, or no row (job deleted) -> nothing: the caller acks the item away.
        """
        if not items:
            return []
        rows = await self._pool.fetch(
            """
            WITH items AS (
                SELECT * FROM unnest($1::uuid[], $2::text[]) AS i(run_id, token)
            ), latest AS (
                SELECT x.id, x.run_id, x.job_id, x.scheduled_for, x.attempt, x.status, x.claim_token,
                       x.priority, x.started_at, x.due_at, i.token
                FROM items i CROSS JOIN LATERAL (
                    SELECT * FROM job_executions e WHERE e.run_id = i.run_id
                    ORDER BY e.attempt DESC LIMIT 1 FOR UPDATE
                ) x
            ), started AS (
                UPDATE job_executions e SET status = 'running', claim_token = l.token, worker_id = $3,
                       started_at = now()
                FROM latest l WHERE e.id = l.id AND l.status = 'queued'
                RETURNING e.id, e.run_id, e.job_id, e.scheduled_for, e.attempt, e.started_at, e.due_at
            ), abandoned AS (
                UPDATE job_executions e SET status = 'abandoned', finished_at = now(), error = $4
                FROM latest l WHERE e.id = l.id AND l.status = 'running' AND l.claim_token <> l.token
                RETURNING e.id
            ), restarted AS (
                INSERT INTO job_executions (id, run_id, job_id, scheduled_for, attempt, status, trigger, priority,
                                            claim_token, worker_id, started_at)
                SELECT gen_random_uuid(), l.run_id, l.job_id, l.scheduled_for, l.attempt + 1, 'running', 'retry',
                       l.priority, l.token, $3, now()
                FROM latest l
                WHERE l.status = 'abandoned' OR (l.status = 'running' AND l.claim_token <> l.token)
                RETURNING id, run_id, job_id, scheduled_for, attempt, started_at, due_at
            ), claimed AS (
                SELECT * FROM started
                UNION ALL SELECT * FROM restarted
                UNION ALL SELECT l.id, l.run_id, l.job_id, l.scheduled_for, l.attempt, l.started_at, l.due_at
                          FROM latest l WHERE l.status = 'running' AND l.claim_token = l.token
            )
            SELECT c.id, c.run_id, c.job_id, c.scheduled_for, c.attempt, c.started_at, c.due_at, j.name, j.handler,
                   j.payload, j.timeout, j.max_retries, j.initial_backoff, j.max_backoff, j.retry_jitter, j.queue,
                   (SELECT count(*) FROM abandoned) AS abandoned
            FROM claimed c JOIN jobs j ON j.id = c.job_id
            """,
            _ids([run_id for run_id, _ in items]),
            [token for _, token in items],
            worker_id,
            LOST_WORKER_ERROR,
        )
        return [
            Claim(
                run_id=str(row["run_id"]),
                execution_id=str(row["id"]),
                job_id=str(row["job_id"]),
                job_name=row["name"],
                attempt=row["attempt"],
                scheduled_for=row["scheduled_for"],
                started_at=row["started_at"],
                handler=row["handler"],
                payload=row["payload"],
                timeout=row["timeout"],
                retry=RetryPolicy(row["max_retries"], row["initial_backoff"], row["max_backoff"], row["retry_jitter"]),
                queue=row["queue"],
                due_at=row["due_at"],
            )
            for row in rows
        ]

    async def complete(self, outcomes: Sequence[Outcome]) -> list[Completed]:
        """Record how attempts ended; each only under its claim token and while still `running`.

        An attempt whose worker lost its lease (someone else's claim abandoned it) changes nothing:
        it is simply absent from the result. Outcomes with `retry_after` add the next attempt, `queued`.
        """
        if not outcomes:
            return []
        rows = await self._pool.fetch(
            """
            WITH r AS (
                SELECT * FROM unnest($1::uuid[], $2::text[], $3::text[], $4::text[], $5::text[], $6::interval[])
                    AS r(id, token, status, error, result, retry_after)
            ), done AS (
                UPDATE job_executions e SET status = r.status, finished_at = now(), error = r.error,
                       result = r.result::jsonb
                FROM r WHERE e.id = r.id AND e.claim_token = r.token AND e.status = 'running'
                RETURNING e.id, e.run_id, e.job_id, e.scheduled_for, e.attempt, e.priority, e.status, r.retry_after
            ), retried AS (
                INSERT INTO job_executions (id, run_id, job_id, scheduled_for, attempt, status, trigger, due_at,
                                            priority)
                SELECT gen_random_uuid(), d.run_id, d.job_id, d.scheduled_for, d.attempt + 1, 'queued', 'retry',
                       now() + d.retry_after, d.priority
                FROM done d WHERE d.retry_after IS NOT NULL
                ON CONFLICT DO NOTHING
                RETURNING id, run_id
            )
            SELECT d.id, d.run_id, d.job_id, d.attempt, d.status, t.id AS retry_id
            FROM done d LEFT JOIN retried t ON t.run_id = d.run_id
            """,
            _ids([outcome.execution_id for outcome in outcomes]),
            [outcome.claim_token for outcome in outcomes],
            [outcome.status.value for outcome in outcomes],
            [outcome.error[:8000] if outcome.error else None for outcome in outcomes],
            [orjson.dumps(outcome.result).decode() if outcome.result is not None else None for outcome in outcomes],
            [outcome.retry_after for outcome in outcomes],
        )
        return [
            Completed(
                execution_id=str(row["id"]),
                run_id=str(row["run_id"]),
                job_id=str(row["job_id"]),
                attempt=row["attempt"],
                status=ExecutionStatus(row["status"]),
                retry_execution_id=str(row["retry_id"]) if row["retry_id"] else None,
            )
            for row in rows
        ]

    async def release(self, items: Sequence[tuple[str, str]]) -> int:
        """Hand claimed, unstarted-or-interrupted attempts back: `running` -> `queued` under their token.

        Used on graceful shutdown so the run goes straight back to the queue without a new attempt.
        """
        if not items:
            return 0
        result = await self._pool.execute(
            """UPDATE job_executions e SET status = 'queued', claim_token = NULL, worker_id = NULL,
                      started_at = NULL
               FROM unnest($1::uuid[], $2::text[]) AS r(id, token)
               WHERE e.id = r.id AND e.claim_token = r.token AND e.status = 'running'""",
            _ids([execution_id for execution_id, _ in items]),
            [token for _, token in items],
        )
        return int(result.split()[-1])

    async def abandon(self, items: Sequence[tuple[str, str]]) -> int:
        """A worker that lost its lease gives up attempts `(execution_id, claim_token)`.

        Each still `running` under that token is recorded `abandoned` and its run gets the next
        attempt, `queued`: whoever holds the run's queue item now claims that attempt, and if Redis
        lost the item altogether, reconcile enqueues it again.
        """
        if not items:
            return 0
        rows = await self._pool.fetch(
            """
            WITH gone AS (
                UPDATE job_executions e SET status = 'abandoned', finished_at = now(), error = $3
                FROM unnest($1::uuid[], $2::text[]) AS r(id, token)
                WHERE e.id = r.id AND e.claim_token = r.token AND e.status = 'running'
                RETURNING e.run_id, e.job_id, e.scheduled_for, e.attempt, e.priority
            )
            INSERT INTO job_executions (id, run_id, job_id, scheduled_for, attempt, status, trigger, priority)
            SELECT gen_random_uuid(), run_id, job_id, scheduled_for, attempt + 1, 'queued', 'retry', priority
            FROM gone
            ON CONFLICT DO NOTHING
            RETURNING id
            """,
            _ids([execution_id for execution_id, _ in items]),
            [token for _, token in items],
            LOST_WORKER_ERROR,
        )
        return len(rows)

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
                SELECT x.id, x.status FROM unnest($1::uuid[]) AS r(run_id) CROSS JOIN LATERAL (
                    SELECT id, status FROM job_executions e WHERE e.run_id = r.run_id
                    ORDER BY attempt DESC LIMIT 1 FOR UPDATE) x
                WHERE x.status IN ('queued', 'running')
            ), cancelled AS (
                UPDATE job_executions e SET status = 'cancelled', finished_at = now(), error = 'cancelled'
                FROM latest WHERE e.id = latest.id AND latest.status = 'queued'
                RETURNING e.id
            )
            SELECT {_COLUMNS}, (e.id IN (SELECT id FROM cancelled)) AS cancelled_now
            FROM job_executions e JOIN latest ON latest.id = e.id
            """,
            _ids(run_ids),
        )
        now, running = [], []
        for row in rows:
            execution = execution_from_row(row)
            if row["cancelled_now"]:
                now.append(replace(execution, status=ExecutionStatus.CANCELLED))
            else:
                running.append(execution)
        return now, running

    async def open_run_ids(self, job_ids: Sequence[str], *, excluding: Sequence[str] = ()) -> list[str]:
        """Runs of these jobs whose latest attempt is queued or running (for the `replace` policy)."""
        rows = await self._pool.fetch(
            """SELECT DISTINCT run_id FROM job_executions
               WHERE job_id = ANY($1::uuid[]) AND status IN ('queued', 'running') AND NOT run_id = ANY($2::uuid[])""",
            _ids(job_ids),
            _ids(excluding),
        )
        return [str(row["run_id"]) for row in rows]

    async def mark_runs_dead(self, run_ids: Sequence[str], reason: str) -> list[Execution]:
        """The latest open attempt of each run becomes `dead` (e.g. stalled past the limit)."""
        if not run_ids:
            return []
        rows = await self._pool.fetch(
            f"""
            WITH latest AS (
                SELECT x.id FROM unnest($1::uuid[]) AS r(run_id) CROSS JOIN LATERAL (
                    SELECT id, status FROM job_executions e WHERE e.run_id = r.run_id
                    ORDER BY attempt DESC LIMIT 1 FOR UPDATE) x
                WHERE x.status IN ('queued', 'running', 'abandoned')
            )
            UPDATE job_executions e SET status = 'dead', finished_at = now(), error = $2
            FROM latest WHERE e.id = latest.id
            RETURNING {_COLUMNS}
            """,
            _ids(run_ids),
            reason,
        )
        return [execution_from_row(row) for row in rows]

    async def requeue_runs(self, run_ids: Sequence[str]) -> list[Queued]:
        """Runs requeued from the dead-letter queue get a new `queued` attempt (trigger dlq_requeue)."""
        if not run_ids:
            return []
        rows = await self._pool.fetch(
            """
            WITH latest AS (
                SELECT x.* FROM unnest($1::uuid[]) AS r(run_id) CROSS JOIN LATERAL (
                    SELECT * FROM job_executions e WHERE e.run_id = r.run_id
                    ORDER BY attempt DESC LIMIT 1) x
                WHERE x.status IN ('dead', 'failed', 'timed_out', 'abandoned', 'cancelled')
            )
            INSERT INTO job_executions (id, run_id, job_id, scheduled_for, attempt, status, trigger, priority)
            SELECT gen_random_uuid(), l.run_id, l.job_id, l.scheduled_for, l.attempt + 1, 'queued', 'dlq_requeue',
                   l.priority
            FROM latest l
            RETURNING run_id, job_id, priority, due_at,
                      (SELECT handler FROM jobs WHERE id = job_id), (SELECT queue FROM jobs WHERE id = job_id)
            """,
            _ids(run_ids),
        )
        return [
            Queued(str(row["run_id"]), str(row["job_id"]), row["priority"], row["due_at"], row[4], row[5])
            for row in rows
        ]

    async def open_runs(self, *, older_than: timedelta, after_run_id: str | None, limit: int) -> list[Queued]:
        """Runs whose latest attempt is `queued` (created more than `older_than` ago), by run id.

        The reconcile loop pages through these and re-enqueues the ones Redis does not know.
        """
        rows = await self._pool.fetch(
            """
            SELECT e.run_id, e.job_id, e.priority, e.due_at, j.handler, j.queue
            FROM job_executions e JOIN jobs j ON j.id = e.job_id
            WHERE e.status = 'queued' AND e.created_at < now() - $1::interval
              AND ($2::uuid IS NULL OR e.run_id > $2)
            ORDER BY e.run_id LIMIT $3
            """,
            older_than,
            uuid.UUID(after_run_id) if after_run_id else None,
            limit,
        )
        return [
            Queued(str(row["run_id"]), str(row["job_id"]), row["priority"], row["due_at"], row["handler"], row["queue"])
            for row in rows
        ]

    async def stale_running_runs(self, *, grace: timedelta, limit: int) -> list[Queued]:
        """Runs `running` for longer than their job's timeout plus `grace`: their worker is gone."""
        rows = await self._pool.fetch(
            """
            SELECT e.run_id, e.job_id, e.priority, e.due_at, j.handler, j.queue
            FROM job_executions e JOIN jobs j ON j.id = e.job_id
            WHERE e.status = 'running' AND e.started_at < now() - j.timeout - $1::interval
            ORDER BY e.started_at LIMIT $2
            """,
            grace,
            limit,
        )
        return [
            Queued(str(row["run_id"]), str(row["job_id"]), row["priority"], row["due_at"], row["handler"], row["queue"])
            for row in rows
        ]

    async def dead_runs(self, *, after_run_id: str | None, limit: int) -> list[DeadRun]:
        """Runs whose latest attempt is `dead` and not purged from the dead-letter queue, by run id.

        The reconcile loop pages through these to rebuild a dead-letter queue Redis lost. A requeued
        run has a newer attempt, and a purged one is marked (`mark_dead_letters_purged`): neither
        comes back.
        """
        rows = await self._pool.fetch(
            """
            SELECT e.run_id, e.job_id, e.priority, e.due_at, e.error, j.handler, j.queue
            FROM job_executions e JOIN jobs j ON j.id = e.job_id
            WHERE e.status = 'dead' AND e.dlq_purged_at IS NULL AND ($1::uuid IS NULL OR e.run_id > $1)
              AND NOT EXISTS (SELECT 1 FROM job_executions n WHERE n.run_id = e.run_id AND n.attempt > e.attempt)
            ORDER BY e.run_id LIMIT $2
            """,
            uuid.UUID(after_run_id) if after_run_id else None,
            limit,
        )
        return [
            DeadRun(
                Queued(str(r["run_id"]), str(r["job_id"]), r["priority"], r["due_at"], r["handler"], r["queue"]),
                r["error"] or "dead",
            )
            for r in rows
        ]

    async def mark_dead_letters_purged(self, run_ids: Sequence[str]) -> int:
        """Record that an operator purged these runs from the dead-letter queue (so no rebuild restores them)."""
        if not run_ids:
            return 0
        result = await self._pool.execute(
            """UPDATE job_executions SET dlq_purged_at = now()
               WHERE run_id = ANY($1::uuid[]) AND status = 'dead' AND dlq_purged_at IS NULL""",
            _ids(run_ids),
        )
        return int(result.split()[-1])

    async def get(self, execution_id: str) -> Execution:
        try:
            key = uuid.UUID(execution_id)
        except ValueError:
            raise InvalidArgument("id", f"{execution_id!r} is not a valid id") from None
        row = await self._pool.fetchrow(f"SELECT {_COLUMNS} FROM job_executions e WHERE e.id = $1", key)
        if row is None:
            raise NotFound(f"execution {execution_id} not found")
        return execution_from_row(row)

    async def get_by_request_id(self, job_id: str, request_id: str) -> Execution:
        """The first attempt of the run a `trigger(..., request_id=...)` created (idempotent TriggerJob).

        Raises:
            NotFound: no run of this job was created with this request id.
        """
        row = await self._pool.fetchrow(
            f"SELECT {_COLUMNS} FROM job_executions e WHERE e.job_id = $1 AND e.request_id = $2",
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
    ) -> ExecutionPage:
        """Newest first; by job (served by the (job_id, scheduled_for, attempt) index) or overall."""
        if not 0 <= page_size <= MAX_PAGE_SIZE:
            raise InvalidArgument("page_size", f"must be between 0 and {MAX_PAGE_SIZE}")
        size = page_size or 100
        cursor_time, cursor_id = _decode_cursor(page_token) if page_token else (None, None)
        rows = await self._pool.fetch(
            f"""SELECT {_COLUMNS} FROM job_executions e
                WHERE ($1::uuid IS NULL OR e.job_id = $1)
                  AND (cardinality($2::text[]) = 0 OR e.status = ANY($2))
                  AND ($3::timestamptz IS NULL OR (e.created_at, e.id) < ($3, $4::uuid))
                ORDER BY e.created_at DESC, e.id DESC LIMIT $5""",
            uuid.UUID(job_id) if job_id else None,
            [status.value for status in statuses],
            cursor_time,
            cursor_id,
            size + 1,
        )
        executions = [execution_from_row(row) for row in rows[:size]]
        token = ""
        if len(rows) > size:
            last = executions[-1]
            token = _encode_cursor(last.created_at, last.id)
        return ExecutionPage(executions, token)

    async def history(self, job_id: str) -> list[Execution]:
        """Every attempt of a job, oldest slot first (tests, small jobs)."""
        rows = await self._pool.fetch(
            f"SELECT {_COLUMNS} FROM job_executions e WHERE e.job_id = $1 ORDER BY e.scheduled_for, e.attempt",
            uuid.UUID(job_id),
        )
        return [execution_from_row(row) for row in rows]

    async def prune(self, older_than: datetime) -> int:
        """Delete finished attempts that finished before `older_than` (system.cleanup)."""
        result = await self._pool.execute(
            "DELETE FROM job_executions WHERE finished_at < $1 AND status NOT IN ('queued', 'running')",
            older_than,
        )
        return int(result.split()[-1])


def _encode_cursor(created_at: datetime, execution_id: str) -> str:
    return base64.urlsafe_b64encode(f"{created_at.isoformat()}|{execution_id}".encode()).decode()


def _decode_cursor(token: str) -> tuple[datetime, uuid.UUID]:
    try:
        stamp, execution_id = base64.urlsafe_b64decode(token.encode()).decode().split("|")
        return datetime.fromisoformat(stamp), uuid.UUID(execution_id)
    except (ValueError, UnicodeDecodeError):
        raise InvalidArgument("page_token", "not a token this server issued") from None
