"""PostgreSQL's cost of the worker's hot path (claim, complete) on a table with a long history.

    .venv/bin/python bench/pg_hotpath_bench.py [--history 1000000] [--runs 20000] [--batch 200] [--explain]

Starts embedded PostgreSQL (or uses DATABASE_URL), seeds `--history` finished attempts
(bench/console_bench.py's generator; a database already holding exactly that many rows is reused,
since seeding a million takes minutes), queues `--runs` runs of one job, then claims and completes
them in batches of `--batch` through `RunRepository` with their slots, as the worker does (no
Redis, no handler). Per execution and per statement kind: PostgreSQL CPU µs (its process tree,
from /proc; the machine's load inflates it, so compare the ratio to the `UPDATE ... FROM unnest`
floor measured first), WAL bytes
(pg_current_wal_lsn), and how many row updates were HOT (pg_stat_user_tables; its counters lag up
to a second). With `--explain`, prints EXPLAIN (ANALYZE, BUFFERS, WAL) of one claim batch and one
complete batch halfway through (both rolled back).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import uvloop

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from benchlib import servers  # noqa: E402
from console_bench import HANDLERS, QUEUES, SEED_HISTORY, SEED_JOBS  # noqa: E402
from floors import pg_update_floor, postgres_pid, tree_cpu_seconds  # noqa: E402

from scheduler_grpc.db.executions import Outcome  # noqa: E402
from scheduler_grpc.db.firing import FiringRepository  # noqa: E402
from scheduler_grpc.db.jobs import JobRepository  # noqa: E402
from scheduler_grpc.db.migrate import migrate  # noqa: E402
from scheduler_grpc.db.pool import create_pool  # noqa: E402
from scheduler_grpc.db.runs import RunRepository  # noqa: E402
from scheduler_grpc.executions import ExecutionStatus, Trigger  # noqa: E402
from scheduler_grpc.jobs import JobSpec, RetryPolicy  # noqa: E402


async def _wal(pool: Any) -> int:
    return int(await pool.fetchval("SELECT pg_current_wal_lsn() - '0/0'::pg_lsn"))


async def _upd(pool: Any) -> tuple[int, int]:
    # Statistics reach the shared counters when a backend flushes them (at most ~1 s after commit).
    await asyncio.sleep(1.2)
    # Summed over the partitions (migration 0016): the partitioned table has no rows of its own.
    row = await pool.fetchrow(
        """SELECT coalesce(sum(n_tup_upd), 0), coalesce(sum(n_tup_hot_upd), 0) FROM pg_stat_user_tables
           WHERE relid IN (SELECT inhrelid FROM pg_inherits WHERE inhparent = 'job_executions'::regclass)"""
    )
    return int(row[0]), int(row[1])


async def main(args: argparse.Namespace, database_url: str) -> dict[str, object]:
    pool = await create_pool(database_url, size=2, connect_timeout=timedelta(seconds=300))
    figures: dict[str, object] = {}
    try:
        await migrate(pool)
        figures |= await pg_update_floor(pool)
        await pool.execute("DELETE FROM jobs WHERE name = 'probe'")
        seeded = await pool.fetchval("SELECT count(*) FROM job_executions")
        if seeded != args.history:  # a database seeded at this size is reused (seeding takes minutes)
            await pool.execute("TRUNCATE job_executions, jobs CASCADE")
            t0 = time.perf_counter()
            await pool.execute(SEED_JOBS, 1000, list(HANDLERS), list(QUEUES))
            if args.history:
                await pool.execute(SEED_HISTORY, args.history, 1000)
            print(f"seeded {args.history} history rows in {time.perf_counter() - t0:.0f}s", file=sys.stderr)
        repo = RunRepository(pool)
        job = await JobRepository(pool).create(
            JobSpec(name="probe", handler="test.echo", retry=RetryPolicy(max_retries=0)), None
        )
        base = datetime(2020, 1, 1, tzinfo=UTC)
        runs: list[str] = []
        slot_of: dict[str, datetime | None] = {}  # each run's slot, as its queue item gives it
        for start in range(0, args.runs, 1000):
            slots = [base + timedelta(microseconds=i) for i in range(start, min(start + 1000, args.runs))]
            made = await FiringRepository(pool).trigger(job.id, Trigger.BACKFILL, slots)
            runs += [q.run_id for q in made]
            slot_of.update((q.run_id, q.scheduled_for) for q in made)
        await pool.execute("VACUUM ANALYZE job_executions")
        await pool.execute("CHECKPOINT")
        ppid = await postgres_pid(pool)
        assert ppid is not None, "PostgreSQL must run on this machine"
        spent = {"claim": [0.0, 0], "complete": [0.0, 0]}  # CPU seconds, WAL bytes
        upd0 = await _upd(pool)
        explain_done = False
        for start in range(0, len(runs), args.batch):
            batch = runs[start : start + args.batch]
            items = [(run_id, uuid.uuid4().hex) for run_id in batch]
            explain = args.explain and not explain_done and start >= len(runs) // 2
            if explain:
                await _explain(pool, items, tokens_of=dict(items))
                explain_done = True
            # As the worker claims a dequeue's batch: with its one lease instant (whole ms).
            now = datetime.now(UTC)
            leased = now.replace(microsecond=now.microsecond // 1000 * 1000)
            cpu, wal = tree_cpu_seconds(ppid), await _wal(pool)
            claims = await repo.claim(
                items, "worker-probe", leased_at=[leased] * len(items), slots=[slot_of[run_id] for run_id in batch]
            )
            spent["claim"][0] += tree_cpu_seconds(ppid) - cpu
            spent["claim"][1] += await _wal(pool) - wal
            tokens = dict(items)
            outcomes = [
                Outcome(
                    c.execution_id,
                    tokens[c.run_id],
                    ExecutionStatus.SUCCEEDED,
                    None,
                    {"ok": True},
                    None,
                    scheduled_for=c.scheduled_for,
                )
                for c in claims
            ]
            cpu, wal = tree_cpu_seconds(ppid), await _wal(pool)
            done = await repo.complete(outcomes, resent=False)
            spent["complete"][0] += tree_cpu_seconds(ppid) - cpu
            spent["complete"][1] += await _wal(pool) - wal
            assert len(done) == len(batch), (len(claims), len(done))
        upd1 = await _upd(pool)
        n = len(runs)
        figures |= {
            "runs": n,
            "history": args.history,
            "claim_cpu_us": spent["claim"][0] / n * 1e6,
            "complete_cpu_us": spent["complete"][0] / n * 1e6,
            "pg_cpu_us": (spent["claim"][0] + spent["complete"][0]) / n * 1e6,
            "claim_wal_bytes": spent["claim"][1] / n,
            "complete_wal_bytes": spent["complete"][1] / n,
            "updates": upd1[0] - upd0[0],
            "hot_updates": upd1[1] - upd0[1],
        }
        figures["ratio_to_update_floor"] = float(figures["pg_cpu_us"]) / float(figures["pg_update_cpu_us"] or 1)  # type: ignore[arg-type]
    finally:
        await pool.close()
    return figures


class _Explaining:
    """A pool stand-in whose `fetch` prints EXPLAIN (ANALYZE, BUFFERS, WAL) of the statement instead
    of returning its rows (EXPLAIN ANALYZE runs it: callers roll back)."""

    def __init__(self, connection: Any) -> None:
        self._connection = connection

    def transaction(self) -> Any:  # a completion's savepoint (`RunRepository.complete`)
        return self._connection.transaction()

    async def fetch(self, sql: str, *args: Any) -> list[Any]:
        plan = await self._connection.fetch("EXPLAIN (ANALYZE, BUFFERS, WAL) " + sql, *args)
        print("\n".join(row[0] for row in plan), file=sys.stderr)
        return []


async def _explain(pool: Any, items: list[tuple[str, str]], tokens_of: dict[str, str]) -> None:
    """The plans of one claim and one completion of `items`, both rolled back."""
    async with pool.acquire() as connection:
        explaining = RunRepository(_Explaining(connection))  # type: ignore[arg-type]
        transaction = connection.transaction()
        await transaction.start()
        try:
            print("=== claim", file=sys.stderr)
            await explaining.claim(items, "worker-probe", leased_at=[datetime.now(UTC)] * len(items))
            await transaction.rollback()
            # The completion needs claimed rows: claim for real in the transaction, then explain.
            transaction = connection.transaction()
            await transaction.start()
            leased = [datetime.now(UTC)] * len(items)
            claims = await RunRepository(connection).claim(items, "worker-probe", leased_at=leased)
            outcomes = [
                Outcome(c.execution_id, tokens_of[c.run_id], ExecutionStatus.SUCCEEDED, None, {"ok": True}, None)
                for c in claims
            ]
            print("=== complete", file=sys.stderr)
            await explaining.complete(outcomes, resent=False)
        finally:
            await transaction.rollback()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--history", type=int, default=1_000_000)
    parser.add_argument("--runs", type=int, default=20_000)
    parser.add_argument("--batch", type=int, default=200)
    parser.add_argument("--explain", action="store_true")
    args = parser.parse_args()
    with servers() as urls:
        print(json.dumps(uvloop.run(main(args, urls.database_url))))
