"""Limits enforced on real stores with a real (in-process) worker and leader loops: concurrency caps
per key with other keys running meanwhile, a rate, back-pressure from a webhook's 429, and caps
that hold through a FLUSHALL (the leader re-puts definitions and counts running units again)."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from datetime import timedelta
from typing import Any, ClassVar

import asyncpg
import pytest
import redis.asyncio as aioredis
from aiohttp import web

from scheduler_grpc.control import Control
from scheduler_grpc.db.leadership import LeadershipRepository
from scheduler_grpc.db.runs import RunRepository
from scheduler_grpc.executions import ExecutionStatus
from scheduler_grpc.handlers import ExecutionContext, Handler, HandlerRegistry, JSONValue, RateLimited
from scheduler_grpc.handlers.webhook import retry_after_of
from scheduler_grpc.jobs import Job, JobSpec
from scheduler_grpc.limits import LimitKind, LimitRef, LimitSpec
from scheduler_grpc.queue import Queue
from scheduler_grpc.scheduler import LeaderLoops, LoopSettings
from tests.engine_helpers import eventually
from tests.test_engine_policies import _term
from tests.test_worker_faults import registry_with, running_worker

VT = timedelta(seconds=30)


class Sleep(Handler):
    """Sleeps `seconds` (any other fields allowed: a limit key may come from them); raises
    RateLimited for `throttle_first` seconds on its first call per payload `customer_id`."""

    name: ClassVar[str] = "test.sleep_keyed"
    description: ClassVar[str] = "sleep, keyed"
    extra_fields: ClassVar[bool] = True

    def __init__(self) -> None:
        self.throttled: set[str] = set()

    async def run(self, ctx: ExecutionContext, payload: dict[str, Any]) -> JSONValue:
        wait = payload.get("throttle_first")
        if wait and payload["customer_id"] not in self.throttled:
            self.throttled.add(payload["customer_id"])
            raise RateLimited(timedelta(seconds=wait), "test throttle")
        await asyncio.sleep(float(payload.get("seconds", 0)))
        return {"ok": True}


@pytest.fixture
def registry() -> HandlerRegistry:
    return registry_with(Sleep())


@pytest.fixture
def keyed(redis: aioredis.Redis, pool: asyncpg.Pool, registry: HandlerRegistry) -> Control:
    return Control(redis, pool, registry)


async def attempts(pool: asyncpg.Pool, job_ids: Sequence[str]) -> list[asyncpg.Record]:
    return list(
        await pool.fetch(
            """SELECT run_id::text, job_id::text, attempt, status, started_at, finished_at, limit_keys
               FROM job_executions WHERE job_id = ANY($1::uuid[]) ORDER BY started_at""",
            list(job_ids),
        )
    )


async def all_succeeded(pool: asyncpg.Pool, job_ids: Sequence[str], runs: int) -> bool:
    rows = await pool.fetch(
        """SELECT DISTINCT ON (run_id) status FROM job_executions WHERE job_id = ANY($1::uuid[])
           ORDER BY run_id, attempt DESC""",
        list(job_ids),
    )
    return len(rows) == runs and all(row["status"] == "succeeded" for row in rows)


def overlaps(rows: Sequence[asyncpg.Record]) -> int:
    """Pairs of attempts that ran at once (started before the other finished). A start is its lease
    instant, read from the Redis clock in whole milliseconds: up to 1 ms before the PostgreSQL
    finish that preceded the lease, so only a start a millisecond or more before counts."""
    spans = sorted((row["started_at"], row["finished_at"]) for row in rows if row["started_at"] is not None)
    return sum(1 for (_, end), (start, _) in itertools.pairwise(spans) if start + timedelta(milliseconds=1) <= end)


async def test_runs_of_one_key_never_overlap_while_other_keys_run(
    keyed: Control, pool: asyncpg.Pool, redis_url: str, database_url: str, registry: HandlerRegistry
) -> None:
    await keyed.limits.create_limit(LimitSpec("per-customer", LimitKind.CONCURRENCY, 1))
    ref = (LimitRef("per-customer", "payload.customer_id"),)
    jobs = {
        key: await keyed.create_job(JobSpec(name=f"c-{key}", handler=Sleep.name, limits=ref,
                                            payload={"customer_id": key, "seconds": 0.3}))
        for key in ("a", "b")
    }  # fmt: skip
    for _ in range(3):
        for job in jobs.values():
            await keyed.trigger_job(job.id)
    ids = [job.id for job in jobs.values()]
    async with running_worker(redis_url, database_url, pool, registry, concurrency=8):
        await eventually(lambda: all_succeeded(pool, ids, 6), within=30)
    rows = await attempts(pool, ids)
    for key, job in jobs.items():
        of_key = [row for row in rows if row["job_id"] == job.id]
        assert overlaps(of_key) == 0, key
        assert all(row["limit_keys"] == [["per-customer", key, 1]] for row in of_key)
    assert overlaps(rows) > 0  # the other key ran meanwhile: the cap is per key


async def test_a_rate_limit_spaces_the_starts(
    keyed: Control, pool: asyncpg.Pool, redis_url: str, database_url: str, registry: HandlerRegistry
) -> None:
    await keyed.limits.create_limit(LimitSpec("api", LimitKind.RATE, 5, timedelta(seconds=1)))  # one per 200 ms
    job = await keyed.create_job(JobSpec(name="rated", handler=Sleep.name, payload={"customer_id": "x"},
                                         limits=(LimitRef("api", "billing-api"),)))  # fmt: skip
    for _ in range(6):
        await keyed.trigger_job(job.id)
    async with running_worker(redis_url, database_url, pool, registry, concurrency=8):
        await eventually(lambda: all_succeeded(pool, [job.id], 6), within=30)
    starts = [row["started_at"] for row in await attempts(pool, [job.id])]
    # Six starts at 5/s with no burst: each admitted at least 200 ms after the one before, and the
    # recorded starts are those admissions (the leases), whatever the claims' jitter.
    gaps = [later - earlier for earlier, later in itertools.pairwise(starts)]
    assert min(gaps) >= timedelta(milliseconds=200), gaps


async def test_a_run_starts_at_the_instant_its_rate_admitted_it_not_at_its_claim(
    keyed: Control, pool: asyncpg.Pool, redis: aioredis.Redis
) -> None:
    """Two admissions 200 ms apart claimed together, late: each start is its own lease instant (the
    instant the rate admitted it), not the one claim's time."""
    await keyed.limits.create_limit(LimitSpec("api", LimitKind.RATE, 5, timedelta(seconds=1)))  # one per 200 ms
    job = await keyed.create_job(JobSpec(name="rated", handler=Sleep.name, payload={"customer_id": "x"},
                                         limits=(LimitRef("api", "billing-api"),)))  # fmt: skip
    for _ in range(2):
        await keyed.trigger_job(job.id)
    queue = Queue(redis)
    seconds, micros = await redis.time()
    before = seconds * 1000 + micros // 1000
    [first] = await queue.dequeue("w", VT, 2)  # the rate admits one now ...
    [second] = await queue.dequeue_blocking("w", VT, 2, timedelta(seconds=5))  # ... and the next 200 ms on
    assert first.leased_at is not None
    assert second.leased_at is not None
    assert before <= first.leased_at.timestamp() * 1000
    assert second.leased_at - first.leased_at >= timedelta(milliseconds=200)
    leases = [first, second]
    claims = await RunRepository(pool).claim(
        [(lease.id, lease.token) for lease in leases], "w", leased_at=[lease.leased_at for lease in leases]
    )
    claimed_at = await pool.fetchval("SELECT clock_timestamp()")
    assert {claim.run_id: claim.started_at for claim in claims} == {lease.id: lease.leased_at for lease in leases}
    rows = await attempts(pool, [job.id])
    assert [row["started_at"] for row in rows] == [first.leased_at, second.leased_at]
    assert all(row["started_at"] < claimed_at for row in rows)


