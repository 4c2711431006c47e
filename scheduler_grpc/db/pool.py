"""The asyncpg pool, created inside the running loop with bounded waits."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from urllib.parse import urlsplit

import asyncpg
import orjson

from scheduler_grpc.errors import ConfigError

Pool = asyncpg.Pool


async def ping(pool: Pool) -> None:
    """Ask PostgreSQL for a trivial answer (health checks).

    Raises:
        asyncpg.PostgresError, OSError: PostgreSQL did not answer.
    """
    await pool.fetchval("SELECT 1")


def _redacted(url: str) -> str:
    parts = urlsplit(url)
    host = parts.hostname or "?"
    return f"{parts.scheme}://{host}:{parts.port or 5432}{parts.path}"


async def _init_connection(conn: asyncpg.Connection) -> None:
    # jsonb as Python objects via orjson, both ways.
    await conn.set_type_codec(
        "jsonb",
        encoder=lambda value: orjson.dumps(value).decode(),
        decoder=orjson.loads,
        schema="pg_catalog",
    )


async def _keep_session(conn: asyncpg.Connection) -> None:
    """The pool's reset of a released connection when sessions are not reset (`session_reset=False`):
    nothing beyond what asyncpg always does (roll back an open transaction, drop listener callbacks)."""


async def create_pool(
    database_url: str, *, size: int, connect_timeout: timedelta, session_reset: bool = True
) -> asyncpg.Pool:
    """Open a pool and prove the server answers.

    Args:
        database_url: The PostgreSQL URL.
        size: Most connections open at once.
        connect_timeout: Bound on connecting (and on the first answer).
        session_reset: Whether each released connection has its session reset (asyncpg's default
            `SELECT pg_advisory_unlock_all(); CLOSE ALL; UNLISTEN *; RESET ALL`: one more round trip
            per release). Only a process whose code never leaves session state on a pooled connection
            may turn it off (see `connections.connect`).

    Raises:
        ConfigError: the server cannot be reached or refuses us (names DATABASE_URL).
    """
    seconds = connect_timeout.total_seconds()
    try:
        pool = await asyncio.wait_for(
            asyncpg.create_pool(
                database_url,
                min_size=1,
                max_size=size,
                timeout=seconds,
                command_timeout=max(seconds, 30.0),
                init=_init_connection,
                reset=None if session_reset else _keep_session,
            ),
            timeout=seconds * 2,
        )
    except (OSError, TimeoutError, asyncpg.PostgresError, asyncpg.InterfaceError, ValueError) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ConfigError(
            f"DATABASE_URL ({_redacted(database_url)}) cannot be reached: {reason}; "
            "check the URL and that PostgreSQL is running"
        ) from None
    assert pool is not None
    return pool
