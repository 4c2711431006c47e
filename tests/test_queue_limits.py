"""Keyed flow control in the queue, against a real Valkey: groups, concurrency units, GCRA rates,
paused keys, fairness across keys, and units held exactly while a lease is."""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

import pytest
import redis.asyncio as aioredis

from scheduler_grpc.queue import SEQ_SPAN, ItemState, Lease, LimitDefinition, LimitKey, NewItem, Queue

VT = timedelta(seconds=30)
Deadline = Callable[[float], float]

CONC1 = LimitDefinition("cust", "concurrency", 1)


def lk(limit: str, key: str) -> str:
    return f"{limit}\x00{key}"


async def held(redis: aioredis.Redis, queue: Queue, limit: str, key: str) -> int:
    return int(await redis.hget(queue.keys.held, lk(limit, key)) or 0)


async def redis_ms(redis: aioredis.Redis) -> int:
    seconds, micros = await redis.time()
    return seconds * 1000 + micros // 1000


def item(item_id: str, *keys: tuple[str, str], priority: int = 0, units: int = 1) -> NewItem:
    return NewItem(item_id, priority, limits=tuple(LimitKey(limit, key, units) for limit, key in keys))


async def test_items_with_limits_wait_in_their_group_and_still_count_as_ready(redis: aioredis.Redis) -> None:
    queue = Queue(redis)
    await queue.put_limit_definitions([CONC1])
    assert await queue.enqueue_many([item("a", ("cust", "1")), NewItem("plain")]) == 2
    assert await redis.zcard(queue.keys.ready) == 1  # only the plain one
    assert await queue.states(["a", "plain"]) == {"a": ItemState.READY, "plain": ItemState.READY}
    assert (await queue.stats()).ready == 2
    assert (await queue.key_state("cust", "1")).queued == 1
    assert {lease.id for lease in await queue.dequeue("w", VT, 10)} == {"a", "plain"}
    assert await held(redis, queue, "cust", "1") == 1
    assert (await queue.key_state("cust", "1")).queued == 0


async def test_concurrency_one_never_leases_two_runs_of_a_key_at_once(redis: aioredis.Redis) -> None:
    queue = Queue(redis)
    await queue.put_limit_definitions([CONC1])
    rng = random.Random(7)
    keys = [str(n) for n in range(12)]
    items = [item(f"r{n}", ("cust", rng.choice(keys)), priority=rng.randint(-2, 2)) for n in range(150)]
    key_of = {i.id: i.limits[0].key for i in items}
    await queue.enqueue_many(items)
    running: dict[str, str] = {}
    done: set[str] = set()
    overlaps: list[tuple[str, str]] = []

    async def consumer(name: str) -> None:
        idle_rounds = 0
        while len(done) < len(items) and idle_rounds < 2000:
            leases = await queue.dequeue(name, VT, 3)
            if not leases:
                idle_rounds += 1
                await asyncio.sleep(0)
                continue
            for lease in leases:
                key = key_of[lease.id]
                if key in running:
                    overlaps.append((running[key], lease.id))
                running[key] = lease.id
            await asyncio.sleep(0)  # others dequeue while these "run"
            for lease in leases:
                # Released before the ack is sent: a correct queue cannot lease the key's next run
                # until the ack has run, so only a real overlap is caught.
                del running[key_of[lease.id]]
                assert await queue.ack(lease.id, lease.token)
                done.add(lease.id)

    await asyncio.gather(*(consumer(f"w{n}") for n in range(4)))
    assert overlaps == []
    assert done == {i.id for i in items}
    assert await redis.hlen(queue.keys.held) == 0
    assert await redis.hlen(queue.keys.holds) == 0
    assert await redis.zcard(queue.keys.gwait) == 0


async def test_a_key_with_a_big_backlog_does_not_delay_a_key_with_one_run(redis: aioredis.Redis) -> None:
    queue = Queue(redis)
    await queue.put_limit_definitions([LimitDefinition("cust", "concurrency", 5000)])
    await queue.enqueue_many([item(f"big{n}", ("cust", "noisy")) for n in range(1000)])
    await queue.enqueue_many([item("quiet", ("cust", "calm"))])
    first = await queue.dequeue("w", VT, 4)
    assert "quiet" in [lease.id for lease in first]


