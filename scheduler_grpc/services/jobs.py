"""JobService: job definitions, manual runs, schedule previews and backfills."""

from __future__ import annotations

import asyncio
import itertools
import re
from collections.abc import Iterable, Sequence
from datetime import datetime, timedelta
from typing import Any, Final

import grpc
from google.protobuf import field_mask_pb2
from scheduler_client.v1 import jobs_pb2, jobs_pb2_grpc

from scheduler_grpc.auth import Principal, Role, current_principal
from scheduler_grpc.errors import Aborted, FailedPrecondition, InvalidArgument, NotFound
from scheduler_grpc.executions import Execution
from scheduler_grpc.jobs import Job, ScheduleKind
from scheduler_grpc.schedule import CronSchedule, FireTime, fire_times, parse_cron
from scheduler_grpc.services import Api, convert

Context = grpc.aio.ServicerContext[Any, Any]

DEFAULT_PREVIEW_COUNT: Final = 10
MAX_PREVIEW_COUNT: Final = 1000
MAX_BACKFILL_SLOTS: Final = 1000
# An update without an etag merges onto the job as read; if someone else writes in between, the
# merge is redone on the new version (an etag-less update asks for "last writer wins", not ABORTED).
_UPDATE_ATTEMPTS: Final = 3
_ETAG = re.compile(r'W/"(\d{1,18})"')
_SUBMESSAGE_FIELDS: Final = {
    "schedule": frozenset({"cron", "time_zone", "run_time", "dst_gap_policy", "dst_fold_policy"}),
    "retry_policy": frozenset({"max_retries", "initial_backoff", "max_backoff", "jitter"}),
}
_WRITABLE: Final = (
    "name", "handler", "payload", "schedule", "queue", "priority", "retry_policy", "timeout", "misfire_policy",
    "concurrency_policy",
)  # fmt: skip
_OUTPUT_ONLY: Final = frozenset({"id", "state", "next_run_time", "etag", "create_time", "update_time"})


def _update_paths(mask: field_mask_pb2.FieldMask) -> list[str]:
    """The writable Job field paths `mask` names (all of them for an empty mask).

    Raises:
        InvalidArgument: an unknown or output-only path, naming `update_mask`.
    """
    if not mask.paths:
        return list(_WRITABLE)
    for path in mask.paths:
        head, _, tail = path.partition(".")
        if head in _OUTPUT_ONLY:
            hint = "; use PauseJob/ResumeJob" if head == "state" else ""
            raise InvalidArgument("update_mask", f"{path!r} is output only{hint}")
        if head not in _WRITABLE or (tail and tail not in _SUBMESSAGE_FIELDS.get(head, ())):
            raise InvalidArgument("update_mask", f"unknown field {path!r}")
    return list(dict.fromkeys(mask.paths))


def _etag_version(etag: str) -> int:
    match = _ETAG.fullmatch(etag.strip())
    if match is None:
        raise InvalidArgument("etag", f"{etag[:40]!r} is not an etag this server issued")
    return int(match.group(1))


def _slots(schedule: CronSchedule, start: datetime, end: datetime) -> list[datetime]:
    """Fire times in [start, end), at most MAX_BACKFILL_SLOTS + 1 (the caller refuses more)."""
    slots: list[datetime] = []
    for fire in fire_times(schedule, start - timedelta(microseconds=1)):
        if fire.instant >= end or len(slots) > MAX_BACKFILL_SLOTS:
            break
        slots.append(fire.instant)
    return slots


