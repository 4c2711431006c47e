"""A typed asyncio client of scheduler-grpc over grpc.aio.

    async with SchedulerClient.connect("127.0.0.1:50051") as client:
        await client.login("admin", "admin123")
        job = await client.create_job("hello", "test.log", payload={"message": "hi"}, cron="*/5 * * * * *")
        execution = await client.trigger_job(job.id)
        done = await client.wait_for_execution(execution.id)

Every RPC of the scheduler.v1 services has a method taking plain Python arguments (datetimes,
timedeltas or seconds, dicts, enum names such as "paused") and returning the proto messages of
`scheduler_client.v1`. Every unary call has a deadline (`timeout` of the client, 10 s by default;
`rpc_timeout=` per call). Failures raise `SchedulerClientError` subclasses carrying the gRPC status
code (see `scheduler_client.errors`). Only grpcio and protobuf are needed.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, Generic, Self, TypeVar

import grpc
import grpc.aio
from google.protobuf import duration_pb2, field_mask_pb2, struct_pb2, timestamp_pb2
from google.protobuf.message import Message

from scheduler_client import __version__
from scheduler_client.errors import (
    DeadlineExceeded,
    InvalidArgument,
    NotFound,
    SchedulerClientError,
    error_for,
    from_rpc_error,
)
from scheduler_client.v1 import auth_pb2, cluster_pb2, executions_pb2, jobs_pb2, limits_pb2, queue_pb2, users_pb2

__all__ = [
    "DEFAULT_TARGET",
    "DEFAULT_TIMEOUT",
    "FINAL_STATES",
    "RUN_FINAL_STATES",
    "Page",
    "SchedulerClient",
    "TriggerItem",
    "enum_label",
    "to_datetime",
]

DEFAULT_TARGET = "127.0.0.1:50051"
DEFAULT_TIMEOUT = 10.0
"""Deadline of every unary call, in seconds, unless the client or the call says otherwise."""

DEFAULT_MAX_RETRIES = 3

_M = TypeVar("_M", bound=Message)
_T = TypeVar("_T")

Seconds = timedelta | float | int
"""A duration: a timedelta, or seconds."""

_PKG = "/scheduler.v1."
_AUTH = _PKG + "AuthService/"
_JOBS = _PKG + "JobService/"
_EXECUTIONS = _PKG + "ExecutionService/"
_QUEUE = _PKG + "QueueService/"
_CLUSTER = _PKG + "ClusterService/"
_USERS = _PKG + "UserService/"
_LIMITS = _PKG + "LimitService/"

CURSOR_METADATA = "x-scheduler-cursor"
"""Initial metadata of WatchExecutions: the cursor the subscription starts at (sent once it is live)."""
WATCH_BATCH = 1000
"""`WatchExecutionsRequest.max_events_per_response` of `watch_executions` (the server's cap)."""

# Watch reconnects on these codes: a restarted or draining server, or a subscriber that fell behind.
_RESUMABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED})

FINAL_STATES = frozenset(
    {
        executions_pb2.EXECUTION_STATE_SUCCEEDED,
        executions_pb2.EXECUTION_STATE_FAILED,
        executions_pb2.EXECUTION_STATE_TIMED_OUT,
        executions_pb2.EXECUTION_STATE_CANCELLED,
        executions_pb2.EXECUTION_STATE_DEAD,
        executions_pb2.EXECUTION_STATE_ABANDONED,
        executions_pb2.EXECUTION_STATE_INTERRUPTED,
        executions_pb2.EXECUTION_STATE_SKIPPED,
        executions_pb2.EXECUTION_STATE_MISSED,
        executions_pb2.EXECUTION_STATE_UPSTREAM_FAILED,
    }
)
"""States an attempt does not leave (a failed attempt may be followed by a new attempt)."""

RUN_FINAL_STATES = frozenset(
    {
        executions_pb2.EXECUTION_STATE_SUCCEEDED,
        executions_pb2.EXECUTION_STATE_CANCELLED,
        executions_pb2.EXECUTION_STATE_DEAD,
        executions_pb2.EXECUTION_STATE_SKIPPED,
        executions_pb2.EXECUTION_STATE_MISSED,
        executions_pb2.EXECUTION_STATE_UPSTREAM_FAILED,
    }
)
"""States that end a run: a run's latest attempt in one of these has no next attempt. (A failed,
timed-out, abandoned or interrupted attempt is followed by the run's next attempt, or is recorded
dead when the retry budget is spent.)"""


@dataclass(frozen=True)
class Page(Generic[_T]):
    """One page of a list call; pass `next_page_token` back for the next one ("" on the last page)."""

    items: list[_T]
    next_page_token: str

    def __iter__(self) -> Iterator[_T]:
        return iter(self.items)

    def __len__(self) -> int:
        return len(self.items)


# --- conversions -------------------------------------------------------------------------------


class _EnumType:
    """The parts of a generated protobuf enum wrapper the client uses."""

    def __init__(self, wrapper: Any, prefix: str, what: str) -> None:
        self._wrapper = wrapper
        self.prefix = prefix
        self.what = what

    def name(self, value: int | str) -> str:
        """The enum constant's full name for `value`: a number, a full name or a short one ("paused")."""
        if isinstance(value, int):
            try:
                return str(self._wrapper.Name(value))
            except ValueError:
                raise InvalidArgument(f"{self.what}: unknown value {value}") from None
        text = value.strip().upper().replace("-", "_")
        full = text if text.startswith(self.prefix) else self.prefix + text
        names = self.names()
        if full not in names or full.endswith("_UNSPECIFIED"):
            choices = ", ".join(n.removeprefix(self.prefix).lower() for n in names if not n.endswith("_UNSPECIFIED"))
            raise InvalidArgument(f"{self.what}: unknown value {value!r} (one of {choices})")
        return full

    def names(self) -> list[str]:
        """Every constant's full name, in number order."""
        return [str(value.name) for value in self._wrapper.DESCRIPTOR.values]

    def choices(self) -> list[str]:
        """Short lower-case names, e.g. ["active", "paused"]."""
        return [name.removeprefix(self.prefix).lower() for name in self.names() if not name.endswith("_UNSPECIFIED")]


JOB_STATE = _EnumType(jobs_pb2.JobState, "JOB_STATE_", "state")
MISFIRE_POLICY = _EnumType(jobs_pb2.MisfirePolicy, "MISFIRE_POLICY_", "misfire_policy")
CONCURRENCY_POLICY = _EnumType(jobs_pb2.ConcurrencyPolicy, "CONCURRENCY_POLICY_", "concurrency_policy")
DST_GAP_POLICY = _EnumType(jobs_pb2.DstGapPolicy, "DST_GAP_POLICY_", "dst_gap_policy")
DST_FOLD_POLICY = _EnumType(jobs_pb2.DstFoldPolicy, "DST_FOLD_POLICY_", "dst_fold_policy")
EXECUTION_STATE = _EnumType(executions_pb2.ExecutionState, "EXECUTION_STATE_", "state")
JOB_VIEW = _EnumType(jobs_pb2.JobView, "JOB_VIEW_", "view")
EXECUTION_VIEW = _EnumType(executions_pb2.ExecutionView, "EXECUTION_VIEW_", "view")
EVENT_TYPE = _EnumType(executions_pb2.EventType, "EVENT_TYPE_", "event type")
ROLE = _EnumType(auth_pb2.Role, "ROLE_", "role")
USER_STATE = _EnumType(users_pb2.UserState, "USER_STATE_", "state")
TRIGGER_RULE = _EnumType(executions_pb2.TriggerRule, "TRIGGER_RULE_", "trigger_rule")
FLOW_RUN_STATE = _EnumType(executions_pb2.FlowRunState, "FLOW_RUN_STATE_", "flow run state")
LIMIT_KIND = _EnumType(limits_pb2.LimitKind, "LIMIT_KIND_", "kind")

_LABEL_PREFIXES = (
    "JOB_STATE_",
    "MISFIRE_POLICY_",
    "CONCURRENCY_POLICY_",
    "DST_GAP_POLICY_",
    "DST_FOLD_POLICY_",
    "DST_EFFECT_",
    "EXECUTION_STATE_",
    "EVENT_TYPE_",
    "TRIGGER_RULE_",
    "FLOW_RUN_STATE_",
    "TRIGGER_",
    "ROLE_",
    "BREAKER_STATE_",
    "LIMIT_KIND_",
)


def enum_label(full_name: str) -> str:
    """`EXECUTION_STATE_SUCCEEDED` -> `succeeded` (for display)."""
    for prefix in _LABEL_PREFIXES:
        if full_name.startswith(prefix):
            return full_name.removeprefix(prefix).lower()
    return full_name.lower()


def _timestamp(value: datetime) -> timestamp_pb2.Timestamp:
    """A Timestamp; a naive datetime is taken as UTC."""
    stamp = timestamp_pb2.Timestamp()
    stamp.FromDatetime(value if value.tzinfo is not None else value.replace(tzinfo=UTC))
    return stamp


