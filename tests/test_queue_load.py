"""Lease safety under load: 50 concurrent consumers over 10,000 items, with and without abandoned leases."""

from __future__ import annotations

import asyncio
import time
from collections import Counter, defaultdict
from datetime import timedelta

import redis.asyncio as aioredis

from scheduler_grpc.queue import Lease, NewItem, Queue

ITEMS = 10_000
CONSUMERS = 50
BATCH = 20


async def assert_nothing_left(redis: aioredis.Redis, queue: Queue) -> None:
    stats = await queue.stats()
    assert (stats.ready, stats.processing, stats.delayed, stats.dead) == (0, 0, 0, 0)
    k = queue.keys
    for key in (k.priority, k.data, k.deliveries, k.lease, k.owner, k.dead_reason):
        assert await redis.hlen(key) == 0, key


def assert_best_first(leases: list[Lease]) -> None:
    priorities = [lease.priority for lease in leases]
    assert priorities == sorted(priorities, reverse=True)


async def test_fifty_consumers_ack_every_item_exactly_once(redis: aioredis.Redis) -> None:
    queue = Queue(redis)
    ids = [f"item-{n:05d}" for n in range(ITEMS)]
    assert await queue.enqueue_many(NewItem(item_id, n % 21 - 10, b"x") for n, item_id in enumerate(ids)) == ITEMS
    acked: Counter[str] = Counter()
    delivered: Counter[str] = Counter()

    async def consume(n: int) -> None:
        while leases := await queue.dequeue_blocking(
            f"c{n}", timedelta(seconds=30), BATCH, timedelta(milliseconds=200)
        ):
            assert_best_first(leases)
            delivered.update(lease.id for lease in leases)
            for lease, ok in zip(leases, await queue.ack_many(leases), strict=True):
                if ok:
                    acked[lease.id] += 1

    started = time.perf_counter()
    await asyncio.wait_for(asyncio.gather(*(consume(n) for n in range(CONSUMERS))), 60)
    print(f"{ITEMS} items through {CONSUMERS} consumers in {time.perf_counter() - started:.2f} s")
    assert set(acked) == set(ids)
    assert set(acked.values()) == {1}
    assert set(delivered.values()) == {1}
    await assert_nothing_left(redis, queue)


async def test_abandoned_leases_are_redelivered_and_only_they(redis: aioredis.Redis) -> None:
    queue = Queue(redis)
    visibility = timedelta(seconds=1)
    ids = [f"item-{n:05d}" for n in range(ITEMS)]
    abandoned = set(ids[::53])  # crashed consumers: leased once, never acked
    assert await queue.enqueue_many(NewItem(item_id, n % 7) for n, item_id in enumerate(ids)) == ITEMS
    acked: Counter[str] = Counter()
    tokens: dict[str, list[str]] = defaultdict(list)
    recovered: set[str] = set()
    stale_acks_refused = 0
    done = asyncio.Event()

    async def consume(n: int) -> None:
        nonlocal stale_acks_refused
        while not done.is_set():
            leases = await queue.dequeue_blocking(f"c{n}", visibility, BATCH, timedelta(milliseconds=200))
            assert_best_first(leases)
            finish = []
            for lease in leases:
                tokens[lease.id].append(lease.token)
                assert lease.deliveries == len(tokens[lease.id])
                if lease.id in abandoned and lease.deliveries == 1:
                    continue  # walk away from it
                if lease.deliveries > 1:
                    # The crashed holder comes back late: its ack is refused and changes nothing.
                    assert not await queue.ack(lease.id, tokens[lease.id][0])
                    stale_acks_refused += 1
                finish.append(lease)
            for lease, ok in zip(finish, await queue.ack_many(finish), strict=True):
                assert ok
                acked[lease.id] += 1
            if len(acked) == ITEMS:
                done.set()

    async def recover() -> None:
        # The leader's recover loop; its period is a cadence, not a synchronisation.
        while not done.is_set():
            result = await queue.recover_expired()
            assert result.dead == []
            recovered.update(result.requeued)
            await asyncio.sleep(0.05)

    started = time.perf_counter()
    await asyncio.wait_for(asyncio.gather(recover(), *(consume(n) for n in range(CONSUMERS))), 60)
    print(f"{ITEMS} items, {len(abandoned)} abandoned, done in {time.perf_counter() - started:.2f} s")
    assert set(acked) == set(ids)
    assert set(acked.values()) == {1}
    twice = {item_id for item_id, seen in tokens.items() if len(seen) == 2}
    assert twice == abandoned
    assert recovered == abandoned
    assert {len(seen) for item_id, seen in tokens.items() if item_id not in abandoned} == {1}
    assert stale_acks_refused == len(abandoned)
    # Long after: every old token still fails and nothing reappears.
    assert not any(await queue.ack_many([(item_id, tokens[item_id][0]) for item_id in abandoned]))
    await assert_nothing_left(redis, queue)
