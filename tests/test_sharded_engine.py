"""Sharded queues (issue 24) with real scheduler and worker processes: a 3-shard queue drains its
runs, each succeeded exactly once, through the leader's recovery of a killed worker's leases on
every shard and its reconcile of runs Redis lost from one shard; and a shard count lowered and
raised live. Checked from PostgreSQL, polled with deadlines."""

from __future__ import annotations

import os
import signal
from collections import Counter
from datetime import timedelta

import asyncpg
import pytest
import redis.asyncio as aioredis

from scheduler_grpc.control import MAX_TRIGGER_ITEMS, Control, TriggerItem
from scheduler_grpc.db.queue_shards import QueueShardRepository
from scheduler_grpc.handlers import HandlerSettings, default_registry
from scheduler_grpc.jobs import JobSpec
from scheduler_grpc.keys import QueueKeys, shard_name
from scheduler_grpc.queue import ItemState, Queue
from scheduler_grpc.sharding import ShardMap
from tests.engine_helpers import Roles, eventually, wait_until_ready

LEAD = {"SCHEDULER_QUEUE_SHARD_LEAD": "1s"}
# Runs the drain test makes (the acceptance run: SHARDED_DRAIN_RUNS=50000, as a bench).
RUNS = int(os.environ.get("SHARDED_DRAIN_RUNS", "300"))


async def trigger(control: Control, job_id: str, count: int) -> list[str]:
    """`count` manual runs of a job, in batches of at most `MAX_TRIGGER_ITEMS`."""
    runs: list[str] = []
    while len(runs) < count:
        made = await control.trigger_many([TriggerItem(job_id)] * min(MAX_TRIGGER_ITEMS, count - len(runs)))
        runs += [e.run_id for e in made if not isinstance(e, Exception)]
    return runs


def manual(name: str, handler: str, payload: dict[str, object] | None = None) -> JobSpec:
    return JobSpec(name=name, handler=handler, payload=payload or {})  # type: ignore[call-arg]


async def succeeded_once(pool: asyncpg.Pool, run_ids: list[str]) -> dict[str, int]:
    """Per run, its succeeded attempts (a run with none is counted 0)."""
    rows = await pool.fetch(
        """SELECT run_id::text AS run_id, count(*) FILTER (WHERE status = 'succeeded') AS done
             FROM job_executions WHERE run_id = ANY($1::uuid[]) GROUP BY run_id""",
        run_ids,
    )
    counts = dict.fromkeys(run_ids, 0)
    counts.update({row["run_id"]: int(row["done"]) for row in rows})
    return counts


@pytest.mark.cluster_too
async def test_a_three_shard_queue_drains_every_run_exactly_once(
    roles: Roles, control: Control, pool: asyncpg.Pool, redis: aioredis.Redis
) -> None:
    await QueueShardRepository(pool).set_shards("default", 3, lead=timedelta(0))
    plan = await ShardMap(QueueShardRepository(pool).histories).refresh()
    slow = await control.create_job(manual("slow", "test.delay", {"seconds": 3}))
    echo = await control.create_job(manual("echo", "test.echo"))
    roles.start("scheduler", **LEAD)
    first = roles.start("worker", "--concurrency", "24", **LEAD)
    await wait_until_ready(redis, workers=1)

    # A worker killed while running runs on every shard: the leader recovers each shard's leases
    # (their tokens are the claim tokens) and records the attempts abandoned.
    held = [e.run_id for e in await control.trigger_many([TriggerItem(slow.id)] * 24) if not isinstance(e, Exception)]
    assert {plan.shard_of("default", run_id) for run_id in held} == {0, 1, 2}

    async def all_running() -> bool:
        return await pool.fetchval(
            "SELECT count(*) FROM job_executions WHERE run_id = ANY($1::uuid[]) AND status = 'running'", held
        ) == len(held)

    await eventually(all_running, within=30)
    first.signal(signal.SIGKILL)

    async def all_abandoned() -> bool:
        return await pool.fetchval(
            """SELECT count(*) FROM job_executions
                WHERE run_id = ANY($1::uuid[]) AND status = 'abandoned' AND attempt = 1""",
            held,
        ) == len(held)

    await eventually(all_abandoned, within=30)

    # Runs Redis lost from shard 1 (no worker is running): the reconcile puts them back there.
    runs = await trigger(control, echo.id, RUNS)
    assert len(runs) == RUNS
    on_one = [run_id for run_id in runs if plan.shard_of("default", run_id) == 1][:500]
    per_shard = [await redis.zcard(QueueKeys(shard_name("default", i)).ready) for i in range(3)]
    assert min(per_shard) > 50, per_shard
    shard_one = Queue(redis, "default", shard=1)
    assert all(await shard_one.remove_many(on_one))

    async def restored() -> bool:
        states = await shard_one.states(on_one)
        return all(state is ItemState.READY for state in states.values())

    await eventually(restored, within=30)

    for _ in range(2):
        roles.start("worker", "--concurrency", "24", **LEAD)

    async def drained() -> dict[str, int]:
        counts = await succeeded_once(pool, held + runs)
        return counts if all(counts.values()) else {}

    counts = await eventually(drained, within=90 + RUNS / 100, interval=0.5)
    assert Counter(counts.values()) == {1: len(held) + len(runs)}
    for index in range(3):
        keys = QueueKeys(shard_name("default", index))
        assert await redis.zcard(keys.ready) == 0
        assert await redis.zcard(keys.processing) == 0


