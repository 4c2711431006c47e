"""Jobs that name a remote worker's handler (issue 23): accepted through the API like a built-in's
(on a queue other than the in-process workers'), with `handler_served` telling whether a connected
worker serves it; schedctl prints it and the console's job page warns. Real server, real stores."""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import asyncpg
import grpc
import pytest
from redis.asyncio import Redis
from scheduler_client.v1 import auth_pb2, auth_pb2_grpc, jobs_pb2, jobs_pb2_grpc
from scheduler_client.worker import ExecutionContext, Worker

from scheduler_grpc.auth import Principal, Role
from tests.engine_helpers import eventually
from tests.test_api_support import ADMIN_PASSWORD
from tests.test_client_cli import Schedctl
from tests.test_console import Console, login, running_console

QUEUE = "remote"


@pytest.fixture
async def console(redis_url: str, database_url: str, redis: Redis, pool: asyncpg.Pool) -> AsyncIterator[Console]:
    async with running_console(redis_url, database_url, pool) as running:
        yield running


@contextlib.asynccontextmanager
async def jobs_api(console: Console) -> AsyncIterator[tuple[jobs_pb2_grpc.JobServiceStub, tuple[tuple[str, str]]]]:
    async with grpc.aio.insecure_channel(console.server.address) as channel:
        login_reply = await auth_pb2_grpc.AuthServiceStub(channel).Login(
            auth_pb2.LoginRequest(username="admin", password=ADMIN_PASSWORD)
        )
        yield jobs_pb2_grpc.JobServiceStub(channel), (("authorization", f"Bearer {login_reply.token}"),)


def remote_job(name: str = "sync", **fields: Any) -> jobs_pb2.Job:
    job = jobs_pb2.Job(name=name, **{"handler": "acme.sync", "queue": QUEUE, **fields})
    job.payload.update({"account": 7})
    return job


@contextlib.asynccontextmanager
async def serving_acme_sync(console: Console) -> AsyncIterator[list[str]]:
    """A Python SDK worker serving `acme.sync` on the remote queue; the execution ids it ran."""
    creator = Principal("test", Role.ADMIN, "api_key", "test", b"")
    key = (await console.server.api.auth.create_api_key(creator, "worker-key", Role.WORKER, None)).secret
    worker = Worker(console.server.address, key, queue=QUEUE, slots=2, reconnect_max=1.0)
    ran: list[str] = []

    @worker.handler("acme.sync")
    async def sync(ctx: ExecutionContext, payload: dict[str, Any]) -> Any:
        ran.append(ctx.execution_id)
        return {"account": payload["account"]}

    task = asyncio.create_task(worker.run())
    try:
        async with asyncio.timeout(10):
            await worker.connected.wait()
        yield ran
    finally:
        worker.stop()
        async with asyncio.timeout(15):
            await task


def status(caught: pytest.ExceptionInfo[grpc.aio.AioRpcError]) -> tuple[grpc.StatusCode, str]:
    return caught.value.code(), (caught.value.details() or "").split(":", 1)[0]


