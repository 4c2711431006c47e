"""Issue 24's cluster rows: the drain on one Valkey beside the drain on a 3-master Valkey Cluster
with a 3-shard queue, with 1 and 3 workers; every sharded drain checked exactly-once in PostgreSQL.

    .venv/bin/python bench/cluster_bench.py [--runs 50000] [--rounds 3] [--concurrency 200]

Uses REDIS_URL (the one server) and DATABASE_URL (embedded servers when unset; flushes that Redis
database and truncates the job tables), and starts an embedded Valkey Cluster of 3 masters and 3
replicas (`EmbeddedValkeyCluster`, under .data/) unless BENCH_CLUSTER_URL names one it may flush.
Four configurations, drained in turn in each of `--rounds` rounds (alternated, so a slow moment
of the shared machine falls on all of them alike):

* one: queue `default` unsharded on the one server, 1 worker;
* cluster1: `default` with 3 shards (`QueueShardRepository.set_shards`, for the runs made after
  it; `default`'s three shard tags hash to the three masters' slot ranges) on the cluster, 1 worker;
* one3: as `one`, with 3 workers (what three workers cost without the cluster);
* cluster3: as `cluster1`, with 3 workers.

Each drain: `--runs` `test.echo` runs recorded in PostgreSQL (1,000 per statement); the worker
processes (`python -m scheduler_grpc worker`, `--concurrency` slots each) started and waited for
(every one has beaten, so none's start-up is counted); then the window opens and this script
enqueues the runs, 1,000 per enqueue script, placed on their shards as every role places them,
while the workers drain; it closes when PostgreSQL records every run succeeded.

* executions/s: runs / (last finished_at - window open), PostgreSQL's clock;
* CPU µs per execution of the worker(s), every Valkey process (on the cluster its 3 masters and its
  3 replicas: replication is part of what a cluster costs) and PostgreSQL (the postmaster's tree,
  which includes this script's polling), utime+stime from /proc over the window, divided by the
  runs (the enqueue's Valkey and PostgreSQL side is in it, as in every configuration);
* exactly-once: every run has exactly one succeeded attempt (`duplicates`: runs with two or more,
  `missing`: runs with none), and every shard's ready and processing sets are empty afterwards.

Per configuration the median over rounds of executions/s and of CPU per execution, the median
split by process (worker, Valkey masters, Valkey replicas, PostgreSQL), and each process's share of
a core during the drain (`*_core`: per worker, the busiest master, PostgreSQL) and the rate each
would carry at a whole core (`*_ceiling_per_s`: the drain's rate per process over that share), so
where a next machine would help first is the lowest ceiling; and, before the drains, each deployment's Valkey CPU
at rest over `--idle` seconds (a cluster's nodes gossip on their bus: a cost per second that a slow
drain spreads over fewer executions). On one shared 2-core machine the cluster cannot be faster
than one server (its six Valkey processes and the workers share the same cores); the figure that
must hold is CPU per execution.

The last line of output is one JSON object with every figure.
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
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, cast

import asyncpg
import redis.asyncio as aioredis
import uvloop
from redis.asyncio.cluster import RedisCluster

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from benchlib import servers, valkey_cluster  # noqa: E402
from floors import postgres_pid, proc_cpu_seconds, tree_cpu_seconds, valkey_pid  # noqa: E402

from scheduler_grpc.config import cluster_url  # noqa: E402
from scheduler_grpc.connections import redis_client  # noqa: E402
from scheduler_grpc.control import Control  # noqa: E402
from scheduler_grpc.db.executions import Queued  # noqa: E402
from scheduler_grpc.db.firing import FiringRepository  # noqa: E402
from scheduler_grpc.db.migrate import migrate  # noqa: E402
from scheduler_grpc.db.pool import create_pool  # noqa: E402
from scheduler_grpc.db.queue_shards import QueueShardRepository  # noqa: E402
from scheduler_grpc.dispatch import Queues, enqueue_runs  # noqa: E402
from scheduler_grpc.executions import Trigger  # noqa: E402
from scheduler_grpc.handlers import HandlerSettings, default_registry  # noqa: E402
from scheduler_grpc.jobs import JobSpec, RetryPolicy  # noqa: E402
from scheduler_grpc.keys import QueueKeys, WorkerKeys, shard_name  # noqa: E402
from scheduler_grpc.sharding import ShardMap  # noqa: E402

BATCH = 1000
QUEUE = "default"


@dataclass(frozen=True)
class Config:
    """One configuration: its name, which Redis, the queue's shards, how many workers."""

    name: str
    cluster: bool
    shards: int
    workers: int


CONFIGS = (
    Config("one", False, 1, 1),
    Config("cluster1", True, 3, 1),
    Config("one3", False, 1, 3),
    Config("cluster3", True, 3, 3),
)


