"""Cancellation and concurrency policies, with real scheduler and worker processes."""

from __future__ import annotations

import itertools
from datetime import timedelta

import asyncpg
import pytest
import redis.asyncio as aioredis

from scheduler_grpc.control import Control
from scheduler_grpc.errors import FailedPrecondition
from scheduler_grpc.jobs import ConcurrencyPolicy, JobSpec, ScheduleKind
from scheduler_grpc.queue import Queue
from tests.engine_helpers import Roles, eventually, wait_until_ready


async def latest_status(pool: asyncpg.Pool, run_id: str) -> str:
    return str(
        await pool.fetchval("SELECT status FROM job_executions WHERE run_id = $1 ORDER BY attempt DESC LIMIT 1", run_id)
    )


async def test_cancelling_a_queued_run_removes_it_from_the_queue(
    control: Control, pool: asyncpg.Pool, redis: aioredis.Redis
) -> None:
    job = await control.create_job(JobSpec(name="waits", handler="test.echo"))
    run = (await control.trigger_job(job.id))[0]
    cancelled = await control.cancel_execution(run.run_id)
    assert cancelled.status == "cancelled"
    assert await latest_status(pool, run.run_id) == "cancelled"
    assert (await Queue(redis).states([run.run_id]))[run.run_id] is None
    with pytest.raises(FailedPrecondition):
        await control.cancel_execution(run.run_id)


async def test_cancelling_a_running_run_stops_its_handler_on_the_worker(
    roles: Roles, control: Control, pool: asyncpg.Pool, redis: aioredis.Redis
) -> None:
    roles.start("scheduler")
    worker = roles.start("worker")
    await wait_until_ready(redis, workers=1)
    job = await control.create_job(JobSpec(name="long", handler="test.delay", payload={"seconds": 60}))
    run = (await control.trigger_job(job.id))[0]

    async def running() -> bool:
        return await latest_status(pool, run.run_id) == "running"

    await eventually(running, within=15)
    assert (await control.cancel_execution(run.run_id)).status == "running"

    async def cancelled() -> bool:
        return await latest_status(pool, run.run_id) == "cancelled"

    await eventually(cancelled, within=5)
    assert worker.process.poll() is None
    echo = await control.create_job(JobSpec(name="after", handler="test.echo"))
    after = (await control.trigger_job(echo.id))[0]

    async def after_done() -> bool:
        return await latest_status(pool, after.run_id) == "succeeded"

    await eventually(after_done, within=10)


@pytest.mark.parametrize(
    ("policy", "overlap_status"), [(ConcurrencyPolicy.FORBID, "skipped"), (ConcurrencyPolicy.REPLACE, "cancelled")]
)
async def test_overlapping_slots_follow_the_concurrency_policy(  # noqa: PLR0917 - pytest fixtures
    roles: Roles,
    control: Control,
    pool: asyncpg.Pool,
    redis: aioredis.Redis,
    policy: ConcurrencyPolicy,
    overlap_status: str,
) -> None:
    roles.start("scheduler")
    roles.start("worker")
    await wait_until_ready(redis, workers=1)
    job = await control.create_job(
        JobSpec(
            name="overlaps",
            handler="test.delay",
            payload={"seconds": 2.5},
            schedule_kind=ScheduleKind.CRON,
            cron="* * * * * *",
            concurrency_policy=policy,
        )
    )

    async def enough() -> list[asyncpg.Record]:
        rows = await pool.fetch(
            "SELECT scheduled_for, status, started_at, finished_at FROM job_executions WHERE job_id = $1 "
            "ORDER BY scheduled_for",
            job.id,
        )
        return rows if sum(row["status"] == overlap_status for row in rows) >= 3 else []

    rows = await eventually(enough, within=30)
    await control.pause_job(job.id)
    slots = [row["scheduled_for"] for row in rows]
    assert len(slots) == len(set(slots))
    assert all(b - a == timedelta(seconds=1) for a, b in itertools.pairwise(slots)), "every slot has a row"
    # Never two runs of the job at once: each run starts after the one before it ended.
    ran = [row for row in rows if row["started_at"] is not None and row["finished_at"] is not None]
    for before, after in itertools.pairwise(ran):
        assert after["started_at"] >= before["finished_at"] - timedelta(milliseconds=50), (before, after)
