"""Nothing a job outputs stops a role (issue 19, defects 1-3): a value the store refuses fails the item
that carried it, bounded where it is produced, in the unit it is stored in."""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
import grpc
import pytest
import redis.asyncio as aioredis
from google.protobuf import json_format, struct_pb2
from scheduler_client.v1 import executions_pb2, jobs_pb2

from scheduler_grpc import outputs
from scheduler_grpc.control import Control
from scheduler_grpc.db.executions import REFUSED_ERROR, Outcome
from scheduler_grpc.db.firing import FiringRepository
from scheduler_grpc.db.flows import REFUSED_ERROR as FLOW_REFUSED_ERROR
from scheduler_grpc.db.flows import FlowRepository, NodeDecision
from scheduler_grpc.db.jobs import JobRepository
from scheduler_grpc.db.runs import RunRepository
from scheduler_grpc.executions import ExecutionStatus, Trigger
from scheduler_grpc.jobs import JobSpec, RetryPolicy, ScheduleKind
from scheduler_grpc.outputs import MAX_DEPTH, MAX_ERROR_CHARS
from tests.engine_helpers import Roles, eventually, wait_until_ready
from tests.test_api_support import Harness, api, echo_job  # noqa: F401 - `api` is a fixture
from tests.test_flows_engine import finished, states


async def _claimed(pool: asyncpg.Pool, n: int) -> list[tuple[str, str]]:
    """`n` runs of a new job, claimed: (execution id, claim token) each."""
    job = await JobRepository(pool).create(JobSpec(name=f"bounded-{uuid.uuid4().hex[:8]}", handler="test.echo"), None)
    base = datetime(2020, 1, 1, tzinfo=UTC)
    executions = RunRepository(pool)
    slots = [base + timedelta(seconds=i) for i in range(n)]
    runs = [q.run_id for q in await FiringRepository(pool).trigger(job.id, Trigger.BACKFILL, slots)]
    claims = {c.run_id: c for c in await executions.claim([(run, f"t-{run}") for run in runs], "w")}
    return [(claims[run].execution_id, f"t-{run}") for run in runs]


async def _rows(pool: asyncpg.Pool, ids: list[str]) -> list[tuple[str, str | None, Any]]:
    rows = await pool.fetch(
        "SELECT id::text, status, error, result FROM job_executions WHERE id = ANY($1::uuid[])",
        [uuid.UUID(i) for i in ids],
    )
    by_id = {row["id"]: (row["status"], row["error"], row["result"]) for row in rows}
    return [by_id[i] for i in ids]


async def test_a_refused_result_fails_only_its_own_outcome_of_a_completion_batch(pool: asyncpg.Pool) -> None:
    """Defect 2 (the repository's side): the batch's other outcomes are recorded; each refused one
    is recorded `dead` with an error saying the store refused its result."""
    claimed = await _claimed(pool, 6)
    results: list[Any] = [
        {"ok": 1},
        {"big": "x" * 70_000},  # PostgreSQL's CHECK refuses it
        {"nul": "a\x00b"},  # PostgreSQL refuses \u0000 in jsonb
        {"tags": {1, 2}},  # orjson cannot encode a set
    ]
    outcomes = [
        Outcome(i, token, ExecutionStatus.SUCCEEDED, result=result)
        for (i, token), result in zip(claimed, results, strict=False)
    ]
    outcomes.append(Outcome(*claimed[4], ExecutionStatus.FAILED, "e" * 20_000, retry_after=timedelta(seconds=9)))
    outcomes.append(Outcome(*claimed[5], ExecutionStatus.FAILED, "nul \x00 and \ud800", retry_after=timedelta(0)))
    done = {d.execution_id: d for d in await RunRepository(pool).complete(outcomes, resent=False)}
    ids = [i for i, _ in claimed]
    assert set(done) == set(ids)
    assert [done[i].status for i in ids] == [ExecutionStatus.SUCCEEDED] + [ExecutionStatus.DEAD] * 3 + [
        ExecutionStatus.FAILED
    ] * 2
    assert done[ids[4]].retry_execution_id is not None
    rows = await _rows(pool, ids)
    assert rows[0] == ("succeeded", None, {"ok": 1})
    for status, error, result in rows[1:4]:
        assert (status, result) == ("dead", None)
        assert error is not None
        assert error.startswith(f"{REFUSED_ERROR}: ")
    assert "check constraint" in str(rows[1][1])
    assert rows[4][0] == "failed"
    assert len(str(rows[4][1])) == MAX_ERROR_CHARS
    assert rows[5][:2] == ("failed", "nul \ufffd and \ufffd")


