"""schedctl: the command line of scheduler-grpc, built on `SchedulerClient`.

    schedctl login --username admin --password admin123
    schedctl jobs create --name hello --handler test.log --payload '{"message": "hi"}' --cron '*/5 * * * * *'
    schedctl jobs trigger hello --wait
    schedctl executions list --job hello

Global flags (before or after the command): --server HOST:PORT (default $SCHEDCTL_SERVER or
127.0.0.1:50051), --json, --tls, --deadline SECONDS. `login` keeps the session token per server in
credentials.json (mode 0600) under $SCHEDCTL_CONFIG, else $XDG_CONFIG_HOME/schedctl, else
~/.config/schedctl; $SCHEDCTL_TOKEN (a token or an API key) overrides it.

Errors print one line `schedctl: <message>` on stderr: exit 2 for usage errors and INVALID_ARGUMENT,
1 for any other failure; never a traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import getpass
import json
import os
import re
import sys
import uuid
from collections.abc import Awaitable, Callable, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, NoReturn

from scheduler_client import _output as show
from scheduler_client.client import (
    CONCURRENCY_POLICY,
    DEFAULT_TARGET,
    DEFAULT_TIMEOUT,
    EVENT_TYPE,
    EXECUTION_STATE,
    FLOW_RUN_STATE,
    JOB_STATE,
    MISFIRE_POLICY,
    TRIGGER_RULE,
    SchedulerClient,
    to_datetime,
)
from scheduler_client.errors import (
    DeadlineExceeded,
    InvalidArgument,
    NotFound,
    SchedulerClientError,
    Unauthenticated,
    Unavailable,
)
from scheduler_client.v1 import executions_pb2, jobs_pb2

PROG = "schedctl"
EXIT_FAILURE = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130
CREDENTIALS_FILE = "credentials.json"


class UsageError(Exception):
    """A mistake in the command line: one line, exit 2."""


class CommandError(Exception):
    """A failure to report as one line, exit 1."""


class _Parser(argparse.ArgumentParser):
    """argparse that reports a usage error as one line (raised, printed by main)."""

    def error(self, message: str) -> NoReturn:
        where = self.prog.removeprefix(PROG).strip()
        raise UsageError(f"{where}: {message}" if where else message)


# --- settings and credentials --------------------------------------------------------------------


def config_dir(environ: dict[str, str] | None = None) -> Path:
    env = os.environ if environ is None else environ
    if env.get("SCHEDCTL_CONFIG"):
        return Path(env["SCHEDCTL_CONFIG"]).expanduser()
    base = Path(env["XDG_CONFIG_HOME"]).expanduser() if env.get("XDG_CONFIG_HOME") else Path.home() / ".config"
    return base / "schedctl"


class Credentials:
    """Session tokens per server in one JSON file readable only by its owner."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / CREDENTIALS_FILE

    def _load(self) -> dict[str, Any]:
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            raise CommandError(f"cannot read {self.path}: {exc}") from None
        return data if isinstance(data, dict) else {}

    def token(self, server: str) -> str | None:
        entry = self._load().get("servers", {}).get(server)
        token = entry.get("token") if isinstance(entry, dict) else None
        return token if isinstance(token, str) and token else None

    def store(self, server: str, entry: dict[str, Any] | None) -> None:
        data = self._load()
        servers = data.setdefault("servers", {})
        if entry is None:
            servers.pop(server, None)
        else:
            servers[server] = entry
        try:
            self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            temporary = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
            descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(descriptor, "w") as handle:
                os.fchmod(handle.fileno(), 0o600)
                json.dump(data, handle, indent=2)
                handle.write("\n")
            os.replace(temporary, self.path)
        except OSError as exc:
            raise CommandError(f"cannot write {self.path}: {exc}") from None


# --- argument values -------------------------------------------------------------------------------

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$")
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, None: 1.0}


def parse_duration(text: str) -> timedelta:
    """`250ms`, `10s`, `5m`, `2h`, `1d`, or plain seconds."""
    match = _DURATION.match(text)
    if not match:
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (e.g. 30s, 5m, 250ms)")
    return timedelta(seconds=float(match.group(1)) * _UNITS[match.group(2)])


