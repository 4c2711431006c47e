"""Scheduling lateness, a same-second burst and the scan tick against the number of job definitions.

    .venv/bin/python bench/lateness_bench.py [--jobs 1000] [--seconds 60] [--burst 10000] [--definitions 1000000]

(A minimal version written for `make bench`; bench/run.py reads only its last line, the JSON below.)
Uses REDIS_URL / DATABASE_URL (embedded servers when unset; flushes that Redis database and
truncates the job tables). Each phase starts from a clean slate (tables truncated, Redis flushed,
a fresh scheduler and worker process); a phase that fails is named in `errors` (exit 1) and the
others still run:

* `--jobs` per-second cron jobs for `--seconds`: lateness of every slot in the window (the worker's
  `started_at` - the slot), p50/p99/max, after waiting up to `--grace` for late slots. A slot still
  not started then counts with the lateness it has by then (a lower bound), so a system that cannot
  keep up shows it; and the enqueue lateness (row created - slot);
* `--burst` one-shot jobs due in the same whole second (inserted in one statement ahead of time):
  seconds from that second until the last of them started (a lower bound, with
  `burst_not_started`, if some still wait `--burst-grace` after it);
* then, no roles running: the due scan (`JobRepository.due`, the statement each leader scan runs)
  timed over 1,000 job definitions of which 100 are due, then over `--definitions` (100 due).

JSON keys: lateness_p50_ms, lateness_p99_ms, lateness_max_ms, lateness_slots, lateness_not_started,
enqueue_p99_ms, burst_all_started_s, burst_not_started, scan_tick_1k_ms, scan_tick_1m_ms, pg_roundtrip_ms (a
`SELECT now()`: the 1,000 tick's floor), errors (only when a phase failed).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import uvloop

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from scheduler_grpc.connections import redis_client  # noqa: E402
from scheduler_grpc.db.jobs import JOBS_CHANGED_CHANNEL, JobRepository  # noqa: E402
from scheduler_grpc.db.migrate import migrate  # noqa: E402
from scheduler_grpc.db.pool import create_pool  # noqa: E402
from scheduler_grpc.embedded import embedded_servers  # noqa: E402


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))] if ordered else float("nan")


LEADER_TERM = "SELECT coalesce(max(term), 0) FROM leader_state WHERE scope = 'scheduler'"
INSERT_JOBS = """INSERT INTO jobs (name, handler, schedule_kind, cron, run_at, next_run_time, max_retries)
    SELECT $1::text || n, 'test.echo', $2::text, $3::text, $4::timestamptz,
           $5::timestamptz + (CASE WHEN n < $7 THEN interval '0' ELSE $6::interval END), 0
    FROM generate_series($8::bigint, $9::bigint - 1) AS n"""


async def insert_jobs(pool: object, prefix: str, kind: str, count: int, *, cron: str | None = None,
                      run_at: datetime | None = None, next_run: datetime, later: timedelta = timedelta(0),
                      due: int | None = None, first: int = 0) -> None:  # fmt: skip
    """`count` jobs in one statement; the first `due` (default all) next run at `next_run`, the rest `later`."""
    due = count if due is None else due
    await pool.execute(INSERT_JOBS, prefix, kind, cron, run_at, next_run, later, first + due, first, first + count)  # type: ignore[attr-defined]


async def wait_ready(pool: object, term: int, within: float = 60) -> None:
    """Until a scheduler leads a term after `term` (ours: every earlier one is over)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if await pool.fetchval(LEADER_TERM) > term:  # type: ignore[attr-defined]
            return
        await asyncio.sleep(0.1)
    raise SystemExit("no leader")


class Roles:
    """One scheduler and one worker process on a clean slate (tables truncated, Redis flushed)."""

    def __init__(self, pool: Any, redis: Any, env: dict[str, str]) -> None:
        self.pool, self.redis, self.env = pool, redis, env
        self.processes: list[asyncio.subprocess.Process] = []

    async def __aenter__(self) -> Roles:
        await self.pool.execute("TRUNCATE job_executions, jobs CASCADE")
        await self.redis.flushdb()
        term = await self.pool.fetchval(LEADER_TERM)
        for role in ("scheduler", "worker"):
            self.processes.append(await asyncio.create_subprocess_exec(
                sys.executable, "-m", "scheduler_grpc", role, env=self.env, cwd=ROOT))  # fmt: skip
        await wait_ready(self.pool, term)
        return self

    async def __aexit__(self, *exc: object) -> None:
        for process in self.processes:
            if process.returncode is None:
                process.send_signal(signal.SIGTERM)
        for process in self.processes:
            await asyncio.wait_for(process.wait(), 60)


