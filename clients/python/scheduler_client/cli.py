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
from collections.abc import Awaitable, Callable, Iterable, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, NoReturn

# First: before anything imports grpc (see _grpc_quiet).
from scheduler_client import _grpc_quiet  # noqa: F401
from scheduler_client import _output as show
from scheduler_client.client import (
    CONCURRENCY_POLICY,
    DEFAULT_TARGET,
    DEFAULT_TIMEOUT,
    EVENT_TYPE,
    EXECUTION_STATE,
    FLOW_RUN_STATE,
    JOB_STATE,
    LIMIT_KIND,
    MAX_TRIGGER_ITEMS,
    MISFIRE_POLICY,
    ROLE,
    TRIGGER_RULE,
    USER_STATE,
    SchedulerClient,
    TriggerItem,
    parse_limit_ref,
    to_datetime,
)
from scheduler_client.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    SchedulerClientError,
    Unauthenticated,
    Unavailable,
)
from scheduler_client.v1 import executions_pb2, jobs_pb2, limits_pb2, queue_pb2, users_pb2

PROG = "schedctl"
EXIT_FAILURE = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130
CREDENTIALS_FILE = "credentials.json"
NAME_CACHE_SIZE = 1000
"""Job names a command remembers (by id) while it runs, e.g. for the events of `executions watch`."""
NAME_LOOKUPS = 8
"""GetJob calls in flight at once when a table names its jobs."""

# A user's roles (`worker` is a role of API keys only: remote workers).
USER_ROLES = [role for role in ROLE.choices() if role != "worker"]


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
_MAX_DURATION_SECONDS = 315_576_000_000  # the largest google.protobuf.Duration: 10,000 years
_INT32 = (-(2**31), 2**31 - 1)


def parse_duration(text: str) -> timedelta:
    """`250ms`, `10s`, `5m`, `2h`, `1d`, or plain seconds."""
    match = _DURATION.match(text)
    if not match:
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (e.g. 30s, 5m, 250ms)")
    seconds = float(match.group(1)) * _UNITS[match.group(2)]
    if seconds > _MAX_DURATION_SECONDS:
        raise argparse.ArgumentTypeError(f"too long: {text!r} (at most 10,000 years)")
    return timedelta(seconds=seconds)


def parse_time(text: str) -> datetime:
    """ISO 8601 (`2026-03-29T02:30:00+02:00`; without an offset: UTC), `now`, or `+DURATION` from now."""
    value = text.strip()
    if value == "now":
        return datetime.now(UTC)
    if value.startswith("+"):
        try:
            return datetime.now(UTC) + parse_duration(value[1:])
        except OverflowError:
            raise argparse.ArgumentTypeError(f"too far ahead: {text!r} (after the year 9999)") from None
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


def int32(text: str) -> int:
    """A whole number the API's int32 fields can carry (the server checks its own range)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if not _INT32[0] <= value <= _INT32[1]:
        raise argparse.ArgumentTypeError(f"out of range: {value}")
    return value


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    if value > _INT32[1]:
        raise argparse.ArgumentTypeError(f"out of range: {value}")
    return value


def limit_ref_arg(text: str) -> limits_pb2.LimitRef:
    """`--limit NAME:KEY[:UNITS]` of `jobs create` / `jobs update`."""
    try:
        return parse_limit_ref(text)
    except InvalidArgument as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("limits: ")) from None


def override_arg(text: str) -> tuple[str, tuple[int, int]]:
    """`--override KEY=LIMIT[/BURST]` of `limits create` / `limits update`."""
    key, equals, value = text.rpartition("=")
    limit, _, burst = value.partition("/")
    if equals and key and limit.isdigit() and (not burst or burst.isdigit()):
        return key, (int(limit), int(burst or 0))
    raise argparse.ArgumentTypeError(f"not KEY=LIMIT[/BURST]: {text!r} (e.g. acme=5)")


def server_target(text: str) -> str:
    """`--server`: HOST:PORT (any gRPC target), not empty and without spaces."""
    value = text.strip()
    if not value or any(character.isspace() for character in value):
        raise argparse.ArgumentTypeError(f"not a server address: {text!r} (HOST:PORT, e.g. {DEFAULT_TARGET})")
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
        self._names: dict[str, str] = {}

    async def job_id(self, reference: str) -> str:
        """A job id from an id or a name."""
        try:
            uuid.UUID(reference)
        except ValueError:
            return (await self.client.find_job(reference)).id
        return reference

    async def job_name_map(self, job_ids: Iterable[str]) -> dict[str, str]:
        """Names of these jobs by id, asked NAME_LOOKUPS at a time."""
        ids = list(dict.fromkeys(job_ids))
        room = asyncio.Semaphore(NAME_LOOKUPS)

        async def name(job_id: str) -> str:
            async with room:
                return await self.job_name(job_id)

        return dict(zip(ids, await asyncio.gather(*(name(job_id) for job_id in ids)), strict=True))

    async def job_name(self, job_id: str) -> str:
        """A job's name from its id (the id itself for a job that is gone), remembered while the
        command runs (at most NAME_CACHE_SIZE of them)."""
        name = self._names.get(job_id)
        if name is not None:
            return name
        try:
            name = (await self.client.get_job(job_id)).name
        except NotFound:
            name = job_id  # deleted since: its id is all there is
        except SchedulerClientError:
            return job_id  # no name this time (e.g. a slow server): not remembered, asked again later
        if len(self._names) >= NAME_CACHE_SIZE:
            del self._names[next(iter(self._names))]  # the oldest
        self._names[job_id] = name
        return name


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


async def _show_job(ctx: Context, job: Any) -> int:
    if ctx.json:
        show.print_json(show.message_dict(job))
    else:
        names = await ctx.job_name_map(job.depends_on)
        show.print_fields(show.job_fields(job, names))
    return 0


def _job_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The job flags `jobs create` and `jobs update` share, as client keyword arguments."""
    names = ("payload", "cron", "time_zone", "run_at", "queue", "priority", "max_retries", "initial_backoff",
             "max_backoff", "jitter", "timeout", "misfire_policy", "concurrency_policy", "trigger_rule")  # fmt: skip
    settings = {name: getattr(args, name) for name in names}
    settings["depends_on"] = [] if getattr(args, "no_depends_on", False) else args.depends_on
    settings["limits"] = [] if getattr(args, "no_limits", False) else args.limits
    return settings


