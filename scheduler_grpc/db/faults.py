"""What a PostgreSQL error means: the one place SQLSTATEs and asyncpg's error classes are read.

`scheduler_grpc.stores` asks this module about PostgreSQL errors; nothing outside `db/` looks at a
SQLSTATE or an asyncpg class.
"""

from __future__ import annotations

from typing import Final

import asyncpg
from asyncpg.exceptions import InvalidCachedStatementError, OutdatedSchemaCacheError

# SQLSTATE classes of a wrong request: syntax error or undefined object (42), data exception (22),
# integrity violation (23).
_REQUEST_ERROR_CLASSES: Final = frozenset({"42", "22", "23"})
# SQLSTATE classes of a PostgreSQL that is unreachable, restarting or out of connections: connection
# exception (08), insufficient resources (53: too many connections, disk or memory full), operator
# intervention (57: admin or crash shutdown, cannot connect now, a cancelled statement).
_UNAVAILABLE_CLASSES: Final = frozenset({"08", "53", "57"})
# ... and the other answers of a store failing for now, which a retry outlives: system error (58:
# I/O), transaction rollback (40: serialization failure, deadlock).
_FAULT_CLASSES: Final = _UNAVAILABLE_CLASSES | {"58", "40"}
# A read-only transaction (a primary demoted after a failover), a lock not available (lock_timeout).
_FAULT_STATES: Final = frozenset({"25006", "55P03"})
# asyncpg's errors without a SQLSTATE for a connection that broke or closed under a call, or a pool
# closing (a reconnect); its other InterfaceErrors are misuse ("another operation is in progress",
# "released back to the pool", a bad argument).
_CLOSED_TEXTS: Final = ("connection is closed", "connection was closed", "pool is closing", "operation is cancelling")


def _sqlstate(exc: BaseException) -> str | None:
    state = getattr(exc, "sqlstate", None)
    return state if isinstance(state, str) else None


def _connection_closed(exc: BaseException) -> bool:
    return isinstance(exc, asyncpg.InterfaceError) and any(text in str(exc) for text in _CLOSED_TEXTS)


def is_request_error(exc: BaseException) -> bool:
    """Whether PostgreSQL refused `exc`'s request as wrong (a bug of ours), not as unable to serve."""
    state = _sqlstate(exc)
    return state is not None and state[:2] in _REQUEST_ERROR_CLASSES


def is_unreachable(exc: BaseException) -> bool:
    """Whether `exc` means PostgreSQL could not be reached, is restarting or has no connection to give."""
    state = _sqlstate(exc)
    if state is not None:
        return state[:2] in _UNAVAILABLE_CLASSES
    return _connection_closed(exc)


def is_fault(exc: BaseException) -> bool:
    """Whether `exc` is PostgreSQL (or the connection to it) failing for now, which a retry outlives:
    `is_unreachable`, or a rollback, an I/O error, a read-only transaction, a lock timeout, or a
    schema changed under cached statements (asyncpg drops them; the next call prepares afresh).
    Not a fault: a wrong request, and asyncpg refusing a misuse (bugs of ours)."""
    if isinstance(exc, InvalidCachedStatementError | OutdatedSchemaCacheError):
        return True
    if isinstance(exc, asyncpg.exceptions._base.InternalClientError):
        # asyncpg's protocol state broke with its connection: seen as "cannot switch to state 12;
        # another operation (2) is in progress" from a pool's `fetch` while PostgreSQL shut down fast
        # (make chaos, pg-down-twice). Every call takes its own pooled connection, so it is not a
        # connection shared by two of our tasks (that misuse is an InterfaceError, still a bug).
        return True
    state = _sqlstate(exc)
    if state is not None:
        return state[:2] in _FAULT_CLASSES or state in _FAULT_STATES
    return _connection_closed(exc)