async def test_a_rate_limited_run_pauses_its_key_spends_no_attempt_and_other_keys_run(
    keyed: Control, pool: asyncpg.Pool, redis_url: str, database_url: str, registry: HandlerRegistry
) -> None:
    await keyed.limits.create_limit(LimitSpec("per-customer", LimitKind.CONCURRENCY, 5))
    ref = (LimitRef("per-customer", "payload.customer_id"),)
    slow = await keyed.create_job(
        JobSpec(name="throttled", handler=Sleep.name, limits=ref, payload={"customer_id": "t", "throttle_first": 2})
    )
    also = await keyed.create_job(
        JobSpec(name="same-key", handler=Sleep.name, limits=ref, payload={"customer_id": "t"})
    )
    other = await keyed.create_job(JobSpec(name="other", handler=Sleep.name, limits=ref,
                                           payload={"customer_id": "o", "seconds": 0.1}))  # fmt: skip
    async with running_worker(redis_url, database_url, pool, registry, concurrency=4) as (worker, _):
        [run] = await keyed.trigger_job(slow.id)
        await eventually(lambda: _true(worker.stats.throttled == 1))
        throttled_at = time.monotonic()
        # Its key is paused: a run of the same key waits; runs of another key go on.
        [same] = await keyed.trigger_job(also.id)
        others = [(await keyed.trigger_job(other.id))[0] for _ in range(3)]
        await eventually(lambda: all_succeeded(pool, [other.id], 3), within=10)
        assert time.monotonic() - throttled_at < 1.8
        rows = await attempts(pool, [slow.id, also.id])
        assert {row["status"] for row in rows} == {"queued"}  # neither has run since
        await eventually(lambda: all_succeeded(pool, [slow.id, also.id], 2), within=15)
        assert time.monotonic() - throttled_at >= 1.9
    attempts_of_run = await pool.fetch("SELECT attempt, status FROM job_executions WHERE run_id = $1", run.run_id)
    assert [(row["attempt"], row["status"]) for row in attempts_of_run] == [(1, "succeeded")]  # no attempt spent
    assert others
    assert same


