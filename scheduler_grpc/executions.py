"""The execution model: one row per attempt, grouped into runs (one run per slot or trigger).

A *run* travels through the Redis queue as one item whose id is the run id (the id of its first
attempt). Each attempt is its own row: a failure with retry budget left, or a worker lost mid-job,
finishes the row and adds the next attempt; so does an attempt its worker hands back on a graceful
shutdown (`interrupted`, which spends no retry budget): history is never rewritten.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from datetime import datetime
from typing import Any


class ExecutionStatus(enum.StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"  # this attempt failed; a later attempt of the run retries it
    TIMED_OUT = "timed_out"
    CANCELLED = "cancelled"
    DEAD = "dead"  # the run's last attempt: retry budget or stall limit spent; parked in the DLQ
    ABANDONED = "abandoned"  # its worker was lost (lease expired); the run goes on in a new attempt
    INTERRUPTED = "interrupted"  # its worker stopped it (graceful shutdown); a new attempt, no budget spent
    SKIPPED = "skipped"  # not run: the concurrency policy (forbid: a run was open; replace: a newer slot ran)
    # Not run: the misfire policy dropped slots missed while no leader ran. One row is a whole run
    # of such slots: scheduled_for .. missed_through, missed_count of them (None: not counted).
    MISSED = "missed"
    # Not run: in a flow run, its upstreams' outcomes can no longer meet its trigger rule.
    UPSTREAM_FAILED = "upstream_failed"

    @property
    def finished(self) -> bool:
        return self not in (ExecutionStatus.QUEUED, ExecutionStatus.RUNNING)


class DeadReason(enum.StrEnum):
    """Why an attempt ended its run `dead`, decided where the failure is judged (the worker), never
    read back from the error text (the `reason` of `scheduler_dead_lettered_total`)."""

    RETRIES_EXHAUSTED = "retries_exhausted"  # a retryable failure with no retry budget left
    PERMANENT = "permanent"  # a failure retries cannot fix (PermanentHandlerError, unknown handler)


class Trigger(enum.StrEnum):
    SCHEDULE = "schedule"
    MANUAL = "manual"
    RETRY = "retry"
    BACKFILL = "backfill"
    DLQ_REQUEUE = "dlq_requeue"
    UPSTREAM = "upstream"  # created by a flow run once its upstream runs had finished


@dataclass(frozen=True)
class BlockedBy:
    """Why a queued run waits: its group of limit keys is parked on `limit` and `key` (issue 22).

    Attributes:
        limit: The limit's name.
        key: The key.
        since: When the group was parked on it.
        reason: `concurrency` (no unit free), `rate` (the rate's next start), `paused` (by hand or
            back-pressure), `undefined` (the queue has no definition of the limit).
    """

    limit: str
    key: str
    since: datetime
    reason: str


@dataclass(frozen=True)
class Execution:
    """One attempt of a run."""

    id: str
    run_id: str
    job_id: str
    scheduled_for: datetime
    attempt: int
    status: ExecutionStatus
    trigger: Trigger
    due_at: datetime
    priority: int
    created_at: datetime
    worker_id: str | None = None
    started_at: datetime | None = None
    finished_at: datetime | None = None
    error: str | None = None
    result: Any = None
    term: int | None = None
    missed_through: datetime | None = None  # `missed` only: the last slot of the range not run
    missed_count: int | None = None  # `missed` only: slots in the range (None: not counted)
    flow_run_id: str | None = None  # the flow run (job dependencies) the run belongs to, if any
    trace_id: str | None = None  # the run's OpenTelemetry trace (None: tracing was off when it was made)
    # A queued run held back by a limit key (read from the queue by the reads that show it; never stored).
    blocked_by: BlockedBy | None = None
