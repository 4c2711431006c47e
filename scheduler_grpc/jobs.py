"""The job model: what a job is, its policies, and validation that names the offending field.

Pure domain code: no I/O. The repository (`db/jobs.py`) stores what `validate_job` returns; the API
maps these field names onto its messages.
"""

from __future__ import annotations

import enum
import math
import random
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import Any, Protocol

from scheduler_grpc.errors import InvalidArgument
from scheduler_grpc.flows import MAX_UPSTREAMS, TriggerRule, check_references
from scheduler_grpc.limits import LimitRef, validate_refs
from scheduler_grpc.rules import PRIORITY_MAX, PRIORITY_MIN, QUEUE_NAME_RULE, is_queue_name
from scheduler_grpc.schedule import CronSchedule, FoldPolicy, GapPolicy, next_fire_time, parse_cron, parse_time_zone

MAX_NAME_LENGTH = 200
MAX_RETRIES_LIMIT = 100
MAX_TIMEOUT = timedelta(hours=24)
MAX_PAYLOAD_DEPTH = 20
"""Objects and arrays nested in a payload, at most (a gRPC Struct of this depth still decodes)."""
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]*$")


class ScheduleKind(enum.StrEnum):
    CRON = "cron"
    ONCE = "once"
    MANUAL = "manual"


class MisfirePolicy(enum.StrEnum):
    """What to do with slots that passed while no leader ran (later than the misfire grace)."""

    # A run of missed slots is one `missed` row (a range; see scheduler.plan_job) under these two:
    RUN_ONCE = "run_once"  # run the latest missed slot; the range is the ones before it
    SKIP = "skip"  # run none; the range is all of them
    RUN_ALL = "run_all"  # run every missed slot (bounded per scan)


class ConcurrencyPolicy(enum.StrEnum):
    """What a slot does while an earlier run of the same job is still queued or running."""

    ALLOW = "allow"
    FORBID = "forbid"  # record the new slot as `skipped`
    REPLACE = "replace"  # cancel the earlier run, start the new one


class JobStatus(enum.StrEnum):
    ACTIVE = "active"
    PAUSED = "paused"


@dataclass(frozen=True)
class RetryPolicy:
    """Bounded exponential backoff: attempt n (1-based) failing waits min(initial * 2^(n-1), max)."""

    max_retries: int = 3
    initial_backoff: timedelta = timedelta(seconds=1)
    max_backoff: timedelta = timedelta(minutes=5)
    jitter: bool = True

    def backoff(self, failed_attempt: int, rng: random.Random | None = None) -> timedelta:
        """The delay before the attempt after `failed_attempt`; jitter adds up to 20 %."""
        base: timedelta = min(self.initial_backoff * (2 ** min(failed_attempt - 1, 40)), self.max_backoff)
        if not self.jitter:
            return base
        jittered: timedelta = base * (1 + (rng or random).uniform(0, 0.2))
        return jittered

    def allows_retry_after(self, failed_attempt: int) -> bool:
        return failed_attempt <= self.max_retries


@dataclass(frozen=True)
class JobSpec:
    """Everything a user defines about a job (create and update input)."""

    name: str
    handler: str
    payload: dict[str, Any] = field(default_factory=dict)
    schedule_kind: ScheduleKind = ScheduleKind.MANUAL
    cron: str | None = None
    time_zone: str = "UTC"
    run_at: datetime | None = None
    dst_gap_policy: GapPolicy = GapPolicy.SHIFT
    dst_fold_policy: FoldPolicy = FoldPolicy.FIRST
    queue: str = "default"
    priority: int = 0
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    timeout: timedelta = timedelta(minutes=5)
    misfire_policy: MisfirePolicy = MisfirePolicy.RUN_ONCE
    concurrency_policy: ConcurrencyPolicy = ConcurrencyPolicy.ALLOW
    status: JobStatus = JobStatus.ACTIVE
    # Upstream jobs (ids or names as given; ids once stored), and when this job runs after them
    # in a flow run (see `scheduler_grpc.flows`).
    depends_on: tuple[str, ...] = ()
    trigger_rule: TriggerRule = TriggerRule.ALL_SUCCEEDED
    # The limits each run takes (`scheduler_grpc.limits`), in order; the limits must exist
    # (checked where they are stored: `db/jobs.py`).
    limits: tuple[LimitRef, ...] = ()

    @property
    def cron_schedule(self) -> CronSchedule | None:
        if self.schedule_kind is not ScheduleKind.CRON or self.cron is None:
            return None
        return CronSchedule(self.cron, self.time_zone, self.dst_gap_policy, self.dst_fold_policy)

    def first_run_time(self, now: datetime) -> datetime | None:
        """The `next_run_time` of a job defined (or re-defined, or resumed) at `now`."""
        if self.schedule_kind is ScheduleKind.ONCE:
            return self.run_at
        schedule = self.cron_schedule
        if schedule is None:
            return None
        fire = next_fire_time(schedule, now)
        return fire.instant if fire else None


