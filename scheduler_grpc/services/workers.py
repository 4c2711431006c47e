"""WorkerService: remote workers' streams. Translates messages and errors only; the session
(`scheduler_grpc.remote.Session`) is the protocol."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from datetime import timedelta
from typing import Any

from google.protobuf import duration_pb2
from scheduler_client.v1 import workers_pb2

from scheduler_grpc.application import Api
from scheduler_grpc.auth import parse_bearer
from scheduler_grpc.config import format_duration
from scheduler_grpc.errors import Aborted, FailedPrecondition, InvalidArgument
from scheduler_grpc.remote.protocol import (
    Assignment,
    CancelOrder,
    Drain,
    Failed,
    HandlerSpec,
    HeldRun,
    Hello,
    Outbound,
    OutcomeReport,
    Ping,
    Rejected,
    Succeeded,
    Throttled,
    Welcome,
)
from scheduler_grpc.remote.session import Session
from scheduler_grpc.services import convert
from scheduler_grpc.services.decode import Undecodable

MAX_RATE_LIMIT_WAIT = timedelta(hours=1)

log = logging.getLogger("scheduler_grpc.remote")


class WorkerService:
    def __init__(self, api: Api) -> None:
        self._api = api

    async def Connect(  # the generated service's method name
        self, requests: AsyncIterator[Any], context: Any
    ) -> AsyncIterator[workers_pb2.ConnectResponse]:
        remote = self._api.remote
        if remote is None:
            raise FailedPrecondition("this server does not serve remote workers")
        wait = remote.hello_timeout
        try:
            async with asyncio.timeout(wait.total_seconds()):
                first = await anext(requests)
        except StopAsyncIteration:
            return
        except TimeoutError:
            raise InvalidArgument(
                "hello", f"none within {format_duration(wait)}: the first message of a stream must be `hello`"
            ) from None
        if isinstance(first, Undecodable):
            raise InvalidArgument(first.field, first.message)
        if first.WhichOneof("message") != "hello":
            raise InvalidArgument("hello", "the first message of a stream must be `hello`")
        token = parse_bearer(context.invocation_metadata())  # the interceptor admitted it
        session = remote.open(hello_of(first.hello), context.peer())
        async with session.running():
            reader = asyncio.create_task(_read(requests, session), name=f"remote-reader {session.id}")
            guard = asyncio.create_task(
                remote.keep_authorized(session, lambda: self._api.auth.authenticate(token)),
                name=f"remote-auth {session.id}",
            )
            try:
                yield response(session.welcome())
                async for message in session.outbound():
                    yield response(message)
            finally:
                for task in (reader, guard):
                    task.cancel()
                    with contextlib.suppress(BaseException):
                        await task


async def _read(requests: AsyncIterator[Any], session: Session) -> None:
    """The worker's messages, to the session until the worker closes its side (which ends the
    session); a message that breaks the protocol ends the stream with its error (the worker's
    mistake: INVALID_ARGUMENT or FAILED_PRECONDITION naming the field). Anything else is the
    server's bug: logged once with its traceback, and only this stream ends, ABORTED (the SDKs
    reconnect)."""
    try:
        async for request in requests:
            _dispatch(request, session)
    except (InvalidArgument, FailedPrecondition) as exc:
        session.fail(exc)
        return
    except asyncio.CancelledError:
        raise
    except Exception:
        log.exception("remote worker's message could not be handled", extra={"worker_id": session.id})
        session.fail(Aborted("the server failed to handle a message of this stream (logged); reconnect"))
        return
    session.end()


def _dispatch(request: Any, session: Session) -> None:
    if isinstance(request, Undecodable):
        raise InvalidArgument(request.field, request.message)
    kind = request.WhichOneof("message")
    if kind == "credit":
        session.on_credit(request.credit.grant)
    elif kind == "ack":
        session.on_ack(request.ack.execution_id, request.ack.claim_token)
    elif kind == "outcome":
        session.on_outcome(outcome_of(request.outcome))
    elif kind == "pong":
        session.on_pong(request.pong.nonce)
    elif kind == "batch":
        batch = request.batch
        for ack in batch.acks:
            session.on_ack(ack.execution_id, ack.claim_token)
        for outcome in batch.outcomes:
            session.on_outcome(outcome_of(outcome))
        if batch.credit:
            session.on_credit(batch.credit)
    elif kind == "hello":
        raise InvalidArgument("hello", "sent twice: only the first message of a stream is `hello`")
    else:
        raise InvalidArgument("message", "empty: set one of hello, credit, ack, outcome, pong, batch")


# -- messages to domain values ------------------------------------------------------------------------


def hello_of(message: workers_pb2.Hello) -> Hello:
    return Hello(
        handlers=[HandlerSpec(h.name, h.description, h.payload_schema_json) for h in message.handlers],
        slots=message.slots,
        labels=dict(message.labels),
        sdk=message.sdk,
        sdk_version=message.sdk_version,
        queue=message.queue,
        held=[HeldRun(run.execution_id, run.claim_token) for run in message.held_runs],
    )


def _wait(message: duration_pb2.Duration, field: str) -> timedelta:
    wait = convert.from_duration(message, field)
    if not timedelta(0) <= wait <= MAX_RATE_LIMIT_WAIT:
        raise InvalidArgument(field, "must be between 0 and 1h")
    return wait


def outcome_of(message: workers_pb2.Outcome) -> OutcomeReport:
    kind = message.WhichOneof("result")
    result: Succeeded | Failed | Throttled
    if kind == "value":
        result = Succeeded(convert.value_to_json(message.value))
    elif kind == "error":
        error = message.error
        retry_after = _wait(error.retry_after, "outcome.error.retry_after") if error.HasField("retry_after") else None
        result = Failed(error.message or "failed (no message)", error.permanent, retry_after)
    elif kind == "rate_limited":
        limited = message.rate_limited
        result = Throttled(_wait(limited.retry_after, "outcome.rate_limited.retry_after"), limited.reason)
    else:
        result = Succeeded(None)  # no result set: succeeded without a value
    return OutcomeReport(message.execution_id, message.claim_token, result)


# -- domain values to messages ------------------------------------------------------------------------


def _assignment(message: Assignment) -> workers_pb2.Assignment:
    return workers_pb2.Assignment(
        run_id=message.run_id, execution_id=message.execution_id, job_id=message.job_id,
        job_name=message.job_name, attempt=message.attempt, claim_token=message.claim_token,
        handler=message.handler, payload=convert.dict_to_struct(message.payload),
        deadline=convert.timestamp(message.deadline), scheduled_for=convert.timestamp(message.scheduled_for),
    )  # fmt: skip


def response(message: Outbound | list[Assignment]) -> workers_pb2.ConnectResponse:
    if isinstance(message, list):
        return workers_pb2.ConnectResponse(
            assignments=workers_pb2.Assignments(assignments=[_assignment(each) for each in message])
        )
    if isinstance(message, Assignment):
        return workers_pb2.ConnectResponse(assignment=_assignment(message))
    if isinstance(message, CancelOrder):
        return workers_pb2.ConnectResponse(
            cancel=workers_pb2.Cancel(execution_id=message.execution_id, reason=message.reason)
        )
    if isinstance(message, Ping):
        return workers_pb2.ConnectResponse(ping=workers_pb2.Ping(nonce=message.nonce))
    if isinstance(message, Rejected):
        return workers_pb2.ConnectResponse(rejected=_rejected(message))
    if isinstance(message, Drain):
        return workers_pb2.ConnectResponse(drain=workers_pb2.Drain(deadline=convert.timestamp(message.deadline)))
    assert isinstance(message, Welcome)
    return workers_pb2.ConnectResponse(
        welcome=workers_pb2.Welcome(
            worker_id=message.worker_id, ack_timeout=convert.duration(message.ack_timeout),
            lease_timeout=convert.duration(message.lease_timeout), server_time=convert.timestamp(message.server_time),
            ping_interval=convert.duration(message.ping_interval),
            resumed_execution_ids=message.resumed, resume_refusals=[_rejected(each) for each in message.refused],
        )
    )  # fmt: skip


def _rejected(message: Rejected) -> workers_pb2.Rejected:
    return workers_pb2.Rejected(
        execution_id=message.execution_id, code=message.code, field=message.field, message=message.message
    )
