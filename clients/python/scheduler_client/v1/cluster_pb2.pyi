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

class BreakerState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    BREAKER_STATE_UNSPECIFIED: _ClassVar[BreakerState]
    BREAKER_STATE_CLOSED: _ClassVar[BreakerState]
    BREAKER_STATE_OPEN: _ClassVar[BreakerState]
    BREAKER_STATE_HALF_OPEN: _ClassVar[BreakerState]
BREAKER_STATE_UNSPECIFIED: BreakerState
BREAKER_STATE_CLOSED: BreakerState
BREAKER_STATE_OPEN: BreakerState
BREAKER_STATE_HALF_OPEN: BreakerState

class Worker(_message.Message):
    __slots__ = ("id", "host", "pid", "slots", "active", "queue", "handlers", "start_time", "heartbeat_time", "sdk", "remote")
    ID_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_FIELD_NUMBER: _ClassVar[int]
    QUEUE_FIELD_NUMBER: _ClassVar[int]
    HANDLERS_FIELD_NUMBER: _ClassVar[int]
    START_TIME_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_TIME_FIELD_NUMBER: _ClassVar[int]
    SDK_FIELD_NUMBER: _ClassVar[int]
    REMOTE_FIELD_NUMBER: _ClassVar[int]
    id: str
    host: str
    pid: int
    slots: int
    active: int
    queue: str
    handlers: _containers.RepeatedScalarFieldContainer[str]
    start_time: _timestamp_pb2.Timestamp
    heartbeat_time: _timestamp_pb2.Timestamp
    sdk: str
    remote: bool
    def __init__(self, id: _Optional[str] = ..., host: _Optional[str] = ..., pid: _Optional[int] = ..., slots: _Optional[int] = ..., active: _Optional[int] = ..., queue: _Optional[str] = ..., handlers: _Optional[_Iterable[str]] = ..., start_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., heartbeat_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., sdk: _Optional[str] = ..., remote: _Optional[bool] = ...) -> None: ...

class ListWorkersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListWorkersResponse(_message.Message):
    __slots__ = ("workers",)
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[Worker]
    def __init__(self, workers: _Optional[_Iterable[_Union[Worker, _Mapping]]] = ...) -> None: ...

class GetSchedulerStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetSchedulerStatusResponse(_message.Message):
    __slots__ = ("has_leader", "leader", "term", "leader_since_time")
    HAS_LEADER_FIELD_NUMBER: _ClassVar[int]
    LEADER_FIELD_NUMBER: _ClassVar[int]
    TERM_FIELD_NUMBER: _ClassVar[int]
    LEADER_SINCE_TIME_FIELD_NUMBER: _ClassVar[int]
    has_leader: bool
    leader: str
    term: int
    leader_since_time: _timestamp_pb2.Timestamp
    def __init__(self, has_leader: _Optional[bool] = ..., leader: _Optional[str] = ..., term: _Optional[int] = ..., leader_since_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class Breaker(_message.Message):
    __slots__ = ("key", "state", "worker_id")
    KEY_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    key: str
    state: BreakerState
    worker_id: str
    def __init__(self, key: _Optional[str] = ..., state: _Optional[_Union[BreakerState, str]] = ..., worker_id: _Optional[str] = ...) -> None: ...

class Handler(_message.Message):
    __slots__ = ("name", "description", "admin_only", "enabled", "payload_fields", "breakers")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    ADMIN_ONLY_FIELD_NUMBER: _ClassVar[int]
    ENABLED_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELDS_FIELD_NUMBER: _ClassVar[int]
    BREAKERS_FIELD_NUMBER: _ClassVar[int]
    name: str
    description: str
    admin_only: bool
    enabled: bool
    payload_fields: _struct_pb2.ListValue
    breakers: _containers.RepeatedCompositeFieldContainer[Breaker]
    def __init__(self, name: _Optional[str] = ..., description: _Optional[str] = ..., admin_only: _Optional[bool] = ..., enabled: _Optional[bool] = ..., payload_fields: _Optional[_Union[_struct_pb2.ListValue, _Mapping]] = ..., breakers: _Optional[_Iterable[_Union[Breaker, _Mapping]]] = ...) -> None: ...

class ListHandlersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListHandlersResponse(_message.Message):
    __slots__ = ("handlers",)
    HANDLERS_FIELD_NUMBER: _ClassVar[int]
    handlers: _containers.RepeatedCompositeFieldContainer[Handler]
    def __init__(self, handlers: _Optional[_Iterable[_Union[Handler, _Mapping]]] = ...) -> None: ...