def _duration(value: Seconds, what: str) -> duration_pb2.Duration:
    delta = value if isinstance(value, timedelta) else timedelta(seconds=float(value))
    if delta < timedelta(0):
        raise InvalidArgument(f"{what}: must not be negative")
    duration = duration_pb2.Duration()
    duration.FromTimedelta(delta)
    return duration


MAX_STRUCT_DEPTH = 32
"""Objects and arrays nested in a payload at most: protobuf decodes about 100 nested messages, and
each JSON level is two (a Value holding a Struct or ListValue). The server's own limit is lower."""


def _nesting(value: Any, limit: int) -> int:
    """How deep objects and arrays nest in `value`, counted up to `limit + 1` (no further)."""
    if limit < 0 or not isinstance(value, Mapping | list | tuple):
        return 0
    items = value.values() if isinstance(value, Mapping) else value
    return 1 + max((_nesting(item, limit - 1) for item in items), default=0)


def _struct(value: Mapping[str, Any], what: str) -> struct_pb2.Struct:
    if _nesting(value, MAX_STRUCT_DEPTH) > MAX_STRUCT_DEPTH:
        raise InvalidArgument(f"{what}: nested deeper than {MAX_STRUCT_DEPTH} objects or arrays")
    struct = struct_pb2.Struct()
    try:
        struct.update(dict(value))
    except (TypeError, ValueError) as exc:
        raise InvalidArgument(f"{what}: not representable as JSON: {exc}") from None
    return struct


MAX_TRIGGER_ITEMS = 1000
"""Items of one BatchTriggerJobs call at most (`batch_trigger_jobs` splits longer lists)."""
_ITEM_INDEX = re.compile(r"^requests\[(\d+)\]")
_STATUS_BY_NUMBER = {code.value[0]: code for code in grpc.StatusCode}


@dataclass(frozen=True)
class TriggerItem:
    """One run for `SchedulerClient.batch_trigger_jobs`: the job's id, the request id that makes it
    idempotent (generated when None), and a payload replacing the job's for this run (None: the job's)."""

    job_id: str
    request_id: str | None = None
    payload: Mapping[str, Any] | None = None


def _trigger_request(item: TriggerItem | str, index: int) -> jobs_pb2.TriggerJobRequest:
    if isinstance(item, str):
        item = TriggerItem(item)
    request = jobs_pb2.TriggerJobRequest(id=item.job_id, request_id=item.request_id or str(uuid.uuid4()))
    if item.payload is not None:
        request.payload.CopyFrom(_struct(item.payload, f"requests[{index}].payload"))
    return request


def to_datetime(stamp: timestamp_pb2.Timestamp) -> datetime | None:
    """A timezone-aware UTC datetime, or None for an unset (zero) Timestamp."""
    if stamp.seconds == 0 and stamp.nanos == 0:
        return None
    return stamp.ToDatetime(tzinfo=UTC)


def _serialize(message: Message) -> bytes:
    return message.SerializeToString()


# --- the client --------------------------------------------------------------------------------


