"""One scenario's life: fresh database, roles behind proxies, jobs, the faults, settling, the check.

`Stage` is what a scenario body gets: the cluster, the servers, a direct pool and Redis client
(not through any proxy), and helpers that poll observable state (who leads, what fired, which
worker is busy) instead of sleeping. A body records its faults (`fault`) and the instants to
measure recovery from (`mark`); the runner does the rest.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import redis.asyncio as aioredis

from chaos.checker import CheckReport, FaultMark, Violation, check, install_term_history
from chaos.cluster import Cluster, RoleProcess
from chaos.servers import ChaosPostgres, ChaosRedis, ChaosValkeyCluster
from scheduler_grpc.connections import redis_client
from scheduler_grpc.control import Control
from scheduler_grpc.db.migrate import migrate
from scheduler_grpc.db.pool import create_pool
from scheduler_grpc.db.queue_shards import QueueShardRepository
from scheduler_grpc.handlers import HandlerSettings, default_registry
from scheduler_grpc.jobs import Job, JobSpec, ScheduleKind
from scheduler_grpc.keys import LeaderKeys, WorkerKeys

log = logging.getLogger("chaos")
T = TypeVar("T")

_DB_ERRORS = (asyncpg.PostgresError, asyncpg.InterfaceError, OSError, TimeoutError)
IN_PROCESS_QUEUE = "default"  # the roles' SCHEDULER_QUEUE (not set: the service's default)


async def eventually(
    check: Callable[[], Awaitable[T | None]], *, within: float, interval: float = 0.1, what: str = ""
) -> T:
    """Poll `check` until it returns something truthy; TimeoutError after `within` seconds."""
    deadline = time.monotonic() + within
    last: T | None = None
    while True:
        try:
            last = await check()
        except _DB_ERRORS:
            last = None  # the server under fault: look again
        if last:
            return last
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{what or 'condition'} not met within {within:g}s (last: {last!r})")
        await asyncio.sleep(interval)


def now() -> datetime:
    return datetime.now(UTC)


@dataclass
class Servers:
    """The real servers of the whole run, and the thread that starts them.

    Servers are started from one long-lived thread: they die with the thread that started them
    (PR_SET_PDEATHSIG), so they must not be started from a pool thread that may exit.
    """

    redis: ChaosRedis
    postgres: ChaosPostgres
    thread: ThreadPoolExecutor

    async def run(self, fn: Callable[[], None]) -> None:
        await asyncio.get_running_loop().run_in_executor(self.thread, fn)


@dataclass
class Outcome:
    """What one scenario produced: its faults, the check, the roles at the end, notes."""

    name: str
    faults: list[str] = field(default_factory=list)
    report: CheckReport = field(default_factory=CheckReport)
    roles_alive: int = 0
    roles_total: int = 0
    notes: list[str] = field(default_factory=list)
    error: str = ""
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.error and not self.report.violations


@dataclass
class Stage:
    """A running scenario, as its body sees it."""

    name: str
    servers: Servers
    cluster: Cluster
    pool: asyncpg.Pool
    redis: aioredis.Redis
    control: Control
    outcome: Outcome
    marks: list[FaultMark] = field(default_factory=list)
    jobs: list[Job] = field(default_factory=list)
    succeeding: list[str] = field(default_factory=list)
    # Roles allowed to die on their own (by name prefix, e.g. "worker"): a test handler kills them.
    may_die: tuple[str, ...] = ()
    restarted: int = 0
    # The scenario's own Valkey Cluster (`Scenario.valkey_cluster`); `redis` is then a cluster client.
    valkey: ChaosValkeyCluster | None = None

    def fault(self, label: str) -> None:
        self.outcome.faults.append(label)
        log.info("%s: fault: %s", self.name, label)

    def note(self, text: str) -> None:
        self.outcome.notes.append(text)
        log.info("%s: %s", self.name, text)

    def violation(self, invariant: str, detail: str) -> None:
        self.outcome.report.violations.append(Violation(invariant, detail))
        log.warning("%s: VIOLATION %s: %s", self.name, invariant, detail)

    def mark(
        self, label: str, at: datetime, *, after_term: int | None = None, run_ids: Sequence[str] = (),
        completed: bool = False,
    ) -> None:  # fmt: skip
        self.marks.append(FaultMark(label, at, after_term, tuple(run_ids), completed))

    # -- observing -----------------------------------------------------------------------------------

    async def lock_holder(self) -> RoleProcess | None:
        """The scheduler holding the Redis leader lock (its value is `<holder>:<random>`)."""
        value = await self.redis.get(LeaderKeys().lock)
        if value is None:
            return None
        text = value.decode() if isinstance(value, bytes) else str(value)
        holder = text.rpartition(":")[0]
        return self.cluster.by_holder(holder)

    async def term(self) -> int:
        return int(await self.pool.fetchval("SELECT coalesce(max(term), 0) FROM leader_state") or 0)

    async def leader(self, within: float = 60) -> RoleProcess:
        """The leading scheduler: holds the lock and leads the current term in PostgreSQL."""

        async def found() -> RoleProcess | None:
            holder = await self.pool.fetchval("SELECT holder FROM leader_state WHERE scope = 'scheduler'")
            role = await self.lock_holder()
            return role if role is not None and holder == f"{role.name}:{role.pid}" else None

        return await eventually(found, within=within, what="a leader")

    async def fired_after(self, at: datetime, *, after_term: int | None = None) -> datetime | None:
        return await self.pool.fetchval(  # type: ignore[no-any-return]
            """SELECT min(created_at) FROM job_executions
               WHERE trigger = 'schedule' AND created_at > $1 AND ($2::bigint IS NULL OR term > $2)""",
            at,
            after_term,
        )

    async def wait_fired_after(self, at: datetime, *, after_term: int | None = None, within: float = 60) -> float:
        """Wait until a slot fired after `at`; seconds it took (TimeoutError: never, within the bound)."""
        first = await eventually(lambda: self.fired_after(at, after_term=after_term), within=within,
                                 what=f"a slot fired after {at:%H:%M:%S}")  # fmt: skip
        return (first - at).total_seconds()

    async def running_by_worker(self) -> dict[str, list[str]]:
        """Run ids `running` now, by worker id."""
        rows = await self.pool.fetch("SELECT worker_id, run_id FROM job_executions WHERE status = 'running'")
        found: dict[str, list[str]] = {}
        for row in rows:
            found.setdefault(row["worker_id"], []).append(str(row["run_id"]))
        return found

    async def busiest_worker(self, within: float = 30) -> tuple[RoleProcess, list[str]]:
        """The live worker with the most runs `running`, and those run ids."""

        async def busy() -> tuple[RoleProcess, list[str]] | None:
            best: tuple[RoleProcess, list[str]] | None = None
            for worker_id, runs in (await self.running_by_worker()).items():
                role = self.cluster.by_worker_id(worker_id)
                if role is not None and role.alive() and (best is None or len(runs) > len(best[1])):
                    best = (role, runs)
            return best

        return await eventually(busy, within=within, what="a busy worker")

    async def holding_worker(self, within: float = 30) -> tuple[RoleProcess, list[str]]:
        """The live worker holding the most reservations (runs claimed ahead: `running` with a start
        still to come, on PostgreSQL's clock), and those run ids."""

        async def holding() -> tuple[RoleProcess, list[str]] | None:
            rows = await self.pool.fetch(
                """SELECT worker_id, array_agg(run_id::text) AS runs FROM job_executions
                   WHERE status = 'running' AND started_at > clock_timestamp() GROUP BY worker_id"""
            )
            best: tuple[RoleProcess, list[str]] | None = None
            for row in rows:
                role = self.cluster.by_worker_id(row["worker_id"])
                if role is not None and role.alive() and (best is None or len(row["runs"]) > len(best[1])):
                    best = (role, list(row["runs"]))
            return best

        return await eventually(holding, within=within, interval=0.02, what="a worker holding reservations")

    async def workers_beating(self) -> int:
        return int(await self.redis.zcard(WorkerKeys().index))

    async def role_ready(self, role: RoleProcess, within: float = 60) -> None:
        """Wait until `role`'s current process has opened its stores (it logged its metrics port)."""

        async def ready() -> bool:
            text = role.log_text()
            return '"metrics listening"' in text.rsplit("=== start #", 1)[-1]

        await eventually(ready, within=within, what=f"{role.name} ready")

    async def endpoints(self, server: RoleProcess, within: float = 60) -> tuple[str, str]:
        """A server role's gRPC address (`host:port`) and web console URL (ending in `/`), from
        what its current process logged when it started listening."""

        async def logged() -> tuple[str, str] | None:
            address = url = None
            for line in server.log_text().rsplit("=== start #", 1)[-1].splitlines():
                if '"gRPC server listening"' in line:
                    address = json.loads(line)["address"]
                elif '"web console listening"' in line:
                    url = json.loads(line)["url"]
            return (address, url) if address and url else None

        return await eventually(logged, within=within, what=f"{server.name} listening")

    async def restart(self, role: RoleProcess, within: float = 60) -> None:
        role.start()
        self.restarted += 1
        await self.role_ready(role, within)

    async def sleep_until(self, at: datetime) -> None:
        """Let the system run until wall-clock `at` (the window is measured in slots, not events)."""
        if (wait := (at - now()).total_seconds()) > 0:
            await asyncio.sleep(wait)


ScenarioBody = Callable[[Stage], Awaitable[None]]


@dataclass(frozen=True)
class Scenario:
    """A scenario: the topology and jobs, the body that injects the faults, and its bounds.

    Attributes:
        name: Short name (the table's first column; `python -m chaos NAME` runs one).
        body: Injects the faults and heals them.
        env: Settings for every role (on top of the defaults of the service).
        cron_jobs: Per-second cron jobs running throughout (counted from PostgreSQL).
        handler: Their handler, and `payload` its payload.
        queue: Their queue (default: the in-process workers'); on another queue, `handler` may be
            one only remote workers serve (`chaos.remote_worker`).
        schedulers: Scheduler processes.
        workers: Worker processes.
        servers: gRPC server processes (each with its web console).
        settle: Longest wait, after healing, for every slot to be recorded and every run final.
        budget: Longest the body may run.
        description: One line for the log.
        target_p99: The recovery the service aims at (reported when missed; not a failure).
        valkey_cluster: Run on a Valkey Cluster of the scenario's own (`ChaosValkeyCluster`, 3
            masters and 3 replicas in the run directory, `cluster-node-timeout` this long) instead
            of the suite's one server: every role's REDIS_URL is its `redis+cluster://` URL.
        queue_shards: The in-process queue's shard count (`sharding.py`), set before any role
            starts, so it applies to every run at once.
    """

    name: str
    body: ScenarioBody
    env: dict[str, str] = field(default_factory=dict)
    cron_jobs: int = 20
    handler: str = "test.echo"
    payload: dict[str, Any] = field(default_factory=dict)
    queue: str = IN_PROCESS_QUEUE
    schedulers: int = 2
    workers: int = 2
    servers: int = 0
    settle: float = 60.0
    budget: float = 150.0
    description: str = ""
    target_p99: float | None = None
    valkey_cluster: timedelta | None = None
    queue_shards: int = 1


def _database_url(url: str, name: str) -> str:
    return urlunsplit(urlsplit(url)._replace(path="/" + name))


async def _fresh_database(servers: Servers, name: str) -> str:
    admin = await asyncpg.connect(servers.postgres.url, timeout=10)
    try:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.execute(f'CREATE DATABASE "{name}"')
    finally:
        await admin.close()
    return _database_url(servers.postgres.url, name)


async def _with_retry(call: Callable[[], Awaitable[T]], within: float = 30) -> T:
    """A harness query while PostgreSQL may be restarting: retried until it answers."""
    deadline = time.monotonic() + within
    while True:
        try:
            return await call()
        except _DB_ERRORS:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)


