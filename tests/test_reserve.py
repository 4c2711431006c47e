"""Worker reservations: delayed runs due within `SCHEDULER_WORKER_RESERVE_AHEAD` are leased and
claimed ahead, held outside the slots, and started at their due time (database clock), never before.

In-process workers against the real stores: the queue's reservations, the start at the due time
with the real start recorded, the hand-backs (stop, grace, cancel) and the switch that turns it off.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from datetime import UTC, datetime, timedelta
from typing import Any, ClassVar

import asyncpg
import pytest
import redis.asyncio as aioredis

from chaos.proxy import FaultProxy
from scheduler_grpc.config import load
from scheduler_grpc.connections import redis_client
from scheduler_grpc.control import Control
from scheduler_grpc.db.executions import Claim, Queued
from scheduler_grpc.db.firing import FiringRepository
from scheduler_grpc.db.history import HistoryRepository
from scheduler_grpc.db.runs import RunRepository
from scheduler_grpc.dispatch import Queues, enqueue_runs
from scheduler_grpc.errors import ConfigError
from scheduler_grpc.executions import ExecutionStatus, Trigger
from scheduler_grpc.handlers import ExecutionContext, Handler, HandlerRegistry, JSONValue
from scheduler_grpc.jobs import JobSpec
from scheduler_grpc.queue import ItemState, NewItem, Queue
from scheduler_grpc.worker import Worker
from tests.engine_helpers import eventually, make_settings
from tests.test_worker_faults import registry_with

VT = timedelta(seconds=30)
MS = timedelta(milliseconds=1)


class ClockHandler(Handler):
    """Records when each attempt's handler began (host clock: the same host as PostgreSQL here);
    with `gate` in the payload it waits for the test to open the gate first."""

    name: ClassVar[str] = "test.clock"
    description: ClassVar[str] = "note the start"
    extra_fields: ClassVar[bool] = True

    def __init__(self) -> None:
        self.began: dict[str, datetime] = {}
        self.gate = asyncio.Event()

    async def run(self, ctx: ExecutionContext, payload: dict[str, Any]) -> JSONValue:
        self.began[ctx.execution_id] = datetime.now(UTC)
        if payload.get("gate"):
            await self.gate.wait()
        return None


class SpyRepository(RunRepository):
    """Notes which runs were claimed as reservations."""

    def __init__(self, pool: asyncpg.Pool) -> None:
        super().__init__(pool)
        self.reserved: set[str] = set()
        self.plain: set[str] = set()

    async def claim(
        self,
        items: Sequence[tuple[str, str]],
        worker_id: str,
        *,
        reserved: Sequence[bool] = (),
        leased_at: Sequence[datetime | None] = (),
        slots: Sequence[datetime | None] = (),
    ) -> list[Claim]:
        flags = list(reserved) or [False] * len(items)
        for (run_id, _), flag in zip(items, flags, strict=True):
            (self.reserved if flag else self.plain).add(run_id)
        return await super().claim(items, worker_id, reserved=reserved, leased_at=leased_at, slots=slots)


Clocked = tuple[ClockHandler, HandlerRegistry, Control]


@pytest.fixture
def clocked(redis: aioredis.Redis, pool: asyncpg.Pool) -> Clocked:
    """A clock handler, a registry with it, and a Control over the test stores."""
    clock = ClockHandler()
    registry = registry_with(clock)
    return clock, registry, Control(redis, pool, registry)


@asynccontextmanager
async def worker_running(
    redis_url: str,
    database_url: str,
    pool: asyncpg.Pool,
    registry: HandlerRegistry,
    *,
    runs: RunRepository | None = None,
    concurrency: int = 4,
    **env: str,
) -> AsyncIterator[tuple[Worker, asyncio.Event, asyncio.Task[None]]]:
    """An in-process worker, its run store `runs` (default: a `RunRepository` over `pool`); set the
    event to stop it (the task then ends)."""
    env = {"SCHEDULER_VISIBILITY_TIMEOUT": "5s", "SCHEDULER_SHUTDOWN_GRACE": "1s", **env}
    settings = make_settings(redis_url, database_url, **env)
    client = redis_client(redis_url)
    worker = Worker(
        client, runs or RunRepository(pool), registry, settings,
        history=HistoryRepository(pool), worker_id="reserving", concurrency=concurrency,
    )  # fmt: skip
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    try:
        yield worker, stop, task
    finally:
        stop.set()
        with contextlib.suppress(Exception):
            async with asyncio.timeout(15):
                await task
        if not task.done():
            task.cancel()
        await client.aclose()


async def delayed_runs(
    pool: asyncpg.Pool, redis: aioredis.Redis, job_id: str, count: int, ahead: float
) -> list[Queued]:
    """`count` runs of a job due `ahead` seconds from now (database clock), enqueued delayed as the
    leader enqueues a slot it fired ahead."""
    now = await pool.fetchval("SELECT clock_timestamp()")
    due = now + timedelta(seconds=ahead)
    slots = [due + timedelta(microseconds=index) for index in range(count)]
    runs = await FiringRepository(pool).trigger(job_id, Trigger.MANUAL, slots, due_at=due)
    await enqueue_runs(Queues(redis), runs, now)
    return runs


async def rows_of(pool: asyncpg.Pool, runs: Sequence[Queued]) -> list[asyncpg.Record]:
    return await pool.fetch(
        """SELECT id::text, run_id::text, attempt, status, scheduled_for, due_at, started_at, worker_id
           FROM job_executions WHERE run_id = ANY($1::uuid[]) ORDER BY run_id, attempt""",
        [run.run_id for run in runs],
    )


async def all_with(pool: asyncpg.Pool, runs: Sequence[Queued], status: str) -> list[asyncpg.Record]:
    rows = await rows_of(pool, runs)
    return rows if len(rows) == len(runs) and all(row["status"] == status for row in rows) else []


async def held(pool: asyncpg.Pool, runs: Sequence[Queued]) -> bool:
    """Every run claimed ahead: `running`, with a start still to come."""
    return await pool.fetchval(
        """SELECT count(*) = $2 FROM job_executions
           WHERE run_id = ANY($1::uuid[]) AND status = 'running' AND started_at > clock_timestamp()""",
        [run.run_id for run in runs],
        len(runs),
    )


# -- the queue --------------------------------------------------------------------------------------


async def test_a_dequeue_reserves_delayed_items_within_the_window_after_the_ready_ones(redis: aioredis.Redis) -> None:
    queue = Queue(redis)
    near, far = timedelta(milliseconds=400), timedelta(seconds=5)
    await queue.enqueue_many([NewItem("ready"), NewItem("soon", delay=near), NewItem("later", delay=far)])
    window = timedelta(seconds=1)
    # Ready items first: they fill the request, so nothing is reserved.
    [first] = await queue.dequeue("w", VT, 1, reserve=window, reserve_count=10)
    assert (first.id, first.due_in) == ("ready", None)
    assert (await queue.stats()).delayed == 2
    # Without a reserve window a delayed item is not taken before its due time.
    assert await queue.dequeue("w", VT, 1) == []
    [soon] = await queue.dequeue("w", VT, 1, reserve=window, reserve_count=10)
    assert soon.id == "soon"
    assert soon.due_in is not None
    assert timedelta(milliseconds=200) < soon.due_in <= timedelta(milliseconds=400)
    states = await queue.states(["soon", "later"])
    assert states == {"soon": ItemState.PROCESSING, "later": ItemState.DELAYED}, "beyond the window stays delayed"
    assert await queue.dequeue("w", VT, 1, reserve=window, reserve_count=10) == []
    # An idle caller with a reserve window comes back when the next item enters the window.
    _, next_due = await queue._take("w", VT, 1, window, 10)
    assert next_due is not None
    assert 3.5 < next_due <= 4.0
    # A reserved lease is an ordinary lease: acked under its token.
    assert await queue.ack(soon.id, soon.token)


async def test_a_worker_that_reserves_wakes_a_sleeping_one_while_more_are_within_the_window(
    redis: aioredis.Redis,
) -> None:
    """An instant's runs are shared by the workers: the one that reserves first wakes another while
    runs within the window are left. Without that wake the others slept on (they went to sleep
    before these runs were enqueued, and the enqueue's wake is taken by one) and the first
    reserved the whole instant alone, starting its runs one after another (issue 25's lateness)."""
    queue = Queue(redis, "instant")
    window = timedelta(milliseconds=600)
    # Both workers wait for work while there is none, each for long.
    first = asyncio.create_task(
        queue.dequeue_blocking("a", VT, 1, timedelta(seconds=20), reserve=window, reserve_count=100)
    )
    second = asyncio.create_task(
        queue.dequeue_blocking("b", VT, 1, timedelta(seconds=20), reserve=window, reserve_count=100)
    )
    await eventually(lambda: _blocked_clients(redis, 2))
    # An instant's 300 runs, due in 1 s: the enqueue wakes one of them, which learns when they come
    # within its window and sleeps until then. Had the other slept on, it would have found them due
    # (no longer reservable) when its wait next looked, and taken one ready run.
    await queue.enqueue_many([NewItem(f"run-{i}", delay=timedelta(seconds=1)) for i in range(300)])
    async with asyncio.timeout(5):  # the other one's own wait would end only after 20 s
        leases = await asyncio.gather(first, second)
    assert [len(batch) for batch in leases] == [100, 100]
    assert all(lease.due_in is not None for batch in leases for lease in batch)


async def test_an_instants_runs_are_reserved_in_fair_shares_by_the_reserving_workers(redis: aioredis.Redis) -> None:
    """Three workers reserving an instant's 1,000 runs 100 at a time, one of them asking far more
    often (the first to wake, or the one with the fastest claims): each ends with a third. Before,
    whoever asked took what it asked for, and one worker started most of an instant's runs one
    after another while the others idled (issue 25's lateness: shares of 500 and 600 of 1,000)."""
    queue = Queue(redis, "instant")
    window = timedelta(seconds=2)
    held = dict.fromkeys("abc", 0)
    await queue.enqueue_many([NewItem(f"run-{i}", delay=timedelta(seconds=1.8)) for i in range(1000)])
    for worker in "abc":  # each asks with reservations while runs are delayed: a known reserver
        assert await queue.dequeue(worker, VT, 1, reserve=MS, reserve_count=100) == []
    for worker in "aaaaaaaaaabbbbbccccc" * 2:
        taken = await queue.dequeue(worker, VT, 1, reserve=window, reserve_count=100, held=held[worker])
        held[worker] += len(taken)
    assert sum(held.values()) == 1000
    assert all(332 <= share <= 334 for share in held.values()), held  # a third each, give or take rounding
    assert (await queue.stats()).delayed == 0


async def test_a_worker_kept_out_by_its_share_comes_back_when_shares_end_and_takes_what_is_left(
    redis: aioredis.Redis,
) -> None:
    """A reserver that went away (or stopped asking) strands nothing: within a third of the window
    of the due time, whoever asks takes the rest, whatever its share; until then a caller that has
    its share is told to come back then, not at once (no busy loop)."""
    queue = Queue(redis, "instant")
    window = timedelta(seconds=3)
    await queue.enqueue_many([NewItem(f"run-{i}", delay=timedelta(seconds=2)) for i in range(10)])
    for worker in ("a", "gone"):
        assert await queue.dequeue(worker, VT, 1, reserve=MS, reserve_count=100) == []
    taken = await queue.dequeue("a", VT, 1, reserve=window, reserve_count=100)
    assert len(taken) == 5  # its half: "gone" reserved within the last seconds
    leases, next_due = await queue._take("a", VT, 1, window, 100, held=5)
    assert leases == []
    assert next_due is not None
    assert 0.9 < next_due <= 1.0, "back when the earliest run is a third of the window from its due time"
    async with asyncio.timeout(5):
        rest = await queue.dequeue_blocking(
            "a", VT, 1, timedelta(seconds=4), reserve=window, reserve_count=100, held=lambda: 5
        )
    assert len(rest) == 5
    assert all(lease.due_in is not None and lease.due_in <= window / 3 for lease in rest)


async def test_a_blocking_dequeue_counts_the_reservations_held_at_each_try(redis: aioredis.Redis) -> None:
    """The reservations a worker holds are read again each time its blocking dequeue tries: runs it
    held when the wait began have started since, and counting them would keep it out of the next
    instant until the shares end (it did: a worker's count from the instant before kept it out)."""
    queue = Queue(redis, "instant")
    window = timedelta(milliseconds=1500)
    await queue.enqueue("later", delay=timedelta(minutes=1))
    for worker in ("a", "b"):
        assert await queue.dequeue(worker, VT, 1, reserve=MS, reserve_count=100) == []
    held = [400]  # b's reservations when its wait begins; they have all started when the runs come
    waiting = asyncio.create_task(
        queue.dequeue_blocking(
            "b", VT, 1, timedelta(seconds=5), reserve=window, reserve_count=100, held=lambda: held[0]
        )
    )
    await eventually(lambda: _blocked_clients(redis, 1))
    held[0] = 0
    await queue.enqueue_many([NewItem(f"run-{i}", delay=timedelta(seconds=2)) for i in range(100)])
    async with asyncio.timeout(5):
        leases = await waiting
    assert len(leases) == 50  # its share, as soon as the runs came within the window
    assert all(lease.due_in is not None and lease.due_in > window / 3 for lease in leases)


async def _blocked_clients(redis: aioredis.Redis, count: int) -> bool:
    return int((await redis.info("clients"))["blocked_clients"]) >= count


async def test_a_resent_reserving_dequeue_returns_the_first_batch_and_orphans_nothing(
    redis: aioredis.Redis, redis_url: str
) -> None:
    proxy, url = await FaultProxy.to_url(redis_url)
    client = redis_client(url)
    try:
        queue = Queue(client)
        assert await queue.dequeue("w", VT, 1) == []  # loads the script
        await queue.enqueue_many([NewItem(name, delay=timedelta(seconds=2)) for name in ("a", "b")])
        proxy.drop_reply_to(b"EVALSHA")
        leases = await queue.dequeue("w", VT, 1, reserve=timedelta(seconds=3), reserve_count=1)
        assert proxy.stats.dropped_replies == 1  # the script ran, its reply was lost, the client resent it
        assert [lease.id for lease in leases] == ["a"]
        assert leases[0].due_in is not None
        stats = await Queue(redis).stats()
        assert (stats.delayed, stats.processing) == (1, 1)  # b still delayed, nothing orphaned
        assert await queue.ack(leases[0].id, leases[0].token)
    finally:
        await client.aclose()
        await proxy.close()


# -- the worker -------------------------------------------------------------------------------------


async def test_reserved_runs_start_at_their_due_time_never_before(
    redis: aioredis.Redis, pool: asyncpg.Pool, redis_url: str, database_url: str, clocked: Clocked
) -> None:
    clock, registry, control = clocked
    job = await control.create_job(JobSpec(name="due", handler="test.clock"))
    spy = SpyRepository(pool)
    async with worker_running(redis_url, database_url, pool, registry, runs=spy, concurrency=10):
        runs = await delayed_runs(pool, redis, job.id, 10, ahead=1.5)
        rows = await eventually(lambda: all_with(pool, runs, "succeeded"), within=15)
    assert spy.reserved == {run.run_id for run in runs}, "claimed ahead, as reservations"
    for row in rows:
        assert row["attempt"] == 1
        assert row["started_at"] >= row["scheduled_for"] >= row["due_at"], "started before its due time"
        # Its recorded start is when its handler began (the database clock, estimated from the claim's).
        began = clock.began[row["id"]]
        assert timedelta(milliseconds=-5) < began - row["started_at"] < timedelta(milliseconds=100), (began, row)
    lateness = sorted((row["started_at"] - row["scheduled_for"]).total_seconds() for row in rows)
    assert lateness[-1] < 0.25, lateness  # no claim on the way: a loaded host still fits easily


async def test_a_held_run_that_cannot_get_a_slot_starts_late_with_its_real_start_recorded(
    redis: aioredis.Redis, pool: asyncpg.Pool, redis_url: str, database_url: str, clocked: Clocked
) -> None:
    clock, registry, control = clocked
    blocker = await control.create_job(JobSpec(name="blocker", handler="test.clock", payload={"gate": True}))
    job = await control.create_job(JobSpec(name="late", handler="test.clock"))
    async with worker_running(redis_url, database_url, pool, registry, concurrency=1):
        # Reserved while the slot is free (a worker reserves only then), then the slot gets busy.
        runs = await delayed_runs(pool, redis, job.id, 1, ahead=1.5)
        await eventually(lambda: held(pool, runs), within=5)
        await control.trigger_job(blocker.id)
        await eventually(lambda: _true(bool(clock.began)))  # the only slot is busy
        due = runs[0].due_at

        async def overdue() -> bool:
            return bool(await pool.fetchval("SELECT clock_timestamp() > $1", due + timedelta(milliseconds=300)))

        await eventually(overdue, within=5)
        clock.gate.set()
        [row] = await eventually(lambda: all_with(pool, runs, "succeeded"), within=10)
    assert row["attempt"] == 1
    # Not its expected start (its due time): the real one, 300 ms on (less what the estimate from
    # the claim's clock may err early by, the claim reply's transfer).
    assert row["started_at"] >= due + timedelta(milliseconds=250), "the expected start, not the real one"
    began = clock.began[row["id"]]
    assert timedelta(milliseconds=-5) < began - row["started_at"] < timedelta(milliseconds=100), (began, row)


async def test_a_stopping_worker_hands_its_reservations_back_unspent(
    redis: aioredis.Redis, pool: asyncpg.Pool, redis_url: str, database_url: str, clocked: Clocked
) -> None:
    clock, registry, control = clocked
    job = await control.create_job(JobSpec(name="handed-back", handler="test.clock"))
    runs = await delayed_runs(pool, redis, job.id, 3, ahead=2.5)
    env = {"SCHEDULER_WORKER_RESERVE_AHEAD": "3s"}
    async with worker_running(redis_url, database_url, pool, registry, **env) as (_, stop, task):
        await eventually(lambda: held(pool, runs), within=5)
        stop.set()
        await asyncio.wait_for(task, 10)
    rows = await rows_of(pool, runs)
    assert [(row["attempt"], row["status"], row["started_at"], row["worker_id"]) for row in rows] == [
        (1, "queued", None, None)
    ] * 3, "the same attempt, queued again, as if never claimed"
    queue = Queue(redis)
    states = await queue.states(run.run_id for run in runs)
    assert set(states.values()) <= {ItemState.DELAYED, ItemState.READY}
    deliveries = await redis.hmget(queue.keys.deliveries, [run.run_id for run in runs])
    assert deliveries == [None] * 3, "the deliveries were given back"
    assert not clock.began, "nothing ran"
    # Another worker runs them, once each, in their first attempt, not before their due time.
    async with worker_running(redis_url, database_url, pool, registry):
        rows = await eventually(lambda: all_with(pool, runs, "succeeded"), within=15)
    assert all(row["attempt"] == 1 and row["started_at"] >= row["due_at"] for row in rows), rows
    assert len(clock.began) == 3


async def test_a_held_run_without_a_slot_within_the_grace_is_handed_back(
    redis: aioredis.Redis, pool: asyncpg.Pool, redis_url: str, database_url: str, clocked: Clocked
) -> None:
    clock, registry, control = clocked
    blocker = await control.create_job(JobSpec(name="blocker", handler="test.clock", payload={"gate": True}))
    job = await control.create_job(JobSpec(name="no-slot", handler="test.clock"))
    env = {"SCHEDULER_WORKER_RESERVE_GRACE": "200ms"}
    async with worker_running(redis_url, database_url, pool, registry, concurrency=1, **env):
        runs = await delayed_runs(pool, redis, job.id, 1, ahead=1.5)
        await eventually(lambda: held(pool, runs), within=5)
        await control.trigger_job(blocker.id)
        await eventually(lambda: _true(bool(clock.began)))  # the only slot is busy
        [row] = await eventually(lambda: all_with(pool, runs, "queued"), within=5)
        assert (row["attempt"], row["started_at"], row["worker_id"]) == (1, None, None)
        assert await Queue(redis).states([runs[0].run_id]) == {runs[0].run_id: ItemState.READY}
        clock.gate.set()  # the slot frees: the run goes on in the same attempt
        [row] = await eventually(lambda: all_with(pool, runs, "succeeded"), within=10)
    assert row["attempt"] == 1
    assert row["started_at"] >= row["due_at"]


async def test_a_cancelled_reservation_never_runs(
    redis: aioredis.Redis, pool: asyncpg.Pool, redis_url: str, database_url: str, clocked: Clocked
) -> None:
    clock, registry, control = clocked
    job = await control.create_job(JobSpec(name="cancel-held", handler="test.clock"))
    env = {"SCHEDULER_WORKER_RESERVE_AHEAD": "3s"}
    async with worker_running(redis_url, database_url, pool, registry, **env) as (worker, _, _):
        runs = await delayed_runs(pool, redis, job.id, 1, ahead=2.0)
        await eventually(lambda: held(pool, runs), within=5)
        await control.cancel_execution(runs[0].run_id)
        [row] = await eventually(lambda: all_with(pool, runs, "cancelled"), within=5)
        assert await Queue(redis).states([runs[0].run_id]) == {runs[0].run_id: None}, "its item is gone"
        await eventually(lambda: _true(worker.idle))
        # Past its due time: it never ran.
        await eventually(lambda: _true(datetime.now(UTC) > runs[0].due_at + timedelta(milliseconds=200)), within=5)
    assert (row["attempt"], row["started_at"]) == (1, None)
    assert not clock.began


class _BuggyUnclaim(RunRepository):
    async def unclaim(
        self, items: Sequence[tuple[str, str]], *, slots: Sequence[datetime | None] = ()
    ) -> dict[str, ExecutionStatus]:
        raise RuntimeError("a bug in the hand-back of a held run")


async def test_a_bug_in_a_runs_own_task_ends_the_worker(
    redis: aioredis.Redis, pool: asyncpg.Pool, redis_url: str, database_url: str, clocked: Clocked
) -> None:
    # Issue 19, defect 5: a held run's task ran outside the role's task group; a bug in it (here in
    # the hand-back of a cancelled reservation) vanished into "Task exception was never retrieved"
    # and the worker went on. It must end the role, like a bug anywhere else.
    _, registry, control = clocked
    job = await control.create_job(JobSpec(name="buggy-held", handler="test.clock"))
    env = {"SCHEDULER_WORKER_RESERVE_AHEAD": "3s"}
    executions = _BuggyUnclaim(pool)
    async with worker_running(redis_url, database_url, pool, registry, runs=executions, **env) as (_, _, task):
        runs = await delayed_runs(pool, redis, job.id, 1, ahead=2.0)
        await eventually(lambda: held(pool, runs), within=5)
        await control.cancel_execution(runs[0].run_id)
        await eventually(lambda: _true(task.done()), within=5)
        with pytest.raises(ExceptionGroup) as raised:
            task.result()
        assert raised.group_contains(RuntimeError, match="a bug in the hand-back of a held run")


async def test_reserve_ahead_zero_keeps_the_claim_at_the_due_time(
    redis: aioredis.Redis, pool: asyncpg.Pool, redis_url: str, database_url: str, clocked: Clocked
) -> None:
    _, registry, control = clocked
    assert load({"SCHEDULER_WORKER_RESERVE_AHEAD": "0"}).worker_reserve_ahead == timedelta(0)
    with pytest.raises(ConfigError, match="SCHEDULER_WORKER_RESERVE_AHEAD"):
        load({"SCHEDULER_WORKER_RESERVE_AHEAD": "30s"})  # not below the visibility timeout
    job = await control.create_job(JobSpec(name="off", handler="test.clock"))
    spy = SpyRepository(pool)
    env = {"SCHEDULER_WORKER_RESERVE_AHEAD": "0"}
    async with worker_running(redis_url, database_url, pool, registry, runs=spy, **env):
        runs = await delayed_runs(pool, redis, job.id, 3, ahead=1.0)
        rows = await eventually(lambda: all_with(pool, runs, "succeeded"), within=10)
    assert not spy.reserved
    assert spy.plain == {run.run_id for run in runs}
    assert all(row["started_at"] >= row["due_at"] for row in rows)


async def _true(value: bool) -> bool:
    return value