WEBHOOK_ENV = {"SCHEDULER_WEBHOOK_ALLOWLIST": "127.0.0.1/32"}  # the local test server


async def _webhook_jobs(control: Control, url: str) -> tuple[Job, Job]:
    """A limit of 2 per customer and two webhook jobs on it, to `url`/a (key cust-a) and /b (cust-b)."""
    await control.limits.create_limit(LimitSpec("per-customer", LimitKind.CONCURRENCY, 2))
    a = await control.create_job(JobSpec(name="hook-a", handler="http.webhook", payload={"url": f"{url}/a"},
                                         limits=(LimitRef("per-customer", "cust-a"),)))  # fmt: skip
    b = await control.create_job(JobSpec(name="hook-b", handler="http.webhook", payload={"url": f"{url}/b"},
                                         limits=(LimitRef("per-customer", "cust-b"),)))  # fmt: skip
    return a, b


async def test_a_webhook_429_with_retry_after_pauses_its_key_and_spends_no_attempt(
    control: Control, pool: asyncpg.Pool, redis_url: str, database_url: str
) -> None:
    from scheduler_grpc.handlers import HandlerSettings, default_registry

    seen: list[tuple[str, float]] = []

    async def hook(request: web.Request) -> web.Response:
        seen.append((request.path, time.monotonic()))
        if request.path == "/a" and sum(1 for path, _ in seen if path == "/a") == 1:
            return web.Response(status=429, headers={"Retry-After": "2"})
        return web.Response(text="ok")

    async with _server(hook) as url:
        a, b = await _webhook_jobs(control, url)
        registry = default_registry(HandlerSettings(dev_mode=True))
        async with running_worker(redis_url, database_url, pool, registry, **WEBHOOK_ENV) as (worker, _):
            [run] = await control.trigger_job(a.id)
            await eventually(lambda: _true(worker.stats.throttled == 1))
            [second] = await control.trigger_job(a.id)
            for _ in range(3):
                await control.trigger_job(b.id)
            await eventually(lambda: all_succeeded(pool, [a.id, b.id], 5), within=20)
        await registry.aclose()
    first_429 = next(at for path, at in seen if path == "/a")
    later_a = [at for path, at in seen if path == "/a"][1:]
    b_calls = [at for path, at in seen if path == "/b"]
    assert len(later_a) == 2
    assert all(at - first_429 >= 1.9 for at in later_a)  # the key was paused for the Retry-After
    assert any(at - first_429 < 1.9 for at in b_calls)  # the other key ran meanwhile
    rows = await pool.fetch("SELECT attempt FROM job_executions WHERE run_id = ANY($1::uuid[])",
                            [run.run_id, second.run_id])  # fmt: skip
    assert sorted(row["attempt"] for row in rows) == [1, 1]


