"""Control-plane operations: the domain code behind the gRPC API (and a Python entry point of its own).

Each operation validates first (nothing is stored on bad input), writes PostgreSQL, then Redis (the
outbox order; the leader's reconcile loop repairs a crash in between).
"""

from __future__ import annotations

import asyncio
import itertools
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from redis.asyncio import Redis

from scheduler_grpc import events, flowrun, metrics, queue_depth
from scheduler_grpc.control_bulk import BulkControl, RunActions
from scheduler_grpc.control_flows import FlowReads
from scheduler_grpc.control_limit_keys import LimitKeyControl
from scheduler_grpc.control_limits import LimitControl
from scheduler_grpc.db.bulk import BulkQueries
from scheduler_grpc.db.console import ConsoleQueries, ExecutionRow, JobRow, Overview
from scheduler_grpc.db.executions import ExecutionPage, Queued, TriggerOutcome, TriggerResult
from scheduler_grpc.db.firing import FiringRepository
from scheduler_grpc.db.flow_views import FlowViews
from scheduler_grpc.db.flows import FlowRepository
from scheduler_grpc.db.history import HistoryRepository
from scheduler_grpc.db.jobs import JobPage, JobRepository
from scheduler_grpc.db.limit_keys import LimitKeyQueries
from scheduler_grpc.db.limits import LimitRepository
from scheduler_grpc.db.pool import Pool
from scheduler_grpc.db.queue_shards import QueueShardRepository, ShardHistoryPage
from scheduler_grpc.db.recovery import RecoveryRepository
from scheduler_grpc.db.search import DeadLetter as DeadLetter  # noqa: PLC0414 - re-exported: the console's rows
from scheduler_grpc.db.search import SearchQueries
from scheduler_grpc.db.search import Series as Series  # noqa: PLC0414 - re-exported: the charts' aggregates
from scheduler_grpc.dispatch import Queues, cancel_runs, dispatch_committed, enqueue_runs
from scheduler_grpc.errors import Aborted, FailedPrecondition, InvalidArgument, NotFound, SchedulerError
from scheduler_grpc.executions import Execution, ExecutionStatus, Trigger
from scheduler_grpc.flows import FlowRun, check_references
from scheduler_grpc.jobs import Job, JobSpec, JobStatus, PayloadValidator, check_json, validate_job
from scheduler_grpc.limit_sync import Definitions, LimitSync
from scheduler_grpc.queue import MAX_BATCH, DeadPage, Queue, QueueStats
from scheduler_grpc.queue import DeadItem as DeadItem  # noqa: PLC0414 - re-exported: what dead-letter pages hold
from scheduler_grpc.queue_depth import Sample as Sample  # noqa: PLC0414 - re-exported: depth samples
from scheduler_grpc.rules import QUEUE_NAME_RULE, is_queue_name
from scheduler_grpc.schedule import CronSchedule, FireTime, fire_times
from scheduler_grpc.sharding import SHARD_LEAD, ShardChange, ShardHistory, ShardMap, check_shards
from scheduler_grpc.trigger_batch import BulkRequest, TriggerBatcher

if TYPE_CHECKING:
    from scheduler_grpc.control_users import UserAdmin

MAX_REQUEST_ID_LENGTH = 128
MAX_TRIGGER_ITEMS = 1000  # items of one BatchTriggerJobs call (one statement's rows)
MAX_BACKFILL_SLOTS = 1000
# An update without an expected version merges onto the job as read; if someone else writes in
# between, the merge is redone on the new version ("last writer wins", not ABORTED).
UPDATE_ATTEMPTS = 3
DEFAULT_MISFIRE_GRACE = timedelta(seconds=60)  # SCHEDULER_MISFIRE_GRACE's default
DEFAULT_READ_TIMEOUT = timedelta(seconds=5)  # the console's list and overview reads
# Queue objects kept for the queue names requests mention (a few KB each; any valid name is asked).
QUEUE_CACHE_SIZE = 512


@dataclass(frozen=True)
class TriggerItem:
    """One run asked for by `Control.trigger_many`: the job's id, the request id making it
    idempotent, and a payload instead of the job's (None: the job's)."""

    job_id: str
    request_id: str | None = None
    payload: dict[str, Any] | None = None


def _is_uuid(value: str) -> bool:
    try:
        uuid.UUID(value)
    except ValueError:
        return False
    return True


def _queue_name(name: str) -> str:
    """A queue name as the API takes it ("" is `default`).

    Raises:
        InvalidArgument: not a queue name (field `queue`).
    """
    name = name or "default"
    if not is_queue_name(name):
        raise InvalidArgument("queue", QUEUE_NAME_RULE)
    return name