async def cmd_jobs_get(ctx: Context) -> int:
    job = await ctx.client.get_job(await ctx.job_id(ctx.args.job))
    return await _show_job(ctx, job)


def _one_schedule(args: argparse.Namespace) -> None:
    if args.cron and args.run_at is not None:
        raise UsageError("--cron, --run-at: give one of them (a cron or a one-shot job), not both")


async def cmd_jobs_create(ctx: Context) -> int:
    args = ctx.args
    _one_schedule(args)
    job = await ctx.client.create_job(
        args.name,
        args.handler,
        **_job_settings(args),
        request_id=args.request_id,
    )
    return await _show_job(ctx, job)


async def cmd_jobs_update(ctx: Context) -> int:
    args = ctx.args
    _one_schedule(args)
    job = await ctx.client.update_job(
        await ctx.job_id(args.job),
        etag=args.etag,
        name=args.name,
        handler=args.handler,
        **_job_settings(args),
    )
    return await _show_job(ctx, job)


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
    print(f"Flow run {flow.id} started ({flow.node_count} jobs): schedctl flows get {flow.id}", flush=True)


def read_trigger_items(source: str) -> list[tuple[int, dict[str, Any]]]:
    """The items of `jobs trigger --items FILE` (`-`: standard input): one JSON object per line,
    `{"job": "<id or name>", "payload": {...}, "request_id": "..."}` (payload and request_id
    optional), with their line numbers; blank lines are skipped."""
    try:
        text = sys.stdin.read() if source == "-" else Path(source).expanduser().read_text()
    except OSError as exc:
        raise UsageError(f"--items: cannot read {source}: {exc.strerror}") from None
    items: list[tuple[int, dict[str, Any]]] = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except ValueError as exc:
            raise UsageError(f"--items: line {number}: not valid JSON: {exc}") from None
        if not isinstance(item, dict) or not isinstance(item.get("job"), str) or not item["job"]:
            raise UsageError(f'--items: line {number}: expected an object with "job" (an id or name)')
        unknown = set(item) - {"job", "payload", "request_id"}
        if unknown:
            raise UsageError(f"--items: line {number}: unknown key {sorted(unknown)[0]!r} (job, payload, request_id)")
        if item.get("payload") is not None and not isinstance(item["payload"], dict):
            raise UsageError(f"--items: line {number}: payload must be a JSON object")
        if item.get("request_id") is not None and not isinstance(item["request_id"], str):
            raise UsageError(f"--items: line {number}: request_id must be a string")
        items.append((number, item))
    if not items:
        raise UsageError(f"--items: no items in {source}")
    return items


