"""Bulk actions (`control_bulk`) against the real stores: by ids and by filter, in batches, pinned to
the moment they start, bounded, and idempotent on what they already changed."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest
import redis.asyncio as aioredis

from scheduler_grpc import control_bulk
from scheduler_grpc.control import Control
from scheduler_grpc.control_bulk import ExecutionAction, JobAction, Search
from scheduler_grpc.db import bulk as db_bulk
from scheduler_grpc.db.bulk import JobFilter
from scheduler_grpc.errors import InvalidArgument
from scheduler_grpc.executions import ExecutionStatus, Trigger
from scheduler_grpc.jobs import JobSpec, JobStatus, ScheduleKind
from scheduler_grpc.queue import Queue


def manual(name: str, handler: str = "test.echo") -> JobSpec:
    return JobSpec(name=name, handler=handler, schedule_kind=ScheduleKind.MANUAL)


def minutely(name: str) -> JobSpec:
    return JobSpec(name=name, handler="test.echo", schedule_kind=ScheduleKind.CRON, cron="* * * * *")


async def test_cancel_by_filter_in_batches_touches_only_what_matched_before_it_started(
    control: Control, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(db_bulk, "BATCH", 7)  # many batches out of a few runs
    monkeypatch.setattr(control_bulk, "BATCH", 7)
    target = await control.create_job(manual("nightly-export"))
    other = await control.create_job(manual("hourly-import"))
    runs = [(await control.trigger_job(target.id))[0].run_id for _ in range(30)]
    others = [(await control.trigger_job(other.id))[0].run_id for _ in range(3)]
    bulk = control.bulk
    search = Search(job_name="EXPORT", states=("queued",))

    preview = await bulk.executions(ExecutionAction.CANCEL, search=search, validate_only=True)
    assert (preview.matched, preview.done) == (30, [])
    outcome = await bulk.executions(ExecutionAction.CANCEL, search=search)
    assert (outcome.matched, sorted(outcome.done)) == (30, sorted(runs))
    latest = {e.run_id: e.status for e in await control._history.history(target.id)}
    assert set(latest.values()) == {ExecutionStatus.CANCELLED}
    assert {e.status for e in await control._history.history(other.id)} == {ExecutionStatus.QUEUED}
    assert (await control._queues.get("default").stats()).ready == len(others)

    # Nothing left to match: a second cancel changes nothing.
    again = await bulk.executions(ExecutionAction.CANCEL, search=search)
    assert (again.matched, again.done) == (0, [])


async def test_retry_gives_cancelled_runs_a_new_attempt_and_requeues_dead_ones_from_the_dlq(
    control: Control, redis: aioredis.Redis
) -> None:
    job = await control.create_job(manual("flaky"))
    cancelled = [(await control.trigger_job(job.id))[0].run_id for _ in range(2)]
    dead = [(await control.trigger_job(job.id))[0].run_id for _ in range(2)]
    bulk = control.bulk
    await bulk.executions(ExecutionAction.CANCEL, ids=cancelled)
    await control._recovery.mark_runs_dead(dead, "test")
    queue = Queue(redis, "default")
    for lease in await queue.dequeue("test-worker", timedelta(seconds=30), count=10):
        await queue.dead_letter(lease.id, lease.token, "test")
    assert (await queue.stats()).dead == 2

    requeued = await bulk.executions(ExecutionAction.REQUEUE, ids=[*cancelled, *dead])
    assert sorted(requeued.done) == sorted(dead), "requeue is for dead runs only"
    assert (await queue.stats()).dead == 0
    retried = await bulk.executions(ExecutionAction.RETRY, ids=cancelled)
    assert sorted(retried.done) == sorted(cancelled)
    latest: dict[str, tuple[int, ExecutionStatus, Trigger]] = {}
    for e in await control._history.history(job.id):
        if e.attempt > latest.get(e.run_id, (0,))[0]:
            latest[e.run_id] = (e.attempt, e.status, e.trigger)
    assert {run: value[1:] for run, value in latest.items()} == {
        run: (ExecutionStatus.QUEUED, Trigger.DLQ_REQUEUE) for run in [*cancelled, *dead]
    }
    assert (await queue.stats()).ready == 4
    # Open runs are not retried again.
    assert (await bulk.executions(ExecutionAction.RETRY, ids=cancelled)).done == []


async def test_a_filter_matching_too_many_is_refused_naming_the_filter(
    control: Control, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(control_bulk, "MAX_BULK", 3)
    job = await control.create_job(manual("busy"))
    for _ in range(4):
        await control.trigger_job(job.id)
    bulk = control.bulk
    with pytest.raises(InvalidArgument) as caught:
        await bulk.executions(ExecutionAction.CANCEL, search=Search(job_id=job.id))
    assert caught.value.field == "filter"
    assert {e.status for e in await control._history.history(job.id)} == {ExecutionStatus.QUEUED}
    with pytest.raises(InvalidArgument) as caught:
        await bulk.executions(ExecutionAction.CANCEL, ids=["not-a-uuid"])
    assert caught.value.field == "ids"
    with pytest.raises(InvalidArgument) as caught:
        await bulk.executions(ExecutionAction.CANCEL, search=Search(states=("sleeping",)))
    assert caught.value.field == "states"
    with pytest.raises(InvalidArgument):
        await bulk.executions(ExecutionAction.CANCEL)


@pytest.mark.parametrize(
    ("search", "field"),
    [
        (Search(job_name="a\x00b"), "job_name"),
        (Search(handler="test.\x00"), "handler"),
        (Search(queue="q\x00"), "queue"),
        (Search(error="boom\x00"), "error"),
    ],
)
async def test_a_nul_in_an_executions_filter_is_refused_naming_its_field(
    control: Control, search: Search, field: str
) -> None:
    """The console's forms reach these filters without the gRPC layer's NUL check: PostgreSQL would
    refuse the text (an error page, not a form error) had Control not refused it first."""
    job = await control.create_job(manual("nul"))
    await control.trigger_job(job.id)
    with pytest.raises(InvalidArgument) as caught:
        await control.bulk.executions(ExecutionAction.CANCEL, search=search)
    assert caught.value.field == field
    assert {e.status for e in await control._history.history(job.id)} == {ExecutionStatus.QUEUED}


@pytest.mark.parametrize(
    ("search", "field"),
    [
        (JobFilter(name="a\x00"), "filter.name_contains"),
        (JobFilter(handler="\x00"), "filter.handler"),
        (JobFilter(queue="\x00q"), "filter.queue"),
    ],
)
async def test_a_nul_in_a_jobs_filter_is_refused_naming_its_field(
    control: Control, search: JobFilter, field: str
) -> None:
    job = await control.create_job(manual("nul"))
    with pytest.raises(InvalidArgument) as caught:
        await control.bulk.jobs(JobAction.PAUSE, search=search)
    assert caught.value.field == field
    assert (await control.get_job(job.id)).status is JobStatus.ACTIVE


async def test_pause_resume_and_delete_jobs_by_filter(control: Control, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(db_bulk, "BATCH", 4)
    monkeypatch.setattr(control_bulk, "BATCH", 4)
    reports = [await control.create_job(minutely(f"report-{n:02d}")) for n in range(10)]
    keep = await control.create_job(minutely("billing"))
    bulk = control.bulk

    paused = await bulk.jobs(JobAction.PAUSE, search=JobFilter(name="report"))
    assert (paused.matched, len(paused.done)) == (10, 10)
    assert {(await control._jobs.get(j.id)).status for j in reports} == {JobStatus.PAUSED}
    assert (await control._jobs.get(keep.id)).status is JobStatus.ACTIVE
    assert (await control._jobs.get(reports[0].id)).next_run_time is None

    resumed = await bulk.jobs(JobAction.RESUME, ids=[j.id for j in reports[:3]])
    assert sorted(resumed.done) == sorted(j.id for j in reports[:3])
    after = await control._jobs.get(reports[0].id)
    assert after.status is JobStatus.ACTIVE
    assert after.next_run_time is not None
    assert after.next_run_time > datetime.now(UTC) - timedelta(seconds=1)
    assert (await bulk.jobs(JobAction.RESUME, ids=[reports[0].id])).done == [], "already active"

    counted = await bulk.jobs(JobAction.DELETE, search=JobFilter(name="report", state="paused"), validate_only=True)
    assert (counted.matched, counted.done) == (7, [])
    deleted = await bulk.jobs(JobAction.DELETE, search=JobFilter(name="report", state="paused"))
    assert sorted(deleted.done) == sorted(j.id for j in reports[3:])
    remaining = await db_bulk.BulkQueries(control._pool).count_jobs(JobFilter(), 100)
    assert remaining == 4


async def test_deleting_keeps_a_job_others_depend_on_unless_detached(control: Control) -> None:
    upstream = await control.create_job(manual("extract"))
    downstream = await control.create_job(replace(manual("load"), depends_on=(upstream.id,)))
    bulk = control.bulk
    outcome = await bulk.jobs(JobAction.DELETE, ids=[upstream.id])
    assert (outcome.done, outcome.kept) == ([], [upstream.id])
    together = await bulk.jobs(JobAction.DELETE, ids=[upstream.id, downstream.id])
    assert sorted(together.done) == sorted([upstream.id, downstream.id])
