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
server's cancel (the job's timeout, a CancelExecution) and answers pings. A lost stream (the
server's end, a cut connection, or no message from the server for 2.5 ping intervals) is
reconnected with jittered exponential backoff, and the runs still executing (or finished while
disconnected) are resumed on the new stream with their claim tokens: the server keeps their leases
again and takes their outcomes; the tasks of runs it does not resume (their leases expired) are
cancelled. `stop()` (or the server's drain) takes no new work and lets the running handlers finish.

Where a bidirectional stream does not survive (a proxy that buffers or cuts long streams),
`Worker(..., transport="unary")` serves the same runs over unary calls instead (`OpenWorkerSession`,
then `PollWorkerSession` with a bounded wait, `CloseWorkerSession`), with the same handler API and
semantics; a poll that reaches a server process not holding its session opens a new session.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
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
_OPEN: Final = "/scheduler.v1.WorkerService/OpenWorkerSession"
_POLL: Final = "/scheduler.v1.WorkerService/PollWorkerSession"
_CLOSE: Final = "/scheduler.v1.WorkerService/CloseWorkerSession"
_TRANSPORTS: Final = ("stream", "unary")
_CALL_MARGIN: Final = 10.0  # seconds a unary call may take beyond its wait
_MIN_POLL_WAIT: Final = 0.1  # seconds: a long poll is never a busy loop
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
            execution id, same attempt), so a handler must be idempotent per execution id. A run
            the worker still executes when its stream is lost is resumed on the next stream (its
            task goes on); one whose lease expired meanwhile is not, and its task is cancelled.
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
    resumed: int = 0  # runs resumed on a new stream
    not_resumed: int = 0  # runs a new stream did not resume (their tasks cancelled)


@dataclass(eq=False)
class _Run:
    """A run this worker executes, across streams, until its outcome is sent."""

    ctx: ExecutionContext
    task: asyncio.Task[None] | None = None
    stream: _Stream | None = None  # the live stream it reports to; None while disconnected
    outcome: workers_pb2.Outcome | None = None  # finished while disconnected: sent once resumed


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
        transport: `"stream"` (one `Connect` stream) or `"unary"` (polls, for networks where a
            bidirectional stream does not survive).
        poll_wait: With `transport="unary"`: how long a poll waits for work, in seconds (default
            and at most the server's `max_wait`; at least 0.1).
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
        transport: str = "stream",
        poll_wait: float | None = None,
    ) -> None:
        if slots < 1:
            raise ValueError("slots must be at least 1")
        if transport not in _TRANSPORTS:
            raise ValueError(f"transport must be one of {_TRANSPORTS}, got {transport!r}")
        self.transport = transport
        self.poll_wait = poll_wait
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
        self._runs: dict[str, _Run] = {}  # by execution id: executing, or finished and not reported
        self._ping_interval = 10.0  # seconds, as the last welcome said (the server's default before)

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
            try:
                # Stopping, runs still held (a lost stream) are reported on a new one first.
                while not self._stopping.is_set() or self._runs:
                    stream = _Stream(self, channel) if self.transport == "stream" else _Unary(self, channel)
                    try:
                        await stream.serve()
                    except grpc.aio.AioRpcError as exc:
                        if exc.code() in _FATAL:
                            raise
                        log.warning("stream lost (%s: %s); reconnecting", exc.code().name, exc.details())
                    if stream.welcomed:
                        delay = 0.1
                    if self._stopping.is_set() and not self._runs:
                        break
                    wait = random.uniform(0, delay)
                    delay = min(delay * 2, self._reconnect_max)
                    if self._stopping.is_set():
                        await asyncio.sleep(wait)
                        continue
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(wait):
                            await self._stopping.wait()
            finally:
                await self._drop(list(self._runs.values()))

    async def _drop(self, runs: Sequence[_Run]) -> None:
        """Stop runs no stream will report: their tasks cancelled (nothing reported)."""
        tasks = []
        for run in runs:
            self._runs.pop(run.ctx.execution_id, None)
            if run.task is not None and not run.task.done():
                run.task.cancel()
                tasks.append(run.task)
        if tasks:
            await asyncio.wait(tasks)

    async def _execute(self, run: _Run, payload: dict[str, Any]) -> None:
        ctx = run.ctx
        outcome = workers_pb2.Outcome(execution_id=ctx.execution_id, claim_token=ctx.claim_token)
        stats = self.stats
        try:
            registered = self._handlers.get(ctx.handler)
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
            if not ctx.cancelled.is_set():  # not the server's cancel (not resumed, or stopping): no report
                if self._runs.get(ctx.execution_id) is run:
                    del self._runs[ctx.execution_id]
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
        if self._runs.get(ctx.execution_id) is run:
            self._finished(run, outcome)

    def _finished(self, run: _Run, outcome: workers_pb2.Outcome) -> None:
        """A run's task ended with `outcome`: sent on its stream, or kept for the next one."""
        stream = run.stream
        if stream is None or stream.ended:
            run.outcome = outcome
            return
        del self._runs[run.ctx.execution_id]
        stream.report(outcome)

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
            held_runs=[
                workers_pb2.HeldRun(execution_id=eid, claim_token=run.ctx.claim_token)
                for eid, run in self._runs.items()
            ],
        )


