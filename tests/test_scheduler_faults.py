"""The scheduler role under store faults: outages, a deposed leader, lost Redis state, big catch-ups.

Real processes where a process can show it (an outage cut with a TCP proxy in front of the store),
in-process leader loops against the real stores where the fault must be forced (a stale term).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import asyncpg
import pytest
import redis.asyncio as aioredis

from scheduler_grpc.control import Control
from scheduler_grpc.jobs import JobSpec, ScheduleKind
from tests.engine_helpers import Role, Roles, eventually, wait_until_ready
from tests.fault_proxy import FaultProxy


def every_second(name: str, **fields: object) -> JobSpec:
    return JobSpec(name=name, handler="test.echo", schedule_kind=ScheduleKind.CRON, cron="* * * * * *", **fields)  # type: ignore[arg-type]


async def _elapsed(since: float, seconds: float) -> bool:
    return time.monotonic() - since >= seconds


@pytest.fixture
async def pg_proxy(database_url: str) -> AsyncIterator[FaultProxy]:
    proxy = FaultProxy.for_url(database_url)
    await proxy.start()
    try:
        yield proxy
    finally:
        await proxy.close()


@pytest.fixture
async def redis_proxy(redis_url: str) -> AsyncIterator[FaultProxy]:
    proxy = FaultProxy.for_url(redis_url)
    await proxy.start()
    try:
        yield proxy
    finally:
        await proxy.close()


def _lines(role: Role, text: str) -> list[str]:
    return [line for line in role.log_lines() if text in line]


async def _fires_after(pool: asyncpg.Pool, job_id: str, since: object) -> bool:
    count = await pool.fetchval(
        "SELECT count(*) FROM job_executions WHERE job_id = $1 AND created_at > $2", job_id, since
    )
    return int(count) >= 2


async def _outage(proxy: FaultProxy, scheduler: Role, seconds: float) -> None:
    """Cut the link for `seconds`, checking the scheduler saw it and stays alive throughout."""
    warnings_before = len(_lines(scheduler, '"level":"WARNING"'))
    proxy.cut()
    cut_at = time.monotonic()

    async def noticed() -> bool:
        warnings = len(_lines(scheduler, '"level":"WARNING"'))
        return warnings > warnings_before or scheduler.process.poll() is not None

    await eventually(noticed, within=10)
    await eventually(lambda: _elapsed(cut_at, seconds), within=seconds + 5)
    assert scheduler.process.poll() is None, f"the scheduler exited ({scheduler.process.poll()}) during the outage"
    proxy.heal()


async def test_the_leader_survives_two_postgresql_outages_and_fires_again(  # noqa: PLR0917 - pytest fixtures
    roles: Roles, control: Control, pool: asyncpg.Pool, redis: aioredis.Redis, database_url: str,
    pg_proxy: FaultProxy,
) -> None:  # fmt: skip
    scheduler = roles.start("scheduler", DATABASE_URL=pg_proxy.url(database_url))
    await wait_until_ready(redis, workers=0)
    job = await control.create_job(every_second("tick"))
    await eventually(lambda: _fires_after(pool, job.id, job.created_at), within=15)
    for _ in range(2):
        await _outage(pg_proxy, scheduler, 3.0)
        healed = await pool.fetchval("SELECT now()")
        await eventually(lambda since=healed: _fires_after(pool, job.id, since), within=20)
    assert scheduler.process.poll() is None
    # Logged once per outage and loop, not once per retry.
    assert len(_lines(scheduler, "leader loop failing")) <= 2 * 5, "\n".join(_lines(scheduler, "failing"))
    assert _lines(scheduler, "leader loop recovered")


async def test_the_scheduler_survives_a_redis_outage_without_flooding_its_log(  # noqa: PLR0917 - pytest fixtures
    roles: Roles, control: Control, pool: asyncpg.Pool, redis: aioredis.Redis, redis_url: str,
    redis_proxy: FaultProxy,
) -> None:  # fmt: skip
    scheduler = roles.start("scheduler", REDIS_URL=redis_proxy.url(redis_url))
    await wait_until_ready(redis, workers=0)
    job = await control.create_job(every_second("tick"))
    await eventually(lambda: _fires_after(pool, job.id, job.created_at), within=15)
    lines_before = len(scheduler.log_lines())
    await _outage(redis_proxy, scheduler, 4.0)
    healed = await pool.fetchval("SELECT now()")
    await eventually(lambda: _fires_after(pool, job.id, healed), within=20)
    assert scheduler.process.poll() is None
    during = scheduler.log_lines()[lines_before:]
    # A few lines per outage (failing, stepped down, campaign failing, recovered), never one per retry.
    assert len(during) <= 25, "\n".join(during)
    assert not [line for line in during if "Traceback" in line or '"exc_info"' in line], "\n".join(during)
