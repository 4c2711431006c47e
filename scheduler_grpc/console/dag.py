"""A flow run's DAG laid out for a server-rendered SVG: layers by depth, no script, no library.

`svg` writes the drawing out (every value escaped): in Python rather than in a template, since a
200-job flow is some thousand elements and a template's per-element cost would be most of the page.

Each node's layer is its depth: the longest path from a node without upstreams (so every edge goes
left to right). Within a layer, nodes are ordered by the mean row of their upstreams (one
barycentric pass, which keeps most edges short), ties by name. Pure code: no I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Final

from markupsafe import Markup, escape

from scheduler_grpc.control_flows import NodeView

NODE_WIDTH: Final = 180
NODE_HEIGHT: Final = 44
COLUMN_GAP: Final = 56
ROW_GAP: Final = 14
PADDING: Final = 12
NAME_CHARS: Final = 24
FINAL: Final = frozenset({"succeeded", "dead", "cancelled", "upstream_failed", "skipped", "missed"})


@dataclass(frozen=True)
class Box:
    """A node drawn: its place, its label lines and tooltip, and where it links."""

    x: int
    y: int
    name: str
    full_name: str
    state: str
    seconds: float | None
    attempt: int
    error: str
    href: str
    job_id: str


@dataclass(frozen=True)
class Edge:
    """An upstream -> downstream arrow, as an SVG path."""

    path: str
    state: str


@dataclass(frozen=True)
class Graph:
    """The whole drawing: its size, boxes and edges."""

    width: int
    height: int
    boxes: tuple[Box, ...]
    edges: tuple[Edge, ...]
    node_width: int = NODE_WIDTH
    node_height: int = NODE_HEIGHT


def depths(nodes: Sequence[NodeView]) -> dict[str, int]:
    """Each node's layer: the longest upstream path to it inside the flow run (upstreams outside it
    are ignored; a node on a cycle, which a flow run cannot hold, stays in layer 0)."""
    ids = {view.node.job_id for view in nodes}
    upstreams = {view.node.job_id: [u for u in view.node.upstream_ids if u in ids] for view in nodes}
    downstreams: dict[str, list[str]] = {job: [] for job in ids}
    for job, ups in upstreams.items():
        for up in ups:
            downstreams[up].append(job)
    waiting = {job: len(ups) for job, ups in upstreams.items()}
    depth = dict.fromkeys(ids, 0)
    ready = sorted(job for job, count in waiting.items() if count == 0)
    while ready:
        job = ready.pop()
        for down in downstreams[job]:
            depth[down] = max(depth[down], depth[job] + 1)
            waiting[down] -= 1
            if waiting[down] == 0:
                ready.append(down)
    return depth


def _seconds(view: NodeView, now: datetime) -> float | None:
    """How long the node's latest attempt ran (so far, while it runs)."""
    if view.started_at is None:
        return None
    return max(0.0, ((view.finished_at or now) - view.started_at).total_seconds())