@pytest.mark.cluster_too
async def test_lowering_the_count_live_runs_everything_once(
    roles: Roles, pool: asyncpg.Pool, redis: aioredis.Redis
) -> None:
    shards = QueueShardRepository(pool)
    await shards.set_shards("default", 3, lead=timedelta(0))
    # The test's producer reads the counts with the roles' lead, as every role must.
    registry = default_registry(HandlerSettings(dev_mode=True))
    producer = Control(redis, pool, registry, shard_map=ShardMap(shards.histories, lead=timedelta(seconds=1)))
    job = await producer.create_job(manual("echo", "test.echo"))
    made = await producer.trigger_many([TriggerItem(job.id)] * 150)
    before = [e.run_id for e in made if not isinstance(e, Exception)]
    plan = await ShardMap(shards.histories).refresh()
    on_high = [run_id for run_id in before if plan.shard_of("default", run_id) > 0]
    assert len(on_high) > 50
    # 3 -> 1 while runs wait on shards 1 and 2; runs made after it go to shard 0.
    effective = await shards.set_shards("default", 1, lead=timedelta(seconds=1))

    async def in_effect() -> bool:
        return bool(await pool.fetchval("SELECT clock_timestamp() > $1", effective))

    await eventually(in_effect, within=10)
    made = await producer.trigger_many([TriggerItem(job.id)] * 150)
    after = [e.run_id for e in made if not isinstance(e, Exception)]
    assert await redis.zcard(QueueKeys(shard_name("default", 0)).ready) >= 150
    roles.start("scheduler", **LEAD)
    for _ in range(2):
        roles.start("worker", "--concurrency", "24", **LEAD)

    async def drained() -> dict[str, int]:
        counts = await succeeded_once(pool, before + after)
        return counts if all(counts.values()) else {}

    counts = await eventually(drained, within=90)
    assert Counter(counts.values()) == {1: 300}
    await registry.aclose()


@pytest.mark.cluster_too
async def test_raising_the_count_while_workers_drain_runs_everything_once(
    roles: Roles, pool: asyncpg.Pool, redis: aioredis.Redis
) -> None:
    """1 -> 3 while the workers drain: runs made before stay on shard 0, runs made after spread to
    the new shards, and every worker starts taking from them once the change is in effect."""
    shards = QueueShardRepository(pool)
    registry = default_registry(HandlerSettings(dev_mode=True))
    producer = Control(redis, pool, registry, shard_map=ShardMap(shards.histories, lead=timedelta(seconds=1)))
    job = await producer.create_job(manual("slow-echo", "test.delay", {"seconds": 0.05}))
    roles.start("scheduler", **LEAD)
    for _ in range(2):
        roles.start("worker", "--concurrency", "4", **LEAD)
    before = await trigger(producer, job.id, 400)  # 2.5 s of work for 8 slots: draining through the change
    effective = await shards.set_shards("default", 3, lead=timedelta(seconds=1))

    async def in_effect() -> bool:
        return bool(await pool.fetchval("SELECT clock_timestamp() > $1", effective))

    await eventually(in_effect, within=10)
    after = await trigger(producer, job.id, 300)
    plan = await ShardMap(shards.histories).refresh()
    assert {plan.shard_of("default", run_id) for run_id in before} == {0}
    assert {plan.shard_of("default", run_id) for run_id in after} == {0, 1, 2}

    async def drained() -> dict[str, int]:
        counts = await succeeded_once(pool, before + after)
        return counts if all(counts.values()) else {}

    counts = await eventually(drained, within=90)
    assert Counter(counts.values()) == {1: 700}
    for index in range(3):  # every shard emptied: the workers took from the new ones too
        keys = QueueKeys(shard_name("default", index))
        assert await redis.zcard(keys.ready) == 0
        assert await redis.zcard(keys.processing) == 0
    await registry.aclose()
