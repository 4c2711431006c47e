"""Execution history in PostgreSQL: one row per attempt, written in batches.

The hot paths (fire, claim, complete) are each ONE statement over arrays (`unnest`), so a batch of
any size costs one round trip and commits atomically.

No index reads a column the claim changes (status, claim_token, worker_id, started_at), so the claim
is a HOT update (migration 0009). Queries that need an index therefore say "open" as
`finished_at IS NULL` (equivalent to `status IN ('queued', 'running')` by a CHECK) and look up a
finished status through the generated `final_status` column (NULL while open).
"""

from __future__ import annotations

import enum
import os
import time
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from typing import Any

import asyncpg
import orjson

from scheduler_grpc import outputs, pagetokens
from scheduler_grpc.db import faults
from scheduler_grpc.db.attempts import latest_attempt
from scheduler_grpc.db.leadership import Connection, assert_current_term
from scheduler_grpc.errors import Fenced, InvalidArgument, NotFound
from scheduler_grpc.executions import DeadReason, Execution, ExecutionStatus, Trigger
from scheduler_grpc.jobs import RetryPolicy

_COLUMNS = """e.id, e.run_id, e.job_id, e.scheduled_for, e.attempt, e.status, e.trigger, e.due_at, e.priority,
    e.created_at, e.worker_id, e.started_at, e.finished_at, e.error, e.result, e.term, e.missed_through,
    e.missed_count"""

# What the API reads of an execution: its columns plus its flow run (job dependencies), if any.
_FLOW_RUN = "(SELECT n.flow_run_id FROM flow_nodes n WHERE n.run_id = e.run_id) AS flow_run_id"
MAX_PAGE_SIZE = 1000
# What a list without outputs selects (the basic view): no error, no result.
_COLUMNS_WITHOUT_OUTPUT = _COLUMNS.replace("e.error, e.result", "NULL::text AS error, NULL::jsonb AS result")
_FENCED_IDLE_LIMIT = "SET LOCAL idle_in_transaction_session_timeout = '1s'"
LOST_WORKER_ERROR = "worker lost: its lease expired before the attempt finished"
INTERRUPTED_ERROR = "interrupted: its worker stopped; the run goes on in a new attempt"
CANCELLED_ERROR = "cancelled"
REFUSED_ERROR = "the store refused its result"

# The job definition a run carries from the moment it is fired (migration 0002): the claim reads
# these from the execution row, so editing a job never changes a run already fired.
_SNAPSHOT = ("handler", "payload", "queue", "timeout", "max_retries", "initial_backoff", "max_backoff", "retry_jitter")


def _snapshot(alias: str) -> str:
    """`alias.handler, alias.payload, ...`: the snapshot columns of a row or of the jobs row."""
    return ", ".join(f"{alias}.{column}" for column in _SNAPSHOT)


def _snapshot_of_run(alias: str) -> str:
    """The snapshot of an execution row `alias`, falling back to its job `j` for rows written before
    the snapshot existed (columns named as in `_SNAPSHOT`)."""
    return ", ".join(f"coalesce({alias}.{column}, j.{column}) AS {column}" for column in _SNAPSHOT)


_SNAPSHOT_COLUMNS = ", ".join(_SNAPSHOT)


_LOW_62 = (1 << 62) - 1


def new_execution_id() -> uuid.UUID:
    """A time-ordered execution id (UUID version 7, as `uuid_v7()` in SQL, migration 0009): 48 bits
    of Unix milliseconds, the version, 74 random bits and the variant. New rows' index entries then
    land on the rightmost leaves of the primary key and run index, not on random ones."""
    random = int.from_bytes(os.urandom(10), "big")  # 12 bits before the variant, 62 after it
    milliseconds = time.time_ns() // 1_000_000
    return uuid.UUID(
        int=(milliseconds << 80) | (0x7 << 76) | (((random >> 62) & 0xFFF) << 64) | (0b10 << 62) | (random & _LOW_62)
    )


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
        # .get: not every statement that builds an Execution selects the range columns.
        missed_through=row.get("missed_through"),
        missed_count=row.get("missed_count"),
        flow_run_id=str(row["flow_run_id"]) if row.get("flow_run_id") is not None else None,
    )


@dataclass(frozen=True)
class PlannedSlot:
    """A slot the scheduler decided about: `queued` (to run) or `missed` (misfire policy).

    A `missed` slot is a range of slots not run (migration 0004): from `scheduled_for` through
    `missed_through`, `missed_count` slots (None: not counted).
    """

    job_id: str
    scheduled_for: datetime
    status: ExecutionStatus
    due_at: datetime
    missed_through: datetime | None = None
    missed_count: int | None = None


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
    payload: dict[str, Any] | None = None  # the run's snapshot, for its breaker key (dispatch.queue_item)


def _queued(row: asyncpg.Record) -> Queued:
    return Queued(
        str(row["run_id"]), str(row["job_id"]), row["priority"], row["due_at"], row["handler"], row["queue"],
        payload=row["payload"],
    )  # fmt: skip


