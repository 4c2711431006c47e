"""Limit definitions in PostgreSQL: the `limits` table (issue 22), and the check that the limits a
job names exist, made inside the job's own write.

Inputs are already validated by `scheduler_grpc.limits.validate_limit`. Every change raises the
row's `version` (the limit's etag). A job's write reads the limits it names `FOR SHARE` and a
delete locks its limit `FOR UPDATE` before looking for jobs that use it, so a job naming a limit
and the delete of that limit are decided one after the other: never a job left naming a limit
that no longer exists.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Final

import asyncpg

from scheduler_grpc.db import keyset
from scheduler_grpc.errors import Aborted, AlreadyExists, FailedPrecondition, InvalidArgument, NotFound
from scheduler_grpc.limits import (
    Limit,
    LimitKind,
    LimitSpec,
    overrides_from_json,
    overrides_to_json,
)

_COLUMNS: Final = 'id, name, kind, "limit", period, burst, overrides, version, created_at, updated_at'
_DEFAULT_TIMEOUT: Final = timedelta(seconds=5)
# Jobs named in a FAILED_PRECONDITION refusing a delete, at most (then ", ...").
_NAMED_JOBS: Final = 10
_KINDS: Final = {member.value: member for member in LimitKind}


@dataclass(frozen=True)
class LimitPage:
    """One page of limits, by name."""

    limits: list[Limit]
    next_page_token: str


def limit_from_row(row: asyncpg.Record) -> Limit:
    return Limit(
        id=str(row["id"]),
        name=row["name"],
        kind=_KINDS[row["kind"]],
        limit=row["limit"],
        period=row["period"],
        burst=row["burst"],
        overrides=overrides_from_json(row["overrides"]),
        version=row["version"],
        created_at=row["created_at"],
        updated_at=row["updated_at"],
    )


def _limit_id(value: str, field: str = "id") -> uuid.UUID:
    try:
        return uuid.UUID(value)
    except (ValueError, AttributeError, TypeError):
        raise InvalidArgument(field, f"{str(value)[:40]!r} is not a valid id") from None


async def shared_limits(conn: Any, names: Sequence[str]) -> dict[str, Limit]:
    """The limits named `names` that exist, each row locked `FOR SHARE` until the caller's
    transaction ends (so none of them can be deleted meanwhile: see the module docstring)."""
    if not names:
        return {}
    rows = await conn.fetch(
        f"SELECT {_COLUMNS} FROM limits WHERE name = ANY($1::text[]) ORDER BY name FOR SHARE", list(names)
    )
    return {row["name"]: limit_from_row(row) for row in rows}


class LimitRepository:
    """CRUD on `limits`; every call is bounded by `timeout` (pool wait included).

    Args:
        pool: The process's asyncpg pool.
        timeout: Bound on each call.
    """

    def __init__(self, pool: asyncpg.Pool, *, timeout: timedelta = _DEFAULT_TIMEOUT) -> None:
        self._pool = pool
        self._timeout = timeout.total_seconds()

    async def create(self, spec: LimitSpec, request_id: str | None = None) -> Limit:
        """Store a new limit; with a `request_id` seen before, return the limit that request created.

        Raises:
            AlreadyExists: another limit has this name.
            Aborted: the limit this `request_id` created was deleted meanwhile.
        """
        try:
            async with asyncio.timeout(self._timeout):
                row = await self._pool.fetchrow(
                    f"""INSERT INTO limits (name, kind, "limit", period, burst, overrides, request_id)
                        VALUES ($1, $2, $3, $4, $5, $6, $7)
                        ON CONFLICT (request_id) DO NOTHING RETURNING {_COLUMNS}""",
                    spec.name,
                    spec.kind.value,
                    spec.limit,
                    spec.period,
                    spec.burst,
                    overrides_to_json(spec.overrides),
                    request_id,
                )
        except asyncpg.UniqueViolationError:
            # A retry racing the first call can trip over the name first: then the limit of this
            # request_id is the answer.
            taken = await self._by_request_id(request_id) if request_id is not None else None
            if taken is None:
                raise AlreadyExists(f"name: a limit named {spec.name!r} already exists") from None
            return taken
        if row is None:  # the request_id was used before: same request, same answer
            taken = await self._by_request_id(request_id) if request_id is not None else None
            if taken is None:
                raise Aborted("request_id: the limit created by this request was deleted meanwhile")
            return taken
        return limit_from_row(row)

    async def _by_request_id(self, request_id: str) -> Limit | None:
        async with asyncio.timeout(self._timeout):
            row = await self._pool.fetchrow(f"SELECT {_COLUMNS} FROM limits WHERE request_id = $1", request_id)
        return None if row is None else limit_from_row(row)

    async def get(self, limit_id: str) -> Limit:
        """The limit with this id.

        Raises:
            InvalidArgument: `limit_id` is not a UUID.
            NotFound: no such limit.
        """
        parsed = _limit_id(limit_id)
        async with asyncio.timeout(self._timeout):
            row = await self._pool.fetchrow(f"SELECT {_COLUMNS} FROM limits WHERE id = $1", parsed)
        if row is None:
            raise NotFound(f"limit {limit_id} not found")
        return limit_from_row(row)

    async def get_by_name(self, name: str) -> Limit:
        """The limit named `name`.

        Raises:
            NotFound: no such limit.
        """
        async with asyncio.timeout(self._timeout):
            row = await self._pool.fetchrow(f"SELECT {_COLUMNS} FROM limits WHERE name = $1", name)
        if row is None:
            raise NotFound(f"limit named {name!r} not found")
        return limit_from_row(row)

    async def list_page(self, page_size: int = 0, page_token: str = "") -> LimitPage:
        """Limits by name.

        Raises:
            InvalidArgument: `page_size` out of range or a `page_token` this server did not issue.
        """
        limits, token = await keyset.page_by_name(
            self._pool,
            self._timeout,
            kind="limits",
            select=f"SELECT {_COLUMNS} FROM limits",
            column="name",
            page_size=page_size,
            page_token=page_token,
            item=limit_from_row,
            name_of=lambda found: found.name,
        )
        return LimitPage(limits, token)

    async def by_names(self, names: Sequence[str]) -> list[Limit]:
        """The limits named `names` that exist (what the queues' scripts need for runs that carry them)."""
        if not names:
            return []
        async with asyncio.timeout(self._timeout):
            rows = await self._pool.fetch(
                f"SELECT {_COLUMNS} FROM limits WHERE name = ANY($1::text[]) ORDER BY name", list(names)
            )
        return [limit_from_row(row) for row in rows]

    async def every_limit(self) -> list[Limit]:
        """Every limit, by name (the leader re-puts them all in the queues)."""
        async with asyncio.timeout(self._timeout):
            rows = await self._pool.fetch(f"SELECT {_COLUMNS} FROM limits ORDER BY name")
        return [limit_from_row(row) for row in rows]

    async def queue_names(self) -> list[str]:
        """The queues limit definitions go to: every queue a job names (a job may take a limit
        later), and every queue an open run with limit keys is on (its job may have moved)."""
        async with asyncio.timeout(self._timeout):
            rows = await self._pool.fetch(
                """SELECT queue FROM jobs
                   UNION SELECT DISTINCT e.queue FROM job_executions e
                   WHERE e.finished_at IS NULL AND e.limit_keys IS NOT NULL AND e.queue IS NOT NULL"""
            )
        return sorted(row["queue"] for row in rows)

    async def in_use_by_open_runs(self, name: str) -> bool:
        """Whether a queued or running run still carries limit `name` (its definition must stay in
        the queues until it ends: a run whose limit has no definition waits)."""
        async with asyncio.timeout(self._timeout):
            return bool(
                await self._pool.fetchval(
                    """SELECT EXISTS (SELECT 1 FROM job_executions
                       WHERE finished_at IS NULL AND limit_keys IS NOT NULL
                         AND limit_keys @> jsonb_build_array(jsonb_build_array($1::text)))""",
                    name,
                )
            )

    async def running_with_limits(self, run_ids: Sequence[str]) -> set[str]:
        """Of these runs, those whose latest attempt is `running` (their units are held)."""
        if not run_ids:
            return set()
        async with asyncio.timeout(self._timeout):
            rows = await self._pool.fetch(
                """SELECT DISTINCT run_id::text FROM job_executions
                   WHERE run_id = ANY($1::uuid[]) AND status = 'running' AND finished_at IS NULL""",
                [uuid.UUID(value) for value in run_ids],
            )
        return {row["run_id"] for row in rows}

    async def running_runs_with_limits(self, *, after_run_id: str | None, limit: int) -> list[tuple[str, str, Any]]:
        """`(run id, queue, limit_keys)` of runs running with limit keys, by run id (a page)."""
        async with asyncio.timeout(self._timeout):
            rows = await self._pool.fetch(
                """SELECT e.run_id::text, coalesce(e.queue, j.queue) AS queue, e.limit_keys
                   FROM job_executions e JOIN jobs j ON j.id = e.job_id
                   WHERE e.finished_at IS NULL AND e.status = 'running' AND e.limit_keys IS NOT NULL
                     AND ($1::uuid IS NULL OR e.run_id > $1)
                   ORDER BY e.run_id LIMIT $2""",
                uuid.UUID(after_run_id) if after_run_id else None,
                limit,
            )
        return [(row["run_id"], row["queue"], row["limit_keys"]) for row in rows]

    async def update(self, limit_id: str, spec: LimitSpec, expected_version: int) -> Limit:
        """Replace a limit's definition (its name stays) if it is still at `expected_version`.

        Raises:
            InvalidArgument: `limit_id` is not a UUID.
            NotFound: no such limit.
            Aborted: someone else changed it first (stale etag).
        """
        parsed = _limit_id(limit_id)
        async with asyncio.timeout(self._timeout):
            row = await self._pool.fetchrow(
                f"""UPDATE limits SET kind = $3, "limit" = $4, period = $5, burst = $6, overrides = $7,
                        version = version + 1, updated_at = now()
                    WHERE id = $1 AND version = $2 RETURNING {_COLUMNS}""",
                parsed,
                expected_version,
                spec.kind.value,
                spec.limit,
                spec.period,
                spec.burst,
                overrides_to_json(spec.overrides),
            )
        if row is None:
            current = await self.get(limit_id)
            raise Aborted(f"etag: limit changed meanwhile (now {current.etag}); read it again and retry")
        return limit_from_row(row)

    async def delete(self, limit_id: str, *, expected_version: int | None = None) -> Limit:
        """Delete a limit no job uses; returns the row as it was.

        Raises:
            InvalidArgument: `limit_id` is not a UUID.
            NotFound: no such limit.
            Aborted: the limit is not at `expected_version` (a stale etag).
            FailedPrecondition: jobs use it (the message names up to 10 of them).
        """
        parsed = _limit_id(limit_id)
        async with asyncio.timeout(self._timeout), self._pool.acquire() as conn, conn.transaction():
            row = await conn.fetchrow(f"SELECT {_COLUMNS} FROM limits WHERE id = $1 FOR UPDATE", parsed)
            if row is None:
                raise NotFound(f"limit {limit_id} not found")
            current = limit_from_row(row)
            if expected_version is not None and current.version != expected_version:
                raise Aborted(f"etag: limit changed meanwhile (now {current.etag}); read it again and retry")
            # A statement after the lock: it sees every job committed by a write that held the
            # row FOR SHARE before us.
            users = await conn.fetch(
                """SELECT name FROM jobs
                   WHERE limits <> '[]'::jsonb AND limits @> jsonb_build_array(jsonb_build_object('limit', $1::text))
                   ORDER BY name LIMIT $2""",
                current.name,
                _NAMED_JOBS + 1,
            )
            if users:
                names = ", ".join(user["name"] for user in users[:_NAMED_JOBS])
                more = ", ..." if len(users) > _NAMED_JOBS else ""
                raise FailedPrecondition(
                    f"id: jobs use limit {current.name!r} ({names}{more}); remove it from them first"
                )
            await conn.execute("DELETE FROM limits WHERE id = $1", parsed)
        return current
