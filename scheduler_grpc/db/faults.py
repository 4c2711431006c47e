"""What a PostgreSQL error means: the one place SQLSTATEs and asyncpg's error classes are read.

`scheduler_grpc.stores` asks this module about PostgreSQL errors; nothing outside `db/` looks at a
SQLSTATE or an asyncpg class.
"""

from __future__ import annotations

from typing import Final

import asyncpg

# SQLSTATE classes of a wrong request: syntax error or undefined object (42), data exception (22),
# integrity violation (23). Everything else from PostgreSQL (connection failures, shutdown, too many
# connections, read-only transaction after failover, serialization failures, ...) is the store failing.
_REQUEST_ERROR_CLASSES: Final = frozenset({"42", "22", "23"})
# SQLSTATE classes of a PostgreSQL that is unreachable, restarting or out of connections.
_UNAVAILABLE_CLASSES: Final = frozenset({"08", "53", "57"})


def _sqlstate(exc: BaseException) -> str | None:
    state = getattr(exc, "sqlstate", None)
    return state if isinstance(state, str) else None


def is_request_error(exc: BaseException) -> bool:
    """Whether PostgreSQL refused `exc`'s request as wrong (a bug of ours), not as unable to serve."""
    state = _sqlstate(exc)
    return state is not None and state[:2] in _REQUEST_ERROR_CLASSES


def is_unreachable(exc: BaseException) -> bool:
    """Whether `exc` means PostgreSQL could not be reached, is restarting or has no connection to give."""
    state = _sqlstate(exc)
    if state is not None and state[:2] in _UNAVAILABLE_CLASSES:
        return True
    # asyncpg's own error for a connection that broke or closed under a call (no SQLSTATE).
    return isinstance(exc, asyncpg.InterfaceError)
