"""`scheduler-grpc up`: the whole topology on one machine, one process per role.

gRPC and fork don't mix, so every role is its own freshly exec'd process. The supervisor starts
embedded servers when no URL is set (dev mode), applies migrations once, starts the roles, and on
Ctrl-C/SIGTERM stops them (SIGTERM, then SIGKILL after the grace period) before the servers.
It prints the "up" banner once every role is ready: the gRPC server's health check answers SERVING,
its web console accepts connections, and every role's /metrics answers (a role serves it only once
it has reached Redis and PostgreSQL), so what the banner says to try works at once.
If a role exits on its own, the supervisor logs its exit code and starts it again after a backoff
(0.5 s, doubling up to 30 s; back to 0.5 s once the role stayed up a minute), so one role's crash
(a bug, or a job that kills its worker) never stops the others. Only Ctrl-C/SIGTERM stops `up`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from scheduler_grpc.config import SETTINGS, Settings
from scheduler_grpc.connections import connect
from scheduler_grpc.embedded import embedded_servers
from scheduler_grpc.errors import ConfigError
from scheduler_grpc.processes import die_with_parent

log = logging.getLogger(__name__)

GRACE_SECONDS = 20.0
RESTART_FIRST_S = 0.5
"""Wait before restarting a role that exited; doubled after each quick exit, up to RESTART_MAX_S."""
RESTART_MAX_S = 30.0
RESTART_RESET_S = 60.0
"""A role that stayed up this long is healthy again: its next exit restarts it after RESTART_FIRST_S."""
READY_TIMEOUT_SECONDS = 120.0
DEFAULT_SCHEDCTL_TARGET = "127.0.0.1:50051"
"""Where schedctl connects without `--server` or `SCHEDCTL_SERVER` (scheduler_client.client.DEFAULT_TARGET)."""
_POLL_SECONDS = 0.2


@dataclass(frozen=True)
class Child:
    name: str
    argv: list[str]
    metrics_port: int


def add_arguments(parser: argparse.ArgumentParser) -> None:
    # `--metrics-base` is a setting (SCHEDULER_METRICS_BASE), added with the others by config.add_flags.
    parser.add_argument("--schedulers", type=int, default=2, help="scheduler processes (1 leader + standbys)")
    parser.add_argument("--workers", type=int, default=3, help="worker processes")


def _children(settings: Settings, args: argparse.Namespace) -> list[Child]:
    """The roles to run, each with its /metrics port counted from SCHEDULER_METRICS_BASE.

    Raises:
        ConfigError: the last worker's port would pass 65535.
    """
    # The role commands of `scheduler-grpc` (cli.COMMANDS); not imported from cli, which imports
    # this module for `up`.
    script = [sys.executable, "-m", "scheduler_grpc"]
    base = settings.metrics_base
    if base + 9 + args.workers > 65535 or base + args.schedulers > 65535:
        raise ConfigError(
            f"SCHEDULER_METRICS_BASE (--metrics-base) {base} is too high: worker {args.workers} would listen "
            f"on {base + 9 + args.workers}, past port 65535"
        )
    children = [Child("server", [*script, "server"], base)]
    children += [Child(f"scheduler-{i}", [*script, "scheduler"], base + i) for i in range(1, args.schedulers + 1)]
    children += [Child(f"worker-{i}", [*script, "worker"], base + 9 + i) for i in range(1, args.workers + 1)]
    return children


def child_environment(
    args: argparse.Namespace, environ: Mapping[str, str], redis_url: str, database_url: str
) -> dict[str, str]:
    """The environment of every role `up` starts: its own, the settings given to `up` as flags
    (`--grpc-port 50071` reaches the server as SCHEDULER_GRPC_PORT: a flag beats the environment, as
    it does for `up` itself), and the servers' URLs."""
    given = {
        setting.env: str(value) for setting in SETTINGS if (value := getattr(args, setting.attr, None)) is not None
    }
    return {**environ, **given, "REDIS_URL": redis_url, "DATABASE_URL": database_url}


