"""Scheduling lateness and leader failover, measured with real processes.

    .venv/bin/python bench/scheduling_bench.py [--jobs 50] [--seconds 20] [--kills 10] [--stops 5] [--ttl 2500ms]

Starts embedded Valkey and PostgreSQL (or uses REDIS_URL / DATABASE_URL), two scheduler processes
and one worker, creates `--jobs` per-second cron jobs, and prints:

* lateness p50/p99/max of every slot: enqueue (row created - slot) and start (worker start - slot);
* graceful failover, `--stops` times: SIGTERM of the leader -> the standby holds a new term, and ->
  the next slot is fired (the first row created after the signal);
* crash failover, `--kills` times: SIGKILL of the leader -> new term, and -> next slot fired.

The leader TTL is the default of `SCHEDULER_LEADER_TTL` unless `--ttl` is given. Before each
signal the killed process's replacement is a subscribed standby again (PUBSUB NUMSUB on the
release channel), so every round measures the same thing: one leader, one ready standby.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import statistics
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import asyncpg
import uvloop
from redis.asyncio import Redis

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchlib import log_dir, role_env, servers  # noqa: E402

from scheduler_grpc.config import SETTINGS  # noqa: E402
from scheduler_grpc.connections import redis_client  # noqa: E402
from scheduler_grpc.control import Control  # noqa: E402
from scheduler_grpc.db.migrate import migrate  # noqa: E402
from scheduler_grpc.db.pool import create_pool  # noqa: E402
from scheduler_grpc.handlers import HandlerSettings, default_registry  # noqa: E402
from scheduler_grpc.jobs import JobSpec, ScheduleKind  # noqa: E402
from scheduler_grpc.keys import LeaderKeys  # noqa: E402

DEFAULT_TTL = next(setting.default for setting in SETTINGS if setting.attr == "leader_ttl")


def start(role: str, env: dict[str, str], log_dir: Path, name: str) -> subprocess.Popen[bytes]:
    log = open(log_dir / f"{name}.log", "wb")  # noqa: SIM115 - the child owns it
    return subprocess.Popen(
        [sys.executable, "-m", "scheduler_grpc", role],
        env={**env, "SCHEDULER_INSTANCE": name},
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=ROOT,
    )


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


async def leader(pool: asyncpg.Pool) -> tuple[str, int] | None:
    row = await pool.fetchrow("SELECT holder, term FROM leader_state WHERE scope = 'scheduler'")
    return (row["holder"], row["term"]) if row else None


async def wait_new_term(pool: asyncpg.Pool, old_term: int, limit: float = 30.0) -> float:
    began = time.monotonic()
    while time.monotonic() - began < limit:
        current = await leader(pool)
        if current and current[1] > old_term:
            return time.monotonic() - began
        await asyncio.sleep(0.005)
    raise SystemExit("no new leader")


async def next_slot_fired(pool: asyncpg.Pool, since_epoch: float, limit: float = 30.0) -> float:
    """Seconds from `since_epoch` (wall clock, this host) to the first scheduled row created after it."""
    began = time.monotonic()
    while time.monotonic() - began < limit:
        first = await pool.fetchval(
            """SELECT min(extract(epoch FROM created_at)) FROM job_executions
               WHERE trigger = 'schedule' AND created_at > to_timestamp($1)""",
            since_epoch,
        )
        if first is not None:
            return float(first) - since_epoch
        await asyncio.sleep(0.01)
    raise SystemExit("no slot fired after the failover")


async def standby_ready(redis: Redis, limit: float = 30.0) -> None:
    """Wait until a standby is subscribed to the leader's release channel (it campaigns).

    The leader stays subscribed while it leads, so two subscribers mean one leader and one standby.
    """
    began = time.monotonic()
    while time.monotonic() - began < limit:
        [(_, subscribers)] = await redis.pubsub_numsub(LeaderKeys("scheduler").released)
        if subscribers >= 2:
            return
        await asyncio.sleep(0.05)
    raise SystemExit("no standby")


def summary(label: str, values: list[float]) -> str:
    ms = [value * 1000 for value in values]
    return (f"  {label:<34} p50 {statistics.median(ms):6.0f} ms   p99 {percentile(ms, 0.99):6.0f} ms"
            f"   max {max(ms):6.0f} ms   (n={len(ms)})")  # fmt: skip


async def main(args: argparse.Namespace, redis_url: str, database_url: str, log_dir: Path) -> None:
    pool = await create_pool(database_url, size=4, connect_timeout=timedelta(seconds=5))
    await migrate(pool)
    await pool.execute("TRUNCATE job_executions, jobs CASCADE")
    redis = redis_client(redis_url)
    await redis.flushdb()
    env = role_env(redis_url, database_url)
    if args.ttl:
        env["SCHEDULER_LEADER_TTL"] = args.ttl
    ttl = args.ttl or DEFAULT_TTL
    processes = {name: start(role, env, log_dir, name) for name, role in
                 (("scheduler-a", "scheduler"), ("scheduler-b", "scheduler"), ("worker", "worker"))}  # fmt: skip
    registry = default_registry(HandlerSettings())
    try:
        await wait_new_term(pool, 0)
        control = Control(redis, pool, registry)
        for index in range(args.jobs):
            await control.create_job(
                JobSpec(name=f"bench-{index}", handler="test.echo", schedule_kind=ScheduleKind.CRON, cron="* * * * * *")
            )
        await asyncio.sleep(args.seconds)
        rows = await pool.fetch(
            """SELECT extract(epoch FROM created_at - scheduled_for) AS enqueue_s,
                      extract(epoch FROM started_at - scheduled_for) AS start_s
               FROM job_executions WHERE trigger = 'schedule' AND started_at IS NOT NULL"""
        )
        enqueue = [float(row["enqueue_s"]) * 1000 for row in rows]
        started = [float(row["start_s"]) * 1000 for row in rows]
        print(f"lateness over {len(rows)} slots ({args.jobs} per-second cron jobs, {args.seconds}s):")
        for label, values in (("enqueue (row created - slot)", enqueue), ("start (worker start - slot)", started)):
            print(f"  {label:<30} p50 {statistics.median(values):7.1f} ms   p99 {percentile(values, 0.99):7.1f} ms"
                  f"   max {max(values):7.1f} ms")  # fmt: skip
        await control.list_jobs()  # keep the connection warm for the failover timing
        rounds = [("graceful (SIGTERM)", signal.SIGTERM)] * args.stops
        rounds += [("crash (SIGKILL)", signal.SIGKILL)] * args.kills
        terms: dict[str, list[float]] = {}
        fired: dict[str, list[float]] = {}
        for how, signum in rounds:
            await standby_ready(redis)
            current = await leader(pool)
            assert current is not None
            holder, term = current
            name = holder.split(":")[0]
            signalled = time.time()
            processes[name].send_signal(signum)
            terms.setdefault(how, []).append(await wait_new_term(pool, term))
            fired.setdefault(how, []).append(await next_slot_fired(pool, signalled))
            processes[name].wait()
            processes[name] = start("scheduler", env, log_dir, name)
        print(f"failover (TTL {ttl}, {args.jobs} per-second jobs):")
        for how in dict.fromkeys(how for how, _ in rounds):
            print(summary(f"{how} -> new term", terms[how]))
            print(summary(f"{how} -> next slot fired", fired[how]))
    finally:
        for process in processes.values():
            process.send_signal(signal.SIGTERM)
        for process in processes.values():
            process.wait()
        await registry.aclose()
        await redis.aclose()
        await pool.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=50)
    parser.add_argument("--seconds", type=int, default=20)
    parser.add_argument("--kills", type=int, default=10, help="SIGKILLs of the leader (crash failover)")
    parser.add_argument("--stops", type=int, default=5, help="SIGTERMs of the leader (graceful failover)")
    parser.add_argument("--ttl", default="", help="SCHEDULER_LEADER_TTL (default: the setting's default)")
    arguments = parser.parse_args()
    with log_dir() as logs, servers() as urls:
        uvloop.run(main(arguments, urls.redis_url, urls.database_url, logs))