class SchedulerClient:
    """An asyncio client of one scheduler-grpc server (or a load balancer in front of several).

    Use `async with SchedulerClient.connect(target) as client:`; the channel is created when the
    context is entered, inside the running event loop, and closed when it is left.

    Args:
        target: `host:port` of the server (a gRPC target string).
        token: a session token (from `login`) or an API key, sent as `authorization: Bearer <token>`.
        tls: False for plaintext, True for TLS with the system's root certificates, or
            `grpc.ChannelCredentials` for anything else.
        timeout: deadline of each unary call in seconds (override per call with `rpc_timeout=`).
        options: extra gRPC channel options.
    """

    def __init__(
        self,
        target: str = DEFAULT_TARGET,
        *,
        token: str | None = None,
        tls: bool | grpc.ChannelCredentials = False,
        timeout: float = DEFAULT_TIMEOUT,
        options: Sequence[tuple[str, Any]] = (),
    ) -> None:
        if timeout <= 0:
            raise ValueError("timeout must be positive")
        self.target = target
        self.token = token or None
        self.timeout = timeout
        self._tls = tls
        self._options = [("grpc.primary_user_agent", f"scheduler-grpc-client/{__version__}"), *options]
        self._channel: grpc.aio.Channel | None = None

    @classmethod
    def connect(
        cls,
        target: str = DEFAULT_TARGET,
        *,
        token: str | None = None,
        tls: bool | grpc.ChannelCredentials = False,
        timeout: float = DEFAULT_TIMEOUT,
        options: Sequence[tuple[str, Any]] = (),
    ) -> SchedulerClient:
        """A client to use as `async with SchedulerClient.connect(...) as client` (same arguments as the class)."""
        return cls(target, token=token, tls=tls, timeout=timeout, options=options)

    # -- lifecycle --

    async def open(self) -> Self:
        """Create the channel (inside the running loop). `async with` calls it for you."""
        if self._channel is None:
            if self._tls is False:
                self._channel = grpc.aio.insecure_channel(self.target, options=self._options)
            else:
                credentials = grpc.ssl_channel_credentials() if self._tls is True else self._tls
                self._channel = grpc.aio.secure_channel(self.target, credentials, options=self._options)
        return self

    async def close(self) -> None:
        """Close the channel; calls in flight are cancelled."""
        channel, self._channel = self._channel, None
        if channel is not None:
            await channel.close()

    async def __aenter__(self) -> Self:
        return await self.open()

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    def _require_channel(self) -> grpc.aio.Channel:
        if self._channel is None:
            raise RuntimeError("the client is not open: use `async with SchedulerClient.connect(...) as client`")
        return self._channel

    def _metadata(self, authenticated: bool) -> tuple[tuple[str, str], ...]:
        if authenticated and self.token:
            return (("authorization", f"Bearer {self.token}"),)
        return ()

    def _deadline(self, rpc_timeout: float | None) -> float:
        return self.timeout if rpc_timeout is None else rpc_timeout

    async def _call(
        self,
        path: str,
        request: Message,
        response_type: type[_M],
        rpc_timeout: float | None,
        *,
        authenticated: bool = True,
    ) -> _M:
        method = self._require_channel().unary_unary(
            path, request_serializer=_serialize, response_deserializer=response_type.FromString
        )
        try:
            return await method(request, timeout=self._deadline(rpc_timeout), metadata=self._metadata(authenticated))
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc) from exc

    # -- AuthService --

    async def login(self, username: str, password: str, *, rpc_timeout: float | None = None) -> auth_pb2.LoginResponse:
        """Log in; the returned token is kept and sent with every later call."""
        response = await self._call(
            _AUTH + "Login",
            auth_pb2.LoginRequest(username=username, password=password),
            auth_pb2.LoginResponse,
            rpc_timeout,
            authenticated=False,
        )
        self.token = response.token
        return response

    async def logout(self, *, rpc_timeout: float | None = None) -> None:
        """Revoke the session token on the server and forget it."""
        await self._call(_AUTH + "Logout", auth_pb2.LogoutRequest(), auth_pb2.LogoutResponse, rpc_timeout)
        self.token = None

    async def whoami(self, *, rpc_timeout: float | None = None) -> auth_pb2.WhoAmIResponse:
        """The caller's principal and role."""
        return await self._call(_AUTH + "WhoAmI", auth_pb2.WhoAmIRequest(), auth_pb2.WhoAmIResponse, rpc_timeout)

    async def create_api_key(
        self,
        display_name: str,
        role: int | str = "viewer",
        *,
        expire_time: datetime | None = None,
        rpc_timeout: float | None = None,
    ) -> auth_pb2.CreateApiKeyResponse:
        """Create an API key (admin only); `.secret` of the response is shown this once."""
        request = auth_pb2.CreateApiKeyRequest(display_name=display_name, role=ROLE.name(role))
        if expire_time is not None:
            request.expire_time.CopyFrom(_timestamp(expire_time))
        return await self._call(_AUTH + "CreateApiKey", request, auth_pb2.CreateApiKeyResponse, rpc_timeout)

    async def list_api_keys(
        self, *, page_size: int = 0, page_token: str = "", rpc_timeout: float | None = None
    ) -> Page[auth_pb2.ApiKey]:
        """One page of API keys (admin only), newest first."""
        response = await self._call(
            _AUTH + "ListApiKeys",
            auth_pb2.ListApiKeysRequest(page_size=page_size, page_token=page_token),
            auth_pb2.ListApiKeysResponse,
            rpc_timeout,
        )
        return Page(list(response.api_keys), response.next_page_token)

    async def revoke_api_key(self, key_id: str, *, rpc_timeout: float | None = None) -> auth_pb2.ApiKey:
        """Revoke an API key (admin only)."""
        response = await self._call(
            _AUTH + "RevokeApiKey", auth_pb2.RevokeApiKeyRequest(id=key_id), auth_pb2.RevokeApiKeyResponse, rpc_timeout
        )
        return response.api_key

    # -- JobService --

    async def create_job(
        self,
        name: str,
        handler: str,
        *,
        payload: Mapping[str, Any] | None = None,
        cron: str | None = None,
        time_zone: str | None = None,
        run_at: datetime | None = None,
        dst_gap_policy: int | str | None = None,
        dst_fold_policy: int | str | None = None,
        queue: str | None = None,
        priority: int | None = None,
        max_retries: int | None = None,
        initial_backoff: Seconds | None = None,
        max_backoff: Seconds | None = None,
        jitter: bool | None = None,
        timeout: Seconds | None = None,  # noqa: ASYNC109 - the job's attempt timeout, not this call's
        misfire_policy: int | str | None = None,
        concurrency_policy: int | str | None = None,
        depends_on: Sequence[str] | None = None,
        trigger_rule: int | str | None = None,
        limits: Sequence[LimitRefArg] | None = None,
        request_id: str | None = None,
        rpc_timeout: float | None = None,
    ) -> jobs_pb2.Job:
        """Create a job: `cron` (+ `time_zone`), a one-shot `run_at`, or neither (runs only when triggered).

        Unset arguments take the server's defaults. `request_id` makes the call idempotent.
        """
        job = build_job(
            name=name,
            handler=handler,
            payload=payload,
            cron=cron,
            time_zone=time_zone,
            run_at=run_at,
            dst_gap_policy=dst_gap_policy,
            dst_fold_policy=dst_fold_policy,
            queue=queue,
            priority=priority,
            max_retries=max_retries,
            initial_backoff=initial_backoff,
            max_backoff=max_backoff,
            jitter=jitter,
            timeout=timeout,
            misfire_policy=misfire_policy,
            concurrency_policy=concurrency_policy,
            depends_on=depends_on,
            trigger_rule=trigger_rule,
            limits=limits,
        )
        return await self.create_job_message(job, request_id=request_id, rpc_timeout=rpc_timeout)

    async def create_job_message(
        self, job: jobs_pb2.Job, *, request_id: str | None = None, rpc_timeout: float | None = None
    ) -> jobs_pb2.Job:
        """Create a job from a `Job` message you built yourself."""
        response = await self._call(
            _JOBS + "CreateJob",
            jobs_pb2.CreateJobRequest(job=job, request_id=request_id or ""),
            jobs_pb2.CreateJobResponse,
            rpc_timeout,
        )
        return response.job

    async def get_job(self, job_id: str, *, rpc_timeout: float | None = None) -> jobs_pb2.Job:
        """Read one job."""
        response = await self._call(
            _JOBS + "GetJob", jobs_pb2.GetJobRequest(id=job_id), jobs_pb2.GetJobResponse, rpc_timeout
        )
        return response.job

    async def list_jobs(
        self,
        *,
        state: int | str | None = None,
        handler: str | None = None,
        page_size: int = 0,
        page_token: str = "",
        view: int | str | None = None,
        rpc_timeout: float | None = None,
    ) -> Page[jobs_pb2.Job]:
        """One page of jobs ordered by name, optionally only `state` ("active"/"paused") or one handler;
        `view="basic"` leaves out the payloads."""
        request = jobs_pb2.ListJobsRequest(
            page_size=page_size,
            page_token=page_token,
            handler=handler or "",
            state=JOB_STATE.name(state) if state is not None else "JOB_STATE_UNSPECIFIED",
            view=JOB_VIEW.name(view) if view is not None else "JOB_VIEW_UNSPECIFIED",
        )
        response = await self._call(_JOBS + "ListJobs", request, jobs_pb2.ListJobsResponse, rpc_timeout)
        return Page(list(response.jobs), response.next_page_token)

    def iter_jobs(
        self,
        *,
        state: int | str | None = None,
        handler: str | None = None,
        page_size: int = 0,
        view: int | str | None = None,
    ) -> AsyncIterator[jobs_pb2.Job]:
        """Every job, page after page."""
        return _pages(
            lambda token: self.list_jobs(state=state, handler=handler, page_size=page_size, page_token=token, view=view)
        )

    async def find_job(self, name: str, *, rpc_timeout: float | None = None) -> jobs_pb2.Job:
        """The job named `name` (searched through ListJobs); NotFound if there is none."""
        async for job in _pages(
            lambda token: self.list_jobs(page_size=1000, page_token=token, rpc_timeout=rpc_timeout)
        ):
            if job.name == name:
                return job
        raise NotFound(f"no job named {name!r}")

    async def update_job(
        self,
        job_id: str,
        *,
        etag: str | None = None,
        name: str | None = None,
        handler: str | None = None,
        payload: Mapping[str, Any] | None = None,
        cron: str | None = None,
        time_zone: str | None = None,
        run_at: datetime | None = None,
        dst_gap_policy: int | str | None = None,
        dst_fold_policy: int | str | None = None,
        queue: str | None = None,
        priority: int | None = None,
        max_retries: int | None = None,
        initial_backoff: Seconds | None = None,
        max_backoff: Seconds | None = None,
        jitter: bool | None = None,
        timeout: Seconds | None = None,  # noqa: ASYNC109 - the job's attempt timeout, not this call's
        misfire_policy: int | str | None = None,
        concurrency_policy: int | str | None = None,
        depends_on: Sequence[str] | None = None,
        trigger_rule: int | str | None = None,
        limits: Sequence[LimitRefArg] | None = None,
        rpc_timeout: float | None = None,
    ) -> jobs_pb2.Job:
        """Change the given fields only (a field mask of the arguments not None).

        With `etag` (from the job as read), a concurrent change makes the call fail with Aborted.
        """
        job = build_job(
            name=name or "",
            handler=handler or "",
            payload=payload,
            cron=cron,
            time_zone=time_zone,
            run_at=run_at,
            dst_gap_policy=dst_gap_policy,
            dst_fold_policy=dst_fold_policy,
            queue=queue,
            priority=priority,
            max_retries=max_retries,
            initial_backoff=initial_backoff,
            max_backoff=max_backoff,
            jitter=jitter,
            timeout=timeout,
            misfire_policy=misfire_policy,
            concurrency_policy=concurrency_policy,
            depends_on=depends_on,
            trigger_rule=trigger_rule,
            limits=limits,
        )
        job.id = job_id
        given = {
            "name": name,
            "handler": handler,
            "payload": payload,
            "schedule.cron": cron,
            "schedule.time_zone": time_zone,
            "schedule.run_time": run_at,
            "schedule.dst_gap_policy": dst_gap_policy,
            "schedule.dst_fold_policy": dst_fold_policy,
            "queue": queue,
            "priority": priority,
            "retry_policy.max_retries": max_retries,
            "retry_policy.initial_backoff": initial_backoff,
            "retry_policy.max_backoff": max_backoff,
            "retry_policy.jitter": jitter,
            "timeout": timeout,
            "misfire_policy": misfire_policy,
            "concurrency_policy": concurrency_policy,
            "depends_on": depends_on,  # [] clears them
            "trigger_rule": trigger_rule,
            "limits": limits,  # [] clears them
        }
        paths = [path for path, value in given.items() if value is not None]
        if not paths:
            raise InvalidArgument("update_job: give at least one field to change")
        return await self.update_job_message(job, paths, etag=etag, rpc_timeout=rpc_timeout)

    async def update_job_message(
        self,
        job: jobs_pb2.Job,
        update_mask: Iterable[str],
        *,
        etag: str | None = None,
        rpc_timeout: float | None = None,
    ) -> jobs_pb2.Job:
        """UpdateJob with a `Job` message and field mask paths you built yourself."""
        request = jobs_pb2.UpdateJobRequest(
            job=job, update_mask=field_mask_pb2.FieldMask(paths=list(update_mask)), etag=etag or ""
        )
        response = await self._call(_JOBS + "UpdateJob", request, jobs_pb2.UpdateJobResponse, rpc_timeout)
        return response.job

    async def delete_job(
        self, job_id: str, *, detach_dependents: bool = False, rpc_timeout: float | None = None
    ) -> None:
        """Delete a job and its history (one others depend on only with `detach_dependents`)."""
        await self._call(
            _JOBS + "DeleteJob",
            jobs_pb2.DeleteJobRequest(id=job_id, detach_dependents=detach_dependents),
            jobs_pb2.DeleteJobResponse,
            rpc_timeout,
        )

    async def pause_job(self, job_id: str, *, rpc_timeout: float | None = None) -> jobs_pb2.Job:
        """Stop scheduling a job."""
        response = await self._call(
            _JOBS + "PauseJob", jobs_pb2.PauseJobRequest(id=job_id), jobs_pb2.PauseJobResponse, rpc_timeout
        )
        return response.job

    async def resume_job(self, job_id: str, *, rpc_timeout: float | None = None) -> jobs_pb2.Job:
        """Schedule a paused job again from now on."""
        response = await self._call(
            _JOBS + "ResumeJob", jobs_pb2.ResumeJobRequest(id=job_id), jobs_pb2.ResumeJobResponse, rpc_timeout
        )
        return response.job

    async def batch_pause_jobs(
        self,
        ids: Sequence[str] = (),
        *,
        filter: jobs_pb2.JobFilter | None = None,
        validate_only: bool = False,
        rpc_timeout: float | None = None,
    ) -> jobs_pb2.BatchPauseJobsResponse:
        """Pause the jobs named by `ids`, or every job matching `filter` (bounded server-side);
        `validate_only` counts them and changes nothing."""
        request = jobs_pb2.BatchPauseJobsRequest(ids=list(ids), filter=filter, validate_only=validate_only)
        return await self._call(_JOBS + "BatchPauseJobs", request, jobs_pb2.BatchPauseJobsResponse, rpc_timeout)

    async def batch_resume_jobs(
        self,
        ids: Sequence[str] = (),
        *,
        filter: jobs_pb2.JobFilter | None = None,
        validate_only: bool = False,
        rpc_timeout: float | None = None,
    ) -> jobs_pb2.BatchResumeJobsResponse:
        """Resume the jobs named by `ids`, or every job matching `filter`."""
        request = jobs_pb2.BatchResumeJobsRequest(ids=list(ids), filter=filter, validate_only=validate_only)
        return await self._call(_JOBS + "BatchResumeJobs", request, jobs_pb2.BatchResumeJobsResponse, rpc_timeout)

    async def batch_delete_jobs(
        self,
        ids: Sequence[str] = (),
        *,
        filter: jobs_pb2.JobFilter | None = None,
        validate_only: bool = False,
        detach_dependents: bool = False,
        rpc_timeout: float | None = None,
    ) -> jobs_pb2.BatchDeleteJobsResponse:
        """Delete the jobs named by `ids`, or every job matching `filter` (admin); jobs others
        depend on are kept (`kept_ids`) unless `detach_dependents`."""
        request = jobs_pb2.BatchDeleteJobsRequest(
            ids=list(ids), filter=filter, validate_only=validate_only, detach_dependents=detach_dependents
        )
        return await self._call(_JOBS + "BatchDeleteJobs", request, jobs_pb2.BatchDeleteJobsResponse, rpc_timeout)

    async def trigger_job(
        self,
        job_id: str,
        *,
        request_id: str | None = None,
        payload: Mapping[str, Any] | None = None,
        rpc_timeout: float | None = None,
    ) -> executions_pb2.Execution:
        """Run a job now. The same `request_id` never runs it twice (one is generated if not given);
        `payload` replaces the job's for this run (checked against its handler)."""
        request = jobs_pb2.TriggerJobRequest(id=job_id, request_id=request_id or str(uuid.uuid4()))
        if payload is not None:
            request.payload.CopyFrom(_struct(payload, "payload"))
        response = await self._call(_JOBS + "TriggerJob", request, jobs_pb2.TriggerJobResponse, rpc_timeout)
        return response.execution

    async def batch_trigger_jobs(
        self, items: Iterable[TriggerItem | str], *, rpc_timeout: float | None = None
    ) -> list[executions_pb2.Execution | SchedulerClientError]:
        """Run many jobs now (or one job many times): one run per item, in BatchTriggerJobs calls of
        at most `MAX_TRIGGER_ITEMS` items. An item is a `TriggerItem` or a job id; an item without a
        `request_id` gets a generated one.

        Returns:
            Per item, in order: its run's first attempt, or the error TriggerJob would have raised for
            it alone (`NotFound` for a job that does not exist, ...); the other items ran.

        Raises:
            InvalidArgument: an invalid item, named by its index among `items` (`requests[1042].payload.n`);
                nothing of its call of `MAX_TRIGGER_ITEMS` was run (calls before it were).
        """
        requests = [_trigger_request(item, index) for index, item in enumerate(items)]
        results: list[executions_pb2.Execution | SchedulerClientError] = []
        for offset in range(0, len(requests), MAX_TRIGGER_ITEMS):
            chunk = requests[offset : offset + MAX_TRIGGER_ITEMS]
            try:
                response = await self._call(
                    _JOBS + "BatchTriggerJobs",
                    jobs_pb2.BatchTriggerJobsRequest(requests=chunk),
                    jobs_pb2.BatchTriggerJobsResponse,
                    rpc_timeout,
                )
            except InvalidArgument as exc:
                if offset == 0:
                    raise
                found = _ITEM_INDEX.match(exc.message)
                if found is None:
                    raise
                message = f"requests[{int(found[1]) + offset}]{exc.message[found.end() :]}"
                raise InvalidArgument(message, exc.code) from exc
            for result in response.results:
                if result.code == 0:
                    results.append(result.execution)
                else:
                    results.append(
                        error_for(_STATUS_BY_NUMBER.get(result.code, grpc.StatusCode.UNKNOWN), result.message)
                    )
        return results

    async def preview_schedule(
        self,
        cron: str,
        *,
        time_zone: str | None = None,
        count: int = 10,
        start_time: datetime | None = None,
        dst_gap_policy: int | str | None = None,
        dst_fold_policy: int | str | None = None,
        rpc_timeout: float | None = None,
    ) -> list[jobs_pb2.FireTime]:
        """The next `count` fire times of a cron expression in a time zone, DST applied."""
        schedule = jobs_pb2.Schedule(cron=cron, time_zone=time_zone or "")
        if dst_gap_policy is not None:
            schedule.MergeFrom(jobs_pb2.Schedule(dst_gap_policy=DST_GAP_POLICY.name(dst_gap_policy)))
        if dst_fold_policy is not None:
            schedule.MergeFrom(jobs_pb2.Schedule(dst_fold_policy=DST_FOLD_POLICY.name(dst_fold_policy)))
        request = jobs_pb2.PreviewScheduleRequest(schedule=schedule, count=count)
        if start_time is not None:
            request.start_time.CopyFrom(_timestamp(start_time))
        response = await self._call(_JOBS + "PreviewSchedule", request, jobs_pb2.PreviewScheduleResponse, rpc_timeout)
        return list(response.fire_times)

    async def backfill_job(
        self, job_id: str, start_time: datetime, end_time: datetime, *, rpc_timeout: float | None = None
    ) -> list[executions_pb2.Execution]:
        """One run per slot of a cron job in [start_time, end_time) (slots already backfilled are skipped)."""
        request = jobs_pb2.BackfillJobRequest(
            id=job_id, start_time=_timestamp(start_time), end_time=_timestamp(end_time)
        )
        response = await self._call(_JOBS + "BackfillJob", request, jobs_pb2.BackfillJobResponse, rpc_timeout)
        return list(response.executions)

    # -- ExecutionService --

    async def get_execution(self, execution_id: str, *, rpc_timeout: float | None = None) -> executions_pb2.Execution:
        """Read one execution (attempt)."""
        response = await self._call(
            _EXECUTIONS + "GetExecution",
            executions_pb2.GetExecutionRequest(id=execution_id),
            executions_pb2.GetExecutionResponse,
            rpc_timeout,
        )
        return response.execution

    async def list_executions(
        self,
        *,
        job_id: str | None = None,
        states: Iterable[int | str] = (),
        page_size: int = 0,
        page_token: str = "",
        view: int | str | None = None,
        flow_run_id: str | None = None,
        rpc_timeout: float | None = None,
    ) -> Page[executions_pb2.Execution]:
        """One page of executions, newest first, optionally of one job and in some states ("succeeded", ...);
        `view="basic"` leaves out results and errors."""
        request = executions_pb2.ListExecutionsRequest(
            page_size=page_size,
            page_token=page_token,
            job_id=job_id or "",
            states=[EXECUTION_STATE.name(state) for state in states],
            view=EXECUTION_VIEW.name(view) if view is not None else "EXECUTION_VIEW_UNSPECIFIED",
            flow_run_id=flow_run_id or "",
        )
        response = await self._call(
            _EXECUTIONS + "ListExecutions", request, executions_pb2.ListExecutionsResponse, rpc_timeout
        )
        return Page(list(response.executions), response.next_page_token)

    def iter_executions(
        self,
        *,
        job_id: str | None = None,
        states: Iterable[int | str] = (),
        page_size: int = 0,
        view: int | str | None = None,
        flow_run_id: str | None = None,
    ) -> AsyncIterator[executions_pb2.Execution]:
        """Every execution, page after page, newest first."""
        wanted = list(states)
        return _pages(
            lambda token: self.list_executions(
                job_id=job_id,
                states=wanted,
                page_size=page_size,
                page_token=token,
                view=view,
                flow_run_id=flow_run_id,
            )
        )

    async def get_flow_run(self, flow_run_id: str, *, rpc_timeout: float | None = None) -> executions_pb2.FlowRun:
        """A flow run (job dependencies) with every node and its state."""
        response = await self._call(
            _EXECUTIONS + "GetFlowRun",
            executions_pb2.GetFlowRunRequest(id=flow_run_id),
            executions_pb2.GetFlowRunResponse,
            rpc_timeout,
        )
        return response.flow_run

    async def list_flow_runs(
        self,
        *,
        root_job_id: str | None = None,
        state: int | str | None = None,
        page_size: int = 0,
        page_token: str = "",
        rpc_timeout: float | None = None,
    ) -> Page[executions_pb2.FlowRun]:
        """One page of flow runs (without their nodes), newest first, optionally started by one job
        and in one state ("running", "succeeded", "failed", "cancelled")."""
        request = executions_pb2.ListFlowRunsRequest(
            page_size=page_size,
            page_token=page_token,
            root_job_id=root_job_id or "",
            state=FLOW_RUN_STATE.name(state) if state is not None else "FLOW_RUN_STATE_UNSPECIFIED",
        )
        response = await self._call(
            _EXECUTIONS + "ListFlowRuns", request, executions_pb2.ListFlowRunsResponse, rpc_timeout
        )
        return Page(list(response.flow_runs), response.next_page_token)

    def iter_flow_runs(
        self, *, root_job_id: str | None = None, state: int | str | None = None, page_size: int = 0
    ) -> AsyncIterator[executions_pb2.FlowRun]:
        """Every flow run, page after page, newest first."""
        return _pages(
            lambda token: self.list_flow_runs(
                root_job_id=root_job_id, state=state, page_size=page_size, page_token=token
            )
        )

    async def cancel_flow_run(self, flow_run_id: str, *, rpc_timeout: float | None = None) -> executions_pb2.FlowRun:
        """Cancel a flow run: its queued and running runs, and the nodes still waiting."""
        response = await self._call(
            _EXECUTIONS + "CancelFlowRun",
            executions_pb2.CancelFlowRunRequest(id=flow_run_id),
            executions_pb2.CancelFlowRunResponse,
            rpc_timeout,
        )
        return response.flow_run

    async def cancel_execution(
        self, execution_id: str, *, rpc_timeout: float | None = None
    ) -> executions_pb2.Execution:
        """Cancel a run (any of its attempts' ids)."""
        response = await self._call(
            _EXECUTIONS + "CancelExecution",
            executions_pb2.CancelExecutionRequest(id=execution_id),
            executions_pb2.CancelExecutionResponse,
            rpc_timeout,
        )
        return response.execution

    async def batch_cancel_executions(
        self,
        ids: Sequence[str] = (),
        *,
        filter: executions_pb2.ExecutionFilter | None = None,
        validate_only: bool = False,
        rpc_timeout: float | None = None,
    ) -> executions_pb2.BatchCancelExecutionsResponse:
        """Cancel the runs named by `ids` (any attempt's id), or every open run matching `filter`."""
        request = executions_pb2.BatchCancelExecutionsRequest(ids=list(ids), filter=filter, validate_only=validate_only)
        return await self._call(
            _EXECUTIONS + "BatchCancelExecutions", request, executions_pb2.BatchCancelExecutionsResponse, rpc_timeout
        )

    async def batch_retry_executions(
        self,
        ids: Sequence[str] = (),
        *,
        filter: executions_pb2.ExecutionFilter | None = None,
        validate_only: bool = False,
        dead_only: bool = False,
        rpc_timeout: float | None = None,
    ) -> executions_pb2.BatchRetryExecutionsResponse:
        """Give the failed, cancelled or dead runs named by `ids`, or matching `filter`, a new
        attempt (a dead one is requeued from its dead-letter queue); `dead_only`: dead runs only."""
        request = executions_pb2.BatchRetryExecutionsRequest(
            ids=list(ids), filter=filter, validate_only=validate_only, dead_only=dead_only
        )
        return await self._call(
            _EXECUTIONS + "BatchRetryExecutions", request, executions_pb2.BatchRetryExecutionsResponse, rpc_timeout
        )

    async def watch_executions(
        self,
        *,
        job_ids: Iterable[str] = (),
        types: Iterable[int | str] = (),
        handler: str | None = None,
        cursor: str | None = None,
        flow_run_id: str | None = None,
        max_reconnects: int = 10,
        reconnect_delay: float = 0.1,
        max_reconnect_delay: float = 2.0,
        rpc_timeout: float | None = None,
        subscribed: asyncio.Event | None = None,
    ) -> AsyncGenerator[executions_pb2.ExecutionEvent, None]:
        """Execution events as they happen (from now on, or after `cursor`).

        When the stream breaks with UNAVAILABLE (server restart) or RESOURCE_EXHAUSTED (this
        subscriber fell behind), it is reopened from the last event's cursor, so no event is lost
        or seen twice; after `max_reconnects` failures in a row without an event the error is
        raised. The stream has no deadline unless `rpc_timeout` (seconds, per connection) is given.
        Use `contextlib.aclosing(...)` (or break and let it be collected) to stop watching.

        The server confirms a live subscription with its response headers, carrying the cursor it
        starts at: the stream resumes from there when it breaks before the first event, and
        `subscribed` (if given) is set then, so a caller knows every later event will reach it.
        """
        request = executions_pb2.WatchExecutionsRequest(
            job_ids=list(job_ids),
            types=[EVENT_TYPE.name(kind) for kind in types],
            handler=handler or "",
            cursor=cursor or "",
            flow_run_id=flow_run_id or "",
            # Batched: the server sends what is ready in one message (its cap applies); yielded
            # here one event at a time, each with its own cursor.
            max_events_per_response=WATCH_BATCH,
        )
        failures = 0
        delay = reconnect_delay
        while True:
            method = self._require_channel().unary_stream(
                _EXECUTIONS + "WatchExecutions",
                request_serializer=_serialize,
                response_deserializer=executions_pb2.WatchExecutionsResponse.FromString,
            )
            call = method(request, timeout=rpc_timeout, metadata=self._metadata(True))
            try:
                start = _metadata_value(await call.initial_metadata(), CURSOR_METADATA)
                if start and not request.cursor:
                    request.cursor = start
                if subscribed is not None:
                    subscribed.set()
                async for response in call:
                    failures, delay = 0, reconnect_delay
                    # `event`: a server older than batching (it ignores `max_events_per_response`).
                    for event in response.events or (response.event,):
                        if event.cursor:
                            request.cursor = event.cursor
                        yield event
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in _RESUMABLE or failures >= max_reconnects:
                    raise from_rpc_error(exc) from exc
                failures += 1
            else:
                return  # the server ended the stream
            finally:
                call.cancel()
            await asyncio.sleep(delay)
            delay = min(delay * 2, max_reconnect_delay)

    async def wait_for_execution(
        self, execution_id: str, *, within: float = 60.0, poll_interval: float = 1.0
    ) -> executions_pb2.Execution:
        """Wait until an attempt is in a final state (see FINAL_STATES) and return it.

        Watches the job's events and reads the execution on each of its events, and at least every
        `poll_interval` seconds, so no event can be missed between reading and subscribing.
        Raises DeadlineExceeded after `within` seconds. To wait for a run through its retries,
        use `wait_for_run`.
        """
        execution = await self.get_execution(execution_id)
        if execution.state in FINAL_STATES:
            return execution

        async def read() -> executions_pb2.Execution:
            return await self.get_execution(execution_id)

        return await self._wait_until(
            execution,
            read,
            done=lambda attempt: attempt.state in FINAL_STATES,
            relevant=lambda event: event.execution_id == execution_id,
            what=lambda attempt: f"execution {execution_id}",
            within=within,
            poll_interval=poll_interval,
        )

    async def wait_for_run(
        self, execution_id: str, *, within: float = 60.0, poll_interval: float = 1.0
    ) -> executions_pb2.Execution:
        """Wait until the run of an attempt has ended (see RUN_FINAL_STATES); return its latest attempt.

        A run whose first attempt failed and whose retry succeeded returns the succeeded retry; a run
        whose retry budget ran out returns its dead attempt. Watches the job's events like
        `wait_for_execution` and reads the run's latest attempt on each event of the run, and at
        least every `poll_interval` seconds. Raises DeadlineExceeded after `within` seconds.
        """
        first = await self.get_execution(execution_id)
        run_id = first.run_id or first.id
        latest = await self._latest_attempt(first, run_id)
        if latest.state in RUN_FINAL_STATES:
            return latest

        async def read() -> executions_pb2.Execution:
            nonlocal latest
            latest = await self._latest_attempt(latest, run_id)
            return latest

        return await self._wait_until(
            latest,
            read,
            done=lambda attempt: attempt.state in RUN_FINAL_STATES,
            relevant=lambda event: event.run_id == run_id,
            what=lambda attempt: f"run {run_id} (attempt {attempt.attempt})",
            within=within,
            poll_interval=poll_interval,
        )

    async def _latest_attempt(self, known: executions_pb2.Execution, run_id: str) -> executions_pb2.Execution:
        """The run's latest attempt, read again: `known` itself, or the newest attempt after it."""
        current = await self.get_execution(known.id)
        if current.state in RUN_FINAL_STATES or current.state not in FINAL_STATES:
            return current  # it ended the run, or it is still queued or running: no later attempt
        # Its run goes on in a later attempt, created with its outcome. Executions list newest
        # first, so every later attempt comes before this one: read back to it, and no further.
        newest = current
        async for execution in self.iter_executions(job_id=current.job_id, page_size=100, view="basic"):
            if execution.id == current.id:
                break
            if execution.run_id == run_id and execution.attempt > newest.attempt:
                newest = execution
        return current if newest is current else await self.get_execution(newest.id)

    async def _wait_until(
        self,
        execution: executions_pb2.Execution,
        read: Callable[[], Awaitable[executions_pb2.Execution]],
        *,
        done: Callable[[executions_pb2.Execution], bool],
        relevant: Callable[[executions_pb2.ExecutionEvent], bool],
        what: Callable[[executions_pb2.Execution], str],
        within: float,
        poll_interval: float,
    ) -> executions_pb2.Execution:
        """`read()` until `done` with what it returns: on each `relevant` event of the job, and at least
        every `poll_interval` seconds; DeadlineExceeded (naming `what`) after `within` seconds."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within
        subscribed = asyncio.Event()
        events = self.watch_executions(job_ids=[execution.job_id], subscribed=subscribed)
        pending: asyncio.Task[executions_pb2.ExecutionEvent | None] | None = None
        watching = True
        try:
            # Read again once the subscription is live: what happened before it shows here, after it
            # as an event. (Without the server's confirmation, polling covers the gap.)
            pending = asyncio.ensure_future(_next_or_none(events))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(subscribed.wait(), timeout=max(min(poll_interval, deadline - loop.time()), 0))
            execution = await read()
            last_read = loop.time()
            if done(execution):
                return execution
            while True:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    state = enum_label(executions_pb2.ExecutionState.Name(execution.state))
                    raise DeadlineExceeded(f"{what(execution)} still {state} after {within:g}s")
                wait = max(min(poll_interval - (loop.time() - last_read), remaining), 0.0)
                if watching:
                    if pending is None:
                        pending = asyncio.ensure_future(_next_or_none(events))
                    finished, _ = await asyncio.wait({pending}, timeout=wait)
                    if finished:
                        task, pending = pending, None
                        event = None if task.exception() is not None else task.result()
                        if event is None:
                            watching = False  # the stream ended or failed: poll from now on
                        elif not relevant(event) and loop.time() - last_read < poll_interval:
                            continue
                else:
                    await asyncio.sleep(wait)
                execution = await read()
                last_read = loop.time()
                if done(execution):
                    return execution
        finally:
            if pending is not None:
                pending.cancel()
                with contextlib.suppress(BaseException):
                    await pending
            await events.aclose()

    # -- QueueService --

    async def get_queue_stats(
        self, queue: str | None = None, *, rpc_timeout: float | None = None
    ) -> queue_pb2.GetQueueStatsResponse:
        """Ready, processing, delayed and dead counts of a queue (default "default")."""
        return await self._call(
            _QUEUE + "GetQueueStats",
            queue_pb2.GetQueueStatsRequest(queue=queue or ""),
            queue_pb2.GetQueueStatsResponse,
            rpc_timeout,
        )

    async def list_dead_letters(
        self,
        queue: str | None = None,
        *,
        page_size: int = 0,
        page_token: str = "",
        rpc_timeout: float | None = None,
    ) -> Page[queue_pb2.DeadLetter]:
        """One page of dead-lettered runs, oldest first."""
        response = await self._call(
            _QUEUE + "ListDeadLetters",
            queue_pb2.ListDeadLettersRequest(queue=queue or "", page_size=page_size, page_token=page_token),
            queue_pb2.ListDeadLettersResponse,
            rpc_timeout,
        )
        return Page(list(response.dead_letters), response.next_page_token)

    def iter_dead_letters(self, queue: str | None = None, *, page_size: int = 0) -> AsyncIterator[queue_pb2.DeadLetter]:
        """Every dead-lettered run, page after page."""
        return _pages(lambda token: self.list_dead_letters(queue, page_size=page_size, page_token=token))

    async def requeue_dead_letters(
        self,
        run_ids: Iterable[str] = (),
        *,
        all: bool = False,
        queue: str | None = None,
        rpc_timeout: float | None = None,
    ) -> list[str]:
        """Give dead runs a new attempt; returns the run ids requeued."""
        ids = _run_ids(run_ids, all)
        response = await self._call(
            _QUEUE + "RequeueDeadLetters",
            queue_pb2.RequeueDeadLettersRequest(queue=queue or "", run_ids=ids, all=all),
            queue_pb2.RequeueDeadLettersResponse,
            rpc_timeout,
        )
        return list(response.run_ids)

    async def purge_dead_letters(
        self,
        run_ids: Iterable[str] = (),
        *,
        all: bool = False,
        queue: str | None = None,
        rpc_timeout: float | None = None,
    ) -> list[str]:
        """Forget dead runs (their history stays); returns the run ids purged."""
        ids = _run_ids(run_ids, all)
        response = await self._call(
            _QUEUE + "PurgeDeadLetters",
            queue_pb2.PurgeDeadLettersRequest(queue=queue or "", run_ids=ids, all=all),
            queue_pb2.PurgeDeadLettersResponse,
            rpc_timeout,
        )
        return list(response.run_ids)

    async def get_queue_shards(
        self, queue: str | None = None, *, rpc_timeout: float | None = None
    ) -> queue_pb2.GetQueueShardsResponse:
        """A queue's shard counts (default "default"): in effect now, served, and every change."""
        return await self._call(
            _QUEUE + "GetQueueShards",
            queue_pb2.GetQueueShardsRequest(queue=queue or ""),
            queue_pb2.GetQueueShardsResponse,
            rpc_timeout,
        )

    async def list_queue_shards(
        self, *, page_size: int = 0, page_token: str = "", rpc_timeout: float | None = None
    ) -> Page[queue_pb2.QueueShards]:
        """One page of the queues whose shard count was ever set, by name."""
        response = await self._call(
            _QUEUE + "ListQueueShards",
            queue_pb2.ListQueueShardsRequest(page_size=page_size, page_token=page_token),
            queue_pb2.ListQueueShardsResponse,
            rpc_timeout,
        )
        return Page(list(response.queues), response.next_page_token)

    def iter_queue_shards(self, *, page_size: int = 0) -> AsyncIterator[queue_pb2.QueueShards]:
        """Every queue whose shard count was ever set, page after page."""
        return _pages(lambda token: self.list_queue_shards(page_size=page_size, page_token=token))

    async def set_queue_shards(
        self, queue: str, shards: int, *, rpc_timeout: float | None = None
    ) -> queue_pb2.QueueShardChange:
        """Give `queue` `shards` shards (1 to 64) for the runs made from the server's
        SCHEDULER_QUEUE_SHARD_LEAD after now on (admin); the change, with when it applies."""
        response = await self._call(
            _QUEUE + "SetQueueShards",
            queue_pb2.SetQueueShardsRequest(queue=queue, shards=shards),
            queue_pb2.SetQueueShardsResponse,
            rpc_timeout,
        )
        return response.change

    # -- ClusterService --

    async def list_workers(self, *, rpc_timeout: float | None = None) -> list[cluster_pb2.Worker]:
        """Workers that sent a heartbeat recently."""
        response = await self._call(
            _CLUSTER + "ListWorkers", cluster_pb2.ListWorkersRequest(), cluster_pb2.ListWorkersResponse, rpc_timeout
        )
        return list(response.workers)

    async def get_scheduler_status(self, *, rpc_timeout: float | None = None) -> cluster_pb2.GetSchedulerStatusResponse:
        """The scheduler leader, its term (fencing token) and since when it leads."""
        return await self._call(
            _CLUSTER + "GetSchedulerStatus",
            cluster_pb2.GetSchedulerStatusRequest(),
            cluster_pb2.GetSchedulerStatusResponse,
            rpc_timeout,
        )

    async def list_handlers(self, *, rpc_timeout: float | None = None) -> list[cluster_pb2.Handler]:
        """The handlers jobs can use, with their payload fields and breaker states."""
        response = await self._call(
            _CLUSTER + "ListHandlers", cluster_pb2.ListHandlersRequest(), cluster_pb2.ListHandlersResponse, rpc_timeout
        )
        return list(response.handlers)

    # -- UserService (admin only) --

    async def create_user(
        self,
        username: str,
        password: str,
        role: int | str = "viewer",
        *,
        request_id: str | None = None,
        rpc_timeout: float | None = None,
    ) -> users_pb2.User:
        """Create an enabled user (the password: 12 to 1024 characters). The same `request_id`
        returns the user its first call created (one is generated if not given)."""
        request = users_pb2.CreateUserRequest(
            user=users_pb2.User(username=username, role=ROLE.name(role)),
            password=password,
            request_id=request_id or str(uuid.uuid4()),
        )
        return (await self._call(_USERS + "CreateUser", request, users_pb2.CreateUserResponse, rpc_timeout)).user

    async def get_user(self, user_id: str, *, rpc_timeout: float | None = None) -> users_pb2.User:
        """Read one user."""
        request = users_pb2.GetUserRequest(id=user_id)
        return (await self._call(_USERS + "GetUser", request, users_pb2.GetUserResponse, rpc_timeout)).user

    async def list_users(
        self, *, page_size: int = 0, page_token: str = "", rpc_timeout: float | None = None
    ) -> Page[users_pb2.User]:
        """One page of users by username (disabled ones included)."""
        request = users_pb2.ListUsersRequest(page_size=page_size, page_token=page_token)
        response = await self._call(_USERS + "ListUsers", request, users_pb2.ListUsersResponse, rpc_timeout)
        return Page(list(response.users), response.next_page_token)

    def iter_users(self, *, page_size: int = 0) -> AsyncIterator[users_pb2.User]:
        """Every user, page after page."""
        return _pages(lambda token: self.list_users(page_size=page_size, page_token=token))

    async def find_user(self, username: str, *, rpc_timeout: float | None = None) -> users_pb2.User:
        """The user named `username` (searched through ListUsers); NotFound if there is none."""
        async for user in _pages(
            lambda token: self.list_users(page_size=1000, page_token=token, rpc_timeout=rpc_timeout)
        ):
            if user.username == username:
                return user
        raise NotFound(f"no user named {username!r}")

    async def update_user(
        self, user_id: str, *, role: int | str, etag: str | None = None, rpc_timeout: float | None = None
    ) -> users_pb2.User:
        """Give a user another role (its live sessions have it from their next call)."""
        request = users_pb2.UpdateUserRequest(
            user=users_pb2.User(id=user_id, role=ROLE.name(role)),
            update_mask=field_mask_pb2.FieldMask(paths=["role"]),
            etag=etag or "",
        )
        return (await self._call(_USERS + "UpdateUser", request, users_pb2.UpdateUserResponse, rpc_timeout)).user

    async def delete_user(self, user_id: str, *, etag: str | None = None, rpc_timeout: float | None = None) -> None:
        """Delete a user and end its sessions."""
        request = users_pb2.DeleteUserRequest(id=user_id, etag=etag or "")
        await self._call(_USERS + "DeleteUser", request, users_pb2.DeleteUserResponse, rpc_timeout)

    async def disable_user(
        self, user_id: str, *, etag: str | None = None, rpc_timeout: float | None = None
    ) -> users_pb2.User:
        """Stop a user logging in and end its sessions."""
        request = users_pb2.DisableUserRequest(id=user_id, etag=etag or "")
        return (await self._call(_USERS + "DisableUser", request, users_pb2.DisableUserResponse, rpc_timeout)).user

    async def enable_user(
        self, user_id: str, *, etag: str | None = None, rpc_timeout: float | None = None
    ) -> users_pb2.User:
        """Let a disabled user log in again."""
        request = users_pb2.EnableUserRequest(id=user_id, etag=etag or "")
        return (await self._call(_USERS + "EnableUser", request, users_pb2.EnableUserResponse, rpc_timeout)).user

    async def reset_user_password(
        self, user_id: str, new_password: str, *, etag: str | None = None, rpc_timeout: float | None = None
    ) -> users_pb2.User:
        """Set a user's password and end its other sessions."""
        request = users_pb2.ResetUserPasswordRequest(id=user_id, new_password=new_password, etag=etag or "")
        response = await self._call(
            _USERS + "ResetUserPassword", request, users_pb2.ResetUserPasswordResponse, rpc_timeout
        )
        return response.user

    # -- LimitService (viewers read, admins define) --

    async def create_limit(
        self,
        name: str,
        kind: int | str,
        limit: int,
        *,
        period: Seconds | None = None,
        burst: int = 0,
        overrides: Mapping[str, int | tuple[int, int]] | None = None,
        request_id: str | None = None,
        rpc_timeout: float | None = None,
    ) -> limits_pb2.Limit:
        """Create a limit: `kind` "concurrency" (at most `limit` units held at once per key) or
        "rate" (`limit` units per `period` per key, `burst` more at once). `overrides`: key ->
        its own limit, or (limit, burst). The same `request_id` returns the limit its first call
        created (one is generated if not given)."""
        message = _limit_message(kind, limit, period, burst, overrides)
        message.name = name
        request = limits_pb2.CreateLimitRequest(limit=message, request_id=request_id or str(uuid.uuid4()))
        return (await self._call(_LIMITS + "CreateLimit", request, limits_pb2.CreateLimitResponse, rpc_timeout)).limit

    async def get_limit(
        self, limit_id: str = "", *, name: str = "", rpc_timeout: float | None = None
    ) -> limits_pb2.Limit:
        """Read one limit, by id or (with `name`) by name."""
        request = limits_pb2.GetLimitRequest(id=limit_id, name=name)
        return (await self._call(_LIMITS + "GetLimit", request, limits_pb2.GetLimitResponse, rpc_timeout)).limit

    async def list_limits(
        self, *, page_size: int = 0, page_token: str = "", rpc_timeout: float | None = None
    ) -> Page[limits_pb2.Limit]:
        """One page of limits by name."""
        request = limits_pb2.ListLimitsRequest(page_size=page_size, page_token=page_token)
        response = await self._call(_LIMITS + "ListLimits", request, limits_pb2.ListLimitsResponse, rpc_timeout)
        return Page(list(response.limits), response.next_page_token)

    def iter_limits(self, *, page_size: int = 0) -> AsyncIterator[limits_pb2.Limit]:
        """Every limit, page after page."""
        return _pages(lambda token: self.list_limits(page_size=page_size, page_token=token))

    async def update_limit(
        self,
        limit_id: str,
        *,
        etag: str | None = None,
        kind: int | str | None = None,
        limit: int | None = None,
        period: Seconds | None = None,
        burst: int | None = None,
        overrides: Mapping[str, int | tuple[int, int]] | None = None,
        rpc_timeout: float | None = None,
    ) -> limits_pb2.Limit:
        """Change the given fields only (the name never changes). Changing `kind` sends `period`
        too (unset when not given: a concurrency limit has none)."""
        message = _limit_message(kind or 0, limit or 0, period, burst or 0, overrides)
        message.id = limit_id
        given = {"kind": kind, "limit": limit, "period": period, "burst": burst, "overrides": overrides}
        paths = [path for path, value in given.items() if value is not None]
        if kind is not None and "period" not in paths:
            paths.append("period")
        if not paths:
            raise InvalidArgument("update_limit: give at least one field to change")
        request = limits_pb2.UpdateLimitRequest(
            limit=message, update_mask=field_mask_pb2.FieldMask(paths=paths), etag=etag or ""
        )
        return (await self._call(_LIMITS + "UpdateLimit", request, limits_pb2.UpdateLimitResponse, rpc_timeout)).limit

    async def delete_limit(self, limit_id: str, *, etag: str | None = None, rpc_timeout: float | None = None) -> None:
        """Delete a limit no job uses (FailedPrecondition naming the jobs otherwise)."""
        request = limits_pb2.DeleteLimitRequest(id=limit_id, etag=etag or "")
        await self._call(_LIMITS + "DeleteLimit", request, limits_pb2.DeleteLimitResponse, rpc_timeout)

    async def set_limit_override(
        self,
        limit_id: str,
        key: str,
        *,
        limit: int | None,
        burst: int = 0,
        etag: str | None = None,
        rpc_timeout: float | None = None,
    ) -> limits_pb2.Limit:
        """Give `key` its own `limit` (and `burst`), or take its override away (`limit=None`)."""
        request = limits_pb2.SetLimitOverrideRequest(id=limit_id, key=key, etag=etag or "")
        if limit is not None:
            request.override.CopyFrom(limits_pb2.LimitOverride(limit=limit, burst=burst))
        response = await self._call(
            _LIMITS + "SetLimitOverride", request, limits_pb2.SetLimitOverrideResponse, rpc_timeout
        )
        return response.limit

    async def get_limit_key(
        self, limit: str, key: str, *, queue: str = "", rpc_timeout: float | None = None
    ) -> limits_pb2.LimitKeyState:
        """One key of the limit named `limit`: per queue the limit is used on (or on `queue`), its
        running units, queued runs, next admission time and pause."""
        request = limits_pb2.GetLimitKeyRequest(limit=limit, key=key, queue=queue)
        return (await self._call(_LIMITS + "GetLimitKey", request, limits_pb2.GetLimitKeyResponse, rpc_timeout)).state

    async def pause_limit_key(
        self,
        limit: str,
        key: str,
        *,
        duration: Seconds | None = None,
        until: datetime | None = None,
        queue: str = "",
        rpc_timeout: float | None = None,
    ) -> limits_pb2.LimitKeyState:
        """Pause a key (it admits no run) for `duration` or until `until` (give one), on each queue
        the limit is used on (or on `queue`); returns its state after."""
        request = limits_pb2.PauseLimitKeyRequest(limit=limit, key=key, queue=queue)
        if duration is not None:
            request.duration.CopyFrom(_duration(duration, "duration"))
        if until is not None:
            request.pause_end_time.CopyFrom(_timestamp(until))
        response = await self._call(_LIMITS + "PauseLimitKey", request, limits_pb2.PauseLimitKeyResponse, rpc_timeout)
        return response.state

    async def resume_limit_key(
        self, limit: str, key: str, *, queue: str = "", rpc_timeout: float | None = None
    ) -> limits_pb2.LimitKeyState:
        """End a key's pause now, on each queue the limit is used on (or on `queue`)."""
        request = limits_pb2.ResumeLimitKeyRequest(limit=limit, key=key, queue=queue)
        response = await self._call(_LIMITS + "ResumeLimitKey", request, limits_pb2.ResumeLimitKeyResponse, rpc_timeout)
        return response.state


