"""A NUL character (U+0000) in any string field of any request is refused, naming the field.

PostgreSQL cannot hold NUL in text or jsonb (the statement fails), and Redis keys use it as a
separator: a NUL that got past validation ended calls with INTERNAL (`BatchPauseJobs` with a NUL
in `filter.handler`, found by the fuzz test). Here every string field of every request message
(found from the descriptors, so a new field is swept without a change here) gets a NUL inside an
otherwise valid request, and the answer must be INVALID_ARGUMENT naming that field, with nothing
stored. (The check is one, in `services.decode`: every request is decoded there.)
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import grpc
from google.protobuf import duration_pb2, field_mask_pb2
from google.protobuf.descriptor import Descriptor, FieldDescriptor, MethodDescriptor
from google.protobuf.message import Message
from google.protobuf.message_factory import GetMessageClass
from scheduler_client.v1 import (
    auth_pb2,
    cluster_pb2,
    executions_pb2,
    jobs_pb2,
    limits_pb2,
    queue_pb2,
    users_pb2,
)

from tests.test_api_support import Harness, api, echo_job  # noqa: F401 - the fixture

NUL = "nul\x00here"
SERVICES = [
    module.DESCRIPTOR.services_by_name[name]
    for module, name in (
        (auth_pb2, "AuthService"),
        (jobs_pb2, "JobService"),
        (executions_pb2, "ExecutionService"),
        (queue_pb2, "QueueService"),
        (cluster_pb2, "ClusterService"),
        (users_pb2, "UserService"),
        (limits_pb2, "LimitService"),
    )
]
METHODS = [method for service in SERVICES for method in service.methods]


def string_paths(descriptor: Descriptor, prefix: str = "") -> Iterator[str]:
    """The paths of the string fields under `descriptor` (not inside well-known types: a Struct's
    strings are the payload's, checked by the payload tests), map keys as `field{}`."""
    for field in descriptor.fields:
        path = f"{prefix}{field.name}"
        if field.type == FieldDescriptor.TYPE_STRING:
            yield path
        elif field.type == FieldDescriptor.TYPE_MESSAGE:
            child = field.message_type
            assert child is not None
            if child.GetOptions().map_entry:
                if child.fields_by_name["key"].type == FieldDescriptor.TYPE_STRING:
                    yield f"{path}{{}}"
            elif not child.full_name.startswith("google.protobuf."):
                yield from string_paths(child, f"{path}.")


def with_nul(request: Message, path: str) -> Message:
    """A copy of `request` with NUL in the string field at `path` (a repeated field: one more item)."""
    copy = type(request)()
    copy.CopyFrom(request)
    *parents, last = path.split(".")
    target = copy
    for name in parents:
        target = getattr(target, name)
        if not hasattr(target, "DESCRIPTOR"):  # a repeated message field: its first item
            target = target[0] if len(target) else target.add()
    if last.endswith("{}"):
        entries = getattr(target, last[:-2])
        value = next(iter(entries.values()), None)
        if value is None:
            entries[NUL]  # reading a key of a message map inserts it
        else:
            entries[NUL].CopyFrom(value)
        return copy
    field = target.DESCRIPTOR.fields_by_name[last]
    if field.is_repeated:
        getattr(target, last).append(NUL)
    else:
        setattr(target, last, NUL)
    return copy


@dataclass
class Known:
    """What the valid requests refer to."""

    job: jobs_pb2.Job
    limit: limits_pb2.Limit
    user: users_pb2.User


def _mask(path: str) -> list[str]:
    """An update mask covering the field at `path` (below the resource)."""
    parts = path.split(".")
    return [parts[1].removesuffix("{}")] if len(parts) > 1 else []


def valid_requests(known: Known) -> dict[str, Callable[[str], Message]]:
    """Per method, a valid request (given the path about to get a NUL) where an empty one is not."""
    job, limit, user = known.job, known.limit, known.user
    job_filter = jobs_pb2.JobFilter(name_contains="job", handler="test.echo", queue="default")
    run_filter = executions_pb2.ExecutionFilter(
        job_id=job.id, job_name="job", handler="test.echo", queue="default", error_contains="boom"
    )
    limit_ref = limits_pb2.LimitRef(limit=limit.name, key="payload.customer")
    new_limit = limits_pb2.Limit(
        name=f"nul-{uuid.uuid4().hex[:8]}",
        kind=limits_pb2.LIMIT_KIND_CONCURRENCY,
        limit=3,
        overrides={"acme": limits_pb2.LimitOverride(limit=1)},
    )
    new_user = users_pb2.User(username=f"nul-{uuid.uuid4().hex[:8]}", role=auth_pb2.ROLE_VIEWER)
    return {
        "Login": lambda _: auth_pb2.LoginRequest(username="admin", password="wrong-password"),
        "CreateApiKey": lambda _: auth_pb2.CreateApiKeyRequest(display_name="ci", role=auth_pb2.ROLE_VIEWER),
        "RevokeApiKey": lambda _: auth_pb2.RevokeApiKeyRequest(id=str(uuid.uuid4())),
        "CreateJob": lambda _: jobs_pb2.CreateJobRequest(
            job=echo_job(
                f"nul-{uuid.uuid4().hex[:8]}",
                queue="default",
                schedule=jobs_pb2.Schedule(cron="*/5 * * * *", time_zone="UTC"),
                depends_on=[job.id],
                limits=[limit_ref],
            ),
            request_id=uuid.uuid4().hex,
        ),
        "UpdateJob": lambda path: jobs_pb2.UpdateJobRequest(
            job=jobs_pb2.Job(
                id=job.id,
                name="renamed",
                handler="test.echo",
                queue="default",
                schedule=jobs_pb2.Schedule(cron="*/5 * * * *", time_zone="UTC"),
                limits=[limit_ref],
            ),
            update_mask=field_mask_pb2.FieldMask(paths=_mask(path)),
        ),
        "TriggerJob": lambda _: jobs_pb2.TriggerJobRequest(id=job.id, request_id=uuid.uuid4().hex),
        "BatchTriggerJobs": lambda _: jobs_pb2.BatchTriggerJobsRequest(
            requests=[jobs_pb2.TriggerJobRequest(id=job.id, request_id=uuid.uuid4().hex)]
        ),
        "PreviewSchedule": lambda _: jobs_pb2.PreviewScheduleRequest(
            schedule=jobs_pb2.Schedule(cron="*/5 * * * *", time_zone="UTC"), count=3
        ),
        "BatchPauseJobs": lambda _: jobs_pb2.BatchPauseJobsRequest(filter=job_filter),
        "BatchResumeJobs": lambda _: jobs_pb2.BatchResumeJobsRequest(filter=job_filter),
        "BatchDeleteJobs": lambda _: jobs_pb2.BatchDeleteJobsRequest(filter=job_filter, validate_only=True),
        "ListExecutions": lambda _: executions_pb2.ListExecutionsRequest(job_id=job.id),
        "BatchCancelExecutions": lambda _: executions_pb2.BatchCancelExecutionsRequest(filter=run_filter),
        "BatchRetryExecutions": lambda _: executions_pb2.BatchRetryExecutionsRequest(filter=run_filter),
        "GetQueueStats": lambda _: queue_pb2.GetQueueStatsRequest(queue="default"),
        "ListDeadLetters": lambda _: queue_pb2.ListDeadLettersRequest(queue="default"),
        "RequeueDeadLetters": lambda _: queue_pb2.RequeueDeadLettersRequest(queue="default"),
        "PurgeDeadLetters": lambda _: queue_pb2.PurgeDeadLettersRequest(queue="default"),
        "CreateUser": lambda _: users_pb2.CreateUserRequest(
            user=new_user, password="a-long-password", request_id=uuid.uuid4().hex
        ),
        "UpdateUser": lambda path: users_pb2.UpdateUserRequest(
            user=users_pb2.User(id=user.id, username="renamed-user", role=auth_pb2.ROLE_VIEWER),
            update_mask=field_mask_pb2.FieldMask(paths=_mask(path)),
        ),
        "ResetUserPassword": lambda _: users_pb2.ResetUserPasswordRequest(id=user.id, new_password="another-password"),
        "CreateLimit": lambda _: limits_pb2.CreateLimitRequest(limit=new_limit, request_id=uuid.uuid4().hex),
        "UpdateLimit": lambda path: limits_pb2.UpdateLimitRequest(
            limit=limits_pb2.Limit(
                id=limit.id,
                name=limit.name,
                kind=limits_pb2.LIMIT_KIND_CONCURRENCY,
                limit=4,
                overrides={"acme": limits_pb2.LimitOverride(limit=1)},
            ),
            update_mask=field_mask_pb2.FieldMask(paths=_mask(path)),
        ),
        "SetLimitOverride": lambda _: limits_pb2.SetLimitOverrideRequest(
            id=limit.id, key="acme", override=limits_pb2.LimitOverride(limit=1)
        ),
        "GetLimitKey": lambda _: limits_pb2.GetLimitKeyRequest(limit=limit.name, key="acme", queue="default"),
        "PauseLimitKey": lambda _: limits_pb2.PauseLimitKeyRequest(
            limit=limit.name, key="acme", queue="default", duration=duration_pb2.Duration(seconds=60)
        ),
        "ResumeLimitKey": lambda _: limits_pb2.ResumeLimitKeyRequest(limit=limit.name, key="acme", queue="default"),
    }


async def _call(api: Harness, method: MethodDescriptor, request: Message) -> tuple[grpc.StatusCode, str]:  # noqa: F811
    path = f"/{method.containing_service.full_name}/{method.name}"
    response_class = GetMessageClass(method.output_type)
    if method.server_streaming:
        stream = api.channel.unary_stream(path, request_serializer=type(request).SerializeToString)
        call = stream(request, metadata=api.admin, timeout=5)
        try:
            await call.initial_metadata()
            return await call.code(), await call.details() or ""
        finally:
            call.cancel()
    unary = api.channel.unary_unary(
        path, request_serializer=type(request).SerializeToString, response_deserializer=response_class.FromString
    )
    try:
        await unary(request, metadata=api.admin, timeout=20)
    except grpc.aio.AioRpcError as error:
        return error.code(), error.details() or ""
    return grpc.StatusCode.OK, ""


async def _counts(api: Harness) -> tuple[int, ...]:  # noqa: F811
    row = await api.server.api.control._pool.fetchrow(
        """SELECT (SELECT count(*) FROM jobs), (SELECT count(*) FROM job_executions),
                  (SELECT count(*) FROM api_keys), (SELECT count(*) FROM users),
                  (SELECT count(*) FROM limits)"""
    )
    assert row is not None
    return tuple(row)


async def _known(api: Harness) -> Known:  # noqa: F811
    limit = (
        await api.channel.unary_unary(
            "/scheduler.v1.LimitService/CreateLimit",
            request_serializer=limits_pb2.CreateLimitRequest.SerializeToString,
            response_deserializer=limits_pb2.CreateLimitResponse.FromString,
        )(
            limits_pb2.CreateLimitRequest(
                limit=limits_pb2.Limit(name="per-customer", kind=limits_pb2.LIMIT_KIND_CONCURRENCY, limit=2)
            ),
            metadata=api.admin,
        )
    ).limit
    job = (await api.jobs.CreateJob(jobs_pb2.CreateJobRequest(job=echo_job("known-job")), metadata=api.admin)).job
    user = (
        await api.channel.unary_unary(
            "/scheduler.v1.UserService/CreateUser",
            request_serializer=users_pb2.CreateUserRequest.SerializeToString,
            response_deserializer=users_pb2.CreateUserResponse.FromString,
        )(
            users_pb2.CreateUserRequest(
                user=users_pb2.User(username="known-user", role=auth_pb2.ROLE_VIEWER), password="a-long-password"
            ),
            metadata=api.admin,
        )
    ).user
    return Known(job, limit, user)


def test_every_request_field_is_swept() -> None:
    """The sweep reaches the fields the fuzz test once failed on (and there are plenty)."""
    paths = {(m.name, p) for m in METHODS for p in string_paths(m.input_type)}
    assert {("BatchPauseJobs", "filter.handler"), ("BatchPauseJobs", "filter.name_contains")} <= paths
    assert ("CreateLimit", "limit.overrides{}") in paths
    assert len(paths) > 100


async def test_a_nul_in_any_string_field_is_invalid_argument_naming_it(api: Harness) -> None:  # noqa: F811
    known = await _known(api)
    valid = valid_requests(known)
    wrong: list[str] = []
    for method in METHODS:
        cls = GetMessageClass(method.input_type)
        for path in string_paths(method.input_type):
            base = valid[method.name](path) if method.name in valid else cls()
            # The request without the NUL is fine as far as the field goes (or the check is moot).
            request = with_nul(base, path)
            before = await _counts(api)
            code, details = await _call(api, method, request)
            # `job.limits[0].key`, `job.depends_on[1]`, `limit.overrides` (a key) name the path.
            named = re.sub(r"\[[^]]*\]", "", details.split(": ", 1)[0]) == path.removesuffix("{}")
            if code is not grpc.StatusCode.INVALID_ARGUMENT or not named:
                wrong.append(f"{method.name} {path}: {code.name}: {details}")
            elif await _counts(api) != before:
                wrong.append(f"{method.name} {path}: refused but stored something")
    assert not wrong, "\n".join(wrong)
