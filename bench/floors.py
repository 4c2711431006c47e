"""Floors for `make bench`: the raw primitive under each figure, measured on the same servers in the same run.

    .venv/bin/python bench/floors.py grpc [--callers 50] [--seconds 5]
    .venv/bin/python bench/floors.py timer [--timers 1000] [--seconds 10]
    .venv/bin/python bench/floors.py queue        (needs REDIS_URL and DATABASE_URL)

Each subcommand prints one JSON line of figures at the end (the contract of bench/run.py).

* `queue`: the raw Lua dequeue (one script: ZPOPMIN 50 from a ready set + ZADD them to a leased set)
  in items/s, with the client's and Valkey's CPU per item; and a raw PostgreSQL single statement
  `UPDATE ... FROM unnest($1)` of 50 rows per statement (4 connections) in rows/s with PostgreSQL's
  CPU per row. bench/drain_bench.py imports these and measures them right before its drain.
* `grpc`: a no-op unary RPC (bytes in, bytes out, no proto) served by a grpc.aio server in a
  process of its own, called by `--callers` concurrent callers over one channel, as the TriggerJob
  load is: RPCs/s and p50/p99 latency.
* `timer`: uvloop timer lateness, `--timers` callbacks due at the same whole second, every second
  for `--seconds`: p50/p99/max of (callback ran - due), the floor of scheduling lateness.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import uvloop

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

BATCH = 50
FLOOR_KEYS = ("{bench:floor}:ready", "{bench:floor}:leased")

# KEYS[1] ready set, KEYS[2] leased set; ARGV[1] count, ARGV[2] lease deadline.
# The least a dequeue can be: take the best items and record them as leased, in one script.
DEQUEUE_FLOOR_LUA = """
local items = redis.call('ZPOPMIN', KEYS[1], ARGV[1])
for i = 1, #items, 2 do redis.call('ZADD', KEYS[2], ARGV[2], items[i]) end
return #items / 2
"""


def percentile(values: list[float], share: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))]


def proc_cpu_seconds(pid: int, *, children: bool = False) -> float:
    """utime+stime of `pid` from /proc (plus its reaped children's with `children`)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = int(fields[11]) + int(fields[12])
    if children:
        ticks += int(fields[13]) + int(fields[14])
    return ticks / os.sysconf("SC_CLK_TCK")


def tree_cpu_seconds(root_pid: int) -> float:
    """CPU of a process, its reaped children and its live children (PostgreSQL's backends)."""
    total = proc_cpu_seconds(root_pid, children=True)
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == root_pid:
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def _local(pid: int | None) -> int | None:
    """`pid` if that process runs on this machine."""
    return pid if pid and os.path.exists(f"/proc/{pid}/stat") else None


def _postmaster(directory: str) -> int | None:
    try:
        with open(os.path.join(directory, "postmaster.pid")) as file:
            return _local(int(file.read().split()[0]))
    except OSError:  # not on this machine
        return None


async def valkey_pid(redis: Any) -> int | None:
    """Valkey's pid if it runs on this machine (INFO server), else None."""
    info = await redis.info("server")
    return _local(int(info.get("process_id", 0)))


async def postgres_pid(pool: Any) -> int | None:
    """The postmaster's pid if PostgreSQL runs on this machine (its data directory is readable)."""
    try:
        directory = await pool.fetchval("SHOW data_directory")
    except Exception:  # not a superuser: no server CPU figure
        return None
    return _postmaster(directory)


async def valkey_cpu_seconds(redis: Any) -> float:
    info = await redis.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


# -- queue floors ------------------------------------------------------------------------------------


async def lua_dequeue_floor(redis: Any, items: int = 300_000, seconds: float = 3.0) -> dict[str, float]:
    """Raw Lua dequeue (ZPOPMIN + ZADD, batch 50, one caller): items/s, client and Valkey CPU µs/item."""
    ready, leased = FLOOR_KEYS
    await redis.delete(ready, leased)
    for start in range(0, items, 5000):
        async with redis.pipeline(transaction=False) as pipe:
            for chunk in range(start, min(items, start + 5000), 1000):
                pipe.zadd(ready, {f"item-{n}": n for n in range(chunk, min(items, chunk + 1000))})
            await pipe.execute()
    script = redis.register_script(DEQUEUE_FLOOR_LUA)
    done = 0
    server0, cpu0, wall0 = await valkey_cpu_seconds(redis), time.process_time(), time.perf_counter()
    while time.perf_counter() - wall0 < seconds:
        got = int(await script(keys=[ready, leased], args=[BATCH, 1]))
        if got == 0:
            break
        done += got
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    server = await valkey_cpu_seconds(redis) - server0
    await redis.delete(ready, leased)
    done = max(done, 1)
    return {
        "lua_dequeue_items_per_s": done / wall,
        "lua_dequeue_client_cpu_us": cpu / done * 1e6,
        "lua_dequeue_valkey_cpu_us": server / done * 1e6,
    }


async def pg_update_floor(pool: Any, rows: int = 100_000, seconds: float = 3.0) -> dict[str, float | None]:
    """Raw `UPDATE ... FROM unnest` (50 rows a statement, 4 connections): rows/s, PostgreSQL CPU µs/row."""
    await pool.execute("DROP TABLE IF EXISTS bench_floor")
    await pool.execute(
        "CREATE TABLE bench_floor (id bigint PRIMARY KEY, status text NOT NULL, finished_at timestamptz)"
    )
    await pool.execute("INSERT INTO bench_floor SELECT n, 'running', NULL FROM generate_series(0, $1 - 1) AS n", rows)
    await pool.execute("ANALYZE bench_floor")
    pid = await postgres_pid(pool)
    next_id = 0
    done = 0
    stop = time.perf_counter() + seconds

    async def caller() -> None:
        nonlocal next_id, done
        while time.perf_counter() < stop and next_id < rows:
            ids = list(range(next_id, min(rows, next_id + BATCH)))
            next_id += BATCH
            await pool.execute(
                """UPDATE bench_floor AS t SET status = 'succeeded', finished_at = now()
                   FROM unnest($1::bigint[]) AS u(id) WHERE t.id = u.id""",
                ids,
            )
            done += len(ids)

    server0 = tree_cpu_seconds(pid) if pid else 0.0
    wall0 = time.perf_counter()
    await asyncio.gather(*(caller() for _ in range(4)))
    wall = time.perf_counter() - wall0
    server = tree_cpu_seconds(pid) - server0 if pid else None
    await pool.execute("DROP TABLE bench_floor")
    done = max(done, 1)
    return {
        "pg_update_rows_per_s": done / wall,
        "pg_update_cpu_us": None if server is None else server / done * 1e6,
    }


async def queue_floors(redis_url: str, database_url: str) -> dict[str, float | None]:
    from datetime import timedelta

    from scheduler_grpc.connections import redis_client
    from scheduler_grpc.db.pool import create_pool

    redis = redis_client(redis_url)
    pool = await create_pool(database_url, size=4, connect_timeout=timedelta(seconds=10))
    try:
        return {**await lua_dequeue_floor(redis), **await pg_update_floor(pool)}
    finally:
        await redis.aclose()
        await pool.close()


# -- gRPC floor --------------------------------------------------------------------------------------

NOOP_METHOD = "/bench.Floor/Noop"
FANOUT_METHOD = "/bench.Floor/Fanout"


def _identity(data: bytes) -> bytes:
    return data


async def serve_noop(port_file: Path, fanout_messages: int) -> None:
    """A grpc.aio server with a no-op unary method and a fan-out stream (`--serve`)."""
    import grpc

    started = asyncio.Event()
    go = asyncio.Event()
    subscribers = 0
    expected = 0

    async def noop(request: bytes, context: grpc.aio.ServicerContext[bytes, bytes]) -> bytes:
        return b""

    async def fanout(request: bytes, context: grpc.aio.ServicerContext[bytes, bytes]) -> Any:
        # Each stream gets `fanout_messages` stamped messages once every subscriber is connected.
        nonlocal subscribers, expected
        expected = int(request or b"0")
        subscribers += 1
        if subscribers >= expected:
            go.set()
        await go.wait()
        for _ in range(fanout_messages):
            yield str(time.time()).encode()

    handler = grpc.method_handlers_generic_handler(
        "bench.Floor",
        {
            "Noop": grpc.unary_unary_rpc_method_handler(noop, _identity, _identity),
            "Fanout": grpc.unary_stream_rpc_method_handler(fanout, _identity, _identity),
        },
    )
    server = grpc.aio.server(options=[("grpc.max_concurrent_streams", 100_000)])
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    started.set()
    await asyncio.to_thread(port_file.write_text, str(port))
    await server.wait_for_termination()


class NoopServer:
    """The no-op gRPC server in a process of its own (as the real server is)."""

    def __init__(self, fanout_messages: int = 0) -> None:
        import tempfile

        self.directory = tempfile.TemporaryDirectory(prefix="bench-floor-")
        self.port_file = Path(self.directory.name) / "port"
        self.process = subprocess.Popen(
            [sys.executable, __file__, "--serve", str(self.port_file), "--fanout-messages", str(fanout_messages)],
            cwd=ROOT,
        )

    async def start(self) -> str:
        deadline = time.monotonic() + 30
        while not self.port_file.exists() or not self.port_file.read_text():
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the no-op gRPC server did not start")
            await asyncio.sleep(0.05)
        return f"127.0.0.1:{self.port_file.read_text()}"

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(10)
        self.directory.cleanup()


async def grpc_unary_floor(callers: int, seconds: float) -> dict[str, float]:
    import grpc

    server = NoopServer()
    try:
        target = await server.start()
        async with grpc.aio.insecure_channel(target) as channel:
            call = channel.unary_unary(NOOP_METHOD, request_serializer=_identity, response_deserializer=_identity)
            await call(b"", timeout=10)
            latencies: list[float] = []
            stop = time.perf_counter() + seconds

            async def caller() -> None:
                while time.perf_counter() < stop:
                    began = time.perf_counter()
                    await call(b"", timeout=60)
                    latencies.append(time.perf_counter() - began)

            began = time.perf_counter()
            await asyncio.gather(*(caller() for _ in range(callers)))
            elapsed = time.perf_counter() - began
    finally:
        server.stop()
    return {
        "grpc_noop_rpcs_per_s": len(latencies) / elapsed,
        "grpc_noop_p50_ms": percentile(latencies, 0.5) * 1000,
        "grpc_noop_p99_ms": percentile(latencies, 0.99) * 1000,
    }


async def grpc_fanout_floor(streams: int, messages: int) -> dict[str, float]:
    """`messages` tiny messages pushed to each of `streams` streams by a no-op server: msgs/s, p99 delay."""
    import grpc

    server = NoopServer(fanout_messages=messages)
    delays: list[float] = []
    received = 0
    try:
        target = await server.start()
        async with grpc.aio.insecure_channel(target) as channel:
            call = channel.unary_stream(FANOUT_METHOD, request_serializer=_identity, response_deserializer=_identity)
            first: list[float] = []
            last: list[float] = []

            async def subscriber() -> None:
                nonlocal received
                async for message in call(str(streams).encode(), timeout=600):
                    now, sent = time.time(), float(message)
                    if not first or sent < first[0]:
                        first[:] = [sent]
                    received += 1
                    delays.append(now - sent)
                    last[:] = [max([now, *last])]

            await asyncio.gather(*(subscriber() for _ in range(streams)))
            elapsed = last[0] - first[0]
    finally:
        server.stop()
    return {
        "fanout_msgs_per_s": received / elapsed,
        "fanout_delay_p99_ms": percentile(delays, 0.99) * 1000,
    }


# -- timer floor -------------------------------------------------------------------------------------


async def timer_floor(timers: int, seconds: int) -> dict[str, float]:
    """`timers` callbacks due at each whole second, for `seconds` seconds: their lateness."""
    loop = asyncio.get_running_loop()
    lateness: list[float] = []
    done = loop.create_future()
    remaining = timers * seconds
    start = int(time.time()) + 1

    def fire(due: float) -> None:
        nonlocal remaining
        lateness.append(time.time() - due)
        remaining -= 1
        if remaining == 0:
            done.set_result(None)

    for second in range(seconds):
        due = start + second
        for _ in range(timers):
            loop.call_at(loop.time() + (due - time.time()), fire, due)
    await done
    return {
        "timer_p50_ms": percentile(lateness, 0.5) * 1000,
        "timer_p99_ms": percentile(lateness, 0.99) * 1000,
        "timer_max_ms": max(lateness) * 1000,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", nargs="?", choices=("queue", "grpc", "fanout", "timer"))
    parser.add_argument("--callers", type=int, default=50)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--timers", type=int, default=1000)
    parser.add_argument("--streams", type=int, default=1000)
    parser.add_argument("--messages", type=int, default=200)
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    parser.add_argument("--fanout-messages", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        uvloop.run(serve_noop(Path(args.serve), args.fanout_messages))
        return
    figures: dict[str, Any]
    if args.what == "queue":
        figures = uvloop.run(queue_floors(os.environ["REDIS_URL"], os.environ["DATABASE_URL"]))
    elif args.what == "grpc":
        figures = uvloop.run(grpc_unary_floor(args.callers, args.seconds))
    elif args.what == "fanout":
        figures = uvloop.run(grpc_fanout_floor(args.streams, args.messages))
    elif args.what == "timer":
        figures = uvloop.run(timer_floor(args.timers, int(args.seconds)))
    else:
        parser.error("say which floor")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
