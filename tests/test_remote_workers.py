"""Remote workers (issue 23): `WorkerService.Connect` served by a real server on the test stores,
with the Python SDK's `Worker` or a raw stream client; every count is read from PostgreSQL."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, ClassVar

import asyncpg
import grpc
import pytest
import redis.asyncio as aioredis
import scheduler_client
from grpc_health.v1 import health_pb2, health_pb2_grpc
from scheduler_client.v1 import cluster_pb2, cluster_pb2_grpc, jobs_pb2, jobs_pb2_grpc, workers_pb2
from scheduler_client.worker import ExecutionContext, Worker

from chaos.proxy import FaultProxy
from scheduler_grpc import metrics
from scheduler_grpc.auth import METHOD_ROLES, Principal, Role, required_role
from scheduler_grpc.connections import redis_client
from scheduler_grpc.control import Control
from scheduler_grpc.db.firing import FiringRepository
from scheduler_grpc.dispatch import Queues, enqueue_runs
from scheduler_grpc.errors import InvalidArgument
from scheduler_grpc.executions import Trigger
from scheduler_grpc.handlers import ExecutionContext as ServerContext
from scheduler_grpc.handlers import Handler, HandlerSettings, JSONValue, default_registry
from scheduler_grpc.jobs import JobSpec, RetryPolicy
from scheduler_grpc.limits import LimitKind, LimitRef, LimitSpec
from scheduler_grpc.queue import Queue
from scheduler_grpc.remote import Session
from scheduler_grpc.server import RunningServer, serve
from tests.api_helpers import free_port
from tests.conftest import ROOT
from tests.engine_helpers import Role as RoleProcess
from tests.engine_helpers import eventually, make_settings
from tests.test_api_server import make_certificates
from tests.test_api_support import FAST_HASHER

QUEUE = "remote"
# The drain's size: 2,000 keeps the tier fast; `SCHEDULER_TEST_DRAIN_RUNS=10000` for the figure.
DRAIN_RUNS = int(os.environ.get("SCHEDULER_TEST_DRAIN_RUNS") or 2000)
CONNECT = "/scheduler.v1.WorkerService/Connect"


class Declared(Handler):
    """Only so that jobs can name `remote.noop` (the API's registry validates job handlers)."""

    name: ClassVar[str] = "remote.noop"
    description: ClassVar[str] = "served by remote workers"
    extra_fields: ClassVar[bool] = True

    async def run(self, ctx: ServerContext, payload: dict[str, Any]) -> JSONValue:
        raise AssertionError("never run in-process")


@dataclass
class Deployment:
    server: RunningServer
    control: Control
    pool: asyncpg.Pool
    redis: aioredis.Redis
    worker_key: str

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.server.port}"

    async def key(self, role: Role) -> str:
        creator = Principal("test", Role.ADMIN, "api_key", "test", b"")
        return (await self.server.api.auth.create_api_key(creator, f"{role.value}-key", role, None)).secret

    async def runs(
        self, count: int, *, job_timeout: timedelta = timedelta(minutes=5), retries: int = 0,
        payload: dict[str, Any] | None = None,
    ) -> list[str]:  # fmt: skip
        """`count` runs of one job of `remote.noop` on the remote queue, enqueued; their run ids."""
        job = await self.control.create_job(JobSpec(
            name=f"remote-{time.monotonic_ns()}", handler="remote.noop", queue=QUEUE, timeout=job_timeout,
            retry=RetryPolicy(max_retries=retries), payload=payload or {},
        ))  # fmt: skip
        base = datetime(2020, 1, 1, tzinfo=UTC)
        ids: list[str] = []
        queues = Queues(self.redis)
        for start in range(0, count, 1000):
            slots = [base + timedelta(microseconds=i) for i in range(start, min(start + 1000, count))]
            made = await FiringRepository(self.pool).trigger(job.id, Trigger.BACKFILL, slots)
            await enqueue_runs(queues, made)
            ids.extend(run.run_id for run in made)
        return ids

    async def counts(self, run_ids: list[str]) -> dict[str, int]:
        rows = await self.pool.fetch(
            "SELECT status, count(*) AS n FROM job_executions WHERE run_id = ANY($1::uuid[]) GROUP BY status",
            run_ids,
        )
        return {row["status"]: row["n"] for row in rows}

    async def attempts(self, run_ids: list[str]) -> int:
        return int(await self.pool.fetchval(
            "SELECT max(attempt) FROM job_executions WHERE run_id = ANY($1::uuid[])", run_ids
        ))  # fmt: skip


@pytest.fixture
async def deployment(
    request: pytest.FixtureRequest, redis_url: str, database_url: str, pool: asyncpg.Pool, redis: aioredis.Redis
) -> AsyncIterator[Deployment]:
    """A server on the test stores (settings overridden by an indirect parameter), a worker key."""
    env = {
        "SCHEDULER_REMOTE_ACK_TIMEOUT": "1s", "SCHEDULER_VISIBILITY_TIMEOUT": "5s", "SCHEDULER_SHUTDOWN_GRACE": "2s",
        **getattr(request, "param", {}),
    }  # fmt: skip
    settings = make_settings(redis_url, database_url, SCHEDULER_GRPC_PORT="0", SCHEDULER_HTTP_ENABLED="false", **env)
    client = redis_client(redis_url)
    registry = default_registry(HandlerSettings())
    registry.register(Declared())
    try:
        async with serve(settings, client, pool, hasher=FAST_HASHER) as running:
            deployment = Deployment(running, Control(redis, pool, registry), pool, redis, "")
            deployment.worker_key = await deployment.key(Role.WORKER)
            yield deployment
    finally:
        await registry.aclose()
        await client.aclose()


@contextlib.asynccontextmanager
async def serving(worker: Worker) -> AsyncIterator[asyncio.Task[None]]:
    task = asyncio.create_task(worker.run())
    try:
        async with asyncio.timeout(10):
            await worker.connected.wait()
        yield task
    finally:
        worker.stop()
        with contextlib.suppress(Exception):
            async with asyncio.timeout(15):
                await task
        if not task.done():
            task.cancel()


def sdk_worker(deployment: Deployment, **kwargs: Any) -> Worker:
    return Worker(deployment.target, deployment.worker_key, queue=QUEUE, **{"reconnect_max": 1.0, **kwargs})


async def test_the_python_sdk_drains_runs_each_succeeding_exactly_once(deployment: Deployment) -> None:
    sent = {"n": 5, "f": 1.5, "s": "x", "nested": [1, {"b": True, "none": None}]}
    runs = await deployment.runs(DRAIN_RUNS, payload=sent)
    worker = sdk_worker(deployment, slots=64)
    seen: list[str] = []

    @worker.handler("remote.noop", description="does nothing")
    async def noop(ctx: ExecutionContext, payload: dict[str, Any]) -> Any:
        assert payload == sent  # integral numbers stay ints
        seen.append(ctx.execution_id)
        return {"attempt": ctx.attempt}

    began = time.monotonic()
    async with serving(worker):

        async def drained() -> bool:
            return (await deployment.counts(runs)).get("succeeded", 0) == len(runs)

        await eventually(drained, within=120, interval=0.2)
    seconds = time.monotonic() - began
    print(f"remote drain: {len(runs)} runs in {seconds:.2f}s, {len(runs) / seconds:.0f} runs/s")
    assert await deployment.counts(runs) == {"succeeded": len(runs)}  # one attempt each, all succeeded
    assert len(seen) == len(set(seen)) == len(runs)  # each execution handed to the handler once
    results = await deployment.pool.fetchval(
        "SELECT count(*) FROM job_executions WHERE run_id = ANY($1::uuid[]) AND result = '{\"attempt\": 1}'", runs
    )
    assert results == len(runs)


