import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GetQueueStatsRequest(_message.Message):
    __slots__ = ("queue",)
    QUEUE_FIELD_NUMBER: _ClassVar[int]
    queue: str
    def __init__(self, queue: _Optional[str] = ...) -> None: ...

class GetQueueStatsResponse(_message.Message):
    __slots__ = ("queue", "ready", "processing", "delayed", "dead")
    QUEUE_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    PROCESSING_FIELD_NUMBER: _ClassVar[int]
    DELAYED_FIELD_NUMBER: _ClassVar[int]
    DEAD_FIELD_NUMBER: _ClassVar[int]
    queue: str
    ready: int
    processing: int
    delayed: int
    dead: int
    def __init__(self, queue: _Optional[str] = ..., ready: _Optional[int] = ..., processing: _Optional[int] = ..., delayed: _Optional[int] = ..., dead: _Optional[int] = ...) -> None: ...

class DeadLetter(_message.Message):
    __slots__ = ("run_id", "reason", "dead_time", "priority", "handler")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    DEAD_TIME_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    HANDLER_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    reason: str
    dead_time: _timestamp_pb2.Timestamp
    priority: int
    handler: str
    def __init__(self, run_id: _Optional[str] = ..., reason: _Optional[str] = ..., dead_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., priority: _Optional[int] = ..., handler: _Optional[str] = ...) -> None: ...

class ListDeadLettersRequest(_message.Message):
    __slots__ = ("queue", "page_size", "page_token")
    QUEUE_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    queue: str
    page_size: int
    page_token: str
    def __init__(self, queue: _Optional[str] = ..., page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class ListDeadLettersResponse(_message.Message):
    __slots__ = ("dead_letters", "next_page_token")
    DEAD_LETTERS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    dead_letters: _containers.RepeatedCompositeFieldContainer[DeadLetter]
    next_page_token: str
    def __init__(self, dead_letters: _Optional[_Iterable[_Union[DeadLetter, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class RequeueDeadLettersRequest(_message.Message):
    __slots__ = ("queue", "run_ids", "all")
    QUEUE_FIELD_NUMBER: _ClassVar[int]
    RUN_IDS_FIELD_NUMBER: _ClassVar[int]
    ALL_FIELD_NUMBER: _ClassVar[int]
    queue: str
    run_ids: _containers.RepeatedScalarFieldContainer[str]
    all: bool
    def __init__(self, queue: _Optional[str] = ..., run_ids: _Optional[_Iterable[str]] = ..., all: _Optional[bool] = ...) -> None: ...

class RequeueDeadLettersResponse(_message.Message):
    __slots__ = ("run_ids",)
    RUN_IDS_FIELD_NUMBER: _ClassVar[int]
    run_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, run_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class PurgeDeadLettersRequest(_message.Message):
    __slots__ = ("queue", "run_ids", "all")
    QUEUE_FIELD_NUMBER: _ClassVar[int]
    RUN_IDS_FIELD_NUMBER: _ClassVar[int]
    ALL_FIELD_NUMBER: _ClassVar[int]
    queue: str
    run_ids: _containers.RepeatedScalarFieldContainer[str]
    all: bool
    def __init__(self, queue: _Optional[str] = ..., run_ids: _Optional[_Iterable[str]] = ..., all: _Optional[bool] = ...) -> None: ...

class PurgeDeadLettersResponse(_message.Message):
    __slots__ = ("run_ids",)
    RUN_IDS_FIELD_NUMBER: _ClassVar[int]
    run_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, run_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class QueueShardChange(_message.Message):
    __slots__ = ("shards", "effective_time")
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    EFFECTIVE_TIME_FIELD_NUMBER: _ClassVar[int]
    shards: int
    effective_time: _timestamp_pb2.Timestamp
    def __init__(self, shards: _Optional[int] = ..., effective_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class QueueShards(_message.Message):
    __slots__ = ("queue", "shards", "served_shards", "changes")
    QUEUE_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    SERVED_SHARDS_FIELD_NUMBER: _ClassVar[int]
    CHANGES_FIELD_NUMBER: _ClassVar[int]
    queue: str
    shards: int
    served_shards: int
    changes: _containers.RepeatedCompositeFieldContainer[QueueShardChange]
    def __init__(self, queue: _Optional[str] = ..., shards: _Optional[int] = ..., served_shards: _Optional[int] = ..., changes: _Optional[_Iterable[_Union[QueueShardChange, _Mapping]]] = ...) -> None: ...

class GetQueueShardsRequest(_message.Message):
    __slots__ = ("queue",)
    QUEUE_FIELD_NUMBER: _ClassVar[int]
    queue: str
    def __init__(self, queue: _Optional[str] = ...) -> None: ...

class GetQueueShardsResponse(_message.Message):
    __slots__ = ("queue", "shards", "served_shards", "changes")
    QUEUE_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    SERVED_SHARDS_FIELD_NUMBER: _ClassVar[int]
    CHANGES_FIELD_NUMBER: _ClassVar[int]
    queue: str
    shards: int
    served_shards: int
    changes: _containers.RepeatedCompositeFieldContainer[QueueShardChange]
    def __init__(self, queue: _Optional[str] = ..., shards: _Optional[int] = ..., served_shards: _Optional[int] = ..., changes: _Optional[_Iterable[_Union[QueueShardChange, _Mapping]]] = ...) -> None: ...

class ListQueueShardsRequest(_message.Message):
    __slots__ = ("page_size", "page_token")
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    page_size: int
    page_token: str
    def __init__(self, page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class ListQueueShardsResponse(_message.Message):
    __slots__ = ("queues", "next_page_token")
    QUEUES_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    queues: _containers.RepeatedCompositeFieldContainer[QueueShards]
    next_page_token: str
    def __init__(self, queues: _Optional[_Iterable[_Union[QueueShards, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class SetQueueShardsRequest(_message.Message):
    __slots__ = ("queue", "shards")
    QUEUE_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    queue: str
    shards: int
    def __init__(self, queue: _Optional[str] = ..., shards: _Optional[int] = ...) -> None: ...

class SetQueueShardsResponse(_message.Message):
    __slots__ = ("change",)
    CHANGE_FIELD_NUMBER: _ClassVar[int]
    change: QueueShardChange
    def __init__(self, change: _Optional[_Union[QueueShardChange, _Mapping]] = ...) -> None: ...
