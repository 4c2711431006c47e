"""Role processes under fault: start, stop, kill -9, SIGSTOP/SIGCONT by pid, each behind its own links.

A role is one `python -m scheduler_grpc scheduler|worker|server` process (as `scheduler-grpc up`
and tests/engine_helpers.py start them). Every role gets two fault proxies of its own, one to Redis
and one to PostgreSQL, so a fault can cut exactly one link of one process (on a Valkey Cluster, the
PostgreSQL one only: the cluster's faults are its nodes'). A remote worker (issue
23: the Python SDK's `Worker` in a process of its own, `chaos.remote_worker`) is a role too, with
one link: its gRPC connection to a server. A role the suite stops or kills is remembered as such:
at the end, any other role that is not running died on its own.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from chaos.proxy import FaultProxy
from scheduler_grpc.config import cluster_url
from scheduler_grpc.processes import die_with_parent

ROOT = Path(__file__).resolve().parent.parent
SDK_WORKER = "sdk-worker"


def _with_host_port(url: str, port: int) -> str:
    parts = urlsplit(url)
    user = f"{parts.username}@" if parts.username else ""
    return urlunsplit(parts._replace(netloc=f"{user}127.0.0.1:{port}"))


def process_alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie waiting for its reaper does not)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@dataclass
class RoleProcess:
    """One role process and its links.

    Attributes:
        name: Unique within the run ("scheduler-1", "worker-2", "sdk-worker-1", ...); also its
            SCHEDULER_INSTANCE.
        kind: "scheduler", "worker" or "server" (`python -m scheduler_grpc KIND`), or "sdk-worker"
            (`python -m chaos.remote_worker`).
        links: Its proxies by what they reach: "redis" and "postgres" for the service's roles
            ("postgres" only on a Valkey Cluster), "grpc" (a server) for an SDK worker.
        ended_by_suite: How the suite ended it ("kill -9", "SIGTERM", ...), or "" if it did not.
        spawned_at: When its current process was started (before it could do anything).
    """

    name: str
    kind: str
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    links: dict[str, FaultProxy]
    process: subprocess.Popen[bytes] | None = None
    ended_by_suite: str = ""
    generation: int = 0
    history: list[str] = field(default_factory=list)
    spawned_at: datetime = field(default_factory=lambda: datetime.now(UTC))

    @property
    def redis_link(self) -> FaultProxy:
        """The proxy this role reaches Redis through."""
        return self.links["redis"]

    @property
    def pg_link(self) -> FaultProxy:
        """The proxy this role reaches PostgreSQL through."""
        return self.links["postgres"]

    @property
    def grpc_link(self) -> FaultProxy:
        """The proxy an SDK worker reaches its server through."""
        return self.links["grpc"]

    @property
    def command(self) -> list[str]:
        if self.kind == SDK_WORKER:
            return [sys.executable, "-m", "chaos.remote_worker", *self.argv]
        return [sys.executable, "-m", "scheduler_grpc", self.kind, *self.argv]

    def start(self) -> None:
        self.generation += 1
        self.spawned_at = datetime.now(UTC)
        self.ended_by_suite = ""
        with open(self.log_path, "ab") as log:
            log.write(f"=== start #{self.generation} ===\n".encode())
            log.flush()
            self.process = subprocess.Popen(
                die_with_parent(signal.SIGKILL, self.command),
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=ROOT,
            )

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def returncode(self) -> int | None:
        return None if self.process is None else self.process.poll()

    def signal(self, signum: int, *, ends: bool = False) -> None:
        """Send `signum` by pid; `ends` records that the suite meant to end the process."""
        if ends:
            self.ended_by_suite = signal.Signals(signum).name
        self.history.append(signal.Signals(signum).name)
        if self.alive():
            os.kill(self.pid, signum)

    def kill9(self) -> None:
        self.signal(signal.SIGKILL, ends=True)
        assert self.process is not None
        self.process.wait()

    def pause(self) -> None:
        self.signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.signal(signal.SIGCONT)

    def terminate(self, timeout: float = 40.0) -> int | None:
        """SIGTERM (after SIGCONT, in case it is paused) and wait; SIGKILL past `timeout`."""
        if self.process is None:
            return None
        if self.alive():
            self.ended_by_suite = self.ended_by_suite or "SIGTERM"
            os.kill(self.pid, signal.SIGCONT)
            os.kill(self.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.ended_by_suite = "SIGKILL after SIGTERM timed out"
                self.process.kill()
                self.process.wait()
        return self.process.returncode

    def wait_exit(self, timeout: float = 40.0) -> int | None:
        """Wait for the process to exit on its own (after a signal); SIGKILL past `timeout`."""
        if self.process is None:
            return None
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.ended_by_suite = "SIGKILL: did not exit in time"
            self.process.kill()
            self.process.wait()
        return self.process.returncode

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def log_lines(self) -> list[str]:
        return self.log_text().splitlines()

    def logged(self, event: str) -> int:
        """How many log lines carry this message (the JSON logs' `"message"` field)."""
        needle = f'"{event}"'
        return sum(needle in line for line in self.log_lines())

    def metrics_port(self) -> int | None:
        for line in reversed(self.log_lines()):
            if '"metrics listening"' in line:
                return int(json.loads(line)["metrics_port"])
        return None


class Cluster:
    """The role processes of one scenario, each with its own Redis and PostgreSQL links.

    Args:
        redis_url: The real Redis (proxies forward to it), or a Valkey Cluster's `redis+cluster://`
            URL (the roles reach its nodes directly: a role has no `redis` link then).
        database_url: The real database of this scenario.
        log_dir: Where each role's log goes (`<name>.log`).
        env: Settings for every role (SCHEDULER_*), on top of a clean environment.
    """

    def __init__(self, redis_url: str, database_url: str, log_dir: Path, env: dict[str, str]) -> None:
        self.redis_url = redis_url
        self.database_url = database_url
        self.log_dir = log_dir
        self.env = {
            **{k: v for k, v in os.environ.items() if not k.startswith(("SCHEDULER_", "REDIS_URL", "DATABASE_URL"))},
            "SCHEDULER_ENV": "dev",
            "SCHEDULER_LOG_FORMAT": "json",
            "SCHEDULER_LOG_LEVEL": "INFO",
            "SCHEDULER_METRICS_PORT": "0",
            "SCHEDULER_GRPC_PORT": "0",
            "SCHEDULER_HTTP_PORT": "0",
            **env,
        }
        self.roles: list[RoleProcess] = []
        self.proxies: list[FaultProxy] = []

    async def add(self, kind: str, *argv: str, **env: str) -> RoleProcess:
        """Start a new role process behind two fresh proxies (one: a Valkey Cluster's clients reach
        every node by the addresses the cluster announces, so they are not proxied)."""
        count = sum(role.kind == kind for role in self.roles) + 1
        name = f"{kind}-{count}"
        pg_parts = urlsplit(self.database_url)
        pg_link = await FaultProxy(f"{name}/postgres", "127.0.0.1", pg_parts.port or 5432).start()
        self.proxies.append(pg_link)
        links = {"postgres": pg_link}
        redis_url = self.redis_url
        if cluster_url(self.redis_url) is None:
            redis_parts = urlsplit(self.redis_url)
            links["redis"] = await FaultProxy(f"{name}/redis", "127.0.0.1", redis_parts.port or 6379).start()
            self.proxies.append(links["redis"])
            redis_url = _with_host_port(self.redis_url, links["redis"].port)
        role_env = {
            **self.env,
            **env,
            "SCHEDULER_INSTANCE": name,
            "REDIS_URL": redis_url,
            "DATABASE_URL": _with_host_port(self.database_url, pg_link.port),
        }
        role = RoleProcess(name, kind, list(argv), role_env, self.log_dir / f"{name}.log", links)
        role.start()
        self.roles.append(role)
        return role

    async def add_sdk_worker(self, server: str, *argv: str, **env: str) -> RoleProcess:
        """Start a remote worker process (`chaos.remote_worker`, the Python SDK) that reaches the
        gRPC server at `server` (`host:port`) through a fresh proxy of its own (`grpc_link`);
        `argv` are its arguments after `--target`."""
        count = sum(role.kind == SDK_WORKER for role in self.roles) + 1
        name = f"{SDK_WORKER}-{count}"
        host, _, port = server.rpartition(":")
        grpc_link = await FaultProxy(f"{name}/grpc", host or "127.0.0.1", int(port)).start()
        self.proxies.append(grpc_link)
        role_env = {**self.env, **env, "SCHEDULER_INSTANCE": name}
        role = RoleProcess(
            name, SDK_WORKER, ["--target", grpc_link.url_host_port, *argv], role_env, self.log_dir / f"{name}.log",
            {"grpc": grpc_link},
        )  # fmt: skip
        role.start()
        self.roles.append(role)
        return role

    def of(self, kind: str) -> list[RoleProcess]:
        return [role for role in self.roles if role.kind == kind]

    def by_pid(self, pid: int) -> RoleProcess | None:
        return next((role for role in self.roles if role.process is not None and role.pid == pid), None)

    def by_holder(self, holder: str | None) -> RoleProcess | None:
        """The scheduler whose holder name (`<instance>:<pid>`) is `holder`."""
        if not holder:
            return None
        name, _, pid = holder.rpartition(":")
        return next((r for r in self.of("scheduler") if r.name == name and pid == str(r.pid) and r.alive()), None)

    def by_worker_id(self, worker_id: str | None) -> RoleProcess | None:
        """The worker whose id (`host:pid:random`) is `worker_id`."""
        if not worker_id:
            return None
        parts = worker_id.split(":")
        if len(parts) < 3 or not parts[-2].isdigit():
            return None
        return next((r for r in self.of("worker") if r.process is not None and r.pid == int(parts[-2])), None)

    def heal_all(self) -> None:
        for proxy in self.proxies:
            proxy.heal()

    async def stop(self) -> dict[str, int | None]:
        """SIGTERM every role still running (exit codes by name), then close the proxies."""
        codes: dict[str, int | None] = {}
        for role in self.roles:
            role.resume()
        self.heal_all()
        results = await asyncio.gather(*(asyncio.to_thread(role.terminate) for role in self.roles))
        for role, code in zip(self.roles, results, strict=True):
            codes[role.name] = code
        for proxy in self.proxies:
            await proxy.close()
        return codes
