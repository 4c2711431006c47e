"""The server interceptor (`ApiInterceptor`): what every call goes through, in this order.

1. Observe: one structured log line per call (method, code, duration, principal, peer) and the
   metrics hooks, recorded before the call's status is sent; with tracing on (`tracing`), a
   server span per call (Health excepted), continuing the caller's `traceparent` if it sent one.
2. Errors: exceptions become status codes by the one mapping (`statuses.status_of`, shared with
   the console, applied in `status_for`); unexpected ones are logged
   with their traceback and answered INTERNAL with a generic message. Unary calls are bounded by a
   per-call deadline here, so no servicer await can hang a call for ever (a call past it ends
   DEADLINE_EXCEEDED: the server's bound ran out, not a store).
3. Limit: at most SCHEDULER_MAX_CONCURRENT_RPCS calls at once, beyond which a call is
   RESOURCE_EXHAUSTED (logged and counted, unlike grpc.aio's own limit).
4. Auth: authenticates the bearer token and checks the caller's role against `auth.METHOD_ROLES`
   (deny by default); servicers read the caller with `auth.current_principal()`.

grpc.aio interceptors can only choose a handler, not see its request; this one therefore returns
the handler with its behaviour wrapped. Behaviours come in two shapes: coroutine functions
(unary responses, and streams written with `context.write`, like Health/Watch) and async generator
functions (our streams, reflection); each is wrapped in its own shape, which grpc.aio requires.
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import logging
import math
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Final

import grpc

from scheduler_grpc import auth, statuses, tracing
from scheduler_grpc.auth import Authenticator, ResourceExhausted
from scheduler_grpc.logs import TRACE
from scheduler_grpc.metrics import Metrics

log = logging.getLogger("scheduler_grpc.rpc")

Context = grpc.aio.ServicerContext[Any, Any]
Invoke = Callable[[], Awaitable[Any]]
Iterate = Callable[[], AsyncIterator[Any]]

CALL_TIMEOUT_MESSAGE: Final = "the call ran past the server's own time limit for one call; retry later"
_QUIET_METHODS: Final = frozenset({"/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch"})
# Logged at DEBUG when OK (still measured and traced): a unary remote worker polls all the time.
_QUIET_LOGS: Final = _QUIET_METHODS | {"/scheduler.v1.WorkerService/PollWorkerSession"}
# The codes that make a server span an error (OpenTelemetry's semantic conventions for gRPC).
_SERVER_ERRORS: Final = frozenset(
    {"UNKNOWN", "DEADLINE_EXCEEDED", "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS"}
)
_EXEMPT_FROM_LIMIT: Final = frozenset({"/grpc.health.v1.Health/Check"})


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status code and message a call that raised `exc` ends with (`statuses.status_of`, the
    mapping the console shares)."""
    code, message = statuses.status_of(exc)
    return grpc.StatusCode[code.name], message


@dataclass(eq=False)
class CallInfo:
    """One call as the interceptors see it."""

    method: str
    context: Context
    response_streaming: bool
    principal: str = ""
    # Read when the call starts: asking a cancelled stream's context for its peer crashed the
    # process (SIGSEGV in grpc.aio), so nothing touches the context once the call is over.
    peer: str = ""
    # The caller's W3C `traceparent` trace id or `x-request-id`, else a fresh id; in every log line.
    trace: str = ""
    span: Any = None  # the call's span (tracing on; Health's calls have none)
    task: asyncio.Task[Any] | None = None  # a unary call's task while its deadline runs (`_Deadlines`)
    expired: bool = False  # the server's own bound ran out (`_Deadlines` cancelled the task)


class _Deadlines:
    """Ends unary calls that run past `seconds` (DEADLINE_EXCEEDED, see `ApiInterceptor`).

    `asyncio.timeout` per call costs a timer of its own (under uvloop a libuv handle made, started,
    stopped and closed: ~20 us of a ~500 us call). Here calls share timers: a call joins the bucket
    of its due time rounded up to `resolution`, and one timer per bucket cancels the calls still in
    it, so a call ends between `seconds` and `seconds + resolution` after it began.
    """

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.resolution = min(1.0, seconds / 10)
        self._buckets: dict[int, set[CallInfo]] = {}

    def start(self, call: CallInfo) -> set[CallInfo]:
        """Start `call`'s deadline (its task is the current one); returns its bucket, which the
        call leaves (`discard`) when it ends."""
        call.task = asyncio.current_task()
        loop = asyncio.get_running_loop()
        due = math.ceil((loop.time() + self.seconds) / self.resolution)
        bucket = self._buckets.get(due)
        if bucket is None:
            bucket = self._buckets[due] = set()
            loop.call_at(due * self.resolution, self._expire, due)
        bucket.add(call)
        return bucket

    def _expire(self, due: int) -> None:
        for call in self._buckets.pop(due, ()):
            if call.task is not None:
                call.expired = True
                call.task.cancel()


