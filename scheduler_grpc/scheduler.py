"""The scheduler role: leader election, and the loops only the leader runs.

* scan: due jobs (one statement on the partial index: O(due)) -> planned (next slots by arithmetic
  or a cached walk, `schedule.next_instant`) -> recorded and advanced in chunks, one fenced
  statement each, two in flight (see `FiringRepository.fire_clocked`) -> each chunk's queued runs are
  enqueued in Redis as soon as it is recorded. `allow` jobs are fired `fire_ahead` before their
  slot, their runs delayed in the queue until it (`fires_ahead`), so recording a big second is
  off the lateness path. Between scans: asleep until the next job is to fire.
* recover: expired leases back to ready, their attempts recorded `abandoned` (the next `queued`);
  runs that stalled too often are dead-lettered.
* promote: due retries move from the delayed set to ready.
* reconcile: runs PostgreSQL has `queued` that Redis does not know (crash between commit and
  enqueue, Redis restarted empty, FLUSHALL) are enqueued again, and dead runs (latest attempt
  `dead`, not purged) that Redis does not know are parked in the dead-letter queue again.
* flows: open flow runs (job dependencies) get their next nodes decided, each in one fenced
  transaction, and the runs that creates are enqueued (see `scheduler_grpc.flowrun`).

Every decision uses the database clock, so the scheduler hosts' clocks do not matter.

Faults. No store error ends the role: a failing loop step (Redis or PostgreSQL down, slow, fenced)
is counted, logged once when the loop starts failing and once when it recovers (with a reminder
at most every `_STILL_FAILING_LOG_S` in between), and retried with exponential backoff; the other
loops go on. Any other exception is a bug: its traceback is logged and the process exits with
status 1, so a supervisor restarts it.

Fencing. Every PostgreSQL write of the leader is fenced by its term in the write's own transaction:
`fire` in its one statement, the stalled runs' `dead` marks and the `replace` cancels through
`RecoveryRepository.fenced`. The Redis-only moves are not fenced, and need not be: recovering
expired leases, promoting due retries and enqueueing runs (scan, reconcile, the DLQ rebuild) are
idempotent and converge to the same state whichever leader (or both) makes them, and a deposed
leader's dead-lettering that PostgreSQL refuses is undone (the items go back to ready).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import logging
import os
import socket
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from redis.asyncio import Redis

from scheduler_grpc import flowrun, metrics, stores, tracing
from scheduler_grpc.config import Settings
from scheduler_grpc.connections import connect
from scheduler_grpc.db.executions import Advance, PlannedSlot, Queued
from scheduler_grpc.db.firing import FiringRepository
from scheduler_grpc.db.flows import FlowRepository
from scheduler_grpc.db.jobs import JobChanges, JobRepository
from scheduler_grpc.db.leadership import LeadershipRepository
from scheduler_grpc.db.limits import LimitRepository
from scheduler_grpc.db.partitions import PartitionRepository
from scheduler_grpc.db.pool import Pool
from scheduler_grpc.db.queue_shards import QueueShardRepository
from scheduler_grpc.db.recovery import RecoveryRepository
from scheduler_grpc.dispatch import Queues, cancel_runs, created_events, enqueue_runs, queue_item
from scheduler_grpc.errors import Fenced
from scheduler_grpc.events import EventType, ExecutionEvent, publish
from scheduler_grpc.executions import ExecutionStatus
from scheduler_grpc.jobs import ConcurrencyPolicy, Job, MisfirePolicy, ScheduleKind
from scheduler_grpc.leader import LeaderElector, Term
from scheduler_grpc.limit_sync import Definitions, LimitSync
from scheduler_grpc.ports import FiringStore, RecoveryStore
from scheduler_grpc.queue import MAX_BATCH, SOLO_RETRY_DELAY, ItemState
from scheduler_grpc.schedule import count_fires, instants, last_fire_before
from scheduler_grpc.sharding import SHARD_LEAD, ShardMap

log = logging.getLogger(__name__)

DEFAULT_METRICS_PORT = 9091
METRICS_INTERVAL = timedelta(seconds=2)
STALLED_REASON = "stalled: its lease expired {times} times, the last two alone on its worker (it kills or hangs it)"
STALLED_AT_ONCE_REASON = "stalled: its lease expired (SCHEDULER_MAX_STALLS=1)"
# A failing loop step is retried after 0.1 s, doubling up to 5 s; a step that does not finish
# within _STEP_TIMEOUT_S (a store that accepts but never answers) counts as failed.
_BACKOFF_FIRST_S = 0.1
_BACKOFF_MAX_S = 5.0
_STEP_TIMEOUT_S = 30.0
_STILL_FAILING_LOG_S = 60.0
# Planning yields to the event loop at least this often (the lease renewal must answer in TTL/6).
_PLAN_YIELD_S = 0.005


def is_store_error(exc: BaseException) -> bool:
    """Whether `exc` is a fault of Redis or PostgreSQL (`stores.is_fault`) or a fenced write, not a bug of ours."""
    return isinstance(exc, Fenced) or stores.is_fault(exc)


class Backoff:
    """The failure state of one leader loop: backoff delays, and logging once per outage.

    Args:
        name: The loop, as logs name it.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self.failures = 0
        self._since = 0.0
        self._logged_at = 0.0

    def failed(self, exc: Exception) -> float:
        """Record a failed step; returns the seconds to wait before the next try.

        Raises:
            Exception: `exc` itself when it is a bug (not a store error), after logging it.
        """
        if not is_store_error(exc):
            log.error("leader loop failed with a bug", exc_info=exc, extra={"loop": self.name})
            raise exc
        metrics.store_error(exc)
        now = time.monotonic()
        self.failures += 1
        fields = {"loop": self.name, "error": repr(exc), "failures": self.failures}
        if self.failures == 1:
            self._since = self._logged_at = now
            if isinstance(exc, Fenced):
                log.info("leader write fenced: a newer term exists; this leader steps down", extra=fields)
            else:
                log.warning("leader loop failing; retrying with backoff", extra=fields)
        elif now - self._logged_at >= _STILL_FAILING_LOG_S:
            self._logged_at = now
            log.warning("leader loop still failing", extra={**fields, "for_s": round(now - self._since, 1)})
        return float(min(_BACKOFF_MAX_S, _BACKOFF_FIRST_S * 2.0 ** (self.failures - 1)))

    def succeeded(self) -> None:
        """Record a successful step (logs the recovery after failures)."""
        if self.failures:
            log.info(
                "leader loop recovered",
                extra={"loop": self.name, "failures": self.failures,
                       "after_s": round(time.monotonic() - self._since, 1)},
            )  # fmt: skip
            self.failures = 0


