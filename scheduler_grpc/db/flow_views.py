"""The reads behind the console's flow pages and ListFlowRuns: flow runs listed and viewed with each
node's latest attempt, a job's neighbours in the dependency graph, names for ids, and what a live
row shows of an execution. `control_flows` is their door for the console and the servicers.

Every list is keyset-paginated and served by an index (migration 0011 adds the flow runs' list
indexes), so a page stays fast however long the history is.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Final

import asyncpg

from scheduler_grpc.db.attempts import latest_attempt
from scheduler_grpc.errors import InvalidArgument, NotFound
from scheduler_grpc.flows import FlowRun, Node, TriggerRule

FLOW_STATES: Final = ("running", "succeeded", "failed", "cancelled")
MAX_FLOW_PAGE: Final = 1000
# Error text shown per node on a flow run page (the execution page has all of it).
NODE_ERROR_CHARS: Final = 2000
READ_TIMEOUT: Final = 5.0
"""Seconds each read here may take (a page then shows the store as not answering)."""


def _key(value: str, field: str) -> uuid.UUID:
    try:
        return uuid.UUID(value)
    except (ValueError, AttributeError, TypeError):
        raise InvalidArgument(field, f"{value!r} is not a valid id") from None


def _keys(values: Iterable[str]) -> list[uuid.UUID]:
    """The values that are UUIDs (others name nothing stored here)."""
    keys = []
    for value in values:
        try:
            keys.append(uuid.UUID(value))
        except (ValueError, AttributeError, TypeError):
            continue
    return keys


@dataclass(frozen=True)
class FlowRunSummary:
    """A flow run as a list shows it.

    Attributes:
        id: The flow run (its root run's id).
        root_job_id: The job whose run started it.
        root_job_name: That job's name.
        state: running, succeeded, failed or cancelled.
        created_at: When it started.
        finished_at: When it finished (None while running).
        nodes: How many jobs it holds.
        finished_nodes: How many of them have a run in a final state.
    """

    id: str
    root_job_id: str
    root_job_name: str
    state: str
    created_at: datetime
    finished_at: datetime | None
    nodes: int
    finished_nodes: int


@dataclass(frozen=True)
class NodeView:
    """A node of a flow run with its run's latest attempt: state, timing and error.

    Attributes:
        node: The node (job, upstreams inside the flow run, rule, run, status).
        attempt: The latest attempt's number (0 while waiting).
        started_at: When that attempt started.
        finished_at: When it finished.
        error: Its error (bounded to NODE_ERROR_CHARS), empty if none.
    """

    node: Node
    attempt: int
    started_at: datetime | None
    finished_at: datetime | None
    error: str


@dataclass(frozen=True)
class FlowRunView:
    """A flow run with every node's state, timing and error, by job name."""

    flow: FlowRun
    root_job_name: str
    nodes: tuple[NodeView, ...]


@dataclass(frozen=True)
class Related:
    """A job next to another in the dependency graph."""

    id: str
    name: str
    trigger_rule: TriggerRule


@dataclass(frozen=True)
class ExecutionLabel:
    """What a live row shows of an execution besides its event: the job's name and the trigger."""

    job_name: str
    trigger: str


# Whether a node's latest attempt has ended for good (a flow counts it among its finished jobs).
_FINAL = "a.status IN ('succeeded', 'dead', 'cancelled', 'upstream_failed', 'skipped', 'missed') AS final"

_NODE_ATTEMPT = "a.id, a.status, a.attempt, a.started_at, a.finished_at, a.error"
# The slot beside each node's run id (migration 0017): one partition per node.
_NODE_VIEWS = f"""
    SELECT n.job_id, j.name, n.upstream_ids, n.trigger_rule, n.run_id, x.id AS execution_id, x.status, x.attempt,
           x.started_at, x.finished_at, left(x.error, $2) AS error
    FROM flow_nodes n JOIN jobs j ON j.id = n.job_id
    LEFT JOIN LATERAL {latest_attempt("n.run_id", _NODE_ATTEMPT, slot="n.run_scheduled_for")} x ON true
    WHERE n.flow_run_id = $1
    ORDER BY j.name
"""


class FlowViews:
    """The console's and ListFlowRuns' reads of flows and job relations, each under `timeout` seconds."""

    def __init__(self, pool: asyncpg.Pool, *, timeout: float = READ_TIMEOUT) -> None:
        self._pool = pool
        self._timeout = timeout

    async def flow_run(self, flow_run_id: str) -> FlowRunView:
        """A flow run with each node's latest attempt (state, timing, error): two statements.

        Raises:
            InvalidArgument: not an id (`id`).
            NotFound: no such flow run.
        """
        key = _key(flow_run_id, "id")
        row = await self._pool.fetchrow(
            """SELECT f.id, f.root_job_id, j.name, f.state, f.created_at, f.finished_at
               FROM flow_runs f JOIN jobs j ON j.id = f.root_job_id WHERE f.id = $1""",
            key,
            timeout=self._timeout,
        )
        if row is None:
            raise NotFound(f"flow run {flow_run_id} not found")
        views = []
        for node_row in await self._pool.fetch(_NODE_VIEWS, key, NODE_ERROR_CHARS, timeout=self._timeout):
            node = Node(
                job_id=str(node_row["job_id"]),
                job_name=node_row["name"],
                upstream_ids=tuple(str(value) for value in node_row["upstream_ids"]),
                trigger_rule=TriggerRule(node_row["trigger_rule"]),
                run_id=str(node_row["run_id"]) if node_row["run_id"] is not None else None,
                status=node_row["status"],
                execution_id=str(node_row["execution_id"]) if node_row["execution_id"] is not None else None,
            )
            views.append(
                NodeView(
                    node=node,
                    attempt=node_row["attempt"] or 0,
                    started_at=node_row["started_at"],
                    finished_at=node_row["finished_at"],
                    error=node_row["error"] or "",
                )
            )
        flow = FlowRun(
            id=str(row["id"]),
            root_job_id=str(row["root_job_id"]),
            state=row["state"],
            created_at=row["created_at"],
            finished_at=row["finished_at"],
            nodes=tuple(view.node for view in views),
        )
        return FlowRunView(flow=flow, root_job_name=row["name"], nodes=tuple(views))

    async def flow_runs(
        self,
        *,
        root_job_id: str | None = None,
        state: str | None = None,
        before: tuple[datetime, str] | None = None,
        limit: int = 50,
    ) -> list[FlowRunSummary]:
        """Flow runs newest first, before the keyset position `before` (created_at, id), filtered
        by the job that started them and by state.

        Raises:
            InvalidArgument: an unknown `state`, a `root_job_id` that is not an id, a `limit` out of range.
        """
        if state is not None and state not in FLOW_STATES:
            raise InvalidArgument("state", f"expected one of {', '.join(FLOW_STATES)}")
        if not 1 <= limit <= MAX_FLOW_PAGE + 1:
            raise InvalidArgument("page_size", f"must be between 1 and {MAX_FLOW_PAGE}")
        conditions: list[str] = []
        args: list[object] = []
        if root_job_id is not None:
            args.append(_key(root_job_id, "root_job_id"))
            conditions.append(f"f.root_job_id = ${len(args)}")
        if state is not None:
            args.append(state)
            conditions.append(f"f.state = ${len(args)}")
        if before is not None:
            args += [before[0], _key(before[1], "page_token")]
            conditions.append(f"(f.created_at, f.id) < (${len(args) - 1}, ${len(args)})")
        args.append(limit)
        # The page first (an index range), then the counts of its rows' nodes only.
        rows = await self._pool.fetch(
            f"""SELECT p.*, j.name AS root_job_name, c.nodes, c.finished_nodes
                FROM (SELECT f.id, f.root_job_id, f.state, f.created_at, f.finished_at FROM flow_runs f
                      {"WHERE " + " AND ".join(conditions) if conditions else ""}
                      ORDER BY f.created_at DESC, f.id DESC LIMIT ${len(args)}) p
                JOIN jobs j ON j.id = p.root_job_id
                CROSS JOIN LATERAL (
                    SELECT count(*) AS nodes, count(*) FILTER (WHERE x.final) AS finished_nodes
                    FROM flow_nodes n
                    LEFT JOIN LATERAL {latest_attempt("n.run_id", _FINAL, slot="n.run_scheduled_for")} x ON true
                    WHERE n.flow_run_id = p.id
                ) c
                ORDER BY p.created_at DESC, p.id DESC""",
            *args,
            timeout=self._timeout,
        )
        return [
            FlowRunSummary(
                id=str(row["id"]),
                root_job_id=str(row["root_job_id"]),
                root_job_name=row["root_job_name"],
                state=row["state"],
                created_at=row["created_at"],
                finished_at=row["finished_at"],
                nodes=row["nodes"],
                finished_nodes=row["finished_nodes"],
            )
            for row in rows
        ]

    async def job_relations(self, job_id: str) -> tuple[list[Related], list[Related]]:
        """A job's upstreams (in its `depends_on` order) and its downstreams (by name)."""
        rows = await self._pool.fetch(
            """SELECT 'up' AS side, j.id, j.name, j.trigger_rule, d.position FROM job_dependencies d
                   JOIN jobs j ON j.id = d.upstream_id WHERE d.job_id = $1
               UNION ALL
               SELECT 'down', j.id, j.name, j.trigger_rule, 0 FROM job_dependencies d
                   JOIN jobs j ON j.id = d.job_id WHERE d.upstream_id = $1
               ORDER BY 1, 5, 3""",
            _key(job_id, "id"),
            timeout=self._timeout,
        )
        related: dict[str, list[Related]] = {"up": [], "down": []}
        for row in rows:
            related[row["side"]].append(Related(str(row["id"]), row["name"], TriggerRule(row["trigger_rule"])))
        return related["up"], related["down"]

    async def job_names(self, job_ids: Iterable[str]) -> dict[str, str]:
        """The name of each job among `job_ids` that exists, by id (ids that are not UUIDs are skipped)."""
        keys = _keys(job_ids)
        if not keys:
            return {}
        rows = await self._pool.fetch(
            "SELECT id, name FROM jobs WHERE id = ANY($1::uuid[])", keys, timeout=self._timeout
        )
        return {str(row["id"]): row["name"] for row in rows}

    async def execution_labels(self, execution_ids: Sequence[str]) -> dict[str, ExecutionLabel]:
        """The job name and trigger of each execution among `execution_ids` that exists, by id."""
        keys = _keys(execution_ids)
        if not keys:
            return {}
        rows = await self._pool.fetch(
            """SELECT e.id, e.trigger, coalesce(j.name, '') AS name
               FROM job_executions e LEFT JOIN jobs j ON j.id = e.job_id WHERE e.id = ANY($1::uuid[])""",
            keys,
            timeout=self._timeout,
        )
        return {str(row["id"]): ExecutionLabel(row["name"], row["trigger"]) for row in rows}
