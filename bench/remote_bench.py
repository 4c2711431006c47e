"""Issue 23's throughput figure: a drain by one remote Python SDK worker (through one `server`
process) beside the in-process drain, in the same run, on the same servers.

    .venv/bin/python bench/remote_bench.py [--runs 20000] [--slots 200] [--rounds 1]
    .venv/bin/python bench/remote_bench.py --sdk-worker TARGET QUEUE SLOTS   (internal; key in BENCH_WORKER_KEY)

Uses REDIS_URL / DATABASE_URL (embedded servers when unset; flushes that Redis database and
truncates the job tables). Each round, one after the other:

* in-process: `--runs` `test.echo` runs queued (backfill, 1,000 per statement and enqueue script),
  drained by one `worker` process with `--slots` slots, as bench/drain_bench.py does;
* remote: `--runs` runs of a job naming `bench.noop` (a handler only the SDK worker serves, on a
  queue of its own) queued the same way, drained by one Python SDK worker process
  (`scheduler_client.worker.Worker`, `--slots` slots, a no-op handler returning its payload)
  connected to one `server` role process (started once, before the first round). Full history:
  every run is one attempt row, `succeeded` (checked; the script fails otherwise).

Figures (one JSON line at the end), each the best of the rounds:

* executions/s: runs / (last finished_at - first started_at) of the round's job, from PostgreSQL's
  own timestamps; `remote_ratio` = remote / in-process;
* CPU µs per execution (utime+stime from /proc over the drain) of the in-process worker, and of the
  server process and the SDK process for the remote drain; Valkey's and PostgreSQL's (the
  postmaster's tree) for both. A window opens when the draining worker beats (the in-process
  worker's first heartbeat; the remote worker's session in the server beats as the stream opens),
  so the processes' start-up is not counted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import signal
import socket
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import asyncpg
import uvloop
from redis.asyncio import Redis

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "clients" / "python"))

from api_load_bench import wait_serving  # noqa: E402
from benchlib import servers  # noqa: E402
from floors import postgres_pid, proc_cpu_seconds, tree_cpu_seconds, valkey_pid  # noqa: E402

from scheduler_grpc.auth import API_KEY_PREFIX, KEY_PREFIX_LENGTH, hash_token  # noqa: E402
from scheduler_grpc.connections import redis_client  # noqa: E402
from scheduler_grpc.control import Control  # noqa: E402
from scheduler_grpc.db.api_keys import ApiKeyRepository  # noqa: E402
from scheduler_grpc.db.firing import FiringRepository  # noqa: E402
from scheduler_grpc.db.migrate import migrate  # noqa: E402
from scheduler_grpc.db.pool import create_pool  # noqa: E402
from scheduler_grpc.dispatch import Queues, enqueue_runs  # noqa: E402
from scheduler_grpc.executions import Trigger  # noqa: E402
from scheduler_grpc.handlers import HandlerSettings, default_registry  # noqa: E402
from scheduler_grpc.jobs import JobSpec, RetryPolicy  # noqa: E402
from scheduler_grpc.keys import WorkerKeys  # noqa: E402

BATCH = 1000
REMOTE_QUEUE = "remote-bench"
REMOTE_HANDLER = "bench.noop"
IN_PROCESS_QUEUE = "default"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


async def queue_runs(pool: asyncpg.Pool, queues: Queues, job_id: str, runs: int) -> None:
    base = datetime(2020, 1, 1, tzinfo=UTC)
    for start in range(0, runs, BATCH):
        slots = [base + timedelta(microseconds=i) for i in range(start, min(start + BATCH, runs))]
        made = await FiringRepository(pool).trigger(job_id, Trigger.BACKFILL, slots)
        await enqueue_runs(queues, made)


async def members(redis: Redis) -> set[str]:
    """The workers beating now (the heartbeat index)."""
    found = await redis.zrange(WorkerKeys().index, 0, -1)
    return {m.decode() if isinstance(m, bytes) else str(m) for m in found}


async def new_beat(redis: Redis, before: set[str], process: asyncio.subprocess.Process) -> None:
    """Until a worker not in `before` beats (polled every 2 ms)."""
    up_by = time.monotonic() + 60
    while not await members(redis) - before:
        if process.returncode is not None or time.monotonic() > up_by:
            raise SystemExit("the draining worker did not start within 60 s")
        await asyncio.sleep(0.002)


class Drain:
    """One drain: its job's runs, the processes whose CPU counts, and its figures."""

    def __init__(
        self, pool: asyncpg.Pool, redis: Redis, vpid: int | None, ppid: int | None, *, timeout: float, profile: str
    ) -> None:
        self.pool, self.redis, self.vpid, self.ppid, self.timeout = pool, redis, vpid, ppid, timeout
        self.profile = profile
        self.drains = 0

    async def _profiler(self, name: str, pid: int) -> asyncio.subprocess.Process:
        """py-spy sampling `pid` (without pausing it) until SIGINT, to `--profile`/<drain>-<name>.txt
        (collapsed stacks: `flamegraph.pl` or speedscope read them)."""
        out = Path(self.profile) / f"{self.drains}-{name}.txt"
        return await asyncio.create_subprocess_exec(
            os.environ.get("BENCH_PY_SPY", "py-spy"), "record", "--pid", str(pid), "--nonblocking", "--rate", "250",
            "--format", "raw", "--output", str(out), stdout=asyncio.subprocess.DEVNULL,
        )  # fmt: skip

    def _cpu(self, pids: dict[str, int]) -> dict[str, float]:
        cpu = {name: proc_cpu_seconds(pid) for name, pid in pids.items()}
        if self.vpid:
            cpu["valkey"] = tree_cpu_seconds(self.vpid)
        if self.ppid:
            cpu["postgres"] = tree_cpu_seconds(self.ppid)
        return cpu

    async def measure(
        self, job_id: str, runs: int, drainer: asyncio.subprocess.Process, pids: dict[str, int], before: set[str]
    ) -> dict[str, float]:
        """Wait for `drainer` to beat, then for every run of `job_id` to succeed; the figures."""
        await new_beat(self.redis, before, drainer)
        self.drains += 1
        profilers = [await self._profiler(name, pid) for name, pid in pids.items()] if self.profile else []
        cpu0 = self._cpu(pids)
        deadline = time.monotonic() + self.timeout
        while True:
            done = await self.pool.fetchval(
                "SELECT count(*) FROM job_executions WHERE job_id = $1 AND final_status = 'succeeded'", job_id
            )
            if done >= runs:
                break
            if drainer.returncode is not None:
                raise SystemExit(f"the draining process exited with {drainer.returncode}")
            if time.monotonic() > deadline:
                raise SystemExit(f"only {done} of {runs} runs done after {self.timeout:g}s")
            await asyncio.sleep(0.1)
        cpu1 = self._cpu(pids)
        for profiler in profilers:
            profiler.send_signal(signal.SIGINT)
            await profiler.wait()
        row = await self.pool.fetchrow(
            """SELECT extract(epoch FROM max(finished_at) - min(started_at)) AS seconds, count(*) AS rows,
                      count(*) FILTER (WHERE status = 'succeeded' AND attempt = 1) AS succeeded,
                      count(DISTINCT run_id) AS runs
                 FROM job_executions WHERE job_id = $1""",
            job_id,
        )
        assert row is not None  # an aggregate always returns its row
        if not row["rows"] == row["succeeded"] == row["runs"] == runs:
            raise SystemExit(f"not full history, one succeeded attempt per run: {dict(row)}")
        seconds = float(row["seconds"])
        figures = {"seconds": seconds, "executions_per_s": runs / seconds}
        figures |= {f"{name}_cpu_us": (cpu1[name] - cpu0[name]) / runs * 1e6 for name in cpu0}
        return figures


