import datetime

from google.protobuf import duration_pb2 as _duration_pb2
from google.protobuf import struct_pb2 as _struct_pb2
from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class HandlerInfo(_message.Message):
    __slots__ = ("name", "description", "payload_schema_json")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_SCHEMA_JSON_FIELD_NUMBER: _ClassVar[int]
    name: str
    description: str
    payload_schema_json: str
    def __init__(self, name: _Optional[str] = ..., description: _Optional[str] = ..., payload_schema_json: _Optional[str] = ...) -> None: ...

class Hello(_message.Message):
    __slots__ = ("handlers", "labels", "slots", "sdk", "sdk_version", "queue", "held_runs")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    HANDLERS_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    SDK_FIELD_NUMBER: _ClassVar[int]
    SDK_VERSION_FIELD_NUMBER: _ClassVar[int]
    QUEUE_FIELD_NUMBER: _ClassVar[int]
    HELD_RUNS_FIELD_NUMBER: _ClassVar[int]
    handlers: _containers.RepeatedCompositeFieldContainer[HandlerInfo]
    labels: _containers.ScalarMap[str, str]
    slots: int
    sdk: str
    sdk_version: str
    queue: str
    held_runs: _containers.RepeatedCompositeFieldContainer[HeldRun]
    def __init__(self, handlers: _Optional[_Iterable[_Union[HandlerInfo, _Mapping]]] = ..., labels: _Optional[_Mapping[str, str]] = ..., slots: _Optional[int] = ..., sdk: _Optional[str] = ..., sdk_version: _Optional[str] = ..., queue: _Optional[str] = ..., held_runs: _Optional[_Iterable[_Union[HeldRun, _Mapping]]] = ...) -> None: ...

class HeldRun(_message.Message):
    __slots__ = ("execution_id", "claim_token")
    EXECUTION_ID_FIELD_NUMBER: _ClassVar[int]
    CLAIM_TOKEN_FIELD_NUMBER: _ClassVar[int]
    execution_id: str
    claim_token: str
    def __init__(self, execution_id: _Optional[str] = ..., claim_token: _Optional[str] = ...) -> None: ...

class Credit(_message.Message):
    __slots__ = ("grant",)
    GRANT_FIELD_NUMBER: _ClassVar[int]
    grant: int
    def __init__(self, grant: _Optional[int] = ...) -> None: ...

class Ack(_message.Message):
    __slots__ = ("execution_id", "claim_token")
    EXECUTION_ID_FIELD_NUMBER: _ClassVar[int]
    CLAIM_TOKEN_FIELD_NUMBER: _ClassVar[int]
    execution_id: str
    claim_token: str
    def __init__(self, execution_id: _Optional[str] = ..., claim_token: _Optional[str] = ...) -> None: ...

class OutcomeError(_message.Message):
    __slots__ = ("message", "permanent", "retry_after")
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    PERMANENT_FIELD_NUMBER: _ClassVar[int]
    RETRY_AFTER_FIELD_NUMBER: _ClassVar[int]
    message: str
    permanent: bool
    retry_after: _duration_pb2.Duration
    def __init__(self, message: _Optional[str] = ..., permanent: _Optional[bool] = ..., retry_after: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ...) -> None: ...

class RateLimited(_message.Message):
    __slots__ = ("retry_after", "reason")
    RETRY_AFTER_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    retry_after: _duration_pb2.Duration
    reason: str
    def __init__(self, retry_after: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., reason: _Optional[str] = ...) -> None: ...

class Outcome(_message.Message):
    __slots__ = ("execution_id", "claim_token", "value", "error", "rate_limited")
    EXECUTION_ID_FIELD_NUMBER: _ClassVar[int]
    CLAIM_TOKEN_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    RATE_LIMITED_FIELD_NUMBER: _ClassVar[int]
    execution_id: str
    claim_token: str
    value: _struct_pb2.Value
    error: OutcomeError
    rate_limited: RateLimited
    def __init__(self, execution_id: _Optional[str] = ..., claim_token: _Optional[str] = ..., value: _Optional[_Union[_struct_pb2.Value, _Mapping]] = ..., error: _Optional[_Union[OutcomeError, _Mapping]] = ..., rate_limited: _Optional[_Union[RateLimited, _Mapping]] = ...) -> None: ...