# --- helpers -----------------------------------------------------------------------------------


def _limit_message(
    kind: int | str,
    limit: int,
    period: Seconds | None,
    burst: int,
    overrides: Mapping[str, int | tuple[int, int]] | None,
) -> limits_pb2.Limit:
    """A `Limit` message of the given fields (kind 0: unset)."""
    message = limits_pb2.Limit(limit=limit, burst=burst)
    if kind:
        message.MergeFrom(limits_pb2.Limit(kind=LIMIT_KIND.name(kind)))
    if period is not None:
        message.period.CopyFrom(_duration(period, "period"))
    for key, value in (overrides or {}).items():
        own, own_burst = (value, 0) if isinstance(value, int) else value
        message.overrides[key].CopyFrom(limits_pb2.LimitOverride(limit=own, burst=own_burst))
    return message


def build_job(
    *,
    name: str,
    handler: str,
    payload: Mapping[str, Any] | None = None,
    cron: str | None = None,
    time_zone: str | None = None,
    run_at: datetime | None = None,
    dst_gap_policy: int | str | None = None,
    dst_fold_policy: int | str | None = None,
    queue: str | None = None,
    priority: int | None = None,
    max_retries: int | None = None,
    initial_backoff: Seconds | None = None,
    max_backoff: Seconds | None = None,
    jitter: bool | None = None,
    timeout: Seconds | None = None,
    misfire_policy: int | str | None = None,
    concurrency_policy: int | str | None = None,
    depends_on: Sequence[str] | None = None,
    trigger_rule: int | str | None = None,
    limits: Sequence[LimitRefArg] | None = None,
) -> jobs_pb2.Job:
    """A `Job` message from plain arguments; unset ones stay unset (server defaults).

    `limits`: the limits each run takes, each a `LimitRef`, a `(limit, key[, units])` tuple or a
    `NAME:KEY[:UNITS]` string (`parse_limit_ref`).

    Giving any retry argument sends a whole retry policy: the others then take the documented
    defaults (3 retries, backoff 1 s to 5 min, jitter on).
    """
    schedule = _schedule(cron, time_zone, run_at, dst_gap_policy, dst_fold_policy)
    job = jobs_pb2.Job(name=name, handler=handler, queue=queue or "", priority=priority or 0)
    if payload is not None:
        job.payload.CopyFrom(_struct(payload, "payload"))
    if schedule is not None:
        job.schedule.CopyFrom(schedule)
    retry = _retry_policy(max_retries, initial_backoff, max_backoff, jitter)
    if retry is not None:
        job.retry_policy.CopyFrom(retry)
    if timeout is not None:
        job.timeout.CopyFrom(_duration(timeout, "timeout"))
    if misfire_policy is not None:
        job.MergeFrom(jobs_pb2.Job(misfire_policy=MISFIRE_POLICY.name(misfire_policy)))
    if concurrency_policy is not None:
        job.MergeFrom(jobs_pb2.Job(concurrency_policy=CONCURRENCY_POLICY.name(concurrency_policy)))
    if depends_on is not None:
        job.depends_on.extend(depends_on)
    if trigger_rule is not None:
        job.MergeFrom(jobs_pb2.Job(trigger_rule=TRIGGER_RULE.name(trigger_rule)))
    if limits is not None:
        job.limits.extend(limit_ref(value) for value in limits)
    return job


