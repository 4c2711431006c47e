"""Versioned schema migrations.

Files `migrations/NNNN_name.sql` are applied in order, each in its own transaction together with
its row in `schema_migrations`: a failing file rolls back alone, the files before it stay applied,
and the next start resumes at the failed one. A session-level advisory lock, held across the files,
serialises concurrent starts (every role migrates at start-up), so the second process waits and then
finds nothing to do.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from importlib import resources

import asyncpg

log = logging.getLogger(__name__)

# Arbitrary, fixed: identifies "scheduler-grpc schema migration" among advisory locks.
_ADVISORY_LOCK_ID = 0x5C4ED_0001
_FILE = re.compile(r"^(\d{4})_([a-z0-9_]+)\.sql$")


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    sql: str


def available() -> list[Migration]:
    """The migrations shipped with the package, in version order."""
    found = []
    for entry in resources.files("scheduler_grpc.db").joinpath("migrations").iterdir():
        match = _FILE.match(entry.name)
        if match:
            found.append(Migration(int(match.group(1)), match.group(2), entry.read_text()))
    found.sort(key=lambda migration: migration.version)
    versions = [migration.version for migration in found]
    if len(set(versions)) != len(versions):
        raise RuntimeError(f"duplicate migration versions: {versions}")
    return found


async def migrate(pool: asyncpg.Pool) -> list[int]:
    """Apply every pending migration; return the versions applied by this call.

    Raises:
        asyncpg.PostgresError: a migration failed (it is rolled back; the ones before it stay applied).
    """
    applied_now: list[int] = []
    async with pool.acquire() as conn:
        await conn.execute("SELECT pg_advisory_lock($1)", _ADVISORY_LOCK_ID)
        try:
            await conn.execute(
                """CREATE TABLE IF NOT EXISTS schema_migrations (
                       version    integer PRIMARY KEY,
                       name       text NOT NULL,
                       applied_at timestamptz NOT NULL DEFAULT now())"""
            )
            done = {row["version"] for row in await conn.fetch("SELECT version FROM schema_migrations")}
            for migration in available():
                if migration.version in done:
                    continue
                async with conn.transaction():
                    await conn.execute(migration.sql)
                    await conn.execute(
                        "INSERT INTO schema_migrations (version, name) VALUES ($1, $2)",
                        migration.version,
                        migration.name,
                    )
                log.info("applied migration", extra={"version": migration.version, "migration": migration.name})
                applied_now.append(migration.version)
        finally:
            # Also released by the pool when it resets the connection, or by the server if it broke.
            await conn.execute("SELECT pg_advisory_unlock($1)", _ADVISORY_LOCK_ID)
    return applied_now
