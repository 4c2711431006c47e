"""`scheduler-grpc up`: the banner comes once every role is ready, so what it says to try works at once;
a role that dies is started again, and only a signal to `up` stops the roles."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import asyncpg
import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from redis.asyncio import Redis

from scheduler_grpc.embedded import ServerUrls
from tests.api_helpers import free_port


def _free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _metrics_base() -> int:
    """A base port whose server (base), scheduler-1 (base+1) and worker-1 (base+10) ports are free."""
    for _ in range(100):
        base = random.randrange(20_000, 40_000)
        if all(_free(base + offset) for offset in (0, 1, 10)):
            return base
    raise AssertionError("no free metrics ports")


def _http_status(port: int, path: str) -> int:
    with socket.create_connection(("127.0.0.1", port), timeout=2) as sock:
        sock.sendall(f"GET {path} HTTP/1.0\r\n\r\n".encode())
        return int(sock.recv(64).split(b" ")[1])


def _metrics_answer(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1) as sock:
            sock.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
            return sock.recv(64).split(b" ")[1:2] == [b"200"]
    except OSError:
        return False


async def test_the_banner_comes_when_every_role_is_ready(
    servers: ServerUrls,
    database_url: str,
    redis: Redis,
    pool: asyncpg.Pool,
    tmp_path: Path,
) -> None:
    grpc_port, http_port, base = free_port(), free_port(), _metrics_base()
    env = {
        **os.environ,
        "REDIS_URL": servers.redis_url,
        "DATABASE_URL": database_url,
        "SCHEDULER_GRPC_PORT": str(grpc_port),
        "SCHEDULER_HTTP_PORT": str(http_port),
        "SCHEDULER_DATA_DIR": str(tmp_path),
        "SCHEDULER_LOG_FORMAT": "json",
    }
    argv = [sys.executable, "-m", "scheduler_grpc", "up", "--schedulers", "1", "--workers", "1"]
    process = await asyncio.create_subprocess_exec(
        *argv, "--metrics-base", str(base), env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL
    )
    assert process.stderr is not None
    lines: list[bytes] = []

    async def until_banner() -> None:
        assert process.stderr is not None
        while line := await process.stderr.readline():
            lines.append(line)
            if b"scheduler-grpc is up" in line:
                return
        raise AssertionError("up exited without a banner")

    async def drain() -> None:  # the roles log to the same pipe: keep it flowing
        assert process.stderr is not None
        while await process.stderr.read(65536):
            pass

    drainer: asyncio.Task[None] | None = None
    try:
        try:
            await asyncio.wait_for(until_banner(), 90)
        except TimeoutError:
            raise AssertionError("no banner:\n" + b"".join(lines[-30:]).decode(errors="replace")) from None
        drainer = asyncio.create_task(drain())
        # At the moment of the banner: the gRPC server answers SERVING and every /metrics answers.
        async with grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)  # type: ignore[no-untyped-call]
            reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=2, wait_for_ready=False)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        assert [port for port in (base, base + 1, base + 10) if not _metrics_answer(port)] == []
        # ... and so does the web console.
        assert _http_status(http_port, "/login") == 200
    finally:
        process.send_signal(signal.SIGINT)
        try:
            await asyncio.wait_for(process.wait(), 30)
        except TimeoutError:
            process.kill()
            await process.wait()
        if drainer is not None:
            await drainer


def _alive(pid: int) -> bool:
    """Whether `pid` is a live process (a zombie waiting for its reaper is not)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


async def test_up_restarts_a_role_that_dies_and_stops_every_role_on_sigterm(
    servers: ServerUrls, database_url: str, tmp_path: Path
) -> None:
    base = _metrics_base()
    env = {
        **os.environ,
        "REDIS_URL": servers.redis_url,
        "DATABASE_URL": database_url,
        "SCHEDULER_GRPC_PORT": str(free_port()),
        "SCHEDULER_HTTP_PORT": str(free_port()),
        "SCHEDULER_DATA_DIR": str(tmp_path),
        "SCHEDULER_LOG_FORMAT": "json",
    }
    argv = [sys.executable, "-m", "scheduler_grpc", "up", "--schedulers", "1", "--workers", "1"]
    process = await asyncio.create_subprocess_exec(
        *argv, "--metrics-base", str(base), env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL
    )
    records: list[dict[str, object]] = []
    lines: list[bytes] = []

    async def read() -> None:  # the roles log to the same pipe: keep it flowing
        assert process.stderr is not None
        while line := await process.stderr.readline():
            lines.append(line)
            if line.startswith(b"{"):
                records.append(json.loads(line))

    def started(role: str) -> list[int]:
        return [
            int(str(r["child_pid"]))
            for r in records
            if r.get("message") == "role started" and r.get("role_name") == role
        ]

    async def until(check: Callable[[], bool], within: float, what: str) -> None:
        deadline = asyncio.get_running_loop().time() + within
        while not check():
            if asyncio.get_running_loop().time() > deadline or process.returncode is not None:
                tail = b"".join(lines[-30:]).decode(errors="replace")
                raise AssertionError(f"{what} (exit {process.returncode}):\n{tail}")
            await asyncio.sleep(0.1)

    reader = asyncio.create_task(read())
    try:
        await until(lambda: any(b"scheduler-grpc is up" in line for line in lines), 90, "no banner")
        [first] = started("worker-1")
        scheduler_pid = started("scheduler-1")[0]
        os.kill(first, signal.SIGKILL)
        await until(lambda: len(started("worker-1")) == 2, 30, "the killed worker was not started again")
        [restart] = [r for r in records if r.get("message") == "role exited; restarting it"]
        assert (restart["role_name"], restart["exit_code"]) == ("worker-1", -signal.SIGKILL)
        second = started("worker-1")[1]
        # The others went on; the new worker serves its /metrics (it reached Redis and PostgreSQL).
        assert process.returncode is None
        assert _alive(scheduler_pid)
        assert started("scheduler-1") == [scheduler_pid]
        await until(lambda: _metrics_answer(base + 10), 60, "the restarted worker never became ready")
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            code = await asyncio.wait_for(process.wait(), 40)
        except TimeoutError:
            process.kill()
            await process.wait()
            raise
        await reader
    assert code == 0
    assert not _alive(second)
    assert not _alive(scheduler_pid)
