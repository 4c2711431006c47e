"""The worker under store faults, in-process against the real servers (issue 8).

Each test injects a real fault (Valkey refusing writes, a TCP proxy resetting PostgreSQL, a
pub/sub connection killed) into an in-process `Worker` and checks that the run still ends exactly
as it should: once, with its outcome recorded.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import ipaddress
from collections.abc import AsyncIterator, Awaitable, Sequence
from contextlib import asynccontextmanager
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any, ClassVar

import asyncpg
import pytest
import redis.asyncio as aioredis

from chaos.proxy import FaultProxy
from scheduler_grpc import events, metrics
from scheduler_grpc.breakers import BreakerOpen, BreakerPolicy, Breakers, BreakerState
from scheduler_grpc.connections import redis_client
from scheduler_grpc.control import Control
from scheduler_grpc.db.executions import Advance, Claim, Outcome, PlannedSlot
from scheduler_grpc.db.firing import FiringRepository
from scheduler_grpc.db.history import HistoryRepository
from scheduler_grpc.db.pool import create_pool
from scheduler_grpc.db.recovery import RecoveryRepository
from scheduler_grpc.db.runs import RunRepository
from scheduler_grpc.dispatch import Queues, enqueue_runs
from scheduler_grpc.events import EventType
from scheduler_grpc.executions import ExecutionStatus, Trigger
from scheduler_grpc.handlers import (
    ExecutionContext,
    Handler,
    HandlerError,
    HandlerRegistry,
    HandlerSettings,
    JSONValue,
    default_registry,
)
from scheduler_grpc.jobs import JobSpec, RetryPolicy, ScheduleKind
from scheduler_grpc.queue import Queue
from scheduler_grpc.stores import is_fault as is_store_error
from scheduler_grpc.worker import Worker
from tests.engine_helpers import eventually, make_settings

_SETTINGS = HandlerSettings(
    shell_enabled=False, dev_mode=True, webhook_allowlist=(ipaddress.ip_network("127.0.0.1/32"),)
)


class GateHandler(Handler):
    """Blocks until the test opens the gate; counts its calls; then fails (`fail`) or succeeds."""

    name: ClassVar[str] = "test.gate"
    description: ClassVar[str] = "wait for the test"
    extra_fields: ClassVar[bool] = True

    def __init__(self) -> None:
        self.calls = 0
        self.started = asyncio.Event()
        self.gate = asyncio.Event()

    async def run(self, ctx: ExecutionContext, payload: dict[str, Any]) -> JSONValue:
        self.calls += 1
        self.started.set()
        if self.calls == 1 or not payload.get("only_first_waits"):
            await self.gate.wait()
        if payload.get("fail"):
            raise HandlerError(f"failing attempt {ctx.attempt}")
        return {"calls": self.calls}


def registry_with(*handlers: Handler) -> HandlerRegistry:
    registry = default_registry(_SETTINGS)
    for handler in handlers:
        registry.register(handler)
    return registry


Gated = tuple["GateHandler", HandlerRegistry, Control]


@pytest.fixture
def gated(redis: aioredis.Redis, pool: asyncpg.Pool) -> Gated:
    """A gate handler, a registry with it, and a Control over the test stores."""
    gate = GateHandler()
    registry = registry_with(gate)
    return gate, registry, Control(redis, pool, registry)


@asynccontextmanager
async def running_worker(
    redis_url: str,
    database_url: str,
    pool: asyncpg.Pool,
    registry: HandlerRegistry,
    *,
    runs: RunRepository | None = None,
    concurrency: int = 4,
    **env: str,
) -> AsyncIterator[tuple[Worker, asyncio.Task[None]]]:
    """An in-process worker on a production-like Redis client (auto-retry and all), its run store
    `runs` (default: a `RunRepository` over `pool`)."""
    settings = make_settings(
        redis_url, database_url, SCHEDULER_VISIBILITY_TIMEOUT="1s", SCHEDULER_SHUTDOWN_GRACE="1s", **env
    )
    client = redis_client(redis_url)
    worker = Worker(
        client, runs or RunRepository(pool), registry, settings,
        history=HistoryRepository(pool), worker_id="in-process", concurrency=concurrency,
    )  # fmt: skip
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    try:
        yield worker, task
    finally:
        stop.set()
        with contextlib.suppress(Exception):
            async with asyncio.timeout(15):
                await task
        if not task.done():
            task.cancel()
        await client.aclose()


async def statuses(pool: asyncpg.Pool, run_id: str) -> list[str]:
    rows = await pool.fetch("SELECT status FROM job_executions WHERE run_id = $1 ORDER BY attempt", run_id)
    return [row["status"] for row in rows]


def store_errors(store: str) -> float:
    return metrics.REGISTRY.get_sample_value("scheduler_store_errors_total", {"store": store}) or 0.0


async def test_a_redis_response_error_does_not_kill_the_worker(
    redis: aioredis.Redis, pool: asyncpg.Pool, redis_url: str, database_url: str, gated: Gated
) -> None:
    gate, registry, control = gated
    job = await control.create_job(JobSpec(name="oom", handler="test.gate"))
    async with running_worker(redis_url, database_url, pool, registry) as (worker, task):
        run = (await control.trigger_job(job.id))[0]
        await eventually(lambda: _true(gate.started.is_set()))
        before = store_errors("redis")
        await redis.config_set("maxmemory", 1)  # every write is refused: OOM (a ResponseError)
        try:
            # Lease extensions (every 1/3 s) and heartbeats now fail with a ResponseError.
            await eventually(lambda: _true(task.done() or store_errors("redis") >= before + 3))
        finally:
            await redis.config_set("maxmemory", 0)
        assert not task.done(), "the worker died of a Redis error"
        gate.gate.set()

        async def done() -> list[str]:
            return [s for s in await statuses(pool, run.run_id) if s == "succeeded"]

        await eventually(done)
        await eventually(lambda: _true(worker.stats.completed == 1))
        assert gate.calls == 1
        assert not task.done()


async def _true(value: bool) -> bool:
    return value


class _CancelsRightAfterTheClaim(RunRepository):
    """Cancels each run the moment its claim commits, before the worker has registered its task:
    the pub/sub message arrives while the worker cannot match it to a running task."""

    def __init__(self, pool: asyncpg.Pool, control: Control) -> None:
        super().__init__(pool)
        self._control = control

    async def claim(
        self,
        items: Sequence[tuple[str, str]],
        worker_id: str,
        *,
        leased_at: Sequence[datetime | None] = (),
        slots: Sequence[datetime | None] = (),
    ) -> list[Claim]:
        claims = await super().claim(items, worker_id, leased_at=leased_at, slots=slots)
        for claim in claims:
            assert (await self._control.cancel_execution(claim.execution_id)).status == "running"
        return claims


async def test_a_cancel_the_pubsub_path_misses_is_still_honoured(
    redis: aioredis.Redis, pool: asyncpg.Pool, redis_url: str, database_url: str, gated: Gated
) -> None:
    _, registry, control = gated
    job = await control.create_job(JobSpec(name="cancel-me", handler="test.gate"))
    executions = _CancelsRightAfterTheClaim(pool, control)
    async with running_worker(redis_url, database_url, pool, registry, runs=executions) as (_, task):
        run = (await control.trigger_job(job.id))[0]

        async def cancelled() -> bool:
            return (await statuses(pool, run.run_id))[-1] == "cancelled"

        await eventually(cancelled, within=5)
        assert await statuses(pool, run.run_id) == ["cancelled"]
        assert not task.done()


async def test_a_claim_does_not_restart_a_run_whose_cancel_was_requested(pool: asyncpg.Pool, control: Control) -> None:
    job = await control.create_job(JobSpec(name="lost-and-cancelled", handler="test.echo"))
    run = (await control.trigger_job(job.id))[0]
    executions = RunRepository(pool)
    assert await executions.claim([(run.run_id, "token-a")], "worker-a")
    cancelled, running = await RecoveryRepository(pool).cancel_runs([run.run_id])
    assert not cancelled
    assert [e.run_id for e in running] == [run.run_id]
    # worker-a is lost; its item is recovered and claimed elsewhere: the run must not start again.
    assert await executions.claim([(run.run_id, "token-b")], "worker-b") == []
    assert await statuses(pool, run.run_id) == ["cancelled"]


async def test_an_open_webhook_host_breaker_defers_its_work_before_the_claim(
    redis: aioredis.Redis, pool: asyncpg.Pool, redis_url: str, database_url: str, control: Control
) -> None:
    job = await control.create_job(
        JobSpec(name="hook", handler="http.webhook", payload={"url": "http://127.0.0.1:9/down"})
    )
    registry = default_registry(_SETTINGS)
    async with running_worker(redis_url, database_url, pool, registry) as (worker, _):
        breaker = worker.breakers.get(registry.get("http.webhook").breaker_key(job.payload))
        for _ in range(worker.breakers.policy.min_calls):
            await breaker.call(_returns_true, lambda result: result)
        assert worker.breakers.blocked_for(breaker.key) > timedelta(0)
        run = (await control.trigger_job(job.id))[0]

        async def deferred() -> bool:
            return worker.stats.breaker_deferred >= 1

        await eventually(deferred)
        kinds = [event.type for event in await events.read_after(redis) if event.run_id == run.run_id]
        assert EventType.STARTED not in kinds
        assert await statuses(pool, run.run_id) == ["queued"]  # never claimed: no attempt spent or recorded


async def _returns_true() -> bool:
    return True


async def test_a_postgres_outage_during_completion_records_the_outcome_without_running_again(
    redis: aioredis.Redis, pool: asyncpg.Pool, redis_url: str, database_url: str, gated: Gated
) -> None:
    gate, registry, control = gated
    job = await control.create_job(JobSpec(name="pg-blip", handler="test.gate"))
    proxy, proxied_url = await FaultProxy.to_url(database_url)
    worker_pool = await create_pool(proxied_url, size=4, connect_timeout=timedelta(seconds=2))
    queue = Queue(redis)
    try:
        async with running_worker(redis_url, database_url, worker_pool, registry) as (_, task):
            run = (await control.trigger_job(job.id))[0]
            await eventually(lambda: _true(gate.started.is_set()))
            first_deadline = await redis.zscore(queue.keys.processing, run.run_id)
            assert first_deadline is not None
            proxy.reset(refuse=True)
            before = store_errors("postgres")
            gate.gate.set()  # the handler finishes while PostgreSQL is unreachable

            async def kept_or_lost() -> bool:
                # What the leader would do meanwhile: requeue expired leases.
                recovered = (await queue.recover_expired()).requeued
                deadline = await redis.zscore(queue.keys.processing, run.run_id)
                kept = deadline is not None and deadline > first_deadline + 2000  # extended twice since
                return bool(recovered) or (kept and store_errors("postgres") > before)

            await eventually(kept_or_lost)
            proxy.heal()

            async def succeeded() -> bool:
                await queue.recover_expired()
                return "succeeded" in await statuses(pool, run.run_id)

            await eventually(succeeded)

            async def acked() -> bool:  # the worker acks after the record is committed, not with it
                return (await queue.states([run.run_id]))[run.run_id] is None

            await eventually(acked)
            assert gate.calls == 1
            assert await statuses(pool, run.run_id) == ["succeeded"]
            assert not task.done()
    finally:
        await worker_pool.close()
        await proxy.close()


async def test_a_graceful_hand_back_records_the_interrupted_attempt_without_spending_the_budget(
    redis: aioredis.Redis, pool: asyncpg.Pool, redis_url: str, database_url: str, gated: Gated
) -> None:
    gate, registry, control = gated
    retry = RetryPolicy(max_retries=1, initial_backoff=timedelta(milliseconds=50), jitter=False)
    job = await control.create_job(
        JobSpec(name="interrupted", handler="test.gate", payload={"fail": True, "only_first_waits": True}, retry=retry)
    )
    async with running_worker(redis_url, database_url, pool, registry):
        run = (await control.trigger_job(job.id))[0]
        await eventually(lambda: _true(gate.started.is_set()))
    # The worker stopped: its grace passed and the attempt was handed back.
    history = await HistoryRepository(pool).history(job.id)
    assert [e.status for e in history] == ["interrupted", "queued"]
    assert history[0].worker_id == "in-process"
    assert history[0].started_at is not None
    assert history[0].finished_at is not None
    kinds = [event.type for event in await events.read_after(redis) if event.run_id == run.run_id]
    assert kinds == [EventType.CREATED, EventType.STARTED, EventType.INTERRUPTED]  # the STARTED is closed
    queue = Queue(redis)
    async with running_worker(redis_url, database_url, pool, registry):

        async def dead() -> list[str]:
            await queue.promote_due()
            found = await statuses(pool, run.run_id)
            return found if found[-1] == "dead" else []

        # One retry after the first real failure: the interruption spent none of the budget.
        assert await eventually(dead) == ["interrupted", "failed", "dead"]


async def test_a_run_executes_the_definition_of_its_slot_not_a_later_edit(
    redis: aioredis.Redis, pool: asyncpg.Pool, redis_url: str, database_url: str, control: Control
) -> None:
    spec = JobSpec(name="edited", handler="test.echo", payload={"version": 1}, timeout=timedelta(seconds=30))
    job = await control.create_job(spec)
    run = (await control.trigger_job(job.id))[0]
    await control.update_job(job.id, JobSpec(name="edited", handler="test.log", payload={"message": "v2"}))
    executions = HistoryRepository(pool)
    async with running_worker(redis_url, database_url, pool, default_registry(_SETTINGS)):

        async def finished() -> Any:
            execution = await executions.get(run.run_id)
            return execution if execution.status == "succeeded" else None

        execution = await eventually(finished)
    assert execution.result == {"echo": {"version": 1}}


async def _fails() -> bool:
    return True


async def test_breakers_are_bounded_least_recently_used_first() -> None:
    breakers = Breakers(max_breakers=3)
    for host in ("a", "b", "c"):
        breakers.get(f"http.webhook:{host}")
    breakers.get("http.webhook:a")  # used again: b is now the least recently used
    breakers.get("http.webhook:d")
    assert set(breakers.states()) == {"http.webhook:a", "http.webhook:c", "http.webhook:d"}
    for n in range(5000):
        breakers.get(f"http.webhook:host-{n}")
    assert len(breakers.states()) == 3


async def test_breaker_metrics_are_labelled_by_handler_not_by_host(
    redis: aioredis.Redis, pool: asyncpg.Pool, redis_url: str, database_url: str
) -> None:
    registry = default_registry(_SETTINGS)
    settings = make_settings(redis_url, database_url)
    worker = Worker(
        redis, RunRepository(pool), registry, settings, history=HistoryRepository(pool), worker_id="metrics"
    )
    open_host = worker.breakers.get("http.webhook:open.example")
    worker.breakers.get("http.webhook:closed.example")
    for _ in range(worker.breakers.policy.min_calls):
        await open_host.call(_fails, lambda failed: failed)
    sample = metrics.REGISTRY.get_sample_value
    assert sample("scheduler_breaker_state", {"handler": "http.webhook"}) == metrics.BREAKER_VALUES["open"]
    assert sample("scheduler_breaker_transitions_total", {"handler": "http.webhook", "to": "open"})
    hosts = [s.labels for m in metrics.REGISTRY.collect() if m.name.startswith("scheduler_breaker") for s in m.samples]
    assert not [labels for labels in hosts if any("example" in value for value in labels.values())]


async def test_a_completion_sent_again_after_a_lost_reply_is_reported_not_lost(
    pool: asyncpg.Pool, control: Control
) -> None:
    job = await control.create_job(JobSpec(name="twice", handler="test.echo"))
    run = (await control.trigger_job(job.id))[0]
    executions = RunRepository(pool)
    [claim] = await executions.claim([(run.run_id, "token")], "worker")
    outcome = Outcome(claim.execution_id, "token", ExecutionStatus.FAILED, error="boom", retry_after=timedelta(0))
    [first] = await executions.complete([outcome])
    assert await executions.complete([outcome]) == [first]  # the retry of a write whose reply was lost
    assert await statuses(pool, run.run_id) == ["failed", "queued"]
    stale = Outcome(claim.execution_id, "other-token", ExecutionStatus.FAILED, error="boom")
    assert await executions.complete([stale]) == []


async def test_a_fired_slot_and_its_retries_keep_the_definition_of_the_slot(
    pool: asyncpg.Pool, control: Control
) -> None:
    slot = datetime.now(UTC).replace(microsecond=0) + timedelta(hours=1)
    old = JobSpec(
        name="snap", handler="test.echo", payload={"v": 1}, schedule_kind=ScheduleKind.ONCE, run_at=slot,
        timeout=timedelta(seconds=30), retry=RetryPolicy(max_retries=7, jitter=False),
    )  # fmt: skip
    job = await control.create_job(old)
    await pool.execute("INSERT INTO leader_state (scope, term, holder) VALUES ('scheduler', 1, 'test')")
    executions = RunRepository(pool)
    [fired] = await FiringRepository(pool).fire(
        1, [Advance(job.id, slot, None)], [PlannedSlot(job.id, slot, ExecutionStatus.QUEUED, slot)]
    )
    assert fired.payload == {"v": 1}
    new = replace(old, handler="test.log", payload={"message": "v2"}, timeout=timedelta(seconds=5),
                  retry=RetryPolicy(max_retries=0))  # fmt: skip
    await control.update_job(job.id, new)
    [claim] = await executions.claim([(fired.run_id, "t1")], "w")
    assert (claim.handler, claim.payload, claim.timeout, claim.retry.max_retries) == (
        "test.echo",
        {"v": 1},
        timedelta(seconds=30),
        7,
    )
    # The retry of the slot carries the same definition.
    outcome = Outcome(claim.execution_id, "t1", ExecutionStatus.FAILED, error="x", retry_after=timedelta(0))
    await executions.complete([outcome])
    [retry] = await executions.claim([(fired.run_id, "t2")], "w")
    assert (retry.attempt, retry.handler, retry.payload, retry.timeout) == (
        2,
        "test.echo",
        {"v": 1},
        timedelta(seconds=30),
    )


async def _raised(call: Awaitable[object]) -> BaseException:
    try:
        await call
    except Exception as exc:  # the error a real server answered
        return exc
    raise AssertionError("expected the call to fail")


async def test_store_errors_are_told_from_bugs_on_real_answers(redis: aioredis.Redis, pool: asyncpg.Pool) -> None:
    await redis.config_set("maxmemory", 1)
    try:
        oom = await _raised(redis.set("k", "v"))
    finally:
        await redis.config_set("maxmemory", 0)
    assert is_store_error(oom)
    assert not is_store_error(await _raised(redis.execute_command("NOSUCHCOMMAND")))
    assert not is_store_error(await _raised(redis.eval("return redis.call('INCR', KEYS[1], 'x')", 1, "k")))
    assert not is_store_error(await _raised(pool.execute("SELECT no_such_column FROM jobs")))
    assert not is_store_error(await _raised(pool.execute("SELECT 1 / 0")))
    async with pool.acquire() as conn:
        await conn.execute("SET default_transaction_read_only = on")  # what a demoted primary answers
        read_only = await _raised(conn.execute("CREATE TEMP TABLE t (x int)"))
        await conn.execute("RESET default_transaction_read_only")
    assert is_store_error(read_only)
    assert is_store_error(await _raised(asyncpg.connect("postgresql://127.0.0.1:1/none", timeout=2)))
    assert not is_store_error(RuntimeError("a bug"))


class _BuggyRepository(RunRepository):
    async def cancel_requested(
        self, execution_ids: Sequence[str], *, slots: Sequence[datetime | None] = ()
    ) -> list[str]:
        raise RuntimeError("a bug in the cancel poll")


async def test_a_bug_ends_the_worker(
    redis: aioredis.Redis, pool: asyncpg.Pool, redis_url: str, database_url: str, gated: Gated
) -> None:
    _, registry, control = gated
    job = await control.create_job(JobSpec(name="buggy", handler="test.gate"))
    async with running_worker(redis_url, database_url, pool, registry, runs=_BuggyRepository(pool)) as (_, task):
        await control.trigger_job(job.id)
        await eventually(lambda: _true(task.done()))
        with pytest.raises(ExceptionGroup) as raised:
            task.result()
        assert raised.group_contains(RuntimeError, match="a bug in the cancel poll")


class _BuggyLookup(HandlerRegistry):
    def get(self, name: str) -> Handler:
        if name == "test.echo":
            raise RuntimeError("a bug in the handler lookup")
        return super().get(name)


async def test_a_bug_in_a_runs_task_ends_the_worker(
    redis: aioredis.Redis, pool: asyncpg.Pool, redis_url: str, database_url: str
) -> None:
    # Issue 19, defect 5: the task that runs a claimed attempt was created outside the role's task
    # group and nothing read its exception: the bug vanished ("Task exception was never retrieved")
    # and the run stayed `running` on a worker that went on. A bug there ends the role.
    registry = _BuggyLookup(_SETTINGS, default_registry(_SETTINGS))
    control = Control(redis, pool, default_registry(_SETTINGS))
    job = await control.create_job(JobSpec(name="buggy-lookup", handler="test.echo"))
    async with running_worker(redis_url, database_url, pool, registry) as (_, task):
        await control.trigger_job(job.id)
        await eventually(lambda: _true(task.done()), within=5)
        with pytest.raises(ExceptionGroup) as raised:
            task.result()
        assert raised.group_contains(RuntimeError, match="a bug in the handler lookup")


async def test_a_claim_waiting_on_an_abandon_claims_the_attempt_it_added(control: Control, pool: asyncpg.Pool) -> None:
    # Worker A lost its lease and abandons attempt 1 (adding attempt 2; the leader does the same
    # for an expired lease) while worker B, which now holds the item, claims the run: B waits for
    # A's row lock and then sees attempt 1 abandoned.
    job = await control.create_job(JobSpec(name="contended", handler="test.echo"))
    [run] = await control.trigger_job(job.id)
    executions = RunRepository(pool)
    [first] = await executions.claim([(run.run_id, "token-a")], "worker-a")
    async with pool.acquire() as conn, conn.transaction():
        assert await RunRepository(conn).abandon([(first.execution_id, "token-a")]) == 1
        claim_b = asyncio.create_task(executions.claim([(run.run_id, "token-b")], "worker-b"))

        async def waiting_for_the_lock() -> bool:
            return bool(await pool.fetchval(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND datname = current_database()"
            ))  # fmt: skip

        await eventually(waiting_for_the_lock, within=10)
    # Once a unique violation on (job, slot, attempt 2), which ended worker B as a bug; then B claimed
    # nothing and acked the item away, and the run waited for the reconcile loop to enqueue attempt
    # 2 (chaos remote-kill9: 6 of 80 runs started ~9.5 s after the rest). B holds the item's
    # current lease: it claims attempt 2 as A queued it.
    [claimed] = await claim_b
    assert (claimed.run_id, claimed.attempt) == (run.run_id, 2)
    history = await pool.fetch(
        "SELECT attempt, status, worker_id, claim_token FROM job_executions WHERE run_id = $1 ORDER BY 1", run.run_id
    )
    assert [tuple(row) for row in history] == [
        (1, "abandoned", "worker-a", "token-a"),
        (2, "running", "worker-b", "token-b"),
    ]


async def test_concurrent_requeues_of_one_dead_run_add_one_attempt(control: Control, pool: asyncpg.Pool) -> None:
    job = await control.create_job(JobSpec(name="requeued", handler="test.echo"))
    [run] = await control.trigger_job(job.id)
    await pool.execute("UPDATE job_executions SET status = 'dead', finished_at = now() WHERE run_id = $1", run.run_id)
    async with pool.acquire() as conn, conn.transaction():
        assert len(await RecoveryRepository(conn).requeue_runs([run.run_id])) == 1
        second = asyncio.create_task(RecoveryRepository(pool).requeue_runs([run.run_id]))

        async def waiting_for_the_first() -> bool:
            return bool(await pool.fetchval(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND datname = current_database()"
            ))  # fmt: skip

        await eventually(waiting_for_the_first, within=10)
    # Before: a unique violation on attempt 2 (an INTERNAL error over the API).
    assert await second == []
    attempts = await pool.fetch("SELECT attempt, status FROM job_executions WHERE run_id = $1 ORDER BY 1", run.run_id)
    assert [tuple(row) for row in attempts] == [(1, "dead"), (2, "queued")]


class _HeldCompletions(RunRepository):
    """Outcomes are recorded only once the test lets them through (PostgreSQL slow to record)."""

    def __init__(self, pool: asyncpg.Pool) -> None:
        super().__init__(pool)
        self.release = asyncio.Event()

    async def complete(self, outcomes: Sequence[Outcome], *, resent: bool = True) -> list[Any]:
        await self.release.wait()
        return await super().complete(outcomes, resent=resent)


async def test_a_slot_is_freed_when_its_handler_returns_not_when_its_outcome_is_recorded(
    redis: aioredis.Redis, pool: asyncpg.Pool, redis_url: str, database_url: str
) -> None:
    registry = registry_with()
    control = Control(redis, pool, registry)
    job = await control.create_job(JobSpec(name="pipelined", handler="test.echo"))
    executions = _HeldCompletions(pool)
    async with running_worker(redis_url, database_url, pool, registry, runs=executions) as (worker, task):  # 4 slots
        for _ in range(6):
            await control.trigger_job(job.id)
        # Recording is held back, yet all six ran: the slots came free when the handlers returned.
        await eventually(lambda: _true(worker.stats.claimed == 6 and worker.active == 0))
        running = "SELECT count(*) FROM job_executions WHERE job_id = $1 AND status = 'running'"
        assert await pool.fetchval(running, job.id) == 6  # none recorded yet: their leases are kept
        executions.release.set()

        async def all_succeeded() -> bool:
            done = "SELECT count(*) FROM job_executions WHERE job_id = $1 AND status = 'succeeded'"
            return bool(await pool.fetchval(done, job.id) == 6)

        await eventually(all_succeeded)
        assert worker.stats.completed == 6
        assert not task.done()


async def _has(items: list[str], count: int) -> bool:
    return len(items) >= count


class MarkHandler(Handler):
    """Returns at once, noting which attempts' handlers have returned."""

    name: ClassVar[str] = "test.mark"
    description: ClassVar[str] = "note the return"
    extra_fields: ClassVar[bool] = True

    def __init__(self) -> None:
        self.returned: list[str] = []

    async def run(self, ctx: ExecutionContext, payload: dict[str, Any]) -> JSONValue:
        self.returned.append(ctx.execution_id)
        return None


