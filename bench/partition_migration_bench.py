"""Migration 0016 (job_executions partitioned by day) on a long history: how long the conversion
takes, that it keeps every row, and what the worker's claim and completion and the reads cost
before and after it.

    .venv/bin/python bench/partition_migration_bench.py [--history 1000000] [--jobs 1000] [--days 30]
                                                         [--runs 2000] [--batch 200]

Starts embedded PostgreSQL (or uses DATABASE_URL's server), makes a database of its own migrated up
to 0015, seeds `--history` finished attempts (bench/console_bench.py's generator, their slots spread
over `--days` days) and console_bench's 200-node flow run, then, before and after applying 0016 and
0017: claims and completes `--runs` queued runs in batches of `--batch` through `RunRepository`
(median ms per batch after 12 warm-up batches), with each run's slot as the worker gives it and
without (items queued before slots travelled), and times lookups by id, by run, the list pages and
the flow run page's read of its nodes (by run id alone; with the nodes' slots) (median of 50).
Checks that every row survived (count and a hash of every row's text) and prints EXPLAIN of each
read after the conversion (which index each partition used), and EXPLAIN (ANALYZE) of a claim and
a completion batch (which partitions each row's lookup read).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import asyncpg
import uvloop

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from benchlib import servers  # noqa: E402
from console_bench import (  # noqa: E402
    FINISH_FLOW_RUN,
    FLOW_NODES,
    HANDLERS,
    QUEUES,
    SEED_FLOW,
    SEED_FLOW_RUN,
    SEED_HISTORY,
    SEED_JOBS,
)

from scheduler_grpc.db import migrate as migrations  # noqa: E402
from scheduler_grpc.db.attempts import latest_attempt  # noqa: E402
from scheduler_grpc.db.executions import Outcome  # noqa: E402
from scheduler_grpc.db.firing import FiringRepository  # noqa: E402
from scheduler_grpc.db.migrate import migrate  # noqa: E402
from scheduler_grpc.db.pool import create_pool  # noqa: E402
from scheduler_grpc.db.runs import RunRepository  # noqa: E402
from scheduler_grpc.executions import ExecutionStatus, Trigger  # noqa: E402

DATABASE = "scheduler_partition_bench"
# Every row's text (the columns in their order, which the conversion keeps), hashed and summed.
CHECKSUM = """SELECT count(*) AS rows,
                     sum(('x' || substr(md5(e::text), 1, 15))::bit(60)::bigint) AS hash
              FROM job_executions e"""
READS: dict[str, tuple[str, tuple[str, ...]]] = {  # name: (SQL, the sample row's columns it takes)
    "by id": ("SELECT * FROM job_executions WHERE id = $1", ("id",)),
    "by run (latest attempt)": (
        "SELECT * FROM job_executions WHERE run_id = $1 ORDER BY attempt DESC LIMIT 1",
        ("id",),
    ),
    "list page 1": ("SELECT id FROM job_executions ORDER BY created_at DESC, id DESC LIMIT 101", ()),
    "list page deep": (
        "SELECT id FROM job_executions WHERE (created_at, id) < ($1, $2) ORDER BY created_at DESC, id DESC LIMIT 101",
        ("created_at", "id"),
    ),
    "list by job": (
        "SELECT id FROM job_executions WHERE job_id = $1 ORDER BY created_at DESC, id DESC LIMIT 101",
        ("job_id",),
    ),
    "list state=dead": (
        "SELECT id FROM job_executions WHERE final_status = 'dead' ORDER BY created_at DESC, id DESC LIMIT 101",
        (),
    ),
}


_EXPLAIN: set[str] = set()  # statements to EXPLAIN (ANALYZE) once, the next time they run
WARM_BATCHES = 12  # not measured: a prepared statement's first five runs per connection plan anew


class _ExplainingPool(asyncpg.Pool):
    """A pool that, for each kind in `_EXPLAIN` (`claim`, `complete`), first runs the next such
    statement under EXPLAIN (ANALYZE) in a transaction it rolls back and prints the plan."""

    __slots__ = ()

    async def fetch(self, query: str, *args: Any, **kwargs: Any) -> list[asyncpg.Record]:  # type: ignore[override]
        kind = "claim" if "latest AS" in query else "complete" if "retried AS" in query else "other"
        if kind in _EXPLAIN:
            _EXPLAIN.discard(kind)
            async with self.acquire() as conn:
                transaction = conn.transaction()
                await transaction.start()
                try:
                    plan = await conn.fetch(f"EXPLAIN (ANALYZE, COSTS OFF, TIMING OFF) {query}", *args)
                finally:
                    await transaction.rollback()
            text = "\n".join(row[0] for row in plan)
            print(f"-- {kind}: {len(args[0])} items\n{text}", file=sys.stderr, flush=True)
        return await super().fetch(query, *args, **kwargs)


async def hot_path(pool: asyncpg.Pool, runs: int, batch: int, *, slots: bool, explain: bool) -> dict[str, float]:
    """Claim and complete `runs` queued runs of one job in batches: median ms per batch. With
    `slots`, each run's slot goes with it (as the worker's queue items carry it); without, the
    statements find each run by id alone (items queued before slots travelled with them)."""
    job = await pool.fetchval("SELECT id::text FROM jobs WHERE name NOT LIKE 'flow-%' ORDER BY name LIMIT 1")
    now = await pool.fetchval("SELECT now()")
    firing, executions = FiringRepository(pool), RunRepository(pool)
    # Slots over the last 3 days (distinct microseconds): the batch's runs span several partitions.
    offset = int(time.time() * 1000) % 1000 + (0 if slots else 500)
    runs += WARM_BATCHES * batch
    when = [now - timedelta(days=3) * n / runs + timedelta(microseconds=offset + n) for n in range(runs)]
    queued = []
    for start in range(0, runs, 1000):
        queued += await firing.trigger(job, Trigger.MANUAL, when[start : start + 1000])
    claims_ms, completes_ms = [], []
    for n, start in enumerate(range(0, len(queued), batch)):
        chunk = queued[start : start + batch]
        if explain and n == WARM_BATCHES:
            print(f"({'with' if slots else 'without'} slots)", file=sys.stderr)
            _EXPLAIN.update(("claim", "complete"))
        began = time.perf_counter()
        claims = await executions.claim(
            [(run.run_id, f"t-{run.run_id}") for run in chunk],
            "bench",
            slots=[run.scheduled_for for run in chunk] if slots else (),
        )
        claims_ms.append((time.perf_counter() - began) * 1000)
        assert len(claims) == len(chunk), (len(claims), len(chunk))
        outcomes = [
            Outcome(
                c.execution_id, f"t-{c.run_id}", ExecutionStatus.SUCCEEDED, None, {"ok": 1},
                scheduled_for=c.scheduled_for if slots else None,
            )
            for c in claims
        ]  # fmt: skip
        began = time.perf_counter()
        done = await executions.complete(outcomes, resent=False)
        completes_ms.append((time.perf_counter() - began) * 1000)
        assert len(done) == len(outcomes), (len(done), len(outcomes))
    return {
        "claim_batch_ms": round(statistics.median(claims_ms[WARM_BATCHES:]), 2),
        "complete_batch_ms": round(statistics.median(completes_ms[WARM_BATCHES:]), 2),
    }


async def hot_paths(pool: asyncpg.Pool, runs: int, batch: int, explain: bool) -> dict[str, float]:
    figures = {}
    for slots in (True, False):
        measured = await hot_path(pool, runs, batch, slots=slots, explain=explain)
        suffix = "" if slots else "_without_slots"
        figures.update({f"{name}{suffix}": value for name, value in measured.items()})
    return figures


# The console's flow run page's read of its nodes (db/flow_views.py), by run id alone (before
# migration 0017) and with each node's slot (after it).
_FLOW_COLUMNS = "a.id, a.status, a.attempt, a.started_at, a.finished_at, a.error"
_FLOW_NODES = """SELECT n.job_id, j.name, n.run_id, x.* FROM flow_nodes n JOIN jobs j ON j.id = n.job_id
                 LEFT JOIN LATERAL {} x ON true WHERE n.flow_run_id = $1 ORDER BY j.name"""
FLOW_READS = {
    "flow page nodes, by run id": _FLOW_NODES.format(latest_attempt("n.run_id", _FLOW_COLUMNS)),
    "flow page nodes, with slots": _FLOW_NODES.format(
        latest_attempt("n.run_id", _FLOW_COLUMNS, slot="n.run_scheduled_for")
    ),
}


async def seed_flow(pool: asyncpg.Pool) -> None:
    """console_bench's 200-node flow and its finished flow run (its nodes without their slots:
    migration 0017 fills them)."""
    async with pool.acquire() as conn, conn.transaction():
        await conn.execute(SEED_FLOW, FLOW_NODES)
        await conn.execute(SEED_FLOW_RUN)
        await conn.execute(FINISH_FLOW_RUN.replace(", run_scheduled_for = runs.scheduled_for", ""))


async def flow_reads(pool: asyncpg.Pool, migrated: bool) -> dict[str, float]:
    flow = await pool.fetchval("SELECT id FROM flow_runs LIMIT 1")
    figures = {}
    async with pool.acquire() as conn:
        for name, sql in FLOW_READS.items():
            if "slots" in name and not migrated:
                continue
            statement = await conn.prepare(sql)
            times = []
            for n in range(60):
                began = time.perf_counter()
                rows = await statement.fetch(flow)
                if n >= 10:  # after the custom plans
                    times.append((time.perf_counter() - began) * 1000)
            assert len(rows) == FLOW_NODES
            assert all(row["id"] is not None for row in rows)
            figures[name] = round(statistics.median(times), 3)
    return figures


async def reads(pool: asyncpg.Pool, explain: bool) -> dict[str, Any]:
    sample = await pool.fetchrow(
        "SELECT id, created_at, job_id FROM job_executions ORDER BY created_at DESC OFFSET 500000 LIMIT 1"
    ) or await pool.fetchrow("SELECT id, created_at, job_id FROM job_executions LIMIT 1")
    assert sample is not None
    figures: dict[str, Any] = {}
    async with pool.acquire() as conn:
        for name, (sql, columns) in READS.items():
            args = [sample[column] for column in columns]
            statement = await conn.prepare(sql)
            times = []
            for _ in range(50):
                began = time.perf_counter()
                await statement.fetch(*args)
                times.append((time.perf_counter() - began) * 1000)
            figures[name] = round(statistics.median(times), 3)
            if explain:
                plan = await conn.fetch(f"EXPLAIN (ANALYZE, BUFFERS, COSTS OFF) {sql}", *args)
                print(f"-- {name}\n" + "\n".join(row[0] for row in plan), file=sys.stderr)
    return figures


async def main(args: argparse.Namespace, server_url: str) -> dict[str, Any]:
    admin = await asyncpg.connect(server_url)
    try:
        await admin.execute(f'DROP DATABASE IF EXISTS "{DATABASE}" WITH (FORCE)')
        await admin.execute(f'CREATE DATABASE "{DATABASE}"')
    finally:
        await admin.close()
    url = server_url.rsplit("/", 1)[0] + "/" + DATABASE
    pool = await create_pool(url, size=2, connect_timeout=timedelta(seconds=300))
    pool.__class__ = _ExplainingPool
    shipped = migrations.available()
    figures: dict[str, Any] = {"history": args.history, "days": args.days}
    try:
        migrations.available = lambda: [m for m in shipped if m.version < 16]
        await migrate(pool)
        began = time.perf_counter()
        await pool.execute(SEED_JOBS, args.jobs, list(HANDLERS), list(QUEUES), timeout=600)
        await pool.execute(SEED_HISTORY, args.history, args.jobs, timeout=3600)
        # Spread the slots (one second apart as seeded) over --days days, keeping their order.
        stretch = max(1.0, args.days * 86400 / args.history)
        await pool.execute(
            "UPDATE job_executions SET scheduled_for = now() - (now() - scheduled_for) * $1,"
            " due_at = now() - (now() - due_at) * $1, created_at = now() - (now() - created_at) * $1",
            stretch,
            timeout=3600,
        )
        await seed_flow(pool)
        await pool.execute("VACUUM ANALYZE job_executions", timeout=3600)
        figures["seed_s"] = round(time.perf_counter() - began, 1)
        print(f"seeded {args.history:,} rows in {figures['seed_s']} s", file=sys.stderr, flush=True)

        figures["before"] = (
            await hot_paths(pool, args.runs, args.batch, False)
            | await reads(pool, explain=False)
            | await flow_reads(pool, migrated=False)
        )
        before = await pool.fetchrow(CHECKSUM)

        migrations.available = lambda: shipped
        began = time.perf_counter()
        applied = await migrate(pool)
        figures["migration_s"] = round(time.perf_counter() - began, 1)
        assert applied == [m.version for m in shipped if m.version >= 16], applied
        after = await pool.fetchrow(CHECKSUM)
        assert before is not None
        assert after is not None
        figures["rows_before"], figures["rows_after"] = before["rows"], after["rows"]
        figures["every_row_kept"] = tuple(before) == tuple(after)
        figures["partitions"] = await pool.fetchval(
            "SELECT count(*) FROM pg_inherits WHERE inhparent = 'job_executions'::regclass"
        )
        print(f"migration 0016: {figures['migration_s']} s", file=sys.stderr, flush=True)
        figures["after"] = (
            await hot_paths(pool, args.runs, args.batch, True)
            | await reads(pool, explain=True)
            | await flow_reads(pool, migrated=True)
        )
    finally:
        await pool.close()
    return figures


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--history", type=int, default=1_000_000)
    parser.add_argument("--jobs", type=int, default=1000)
    parser.add_argument("--days", type=int, default=30)
    parser.add_argument("--runs", type=int, default=2000)
    parser.add_argument("--batch", type=int, default=200)
    args = parser.parse_args()
    with servers() as urls:
        result = uvloop.run(main(args, urls.database_url))
    print(json.dumps(result, indent=2, default=str))
    if not result["every_row_kept"]:
        sys.exit(1)


if __name__ == "__main__":
    cli()
