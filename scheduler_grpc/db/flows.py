"""Flow runs in PostgreSQL (issue 13): `flow_runs` and their `flow_nodes` (migration 0007).

A flow run is started by PostgreSQL itself, in the transaction of the statement that created its
root run (the `flows_start` trigger of migration 0007): the fire, trigger and backfill statements
do not name flows at all. The leader advances open flow runs (`advance`), each decision made in
one fenced transaction keyed on (flow run, job): the node's `run_id` is set by a compare-and-set
from NULL together with the insert of its run, so a node gets exactly one run whatever races.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import asyncpg

from scheduler_grpc import outputs
from scheduler_grpc.db import faults
from scheduler_grpc.db.attempts import latest_attempt
from scheduler_grpc.db.executions import (
    Queued,
    key_error_of,
    keys_of,
    new_execution_id,
    queued_from_row,
    resolved_limit_keys,
)
from scheduler_grpc.db.leadership import Connection, assert_current_term
from scheduler_grpc.db.runs import RunRepository
from scheduler_grpc.errors import FailedPrecondition, InvalidArgument, NotFound
from scheduler_grpc.flows import FlowRun, Node, TriggerRule

_FENCED_IDLE_LIMIT = "SET LOCAL idle_in_transaction_session_timeout = '1s'"
REFUSED_ERROR = "the store refused this node's run"
_SNAPSHOT = ("handler", "payload", "queue", "timeout", "max_retries", "initial_backoff", "max_backoff", "retry_jitter")

# Every node of the given flow runs with the latest attempt of its run (if any).
_NODES = f"""
    SELECT n.flow_run_id, n.job_id, j.name, j.status AS job_status, n.upstream_ids, n.trigger_rule, n.run_id,
           x.id AS execution_id, x.status
    FROM flow_nodes n JOIN jobs j ON j.id = n.job_id
    LEFT JOIN LATERAL {latest_attempt("n.run_id", "a.id, a.status", slot="n.run_scheduled_for")} x ON true
    WHERE n.flow_run_id = ANY($1::uuid[])
    ORDER BY n.flow_run_id, j.name
"""


@dataclass(frozen=True)
class OpenNode(Node):
    """A node as the leader reads it: with its flow run and its job's status (paused: skipped)."""

    flow_run_id: str = ""
    job_paused: bool = False


@dataclass(frozen=True)
class Recorded:
    """A finished row a decision recorded for a node (not run: upstream_failed, skipped, ...)."""

    run_id: str
    job_id: str
    status: str
    handler: str
    error: str


@dataclass(frozen=True)
class NodeDecision:
    """What a waiting node becomes: a run with this status (`queued`, or a finished row with `error`)."""

    job_id: str
    status: str
    payload: dict[str, Any] | None = None  # the resolved payload of a queued run (None: the job's)
    error: str | None = None

    def __post_init__(self) -> None:
        # Bounded where it is made: the row and its event carry the same text.
        if self.error is not None:
            object.__setattr__(self, "error", outputs.bound_error(self.error))


def _uuid(value: str, field: str = "id") -> uuid.UUID:
    try:
        return uuid.UUID(value)
    except (ValueError, AttributeError, TypeError):
        raise InvalidArgument(field, f"{value!r} is not a valid id") from None


def _node(row: asyncpg.Record) -> OpenNode:
    return OpenNode(
        job_id=str(row["job_id"]),
        job_name=row["name"],
        upstream_ids=tuple(str(value) for value in row["upstream_ids"]),
        trigger_rule=TriggerRule(row["trigger_rule"]),
        run_id=str(row["run_id"]) if row["run_id"] is not None else None,
        status=row["status"],
        execution_id=str(row["execution_id"]) if row["execution_id"] is not None else None,
        flow_run_id=str(row["flow_run_id"]),
        job_paused=row["job_status"] == "paused",
    )


