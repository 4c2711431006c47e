"""The web console's page times with 10,000 jobs and 1,000,000 history rows.

    .venv/bin/python bench/console_bench.py [--jobs 10000] [--history 1000000] [--requests 40]

Starts embedded Valkey and PostgreSQL (or uses REDIS_URL / DATABASE_URL, in a database of its own,
`console_bench`, dropped first unless `--reuse` finds it at the same size), seeds `--jobs` cron
jobs and `--history` finished attempts spread over them and over the past (generated inside
PostgreSQL: INSERT ... SELECT generate_series) and a flow of 200 jobs with one finished flow run, then
serves the console in-process (`server.serve`, as `scheduler-grpc server` does) and asks each page
`--requests` times over HTTP, logged in as the admin. Prints p50 and p99 of each page's response time
(first byte to last, measured by the client in the same process), and the server process's CPU time
per request. The machine is shared: wall-clock figures are noisy; CPU time per request is steadier.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import re
import statistics
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from urllib.parse import urlencode, urlsplit, urlunsplit

import aiohttp
import asyncpg
import uvloop
from argon2 import PasswordHasher

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchlib import servers  # noqa: E402

from scheduler_grpc import config  # noqa: E402
from scheduler_grpc.connections import redis_client  # noqa: E402
from scheduler_grpc.db.migrate import migrate  # noqa: E402
from scheduler_grpc.db.pool import create_pool  # noqa: E402
from scheduler_grpc.server import serve  # noqa: E402

DATABASE = "console_bench"
HANDLERS = ("test.echo", "test.fail", "test.delay", "test.log")
QUEUES = ("default", "reports", "billing")

SEED_JOBS = """
INSERT INTO jobs (name, handler, payload, queue, schedule_kind, cron, next_run_time, priority)
SELECT 'job-' || lpad(n::text, 6, '0'), ($2::text[])[1 + n % 4], '{}'::jsonb, ($3::text[])[1 + n % 3], 'cron',
       '*/5 * * * *', now() + (n % 300) * interval '1 second', (n % 3) - 1
FROM generate_series(1, $1) AS n
"""
# One finished attempt per row, newest first by n; 90 % succeeded, the rest failed, timed out, dead
# or cancelled. scheduled_for steps back one second per row, so (job_id, scheduled_for) is unique.
SEED_HISTORY = """
WITH j AS (SELECT id, handler, queue, row_number() OVER (ORDER BY name) - 1 AS k FROM jobs),
     s AS (SELECT n, gen_random_uuid() AS u, now() - n * interval '1 second' AS slot,
                  CASE WHEN n % 100 < 90 THEN 'succeeded' WHEN n % 100 < 96 THEN 'failed'
                       WHEN n % 100 < 98 THEN 'timed_out' WHEN n % 100 < 99 THEN 'dead'
                       ELSE 'cancelled' END AS status
           FROM generate_series(1, $1) AS n)
INSERT INTO job_executions (id, job_id, run_id, scheduled_for, attempt, status, trigger, due_at, priority, worker_id,
                            created_at, started_at, finished_at, error, handler, queue)
SELECT s.u, j.id, s.u, s.slot, 1, s.status, 'schedule', s.slot, 0, 'worker-1', s.slot,
       s.slot + interval '40 milliseconds', s.slot + interval '240 milliseconds',
       CASE WHEN s.status <> 'succeeded' THEN 'failed on purpose' END, j.handler, j.queue
FROM s JOIN j ON j.k = s.n % $2
"""

# A flow of FLOW_NODES jobs ('flow-000' the root; then layers of ten, each node after two of the
# layer before) and one finished flow run of it: the flow run page's worst realistic case.
FLOW_NODES = 200
SEED_FLOW = """
WITH made AS (
    INSERT INTO jobs (name, handler, payload, queue, schedule_kind)
    SELECT 'flow-' || lpad(n::text, 3, '0'), 'test.echo', '{}'::jsonb, 'default', 'manual'
    FROM generate_series(0, $1 - 1) AS n
    RETURNING id, substr(name, 6)::int AS n
), edges AS (
    SELECT d.id AS job_id, u.id AS upstream_id, e.position
    FROM made d
    CROSS JOIN LATERAL (VALUES
        (CASE WHEN d.n <= 10 THEN 0 ELSE d.n - 10 END, 0),
        (CASE WHEN d.n <= 10 THEN 0 ELSE ((d.n - 11) / 10) * 10 + 1 + (d.n % 10) END, 1)
    ) AS e(upstream_n, position)
    JOIN made u ON u.n = e.upstream_n
    WHERE d.n > 0
)
INSERT INTO job_dependencies (job_id, upstream_id, position)
SELECT DISTINCT ON (job_id, upstream_id) job_id, upstream_id, position FROM edges
"""
# The root run (its insert starts the flow run: migration 0007's trigger), then one finished run
# per other node, every tenth of them dead with an error.
SEED_FLOW_RUN = """
INSERT INTO job_executions (id, job_id, run_id, scheduled_for, attempt, status, trigger, due_at, priority,
                            handler, queue)