def parse_time(text: str) -> datetime:
    """ISO 8601 (`2026-03-29T02:30:00+02:00`; without an offset: UTC), `now`, or `+DURATION` from now."""
    value = text.strip()
    if value == "now":
        return datetime.now(UTC)
    if value.startswith("+"):
        return datetime.now(UTC) + parse_duration(value[1:])
    try:
        moment = datetime.fromisoformat(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a time: {text!r} (ISO 8601, `now` or `+10m`)") from None
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)


def parse_payload(text: str) -> dict[str, Any]:
    """A JSON object, `@file.json`, or `-` for standard input."""
    source = text
    try:
        if text == "-":
            source = sys.stdin.read()
        elif text.startswith("@"):
            source = Path(text[1:]).expanduser().read_text()
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"cannot read {text[1:]}: {exc.strerror}") from None
    try:
        value = json.loads(source)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return value


def positive_seconds(text: str) -> float:
    seconds = parse_duration(text).total_seconds()
    if seconds <= 0:
        raise argparse.ArgumentTypeError("must be positive")
    return seconds


# --- commands --------------------------------------------------------------------------------------

Handler = Callable[["Context"], Awaitable[int]]


class Context:
    """What a command needs: parsed arguments, the connected client, the credentials."""

    def __init__(self, args: argparse.Namespace, client: SchedulerClient, credentials: Credentials) -> None:
        self.args = args
        self.client = client
        self.credentials = credentials
        self.json: bool = bool(args.json)

    async def job_id(self, reference: str) -> str:
        """A job id from an id or a name."""
        try:
            uuid.UUID(reference)
        except ValueError:
            return (await self.client.find_job(reference)).id
        return reference

    async def job_names(self) -> dict[str, str]:
        return {job.id: job.name async for job in self.client.iter_jobs(page_size=1000)}


def ask_credentials(args: argparse.Namespace) -> None:
    """Fill in `login`'s username and password from flags, the environment or prompts (before the loop)."""
    username = args.username or os.environ.get("SCHEDCTL_USERNAME") or ""
    password = args.password if args.password is not None else os.environ.get("SCHEDCTL_PASSWORD")
    if args.password_stdin:
        password = sys.stdin.readline().rstrip("\r\n")
    interactive = sys.stdin.isatty()
    if not username:
        if not interactive:
            raise UsageError("login: give --username (standard input is not a terminal)")
        username = input("Username: ").strip()
    if password is None:
        if not interactive:
            raise UsageError("login: give --password, --password-stdin or $SCHEDCTL_PASSWORD")
        password = getpass.getpass("Password: ")
    args.username, args.password = username, password


async def cmd_login(ctx: Context) -> int:
    args = ctx.args
    username, password = args.username, args.password
    response = await ctx.client.login(username, password)
    expires = to_datetime(response.expire_time)
    ctx.credentials.store(
        args.server,
        {
            "token": response.token,
            "username": username,
            "role": show.role(response.role),
            "expire_time": expires.isoformat() if expires else None,
        },
    )
    if ctx.json:
        show.print_json(
            {
                "server": args.server,
                "username": username,
                "role": show.role(response.role),
                "expireTime": expires.isoformat() if expires else None,
                "credentials": str(ctx.credentials.path),
            }
        )
    else:
        until = f"; session until {show.when(response.expire_time)}" if expires else ""
        print(f"Logged in to {args.server} as {username} (role {show.role(response.role)}){until}")
    return 0


async def cmd_logout(ctx: Context) -> int:
    server = ctx.args.server
    if ctx.credentials.token(server) is None:
        print(f"Not logged in to {server}")
        return 0
    try:
        await ctx.client.logout()
    except Unauthenticated:
        pass  # expired or revoked already: forgetting it is all that is left
    finally:
        ctx.credentials.store(server, None)
    print(f"Logged out of {server}")
    return 0


async def cmd_whoami(ctx: Context) -> int:
    me = await ctx.client.whoami()
    if ctx.json:
        show.print_json(show.message_dict(me))
    else:
        print(f"{me.principal} (role {show.role(me.role)}) on {ctx.args.server}")
    return 0


