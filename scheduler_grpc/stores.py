"""Which errors are a store failing: the one classification of Redis and PostgreSQL faults.

Every role asks the same questions of an exception and asks them here: which store raised it
(`store_of`, for `scheduler_store_errors_total`), whether the store could not be reached
(`is_unreachable`: the queue then raises `Unavailable`), whether it is a store failing that a loop
rides out rather than a bug that ends the role (`is_fault`), and whether a request that raised it
ends UNAVAILABLE (`is_unavailable`, for `statuses`). Redis's exception classes are recognised here
(and the ones the client retries on, `REDIS_RETRYABLE`); PostgreSQL's SQLSTATEs and asyncpg's
classes in `db.faults`, which this module asks. No other module classifies store errors.
"""

from __future__ import annotations

from typing import Final

from redis.exceptions import (
    AskError,
    ClusterDownError,
    ClusterError,
    InvalidResponse,
    MasterDownError,
    NoScriptError,
    OutOfMemoryError,
    ReadOnlyError,
    RedisError,
    ResponseError,
    SlotNotCoveredError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from scheduler_grpc.db import faults as postgres
from scheduler_grpc.errors import Unavailable

# Redis answers meaning "cannot serve now" (full, a replica after failover, busy running a script,
# loading, ...), not "this request is wrong": a loop rides them out.
_REDIS_CANNOT_SERVE: Final = (
    OutOfMemoryError, ReadOnlyError, NoScriptError, TryAgainError, ClusterDownError, MasterDownError,
)  # fmt: skip
_REDIS_CANNOT_SERVE_PREFIXES: Final = ("BUSY", "LOADING", "MISCONF", "NOREPLICAS", "UNBLOCKED", "READONLY", "OOM")
# A Valkey Cluster in motion, as redis-py's cluster client gives up on it: its redirections and
# TRYAGAIN answers outlasted the command's retries (`ClusterError`, "TTL exhausted": a slot being
# migrated, whose multi-key scripts get TRYAGAIN until it has moved), a redirection it does not
# follow (`AskError` and its `MovedError`, in a MULTI/EXEC pipeline, which EXECABORT then runs none
# of), or no node of its slot map serves the slot (`SlotNotCoveredError`, during a failover). The
# command did not run.
_REDIS_CLUSTER_UNSETTLED: Final = (ClusterError, AskError, SlotNotCoveredError)
# redis-py's errors of the connection itself: lost, refused, reset, timed out (BusyLoadingError and
# AuthenticationError are ConnectionErrors too), or a reply cut off mid-stream.
_REDIS_CONNECTION: Final = (RedisConnectionError, RedisTimeoutError, InvalidResponse)
REDIS_RETRYABLE: Final = (RedisConnectionError, RedisTimeoutError)
"""The errors of a Redis connection itself, on which the client retries a command on a new
connection (`connections.redis_client`)."""
_STORE_LIBRARIES: Final = (("redis", "redis"), ("asyncpg", "postgres"))


def store_of(exc: BaseException) -> str | None:
    """Which store `exc` came from: "redis", "postgres", or None for an error of neither.

    The raising library tells them apart. A builtin error (a refused connection, or the
    TimeoutError of an `asyncio.timeout` around a call) names no library, so the innermost library
    frame of its traceback does, and then the errors it was raised from or while handling. So does
    a RuntimeError of the event loop's transport ("the handler is closed") raised inside redis-py
    when a connection is torn down mid-call.
    """
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        module = type(current).__module__
        for prefix, store in _STORE_LIBRARIES:
            if module.startswith(prefix):
                return store
        innermost: str | None = None
        frame = current.__traceback__
        while frame is not None:
            name = str(frame.tb_frame.f_globals.get("__name__", ""))
            innermost = next((store for prefix, store in _STORE_LIBRARIES if name.startswith(prefix)), innermost)
            frame = frame.tb_next
        if innermost is not None:
            return innermost
        current = current.__cause__ or current.__context__
    return None


def is_fault(exc: BaseException) -> bool:
    """Whether `exc` is a store failing (unreachable, timing out, or answering that it cannot serve
    now), which a loop rides out, rather than a bug of ours, which ends the role after logging.

    Faults: a lost, refused or reset connection and a timeout (redis-py's, asyncpg's, the socket's
    or our own `asyncio.timeout`), `Unavailable`, Redis's "cannot serve now" answers, a Valkey
    Cluster's slot in motion (a migration's TRYAGAIN outlasting the client's retries, an ASK or
    MOVED a transaction does not follow, a slot no node serves during a failover), and what
    `db.faults.is_fault` counts for PostgreSQL. Not faults: any other error of either client, such
    as redis-py's DataError (a bad argument), a Redis answer that the request is wrong, PostgreSQL
    refusing a request, asyncpg refusing a misuse ("another operation is in progress").
    """
    if is_unreachable(exc) or isinstance(exc, _REDIS_CLUSTER_UNSETTLED):
        return True
    if isinstance(exc, ResponseError):
        return isinstance(exc, _REDIS_CANNOT_SERVE) or str(exc).startswith(_REDIS_CANNOT_SERVE_PREFIXES)
    if isinstance(exc, RedisError):
        return False
    if postgres.is_fault(exc):
        return True
    if isinstance(exc, OSError | RuntimeError):
        # A socket error under a client (a failed lookup, no route to the host), or the event loop's
        # transport refusing a call on a connection torn down mid-call ("the handler is closed"):
        # only when raised inside a store's client, whose frames tell (`store_of`).
        return (isinstance(exc, OSError) or "closed" in str(exc)) and store_of(exc) is not None
    return False


def is_unreachable(exc: BaseException) -> bool:
    """Whether `exc` means a store could not be reached or did not answer in time: a lost, refused
    or reset connection, a timeout (redis-py's, asyncpg's, the socket's or our own `asyncio.timeout`),
    PostgreSQL restarting or out of connections, or `Unavailable` (which a call raises for these)."""
    if isinstance(exc, (Unavailable, TimeoutError, ConnectionError, *_REDIS_CONNECTION)):
        return True  # (TimeoutError and ConnectionError: the builtins, e.g. ConnectionResetError)
    return postgres.is_unreachable(exc)


def is_request_error(exc: BaseException) -> bool:
    """Whether a store refused `exc`'s request as wrong: PostgreSQL's data, integrity or syntax
    errors (perhaps one request's data in a batch, not an outage)."""
    return postgres.is_request_error(exc)


def is_unavailable(exc: BaseException) -> bool:
    """Whether a request that raised `exc` failed for want of a store (the API answers UNAVAILABLE,
    the console 503; `statuses.status_of`): a store fault (`is_fault`: unreachable, timing out, or
    answering that it cannot serve now, such as a Redis replica's READONLY), or a socket error.
    Other store errors are bugs (INTERNAL)."""
    return is_fault(exc) or isinstance(exc, OSError)
