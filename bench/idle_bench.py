"""Idle cost: CPU of an idle worker and an idle (leading) scheduler over `--seconds`, in % of one core.

    .venv/bin/python bench/idle_bench.py [--seconds 60]

Uses REDIS_URL / DATABASE_URL (embedded servers when unset; flushes that Redis database and
truncates the job tables, so there is nothing to do). Starts one scheduler and one worker process,
waits until the scheduler leads and the worker beats, then reads their utime+stime from /proc at
the start and the end of the window. The floor, in the same window: a bare uvloop process that
wakes every 100 ms and does nothing (the cost of an idle interpreter whose loop ticks as often as
the roles' housekeeping does). One JSON line: worker_idle_pct, scheduler_idle_pct, floor_idle_pct.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

import uvloop

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from benchlib import role_env, servers  # noqa: E402
from floors import proc_cpu_seconds  # noqa: E402

from scheduler_grpc.connections import redis_client  # noqa: E402
from scheduler_grpc.db.migrate import migrate  # noqa: E402
from scheduler_grpc.db.pool import create_pool  # noqa: E402
from scheduler_grpc.keys import WorkerKeys  # noqa: E402

BARE = (
    "import asyncio, uvloop\nasync def main():\n    while True:\n        await asyncio.sleep(0.1)\nuvloop.run(main())"
)
LEADER_TERM = "SELECT coalesce(max(term), 0) FROM leader_state WHERE scope = 'scheduler'"


async def main(args: argparse.Namespace, redis_url: str, database_url: str) -> dict[str, float]:
    pool = await create_pool(database_url, size=2, connect_timeout=timedelta(seconds=10))
    await migrate(pool)
    await pool.execute("TRUNCATE job_executions, jobs CASCADE")
    term = await pool.fetchval(LEADER_TERM)
    redis = redis_client(redis_url)
    await redis.flushdb()
    env = role_env(redis_url, database_url)
    processes = {
        role: await asyncio.create_subprocess_exec(sys.executable, "-m", "scheduler_grpc", role, env=env, cwd=ROOT)
        for role in ("scheduler", "worker")
    }
    processes["floor"] = await asyncio.create_subprocess_exec(sys.executable, "-c", BARE)
    try:
        deadline = time.monotonic() + 60
        while not (await pool.fetchval(LEADER_TERM) > term and await redis.zcard(WorkerKeys().index) >= 1):
            if time.monotonic() > deadline:
                raise SystemExit("no leader or no worker beating within 60 s")
            await asyncio.sleep(0.2)
        # Start-up work (imports, first scans, pool warm-up) is not idle: let it finish first.
        await asyncio.sleep(3)
        before = {role: proc_cpu_seconds(process.pid) for role, process in processes.items()}
        began = time.perf_counter()
        await asyncio.sleep(args.seconds)
        elapsed = time.perf_counter() - began
        spent = {role: proc_cpu_seconds(process.pid) - before[role] for role, process in processes.items()}
        for role, process in processes.items():
            if process.returncode is not None:
                raise SystemExit(f"the {role} exited with {process.returncode} while idle")
    finally:
        for process in processes.values():
            if process.returncode is None:
                process.send_signal(signal.SIGTERM)
        for process in processes.values():
            await asyncio.wait_for(process.wait(), 60)
        await redis.aclose()
        await pool.close()
    return {
        "seconds": elapsed,
        "worker_idle_pct": spent["worker"] / elapsed * 100,
        "scheduler_idle_pct": spent["scheduler"] / elapsed * 100,
        "floor_idle_pct": spent["floor"] / elapsed * 100,
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=60.0)
    arguments = parser.parse_args()
    with servers() as urls:
        print(json.dumps(uvloop.run(main(arguments, urls.redis_url, urls.database_url))))