async def run_scenario(scenario: Scenario, servers: Servers, work_dir: Path) -> Outcome:
    """Run one scenario end to end; never raises (an error becomes the outcome's `error`)."""
    began = time.monotonic()
    outcome = Outcome(scenario.name)
    log_dir = work_dir / scenario.name
    log_dir.mkdir(parents=True, exist_ok=True)
    db_name = f"chaos_{scenario.name.replace('-', '_')}_{uuid.uuid4().hex[:6]}"
    database_url = await _fresh_database(servers, db_name)
    pool = await create_pool(database_url, size=4, connect_timeout=timedelta(seconds=10))
    valkey: ChaosValkeyCluster | None = None
    if scenario.valkey_cluster is not None:
        valkey = ChaosValkeyCluster(log_dir / "valkey-cluster", node_timeout=scenario.valkey_cluster)
        await servers.run(valkey.start)
        redis = redis_client(valkey.url)  # the roles' own client: it follows failovers and MOVED/ASK
    else:
        redis = aioredis.Redis.from_url(servers.redis.url, socket_connect_timeout=2)
    registry = default_registry(HandlerSettings(dev_mode=True))
    cluster = Cluster(valkey.url if valkey else servers.redis.url, database_url, log_dir, scenario.env)
    stage: Stage | None = None
    try:
        if valkey is None:
            await redis.flushall()
        await migrate(pool)
        await install_term_history(pool)
        if scenario.queue_shards > 1:
            # No role reads the count yet, so it may apply at once (no lead).
            await QueueShardRepository(pool).set_shards(IN_PROCESS_QUEUE, scenario.queue_shards, lead=timedelta(0))
        # As a server's: jobs on another queue than the in-process workers' may name remote handlers.
        control = Control(redis, pool, registry, in_process_queue=IN_PROCESS_QUEUE)
        stage = Stage(scenario.name, servers, cluster, pool, redis, control, outcome, valkey=valkey)
        for _ in range(scenario.schedulers):
            await cluster.add("scheduler")
        for _ in range(scenario.workers):
            await cluster.add("worker")
        for _ in range(scenario.servers):
            await cluster.add("server")
        for role in cluster.roles:
            await stage.role_ready(role)
        await eventually(lambda: _ready(stage, scenario.workers), within=60, what="workers beating and a leader")
        created = now()
        for index in range(scenario.cron_jobs):
            job = await control.create_job(JobSpec(
                name=f"tick-{index}", handler=scenario.handler, payload=scenario.payload, queue=scenario.queue,
                schedule_kind=ScheduleKind.CRON, cron="* * * * * *"))  # fmt: skip
            stage.jobs.append(job)
            stage.succeeding.append(job.id)
        # The window opens on the first whole second that is surely after every job existed.
        start = (created + timedelta(seconds=2)).replace(microsecond=0)
        await stage.sleep_until(start + timedelta(seconds=1))
        try:
            async with asyncio.timeout(scenario.budget):
                await scenario.body(stage)
        finally:
            cluster.heal_all()
            for role in cluster.roles:
                role.resume()
            if valkey is not None:
                valkey.resume_all()
        end = now().replace(microsecond=0) + timedelta(seconds=2)
        await _settle(stage, end, scenario.settle)
        await _with_retry(lambda: pool.execute("UPDATE jobs SET status = 'paused', next_run_time = NULL"))
        report = await _with_retry(
            lambda: check(
                pool, jobs=stage.jobs, start=start, end=end, succeeding_jobs=stage.succeeding, marks=stage.marks
            )
        )
        report.violations[:0] = outcome.report.violations  # the body's own findings first
        report.caps = outcome.report.caps  # a body with limits checked its caps itself
        outcome.report = report
        p99 = report.recovery_percentile(0.99)
        if scenario.target_p99 is not None and p99 is not None and p99 > scenario.target_p99:
            outcome.notes.append(f"recovery p99 {p99:.2f}s misses the {scenario.target_p99:g}s target")
        _judge_roles(stage)
        refused = sum(line.count("is no longer current") for r in cluster.of("scheduler") for line in r.log_lines())
        if refused:
            outcome.notes.append(f"{refused} leader writes attempted under a stale term were refused (fenced)")
    except Exception as exc:
        log.exception("%s: scenario error", scenario.name)
        outcome.error = f"{type(exc).__name__}: {exc}"
        if stage is not None:
            with contextlib.suppress(Exception):
                _judge_roles(stage)
    finally:
        codes = await cluster.stop()
        unclean = {name: code for name, code in codes.items() if code not in (0, None, -9)}
        if unclean:
            outcome.notes.append(f"exit codes on the final SIGTERM: {unclean}")
        await registry.aclose()
        await redis.aclose()
        await pool.close()
        if valkey is not None:
            await servers.run(valkey.stop)
        outcome.seconds = time.monotonic() - began
    return outcome


