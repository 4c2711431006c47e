"""Issue 22's figures: a rate limit's exactness, fairness to quiet keys beside a noisy one, and what
one limit costs a drain. Each mode measures its floor in the same run.

    .venv/bin/python bench/limits_bench.py rate [--runs 5000] [--rate 100] [--burst 10]
    .venv/bin/python bench/limits_bench.py noisy [--noisy-runs 100000] [--quiet 100] [--seconds 30]
    .venv/bin/python bench/limits_bench.py overhead [--runs 20000] [--rounds 5]
    ... [--set SCHEDULER_X=VALUE]   (also `bench/run.py --only limits-rate,limits-noisy,limits-overhead`)

Uses REDIS_URL / DATABASE_URL (embedded servers when unset; flushes that Redis database and
truncates the job and limit tables). Limits and jobs are defined, and runs triggered, through
`Control` (the application layer behind LimitService and JobService: `JobSpec.limits`); every figure
is read from PostgreSQL's own timestamps (`started_at` of a run leased ready is the instant the queue
leased it, the Redis clock reading its limits admitted it on, in whole milliseconds; the claim that
follows records it, so the claims' latency does not shift the starts).

* rate: a rate limit of `--rate`/s with `--burst`, one key, a backlog of `--runs` `test.echo` runs
  triggered before one worker (200 slots) starts. Most starts in any half-open 1-second window
  (issue: at most rate + burst), and the drain rate: (runs - burst - 1) / (last start - first start),
  which is exactly the rate for a GCRA that lets burst + 1 start at once and then one every
  period/rate (issue: 100/s +- 5 %). Floor: the same backlog without the limit, same worker.
* noisy: `--quiet` per-second cron jobs (`test.echo`), each its own key of a concurrency limit of 1,
  2 schedulers and 2 workers (the default topology). Their start lateness (started_at - slot) p99
  over `--seconds` alone (the floor), then again after one key got `--noisy-runs` queued runs of a
  `test.delay` job (50 ms) under the same limit (issue: p99 rises by less than 50 ms).
* overhead: `--runs` `test.echo` runs drained by one worker (200 slots), without limits and with
  one limit ref (a concurrency limit of 1,000,000 on one key, so it never blocks), alternated
  `--rounds` times each. Per kind, the median executions/s and the median CPU per execution of
  the worker, Valkey and PostgreSQL together (from the worker's first claim). Issue: drain
  throughput at most 15 % lower with the limit (capped/free executions/s >= 0.85); the CPU figures
  say where the limit's cost lands (Valkey, mostly). Medians, because one drain's throughput on a
  shared 2-core machine swings by a third between rounds (session 9: 9,000-13,300/s for the same
  drain), so a best-of-N ratio mostly measures the best round's luck.

The last line of output is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import asyncpg
import uvloop

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from benchlib import log_dir, role_env, servers  # noqa: E402
from floors import postgres_pid, tree_cpu_seconds, valkey_pid  # noqa: E402
from lateness_bench import Processes, cpu_seconds, leader_ready, percentiles, workers_ready  # noqa: E402

from scheduler_grpc.connections import redis_client  # noqa: E402
from scheduler_grpc.control import Control  # noqa: E402
from scheduler_grpc.db.migrate import migrate  # noqa: E402
from scheduler_grpc.db.pool import create_pool  # noqa: E402
from scheduler_grpc.handlers import HandlerSettings, default_registry  # noqa: E402
from scheduler_grpc.jobs import JobSpec, RetryPolicy, ScheduleKind  # noqa: E402
from scheduler_grpc.limits import LimitKind, LimitRef, LimitSpec  # noqa: E402

TRIGGER_CHUNK = 1000  # concurrent TriggerJob calls (they batch into one statement and one enqueue)
NO_RETRY = RetryPolicy(max_retries=0)


def max_in_window(instants: Sequence[float], window: float = 1.0) -> int:
    """The most instants (seconds) in any half-open window [t, t + window)."""
    ordered = sorted(instants)
    best = 0
    first = 0
    for last, instant in enumerate(ordered):
        while ordered[first] <= instant - window:
            first += 1
        best = max(best, last - first + 1)
    return best


def drain_rate(instants: Sequence[float], burst: int) -> float | None:
    """(n - burst - 1) / (last - first): the steady rate after a burst of burst + 1 at the start."""
    if len(instants) < burst + 3:
        return None
    span = max(instants) - min(instants)
    return (len(instants) - burst - 1) / span if span > 0 else None


async def trigger_many(control: Control, job_id: str, count: int) -> None:
    """`count` runs of one job, triggered `TRIGGER_CHUNK` at a time."""
    for start in range(0, count, TRIGGER_CHUNK):
        await asyncio.gather(*(control.trigger_job(job_id) for _ in range(min(TRIGGER_CHUNK, count - start))))


async def starts(pool: asyncpg.Pool, job_id: str) -> list[float]:
    """Epoch seconds of every attempt's start of a job."""
    rows = await pool.fetch(
        """SELECT extract(epoch FROM started_at)::float8 AS s FROM job_executions
           WHERE job_id = $1 AND started_at IS NOT NULL""",
        job_id,
    )
    return [row["s"] for row in rows]