class Pong(_message.Message):
    __slots__ = ("nonce",)
    NONCE_FIELD_NUMBER: _ClassVar[int]
    nonce: int
    def __init__(self, nonce: _Optional[int] = ...) -> None: ...

class RequestBatch(_message.Message):
    __slots__ = ("acks", "outcomes", "credit")
    ACKS_FIELD_NUMBER: _ClassVar[int]
    OUTCOMES_FIELD_NUMBER: _ClassVar[int]
    CREDIT_FIELD_NUMBER: _ClassVar[int]
    acks: _containers.RepeatedCompositeFieldContainer[Ack]
    outcomes: _containers.RepeatedCompositeFieldContainer[Outcome]
    credit: int
    def __init__(self, acks: _Optional[_Iterable[_Union[Ack, _Mapping]]] = ..., outcomes: _Optional[_Iterable[_Union[Outcome, _Mapping]]] = ..., credit: _Optional[int] = ...) -> None: ...

class ConnectRequest(_message.Message):
    __slots__ = ("hello", "credit", "ack", "outcome", "pong", "batch")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    CREDIT_FIELD_NUMBER: _ClassVar[int]
    ACK_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    PONG_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    hello: Hello
    credit: Credit
    ack: Ack
    outcome: Outcome
    pong: Pong
    batch: RequestBatch
    def __init__(self, hello: _Optional[_Union[Hello, _Mapping]] = ..., credit: _Optional[_Union[Credit, _Mapping]] = ..., ack: _Optional[_Union[Ack, _Mapping]] = ..., outcome: _Optional[_Union[Outcome, _Mapping]] = ..., pong: _Optional[_Union[Pong, _Mapping]] = ..., batch: _Optional[_Union[RequestBatch, _Mapping]] = ...) -> None: ...

class Welcome(_message.Message):
    __slots__ = ("worker_id", "ack_timeout", "lease_timeout", "server_time", "ping_interval", "resumed_execution_ids", "resume_refusals")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ACK_TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    LEASE_TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    SERVER_TIME_FIELD_NUMBER: _ClassVar[int]
    PING_INTERVAL_FIELD_NUMBER: _ClassVar[int]
    RESUMED_EXECUTION_IDS_FIELD_NUMBER: _ClassVar[int]
    RESUME_REFUSALS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    ack_timeout: _duration_pb2.Duration
    lease_timeout: _duration_pb2.Duration
    server_time: _timestamp_pb2.Timestamp
    ping_interval: _duration_pb2.Duration
    resumed_execution_ids: _containers.RepeatedScalarFieldContainer[str]
    resume_refusals: _containers.RepeatedCompositeFieldContainer[Rejected]
    def __init__(self, worker_id: _Optional[str] = ..., ack_timeout: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., lease_timeout: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., server_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., ping_interval: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., resumed_execution_ids: _Optional[_Iterable[str]] = ..., resume_refusals: _Optional[_Iterable[_Union[Rejected, _Mapping]]] = ...) -> None: ...

