"""The Batch* methods of ExecutionService and JobService: requests to `control_bulk` and back."""

from __future__ import annotations

from scheduler_client.v1 import executions_pb2, jobs_pb2

from scheduler_grpc.auth import current_principal
from scheduler_grpc.control import Control
from scheduler_grpc.control_bulk import BulkOutcome, ExecutionAction, JobAction, JobFilter, Search
from scheduler_grpc.errors import InvalidArgument
from scheduler_grpc.services import convert

# The fields of a Search that come from the request's `filter` (errors name them under it).
_FILTER_FIELDS = frozenset({"job_id", "job_name", "states", "handler", "queue", "error"})

ExecutionRequest = executions_pb2.BatchCancelExecutionsRequest | executions_pb2.BatchRetryExecutionsRequest
JobRequest = jobs_pb2.BatchPauseJobsRequest | jobs_pb2.BatchResumeJobsRequest | jobs_pb2.BatchDeleteJobsRequest


def _search(message: executions_pb2.ExecutionFilter) -> Search:
    return Search(
        job_id=convert.resource_id(message.job_id, "filter.job_id") if message.job_id else None,
        job_name=message.job_name or None,
        states=tuple(s.value for s in convert.execution_states(message.states, "filter.states")),
        handler=message.handler or None,
        queue=message.queue or None,
        since=convert.from_timestamp(message.start_time, "filter.start_time")
        if message.HasField("start_time")
        else None,
        until=convert.from_timestamp(message.end_time, "filter.end_time") if message.HasField("end_time") else None,
        error=message.error_contains or None,
    )


async def executions(control: Control, action: ExecutionAction, request: ExecutionRequest) -> BulkOutcome:
    """Run a Batch*Executions request."""
    if request.ids and request.HasField("filter"):
        raise InvalidArgument("ids", "give either ids or a filter, not both")
    if not request.ids and not request.HasField("filter"):
        raise InvalidArgument("ids", "give ids or a filter")
    search = _search(request.filter) if request.HasField("filter") else None
    try:
        return await control.bulk.executions(
            action,
            ids=list(request.ids),
            search=search,
            validate_only=request.validate_only,
            reader=current_principal().role,
        )
    except InvalidArgument as exc:
        if exc.field in _FILTER_FIELDS:
            raise InvalidArgument(f"filter.{exc.field}", exc.message) from None
        raise


async def jobs(control: Control, action: JobAction, request: JobRequest, *, detach: bool = False) -> BulkOutcome:
    """Run a Batch*Jobs request."""
    if request.ids and request.HasField("filter"):
        raise InvalidArgument("ids", "give either ids or a filter, not both")
    if not request.ids and not request.HasField("filter"):
        raise InvalidArgument("ids", "give ids or a filter")
    search = None
    if request.HasField("filter"):
        given = request.filter
        state = convert.job_state(given.state, "filter.state")
        search = JobFilter(
            name=given.name_contains or None,
            state=state.value if state else None,
            handler=given.handler or None,
            queue=given.queue or None,
        )
    return await control.bulk.jobs(
        action, ids=list(request.ids), search=search, validate_only=request.validate_only, detach_dependents=detach
    )
