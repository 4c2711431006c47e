"""Flow runs and job relations as people look at them, through the application layer: the console's
flow pages, the job page's upstreams and downstreams, names for ids, ListFlowRuns.

Functions taking a `Control` (the one door of the console and the servicers): they read through
`db.flow_views.FlowViews` over Control's pool, and never write.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import datetime

from scheduler_grpc.control import Control
from scheduler_grpc.db.flow_views import (
    FLOW_STATES,
    ExecutionLabel,
    FlowRunSummary,
    FlowRunView,
    FlowViews,
    NodeView,
    Related,
)
from scheduler_grpc.errors import InvalidArgument, NotFound

__all__ = [
    "FLOW_STATES",
    "ExecutionLabel",
    "FlowRunSummary",
    "FlowRunView",
    "NodeView",
    "Related",
    "execution_labels",
    "flow_run_view",
    "job_names",
    "job_relations",
    "list_flow_runs",
    "resolve_job",
]


def _views(control: Control) -> FlowViews:
    # Control's pool: these reads belong to no repository of its own (they join several tables).
    return FlowViews(control._pool)


async def flow_run_view(control: Control, flow_run_id: str) -> FlowRunView:
    """A flow run with each node's latest attempt: state, timing, error.

    Raises:
        InvalidArgument: not an id (`id`).
        NotFound: no such flow run.
    """
    return await _views(control).flow_run(flow_run_id)


async def list_flow_runs(
    control: Control,
    *,
    root_job_id: str | None = None,
    state: str | None = None,
    before: tuple[datetime, str] | None = None,
    limit: int = 50,
) -> list[FlowRunSummary]:
    """Flow runs newest first, before `before` (created_at, id), by root job and state.

    Raises:
        InvalidArgument: an unknown `state`, a `root_job_id` that is not an id, a `limit` out of range.
    """
    return await _views(control).flow_runs(root_job_id=root_job_id, state=state, before=before, limit=limit)


async def job_relations(control: Control, job_id: str) -> tuple[list[Related], list[Related]]:
    """A job's upstreams (in its `depends_on` order) and its downstreams (by name)."""
    return await _views(control).job_relations(job_id)


async def job_names(control: Control, job_ids: Iterable[str]) -> dict[str, str]:
    """The name of each job among `job_ids` that exists, by id."""
    return await _views(control).job_names(job_ids)


async def execution_labels(control: Control, execution_ids: Sequence[str]) -> dict[str, ExecutionLabel]:
    """The job name and trigger of each execution among `execution_ids` that exists, by id."""
    return await _views(control).execution_labels(execution_ids)


async def resolve_job(control: Control, reference: str, field: str = "job") -> str:
    """The id of the job `reference` names: an id, or else a name.

    Raises:
        InvalidArgument: an empty reference (`field`).
        NotFound: no job has that id or name.
    """
    reference = reference.strip()
    if not reference:
        raise InvalidArgument(field, "name a job by its name or id")
    try:
        return (await control.jobs.get(reference)).id
    except (NotFound, InvalidArgument):
        # Not an id, or an id of no job: a job may be named like one, so its name is the next reading.
        return (await control.jobs.get_by_name(reference)).id
