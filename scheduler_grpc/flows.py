"""Flows of jobs (job dependencies): the domain rules, no I/O.

A job may depend on upstream jobs (`JobSpec.depends_on`) with a trigger rule. Firing or triggering
a job R that has dependents starts a *flow run* (its id is R's run id) over R and every job
reachable from R along the dependency edges, as the graph stood then. Each job of the flow run is a
*node*; a node waits until the run of every upstream node has reached its final state (retries
happen within a run as usual), then `decide` chooses what it becomes:

* `all_succeeded` (default): run if every upstream succeeded; `upstream_failed` if one failed
  (dead, cancelled, or itself upstream_failed); otherwise (an upstream was skipped) `skipped`.
* `all_done`: run once every upstream has finished, whatever the outcome.
* `any_failed` (a clean-up step): run if an upstream failed; `skipped` if none did.

A node that should run but whose job is paused is recorded `skipped`. Every node ends with a
history row of its own (a run, or a finished `upstream_failed` / `skipped` / `cancelled` row): a
node is never silently absent. The leader makes these decisions (`scheduler_grpc.scheduler`,
`db/flows.py`), each in one PostgreSQL transaction keyed on (flow run, job).

Results downstream: a payload value `{"$from": "<upstream job name>.result[.<key or index>...]"}`
anywhere in a downstream job's payload is replaced, when its run is created, by that part of the
upstream's result in the same flow run (`resolve_payload`). A reference must name one of the
job's upstreams when the job is defined (`check_reference_names`); one that cannot be resolved
when the run is created (the upstream is not in that flow run, a missing key) makes the run `dead`
at once, with the reference named in its error, and its dependents follow their rules.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from scheduler_grpc.errors import InvalidArgument

FROM_KEY = "$from"
MAX_UPSTREAMS = 100


class TriggerRule(enum.StrEnum):
    ALL_SUCCEEDED = "all_succeeded"
    ALL_DONE = "all_done"
    ANY_FAILED = "any_failed"


class Outcome(enum.Enum):
    """How an upstream node's run ended, as trigger rules see it."""

    SUCCEEDED = "succeeded"
    FAILED = "failed"
    SKIPPED = "skipped"


# The latest attempt's status of a run that will not change any more (a `failed` or `timed_out`
# attempt with budget left is followed by a new attempt in the same statement; `abandoned` and
# `interrupted` likewise).
FINAL_STATUSES: Mapping[str, Outcome] = {
    "succeeded": Outcome.SUCCEEDED,
    "dead": Outcome.FAILED,
    "cancelled": Outcome.FAILED,
    "upstream_failed": Outcome.FAILED,
    "skipped": Outcome.SKIPPED,
    "missed": Outcome.SKIPPED,
}


class Decision(enum.StrEnum):
    """What a waiting node becomes (the status of its history row)."""

    RUN = "queued"
    UPSTREAM_FAILED = "upstream_failed"
    SKIPPED = "skipped"


def outcome(status: str | None) -> Outcome | None:
    """The outcome of a run whose latest attempt has `status`; None while it may still change."""
    return FINAL_STATUSES.get(status) if status is not None else None


def decide(rule: TriggerRule, upstreams: Sequence[Outcome | None]) -> Decision | None:
    """What a node with `rule` becomes given its upstream nodes' outcomes; None: wait (an upstream
    has not finished). A node without upstreams in the flow run (cannot happen but for the root,
    which already has its run) runs."""
    if any(result is None for result in upstreams):
        return None
    if rule is TriggerRule.ALL_DONE:
        return Decision.RUN
    failed = any(result is Outcome.FAILED for result in upstreams)
    if rule is TriggerRule.ANY_FAILED:
        return Decision.RUN if failed else Decision.SKIPPED
    if failed:
        return Decision.UPSTREAM_FAILED
    if all(result is Outcome.SUCCEEDED for result in upstreams):
        return Decision.RUN
    return Decision.SKIPPED


def flow_state(outcomes: Sequence[Outcome | None]) -> str | None:
    """The final state of a flow run whose nodes have these outcomes; None while one may change."""
    if any(result is None for result in outcomes):
        return None
    return "failed" if any(result is Outcome.FAILED for result in outcomes) else "succeeded"


