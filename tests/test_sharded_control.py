"""A sharded queue (issue 24) through the application layer: the dead-letter queue (list, purge,
requeue), the counts the console and the metrics read, and the depth samples, over every shard."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta

import asyncpg
import pytest
import redis.asyncio as aioredis

from scheduler_grpc.control import Control, TriggerItem
from scheduler_grpc.db.queue_shards import QueueShardRepository
from scheduler_grpc.jobs import JobSpec
from scheduler_grpc.keys import QueueKeys, shard_name
from scheduler_grpc.sharded import ShardedQueue
from scheduler_grpc.sharding import ShardMap

VT = timedelta(seconds=30)


@pytest.mark.cluster_too
async def test_dead_letters_and_counts_cover_every_shard(
    control: Control, redis: aioredis.Redis, pool: asyncpg.Pool
) -> None:
    shards = QueueShardRepository(pool)
    await shards.set_shards("default", 3, lead=timedelta(0))
    job = await control.create_job(JobSpec(name="dead", handler="test.echo"))
    made = await control.trigger_many([TriggerItem(job.id)] * 30)
    runs = [e.run_id for e in made if not isinstance(e, Exception)]
    await control._recovery.mark_runs_dead(runs, "test")
    queue = ShardedQueue(redis, "default", shard_map=ShardMap(shards.histories))
    leases = await queue.dequeue("w", VT, count=30)
    assert len(leases) == 30
    for lease in leases:
        assert await queue.dead_letter(lease.id, lease.token, "test")
    dead_per_shard = [await redis.zcard(QueueKeys(shard_name("default", i)).dead) for i in range(3)]
    assert min(dead_per_shard) > 0, dead_per_shard
    assert (await control.queue_stats("default")).dead == 30

    listed: list[str] = []
    page = await control.list_dead_letters("default", 7)
    listed += [item.id for item in page.items]
    while page.next_page_token:
        page = await control.list_dead_letters("default", 7, page.next_page_token)
        assert len(page.items) <= 7
        listed += [item.id for item in page.items]
    assert sorted(listed) == sorted(runs)

    purged = await control.purge_dead_runs("default", runs[:5])
    assert sorted(purged) == sorted(runs[:5])
    requeued = await control.requeue_dead_runs("default", None)
    assert sorted(run.run_id for run in requeued) == sorted(runs[5:])
    stats = await control.queue_stats("default")
    assert (stats.ready, stats.dead, stats.processing) == (25, 0, 0)

    assert await control.sample_queue_depths(time.time())
    [sample] = await control.queue_depth("default", since=datetime.now(UTC) - timedelta(hours=1))
    assert sample.ready == 25
