"""The console's searches beyond the lists of `db.console`: dead letters with their job, handler,
error and age, and the charts' aggregates over the last hour or day.

Dead letters are read from PostgreSQL, which is their record (a run whose latest attempt is `dead`
and not purged; the leader rebuilds the Redis dead-letter queue from it), through the partial index
of migration 0009 (`final_status = 'dead' AND dlq_purged_at IS NULL`): bounded by the number of dead
runs, not by the history. The charts read the finished attempts of the window through the
`finished_at` index (migration 0008).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

import asyncpg

from scheduler_grpc.db.attempts import latest_attempt
from scheduler_grpc.db.bulk import like_pattern


@dataclass(frozen=True)
class DeadLetter:
    """A dead run as the dead-letter page shows it."""

    run_id: str
    job_id: str
    job_name: str
    handler: str
    queue: str
    attempt: int
    error: str
    died_at: datetime | None


@dataclass(frozen=True)
class Series:
    """The charts' aggregates: (bucket start, status, count) and (bucket start, p50 s, p99 s)."""

    outcomes: list[tuple[datetime, str, int]]
    lateness: list[tuple[datetime, float, float]]


class SearchQueries:
    """Dead-letter search and chart aggregates, each bounded by `timeout`."""

    def __init__(self, pool: asyncpg.Pool, *, timeout: float = 5.0) -> None:
        self._pool = pool
        self._timeout = timeout

    async def dead_letters(
        self,
        *,
        queue: str,
        job_ids: Sequence[str] | None,
        handler: str | None,
        error: str | None,
        before: tuple[datetime, str] | None,
        limit: int,
    ) -> list[DeadLetter]:
        """Dead runs of `queue` that are still in its dead-letter queue, newest death first."""
        conditions = ["coalesce(e.queue, j.queue, 'default') = $1"]
        args: list[object] = [queue]

        def where(condition: str, value: object) -> None:
            args.append(value)
            conditions.append(condition.format(f"${len(args)}"))

        if job_ids is not None:
            where("e.job_id = ANY({}::uuid[])", [uuid.UUID(i) for i in job_ids])
        if handler:
            where("coalesce(e.handler, j.handler) = {}", handler)
        if error:
            where("e.error ILIKE {}", like_pattern(error))
        if before:
            args.extend([before[0], uuid.UUID(before[1])])
            conditions.append(f"(e.finished_at, e.run_id) < (${len(args) - 1}, ${len(args)}::uuid)")
        args.append(limit)
        rows = await self._pool.fetch(
            f"""SELECT e.run_id, e.job_id, j.name AS job_name, coalesce(e.handler, j.handler) AS handler,
                       coalesce(e.queue, j.queue, 'default') AS queue, e.attempt, e.error, e.finished_at
                FROM job_executions e LEFT JOIN jobs j ON j.id = e.job_id
                WHERE e.final_status = 'dead' AND e.dlq_purged_at IS NULL
                  AND e.id = {latest_attempt("e.run_id", "a.id")} AND {" AND ".join(conditions)}
                ORDER BY e.finished_at DESC, e.run_id DESC LIMIT ${len(args)}""",
            *args,
            timeout=self._timeout,
        )
        return [_dead_letter(row) for row in rows]

    async def dead_details(self, run_ids: Sequence[str]) -> dict[str, DeadLetter]:
        """The job, handler, error and time of death of these runs' latest attempts (for a page of
        the Redis dead-letter queue)."""
        rows = await self._pool.fetch(
            f"""SELECT x.run_id, x.job_id, j.name AS job_name, coalesce(x.handler, j.handler) AS handler,
                       coalesce(x.queue, j.queue, 'default') AS queue, x.attempt, x.error, x.finished_at
                FROM unnest($1::uuid[]) AS r(run_id)
                CROSS JOIN LATERAL {latest_attempt("r.run_id")} x
                LEFT JOIN jobs j ON j.id = x.job_id""",
            [uuid.UUID(i) for i in run_ids],
            timeout=self._timeout,
        )
        return {str(row["run_id"]): _dead_letter(row) for row in rows}

    async def series(self, *, since: datetime, bucket: timedelta, queue: str | None) -> Series:
        """Attempts finished since `since` per `bucket` and status, and the start lateness (started -
        scheduled) of first attempts of scheduled runs per bucket, on `queue` (None: every queue)."""
        on_queue = "AND e.queue = $3" if queue else ""
        args: list[object] = [since, bucket, *([queue] if queue else [])]
        outcomes, lateness = await asyncio.gather(
            self._pool.fetch(
                f"""SELECT date_bin($2, e.finished_at, $1) AS t, e.final_status AS status, count(*) AS n
                FROM job_executions e WHERE e.finished_at >= $1 {on_queue}
                GROUP BY 1, 2 ORDER BY 1""",
                *args,
                timeout=self._timeout,
            ),
            self._pool.fetch(
                f"""SELECT date_bin($2, e.finished_at, $1) AS t,
                       percentile_cont(0.5) WITHIN GROUP (ORDER BY extract(epoch FROM e.started_at - e.scheduled_for))
                           AS p50,
                       percentile_cont(0.99) WITHIN GROUP (ORDER BY extract(epoch FROM e.started_at - e.scheduled_for))
                           AS p99
                FROM job_executions e
                WHERE e.finished_at >= $1 AND e.trigger = 'schedule' AND e.attempt = 1
                  AND e.started_at IS NOT NULL {on_queue}
                GROUP BY 1 ORDER BY 1""",
                *args,
                timeout=self._timeout,
            ),
        )
        return Series(
            outcomes=[(row["t"], row["status"] or "other", row["n"]) for row in outcomes],
            lateness=[(row["t"], float(row["p50"]), float(row["p99"])) for row in lateness],
        )


def _dead_letter(row: asyncpg.Record) -> DeadLetter:
    return DeadLetter(
        str(row["run_id"]),
        str(row["job_id"]),
        row["job_name"] or "",
        row["handler"] or "",
        row["queue"],
        row["attempt"],
        row["error"] or "",
        row["finished_at"],
    )