async def cmd_jobs_list(ctx: Context) -> int:
    args = ctx.args
    jobs = []
    view = "full" if ctx.json else "basic"  # the table shows no payload: don't fetch them
    async for job in ctx.client.iter_jobs(
        state=args.state, handler=args.handler, page_size=min(args.limit, 1000), view=view
    ):
        jobs.append(job)
        if len(jobs) >= args.limit:
            break
    if ctx.json:
        show.print_json({"jobs": [show.message_dict(job) for job in jobs]})
    else:
        show.print_table(*show.job_rows(jobs))
    return 0


def _show_job(ctx: Context, job: Any) -> int:
    if ctx.json:
        show.print_json(show.message_dict(job))
    else:
        show.print_fields(show.job_fields(job))
    return 0


def _job_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The job flags `jobs create` and `jobs update` share, as client keyword arguments."""
    names = ("payload", "cron", "time_zone", "run_at", "queue", "priority", "max_retries", "initial_backoff",
             "max_backoff", "jitter", "timeout", "misfire_policy", "concurrency_policy", "trigger_rule")  # fmt: skip
    settings = {name: getattr(args, name) for name in names}
    settings["depends_on"] = [] if getattr(args, "no_depends_on", False) else args.depends_on
    return settings


async def cmd_jobs_get(ctx: Context) -> int:
    job = await ctx.client.get_job(await ctx.job_id(ctx.args.job))
    return _show_job(ctx, job)


async def cmd_jobs_create(ctx: Context) -> int:
    args = ctx.args
    job = await ctx.client.create_job(
        args.name,
        args.handler,
        **_job_settings(args),
        request_id=args.request_id,
    )
    return _show_job(ctx, job)


async def cmd_jobs_update(ctx: Context) -> int:
    args = ctx.args
    job = await ctx.client.update_job(
        await ctx.job_id(args.job),
        etag=args.etag,
        name=args.name,
        handler=args.handler,
        **_job_settings(args),
    )
    return _show_job(ctx, job)


async def _job_action(ctx: Context, action: str) -> int:
    job_id = await ctx.job_id(ctx.args.job)
    method = {"pause": ctx.client.pause_job, "resume": ctx.client.resume_job}[action]
    job = await method(job_id)
    if ctx.json:
        show.print_json(show.message_dict(job))
    else:
        verb = "Paused" if action == "pause" else "Resumed"
        print(f"{verb} job {job.name} ({job.id}); next run {show.when(job.next_run_time)}")
    return 0


async def cmd_jobs_pause(ctx: Context) -> int:
    return await _job_action(ctx, "pause")


async def cmd_jobs_resume(ctx: Context) -> int:
    return await _job_action(ctx, "resume")


async def _flow_started(ctx: Context, run_id: str) -> None:
    """Say so when the triggered run started a flow run (its id is the run's: the job has dependents)."""
    try:
        flow = await ctx.client.get_flow_run(run_id)
    except NotFound:
        return
    print(f"Flow run {flow.id} started ({flow.node_count} jobs): schedctl flows get {flow.id}")


async def cmd_jobs_trigger(ctx: Context) -> int:
    args = ctx.args
    execution = await ctx.client.trigger_job(await ctx.job_id(args.job), request_id=args.request_id)
    if args.wait:
        if not ctx.json:
            print(f"Triggered {args.job}: execution {execution.id}; waiting for it to finish")
            await _flow_started(ctx, execution.run_id)
        execution = await ctx.client.wait_for_execution(execution.id, within=args.wait_timeout)
    if ctx.json:
        show.print_json(show.message_dict(execution))
    elif args.wait:
        print(f"Execution {execution.id} {show.execution_state(execution)} in {show.execution_took(execution)}"
              + (f": {execution.error}" if execution.error else ""))  # fmt: skip
    else:
        print(f"Triggered {args.job}: execution {execution.id} ({show.execution_state(execution)})")
        await _flow_started(ctx, execution.run_id)
    if args.wait and execution.state != executions_pb2.EXECUTION_STATE_SUCCEEDED:
        return EXIT_FAILURE
    return 0


async def cmd_jobs_delete(ctx: Context) -> int:
    job_id = await ctx.job_id(ctx.args.job)
    await ctx.client.delete_job(job_id, detach_dependents=ctx.args.detach_dependents)
    if ctx.json:
        show.print_json({"deleted": job_id})
    else:
        print(f"Deleted job {ctx.args.job}" + (f" ({job_id})" if job_id != ctx.args.job else ""))
    return 0


async def cmd_jobs_preview(ctx: Context) -> int:
    args = ctx.args
    times = await ctx.client.preview_schedule(args.cron, time_zone=args.time_zone, count=args.count,
                                              start_time=args.start)  # fmt: skip
    if ctx.json:
        show.print_json({"fireTimes": [show.message_dict(t) for t in times]})
    else:
        show.print_table(
            ["FIRE TIME (UTC)", "LOCAL TIME", "DST"],
            [[show.when(t.fire_time), t.local_time, show.label(jobs_pb2.DstEffect.Name(t.dst_effect))]
             for t in times],
        )  # fmt: skip
    return 0


async def cmd_executions_list(ctx: Context) -> int:
    args = ctx.args
    job_id = await ctx.job_id(args.job) if args.job else None
    executions = []
    async for execution in ctx.client.iter_executions(job_id=job_id, states=args.state or (),
                                                      page_size=min(args.limit, 1000),
                                                      flow_run_id=args.flow_run):  # fmt: skip
        executions.append(execution)
        if len(executions) >= args.limit:
            break
    if ctx.json:
        show.print_json({"executions": [show.message_dict(e) for e in executions]})
    else:
        if not executions:
            names: dict[str, str] = {}
        elif job_id is not None and job_id != args.job:
            names = {job_id: args.job}  # named on the command line
        else:
            names = await ctx.job_names()
        show.print_table(*show.execution_rows(executions, names))
    return 0


async def cmd_executions_get(ctx: Context) -> int:
    execution = await ctx.client.get_execution(ctx.args.execution)
    if ctx.json:
        show.print_json(show.message_dict(execution))
    else:
        show.print_fields(show.execution_fields(execution))
    return 0


async def cmd_executions_cancel(ctx: Context) -> int:
    execution = await ctx.client.cancel_execution(ctx.args.execution)
    if ctx.json:
        show.print_json(show.message_dict(execution))
    else:
        print(f"Cancelling execution {execution.id}: now {show.execution_state(execution)}")
    return 0


async def cmd_executions_watch(ctx: Context) -> int:
    args = ctx.args
    job_ids = [await ctx.job_id(job) for job in args.job or ()]
    seen = 0
    if not ctx.json:
        print(show.event_header(), flush=True)
    events = ctx.client.watch_executions(job_ids=job_ids, types=args.type or (), handler=args.handler,
                                         cursor=args.cursor, flow_run_id=args.flow_run)  # fmt: skip
    async with contextlib.aclosing(events):
        async for event in events:
            if ctx.json:
                show.print_json(show.message_dict(event), indent=None)
            else:
                print(show.event_line(event), flush=True)
            seen += 1
            if args.count and seen >= args.count:
                break
    return 0


async def cmd_flows_get(ctx: Context) -> int:
    flow = await ctx.client.get_flow_run(ctx.args.flow_run)
    if ctx.json:
        show.print_json(show.message_dict(flow))
    else:
        print("\n".join(show.flow_lines(flow)))
    return 0


async def cmd_flows_list(ctx: Context) -> int:
    args = ctx.args
    root = await ctx.job_id(args.job) if args.job else None
    flows = []
    async for flow in ctx.client.iter_flow_runs(root_job_id=root, state=args.state, page_size=min(args.limit, 1000)):
        flows.append(flow)
        if len(flows) >= args.limit:
            break
    if ctx.json:
        show.print_json({"flow_runs": [show.message_dict(flow) for flow in flows]})
        return 0
    show.print_table(
        ["ID", "STARTED BY", "STATE", "JOBS DONE", "STARTED", "TOOK"],
        [
            [
                flow.id,
                flow.root_job_name,
                show.label(executions_pb2.FlowRunState.Name(flow.state)),
                f"{flow.finished_node_count}/{flow.node_count}",
                show.when(flow.create_time),
                show.span(flow.end_time.ToDatetime() - flow.create_time.ToDatetime()) if flow.HasField("end_time")
                else "-",
            ]
            for flow in flows
        ],
    )  # fmt: skip
    return 0


async def cmd_flows_cancel(ctx: Context) -> int:
    flow = await ctx.client.cancel_flow_run(ctx.args.flow_run)
    if ctx.json:
        show.print_json(show.message_dict(flow))
    else:
        print("\n".join(show.flow_lines(flow)))
    return 0


async def cmd_dlq_list(ctx: Context) -> int:
    args = ctx.args
    letters = []
    async for letter in ctx.client.iter_dead_letters(args.queue, page_size=min(args.limit, 1000)):
        letters.append(letter)
        if len(letters) >= args.limit:
            break
    if ctx.json:
        show.print_json({"deadLetters": [show.message_dict(letter) for letter in letters]})
    else:
        show.print_table(*show.dead_letter_rows(letters))
    return 0


async def _dlq_action(ctx: Context, action: str) -> int:
    args = ctx.args
    if bool(args.run_ids) == bool(args.all):
        raise UsageError(f"dlq {action}: give run ids or --all (not both)")
    method = ctx.client.requeue_dead_letters if action == "requeue" else ctx.client.purge_dead_letters
    done = await method(args.run_ids, all=args.all, queue=args.queue)
    if ctx.json:
        show.print_json({"runIds": done})
    else:
        verb = "Requeued" if action == "requeue" else "Purged"
        print(f"{verb} {len(done)} dead run{'s' if len(done) != 1 else ''}" + "".join(f"\n  {r}" for r in done))
    return 0


async def cmd_dlq_requeue(ctx: Context) -> int:
    return await _dlq_action(ctx, "requeue")


async def cmd_dlq_purge(ctx: Context) -> int:
    return await _dlq_action(ctx, "purge")


async def cmd_workers(ctx: Context) -> int:
    workers = await ctx.client.list_workers()
    if ctx.json:
        show.print_json({"workers": [show.message_dict(worker) for worker in workers]})
    else:
        show.print_table(*show.worker_rows(workers))
    return 0


async def cmd_handlers(ctx: Context) -> int:
    handlers = await ctx.client.list_handlers()
    if ctx.json:
        show.print_json({"handlers": [show.message_dict(handler) for handler in handlers]})
    else:
        show.print_table(*show.handler_rows(handlers))
    return 0


async def cmd_status(ctx: Context) -> int:
    status, stats = await asyncio.gather(ctx.client.get_scheduler_status(), ctx.client.get_queue_stats(ctx.args.queue))
    if ctx.json:
        show.print_json({"scheduler": show.message_dict(status), "queue": show.message_dict(stats)})
        return 0
    show.print_fields(
        [
            ("leader", status.leader if status.has_leader else "none (no scheduler leads)"),
            ("term", status.term if status.has_leader else "-"),
            ("leader since", show.when(status.leader_since_time) if status.has_leader else "-"),
            (
                f"queue {stats.queue or 'default'}",
                f"{stats.ready} ready, {stats.processing} running, {stats.delayed} delayed, {stats.dead} dead",
            ),
        ]
    )
    return 0


# --- the parser ------------------------------------------------------------------------------------


def _global_flags(parser: argparse.ArgumentParser, *, top: bool) -> None:
    """The same flags on the top parser (with defaults) and on every subcommand (without)."""

    def default(value: Any) -> Any:
        return value if top else argparse.SUPPRESS

    environ_server = os.environ.get("SCHEDCTL_SERVER") or DEFAULT_TARGET
    group = parser.add_argument_group("global options")
    group.add_argument(
        "--server",
        metavar="HOST:PORT",
        default=default(environ_server),
        help=f"the scheduler-grpc server (default $SCHEDCTL_SERVER or {DEFAULT_TARGET})",
    )
    group.add_argument(
        "--json",
        action="store_true",
        default=default(False),
        help="print JSON (one object; `executions watch`: one per line)",
    )
    group.add_argument(
        "--tls", action="store_true", default=default(False), help="connect with TLS (system root certificates)"
    )
    group.add_argument("--deadline", metavar="SECONDS", type=positive_seconds, default=default(DEFAULT_TIMEOUT),
                       help=f"deadline of each call (default {DEFAULT_TIMEOUT:g}s)")  # fmt: skip


def _job_flags(parser: argparse.ArgumentParser, *, update: bool) -> None:
    """The job definition flags of `jobs create` (name and handler required) and `jobs update`."""
    parser.add_argument("--name", required=not update, help="unique name: letters, digits and _ . : -")
    parser.add_argument("--handler", required=not update, help="what runs it, e.g. http.webhook (`schedctl handlers`)")
    parser.add_argument(
        "--payload",
        type=parse_payload,
        metavar="JSON",
        help="the handler's input: a JSON object, @file.json or - for stdin",
    )
    parser.add_argument("--cron", help="5 fields, or 6 with seconds first, e.g. '*/5 * * * * *'")
    parser.add_argument("--time-zone", metavar="ZONE", help="IANA time zone of --cron (default UTC)")
    parser.add_argument(
        "--run-at",
        type=parse_time,
        metavar="TIME",
        help="run once at this time: ISO 8601 (no offset: UTC), or +DURATION from now",
    )
    parser.add_argument("--queue", help="queue to run on (default: default)")
    parser.add_argument("--priority", type=int, help="-1000 (least urgent) to 1000 (most); default 0")
    parser.add_argument("--max-retries", type=int, metavar="N", help="retries after the first attempt (default 3)")
    parser.add_argument("--initial-backoff", type=parse_duration, metavar="DURATION", help="first retry delay (1s)")
    parser.add_argument("--max-backoff", type=parse_duration, metavar="DURATION", help="longest retry delay (5m)")
    parser.add_argument(
        "--jitter",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="add up to 20%% random jitter to retry delays (default on)",
    )
    parser.add_argument("--timeout", type=parse_duration, metavar="DURATION", help="longest an attempt runs (5m)")
    parser.add_argument("--misfire-policy", choices=MISFIRE_POLICY.choices(), help="slots missed with no leader")
    parser.add_argument("--concurrency-policy", choices=CONCURRENCY_POLICY.choices(), help="overlapping runs")
    parser.add_argument("--depends-on", action="append", metavar="JOB",
                        help="an upstream job, id or name (repeatable; on update: replaces the list)")  # fmt: skip
    parser.add_argument("--trigger-rule", choices=TRIGGER_RULE.choices(),
                        help="when it runs after its upstreams in a flow run (default all_succeeded)")  # fmt: skip
    if update:
        parser.add_argument("--no-depends-on", action="store_true", help="remove every upstream")
    if update:
        parser.add_argument("--etag", help="fail (ABORTED) if the job changed since it had this etag")
    else:
        parser.add_argument("--request-id", help="idempotency key: a retry with the same id returns the same job")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description="Command line of scheduler-grpc: jobs, executions, dead letters, cluster.",
                     epilog="Run `schedctl COMMAND --help` for a command's options.")  # fmt: skip
    _global_flags(parser, top=True)
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def command(where: Any, name: str, help_text: str, handler: Handler | None = None) -> argparse.ArgumentParser:
        sub: argparse.ArgumentParser = where.add_parser(name, help=help_text, description=help_text)
        _global_flags(sub, top=False)
        if handler is not None:
            sub.set_defaults(run=handler)
        return sub

    login = command(commands, "login", "log in and keep the session token for this server", cmd_login)
    login.add_argument("-u", "--username", help="user name (default $SCHEDCTL_USERNAME, else prompt)")
    login.add_argument("-p", "--password", help="password (default $SCHEDCTL_PASSWORD, else prompt)")
    login.add_argument("--password-stdin", action="store_true", help="read the password from standard input")
    command(commands, "logout", "end the session and forget its token", cmd_logout)
    command(commands, "whoami", "show who the stored token belongs to", cmd_whoami)

    jobs = command(commands, "jobs", "list, show, create, update, pause, resume, trigger and delete jobs")
    job_commands = jobs.add_subparsers(dest="jobs_command", metavar="ACTION", required=True)
    listing = command(job_commands, "list", "list jobs by name", cmd_jobs_list)
    listing.add_argument("--state", choices=JOB_STATE.choices(), help="only jobs in this state")
    listing.add_argument("--handler", help="only jobs of this handler")
    listing.add_argument("--limit", type=positive_int, default=1000, help="at most this many (default 1000)")
    get = command(job_commands, "get", "show one job", cmd_jobs_get)
    get.add_argument("job", metavar="JOB", help="job id or name")
    create = command(job_commands, "create", "create a job (cron, one-shot --run-at, or manual)", cmd_jobs_create)
    _job_flags(create, update=False)
    update = command(job_commands, "update", "change the given fields of a job (the others stay)", cmd_jobs_update)
    update.add_argument("job", metavar="JOB", help="job id or name")
    _job_flags(update, update=True)
    for name, handler, help_text in (
        ("pause", cmd_jobs_pause, "stop scheduling a job"),
        ("resume", cmd_jobs_resume, "schedule a paused job again"),
        ("delete", cmd_jobs_delete, "delete a job and its history"),
    ):
        sub = command(job_commands, name, help_text, handler)
        sub.add_argument("job", metavar="JOB", help="job id or name")
        if name == "delete":
            sub.add_argument("--detach-dependents", action="store_true",
                             help="delete it even if other jobs depend on it (they lose that upstream)")  # fmt: skip
    trigger = command(job_commands, "trigger", "run a job now", cmd_jobs_trigger)
    trigger.add_argument("job", metavar="JOB", help="job id or name")
    trigger.add_argument("--request-id", help="idempotency key: the same id never runs the job twice")
    trigger.add_argument(
        "--wait", action="store_true", help="wait until the attempt finishes; exit 1 unless it succeeded"
    )
    trigger.add_argument("--wait-timeout", type=positive_seconds, default=60.0, metavar="DURATION",
                         help="give up waiting after this long (default 60s)")  # fmt: skip
    preview = command(job_commands, "preview", "the next fire times of a cron expression (creates nothing)",
                      cmd_jobs_preview)  # fmt: skip
    preview.add_argument("--cron", required=True, help="the cron expression")
    preview.add_argument("--time-zone", metavar="ZONE", help="IANA time zone (default UTC)")
    preview.add_argument("--count", type=positive_int, default=10, help="how many (default 10)")
    preview.add_argument("--start", type=parse_time, metavar="TIME", help="start after this time (default now)")

    executions = command(commands, "executions", "list, show, cancel and watch executions")
    execution_commands = executions.add_subparsers(dest="executions_command", metavar="ACTION", required=True)
    listing = command(execution_commands, "list", "list executions, newest first", cmd_executions_list)
    listing.add_argument("--job", metavar="JOB", help="only this job's (id or name)")
    listing.add_argument("--state", action="append", choices=EXECUTION_STATE.choices(),
                         help="only executions in this state (repeatable)")  # fmt: skip
    listing.add_argument("--limit", type=positive_int, default=20, help="at most this many (default 20)")
    listing.add_argument("--flow-run", metavar="FLOW_RUN_ID", help="only this flow run's")
    get = command(execution_commands, "get", "show one execution", cmd_executions_get)
    get.add_argument("execution", metavar="EXECUTION", help="execution id")
    cancel = command(execution_commands, "cancel", "cancel a run", cmd_executions_cancel)
    cancel.add_argument("execution", metavar="EXECUTION", help="id of any attempt of the run")
    watch = command(execution_commands, "watch", "print execution events as they happen (Ctrl-C stops)",
                    cmd_executions_watch)  # fmt: skip
    watch.add_argument("--job", action="append", metavar="JOB", help="only this job's events (repeatable)")
    watch.add_argument("--type", action="append", choices=EVENT_TYPE.choices(), help="only these events (repeatable)")
    watch.add_argument("--handler", help="only this handler's events")
    watch.add_argument("--cursor", help="continue after this event cursor")
    watch.add_argument("--flow-run", metavar="FLOW_RUN_ID", help="only this flow run's events")
    watch.add_argument("--count", type=positive_int, help="stop after this many events")

    flows = command(commands, "flows", "show and cancel flow runs (job dependencies)")
    flow_commands = flows.add_subparsers(dest="flows_command", metavar="ACTION", required=True)
    get = command(flow_commands, "get", "draw a flow run's jobs as a tree with their states", cmd_flows_get)
    get.add_argument("flow_run", metavar="FLOW_RUN_ID", help="flow run id (the run id of the run that started it)")
    flow_list = command(flow_commands, "list", "list flow runs, newest first", cmd_flows_list)
    flow_list.add_argument("--job", metavar="JOB", help="only the flow runs this job started (name or id)")
    flow_list.add_argument("--state", choices=FLOW_RUN_STATE.choices(), help="only flow runs in this state")
    flow_list.add_argument("--limit", type=positive_int, default=50, help="at most this many (default 50)")
    cancel = command(flow_commands, "cancel", "cancel a flow run's queued, running and waiting jobs",
                     cmd_flows_cancel)  # fmt: skip
    cancel.add_argument("flow_run", metavar="FLOW_RUN_ID", help="flow run id")

    dlq = command(commands, "dlq", "list, requeue and purge dead-lettered runs")
    dlq_commands = dlq.add_subparsers(dest="dlq_command", metavar="ACTION", required=True)
    listing = command(dlq_commands, "list", "list dead runs, oldest first", cmd_dlq_list)
    listing.add_argument("--queue", help="the queue (default: default)")
    listing.add_argument("--limit", type=positive_int, default=100, help="at most this many (default 100)")
    for name, handler, help_text in (
        ("requeue", cmd_dlq_requeue, "give dead runs a new attempt"),
        ("purge", cmd_dlq_purge, "forget dead runs (their history stays)"),
    ):
        sub = command(dlq_commands, name, help_text, handler)
        sub.add_argument("run_ids", nargs="*", metavar="RUN_ID", help="runs to act on")
        sub.add_argument("--all", action="store_true", help="every dead run of the queue")
        sub.add_argument("--queue", help="the queue (default: default)")

    command(commands, "workers", "list live workers", cmd_workers)
    command(commands, "handlers", "list handlers and their circuit breakers", cmd_handlers)
    status = command(commands, "status", "scheduler leader, term and queue counts", cmd_status)
    status.add_argument("--queue", help="the queue (default: default)")
    return parser


