"""Messages <-> domain: every translation between `scheduler.v1` messages and domain objects.

Domain validation names domain fields (`cron`, `retry_policy.max_retries`); `job_fields` re-raises
those errors with the request's field path (`job.schedule.cron`), so the client is told exactly
which field of its message is wrong.
"""

from __future__ import annotations

import contextlib
import math
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

from google.protobuf import duration_pb2, struct_pb2, timestamp_pb2
from google.protobuf.json_format import ParseDict
from google.protobuf.message import Message
from scheduler_client.v1 import auth_pb2, cluster_pb2, executions_pb2, jobs_pb2, limits_pb2, queue_pb2

from scheduler_grpc import outputs
from scheduler_grpc.auth import USER_ROLES, ApiKeyRecord, Role
from scheduler_grpc.control import DeadItem
from scheduler_grpc.control_flows import FlowRunSummary
from scheduler_grpc.control_limit_keys import LimitKeyState
from scheduler_grpc.errors import InvalidArgument
from scheduler_grpc.events import EventType, ExecutionEvent
from scheduler_grpc.executions import Execution, ExecutionStatus, Trigger
from scheduler_grpc.flows import FINAL_STATUSES, FlowRun, TriggerRule
from scheduler_grpc.handlers import handler_of_breaker_key
from scheduler_grpc.items import item_breaker_key
from scheduler_grpc.jobs import (
    ConcurrencyPolicy,
    Job,
    JobSpec,
    JobStatus,
    MisfirePolicy,
    RetryPolicy,
    ScheduleKind,
)
from scheduler_grpc.limits import Limit, LimitKind, LimitRef, LimitSpec, Override
from scheduler_grpc.schedule import DstEffect, FireTime, FoldPolicy, GapPolicy
from scheduler_grpc.sharding import ShardChange, ShardHistory

E = TypeVar("E")
T = TypeVar("T")
M = TypeVar("M", bound=Message)
DEFAULT_PAGE_SIZE = 100
MAX_PAGE_SIZE = 1000
MAX_PAGE_BYTES = 1024 * 1024
"""A list response stops adding items at this serialized size (its token resumes after the last).

Items are bounded (a payload or result at most 64 KiB, an error 8 KiB), so a page stays far below
gRPC's default 4 MiB receive limit whatever its page_size."""
_DEFAULT_RETRY = RetryPolicy()
_DEFAULT_TIMEOUT = timedelta(minutes=5)

# Domain field -> field path in a request carrying a `job` (CreateJob, UpdateJob).
_JOB_FIELDS = {
    "name": "job.name",
    "handler": "job.handler",
    "payload": "job.payload",
    "queue": "job.queue",
    "priority": "job.priority",
    "schedule_kind": "job.schedule",
    "cron": "job.schedule.cron",
    "time_zone": "job.schedule.time_zone",
    "run_at": "job.schedule.run_time",
    "dst_gap_policy": "job.schedule.dst_gap_policy",
    "dst_fold_policy": "job.schedule.dst_fold_policy",
    "timeout": "job.timeout",
    "misfire_policy": "job.misfire_policy",
    "concurrency_policy": "job.concurrency_policy",
    "status": "job.state",
    "depends_on": "job.depends_on",
    "trigger_rule": "job.trigger_rule",
    "id": "job.id",
}
# Domain field -> field path in PreviewScheduleRequest.
SCHEDULE_FIELDS = {
    "cron": "schedule.cron",
    "time_zone": "schedule.time_zone",
    "dst_gap_policy": "schedule.dst_gap_policy",
    "dst_fold_policy": "schedule.dst_fold_policy",
}


def _remap(field: str, mapping: Mapping[str, str]) -> str:
    if field in mapping:
        return mapping[field]
    head, dot, rest = field.partition(".")
    if dot and head == "payload":
        return f"job.payload.{rest}"
    if dot and head == "retry_policy":
        return f"job.{field}"
    if field.startswith(("depends_on[", "limits[")) or field == "limits":
        return f"job.{field}"
    return field


@contextlib.contextmanager
def renamed_fields(mapping: Mapping[str, str]) -> Iterator[None]:
    """Re-raise `InvalidArgument` with its domain field renamed to the request's field path."""
    try:
        yield
    except InvalidArgument as exc:
        field = _remap(exc.field, mapping)
        if field == exc.field:
            raise
        raise InvalidArgument(field, exc.message) from None


def job_fields() -> contextlib.AbstractContextManager[None]:
    """`renamed_fields` for requests that carry a `job`."""
    return renamed_fields(_JOB_FIELDS)


