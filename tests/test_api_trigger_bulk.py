"""BatchTriggerJobs: many runs in one call, one result per item, idempotent per item; an invalid
item writes nothing. On a real server, Valkey and PostgreSQL."""

from __future__ import annotations

import asyncio
import functools
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import struct_pb2
from redis.asyncio import Redis
from scheduler_client import SchedulerClient
from scheduler_client.client import TriggerItem
from scheduler_client.errors import InvalidArgument as ClientInvalidArgument
from scheduler_client.errors import NotFound
from scheduler_client.v1 import executions_pb2, jobs_pb2, limits_pb2, limits_pb2_grpc

from scheduler_grpc.queue import Queue
from scheduler_grpc.trigger_batch import MAX_BULK_IN_FLIGHT
from tests.conftest import ROOT
from tests.test_api_support import Harness, api, echo_job  # noqa: F401 - `api` is a fixture

ITEMS = 1000


def _struct(value: dict[str, Any]) -> struct_pb2.Struct:
    message = struct_pb2.Struct()
    message.update(value)
    return message


def _item(job_id: str, request_id: str = "", payload: dict[str, Any] | None = None) -> jobs_pb2.TriggerJobRequest:
    item = jobs_pb2.TriggerJobRequest(id=job_id, request_id=request_id)
    if payload is not None:
        item.payload.CopyFrom(_struct(payload))
    return item


async def _batch(api: Harness, items: list[jobs_pb2.TriggerJobRequest], metadata: Any = None) -> Any:  # noqa: F811
    request = jobs_pb2.BatchTriggerJobsRequest(requests=items)
    return (await api.jobs.BatchTriggerJobs(request, metadata=metadata or api.operator)).results


async def _runs(api: Harness) -> int:  # noqa: F811
    return int(await api.server.api.control._pool.fetchval("SELECT count(*) FROM job_executions"))


async def test_a_thousand_items_in_one_call_each_recorded_once_and_a_retry_makes_none(
    api: Harness,  # noqa: F811
    redis: Redis,
) -> None:
    jobs = [
        (await api.jobs.CreateJob(jobs_pb2.CreateJobRequest(job=echo_job(f"bulk-{n}")), metadata=api.admin)).job
        for n in range(3)
    ]
    items = [
        _item(jobs[n % 3].id, f"req-{n}", {"n": n} if n % 2 else None)  # every other item overrides its payload
        for n in range(ITEMS)
    ]
    results = await _batch(api, items)
    assert len(results) == ITEMS
    assert all(result.code == 0 and result.HasField("execution") for result in results)
    assert len({result.execution.id for result in results}) == ITEMS
    assert [result.execution.job_id for result in results] == [item.id for item in items]
    assert all(result.execution.trigger == executions_pb2.TRIGGER_MANUAL for result in results)
    rows = await api.server.api.control._pool.fetch("SELECT id::text, request_id, payload FROM job_executions")
    assert len(rows) == ITEMS
    by_id = {row["id"]: row for row in rows}
    for n, result in enumerate(results):
        row = by_id[result.execution.id]
        assert row["request_id"] == f"req-{n}"
        assert row["payload"] == ({"n": n} if n % 2 else {}), "the override, else the job's payload"
    assert (await Queue(redis, "default").stats()).ready == ITEMS

    again = await _batch(api, items)
    assert [result.execution.id for result in again] == [result.execution.id for result in results]
    assert await _runs(api) == ITEMS, "the same request ids make no new runs"
    assert (await Queue(redis, "default").stats()).ready == ITEMS


async def test_items_without_request_ids_each_make_a_run_and_errors_are_per_item(api: Harness) -> None:  # noqa: F811
    job = (await api.jobs.CreateJob(jobs_pb2.CreateJobRequest(job=echo_job()), metadata=api.admin)).job
    paused = (await api.jobs.CreateJob(jobs_pb2.CreateJobRequest(job=echo_job("paused")), metadata=api.admin)).job
    await api.jobs.PauseJob(jobs_pb2.PauseJobRequest(id=paused.id), metadata=api.operator)
    missing = str(uuid.uuid4())
    results = await _batch(
        api, [_item(job.id), _item(missing, "gone"), _item(job.id), _item(paused.id), _item(missing, payload={"a": 1})]
    )
    assert [result.code for result in results] == [0, grpc.StatusCode.NOT_FOUND.value[0], 0, 0, 5]
    assert results[1].message == f"job {missing} not found"
    assert not results[1].HasField("execution")
    assert results[0].execution.id != results[2].execution.id
    assert results[3].execution.job_id == paused.id, "a paused job runs when triggered, as with TriggerJob"
    assert await _runs(api) == 3


