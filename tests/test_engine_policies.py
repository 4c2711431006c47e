"""Cancellation and concurrency policies: the fire statement's decisions, and real scheduler and
worker processes."""

from __future__ import annotations

import itertools
import signal
import time
from datetime import UTC, datetime, timedelta

import asyncpg
import pytest
import redis.asyncio as aioredis

from scheduler_grpc.control import Control
from scheduler_grpc.db.executions import Advance, PlannedSlot
from scheduler_grpc.db.firing import FiringRepository
from scheduler_grpc.db.leadership import LeadershipRepository, TermRecord
from scheduler_grpc.errors import FailedPrecondition
from scheduler_grpc.executions import ExecutionStatus
from scheduler_grpc.jobs import ConcurrencyPolicy, JobSpec, ScheduleKind
from scheduler_grpc.leader import Term
from scheduler_grpc.queue import ItemState, Queue
from scheduler_grpc.scheduler import LeaderLoops, LoopSettings
from tests.engine_helpers import Roles, eventually, wait_until_ready


async def latest_status(pool: asyncpg.Pool, run_id: str) -> str:
    return str(
        await pool.fetchval("SELECT status FROM job_executions WHERE run_id = $1 ORDER BY attempt DESC LIMIT 1", run_id)
    )


@pytest.mark.cluster_too
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


@pytest.mark.cluster_too
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


# -- forbid and replace between slots recorded together ------------------------------------------------


def every_second(name: str, **fields: object) -> JobSpec:
    return JobSpec(name=name, handler="test.echo", schedule_kind=ScheduleKind.CRON, cron="* * * * * *", **fields)  # type: ignore[arg-type]


def _term(record: TermRecord) -> Term:
    """A term as its elector holds it, locally valid for a minute."""
    term = Term(token=record.term, holder=record.holder, lease_id=f"{record.holder}:x",
                acquired_at=record.acquired_at, scope=record.scope)  # fmt: skip
    now = time.monotonic()
    term._renewed(now, now + 60)
    return term


async def _fire_together(
    control: Control, pool: asyncpg.Pool, policy: ConcurrencyPolicy, *, missed: bool = False, open_before: bool = False
) -> list[str]:
    """Fire four slots of one per-second job (after a `missed` range, and with a run open, if asked)
    in ONE fire statement, as a leader does after a pause; the statuses recorded, by slot."""
    job = await control.create_job(every_second(f"together-{policy.value}", concurrency_policy=policy))
    if open_before:
        await control.trigger_job(job.id)
    first = datetime(2030, 1, 1, tzinfo=UTC)
    slots = [first + timedelta(seconds=index) for index in range(4)]
    await pool.execute("UPDATE jobs SET next_run_time = $2 WHERE id = $1", job.id, first)
    term = await LeadershipRepository(pool).begin_term("scheduler", "test")
    assert term is not None
    planned = [PlannedSlot(job.id, slot, ExecutionStatus.QUEUED, slot) for slot in slots]
    if missed:
        gone = first - timedelta(seconds=1)
        planned.insert(0, PlannedSlot(job.id, gone, ExecutionStatus.MISSED, gone, gone, 1))
    advance = Advance(job.id, first, slots[-1] + timedelta(seconds=1))
    queued = await FiringRepository(pool).fire(term.term, [advance], planned)
    rows = await pool.fetch(
        "SELECT run_id::text, status FROM job_executions WHERE job_id = $1 AND trigger = 'schedule' "
        "ORDER BY scheduled_for",
        job.id,
    )
    assert [run.run_id for run in queued] == [row["run_id"] for row in rows if row["status"] == "queued"]
    return [row["status"] for row in rows]


@pytest.mark.parametrize(
    ("policy", "missed", "open_before", "expected"),
    [
        # forbid: the first slot runs, the others would overlap it.
        (ConcurrencyPolicy.FORBID, False, False, ["queued", "skipped", "skipped", "skipped"]),
        # ...and none runs while a run from before the statement is open.
        (ConcurrencyPolicy.FORBID, False, True, ["skipped", "skipped", "skipped", "skipped"]),
        (ConcurrencyPolicy.FORBID, True, False, ["missed", "queued", "skipped", "skipped", "skipped"]),
        # replace: the newest slot runs; the earlier ones of the statement never do.
        (ConcurrencyPolicy.REPLACE, False, False, ["skipped", "skipped", "skipped", "queued"]),
        (ConcurrencyPolicy.REPLACE, True, True, ["missed", "skipped", "skipped", "skipped", "queued"]),
        (ConcurrencyPolicy.ALLOW, False, True, ["queued", "queued", "queued", "queued"]),
    ],
)
async def test_slots_of_one_job_fired_together_follow_its_concurrency_policy(  # noqa: PLR0917 - parameters
    control: Control,
    pool: asyncpg.Pool,
    policy: ConcurrencyPolicy,
    missed: bool,
    open_before: bool,
    expected: list[str],
) -> None:
    assert await _fire_together(control, pool, policy, missed=missed, open_before=open_before) == expected


