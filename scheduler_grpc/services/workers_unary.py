"""WorkerService's unary fallback (`OpenWorkerSession`, `PollWorkerSession`, `CloseWorkerSession`):
messages and errors only; the session (`scheduler_grpc.remote.unary`) is the protocol, the stream's
own `Session`. `UnaryWorkerService` is the whole servicer: the stream's (`workers.WorkerService`)
and these."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any, Final

from scheduler_client.v1 import workers_pb2

from scheduler_grpc.auth import current_principal
from scheduler_grpc.config import format_duration
from scheduler_grpc.errors import FailedPrecondition, InvalidArgument
from scheduler_grpc.remote import RemoteWorkers
from scheduler_grpc.remote.protocol import Outbound
from scheduler_grpc.remote.session import Session
from scheduler_grpc.services import convert
from scheduler_grpc.services.workers import WorkerService, hello_of, outcome_of, response

# An answer stays well under the 4 MiB a gRPC client takes by default (one message always goes).
MAX_POLL_BYTES: Final = 3 * 1024 * 1024


class UnaryWorkerService(WorkerService):
    """`WorkerService`: the stream (`Connect`) and its unary fallback."""

    def _remote(self) -> RemoteWorkers:
        remote = self._api.remote
        if remote is None:
            raise FailedPrecondition("this server does not serve remote workers")
        return remote

    async def OpenWorkerSession(  # the generated service's method name
        self, request: workers_pb2.OpenWorkerSessionRequest, context: Any
    ) -> workers_pb2.OpenWorkerSessionResponse:
        remote = self._remote()
        if not request.HasField("hello"):
            raise InvalidArgument("hello", "required: the handlers this worker serves, its slots, ...")
        held = remote.unary.open(hello_of(request.hello), context.peer(), current_principal().subject_id)
        await asyncio.shield(held.ready)  # its held runs resumed: the welcome says which
        welcome = response(held.session.welcome()).welcome
        welcome.ClearField("ping_interval")  # no pings: the polls are the liveness
        return workers_pb2.OpenWorkerSessionResponse(
            session_id=held.id,
            welcome=welcome,
            poll_timeout=convert.duration(remote.unary.poll_timeout),
            max_wait=convert.duration(remote.unary.max_wait),
        )

    async def PollWorkerSession(  # the generated service's method name
        self, request: workers_pb2.PollWorkerSessionRequest, context: Any
    ) -> workers_pb2.PollWorkerSessionResponse:
        unary = self._remote().unary
        wait = convert.from_duration(request.wait, "wait") if request.HasField("wait") else timedelta(0)
        if not timedelta(0) <= wait <= unary.max_wait:
            raise InvalidArgument("wait", f"must be between 0 and {format_duration(unary.max_wait)}")
        held = unary.get(request.session_id, current_principal().subject_id)
        batch = request.batch
        answer = workers_pb2.PollWorkerSessionResponse()
        size = 0

        def take(message: Outbound) -> bool:
            nonlocal size
            encoded = response(message)
            grows = encoded.ByteSize() + 8
            if size and size + grows > MAX_POLL_BYTES:
                return False
            size += grows
            answer.messages.append(encoded)
            return True

        await held.poll(lambda session: _apply(batch, session), wait, take)
        return answer

    async def CloseWorkerSession(  # the generated service's method name
        self, request: workers_pb2.CloseWorkerSessionRequest, context: Any
    ) -> workers_pb2.CloseWorkerSessionResponse:
        await self._remote().unary.close(request.session_id, current_principal().subject_id)
        return workers_pb2.CloseWorkerSessionResponse()


def _apply(batch: workers_pb2.RequestBatch, session: Session) -> None:
    """A poll's batch, as a stream's `RequestBatch` (acks, then outcomes, then credit); an error
    names the poll request's field (`batch.outcomes[2].error.retry_after`, `batch.credit`)."""
    for ack in batch.acks:
        session.on_ack(ack.execution_id, ack.claim_token)
    for index, outcome in enumerate(batch.outcomes):
        try:
            report = outcome_of(outcome)
        except InvalidArgument as exc:
            raise InvalidArgument(exc.field.replace("outcome.", f"batch.outcomes[{index}].", 1), exc.message) from None
        session.on_outcome(report)
    if batch.credit:
        try:
            session.on_credit(batch.credit)
        except InvalidArgument as exc:
            raise InvalidArgument("batch.credit", exc.message) from None