@pytest.mark.parametrize(
    ("bad", "field"),
    [
        (lambda job: _item("not-a-uuid"), "requests[3].id"),
        (lambda job: _item(job, "x" * 129), "requests[3].request_id"),
        (lambda job: _item(job, "r-0"), "requests[3].request_id"),  # r-0 is requests[0]'s, same job
        (lambda job: _item(job, payload={"n": float("nan")}), "requests[3].payload.n"),
        (lambda job: _item(job, payload={"$from": 3}), "requests[3].payload"),
    ],
)
async def test_an_invalid_item_is_invalid_argument_naming_it_and_nothing_is_written(
    api: Harness,  # noqa: F811
    bad: Any,
    field: str,
) -> None:
    job = (await api.jobs.CreateJob(jobs_pb2.CreateJobRequest(job=echo_job()), metadata=api.admin)).job
    items = [_item(job.id, f"r-{n}", {"n": n}) for n in range(3)] + [bad(job.id)] + [_item(job.id) for _ in range(3)]
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await _batch(api, items)
    assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert (caught.value.details() or "").split(": ")[0] == field
    assert await _runs(api) == 0


async def test_payload_overrides_are_checked_against_the_jobs_handler(api: Harness) -> None:  # noqa: F811
    job = jobs_pb2.Job(name="sleepy", handler="test.delay", payload=_struct({"seconds": 1}))
    job = (await api.jobs.CreateJob(jobs_pb2.CreateJobRequest(job=job), metadata=api.admin)).job
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await _batch(api, [_item(job.id, payload={"seconds": 2}), _item(job.id, payload={"seconds": -1})])
    assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert (caught.value.details() or "").startswith("requests[1].payload.seconds: ")
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await _batch(api, [_item(job.id, payload={"secs": 2})])
    assert (caught.value.details() or "").startswith("requests[0].payload")
    assert await _runs(api) == 0
    (result,) = await _batch(api, [_item(job.id, payload={"seconds": 2})])
    row = await api.server.api.control._pool.fetchrow("SELECT payload FROM job_executions")
    assert result.code == 0
    assert row is not None
    assert row["payload"] == {"seconds": 2}


async def test_limit_keys_are_resolved_from_the_items_payload(api: Harness) -> None:  # noqa: F811
    limit = limits_pb2.Limit(name="per-customer", kind=limits_pb2.LIMIT_KIND_CONCURRENCY, limit=2)
    await limits_pb2_grpc.LimitServiceStub(api.channel).CreateLimit(
        limits_pb2.CreateLimitRequest(limit=limit), metadata=api.admin
    )
    ref = limits_pb2.LimitRef(limit="per-customer", key="payload.customer")
    job = echo_job(payload=_struct({"customer": "job"}), limits=[ref])
    job = (await api.jobs.CreateJob(jobs_pb2.CreateJobRequest(job=job), metadata=api.admin)).job
    await _batch(api, [_item(job.id, payload={"customer": "acme"}), _item(job.id)])
    rows = await api.server.api.control._pool.fetch("SELECT limit_keys FROM job_executions ORDER BY scheduled_for")
    assert [[key[:2] for key in row["limit_keys"]] for row in rows] == [
        [["per-customer", "acme"]],
        [["per-customer", "job"]],
    ]