async def test_priority_orders_the_runs_of_a_group(redis: aioredis.Redis) -> None:
    queue = Queue(redis)
    await queue.put_limit_definitions([LimitDefinition("cust", "concurrency", 100)])
    await queue.enqueue_many(
        [
            item("low", ("cust", "k"), priority=-3),
            item("mid", ("cust", "k")),
            item("high1", ("cust", "k"), priority=5),
            item("high2", ("cust", "k"), priority=5),
        ]
    )
    order = [lease.id for _ in range(4) for lease in await queue.dequeue("w", VT, 1)]
    assert order == ["high1", "high2", "mid", "low"]


async def test_ready_items_and_groups_interleave_by_priority_then_age(redis: aioredis.Redis) -> None:
    queue = Queue(redis)
    await queue.put_limit_definitions([LimitDefinition("cust", "concurrency", 100)])
    await queue.enqueue_many([NewItem("old-plain"), item("grouped", ("cust", "k")), NewItem("new-plain")])
    await queue.enqueue_many([NewItem("urgent-plain", priority=9)])
    assert [lease.id for lease in await queue.dequeue("w", VT, 4)] == [
        "urgent-plain",
        "old-plain",
        "grouped",
        "new-plain",
    ]


async def test_a_rate_admits_its_burst_then_waits_exactly_until_the_retry_time(
    redis: aioredis.Redis, deadline: Deadline
) -> None:
    queue = Queue(redis)
    # 10 per second (T = 100 ms), burst 2: three at once, then one per 100 ms.
    await queue.put_limit_definitions([LimitDefinition("api", "rate", 10, timedelta(seconds=1), burst=2)])
    await queue.enqueue_many([item(f"r{n}", ("api", "host")) for n in range(6)])
    first = await queue.dequeue("w", VT, 10)
    assert [lease.id for lease in first] == ["r0", "r1", "r2"]
    tat = int(await redis.zscore(queue.keys.tat, lk("api", "host")) or 0)
    due = tat - 200  # one unit passes once tat - now <= burst * T
    group = '[["api","host",1]]'
    assert await redis.zscore(queue.keys.gdelay, group) == due
    blocked = await queue.blocked_by(["r3", "r0"])
    assert list(blocked) == ["r3"]
    assert (blocked["r3"].limit, blocked["r3"].key, blocked["r3"].kind) == ("api", "host", "rate")
    state = await queue.key_state("api", "host")
    assert state.next_admission == datetime.fromtimestamp(due / 1000, tz=UTC)
    # An empty dequeue tells an idle worker to come back exactly then.
    before = await redis_ms(redis)
    leases, wait_s = await queue._take("w", VT, 1)
    after = await redis_ms(redis)
    if after < due:  # (under a heavy load the retry time may have passed already)
        assert not leases
        assert wait_s is not None
        assert before <= due - round(wait_s * 1000) <= after  # the script's clock, between ours
    # A blocking dequeue gets the next run no earlier than the retry time, and only one.
    [lease] = await queue.dequeue_blocking("w", VT, 10, timedelta(seconds=3))
    assert lease.leased_at is not None
    leased_at = round(lease.leased_at.timestamp() * 1000)  # the instant the rate admitted it
    assert lease.id == "r3"
    assert due <= leased_at < due + 1000


async def ended_by(op: str, queue: Queue, redis: aioredis.Redis, lease: Lease, deadline: Deadline) -> bool:
    """End `lease` by `op`; True if the op reports it did."""
    if op == "ack":
        return await queue.ack(lease.id, lease.token)
    if op == "nack":
        return await queue.nack(lease.id, lease.token, timedelta(seconds=60))
    if op == "finish_ack":
        return (await queue.finish_many(acks=[lease]))[0]
    if op == "finish_retry":
        return (await queue.finish_many(retries=[(lease, timedelta(seconds=60))]))[0]
    if op == "finish_dead":
        return (await queue.finish_many(dead=[(lease, "boom")]))[0]
    if op == "dead_letter":
        return await queue.dead_letter(lease.id, lease.token, "boom")
    assert op == "recover"
    until = deadline(10)
    while True:
        recovered = await queue.recover_expired()
        if lease.id in recovered.requeued or lease.id in recovered.dead:
            return True
        assert time.monotonic() < until, "the lease never expired"
        await asyncio.sleep(0.005)


