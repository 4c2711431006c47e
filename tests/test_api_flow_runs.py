"""ListFlowRuns over gRPC: newest first, filters (root job, state), page tokens bound to them, the
viewer's right to it, and the counts GetFlowRun and ListFlowRuns share."""

from __future__ import annotations

import grpc
import pytest
from scheduler_client.v1 import executions_pb2, jobs_pb2

from tests.test_api_support import Harness, echo_job
from tests.test_api_support import api as api  # noqa: PLC0414 (the fixture, shared)


async def _root(api: Harness, name: str) -> str:
    root = (await api.jobs.CreateJob(jobs_pb2.CreateJobRequest(job=echo_job(name)), metadata=api.admin)).job
    child = echo_job(f"{name}-child")
    child.depends_on.append(root.id)
    await api.jobs.CreateJob(jobs_pb2.CreateJobRequest(job=child), metadata=api.admin)
    return root.id


async def test_flow_runs_are_listed_newest_first_with_filters_and_pages(api: Harness) -> None:
    first, second = await _root(api, "first"), await _root(api, "second")
    started = []
    for job_id in (first, second, first):
        run = (await api.jobs.TriggerJob(jobs_pb2.TriggerJobRequest(id=job_id), metadata=api.operator)).execution
        started.append(run.run_id)
    ex = api.executions
    listed = (await ex.ListFlowRuns(executions_pb2.ListFlowRunsRequest(), metadata=api.viewer)).flow_runs
    assert [flow.id for flow in listed] == started[::-1]
    assert next((flow.root_job_name, flow.node_count, flow.finished_node_count) for flow in listed) == ("first", 2, 0)
    assert all(flow.state == executions_pb2.FLOW_RUN_STATE_RUNNING and not flow.nodes for flow in listed)
    got = (await ex.GetFlowRun(executions_pb2.GetFlowRunRequest(id=started[0]), metadata=api.viewer)).flow_run
    assert (got.root_job_name, got.node_count, got.finished_node_count) == ("first", 2, 0)
    # One per page, by root job: the token carries the position and the filters.
    request = executions_pb2.ListFlowRunsRequest(page_size=1, root_job_id=first)
    page = await ex.ListFlowRuns(request, metadata=api.viewer)
    assert [flow.id for flow in page.flow_runs] == [started[2]]
    request.page_token = page.next_page_token
    page = await ex.ListFlowRuns(request, metadata=api.viewer)
    assert [flow.id for flow in page.flow_runs] == [started[0]]
    assert page.next_page_token == ""
    # A token is refused with other filters, and a state filter works.
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await ex.ListFlowRuns(
            executions_pb2.ListFlowRunsRequest(page_size=1, page_token=request.page_token), metadata=api.viewer
        )
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "page_token" in (refused.value.details() or "")
    done = executions_pb2.ListFlowRunsRequest(state=executions_pb2.FLOW_RUN_STATE_SUCCEEDED)
    assert list((await ex.ListFlowRuns(done, metadata=api.viewer)).flow_runs) == []


@pytest.mark.parametrize(
    ("request_fields", "field"),
    [({"root_job_id": "not-an-id"}, "root_job_id"), ({"state": 99}, "state"), ({"page_size": -1}, "page_size"),
     ({"page_token": "garbage"}, "page_token")],
)  # fmt: skip
async def test_bad_list_requests_name_their_field(api: Harness, request_fields: dict[str, object], field: str) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await api.executions.ListFlowRuns(
            executions_pb2.ListFlowRunsRequest(**request_fields),  # type: ignore[arg-type]
            metadata=api.viewer,
        )
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in (refused.value.details() or "")