@dataclass
class Drained:
    """One drain's figures (CPU in µs per execution; `*_core` the share of one core it used)."""

    runs: int
    executions_per_s: float
    worker_cpu_us: float
    master_cpu_us: float
    replica_cpu_us: float
    postgres_cpu_us: float
    worker_core: float
    busiest_master_core: float
    postgres_core: float
    per_shard: list[int]
    duplicates: int
    missing: int
    left_in_redis: int

    workers: int = 1

    @property
    def cpu_us(self) -> float:
        return self.worker_cpu_us + self.master_cpu_us + self.replica_cpu_us + self.postgres_cpu_us

    def ceiling(self, core: float, processes: int = 1) -> float | None:
        """Executions/s one process would carry at a whole core: this drain's rate per process over
        the share of a core it used (where a next machine helps first is the lowest)."""
        return self.executions_per_s / processes / core if core > 0 else None


@dataclass
class Target:
    """A Redis deployment the drains run on: its URL and its Valkey processes (pids on this machine)."""

    url: str
    masters: list[int]
    replicas: list[int]


async def node_pid(url: str) -> tuple[int | None, bool]:
    """(pid if local, is a master) of the Valkey at `url`."""
    client = aioredis.Redis.from_url(url)
    try:
        role = (await client.info("replication")).get("role")
        return await valkey_pid(client), role == "master"
    finally:
        await client.aclose()


async def cluster_target(url: str) -> Target:
    parsed = cluster_url(url)
    assert parsed is not None
    masters: list[int] = []
    replicas: list[int] = []
    for host, port in parsed.seeds:
        pid, master = await node_pid(f"redis://{host}:{port}")
        if pid is not None:
            (masters if master else replicas).append(pid)
    return Target(url, masters, replicas)


async def shard_masters(url: str, shards: int) -> int:
    """How many masters the queue's `shards` shards are on (each shard's keys share one slot)."""
    client = cast(RedisCluster, redis_client(url))
    try:
        await client.initialize()
        nodes = {client.get_node_from_key(QueueKeys(shard_name(QUEUE, i)).ready) for i in range(shards)}
        return len({node.name for node in nodes if node is not None})
    finally:
        await client.aclose()


def cpu(pids: list[int]) -> float:
    return sum(proc_cpu_seconds(pid) for pid in pids)