async def test_a_webhook_429_retry_after_30_pauses_its_key_30_s_at_once_and_others_run(
    control: Control, pool: asyncpg.Pool, redis_url: str, database_url: str
) -> None:
    """The issue's own figure, without waiting it out: the key's pause (read through the
    application layer, as GetLimitKey does) ends 30 s after the 429, set by the hand-back itself
    (within one admission), the attempt count stays 1, and another key's runs go on meanwhile."""
    from datetime import UTC, datetime

    from scheduler_grpc.handlers import HandlerSettings, default_registry

    calls: list[str] = []

    async def hook(request: web.Request) -> web.Response:
        calls.append(request.path)
        if request.path == "/a":
            return web.Response(status=429, headers={"Retry-After": "30"})
        return web.Response(text="ok")

    async with _server(hook) as url:
        a, b = await _webhook_jobs(control, url)
        registry = default_registry(HandlerSettings(dev_mode=True))
        async with running_worker(redis_url, database_url, pool, registry, **WEBHOOK_ENV) as (worker, _):
            [run] = await control.trigger_job(a.id)
            await eventually(lambda: _true(worker.stats.throttled == 1))
            answered = datetime.now(UTC)
            state = await control.limit_keys.key_state("per-customer", "cust-a")
            for _ in range(3):
                await control.trigger_job(b.id)
            await eventually(lambda: all_succeeded(pool, [b.id], 3), within=20)
            after = await control.limit_keys.key_state("per-customer", "cust-a")
        await registry.aclose()
    [paused_until] = {entry.state.paused_until for entry in state.queues}
    assert paused_until is not None
    assert 28.0 <= (paused_until - answered).total_seconds() <= 30.5  # 30 s from the 429 (less its own latency)
    assert (calls.count("/a"), calls.count("/b")) == (1, 3)  # paused: no second call; the other key ran
    assert (after.queued, after.running) == (1, 0)  # the run waits for the pause, unspent
    rows = await pool.fetch("SELECT attempt, status FROM job_executions WHERE run_id = $1", run.run_id)
    assert [(row["attempt"], row["status"]) for row in rows] == [(1, "queued")]


def test_retry_after_reads_seconds_and_dates_bounded() -> None:
    from datetime import UTC, datetime

    now = datetime(2026, 1, 1, tzinfo=UTC)
    assert retry_after_of("2") == timedelta(seconds=2)
    assert retry_after_of("99999999") == timedelta(hours=1)
    assert retry_after_of("Thu, 01 Jan 2026 00:00:30 GMT", now) == timedelta(seconds=30)
    assert retry_after_of("Wed, 31 Dec 2025 00:00:00 GMT", now) == timedelta(0)
    assert retry_after_of("soon") is None
    assert retry_after_of(None) is None
    assert RateLimited(timedelta(days=2)).retry_after == timedelta(hours=1)


async def test_caps_hold_through_a_flushall_the_leader_counts_running_units_again(
    control: Control, pool: asyncpg.Pool, redis: aioredis.Redis
) -> None:
    await control.limits.create_limit(LimitSpec("per-customer", LimitKind.CONCURRENCY, 1))
    job = await control.create_job(JobSpec(name="capped", handler="test.echo", payload={"customer_id": "k"},
                                           limits=(LimitRef("per-customer", "payload.customer_id"),)))  # fmt: skip
    first = (await control.trigger_job(job.id))[0]
    second = (await control.trigger_job(job.id))[0]
    queue = Queue(redis)
    [lease] = await queue.dequeue("w", VT, 5)
    assert lease.id == first.run_id
    runs = RunRepository(pool)
    [claim] = await runs.claim([(lease.id, lease.token)], "w")
    assert claim.limits == first.limits
    record = await LeadershipRepository(pool).begin_term("scheduler", "test")
    assert record is not None
    loops = LeaderLoops(redis, pool, LoopSettings(reconcile_grace=timedelta(0)))
    await loops._reconcile(_term(record))
    await loops._recover(_term(record))  # nothing lost: nothing to do
    assert (await queue.key_state("per-customer", "k")).running == 1
    await redis.flushall()
    # The leader's recover loop (every 500 ms) sees the loss and rebuilds at once: the definition
    # is back, the running run's unit counted again, the queued run re-enqueued but held back by
    # the cap.
    await loops._recover(_term(record))
    assert (await queue.key_state("per-customer", "k")).running == 1
    assert await queue.dequeue("w", VT, 5) == []
    assert (await queue.blocked_by([second.run_id]))[second.run_id].kind == "concurrency"
    await loops._reconcile(_term(record))  # again: idempotent, nothing counted twice
    assert (await queue.key_state("per-customer", "k")).running == 1
    # The run ends (its worker's ack finds no lease); the next reconcile gives its unit back.
    from scheduler_grpc.db.executions import Outcome

    await runs.complete([Outcome(claim.execution_id, lease.token, ExecutionStatus.SUCCEEDED)])
    await loops._reconcile(_term(record))
    assert (await queue.key_state("per-customer", "k")).running == 0
    assert [lease.id for lease in await queue.dequeue("w", VT, 5)] == [second.run_id]


