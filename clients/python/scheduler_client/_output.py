"""How schedctl prints: aligned tables and key/value views for people, JSON for scripts."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable, Mapping, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any, TextIO

from google.protobuf import duration_pb2, json_format, struct_pb2, timestamp_pb2
from google.protobuf.message import Message

from scheduler_client.client import enum_label, to_datetime
from scheduler_client.v1 import auth_pb2, cluster_pb2, executions_pb2, jobs_pb2, queue_pb2

MAX_CELL = 60
# Larger whole numbers are not exact as doubles: they keep their float form.
_MAX_EXACT_INTEGER = 2**53


def integral(value: Any) -> Any:
    """`value` (JSON-like) with whole floats as ints: a Struct holds every number as a double, so
    the payload `{"n": 42}` comes back as `42.0`; people and scripts expect `42`."""
    if isinstance(value, float) and value.is_integer() and abs(value) <= _MAX_EXACT_INTEGER:
        return int(value)
    if isinstance(value, dict):
        return {key: integral(item) for key, item in value.items()}
    if isinstance(value, list):
        return [integral(item) for item in value]
    return value


def message_dict(message: Message) -> dict[str, Any]:
    """The proto3 JSON mapping (lowerCamelCase names, as buf curl, grpcurl and the README print),
    with every field (zero values too), whole numbers printed as integers."""
    result: dict[str, Any] = integral(json_format.MessageToDict(message, always_print_fields_with_no_presence=True))
    return result


def print_json(value: Any, out: TextIO | None = None, *, indent: int | None = 2) -> None:
    stream = out or sys.stdout
    stream.write(json.dumps(value, indent=indent, ensure_ascii=False) + "\n")
    stream.flush()


def _cell(value: object) -> str:
    text = " ".join(str(value).split())
    return text if len(text) <= MAX_CELL else text[: MAX_CELL - 1] + "…"


def print_table(headers: Sequence[str], rows: Iterable[Sequence[object]], out: TextIO | None = None) -> None:
    """Columns aligned on the widest cell; the last column is not padded."""
    stream = out or sys.stdout
    cells = [[_cell(value) for value in row] for row in rows]
    widths = [max([len(header), *(len(row[i]) for row in cells)]) for i, header in enumerate(headers)]
    for row in [list(headers), *cells]:
        line = "  ".join(value.ljust(width) for value, width in zip(row, widths, strict=True))
        stream.write(line.rstrip() + "\n")
    stream.flush()


def print_fields(fields: Sequence[tuple[str, object]], out: TextIO | None = None) -> None:
    """`key:  value` lines, keys aligned."""
    stream = out or sys.stdout
    width = max((len(key) for key, _ in fields), default=0) + 1
    for key, value in fields:
        stream.write(f"{(key + ':').ljust(width)}  {value}\n")
    stream.flush()


# --- values ------------------------------------------------------------------------------------


def when(stamp: timestamp_pb2.Timestamp) -> str:
    """`2026-03-29 01:30:00Z`, or `-` when unset."""
    moment = to_datetime(stamp)
    if moment is None:
        return "-"
    return moment.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S") + "Z"


def ago(stamp: timestamp_pb2.Timestamp, now: datetime | None = None) -> str:
    moment = to_datetime(stamp)
    if moment is None:
        return "-"
    return span((now or datetime.now(UTC)) - moment) + " ago"


def span(delta: timedelta) -> str:
    """`850ms`, `1s`, `12.3s`, `4m05s`, `2h03m` (no `.0` on whole seconds)."""
    seconds = max(delta.total_seconds(), 0.0)
    if seconds < 1:
        return f"{seconds * 1000:.0f}ms"
    if seconds < 60:
        return f"{seconds:.1f}".removesuffix(".0") + "s"
    if seconds < 3600:
        return f"{int(seconds // 60)}m{int(seconds % 60):02d}s"
    return f"{int(seconds // 3600)}h{int(seconds % 3600 // 60):02d}m"


def duration(value: duration_pb2.Duration) -> str:
    if value.seconds == 0 and value.nanos == 0:
        return "-"
    return span(value.ToTimedelta())


def label(enum_name: str) -> str:
    return enum_label(enum_name)


def struct_json(value: struct_pb2.Struct) -> str:
    return json.dumps(integral(json_format.MessageToDict(value)), ensure_ascii=False, sort_keys=True)


def value_json(value: struct_pb2.Value) -> str:
    if value.WhichOneof("kind") is None:
        return "-"
    return json.dumps(integral(json_format.MessageToDict(value)), ensure_ascii=False, sort_keys=True)


# --- messages ----------------------------------------------------------------------------------


def schedule_text(schedule: jobs_pb2.Schedule) -> str:
    if schedule.cron:
        return f"{schedule.cron} ({schedule.time_zone or 'UTC'})"
    if schedule.HasField("run_time"):
        return f"once at {when(schedule.run_time)}"
    return "manual"


def job_state(job: jobs_pb2.Job) -> str:
    return label(jobs_pb2.JobState.Name(job.state))


def job_rows(jobs: Iterable[jobs_pb2.Job]) -> tuple[list[str], list[list[object]]]:
    headers = ["NAME", "ID", "HANDLER", "SCHEDULE", "STATE", "NEXT RUN"]
    rows: list[list[object]] = [
        [job.name, job.id, job.handler, schedule_text(job.schedule), job_state(job), when(job.next_run_time)]
        for job in jobs
    ]
    return headers, rows


def job_fields(job: jobs_pb2.Job, job_names: Mapping[str, str] | None = None) -> list[tuple[str, object]]:
    """A job's fields; its upstream jobs by name where `job_names` (id -> name) knows them."""
    names = job_names or {}
    retry = job.retry_policy
    return [
        ("name", job.name),
        ("id", job.id),
        ("handler", job.handler),
        ("handler served", "yes" if job.handler_served else "no: no connected worker serves it on the job's queue now"),
        ("state", job_state(job)),
        ("schedule", schedule_text(job.schedule)),
        ("next run", when(job.next_run_time)),
        ("payload", struct_json(job.payload)),
        ("queue", job.queue or "default"),
        ("priority", job.priority),
        (
            "retries",
            f"{retry.max_retries} (backoff {duration(retry.initial_backoff)} to {duration(retry.max_backoff)}"
            f"{', jitter' if retry.jitter else ''})",
        ),
        ("timeout", duration(job.timeout)),
        ("misfire policy", label(jobs_pb2.MisfirePolicy.Name(job.misfire_policy))),
        ("concurrency policy", label(jobs_pb2.ConcurrencyPolicy.Name(job.concurrency_policy))),
        ("depends on", ", ".join(names.get(upstream, upstream) for upstream in job.depends_on) or "-"),
        ("trigger rule", label(executions_pb2.TriggerRule.Name(job.trigger_rule))),
        ("limits", ", ".join(f"{ref.limit}:{ref.key}:{ref.units}" for ref in job.limits) or "-"),
        ("etag", job.etag or "-"),
        ("created", when(job.create_time)),
        ("updated", when(job.update_time)),
    ]