def test_the_sdk_reads_a_payload_as_json_with_integral_numbers_as_ints() -> None:
    from google.protobuf import struct_pb2
    from google.protobuf.json_format import MessageToDict
    from scheduler_client.worker import _json

    sent = {"n": 5, "neg": -3, "big": 2.0**60, "f": 1.5, "s": "x", "t": True, "none": None, "empty": {}, "list": [],
            "nested": [1, {"b": False, "deep": [[2.5, "y"]]}]}  # fmt: skip
    payload = struct_pb2.Struct()
    payload.update(sent)
    read = {key: _json(value) for key, value in payload.fields.items()}
    assert read == sent
    assert isinstance(read["n"], int)
    assert isinstance(read["big"], float)  # beyond 2**53: not exact as an int, left a float
    assert read == MessageToDict(payload)  # the same JSON the generic conversion gives


# -- a raw stream client ---------------------------------------------------------------------------


class RawStream:
    """A `Connect` stream driven message by message."""

    def __init__(self, channel: grpc.aio.Channel, key: str) -> None:
        self._requests: asyncio.Queue[workers_pb2.ConnectRequest | None] = asyncio.Queue()
        self._buffered: list[workers_pb2.ConnectResponse] = []
        method = channel.stream_stream(
            CONNECT,
            request_serializer=workers_pb2.ConnectRequest.SerializeToString,
            response_deserializer=workers_pb2.ConnectResponse.FromString,
        )
        self.call = method(self._outgoing(), metadata=(("authorization", f"Bearer {key}"),))

    async def _outgoing(self) -> AsyncIterator[workers_pb2.ConnectRequest]:
        while (request := await self._requests.get()) is not None:
            yield request

    def send(self, **message: Any) -> None:
        self._requests.put_nowait(workers_pb2.ConnectRequest(**message))

    def close(self) -> None:
        self._requests.put_nowait(None)

    async def receive(self, within: float = 10.0) -> workers_pb2.ConnectResponse:
        """The next message; several assignments in one (`assignments`) come one by one."""
        if self._buffered:
            return self._buffered.pop(0)
        async with asyncio.timeout(within):
            response = await self.call.read()
        assert response is not grpc.aio.EOF, "the stream ended"
        assert isinstance(response, workers_pb2.ConnectResponse)
        if response.WhichOneof("message") == "assignments":
            self._buffered = [workers_pb2.ConnectResponse(assignment=each) for each in response.assignments.assignments]
            return self._buffered.pop(0)
        return response

    async def rest(self, within: float = 10.0) -> list[workers_pb2.ConnectResponse]:
        """What comes until the stream ends (pings left out)."""
        found = []
        found.extend(self._buffered)
        async with asyncio.timeout(within):
            while (response := await self.call.read()) is not grpc.aio.EOF:
                assert isinstance(response, workers_pb2.ConnectResponse)
                if response.WhichOneof("message") != "ping":
                    found.append(response)
        return found

    async def receive_kind(self, kind: str, within: float = 10.0) -> workers_pb2.ConnectResponse:
        """The next message of `kind`, answering pings on the way."""
        while True:
            response = await self.receive(within)
            if response.WhichOneof("message") == "ping":
                self.send(pong=workers_pb2.Pong(nonce=response.ping.nonce))
                continue
            assert response.WhichOneof("message") == kind, response
            return response


def hello(slots: int = 10, names: tuple[str, ...] = ("remote.noop",)) -> workers_pb2.Hello:
    return workers_pb2.Hello(
        handlers=[workers_pb2.HandlerInfo(name=name) for name in names], slots=slots, sdk="raw", queue=QUEUE
    )


@contextlib.asynccontextmanager
async def raw(deployment: Deployment, key: str | None = None) -> AsyncIterator[Callable[[], RawStream]]:
    async with grpc.aio.insecure_channel(deployment.target) as channel:
        yield lambda: RawStream(channel, key or deployment.worker_key)


async def test_assignments_never_exceed_credit_and_unacknowledged_ones_go_back_unspent(
    deployment: Deployment,
) -> None:
    runs = await deployment.runs(30)
    async with raw(deployment) as open_stream:
        stream = open_stream()
        stream.send(hello=hello(slots=10))
        welcome = (await stream.receive_kind("welcome")).welcome
        assert welcome.worker_id.startswith("remote:")
        assert welcome.ack_timeout.seconds == 1
        stream.send(credit=workers_pb2.Credit(grant=10))
        assigned = [(await stream.receive_kind("assignment")).assignment for _ in range(10)]
        assert len({a.execution_id for a in assigned}) == 10
        # Nothing acknowledged: each goes back after the ack timeout, with a cancel to the worker;
        # no eleventh assignment comes, whatever the wait (the credit is spent).
        cancels = {(await stream.receive_kind("cancel")).cancel.execution_id for _ in range(10)}
        assert cancels == {a.execution_id for a in assigned}

        async def handed_back() -> bool:
            counts = await deployment.counts(runs)
            return counts == {"queued": 30}

        await eventually(handed_back, within=10)
        assert await deployment.attempts(runs) == 1  # no attempt spent
        stream.close()
        assert await stream.rest() == []  # the server ends the stream: nothing more was assigned
    # Then an SDK worker runs all of them, each once.
    worker = sdk_worker(deployment, slots=8)

    @worker.handler("remote.noop")
    async def noop(ctx: ExecutionContext, payload: dict[str, Any]) -> Any:
        return None

    async with serving(worker):

        async def drained() -> bool:
            return (await deployment.counts(runs)).get("succeeded", 0) == len(runs)

        await eventually(drained, within=30)
    assert await deployment.counts(runs) == {"succeeded": 30}
    assert await deployment.attempts(runs) == 1


async def test_only_the_unacknowledged_assignments_go_back_after_the_ack_timeout(deployment: Deployment) -> None:
    """One timer watches the oldest unacknowledged assignment: acks in any order (the oldest first
    here) leave the others' deadlines as they were, and acknowledged ones stay with the worker."""
    runs = await deployment.runs(6)
    async with raw(deployment) as open_stream:
        stream = open_stream()
        stream.send(hello=hello(slots=6))
        await stream.receive_kind("welcome")
        stream.send(credit=workers_pb2.Credit(grant=6))
        assigned = [(await stream.receive_kind("assignment")).assignment for _ in range(6)]
        acked, unacked = assigned[0::2], assigned[1::2]
        for each in acked:
            stream.send(ack=workers_pb2.Ack(execution_id=each.execution_id, claim_token=each.claim_token))
        cancels = {(await stream.receive_kind("cancel")).cancel.execution_id for _ in range(3)}
        assert cancels == {each.execution_id for each in unacked}
        for each in acked:  # held past the ack timeout, still theirs to report
            stream.send(outcome=workers_pb2.Outcome(execution_id=each.execution_id, claim_token=each.claim_token))

        async def settled() -> bool:
            return await deployment.counts(runs) == {"succeeded": 3, "queued": 3}

        await eventually(settled, within=10)
        assert await deployment.attempts(runs) == 1  # the unacknowledged ones went back unspent
        stream.close()
        await stream.rest()


