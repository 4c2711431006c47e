"""`scheduler-grpc up`: the banner comes once every role is ready, so what it says to try works at once;
a role that dies is started again, and only a signal to `up` stops the roles."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import asyncpg
import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from redis.asyncio import Redis

from scheduler_grpc import cli, config
from scheduler_grpc.config import Settings
from scheduler_grpc.embedded import ServerUrls
from scheduler_grpc.errors import ConfigError
from scheduler_grpc.topology import _banner, _children
from tests.api_helpers import free_port, metrics_base


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
    grpc_port, http_port, base = free_port(), free_port(), metrics_base()
    env = {
        **os.environ,
        "REDIS_URL": servers.redis_url,
        "DATABASE_URL": database_url,
        "SCHEDULER_GRPC_PORT": str(grpc_port),
        "SCHEDULER_HTTP_PORT": str(http_port),
        "SCHEDULER_DATA_DIR": str(tmp_path),
        "SCHEDULER_LOG_FORMAT": "json",
        "SCHEDULER_METRICS_BASE": str(base),  # as `make run` takes it (no flag)
    }
    argv = [sys.executable, "-m", "scheduler_grpc", "up", "--schedulers", "1", "--workers", "1"]
    process = await asyncio.create_subprocess_exec(*argv, env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL)
    assert process.stderr is not None
    lines: list[bytes] = []

    async def until_banner() -> None:
        assert process.stderr is not None
        while line := await process.stderr.readline():
            lines.append(line)
            if b"scheduler-grpc is up" in line:
                return
        raise AssertionError("up exited without a banner")

    async def until_banner_ends() -> None:
        assert process.stderr is not None
        while line := await process.stderr.readline():
            lines.append(line)
            if not line.strip():
                return
        raise AssertionError("up exited in its banner")

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
        banner_start = len(lines) - 1
        await asyncio.wait_for(until_banner_ends(), 10)
        banner = b"".join(lines[banner_start:]).decode()
        drainer = asyncio.create_task(drain())
        # At the moment of the banner: the gRPC server answers SERVING and every /metrics answers.
        async with grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)  # type: ignore[no-untyped-call]
            reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=2, wait_for_ready=False)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        assert [port for port in (base, base + 1, base + 10) if not _metrics_answer(port)] == []
        # ... and so does the web console.
        assert _http_status(http_port, "/login") == 200
        # What the banner says to run from a shell works as it is: schedctl finds this server.
        assert "npx" not in banner
        [line] = [line for line in banner.splitlines() if line.lstrip().startswith("schedctl:")]
        command = line.split("schedctl:", 1)[1].strip()
        assert command.startswith(f"export SCHEDCTL_SERVER=127.0.0.1:{grpc_port}; schedctl login ")
        shell_env = {k: v for k, v in os.environ.items() if not k.startswith("SCHEDCTL_")}
        shell_env["PATH"] = f"{Path(sys.executable).parent}:{shell_env.get('PATH', '')}"
        shell_env["SCHEDCTL_CONFIG"] = str(tmp_path / "schedctl")
        shell = await asyncio.create_subprocess_exec(
            "sh", "-c", f"{command} && schedctl whoami", env=shell_env,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )  # fmt: skip
        out, err = await asyncio.wait_for(shell.communicate(), 60)
        assert shell.returncode == 0, err.decode()
        assert out.decode().splitlines()[-1] == f"admin (role admin) on 127.0.0.1:{grpc_port}"
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
    base = metrics_base()
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


def _settings(**environ: str) -> Settings:
    return config.load({"SCHEDULER_DATA_DIR": "/tmp/unused", **environ})


def test_metrics_ports_count_from_scheduler_metrics_base() -> None:
    args = argparse.Namespace(schedulers=2, workers=3)
    ports = {child.name: child.metrics_port for child in _children(_settings(), args)}
    assert ports == {"server": 9090, "scheduler-1": 9091, "scheduler-2": 9092,
                     "worker-1": 9100, "worker-2": 9101, "worker-3": 9102}  # fmt: skip
    moved = {child.name: child.metrics_port for child in _children(_settings(SCHEDULER_METRICS_BASE="19090"), args)}
    assert moved == {name: port + 10000 for name, port in ports.items()}
    # The flag of `up` is the same setting, and beats the environment.
    parsed = cli.build_parser().parse_args(["up", "--metrics-base", "29090"])
    flagged = config.load({"SCHEDULER_METRICS_BASE": "19090"}, vars(parsed))
    assert _children(flagged, parsed)[0].metrics_port == 29090
    with pytest.raises(ConfigError, match="SCHEDULER_METRICS_BASE"):
        _children(_settings(SCHEDULER_METRICS_BASE="65530"), args)
    with pytest.raises(ConfigError, match="SCHEDULER_METRICS_BASE"):
        _settings(SCHEDULER_METRICS_BASE="0")


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({}, "schedctl login --username admin --password admin123"),
        ({"SCHEDULER_GRPC_PORT": "50052"},
         "export SCHEDCTL_SERVER=127.0.0.1:50052; schedctl login --username admin --password admin123"),
        ({"SCHEDULER_GRPC_HOST": "0.0.0.0", "SCHEDULER_ADMIN_PASSWORD": "a-strong-passphrase",
          "SCHEDULER_ADMIN_USERNAME": "ops"}, "schedctl login --username ops"),
    ],
)  # fmt: skip
def test_the_banner_says_how_schedctl_reaches_the_server(
    environ: dict[str, str], expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    settings = _settings(**environ)
    _banner(settings, _children(settings, argparse.Namespace(schedulers=1, workers=1)), "redis://r", "postgresql://p",
            Path("/tmp/env"))  # fmt: skip
    banner = capsys.readouterr().err
    assert f"  schedctl:     {expected}\n" in banner
    assert "npx" not in banner


def test_settings_given_to_up_as_flags_reach_every_role() -> None:
    # `up --grpc-port 50071 --http-port 8091` once left the server on 50051 and 8080 (the flags were
    # parsed by `up` but not handed to its children) and `up` waited on 50071 for ever.
    from scheduler_grpc.cli import build_parser
    from scheduler_grpc.topology import child_environment

    args = build_parser().parse_args(["up", "--grpc-port", "50071", "--http-port", "8091"])
    env = child_environment(args, {"SCHEDULER_GRPC_PORT": "1", "PATH": "/bin"}, "redis://r", "postgresql://p")
    assert env["SCHEDULER_GRPC_PORT"] == "50071"  # the flag beats the environment, as for `up` itself
    assert env["SCHEDULER_HTTP_PORT"] == "8091"
    assert (env["PATH"], env["REDIS_URL"], env["DATABASE_URL"]) == ("/bin", "redis://r", "postgresql://p")
    assert "SCHEDULER_LOG_LEVEL" not in env  # only what was given
