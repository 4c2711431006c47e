"""List responses bounded in bytes as well as items, and page tokens refused consistently when forged."""

from __future__ import annotations

import base64
from datetime import UTC, datetime

import grpc
import orjson
import pytest
from scheduler_client.v1 import executions_pb2, executions_pb2_grpc, jobs_pb2, jobs_pb2_grpc

from scheduler_grpc.executions import Trigger
from scheduler_grpc.jobs import JobSpec
from tests.test_api_support import Harness, api  # noqa: F401 - `api` is a fixture

DEFAULT_RECEIVE_LIMIT = 4 * 1024 * 1024  # gRPC's default max_receive_message_length
MAX_PAGE_BYTES = 1024 * 1024  # convert.MAX_PAGE_BYTES


async def test_a_page_of_big_jobs_fits_any_client_and_the_token_resumes_where_the_bytes_ran_out(
    api: Harness,  # noqa: F811
) -> None:
    control = api.server.api.control
    for index in range(300):  # 300 payloads of ~20 KiB: 6 MB, under the 64 KiB cap each
        await control.create_job(JobSpec(name=f"big-{index:03}", handler="test.echo", payload={"blob": "x" * 20_000}))
    # A client with gRPC's default receive limit (the harness channel has it), asking for 1000.
    stub = jobs_pb2_grpc.JobServiceStub(api.channel)
    names: list[str] = []
    token = ""
    pages = 0
    while True:
        page = await stub.ListJobs(jobs_pb2.ListJobsRequest(page_size=1000, page_token=token), metadata=api.viewer)
        assert page.ByteSize() <= MAX_PAGE_BYTES + 64 * 1024 < DEFAULT_RECEIVE_LIMIT
        names += [job.name for job in page.jobs]
        pages += 1
        token = page.next_page_token
        if not token:
            break
    assert names == [f"big-{index:03}" for index in range(300)]  # no gap, no repeat, in order
    assert pages >= 6


async def test_a_page_of_big_executions_is_bounded_too(api: Harness) -> None:  # noqa: F811
    control = api.server.api.control
    job = await control.create_job(JobSpec(name="results", handler="test.echo"))
    slots = []
    for _ in range(100):
        slots += await control._firing.trigger(job.id, Trigger.MANUAL, [datetime.now(UTC)])
    pool = control._pool
    await pool.execute(
        """UPDATE job_executions SET result = $1, error = $2, status = 'failed', worker_id = 'w',
               started_at = now(), finished_at = now()""",
        {"blob": "r" * 50_000},
        "e" * 8000,
    )
    stub = executions_pb2_grpc.ExecutionServiceStub(api.channel)
    ids: list[str] = []
    token = ""
    while True:
        page = await stub.ListExecutions(
            executions_pb2.ListExecutionsRequest(job_id=job.id, page_size=1000, page_token=token), metadata=api.viewer
        )
        assert page.ByteSize() <= MAX_PAGE_BYTES + 64 * 1024
        ids += [execution.id for execution in page.executions]
        token = page.next_page_token
        if not token:
            break
    assert len(ids) == len(set(ids)) == 100
    assert set(ids) == {run.run_id for run in slots}


def _forged_name_token(name: str) -> str:
    return base64.urlsafe_b64encode(name.encode()).decode()


async def test_forged_and_foreign_page_tokens_are_refused_by_every_listing(api: Harness) -> None:  # noqa: F811
    control = api.server.api.control
    for index in range(3):
        job = await control.create_job(JobSpec(name=f"job-{index}", handler="test.echo"))
        await control._firing.trigger(job.id, Trigger.MANUAL, [datetime.now(UTC)])
    jobs_page = await api.jobs.ListJobs(jobs_pb2.ListJobsRequest(page_size=1), metadata=api.viewer)
    runs_page = await api.executions.ListExecutions(
        executions_pb2.ListExecutionsRequest(page_size=1), metadata=api.viewer
    )
    assert jobs_page.next_page_token
    assert runs_page.next_page_token
    body = base64.urlsafe_b64decode(jobs_page.next_page_token + "==")
    tampered = base64.urlsafe_b64encode(body[:12] + body[12:].replace(b"job-0", b"job-1")).decode()
    forged = [
        _forged_name_token("job-0"),  # what the old tokens were: accepted by ListJobs
        base64.urlsafe_b64encode(orjson.dumps({"v": 1, "k": "jobs", "s": {}, "p": ["a"]})).decode(),
        tampered,
        "not base64 at all!",
        runs_page.next_page_token,  # another listing's token
        "x" * 5000,
    ]
    own_tokens = {"ListJobs": jobs_page.next_page_token, "ListExecutions": runs_page.next_page_token}
    for token in [*forged, jobs_page.next_page_token]:
        for method in ("ListJobs", "ListExecutions"):
            if token == own_tokens[method]:
                continue
            call = (
                api.jobs.ListJobs(jobs_pb2.ListJobsRequest(page_token=token), metadata=api.viewer)
                if method == "ListJobs"
                else api.executions.ListExecutions(
                    executions_pb2.ListExecutionsRequest(page_token=token), metadata=api.viewer
                )
            )
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await call
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, token, caught.value.details())
            assert (caught.value.details() or "").startswith("page_token: ")
    # A token reused with other filters is refused too (AIP-158), and the right one still works.
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await api.jobs.ListJobs(
            jobs_pb2.ListJobsRequest(page_token=jobs_page.next_page_token, handler="test.echo"), metadata=api.viewer
        )
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    rest = await api.jobs.ListJobs(jobs_pb2.ListJobsRequest(page_token=jobs_page.next_page_token), metadata=api.viewer)
    assert [job.name for job in rest.jobs] == ["job-1", "job-2"]


async def test_the_basic_view_leaves_out_payloads_results_and_errors(api: Harness) -> None:  # noqa: F811
    control = api.server.api.control
    job = await control.create_job(JobSpec(name="viewed", handler="test.echo", payload={"blob": "x" * 1000}))
    await control._firing.trigger(job.id, Trigger.MANUAL, [datetime.now(UTC)])
    await control._pool.execute(
        """UPDATE job_executions SET result = '{"r": 1}', error = 'boom', status = 'failed', worker_id = 'w',
               started_at = now(), finished_at = now()"""
    )
    for view, has_payload in [
        (jobs_pb2.JOB_VIEW_UNSPECIFIED, True), (jobs_pb2.JOB_VIEW_FULL, True), (jobs_pb2.JOB_VIEW_BASIC, False)
    ]:  # fmt: skip
        listed = await api.jobs.ListJobs(jobs_pb2.ListJobsRequest(view=view), metadata=api.viewer)
        assert listed.jobs[0].name == "viewed"
        assert listed.jobs[0].HasField("payload") is has_payload
        assert listed.jobs[0].handler == "test.echo"
    for view, full in [
        (executions_pb2.EXECUTION_VIEW_UNSPECIFIED, True),
        (executions_pb2.EXECUTION_VIEW_FULL, True),
        (executions_pb2.EXECUTION_VIEW_BASIC, False),
    ]:
        runs = await api.executions.ListExecutions(executions_pb2.ListExecutionsRequest(view=view), metadata=api.viewer)
        assert runs.executions[0].HasField("result") is full
        assert (runs.executions[0].error == "boom") is full
        assert runs.executions[0].state == executions_pb2.EXECUTION_STATE_FAILED
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await api.jobs.ListJobs(jobs_pb2.ListJobsRequest(view=7), metadata=api.viewer)  # type: ignore[arg-type]
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (caught.value.details() or "").startswith("view: ")