async def test_sizes_roles_and_trigger_job_with_a_payload(api: Harness) -> None:  # noqa: F811
    job = (await api.jobs.CreateJob(jobs_pb2.CreateJobRequest(job=echo_job()), metadata=api.admin)).job
    for items, details in (([], "requests: at least one item"), ([_item(job.id)] * 1001, "requests: at most 1000")):
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await _batch(api, items)
        assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert (caught.value.details() or "").startswith(details)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await _batch(api, [_item(job.id)], metadata=api.viewer)
    assert caught.value.code() is grpc.StatusCode.PERMISSION_DENIED

    request = _item(job.id, "one", {"k": "v"})
    first = (await api.jobs.TriggerJob(request, metadata=api.operator)).execution
    again = (await api.jobs.TriggerJob(request, metadata=api.operator)).execution
    assert first.id == again.id
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await api.jobs.TriggerJob(_item(job.id, payload={"k": float("inf")}), metadata=api.operator)
    assert (caught.value.details() or "").startswith("payload.k: ")
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await api.jobs.TriggerJob(_item(str(uuid.uuid4()), payload={}), metadata=api.operator)
    assert caught.value.code() is grpc.StatusCode.NOT_FOUND
    row = await api.server.api.control._pool.fetchrow("SELECT payload FROM job_executions")
    assert row is not None
    assert row["payload"] == {"k": "v"}
    assert await _runs(api) == 1


# -- clients -----------------------------------------------------------------------------------------


async def test_python_client_trigger_jobs_splits_calls_and_returns_errors_per_item(api: Harness) -> None:  # noqa: F811
    job = (await api.jobs.CreateJob(jobs_pb2.CreateJobRequest(job=echo_job()), metadata=api.admin)).job
    missing = str(uuid.uuid4())
    token = api.operator[0][1].removeprefix("Bearer ")
    items = [TriggerItem(job.id, f"py-{n}", {"n": n}) for n in range(1500)] + [TriggerItem(missing), job.id]
    async with SchedulerClient.connect(api.server.address, token=token) as client:
        results = await client.batch_trigger_jobs(items)
        assert len(results) == 1502
        assert isinstance(results[1500], NotFound)
        assert all(isinstance(result, executions_pb2.Execution) for i, result in enumerate(results) if i != 1500)
        again = await client.batch_trigger_jobs(items[:1500])
        assert [r.id for r in again] == [r.id for r in results[:1500]]  # type: ignore[union-attr]
        bad = [TriggerItem(job.id)] * 1200 + [TriggerItem("nope")]
        with pytest.raises(ClientInvalidArgument, match=r"^requests\[1200\]\.id: "):
            await client.batch_trigger_jobs(bad)
        one = await client.trigger_job(job.id, payload={"k": 1})
        assert one.job_id == job.id
    assert await _runs(api) == 1501 + 1000 + 1, "the bad call's first 1,000 items ran; its second call ran none"


def _schedctl(api: Harness, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:  # noqa: F811
    env = {k: v for k, v in os.environ.items() if not k.startswith("SCHEDCTL_")}
    env |= {"SCHEDCTL_SERVER": api.server.address, "SCHEDCTL_TOKEN": api.operator[0][1].removeprefix("Bearer ")}
    return subprocess.run(
        [sys.executable, "-m", "scheduler_client.cli", *args],
        env=env, input=stdin, capture_output=True, text=True, timeout=60, check=False, cwd=ROOT,
    )  # fmt: skip


async def test_schedctl_trigger_count_and_items(api: Harness, tmp_path: Path) -> None:  # noqa: F811
    await api.jobs.CreateJob(jobs_pb2.CreateJobRequest(job=echo_job("hello")), metadata=api.admin)
    run = functools.partial(asyncio.to_thread, _schedctl, api)
    done = await run("jobs", "trigger", "hello", "--count", "1200", "--request-id", "batch", "--payload", '{"a": 1}')
    assert (done.returncode, done.stdout.strip()) == (0, "Triggered hello: 1200 runs"), done.stderr
    again = await run("jobs", "trigger", "hello", "--count", "1200", "--request-id", "batch")
    assert again.returncode == 0, again.stderr
    assert await _runs(api) == 1200, "ID-1 ... ID-N: the same command again runs nothing new"

    lines = [
        json.dumps({"job": "hello", "payload": {"n": 1}, "request_id": "line-1"}),
        "",
        json.dumps({"job": "hello"}),
        json.dumps({"job": str(uuid.uuid4())}),
    ]
    items = tmp_path / "items.jsonl"
    items.write_text("\n".join(lines) + "\n")
    partial = await run("jobs", "trigger", "--items", str(items))
    assert partial.returncode == 1
    assert partial.stdout.strip() == f"Triggered 3 items of {items}: 2 runs, 1 failed"
    assert partial.stderr.strip().splitlines() == [
        f"schedctl: line 4: NOT_FOUND: job {json.loads(lines[3])['job']} not found"
    ]
    as_json = await run("--json", "jobs", "trigger", "--items", "-", stdin=lines[0] + "\n")
    results = json.loads(as_json.stdout)["results"]
    assert len(results) == 1
    assert "execution" in results[0]
    assert await _runs(api) == 1202

    for args, message in (
        (("jobs", "trigger", "hello", "--count", "3", "--payload", '{"x": NaN}'), "run 1: --payload: x: "),
        (("jobs", "trigger", "--items", "-"), "--items: no items in -"),
        (("jobs", "trigger", "hello", "--items", str(items)), "--items: give JOB"),
        (("jobs", "trigger", "hello", "--count", "2", "--wait"), "--wait: only for one run"),
    ):
        failed = await run(*args, stdin="")
        assert failed.returncode == 2, failed.stdout + failed.stderr
        assert len(failed.stderr.strip().splitlines()) == 1, failed.stderr
        assert failed.stderr.startswith(f"schedctl: {message}"), failed.stderr
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"job": "hello"}\n{"job": "hello", "payload": {"n": NaN}}\n')
    failed = await run("jobs", "trigger", "--items", str(bad))
    assert failed.returncode == 2
    assert failed.stderr.startswith("schedctl: line 2: payload.n: "), failed.stderr
    assert await _runs(api) == 1202


