"""Sharded queues (issue 24) against a real Valkey, on one server and on the cluster: placement by
the shard history, dequeue over every shard, leases routed by their token, the leader's moves and
the reads over every shard, and a shard count lowered with runs still on the shards it drops."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta

import pytest
import redis.asyncio as aioredis
from hypothesis import given
from hypothesis import strategies as st
from redis.asyncio.cluster import RedisCluster

from scheduler_grpc.db.executions import new_execution_id
from scheduler_grpc.errors import InvalidArgument
from scheduler_grpc.keys import QueueKeys, shard_name
from scheduler_grpc.queue import ItemState, LimitDefinition, LimitKey, NewItem, Queue
from scheduler_grpc.sharded import ShardedQueue, unwrap_token
from scheduler_grpc.sharding import ShardChange, ShardMap, ShardPlan, run_time_ms

VT = timedelta(seconds=30)
Deadline = Callable[[float], float]


def run_id() -> str:
    return str(new_execution_id())


def sharded(redis: aioredis.Redis, shards: int, name: str = "sq") -> ShardedQueue:
    return ShardedQueue(redis, name, shard_map=ShardMap(static={name: shards}))


async def ready_per_shard(redis: aioredis.Redis, name: str, shards: int) -> list[int]:
    return [int(await redis.zcard(QueueKeys(shard_name(name, i)).ready)) for i in range(shards)]


def test_shard_keys_have_their_own_hash_tag_and_no_queue_name_is_a_shard() -> None:
    assert QueueKeys(shard_name("jobs", 0)).ready == "{q:jobs}:ready"
    assert QueueKeys(shard_name("jobs", 2)).ready == "{q:jobs#2}:ready"
    with pytest.raises(InvalidArgument):
        Queue(aioredis.Redis(), "jobs#2")


def test_placement_follows_the_count_in_effect_when_the_run_was_made() -> None:
    early, late = run_id(), None
    made = run_time_ms(early)
    assert made is not None
    plan = ShardPlan({"q": (ShardChange(0, 4), ShardChange(made + 1, 1))})
    while late is None or run_time_ms(late) == made:
        late = run_id()
    # Made under 4 shards: placed by its hash, wherever and whenever it is enqueued again.
    assert plan.count_at("q", made) == 4
    assert plan.shard_of("q", late) == 0
    assert plan.served("q") == 4
    spread = Counter(plan.shard_of("q", str(new_execution_id())) for _ in range(2000))
    assert spread.keys() == {0}
    assert plan.served("other") == 1
    # A run with limits is on shard 0, whatever the count.
    assert ShardPlan({"q": (ShardChange(0, 4),)}).shard_of("q", early, has_limits=True) == 0
    many = Counter(ShardPlan({"q": (ShardChange(0, 4),)}).shard_of("q", run_id()) for _ in range(2000))
    assert sorted(many) == [0, 1, 2, 3]
    assert min(many.values()) > 350


def _parsed_time_ms(item_id: str) -> int | None:
    """What `run_time_ms` means, the slow way: the id parsed as a UUID, its millisecond if a v7."""
    try:
        value = uuid.UUID(item_id)
    except ValueError:
        return None
    return value.int >> 80 if value.version == 7 else None


@given(
    bits=st.integers(min_value=0, max_value=2**128 - 1),
    version=st.sampled_from([None, 4, 7]),
    form=st.sampled_from(["canonical", "upper", "braced", "hex"]),
)
def test_a_run_ids_millisecond_read_off_its_text_is_the_parsed_ones(bits: int, version: int | None, form: str) -> None:
    if version is not None:  # that version with the RFC 4122 variant (uuid.UUID knows no v7 on 3.11)
        bits = bits & ~(0xF << 76) & ~(0x3 << 62) | version << 76 | 0x2 << 62
    value = uuid.UUID(int=bits)
    text = {"canonical": str(value), "upper": str(value).upper(), "braced": f"{{{value}}}", "hex": value.hex}[form]
    assert run_time_ms(text) == _parsed_time_ms(text)
    assert run_time_ms(text[:-1] + "g") is None


async def test_runs_spread_over_the_shards_and_each_is_taken_exactly_once(redis: aioredis.Redis) -> None:
    queue = sharded(redis, 3)
    ids = [run_id() for _ in range(300)]
    assert await queue.enqueue_many(NewItem(i, data=f"d{i}") for i in ids) == 300
    assert await queue.enqueue_many(NewItem(i) for i in ids) == 0  # idempotent: the same shard each time
    per_shard = await ready_per_shard(redis, "sq", 3)
    assert sum(per_shard) == 300
    assert min(per_shard) > 50, per_shard
    assert (await queue.stats()).ready == 300
    taken: list[str] = []
    while leases := await queue.dequeue("w", VT, count=37):
        taken += [lease.id for lease in leases]
        assert all(lease.data == f"d{lease.id}".encode() for lease in leases)
        assert all(await queue.ack_many(leases))
    assert sorted(taken) == sorted(ids)
    stats = await queue.stats()
    assert (stats.ready, stats.processing, stats.delayed, stats.dead) == (0, 0, 0, 0)


async def test_a_dequeue_starts_one_shard_later_each_time_so_none_starves(redis: aioredis.Redis) -> None:
    queue = sharded(redis, 3)
    plan = await queue.shard_map.current()
    ids = [run_id() for _ in range(60)]
    await queue.enqueue_many(NewItem(i) for i in ids)
    shards = [{plan.shard_of("sq", lease.id) for lease in await queue.dequeue("w", VT, count=1)} for _ in range(6)]
    # Three calls in a row, one item each, come from the three shards.
    assert set().union(*shards[:3]) == {0, 1, 2}
    assert set().union(*shards[3:]) == {0, 1, 2}
    # A high-priority run on one shard waits behind at most one batch of each other shard.
    urgent = next(i for i in (run_id() for _ in range(100)) if plan.shard_of("sq", i) == 2)
    await queue.enqueue(urgent, priority=10)
    seen: list[str] = []
    for _ in range(3):
        seen += [lease.id for lease in await queue.dequeue("w", VT, count=1)]
    assert urgent in seen


async def test_a_blocked_dequeue_wakes_for_work_on_any_shard(redis: aioredis.Redis) -> None:
    queue = sharded(redis, 3)
    plan = await queue.shard_map.current()
    on_two = next(i for i in (run_id() for _ in range(100)) if plan.shard_of("sq", i) == 2)
    waiting = asyncio.create_task(queue.dequeue_blocking("w", VT, wait=timedelta(seconds=10)))
    await asyncio.sleep(0.2)  # let it block (not synchronisation: the marker persists either way)
    started = time.monotonic()
    await queue.enqueue(on_two)
    leases = await asyncio.wait_for(waiting, 5)
    assert [lease.id for lease in leases] == [on_two]
    assert time.monotonic() - started < 2.0  # woken by the marker, not by the 2 s re-check
    assert unwrap_token(leases[0].token)[0] == 2
    # No marker was lost: every shard's other waits were cancelled and re-armed only if set.
    assert await queue.dequeue("w", VT) == []


async def test_leases_are_routed_to_their_shard_by_token(redis: aioredis.Redis) -> None:
    queue = sharded(redis, 3)
    ids = [run_id() for _ in range(30)]
    await queue.enqueue_many(NewItem(i) for i in ids)
    leases = await queue.dequeue("w", VT, count=30)
    assert len(leases) == 30
    assert {unwrap_token(lease.token)[0] for lease in leases} == {0, 1, 2}
    deadlines = await queue.extend_many([(lease.id, lease.token) for lease in leases], VT)
    assert all(deadlines)
    # Wrong shard's token (a token of shard 1 presented as shard 2's): lease lost, nothing moves.
    one = next(lease for lease in leases if unwrap_token(lease.token)[0] == 1)
    assert await queue.ack_many([(one.id, "2~" + unwrap_token(one.token)[1])]) == [False]
    acks, retries, dead = leases[:10], leases[10:20], leases[20:]
    flags = await queue.finish_many(acks, [(lease, timedelta(0)) for lease in retries], [(d, "x") for d in dead])
    assert flags == [True] * 30
    states = await queue.states(ids)
    assert Counter(states.values()) == {None: 10, ItemState.READY: 10, ItemState.DEAD: 10}
    page = await queue.list_dead(page_size=4)
    listed = [item.id for item in page.items]
    while page.next_page_token:
        page = await queue.list_dead(page_size=4, page_token=page.next_page_token)
        listed += [item.id for item in page.items]
    assert sorted(listed) == sorted(d.id for d in dead)
    assert sorted(await queue.requeue_dead(None)) == sorted(d.id for d in dead)
    assert sum(await queue.remove_many(ids)) == 20


async def test_recover_and_promote_go_over_every_shard(redis: aioredis.Redis, deadline: Deadline) -> None:
    queue = sharded(redis, 3)
    ids = [run_id() for _ in range(30)]
    await queue.enqueue_many(NewItem(i, delay=timedelta(milliseconds=50)) for i in ids)
    promoted: list[str] = []
    until = deadline(10)
    while len(promoted) < 30:
        assert time.monotonic() < until
        promoted += await queue.promote_due()
    assert sorted(promoted) == sorted(ids)
    leases = await queue.dequeue("w", timedelta(milliseconds=20), count=30)
    tokens = {lease.id: lease.token for lease in leases}
    recovered: dict[str, str] = {}
    while len(recovered) < 30:
        assert time.monotonic() < until
        got = await queue.recover_expired()
        recovered.update(got.expired_leases())
    # The tokens recovered are the ones the worker saw (the claim tokens PostgreSQL holds).
    assert recovered == tokens
    assert (await queue.stats()).ready == 30


async def test_runs_with_limits_stay_on_shard_zero(redis: aioredis.Redis) -> None:
    queue = sharded(redis, 3)
    key = LimitKey("cap", "k", 1)
    definitions = [LimitDefinition("cap", "concurrency", 1)]
    ids = [run_id() for _ in range(20)]
    await queue.enqueue_many((NewItem(i, limits=(key,)) for i in ids), definitions)
    assert await ready_per_shard(redis, "sq", 3) == [0, 0, 0]  # waiting in their group, on shard 0
    assert (await queue.stats()).ready == 20
    first = await queue.dequeue("w", VT, count=20)
    assert len(first) == 1
    assert unwrap_token(first[0].token)[0] == 0
    assert await queue.dequeue("w", VT, count=20) == []


class _History:
    """A shard history a test changes: the `ShardSource` of a `ShardMap`."""

    def __init__(self) -> None:
        self.changes: dict[str, list[ShardChange]] = {}

    async def __call__(self) -> tuple[int, Mapping[str, Sequence[ShardChange]]]:
        return int(time.time() * 1000), self.changes


async def test_lowering_the_count_loses_and_duplicates_nothing(redis: aioredis.Redis) -> None:
    history = _History()
    history.changes["sq"] = [ShardChange(0, 3)]
    shards = ShardMap(history, lead=timedelta(seconds=1), refresh_every=timedelta(0))
    producer = ShardedQueue(redis, "sq", shard_map=shards)
    before = [run_id() for _ in range(90)]
    await producer.enqueue_many(NewItem(i) for i in before)
    assert min(await ready_per_shard(redis, "sq", 3)) > 10
    # 3 -> 1 from now on: runs made from now are on shard 0; those on 1 and 2 stay where they are.
    history.changes["sq"].append(ShardChange(int(time.time() * 1000), 1))
    after = []
    while len(after) < 30:
        candidate = run_id()
        if (run_time_ms(candidate) or 0) > history.changes["sq"][-1].effective_ms:
            after.append(candidate)
    await producer.enqueue_many(NewItem(i) for i in after)
    # Enqueued again (a reconcile of every run): each lands on the shard it is on; nothing is added.
    assert await producer.enqueue_many(NewItem(i) for i in before + after) == 0
    per_shard = await ready_per_shard(redis, "sq", 3)
    assert sum(per_shard) == 120
    assert per_shard[0] >= 30
    consumer = ShardedQueue(redis, "sq", shard_map=shards)
    taken: Counter[str] = Counter()
    while leases := await consumer.dequeue("w", VT, count=25):
        taken.update(lease.id for lease in leases)
        assert all(await consumer.ack_many(leases))
    assert taken == Counter(before + after)
    assert await ready_per_shard(redis, "sq", 3) == [0, 0, 0]


async def test_an_idle_worker_told_to_drain_a_solo_run_gets_it_from_its_shard(redis: aioredis.Redis) -> None:
    queue = ShardedQueue(redis, "sq", shard_map=ShardMap(static={"sq": 3}), max_stalls=2)
    plan = await queue.shard_map.current()
    ids = (run_id() for _ in range(1000))
    poison = next(i for i in ids if plan.shard_of("sq", i) == 2)
    await queue.enqueue(poison)
    [lease] = await queue.dequeue("w", timedelta(milliseconds=1), idle=True)
    recovered: list[str] = []
    while not recovered:
        recovered = (await queue.recover_expired()).requeued
    assert recovered == [poison]  # one stall of two: its next delivery is solo
    others = [run_id() for _ in range(60)]
    await queue.enqueue_many(NewItem(i) for i in others)
    # A busy worker skips it and is told to drain it (on shard 2, whichever shard it starts on).
    drained = False
    for _ in range(6):
        leases = await queue.dequeue("w", VT, count=2)
        assert poison not in [lease.id for lease in leases]
        if leases.solo_waiting:
            drained = True
            break
    assert drained
    # Idle, its next dequeue starts on the solo run's shard: it gets the solo run alone.
    solo = await queue.dequeue("w", VT, count=5, idle=True)
    assert [(lease.id, lease.solo) for lease in solo] == [(poison, True)]
    assert lease.id == poison


async def test_a_stale_plan_is_refreshed_in_the_background_never_in_a_callers_way(deadline: Deadline) -> None:
    gate = asyncio.Event()
    reads = 0

    async def source() -> tuple[int, Mapping[str, Sequence[ShardChange]]]:
        nonlocal reads
        reads += 1
        count = reads
        if count == 2:
            await gate.wait()  # PostgreSQL hangs
        if count == 3:
            raise ConnectionError("PostgreSQL is down")
        return int(time.time() * 1000), {"q": [ShardChange(0, count)]}

    shards = ShardMap(source, lead=timedelta(seconds=1), refresh_every=timedelta(0))
    assert (await shards.current()).served("q") == 1
    # The refresh hangs: readers go on at once with the plan they have.
    for _ in range(3):
        assert (await asyncio.wait_for(shards.current(), 1)).served("q") == 1
    assert reads == 2
    gate.set()
    until = deadline(5)
    while (await shards.current()).served("q") != 2:
        assert time.monotonic() < until
        await asyncio.sleep(0.01)
    # A failing refresh keeps the last plan and raises to nobody; the next one reads again.
    until = deadline(5)
    while (await shards.current()).served("q") != 4:
        assert time.monotonic() < until
        await asyncio.sleep(0.01)
    assert reads >= 4


async def test_bad_arguments_are_refused_before_any_shard_is_written(redis: aioredis.Redis) -> None:
    queue = sharded(redis, 3)
    good = [run_id() for _ in range(30)]
    with pytest.raises(InvalidArgument, match=r"items\[30\]\.priority"):
        await queue.enqueue_many([*(NewItem(i) for i in good), NewItem(run_id(), priority=5000)])
    assert (await queue.stats()).ready == 0
    with pytest.raises(InvalidArgument, match="worker_id"):
        await queue.dequeue("", VT)
    with pytest.raises(InvalidArgument, match="worker_id"):
        await queue.dequeue_blocking("", VT, wait=timedelta(0))


async def connections_received(redis: aioredis.Redis) -> int:
    """Connections the servers accepted so far (every master of a cluster)."""
    replies = await redis.info("stats", target_nodes=RedisCluster.PRIMARIES)  # type: ignore[call-arg]
    return sum(int(stats["total_connections_received"]) for stats in replies.values())


async def test_an_idle_wait_on_a_cluster_keeps_its_connections(redis: aioredis.Redis, redis_backend: str) -> None:
    if redis_backend != "cluster":
        pytest.skip("on one server the shards' markers are one BZPOPMIN")
    queue = sharded(redis, 3)
    await queue.dequeue_blocking("w", VT, wait=timedelta(seconds=0.3))  # each shard's node has a connection
    before = await connections_received(redis)
    # Three waits that time out: none is cancelled, so no connection is dropped and made again
    # (cancelling the two left at each timeout made about two new connections per wait).
    assert await queue.dequeue_blocking("w", VT, wait=timedelta(seconds=4.6)) == []
    assert await connections_received(redis) - before <= 1