LimitRefArg = limits_pb2.LimitRef | str | tuple[str, str] | tuple[str, str, int]
"""A job's limit ref: a message, `(limit, key)`, `(limit, key, units)` or `NAME:KEY[:UNITS]`."""


def parse_limit_ref(text: str) -> limits_pb2.LimitRef:
    """`NAME:KEY[:UNITS]`: the limit's name (up to the first `:`), the key template (a constant or
    `payload.<field>`), and the units each run takes when the text ends in `:<digits>` (else 1).

    Raises:
        InvalidArgument: no `:` after a name, or no key.
    """
    name, colon, rest = text.partition(":")
    units: int | None = None
    head, last_colon, tail = rest.rpartition(":")
    if last_colon and tail.isdigit():
        rest, units = head, int(tail)
    if not colon or not name or not rest:
        raise InvalidArgument(f"limits: {text!r} is not NAME:KEY[:UNITS] (e.g. per-customer:payload.customer_id:1)")
    return limits_pb2.LimitRef(limit=name, key=rest, units=units)


def limit_ref(value: LimitRefArg) -> limits_pb2.LimitRef:
    """A `LimitRef` from any `LimitRefArg`."""
    if isinstance(value, limits_pb2.LimitRef):
        return value
    if isinstance(value, str):
        return parse_limit_ref(value)
    if len(value) == 3:
        return limits_pb2.LimitRef(limit=value[0], key=value[1], units=value[2])
    return limits_pb2.LimitRef(limit=value[0], key=value[1])


