"""The worker's two statements of a claim and of a completion (`db/runs.py`): the short one for the
usual case, the whole one for the rest, and between them every run claimed or recorded once."""

from __future__ import annotations

import contextlib
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg

from scheduler_grpc.db.executions import Outcome, Queryable
from scheduler_grpc.db.firing import FiringRepository
from scheduler_grpc.db.jobs import JobRepository
from scheduler_grpc.db.runs import RunRepository
from scheduler_grpc.executions import ExecutionStatus, Trigger
from scheduler_grpc.jobs import JobSpec, RetryPolicy


class _Counting:
    """A pool stand-in that keeps the statements it ran."""

    def __init__(self, pool: asyncpg.Pool) -> None:
        self._pool = pool
        self.statements: list[str] = []

    async def fetch(self, query: str, *args: Any) -> list[asyncpg.Record]:
        self.statements.append(query)
        return list(await self._pool.fetch(query, *args))

    def transaction(self) -> contextlib.nullcontext[None]:  # each statement on its own, as over a pool
        return contextlib.nullcontext()


async def _states(pool: asyncpg.Pool, run_id: str) -> list[tuple[int, str, str | None]]:
    rows = await pool.fetch(
        "SELECT attempt, status, claim_token FROM job_executions WHERE run_id = $1::uuid ORDER BY attempt", run_id
    )
    return [(row["attempt"], row["status"], row["claim_token"]) for row in rows]


async def test_a_batch_of_every_case_claims_each_run_once_in_at_most_two_statements(pool: asyncpg.Pool) -> None:
    job = await JobRepository(pool).create(JobSpec(name="paths", handler="test.echo"), None)
    base = datetime(2020, 1, 1, tzinfo=UTC)
    made = await FiringRepository(pool).trigger(
        job.id, Trigger.BACKFILL, [base + timedelta(seconds=i) for i in range(6)]
    )
    queued, lost, again, finished, unknown_slot, fresh = made
    runs = RunRepository(pool)
    # Before the batch: one run held by a worker that lost its lease, one by this very token (a
    # resent claim), one finished.
    assert len(await runs.claim([(lost.run_id, "old")], "gone", slots=[lost.scheduled_for])) == 1
    (held,) = await runs.claim([(again.run_id, "t-again")], "w", slots=[again.scheduled_for])
    (ended,) = await runs.claim([(finished.run_id, "t-ended")], "w", slots=[finished.scheduled_for])
    await runs.complete(
        [Outcome(ended.execution_id, "t-ended", ExecutionStatus.SUCCEEDED, scheduled_for=ended.scheduled_for)]
    )

    counting = _Counting(pool)
    batch = [
        (queued.run_id, "t-queued"),
        (lost.run_id, "t-lost"),
        (again.run_id, "t-again"),
        (finished.run_id, "t-finished"),
        (unknown_slot.run_id, "t-unknown"),
    ]
    slots: list[datetime | None] = [
        queued.scheduled_for,
        lost.scheduled_for,
        again.scheduled_for,
        finished.scheduled_for,
        None,
    ]
    claims = await RunRepository(counting).claim(batch, "w", slots=slots)  # type: ignore[arg-type]

    assert sorted((c.run_id, c.attempt) for c in claims) == sorted(
        [(queued.run_id, 1), (lost.run_id, 2), (again.run_id, 1), (unknown_slot.run_id, 1)]
    )
    assert len(counting.statements) == 2  # the queued ones with their slot, then the whole claim for the rest
    assert await _states(pool, queued.run_id) == [(1, "running", "t-queued")]
    assert await _states(pool, lost.run_id) == [(1, "abandoned", "old"), (2, "running", "t-lost")]
    assert await _states(pool, again.run_id) == [(1, "running", "t-again")]
    assert held.execution_id == next(c.execution_id for c in claims if c.run_id == again.run_id)
    assert await _states(pool, finished.run_id) == [(1, "succeeded", "t-ended")]
    assert await _states(pool, unknown_slot.run_id) == [(1, "running", "t-unknown")]

    # Queued runs with their slots, the usual batch: one statement.
    counting.statements.clear()
    assert len(await RunRepository(counting).claim([(fresh.run_id, "t-fresh")], "w", slots=[fresh.scheduled_for])) == 1  # type: ignore[arg-type]
    assert len(counting.statements) == 1