@pytest.mark.parametrize("op", ["ack", "nack", "finish_ack", "finish_retry", "finish_dead", "dead_letter", "recover"])
async def test_units_come_back_once_when_a_lease_ends(redis: aioredis.Redis, deadline: Deadline, op: str) -> None:
    queue = Queue(redis, max_stalls=5)
    await queue.put_limit_definitions([LimitDefinition("cust", "concurrency", 2)])
    await queue.enqueue_many([item("a", ("cust", "k"), units=2), item("b", ("cust", "k"))])
    visibility = timedelta(milliseconds=50) if op == "recover" else VT
    [lease] = await queue.dequeue("w", visibility, 5)
    assert lease.id == "a"
    assert await held(redis, queue, "cust", "k") == 2
    assert await queue.dequeue("w", VT, 5) == []  # b waits: the key is full
    assert list(await queue.blocked_by(["b"])) == ["b"]
    assert await ended_by(op, queue, redis, lease, deadline)
    assert await held(redis, queue, "cust", "k") == 0
    assert not await redis.hexists(queue.keys.holds, "a")
    # The key's parked group woke: b runs now, holding one unit.
    taken = [lease.id for lease in await queue.dequeue("w", VT, 5)]
    assert "b" in taken
    assert await held(redis, queue, "cust", "k") == 1 + (2 if "a" in taken else 0)
    # Sending the same end again changes nothing: the units came back once.
    if op != "recover":
        assert not await ended_by(op, queue, redis, lease, deadline)
    assert await held(redis, queue, "cust", "k") == 1 + (2 if "a" in taken else 0)


async def test_remove_and_dead_letter_of_waiting_runs_leave_their_group(redis: aioredis.Redis) -> None:
    queue = Queue(redis)
    await queue.put_limit_definitions([CONC1])
    await queue.enqueue_many([item("a", ("cust", "k")), item("b", ("cust", "k")), item("c", ("cust", "k"))])
    assert await queue.remove("b")
    assert await queue.dead_letter("c", None, "operator")
    assert (await queue.key_state("cust", "k")).queued == 1
    assert await queue.states(["b", "c"]) == {"b": None, "c": ItemState.DEAD}
    assert [lease.id for lease in await queue.dequeue("w", VT, 5)] == ["a"]
    assert await redis.zcard(queue.keys.gwait) == 0
    # Requeued from dead, c goes back to its group (and waits for a's unit).
    assert await queue.requeue_dead(["c"]) == ["c"]
    assert await queue.dequeue("w", VT, 5) == []
    assert list(await queue.blocked_by(["c"])) == ["c"]


async def test_delayed_and_restored_runs_keep_their_limits(redis: aioredis.Redis, deadline: Deadline) -> None:
    queue = Queue(redis)
    await queue.put_limit_definitions([CONC1])
    await queue.enqueue_many([item("held", ("cust", "k"))])
    [lease] = await queue.dequeue("w", VT, 1)
    await queue.enqueue_many([NewItem("later", delay=timedelta(milliseconds=20), limits=(LimitKey("cust", "k"),))])
    await queue.restore_dead([(item("dead", ("cust", "k")), "lost")])
    until = deadline(5)
    while await redis.zcard(queue.keys.delayed):
        assert time.monotonic() < until
        await queue.promote_due()
    assert await queue.dequeue("w", VT, 5) == []  # the key is held: "later" waits in the group
    assert await queue.requeue_dead(["dead"]) == ["dead"]
    assert await queue.dequeue("w", VT, 5) == []
    assert await queue.ack(lease.id, lease.token)
    assert [lease.id for lease in await queue.dequeue("w", VT, 5)] == ["later"]