async def lateness(args: argparse.Namespace, pool: Any) -> dict[str, float]:
    """`--jobs` per-second cron jobs for `--seconds`: lateness of every slot of the window.

    A slot not started when the measurement ends (the system could not keep up) counts with the
    lateness it had by then, a lower bound; a slot not even recorded, with the time since the window.
    """
    now = await pool.fetchval("SELECT now()")
    first_slot = now.replace(microsecond=0) + timedelta(seconds=2)
    await insert_jobs(pool, "tick-", "cron", args.jobs, cron="* * * * * *", next_run=first_slot)
    await pool.execute("SELECT pg_notify($1, '')", JOBS_CHANGED_CHANNEL)
    window = (first_slot + timedelta(seconds=3), first_slot + timedelta(seconds=3 + args.seconds))
    await asyncio.sleep(max(0.0, (window[1] - datetime.now(UTC)).total_seconds()) + 1)
    await pool.execute("UPDATE jobs SET status = 'paused', next_run_time = NULL")
    expected = args.jobs * args.seconds
    in_window = "trigger = 'schedule' AND scheduled_for >= $1 AND scheduled_for < $2"
    deadline = time.monotonic() + args.grace
    while time.monotonic() < deadline:
        started = await pool.fetchval(
            f"SELECT count(*) FROM job_executions WHERE {in_window} AND started_at IS NOT NULL", *window
        )
        if started >= expected:
            break
        await asyncio.sleep(0.5)
    rows = await pool.fetch(
        f"""SELECT extract(epoch FROM coalesce(started_at, now()) - scheduled_for) AS start_s,
                   extract(epoch FROM created_at - scheduled_for) AS enqueue_s, started_at IS NOT NULL AS started
            FROM job_executions WHERE {in_window}""",
        *window,
    )
    end = await pool.fetchval("SELECT now()")
    late = [float(row["start_s"]) * 1000 for row in rows]
    unrecorded = max(0, expected - len(rows))
    late += [(end - window[1]).total_seconds() * 1000] * unrecorded
    return {
        "lateness_slots": expected,
        "lateness_not_started": sum(not row["started"] for row in rows) + unrecorded,
        "lateness_p50_ms": statistics.median(late),
        "lateness_p99_ms": percentile(late, 0.99),
        "lateness_max_ms": max(late),
        "enqueue_p99_ms": percentile([float(row["enqueue_s"]) * 1000 for row in rows], 0.99),
    }


async def burst(args: argparse.Namespace, pool: Any) -> dict[str, float]:
    """`--burst` one-shot jobs due in the same second: seconds until the last started.

    If some have not started `--burst-grace` after the second, the figure is the time until then
    (a lower bound) and `burst_not_started` says how many were still waiting.
    """
    now = await pool.fetchval("SELECT now()")
    due_at = now.replace(microsecond=0) + timedelta(seconds=5)
    await insert_jobs(pool, "burst-", "once", args.burst, run_at=due_at, next_run=due_at)
    await pool.execute("SELECT pg_notify($1, '')", JOBS_CHANGED_CHANNEL)
    deadline = time.monotonic() + 5 + args.burst_grace
    while True:
        row = await pool.fetchrow(
            """SELECT count(*) AS n, extract(epoch FROM max(e.started_at) - $1) AS last_s
               FROM job_executions e JOIN jobs j ON j.id = e.job_id
               WHERE j.name LIKE 'burst-%' AND e.started_at IS NOT NULL""",
            due_at,
        )
        if row["n"] >= args.burst:
            return {"burst_all_started_s": float(row["last_s"]), "burst_not_started": 0}
        if time.monotonic() > deadline:
            waited = (await pool.fetchval("SELECT now()") - due_at).total_seconds()
            return {"burst_all_started_s": waited, "burst_not_started": args.burst - row["n"]}
        await asyncio.sleep(0.2)


