"""The `scheduler-grpc` console script: one subcommand per role, plus `migrate` and `up`.

Errors a user can fix (bad settings, unreachable servers) print as one line and exit with 2;
nothing prints a traceback to the user.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import uvloop

from scheduler_grpc import config, logs, tracing
from scheduler_grpc.config import Settings
from scheduler_grpc.errors import ConfigError, SchedulerError

log = logging.getLogger("scheduler_grpc.cli")

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130
# The roles that make spans when the OTEL_* variables turn tracing on (`up` only supervises them).
TRACED_ROLES = frozenset({"server", "scheduler", "worker"})


@dataclass(frozen=True)
class Command:
    name: str
    help: str
    main: Callable[[Settings, argparse.Namespace, asyncio.Event], Coroutine[Any, Any, int]]
    add_arguments: Callable[[argparse.ArgumentParser], None] | None = None


async def _migrate(settings: Settings, args: argparse.Namespace, stop: asyncio.Event) -> int:
    from scheduler_grpc.connections import connect_database
    from scheduler_grpc.db.migrate import migrate

    async with connect_database(settings) as pool:
        applied = await migrate(pool)
    log.info("migrations applied" if applied else "schema is up to date", extra={"versions": applied})
    return 0


async def _up(settings: Settings, args: argparse.Namespace, stop: asyncio.Event) -> int:
    from scheduler_grpc.topology import run_topology

    return await run_topology(settings, args, stop)


def _add_up_arguments(parser: argparse.ArgumentParser) -> None:
    from scheduler_grpc.topology import add_arguments

    add_arguments(parser)


async def _scheduler(settings: Settings, args: argparse.Namespace, stop: asyncio.Event) -> int:
    from scheduler_grpc.scheduler import run_scheduler

    return await run_scheduler(settings, args, stop)


async def _server(settings: Settings, args: argparse.Namespace, stop: asyncio.Event) -> int:
    from scheduler_grpc.server import run_server

    return await run_server(settings, args, stop)


async def _worker(settings: Settings, args: argparse.Namespace, stop: asyncio.Event) -> int:
    from scheduler_grpc.worker import run_worker

    return await run_worker(settings, args, stop)


def _add_worker_arguments(parser: argparse.ArgumentParser) -> None:
    def slots(text: str) -> int:
        value = int(text)
        if value < 1:
            raise argparse.ArgumentTypeError("must be at least 1")
        return value

    parser.add_argument("--concurrency", type=slots, default=None, metavar="N",
                        help="jobs run at once (default SCHEDULER_WORKER_CONCURRENCY)")  # fmt: skip


async def _shards(settings: Settings, args: argparse.Namespace, stop: asyncio.Event) -> int:
    """`shards show`: every queue's shard history; `shards set QUEUE N`: N shards for the runs made
    from SCHEDULER_QUEUE_SHARD_LEAD after now on (see `sharding.py`)."""
    from scheduler_grpc.connections import connect_database
    from scheduler_grpc.db.migrate import migrate
    from scheduler_grpc.db.queue_shards import QueueShardRepository

    async with connect_database(settings) as pool:
        await migrate(pool)
        shards = QueueShardRepository(pool)
        if args.action == "set":
            if args.queue is None or args.count is None:
                raise ConfigError("usage: scheduler-grpc shards set QUEUE N")
            effective = await shards.set_shards(args.queue, args.count, lead=settings.queue_shard_lead)
            print(f"{args.queue}: {args.count} shard(s) for runs made from {effective.isoformat()}")
        _, histories = await shards.histories()
        for name, changes in sorted(histories.items()):
            steps = ", ".join(
                f"{c.shards} from {datetime.fromtimestamp(c.effective_ms / 1000, UTC).isoformat()}" for c in changes
            )
            print(f"{name}: {steps}; served: {max(c.shards for c in changes)}")
    return 0


def _add_shards_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=("show", "set"))
    parser.add_argument("queue", nargs="?", default=None)
    parser.add_argument("count", nargs="?", type=int, default=None, metavar="N")


COMMANDS: tuple[Command, ...] = (
    Command("migrate", "apply pending schema migrations (idempotent, safe to run concurrently)", _migrate),
    Command("server", "serve the gRPC API (with health checks and reflection) and /metrics", _server),
    Command("scheduler", "campaign for leadership; the leader schedules, recovers and reconciles", _scheduler),
    Command("worker", "execute jobs from the queue with bounded concurrency", _worker, _add_worker_arguments),
    Command("shards", "show the queues' shard counts, or set one (`shards set QUEUE N`)", _shards,
            _add_shards_arguments),
    Command("up", "run the whole topology as separate processes (embedded servers when no URL is set)",
            _up, _add_up_arguments),
)  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="scheduler-grpc", description="A distributed, cron-capable job scheduler.")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        sub = subparsers.add_parser(command.name, help=command.help, description=command.help)
        config.add_flags(sub)
        if command.add_arguments is not None:
            command.add_arguments(sub)
        sub.set_defaults(command_spec=command)
    return parser


async def _run(command: Command, settings: Settings, args: argparse.Namespace) -> int:
    """Run a command with SIGINT/SIGTERM wired to a graceful stop; a second signal cancels at once."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    task = asyncio.current_task()
    assert task is not None

    def on_signal() -> None:
        if stop.is_set():
            task.cancel()
        stop.set()

    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, on_signal)
    try:
        return await command.main(settings, args, stop)
    finally:
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(signum)


def main(argv: list[str] | None = None) -> None:
    """Entry point of the console script."""
    args = build_parser().parse_args(argv)
    command: Command = args.command_spec
    try:
        settings = config.load(os.environ, vars(args))
        logs.setup(command.name, settings.log_level, settings.log_format)
        if command.name in TRACED_ROLES:
            tracing.configure(command.name)
        try:
            code = uvloop.run(_run(command, settings, args))
        finally:
            tracing.shutdown()  # the spans still buffered go out (bounded by the exporter's timeout)
    except SchedulerError as exc:
        print(f"scheduler-grpc {command.name}: {exc}", file=sys.stderr)
        sys.exit(EXIT_USAGE)
    except (KeyboardInterrupt, asyncio.CancelledError):
        sys.exit(EXIT_INTERRUPTED)
    sys.exit(code)
