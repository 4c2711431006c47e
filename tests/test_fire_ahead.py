"""Firing ahead: slots of `allow` jobs are recorded and enqueued (delayed) before they are due, and
start at their slot, never before; workers take delayed work at its due time by themselves.

Real processes where the timing is the point (a scheduler and a worker against the real stores), the
in-process leader loops where a scan's decision or a lost Redis must be looked at step by step.
"""

from __future__ import annotations

import asyncio
import time
from datetime import timedelta

import asyncpg
import redis.asyncio as aioredis

from scheduler_grpc.control import Control
from scheduler_grpc.db.leadership import LeadershipRepository
from scheduler_grpc.jobs import ConcurrencyPolicy, JobSpec, ScheduleKind
from scheduler_grpc.leader import Term
from scheduler_grpc.queue import ItemState, NewItem, Queue
from scheduler_grpc.scheduler import LeaderLoops, LoopSettings
from tests.engine_helpers import Roles, eventually, wait_until_ready

VT = timedelta(seconds=30)


def every_second(name: str, **fields: object) -> JobSpec:
    return JobSpec(name=name, handler="test.echo", schedule_kind=ScheduleKind.CRON, cron="* * * * * *", **fields)  # type: ignore[arg-type]


async def _term(pool: asyncpg.Pool) -> Term:
    record = await LeadershipRepository(pool).begin_term("scheduler", "test-leader")
    assert record is not None
    term = Term(token=record.term, holder=record.holder, lease_id=f"{record.holder}:x",
                acquired_at=record.acquired_at, scope=record.scope)  # fmt: skip
    now = time.monotonic()
    term._renewed(now, now + 60)
    return term


