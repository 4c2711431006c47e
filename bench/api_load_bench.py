"""gRPC API under load: many concurrent unary calls and streams against one server process.

    .venv/bin/python bench/api_load_bench.py [--calls 10000] [--streams 1000] [--channels 1]
    .venv/bin/python bench/api_load_bench.py --method TriggerJob [--callers 50] [--seconds 10]

Starts embedded Valkey and PostgreSQL (or uses REDIS_URL / DATABASE_URL), one `scheduler-grpc
server` process on a free loopback port, logs in as the dev admin, opens `--streams`
WatchExecutions streams, then fires `--calls` concurrent GetQueueStats calls (spread over
`--channels` channels, one connection each). Throughout, a prober (a process of its own, so this one's burst does not
delay it) calls health Check and an admin call (ListJobs) in a loop and records their latencies.
Prints calls/s, p50/p99/max, the status codes of every call and stream, the server's CPU time per
call, the probes' latencies, and the server's own count of calls by code (from /metrics).
Exits 1 if any call ended CANCELLED, INTERNAL or UNKNOWN.

`--method TriggerJob` (issue 11's figure) instead creates one `test.echo` job and has `--callers`
concurrent callers (over the same channels) trigger it back to back for `--seconds` (no streams,
no prober, no worker: the runs stay queued); it prints RPCs/s, p50/p99 and the CPU per call of the
server and of this client (`--json`: one JSON line: rps, p50_ms, p99_ms, errors, calls, CPU per
call). `--method HealthCheck` does the same with health Check calls: the floor of a call (gRPC and
the interceptors, no store) on the same machine in the same conditions.

`--method BatchTriggerJobs` (issue 25's figure) creates one `test.echo` job and has `--callers`
concurrent callers call BatchTriggerJobs back to back for `--seconds`, each call `--items` items
with a request id of its own (every item a new run); the figure is the runs recorded in PostgreSQL
per second (counted there at the end). Its floor, measured first on the same PostgreSQL: the raw
INSERT of the same runs (`INSERT ... SELECT FROM unnest`, `--items` rows per statement, `--callers`
connections, the job's snapshot and a request id each, and each request id's claim in
`execution_requests`: the rows the RPC writes, without its idempotency and missed-slot checks,
events, enqueue or gRPC), in rows/s; the tables are emptied after it.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import functools
import json
import os
import signal
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import grpc
import uvloop
from grpc_health.v1 import health_pb2, health_pb2_grpc

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from floors import postgres_pid, tree_cpu_seconds  # noqa: E402
from scheduler_client.v1 import (  # noqa: E402
    auth_pb2,
    auth_pb2_grpc,
    executions_pb2,
    executions_pb2_grpc,
    jobs_pb2,
    jobs_pb2_grpc,
    queue_pb2,
    queue_pb2_grpc,
)

from scheduler_grpc.db.executions import SNAPSHOT, new_execution_id, snapshot  # noqa: E402
from scheduler_grpc.db.migrate import migrate  # noqa: E402
from scheduler_grpc.db.pool import create_pool  # noqa: E402
from scheduler_grpc.embedded import embedded_servers, free_port  # noqa: E402

BAD_CODES = frozenset({"CANCELLED", "INTERNAL", "UNKNOWN"})


def percentile(values: list[float], share: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))]


def scrape(metrics_port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as response:
        return str(response.read().decode())


async def wait_serving(target: str, process: asyncio.subprocess.Process) -> None:
    async with grpc.aio.insecure_channel(target) as channel:
        health: Any = health_pb2_grpc.HealthStub(channel)  # its stubs do not declare Check
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if process.returncode is not None:
                raise SystemExit(f"the server exited with {process.returncode}")
            try:
                answer = await health.Check(health_pb2.HealthCheckRequest(), timeout=1)
                if answer.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.aio.AioRpcError:
                pass
            await asyncio.sleep(0.1)
    raise SystemExit("the server did not become SERVING within 60 s")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def trigger_load(args: argparse.Namespace, target: str, server_pid: int) -> int:
    """`--method TriggerJob` (or `HealthCheck`, the floor of a call): `--callers` concurrent callers
    call back to back for `--seconds`."""
    channels = [
        grpc.aio.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)]) for _ in range(args.channels)
    ]
    try:
        login = await auth_pb2_grpc.AuthServiceStub(channels[0]).Login(
            auth_pb2.LoginRequest(username="admin", password="admin123"), timeout=10
        )
        token = (("authorization", f"Bearer {login.token}"),)
        stubs = [jobs_pb2_grpc.JobServiceStub(channel) for channel in channels]
        job = await stubs[0].CreateJob(
            jobs_pb2.CreateJobRequest(job=jobs_pb2.Job(name=f"bench-{os.getpid()}", handler="test.echo")),
            metadata=token,
            timeout=10,
        )
        latencies: list[float] = []
        codes: collections.Counter[str] = collections.Counter()
        request = jobs_pb2.TriggerJobRequest(id=job.job.id)
        if args.method == "HealthCheck":
            checks: list[Any] = [health_pb2_grpc.HealthStub(channel) for channel in channels]
            calls = [functools.partial(check.Check, health_pb2.HealthCheckRequest(), timeout=60) for check in checks]
        else:
            calls = [functools.partial(stub.TriggerJob, request, metadata=token, timeout=60) for stub in stubs]
        stop = time.perf_counter() + args.seconds

        async def caller(i: int) -> None:
            call = calls[i % len(calls)]
            while time.perf_counter() < stop:
                began = time.perf_counter()
                try:
                    await call()
                    codes["OK"] += 1
                except grpc.aio.AioRpcError as error:
                    codes[error.code().name] += 1
                latencies.append(time.perf_counter() - began)

        began, cpu_before, own_before = time.perf_counter(), cpu_seconds(server_pid), time.process_time()
        await asyncio.gather(*(caller(i) for i in range(args.callers)))
        elapsed, server_cpu = time.perf_counter() - began, cpu_seconds(server_pid) - cpu_before
        client_cpu = time.process_time() - own_before
    finally:
        for channel in channels:
            await channel.close()
    done = len(latencies)
    figures = {
        "method": args.method, "callers": args.callers, "seconds": round(elapsed, 2), "calls": done,
        "rps": round(done / elapsed, 1), "p50_ms": round(percentile(latencies, 0.5) * 1000, 2),
        "p99_ms": round(percentile(latencies, 0.99) * 1000, 2), "errors": done - codes["OK"],
        "server_cpu_us_per_call": round(server_cpu / max(done, 1) * 1e6),
        "client_cpu_us_per_call": round(client_cpu / max(done, 1) * 1e6),
    }  # fmt: skip
    if args.json:
        print(json.dumps(figures), flush=True)
    else:
        print(f"{args.method} from {args.callers} concurrent callers for {elapsed:.1f}s over {args.channels} "
              f"channel(s): {figures['rps']:,.0f} RPCs/s, p50 {figures['p50_ms']:.1f} ms, "
              f"p99 {figures['p99_ms']:.1f} ms")  # fmt: skip
        print(f"codes: {dict(codes)}; CPU per call: server {figures['server_cpu_us_per_call']} us, "
              f"this client {figures['client_cpu_us_per_call']} us")  # fmt: skip
    return 1 if BAD_CODES & codes.keys() else 0


async def raw_insert_floor(database_url: str, job_id: str, callers: int, rows: int, seconds: float) -> float:
    """Rows/s of the bare INSERT of manual runs of `job_id`, `rows` per statement from `callers`
    connections for `seconds`; the rows are deleted afterwards."""
    columns = ", ".join(SNAPSHOT)
    # Each run and its request id's claim, written by one statement (as BatchTriggerJobs does, migration
    # 0020), in a transaction that tells the row trigger so.
    sql = f"""
        WITH u AS (SELECT * FROM unnest($1::uuid[], $2::timestamptz[], $4::text[]) AS u(id, slot, request_id)),
        claims AS (INSERT INTO execution_requests (job_id, request_id, run_id, scheduled_for)
                   SELECT $3, request_id, id, slot FROM u)
        INSERT INTO job_executions (id, run_id, job_id, scheduled_for, attempt, status, trigger, due_at, priority,
                                    request_id, {columns})
        SELECT u.id, u.id, j.id, u.slot, 1, 'queued', 'manual', now(), j.priority, u.request_id, {snapshot("j")}
        FROM u JOIN jobs j ON j.id = $3
    """  # fmt: skip
    pool = await create_pool(database_url, size=callers, connect_timeout=timedelta(seconds=5))
    inserted = 0
    try:
        stop = time.perf_counter() + seconds
        base = datetime.now(UTC)
        job = uuid.UUID(job_id)

        async def caller(i: int) -> None:
            nonlocal inserted
            n = 0
            while time.perf_counter() < stop:
                slots = [base + timedelta(microseconds=(n + k) * callers + i) for k in range(rows)]
                ids = [new_execution_id() for _ in range(rows)]
                async with pool.acquire() as conn, conn.transaction():
                    await conn.execute("SET LOCAL scheduler.request_claims = 'statement'")
                    await conn.execute(sql, ids, slots, job, [f"floor-{i}-{n + k}" for k in range(rows)])
                n += rows
                inserted += rows

        began = time.perf_counter()
        await asyncio.gather(*(caller(i) for i in range(callers)))
        elapsed = time.perf_counter() - began
        await pool.execute("TRUNCATE job_executions, execution_requests CASCADE")
    finally:
        await pool.close()
    return inserted / elapsed


async def batch_trigger_load(args: argparse.Namespace, target: str, server_pid: int, database_url: str) -> int:
    """`--method BatchTriggerJobs`: the raw INSERT floor, then `--callers` concurrent callers of
    `--items` items each, back to back for `--seconds`; runs/s counted in PostgreSQL."""
    channel = grpc.aio.insecure_channel(target, options=[("grpc.max_receive_message_length", 64 << 20)])
    try:
        login = await auth_pb2_grpc.AuthServiceStub(channel).Login(
            auth_pb2.LoginRequest(username="admin", password="admin123"), timeout=10
        )
        token = (("authorization", f"Bearer {login.token}"),)
        stub = jobs_pb2_grpc.JobServiceStub(channel)
        job = (
            await stub.CreateJob(
                jobs_pb2.CreateJobRequest(job=jobs_pb2.Job(name=f"bench-{os.getpid()}", handler="test.echo")),
                metadata=token,
                timeout=10,
            )
        ).job
        floor = await raw_insert_floor(database_url, job.id, args.callers, args.items, min(args.seconds, 5.0))
        latencies: list[float] = []
        codes: collections.Counter[str] = collections.Counter()
        items_ok = 0
        stop = time.perf_counter() + args.seconds
        prefix = uuid.uuid4().hex[:8]

        async def caller(i: int) -> None:
            nonlocal items_ok
            n = 0
            while time.perf_counter() < stop:
                request = jobs_pb2.BatchTriggerJobsRequest(
                    requests=[
                        jobs_pb2.TriggerJobRequest(id=job.id, request_id=f"{prefix}-{i}-{n + k}")
                        for k in range(args.items)
                    ]
                )
                n += args.items
                began = time.perf_counter()
                try:
                    answer = await stub.BatchTriggerJobs(request, metadata=token, timeout=60)
                    codes["OK"] += 1
                    items_ok += sum(1 for result in answer.results if result.code == 0)
                except grpc.aio.AioRpcError as error:
                    codes[error.code().name] += 1
                latencies.append(time.perf_counter() - began)

        pool = await create_pool(database_url, size=1, connect_timeout=timedelta(seconds=5))
        try:
            postgres = await postgres_pid(pool)
            pg_before = tree_cpu_seconds(postgres) if postgres else 0.0
            began, cpu_before = time.perf_counter(), cpu_seconds(server_pid)
            await asyncio.gather(*(caller(i) for i in range(args.callers)))
            elapsed, server_cpu = time.perf_counter() - began, cpu_seconds(server_pid) - cpu_before
            pg_cpu = tree_cpu_seconds(postgres) - pg_before if postgres else None
            recorded = int(await pool.fetchval("SELECT count(*) FROM job_executions WHERE trigger = 'manual'"))
        finally:
            await pool.close()
    finally:
        await channel.close()
    figures = {
        "method": args.method, "callers": args.callers, "items": args.items, "seconds": round(elapsed, 2),
        "calls": len(latencies), "errors": len(latencies) - codes["OK"], "items_ok": items_ok,
        "runs_recorded": recorded, "runs_per_s": round(recorded / elapsed, 1),
        "raw_insert_rows_per_s": round(floor, 1),
        "p50_ms": round(percentile(latencies, 0.5) * 1000, 2), "p99_ms": round(percentile(latencies, 0.99) * 1000, 2),
        "server_cpu_us_per_run": round(server_cpu / max(recorded, 1) * 1e6, 1),
        "postgres_cpu_us_per_run": None if pg_cpu is None else round(pg_cpu / max(recorded, 1) * 1e6, 1),
    }  # fmt: skip
    if args.json:
        print(json.dumps(figures), flush=True)
    else:
        print(f"BatchTriggerJobs of {args.items} items from {args.callers} concurrent callers for {elapsed:.1f}s: "
              f"{figures['runs_per_s']:,.0f} runs/s recorded ({recorded} runs, {items_ok} items OK), "
              f"call p50 {figures['p50_ms']:.1f} ms, p99 {figures['p99_ms']:.1f} ms; raw INSERT floor "
              f"{floor:,.0f} rows/s; CPU per run: server {figures['server_cpu_us_per_run']} us, "
              f"PostgreSQL {figures['postgres_cpu_us_per_run']} us; "
              f"codes {dict(codes)}")  # fmt: skip
    return 1 if BAD_CODES & codes.keys() or recorded != items_ok else 0


async def load(args: argparse.Namespace, target: str, metrics_port: int, server_pid: int) -> int:
    # A local subchannel pool per channel: otherwise channels to one target share one connection.
    channels = [
        grpc.aio.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)]) for _ in range(args.channels)
    ]
    try:
        login = await auth_pb2_grpc.AuthServiceStub(channels[0]).Login(
            auth_pb2.LoginRequest(username="admin", password="admin123"), timeout=10
        )
        token = (("authorization", f"Bearer {login.token}"),)
        stream_codes: collections.Counter[str] = collections.Counter()
        watch = executions_pb2_grpc.ExecutionServiceStub(channels[0])
        streams = [
            watch.WatchExecutions(executions_pb2.WatchExecutionsRequest(), metadata=token) for _ in range(args.streams)
        ]
        opened = time.perf_counter()
        await asyncio.gather(*(stream.initial_metadata() for stream in streams))
        print(f"{args.streams} WatchExecutions streams open in {time.perf_counter() - opened:.2f}s")

        # The prober is a process of its own: in this one, starting thousands of calls at once
        # stalls the event loop and would be counted against the server.
        prober = await asyncio.create_subprocess_exec(
            sys.executable, __file__, "--probe", target, "--token", login.token,
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        )  # fmt: skip
        assert prober.stdout is not None
        assert prober.stdin is not None
        await prober.stdout.readline()  # "probing": its first round is done
        latencies: list[float] = []
        codes: collections.Counter[str] = collections.Counter()
        stubs = [queue_pb2_grpc.QueueServiceStub(channel) for channel in channels]

        async def one(i: int) -> None:
            began = time.perf_counter()
            try:
                await stubs[i % len(stubs)].GetQueueStats(queue_pb2.GetQueueStatsRequest(), metadata=token, timeout=60)
                codes["OK"] += 1
            except grpc.aio.AioRpcError as error:
                codes[error.code().name] += 1
            latencies.append(time.perf_counter() - began)

        began, cpu_before = time.perf_counter(), cpu_seconds(server_pid)
        await asyncio.gather(*(one(i) for i in range(args.calls)))
        elapsed, server_cpu = time.perf_counter() - began, cpu_seconds(server_pid) - cpu_before
        prober.stdin.close()
        probe_report = json.loads(await prober.stdout.read())
        await prober.wait()
        for stream in streams:
            if stream.done():
                stream_codes[(await stream.code()).name] += 1
            else:
                stream_codes["open (then cancelled by the client)"] += 1
                stream.cancel()
    finally:
        for channel in channels:
            await channel.close()
    print(f"{args.calls} concurrent GetQueueStats over {args.channels} channel(s): "
          f"{args.calls / elapsed:,.0f} calls/s, p50 {percentile(latencies, 0.5) * 1000:.0f} ms, "
          f"p99 {percentile(latencies, 0.99) * 1000:.0f} ms, "
          f"max {max(latencies) * 1000:.0f} ms")  # fmt: skip
    print(f"codes: {dict(codes)}; server CPU {server_cpu / args.calls * 1e6:.0f} us per call")
    print(f"streams: {dict(stream_codes)}")
    probe_codes = probe_report.pop("codes")
    for name, values in probe_report.items():
        print(f"probe {name}: {len(values)} calls, p50 {percentile(values, 0.5) * 1000:.0f} ms, "
              f"max {max(values, default=0) * 1000:.0f} ms")  # fmt: skip
    print(f"probe codes: {probe_codes}")
    text = await asyncio.to_thread(scrape, metrics_port)
    counted = [line for line in text.splitlines()
               if line.startswith("scheduler_grpc_requests_total") and 'method="GetQueueStats"' in line]  # fmt: skip
    print("server counted:", *counted, sep="\n  ")
    return 1 if BAD_CODES & (codes.keys() | set(probe_codes)) else 0


def probe(target: str, token: str) -> None:
    """`--probe`: health Check and an admin ListJobs in turn until stdin closes; then a JSON report."""
    latencies: dict[str, list[float]] = {"health": [], "admin ListJobs": []}
    codes: collections.Counter[str] = collections.Counter()
    stop = threading.Event()

    def wait_for_eof() -> None:
        sys.stdin.read()
        stop.set()

    threading.Thread(target=wait_for_eof, daemon=True).start()
    metadata = (("authorization", f"Bearer {token}"),)
    with grpc.insecure_channel(target) as channel:
        health: Any = health_pb2_grpc.HealthStub(channel)
        jobs = jobs_pb2_grpc.JobServiceStub(channel)
        calls: dict[str, Callable[[], object]] = {
            "health": lambda: health.Check(health_pb2.HealthCheckRequest(), timeout=10),
            "admin ListJobs": lambda: jobs.ListJobs(jobs_pb2.ListJobsRequest(), metadata=metadata, timeout=10),
        }
        first = True
        while not stop.is_set():
            for name, call in calls.items():
                began = time.perf_counter()
                try:
                    call()
                    codes["OK"] += 1
                except grpc.RpcError as error:
                    codes[error.code().name] += 1
                latencies[name].append(time.perf_counter() - began)
            if first:
                print("probing", flush=True)
                first = False
            stop.wait(0.05)
    print(json.dumps({**latencies, "codes": dict(codes)}), flush=True)


async def main(args: argparse.Namespace, redis_url: str, database_url: str) -> int:
    pool = await create_pool(database_url, size=2, connect_timeout=timedelta(seconds=5))
    try:
        await migrate(pool)
    finally:
        await pool.close()
    port, metrics_port = free_port(), free_port()
    env = {**os.environ, "REDIS_URL": redis_url, "DATABASE_URL": database_url, "SCHEDULER_LOG_LEVEL": args.log_level,
           "SCHEDULER_GRPC_PORT": str(port), "SCHEDULER_METRICS_PORT": str(metrics_port),
           "SCHEDULER_HTTP_PORT": "0"}  # fmt: skip
    env.pop("SCHEDULER_ADMIN_PASSWORD", None)
    server = await asyncio.create_subprocess_exec(sys.executable, "-m", "scheduler_grpc", "server", env=env, cwd=ROOT)
    try:
        target = f"127.0.0.1:{port}"
        await wait_serving(target, server)
        if args.method == "BatchTriggerJobs":
            return await batch_trigger_load(args, target, server.pid, database_url)
        if args.method in {"TriggerJob", "HealthCheck"}:
            return await trigger_load(args, target, server.pid)
        return await load(args, target, metrics_port, server.pid)
    finally:
        if server.returncode is None:
            server.send_signal(signal.SIGTERM)
            await asyncio.wait_for(server.wait(), 60)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--calls", type=int, default=10_000)
    parser.add_argument("--streams", type=int, default=1_000)
    parser.add_argument("--channels", type=int, default=1)
    parser.add_argument(
        "--method", choices=("GetQueueStats", "TriggerJob", "HealthCheck", "BatchTriggerJobs"), default="GetQueueStats"
    )
    parser.add_argument("--items", type=int, default=1000, help="BatchTriggerJobs: items per call")
    parser.add_argument("--callers", type=int, default=50, help="TriggerJob: concurrent callers")
    parser.add_argument("--seconds", type=float, default=10.0, help="TriggerJob: how long they call")
    parser.add_argument("--json", action="store_true", help="TriggerJob/HealthCheck: print one JSON line of figures")
    parser.add_argument("--log-level", default="WARNING", help="the server's SCHEDULER_LOG_LEVEL (INFO: one per call)")
    parser.add_argument("--probe", help=argparse.SUPPRESS)  # internal: run as the prober of TARGET
    parser.add_argument("--token", help=argparse.SUPPRESS)
    arguments = parser.parse_args()
    if arguments.probe:
        probe(arguments.probe, arguments.token)
        sys.exit(0)
    redis_env, database_env = os.environ.get("REDIS_URL"), os.environ.get("DATABASE_URL")
    with tempfile.TemporaryDirectory(prefix="api-bench-") as directory, embedded_servers(
        Path(directory), redis_url=redis_env or None, database_url=database_env or None, throwaway=True
    ) as urls:  # fmt: skip
        sys.exit(uvloop.run(main(arguments, urls.redis_url, urls.database_url)))
