"""Issue 24: the worker's statements and the flow run page reach one partition of `job_executions`
per run (its slot travels with it: the queue item's data, `Claim.scheduled_for`, the flow node), and
an item queued before slots travelled (its data the breaker key alone) is still claimed and
completed, by id alone."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
import pytest
import redis.asyncio as aioredis

from scheduler_grpc.control import Control
from scheduler_grpc.db.executions import Outcome, Queued
from scheduler_grpc.db.firing import FiringRepository
from scheduler_grpc.db.flow_views import FlowViews
from scheduler_grpc.db.recovery import RecoveryRepository
from scheduler_grpc.db.runs import RunRepository
from scheduler_grpc.dispatch import queue_item
from scheduler_grpc.executions import ExecutionStatus, Trigger
from scheduler_grpc.items import item_breaker_key, item_data, item_slot
from scheduler_grpc.jobs import JobSpec
from scheduler_grpc.queue import NewItem, Queue
from tests.engine_helpers import eventually
from tests.test_worker_faults import registry_with, running_worker, statuses


class _Explaining(asyncpg.Connection):  # type: ignore[misc]
    """A connection that first runs each statement under EXPLAIN (ANALYZE, FORMAT JSON), rolled
    back, and keeps which partitions of `job_executions` each plan really scanned."""

    scanned: list[set[str]]

    async def fetch(self, query: str, *args: Any, **kwargs: Any) -> list[asyncpg.Record]:
        if not query.lstrip().startswith("EXPLAIN") and "job_executions" in query:
            transaction = self.transaction()
            await transaction.start()
            try:
                plan = await super().fetch(f"EXPLAIN (ANALYZE, FORMAT JSON) {query}", *args)
            finally:
                await transaction.rollback()
            found: set[str] = set()
            _scans(json.loads(plan[0][0])[0]["Plan"], found)
            self.scanned.append(found)
        return await super().fetch(query, *args, **kwargs)


def _scans(node: dict[str, Any], found: set[str]) -> None:
    """The partitions of `job_executions` a plan node (or one below it) scanned at least once."""
    relation = node.get("Relation Name", "")
    if "Scan" in node["Node Type"] and relation.startswith("job_executions_") and node.get("Actual Loops", 0) > 0:
        found.add(relation)
    for child in node.get("Plans", ()):
        _scans(child, found)


# The plans a long history gets (bench/partition_migration_bench.py: each row by an index, in a
# nested loop, for a batch of 200 over 1,000,000 rows). On the few rows of a test the planner
# would rather hash a sequential scan of every (tiny) partition, which says nothing of pruning.
_LONG_HISTORY = {"enable_hashjoin": "off", "enable_mergejoin": "off", "enable_seqscan": "off"}


async def _explaining(database_url: str) -> _Explaining:
    conn: _Explaining = await asyncpg.connect(database_url, connection_class=_Explaining, server_settings=_LONG_HISTORY)
    conn.scanned = []
    return conn


@pytest.fixture
async def explaining(pool: asyncpg.Pool, database_url: str) -> AsyncIterator[_Explaining]:
    conn = await _explaining(database_url)
    try:
        yield conn
    finally:
        await conn.close()


async def _days(pool: asyncpg.Pool) -> list[datetime]:
    """Noon of today and of the next three days (UTC), each in a day partition of its own."""
    today = await pool.fetchval("SELECT (now() AT TIME ZONE 'UTC')::date")
    for n in range(4):
        await pool.fetchval("SELECT job_executions_add_partition($1)", today + timedelta(days=n))
    return [datetime(today.year, today.month, today.day, 12, tzinfo=UTC) + timedelta(days=n) for n in range(4)]


def _partition(slot: datetime) -> str:
    return f"job_executions_p{slot:%Y%m%d}"


async def _runs(pool: asyncpg.Pool, slots: list[datetime]) -> list[Queued]:
    job = await pool.fetchval(
        "INSERT INTO jobs (name, handler, schedule_kind) VALUES ('p', 'test.echo', 'manual') RETURNING id::text"
    )
    runs = await FiringRepository(pool).trigger(job, Trigger.MANUAL, slots)
    assert [run.scheduled_for for run in runs] == slots  # a made run knows its slot
    return runs


async def test_with_their_slots_the_worker_statements_scan_only_their_runs_partitions(
    pool: asyncpg.Pool, explaining: _Explaining
) -> None:
    days = await _days(pool)
    slots = [days[1], days[3]]
    runs = await _runs(pool, slots)
    own = {_partition(slot) for slot in slots}
    store = RunRepository(explaining)

    claims = await store.claim([(r.run_id, f"t-{r.run_id}") for r in runs], "w", slots=slots)
    assert sorted(c.run_id for c in claims) == sorted(r.run_id for r in runs)
    failed = [
        Outcome(c.execution_id, f"t-{c.run_id}", ExecutionStatus.FAILED, "again", retry_after=timedelta(0),
                scheduled_for=c.scheduled_for)
        for c in claims
    ]  # fmt: skip
    done = await store.complete(failed, resent=True)
    assert all(d.retry_execution_id for d in done)
    # The retries: claimed, then handed back, polled, reserved and unclaimed, lost and abandoned
    # (each with its attempt's slot, from its claim, as the worker gives them).
    claims = await store.claim([(r.run_id, f"u-{r.run_id}") for r in runs], "w", slots=slots)
    assert {c.attempt for c in claims} == {2}
    items, held = [(c.execution_id, f"u-{c.run_id}") for c in claims], [c.scheduled_for for c in claims]
    assert await store.cancel_requested([c.execution_id for c in claims], slots=held) == []
    assert await store.release(items, slots=held) == 2
    claims = await store.claim([(r.run_id, f"v-{r.run_id}") for r in runs], "w", slots=slots)
    items, held = [(c.execution_id, f"v-{c.run_id}") for c in claims], [c.scheduled_for for c in claims]
    assert set((await store.unclaim(items, slots=held)).values()) == {ExecutionStatus.QUEUED}
    claims = await store.claim([(r.run_id, f"w-{r.run_id}") for r in runs], "w", slots=slots)
    items, held = [(c.execution_id, f"w-{c.run_id}") for c in claims], [c.scheduled_for for c in claims]
    assert await store.abandon(items, slots=held) == 2

    # 12: the three claims of retries are two statements each (the short one claims first attempts only).
    assert len(explaining.scanned) == 12
    for scanned in explaining.scanned:
        assert scanned <= own, (explaining.scanned.index(scanned), scanned)  # no other day, nor the default
    assert [(await statuses(pool, r.run_id)) for r in runs] == [["failed", "interrupted", "abandoned", "queued"]] * 2


async def test_without_slots_the_same_statements_find_runs_by_id_alone(
    pool: asyncpg.Pool, explaining: _Explaining
) -> None:
    # Items queued before slots travelled with them: correct, and every partition is probed.
    days = await _days(pool)
    runs = await _runs(pool, [days[1], days[2]])
    store = RunRepository(explaining)
    claims = await store.claim([(r.run_id, f"t-{r.run_id}") for r in runs], "w")
    assert sorted(c.run_id for c in claims) == sorted(r.run_id for r in runs)
    assert await store.cancel_requested([c.execution_id for c in claims]) == []
    done = await store.complete(
        [Outcome(c.execution_id, f"t-{c.run_id}", ExecutionStatus.SUCCEEDED, result={"n": 1}) for c in claims]
    )
    assert {d.status for d in done} == {ExecutionStatus.SUCCEEDED}
    assert _partition(days[3]) in explaining.scanned[0]  # the fallback probes days the runs are not in
    for r in runs:
        assert await statuses(pool, r.run_id) == ["succeeded"]


async def test_lease_recovery_abandons_by_run_and_token_with_or_without_slots(pool: asyncpg.Pool) -> None:
    days = await _days(pool)
    runs = await _runs(pool, [days[1], days[2]])
    store = RunRepository(pool)
    await store.claim([(r.run_id, f"t-{r.run_id}") for r in runs], "w")
    recovery = RecoveryRepository(pool)
    assert await recovery.abandon_expired([(r.run_id, f"t-{r.run_id}") for r in runs]) == 2
    for r in runs:
        assert await statuses(pool, r.run_id) == ["abandoned", "queued"]


def test_an_items_data_carries_the_breaker_key_and_the_slot() -> None:
    slot = datetime(2026, 12, 2, 21, 4, 5, 123456, tzinfo=UTC)
    data = item_data("http.webhook:example.com", slot)
    assert (item_breaker_key(data.encode()), item_slot(data.encode())) == ("http.webhook:example.com", slot)
    far = datetime(1999, 1, 1, tzinfo=UTC)
    assert item_slot(item_data("h", far)) == far
    # An item made before: the breaker key alone, no slot.
    assert (item_breaker_key(b"test.echo"), item_slot(b"test.echo")) == ("test.echo", None)
    assert item_data("test.echo", None) == "test.echo"


async def test_a_runs_queue_item_carries_its_slot_to_the_lease(redis: aioredis.Redis, pool: asyncpg.Pool) -> None:
    days = await _days(pool)
    [run] = await _runs(pool, [days[2]])
    queue = Queue(redis, "default")
    assert await queue.enqueue_many([queue_item(run, datetime.now(UTC))]) == 1
    [lease] = await queue.dequeue("w", timedelta(seconds=30))
    assert (item_breaker_key(lease.data), item_slot(lease.data)) == ("test.echo", days[2])


async def test_a_worker_runs_an_item_queued_without_its_slot(
    redis: aioredis.Redis, pool: asyncpg.Pool, redis_url: str, database_url: str, control: Control
) -> None:
    # An item enqueued by a version before this one (its data the breaker key alone): the worker
    # claims and completes it by id alone.
    job = await control.create_job(JobSpec(name="old-item", handler="test.echo"))
    [run] = await FiringRepository(pool).trigger(job.id, Trigger.MANUAL, [datetime.now(UTC) - timedelta(days=1)])
    await Queue(redis, "default").enqueue_many([NewItem(run.run_id, data=b"test.echo")])
    async with running_worker(redis_url, database_url, pool, registry_with()):

        async def done() -> bool:
            return await statuses(pool, run.run_id) == ["succeeded"]

        await eventually(done)


async def test_the_flow_run_page_reads_one_partition_per_node(
    pool: asyncpg.Pool, control: Control, database_url: str
) -> None:
    root = await control.create_job(JobSpec(name="root", handler="test.echo"))
    await control.create_job(JobSpec(name="child", handler="test.echo", depends_on=("root",)))
    await _days(pool)
    [run] = await control.trigger_job(root.id)
    nodes = await pool.fetch("SELECT run_id, run_scheduled_for FROM flow_nodes ORDER BY run_id NULLS LAST")
    slot = await pool.fetchval("SELECT scheduled_for FROM job_executions WHERE id = $1", uuid.UUID(run.run_id))
    assert [(str(n["run_id"]), n["run_scheduled_for"]) for n in nodes] == [(run.run_id, slot), ("None", None)]
    conn = await _explaining(database_url)
    try:
        async with conn.transaction():
            view = await FlowViews(conn).flow_run(run.run_id)  # type: ignore[arg-type]
    finally:
        await conn.close()
    assert [v.node.status for v in view.nodes if v.node.run_id] == ["queued"]
    assert conn.scanned
    assert all(scanned <= {_partition(slot)} for scanned in conn.scanned), conn.scanned
