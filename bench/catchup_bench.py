"""A big catch-up after an outage: how fast does the leader recover, and does it keep its lease?

    .venv/bin/python bench/catchup_bench.py [--jobs 500] [--minutes 20] [--policy run_once] [--grace 60]

Starts embedded Valkey and PostgreSQL (or uses REDIS_URL / DATABASE_URL), creates `--jobs`
per-second cron jobs with misfire policy `--policy` (run_once, skip or run_all) whose next run is
`--minutes` in the past (an outage: 60 slots a minute each; those within the misfire grace,
`--grace` seconds, run as usual), and leads in-process with the default leader TTL until every
job has caught up. Prints the catch-up time, the rows recorded (`skip` and `run_once` record a
run of misfires as one `missed` row with its count; `run_all` one row per slot, at most 250 per
job and 2000 per scan), the longest event-loop stall (a 5 ms ticker) and whether the term
survived (the same term from start to end, never stepped down).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import time
from datetime import timedelta
from pathlib import Path

import uvloop

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchlib import servers  # noqa: E402

from scheduler_grpc.connections import redis_client  # noqa: E402
from scheduler_grpc.control import Control  # noqa: E402
from scheduler_grpc.db.leadership import LeadershipRepository  # noqa: E402
from scheduler_grpc.db.migrate import migrate  # noqa: E402
from scheduler_grpc.db.pool import create_pool  # noqa: E402
from scheduler_grpc.handlers import HandlerSettings, default_registry  # noqa: E402
from scheduler_grpc.jobs import JobSpec, MisfirePolicy, ScheduleKind  # noqa: E402
from scheduler_grpc.leader import LeaderElector  # noqa: E402
from scheduler_grpc.scheduler import LeaderLoops, LoopSettings  # noqa: E402


async def main(args: argparse.Namespace, redis_url: str, database_url: str) -> None:
    pool = await create_pool(database_url, size=10, connect_timeout=timedelta(seconds=5))
    await migrate(pool)
    await pool.execute("TRUNCATE job_executions, jobs CASCADE")
    redis = redis_client(redis_url)
    await redis.flushdb()
    registry = default_registry(HandlerSettings())
    control = Control(redis, pool, registry)
    for index in range(args.jobs):
        await control.create_job(
            JobSpec(
                name=f"late-{index}",
                handler="test.echo",
                schedule_kind=ScheduleKind.CRON,
                cron="* * * * * *",
                misfire_policy=MisfirePolicy(args.policy),
            )
        )
    await pool.execute(
        "UPDATE jobs SET next_run_time = date_trunc('second', now()) - make_interval(mins => $1)", args.minutes
    )
    stalls: list[float] = []

    async def ticker() -> None:
        last = time.monotonic()
        while True:
            await asyncio.sleep(0.005)
            now = time.monotonic()
            stalls.append(now - last - 0.005)
            last = now

    elector = LeaderElector(redis, LeadershipRepository(pool), holder="catchup-bench")
    loops = LeaderLoops(redis, pool, LoopSettings(misfire_grace=timedelta(seconds=args.grace)))
    ticking = asyncio.create_task(ticker())
    campaign = asyncio.create_task(elector.run(loops.lead))
    try:
        while True:  # polled: a bench, not a test
            if (elected := elector.term) is not None:
                break
            await asyncio.sleep(0.01)
        first_term = elected.token
        began = time.monotonic()
        behind = "SELECT count(*) FROM jobs WHERE next_run_time < now() - interval '5 seconds'"
        while True:
            if not await pool.fetchval(behind):
                break
            await asyncio.sleep(0.2)
        took = time.monotonic() - began
        term = elector.term
        kept = term is not None and term.token == first_term and term.is_valid()
        rows = await pool.fetchval("SELECT count(*) FROM job_executions")
        missed = await pool.fetchrow(
            "SELECT count(*) AS ranges, sum(missed_count) AS slots FROM job_executions WHERE status = 'missed'"
        )
        assert missed is not None  # an aggregate always returns its row
        runs = await pool.fetchval("SELECT count(*) FROM job_executions WHERE status <> 'missed'")
        print(f"catch-up of {args.jobs} per-second jobs ({args.policy}) after a {args.minutes}-minute outage:")
        print(f"  caught up in {took:.1f} s; longest loop stall {max(stalls) * 1000:.0f} ms")
        print(f"  {rows} rows: {missed['ranges']} missed ranges of {missed['slots'] or 0} slots, {runs} runs")
        print(f"  leader term {'kept throughout' if kept else 'LOST'} (term {first_term} -> {term and term.token})")
    finally:
        campaign.cancel()
        ticking.cancel()
        await asyncio.gather(campaign, ticking, return_exceptions=True)
        await registry.aclose()
        await redis.aclose()
        await pool.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=500)
    parser.add_argument("--minutes", type=int, default=20)
    parser.add_argument("--grace", type=float, default=60.0, help="misfire grace in seconds (default 60)")
    parser.add_argument("--policy", choices=[policy.value for policy in MisfirePolicy], default="run_once")
    arguments = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)  # the leader's per-scan warnings (slots missed) are expected here
    with servers() as urls:
        uvloop.run(main(arguments, urls.redis_url, urls.database_url))
