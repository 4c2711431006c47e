"""LimitService's key methods over gRPC (issue 22): GetLimitKey, PauseLimitKey, ResumeLimitKey
(roles, validation, NOT_FOUND, per-queue state), and `blocked_by` on queued executions.

The key state is made directly through `Queue` (definitions, items with limit keys, a lease), so
these tests do not depend on how runs get their limit keys when they are fired."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

import asyncpg
import grpc
import pytest
from google.protobuf import duration_pb2, timestamp_pb2
from redis.asyncio import Redis
from scheduler_client.v1 import executions_pb2, jobs_pb2, limits_pb2, limits_pb2_grpc

from scheduler_grpc import auth
from scheduler_grpc.auth import METHOD_ROLES
from scheduler_grpc.gcra import LimitDefinition, LimitKey
from scheduler_grpc.queue import NewItem, Queue
from tests.test_api_auth import call, full_name, methods
from tests.test_api_limits import create, ref, refused
from tests.test_api_support import Harness, api, echo_job  # noqa: F401 - `api` is a fixture

VT = timedelta(seconds=60)
QUEUE = "limq"


def stub(harness: Harness) -> limits_pb2_grpc.LimitServiceStub:
    return limits_pb2_grpc.LimitServiceStub(harness.channel)


def stamp(value: datetime) -> timestamp_pb2.Timestamp:
    message = timestamp_pb2.Timestamp()
    message.FromDatetime(value)
    return message


async def setup_key(api: Harness, redis: Redis) -> tuple[Queue, jobs_pb2.Job]:  # noqa: F811
    """A concurrency-1 limit `per-customer` named by a job on QUEUE; key `c1` holds its one unit
    (a leased run) and has one run waiting."""
    await create(api, "per-customer", limit=1)
    job_message = echo_job(
        "j", queue=QUEUE, payload={"customer_id": "c1"}, limits=[ref("per-customer", "payload.customer_id")]
    )
    job = (await api.jobs.CreateJob(jobs_pb2.CreateJobRequest(job=job_message), metadata=api.admin)).job
    queue = Queue(redis, QUEUE)
    await queue.put_limit_definitions([LimitDefinition("per-customer", "concurrency", 1)])
    await queue.enqueue_many([NewItem(f"run-{n}", limits=(LimitKey("per-customer", "c1"),)) for n in range(2)])
    assert [lease.id for lease in await queue.dequeue("w", VT, 2)] == ["run-0"]
    return queue, job


async def test_the_key_methods_viewers_read_operators_pause_and_resume(api: Harness, redis: Redis) -> None:  # noqa: F811
    wanted = {
        "GetLimitKey": auth.Role.VIEWER,
        "PauseLimitKey": auth.Role.OPERATOR,
        "ResumeLimitKey": auth.Role.OPERATOR,
    }
    for method in methods(limits_pb2):
        if method.name in wanted:
            assert METHOD_ROLES[full_name(method)] is wanted[method.name], method.name
            assert await call(api, method) == grpc.StatusCode.UNAUTHENTICATED, method.name
            if wanted[method.name] is auth.Role.OPERATOR:
                assert await call(api, method, api.viewer) == grpc.StatusCode.PERMISSION_DENIED, method.name
    await setup_key(api, redis)
    read = limits_pb2.GetLimitKeyRequest(limit="per-customer", key="c1")
    assert (await stub(api).GetLimitKey(read, metadata=api.viewer)).state.queued_runs == 1
    pause = limits_pb2.PauseLimitKeyRequest(limit="per-customer", key="c1", duration=duration_pb2.Duration(seconds=30))
    await stub(api).PauseLimitKey(pause, metadata=api.operator)
    resume = limits_pb2.ResumeLimitKeyRequest(limit="per-customer", key="c1")
    await stub(api).ResumeLimitKey(resume, metadata=api.operator)


async def test_a_key_reads_per_queue_and_pause_then_resume_show_in_it(api: Harness, redis: Redis) -> None:  # noqa: F811
    await setup_key(api, redis)
    read = limits_pb2.GetLimitKeyRequest(limit="per-customer", key="c1")
    state = (await stub(api).GetLimitKey(read, metadata=api.viewer)).state
    assert (state.limit, state.key, state.running_units, state.queued_runs) == ("per-customer", "c1", 1, 1)
    assert [q.queue for q in state.queues] == [QUEUE]
    (on_queue,) = state.queues
    assert (on_queue.running_units, on_queue.queued_runs) == (1, 1)
    assert not on_queue.HasField("pause_end_time")
    assert not on_queue.HasField("next_admit_time")  # full: it waits for its unit to come back
    # An idle key of the same limit reads as empty, admitting now.
    idle = (
        await stub(api).GetLimitKey(limits_pb2.GetLimitKeyRequest(limit="per-customer", key="c2"), metadata=api.viewer)
    ).state
    assert (idle.running_units, idle.queued_runs) == (0, 0)
    assert idle.queues[0].HasField("next_admit_time")

    before = datetime.now(UTC)
    pause = limits_pb2.PauseLimitKeyRequest(limit="per-customer", key="c1", duration=duration_pb2.Duration(seconds=30))
    paused = (await stub(api).PauseLimitKey(pause, metadata=api.operator)).state
    end = paused.queues[0].pause_end_time.ToDatetime(tzinfo=UTC)
    assert before + timedelta(seconds=29) < end < before + timedelta(seconds=32)
    again = (await stub(api).GetLimitKey(read, metadata=api.viewer)).state
    assert again.queues[0].pause_end_time == paused.queues[0].pause_end_time
    # Until a time: it replaces the pause.
    until = datetime.now(UTC) + timedelta(minutes=10)
    later = limits_pb2.PauseLimitKeyRequest(limit="per-customer", key="c1", pause_end_time=stamp(until))
    moved = (await stub(api).PauseLimitKey(later, metadata=api.operator)).state
    assert abs(moved.queues[0].pause_end_time.ToDatetime(tzinfo=UTC) - until) < timedelta(seconds=2)

    resumed = (
        await stub(api).ResumeLimitKey(
            limits_pb2.ResumeLimitKeyRequest(limit="per-customer", key="c1"), metadata=api.operator
        )
    ).state
    assert not resumed.queues[0].HasField("pause_end_time")
    assert not (await stub(api).GetLimitKey(read, metadata=api.viewer)).state.queues[0].HasField("pause_end_time")


async def test_a_named_queue_is_read_and_paused_alone(api: Harness, redis: Redis) -> None:  # noqa: F811
    await setup_key(api, redis)
    other = limits_pb2.PauseLimitKeyRequest(
        limit="per-customer", key="c1", queue="other", duration=duration_pb2.Duration(seconds=30)
    )
    paused = (await stub(api).PauseLimitKey(other, metadata=api.operator)).state
    assert [(q.queue, q.HasField("pause_end_time")) for q in paused.queues] == [("other", True)]
    mine = (
        await stub(api).GetLimitKey(limits_pb2.GetLimitKeyRequest(limit="per-customer", key="c1"), metadata=api.viewer)
    ).state
    assert [(q.queue, q.HasField("pause_end_time")) for q in mine.queues] == [(QUEUE, False)]


async def test_a_limit_no_job_names_is_paused_only_on_a_named_queue(api: Harness) -> None:  # noqa: F811
    await create(api, "unused", limit=1)
    request = limits_pb2.PauseLimitKeyRequest(limit="unused", key="k", duration=duration_pb2.Duration(seconds=5))
    code, _ = await refused(api, stub(api).PauseLimitKey(request, metadata=api.operator))
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    state = (
        await stub(api).GetLimitKey(limits_pb2.GetLimitKeyRequest(limit="unused", key="k"), metadata=api.viewer)
    ).state
    assert list(state.queues) == []
    assert state.queued_runs == 0


@pytest.mark.parametrize(
    ("request_fields", "field"),
    [
        ({"key": ""}, "key"),
        ({"key": "k" * 201}, "key"),
        ({"queue": "no spaces"}, "queue"),
        ({"duration": duration_pb2.Duration(seconds=0)}, "duration"),
        ({"duration": duration_pb2.Duration(seconds=367 * 86400)}, "duration"),
        ({"duration": None}, "duration"),  # neither a duration nor an end
        ({"duration": None, "pause_end_time": timestamp_pb2.Timestamp(seconds=1)}, "pause_end_time"),
    ],
)
async def test_bad_pauses_are_invalid_argument_naming_the_field(
    api: Harness,  # noqa: F811
    request_fields: dict[str, object],
    field: str,
) -> None:
    await create(api, "per-customer", limit=1)
    fields: dict[str, object] = {"limit": "per-customer", "key": "c1", "duration": duration_pb2.Duration(seconds=5)}
    fields.update(request_fields)
    request = limits_pb2.PauseLimitKeyRequest(**{name: value for name, value in fields.items() if value is not None})
    assert await refused(api, stub(api).PauseLimitKey(request, metadata=api.operator)) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        field,
    )


async def test_an_unknown_limit_is_not_found_and_a_bad_key_names_it(api: Harness) -> None:  # noqa: F811
    for call_ in (
        stub(api).GetLimitKey(limits_pb2.GetLimitKeyRequest(limit="nope", key="k"), metadata=api.viewer),
        stub(api).ResumeLimitKey(limits_pb2.ResumeLimitKeyRequest(limit="nope", key="k"), metadata=api.operator),
        stub(api).PauseLimitKey(
            limits_pb2.PauseLimitKeyRequest(limit="nope", key="k", duration=duration_pb2.Duration(seconds=1)),
            metadata=api.operator,
        ),
    ):
        code, _ = await refused(api, call_)
        assert code == grpc.StatusCode.NOT_FOUND
    await create(api, "real", limit=1)
    assert await refused(
        api, stub(api).GetLimitKey(limits_pb2.GetLimitKeyRequest(limit="real", key=""), metadata=api.viewer)
    ) == (grpc.StatusCode.INVALID_ARGUMENT, "key")


async def park_a_run(api: Harness, redis: Redis, pool: asyncpg.Pool) -> tuple[executions_pb2.Execution, Queue]:  # noqa: F811
    """A triggered run of the job, queued behind key c1 (whose one unit is held): its limit keys
    written to PostgreSQL and its queue item put in its group, as firing does once enforcement is
    wired."""
    queue, job = await setup_key(api, redis)
    execution = (await api.jobs.TriggerJob(jobs_pb2.TriggerJobRequest(id=job.id), metadata=api.operator)).execution
    await pool.execute(
        "UPDATE job_executions SET limit_keys = $2 WHERE id = $1",
        uuid.UUID(execution.id),
        [["per-customer", "c1", 1]],
    )
    await queue.remove_many([execution.run_id])
    await queue.enqueue_many([NewItem(execution.run_id, limits=(LimitKey("per-customer", "c1"),))])
    assert list(await queue.dequeue("w", VT, 1)) == []  # the group is found blocked and parked
    return execution, queue


async def test_a_queued_execution_says_which_key_it_waits_for(
    api: Harness,  # noqa: F811
    redis: Redis,
    pool: asyncpg.Pool,
) -> None:
    execution, _ = await park_a_run(api, redis, pool)
    got = (
        await api.executions.GetExecution(executions_pb2.GetExecutionRequest(id=execution.id), metadata=api.viewer)
    ).execution
    assert (got.blocked_by.limit, got.blocked_by.key, got.blocked_by.reason) == ("per-customer", "c1", "concurrency")
    assert got.blocked_by.since.ToDatetime(tzinfo=UTC) <= datetime.now(UTC)
    listed = await api.executions.ListExecutions(executions_pb2.ListExecutionsRequest(), metadata=api.viewer)
    (row,) = [e for e in listed.executions if e.id == execution.id]
    assert row.blocked_by == got.blocked_by
    # Runs that take no limits carry no reason.
    other = (await api.jobs.CreateJob(jobs_pb2.CreateJobRequest(job=echo_job("plain")), metadata=api.admin)).job
    plain = (await api.jobs.TriggerJob(jobs_pb2.TriggerJobRequest(id=other.id), metadata=api.operator)).execution
    got = (
        await api.executions.GetExecution(executions_pb2.GetExecutionRequest(id=plain.id), metadata=api.viewer)
    ).execution
    assert not got.HasField("blocked_by")


async def test_a_run_not_held_back_has_no_blocked_by(
    api: Harness,  # noqa: F811
    redis: Redis,
    pool: asyncpg.Pool,
) -> None:
    execution, queue = await park_a_run(api, redis, pool)
    await queue.remove_many([execution.run_id])  # e.g. cancelled from Redis: nothing parks it any more
    got = (
        await api.executions.GetExecution(executions_pb2.GetExecutionRequest(id=execution.id), metadata=api.viewer)
    ).execution
    assert not got.HasField("blocked_by")
