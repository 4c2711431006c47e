"""The job form: form fields <-> `JobSpec`.

Form fields carry the domain's field names (`cron`, `retry_policy.max_retries`, `payload`,
`depends_on`), so an `InvalidArgument` from parsing here or from `Control` (which validates with
`jobs.validate_job`, as for the API) names the form field to show the error on. Only text -> value
parsing lives here; every rule about what a job may be is the domain's.

The form carries every field of the API's `JobSpec` but `status` (pause and resume are actions of
their own). An edit changes only what the form changed (`merged_spec`): each field is compared with
the value the form showed, and a field left alone keeps the job's stored value exactly, so a value
the form cannot show losslessly is never rewritten by an unchanged save.

The schedule's kind follows what was filled (`auto`, the new form's default): a cron expression
makes a cron job, a run time a one-shot job, neither a manual job. A kind chosen explicitly that
contradicts a filled field is refused on that field; nothing typed is ever dropped silently.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import fields, replace
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

import orjson

from scheduler_grpc.config import format_duration, parse_duration
from scheduler_grpc.errors import InvalidArgument
from scheduler_grpc.flows import TriggerRule
from scheduler_grpc.jobs import ConcurrencyPolicy, Job, JobSpec, JobStatus, MisfirePolicy, RetryPolicy, ScheduleKind
from scheduler_grpc.schedule import FoldPolicy, GapPolicy

E = TypeVar("E", bound=enum.StrEnum)

FIELDS = (
    "name", "handler", "payload", "schedule_kind", "cron", "time_zone", "run_at", "dst_gap_policy", "dst_fold_policy",
    "queue", "priority", "retry_policy.max_retries", "retry_policy.initial_backoff", "retry_policy.max_backoff",
    "retry_policy.jitter", "timeout", "misfire_policy", "concurrency_policy", "depends_on", "trigger_rule",
)  # fmt: skip
AUTO = "auto"
"""The schedule kind that follows what was filled (cron, run_at, or neither)."""
CHOICES: Mapping[str, list[str]] = {
    "schedule_kind": [AUTO, *(kind.value for kind in ScheduleKind)],
    "dst_gap_policy": [policy.value for policy in GapPolicy],
    "dst_fold_policy": [policy.value for policy in FoldPolicy],
    "misfire_policy": [policy.value for policy in MisfirePolicy],
    "concurrency_policy": [policy.value for policy in ConcurrencyPolicy],
    "trigger_rule": [rule.value for rule in TriggerRule],
}
# The form fields that set each `JobSpec` attribute (an attribute whose fields are all unchanged
# keeps its stored value). The schedule's kind, cron and run time move together: they are one choice.
_SCHEDULE = ("schedule_kind", "cron", "run_at")
_ATTRIBUTES: Mapping[str, tuple[str, ...]] = {
    "name": ("name",),
    "handler": ("handler",),
    "payload": ("payload",),
    "schedule_kind": _SCHEDULE,
    "cron": _SCHEDULE,
    "run_at": _SCHEDULE,
    "time_zone": ("time_zone",),
    "dst_gap_policy": ("dst_gap_policy",),
    "dst_fold_policy": ("dst_fold_policy",),
    "queue": ("queue",),
    "priority": ("priority",),
    "timeout": ("timeout",),
    "misfire_policy": ("misfire_policy",),
    "concurrency_policy": ("concurrency_policy",),
    "depends_on": ("depends_on",),
    "trigger_rule": ("trigger_rule",),
}
_RETRY = {
    "retry_policy.max_retries": "max_retries",
    "retry_policy.initial_backoff": "initial_backoff",
    "retry_policy.max_backoff": "max_backoff",
    "retry_policy.jitter": "jitter",
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


def _schedule(form: Mapping[str, str]) -> tuple[ScheduleKind, str | None, datetime | None]:
    """The kind, cron and run time the form describes; the kind follows what was filled under `auto`.

    Raises:
        InvalidArgument: a filled field the chosen kind has no use for (named, so the error shows
            under it), both cron and run time under `auto`, or an unknown kind.
    """
    cron = form.get("cron", "").strip() or None
    run_at = _run_at(form)
    raw = form.get("schedule_kind", "").strip()
    if raw in ("", AUTO):
        if cron and run_at:
            raise InvalidArgument("schedule_kind", "both a cron expression and a run time are filled: choose one")
        kind = ScheduleKind.CRON if cron else ScheduleKind.ONCE if run_at else ScheduleKind.MANUAL
        return kind, cron, run_at
    kind = _choice(ScheduleKind, form, "schedule_kind", ScheduleKind.MANUAL)
    if cron and kind is not ScheduleKind.CRON:
        raise InvalidArgument(
            "cron", f"a {kind.value} job has no cron expression: choose kind cron (or auto), or clear this field"
        )
    if run_at and kind is not ScheduleKind.ONCE:
        raise InvalidArgument(
            "run_at", f"a {kind.value} job has no run time: choose kind once (or auto), or clear this field"
        )
    return kind, cron, run_at


def _depends_on(form: Mapping[str, str]) -> tuple[str, ...]:
    """Upstream jobs, by name or id, separated by commas or new lines."""
    raw = form.get("depends_on", "").replace("\n", ",")
    return tuple(part.strip() for part in raw.split(",") if part.strip())


def job_spec(form: Mapping[str, str], status: JobStatus = JobStatus.ACTIVE) -> JobSpec:
    """The spec a submitted job form describes (not yet validated: `Control` does that).

    Raises:
        InvalidArgument: a field that does not parse, named as in the form.
    """
    defaults = RetryPolicy()
    kind, cron, run_at = _schedule(form)
    return JobSpec(
        name=form.get("name", ""),
        handler=form.get("handler", "").strip(),
        payload=_payload(form),
        schedule_kind=kind,
        cron=cron,
        time_zone=form.get("time_zone", "").strip() or "UTC",
        run_at=run_at,
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
        depends_on=_depends_on(form),
        trigger_rule=_choice(TriggerRule, form, "trigger_rule", TriggerRule.ALL_SUCCEEDED),
    )


def form_values(job: Job | None, upstream_names: Mapping[str, str] | None = None) -> dict[str, str]:
    """The form fields of `job` (the defaults of a new job for None); upstreams are shown by name
    (`upstream_names`, by id; an id without a name is shown as it is)."""
    spec = job or JobSpec(name="", handler="", retry=RetryPolicy(jitter=True))
    names = upstream_names or {}
    return {
        "name": spec.name,
        "handler": spec.handler,
        "payload": orjson.dumps(spec.payload, option=orjson.OPT_INDENT_2).decode(),
        "schedule_kind": spec.schedule_kind.value if job is not None else AUTO,
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
        "depends_on": ", ".join(names.get(upstream, upstream) for upstream in spec.depends_on),
        "trigger_rule": spec.trigger_rule.value,
    }


def _same(field: str, submitted: str, shown: str) -> bool:
    """Whether a submitted field still says what the form showed."""
    if field == "payload":
        # Compared as JSON: a browser sends a textarea's line breaks as CRLF.
        try:
            return bool(orjson.loads(submitted or "{}") == orjson.loads(shown or "{}"))
        except orjson.JSONDecodeError:
            return False
    if field == "retry_policy.jitter":
        return (submitted in ("on", "true", "1")) == (shown == "on")
    if field == "depends_on":
        return _depends_on({"depends_on": submitted}) == _depends_on({"depends_on": shown})
    return submitted.strip() == shown.strip()


def changed_fields(job: Job, form: Mapping[str, str], upstream_names: Mapping[str, str]) -> list[str]:
    """The form fields whose submitted value differs from what the edit form showed of `job` (a
    field absent from the submission is unchanged: a form without it cannot have changed it)."""
    shown = form_values(job, upstream_names)
    return [
        field
        for field in FIELDS
        if field in form or field == "retry_policy.jitter"
        if not _same(field, form.get(field, ""), shown[field])
    ]


def merged_spec(job: Job, form: Mapping[str, str], upstream_names: Mapping[str, str]) -> JobSpec:
    """The spec an edit form makes of `job`: its stored values, with only the fields the form
    changed replaced by what the form says (a field mask of the changed fields).

    Raises:
        InvalidArgument: a changed field that does not parse, named as in the form.
    """
    current = JobSpec(**{f.name: getattr(job, f.name) for f in fields(JobSpec)})
    changed = changed_fields(job, form, upstream_names)
    if not changed:
        return current
    submitted = job_spec({**form_values(job, upstream_names), **form}, status=job.status)
    updates: dict[str, Any] = {}
    for field in changed:
        for attribute in _ATTRIBUTES.get(field, ()):
            updates[attribute] = getattr(submitted, attribute)
    retry_updates = {_RETRY[field]: getattr(submitted.retry, _RETRY[field]) for field in changed if field in _RETRY}
    if retry_updates:
        updates["retry"] = replace(current.retry, **retry_updates)
    return replace(current, **updates)
