"""Job definitions in PostgreSQL."""

from __future__ import annotations

import asyncio
import contextlib
import enum
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, TypeVar

import asyncpg

from scheduler_grpc import pagetokens
from scheduler_grpc.db.limits import shared_limits
from scheduler_grpc.errors import Aborted, AlreadyExists, FailedPrecondition, InvalidArgument, NotFound
from scheduler_grpc.flows import TriggerRule, check_reference_names
from scheduler_grpc.jobs import (
    ConcurrencyPolicy,
    Job,
    JobSpec,
    JobStatus,
    MisfirePolicy,
    RetryPolicy,
    ScheduleKind,
)
from scheduler_grpc.limits import check_units, refs_from_json, refs_to_json
from scheduler_grpc.schedule import FoldPolicy, GapPolicy

_E = TypeVar("_E", bound=enum.Enum)

_COLUMNS = """id, name, handler, payload, queue, schedule_kind, cron, time_zone, run_at, dst_gap_policy,
    dst_fold_policy, next_run_time, priority, max_retries, initial_backoff, max_backoff, retry_jitter,
    timeout, misfire_policy, concurrency_policy, status, version, created_at, updated_at, limits"""

# What the API reads of a job: its columns plus its dependency edges (the due scan, which never
# needs the edges, reads `_COLUMNS` only). Used on `FROM jobs` (not aliased).
_API_COLUMNS = (
    _COLUMNS
    + """, trigger_rule,
    ARRAY(SELECT d.upstream_id::text FROM job_dependencies d WHERE d.job_id = jobs.id ORDER BY d.position)
        AS depends_on"""
)
# The dependency graph's transaction-scoped advisory lock (arbitrary, fixed): every write that adds
# edges, and every delete, takes it first, so the cycle check and the write it allowed are one
# step across all server processes (two concurrent edits A->B and B->A cannot both pass).
GRAPH_LOCK = 0x5C4ED_F10_0013

MAX_PAGE_SIZE = 1000
# What a list without payloads selects (the basic view): an empty object in the payload's place.
_COLUMNS_WITHOUT_PAYLOAD = _API_COLUMNS.replace("payload,", "'{}'::jsonb AS payload,", 1)
# NOTIFY channel: a job's schedule changed, so a sleeping leader re-plans its next scan at once.
JOBS_CHANGED_CHANNEL = "scheduler_jobs_changed"


def _by_value(kind: type[_E]) -> dict[str, _E]:
    return {member.value: member for member in kind}


# Stored values are checked by the schema; a dict lookup is ~15x cheaper than calling the enum,
# and the leader's due scan decodes a thousand jobs a second.
_SCHEDULE_KINDS = _by_value(ScheduleKind)
_GAP_POLICIES = _by_value(GapPolicy)
_FOLD_POLICIES = _by_value(FoldPolicy)
_MISFIRE_POLICIES = _by_value(MisfirePolicy)
_CONCURRENCY_POLICIES = _by_value(ConcurrencyPolicy)
_STATUSES = _by_value(JobStatus)


def job_from_row(row: asyncpg.Record) -> Job:
    return Job(
        id=str(row["id"]),
        name=row["name"],
        handler=row["handler"],
        payload=row["payload"],
        queue=row["queue"],
        schedule_kind=_SCHEDULE_KINDS[row["schedule_kind"]],
        cron=row["cron"],
        time_zone=row["time_zone"],
        run_at=row["run_at"],
        dst_gap_policy=_GAP_POLICIES[row["dst_gap_policy"]],
        dst_fold_policy=_FOLD_POLICIES[row["dst_fold_policy"]],
        next_run_time=row["next_run_time"],
        priority=row["priority"],
        retry=RetryPolicy(row["max_retries"], row["initial_backoff"], row["max_backoff"], row["retry_jitter"]),
        timeout=row["timeout"],
        misfire_policy=_MISFIRE_POLICIES[row["misfire_policy"]],
        concurrency_policy=_CONCURRENCY_POLICIES[row["concurrency_policy"]],
        status=_STATUSES[row["status"]],
        # .get: the due scan does not read the edges.
        depends_on=tuple(row.get("depends_on") or ()),
        trigger_rule=TriggerRule(row.get("trigger_rule") or TriggerRule.ALL_SUCCEEDED),
        limits=refs_from_json(row.get("limits")),
        version=row["version"],
        created_at=row["created_at"],
        updated_at=row["updated_at"],
    )


