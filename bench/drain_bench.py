"""End-to-end drain with full history, beside the raw queue and PostgreSQL floors measured right before.

    .venv/bin/python bench/drain_bench.py [--runs 50000] [--concurrency 200]

Uses REDIS_URL / DATABASE_URL (embedded servers when unset; flushes that Redis database and
truncates the job tables). Measures the floors of bench/floors.py `queue` first (raw Lua
ZPOPMIN+ZADD dequeue, raw `UPDATE ... FROM unnest`), then queues `--runs` runs of a `test.echo`
job (1,000 per statement and enqueue script), starts one worker process and waits until PostgreSQL
records every run `succeeded`. Figures (one JSON line at the end):

* executions/s: runs / (last finished_at - first started_at), from PostgreSQL's own timestamps;
* CPU µs per execution of the worker, Valkey and PostgreSQL (utime+stime from /proc over the
  drain; PostgreSQL's is the postmaster's process tree, so it includes this script's polling
  count, a few ms a second); a server not on this machine gives null. The window opens when the
  worker is up (its first heartbeat, polled every 2 ms): its start (interpreter, imports,
  connections; ~1 s of CPU, a fixed cost that would add ~50 µs per execution to a 20,000-run
  drain) is reported apart, as worker_startup_cpu_s.

With `--tracing`, every run is made with a trace (`job_executions.trace_context`, as a traced
trigger records it) and the worker runs with OpenTelemetry on (`OTEL_TRACES_EXPORTER=otlp`),
exporting to an OTLP sink in this process that counts the spans and drops them: the figures are
the drain's cost with tracing on (span creation, batching, encoding and sending; spans_exported
says how many arrived).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import grpc
import uvloop
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from benchlib import servers  # noqa: E402
from floors import (  # noqa: E402
    lua_dequeue_floor,
    pg_update_floor,
    postgres_pid,
    proc_cpu_seconds,
    tree_cpu_seconds,
    valkey_pid,
)

from scheduler_grpc.connections import redis_client  # noqa: E402
from scheduler_grpc.control import Control  # noqa: E402
from scheduler_grpc.db.firing import FiringRepository  # noqa: E402
from scheduler_grpc.db.migrate import migrate  # noqa: E402
from scheduler_grpc.db.pool import create_pool  # noqa: E402
from scheduler_grpc.dispatch import Queues, enqueue_runs  # noqa: E402
from scheduler_grpc.executions import Trigger  # noqa: E402
from scheduler_grpc.handlers import HandlerSettings, default_registry  # noqa: E402
from scheduler_grpc.jobs import JobSpec, RetryPolicy  # noqa: E402
from scheduler_grpc.keys import WorkerKeys  # noqa: E402

BATCH = 1000


class SpanSink(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP trace receiver that counts the spans it gets and keeps none."""

    def __init__(self) -> None:
        self.spans = 0

    async def Export(  # the generated service's method name
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: object
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        self.spans += sum(len(scope.spans) for resource in request.resource_spans for scope in resource.scope_spans)
        return trace_service_pb2.ExportTraceServiceResponse()


async def main(args: argparse.Namespace, redis_url: str, database_url: str) -> dict[str, object]:
    pool = await create_pool(database_url, size=4, connect_timeout=timedelta(seconds=10))
    await migrate(pool)
    await pool.execute("TRUNCATE job_executions, jobs CASCADE")
    redis = redis_client(redis_url)
    await redis.flushdb()
    figures: dict[str, object] = {}
    figures |= await lua_dequeue_floor(redis)
    figures |= await pg_update_floor(pool)
    print(f"floors: {figures}", file=sys.stderr)
    registry = default_registry(HandlerSettings())
    control = Control(redis, pool, registry)
    queues = Queues(redis)  # the bench enqueues its runs itself (no events)
    job = await control.create_job(JobSpec(name="drain", handler="test.echo", retry=RetryPolicy(max_retries=0)))
    base = datetime(2020, 1, 1, tzinfo=UTC)
    for start in range(0, args.runs, BATCH):
        slots = [base + timedelta(microseconds=i) for i in range(start, min(start + BATCH, args.runs))]
        runs = await FiringRepository(pool).trigger(job.id, Trigger.BACKFILL, slots)
        await enqueue_runs(queues, runs)
    tracing: dict[str, str] = {}
    sink = SpanSink()
    receiver = grpc.aio.server()
    if args.tracing:
        # One trace per run, as a traced trigger records it (the parent span id is made up).
        await pool.execute(
            """UPDATE job_executions SET trace_context =
                   '00-' || replace(gen_random_uuid()::text, '-', '') || '-' || substr(md5(id::text), 1, 16) || '-01'"""
        )
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(sink, receiver)  # type: ignore[no-untyped-call]
        port = receiver.add_insecure_port("127.0.0.1:0")
        await receiver.start()
        tracing = {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",
                   "OTEL_EXPORTER_OTLP_INSECURE": "true"}  # fmt: skip
    print(f"queued {args.runs} runs", file=sys.stderr)
    vpid, ppid = await valkey_pid(redis), await postgres_pid(pool)
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("SCHEDULER_", "OTEL_"))}, **tracing,
           "REDIS_URL": redis_url, "DATABASE_URL": database_url, "SCHEDULER_LOG_LEVEL": "WARNING",
           "SCHEDULER_METRICS_PORT": "0", **dict(setting.split("=", 1) for setting in args.set)}  # fmt: skip
    worker = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "scheduler_grpc", "worker", "--concurrency", str(args.concurrency), env=env, cwd=ROOT
    )
    try:
        # The worker beats as it takes its first batch: from then on its CPU is the drain's.
        up_by = time.monotonic() + 60
        while not await redis.zcard(WorkerKeys().index):
            if worker.returncode is not None or time.monotonic() > up_by:
                raise SystemExit("the worker did not start within 60 s")
            await asyncio.sleep(0.002)
        cpu0 = (proc_cpu_seconds(worker.pid), tree_cpu_seconds(vpid) if vpid else 0.0,
                tree_cpu_seconds(ppid) if ppid else 0.0)  # fmt: skip
        deadline = time.monotonic() + args.timeout
        while True:
            done = await pool.fetchval("SELECT count(*) FROM job_executions WHERE final_status = 'succeeded'")
            if done >= args.runs:
                break
            if worker.returncode is not None:
                raise SystemExit(f"the worker exited with {worker.returncode}")
            if time.monotonic() > deadline:
                raise SystemExit(f"only {done} of {args.runs} runs done after {args.timeout:g}s")
            await asyncio.sleep(0.25)
        cpu = (proc_cpu_seconds(worker.pid) - cpu0[0], tree_cpu_seconds(vpid) - cpu0[1] if vpid else None,
               tree_cpu_seconds(ppid) - cpu0[2] if ppid else None)  # fmt: skip
        row = await pool.fetchrow(
            """SELECT extract(epoch FROM max(finished_at) - min(started_at)) AS seconds,
                      count(*) AS runs FROM job_executions WHERE status = 'succeeded'"""
        )
        assert row is not None  # an aggregate always returns its row
        seconds = float(row["seconds"])
        n = int(row["runs"])
        figures |= {
            "runs": n,
            "drain_seconds": seconds,
            "executions_per_s": n / seconds,
            "worker_cpu_us": cpu[0] / n * 1e6,
            "worker_startup_cpu_s": cpu0[0],
            "valkey_cpu_us": None if cpu[1] is None else cpu[1] / n * 1e6,
            "postgres_cpu_us": None if cpu[2] is None else cpu[2] / n * 1e6,
            "tracing": args.tracing,
        }
    finally:
        if worker.returncode is None:
            worker.send_signal(signal.SIGTERM)
        await asyncio.wait_for(worker.wait(), 60)
        if args.tracing:
            figures["spans_exported"] = sink.spans  # the worker flushed its spans on exit
        await receiver.stop(None)
        await registry.aclose()
        await redis.aclose()
        await pool.close()
    return figures


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=50_000)
    parser.add_argument("--concurrency", type=int, default=200)
    parser.add_argument("--timeout", type=float, default=300.0, help="give up after this many seconds of drain")
    parser.add_argument("--set", action="append", default=[], metavar="SCHEDULER_X=VALUE",
                        help="a setting for the worker, e.g. SCHEDULER_WORKER_RESERVE_AHEAD=0")  # fmt: skip
    parser.add_argument("--tracing", action="store_true",
                        help="runs with traces, the worker with OpenTelemetry on (to an OTLP sink here)")  # fmt: skip
    arguments = parser.parse_args()
    with servers() as urls:
        print(json.dumps(uvloop.run(main(arguments, urls.redis_url, urls.database_url))))
