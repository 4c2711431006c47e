"""People who log in: the `users` table (argon2id password hashes, one role each).

Roles travel as their names (`viewer`, `operator`, `admin`); `scheduler_grpc.auth` owns their meaning.

Every change an administrator makes raises the row's `version` (the user's etag). A change that
would leave no enabled admin (demoting, disabling or deleting the last one) is refused with
`LastAdmin`: such changes take one transaction-level advisory lock first, so two administrators
demoting each other at once cannot both succeed.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Final

import asyncpg

from scheduler_grpc.db import keyset
from scheduler_grpc.errors import Aborted, AlreadyExists, FailedPrecondition, InvalidArgument, NotFound

_COLUMNS: Final = "id, username, password_hash, role, disabled, created_at, updated_at, version"
_DEFAULT_TIMEOUT: Final = timedelta(seconds=5)
# Arbitrary, fixed: identifies "a change to the set of enabled admins" among advisory locks.
_ADMINS_LOCK: Final = 0x5C4ED_0A11
_ADMIN: Final = "admin"


class LastAdmin(FailedPrecondition):
    """The change would leave no enabled admin."""


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
        version: Raised by every change an administrator makes (the etag).
    """

    id: str
    username: str
    password_hash: str
    role: str
    disabled: bool
    created_at: datetime
    updated_at: datetime
    version: int = 1

    @property
    def etag(self) -> str:
        """The version as an etag (the same weak form as a job's)."""
        return f'W/"{self.version}"'

    @property
    def active_admin(self) -> bool:
        return self.role == _ADMIN and not self.disabled


@dataclass(frozen=True)
class UserPage:
    """One page of users, by username."""

    users: list[User]
    next_page_token: str


def _user(row: asyncpg.Record) -> User:
    return User(
        id=str(row["id"]),
        username=row["username"],
        password_hash=row["password_hash"],
        role=row["role"],
        disabled=row["disabled"],
        created_at=row["created_at"],
        updated_at=row["updated_at"],
        version=row["version"],
    )


