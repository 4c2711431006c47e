"""The server's metrics move with its calls, and its log lines carry each call's trace id."""

from __future__ import annotations

import asyncio
import json
import logging

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from scheduler_client.v1 import auth_pb2, executions_pb2, jobs_pb2

from scheduler_grpc import metrics
from scheduler_grpc.logs import JsonFormatter
from tests.engine_helpers import eventually
from tests.test_api_support import Harness, api  # noqa: F401 - the fixture


def sample(name: str, **labels: str) -> float:
    return metrics.REGISTRY.get_sample_value(name, labels) or 0.0


async def test_server_metrics_move_with_calls(api: Harness) -> None:  # noqa: F811
    ok = {"service": "scheduler.v1.JobService", "method": "ListJobs", "code": "OK"}
    before = {
        "ok": sample("scheduler_grpc_requests_total", **ok),
        "denied": sample(
            "scheduler_grpc_requests_total",
            service="scheduler.v1.JobService",
            method="ListJobs",
            code="UNAUTHENTICATED",
        ),
        "latency": sample(
            "scheduler_grpc_request_duration_seconds_count", service="scheduler.v1.JobService", method="ListJobs"
        ),
        "logins": sample("scheduler_login_failures_total"),
        "created": sample("scheduler_jobs_created_total"),
    }
    await api.jobs.ListJobs(jobs_pb2.ListJobsRequest(), metadata=api.viewer)
    with pytest.raises(grpc.aio.AioRpcError):
        await api.jobs.ListJobs(jobs_pb2.ListJobsRequest())
    with pytest.raises(grpc.aio.AioRpcError):
        await api.auth.Login(auth_pb2.LoginRequest(username="admin", password="wrong"))
    job = jobs_pb2.Job(name="observed", handler="test.echo")
    await api.jobs.CreateJob(jobs_pb2.CreateJobRequest(job=job), metadata=api.admin)
    assert sample("scheduler_grpc_requests_total", **ok) == before["ok"] + 1
    assert sample("scheduler_grpc_requests_total", service="scheduler.v1.JobService", method="ListJobs",
                  code="UNAUTHENTICATED") == before["denied"] + 1  # fmt: skip
    assert sample("scheduler_grpc_request_duration_seconds_count", service="scheduler.v1.JobService",
                  method="ListJobs") == before["latency"] + 2  # fmt: skip
    assert sample("scheduler_login_failures_total") == before["logins"] + 1
    assert sample("scheduler_jobs_created_total") == before["created"] + 1

    stream = api.executions.WatchExecutions(executions_pb2.WatchExecutionsRequest(), metadata=api.viewer)
    await stream.initial_metadata()  # the subscription is live once headers arrive
    assert sample("scheduler_stream_subscribers") >= 1
    stream.cancel()

    async def unsubscribed() -> bool:
        return sample("scheduler_stream_subscribers") == 0

    await eventually(unsubscribed, within=5)


async def test_call_log_lines_carry_the_trace_id(api: Harness, caplog: pytest.LogCaptureFixture) -> None:  # noqa: F811
    caplog.set_level(logging.INFO, logger="scheduler_grpc")
    trace = "0af7651916cd43dd8448eb211c80319c"
    traceparent = (("traceparent", f"00-{trace}-b7ad6b7169203331-01"),)
    await api.jobs.ListJobs(jobs_pb2.ListJobsRequest(), metadata=(*api.viewer, *traceparent))
    formatter = JsonFormatter("server")
    lines = [json.loads(formatter.format(record)) for record in caplog.records if record.getMessage() == "rpc"]
    listed = [line for line in lines if line.get("method", "").endswith("/ListJobs")]
    assert listed
    assert listed[-1]["trace"] == trace
    assert {"time", "level", "role", "pid", "message", "code", "duration_ms"} <= listed[-1].keys()


async def test_server_waits_on_no_per_method_call_requests(api: Harness) -> None:  # noqa: F811
    """Every method is served by a generic handler, none registered: grpc.aio keeps one pending
    call request per registered method and waits on all of them for every call (grpc/grpc#43461),
    ~100 us per call with this API's methods. One pending request serves them all."""
    await api.jobs.ListJobs(jobs_pb2.ListJobsRequest(), metadata=api.viewer)
    health = health_pb2_grpc.HealthStub(api.channel)
    assert (await health.Check(health_pb2.HealthCheckRequest())).status == health_pb2.HealthCheckResponse.SERVING
    pending = [
        task.get_coro().__qualname__  # type: ignore[union-attr]
        for task in asyncio.all_tasks()
        if task.get_coro().__qualname__.startswith("AioServer._request")  # type: ignore[union-attr]
    ]
    assert pending == ["AioServer._request_call"], pending