async def test_triggering_an_upstream_in_a_batch_starts_a_flow_run_per_item(api: Harness) -> None:  # noqa: F811
    upstream = (await api.jobs.CreateJob(jobs_pb2.CreateJobRequest(job=echo_job("up")), metadata=api.admin)).job
    down = echo_job("down", depends_on=[upstream.id])
    await api.jobs.CreateJob(jobs_pb2.CreateJobRequest(job=down), metadata=api.admin)
    results = await _batch(api, [_item(upstream.id, f"f-{n}") for n in range(3)])
    pool = api.server.api.control._pool
    flows = await pool.fetch("SELECT id::text FROM flow_runs WHERE root_job_id = $1", uuid.UUID(upstream.id))
    assert {row["id"] for row in flows} == {result.execution.run_id for result in results}, (
        "a flow run's id is its run's"
    )


async def test_concurrent_calls_with_the_same_request_ids_make_each_run_once(api: Harness) -> None:  # noqa: F811
    job = (await api.jobs.CreateJob(jobs_pb2.CreateJobRequest(job=echo_job()), metadata=api.admin)).job
    items = [_item(job.id, f"same-{n}") for n in range(200)]
    first, second, third = await asyncio.gather(_batch(api, items), _batch(api, items), _batch(api, items[::-1]))
    ids = [result.execution.id for result in first]
    assert [result.execution.id for result in second] == ids
    assert [result.execution.id for result in third] == ids[::-1]
    assert len(set(ids)) == 200
    assert await _runs(api) == 200


async def test_concurrent_calls_leave_most_of_the_pool_to_other_requests(
    api: Harness,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    job = (await api.jobs.CreateJob(jobs_pb2.CreateJobRequest(job=echo_job()), metadata=api.admin)).job
    firing = api.server.api.control._firing
    trigger_now = firing.trigger_now
    running = peak = 0
    enough = asyncio.Event()  # set once MAX_BULK_IN_FLIGHT statements run: a wider door would show by then

    async def counted(requests: Any) -> Any:
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        if running >= MAX_BULK_IN_FLIGHT:
            enough.set()
        try:
            await enough.wait()
            return await trigger_now(requests)
        finally:
            running -= 1

    monkeypatch.setattr(firing, "trigger_now", counted)
    calls = [_batch(api, [_item(job.id, f"c{c}-{n}") for n in range(20)]) for c in range(10)]
    answers = await asyncio.gather(*calls)
    assert peak == MAX_BULK_IN_FLIGHT, "ten calls hold at most MAX_BULK_IN_FLIGHT pool connections at once"
    assert sum(len(results) for results in answers) == await _runs(api) == 200
