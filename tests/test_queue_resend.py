"""Scripts resent by the Redis client's auto-retry run once (issue 8, item 6).

The production client (`connections.redis_client`) retries a command whose connection failed. When
the failure is a lost reply, the script has already run: a TCP proxy forwards the request and then
resets the connection instead of forwarding the reply, so the client really resends it.
"""

from __future__ import annotations

from datetime import timedelta

import redis.asyncio as aioredis

from chaos.proxy import FaultProxy
from scheduler_grpc import events
from scheduler_grpc.connections import redis_client
from scheduler_grpc.events import EventType, ExecutionEvent
from scheduler_grpc.queue import NewItem, Queue


async def test_a_resent_dequeue_returns_the_first_batch_and_orphans_nothing(
    redis: aioredis.Redis, redis_url: str
) -> None:
    proxy, url = await FaultProxy.to_url(redis_url)
    client = redis_client(url)
    try:
        queue = Queue(client)
        assert await queue.dequeue("w", timedelta(seconds=30), 1) == []  # loads the script
        await queue.enqueue_many([NewItem("a"), NewItem("b"), NewItem("c")])
        proxy.drop_reply_to(b"EVALSHA")
        leases = await queue.dequeue("w", timedelta(seconds=30), 1)
        assert proxy.stats.dropped_replies == 1  # the script ran, its reply was lost, the client resent it
        assert [lease.id for lease in leases] == ["a"]
        stats = await Queue(redis).stats()
        assert (stats.ready, stats.processing) == (2, 1)  # b is still ready, nothing orphaned
        assert await queue.ack(leases[0].id, leases[0].token)
    finally:
        await client.aclose()
        await proxy.close()


async def test_a_resent_event_publish_appends_each_event_once(redis: aioredis.Redis, redis_url: str) -> None:
    proxy, url = await FaultProxy.to_url(redis_url)
    client = redis_client(url)
    try:
        await events.publish(client, [ExecutionEvent(EventType.CREATED, "warm-up", "warm-up", "job", 1)])
        proxy.drop_reply_to(b"EVALSHA")
        sent = [
            ExecutionEvent(EventType.STARTED, "e1", "r1", "job", 1),
            ExecutionEvent(EventType.SUCCEEDED, "e1", "r1", "job", 1),
        ]
        ids = await events.publish(client, sent)
        assert proxy.stats.dropped_replies == 1
        stored = [event for event in await events.read_after(redis) if event.run_id == "r1"]
        assert [event.type for event in stored] == [EventType.STARTED, EventType.SUCCEEDED]
        assert len(ids) == 2
    finally:
        await client.aclose()
        await proxy.close()