async def _trigger_many(ctx: Context) -> int:
    """`jobs trigger JOB --count N` or `jobs trigger --items FILE`: BatchTriggerJobs calls of up to
    1,000 items; one line per item that failed (stderr), exit 1 if any did."""
    args = ctx.args
    if args.items is not None:
        lines = read_trigger_items(args.items)
        ids = {ref: await ctx.job_id(ref) for ref in dict.fromkeys(item["job"] for _, item in lines)}
        items = [TriggerItem(ids[item["job"]], item.get("request_id"), item.get("payload")) for _, item in lines]
        where = [f"line {number}" for number, _ in lines]
    else:
        job_id = await ctx.job_id(args.job)
        items = [
            TriggerItem(job_id, f"{args.request_id}-{n}" if args.request_id else None, args.payload)
            for n in range(1, args.count + 1)
        ]
        where = [f"run {n}" for n in range(1, args.count + 1)]
    try:
        results = await ctx.client.batch_trigger_jobs(items)
    except InvalidArgument as error:
        found = re.match(r"requests\[(\d+)\]\.?(\S*): (.*)", error.message, re.DOTALL)
        if found is None or int(found[1]) >= len(where):
            raise
        field, text = found[2], found[3]
        if args.items is None:  # every run has the flags' values: name the flag
            inside = field.removeprefix("payload").lstrip(".")
            flag = {"id": "JOB", "request_id": "--request-id"}.get(field, "--payload")
            field = f"{flag}: {inside}" if flag == "--payload" and inside else flag
        raise UsageError(
            f"{where[int(found[1])]}: {field}: {text}" if field else f"{where[int(found[1])]}: {text}"
        ) from None
    failed = [
        (place, result)
        for place, result in zip(where, results, strict=True)
        if not isinstance(result, executions_pb2.Execution)
    ]
    if ctx.json:
        show.print_json({"results": [
            {"execution": show.message_dict(result)} if isinstance(result, executions_pb2.Execution)
            else {"error": {"code": result.code_name, "message": result.message}}
            for result in results
        ]})  # fmt: skip
    else:
        subject = args.job if args.items is None else f"{len(items)} items of {args.items}"
        print(f"Triggered {subject}: {len(results) - len(failed)} runs" + (f", {len(failed)} failed" if failed else ""))
    for place, problem in failed:
        assert isinstance(problem, SchedulerClientError)
        sys.stderr.write(f"{PROG}: {place}: {problem.code_name}: {' '.join(problem.message.split())}\n")
    return EXIT_FAILURE if failed else 0


async def cmd_jobs_trigger(ctx: Context) -> int:
    args = ctx.args
    if args.items is not None:
        if args.job is not None or args.count != 1 or args.payload is not None or args.request_id or args.wait:
            raise UsageError("--items: give JOB, --count, --payload, --request-id and --wait per item or not at all")
        return await _trigger_many(ctx)
    if args.job is None:
        raise UsageError("JOB: required (or --items FILE)")
    if args.count != 1:
        if args.wait:
            raise UsageError("--wait: only for one run (not with --count)")
        return await _trigger_many(ctx)
    execution = await ctx.client.trigger_job(await ctx.job_id(args.job), request_id=args.request_id,
                                             payload=args.payload)  # fmt: skip
    run_id = execution.run_id or execution.id
    if args.wait:
        if not ctx.json:
            print(f"Triggered {args.job}: run {run_id}; waiting for it to finish", flush=True)
            await _flow_started(ctx, run_id)
        # The run, not its first attempt: a failed attempt with retries left is not the outcome.
        execution = await ctx.client.wait_for_run(execution.id, within=args.wait_timeout)
    if ctx.json:
        show.print_json(show.message_dict(execution))
    elif args.wait:
        print(f"Run {run_id} {show.execution_state(execution)} in {show.execution_took(execution)} "
              f"(attempt {execution.attempt}, execution {execution.id})"
              + (f": {execution.error}" if execution.error else ""))  # fmt: skip
    else:
        print(f"Triggered {args.job}: execution {execution.id} ({show.execution_state(execution)})")
        await _flow_started(ctx, run_id)
    if args.wait and execution.state != executions_pb2.EXECUTION_STATE_SUCCEEDED:
        return EXIT_FAILURE
    return 0


async def cmd_jobs_delete(ctx: Context) -> int:
    job_id = await ctx.job_id(ctx.args.job)
    try:
        await ctx.client.delete_job(job_id, detach_dependents=ctx.args.detach_dependents)
    except FailedPrecondition as error:
        if "detach_dependents" not in error.message:
            raise
        # The API names its request field; here the way out is a flag.
        which = error.message.removeprefix("id: ").split("; ")[0]
        raise CommandError(f"{which}: delete or change them first, or run "
                           f"`schedctl jobs delete {ctx.args.job} --detach-dependents`") from None  # fmt: skip
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
            # The jobs these rows name, not every job (a page of executions names a few).
            names = await ctx.job_name_map(execution.job_id for execution in executions)
        show.print_table(*show.execution_rows(executions, names))
    return 0


async def cmd_executions_get(ctx: Context) -> int:
    execution = await ctx.client.get_execution(ctx.args.execution)
    if ctx.json:
        show.print_json(show.message_dict(execution))
    else:
        show.print_fields(show.execution_fields(execution, await ctx.job_name(execution.job_id)))
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
                print(show.event_line(event, await ctx.job_name(event.job_id)), flush=True)
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
    # The API acts on the runs it holds and answers with those: name the ones it did not hold.
    found = {_canonical(run_id) for run_id in done}
    missing = [run_id for run_id in dict.fromkeys(args.run_ids) if _canonical(run_id) not in found]
    if ctx.json:
        show.print_json({"runIds": done, "notFound": missing})
    elif done or not missing:
        verb = "Requeued" if action == "requeue" else "Purged"
        print(f"{verb} {len(done)} dead run{'s' if len(done) != 1 else ''}" + "".join(f"\n  {r}" for r in done))
    if missing:
        raise CommandError(f"not in the dead-letter queue {args.queue or 'default'}: {', '.join(missing)}")
    return 0