# --- running -----------------------------------------------------------------------------------------


def _message(error: SchedulerClientError, args: argparse.Namespace, had_token: bool) -> str:
    server = args.server
    if isinstance(error, Unavailable):
        return f"cannot reach {server}: {error.message}"
    if isinstance(error, DeadlineExceeded) and error.message.lower() == "deadline exceeded":
        return f"{server} did not answer within {args.deadline:g}s"
    if isinstance(error, Unauthenticated) and args.command not in {"login", "logout"}:
        if not had_token:
            return f"not logged in to {server}: run `schedctl login`"
        return f"{error.message} (run `schedctl login`)"
    return error.message


async def _run(args: argparse.Namespace) -> int:
    credentials = Credentials(config_dir())
    token = os.environ.get("SCHEDCTL_TOKEN") or None
    if token is None and args.command != "login":
        token = credentials.token(args.server)
    async with SchedulerClient.connect(args.server, token=token, tls=bool(args.tls), timeout=args.deadline) as client:
        ctx = Context(args, client, credentials)
        run: Handler = args.run
        try:
            return await run(ctx)
        except InvalidArgument as error:
            raise UsageError(_message(error, args, token is not None)) from None
        except SchedulerClientError as error:
            raise CommandError(_message(error, args, token is not None)) from None


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `schedctl`; returns the exit status."""
    try:
        args = build_parser().parse_args(argv)
        if args.command == "login":
            ask_credentials(args)
        return asyncio.run(_run(args))
    except UsageError as error:
        _fail(str(error))
        return EXIT_USAGE
    except CommandError as error:
        _fail(str(error))
        return EXIT_FAILURE
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # The reader went away (`schedctl ... | head`): stop quietly.
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_FAILURE
    except Exception as error:  # a bug: still one line, but say what it was
        if os.environ.get("SCHEDCTL_DEBUG"):
            raise
        _fail(f"unexpected error ({type(error).__name__}): {error} (set SCHEDCTL_DEBUG=1 for a traceback)")
        return EXIT_FAILURE


def _fail(message: str) -> None:
    text = " ".join(message.split()) or "failed"
    sys.stderr.write(f"{PROG}: {text}\n")
    sys.stderr.flush()


if __name__ == "__main__":
    sys.exit(main())
