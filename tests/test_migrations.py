"""Migrations: applied once, idempotent, safe under concurrent starts; constraints hold."""

from __future__ import annotations

import asyncio
import re
import uuid
from datetime import UTC, datetime, timedelta

import asyncpg
import pytest

from scheduler_grpc import rules
from scheduler_grpc.db import migrate as migrations
from scheduler_grpc.db.migrate import migrate


async def test_second_run_is_a_no_op(pool: asyncpg.Pool) -> None:
    assert await migrate(pool) == []
    versions = [row["version"] for row in await pool.fetch("SELECT version FROM schema_migrations")]
    assert versions == [migration.version for migration in migrations.available()]


async def test_concurrent_migrations_on_a_fresh_database_apply_each_file_once(
    pool: asyncpg.Pool, database_url: str
) -> None:
    fresh = "scheduler_migrate_race"
    await pool.execute(f'DROP DATABASE IF EXISTS "{fresh}" WITH (FORCE)')
    await pool.execute(f'CREATE DATABASE "{fresh}"')
    url = database_url.rsplit("/", 1)[0] + "/" + fresh
    pools = [await asyncpg.create_pool(url, min_size=1, max_size=1) for _ in range(4)]
    try:
        results = await asyncio.gather(*(migrate(p) for p in pools))
        applied = sorted(version for result in results for version in result)
        assert applied == [migration.version for migration in migrations.available()]
    finally:
        for p in pools:
            await p.close()
        await pool.execute(f'DROP DATABASE "{fresh}" WITH (FORCE)')