async def test_an_assignment_unacknowledged_when_its_stream_ends_comes_again_as_the_same_attempt(
    deployment: Deployment,
) -> None:
    """What the SDKs' docs and docs/guarantees.md say: the same execution id may be delivered twice."""
    (run_id,) = await deployment.runs(1)
    async with raw(deployment) as open_stream:
        first = open_stream()
        first.send(hello=hello(slots=1))
        await first.receive_kind("welcome")
        first.send(credit=workers_pb2.Credit(grant=1))
        sent = (await first.receive_kind("assignment")).assignment
        first.close()  # its ack (had it sent one) never reached the server
        await first.rest()
        second = open_stream()
        second.send(hello=hello(slots=1))
        await second.receive_kind("welcome")
        second.send(credit=workers_pb2.Credit(grant=1))
        again = (await second.receive_kind("assignment", within=20)).assignment
        assert (again.run_id, again.execution_id, again.attempt) == (run_id, sent.execution_id, 1)
        second.close()


async def test_a_credit_grant_over_the_slots_ends_that_stream_only(deployment: Deployment) -> None:
    async with raw(deployment) as open_stream:
        good, bad = open_stream(), open_stream()
        for stream in (good, bad):
            stream.send(hello=hello(slots=4))
            await stream.receive_kind("welcome")
        bad.send(credit=workers_pb2.Credit(grant=5))
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await bad.receive_kind("assignment")
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert caught.value.details().startswith("credit.grant:")
        runs = await deployment.runs(1)
        good.send(credit=workers_pb2.Credit(grant=4))
        assignment = (await good.receive_kind("assignment")).assignment
        assert assignment.run_id == runs[0]
        good.close()


# -- the worker role ---------------------------------------------------------------------------------


def test_the_worker_role_serves_runs_only_and_only_it_does() -> None:
    assert Role.WORKER.allows(Role.WORKER)
    for other in (Role.VIEWER, Role.OPERATOR, Role.ADMIN):
        assert not Role.WORKER.allows(other)
        assert not other.allows(Role.WORKER)
    assert required_role(CONNECT) is Role.WORKER
    assert [method for method, role in METHOD_ROLES.items() if role is Role.WORKER] == [
        CONNECT, *(f"/scheduler.v1.WorkerService/{verb}WorkerSession" for verb in ("Open", "Poll", "Close"))
    ]  # fmt: skip


async def test_a_worker_key_connects_and_may_call_nothing_else(deployment: Deployment) -> None:
    async with grpc.aio.insecure_channel(deployment.target) as channel:
        jobs = jobs_pb2_grpc.JobServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await jobs.ListJobs(
                jobs_pb2.ListJobsRequest(), metadata=(("authorization", f"Bearer {deployment.worker_key}"),)
            )
        assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "needs the viewer role (you are worker)" in (caught.value.details() or "")
    for role in (Role.VIEWER, Role.OPERATOR, Role.ADMIN):
        async with raw(deployment, await deployment.key(role)) as open_stream:
            stream = open_stream()
            stream.send(hello=hello())
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stream.receive()
            assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED, role
    async with raw(deployment) as open_stream:
        stream = open_stream()
        stream.send(hello=hello())
        assert (await stream.receive_kind("welcome")).welcome.worker_id.startswith("remote:")
        stream.close()


async def test_a_user_cannot_have_the_worker_role(deployment: Deployment) -> None:
    with pytest.raises(InvalidArgument) as caught:
        await deployment.server.api.control.users.create_user("robot", "a-long-password-1", Role.WORKER)
    assert caught.value.field == "role"


# -- cancels -----------------------------------------------------------------------------------------


async def test_a_cancel_reaches_the_sdk_handler_within_a_second(deployment: Deployment) -> None:
    (run_id,) = await deployment.runs(1)
    worker = sdk_worker(deployment, slots=2)
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
        await deployment.server.api.control.cancel_execution(run_id)
        async with asyncio.timeout(5):
            await stopped.wait()
        assert cancelled_at[0] - asked < 1.0

        async def recorded() -> bool:
            return await deployment.counts([run_id]) == {"cancelled": 1}

        await eventually(recorded, within=10)
    assert worker.stats.cancelled == 1


async def test_the_jobs_timeout_cancels_the_sdk_handler_and_records_the_timeout(deployment: Deployment) -> None:
    (run_id,) = await deployment.runs(1, job_timeout=timedelta(milliseconds=500))
    worker = sdk_worker(deployment, slots=2)
    stopped = asyncio.Event()

    @worker.handler("remote.noop")
    async def wait_forever(ctx: ExecutionContext, payload: dict[str, Any]) -> Any:
        try:
            await asyncio.Event().wait()
        finally:
            stopped.set()

    async with serving(worker):
        async with asyncio.timeout(10):
            await stopped.wait()

        async def recorded() -> bool:
            return await deployment.counts([run_id]) == {"dead": 1}  # timed out, no retries left

        await eventually(recorded, within=10)
    error = await deployment.pool.fetchval("SELECT error FROM job_executions WHERE run_id = $1", run_id)
    assert error.startswith("timed out after 0.5s")


async def test_the_worker_is_told_the_real_reason_of_a_cancel(deployment: Deployment) -> None:
    (timing_out,) = await deployment.runs(1, job_timeout=timedelta(milliseconds=500))
    (cancelled,) = await deployment.runs(1)
    async with raw(deployment) as open_stream:
        stream = open_stream()
        stream.send(hello=hello(slots=2))
        await stream.receive_kind("welcome")
        stream.send(credit=workers_pb2.Credit(grant=2))
        assigned = {}
        for _ in range(2):
            a = (await stream.receive_kind("assignment")).assignment
            stream.send(ack=workers_pb2.Ack(execution_id=a.execution_id, claim_token=a.claim_token))
            assigned[a.run_id] = a.execution_id
        # The job's timeout: "timed out", not "cancelled".
        cancel = (await stream.receive_kind("cancel")).cancel
        assert (cancel.execution_id, cancel.reason) == (assigned[timing_out], "timed out")
        # A cancel request: "cancelled".
        await deployment.server.api.control.cancel_execution(cancelled)
        cancel = (await stream.receive_kind("cancel")).cancel
        assert (cancel.execution_id, cancel.reason) == (assigned[cancelled], "cancelled")
        stream.close()


# -- bad input ---------------------------------------------------------------------------------------


