"""End-to-end throughput with full history: one worker process drains N queued no-op runs.

    .venv/bin/python bench/throughput_bench.py [--runs 20000] [--concurrency 200]

Starts embedded Valkey and PostgreSQL (or uses REDIS_URL / DATABASE_URL), queues `--runs` runs of a
`test.echo` job (one statement and one enqueue script per 1,000), then starts one worker process
and measures the time until every run is recorded `succeeded` in PostgreSQL. Prints executions/s
and the worker's CPU time per execution (ARCHITECTURE.md's goal: >= 6,500/s from one worker).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import uvloop

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchlib import servers  # noqa: E402

from scheduler_grpc.connections import redis_client  # noqa: E402
from scheduler_grpc.control import Control  # noqa: E402
from scheduler_grpc.db.firing import FiringRepository  # noqa: E402
from scheduler_grpc.db.migrate import migrate  # noqa: E402
from scheduler_grpc.db.pool import create_pool  # noqa: E402
from scheduler_grpc.dispatch import Queues, enqueue_runs  # noqa: E402
from scheduler_grpc.executions import Trigger  # noqa: E402
from scheduler_grpc.handlers import HandlerSettings, default_registry  # noqa: E402
from scheduler_grpc.jobs import JobSpec, RetryPolicy  # noqa: E402

BATCH = 1000


def cpu_seconds(pid: int, *, reaped: bool = False, system: bool = True) -> float:
    """CPU time of a process (with `reaped`, also of its children that exited: PostgreSQL backends;
    without `system`, user time only)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    ticks = int(fields[11]) + (int(fields[12]) if system else 0)
    if reaped:
        ticks += int(fields[13]) + (int(fields[14]) if system else 0)
    return ticks / os.sysconf("SC_CLK_TCK")


def server_cpu() -> dict[str, float]:
    """CPU seconds of the servers this process started (embedded PostgreSQL and Valkey), by kind."""
    children: dict[int, list[int]] = {}
    names: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            head, tail = (entry / "stat").read_text().rsplit(")", 1)
        except OSError:
            continue
        pid = int(entry.name)
        names[pid] = head.split("(", 1)[1]
        children.setdefault(int(tail.split()[1]), []).append(pid)
    totals = {"postgres": 0.0, "valkey": 0.0}
    pending = list(children.get(os.getpid(), []))
    while pending:
        pid = pending.pop()
        pending.extend(children.get(pid, []))
        name = names[pid]
        kind = "postgres" if name.startswith("postgres") else "valkey" if "valkey" in name or "redis" in name else None
        if kind:
            totals[kind] += cpu_seconds(pid, reaped=kind == "postgres")
    return totals


async def main(args: argparse.Namespace, redis_url: str, database_url: str) -> None:
    pool = await create_pool(database_url, size=4, connect_timeout=timedelta(seconds=5))
    await migrate(pool)
    await pool.execute("TRUNCATE job_executions, jobs CASCADE")
    redis = redis_client(redis_url)
    await redis.flushdb()
    registry = default_registry(HandlerSettings())
    control = Control(redis, pool, registry)
    queues = Queues(redis)  # the bench enqueues its runs itself (no events)
    job = await control.create_job(JobSpec(name="noop", handler="test.echo", retry=RetryPolicy(max_retries=0)))
    base = datetime(2020, 1, 1, tzinfo=UTC)
    queued_at = time.perf_counter()
    for start in range(0, args.runs, BATCH):
        slots = [base + timedelta(microseconds=i) for i in range(start, min(start + BATCH, args.runs))]
        runs = await FiringRepository(pool).trigger(job.id, Trigger.BACKFILL, slots)
        await enqueue_runs(queues, runs)
    print(f"queued {args.runs} runs in {time.perf_counter() - queued_at:.1f}s")
    env = {**os.environ, "REDIS_URL": redis_url, "DATABASE_URL": database_url, "SCHEDULER_LOG_LEVEL": "WARNING",
           "SCHEDULER_METRICS_PORT": "0"}  # fmt: skip
    profile = ["-m", "cProfile", "-o", args.profile] if args.profile else []
    worker = await asyncio.create_subprocess_exec(
        sys.executable, *profile, "-m", "scheduler_grpc", "worker", "--concurrency", str(args.concurrency),
        env=env, cwd=ROOT,
    )  # fmt: skip
    # The progress poll runs on a connection of its own, whose backend's CPU is not the worker's load.
    poll = await pool.acquire()
    poll_pid = await poll.fetchval("SELECT pg_backend_pid()")
    try:
        began = None
        cpu_before = user_before = 0.0
        servers_before: dict[str, float] = {}
        while True:
            done = await poll.fetchval("SELECT count(*) FROM job_executions WHERE status = 'succeeded'")
            if began is None and done > 0:
                began, first_done, cpu_before = time.perf_counter(), done, cpu_seconds(worker.pid)
                user_before = cpu_seconds(worker.pid, system=False)
                servers_before = server_cpu()
                servers_before["postgres"] -= cpu_seconds(poll_pid)
            if done >= args.runs:
                break
            if worker.returncode is not None:
                raise SystemExit("the worker died")
            await asyncio.sleep(0.05)
        assert began is not None
        elapsed = time.perf_counter() - began
        drained = args.runs - first_done
        cpu = cpu_seconds(worker.pid) - cpu_before
        user = cpu_seconds(worker.pid, system=False) - user_before
        servers = {kind: seconds - servers_before[kind] for kind, seconds in server_cpu().items()}
        servers["postgres"] -= cpu_seconds(poll_pid)
        print(f"one worker (concurrency {args.concurrency}): {drained / elapsed:,.0f} executions/s "
              f"with full history; worker CPU {cpu / drained * 1e6:,.0f} µs per execution "
              f"({user / drained * 1e6:,.0f} user)")  # fmt: skip
        if servers["postgres"] or servers["valkey"]:  # embedded servers (not REDIS_URL / DATABASE_URL)
            print(f"PostgreSQL CPU {servers['postgres'] / drained * 1e6:,.0f} µs, "
                  f"Valkey CPU {servers['valkey'] / drained * 1e6:,.0f} µs per execution")  # fmt: skip
    finally:
        await pool.release(poll)
        worker.send_signal(signal.SIGINT)  # a clean exit, so cProfile writes its file
        await worker.wait()
        await registry.aclose()
        await redis.aclose()
        await pool.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=20000)
    parser.add_argument("--concurrency", type=int, default=200)
    parser.add_argument("--profile", metavar="FILE", help="run the worker under cProfile, writing FILE")
    arguments = parser.parse_args()
    with servers() as urls:
        uvloop.run(main(arguments, urls.redis_url, urls.database_url))