def _schedule(
    cron: str | None,
    time_zone: str | None,
    run_at: datetime | None,
    dst_gap_policy: int | str | None,
    dst_fold_policy: int | str | None,
) -> jobs_pb2.Schedule | None:
    """The `schedule` of `build_job`: None when no schedule argument is given (a manual job)."""
    if cron and run_at is not None:
        raise InvalidArgument("schedule: give either cron or run_at, not both")
    if not (cron or time_zone) and run_at is None and dst_gap_policy is None and dst_fold_policy is None:
        return None
    schedule = jobs_pb2.Schedule(cron=cron or "", time_zone=time_zone or "")
    if run_at is not None:
        schedule.run_time.CopyFrom(_timestamp(run_at))
    if dst_gap_policy is not None:
        schedule.MergeFrom(jobs_pb2.Schedule(dst_gap_policy=DST_GAP_POLICY.name(dst_gap_policy)))
    if dst_fold_policy is not None:
        schedule.MergeFrom(jobs_pb2.Schedule(dst_fold_policy=DST_FOLD_POLICY.name(dst_fold_policy)))
    return schedule


def _retry_policy(
    max_retries: int | None, initial_backoff: Seconds | None, max_backoff: Seconds | None, jitter: bool | None
) -> jobs_pb2.RetryPolicy | None:
    """The `retry_policy` of `build_job`: None when no retry argument is given (server defaults)."""
    if max_retries is None and initial_backoff is None and max_backoff is None and jitter is None:
        return None
    # A RetryPolicy message cannot leave a field "unset": what is not given gets the documented default.
    retry = jobs_pb2.RetryPolicy(
        max_retries=DEFAULT_MAX_RETRIES if max_retries is None else max_retries,
        jitter=True if jitter is None else jitter,
    )
    if initial_backoff is not None:
        retry.initial_backoff.CopyFrom(_duration(initial_backoff, "initial_backoff"))
    if max_backoff is not None:
        retry.max_backoff.CopyFrom(_duration(max_backoff, "max_backoff"))
    return retry


def _run_ids(run_ids: Iterable[str], all_runs: bool) -> list[str]:
    ids = list(run_ids)
    if not ids and not all_runs:
        raise InvalidArgument("run_ids: name at least one run, or pass all=True")
    if ids and all_runs:
        raise InvalidArgument("run_ids: give run ids or all=True, not both")
    return ids


async def _pages(fetch: Callable[[str], Awaitable[Page[_T]]]) -> AsyncIterator[_T]:
    token = ""
    while True:
        page = await fetch(token)
        for item in page.items:
            yield item
        if not page.next_page_token or page.next_page_token == token:
            return
        token = page.next_page_token


def _metadata_value(metadata: Any, key: str) -> str | None:
    for name, value in metadata or ():
        if name == key:
            return value.decode() if isinstance(value, bytes) else str(value)
    return None


async def _next_or_none(iterator: AsyncIterator[_T]) -> _T | None:
    try:
        return await anext(iterator)
    except StopAsyncIteration:
        return None