def _canonical(run_id: str) -> str:
    try:
        return str(uuid.UUID(run_id))
    except ValueError:
        return run_id


async def cmd_dlq_requeue(ctx: Context) -> int:
    return await _dlq_action(ctx, "requeue")


async def cmd_dlq_purge(ctx: Context) -> int:
    return await _dlq_action(ctx, "purge")


def _shard_row(queue: str, shards: int, served: int, changes: Sequence[queue_pb2.QueueShardChange]) -> list[object]:
    steps = ", ".join(f"{change.shards} from {show.when(change.effective_time)}" for change in changes)
    return [queue, shards, served, steps or "-"]


async def cmd_queues_shards_show(ctx: Context) -> int:
    headers = ["QUEUE", "SHARDS", "SERVED", "CHANGES"]
    if ctx.args.queue is not None:
        one = await ctx.client.get_queue_shards(ctx.args.queue)
        if ctx.json:
            show.print_json(show.message_dict(one))
        else:
            show.print_table(headers, [_shard_row(one.queue, one.shards, one.served_shards, one.changes)])
        return 0
    queues = [queue async for queue in ctx.client.iter_queue_shards(page_size=1000)]
    if ctx.json:
        show.print_json({"queues": [show.message_dict(queue) for queue in queues]})
    else:
        show.print_table(headers, [_shard_row(q.queue, q.shards, q.served_shards, q.changes) for q in queues])
    return 0


async def cmd_queues_shards_set(ctx: Context) -> int:
    change = await ctx.client.set_queue_shards(ctx.args.queue, ctx.args.shards)
    if ctx.json:
        show.print_json(show.message_dict(change))
    else:
        count = f"{change.shards} shard{'s' if change.shards != 1 else ''}"
        print(f"{ctx.args.queue}: {count} for the runs made from {show.when(change.effective_time)}")
    return 0


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


# --- users (admin only) ----------------------------------------------------------------------------


async def _user_id(ctx: Context, reference: str) -> str:
    """A user id from an id or a username."""
    try:
        uuid.UUID(reference)
    except ValueError:
        return (await ctx.client.find_user(reference)).id
    return reference


def _new_password(args: argparse.Namespace, what: str) -> str:
    """The new password of `users create` / `reset-password`: --password, --password-stdin,
    $SCHEDCTL_NEW_PASSWORD, else asked twice on a terminal (in a thread: it blocks)."""
    if args.password_stdin:
        return sys.stdin.readline().rstrip("\r\n")
    if args.password is not None:
        return str(args.password)
    environ = os.environ.get("SCHEDCTL_NEW_PASSWORD")
    if environ is not None:
        return environ
    if not sys.stdin.isatty():
        raise UsageError(f"{what}: give --password, --password-stdin or $SCHEDCTL_NEW_PASSWORD")
    first = getpass.getpass("New password: ")
    if getpass.getpass("Repeat it: ") != first:
        raise UsageError(f"{what}: the two passwords differ")
    return first


def _user_rows(users: Sequence[users_pb2.User]) -> tuple[list[str], list[list[object]]]:
    rows: list[list[object]] = [
        [user.username, show.role(user.role), USER_STATE.name(user.state).removeprefix("USER_STATE_").lower(),
         show.when(user.create_time), user.id]
        for user in users
    ]  # fmt: skip
    return ["USERNAME", "ROLE", "STATE", "CREATED", "ID"], rows


def _show_user(ctx: Context, user: users_pb2.User, done: str | None = None) -> int:
    if ctx.json:
        show.print_json(show.message_dict(user))
    elif done is not None:
        state = USER_STATE.name(user.state).removeprefix("USER_STATE_").lower()
        print(f"{done} user {user.username} (role {show.role(user.role)}, {state})")
    else:
        headers, rows = _user_rows([user])
        show.print_fields([(header.lower(), value) for header, value in zip(headers, rows[0], strict=True)]
                          + [("etag", user.etag), ("updated", show.when(user.update_time))])  # fmt: skip
    return 0


async def cmd_users_list(ctx: Context) -> int:
    users = []
    async for user in ctx.client.iter_users(page_size=min(ctx.args.limit, 1000)):
        users.append(user)
        if len(users) >= ctx.args.limit:
            break
    if ctx.json:
        show.print_json({"users": [show.message_dict(user) for user in users]})
    else:
        show.print_table(*_user_rows(users))
    return 0


async def cmd_users_get(ctx: Context) -> int:
    return _show_user(ctx, await ctx.client.get_user(await _user_id(ctx, ctx.args.user)))


async def cmd_users_create(ctx: Context) -> int:
    args = ctx.args
    password = await asyncio.to_thread(_new_password, args, "users create")
    user = await ctx.client.create_user(args.username, password, args.role, request_id=args.request_id)
    return _show_user(ctx, user, "Created")


async def cmd_users_update(ctx: Context) -> int:
    args = ctx.args
    user = await ctx.client.update_user(await _user_id(ctx, args.user), role=args.role, etag=args.etag)
    return _show_user(ctx, user, "Updated")