_CALL: contextvars.ContextVar[CallInfo | None] = contextvars.ContextVar("scheduler_call", default=None)


class _WrappingInterceptor(grpc.aio.ServerInterceptor):
    """Returns the continuation's handler with its behaviour wrapped by `around` / `around_stream`."""

    def __init__(self) -> None:
        # Full method name -> (the continuation's handler, its wrapping); bounded by the served
        # methods (an unknown one gets no handler).
        self._wrapped: dict[str, tuple[grpc.RpcMethodHandler[Any, Any], grpc.RpcMethodHandler[Any, Any]]] = {}

    async def around(self, call: CallInfo, invoke: Invoke) -> Any:
        """Run a coroutine behaviour (`invoke()`); return its result."""
        return await invoke()

    async def around_stream(self, call: CallInfo, iterate: Iterate) -> AsyncIterator[Any]:
        """Run an async generator behaviour (`iterate()`); yield its items."""
        async for item in iterate():
            yield item

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any] | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler = await continuation(handler_call_details)
        if handler is None:
            return None  # unknown method: grpc answers UNIMPLEMENTED
        # A service hands out one handler object per method, so its wrapping is built once, not
        # per call (and each interceptor below returns its own cached wrapping in turn).
        method = handler_call_details.method
        cached = self._wrapped.get(method)
        if cached is None or cached[0] is not handler:
            cached = (handler, self._wrap(handler, method))
            self._wrapped[method] = cached
        return cached[1]

    def _call(self, method: str, context: Context, streaming: bool) -> CallInfo:
        call = _CALL.get()
        if call is None or call.context is not context:
            call = CallInfo(method, context, streaming, peer=context.peer(), trace=_trace_id(context))
            _CALL.set(call)
            TRACE.set(call.trace)
        return call

    def _wrap(self, handler: grpc.RpcMethodHandler[Any, Any], method: str) -> grpc.RpcMethodHandler[Any, Any]:
        behaviour: Any
        kind: Callable[..., grpc.RpcMethodHandler[Any, Any]]
        if handler.unary_unary is not None:
            behaviour, kind = handler.unary_unary, grpc.unary_unary_rpc_method_handler
        elif handler.unary_stream is not None:
            behaviour, kind = handler.unary_stream, grpc.unary_stream_rpc_method_handler
        elif handler.stream_unary is not None:
            behaviour, kind = handler.stream_unary, grpc.stream_unary_rpc_method_handler
        else:
            behaviour, kind = handler.stream_stream, grpc.stream_stream_rpc_method_handler
        streaming = handler.response_streaming
        wrapped: Any
        if inspect.isasyncgenfunction(behaviour):

            async def wrapped_stream(request: Any, context: Context) -> AsyncIterator[Any]:
                call = self._call(method, context, streaming)
                async for item in self.around_stream(call, lambda: behaviour(request, context)):
                    yield item

            wrapped = wrapped_stream
        else:

            async def wrapped_unary(request: Any, context: Context) -> Any:
                call = self._call(method, context, streaming)
                return await self.around(call, lambda: behaviour(request, context))

            wrapped = wrapped_unary
        return kind(
            wrapped,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )


class ApiInterceptor(_WrappingInterceptor):
    """Every call's observation, error mapping, deadline, concurrency limit and authorisation, in
    ONE wrapper (the module docstring lists the stages in their order).

    One wrapper instead of four nested ones saves each call three coroutine frames, three lambdas
    and three context look-ups (measured: see the README's gRPC API section).

    Args:
        metrics: Where calls (and calls failed for want of Redis or PostgreSQL) are recorded.
        authenticator: Checks bearer tokens.
        call_timeout: Longest a unary call may take on the server (streams are not bounded).
        limit: Calls (streams included) that may run at once.
    """

    def __init__(self, metrics: Metrics, authenticator: Authenticator, *, call_timeout: timedelta, limit: int) -> None:
        super().__init__()
        self._metrics = metrics
        self._auth = authenticator
        self._deadlines = _Deadlines(call_timeout.total_seconds())
        self._limit = limit
        self.active = 0

    async def around(self, call: CallInfo, invoke: Invoke) -> Any:
        if tracing.enabled and call.method not in _QUIET_METHODS:
            span = _start_span(call)
            try:
                with tracing.current(span):
                    return await self._around(call, invoke)
            finally:
                span.end()
        return await self._around(call, invoke)

    async def _around(self, call: CallInfo, invoke: Invoke) -> Any:
        began = time.perf_counter()
        self._metrics.rpc_started(call.method)
        admitted = False
        principal_token: contextvars.Token[auth.Principal | None] | None = None
        bucket: set[CallInfo] | None = None
        try:
            admitted = self._admit(call)
            principal_token = auth.set_current_principal(await self._authorize(call))
            if call.response_streaming:  # e.g. Health/Watch: lives as long as the client wants
                result = await invoke()
            else:
                bucket = self._deadlines.start(call)
                cancelling = call.task.cancelling() if call.task is not None else 0
                try:
                    result = await invoke()
                except asyncio.CancelledError:
                    # Our deadline's cancel (and nobody else's): the call ran out of time.
                    if not call.expired or call.task is None or call.task.uncancel() > cancelling:
                        raise
                    raise _CallExpired() from None
                finally:
                    bucket.discard(call)
        except asyncio.CancelledError:
            self._finish(call, "CANCELLED", began)
            raise
        except grpc.aio.AbortError:  # the servicer aborted the call itself
            self._finish(call, _code_name(call.context, default="UNKNOWN"), began)
            raise
        except Exception as exc:
            if isinstance(exc, _CallExpired):
                # The server's own bound ran out, not a store's: saying UNAVAILABLE "a backing
                # server is unavailable" would send the operator after healthy stores.
                code, message = grpc.StatusCode.DEADLINE_EXCEEDED, CALL_TIMEOUT_MESSAGE
            else:
                code, message = self._status(call, exc)
            # Recorded before the status goes out: a client that got its answer finds it counted.
            self._finish(call, code.name, began)
            await call.context.abort(code, message)
        else:
            self._finish(call, _code_name(call.context, default="OK"), began)
            return result
        finally:
            if principal_token is not None:
                auth.reset_current_principal(principal_token)
            if admitted:
                self.active -= 1

    async def around_stream(self, call: CallInfo, iterate: Iterate) -> AsyncIterator[Any]:
        # A stream's span is not made current: its generator may be closed from another context,
        # where the context token is invalid (its log lines carry the span's trace id, `TRACE`).
        span = _start_span(call) if tracing.enabled and call.method not in _QUIET_METHODS else None
        try:
            async for item in self._around_stream(call, iterate):
                yield item
        finally:
            if span is not None:
                span.end()

    async def _around_stream(self, call: CallInfo, iterate: Iterate) -> AsyncIterator[Any]:
        began = time.perf_counter()
        self._metrics.rpc_started(call.method)
        admitted = False
        code: str | None = "UNKNOWN"
        try:
            admitted = self._admit(call)
            # Not reset afterwards: a stream's generator may be closed from another context, where
            # the reset token is invalid; the call's task (and so this context) ends with the call.
            auth.set_current_principal(await self._authorize(call))
            async for item in iterate():
                yield item
            code = _code_name(call.context, default="OK")
        except (asyncio.CancelledError, GeneratorExit):
            code = "CANCELLED"  # the client went away (or the server is stopping)
            raise
        except grpc.aio.AbortError:
            code = _code_name(call.context, default="UNKNOWN")
            raise
        except Exception as exc:
            status, message = self._status(call, exc)
            self._finish(call, status.name, began)
            code = None  # recorded
            await call.context.abort(status, message)
        finally:
            if code is not None:
                self._finish(call, code, began)
            if admitted:
                self.active -= 1

    def _admit(self, call: CallInfo) -> bool:
        """Count the call against the limit (Health `Check` is exempt: it touches no store, and a
        load balancer must get its answer under load).

        grpc.aio's own `maximum_concurrent_rpcs` refuses before any interceptor runs, so those
        refusals were neither logged nor counted; here each one is.

        Raises:
            ResourceExhausted: `limit` calls are running.
        """
        if call.method in _EXEMPT_FROM_LIMIT:
            return False
        if self.active >= self._limit:
            raise ResourceExhausted(
                f"the server is running its limit of {self._limit} calls at once (SCHEDULER_MAX_CONCURRENT_RPCS); "
                "retry with backoff"
            )
        self.active += 1
        return True

    async def _authorize(self, call: CallInfo) -> auth.Principal | None:
        needed = auth.required_role(call.method)  # PermissionDenied for a method missing from the table
        if needed is None:
            return None
        metadata = call.context.invocation_metadata() or ()
        token = auth.parse_bearer(metadata)
        principal = await self._auth.authenticate(token)
        call.principal = principal.name
        principal.require(needed, call.method)
        return principal

    def _status(self, call: CallInfo, exc: Exception) -> tuple[grpc.StatusCode, str]:
        code, message = status_for(exc)
        if code is grpc.StatusCode.UNAVAILABLE:
            self._metrics.store_error(exc)
        elif code is grpc.StatusCode.INTERNAL:
            log.error("unexpected error", exc_info=exc, extra={"method": call.method, "principal": call.principal})
        return code, message

    def _finish(self, call: CallInfo, code: str, began: float) -> None:
        seconds = time.perf_counter() - began
        self._metrics.rpc_finished(call.method, code, seconds)
        if call.span is not None:
            call.span.set_attribute("rpc.grpc.status_code", grpc.StatusCode[code].value[0] if code in _CODES else 2)
            if call.principal:
                call.span.set_attribute("enduser.id", call.principal)
            if code in _SERVER_ERRORS:
                tracing.span_error(call.span, code)
        level = logging.DEBUG if call.method in _QUIET_LOGS and code == "OK" else logging.INFO
        if code in {"INTERNAL", "UNKNOWN", "DATA_LOSS"}:
            level = logging.WARNING
        if log.isEnabledFor(level):
            log.log(
                level,
                "rpc",
                extra={
                    "method": call.method,
                    "code": code,
                    "duration_ms": round(seconds * 1000, 3),
                    "principal": call.principal or "-",
                    "peer": call.peer,
                },
            )