class UnresolvedReference(Exception):
    """A `$from` reference that names no upstream result in the flow run."""


def _is_reference(value: Any) -> bool:
    return isinstance(value, dict) and len(value) == 1 and FROM_KEY in value


def references(payload: Any) -> list[str]:
    """Every `$from` reference in a payload, in document order."""
    if _is_reference(payload):
        return [payload[FROM_KEY]]
    if isinstance(payload, dict):
        return [ref for value in payload.values() for ref in references(value)]
    if isinstance(payload, list):
        return [ref for value in payload for ref in references(value)]
    return []


def check_references(payload: Mapping[str, Any]) -> None:
    """Refuse malformed `$from` references (what they name is checked when the run is created).

    Raises:
        InvalidArgument: a reference that is not a string `<job>.result[.path]`, naming `payload`.
    """
    for ref in references(payload):
        if not isinstance(ref, str) or ".result" not in ref:
            raise InvalidArgument(
                "payload", f'{{"$from": {ref!r}}}: expected "<upstream job name>.result[.<key or index>...]"'
            )


def check_reference_names(payload: Mapping[str, Any], upstream_names: Sequence[str]) -> None:
    """Refuse `$from` references that name none of the job's upstreams (they could never resolve).

    Raises:
        InvalidArgument: naming `payload` and the reference.
    """
    for ref in references(payload):
        if not any(ref == f"{name}.result" or ref.startswith(f"{name}.result.") for name in upstream_names):
            known = ", ".join(upstream_names) or "none"
            raise InvalidArgument(
                "payload", f'{{"$from": "{ref}"}} names no upstream of this job (its depends_on: {known})'
            )


def _lookup(results: Mapping[str, Any], ref: str) -> Any:
    # Job names may hold dots: the longest upstream name that the reference starts with wins.
    for name in sorted(results, key=len, reverse=True):
        prefix = f"{name}.result"
        if ref == prefix or ref.startswith(prefix + "."):
            break
    else:
        raise UnresolvedReference(f'{{"$from": "{ref}"}}: no upstream of this job in the flow run is named so')
    value = results[name]
    path = ref[len(prefix) + 1 :].split(".") if ref != prefix else []
    walked = prefix
    for key in path:
        if isinstance(value, dict) and key in value:
            value = value[key]
        elif isinstance(value, list) and key.isdigit() and int(key) < len(value):
            value = value[int(key)]
        else:
            raise UnresolvedReference(f'{{"$from": "{ref}"}}: {walked} has no {key!r}')
        walked = f"{walked}.{key}"
    return value


def resolve_payload(payload: Any, results: Mapping[str, Any]) -> Any:
    """`payload` with every `$from` reference replaced by the upstream result it names.

    Args:
        payload: The downstream job's payload.
        results: The result of each upstream run of the flow run, by upstream job name (an upstream
            that did not succeed maps to None).

    Raises:
        UnresolvedReference: a reference names no upstream, or a path its result does not have.
    """
    if _is_reference(payload):
        return _lookup(results, str(payload[FROM_KEY]))
    if isinstance(payload, dict):
        return {key: resolve_payload(value, results) for key, value in payload.items()}
    if isinstance(payload, list):
        return [resolve_payload(value, results) for value in payload]
    return payload


@dataclass(frozen=True)
class Node:
    """One job of a flow run as the leader and GetFlowRun see it.

    Attributes:
        job_id: The job.
        job_name: Its name.
        upstream_ids: Its upstream jobs inside the flow run (a snapshot taken when the run started).
        trigger_rule: Its rule (snapshot).
        run_id: Its run in this flow run; None while it waits.
        status: The latest attempt's status of that run; None while it waits.
        execution_id: That attempt's id.
    """

    job_id: str
    job_name: str
    upstream_ids: tuple[str, ...]
    trigger_rule: TriggerRule
    run_id: str | None = None
    status: str | None = None
    execution_id: str | None = None

    @property
    def state(self) -> str:
        """`pending` while waiting, else its run's latest status."""
        return self.status or "pending"


@dataclass(frozen=True)
class FlowRun:
    """A flow run with every node."""

    id: str
    root_job_id: str
    state: str
    created_at: Any
    finished_at: Any
    nodes: tuple[Node, ...]
