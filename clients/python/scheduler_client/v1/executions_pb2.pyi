import datetime

from google.protobuf import struct_pb2 as _struct_pb2
from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ExecutionState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    EXECUTION_STATE_UNSPECIFIED: _ClassVar[ExecutionState]
    EXECUTION_STATE_QUEUED: _ClassVar[ExecutionState]
    EXECUTION_STATE_RUNNING: _ClassVar[ExecutionState]
    EXECUTION_STATE_SUCCEEDED: _ClassVar[ExecutionState]
    EXECUTION_STATE_FAILED: _ClassVar[ExecutionState]
    EXECUTION_STATE_TIMED_OUT: _ClassVar[ExecutionState]
    EXECUTION_STATE_CANCELLED: _ClassVar[ExecutionState]
    EXECUTION_STATE_DEAD: _ClassVar[ExecutionState]
    EXECUTION_STATE_ABANDONED: _ClassVar[ExecutionState]
    EXECUTION_STATE_SKIPPED: _ClassVar[ExecutionState]
    EXECUTION_STATE_MISSED: _ClassVar[ExecutionState]
    EXECUTION_STATE_INTERRUPTED: _ClassVar[ExecutionState]
    EXECUTION_STATE_UPSTREAM_FAILED: _ClassVar[ExecutionState]