async def wait_succeeded(pool: asyncpg.Pool, job_id: str, count: int, within: float) -> float:
    """Wait until `count` runs of the job succeeded; seconds it took (SystemExit past `within`)."""
    began = time.monotonic()
    while True:
        done = await pool.fetchval(
            "SELECT count(*) FROM job_executions WHERE job_id = $1 AND status = 'succeeded'", job_id
        )
        if done >= count:
            return time.monotonic() - began
        if time.monotonic() - began > within:
            raise SystemExit(f"only {done} of {count} runs of {job_id} succeeded after {within:g}s")
        await asyncio.sleep(0.25)


@dataclass
class Drained:
    """One drain: executions/s from PostgreSQL, and CPU per execution (microseconds) of the
    worker, Valkey and PostgreSQL (None where the server is not on this machine)."""

    executions_per_s: float
    worker_cpu_us: float
    valkey_cpu_us: float | None
    postgres_cpu_us: float | None

    @property
    def cpu_us(self) -> float:
        """Every process's CPU per execution: what one execution costs the deployment."""
        return self.worker_cpu_us + (self.valkey_cpu_us or 0.0) + (self.postgres_cpu_us or 0.0)


async def drain(
    pool: asyncpg.Pool,
    control: Control,
    procs: Processes,
    job_id: str,
    *,
    runs: int,
    name: str,
    within: float,
    servers_pids: tuple[int | None, int | None] = (None, None),
) -> Drained:
    """Queue `runs` runs of a job, start one worker (200 slots), wait until all succeeded, stop it;
    executions/s from PostgreSQL: runs / (last finished_at - first started_at). CPU counts from the
    worker's first claim (its start-up excluded, as in the drain row) over the runs claimed since."""
    await trigger_many(control, job_id, runs)
    vpid, ppid = servers_pids
    procs.start("worker", name)
    try:
        began = time.monotonic()
        while not (
            claimed := await pool.fetchval(
                "SELECT count(*) FROM job_executions WHERE job_id = $1 AND started_at IS NOT NULL", job_id
            )
        ):
            if time.monotonic() - began > within:
                raise SystemExit(f"the worker {name} claimed nothing within {within:g}s")
            await asyncio.sleep(0.002)
        worker_pid = procs.roles[name].pid
        cpu0 = (cpu_seconds(worker_pid), tree_cpu_seconds(vpid) if vpid else 0.0,
                tree_cpu_seconds(ppid) if ppid else 0.0)  # fmt: skip
        await wait_succeeded(pool, job_id, runs, within)
        cpu = (cpu_seconds(worker_pid) - cpu0[0], tree_cpu_seconds(vpid) - cpu0[1] if vpid else None,
               tree_cpu_seconds(ppid) - cpu0[2] if ppid else None)  # fmt: skip
    finally:
        procs.stop()
        procs.roles.clear()
    seconds = await pool.fetchval(
        "SELECT extract(epoch FROM max(finished_at) - min(started_at))::float8 FROM job_executions WHERE job_id = $1",
        job_id,
    )
    counted = runs - int(claimed)
    return Drained(
        runs / float(seconds),
        cpu[0] / counted * 1e6,
        None if cpu[1] is None else cpu[1] / counted * 1e6,
        None if cpu[2] is None else cpu[2] / counted * 1e6,
    )