async def test_a_paused_key_admits_nothing_until_resumed(redis: aioredis.Redis) -> None:
    queue = Queue(redis)
    await queue.put_limit_definitions([CONC1])
    assert await queue.pause_key("cust", "k") is None
    await queue.enqueue_many([item("a", ("cust", "k")), item("other", ("cust", "j"))])
    assert [lease.id for lease in await queue.dequeue("w", VT, 5)] == ["other"]
    blocked = await queue.blocked_by(["a"])
    assert blocked["a"].kind == "paused"
    state = await queue.key_state("cust", "k")
    assert state.paused_until is None  # paused until resumed
    assert await redis.zscore(queue.keys.kpause, lk("cust", "k")) is not None
    assert await queue.resume_key("cust", "k") == 1
    assert [lease.id for lease in await queue.dequeue("w", VT, 5)] == ["a"]


async def test_a_pause_ends_by_itself_and_wakes_an_idle_worker_then(redis: aioredis.Redis) -> None:
    queue = Queue(redis)
    await queue.put_limit_definitions([CONC1])
    until = await queue.pause_key("cust", "k", timedelta(milliseconds=300))
    assert until is not None
    await queue.enqueue_many([item("a", ("cust", "k"))])
    assert await queue.dequeue("w", VT, 1) == []
    assert (await queue.key_state("cust", "k")).paused_until == until
    started = time.monotonic()
    [lease] = await queue.dequeue_blocking("w", VT, 1, timedelta(seconds=3))
    assert lease.id == "a"
    assert lease.deadline - VT >= until
    assert time.monotonic() - started < 2.0  # woken at the pause's end, not at a polling bound


async def test_retry_after_pauses_the_keys_and_costs_no_delivery(redis: aioredis.Redis) -> None:
    queue = Queue(redis)
    await queue.put_limit_definitions([CONC1, LimitDefinition("host", "concurrency", 10)])
    await queue.enqueue_many([item("a", ("cust", "k"), ("host", "h")), item("b", ("cust", "j"))])
    leases = await queue.dequeue("w", VT, 1)
    assert [lease.id for lease in leases] == ["a"]
    assert leases[0].deliveries == 1
    assert await queue.nack("a", leases[0].token, retry_after=timedelta(milliseconds=400))
    assert await redis.hget(queue.keys.deliveries, "a") is None  # the delivery was given back
    for limit, key in (("cust", "k"), ("host", "h")):
        assert (await queue.key_state(limit, key)).paused_until is not None
    assert await held(redis, queue, "cust", "k") == 0
    # Other keys keep running; "a" waits for the pause.
    assert [lease.id for lease in await queue.dequeue("w", VT, 5)] == ["b"]
    assert (await queue.blocked_by(["a"]))["a"].kind == "paused"
    [again] = await queue.dequeue_blocking("w", VT, 1, timedelta(seconds=3))
    assert again.id == "a"
    assert again.deliveries == 1


async def test_a_run_without_a_definition_waits_until_one_comes(redis: aioredis.Redis) -> None:
    queue = Queue(redis)
    await queue.enqueue_many([item("a", ("nodef", "k"))])
    assert await queue.dequeue("w", VT, 1) == []
    assert (await queue.blocked_by(["a"]))["a"].kind == "undefined"
    assert await queue.put_limit_definitions([LimitDefinition("nodef", "concurrency", 1)]) == 1
    assert [lease.id for lease in await queue.dequeue("w", VT, 1)] == ["a"]


async def test_definitions_travel_with_the_enqueue(redis: aioredis.Redis) -> None:
    queue = Queue(redis)
    await queue.enqueue_many([item("a", ("cust", "k"))], definitions=[CONC1])
    assert [lease.id for lease in await queue.dequeue("w", VT, 1)] == ["a"]


async def test_overrides_and_runs_of_several_keys(redis: aioredis.Redis) -> None:
    queue = Queue(redis)
    await queue.put_limit_definitions(
        [
            LimitDefinition("cust", "concurrency", 1, overrides={"vip": (2, 0)}),
            LimitDefinition("host", "concurrency", 2),
        ]
    )
    await queue.enqueue_many(
        [
            item("v1", ("cust", "vip"), ("host", "h")),
            item("v2", ("cust", "vip"), ("host", "h")),
            item("x1", ("cust", "x"), ("host", "h")),
            item("y1", ("cust", "y"), ("host", "g")),
        ]
    )
    taken = [lease.id for lease in await queue.dequeue("w", VT, 10)]
    # vip may hold 2, but host h only 2 in all: v1 and (v2 or x1); y1 is on another host.
    assert len(taken) == 3
    assert "y1" in taken
    assert "v1" in taken
    assert await held(redis, queue, "host", "h") == 2
    waiting = ({"v2", "x1"} - set(taken)).pop()
    assert (await queue.blocked_by([waiting]))[waiting].limit == "host"