def _spec_values(spec: JobSpec) -> list[Any]:
    return [
        spec.name, spec.handler, spec.payload, spec.queue, spec.schedule_kind.value, spec.cron, spec.time_zone,
        spec.run_at, spec.dst_gap_policy.value, spec.dst_fold_policy.value, spec.priority, spec.retry.max_retries,
        spec.retry.initial_backoff, spec.retry.max_backoff, spec.retry.jitter, spec.timeout,
        spec.misfire_policy.value, spec.concurrency_policy.value, spec.status.value,
    ]  # fmt: skip


@dataclass(frozen=True)
class JobPage:
    """Up to a page of jobs; `has_more` when more follow the last one."""

    jobs: list[Job]
    has_more: bool
    scope: dict[str, Any]

    def token_after(self, job: Job) -> str:
        """The token of the page that starts after `job` (a caller may cut a page short)."""
        return pagetokens.encode("jobs", self.scope, [job.name])

    @property
    def next_page_token(self) -> str:
        return self.token_after(self.jobs[-1]) if self.has_more and self.jobs else ""


class JobRepository:
    """CRUD on `jobs`. Inputs are already validated by `jobs.validate_job`."""

    def __init__(self, pool: asyncpg.Pool) -> None:
        self._pool = pool

    async def create(self, spec: JobSpec, next_run_time: datetime | None, request_id: str | None = None) -> Job:
        """Store a new job and its dependency edges; with a `request_id` seen before, return the job
        it created.

        Raises:
            AlreadyExists: another job has this name.
            InvalidArgument: an upstream that does not exist (`depends_on[i]`), or the job itself.
        """
        try:
            async with self._pool.acquire() as conn, conn.transaction():
                if spec.depends_on:
                    await conn.execute("SELECT pg_advisory_xact_lock($1)", GRAPH_LOCK)
                await _check_limits(conn, spec)
                row = await conn.fetchrow(
                    """INSERT INTO jobs (name, handler, payload, queue, schedule_kind, cron, time_zone, run_at,
                            dst_gap_policy, dst_fold_policy, priority, max_retries, initial_backoff, max_backoff,
                            retry_jitter, timeout, misfire_policy, concurrency_policy, status, next_run_time,
                            request_id, trigger_rule, limits)
                        VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17, $18,
                            $19, $20, $21, $22, $23)
                        ON CONFLICT (request_id) DO NOTHING
                        RETURNING id""",
                    *_spec_values(spec),
                    next_run_time,
                    request_id,
                    spec.trigger_rule.value,
                    refs_to_json(spec.limits),
                )
                if row is not None:
                    # A new job has no dependents yet: its edges cannot close a cycle (only name it).
                    upstreams = await _resolve_upstreams(conn, spec.depends_on, str(row["id"]), spec.payload)
                    await _write_edges(conn, str(row["id"]), upstreams)
                    job = await _read(conn, str(row["id"]))
        except asyncpg.UniqueViolationError:
            # A retry of the same request racing the first one can trip over the name first (PostgreSQL
            # checks the unique indexes in its own order): then the job of this request_id is the answer.
            taken = await self._by_request_id(request_id) if request_id is not None else None
            if taken is None:
                raise AlreadyExists(f"name: a job named {spec.name!r} already exists") from None
            return taken
        if row is None:  # the request_id was used before: same request, same answer
            taken = await self._by_request_id(request_id) if request_id is not None else None
            if taken is None:
                raise Aborted("request_id: the job created by this request was deleted meanwhile")
            return taken
        await self._notify()
        return job

    async def _by_request_id(self, request_id: str) -> Job | None:
        row = await self._pool.fetchrow(f"SELECT {_API_COLUMNS} FROM jobs WHERE request_id = $1", request_id)
        return job_from_row(row) if row is not None else None

    async def _notify(self) -> None:
        await self._pool.execute("SELECT pg_notify($1, '')", JOBS_CHANGED_CHANNEL)

    async def due(
        self, limit: int, ahead: timedelta = timedelta(0), fire_ahead: timedelta = timedelta(0)
    ) -> tuple[list[Job], datetime]:
        """Active jobs to fire now or soon, earliest next run first, and the database's clock, which
        every leader decision uses so scheduler hosts' clocks don't matter.

        A job is read when its next run is due within `ahead` or, when its concurrency policy is
        `allow` (its slots may fire ahead, see `scheduler.fires_ahead`), within `fire_ahead` plus
        `ahead`. One range of the partial index `jobs_due_idx` (O(jobs due that soon)).
        """
        rows = await self._pool.fetch(
            f"""SELECT {_COLUMNS}, now() AS db_now FROM jobs
                WHERE status = 'active' AND next_run_time <= now() + $2::interval + $3::interval
                  AND (next_run_time <= now() + $2::interval OR concurrency_policy = 'allow')
                ORDER BY next_run_time LIMIT $1""",
            limit,
            ahead,
            fire_ahead,
        )
        if not rows:
            return [], await self._pool.fetchval("SELECT now()")
        return [job_from_row(row) for row in rows], rows[0]["db_now"]

    async def time_until_next_due(self, fire_ahead: timedelta = timedelta(0)) -> timedelta | None:
        """How long until the earliest active job is to fire, by the database clock; None when no
        job has a next run.

        A job is to fire at its next run, or `fire_ahead` before it when its concurrency policy is
        `allow`. The jobs due within `fire_ahead` are looked at one by one (a range of the partial
        index: the jobs due that soon); the earliest beyond is one index probe, counted as `allow`
        (the earliest it could fire: a wake-up too early at worst, never too late).
        """
        value: timedelta | None = await self._pool.fetchval(
            """SELECT least(
                   (SELECT min(next_run_time - CASE WHEN concurrency_policy = 'allow' THEN $1::interval
                                                    ELSE interval '0' END)
                    FROM jobs WHERE status = 'active' AND next_run_time <= now() + $1::interval),
                   (SELECT min(next_run_time) - $1::interval
                    FROM jobs WHERE status = 'active' AND next_run_time > now() + $1::interval)
               ) - now()""",
            fire_ahead,
        )
        return value

    async def queue_names(self) -> list[str]:
        """Every queue some job names (the leader's recover, promote and reconcile loops visit them)."""
        rows = await self._pool.fetch("SELECT DISTINCT queue FROM jobs")
        return [row["queue"] for row in rows]

    async def database_now(self) -> datetime:
        """The database clock, which every leader decision uses."""
        now: datetime = await self._pool.fetchval("SELECT now()")
        return now

    async def get(self, job_id: str) -> Job:
        row = await self._pool.fetchrow(f"SELECT {_API_COLUMNS} FROM jobs WHERE id = $1", _uuid(job_id))
        if row is None:
            raise NotFound(f"job {job_id} not found")
        return job_from_row(row)

    async def handlers_of(self, job_ids: Sequence[str]) -> dict[str, tuple[str, str]]:
        """The handler and queue of each job of `job_ids` (UUIDs) that exists, by id."""
        rows = await self._pool.fetch(
            "SELECT id::text, handler, queue FROM jobs WHERE id = ANY($1::uuid[])", [uuid.UUID(i) for i in job_ids]
        )
        return {row["id"]: (row["handler"], row["queue"]) for row in rows}

    async def get_by_name(self, name: str) -> Job:
        row = await self._pool.fetchrow(f"SELECT {_API_COLUMNS} FROM jobs WHERE name = $1", name)
        if row is None:
            raise NotFound(f"job named {name!r} not found")
        return job_from_row(row)

    async def list_page(
        self,
        page_size: int = 100,
        page_token: str = "",
        status: JobStatus | None = None,
        handler: str | None = None,
        *,
        with_payload: bool = True,
    ) -> JobPage:
        """A page of jobs ordered by name; pass `next_page_token` back for the next page.

        Without `with_payload` every job's payload is read as `{}` (and not fetched at all).
        """
        if not 0 <= page_size <= MAX_PAGE_SIZE:
            raise InvalidArgument("page_size", f"must be between 0 and {MAX_PAGE_SIZE}")
        size = page_size or 100
        scope = {"state": status.value if status else None, "handler": handler}
        after = None
        if page_token:
            position = pagetokens.decode(page_token, "jobs", scope)
            if len(position) != 1 or not isinstance(position[0], str):
                raise InvalidArgument("page_token", "not a token this server issued")
            after = position[0]
        rows = await self._pool.fetch(
            f"""SELECT {_API_COLUMNS if with_payload else _COLUMNS_WITHOUT_PAYLOAD} FROM jobs
                WHERE ($1::text IS NULL OR name > $1) AND ($2::text IS NULL OR status = $2)
                  AND ($3::text IS NULL OR handler = $3)
                ORDER BY name LIMIT $4""",
            after,
            status.value if status else None,
            handler,
            size + 1,
        )
        return JobPage([job_from_row(row) for row in rows[:size]], len(rows) > size, scope)

    async def update(self, job_id: str, spec: JobSpec, next_run_time: datetime | None, expected_version: int) -> Job:
        """Replace a job's definition and its dependency edges if it is still at `expected_version`
        (optimistic concurrency).

        New edges are checked under the graph's advisory lock (`GRAPH_LOCK`): the walk upward
        from the new upstreams (`_cycle`) and the write are one step for every server process.

        Raises:
            NotFound: no such job.
            Aborted: someone else changed it first (stale etag).
            AlreadyExists: the new name is taken.
            InvalidArgument: `depends_on` names an unknown job or the job itself, or would close a cycle.
        """
        key = _uuid(job_id)
        try:
            async with self._pool.acquire() as conn, conn.transaction():
                if spec.depends_on:
                    await conn.execute("SELECT pg_advisory_xact_lock($1)", GRAPH_LOCK)
                upstreams = await _resolve_upstreams(conn, spec.depends_on, key, spec.payload)
                await _check_limits(conn, spec)
                cycle = await _cycle(conn, key, upstreams)
                if cycle:
                    raise InvalidArgument("depends_on", f"would create a cycle: {' → '.join(cycle)}")
                row = await conn.fetchrow(
                    """UPDATE jobs SET name = $1, handler = $2, payload = $3, queue = $4, schedule_kind = $5,
                            cron = $6, time_zone = $7, run_at = $8, dst_gap_policy = $9, dst_fold_policy = $10,
                            priority = $11, max_retries = $12, initial_backoff = $13, max_backoff = $14,
                            retry_jitter = $15, timeout = $16, misfire_policy = $17, concurrency_policy = $18,
                            status = $19, next_run_time = $20, trigger_rule = $23, limits = $24,
                            version = version + 1, updated_at = now()
                        WHERE id = $21 AND version = $22
                        RETURNING id""",
                    *_spec_values(spec),
                    next_run_time,
                    key,
                    expected_version,
                    spec.trigger_rule.value,
                    refs_to_json(spec.limits),
                )
                if row is not None:
                    await _write_edges(conn, key, upstreams)
                    job = await _read(conn, key)
        except asyncpg.UniqueViolationError:
            raise AlreadyExists(f"name: a job named {spec.name!r} already exists") from None
        if row is None:
            current = await self.get(job_id)
            raise Aborted(f"etag: job changed meanwhile (now {current.etag}); read it again and retry")
        await self._notify()
        return job

    async def set_status(self, job_id: str, status: JobStatus, next_run_time: datetime | None) -> Job:
        """Pause or resume; resuming sets the next run from now (paused slots are not caught up)."""
        row = await self._pool.fetchrow(
            f"""UPDATE jobs SET status = $2, next_run_time = $3, version = version + 1, updated_at = now()
                WHERE id = $1 RETURNING {_API_COLUMNS}""",
            _uuid(job_id),
            status.value,
            next_run_time,
        )
        if row is None:
            raise NotFound(f"job {job_id} not found")
        await self._notify()
        return job_from_row(row)

    async def delete(self, job_id: str, *, detach_dependents: bool = False) -> None:
        """Delete a job and its history.

        Raises:
            NotFound: no such job.
            FailedPrecondition: other jobs depend on it and `detach_dependents` is not set (with it,
                their edges to this job are deleted with it).
        """
        key = _uuid(job_id)
        async with self._pool.acquire() as conn, conn.transaction():
            await conn.execute("SELECT pg_advisory_xact_lock($1)", GRAPH_LOCK)
            if not detach_dependents:
                names = await conn.fetch(
                    """SELECT j.name FROM job_dependencies d JOIN jobs j ON j.id = d.job_id
                       WHERE d.upstream_id = $1 ORDER BY j.name LIMIT 11""",
                    key,
                )
                if names:
                    listed = ", ".join(row["name"] for row in names[:10]) + (", ..." if len(names) > 10 else "")
                    raise FailedPrecondition(
                        f"id: other jobs depend on job {job_id} ({listed}); delete or change them first, "
                        "or delete with detach_dependents"
                    )
            result = await conn.execute("DELETE FROM jobs WHERE id = $1", key)
        if result == "DELETE 0":
            raise NotFound(f"job {job_id} not found")