@dataclass(frozen=True)
class Job(JobSpec):
    """A stored job."""

    id: str = ""
    version: int = 1
    next_run_time: datetime | None = None
    created_at: datetime | None = None
    updated_at: datetime | None = None

    @property
    def etag(self) -> str:
        return f'W/"{self.version}"'


class PayloadValidator(Protocol):
    """What job validation needs of the handler registry."""

    def validate(self, handler: str, payload: Mapping[str, Any]) -> dict[str, Any]: ...

    def validate_remote(self, handler: str, payload: Mapping[str, Any]) -> dict[str, Any]: ...

    def __contains__(self, name: object) -> bool: ...


def _enum(kind: type[enum.StrEnum], value: object, field_name: str) -> Any:
    try:
        return kind(str(value))
    except ValueError:
        allowed = ", ".join(repr(member.value) for member in kind)
        raise InvalidArgument(field_name, f"expected one of {allowed}, got {value!r}") from None


def check_json(value: Any, path: str = "payload", depth: int = 0) -> None:
    """Require what PostgreSQL's jsonb can store: finite numbers, no NUL characters, bounded nesting.

    A Struct from gRPC can carry NaN, Infinity and U+0000, which jsonb refuses (or JSON cannot say);
    refused here, before anything is stored, with the path of the offending value.

    Raises:
        InvalidArgument: naming the value's path (`payload.a.b`, `payload.list[2]`).
    """
    if isinstance(value, float):
        if not math.isfinite(value):
            raise InvalidArgument(path, f"{value} is not a JSON number (use a finite number)")
    elif isinstance(value, str):
        if "\x00" in value:
            raise InvalidArgument(path, "must not contain the NUL character (U+0000)")
    elif isinstance(value, Mapping | list | tuple):
        if depth >= MAX_PAYLOAD_DEPTH:
            raise InvalidArgument(path, f"nested deeper than {MAX_PAYLOAD_DEPTH} objects or arrays")
        if isinstance(value, Mapping):
            for key, item in value.items():
                if isinstance(key, str) and "\x00" in key:
                    raise InvalidArgument(path, "an object key must not contain the NUL character (U+0000)")
                check_json(item, f"{path}.{key}", depth + 1)
        else:
            for index, item in enumerate(value):
                check_json(item, f"{path}[{index}]", depth + 1)


def _remote_payload(spec: JobSpec, handlers: PayloadValidator, in_process_queue: str) -> dict[str, Any]:
    """The payload of a job whose handler the server does not know: a remote worker's (issue 23).
    Its name must follow the naming rule and its payload be a JSON object within the size limit
    (`validate_remote`; the remote handler checks the rest), and its queue must not be the
    in-process workers' (they dead-letter runs of handlers they do not know)."""
    payload = handlers.validate_remote(spec.handler, spec.payload)
    if spec.queue == in_process_queue:
        raise InvalidArgument(
            "queue",
            f"{spec.handler!r} is not a handler of this server, so only remote workers can run it, but "
            f"{in_process_queue!r} is the in-process workers' queue (they would dead-letter its runs): "
            "name the queue its remote workers serve (their hello's `queue`)",
        )
    return payload