def flow_lines(flow: executions_pb2.FlowRun) -> list[str]:
    """A flow run drawn as text: a tree from the root along the dependency edges, each job with its
    state; a job with several upstreams is drawn in full under the first and marked `(see above)`
    under the others, with its upstreams listed."""
    nodes = {node.job_id: node for node in flow.nodes}
    children: dict[str, list[str]] = {job_id: [] for job_id in nodes}
    for node in flow.nodes:
        for upstream in node.upstream_job_ids:
            if upstream in children:
                children[upstream].append(node.job_id)
    for ids in children.values():
        ids.sort(key=lambda job_id: nodes[job_id].job_name)

    def state(node: executions_pb2.FlowNode) -> str:
        if node.state == executions_pb2.EXECUTION_STATE_UNSPECIFIED:
            return "pending"
        return label(executions_pb2.ExecutionState.Name(node.state))

    def text(node: executions_pb2.FlowNode) -> str:
        upstreams = [nodes[u].job_name for u in node.upstream_job_ids if u in nodes]
        after = f"  ← {', '.join(upstreams)}" if len(upstreams) > 1 else ""
        return f"{node.job_name} [{state(node)}]{after}"

    lines = [f"flow run {flow.id}: {label(executions_pb2.FlowRunState.Name(flow.state))}"]
    drawn: set[str] = set()

    def draw(job_id: str, prefix: str, last: bool, top: bool) -> None:
        node = nodes[job_id]
        branch = "" if top else ("└─▶ " if last else "├─▶ ")
        if job_id in drawn:
            lines.append(f"{prefix}{branch}{node.job_name} (see above)")
            return
        drawn.add(job_id)
        lines.append(f"{prefix}{branch}{text(node)}")
        below = prefix if top else prefix + ("    " if last else "│   ")
        for index, child in enumerate(children[job_id]):
            draw(child, below, index == len(children[job_id]) - 1, False)

    roots = [n.job_id for n in flow.nodes if not any(u in nodes for u in n.upstream_job_ids)]
    for root in sorted(roots, key=lambda job_id: (job_id != flow.root_job_id, nodes[job_id].job_name)):
        draw(root, "", True, True)
    return lines


def execution_state(execution: executions_pb2.Execution) -> str:
    return label(executions_pb2.ExecutionState.Name(execution.state))


def execution_took(execution: executions_pb2.Execution) -> str:
    start, end = to_datetime(execution.start_time), to_datetime(execution.end_time)
    if start is None or end is None:
        return "-"
    return span(end - start)