# -- scalars ----------------------------------------------------------------------------------------


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def timestamp(value: datetime | None) -> timestamp_pb2.Timestamp | None:
    """An aware datetime as a Timestamp (None stays None, so the field stays unset)."""
    if value is None:
        return None
    # Integer arithmetic on the timedelta: FromDatetime converts through a float timestamp and a
    # second datetime, ~3x the cost, and an execution carries up to five of these.
    delta = value - _EPOCH
    return timestamp_pb2.Timestamp(seconds=delta.days * 86_400 + delta.seconds, nanos=delta.microseconds * 1000)


# The ranges google.protobuf.Timestamp and Duration define (0001-01-01 to 9999-12-31; about 10,000
# years): values outside are malformed messages, refused with the field named before any arithmetic.
_TIMESTAMP_MIN_SECONDS = -62_135_596_800
_TIMESTAMP_MAX_SECONDS = 253_402_300_799
_DURATION_MAX_SECONDS = 315_576_000_000
_NANOS_MAX = 999_999_999


def from_timestamp(message: timestamp_pb2.Timestamp, field: str) -> datetime:
    """A Timestamp as an aware UTC datetime.

    Raises:
        InvalidArgument: outside 0001-01-01..9999-12-31 or nanos outside 0..999,999,999, naming `field`.
    """
    if not 0 <= message.nanos <= _NANOS_MAX:
        raise InvalidArgument(field, f"nanos must be between 0 and {_NANOS_MAX}, got {message.nanos}")
    if not _TIMESTAMP_MIN_SECONDS <= message.seconds <= _TIMESTAMP_MAX_SECONDS:
        raise InvalidArgument(field, "must be between 0001-01-01T00:00:00Z and 9999-12-31T23:59:59Z")
    return message.ToDatetime(tzinfo=UTC)


def from_duration(message: duration_pb2.Duration, field: str) -> timedelta:
    """A Duration as a timedelta.

    Raises:
        InvalidArgument: seconds beyond +-10,000 years, nanos beyond +-999,999,999, or seconds and
            nanos of opposite signs (a malformed Duration), naming `field`.
    """
    seconds, nanos = message.seconds, message.nanos
    if not -_NANOS_MAX <= nanos <= _NANOS_MAX:
        raise InvalidArgument(field, f"nanos must be between -{_NANOS_MAX} and {_NANOS_MAX}, got {nanos}")
    if (seconds > 0 and nanos < 0) or (seconds < 0 and nanos > 0):
        raise InvalidArgument(field, "seconds and nanos must have the same sign")
    if not -_DURATION_MAX_SECONDS <= seconds <= _DURATION_MAX_SECONDS:
        raise InvalidArgument(field, f"seconds must be between -{_DURATION_MAX_SECONDS} and {_DURATION_MAX_SECONDS}")
    return message.ToTimedelta()


def duration(value: timedelta) -> duration_pb2.Duration:
    message = duration_pb2.Duration()
    message.FromTimedelta(value)
    return message


def fill_page(
    items: Sequence[T], to_message: Callable[[T], M], max_bytes: int = MAX_PAGE_BYTES
) -> tuple[list[M], bool]:
    """Messages for `items`, in order, while the page stays within `max_bytes` (at least one).

    Returns:
        The messages, and whether the page was cut short (then the next page token must resume
        after the last message's item, not after the last of `items`).
    """
    messages: list[M] = []
    total = 0
    for item in items:
        message = to_message(item)
        size = message.ByteSize() + 8  # the field's tag and length prefix
        if messages and total + size > max_bytes:
            return messages, True
        messages.append(message)
        total += size
    return messages, False


def page_size(value: int, field: str = "page_size") -> int:
    """A request's page size: 0 means the default; 1..1000 otherwise.

    Raises:
        InvalidArgument: negative or above the maximum.
    """
    if not 0 <= value <= MAX_PAGE_SIZE:
        raise InvalidArgument(field, f"must be between 0 and {MAX_PAGE_SIZE}")
    return value or DEFAULT_PAGE_SIZE


def resource_id(value: str, field: str = "id") -> str:
    """A resource id from a request: required, a UUID.

    Raises:
        InvalidArgument: empty or not a UUID, naming `field`.
    """
    if not value:
        raise InvalidArgument(field, "required")
    try:
        return str(uuid.UUID(value))
    except ValueError:
        raise InvalidArgument(field, f"{value[:64]!r} is not a valid id") from None


