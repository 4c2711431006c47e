"""The Python client against an in-process fake server: resumption, deadlines, errors, completeness.

The real server is exercised in test_client_python.py; a fake lets these tests break streams and
stall calls on purpose, deterministically and in milliseconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

import grpc
import grpc.aio
import pytest
from scheduler_client import SchedulerClient
from scheduler_client.client import build_job
from scheduler_client.errors import (
    DeadlineExceeded,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    SchedulerClientError,
    Unauthenticated,
    Unavailable,
)
from scheduler_client.v1 import (
    auth_pb2,
    auth_pb2_grpc,
    cluster_pb2,
    executions_pb2,
    executions_pb2_grpc,
    jobs_pb2,
    jobs_pb2_grpc,
    limits_pb2,
    queue_pb2,
    users_pb2,
)

from tests.api_helpers import free_port
from tests.conftest import ROOT

TOKEN = "fake-token"


def _event(n: int, execution_id: str = "e1", kind: int = executions_pb2.EVENT_TYPE_STARTED) -> Any:
    return executions_pb2.WatchExecutionsResponse(
        event=executions_pb2.ExecutionEvent(cursor=f"{n}-0", type=kind, execution_id=execution_id, job_id="j1")  # type: ignore[arg-type]
    )


def _authorized(context: grpc.aio.ServicerContext[Any, Any]) -> bool:
    return dict(context.invocation_metadata() or ()).get("authorization") == f"Bearer {TOKEN}"


class FakeAuth(auth_pb2_grpc.AuthServiceServicer):
    async def Login(self, request: Any, context: Any) -> Any:
        if (request.username, request.password) != ("admin", "admin123"):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "invalid username or password")
        return auth_pb2.LoginResponse(token=TOKEN, role=auth_pb2.ROLE_ADMIN)

    async def WhoAmI(self, request: Any, context: Any) -> Any:
        if not _authorized(context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid token")
        return auth_pb2.WhoAmIResponse(principal="admin", role=auth_pb2.ROLE_ADMIN)


class FakeJobs(jobs_pb2_grpc.JobServiceServicer):
    def __init__(self) -> None:
        self.created: list[Any] = []

    async def GetJob(self, request: Any, context: Any) -> Any:
        if request.id == "slow":
            await asyncio.sleep(5)
        await context.abort(grpc.StatusCode.NOT_FOUND, f"job {request.id} not found")

    async def CreateJob(self, request: Any, context: Any) -> Any:
        self.created.append(request)
        if not request.job.schedule.cron and not request.job.HasField("schedule"):
            return jobs_pb2.CreateJobResponse(job=request.job)
        if request.job.schedule.cron == "bad":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "schedule.cron: not a cron expression")
        return jobs_pb2.CreateJobResponse(job=request.job)


class FakeExecutions(executions_pb2_grpc.ExecutionServiceServicer):
    """Watch: breaks the stream with RESOURCE_EXHAUSTED, then UNAVAILABLE, then ends it; the events
    of each connection in one batch if asked (`max_events_per_response`), unless the watched job is
    "old" (a server older than batching)."""

    def __init__(self) -> None:
        self.cursors: list[str] = []
        self.reads = 0

    async def WatchExecutions(self, request: Any, context: Any) -> AsyncIterator[Any]:
        self.cursors.append(request.cursor)
        if request.job_ids == ["quiet"]:
            await asyncio.sleep(30)
            return
        start = int(request.cursor.split("-")[0]) if request.cursor else 0
        numbers = range(start + 1, min(start + 3, 6))
        if request.max_events_per_response > 0 and request.job_ids != ["old"]:
            yield executions_pb2.WatchExecutionsResponse(events=[_event(n).event for n in numbers])
        else:
            for n in numbers:
                yield _event(n)
        if start == 0:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "too slow; resume from cursor")
        if start == 2:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the server is shutting down")

    async def GetExecution(self, request: Any, context: Any) -> Any:
        self.reads += 1
        state = executions_pb2.EXECUTION_STATE_SUCCEEDED if self.reads >= 3 else executions_pb2.EXECUTION_STATE_RUNNING
        return executions_pb2.GetExecutionResponse(
            execution=executions_pb2.Execution(id=request.id, job_id="quiet", state=state)
        )


async def _drain(events: AsyncIterator[Any]) -> list[Any]:
    async with contextlib.aclosing(events):  # type: ignore[type-var]
        return [event async for event in events]


@pytest.fixture
async def fake() -> AsyncIterator[tuple[str, FakeJobs, FakeExecutions]]:
    server = grpc.aio.server()
    jobs, executions = FakeJobs(), FakeExecutions()
    auth_pb2_grpc.add_AuthServiceServicer_to_server(FakeAuth(), server)  # type: ignore[no-untyped-call]
    jobs_pb2_grpc.add_JobServiceServicer_to_server(jobs, server)  # type: ignore[no-untyped-call]
    executions_pb2_grpc.add_ExecutionServiceServicer_to_server(executions, server)  # type: ignore[no-untyped-call]
    port = server.add_insecure_port(f"127.0.0.1:{free_port()}")
    await server.start()
    try:
        yield f"127.0.0.1:{port}", jobs, executions
    finally:
        await server.stop(grace=None)


async def test_login_keeps_the_token_and_sends_it(fake: tuple[str, FakeJobs, FakeExecutions]) -> None:
    target, _, _ = fake
    async with SchedulerClient.connect(target) as client:
        with pytest.raises(Unauthenticated) as denied:
            await client.whoami()
        assert denied.value.code is grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(Unauthenticated):
            await client.login("admin", "wrong")
        await client.login("admin", "admin123")
        assert client.token == TOKEN
        assert (await client.whoami()).principal == "admin"


async def test_errors_carry_code_and_message(fake: tuple[str, FakeJobs, FakeExecutions]) -> None:
    target, _, _ = fake
    async with SchedulerClient.connect(target, token=TOKEN) as client:
        with pytest.raises(NotFound) as missing:
            await client.get_job("nope")
        assert missing.value.code is grpc.StatusCode.NOT_FOUND
        assert missing.value.code_name == "NOT_FOUND"
        assert "job nope not found" in str(missing.value)
        with pytest.raises(InvalidArgument) as invalid:
            await client.create_job("x", "test.echo", cron="bad")
        assert "schedule.cron" in invalid.value.message
        assert isinstance(invalid.value, SchedulerClientError)


async def test_every_call_has_a_deadline(fake: tuple[str, FakeJobs, FakeExecutions]) -> None:
    target, _, _ = fake
    async with SchedulerClient.connect(target, token=TOKEN, timeout=0.3) as client:
        started = time.monotonic()
        with pytest.raises(DeadlineExceeded):
            await client.get_job("slow")
        assert time.monotonic() - started < 3
        started = time.monotonic()
        with pytest.raises(DeadlineExceeded):
            await client.get_job("slow", rpc_timeout=0.1)
        assert time.monotonic() - started < 3


async def test_unreachable_server_is_unavailable() -> None:
    async with SchedulerClient.connect(f"127.0.0.1:{free_port()}", timeout=5) as client:
        with pytest.raises(Unavailable) as down:
            await client.login("admin", "admin123")
        assert down.value.code is grpc.StatusCode.UNAVAILABLE


@pytest.mark.parametrize("job", ["j1", "old"])
async def test_watch_resumes_from_the_last_cursor(fake: tuple[str, FakeJobs, FakeExecutions], job: str) -> None:
    """Batched or not (an older server), each event is yielded on its own and resumed after exactly."""
    target, _, executions = fake
    async with SchedulerClient.connect(target, token=TOKEN) as client:
        events = client.watch_executions(job_ids=[job], reconnect_delay=0.01)
        cursors = [event.cursor async for event in events]
    # 1, 2, RESOURCE_EXHAUSTED -> resume after 2: 3, 4, UNAVAILABLE -> resume after 4: 5, end.
    assert cursors == ["1-0", "2-0", "3-0", "4-0", "5-0"]
    assert executions.cursors == ["", "2-0", "4-0"]


async def test_watch_gives_up_after_max_reconnects(fake: tuple[str, FakeJobs, FakeExecutions]) -> None:
    target, _, executions = fake
    async with SchedulerClient.connect(target, token=TOKEN) as client:
        with pytest.raises(ResourceExhausted):
            await _drain(client.watch_executions(max_reconnects=0))
    assert executions.cursors == [""]


async def test_wait_for_execution_polls_when_no_event_comes(fake: tuple[str, FakeJobs, FakeExecutions]) -> None:
    target, _, executions = fake
    async with SchedulerClient.connect(target, token=TOKEN) as client:
        done = await client.wait_for_execution("e1", within=10, poll_interval=0.1)
    assert done.state == executions_pb2.EXECUTION_STATE_SUCCEEDED
    assert executions.reads == 3


async def test_create_job_sends_plain_arguments_as_protos(fake: tuple[str, FakeJobs, FakeExecutions]) -> None:
    target, jobs, _ = fake
    async with SchedulerClient.connect(target, token=TOKEN) as client:
        await client.create_job(
            "nightly",
            "test.echo",
            payload={"n": 1, "tags": ["a"]},
            cron="0 3 * * *",
            time_zone="Europe/Paris",
            priority=5,
            max_retries=0,
            initial_backoff=2,
            timeout=30,
            concurrency_policy="forbid",
            request_id="req-1",
        )
    sent = jobs.created[-1]
    assert sent.request_id == "req-1"
    assert sent.job.schedule.cron == "0 3 * * *"
    assert sent.job.schedule.time_zone == "Europe/Paris"
    assert sent.job.HasField("retry_policy")
    assert sent.job.retry_policy.max_retries == 0
    assert sent.job.retry_policy.initial_backoff.seconds == 2
    assert sent.job.timeout.seconds == 30
    assert sent.job.concurrency_policy == jobs_pb2.CONCURRENCY_POLICY_FORBID
    assert sent.job.payload["n"] == 1
    assert list(sent.job.payload["tags"]) == ["a"]


def test_local_argument_errors_are_invalid_argument() -> None:
    with pytest.raises(InvalidArgument, match="concurrency_policy"):
        build_job(name="x", handler="test.echo", concurrency_policy="sometimes")
    with pytest.raises(InvalidArgument, match="either cron or run_at"):
        build_job(name="x", handler="test.echo", cron="* * * * *", run_at=datetime.now(UTC))


def test_every_rpc_has_a_client_method() -> None:
    import re

    modules = (auth_pb2, jobs_pb2, executions_pb2, queue_pb2, cluster_pb2, users_pb2, limits_pb2)
    missing = []
    for module in modules:
        for service in module.DESCRIPTOR.services_by_name.values():
            for method in service.methods:
                snake = re.sub(r"(?<!^)(?=[A-Z])", "_", method.name).lower().replace("who_am_i", "whoami")
                if not callable(getattr(SchedulerClient, snake, None)):
                    missing.append(f"{service.name}.{method.name} -> {snake}")
    assert not missing, missing


def test_client_imports_without_the_server_dependencies() -> None:
    """The client distribution needs only grpcio and protobuf: block everything else and use it."""
    blocker = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        top = name.split('.')[0]\n"
        "        if top in {'scheduler_grpc', 'redis', 'asyncpg', 'uvloop', 'croniter', 'orjson', 'aiohttp',\n"
        "                   'prometheus_client', 'argon2', 'grpc_health', 'grpc_reflection', 'pytest'}:\n"
        "            raise ImportError(f'blocked: {name}')\n"
        "sys.meta_path.insert(0, Block())\n"
        "from scheduler_client import SchedulerClient\n"
        "from scheduler_client.cli import main\n"
        "sys.exit(main(['--server', '127.0.0.1:1', '--deadline', '2', 'status']))\n"
    )
    env = {**os.environ, "SCHEDCTL_CONFIG": str(ROOT / ".data" / "nonexistent-schedctl")}
    result = subprocess.run([sys.executable, "-c", blocker], capture_output=True, text=True, timeout=60, env=env,
                            check=False)  # fmt: skip
    assert result.returncode == 1, result.stderr
    assert result.stderr.startswith("schedctl: cannot reach 127.0.0.1:1"), result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
