"""Which status a failed request ends with: the one mapping of errors, for the gRPC API and the console.

`status_of` names the outcome of an exception as a gRPC status code name (`Code`) with the message
to send; the gRPC interceptor (`interceptors.status_for`) turns it into a `grpc.StatusCode`, the web
console into the HTTP status of `HTTP_STATUS`. So the same failure of the same `Control` call is the
same answer whichever door it came through: a store that cannot serve now is UNAVAILABLE (HTTP 503)
on both, a write under a stale leader term ABORTED (409), and anything unexpected INTERNAL (500,
logged with its traceback, its text never sent).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Final

from scheduler_grpc import stores
from scheduler_grpc.auth import PermissionDenied, ResourceExhausted, Unauthenticated
from scheduler_grpc.errors import (
    Aborted,
    AlreadyExists,
    FailedPrecondition,
    Fenced,
    InvalidArgument,
    LeaseLost,
    NotFound,
)
from scheduler_grpc.events import FanoutClosed, SubscriberTooSlow


class Code(enum.Enum):
    """The outcomes a request can end with, named as gRPC's status codes."""

    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    NOT_FOUND = "NOT_FOUND"
    ALREADY_EXISTS = "ALREADY_EXISTS"
    FAILED_PRECONDITION = "FAILED_PRECONDITION"
    ABORTED = "ABORTED"
    UNAUTHENTICATED = "UNAUTHENTICATED"
    PERMISSION_DENIED = "PERMISSION_DENIED"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
    UNAVAILABLE = "UNAVAILABLE"
    INTERNAL = "INTERNAL"


UNAVAILABLE_MESSAGE: Final = "a backing server (Redis or PostgreSQL) is unavailable right now; retry"
INTERNAL_MESSAGE: Final = "internal error; the server logged the details"

# Errors -> outcomes. The first matching class wins (subclasses before their bases).
_CODES: Final[tuple[tuple[type[BaseException], Code], ...]] = (
    (InvalidArgument, Code.INVALID_ARGUMENT),
    (NotFound, Code.NOT_FOUND),
    (AlreadyExists, Code.ALREADY_EXISTS),
    (FailedPrecondition, Code.FAILED_PRECONDITION),
    (Aborted, Code.ABORTED),
    (Fenced, Code.ABORTED),
    (LeaseLost, Code.ABORTED),
    (Unauthenticated, Code.UNAUTHENTICATED),
    (PermissionDenied, Code.PERMISSION_DENIED),
    (ResourceExhausted, Code.RESOURCE_EXHAUSTED),
    (SubscriberTooSlow, Code.RESOURCE_EXHAUSTED),
    (FanoutClosed, Code.UNAVAILABLE),
)
# Messages of these are safe and useful to send as they are (they name a field or a cursor).
_SEND_MESSAGE: Final = frozenset(
    {
        Code.INVALID_ARGUMENT,
        Code.NOT_FOUND,
        Code.ALREADY_EXISTS,
        Code.FAILED_PRECONDITION,
        Code.ABORTED,
        Code.UNAUTHENTICATED,
        Code.PERMISSION_DENIED,
        Code.RESOURCE_EXHAUSTED,
    }
)

HTTP_STATUS: Final[Mapping[Code, int]] = {
    Code.INVALID_ARGUMENT: 400,
    Code.NOT_FOUND: 404,
    Code.ALREADY_EXISTS: 409,
    Code.FAILED_PRECONDITION: 409,
    Code.ABORTED: 409,
    Code.UNAUTHENTICATED: 401,
    Code.PERMISSION_DENIED: 403,
    Code.RESOURCE_EXHAUSTED: 429,
    Code.UNAVAILABLE: 503,
    Code.INTERNAL: 500,
}
"""The HTTP status of each outcome (the console's pages and JSON answers)."""


def status_of(exc: BaseException) -> tuple[Code, str]:
    """The outcome of a request that raised `exc`, and the message to send with it.

    Domain errors by class; then a store that could not serve (`stores.is_unavailable`: Redis or
    PostgreSQL unreachable, timing out, or answering that it cannot serve now) is UNAVAILABLE; any
    other exception is INTERNAL, with a generic message (the caller logs the details).
    """
    for kind, code in _CODES:
        if isinstance(exc, kind):
            return code, str(exc) if code in _SEND_MESSAGE else str(exc) or UNAVAILABLE_MESSAGE
    if stores.is_unavailable(exc):
        return Code.UNAVAILABLE, UNAVAILABLE_MESSAGE
    return Code.INTERNAL, INTERNAL_MESSAGE