async def test_bad_messages_get_clear_errors_naming_the_field_and_other_streams_go_on(deployment: Deployment) -> None:
    async with raw(deployment) as open_stream:
        # A handler name breaking the naming rule ends that stream before anything is served.
        bad_name = open_stream()
        bad_name.send(hello=hello(names=("remote.noop", "Not A Name")))
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await bad_name.receive()
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert (caught.value.details() or "").startswith("hello.handlers[1].name:")
        # A built-in handler's name: a worker key must not receive its runs' payloads.
        builtin = open_stream()
        builtin.send(hello=hello(names=("http.webhook",)))
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await builtin.receive()
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert (caught.value.details() or "").startswith("hello.handlers[0].name: 'http.webhook' is a built-in")
        # A first message that is not a hello.
        no_hello = open_stream()
        no_hello.send(credit=workers_pb2.Credit(grant=1))
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await no_hello.receive()
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert (caught.value.details() or "").startswith("hello:")

        stream, other = open_stream(), open_stream()
        for each in (stream, other):
            each.send(hello=hello(slots=2))
            await each.receive_kind("welcome")
        runs = await deployment.runs(3)
        stream.send(credit=workers_pb2.Credit(grant=2))
        first, second = [(await stream.receive_kind("assignment")).assignment for _ in range(2)]
        for assignment in (first, second):
            stream.send(ack=workers_pb2.Ack(execution_id=assignment.execution_id, claim_token=assignment.claim_token))

        def outcome(execution_id: str, token: str, value: Any) -> workers_pb2.Outcome:
            message = workers_pb2.Outcome(execution_id=execution_id, claim_token=token)
            message.value.string_value = value
            return message

        # Unknown execution id, foreign claim token: refused, the stream goes on.
        stream.send(outcome=outcome("0190a5f0-0000-7000-8000-000000000000", first.claim_token, "x"))
        rejected = (await stream.receive_kind("rejected")).rejected
        assert (rejected.code, rejected.field) == ("NOT_FOUND", "outcome.execution_id")
        stream.send(outcome=outcome(first.execution_id, "not-the-token", "x"))
        rejected = (await stream.receive_kind("rejected")).rejected
        assert (rejected.code, rejected.field) == ("FAILED_PRECONDITION", "outcome.claim_token")
        # A result over the size limit: refused, and the attempt fails (as in-process).
        stream.send(outcome=outcome(first.execution_id, first.claim_token, "x" * 70_000))
        rejected = (await stream.receive_kind("rejected")).rejected
        assert (rejected.code, rejected.field) == ("INVALID_ARGUMENT", "outcome.value")
        # The right outcome is taken.
        stream.send(outcome=outcome(second.execution_id, second.claim_token, "fine"))

        async def recorded() -> bool:
            statuses = {
                row["id"]: row["status"]
                for row in await deployment.pool.fetch(
                    "SELECT id::text, status FROM job_executions WHERE id = ANY($1::uuid[])",
                    [first.execution_id, second.execution_id],
                )
            }
            return statuses == {first.execution_id: "dead", second.execution_id: "succeeded"}

        await eventually(recorded, within=10)
        # The other stream never noticed.
        other.send(credit=workers_pb2.Credit(grant=1))
        third = (await other.receive_kind("assignment")).assignment
        assert third.run_id in runs
        # A credit over the slots ends this stream with INVALID_ARGUMENT, never INTERNAL.
        stream.send(credit=workers_pb2.Credit(grant=3))
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stream.receive_kind("assignment")
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert (caught.value.details() or "").startswith("credit.grant:")
        other.send(ack=workers_pb2.Ack(execution_id=third.execution_id, claim_token=third.claim_token))
        other.send(outcome=outcome(third.execution_id, third.claim_token, "also fine"))
        other.close()
        assert await other.rest() == []


@pytest.mark.parametrize("deployment", [{"SCHEDULER_REMOTE_HELLO_TIMEOUT": "300ms"}], indirect=True)
async def test_a_stream_that_never_says_hello_is_ended_after_the_hello_timeout(deployment: Deployment) -> None:
    async with raw(deployment) as open_stream:
        silent = open_stream()  # opens the stream, sends nothing
        began = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await silent.receive(within=10)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        expected = "hello: none within 300ms: the first message of a stream must be `hello`"
        assert caught.value.details() == expected
        assert time.monotonic() - began < 5
        # A stream that says hello in time is served as usual.
        stream = open_stream()
        stream.send(hello=hello())
        assert (await stream.receive_kind("welcome")).welcome.worker_id.startswith("remote:")
        stream.close()


async def test_a_server_bug_on_a_message_is_logged_once_and_ends_that_stream_only(
    deployment: Deployment, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(self: Session, nonce: int) -> None:
        raise RuntimeError("a bug in on_pong")

    monkeypatch.setattr(Session, "on_pong", broken)
    async with raw(deployment) as open_stream:
        stream, other = open_stream(), open_stream()
        for each in (stream, other):
            each.send(hello=hello(slots=1))
            await each.receive_kind("welcome")
        with caplog.at_level(logging.ERROR, logger="scheduler_grpc"):
            stream.send(pong=workers_pb2.Pong(nonce=1))
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stream.rest()
        # Not a silent end (OK) and not the worker's fault (INVALID_ARGUMENT): the server's bug.
        assert caught.value.code() == grpc.StatusCode.ABORTED
        assert "failed to handle a message" in (caught.value.details() or "")
        logged = [r for r in caplog.records if r.exc_info and isinstance(r.exc_info[1], RuntimeError)]
        assert len(logged) == 1
        assert str(logged[0].exc_info[1]) == "a bug in on_pong"  # type: ignore[index]
        # The other stream is still served.
        runs = await deployment.runs(1)
        other.send(credit=workers_pb2.Credit(grant=1))
        assert (await other.receive_kind("assignment")).assignment.run_id == runs[0]
        other.close()


# -- a worker process killed -------------------------------------------------------------------------


async def held_by_process(deployment: Deployment, mode: str, slots: int) -> tuple[asyncio.subprocess.Process, set[str]]:
    """A remote worker process (`tests/remote_worker_process.py`) holding `slots` assignments."""
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tests.remote_worker_process", mode, deployment.target, deployment.worker_key, QUEUE,
        str(slots), stdout=asyncio.subprocess.PIPE, cwd=ROOT,
    )  # fmt: skip
    assert process.stdout is not None
    held: set[str] = set()
    try:
        async with asyncio.timeout(20):
            while len(held) < slots:
                line = (await process.stdout.readline()).decode()
                assert line.startswith("held "), line
                held.add(line.split()[1])
    except BaseException:
        process.kill()
        await process.wait()
        raise
    return process, held


async def recovered(deployment: Deployment, run_ids: set[str], within: float = 15) -> None:
    """What the leader's recovery loop does: once their leases expired, `run_ids` are back in the queue."""
    queue = Queue(deployment.redis, QUEUE)
    back: set[str] = set()

    async def all_back() -> bool:
        back.update((await queue.recover_expired()).requeued)
        return run_ids <= back

    await eventually(all_back, within=within, interval=0.1)


async def run_ids_of(deployment: Deployment, execution_ids: set[str]) -> set[str]:
    rows = await deployment.pool.fetch(
        "SELECT run_id::text FROM job_executions WHERE id = ANY($1::uuid[])", list(execution_ids)
    )
    return {row["run_id"] for row in rows}


