"""The execution history at scale (issue 24): the worker's claim and completion, and retention of a
day, on a `--history`-row history (default 100,000,000), beside the same on `--floor` rows
(default 1,000,000) in the same run.

    .venv/bin/python bench/history_bench.py [--history 100000000] [--floor 1000000] [--days 30]
                                            [--jobs 1000] [--runs 2000] [--batch 200] [--loaders N]

Starts embedded PostgreSQL (or uses DATABASE_URL's server). For each size, the floor first: makes a
database of its own (`scheduler_history_bench`) migrated to head, lets the leader's code create the
days ahead (`PartitionRepository.create_ahead`), seeds `--jobs` cron jobs (console_bench's) and
generates that many finished attempts (console_bench's row shape and status mix, one job after the
other) straight into one partition per UTC day over the `--days` days before today, as fast as the
machine allows: `--loaders` connections (default: one per CPU), each taking one day at a time and
making its partition as the migrations' `job_executions_add_partition` does (a table LIKE the
parent, a CHECK of its range so that ATTACH need not scan it, ATTACH, the CHECK dropped, the
indexes named), with the rows loaded in between by one `INSERT ... SELECT generate_series` and the
table's indexes built afterwards (by definition from the parent's, with the names the migrations
give them, so ATTACH adopts them instead of building them under its lock), then `VACUUM (FREEZE,
ANALYZE)` of the day. The rows fill their pages whole: the table's `fillfactor = 40` (migration
0009, room for the claim's HOT update) is set after loading, so the reloption is the migrations'
but a finished day takes 2.5x less heap than one the hot path would have filled. Then checks the
schema: the parent and the DEFAULT partition as migrated, and every day's partition identical to
one `job_executions_add_partition` made (columns, constraints, indexes and their parents,
triggers, reloptions, bound; names with the day's suffix).

Then measures, as bench/partition_migration_bench.py does (its `hot_path`): `--runs` queued runs
of one job, their slots over the last 3 days (several partitions), claimed and completed through
`RunRepository` in batches of `--batch` with each run's slot, median ms per batch after 12 warm-up
batches, given as µs per execution; and retention (`PartitionRepository.drop_before`, under a
leader term, the leader's code path): the oldest day dropped (timed), then the next day, which
holds one open run (a manual trigger), kept (timed; the run and the day's rows checked after).
Reports the generation's rows/s and the database's size on disk, and drops the database.

Before the large size the free disk under the server's data directory (when it is on this machine)
is checked against the size the floor's bytes per row project: the run stops rather than fill the
disk. Prints one JSON line of figures (`floor_*`: the floor's).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import statistics
import sys
import time
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from pathlib import Path
from typing import Any

import asyncpg
import uvloop

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from benchlib import servers  # noqa: E402
from console_bench import HANDLERS, QUEUES, SEED_JOBS  # noqa: E402
from floors import proc_cpu_seconds  # noqa: E402
from partition_migration_bench import hot_path  # noqa: E402

from scheduler_grpc.db.executions import Queryable  # noqa: E402
from scheduler_grpc.db.firing import FiringRepository  # noqa: E402
from scheduler_grpc.db.leadership import LeadershipRepository  # noqa: E402
from scheduler_grpc.db.migrate import migrate  # noqa: E402
from scheduler_grpc.db.partitions import PartitionRepository, partition_name  # noqa: E402
from scheduler_grpc.db.pool import create_pool  # noqa: E402
from scheduler_grpc.executions import Trigger  # noqa: E402

DATABASE = "scheduler_history_bench"  # and DATABASE + "_floor"
SCOPE = "scheduler"
DAY = timedelta(days=1)

# One day's finished attempts, the n-th of the history ($1 the first n, $2 the count) at the day's
# start $3 + (n - $1) x $4: console_bench's row (SEED_HISTORY) and status mix by n, job n mod $5
# ($6: the jobs' ids by name; $7/$8: the handlers and queues, $9/$10 each job's index into them).
# The id is a UUIDv7 of the slot's millisecond, as `uuid_v7()` would have made it at the slot,
# with n in its random bits ($11: the slot's Unix ms at n = $1) (`gen_random_uuid()` per row
# would cost more than the rest of the row).
DAY_ROWS = """
INSERT INTO {table} (id, job_id, run_id, scheduled_for, attempt, status, trigger, due_at, priority, worker_id,
                     created_at, started_at, finished_at, error, handler, queue)
