"""`job_executions` partitioned by day (migration 0016): the conversion keeps every row, the
uniqueness the guarantees rest on stays enforced by PostgreSQL across partitions, and a slot no day
partition covers still inserts."""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, date, datetime, timedelta
from pathlib import Path

import asyncpg
import pytest
import redis.asyncio as aioredis

from scheduler_grpc.db import migrate as migrations
from scheduler_grpc.db.firing import FiringRepository
from scheduler_grpc.db.history import HistoryRepository
from scheduler_grpc.db.leadership import LeadershipRepository
from scheduler_grpc.db.migrate import migrate
from scheduler_grpc.db.partitions import PartitionRepository, partition_name
from scheduler_grpc.errors import Fenced
from scheduler_grpc.executions import Trigger
from scheduler_grpc.leader import Term
from scheduler_grpc.scheduler import LeaderLoops, LoopSettings

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


# -- maintenance and retention (db/partitions.py) ----------------------------------------------------


@pytest.fixture
async def old_day(pool: asyncpg.Pool) -> AsyncIterator[date]:
    """A day partition 40 days back, dropped after the test if retention left it."""
    today = (await pool.fetchval("SELECT now()")).astimezone(UTC).date()
    day = today - timedelta(days=40)
    await pool.fetchval("SELECT job_executions_add_partition($1)", day)
    try:
        yield day
    finally:
        await pool.execute("DELETE FROM job_executions WHERE scheduled_for < now() - interval '39 days'")
        await pool.execute(f'DROP TABLE IF EXISTS "{partition_name(day)}"')


async def _run_on(pool: asyncpg.Pool, job: uuid.UUID, day: date, status: str, request_id: str | None = None) -> str:
    slot = datetime(day.year, day.month, day.day, 12, tzinfo=UTC) + timedelta(seconds=await pool.fetchval(
        "SELECT count(*) FROM job_executions"))  # fmt: skip
    run = uuid.uuid4()
    finished = None if status in ("queued", "running") else slot
    started = None if status == "queued" else slot
    worker = None if status == "queued" else "w"
    await pool.execute(_ROW, run, run, job, slot, 1, status, started, finished, worker, "t", request_id, None)
    return str(run)


async def _exists(pool: asyncpg.Pool, day: date) -> bool:
    return bool(await pool.fetchval("SELECT to_regclass($1) IS NOT NULL", partition_name(day)))


async def test_retention_drops_a_day_past_it_with_its_request_ids(pool: asyncpg.Pool, old_day: date) -> None:
    job = await _job(pool)
    runs = [await _run_on(pool, job, old_day, "succeeded", request_id="r1"), await _run_on(pool, job, old_day, "dead")]
    recent = await _run_on(pool, job, old_day + timedelta(days=40), "succeeded")  # today: kept
    done = await PartitionRepository(pool).drop_before(datetime.now(UTC) - timedelta(days=30))
    assert old_day in done.dropped
    assert done.executions >= 2
    assert not await _exists(pool, old_day)
    left = {str(row["id"]) for row in await pool.fetch("SELECT id FROM job_executions")}
    assert recent in left
    assert not left & set(runs)
    assert await pool.fetchval("SELECT count(*) FROM execution_requests") == 0
    # The cleanup handler's path drops days too (nothing left to drop here).
    assert await HistoryRepository(pool).prune(datetime.now(UTC) - timedelta(days=30)) == 0


async def test_a_run_still_open_in_an_old_day_survives_retention(pool: asyncpg.Pool, old_day: date) -> None:
    job = await _job(pool)
    done_run = await _run_on(pool, job, old_day, "succeeded")
    open_run = await _run_on(pool, job, old_day, "running")
    partitions = PartitionRepository(pool)
    done = await partitions.drop_before(datetime.now(UTC) - timedelta(days=30))
    assert old_day in done.kept_open
    assert old_day not in done.dropped
    assert await _exists(pool, old_day)
    left = {str(row["id"]) for row in await pool.fetch("SELECT id FROM job_executions")}
    assert {done_run, open_run} <= left
    # Once the run ends, the next pass drops the day.
    await pool.execute(
        "UPDATE job_executions SET status = 'succeeded', finished_at = now() WHERE id = $1", uuid.UUID(open_run)
    )
    assert old_day in (await partitions.drop_before(datetime.now(UTC) - timedelta(days=30))).dropped
    assert not await _exists(pool, old_day)


async def test_a_day_found_open_once_detached_is_attached_again(pool: asyncpg.Pool, old_day: date) -> None:
    """The test under the detach's lock (what a run made between the unlocked test and the lock
    would meet): the day is kept, attached as before, with its rows."""
    job = await _job(pool)
    queued = await _run_on(pool, job, old_day, "queued")
    assert await PartitionRepository(pool)._drop(old_day, None) is None
    where = await pool.fetchval("SELECT tableoid::regclass::text FROM job_executions WHERE id = $1", uuid.UUID(queued))
    assert where == partition_name(old_day)