async def test_a_failing_migration_rolls_back_alone(
    pool: asyncpg.Pool, database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    fresh = "scheduler_migrate_failure"
    await pool.execute(f'DROP DATABASE IF EXISTS "{fresh}" WITH (FORCE)')
    await pool.execute(f'CREATE DATABASE "{fresh}"')
    url = database_url.rsplit("/", 1)[0] + "/" + fresh
    target = await asyncpg.create_pool(url, min_size=1, max_size=1)
    shipped = migrations.available()
    broken = migrations.Migration(9001, "broken", "CREATE TABLE half_done (id int); SELECT 1 / 0")
    try:
        monkeypatch.setattr(migrations, "available", lambda: [*shipped, broken])
        with pytest.raises(asyncpg.DivisionByZeroError):
            await migrate(target)
        # Every file before the broken one stays applied; the broken one left nothing behind.
        versions = [row["version"] for row in await target.fetch("SELECT version FROM schema_migrations")]
        assert sorted(versions) == [migration.version for migration in shipped]
        assert await target.fetchval("SELECT to_regclass('half_done')") is None
        # The lock was released: a fixed file applies at the next start.
        fixed = migrations.Migration(9001, "fixed", "CREATE TABLE half_done (id int)")
        monkeypatch.setattr(migrations, "available", lambda: [*shipped, fixed])
        assert await asyncio.wait_for(migrate(target), 10) == [9001]
    finally:
        await target.close()
        await pool.execute(f'DROP DATABASE "{fresh}" WITH (FORCE)')


async def test_invalid_job_states_cannot_be_stored(pool: asyncpg.Pool) -> None:
    insert = "INSERT INTO jobs (name, handler, schedule_kind, cron, run_at, priority) VALUES ($1, $2, $3, $4, $5, $6)"
    await pool.execute(insert, "ok", "test.echo", "cron", "* * * * *", None, 0)
    bad_rows = [
        ("cron-without-expression", "test.echo", "cron", None, None, 0),
        ("manual-with-cron", "test.echo", "manual", "* * * * *", None, 0),
        ("too-high", "test.echo", "manual", None, None, 1001),
        ("bad name with spaces", "test.echo", "manual", None, None, 0),
        ("bad-handler", "Not A Handler", "manual", None, None, 0),
    ]
    for row in bad_rows:
        with pytest.raises(asyncpg.CheckViolationError):
            await pool.execute(insert, *row)
    with pytest.raises(asyncpg.UniqueViolationError):
        await pool.execute(insert, "ok", "test.echo", "manual", None, None, 0)


async def test_one_row_per_job_slot_and_attempt(pool: asyncpg.Pool) -> None:
    job_id = await pool.fetchval(
        "INSERT INTO jobs (name, handler, schedule_kind) VALUES ('j', 'test.echo', 'manual') RETURNING id"
    )
    insert = """INSERT INTO job_executions (id, run_id, job_id, scheduled_for, attempt, status, trigger)
                VALUES ($1, $2, $3, '2026-01-01T00:00:00Z', $4, 'queued', $5) ON CONFLICT DO NOTHING RETURNING id"""
    first, second = uuid.uuid4(), uuid.uuid4()
    assert await pool.fetchval(insert, first, first, job_id, 1, "schedule") is not None
    assert await pool.fetchval(insert, second, second, job_id, 1, "schedule") is None
    assert await pool.fetchval(insert, second, first, job_id, 2, "retry") is not None
    with pytest.raises(asyncpg.CheckViolationError):
        await pool.execute(insert, uuid.uuid4(), first, job_id, 1, "manual")
    with pytest.raises(asyncpg.CheckViolationError):
        await pool.execute("UPDATE job_executions SET status = 'succeeded' WHERE job_id = $1 AND attempt = 1", job_id)


async def test_schema_checks_match_the_rules(pool: asyncpg.Pool) -> None:
    """SQL cannot import `scheduler_grpc.rules`: its CHECK constraints must say the same."""
    rows = await pool.fetch(
        """SELECT conrelid::regclass::text AS tbl, pg_get_constraintdef(oid) AS def FROM pg_constraint
           WHERE contype = 'c' AND conrelid::regclass::text IN ('jobs', 'job_executions')"""
    )
    checks = [(row["tbl"], row["def"]) for row in rows]
    # The job's queue, and the queue a run was fired into (its snapshot).
    assert sorted(table for table, d in checks if "queue ~" in d) == ["job_executions", "jobs"]
    # Migration 0009 writes `[class]{1,n}` as `[class]+` and a length bound (cheaper to evaluate).
    match = re.fullmatch(r"(\[.*\])\{1,(\d+)\}", rules.QUEUE_NAME_PATTERN)
    assert match is not None
    queue_check = f"CHECK (((queue ~ '^{match[1]}+$'::text) AND (char_length(queue) <= {match[2]})))"
    assert [d for _, d in checks if "queue ~" in d] == [queue_check, queue_check]
    bounds = f"CHECK (((priority >= '{rules.PRIORITY_MIN}'::integer) AND (priority <= {rules.PRIORITY_MAX})))"
    assert sorted(table for table, d in checks if "priority" in d) == ["job_executions", "jobs"]
    assert [d for _, d in checks if "priority" in d] == [bounds, bounds]


async def test_a_missed_range_is_only_on_missed_rows_and_well_formed(pool: asyncpg.Pool) -> None:
    """Migration 0004: a `missed` row is a range scheduled_for..missed_through of missed_count slots."""
    job_id = await pool.fetchval(
        "INSERT INTO jobs (name, handler, schedule_kind) VALUES ('m', 'test.echo', 'manual') RETURNING id"
    )
    insert = """INSERT INTO job_executions (id, run_id, job_id, scheduled_for, attempt, status, trigger,
                                            finished_at, missed_through, missed_count)
                VALUES ($1, $1, $2, $3, 1, $4, 'schedule', now(), $5, $6)"""
    slot = datetime(2026, 1, 1, tzinfo=UTC)
    later = slot + timedelta(minutes=5)
    await pool.execute(insert, uuid.uuid4(), job_id, slot, "missed", later, 6)
    await pool.execute(insert, uuid.uuid4(), job_id, later, "missed", later, None)  # count unknown
    bad = [
        ("missed", None, None),  # a missed row without its range
        ("skipped", later, 1),  # a range on another status
        ("skipped", None, 1),
        ("missed", later, 0),  # an empty range
        ("missed", slot - timedelta(seconds=1), 1),  # ending before it starts
    ]
    for offset, (status, through, count) in enumerate(bad, start=1):
        with pytest.raises(asyncpg.CheckViolationError):
            await pool.execute(insert, uuid.uuid4(), job_id, later + timedelta(hours=offset), status, through, count)


@pytest.mark.parametrize(
    ("column", "pattern", "values"),
    [
        ("name", r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,199}", ["a", "a" * 200, "a" * 201, "-a", "a b", "a\n", "x:y-z.1_"]),
        ("handler", r"[a-z][a-z0-9_.-]{0,99}", ["test.echo", "a" * 100, "a" * 101, "A", "1a", "a\n", "a-b_c.d"]),
        ("queue", r"[A-Za-z0-9_.-]{1,64}", ["", "q" * 64, "q" * 65, "a b", "a\n", "Q-1_.x"]),
    ],
)
async def test_the_cheaper_name_checks_accept_exactly_what_the_patterns_did(
    pool: asyncpg.Pool, column: str, pattern: str, values: list[str]
) -> None:
    """Migration 0009 rewrote `[c]{0,n}` checks (slow in PostgreSQL's regex engine) as `[c]*` plus a
    length bound: the same strings are accepted, in jobs and in the execution snapshot."""
    for i, value in enumerate(values):
        row = {"name": f"n{i}", "handler": "test.echo", "queue": "default"} | {column: value}
        insert = "INSERT INTO jobs (name, handler, queue, schedule_kind) VALUES ($1, $2, $3, 'manual') RETURNING id"
        if re.fullmatch(pattern, value):
            job_id = await pool.fetchval(insert, row["name"], row["handler"], row["queue"])
        else:
            with pytest.raises(asyncpg.CheckViolationError):
                await pool.execute(insert, row["name"], row["handler"], row["queue"])
            continue
        if column == "name":
            continue
        snapshot = f"""INSERT INTO job_executions (id, run_id, job_id, scheduled_for, status, trigger, {column})
                       VALUES ($1, $1, $2, now(), 'queued', 'manual', $3)"""
        await pool.execute(snapshot, uuid.uuid4(), job_id, value)
    bad = {"handler": "A" * 2, "queue": "q" * 65}.get(column)
    if bad is not None:
        job_id = await pool.fetchval("SELECT id FROM jobs LIMIT 1")
        with pytest.raises(asyncpg.CheckViolationError):
            await pool.execute(
                f"""INSERT INTO job_executions (id, run_id, job_id, scheduled_for, status, trigger, {column})
                    VALUES ($1, $1, $2, now(), 'queued', 'manual', $3)""",
                uuid.uuid4(),
                job_id,
                bad,
            )
