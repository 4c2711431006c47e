"""Queue throughput beside raw Redis floors measured on the same server by the same process.

Run: `.venv/bin/python bench/queue_bench.py`. With REDIS_URL set it uses that server (touching only
its own `{q:bench-*}` and `{bench:floor}` keys, deleted afterwards); otherwise it starts an embedded
Valkey in a temporary directory and stops it at the end.

Each row runs for a fixed time (or until its prefilled queue drains) with C concurrent tasks on one
uvloop event loop and one connection pool. A row's floors are the raw primitive run in the same
shape: the same concurrency and the same number of round trips per item (ZADD with as many members
as the row's batch, and EVALSHA of a script that only returns 1). "ratio" is queue items/s divided
by the floor's items/s; "cpu" is this client process's CPU time per item (the server's is not
included; the server's is shown separately from INFO cpu).
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import os
import platform
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import redis
import uvloop
from redis.asyncio import Redis

from scheduler_grpc.embedded import EmbeddedRedis
from scheduler_grpc.keys import QueueKeys
from scheduler_grpc.queue import NewItem, Queue

SECONDS = 1.0  # per measurement
PREFILL_CHUNK = 1000
VT = timedelta(seconds=60)
FLOOR_KEY = "{bench:floor}:zset"

Step = Callable[[int, int], Awaitable[int]]  # (task number, call number) -> items done (0: stop)


@dataclass(frozen=True)
class Rate:
    items_per_s: float
    cpu_us_per_item: float
    server_cpu_us_per_item: float


async def server_cpu(client: Redis) -> float:
    info = await client.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


async def measure(client: Redis, step: Step, concurrency: int, seconds: float = SECONDS) -> Rate:
    """Run `concurrency` tasks calling `step` until `seconds` pass or a step returns 0."""
    done = 0
    stop = False
    loop = asyncio.get_running_loop()
    end = loop.time() + seconds

    async def task(n: int) -> None:
        nonlocal done, stop
        call = 0
        while not stop and loop.time() < end:
            items = await step(n, call)
            call += 1
            if items == 0:
                stop = True
                return
            done += items

    server0 = await server_cpu(client)
    cpu0, wall0 = time.process_time(), time.perf_counter()
    await asyncio.gather(*(task(n) for n in range(concurrency)))
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    server = await server_cpu(client) - server0
    items = max(done, 1)
    return Rate(done / wall, cpu / items * 1e6, server / items * 1e6)


async def drop_queue(client: Redis, name: str) -> None:
    k = QueueKeys(name)
    keys = [k.ready, k.processing, k.delayed, k.dead, k.priority, k.data, k.deliveries, k.lease, k.owner]
    await client.delete(*keys, k.dead_reason, k.seq, k.lease_seq, k.marker)


class Floors:
    """Raw primitives, measured right after each queue row so both see the same machine load."""

    def __init__(self, client: Redis) -> None:
        self.client = client
        self.trivial = client.register_script("return 1")

    async def zadd_step(self, n: int, call: int, batch: int) -> int:
        base = (n * 10_000_000 + call) * batch
        await self.client.zadd(FLOOR_KEY, {f"m{base + i}": base + i for i in range(batch)})
        return 1

    async def evalsha_step(self, n: int, call: int) -> int:
        await self.trivial()
        return 1

    async def calls_per_s(self, primitive: str, batch: int, concurrency: int) -> float:
        if primitive == "ZADD":
            rate = await measure(self.client, lambda n, call: self.zadd_step(n, call, batch), concurrency)
            await self.client.delete(FLOOR_KEY)
        else:
            rate = await measure(self.client, self.evalsha_step, concurrency)
        return rate.items_per_s

    async def items_per_s(self, primitive: str, batch: int, concurrency: int, calls_per_batch: int) -> float:
        """The floor for `batch` items per call needing `calls_per_batch` round trips per batch."""
        return await self.calls_per_s(primitive, batch, concurrency) * batch / calls_per_batch


async def prefill(queue: Queue, count: int, tag: str) -> None:
    for start in range(0, count, PREFILL_CHUNK):
        stop = min(count, start + PREFILL_CHUNK)
        await queue.enqueue_many(NewItem(f"{tag}-{n}", n % 11 - 5, b"payload") for n in range(start, stop))


async def run(client: Redis) -> None:
    info = await client.info("server")
    server = f"{info.get('server_name', 'redis')} {info.get('valkey_version') or info.get('redis_version')}"
    print(
        f"queue bench: {server}, redis-py {redis.__version__}, uvloop {importlib.metadata.version('uvloop')}, "
        f"Python {platform.python_version()}, {os.cpu_count()} CPUs, {SECONDS} s per row"
    )
    floors = Floors(client)
    await floors.trivial()  # load it
    pid = os.getpid()
    rows: list[tuple[str, Rate, float, float]] = []

    async def row(label: str, rate: Rate, batch: int, concurrency: int, calls_per_batch: int) -> None:
        zadd = await floors.items_per_s("ZADD", batch, concurrency, calls_per_batch)
        evalsha = await floors.items_per_s("EVALSHA", 1, concurrency, calls_per_batch) * batch
        rows.append((label, rate, zadd, evalsha))

    # -- enqueue
    for concurrency in (1, 50):
        name = f"bench-enq1-{concurrency}-{pid}"
        queue = Queue(client, name)

        async def enqueue_one(n: int, call: int, queue: Queue = queue) -> int:
            await queue.enqueue(f"{n}-{call}", priority=call % 11 - 5, data=b"payload")
            return 1

        await row(
            f"enqueue x1          c={concurrency:<2}",
            await measure(client, enqueue_one, concurrency),
            1,
            concurrency,
            1,
        )
        await drop_queue(client, name)
    for concurrency in (1, 50):
        name = f"bench-enq100-{concurrency}-{pid}"
        queue = Queue(client, name)

        async def enqueue_batch(n: int, call: int, queue: Queue = queue) -> int:
            base = f"{n}-{call}"
            return await queue.enqueue_many(NewItem(f"{base}-{i}", i % 11 - 5, b"payload") for i in range(100))

        label = f"enqueue_many x100   c={concurrency:<2}"
        await row(label, await measure(client, enqueue_batch, concurrency), 100, concurrency, 1)
        await drop_queue(client, name)

    # -- dequeue + ack
    for count, concurrency, fill in ((1, 1, 30_000), (1, 50, 60_000), (50, 1, 200_000), (50, 50, 300_000)):
        name = f"bench-deq-{count}-{concurrency}-{pid}"
        queue = Queue(client, name)
        await prefill(queue, fill, "item")

        async def dequeue_ack(n: int, call: int, queue: Queue = queue, count: int = count) -> int:
            leases = await queue.dequeue(f"w{n}", VT, count)
            if leases:
                await queue.ack_many(leases)
            return len(leases)

        label = f"dequeue+ack x{count:<5} c={concurrency:<2}"
        await row(label, await measure(client, dequeue_ack, concurrency), count, concurrency, 2)
        await drop_queue(client, name)

    print()
    header = ("operation", "items/s", "client µs", "server µs", "ZADD floor", "ratio", "EVALSHA floor", "ratio")
    widths = (30, 10, 11, 11, 12, 7, 15, 7)
    print(
        "".join(
            f"{text:<{w}}" if i == 0 else f"{text:>{w}}" for i, (text, w) in enumerate(zip(header, widths, strict=True))
        )
    )
    for label, rate, zadd, evalsha in rows:
        print(
            f"{label:<30}{rate.items_per_s:>10,.0f}{rate.cpu_us_per_item:>11.1f}{rate.server_cpu_us_per_item:>11.1f}"
            f"{zadd:>12,.0f}{rate.items_per_s / zadd:>7.2f}{evalsha:>15,.0f}{rate.items_per_s / evalsha:>7.2f}"
        )
    print()
    print("client/server µs: CPU time per item of this process / of the Redis server (INFO cpu).")
    print("floors: ZADD with the row's batch as members, EVALSHA of `return 1`; both at the row's concurrency")
    print("and round trips per item (dequeue+ack makes 2 calls per batch, enqueue 1); ratio = items/s / floor.")


async def main() -> None:
    url = os.environ.get("REDIS_URL")
    embedded = None
    tmp = None
    if not url:
        tmp = tempfile.TemporaryDirectory(prefix="queue-bench-")
        embedded = EmbeddedRedis(Path(tmp.name) / "valkey")
        url = embedded.start()
    client = Redis.from_url(url, decode_responses=False)
    try:
        await run(client)
    finally:
        await client.aclose()
        if embedded is not None:
            embedded.stop()
        if tmp is not None:
            tmp.cleanup()


if __name__ == "__main__":
    started = time.perf_counter()
    uvloop.run(main())
    print(f"total {time.perf_counter() - started:.1f} s")
