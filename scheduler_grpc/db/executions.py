"""Execution history in PostgreSQL: the records its stores share, and the SQL vocabulary of `job_executions`.

The table is written and read through four stores, each split along the role that needs it
(`scheduler_grpc.ports` names what each role relies on): `db/runs.py` (the worker's claim and
completion, the hot path), `db/firing.py` (the leader's fire and the API's triggers),
`db/recovery.py` (the leader's recovery scans, cancels, dead-letter requeue and purge marks, and
`fenced`) and `db/history.py` (reads and pruning). This module holds what they share: the records
they take and return (`Claim`, `Outcome`, `Completed`, `Queued`, ...), the column lists and the
run snapshot.

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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, TypeAlias

import asyncpg

from scheduler_grpc import outputs, pagetokens
from scheduler_grpc.db.leadership import Connection
from scheduler_grpc.executions import DeadReason, Execution, ExecutionStatus, Trigger
from scheduler_grpc.gcra import LimitKey
from scheduler_grpc.jobs import RetryPolicy
from scheduler_grpc.tracing import trace_id_of

# What a store runs its statements on: a pool (each call on a connection of its own) or the one
# connection of a transaction (its stores use only `fetch`, `fetchrow`, `fetchval` and `execute`,
# which both offer).
Queryable: TypeAlias = asyncpg.Pool | Connection

COLUMNS = """e.id, e.run_id, e.job_id, e.scheduled_for, e.attempt, e.status, e.trigger, e.due_at, e.priority,
    e.created_at, e.worker_id, e.started_at, e.finished_at, e.error, e.result, e.term, e.missed_through,
    e.missed_count, e.trace_context"""

# What the API reads of an execution: its columns plus its flow run (job dependencies), if any.
FLOW_RUN = "(SELECT n.flow_run_id FROM flow_nodes n WHERE n.run_id = e.run_id) AS flow_run_id"
MAX_PAGE_SIZE = 1000
# What a list without outputs selects (the basic view): no error, no result.
COLUMNS_WITHOUT_OUTPUT = COLUMNS.replace("e.error, e.result", "NULL::text AS error, NULL::jsonb AS result")
LOST_WORKER_ERROR = "worker lost: its lease expired before the attempt finished"
INTERRUPTED_ERROR = "interrupted: its worker stopped; the run goes on in a new attempt"
CANCELLED_ERROR = "cancelled"
REFUSED_ERROR = "the store refused its result"

# The job definition a run carries from the moment it is fired (migration 0002): the claim reads
# these from the execution row, so editing a job never changes a run already fired.
SNAPSHOT = ("handler", "payload", "queue", "timeout", "max_retries", "initial_backoff", "max_backoff", "retry_jitter")


def snapshot(alias: str) -> str:
    """`alias.handler, alias.payload, ...`: the snapshot columns of a row or of the jobs row."""
    return ", ".join(f"{alias}.{column}" for column in SNAPSHOT)


def snapshot_of_run(alias: str) -> str:
    """The snapshot of an execution row `alias`, falling back to its job `j` for rows written before
    the snapshot existed (columns named as in `SNAPSHOT`)."""
    return ", ".join(f"coalesce({alias}.{column}, j.{column}) AS {column}" for column in SNAPSHOT)


SNAPSHOT_COLUMNS = ", ".join(SNAPSHOT)


def resolved_limit_keys(refs: str, payload: str) -> str:
    """The SQL expression of a run's limit keys as the statement that makes its first attempt
    resolves them from its job's refs `refs` (jobs.limits) and its payload snapshot `payload`
    (`resolve_limit_keys`, migration 0014): NULL for a job without limits (one comparison: runs of
    jobs without limits pay nothing else), else an array of keys, or a string saying why they
    cannot be resolved (the run is recorded dead with it)."""
    return f"(CASE WHEN {refs} = '[]'::jsonb THEN NULL ELSE resolve_limit_keys({refs}, {payload}) END)"


def keys_of(resolved: str) -> str:
    """The `limit_keys` value of a resolution (NULL when it failed or there are no limits)."""
    return f"(CASE WHEN jsonb_typeof({resolved}) = 'array' THEN {resolved} END)"


def key_error_of(resolved: str) -> str:
    """Why a resolution failed (NULL when it did not)."""
    return f"(CASE WHEN jsonb_typeof({resolved}) = 'string' THEN {resolved} #>> '{{}}' END)"


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


def new_execution_ids(count: int) -> list[str]:
    """`count` ids as `new_execution_id` makes them, as 32 hex digits (asyncpg's uuid codec parses
    them in C): one clock read and one `os.urandom` for all, a third of the CPU of `count` calls."""
    high = ((time.time_ns() // 1_000_000) << 80) | (0x7 << 76) | (0b10 << 62)
    raw = os.urandom(10 * count)
    ids: list[str] = []
    for start in range(0, 10 * count, 10):
        random = int.from_bytes(raw[start : start + 10], "big")
        ids.append(f"{high | (((random >> 62) & 0xFFF) << 64) | (random & _LOW_62):032x}")
    return ids


def execution_from_row(row: asyncpg.Record) -> Execution:
    return Execution(
        id=str(row["id"]),
        run_id=str(row["run_id"]),
        job_id=str(row["job_id"]),
        scheduled_for=row["scheduled_for"],
        attempt=row["attempt"],
        status=STATUSES[row["status"]],
        trigger=TRIGGERS[row["trigger"]],
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
        trace_id=trace_id_of(row.get("trace_context")),
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
    # The limit keys the run took when it was made (`job_executions.limit_keys`); empty: none.
    limits: tuple[LimitKey, ...] = ()
    # The run's slot (the partition key): its queue item carries it to the worker's claim.
    scheduled_for: datetime | None = None


def limit_keys_from_json(value: Any) -> tuple[LimitKey, ...]:
    """A run's `limit_keys` column (`[[limit, key, units], ...]` or NULL) as queue limit keys."""
    if not value:
        return ()
    return tuple(LimitKey(str(limit), str(key), int(units)) for limit, key, units in value)


