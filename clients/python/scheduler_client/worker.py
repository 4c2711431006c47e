"""A remote worker: serve a scheduler-grpc deployment's runs from this process, over one
`WorkerService.Connect` stream (issue 23).

    worker = Worker("scheduler:50051", api_key=os.environ["SCHEDULER_WORKER_KEY"], slots=20)

    @worker.handler("acme.sync", description="sync one account")
    async def sync(ctx: ExecutionContext, payload: dict[str, Any]) -> Any:
        if rate_limited():
            ctx.retry_after(30)  # back to the queue, no attempt spent
        return {"synced": payload["account"]}

    asyncio.run(worker.run())

What it does for you: it says hello (its handlers, slots, SDK), grants credit as slots come free,
acknowledges each assignment on receipt, runs each in its own task, reports its outcome (the
handler's return value; an exception as a failure retried by the job's policy, `PermanentError`
as one that is not, `RetryAfter` / `ctx.retry_after` as back-pressure), cancels the task on the
server's cancel (the job's timeout, a CancelExecution) and answers pings. A lost stream is
reconnected with jittered exponential backoff (runs in flight then are cancelled: the server has
handed them back). `stop()` (or the server's drain) takes no new work and lets the running
handlers finish.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Final, NoReturn

import grpc
from google.protobuf import duration_pb2, struct_pb2
from google.protobuf.json_format import ParseDict

from scheduler_client import __version__
from scheduler_client.v1 import workers_pb2

log = logging.getLogger("scheduler_client.worker")

SDK: Final = "scheduler-client-python"
_CONNECT: Final = "/scheduler.v1.WorkerService/Connect"
# Codes that reconnecting cannot fix: the key, its role or what this worker says is wrong.
_FATAL: Final = frozenset(
    {grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.INVALID_ARGUMENT,
     grpc.StatusCode.UNIMPLEMENTED}
)  # fmt: skip

_BATCHED: Final = frozenset({"ack", "outcome", "credit", "batch"})

Handler = Callable[["ExecutionContext", dict[str, Any]], Awaitable[Any]]


class RetryAfter(Exception):
    """Raise from a handler: "rate limited, retry after `seconds`": the run goes back to the queue
    without spending an attempt (and its limit keys wait that long)."""

    def __init__(self, seconds: float, reason: str = "rate limited") -> None:
        super().__init__(f"{reason}; retry after {seconds:g}s")
        self.seconds = max(0.0, min(float(seconds), 3600.0))
        self.reason = reason


class PermanentError(Exception):
    """Raise from a handler for a failure retries cannot fix: the run is dead-lettered at once."""


@dataclass
class ExecutionContext:
    """What a handler knows about the run it executes.

    Attributes:
        run_id: The run (its first attempt's execution id).
        execution_id: This attempt. Not a once-only key: an assignment whose ack had not reached
            the server when its stream ended goes back unspent and may be delivered again (same
            execution id, same attempt), so a handler must be idempotent per execution id.
        job_id, job_name: The job.
        attempt: 1 for the first attempt, 2 for the first retry, ...
        handler: The handler name.
        deadline: When the job's timeout cancels it (server clock).
        scheduled_for: The slot the run belongs to.
        cancelled: Set when the server cancels the run (the handler's task is cancelled too).
    """

    run_id: str
    execution_id: str
    job_id: str
    job_name: str
    attempt: int
    handler: str
    deadline: datetime | None
    scheduled_for: datetime | None
    claim_token: str = field(repr=False, default="")
    cancelled: asyncio.Event = field(default_factory=asyncio.Event, repr=False)

    def retry_after(self, seconds: float, reason: str = "rate limited") -> NoReturn:
        """Hand the run back, unspent, to run again after `seconds` (raises `RetryAfter`)."""
        raise RetryAfter(seconds, reason)


@dataclass
class WorkerStats:
    """What this worker did (for tests and logs)."""

    assigned: int = 0
    succeeded: int = 0
    failed: int = 0
    cancelled: int = 0
    rejected: int = 0
    connects: int = 0


@dataclass
class _Registered:
    handler: Handler
    description: str
    schema_json: str


class Worker:
    """A remote worker of a scheduler-grpc deployment.

    Args:
        target: `host:port` of a server.
        api_key: An API key of the `worker` role.
        slots: Runs executed at once (credit never exceeds it).
        queue: The queue to take runs from (default: the server's).
        labels: Free-form labels shown with the worker.
        tls: False for plaintext, True for TLS with the system's roots, or channel credentials.
        options: Extra gRPC channel options.
        reconnect_max: The longest wait between two connection attempts, in seconds.
    """

    def __init__(
        self,
        target: str,
        api_key: str,
        *,
        slots: int = 10,
        queue: str = "",
        labels: Mapping[str, str] | None = None,
        tls: bool | grpc.ChannelCredentials = False,
        options: Sequence[tuple[str, Any]] = (),
        reconnect_max: float = 30.0,
    ) -> None:
        if slots < 1:
            raise ValueError("slots must be at least 1")
        self.target = target
        self.slots = slots
        self.queue = queue
        self.labels = dict(labels or {})
        self.stats = WorkerStats()
        self.worker_id = ""
        self.connected = asyncio.Event()
        self.draining = asyncio.Event()  # a server asked this worker to drain (it is stopping)
        self._api_key = api_key
        self._tls = tls
        self._options = [
            ("grpc.primary_user_agent", f"{SDK}/{__version__}"),
            # Keep the stream alive through idle proxies (the server allows a ping every 10 s).
            ("grpc.keepalive_time_ms", 20_000),
            ("grpc.keepalive_timeout_ms", 10_000),
            ("grpc.keepalive_permit_without_calls", 1),
            *options,
        ]
        self._reconnect_max = reconnect_max
        self._handlers: dict[str, _Registered] = {}
        self._stopping = asyncio.Event()

    def handler(
        self, name: str, *, description: str = "", payload_schema: Mapping[str, Any] | None = None
    ) -> Callable[[Handler], Handler]:
        """Register an async handler `f(ctx, payload) -> result` under `name` (a job's `handler`)."""

        def register(function: Handler) -> Handler:
            if name in self._handlers:
                raise ValueError(f"a handler named {name!r} is registered already")
            schema = "" if payload_schema is None else _json_text(payload_schema)
            self._handlers[name] = _Registered(function, description, schema)
            return function

        return register

    def stop(self) -> None:
        """Take no new work; `run` returns once the running handlers finished and reported."""
        self._stopping.set()

    async def run(self) -> None:
        """Serve until `stop()` (or a server's drain followed by `stop()`), reconnecting with
        jittered exponential backoff.

        Raises:
            grpc.aio.AioRpcError: a failure reconnecting cannot fix (the key, its role, a handler
                name breaking the naming rule).
        """
        if not self._handlers:
            raise ValueError("register at least one handler (@worker.handler)")
        delay = 0.1
        async with self._channel() as channel:
            while not self._stopping.is_set():
                stream = _Stream(self, channel)
                try:
                    await stream.serve()
                except grpc.aio.AioRpcError as exc:
                    if exc.code() in _FATAL:
                        raise
                    log.warning("stream lost (%s: %s); reconnecting", exc.code().name, exc.details())
                if stream.welcomed:
                    delay = 0.1
                if self._stopping.is_set():
                    break
                wait = random.uniform(0, delay)
                delay = min(delay * 2, self._reconnect_max)
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(wait):
                        await self._stopping.wait()

    @contextlib.asynccontextmanager
    async def _channel(self) -> AsyncIterator[grpc.aio.Channel]:
        if self._tls is False:
            channel = grpc.aio.insecure_channel(self.target, options=self._options)
        else:
            credentials = grpc.ssl_channel_credentials() if self._tls is True else self._tls
            channel = grpc.aio.secure_channel(self.target, credentials, options=self._options)
        try:
            yield channel
        finally:
            await channel.close()

    def hello(self) -> workers_pb2.Hello:
        return workers_pb2.Hello(
            handlers=[
                workers_pb2.HandlerInfo(name=name, description=entry.description, payload_schema_json=entry.schema_json)
                for name, entry in self._handlers.items()
            ],
            labels=self.labels,
            slots=self.slots,
            sdk=SDK,
            sdk_version=__version__,
            queue=self.queue,
        )


class _Stream:
    """One connection: its requests, its running tasks, its credit."""

    def __init__(self, worker: Worker, channel: grpc.aio.Channel) -> None:
        self._worker = worker
        self._channel = channel
        self._requests: asyncio.Queue[workers_pb2.ConnectRequest | None] = asyncio.Queue()
        self._tasks: dict[str, tuple[asyncio.Task[None], ExecutionContext]] = {}
        self._draining = False
        self.welcomed = False

    async def _outgoing(self) -> AsyncIterator[workers_pb2.ConnectRequest]:
        """The requests, with the acks, outcomes and credit that are ready together in one
        `RequestBatch` (one write instead of three per run on a busy stream)."""
        queue = self._requests
        while True:
            request = await queue.get()
            if request is None:
                return
            if request.WhichOneof("message") not in _BATCHED or queue.empty():
                yield request
                continue
            batch, others, end = workers_pb2.RequestBatch(), [], False
            _merge(batch, request)
            while not queue.empty():
                more = queue.get_nowait()
                if more is None:
                    end = True
                    break
                if more.WhichOneof("message") in _BATCHED:
                    _merge(batch, more)
                else:
                    others.append(more)
            yield workers_pb2.ConnectRequest(batch=batch)
            for other in others:
                yield other
            if end:
                return

    def _send(self, request: workers_pb2.ConnectRequest) -> None:
        self._requests.put_nowait(request)

    def _grant(self, count: int) -> None:
        if count > 0 and not self._draining and not self._worker._stopping.is_set():
            self._send(workers_pb2.ConnectRequest(credit=workers_pb2.Credit(grant=count)))

    async def serve(self) -> None:
        worker = self._worker
        connect = self._channel.stream_stream(
            _CONNECT,
            request_serializer=workers_pb2.ConnectRequest.SerializeToString,
            response_deserializer=workers_pb2.ConnectResponse.FromString,
        )
        self._send(workers_pb2.ConnectRequest(hello=worker.hello()))
        call = connect(self._outgoing(), metadata=(("authorization", f"Bearer {worker._api_key}"),))
        stopper = asyncio.create_task(self._stop_when_asked())
        try:
            async for response in call:
                self._on(response)
        finally:
            stopper.cancel()
            worker.connected.clear()
            # Runs still going cannot report on another stream: the server handed them back.
            for task, _ in list(self._tasks.values()):
                task.cancel()
            if self._tasks:
                await asyncio.wait([task for task, _ in self._tasks.values()])
            self._requests.put_nowait(None)

    async def _stop_when_asked(self) -> None:
        await self._worker._stopping.wait()
        self._draining = True
        self._close_when_idle()

    def _close_when_idle(self) -> None:
        if self._draining and not self._tasks:
            self._requests.put_nowait(None)  # the server ends the stream

    def _on(self, response: workers_pb2.ConnectResponse) -> None:
        kind = response.WhichOneof("message")
        if kind == "assignment":
            self._assigned(response.assignment)
        elif kind == "assignments":
            assignments = response.assignments.assignments
            # Their acks in one request (one message, not one per assignment).
            self._send(workers_pb2.ConnectRequest(batch=workers_pb2.RequestBatch(acks=[
                workers_pb2.Ack(execution_id=each.execution_id, claim_token=each.claim_token) for each in assignments
            ])))  # fmt: skip
            for assignment in assignments:
                self._assigned(assignment, acked=True)
        elif kind == "ping":
            self._send(workers_pb2.ConnectRequest(pong=workers_pb2.Pong(nonce=response.ping.nonce)))
        elif kind == "cancel":
            entry = self._tasks.get(response.cancel.execution_id)
            if entry is not None:
                entry[1].cancelled.set()
                entry[0].cancel()
        elif kind == "welcome":
            self.welcomed = True
            self._worker.draining.clear()
            self._worker.worker_id = response.welcome.worker_id
            self._worker.stats.connects += 1
            self._worker.connected.set()
            self._grant(self._worker.slots - len(self._tasks))
        elif kind == "drain":
            self._worker.draining.set()
            self._draining = True
            self._close_when_idle()
        elif kind == "rejected":
            rejected = response.rejected
            self._worker.stats.rejected += 1
            log.warning("the server refused a message: %s %s: %s", rejected.code, rejected.field, rejected.message)

    def _assigned(self, assignment: workers_pb2.Assignment, *, acked: bool = False) -> None:
        """Start an assignment (acknowledged first, unless `acked` says that is done)."""
        worker = self._worker
        worker.stats.assigned += 1
        if not acked:
            self._send(workers_pb2.ConnectRequest(
                ack=workers_pb2.Ack(execution_id=assignment.execution_id, claim_token=assignment.claim_token)
            ))  # fmt: skip
        ctx = ExecutionContext(
            run_id=assignment.run_id, execution_id=assignment.execution_id, job_id=assignment.job_id,
            job_name=assignment.job_name, attempt=assignment.attempt, handler=assignment.handler,
            deadline=_time(assignment, "deadline"), scheduled_for=_time(assignment, "scheduled_for"),
            claim_token=assignment.claim_token,
        )  # fmt: skip
        payload = {key: _json(value) for key, value in assignment.payload.fields.items()}
        task = asyncio.create_task(self._execute(ctx, payload), name=f"run {assignment.execution_id}")
        self._tasks[assignment.execution_id] = (task, ctx)

    async def _execute(self, ctx: ExecutionContext, payload: dict[str, Any]) -> None:
        outcome = workers_pb2.Outcome(execution_id=ctx.execution_id, claim_token=ctx.claim_token)
        stats = self._worker.stats
        try:
            registered = self._worker._handlers.get(ctx.handler)
            if registered is None:
                raise PermanentError(f"handler {ctx.handler!r} is not served by this worker")  # noqa: TRY301
            result = await registered.handler(ctx, payload)
            value = struct_pb2.Value()
            ParseDict(result, value)
            outcome.value.CopyFrom(value)
            stats.succeeded += 1
        except asyncio.CancelledError:
            stats.cancelled += 1
            outcome.error.message = "cancelled"
            if not ctx.cancelled.is_set():  # the stream ended: nothing to report to
                self._forget(ctx)
                raise
        except RetryAfter as exc:
            outcome.rate_limited.retry_after.CopyFrom(_duration(exc.seconds))
            outcome.rate_limited.reason = exc.reason
        except PermanentError as exc:
            stats.failed += 1
            outcome.error.message = str(exc) or type(exc).__name__
            outcome.error.permanent = True
        except Exception as exc:
            stats.failed += 1
            outcome.error.message = f"{type(exc).__name__}: {exc}"
        self._send(workers_pb2.ConnectRequest(outcome=outcome))
        self._forget(ctx)
        self._grant(1)

    def _forget(self, ctx: ExecutionContext) -> None:
        self._tasks.pop(ctx.execution_id, None)
        self._close_when_idle()


def _merge(batch: workers_pb2.RequestBatch, request: workers_pb2.ConnectRequest) -> None:
    kind = request.WhichOneof("message")
    if kind == "batch":
        batch.acks.extend(request.batch.acks)
        batch.outcomes.extend(request.batch.outcomes)
        batch.credit += request.batch.credit
    elif kind == "ack":
        batch.acks.append(request.ack)
    elif kind == "outcome":
        batch.outcomes.append(request.outcome)
    else:
        batch.credit += request.credit.grant


def _time(message: workers_pb2.Assignment, name: str) -> datetime | None:
    if not message.HasField(name):
        return None
    stamp = getattr(message, name)
    return datetime.fromtimestamp(stamp.seconds + stamp.nanos / 1e9, UTC)


def _duration(seconds: float) -> duration_pb2.Duration:
    message = duration_pb2.Duration()
    message.FromNanoseconds(int(seconds * 1e9))
    return message


def _json(value: struct_pb2.Value) -> Any:
    """A payload's value as JSON, its numbers (doubles in protobuf) back to ints where integral, as
    the server reads payloads (`5` stays `5`, not `5.0`). Direct: `MessageToDict` costs twice as much."""
    kind = value.WhichOneof("kind")
    if kind == "number_value":
        number = value.number_value
        return int(number) if number.is_integer() and abs(number) < 2**53 else number
    if kind == "string_value":
        return value.string_value
    if kind == "bool_value":
        return value.bool_value
    if kind == "struct_value":
        return {key: _json(item) for key, item in value.struct_value.fields.items()}
    if kind == "list_value":
        return [_json(item) for item in value.list_value.values]
    return None  # null_value


def _json_text(value: Mapping[str, Any]) -> str:
    import json

    return json.dumps(value, separators=(",", ":"))


__all__ = ["ExecutionContext", "PermanentError", "RetryAfter", "Worker", "WorkerStats"]
