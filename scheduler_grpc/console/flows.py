"""The console's flow pages: the flow runs list, a flow run's DAG (live while it runs), cancelling one.

A flow run page draws the DAG on the server (`dag.layout`, an inline SVG: no script draws it) with
each node's state, timing and error, and lists the nodes in a table. While the flow run is open the
page subscribes to `/flows/{id}/events`, the console's live mechanism (Server-Sent Events from the
WatchExecutions fan-out, filtered by the flow run's jobs, from the position read before the page),
and on each event fetches the server-rendered graph again (`/flows/{id}/graph`), at most a few times
a second. Every read goes through `Control` (`Control.flow_reads`, `control_flows`).
"""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime
from typing import Any, Final

from aiohttp import web

from scheduler_grpc import redaction
from scheduler_grpc.console import dag, sse
from scheduler_grpc.console.context import CONSOLE, render
from scheduler_grpc.console.security import PRINCIPAL, rpc
from scheduler_grpc.control_flows import FLOW_STATES
from scheduler_grpc.errors import InvalidArgument
from scheduler_grpc.events import EventFilter, ExecutionEvent

PAGE_SIZE: Final = 50
_V: Final = "/scheduler.v1."


def _before(value: str) -> tuple[datetime, str]:
    time_text, _, flow_id = value.partition("_")
    try:
        moment = datetime.fromisoformat(time_text)
    except ValueError:
        raise InvalidArgument("before", "not a position of this list (follow its 'older' link)") from None
    return (moment if moment.tzinfo else moment.replace(tzinfo=UTC)), flow_id


@rpc(_V + "ExecutionService/ListFlowRuns")
async def flow_runs(request: web.Request) -> web.StreamResponse:
    """The flow runs, newest first, by the job that started them (name or id) and state."""
    control = request.app[CONSOLE].api.control
    query = request.query
    root = await control.flow_reads.resolve_job(query["job"]) if query.get("job") else None
    state = query.get("state") or None
    before = _before(query["before"]) if query.get("before") else None
    rows = await control.flow_reads.list_flow_runs(root_job_id=root, state=state, before=before, limit=PAGE_SIZE + 1)
    next_query = None
    if len(rows) > PAGE_SIZE:
        rows = rows[:PAGE_SIZE]
        last = rows[-1]
        next_query = {
            **{k: v for k, v in query.items() if k != "before"},
            "before": f"{last.created_at.isoformat()}_{last.id}",
        }
    return await render(
        request,
        "flow_runs.html",
        {"rows": rows, "query": query, "states": FLOW_STATES, "next_query": next_query},
    )


async def _graph_values(request: web.Request) -> dict[str, Any]:
    console = request.app[CONSOLE]
    # Where a live page's stream starts: the fan-out's position before the read, so no event
    # between the read and the subscription is missed.
    cursor = console.api.fanout.position
    view = await console.api.control.flow_reads.flow_run_view(request.match_info["id"])
    # The nodes' errors as the caller may read them: the table and the drawing's tooltips alike.
    role = request[PRINCIPAL].role
    view = replace(view, nodes=tuple(replace(node, error=redaction.error_for(role, node.error)) for node in view.nodes))
    now = datetime.now(UTC)
    depth = dag.depths(view.nodes)
    graph = dag.layout(view.nodes, now)
    return {
        "svg": dag.svg(graph, console.templates.filters["secs"]),
        # The table in the drawing's order: by depth, then by name.
        "ordered": sorted(view.nodes, key=lambda node: (depth[node.node.job_id], node.node.job_name)),
        "view": view,
        "flow": view.flow,
        "names": {node.node.job_id: node.node.job_name for node in view.nodes},
        "now": now,
        "cursor": cursor if cursor != "0-0" else "",
        "finished": sum(1 for node in view.nodes if node.node.state in dag.FINAL),
    }


@rpc(_V + "ExecutionService/GetFlowRun")
async def flow_run(request: web.Request) -> web.StreamResponse:
    """A flow run: its DAG with each node's state, timing and error, and the nodes' table."""
    return await render(request, "flow_run.html", await _graph_values(request))


@rpc(_V + "ExecutionService/GetFlowRun")
async def flow_graph(request: web.Request) -> web.StreamResponse:
    """The flow run page's live part alone (what the page fetches again on each event)."""
    return await render(request, "_flow_graph.html", await _graph_values(request))


@rpc(_V + "ExecutionService/CancelFlowRun")
async def cancel_flow_run(request: web.Request) -> web.StreamResponse:
    flow = await request.app[CONSOLE].api.control.cancel_flow_run(request.match_info["id"])
    raise web.HTTPSeeOther(f"/flows/{flow.id}")


@rpc(_V + "ExecutionService/WatchExecutions")
async def flow_events(request: web.Request) -> web.StreamResponse:
    """Server-Sent Events: a `data: {}` message whenever a job of the flow run has an event (the
    page then fetches its graph again); `event: done` once the flow run has finished."""
    flow = await request.app[CONSOLE].api.control.get_flow_run(request.match_info["id"])
    if flow.state != "running":
        response = sse.stream_response()
        await response.prepare(request)
        await response.write(b"event: done\ndata: {}\n\n")
        return response

    async def encode(event: ExecutionEvent) -> bytes:
        return b"{}"

    return await sse.relay(request, EventFilter(job_ids=frozenset(node.job_id for node in flow.nodes)), encode)


ROUTES: Final = (
    web.get("/flows", flow_runs),
    web.get("/flows/{id}", flow_run),
    web.get("/flows/{id}/graph", flow_graph),
    web.get("/flows/{id}/events", flow_events),
    web.post("/flows/{id}/cancel", cancel_flow_run),
)