async def test_every_run_completes_through_a_flushall_mid_run_with_the_cap_kept(
    keyed: Control, pool: asyncpg.Pool, redis: aioredis.Redis, *, redis_url: str, database_url: str,
    registry: HandlerRegistry,
) -> None:  # fmt: skip
    await keyed.limits.create_limit(LimitSpec("per-customer", LimitKind.CONCURRENCY, 1))
    ref = (LimitRef("per-customer", "payload.customer_id"),)
    job = await keyed.create_job(JobSpec(name="mid", handler=Sleep.name, limits=ref,
                                         payload={"customer_id": "m", "seconds": 0.8}))  # fmt: skip
    for _ in range(4):
        await keyed.trigger_job(job.id)
    record = await LeadershipRepository(pool).begin_term("scheduler", "test")
    assert record is not None
    loops = LeaderLoops(redis, pool, LoopSettings(reconcile_grace=timedelta(0)))

    async def reconciled_and_done() -> bool:
        await loops._reconcile(_term(record))
        return await all_succeeded(pool, [job.id], 4)

    async with running_worker(redis_url, database_url, pool, registry, concurrency=4):

        async def running() -> bool:
            return bool(await pool.fetchval("SELECT count(*) FROM job_executions WHERE status = 'running'"))

        await eventually(running, within=10)
        await redis.flushall()
        await eventually(reconciled_and_done, within=40, interval=0.3)
    assert overlaps(await attempts(pool, [job.id])) == 0


async def _true(value: bool) -> bool:
    return value


@asynccontextmanager
async def _server(handler: Any) -> AsyncIterator[str]:
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


async def test_an_open_webhook_breaker_pauses_the_limit_keyed_on_its_host(
    control: Control, pool: asyncpg.Pool, redis: aioredis.Redis, redis_url: str, database_url: str
) -> None:
    from scheduler_grpc.handlers import HandlerSettings, default_registry

    await control.limits.create_limit(LimitSpec("per-host", LimitKind.CONCURRENCY, 10))
    await control.limits.create_limit(LimitSpec("per-customer", LimitKind.CONCURRENCY, 10))
    job = await control.create_job(JobSpec(
        name="hook", handler="http.webhook", payload={"url": "http://127.0.0.1:9/down"},
        limits=(LimitRef("per-host", "127.0.0.1"), LimitRef("per-customer", "c1"))))  # fmt: skip
    registry = default_registry(HandlerSettings(dev_mode=True))
    async with running_worker(redis_url, database_url, pool, registry) as (worker, _):
        breaker = worker.breakers.get(registry.get("http.webhook").breaker_key(job.payload))
        for _ in range(worker.breakers.policy.min_calls):
            await breaker.call(_open, lambda result: result)
        assert worker.breakers.blocked_for(breaker.key) > timedelta(0)
        await control.trigger_job(job.id)
        await eventually(lambda: _true(worker.stats.breaker_deferred >= 1))
    queue = Queue(redis)
    assert (await queue.key_state("per-host", "127.0.0.1")).paused_until is not None
    assert (await queue.key_state("per-customer", "c1")).paused_until is None  # not keyed on the host
    await registry.aclose()


async def _open() -> bool:
    return True
