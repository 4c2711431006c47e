"""Cost of the dependency graph's cycle check (issue 13): one edit on a large graph.

Starts embedded PostgreSQL (or uses DATABASE_URL), stores `--jobs` jobs and `--edges` acyclic
dependency edges in one of two shapes, then times `--edits` edits that each add one upstream:

* `flows` (default): the jobs form many independent flows of `--flow-size` jobs (what a
  deployment with many pipelines looks like); an edit's upward walk sees one flow's edges.
* `random`: one random DAG over all jobs (edge i -> j for i < j): the worst case, where the jobs
  upstream of a late job are most of the graph, so the walk is O(most edges).

Each edit is timed twice: the graph check alone (advisory lock, upstream resolution, the recursive
walk upward; `db/jobs.py _cycle`) inside a transaction that writes nothing, and the whole
`Control.update_job` (validation, the check and the write) on a copy of the edit. About a quarter
of the edits target an upstream that is downstream of the job (a cycle: refused, path named).
A floor is timed alongside: the same transaction with trivial statements (lock, two round trips,
commit). Last, the cost of the statement trigger that starts flow runs (migration 0007) on a batch insert
of `--batch` runs of jobs without dependents, against the same insert with the trigger disabled.
Prints one JSON object: p50 / p99 / max in milliseconds, and this process's CPU time per
edit.
Timings on a shared 2-core machine are noisy; the CPU figure and the ratio between shapes are
the steadier numbers.

    .venv/bin/python bench/flows_bench.py [--shape flows|random] [--jobs 10000] [--edges 20000]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import statistics
import sys
import time
import uuid
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import uvloop

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchlib import servers  # noqa: E402

from scheduler_grpc.connections import redis_client  # noqa: E402
from scheduler_grpc.control import Control  # noqa: E402
from scheduler_grpc.db import jobs as jobs_db  # noqa: E402
from scheduler_grpc.db.migrate import migrate  # noqa: E402
from scheduler_grpc.db.pool import create_pool  # noqa: E402
from scheduler_grpc.errors import InvalidArgument  # noqa: E402
from scheduler_grpc.handlers import HandlerSettings, default_registry  # noqa: E402


def _edges(shape: str, jobs: int, edges: int, flow_size: int, rng: random.Random) -> set[tuple[int, int]]:
    """(upstream, downstream) index pairs, upstream < downstream (acyclic by construction)."""
    chosen: set[tuple[int, int]] = set()
    while len(chosen) < edges:
        if shape == "random":
            a, b = sorted(rng.sample(range(jobs), 2))
        else:
            base = rng.randrange(0, jobs - flow_size + 1, flow_size)
            a, b = sorted(rng.sample(range(base, base + flow_size), 2))
        chosen.add((a, b))
    return chosen


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 2)


async def _insert_runs(pool: Any, job_ids: list[uuid.UUID], batch: int) -> float:
    """One INSERT of `batch` queued first attempts (as the scheduler's fire makes them), rolled
    back; returns its server-side time in ms (EXPLAIN ANALYZE, the statement trigger included)."""
    async with pool.acquire() as conn:
        tr = conn.transaction()
        await tr.start()
        try:
            plan = await conn.fetchval(
                """EXPLAIN (ANALYZE, FORMAT JSON)
                   INSERT INTO job_executions (id, run_id, job_id, scheduled_for, status, trigger)
                   SELECT r.id, r.id, r.job_id, now(), 'queued', 'schedule'
                   FROM unnest($1::uuid[], $2::uuid[]) AS r(id, job_id)""",
                [uuid.uuid4() for _ in range(batch)],
                [job_ids[i % len(job_ids)] for i in range(batch)],
            )
        finally:
            await tr.rollback()
    document = json.loads(plan) if isinstance(plan, str) else plan
    return float(document[0]["Execution Time"])


async def _trigger_overhead(pool: Any, ids: list[uuid.UUID], batch: int, rounds: int) -> dict[str, Any]:
    """What the flow-start trigger adds to a batch insert of runs: jobs without dependents (the
    trigger's EXISTS finds nothing), and with the trigger disabled (the floor), in the same run."""
    no_dependents = [
        row["id"]
        for row in await pool.fetch(
            """SELECT j.id FROM jobs j WHERE NOT EXISTS (SELECT 1 FROM job_dependencies d WHERE d.upstream_id = j.id)
               LIMIT $1""",
            batch,
        )
    ]
    figures: dict[str, Any] = {"batch": batch}
    for label, enabled in (("with_trigger_ms", True), ("trigger_disabled_ms", False)):
        await pool.execute(f"ALTER TABLE job_executions {'ENABLE' if enabled else 'DISABLE'} TRIGGER flows_start")
        times = [await _insert_runs(pool, no_dependents, batch) for _ in range(rounds)]
        figures[label] = {"p50": _pct(times, 0.5), "p90": _pct(times, 0.9)}
    await pool.execute("ALTER TABLE job_executions ENABLE TRIGGER flows_start")
    return figures


async def main(args: argparse.Namespace, redis_url: str, database_url: str) -> None:
    rng = random.Random(args.seed)
    pool = await create_pool(database_url, size=4, connect_timeout=timedelta(seconds=10))
    await migrate(pool)
    await pool.execute("TRUNCATE jobs CASCADE")
    ids = [uuid.uuid4() for _ in range(args.jobs)]
    await pool.executemany(
        "INSERT INTO jobs (id, name, handler, schedule_kind) VALUES ($1, $2, 'test.echo', 'manual')",
        [(job_id, f"bench-{index:05d}") for index, job_id in enumerate(ids)],
    )
    pairs = _edges(args.shape, args.jobs, args.edges, args.flow_size, rng)
    await pool.executemany(
        "INSERT INTO job_dependencies (job_id, upstream_id, position) VALUES ($1, $2, $3)",
        [(ids[b], ids[a], position) for position, (a, b) in enumerate(sorted(pairs))],
    )
    await pool.execute("ANALYZE jobs; ANALYZE job_dependencies")
    redis = redis_client(redis_url)
    registry = default_registry(HandlerSettings(dev_mode=True))
    control = Control(redis, pool, registry)
    check_ms: list[float] = []
    update_ms: list[float] = []
    floor_ms: list[float] = []
    cycles = 0
    cpu_before = time.process_time()
    for edit in range(args.edits):
        # An edge between two jobs of one flow (or anywhere, for `random`); a quarter of them backwards.
        a, b = sorted(_edges(args.shape, args.jobs, 1, args.flow_size, rng).pop())
        if edit % 4 == 0:
            a, b = b, a  # b would depend on a later job: a cycle whenever a path b -> ... -> a exists
        job, upstream = str(ids[b]), str(ids[a])
        current = await control.get_job(job)
        given = (*current.depends_on, upstream)
        began = time.perf_counter()
        async with pool.acquire() as conn, conn.transaction():
            await conn.execute("SELECT pg_advisory_xact_lock($1)", jobs_db.GRAPH_LOCK)
            resolved = await jobs_db._resolve_upstreams(conn, given, job, current.payload)
            found = await jobs_db._cycle(conn, job, resolved)
            check_ms.append((time.perf_counter() - began) * 1000)  # the transaction wrote nothing
        cycles += bool(found)
        # The floor: the same transaction shape with trivial statements (round trips, lock, commit).
        began = time.perf_counter()
        async with pool.acquire() as conn, conn.transaction():
            await conn.execute("SELECT pg_advisory_xact_lock($1)", jobs_db.GRAPH_LOCK)
            await conn.fetch("SELECT 1")
            await conn.fetchval("SELECT 1")
            floor_ms.append((time.perf_counter() - began) * 1000)
        began = time.perf_counter()
        with contextlib.suppress(InvalidArgument):  # a cycle: refused
            await control.update_job(job, replace(current, depends_on=given))
        update_ms.append((time.perf_counter() - began) * 1000)
    cpu_per_edit = (time.process_time() - cpu_before) / args.edits * 1000
    trigger = await _trigger_overhead(pool, ids, args.batch, args.rounds)
    print(json.dumps({
        "shape": args.shape, "jobs": args.jobs, "edges": args.edges, "edits": args.edits,
        "cycles_refused": cycles,
        "graph_check_ms": {"p50": _pct(check_ms, 0.5), "p99": _pct(check_ms, 0.99), "max": round(max(check_ms), 2),
                           "mean": round(statistics.fmean(check_ms), 2)},
        "floor_ms": {"p50": _pct(floor_ms, 0.5), "p99": _pct(floor_ms, 0.99)},
        "update_job_ms": {"p50": _pct(update_ms, 0.5), "p99": _pct(update_ms, 0.99), "max": round(max(update_ms), 2)},
        "client_cpu_ms_per_edit": round(cpu_per_edit, 2),
        "flow_start_trigger": trigger,
    }))  # fmt: skip
    await redis.aclose()
    await registry.aclose()
    await pool.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=["flows", "random"], default="flows")
    parser.add_argument("--jobs", type=int, default=10_000)
    parser.add_argument("--edges", type=int, default=20_000)
    parser.add_argument("--flow-size", type=int, default=20, help="jobs per flow (shape flows; default 20)")
    parser.add_argument("--edits", type=int, default=300)
    parser.add_argument("--seed", type=int, default=13)
    parser.add_argument("--batch", type=int, default=500, help="runs per insert for the trigger figure (500)")
    parser.add_argument("--rounds", type=int, default=30, help="inserts timed per variant (30)")
    arguments = parser.parse_args()
    with servers() as urls:
        uvloop.run(main(arguments, urls.redis_url, urls.database_url))