@pytest.mark.parametrize(
    "deployment", [{"SCHEDULER_REMOTE_ACK_TIMEOUT": "60s", "SCHEDULER_VISIBILITY_TIMEOUT": "2s"}], indirect=True
)
async def test_a_killed_worker_process_parks_its_acked_runs_until_their_leases_expire_and_each_succeeds_once(
    deployment: Deployment,
) -> None:
    """A stream that ends and never comes back: unacknowledged runs back unspent at once; acknowledged
    ones parked (still `running`, nothing recorded) until their leases expire, then recovered as a
    killed in-process worker's are (the attempt `abandoned`, worker lost) and run elsewhere, once."""
    runs = await deployment.runs(10)
    acked, acked_ids = await held_by_process(deployment, "sdk", 4)
    unacked, unacked_ids = await held_by_process(deployment, "raw", 3)
    rows = await deployment.pool.fetch(
        "SELECT id::text, status FROM job_executions WHERE id = ANY($1::uuid[])", [*acked_ids, *unacked_ids]
    )
    assert {row["status"] for row in rows} == {"running"}
    for process in (acked, unacked):
        process.kill()  # SIGKILL: no goodbye on the stream
        await process.wait()

    async def unacked_back() -> bool:
        statuses = await deployment.pool.fetch(
            "SELECT status, attempt FROM job_executions WHERE id = ANY($1::uuid[])", list(unacked_ids)
        )
        return all((row["status"], row["attempt"]) == ("queued", 1) for row in statuses)

    # At once (well within the 60 s ack timeout), the same attempt: nothing spent.
    await eventually(unacked_back, within=10)

    statuses = await deployment.pool.fetch(
        "SELECT status FROM job_executions WHERE id = ANY($1::uuid[])", list(acked_ids)
    )
    assert {row["status"] for row in statuses} == {"running"}  # parked: nothing recorded
    await recovered(deployment, await run_ids_of(deployment, acked_ids))  # their leases are no longer kept
    worker = sdk_worker(deployment, slots=4)

    @worker.handler("remote.noop")
    async def noop(ctx: ExecutionContext, payload: dict[str, Any]) -> Any:
        return ctx.attempt

    async with serving(worker):

        async def drained() -> bool:
            return (await deployment.counts(runs)).get("succeeded", 0) == len(runs)

        await eventually(drained, within=30)
    assert await deployment.counts(runs) == {"succeeded": 10, "abandoned": 4}
    abandoned = await deployment.pool.fetch(
        "SELECT id::text, error FROM job_executions WHERE run_id = ANY($1::uuid[]) AND status = 'abandoned'", runs
    )
    assert {row["id"] for row in abandoned} == acked_ids
    assert {row["error"] for row in abandoned} == {"worker lost: its lease expired before the attempt finished"}
    succeeded = await deployment.pool.fetch(
        "SELECT run_id::text, count(*) AS n FROM job_executions WHERE run_id = ANY($1::uuid[]) "
        "AND status = 'succeeded' GROUP BY run_id",
        runs,
    )
    assert sorted(row["n"] for row in succeeded) == [1] * 10  # each run succeeded exactly once


async def test_list_workers_shows_a_remote_worker_with_its_handlers_slots_and_sdk(deployment: Deployment) -> None:
    worker = sdk_worker(deployment, slots=7)

    @worker.handler("remote.noop")
    async def noop(ctx: ExecutionContext, payload: dict[str, Any]) -> Any:
        return None

    @worker.handler("acme.sync", description="sync one account")
    async def sync(ctx: ExecutionContext, payload: dict[str, Any]) -> Any:
        return None

    token = (("authorization", f"Bearer {await deployment.key(Role.VIEWER)}"),)
    async with serving(worker), grpc.aio.insecure_channel(deployment.target) as channel:
        cluster = cluster_pb2_grpc.ClusterServiceStub(channel)

        async def listed() -> list[cluster_pb2.Worker]:
            reply = await cluster.ListWorkers(cluster_pb2.ListWorkersRequest(), metadata=token)
            return [w for w in reply.workers if w.id == worker.worker_id]

        (shown,) = await eventually(listed, within=10)
        assert shown.remote
        assert shown.id.startswith("remote:127.0.0.1:")
        assert (shown.host, shown.pid, shown.slots, shown.queue) == ("127.0.0.1", 0, 7, QUEUE)
        assert sorted(shown.handlers) == ["acme.sync", "remote.noop"]
        assert shown.sdk == f"scheduler-client-python/{scheduler_client.__version__}"
    # Gone once its stream ended (the session unregisters).
    async with grpc.aio.insecure_channel(deployment.target) as channel:
        reply = await cluster_pb2_grpc.ClusterServiceStub(channel).ListWorkers(
            cluster_pb2.ListWorkersRequest(), metadata=token
        )
        assert worker.worker_id not in [w.id for w in reply.workers]


# -- liveness and drain ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "deployment", [{"SCHEDULER_REMOTE_PING_INTERVAL": "200ms", "SCHEDULER_VISIBILITY_TIMEOUT": "2s"}], indirect=True
)
async def test_a_stream_that_stops_answering_pings_is_ended_and_its_leases_no_longer_kept(
    deployment: Deployment,
) -> None:
    runs = await deployment.runs(2)
    async with raw(deployment) as open_stream:
        alive, silent = open_stream(), open_stream()
        for stream in (alive, silent):
            stream.send(hello=hello(slots=2))
            await stream.receive_kind("welcome")

        async def two_assignments() -> set[str]:  # answering pings meanwhile
            return {(await alive.receive_kind("assignment", within=20)).assignment.run_id for _ in range(2)}

        alive_got = asyncio.create_task(two_assignments())
        silent.send(credit=workers_pb2.Credit(grant=2))
        held = []
        while len(held) < 2:  # pings are not answered
            response = await silent.receive()
            if response.WhichOneof("message") == "assignment":
                a = response.assignment
                silent.send(ack=workers_pb2.Ack(execution_id=a.execution_id, claim_token=a.claim_token))
                held.append(a.execution_id)
        began = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await silent.rest()
        assert caught.value.code() == grpc.StatusCode.ABORTED
        assert "two pings" in (caught.value.details() or "")
        assert time.monotonic() - began < 2.0

        # Parked: their leases expire (the worker whose receive loop died keeps nothing alive).
        await recovered(deployment, set(runs))
        # The stream that answers its pings is still served (the runs' next attempts come to it).
        alive.send(credit=workers_pb2.Credit(grant=2))
        assert await alive_got == set(runs)
        alive.close()


