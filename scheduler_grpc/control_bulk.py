"""Bulk actions on executions and jobs, by explicit ids or by filter (the console's bulk bar and the
API's Batch* methods).

Every action works in batches of `db.bulk.BATCH` rows per statement (and per Redis script), and on
at most `MAX_BULK` items per request: a filter matching more is refused with INVALID_ARGUMENT (narrow
it, or repeat). A filter is pinned when the action starts: only executions created before that
moment are touched, so runs fired meanwhile are not swept up by a "cancel everything queued".
Actions are not atomic across batches (AIP-233's non-atomic batch): each batch commits on its own and
the outcome counts what was done. With `validate_only` nothing changes and the outcome says how many
the filter matches now (the console's confirmation).

What each action does to a run:
* cancel: its queued or running latest attempt is cancelled (as CancelExecution); finished runs are
  left as they are.
* retry: a run whose latest attempt ended failed, timed out, cancelled or abandoned gets a new queued
  attempt (trigger `dlq_requeue`, as a dead-letter requeue); a dead run is requeued from its queue's
  dead-letter queue. Runs that succeeded, or are still open, are left as they are.
* requeue: like retry, for dead runs only (the dead-letter queue's bulk requeue).
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from enum import StrEnum
from typing import Final

from scheduler_grpc import metrics, redaction
from scheduler_grpc.auth import Role
from scheduler_grpc.db.bulk import BATCH, MAX_NAME_MATCHES, BulkQueries, ExecutionFilter
from scheduler_grpc.db.bulk import JobFilter as JobFilter  # noqa: PLC0414  (re-exported: the doors see no db)
from scheduler_grpc.db.executions import Queued
from scheduler_grpc.errors import InvalidArgument
from scheduler_grpc.executions import Execution, ExecutionStatus
from scheduler_grpc.jobs import Job, JobStatus

MAX_BULK: Final = 10_000
_OVER_THE_CAP: Final = f"matches more than {MAX_BULK} executions; narrow it (e.g. a time range)"
"""Most executions or jobs one bulk request acts on."""
MAX_IDS: Final = 1000
"""Most ids one bulk request may list explicitly (a larger set is a filter)."""


class ExecutionAction(StrEnum):
    """What a bulk action does to the runs of the executions selected."""

    CANCEL = "cancel"
    RETRY = "retry"
    REQUEUE = "requeue"


class JobAction(StrEnum):
    """What a bulk action does to the jobs selected."""

    PAUSE = "pause"
    RESUME = "resume"
    DELETE = "delete"


@dataclass(frozen=True)
class BulkOutcome:
    """What a bulk action did.

    Attributes:
        matched: How many items the ids or filter selected (runs for executions, jobs for jobs).
        done: Ids of the items the action changed (run ids, or job ids).
        kept: Ids of items it refused to change with a reason worth showing (a deleted job's dependents).
    """

    matched: int
    done: list[str]
    kept: list[str]


@dataclass(frozen=True)
class Search:
    """A filter of executions as a person types it: a job name or id instead of job ids."""

    job_id: str | None = None
    job_name: str | None = None
    states: tuple[str, ...] = ()
    handler: str | None = None
    queue: str | None = None
    since: datetime | None = None
    until: datetime | None = None
    error: str | None = None

    def is_empty(self) -> bool:
        """Whether no field filters (a bulk action by filter then needs an explicit "everything")."""
        return self == Search()


def _no_nul(*fields: tuple[str, str | None]) -> None:
    """Refuse text PostgreSQL cannot store (the gRPC layer refuses it in any field; the console's
    forms reach these filters directly)."""
    for field, value in fields:
        if value and "\x00" in value:
            raise InvalidArgument(field, "must not contain the NUL character (U+0000)")


def _uuids(values: Sequence[str], field: str) -> list[str]:
    if len(values) > MAX_IDS:
        raise InvalidArgument(field, f"at most {MAX_IDS} ids per request; use a filter for more")
    try:
        return list(dict.fromkeys(str(uuid.UUID(value)) for value in values))
    except ValueError:
        raise InvalidArgument(field, "every id must be a UUID") from None


@dataclass(frozen=True)
class RunActions:
    """What a bulk action does to one queue's runs, as `Control` does it (its queues, repositories
    and dispatch stay private to it; `Control` builds `BulkControl` with these).

    Attributes:
        cancel: Cancel runs of a queue (as CancelExecution); returns the latest attempts it changed.
        retry: Give runs whose latest attempt ended unsuccessfully a new queued attempt, and enqueue it.
        requeue_dead: Requeue dead runs of a queue from its dead-letter queue (`Control.requeue_dead_runs`).
    """

    cancel: Callable[[str, Sequence[str]], Awaitable[list[Execution]]]
    retry: Callable[[Sequence[str]], Awaitable[list[Queued]]]
    requeue_dead: Callable[[str, Sequence[str]], Awaitable[list[Queued]]]


class BulkControl:
    """Bulk actions, as `Control.bulk` offers them.

    Args:
        queries: The selections by filter and the batched job writes (SQL in `db/bulk.py`).
        runs: What to do to runs, from `Control`.
    """

    def __init__(self, queries: BulkQueries, runs: RunActions) -> None:
        self._queries = queries
        self._runs = runs

    async def job_ids_named(self, name: str) -> list[str]:
        """Ids of the jobs whose name contains `name` (case-insensitive; an exact name first).

        Raises:
            InvalidArgument: more than `MAX_NAME_MATCHES` jobs match (`job_name`).
        """
        named = await self._queries.job_ids_named(name)
        if len(named) > MAX_NAME_MATCHES:
            raise InvalidArgument("job_name", f"matches more than {MAX_NAME_MATCHES} jobs; type more of the name")
        return named

    async def resolve(self, search: Search) -> ExecutionFilter:
        """The executions filter of a search: a job name becomes the ids of the jobs it names.

        Raises:
            InvalidArgument: an unknown state (`states`), a job id that is not a UUID (`job_id`), or a
                name matching more than `MAX_NAME_MATCHES` jobs (`job_name`).
        """
        _no_nul(("job_name", search.job_name), ("handler", search.handler), ("queue", search.queue),
                ("error", search.error), *(("states", state) for state in search.states))  # fmt: skip
        for state in search.states:
            if state not in ExecutionStatus.__members__.values():
                raise InvalidArgument("states", f"unknown state {state!r}")
        job_ids: tuple[str, ...] | None = None
        if search.job_id:
            job_ids = tuple(_uuids([search.job_id], "job_id"))
        if search.job_name:
            named = await self.job_ids_named(search.job_name)
            job_ids = tuple(named) if job_ids is None else tuple(i for i in job_ids if i in named)
        return ExecutionFilter(
            job_ids=job_ids,
            states=search.states,
            handler=search.handler or None,
            queue=search.queue or None,
            since=search.since,
            until=search.until,
            error=search.error or None,
        )

    async def executions(
        self,
        action: ExecutionAction,
        *,
        ids: Sequence[str] = (),
        search: Search | None = None,
        validate_only: bool = False,
        reader: Role = Role.ADMIN,
    ) -> BulkOutcome:
        """Cancel, retry or requeue the runs of the executions `ids` (any attempt of a run stands for
        it), or of every execution `search` matches. A search's error text matches the error as
        `reader` may read it (`redaction.error_matches`), so neither the count nor the action is an
        oracle for a secret.

        Raises:
            InvalidArgument: neither or both of ids and search (`ids`), more than `MAX_IDS` ids or one not a
                UUID (`ids`), a filter matching more than `MAX_BULK` executions (`filter`), or a bad filter
                field (see `resolve`).
        """
        if bool(ids) == (search is not None):
            raise InvalidArgument("ids", "give either ids or a filter (not both, not neither)")
        if search is None:
            runs = await self._queries.runs_of(_uuids(ids, "ids"))
            if validate_only:
                return BulkOutcome(len(runs), [], [])
            return BulkOutcome(len(runs), await self._act(action, runs), [])
        selected = await self.resolve(search)
        if selected.until is None or selected.until > datetime.now(UTC):
            # Pinned: what is created after the count is not part of the action.
            selected = replace(selected, until=datetime.now(UTC))
        if selected.job_ids == ():
            return BulkOutcome(0, [], [])
        if selected.error and not redaction.sees_secrets(reader):
            return await self._by_readable_error(action, selected, selected.error, reader, validate_only)
        count = await self._queries.count_executions(selected, MAX_BULK)
        if count > MAX_BULK:
            raise InvalidArgument("filter", _OVER_THE_CAP)
        if validate_only:
            return BulkOutcome(count, [], [])
        done: list[str] = []
        seen: set[str] = set()
        cursor = None
        while True:
            batch = await self._queries.select_runs(selected, cursor)
            fresh = [run for run in batch.runs if run[0] not in seen]
            seen.update(run_id for run_id, _ in fresh)
            done += await self._act(action, fresh)
            if batch.cursor is None or len(seen) >= MAX_BULK:
                return BulkOutcome(len(seen), done, [])
            cursor = batch.cursor

    async def _by_readable_error(
        self, action: ExecutionAction, selected: ExecutionFilter, term: str, reader: Role, validate_only: bool
    ) -> BulkOutcome:
        """A filtered action for a reader of redacted errors: the store's matches (a superset),
        kept where the text is found in the error as `reader` reads it."""
        found = await self._queries.errors_of_matches(selected, MAX_BULK)
        if len(found) > MAX_BULK:
            raise InvalidArgument("filter", _OVER_THE_CAP)
        ids = [execution_id for execution_id, error in found if redaction.error_matches(reader, error, term)]
        if validate_only or not ids:
            return BulkOutcome(len(ids), [], [])
        return BulkOutcome(len(ids), await self._act(action, await self._queries.runs_of(ids)), [])

    async def _act(self, action: ExecutionAction, runs: Sequence[tuple[str, str]]) -> list[str]:
        """The action on up to `BATCH` runs, grouped by queue; returns the run ids changed."""
        by_queue: dict[str, list[str]] = {}
        for run_id, queue in runs:
            by_queue.setdefault(queue, []).append(run_id)
        done: list[str] = []
        for queue, run_ids in by_queue.items():
            for start in range(0, len(run_ids), BATCH):
                chunk = run_ids[start : start + BATCH]
                if action is ExecutionAction.CANCEL:
                    changed = await self._runs.cancel(queue, chunk)
                    done += [execution.run_id for execution in changed]
                    continue
                latest = await self._queries.latest_states(chunk)
                dead = [run_id for run_id in chunk if latest.get(run_id) == ExecutionStatus.DEAD.value]
                if dead:
                    done += [run.run_id for run in await self._runs.requeue_dead(queue, dead)]
                if action is ExecutionAction.RETRY:
                    others = [run_id for run_id in chunk if run_id not in set(dead)]
                    done += [run.run_id for run in await self._runs.retry(others)]
        return done

    async def jobs(
        self,
        action: JobAction,
        *,
        ids: Sequence[str] = (),
        search: JobFilter | None = None,
        validate_only: bool = False,
        detach_dependents: bool = False,
    ) -> BulkOutcome:
        """Pause, resume or delete the jobs `ids`, or every job `search` matches.

        Pausing skips jobs already paused and resuming jobs already active (they are not counted as
        done). Deleting keeps a job that another job (not deleted with it) depends on, unless
        `detach_dependents`.

        Raises:
            InvalidArgument: neither or both of ids and search (`ids`), more than `MAX_IDS` ids or one not a
                UUID (`ids`), an unknown state (`filter.state`), or a filter matching more than
                `MAX_BULK` jobs (`filter`).
        """
        if bool(ids) == (search is not None):
            raise InvalidArgument("ids", "give either ids or a filter (not both, not neither)")
        if search is None:
            jobs = await self._queries.jobs_by_id(_uuids(ids, "ids"))
            if validate_only:
                return BulkOutcome(len(jobs), [], [])
            done, kept = await self._act_jobs(action, jobs, detach_dependents)
            return BulkOutcome(len(jobs), done, kept)
        _no_nul(("filter.name_contains", search.name), ("filter.state", search.state),
                ("filter.handler", search.handler), ("filter.queue", search.queue))  # fmt: skip
        if search.state and search.state not in (JobStatus.ACTIVE.value, JobStatus.PAUSED.value):
            raise InvalidArgument("filter.state", "must be active or paused")
        count = await self._queries.count_jobs(search, MAX_BULK)
        if count > MAX_BULK:
            raise InvalidArgument("filter", f"matches more than {MAX_BULK} jobs; narrow it")
        if validate_only:
            return BulkOutcome(count, [], [])
        done, kept, matched = [], [], 0
        after: str | None = None
        while matched < MAX_BULK:
            jobs = await self._queries.select_jobs(search, after, min(BATCH, MAX_BULK - matched))
            if not jobs:
                break
            matched += len(jobs)
            changed, refused = await self._act_jobs(action, jobs, detach_dependents)
            done += changed
            kept += refused
            after = jobs[-1].name
        return BulkOutcome(matched, done, kept)

    async def _act_jobs(self, action: JobAction, jobs: Sequence[Job], detach: bool) -> tuple[list[str], list[str]]:
        if not jobs:
            return [], []
        if action is JobAction.DELETE:
            done, kept = await self._queries.delete_jobs([job.id for job in jobs], detach_dependents=detach)
            metrics.JOBS_DELETED.inc(len(done))
            return done, kept
        now = datetime.now(UTC)
        changes: list[tuple[str, str, datetime | None]]
        if action is JobAction.PAUSE:
            changes = [(job.id, JobStatus.PAUSED.value, None) for job in jobs if job.status is JobStatus.ACTIVE]
            done = await self._queries.set_statuses(changes, JobStatus.ACTIVE.value)
        else:
            # Resumed from now, as ResumeJob: slots passed while paused are not caught up.
            changes = [
                (job.id, JobStatus.ACTIVE.value, replace(job, status=JobStatus.ACTIVE).first_run_time(now))
                for job in jobs
                if job.status is JobStatus.PAUSED
            ]
            done = await self._queries.set_statuses(changes, JobStatus.PAUSED.value)
        metrics.JOBS_UPDATED.inc(len(done))
        return done, []


__all__ = [
    "MAX_BULK",
    "MAX_IDS",
    "BulkControl",
    "BulkOutcome",
    "ExecutionAction",
    "JobAction",
    "JobFilter",
    "RunActions",
    "Search",
]