SELECT r.id, ($6::uuid[])[1 + r.job], r.id, r.slot, 1, r.status, 'schedule', r.slot, 0, 'worker-1', r.slot,
       r.slot + interval '40 milliseconds', r.slot + interval '240 milliseconds',
       CASE WHEN r.status <> 'succeeded' THEN 'failed on purpose' END,
       ($7::text[])[($9::int[])[1 + r.job]], ($8::text[])[($10::int[])[1 + r.job]]
FROM (
    SELECT g.slot, (m.n % $5)::int AS job,
           CASE WHEN m.n % 100 < 90 THEN 'succeeded' WHEN m.n % 100 < 96 THEN 'failed'
                WHEN m.n % 100 < 98 THEN 'timed_out' WHEN m.n % 100 < 99 THEN 'dead' ELSE 'cancelled' END AS status,
           encode(int8send((($11::bigint + ((g.i - 1) * $12::bigint) / 1000) << 16) | 28672 | (m.n & 4095))
                  || int8send(-9223372036854775808 | ((m.n * 2654435761) & 4611686018427387903)), 'hex')::uuid AS id
    FROM generate_series($3::timestamptz, $3::timestamptz + ($2 - 1) * $4::interval, $4::interval)
         WITH ORDINALITY AS g (slot, i),
         LATERAL (SELECT $1::bigint + g.i - 1 AS n) AS m
    OFFSET 0  -- each row's id and status made once, not once per use
) AS r
"""
# The parent's indexes (a partition's are made from their definitions) and the constraints that own
# them (primary key, unique: made as constraints, so ATTACH adopts them for the parent's).
PARENT_INDEXES = """
SELECT c.relname AS name, pg_get_indexdef(i.indexrelid) AS definition, k.conname,
       pg_get_constraintdef(k.oid) AS constraint
FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
LEFT JOIN pg_constraint k ON k.conindid = i.indexrelid AND k.conrelid = i.indrelid AND k.contype IN ('p', 'u')
WHERE i.indrelid = 'job_executions'::regclass ORDER BY c.relname
"""
# What makes a table what it is, one text per part (names and the bound as they are; see `signature`).
SIGNATURE = """
SELECT 'class ' || format('%s %s %s %s', c.relkind, c.relpersistence, c.reloptions, c.relispartition)
       || coalesce(' ' || pg_get_expr(c.relpartbound, c.oid), '') FROM pg_class c WHERE c.oid = $1::regclass
UNION ALL
SELECT format('column %s %s %s %s %s %s %s %s %s', a.attnum, a.attname, format_type(a.atttypid, a.atttypmod),
              a.attnotnull, pg_get_expr(d.adbin, d.adrelid), a.attgenerated, a.attstorage, a.attislocal,
              a.attinhcount)
FROM pg_attribute a LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
WHERE a.attrelid = $1::regclass AND a.attnum > 0 AND NOT a.attisdropped
UNION ALL
SELECT format('constraint %s %s %s local=%s inherited=%s valid=%s parent=%s', k.conname, k.contype,
              pg_get_constraintdef(k.oid), k.conislocal, k.coninhcount, k.convalidated, p.conname)
FROM pg_constraint k LEFT JOIN pg_constraint p ON p.oid = k.conparentid WHERE k.conrelid = $1::regclass
UNION ALL
SELECT format('index %s %s parent=%s', c.relname, pg_get_indexdef(i.indexrelid), p.relname)
FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
LEFT JOIN pg_inherits h ON h.inhrelid = i.indexrelid LEFT JOIN pg_class p ON p.oid = h.inhparent
WHERE i.indrelid = $1::regclass
UNION ALL
SELECT format('trigger %s %s %s internal=%s cloned=%s', t.tgname, pg_get_triggerdef(t.oid), t.tgenabled,
              t.tgisinternal, t.tgparentid <> 0)
FROM pg_trigger t WHERE t.tgrelid = $1::regclass
"""
SIZES = """
SELECT count(*) AS partitions, sum(pg_table_size(inhrelid))::bigint AS heap,
       sum(pg_indexes_size(inhrelid))::bigint AS indexes,
       pg_database_size(current_database()) AS database