async def rate(args: argparse.Namespace, pool: asyncpg.Pool, control: Control, procs: Processes) -> dict[str, Any]:
    await control.limits.create_limit(
        LimitSpec("bench-rate", LimitKind.RATE, args.rate, period=timedelta(seconds=1), burst=args.burst)
    )
    free = await control.create_job(JobSpec(name="rate-free", handler="test.echo", retry=NO_RETRY))
    capped = await control.create_job(JobSpec(name="rate-capped", handler="test.echo", retry=NO_RETRY,
                                              limits=(LimitRef("bench-rate", "upstream"),)))  # fmt: skip
    free_per_s = (
        await drain(pool, control, procs, free.id, runs=args.runs, name="worker-free", within=args.timeout)
    ).executions_per_s
    free_starts = await starts(pool, free.id)
    capped_per_s = (
        await drain(pool, control, procs, capped.id, runs=args.runs, name="worker-capped", within=args.timeout)
    ).executions_per_s
    capped_starts = await starts(pool, capped.id)
    result = {
        "mode": "rate", "runs": args.runs, "rate": args.rate, "burst": args.burst,
        "rate_max_starts_1s": max_in_window(capped_starts), "rate_drain_per_s": drain_rate(capped_starts, args.burst),
        "rate_executions_per_s": capped_per_s, "free_max_starts_1s": max_in_window(free_starts),
        "free_executions_per_s": free_per_s,
    }  # fmt: skip
    print(f"rate limit {args.rate}/s burst {args.burst}, {args.runs} runs: most starts in 1 s "
          f"{result['rate_max_starts_1s']}, drain {result['rate_drain_per_s']}/s; without the limit "
          f"{free_per_s:.0f}/s, most starts in 1 s {result['free_max_starts_1s']}", file=sys.stderr)  # fmt: skip
    return result


async def quiet_lateness(pool: asyncpg.Pool, start: datetime, end: datetime, drain_s: float) -> dict[str, float]:
    """Start lateness of the quiet jobs' slots in [start, end) (waiting up to `drain_s` for them to
    start; a slot not started by then counts with its lateness at that moment, a lower bound)."""
    window = """FROM job_executions e JOIN jobs j ON j.id = e.job_id WHERE j.name LIKE 'quiet-%'
                AND e.attempt = 1 AND e.trigger = 'schedule' AND e.scheduled_for >= $1 AND e.scheduled_for < $2"""
    began = time.monotonic()
    while time.monotonic() - began < drain_s:
        if not await pool.fetchval(f"SELECT count(*) {window} AND e.finished_at IS NULL", start, end):
            break
        await asyncio.sleep(0.5)
    rows = await pool.fetch(
        f"""SELECT extract(epoch FROM coalesce(e.started_at, clock_timestamp()) - e.scheduled_for)::float8 AS late,
                   e.started_at IS NULL AS waiting {window}""",
        start,
        end,
    )
    figures = percentiles([row["late"] for row in rows])
    figures["not_started"] = sum(row["waiting"] for row in rows)
    return figures


