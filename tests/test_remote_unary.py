"""Remote workers' unary fallback (issue 23): `OpenWorkerSession` / `PollWorkerSession` /
`CloseWorkerSession` served by a real server on the test stores, with the Python SDK's
`Worker(transport="unary")` or raw calls; every count is read from PostgreSQL."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import asyncpg
import grpc
import pytest
import redis.asyncio as aioredis
from google.protobuf import duration_pb2
from scheduler_client.v1 import workers_pb2, workers_pb2_grpc
from scheduler_client.worker import ExecutionContext, Worker

from scheduler_grpc.auth import Role
from scheduler_grpc.connections import redis_client
from scheduler_grpc.control import Control
from scheduler_grpc.handlers import HandlerSettings, default_registry
from scheduler_grpc.remote.unary import UnarySessions
from scheduler_grpc.server import serve
from tests.engine_helpers import eventually, make_settings
from tests.test_api_support import FAST_HASHER
from tests.test_remote_workers import Declared, Deployment, hello, sdk_worker, serving
from tests.test_remote_workers import deployment as deployment  # noqa: PLC0414 (the fixture, shared)

# The drain's size: 500 keeps the tier fast; `SCHEDULER_TEST_DRAIN_RUNS=10000` for the figure.
DRAIN_RUNS = int(os.environ.get("SCHEDULER_TEST_DRAIN_RUNS") or 500)


def unary_worker(deployment: Deployment, **kwargs: Any) -> Worker:
    return sdk_worker(deployment, transport="unary", **kwargs)


def sessions(deployment: Deployment) -> UnarySessions:
    remote = deployment.server.api.remote
    assert remote is not None
    return remote.unary


def seconds(value: float) -> duration_pb2.Duration:
    message = duration_pb2.Duration()
    message.FromNanoseconds(int(value * 1e9))
    return message


class RawSession:
    """A unary session driven call by call."""

    def __init__(self, channel: grpc.aio.Channel, key: str) -> None:
        self.stub = workers_pb2_grpc.WorkerServiceStub(channel)
        self.metadata = (("authorization", f"Bearer {key}"),)
        self.id = ""

    async def open(self, message: workers_pb2.Hello | None = None) -> workers_pb2.OpenWorkerSessionResponse:
        opened = await self.stub.OpenWorkerSession(
            workers_pb2.OpenWorkerSessionRequest(hello=message or hello()), metadata=self.metadata
        )
        self.id = opened.session_id
        return opened

    async def poll(
        self, *, wait: float = 0.0, credit: int = 0, acks: Sequence[workers_pb2.Assignment] = (),
        outcomes: Sequence[workers_pb2.Outcome] = (), session_id: str | None = None,
    ) -> list[workers_pb2.ConnectResponse]:  # fmt: skip
        """One poll's messages, several assignments in one (`assignments`) one by one."""
        batch = workers_pb2.RequestBatch(
            acks=[workers_pb2.Ack(execution_id=a.execution_id, claim_token=a.claim_token) for a in acks],
            outcomes=outcomes, credit=credit,
        )  # fmt: skip
        request = workers_pb2.PollWorkerSessionRequest(
            session_id=self.id if session_id is None else session_id, batch=batch
        )
        if wait:
            request.wait.CopyFrom(seconds(wait))
        answer = await self.stub.PollWorkerSession(request, metadata=self.metadata)
        found: list[workers_pb2.ConnectResponse] = []
        for message in answer.messages:
            if message.WhichOneof("message") == "assignments":
                found.extend(workers_pb2.ConnectResponse(assignment=a) for a in message.assignments.assignments)
            else:
                found.append(message)
        return found

    async def close(self) -> None:
        await self.stub.CloseWorkerSession(
            workers_pb2.CloseWorkerSessionRequest(session_id=self.id), metadata=self.metadata
        )

    async def refused(self, code: grpc.StatusCode, **poll: Any) -> str:
        """The details of a poll refused with `code`."""
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await self.poll(**poll)
        assert caught.value.code() == code, caught.value.details()
        return caught.value.details() or ""


async def raw_session(deployment: Deployment, channel: grpc.aio.Channel) -> RawSession:
    return RawSession(channel, deployment.worker_key)


@pytest.fixture
async def channel(deployment: Deployment) -> AsyncIterator[grpc.aio.Channel]:
    async with grpc.aio.insecure_channel(deployment.target) as opened:
        yield opened


def of_kind(messages: list[workers_pb2.ConnectResponse], kind: str) -> list[Any]:
    return [getattr(m, kind) for m in messages if m.WhichOneof("message") == kind]


