"""Hostile input over gRPC: every client mistake is INVALID_ARGUMENT naming its field, never INTERNAL."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime

import grpc
import pytest
from google.protobuf import duration_pb2, field_mask_pb2, struct_pb2, timestamp_pb2
from redis.asyncio import Redis
from scheduler_client.v1 import auth_pb2, executions_pb2, jobs_pb2

from scheduler_grpc import events
from scheduler_grpc.jobs import Job, JobSpec
from tests.test_api_executions import burst, take, watch
from tests.test_api_support import Harness, api, echo_job  # noqa: F401 - `api` is a fixture


async def job_count(harness: Harness) -> int:
    count: int = await harness.server.api.control._pool.fetchval("SELECT count(*) FROM jobs")
    return count


def _payload(**values: object) -> jobs_pb2.Job:
    job = echo_job()
    job.payload.update(values)
    return job


def _nested(depth: int) -> jobs_pb2.Job:
    """A job whose payload nests `depth` objects (the payload included), keys `a`."""
    job = echo_job()
    inner = struct_pb2.Struct()
    inner.update({"leaf": 1})
    for _ in range(depth - 1):
        outer = struct_pb2.Struct()
        outer.fields["a"].struct_value.CopyFrom(inner)
        inner = outer
    job.payload.CopyFrom(inner)
    return job


def _run_time(seconds: int, nanos: int = 0) -> jobs_pb2.Job:
    job = echo_job()
    job.schedule.run_time.CopyFrom(timestamp_pb2.Timestamp(seconds=seconds, nanos=nanos))
    return job


YEAR_10000 = 253402300800  # 10000-01-01T00:00:00Z
BEFORE_YEAR_1 = -62135596800 - 86400


def hostile_jobs() -> list[tuple[str, str, jobs_pb2.Job]]:
    return [
        ("nul-in-string", "job.payload.message", _payload(message="a\u0000b")),
        ("nul-in-key", "job.payload", _payload(**{"a\u0000": 1})),
        ("nan", "job.payload.x", _payload(x=float("nan"))),
        ("inf", "job.payload.x", _payload(x=float("inf"))),
        ("minus-inf", "job.payload.x", _payload(x=float("-inf"))),
        ("year-10000", "job.schedule.run_time", _run_time(YEAR_10000)),
        ("before-year-1", "job.schedule.run_time", _run_time(BEFORE_YEAR_1)),
        ("negative-nanos", "job.schedule.run_time", _run_time(2_000_000_000, -1)),
        ("deep-struct-21", "job.payload" + ".a" * 20, _nested(22)),
    ]


@pytest.mark.parametrize(("case", "field", "job"), hostile_jobs(), ids=[c for c, _, _ in hostile_jobs()])
async def test_client_mistakes_are_invalid_argument_naming_the_field(
    api: Harness,  # noqa: F811
    case: str,
    field: str,
    job: jobs_pb2.Job,
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await api.jobs.CreateJob(jobs_pb2.CreateJobRequest(job=job), metadata=api.admin)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value.details()
    assert (caught.value.details() or "").startswith(f"{field}"), caught.value.details()
    assert await job_count(api) == 0


def _field(number: int, body: bytes) -> bytes:
    """One length-delimited field in protobuf wire format."""
    return _varint((number << 3) | 2) + _varint(len(body)) + body


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _nested_struct(depth: int) -> bytes:
    struct = b""
    for _ in range(depth - 1):
        value = _field(5, struct)  # Value.struct_value
        struct = _field(1, _field(1, b"a") + _field(2, value))  # Struct.fields {key: "a", value}
    return struct


async def _raw_create_job(api: Harness, request: bytes) -> grpc.aio.AioRpcError:  # noqa: F811
    call = api.channel.unary_unary(
        "/scheduler.v1.JobService/CreateJob", request_serializer=None, response_deserializer=None
    )
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call(request, metadata=api.admin)
    return caught.value


@pytest.mark.parametrize(
    ("case", "field", "job"),
    [
        ("struct-40-levels", "job.payload" + ".a" * 20, _field(4, _nested_struct(40))),
        ("bad-utf8-name", "job.name", _field(2, b"ab\xffc")),
        (
            "bad-utf8-payload-string",
            "job.payload.k",
            _field(4, _field(1, _field(1, b"k") + _field(2, _field(3, b"\xc3(")))),
        ),
        ("bad-utf8-payload-key", "job.payload.", _field(4, _field(1, _field(1, b"\xff")))),
        ("truncated", "job", b"\x0a\x05ab"),
    ],
)
async def test_undecodable_requests_are_invalid_argument_naming_the_field(
    api: Harness,  # noqa: F811
    case: str,
    field: str,
    job: bytes,
) -> None:
    error = await _raw_create_job(api, _field(1, job) if case != "truncated" else job)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
    assert (error.details() or "").startswith(field), error.details()
    assert await job_count(api) == 0
    # The server is fine afterwards.
    await api.jobs.ListJobs(jobs_pb2.ListJobsRequest(), metadata=api.viewer)


async def test_an_api_key_expiring_after_year_9999_is_invalid_argument(api: Harness) -> None:  # noqa: F811
    request = auth_pb2.CreateApiKeyRequest(
        display_name="far", role=auth_pb2.ROLE_VIEWER, expire_time=timestamp_pb2.Timestamp(seconds=YEAR_10000)
    )
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await api.auth.CreateApiKey(request, metadata=api.admin)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value.details()
    assert (caught.value.details() or "").startswith("expire_time: "), caught.value.details()


@pytest.mark.parametrize(
    ("start", "count", "field"),
    [
        (datetime(9999, 12, 30, tzinfo=UTC), 10, "count"),
        (datetime(9999, 12, 31, 23, 59, tzinfo=UTC), 1, "start_time"),
    ],
)
async def test_a_preview_running_past_year_9999_is_invalid_argument(
    api: Harness,  # noqa: F811
    start: datetime,
    count: int,
    field: str,
) -> None:
    request = jobs_pb2.PreviewScheduleRequest(
        schedule=jobs_pb2.Schedule(cron="0 0 * * *", time_zone="America/New_York"), count=count
    )
    request.start_time.FromDatetime(start)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await api.jobs.PreviewSchedule(request, metadata=api.viewer)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value.details()
    assert (caught.value.details() or "").startswith(f"{field}: "), caught.value.details()


@pytest.mark.parametrize(("seconds", "nanos"), [(1, -5), (-1, 5), (1, 1_000_000_000), (0, -1_000_000_000), (10**12, 0)])
async def test_malformed_durations_are_refused_not_normalised(
    api: Harness,  # noqa: F811
    seconds: int,
    nanos: int,
) -> None:
    job = echo_job(timeout=duration_pb2.Duration(seconds=seconds, nanos=nanos))
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await api.jobs.CreateJob(jobs_pb2.CreateJobRequest(job=job), metadata=api.admin)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value.details()
    assert (caught.value.details() or "").startswith("job.timeout: "), caught.value.details()
    assert "nanos" in (caught.value.details() or "") or "seconds" in (caught.value.details() or "")
    assert await job_count(api) == 0


@pytest.mark.parametrize("published", [0, 3])
async def test_a_cursor_from_the_future_is_refused_not_silent(
    api: Harness,  # noqa: F811
    redis: Redis,
    published: int,
) -> None:
    if published:
        await events.publish(redis, burst(1, published))
    newest = (await events.read_after(redis))[-1].cursor if published else "0-0"
    for cursor in ("99999999999999-0", f"{int(newest.split('-')[0]) + 1}-0"):
        call = api.executions.WatchExecutions(executions_pb2.WatchExecutionsRequest(cursor=cursor), metadata=api.viewer)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await take(call, 1)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value.details()
        assert (caught.value.details() or "").startswith("cursor: "), caught.value.details()
    # The newest cursor itself is fine: the next event arrives.
    call, _ = await watch(api, api.viewer, cursor=newest)
    await events.publish(redis, burst(10, 1))
    assert [e.attempt for e in await take(call, 1)] == [10]
    call.cancel()


async def test_concurrent_retries_of_one_create_all_get_the_created_job(api: Harness) -> None:  # noqa: F811
    # Straight on the repository (10 pooled connections) for many races a second; then once over gRPC.
    jobs = api.server.api.control._jobs
    for round_ in range(40):
        spec = JobSpec(name=f"race-{round_}", handler="test.echo")
        answers = await asyncio.gather(
            *(jobs.create(spec, None, f"req-{round_}") for _ in range(10)), return_exceptions=True
        )
        errors = [answer for answer in answers if isinstance(answer, BaseException)]
        assert not errors, f"round {round_}: {errors[0]!r}"
        assert len({answer.id for answer in answers if isinstance(answer, Job)}) == 1
    request = jobs_pb2.CreateJobRequest(job=echo_job(name="race-grpc"), request_id="req-grpc")
    replies = await asyncio.gather(*(api.jobs.CreateJob(request, metadata=api.admin) for _ in range(20)))
    assert len({reply.job.id for reply in replies}) == 1
    assert await job_count(api) == 41
    # A different request for a taken name is still ALREADY_EXISTS.
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await api.jobs.CreateJob(
            jobs_pb2.CreateJobRequest(job=echo_job(name="race-0"), request_id="other"), metadata=api.admin
        )
    assert caught.value.code() == grpc.StatusCode.ALREADY_EXISTS


async def test_a_one_shot_time_older_than_the_misfire_grace_is_refused(api: Harness) -> None:  # noqa: F811
    long_ago = _run_time(0)  # 1970-01-01
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await api.jobs.CreateJob(jobs_pb2.CreateJobRequest(job=long_ago), metadata=api.admin)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value.details()
    assert (caught.value.details() or "").startswith("job.schedule.run_time: "), caught.value.details()
    assert await job_count(api) == 0
    # Within the grace (60 s by default) a time just past is fine: it runs at once.
    recent = _run_time(int(datetime.now(UTC).timestamp()) - 10)
    created = (await api.jobs.CreateJob(jobs_pb2.CreateJobRequest(job=recent), metadata=api.admin)).job
    # Moving it to 1970 is refused; updating anything else of a one-shot whose time has passed is not.
    moved = jobs_pb2.Job(id=created.id, schedule=long_ago.schedule)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await api.jobs.UpdateJob(
            jobs_pb2.UpdateJobRequest(job=moved, update_mask=field_mask_pb2.FieldMask(paths=["schedule"])),
            metadata=api.admin,
        )
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value.details()
    assert (caught.value.details() or "").startswith("job.schedule.run_time: "), caught.value.details()


async def test_a_backfill_from_the_first_instant_of_year_1_is_not_internal(api: Harness) -> None:  # noqa: F811
    job = (
        await api.jobs.CreateJob(
            jobs_pb2.CreateJobRequest(
                job=jobs_pb2.Job(
                    name="c",
                    handler="test.echo",
                    schedule=jobs_pb2.Schedule(cron="0 0 1 1 *", time_zone="America/New_York"),
                )
            ),
            metadata=api.admin,
        )
    ).job
    request = jobs_pb2.BackfillJobRequest(
        id=job.id,
        start_time=timestamp_pb2.Timestamp(seconds=-62_135_596_800),
        end_time=timestamp_pb2.Timestamp(seconds=0),
    )
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await api.jobs.BackfillJob(request, metadata=api.admin)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value.details()