async def cmd_users_disable(ctx: Context) -> int:
    user = await ctx.client.disable_user(await _user_id(ctx, ctx.args.user), etag=ctx.args.etag)
    return _show_user(ctx, user, "Disabled (its sessions ended)")


async def cmd_users_enable(ctx: Context) -> int:
    user = await ctx.client.enable_user(await _user_id(ctx, ctx.args.user), etag=ctx.args.etag)
    return _show_user(ctx, user, "Enabled")


async def cmd_users_reset_password(ctx: Context) -> int:
    args = ctx.args
    user_id = await _user_id(ctx, args.user)
    password = await asyncio.to_thread(_new_password, args, "users reset-password")
    user = await ctx.client.reset_user_password(user_id, password, etag=args.etag)
    return _show_user(ctx, user, "Reset the password of (its other sessions ended)")


async def cmd_users_delete(ctx: Context) -> int:
    args = ctx.args
    user_id = await _user_id(ctx, args.user)
    await ctx.client.delete_user(user_id, etag=args.etag)
    if ctx.json:
        show.print_json({"id": user_id, "deleted": True})
    else:
        print(f"Deleted user {args.user} (its sessions ended)")
    return 0


def _users_commands(command: Callable[..., argparse.ArgumentParser], commands: Any) -> None:
    """`schedctl users ...` (admin only)."""
    users = command(commands, "users", "manage who logs in: list, create, change role, disable, reset, delete")
    user_commands = users.add_subparsers(dest="users_command", metavar="ACTION", required=True)
    listing = command(user_commands, "list", "list users by username", cmd_users_list)
    listing.add_argument("--limit", type=positive_int, default=1000, help="at most this many (default 1000)")
    get = command(user_commands, "get", "show one user", cmd_users_get)
    get.add_argument("user", metavar="USER", help="user id or username")
    create = command(user_commands, "create", "create a user (asks for its password)", cmd_users_create)
    create.add_argument("username", metavar="USERNAME", help="1-64 characters among A-Z a-z 0-9 _ . @ -")
    create.add_argument("--role", required=True, choices=USER_ROLES, help="what the user may do")
    create.add_argument("--request-id", help="idempotency key: a retry with the same id creates nothing more")
    update = command(user_commands, "update", "change a user's role (its sessions have it at once)",
                     cmd_users_update)  # fmt: skip
    update.add_argument("user", metavar="USER", help="user id or username")
    update.add_argument("--role", required=True, choices=USER_ROLES, help="the new role")
    reset = command(user_commands, "reset-password", "set a user's password (its other sessions end)",
                    cmd_users_reset_password)  # fmt: skip
    reset.add_argument("user", metavar="USER", help="user id or username")
    for sub in (create, reset):
        sub.add_argument("--password", help="the password (12-1024 characters; default $SCHEDCTL_NEW_PASSWORD, "
                                            "else asked)")  # fmt: skip
        sub.add_argument("--password-stdin", action="store_true", help="read the password from standard input")
    for name, handler, help_text in (
        ("disable", cmd_users_disable, "stop a user logging in and end its sessions"),
        ("enable", cmd_users_enable, "let a disabled user log in again"),
        ("delete", cmd_users_delete, "delete a user and end its sessions"),
    ):
        sub = command(user_commands, name, help_text, handler)
        sub.add_argument("user", metavar="USER", help="user id or username")
    for sub in (update, reset, *(user_commands.choices[name] for name in ("disable", "enable", "delete"))):
        sub.add_argument("--etag", help="fail (ABORTED) if the user changed since it had this etag")


# --- limits (viewers read, admins define) ------------------------------------------------------------


async def _limit_id(ctx: Context, reference: str) -> str:
    """A limit id from an id or a name."""
    try:
        uuid.UUID(reference)
    except ValueError:
        return (await ctx.client.get_limit(name=reference)).id
    return reference


def _limit_text(limit: limits_pb2.Limit) -> str:
    """`2 at once` / `100 per 1s (+10 burst)`."""
    if limit.kind == limits_pb2.LIMIT_KIND_RATE:
        burst = f" (+{limit.burst} burst)" if limit.burst else ""
        return f"{limit.limit} per {show.duration(limit.period)}{burst}"
    return f"{limit.limit} at once"


def _limit_rows(limits: Sequence[limits_pb2.Limit]) -> tuple[list[str], list[list[object]]]:
    rows: list[list[object]] = [
        [limit.name, show.label(limits_pb2.LimitKind.Name(limit.kind)), _limit_text(limit), len(limit.overrides),
         limit.id]
        for limit in limits
    ]  # fmt: skip
    return ["NAME", "KIND", "LIMIT", "OVERRIDES", "ID"], rows


def _show_limit(ctx: Context, limit: limits_pb2.Limit, done: str | None = None) -> int:
    if ctx.json:
        show.print_json(show.message_dict(limit))
    elif done is not None:
        print(f"{done} limit {limit.name} ({_limit_text(limit)} per key)")
    else:
        overrides = ", ".join(
            f"{key}={value.limit}" + (f"/{value.burst}" if value.burst else "")
            for key, value in sorted(limit.overrides.items())
        )
        show.print_fields([
            ("name", limit.name), ("id", limit.id), ("kind", show.label(limits_pb2.LimitKind.Name(limit.kind))),
            ("limit", _limit_text(limit) + " per key"), ("overrides", overrides or "-"), ("etag", limit.etag),
            ("created", show.when(limit.create_time)), ("updated", show.when(limit.update_time)),
        ])  # fmt: skip
    return 0