async def _check_limits(conn: Any, spec: JobSpec) -> None:
    """Require the limits `spec` names to exist (locked FOR SHARE until the write commits, so
    none is deleted meanwhile: `db/limits.py`) and admit the units it asks of them.

    Raises:
        InvalidArgument: naming `limits[i].limit` (no such limit) or `limits[i].units`.
    """
    if spec.limits:
        check_units(spec.limits, await shared_limits(conn, [ref.limit for ref in spec.limits]))


async def _read(conn: Any, job_id: str) -> Job:
    row = await conn.fetchrow(f"SELECT {_API_COLUMNS} FROM jobs WHERE id = $1", uuid.UUID(job_id))
    return job_from_row(row)


async def _resolve_upstreams(
    conn: Any, given: tuple[str, ...], job_id: str, payload: dict[str, Any] | None = None
) -> list[str]:
    """The ids of the upstream jobs `given` (ids or names), in order; with `payload`, its `$from`
    references must name one of them.

    Raises:
        InvalidArgument: `depends_on[i]` names no job, or the job itself; a reference in `payload`
            names none of them.
    """
    if not given:
        if payload is not None:
            check_reference_names(payload, [])
        return []
    ids = [value for value in given if _is_uuid(value)]
    rows = await conn.fetch(
        # Two index probes (an OR of both would scan the table).
        """SELECT id::text AS id, name FROM jobs WHERE id = ANY($1::uuid[])
           UNION SELECT id::text, name FROM jobs WHERE name = ANY($2::text[])""",
        ids,
        list(given),
    )
    by_id = {row["id"]: row["id"] for row in rows}
    by_name = {row["name"]: row["id"] for row in rows}
    resolved: list[str] = []
    for index, value in enumerate(given):
        found = by_id.get(str(uuid.UUID(value))) if _is_uuid(value) else None
        found = found or by_name.get(value)
        if found is None:
            raise InvalidArgument(f"depends_on[{index}]", f"no job {value!r}")
        if found == job_id:
            raise InvalidArgument(
                f"depends_on[{index}]", f"would create a cycle: {value} → {value} (a job cannot depend on itself)"
            )
        if found not in resolved:
            resolved.append(found)
    if payload is not None:
        names = {row["id"]: row["name"] for row in rows}
        check_reference_names(payload, [names[upstream] for upstream in resolved])
    return resolved