async def test_a_job_may_name_a_remote_handler_on_a_queue_of_its_own(console: Console) -> None:
    async with jobs_api(console) as (jobs, token):
        # On the in-process workers' queue it is refused: they would dead-letter its runs.
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await jobs.CreateJob(jobs_pb2.CreateJobRequest(job=remote_job(queue="")), metadata=token)
        assert status(caught) == (grpc.StatusCode.INVALID_ARGUMENT, "job.queue")
        assert "in-process workers' queue" in (caught.value.details() or "")
        # A name breaking the naming rule is still no handler at all.
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await jobs.CreateJob(jobs_pb2.CreateJobRequest(job=remote_job(handler="Acme Sync")), metadata=token)
        assert status(caught) == (grpc.StatusCode.INVALID_ARGUMENT, "job.handler")
        # Its payload is checked as a JSON object within the size limit, nothing more.
        too_big = remote_job()
        too_big.payload.update({"blob": "x" * 70_000})
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await jobs.CreateJob(jobs_pb2.CreateJobRequest(job=too_big), metadata=token)
        assert status(caught) == (grpc.StatusCode.INVALID_ARGUMENT, "job.payload")
        # On a queue of its own it is created; nothing serves it yet, and the response says so.
        created = (await jobs.CreateJob(jobs_pb2.CreateJobRequest(job=remote_job()), metadata=token)).job
        assert (created.handler, created.queue, created.handler_served) == ("acme.sync", QUEUE, False)
        builtin = (
            await jobs.CreateJob(
                jobs_pb2.CreateJobRequest(job=jobs_pb2.Job(name="echo", handler="test.echo")), metadata=token
            )
        ).job
        assert builtin.handler_served
        # UpdateJob: a built-in job moved to a remote handler on the in-process queue is refused too.
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await jobs.UpdateJob(
                jobs_pb2.UpdateJobRequest(
                    job=jobs_pb2.Job(id=builtin.id, handler="acme.sync"),
                    update_mask={"paths": ["handler"]},
                ),
                metadata=token,
            )
        assert status(caught) == (grpc.StatusCode.INVALID_ARGUMENT, "job.queue")

        async with serving_acme_sync(console) as ran:

            async def served() -> bool:
                got = await jobs.GetJob(jobs_pb2.GetJobRequest(id=created.id), metadata=token)
                return got.job.handler_served

            await eventually(served, within=10)
            listed = await jobs.ListJobs(jobs_pb2.ListJobsRequest(), metadata=token)
            assert {job.name: job.handler_served for job in listed.jobs} == {"sync": True, "echo": True}
            # The job runs on the remote worker, exactly as a built-in handler's would in-process.
            await jobs.TriggerJob(jobs_pb2.TriggerJobRequest(id=created.id), metadata=token)

            async def succeeded() -> bool:
                pool = console.server.api.control._pool
                found = await pool.fetchval(
                    "SELECT count(*) FROM job_executions WHERE job_id = $1 AND status = 'succeeded'", created.id
                )
                return found == 1

            await eventually(succeeded, within=10)
            assert len(ran) == 1

        # Its stream ended: nothing serves it any more.
        got = await jobs.GetJob(jobs_pb2.GetJobRequest(id=created.id), metadata=token)
        assert not got.job.handler_served


async def test_schedctl_prints_whether_the_handler_is_served(console: Console, tmp_path: Path) -> None:
    cli = Schedctl(console.server.address, tmp_path / "schedctl")
    await asyncio.to_thread(cli.ok, "login", "--username", "admin", "--password", ADMIN_PASSWORD)
    out = await asyncio.to_thread(
        cli.ok, "jobs", "create", "--name", "sync", "--handler", "acme.sync", "--queue", QUEUE
    )
    assert re.search(r"^handler served: +no: no connected worker serves it on the job's queue now$", out, re.M), out
    out = await asyncio.to_thread(cli.ok, "jobs", "create", "--name", "echo", "--handler", "test.echo")
    assert re.search(r"^handler served: +yes$", out, re.M), out
    line = await asyncio.to_thread(cli.fails, "jobs", "create", "--name", "bad", "--handler", "acme.sync", code=2)
    assert "--queue" in line, line
    assert "in-process workers' queue" in line, line


async def test_the_console_job_page_warns_when_nothing_serves_the_handler(console: Console) -> None:
    async with jobs_api(console) as (jobs, token):
        created = (await jobs.CreateJob(jobs_pb2.CreateJobRequest(job=remote_job()), metadata=token)).job
        builtin = (
            await jobs.CreateJob(
                jobs_pb2.CreateJobRequest(job=jobs_pb2.Job(name="echo", handler="test.echo")), metadata=token
            )
        ).job
    async with console.client() as http:
        await login(http)

        async def page(job_id: str) -> str:
            async with http.get(f"/jobs/{job_id}") as reply:
                assert reply.status == 200
                return await reply.text()

        warned = await page(created.id)
        assert 'id="handler-not-served"' in warned
        assert "No worker serves handler <code>acme.sync</code> on queue <code>remote</code>" in warned
        assert 'id="handler-not-served"' not in await page(builtin.id)
        async with serving_acme_sync(console):

            async def no_warning() -> bool:
                return 'id="handler-not-served"' not in await page(created.id)

            await eventually(no_warning, within=10)
