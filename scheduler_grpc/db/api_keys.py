"""API keys for services: the `api_keys` table, holding only the SHA-256 of each key."""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta

import asyncpg

from scheduler_grpc import pagetokens
from scheduler_grpc.errors import InvalidArgument, NotFound

_COLUMNS = "id, name, key_prefix, role, created_by, created_at, expires_at, revoked_at, last_used_at"
_DEFAULT_TIMEOUT = timedelta(seconds=5)
MAX_PAGE_SIZE = 1000
DEFAULT_PAGE_SIZE = 100
# `last_used_at` is a hint for people, not an audit log: writing it on every call would turn each
# authenticated read into a write, so it is refreshed at most this often.
LAST_USE_RESOLUTION = timedelta(minutes=1)


@dataclass(frozen=True)
class ApiKeyRecord:
    """A row of `api_keys` without its hash.

    Attributes:
        id: Server-assigned id.
        name: The display name.
        key_prefix: The first characters of the key, to tell keys apart.
        role: `viewer`, `operator` or `admin`.
        created_by: The user who created it (None once that user is deleted, or for keys made by keys).
        created_at: When it was created.
        expires_at: When it stops working, if ever.
        revoked_at: When it was revoked, if it was.
        last_used_at: When it was last used (to within `LAST_USE_RESOLUTION`).
    """

    id: str
    name: str
    key_prefix: str
    role: str
    created_by: str | None
    created_at: datetime
    expires_at: datetime | None
    revoked_at: datetime | None
    last_used_at: datetime | None


@dataclass(frozen=True)
class ApiKeyPage:
    keys: list[ApiKeyRecord]
    next_page_token: str


def _record(row: asyncpg.Record) -> ApiKeyRecord:
    return ApiKeyRecord(
        id=str(row["id"]),
        name=row["name"],
        key_prefix=row["key_prefix"],
        role=row["role"],
        created_by=str(row["created_by"]) if row["created_by"] else None,
        created_at=row["created_at"],
        expires_at=row["expires_at"],
        revoked_at=row["revoked_at"],
        last_used_at=row["last_used_at"],
    )


def _key_id(value: str, field: str = "id") -> uuid.UUID:
    try:
        return uuid.UUID(value)
    except (ValueError, AttributeError, TypeError):
        raise InvalidArgument(field, f"{value!r} is not a valid id") from None


def _encode_token(created_at: datetime, key_id: str) -> str:
    return pagetokens.encode("api_keys", {}, [created_at.isoformat(), key_id])


def _decode_token(token: str) -> tuple[datetime, uuid.UUID]:
    position = pagetokens.decode(token, "api_keys", {})
    try:
        stamp, key_id = position
        moment, key = datetime.fromisoformat(stamp), uuid.UUID(key_id)
    except (ValueError, TypeError, AttributeError):
        raise InvalidArgument("page_token", "not a token this server issued") from None
    if moment.tzinfo is None:  # every issued position is aware
        raise InvalidArgument("page_token", "not a token this server issued")
    return moment, key


class ApiKeyRepository:
    """Creates, finds, lists and revokes API keys; every call is bounded by `timeout`.

    Args:
        pool: The process's asyncpg pool.
        timeout: Bound on each call (pool wait included).
    """

    def __init__(self, pool: asyncpg.Pool, *, timeout: timedelta = _DEFAULT_TIMEOUT) -> None:
        self._pool = pool
        self._timeout = timeout.total_seconds()

    async def create(
        self,
        *,
        name: str,
        key_hash: bytes,
        key_prefix: str,
        role: str,
        created_by: str | None,
        expires_at: datetime | None,
    ) -> ApiKeyRecord:
        """Store a new key (its hash only)."""
        async with asyncio.timeout(self._timeout):
            row = await self._pool.fetchrow(
                f"""INSERT INTO api_keys (name, key_hash, key_prefix, role, created_by, expires_at)
                    VALUES ($1, $2, $3, $4, $5, $6) RETURNING {_COLUMNS}""",
                name,
                key_hash,
                key_prefix,
                role,
                uuid.UUID(created_by) if created_by else None,
                expires_at,
            )
        assert row is not None  # an INSERT ... RETURNING returns its row
        return _record(row)

    async def find_active(self, key_hash: bytes) -> ApiKeyRecord | None:
        """The key with this hash if it is neither revoked nor expired; notes its use.

        One statement: the lookup (by the unique index on `key_hash`) and, at most once per
        `LAST_USE_RESOLUTION`, the `last_used_at` refresh.
        """
        async with asyncio.timeout(self._timeout):
            row = await self._pool.fetchrow(
                f"""WITH found AS (
                        SELECT {_COLUMNS} FROM api_keys
                        WHERE key_hash = $1 AND revoked_at IS NULL AND (expires_at IS NULL OR expires_at > now())
                    ), touched AS (
                        UPDATE api_keys k SET last_used_at = now() FROM found
                        WHERE k.id = found.id
                          AND (found.last_used_at IS NULL OR found.last_used_at < now() - $2::interval)
                    )
                    SELECT * FROM found""",
                key_hash,
                LAST_USE_RESOLUTION,
            )
        return None if row is None else _record(row)

    async def list_page(self, page_size: int = 0, page_token: str = "") -> ApiKeyPage:
        """Keys newest first (revoked and expired ones included).

        Raises:
            InvalidArgument: `page_size` out of range or a `page_token` this server did not issue.
        """
        if not 0 <= page_size <= MAX_PAGE_SIZE:
            raise InvalidArgument("page_size", f"must be between 0 and {MAX_PAGE_SIZE}")
        size = page_size or DEFAULT_PAGE_SIZE
        after_time, after_id = _decode_token(page_token) if page_token else (None, None)
        async with asyncio.timeout(self._timeout):
            rows = await self._pool.fetch(
                f"""SELECT {_COLUMNS} FROM api_keys
                    WHERE $1::timestamptz IS NULL OR (created_at, id) < ($1, $2::uuid)
                    ORDER BY created_at DESC, id DESC LIMIT $3""",
                after_time,
                after_id,
                size + 1,
            )
        keys = [_record(row) for row in rows[:size]]
        token = _encode_token(keys[-1].created_at, keys[-1].id) if len(rows) > size else ""
        return ApiKeyPage(keys, token)

    async def revoke(self, key_id: str) -> ApiKeyRecord:
        """Revoke a key at once (revoking it again keeps the first revocation time).

        Raises:
            InvalidArgument: `key_id` is not a UUID.
            NotFound: no such key.
        """
        parsed = _key_id(key_id)
        async with asyncio.timeout(self._timeout):
            row = await self._pool.fetchrow(
                f"""UPDATE api_keys SET revoked_at = coalesce(revoked_at, now()) WHERE id = $1
                    RETURNING {_COLUMNS}""",
                parsed,
            )
        if row is None:
            raise NotFound(f"API key {key_id} not found")
        return _record(row)