@dataclass(frozen=True)
class LoopSettings:
    """Timings of the leader loops (defaults in brackets)."""

    scan_interval: timedelta = timedelta(seconds=1)  # longest sleep between scans [1 s]
    scan_batch: int = 1000  # due jobs one scan reads (one statement, O(due) on the partial index) [1000]
    fire_chunk: int = 200  # jobs per fire statement: the first runs reach the queue before the rest [200]
    # Slots after which a chunk takes no more jobs: a catch-up chunk's statement, events and enqueue
    # are CPU work between two awaits, so its size bounds the stall of the loop [250]
    fire_chunk_slots: int = 250
    fire_concurrency: int = 2  # fire statements in flight at once (PostgreSQL works on both) [2]
    # Jobs due this soon are read and planned before their slot; the scan then waits for the slot
    # and only records them at it, so the read and the planning are off the lateness path [50 ms].
    plan_ahead: timedelta = timedelta(milliseconds=50)
    # Slots of `allow` jobs are recorded and enqueued (delayed, due at the slot) this long before
    # they are due, so the fire is off the lateness path too; 0: at the slot (SCHEDULER_FIRE_AHEAD).
    # Half a second off the whole: schedules fire on whole seconds, so the fire of the slot after
    # next never competes with the workers claiming a slot's runs [1.5 s].
    fire_ahead: timedelta = timedelta(milliseconds=1500)
    max_slots_per_job: int = 250  # catch-up slots one job records per scan (~12 ms of planning) [250]
    max_slots_per_scan: int = 2000  # slots one scan plans and records (bounds its loop stalls) [2000]
    missed_count_walk: int = 32  # slots walked at most to count a missed range exactly (else NULL) [32]
    misfire_grace: timedelta = timedelta(seconds=60)  # [60 s]
    recover_interval: timedelta = timedelta(milliseconds=500)  # [500 ms]
    promote_interval: timedelta = timedelta(milliseconds=100)  # [100 ms]
    reconcile_interval: timedelta = timedelta(seconds=10)  # [10 s]
    reconcile_grace: timedelta = timedelta(seconds=2)  # rows younger than this may be mid-enqueue [2 s]
    max_stalls: int = 3  # [3]
    solo_retry_delay: timedelta = SOLO_RETRY_DELAY  # [30s]
    stale_running_grace: timedelta = timedelta(seconds=30)  # running past timeout + this: worker gone [30 s]
    # A leader whose scan has made no progress this long hands over [2 x leader TTL, at least 3 scans].
    step_down_after: timedelta = timedelta(seconds=5)
    flow_interval: timedelta = timedelta(milliseconds=200)  # flow runs advanced this often [200 ms]
    # The execution history's day partitions (db/partitions.py): created this many days ahead, dropped
    # whole past the retention (0: never), checked this often [3 days, 0, 10 min].
    execution_partitions_ahead: int = 3
    execution_retention_days: int = 0
    partition_interval: timedelta = timedelta(minutes=10)
    queue_shard_lead: timedelta = SHARD_LEAD  # sharded queues' change lead (sharding.py) [10 s]

    @classmethod
    def from_settings(cls, settings: Settings) -> LoopSettings:
        return cls(
            scan_interval=settings.scan_interval,
            fire_ahead=settings.fire_ahead,
            misfire_grace=settings.misfire_grace,
            reconcile_interval=settings.reconcile_interval,
            max_stalls=settings.max_stalls,
            solo_retry_delay=settings.solo_retry_delay,
            stale_running_grace=settings.visibility_timeout,
            step_down_after=max(2 * settings.leader_ttl, 3 * settings.scan_interval),
            execution_partitions_ahead=settings.execution_partitions_ahead,
            execution_retention_days=settings.execution_retention_days,
            queue_shard_lead=settings.queue_shard_lead,
        )