async def test_a_cancel_while_the_outcome_waits_for_the_completion_stage_never_strands_the_run(
    redis: aioredis.Redis, pool: asyncpg.Pool, redis_url: str, database_url: str
) -> None:
    # Issue 19, defect 4. Recording is held back; one slot, so the completion buffer holds 4
    # outcomes: the first run's outcome is being recorded, the next four fill the buffer, and the
    # sixth run's handler returns with no room for its outcome. A cancel then reaches that run.
    # Before: its task was cancelled inside the hand-off, the outcome dropped, and the run stayed
    # `running` forever, its lease renewed until the worker restarted.
    mark = MarkHandler()
    registry = registry_with(mark)
    control = Control(redis, pool, registry)
    job = await control.create_job(JobSpec(name="hand-off", handler="test.mark"))
    held = _HeldCompletions(pool)
    async with running_worker(redis_url, database_url, pool, registry, runs=held, concurrency=1) as (worker, task):
        runs = []
        for _ in range(6):  # one at a time: the last one is the one whose outcome finds no room
            runs.append((await control.trigger_job(job.id))[0])
            await eventually(functools.partial(_has, mark.returned, len(runs)))
        last = runs[-1]
        execution = await control.cancel_execution(last.run_id)
        assert execution.status == "running"
        # The cancel reached the worker (pub/sub at once, else the 1 s poll) while the outcome waited.
        await eventually(lambda: _true(worker.active == 0), within=5)
        held.release.set()

        async def none_running() -> list[str]:
            found = [(await statuses(pool, run.run_id))[-1] for run in runs]
            return found if "running" not in found else []

        found = await eventually(none_running, within=10)
        assert found[:5] == ["succeeded"] * 5
        assert found[5] in {"succeeded", "cancelled"}  # its handler had returned: either is honest
        await eventually(lambda: _true(worker.idle), within=5)
        assert not task.done()