class _Stream:
    """One connection: its requests, the runs it reports, its credit."""

    def __init__(self, worker: Worker, channel: grpc.aio.Channel) -> None:
        self._worker = worker
        self._channel = channel
        self._requests: asyncio.Queue[workers_pb2.ConnectRequest | None] = asyncio.Queue()
        self._draining = False
        self._offered: list[str] = []  # the runs its hello asked to resume
        self._heard = time.monotonic()  # when the server last said anything
        self._lost = False  # ended by the watchdog: the server went silent
        self.welcomed = False
        self.ended = False

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

    def _mine(self) -> list[_Run]:
        return [run for run in self._worker._runs.values() if run.stream is self]

    async def serve(self) -> None:
        worker = self._worker
        connect = self._channel.stream_stream(
            _CONNECT,
            request_serializer=workers_pb2.ConnectRequest.SerializeToString,
            response_deserializer=workers_pb2.ConnectResponse.FromString,
        )
        hello = worker.hello()
        self._offered = [held.execution_id for held in hello.held_runs]
        self._send(workers_pb2.ConnectRequest(hello=hello))
        call = connect(self._outgoing(), metadata=(("authorization", f"Bearer {worker._api_key}"),))
        stopper = asyncio.create_task(self._stop_when_asked())
        reading = asyncio.create_task(self._read(call))
        watchdog = asyncio.create_task(self._watch())
        try:
            done, _ = await asyncio.wait([reading, watchdog], return_when=asyncio.FIRST_COMPLETED)
            if reading in done:
                reading.result()  # (raises how the stream ended)
            else:
                log.warning("no message from the server for 2.5 ping intervals; reconnecting")
                call.cancel()
        finally:
            self.ended = True
            for task in (stopper, watchdog, reading):
                task.cancel()
            await asyncio.wait([reading])
            worker.connected.clear()
            # Runs still going are kept: the next stream resumes them (their outcomes wait).
            for run in self._mine():
                run.stream = None
            self._requests.put_nowait(None)

    async def _read(self, call: Any) -> None:
        async for response in call:
            self._heard = time.monotonic()
            self._on(response)

    async def _watch(self) -> None:
        """Return once the server has gone silent on this stream for 2.5 ping intervals (it pings
        every one; before the welcome, the last welcome's interval): a cut the connection does not
        notice (a proxy holding it open, a blackholed link)."""
        while True:
            interval = self._worker._ping_interval  # (a welcome may change it: looked at again soon)
            await asyncio.sleep(max(min(self._heard + 2.5 * interval - time.monotonic(), interval, 1.0), 0.01))
            if time.monotonic() - self._heard >= 2.5 * self._worker._ping_interval:
                return

    async def _stop_when_asked(self) -> None:
        await self._worker._stopping.wait()
        self._draining = True
        self._close_when_idle()

    def _close_when_idle(self) -> None:
        if self._draining and self.welcomed and not self._worker._runs:
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
            run = self._worker._runs.get(response.cancel.execution_id)
            if run is not None and run.stream is self and run.task is not None:
                run.ctx.cancelled.set()
                run.task.cancel()
        elif kind == "welcome":
            self._welcomed(response.welcome)
        elif kind == "drain":
            self._worker.draining.set()
            self._draining = True
            self._close_when_idle()
        elif kind == "rejected":
            rejected = response.rejected
            self._worker.stats.rejected += 1
            log.warning("the server refused a message: %s %s: %s", rejected.code, rejected.field, rejected.message)

    def _welcomed(self, welcome: workers_pb2.Welcome) -> None:
        worker = self._worker
        self.welcomed = True
        worker.draining.clear()
        worker.worker_id = welcome.worker_id
        worker.stats.connects += 1
        if welcome.HasField("ping_interval"):
            worker._ping_interval = max(welcome.ping_interval.ToTimedelta().total_seconds(), 0.1)
        resumed = set(welcome.resumed_execution_ids)
        dropped: list[_Run] = []
        for execution_id in self._offered:
            run = worker._runs.get(execution_id)
            if run is None:
                continue
            if execution_id not in resumed:
                dropped.append(run)  # its lease is gone: its outcome would be refused
                continue
            worker.stats.resumed += 1
            run.stream = self
            if run.outcome is not None:  # finished while disconnected: reported now
                del worker._runs[execution_id]
                self.report(run.outcome, grant=False)  # (its slot is in the grant below)
        for refusal in welcome.resume_refusals:
            log.warning("run %s not resumed: %s", refusal.execution_id, refusal.message)
        if dropped:
            worker.stats.not_resumed += len(dropped)
            for run in dropped:
                worker._runs.pop(run.ctx.execution_id, None)
                if run.task is not None:
                    run.task.cancel()
        worker.connected.set()
        self._grant(worker.slots - len(worker._runs))
        self._close_when_idle()  # stopped while disconnected: what was held is reported now

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
        run = _Run(ctx, stream=self)
        worker._runs[assignment.execution_id] = run
        run.task = asyncio.create_task(worker._execute(run, payload), name=f"run {assignment.execution_id}")

    def report(self, outcome: workers_pb2.Outcome, *, grant: bool = True) -> None:
        """Send an outcome (and a credit for the slot it frees)."""
        self._send(workers_pb2.ConnectRequest(outcome=outcome))
        if grant:
            self._grant(1)
        self._close_when_idle()