@dataclass
class Plan:
    """What one scan decided for a batch of due jobs."""

    advances: list[Advance] = field(default_factory=list)
    slots: list[PlannedSlot] = field(default_factory=list)


def fires_ahead(job: Job) -> bool:
    """Whether a job's slots may be recorded and enqueued up to `fire_ahead` before they are due.

    Only under the `allow` concurrency policy (the default), one-shots included: `forbid` and
    `replace` decide on the state of the job's earlier run at the slot itself (still running, or
    not), so those slots are recorded at their time.
    """
    return job.concurrency_policy is ConcurrencyPolicy.ALLOW


def plan_job(job: Job, now: datetime, loop: LoopSettings, plan: Plan, *, until: datetime | None = None) -> None:
    """Decide the slots of one job due at `now` (database clock), or by `until` when later (fired
    ahead: see `fires_ahead`), and its next run time.

    A slot older than `now - misfire_grace` is a misfire and follows the misfire policy; younger
    slots run as usual. `skip` and `run_once` plan a run of misfires arithmetically, so recovery
    after an outage of any length costs O(1) per job, not O(slots):

    * the last misfire L is found by walking back from `now - misfire_grace` (`last_fire_before`),
      never by walking every slot from `next_run_time`;
    * the misfires not run become ONE `missed` row: `scheduled_for` = the first of them
      (`next_run_time`), `missed_through` = the last, `missed_count` = how many, or None when not
      cheaply known (`count_fires`: arithmetic for fixed-period schedules in fixed-offset zones,
      a walk of at most `missed_count_walk` slots otherwise; the count is informational);
    * `skip` runs none of them (the range is first..L); `run_once` runs exactly one, the LAST
      misfire L (the one whose successor is not a misfire), with its own `queued` row
      (scheduled_for = L), and the range is first..the slot before L (none when L is the first).

    The slots inside a range get no row of their own: the range's row and the compare-and-set of
    `next_run_time` past them (see `FiringRepository.fire_clocked`) make a later row for them impossible.

    `run_all` records and runs every slot, at most `max_slots_per_job` per scan (and
    `max_slots_per_scan` per scan over all jobs): after a long outage it catches up at that
    bounded rate, the next scan continuing where this one stopped.
    """
    assert job.next_run_time is not None
    first = job.next_run_time
    misfire_before = now - loop.misfire_grace
    if job.schedule_kind is ScheduleKind.ONCE:
        if first < misfire_before and job.misfire_policy is MisfirePolicy.SKIP:
            plan.slots.append(PlannedSlot(job.id, first, ExecutionStatus.MISSED, first, first, 1))
        else:
            plan.slots.append(PlannedSlot(job.id, first, ExecutionStatus.QUEUED, first))
        plan.advances.append(Advance(job.id, first, None))
        return
    schedule = job.cron_schedule
    assert schedule is not None
    # The slots that run, in order: after a coalesced run of misfires, from its last slot
    # (`run_once`) or the slot after it (`skip`); otherwise from next_run_time itself.
    upcoming: Iterator[datetime] = itertools.chain([first], instants(schedule, first))
    if job.misfire_policy is not MisfirePolicy.RUN_ALL and first < misfire_before:
        last_missed = last_fire_before(schedule, first, misfire_before)
        through: datetime | None = last_missed
        upcoming = instants(schedule, last_missed)
        if job.misfire_policy is MisfirePolicy.RUN_ONCE:
            through = last_fire_before(schedule, first, last_missed) if last_missed > first else None
            upcoming = itertools.chain([last_missed], upcoming)
        if through is not None:
            count = count_fires(schedule, first, through, walk_limit=loop.missed_count_walk)
            plan.slots.append(PlannedSlot(job.id, first, ExecutionStatus.MISSED, first, through, count))
    due: list[datetime] = []
    following: datetime | None = None
    last = now if until is None else max(now, until)
    for instant in upcoming:
        if instant > last or len(due) >= loop.max_slots_per_job:
            following = instant
            break
        due.append(instant)
    plan.slots.extend(PlannedSlot(job.id, slot, ExecutionStatus.QUEUED, slot) for slot in due)
    plan.advances.append(Advance(job.id, first, following))


