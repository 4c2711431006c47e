"""JobService over gRPC: every RPC's success path, validation naming the field, idempotency, etags."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

import grpc
import pytest
from google.protobuf import duration_pb2, field_mask_pb2
from scheduler_client.v1 import executions_pb2, jobs_pb2

from tests.test_api_support import Harness, api, cron_job, echo_job  # noqa: F401 - `api` is a fixture


async def test_create_get_list_delete(api: Harness) -> None:  # noqa: F811
    created = await api.jobs.CreateJob(jobs_pb2.CreateJobRequest(job=cron_job()), metadata=api.admin)
    job = created.job
    assert job.id
    assert job.etag == 'W/"1"'
    assert job.state == jobs_pb2.JOB_STATE_ACTIVE
    assert job.HasField("next_run_time")
    got = await api.jobs.GetJob(jobs_pb2.GetJobRequest(id=job.id), metadata=api.viewer)
    assert got.job == job
    listed = await api.jobs.ListJobs(jobs_pb2.ListJobsRequest(), metadata=api.viewer)
    assert [j.id for j in listed.jobs] == [job.id]
    await api.jobs.DeleteJob(jobs_pb2.DeleteJobRequest(id=job.id), metadata=api.admin)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await api.jobs.GetJob(jobs_pb2.GetJobRequest(id=job.id), metadata=api.viewer)
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND


def status_of(caught: pytest.ExceptionInfo[grpc.aio.AioRpcError]) -> tuple[grpc.StatusCode, str]:
    """The code and the field an error names (the text before the first ': ')."""
    return caught.value.code(), (caught.value.details() or "").split(": ")[0]


async def job_count(harness: Harness) -> int:
    count: int = await harness.server.api.control._pool.fetchval("SELECT count(*) FROM jobs")
    return count


def with_retry(**fields: object) -> jobs_pb2.Job:
    job = echo_job()
    job.retry_policy.CopyFrom(jobs_pb2.RetryPolicy(**fields))  # type: ignore[arg-type]
    return job


def invalid_jobs() -> list[tuple[str, jobs_pb2.Job]]:
    bad_payload = jobs_pb2.Job(name="delay", handler="test.delay")
    bad_payload.payload.update({"seconds": 1, "unknown_field": 1})
    missing = jobs_pb2.Job(name="delay", handler="test.delay")
    webhook = jobs_pb2.Job(name="hook", handler="http.webhook")
    webhook.payload.update({"url": "ftp://x"})
    return [
        ("job.name", echo_job(name="")),
        ("job.name", echo_job(name="has spaces")),
        ("job.name", echo_job(name="x" * 201)),
        ("job.handler", jobs_pb2.Job(name="n", handler="No Such Handler")),  # not even a remote one
        ("job.queue", jobs_pb2.Job(name="n", handler="no.such.handler")),  # a remote one, on the in-process queue
        ("job.payload.unknown_field", bad_payload),
        ("job.payload.seconds", missing),
        ("job.payload.url", webhook),
        ("job.queue", echo_job(queue="bad queue!")),
        ("job.priority", echo_job(priority=1001)),
        ("job.schedule.cron", cron_job(cron="61 * * * *")),
        ("job.schedule.cron", cron_job(cron="0 0 31 2 *")),
        ("job.schedule.cron", cron_job(cron="0 0 * * 5L")),
        ("job.schedule.cron", cron_job(cron="0 0 1W,15W * *")),
        ("job.schedule.time_zone", _cron_in("Mars/Olympus")),
        ("job.schedule", _both_cron_and_run_time()),
        ("job.schedule.dst_gap_policy", _cron_with(dst_gap_policy=7)),
        ("job.schedule.dst_fold_policy", _cron_with(dst_fold_policy=9)),
        ("job.retry_policy.max_retries", with_retry(max_retries=101)),
        ("job.retry_policy.max_retries", with_retry(max_retries=-1)),
        ("job.retry_policy.initial_backoff", with_retry(initial_backoff=duration_pb2.Duration(seconds=-1))),
        (
            "job.retry_policy.max_backoff",
            with_retry(initial_backoff=duration_pb2.Duration(seconds=10), max_backoff=duration_pb2.Duration(seconds=1)),
        ),
        ("job.timeout", echo_job(timeout=duration_pb2.Duration(seconds=0))),
        ("job.timeout", echo_job(timeout=duration_pb2.Duration(seconds=25 * 3600))),
        ("job.misfire_policy", echo_job(misfire_policy=42)),  # type: ignore[arg-type]
        ("job.concurrency_policy", echo_job(concurrency_policy=42)),  # type: ignore[arg-type]
        ("request_id", echo_job()),
    ]


def _cron_in(zone: str) -> jobs_pb2.Job:
    job = cron_job()
    job.schedule.time_zone = zone
    return job


def _cron_with(**fields: int) -> jobs_pb2.Job:
    job = cron_job()
    for name, value in fields.items():
        setattr(job.schedule, name, value)
    return job


def _both_cron_and_run_time() -> jobs_pb2.Job:
    job = cron_job()
    job.schedule.run_time.FromDatetime(datetime(2030, 1, 1, tzinfo=UTC))
    return job


@pytest.mark.parametrize(("field", "job"), invalid_jobs(), ids=[f"{f}-{i}" for i, (f, _) in enumerate(invalid_jobs())])
async def test_invalid_create_names_the_field_and_stores_nothing(
    api: Harness,  # noqa: F811
    field: str,
    job: jobs_pb2.Job,
) -> None:
    request_id = "r" * 129 if field == "request_id" else ""
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await api.jobs.CreateJob(jobs_pb2.CreateJobRequest(job=job, request_id=request_id), metadata=api.admin)
    assert status_of(caught) == (grpc.StatusCode.INVALID_ARGUMENT, field), caught.value.details()
    assert await job_count(api) == 0


async def test_create_is_idempotent_per_request_id_and_names_are_unique(api: Harness) -> None:  # noqa: F811
    first = await api.jobs.CreateJob(jobs_pb2.CreateJobRequest(job=echo_job(), request_id="req-1"), metadata=api.admin)
    again = await api.jobs.CreateJob(jobs_pb2.CreateJobRequest(job=echo_job(), request_id="req-1"), metadata=api.admin)
    assert again.job.id == first.job.id
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await api.jobs.CreateJob(jobs_pb2.CreateJobRequest(job=echo_job(), request_id="req-2"), metadata=api.admin)
    assert caught.value.code() == grpc.StatusCode.ALREADY_EXISTS
    assert await job_count(api) == 1


async def test_update_merges_the_mask_and_checks_the_etag(api: Harness) -> None:  # noqa: F811
    job = (await api.jobs.CreateJob(jobs_pb2.CreateJobRequest(job=cron_job(priority=5)), metadata=api.admin)).job
    change = jobs_pb2.Job(id=job.id, priority=-3, schedule=jobs_pb2.Schedule(cron="0 * * * *", time_zone="Asia/Tokyo"))
    change.retry_policy.max_retries = 0
    updated = (
        await api.jobs.UpdateJob(
            jobs_pb2.UpdateJobRequest(
                job=change,
                update_mask=field_mask_pb2.FieldMask(paths=["priority", "schedule.cron", "retry_policy.max_retries"]),
                etag=job.etag,
            ),
            metadata=api.admin,
        )
    ).job
    assert (updated.priority, updated.schedule.cron, updated.retry_policy.max_retries) == (-3, "0 * * * *", 0)
    # Fields outside the mask keep their stored values.
    assert (updated.name, updated.schedule.time_zone, updated.retry_policy.initial_backoff.seconds) == (
        "tick",
        "UTC",
        1,
    )
    assert updated.etag == 'W/"2"'
    with pytest.raises(grpc.aio.AioRpcError) as caught:  # the etag read before the update is stale now
        await api.jobs.UpdateJob(
            jobs_pb2.UpdateJobRequest(
                job=jobs_pb2.Job(id=job.id, priority=1),
                update_mask=field_mask_pb2.FieldMask(paths=["priority"]),
                etag=job.etag,
            ),
            metadata=api.admin,
        )
    assert status_of(caught) == (grpc.StatusCode.ABORTED, "etag")
    assert (await api.jobs.GetJob(jobs_pb2.GetJobRequest(id=job.id), metadata=api.viewer)).job == updated


@pytest.mark.parametrize(
    ("paths", "change", "field"),
    [
        (["priority"], {"priority": 5000}, "job.priority"),
        (["schedule.cron"], {"schedule": jobs_pb2.Schedule(cron="nope")}, "job.schedule.cron"),
        (["schedule.time_zone"], {"schedule": jobs_pb2.Schedule(time_zone="Nowhere/City")}, "job.schedule.time_zone"),
        (["name"], {"name": "bad name"}, "job.name"),
        (["handler"], {"handler": "No Such Handler"}, "job.handler"),
        (["handler"], {"handler": "no.such.handler"}, "job.queue"),
        (["timeout"], {"timeout": duration_pb2.Duration(seconds=-5)}, "job.timeout"),
        (["retry_policy.max_retries"], {"retry_policy": jobs_pb2.RetryPolicy(max_retries=500)},
         "job.retry_policy.max_retries"),
        (["state"], {}, "update_mask"),
        (["no_such_field"], {}, "update_mask"),
    ],
)  # fmt: skip
async def test_invalid_update_names_the_field_and_changes_nothing(
    api: Harness,  # noqa: F811
    paths: list[str],
    change: dict[str, object],
    field: str,
) -> None:
    job = (await api.jobs.CreateJob(jobs_pb2.CreateJobRequest(job=cron_job()), metadata=api.admin)).job
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await api.jobs.UpdateJob(
            jobs_pb2.UpdateJobRequest(
                job=jobs_pb2.Job(id=job.id, **change),  # type: ignore[arg-type]
                update_mask=field_mask_pb2.FieldMask(paths=paths),
            ),
            metadata=api.admin,
        )
    assert status_of(caught) == (grpc.StatusCode.INVALID_ARGUMENT, field), caught.value.details()
    assert (await api.jobs.GetJob(jobs_pb2.GetJobRequest(id=job.id), metadata=api.viewer)).job == job


async def test_pause_resume_and_trigger_idempotently(api: Harness) -> None:  # noqa: F811
    job = (await api.jobs.CreateJob(jobs_pb2.CreateJobRequest(job=cron_job()), metadata=api.admin)).job
    paused = (await api.jobs.PauseJob(jobs_pb2.PauseJobRequest(id=job.id), metadata=api.operator)).job
    assert paused.state == jobs_pb2.JOB_STATE_PAUSED
    assert not paused.HasField("next_run_time")
    resumed = (await api.jobs.ResumeJob(jobs_pb2.ResumeJobRequest(id=job.id), metadata=api.operator)).job
    assert resumed.state == jobs_pb2.JOB_STATE_ACTIVE
    assert resumed.HasField("next_run_time")
    first = await api.jobs.TriggerJob(jobs_pb2.TriggerJobRequest(id=job.id, request_id="t-1"), metadata=api.operator)
    again = await api.jobs.TriggerJob(jobs_pb2.TriggerJobRequest(id=job.id, request_id="t-1"), metadata=api.operator)
    other = await api.jobs.TriggerJob(jobs_pb2.TriggerJobRequest(id=job.id), metadata=api.operator)
    assert first.execution.id == again.execution.id != other.execution.id
    assert first.execution.trigger == executions_pb2.TRIGGER_MANUAL
    assert first.execution.state == executions_pb2.EXECUTION_STATE_QUEUED
    runs = await api.server.api.control._pool.fetchval("SELECT count(*) FROM job_executions")
    assert runs == 2
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await api.jobs.TriggerJob(jobs_pb2.TriggerJobRequest(id=str(uuid.uuid4())), metadata=api.operator)
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await api.jobs.TriggerJob(jobs_pb2.TriggerJobRequest(id="not-a-uuid"), metadata=api.operator)
    assert status_of(caught) == (grpc.StatusCode.INVALID_ARGUMENT, "id")


async def test_pagination_over_1000_jobs_has_no_gaps_or_repeats(api: Harness) -> None:  # noqa: F811
    await api.server.api.control._pool.execute(
        """INSERT INTO jobs (name, handler, schedule_kind)
           SELECT 'job-' || lpad(i::text, 4, '0'), 'test.echo', 'manual' FROM generate_series(1, 1000) AS i"""
    )
    names: list[str] = []
    token = ""
    while True:
        page = await api.jobs.ListJobs(jobs_pb2.ListJobsRequest(page_size=37, page_token=token), metadata=api.viewer)
        names += [job.name for job in page.jobs]
        token = page.next_page_token
        if not token:
            break
    assert names == [f"job-{i:04d}" for i in range(1, 1001)]
    whole = await api.jobs.ListJobs(jobs_pb2.ListJobsRequest(page_size=1000), metadata=api.viewer)
    assert len(whole.jobs) == 1000
    assert not whole.next_page_token
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await api.jobs.ListJobs(jobs_pb2.ListJobsRequest(page_size=1001), metadata=api.viewer)
    assert status_of(caught) == (grpc.StatusCode.INVALID_ARGUMENT, "page_size")
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await api.jobs.ListJobs(jobs_pb2.ListJobsRequest(page_token="_w=="), metadata=api.viewer)
    assert status_of(caught) == (grpc.StatusCode.INVALID_ARGUMENT, "page_token")


async def test_preview_schedule_marks_daylight_saving_effects(api: Harness) -> None:  # noqa: F811
    request = jobs_pb2.PreviewScheduleRequest(
        schedule=jobs_pb2.Schedule(
            cron="30 2 * * *", time_zone="Europe/Paris", dst_fold_policy=jobs_pb2.DST_FOLD_POLICY_BOTH
        ),
        count=3,
    )
    request.start_time.FromDatetime(datetime(2026, 3, 28, 12, tzinfo=UTC))
    fires = (await api.jobs.PreviewSchedule(request, metadata=api.viewer)).fire_times
    assert [f.local_time for f in fires] == ["2026-03-29T02:30:00", "2026-03-30T02:30:00", "2026-03-31T02:30:00"]
    assert [f.dst_effect for f in fires] == [jobs_pb2.DST_EFFECT_SHIFTED, jobs_pb2.DST_EFFECT_NONE,
                                             jobs_pb2.DST_EFFECT_NONE]  # fmt: skip
    assert fires[0].fire_time.ToDatetime(tzinfo=UTC) == datetime(2026, 3, 29, 1, tzinfo=UTC)
    request.start_time.FromDatetime(datetime(2026, 10, 24, 12, tzinfo=UTC))
    fires = (await api.jobs.PreviewSchedule(request, metadata=api.viewer)).fire_times
    assert [f.dst_effect for f in fires][:2] == [jobs_pb2.DST_EFFECT_NONE, jobs_pb2.DST_EFFECT_REPEATED]
    assert fires[0].local_time == fires[1].local_time == "2026-10-25T02:30:00"
    many = await api.jobs.PreviewSchedule(
        jobs_pb2.PreviewScheduleRequest(schedule=jobs_pb2.Schedule(cron="* * * * *"), count=1000), metadata=api.viewer
    )
    assert len(many.fire_times) == 1000
    default = await api.jobs.PreviewSchedule(
        jobs_pb2.PreviewScheduleRequest(schedule=jobs_pb2.Schedule(cron="@daily")), metadata=api.viewer
    )
    assert len(default.fire_times) == 10
    for bad, field in [
        (jobs_pb2.PreviewScheduleRequest(schedule=jobs_pb2.Schedule(cron="* * *")), "schedule.cron"),
        (jobs_pb2.PreviewScheduleRequest(schedule=jobs_pb2.Schedule()), "schedule.cron"),
        (jobs_pb2.PreviewScheduleRequest(schedule=jobs_pb2.Schedule(cron="@daily", time_zone="X/Y")),
         "schedule.time_zone"),
        (jobs_pb2.PreviewScheduleRequest(schedule=jobs_pb2.Schedule(cron="@daily"), count=1001), "count"),
    ]:  # fmt: skip
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await api.jobs.PreviewSchedule(bad, metadata=api.viewer)
        assert status_of(caught) == (grpc.StatusCode.INVALID_ARGUMENT, field)


async def test_backfill_creates_one_run_per_past_slot_once(api: Harness) -> None:  # noqa: F811
    job = (await api.jobs.CreateJob(jobs_pb2.CreateJobRequest(job=cron_job(cron="0 * * * *")), metadata=api.admin)).job
    end = datetime.now(UTC).replace(minute=30, second=0, microsecond=0) - timedelta(hours=1)
    request = jobs_pb2.BackfillJobRequest(id=job.id)
    request.start_time.FromDatetime(end - timedelta(hours=5))
    request.end_time.FromDatetime(end)
    created = (await api.jobs.BackfillJob(request, metadata=api.admin)).executions
    assert len(created) == 5
    assert {e.trigger for e in created} == {executions_pb2.TRIGGER_BACKFILL}
    assert [e.schedule_time.ToDatetime(tzinfo=UTC).minute for e in created] == [0] * 5
    assert (await api.jobs.BackfillJob(request, metadata=api.admin)).executions == []  # idempotent per slot
    future = jobs_pb2.BackfillJobRequest(id=job.id, start_time=request.start_time)
    future.end_time.FromDatetime(datetime.now(UTC) + timedelta(hours=1))
    wide = jobs_pb2.BackfillJobRequest(id=job.id, end_time=request.end_time)
    wide.start_time.FromDatetime(end - timedelta(days=60))
    for bad, field in [
        (future, "end_time"),
        (wide, "end_time"),
        (jobs_pb2.BackfillJobRequest(id=job.id), "start_time"),
    ]:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await api.jobs.BackfillJob(bad, metadata=api.admin)
        assert status_of(caught) == (grpc.StatusCode.INVALID_ARGUMENT, field)
    manual = (await api.jobs.CreateJob(jobs_pb2.CreateJobRequest(job=echo_job()), metadata=api.admin)).job
    request.id = manual.id
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await api.jobs.BackfillJob(request, metadata=api.admin)
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
