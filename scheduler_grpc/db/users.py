"""People who log in: the `users` table (argon2id password hashes, one role each).

Roles travel as their names (`viewer`, `operator`, `admin`); `scheduler_grpc.auth` owns their meaning.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from datetime import datetime, timedelta

import asyncpg

_COLUMNS = "id, username, password_hash, role, disabled, created_at, updated_at"
_DEFAULT_TIMEOUT = timedelta(seconds=5)


@dataclass(frozen=True)
class User:
    """A row of `users`.

    Attributes:
        id: Server-assigned id.
        username: Unique login name.
        password_hash: The argon2id hash (PHC string) of the password.
        role: `viewer`, `operator` or `admin`.
        disabled: A disabled user cannot log in.
        created_at: When the row was created.
        updated_at: When the row last changed.
    """

    id: str
    username: str
    password_hash: str
    role: str
    disabled: bool
    created_at: datetime
    updated_at: datetime


def _user(row: asyncpg.Record) -> User:
    return User(
        id=str(row["id"]),
        username=row["username"],
        password_hash=row["password_hash"],
        role=row["role"],
        disabled=row["disabled"],
        created_at=row["created_at"],
        updated_at=row["updated_at"],
    )


class UserRepository:
    """Reads and writes `users`; every call is bounded by `timeout` (pool wait included).

    Args:
        pool: The process's asyncpg pool.
        timeout: Bound on each call.
    """

    def __init__(self, pool: asyncpg.Pool, *, timeout: timedelta = _DEFAULT_TIMEOUT) -> None:
        self._pool = pool
        self._timeout = timeout.total_seconds()

    async def get_by_username(self, username: str) -> User | None:
        """The user named `username`, or None."""
        async with asyncio.timeout(self._timeout):
            row = await self._pool.fetchrow(f"SELECT {_COLUMNS} FROM users WHERE username = $1", username)
        return None if row is None else _user(row)

    async def upsert(self, username: str, password_hash: str, role: str) -> User:
        """Create the user, or set the password hash and role of an existing one (and enable it)."""
        async with asyncio.timeout(self._timeout):
            row = await self._pool.fetchrow(
                f"""INSERT INTO users (username, password_hash, role) VALUES ($1, $2, $3)
                    ON CONFLICT (username) DO UPDATE
                        SET password_hash = EXCLUDED.password_hash, role = EXCLUDED.role, disabled = false,
                            updated_at = now()
                    RETURNING {_COLUMNS}""",
                username,
                password_hash,
                role,
            )
        assert row is not None  # an upsert always returns its row
        return _user(row)

    async def set_role(self, user_id: str, role: str) -> None:
        """Change a user's role and enable the user (the start-up admin keeps its hash)."""
        async with asyncio.timeout(self._timeout):
            await self._pool.execute(
                "UPDATE users SET role = $2, disabled = false, updated_at = now() WHERE id = $1::uuid",
                user_id,
                role,
            )

    async def set_password_hash(self, user_id: str, password_hash: str) -> None:
        """Replace a user's password hash (a rehash with stronger parameters, or a new password)."""
        async with asyncio.timeout(self._timeout):
            await self._pool.execute(
                "UPDATE users SET password_hash = $2, updated_at = now() WHERE id = $1::uuid",
                user_id,
                password_hash,
            )