async def test_parked_groups_cost_nothing_and_blocked_ones_are_bounded_per_dequeue(redis: aioredis.Redis) -> None:
    queue = Queue(redis)
    await queue.put_limit_definitions([CONC1, LimitDefinition("gate", "concurrency", 1000)])
    await queue.pause_key("gate", "shared")
    # 200 groups (one key of their own each, plus the paused shared key): each is blocked.
    await queue.enqueue_many([item(f"r{n}", ("cust", f"own{n}"), ("gate", "shared")) for n in range(200)])
    assert await redis.zcard(queue.keys.gactive) == 200
    assert await queue.dequeue("w", VT, 1) == []
    assert await redis.zcard(queue.keys.gactive) >= 200 - (1 + 8)
    while await queue.dequeue("w", VT, 10) == [] and await redis.zcard(queue.keys.gactive):
        pass
    assert await redis.zcard(queue.keys.gactive) == 0
    assert await redis.zcard(queue.keys.kpark) == 200
    assert await queue.resume_key("gate", "shared") == 200
    assert len(await queue.dequeue("w", VT, 1000)) == 200


async def test_a_queue_without_limits_pays_one_check_per_call_not_per_item(redis: aioredis.Redis) -> None:
    queue = Queue(redis)
    await queue.enqueue_many([NewItem(f"i{n}") for n in range(50)])

    async def calls() -> dict[str, int]:
        stats = await redis.info("commandstats")
        return {name.removeprefix("cmdstat_"): int(value["calls"]) for name, value in stats.items()}

    before = await calls()
    leases = await queue.dequeue("w", VT, 50)
    assert len(leases) == 50
    assert all(await queue.finish_many(acks=leases[:25], retries=[(lease, timedelta(0)) for lease in leases[25:]]))
    after = await calls()
    delta = {name: count - before.get(name, 0) for name, count in after.items() if count != before.get(name)}
    assert delta.get("exists") == 2  # one per script call
    assert "hexists" not in delta
    # As before limits: a lease reads data and priority, a finish the token, a retry its priority.
    assert delta.get("hget", 0) == 50 * 2 + 50 + 25


async def test_a_lone_group_drains_with_writes_per_call_not_per_run(redis: aioredis.Redis) -> None:
    # The drain of one group (issue 22: a limit costs a drain at most 15 %): its turns are taken at
    # once, and the acks give their units back at once: one write per key and call, not per run.
    queue = Queue(redis)
    await queue.put_limit_definitions([LimitDefinition("cust", "concurrency", 1000)])
    await queue.enqueue_many([item(f"i{n}", ("cust", "k")) for n in range(60)])

    async def calls() -> dict[str, int]:
        stats = await redis.info("commandstats")
        return {name.removeprefix("cmdstat_"): int(value["calls"]) for name, value in stats.items()}

    before = await calls()
    leases = await queue.dequeue("w", VT, 50)
    assert [lease.id for lease in leases] == [f"i{n}" for n in range(50)]
    assert await held(redis, queue, "cust", "k") == 50
    assert all(await queue.finish_many(acks=leases[:40]))
    assert all(await queue.ack_many(leases[40:]))
    after = await calls()
    delta = {name: count - before.get(name, 0) for name, count in after.items() if count != before.get(name)}
    # A lease counts its delivery; the group's units, its queued count and each return: one each.
    assert delta.get("hincrby") == 50 + 1 + 1 + 2
    assert delta.get("zrem") == 50  # processing, per run
    assert delta.get("zremrangebylex") == 1  # the group's backlog, once
    assert delta.get("zrange", 0) <= 8  # a few per call (groups, backlog, ready's head)
    assert await held(redis, queue, "cust", "k") == 0
    assert await redis.hlen(queue.keys.holds) == 0
    assert (await queue.key_state("cust", "k")).queued == 10
    assert [lease.id for lease in await queue.dequeue("w", VT, 50)] == [f"i{n}" for n in range(50, 60)]
    assert await redis.exists(queue.keys.gactive, queue.keys.gwait, queue.keys.gmem, queue.keys.kqueued) == 0


