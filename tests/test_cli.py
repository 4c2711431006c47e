"""The console script: user errors are one line on stderr and a non-zero exit, never a traceback."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from datetime import timedelta

import asyncpg
import pytest

from scheduler_grpc.db import migrate as migrations
from tests.conftest import ROOT


def run_cli(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {key: value for key, value in os.environ.items() if key not in {"REDIS_URL", "DATABASE_URL"}}
    return subprocess.run(
        [sys.executable, "-m", "scheduler_grpc", *args],
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=ROOT,
    )


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({"DATABASE_URL": "postgresql://nobody:secret@127.0.0.1:1/none"}, "DATABASE_URL"),
        ({"DATABASE_URL": "not a url"}, "DATABASE_URL"),
        ({"DATABASE_URL": "postgresql://x@127.0.0.1:1/y", "SCHEDULER_LEADER_TTL": "-1"}, "SCHEDULER_LEADER_TTL"),
    ],
)
def test_bad_setting_gives_one_clear_line(env: dict[str, str], named: str) -> None:
    result = run_cli("migrate", **env)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert named in lines[0]
    assert "Traceback" not in result.stderr
    assert "secret" not in result.stderr


async def test_migrate_applies_then_is_a_no_op(pool: asyncpg.Pool, database_url: str) -> None:
    fresh = "scheduler_cli_migrate"
    await pool.execute(f'DROP DATABASE IF EXISTS "{fresh}" WITH (FORCE)')
    await pool.execute(f'CREATE DATABASE "{fresh}"')
    url = database_url.rsplit("/", 1)[0] + "/" + fresh
    try:
        first = await asyncio.to_thread(run_cli, "migrate", DATABASE_URL=url)
        assert first.returncode == 0, first.stderr
        assert "migrations applied" in first.stderr, first.stderr
        versions = [migration.version for migration in migrations.available()]
        conn = await asyncpg.connect(url)
        try:
            assert [row["version"] for row in await conn.fetch("SELECT version FROM schema_migrations")] == versions
        finally:
            await conn.close()
        second = await asyncio.to_thread(run_cli, "migrate", DATABASE_URL=url)
        assert second.returncode == 0, second.stderr
        assert "schema is up to date" in second.stderr, second.stderr
        assert "migrations applied" not in second.stderr
    finally:
        await pool.execute(f'DROP DATABASE "{fresh}" WITH (FORCE)')


async def test_shards_set_records_a_change_ahead_and_show_lists_it(pool: asyncpg.Pool, database_url: str) -> None:
    """`scheduler-grpc shards set QUEUE N` (issue 24): the change applies to runs made a lead time later."""
    before = await pool.fetchval("SELECT clock_timestamp()")
    result = await asyncio.to_thread(
        run_cli, "shards", "set", "reports", "3", DATABASE_URL=database_url, SCHEDULER_QUEUE_SHARD_LEAD="5s"
    )
    assert result.returncode == 0, result.stderr
    row = await pool.fetchrow("SELECT effective_at, shards FROM queue_shards WHERE queue = 'reports'")
    assert row["shards"] == 3
    assert row["effective_at"] >= before + timedelta(seconds=5)
    assert "reports: 3 from" in result.stdout
    assert "served: 3" in result.stdout
    bad = await asyncio.to_thread(run_cli, "shards", "set", "reports", "65", DATABASE_URL=database_url)
    assert bad.returncode == 2
    assert "shards" in bad.stderr
    assert "Traceback" not in bad.stderr
