"""ExecutionService: execution history, cancellation and the live event stream."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import replace
from datetime import datetime
from typing import Any, Final

import grpc
from scheduler_client.v1 import executions_pb2, executions_pb2_grpc

from scheduler_grpc import pagetokens, redaction
from scheduler_grpc.application import Api
from scheduler_grpc.auth import current_principal
from scheduler_grpc.control import FlowMembers
from scheduler_grpc.control_bulk import ExecutionAction
from scheduler_grpc.errors import InvalidArgument
from scheduler_grpc.events import EventFilter, SubscriberTooSlow
from scheduler_grpc.executions import Execution
from scheduler_grpc.services import bulk, convert

Context = grpc.aio.ServicerContext[Any, Any]

CURSOR_METADATA: Final = "x-scheduler-cursor"
"""Initial metadata of WatchExecutions: where the stream starts (resume from it if no event came)."""
MAX_JOB_FILTERS: Final = 1000


def _shown(execution: Execution) -> executions_pb2.Execution:
    """`execution` as the caller may read it (result secrets and error credentials redacted below
    `redaction.SECRET_READER`)."""
    return convert.execution_to_proto(redaction.execution_for(current_principal().role, execution))


def _basic_execution(execution: Execution) -> executions_pb2.Execution:
    message = convert.execution_to_proto(execution)
    message.ClearField("result")
    message.ClearField("error")
    return message


_NO_JOB: Final = "-"  # a job id no job has: filters every event out


class ExecutionService(executions_pb2_grpc.ExecutionServiceServicer):
    """Reads, cancels and streams executions (the rights are in `auth.METHOD_ROLES`)."""

    def __init__(self, api: Api) -> None:
        self._control = api.control
        self._fanout = api.fanout
        self._metrics = api.metrics

    async def GetExecution(
        self, request: executions_pb2.GetExecutionRequest, context: Context
    ) -> executions_pb2.GetExecutionResponse:
        execution = await self._control.get_execution(convert.resource_id(request.id))
        return executions_pb2.GetExecutionResponse(execution=_shown(execution))

    async def ListExecutions(
        self, request: executions_pb2.ListExecutionsRequest, context: Context
    ) -> executions_pb2.ListExecutionsResponse:
        basic = convert.basic_execution_view(request.view)
        page = await self._control.list_executions(
            job_id=convert.resource_id(request.job_id, "job_id") if request.job_id else None,
            statuses=convert.execution_states(request.states),
            page_size=convert.page_size(request.page_size),
            page_token=request.page_token,
            with_output=not basic,
            flow_run_id=convert.resource_id(request.flow_run_id, "flow_run_id") if request.flow_run_id else None,
        )
        executions, cut = convert.fill_page(page.executions, _basic_execution if basic else _shown)
        token = page.token_after(page.executions[len(executions) - 1]) if cut else page.next_page_token
        return executions_pb2.ListExecutionsResponse(executions=executions, next_page_token=token)

    async def CancelExecution(
        self, request: executions_pb2.CancelExecutionRequest, context: Context
    ) -> executions_pb2.CancelExecutionResponse:
        execution = await self._control.cancel_execution(convert.resource_id(request.id))
        return executions_pb2.CancelExecutionResponse(execution=_shown(execution))

    async def GetFlowRun(
        self, request: executions_pb2.GetFlowRunRequest, context: Context
    ) -> executions_pb2.GetFlowRunResponse:
        flow = await self._control.get_flow_run(convert.resource_id(request.id))
        return executions_pb2.GetFlowRunResponse(flow_run=convert.flow_run_to_proto(flow))

    async def CancelFlowRun(
        self, request: executions_pb2.CancelFlowRunRequest, context: Context
    ) -> executions_pb2.CancelFlowRunResponse:
        flow = await self._control.cancel_flow_run(convert.resource_id(request.id))
        return executions_pb2.CancelFlowRunResponse(flow_run=convert.flow_run_to_proto(flow))

    async def BatchCancelExecutions(
        self, request: executions_pb2.BatchCancelExecutionsRequest, context: Context
    ) -> executions_pb2.BatchCancelExecutionsResponse:
        done = await bulk.executions(self._control, ExecutionAction.CANCEL, request)
        return executions_pb2.BatchCancelExecutionsResponse(matched_count=done.matched, run_ids=done.done)

    async def BatchRetryExecutions(
        self, request: executions_pb2.BatchRetryExecutionsRequest, context: Context
    ) -> executions_pb2.BatchRetryExecutionsResponse:
        action = ExecutionAction.REQUEUE if request.dead_only else ExecutionAction.RETRY
        done = await bulk.executions(self._control, action, request)
        return executions_pb2.BatchRetryExecutionsResponse(matched_count=done.matched, run_ids=done.done)

    async def ListFlowRuns(
        self, request: executions_pb2.ListFlowRunsRequest, context: Context
    ) -> executions_pb2.ListFlowRunsResponse:
        size = convert.page_size(request.page_size)
        root = convert.resource_id(request.root_job_id, "root_job_id") if request.root_job_id else None
        state = convert.flow_run_state(request.state)
        scope = {"root": root or "", "state": state or ""}
        before = None
        if request.page_token:
            position = pagetokens.decode(request.page_token, "flow_runs", scope)
            if len(position) != 2 or not all(isinstance(value, str) for value in position):
                raise InvalidArgument("page_token", "not a token this server issued")
            try:
                before = (datetime.fromisoformat(position[0]), position[1])
            except ValueError:
                raise InvalidArgument("page_token", "not a token this server issued") from None
        rows = await self._control.flow_reads.list_flow_runs(
            root_job_id=root, state=state, before=before, limit=size + 1
        )
        token = ""
        if len(rows) > size:
            rows = rows[:size]
            token = pagetokens.encode("flow_runs", scope, [rows[-1].created_at.isoformat(), rows[-1].id])
        return executions_pb2.ListFlowRunsResponse(
            flow_runs=[convert.flow_run_summary_to_proto(row) for row in rows], next_page_token=token
        )

    async def WatchExecutions(
        self, request: executions_pb2.WatchExecutionsRequest, context: Context
    ) -> AsyncIterator[executions_pb2.WatchExecutionsResponse]:
        if len(request.job_ids) > MAX_JOB_FILTERS:
            raise InvalidArgument("job_ids", f"at most {MAX_JOB_FILTERS} jobs")
        job_ids = frozenset(convert.resource_id(job_id, f"job_ids[{i}]") for i, job_id in enumerate(request.job_ids))
        members: FlowMembers | None = None
        if request.flow_run_id:
            members = await self._control.flow_members(convert.resource_id(request.flow_run_id, "flow_run_id"))
            # Only the flow run's jobs can have events of it: the stream is filtered by them first.
            job_ids = (job_ids & members.job_ids if job_ids else members.job_ids) or frozenset({_NO_JOB})
        event_filter = EventFilter(job_ids=job_ids, types=convert.event_types(request.types), handler=request.handler)
        role = current_principal().role
        try:
            async with self._fanout.subscribe(event_filter, request.cursor or None) as subscription:
                self._metrics.watchers(self._fanout.subscriber_count)
                # Headers go out once the subscription is live: a client that waits for them knows
                # every later event will reach it, and where to resume if none comes.
                await context.send_initial_metadata(((CURSOR_METADATA, subscription.cursor),))
                async for event in subscription:
                    if members is None or await members.contains(event.run_id):
                        # An error as the caller may read it (credentials redacted below admin).
                        yield convert.event_response(replace(event, error=redaction.error_for(role, event.error)))
        except SubscriberTooSlow:
            self._metrics.watcher_too_slow()
            raise
        finally:
            self._metrics.watchers(self._fanout.subscriber_count)
