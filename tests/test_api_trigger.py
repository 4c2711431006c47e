"""TriggerJob under concurrency: group commit (`trigger_batch`), each caller its own answer."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import grpc
import pytest
from redis.asyncio import Redis
from scheduler_client.v1 import executions_pb2, jobs_pb2

from scheduler_grpc import metrics
from scheduler_grpc.control import Control
from scheduler_grpc.errors import NotFound
from scheduler_grpc.executions import Trigger
from scheduler_grpc.jobs import JobSpec, ScheduleKind
from scheduler_grpc.keys import QueueKeys
from scheduler_grpc.queue import Queue
from scheduler_grpc.trigger_batch import GATHER_AFTER, MAX_IN_FLIGHT, TriggerBatcher
from tests.engine_helpers import Roles, eventually
from tests.test_api_support import Harness, api, echo_job  # noqa: F401 - `api` is a fixture

CALLS = 200


async def _trigger(api: Harness, request: jobs_pb2.TriggerJobRequest) -> Any:  # noqa: F811
    try:
        return (await api.jobs.TriggerJob(request, metadata=api.operator)).execution
    except grpc.aio.AioRpcError as error:
        return error.code(), error.details()


async def test_concurrent_triggers_of_one_job_each_create_their_own_run(api: Harness, redis: Redis) -> None:  # noqa: F811
    """Many callers triggering one job at once (same microsecond slots collided: "job not found")."""
    job = (await api.jobs.CreateJob(jobs_pb2.CreateJobRequest(job=echo_job()), metadata=api.admin)).job
    request = jobs_pb2.TriggerJobRequest(id=job.id)
    answers = await asyncio.gather(*(_trigger(api, request) for _ in range(CALLS)))
    failures = [answer for answer in answers if isinstance(answer, tuple)]
    assert failures == []
    assert len({answer.id for answer in answers}) == CALLS
    pool = api.server.api.control._pool
    rows = await pool.fetch("SELECT id, scheduled_for FROM job_executions WHERE job_id = $1", uuid.UUID(job.id))
    assert {str(row["id"]) for row in rows} == {answer.id for answer in answers}
    assert len({row["scheduled_for"] for row in rows}) == CALLS
    assert (await Queue(redis, job.queue or "default").stats()).ready == CALLS


async def test_a_bad_request_in_a_batch_fails_only_its_own_call(api: Harness) -> None:  # noqa: F811
    job = (await api.jobs.CreateJob(jobs_pb2.CreateJobRequest(job=echo_job()), metadata=api.admin)).job
    missing = str(uuid.uuid4())
    requests = [
        *(jobs_pb2.TriggerJobRequest(id=job.id) for _ in range(20)),
        jobs_pb2.TriggerJobRequest(id=missing),
        jobs_pb2.TriggerJobRequest(id=missing, request_id="to-nowhere"),
        jobs_pb2.TriggerJobRequest(id="not-a-uuid"),
        jobs_pb2.TriggerJobRequest(id=job.id, request_id="nul\x00"),
        jobs_pb2.TriggerJobRequest(id=job.id, request_id="x" * 129),
        *(jobs_pb2.TriggerJobRequest(id=job.id, request_id="shared") for _ in range(5)),
        *(jobs_pb2.TriggerJobRequest(id=job.id) for _ in range(20)),
    ]
    answers = await asyncio.gather(*(_trigger(api, request) for request in requests))
    good, rest = answers[:20] + answers[-20:], answers[20:-20]
    assert all(not isinstance(answer, tuple) for answer in good)
    assert [answer[0] for answer in rest[:5]] == [
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.INVALID_ARGUMENT,
    ]
    assert [answer[1].split(":")[0] for answer in rest[2:5]] == ["id", "request_id", "request_id"]
    shared = rest[5:]
    assert len({answer.id for answer in shared}) == 1, "one request_id, one run"
    again = await _trigger(api, jobs_pb2.TriggerJobRequest(id=job.id, request_id="shared"))
    assert again.id == shared[0].id
    pool = api.server.api.control._pool
    assert await pool.fetchval("SELECT count(*) FROM job_executions") == 41


async def test_concurrent_triggers_share_statements(control: Control, monkeypatch: pytest.MonkeyPatch) -> None:
    job = await control.create_job(JobSpec(name="batched", handler="test.echo", schedule_kind=ScheduleKind.MANUAL))
    statements: list[int] = []
    trigger_now = control._firing.trigger_now

    async def counted(requests: Any) -> Any:
        statements.append(len(requests))
        return await trigger_now(requests)

    monkeypatch.setattr(control._firing, "trigger_now", counted)
    runs = await asyncio.gather(*(control.trigger_job(job.id) for _ in range(100)))
    assert len({run.run_id for [run] in runs}) == 100
    assert sum(statements) == 100
    # The first call goes alone; the rest queue up behind it and share at most a few statements.
    assert len(statements) <= 5, statements


def _held_statements(control: Control, monkeypatch: pytest.MonkeyPatch) -> tuple[list[int], list[asyncio.Event]]:
    """Each trigger statement's size, each statement held until its event is set (made as it starts)."""
    sizes: list[int] = []
    releases: list[asyncio.Event] = []
    trigger_now = control._firing.trigger_now

    async def held(requests: Any) -> Any:
        sizes.append(len(requests))
        releases.append(release := asyncio.Event())
        await release.wait()
        return await trigger_now(requests)

    monkeypatch.setattr(control._firing, "trigger_now", held)
    return sizes, releases


