"""What a remote worker and the server say to each other on a `WorkerService.Connect` stream, as
domain values (the servicer maps them to and from `scheduler.v1` messages), and the checks of what
the worker says first (`check_hello`)."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Final
from uuid import UUID

from scheduler_grpc.errors import InvalidArgument
from scheduler_grpc.handlers import check_handler_name
from scheduler_grpc.rules import QUEUE_NAME_RULE, is_queue_name

MAX_HANDLERS: Final = 100
MAX_SLOTS: Final = 10_000
MAX_LABELS: Final = 32
MAX_LABEL_LENGTH: Final = 256
MAX_DESCRIPTION: Final = 1024
MAX_SCHEMA_BYTES: Final = 64 * 1024
MAX_TOKEN: Final = 256  # a claim token's length at most (the server's are 32 hex characters)


@dataclass(frozen=True)
class HandlerSpec:
    """A handler a remote worker serves."""

    name: str
    description: str = ""
    payload_schema_json: str = ""


@dataclass(frozen=True)
class HeldRun:
    """A run a worker still holds from a stream that ended (to resume)."""

    execution_id: str
    claim_token: str


@dataclass(frozen=True)
class Hello:
    """A remote worker's first message: who it is and what it serves."""

    handlers: Sequence[HandlerSpec]
    slots: int
    labels: Mapping[str, str] = field(default_factory=dict)
    sdk: str = ""
    sdk_version: str = ""
    queue: str = ""
    held: Sequence[HeldRun] = ()


def check_hello(hello: Hello, reserved: Collection[str] = ()) -> None:
    """Require a well-formed hello; `reserved`: handler names a remote worker may not serve (the
    built-in handlers: a worker key must not receive the payloads of, say, `http.webhook` runs).

    Raises:
        InvalidArgument: naming the field (`hello.handlers[i].name`, `hello.slots`, ...).
    """
    if not 1 <= len(hello.handlers) <= MAX_HANDLERS:
        raise InvalidArgument("hello.handlers", f"must name 1 to {MAX_HANDLERS} handlers, got {len(hello.handlers)}")
    seen: set[str] = set()
    for index, spec in enumerate(hello.handlers):
        try:
            check_handler_name(spec.name)
        except TypeError as exc:
            raise InvalidArgument(f"hello.handlers[{index}].name", str(exc)) from None
        if spec.name in reserved:
            raise InvalidArgument(f"hello.handlers[{index}].name", f"{spec.name!r} is a built-in handler of the server")
        if spec.name in seen:
            raise InvalidArgument(f"hello.handlers[{index}].name", f"{spec.name!r} is named twice")
        seen.add(spec.name)
        if len(spec.description) > MAX_DESCRIPTION:
            raise InvalidArgument(f"hello.handlers[{index}].description", f"at most {MAX_DESCRIPTION} characters")
        if len(spec.payload_schema_json.encode()) > MAX_SCHEMA_BYTES:
            raise InvalidArgument(f"hello.handlers[{index}].payload_schema_json", f"at most {MAX_SCHEMA_BYTES} bytes")
    if not 1 <= hello.slots <= MAX_SLOTS:
        raise InvalidArgument("hello.slots", f"must be between 1 and {MAX_SLOTS}, got {hello.slots}")
    if len(hello.labels) > MAX_LABELS:
        raise InvalidArgument("hello.labels", f"at most {MAX_LABELS} labels")
    for key, value in hello.labels.items():
        if not 1 <= len(key) <= MAX_LABEL_LENGTH or len(value) > MAX_LABEL_LENGTH:
            raise InvalidArgument(f"hello.labels.{key[:64]}", f"keys 1-{MAX_LABEL_LENGTH}, values at most that")
    if len(hello.sdk) > MAX_LABEL_LENGTH or len(hello.sdk_version) > MAX_LABEL_LENGTH:
        raise InvalidArgument("hello.sdk", f"sdk and sdk_version: at most {MAX_LABEL_LENGTH} characters")
    if len(hello.held) > hello.slots:
        raise InvalidArgument("hello.held_runs", f"at most the hello's {hello.slots} slots, got {len(hello.held)}")
    held: set[str] = set()
    for index, run in enumerate(hello.held):
        try:
            UUID(run.execution_id)
        except ValueError:
            raise InvalidArgument(f"hello.held_runs[{index}].execution_id", "not an execution id (a UUID)") from None
        if run.execution_id in held:
            raise InvalidArgument(f"hello.held_runs[{index}].execution_id", "named twice")
        held.add(run.execution_id)
        if not 1 <= len(run.claim_token) <= MAX_TOKEN:
            raise InvalidArgument(f"hello.held_runs[{index}].claim_token", f"1 to {MAX_TOKEN} characters")
    if hello.queue and not is_queue_name(hello.queue):
        raise InvalidArgument("hello.queue", QUEUE_NAME_RULE)


# -- the worker's reports ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Succeeded:
    """The handler returned `value` (JSON)."""

    value: Any


@dataclass(frozen=True)
class Failed:
    """The handler failed; `permanent`: retries cannot fix it."""

    message: str
    permanent: bool = False
    retry_after: timedelta | None = None


@dataclass(frozen=True)
class Throttled:
    """The handler's upstream said "retry after": back-pressure, no attempt spent."""

    retry_after: timedelta
    reason: str = ""


@dataclass(frozen=True)
class OutcomeReport:
    """An assignment's end, as the worker reports it."""

    execution_id: str
    claim_token: str
    result: Succeeded | Failed | Throttled


# -- the server's messages --------------------------------------------------------------------------


@dataclass(frozen=True)
class Welcome:
    worker_id: str
    ack_timeout: timedelta
    lease_timeout: timedelta
    server_time: datetime
    ping_interval: timedelta
    resumed: Sequence[str] = ()  # execution ids of the hello's held runs resumed
    refused: Sequence[Rejected] = ()  # and those not, with why


@dataclass(frozen=True)
class Assignment:
    run_id: str
    execution_id: str
    job_id: str
    job_name: str
    attempt: int
    claim_token: str
    handler: str
    payload: Mapping[str, Any]
    deadline: datetime
    scheduled_for: datetime


@dataclass(frozen=True)
class CancelOrder:
    execution_id: str
    reason: str


@dataclass(frozen=True)
class Ping:
    nonce: int


@dataclass(frozen=True)
class Drain:
    deadline: datetime


@dataclass(frozen=True)
class Rejected:
    """A worker's message refused; the stream goes on. `code` is a gRPC status code's name."""

    execution_id: str
    code: str
    field: str
    message: str


Outbound = Welcome | Assignment | CancelOrder | Ping | Drain | Rejected