async def _cycle(conn: Any, job_id: str, upstreams: list[str]) -> list[str]:
    """The cycle that edges `upstream -> job_id` for each of `upstreams` would close, as job names
    from `job_id` round to it again; empty when there is none.

    One recursive walk upward from the new upstreams (the dependency table's primary key): it
    costs O(edges reachable upward from them), never O(all jobs). Only when the job is found
    (a cycle: rare) are the edges walked read again to name the path.
    """
    if not upstreams:
        return []
    ids = [uuid.UUID(value) for value in upstreams]
    key = uuid.UUID(job_id)
    found = await conn.fetchval(
        """WITH RECURSIVE up (id) AS (
               SELECT unnest($1::uuid[])
               UNION
               SELECT d.upstream_id FROM up JOIN job_dependencies d ON d.job_id = up.id WHERE up.id <> $2
           )
           SELECT EXISTS (SELECT 1 FROM up WHERE id = $2)""",
        ids,
        key,
    )
    if not found:
        return []
    rows = await conn.fetch(
        """WITH RECURSIVE up (id) AS (
               SELECT unnest($1::uuid[])
               UNION
               SELECT d.upstream_id FROM up JOIN job_dependencies d ON d.job_id = up.id WHERE up.id <> $2
           )
           SELECT d.job_id, d.upstream_id FROM job_dependencies d JOIN up ON d.job_id = up.id""",
        ids,
        key,
    )
    upstreams_of: dict[uuid.UUID, list[uuid.UUID]] = {}
    for row in rows:
        upstreams_of.setdefault(row["job_id"], []).append(row["upstream_id"])
    # Breadth-first upward from the new upstreams to the job: the shortest such path.
    parent: dict[uuid.UUID, uuid.UUID | None] = {value: None for value in ids}
    frontier = list(ids)
    while frontier and key not in parent:
        following = []
        for node in frontier:
            for upstream in upstreams_of.get(node, ()):
                if upstream not in parent:
                    parent[upstream] = node
                    following.append(upstream)
        frontier = following
    if key not in parent:  # the job is itself a new upstream (refused before) or raced: name it alone
        chain = [key]
    else:
        chain, step = [], parent[key]
        while step is not None:
            chain.append(step)
            step = parent[step]
        chain = [key, *chain]
    names = {
        row["id"]: row["name"]
        for row in await conn.fetch("SELECT id, name FROM jobs WHERE id = ANY($1::uuid[])", chain)
    }
    return [names.get(node, str(node)) for node in [*chain, key]]


