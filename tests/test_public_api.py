"""The package's curated API: every exported name resolves, importing the package stays light, and
`open_control` gives an embedding program a working `Control`."""

from __future__ import annotations

import subprocess
import sys

import asyncpg
from redis.asyncio import Redis

import scheduler_grpc
from scheduler_grpc import JobSpec, ScheduleKind, load_settings, open_control
from tests.conftest import ROOT


def test_every_exported_name_resolves() -> None:
    missing = [name for name in scheduler_grpc.__all__ if getattr(scheduler_grpc, name, None) is None]
    assert not missing
    assert set(scheduler_grpc.__all__) <= set(dir(scheduler_grpc))
    assert scheduler_grpc.Control.__module__ == "scheduler_grpc.control"


def test_importing_the_package_loads_no_store_client() -> None:
    """Every `scheduler-grpc` command imports the package first: the exports load on first use."""
    probe = "import sys, scheduler_grpc; print(sorted(m for m in ('redis', 'asyncpg', 'aiohttp') if m in sys.modules))"
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True, cwd=ROOT
    )
    assert result.stdout.strip() == "[]"


async def test_open_control_creates_and_reads_a_job(
    redis_url: str, database_url: str, redis: Redis, pool: asyncpg.Pool
) -> None:
    settings = load_settings({"REDIS_URL": redis_url, "DATABASE_URL": database_url})
    async with open_control(settings) as control:
        spec = JobSpec(name="tick", handler="test.echo", schedule_kind=ScheduleKind.CRON, cron="*/5 * * * *")
        job = await control.create_job(spec)
        assert (await control.get_job(job.id)).name == "tick"
        assert job.next_run_time is not None
