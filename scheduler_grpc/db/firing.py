"""Making runs in PostgreSQL: the leader's fire (fenced by its term in the one statement) and the
API's triggers and backfills (idempotent per slot and request id).

Each is ONE statement over arrays (`unnest`), so a batch of any size costs one round trip and
commits atomically.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Sequence
from datetime import datetime
from typing import Final

import asyncpg

from scheduler_grpc.db.executions import (
    COLUMNS,
    SNAPSHOT,
    SNAPSHOT_COLUMNS,
    Advance,
    PlannedSlot,
    Queryable,
    Queued,
    TriggerOutcome,
    TriggerRequest,
    TriggerResult,
    execution_from_row,
    executions_by_id,
    ids,
    key_error_of,
    keys_of,
    new_execution_id,
    new_execution_ids,
    queued_from_row,
    resolved_limit_keys,
    snapshot,
)
from scheduler_grpc.db.leadership import Connection
from scheduler_grpc.errors import Fenced
from scheduler_grpc.executions import ExecutionStatus, Trigger

log = logging.getLogger(__name__)

# The status and end of a new run from its resolution `resolved` (see `resolved_limit_keys`):
# `dead` at once when its limit keys cannot be resolved (it never blocks a key), else `queued`.
_STATUS = "CASE WHEN jsonb_typeof(resolved) = 'string' THEN 'dead' ELSE 'queued' END"
_FINISHED = "CASE WHEN jsonb_typeof(resolved) = 'string' THEN now() END"
# A manual run's snapshot of its job `j`, with the payload its request `r` gave instead, if any.
_SNAPSHOT_OVERRIDDEN = ", ".join(
    "coalesce(r.payload, j.payload) AS payload" if column == "payload" else f"j.{column}" for column in SNAPSHOT
)


def outside_missed_ranges(job: str, slot: str) -> str:
    """SQL: `slot` lies in no `missed` range of `job` (an alias of a `jobs` row). Ranges of a job
    never overlap, so the latest one starting by the slot decides. Only a job whose latest range
    ends at or after the slot (`jobs.missed_through`, migration 0019) looks at its ranges: the
    others never read `job_executions` here, whatever plan the statement was prepared with. An OR
    is evaluated in its written order, so the look runs only when the cheap tests fail."""
    return f"""({job}.missed_through IS NULL OR {job}.missed_through < {slot} OR NOT EXISTS (
                SELECT 1 FROM (
                    SELECT m.missed_through FROM job_executions m
                    WHERE m.job_id = {job}.id AND m.final_status = 'missed' AND m.scheduled_for <= {slot}
                    ORDER BY m.scheduled_for DESC LIMIT 1
                ) AS range WHERE range.missed_through >= {slot}
            ))"""


# `FiringRepository.trigger_now`'s statement: $1 the requests' order, $2 new run ids, $3 job ids,
# $4 slots, $5 request ids, $6 traceparents, $7 payload overrides.
_TRIGGER_NOW: Final = f"""
            WITH r AS (
                -- $6 is empty (NULLs) when tracing is off, $7 when no request overrides its payload.
                SELECT * FROM unnest($1::integer[], $2::uuid[], $3::uuid[], $4::timestamptz[], $5::text[], $6::text[],
                                     $7::jsonb[])
                    AS r(ord, id, job_id, slot, request_id, trace_context, payload)
            ), eligible AS (
                SELECT r.id, r.job_id, r.slot, r.request_id, r.trace_context, j.priority, {_SNAPSHOT_OVERRIDDEN},
                       {resolved_limit_keys("j.limits", "coalesce(r.payload, j.payload)")} AS resolved
                FROM r JOIN jobs j ON j.id = r.job_id
                WHERE {outside_missed_ranges("j", "r.slot")}
            ), claimed AS (
                -- Each request id's claim (migration 0020: this statement's, not the row trigger's):
                -- a new one, or one taken over whose run does not exist (its insert was skipped on a
                -- slot collision, or its day was dropped). A claim another transaction holds
                -- uncommitted is waited for; once that commits, its run exists (seen by
                -- `execution_exists`' fresh snapshot) and the claim stays theirs.
                INSERT INTO execution_requests AS q (job_id, request_id, run_id, scheduled_for)
                SELECT job_id, request_id, id, slot FROM eligible WHERE request_id IS NOT NULL
                ORDER BY job_id, request_id
                ON CONFLICT (job_id, request_id) DO UPDATE
                    SET run_id = excluded.run_id, scheduled_for = excluded.scheduled_for
                    WHERE NOT execution_exists(q.run_id, q.scheduled_for)
                RETURNING q.run_id
            ), inserted AS (
                INSERT INTO job_executions AS e (id, run_id, job_id, scheduled_for, attempt, status, trigger, due_at,
                                                 priority, request_id, trace_context, limit_keys, error, finished_at,
                                                 {SNAPSHOT_COLUMNS})
                SELECT id, id, job_id, slot, 1, {_STATUS}, 'manual', now(), priority, request_id, trace_context,
                       {keys_of("resolved")}, {key_error_of("resolved")}, {_FINISHED}, {SNAPSHOT_COLUMNS}
                FROM eligible
                WHERE request_id IS NULL OR id IN (SELECT run_id FROM claimed)
                -- One order for every statement: two calls claiming the same request ids (or
                -- inserting the same slots) in different orders would each wait on the other's
                -- uncommitted row, a deadlock PostgreSQL breaks by failing one.
                ORDER BY job_id, request_id, slot
                ON CONFLICT DO NOTHING
                RETURNING {COLUMNS}, e.handler, e.queue, e.payload, e.limit_keys
            )
            SELECT r.ord, j.id IS NOT NULL AS job_found, el.id IS NOT NULL AS eligible, p.id AS prior_id, i.*
            FROM r
            LEFT JOIN jobs j ON j.id = r.job_id
            LEFT JOIN eligible el ON el.id = r.id
            LEFT JOIN inserted i ON i.id = r.id
            -- The statement's snapshot: a run an EARLIER call created (not one this INSERT made).
            -- Primary-key probes per request with a request id, and nothing for the others (the
            -- filter on r.request_id is checked once per request, before any scan). LIMIT: never
            -- flattened into joins, which the planner may make a hash of the whole table, every
            -- statement: a plan cached while the day's partition was empty did so for every
            -- TriggerJob, its cost growing with the day's runs.
            LEFT JOIN LATERAL (
                SELECT p.id FROM execution_requests q
                JOIN job_executions p ON p.id = q.run_id AND p.scheduled_for = q.scheduled_for
                WHERE r.request_id IS NOT NULL AND q.job_id = r.job_id AND q.request_id = r.request_id
                LIMIT 1
            ) p ON true
            ORDER BY r.ord
            """


async def _claiming(conn: Connection, args: tuple[object, ...]) -> list[asyncpg.Record]:
    """`_TRIGGER_NOW` in a transaction whose request ids the statement claims itself: the row trigger
    of migration 0016 steps aside for it (migration 0020). In a caller's transaction already, the
    trigger is back on for the rest of it afterwards."""
    outer = conn.is_in_transaction()
    async with conn.transaction():
        await conn.execute("SET LOCAL scheduler.request_claims = 'statement'")
        rows = await conn.fetch(_TRIGGER_NOW, *args)
        if outer:
            await conn.execute("SET LOCAL scheduler.request_claims = ''")
    return rows


class FiringRepository:
    """Inserts of new runs into `job_executions` (`ports.FiringStore`, `ports.TriggerStore`).

    Over a pool (each call on a connection of its own) or over the one connection of a transaction.
    """

    def __init__(self, pool: Queryable, *, scope: str = "scheduler") -> None:
        self._pool = pool
        self._scope = scope  # the leader_state scope `fire` fences on

    async def fire(self, term: int, advances: Sequence[Advance], slots: Sequence[PlannedSlot]) -> list[Queued]:
        """`fire_clocked` without the clock."""
        queued, _ = await self.fire_clocked(term, advances, slots)
        return queued

    async def fire_clocked(
        self,
        term: int,
        advances: Sequence[Advance],
        slots: Sequence[PlannedSlot],
        trace_contexts: Sequence[str | None] = (),
    ) -> tuple[list[Queued], datetime]:
        """Record planned slots and advance their jobs, atomically, under leader term `term`.

        One statement: the fence (the term must still be current; FOR SHARE makes a concurrent
        term change wait for us), the compare-and-set of each job's next_run_time (a job whose
        next_run_time moved meanwhile is left alone, and so are its slots), and the inserts
        (`ON CONFLICT DO NOTHING` on (job, slot, attempt): a slot can never fire twice; a `missed`
        range's row holds its first slot, and the compare-and-set moves next_run_time past its
        last, so no later row can be made for a slot inside it).

        Concurrency policies, over the `queued` slots of a job recorded together (several after a
        pause or with `run_all`) as well as against the runs open before the statement:
        `forbid` runs the first of them, and none if a run of the job is still open; `replace`
        runs the newest (the caller cancels the runs open before: `open_run_ids`). The others are
        recorded `skipped`: never enqueued, they were not runs to cancel, and `skipped` is what
        "not run: the concurrency policy" already reads as.

        Returns:
            The runs inserted as `queued`, to be enqueued in Redis (the outbox order: PostgreSQL
            first; if we crash before enqueueing, reconcile finds them), and the database clock as
            the statement ended: a run due later is enqueued delayed by its due time less this
            clock, which was read before the enqueue whatever the offset of the Redis clock.

        `trace_contexts`: the `traceparent` each slot's run is made under (tracing on), in the
        order of `slots`; empty (tracing off): none.

        Raises:
            Fenced: `term` is no longer the current term; nothing was written.
        """
        rows = await self._pool.fetch(
            f"""
            WITH fence AS (
                SELECT term FROM leader_state WHERE scope = $1 AND term = $2 FOR SHARE
            ), advanced AS (
                -- A job's missed_through only rises (migration 0019): to the end of its latest range.
                UPDATE jobs j SET next_run_time = a.new_next, updated_at = now(),
                                  missed_through = greatest(j.missed_through, (
                                      SELECT max(x.through) FROM unnest($6::uuid[], $10::timestamptz[], $8::text[])
                                          AS x(job_id, through, status)
                                      WHERE x.job_id = a.job_id AND x.status = 'missed'))
                FROM unnest($3::uuid[], $4::timestamptz[], $5::timestamptz[]) AS a(job_id, old_next, new_next)
                WHERE j.id = a.job_id AND j.next_run_time = a.old_next AND j.status = 'active'
                  AND EXISTS (SELECT 1 FROM fence)
                RETURNING j.id, j.priority, j.concurrency_policy, {snapshot("j")},
                          {resolved_limit_keys("j.limits", "j.payload")} AS resolved
            ), planned AS (
                -- Each run's id (and run_id) is made here: a CTE read twice is evaluated once.
                -- The EXISTS sees only rows from before this statement, so the slots of a job
                -- recorded together are weighed against each other here (the window `w`).
                SELECT uuid_v7() AS id, p.*, a.priority, {snapshot("a")}, a.resolved,
                       CASE WHEN p.status <> 'queued' THEN p.status
                            -- its limit keys cannot be resolved: the run fails, no key is blocked
                            WHEN jsonb_typeof(a.resolved) = 'string' THEN 'dead'
                            WHEN a.concurrency_policy = 'allow' THEN p.status
                            -- forbid: the statement's first slot runs, if no run was open before it
                            WHEN a.concurrency_policy = 'forbid' AND (
                                p.scheduled_for > min(p.scheduled_for) FILTER (WHERE p.status = 'queued') OVER w
                                OR EXISTS (SELECT 1 FROM job_executions o
                                           WHERE o.job_id = p.job_id AND o.finished_at IS NULL))
                            THEN 'skipped'
                            -- replace: the statement's newest slot runs (the runs open before it are
                            -- cancelled after the statement, `LeaderLoops._replace_earlier_runs`)
                            WHEN a.concurrency_policy = 'replace'
                                 AND p.scheduled_for < max(p.scheduled_for) FILTER (WHERE p.status = 'queued') OVER w
                            THEN 'skipped'
                            ELSE p.status END AS final_status
                -- unnest pads a shorter array with NULLs: $12 is empty when tracing is off.
                FROM unnest($6::uuid[], $7::timestamptz[], $8::text[], $9::timestamptz[], $10::timestamptz[],
                            $11::integer[], $12::text[]) WITH ORDINALITY
                     AS p(job_id, scheduled_for, status, due_at, missed_through, missed_count, trace_context, n)
                JOIN advanced a ON a.id = p.job_id
                WINDOW w AS (PARTITION BY p.job_id)
            ), inserted AS (
                INSERT INTO job_executions (id, run_id, job_id, scheduled_for, attempt, status, trigger, due_at,
                                            priority, term, finished_at, missed_through, missed_count,
                                            trace_context, limit_keys, error, {SNAPSHOT_COLUMNS})
                SELECT id, id, job_id, scheduled_for, 1, final_status, 'schedule', due_at, priority, $2,
                       CASE WHEN final_status = 'queued' THEN NULL ELSE now() END, missed_through, missed_count,
                       trace_context, CASE WHEN final_status = 'queued' THEN {keys_of("resolved")} END,
                       CASE WHEN final_status = 'dead' THEN {key_error_of("resolved")} END, {SNAPSHOT_COLUMNS}
                FROM planned
                ON CONFLICT DO NOTHING
                RETURNING id, job_id, scheduled_for, status, priority, due_at, limit_keys
            )
            SELECT (SELECT count(*) FROM fence) AS fenced_in, i.id, i.id AS run_id, i.job_id, i.status, i.priority,
                   i.due_at, i.scheduled_for, p.handler, p.queue, p.payload, i.limit_keys, clock_timestamp() AS clock
            FROM (SELECT 1) AS one
            LEFT JOIN inserted i ON true
            LEFT JOIN planned p ON p.id = i.id
            ORDER BY p.n  -- the planned order (the window sorted by job), which is the enqueue order
            """,
            self._scope,
            term,
            # Job ids as text: the uuid codec parses them (in C) and refuses a malformed one.
            [advance.job_id for advance in advances],
            [advance.old for advance in advances],
            [advance.new for advance in advances],
            [slot.job_id for slot in slots],
            [slot.scheduled_for for slot in slots],
            [slot.status.value for slot in slots],
            [slot.due_at for slot in slots],
            [slot.missed_through for slot in slots],
            [slot.missed_count for slot in slots],
            list(trace_contexts),
        )
        if not rows or rows[0]["fenced_in"] == 0:
            raise Fenced(f"leader term {term} is no longer current")
        queued = [
            queued_from_row(row) for row in rows if row["id"] is not None and row["status"] == ExecutionStatus.QUEUED
        ]
        if len(queued) < len(rows) and (dead := [row for row in rows if row["status"] == ExecutionStatus.DEAD]):
            log.warning(
                "%d fired runs recorded dead: their limit keys cannot be resolved", len(dead),
                extra={"job_ids": sorted({str(row["job_id"]) for row in dead})[:10]},
            )  # fmt: skip
        return queued, max(row["clock"] for row in rows)

    async def open_run_ids(self, job_ids: Sequence[str], *, excluding: Sequence[str] = ()) -> list[str]:
        """Runs of these jobs whose latest attempt is queued or running (for the `replace` policy)."""
        rows = await self._pool.fetch(
            """SELECT DISTINCT run_id FROM job_executions
               WHERE job_id = ANY($1::uuid[]) AND finished_at IS NULL AND NOT run_id = ANY($2::uuid[])""",
            ids(job_ids),
            ids(excluding),
        )
        return [str(row["run_id"]) for row in rows]

    async def trigger(
        self,
        job_id: str,
        trigger: Trigger,
        slots: Sequence[datetime],
        *,
        request_id: str | None = None,
        due_at: datetime | None = None,
    ) -> list[Queued]:
        """Create runs outside the schedule (manual trigger, backfill), idempotent per slot / request_id.

        A slot inside a `missed` range already has its record (the range's row), as it had when
        each missed slot had its own row: no run is created for it.
        """
        ids = [new_execution_id() for _ in slots]
        rows = await self._pool.fetch(
            f"""
            WITH job AS (SELECT id, priority, missed_through, {SNAPSHOT_COLUMNS},
                                {resolved_limit_keys("limits", "payload")} AS resolved
                         FROM jobs WHERE id = $1)
            INSERT INTO job_executions (id, run_id, job_id, scheduled_for, attempt, status, trigger, due_at,
                                        priority, request_id, limit_keys, error, finished_at, {SNAPSHOT_COLUMNS})
            SELECT s.id, s.id, job.id, s.slot, 1, {_STATUS}, $2, coalesce($5, now()), job.priority, $4,
                   {keys_of("job.resolved")}, {key_error_of("job.resolved")}, {_FINISHED}, {snapshot("job")}
            FROM job, unnest($3::uuid[], $6::timestamptz[]) AS s(id, slot)
            WHERE {outside_missed_ranges("job", "s.slot")}
            ON CONFLICT DO NOTHING
            RETURNING id AS run_id, job_id, scheduled_for, priority, due_at, handler, queue, payload, limit_keys,
                      status, error
            """,
            uuid.UUID(job_id),
            trigger.value,
            ids,
            request_id,
            due_at,
            list(slots),
        )
        failed = [row for row in rows if row["status"] != ExecutionStatus.QUEUED]
        if failed:
            log.warning(
                "%d runs recorded dead: their limit keys cannot be resolved: %s", len(failed), failed[0]["error"],
                extra={"job_id": job_id, "run_ids": [str(row["run_id"]) for row in failed[:10]]},
            )  # fmt: skip
        return [queued_from_row(row) for row in rows if row["status"] == ExecutionStatus.QUEUED]

    async def trigger_now(self, requests: Sequence[TriggerRequest]) -> list[TriggerResult]:
        """Create one manual run per request, for many jobs at once, in ONE statement (group commit).

        Each request is decided on its own (`TriggerOutcome`): a new run, the run an earlier call
        with the same `request_id` created (idempotency: returned, nothing created), no such job, a
        slot inside a `missed` range of its job (the range's row is its record, as in `trigger`),
        or a collision on its slot (another run of the job has the very same `scheduled_for`: the
        caller retries with another slot). The new run's first attempt comes back from the INSERT
        itself, so nothing is read again. Requests of one batch must have distinct slots per job
        and distinct `(job_id, request_id)` pairs.

        Returns:
            One result per request, in their order.
        """
        if not requests:
            return []
        try:
            rows = await self._fetch_trigger_now(requests)
        except asyncpg.ForeignKeyViolationError:
            if len(requests) > 1:
                raise  # which one is not known: the caller asks again one request at a time
            return [TriggerResult(TriggerOutcome.NO_JOB)]  # deleted between the statement's read and insert
        priors = {row["prior_id"] for row in rows if row["id"] is None and row["prior_id"] is not None}
        earlier = {e.id: e for e in await executions_by_id(self._pool, [str(i) for i in priors])} if priors else {}
        results: list[TriggerResult] = []
        for row in rows:
            if row["id"] is not None:
                # A run whose limit keys cannot be resolved is recorded dead: nothing to enqueue.
                run = queued_from_row(row) if row["status"] == ExecutionStatus.QUEUED else None
                results.append(TriggerResult(TriggerOutcome.CREATED, execution_from_row(row), run))
            elif row["prior_id"] is not None and str(row["prior_id"]) in earlier:
                results.append(TriggerResult(TriggerOutcome.REPEATED, earlier[str(row["prior_id"])]))
            elif not row["job_found"]:
                results.append(TriggerResult(TriggerOutcome.NO_JOB))
            elif not row["eligible"]:
                results.append(TriggerResult(TriggerOutcome.MISSED))
            else:
                results.append(TriggerResult(TriggerOutcome.COLLIDED))
        return results

    async def _fetch_trigger_now(self, requests: Sequence[TriggerRequest]) -> list[asyncpg.Record]:
        args = (
            list(range(len(requests))),
            new_execution_ids(len(requests)),
            [request.job_id for request in requests],  # UUID text: asyncpg encodes it without a UUID object
            [request.slot for request in requests],
            [request.request_id for request in requests],
            [request.trace_context for request in requests] if any(r.trace_context for r in requests) else [],
            [request.payload for request in requests] if any(r.payload is not None for r in requests) else [],
        )
        if all(request.request_id is None for request in requests):
            return await self._pool.fetch(_TRIGGER_NOW, *args)
        if isinstance(self._pool, asyncpg.Pool):
            async with self._pool.acquire() as conn:
                return await _claiming(conn, args)
        return await _claiming(self._pool, args)