@pytest.mark.parametrize(
    ("definition", "units", "taken"),
    [
        (LimitDefinition("lim", "concurrency", 3), 1, 3),
        (LimitDefinition("lim", "concurrency", 5), 2, 2),
        (LimitDefinition("lim", "concurrency", 2), 3, 1),  # more than the cap: alone on its key
        (LimitDefinition("lim", "concurrency", 3, overrides={"k": (6, 0)}), 1, 6),
        (LimitDefinition("lim", "rate", 10, timedelta(seconds=1), burst=4), 1, 5),
        (LimitDefinition("lim", "rate", 10, timedelta(seconds=1), burst=4), 2, 2),
    ],
)
async def test_a_lone_group_takes_in_one_dequeue_exactly_what_its_key_admits(
    redis: aioredis.Redis, definition: LimitDefinition, units: int, taken: int
) -> None:
    queue = Queue(redis)
    await queue.put_limit_definitions([definition])
    await queue.enqueue_many([item(f"r{n}", ("lim", "k"), units=units) for n in range(10)])
    await queue.enqueue_many([NewItem("plain")])
    leases = await queue.dequeue("w", VT, 20)
    assert [lease.id for lease in leases] == [f"r{n}" for n in range(taken)] + ["plain"]
    if definition.kind == "concurrency":
        assert await held(redis, queue, "lim", "k") == taken * units
        assert await redis.hlen(queue.keys.holds) == taken
    blocked = await queue.blocked_by(["r0", f"r{taken}"])
    assert list(blocked) == [f"r{taken}"]
    assert (blocked[f"r{taken}"].key, blocked[f"r{taken}"].kind) == ("k", definition.kind)
    assert (await queue.key_state("lim", "k")).queued == 10 - taken


async def test_a_lone_group_with_two_keys_takes_what_both_admit(redis: aioredis.Redis) -> None:
    queue = Queue(redis)
    rate = LimitDefinition("b_rate", "rate", 10, timedelta(seconds=1), burst=2)
    await queue.put_limit_definitions([LimitDefinition("a_cap", "concurrency", 4), rate])
    await queue.enqueue_many([item(f"r{n}", ("a_cap", "k"), ("b_rate", "k")) for n in range(10)])
    assert [lease.id for lease in await queue.dequeue("w", VT, 10)] == ["r0", "r1", "r2"]
    assert await held(redis, queue, "a_cap", "k") == 3
    # The TAT advanced by exactly the three runs taken: two more T (100 ms) past the first's.
    now = await redis_ms(redis)
    tat = int(await redis.zscore(queue.keys.tat, lk("b_rate", "k")) or 0)
    assert now < tat <= now + 300


async def test_groups_with_room_take_turns_one_run_each(redis: aioredis.Redis) -> None:
    queue = Queue(redis)
    await queue.put_limit_definitions([LimitDefinition("cust", "concurrency", 2)])
    await queue.enqueue_many([item(f"a{n}", ("cust", "a")) for n in range(5)])
    await queue.enqueue_many([item(f"b{n}", ("cust", "b")) for n in range(5)])
    # Round-robin while both have room; then the lone group with room takes its own.
    assert [lease.id for lease in await queue.dequeue("w", VT, 3)] == ["a0", "b0", "a1"]
    assert [lease.id for lease in await queue.dequeue("w", VT, 10)] == ["b1"]


