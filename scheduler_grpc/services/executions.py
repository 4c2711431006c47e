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
from scheduler_grpc.auth import Role, current_principal
from scheduler_grpc.control import FlowMembers
from scheduler_grpc.control_bulk import ExecutionAction
from scheduler_grpc.errors import InvalidArgument
from scheduler_grpc.events import EventFilter, ExecutionEvent, SubscriberTooSlow
from scheduler_grpc.executions import Execution
from scheduler_grpc.services import bulk, convert

Context = grpc.aio.ServicerContext[Any, Any]

CURSOR_METADATA: Final = "x-scheduler-cursor"
"""Initial metadata of WatchExecutions: where the stream starts (resume from it if no event came)."""
MAX_JOB_FILTERS: Final = 1000
MAX_EVENTS_PER_RESPONSE: Final = 1000
"""The most events one WatchExecutions response carries (a request asking for more gets this many)."""


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


def _framed(field: int, body: bytes) -> bytes:
    """`body` as the wire form of length-delimited field `field` (tag, length, bytes)."""
    size = len(body)
    head = bytearray([field << 3 | 2])
    while size > 0x7F:
        head.append(size & 0x7F | 0x80)
        size >>= 7
    head.append(size)
    return bytes(head) + body


_BATCH_BYTES: Final = 16 << 20  # joined batches kept at most (and at most `size` of them)


class EventWire:
    """WatchExecutions responses as wire bytes, each event encoded once however many subscribers
    send it (the servicer yields bytes; `decode.register`'s serializer passes them through).

    A response is the concatenation of its fields, so a batch is the join of its events, each
    framed as field 2 (`events`) once; the one-event form is the event framed as field 1 (`event`).
    The last `size` events are kept, per redaction (an error is redacted below SECRET_READER), and
    the last joined batches (`size`, 16 MiB at most): subscribers with one filter get the same
    batches (the events that filter admits, in stream order, from one to another), joined once.
    """

    def __init__(self, size: int = 4096) -> None:
        self._size = size
        # (cursor, sees secrets) -> (the event, as `event`, as one of `events`)
        self._pieces: dict[tuple[str, bool], tuple[ExecutionEvent, bytes, bytes]] = {}
        # (filter, sees secrets, first cursor, last cursor, size) -> (first, last, the response)
        self._batches: dict[tuple[EventFilter, bool, str, str, int], tuple[ExecutionEvent, ExecutionEvent, bytes]] = {}
        self._batch_bytes = 0

    def response(
        self, batch: list[ExecutionEvent], role: Role, *, batched: bool, shared: EventFilter | None = None
    ) -> bytes:
        """The response of `batch` (`events`, or its one event as `event` unless `batched`); with
        `shared`, the filter that alone selected `batch`, a batch joined before is reused."""
        secrets = redaction.sees_secrets(role)
        if not batched:
            (event,) = batch
            return self._piece(event, role, secrets)[1]
        if len(batch) == 1 or shared is None:
            return b"".join([self._piece(event, role, secrets)[2] for event in batch])
        first, last = batch[0], batch[-1]
        key = (shared, secrets, first.cursor, last.cursor, len(batch))
        joined = self._batches.get(key)
        if (
            joined is not None
            and (joined[0] is first or joined[0] == first)
            and (joined[1] is last or joined[1] == last)
        ):
            return joined[2]
        response = b"".join([self._piece(event, role, secrets)[2] for event in batch])
        while self._batches and (len(self._batches) >= self._size or self._batch_bytes > _BATCH_BYTES):
            self._batch_bytes -= len(self._batches.pop(next(iter(self._batches)))[2])  # the oldest
        self._batches[key] = (first, last, response)
        self._batch_bytes += len(response)
        return response

    def _piece(self, event: ExecutionEvent, role: Role, secrets: bool) -> tuple[ExecutionEvent, bytes, bytes]:
        key = (event.cursor, secrets)
        piece = self._pieces.get(key)
        if piece is not None and (piece[0] is event or piece[0] == event):
            return piece
        shown = event if secrets else replace(event, error=redaction.error_for(role, event.error))
        body = convert.event_to_proto(shown).SerializeToString()
        piece = (event, _framed(1, body), _framed(2, body))
        if len(self._pieces) >= self._size:
            del self._pieces[next(iter(self._pieces))]  # the oldest
        self._pieces[key] = piece
        return piece


class ExecutionService(executions_pb2_grpc.ExecutionServiceServicer):
    """Reads, cancels and streams executions (the rights are in `auth.METHOD_ROLES`)."""

    def __init__(self, api: Api) -> None:
        self._control = api.control
        self._fanout = api.fanout
        self._metrics = api.metrics
        self._wire = EventWire()

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

    async def WatchExecutions(  # type: ignore[override]  # yields wire bytes (`EventWire`), see there
        self, request: executions_pb2.WatchExecutionsRequest, context: Context
    ) -> AsyncIterator[bytes]:
        if len(request.job_ids) > MAX_JOB_FILTERS:
            raise InvalidArgument("job_ids", f"at most {MAX_JOB_FILTERS} jobs")
        if request.max_events_per_response < 0:
            raise InvalidArgument("max_events_per_response", "must not be negative")
        job_ids = frozenset(convert.resource_id(job_id, f"job_ids[{i}]") for i, job_id in enumerate(request.job_ids))
        members: FlowMembers | None = None
        if request.flow_run_id:
            members = await self._control.flow_members(convert.resource_id(request.flow_run_id, "flow_run_id"))
            # Only the flow run's jobs can have events of it: the stream is filtered by them first.
            job_ids = (job_ids & members.job_ids if job_ids else members.job_ids) or frozenset({_NO_JOB})
        event_filter = EventFilter(job_ids=job_ids, types=convert.event_types(request.types), handler=request.handler)
        batched = request.max_events_per_response > 0
        limit = min(request.max_events_per_response, MAX_EVENTS_PER_RESPONSE) if batched else 1
        role = current_principal().role
        try:
            async with self._fanout.subscribe(event_filter, request.cursor or None) as subscription:
                self._metrics.watchers(self._fanout.subscriber_count)
                # Headers go out once the subscription is live: a client that waits for them knows
                # every later event will reach it, and where to resume if none comes.
                await context.send_initial_metadata(((CURSOR_METADATA, subscription.cursor),))
                # Whatever is ready goes out in one message: a subscriber pays one write per burst,
                # not one per event, and the buffer refills while that write waits for the client.
                async for ready in subscription.batches(limit):
                    if members is None:
                        yield self._wire.response(ready, role, batched=batched, shared=event_filter)
                        continue
                    batch = [event for event in ready if await members.contains(event.run_id)]
                    if batch:
                        yield self._wire.response(batch, role, batched=batched)
        except SubscriberTooSlow:
            self._metrics.watcher_too_slow()
            raise
        finally:
            self._metrics.watchers(self._fanout.subscriber_count)
