"""Flow runs and job relations as people look at them, through the application layer: the console's
flow pages, the job page's upstreams and downstreams, names for ids, ListFlowRuns.

`FlowReads` is reached as `Control.flow_reads` (Control, the one door of the console and the
servicers, builds it over its pool): it reads through `db.flow_views.FlowViews` and never writes.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Sequence
from datetime import datetime

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
from scheduler_grpc.jobs import Job

__all__ = [
    "FLOW_STATES",
    "ExecutionLabel",
    "FlowReads",
    "FlowRunSummary",
    "FlowRunView",
    "NodeView",
    "Related",
]


JobLookup = Callable[[str], Awaitable[Job]]


class FlowReads:
    """The flow reads of the application layer (`Control.flow_reads`)."""

    def __init__(self, views: FlowViews, *, job_by_id: JobLookup, job_by_name: JobLookup) -> None:
        self._views = views
        # Control's own job reads: a reference to a job resolves by the rules every door uses.
        self._job_by_id = job_by_id
        self._job_by_name = job_by_name

    async def flow_run_view(self, flow_run_id: str) -> FlowRunView:
        """A flow run with each node's latest attempt: state, timing, error.

        Raises:
            InvalidArgument: not an id (`id`).
            NotFound: no such flow run.
        """
        return await self._views.flow_run(flow_run_id)

    async def list_flow_runs(
        self,
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
        return await self._views.flow_runs(root_job_id=root_job_id, state=state, before=before, limit=limit)

    async def job_relations(self, job_id: str) -> tuple[list[Related], list[Related]]:
        """A job's upstreams (in its `depends_on` order) and its downstreams (by name)."""
        return await self._views.job_relations(job_id)

    async def job_names(self, job_ids: Iterable[str]) -> dict[str, str]:
        """The name of each job among `job_ids` that exists, by id."""
        return await self._views.job_names(job_ids)

    async def execution_labels(self, execution_ids: Sequence[str]) -> dict[str, ExecutionLabel]:
        """The job name and trigger of each execution among `execution_ids` that exists, by id."""
        return await self._views.execution_labels(execution_ids)

    async def resolve_job(self, reference: str, field: str = "job") -> str:
        """The id of the job `reference` names: an id, or else a name.

        Raises:
            InvalidArgument: an empty reference (`field`).
            NotFound: no job has that id or name.
        """
        reference = reference.strip()
        if not reference:
            raise InvalidArgument(field, "name a job by its name or id")
        try:
            return (await self._job_by_id(reference)).id
        except (NotFound, InvalidArgument):
            # Not an id, or an id of no job: a job may be named like one, so its name is the next reading.
            return (await self._job_by_name(reference)).id
