"""JobService: job definitions, manual runs, schedule previews and backfills."""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import Any, Final

import grpc
from google.protobuf import field_mask_pb2
from scheduler_client.v1 import jobs_pb2, jobs_pb2_grpc

from scheduler_grpc import redaction, statuses
from scheduler_grpc.application import Api
from scheduler_grpc.auth import Principal, Role, current_principal
from scheduler_grpc.control import TriggerItem, preview_fire_times
from scheduler_grpc.control_bulk import JobAction
from scheduler_grpc.errors import InvalidArgument
from scheduler_grpc.jobs import Job, JobSpec
from scheduler_grpc.schedule import parse_cron
from scheduler_grpc.services import bulk, convert

Context = grpc.aio.ServicerContext[Any, Any]

DEFAULT_PREVIEW_COUNT: Final = 10
MAX_PREVIEW_COUNT: Final = 1000
_ETAG = re.compile(r'W/"(\d{1,18})"')
_SUBMESSAGE_FIELDS: Final = {
    "schedule": frozenset({"cron", "time_zone", "run_time", "dst_gap_policy", "dst_fold_policy"}),
    "retry_policy": frozenset({"max_retries", "initial_backoff", "max_backoff", "jitter"}),
}
_WRITABLE: Final = (
    "name", "handler", "payload", "schedule", "queue", "priority", "retry_policy", "timeout", "misfire_policy",
    "concurrency_policy", "depends_on", "trigger_rule", "limits",
)  # fmt: skip
_OUTPUT_ONLY: Final = frozenset(
    {"id", "state", "next_run_time", "etag", "create_time", "update_time", "handler_served"}
)


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


