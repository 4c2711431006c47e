"""Leader terms in PostgreSQL: where fencing tokens come from and where they are enforced.

A term is a value of the `leader_term_seq` sequence, recorded as the current one in `leader_state`.
Both live in PostgreSQL, not Redis, so tokens keep increasing when Redis restarts empty or is
flushed. The record only ever moves up: a candidate whose term is older than the recorded one
(it stalled between taking the term and recording it while a newer leader got in) is refused.

Every PostgreSQL write a leader makes checks its term inside its own transaction, so a deposed
leader (paused, partitioned, or simply slow to notice) cannot change anything there: `fire` checks
it in its one statement, every other leader write runs inside `RecoveryRepository.fenced`, which
calls `assert_current_term` first. The leader's Redis moves are not fenced; `scheduler_grpc.scheduler`
says why each is safe (idempotent, convergent moves).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TypeAlias

import asyncpg
from asyncpg.pool import PoolConnectionProxy

from scheduler_grpc import stores
from scheduler_grpc.errors import Fenced, Unavailable

Connection: TypeAlias = asyncpg.Connection | PoolConnectionProxy
"""A plain connection or one lent by a pool: `assert_current_term` accepts either."""

_DEFAULT_TIMEOUT = timedelta(seconds=5)

# nextval() and the upsert in one statement: one round trip. The WHERE makes the upsert a no-op
# (no row returned) unless the new term is higher than the recorded one, so the record never goes
# back. The upsert locks the row, so it waits for leaders' open transactions that hold it FOR SHARE
# (see assert_current_term): a write under the old term commits before the new term exists, or fails.
_BEGIN_TERM = """
INSERT INTO leader_state AS current (scope, term, holder, acquired_at)
VALUES ($1, nextval('leader_term_seq'), $2, now())
ON CONFLICT (scope) DO UPDATE
    SET term = EXCLUDED.term, holder = EXCLUDED.holder, acquired_at = EXCLUDED.acquired_at
    WHERE current.term < EXCLUDED.term
RETURNING scope, term, holder, acquired_at
"""

_CURRENT = "SELECT scope, term, holder, acquired_at FROM leader_state WHERE scope = $1"

# FOR SHARE: a concurrent begin_term (which must lock the row to raise the term) waits until the
# caller's transaction ends, so the check stays true until the caller commits.
_CHECK_TERM = "SELECT term FROM leader_state WHERE scope = $1 FOR SHARE"


@dataclass(frozen=True)
class TermRecord:
    """A row of `leader_state`: the current term of one election scope.

    Attributes:
        scope: The election scope (one per deployment).
        term: The fencing token; strictly increasing across terms of all scopes.
        holder: Who took the term (the elector's holder name).
        acquired_at: When the term was taken (PostgreSQL clock, UTC).
    """

    scope: str
    term: int
    holder: str
    acquired_at: datetime


def _record(row: asyncpg.Record) -> TermRecord:
    return TermRecord(scope=row["scope"], term=row["term"], holder=row["holder"], acquired_at=row["acquired_at"])


class LeadershipRepository:
    """Takes and reads leader terms.

    Args:
        pool: The process's asyncpg pool.
        timeout: Default bound on each call, including the wait for a pooled connection
            (default 5 s).
    """

    def __init__(self, pool: asyncpg.Pool, *, timeout: timedelta = _DEFAULT_TIMEOUT) -> None:
        self._pool = pool
        self._timeout = timeout.total_seconds()

    async def begin_term(self, scope: str, holder: str) -> TermRecord | None:
        """Take the next term from `leader_term_seq` and record it as the current term of `scope`.

        Call only while holding the Redis leader lock: the lock keeps standbys from burning terms,
        this record is what makes the token safe. Bounded by the repository timeout; callers that
        need less wrap the call in `asyncio.timeout`.

        Args:
            scope: The election scope.
            holder: Who takes the term (for status and logs).

        Returns:
            The new current term, or None if a newer term is already recorded (the caller must not
            lead).

        Raises:
            Unavailable: PostgreSQL failed or did not answer in time.
        """
        try:
            async with asyncio.timeout(self._timeout), self._pool.acquire() as conn:
                row = await conn.fetchrow(_BEGIN_TERM, scope, holder, timeout=self._timeout)
        except Exception as exc:
            if not stores.is_fault(exc):  # a bug (a wrong statement, a misuse) is not an outage
                raise
            raise Unavailable(f"cannot record a leader term for scope {scope!r}: {exc!r}") from exc
        return None if row is None else _record(row)

    async def current(self, scope: str) -> TermRecord | None:
        """The recorded current term of `scope`, or None if no leader was ever elected there.

        Raises:
            Unavailable: PostgreSQL failed or did not answer within the repository timeout.
        """
        try:
            async with asyncio.timeout(self._timeout), self._pool.acquire() as conn:
                row = await conn.fetchrow(_CURRENT, scope, timeout=self._timeout)
        except Exception as exc:
            if not stores.is_fault(exc):  # a bug (a wrong statement, a misuse) is not an outage
                raise
            raise Unavailable(f"cannot read the leader term of scope {scope!r}: {exc!r}") from exc
        return None if row is None else _record(row)


async def assert_current_term(conn: Connection, scope: str, term: int) -> None:
    """Fence a leader write: fail unless `term` is still the current term of `scope`.

    Call it inside the transaction that makes the write, before the write. It locks the
    `leader_state` row FOR SHARE until that transaction ends, so a new term cannot be recorded
    in between: the write either commits under a term that was current throughout, or fails here
    (a new leader's `begin_term` waits for the transaction to end, so keep it short).

    It may wait while a new term is being recorded; it is bounded like the caller's other
    statements (the pool's command timeout, or the caller's `asyncio.timeout`).

    Args:
        conn: The connection the caller's transaction runs on.
        scope: The election scope.
        term: The caller's fencing token (`Term.token`).

    Raises:
        Fenced: `term` is not the current term (a newer leader exists, or none was recorded).
        RuntimeError: `conn` is not inside a transaction, where the check would protect nothing.
    """
    if not conn.is_in_transaction():
        raise RuntimeError("assert_current_term must run inside the transaction that makes the write")
    current = await conn.fetchval(_CHECK_TERM, scope)
    if current != term:
        raise Fenced(f"leader term {term} of scope {scope!r} is no longer current (current term: {current})")
