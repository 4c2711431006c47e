"""Request ids claimed by the trigger statement itself (migration 0020): set-based, without the
row trigger of migration 0016, and still one run per request id however calls race. On a real
PostgreSQL."""

from __future__ import annotations

import asyncio
import uuid
from datetime import UTC, datetime, timedelta

import asyncpg
import pytest

from scheduler_grpc.db.executions import TriggerOutcome, TriggerRequest
from scheduler_grpc.db.firing import FiringRepository
from tests.engine_helpers import eventually

# The row trigger's function, made to fail: called for a row, it fails the statement.
_FAILING_ROW_TRIGGER = """CREATE OR REPLACE FUNCTION execution_requests_claim() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN RAISE EXCEPTION 'the row trigger was called'; END $$"""


async def _job(pool: asyncpg.Pool) -> str:
    job_id: uuid.UUID = await pool.fetchval(
        "INSERT INTO jobs (name, handler, schedule_kind) VALUES ('j', 'test.echo', 'manual') RETURNING id"
    )
    return str(job_id)


async def test_the_trigger_statement_claims_its_request_ids_without_the_row_trigger(pool: asyncpg.Pool) -> None:
    """The per-row trigger cost two thirds of a run's insert: the statement claims every request id
    in one insert of its own, and the trigger is not called (here it would fail the statement)."""
    job = await _job(pool)
    slot = datetime.now(UTC)
    requests = [TriggerRequest(job, slot + timedelta(microseconds=i), f"r{i}") for i in range(100)]
    async with pool.acquire() as conn:
        transaction = conn.transaction()
        await transaction.start()
        try:
            await conn.execute(_FAILING_ROW_TRIGGER)
            results = await FiringRepository(conn).trigger_now(requests)
            assert [result.outcome for result in results] == [TriggerOutcome.CREATED] * len(requests)
            rows = await conn.fetch("SELECT request_id, run_id::text FROM execution_requests WHERE job_id = $1", job)
            claims = {row["request_id"]: row["run_id"] for row in rows}
            assert claims == {f"r{i}": result.execution.run_id for i, result in enumerate(results) if result.execution}
            # Any other insert of a row with a request id, even later in the same transaction, still
            # goes through the trigger.
            with pytest.raises(asyncpg.RaiseError, match="the row trigger was called"):
                async with conn.transaction():
                    await conn.execute(
                        """INSERT INTO job_executions (id, run_id, job_id, scheduled_for, attempt, status, trigger,
                                                       request_id, handler)
                           VALUES ($1, $1, $2, $3, 1, 'queued', 'manual', 'by-hand', 'test.echo')""",
                        uuid.uuid4(),
                        uuid.UUID(job),
                        slot - timedelta(seconds=1),
                    )
        finally:
            await transaction.rollback()  # the trigger's function as it was
    assert await pool.fetchval("SELECT count(*) FROM execution_requests") == 0


async def test_a_request_id_claimed_by_an_open_transaction_stays_its_own_once_it_commits(pool: asyncpg.Pool) -> None:
    """A call that finds its request id claimed by a transaction not yet committed waits for it; when
    that commits, its run exists, so the waiting call must not take the claim over (it would make a
    second run): it answers COLLIDED (the run is newer than its statement), and its retry finds the
    first call's run."""
    job = await _job(pool)
    slot = datetime.now(UTC)
    firing = FiringRepository(pool)
    async with pool.acquire() as first:
        opened = first.transaction()
        await opened.start()
        try:
            [made] = await FiringRepository(first).trigger_now([TriggerRequest(job, slot, "once")])
            assert made.outcome is TriggerOutcome.CREATED
            assert made.execution is not None
            waiting = asyncio.create_task(
                firing.trigger_now([TriggerRequest(job, slot + timedelta(seconds=1), "once")])
            )
            await eventually(
                lambda: pool.fetchval(
                    "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                    " AND datname = current_database()"
                )
            )
        finally:
            await opened.commit()
    [answer] = await waiting
    assert answer.outcome is TriggerOutcome.COLLIDED
    [again] = await firing.trigger_now([TriggerRequest(job, slot + timedelta(seconds=2), "once")])
    assert again.outcome is TriggerOutcome.REPEATED
    assert again.execution is not None
    assert again.execution.run_id == made.execution.run_id
    assert await pool.fetchval("SELECT count(*) FROM job_executions WHERE request_id = 'once'") == 1
