"""The handlers of a remote worker's session: each advertised handler is a `RemoteHandler` in the
session's `HandlerRegistry`, so the in-process run lifecycle (`scheduler_grpc.worker`) runs remote
work exactly as it runs built-in handlers: `run` hands the assignment to the session and returns
(or raises) what the remote worker reported."""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING, Any, ClassVar, Final

from scheduler_grpc.handlers import ExecutionContext, Handler, HandlerRegistry, HandlerSettings, JSONValue
from scheduler_grpc.remote.protocol import HandlerSpec
from scheduler_grpc.worker import HandBack

if TYPE_CHECKING:
    from scheduler_grpc.remote.session import Session

NOT_SERVED_WAIT: Final = timedelta(seconds=1)


class NotAcknowledged(HandBack):
    """The remote worker did not acknowledge an assignment within the ack timeout (or its stream
    ended first): the run goes back to the queue as the same attempt, unspent (`HandBack`:
    `unclaim`, then `nack` without counting the delivery; no limit key paused), due again at once."""

    def __init__(self, reason: str = "not acknowledged by the remote worker") -> None:
        super().__init__(reason)


class RemoteHandler(Handler):
    """One handler a remote worker serves; `run` is the session's round trip.

    Payloads are not validated here: the remote worker validates its own (its schema is only
    described, `HandlerSpec.payload_schema_json`)."""

    name: ClassVar[str] = "remote.handler"
    description: ClassVar[str] = "a handler served by a remote worker"
    extra_fields: ClassVar[bool] = True

    def __init__(self, session: Session) -> None:
        self._session = session

    async def run(self, ctx: ExecutionContext, payload: dict[str, Any]) -> JSONValue:
        result: JSONValue = await self._session.execute(self.name, ctx, payload)
        return result


class NotServedHere(Handler):
    """A run of a handler the remote worker does not serve (it shares a queue with other workers):
    handed back unspent (`HandBack`: no attempt, no delivery counted, no limit key paused), to wait
    a moment for a worker that serves it."""

    name: ClassVar[str] = "remote.not_served"
    description: ClassVar[str] = "a handler this remote worker does not serve"

    async def run(self, ctx: ExecutionContext, payload: dict[str, Any]) -> JSONValue:
        raise HandBack("handler not served by this remote worker", NOT_SERVED_WAIT)


class SessionRegistry(HandlerRegistry):
    """The registry of one session: a `RemoteHandler` per advertised handler; any other name is
    `NotServedHere` (never "unknown handler", which would dead-letter another worker's run)."""

    def __init__(self, session: Session, specs: list[HandlerSpec]) -> None:
        super().__init__(HandlerSettings())
        self._not_served = NotServedHere()
        for spec in specs:
            cls = type(
                "RemoteHandler_" + spec.name.replace(".", "_"),
                (RemoteHandler,),
                {"name": spec.name, "description": spec.description or f"remote handler {spec.name}"},
            )
            self.register(cls(session))

    def get(self, name: str) -> Handler:
        try:
            return super().get(name)
        except Exception:
            return self._not_served
