"""LimitService over gRPC (issue 22): limits defined and validated end to end (CRUD, paging, etags,
overrides, roles), and jobs' limit refs checked, stored and read back. Enforcement is the queue's
and is not tested here."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

import asyncpg
import grpc
import pytest
from google.protobuf import duration_pb2, field_mask_pb2
from scheduler_client.v1 import jobs_pb2, limits_pb2, limits_pb2_grpc

from scheduler_grpc import auth
from scheduler_grpc.auth import METHOD_ROLES
from scheduler_grpc.db.jobs import JobRepository
from scheduler_grpc.db.jobs import _check_limits as check_job_limits
from scheduler_grpc.db.limits import LimitRepository
from scheduler_grpc.errors import FailedPrecondition, InvalidArgument
from scheduler_grpc.jobs import JobSpec
from scheduler_grpc.limits import LimitKind, LimitRef, LimitSpec, refs_to_json
from tests.engine_helpers import eventually
from tests.test_api_auth import call, full_name, methods
from tests.test_api_support import Harness, api, echo_job  # noqa: F401 - `api` is a fixture
from tests.test_api_users import status_of

CONCURRENCY = limits_pb2.LIMIT_KIND_CONCURRENCY
RATE = limits_pb2.LIMIT_KIND_RATE


def stub(harness: Harness) -> limits_pb2_grpc.LimitServiceStub:
    return limits_pb2_grpc.LimitServiceStub(harness.channel)


def seconds(value: int, nanos: int = 0) -> duration_pb2.Duration:
    return duration_pb2.Duration(seconds=value, nanos=nanos)


async def create(
    harness: Harness, name: str, kind: int = CONCURRENCY, limit: int = 2, **fields: Any
) -> limits_pb2.Limit:
    request = limits_pb2.CreateLimitRequest(limit=limits_pb2.Limit(name=name, kind=kind, limit=limit, **fields))
    return (await stub(harness).CreateLimit(request, metadata=harness.admin)).limit


async def refused(harness: Harness, call_: Any) -> tuple[grpc.StatusCode, str]:
    """The code and the field named first in the message ("field: what is wrong")."""
    code, message = await status_of(call_)
    return code, message.split(": ", 1)[0]


def ref(limit: str, key: str, units: int | None = None) -> limits_pb2.LimitRef:
    return limits_pb2.LimitRef(limit=limit, key=key, units=units)


async def test_the_roles_viewers_read_admins_define(api: Harness) -> None:  # noqa: F811
    limit_methods = list(methods(limits_pb2))
    assert {m.name for m in limit_methods} == {
        "CreateLimit", "GetLimit", "ListLimits", "UpdateLimit", "DeleteLimit", "SetLimitOverride",
        "GetLimitKey", "PauseLimitKey", "ResumeLimitKey",
    }  # fmt: skip
    readers = {"GetLimit", "ListLimits", "GetLimitKey"}
    operators = {"PauseLimitKey", "ResumeLimitKey"}  # tested in test_api_limit_keys.py
    limit_methods = [method for method in limit_methods if method.name not in operators]
    for method in limit_methods:
        wanted = auth.Role.VIEWER if method.name in readers else auth.Role.ADMIN
        assert METHOD_ROLES[full_name(method)] is wanted, method.name
        if method.name not in readers:
            for metadata in (api.viewer, api.operator):
                assert await call(api, method, metadata) == grpc.StatusCode.PERMISSION_DENIED, method.name
        assert await call(api, method) == grpc.StatusCode.UNAUTHENTICATED, method.name
    created = await create(api, "shared")
    got = await stub(api).GetLimit(limits_pb2.GetLimitRequest(id=created.id), metadata=api.viewer)
    assert got.limit == created
    listed = await stub(api).ListLimits(limits_pb2.ListLimitsRequest(), metadata=api.viewer)
    assert [limit.name for limit in listed.limits] == ["shared"]
    code, _ = await status_of(
        stub(api).CreateLimit(
            limits_pb2.CreateLimitRequest(limit=limits_pb2.Limit(name="v", kind=CONCURRENCY, limit=1)),
            metadata=api.viewer,
        )
    )
    assert code == grpc.StatusCode.PERMISSION_DENIED


async def test_create_get_list_update_override_and_delete(api: Harness) -> None:  # noqa: F811
    limits = stub(api)
    request = limits_pb2.CreateLimitRequest(
        limit=limits_pb2.Limit(name="billing-api", kind=RATE, limit=100, period=seconds(1), burst=10),
        request_id="r-1",
    )
    rate = (await limits.CreateLimit(request, metadata=api.admin)).limit
    assert (rate.name, rate.kind, rate.limit, rate.period.seconds, rate.burst) == ("billing-api", RATE, 100, 1, 10)
    assert rate.id
    assert rate.etag
    assert rate.HasField("create_time")
    # The same request_id: the same limit, nothing created twice; the same name otherwise: taken.
    assert (await limits.CreateLimit(request, metadata=api.admin)).limit.id == rate.id
    code, _ = await status_of(create(api, "billing-api"))
    assert code == grpc.StatusCode.ALREADY_EXISTS
    cap = await create(api, "per-customer", overrides={"acme": limits_pb2.LimitOverride(limit=5)})
    assert not cap.HasField("period")
    assert dict(cap.overrides) == {"acme": limits_pb2.LimitOverride(limit=5)}
    # Read by id and by name.
    assert (await limits.GetLimit(limits_pb2.GetLimitRequest(id=cap.id), metadata=api.admin)).limit == cap
    assert (await limits.GetLimit(limits_pb2.GetLimitRequest(name="per-customer"), metadata=api.admin)).limit == cap
    for name in ("nope", "x" * 300):
        code, _ = await status_of(limits.GetLimit(limits_pb2.GetLimitRequest(name=name), metadata=api.admin))
        assert code == grpc.StatusCode.NOT_FOUND, name
    # A NUL character is refused in every string field of every request (tests/test_api_nul.py).
    code, message = await status_of(limits.GetLimit(limits_pb2.GetLimitRequest(name="a\x00b"), metadata=api.admin))
    assert (code, message.split(":")[0]) == (grpc.StatusCode.INVALID_ARGUMENT, "name")

    # Update: the fields in the mask; the etag it was read with is stale afterwards.
    update = limits_pb2.UpdateLimitRequest(
        limit=limits_pb2.Limit(id=rate.id, limit=50, burst=0),
        update_mask=field_mask_pb2.FieldMask(paths=["limit", "burst"]),
        etag=rate.etag,
    )
    updated = (await limits.UpdateLimit(update, metadata=api.admin)).limit
    assert (updated.limit, updated.burst, updated.period.seconds, updated.kind) == (50, 0, 1, RATE)
    assert updated.etag != rate.etag
    code, message = await status_of(limits.UpdateLimit(update, metadata=api.admin))
    assert (code, message.split(":")[0]) == (grpc.StatusCode.ABORTED, "etag")
    # Rate to concurrency: the period goes with it (in the mask, unset).
    to_cap = limits_pb2.UpdateLimitRequest(
        limit=limits_pb2.Limit(id=rate.id, kind=CONCURRENCY, limit=3),
        update_mask=field_mask_pb2.FieldMask(paths=["kind", "limit", "period"]),
    )
    changed = (await limits.UpdateLimit(to_cap, metadata=api.admin)).limit
    assert (changed.kind, changed.limit, changed.HasField("period")) == (CONCURRENCY, 3, False)

    # Overrides, one key at a time.
    set_override = limits_pb2.SetLimitOverrideRequest(
        id=cap.id, key="globex", override=limits_pb2.LimitOverride(limit=7), etag=cap.etag
    )
    with_globex = (await limits.SetLimitOverride(set_override, metadata=api.admin)).limit
    assert dict(with_globex.overrides) == {
        "acme": limits_pb2.LimitOverride(limit=5),
        "globex": limits_pb2.LimitOverride(limit=7),
    }
    code, _ = await status_of(limits.SetLimitOverride(set_override, metadata=api.admin))
    assert code == grpc.StatusCode.ABORTED  # its etag is stale now
    cleared = (
        await limits.SetLimitOverride(limits_pb2.SetLimitOverrideRequest(id=cap.id, key="acme"), metadata=api.admin)
    ).limit
    assert dict(cleared.overrides) == {"globex": limits_pb2.LimitOverride(limit=7)}

    await limits.DeleteLimit(limits_pb2.DeleteLimitRequest(id=cap.id, etag=cleared.etag), metadata=api.admin)
    code, _ = await status_of(limits.GetLimit(limits_pb2.GetLimitRequest(id=cap.id), metadata=api.admin))
    assert code == grpc.StatusCode.NOT_FOUND
    code, _ = await status_of(limits.DeleteLimit(limits_pb2.DeleteLimitRequest(id=cap.id), metadata=api.admin))
    assert code == grpc.StatusCode.NOT_FOUND


async def test_paging_by_name(api: Harness) -> None:  # noqa: F811
    names = [f"limit-{index:02}" for index in range(7)]
    await asyncio.gather(*(create(api, name) for name in reversed(names)))
    seen: list[str] = []
    token = ""
    pages = 0
    while True:
        page = await stub(api).ListLimits(
            limits_pb2.ListLimitsRequest(page_size=3, page_token=token), metadata=api.viewer
        )
        seen += [limit.name for limit in page.limits]
        pages += 1
        token = page.next_page_token
        if not token:
            break
    assert (seen, pages) == (names, 3)
    code, field = await refused(
        api, stub(api).ListLimits(limits_pb2.ListLimitsRequest(page_token="forged"), metadata=api.viewer)
    )
    assert (code, field) == (grpc.StatusCode.INVALID_ARGUMENT, "page_token")
    code, field = await refused(
        api, stub(api).ListLimits(limits_pb2.ListLimitsRequest(page_size=-1), metadata=api.viewer)
    )
    assert (code, field) == (grpc.StatusCode.INVALID_ARGUMENT, "page_size")


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"name": "cap", "kind": CONCURRENCY, "limit": 0}, "limit.limit"),
        ({"name": "cap", "kind": CONCURRENCY, "limit": -1}, "limit.limit"),
        ({"name": "rate", "kind": RATE, "limit": 10, "period": seconds(-1)}, "limit.period"),
        ({"name": "rate", "kind": RATE, "limit": 10, "period": seconds(0)}, "limit.period"),
        ({"name": "rate", "kind": RATE, "limit": 10}, "limit.period"),
        ({"name": "rate", "kind": RATE, "limit": 10, "period": seconds(1), "burst": -1}, "limit.burst"),
        ({"name": "cap", "kind": CONCURRENCY, "limit": 1, "period": seconds(1)}, "limit.period"),
        ({"name": "cap", "kind": CONCURRENCY, "limit": 1, "burst": 3}, "limit.burst"),
        ({"name": "bad name", "kind": CONCURRENCY, "limit": 1}, "limit.name"),
        ({"name": "", "kind": CONCURRENCY, "limit": 1}, "limit.name"),
        ({"name": "cap", "limit": 1}, "limit.kind"),
        ({"name": "cap", "kind": 9, "limit": 1}, "limit.kind"),
        ({"name": "rate", "kind": RATE, "limit": 1, "period": seconds(1, -5)}, "limit.period"),
        (
            {"name": "cap", "kind": CONCURRENCY, "limit": 1, "overrides": {"acme": limits_pb2.LimitOverride(limit=0)}},
            "limit.overrides['acme'].limit",
        ),
        (
            {"name": "cap", "kind": CONCURRENCY, "limit": 1, "overrides": {"": limits_pb2.LimitOverride(limit=1)}},
            "limit.overrides['']",
        ),
    ],
)
async def test_every_bad_definition_is_invalid_argument_naming_the_field(
    api: Harness,  # noqa: F811
    fields: dict[str, Any],
    field: str,
) -> None:
    request = limits_pb2.CreateLimitRequest(limit=limits_pb2.Limit(**fields))
    assert await refused(api, stub(api).CreateLimit(request, metadata=api.admin)) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        field,
    )
    assert (await stub(api).ListLimits(limits_pb2.ListLimitsRequest(), metadata=api.admin)).limits == []


async def test_bad_updates_and_overrides_name_their_field(api: Harness) -> None:  # noqa: F811
    cap = await create(api, "cap")
    limits = stub(api)

    def update(paths: list[str], **fields: Any) -> Any:
        return limits.UpdateLimit(
            limits_pb2.UpdateLimitRequest(
                limit=limits_pb2.Limit(id=cap.id, **fields), update_mask=field_mask_pb2.FieldMask(paths=paths)
            ),
            metadata=api.admin,
        )

    assert await refused(api, update(["name"], name="other")) == (grpc.StatusCode.INVALID_ARGUMENT, "update_mask")
    assert await refused(api, update(["etag"])) == (grpc.StatusCode.INVALID_ARGUMENT, "update_mask")
    assert await refused(api, update(["nope"])) == (grpc.StatusCode.INVALID_ARGUMENT, "update_mask")
    assert await refused(api, update(["limit"], limit=0)) == (grpc.StatusCode.INVALID_ARGUMENT, "limit.limit")
    assert await refused(api, update(["kind"], kind=RATE)) == (grpc.StatusCode.INVALID_ARGUMENT, "limit.period")
    assert (await refused(api, update(["limit"], limit=1)))[0] == grpc.StatusCode.OK

    def override(key: str, limit: int, burst: int = 0) -> Any:
        request = limits_pb2.SetLimitOverrideRequest(
            id=cap.id, key=key, override=limits_pb2.LimitOverride(limit=limit, burst=burst)
        )
        return limits.SetLimitOverride(request, metadata=api.admin)

    assert await refused(api, override("acme", 0)) == (grpc.StatusCode.INVALID_ARGUMENT, "override.limit")
    assert await refused(api, override("acme", 1, 2)) == (grpc.StatusCode.INVALID_ARGUMENT, "override.burst")
    assert await refused(api, override("", 1)) == (grpc.StatusCode.INVALID_ARGUMENT, "key")
    assert await refused(api, override("k" * 201, 1)) == (grpc.StatusCode.INVALID_ARGUMENT, "key")
    got = (await limits.GetLimit(limits_pb2.GetLimitRequest(id=cap.id), metadata=api.admin)).limit
    assert dict(got.overrides) == {}
    assert got.etag != cap.etag  # the one good update above


async def test_jobs_store_their_limit_refs_and_read_them_back(api: Harness) -> None:  # noqa: F811
    await create(api, "per-customer", limit=2)
    await create(api, "billing-api", kind=RATE, limit=10, period=seconds(1), burst=2)
    refs = [ref("per-customer", "payload.customer_id"), ref("billing-api", "billing", 3)]
    job = (await api.jobs.CreateJob(jobs_pb2.CreateJobRequest(job=echo_job("j", limits=refs)), metadata=api.admin)).job
    assert list(job.limits) == [ref("per-customer", "payload.customer_id", 1), ref("billing-api", "billing", 3)]
    got = (await api.jobs.GetJob(jobs_pb2.GetJobRequest(id=job.id), metadata=api.viewer)).job
    assert list(got.limits) == list(job.limits)
    for view in (jobs_pb2.JOB_VIEW_FULL, jobs_pb2.JOB_VIEW_BASIC):
        listed = await api.jobs.ListJobs(jobs_pb2.ListJobsRequest(view=view), metadata=api.viewer)
        assert [list(j.limits) for j in listed.jobs] == [list(job.limits)]
    # An update that leaves `limits` out of its mask keeps them; one that names it replaces them.
    renamed = (
        await api.jobs.UpdateJob(
            jobs_pb2.UpdateJobRequest(
                job=jobs_pb2.Job(id=job.id, name="j2"), update_mask=field_mask_pb2.FieldMask(paths=["name"])
            ),
            metadata=api.admin,
        )
    ).job
    assert list(renamed.limits) == list(job.limits)
    cleared = (
        await api.jobs.UpdateJob(
            jobs_pb2.UpdateJobRequest(
                job=jobs_pb2.Job(id=job.id), update_mask=field_mask_pb2.FieldMask(paths=["limits"])
            ),
            metadata=api.admin,
        )
    ).job
    assert list(cleared.limits) == []


@pytest.mark.parametrize(
    ("refs", "field"),
    [
        ([ref("nope", "k")], "job.limits[0].limit"),
        ([ref("cap", "k"), ref("nope", "k")], "job.limits[1].limit"),
        ([ref("cap", "k"), ref("cap", "other")], "job.limits[1].limit"),
        ([ref("cap", "k", 0)], "job.limits[0].units"),
        ([ref("cap", "k", -2)], "job.limits[0].units"),
        ([ref("cap", "k", 3)], "job.limits[0].units"),  # more than the limit admits at once
        ([ref("cap", "")], "job.limits[0].key"),
        ([ref("cap", "payload.")], "job.limits[0].key"),
        ([ref("bad name", "k")], "job.limits[0].limit"),
        ([ref(f"l{index}", "k") for index in range(5)], "job.limits"),
    ],
)
async def test_bad_limit_refs_on_a_job_are_invalid_argument_naming_the_field(
    api: Harness,  # noqa: F811
    refs: list[limits_pb2.LimitRef],
    field: str,
) -> None:
    await create(api, "cap", limit=2)
    job = echo_job("j", limits=refs)
    assert await refused(api, api.jobs.CreateJob(jobs_pb2.CreateJobRequest(job=job), metadata=api.admin)) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        field,
    )
    assert (await api.jobs.ListJobs(jobs_pb2.ListJobsRequest(), metadata=api.admin)).jobs == []
    # The same refs through an update of an existing job: refused the same way, nothing changed.
    plain = (await api.jobs.CreateJob(jobs_pb2.CreateJobRequest(job=echo_job("plain")), metadata=api.admin)).job
    update = jobs_pb2.UpdateJobRequest(
        job=jobs_pb2.Job(id=plain.id, limits=refs), update_mask=field_mask_pb2.FieldMask(paths=["limits"])
    )
    assert await refused(api, api.jobs.UpdateJob(update, metadata=api.admin)) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        field,
    )
    assert (await api.jobs.GetJob(jobs_pb2.GetJobRequest(id=plain.id), metadata=api.admin)).job == plain


async def test_a_limit_jobs_use_cannot_be_deleted(api: Harness) -> None:  # noqa: F811
    cap = await create(api, "cap")
    other = await create(api, "other")
    for name in ("zeta", "alpha"):
        job = echo_job(name, limits=[ref("other", "k"), ref("cap", "payload.customer")])
        await api.jobs.CreateJob(jobs_pb2.CreateJobRequest(job=job), metadata=api.admin)
    code, message = await status_of(stub(api).DeleteLimit(limits_pb2.DeleteLimitRequest(id=cap.id), metadata=api.admin))
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert "alpha, zeta" in message
    assert "'cap'" in message
    # Once no job names it, it goes.
    jobs = (await api.jobs.ListJobs(jobs_pb2.ListJobsRequest(), metadata=api.admin)).jobs
    for job in jobs:
        await api.jobs.UpdateJob(
            jobs_pb2.UpdateJobRequest(
                job=jobs_pb2.Job(id=job.id, limits=[ref("other", "k")]),
                update_mask=field_mask_pb2.FieldMask(paths=["limits"]),
            ),
            metadata=api.admin,
        )
    await stub(api).DeleteLimit(limits_pb2.DeleteLimitRequest(id=cap.id), metadata=api.admin)
    code, _ = await status_of(stub(api).DeleteLimit(limits_pb2.DeleteLimitRequest(id=other.id), metadata=api.admin))
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    # Deleting the jobs frees the limit.
    for job in jobs:
        await api.jobs.DeleteJob(jobs_pb2.DeleteJobRequest(id=job.id), metadata=api.admin)
    await stub(api).DeleteLimit(limits_pb2.DeleteLimitRequest(id=other.id), metadata=api.admin)


async def test_a_delete_waits_for_a_job_write_naming_the_limit_and_then_refuses(pool: asyncpg.Pool) -> None:
    """A job's write holds the limits it names FOR SHARE until it commits: a delete of one of them
    meanwhile waits, then sees the job and is refused, so no job is left naming a limit that is gone.
    (Without the lock the delete would not wait: `eventually` below fails.)"""
    limits = LimitRepository(pool)
    cap = await limits.create(LimitSpec("cap", LimitKind.CONCURRENCY, 2))
    spec = JobSpec("j", "test.echo", limits=(LimitRef("cap", "k"),))

    async def delete_waits() -> bool:
        return bool(
            await pool.fetchval(
                """SELECT count(*) FROM pg_stat_activity
                   WHERE wait_event_type = 'Lock' AND query LIKE '%FROM limits WHERE id = $1 FOR UPDATE%'"""
            )
        )

    async with pool.acquire() as conn:
        transaction = conn.transaction()
        await transaction.start()
        try:
            await check_job_limits(conn, spec)  # what JobRepository.create/update do first
            delete = asyncio.create_task(limits.delete(cap.id))
            await eventually(delete_waits, within=5)
            await conn.execute(
                "INSERT INTO jobs (name, handler, schedule_kind, limits) VALUES ('j', 'test.echo', 'manual', $1)",
                refs_to_json(spec.limits),
            )
        finally:
            await transaction.commit()
    with pytest.raises(FailedPrecondition, match=r"jobs use limit 'cap' \(j\)"):
        await delete
    # The other order: the delete first, then a job naming the limit finds none.
    free = await limits.create(LimitSpec("free", LimitKind.CONCURRENCY, 2))
    await limits.delete(free.id)
    with pytest.raises(InvalidArgument, match="no limit named 'free'") as raised:
        await JobRepository(pool).create(JobSpec("k", "test.echo", limits=(LimitRef("free", "k"),)), None)
    assert raised.value.field == "limits[0].limit"


@pytest.mark.parametrize(
    ("columns", "values"),
    [
        ('name, kind, "limit"', ("cap", "concurrency", 0)),
        ('name, kind, "limit"', ("bad name", "concurrency", 1)),
        ('name, kind, "limit"', ("cap", "window", 1)),
        ('name, kind, "limit"', ("rate", "rate", 1)),  # a rate without a period
        ('name, kind, "limit", period', ("cap", "concurrency", 1, timedelta(seconds=1))),
        ('name, kind, "limit", period', ("rate", "rate", 1, timedelta(seconds=-1))),
        ('name, kind, "limit", burst', ("cap", "concurrency", 1, 2)),
        ('name, kind, "limit", overrides', ("cap", "concurrency", 1, {"a": {"limit": 0}})),
        ('name, kind, "limit", overrides', ("cap", "concurrency", 1, {"a": {"limit": 1, "burst": 1}})),
        ('name, kind, "limit", overrides', ("cap", "concurrency", 1, {"a": {"limit": "x"}})),
        ('name, kind, "limit", overrides', ("cap", "concurrency", 1, {"a": {"limit": 1.5}})),
        ('name, kind, "limit", overrides', ("cap", "concurrency", 1, {"a": 3})),
        ('name, kind, "limit", overrides', ("cap", "concurrency", 1, [])),
        ('name, kind, "limit", overrides', ("cap", "concurrency", 1, {str(i): {"limit": 1} for i in range(1001)})),
    ],
)
async def test_the_schema_refuses_what_validation_refuses(
    pool: asyncpg.Pool, columns: str, values: tuple[Any, ...]
) -> None:
    """Migration 0012's CHECKs repeat `limits.validate_limit` (a write that skipped it is refused)."""
    placeholders = ", ".join(f"${index}" for index in range(1, len(values) + 1))
    with pytest.raises(asyncpg.CheckViolationError):
        await pool.execute(f"INSERT INTO limits ({columns}) VALUES ({placeholders})", *values)


async def test_the_schema_takes_what_validation_takes(pool: asyncpg.Pool) -> None:
    overrides = {"acme": {"limit": 5, "burst": 2}, "globex": {"limit": 1}}
    await pool.execute(
        """INSERT INTO limits (name, kind, "limit", period, burst, overrides)
           VALUES ('rate', 'rate', 100, interval '1 second', 10, $1)""",
        overrides,
    )
    insert = "INSERT INTO jobs (name, handler, schedule_kind, limits) VALUES ($1, 'test.echo', 'manual', $2)"
    await pool.execute(insert, "four", [{"limit": "rate", "key": "k", "units": 1}] * 4)
    for name, refs in (("object", {}), ("five", [{"limit": "rate", "key": "k", "units": 1}] * 5)):
        with pytest.raises(asyncpg.CheckViolationError):
            await pool.execute(insert, name, refs)
