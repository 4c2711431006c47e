"""The Python client against a real `scheduler-grpc server` process (with a scheduler and a worker)."""

from __future__ import annotations

import asyncio
import contextlib
import uuid

import asyncpg
import grpc
import pytest
import redis.asyncio as aioredis
from scheduler_client import SchedulerClient
from scheduler_client.errors import AlreadyExists, InvalidArgument, NotFound, Unauthenticated
from scheduler_client.v1 import auth_pb2, executions_pb2, jobs_pb2

from tests.api_helpers import ADMIN, ADMIN_PASSWORD, start_api, start_server, wait_for_server
from tests.engine_helpers import Roles

SUCCEEDED = executions_pb2.EVENT_TYPE_SUCCEEDED


async def test_client_drives_jobs_and_executions(roles: Roles, redis: aioredis.Redis, pool: asyncpg.Pool) -> None:
    api = await start_api(roles, redis)
    async with SchedulerClient.connect(api.target) as client:
        login = await client.login(ADMIN, ADMIN_PASSWORD)
        assert login.token
        assert login.role == auth_pb2.ROLE_ADMIN
        me = await client.whoami()
        assert (me.principal, me.role) == (ADMIN, auth_pb2.ROLE_ADMIN)

        job = await client.create_job("client-echo", "test.echo", payload={"hello": "client", "n": 3})
        assert job.id
        assert job.state == jobs_pb2.JOB_STATE_ACTIVE
        assert (await client.get_job(job.id)).name == "client-echo"
        assert [j.name for j in (await client.list_jobs()).items] == ["client-echo"]
        assert [j.id async for j in client.iter_jobs(handler="test.echo")] == [job.id]
        assert (await client.find_job("client-echo")).id == job.id

        # Subscribe, trigger, and see the very execution succeed on the stream.
        subscribed = asyncio.Event()
        events = client.watch_executions(job_ids=[job.id], subscribed=subscribed)
        first = asyncio.ensure_future(anext(events))
        await asyncio.wait_for(subscribed.wait(), 10)
        execution = await client.trigger_job(job.id)
        assert execution.job_id == job.id

        async def until_succeeded() -> executions_pb2.ExecutionEvent:
            event = await first
            while not (event.execution_id == execution.id and event.type == SUCCEEDED):
                event = await anext(events)
            return event

        async with contextlib.aclosing(events):
            succeeded = await asyncio.wait_for(until_succeeded(), 20)
        assert succeeded.cursor
        assert succeeded.job_id == job.id

        done = await client.get_execution(execution.id)
        assert done.state == executions_pb2.EXECUTION_STATE_SUCCEEDED
        assert done.worker_id
        history = await client.list_executions(job_id=job.id, states=["succeeded"])
        assert [e.id for e in history.items] == [execution.id]

        # wait_for_execution: subscribe + read, so it returns whether the run is done already or not.
        again = await client.trigger_job(job.id, request_id="client-test-1")
        same = await client.trigger_job(job.id, request_id="client-test-1")
        assert same.id == again.id  # idempotent
        finished = await client.wait_for_execution(again.id, within=20)
        assert finished.state == executions_pb2.EXECUTION_STATE_SUCCEEDED

        paused = await client.pause_job(job.id)
        assert paused.state == jobs_pb2.JOB_STATE_PAUSED
        assert (await client.resume_job(job.id)).state == jobs_pb2.JOB_STATE_ACTIVE

        workers = await client.list_workers()
        assert len(workers) == 1
        status = await client.get_scheduler_status()
        assert status.has_leader
        assert status.term >= 1
        handlers = {handler.name for handler in await client.list_handlers()}
        assert {"test.echo", "http.webhook"} <= handlers
        assert (await client.get_queue_stats()).dead == 0
        assert len(await client.list_dead_letters()) == 0
        fire_times = await client.preview_schedule("0 9 * * *", time_zone="Europe/Paris", count=3)
        assert len(fire_times) == 3

        # Errors carry their gRPC code and a message naming the problem.
        with pytest.raises(AlreadyExists) as taken:
            await client.create_job("client-echo", "test.echo")
        assert taken.value.code is grpc.StatusCode.ALREADY_EXISTS
        with pytest.raises(InvalidArgument) as invalid:
            await client.create_job("client-bad", "test.echo", cron="not a cron")
        assert invalid.value.code is grpc.StatusCode.INVALID_ARGUMENT
        assert "cron" in invalid.value.message
        with pytest.raises(NotFound) as missing:
            await client.get_job(str(uuid.uuid4()))
        assert missing.value.code is grpc.StatusCode.NOT_FOUND

        await client.delete_job(job.id)
        with pytest.raises(NotFound):
            await client.get_job(job.id)

        await client.logout()
        assert client.token is None
        with pytest.raises(Unauthenticated) as anonymous:
            await client.list_jobs()
        assert anonymous.value.code is grpc.StatusCode.UNAUTHENTICATED

    async with SchedulerClient.connect(api.target, token="not-a-token") as stranger:
        with pytest.raises(Unauthenticated):
            await stranger.whoami()
        with pytest.raises(Unauthenticated):
            await stranger.login(ADMIN, "wrong password")