async def test_a_scan_after_a_pause_replaces_the_open_run_with_the_newest_slot_only(
    control: Control, pool: asyncpg.Pool, redis: aioredis.Redis
) -> None:
    """The leader's whole path (plan, fire, cancel the runs open before): of the slots a pause
    left due, the newest runs; the earlier run open before the scan is cancelled."""
    term = await LeadershipRepository(pool).begin_term("scheduler", "test")
    assert term is not None
    loops = LeaderLoops(redis, pool, LoopSettings())
    job = await control.create_job(every_second("replaced", concurrency_policy=ConcurrencyPolicy.REPLACE))
    [earlier] = await control.trigger_job(job.id)
    await pool.execute("UPDATE jobs SET next_run_time = date_trunc('second', now()) - interval '4 seconds'")
    await loops.scan_once(_term(term))
    rows = await pool.fetch(
        "SELECT run_id::text, status FROM job_executions WHERE job_id = $1 AND trigger = 'schedule' "
        "ORDER BY scheduled_for",
        job.id,
    )
    statuses = [row["status"] for row in rows]
    assert len(statuses) >= 5
    assert statuses == ["skipped"] * (len(statuses) - 1) + ["queued"]
    assert await latest_status(pool, earlier.run_id) == "cancelled"
    newest = rows[-1]["run_id"]
    assert set((await Queue(redis, "default").states([earlier.run_id, newest])).values()) == {None, ItemState.READY}


async def _no_run_open(pool: asyncpg.Pool, job_id: str) -> bool:
    return not await pool.fetchval(
        "SELECT count(*) FROM job_executions WHERE job_id = $1 AND finished_at IS NULL", job_id
    )


async def test_a_forbid_job_never_runs_twice_at_once_after_both_schedulers_pause(
    roles: Roles, control: Control, pool: asyncpg.Pool, redis: aioredis.Redis
) -> None:
    """Issue 19, defect 7: the slots a pause of every scheduler left due are recorded in one
    statement; under `forbid` at most one of them may run, and only once the run before is over."""
    schedulers = [roles.start("scheduler"), roles.start("scheduler")]
    roles.start("worker")
    await wait_until_ready(redis, workers=1)
    job = await control.create_job(
        JobSpec(name="forbids", handler="test.delay", payload={"seconds": 3}, schedule_kind=ScheduleKind.CRON,
                cron="* * * * * *", concurrency_policy=ConcurrencyPolicy.FORBID)
    )  # fmt: skip

    async def running() -> str:
        run_id = await pool.fetchval(
            "SELECT run_id::text FROM job_executions WHERE job_id = $1 AND status = 'running'", job.id
        )
        return str(run_id or "")

    async def pause_both_while_a_run_ends() -> bool:
        """SIGSTOP both schedulers while a run is running, for 4 s and until it has ended, so no run
        is open when they resume; True if their first fire then recorded several slots at once
        (the case under test; not so if a leader had planned one slot just before the pause)."""
        run_id = await eventually(running, within=20)
        for scheduler in schedulers:
            scheduler.signal(signal.SIGSTOP)
        paused_at = time.monotonic()

        async def over() -> bool:
            return time.monotonic() - paused_at >= 4 and await latest_status(pool, run_id) == "succeeded"

        await eventually(over, within=15)
        ended = await pool.fetchval("SELECT max(finished_at) FROM job_executions WHERE run_id = $1", run_id)
        for scheduler in schedulers:
            scheduler.signal(signal.SIGCONT)

        async def first_fire_after() -> int:
            return int(
                await pool.fetchval(
                    """SELECT count(*) FROM job_executions WHERE job_id = $1 AND created_at = (
                           SELECT min(created_at) FROM job_executions WHERE job_id = $1 AND created_at > $2)""",
                    job.id,
                    ended,
                )
            )

        return await eventually(first_fire_after, within=15) >= 3

    for _ in range(3):
        if await pause_both_while_a_run_ends():
            break
    else:
        pytest.fail("no pause left several slots due at once")
    await control.pause_job(job.id)
    await eventually(lambda: _no_run_open(pool, job.id), within=20)
    assert all(scheduler.process.poll() is None for scheduler in schedulers)
    attempts = await pool.fetch(
        "SELECT run_id, attempt, started_at, finished_at FROM job_executions "
        "WHERE job_id = $1 AND started_at IS NOT NULL ORDER BY started_at",
        job.id,
    )
    assert len(attempts) >= 2
    for before, after in itertools.pairwise(attempts):
        assert after["started_at"] >= before["finished_at"], f"two attempts ran at once: {before} and {after}"