async def test_a_days_drop_holds_no_lock_on_job_executions(pool: asyncpg.Pool, old_day: date) -> None:
    """The hot path never waits for a day's files to go: a DROP's commit removes them (half a second
    for 3.3 million rows, bench/history_bench.py), and a plain DETACH locks `job_executions` itself
    until its transaction ends. An event trigger records, inside the DROP's own transaction, the
    locks that transaction holds on `job_executions`."""
    job = await _job(pool)
    await _run_on(pool, job, old_day, "succeeded")
    await pool.execute("""
        CREATE TABLE drop_locks (mode text);
        CREATE FUNCTION record_drop_locks() RETURNS event_trigger LANGUAGE plpgsql AS $$
        BEGIN
            INSERT INTO drop_locks SELECT coalesce(string_agg(mode, ','), '') FROM pg_locks
             WHERE pid = pg_backend_pid() AND relation = 'job_executions'::regclass;
        END $$;
        CREATE EVENT TRIGGER record_drop_locks ON sql_drop EXECUTE FUNCTION record_drop_locks();
    """)  # fmt: skip
    try:
        done = await PartitionRepository(pool).drop_before(datetime.now(UTC) - timedelta(days=30))
        assert old_day in done.dropped
        assert done.executions == 1
        assert [row["mode"] for row in await pool.fetch("SELECT mode FROM drop_locks")] == [""]
    finally:
        await pool.execute("""
            DROP EVENT TRIGGER record_drop_locks; DROP FUNCTION record_drop_locks(); DROP TABLE drop_locks
        """)  # fmt: skip


async def test_a_day_detached_but_not_dropped_is_dropped_by_the_next_pass(pool: asyncpg.Pool, old_day: date) -> None:
    """What a crash between the detach's commit and the drop leaves: a day table no longer attached."""
    job = await _job(pool)
    await _run_on(pool, job, old_day, "succeeded")
    await pool.execute(f'ALTER TABLE job_executions DETACH PARTITION "{partition_name(old_day)}"')
    await PartitionRepository(pool).drop_before(datetime.now(UTC) - timedelta(days=30))
    assert not await _exists(pool, old_day)


async def test_a_day_whose_lock_is_busy_is_left_for_the_next_round(pool: asyncpg.Pool, old_day: date) -> None:
    job = await _job(pool)
    await _run_on(pool, job, old_day, "succeeded")
    partitions = PartitionRepository(pool, lock_timeout=timedelta(milliseconds=50))
    async with pool.acquire() as reader, reader.transaction():
        await reader.execute(f'LOCK TABLE "{partition_name(old_day)}" IN ACCESS SHARE MODE')
        done = await partitions.drop_before(datetime.now(UTC) - timedelta(days=30))
        assert old_day in done.busy
    assert await _exists(pool, old_day)
    assert old_day in (await partitions.drop_before(datetime.now(UTC) - timedelta(days=30))).dropped


async def test_days_are_created_ahead_idempotently_and_only_under_the_current_term(pool: asyncpg.Pool) -> None:
    partitions = PartitionRepository(pool)
    today = (await pool.fetchval("SELECT now()")).astimezone(UTC).date()
    await pool.execute("INSERT INTO leader_state (scope, term, holder) VALUES ('scheduler', 7, 'me')")
    far = today + timedelta(days=9)
    with pytest.raises(Fenced):
        await partitions.create_ahead(9, term=6)
    assert not await _exists(pool, far)
    created = await partitions.create_ahead(9, term=7)
    assert far in created
    assert await partitions.create_ahead(9, term=7) == []
    assert {today + timedelta(days=n) for n in range(10)} <= set(await partitions.days())
    for day in created:
        await pool.execute(f'DROP TABLE "{partition_name(day)}"')


async def test_the_leader_creates_days_ahead_and_drops_days_past_the_retention(
    pool: asyncpg.Pool, redis: aioredis.Redis, old_day: date
) -> None:
    job = await _job(pool)
    older = old_day - timedelta(days=1)
    await pool.fetchval("SELECT job_executions_add_partition($1)", older)
    try:
        await _run_on(pool, job, older, "succeeded")
        still_open = await _run_on(pool, job, old_day, "queued")
        record = await LeadershipRepository(pool).begin_term("scheduler", "test")
        assert record is not None
        term = Term(token=record.term, holder=record.holder, lease_id="test:x",
                    acquired_at=record.acquired_at, scope=record.scope)  # fmt: skip
        term._renewed(time.monotonic(), time.monotonic() + 60)
        loops = LeaderLoops(redis, pool, LoopSettings(execution_retention_days=30, execution_partitions_ahead=5))
        await loops.maintain_partitions(term)
        days = await PartitionRepository(pool).days()
        today = (await pool.fetchval("SELECT now()")).astimezone(UTC).date()
        assert {today + timedelta(days=n) for n in range(6)} <= set(days)
        assert older not in days  # past the retention, finished: dropped
        assert old_day in days  # past the retention, but a run is open in it
        assert await pool.fetchval("SELECT count(*) FROM job_executions WHERE id = $1", uuid.UUID(still_open)) == 1
    finally:
        await pool.execute(f'DROP TABLE IF EXISTS "{partition_name(older)}"')


def test_no_statement_deletes_executions() -> None:
    """Retention drops whole days: no code path deletes rows of job_executions."""
    root = Path(__file__).resolve().parent.parent / "scheduler_grpc"
    pattern = re.compile(r"DELETE\s+FROM\s+job_executions\b", re.IGNORECASE)
    found = [
        str(path) for path in root.rglob("*") if path.suffix in {".py", ".sql"} and pattern.search(path.read_text())
    ]
    assert found == []