async def test_a_server_stopping_drains_its_streams_and_records_their_outcomes(
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
            worker = sdk_worker(deployment, slots=3, reconnect_max=30.0)
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
                await worker.draining.wait()  # told before the server stops
            release.set()  # the handlers finish within the grace: their outcomes are recorded
            async with asyncio.timeout(20):
                await stopping
            worker.stop()
            async with asyncio.timeout(10):
                await task
            assert await deployment.counts(runs) == {"succeeded": 3}
        finally:
            if not stopped:
                await server.__aexit__(None, None, None)
    finally:
        await registry.aclose()
        await client.aclose()


async def _true(value: bool) -> bool:
    return value


@pytest.mark.parametrize("deployment", [{"SCHEDULER_REMOTE_PING_INTERVAL": "200ms"}], indirect=True)
async def test_revoking_a_worker_key_ends_its_stream_and_stops_the_sdk(deployment: Deployment) -> None:
    creator = Principal("test", Role.ADMIN, "api_key", "test", b"")
    revoked = await deployment.server.api.auth.create_api_key(creator, "to-revoke", Role.WORKER, None)
    sdk_revoked = await deployment.server.api.auth.create_api_key(creator, "sdk-to-revoke", Role.WORKER, None)
    async with raw(deployment, revoked.secret) as open_stream, raw(deployment) as open_other:
        stream, other = open_stream(), open_other()
        for each in (stream, other):
            each.send(hello=hello())
            await each.receive_kind("welcome")

        async def answer_pings() -> None:
            while True:
                response = await other.receive(within=30)
                if response.WhichOneof("message") == "ping":
                    other.send(pong=workers_pb2.Pong(nonce=response.ping.nonce))

        answering = asyncio.create_task(answer_pings())
        await deployment.server.api.auth.revoke_api_key(revoked.record.id)
        began = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stream.rest()
        assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "revoked" in (caught.value.details() or "")
        assert time.monotonic() - began < 2.0  # within a ping interval or so, not at reconnect
        # Another worker's stream goes on.
        assert not answering.done()
        assert not other.call.done()
        answering.cancel()
        other.close()
    worker = Worker(deployment.target, sdk_revoked.secret, queue=QUEUE, reconnect_max=1.0)
    worker.handler("remote.noop")(_noop)
    task = asyncio.create_task(worker.run())
    async with asyncio.timeout(10):
        await worker.connected.wait()
    await deployment.server.api.auth.revoke_api_key(sdk_revoked.record.id)
    with pytest.raises(grpc.aio.AioRpcError) as sdk_caught:
        async with asyncio.timeout(10):
            await task  # a revoked key is fatal to the SDK: no reconnect loop against a dead key
    assert sdk_caught.value.code() == grpc.StatusCode.UNAUTHENTICATED


async def _noop(ctx: ExecutionContext, payload: dict[str, Any]) -> None:
    return None


# -- resume: a stream's end parks its acknowledged runs; a new stream resumes them -------------------


@contextlib.asynccontextmanager
async def proxy_to(port: int) -> AsyncIterator[FaultProxy]:
    """A TCP proxy in front of a server (chaos/proxy.py): what cuts a worker's stream."""
    proxy = await FaultProxy("worker-stream", "127.0.0.1", port).start()
    try:
        yield proxy
    finally:
        await proxy.close()


def blocking_worker(target: str, deployment: Deployment, slots: int) -> tuple[Worker, list[str], asyncio.Event]:
    """An SDK worker whose handler holds each run until `release` is set; `started` lists them."""
    worker = Worker(target, deployment.worker_key, queue=QUEUE, slots=slots, reconnect_max=0.5)
    started: list[str] = []
    release = asyncio.Event()

    @worker.handler("remote.noop")
    async def hold(ctx: ExecutionContext, payload: dict[str, Any]) -> Any:
        started.append(ctx.execution_id)
        await release.wait()
        return {"attempt": ctx.attempt}

    return worker, started, release


async def acked_on_the_server(deployment: Deployment, count: int) -> None:
    """Wait until a session of the deployment's server holds `count` acknowledged assignments: the
    worker's acks travel after its handlers start, and an assignment whose ack a cut overtakes goes
    back unspent at the stream's end (not the worker's to resume)."""
    remote = deployment.server.api.remote
    assert remote is not None
    await eventually(lambda: _true(any(
        len(s._pending) == count and all(p.acked for p in s._pending.values()) for s in remote.sessions
    )))  # fmt: skip


async def exactly_once_in_one_attempt(deployment: Deployment, runs: list[str]) -> None:
    async def drained() -> bool:
        return (await deployment.counts(runs)).get("succeeded", 0) == len(runs)

    await eventually(drained, within=20)
    assert await deployment.counts(runs) == {"succeeded": len(runs)}  # nothing interrupted, abandoned
    assert await deployment.attempts(runs) == 1


@pytest.mark.parametrize("deployment", [{"SCHEDULER_VISIBILITY_TIMEOUT": "3s"}], indirect=True)
async def test_a_cut_stream_is_reconnected_and_its_runs_resumed_each_succeeding_once_in_one_attempt(
    deployment: Deployment,
) -> None:
    runs = await deployment.runs(4)
    async with proxy_to(deployment.server.port) as proxy:
        worker, started, release = blocking_worker(proxy.url_host_port, deployment, slots=4)
        async with serving(worker):
            await eventually(lambda: _true(len(started) == 4), within=10)
            await acked_on_the_server(deployment, 4)
            assert proxy.reset() == 1  # the connection killed (RST both ways) with 4 acked runs in flight
            await eventually(lambda: _true(worker.stats.connects == 2 and worker.stats.resumed == 4), within=10)
            assert worker.stats.not_resumed == 0
            [session] = deployment.server.api.remote.sessions  # type: ignore[union-attr]
            assert set(session.welcome().resumed) == set(started)
            release.set()
            await exactly_once_in_one_attempt(deployment, runs)
        assert len(started) == 4  # each handler called once: the tasks went on across the streams


@pytest.mark.parametrize(
    "deployment",
    [{"SCHEDULER_VISIBILITY_TIMEOUT": "3s", "SCHEDULER_REMOTE_PING_INTERVAL": "300ms"}],
    indirect=True,
)
async def test_a_silently_dropped_stream_is_found_dead_by_both_sides_and_its_runs_resumed(
    deployment: Deployment,
) -> None:
    """A blackholed link (no FIN, no RST): the server ends the stream after two unanswered pings and
    parks its runs; the SDK hears nothing for 2.5 ping intervals and reconnects; once the link heals
    the new stream resumes the runs, and outcomes finished while disconnected are reported then."""
    runs = await deployment.runs(3)
    remote = deployment.server.api.remote
    assert remote is not None
    async with proxy_to(deployment.server.port) as proxy:
        worker, started, release = blocking_worker(proxy.url_host_port, deployment, slots=3)
        async with serving(worker):
            await eventually(lambda: _true(len(started) == 3), within=10)
            proxy.blackhole()
            await eventually(lambda: _true(not remote.sessions and not worker.connected.is_set()), within=10)
            release.set()  # they finish while disconnected: their outcomes wait for the next stream
            await eventually(lambda: _true(worker.stats.succeeded == 3), within=10)
            rows = await deployment.pool.fetch("SELECT status FROM job_executions WHERE id = ANY($1::uuid[])", started)
            assert {row["status"] for row in rows} == {"running"}  # parked, nothing recorded
            proxy.heal()
            await eventually(lambda: _true(worker.stats.resumed == 3), within=10)
            await exactly_once_in_one_attempt(deployment, runs)


@pytest.mark.parametrize("deployment", [{"SCHEDULER_VISIBILITY_TIMEOUT": "2s"}], indirect=True)
async def test_a_resume_with_a_stale_or_foreign_claim_token_is_refused_for_that_run_only(
    deployment: Deployment,
) -> None:
    runs = await deployment.runs(3)
    async with raw(deployment) as open_stream:
        first = open_stream()
        first.send(hello=hello(slots=3))
        await first.receive_kind("welcome")
        first.send(credit=workers_pb2.Credit(grant=3))
        held = [(await first.receive_kind("assignment")).assignment for _ in range(3)]
        for a in held:
            first.send(ack=workers_pb2.Ack(execution_id=a.execution_id, claim_token=a.claim_token))
        remote = deployment.server.api.remote
        assert remote is not None
        [session] = remote.sessions
        await eventually(lambda: _true(all(p.acked for p in session._pending.values())))  # acks in
        first.call.cancel()  # the stream is lost with three acknowledged runs
        foreign = held[0].claim_token  # another run's token
        second = open_stream()
        second.send(hello=workers_pb2.Hello(
            handlers=[workers_pb2.HandlerInfo(name="remote.noop")], slots=3, sdk="raw", queue=QUEUE,
            held_runs=[
                workers_pb2.HeldRun(execution_id=held[0].execution_id, claim_token=held[0].claim_token),
                workers_pb2.HeldRun(execution_id=held[1].execution_id, claim_token=foreign),
                workers_pb2.HeldRun(execution_id=held[2].execution_id, claim_token="0" * 32),
            ],
        ))  # fmt: skip
        welcome = (await second.receive_kind("welcome")).welcome
        assert list(welcome.resumed_execution_ids) == [held[0].execution_id]
        refusals = {r.execution_id: r for r in welcome.resume_refusals}
        assert set(refusals) == {held[1].execution_id, held[2].execution_id}
        assert {(r.code, r.field) for r in refusals.values()} == {
            ("FAILED_PRECONDITION", "hello.held_runs[1].claim_token"),
            ("FAILED_PRECONDITION", "hello.held_runs[2].claim_token"),
        }
        # The resumed one reports through the new stream under its token; the old one cannot.
        second.send(outcome=workers_pb2.Outcome(
            execution_id=held[0].execution_id, claim_token=held[0].claim_token, value=struct_value("ok")
        ))  # fmt: skip

        async def recorded() -> bool:
            status = await deployment.pool.fetchval(
                "SELECT status FROM job_executions WHERE id = $1::uuid", held[0].execution_id
            )
            return bool(status == "succeeded")

        await eventually(recorded, within=10)
        # The refused ones stay parked until their leases expire, then run again elsewhere.
        await recovered(deployment, {held[1].run_id, held[2].run_id})
        second.send(credit=workers_pb2.Credit(grant=2))
        again = [(await second.receive_kind("assignment", within=10)).assignment for _ in range(2)]
        assert {(a.run_id, a.attempt) for a in again} == {(held[1].run_id, 2), (held[2].run_id, 2)}
        second.close()
    assert sorted(runs) == sorted(a.run_id for a in held)


async def test_a_bad_held_run_in_a_hello_is_invalid_argument_naming_it(deployment: Deployment) -> None:
    async with raw(deployment) as open_stream:
        stream = open_stream()
        stream.send(hello=workers_pb2.Hello(
            handlers=[workers_pb2.HandlerInfo(name="remote.noop")], slots=1, queue=QUEUE,
            held_runs=[workers_pb2.HeldRun(execution_id="not-a-uuid", claim_token="x")],
        ))  # fmt: skip
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stream.receive()
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert (caught.value.details() or "").startswith("hello.held_runs[0].execution_id:")


# Leases of 8 s (extended every 2.7 s): nothing here waits for one to expire, and a loaded machine's
# stall of 2 s (3 s leases) once let the first server lose a lease before the reconnect resumed it.
@pytest.mark.parametrize("deployment", [{"SCHEDULER_VISIBILITY_TIMEOUT": "8s"}], indirect=True)
async def test_runs_resume_on_another_server_process(
    deployment: Deployment, redis_url: str, database_url: str, tmp_path: Path
) -> None:
    """Servers are stateless: a reconnect a load balancer sends to another server process resumes
    the runs there, through Redis (the lease, extended under the same token) and PostgreSQL (the
    claim): even while the first server still holds the old stream (a silent cut it has not noticed
    yet), and with the SDK after a cut connection."""
    port = free_port()
    env = {
        **os.environ, "REDIS_URL": redis_url, "DATABASE_URL": database_url, "SCHEDULER_GRPC_PORT": str(port),
        "SCHEDULER_HTTP_ENABLED": "false", "SCHEDULER_METRICS_PORT": str(free_port()),
        "SCHEDULER_VISIBILITY_TIMEOUT": "8s", "SCHEDULER_REMOTE_ACK_TIMEOUT": "1s",
    }  # fmt: skip
    other = RoleProcess("server-2", ["server"], env, tmp_path / "server-2.log")
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)

            async def serving_health() -> bool:
                with contextlib.suppress(grpc.aio.AioRpcError):
                    reply = await health.Check(health_pb2.HealthCheckRequest(), timeout=1)
                    return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)
                return False

            await eventually(serving_health, within=30, interval=0.2)
            # A raw worker holds 2 acknowledged runs on the first server, whose stream stays open.
            held_runs = await deployment.runs(2)
            async with raw(deployment) as open_stream:
                old = open_stream()
                old.send(hello=hello(slots=2))
                await old.receive_kind("welcome")
                old.send(credit=workers_pb2.Credit(grant=2))
                held = [(await old.receive_kind("assignment")).assignment for _ in range(2)]
                for a in held:
                    old.send(ack=workers_pb2.Ack(execution_id=a.execution_id, claim_token=a.claim_token))
                await acked_on_the_server(deployment, 2)
                new = RawStream(channel, deployment.worker_key)
                new.send(hello=workers_pb2.Hello(
                    handlers=[workers_pb2.HandlerInfo(name="remote.noop")], slots=2, sdk="raw", queue=QUEUE,
                    held_runs=[workers_pb2.HeldRun(execution_id=a.execution_id, claim_token=a.claim_token)
                               for a in held],
                ))  # fmt: skip
                welcome = (await new.receive_kind("welcome")).welcome
                assert sorted(welcome.resumed_execution_ids) == sorted(a.execution_id for a in held)
                for a in held:
                    new.send(outcome=workers_pb2.Outcome(
                        execution_id=a.execution_id, claim_token=a.claim_token, value=struct_value("ok")
                    ))  # fmt: skip
                await exactly_once_in_one_attempt(deployment, held_runs)
                # The first server's session finds the leases gone: it tells the old stream, records nothing.
                cancels = [(await old.receive_kind("cancel", within=10)).cancel for _ in range(2)]
                assert {(c.execution_id, c.reason) for c in cancels} == {(a.execution_id, "lease lost") for a in held}
                old.close()
                new.close()
            assert await deployment.counts(held_runs) == {"succeeded": 2}
        runs = await deployment.runs(3)
        async with proxy_to(deployment.server.port) as proxy:
            worker, started, release = blocking_worker(proxy.url_host_port, deployment, slots=3)
            async with serving(worker):
                await eventually(lambda: _true(len(started) == 3), within=10)
                first = worker.worker_id
                await acked_on_the_server(deployment, 3)
                proxy.target = ("127.0.0.1", port)  # the balancer's next pick
                proxy.reset()
                await eventually(lambda: _true(worker.stats.resumed == 3), within=10)
                assert worker.worker_id != first
                assert worker.stats.not_resumed == 0
                release.set()
                await exactly_once_in_one_attempt(deployment, runs)
                rows = await deployment.pool.fetch(
                    "SELECT DISTINCT worker_id FROM job_executions WHERE run_id = ANY($1::uuid[])", runs
                )
                assert {row["worker_id"] for row in rows} == {first}  # claimed by the first, resumed as it was
    finally:
        assert other.stop() == 0, "\n".join(other.log_lines()[-20:])