async def drain(
    args: argparse.Namespace, config: Config, target: Target, pool: asyncpg.Pool, *, ppid: int | None, database_url: str
) -> Drained:
    redis = redis_client(target.url)
    registry = default_registry(HandlerSettings())
    workers: list[asyncio.subprocess.Process] = []
    try:
        await redis.flushdb()  # on a cluster, every master
        await pool.execute("TRUNCATE job_executions, jobs, queue_shards CASCADE")
        if config.shards > 1:
            # Lead 0: the count applies to every run made from now on; the workers start after it.
            await QueueShardRepository(pool).set_shards(QUEUE, config.shards, lead=timedelta(0))
        shard_map = ShardMap(QueueShardRepository(pool).histories)
        await shard_map.refresh()
        queues = Queues(redis, shard_map=shard_map)
        control = Control(redis, pool, registry, shard_map=shard_map)
        job = await control.create_job(
            JobSpec(name=f"drain-{config.name}", handler="test.echo", queue=QUEUE, retry=RetryPolicy(max_retries=0))
        )
        base = datetime(2020, 1, 1, tzinfo=UTC)
        runs: list[Queued] = []
        for start in range(0, args.runs, BATCH):
            slots = [base + timedelta(microseconds=i) for i in range(start, min(start + BATCH, args.runs))]
            runs += await FiringRepository(pool).trigger(job.id, Trigger.BACKFILL, slots)
        per_shard = [0] * config.shards
        for run in runs:
            per_shard[shard_map.plan.shard_of(QUEUE, run.run_id)] += 1
        env = {**{k: v for k, v in os.environ.items() if not k.startswith(("SCHEDULER_", "OTEL_"))},
               "REDIS_URL": target.url, "DATABASE_URL": database_url, "SCHEDULER_LOG_LEVEL": "WARNING",
               "SCHEDULER_METRICS_PORT": "0", "SCHEDULER_QUEUE_SHARD_LEAD": "1s"}  # fmt: skip
        for _ in range(config.workers):
            workers.append(await asyncio.create_subprocess_exec(
                sys.executable, "-m", "scheduler_grpc", "worker", "--concurrency", str(args.concurrency),
                env=env, cwd=ROOT))  # fmt: skip
        # Every worker up and waiting on an empty queue (its start-up is not the drain's), then the
        # window opens and the runs go into Redis, 1,000 per enqueue script, while the workers drain.
        up_by = time.monotonic() + 60
        while await redis.zcard(WorkerKeys().index) < config.workers:
            if any(w.returncode is not None for w in workers) or time.monotonic() > up_by:
                raise SystemExit(f"{config.name}: the workers did not start within 60 s")
            await asyncio.sleep(0.01)
        pids = [w.pid for w in workers]
        cpu0 = (cpu(pids), [proc_cpu_seconds(p) for p in target.masters], cpu(target.replicas),
                tree_cpu_seconds(ppid) if ppid else 0.0)  # fmt: skip
        opened = time.monotonic()
        t0 = await pool.fetchval("SELECT clock_timestamp()")
        added = 0
        for start in range(0, len(runs), BATCH):
            added += await enqueue_runs(queues, runs[start : start + BATCH])
        if added != args.runs:
            raise SystemExit(f"{config.name}: {added} of {args.runs} runs were new to Redis")
        deadline = time.monotonic() + args.timeout
        while True:
            done = await pool.fetchval(
                "SELECT count(*) FROM job_executions WHERE job_id = $1 AND status = 'succeeded'", job.id
            )
            if done >= args.runs:
                break
            if any(w.returncode is not None for w in workers):
                raise SystemExit(f"{config.name}: a worker exited")
            if time.monotonic() > deadline:
                raise SystemExit(f"{config.name}: only {done} of {args.runs} runs done after {args.timeout:g}s")
            await asyncio.sleep(0.25)
        wall = time.monotonic() - opened
        masters1 = [proc_cpu_seconds(p) for p in target.masters]
        used = (cpu(pids) - cpu0[0], sum(masters1) - sum(cpu0[1]), cpu(target.replicas) - cpu0[2],
                (tree_cpu_seconds(ppid) - cpu0[3]) if ppid else 0.0)  # fmt: skip
        busiest = max((b - a for a, b in zip(cpu0[1], masters1, strict=True)), default=0.0)
        check = await pool.fetchrow(
            """SELECT count(*) FILTER (WHERE n > 1) AS duplicates, count(*) FILTER (WHERE n = 0) AS missing,
                      count(*) AS runs
                 FROM (SELECT run_id, count(*) FILTER (WHERE status = 'succeeded') AS n
                         FROM job_executions WHERE job_id = $1 GROUP BY run_id) AS per_run""",
            job.id,
        )
        assert check is not None
        seconds = await pool.fetchval(
            "SELECT extract(epoch FROM max(finished_at) - $2::timestamptz)::float8 FROM job_executions"
            " WHERE job_id = $1",
            job.id,
            t0,
        )
        left = 0
        for i in range(config.shards):
            keys = QueueKeys(shard_name(QUEUE, i))
            left += int(await redis.zcard(keys.ready)) + int(await redis.zcard(keys.processing))
        counted = args.runs
        return Drained(
            runs=int(check["runs"]),
            executions_per_s=counted / float(seconds),
            worker_cpu_us=used[0] / counted * 1e6,
            master_cpu_us=used[1] / counted * 1e6,
            replica_cpu_us=used[2] / counted * 1e6,
            postgres_cpu_us=used[3] / counted * 1e6,
            worker_core=used[0] / wall / config.workers,
            busiest_master_core=busiest / wall,
            postgres_core=used[3] / wall,
            per_shard=per_shard,
            duplicates=int(check["duplicates"]),
            missing=int(check["missing"]) + args.runs - int(check["runs"]),
            left_in_redis=left,
            workers=config.workers,
        )
    finally:
        for worker in workers:
            if worker.returncode is None:
                worker.send_signal(signal.SIGTERM)
        for worker in workers:
            await asyncio.wait_for(worker.wait(), 60)
        await registry.aclose()
        await redis.aclose()


def summary(name: str, drains: list[Drained]) -> dict[str, Any]:
    """The medians of one configuration's drains, its figures prefixed with its name."""

    def median(attribute: str) -> float:
        return float(statistics.median(getattr(d, attribute) for d in drains))

    figures: dict[str, Any] = {
        "executions_per_s": median("executions_per_s"), "cpu_us": statistics.median(d.cpu_us for d in drains),
        "worker_cpu_us": median("worker_cpu_us"), "valkey_master_cpu_us": median("master_cpu_us"),
        "valkey_replica_cpu_us": median("replica_cpu_us"), "postgres_cpu_us": median("postgres_cpu_us"),
        "worker_core": median("worker_core"), "busiest_master_core": median("busiest_master_core"),
        "postgres_core": median("postgres_core"),
        "rates": [round(d.executions_per_s) for d in drains], "cpu_us_each": [round(d.cpu_us, 1) for d in drains],
        "per_shard": drains[-1].per_shard,
        "duplicates": sum(d.duplicates for d in drains), "missing": sum(d.missing for d in drains),
        "left_in_redis": sum(d.left_in_redis for d in drains),
        "worker_ceiling_per_s": _median_known(d.ceiling(d.worker_core, d.workers) for d in drains),
        "busiest_master_ceiling_per_s": _median_known(d.ceiling(d.busiest_master_core) for d in drains),
        "postgres_ceiling_per_s": _median_known(d.ceiling(d.postgres_core) for d in drains),
    }  # fmt: skip
    return {f"{name}_{key}": value for key, value in figures.items()}