async def _started_and_finished(pool: asyncpg.Pool, run_ids: Sequence[str]) -> list[asyncpg.Record]:
    rows = await pool.fetch(
        "SELECT run_id::text, status, started_at, finished_at FROM job_executions WHERE run_id = ANY($1::uuid[])",
        list(run_ids),
    )
    return rows if len(rows) == len(run_ids) and all(row["status"] == "succeeded" for row in rows) else []


async def test_a_solo_delivery_runs_alone_after_the_worker_drains(
    redis: aioredis.Redis, pool: asyncpg.Pool, redis_url: str, database_url: str, gated: Gated
) -> None:
    # Issue 19, defect 12 (the worker's side): told that a solo item waits, a busy worker leases
    # nothing more until it holds no run, then takes the solo delivery alone and runs nothing
    # beside it until it is recorded.
    gate, registry, control = gated
    busy_job = await control.create_job(JobSpec(name="busy", handler="test.gate"))
    echo = await control.create_job(JobSpec(name="echo", handler="test.echo"))
    queue = Queue(redis)
    async with running_worker(redis_url, database_url, pool, registry, concurrency=2) as (_, task):
        [busy] = await control.trigger_job(busy_job.id)
        await eventually(lambda: _true(gate.started.is_set()))  # one slot busy, one free
        # A run whose next delivery is solo (as after max_stalls - 1 stalls), enqueued as the API does.
        [solo] = await FiringRepository(pool).trigger(echo.id, Trigger.MANUAL, [datetime.now(UTC)])
        await redis.sadd(queue.keys.solo, solo.run_id)
        await enqueue_runs(Queues(redis), [solo])

        async def draining() -> bool:
            return await redis.get(queue.keys.drainer) == b"in-process"

        await eventually(draining, within=5)
        others = [(await control.trigger_job(echo.id))[0].run_id for _ in range(3)]
        gate.gate.set()
        rows = await eventually(lambda: _started_and_finished(pool, [busy.run_id, solo.run_id, *others]), within=10)
        assert not task.done()
    by_run = {row["run_id"]: row for row in rows}
    # A start is its lease instant, read from the Redis clock in whole milliseconds: it may read up
    # to 1 ms before the PostgreSQL finish that preceded the lease.
    began = {run_id: row["started_at"] + timedelta(milliseconds=1) for run_id, row in by_run.items()}
    assert began[solo.run_id] > by_run[busy.run_id]["finished_at"], "it did not wait to be alone"
    for run_id in others:
        # Not leased beside the busy run while draining, nor beside the solo run.
        assert began[run_id] > by_run[solo.run_id]["finished_at"], "something ran beside it"