class LeaderLoops:
    """The leader's work for one term; `lead` is what `LeaderElector.run` calls.

    Args:
        redis: The queues, events and the DLQ.
        pool: PostgreSQL.
        loop: Timings.
        default_queue: A queue to look after even before any job names it.
        step_down: Hands leadership over (`LeaderElector.resign`); called when the scan has made no
            progress for `loop.step_down_after` (this process cannot reach PostgreSQL or Redis
            while a standby may), so a standby that can takes over within milliseconds instead of
            the leader holding the lock through the partition. None: never.
    """

    def __init__(
        self,
        redis: Redis,
        pool: Pool,
        loop: LoopSettings,
        *,
        default_queue: str = "default",
        step_down: Callable[[], None] | None = None,
    ):
        self._redis = redis
        self._loop = loop
        self._step_down = step_down
        self._scanned_at = time.monotonic()
        self._jobs = JobRepository(pool)
        self._firing: FiringStore = FiringRepository(pool)
        self._recovery: RecoveryStore = RecoveryRepository(pool)
        self._changes = JobChanges(pool)
        self._flows = FlowRepository(pool)
        self._partitions = PartitionRepository(pool)
        limits = LimitRepository(pool)
        shards = ShardMap(QueueShardRepository(pool).histories, lead=loop.queue_shard_lead)
        self._queues = Queues(redis, definitions=Definitions(limits), shard_map=shards)
        self._queues.get(default_queue)
        self._limit_sync = LimitSync(limits, self._queues)
        self._limits_defined = False  # some limit exists (as the last reconcile read): watch for a loss
        self._limits_seen: set[str] = set()  # limit names `scheduler_limit_runs_waiting` has a series for
        self.scans = 0

    async def lead(self, term: Term) -> None:
        """Run every leader loop until cancelled (leadership lost or shutdown).

        Raises:
            ExceptionGroup: a loop met a bug (never a store error: those are retried).
        """
        log.info("leading", extra={"term": term.token})
        metrics.LEADER.set(1)
        metrics.LEADER_TERM.set(term.token)
        metrics.LEADERSHIP_CHANGES.inc()
        self._scanned_at = time.monotonic()
        try:
            async with asyncio.TaskGroup() as group:
                group.create_task(self._scan_loop(term), name="scan")
                if self._step_down is not None:
                    group.create_task(self._watch_progress(term, self._step_down), name="progress")
                group.create_task(self._every(self._loop.recover_interval, self._recover, term), name="recover")
                group.create_task(self._every(self._loop.promote_interval, self._promote, term), name="promote")
                group.create_task(self._every(self._loop.reconcile_interval, self._reconcile, term), name="reconcile")
                group.create_task(self._every(METRICS_INTERVAL, self._observe_queues, term), name="queue-metrics")
                group.create_task(self._every(self._loop.flow_interval, self._advance_flows, term), name="flows")
                group.create_task(
                    self._every(self._loop.partition_interval, self.maintain_partitions, term), name="partitions"
                )
        finally:
            metrics.LEADER.set(0)
            metrics.LEADERSHIP_CHANGES.inc()
            # Shielded: the elector cancels lead() repeatedly, and the connection must go back.
            await asyncio.shield(self._changes.close())

    async def _every(self, interval: timedelta, step: Callable[[Term], Awaitable[None]], term: Term) -> None:
        """Run `step` every `interval` while the term is valid; a store error backs off, a bug raises."""
        backoff = Backoff(step.__name__.lstrip("_"))
        while True:
            delay = interval.total_seconds()
            if term.is_valid():
                try:
                    async with asyncio.timeout(_STEP_TIMEOUT_S):
                        await step(term)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    delay = max(delay, backoff.failed(exc))
                else:
                    backoff.succeeded()
            await asyncio.sleep(delay)

    # -- scan ------------------------------------------------------------------------------------

    async def _scan_loop(self, term: Term) -> None:
        backoff = Backoff("scan")
        while True:
            self._changes.changed.clear()
            try:
                async with asyncio.timeout(_STEP_TIMEOUT_S):
                    await self._changes.listen()
                    full = await self.scan_once(term) if term.is_valid() else False
                self._scanned_at = time.monotonic()
                if not full:
                    await self._sleep_until_next_due()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                await asyncio.sleep(backoff.failed(exc))
            else:
                backoff.succeeded()

    async def _watch_progress(self, term: Term, step_down: Callable[[], None]) -> None:
        """Hand leadership over when the scan makes no progress (see `step_down` in the constructor).

        A leader cut off from PostgreSQL but not from Redis would otherwise renew its lock through
        the whole partition and fire nothing; a standby that reaches both can lead instead. If no
        scheduler reaches the stores, leadership just changes hands until one does.
        """
        limit = self._loop.step_down_after.total_seconds()
        while True:
            await asyncio.sleep(min(limit / 4, 0.5))
            stalled = time.monotonic() - self._scanned_at
            if stalled > limit:
                log.warning(
                    "leader makes no progress; handing leadership over",
                    extra={"term": term.token, "stalled_s": round(stalled, 1)},
                )
                step_down()
                return

    async def scan_once(self, term: Term) -> bool:
        """One scan: record and enqueue what is due. Returns True if the batch was full.

        One statement reads the jobs to fire (at most `scan_batch`): due ones, and `allow` ones due
        within `fire_ahead`, whose slots up to `fire_ahead` from now are recorded and enqueued now,
        delayed until due (`fires_ahead`); or, when none is to fire yet, those to fire within
        `plan_ahead`, recorded once that time is reached. Planning is arithmetic or
        cached (`schedule.next_instant`), and the slots are fired in chunks of `fire_chunk` jobs, each one
        fenced statement followed by its CREATED events and one enqueue call, with up to
        `fire_concurrency` chunks in flight: the first runs are in the queue while PostgreSQL is
        still recording the rest, instead of every run of the scan waiting for the slowest.
        """
        began = time.perf_counter()
        ahead = self._loop.fire_ahead
        read, now = await self._jobs.due(self._loop.scan_batch, self._loop.plan_ahead, ahead)
        read_at = time.monotonic()
        self.scans += 1
        if not read:
            metrics.SCAN_DUE_JOBS.observe(0)
            metrics.SCAN_DURATION.observe(time.perf_counter() - began)
            return False
        # A job is to fire at its next run, or `fire_ahead` before it (`fires_ahead`). Those whose
        # time has come fire now. Otherwise (all read ahead: to fire within `plan_ahead`) the jobs
        # of the earliest such time are planned as of it and recorded once the database clock
        # reaches it; later ones are left to the next scan, so no job waits for another's time.
        fire_at = {job.id: self._fire_at(job) for job in read}
        jobs = [job for job in read if fire_at[job.id] <= now]
        at = now
        if not jobs:
            at = min(fire_at.values())
            jobs = [job for job in read if fire_at[job.id] == at]
        metrics.SCAN_DUE_JOBS.observe(len(jobs))
        chunks: list[tuple[list[Job], Plan]] = []
        planned = slots = 0
        yielded = time.perf_counter()
        for job in jobs:
            if slots >= self._loop.max_slots_per_scan:
                break  # the rest stay due (their next_run_time is unchanged): the next scan takes them
            if (
                not chunks
                or len(chunks[-1][0]) >= self._loop.fire_chunk
                or len(chunks[-1][1].slots) >= self._loop.fire_chunk_slots
            ):
                chunks.append(([], Plan()))
            chunk_jobs, plan = chunks[-1]
            before = len(plan.slots)
            plan_job(job, at, self._loop, plan, until=at + ahead if fires_ahead(job) else at)
            chunk_jobs.append(job)
            planned += 1
            slots += len(plan.slots) - before
            # Planning a long catch-up is CPU work (~50 ms for 1000 slots): let the lease renewal
            # and the other loops run every few milliseconds, so a big batch never starves them.
            if time.perf_counter() - yielded > _PLAN_YIELD_S:
                await asyncio.sleep(0)
                yielded = time.perf_counter()
        # `now` is the database clock when the read began, before read_at: waiting from read_at
        # can only end late, never early, so no run is recorded before its slot.
        wait = (at - now).total_seconds() - (time.monotonic() - read_at)
        if wait > 0:
            await asyncio.sleep(wait)
        await self._fire_chunks(term, chunks)
        metrics.SCAN_DURATION.observe(time.perf_counter() - began)
        # Full, cut short, or jobs read ahead left for the next scan: scan again at once.
        return len(read) >= self._loop.scan_batch or planned < len(read)

    async def _fire_chunks(self, term: Term, chunks: Sequence[tuple[list[Job], Plan]]) -> None:
        """Fire every chunk, `fire_concurrency` at a time; raise the first failure once all are done.

        Chunks are independent (each its own fenced compare-and-set), so one failing leaves the
        others' slots recorded and its own jobs due: the next scan takes them again.
        """
        pending = iter(chunks)

        async def fire_some() -> None:
            for chunk_jobs, plan in pending:
                await self._fire(term, chunk_jobs, plan)

        results = await asyncio.gather(
            *(fire_some() for _ in range(min(self._loop.fire_concurrency, len(chunks)))), return_exceptions=True
        )
        for result in results:
            if isinstance(result, BaseException):
                raise result

    def _fire_at(self, job: Job) -> datetime:
        """When a job's next slot is to be recorded: at it, or `fire_ahead` before (`fires_ahead`)."""
        assert job.next_run_time is not None  # the due scan reads only jobs with a next run
        return job.next_run_time - self._loop.fire_ahead if fires_ahead(job) else job.next_run_time

    async def _fire(self, term: Term, jobs: Sequence[Job], plan: Plan) -> None:
        if tracing.enabled:
            await self._fire_traced(term, jobs, plan)
            return
        queued, fired_at = await self._firing.fire_clocked(term.token, plan.advances, plan.slots)
        await self._dispatch_fired(term, jobs, plan, queued, fired_at)

    async def _fire_traced(self, term: Term, jobs: Sequence[Job], plan: Plan) -> None:
        """`_fire` with a `run.fire` span per slot to run, each the root of its run's trace: its
        `traceparent` is recorded with the run, and the span ends once the run is enqueued."""
        spans = {
            index: tracing.start(
                "run.fire",
                attributes={
                    "scheduler.job_id": slot.job_id,
                    "scheduler.scheduled_for": slot.scheduled_for.isoformat(),
                    "scheduler.term": term.token,
                },
            )
            for index, slot in enumerate(plan.slots)
            if slot.status is ExecutionStatus.QUEUED
        }
        contexts = [tracing.traceparent(spans[i]) if i in spans else None for i in range(len(plan.slots))]
        try:
            queued, fired_at = await self._firing.fire_clocked(term.token, plan.advances, plan.slots, contexts)
            await self._dispatch_fired(term, jobs, plan, queued, fired_at)
        except BaseException as exc:
            for span in spans.values():
                tracing.span_error(span, repr(exc))
            raise
        finally:
            for span in spans.values():
                span.end()

    async def _dispatch_fired(
        self, term: Term, jobs: Sequence[Job], plan: Plan, queued: Sequence[Queued], fired_at: datetime
    ) -> None:
        fired = time.monotonic()
        # `replace`: the earlier runs are cancelled before the new ones can be claimed, so the two
        # overlap as little as possible (if this fails, reconcile enqueues the new runs later).
        await self._replace_earlier_runs(term, jobs, queued)
        # CREATED before the enqueue, so no STARTED of these runs can precede it (dispatch_new_runs).
        await self._announce(queued, plan.slots)
        # A run fired ahead waits in the delayed set until its slot. Its delay is counted from the
        # database clock read at the end of the fire statement, less the time spent here since:
        # both happened before the enqueue script reads the Redis clock, so the item is due no
        # sooner than its slot whatever the offset between the two clocks (and barely later).
        await enqueue_runs(self._queues, queued, fired_at + timedelta(seconds=time.monotonic() - fired))

    async def _replace_earlier_runs(self, term: Term, jobs: Sequence[Job], queued: Sequence[Queued]) -> None:
        """`replace` concurrency policy: a new run cancels the job's runs still queued or running."""
        replacing = {job.id for job in jobs if job.concurrency_policy is ConcurrencyPolicy.REPLACE}
        fresh_by_queue: dict[str, list[Queued]] = {}
        for run in queued:
            if run.job_id in replacing:
                fresh_by_queue.setdefault(run.queue, []).append(run)
        for queue, fresh in fresh_by_queue.items():
            earlier = await self._firing.open_run_ids(
                [run.job_id for run in fresh], excluding=[run.run_id for run in fresh]
            )
            if earlier:
                await cancel_runs(self._redis, self._queues, self._recovery, queue, earlier, term=term.token)
                log.info("replaced earlier runs", extra={"queue": queue, "runs": len(earlier)})

    async def _announce(self, queued: Sequence[Queued], slots: Sequence[PlannedSlot]) -> None:
        events = created_events(queued)
        ranges = [slot for slot in slots if slot.status is ExecutionStatus.MISSED]
        missed = sum(slot.missed_count or 1 for slot in ranges)
        if missed:
            log.warning("slots missed (misfire policy)", extra={"missed": missed, "ranges": len(ranges)})
        if events:
            await publish(self._redis, events)

    async def _sleep_until_next_due(self) -> None:
        cap = self._loop.scan_interval.total_seconds()
        until_due = await self._jobs.time_until_next_due(self._loop.fire_ahead)
        # Wake `plan_ahead` early: the scan reads and plans the slot's jobs, then waits for it.
        ahead = self._loop.plan_ahead.total_seconds()
        wait = cap if until_due is None else min(cap, max(0.0, until_due.total_seconds() - ahead))
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(wait):
                await self._changes.changed.wait()

    # -- recover, promote, reconcile ---------------------------------------------------------------

    async def _recover(self, term: Term) -> None:
        if self._limits_defined and await self._limit_sync.lost():
            # Redis lost its data while limits are in use: rebuild now, not at the next reconcile,
            # so runs made meanwhile cannot start beside runs that outlived the loss.
            log.warning("Redis lost the limit state; reconciling now")
            await self._reconcile(term)
        for queue in self._queues.known():
            while True:
                recovered = await queue.recover_expired(
                    MAX_BATCH, max_deliveries=self._loop.max_stalls, solo_retry_delay=self._loop.solo_retry_delay
                )
                if recovered.requeued:
                    metrics.LEASE_RECOVERIES.labels(queue.name).inc(len(recovered.requeued))
                    log.warning(
                        "leases expired; runs requeued", extra={"queue": queue.name, "runs": len(recovered.requeued)}
                    )
                    # Their attempts end now, not at the next claim: with no worker left to claim
                    # them, they would read `running` for as long as none comes. (If this fails,
                    # the next claim records them abandoned, as before.)
                    await self._recovery.abandon_expired(recovered.expired_leases())
                if recovered.dead:
                    try:
                        await self._record_stalled_dead(term, recovered.dead)
                    except BaseException:
                        # PostgreSQL did not record them dead (fenced, failed, cancelled): put the
                        # items back to ready rather than leave them dead in Redis only; they stall
                        # again and are recorded then. (If even this reply is lost, reconcile finds
                        # them dead in Redis and open in PostgreSQL, and records them.)
                        await asyncio.shield(queue.requeue_dead(recovered.dead))
                        raise
                    metrics.LEASE_RECOVERIES.labels(queue.name).inc(len(recovered.dead))
                if len(recovered.requeued) + len(recovered.dead) < MAX_BATCH:
                    break

    async def _record_stalled_dead(self, term: Term, run_ids: Sequence[str]) -> None:
        """Record runs Redis dead-lettered as stalled `dead` in PostgreSQL (fenced), and announce them."""
        limit = self._loop.max_stalls
        # Parked at the second solo stall (`Queue.recover_expired`): one more than the limit.
        reason = STALLED_REASON.format(times=limit + 1) if limit > 1 else STALLED_AT_ONCE_REASON
        async with self._recovery.fenced(term.token) as fenced:
            dead = await fenced.mark_runs_dead(run_ids, reason)
        metrics.DEAD_LETTERED.labels("stalled").inc(len(dead))
        await publish(self._redis, [
            ExecutionEvent(EventType.DEAD, e.id, e.run_id, e.job_id, e.attempt, error=reason) for e in dead
        ])  # fmt: skip
        log.error("runs dead-lettered after stalling", extra={"runs": list(run_ids)})

    async def _advance_flows(self, term: Term) -> None:
        """Advance open flow runs (job dependencies; see `scheduler_grpc.flowrun`)."""
        await flowrun.advance(self._flows, self._redis, self._queues, term.token)

    async def maintain_partitions(self, term: Term) -> None:
        """The execution history's day partitions: today and the days ahead created, and the days past
        the retention detached and dropped whole, except those holding an open run (`db/partitions.py`;
        each change fenced by the term, under a short lock timeout)."""
        await self._partitions.create_ahead(self._loop.execution_partitions_ahead, term=term.token)
        if self._loop.execution_retention_days:
            older_than = datetime.now(UTC) - timedelta(days=self._loop.execution_retention_days)
            await self._partitions.drop_before(older_than, term=term.token)

    async def _promote(self, term: Term) -> None:
        for queue in self._queues.known():
            while len(await queue.promote_due(MAX_BATCH)) >= MAX_BATCH:
                pass

    async def _reconcile(self, term: Term) -> None:
        """Repair what Redis and PostgreSQL disagree on (the outbox repair).

        * Runs PostgreSQL has open that Redis does not know: enqueued again.
        * A `queued` run that Redis has dead-lettered: the Redis half of a dead-letter requeue was
          lost; it is moved back to ready.
        * A run left `running` past its timeout that Redis has dead-lettered: the PostgreSQL half of
          the stalled dead-lettering was lost (`_recover`); it is recorded `dead`.
        """
        self._queues.known(await self._jobs.queue_names())
        # Limits first (issue 22): every definition put again (a Redis that lost them blocks the
        # runs that need them), and the units of runs still running counted again if Redis lost
        # them, before any run is enqueued again here; a run still counted so is not enqueued
        # (its item would take its units twice): it is, once PostgreSQL no longer has it running.
        self._limits_defined = await self._limit_sync.put_all() > 0
        _, held = await self._limit_sync.recount()
        after: str | None = None
        restored = 0
        while True:
            runs = await self._recovery.open_runs(
                older_than=self._loop.reconcile_grace, after_run_id=after, limit=MAX_BATCH
            )
            missing, dead = await self._redis_disagrees(runs)
            restored += await self._enqueue([run for run in missing if run.run_id not in held])
            for name, run_ids in dead.items():
                restored += len(await self._queues.get(name).requeue_dead(run_ids))
            if len(runs) < MAX_BATCH:
                break
            after = runs[-1].run_id
        stale = await self._recovery.stale_running_runs(grace=self._loop.stale_running_grace, limit=MAX_BATCH)
        missing, dead = await self._redis_disagrees(stale)
        # Past its timeout, a run still counted again is taken as gone: its units come back first.
        for run in missing:
            if run.run_id in held:
                await self._queues.get(run.queue).unhold([run.run_id])
        restored += await self._enqueue(missing)
        for run_ids in dead.values():
            await self._record_stalled_dead(term, run_ids)
        if restored:
            metrics.RECONCILE_REENQUEUED.inc(restored)
            log.warning("reconcile re-enqueued runs Redis had lost", extra={"runs": restored})
        parked = await self._restore_dead_letters()
        if parked:
            log.warning("reconcile rebuilt dead letters Redis had lost", extra={"runs": parked})

    async def _restore_dead_letters(self) -> int:
        """Park again in the dead-letter queue the dead runs Redis does not know (it lost them).

        PostgreSQL is the record: a run whose latest attempt is `dead` and that no operator purged
        belongs in its queue's dead set, with that attempt's error as the reason. Only runs Redis
        knows in no state are parked, so an item still on its way (a worker between recording
        `dead` and dead-lettering it) is left alone. A purge racing this rebuild can see its runs
        parked once more; the purge's mark stops any later rebuild, and a second purge removes them.
        """
        after: str | None = None
        parked = 0
        while True:
            dead = await self._recovery.dead_runs(after_run_id=after, limit=MAX_BATCH)
            for name, group in itertools.groupby(sorted(dead, key=lambda d: d.run.queue), key=lambda d: d.run.queue):
                batch = list(group)
                queue = self._queues.get(name)
                states = await queue.states(d.run.run_id for d in batch)
                missing = [d for d in batch if states.get(d.run.run_id) is None]
                if missing:
                    parked += await queue.restore_dead((queue_item(d.run, d.run.due_at), d.reason) for d in missing)
            if len(dead) < MAX_BATCH:
                return parked
            after = dead[-1].run.run_id

    async def _observe_queues(self, term: Term) -> None:
        waiting: dict[str, int] = {}
        for queue in self._queues.known():
            stats = await queue.stats()
            for state in ("ready", "processing", "delayed", "dead"):
                metrics.QUEUE_DEPTH.labels(queue.name, state).set(getattr(stats, state))
            metrics.QUEUE_SHARDS.labels(queue.name).set(stats.shards)
            for band, count in (await queue.ready_by_band()).items():
                metrics.QUEUE_READY_BY_PRIORITY.labels(queue.name, band).set(count)
            for name, count in (await queue.waiting_by_limit()).items():
                waiting[name] = waiting.get(name, 0) + count
        # By limit name over every queue; a limit with nothing waiting any more reads 0.
        for name in self._limits_seen | waiting.keys():
            metrics.LIMIT_RUNS_WAITING.labels(name).set(waiting.get(name, 0))
        self._limits_seen |= waiting.keys()

    async def _redis_disagrees(self, runs: Sequence[Queued]) -> tuple[list[Queued], dict[str, list[str]]]:
        """Of open runs, those Redis knows in no state, and (by queue) the ids it has dead-lettered."""
        missing: list[Queued] = []
        dead: dict[str, list[str]] = {}
        runs_by_queue = itertools.groupby(sorted(runs, key=lambda run: run.queue), key=lambda run: run.queue)
        for name, group in runs_by_queue:
            batch = list(group)
            states = await self._queues.get(name).states(run.run_id for run in batch)
            missing += [run for run in batch if states.get(run.run_id) is None]
            if parked := [run.run_id for run in batch if states.get(run.run_id) is ItemState.DEAD]:
                dead[name] = parked
        return missing, dead

    async def _enqueue(self, runs: Sequence[Queued]) -> int:
        if not runs:
            return 0
        now = await self._jobs.database_now()
        return await enqueue_runs(self._queues, runs, now)