async def cmd_limits_list(ctx: Context) -> int:
    limits = []
    async for limit in ctx.client.iter_limits(page_size=min(ctx.args.limit, 1000)):
        limits.append(limit)
        if len(limits) >= ctx.args.limit:
            break
    if ctx.json:
        show.print_json({"limits": [show.message_dict(limit) for limit in limits]})
    else:
        show.print_table(*_limit_rows(limits))
    return 0


async def cmd_limits_get(ctx: Context) -> int:
    reference = ctx.args.limit_ref
    try:
        uuid.UUID(reference)
    except ValueError:
        return _show_limit(ctx, await ctx.client.get_limit(name=reference))
    return _show_limit(ctx, await ctx.client.get_limit(reference))


async def cmd_limits_create(ctx: Context) -> int:
    args = ctx.args
    limit = await ctx.client.create_limit(
        args.name,
        args.kind,
        args.limit,
        period=args.period,
        burst=args.burst or 0,
        overrides=dict(args.overrides or []),
        request_id=args.request_id,
    )
    return _show_limit(ctx, limit, "Created")


async def cmd_limits_update(ctx: Context) -> int:
    args = ctx.args
    overrides = dict(args.overrides or []) if args.overrides or args.no_overrides else None
    limit = await ctx.client.update_limit(
        await _limit_id(ctx, args.limit_ref),
        etag=args.etag,
        kind=args.kind,
        limit=args.limit,
        period=args.period,
        burst=args.burst,
        overrides=overrides,
    )
    return _show_limit(ctx, limit, "Updated")


async def cmd_limits_override(ctx: Context) -> int:
    args = ctx.args
    if (args.limit is None) == (not args.clear):
        raise UsageError("limits override: give --limit (and --burst) to set the key's override, or --clear")
    limit = await ctx.client.set_limit_override(
        await _limit_id(ctx, args.limit_ref), args.key, limit=args.limit, burst=args.burst or 0, etag=args.etag
    )
    return _show_limit(ctx, limit, "Updated")


async def cmd_limits_delete(ctx: Context) -> int:
    args = ctx.args
    limit_id = await _limit_id(ctx, args.limit_ref)
    await ctx.client.delete_limit(limit_id, etag=args.etag)
    if ctx.json:
        show.print_json({"id": limit_id, "deleted": True})
    else:
        print(f"Deleted limit {args.limit_ref}")
    return 0


async def _limit_name(ctx: Context, reference: str) -> str:
    """A limit's name from a name or an id (the key methods take names)."""
    try:
        uuid.UUID(reference)
    except ValueError:
        return reference
    return (await ctx.client.get_limit(reference)).name


def _show_key(ctx: Context, state: limits_pb2.LimitKeyState, done: str | None = None) -> int:
    if ctx.json:
        show.print_json(show.message_dict(state))
        return 0
    if done is not None:
        queues = ", ".join(entry.queue for entry in state.queues) or "no queue"
        print(f"{done} key {state.key} of limit {state.limit} on {queues}")
        return 0
    rows: list[list[object]] = [
        [entry.queue, entry.running_units, entry.queued_runs, show.when(entry.next_admit_time),
         show.when(entry.pause_end_time)]
        for entry in state.queues
    ]  # fmt: skip
    if not rows:
        print(f"Limit {state.limit} is used on no queue (no job names it); give --queue to read one")
        return 0
    rows.append(["(all)", state.running_units, state.queued_runs, "", ""])
    show.print_table(["QUEUE", "RUNNING", "QUEUED", "NEXT ADMISSION", "PAUSED UNTIL"], rows)
    return 0


async def cmd_limits_key(ctx: Context) -> int:
    args = ctx.args
    name = await _limit_name(ctx, args.limit_ref)
    return _show_key(ctx, await ctx.client.get_limit_key(name, args.key, queue=args.queue or ""))


async def cmd_limits_pause(ctx: Context) -> int:
    args = ctx.args
    if (args.pause_for is None) == (args.until is None):
        raise UsageError("limits pause: give --for DURATION or --until TIME")
    name = await _limit_name(ctx, args.limit_ref)
    state = await ctx.client.pause_limit_key(
        name, args.key, duration=args.pause_for, until=args.until, queue=args.queue or ""
    )
    ends = {show.when(entry.pause_end_time) for entry in state.queues}
    return _show_key(ctx, state, "Paused" + (f" until {ends.pop()}" if len(ends) == 1 else ""))


async def cmd_limits_resume(ctx: Context) -> int:
    args = ctx.args
    name = await _limit_name(ctx, args.limit_ref)
    return _show_key(ctx, await ctx.client.resume_limit_key(name, args.key, queue=args.queue or ""), "Resumed")