async def test_runs_claimed_together_time_out_each_by_its_own_job_timeout(
    redis_url: str, database_url: str, pool: asyncpg.Pool, control: Control
) -> None:
    # Claimed in one batch (triggered before the worker starts): the claims sharing a timeout share
    # one deadline timer. The stuck run times out; the quick one of the same deadline and the slower
    # one of a longer timeout are not cut by it.
    retry = RetryPolicy(max_retries=1, initial_backoff=timedelta(seconds=30))
    jobs = {
        name: await control.create_job(
            JobSpec(
                name=name,
                handler="test.delay",
                payload={"seconds": seconds},
                timeout=timedelta(seconds=timeout),
                retry=retry,
            )
        )
        for name, seconds, timeout in (("stuck", 30, 1), ("quick", 0.1, 1), ("longer", 1.5, 5))
    }
    runs = {name: (await control.trigger_job(job.id))[0] for name, job in jobs.items()}
    async with running_worker(redis_url, database_url, pool, default_registry(_SETTINGS)):

        async def first_attempts() -> dict[str, str]:
            found = {name: (await statuses(pool, run.run_id))[0] for name, run in runs.items()}
            return found if not {"queued", "running"} & set(found.values()) else {}

        assert await eventually(first_attempts, within=15) == {
            "stuck": "timed_out", "quick": "succeeded", "longer": "succeeded"
        }  # fmt: skip
    row = await pool.fetchrow(
        "SELECT error, started_at, finished_at FROM job_executions WHERE run_id = $1 AND attempt = 1",
        runs["stuck"].run_id,
    )
    assert row["error"] == "timed out after 1s"
    assert 0.9 < (row["finished_at"] - row["started_at"]).total_seconds() < 2.0


