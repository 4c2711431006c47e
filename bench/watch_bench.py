"""WatchExecutions subscribers during a drain: events/s delivered and the delay from event to receipt.

    .venv/bin/python bench/watch_bench.py [--subscribers 1000] [--runs 300]

Uses REDIS_URL / DATABASE_URL (embedded servers when unset; flushes that Redis database and
truncates the job tables). Starts one `scheduler-grpc server` and one worker process, opens
`--subscribers` WatchExecutions streams (one channel, from this process) for the SUCCEEDED events
of one `test.echo` job, waits until the server counts them all (its `scheduler_stream_subscribers`
gauge), then queues `--runs` runs of that job for the worker to drain. Every subscriber gets every
event: subscribers x runs deliveries. The streams ask for batches (`max_events_per_response`,
`--batch`, as the clients in this repository do; 0: one event per message).

Before that, the floor: the same number of tiny messages pushed to the same number of streams by a
no-op grpc.aio server in a process of its own (bench/floors.py `fanout`), received the same way.

One JSON line: events_per_s (deliveries / (last receipt - first event)), delay_p50_ms /
delay_p99_ms (receipt of the message carrying the event - the event's `event_time`), delivered,
expected, ended_early (streams the server ended, e.g. RESOURCE_EXHAUSTED for a subscriber too
slow), fanout_msgs_per_s, fanout_delay_p99_ms (the floor); added_p99_ms (of that delay, the part
before the event was in the stream: Redis's id time - `event_time`, the writer's share), messages
(responses received).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import gc
import json
import signal
import sys
import time
import urllib.request
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import grpc
import uvloop

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from api_load_bench import wait_serving  # noqa: E402
from benchlib import role_env, servers  # noqa: E402
from floors import grpc_fanout_floor, percentile  # noqa: E402
from scheduler_client.v1 import auth_pb2, auth_pb2_grpc, executions_pb2, executions_pb2_grpc  # noqa: E402

from scheduler_grpc.connections import redis_client  # noqa: E402
from scheduler_grpc.control import Control  # noqa: E402
from scheduler_grpc.db.firing import FiringRepository  # noqa: E402
from scheduler_grpc.db.migrate import migrate  # noqa: E402
from scheduler_grpc.db.pool import create_pool  # noqa: E402
from scheduler_grpc.dispatch import Queues, enqueue_runs  # noqa: E402
from scheduler_grpc.embedded import free_port  # noqa: E402
from scheduler_grpc.executions import Trigger  # noqa: E402
from scheduler_grpc.handlers import HandlerSettings, default_registry  # noqa: E402
from scheduler_grpc.jobs import JobSpec, RetryPolicy  # noqa: E402


def subscribers_counted(metrics_port: int) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as response:
        for line in response.read().decode().splitlines():
            if line.startswith("scheduler_stream_subscribers "):
                return float(line.split()[1])
    return 0.0


async def main(args: argparse.Namespace, redis_url: str, database_url: str) -> dict[str, object]:
    figures: dict[str, object] = dict(await grpc_fanout_floor(args.subscribers, args.runs))
    print(f"floor: {figures}", file=sys.stderr)
    pool = await create_pool(database_url, size=4, connect_timeout=timedelta(seconds=10))
    await migrate(pool)
    await pool.execute("TRUNCATE job_executions, jobs CASCADE")
    redis = redis_client(redis_url)
    await redis.flushdb()
    registry = default_registry(HandlerSettings())
    control = Control(redis, pool, registry)
    queues = Queues(redis)  # the bench enqueues its runs itself (no events)
    job = await control.create_job(JobSpec(name="watched", handler="test.echo", retry=RetryPolicy(max_retries=0)))
    port, metrics_port = free_port(), free_port()
    env = role_env(redis_url, database_url, SCHEDULER_GRPC_PORT=str(port), SCHEDULER_METRICS_PORT=str(metrics_port),
                   SCHEDULER_HTTP_PORT="0")  # fmt: skip
    server = await asyncio.create_subprocess_exec(sys.executable, "-m", "scheduler_grpc", "server", env=env, cwd=ROOT)
    worker = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "scheduler_grpc", "worker", env={**env, "SCHEDULER_METRICS_PORT": "0"}, cwd=ROOT
    )
    target = f"127.0.0.1:{port}"
    channel = grpc.aio.insecure_channel(target)
    try:
        await wait_serving(target, server)
        login = await auth_pb2_grpc.AuthServiceStub(channel).Login(
            auth_pb2.LoginRequest(username="admin", password="admin123"), timeout=10
        )
        token = (("authorization", f"Bearer {login.token}"),)
        stub = executions_pb2_grpc.ExecutionServiceStub(channel)
        request = executions_pb2.WatchExecutionsRequest(
            job_ids=[job.id], types=[executions_pb2.EVENT_TYPE_SUCCEEDED], max_events_per_response=args.batch
        )
        delays: list[float] = []
        receipts: list[float] = []
        event_times: list[float] = []
        ended: collections.Counter[str] = collections.Counter()
        received = 0
        added: list[float] = []
        arrived: list[tuple[float, Any]] = []  # (receipt time, response)

        async def subscriber(call: grpc.aio.UnaryStreamCall[Any, Any]) -> None:
            # Only the receipt time per message here: the events' delays are worked out after the
            # run, so this client's own per-event work does not delay the messages behind it.
            nonlocal received
            got = 0
            try:
                async for response in call:
                    now = time.time()
                    arrived.append((now, response))
                    count = len(response.events) or 1
                    got += count
                    received += count
                    if got >= args.runs:
                        receipts.append(now)
                        call.cancel()
                        return
            except grpc.aio.AioRpcError as error:
                if error.code() != grpc.StatusCode.CANCELLED:
                    ended[error.code().name] += 1
            receipts.append(time.time())

        calls = [stub.WatchExecutions(request, metadata=token) for _ in range(args.subscribers)]
        await asyncio.gather(*(call.initial_metadata() for call in calls))
        deadline = time.monotonic() + 60
        while await asyncio.to_thread(subscribers_counted, metrics_port) < args.subscribers:
            if time.monotonic() > deadline:
                raise SystemExit("the server did not count every subscriber within 60 s")
            await asyncio.sleep(0.2)
        tasks = [asyncio.create_task(subscriber(call)) for call in calls]
        # The 1,000 streams and their tasks live through the drain: out of this process's
        # collector's sight, so no full collection (~0.3 s here, walking them all) pauses the one
        # process receiving every stream (real subscribers are processes of their own).
        gc.freeze()
        slots = [datetime(2020, 1, 1, tzinfo=UTC) + timedelta(microseconds=i) for i in range(args.runs)]
        for start in range(0, args.runs, 1000):
            runs = await FiringRepository(pool).trigger(job.id, Trigger.BACKFILL, slots[start : start + 1000])
            await enqueue_runs(queues, runs)
        _, pending = await asyncio.wait(tasks, timeout=args.timeout)
        for task in pending:
            task.cancel()
        for call in calls:
            call.cancel()
        for now, response in arrived:
            for event in response.events or (response.event,):
                stamp = event.event_time
                at = stamp.seconds + stamp.nanos / 1e9
                delays.append(now - at)
                # The cursor is the stream id: milliseconds since the epoch when Redis added it.
                added.append(int(event.cursor.split("-")[0]) / 1000 - at)
                event_times.append(at)
        elapsed = max(receipts, default=time.time()) - min(event_times, default=time.time())
        figures |= {
            "subscribers": args.subscribers,
            "runs": args.runs,
            "delivered": received,
            "expected": args.subscribers * args.runs,
            "events_per_s": received / elapsed if elapsed > 0 else float("nan"),
            "delay_p50_ms": percentile(delays, 0.5) * 1000,
            "delay_p99_ms": percentile(delays, 0.99) * 1000,
            "added_p99_ms": percentile(added, 0.99) * 1000,
            "messages": len(arrived),
            "ended_early": dict(ended),
            "unfinished_after_timeout": len(pending),
        }
    finally:
        await channel.close()
        for process in (worker, server):
            if process.returncode is None:
                process.send_signal(signal.SIGTERM)
        for process in (worker, server):
            await asyncio.wait_for(process.wait(), 60)
        await registry.aclose()
        await redis.aclose()
        await pool.close()
    return figures


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--subscribers", type=int, default=1000)
    parser.add_argument("--runs", type=int, default=300)
    parser.add_argument(
        "--batch", type=int, default=1000, help="max_events_per_response (0: one event per message, as before)"
    )
    parser.add_argument("--timeout", type=float, default=180.0, help="longest wait for every delivery")
    arguments = parser.parse_args()
    with servers() as urls:
        print(json.dumps(uvloop.run(main(arguments, urls.redis_url, urls.database_url))))
