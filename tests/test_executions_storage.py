"""How execution rows are stored (migration 0009): the claim is a HOT update, and every query that
looks up open rows or a finished status still reads an index; what the claim records as a start."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

import asyncpg
import pytest

from scheduler_grpc.db.console import ConsoleQueries
from scheduler_grpc.db.executions import Outcome, TriggerOutcome, TriggerRequest
from scheduler_grpc.db.firing import FiringRepository
from scheduler_grpc.db.jobs import JobRepository
from scheduler_grpc.db.runs import RunRepository
from scheduler_grpc.executions import ExecutionStatus, Trigger
from scheduler_grpc.jobs import JobSpec


async def _job(pool: asyncpg.Pool, name: str = "storage") -> str:
    job = await JobRepository(pool).create(JobSpec(name=name, handler="test.echo"), None)
    return job.id


async def _runs(pool: asyncpg.Pool, job_id: str, n: int) -> list[str]:
    base = datetime(2020, 1, 1, tzinfo=UTC)
    slots = [base + timedelta(seconds=i) for i in range(n)]
    return [q.run_id for q in await FiringRepository(pool).trigger(job_id, Trigger.BACKFILL, slots)]


async def test_a_claim_is_a_hot_update_and_a_completion_adds_no_open_row_entries(pool: asyncpg.Pool) -> None:
    """No index reads what the claim changes and pages keep room: the claim writes no index entry."""
    job_id = await _job(pool)
    runs = await _runs(pool, job_id, 300)
    async with pool.acquire() as connection, connection.transaction():
        # This transaction's own counters: exact, no waiting for the statistics collector.
        claims = await RunRepository(connection).claim([(run, f"t-{run}") for run in runs], "w")
        # Counted per partition (the partitioned table has no rows of its own).
        updated, hot = await connection.fetchrow(
            """SELECT sum(pg_stat_get_xact_tuples_updated(inhrelid)),
                      sum(pg_stat_get_xact_tuples_hot_updated(inhrelid))
               FROM pg_inherits WHERE inhparent = 'job_executions'::regclass"""
        )
    assert len(claims) == 300
    assert (updated, hot) == (300, 300)
    done = await RunRepository(pool).complete(
        [Outcome(c.execution_id, f"t-{c.run_id}", ExecutionStatus.SUCCEEDED, None, {"ok": 1}) for c in claims],
        resent=False,
    )
    assert len(done) == 300
    # Finished rows are out of the open-row indexes and in the finished-status one.
    counts = await pool.fetchrow(
        """SELECT count(*) FILTER (WHERE finished_at IS NULL) AS open,
                  count(*) FILTER (WHERE final_status = 'succeeded') AS succeeded FROM job_executions"""
    )
    assert (counts["open"], counts["succeeded"]) == (0, 300)


async def test_a_trigger_of_a_job_without_missed_ranges_reads_none_of_its_runs(pool: asyncpg.Pool) -> None:
    """The missed-range check of a manual trigger: a job that never had a range (`jobs.missed_through`
    NULL, migration 0019) reads neither a partition nor a missed-range index. Before, every trigger
    looked for the job's latest range, and a generic plan prepared while the day's partition was
    nearly empty scanned the whole partition for each request: a trigger cost more with every run."""
    job_id = await _job(pool)
    await _runs(pool, job_id, 300)
    now = await pool.fetchval("SELECT now()")
    # This backend's counters not yet flushed (exact: no waiting for the statistics collector;
    # they may hold earlier statements' scans, so the statement's are the difference).
    scans = """SELECT (SELECT sum(pg_stat_get_xact_numscans(inhrelid)) FROM pg_inherits
                       WHERE inhparent = 'job_executions'::regclass),
                      (SELECT sum(pg_stat_get_xact_numscans(inhrelid)) FROM pg_inherits
                       WHERE inhparent = 'job_executions_missed_ranges_idx'::regclass)"""
    async with pool.acquire() as connection, connection.transaction():
        before = await connection.fetchrow(scans)
        results = await FiringRepository(connection).trigger_now(
            [TriggerRequest(job_id, now + timedelta(microseconds=i)) for i in range(15)]
        )
        after = await connection.fetchrow(scans)
    assert [result.outcome for result in results] == [TriggerOutcome.CREATED] * 15
    assert (after[0] - before[0], after[1] - before[1]) == (0, 0)  # partitions scanned, range index read


async def test_final_status_is_null_while_open_and_the_status_once_final(pool: asyncpg.Pool) -> None:
    job_id = await _job(pool)
    [run] = await _runs(pool, job_id, 1)
    executions = RunRepository(pool)
    final = "SELECT status, final_status FROM job_executions WHERE run_id = $1 ORDER BY attempt DESC LIMIT 1"
    assert tuple(await pool.fetchrow(final, uuid.UUID(run))) == ("queued", None)
    [claim] = await executions.claim([(run, "t")], "w")
    assert tuple(await pool.fetchrow(final, uuid.UUID(run))) == ("running", None)
    await executions.complete([Outcome(claim.execution_id, "t", ExecutionStatus.DEAD, "boom")])
    assert tuple(await pool.fetchrow(final, uuid.UUID(run))) == ("dead", "dead")
    with pytest.raises(asyncpg.GeneratedAlwaysError):
        await pool.execute("UPDATE job_executions SET final_status = 'succeeded' WHERE run_id = $1", uuid.UUID(run))


async def test_an_open_row_has_no_finished_at_and_a_finished_one_has_one(pool: asyncpg.Pool) -> None:
    """The CHECK that makes `finished_at IS NULL` mean queued or running (the open-row indexes)."""
    job_id = await _job(pool)
    [run] = await _runs(pool, job_id, 1)
    with pytest.raises(asyncpg.CheckViolationError):
        await pool.execute("UPDATE job_executions SET finished_at = now() WHERE run_id = $1", uuid.UUID(run))
    [claim] = await RunRepository(pool).claim([(run, "t")], "w")
    with pytest.raises(asyncpg.CheckViolationError):
        await pool.execute("UPDATE job_executions SET finished_at = now() WHERE id = $1", uuid.UUID(claim.execution_id))


async def test_a_ready_run_starts_at_its_lease_kept_between_its_due_time_and_its_claim(pool: asyncpg.Pool) -> None:
    """`started_at` is the lease instant given with the item; a lease instant after the claim (the
    queue's clock ahead) starts it at the claim, one before its due time (the clock behind) at its
    due time to the millisecond, and an item without one (a caller that has none) at the claim."""
    job_id = await _job(pool)
    now = await pool.fetchval("SELECT clock_timestamp()")
    due = now - timedelta(hours=1, microseconds=123_456)  # not a whole millisecond
    runs = await FiringRepository(pool).trigger(
        job_id, Trigger.MANUAL, [due + timedelta(microseconds=n) for n in range(4)], due_at=due
    )
    leased = due + timedelta(minutes=30, microseconds=456)  # whole milliseconds, as a queue gives them
    leased = leased.replace(microsecond=leased.microsecond // 1000 * 1000)
    instants = [leased, now + timedelta(hours=1), due - timedelta(hours=1), None]
    async with pool.acquire() as connection, connection.transaction():
        claims = await RunRepository(connection).claim(
            [(run.run_id, f"t-{n}") for n, run in enumerate(runs)], "w", leased_at=instants
        )
        claimed_at = await connection.fetchval("SELECT now()")  # the claim's statement time
    starts = {claim.run_id: claim.started_at for claim in claims}
    stored = dict(await pool.fetch("SELECT run_id::text, started_at FROM job_executions WHERE job_id = $1", job_id))
    assert stored == starts
    due_ms = due.replace(microsecond=due.microsecond // 1000 * 1000)
    assert [starts[run.run_id] for run in runs] == [leased, claimed_at, due_ms, claimed_at]


async def _plan(pool: asyncpg.Pool, sql: str, *args: object) -> str:
    async with pool.acquire() as connection, connection.transaction():
        # Only the indexes can serve the query once sequential scans cost "infinitely" much; a
        # plan that still scans the table means no index matches the query's predicate.
        await connection.execute("SET LOCAL enable_seqscan = off")
        rows = await connection.fetch("EXPLAIN " + sql, *args)
    return "\n".join(row[0] for row in rows)


@pytest.mark.parametrize(
    ("sql", "index"),
    [
        # Reconcile and the policies (db/executions.py), the console (db/console.py).
        # (Either open-row index serves it: both hold only open rows.)
        ("SELECT run_id FROM job_executions WHERE job_id = $1 AND finished_at IS NULL", "job_executions_open"),
        (
            "SELECT id FROM job_executions WHERE id = ANY($1::uuid[]) AND cancel_requested_at IS NOT NULL"
            " AND finished_at IS NULL AND status = 'running'",
            "job_executions_cancel_idx",
        ),
        (
            "SELECT run_id FROM job_executions WHERE final_status = 'dead' AND dlq_purged_at IS NULL ORDER BY run_id",
            "job_executions_dead_letters_idx|job_executions_final_status_created_idx",
        ),
        (
            "SELECT scheduled_for FROM job_executions WHERE job_id = $1 AND final_status = 'missed'"
            " ORDER BY scheduled_for DESC LIMIT 1",
            "job_executions_missed_ranges_idx",
        ),
        (
            "SELECT id FROM job_executions e WHERE e.final_status = 'failed'"
            " ORDER BY e.created_at DESC, e.id DESC LIMIT 5",
            "job_executions_final_status_created_idx",
        ),
        (
            "SELECT id FROM job_executions e WHERE e.finished_at IS NULL AND e.status = ANY('{queued}')"
            " ORDER BY e.created_at DESC, e.id DESC LIMIT 5",
            "job_executions_open",
        ),
        (
            "SELECT status, count(*) FROM job_executions WHERE finished_at IS NULL GROUP BY 1",
            "job_executions_open",
        ),
        # The console's last hour: a range of finished_at.
        (
            "SELECT status, count(*) FROM job_executions WHERE finished_at >= now() - interval '1 hour'"
            " AND finished_at IS NOT NULL GROUP BY 1",
            "job_executions_finished_idx",
        ),
    ],
)
async def test_the_queries_of_open_rows_and_final_statuses_read_their_index(
    pool: asyncpg.Pool, sql: str, index: str
) -> None:
    job_id = await _job(pool)
    # A history of finished rows and a few open ones, analysed: the planner's choice as in production.
    await pool.execute(
        """INSERT INTO job_executions (id, run_id, job_id, scheduled_for, status, trigger, started_at,
                                       finished_at, worker_id, handler)
           SELECT u, u, $1, now() - n * interval '1 second', 'succeeded', 'manual', now(), now(), 'w', 'test.echo'
           FROM (SELECT gen_random_uuid() AS u, n FROM generate_series(1, 5000) AS n) s""",
        uuid.UUID(job_id),
    )
    await _runs(pool, job_id, 5)
    await pool.execute("ANALYZE job_executions")
    args: tuple[object, ...] = ()
    if "$1::uuid[]" in sql:
        args = ([uuid.uuid4()],)
    elif "$1" in sql:
        args = (uuid.UUID(job_id),)
    plan = await _plan(pool, sql, *args)
    assert any(name in plan for name in index.split("|")), plan
    assert "Seq Scan" not in plan, plan


async def test_the_console_state_filter_finds_open_and_finished_attempts(pool: asyncpg.Pool) -> None:
    """Console filters by a finished state (final_status), an open one, and both at once."""
    job_id = await _job(pool)
    runs = await _runs(pool, job_id, 3)
    executions = RunRepository(pool)
    claims = await executions.claim([(runs[0], "a"), (runs[1], "b")], "w")
    by_run = {c.run_id: c for c in claims}
    await executions.complete([Outcome(by_run[runs[0]].execution_id, "a", ExecutionStatus.FAILED, "x")])
    console = ConsoleQueries(pool)

    async def states(*wanted: str) -> list[str]:
        rows = await console.executions(
            job_id=None, statuses=wanted, handler=None, since=None, until=None, before=None, limit=10
        )
        return sorted(row.execution.status.value for row in rows)

    assert await states("failed") == ["failed"]
    assert await states("running") == ["running"]
    assert await states("queued", "running") == ["queued", "running"]
    assert await states("failed", "queued") == ["failed", "queued"]
    assert await states("failed", "succeeded") == ["failed"]


async def test_a_completion_batch_reports_each_retry_with_its_own_outcome(pool: asyncpg.Pool) -> None:
    """Retries come back as rows of their own and are joined to their outcome in Python."""
    job_id = await _job(pool)
    runs = await _runs(pool, job_id, 4)
    executions = RunRepository(pool)
    claims = {c.run_id: c for c in await executions.claim([(run, f"t-{run}") for run in runs], "w")}
    outcomes = [
        Outcome(claims[runs[0]].execution_id, f"t-{runs[0]}", ExecutionStatus.FAILED, "x", None, timedelta(seconds=9)),
        Outcome(claims[runs[1]].execution_id, f"t-{runs[1]}", ExecutionStatus.SUCCEEDED, None, {"n": 1}),
        Outcome(claims[runs[2]].execution_id, f"t-{runs[2]}", ExecutionStatus.TIMED_OUT, "t", None, timedelta(0)),
        Outcome(claims[runs[3]].execution_id, "not-the-token", ExecutionStatus.SUCCEEDED),
    ]
    done = {d.run_id: d for d in await executions.complete(outcomes, resent=False)}
    assert set(done) == {runs[0], runs[1], runs[2]}
    retry_of = dict(
        await pool.fetch(
            "SELECT run_id::text, id::text FROM job_executions WHERE attempt = 2 AND run_id = ANY($1::uuid[])",
            [uuid.UUID(run) for run in runs],
        )
    )
    assert set(retry_of) == {runs[0], runs[2]}
    assert [done[run].retry_execution_id for run in runs[:3]] == [retry_of[runs[0]], None, retry_of[runs[2]]]
    assert [done[run].execution_id for run in runs[:3]] == [claims[run].execution_id for run in runs[:3]]
    # The retry carries the run's snapshot of its job.
    snapshot = await pool.fetchrow(
        "SELECT handler, queue FROM job_executions WHERE id = $1", uuid.UUID(retry_of[runs[0]])
    )
    assert tuple(snapshot) == ("test.echo", "default")
    # Sent again (the reply was lost): reported again, with the same retry.
    again = await executions.complete(outcomes[:2])
    assert {(d.run_id, d.retry_execution_id) for d in again} == {(runs[0], retry_of[runs[0]]), (runs[1], None)}


def _milliseconds(execution_id: str) -> int:
    return uuid.UUID(execution_id).int >> 80


async def test_execution_ids_are_time_ordered_from_python_and_from_sql(pool: asyncpg.Pool) -> None:
    """UUID version 7: new index entries land on the rightmost leaves, not on random ones."""
    job_id = await _job(pool)
    before = int(datetime.now(UTC).timestamp() * 1000)
    runs = await _runs(pool, job_id, 3)  # ids made in Python
    executions = RunRepository(pool)
    claims = await executions.claim([(run, "t") for run in runs], "w")
    [done, *_] = await executions.complete(
        [Outcome(c.execution_id, "t", ExecutionStatus.FAILED, "x", None, timedelta(0)) for c in claims]
    )
    assert done.retry_execution_id is not None  # an id made in SQL (uuid_v7())
    default = str(await pool.fetchval("SELECT uuid_v7()"))
    after = int(datetime.now(UTC).timestamp() * 1000)
    for made in [*runs, done.retry_execution_id, default]:
        parsed = uuid.UUID(made)
        assert (parsed.version, parsed.variant) == (7, uuid.RFC_4122)
        assert before - 1 <= _milliseconds(made) <= after + 1
    assert _milliseconds(done.retry_execution_id) >= max(_milliseconds(run) for run in runs)
    # Random below the milliseconds: many ids in one millisecond stay distinct.
    assert await pool.fetchval("SELECT count(DISTINCT uuid_v7()) FROM generate_series(1, 1000)") == 1000