def test_a_breaker_opens_on_its_failure_ratio_and_a_half_open_trial_decides() -> None:
    changes: list[tuple[str, str]] = []
    breakers = Breakers(
        BreakerPolicy(window=4, min_calls=4, failure_ratio=0.5, reset_timeout=timedelta(seconds=30)),
        lambda key, old, new: changes.append((old.value, new.value)),
    )
    breaker = breakers.get("h")
    for failed in (False, True, False):  # 1 of 3: under min_calls anyway
        breaker.admit()
        breaker.record(failed)
    assert breaker.state is BreakerState.CLOSED
    breaker.record(False)  # the window slides: 1 failure of 4
    breaker.record(True)  # 2 of 4 (the oldest, a success, left): opens
    assert breaker.state is BreakerState.OPEN
    assert breaker.failures == 2
    with pytest.raises(BreakerOpen):
        breaker.admit()
    assert timedelta(seconds=29) < breakers.blocked_for("h") <= timedelta(seconds=30)
    breaker._opened_at -= 30  # the reset timeout has passed (instead of waiting 30 s)
    assert breaker.state is BreakerState.HALF_OPEN
    assert breakers.blocked_for("h") == timedelta(0)
    breaker.admit()  # the trial
    breaker.record(True)  # fails: open again, for a new reset timeout
    assert breaker.state is BreakerState.OPEN
    assert breakers.blocked_for("h") > timedelta(seconds=29)
    breaker._opened_at -= 30
    breaker.admit()
    breaker.record(False)  # a trial succeeds: closed, with a clean window
    assert breaker.state is BreakerState.CLOSED
    assert (breaker.calls, breaker.failures) == (0, 0)
    assert changes == [
        ("closed", "open"), ("open", "half_open"), ("half_open", "open"), ("open", "half_open"),
        ("half_open", "closed"),
    ]  # fmt: skip