async def stop(process: asyncio.subprocess.Process) -> None:
    if process.returncode is None:
        process.send_signal(signal.SIGTERM)
    await asyncio.wait_for(process.wait(), 60)


async def main(args: argparse.Namespace, redis_url: str, database_url: str) -> dict[str, Any]:
    pool = await create_pool(database_url, size=4, connect_timeout=timedelta(seconds=10))
    await migrate(pool)
    await pool.execute("TRUNCATE job_executions, jobs CASCADE")
    redis = redis_client(redis_url)
    await redis.flushdb()
    registry = default_registry(HandlerSettings())
    control = Control(redis, pool, registry, in_process_queue=IN_PROCESS_QUEUE)
    queues = Queues(redis)
    secret = API_KEY_PREFIX + secrets.token_urlsafe(32)
    await ApiKeyRepository(pool).create(
        name=f"remote-bench-{time.time_ns()}", key_hash=hash_token(secret), key_prefix=secret[:KEY_PREFIX_LENGTH],
        role="worker", created_by=None, expires_at=None,
    )  # fmt: skip
    drain = Drain(
        pool, redis, await valkey_pid(redis), await postgres_pid(pool), timeout=args.timeout, profile=args.profile
    )
    base_env = {k: v for k, v in os.environ.items() if not k.startswith(("SCHEDULER_", "OTEL_"))}
    env = {**base_env, "REDIS_URL": redis_url, "DATABASE_URL": database_url, "SCHEDULER_LOG_LEVEL": "WARNING",
           "SCHEDULER_METRICS_PORT": "0", "SCHEDULER_QUEUE": IN_PROCESS_QUEUE,
           **dict(setting.split("=", 1) for setting in args.set)}  # fmt: skip
    port = free_port()
    target = f"127.0.0.1:{port}"
    server = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "scheduler_grpc", "server", env={**env, "SCHEDULER_GRPC_PORT": str(port),
                                                               "SCHEDULER_HTTP_ENABLED": "false"},
        cwd=ROOT,
    )  # fmt: skip
    rounds: list[dict[str, Any]] = []
    try:
        await wait_serving(target, server)
        for index in range(args.rounds):
            figures: dict[str, Any] = {}
            # In-process: the drain row's worker, the same settings.
            job = await control.create_job(JobSpec(name=f"local-{index}", handler="test.echo",
                                                   retry=RetryPolicy(max_retries=0)))  # fmt: skip
            await queue_runs(pool, queues, job.id, args.runs)
            before = await members(redis)
            worker = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "scheduler_grpc", "worker", "--concurrency", str(args.slots), env=env, cwd=ROOT
            )
            try:
                local = await drain.measure(job.id, args.runs, worker, {"worker": worker.pid}, before)
            finally:
                await stop(worker)
            figures |= {f"inprocess_{key}": value for key, value in local.items()}
            # Remote: one SDK worker process through the server process.
            job = await control.create_job(JobSpec(name=f"remote-{index}", handler=REMOTE_HANDLER,
                                                   queue=REMOTE_QUEUE, retry=RetryPolicy(max_retries=0)))  # fmt: skip
            await queue_runs(pool, queues, job.id, args.runs)
            before = await members(redis)
            sdk = await asyncio.create_subprocess_exec(
                sys.executable, __file__, "--sdk-worker", target, REMOTE_QUEUE, str(args.slots),
                "--sdk-loop", args.sdk_loop, env={**base_env, "BENCH_WORKER_KEY": secret}, cwd=ROOT,
            )  # fmt: skip
            try:
                remote = await drain.measure(job.id, args.runs, sdk, {"server": server.pid, "sdk": sdk.pid}, before)
            finally:
                await stop(sdk)
            figures |= {f"remote_{key}": value for key, value in remote.items()}
            figures["remote_ratio"] = remote["executions_per_s"] / local["executions_per_s"]
            print(f"round {index + 1}: in-process {local['executions_per_s']:.0f}/s, remote "
                  f"{remote['executions_per_s']:.0f}/s ({figures['remote_ratio']:.2f}x); CPU µs/execution: worker "
                  f"{local['worker_cpu_us']:.0f}, server {remote['server_cpu_us']:.0f}, SDK {remote['sdk_cpu_us']:.0f}",
                  file=sys.stderr)  # fmt: skip
            rounds.append(figures)
    finally:
        await stop(server)
        await registry.aclose()
        await redis.aclose()
        await pool.close()
    best_local = max(rounds, key=lambda r: r["inprocess_executions_per_s"])
    best_remote = max(rounds, key=lambda r: r["remote_executions_per_s"])
    result: dict[str, Any] = {
        "runs": args.runs, "slots": args.slots, "rounds": rounds, "sdk_loop": args.sdk_loop,
        **{key: value for key, value in best_local.items() if key.startswith("inprocess_")},
        **{key: value for key, value in best_remote.items() if key.startswith("remote_") and key != "remote_ratio"},
    }  # fmt: skip
    result["remote_ratio"] = result["remote_executions_per_s"] / result["inprocess_executions_per_s"]
    return result