FROM pg_inherits WHERE inhparent = 'job_executions'::regclass
"""


def _bounds(day: date) -> tuple[datetime, datetime]:
    low = datetime(day.year, day.month, day.day, tzinfo=UTC)
    return low, low + DAY


async def signature(conn: Queryable, table: str, day: date | None = None) -> list[str]:
    """The parts of `table`'s definition, sorted; with `day`, its partition's suffix and bound
    written as placeholders, so that two days' partitions compare equal when alike."""
    parts = [row[0] for row in await conn.fetch(SIGNATURE, table)]
    if day is not None:
        low, high = _bounds(day)
        suffix = partition_name(day).removeprefix("job_executions_")
        parts = [
            part.replace(f"{low:%Y-%m-%d %H:%M:%S}+00", "<low>").replace(f"{high:%Y-%m-%d %H:%M:%S}+00", "<high>")
            .replace(suffix, "<day>")
            for part in parts
        ]  # fmt: skip
    # The foreign key's internal triggers are named after their constraint's oid.
    return sorted(re.sub(r"RI_ConstraintTrigger_([ac])_\d+", r"RI_ConstraintTrigger_\1", part) for part in parts)


@dataclass(frozen=True)
class Jobs:
    """The generator's view of the jobs: their ids by name, each one's handler and queue."""

    ids: list[str]
    handlers: list[str]
    queues: list[str]
    handler_of: list[int]  # 1-based index into handlers, per job
    queue_of: list[int]


async def jobs_of(conn: asyncpg.Connection) -> Jobs:
    rows = await conn.fetch("SELECT id, handler, queue FROM jobs ORDER BY name")
    handlers = sorted({row["handler"] for row in rows})
    queues = sorted({row["queue"] for row in rows})
    return Jobs(
        [row["id"] for row in rows],
        handlers,
        queues,
        [handlers.index(row["handler"]) + 1 for row in rows],
        [queues.index(row["queue"]) + 1 for row in rows],
    )


# The indexes built after the load (a sorted build each), the others kept up by it, as measured for
# 1,000,000 rows in one day (one loader): 24 s, against 31 s keeping up all but the first three
# and 26 s building all twelve. Built: those whose keys run from the newest row down (created_at
# DESC: a load in time order would add each row at the left end of its range, where a page split
# leaves both halves half empty) and the (job_id, scheduled_for, attempt) key (its rows arrive
# spread over every job's range: a descent and a uniqueness probe each, into pages that outgrow the
# buffers). Kept up: those whose keys grow with time (one right edge each, as the hot path adds to
# them) and the partial ones that take no finished row.
BUILT_AFTER = frozenset((
    "job_executions_created_idx", "job_executions_handler_created_idx", "job_executions_final_status_created_idx",
    "job_executions_job_id_scheduled_for_attempt_key",
))  # fmt: skip


def own_index(index: asyncpg.Record, table: str, suffix: str) -> str:
    """The statement making one of the parent's indexes on the day's table `table`, named as
    migration 0016 names a partition's (the parent's name, then the day's suffix)."""
    own = f"{index['name']}_{suffix}"
    if index["conname"] is not None:
        return f'ALTER TABLE "{table}" ADD CONSTRAINT "{own}" {index["constraint"]}'
    definition: str = index["definition"]
    head = re.match(r"^CREATE (UNIQUE )?INDEX \S+ ON ONLY \S+ ", definition)
    assert head is not None, definition
    return f'CREATE {head[1] or ""}INDEX "{own}" ON "{table}" ' + definition[head.end() :]


@dataclass
class Loaded:
    """One day generated: its rows and where the time went."""

    day: date
    rows: int
    insert_s: float
    vacuum_s: float
    index_s: float
    attach_s: float