def _median_known(values: Iterable[float | None]) -> float | None:
    known = [value for value in values if value is not None]
    return float(statistics.median(known)) if known else None


async def main(args: argparse.Namespace, one_url: str, database_url: str, cluster: str) -> dict[str, Any]:
    pool = await create_pool(database_url, size=4, connect_timeout=timedelta(seconds=10))
    try:
        await migrate(pool)
        ppid = await postgres_pid(pool)
        one_client = aioredis.Redis.from_url(one_url)
        try:
            one_pid = await valkey_pid(one_client)
        finally:
            await one_client.aclose()
        targets = {False: Target(one_url, [one_pid] if one_pid else [], []), True: await cluster_target(cluster)}
        # What the Valkey processes cost doing nothing (a cluster's nodes gossip on their bus): a
        # cost per second, not per execution, that a slow drain spreads over fewer executions.
        idle: dict[str, float] = {}
        for name, target in (("one", targets[False]), ("cluster", targets[True])):
            before = cpu(target.masters + target.replicas)
            await asyncio.sleep(args.idle)
            idle[name] = (cpu(target.masters + target.replicas) - before) / args.idle
        drains: dict[str, list[Drained]] = {config.name: [] for config in CONFIGS}
        for round_ in range(args.rounds):
            for config in CONFIGS:
                done = await drain(args, config, targets[config.cluster], pool, ppid=ppid, database_url=database_url)
                drains[config.name].append(done)
                print(f"round {round_ + 1} {config.name}: {done.executions_per_s:.0f}/s, {done.cpu_us:.0f} us CPU "
                      f"per execution (worker {done.worker_cpu_us:.0f}, masters {done.master_cpu_us:.0f}, replicas "
                      f"{done.replica_cpu_us:.0f}, PostgreSQL {done.postgres_cpu_us:.0f}); per shard "
                      f"{done.per_shard}, duplicates {done.duplicates}, missing {done.missing}",
                      file=sys.stderr, flush=True)  # fmt: skip
        figures: dict[str, Any] = {"runs": args.runs, "rounds": args.rounds, "concurrency": args.concurrency,
                                   "cluster_masters": len(targets[True].masters),
                                   "cluster_replicas": len(targets[True].replicas),
                                   "cluster_shard_masters": await shard_masters(cluster, 3)}  # fmt: skip
        for name, each in drains.items():
            figures |= summary(name, each)
        for name, floor in (("cluster1", "one"), ("cluster3", "one3")):
            figures[f"{name}_cpu_ratio"] = figures[f"{name}_cpu_us"] / figures[f"{floor}_cpu_us"]
        figures |= {f"{name}_idle_valkey_core": value for name, value in idle.items()}
        sharded = [d for name in ("cluster1", "cluster3") for d in drains[name]]
        figures["sharded_runs_verified"] = sum(d.runs for d in sharded)
        figures["sharded_not_exactly_once"] = sum(d.duplicates + d.missing for d in sharded)
        return figures
    finally:
        # The shared PostgreSQL of `make bench`: the next measurements' queue is unsharded again.
        await pool.execute("TRUNCATE job_executions, jobs, queue_shards CASCADE")
        await pool.close()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=50_000, help="runs per drain [50000]")
    parser.add_argument("--rounds", type=int, default=3, help="drains of each configuration [3]")
    parser.add_argument("--concurrency", type=int, default=200, help="slots per worker [200]")
    parser.add_argument("--replicas", type=int, default=1, help="replicas per master of the embedded cluster [1]")
    parser.add_argument("--idle", type=float, default=5.0, help="seconds of the idle Valkey CPU baseline [5]")
    parser.add_argument("--timeout", type=float, default=300.0, help="longest wait for one drain [300]")
    return parser.parse_args(argv)


if __name__ == "__main__":
    arguments = parse_args()
    with servers() as urls, valkey_cluster(arguments.replicas) as cluster_redis_url:
        outcome = uvloop.run(main(arguments, urls.redis_url, urls.database_url, cluster_redis_url))
    print(json.dumps(outcome, sort_keys=True))