def holder_name() -> str:
    return f"{os.environ.get('SCHEDULER_INSTANCE') or socket.gethostname()}:{os.getpid()}"


async def run_scheduler(settings: Settings, args: argparse.Namespace, stop: asyncio.Event) -> int:
    """`scheduler-grpc scheduler`: campaign for leadership; lead until stopped."""
    port = settings.metrics_port if settings.metrics_port is not None else DEFAULT_METRICS_PORT
    async with connect(settings) as conns, metrics.serve(settings.metrics_host, port):
        elector = LeaderElector(
            conns.redis, LeadershipRepository(conns.pool), holder=holder_name(), ttl=settings.leader_ttl
        )
        loops = LeaderLoops(
            conns.redis, conns.pool, LoopSettings.from_settings(settings),
            default_queue=settings.queue, step_down=elector.resign,
        )  # fmt: skip
        campaign = asyncio.create_task(elector.run(loops.lead), name="campaign")
        stopper = asyncio.create_task(stop.wait(), name="stop")
        await asyncio.wait([campaign, stopper], return_when=asyncio.FIRST_COMPLETED)
        stopper.cancel()
        campaign.cancel()  # the elector releases the lock gracefully: a standby takes over at once
        await asyncio.wait([campaign])
        # The campaign never ends on its own but for a bug (store errors are retried in it): say
        # so with the traceback, and exit non-zero so a supervisor restarts the process.
        failure = None if campaign.cancelled() else campaign.exception()
        if failure is not None:
            log.critical("scheduler failed with a bug; exiting", exc_info=failure)
            return 1
        log.info("scheduler stopped")
    return 0