async def load_day(conn: asyncpg.Connection, day: date, first: int, count: int, jobs: Jobs) -> Loaded:
    """Make `day`'s partition with `count` finished attempts (the `first`-th of the history on)."""
    name = partition_name(day)
    suffix = name.removeprefix("job_executions_")
    low, high = _bounds(day)
    step = timedelta(microseconds=int(DAY / timedelta(microseconds=1)) // count)
    indexes = await conn.fetch(PARENT_INDEXES)
    began = time.perf_counter()
    async with conn.transaction():
        # As job_executions_add_partition (migration 0016) makes it; filled at fillfactor 100.
        await conn.execute(
            f'CREATE TABLE "{name}" (LIKE job_executions INCLUDING DEFAULTS INCLUDING CONSTRAINTS'
            " INCLUDING GENERATED INCLUDING STORAGE) WITH (fillfactor = 100)"
        )
        await conn.execute(
            f'ALTER TABLE "{name}" ADD CONSTRAINT "{name}_range"'
            f" CHECK (scheduled_for >= '{low.isoformat()}' AND scheduled_for < '{high.isoformat()}')"
        )
        for index in indexes:
            if index["name"] not in BUILT_AFTER:
                await conn.execute(own_index(index, name, suffix))
        status = await conn.execute(
            DAY_ROWS.format(table=f'"{name}"'),
            first, count, low, step, len(jobs.ids), jobs.ids, jobs.handlers, jobs.queues, jobs.handler_of,
            jobs.queue_of, int(low.timestamp() * 1000), step // timedelta(microseconds=1),
            timeout=None,
        )  # fmt: skip
        assert status == f"INSERT 0 {count}", status
    inserted = time.perf_counter()
    await conn.execute(f'VACUUM (FREEZE, ANALYZE) "{name}"', timeout=None)
    vacuumed = time.perf_counter()
    async with conn.transaction():
        await conn.execute(f'ALTER TABLE "{name}" SET (fillfactor = 40)')
        for index in indexes:
            if index["name"] in BUILT_AFTER:
                await conn.execute(own_index(index, name, suffix), timeout=None)
        indexed = time.perf_counter()
        await conn.execute(
            f'ALTER TABLE job_executions ATTACH PARTITION "{name}" FOR VALUES FROM'
            f" ('{low.isoformat()}') TO ('{high.isoformat()}')",
            timeout=None,
        )
        await conn.execute(f'ALTER TABLE "{name}" DROP CONSTRAINT "{name}_range"')
        await conn.execute("SELECT job_executions_name_indexes($1::regclass)", name)
    attached = time.perf_counter()
    return Loaded(day, count, inserted - began, vacuumed - inserted, indexed - vacuumed, attached - indexed)


async def generate(url: str, days: list[date], rows: int, loaders: int) -> tuple[dict[str, Any], dict[date, int]]:
    """`rows` finished attempts over `days`, one partition each, by `loaders` connections at once:
    the figures, and the rows of each day."""
    per_day, extra = divmod(rows, len(days))
    work: asyncio.Queue[tuple[date, int, int]] = asyncio.Queue()
    first = 0
    for index, day in enumerate(days):
        count = per_day + (1 if index < extra else 0)
        work.put_nowait((day, first, count))
        first += count
    loaded: list[Loaded] = []
    cpu: list[float | None] = []

    async def loader() -> None:
        conn = await asyncpg.connect(url)
        backend = await conn.fetchval("SELECT pg_backend_pid()")
        try:
            # Sorts in memory; one process per loader (the loaders already use the cores).
            await conn.execute("SET maintenance_work_mem = '512MB'; SET max_parallel_maintenance_workers = 0")
            jobs = await jobs_of(conn)
            while not work.empty():
                day, first, count = work.get_nowait()
                done = await load_day(conn, day, first, count, jobs)
                loaded.append(done)
                print(
                    f"  {day}: {done.rows:,} rows: insert {done.insert_s:.1f} s, vacuum {done.vacuum_s:.1f} s,"
                    f" indexes {done.index_s:.1f} s, attach {done.attach_s:.1f} s",
                    file=sys.stderr, flush=True,
                )  # fmt: skip
            try:  # the backend's CPU, when the server runs on this machine
                cpu.append(proc_cpu_seconds(backend))
            except OSError:
                cpu.append(None)
        finally:
            await conn.close()

    began = time.perf_counter()
    await asyncio.gather(*(loader() for _ in range(min(loaders, len(days)))))
    seconds = time.perf_counter() - began
    assert sum(done.rows for done in loaded) == rows
    figures = {
        "generate_s": round(seconds, 1),
        "generated_rows_per_s": round(rows / seconds),
        # Summed over the loaders (they overlap): where the time went.
        "generate_insert_s": round(sum(done.insert_s for done in loaded), 1),
        "generate_vacuum_s": round(sum(done.vacuum_s for done in loaded), 1),
        "generate_index_s": round(sum(done.index_s for done in loaded), 1),
        "generate_attach_s": round(sum(done.attach_s for done in loaded), 1),
        # PostgreSQL's CPU for it (the loaders' backends), the machine's cost whatever its load.
        "generate_cpu_s": None if None in cpu else round(sum(c for c in cpu if c is not None), 1),
    }
    if figures["generate_cpu_s"] is not None:
        figures["generate_cpu_us_per_row"] = round(figures["generate_cpu_s"] * 1e6 / rows, 1)
    return figures, {done.day: done.rows for done in loaded}


async def check_schema(conn: Queryable, reference: dict[str, list[str]], days: list[date]) -> None:
    """The parent and the DEFAULT partition as migrated; every day's partition (`days`: all of them)
    as the migrations' `job_executions_add_partition` made one."""
    for table, parts in reference.items():
        if table != "day":
            now = await signature(conn, table)
            assert now == parts, (table, sorted(set(now) ^ set(parts)))
    for day in days:
        parts = await signature(conn, partition_name(day), day)
        assert parts == reference["day"], (day, sorted(set(parts) ^ set(reference["day"])))


@dataclass
class History:
    """One size's database, generated and checked."""

    label: str  # "floor" or "history"
    rows: int
    database: str
    pool: asyncpg.Pool
    partitions: PartitionRepository
    term: int
    days: list[date]
    counts: dict[date, int]
    figures: dict[str, Any]


async def recreate(server_url: str, database: str, *, drop_only: bool = False) -> str:
    admin = await asyncpg.connect(server_url)
    try:
        await admin.execute(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')
        if not drop_only:
            await admin.execute(f'CREATE DATABASE "{database}"')
    finally:
        await admin.close()
    return server_url.rsplit("/", 1)[0] + "/" + database


async def make_history(server_url: str, label: str, database: str, rows: int, args: argparse.Namespace) -> History:
    """A database of its own, migrated to head, with `rows` generated and its schema checked."""
    url = await recreate(server_url, database)
    pool = await create_pool(url, size=2, connect_timeout=timedelta(seconds=300))
    try:
        await migrate(pool)
        term = await LeadershipRepository(pool).begin_term(SCOPE, "history-bench")
        assert term is not None
        partitions = PartitionRepository(pool, scope=SCOPE)
        await partitions.create_ahead(3, term=term.term)  # as the leader does: one day past the migration's
        await pool.execute(SEED_JOBS, args.jobs, list(HANDLERS), list(QUEUES))
        today: date = await pool.fetchval("SELECT (now() AT TIME ZONE 'UTC')::date")
        days = [today - DAY * back for back in range(args.days, 0, -1)]
        async with pool.acquire() as conn:
            await conn.execute("SET TIME ZONE 'UTC'")
            reference = {
                "job_executions": await signature(conn, "job_executions"),
                "job_executions_default": await signature(conn, "job_executions_default"),
                "day": await signature(conn, partition_name(today + DAY * 3), today + DAY * 3),  # create_ahead's
            }
            assert reference["day"] == await signature(conn, partition_name(today), today)  # the migration's
            empty = await conn.fetchval("SELECT pg_database_size(current_database())")

        print(f"{label}: generating {rows:,} rows over {len(days)} days ({days[0]} to {days[-1]})", file=sys.stderr)
        figures, counts = await generate(url, days, rows, args.loaders)
        print(f"{label}: generated in {figures['generate_s']} s, {figures['generated_rows_per_s']:,} rows/s, PostgreSQL"
              f" CPU {figures['generate_cpu_s']} s", file=sys.stderr, flush=True)  # fmt: skip

        async with pool.acquire() as conn:
            await conn.execute("SET TIME ZONE 'UTC'")
            began = time.perf_counter()
            present = await partitions.days()
            assert set(days) <= set(present), (days, present)
            await check_schema(conn, reference, present)
            figures["schema_check_s"] = round(time.perf_counter() - began, 1)
            figures["schema_identical"] = True
            sizes = await conn.fetchrow(SIZES)
        assert sizes is not None
        figures |= {
            "rows": rows,
            "days": len(days),
            "rows_per_day": rows // len(days),
            "partitions": sizes["partitions"],  # the DEFAULT's included
            "heap_gb": round(sizes["heap"] / 1e9, 2),
            "index_gb": round(sizes["indexes"] / 1e9, 2),
            "database_gb": round(sizes["database"] / 1e9, 2),
            "bytes_per_row": round((sizes["database"] - empty) / rows),
        }
        print(f"{label}: {figures['database_gb']} GB on disk ({figures['bytes_per_row']} bytes per row)",
              file=sys.stderr, flush=True)  # fmt: skip
    except BaseException:
        await pool.close()
        raise
    return History(label, rows, database, pool, partitions, term.term, days, counts, figures)


async def hot_paths(sizes: list[History], args: argparse.Namespace) -> None:
    """partition_migration_bench's claim and completion batches on each size, alternated `--rounds`
    times, which goes first changing each round (so that a change in the machine's load, or what
    the first leaves behind, falls on both): the median of each size's."""
    rounds: dict[str, list[dict[str, float]]] = {size.label: [] for size in sizes}
    for round_ in range(args.rounds):
        for size in sizes if round_ % 2 == 0 else sizes[::-1]:
            measured = await hot_path(size.pool, args.runs, args.batch, slots=True, explain=False)
            rounds[size.label].append(measured)
            print(f"{size.label} round {round_ + 1}: claim batch {measured['claim_batch_ms']} ms, completion batch"
                  f" {measured['complete_batch_ms']} ms", file=sys.stderr, flush=True)  # fmt: skip
    for size in sizes:
        claim = round(statistics.median(r["claim_batch_ms"] for r in rounds[size.label]), 2)
        complete = round(statistics.median(r["complete_batch_ms"] for r in rounds[size.label]), 2)
        size.figures |= {
            "claim_batch_ms": claim,
            "complete_batch_ms": complete,
            "claim_us": round(claim * 1000 / args.batch, 1),
            "complete_us": round(complete * 1000 / args.batch, 1),
            "claim_batch_ms_rounds": [r["claim_batch_ms"] for r in rounds[size.label]],
            "complete_batch_ms_rounds": [r["complete_batch_ms"] for r in rounds[size.label]],
        }


async def retention(size: History) -> None:
    """The oldest day dropped by the leader's retention, then the next one, holding an open run, kept."""
    pool, partitions, term, days, counts = size.pool, size.partitions, size.term, size.days, size.counts
    oldest, open_day = days[0], days[1]
    job = await pool.fetchval("SELECT id::text FROM jobs WHERE name NOT LIKE 'flow-%' ORDER BY name DESC LIMIT 1")
    slot = _bounds(open_day)[0] + timedelta(hours=12, microseconds=123)
    (run,) = await FiringRepository(pool).trigger(job, Trigger.MANUAL, [slot])
    held = await pool.fetchval(f'SELECT count(*) FROM "{partition_name(open_day)}"', timeout=None)

    # The runs the hot path made in that day, if it reaches back so far (by the unique index's
    # (job_id, scheduled_for): the day's own rows are not read before retention reads them).
    late = await pool.fetchval(
        "SELECT count(*) FROM job_executions WHERE job_id = (SELECT id FROM jobs WHERE name NOT LIKE 'flow-%'"
        " ORDER BY name LIMIT 1) AND scheduled_for >= $1 AND scheduled_for < $2 AND trigger = 'manual'",
        *_bounds(oldest),
    )

    # How the retention counts the day's rows (its one read of them): a plan, not run.
    plan = await pool.fetch(f'EXPLAIN SELECT count(*) FROM "{partition_name(oldest)}"')
    count_plan = " / ".join(
        found[1]
        for row in plan
        if (found := re.match(r"^\s*(?:->\s*)?([A-Z][A-Za-z ]+?)(?: on | using |  \()", row[0]))
    )

    began = time.perf_counter()
    dropped = await partitions.drop_before(_bounds(oldest)[1], term=term)
    drop_s = time.perf_counter() - began
    assert dropped.dropped == [oldest], dropped
    assert dropped.executions == counts[oldest] + late, (dropped.executions, counts[oldest], late)
    assert await pool.fetchval("SELECT to_regclass($1)", partition_name(oldest)) is None

    began = time.perf_counter()
    kept = await partitions.drop_before(_bounds(open_day)[1], term=term)
    keep_s = time.perf_counter() - began
    assert kept.kept_open == [open_day], kept
    assert not kept.dropped, kept
    status = await pool.fetchval(
        "SELECT status FROM job_executions WHERE id = $1 AND scheduled_for = $2", run.run_id, slot
    )
    assert status == "queued", status
    assert await pool.fetchval(f'SELECT count(*) FROM "{partition_name(open_day)}"', timeout=None) == held
    print(f"{size.label} retention: a day of {dropped.executions:,} rows ({count_plan}) dropped in {drop_s:.3f} s,"
          f" an open day kept in {keep_s:.3f} s", file=sys.stderr, flush=True)  # fmt: skip
    # What the count alone costs, on the next finished day (as cold: generated just after): the
    # retention's one read of a day's rows.
    began = time.perf_counter()
    await pool.fetchval(f'SELECT count(*) FROM "{partition_name(days[2])}"', timeout=None)
    count_s = time.perf_counter() - began
    size.figures |= {
        "retention_count_next_day_s": round(count_s, 3),
        "retention_day_s": round(drop_s, 3),
        "retention_day_rows": dropped.executions,
        "retention_count_plan": count_plan,
        "retention_kept_open_s": round(keep_s, 3),
        "open_day_kept": True,
    }


async def data_directory(server_url: str) -> str | None:
    """The server's data directory when it is on this machine (embedded, or a local server)."""
    if not re.search(r"@(127\.0\.0\.1|localhost|\[::1\])[:/]", server_url):
        return None
    conn = await asyncpg.connect(server_url)
    try:
        return str(await conn.fetchval("SHOW data_directory"))
    except asyncpg.InsufficientPrivilegeError:
        return None
    finally:
        await conn.close()


def free_disk(directory: str | None) -> int | None:
    try:
        return shutil.disk_usage(directory).free if directory else None
    except OSError:
        return None


async def main(args: argparse.Namespace, server_url: str) -> dict[str, Any]:
    directory = await data_directory(server_url)
    sizes: list[History] = []
    try:
        sizes.append(await make_history(server_url, "floor", DATABASE + "_floor", args.floor, args))
        floor = sizes[0].figures
        projected = floor["bytes_per_row"] * args.history
        room = free_disk(directory)
        print(f"projected: {projected / 1e9:.1f} GB on disk for {args.history:,} rows"
              + ("" if room is None else f", {room / 1e9:.1f} GB free"), file=sys.stderr, flush=True)  # fmt: skip
        if room is not None and projected * 1.1 + 4e9 > room:
            raise SystemExit(f"{args.history:,} rows would take ~{projected / 1e9:.0f} GB; {room / 1e9:.0f} GB free")
        sizes.append(await make_history(server_url, "history", DATABASE, args.history, args))
        sizes[1].figures["free_disk_gb_before"] = None if room is None else round(room / 1e9, 1)
        await hot_paths(sizes, args)
        for size in sizes:
            await retention(size)
    finally:
        for size in sizes:
            await size.pool.close()
        for database in (DATABASE + "_floor", DATABASE):
            await recreate(server_url, database, drop_only=True)
    floor, history = sizes[0].figures, sizes[1].figures
    return history | {f"floor_{key}": value for key, value in floor.items()} | {
        "batch": args.batch, "runs": args.runs, "rounds": args.rounds, "loaders": args.loaders
    }  # fmt: skip


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--history", type=int, default=100_000_000)
    parser.add_argument("--floor", type=int, default=1_000_000)
    parser.add_argument("--days", type=int, default=30)
    parser.add_argument("--jobs", type=int, default=1000)
    parser.add_argument("--runs", type=int, default=2000)
    parser.add_argument("--batch", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--loaders", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    if args.days < 3 or min(args.history, args.floor) < args.days:
        parser.error("--days must be at least 3 and each size at least one row a day")
    with servers() as urls:
        result = uvloop.run(main(args, urls.database_url))
    print(json.dumps(result))


if __name__ == "__main__":
    cli()