async def noisy(args: argparse.Namespace, pool: asyncpg.Pool, control: Control, procs: Processes) -> dict[str, Any]:
    await control.limits.create_limit(LimitSpec("tenant", LimitKind.CONCURRENCY, 1))
    for index in range(2):
        procs.start("scheduler", f"scheduler-{index}")
        procs.start("worker", f"worker-{index}")
    await leader_ready(pool)
    await workers_ready(args.redis_url, 2)
    for index in range(args.quiet):
        await control.create_job(JobSpec(
            name=f"quiet-{index}", handler="test.echo", schedule_kind=ScheduleKind.CRON, cron="* * * * * *",
            retry=NO_RETRY, limits=(LimitRef("tenant", f"quiet-{index}"),)))  # fmt: skip
    noisy_job = await control.create_job(JobSpec(name="noisy", handler="test.delay", payload={"seconds": 0.05},
                                                 retry=NO_RETRY, limits=(LimitRef("tenant", "noisy"),)))  # fmt: skip
    second = timedelta(seconds=1)
    alone_from = (await pool.fetchval("SELECT date_trunc('second', now())")) + 3 * second
    alone_to = alone_from + args.seconds * second
    await asyncio.sleep(max(0.0, (alone_to - await pool.fetchval("SELECT now()")).total_seconds()))
    alone = await quiet_lateness(pool, alone_from, alone_to, args.drain)
    began = time.monotonic()
    await trigger_many(control, noisy_job.id, args.noisy_runs)
    trigger_s = time.monotonic() - began
    beside_from = (await pool.fetchval("SELECT date_trunc('second', now())")) + 2 * second
    beside_to = beside_from + args.seconds * second
    await asyncio.sleep(max(0.0, (beside_to - await pool.fetchval("SELECT now()")).total_seconds()))
    beside = await quiet_lateness(pool, beside_from, beside_to, args.drain)
    noisy_started = await pool.fetchval(
        "SELECT count(*) FROM job_executions WHERE job_id = $1 AND started_at >= $2 AND started_at < $3",
        noisy_job.id,
        beside_from,
        beside_to,
    )
    result = {
        "mode": "noisy", "quiet_jobs": args.quiet, "noisy_runs": args.noisy_runs, "seconds": args.seconds,
        "alone": alone, "beside": beside, "noisy_trigger_s": round(trigger_s, 1),
        "noisy_started_in_window": noisy_started,
        "quiet_p99_alone_ms": alone["p99_ms"], "quiet_p99_noisy_ms": beside["p99_ms"],
        "quiet_p99_rise_ms": beside["p99_ms"] - alone["p99_ms"],
    }  # fmt: skip
    print(f"{args.quiet} quiet per-second jobs, p99 start lateness: alone {alone['p99_ms']} ms, beside a key with "
          f"{args.noisy_runs} queued runs {beside['p99_ms']} ms ({noisy_started} noisy runs started meanwhile)",
          file=sys.stderr)  # fmt: skip
    return result


async def overhead(args: argparse.Namespace, pool: asyncpg.Pool, control: Control, procs: Processes) -> dict[str, Any]:
    await control.limits.create_limit(LimitSpec("bench-wide", LimitKind.CONCURRENCY, 1_000_000))
    redis = redis_client(args.redis_url)
    try:
        servers_pids = (await valkey_pid(redis), await postgres_pid(pool))
    finally:
        await redis.aclose()
    free: list[Drained] = []
    capped: list[Drained] = []
    for round_ in range(args.rounds):
        free_job = await control.create_job(JobSpec(name=f"drain-free-{round_}", handler="test.echo", retry=NO_RETRY))
        wide = (LimitRef("bench-wide", "all"),)
        capped_job = await control.create_job(
            JobSpec(name=f"drain-capped-{round_}", handler="test.echo", retry=NO_RETRY, limits=wide)
        )
        # Alternated, so a slow moment of the machine falls on both kinds alike.
        for job, drains in ((free_job, free), (capped_job, capped)):
            drains.append(await drain(pool, control, procs, job.id, runs=args.runs, name=f"worker-{job.name}",
                                      within=args.timeout, servers_pids=servers_pids))  # fmt: skip
    free_rate = statistics.median(d.executions_per_s for d in free)
    capped_rate = statistics.median(d.executions_per_s for d in capped)
    free_cpu = statistics.median(d.cpu_us for d in free)
    capped_cpu = statistics.median(d.cpu_us for d in capped)
    result = {
        "mode": "overhead", "runs": args.runs, "rounds": args.rounds,
        "free_rates": [round(d.executions_per_s) for d in free],
        "capped_rates": [round(d.executions_per_s) for d in capped],
        "free_cpu_us_each": [round(d.cpu_us, 1) for d in free],
        "capped_cpu_us_each": [round(d.cpu_us, 1) for d in capped],
        "free_executions_per_s": free_rate, "capped_executions_per_s": capped_rate,
        "capped_ratio": capped_rate / free_rate,
        "free_cpu_us": free_cpu, "capped_cpu_us": capped_cpu,
        # Executions one CPU-second buys with the limit, over without: the cost "per execution".
        "capped_cpu_ratio": free_cpu / capped_cpu,
        "free_worker_cpu_us": statistics.median(d.worker_cpu_us for d in free),
        "capped_worker_cpu_us": statistics.median(d.worker_cpu_us for d in capped),
        "free_valkey_cpu_us": _median_known(d.valkey_cpu_us for d in free),
        "capped_valkey_cpu_us": _median_known(d.valkey_cpu_us for d in capped),
        "free_postgres_cpu_us": _median_known(d.postgres_cpu_us for d in free),
        "capped_postgres_cpu_us": _median_known(d.postgres_cpu_us for d in capped),
    }  # fmt: skip
    print(f"drain of {args.runs} runs, median of {args.rounds}: {free_rate:.0f}/s and {free_cpu:.0f} us CPU each "
          f"without limits, {capped_rate:.0f}/s and {capped_cpu:.0f} us with one (throughput "
          f"{result['capped_ratio']:.3f}x, executions per CPU-second {result['capped_cpu_ratio']:.3f}x)",
          file=sys.stderr)  # fmt: skip
    return result