async def scan_tick(args: argparse.Namespace, pool: Any) -> dict[str, float]:
    """The due scan over 1,000 definitions, then over `--definitions` (100 due in both)."""
    await pool.execute("TRUNCATE job_executions, jobs CASCADE")
    repository = JobRepository(pool)
    now = await pool.fetchval("SELECT now()")

    async def tick() -> float:
        await pool.execute("ANALYZE jobs")
        times = []
        for _ in range(30):
            began = time.perf_counter()
            jobs, _ = await repository.due(500)
            times.append(time.perf_counter() - began)
            assert len(jobs) == 100, len(jobs)
        return statistics.median(times) * 1000

    figures: dict[str, float] = {}
    common = {"cron": "0 0 1 1 *", "next_run": now - timedelta(seconds=1), "later": timedelta(days=400), "due": 100}
    await insert_jobs(pool, "def-", "cron", 1000, **common)  # type: ignore[arg-type]
    figures["scan_tick_1k_ms"] = await tick()
    round_trips = []
    for _ in range(30):
        began = time.perf_counter()
        await pool.fetchval("SELECT now()")
        round_trips.append(time.perf_counter() - began)
    figures["pg_roundtrip_ms"] = statistics.median(round_trips) * 1000  # the floor of any tick
    chunk = 100_000
    for first in range(1000, args.definitions, chunk):
        await insert_jobs(pool, "def-", "cron", min(chunk, args.definitions - first), first=first,
                          cron="0 0 1 1 *", next_run=now + timedelta(days=400))  # fmt: skip
    figures["scan_tick_1m_ms"] = await tick()
    figures["scan_definitions"] = args.definitions
    await pool.execute("TRUNCATE job_executions, jobs CASCADE")
    return figures


async def main(args: argparse.Namespace, redis_url: str, database_url: str) -> dict[str, Any]:
    """Each phase on a clean slate; a phase that fails is named in `errors` and the others still run."""
    pool = await create_pool(database_url, size=4, connect_timeout=timedelta(seconds=10))
    await migrate(pool)
    redis = redis_client(redis_url)
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("SCHEDULER_")},
           "REDIS_URL": redis_url, "DATABASE_URL": database_url, "SCHEDULER_LOG_LEVEL": "WARNING",
           "SCHEDULER_METRICS_PORT": "0"}  # fmt: skip
    figures: dict[str, Any] = {}
    errors: list[str] = []
    try:
        for name, phase, with_roles in (("lateness", lateness, True), ("burst", burst, True),
                                        ("scan tick", scan_tick, False)):  # fmt: skip
            began = time.monotonic()
            try:
                if with_roles:
                    async with Roles(pool, redis, env):
                        figures |= await phase(args, pool)
                else:
                    figures |= await phase(args, pool)
                print(f"{name} ({time.monotonic() - began:.0f} s): {figures}", file=sys.stderr)
            except Exception as error:
                errors.append(f"{name}: {type(error).__name__}: {error}")
                print(f"{name} failed: {error!r}", file=sys.stderr)
    finally:
        await redis.aclose()
        await pool.close()
    if errors:
        figures["errors"] = errors
    return figures


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=1000)
    parser.add_argument("--seconds", type=int, default=60)
    parser.add_argument("--burst", type=int, default=10_000)
    parser.add_argument("--definitions", type=int, default=1_000_000)
    parser.add_argument("--grace", type=float, default=15.0, help="longest wait for late slots after the window")
    parser.add_argument("--burst-grace", type=float, default=60.0, help="longest wait for the burst to start")
    arguments = parser.parse_args()
    with embedded_servers(
        ROOT / ".data",
        redis_url=os.environ.get("REDIS_URL"),
        database_url=os.environ.get("DATABASE_URL"),
        throwaway=True,
    ) as urls:
        result = uvloop.run(main(arguments, urls.redis_url, urls.database_url))
    print(json.dumps(result))
    sys.exit(1 if result.get("errors") else 0)
