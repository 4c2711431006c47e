"""`job_executions` partitioned by day (migration 0016): the conversion keeps every row, the
uniqueness the guarantees rest on stays enforced by PostgreSQL across partitions, and a slot no day
partition covers still inserts."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta

import asyncpg
import pytest

from scheduler_grpc.db import migrate as migrations
from scheduler_grpc.db.firing import FiringRepository
from scheduler_grpc.db.history import HistoryRepository
from scheduler_grpc.db.migrate import migrate
from scheduler_grpc.executions import Trigger

_ROW = """INSERT INTO job_executions (id, run_id, job_id, scheduled_for, attempt, status, trigger, started_at,
                                   finished_at, worker_id, claim_token, request_id, handler, payload, result)
          VALUES ($1, $2, $3, $4, $5, $6, 'manual', $7, $8, $9, $10, $11, 'test.echo', '{"n": 1}', $12)"""


@pytest.fixture
async def before_0016(pool: asyncpg.Pool, database_url: str) -> AsyncIterator[asyncpg.Pool]:
    """A fresh database migrated up to 0015 (job_executions not yet partitioned)."""
    name = "scheduler_before_0016"
    await pool.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    await pool.execute(f'CREATE DATABASE "{name}"')
    target = await asyncpg.create_pool(database_url.rsplit("/", 1)[0] + "/" + name, min_size=1, max_size=2)
    try:
        yield target
    finally:
        await target.close()
        await pool.execute(f'DROP DATABASE "{name}" WITH (FORCE)')


async def _job(pool: asyncpg.Pool, name: str = "j") -> uuid.UUID:
    job_id: uuid.UUID = await pool.fetchval(
        "INSERT INTO jobs (name, handler, schedule_kind) VALUES ($1, 'test.echo', 'manual') RETURNING id", name
    )
    return job_id


async def test_the_conversion_keeps_every_row_and_its_values(
    before_0016: asyncpg.Pool, monkeypatch: pytest.MonkeyPatch
) -> None:
    shipped = migrations.available()
    monkeypatch.setattr(migrations, "available", lambda: [m for m in shipped if m.version < 16])
    await migrate(before_0016)
    job = await _job(before_0016)
    now = datetime.now(UTC)
    rows = []
    # Finished and open runs over 40 days (one far back), retries sharing their run's slot, request ids.
    for n in range(120):
        slot = now - timedelta(hours=8 * n) if n < 119 else datetime(2019, 5, 4, 3, 2, 1, tzinfo=UTC)
        run = uuid.uuid4()
        open_run = n % 10 == 0
        rows.append((run, run, job, slot, 1, "failed", slot, slot, "w", "t", f"req-{n}" if n % 3 == 0 else None, None))
        retry = uuid.uuid4()
        if open_run:
            rows.append((retry, run, job, slot, 2, "running", slot, None, "w", "t", None, None))
        else:
            rows.append((retry, run, job, slot, 2, "succeeded", slot, slot, "w", "t", None, '{"ok": true}'))
    await before_0016.executemany(_ROW, rows)
    before = [dict(r) for r in await before_0016.fetch("SELECT * FROM job_executions ORDER BY id")]

    monkeypatch.setattr(migrations, "available", lambda: shipped)
    assert await migrate(before_0016) == [m.version for m in shipped if m.version >= 16]

    after = [dict(r) for r in await before_0016.fetch("SELECT * FROM job_executions ORDER BY id")]
    assert after == before
    # One partition per day holding rows, each run's attempts in one of them, none in the default.
    places = await before_0016.fetch(
        "SELECT run_id, array_agg(DISTINCT tableoid::regclass::text) AS parts FROM job_executions GROUP BY run_id"
    )
    assert all(len(row["parts"]) == 1 for row in places)
    days = {row["parts"][0] for row in places}
    assert "job_executions_p20190504" in days
    assert "job_executions_default" not in days
    assert await before_0016.fetchval("SELECT relkind::text FROM pg_class WHERE relname = 'job_executions'") == "p"
    # The request ids made before the conversion are still held by their runs.
    held = await before_0016.fetchval("SELECT count(*) FROM execution_requests")
    assert held == 40
    found = await HistoryRepository(before_0016).get_by_request_id(str(job), "req-33")
    assert found.scheduled_for == rows[2 * 33][3]


async def test_a_slot_has_one_first_attempt_whichever_partition(pool: asyncpg.Pool) -> None:
    job = await _job(pool)
    slot = datetime(2001, 2, 3, 4, 5, 6, tzinfo=UTC)  # no day partition: the default one
    first, second = uuid.uuid4(), uuid.uuid4()
    await pool.execute(_ROW, first, first, job, slot, 1, "failed", slot, slot, "w", "t", None, None)
    with pytest.raises(asyncpg.UniqueViolationError):
        await pool.execute(_ROW, second, second, job, slot, 1, "failed", slot, slot, "w", "t", None, None)
    today = await pool.fetchval("SELECT now()")
    await pool.execute(_ROW, second, second, job, today, 1, "failed", today, today, "w", "t", None, None)
    with pytest.raises(asyncpg.UniqueViolationError):
        await pool.execute(_ROW, first, first, job, today, 1, "failed", today, today, "w", "t", None, None)


async def test_a_request_id_makes_one_run_even_when_retried_on_another_day(pool: asyncpg.Pool) -> None:
    """A retried TriggerJob whose slot (its trigger time) falls on another day finds the first run."""
    job = str(await _job(pool))
    firing = FiringRepository(pool)
    today = (await pool.fetchval("SELECT now()")).astimezone(UTC).date()
    midnight = datetime(today.year, today.month, today.day, tzinfo=UTC) + timedelta(days=1)
    before_midnight, after_midnight = midnight - timedelta(microseconds=1), midnight
    [run] = await firing.trigger(job, Trigger.MANUAL, [before_midnight], request_id="once")
    assert await firing.trigger(job, Trigger.MANUAL, [after_midnight], request_id="once") == []
    found = await HistoryRepository(pool).get_by_request_id(job, "once")
    assert found.id == run.run_id
    assert await pool.fetchval("SELECT count(*) FROM job_executions WHERE request_id = 'once'") == 1
    # The two slots are in two day partitions (the migration made today's and tomorrow's).
    for slot in (before_midnight, after_midnight):
        assert (
            await pool.fetchval(
                "SELECT to_regclass('job_executions_p' || to_char($1 AT TIME ZONE 'UTC', 'YYYYMMDD'))", slot
            )
            is not None
        )


async def test_a_request_id_whose_insert_collided_on_its_slot_is_free_again(pool: asyncpg.Pool) -> None:
    """The claim of a request id whose row was skipped (its slot taken) holds no run: the next try
    with another slot makes the run."""
    job = str(await _job(pool))
    firing = FiringRepository(pool)
    slot = datetime(2026, 3, 1, 12, tzinfo=UTC)
    await firing.trigger(job, Trigger.MANUAL, [slot])
    assert await firing.trigger(job, Trigger.MANUAL, [slot], request_id="r") == []  # the slot collided
    [run] = await firing.trigger(job, Trigger.MANUAL, [slot + timedelta(seconds=1)], request_id="r")
    assert (await HistoryRepository(pool).get_by_request_id(job, "r")).id == run.run_id


async def test_a_backfill_slot_outside_the_created_days_still_inserts(pool: asyncpg.Pool) -> None:
    job = str(await _job(pool))
    far = [datetime(1999, 12, 31, 23, tzinfo=UTC), datetime(2199, 1, 1, tzinfo=UTC)]
    runs = await FiringRepository(pool).trigger(job, Trigger.BACKFILL, far)
    assert len(runs) == 2
    parts = await pool.fetch("SELECT DISTINCT tableoid::regclass::text AS part FROM job_executions")
    assert [row["part"] for row in parts] == ["job_executions_default"]


async def test_a_new_day_partition_takes_its_rows_from_the_default_one(pool: asyncpg.Pool) -> None:
    job = str(await _job(pool))
    slot = datetime(1999, 12, 31, 23, tzinfo=UTC)
    [run] = await FiringRepository(pool).trigger(job, Trigger.BACKFILL, [slot])
    try:
        assert await pool.fetchval("SELECT job_executions_add_partition('1999-12-31')") is True
        assert await pool.fetchval("SELECT job_executions_add_partition('1999-12-31')") is False
        where = await pool.fetchval(
            "SELECT tableoid::regclass::text FROM job_executions WHERE id = $1", uuid.UUID(run.run_id)
        )
        assert where == "job_executions_p19991231"
        assert await pool.fetchval("SELECT count(*) FROM job_executions_default") == 0
    finally:
        await pool.execute("DELETE FROM job_executions; DROP TABLE IF EXISTS job_executions_p19991231")
