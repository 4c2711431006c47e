"""`python -m chaos [SCENARIO ...]` (`make chaos`): run the fault scenarios and print one table.

Exit status 1 if any scenario had a duplicate, a lost slot, a run never completed, a stuck run, a
write under a stale term, an unexpectedly dead role, or failed to run; 0 otherwise.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import uvloop

from chaos.harness import Outcome, Servers, run_scenario
from chaos.report import render
from chaos.scenarios import SCENARIOS
from chaos.servers import ChaosPostgres, ChaosRedis
from scheduler_grpc.embedded import sweep_stale_runs

ROOT = Path(__file__).resolve().parent.parent
log = logging.getLogger("chaos")


async def _main(names: list[str], work_dir: Path) -> list[Outcome]:
    chosen = [s for s in SCENARIOS if not names or s.name in names]
    thread = ThreadPoolExecutor(1, thread_name_prefix="chaos-servers")
    servers = Servers(ChaosRedis(work_dir / "valkey"), ChaosPostgres(work_dir / "postgres"), thread)
    outcomes: list[Outcome] = []
    try:
        await servers.run(servers.redis.start)
        await servers.run(servers.postgres.start)
        for scenario in chosen:
            log.info("=== %s: %s", scenario.name, scenario.description)
            outcome = await run_scenario(scenario, servers, work_dir)
            log.info("=== %s: %s in %.0fs", scenario.name, "ok" if outcome.ok else "FAILED", outcome.seconds)
            outcomes.append(outcome)
    finally:
        await servers.run(servers.postgres.stop)
        await servers.run(servers.redis.stop)
        thread.shutdown()
    return outcomes


def main(argv: list[str] | None = None) -> None:
    names = [s.name for s in SCENARIOS]
    parser = argparse.ArgumentParser(prog="python -m chaos", description=__doc__)
    parser.add_argument("scenarios", nargs="*", metavar="SCENARIO", help=f"run only these: {', '.join(names)}")
    parser.add_argument("--keep", action="store_true", help="keep the run directory (role logs) afterwards")
    args = parser.parse_args(argv)
    unknown = set(args.scenarios) - set(names)
    if unknown:
        parser.error(f"unknown scenario(s): {', '.join(sorted(unknown))}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    # The suite's own pool retries through the outages it causes: its reconnect warnings are noise.
    logging.getLogger("asyncpg").setLevel(logging.ERROR)
    root = Path(os.environ.get("SCHEDULER_DATA_DIR") or ROOT / ".data") / "chaos"
    root.mkdir(parents=True, exist_ok=True)
    sweep_stale_runs(root)
    work_dir = root / f"run-{os.getpid()}-{time.time_ns()}"
    work_dir.mkdir()
    (work_dir / "owner.pid").write_text(str(os.getpid()))
    began = time.monotonic()
    outcomes = uvloop.run(_main(args.scenarios, work_dir))
    print(render(outcomes, time.monotonic() - began))
    failed = [outcome for outcome in outcomes if not outcome.ok]
    if args.keep or failed:
        print(f"role logs: {work_dir}")
    else:
        shutil.rmtree(work_dir, ignore_errors=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