def _median_known(values: Iterable[float | None]) -> float | None:
    known = [value for value in values if value is not None]
    return statistics.median(known) if known else None


async def main(args: argparse.Namespace, redis_url: str, database_url: str, log_dir: Path) -> dict[str, Any]:
    args.redis_url = redis_url
    pool = await create_pool(database_url, size=8, connect_timeout=timedelta(seconds=10))
    redis = redis_client(redis_url)
    registry = default_registry(HandlerSettings())
    try:
        await migrate(pool)
        await pool.execute("TRUNCATE job_executions, jobs, leader_state, limits CASCADE")
        await redis.flushdb()
        control = Control(redis, pool, registry)
        env = role_env(redis_url, database_url, SCHEDULER_WORKER_CONCURRENCY="200" if args.mode != "noisy" else "10",
                       **dict(setting.split("=", 1) for setting in args.set))  # fmt: skip
        procs = Processes(env, log_dir)
        try:
            mode = {"rate": rate, "noisy": noisy, "overhead": overhead}[args.mode]
            return await mode(args, pool, control, procs)
        finally:
            procs.stop()
    finally:
        await registry.aclose()
        await redis.aclose()
        await pool.close()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["rate", "noisy", "overhead"])
    parser.add_argument("--runs", type=int, default=0, help="rate: backlog [5000]; overhead: runs per drain [20000]")
    parser.add_argument("--rate", type=int, default=100, help="rate: units per second [100]")
    parser.add_argument("--burst", type=int, default=10, help="rate: burst [10]")
    parser.add_argument("--noisy-runs", type=int, default=100_000, help="noisy: runs queued on the noisy key")
    parser.add_argument("--quiet", type=int, default=100, help="noisy: quiet per-second jobs [100]")
    parser.add_argument("--seconds", type=int, default=30, help="noisy: length of each window [30]")
    parser.add_argument("--drain", type=float, default=30.0, help="noisy: longest wait for a window's slots [30]")
    parser.add_argument("--rounds", type=int, default=5, help="overhead: drains of each kind [5]")
    parser.add_argument("--timeout", type=float, default=300.0, help="longest wait for one drain [300]")
    parser.add_argument("--set", action="append", default=[], metavar="SCHEDULER_X=VALUE",
                        help="a setting for every role process (repeatable)")  # fmt: skip
    args = parser.parse_args(argv)
    args.runs = args.runs or (5000 if args.mode == "rate" else 20_000)
    if any("=" not in setting for setting in args.set):
        parser.error("--set takes SCHEDULER_X=VALUE")
    return args


if __name__ == "__main__":
    arguments = parse_args()
    with log_dir() as logs, servers() as urls:
        outcome = uvloop.run(main(arguments, urls.redis_url, urls.database_url, logs))
    print(json.dumps(outcome, sort_keys=True))
