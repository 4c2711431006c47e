"""The Batch* methods (ExecutionService.BatchCancelExecutions/BatchRetryExecutions, JobService.
BatchPauseJobs/BatchResumeJobs/BatchDeleteJobs) over gRPC: roles, ids or filter, validate_only and
field errors. The batching itself is tested in test_control_bulk."""

from __future__ import annotations

import asyncpg
import grpc
import pytest
from scheduler_client.v1 import executions_pb2, jobs_pb2

from tests.test_api_support import Harness, api, echo_job  # noqa: F401 - `api` is a fixture


async def test_batch_cancel_and_retry_by_filter(api: Harness) -> None:  # noqa: F811
    job = (await api.jobs.CreateJob(jobs_pb2.CreateJobRequest(job=echo_job("bulk-export")), metadata=api.admin)).job
    runs = [
        (await api.jobs.TriggerJob(jobs_pb2.TriggerJobRequest(id=job.id), metadata=api.operator)).execution.run_id
        for _ in range(5)
    ]
    by_name = executions_pb2.ExecutionFilter(job_name="bulk-EXP", states=[executions_pb2.EXECUTION_STATE_QUEUED])
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await api.executions.BatchCancelExecutions(
            executions_pb2.BatchCancelExecutionsRequest(filter=by_name), metadata=api.viewer
        )
    assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED
    counted = await api.executions.BatchCancelExecutions(
        executions_pb2.BatchCancelExecutionsRequest(filter=by_name, validate_only=True), metadata=api.operator
    )
    assert (counted.matched_count, list(counted.run_ids)) == (5, [])
    cancelled = await api.executions.BatchCancelExecutions(
        executions_pb2.BatchCancelExecutionsRequest(filter=by_name), metadata=api.operator
    )
    assert sorted(cancelled.run_ids) == sorted(runs)
    retried = await api.executions.BatchRetryExecutions(
        executions_pb2.BatchRetryExecutionsRequest(ids=runs[:2]), metadata=api.operator
    )
    assert sorted(retried.run_ids) == sorted(runs[:2])
    queued = await api.executions.ListExecutions(
        executions_pb2.ListExecutionsRequest(job_id=job.id, states=[executions_pb2.EXECUTION_STATE_QUEUED]),
        metadata=api.viewer,
    )
    assert sorted(e.run_id for e in queued.executions) == sorted(runs[:2])
    for request, field in [
        (executions_pb2.BatchCancelExecutionsRequest(), "ids"),
        (executions_pb2.BatchCancelExecutionsRequest(ids=["x"], filter=by_name), "ids"),
        (executions_pb2.BatchCancelExecutionsRequest(ids=["not-a-uuid"]), "ids"),
        (
            executions_pb2.BatchCancelExecutionsRequest(filter=executions_pb2.ExecutionFilter(job_id="nope")),
            "filter.job_id",
        ),
        (
            executions_pb2.BatchCancelExecutionsRequest(
                filter=executions_pb2.ExecutionFilter(states=[executions_pb2.EXECUTION_STATE_UNSPECIFIED])
            ),
            "filter.states[0]",
        ),
    ]:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await api.executions.BatchCancelExecutions(request, metadata=api.operator)
        assert (caught.value.code(), (caught.value.details() or "").split(":")[0]) == (
            grpc.StatusCode.INVALID_ARGUMENT,
            field,
        )


async def test_batch_pause_resume_and_delete_jobs(api: Harness) -> None:  # noqa: F811
    ids = [
        (await api.jobs.CreateJob(jobs_pb2.CreateJobRequest(job=echo_job(f"nightly-{n}")), metadata=api.admin)).job.id
        for n in range(3)
    ]
    nightly = jobs_pb2.JobFilter(name_contains="nightly")
    paused = await api.jobs.BatchPauseJobs(jobs_pb2.BatchPauseJobsRequest(filter=nightly), metadata=api.operator)
    assert (paused.matched_count, sorted(paused.job_ids)) == (3, sorted(ids))
    resumed = await api.jobs.BatchResumeJobs(jobs_pb2.BatchResumeJobsRequest(ids=ids[:1]), metadata=api.operator)
    assert list(resumed.job_ids) == ids[:1]
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await api.jobs.BatchDeleteJobs(jobs_pb2.BatchDeleteJobsRequest(filter=nightly), metadata=api.operator)
    assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED
    only_paused = jobs_pb2.JobFilter(name_contains="nightly", state=jobs_pb2.JOB_STATE_PAUSED)
    deleted = await api.jobs.BatchDeleteJobs(jobs_pb2.BatchDeleteJobsRequest(filter=only_paused), metadata=api.admin)
    assert sorted(deleted.job_ids) == sorted(ids[1:])
    listed = await api.jobs.ListJobs(jobs_pb2.ListJobsRequest(), metadata=api.viewer)
    assert [j.id for j in listed.jobs] == ids[:1]


async def test_a_batch_by_error_text_counts_only_what_the_caller_may_read(api: Harness, pool: asyncpg.Pool) -> None:  # noqa: F811
    """An operator's error filter is no oracle for a credential in an error (admins read errors whole)."""
    job = (await api.jobs.CreateJob(jobs_pb2.CreateJobRequest(job=echo_job("leaky-batch")), metadata=api.admin)).job
    run = (await api.jobs.TriggerJob(jobs_pb2.TriggerJobRequest(id=job.id), metadata=api.operator)).execution
    await pool.execute(
        "UPDATE job_executions SET error = $1 WHERE id = $2", "login refused: password=hunter2secret", run.id
    )
    for term, caller, matched in [
        ("hunter2", api.operator, 0),
        ("login refused", api.operator, 1),
        ("hunter2", api.admin, 1),
    ]:
        request = executions_pb2.BatchCancelExecutionsRequest(
            filter=executions_pb2.ExecutionFilter(error_contains=term), validate_only=True
        )
        counted = await api.executions.BatchCancelExecutions(request, metadata=caller)
        assert counted.matched_count == matched, (term, matched)
    done = await api.executions.BatchCancelExecutions(
        executions_pb2.BatchCancelExecutionsRequest(filter=executions_pb2.ExecutionFilter(error_contains="hunter2")),
        metadata=api.operator,
    )
    assert list(done.run_ids) == []
    done = await api.executions.BatchCancelExecutions(
        executions_pb2.BatchCancelExecutionsRequest(filter=executions_pb2.ExecutionFilter(error_contains="refused")),
        metadata=api.operator,
    )
    assert list(done.run_ids) == [run.run_id]
