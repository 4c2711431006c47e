"""Errors of the client: one class per gRPC status code a caller may want to catch.

Every error raised by `SchedulerClient` is a `SchedulerClientError` carrying the gRPC status code
(`.code`, a `grpc.StatusCode`) and the server's message (`.message`), so a caller can write
`except NotFound:` or `except SchedulerClientError as e: if e.code is grpc.StatusCode.ABORTED`.
"""

from __future__ import annotations

import grpc


class SchedulerClientError(Exception):
    """A failed call: the gRPC status `code` and the server's `message`."""

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN

    def __init__(self, message: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code

    @property
    def code_name(self) -> str:
        """The code's name, e.g. `NOT_FOUND`."""
        return str(self.code.name)

    def __str__(self) -> str:
        return self.message

    def __repr__(self) -> str:
        return f"{type(self).__name__}(code={self.code_name}, message={self.message!r})"


class InvalidArgument(SchedulerClientError):
    """INVALID_ARGUMENT: a field is missing or malformed (the message names it)."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(SchedulerClientError):
    """NOT_FOUND: no such job, execution, key or dead letter."""

    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(SchedulerClientError):
    """ALREADY_EXISTS: e.g. a job name that is taken."""

    code = grpc.StatusCode.ALREADY_EXISTS


class FailedPrecondition(SchedulerClientError):
    """FAILED_PRECONDITION: the request is valid but the state does not allow it."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class Aborted(SchedulerClientError):
    """ABORTED: a concurrent change (stale etag); read again and retry."""

    code = grpc.StatusCode.ABORTED


class PermissionDenied(SchedulerClientError):
    """PERMISSION_DENIED: the caller's role does not allow this."""

    code = grpc.StatusCode.PERMISSION_DENIED


class Unauthenticated(SchedulerClientError):
    """UNAUTHENTICATED: no, an expired or a revoked token; or a failed login."""

    code = grpc.StatusCode.UNAUTHENTICATED


class ResourceExhausted(SchedulerClientError):
    """RESOURCE_EXHAUSTED: rate-limited, or a watcher too slow to keep up."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(SchedulerClientError):
    """UNAVAILABLE: the server cannot be reached (or is shutting down)."""

    code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceeded(SchedulerClientError):
    """DEADLINE_EXCEEDED: the call did not finish within its deadline."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Cancelled(SchedulerClientError):
    """CANCELLED: the call was cancelled."""

    code = grpc.StatusCode.CANCELLED


class Unimplemented(SchedulerClientError):
    """UNIMPLEMENTED: the server does not offer this method (an older server?)."""

    code = grpc.StatusCode.UNIMPLEMENTED


class InternalError(SchedulerClientError):
    """INTERNAL, UNKNOWN, DATA_LOSS or any other code: a server-side fault."""

    code = grpc.StatusCode.INTERNAL


_BY_CODE: dict[grpc.StatusCode, type[SchedulerClientError]] = {
    cls.code: cls
    for cls in (
        InvalidArgument,
        NotFound,
        AlreadyExists,
        FailedPrecondition,
        Aborted,
        PermissionDenied,
        Unauthenticated,
        ResourceExhausted,
        Unavailable,
        DeadlineExceeded,
        Cancelled,
        Unimplemented,
    )
}
# OUT_OF_RANGE is an invalid argument that depends on state (e.g. a page token past the end).
_BY_CODE[grpc.StatusCode.OUT_OF_RANGE] = InvalidArgument


def error_for(code: grpc.StatusCode, message: str | None) -> SchedulerClientError:
    """The exception for a status code and message (the code is kept even when mapped to a base class)."""
    cls = _BY_CODE.get(code, InternalError)
    text = " ".join((message or "").split()) or f"call failed with status {code.name}"
    return cls(text, code)


def from_rpc_error(error: grpc.RpcError) -> SchedulerClientError:
    """Translate a grpc(.aio) error into the client's hierarchy."""
    code_fn = getattr(error, "code", None)
    details_fn = getattr(error, "details", None)
    code = code_fn() if callable(code_fn) else grpc.StatusCode.UNKNOWN
    details = details_fn() if callable(details_fn) else str(error)
    if not isinstance(code, grpc.StatusCode):
        code = grpc.StatusCode.UNKNOWN
    return error_for(code, details if isinstance(details, str) else None)
