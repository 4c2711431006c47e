"""The application layer (`Control`) in-process against the real stores: what the servicers used to
do themselves (merge-and-retry updates, idempotent triggers, backfills, requeue-all)."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest
import redis.asyncio as aioredis

from scheduler_grpc.control import MAX_BACKFILL_SLOTS, Control
from scheduler_grpc.errors import Aborted, InvalidArgument
from scheduler_grpc.executions import ExecutionStatus, Trigger
from scheduler_grpc.jobs import Job, JobSpec, ScheduleKind
from scheduler_grpc.queue import NewItem, Queue


def minutely(name: str) -> JobSpec:
    return JobSpec(name=name, handler="test.echo", schedule_kind=ScheduleKind.CRON, cron="* * * * *")


async def test_a_merge_is_redone_on_the_version_a_concurrent_write_left(
    control: Control, monkeypatch: pytest.MonkeyPatch
) -> None:
    job = await control.create_job(minutely("merged"))
    seen: list[int] = []

    def raise_priority(current: Job) -> JobSpec:
        seen.append(current.version)
        return replace(current, priority=current.priority + 1)

    update = control._jobs.update
    interfered = False

    async def update_after_someone_else(job_id: str, spec: JobSpec, next_run: datetime | None, version: int) -> Job:
        # Someone else's write lands between the merge's read and its update, once.
        nonlocal interfered
        if not interfered:
            interfered = True
            current = await control.get_job(job_id)
            await update(job_id, replace(current, payload={"by": "someone else"}), current.next_run_time, version)
        return await update(job_id, spec, next_run, version)

    monkeypatch.setattr(control._jobs, "update", update_after_someone_else)
    updated = await control.merge_job(job.id, raise_priority)
    assert seen == [1, 2], "the merge must run again on the version the other write left"
    assert (updated.version, updated.priority, updated.payload) == (3, 1, {"by": "someone else"})

    # With an expected version the caller asked for that version: a stale one is refused.
    with pytest.raises(Aborted):
        await control.merge_job(job.id, raise_priority, expected_version=1)
    assert (await control.get_job(job.id)).version == 3


async def test_a_trigger_with_a_request_id_answers_its_first_run_again(control: Control) -> None:
    job = await control.create_job(replace(minutely("triggered"), schedule_kind=ScheduleKind.MANUAL, cron=None))
    first = await control.trigger_execution(job.id, request_id="once")
    again = await control.trigger_execution(job.id, request_id="once")
    other = await control.trigger_execution(job.id)
    assert again.id == first.id
    assert other.id != first.id
    assert [e.trigger for e in await control._history.history(job.id)] == [Trigger.MANUAL, Trigger.MANUAL]


async def test_a_backfill_creates_each_missing_slot_once_in_slot_order(control: Control) -> None:
    job = await control.create_job(minutely("backfilled"))
    end = datetime.now(UTC).replace(second=0, microsecond=0)
    start = end - timedelta(minutes=5)
    executions = await control.backfill_range(job.id, start, end)
    assert [e.scheduled_for for e in executions] == [start + timedelta(minutes=m) for m in range(5)]
    assert {(e.trigger, e.status, e.attempt) for e in executions} == {(Trigger.BACKFILL, ExecutionStatus.QUEUED, 1)}
    assert await control.backfill_range(job.id, start - timedelta(minutes=1), end) != []
    assert await control.backfill_range(job.id, start, end) == []  # every slot has its run already
    with pytest.raises(InvalidArgument, match="end_time"):
        await control.backfill_range(job.id, end - timedelta(minutes=MAX_BACKFILL_SLOTS + 1), end)
    with pytest.raises(InvalidArgument, match="end_time"):
        await control.backfill_range(job.id, start, datetime.now(UTC) + timedelta(minutes=1))


async def test_requeue_all_moves_every_dead_run_back_and_leaves_foreign_items(
    control: Control, redis: aioredis.Redis
) -> None:
    job = await control.create_job(replace(minutely("requeued"), schedule_kind=ScheduleKind.MANUAL, cron=None))
    runs = [(await control.trigger_job(job.id))[0] for _ in range(3)]
    await control._recovery.mark_runs_dead([run.run_id for run in runs], "test")
    queue = Queue(redis, "default")
    await queue.enqueue_many([NewItem("not-a-run", 0, "", None)])  # a foreign item: it stays
    for lease in await queue.dequeue("test-worker", timedelta(seconds=30), count=10):
        await queue.dead_letter(lease.id, lease.token, "test")
    assert (await queue.stats()).dead == 4
    requeued = await control.requeue_dead_runs("default", None)
    assert sorted(run.run_id for run in requeued) == sorted(run.run_id for run in runs)
    assert [item.id for item in (await queue.list_dead()).items] == ["not-a-run"]
    latest = {e.run_id: e for e in await control._history.history(job.id)}
    assert {e.trigger for e in latest.values()} == {Trigger.DLQ_REQUEUE}
