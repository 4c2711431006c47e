"""The job form: form fields <-> `JobSpec`.

Form fields carry the domain's field names (`cron`, `retry_policy.max_retries`, `payload`), so an
`InvalidArgument` from parsing here or from `Control` (which validates with `jobs.validate_job`, as
for the API) names the form field to show the error on. Only text -> value parsing lives here; every
rule about what a job may be is the domain's.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

import orjson

from scheduler_grpc.config import format_duration, parse_duration
from scheduler_grpc.errors import InvalidArgument
from scheduler_grpc.jobs import ConcurrencyPolicy, Job, JobSpec, JobStatus, MisfirePolicy, RetryPolicy, ScheduleKind
from scheduler_grpc.schedule import FoldPolicy, GapPolicy

E = TypeVar("E", bound=enum.StrEnum)

FIELDS = (
    "name", "handler", "payload", "schedule_kind", "cron", "time_zone", "run_at", "dst_gap_policy", "dst_fold_policy",
    "queue", "priority", "retry_policy.max_retries", "retry_policy.initial_backoff", "retry_policy.max_backoff",
    "retry_policy.jitter", "timeout", "misfire_policy", "concurrency_policy",
)  # fmt: skip
CHOICES: Mapping[str, list[str]] = {
    "schedule_kind": [kind.value for kind in ScheduleKind],
    "dst_gap_policy": [policy.value for policy in GapPolicy],
    "dst_fold_policy": [policy.value for policy in FoldPolicy],
    "misfire_policy": [policy.value for policy in MisfirePolicy],
    "concurrency_policy": [policy.value for policy in ConcurrencyPolicy],
}


def _choice(kind: type[E], form: Mapping[str, str], field: str, default: E) -> E:
    raw = form.get(field, "").strip()
    if not raw:
        return default
    try:
        return kind(raw)
    except ValueError:
        allowed = ", ".join(member.value for member in kind)
        raise InvalidArgument(field, f"expected one of {allowed}") from None


def _int(form: Mapping[str, str], field: str, default: int) -> int:
    raw = form.get(field, "").strip()
    if not raw:
        return default
    try:
        return int(raw)
    except ValueError:
        raise InvalidArgument(field, "must be a whole number") from None


def _duration(form: Mapping[str, str], field: str, default: timedelta) -> timedelta:
    raw = form.get(field, "").strip()
    if not raw:
        return default
    try:
        return parse_duration(raw)
    except ValueError:
        raise InvalidArgument(field, "must be a duration such as 30s, 5m or 1h") from None


def _payload(form: Mapping[str, str]) -> dict[str, Any]:
    raw = form.get("payload", "").strip() or "{}"
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise InvalidArgument("payload", f"not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise InvalidArgument("payload", "must be a JSON object")
    return value


def _run_at(form: Mapping[str, str]) -> datetime | None:
    raw = form.get("run_at", "").strip()
    if not raw:
        return None
    try:
        value = datetime.fromisoformat(raw)
    except ValueError:
        raise InvalidArgument("run_at", "must be an ISO 8601 time such as 2030-01-01T09:00:00Z") from None
    return value if value.tzinfo is not None else value.replace(tzinfo=UTC)  # the form says UTC


def job_spec(form: Mapping[str, str], status: JobStatus = JobStatus.ACTIVE) -> JobSpec:
    """The spec a submitted job form describes (not yet validated: `Control` does that).

    Raises:
        InvalidArgument: a field that does not parse, named as in the form.
    """
    defaults = RetryPolicy()
    kind = _choice(ScheduleKind, form, "schedule_kind", ScheduleKind.MANUAL)
    return JobSpec(
        name=form.get("name", ""),
        handler=form.get("handler", "").strip(),
        payload=_payload(form),
        schedule_kind=kind,
        cron=(form.get("cron", "").strip() or None) if kind is ScheduleKind.CRON else None,
        time_zone=form.get("time_zone", "").strip() or "UTC",
        run_at=_run_at(form) if kind is ScheduleKind.ONCE else None,
        dst_gap_policy=_choice(GapPolicy, form, "dst_gap_policy", GapPolicy.SHIFT),
        dst_fold_policy=_choice(FoldPolicy, form, "dst_fold_policy", FoldPolicy.FIRST),
        queue=form.get("queue", "").strip() or "default",
        priority=_int(form, "priority", 0),
        retry=RetryPolicy(
            max_retries=_int(form, "retry_policy.max_retries", defaults.max_retries),
            initial_backoff=_duration(form, "retry_policy.initial_backoff", defaults.initial_backoff),
            max_backoff=_duration(form, "retry_policy.max_backoff", defaults.max_backoff),
            jitter=form.get("retry_policy.jitter", "") in ("on", "true", "1"),
        ),
        timeout=_duration(form, "timeout", timedelta(minutes=5)),
        misfire_policy=_choice(MisfirePolicy, form, "misfire_policy", MisfirePolicy.RUN_ONCE),
        concurrency_policy=_choice(ConcurrencyPolicy, form, "concurrency_policy", ConcurrencyPolicy.ALLOW),
        status=status,
    )


def form_values(job: Job | None) -> dict[str, str]:
    """The form fields of `job` (the defaults of a new job for None)."""
    spec = job or JobSpec(name="", handler="", retry=RetryPolicy(jitter=True))
    return {
        "name": spec.name,
        "handler": spec.handler,
        "payload": orjson.dumps(spec.payload, option=orjson.OPT_INDENT_2).decode(),
        "schedule_kind": spec.schedule_kind.value,
        "cron": spec.cron or "",
        "time_zone": spec.time_zone,
        "run_at": spec.run_at.isoformat() if spec.run_at else "",
        "dst_gap_policy": spec.dst_gap_policy.value,
        "dst_fold_policy": spec.dst_fold_policy.value,
        "queue": spec.queue,
        "priority": str(spec.priority),
        "retry_policy.max_retries": str(spec.retry.max_retries),
        "retry_policy.initial_backoff": format_duration(spec.retry.initial_backoff),
        "retry_policy.max_backoff": format_duration(spec.retry.max_backoff),
        "retry_policy.jitter": "on" if spec.retry.jitter else "",
        "timeout": format_duration(spec.timeout),
        "misfire_policy": spec.misfire_policy.value,
        "concurrency_policy": spec.concurrency_policy.value,
    }
