"""Limits enforced end to end (issue 22): a run's limit keys resolved where it is made (in SQL, the
same rules as `limits.resolve_keys`), kept by every later attempt, carried to the queue, and the
definitions and held units the queues need, kept by the application and the leader."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
import pytest
import redis.asyncio as aioredis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scheduler_grpc.control import Control
from scheduler_grpc.db.executions import Advance, PlannedSlot
from scheduler_grpc.db.firing import FiringRepository
from scheduler_grpc.db.leadership import LeadershipRepository
from scheduler_grpc.db.recovery import RecoveryRepository
from scheduler_grpc.db.runs import RunRepository
from scheduler_grpc.executions import ExecutionStatus
from scheduler_grpc.gcra import LimitKey
from scheduler_grpc.jobs import JobSpec, ScheduleKind
from scheduler_grpc.limits import LimitKeyError, LimitKind, LimitRef, LimitSpec, resolve_keys
from scheduler_grpc.queue import Queue

CUSTOMER = LimitRef("per-customer", "payload.customer_id")


async def limit_keys(pool: asyncpg.Pool, run_id: str) -> list[Any]:
    rows = await pool.fetch("SELECT limit_keys FROM job_executions WHERE run_id = $1 ORDER BY attempt", run_id)
    return [row["limit_keys"] for row in rows]


# -- resolution in SQL, checked against the Python rules ------------------------------------------

_leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**63 - 1),
    st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from([2.0**64, 1.8446744073709552e19, -(2.0**63), 1e300, 1.0]),
    st.text(alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=210),
)
_payloads = st.recursive(
    _leaf,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.sampled_from(["a", "b", "c.d", "é"]), inner, max_size=3)
    ),
    max_leaves=8,
)
_templates = st.one_of(
    st.sampled_from(["billing-api", "payload.a", "payload.b", "payload.a.b", "payload.a.a.c", "payload.é"]),
    st.lists(st.sampled_from(["a", "b", "é"]), min_size=1, max_size=4).map(lambda p: "payload." + ".".join(p)),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(payload=st.dictionaries(st.sampled_from(["a", "b", "é"]), _payloads, max_size=3), templates=st.lists(
    _templates, min_size=1, max_size=4), units=st.integers(min_value=1, max_value=5))  # fmt: skip
async def test_sql_resolution_matches_the_python_rules(
    pool: asyncpg.Pool, payload: dict[str, Any], templates: list[str], units: int
) -> None:
    refs = [LimitRef(f"lim-{index}", template, units) for index, template in enumerate(templates)]
    # The payload as the run's snapshot holds it, and as Python reads it back from PostgreSQL.
    stored = await pool.fetchval("SELECT $1::jsonb", payload)
    sql = await pool.fetchval(
        "SELECT resolve_limit_keys($1::jsonb, $2::jsonb)",
        [{"limit": ref.limit, "key": ref.key, "units": ref.units} for ref in refs],
        stored,
    )
    try:
        expected: Any = [list(key) for key in resolve_keys(refs, stored)]
    except LimitKeyError as exc:
        expected = str(exc)
    assert sql == expected


# -- where runs are made ----------------------------------------------------------------------------


async def _limit(control: Control, spec: LimitSpec | None = None) -> None:
    await control.limits.create_limit(spec or LimitSpec("per-customer", LimitKind.CONCURRENCY, 1))


async def test_a_trigger_stores_the_keys_and_the_queue_item_carries_them(
    control: Control, pool: asyncpg.Pool, redis: aioredis.Redis
) -> None:
    await _limit(control)
    await control.limits.create_limit(LimitSpec("host", LimitKind.RATE, 10, timedelta(seconds=1), burst=2))
    job = await control.create_job(
        JobSpec(name="keyed", handler="test.echo", payload={"customer_id": 42},
                limits=(CUSTOMER, LimitRef("host", "billing-api", 2)))
    )  # fmt: skip
    run = (await control.trigger_job(job.id))[0]
    assert run.limits == (LimitKey("per-customer", "42", 1), LimitKey("host", "billing-api", 2))
    assert await limit_keys(pool, run.run_id) == [[["per-customer", "42", 1], ["host", "billing-api", 2]]]
    queue = Queue(redis)
    # The item waits in its group (the engine's lims record), and the definitions came with it.
    assert await redis.hexists(queue.keys.lims, run.run_id)
    assert set(await redis.hkeys(queue.keys.limdef)) == {b"per-customer", b"host"}


async def test_a_job_without_limits_makes_runs_without_keys(control: Control, pool: asyncpg.Pool) -> None:
    job = await control.create_job(JobSpec(name="plain", handler="test.echo"))
    run = (await control.trigger_job(job.id))[0]
    assert run.limits == ()
    assert await limit_keys(pool, run.run_id) == [None]


async def test_a_key_path_missing_from_the_payload_fails_the_run_with_the_reason(
    control: Control, pool: asyncpg.Pool, redis: aioredis.Redis
) -> None:
    await _limit(control)
    job = await control.create_job(JobSpec(name="nokey", handler="test.echo", payload={"other": 1}, limits=(CUSTOMER,)))
    execution = await control.trigger_execution(job.id)
    assert execution.status is ExecutionStatus.DEAD
    assert execution.finished_at is not None
    assert execution.error == "limit 'per-customer': key payload.customer_id: the payload has no such field"
    assert (await Queue(redis).states([execution.run_id]))[execution.run_id] is None  # never enqueued
    # A backfill's runs likewise: recorded dead, none enqueued.
    cron = await control.create_job(JobSpec(name="nokey-cron", handler="test.echo", payload={}, limits=(CUSTOMER,),
                                            schedule_kind=ScheduleKind.CRON, cron="0 * * * *"))  # fmt: skip
    assert await control.backfill_job(cron.id, [datetime(2020, 1, 1, tzinfo=UTC)]) == []
    row = await pool.fetchrow("SELECT status, error FROM job_executions WHERE trigger = 'backfill'")
    assert row is not None
    assert row["status"] == "dead"
    assert "payload.customer_id" in row["error"]


async def test_the_fire_resolves_keys_and_fails_only_the_jobs_that_give_none(
    control: Control, pool: asyncpg.Pool
) -> None:
    await _limit(control)
    good = await control.create_job(
        JobSpec(
            name="good",
            handler="test.echo",
            schedule_kind=ScheduleKind.CRON,
            cron="* * * * * *",
            payload={"customer_id": "c1"},
            limits=(CUSTOMER,),
        )
    )
    bad = await control.create_job(
        JobSpec(
            name="bad",
            handler="test.echo",
            schedule_kind=ScheduleKind.CRON,
            cron="* * * * * *",
            payload={"customer_id": 1.5},
            limits=(CUSTOMER,),
        )
    )
    plain = await control.create_job(JobSpec(name="plain", handler="test.echo", schedule_kind=ScheduleKind.CRON,
                                             cron="* * * * * *"))  # fmt: skip
    slot = datetime(2030, 1, 1, tzinfo=UTC)
    jobs = [good, bad, plain]
    await pool.execute("UPDATE jobs SET next_run_time = $1", slot)
    term = await LeadershipRepository(pool).begin_term("scheduler", "test")
    assert term is not None
    queued = await FiringRepository(pool).fire(
        term.term,
        [Advance(job.id, slot, slot + timedelta(seconds=1)) for job in jobs],
        [PlannedSlot(job.id, slot, ExecutionStatus.QUEUED, slot) for job in jobs],
    )
    assert {run.job_id: run.limits for run in queued} == {good.id: (LimitKey("per-customer", "c1", 1),), plain.id: ()}
    row = await pool.fetchrow("SELECT status, error, finished_at, limit_keys FROM job_executions WHERE job_id = $1",
                              bad.id)  # fmt: skip
    assert row is not None
    assert row["status"] == "dead"
    assert row["finished_at"] is not None
    assert row["limit_keys"] is None
    assert row["error"] == (
        "limit 'per-customer': key payload.customer_id: the value is a number with a fraction; "
        "a key is a string, integer or boolean"
    )


async def test_later_attempts_keep_the_run_s_keys(control: Control, pool: asyncpg.Pool) -> None:
    await _limit(control)
    job = await control.create_job(JobSpec(name="retried", handler="test.echo", payload={"customer_id": "c"},
                                           limits=(CUSTOMER,)))  # fmt: skip
    run = (await control.trigger_job(job.id))[0]
    runs = RunRepository(pool)
    # A takeover (another token claims a running attempt), an abandon, a release: each adds an attempt.
    first = (await runs.claim([(run.run_id, "t1")], "w1"))[0]
    second = (await runs.claim([(run.run_id, "t2")], "w2"))[0]
    assert second.attempt == 2
    await runs.abandon([(second.execution_id, "t2")])
    third = (await runs.claim([(run.run_id, "t3")], "w3"))[0]
    await runs.release([(third.execution_id, "t3")])
    assert first.attempt == 1
    keys = [["per-customer", "c", 1]]
    assert await limit_keys(pool, run.run_id) == [keys, keys, keys, keys]
    # What reconcile re-enqueues after a Redis loss carries them too.
    reopened = await RecoveryRepository(pool).open_runs(older_than=timedelta(0), after_run_id=None, limit=10)
    assert [r.limits for r in reopened] == [(LimitKey("per-customer", "c", 1),)]


async def test_a_flow_s_downstream_run_takes_its_keys_from_its_resolved_payload(
    control: Control, pool: asyncpg.Pool
) -> None:
    from scheduler_grpc.db.flows import FlowRepository, NodeDecision

    await _limit(control)
    root = await control.create_job(JobSpec(name="root", handler="test.echo"))
    down = await control.create_job(JobSpec(name="down", handler="test.echo", depends_on=(root.id,),
                                            limits=(CUSTOMER,)))  # fmt: skip
    flow_run = (await control.trigger_job(root.id))[0].run_id
    flows = FlowRepository(pool)
    queued, recorded = await flows.decide(flow_run, [NodeDecision(down.id, "queued", payload={"customer_id": "z"})],
                                          None)  # fmt: skip
    assert [run.limits for run in queued] == [(LimitKey("per-customer", "z", 1),)]
    assert recorded == []


async def test_a_flow_s_downstream_run_without_a_key_is_dead_with_the_reason(
    control: Control, pool: asyncpg.Pool
) -> None:
    from scheduler_grpc.db.flows import FlowRepository, NodeDecision

    await _limit(control)
    root = await control.create_job(JobSpec(name="root", handler="test.echo"))
    down = await control.create_job(JobSpec(name="down", handler="test.echo", depends_on=(root.id,),
                                            limits=(CUSTOMER,)))  # fmt: skip
    flow_run = (await control.trigger_job(root.id))[0].run_id
    queued, recorded = await FlowRepository(pool).decide(flow_run, [NodeDecision(down.id, "queued", payload={})], None)
    assert queued == []
    assert [(r.status, r.error) for r in recorded] == [
        ("dead", "limit 'per-customer': key payload.customer_id: the payload has no such field")
    ]


def test_keys_json_round_trip() -> None:
    from scheduler_grpc.db.executions import limit_keys_from_json

    assert limit_keys_from_json(None) == ()
    assert limit_keys_from_json(json.loads('[["a", "k", 2]]')) == (LimitKey("a", "k", 2),)


@pytest.mark.parametrize("value", [[], None])
def test_no_keys_is_empty(value: Any) -> None:
    from scheduler_grpc.db.executions import limit_keys_from_json

    assert limit_keys_from_json(value) == ()


async def test_a_dead_letter_requeue_keeps_the_keys_or_resolves_them_or_stays_dead(
    control: Control, pool: asyncpg.Pool, redis: aioredis.Redis
) -> None:
    await _limit(control)
    job = await control.create_job(JobSpec(name="fixme", handler="test.echo", payload={"id": "7"}, limits=(CUSTOMER,)))
    dead = await control.trigger_execution(job.id)
    assert dead.status is ExecutionStatus.DEAD
    # Still unresolvable: the requeue records another dead attempt and enqueues nothing.
    assert await control.requeue_dead_runs("default", [dead.run_id]) == []
    rows = await pool.fetch("SELECT status FROM job_executions WHERE run_id = $1 ORDER BY attempt", dead.run_id)
    assert [row["status"] for row in rows] == ["dead", "dead"]
    # The job's key fixed: the requeue resolves the run's keys now and enqueues it with them.
    await pool.execute(
        """UPDATE jobs SET limits = '[{"limit": "per-customer", "key": "payload.id", "units": 1}]' WHERE id = $1""",
        job.id,
    )
    [run] = await control.requeue_dead_runs("default", [dead.run_id])
    assert run.limits == (LimitKey("per-customer", "7", 1),)
    assert await limit_keys(pool, dead.run_id) == [None, None, [["per-customer", "7", 1]]]
    assert await redis.hexists(Queue(redis).keys.lims, dead.run_id)


async def test_limit_changes_reach_the_queues_at_once(control: Control, redis: aioredis.Redis) -> None:
    from dataclasses import replace

    limit = await control.limits.create_limit(LimitSpec("per-customer", LimitKind.CONCURRENCY, 1))
    job = await control.create_job(JobSpec(name="user", handler="test.echo", payload={"customer_id": "a"},
                                           limits=(CUSTOMER,)))  # fmt: skip
    queue = Queue(redis)
    await control.limits.merge_limit(limit.id, lambda current: replace(current, limit=3))
    assert json.loads(await redis.hget(queue.keys.limdef, "per-customer"))["l"] == 3
    [run] = await control.trigger_job(job.id)
    await control.delete_job(job.id)  # its runs go with it
    await control.limits.delete_limit(limit.id)
    assert not await redis.hexists(queue.keys.limdef, "per-customer")
    assert run.limits
