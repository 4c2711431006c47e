"""Shared pieces of the engine tests: settings on the test servers, in-process roles, polling."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar, cast

from redis.asyncio import Redis
from redis.asyncio.cluster import ClusterNode, RedisCluster

from scheduler_grpc import config
from scheduler_grpc.config import Settings, cluster_url
from scheduler_grpc.keys import LeaderKeys, WorkerKeys

T = TypeVar("T")
ROOT = Path(__file__).resolve().parent.parent


def make_settings(redis_url: str, database_url: str, **overrides: str) -> Settings:
    # The web console on any free port: many servers run at once in a test session.
    environ = {"REDIS_URL": redis_url, "DATABASE_URL": database_url, "SCHEDULER_HTTP_PORT": "0", **overrides}
    return config.load(environ, {})


async def eventually(check: Callable[[], Awaitable[T]], *, within: float = 10.0, interval: float = 0.05) -> T:
    """Poll `check` until it returns something truthy, or fail after `within` seconds."""
    deadline = time.monotonic() + within
    last: T | None = None
    while time.monotonic() < deadline:
        last = await check()
        if last:
            return last
        await asyncio.sleep(interval)
    raise AssertionError(f"condition not met within {within}s (last value: {last!r})")


class Role:
    """One `scheduler-grpc <role>` process with its log in a file."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], log_path: Path) -> None:
        self.name = name
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "scheduler_grpc", *argv],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
        )

    @property
    def pid(self) -> int:
        return self.process.pid

    def signal(self, signum: int) -> None:
        if self.process.poll() is None:
            os.kill(self.process.pid, signum)

    def log_lines(self) -> list[str]:
        return self.log_path.read_text(errors="replace").splitlines()

    def metrics_port(self) -> int | None:
        """The /metrics port this role logged, once it has."""
        for line in self.log_lines():
            if '"metrics listening"' in line:
                return int(json.loads(line)["metrics_port"])
        return None

    def terminate(self) -> None:
        """Ask the role to stop (SIGTERM; SIGCONT first, in case it was paused), without waiting."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGCONT)
            self.process.terminate()

    def stop(self, timeout: float = 15.0) -> int:
        if self.process.poll() is None:
            self.terminate()
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()
        return self.process.returncode


class Roles:
    """Starts role processes against the test servers; kills whatever is left at the end."""

    def __init__(self, redis_url: str, database_url: str, log_dir: Path, **env: str) -> None:
        self.env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("SCHEDULER_")},
            "REDIS_URL": redis_url,
            "DATABASE_URL": database_url,
            "SCHEDULER_LOG_LEVEL": "INFO",
            "SCHEDULER_LEADER_TTL": "2s",
            "SCHEDULER_VISIBILITY_TIMEOUT": "2s",
            "SCHEDULER_RECONCILE_INTERVAL": "1s",
            "SCHEDULER_SHUTDOWN_GRACE": "5s",
            "SCHEDULER_METRICS_PORT": "0",  # any free port; a role logs the one it got
            "SCHEDULER_HTTP_PORT": "0",  # the server's web console too
            **env,
        }
        self.log_dir = log_dir
        self.started: list[Role] = []

    def start(self, role: str, *args: str, **env: str) -> Role:
        name = f"{role}-{len(self.started) + 1}"
        process = Role(name, [role, *args], {**self.env, **env, "SCHEDULER_INSTANCE": name},
                       self.log_dir / f"{name}.log")  # fmt: skip
        self.started.append(process)
        return process

    def stop_all(self) -> None:
        # Every role drains at once (each may take its shutdown grace), then each is waited for.
        for role in self.started:
            role.terminate()
        for role in self.started:
            role.stop()

    def dump_logs(self, tail: int = 40) -> str:
        return "\n".join(
            f"--- {role.name} (exit {role.process.poll()}) ---\n" + "\n".join(role.log_lines()[-tail:])
            for role in self.started
        )


async def wait_until_ready(redis: Redis, *, workers: int, leader: bool = True, within: float = 30.0) -> None:
    """Wait until `workers` workers beat and (optionally) a leader holds the lock."""

    async def ready() -> bool:
        beating = await redis.zcard(WorkerKeys().index)
        led = not leader or await redis.exists(LeaderKeys().lock)
        return bool(beating >= workers and led)

    await eventually(ready, within=within)


def redis_for(url: str, **options: Any) -> Redis:
    """A plain client (no retries of `connections.redis_client`) on `url`, a single server's or a
    cluster's (`redis+cluster://`: a `RedisCluster` on its seeds, typed as `Redis` as the package does)."""
    cluster = cluster_url(url)
    if cluster is None:
        return Redis.from_url(url, **options)
    options.setdefault("username", cluster.username)
    options.setdefault("password", cluster.password)
    nodes = [ClusterNode(host, port) for host, port in cluster.seeds]
    return cast(Redis, RedisCluster(startup_nodes=nodes, ssl=cluster.tls, **options))


def every_node(client: Redis) -> dict[str, Any]:
    """Options that send a node-local command (ACL, CONFIG, CLIENT ...) to every node of a cluster."""
    # The nodes themselves, not the ALL_NODES flag: redis-py dispatches a flag only for the commands
    # it knows (not ACL SETUSER). The client must have loaded the slot map (any command does).
    return {"target_nodes": client.get_nodes()} if isinstance(client, RedisCluster) else {}