def execution_rows(
    executions: Iterable[executions_pb2.Execution], job_names: Mapping[str, str]
) -> tuple[list[str], list[list[object]]]:
    headers = ["ID", "JOB", "ATTEMPT", "STATE", "TRIGGER", "SCHEDULED", "TOOK", "WORKER", "ERROR"]
    rows: list[list[object]] = [
        [
            execution.id,
            job_names.get(execution.job_id, execution.job_id),
            execution.attempt,
            execution_state(execution) + (f" ({blocked_text(execution)})" if execution.HasField("blocked_by") else ""),
            label(executions_pb2.Trigger.Name(execution.trigger)),
            when(execution.schedule_time),
            execution_took(execution),
            execution.worker_id or "-",
            execution.error or "",
        ]
        for execution in executions
    ]
    return headers, rows


def blocked_text(execution: executions_pb2.Execution) -> str:
    """Why a queued execution waits: `waits for limit per-customer key c1 (concurrency) since ...`."""
    why = execution.blocked_by
    return f"waits for limit {why.limit} key {why.key} ({why.reason}) since {when(why.since)}"


def execution_fields(execution: executions_pb2.Execution, job_name: str | None = None) -> list[tuple[str, object]]:
    """An execution's fields, its job by `job_name` too when given."""
    return [
        ("id", execution.id),
        ("run id", execution.run_id),
        *([("job", job_name)] if job_name and job_name != execution.job_id else []),
        ("job id", execution.job_id),
        ("attempt", execution.attempt),
        ("state", execution_state(execution)),
        *([("blocked", blocked_text(execution))] if execution.HasField("blocked_by") else []),
        ("trigger", label(executions_pb2.Trigger.Name(execution.trigger))),
        ("scheduled for", when(execution.schedule_time)),
        ("due", when(execution.due_time)),
        ("priority", execution.priority),
        ("worker", execution.worker_id or "-"),
        ("created", when(execution.create_time)),
        ("started", when(execution.start_time)),
        ("ended", when(execution.end_time)),
        ("took", execution_took(execution)),
        ("error", execution.error or "-"),
        ("result", value_json(execution.result)),
    ]


EVENT_HEADERS = ("TIME", "EVENT", "EXECUTION", "JOB", "ATTEMPT", "WORKER", "ERROR")
_EVENT_WIDTHS = (21, 10, 36, 36, 7, 0, 0)


def event_line(event: executions_pb2.ExecutionEvent, job_name: str | None = None) -> str:
    """One event as a line under `event_header()`: its job by `job_name` when given, else by id."""
    values = [
        when(event.event_time),
        label(executions_pb2.EventType.Name(event.type)),
        event.execution_id,
        job_name or event.job_id,
        str(event.attempt),
        event.worker_id or "-",
        _cell(event.error) if event.error else "",
    ]
    return "  ".join(v.ljust(w) for v, w in zip(values, _EVENT_WIDTHS, strict=True)).rstrip()


def event_header() -> str:
    return "  ".join(v.ljust(w) for v, w in zip(EVENT_HEADERS, _EVENT_WIDTHS, strict=True)).rstrip()


def dead_letter_rows(letters: Iterable[queue_pb2.DeadLetter]) -> tuple[list[str], list[list[object]]]:
    headers = ["RUN ID", "HANDLER", "PRIORITY", "DEAD SINCE", "REASON"]
    rows: list[list[object]] = [
        [letter.run_id, letter.handler, letter.priority, when(letter.dead_time), letter.reason] for letter in letters
    ]
    return headers, rows


def _handlers(names: Iterable[str], most: int = 3) -> str:
    listed = list(names)
    shown = ",".join(listed[:most])
    return shown + (f",+{len(listed) - most}" if len(listed) > most else "") if listed else "-"


def worker_rows(workers: Iterable[cluster_pb2.Worker]) -> tuple[list[str], list[list[object]]]:
    now = datetime.now(UTC)
    headers = ["ID", "HOST", "PID", "QUEUE", "BUSY", "HANDLERS", "SDK", "STARTED", "HEARTBEAT"]
    rows: list[list[object]] = [
        [
            worker.id,
            worker.host,
            worker.pid or "-",
            worker.queue,
            f"{worker.active}/{worker.slots}",
            _handlers(worker.handlers),
            worker.sdk or "-",
            when(worker.start_time),
            ago(worker.heartbeat_time, now),
        ]
        for worker in workers
    ]
    return headers, rows


def handler_rows(handlers: Iterable[cluster_pb2.Handler]) -> tuple[list[str], list[list[object]]]:
    headers = ["NAME", "ENABLED", "ADMIN ONLY", "BREAKERS", "DESCRIPTION"]
    rows: list[list[object]] = []
    for handler in handlers:
        states = sorted(
            {
                label(cluster_pb2.BreakerState.Name(b.state))
                for b in handler.breakers
                if b.state != cluster_pb2.BREAKER_STATE_CLOSED
            }
        )
        rows.append(
            [
                handler.name,
                "yes" if handler.enabled else "no",
                "yes" if handler.admin_only else "no",
                ", ".join(states) or "closed",
                handler.description,
            ]
        )
    return headers, rows


def role(value: auth_pb2.Role) -> str:
    return label(auth_pb2.Role.Name(value))