class Assignment(_message.Message):
    __slots__ = ("run_id", "execution_id", "job_id", "job_name", "attempt", "claim_token", "handler", "payload", "deadline", "scheduled_for")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    EXECUTION_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_NAME_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    CLAIM_TOKEN_FIELD_NUMBER: _ClassVar[int]
    HANDLER_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_FIELD_NUMBER: _ClassVar[int]
    SCHEDULED_FOR_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    execution_id: str
    job_id: str
    job_name: str
    attempt: int
    claim_token: str
    handler: str
    payload: _struct_pb2.Struct
    deadline: _timestamp_pb2.Timestamp
    scheduled_for: _timestamp_pb2.Timestamp
    def __init__(self, run_id: _Optional[str] = ..., execution_id: _Optional[str] = ..., job_id: _Optional[str] = ..., job_name: _Optional[str] = ..., attempt: _Optional[int] = ..., claim_token: _Optional[str] = ..., handler: _Optional[str] = ..., payload: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ..., deadline: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., scheduled_for: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class Cancel(_message.Message):
    __slots__ = ("execution_id", "reason")
    EXECUTION_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    execution_id: str
    reason: str
    def __init__(self, execution_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class Ping(_message.Message):
    __slots__ = ("nonce",)
    NONCE_FIELD_NUMBER: _ClassVar[int]
    nonce: int
    def __init__(self, nonce: _Optional[int] = ...) -> None: ...

class Drain(_message.Message):
    __slots__ = ("deadline",)
    DEADLINE_FIELD_NUMBER: _ClassVar[int]
    deadline: _timestamp_pb2.Timestamp
    def __init__(self, deadline: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class Rejected(_message.Message):
    __slots__ = ("execution_id", "code", "field", "message")
    EXECUTION_ID_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    FIELD_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    execution_id: str
    code: str
    field: str
    message: str
    def __init__(self, execution_id: _Optional[str] = ..., code: _Optional[str] = ..., field: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class Assignments(_message.Message):
    __slots__ = ("assignments",)
    ASSIGNMENTS_FIELD_NUMBER: _ClassVar[int]
    assignments: _containers.RepeatedCompositeFieldContainer[Assignment]
    def __init__(self, assignments: _Optional[_Iterable[_Union[Assignment, _Mapping]]] = ...) -> None: ...

class ConnectResponse(_message.Message):
    __slots__ = ("welcome", "assignment", "cancel", "ping", "drain", "rejected", "assignments")
    WELCOME_FIELD_NUMBER: _ClassVar[int]
    ASSIGNMENT_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    PING_FIELD_NUMBER: _ClassVar[int]
    DRAIN_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    ASSIGNMENTS_FIELD_NUMBER: _ClassVar[int]
    welcome: Welcome
    assignment: Assignment
    cancel: Cancel
    ping: Ping
    drain: Drain
    rejected: Rejected
    assignments: Assignments
    def __init__(self, welcome: _Optional[_Union[Welcome, _Mapping]] = ..., assignment: _Optional[_Union[Assignment, _Mapping]] = ..., cancel: _Optional[_Union[Cancel, _Mapping]] = ..., ping: _Optional[_Union[Ping, _Mapping]] = ..., drain: _Optional[_Union[Drain, _Mapping]] = ..., rejected: _Optional[_Union[Rejected, _Mapping]] = ..., assignments: _Optional[_Union[Assignments, _Mapping]] = ...) -> None: ...

class OpenWorkerSessionRequest(_message.Message):
    __slots__ = ("hello",)
    HELLO_FIELD_NUMBER: _ClassVar[int]
    hello: Hello
    def __init__(self, hello: _Optional[_Union[Hello, _Mapping]] = ...) -> None: ...

class OpenWorkerSessionResponse(_message.Message):
    __slots__ = ("session_id", "welcome", "poll_timeout", "max_wait")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    WELCOME_FIELD_NUMBER: _ClassVar[int]
    POLL_TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    MAX_WAIT_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    welcome: Welcome
    poll_timeout: _duration_pb2.Duration
    max_wait: _duration_pb2.Duration
    def __init__(self, session_id: _Optional[str] = ..., welcome: _Optional[_Union[Welcome, _Mapping]] = ..., poll_timeout: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., max_wait: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ...) -> None: ...

class PollWorkerSessionRequest(_message.Message):
    __slots__ = ("session_id", "batch", "wait")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    WAIT_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    batch: RequestBatch
    wait: _duration_pb2.Duration
    def __init__(self, session_id: _Optional[str] = ..., batch: _Optional[_Union[RequestBatch, _Mapping]] = ..., wait: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ...) -> None: ...

class PollWorkerSessionResponse(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ConnectResponse]
    def __init__(self, messages: _Optional[_Iterable[_Union[ConnectResponse, _Mapping]]] = ...) -> None: ...

class CloseWorkerSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class CloseWorkerSessionResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
