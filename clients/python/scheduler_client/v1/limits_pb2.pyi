import datetime

from google.protobuf import duration_pb2 as _duration_pb2
from google.protobuf import field_mask_pb2 as _field_mask_pb2
from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class LimitKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    LIMIT_KIND_UNSPECIFIED: _ClassVar[LimitKind]
    LIMIT_KIND_CONCURRENCY: _ClassVar[LimitKind]
    LIMIT_KIND_RATE: _ClassVar[LimitKind]
LIMIT_KIND_UNSPECIFIED: LimitKind
LIMIT_KIND_CONCURRENCY: LimitKind
LIMIT_KIND_RATE: LimitKind

class LimitOverride(_message.Message):
    __slots__ = ("limit", "burst")
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    BURST_FIELD_NUMBER: _ClassVar[int]
    limit: int
    burst: int
    def __init__(self, limit: _Optional[int] = ..., burst: _Optional[int] = ...) -> None: ...

class Limit(_message.Message):
    __slots__ = ("id", "name", "kind", "limit", "period", "burst", "overrides", "etag", "create_time", "update_time")
    class OverridesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: LimitOverride
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[LimitOverride, _Mapping]] = ...) -> None: ...
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    PERIOD_FIELD_NUMBER: _ClassVar[int]
    BURST_FIELD_NUMBER: _ClassVar[int]
    OVERRIDES_FIELD_NUMBER: _ClassVar[int]
    ETAG_FIELD_NUMBER: _ClassVar[int]
    CREATE_TIME_FIELD_NUMBER: _ClassVar[int]
    UPDATE_TIME_FIELD_NUMBER: _ClassVar[int]
    id: str
    name: str
    kind: LimitKind
    limit: int
    period: _duration_pb2.Duration
    burst: int
    overrides: _containers.MessageMap[str, LimitOverride]
    etag: str
    create_time: _timestamp_pb2.Timestamp
    update_time: _timestamp_pb2.Timestamp
    def __init__(self, id: _Optional[str] = ..., name: _Optional[str] = ..., kind: _Optional[_Union[LimitKind, str]] = ..., limit: _Optional[int] = ..., period: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., burst: _Optional[int] = ..., overrides: _Optional[_Mapping[str, LimitOverride]] = ..., etag: _Optional[str] = ..., create_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., update_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class LimitRef(_message.Message):
    __slots__ = ("limit", "key", "units")
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    UNITS_FIELD_NUMBER: _ClassVar[int]
    limit: str
    key: str
    units: int
    def __init__(self, limit: _Optional[str] = ..., key: _Optional[str] = ..., units: _Optional[int] = ...) -> None: ...

class CreateLimitRequest(_message.Message):
    __slots__ = ("limit", "request_id")
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    limit: Limit
    request_id: str
    def __init__(self, limit: _Optional[_Union[Limit, _Mapping]] = ..., request_id: _Optional[str] = ...) -> None: ...

class CreateLimitResponse(_message.Message):
    __slots__ = ("limit",)
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    limit: Limit
    def __init__(self, limit: _Optional[_Union[Limit, _Mapping]] = ...) -> None: ...

class GetLimitRequest(_message.Message):
    __slots__ = ("id", "name")
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    id: str
    name: str
    def __init__(self, id: _Optional[str] = ..., name: _Optional[str] = ...) -> None: ...

class GetLimitResponse(_message.Message):
    __slots__ = ("limit",)
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    limit: Limit
    def __init__(self, limit: _Optional[_Union[Limit, _Mapping]] = ...) -> None: ...

class ListLimitsRequest(_message.Message):
    __slots__ = ("page_size", "page_token")
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    page_size: int
    page_token: str
    def __init__(self, page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class ListLimitsResponse(_message.Message):
    __slots__ = ("limits", "next_page_token")
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    limits: _containers.RepeatedCompositeFieldContainer[Limit]
    next_page_token: str
    def __init__(self, limits: _Optional[_Iterable[_Union[Limit, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class UpdateLimitRequest(_message.Message):
    __slots__ = ("limit", "update_mask", "etag")
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    UPDATE_MASK_FIELD_NUMBER: _ClassVar[int]
    ETAG_FIELD_NUMBER: _ClassVar[int]
    limit: Limit
    update_mask: _field_mask_pb2.FieldMask
    etag: str
    def __init__(self, limit: _Optional[_Union[Limit, _Mapping]] = ..., update_mask: _Optional[_Union[_field_mask_pb2.FieldMask, _Mapping]] = ..., etag: _Optional[str] = ...) -> None: ...

class UpdateLimitResponse(_message.Message):
    __slots__ = ("limit",)
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    limit: Limit
    def __init__(self, limit: _Optional[_Union[Limit, _Mapping]] = ...) -> None: ...

class DeleteLimitRequest(_message.Message):
    __slots__ = ("id", "etag")
    ID_FIELD_NUMBER: _ClassVar[int]
    ETAG_FIELD_NUMBER: _ClassVar[int]
    id: str
    etag: str
    def __init__(self, id: _Optional[str] = ..., etag: _Optional[str] = ...) -> None: ...

class DeleteLimitResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SetLimitOverrideRequest(_message.Message):
    __slots__ = ("id", "key", "override", "etag")
    ID_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    OVERRIDE_FIELD_NUMBER: _ClassVar[int]
    ETAG_FIELD_NUMBER: _ClassVar[int]
    id: str
    key: str
    override: LimitOverride
    etag: str
    def __init__(self, id: _Optional[str] = ..., key: _Optional[str] = ..., override: _Optional[_Union[LimitOverride, _Mapping]] = ..., etag: _Optional[str] = ...) -> None: ...

class SetLimitOverrideResponse(_message.Message):
    __slots__ = ("limit",)
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    limit: Limit
    def __init__(self, limit: _Optional[_Union[Limit, _Mapping]] = ...) -> None: ...

class LimitKeyQueueState(_message.Message):
    __slots__ = ("queue", "running_units", "queued_runs", "next_admit_time", "pause_end_time")
    QUEUE_FIELD_NUMBER: _ClassVar[int]
    RUNNING_UNITS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_RUNS_FIELD_NUMBER: _ClassVar[int]
    NEXT_ADMIT_TIME_FIELD_NUMBER: _ClassVar[int]
    PAUSE_END_TIME_FIELD_NUMBER: _ClassVar[int]
    queue: str
    running_units: int
    queued_runs: int
    next_admit_time: _timestamp_pb2.Timestamp
    pause_end_time: _timestamp_pb2.Timestamp
    def __init__(self, queue: _Optional[str] = ..., running_units: _Optional[int] = ..., queued_runs: _Optional[int] = ..., next_admit_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., pause_end_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class LimitKeyState(_message.Message):
    __slots__ = ("limit", "key", "queues", "running_units", "queued_runs")
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    QUEUES_FIELD_NUMBER: _ClassVar[int]
    RUNNING_UNITS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_RUNS_FIELD_NUMBER: _ClassVar[int]
    limit: str
    key: str
    queues: _containers.RepeatedCompositeFieldContainer[LimitKeyQueueState]
    running_units: int
    queued_runs: int
    def __init__(self, limit: _Optional[str] = ..., key: _Optional[str] = ..., queues: _Optional[_Iterable[_Union[LimitKeyQueueState, _Mapping]]] = ..., running_units: _Optional[int] = ..., queued_runs: _Optional[int] = ...) -> None: ...

class GetLimitKeyRequest(_message.Message):
    __slots__ = ("limit", "key", "queue")
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    QUEUE_FIELD_NUMBER: _ClassVar[int]
    limit: str
    key: str
    queue: str
    def __init__(self, limit: _Optional[str] = ..., key: _Optional[str] = ..., queue: _Optional[str] = ...) -> None: ...

class GetLimitKeyResponse(_message.Message):
    __slots__ = ("state",)
    STATE_FIELD_NUMBER: _ClassVar[int]
    state: LimitKeyState
    def __init__(self, state: _Optional[_Union[LimitKeyState, _Mapping]] = ...) -> None: ...

class PauseLimitKeyRequest(_message.Message):
    __slots__ = ("limit", "key", "queue", "duration", "pause_end_time")
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    QUEUE_FIELD_NUMBER: _ClassVar[int]
    DURATION_FIELD_NUMBER: _ClassVar[int]
    PAUSE_END_TIME_FIELD_NUMBER: _ClassVar[int]
    limit: str
    key: str
    queue: str
    duration: _duration_pb2.Duration
    pause_end_time: _timestamp_pb2.Timestamp
    def __init__(self, limit: _Optional[str] = ..., key: _Optional[str] = ..., queue: _Optional[str] = ..., duration: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., pause_end_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class PauseLimitKeyResponse(_message.Message):
    __slots__ = ("state",)
    STATE_FIELD_NUMBER: _ClassVar[int]
    state: LimitKeyState
    def __init__(self, state: _Optional[_Union[LimitKeyState, _Mapping]] = ...) -> None: ...

class ResumeLimitKeyRequest(_message.Message):
    __slots__ = ("limit", "key", "queue")
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    QUEUE_FIELD_NUMBER: _ClassVar[int]
    limit: str
    key: str
    queue: str
    def __init__(self, limit: _Optional[str] = ..., key: _Optional[str] = ..., queue: _Optional[str] = ...) -> None: ...

class ResumeLimitKeyResponse(_message.Message):
    __slots__ = ("state",)
    STATE_FIELD_NUMBER: _ClassVar[int]
    state: LimitKeyState
    def __init__(self, state: _Optional[_Union[LimitKeyState, _Mapping]] = ...) -> None: ...