async def test_slots_fired_ahead_start_at_their_slot_and_never_before(
    roles: Roles, control: Control, pool: asyncpg.Pool, redis: aioredis.Redis
) -> None:
    roles.start("scheduler", SCHEDULER_FIRE_AHEAD="1s")
    roles.start("worker")
    await wait_until_ready(redis, workers=1)
    jobs = [await control.create_job(every_second(f"tick-{index}")) for index in range(5)]
    ids = [job.id for job in jobs]

    async def started() -> list[asyncpg.Record]:
        rows = await pool.fetch(
            """SELECT scheduled_for, created_at, started_at FROM job_executions
               WHERE job_id = ANY($1::uuid[]) AND started_at IS NOT NULL ORDER BY scheduled_for""",
            ids,
        )
        return rows if len(rows) >= 25 else []

    rows = await eventually(started, within=30)
    # The first slot of a new job may be due before any scan saw the job; the later ones were all
    # recorded ahead of their slot.
    later = [row for row in rows if row["scheduled_for"] > rows[0]["scheduled_for"] + timedelta(seconds=1)]
    assert later
    assert all(row["created_at"] < row["scheduled_for"] for row in later), "not recorded ahead of the slot"
    lateness = sorted((row["started_at"] - row["scheduled_for"]).total_seconds() for row in later)
    assert lateness[0] >= 0, f"a run started {-lateness[0] * 1000:.1f} ms before its slot"
    # Small: what is left is the worker's dequeue and claim, not the leader's fire (a loaded host
    # has to fit too, so a generous bound; an idle one shows a few milliseconds).
    assert lateness[len(lateness) // 2] < 0.2, lateness
    assert lateness[-1] < 0.75, lateness


async def test_forbid_and_replace_jobs_are_not_fired_ahead(
    control: Control, pool: asyncpg.Pool, redis: aioredis.Redis
) -> None:
    term = await _term(pool)
    loops = LeaderLoops(redis, pool, LoopSettings(fire_ahead=timedelta(seconds=3)))
    allow = await control.create_job(every_second("allow"))
    forbid = await control.create_job(every_second("forbid", concurrency_policy=ConcurrencyPolicy.FORBID))
    replace = await control.create_job(every_second("replace", concurrency_policy=ConcurrencyPolicy.REPLACE))
    slot = await pool.fetchval(
        "UPDATE jobs SET next_run_time = date_trunc('second', now()) + interval '2 seconds' RETURNING next_run_time"
    )
    await loops.scan_once(term)
    rows = await pool.fetch("SELECT job_id::text, run_id::text, scheduled_for, created_at FROM job_executions")
    assert {row["job_id"] for row in rows} == {allow.id}, "only the allow job fires ahead"
    assert all(row["created_at"] < row["scheduled_for"] for row in rows)
    assert slot in {row["scheduled_for"] for row in rows}
    states = await Queue(redis).states(row["run_id"] for row in rows)
    assert set(states.values()) == {ItemState.DELAYED}, "a run fired ahead waits, delayed, until its slot"
    nexts = dict(await pool.fetch("SELECT id::text, next_run_time FROM jobs WHERE id = ANY($1::uuid[])",
                                  [forbid.id, replace.id]))  # fmt: skip
    assert nexts == {forbid.id: slot, replace.id: slot}

    # They fire at their slot, not before.
    async def fired() -> list[asyncpg.Record]:
        await loops.scan_once(term)
        return await pool.fetch(
            """SELECT scheduled_for, created_at FROM job_executions
               WHERE job_id = ANY($1::uuid[]) AND scheduled_for = $2""",
            [forbid.id, replace.id],
            slot,
        )

    late = await eventually(fired, within=10)
    assert len(late) == 2
    assert all(row["created_at"] >= slot for row in late), late


async def test_an_idle_consumer_takes_a_delayed_item_at_its_due_time_without_the_promote_loop(
    redis: aioredis.Redis,
) -> None:
    queue = Queue(redis)
    delay = timedelta(milliseconds=400)
    waiting = asyncio.create_task(queue.dequeue_blocking("idle", VT, 1, timedelta(seconds=5)))
    # The consumer is blocked on the marker before the item arrives (no leader runs here).
    await eventually(lambda: _blocked(redis), within=5)
    sent = time.monotonic()
    assert await queue.enqueue("later", delay=delay)
    leases = await waiting
    took = time.monotonic() - sent
    assert [lease.id for lease in leases] == ["later"]
    assert took >= delay.total_seconds(), "taken before its due time"
    # Promptly: not at Redis's next 100 ms timer tick, nor after the 2 s block, nor the leader's loop.
    assert took < delay.total_seconds() + 0.09, f"taken {took - delay.total_seconds():.3f}s after its due time"


async def test_an_earlier_delayed_item_wakes_a_consumer_sleeping_towards_a_later_one(
    redis: aioredis.Redis,
) -> None:
    queue = Queue(redis)
    assert await queue.enqueue("much-later", delay=timedelta(seconds=30))
    waiting = asyncio.create_task(queue.dequeue_blocking("idle", VT, 1, timedelta(seconds=5)))
    await eventually(lambda: _blocked(redis), within=5)
    sent = time.monotonic()
    assert await queue.enqueue_many([NewItem("sooner", delay=timedelta(milliseconds=300))]) == 1
    leases = await waiting
    took = time.monotonic() - sent
    assert [lease.id for lease in leases] == ["sooner"]
    assert 0.3 <= took < 0.39, took


async def test_a_dequeue_promotes_due_delayed_items_before_taking_so_priority_holds(redis: aioredis.Redis) -> None:
    queue = Queue(redis)
    assert await queue.enqueue("low", priority=-5)
    assert await queue.enqueue("high", priority=5, delay=timedelta(milliseconds=50))
    due_ms = await redis.zscore(queue.keys.delayed, "high")

    async def due() -> bool:
        seconds, micros = await redis.time()
        return bool(seconds * 1000 + micros // 1000 >= due_ms)

    await eventually(due, within=5, interval=0.01)
    assert [lease.id for lease in await queue.dequeue("w", VT, 1)] == ["high"]
    assert [lease.id for lease in await queue.dequeue("w", VT, 1)] == ["low"]


async def test_a_flushall_inside_the_fire_ahead_window_loses_nothing(
    control: Control, pool: asyncpg.Pool, redis: aioredis.Redis
) -> None:
    term = await _term(pool)
    loops = LeaderLoops(redis, pool, LoopSettings(fire_ahead=timedelta(seconds=5), reconcile_grace=timedelta(0)))
    jobs = [await control.create_job(every_second(f"ahead-{index}")) for index in range(20)]
    slot = await pool.fetchval(
        "UPDATE jobs SET next_run_time = date_trunc('second', now()) + interval '4 seconds' RETURNING next_run_time"
    )
    await loops.scan_once(term)
    rows = await pool.fetch(
        "SELECT run_id::text FROM job_executions WHERE scheduled_for = $1 AND status = 'queued'", slot
    )
    assert len(rows) == len(jobs), "every job's slot recorded ahead"
    run_ids = [row["run_id"] for row in rows]
    queue = Queue(redis)
    assert set((await queue.states(run_ids)).values()) == {ItemState.DELAYED}
    await redis.flushall()
    assert set((await queue.states(run_ids)).values()) == {None}
    # The leader's repair enqueues them again from PostgreSQL, still delayed until their slot.
    await loops._reconcile(term)
    assert set((await queue.states(run_ids)).values()) == {ItemState.DELAYED}
    assert await pool.fetchval("SELECT now() < $1", slot), "the host was too slow for this test's window"
    # Due at the slot, not before: taken by a consumer only once the database clock has reached it.
    taken: list[str] = []
    while len(taken) < len(run_ids):
        taken += [lease.id for lease in await queue.dequeue_blocking("w", VT, 100, timedelta(seconds=10))]
        assert await pool.fetchval("SELECT now() >= $1", slot), "a run was taken before its slot"
    assert sorted(taken) == sorted(run_ids)


async def _blocked(redis: aioredis.Redis) -> bool:
    """Whether a client is blocked (flag `b`) in a BZPOPMIN right now."""
    clients = await redis.client_list()
    return any("b" in str(client.get("flags")) and client.get("cmd") == "bzpopmin" for client in clients)