def validate_job(spec: JobSpec, handlers: PayloadValidator, *, in_process_queue: str | None = None) -> JobSpec:
    """Check every field of `spec` and return it normalised.

    With `in_process_queue` (a server's), a handler `handlers` does not know is taken as a remote
    worker's (`_remote_payload`); without, it is refused.

    Raises:
        InvalidArgument: naming the first offending field; nothing has been stored.
    """
    name = spec.name.strip()
    if not name:
        raise InvalidArgument("name", "must not be empty")
    if len(name) > MAX_NAME_LENGTH:
        raise InvalidArgument("name", f"must be at most {MAX_NAME_LENGTH} characters")
    if not _NAME.match(name):
        raise InvalidArgument("name", "use letters, digits and _ . : - (starting with a letter or digit)")
    if not is_queue_name(spec.queue):
        raise InvalidArgument("queue", QUEUE_NAME_RULE)
    if isinstance(spec.priority, bool) or not PRIORITY_MIN <= spec.priority <= PRIORITY_MAX:
        raise InvalidArgument("priority", f"must be between {PRIORITY_MIN} and {PRIORITY_MAX}")
    check_json(spec.payload)
    check_references(spec.payload)
    if in_process_queue is not None and spec.handler not in handlers:
        payload = _remote_payload(spec, handlers, in_process_queue)
    else:
        payload = handlers.validate(spec.handler, spec.payload)
    if len(spec.depends_on) > MAX_UPSTREAMS:
        raise InvalidArgument("depends_on", f"at most {MAX_UPSTREAMS} upstream jobs")
    for index, upstream in enumerate(spec.depends_on):
        if not isinstance(upstream, str) or not upstream.strip():
            raise InvalidArgument(f"depends_on[{index}]", "must name a job (by id or name)")
        if upstream.strip() == name:
            raise InvalidArgument(
                f"depends_on[{index}]", f"would create a cycle: {name} → {name} (a job cannot depend on itself)"
            )
    kind = _enum(ScheduleKind, spec.schedule_kind, "schedule_kind")
    gap = _enum(GapPolicy, spec.dst_gap_policy, "dst_gap_policy")
    fold = _enum(FoldPolicy, spec.dst_fold_policy, "dst_fold_policy")
    parse_time_zone(spec.time_zone)
    cron, run_at = spec.cron, spec.run_at
    if kind is ScheduleKind.CRON:
        if not cron:
            raise InvalidArgument("cron", "required for a cron schedule")
        if run_at is not None:
            raise InvalidArgument("run_at", "only for a one-shot schedule")
        cron = parse_cron(cron, spec.time_zone, gap, fold).expression
    elif kind is ScheduleKind.ONCE:
        if cron:
            raise InvalidArgument("cron", "only for a cron schedule")
        if run_at is None:
            raise InvalidArgument("run_at", "required for a one-shot schedule")
        if run_at.tzinfo is None:
            raise InvalidArgument("run_at", "must carry a time zone (use UTC)")
        run_at = run_at.astimezone(UTC)
    elif cron or run_at is not None:
        raise InvalidArgument("schedule_kind", "a manual job has neither cron nor run_at")
    retry = spec.retry
    if not 0 <= retry.max_retries <= MAX_RETRIES_LIMIT:
        raise InvalidArgument("retry_policy.max_retries", f"must be between 0 and {MAX_RETRIES_LIMIT}")
    if retry.initial_backoff <= timedelta(0):
        raise InvalidArgument("retry_policy.initial_backoff", "must be positive")
    if retry.max_backoff < retry.initial_backoff:
        raise InvalidArgument("retry_policy.max_backoff", "must be at least initial_backoff")
    if retry.max_backoff > timedelta(days=1):
        raise InvalidArgument("retry_policy.max_backoff", "must be at most 1 day")
    if not timedelta(0) < spec.timeout <= MAX_TIMEOUT:
        raise InvalidArgument("timeout", "must be positive and at most 24h")
    limits = validate_refs(spec.limits)
    return replace(
        spec,
        name=name,
        payload=payload,
        schedule_kind=kind,
        cron=cron,
        run_at=run_at,
        dst_gap_policy=gap,
        dst_fold_policy=fold,
        misfire_policy=_enum(MisfirePolicy, spec.misfire_policy, "misfire_policy"),
        concurrency_policy=_enum(ConcurrencyPolicy, spec.concurrency_policy, "concurrency_policy"),
        status=_enum(JobStatus, spec.status, "status"),
        depends_on=tuple(dict.fromkeys(upstream.strip() for upstream in spec.depends_on)),
        trigger_rule=_enum(TriggerRule, spec.trigger_rule, "trigger_rule"),
        limits=limits,
    )