async def test_watch_resumes_across_a_server_restart(roles: Roles, redis: aioredis.Redis, pool: asyncpg.Pool) -> None:
    """The stream breaks with UNAVAILABLE when its server stops; the client resumes from its cursor."""
    api = await start_api(roles, redis)
    async with SchedulerClient.connect(api.target) as client:
        await client.login(ADMIN, ADMIN_PASSWORD)
        job = await client.create_job("client-resume", "test.echo")
        subscribed = asyncio.Event()
        events = client.watch_executions(job_ids=[job.id], types=["succeeded"], subscribed=subscribed,
                                         max_reconnects=30, max_reconnect_delay=0.5)  # fmt: skip
        async with contextlib.aclosing(events):
            pending = asyncio.ensure_future(anext(events))
            await asyncio.wait_for(subscribed.wait(), 10)
            first = await client.trigger_job(job.id)
            assert (await asyncio.wait_for(pending, 20)).execution_id == first.id

            api.server.stop()  # graceful: the stream ends with UNAVAILABLE
            pending = asyncio.ensure_future(anext(events))
            restarted = start_server(roles, int(api.target.rsplit(":", 1)[1]))
            await wait_for_server(restarted)
            # Triggered while the watcher may still be reconnecting: the cursor brings it anyway.
            second = await client.trigger_job(job.id)
            assert (await asyncio.wait_for(pending, 30)).execution_id == second.id


async def test_client_batch_methods_pause_resume_and_cancel_by_filter(roles: Roles, redis: aioredis.Redis) -> None:
    api = await start_api(roles, redis)
    async with SchedulerClient.connect(api.target) as client:
        await client.login(ADMIN, ADMIN_PASSWORD)
        ids = [(await client.create_job(f"batch-{n}", "test.echo", cron="0 0 1 1 *")).id for n in range(3)]
        counted = await client.batch_pause_jobs(filter=jobs_pb2.JobFilter(name_contains="batch-"), validate_only=True)
        assert counted.matched_count == 3
        assert [(await client.get_job(job_id)).state for job_id in ids] == [jobs_pb2.JOB_STATE_ACTIVE] * 3
        paused = await client.batch_pause_jobs(ids[:2])
        assert sorted(paused.job_ids) == sorted(ids[:2])
        assert [(await client.get_job(job_id)).state for job_id in ids] == [
            jobs_pb2.JOB_STATE_PAUSED, jobs_pb2.JOB_STATE_PAUSED, jobs_pb2.JOB_STATE_ACTIVE,
        ]  # fmt: skip
        resumed = await client.batch_resume_jobs(filter=jobs_pb2.JobFilter(state=jobs_pb2.JOB_STATE_PAUSED))
        assert sorted(resumed.job_ids) == sorted(ids[:2])
        none_open = await client.batch_cancel_executions(
            filter=executions_pb2.ExecutionFilter(job_name="batch-0"), validate_only=True
        )
        assert none_open.matched_count == 0
        retried = await client.batch_retry_executions(ids=[], filter=executions_pb2.ExecutionFilter(job_name="batch-0"))
        assert retried.matched_count == 0
        deleted = await client.batch_delete_jobs(ids)
        assert sorted(deleted.job_ids) == sorted(ids)