def _limits_commands(command: Callable[..., argparse.ArgumentParser], commands: Any) -> None:
    """`schedctl limits ...` (viewers read, admins define)."""
    limits = command(
        commands,
        "limits",
        "define limits (list, get, create, update, override, delete); steer keys (key, pause, resume)",
    )
    limit_commands = limits.add_subparsers(dest="limits_command", metavar="ACTION", required=True)
    listing = command(limit_commands, "list", "list limits by name", cmd_limits_list)
    listing.add_argument("--limit", type=positive_int, default=1000, help="at most this many (default 1000)")
    get = command(limit_commands, "get", "show one limit", cmd_limits_get)
    create = command(limit_commands, "create", "create a limit", cmd_limits_create)
    create.add_argument("name", metavar="NAME", help="unique name, as jobs refer to it: letters, digits and _ . : -")
    create.add_argument("--kind", required=True, choices=LIMIT_KIND.choices(),
                        help="concurrency: units held at once per key; rate: units per --period per key")  # fmt: skip
    create.add_argument("--limit", required=True, type=positive_int, metavar="N", help="units per key (1-1000000)")
    create.add_argument("--request-id", help="idempotency key: a retry with the same id creates nothing more")
    update = command(limit_commands, "update", "change the given fields of a limit (the name stays)",
                     cmd_limits_update)  # fmt: skip
    update.add_argument("--kind", choices=LIMIT_KIND.choices(), help="the new kind (give --period for a rate)")
    update.add_argument("--limit", type=positive_int, metavar="N", help="units per key (1-1000000)")
    update.add_argument("--no-overrides", action="store_true", help="remove every per-key override")
    for sub in (create, update):
        sub.add_argument("--period", type=parse_duration, metavar="DURATION", help="a rate's period, e.g. 1s, 1m")
        sub.add_argument("--burst", type=int32, metavar="N", help="a rate's extra units at once (default 0)")
        sub.add_argument("--override", dest="overrides", action="append", type=override_arg,
                         metavar="KEY=LIMIT[/BURST]", help="a key's own limit (repeatable; on update: replaces "
                                                           "every override)")  # fmt: skip
    override = command(limit_commands, "override", "set or clear one key's own limit", cmd_limits_override)
    override.add_argument("--limit", type=positive_int, metavar="N", help="the key's own limit")
    override.add_argument("--burst", type=int32, metavar="N", help="the key's own burst (rate limits)")
    override.add_argument("--clear", action="store_true", help="take the key's override away")
    delete = command(limit_commands, "delete", "delete a limit no job uses", cmd_limits_delete)
    for sub in (get, update, override, delete):
        sub.add_argument("limit_ref", metavar="LIMIT", help="limit id or name")
    override.add_argument("key", metavar="KEY", help="the key, as a run's limit key resolves to it")
    for sub in (update, override, delete):
        sub.add_argument("--etag", help="fail (ABORTED) if the limit changed since it had this etag")
    # Keys (viewers read, operators pause and resume), on each queue the limit is used on.
    key = command(limit_commands, "key", "show one key's state on each queue: running, queued, pause", cmd_limits_key)
    pause = command(limit_commands, "pause", "pause one key (it admits no run) for a while", cmd_limits_pause)
    pause.add_argument("--for", dest="pause_for", type=parse_duration, metavar="DURATION", help="e.g. 30s, 10m, 2h")
    pause.add_argument("--until", type=parse_time, metavar="TIME", help="ISO 8601 or +DURATION")
    resume = command(limit_commands, "resume", "end one key's pause now", cmd_limits_resume)
    for sub in (key, pause, resume):
        sub.add_argument("limit_ref", metavar="LIMIT", help="limit name or id")
        sub.add_argument("key", metavar="KEY", help="the key, as a run's limit key resolves to it")
        sub.add_argument("--queue", help="only this queue (default: every queue the limit is used on)")


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
        type=server_target,
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
    parser.add_argument("--priority", type=int32, help="-1000 (least urgent) to 1000 (most); default 0")
    parser.add_argument("--max-retries", type=int32, metavar="N", help="retries after the first attempt (default 3)")
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
    parser.add_argument("--limit", dest="limits", action="append", type=limit_ref_arg, metavar="NAME:KEY[:UNITS]",
                        help="a limit each run takes: the limit's name, the key (a constant, or payload.FIELD "
                             "to take it from the run's payload), units per run (default 1); repeatable (on "
                             "update: replaces the list)")  # fmt: skip
    if update:
        parser.add_argument("--no-depends-on", action="store_true", help="remove every upstream")
        parser.add_argument("--no-limits", action="store_true", help="remove every limit")
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
    trigger = command(job_commands, "trigger", "run a job now (or many runs of jobs at once)", cmd_jobs_trigger)
    trigger.add_argument("job", metavar="JOB", nargs="?", help="job id or name")
    trigger.add_argument("--request-id", help="idempotency key: the same id never runs the job twice (with --count "
                         "N: ID-1 ... ID-N)")  # fmt: skip
    trigger.add_argument("--payload", type=parse_payload, metavar="JSON",
                         help="the run's payload instead of the job's: JSON, @file.json or - (stdin)")  # fmt: skip
    trigger.add_argument("--count", type=positive_int, default=1, metavar="N",
                         help=f"N runs of JOB, in calls of {MAX_TRIGGER_ITEMS:,} (BatchTriggerJobs)")  # fmt: skip
    trigger.add_argument("--items", metavar="FILE",
                         help='runs from a JSON lines file (- for stdin), one per line: {"job": ID or NAME, '
                              '"payload": {...}, "request_id": "..."} (payload and request_id optional)')  # fmt: skip
    trigger.add_argument(
        "--wait",
        action="store_true",
        help="wait until the run ends (after its retries) and show its last attempt; exit 1 unless it succeeded",
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

    queues = command(commands, "queues", "show and set the queues' shard counts")
    queue_commands = queues.add_subparsers(dest="queues_command", metavar="ACTION", required=True)
    shards = command(queue_commands, "shards", "show or set a queue's shard count")
    shard_commands = shards.add_subparsers(dest="shards_command", metavar="ACTION", required=True)
    shards_show = command(shard_commands, "show", "the shard counts of a queue, or of every queue ever sharded",
                          cmd_queues_shards_show)  # fmt: skip
    shards_show.add_argument("queue", metavar="QUEUE", nargs="?", help="the queue (default: every queue ever set)")
    shards_set = command(shard_commands, "set", "give a queue N shards for the runs made a lead time from now on "
                         "(admin; the server's SCHEDULER_QUEUE_SHARD_LEAD)", cmd_queues_shards_set)  # fmt: skip
    shards_set.add_argument("queue", metavar="QUEUE", help="the queue")
    shards_set.add_argument("shards", metavar="N", type=int32, help="shards (1-64)")
    command(commands, "workers", "list live workers", cmd_workers)
    command(commands, "handlers", "list handlers and their circuit breakers", cmd_handlers)
    status = command(commands, "status", "scheduler leader, term and queue counts", cmd_status)
    status.add_argument("--queue", help="the queue (default: default)")
    _users_commands(command, commands)
    _limits_commands(command, commands)
    return parser


# --- running -----------------------------------------------------------------------------------------


# API field paths (the start of an INVALID_ARGUMENT message, `job.` dropped) -> the flag that sets them.
_FLAGS = {
    "name": "--name",
    "handler": "--handler",
    "payload": "--payload",
    "schedule.cron": "--cron",
    "cron": "--cron",
    "schedule.time_zone": "--time-zone",
    "time_zone": "--time-zone",
    "schedule.run_time": "--run-at",
    "run_at": "--run-at",
    "queue": "--queue",
    "priority": "--priority",
    "retry_policy.max_retries": "--max-retries",
    "retry_policy.initial_backoff": "--initial-backoff",
    "retry_policy.max_backoff": "--max-backoff",
    "timeout": "--timeout",
    "misfire_policy": "--misfire-policy",
    "concurrency_policy": "--concurrency-policy",
    "depends_on": "--depends-on",
    "trigger_rule": "--trigger-rule",
    "etag": "--etag",
    "request_id": "--request-id",
    "count": "--count",
    "start_time": "--start",
    "cursor": "--cursor",
    "flow_run_id": "--flow-run",
    "job_id": "--job",
    "job_ids": "--job",
    "states": "--state",
    "types": "--type",
    "run_ids": "RUN_ID",
}
# Per command, fields its positional arguments set (they win over `_FLAGS`).
_COMMAND_FIELDS = {"queues": {"queue": "QUEUE", "shards": "N"}}
# The positional argument a request's `id` comes from, per command.
_ID_ARGUMENT = {"jobs": "JOB", "executions": "EXECUTION", "flows": "FLOW_RUN_ID"}
_FIELD = re.compile(r"^([a-z_][a-z0-9_]*(?:\[\d+\])?(?:\.[a-z_][a-z0-9_]*(?:\[\d+\])?)*): (.+)$", re.DOTALL)


def flag_message(message: str, command: str) -> str:
    """An INVALID_ARGUMENT message naming the API field (`job.schedule.cron: ...`) as naming the
    flag or argument that set it (`--cron: ...`); unchanged when no flag sets that field."""
    match = _FIELD.match(message)
    if match is None:
        return message
    path, text = match.groups()
    parts = re.sub(r"\[\d+\]", "", path.removeprefix("job.")).split(".")
    if parts == ["id"] and command in _ID_ARGUMENT:
        return f"{_ID_ARGUMENT[command]}: {text}"
    fields = {**_FLAGS, **_COMMAND_FIELDS.get(command, {})}
    for end in range(len(parts), 0, -1):
        flag = fields.get(".".join(parts[:end]))
        if flag is not None:
            inside = ".".join(parts[end:])  # e.g. a payload field: `--payload: message: ...`
            return f"{flag}: {inside}: {text}" if inside else f"{flag}: {text}"
    return message


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
    if isinstance(error, InvalidArgument):
        return flag_message(error.message, args.command)
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