def outcome(assignment: workers_pb2.Assignment, value: str = "done", token: str | None = None) -> workers_pb2.Outcome:
    message = workers_pb2.Outcome(execution_id=assignment.execution_id, claim_token=token or assignment.claim_token)
    message.value.string_value = value
    return message


# -- the SDK ---------------------------------------------------------------------------------------


async def test_a_unary_sdk_worker_drains_runs_each_succeeding_exactly_once(deployment: Deployment) -> None:
    sent = {"n": 5, "nested": [1, {"b": True}]}
    runs = await deployment.runs(DRAIN_RUNS, payload=sent)
    worker = unary_worker(deployment, slots=32)
    seen: list[str] = []

    @worker.handler("remote.noop")
    async def noop(ctx: ExecutionContext, payload: dict[str, Any]) -> Any:
        assert payload == sent
        seen.append(ctx.execution_id)
        return {"attempt": ctx.attempt}

    began = time.monotonic()
    async with serving(worker):
        assert len(sessions(deployment)) == 1  # served by polls, not a stream
        assert not worker.draining.is_set()

        async def drained() -> bool:
            return (await deployment.counts(runs)).get("succeeded", 0) == len(runs)

        await eventually(drained, within=60, interval=0.2)
    took = time.monotonic() - began
    print(f"unary drain: {len(runs)} runs in {took:.2f}s, {len(runs) / took:.0f} runs/s")
    assert await deployment.counts(runs) == {"succeeded": len(runs)}  # one attempt each
    assert len(seen) == len(set(seen)) == len(runs)
    assert worker.stats.connects == 1
    results = await deployment.pool.fetchval(
        "SELECT count(*) FROM job_executions WHERE run_id = ANY($1::uuid[]) AND result = '{\"attempt\": 1}'", runs
    )
    assert results == len(runs)
    assert len(sessions(deployment)) == 0  # `stop()` closed the session


async def test_a_cancel_reaches_the_unary_sdk_handler_within_a_second(deployment: Deployment) -> None:
    (run_id,) = await deployment.runs(1)
    worker = unary_worker(deployment, slots=2)
    started, stopped = asyncio.Event(), asyncio.Event()
    cancelled_at: list[float] = []

    @worker.handler("remote.noop")
    async def wait_forever(ctx: ExecutionContext, payload: dict[str, Any]) -> Any:
        started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled_at.append(time.monotonic())
            assert ctx.cancelled.is_set()
            stopped.set()
            raise

    async with serving(worker):
        async with asyncio.timeout(10):
            await started.wait()
        asked = time.monotonic()
        await deployment.server.api.control.cancel_execution(run_id)  # a long poll is waiting: it answers
        async with asyncio.timeout(5):
            await stopped.wait()
        assert cancelled_at[0] - asked < 1.0

        async def recorded() -> bool:
            return await deployment.counts([run_id]) == {"cancelled": 1}

        await eventually(recorded, within=10)
    assert worker.stats.cancelled == 1


@pytest.mark.parametrize("deployment", [{"SCHEDULER_REMOTE_POLL_TIMEOUT": "500ms"}], indirect=True)
async def test_a_poll_the_server_process_does_not_hold_makes_the_sdk_open_a_new_session(
    deployment: Deployment,
) -> None:
    """What a load balancer sending a poll to another server process looks like to the SDK."""
    worker = unary_worker(deployment, slots=2, poll_wait=0.2)

    @worker.handler("remote.noop")
    async def noop(ctx: ExecutionContext, payload: dict[str, Any]) -> Any:
        return ctx.attempt

    async with serving(worker):
        held = sessions(deployment)
        first = worker.worker_id
        held._held.clear()  # as if the next poll reached a process that never held the session
        await eventually(lambda: _true(worker.stats.connects == 2), within=10, interval=0.05)
        assert worker.worker_id != first
        runs = await deployment.runs(3)

        async def drained() -> bool:
            return await deployment.counts(runs) == {"succeeded": 3}

        await eventually(drained, within=30)


async def _true(value: bool) -> bool:
    return value


# -- the protocol, call by call --------------------------------------------------------------------