def queued_from_row(row: asyncpg.Record) -> Queued:
    """The `Queued` of a row with the run's id, job, priority, due time, handler, queue, payload
    and (if the statement selects them) its `limit_keys` and `scheduled_for`."""
    return Queued(
        str(row["run_id"]), str(row["job_id"]), row["priority"], row["due_at"], row["handler"], row["queue"],
        payload=row["payload"], limits=limit_keys_from_json(row.get("limit_keys")),
        scheduled_for=row.get("scheduled_for"),
    )  # fmt: skip


@dataclass(frozen=True)
class TriggerRequest:
    """A manual run asked for `job_id` at `slot` (its `scheduled_for`), idempotent per `request_id`."""

    job_id: str
    slot: datetime
    request_id: str | None = None
    trace_context: str | None = None  # the `traceparent` of the span that asked for the run (tracing on)
    payload: dict[str, Any] | None = None  # the run's payload instead of the job's (validated), if any


class TriggerOutcome(enum.Enum):
    """What `FiringRepository.trigger_now` made of one request."""

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
    # The `traceparent` of the span that made the run (migration 0013); None when tracing was off.
    trace_context: str | None = None
    limits: tuple[LimitKey, ...] = ()  # the run's limit keys (a rate-limited hand-back names them)

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
    # The run's slot (`Claim.scheduled_for`, the partition key): the completion then reads one
    # partition. None: found by id alone (every partition's index), as correct, slower.
    scheduled_for: datetime | None = None

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


TRIGGERS: dict[str, Trigger] = {trigger.value: trigger for trigger in Trigger}  # faster than Trigger(value)
STATUSES: dict[str, ExecutionStatus] = {status.value: status for status in ExecutionStatus}


def ids(values: Sequence[str]) -> list[uuid.UUID]:
    return [uuid.UUID(value) for value in values]

    """The uuids of these ids (the uuid codec refuses a malformed one)."""
    return [uuid.UUID(value) for value in values]


async def executions_by_id(db: Queryable, execution_ids: Sequence[str]) -> list[Execution]:
    """These executions in one query, oldest slot first; ids that do not exist are left out."""
    if not execution_ids:
        return []
    rows = await db.fetch(
        f"SELECT {COLUMNS} FROM job_executions e WHERE e.id = ANY($1::uuid[]) ORDER BY e.scheduled_for, e.id",
        ids(execution_ids),
    )
    return [execution_from_row(row) for row in rows]
