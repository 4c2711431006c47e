"""Leader failover: kill -9 and graceful stop of the leader, time from the signal to the next slot fired.

    .venv/bin/python bench/failover_bench.py [--kills 10] [--stops 10] [--jobs 5]

Runs the chaos suite's own failover bodies (chaos/scenarios.py `leader_kill9`, `leader_sigterm`)
in one chaos scenario (chaos/harness.py: a fresh database on the given PostgreSQL, two scheduler
processes and one worker with the service's DEFAULT leader TTL, `--jobs` per-second cron jobs).
Each round signals the current leader, waits for a slot fired under a later term, and restarts the
signalled process as a standby. The chaos checker then measures, per signal, the time to the first
slot PostgreSQL recorded after it under a later term, and checks no slot was lost or duplicated.

Uses REDIS_URL / DATABASE_URL (embedded servers when unset); it FLUSHALLs that Redis. Prints one
JSON line: kill9_p50_s, kill9_p99_s, kill9_max_s, sigterm_p50_s, sigterm_p99_s, sigterm_max_s,
leader_ttl_s, violations.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import asyncpg
import uvloop

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchlib import servers  # noqa: E402

from chaos.harness import Scenario, Servers, Stage, run_scenario  # noqa: E402
from chaos.scenarios import DEFAULT_TTL_S, leader_kill9, leader_sigterm  # noqa: E402


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))] if ordered else float("nan")


async def drop_scenario_databases(database_url: str) -> None:
    """The chaos scenario made a database of its own on this server: drop it."""
    admin = await asyncpg.connect(database_url, timeout=10)
    try:
        names = await admin.fetch("SELECT datname FROM pg_database WHERE datname LIKE 'chaos_bench_failover_%'")
        for row in names:
            await admin.execute(f'DROP DATABASE IF EXISTS "{row["datname"]}" WITH (FORCE)')
    finally:
        await admin.close()


async def main(args: argparse.Namespace, redis_url: str, database_url: str, work_dir: Path) -> dict[str, Any]:
    async def body(stage: Stage) -> None:
        await leader_kill9(stage, args.kills)
        await leader_sigterm(stage, args.stops)

    scenario = Scenario("bench-failover", body, cron_jobs=args.jobs, schedulers=2, workers=1,
                        budget=60.0 * (args.kills + args.stops), description="failover bench")  # fmt: skip
    # The scenario only reads the servers' URLs (its bodies here never restart or fault a server).
    servers = Servers(SimpleNamespace(url=redis_url), SimpleNamespace(url=database_url), ThreadPoolExecutor(1))  # type: ignore[arg-type]
    try:
        outcome = await run_scenario(scenario, servers, work_dir)
    finally:
        servers.thread.shutdown()
        await drop_scenario_databases(database_url)
    if outcome.error:
        raise SystemExit(f"failover scenario failed: {outcome.error}")
    recovery = outcome.report.recovery
    kills = [value for value in recovery[: args.kills] if value is not None]
    stops = [value for value in recovery[args.kills :] if value is not None]
    return {
        "kill9_p50_s": percentile(kills, 0.5),
        "kill9_p99_s": percentile(kills, 0.99),
        "kill9_max_s": max(kills, default=float("nan")),
        "kill9_rounds": len(kills),
        "sigterm_p50_s": percentile(stops, 0.5),
        "sigterm_p99_s": percentile(stops, 0.99),
        "sigterm_max_s": max(stops, default=float("nan")),
        "sigterm_rounds": len(stops),
        "leader_ttl_s": DEFAULT_TTL_S,
        "violations": [f"{v.invariant}: {v.detail}" for v in outcome.report.violations],
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument("--stops", type=int, default=10)
    parser.add_argument("--jobs", type=int, default=5, help="per-second cron jobs running throughout")
    arguments = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(message)s", stream=sys.stderr)
    logging.getLogger("asyncpg").setLevel(logging.ERROR)
    work = Path(tempfile.mkdtemp(prefix="failover-bench-", dir=ROOT / ".data" if (ROOT / ".data").is_dir() else None))
    try:
        with servers() as urls:
            figures = uvloop.run(main(arguments, urls.redis_url, urls.database_url, work))
        print(json.dumps(figures))
    finally:
        shutil.rmtree(work, ignore_errors=True)