# -- the SDK worker process ----------------------------------------------------------------------------


async def sdk_worker(target: str, queue: str, slots: int) -> None:
    """One Python SDK worker serving `bench.noop` (returns its payload) until SIGTERM."""
    from scheduler_client.worker import ExecutionContext, Worker

    worker = Worker(target, os.environ["BENCH_WORKER_KEY"], slots=slots, queue=queue)

    @worker.handler(REMOTE_HANDLER, description="no-op (bench/remote_bench.py)")
    async def noop(ctx: ExecutionContext, payload: dict[str, Any]) -> Any:
        return payload

    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, worker.stop)
    await worker.run()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=20_000)
    parser.add_argument("--slots", type=int, default=200, help="the in-process worker's concurrency, the SDK's slots")
    parser.add_argument("--rounds", type=int, default=1, help="in-process then remote, this many times; the best")
    parser.add_argument("--timeout", type=float, default=300.0, help="give up after this many seconds of one drain")
    parser.add_argument("--sdk-loop", choices=("uvloop", "asyncio"), default="uvloop",
                        help="the SDK worker's event loop")  # fmt: skip
    parser.add_argument("--profile", default="", metavar="DIR",
                        help="sample each drain's processes with py-spy (BENCH_PY_SPY: its path) into DIR")  # fmt: skip
    parser.add_argument("--set", action="append", default=[], metavar="SCHEDULER_X=VALUE",
                        help="a setting for the worker and the server processes")  # fmt: skip
    parser.add_argument("--sdk-worker", nargs=3, metavar=("TARGET", "QUEUE", "SLOTS"), help=argparse.SUPPRESS)
    arguments = parser.parse_args()
    if arguments.sdk_worker:
        target, queue, slots = arguments.sdk_worker
        run = uvloop.run if arguments.sdk_loop == "uvloop" else asyncio.run
        run(sdk_worker(target, queue, int(slots)))
        sys.exit(0)
    with servers() as urls:
        print(json.dumps(uvloop.run(main(arguments, urls.redis_url, urls.database_url))))