def _json_numbers(value: Any) -> Any:
    # Struct keeps every number as a double; JSON does not tell 3 from 3.0, handlers often want 3.
    if isinstance(value, float) and math.isfinite(value) and value.is_integer() and abs(value) < 2**53:
        return int(value)
    if isinstance(value, dict):
        return {key: _json_numbers(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_json_numbers(item) for item in value]
    return value


def _from_value(value: struct_pb2.Value) -> Any:
    # By hand rather than MessageToDict, which raises ValueError on NaN and Infinity: they are kept
    # here, and `jobs.check_json` refuses them with their field path.
    kind = value.WhichOneof("kind")
    if kind == "struct_value":
        return struct_to_dict(value.struct_value)
    if kind == "list_value":
        return [_from_value(item) for item in value.list_value.values]
    if kind == "number_value":
        return _json_numbers(value.number_value)
    if kind == "string_value":
        return value.string_value
    if kind == "bool_value":
        return value.bool_value
    return None  # null_value, or no kind set


def value_to_json(value: struct_pb2.Value) -> Any:
    """A Value as JSON (integral numbers as ints; not validated)."""
    return _from_value(value)


def struct_to_dict(message: struct_pb2.Struct) -> dict[str, Any]:
    """A Struct as a dict (integral numbers as ints; not validated: see `jobs.check_json`)."""
    return {key: _from_value(item) for key, item in message.fields.items()}


def dict_to_struct(value: Mapping[str, Any]) -> struct_pb2.Struct:
    message = struct_pb2.Struct()
    message.update(value)
    return message


def json_value(value: Any) -> struct_pb2.Value:
    message = struct_pb2.Value()
    ParseDict(value, message)
    return message


# -- enums: explicit maps, so a new enum value on either side is a visible gap, not a silent mismatch --

_GAP = {GapPolicy.SHIFT: jobs_pb2.DST_GAP_POLICY_SHIFT, GapPolicy.SKIP: jobs_pb2.DST_GAP_POLICY_SKIP}
_FOLD = {FoldPolicy.FIRST: jobs_pb2.DST_FOLD_POLICY_FIRST, FoldPolicy.BOTH: jobs_pb2.DST_FOLD_POLICY_BOTH}
_MISFIRE = {
    MisfirePolicy.RUN_ONCE: jobs_pb2.MISFIRE_POLICY_RUN_ONCE,
    MisfirePolicy.SKIP: jobs_pb2.MISFIRE_POLICY_SKIP,
    MisfirePolicy.RUN_ALL: jobs_pb2.MISFIRE_POLICY_RUN_ALL,
}
_CONCURRENCY = {
    ConcurrencyPolicy.ALLOW: jobs_pb2.CONCURRENCY_POLICY_ALLOW,
    ConcurrencyPolicy.FORBID: jobs_pb2.CONCURRENCY_POLICY_FORBID,
    ConcurrencyPolicy.REPLACE: jobs_pb2.CONCURRENCY_POLICY_REPLACE,
}
_JOB_STATE = {JobStatus.ACTIVE: jobs_pb2.JOB_STATE_ACTIVE, JobStatus.PAUSED: jobs_pb2.JOB_STATE_PAUSED}
_DST_EFFECT = {
    DstEffect.NONE: jobs_pb2.DST_EFFECT_NONE,
    DstEffect.SHIFTED: jobs_pb2.DST_EFFECT_SHIFTED,
    DstEffect.REPEATED: jobs_pb2.DST_EFFECT_REPEATED,
}
_EXECUTION_STATE = {
    ExecutionStatus.QUEUED: executions_pb2.EXECUTION_STATE_QUEUED,
    ExecutionStatus.RUNNING: executions_pb2.EXECUTION_STATE_RUNNING,
    ExecutionStatus.SUCCEEDED: executions_pb2.EXECUTION_STATE_SUCCEEDED,
    ExecutionStatus.FAILED: executions_pb2.EXECUTION_STATE_FAILED,
    ExecutionStatus.TIMED_OUT: executions_pb2.EXECUTION_STATE_TIMED_OUT,
    ExecutionStatus.CANCELLED: executions_pb2.EXECUTION_STATE_CANCELLED,
    ExecutionStatus.DEAD: executions_pb2.EXECUTION_STATE_DEAD,
    ExecutionStatus.ABANDONED: executions_pb2.EXECUTION_STATE_ABANDONED,
    ExecutionStatus.INTERRUPTED: executions_pb2.EXECUTION_STATE_INTERRUPTED,
    ExecutionStatus.SKIPPED: executions_pb2.EXECUTION_STATE_SKIPPED,
    ExecutionStatus.MISSED: executions_pb2.EXECUTION_STATE_MISSED,
    ExecutionStatus.UPSTREAM_FAILED: executions_pb2.EXECUTION_STATE_UPSTREAM_FAILED,
}
_TRIGGER = {
    Trigger.SCHEDULE: executions_pb2.TRIGGER_SCHEDULE,
    Trigger.MANUAL: executions_pb2.TRIGGER_MANUAL,
    Trigger.RETRY: executions_pb2.TRIGGER_RETRY,
    Trigger.BACKFILL: executions_pb2.TRIGGER_BACKFILL,
    Trigger.DLQ_REQUEUE: executions_pb2.TRIGGER_DLQ_REQUEUE,
    Trigger.UPSTREAM: executions_pb2.TRIGGER_UPSTREAM,
}
_TRIGGER_RULE = {
    TriggerRule.ALL_SUCCEEDED: executions_pb2.TRIGGER_RULE_ALL_SUCCEEDED,
    TriggerRule.ALL_DONE: executions_pb2.TRIGGER_RULE_ALL_DONE,
    TriggerRule.ANY_FAILED: executions_pb2.TRIGGER_RULE_ANY_FAILED,
}
_FLOW_RUN_STATE = {
    "running": executions_pb2.FLOW_RUN_STATE_RUNNING,
    "succeeded": executions_pb2.FLOW_RUN_STATE_SUCCEEDED,
    "failed": executions_pb2.FLOW_RUN_STATE_FAILED,
    "cancelled": executions_pb2.FLOW_RUN_STATE_CANCELLED,
}
_EVENT_TYPE = {
    EventType.CREATED: executions_pb2.EVENT_TYPE_CREATED,
    EventType.STARTED: executions_pb2.EVENT_TYPE_STARTED,
    EventType.SUCCEEDED: executions_pb2.EVENT_TYPE_SUCCEEDED,
    EventType.FAILED: executions_pb2.EVENT_TYPE_FAILED,
    EventType.TIMED_OUT: executions_pb2.EVENT_TYPE_TIMED_OUT,
    EventType.RETRYING: executions_pb2.EVENT_TYPE_RETRYING,
    EventType.DEAD: executions_pb2.EVENT_TYPE_DEAD,
    EventType.CANCELLED: executions_pb2.EVENT_TYPE_CANCELLED,
    EventType.ABANDONED: executions_pb2.EVENT_TYPE_ABANDONED,
    EventType.INTERRUPTED: executions_pb2.EVENT_TYPE_INTERRUPTED,
    EventType.SKIPPED: executions_pb2.EVENT_TYPE_SKIPPED,
    EventType.MISSED: executions_pb2.EVENT_TYPE_MISSED,
    EventType.UPSTREAM_FAILED: executions_pb2.EVENT_TYPE_UPSTREAM_FAILED,
}
_LIMIT_KIND = {LimitKind.CONCURRENCY: limits_pb2.LIMIT_KIND_CONCURRENCY, LimitKind.RATE: limits_pb2.LIMIT_KIND_RATE}
_ROLE = {
    Role.VIEWER: auth_pb2.ROLE_VIEWER,
    Role.OPERATOR: auth_pb2.ROLE_OPERATOR,
    Role.ADMIN: auth_pb2.ROLE_ADMIN,
    Role.WORKER: auth_pb2.ROLE_WORKER,
}
_UNSET = 0  # every proto enum's UNSPECIFIED value


def _from_proto(mapping: Mapping[E, int], value: int, field: str, default: E | None = None) -> E | None:
    """The domain member for a proto enum number; `default` for UNSPECIFIED.

    Raises:
        InvalidArgument: a number the map does not know, naming `field`.
    """
    if value == _UNSET:
        return default
    for member, number in mapping.items():
        if number == value:
            return member
    raise InvalidArgument(field, f"unknown value {value}")


def _required(value: E | None) -> E:
    assert value is not None  # a default was given
    return value


# -- jobs -------------------------------------------------------------------------------------------


def job_to_proto(job: Job) -> jobs_pb2.Job:
    """A stored job as a message (etag from its version)."""
    schedule = jobs_pb2.Schedule(
        cron=job.cron or "",
        time_zone=job.time_zone,
        run_time=timestamp(job.run_at),
        dst_gap_policy=_GAP[job.dst_gap_policy],
        dst_fold_policy=_FOLD[job.dst_fold_policy],
    )
    return jobs_pb2.Job(
        id=job.id,
        name=job.name,
        handler=job.handler,
        payload=dict_to_struct(job.payload),
        schedule=schedule,
        queue=job.queue,
        priority=job.priority,
        retry_policy=jobs_pb2.RetryPolicy(
            max_retries=job.retry.max_retries,
            initial_backoff=duration(job.retry.initial_backoff),
            max_backoff=duration(job.retry.max_backoff),
            jitter=job.retry.jitter,
        ),
        timeout=duration(job.timeout),
        misfire_policy=_MISFIRE[job.misfire_policy],
        concurrency_policy=_CONCURRENCY[job.concurrency_policy],
        state=_JOB_STATE[job.status],
        next_run_time=timestamp(job.next_run_time),
        etag=job.etag,
        create_time=timestamp(job.created_at),
        update_time=timestamp(job.updated_at),
        depends_on=list(job.depends_on),
        trigger_rule=_TRIGGER_RULE[job.trigger_rule],
        limits=[limits_pb2.LimitRef(limit=ref.limit, key=ref.key, units=ref.units) for ref in job.limits],
    )


def job_spec(message: jobs_pb2.Job, status: JobStatus = JobStatus.ACTIVE) -> JobSpec:
    """The writable fields of a Job message as a spec (validated later by `validate_job`).

    Unset fields take their documented defaults. A `retry_policy` that is present is taken as
    written (max_retries 0 means no retries); an absent one means the default policy.

    Raises:
        InvalidArgument: structural errors the domain cannot see (both cron and run_time, unknown
            enum numbers), named by field path.
    """
    schedule = message.schedule
    has_run_time = message.HasField("schedule") and schedule.HasField("run_time")
    if schedule.cron and has_run_time:
        raise InvalidArgument("job.schedule", "set cron or run_time, not both")
    kind = ScheduleKind.CRON if schedule.cron else ScheduleKind.ONCE if has_run_time else ScheduleKind.MANUAL
    gap, fold = schedule_policies(schedule, "job.schedule")
    misfire = _required(_from_proto(_MISFIRE, message.misfire_policy, "job.misfire_policy", MisfirePolicy.RUN_ONCE))
    concurrency = _required(
        _from_proto(_CONCURRENCY, message.concurrency_policy, "job.concurrency_policy", ConcurrencyPolicy.ALLOW)
    )
    retry = _DEFAULT_RETRY
    if message.HasField("retry_policy"):
        policy = message.retry_policy
        retry = RetryPolicy(
            max_retries=policy.max_retries,
            initial_backoff=(
                from_duration(policy.initial_backoff, "job.retry_policy.initial_backoff")
                if policy.HasField("initial_backoff")
                else _DEFAULT_RETRY.initial_backoff
            ),
            max_backoff=(
                from_duration(policy.max_backoff, "job.retry_policy.max_backoff")
                if policy.HasField("max_backoff")
                else _DEFAULT_RETRY.max_backoff
            ),
            jitter=policy.jitter,
        )
    return JobSpec(
        name=message.name,
        handler=message.handler,
        payload=struct_to_dict(message.payload),
        schedule_kind=kind,
        cron=schedule.cron or None,
        time_zone=schedule.time_zone or "UTC",
        run_at=from_timestamp(schedule.run_time, "job.schedule.run_time") if has_run_time else None,
        dst_gap_policy=gap,
        dst_fold_policy=fold,
        queue=message.queue or "default",
        priority=message.priority,
        retry=retry,
        timeout=from_duration(message.timeout, "job.timeout") if message.HasField("timeout") else _DEFAULT_TIMEOUT,
        misfire_policy=misfire,
        concurrency_policy=concurrency,
        status=status,
        depends_on=tuple(message.depends_on),
        trigger_rule=_required(
            _from_proto(_TRIGGER_RULE, message.trigger_rule, "job.trigger_rule", TriggerRule.ALL_SUCCEEDED)
        ),
        limits=tuple(LimitRef(ref.limit, ref.key, ref.units if ref.HasField("units") else 1) for ref in message.limits),
    )


_JOB_VIEWS = frozenset(jobs_pb2.JobView.values())
_EXECUTION_VIEWS = frozenset(executions_pb2.ExecutionView.values())


def basic_job_view(value: int, field: str = "view") -> bool:
    """Whether a JobView asks for the basic view (UNSPECIFIED means FULL).

    Raises:
        InvalidArgument: an unknown number, naming `field`.
    """
    if value not in _JOB_VIEWS:
        raise InvalidArgument(field, f"unknown value {value}")
    return value == jobs_pb2.JOB_VIEW_BASIC


def basic_execution_view(value: int, field: str = "view") -> bool:
    """Whether an ExecutionView asks for the basic view (UNSPECIFIED means FULL).

    Raises:
        InvalidArgument: an unknown number, naming `field`.
    """
    if value not in _EXECUTION_VIEWS:
        raise InvalidArgument(field, f"unknown value {value}")
    return value == executions_pb2.EXECUTION_VIEW_BASIC


def job_state(value: int, field: str = "state") -> JobStatus | None:
    """A JobState filter: None when unspecified."""
    return _from_proto(_JOB_STATE, value, field)


def fire_time(fire: FireTime) -> jobs_pb2.FireTime:
    return jobs_pb2.FireTime(
        fire_time=timestamp(fire.instant), local_time=fire.local_slot.isoformat(), dst_effect=_DST_EFFECT[fire.dst]
    )


def schedule_policies(message: jobs_pb2.Schedule, path: str = "schedule") -> tuple[GapPolicy, FoldPolicy]:
    """The DST policies of a Schedule message at field path `path` (defaults when unset)."""
    gap = _from_proto(_GAP, message.dst_gap_policy, f"{path}.dst_gap_policy", GapPolicy.SHIFT)
    fold = _from_proto(_FOLD, message.dst_fold_policy, f"{path}.dst_fold_policy", FoldPolicy.FIRST)
    return _required(gap), _required(fold)


# -- executions and events --------------------------------------------------------------------------


def _set_time(field: timestamp_pb2.Timestamp, value: datetime) -> None:
    """`timestamp(value)` written into `field` in place (no message made and copied)."""
    delta = value - _EPOCH
    field.seconds = delta.days * 86_400 + delta.seconds
    field.nanos = delta.microseconds * 1000


def execution_to_proto(execution: Execution) -> executions_pb2.Execution:
    message = executions_pb2.Execution()
    fill_execution(message, execution)
    return message


def fill_execution(message: executions_pb2.Execution, execution: Execution) -> None:
    """Write `execution` into `message`, an empty message (a new one, or a field of a message being
    built, so it is not made and then copied in: half the cost per item of a BatchTriggerJobs answer).
    """
    # Only the fields that are set, times written in place: an unset field written as None or ""
    # costs as much as a set one, and a Timestamp made to be copied in twice that.
    message.id = execution.id
    message.run_id = execution.run_id
    message.job_id = execution.job_id
    message.attempt = execution.attempt
    message.state = _EXECUTION_STATE[execution.status]
    message.trigger = _TRIGGER[execution.trigger]
    if execution.priority:
        message.priority = execution.priority
    _set_time(message.schedule_time, execution.scheduled_for)
    _set_time(message.due_time, execution.due_at)
    _set_time(message.create_time, execution.created_at)
    if execution.worker_id:
        message.worker_id = execution.worker_id
    if execution.started_at is not None:
        _set_time(message.start_time, execution.started_at)
    if execution.finished_at is not None:
        _set_time(message.end_time, execution.finished_at)
    if execution.error:
        message.error = execution.error
    if execution.missed_through is not None:
        _set_time(message.missed_through, execution.missed_through)
    if execution.missed_count:
        message.missed_count = execution.missed_count
    if execution.flow_run_id:
        message.flow_run_id = execution.flow_run_id
    if execution.trace_id:
        message.trace_id = execution.trace_id
    if execution.blocked_by is not None:
        why = execution.blocked_by
        message.blocked_by.CopyFrom(
            executions_pb2.BlockedBy(limit=why.limit, key=why.key, since=timestamp(why.since), reason=why.reason)
        )
    if execution.result is not None:
        message.result.CopyFrom(_receivable(execution.result))


def _receivable(result: Any) -> struct_pb2.Value:
    """A stored result as the API returns it; one nested deeper than outputs.MAX_DEPTH (stored
    before results were bounded) as a string saying so: protobuf's Struct cannot carry ~33 levels,
    and one such result would make every page holding it fail."""
    if outputs.depth(result, stop_above=outputs.MAX_DEPTH) <= outputs.MAX_DEPTH:
        return json_value(result)
    levels = outputs.depth(result)
    return struct_pb2.Value(
        string_value=f"(result not shown: nested {levels} levels deep; the API returns at most {outputs.MAX_DEPTH})"
    )


def flow_run_to_proto(flow: FlowRun) -> executions_pb2.FlowRun:
    """A flow run with its nodes (a waiting node's state is UNSPECIFIED)."""
    return executions_pb2.FlowRun(
        id=flow.id,
        root_job_id=flow.root_job_id,
        state=_FLOW_RUN_STATE[flow.state],
        create_time=timestamp(flow.created_at),
        end_time=timestamp(flow.finished_at),
        root_job_name=next((node.job_name for node in flow.nodes if node.job_id == flow.root_job_id), ""),
        node_count=len(flow.nodes),
        finished_node_count=sum(1 for node in flow.nodes if node.status in FINAL_STATUSES),
        nodes=[
            executions_pb2.FlowNode(
                job_id=node.job_id,
                job_name=node.job_name,
                upstream_job_ids=list(node.upstream_ids),
                trigger_rule=_TRIGGER_RULE[node.trigger_rule],
                run_id=node.run_id or "",
                execution_id=node.execution_id or "",
                state=(
                    _EXECUTION_STATE[ExecutionStatus(node.status)]
                    if node.status
                    else executions_pb2.EXECUTION_STATE_UNSPECIFIED
                ),
            )
            for node in flow.nodes
        ],
    )


def execution_states(values: Sequence[int], field: str = "states") -> list[ExecutionStatus]:
    statuses = []
    for index, value in enumerate(values):
        status = _from_proto(_EXECUTION_STATE, value, f"{field}[{index}]")
        if status is None:
            raise InvalidArgument(f"{field}[{index}]", "EXECUTION_STATE_UNSPECIFIED is not a state")
        statuses.append(status)
    return statuses


def event_types(values: Sequence[int], field: str = "types") -> frozenset[EventType]:
    types = set()
    for index, value in enumerate(values):
        event_type = _from_proto(_EVENT_TYPE, value, f"{field}[{index}]")
        if event_type is None:
            raise InvalidArgument(f"{field}[{index}]", "EVENT_TYPE_UNSPECIFIED is not an event type")
        types.add(event_type)
    return frozenset(types)


def event_to_proto(event: ExecutionEvent) -> executions_pb2.ExecutionEvent:
    """An event as its message (the stream encodes each one once: `services.executions.EventWire`)."""
    return executions_pb2.ExecutionEvent(
        cursor=event.cursor,
        type=_EVENT_TYPE[event.type],
        execution_id=event.execution_id,
        run_id=event.run_id,
        job_id=event.job_id,
        attempt=event.attempt,
        handler=event.handler,
        worker_id=event.worker_id,
        error=event.error,
        event_time=timestamp(event.time),
    )


# -- auth, queues, cluster --------------------------------------------------------------------------


def role_to_proto(role: Role) -> auth_pb2.Role:
    return _ROLE[role]


def role_from_proto(value: int, field: str = "role") -> Role:
    role = _from_proto(_ROLE, value, field)
    if role is None:
        raise InvalidArgument(field, "required: ROLE_VIEWER, ROLE_OPERATOR, ROLE_ADMIN or ROLE_WORKER")
    return role


def user_role_from_proto(value: int, field: str = "role") -> Role:
    """A user's role: ROLE_WORKER is for API keys only."""
    role = _from_proto(_ROLE, value, field)
    if role is None or role not in USER_ROLES:
        raise InvalidArgument(field, "required: ROLE_VIEWER, ROLE_OPERATOR or ROLE_ADMIN (ROLE_WORKER is for API keys)")
    return role


def api_key_to_proto(record: ApiKeyRecord) -> auth_pb2.ApiKey:
    return auth_pb2.ApiKey(
        id=record.id,
        display_name=record.name,
        key_prefix=record.key_prefix,
        role=role_to_proto(Role(record.role)),
        create_time=timestamp(record.created_at),
        expire_time=timestamp(record.expires_at),
        revoke_time=timestamp(record.revoked_at),
        last_use_time=timestamp(record.last_used_at),
    )


def dead_letter(item: DeadItem) -> queue_pb2.DeadLetter:
    # The queue item's data holds the run's breaker key, which starts with its handler's name (see
    # dispatch.queue_item, items.item_data).
    return queue_pb2.DeadLetter(
        run_id=item.id,
        reason=item.reason,
        dead_time=timestamp(item.parked_at),
        priority=item.priority,
        handler=handler_of_breaker_key(item_breaker_key(item.data)),
    )


def shard_change(change: ShardChange) -> queue_pb2.QueueShardChange:
    seconds, ms = divmod(change.effective_ms, 1000)
    return queue_pb2.QueueShardChange(
        shards=change.shards, effective_time=timestamp_pb2.Timestamp(seconds=seconds, nanos=ms * 1_000_000)
    )


def queue_shards(history: ShardHistory) -> queue_pb2.QueueShards:
    return queue_pb2.QueueShards(
        queue=history.queue,
        shards=history.shards,
        served_shards=history.served,
        changes=[shard_change(change) for change in history.changes],
    )


_BREAKER_STATES = {
    "closed": cluster_pb2.BREAKER_STATE_CLOSED,
    "open": cluster_pb2.BREAKER_STATE_OPEN,
    "half_open": cluster_pb2.BREAKER_STATE_HALF_OPEN,
}


def breaker_state(value: str) -> cluster_pb2.BreakerState:
    return _BREAKER_STATES.get(value, cluster_pb2.BREAKER_STATE_UNSPECIFIED)


def list_value(values: Sequence[Any]) -> struct_pb2.ListValue:
    message = struct_pb2.ListValue()
    message.extend(values)
    return message


def now() -> datetime:
    """The current time, UTC (one place, so tests can reason about "now")."""
    return datetime.now(UTC)


def flow_run_summary_to_proto(flow: FlowRunSummary) -> executions_pb2.FlowRun:
    """A flow run as ListFlowRuns returns it (without nodes)."""
    return executions_pb2.FlowRun(
        id=flow.id,
        root_job_id=flow.root_job_id,
        state=_FLOW_RUN_STATE[flow.state],
        create_time=timestamp(flow.created_at),
        end_time=timestamp(flow.finished_at),
        root_job_name=flow.root_job_name,
        node_count=flow.nodes,
        finished_node_count=flow.finished_nodes,
    )


def flow_run_state(value: int, field: str = "state") -> str | None:
    """A flow run state filter (None for UNSPECIFIED: any state).

    Raises:
        InvalidArgument: an unknown value, naming `field`.
    """
    return _from_proto(_FLOW_RUN_STATE, value, field)


# -- limits -----------------------------------------------------------------------------------------

# Domain field -> field path in a request carrying a `limit` (CreateLimit, UpdateLimit).
_LIMIT_FIELDS = {
    "name": "limit.name",
    "kind": "limit.kind",
    "limit": "limit.limit",
    "period": "limit.period",
    "burst": "limit.burst",
    "overrides": "limit.overrides",
    "id": "limit.id",
}


@contextlib.contextmanager
def limit_fields() -> Iterator[None]:
    """Re-raise `InvalidArgument` with its domain field as the request's path (`limit.period`,
    `limit.overrides['acme'].limit`)."""
    try:
        yield
    except InvalidArgument as exc:
        field = _LIMIT_FIELDS.get(exc.field)
        if field is None and exc.field.startswith("overrides["):
            field = f"limit.{exc.field}"
        if field is None:
            raise
        raise InvalidArgument(field, exc.message) from None


def limit_to_proto(limit: Limit) -> limits_pb2.Limit:
    """A stored limit as a message (etag from its version)."""
    return limits_pb2.Limit(
        id=limit.id,
        name=limit.name,
        kind=_LIMIT_KIND[limit.kind],
        limit=limit.limit,
        period=duration(limit.period) if limit.period is not None else None,
        burst=limit.burst,
        overrides={
            key: limits_pb2.LimitOverride(limit=value.limit, burst=value.burst)
            for key, value in limit.overrides.items()
        },
        etag=limit.etag,
        create_time=timestamp(limit.created_at),
        update_time=timestamp(limit.updated_at),
    )


def limit_spec(message: limits_pb2.Limit) -> LimitSpec:
    """The writable fields of a Limit message as a spec (validated later by `validate_limit`).

    Raises:
        InvalidArgument: an unset or unknown kind (`limit.kind`), a malformed period (`limit.period`).
    """
    kind = _from_proto(_LIMIT_KIND, message.kind, "limit.kind")
    if kind is None:
        raise InvalidArgument("limit.kind", "required: LIMIT_KIND_CONCURRENCY or LIMIT_KIND_RATE")
    return LimitSpec(
        name=message.name,
        kind=kind,
        limit=message.limit,
        period=from_duration(message.period, "limit.period") if message.HasField("period") else None,
        burst=message.burst,
        overrides={key: override(value) for key, value in message.overrides.items()},
    )


def override(message: limits_pb2.LimitOverride) -> Override:
    """A LimitOverride message as the domain's (validated with its limit)."""
    return Override(message.limit, message.burst)


def limit_key_state_to_proto(state: LimitKeyState) -> limits_pb2.LimitKeyState:
    """A key's state on each queue, with the sums."""
    return limits_pb2.LimitKeyState(
        limit=state.limit,
        key=state.key,
        queues=[
            limits_pb2.LimitKeyQueueState(
                queue=entry.queue,
                running_units=entry.state.running,
                queued_runs=entry.state.queued,
                next_admit_time=timestamp(entry.state.next_admission),
                pause_end_time=timestamp(entry.state.paused_until),
            )
            for entry in state.queues
        ],
        running_units=state.running,
        queued_runs=state.queued,
    )