# -- hand-backs of runs that were never the worker's -------------------------------------------------


async def test_a_run_of_a_handler_not_served_goes_back_unspent_without_pausing_its_limit_keys(
    deployment: Deployment,
) -> None:
    """`NotServedHere` (and `NotAcknowledged`) are hand-backs of their own (`HandBack`), not
    back-pressure: no attempt, no delivery counted, no limit key paused, no throttle wait counted."""
    await deployment.control.limits.create_limit(LimitSpec("remote-per-customer", LimitKind.CONCURRENCY, 5))
    job = await deployment.control.create_job(JobSpec(
        name="keyed-remote", handler="remote.noop", queue=QUEUE,
        limits=(LimitRef("remote-per-customer", "payload.customer"),), payload={"customer": "c1"},
    ))  # fmt: skip
    throttled_before = _sample(metrics.LIMIT_THROTTLE_WAITS, "remote-per-customer")
    async with raw(deployment) as open_stream:
        stream = open_stream()
        stream.send(hello=hello(slots=1, names=("remote.other",)))
        await stream.receive_kind("welcome")
        remote = deployment.server.api.remote
        assert remote is not None
        [session] = remote.sessions
        stream.send(credit=workers_pb2.Credit(grant=1))
        [run] = await deployment.control.trigger_job(job.id)
        await eventually(lambda: _true(session.worker.stats.unspent >= 1), within=10)
        state = await deployment.control.limit_keys.key_state("remote-per-customer", "c1")
        stream.close()
    assert session.worker.stats.throttled == 0
    assert _sample(metrics.LIMIT_THROTTLE_WAITS, "remote-per-customer") == throttled_before
    assert {entry.state.paused_until for entry in state.queues} == {None}
    rows = await deployment.pool.fetch("SELECT attempt, status FROM job_executions WHERE run_id = $1", run.run_id)
    assert [(row["attempt"], row["status"]) for row in rows] == [(1, "queued")]