async def run_topology(settings: Settings, args: argparse.Namespace, stop: asyncio.Event) -> int:
    """Run until `stop` is set, restarting any role that exits; return the exit code."""
    if settings.production and not (settings.redis_url and settings.database_url):
        raise ConfigError("SCHEDULER_ENV=production needs REDIS_URL and DATABASE_URL: embedded servers are for dev")
    children = _children(settings, args)
    with embedded_servers(
        settings.data_dir,
        redis_url=settings.redis_url,
        database_url=settings.database_url,
        throwaway=False,
    ) as urls:
        settings = settings.with_urls(urls.redis_url, urls.database_url)
        async with connect(settings):
            pass  # proves both servers answer and applies migrations once, before the roles race
        env = child_environment(args, os.environ, urls.redis_url, urls.database_url)
        env_file = _write_env_file(settings, urls.redis_url, urls.database_url)
        print(f"scheduler-grpc: starting {len(children)} roles ...", file=sys.stderr, flush=True)

        async def announce() -> None:
            waiting = await _wait_ready(settings, children)
            if waiting:
                log.warning("roles not ready yet; printing the banner anyway", extra={"roles": ", ".join(waiting)})
            _banner(settings, children, urls.redis_url, urls.database_url, env_file)

        try:
            return await _supervise(children, env, stop, announce)
        finally:
            env_file.unlink(missing_ok=True)  # the servers stop with us: their URLs stop working


def _write_env_file(settings: Settings, redis_url: str, database_url: str) -> Path:
    """Where other shells (the README's snippets, schedctl) find this topology's servers."""
    path = settings.data_dir.resolve() / "dev" / "env"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        f"REDIS_URL={redis_url}\nDATABASE_URL={database_url}\nSCHEDCTL_SERVER={_schedctl_target(settings)}\n"
    )
    return path


def _schedctl_target(settings: Settings) -> str:
    """The address schedctl reaches this topology's gRPC server at."""
    return f"{_local(settings.grpc_host or '')}:{settings.grpc_port}"


def schedctl_line(settings: Settings) -> str:
    """The schedctl command that logs in to this topology: `SCHEDCTL_SERVER` set when schedctl's
    default (127.0.0.1:50051) is not where the server listens, `--tls` with TLS, the dev password
    only when it is the dev default."""
    target = _schedctl_target(settings)
    words = [] if target == DEFAULT_SCHEDCTL_TARGET else [f"export SCHEDCTL_SERVER={target};"]
    words += ["schedctl", *(["--tls"] if settings.tls_cert else []), "login", "--username", settings.admin_username]
    if not settings.admin_password:
        words += ["--password", "admin123"]
    return " ".join(words)


def _banner(settings: Settings, children: list[Child], redis_url: str, database_url: str, env_file: Path) -> None:
    roles = ", ".join(child.name for child in children)
    metrics = ", ".join(f"{child.name} :{child.metrics_port}" for child in children)
    grpc_lines = []
    if any(child.name == "server" for child in children):
        address = f"{settings.grpc_host or '127.0.0.1'}:{settings.grpc_port}"
        login = "admin / admin123 (dev default)" if not settings.admin_password else settings.admin_username
        grpc_lines = [
            f"  gRPC:         {address}  (reflection + grpc.health.v1)",
            f"  login:        {login}",
            *([f"  web console:  {_console_url(settings)}"] if settings.http_enabled else []),
            f"  schedctl:     {schedctl_line(settings)}",
        ]
    lines = [
        "",
        "scheduler-grpc is up (Ctrl-C stops everything)",
        *grpc_lines,
        f"  roles:        {roles}",
        f"  /metrics:     http://127.0.0.1:<port>/metrics  ({metrics})",
        f"  REDIS_URL:    {redis_url}",
        f"  DATABASE_URL: {database_url}",
        f"  in a shell:   set -a; . {env_file}; set +a",
        "",
    ]
    print("\n".join(lines), file=sys.stderr, flush=True)


def _console_url(settings: Settings) -> str:
    scheme = "https" if settings.tls_cert else "http"
    return f"{scheme}://{_local(settings.http_host or '')}:{settings.http_port}/"


def _local(host: str) -> str:
    return "127.0.0.1" if host in ("", "0.0.0.0", "::") else host  # a wildcard address is reached on loopback


async def _metrics_answer(host: str, port: int) -> bool:
    try:
        async with asyncio.timeout(1):
            reader, writer = await asyncio.open_connection(host, port)
            try:
                writer.write(b"GET /metrics HTTP/1.0\r\nHost: localhost\r\n\r\n")
                await writer.drain()
                status = await reader.readline()
            finally:
                writer.close()
    except (OSError, TimeoutError):
        return False
    return status.split(b" ")[1:2] == [b"200"]


async def _console_answers(settings: Settings) -> bool:
    """Whether the web console accepts connections (true when it is disabled)."""
    if not settings.http_enabled:
        return True
    try:
        async with asyncio.timeout(1):
            _, writer = await asyncio.open_connection(_local(settings.http_host or ""), settings.http_port)
            writer.close()
    except (OSError, TimeoutError):
        return False
    return True


