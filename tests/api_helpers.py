"""Shared pieces of the API tests: a server process (with scheduler and workers) and waiting for it.

`start_api(roles, redis)` starts `scheduler-grpc scheduler`, `worker` and `server` processes on the
test servers (through the `roles` fixture) and returns once the server answers a Login as the dev
admin and the worker beats.
"""

from __future__ import annotations

import random
import socket
from dataclasses import dataclass

from redis.asyncio import Redis
from scheduler_client import SchedulerClient
from scheduler_client.errors import DeadlineExceeded, Unavailable

from tests.engine_helpers import Role, Roles, eventually, wait_until_ready

ADMIN = "admin"
ADMIN_PASSWORD = "admin123"  # the dev default: SCHEDULER_ADMIN_PASSWORD is unset in the tests


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _ephemeral_floor() -> int:
    """The lowest port the kernel hands to outgoing connections (32768 where /proc says nothing)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as ports:
            return int(ports.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def metrics_base(workers: int = 1, schedulers: int = 1) -> int:
    """A SCHEDULER_METRICS_BASE for `up` whose every role's port (server base, scheduler-i base+i,
    worker-i base+9+i) is free now. Below the kernel's ephemeral range: there, base+10 may be the
    local end of any test's outgoing connection, and a role that cannot bind its /metrics port
    restarts forever while `up` waits for it (a CI run's console tests once timed out so)."""
    offsets = [0, *range(1, schedulers + 1), *range(10, 10 + workers)]
    top = min(_ephemeral_floor(), 65536) - 20
    for _ in range(100):
        base = random.randrange(10_000, max(top, 10_001))
        if all(_free(base + offset) for offset in offsets):
            return base
    raise AssertionError("no free metrics ports")


@dataclass
class Api:
    target: str
    server: Role


def start_server(roles: Roles, port: int | None = None, **env: str) -> Api:
    port = port or free_port()
    server = roles.start("server", SCHEDULER_GRPC_PORT=str(port), **env)
    return Api(f"127.0.0.1:{port}", server)


async def wait_for_server(api: Api, *, within: float = 30.0) -> None:
    """Until the server accepts a Login of the dev admin (so it listens and its admin exists)."""

    async def answers() -> bool:
        if api.server.process.poll() is not None:
            tail = "\n".join(api.server.log_lines()[-20:])
            raise AssertionError(f"the server exited with {api.server.process.returncode}:\n{tail}")
        try:
            async with SchedulerClient.connect(api.target, timeout=2.0) as client:
                await client.login(ADMIN, ADMIN_PASSWORD)
        except (Unavailable, DeadlineExceeded):
            return False  # not listening yet
        return True

    await eventually(answers, within=within, interval=0.1)


async def start_api(roles: Roles, redis: Redis, *, workers: int = 1, scheduler: bool = True) -> Api:
    """Scheduler, workers and a server on a free port; returns when all are ready."""
    if scheduler:
        roles.start("scheduler")
    for _ in range(workers):
        roles.start("worker")
    api = start_server(roles)
    await wait_for_server(api)
    await wait_until_ready(redis, workers=workers, leader=scheduler)
    return api