class JobService(jobs_pb2_grpc.JobServiceServicer):
    """CRUD on jobs plus trigger, preview and backfill (the rights are in `auth.METHOD_ROLES`)."""

    def __init__(self, api: Api) -> None:
        self._control = api.control
        self._handlers = api.handlers
        self._api = api

    async def _served(self, jobs: Sequence[Job], messages: Sequence[jobs_pb2.Job]) -> None:
        """Set `handler_served` of each message (`Api.handlers_served`)."""
        for message, served in zip(messages, await self._api.handlers_served(jobs), strict=True):
            message.handler_served = served

    async def _one(self, job: Job, message: jobs_pb2.Job) -> jobs_pb2.Job:
        await self._served([job], [message])
        return message

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
        return jobs_pb2.CreateJobResponse(job=await self._one(job, convert.job_to_proto(job)))

    async def GetJob(self, request: jobs_pb2.GetJobRequest, context: Context) -> jobs_pb2.GetJobResponse:
        job = await self._control.get_job(convert.resource_id(request.id))
        return jobs_pb2.GetJobResponse(job=await self._one(job, _shown(job)))

    async def ListJobs(self, request: jobs_pb2.ListJobsRequest, context: Context) -> jobs_pb2.ListJobsResponse:
        basic = convert.basic_job_view(request.view)
        page = await self._control.list_jobs(
            page_size=convert.page_size(request.page_size),
            page_token=request.page_token,
            status=convert.job_state(request.state),
            handler=request.handler or None,
            with_payload=not basic,
        )
        jobs, cut = convert.fill_page(page.jobs, _basic_job if basic else _shown)
        await self._served(page.jobs[: len(jobs)], jobs)
        token = page.token_after(page.jobs[len(jobs) - 1]) if cut else page.next_page_token
        return jobs_pb2.ListJobsResponse(jobs=jobs, next_page_token=token)

    async def UpdateJob(self, request: jobs_pb2.UpdateJobRequest, context: Context) -> jobs_pb2.UpdateJobResponse:
        if not request.HasField("job"):
            raise InvalidArgument("job", "required")
        job_id = convert.resource_id(request.job.id, "job.id")
        paths = _update_paths(request.update_mask)
        expected = _etag_version(request.etag) if request.etag else None
        principal = current_principal()

        def merge(current: Job) -> JobSpec:
            merged = convert.job_to_proto(current)
            field_mask_pb2.FieldMask(paths=paths).MergeMessage(
                request.job, merged, replace_message_field=True, replace_repeated_field=True
            )
            self._require_handler_rights(principal, {current.handler, merged.handler})
            return convert.job_spec(merged, status=current.status)

        with convert.job_fields():  # covers `merge` too: it runs inside merge_job
            job = await self._control.merge_job(job_id, merge, expected_version=expected)
        return jobs_pb2.UpdateJobResponse(job=await self._one(job, convert.job_to_proto(job)))

    async def DeleteJob(self, request: jobs_pb2.DeleteJobRequest, context: Context) -> jobs_pb2.DeleteJobResponse:
        await self._control.delete_job(convert.resource_id(request.id), detach_dependents=request.detach_dependents)
        return jobs_pb2.DeleteJobResponse()

    async def PauseJob(self, request: jobs_pb2.PauseJobRequest, context: Context) -> jobs_pb2.PauseJobResponse:
        job = await self._control.pause_job(convert.resource_id(request.id))
        return jobs_pb2.PauseJobResponse(job=await self._one(job, _shown(job)))

    async def ResumeJob(self, request: jobs_pb2.ResumeJobRequest, context: Context) -> jobs_pb2.ResumeJobResponse:
        job = await self._control.resume_job(convert.resource_id(request.id))
        return jobs_pb2.ResumeJobResponse(job=await self._one(job, _shown(job)))

    async def TriggerJob(self, request: jobs_pb2.TriggerJobRequest, context: Context) -> jobs_pb2.TriggerJobResponse:
        job_id = convert.resource_id(request.id)
        if request.HasField("payload"):  # validated against the job's handler: BatchTriggerJobs's path
            try:
                (answer,) = await self._control.trigger_many([_trigger_item(request)])
            except InvalidArgument as exc:  # named as a batch's item: `requests[0].payload.url`
                raise InvalidArgument(exc.field.removeprefix("requests[0]."), exc.message) from None
            if isinstance(answer, Exception):
                raise answer
            return jobs_pb2.TriggerJobResponse(execution=convert.execution_to_proto(answer))
        execution = await self._control.trigger_execution(job_id, request_id=request.request_id or None)
        return jobs_pb2.TriggerJobResponse(execution=convert.execution_to_proto(execution))

    async def BatchTriggerJobs(
        self, request: jobs_pb2.BatchTriggerJobsRequest, context: Context
    ) -> jobs_pb2.BatchTriggerJobsResponse:
        answers = await self._control.trigger_many([_trigger_item(item) for item in request.requests])
        response = jobs_pb2.BatchTriggerJobsResponse()
        add = response.results.add  # each result written in place: no message made and then copied in
        for answer in answers:
            result = add()
            if isinstance(answer, Exception):
                code, message = statuses.status_of(answer)
                result.code, result.message = grpc.StatusCode[code.name].value[0], message
            else:
                convert.fill_execution(result.execution, answer)
        return response

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
        fires = await preview_fire_times(cron, start, count)
        return jobs_pb2.PreviewScheduleResponse(fire_times=[convert.fire_time(fire) for fire in fires])

    async def BackfillJob(self, request: jobs_pb2.BackfillJobRequest, context: Context) -> jobs_pb2.BackfillJobResponse:
        job_id = convert.resource_id(request.id)
        if not request.HasField("start_time"):
            raise InvalidArgument("start_time", "required")
        if not request.HasField("end_time"):
            raise InvalidArgument("end_time", "required")
        start = convert.from_timestamp(request.start_time, "start_time")
        end = convert.from_timestamp(request.end_time, "end_time")
        executions = await self._control.backfill_range(job_id, start, end)
        return jobs_pb2.BackfillJobResponse(executions=[convert.execution_to_proto(e) for e in executions])

    async def BatchPauseJobs(
        self, request: jobs_pb2.BatchPauseJobsRequest, context: Context
    ) -> jobs_pb2.BatchPauseJobsResponse:
        done = await bulk.jobs(self._control, JobAction.PAUSE, request)
        return jobs_pb2.BatchPauseJobsResponse(matched_count=done.matched, job_ids=done.done)

    async def BatchResumeJobs(
        self, request: jobs_pb2.BatchResumeJobsRequest, context: Context
    ) -> jobs_pb2.BatchResumeJobsResponse:
        done = await bulk.jobs(self._control, JobAction.RESUME, request)
        return jobs_pb2.BatchResumeJobsResponse(matched_count=done.matched, job_ids=done.done)

    async def BatchDeleteJobs(
        self, request: jobs_pb2.BatchDeleteJobsRequest, context: Context
    ) -> jobs_pb2.BatchDeleteJobsResponse:
        done = await bulk.jobs(self._control, JobAction.DELETE, request, detach=request.detach_dependents)
        return jobs_pb2.BatchDeleteJobsResponse(matched_count=done.matched, job_ids=done.done, kept_ids=done.kept)


def _trigger_item(request: jobs_pb2.TriggerJobRequest) -> TriggerItem:
    """A TriggerJob request as `Control.trigger_many` takes it (ids are checked there, by index)."""
    payload = convert.struct_to_dict(request.payload) if request.HasField("payload") else None
    return TriggerItem(request.id, request.request_id or None, payload)


def _shown(job: Job) -> jobs_pb2.Job:
    """`job` as the caller may read it (payload secrets redacted below `redaction.SECRET_READER`)."""
    return convert.job_to_proto(redaction.job_for(current_principal().role, job))


def _basic_job(job: Job) -> jobs_pb2.Job:
    message = convert.job_to_proto(job)
    message.ClearField("payload")
    return message