async def _grpc_serving(target: str) -> bool:
    import grpc  # only here: the supervisor has started every child by now (gRPC and fork don't mix)
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    stub: Any = health_pb2_grpc.HealthStub  # grpcio-health-checking ships no type hints
    try:
        async with grpc.aio.insecure_channel(target) as channel:
            reply = await stub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1)
    except grpc.aio.AioRpcError:
        return False
    return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)


async def _wait_ready(settings: Settings, children: list[Child]) -> list[str]:
    """Poll until every role is ready (at most READY_TIMEOUT_SECONDS); the names still not ready."""
    host = _local(settings.metrics_host)
    target = f"{_local(settings.grpc_host or '')}:{settings.grpc_port}"
    waiting = {child.name: child for child in children}
    deadline = asyncio.get_running_loop().time() + READY_TIMEOUT_SECONDS
    while waiting and asyncio.get_running_loop().time() < deadline:
        for name, child in list(waiting.items()):
            ready = await _metrics_answer(host, child.metrics_port)
            if ready and name == "server":
                ready = await _grpc_serving(target) and await _console_answers(settings)
            if ready:
                del waiting[name]
        if waiting:
            await asyncio.sleep(_POLL_SECONDS)
    return sorted(waiting)


async def _supervise(
    children: list[Child], env: dict[str, str], stop: asyncio.Event, announce: Callable[[], Coroutine[Any, Any, None]]
) -> int:
    """Start every role, restart each one that exits (with backoff) until `stop` is set, then stop them."""
    processes: dict[str, asyncio.subprocess.Process] = {}

    async def start(child: Child) -> None:
        process = processes[child.name] = await asyncio.create_subprocess_exec(
            *die_with_parent(signal.SIGTERM, child.argv),
            env={**env, "SCHEDULER_INSTANCE": child.name, "SCHEDULER_METRICS_PORT": str(child.metrics_port)},
            stdin=asyncio.subprocess.DEVNULL,
            start_new_session=True,  # Ctrl-C reaches the supervisor only; it stops roles in order
        )
        log.info("role started", extra={"role_name": child.name, "child_pid": process.pid})

    try:
        for child in children:
            await start(child)
        async with asyncio.TaskGroup() as group:
            announcer = group.create_task(announce(), name="announce")
            for child in children:
                group.create_task(_keep(child, processes, start, stop), name=f"keep-{child.name}")
            await stop.wait()
            announcer.cancel()
        return 0
    finally:
        await _stop_all(processes)


async def _keep(
    child: Child,
    processes: dict[str, asyncio.subprocess.Process],
    start: Callable[[Child], Coroutine[Any, Any, None]],
    stop: asyncio.Event,
) -> None:
    """Start `child` again whenever it exits, after a backoff, until `stop` is set.

    Never cancelled on a normal stop (it returns as soon as `stop` is set), so a restart is never
    cut between the process's creation and its entry in `processes`, which `_stop_all` stops.
    """
    loop = asyncio.get_running_loop()
    delay = RESTART_FIRST_S
    while True:
        started = loop.time()
        process = processes[child.name]
        if await _stopped_first(process.wait(), stop):
            return
        exited = process.returncode
        if loop.time() - started >= RESTART_RESET_S:
            delay = RESTART_FIRST_S
        log.error(
            "role exited; restarting it",
            extra={"role_name": child.name, "exit_code": exited, "restart_in_s": delay},
        )
        if await _stopped_first(asyncio.sleep(delay), stop):
            return
        await start(child)
        delay = min(delay * 2, RESTART_MAX_S)


async def _stopped_first(awaitable: Coroutine[Any, Any, Any], stop: asyncio.Event) -> bool:
    """Await `awaitable`, or give it up as soon as `stop` is set: True if `stop` came first."""
    work = asyncio.ensure_future(awaitable)
    stopped = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait([work, stopped], return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (work, stopped):
            task.cancel()
        await asyncio.gather(work, stopped, return_exceptions=True)
    if stop.is_set():
        return True
    work.result()  # its exception, if any (a bug): the task group ends `up`, which stops every role
    return False


async def _stop_all(processes: dict[str, asyncio.subprocess.Process]) -> None:
    running = [process for process in processes.values() if process.returncode is None]
    for process in running:
        with contextlib.suppress(ProcessLookupError):
            process.terminate()
    try:
        async with asyncio.timeout(GRACE_SECONDS):
            await asyncio.gather(*(process.wait() for process in running))
    except TimeoutError:
        for process in running:
            if process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    process.kill()
        await asyncio.gather(*(process.wait() for process in running))