_CODES: Final = frozenset(code.name for code in grpc.StatusCode)


class _CallExpired(Exception):
    """A unary call ran past the server's own bound (`_Deadlines`)."""


def _start_span(call: CallInfo) -> Any:
    """The call's server span: a child of the caller's `traceparent` if it sent one; its trace id
    becomes the call's (`TRACE`, in every log line)."""
    carrier: dict[str, str] = {}
    for key, value in call.context.invocation_metadata() or ():
        if key in ("traceparent", "tracestate"):
            carrier[key] = value.decode(errors="replace") if isinstance(value, bytes) else str(value)
    name = call.method.lstrip("/")
    service, _, method = name.rpartition("/")
    span = tracing.start(
        name,
        parent=tracing.extract(carrier),
        kind="SERVER",
        attributes={
            "rpc.system": "grpc",
            "rpc.service": service,
            "rpc.method": method,
            "network.peer.address": call.peer,
        },
    )
    call.span = span
    call.trace = f"{span.get_span_context().trace_id:032x}"
    TRACE.set(call.trace)
    return span


def _trace_id(context: Context) -> str:
    for key, value in context.invocation_metadata() or ():
        text = value.decode(errors="replace") if isinstance(value, bytes) else str(value)
        if key == "traceparent":  # version-traceid-spanid-flags
            parts = text.split("-")
            if len(parts) == 4 and len(parts[1]) == 32:
                return parts[1]
        elif key == "x-request-id" and 0 < len(text) <= 128:
            return text
    return os.urandom(16).hex()  # a uuid4's randomness, without making a UUID (~3 us a call)


def _code_name(context: Context, default: str) -> str:
    code = context.code()
    if code is None:  # grpc.aio returns None until a code was set or the call aborted
        return default
    return code.name if isinstance(code, grpc.StatusCode) else str(code)
