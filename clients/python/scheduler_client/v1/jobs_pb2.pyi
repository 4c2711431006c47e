import datetime

from google.protobuf import duration_pb2 as _duration_pb2
from google.protobuf import field_mask_pb2 as _field_mask_pb2
from google.protobuf import struct_pb2 as _struct_pb2
from google.protobuf import timestamp_pb2 as _timestamp_pb2
from scheduler_client.v1 import executions_pb2 as _executions_pb2
from scheduler_client.v1 import limits_pb2 as _limits_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class JobState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    JOB_STATE_UNSPECIFIED: _ClassVar[JobState]
    JOB_STATE_ACTIVE: _ClassVar[JobState]
    JOB_STATE_PAUSED: _ClassVar[JobState]

class MisfirePolicy(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MISFIRE_POLICY_UNSPECIFIED: _ClassVar[MisfirePolicy]
    MISFIRE_POLICY_RUN_ONCE: _ClassVar[MisfirePolicy]
    MISFIRE_POLICY_SKIP: _ClassVar[MisfirePolicy]
    MISFIRE_POLICY_RUN_ALL: _ClassVar[MisfirePolicy]

class ConcurrencyPolicy(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CONCURRENCY_POLICY_UNSPECIFIED: _ClassVar[ConcurrencyPolicy]
    CONCURRENCY_POLICY_ALLOW: _ClassVar[ConcurrencyPolicy]
    CONCURRENCY_POLICY_FORBID: _ClassVar[ConcurrencyPolicy]
    CONCURRENCY_POLICY_REPLACE: _ClassVar[ConcurrencyPolicy]

class DstGapPolicy(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DST_GAP_POLICY_UNSPECIFIED: _ClassVar[DstGapPolicy]
    DST_GAP_POLICY_SHIFT: _ClassVar[DstGapPolicy]
    DST_GAP_POLICY_SKIP: _ClassVar[DstGapPolicy]

class DstFoldPolicy(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DST_FOLD_POLICY_UNSPECIFIED: _ClassVar[DstFoldPolicy]
    DST_FOLD_POLICY_FIRST: _ClassVar[DstFoldPolicy]
    DST_FOLD_POLICY_BOTH: _ClassVar[DstFoldPolicy]

class JobView(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    JOB_VIEW_UNSPECIFIED: _ClassVar[JobView]
    JOB_VIEW_BASIC: _ClassVar[JobView]
    JOB_VIEW_FULL: _ClassVar[JobView]

class DstEffect(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DST_EFFECT_UNSPECIFIED: _ClassVar[DstEffect]
    DST_EFFECT_NONE: _ClassVar[DstEffect]
    DST_EFFECT_SHIFTED: _ClassVar[DstEffect]
    DST_EFFECT_REPEATED: _ClassVar[DstEffect]
JOB_STATE_UNSPECIFIED: JobState
JOB_STATE_ACTIVE: JobState
JOB_STATE_PAUSED: JobState
MISFIRE_POLICY_UNSPECIFIED: MisfirePolicy
MISFIRE_POLICY_RUN_ONCE: MisfirePolicy
MISFIRE_POLICY_SKIP: MisfirePolicy
MISFIRE_POLICY_RUN_ALL: MisfirePolicy
CONCURRENCY_POLICY_UNSPECIFIED: ConcurrencyPolicy
CONCURRENCY_POLICY_ALLOW: ConcurrencyPolicy
CONCURRENCY_POLICY_FORBID: ConcurrencyPolicy
CONCURRENCY_POLICY_REPLACE: ConcurrencyPolicy
DST_GAP_POLICY_UNSPECIFIED: DstGapPolicy
DST_GAP_POLICY_SHIFT: DstGapPolicy
DST_GAP_POLICY_SKIP: DstGapPolicy
DST_FOLD_POLICY_UNSPECIFIED: DstFoldPolicy
DST_FOLD_POLICY_FIRST: DstFoldPolicy
DST_FOLD_POLICY_BOTH: DstFoldPolicy
JOB_VIEW_UNSPECIFIED: JobView
JOB_VIEW_BASIC: JobView
JOB_VIEW_FULL: JobView
DST_EFFECT_UNSPECIFIED: DstEffect
DST_EFFECT_NONE: DstEffect
DST_EFFECT_SHIFTED: DstEffect
DST_EFFECT_REPEATED: DstEffect

class Schedule(_message.Message):
    __slots__ = ("cron", "time_zone", "run_time", "dst_gap_policy", "dst_fold_policy")
    CRON_FIELD_NUMBER: _ClassVar[int]
    TIME_ZONE_FIELD_NUMBER: _ClassVar[int]
    RUN_TIME_FIELD_NUMBER: _ClassVar[int]
    DST_GAP_POLICY_FIELD_NUMBER: _ClassVar[int]
    DST_FOLD_POLICY_FIELD_NUMBER: _ClassVar[int]
    cron: str
    time_zone: str
    run_time: _timestamp_pb2.Timestamp
    dst_gap_policy: DstGapPolicy
    dst_fold_policy: DstFoldPolicy
    def __init__(self, cron: _Optional[str] = ..., time_zone: _Optional[str] = ..., run_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., dst_gap_policy: _Optional[_Union[DstGapPolicy, str]] = ..., dst_fold_policy: _Optional[_Union[DstFoldPolicy, str]] = ...) -> None: ...

class RetryPolicy(_message.Message):
    __slots__ = ("max_retries", "initial_backoff", "max_backoff", "jitter")
    MAX_RETRIES_FIELD_NUMBER: _ClassVar[int]
    INITIAL_BACKOFF_FIELD_NUMBER: _ClassVar[int]
    MAX_BACKOFF_FIELD_NUMBER: _ClassVar[int]
    JITTER_FIELD_NUMBER: _ClassVar[int]
    max_retries: int
    initial_backoff: _duration_pb2.Duration
    max_backoff: _duration_pb2.Duration
    jitter: bool
    def __init__(self, max_retries: _Optional[int] = ..., initial_backoff: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., max_backoff: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., jitter: _Optional[bool] = ...) -> None: ...

class Job(_message.Message):
    __slots__ = ("id", "name", "handler", "payload", "schedule", "queue", "priority", "retry_policy", "timeout", "misfire_policy", "concurrency_policy", "state", "next_run_time", "etag", "create_time", "update_time", "depends_on", "trigger_rule", "limits", "handler_served")
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    HANDLER_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    SCHEDULE_FIELD_NUMBER: _ClassVar[int]
    QUEUE_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    RETRY_POLICY_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    MISFIRE_POLICY_FIELD_NUMBER: _ClassVar[int]
    CONCURRENCY_POLICY_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    NEXT_RUN_TIME_FIELD_NUMBER: _ClassVar[int]
    ETAG_FIELD_NUMBER: _ClassVar[int]
    CREATE_TIME_FIELD_NUMBER: _ClassVar[int]
    UPDATE_TIME_FIELD_NUMBER: _ClassVar[int]
    DEPENDS_ON_FIELD_NUMBER: _ClassVar[int]
    TRIGGER_RULE_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    HANDLER_SERVED_FIELD_NUMBER: _ClassVar[int]
    id: str
    name: str
    handler: str
    payload: _struct_pb2.Struct
    schedule: Schedule
    queue: str
    priority: int
    retry_policy: RetryPolicy
    timeout: _duration_pb2.Duration
    misfire_policy: MisfirePolicy
    concurrency_policy: ConcurrencyPolicy
    state: JobState
    next_run_time: _timestamp_pb2.Timestamp
    etag: str
    create_time: _timestamp_pb2.Timestamp
    update_time: _timestamp_pb2.Timestamp
    depends_on: _containers.RepeatedScalarFieldContainer[str]
    trigger_rule: _executions_pb2.TriggerRule
    limits: _containers.RepeatedCompositeFieldContainer[_limits_pb2.LimitRef]
    handler_served: bool
    def __init__(self, id: _Optional[str] = ..., name: _Optional[str] = ..., handler: _Optional[str] = ..., payload: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ..., schedule: _Optional[_Union[Schedule, _Mapping]] = ..., queue: _Optional[str] = ..., priority: _Optional[int] = ..., retry_policy: _Optional[_Union[RetryPolicy, _Mapping]] = ..., timeout: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., misfire_policy: _Optional[_Union[MisfirePolicy, str]] = ..., concurrency_policy: _Optional[_Union[ConcurrencyPolicy, str]] = ..., state: _Optional[_Union[JobState, str]] = ..., next_run_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., etag: _Optional[str] = ..., create_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., update_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., depends_on: _Optional[_Iterable[str]] = ..., trigger_rule: _Optional[_Union[_executions_pb2.TriggerRule, str]] = ..., limits: _Optional[_Iterable[_Union[_limits_pb2.LimitRef, _Mapping]]] = ..., handler_served: _Optional[bool] = ...) -> None: ...

class CreateJobRequest(_message.Message):
    __slots__ = ("job", "request_id")
    JOB_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    job: Job
    request_id: str
    def __init__(self, job: _Optional[_Union[Job, _Mapping]] = ..., request_id: _Optional[str] = ...) -> None: ...

class CreateJobResponse(_message.Message):
    __slots__ = ("job",)
    JOB_FIELD_NUMBER: _ClassVar[int]
    job: Job
    def __init__(self, job: _Optional[_Union[Job, _Mapping]] = ...) -> None: ...

class GetJobRequest(_message.Message):
    __slots__ = ("id",)
    ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    def __init__(self, id: _Optional[str] = ...) -> None: ...

class GetJobResponse(_message.Message):
    __slots__ = ("job",)
    JOB_FIELD_NUMBER: _ClassVar[int]
    job: Job
    def __init__(self, job: _Optional[_Union[Job, _Mapping]] = ...) -> None: ...

class ListJobsRequest(_message.Message):
    __slots__ = ("page_size", "page_token", "state", "handler", "view")
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    HANDLER_FIELD_NUMBER: _ClassVar[int]
    VIEW_FIELD_NUMBER: _ClassVar[int]
    page_size: int
    page_token: str
    state: JobState
    handler: str
    view: JobView
    def __init__(self, page_size: _Optional[int] = ..., page_token: _Optional[str] = ..., state: _Optional[_Union[JobState, str]] = ..., handler: _Optional[str] = ..., view: _Optional[_Union[JobView, str]] = ...) -> None: ...

class ListJobsResponse(_message.Message):
    __slots__ = ("jobs", "next_page_token")
    JOBS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    jobs: _containers.RepeatedCompositeFieldContainer[Job]
    next_page_token: str
    def __init__(self, jobs: _Optional[_Iterable[_Union[Job, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class UpdateJobRequest(_message.Message):
    __slots__ = ("job", "update_mask", "etag")
    JOB_FIELD_NUMBER: _ClassVar[int]
    UPDATE_MASK_FIELD_NUMBER: _ClassVar[int]
    ETAG_FIELD_NUMBER: _ClassVar[int]
    job: Job
    update_mask: _field_mask_pb2.FieldMask
    etag: str
    def __init__(self, job: _Optional[_Union[Job, _Mapping]] = ..., update_mask: _Optional[_Union[_field_mask_pb2.FieldMask, _Mapping]] = ..., etag: _Optional[str] = ...) -> None: ...

class UpdateJobResponse(_message.Message):
    __slots__ = ("job",)
    JOB_FIELD_NUMBER: _ClassVar[int]
    job: Job
    def __init__(self, job: _Optional[_Union[Job, _Mapping]] = ...) -> None: ...

class DeleteJobRequest(_message.Message):
    __slots__ = ("id", "detach_dependents")
    ID_FIELD_NUMBER: _ClassVar[int]
    DETACH_DEPENDENTS_FIELD_NUMBER: _ClassVar[int]
    id: str
    detach_dependents: bool
    def __init__(self, id: _Optional[str] = ..., detach_dependents: _Optional[bool] = ...) -> None: ...

class DeleteJobResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PauseJobRequest(_message.Message):
    __slots__ = ("id",)
    ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    def __init__(self, id: _Optional[str] = ...) -> None: ...

class PauseJobResponse(_message.Message):
    __slots__ = ("job",)
    JOB_FIELD_NUMBER: _ClassVar[int]
    job: Job
    def __init__(self, job: _Optional[_Union[Job, _Mapping]] = ...) -> None: ...

class ResumeJobRequest(_message.Message):
    __slots__ = ("id",)
    ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    def __init__(self, id: _Optional[str] = ...) -> None: ...

class ResumeJobResponse(_message.Message):
    __slots__ = ("job",)
    JOB_FIELD_NUMBER: _ClassVar[int]
    job: Job
    def __init__(self, job: _Optional[_Union[Job, _Mapping]] = ...) -> None: ...

class TriggerJobRequest(_message.Message):
    __slots__ = ("id", "request_id", "payload")
    ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    id: str
    request_id: str
    payload: _struct_pb2.Struct
    def __init__(self, id: _Optional[str] = ..., request_id: _Optional[str] = ..., payload: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ...) -> None: ...

class TriggerJobResponse(_message.Message):
    __slots__ = ("execution",)
    EXECUTION_FIELD_NUMBER: _ClassVar[int]
    execution: _executions_pb2.Execution
    def __init__(self, execution: _Optional[_Union[_executions_pb2.Execution, _Mapping]] = ...) -> None: ...

class BatchTriggerJobsRequest(_message.Message):
    __slots__ = ("requests",)
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    requests: _containers.RepeatedCompositeFieldContainer[TriggerJobRequest]
    def __init__(self, requests: _Optional[_Iterable[_Union[TriggerJobRequest, _Mapping]]] = ...) -> None: ...

class BatchTriggerJobsResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[TriggerJobResult]
    def __init__(self, results: _Optional[_Iterable[_Union[TriggerJobResult, _Mapping]]] = ...) -> None: ...

class TriggerJobResult(_message.Message):
    __slots__ = ("execution", "code", "message")
    EXECUTION_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    execution: _executions_pb2.Execution
    code: int
    message: str
    def __init__(self, execution: _Optional[_Union[_executions_pb2.Execution, _Mapping]] = ..., code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class FireTime(_message.Message):
    __slots__ = ("fire_time", "local_time", "dst_effect")
    FIRE_TIME_FIELD_NUMBER: _ClassVar[int]
    LOCAL_TIME_FIELD_NUMBER: _ClassVar[int]
    DST_EFFECT_FIELD_NUMBER: _ClassVar[int]
    fire_time: _timestamp_pb2.Timestamp
    local_time: str
    dst_effect: DstEffect
    def __init__(self, fire_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., local_time: _Optional[str] = ..., dst_effect: _Optional[_Union[DstEffect, str]] = ...) -> None: ...

class PreviewScheduleRequest(_message.Message):
    __slots__ = ("schedule", "count", "start_time")
    SCHEDULE_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    START_TIME_FIELD_NUMBER: _ClassVar[int]
    schedule: Schedule
    count: int
    start_time: _timestamp_pb2.Timestamp
    def __init__(self, schedule: _Optional[_Union[Schedule, _Mapping]] = ..., count: _Optional[int] = ..., start_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class PreviewScheduleResponse(_message.Message):
    __slots__ = ("fire_times",)
    FIRE_TIMES_FIELD_NUMBER: _ClassVar[int]
    fire_times: _containers.RepeatedCompositeFieldContainer[FireTime]
    def __init__(self, fire_times: _Optional[_Iterable[_Union[FireTime, _Mapping]]] = ...) -> None: ...

class BackfillJobRequest(_message.Message):
    __slots__ = ("id", "start_time", "end_time")
    ID_FIELD_NUMBER: _ClassVar[int]
    START_TIME_FIELD_NUMBER: _ClassVar[int]
    END_TIME_FIELD_NUMBER: _ClassVar[int]
    id: str
    start_time: _timestamp_pb2.Timestamp
    end_time: _timestamp_pb2.Timestamp
    def __init__(self, id: _Optional[str] = ..., start_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., end_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class BackfillJobResponse(_message.Message):
    __slots__ = ("executions",)
    EXECUTIONS_FIELD_NUMBER: _ClassVar[int]
    executions: _containers.RepeatedCompositeFieldContainer[_executions_pb2.Execution]
    def __init__(self, executions: _Optional[_Iterable[_Union[_executions_pb2.Execution, _Mapping]]] = ...) -> None: ...

class JobFilter(_message.Message):
    __slots__ = ("name_contains", "state", "handler", "queue")
    NAME_CONTAINS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    HANDLER_FIELD_NUMBER: _ClassVar[int]
    QUEUE_FIELD_NUMBER: _ClassVar[int]
    name_contains: str
    state: JobState
    handler: str
    queue: str
    def __init__(self, name_contains: _Optional[str] = ..., state: _Optional[_Union[JobState, str]] = ..., handler: _Optional[str] = ..., queue: _Optional[str] = ...) -> None: ...

class BatchPauseJobsRequest(_message.Message):
    __slots__ = ("ids", "filter", "validate_only")
    IDS_FIELD_NUMBER: _ClassVar[int]
    FILTER_FIELD_NUMBER: _ClassVar[int]
    VALIDATE_ONLY_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[str]
    filter: JobFilter
    validate_only: bool
    def __init__(self, ids: _Optional[_Iterable[str]] = ..., filter: _Optional[_Union[JobFilter, _Mapping]] = ..., validate_only: _Optional[bool] = ...) -> None: ...

class BatchPauseJobsResponse(_message.Message):
    __slots__ = ("matched_count", "job_ids")
    MATCHED_COUNT_FIELD_NUMBER: _ClassVar[int]
    JOB_IDS_FIELD_NUMBER: _ClassVar[int]
    matched_count: int
    job_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, matched_count: _Optional[int] = ..., job_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class BatchResumeJobsRequest(_message.Message):
    __slots__ = ("ids", "filter", "validate_only")
    IDS_FIELD_NUMBER: _ClassVar[int]
    FILTER_FIELD_NUMBER: _ClassVar[int]
    VALIDATE_ONLY_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[str]
    filter: JobFilter
    validate_only: bool
    def __init__(self, ids: _Optional[_Iterable[str]] = ..., filter: _Optional[_Union[JobFilter, _Mapping]] = ..., validate_only: _Optional[bool] = ...) -> None: ...

class BatchResumeJobsResponse(_message.Message):
    __slots__ = ("matched_count", "job_ids")
    MATCHED_COUNT_FIELD_NUMBER: _ClassVar[int]
    JOB_IDS_FIELD_NUMBER: _ClassVar[int]
    matched_count: int
    job_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, matched_count: _Optional[int] = ..., job_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class BatchDeleteJobsRequest(_message.Message):
    __slots__ = ("ids", "filter", "validate_only", "detach_dependents")
    IDS_FIELD_NUMBER: _ClassVar[int]
    FILTER_FIELD_NUMBER: _ClassVar[int]
    VALIDATE_ONLY_FIELD_NUMBER: _ClassVar[int]
    DETACH_DEPENDENTS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[str]
    filter: JobFilter
    validate_only: bool
    detach_dependents: bool
    def __init__(self, ids: _Optional[_Iterable[str]] = ..., filter: _Optional[_Union[JobFilter, _Mapping]] = ..., validate_only: _Optional[bool] = ..., detach_dependents: _Optional[bool] = ...) -> None: ...

class BatchDeleteJobsResponse(_message.Message):
    __slots__ = ("matched_count", "job_ids", "kept_ids")
    MATCHED_COUNT_FIELD_NUMBER: _ClassVar[int]
    JOB_IDS_FIELD_NUMBER: _ClassVar[int]
    KEPT_IDS_FIELD_NUMBER: _ClassVar[int]
    matched_count: int
    job_ids: _containers.RepeatedScalarFieldContainer[str]
    kept_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, matched_count: _Optional[int] = ..., job_ids: _Optional[_Iterable[str]] = ..., kept_ids: _Optional[_Iterable[str]] = ...) -> None: ...