async def test_caps_hold_and_nothing_sticks_under_mixed_returns(redis: aioredis.Redis) -> None:
    # Runs of 2 keys each (a customer cap of 1 and a host cap of 2), some asking 2 host units,
    # returned by every path at random: caps never exceed, nothing waits for ever, nothing leaks.
    queue = Queue(redis, max_stalls=100)
    await queue.put_limit_definitions(
        [LimitDefinition("cust", "concurrency", 1), LimitDefinition("host", "concurrency", 2)]
    )
    rng = random.Random(22)
    items = [
        NewItem(
            f"r{n}",
            rng.randint(-1, 1),
            limits=(
                LimitKey("cust", str(rng.randrange(15))),
                LimitKey("host", f"h{rng.randrange(3)}", rng.choice((1, 2))),
            ),
        )
        for n in range(200)
    ]
    spec = {i.id: i.limits for i in items}
    await queue.enqueue_many(items)
    usage: dict[tuple[str, str], int] = {}
    caps = {"cust": 1, "host": 2}
    violations: list[str] = []
    done: set[str] = set()

    def take(item_id: str, sign: int) -> None:
        for limit in spec[item_id]:
            slot = (limit.limit, limit.key)
            usage[slot] = usage.get(slot, 0) + sign * limit.units
            # A run asking more units than the cap runs alone on its key.
            if sign > 0 and usage[slot] > max(caps[limit.limit], limit.units):
                violations.append(f"{slot} at {usage[slot]}")

    async def consumer(name: str) -> None:
        idle = 0
        while len(done) < len(items) and idle < 3000:
            leases = await queue.dequeue(name, VT, 4)
            if not leases:
                idle += 1
                await asyncio.sleep(0)
                continue
            idle = 0
            for lease in leases:
                take(lease.id, +1)
            await asyncio.sleep(0)
            for lease in leases:
                take(lease.id, -1)
                roll = rng.random()
                if roll < 0.6:
                    assert await queue.ack(lease.id, lease.token)
                    done.add(lease.id)
                elif roll < 0.75:
                    assert await queue.nack(lease.id, lease.token)
                elif roll < 0.85:
                    assert (await queue.finish_many(retries=[(lease, timedelta(0))]))[0]
                elif roll < 0.92:
                    assert await queue.nack(lease.id, lease.token, retry_after=timedelta(milliseconds=5))
                else:
                    assert await queue.dead_letter(lease.id, lease.token, "x")
                    assert await queue.requeue_dead([lease.id]) == [lease.id]

    await asyncio.gather(*(consumer(f"w{n}") for n in range(4)))
    assert violations == []
    assert done == set(spec), f"stuck: {sorted(set(spec) - done)[:5]}"
    for key in ("held", "holds", "lims", "gwait", "gmem", "gactive", "gdelay", "gblock", "kpark", "kqueued"):
        assert await redis.exists(getattr(queue.keys, key)) == 0, key


async def test_a_freed_unit_is_not_left_with_groups_asleep_on_it(redis: aioredis.Redis) -> None:
    # A returned unit wakes one group parked on its key; when that group turns out blocked by
    # another key, it passes the wake-up on, so the next group parked on the freed key runs.
    queue = Queue(redis)
    await queue.put_limit_definitions(
        [LimitDefinition("a_host", "concurrency", 1), LimitDefinition("b_cust", "concurrency", 1)]
    )
    await queue.enqueue_many(
        [item("p1", ("a_host", "h"), ("b_cust", "a")), item("p2", ("a_host", "g2"), ("b_cust", "b"))]
    )
    p1, p2 = await queue.dequeue("w", VT, 2)
    assert (p1.id, p2.id) == ("p1", "p2")
    await queue.enqueue_many(
        [
            item("g1", ("a_host", "g"), ("b_cust", "a")),  # parks on b_cust a
            item("g2", ("a_host", "h"), ("b_cust", "b")),  # parks on a_host h (its first blocked key)
            item("g3", ("a_host", "h"), ("b_cust", "c")),  # parks on a_host h, behind g2
        ]
    )
    assert await queue.dequeue("w", VT, 10) == []
    assert {run: block.key for run, block in (await queue.blocked_by(["g1", "g2", "g3"])).items()} == {
        "g1": "a",
        "g2": "h",
        "g3": "h",
    }
    assert await queue.ack(p1.id, p1.token)  # frees a_host h and b_cust a
    assert {lease.id for lease in await queue.dequeue("w", VT, 10)} == {"g1", "g3"}
    assert (await queue.blocked_by(["g2"]))["g2"].key == "b"  # waits for p2 now