@dataclass(frozen=True)
class TriggerRequest:
    """A manual run asked for `job_id` at `slot` (its `scheduled_for`), idempotent per `request_id`."""

    job_id: str
    slot: datetime
    request_id: str | None = None


class TriggerOutcome(enum.Enum):
    """What `ExecutionRepository.trigger_now` made of one request."""

    CREATED = "created"  # a new run: `execution` is its first attempt, `run` what to enqueue
    REPEATED = "repeated"  # an earlier call with this request_id created `execution`'s run
    NO_JOB = "no_job"
    MISSED = "missed"  # the slot lies inside a `missed` range of the job: no run for it
    COLLIDED = "collided"  # another run of the job has this very slot (or request_id, uncommitted)


@dataclass(frozen=True)
class TriggerResult:
    outcome: TriggerOutcome
    execution: Execution | None = None
    run: Queued | None = None


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
    # The database clock as the claim statement read it, after the claim's writes (only in a claim
    # with reservations, else None): a reserved attempt (`claim(reserved=...)`) starts when
    # `started_at - clock` has passed since the reply.
    clock: datetime | None = None
    interrupted: int = 0  # earlier attempts of the run that were interrupted (they spend no retry budget)
    trigger: Trigger = Trigger.SCHEDULE  # what created this attempt (a backfill's slot lies in the past)
    # In a flow run: each upstream job's result by job name (the handler's `upstream_results`).
    upstream_results: Mapping[str, Any] = field(default_factory=dict)

    @property
    def budget_attempt(self) -> int:
        """This attempt's number as the retry budget counts it: interrupted attempts excluded."""
        return self.attempt - self.interrupted


@dataclass(frozen=True)
class Outcome:
    """How an attempt ended, as the worker reports it.

    `retry_after` set: the run gets a new `queued` attempt due that long after this one is recorded
    (the worker decided the budget allows it). `dead_reason`: why a `dead` outcome is dead (None
    for any other status; a `dead` outcome without one counts as permanent).
    """

    execution_id: str
    claim_token: str
    status: ExecutionStatus
    error: str | None = None
    result: Any = None
    retry_after: timedelta | None = None
    # When the handler really started, if the claim could not know it (a reserved attempt, claimed
    # ahead): the completion writes it as the attempt's `started_at`. None keeps the claim's.
    started_at: datetime | None = None
    dead_reason: DeadReason | None = None

    def __post_init__(self) -> None:
        # Bounded where it is made, so the row and the events built from it carry the same text.
        if self.error is not None:
            object.__setattr__(self, "error", outputs.bound_error(self.error))


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
    """Up to a page of executions; `has_more` when more follow the last one."""

    executions: list[Execution]
    has_more: bool
    scope: dict[str, Any]

    def token_after(self, execution: Execution) -> str:
        """The token of the page that starts after `execution` (a caller may cut a page short)."""
        assert execution.created_at is not None  # stored executions have one
        return pagetokens.encode("executions", self.scope, [execution.created_at.isoformat(), execution.id])

    @property
    def next_page_token(self) -> str:
        return self.token_after(self.executions[-1]) if self.has_more and self.executions else ""


_TRIGGERS: dict[str, Trigger] = {trigger.value: trigger for trigger in Trigger}  # faster than Trigger(value)
_STATUSES: dict[str, ExecutionStatus] = {status.value: status for status in ExecutionStatus}


def _encoded(outcome: Outcome) -> tuple[Outcome, str | None]:
    """An outcome with its result as JSON text; one whose result orjson cannot encode is refused."""
    if outcome.result is None:
        return outcome, None
    try:
        return outcome, orjson.dumps(outcome.result).decode()
    except orjson.JSONEncodeError as exc:
        return _refused(outcome, str(exc)), None


