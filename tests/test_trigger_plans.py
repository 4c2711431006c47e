"""The trigger statement's cost does not grow with the day's runs, whatever plan PostgreSQL caches
for it. On a real PostgreSQL.

A prepared statement's generic plan is made once and kept: one made while the day's partition was
still empty may hash-join the whole partition where a probe per request was meant, and then every
TriggerJob of the day reads every run of the day (it did: 1.7 ms a statement at 2,700 runs, 9.8 ms
at 21,600). Here the generic plan is forced and made before any run exists.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

import asyncpg

from scheduler_grpc.db.executions import TriggerOutcome, TriggerRequest
from scheduler_grpc.db.firing import FiringRepository


async def _rows_read_by_scans(conn: asyncpg.Connection) -> int:
    """Rows this database's sequential scans of `job_executions` (every partition) have read."""
    await conn.execute("SELECT pg_stat_force_next_flush()")  # this backend's counts, now
    return int(
        await conn.fetchval(
            "SELECT coalesce(sum(seq_tup_read), 0) FROM pg_stat_user_tables WHERE relname LIKE 'job_executions%'"
        )
    )


async def test_a_trigger_reads_no_earlier_runs_even_with_a_plan_made_on_an_empty_day(pool: asyncpg.Pool) -> None:
    job_id: uuid.UUID = await pool.fetchval(
        "INSERT INTO jobs (name, handler, schedule_kind) VALUES ('j', 'test.echo', 'manual') RETURNING id"
    )
    job = str(job_id)
    slot = datetime.now(UTC)

    def requests(count: int, request_ids: bool = False) -> list[TriggerRequest]:
        nonlocal slot
        batch = [
            TriggerRequest(job, slot + timedelta(microseconds=i), uuid.uuid4().hex if request_ids else None)
            for i in range(count)
        ]
        slot += timedelta(microseconds=count)
        return batch

    async with pool.acquire() as conn:
        await conn.execute("SET plan_cache_mode = force_generic_plan")
        firing = FiringRepository(conn)
        # The plans, made while the day has no run (with and without request ids: one statement).
        assert [r.outcome for r in await firing.trigger_now(requests(1))] == [TriggerOutcome.CREATED]
        assert [r.outcome for r in await firing.trigger_now(requests(1, True))] == [TriggerOutcome.CREATED]
        for _ in range(3):
            await firing.trigger_now(requests(1000))
        before = await _rows_read_by_scans(conn)
        for _ in range(10):
            results = await firing.trigger_now(requests(5)) + await firing.trigger_now(requests(5, True))
            assert {result.outcome for result in results} == {TriggerOutcome.CREATED}
        assert await pool.fetchval("SELECT count(*) FROM job_executions") == 3102
        # Each of the 20 statements reading the 3,000 runs would be 60,000 rows.
        assert await _rows_read_by_scans(conn) - before < 1000