async def _ready(stage: Stage, workers: int) -> bool:
    return await stage.workers_beating() >= workers and await stage.lock_holder() is not None


async def _settle(stage: Stage, end: datetime, within: float) -> None:
    """Wait until every slot up to `end` is recorded and every run up to it is final (bounded)."""
    per_job = {job.id for job in stage.jobs}

    async def settled() -> bool:
        if now() < end + timedelta(seconds=1):
            return False
        rows = await stage.pool.fetch(
            """SELECT job_id, max(scheduled_for) AS last FROM job_executions
               WHERE job_id = ANY($1::uuid[]) GROUP BY job_id""",
            list(per_job),
        )
        if len(rows) < len(per_job) or any(row["last"] < end for row in rows):
            return False
        open_runs = await stage.pool.fetchval(
            """SELECT count(*) FROM (SELECT DISTINCT ON (run_id) status FROM job_executions
               WHERE scheduled_for <= $1 ORDER BY run_id, attempt DESC) latest
               WHERE status IN ('queued', 'running')""",
            end,
        )
        return bool(open_runs == 0)

    with contextlib.suppress(TimeoutError):
        await eventually(settled, within=within + 3, interval=0.25)


def _message(lines: Sequence[str]) -> str:
    """The `message` of the last JSON log line (or the raw line)."""
    if not lines:
        return "-"
    last = lines[-1]
    try:
        return str(json.loads(last).get("message", last))[:120]
    except ValueError:
        return last[:120]


def _judge_roles(stage: Stage) -> None:
    """Every role must run at the end, unless the suite ended it or the scenario lets it die."""
    outcome = stage.outcome
    outcome.roles_total = len(stage.cluster.roles)
    for role in stage.cluster.roles:
        if role.alive():
            outcome.roles_alive += 1
            continue
        if role.ended_by_suite:
            continue
        code = role.returncode()
        # A crash ends its log with the traceback (the uncaught one, or the one logged on the way out).
        lines = role.log_text().rsplit("=== start #", 1)[-1].strip().splitlines()
        tail = lines[-3:]
        heads = ("Traceback", "Exception Group Traceback")
        printed = any(line.lstrip(" |+").startswith(heads) for line in lines[-400:])
        traceback = printed or any('"exception"' in line for line in tail)
        if code == 0:
            died = f"{role.name} exited 0 on its own (a silent exit; last log: {_message(tail)})"
        else:
            died = f"{role.name} exited {code} ({'traceback logged' if traceback else 'NO traceback logged'})"
        if role.name.startswith(stage.may_die) and stage.may_die and code != 0:
            outcome.notes.append(f"{died}, allowed by the scenario")
            continue
        outcome.report.violations.append(Violation("role died", died))
