"""The leader's flow loop: advance open flow runs (see `scheduler_grpc.flows` for the rules).

Each step reads the nodes of the open flow runs from PostgreSQL (the record: a worker that died
between finishing an upstream run and anything else has lost nothing, its outcome is in
PostgreSQL), decides every waiting node whose upstream runs are all final, and writes the
decisions of one flow run in ONE transaction fenced by the leader's term (`FlowRepository.decide`:
a compare-and-set keyed on (flow run, job), so a node gets one run even if two leaders, or a leader
and a CancelFlowRun, race). Then the new queued runs are announced and enqueued (PostgreSQL first;
reconcile re-enqueues a queued run Redis lacks). A flow run whose every node is final is closed.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from redis.asyncio import Redis

from scheduler_grpc import events, outputs
from scheduler_grpc.db.executions import Queued
from scheduler_grpc.db.flows import FlowRepository, NodeDecision, OpenNode, Recorded
from scheduler_grpc.dispatch import Queues, dispatch_new_runs
from scheduler_grpc.events import EventType, ExecutionEvent
from scheduler_grpc.flows import (
    Decision,
    Outcome,
    UnresolvedReference,
    decide,
    flow_state,
    outcome,
    references,
    resolve_payload,
)

log = logging.getLogger(__name__)

FLOW_PAGE = 200  # flow runs read per query; a step pages through every open flow run
PAUSED_ERROR = "skipped: its job is paused"


_EVENT_OF = {
    "upstream_failed": EventType.UPSTREAM_FAILED,
    "skipped": EventType.SKIPPED,
    "cancelled": EventType.CANCELLED,
    "dead": EventType.DEAD,
}


def recorded_events(recorded: Sequence[Recorded]) -> list[ExecutionEvent]:
    """The event of each row a flow run recorded for a job it did not run."""
    return [
        ExecutionEvent(_EVENT_OF[row.status], row.run_id, row.run_id, row.job_id, 1, handler=row.handler,
                       error=row.error)
        for row in recorded
    ]  # fmt: skip


def _outcome(node: OpenNode) -> Outcome | None:
    # A node whose run has no row any more (its history was pruned, or deleted with its job)
    # counts as failed, so the flow run can still end rather than wait for ever.
    if node.run_id is not None and node.status is None:
        return Outcome.FAILED
    return outcome(node.status)


def _decisions(nodes: Sequence[OpenNode]) -> list[tuple[OpenNode, Decision]]:
    by_job = {node.job_id: node for node in nodes}
    ready: list[tuple[OpenNode, Decision]] = []
    for node in nodes:
        if node.run_id is not None:
            continue
        # An upstream node that is gone (its job deleted meanwhile) counts as skipped.
        outcomes = [
            _outcome(by_job[upstream]) if upstream in by_job else Outcome.SKIPPED for upstream in node.upstream_ids
        ]
        decision = decide(node.trigger_rule, outcomes)
        if decision is not None:
            ready.append((node, decision))
    return ready


async def _decide_flow(
    flows: FlowRepository, flow_run_id: str, nodes: Sequence[OpenNode], term: int
) -> tuple[list[Queued], list[Recorded], int]:
    """Decide and record the ready nodes of one flow run; returns the runs queued, the rows
    recorded as not run, and how many nodes were decided."""
    ready = _decisions(nodes)
    if not ready:
        state = flow_state([_outcome(node) for node in nodes])
        if state is not None:
            async with flows.fenced(term) as fenced:
                await fenced.finish(flow_run_id, state)
        return [], [], 0
    by_job = {node.job_id: node for node in nodes}
    to_run = [node.job_id for node, decision in ready if decision is Decision.RUN and not node.job_paused]
    payloads = await flows.payloads(to_run) if to_run else {}
    decisions: list[NodeDecision] = []
    for node, decision in ready:
        if decision is not Decision.RUN:
            error = "upstream failed" if decision is Decision.UPSTREAM_FAILED else "trigger rule not met"
            decisions.append(NodeDecision(node.job_id, decision.value, error=f"{error} ({node.trigger_rule})"))
            continue
        if node.job_paused:
            decisions.append(NodeDecision(node.job_id, "skipped", error=PAUSED_ERROR))
            continue
        payload = payloads.get(node.job_id, {})
        if not references(payload):
            decisions.append(NodeDecision(node.job_id, "queued"))
            continue
        upstreams = [by_job[upstream] for upstream in node.upstream_ids if upstream in by_job]
        results = await flows.results([up.run_id for up in upstreams if up.run_id is not None])
        named = {up.job_name: results.get(up.run_id) if up.run_id else None for up in upstreams}
        try:
            resolved = resolve_payload(payload, named)
            outputs.bound_resolved_payload(resolved)  # as the run's payload column stores it
        except UnresolvedReference as exc:
            decisions.append(NodeDecision(node.job_id, "dead", error=f"payload: {exc}"))
        except outputs.Unstorable as exc:  # "payload resolved to 80,012 bytes; at most 65,536"
            decisions.append(NodeDecision(node.job_id, "dead", error=str(exc)))
        else:
            decisions.append(NodeDecision(node.job_id, "queued", payload=resolved))
    async with flows.fenced(term) as fenced:
        queued, recorded = await fenced.decide(flow_run_id, decisions, term)
    return queued, recorded, len(decisions)


async def advance(flows: FlowRepository, redis: Redis, queues: Queues, term: int) -> int:
    """One step of the leader's flow loop over the open flow runs; returns the nodes decided.

    Raises:
        Fenced: `term` is no longer current (nothing of that flow run was written).
        Exception: store errors; the loop retries with backoff.
    """
    decided = 0
    after = None
    while True:
        page, after = await flows.open_nodes(FLOW_PAGE, after)
        for flow_run_id, nodes in page.items():
            queued, recorded, count = await _decide_flow(flows, flow_run_id, nodes, term)
            decided += count
            await events.publish(redis, recorded_events(recorded))
            if queued:
                await dispatch_new_runs(redis, queues, queued)
        if after is None:
            return decided