def layout(nodes: Sequence[NodeView], now: datetime) -> Graph:
    """The drawing of a flow run's nodes (`now`: the end of a running node's time so far)."""
    depth = depths(nodes)
    by_id = {view.node.job_id: view for view in nodes}
    layers: dict[int, list[str]] = {}
    for view in sorted(nodes, key=lambda v: v.node.job_name):
        layers.setdefault(depth[view.node.job_id], []).append(view.node.job_id)
    row: dict[str, float] = {}
    for level in sorted(layers):
        members = layers[level]

        def barycentre(job: str) -> float:
            ups = [row[u] for u in by_id[job].node.upstream_ids if u in row]
            return sum(ups) / len(ups) if ups else 0.0

        if level > 0:
            members.sort(key=lambda job: (barycentre(job), by_id[job].node.job_name))
        for index, job in enumerate(members):
            row[job] = float(index)
    x_of = {job: PADDING + depth[job] * (NODE_WIDTH + COLUMN_GAP) for job in by_id}
    y_of = {job: PADDING + int(row[job]) * (NODE_HEIGHT + ROW_GAP) for job in by_id}
    boxes = []
    for job, view in by_id.items():
        node = view.node
        name = node.job_name if len(node.job_name) <= NAME_CHARS else node.job_name[: NAME_CHARS - 1] + "…"
        boxes.append(
            Box(
                x=x_of[job],
                y=y_of[job],
                name=name,
                full_name=node.job_name,
                state=node.state,
                seconds=_seconds(view, now),
                attempt=view.attempt,
                error=view.error,
                href=f"/executions/{node.execution_id}" if node.execution_id else f"/jobs/{node.job_id}",
                job_id=job,
            )
        )
    edges = []
    for job, view in by_id.items():
        for up in view.node.upstream_ids:
            if up not in by_id:
                continue
            x1, y1 = x_of[up] + NODE_WIDTH, y_of[up] + NODE_HEIGHT // 2
            x2, y2 = x_of[job], y_of[job] + NODE_HEIGHT // 2
            middle = (x1 + x2) / 2
            edges.append(
                Edge(
                    path=f"M{x1},{y1} C{middle:.0f},{y1} {middle:.0f},{y2} {x2 - 4},{y2}",
                    state=by_id[up].node.state,
                )
            )
    columns = max(depth.values(), default=0) + 1
    rows = max((len(members) for members in layers.values()), default=1)
    return Graph(
        width=2 * PADDING + columns * NODE_WIDTH + (columns - 1) * COLUMN_GAP,
        height=2 * PADDING + rows * NODE_HEIGHT + (rows - 1) * ROW_GAP,
        boxes=tuple(sorted(boxes, key=lambda box: (box.x, box.y))),
        edges=tuple(edges),
    )


def svg(graph: Graph, seconds: Callable[[float], str]) -> Markup:
    """The drawing as an inline `<svg>` (`seconds` formats a run time as the rest of the console does).

    Each node is a link (to its execution, or its job while it waits) with `data-name` and
    `data-state`, a tooltip (`<title>`: name, state, attempt, run time, error) and two lines of text.
    """
    parts = [
        f'<svg class="dag" id="dag" viewBox="0 0 {graph.width} {graph.height}" width="{graph.width}" '
        f'height="{graph.height}" role="img" aria-label="the flow run\'s jobs and their dependencies">'
        '<defs><marker id="arrow" viewBox="0 0 8 8" refX="7" refY="4" markerWidth="7" markerHeight="7" '
        'orient="auto"><path d="M0,0 L8,4 L0,8 z" class="arrow-head"></path></marker></defs>'
    ]
    parts.extend(
        f'<path class="edge e-{escape(edge.state)}" d="{edge.path}" marker-end="url(#arrow)"></path>'
        for edge in graph.edges
    )
    for box in graph.boxes:
        took = seconds(box.seconds) if box.seconds is not None else ""
        title = f"{box.full_name}: {box.state}"
        if box.attempt > 1:
            title += f", attempt {box.attempt}"
        if took:
            title += f", {took}"
        if box.error:
            title += f"\n{box.error}"
        line = box.state.replace("_", " ") + (f" · {took}" if took else "") + (" · error" if box.error else "")
        parts.append(
            f'<a href="{escape(box.href)}" class="node n-{escape(box.state)}" data-job="{escape(box.job_id)}" '
            f'data-name="{escape(box.full_name)}" data-state="{escape(box.state)}"><title>{escape(title)}</title>'
            f'<rect x="{box.x}" y="{box.y}" width="{graph.node_width}" height="{graph.node_height}" rx="6"></rect>'
            f'<text x="{box.x + 8}" y="{box.y + 17}" class="node-name">{escape(box.name)}</text>'
            f'<text x="{box.x + 8}" y="{box.y + 34}" class="node-state">{escape(line)}</text></a>'
        )
    parts.append("</svg>")
    return Markup("".join(parts))