async def _write_edges(conn: Any, job_id: str, upstreams: list[str]) -> None:
    await conn.execute("DELETE FROM job_dependencies WHERE job_id = $1", uuid.UUID(job_id))
    if upstreams:
        await conn.execute(
            """INSERT INTO job_dependencies (job_id, upstream_id, position)
               SELECT $1, u.id, u.position - 1 FROM unnest($2::uuid[]) WITH ORDINALITY AS u(id, position)""",
            uuid.UUID(job_id),
            [uuid.UUID(value) for value in upstreams],
        )


def _is_uuid(value: str) -> bool:
    try:
        uuid.UUID(value)
    except (ValueError, AttributeError, TypeError):
        return False
    return True


class JobChanges:
    """A LISTEN on `JOBS_CHANGED_CHANNEL` over a pooled connection of its own, re-opened after a failure.

    `changed` is set by every notification; the leader clears it before a scan and waits on it
    between scans. A notification sent while the connection is down is lost, which costs nothing:
    the leader also wakes every scan interval, and `listen()` sets `changed` after re-opening.

    Args:
        pool: The process's asyncpg pool (one of its connections is held while listening).
        timeout: Bound on acquiring and subscribing the connection.
    """

    def __init__(self, pool: asyncpg.Pool, *, timeout: timedelta = timedelta(seconds=5)) -> None:
        self._pool = pool
        self._timeout = timeout.total_seconds()
        self._conn: Any = None
        self.changed = asyncio.Event()

    def _on_notify(self, *args: object) -> None:
        self.changed.set()

    async def listen(self) -> None:
        """Make sure the LISTEN connection is open; re-open it if PostgreSQL closed it.

        Raises:
            Exception: PostgreSQL errors (asyncpg, OSError, TimeoutError) when it cannot be opened;
                the caller retries later.
        """
        if self._is_open():
            return
        await self.close()
        async with asyncio.timeout(self._timeout):
            conn = await self._pool.acquire()
            try:
                await conn.add_listener(JOBS_CHANGED_CHANNEL, self._on_notify)
            except BaseException:
                await self._pool.release(conn)
                raise
        self._conn = conn
        self.changed.set()  # changes made while we were not listening: scan again at once

    def _is_open(self) -> bool:
        try:
            return self._conn is not None and not self._conn.is_closed()
        except asyncpg.InterfaceError:  # the pool took back the broken connection already
            return False

    async def close(self) -> None:
        """Stop listening and give the connection back (a broken one is discarded by the pool)."""
        conn, self._conn = self._conn, None
        if conn is None:
            return
        with contextlib.suppress(Exception):
            async with asyncio.timeout(self._timeout):
                await conn.remove_listener(JOBS_CHANGED_CHANNEL, self._on_notify)
        with contextlib.suppress(Exception):
            async with asyncio.timeout(self._timeout):
                await self._pool.release(conn)


def _uuid(value: str) -> str:
    # Refuse anything that is not a UUID before PostgreSQL does, with the field named.
    try:
        return str(uuid.UUID(value))
    except (ValueError, AttributeError, TypeError):
        raise InvalidArgument("id", f"{value!r} is not a valid id") from None