def _sample(counter: Any, *labels: str) -> float:
    return float(counter.labels(*labels)._value.get())


def struct_value(value: Any) -> Any:
    from google.protobuf import struct_pb2

    message = struct_pb2.Value()
    message.string_value = value
    return message


async def test_runs_still_running_when_a_server_stops_are_resumed_on_another_server(
    deployment: Deployment, redis_url: str, database_url: str, pool: asyncpg.Pool
) -> None:
    """SIGTERM's drain: streams are told to drain; runs still running after the grace are parked,
    not handed back, and the worker resumes them on the server it reconnects to."""
    settings = make_settings(
        redis_url, database_url, SCHEDULER_GRPC_PORT="0", SCHEDULER_HTTP_ENABLED="false",
        SCHEDULER_VISIBILITY_TIMEOUT="5s", SCHEDULER_SHUTDOWN_GRACE="500ms",
    )  # fmt: skip
    client = redis_client(redis_url)
    try:
        stopping = serve(settings, client, pool, hasher=FAST_HASHER)
        first = await stopping.__aenter__()
        stop: asyncio.Task[Any] | None = None
        try:
            runs = await deployment.runs(3)
            async with proxy_to(first.port) as proxy:
                worker, started, release = blocking_worker(proxy.url_host_port, deployment, slots=3)
                async with serving(worker):
                    await eventually(lambda: _true(len(started) == 3), within=10)
                    stop = asyncio.create_task(stopping.__aexit__(None, None, None))
                    async with asyncio.timeout(10):
                        await worker.draining.wait()
                    proxy.target = ("127.0.0.1", deployment.server.port)  # the balancer's pick from now on
                    async with asyncio.timeout(20):
                        await stop  # the grace passes with the handlers still running
                    await eventually(lambda: _true(worker.stats.resumed == 3), within=10)
                    rows = await deployment.pool.fetch(
                        "SELECT status FROM job_executions WHERE id = ANY($1::uuid[])", started
                    )
                    assert {row["status"] for row in rows} == {"running"}  # parked, never interrupted
                    release.set()
                    await exactly_once_in_one_attempt(deployment, runs)
        finally:
            if stop is None:
                await stopping.__aexit__(None, None, None)
    finally:
        await client.aclose()


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command to make certificates")
async def test_an_sdk_worker_serves_runs_over_mutual_tls(
    redis_url: str, database_url: str, pool: asyncpg.Pool, redis: aioredis.Redis, tmp_path: Path
) -> None:
    """TLS and mTLS as for the rest of the API: the worker's stream rides the server's own port."""
    files = await asyncio.to_thread(make_certificates, tmp_path)
    settings = make_settings(
        redis_url, database_url, SCHEDULER_GRPC_PORT="0", SCHEDULER_HTTP_ENABLED="false",
        SCHEDULER_SHUTDOWN_GRACE="1s", SCHEDULER_TLS_CERT=str(files["server.pem"]),
        SCHEDULER_TLS_KEY=str(files["server.key"]), SCHEDULER_TLS_CLIENT_CA=str(files["ca.pem"]),
    )  # fmt: skip
    client = redis_client(redis_url)
    registry = default_registry(HandlerSettings())
    registry.register(Declared())
    try:
        async with serve(settings, client, pool, hasher=FAST_HASHER) as running:
            deployment = Deployment(running, Control(redis, pool, registry), pool, redis, "")
            deployment.worker_key = await deployment.key(Role.WORKER)
            runs = await deployment.runs(20)
            trusted = grpc.ssl_channel_credentials(
                root_certificates=files["ca.pem"].read_bytes(),
                private_key=files["client.key"].read_bytes(),
                certificate_chain=files["client.pem"].read_bytes(),
            )
            worker = sdk_worker(deployment, tls=trusted)
            worker.handler("remote.noop")(_noop)
            async with serving(worker):

                async def drained() -> bool:
                    return await deployment.counts(runs) == {"succeeded": 20}

                await eventually(drained, within=30)
            # Without a client certificate the handshake fails: no stream, whatever the key.
            anonymous = Worker(
                deployment.target, deployment.worker_key, queue=QUEUE, reconnect_max=0.2,
                tls=grpc.ssl_channel_credentials(root_certificates=files["ca.pem"].read_bytes()),
            )  # fmt: skip
            anonymous.handler("remote.noop")(_noop)
            task = asyncio.create_task(anonymous.run())
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(1.5):
                    await anonymous.connected.wait()
            anonymous.stop()
            async with asyncio.timeout(10):
                await task
    finally:
        await registry.aclose()
        await client.aclose()
