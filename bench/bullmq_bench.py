"""Issue 25's race: our drain with full PostgreSQL history beside BullMQ's, in the same run, on the
same Valkey, alternated round by round.

    .venv/bin/python bench/bullmq_bench.py [--runs 20000] [--rounds 3] [--concurrency 200]

Uses REDIS_URL / DATABASE_URL (embedded servers when unset; flushes that Redis database and
truncates the job tables). BullMQ is installed by the bench itself (`npm ci` in bench/bullmq, the
versions of its package-lock.json) and runs in Node.js (bench/bullmq/drain.mjs). Each round drains
`--runs` no-op runs twice, first ours, then BullMQ's, each with one worker process of
`--concurrency` slots on a backlog queued before it starts:

* ours: `test.echo` runs of one job (triggered through `Control`, 1,000 at a time), one worker
  process; executions/s = runs / (last finished_at - first started_at), PostgreSQL's timestamps
  (limits_bench.py's `drain`);
* BullMQ: no-op jobs (`addBulk` of 1,000, BullMQ's defaults: completed jobs kept), one `Worker`;
  executions/s = runs / (last finishedOn - first processedOn), BullMQ's timestamps.

Per side the median executions/s and CPU per execution (worker + Valkey, and PostgreSQL for ours);
the ratio ours / BullMQ (issue 25: >= 1.05). The last line of output is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import uvloop

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from benchlib import log_dir, role_env, servers  # noqa: E402
from floors import postgres_pid, valkey_pid  # noqa: E402
from lateness_bench import Processes  # noqa: E402
from limits_bench import NO_RETRY, Drained, _median_known, drain  # noqa: E402

from scheduler_grpc.connections import redis_client  # noqa: E402
from scheduler_grpc.control import Control  # noqa: E402
from scheduler_grpc.db.migrate import migrate  # noqa: E402
from scheduler_grpc.db.pool import create_pool  # noqa: E402
from scheduler_grpc.handlers import HandlerSettings, default_registry  # noqa: E402
from scheduler_grpc.jobs import JobSpec  # noqa: E402

BULLMQ = ROOT / "bench" / "bullmq"


def install_bullmq() -> str:
    """`npm ci` in bench/bullmq unless its node_modules holds the locked BullMQ; its version."""
    lock = json.loads((BULLMQ / "package-lock.json").read_text())
    wanted = lock["packages"]["node_modules/bullmq"]["version"]
    installed = BULLMQ / "node_modules" / "bullmq" / "package.json"
    if not installed.exists() or json.loads(installed.read_text())["version"] != wanted:
        # --ignore-scripts: msgpackr's optional native build is not needed (it falls back to JS).
        subprocess.run(["npm", "ci", "--no-audit", "--no-fund", "--ignore-scripts"], cwd=BULLMQ, check=True,
                       stdout=subprocess.DEVNULL, timeout=600)  # fmt: skip
    return str(wanted)


def bullmq_drain(redis_url: str, runs: int, concurrency: int, vpid: int | None, timeout: float) -> dict[str, Any]:
    command = ["node", str(BULLMQ / "drain.mjs"), "--redis-url", redis_url, "--runs", str(runs),
               "--concurrency", str(concurrency)] + (["--valkey-pid", str(vpid)] if vpid else [])  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False)
    if done.returncode != 0:
        raise SystemExit(f"BullMQ's drain failed ({done.returncode}): {done.stderr.strip()[-500:]}")
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


async def race(args: argparse.Namespace, redis_url: str, database_url: str, log_dir: Path) -> dict[str, Any]:
    version = install_bullmq()
    pool = await create_pool(database_url, size=8, connect_timeout=timedelta(seconds=10))
    redis = redis_client(redis_url)
    registry = default_registry(HandlerSettings())
    try:
        await migrate(pool)
        await pool.execute("TRUNCATE job_executions, jobs, leader_state CASCADE")
        await redis.flushdb()
        control = Control(redis, pool, registry)
        servers_pids = (await valkey_pid(redis), await postgres_pid(pool))
        env = role_env(redis_url, database_url, SCHEDULER_WORKER_CONCURRENCY=str(args.concurrency))
        procs = Processes(env, log_dir)
        ours: list[Drained] = []
        theirs: list[dict[str, Any]] = []
        for round_ in range(args.rounds):
            job = await control.create_job(JobSpec(name=f"race-{round_}", handler="test.echo", retry=NO_RETRY))
            ours.append(await drain(pool, control, procs, job.id, runs=args.runs, name=f"worker-{round_}",
                                    within=args.timeout, servers_pids=servers_pids))  # fmt: skip
            theirs.append(bullmq_drain(redis_url, args.runs, args.concurrency, servers_pids[0], args.timeout))
            print(f"round {round_ + 1}: ours {ours[-1].executions_per_s:,.0f}/s, "
                  f"BullMQ {theirs[-1]['executions_per_s']:,.0f}/s", file=sys.stderr)  # fmt: skip
    finally:
        await registry.aclose()
        await redis.aclose()
        await pool.close()
    our_rate = statistics.median(d.executions_per_s for d in ours)
    their_rate = statistics.median(float(t["executions_per_s"]) for t in theirs)
    their_valkey = [float(t["valkey_cpu_us"]) for t in theirs if t.get("valkey_cpu_us") is not None]
    result = {
        "runs": args.runs, "rounds": args.rounds, "concurrency": args.concurrency, "bullmq": version,
        "ours_rates": [round(d.executions_per_s) for d in ours],
        "bullmq_rates": [round(float(t["executions_per_s"])) for t in theirs],
        "ours_executions_per_s": our_rate, "bullmq_executions_per_s": their_rate,
        "ratio": our_rate / their_rate,
        "ours_cpu_us": statistics.median(d.cpu_us for d in ours),
        "ours_worker_cpu_us": statistics.median(d.worker_cpu_us for d in ours),
        "ours_valkey_cpu_us": _median_known([d.valkey_cpu_us for d in ours]),
        "ours_postgres_cpu_us": _median_known([d.postgres_cpu_us for d in ours]),
        "bullmq_worker_cpu_us": statistics.median(float(t["worker_cpu_us"]) for t in theirs),
        "bullmq_valkey_cpu_us": statistics.median(their_valkey) if their_valkey else None,
        "bullmq_cpu_us": statistics.median(
            float(t["worker_cpu_us"]) + float(t.get("valkey_cpu_us") or 0.0) for t in theirs
        ),
    }  # fmt: skip
    print(f"median of {args.rounds}: ours {our_rate:,.0f}/s with history, BullMQ {version} {their_rate:,.0f}/s: "
          f"ratio {result['ratio']:.3f}", file=sys.stderr)  # fmt: skip
    return result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=20_000, help="runs per drain [20000]")
    parser.add_argument("--rounds", type=int, default=3, help="drains of each side [3]")
    parser.add_argument("--concurrency", type=int, default=200, help="slots of each worker [200]")
    parser.add_argument("--timeout", type=float, default=300.0, help="longest wait for one drain [300]")
    return parser.parse_args(argv)


if __name__ == "__main__":
    arguments = parse_args()
    with log_dir() as logs, servers() as urls:
        outcome = uvloop.run(race(arguments, urls.redis_url, urls.database_url, logs))
    print(json.dumps(outcome, sort_keys=True))