def _refused(outcome: Outcome, reason: str) -> Outcome:
    """The outcome recorded in place of one whose values the store refused: `dead` (the values
    would be refused again on any retry), without its result."""
    return Outcome(outcome.execution_id, outcome.claim_token, ExecutionStatus.DEAD,
                   error=f"{REFUSED_ERROR}: {reason}", started_at=outcome.started_at,
                   dead_reason=DeadReason.PERMANENT)  # fmt: skip


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
        """`fire_clocked` without the clock."""
        queued, _ = await self.fire_clocked(term, advances, slots)
        return queued

    async def fire_clocked(
        self, term: int, advances: Sequence[Advance], slots: Sequence[PlannedSlot]
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

        Raises:
            Fenced: `term` is no longer the current term; nothing was written.
        """
        rows = await self._pool.fetch(
            f"""
            WITH fence AS (
                SELECT term FROM leader_state WHERE scope = $1 AND term = $2 FOR SHARE
            ), advanced AS (
                UPDATE jobs j SET next_run_time = a.new_next, updated_at = now()
                FROM unnest($3::uuid[], $4::timestamptz[], $5::timestamptz[]) AS a(job_id, old_next, new_next)
                WHERE j.id = a.job_id AND j.next_run_time = a.old_next AND j.status = 'active'
                  AND EXISTS (SELECT 1 FROM fence)
                RETURNING j.id, j.priority, j.concurrency_policy, {_snapshot("j")}
            ), planned AS (
                -- Each run's id (and run_id) is made here: a CTE read twice is evaluated once.
                -- The EXISTS sees only rows from before this statement, so the slots of a job
                -- recorded together are weighed against each other here (the window `w`).
                SELECT uuid_v7() AS id, p.*, a.priority, {_snapshot("a")},
                       CASE WHEN p.status <> 'queued' OR a.concurrency_policy = 'allow' THEN p.status
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
                FROM unnest($6::uuid[], $7::timestamptz[], $8::text[], $9::timestamptz[], $10::timestamptz[],
                            $11::integer[]) WITH ORDINALITY
                     AS p(job_id, scheduled_for, status, due_at, missed_through, missed_count, n)
                JOIN advanced a ON a.id = p.job_id
                WINDOW w AS (PARTITION BY p.job_id)
            ), inserted AS (
                INSERT INTO job_executions (id, run_id, job_id, scheduled_for, attempt, status, trigger, due_at,
                                            priority, term, finished_at, missed_through, missed_count,
                                            {_SNAPSHOT_COLUMNS})
                SELECT id, id, job_id, scheduled_for, 1, final_status, 'schedule', due_at, priority, $2,
                       CASE WHEN final_status = 'queued' THEN NULL ELSE now() END, missed_through, missed_count,
                       {_SNAPSHOT_COLUMNS}
                FROM planned
                ON CONFLICT DO NOTHING
                RETURNING id, job_id, status, priority, due_at
            )
            SELECT (SELECT count(*) FROM fence) AS fenced_in, i.id, i.id AS run_id, i.job_id, i.status, i.priority,
                   i.due_at, p.handler, p.queue, p.payload, clock_timestamp() AS clock
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
        )
        if not rows or rows[0]["fenced_in"] == 0:
            raise Fenced(f"leader term {term} is no longer current")
        queued = [_queued(row) for row in rows if row["id"] is not None and row["status"] == ExecutionStatus.QUEUED]
        return queued, max(row["clock"] for row in rows)

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
            WITH job AS (SELECT id, priority, {_SNAPSHOT_COLUMNS} FROM jobs WHERE id = $1)
            INSERT INTO job_executions (id, run_id, job_id, scheduled_for, attempt, status, trigger, due_at,
                                        priority, request_id, {_SNAPSHOT_COLUMNS})
            SELECT s.id, s.id, job.id, s.slot, 1, 'queued', $2, coalesce($5, now()), job.priority, $4,
                   {_snapshot("job")}
            FROM job, unnest($3::uuid[], $6::timestamptz[]) AS s(id, slot)
            WHERE NOT EXISTS (  -- ranges of a job never overlap: the latest one starting by the slot
                SELECT 1 FROM (
                    SELECT m.missed_through FROM job_executions m
                    WHERE m.job_id = job.id AND m.final_status = 'missed' AND m.scheduled_for <= s.slot
                    ORDER BY m.scheduled_for DESC LIMIT 1
                ) AS range WHERE range.missed_through >= s.slot
            )
            ON CONFLICT DO NOTHING
            RETURNING id AS run_id, job_id, priority, due_at, handler, queue, payload
            """,
            uuid.UUID(job_id),
            trigger.value,
            ids,
            request_id,
            due_at,
            list(slots),
        )
        return [_queued(row) for row in rows]

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
        earlier = {e.id: e for e in await self.get_many([str(i) for i in priors])} if priors else {}
        results: list[TriggerResult] = []
        for row in rows:
            if row["id"] is not None:
                results.append(TriggerResult(TriggerOutcome.CREATED, execution_from_row(row), _queued(row)))
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
        return await self._pool.fetch(
            f"""
            WITH r AS (
                SELECT * FROM unnest($1::integer[], $2::uuid[], $3::uuid[], $4::timestamptz[], $5::text[])
                    AS r(ord, id, job_id, slot, request_id)
            ), eligible AS (
                SELECT r.id, r.job_id, r.slot, r.request_id, j.priority, {_snapshot("j")}
                FROM r JOIN jobs j ON j.id = r.job_id
                WHERE NOT EXISTS (  -- ranges of a job never overlap: the latest one starting by the slot
                    SELECT 1 FROM (
                        SELECT m.missed_through FROM job_executions m
                        WHERE m.job_id = r.job_id AND m.final_status = 'missed' AND m.scheduled_for <= r.slot
                        ORDER BY m.scheduled_for DESC LIMIT 1
                    ) AS range WHERE range.missed_through >= r.slot
                )
            ), inserted AS (
                INSERT INTO job_executions AS e (id, run_id, job_id, scheduled_for, attempt, status, trigger, due_at,
                                                 priority, request_id, {_SNAPSHOT_COLUMNS})
                SELECT id, id, job_id, slot, 1, 'queued', 'manual', now(), priority, request_id, {_SNAPSHOT_COLUMNS}
                FROM eligible
                ON CONFLICT DO NOTHING
                RETURNING {_COLUMNS}, e.handler, e.queue, e.payload
            )
            SELECT r.ord, j.id IS NOT NULL AS job_found, el.id IS NOT NULL AS eligible, p.id AS prior_id, i.*
            FROM r
            LEFT JOIN jobs j ON j.id = r.job_id
            LEFT JOIN eligible el ON el.id = r.id
            LEFT JOIN inserted i ON i.id = r.id
            -- The statement's snapshot: a run an EARLIER call created (not one this INSERT made).
            LEFT JOIN job_executions p ON p.job_id = r.job_id AND p.request_id = r.request_id
            ORDER BY r.ord
            """,
            list(range(len(requests))),
            [new_execution_id() for _ in requests],
            [uuid.UUID(request.job_id) for request in requests],
            [request.slot for request in requests],
            [request.request_id for request in requests],
        )

    async def upstream_results(self, run_ids: Sequence[str]) -> dict[str, dict[str, Any]]:
        """For runs a flow run created: each upstream node's result by job name (None where its run
        has none, e.g. it failed), by run id; runs outside any flow run are absent. One statement
        for a claimed batch: the worker asks only for runs no schedule, trigger or backfill made."""
        if not run_ids:
            return {}
        rows = await self._pool.fetch(
            f"""SELECT me.run_id, j.name, x.result
               FROM flow_nodes me JOIN flow_nodes u ON u.flow_run_id = me.flow_run_id
                                                   AND u.job_id = ANY(me.upstream_ids)
               JOIN jobs j ON j.id = u.job_id
               LEFT JOIN LATERAL {latest_attempt("u.run_id", "a.result")} x ON true
               WHERE me.run_id = ANY($1::uuid[])""",
            _ids(run_ids),
        )
        found: dict[str, dict[str, Any]] = {}
        for row in rows:
            found.setdefault(str(row["run_id"]), {})[row["name"]] = row["result"]
        return found

    async def claim(
        self, items: Sequence[tuple[str, str]], worker_id: str, *, reserved: Sequence[bool] = ()
    ) -> list[Claim]:
        """Claim the current attempt of each run `(run_id, lease_token)` for `worker_id`.

        `reserved` flags items a worker reserved ahead of their due time (one flag per item; empty:
        none): their attempt's `started_at` is the expected start, the later of the database clock
        and the attempt's `due_at`, and the worker starts it when `Claim.clock` reaches that (the
        completion then writes the real start, `Outcome.started_at`). Others start `now()`.

        The lease token becomes the attempt's claim token; only it can complete the attempt. Per run,
        the latest attempt decides:

        * `queued` -> it becomes `running` under this token;
        * `running` under another token (its worker lost the lease) or `abandoned` -> that attempt
          is recorded `abandoned` and a new attempt starts `running` under this token;
        * `running` under this token -> returned again (a repeated claim is harmless);
        * finished, or no row (job deleted) -> nothing: the caller acks the item away;
        * `running` under another token with a cancel requested -> recorded `cancelled`, nothing
          restarts: the cancel request outlives the worker that was to honour it.

        What to run comes from the run's own snapshot of its job (see migration 0002), not from the
        job as it is now.
        """
        if not items:
            return []
        rows = await self._pool.fetch(
            f"""
            WITH items AS (
                -- Ids travel as text both ways: cheaper for the client than uuid objects.
                -- `reserve` is NULL (not reserved) for every item when $6 is empty.
                SELECT * FROM unnest($1::text[]::uuid[], $2::text[], $6::bool[]) AS i(run_id, token, reserve)
            ), latest AS (
                SELECT x.id, x.run_id, x.job_id, x.scheduled_for, x.attempt, x.status, x.claim_token,
                       x.priority, x.started_at, x.due_at, x.trigger, x.cancel_requested_at, i.token, i.reserve,
                       {_snapshot("x")}
                FROM items i CROSS JOIN LATERAL {latest_attempt("i.run_id", lock=True)} x
            ), started AS (
                UPDATE job_executions e SET status = 'running', claim_token = l.token, worker_id = $3,
                       started_at = CASE WHEN l.reserve THEN greatest(clock_timestamp(), l.due_at) ELSE now() END
                FROM latest l WHERE e.id = l.id AND l.status = 'queued'
                RETURNING e.id, e.run_id, e.job_id, e.scheduled_for, e.attempt, e.started_at, e.due_at, e.trigger,
                          {_snapshot("e")}
            ), abandoned AS (
                UPDATE job_executions e
                SET status = CASE WHEN l.cancel_requested_at IS NULL THEN 'abandoned' ELSE 'cancelled' END,
                    finished_at = now(), error = CASE WHEN l.cancel_requested_at IS NULL THEN $4 ELSE $5 END,
                    started_at = least(l.started_at, now())  -- a reserved attempt taken over before its start
                FROM latest l WHERE e.id = l.id AND l.status = 'running' AND l.claim_token <> l.token
                RETURNING e.id
            ), restarted AS (
                INSERT INTO job_executions (id, run_id, job_id, scheduled_for, attempt, status, trigger, priority,
                                            claim_token, worker_id, started_at, {_SNAPSHOT_COLUMNS})
                SELECT uuid_v7(), l.run_id, l.job_id, l.scheduled_for, l.attempt + 1, 'running', 'retry',
                       l.priority, l.token, $3,
                       CASE WHEN l.reserve THEN greatest(clock_timestamp(), l.due_at) ELSE now() END,
                       {_snapshot("l")}
                FROM latest l
                WHERE l.status = 'abandoned'
                   OR (l.status = 'running' AND l.claim_token <> l.token AND l.cancel_requested_at IS NULL)
                -- The old holder may have ended the attempt and added the next one while we waited for
                -- its row lock (abandon, release): that attempt is not in our snapshot. Then the run
                -- is simply not claimed here (the caller acks the item; reconcile enqueues the attempt).
                ON CONFLICT DO NOTHING
                RETURNING id, run_id, job_id, scheduled_for, attempt, started_at, due_at, trigger, {_SNAPSHOT_COLUMNS}
            ), claimed AS (
                SELECT * FROM started
                UNION ALL SELECT * FROM restarted
                UNION ALL SELECT l.id, l.run_id, l.job_id, l.scheduled_for, l.attempt, l.started_at, l.due_at,
                                 l.trigger, {_snapshot("l")}
                          FROM latest l WHERE l.status = 'running' AND l.claim_token = l.token
            )
            SELECT c.id::text, c.run_id::text, c.job_id::text, c.scheduled_for, c.attempt, c.started_at, c.due_at,
                   c.trigger, j.name,
                   {_snapshot_of_run("c")},
                   CASE WHEN c.attempt = 1 THEN 0  -- a first attempt has no earlier ones: no probe
                        ELSE (SELECT count(*) FROM job_executions p
                              WHERE p.run_id = c.run_id AND p.status = 'interrupted') END AS interrupted,
                   (SELECT count(*) FROM abandoned) AS abandoned,
                   -- Read last, after the writes: a reserved attempt's wait counted from it errs late
                   -- (by the reply's transfer), never early. Only for a batch with reservations.
                   CASE WHEN cardinality($6::bool[]) > 0 THEN clock_timestamp() END AS clock
            FROM claimed c JOIN jobs j ON j.id = c.job_id
            """,
            [run_id for run_id, _ in items],
            [token for _, token in items],
            worker_id,
            LOST_WORKER_ERROR,
            CANCELLED_ERROR,
            list(reserved),
        )
        return [
            Claim(
                run_id=row["run_id"],
                execution_id=row["id"],
                job_id=row["job_id"],
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
                clock=row["clock"],
                interrupted=row["interrupted"],
                trigger=_TRIGGERS[row["trigger"]],
            )
            for row in rows
        ]

    async def complete(self, outcomes: Sequence[Outcome], *, resent: bool = True) -> list[Completed]:
        """Record how attempts ended; each only under its claim token and while still `running`.

        An attempt whose worker lost its lease (someone else's claim abandoned it) changes nothing:
        it is simply absent from the result. Outcomes with `retry_after` add the next attempt, `queued`.
        Safe to repeat: an outcome already recorded under the same token is reported again, as long
        as `resent` is true (the default). A caller sending outcomes for the first time may pass
        False to skip looking for earlier recordings (one index probe per outcome).

        A value the store refuses (a result orjson cannot encode, or one PostgreSQL refuses: a CHECK,
        a NUL character) fails only the outcome that carried it: that attempt is recorded `dead`
        with `REFUSED_ERROR` (its result dropped) and reported with that status, and the batch's
        other outcomes are recorded as they are (after such a refusal, one statement each).
        """
        if not outcomes:
            return []
        encoded = [_encoded(outcome) for outcome in outcomes]
        try:
            async with self._savepoint():
                return await self._complete(encoded, resent)
        except asyncpg.PostgresError as exc:
            if not faults.is_request_error(exc):
                raise
            if len(encoded) > 1:
                # Perhaps one outcome's data, not the statement: again one by one, so only it fails.
                return [done for outcome, _ in encoded for done in await self.complete([outcome], resent=resent)]
            outcome, _ = encoded[0]
            if outcome.result is None:
                raise  # refused without a result (or without it already): not the data, a bug
            async with self._savepoint():
                return await self._complete([(_refused(outcome, str(exc)), None)], resent)

    @asynccontextmanager
    async def _savepoint(self) -> AsyncIterator[None]:
        """A statement that may be refused, under a savepoint when this repository works inside a
        transaction (so the transaction survives the refusal); as is over a pool."""
        if isinstance(self._pool, asyncpg.Pool):
            yield
        else:
            async with self._pool.transaction():
                yield

    async def _complete(self, encoded: Sequence[tuple[Outcome, str | None]], resent: bool) -> list[Completed]:
        outcomes = [outcome for outcome, _ in encoded]
        rows = await self._pool.fetch(
            f"""
            WITH r AS MATERIALIZED (
                -- `running` is a column, not a constant, so the planner cannot use `status =
                -- 'running'` to scan the table (its statistics often count no running rows, and a
                -- sequential scan of the whole history per batch would follow): each outcome
                -- finds its row by primary key.
                SELECT *, 'running'::text AS running
                FROM unnest($1::text[]::uuid[], $2::text[], $3::text[], $4::text[], $5::text[], $6::interval[],
                            $8::timestamptz[])
                    AS r(id, token, status, error, result, retry_after, started_at)
            ), done AS (
                UPDATE job_executions e SET status = r.status, finished_at = now(), error = r.error,
                       result = r.result::jsonb, started_at = coalesce(r.started_at, e.started_at)
                FROM r WHERE e.id = r.id AND e.claim_token = r.token AND e.status = r.running
                RETURNING e.id, e.run_id, e.job_id, e.scheduled_for, e.attempt, e.priority, e.status, r.retry_after,
                          e.cancel_requested_at
            ), retried AS (
                -- A run whose cancel was requested meanwhile is not retried: the cancel wins. The
                -- snapshot comes from the attempt's row as the statement's snapshot shows it (the
                -- completion does not change it), read only for the few outcomes that retry.
                INSERT INTO job_executions (id, run_id, job_id, scheduled_for, attempt, status, trigger, due_at,
                                            priority, {_SNAPSHOT_COLUMNS})
                SELECT uuid_v7(), d.run_id, d.job_id, d.scheduled_for, d.attempt + 1, 'queued', 'retry',
                       now() + d.retry_after, d.priority, {_snapshot("p")}
                FROM done d JOIN job_executions p ON p.id = d.id
                WHERE d.retry_after IS NOT NULL AND d.cancel_requested_at IS NULL
                ON CONFLICT DO NOTHING
                RETURNING id, run_id
            ), again AS (
                -- The same outcome sent again because the reply of a committed first try was lost
                -- (the worker retries a failed write): report it again instead of "lease lost".
                -- The statement's snapshot shows rows `done` updates as still running: no overlap.
                SELECT e.id, e.run_id, e.job_id, e.attempt, e.status,
                       (SELECT n.id FROM job_executions n
                        WHERE n.run_id = e.run_id AND n.attempt = e.attempt + 1 AND n.trigger = 'retry') AS retry_id
                FROM r JOIN job_executions e ON e.id = r.id AND e.claim_token = r.token AND e.status = r.status
                WHERE $7
            )
            -- A retry's id comes as a row of its own (no id, the run id and the retry id), joined to
            -- its outcome here: a join in SQL rescans `retried` once per outcome.
            SELECT d.id::text, d.run_id::text, d.job_id::text, d.attempt, d.status, NULL::text AS retry_id FROM done d
            UNION ALL SELECT NULL, run_id::text, NULL, NULL, NULL, id::text FROM retried
            UNION ALL SELECT id::text, run_id::text, job_id::text, attempt, status, retry_id::text FROM again
            """,
            [outcome.execution_id for outcome in outcomes],
            [outcome.claim_token for outcome in outcomes],
            [outcome.status.value for outcome in outcomes],
            [outcome.error for outcome in outcomes],
            [result for _, result in encoded],
            [outcome.retry_after for outcome in outcomes],
            resent,
            [outcome.started_at for outcome in outcomes],
        )
        retries = {row["run_id"]: row["retry_id"] for row in rows if row["id"] is None}
        return [
            Completed(
                execution_id=row["id"],
                run_id=row["run_id"],
                job_id=row["job_id"],
                attempt=row["attempt"],
                status=_STATUSES[row["status"]],
                retry_execution_id=row["retry_id"] or retries.get(row["run_id"]),
            )
            for row in rows
            if row["id"] is not None
        ]

    async def release(
        self,
        items: Sequence[tuple[str, str]],
        *,
        reason: str = INTERRUPTED_ERROR,
        delay: timedelta = timedelta(0),
    ) -> int:
        """Hand claimed attempts `(execution_id, claim_token)` back without an outcome of their own.

        Each still `running` under its token is recorded `interrupted` (history is never rewritten:
        its worker, start and end stay on the row) and its run gets the next attempt, `queued`, due
        after `delay`, with the same snapshot. An interruption is not the handler's failure: it
        spends no retry budget (`Claim.budget_attempt`). A run whose cancel was requested is
        recorded `cancelled` instead, with no next attempt.

        Used on graceful shutdown (attempts the grace period did not let finish) and when a
        claimed run's breaker turns out to be open.

        Returns:
            How many attempts were handed back.
        """
        return await self._end_and_continue(items, ExecutionStatus.INTERRUPTED, reason, delay)

    async def unclaim(self, items: Sequence[tuple[str, str]]) -> dict[str, ExecutionStatus]:
        """Undo the claims of reserved attempts `(execution_id, claim_token)` that never started.

        Each still `running` under its token goes back to `queued` as if never claimed (no worker,
        no token, no start): the same attempt, so no attempt and no retry budget is spent, and the
        next claim of its queue item takes it. One whose cancel was requested is recorded
        `cancelled` instead (it never ran, so it has no start either).

        Returns:
            By execution id, the status each attempt now has (`queued` or `cancelled`); attempts
            no longer running under the token (lease lost, finished) are absent.
        """
        if not items:
            return {}
        rows = await self._pool.fetch(
            """
            UPDATE job_executions e
            SET status = CASE WHEN e.cancel_requested_at IS NULL THEN 'queued' ELSE 'cancelled' END,
                finished_at = CASE WHEN e.cancel_requested_at IS NULL THEN NULL ELSE now() END,
                error = CASE WHEN e.cancel_requested_at IS NULL THEN NULL ELSE $3 END,
                claim_token = NULL, worker_id = NULL, started_at = NULL
            FROM unnest($1::uuid[], $2::text[]) AS r(id, token)
            WHERE e.id = r.id AND e.claim_token = r.token AND e.status = 'running'
            RETURNING e.id::text, e.status
            """,
            _ids([execution_id for execution_id, _ in items]),
            [token for _, token in items],
            CANCELLED_ERROR,
        )
        return {row["id"]: _STATUSES[row["status"]] for row in rows}

    async def cancel_requested(self, execution_ids: Sequence[str]) -> list[str]:
        """Which of these attempts are still `running` with a cancel requested (the worker's poll)."""
        if not execution_ids:
            return []
        rows = await self._pool.fetch(
            """SELECT id FROM job_executions
               WHERE id = ANY($1::uuid[]) AND cancel_requested_at IS NOT NULL AND finished_at IS NULL
                 AND status = 'running'""",
            _ids(execution_ids),
        )
        return [str(row["id"]) for row in rows]

    async def abandon(self, items: Sequence[tuple[str, str]]) -> int:
        """A worker that lost its lease gives up attempts `(execution_id, claim_token)`.

        Each still `running` under that token is recorded `abandoned` and its run gets the next
        attempt, `queued`: whoever holds the run's queue item now claims that attempt, and if Redis
        lost the item altogether, reconcile enqueues it again.
        """
        return await self._end_and_continue(items, ExecutionStatus.ABANDONED, LOST_WORKER_ERROR, timedelta(0))

    async def _end_and_continue(
        self, items: Sequence[tuple[str, str]], status: ExecutionStatus, error: str, delay: timedelta
    ) -> int:
        """End attempts `(execution_id, claim_token)` still `running` under their token with `status`
        (`cancelled` instead where a cancel was requested) and give each run its next attempt,
        `queued`, due after `delay`, with the same snapshot. Returns how many attempts ended."""
        if not items:
            return 0
        rows = await self._pool.fetch(
            f"""
            WITH gone AS (
                UPDATE job_executions e
                SET status = CASE WHEN e.cancel_requested_at IS NULL THEN $3 ELSE 'cancelled' END,
                    finished_at = now(), error = CASE WHEN e.cancel_requested_at IS NULL THEN $4 ELSE $5 END,
                    -- A reserved attempt ended before its expected start (its lease lost while
                    -- held) did not start later than now.
                    started_at = least(e.started_at, now())
                FROM unnest($1::uuid[], $2::text[]) AS r(id, token)
                WHERE e.id = r.id AND e.claim_token = r.token AND e.status = 'running'
                RETURNING e.run_id, e.job_id, e.scheduled_for, e.attempt, e.priority, e.status, {_snapshot("e")}
            ), next AS (
                INSERT INTO job_executions (id, run_id, job_id, scheduled_for, attempt, status, trigger, due_at,
                                            priority, {_SNAPSHOT_COLUMNS})
                SELECT uuid_v7(), g.run_id, g.job_id, g.scheduled_for, g.attempt + 1, 'queued', 'retry',
                       now() + $6::interval, g.priority, {_snapshot("g")}
                FROM gone g WHERE g.status = $3
                ON CONFLICT DO NOTHING
                RETURNING id
            )
            SELECT (SELECT count(*) FROM gone) AS ended
            """,
            _ids([execution_id for execution_id, _ in items]),
            [token for _, token in items],
            status.value,
            outputs.bound_error(error),
            CANCELLED_ERROR,
            delay,
        )
        return int(rows[0]["ended"])

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
               WHERE job_id = ANY($1::uuid[]) AND finished_at IS NULL AND NOT run_id = ANY($2::uuid[])""",
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
                SELECT x.id
                FROM unnest($1::uuid[]) AS r(run_id) CROSS JOIN LATERAL {latest_attempt("r.run_id", lock=True)} x
                WHERE x.status IN ('queued', 'running', 'abandoned')
            )
            UPDATE job_executions e SET status = 'dead', finished_at = now(), error = $2
            FROM latest WHERE e.id = latest.id
            RETURNING {_COLUMNS}
            """,
            _ids(run_ids),
            outputs.bound_error(reason),
        )
        return [execution_from_row(row) for row in rows]

    async def requeue_runs(self, run_ids: Sequence[str]) -> list[Queued]:
        """Runs requeued from the dead-letter queue get a new `queued` attempt (trigger dlq_requeue)."""
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
                                        {_SNAPSHOT_COLUMNS})
            SELECT uuid_v7(), l.run_id, l.job_id, l.scheduled_for, l.attempt + 1, 'queued', 'dlq_requeue',
                   l.priority, {_snapshot_of_run("l")}
            FROM latest l JOIN jobs j ON j.id = l.job_id
            ON CONFLICT DO NOTHING  -- a concurrent requeue of the same run added that attempt first
            RETURNING run_id, job_id, priority, due_at, handler, queue, payload
            """,
            _ids(run_ids),
        )
        return [_queued(row) for row in rows]

    async def open_runs(self, *, older_than: timedelta, after_run_id: str | None, limit: int) -> list[Queued]:
        """Runs whose latest attempt is `queued` (created more than `older_than` ago), by run id.

        The reconcile loop pages through these and re-enqueues the ones Redis does not know.
        """
        rows = await self._pool.fetch(
            """
            SELECT e.run_id, e.job_id, e.priority, e.due_at, coalesce(e.handler, j.handler) AS handler,
                   coalesce(e.queue, j.queue) AS queue, coalesce(e.payload, j.payload) AS payload
            FROM job_executions e JOIN jobs j ON j.id = e.job_id
            WHERE e.status = 'queued' AND e.finished_at IS NULL AND e.created_at < now() - $1::interval
              AND ($2::uuid IS NULL OR e.run_id > $2)
            ORDER BY e.run_id LIMIT $3
            """,
            older_than,
            uuid.UUID(after_run_id) if after_run_id else None,
            limit,
        )
        return [_queued(row) for row in rows]

    async def stale_running_runs(self, *, grace: timedelta, limit: int) -> list[Queued]:
        """Runs `running` for longer than their job's timeout plus `grace`: their worker is gone."""
        rows = await self._pool.fetch(
            """
            SELECT e.run_id, e.job_id, e.priority, e.due_at, coalesce(e.handler, j.handler) AS handler,
                   coalesce(e.queue, j.queue) AS queue, coalesce(e.payload, j.payload) AS payload
            FROM job_executions e JOIN jobs j ON j.id = e.job_id
            WHERE e.status = 'running' AND e.finished_at IS NULL
              AND e.started_at < now() - coalesce(e.timeout, j.timeout) - $1::interval
            ORDER BY e.started_at LIMIT $2
            """,
            grace,
            limit,
        )
        return [_queued(row) for row in rows]

    async def dead_runs(self, *, after_run_id: str | None, limit: int) -> list[DeadRun]:
        """Runs whose latest attempt is `dead` and not purged from the dead-letter queue, by run id.

        The reconcile loop pages through these to rebuild a dead-letter queue Redis lost. A requeued
        run has a newer attempt, and a purged one is marked (`mark_dead_letters_purged`): neither
        comes back.
        """
        rows = await self._pool.fetch(
            f"""
            SELECT e.run_id, e.job_id, e.priority, e.due_at, e.error, {_snapshot_of_run("e")}
            FROM job_executions e JOIN jobs j ON j.id = e.job_id
            WHERE e.final_status = 'dead' AND e.dlq_purged_at IS NULL AND ($1::uuid IS NULL OR e.run_id > $1)
              AND e.id = {latest_attempt("e.run_id", "a.id")}
            ORDER BY e.run_id LIMIT $2
            """,
            uuid.UUID(after_run_id) if after_run_id else None,
            limit,
        )
        return [DeadRun(_queued(row), row["error"] or "dead") for row in rows]

    async def mark_dead_letters_purged(self, run_ids: Sequence[str]) -> int:
        """Record that an operator purged these runs from the dead-letter queue (so no rebuild restores them)."""
        if not run_ids:
            return 0
        result = await self._pool.execute(
            """UPDATE job_executions SET dlq_purged_at = now()
               WHERE run_id = ANY($1::uuid[]) AND final_status = 'dead' AND dlq_purged_at IS NULL""",
            _ids(run_ids),
        )
        return int(result.split()[-1])

    async def get(self, execution_id: str) -> Execution:
        try:
            key = uuid.UUID(execution_id)
        except ValueError:
            raise InvalidArgument("id", f"{execution_id!r} is not a valid id") from None
        row = await self._pool.fetchrow(f"SELECT {_COLUMNS}, {_FLOW_RUN} FROM job_executions e WHERE e.id = $1", key)
        if row is None:
            raise NotFound(f"execution {execution_id} not found")
        return execution_from_row(row)

    async def get_many(self, execution_ids: Sequence[str]) -> list[Execution]:
        """These executions in one query, oldest slot first; ids that do not exist are left out."""
        if not execution_ids:
            return []
        rows = await self._pool.fetch(
            f"SELECT {_COLUMNS} FROM job_executions e WHERE e.id = ANY($1::uuid[]) ORDER BY e.scheduled_for, e.id",
            _ids(execution_ids),
        )
        return [execution_from_row(row) for row in rows]

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
            f"""SELECT {_COLUMNS if with_output else _COLUMNS_WITHOUT_OUTPUT}, {_FLOW_RUN} FROM job_executions e
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
            f"""SELECT {_COLUMNS}, {_FLOW_RUN} FROM job_executions e WHERE e.job_id = $1
                ORDER BY e.scheduled_for, e.attempt""",
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


def _decode_cursor(position: list[Any]) -> tuple[datetime, uuid.UUID]:
    try:
        stamp, execution_id = position
        moment, key = datetime.fromisoformat(stamp), uuid.UUID(execution_id)
    except (ValueError, TypeError, AttributeError):
        raise InvalidArgument("page_token", "not a token this server issued") from None
    if moment.tzinfo is None:  # every issued position is aware
        raise InvalidArgument("page_token", "not a token this server issued")
    return moment, key
