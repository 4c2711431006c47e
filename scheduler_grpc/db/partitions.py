"""The day partitions of `job_executions` (migration 0016): created ahead by the leader, and retention
by detaching and dropping whole days, never by deleting executions.

Every DDL statement runs in a transaction of its own under a short `lock_timeout`: a partition
whose lock is not granted in time is left for the next round instead of queueing the hot path's
statements behind a waiting ACCESS EXCLUSIVE request. Under a leader term, each transaction first
takes the term's row `FOR SHARE` (the fence of the leader's other writes): a deposed leader changes
nothing.
"""

from __future__ import annotations

import contextlib
import logging
import re
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, timedelta

import asyncpg

from scheduler_grpc.db.executions import Queryable
from scheduler_grpc.errors import Fenced

log = logging.getLogger(__name__)

PARTITION = re.compile(r"^job_executions_p(\d{8})$")
# How long a DDL statement may wait for its locks before the partition is left for the next round.
LOCK_TIMEOUT = timedelta(milliseconds=200)

_FENCE = "SELECT 1 FROM leader_state WHERE scope = $1 AND term = $2 FOR SHARE"


def partition_name(day: date) -> str:
    return f"job_executions_p{day:%Y%m%d}"


def _bounds(day: date) -> tuple[datetime, datetime]:
    low = datetime(day.year, day.month, day.day, tzinfo=UTC)
    return low, low + timedelta(days=1)


@dataclass
class Retention:
    """What one retention pass did, by day."""

    dropped: list[date] = field(default_factory=list)
    # The rows the dropped days held: exact for a day never analyzed, else the planner's count
    # (`reltuples`, kept by autovacuum): counting a day of millions of rows reads all of it.
    executions: int = 0
    kept_open: list[date] = field(default_factory=list)  # past the retention but holding open runs
    busy: list[date] = field(default_factory=list)  # their lock was not granted in time: next round