async def _until(predicate: Callable[[], bool]) -> None:
    async def check() -> bool:
        return predicate()

    await eventually(check, interval=0.01)


async def test_under_load_a_batch_waits_for_the_calls_that_keep_coming(
    control: Control, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a batch of GATHER_AFTER or more, the next one waits up to `gather` (long here, so the
    test need not race it) and takes the calls that came meanwhile; after a small one it does not."""
    job = await control.create_job(JobSpec(name="gathered", handler="test.echo", schedule_kind=ScheduleKind.MANUAL))
    control._triggers = TriggerBatcher(control._firing, control._dispatch, gather=timedelta(seconds=30))
    sizes, releases = _held_statements(control, monkeypatch)

    async def statements(count: int) -> None:
        await _until(lambda: len(sizes) >= count)

    first = [asyncio.create_task(control.trigger_job(job.id))]
    await statements(1)  # a lone call goes at once
    second = [asyncio.create_task(control.trigger_job(job.id)) for _ in range(GATHER_AFTER)]
    await _until(lambda: len(control._triggers._pending) == GATHER_AFTER)
    releases[0].set()
    await asyncio.gather(*first)
    await statements(2)  # after a batch of one, no wait: the next starts with what is queued
    third = [asyncio.create_task(control.trigger_job(job.id)) for _ in range(2)]
    await _until(lambda: len(control._triggers._pending) == 2)
    releases[1].set()
    await asyncio.gather(*second)
    fourth = [asyncio.create_task(control.trigger_job(job.id)) for _ in range(3)]
    await _until(lambda: len(control._triggers._pending) == 5)
    assert sizes == [1, GATHER_AFTER], "after a batch of GATHER_AFTER, the next waits for more"
    control._triggers._gather_ended()  # as the timer would, 30 s from now
    await statements(3)
    releases[2].set()
    runs = await asyncio.gather(*third, *fourth)
    assert sizes == [1, GATHER_AFTER, 5]
    assert len({run.run_id for [run] in runs}) == 5


async def test_a_sequential_caller_never_waits_for_company(control: Control) -> None:
    """Calls one after another are batches of one: none waits (here the wait would be 30 s)."""
    job = await control.create_job(JobSpec(name="alone", handler="test.echo", schedule_kind=ScheduleKind.MANUAL))
    control._triggers = TriggerBatcher(control._firing, control._dispatch, gather=timedelta(seconds=30))
    async with asyncio.timeout(10):
        runs = [await control.trigger_job(job.id) for _ in range(20)]
    assert len({run.run_id for [run] in runs}) == 20


async def test_a_trigger_that_collides_with_a_run_at_its_slot_retries_with_another(control: Control) -> None:
    job = await control.create_job(JobSpec(name="collides", handler="test.echo", schedule_kind=ScheduleKind.MANUAL))
    taken = datetime.now(UTC) + timedelta(seconds=1)
    [other] = await control._firing.trigger(job.id, Trigger.MANUAL, [taken])
    # The batcher's next slot is `taken`, as another server process may have used it already.
    control._triggers._last_slot = taken - timedelta(microseconds=1)
    execution = await control.trigger_execution(job.id)
    assert execution.run_id != other.run_id
    assert execution.scheduled_for > taken


class _FrozenClock(datetime):
    """A clock stuck at one microsecond (`now` only)."""

    instant = datetime(2030, 1, 1, 12, 0, tzinfo=UTC)

    @classmethod
    def now(cls, tz: Any = None) -> Any:
        return cls.instant


async def test_triggers_in_the_same_microsecond_each_create_their_own_run(
    control: Control, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Manual runs are keyed by their trigger time: two in one microsecond collided ("job not found")."""
    job = await control.create_job(JobSpec(name="same-us", handler="test.echo", schedule_kind=ScheduleKind.MANUAL))
    monkeypatch.setattr("scheduler_grpc.control.datetime", _FrozenClock)
    monkeypatch.setattr("scheduler_grpc.trigger_batch.datetime", _FrozenClock)
    first = await control.trigger_execution(job.id)
    second = await control.trigger_execution(job.id)
    together = await asyncio.gather(*(control.trigger_execution(job.id) for _ in range(10)))
    assert len({e.run_id for e in [first, second, *together]}) == 12


async def test_a_job_deleted_under_a_batch_fails_only_its_own_trigger(control: Control) -> None:
    """The batch's INSERT reads a job that a concurrent transaction deletes: the foreign key fails
    the whole statement, which runs again one request at a time, so only that trigger fails."""
    good = await control.create_job(JobSpec(name="stays", handler="test.echo", schedule_kind=ScheduleKind.MANUAL))
    doomed = await control.create_job(JobSpec(name="goes", handler="test.echo", schedule_kind=ScheduleKind.MANUAL))
    pool = control._pool
    async with pool.acquire() as deleter:
        deletion = deleter.transaction()
        await deletion.start()
        await deleter.execute("DELETE FROM jobs WHERE id = $1", uuid.UUID(doomed.id))
        # The first MAX_IN_FLIGHT calls go alone; the next ones form one batch whose foreign-key
        # check waits for the deleting transaction (the statement's snapshot still sees the job).
        calls = asyncio.gather(
            *(control.trigger_job(good.id) for _ in range(MAX_IN_FLIGHT)),
            control.trigger_job(doomed.id),
            *(control.trigger_job(good.id) for _ in range(5)),
            return_exceptions=True,
        )
        try:
            await eventually(
                lambda: pool.fetchval(
                    "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE '%unnest%'"
                ),
                within=30,
                interval=0.01,
            )
        finally:
            await deletion.commit()
        answers = await calls
    assert isinstance(answers[MAX_IN_FLIGHT], NotFound), answers
    others = answers[:MAX_IN_FLIGHT] + answers[MAX_IN_FLIGHT + 1 :]
    assert all(isinstance(answer, list) and len(answer) == 1 for answer in others), answers


async def test_concurrent_triggers_with_one_request_id_share_one_run(control: Control) -> None:
    """The first calls run in concurrent batches (one may meet the other's uncommitted row and retry)."""
    job = await control.create_job(JobSpec(name="once", handler="test.echo", schedule_kind=ScheduleKind.MANUAL))
    answers = await asyncio.gather(*(control.trigger_execution(job.id, request_id="same") for _ in range(10)))
    assert len({answer.id for answer in answers}) == 1
    assert len(await control._history.history(job.id)) == 1


async def test_a_trigger_whose_enqueue_fails_after_the_commit_returns_its_run(
    api: Harness,  # noqa: F811
    redis: Redis,
    roles: Roles,
) -> None:
    """Issue 19, defect 10: the run is committed, so the caller gets it (a failure would invite a
    retry that runs the job twice); the leader's reconcile enqueues it once Redis takes it."""
    job = (await api.jobs.CreateJob(jobs_pb2.CreateJobRequest(job=echo_job()), metadata=api.admin)).job
    # The enqueue script, and only it, now fails at its first command (WRONGTYPE), writing nothing.
    known = QueueKeys("default").priority
    await redis.set(known, "not a hash")
    deferred = metrics.ENQUEUE_DEFERRED._value.get()
    run = (await api.jobs.TriggerJob(jobs_pb2.TriggerJobRequest(id=job.id), metadata=api.operator)).execution
    assert run.state == executions_pb2.EXECUTION_STATE_QUEUED
    assert metrics.ENQUEUE_DEFERRED._value.get() == deferred + 1
    await redis.delete(known)
    assert await Queue(redis, "default").states([run.id]) == {run.id: None}  # Redis does not know it
    roles.start("scheduler")
    roles.start("worker")

    async def succeeded() -> bool:
        got = await api.executions.GetExecution(executions_pb2.GetExecutionRequest(id=run.id), metadata=api.viewer)
        return got.execution.state == executions_pb2.EXECUTION_STATE_SUCCEEDED

    await eventually(succeeded, within=30, interval=0.2)
