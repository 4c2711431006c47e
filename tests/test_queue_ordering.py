"""Property: whatever the history, ready items come out by (priority desc, time they became ready).

Redis TIME cannot be faked, so age independence is shown by construction: items wait while bulks
of others arrive, return through nack, delayed/promote and lease expiry, and the sequence counter
jumps ahead as on a queue that has run for years. The model assigns each item an order when it
becomes ready; every dequeue must return exactly the model's best items.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import timedelta

import redis.asyncio as aioredis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scheduler_grpc.queue import PRIORITY_MAX, PRIORITY_MIN, SEQ_SPAN, NewItem, Queue

VT = timedelta(seconds=30)
TINY = timedelta(milliseconds=1)

priorities = st.one_of(
    st.sampled_from([PRIORITY_MIN, PRIORITY_MIN + 1, -1, 0, 1, PRIORITY_MAX - 1, PRIORITY_MAX]),
    st.integers(PRIORITY_MIN, PRIORITY_MAX),
)
operations = st.one_of(
    st.tuples(st.just("enqueue"), st.lists(priorities, min_size=1, max_size=8)),
    st.tuples(st.just("bulk"), st.lists(priorities, min_size=50, max_size=300)),
    st.tuples(st.just("delayed"), st.lists(priorities, min_size=1, max_size=5)),
    st.tuples(st.just("promote"), st.none()),
    st.tuples(st.just("take"), st.lists(st.sampled_from(["ack", "nack", "nack-later"]), min_size=1, max_size=12)),
    st.tuples(st.just("stall"), st.integers(1, 6)),
    st.tuples(st.just("age"), st.integers(0, SEQ_SPAN - 10**6)),
)


@dataclass
class Model:
    """Ready items as id -> (priority, order); order grows each time an item becomes ready."""

    priority: dict[str, int] = field(default_factory=dict)
    ready: dict[str, tuple[int, int]] = field(default_factory=dict)
    counter: int = 0
    next_id: int = 0

    def new_id(self) -> str:
        self.next_id += 1
        return f"item-{self.next_id}"

    def make_ready(self, item_id: str) -> None:
        self.counter += 1
        self.ready[item_id] = (-self.priority[item_id], self.counter)

    def take(self, count: int) -> list[str]:
        best = sorted(self.ready, key=self.ready.__getitem__)[:count]
        for item_id in best:
            del self.ready[item_id]
        return best


async def poll(step: Callable[[], Awaitable[None]], done: Callable[[], bool], seconds: float = 10) -> None:
    until = time.monotonic() + seconds
    while not done():
        assert time.monotonic() < until, "timed out"
        await step()
        await asyncio.sleep(0.001)


@settings(
    max_examples=50,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(program=st.lists(operations, min_size=1, max_size=25))
async def test_dequeue_order_is_priority_then_fifo_whatever_the_history(
    redis: aioredis.Redis, program: list[tuple[str, object]]
) -> None:
    await redis.flushdb()
    # No item reaches the stall limit here: a solo delivery's order is test_queue's subject.
    queue = Queue(redis, max_stalls=1000)
    model = Model()
    delayed: set[str] = set()

    async def enqueue(prios: list[int], delay: timedelta | None = None) -> list[str]:
        ids = [model.new_id() for _ in prios]
        model.priority.update(zip(ids, prios, strict=True))
        assert await queue.enqueue_many(NewItem(i, p, delay=delay) for i, p in zip(ids, prios, strict=True)) == len(ids)
        return ids

    async def take(count: int) -> list[str]:
        leases = await queue.dequeue("w", VT, count) if count else []
        got = [lease.id for lease in leases]
        assert got == model.take(count), "dequeue order differs from (priority desc, FIFO)"
        assert [lease.priority for lease in leases] == [model.priority[i] for i in got]
        return got

    async def promote() -> None:
        promoted: list[str] = []

        async def step() -> None:
            promoted.extend(await queue.promote_due())

        await poll(step, lambda: set(promoted) == delayed)
        for item_id in promoted:  # due order, as the script moved them
            model.make_ready(item_id)
        delayed.clear()

    async def recover_all(stalled: list[str]) -> list[str]:
        requeued: list[str] = []

        async def step() -> None:
            requeued.extend((await queue.recover_expired(max_deliveries=1000)).requeued)

        await poll(step, lambda: sorted(requeued) == sorted(stalled))
        return requeued  # expiry order, as the script requeued them

    for op, arg in program:
        if op in ("enqueue", "bulk"):
            for item_id in await enqueue(arg):
                model.make_ready(item_id)
        elif op == "delayed":
            delayed.update(await enqueue(arg, TINY))
        elif op == "promote":
            await promote()
        elif op == "take":
            # A dequeue promotes the due delayed items itself, in due order, before taking; which
            # are due is Redis's clock's call, so the model promotes them all first (TINY delays).
            await promote()
            actions: list[str] = arg
            leases = await queue.dequeue("w", VT, len(actions))
            got = [lease.id for lease in leases]
            assert got == model.take(len(actions)), "dequeue order differs from (priority desc, FIFO)"
            acks = [lease for lease, action in zip(leases, actions, strict=False) if action == "ack"]
            nacks = [lease for lease, action in zip(leases, actions, strict=False) if action == "nack"]
            later = [lease for lease, action in zip(leases, actions, strict=False) if action == "nack-later"]
            assert all(await queue.ack_many(acks))
            assert all(await queue.nack_many(nacks))
            for lease in nacks:  # back of their priority, in the order given
                model.make_ready(lease.id)
            assert all(await queue.nack_many(later, TINY))
            delayed.update(lease.id for lease in later)
        elif op == "stall":
            await promote()
            leases = await queue.dequeue("w", TINY, arg)
            stalled = [lease.id for lease in leases]
            assert stalled == model.take(arg)
            requeued = await recover_all(stalled)
            for item_id in requeued:
                model.make_ready(item_id)
        elif op == "age":
            # A long history: the counter jumps forward (never back, as INCR only grows).
            current = int(await redis.get(queue.keys.seq) or 0)
            await redis.set(queue.keys.seq, max(current, arg))

    # Drain: everything delayed becomes ready, then all of it comes out in model order.
    await promote()
    while model.ready:
        await take(7)
    assert await queue.dequeue("w", VT, 10) == []