class Trigger(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TRIGGER_UNSPECIFIED: _ClassVar[Trigger]
    TRIGGER_SCHEDULE: _ClassVar[Trigger]
    TRIGGER_MANUAL: _ClassVar[Trigger]
    TRIGGER_RETRY: _ClassVar[Trigger]
    TRIGGER_BACKFILL: _ClassVar[Trigger]
    TRIGGER_DLQ_REQUEUE: _ClassVar[Trigger]
    TRIGGER_UPSTREAM: _ClassVar[Trigger]

class ExecutionView(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    EXECUTION_VIEW_UNSPECIFIED: _ClassVar[ExecutionView]
    EXECUTION_VIEW_BASIC: _ClassVar[ExecutionView]
    EXECUTION_VIEW_FULL: _ClassVar[ExecutionView]

class EventType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    EVENT_TYPE_UNSPECIFIED: _ClassVar[EventType]
    EVENT_TYPE_CREATED: _ClassVar[EventType]
    EVENT_TYPE_STARTED: _ClassVar[EventType]
    EVENT_TYPE_SUCCEEDED: _ClassVar[EventType]
    EVENT_TYPE_FAILED: _ClassVar[EventType]
    EVENT_TYPE_TIMED_OUT: _ClassVar[EventType]
    EVENT_TYPE_RETRYING: _ClassVar[EventType]
    EVENT_TYPE_DEAD: _ClassVar[EventType]
    EVENT_TYPE_CANCELLED: _ClassVar[EventType]
    EVENT_TYPE_ABANDONED: _ClassVar[EventType]
    EVENT_TYPE_SKIPPED: _ClassVar[EventType]
    EVENT_TYPE_MISSED: _ClassVar[EventType]
    EVENT_TYPE_INTERRUPTED: _ClassVar[EventType]
    EVENT_TYPE_UPSTREAM_FAILED: _ClassVar[EventType]

class TriggerRule(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TRIGGER_RULE_UNSPECIFIED: _ClassVar[TriggerRule]
    TRIGGER_RULE_ALL_SUCCEEDED: _ClassVar[TriggerRule]
    TRIGGER_RULE_ALL_DONE: _ClassVar[TriggerRule]
    TRIGGER_RULE_ANY_FAILED: _ClassVar[TriggerRule]

class FlowRunState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FLOW_RUN_STATE_UNSPECIFIED: _ClassVar[FlowRunState]
    FLOW_RUN_STATE_RUNNING: _ClassVar[FlowRunState]
    FLOW_RUN_STATE_SUCCEEDED: _ClassVar[FlowRunState]
    FLOW_RUN_STATE_FAILED: _ClassVar[FlowRunState]
    FLOW_RUN_STATE_CANCELLED: _ClassVar[FlowRunState]
EXECUTION_STATE_UNSPECIFIED: ExecutionState
EXECUTION_STATE_QUEUED: ExecutionState
EXECUTION_STATE_RUNNING: ExecutionState
EXECUTION_STATE_SUCCEEDED: ExecutionState
EXECUTION_STATE_FAILED: ExecutionState
EXECUTION_STATE_TIMED_OUT: ExecutionState
EXECUTION_STATE_CANCELLED: ExecutionState
EXECUTION_STATE_DEAD: ExecutionState
EXECUTION_STATE_ABANDONED: ExecutionState
EXECUTION_STATE_SKIPPED: ExecutionState
EXECUTION_STATE_MISSED: ExecutionState
EXECUTION_STATE_INTERRUPTED: ExecutionState
EXECUTION_STATE_UPSTREAM_FAILED: ExecutionState
TRIGGER_UNSPECIFIED: Trigger
TRIGGER_SCHEDULE: Trigger
TRIGGER_MANUAL: Trigger
TRIGGER_RETRY: Trigger
TRIGGER_BACKFILL: Trigger
TRIGGER_DLQ_REQUEUE: Trigger
TRIGGER_UPSTREAM: Trigger
EXECUTION_VIEW_UNSPECIFIED: ExecutionView
EXECUTION_VIEW_BASIC: ExecutionView
EXECUTION_VIEW_FULL: ExecutionView
EVENT_TYPE_UNSPECIFIED: EventType
EVENT_TYPE_CREATED: EventType
EVENT_TYPE_STARTED: EventType
EVENT_TYPE_SUCCEEDED: EventType
EVENT_TYPE_FAILED: EventType
EVENT_TYPE_TIMED_OUT: EventType
EVENT_TYPE_RETRYING: EventType
EVENT_TYPE_DEAD: EventType
EVENT_TYPE_CANCELLED: EventType
EVENT_TYPE_ABANDONED: EventType
EVENT_TYPE_SKIPPED: EventType
EVENT_TYPE_MISSED: EventType
EVENT_TYPE_INTERRUPTED: EventType
EVENT_TYPE_UPSTREAM_FAILED: EventType
TRIGGER_RULE_UNSPECIFIED: TriggerRule
TRIGGER_RULE_ALL_SUCCEEDED: TriggerRule
TRIGGER_RULE_ALL_DONE: TriggerRule
TRIGGER_RULE_ANY_FAILED: TriggerRule
FLOW_RUN_STATE_UNSPECIFIED: FlowRunState
FLOW_RUN_STATE_RUNNING: FlowRunState
FLOW_RUN_STATE_SUCCEEDED: FlowRunState
FLOW_RUN_STATE_FAILED: FlowRunState
FLOW_RUN_STATE_CANCELLED: FlowRunState

class Execution(_message.Message):
    __slots__ = ("id", "run_id", "job_id", "schedule_time", "attempt", "state", "trigger", "due_time", "priority", "worker_id", "create_time", "start_time", "end_time", "error", "result", "missed_through", "missed_count", "flow_run_id", "trace_id", "blocked_by")
    ID_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    SCHEDULE_TIME_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    TRIGGER_FIELD_NUMBER: _ClassVar[int]
    DUE_TIME_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    CREATE_TIME_FIELD_NUMBER: _ClassVar[int]
    START_TIME_FIELD_NUMBER: _ClassVar[int]
    END_TIME_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    MISSED_THROUGH_FIELD_NUMBER: _ClassVar[int]
    MISSED_COUNT_FIELD_NUMBER: _ClassVar[int]
    FLOW_RUN_ID_FIELD_NUMBER: _ClassVar[int]
    TRACE_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCKED_BY_FIELD_NUMBER: _ClassVar[int]
    id: str
    run_id: str
    job_id: str
    schedule_time: _timestamp_pb2.Timestamp
    attempt: int
    state: ExecutionState
    trigger: Trigger
    due_time: _timestamp_pb2.Timestamp
    priority: int
    worker_id: str
    create_time: _timestamp_pb2.Timestamp
    start_time: _timestamp_pb2.Timestamp
    end_time: _timestamp_pb2.Timestamp
    error: str
    result: _struct_pb2.Value
    missed_through: _timestamp_pb2.Timestamp
    missed_count: int
    flow_run_id: str
    trace_id: str
    blocked_by: BlockedBy
    def __init__(self, id: _Optional[str] = ..., run_id: _Optional[str] = ..., job_id: _Optional[str] = ..., schedule_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., attempt: _Optional[int] = ..., state: _Optional[_Union[ExecutionState, str]] = ..., trigger: _Optional[_Union[Trigger, str]] = ..., due_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., priority: _Optional[int] = ..., worker_id: _Optional[str] = ..., create_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., start_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., end_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., error: _Optional[str] = ..., result: _Optional[_Union[_struct_pb2.Value, _Mapping]] = ..., missed_through: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., missed_count: _Optional[int] = ..., flow_run_id: _Optional[str] = ..., trace_id: _Optional[str] = ..., blocked_by: _Optional[_Union[BlockedBy, _Mapping]] = ...) -> None: ...

class BlockedBy(_message.Message):
    __slots__ = ("limit", "key", "since", "reason")
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    SINCE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    limit: str
    key: str
    since: _timestamp_pb2.Timestamp
    reason: str
    def __init__(self, limit: _Optional[str] = ..., key: _Optional[str] = ..., since: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., reason: _Optional[str] = ...) -> None: ...

class GetExecutionRequest(_message.Message):
    __slots__ = ("id",)
    ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    def __init__(self, id: _Optional[str] = ...) -> None: ...

class GetExecutionResponse(_message.Message):
    __slots__ = ("execution",)
    EXECUTION_FIELD_NUMBER: _ClassVar[int]
    execution: Execution
    def __init__(self, execution: _Optional[_Union[Execution, _Mapping]] = ...) -> None: ...

class ListExecutionsRequest(_message.Message):
    __slots__ = ("page_size", "page_token", "job_id", "states", "view", "flow_run_id")
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STATES_FIELD_NUMBER: _ClassVar[int]
    VIEW_FIELD_NUMBER: _ClassVar[int]
    FLOW_RUN_ID_FIELD_NUMBER: _ClassVar[int]
    page_size: int
    page_token: str
    job_id: str
    states: _containers.RepeatedScalarFieldContainer[ExecutionState]
    view: ExecutionView
    flow_run_id: str
    def __init__(self, page_size: _Optional[int] = ..., page_token: _Optional[str] = ..., job_id: _Optional[str] = ..., states: _Optional[_Iterable[_Union[ExecutionState, str]]] = ..., view: _Optional[_Union[ExecutionView, str]] = ..., flow_run_id: _Optional[str] = ...) -> None: ...

class ListExecutionsResponse(_message.Message):
    __slots__ = ("executions", "next_page_token")
    EXECUTIONS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    executions: _containers.RepeatedCompositeFieldContainer[Execution]
    next_page_token: str
    def __init__(self, executions: _Optional[_Iterable[_Union[Execution, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class CancelExecutionRequest(_message.Message):
    __slots__ = ("id",)
    ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    def __init__(self, id: _Optional[str] = ...) -> None: ...

class CancelExecutionResponse(_message.Message):
    __slots__ = ("execution",)
    EXECUTION_FIELD_NUMBER: _ClassVar[int]
    execution: Execution
    def __init__(self, execution: _Optional[_Union[Execution, _Mapping]] = ...) -> None: ...

class ExecutionEvent(_message.Message):
    __slots__ = ("cursor", "type", "execution_id", "run_id", "job_id", "attempt", "handler", "worker_id", "error", "event_time")
    CURSOR_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    EXECUTION_ID_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    HANDLER_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    EVENT_TIME_FIELD_NUMBER: _ClassVar[int]
    cursor: str
    type: EventType
    execution_id: str
    run_id: str
    job_id: str
    attempt: int
    handler: str
    worker_id: str
    error: str
    event_time: _timestamp_pb2.Timestamp
    def __init__(self, cursor: _Optional[str] = ..., type: _Optional[_Union[EventType, str]] = ..., execution_id: _Optional[str] = ..., run_id: _Optional[str] = ..., job_id: _Optional[str] = ..., attempt: _Optional[int] = ..., handler: _Optional[str] = ..., worker_id: _Optional[str] = ..., error: _Optional[str] = ..., event_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class WatchExecutionsRequest(_message.Message):
    __slots__ = ("job_ids", "types", "handler", "cursor", "flow_run_id", "max_events_per_response")
    JOB_IDS_FIELD_NUMBER: _ClassVar[int]
    TYPES_FIELD_NUMBER: _ClassVar[int]
    HANDLER_FIELD_NUMBER: _ClassVar[int]
    CURSOR_FIELD_NUMBER: _ClassVar[int]
    FLOW_RUN_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_EVENTS_PER_RESPONSE_FIELD_NUMBER: _ClassVar[int]
    job_ids: _containers.RepeatedScalarFieldContainer[str]
    types: _containers.RepeatedScalarFieldContainer[EventType]
    handler: str
    cursor: str
    flow_run_id: str
    max_events_per_response: int
    def __init__(self, job_ids: _Optional[_Iterable[str]] = ..., types: _Optional[_Iterable[_Union[EventType, str]]] = ..., handler: _Optional[str] = ..., cursor: _Optional[str] = ..., flow_run_id: _Optional[str] = ..., max_events_per_response: _Optional[int] = ...) -> None: ...

class WatchExecutionsResponse(_message.Message):
    __slots__ = ("event", "events")
    EVENT_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    event: ExecutionEvent
    events: _containers.RepeatedCompositeFieldContainer[ExecutionEvent]
    def __init__(self, event: _Optional[_Union[ExecutionEvent, _Mapping]] = ..., events: _Optional[_Iterable[_Union[ExecutionEvent, _Mapping]]] = ...) -> None: ...

class FlowNode(_message.Message):
    __slots__ = ("job_id", "job_name", "upstream_job_ids", "trigger_rule", "run_id", "execution_id", "state")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_NAME_FIELD_NUMBER: _ClassVar[int]
    UPSTREAM_JOB_IDS_FIELD_NUMBER: _ClassVar[int]
    TRIGGER_RULE_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    EXECUTION_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    job_name: str
    upstream_job_ids: _containers.RepeatedScalarFieldContainer[str]
    trigger_rule: TriggerRule
    run_id: str
    execution_id: str
    state: ExecutionState
    def __init__(self, job_id: _Optional[str] = ..., job_name: _Optional[str] = ..., upstream_job_ids: _Optional[_Iterable[str]] = ..., trigger_rule: _Optional[_Union[TriggerRule, str]] = ..., run_id: _Optional[str] = ..., execution_id: _Optional[str] = ..., state: _Optional[_Union[ExecutionState, str]] = ...) -> None: ...

class FlowRun(_message.Message):
    __slots__ = ("id", "root_job_id", "state", "create_time", "end_time", "nodes", "root_job_name", "node_count", "finished_node_count")
    ID_FIELD_NUMBER: _ClassVar[int]
    ROOT_JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    CREATE_TIME_FIELD_NUMBER: _ClassVar[int]
    END_TIME_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    ROOT_JOB_NAME_FIELD_NUMBER: _ClassVar[int]
    NODE_COUNT_FIELD_NUMBER: _ClassVar[int]
    FINISHED_NODE_COUNT_FIELD_NUMBER: _ClassVar[int]
    id: str
    root_job_id: str
    state: FlowRunState
    create_time: _timestamp_pb2.Timestamp
    end_time: _timestamp_pb2.Timestamp
    nodes: _containers.RepeatedCompositeFieldContainer[FlowNode]
    root_job_name: str
    node_count: int
    finished_node_count: int
    def __init__(self, id: _Optional[str] = ..., root_job_id: _Optional[str] = ..., state: _Optional[_Union[FlowRunState, str]] = ..., create_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., end_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., nodes: _Optional[_Iterable[_Union[FlowNode, _Mapping]]] = ..., root_job_name: _Optional[str] = ..., node_count: _Optional[int] = ..., finished_node_count: _Optional[int] = ...) -> None: ...

class GetFlowRunRequest(_message.Message):
    __slots__ = ("id",)
    ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    def __init__(self, id: _Optional[str] = ...) -> None: ...

class GetFlowRunResponse(_message.Message):
    __slots__ = ("flow_run",)
    FLOW_RUN_FIELD_NUMBER: _ClassVar[int]
    flow_run: FlowRun
    def __init__(self, flow_run: _Optional[_Union[FlowRun, _Mapping]] = ...) -> None: ...

class CancelFlowRunRequest(_message.Message):
    __slots__ = ("id",)
    ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    def __init__(self, id: _Optional[str] = ...) -> None: ...

class CancelFlowRunResponse(_message.Message):
    __slots__ = ("flow_run",)
    FLOW_RUN_FIELD_NUMBER: _ClassVar[int]
    flow_run: FlowRun
    def __init__(self, flow_run: _Optional[_Union[FlowRun, _Mapping]] = ...) -> None: ...

class ExecutionFilter(_message.Message):
    __slots__ = ("job_id", "job_name", "states", "handler", "queue", "start_time", "end_time", "error_contains")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_NAME_FIELD_NUMBER: _ClassVar[int]
    STATES_FIELD_NUMBER: _ClassVar[int]
    HANDLER_FIELD_NUMBER: _ClassVar[int]
    QUEUE_FIELD_NUMBER: _ClassVar[int]
    START_TIME_FIELD_NUMBER: _ClassVar[int]
    END_TIME_FIELD_NUMBER: _ClassVar[int]
    ERROR_CONTAINS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    job_name: str
    states: _containers.RepeatedScalarFieldContainer[ExecutionState]
    handler: str
    queue: str
    start_time: _timestamp_pb2.Timestamp
    end_time: _timestamp_pb2.Timestamp
    error_contains: str
    def __init__(self, job_id: _Optional[str] = ..., job_name: _Optional[str] = ..., states: _Optional[_Iterable[_Union[ExecutionState, str]]] = ..., handler: _Optional[str] = ..., queue: _Optional[str] = ..., start_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., end_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., error_contains: _Optional[str] = ...) -> None: ...

class BatchCancelExecutionsRequest(_message.Message):
    __slots__ = ("ids", "filter", "validate_only")
    IDS_FIELD_NUMBER: _ClassVar[int]
    FILTER_FIELD_NUMBER: _ClassVar[int]
    VALIDATE_ONLY_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[str]
    filter: ExecutionFilter
    validate_only: bool
    def __init__(self, ids: _Optional[_Iterable[str]] = ..., filter: _Optional[_Union[ExecutionFilter, _Mapping]] = ..., validate_only: _Optional[bool] = ...) -> None: ...

class BatchCancelExecutionsResponse(_message.Message):
    __slots__ = ("matched_count", "run_ids")
    MATCHED_COUNT_FIELD_NUMBER: _ClassVar[int]
    RUN_IDS_FIELD_NUMBER: _ClassVar[int]
    matched_count: int
    run_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, matched_count: _Optional[int] = ..., run_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class BatchRetryExecutionsRequest(_message.Message):
    __slots__ = ("ids", "filter", "validate_only", "dead_only")
    IDS_FIELD_NUMBER: _ClassVar[int]
    FILTER_FIELD_NUMBER: _ClassVar[int]
    VALIDATE_ONLY_FIELD_NUMBER: _ClassVar[int]
    DEAD_ONLY_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[str]
    filter: ExecutionFilter
    validate_only: bool
    dead_only: bool
    def __init__(self, ids: _Optional[_Iterable[str]] = ..., filter: _Optional[_Union[ExecutionFilter, _Mapping]] = ..., validate_only: _Optional[bool] = ..., dead_only: _Optional[bool] = ...) -> None: ...

class BatchRetryExecutionsResponse(_message.Message):
    __slots__ = ("matched_count", "run_ids")
    MATCHED_COUNT_FIELD_NUMBER: _ClassVar[int]
    RUN_IDS_FIELD_NUMBER: _ClassVar[int]
    matched_count: int
    run_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, matched_count: _Optional[int] = ..., run_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class ListFlowRunsRequest(_message.Message):
    __slots__ = ("page_size", "page_token", "root_job_id", "state")
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    ROOT_JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    page_size: int
    page_token: str
    root_job_id: str
    state: FlowRunState
    def __init__(self, page_size: _Optional[int] = ..., page_token: _Optional[str] = ..., root_job_id: _Optional[str] = ..., state: _Optional[_Union[FlowRunState, str]] = ...) -> None: ...

class ListFlowRunsResponse(_message.Message):
    __slots__ = ("flow_runs", "next_page_token")
    FLOW_RUNS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    flow_runs: _containers.RepeatedCompositeFieldContainer[FlowRun]
    next_page_token: str
    def __init__(self, flow_runs: _Optional[_Iterable[_Union[FlowRun, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...