async def test_unary_assignments_never_exceed_credit_and_unacknowledged_ones_go_back_unspent(
    deployment: Deployment, channel: grpc.aio.Channel
) -> None:
    runs = await deployment.runs(30)
    session = await raw_session(deployment, channel)
    opened = await session.open(hello(slots=10))
    assert opened.welcome.worker_id.startswith("remote:")
    assert opened.welcome.ack_timeout.seconds == 1
    assert not opened.welcome.HasField("ping_interval")  # no pings: the polls are the liveness
    assert opened.max_wait.seconds == 20
    assert len(opened.session_id) >= 32
    assigned: dict[str, workers_pb2.Assignment] = {}
    cancelled: set[str] = set()
    # Nothing acknowledged: each goes back after the ack timeout, with a cancel; no eleventh
    # assignment comes (the credit is spent).
    messages = await session.poll(credit=10, wait=5)
    while True:
        for each in of_kind(messages, "assignment"):
            assert each.execution_id not in assigned
            assigned[each.execution_id] = each
        cancelled.update(c.execution_id for c in of_kind(messages, "cancel"))
        if len(cancelled) == 10:
            break
        messages = await session.poll(wait=5)
    assert len(assigned) == 10
    assert cancelled == set(assigned)

    async def handed_back() -> bool:
        return await deployment.counts(runs) == {"queued": 30}

    await eventually(handed_back, within=10)
    assert await deployment.attempts(runs) == 1  # no attempt spent
    assert of_kind(await session.poll(), "assignment") == []
    # A grant over the slots ends the session with INVALID_ARGUMENT naming the field; its next poll
    # is told the same.
    details = await session.refused(grpc.StatusCode.INVALID_ARGUMENT, credit=11)
    assert details.startswith("batch.credit: 11 more would make 11")
    assert await session.refused(grpc.StatusCode.INVALID_ARGUMENT) == details


async def test_acks_and_outcomes_over_polls_record_the_runs(deployment: Deployment, channel: grpc.aio.Channel) -> None:
    runs = await deployment.runs(2)
    session = await raw_session(deployment, channel)
    await session.open(hello(slots=2))
    found = of_kind(await session.poll(credit=2, wait=5), "assignment")
    while len(found) < 2:
        found += of_kind(await session.poll(wait=5), "assignment")
    first, second = found
    await session.poll(acks=found)
    rows = await deployment.pool.fetch("SELECT status FROM job_executions WHERE run_id = ANY($1::uuid[])", runs)
    assert {row["status"] for row in rows} == {"running"}
    # Unknown execution id, foreign claim token: refused in the answer, the session goes on.
    stranger = workers_pb2.Assignment(execution_id="0190a5f0-0000-7000-8000-000000000000", claim_token="x")
    answer = await session.poll(outcomes=[outcome(stranger), outcome(first, token="not-the-token")], wait=5)
    refused = of_kind(answer, "rejected")
    assert [(r.code, r.field) for r in refused] == [
        ("NOT_FOUND", "outcome.execution_id"), ("FAILED_PRECONDITION", "outcome.claim_token")
    ]  # fmt: skip
    await session.poll(outcomes=[outcome(first), outcome(second)])

    async def recorded() -> bool:
        return await deployment.counts(runs) == {"succeeded": 2}

    await eventually(recorded, within=10)
    await session.close()
    assert len(sessions(deployment)) == 0
    details = await session.refused(grpc.StatusCode.NOT_FOUND)
    assert details.startswith("session_id: ")


@pytest.mark.parametrize(
    "deployment", [{"SCHEDULER_REMOTE_POLL_TIMEOUT": "300ms", "SCHEDULER_REMOTE_ACK_TIMEOUT": "60s"}], indirect=True
)
async def test_a_session_whose_worker_stops_polling_is_ended_and_its_runs_parked_or_handed_back(
    deployment: Deployment, channel: grpc.aio.Channel
) -> None:
    await deployment.runs(3)
    session = await raw_session(deployment, channel)
    opened = await session.open(hello(slots=3))
    assert opened.poll_timeout.ToMilliseconds() == 300
    found = of_kind(await session.poll(credit=3, wait=5), "assignment")
    while len(found) < 3:
        found += of_kind(await session.poll(wait=5), "assignment")
    acked, unacked = found[:2], found[2]
    await session.poll(acks=acked)
    stopped = time.monotonic()  # no poll from here on

    async def handed_back() -> bool:
        rows = await deployment.pool.fetch(
            "SELECT id::text, status, attempt FROM job_executions WHERE id = ANY($1::uuid[])",
            [a.execution_id for a in found],
        )
        return {row["id"]: (row["status"], row["attempt"]) for row in rows} == {
            # Parked, as at a stream's end: a new session may resume them until their leases expire.
            acked[0].execution_id: ("running", 1),
            acked[1].execution_id: ("running", 1),
            unacked.execution_id: ("queued", 1),  # unspent: the same attempt, queued again
        }

    await eventually(handed_back, within=10, interval=0.05)
    assert time.monotonic() - stopped < 5  # well within its 60 s ack timeout: the session's end
    details = await session.refused(grpc.StatusCode.ABORTED)
    assert details == "no poll for 300ms: the session is ended; open a new one"
    # Forgotten after a while: then like a session another process holds.
    await eventually(lambda: _true(len(sessions(deployment)) == 0), within=10, interval=0.05)
    assert (await session.refused(grpc.StatusCode.NOT_FOUND)).startswith("session_id: ")