def _check_request_id(request_id: str | None) -> str | None:
    if request_id is None or request_id == "":
        return None
    if len(request_id) > MAX_REQUEST_ID_LENGTH:
        raise InvalidArgument("request_id", f"must be at most {MAX_REQUEST_ID_LENGTH} characters")
    # What PostgreSQL text cannot hold would fail the statement (of a whole trigger batch).
    if "\x00" in request_id:
        raise InvalidArgument("request_id", "must not contain the NUL character (U+0000)")
    try:
        request_id.encode()
    except UnicodeEncodeError:  # a lone surrogate (only from Python: protobuf strings are UTF-8)
        raise InvalidArgument("request_id", "must be valid Unicode text") from None
    return request_id


def _slots(schedule: CronSchedule, start: datetime, end: datetime) -> list[datetime]:
    """Fire times in [start, end), at most MAX_BACKFILL_SLOTS + 1 (the caller refuses more)."""
    slots: list[datetime] = []
    for fire in fire_times(schedule, start - timedelta(microseconds=1)):
        if fire.instant >= end or len(slots) > MAX_BACKFILL_SLOTS:
            break
        slots.append(fire.instant)
    return slots


async def preview_fire_times(schedule: CronSchedule, start: datetime, count: int) -> list[FireTime]:
    """The next `count` fire times of `schedule` after `start` (PreviewSchedule and the console's preview).

    Raises:
        InvalidArgument: no fire time before year 9999 (`start_time`), or fewer than `count` (`count`).
    """

    def preview() -> list[FireTime]:
        fires: list[FireTime] = []
        try:
            for fire in itertools.islice(fire_times(schedule, start), count):
                fires.append(fire)
        except (OverflowError, ValueError):
            pass  # datetime ends at 9999-12-31: a walk that runs past it (or starts at its edges) stops
        # The walk ends (or overflows) only where datetime ends, at 9999-12-31.
        if not fires:
            raise InvalidArgument("start_time", "no fire time between start_time and year 9999")
        if len(fires) < count:
            raise InvalidArgument("count", f"only {len(fires)} fire times before year 9999; ask for fewer")
        return fires

    # Up to 1000 cron steps: CPU work kept off the event loop.
    return await asyncio.to_thread(preview)