async def test_a_completion_without_retries_records_the_same_as_the_whole_statement(pool: asyncpg.Pool) -> None:
    job = await JobRepository(pool).create(
        JobSpec(name="complete-paths", handler="test.echo", retry=RetryPolicy(max_retries=3)), None
    )
    base = datetime(2020, 1, 1, tzinfo=UTC)
    made = await FiringRepository(pool).trigger(
        job.id, Trigger.BACKFILL, [base + timedelta(seconds=i) for i in range(3)]
    )
    runs = RunRepository(pool)
    claims = await runs.claim([(q.run_id, f"t-{q.run_id}") for q in made], "w", slots=[q.scheduled_for for q in made])
    ok, failed, retried = sorted(claims, key=lambda c: c.scheduled_for)
    started = datetime.now(UTC) - timedelta(seconds=1)

    def outcome(claim: Any, status: ExecutionStatus, **kwargs: Any) -> Outcome:
        return Outcome(claim.execution_id, f"t-{claim.run_id}", status, scheduled_for=claim.scheduled_for, **kwargs)

    counting = _Counting(pool)
    done = await RunRepository(counting).complete(  # type: ignore[arg-type]
        [outcome(ok, ExecutionStatus.SUCCEEDED, result={"n": 1}, started_at=started),
         outcome(failed, ExecutionStatus.FAILED, error="no")],
        resent=False,
    )  # fmt: skip
    assert "INSERT" not in counting.statements[0]  # the short statement: no retry to add
    assert sorted((d.run_id, d.status, d.retry_execution_id) for d in done) == sorted(
        [(ok.run_id, ExecutionStatus.SUCCEEDED, None), (failed.run_id, ExecutionStatus.FAILED, None)]
    )
    row = await pool.fetchrow(
        "SELECT status, result, error, started_at, finished_at FROM job_executions WHERE id = $1::uuid", ok.execution_id
    )
    assert row is not None
    assert (row["status"], row["result"], row["error"]) == ("succeeded", {"n": 1}, None)
    assert row["started_at"] == started
    assert row["finished_at"] is not None
    # A lost lease (another token) changes nothing; a retry goes through the whole statement.
    lost = Outcome(retried.execution_id, "other", ExecutionStatus.SUCCEEDED, scheduled_for=retried.scheduled_for)
    assert await runs.complete([lost], resent=False) == []
    (again,) = await runs.complete(
        [outcome(retried, ExecutionStatus.FAILED, error="later", retry_after=timedelta(0))], resent=False
    )
    assert again.retry_execution_id is not None
    assert [r["status"] for r in await pool.fetch(
        "SELECT status FROM job_executions WHERE run_id = $1::uuid ORDER BY attempt", retried.run_id
    )] == ["failed", "queued"]  # fmt: skip


async def test_the_short_statements_probe_each_run_whatever_the_statistics_say(pool: asyncpg.Pool) -> None:
    """Statistics taken before a day's runs were queued (the day analysed nearly empty) must not
    give the short claim or completion a plan that scans the day at every batch. The first five
    executions of a prepared statement are planned with their values (a scan of a small day may
    then be the cheaper plan); the plan kept from the sixth on must probe each run."""
    job = await JobRepository(pool).create(JobSpec(name="stale-stats", handler="test.echo"), None)
    firing = FiringRepository(pool)
    slot = datetime.now(UTC)
    await pool.execute("ANALYZE job_executions")
    made = await firing.trigger(job.id, Trigger.MANUAL, [slot + timedelta(microseconds=i + 1) for i in range(3000)])
    scanned: list[int] = []
    # One connection (its prepared statements), one transaction (its own exact counters).
    async with pool.acquire() as connection, connection.transaction():
        runs = RunRepository(connection)
        for k in range(0, len(made), 100):
            batch = made[k : k + 100]
            before = await _sequential_reads(connection)
            claims = await runs.claim([(q.run_id, "t") for q in batch], "w", slots=[q.scheduled_for for q in batch])
            done = await runs.complete(
                [
                    Outcome(c.execution_id, "t", ExecutionStatus.SUCCEEDED, scheduled_for=c.scheduled_for)
                    for c in claims
                ],
                resent=False,
            )
            assert len(done) == len(batch)
            scanned.append(await _sequential_reads(connection) - before)
    assert scanned[6:] == [0] * (len(scanned) - 6), scanned


async def _sequential_reads(connection: Queryable) -> int:
    """Rows of job_executions read by sequential scan in this transaction."""
    return int(
        await connection.fetchval(
            "SELECT coalesce(sum(seq_tup_read), 0) FROM pg_stat_xact_user_tables WHERE relname LIKE 'job_executions%'"
        )
    )