def _user_id(value: str, field: str = "id") -> uuid.UUID:
    try:
        return uuid.UUID(value)
    except (ValueError, AttributeError, TypeError):
        raise InvalidArgument(field, f"{value[:40]!r} is not a valid id") from None


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

    async def find(self, user_id: str) -> User | None:
        """The user with this id, or None (also for an id that is no UUID)."""
        try:
            parsed = uuid.UUID(user_id)
        except ValueError:
            return None
        async with asyncio.timeout(self._timeout):
            row = await self._pool.fetchrow(f"SELECT {_COLUMNS} FROM users WHERE id = $1", parsed)
        return None if row is None else _user(row)

    async def get(self, user_id: str) -> User:
        """The user with this id.

        Raises:
            InvalidArgument: `user_id` is not a UUID.
            NotFound: no such user.
        """
        parsed = _user_id(user_id)
        user = await self.find(str(parsed))
        if user is None:
            raise NotFound(f"user {user_id} not found")
        return user

    async def list_page(self, page_size: int = 0, page_token: str = "") -> UserPage:
        """Users by username (disabled ones included).

        Raises:
            InvalidArgument: `page_size` out of range or a `page_token` this server did not issue.
        """
        users, token = await keyset.page_by_name(
            self._pool,
            self._timeout,
            kind="users",
            select=f"SELECT {_COLUMNS} FROM users",
            column="username",
            page_size=page_size,
            page_token=page_token,
            item=_user,
            name_of=lambda found: found.username,
        )
        return UserPage(users, token)

    async def create(self, username: str, password_hash: str, role: str, request_id: str | None = None) -> User:
        """Store a new user; with a `request_id` seen before, return the user that request created.

        Raises:
            AlreadyExists: another user has this username.
            Aborted: the user this `request_id` created was deleted meanwhile.
        """
        try:
            async with asyncio.timeout(self._timeout):
                row = await self._pool.fetchrow(
                    f"""INSERT INTO users (username, password_hash, role, request_id) VALUES ($1, $2, $3, $4)
                        ON CONFLICT (request_id) DO NOTHING RETURNING {_COLUMNS}""",
                    username,
                    password_hash,
                    role,
                    request_id,
                )
        except asyncpg.UniqueViolationError:
            # A retry racing the first call can trip over the username first: then the user of
            # this request_id is the answer.
            taken = await self._by_request_id(request_id) if request_id is not None else None
            if taken is None:
                raise AlreadyExists(f"username: a user named {username!r} already exists") from None
            return taken
        if row is None:  # the request_id was used before: same request, same answer
            taken = await self._by_request_id(request_id) if request_id is not None else None
            if taken is None:
                raise Aborted("request_id: the user created by this request was deleted meanwhile")
            return taken
        return _user(row)

    async def _by_request_id(self, request_id: str) -> User | None:
        async with asyncio.timeout(self._timeout):
            row = await self._pool.fetchrow(f"SELECT {_COLUMNS} FROM users WHERE request_id = $1", request_id)
        return None if row is None else _user(row)

    async def change(
        self,
        user_id: str,
        *,
        role: str | None = None,
        disabled: bool | None = None,
        password_hash: str | None = None,
        expected_version: int | None = None,
    ) -> User:
        """Apply an administrator's change (the given fields) and raise the version.

        Raises:
            InvalidArgument: `user_id` is not a UUID.
            NotFound: no such user.
            Aborted: the user is not at `expected_version` (a stale etag).
            LastAdmin: the change would leave no enabled admin.
        """
        parsed = _user_id(user_id)
        async with asyncio.timeout(self._timeout), self._pool.acquire() as conn, conn.transaction():
            current = await self._locked(conn, parsed, user_id, expected_version)
            after_role = current.role if role is None else role
            after_disabled = current.disabled if disabled is None else disabled
            if current.active_admin and not (after_role == _ADMIN and not after_disabled):
                await self._keep_an_admin(conn, parsed, current)
            row = await conn.fetchrow(
                f"""UPDATE users SET role = $2, disabled = $3, password_hash = coalesce($4, password_hash),
                        version = version + 1, updated_at = now()
                    WHERE id = $1 RETURNING {_COLUMNS}""",
                parsed,
                after_role,
                after_disabled,
                password_hash,
            )
        assert row is not None  # the row is locked by this transaction
        return _user(row)

    async def delete(self, user_id: str, *, expected_version: int | None = None) -> User:
        """Delete a user (API keys it created stay, without their creator); returns the row as it was.

        Raises:
            InvalidArgument: `user_id` is not a UUID.
            NotFound: no such user.
            Aborted: the user is not at `expected_version` (a stale etag).
            LastAdmin: it is the last enabled admin.
        """
        parsed = _user_id(user_id)
        async with asyncio.timeout(self._timeout), self._pool.acquire() as conn, conn.transaction():
            current = await self._locked(conn, parsed, user_id, expected_version)
            if current.active_admin:
                await self._keep_an_admin(conn, parsed, current)
            await conn.execute("DELETE FROM users WHERE id = $1", parsed)
        return current

    async def _locked(self, conn: Any, parsed: uuid.UUID, user_id: str, expected_version: int | None) -> User:
        """The row, locked for this transaction, at `expected_version` if given."""
        row = await conn.fetchrow(f"SELECT {_COLUMNS} FROM users WHERE id = $1 FOR UPDATE", parsed)
        if row is None:
            raise NotFound(f"user {user_id} not found")
        current = _user(row)
        if expected_version is not None and current.version != expected_version:
            raise Aborted(f"etag: user changed meanwhile (now {current.etag}); read it again and retry")
        return current

    async def _keep_an_admin(self, conn: Any, parsed: uuid.UUID, current: User) -> None:
        """Refuse to remove `current`'s admin rights if no other enabled admin would remain.

        The lock serialises every such change, so the count cannot be stale: two admins demoting
        each other at once are decided one after the other.
        """
        await conn.execute("SELECT pg_advisory_xact_lock($1)", _ADMINS_LOCK)
        others = await conn.fetchval(
            "SELECT count(*) FROM users WHERE role = 'admin' AND NOT disabled AND id <> $1", parsed
        )
        if not others:
            raise LastAdmin(f"{current.username!r} is the last enabled admin: make another user admin first")

    async def upsert(self, username: str, password_hash: str, role: str) -> User:
        """Create the user, or set the password hash and role of an existing one (and enable it)."""
        async with asyncio.timeout(self._timeout):
            row = await self._pool.fetchrow(
                f"""INSERT INTO users (username, password_hash, role) VALUES ($1, $2, $3)
                    ON CONFLICT (username) DO UPDATE
                        SET password_hash = EXCLUDED.password_hash, role = EXCLUDED.role, disabled = false,
                            version = users.version + 1, updated_at = now()
                    RETURNING {_COLUMNS}""",
                username,
                password_hash,
                role,
            )
        assert row is not None  # an upsert always returns its row
        return _user(row)

    async def set_role(self, user_id: str, role: str) -> User:
        """Change a user's role and enable the user (the start-up admin keeps its hash)."""
        async with asyncio.timeout(self._timeout):
            row = await self._pool.fetchrow(
                f"""UPDATE users SET role = $2, disabled = false, version = version + 1, updated_at = now()
                    WHERE id = $1::uuid RETURNING {_COLUMNS}""",
                user_id,
                role,
            )
        if row is None:
            raise NotFound(f"user {user_id} not found")
        return _user(row)

    async def set_password_hash(self, user_id: str, password_hash: str) -> None:
        """Replace a user's password hash with a rehash of the same password (stronger parameters).

        Not a change of the user: the version (and so the etag and the sessions) stay.
        """
        async with asyncio.timeout(self._timeout):
            await self._pool.execute(
                "UPDATE users SET password_hash = $2, updated_at = now() WHERE id = $1::uuid",
                user_id,
                password_hash,
            )
