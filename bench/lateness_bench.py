"""Scheduling lateness at scale, measured from PostgreSQL with real scheduler and worker processes.

    .venv/bin/python bench/lateness_bench.py [--jobs 1000] [--seconds 60] [--schedulers 2] [--workers 2]
    .venv/bin/python bench/lateness_bench.py --burst 10000 [--kind once|cron]
    .venv/bin/python bench/lateness_bench.py --scan-tick [--definitions 1000 1000000] [--due 100]
    ... [--set SCHEDULER_FIRE_AHEAD=0] [--set SCHEDULER_WORKER_CONCURRENCY=100]

Starts embedded Valkey and PostgreSQL (or uses REDIS_URL / DATABASE_URL); job definitions are
inserted with COPY. Three modes:

* steady (default): `--jobs` per-second cron jobs (`* * * * * *`), all with the same first slot,
  for `--seconds`, with `--schedulers` scheduler and `--workers` worker processes (default
  settings); with `--shipped`, `scheduler-grpc up --schedulers N --workers M` starts them beside
  a server role, the topology `make run` starts (its defaults: 2 schedulers, 3 workers); with
  `--cluster`, on a Valkey Cluster of 3 masters and 3 replicas (embedded, or BENCH_CLUSTER_URL)
  instead of REDIS_URL, and with `--shards N` the queue `default` has N shards (issue 24).
  Lateness of every slot in the window, attempt 1 of trigger `schedule`: start (`started_at -
  scheduled_for`, the figure of issue 11) and fire (`created_at - scheduled_for`:
  the row was recorded by the leader's fire statement) as p50 / p99 / max, plus the slots fired
  and started, and the CPU seconds per slot of the leader, the workers and PostgreSQL (from /proc).
* `--burst N`: N jobs (one-shots, or with `--kind cron` cron jobs firing at one second of every
  minute) due in the same second; time from that second until the last one was fired and started.
* `--scan-tick`: in-process leader; one scan (`LeaderLoops.scan_once`: due query, planning, the
  fire statement, enqueue) when `--due` per-second jobs are due among each `--definitions` total
  (the rest due in a year). Median and p90 of the scan time per table size, and the ratio of the
  largest to the smallest.

The last line of output is one JSON object with every figure (for `make bench`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import asyncpg
import uvloop

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchlib import log_dir, role_env, servers, valkey_cluster  # noqa: E402
from floors import tree_cpu_seconds  # noqa: E402

from scheduler_grpc.connections import redis_client  # noqa: E402
from scheduler_grpc.db.leadership import LeadershipRepository  # noqa: E402
from scheduler_grpc.db.migrate import migrate  # noqa: E402
from scheduler_grpc.db.pool import create_pool  # noqa: E402
from scheduler_grpc.db.queue_shards import QueueShardRepository  # noqa: E402
from scheduler_grpc.keys import WorkerKeys  # noqa: E402
from scheduler_grpc.leader import LeaderElector, Term  # noqa: E402
from scheduler_grpc.scheduler import LeaderLoops, LoopSettings  # noqa: E402

_JOB_COLUMNS = ["name", "handler", "schedule_kind", "cron", "run_at", "next_run_time"]


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process (and, with `children`, of its reaped children)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return 0.0
    return (int(fields[11]) + int(fields[12]) + int(fields[13]) + int(fields[14])) / os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def free_port_run(count: int) -> int:
    """The first of `count` consecutive loopback ports free right now (`up`'s /metrics ports)."""
    for _ in range(100):
        base = random.randrange(20000, 60000 - count)
        try:
            with contextlib.ExitStack() as stack:
                for port in range(base, base + count):
                    stack.enter_context(socket.socket()).bind(("127.0.0.1", port))
        except OSError:
            continue
        return base
    raise SystemExit(f"no {count} consecutive free ports")


def parent_pid(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def percentiles(values: list[float]) -> dict[str, float]:
    """p50 / p99 / max in milliseconds, rounded to 0.1 ms."""
    if not values:
        return {"p50_ms": float("nan"), "p99_ms": float("nan"), "max_ms": float("nan"), "n": 0}
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
    return {"p50_ms": round(statistics.median(ordered) * 1000, 1), "p99_ms": round(p99 * 1000, 1),
            "max_ms": round(ordered[-1] * 1000, 1), "n": len(ordered)}  # fmt: skip


def line(label: str, figures: dict[str, float]) -> str:
    return (f"  {label:<32} p50 {figures['p50_ms']:8.1f} ms   p99 {figures['p99_ms']:8.1f} ms"
            f"   max {figures['max_ms']:8.1f} ms   (n={figures['n']})")  # fmt: skip


async def fresh(pool: asyncpg.Pool, redis_url: str, shards: int = 1) -> None:
    await migrate(pool)
    await pool.execute("TRUNCATE job_executions, jobs, leader_state, queue_shards CASCADE")
    if shards > 1:  # for every run made from now on (lead 0): the roles start after it
        await QueueShardRepository(pool).set_shards("default", shards, lead=timedelta(0))
    redis = redis_client(redis_url)
    try:
        await redis.flushdb()
    finally:
        await redis.aclose()


async def copy_jobs(pool: asyncpg.Pool, records: list[tuple[Any, ...]]) -> None:
    async with pool.acquire() as conn:
        await conn.copy_records_to_table("jobs", records=records, columns=_JOB_COLUMNS, timeout=600)


class Processes:
    """Scheduler and worker processes with default settings, logs under `log_dir`."""

    def __init__(self, env: dict[str, str], log_dir: Path) -> None:
        self._env = env
        self._log_dir = log_dir
        self.log_dir = log_dir
        self.roles: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, role: str, name: str) -> None:
        log = open(self._log_dir / f"{name}.log", "wb")  # noqa: SIM115 - the child owns it
        self.roles[name] = subprocess.Popen(
            [sys.executable, "-m", "scheduler_grpc", role],
            env={**self._env, "SCHEDULER_INSTANCE": name},
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
        )

    def start_up(self, schedulers: int, workers: int, log_dir: Path) -> None:
        """`scheduler-grpc up`: the roles as `make run` starts them, on free ports, as one child "up"."""
        grpc_port, http_port = free_port(), free_port()
        metrics_base = free_port_run(10 + workers)
        settings = {"SCHEDULER_GRPC_PORT": str(grpc_port), "SCHEDULER_HTTP_PORT": str(http_port),
                    "SCHEDULER_METRICS_BASE": str(metrics_base), "SCHEDULER_DATA_DIR": str(log_dir)}  # fmt: skip
        log = open(self._log_dir / "up.log", "wb")  # noqa: SIM115 - the child owns it
        self.roles["up"] = subprocess.Popen(
            [sys.executable, "-m", "scheduler_grpc", "up", "--schedulers", str(schedulers), "--workers", str(workers)],
            env={**self._env, **settings},
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
        )

    def cpu(self, prefix: str) -> float:
        if prefix == "up":  # the roles are up's children: their CPU in all
            return tree_cpu_seconds(self.roles["up"].pid)
        return sum(cpu_seconds(p.pid) for name, p in self.roles.items() if name.startswith(prefix))

    def stop(self) -> None:
        for process in self.roles.values():
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in self.roles.values():
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


async def leader_ready(pool: asyncpg.Pool, limit: float = 60.0) -> str:
    began = time.monotonic()
    while time.monotonic() - began < limit:
        holder = await pool.fetchval("SELECT holder FROM leader_state WHERE scope = 'scheduler'")
        if holder:
            return str(holder).split(":")[0]
        await asyncio.sleep(0.05)
    raise SystemExit("no leader elected")


async def workers_ready(redis_url: str, workers: int, limit: float = 60.0) -> None:
    redis = redis_client(redis_url)
    try:
        began = time.monotonic()
        while time.monotonic() - began < limit:
            if await redis.zcard(WorkerKeys().index) >= workers:
                return
            await asyncio.sleep(0.05)
    finally:
        await redis.aclose()


async def steady(args: argparse.Namespace, pool: asyncpg.Pool, procs: Processes, redis_url: str) -> dict[str, Any]:
    postmaster = parent_pid(await pool.fetchval("SELECT pg_backend_pid()"))
    if args.shipped:
        procs.start_up(args.schedulers, args.workers, procs.log_dir)
    else:
        for index in range(args.schedulers):
            procs.start("scheduler", f"scheduler-{index}")
        for index in range(args.workers):
            procs.start("worker", f"worker-{index}")
    await leader_ready(pool)
    await workers_ready(redis_url, args.workers)
    start = await pool.fetchval("SELECT date_trunc('second', now()) + interval '3 seconds'")
    end = start + timedelta(seconds=args.seconds)
    await copy_jobs(pool, [(f"late-{i}", "test.echo", "cron", "* * * * * *", None, start) for i in range(args.jobs)])
    await pool.execute("SELECT pg_notify('scheduler_jobs_changed', '')")
    leader = await leader_ready(pool)
    wait = (start - await pool.fetchval("SELECT now()")).total_seconds()
    await asyncio.sleep(max(0.0, wait))

    def cpu_now() -> dict[str, float]:
        if args.shipped:  # up's children, the server too
            return {"roles": procs.cpu("up"), "postgres": tree_cpu_seconds(postmaster)}
        return {"leader": procs.cpu(leader), "workers": procs.cpu("worker"), "postgres": tree_cpu_seconds(postmaster)}

    cpu_before = cpu_now()
    await asyncio.sleep(args.seconds)
    cpu_after = cpu_now()
    # Let the window's slots finish firing, then stop firing, and let them finish starting (bounded).
    drain_began = time.monotonic()
    while time.monotonic() - drain_began < args.drain:
        if await pool.fetchval("SELECT min(next_run_time) FROM jobs") >= end:
            break
        await asyncio.sleep(0.5)
    await pool.execute("UPDATE jobs SET status = 'paused'")
    expected = args.jobs * args.seconds
    window = """FROM job_executions WHERE attempt = 1 AND trigger = 'schedule'
                AND scheduled_for >= $1 AND scheduled_for < $2"""
    while time.monotonic() - drain_began < args.drain:
        # Ended, not just started: a run a worker reserved shows its expected start until it ends,
        # when the real one is written (test.echo ends at once).
        started = await pool.fetchval(f"SELECT count(*) {window} AND finished_at IS NOT NULL", start, end)
        if started >= expected:
            break
        await asyncio.sleep(0.5)
    rows = await pool.fetch(
        f"""SELECT extract(epoch FROM created_at - scheduled_for)::float8 AS fired,
                   extract(epoch FROM started_at - scheduled_for)::float8 AS started {window}""",
        start,
        end,
    )
    fired = [row["fired"] for row in rows]
    started_l = [row["started"] for row in rows if row["started"] is not None]
    slots = max(1, len(fired))
    cpu = {role: round((cpu_after[role] - cpu_before[role]) / slots * 1e6, 1) for role in cpu_before}
    result = {
        "mode": "steady", "jobs": args.jobs, "seconds": args.seconds, "schedulers": args.schedulers,
        "workers": args.workers, "shipped": args.shipped, "cluster": args.cluster, "shards": args.shards,
        "slots_expected": expected, "slots_fired": len(fired),
        "slots_started": len(started_l), "start": percentiles(started_l), "fire": percentiles(fired),
        "cpu_us_per_slot": cpu,
    }  # fmt: skip
    print(f"lateness of {args.jobs} per-second cron jobs over {args.seconds} s "
          f"({'scheduler-grpc up: a server, ' if args.shipped else ''}{args.schedulers} schedulers, "
          f"{args.workers} workers):")  # fmt: skip
    print(f"  slots: {expected} due, {len(fired)} fired, {len(started_l)} started")
    print(line("start (started_at - slot)", result["start"]))
    print(line("fire (created_at - slot)", result["fire"]))
    print("  CPU per slot: " + ", ".join(f"{role} {us} us" for role, us in cpu.items()))
    return result


async def burst(args: argparse.Namespace, pool: asyncpg.Pool, procs: Processes, redis_url: str) -> dict[str, Any]:
    for index in range(args.schedulers):
        procs.start("scheduler", f"scheduler-{index}")
    for index in range(args.workers):
        procs.start("worker", f"worker-{index}")
    await leader_ready(pool)
    await workers_ready(redis_url, args.workers)
    slot = await pool.fetchval("SELECT date_trunc('second', now()) + interval '4 seconds'")
    records: list[tuple[object, ...]]
    if args.kind == "once":
        records = [(f"burst-{i}", "test.echo", "once", None, slot, slot) for i in range(args.burst)]
    else:  # fires at this second of every minute: once in the window
        cron = f"{slot.second} * * * * *"
        records = [(f"burst-{i}", "test.echo", "cron", cron, None, slot) for i in range(args.burst)]
    await copy_jobs(pool, records)
    await pool.execute("SELECT pg_notify('scheduler_jobs_changed', '')")
    window = "FROM job_executions WHERE attempt = 1 AND trigger = 'schedule' AND scheduled_for = $1"
    began = time.monotonic()
    while time.monotonic() - began < args.drain + 5:
        # Ended: a reserved run's `started_at` is final only then (see `steady`).
        if await pool.fetchval(f"SELECT count(*) {window} AND finished_at IS NOT NULL", slot) >= args.burst:
            break
        await asyncio.sleep(0.25)
    row = await pool.fetchrow(
        f"""SELECT count(*) AS fired, count(started_at) AS started,
                   extract(epoch FROM max(created_at) - $1)::float8 AS all_fired,
                   extract(epoch FROM max(started_at) - $1)::float8 AS all_started {window}""",
        slot,
    )
    assert row is not None  # an aggregate always returns its row
    rows = await pool.fetch(f"SELECT extract(epoch FROM started_at - $1)::float8 AS s {window}", slot)
    result = {
        "mode": "burst", "kind": args.kind, "jobs": args.burst, "fired": row["fired"], "started": row["started"],
        "all_fired_s": round(row["all_fired"] or float("nan"), 3),
        "all_started_s": round(row["all_started"] or float("nan"), 3),
        "start": percentiles([r["s"] for r in rows if r["s"] is not None]),
    }  # fmt: skip
    print(f"burst of {args.burst} {args.kind} jobs due in the same second:")
    print(f"  fired {row['fired']}, started {row['started']}; all fired after {result['all_fired_s']} s, "
          f"all started after {result['all_started_s']} s")  # fmt: skip
    print(line("start (started_at - slot)", result["start"]))
    return result


async def scan_tick(args: argparse.Namespace, pool: asyncpg.Pool, redis_url: str) -> dict[str, Any]:
    redis = redis_client(redis_url)
    figures: dict[str, Any] = {}
    try:
        far = await pool.fetchval("SELECT now() + interval '365 days'")
        due_at = await pool.fetchval("SELECT date_trunc('second', now()) + interval '1 second'")
        await copy_jobs(pool, [(f"due-{i}", "test.echo", "cron", "* * * * * *", None, due_at) for i in range(args.due)])
        have = args.due
        for total in sorted(args.definitions):
            # The definitions are copied in while no leader runs (encoding a million rows would hold
            # up the lease renewal of an in-process leader); each size is measured under a new term.
            for chunk in range(have, total, 100_000):
                upto = min(total, chunk + 100_000)
                # A yearly cron at an instant a year ahead: never due during the bench.
                await copy_jobs(pool, [(f"idle-{i}", "test.echo", "cron", "0 0 1 1 *", None, far)
                                       for i in range(chunk, upto)])  # fmt: skip
            have = max(have, total)
            await pool.execute("VACUUM ANALYZE jobs", timeout=600)
            times, cpu = await _timed_scans(args, pool, redis)
            ordered = sorted(times)
            figures[str(total)] = {
                "median_ms": round(statistics.median(ordered) * 1000, 2),
                "p90_ms": round(ordered[int(0.9 * (len(ordered) - 1))] * 1000, 2),
                "leader_cpu_ms": round(statistics.median(cpu) * 1000, 2),
                "n": len(ordered),
            }
            size = figures[str(total)]
            print(f"  {total:>9} definitions, {args.due} due: scan median {size['median_ms']} ms, "
                  f"p90 {size['p90_ms']} ms, leader CPU {size['leader_cpu_ms']} ms")  # fmt: skip
    finally:
        await redis.aclose()
    # The floor of a tick: the least any statement of a scan costs (a round trip on the same pool).
    trips = []
    for _ in range(50):
        began = time.perf_counter()
        await pool.fetchval("SELECT now()")
        trips.append(time.perf_counter() - began)
    sizes = sorted(args.definitions)
    ratio = figures[str(sizes[-1])]["median_ms"] / max(1e-6, figures[str(sizes[0])]["median_ms"])
    print(f"  ratio {sizes[-1]} / {sizes[0]} definitions: {ratio:.2f}")
    return {
        "mode": "scan_tick",
        "due": args.due,
        "scans": figures,
        "ratio": round(ratio, 2),
        "pg_roundtrip_ms": round(statistics.median(trips) * 1000, 3),
    }


async def _timed_scans(args: argparse.Namespace, pool: asyncpg.Pool, redis: Any) -> tuple[list[float], list[float]]:
    """Lead in-process; `--scans` times wait for the due jobs' next slot, then time one scan.

    Returns the wall seconds of each scan and the CPU seconds this process spent in it."""
    elector = LeaderElector(redis, LeadershipRepository(pool), holder="lateness-bench")
    loops = LeaderLoops(redis, pool, LoopSettings())
    times: list[float] = []
    cpu: list[float] = []

    async def lead(term: Term) -> None:
        for _ in range(args.scans + 1):
            until = await pool.fetchval("SELECT min(next_run_time) - now() FROM jobs WHERE name LIKE 'due-%'")
            await asyncio.sleep(max(0.0, until.total_seconds()) + 0.01)
            began, cpu_began = time.perf_counter(), time.process_time()
            full = await loops.scan_once(term)
            times.append(time.perf_counter() - began)
            cpu.append(time.process_time() - cpu_began)
            while full:
                full = await loops.scan_once(term)
        await asyncio.Event().wait()  # until cancelled: the term ends when the bench is done

    campaign = asyncio.create_task(elector.run(lead))
    try:
        while len(times) < args.scans + 1:
            if campaign.done():
                raise SystemExit(f"the bench's leader stopped: {campaign}")
            await asyncio.sleep(0.1)
    finally:
        campaign.cancel()
        await asyncio.gather(campaign, return_exceptions=True)
    return times[1:], cpu[1:]  # the first scan warms caches


async def main(args: argparse.Namespace, redis_url: str, database_url: str, log_dir: Path) -> dict[str, Any]:
    pool = await create_pool(database_url, size=4, connect_timeout=timedelta(seconds=5))
    try:
        await fresh(pool, redis_url, args.shards)
        if args.scan_tick:
            return await scan_tick(args, pool, redis_url)
        env = role_env(redis_url, database_url, **dict(setting.split("=", 1) for setting in args.set))
        procs = Processes(env, log_dir)
        try:
            if args.burst:
                return await burst(args, pool, procs, redis_url)
            return await steady(args, pool, procs, redis_url)
        finally:
            procs.stop()
    finally:
        await pool.close()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=1000, help="per-second cron jobs (steady mode) [1000]")
    parser.add_argument("--seconds", type=int, default=60, help="length of the window (steady mode) [60]")
    parser.add_argument("--schedulers", type=int, default=2, help="scheduler processes [2]")
    parser.add_argument("--workers", type=int, default=2, help="worker processes [2]")
    parser.add_argument("--shipped", action="store_true",
                        help="steady mode: roles from `scheduler-grpc up` (a server too), as `make run`")  # fmt: skip
    parser.add_argument(
        "--cluster",
        action="store_true",
        help="Redis: a Valkey Cluster of 3 masters and 3 replicas (embedded, or BENCH_CLUSTER_URL)",
    )
    parser.add_argument("--shards", type=int, default=1, help="shards of the queue `default` [1]")
    parser.add_argument("--drain", type=float, default=60.0, help="longest wait for the window's slots to start [60]")
    parser.add_argument("--burst", type=int, default=0, help="burst mode: this many jobs due in the same second")
    parser.add_argument("--kind", choices=["once", "cron"], default="once", help="burst mode: job kind [once]")
    parser.add_argument("--scan-tick", action="store_true", help="scan-tick mode (in-process leader)")
    parser.add_argument("--set", action="append", default=[], metavar="SCHEDULER_X=VALUE",
                        help="a setting for every role process, e.g. SCHEDULER_FIRE_AHEAD=0 (repeatable)")  # fmt: skip
    parser.add_argument("--definitions", type=int, nargs="+", default=[1000, 1_000_000],
                        help="scan-tick mode: table sizes [1000 1000000]")  # fmt: skip
    parser.add_argument("--due", type=int, default=100, help="scan-tick mode: due jobs among them [100]")
    parser.add_argument("--scans", type=int, default=20, help="scan-tick mode: scans timed per size [20]")
    args = parser.parse_args(argv)
    if args.scan_tick and min(args.definitions) < args.due:
        parser.error("--definitions must each be at least --due")
    if any("=" not in setting for setting in args.set):
        parser.error("--set takes SCHEDULER_X=VALUE")
    return args


if __name__ == "__main__":
    arguments = parse_args()
    with (
        log_dir() as logs,
        servers() as urls,
        valkey_cluster() if arguments.cluster else contextlib.nullcontext(urls.redis_url) as redis_url,
    ):
        outcome = uvloop.run(main(arguments, redis_url, urls.database_url, logs))
    print(json.dumps(outcome, sort_keys=True))