class Control:
    """Jobs and runs, as an operator or another service manipulates them."""

    def __init__(
        self,
        redis: Redis,
        pool: Pool,
        handlers: PayloadValidator,
        *,
        misfire_grace: timedelta = DEFAULT_MISFIRE_GRACE,
        users: UserAdmin | None = None,
        read_timeout: timedelta = DEFAULT_READ_TIMEOUT,
        in_process_queue: str | None = None,
        shard_map: ShardMap | None = None,
        shard_lead: timedelta = SHARD_LEAD,
    ) -> None:
        self._redis = redis
        # A server's: jobs may then name a handler it does not know (a remote worker's) on another queue.
        self._in_process_queue = in_process_queue
        self._users = users
        self._misfire_grace = misfire_grace
        self._pool = pool
        self._handlers = handlers
        # Private: callers (the servicers, the console, embedding programs) go through the methods
        # below, so every rule about jobs and runs is kept here (`tests/test_layout.py`).
        self._jobs = JobRepository(pool)
        self._firing = FiringRepository(pool)
        self._history = HistoryRepository(pool)
        self._recovery = RecoveryRepository(pool)
        self._flows = FlowRepository(pool)
        self._reads = ConsoleQueries(pool, timeout=read_timeout)
        self._searches = SearchQueries(pool, timeout=read_timeout.total_seconds())
        limits = LimitRepository(pool)
        # The queues' shard counts (`sharding.py`), read from PostgreSQL unless the caller shares its
        # map, with the deployment's SCHEDULER_QUEUE_SHARD_LEAD.
        self._shards = QueueShardRepository(pool, timeout=read_timeout)
        shard_map = shard_map or ShardMap(self._shards.histories, lead=shard_lead)
        self._queues = Queues(redis, capacity=QUEUE_CACHE_SIZE, definitions=Definitions(limits), shard_map=shard_map)
        self._triggers = TriggerBatcher(self._firing, self._dispatch)
        self._bulk = BulkControl(
            BulkQueries(pool),
            RunActions(cancel=self._cancel_runs, retry=self._retry_runs, requeue_dead=self.requeue_dead_runs),
        )
        self._flow_reads = FlowReads(
            FlowViews(pool, timeout=read_timeout.total_seconds()),
            job_by_id=self.get_job,
            job_by_name=self.get_job_by_name,
        )
        self._limits = LimitControl(limits, check_request_id=_check_request_id, sync=LimitSync(limits, self._queues))
        self._limit_keys = LimitKeyControl(self._limits, LimitKeyQueries(pool, timeout=read_timeout), self._queues)

    @property
    def in_process_queue(self) -> str | None:
        """The in-process workers' queue, where a job may name only this server's handlers (a
        remote worker's handler must be on another queue); None: no handler but this process's."""
        return self._in_process_queue

    @property
    def bulk(self) -> BulkControl:
        """Bulk actions on executions and jobs, by ids or filter (`control_bulk`)."""
        return self._bulk

    @property
    def flow_reads(self) -> FlowReads:
        """Flow runs and job relations as the console and ListFlowRuns show them (`control_flows`)."""
        return self._flow_reads

    @property
    def limits(self) -> LimitControl:
        """Limit definitions (`control_limits`): create, read, list, update, delete, key overrides."""
        return self._limits

    @property
    def limit_keys(self) -> LimitKeyControl:
        """Limit keys (`control_limit_keys`): a key's state per queue, pause, resume, busiest keys."""
        return self._limit_keys

    @property
    def users(self) -> UserAdmin:
        """User management (`control_users`): the server process passes it in.

        Raises:
            FailedPrecondition: this Control was built without it (a process that serves no users).
        """
        if self._users is None:
            raise FailedPrecondition("user management is not available in this process")
        return self._users

    async def create_job(self, spec: JobSpec, *, request_id: str | None = None) -> Job:
        """Validate and store a job; the same `request_id` returns the same job."""
        request_id = _check_request_id(request_id)
        spec = validate_job(spec, self._handlers, in_process_queue=self._in_process_queue)
        now = datetime.now(UTC)
        self._check_run_at(spec, now)
        next_run = spec.first_run_time(now) if spec.status is JobStatus.ACTIVE else None
        job = await self._jobs.create(spec, next_run, request_id)
        metrics.JOBS_CREATED.inc()
        return job

    async def update_job(self, job_id: str, spec: JobSpec, expected_version: int | None = None) -> Job:
        """Replace a job's definition (optimistic concurrency on `expected_version` when given)."""
        current = await self._jobs.get(job_id)
        spec = validate_job(spec, self._handlers, in_process_queue=self._in_process_queue)
        schedule_changed = (spec.schedule_kind, spec.cron, spec.time_zone, spec.run_at, spec.dst_gap_policy,
                            spec.dst_fold_policy, spec.status) != (
            current.schedule_kind, current.cron, current.time_zone, current.run_at, current.dst_gap_policy,
            current.dst_fold_policy, current.status)  # fmt: skip
        next_run = current.next_run_time
        if spec.run_at != current.run_at:  # an unchanged past run_at is history, not a request
            self._check_run_at(spec, datetime.now(UTC))
        if schedule_changed:
            next_run = spec.first_run_time(datetime.now(UTC)) if spec.status is JobStatus.ACTIVE else None
        version = current.version if expected_version is None else expected_version
        job = await self._jobs.update(job_id, spec, next_run, version)
        metrics.JOBS_UPDATED.inc()
        return job

    async def merge_job(self, job_id: str, merge: Callable[[Job], JobSpec], expected_version: int | None = None) -> Job:
        """Update a job with the spec `merge` makes of it as it stands (a partial update).

        With `expected_version`, the job must still be at that version (else `Aborted`). Without it,
        a concurrent write between the read and the update makes the merge run again on the new
        version, up to `UPDATE_ATTEMPTS` times.

        Raises:
            Aborted: the job is not at `expected_version`, or kept changing under the merge.
            NotFound: no such job.
        """
        for attempt in range(1, UPDATE_ATTEMPTS + 1):
            current = await self._jobs.get(job_id)
            if expected_version is not None and current.version != expected_version:
                raise Aborted(f"etag: job changed meanwhile (now {current.etag}); read it again and retry")
            try:
                return await self.update_job(job_id, merge(current), expected_version=current.version)
            except Aborted:
                if expected_version is not None or attempt == UPDATE_ATTEMPTS:
                    raise
        raise AssertionError("unreachable: the last attempt returns or raises")

    def _check_run_at(self, spec: JobSpec, now: datetime) -> None:
        """Refuse a one-shot time already past the misfire grace.

        The scheduler would treat it as a misfire at once (run it decades late, or record it
        missed), and a run that late would be a client mistake, not a schedule.

        Raises:
            InvalidArgument: naming `run_at`.
        """
        if spec.run_at is not None and spec.run_at < now - self._misfire_grace:
            raise InvalidArgument(
                "run_at",
                f"{spec.run_at.isoformat()} is more than {self._misfire_grace.total_seconds():g}s in the past "
                "(the misfire grace); give a time to come, or trigger the job to run it now",
            )

    async def pause_job(self, job_id: str) -> Job:
        job = await self._jobs.set_status(job_id, JobStatus.PAUSED, None)
        metrics.JOBS_UPDATED.inc()
        return job

    async def resume_job(self, job_id: str) -> Job:
        """Resume from now: slots passed while paused are not caught up."""
        job = await self._jobs.get(job_id)
        next_run = replace(job, status=JobStatus.ACTIVE).first_run_time(datetime.now(UTC))
        job = await self._jobs.set_status(job_id, JobStatus.ACTIVE, next_run)
        metrics.JOBS_UPDATED.inc()
        return job

    async def delete_job(self, job_id: str, *, detach_dependents: bool = False) -> None:
        """Delete a job and its history.

        Raises:
            NotFound: no such job.
            FailedPrecondition: other jobs depend on it and `detach_dependents` is not set (with it,
                they simply lose that upstream).
        """
        await self._jobs.delete(job_id, detach_dependents=detach_dependents)
        metrics.JOBS_DELETED.inc()

    async def trigger_job(self, job_id: str, *, request_id: str | None = None) -> list[Queued]:
        """Run a job now, outside its schedule; the same `request_id` does not run it twice.

        Returns:
            The new run (enqueued), or nothing when `request_id` already ran the job.

        Raises:
            NotFound: no such job.
        """
        run = (await self._trigger(job_id, request_id)).run
        return [run] if run is not None else []

    async def trigger_execution(self, job_id: str, *, request_id: str | None = None) -> Execution:
        """Run a job now and return the run's first attempt; a repeated `request_id` returns the
        attempt its first call created, running nothing again.

        Raises:
            NotFound: no such job.
        """
        execution = (await self._trigger(job_id, request_id)).execution
        assert execution is not None  # CREATED and REPEATED carry one; _trigger raises otherwise
        return execution

    async def _trigger(self, job_id: str, request_id: str | None) -> TriggerResult:
        """One manual trigger, batched with concurrent ones (`trigger_batch`): every concurrent
        call gets its own run, and the batch shares one statement, one enqueue and one publish."""
        request_id = _check_request_id(request_id)
        result = await self._triggers.trigger(job_id, request_id)
        if result.outcome is TriggerOutcome.NO_JOB:
            raise NotFound(f"job {job_id} not found")
        if result.outcome is TriggerOutcome.MISSED:  # a clock far behind the scheduler's
            raise FailedPrecondition(f"id: now lies inside a range of missed slots of job {job_id}; retry later")
        return result

    async def trigger_many(self, items: Sequence[TriggerItem]) -> list[Execution | SchedulerError]:
        """Many manual runs in one call (BatchTriggerJobs): one per item, each as `trigger_execution`
        would make it, with its own `request_id` and, optionally, a payload instead of its job's.

        Every item is validated first (nothing is written when one is invalid); then the runs are
        made in one statement (`TriggerBatcher.trigger_all`), enqueued and announced together.

        Returns:
            Per item, in order: its run's first attempt (new, or the one an earlier request with its
            `request_id` made), or the error it alone would have raised (`NotFound`: no such job;
            `FailedPrecondition`: now lies in a missed range; `Aborted`: kept colliding).

        Raises:
            InvalidArgument: no items or more than `MAX_TRIGGER_ITEMS` (`requests`), or an invalid
                item, named with its index (`requests[3].id`, `requests[3].request_id`,
                `requests[3].payload.url`); a request id repeated for one job is invalid too.
        """
        if not items:
            raise InvalidArgument("requests", "at least one item")
        if len(items) > MAX_TRIGGER_ITEMS:
            raise InvalidArgument("requests", f"at most {MAX_TRIGGER_ITEMS} items per call")
        requests: list[BulkRequest] = []
        seen: dict[tuple[str, str], int] = {}
        job_ids: dict[str, str] = {}  # as given -> canonical (calls tend to name a few jobs many times)
        for index, item in enumerate(items):
            job_id = job_ids.get(item.job_id, "")
            if not job_id:
                try:
                    job_id = job_ids[item.job_id] = str(uuid.UUID(item.job_id))
                except (ValueError, AttributeError, TypeError):
                    raise InvalidArgument(f"requests[{index}].id", f"{item.job_id!r:.80} is not a valid id") from None
            try:
                request_id = _check_request_id(item.request_id)
            except InvalidArgument as exc:
                raise InvalidArgument(f"requests[{index}].request_id", exc.message) from None
            if request_id is not None:
                first = seen.setdefault((job_id, request_id), index)
                if first != index:
                    raise InvalidArgument(
                        f"requests[{index}].request_id", f"repeats requests[{first}]'s for the same job"
                    )
            if item.payload is not None:
                check_json(item.payload, f"requests[{index}].payload")
            requests.append(BulkRequest(job_id, request_id, item.payload))
        requests = await self._validated_payloads(requests)
        results = await self._triggers.trigger_all(requests)
        answers: list[Execution | SchedulerError] = []
        for request, result in zip(requests, results, strict=True):
            if result.execution is not None:
                answers.append(result.execution)
            elif result.outcome is TriggerOutcome.NO_JOB:
                answers.append(NotFound(f"job {request.job_id} not found"))
            elif result.outcome is TriggerOutcome.MISSED:
                missed = f"id: now lies inside a range of missed slots of job {request.job_id}; retry later"
                answers.append(FailedPrecondition(missed))
            else:
                answers.append(Aborted("the trigger kept colliding with other runs; retry"))
        return answers

    async def _validated_payloads(self, requests: list[BulkRequest]) -> list[BulkRequest]:
        """`requests` with each payload override checked against its job's handler, as a job's own
        payload is (`validate_job`), and normalised. A job that does not exist is left to the insert,
        which answers NOT_FOUND for it alone.

        Raises:
            InvalidArgument: naming `requests[<index>].payload...`.
        """
        overriding = {request.job_id for request in requests if request.payload is not None}
        if not overriding:
            return requests
        handlers = await self._jobs.handlers_of(sorted(overriding))
        checked: list[BulkRequest] = []
        for index, request in enumerate(requests):
            if request.payload is None or request.job_id not in handlers:
                checked.append(request)
                continue
            handler, _queue = handlers[request.job_id]
            try:
                check_references(request.payload)
                if self._in_process_queue is not None and handler not in self._handlers:
                    payload = self._handlers.validate_remote(handler, request.payload)
                else:
                    payload = self._handlers.validate(handler, request.payload)
            except InvalidArgument as exc:
                field = exc.field if exc.field.startswith("payload") else "payload"
                message = exc.message if field == exc.field else f"{exc.field}: {exc.message}"
                raise InvalidArgument(f"requests[{index}].{field}", message) from None
            checked.append(replace(request, payload=payload))
        return checked

    async def backfill_range(self, job_id: str, start: datetime, end: datetime) -> list[Execution]:
        """One run per slot of a cron job's schedule in [start, end) that has none yet (trigger
        `backfill`); returns their first attempts, oldest slot first.

        Raises:
            InvalidArgument: `end` in the future or not after `start` (field `end_time`), more than
                `MAX_BACKFILL_SLOTS` slots in the range (`end_time`), or a range the calendar cannot
                walk (`start_time`).
            FailedPrecondition: not a cron job.
        """
        if end > datetime.now(UTC):
            raise InvalidArgument("end_time", "must not be in the future")
        if end <= start:
            raise InvalidArgument("end_time", "must be after start_time")
        job = await self._jobs.get(job_id)
        schedule = job.cron_schedule
        if schedule is None:
            raise FailedPrecondition("id: only cron jobs can be backfilled")
        try:
            # Up to MAX_BACKFILL_SLOTS cron steps: CPU work kept off the event loop.
            slots = await asyncio.to_thread(_slots, schedule, start, end)
        except (OverflowError, ValueError):  # datetime begins at year 1: a walk from its edge overflows
            raise InvalidArgument("start_time", "too close to year 1 for this schedule; start later") from None
        if len(slots) > MAX_BACKFILL_SLOTS:
            raise InvalidArgument(
                "end_time", f"the range holds more than {MAX_BACKFILL_SLOTS} slots; backfill it in smaller ranges"
            )
        runs = await self.backfill_job(job.id, slots)
        return await self._history.get_many([run.run_id for run in runs])

    async def backfill_job(self, job_id: str, slots: Sequence[datetime]) -> list[Queued]:
        """One run per past slot (idempotent per slot), trigger `backfill`."""
        job = await self._jobs.get(job_id)
        if job.schedule_kind.value != "cron":
            raise FailedPrecondition("job: only cron jobs can be backfilled")
        runs = await self._firing.trigger(job.id, Trigger.BACKFILL, list(slots))
        await self._dispatch(runs)
        return runs

    async def requeue_dead_runs(self, queue: str, run_ids: Sequence[str] | None) -> list[Queued]:
        """Give dead runs a new attempt and move them from the dead-letter queue back to ready
        (None: every dead run of `queue`; items that are not runs, no UUID id, stay)."""
        target = self._queue(queue)  # validated before anything is written
        if run_ids is not None:
            return await self._requeue_dead(target, run_ids)
        requeued: list[Queued] = []
        token: str | None = None
        while True:
            # Page through the dead set once (the page order is stable while items leave it), so
            # runs PostgreSQL refuses to requeue cannot keep the loop going.
            page = await target.list_dead(MAX_BATCH, token)
            requeued += await self._requeue_dead(target, [item.id for item in page.items if _is_uuid(item.id)])
            if page.next_page_token is None:
                return requeued
            token = page.next_page_token

    async def _requeue_dead(self, target: Queue, run_ids: Sequence[str]) -> list[Queued]:
        runs = await self._recovery.requeue_runs(run_ids)
        plain = [run.run_id for run in runs if not run.limits]
        if plain:
            await target.requeue_dead(plain)
        # A run with limit keys is enqueued again with the keys PostgreSQL holds (its dead item may
        # have none: resolved only now); if this stops between the two, reconcile enqueues it.
        if limited := [run for run in runs if run.limits]:
            await target.purge_dead([run.run_id for run in limited])
            await enqueue_runs(self._queues, limited)
        return runs

    async def purge_dead_runs(self, queue: str, run_ids: Sequence[str] | None) -> list[str]:
        """Forget dead runs from the dead-letter queue (None: every dead item of `queue`).

        PostgreSQL records the purge first (`mark_dead_letters_purged`), so the leader's rebuild of a
        lost dead-letter queue does not bring the runs back; then Redis forgets them. Items that are
        not runs (no UUID id) are purged from Redis only.

        Returns:
            The ids purged from Redis.
        """
        target = self._queue(queue)
        if run_ids is not None:
            await self._recovery.mark_dead_letters_purged([i for i in run_ids if _is_uuid(i)])
            return await target.purge_dead(run_ids)
        purged: list[str] = []
        token: str | None = None
        while True:
            # One page at a time: the page order is stable while items leave the dead set.
            page = await target.list_dead(MAX_BATCH, token)
            ids = [item.id for item in page.items]
            await self._recovery.mark_dead_letters_purged([i for i in ids if _is_uuid(i)])
            purged += await target.purge_dead(ids)
            if page.next_page_token is None:
                return purged
            token = page.next_page_token

    async def cancel_execution(self, execution_id: str) -> Execution:
        """Cancel the run of an execution: removed from the queue if waiting, stopped on its worker
        if running (then recorded `cancelled` by the worker).

        Raises:
            NotFound: no such execution.
            FailedPrecondition: the run has already finished.
        """
        execution = await self._history.get(execution_id)
        job = await self._jobs.get(execution.job_id)
        latest = await cancel_runs(self._redis, self._queues, self._recovery, job.queue, [execution.run_id])
        if not latest:
            raise FailedPrecondition(f"id: the run of execution {execution_id} has already finished")
        return latest[0]

    async def _cancel_runs(self, queue: str, run_ids: Sequence[str]) -> list[Execution]:
        """Cancel runs of `queue` (as `cancel_execution`, for `control_bulk`); finished ones stay."""
        return await cancel_runs(self._redis, self._queues, self._recovery, queue, run_ids)

    async def _retry_runs(self, run_ids: Sequence[str]) -> list[Queued]:
        """A new queued attempt for each run whose latest attempt ended unsuccessfully (trigger
        `dlq_requeue`), enqueued (for `control_bulk`)."""
        runs = await self._recovery.requeue_runs(run_ids)
        # A run with limit keys may have a dead item without them (resolved only now): it goes, and
        # the run is enqueued with the keys PostgreSQL holds (as `_requeue_dead`).
        for name, group in itertools.groupby(sorted((r for r in runs if r.limits), key=lambda r: r.queue),
                                             key=lambda r: r.queue):  # fmt: skip
            await self._queues.get(name).purge_dead([run.run_id for run in group])
        await self._dispatch(runs)
        return runs

    async def get_flow_run(self, flow_run_id: str) -> FlowRun:
        """A flow run (job dependencies) with every node and its state.

        Raises:
            NotFound: no such flow run.
        """
        return await self._flows.get(flow_run_id)

    async def cancel_flow_run(self, flow_run_id: str) -> FlowRun:
        """Cancel a flow run: its waiting nodes are recorded `cancelled`, and its queued and running
        runs are cancelled (a running one by its worker); finished runs stay as they are.

        Raises:
            NotFound: no such flow run.
            FailedPrecondition: it has already finished.
        """
        started, recorded = await self._flows.cancel(flow_run_id)
        await events.publish(self._redis, flowrun.recorded_events(recorded))
        by_queue: dict[str, list[str]] = {}
        for run_id, queue in started:
            by_queue.setdefault(queue, []).append(run_id)
        for queue, run_ids in by_queue.items():
            await cancel_runs(self._redis, self._queues, self._recovery, queue, run_ids)
        return await self._flows.get(flow_run_id)

    async def _dispatch(self, runs: Sequence[Queued]) -> None:
        # Committed already: the caller gets its runs even if Redis fails now (reconcile enqueues them).
        await dispatch_committed(self._redis, self._queues, runs)

    # -- reads ------------------------------------------------------------------------------------

    async def get_job(self, job_id: str) -> Job:
        """A job by id.

        Raises:
            NotFound: no such job.
        """
        return await self._jobs.get(job_id)

    async def get_job_by_name(self, name: str) -> Job:
        """A job by its unique name.

        Raises:
            NotFound: no job of that name.
        """
        return await self._jobs.get_by_name(name)

    async def list_jobs(
        self,
        *,
        page_size: int = 100,
        page_token: str = "",
        status: JobStatus | None = None,
        handler: str | None = None,
        with_payload: bool = True,
    ) -> JobPage:
        """A page of jobs ordered by name (`next_page_token`, or `token_after` a job to cut it short).

        Raises:
            InvalidArgument: `page_size` out of range or a `page_token` of another listing.
        """
        return await self._jobs.list_page(
            page_size=page_size, page_token=page_token, status=status, handler=handler, with_payload=with_payload
        )

    async def queue_names(self) -> list[str]:
        """Every queue some job names."""
        return await self._jobs.queue_names()

    async def get_execution(self, execution_id: str) -> Execution:
        """One attempt by id (a queued one held back by a limit key says so in `blocked_by`).

        Raises:
            NotFound: no such execution.
        """
        (execution,) = await self._limit_keys.with_blocked_by([await self._history.get(execution_id)])
        return execution

    async def list_executions(
        self,
        *,
        job_id: str | None = None,
        statuses: Sequence[ExecutionStatus] = (),
        page_size: int = 100,
        page_token: str = "",
        with_output: bool = True,
        flow_run_id: str | None = None,
    ) -> ExecutionPage:
        """A page of attempts, newest first, by job, states and flow run (without `with_output`, no
        error and no result are read); queued ones held back by a limit key say so in `blocked_by`.

        Raises:
            InvalidArgument: `page_size` out of range or a `page_token` of another listing.
        """
        page = await self._history.list_page(
            job_id=job_id,
            statuses=statuses,
            page_size=page_size,
            page_token=page_token,
            with_output=with_output,
            flow_run_id=flow_run_id,
        )
        return replace(page, executions=await self._limit_keys.with_blocked_by(page.executions))

    async def flow_members(self, flow_run_id: str) -> FlowMembers:
        """Which runs belong to a flow run, for a watcher that filters events by it.

        Raises:
            NotFound: no such flow run.
        """
        return FlowMembers(self._flows, await self._flows.get(flow_run_id))

    def _queue(self, name: str) -> Queue:
        """The queue named `name` ("" is `default`).

        Raises:
            InvalidArgument: not a queue name (field `queue`).
        """
        return self._queues.get(_queue_name(name))

    async def queue_stats(self, queue: str) -> QueueStats:
        """How many items of `queue` are ready, leased, delayed and dead (read atomically)."""
        return await self._queue(queue).stats()

    async def list_dead_letters(self, queue: str, page_size: int, page_token: str | None = None) -> DeadPage:
        """A page of `queue`'s dead-letter queue, oldest first."""
        return await self._queue(queue).list_dead(page_size, page_token)

    # Sharded queues (`sharding.py`): the counts are read from PostgreSQL, not from the process's
    # plan, so a change shows at once (before it applies).

    async def queue_shards(self, queue: str) -> ShardHistory:
        """`queue`'s shard counts over time ("" is `default`; a queue never changed has one shard).

        Raises:
            InvalidArgument: not a queue name (field `queue`).
        """
        return await self._shards.history(_queue_name(queue))

    async def list_queue_shards(self, *, page_size: int = 0, page_token: str = "") -> ShardHistoryPage:
        """A page of the queues whose shard count was ever set, by name, and the next page's token.

        Raises:
            InvalidArgument: `page_size` out of range or a `page_token` of another listing.
        """
        return await self._shards.list_page(page_size=page_size, page_token=page_token)

    async def set_queue_shards(self, queue: str, shards: int) -> ShardChange:
        """Give `queue` ("" is `default`) `shards` shards for the runs made from the deployment's
        SCHEDULER_QUEUE_SHARD_LEAD after now (database clock) on; the change recorded, with when it
        applies. Runs made before keep their shard; every shard the queue ever had stays served.

        Raises:
            InvalidArgument: not a queue name (field `queue`) or not 1 to `SHARDS_MAX` (`shards`);
                nothing is written.
        """
        name = _queue_name(queue)
        check_shards(shards)
        # The lead the processes' shard maps assume (this one's is the deployment's setting).
        effective = await self._shards.set_shards(name, shards, lead=self._queues.shard_map.lead)
        # In whole ms rounded half up, as the histories are read (`db/queue_shards.py`).
        micros = (effective - datetime(1970, 1, 1, tzinfo=UTC)) // timedelta(microseconds=1)
        return ShardChange((micros + 500) // 1000, shards)

    # The console's reads: lists with its filters and the overview's aggregates, each bounded by
    # `read_timeout` (`db/console.py`).

    async def search_jobs(
        self,
        *,
        search: str | None,
        status: str | None,
        handler: str | None,
        queue: str | None,
        after: str | None,
        limit: int,
    ) -> list[JobRow]:
        """Jobs by name after `after` whose name contains `search`, with their latest run's status."""
        return await self._reads.jobs(
            search=search, status=status, handler=handler, queue=queue, after=after, limit=limit
        )

    async def search_executions(
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
        """Attempts newest first, before the keyset cursor `before`, with the console's filters
        (`job_ids`: the jobs a name search found; `error`: a part of the error text)."""
        rows = await self._reads.executions(
            job_id=job_id,
            statuses=statuses,
            handler=handler,
            since=since,
            until=until,
            before=before,
            limit=limit,
            job_ids=job_ids,
            error=error,
        )
        shown = await self._limit_keys.with_blocked_by([row.execution for row in rows])
        return [replace(row, execution=execution) for row, execution in zip(rows, shown, strict=True)]

    async def run_attempts(self, run_id: str) -> list[Execution]:
        """Every attempt of a run, first attempt first."""
        return await self._reads.run_attempts(run_id)

    async def job_slots(self, job_id: str, limit: int) -> list[Execution]:
        """The job's most recent attempts, newest slot first."""
        return await self._reads.job_slots(job_id, limit)

    async def overview(self, now: datetime) -> Overview:
        """The overview page's aggregates of the last hour."""
        return await self._reads.overview(now)

    async def handlers_and_queues(self) -> tuple[list[str], list[str]]:
        """The handler and queue names jobs use (the filters' choices; cached a few seconds)."""
        return await self._reads.handlers_and_queues()

    async def search_dead_letters(
        self,
        *,
        queue: str,
        job_ids: Sequence[str] | None,
        handler: str | None,
        error: str | None,
        before: tuple[datetime, str] | None,
        limit: int,
    ) -> list[DeadLetter]:
        """Dead runs of `queue` still in its dead-letter queue, newest death first, by job, handler
        and a part of the error text (PostgreSQL, the record; `db/search.py`)."""
        return await self._searches.dead_letters(
            queue=queue, job_ids=job_ids, handler=handler, error=error, before=before, limit=limit
        )

    async def dead_letter_details(self, run_ids: Sequence[str]) -> dict[str, DeadLetter]:
        """The job, handler, error and time of death of these dead runs (a dead-letter page's rows)."""
        return await self._searches.dead_details(run_ids)

    async def chart_series(self, *, since: datetime, bucket: timedelta, queue: str | None) -> Series:
        """The charts' aggregates since `since` per `bucket`: attempts finished by outcome, and the
        start lateness of scheduled runs, on `queue` (None: every queue)."""
        return await self._searches.series(since=since, bucket=bucket, queue=queue)

    async def sample_queue_depths(self, now: float) -> bool:
        """Record every queue's counts for the minute of `now` (`queue_depth`), unless another
        process did; True if recorded."""
        if not await queue_depth.claim_minute(self._redis, now):
            return False
        names = sorted({"default", *(await self.queue_names())})[: queue_depth.MAX_QUEUES]
        # One queue after another: one connection, not a burst of up to MAX_QUEUES of them.
        counts = [(name, await self._queues.get(name).stats()) for name in names]
        await queue_depth.record(self._redis, now, counts)
        return True

    async def queue_depth(self, queue: str, since: datetime) -> list[Sample]:
        """The depth samples of `queue` since `since`, oldest first."""
        return await queue_depth.read(self._redis, self._queue(queue).name, since)


_MAX_OUTSIDERS = 10_000


class FlowMembers:
    """Which runs belong to one flow run: its nodes' runs as read at the start, and runs created
    later, looked up once on their first event (a run's row and its flow node commit before its
    first event is published) and remembered either way."""

    def __init__(self, flows: FlowRepository, flow: FlowRun) -> None:
        self._flows = flows
        self._flow_run_id = flow.id
        self.job_ids = frozenset(node.job_id for node in flow.nodes)
        self._members = {node.run_id for node in flow.nodes if node.run_id}
        self._outsiders: set[str] = set()

    async def contains(self, run_id: str) -> bool:
        """Whether run `run_id` belongs to the flow run."""
        if run_id in self._members:
            return True
        if run_id in self._outsiders:
            return False
        if await self._flows.flow_of_run(run_id) == self._flow_run_id:
            self._members.add(run_id)
            return True
        if len(self._outsiders) >= _MAX_OUTSIDERS:  # bounded: forget, and look up again if need be
            self._outsiders.clear()
        self._outsiders.add(run_id)
        return False