async def test_bad_unary_calls_get_clear_errors_naming_the_field(
    deployment: Deployment, channel: grpc.aio.Channel
) -> None:
    session = await raw_session(deployment, channel)
    # No session id; one no process holds; a wait over the server's most.
    assert (await session.refused(grpc.StatusCode.INVALID_ARGUMENT)).startswith("session_id: required")
    unknown = await session.refused(grpc.StatusCode.NOT_FOUND, session_id="no-such-session")
    assert unknown == (
        "session_id: the session 'no-such-session' is not held by this server process (another process "
        "opened it, or it ended); open a new one"
    )
    await session.open()
    details = await session.refused(grpc.StatusCode.INVALID_ARGUMENT, wait=21)
    assert details == "wait: must be between 0 and 20s"
    # Another worker key may not use this key's session (nor learn that it exists).
    other = RawSession(channel, await deployment.key(Role.WORKER))
    assert (await other.refused(grpc.StatusCode.NOT_FOUND, session_id=session.id)).startswith("session_id: ")
    # A bad hello: named as on a stream.
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await other.open(hello(names=("remote.noop", "Not A Name")))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (caught.value.details() or "").startswith("hello.handlers[1].name:")
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await other.stub.OpenWorkerSession(workers_pb2.OpenWorkerSessionRequest(), metadata=other.metadata)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (caught.value.details() or "").startswith("hello: required")
    # A malformed outcome ends that session only, naming the poll's field.
    runs = await deployment.runs(1)
    await other.open(hello(slots=1))
    bad = workers_pb2.Outcome(execution_id="x", claim_token="y")
    bad.error.retry_after.seconds = 7200
    details = await session.refused(grpc.StatusCode.INVALID_ARGUMENT, outcomes=[bad])
    assert details == "batch.outcomes[0].error.retry_after: must be between 0 and 1h"
    found = of_kind(await other.poll(credit=1, wait=5), "assignment")
    while not found:
        found = of_kind(await other.poll(wait=5), "assignment")
    assert found[0].run_id == runs[0]
    await other.poll(acks=found, outcomes=[outcome(found[0])])
    await other.close()


async def test_only_worker_keys_may_use_unary_sessions(deployment: Deployment, channel: grpc.aio.Channel) -> None:
    for role in (Role.VIEWER, Role.OPERATOR, Role.ADMIN):
        session = RawSession(channel, await deployment.key(role))
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await session.open()
        assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED, role
        await session.refused(grpc.StatusCode.PERMISSION_DENIED, session_id="x")
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await session.stub.CloseWorkerSession(
                workers_pb2.CloseWorkerSessionRequest(session_id="x"), metadata=session.metadata
            )
        assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED, role


async def test_a_server_stopping_drains_its_unary_sessions_and_records_their_outcomes(
    redis_url: str, database_url: str, pool: asyncpg.Pool, redis: aioredis.Redis
) -> None:
    settings = make_settings(
        redis_url, database_url, SCHEDULER_GRPC_PORT="0", SCHEDULER_HTTP_ENABLED="false",
        SCHEDULER_SHUTDOWN_GRACE="10s",
    )  # fmt: skip
    client = redis_client(redis_url)
    registry = default_registry(HandlerSettings())
    registry.register(Declared())
    release = asyncio.Event()
    try:
        server = serve(settings, client, pool, hasher=FAST_HASHER)
        running = await server.__aenter__()
        stopped = False
        try:
            deployment = Deployment(running, Control(redis, pool, registry), pool, redis, "")
            deployment.worker_key = await deployment.key(Role.WORKER)
            runs = await deployment.runs(3)
            worker = unary_worker(deployment, slots=3, reconnect_max=30.0)
            started: list[str] = []

            @worker.handler("remote.noop")
            async def slow(ctx: ExecutionContext, payload: dict[str, Any]) -> Any:
                started.append(ctx.execution_id)
                await release.wait()
                return "done"

            task = asyncio.create_task(worker.run())
            await eventually(lambda: _true(len(started) == 3), within=10)
            stopping = asyncio.create_task(server.__aexit__(None, None, None))
            stopped = True
            async with asyncio.timeout(10):
                await worker.draining.wait()  # told in a poll's answer before the server stops
            release.set()  # the handlers finish within the grace: their outcomes are recorded
            async with asyncio.timeout(20):
                await stopping
            worker.stop()
            async with asyncio.timeout(10):
                await task
            assert await deployment.counts(runs) == {"succeeded": 3}
            assert len(sessions(deployment)) == 0
        finally:
            if not stopped:
                await server.__aexit__(None, None, None)
    finally:
        await registry.aclose()
        await client.aclose()