async def test_a_refused_result_inside_a_transaction_keeps_the_transaction(pool: asyncpg.Pool) -> None:
    [(i, token), (j, token_j)] = await _claimed(pool, 2)
    async with pool.acquire() as connection, connection.transaction():
        done = await RunRepository(connection).complete(
            [Outcome(i, token, ExecutionStatus.SUCCEEDED, result={"big": "x" * 70_000}),
             Outcome(j, token_j, ExecutionStatus.SUCCEEDED, result=[1])]
        )  # fmt: skip
        assert sorted(d.status.value for d in done) == ["dead", "succeeded"]
    assert [row[0] for row in await _rows(pool, [i, j])] == ["dead", "succeeded"]


def _nested(depth: int, leaf: Any = 1) -> Any:
    value = leaf
    for _ in range(depth):
        value = {"k": value}
    return value


async def test_a_stored_result_too_deep_for_a_client_is_returned_as_an_error_string(
    api: Harness,  # noqa: F811
    pool: asyncpg.Pool,
) -> None:
    """Defect 3 (the API's side): a result stored before results were bounded, too deep for
    protobuf's Struct, is answered in place by a string saying so, not INTERNAL for every reader."""
    job = (await api.jobs.CreateJob(jobs_pb2.CreateJobRequest(job=echo_job()), metadata=api.admin)).job
    runs = [
        (await api.jobs.TriggerJob(jobs_pb2.TriggerJobRequest(id=job.id), metadata=api.operator)).execution.id
        for _ in range(2)
    ]
    finish = """UPDATE job_executions SET status = 'succeeded', started_at = now(), finished_at = now(),
                                         worker_id = 'w', result = $2::jsonb WHERE id = $1"""
    await pool.execute(finish, uuid.UUID(runs[0]), _nested(40))
    await pool.execute(finish, uuid.UUID(runs[1]), _nested(MAX_DEPTH))
    got = await api.executions.GetExecution(executions_pb2.GetExecutionRequest(id=runs[0]), metadata=api.viewer)
    marker = got.execution.result.string_value
    assert marker == "(result not shown: nested 40 levels deep; the API returns at most 20)"
    listed = await api.executions.ListExecutions(
        executions_pb2.ListExecutionsRequest(job_id=job.id, view=executions_pb2.EXECUTION_VIEW_FULL),
        metadata=api.viewer,
    )
    by_id = {e.id: e for e in listed.executions}
    assert by_id[runs[0]].result.string_value == marker
    assert json_format.MessageToDict(by_id[runs[1]].result) == _nested(MAX_DEPTH)


async def test_a_payload_over_64_kib_as_stored_is_an_invalid_argument_naming_payload(
    api: Harness,  # noqa: F811
) -> None:
    """Defect 2 (the API's side): 65,001 bytes as compact JSON, 78,000 as PostgreSQL stores it."""
    payload = struct_pb2.Struct()
    payload.update({f"k{i:04d}": 0 for i in range(6_500)})
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await api.jobs.CreateJob(jobs_pb2.CreateJobRequest(job=echo_job(payload=payload)), metadata=api.admin)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (caught.value.details() or "").startswith("job.payload: is 78,000 bytes as stored; at most 65,536")


async def test_a_flow_decision_the_store_refuses_fails_that_node_not_the_leader(
    control: Control, pool: asyncpg.Pool
) -> None:
    """Defect 1 (the repository's side): any refusal while advancing a flow fails its node only."""
    a = await control.create_job(JobSpec(name="A", handler="test.echo"))
    b = await control.create_job(JobSpec(name="B", handler="test.echo", depends_on=("A",)))
    c = await control.create_job(JobSpec(name="C", handler="test.echo", depends_on=("A",)))
    flow_run_id = (await control.trigger_job(a.id))[0].run_id
    decisions = [
        NodeDecision(b.id, "queued", payload={"big": "x" * 70_000}),  # the payload column's CHECK refuses it
        NodeDecision(c.id, "queued", payload={"ok": 1}),
    ]
    async with pool.acquire() as connection, connection.transaction():
        queued, recorded = await FlowRepository(connection).decide(flow_run_id, decisions, None)
    assert [(q.job_id, q.payload) for q in queued] == [(c.id, {"ok": 1})]
    assert [(r.job_id, r.status) for r in recorded] == [(b.id, "dead")]
    assert recorded[0].error.startswith(f"{FLOW_REFUSED_ERROR}: ")
    assert "check constraint" in recorded[0].error
    flow = await control.get_flow_run(flow_run_id)
    assert {node.job_name: node.state for node in flow.nodes} == {"A": "queued", "B": "dead", "C": "queued"}