class _Unary(_Stream):
    """One unary session: the stream's requests and answers, carried by polls. A long poll waits
    for work; a second call reports what is ready (acks, outcomes, credit) at once, with no wait."""

    def __init__(self, worker: Worker, channel: grpc.aio.Channel) -> None:
        super().__init__(worker, channel)
        self._metadata = (("authorization", f"Bearer {worker._api_key}"),)
        self._session_id = ""
        self._closing = False  # the session is being closed: a poll's NOT_FOUND is expected
        self._poll = channel.unary_unary(
            _POLL,
            request_serializer=workers_pb2.PollWorkerSessionRequest.SerializeToString,
            response_deserializer=workers_pb2.PollWorkerSessionResponse.FromString,
        )

    async def serve(self) -> None:
        worker = self._worker
        open_session = self._channel.unary_unary(
            _OPEN,
            request_serializer=workers_pb2.OpenWorkerSessionRequest.SerializeToString,
            response_deserializer=workers_pb2.OpenWorkerSessionResponse.FromString,
        )
        hello = worker.hello()
        self._offered = [held.execution_id for held in hello.held_runs]
        opened = await open_session(
            workers_pb2.OpenWorkerSessionRequest(hello=hello), metadata=self._metadata, timeout=_CALL_MARGIN
        )
        self._session_id = opened.session_id
        most = opened.max_wait.ToTimedelta().total_seconds()
        wait = most if worker.poll_wait is None else max(_MIN_POLL_WAIT, min(worker.poll_wait, most))
        stopper = asyncio.create_task(self._stop_when_asked())
        poller = asyncio.create_task(self._long_polls(wait))
        reporter = asyncio.create_task(self._reports())
        try:
            self._on(workers_pb2.ConnectResponse(welcome=opened.welcome))
            done, _ = await asyncio.wait((poller, reporter), return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()  # the error of a failed poll, if any: reconnect (or fatal)
        finally:
            self.ended = True
            for task in (stopper, poller, reporter):
                task.cancel()
            worker.connected.clear()
            # Runs still going are kept: the next session resumes them (their outcomes wait).
            for run in self._mine():
                run.stream = None

    async def _call(self, batch: workers_pb2.RequestBatch | None, wait: float) -> None:
        request = workers_pb2.PollWorkerSessionRequest(session_id=self._session_id, batch=batch)
        if wait > 0:
            request.wait.CopyFrom(_duration(wait))
        answer = await self._poll(request, metadata=self._metadata, timeout=wait + _CALL_MARGIN)
        for response in answer.messages:
            self._on(response)

    async def _long_polls(self, wait: float) -> None:
        while True:
            try:
                await self._call(None, wait)
            except grpc.aio.AioRpcError:
                if not self._closing:
                    raise
                await asyncio.Event().wait()  # the close ends the session; `_reports` returns

    async def _reports(self) -> None:
        """What is ready in one poll each turn; at the end (drained, or stopping, and idle) the
        session is closed, its last outcomes reported first."""
        queue = self._requests
        while True:
            request = await queue.get()
            batch, end = workers_pb2.RequestBatch(), request is None
            if request is not None:
                _merge(batch, request)
            while not end and not queue.empty():
                more = queue.get_nowait()
                if more is None:
                    end = True
                else:
                    _merge(batch, more)
            if batch.acks or batch.outcomes or batch.credit:
                await self._call(batch, 0)
            if end:
                self._closing = True
                close = self._channel.unary_unary(
                    _CLOSE,
                    request_serializer=workers_pb2.CloseWorkerSessionRequest.SerializeToString,
                    response_deserializer=workers_pb2.CloseWorkerSessionResponse.FromString,
                )
                await close(
                    workers_pb2.CloseWorkerSessionRequest(session_id=self._session_id),
                    metadata=self._metadata,
                    timeout=_CALL_MARGIN,
                )
                return


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