class PartitionRepository:
    """Creates and drops the day partitions of `job_executions`.

    Over a pool: each partition is changed in a transaction of its own.
    """

    def __init__(self, pool: asyncpg.Pool, *, scope: str = "scheduler", lock_timeout: timedelta = LOCK_TIMEOUT):
        self._pool = pool
        self._scope = scope
        self._lock_timeout_ms = max(1, round(lock_timeout.total_seconds() * 1000))

    async def days(self) -> list[date]:
        """The days that have a partition, oldest first."""
        rows = await self._pool.fetch(
            "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid"
            " WHERE i.inhparent = 'job_executions'::regclass"
        )
        found = [m.group(1) for row in rows if (m := PARTITION.match(row["relname"]))]
        return sorted(datetime.strptime(text, "%Y%m%d").replace(tzinfo=UTC).date() for text in found)

    async def create_ahead(self, ahead: int, *, term: int | None = None) -> list[date]:
        """Make sure today (UTC, database clock) and the next `ahead` days have their partition.

        Idempotent. Returns the days created; a day whose lock was not granted in time is left for
        the next call (its slots land in the DEFAULT partition meanwhile, and move when it is made).

        Raises:
            Fenced: `term` is no longer the current term.
        """
        today: date = await self._pool.fetchval("SELECT (now() AT TIME ZONE 'UTC')::date")
        existing = set(await self.days())
        created = []
        for offset in range(ahead + 1):
            day = today + timedelta(days=offset)
            if day in existing:
                continue
            try:
                async with self._pool.acquire() as conn, conn.transaction():
                    await self._prepare(conn, term)
                    if await conn.fetchval("SELECT job_executions_add_partition($1)", day):
                        created.append(day)
            except asyncpg.LockNotAvailableError:
                log.info("partition not created: its locks were busy; next round", extra={"day": str(day)})
        if created:
            log.info("execution partitions created", extra={"days": [str(day) for day in created]})
        return created

    async def drop_before(self, older_than: datetime, *, term: int | None = None) -> Retention:
        """Detach and drop every day partition that ends by `older_than` and holds no open run.

        A day holding a run still queued or running (`finished_at IS NULL`, the open-row index) is
        kept whole, however old, and tried again at the next pass: its open runs are never lost. The
        test is made twice: once without a lock (to skip such a day cheaply), then again after
        `DETACH PARTITION`, which holds the partition's ACCESS EXCLUSIVE lock until the transaction
        ends, so no run can be made or reopened in it between the test and the commit; a day found
        open then is re-attached by the rollback. The request ids of the dropped runs
        (`execution_requests`) go in the same transaction. The table is dropped in a transaction
        of its own: a plain DETACH also locks `job_executions` itself (and its DEFAULT partition)
        exclusively until commit, and a DROP's commit removes the day's files (half a second for
        3.3 million rows), which the hot path must not wait for. A table detached but not dropped
        (a crash, a busy lock in between) is dropped by the next pass. The DEFAULT partition is
        never dropped.

        Raises:
            Fenced: `term` is no longer the current term.
        """
        done = Retention()
        for name in await self._detached():
            with contextlib.suppress(asyncpg.LockNotAvailableError):
                await self._drop_detached(name)
        for day in await self.days():
            if _bounds(day)[1] > older_than:
                break
            if await self._pool.fetchval(
                f'SELECT EXISTS (SELECT 1 FROM "{partition_name(day)}" WHERE finished_at IS NULL)'
            ):
                done.kept_open.append(day)
                continue
            try:
                rows = await self._drop(day, term)
            except asyncpg.LockNotAvailableError:
                done.busy.append(day)
                continue
            if rows is None:
                done.kept_open.append(day)
            else:
                done.dropped.append(day)
                done.executions += rows
        if done.dropped or done.kept_open or done.busy:
            log.info(
                "execution retention",
                extra={
                    "dropped": [str(day) for day in done.dropped],
                    "executions": done.executions,
                    "kept_open": [str(day) for day in done.kept_open],
                    "busy": [str(day) for day in done.busy],
                },
            )
        return done

    async def _drop(self, day: date, term: int | None) -> int | None:
        """Detach, test and drop one day; its row count (see `Retention.executions`), or None when
        it holds an open run (kept)."""
        name = partition_name(day)
        low, high = _bounds(day)
        async with self._pool.acquire() as conn:
            transaction = conn.transaction()
            await transaction.start()
            try:
                await self._prepare(conn, term)
                await conn.execute(f'ALTER TABLE job_executions DETACH PARTITION "{name}"')
                if await conn.fetchval(f'SELECT EXISTS (SELECT 1 FROM "{name}" WHERE finished_at IS NULL)'):
                    await transaction.rollback()  # re-attached as it was
                    return None
                await conn.execute(
                    "DELETE FROM execution_requests WHERE scheduled_for >= $1 AND scheduled_for < $2", low, high
                )
            except BaseException:
                await transaction.rollback()
                raise
            await transaction.commit()
        # Detached: out of every query of job_executions, its lock released.
        rows = await self._rows(name)
        with contextlib.suppress(asyncpg.LockNotAvailableError):  # (left for the next pass)
            await self._drop_detached(name)
        return rows

    async def _rows(self, name: str) -> int:
        estimate = await self._pool.fetchval("SELECT reltuples::bigint FROM pg_class WHERE oid = $1::regclass", name)
        if estimate is not None and estimate >= 0:
            return int(estimate)
        return int(await self._pool.fetchval(f'SELECT count(*) FROM "{name}"'))  # never analyzed: small

    async def _detached(self) -> list[str]:
        """Day tables of `job_executions` that a pass detached and did not drop."""
        rows = await self._pool.fetch(
            "SELECT c.relname FROM pg_class c WHERE c.relkind = 'r' AND c.relname ~ '^job_executions_p[0-9]{8}$'"
            " AND c.relnamespace = current_schema()::regnamespace"
            " AND NOT EXISTS (SELECT 1 FROM pg_inherits i WHERE i.inhrelid = c.oid)"
        )
        return [row["relname"] for row in rows]

    async def _drop_detached(self, name: str) -> None:
        async with self._pool.acquire() as conn, conn.transaction():
            await conn.execute(f"SET LOCAL lock_timeout = {self._lock_timeout_ms}")
            await conn.execute(f'DROP TABLE IF EXISTS "{name}"')

    async def _prepare(self, conn: Queryable, term: int | None) -> None:
        await conn.execute(f"SET LOCAL lock_timeout = {self._lock_timeout_ms}")
        if term is not None and await conn.fetchval(_FENCE, self._scope, term) is None:
            raise Fenced(f"leader term {term} is no longer current")