SELECT u, j.id, u, now() - interval '1 hour', 1, 'queued', 'manual', now() - interval '1 hour', 0, 'test.echo',
       'default'
FROM jobs j, gen_random_uuid() AS u WHERE j.name = 'flow-000'
"""
FINISH_FLOW_RUN = """
WITH f AS (SELECT id FROM flow_runs f WHERE root_job_id = (SELECT id FROM jobs WHERE name = 'flow-000')),
nodes AS (
    SELECT n.job_id, gen_random_uuid() AS u, substr(j.name, 6)::int AS k
    FROM flow_nodes n JOIN jobs j ON j.id = n.job_id, f WHERE n.flow_run_id = f.id AND n.run_id IS NULL
), runs AS (
    INSERT INTO job_executions (id, job_id, run_id, scheduled_for, attempt, status, trigger, due_at, priority,
                                worker_id, started_at, finished_at, error, handler, queue)
    SELECT u, job_id, u, now() - interval '1 hour' + k * interval '1 second', 1,
           CASE WHEN k % 10 = 0 THEN 'dead' ELSE 'succeeded' END, 'upstream', now() - interval '1 hour', 0,
           'worker-1', now() - interval '1 hour' + k * interval '1 second',
           now() - interval '1 hour' + k * interval '1 second' + interval '200 milliseconds',
           CASE WHEN k % 10 = 0 THEN 'failed on purpose' END, 'test.echo', 'default'
    FROM nodes RETURNING job_id, run_id, scheduled_for
)
UPDATE flow_nodes n SET run_id = runs.run_id, run_scheduled_for = runs.scheduled_for
FROM runs, f WHERE n.flow_run_id = f.id AND n.job_id = runs.job_id
"""


async def seed_flow(url: str) -> None:
    """The 200-node flow and its finished flow run, once per database (kept by --reuse)."""
    conn = await asyncpg.connect(url)
    try:
        if await conn.fetchval("SELECT count(*) FROM jobs WHERE name = 'flow-000'"):
            return
        async with conn.transaction():
            await conn.execute(SEED_FLOW, FLOW_NODES)
            await conn.execute(SEED_FLOW_RUN)
            await conn.execute(FINISH_FLOW_RUN)
            await conn.execute(
                """UPDATE job_executions SET status = 'succeeded', worker_id = 'worker-1',
                          started_at = now() - interval '1 hour', finished_at = now() - interval '1 hour'
                   WHERE id = (SELECT id FROM flow_runs)"""
            )
            await conn.execute("UPDATE flow_runs SET state = 'failed', finished_at = now()")
    finally:
        await conn.close()


async def migrate_connection(url: str) -> None:
    """Apply migrations added since the data was seeded (their indexes are what is measured)."""
    pool = await create_pool(url, size=1, connect_timeout=timedelta(seconds=10))
    try:
        await migrate(pool)
    finally:
        await pool.close()


def _with_database(url: str, database: str) -> str:
    return urlunsplit(urlsplit(url)._replace(path="/" + database))


async def seed(admin_url: str, jobs: int, history: int, *, reuse: bool) -> str:
    url = _with_database(admin_url, DATABASE)
    if reuse:
        try:
            conn = await asyncpg.connect(url)
        except asyncpg.InvalidCatalogNameError:
            pass
        else:
            try:
                await migrate_connection(url)
                # Less the flow's jobs and runs (`seed_flow`), which the sizes do not count.
                counts = await conn.fetchrow(
                    """SELECT (SELECT count(*) FROM jobs WHERE name NOT LIKE 'flow-%') AS j,
                              (SELECT count(*) FROM job_executions) - (SELECT count(*) FROM flow_nodes) AS e"""
                )
            finally:
                await conn.close()
            if counts is not None and (counts["j"], counts["e"]) == (jobs, history):
                print(f"reusing {DATABASE}: {jobs:,} jobs and {history:,} history rows", flush=True)
                return url
    conn = await asyncpg.connect(admin_url)
    try:
        await conn.execute(f'DROP DATABASE IF EXISTS "{DATABASE}" WITH (FORCE)')
        await conn.execute(f'CREATE DATABASE "{DATABASE}"')
    finally:
        await conn.close()
    pool = await create_pool(url, size=2, connect_timeout=timedelta(seconds=10))
    try:
        await migrate(pool)
        started = time.monotonic()
        await pool.execute(SEED_JOBS, jobs, list(HANDLERS), list(QUEUES), timeout=600)
        await pool.execute(SEED_HISTORY, history, jobs, timeout=3600)
        await pool.execute("VACUUM ANALYZE jobs", timeout=600)
        await pool.execute("VACUUM ANALYZE job_executions", timeout=600)
        print(f"seeded {jobs:,} jobs and {history:,} history rows in {time.monotonic() - started:.0f} s", flush=True)
    finally:
        await pool.close()
    return url


async def pages(pool: asyncpg.Pool, history: int, jobs: int) -> list[tuple[str, str]]:
    job = await pool.fetchrow(
        "SELECT id, name FROM jobs WHERE name NOT LIKE 'flow-%' ORDER BY name OFFSET $1 LIMIT 1", jobs // 2
    )
    flow = await pool.fetchval("SELECT id FROM flow_runs ORDER BY created_at DESC LIMIT 1")
    flow_job = await pool.fetchval("SELECT id FROM jobs WHERE name = 'flow-105'")
    execution = await pool.fetchrow(
        "SELECT id, created_at FROM job_executions ORDER BY created_at DESC OFFSET $1 LIMIT 1", history // 2
    )
    assert job is not None
    assert execution is not None
    now = datetime.now(UTC)
    window = urlencode(
        {"since": (now - timedelta(hours=13)).isoformat(), "until": (now - timedelta(hours=12)).isoformat()}
    )
    deep = urlencode({"before": f"{execution['created_at'].isoformat()}_{execution['id']}"})
    return [
        ("overview", "/"),
        ("jobs", "/jobs"),
        ("jobs, search", "/jobs?q=04242"),
        ("jobs, handler+state", "/jobs?handler=test.fail&state=active"),
        ("jobs, queue", "/jobs?queue=reports"),
        ("jobs, middle page", f"/jobs?after={job['name']}"),
        ("job detail", f"/jobs/{job['id']}"),
        ("job edit form", f"/jobs/{job['id']}/edit"),
        ("executions", "/executions"),
        ("executions, job", f"/executions?job={job['id']}"),
        ("executions, state=dead", "/executions?state=dead"),
        ("executions, state=queued", "/executions?state=queued"),
        ("executions, handler", "/executions?handler=test.log"),
        ("executions, time range", f"/executions?{window}"),
        ("executions, deep page", f"/executions?{deep}"),
        ("executions, job name", "/executions?job_name=job-0042"),
        ("executions, error text", "/executions?error=on+purpose"),
        ("executions, rare error text", "/executions?error=no+such+error"),
        ("executions, name+error+state", "/executions?job_name=job-0042&error=purpose&state=failed"),
        ("execution detail", f"/executions/{execution['id']}"),
        ("flow run, 200 nodes", f"/flows/{flow}"),
        ("flow run graph (live part)", f"/flows/{flow}/graph"),
        ("flow runs", "/flows"),
        ("flow runs, state=failed", "/flows?state=failed"),
        ("job detail, flow node", f"/jobs/{flow_job}"),
        ("workers", "/workers"),
        ("dead letters", "/dead-letters"),
        ("dead letters, search", "/dead-letters?queue=reports&job_name=job-004&error=purpose"),
        ("charts, hour", "/charts"),
        ("charts, day", "/charts?window=day"),
        ("charts, day, queue", "/charts?window=day&queue=reports"),
        ("API keys", "/api-keys"),
        ("schedule preview (JSON)", "/api/preview?cron=30+2+*+*+*&time_zone=Europe/Paris"),
    ]


async def measure(redis_url: str, database_url: str, args: argparse.Namespace) -> None:
    settings = config.load(
        {"REDIS_URL": redis_url, "DATABASE_URL": database_url, "SCHEDULER_GRPC_PORT": "0", "SCHEDULER_HTTP_PORT": "0"},
        {},
    )
    pool = await create_pool(database_url, size=10, connect_timeout=timedelta(seconds=10))
    redis = redis_client(redis_url)
    await redis.flushdb()
    try:
        async with serve(settings, redis, pool, hasher=PasswordHasher(time_cost=1, memory_cost=1024)) as server:
            assert server.console_url is not None
            base = server.console_url.rstrip("/")
            async with aiohttp.ClientSession(base, cookie_jar=aiohttp.CookieJar(unsafe=True)) as http:
                async with http.get("/login") as page:  # the form's pre-session token (and its cookie)
                    found = re.search(r'name="login_token" value="([^"]+)"', await page.text())
                    assert found is not None
                form = {"username": "admin", "password": "admin123", "login_token": found.group(1)}
                async with http.post("/login", data=form) as reply:
                    assert reply.status == 200, reply.status
                rows = []
                for name, path in await pages(pool, args.history, args.jobs):
                    async with http.get(path) as reply:  # warm: templates compiled, plans cached
                        assert reply.status == 200, (path, reply.status, (await reply.text())[:500])
                        await reply.read()
                    times = []
                    cpu = time.process_time()
                    for _ in range(args.requests):
                        start = time.perf_counter()
                        async with http.get(path) as reply:
                            await reply.read()
                            assert reply.status == 200, path
                        times.append((time.perf_counter() - start) * 1000)
                    cpu_ms = (time.process_time() - cpu) * 1000 / args.requests
                    times.sort()
                    p99 = times[min(len(times) - 1, round(0.99 * (len(times) - 1)))]
                    rows.append((name, statistics.median(times), p99, cpu_ms))
                    print(
                        f"  {name:<28} p50 {rows[-1][1]:7.1f} ms  p99 {p99:7.1f} ms  cpu {cpu_ms:6.1f} ms", flush=True
                    )
            if args.screenshots:
                await asyncio.to_thread(screenshots, base, args.screenshots)
        print()
        print("| page | p50 (ms) | p99 (ms) | process CPU per request (ms) |")
        print("| --- | ---: | ---: | ---: |")
        for name, p50, p99, cpu_ms in rows:
            print(f"| {name} | {p50:.1f} | {p99:.1f} | {cpu_ms:.1f} |")
    finally:
        await redis.aclose()
        await pool.close()


def screenshots(base: str, directory: Path) -> None:
    """The README's pictures: the overview, jobs, executions and charts pages, 1280x800, in headless Chromium."""
    import shutil

    from playwright.sync_api import sync_playwright

    directory.mkdir(parents=True, exist_ok=True)
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking"]
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=shutil.which("chromium"), args=flags)
        page = browser.new_page(viewport={"width": 1280, "height": 800})
        page.goto(f"{base}/login")
        page.fill("input[name=username]", "admin")
        page.fill("input[name=password]", "admin123")
        page.click("button[type=submit]")
        page.wait_for_selector("#leader")
        page.screenshot(path=str(directory / "console-overview.png"))
        page.goto(f"{base}/jobs")
        page.screenshot(path=str(directory / "console-jobs.png"))
        page.goto(f"{base}/executions?state=failed")
        page.screenshot(path=str(directory / "console-executions.png"))
        page.goto(f"{base}/charts?window=day")
        page.screenshot(path=str(directory / "console-charts.png"))
        browser.close()


async def main(args: argparse.Namespace, redis_url: str, admin_url: str) -> None:
    url = await seed(admin_url, args.jobs, args.history, reuse=args.reuse)
    await seed_flow(url)
    await measure(redis_url, url, args)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=10_000)
    parser.add_argument("--history", type=int, default=1_000_000)
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--reuse", action="store_true", help="keep a console_bench database of the same size")
    parser.add_argument("--screenshots", type=Path, help="also save the README's screenshots in this directory")
    arguments = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    with servers() as urls:
        uvloop.run(main(arguments, urls.redis_url, urls.database_url))