async def test_poison_outputs_fail_their_own_items_and_every_role_keeps_working(
    roles: Roles, control: Control, pool: asyncpg.Pool, redis: aioredis.Redis
) -> None:
    """Defects 1-3 with real role processes: a result over 64 KiB as stored (defect 2), one nested
    256 deep (defect 3), and a flow whose `$from` resolves to more than 64 KiB (defect 1, the
    issue's reproduction) each fail their own run; the scheduler and the worker live on, and a
    per-second job keeps firing and running."""
    scheduler, worker = roles.start("scheduler"), roles.start("worker", "--concurrency", "4")
    await wait_until_ready(redis, workers=1)
    once = RetryPolicy(max_retries=0, initial_backoff=timedelta(milliseconds=100))

    def echo(name: str, payload: dict[str, Any] | None = None, *depends_on: str) -> JobSpec:
        return JobSpec(name=name, handler="test.echo", payload=payload or {}, depends_on=depends_on, retry=once)

    tick = await control.create_job(replace(echo("tick"), schedule_kind=ScheduleKind.CRON, cron="* * * * * *"))
    big_payload = {"s": "x" * 65_520}  # fits as a payload; its echo {"echo": payload} does not
    big = await control.create_job(echo("big", big_payload))
    up = await control.create_job(echo("up", {"s": "x" * 40_000}))
    await control.create_job(echo("down", {"a": {"$from": "up.result"}, "b": {"$from": "up.result"}}, "up"))
    deep = await control.create_job(echo("deep"))
    # Deeper than the API takes (as data stored before the bounds might be): its echo is 256 deep.
    nested = '{"k": ' * 255 + "1" + "}" * 255  # as text: orjson encodes 254 levels at most
    await pool.execute("UPDATE jobs SET payload = $2::text::jsonb WHERE id = $1", uuid.UUID(deep.id), nested)
    big_run = (await control.trigger_job(big.id))[0].run_id
    flow_run_id = (await control.trigger_job(up.id))[0].run_id
    deep_run = (await control.trigger_job(deep.id))[0].run_id

    async def ended(run_id: str) -> tuple[str, str] | None:
        row = await pool.fetchrow(
            "SELECT status, error FROM job_executions WHERE run_id = $1 AND finished_at IS NOT NULL "
            "ORDER BY attempt DESC LIMIT 1",
            uuid.UUID(run_id),
        )
        return (row["status"], row["error"]) if row is not None else None

    stored = outputs.stored_size({"echo": big_payload})
    assert await eventually(lambda: ended(big_run), within=60) == (
        "dead",
        f"result is {stored:,} bytes as stored; at most 65,536 (retry budget of 0 spent)",
    )
    assert await eventually(lambda: ended(deep_run), within=60) == (
        "dead",
        "result is not storable: nested deeper than 20 objects or arrays (retry budget of 0 spent)",
    )
    flow = await finished(control, flow_run_id, within=60)
    assert states(flow) == {"up": "succeeded", "down": "dead"}
    down_run = next(node.run_id for node in flow.nodes if node.job_name == "down")
    assert down_run is not None
    up_result = {"echo": {"s": "x" * 40_000}}
    resolved = outputs.stored_size({"a": up_result, "b": up_result})
    assert await ended(down_run) == ("dead", f"payload resolved to {resolved:,} bytes; at most 65,536")

    # Every role lives on: the per-second job keeps firing and running, and a new run runs.
    async def ticks() -> int:
        value = await pool.fetchval(
            "SELECT count(*) FROM job_executions WHERE job_id = $1 AND status = 'succeeded'", uuid.UUID(tick.id)
        )
        return int(value)

    seen = await ticks()
    await eventually(lambda: _at_least(ticks, seen + 3), within=30)
    after = await control.create_job(echo("after"))
    after_run = (await control.trigger_job(after.id))[0].run_id
    assert await eventually(lambda: ended(after_run), within=30) == ("succeeded", None)
    assert scheduler.process.poll() is None
    assert worker.process.poll() is None


async def _at_least(count: Callable[[], Awaitable[int]], least: int) -> bool:
    return await count() >= least