class JobService(jobs_pb2_grpc.JobServiceServicer):
    """CRUD on jobs plus trigger, preview and backfill (the rights are in `auth.METHOD_ROLES`)."""

    def __init__(self, api: Api) -> None:
        self._control = api.control
        self._handlers = api.handlers

    def _require_handler_rights(self, principal: Principal, handlers: Iterable[str]) -> None:
        # Checked here as well as by the method table: defining what a shell command runs is
        # admin-only whatever roles a future table grants for job definitions.
        for name in handlers:
            try:
                handler = self._handlers.get(name)
            except InvalidArgument:
                continue  # unknown: validation reports it with the field named
            if handler.admin_only:
                principal.require(Role.ADMIN, f"jobs using handler {name!r}")

    async def CreateJob(self, request: jobs_pb2.CreateJobRequest, context: Context) -> jobs_pb2.CreateJobResponse:
        if not request.HasField("job"):
            raise InvalidArgument("job", "required")
        self._require_handler_rights(current_principal(), [request.job.handler])
        with convert.job_fields():
            spec = convert.job_spec(request.job)
            job = await self._control.create_job(spec, request_id=request.request_id or None)
        return jobs_pb2.CreateJobResponse(job=convert.job_to_proto(job))

    async def GetJob(self, request: jobs_pb2.GetJobRequest, context: Context) -> jobs_pb2.GetJobResponse:
        job = await self._control.jobs.get(convert.resource_id(request.id))
        return jobs_pb2.GetJobResponse(job=convert.job_to_proto(job))

    async def ListJobs(self, request: jobs_pb2.ListJobsRequest, context: Context) -> jobs_pb2.ListJobsResponse:
        basic = convert.basic_job_view(request.view)
        page = await self._control.jobs.list_page(
            page_size=convert.page_size(request.page_size),
            page_token=request.page_token,
            status=convert.job_state(request.state),
            handler=request.handler or None,
            with_payload=not basic,
        )
        jobs, cut = convert.fill_page(page.jobs, _basic_job if basic else convert.job_to_proto)
        token = page.token_after(page.jobs[len(jobs) - 1]) if cut else page.next_page_token
        return jobs_pb2.ListJobsResponse(jobs=jobs, next_page_token=token)

    async def UpdateJob(self, request: jobs_pb2.UpdateJobRequest, context: Context) -> jobs_pb2.UpdateJobResponse:
        if not request.HasField("job"):
            raise InvalidArgument("job", "required")
        job_id = convert.resource_id(request.job.id, "job.id")
        paths = _update_paths(request.update_mask)
        expected = _etag_version(request.etag) if request.etag else None
        principal = current_principal()
        for attempt in range(1, _UPDATE_ATTEMPTS + 1):
            current = await self._control.jobs.get(job_id)
            if expected is not None and current.version != expected:
                raise Aborted(f"etag: job changed meanwhile (now {current.etag}); read it again and retry")
            merged = convert.job_to_proto(current)
            field_mask_pb2.FieldMask(paths=paths).MergeMessage(
                request.job, merged, replace_message_field=True, replace_repeated_field=True
            )
            self._require_handler_rights(principal, {current.handler, merged.handler})
            with convert.job_fields():
                spec = convert.job_spec(merged, status=current.status)
                try:
                    job = await self._control.update_job(job_id, spec, expected_version=current.version)
                except Aborted:
                    if expected is not None or attempt == _UPDATE_ATTEMPTS:
                        raise
                    continue
            return jobs_pb2.UpdateJobResponse(job=convert.job_to_proto(job))
        raise AssertionError("unreachable: the last attempt returns or raises")

    async def DeleteJob(self, request: jobs_pb2.DeleteJobRequest, context: Context) -> jobs_pb2.DeleteJobResponse:
        await self._control.delete_job(convert.resource_id(request.id))
        return jobs_pb2.DeleteJobResponse()

    async def PauseJob(self, request: jobs_pb2.PauseJobRequest, context: Context) -> jobs_pb2.PauseJobResponse:
        job = await self._control.pause_job(convert.resource_id(request.id))
        return jobs_pb2.PauseJobResponse(job=convert.job_to_proto(job))

    async def ResumeJob(self, request: jobs_pb2.ResumeJobRequest, context: Context) -> jobs_pb2.ResumeJobResponse:
        job = await self._control.resume_job(convert.resource_id(request.id))
        return jobs_pb2.ResumeJobResponse(job=convert.job_to_proto(job))

    async def TriggerJob(self, request: jobs_pb2.TriggerJobRequest, context: Context) -> jobs_pb2.TriggerJobResponse:
        job_id = convert.resource_id(request.id)
        request_id = request.request_id or None
        runs = await self._control.trigger_job(job_id, request_id=request_id)
        execution: Execution
        if runs:
            execution = await self._control.executions.get(runs[0].run_id)
        elif request_id is not None:  # the same request ran before: answer with its run
            execution = await self._control.executions.get_by_request_id(job_id, request_id)
        else:
            raise NotFound(f"job {job_id} not found")
        return jobs_pb2.TriggerJobResponse(execution=convert.execution_to_proto(execution))

    async def PreviewSchedule(
        self, request: jobs_pb2.PreviewScheduleRequest, context: Context
    ) -> jobs_pb2.PreviewScheduleResponse:
        schedule = request.schedule
        if not schedule.cron:
            raise InvalidArgument("schedule.cron", "required")
        if schedule.HasField("run_time"):
            raise InvalidArgument("schedule.run_time", "a preview shows a cron schedule; leave run_time unset")
        if not 0 <= request.count <= MAX_PREVIEW_COUNT:
            raise InvalidArgument("count", f"must be between 0 and {MAX_PREVIEW_COUNT} (0: {DEFAULT_PREVIEW_COUNT})")
        count = request.count or DEFAULT_PREVIEW_COUNT
        with convert.renamed_fields(convert.SCHEDULE_FIELDS):
            gap, fold = convert.schedule_policies(schedule)
            cron = parse_cron(schedule.cron, schedule.time_zone or "UTC", gap, fold)
        start = convert.now()
        if request.HasField("start_time"):
            start = convert.from_timestamp(request.start_time, "start_time")

        def preview() -> list[FireTime]:
            fires: list[FireTime] = []
            try:
                for fire in itertools.islice(fire_times(cron, start), count):
                    fires.append(fire)
            except (OverflowError, ValueError):
                # datetime ends at 9999-12-31: a walk that runs past it (or starts at its edges) stops.
                if not fires:
                    raise InvalidArgument("start_time", "no fire time between start_time and year 9999") from None
                raise InvalidArgument(
                    "count", f"only {len(fires)} fire times before year 9999; ask for fewer"
                ) from None
            return fires

        # Up to 1000 cron steps: CPU work kept off the event loop.
        fires = await asyncio.to_thread(preview)
        return jobs_pb2.PreviewScheduleResponse(fire_times=[convert.fire_time(fire) for fire in fires])

    async def BackfillJob(self, request: jobs_pb2.BackfillJobRequest, context: Context) -> jobs_pb2.BackfillJobResponse:
        job_id = convert.resource_id(request.id)
        if not request.HasField("start_time"):
            raise InvalidArgument("start_time", "required")
        if not request.HasField("end_time"):
            raise InvalidArgument("end_time", "required")
        start = convert.from_timestamp(request.start_time, "start_time")
        end = convert.from_timestamp(request.end_time, "end_time")
        if end > convert.now():
            raise InvalidArgument("end_time", "must not be in the future")
        if end <= start:
            raise InvalidArgument("end_time", "must be after start_time")
        job = await self._control.jobs.get(job_id)
        schedule = _cron_schedule(job)
        try:
            slots = await asyncio.to_thread(_slots, schedule, start, end)
        except (OverflowError, ValueError):  # datetime begins at year 1: a walk from its edge overflows
            raise InvalidArgument("start_time", "too close to year 1 for this schedule; start later") from None
        if len(slots) > MAX_BACKFILL_SLOTS:
            raise InvalidArgument(
                "end_time", f"the range holds more than {MAX_BACKFILL_SLOTS} slots; backfill it in smaller ranges"
            )
        runs = await self._control.backfill_job(job.id, slots)
        executions = await self._executions([run.run_id for run in runs])
        executions.sort(key=lambda execution: execution.scheduled_for)
        return jobs_pb2.BackfillJobResponse(executions=[convert.execution_to_proto(e) for e in executions])

    async def _executions(self, ids: Sequence[str]) -> list[Execution]:
        return [await self._control.executions.get(execution_id) for execution_id in ids]


def _basic_job(job: Job) -> jobs_pb2.Job:
    message = convert.job_to_proto(job)
    message.ClearField("payload")
    return message


def _cron_schedule(job: Job) -> CronSchedule:
    schedule = job.cron_schedule
    if job.schedule_kind is not ScheduleKind.CRON or schedule is None:
        raise FailedPrecondition("id: only cron jobs can be backfilled")
    return schedule