class FlowRepository:
    """Reads and writes of `flow_runs` / `flow_nodes` (over a pool, or one fenced transaction)."""

    def __init__(self, pool: asyncpg.Pool | Connection, *, scope: str = "scheduler") -> None:
        self._pool = pool
        self._scope = scope

    @asynccontextmanager
    async def fenced(self, term: int) -> AsyncIterator[FlowRepository]:
        """One transaction that commits only while `term` is the current leader term (as
        `RecoveryRepository.fenced`)."""
        if not isinstance(self._pool, asyncpg.Pool):
            raise TypeError("fenced() needs a repository over a pool")
        async with self._pool.acquire() as conn, conn.transaction():
            await conn.execute(_FENCED_IDLE_LIMIT)
            await assert_current_term(conn, self._scope, term)
            yield FlowRepository(conn, scope=self._scope)

    async def open_nodes(
        self, limit: int, after: tuple[Any, str] | None = None
    ) -> tuple[dict[str, list[OpenNode]], tuple[Any, str] | None]:
        """The nodes of up to `limit` open flow runs after the position `after`, oldest first (the
        partial index `flow_runs_open_idx`: O(open flow runs), never O(history)), and the position
        of the last one (None when no more follow)."""
        ids = await self._pool.fetch(
            """SELECT id, created_at FROM flow_runs
               WHERE state = 'running' AND ($2::timestamptz IS NULL OR (created_at, id) > ($2, $3::uuid))
               ORDER BY created_at, id LIMIT $1""",
            limit,
            after[0] if after else None,
            uuid.UUID(after[1]) if after else None,
        )
        if not ids:
            return {}, None
        rows = await self._pool.fetch(_NODES, [row["id"] for row in ids])
        flows: dict[str, list[OpenNode]] = {str(row["id"]): [] for row in ids}
        for row in rows:
            flows[str(row["flow_run_id"])].append(_node(row))
        last = (ids[-1]["created_at"], str(ids[-1]["id"])) if len(ids) == limit else None
        return flows, last

    async def results(self, run_ids: Sequence[str]) -> dict[str, Any]:
        """The result of each run's latest attempt, by run id (None for a run that has none)."""
        rows = await self._pool.fetch(
            f"""SELECT r.run_id, x.result FROM unnest($1::uuid[]) AS r(run_id)
               CROSS JOIN LATERAL {latest_attempt("r.run_id", "a.result")} x""",
            [uuid.UUID(value) for value in run_ids],
        )
        return {str(row["run_id"]): row["result"] for row in rows}

    async def decide(
        self, flow_run_id: str, decisions: Sequence[NodeDecision], term: int | None
    ) -> tuple[list[Queued], list[Recorded]]:
        """Record decisions on waiting nodes of a flow run that is still running; call it inside
        `fenced` (or a transaction of its own).

        The flow run's row is locked first (a concurrent CancelFlowRun waits, or wins and nothing
        is decided here). Each node gets its run only if its `run_id` is still NULL (the
        compare-and-set keyed on (flow run, job)); the run is a snapshot of the job as it is now,
        trigger `upstream`, with the resolved payload.

        Returns:
            The runs created `queued`, to be enqueued (PostgreSQL first: reconcile re-enqueues a
            queued run Redis lacks, so a crash after the commit loses nothing), and the finished
            rows recorded (upstream_failed, skipped, cancelled, dead), to be announced.
        """
        state = await self._pool.fetchval(
            "SELECT state FROM flow_runs WHERE id = $1 FOR UPDATE", uuid.UUID(flow_run_id)
        )
        if state != "running" or not decisions:
            return [], []
        rows = await self._record(flow_run_id, decisions, term)
        queued = [
            queued_from_row(row) for row in rows if row["status"] == "queued"
        ]  # fmt: skip
        recorded = [
            Recorded(str(row["run_id"]), str(row["job_id"]), row["status"], row["handler"], row["error"] or "")
            for row in rows
            if row["status"] != "queued"
        ]
        return queued, recorded

    async def _record(
        self, flow_run_id: str, decisions: Sequence[NodeDecision], term: int | None
    ) -> list[asyncpg.Record]:
        """Insert the decisions' rows; a decision whose values the store refuses (a CHECK, an
        encoding) is recorded `dead` instead, with `REFUSED_ERROR`: the node fails, not the leader.
        After a refusal, one statement per decision (each under a savepoint)."""
        try:
            async with self._savepoint():
                return await self._insert(flow_run_id, decisions, term)
        except asyncpg.PostgresError as exc:
            if not faults.is_request_error(exc):
                raise
            if len(decisions) > 1:
                return [row for one in decisions for row in await self._record(flow_run_id, [one], term)]
            # Recorded without the values of its own (the job's payload; a bounded error): if the
            # store refuses that too, it is not the data but a bug, and it raises.
            refused = NodeDecision(decisions[0].job_id, "dead", error=f"{REFUSED_ERROR}: {exc}")
            async with self._savepoint():
                return await self._insert(flow_run_id, [refused], term)

    @asynccontextmanager
    async def _savepoint(self) -> AsyncIterator[None]:
        """Under a savepoint when on a connection (so its transaction survives a refusal)."""
        if isinstance(self._pool, asyncpg.Pool):
            yield
        else:
            async with self._pool.transaction():
                yield

    async def _insert(
        self, flow_run_id: str, decisions: Sequence[NodeDecision], term: int | None
    ) -> list[asyncpg.Record]:
        return await self._pool.fetch(
            f"""
            WITH d AS (
                -- The run's slot is its creation (clock_timestamp: volatile, so this CTE is
                -- evaluated once), kept on its node too (migration 0017).
                SELECT *, clock_timestamp() AS slot
                FROM unnest($2::uuid[], $3::uuid[], $4::text[], $5::jsonb[], $6::text[])
                    AS d(run_id, job_id, status, payload, error)
            ), claimed AS (
                UPDATE flow_nodes n SET run_id = d.run_id, run_scheduled_for = d.slot
                FROM d WHERE n.flow_run_id = $1 AND n.job_id = d.job_id AND n.run_id IS NULL
                RETURNING n.job_id, d.run_id, d.slot, d.status, d.payload, d.error
            )
            INSERT INTO job_executions (id, run_id, job_id, scheduled_for, attempt, status, trigger, due_at, priority,
                                        term, finished_at, error, limit_keys, {", ".join(_SNAPSHOT)})
            SELECT c.run_id, c.run_id, j.id, c.slot, 1, s.status, 'upstream', now(), j.priority, $7,
                   CASE WHEN s.status = 'queued' THEN NULL ELSE now() END,
                   coalesce(c.error, {key_error_of("r.resolved")}),
                   {keys_of("r.resolved")},
                   j.handler, coalesce(c.payload, j.payload), j.queue, j.timeout, j.max_retries, j.initial_backoff,
                   j.max_backoff, j.retry_jitter
            FROM claimed c JOIN jobs j ON j.id = c.job_id
            -- A run's limit keys come from its resolved payload; if they cannot be resolved the run
            -- is dead at once (its dependents follow their rules), as for an unresolved reference.
            CROSS JOIN LATERAL (
                SELECT CASE WHEN c.status = 'queued'
                            THEN {resolved_limit_keys("j.limits", "coalesce(c.payload, j.payload)")} END AS resolved
            ) r
            CROSS JOIN LATERAL (
                SELECT CASE WHEN jsonb_typeof(r.resolved) = 'string' THEN 'dead' ELSE c.status END AS status
            ) s
            RETURNING id AS run_id, job_id, scheduled_for, status, priority, due_at, handler, queue, payload, error,
                      limit_keys
            """,
            uuid.UUID(flow_run_id),
            [new_execution_id() for _ in decisions],
            [uuid.UUID(decision.job_id) for decision in decisions],
            [decision.status for decision in decisions],
            [decision.payload for decision in decisions],
            [decision.error for decision in decisions],
            term,
        )

    async def payloads(self, job_ids: Sequence[str]) -> dict[str, dict[str, Any]]:
        """The payload of each job as it is now, by job id (only read for nodes about to run)."""
        rows = await self._pool.fetch(
            "SELECT id, payload FROM jobs WHERE id = ANY($1::uuid[])", [uuid.UUID(value) for value in job_ids]
        )
        return {str(row["id"]): row["payload"] for row in rows}

    async def finish(self, flow_run_id: str, state: str) -> bool:
        """Close a running flow run whose every node is final (compare-and-set from running)."""
        result = await self._pool.execute(
            "UPDATE flow_runs SET state = $2, finished_at = now() WHERE id = $1 AND state = 'running'",
            uuid.UUID(flow_run_id),
            state,
        )
        return bool(result == "UPDATE 1")

    async def cancel(self, flow_run_id: str) -> tuple[list[tuple[str, str]], list[Recorded]]:
        """Cancel a running flow run: its waiting nodes are recorded `cancelled` (a history row
        each) and the flow run `cancelled`, in one transaction.

        Returns:
            `(run_id, queue)` of the runs of its nodes that were created already, for the caller to
            cancel (those already finished are left as they are by the cancel), and the `cancelled`
            rows recorded for the waiting nodes, to be announced.

        Raises:
            NotFound: no such flow run.
            FailedPrecondition: it has already finished.
        """
        key = _uuid(flow_run_id)
        if not isinstance(self._pool, asyncpg.Pool):
            raise TypeError("cancel() needs a repository over a pool")
        async with self._pool.acquire() as conn, conn.transaction():
            inner = FlowRepository(conn, scope=self._scope)
            state = await conn.fetchval("SELECT state FROM flow_runs WHERE id = $1 FOR UPDATE", key)
            if state is None:
                raise NotFound(f"flow run {flow_run_id} not found")
            if state != "running":
                raise FailedPrecondition(f"id: flow run {flow_run_id} has already finished ({state})")
            waiting = await conn.fetch("SELECT job_id FROM flow_nodes WHERE flow_run_id = $1 AND run_id IS NULL", key)
            _, recorded = await inner.decide(
                flow_run_id,
                [NodeDecision(str(row["job_id"]), "cancelled", error="cancelled: its flow run was cancelled")
                 for row in waiting],
                None,
            )  # fmt: skip
            await conn.execute("UPDATE flow_runs SET state = 'cancelled', finished_at = now() WHERE id = $1", key)
            started = await conn.fetch(
                """SELECT n.run_id, coalesce(e.queue, j.queue) AS queue
                   FROM flow_nodes n JOIN jobs j ON j.id = n.job_id
                   JOIN job_executions e ON e.id = n.run_id AND e.scheduled_for = n.run_scheduled_for
                   WHERE n.flow_run_id = $1""",
                key,
            )
        return [(str(row["run_id"]), row["queue"]) for row in started], recorded

    async def get(self, flow_run_id: str) -> FlowRun:
        """A flow run with every node and its state.

        Raises:
            NotFound: no such flow run.
        """
        key = _uuid(flow_run_id)
        row = await self._pool.fetchrow(
            "SELECT id, root_job_id, state, created_at, finished_at FROM flow_runs WHERE id = $1", key
        )
        if row is None:
            raise NotFound(f"flow run {flow_run_id} not found")
        nodes = await self._pool.fetch(_NODES, [key])
        return FlowRun(
            id=str(row["id"]),
            root_job_id=str(row["root_job_id"]),
            state=row["state"],
            created_at=row["created_at"],
            finished_at=row["finished_at"],
            nodes=tuple(_node(node) for node in nodes),
        )

    async def upstream_results(self, run_id: str) -> dict[str, Any]:
        """For a run a flow run created: the result of each of its upstream nodes' runs, by job name
        (None where the run has no result, e.g. it failed); empty for a run outside any flow run.
        What the worker hands the handler as `ExecutionContext.upstream_results`."""
        return (await RunRepository(self._pool).upstream_results([run_id])).get(run_id, {})

    async def flow_of_run(self, run_id: str) -> str | None:
        """The flow run a run belongs to, if any."""
        value = await self._pool.fetchval("SELECT flow_run_id FROM flow_nodes WHERE run_id = $1", _uuid(run_id))
        return str(value) if value is not None else None

    async def run_ids(self, flow_run_id: str) -> list[str]:
        """The runs of a flow run's nodes (ListExecutions / WatchExecutions by flow run)."""
        rows = await self._pool.fetch(
            "SELECT run_id FROM flow_nodes WHERE flow_run_id = $1 AND run_id IS NOT NULL", _uuid(flow_run_id)
        )
        return [str(row["run_id"]) for row in rows]