async def test_rate_state_of_keys_no_longer_used_is_dropped(redis: aioredis.Redis, deadline: Deadline) -> None:
    queue = Queue(redis)
    await queue.put_limit_definitions([LimitDefinition("api", "rate", 1000, timedelta(seconds=1))])
    await queue.enqueue_many([item("old", ("api", "old"))])
    assert len(await queue.dequeue("w", VT, 1)) == 1
    tat = int(await redis.zscore(queue.keys.tat, lk("api", "old")) or 0)
    until = deadline(5)
    while await redis_ms(redis) <= tat:
        assert time.monotonic() < until
        await asyncio.sleep(0.001)
    await queue.enqueue_many([item("new", ("api", "new"))])
    assert len(await queue.dequeue("w", VT, 1)) == 1
    assert await redis.zrange(queue.keys.tat, 0, -1) == [lk("api", "new").encode()]


async def test_the_sequence_restarts_only_when_no_group_waits_either(redis: aioredis.Redis) -> None:
    queue = Queue(redis)
    await queue.put_limit_definitions([LimitDefinition("cust", "concurrency", 100)])
    await redis.set(queue.keys.seq, SEQ_SPAN // 2 - 1)  # the next but one passes the restart point
    await queue.enqueue_many([item("first", ("cust", "k"))])
    await queue.enqueue_many([item("second", ("cust", "k"))])  # ready is empty, the group is not
    assert [lease.id for lease in await queue.dequeue("w", VT, 2)] == ["first", "second"]


async def test_a_rate_drains_a_backlog_at_the_rate_and_no_second_exceeds_it_plus_the_burst(
    redis: aioredis.Redis,
) -> None:
    # The acceptance row, scaled down: 100/s with burst 10 over 300 runs, two consumers.
    queue = Queue(redis)
    await queue.put_limit_definitions([LimitDefinition("api", "rate", 100, timedelta(seconds=1), burst=10)])
    await queue.enqueue_many([item(f"r{n}", ("api", "host")) for n in range(300)])
    starts: list[int] = []

    async def consumer(name: str) -> None:
        while len(starts) < 300:
            leases = await queue.dequeue_blocking(name, VT, 20, timedelta(seconds=1))
            for lease in leases:  # its instant: the one its admission read (the start a worker records)
                assert lease.leased_at is not None
                starts.append(round(lease.leased_at.timestamp() * 1000))
            if leases:
                assert all(await queue.ack_many(leases))

    await asyncio.wait_for(asyncio.gather(consumer("w1"), consumer("w2")), timeout=30)
    starts.sort()
    fullest = max(sum(1 for other in starts[i:] if other < start + 1000) for i, start in enumerate(starts))
    rate = (len(starts) - 11) / ((starts[-1] - starts[0]) / 1000)
    pauses = sum(1 for before, after in itertools.pairwise(starts) if after - before >= 750)
    print(f"drained at {rate:.1f}/s, fullest second {fullest} starts, {pauses} pauses of 0.75 s or more")
    assert fullest <= 110  # exact: the GCRA never lets more through
    assert rate <= 100.5, rate
    # Measured 99.9-100.0/s on an idle machine and 48/s on one running four test suites at once
    # (each late wake-up costs the rate its delay), so the rate cannot tell a loaded machine from a
    # queue that lets its consumers sleep past the retry time. The pauses can: such a queue leaves a
    # gap of its whole 1 s block after each burst (13 of 0.87-1.05 s over these 300 runs), where a
    # late wake-up leaves gaps of the machine's delay (at most 52 ms here, idle).
    assert pauses <= 2, pauses


async def test_runs_with_limits_are_never_reserved_ahead(redis: aioredis.Redis) -> None:
    # A reservation would skip admission; a limited run is taken when due, through its group.
    queue = Queue(redis)
    await queue.put_limit_definitions([CONC1])
    await queue.enqueue_many([NewItem("later", delay=timedelta(milliseconds=400), limits=(LimitKey("cust", "k"),))])
    leases, wait_s = await queue._take("w", VT, 5, reserve=timedelta(seconds=5), reserve_count=5)
    assert leases == []
    assert wait_s is not None
    assert 0.2 < wait_s <= 0.401  # until it is due (enqueue rounds up a ms), not within the window
    [lease] = await queue.dequeue_blocking(
        "w", VT, 5, timedelta(seconds=3), reserve=timedelta(seconds=5), reserve_count=5
    )
    assert lease.id == "later"
    assert lease.due_in is None  # leased when ready, not reserved
