"""The scenarios of `make chaos`: every fault of issue 8, what users' jobs and clients produce
(issue 19), limits under faults (issue 22), remote workers killed or cut off (issue 23) and the
faults of a Valkey Cluster's nodes (issue 24), each bounded in count and time.

Each body injects its faults against a running topology (2 schedulers, 2 workers, 20 per-second
cron jobs unless it says otherwise), heals them, and records the instants recovery is measured
from. Waits are on observable state (who holds the lock, what PostgreSQL recorded, which worker
runs what); the only plain waits are fault durations ("PostgreSQL down 10 s") and letting slots
pass. Failover scenarios use the service's DEFAULT leader TTL; others shorten only what they are
not about (the visibility timeout of worker faults), and say so in `env`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import asyncpg
import orjson
from scheduler_client import SchedulerClient
from scheduler_client.errors import SchedulerClientError

from chaos.checker import (
    Attempt,
    Kill,
    attempts_of,
    check_caps,
    not_exactly_once,
    overdue_running,
    spent_unacknowledged,
    succeeded_on,
)
from chaos.cluster import RoleProcess
from chaos.harness import IN_PROCESS_QUEUE, Scenario, Stage, eventually, now
from chaos.remote_worker import HANDLER as REMOTE_HANDLER
from chaos.servers import ChaosValkeyCluster, ValkeyNode
from chaos.watchers import Watchers, gaps, judge, login
from scheduler_grpc.control import MAX_TRIGGER_ITEMS, TriggerItem
from scheduler_grpc.db.jobs import JOBS_CHANGED_CHANNEL
from scheduler_grpc.db.queue_shards import QueueShardRepository
from scheduler_grpc.errors import FailedPrecondition, SchedulerError
from scheduler_grpc.events import ExecutionEvent, stream_id
from scheduler_grpc.flows import FlowRun
from scheduler_grpc.jobs import JobSpec, RetryPolicy
from scheduler_grpc.keys import EventKeys, QueueKeys, shard_name
from scheduler_grpc.leader import DEFAULT_TTL
from scheduler_grpc.limits import LimitKind, LimitRef, LimitSpec
from scheduler_grpc.queue import Queue

DEFAULT_TTL_S = DEFAULT_TTL.total_seconds()  # the failover scenarios run with the service's default
ZOMBIE_STOP_S = 15.0  # the zombie leader's pause: many TTLs, so another leader surely takes over meanwhile
FAST_WORKERS = {"SCHEDULER_VISIBILITY_TIMEOUT": "3s"}  # worker faults are not about the lease length
BUSY = {"seconds": 0.8}  # per-second jobs that keep both workers busy


# -- leader ------------------------------------------------------------------------------------------


async def leader_kill9(stage: Stage, times: int = 10) -> None:
    """kill -9 of the leader, `times` times; the killed process is restarted as a standby."""
    for _ in range(times):
        leader = await stage.leader()
        term = await stage.term()
        at = now()
        leader.kill9()
        stage.fault(f"kill -9 {leader.name}")
        stage.mark(f"kill -9 {leader.name}", at, after_term=term)
        await stage.wait_fired_after(at, after_term=term, within=40)
        await stage.restart(leader)


async def leader_sigterm(stage: Stage, times: int = 5) -> None:
    """Graceful stop of the leader (SIGTERM), `times` times; restarted as a standby."""
    for _ in range(times):
        leader = await stage.leader()
        term = await stage.term()
        at = now()
        leader.signal(15, ends=True)
        stage.fault(f"SIGTERM {leader.name}")
        stage.mark(f"SIGTERM {leader.name}", at, after_term=term)
        await stage.wait_fired_after(at, after_term=term, within=40)
        code = await asyncio.to_thread(leader.wait_exit)
        if code != 0:
            stage.violation("graceful stop", f"{leader.name} exited {code} on SIGTERM")
        await stage.restart(leader)


async def zombie_leader(stage: Stage) -> None:
    """SIGSTOP the leader past its TTL while another takes over, then SIGCONT it."""
    zombie = await stage.leader()
    term = await stage.term()
    at = now()
    zombie.pause()
    stage.fault(f"SIGSTOP {zombie.name} {ZOMBIE_STOP_S:g}s")
    stage.mark(f"SIGSTOP {zombie.name}", at, after_term=term)
    await stage.wait_fired_after(at, after_term=term, within=40)
    await stage.sleep_until(at + timedelta(seconds=ZOMBIE_STOP_S))
    zombie.resume()

    async def stepped_down() -> bool:
        return zombie.logged("stepped down") > 0 or not zombie.alive()

    try:
        await eventually(stepped_down, within=15, what=f"{zombie.name} stepped down")
    except TimeoutError as exc:
        stage.violation("zombie leader did not step down", str(exc))
    await stage.sleep_until(now() + timedelta(seconds=3))  # the resumed zombie lives among slots


# -- workers -----------------------------------------------------------------------------------------


async def worker_kill9(stage: Stage, times: int = 10) -> None:
    """kill -9 of the busiest worker, `times` times; restarted at once."""
    for _ in range(times):
        worker, runs = await stage.busiest_worker()
        at = now()
        worker.kill9()
        stage.fault(f"kill -9 {worker.name} ({len(runs)} running)")
        stage.mark(f"kill -9 {worker.name}", at, run_ids=runs)
        await stage.restart(worker)


async def worker_kill9_reserved(stage: Stage, times: int = 5) -> None:
    """kill -9 of a worker while it holds reservations (runs claimed ahead of their due time),
    `times` times; restarted at once. Their leases expire, the leader requeues them, and the next
    claim supersedes the dead worker's attempt: no slot lost, none run twice."""
    for _ in range(times):
        worker, runs = await stage.holding_worker()
        at = now()
        worker.kill9()
        stage.fault(f"kill -9 {worker.name} ({len(runs)} reserved)")
        stage.mark(f"kill -9 {worker.name}", at, run_ids=runs)
        await stage.restart(worker)
        await stage.sleep_until(now() + timedelta(seconds=2))  # a few slots between two kills


async def worker_sigterm(stage: Stage, times: int = 3) -> None:
    """SIGTERM of the busiest worker (it drains), `times` times; restarted after it exited."""
    for _ in range(times):
        worker, runs = await stage.busiest_worker()
        at = now()
        worker.signal(15, ends=True)
        stage.fault(f"SIGTERM {worker.name} ({len(runs)} running)")
        stage.mark(f"SIGTERM {worker.name}", at, run_ids=runs)
        code = await asyncio.to_thread(worker.wait_exit)
        if code != 0:
            stage.violation("graceful stop", f"{worker.name} exited {code} on SIGTERM")
        await stage.restart(worker)


async def worker_cut_off(stage: Stage) -> None:
    """A worker loses Redis past its visibility timeout mid-run: the run goes on elsewhere and the
    cut-off worker's late completion (PostgreSQL still reachable) must be refused."""
    job = await stage.control.create_job(JobSpec(name="slow-one", handler="test.delay", payload={"seconds": 6}))
    stage.succeeding.append(job.id)
    run = (await stage.control.trigger_job(job.id))[0]

    async def running_on() -> str | None:
        return await stage.pool.fetchval(  # type: ignore[no-any-return]
            "SELECT worker_id FROM job_executions WHERE run_id = $1 AND status = 'running'", run.run_id
        )

    worker = stage.cluster.by_worker_id(await eventually(running_on, within=20, what="the slow run started"))
    assert worker is not None
    at = now()
    worker.redis_link.blackhole()
    stage.fault(f"blackhole {worker.redis_link.name} 9s (visibility 2s)")
    stage.mark(f"cut {worker.name} from Redis", at, run_ids=[run.run_id])

    async def late_completion_seen() -> bool:
        row = await stage.pool.fetchrow(
            "SELECT count(*) FILTER (WHERE status = 'succeeded') AS ok, count(*) AS attempts "
            "FROM job_executions WHERE run_id = $1",
            run.run_id,
        )
        return row is not None and row["ok"] >= 1 and row["attempts"] >= 2

    try:
        await eventually(late_completion_seen, within=25, what="the run completed elsewhere")
    except TimeoutError as exc:
        stage.violation("cut-off worker's run not taken over", str(exc))
    await stage.sleep_until(at + timedelta(seconds=9))  # past the first attempt's own end (6 s)
    worker.redis_link.heal()
    rows = await stage.pool.fetch(
        "SELECT attempt, status, worker_id FROM job_executions WHERE run_id = $1 ORDER BY attempt", run.run_id
    )
    stage.note("cut-off run: " + ", ".join(f"#{r['attempt']} {r['status']}" for r in rows))
    first = rows[0] if rows else None
    if first is not None and first["status"] == "succeeded" and len(rows) > 1:
        stage.violation("late completion accepted", f"attempt 1 of run {run.run_id[:8]} succeeded after its lease")


# -- Redis -------------------------------------------------------------------------------------------


async def flushall(stage: Stage, times: int = 2) -> None:
    for _ in range(times):
        at = now()
        await stage.servers.redis.flushall()
        stage.fault("FLUSHALL")
        stage.mark("FLUSHALL", at)
        await stage.wait_fired_after(at + timedelta(seconds=1), within=30)
        await stage.sleep_until(now() + timedelta(seconds=3))


async def valkey_restart_empty(stage: Stage) -> None:
    await stage.servers.run(stage.servers.redis.kill)
    stage.fault("kill -9 Valkey, restart empty")
    await stage.servers.run(lambda: stage.servers.redis.start(persistent=False))
    at = now()
    stage.mark("Valkey back (empty)", at)
    await stage.wait_fired_after(at, within=40)
    await stage.sleep_until(now() + timedelta(seconds=3))


async def valkey_restart_aof(stage: Stage) -> None:
    await stage.servers.redis.enable_aof()
    await stage.sleep_until(now() + timedelta(seconds=2))  # traffic written through the AOF
    await stage.servers.run(stage.servers.redis.kill)
    stage.fault("kill -9 Valkey, restart from AOF")
    await stage.servers.run(lambda: stage.servers.redis.start(persistent=True))
    at = now()
    stage.mark("Valkey back (AOF)", at)
    await stage.wait_fired_after(at, within=40)
    await stage.sleep_until(now() + timedelta(seconds=3))
    # Leave the server as the other scenarios expect it: no AOF.
    await stage.servers.run(stage.servers.redis.stop)
    await stage.servers.run(lambda: stage.servers.redis.start(persistent=False))
    await stage.sleep_until(now() + timedelta(seconds=2))


async def redis_slow_leader_link(stage: Stage) -> None:
    """2-5 s latency on the leader's Redis link for 10 s."""
    leader = await stage.leader()
    at = now()
    leader.redis_link.latency(2.0, 5.0)
    stage.fault(f"latency 2-5s on {leader.redis_link.name} 10s")
    stage.mark(f"slow Redis for {leader.name}", at)
    await stage.sleep_until(at + timedelta(seconds=10))
    leader.redis_link.heal()
    await stage.sleep_until(now() + timedelta(seconds=3))


async def redis_refuses_writes(stage: Stage) -> None:
    """Valkey answers OOM to every write for 6 s, then READONLY (demoted replica) for 6 s."""
    redis = stage.servers.redis
    await redis.refuse_writes_oom()
    stage.fault("OOM on writes 6s")
    await stage.sleep_until(now() + timedelta(seconds=6))
    await redis.accept_writes()
    stage.mark("OOM healed", now())
    await stage.sleep_until(now() + timedelta(seconds=3))
    await redis.become_replica()
    stage.fault("READONLY (replica) 6s")
    await stage.sleep_until(now() + timedelta(seconds=6))
    await redis.become_master()
    stage.mark("READONLY healed", now())
    await stage.sleep_until(now() + timedelta(seconds=3))


# -- partitions ----------------------------------------------------------------------------------------


async def leader_loses_redis(stage: Stage) -> None:
    """The leader reaches PostgreSQL but not Redis for 12 s."""
    leader = await stage.leader()
    term = await stage.term()
    at = now()
    leader.redis_link.blackhole()
    stage.fault(f"blackhole {leader.redis_link.name} 12s")
    stage.mark(f"{leader.name} cut from Redis", at, after_term=term)
    await stage.sleep_until(at + timedelta(seconds=12))
    leader.redis_link.heal()
    await stage.sleep_until(now() + timedelta(seconds=3))


async def leader_loses_postgres(stage: Stage) -> None:
    """The leader reaches Redis but not PostgreSQL for 12 s."""
    leader = await stage.leader()
    at = now()
    leader.pg_link.blackhole()
    stage.fault(f"blackhole {leader.pg_link.name} 12s")
    stage.mark(f"{leader.name} cut from PostgreSQL", at)
    await stage.sleep_until(at + timedelta(seconds=12))
    leader.pg_link.heal()
    await stage.sleep_until(now() + timedelta(seconds=3))


# -- PostgreSQL ----------------------------------------------------------------------------------------


async def _pg_outage(stage: Stage, mode: str, seconds: float) -> None:
    postgres = stage.servers.postgres
    await postgres.shutdown(mode)
    stage.fault(f"PostgreSQL {mode} stop {seconds:g}s")
    await asyncio.sleep(seconds)  # the fault's length: nothing to observe while the server is down
    await stage.servers.run(postgres.start)
    at = now()
    stage.mark(f"PostgreSQL back ({mode})", at)
    try:
        await stage.wait_fired_after(at, within=40)
    except TimeoutError as exc:
        stage.violation("no slot fired after PostgreSQL came back", str(exc))


async def postgres_down_twice(stage: Stage) -> None:
    await _pg_outage(stage, "fast", 10)
    await _pg_outage(stage, "fast", 10)
    await stage.sleep_until(now() + timedelta(seconds=3))


async def postgres_immediate(stage: Stage) -> None:
    await _pg_outage(stage, "immediate", 5)
    await stage.sleep_until(now() + timedelta(seconds=3))


async def postgres_sigstop(stage: Stage) -> None:
    postgres = stage.servers.postgres
    stopped = postgres.freeze()
    stage.fault(f"SIGSTOP PostgreSQL ({stopped} processes) 10s")
    await asyncio.sleep(10)  # the fault's length
    postgres.cont()
    at = now()
    stage.mark("PostgreSQL resumed", at)
    await stage.wait_fired_after(at, within=40)
    await stage.sleep_until(now() + timedelta(seconds=3))


# -- jobs that misbehave -------------------------------------------------------------------------------


async def poison(stage: Stage) -> None:
    """A job that always fails and one that always hangs: dead-lettered after their retry budget."""
    retry = RetryPolicy(max_retries=2, initial_backoff=timedelta(milliseconds=200),
                        max_backoff=timedelta(milliseconds=400), jitter=False)  # fmt: skip
    failing = await stage.control.create_job(JobSpec(name="poison-fail", handler="test.fail", retry=retry))
    hanging = await stage.control.create_job(JobSpec(
        name="poison-hang", handler="test.delay", payload={"seconds": 3600}, retry=retry,
        timeout=timedelta(seconds=1)))  # fmt: skip
    runs = [(await stage.control.trigger_job(job.id))[0].run_id for job in (failing, hanging)]
    stage.fault("poison jobs: always fails, always hangs (max_retries 2)")

    async def dead() -> bool:
        count = await stage.pool.fetchval(
            """SELECT count(*) FROM (SELECT DISTINCT ON (run_id) status FROM job_executions
               WHERE run_id = ANY($1::uuid[]) ORDER BY run_id, attempt DESC) l WHERE status = 'dead'""",
            runs,
        )
        return bool(count == len(runs))

    try:
        await eventually(dead, within=30, what="both poison runs dead")
    except TimeoutError as exc:
        stage.violation("poison job not dead-lettered", str(exc))
    attempts = await stage.pool.fetchval("SELECT max(attempt) FROM job_executions WHERE run_id = ANY($1::uuid[])", runs)
    if attempts is not None and attempts > retry.max_retries + 1:
        stage.violation("poison job retried past its budget", f"{attempts} attempts for max_retries 2")
    listed = {item.id for item in (await Queue(stage.redis).list_dead()).items}
    if not set(runs) <= listed:
        stage.violation("poison run missing from the dead-letter queue", f"{set(runs) - listed}")
    stage.note(f"poison runs dead after at most {attempts} attempts")
    # PostgreSQL knows they are dead: the dead-letter queue must come back after Redis lost it.
    await stage.servers.redis.flushall()
    stage.fault("FLUSHALL after dead-lettering")

    async def relisted() -> bool:
        return set(runs) <= {item.id for item in (await Queue(stage.redis).list_dead()).items}

    try:
        await eventually(relisted, within=20, interval=0.5, what="the dead-letter queue rebuilt from PostgreSQL")
    except TimeoutError as exc:
        stage.violation("dead-letter queue lost with Redis", str(exc))


async def handler_kills_worker(stage: Stage) -> None:
    """A handler that SIGKILLs its worker: dead-lettered as stalled at its second solo stall
    (MAX_STALLS + 1 deaths, the last two alone on a worker, `SCHEDULER_SOLO_RETRY_DELAY` apart); the
    workers it killed are restarted by the suite (by design) and everything else keeps flowing."""
    stage.may_die = ("worker",)
    crash = await stage.control.create_job(JobSpec(name="crash", handler="test.crash"))
    run = (await stage.control.trigger_job(crash.id))[0]
    stage.fault("test.crash (kills its worker)")
    deaths = 0

    async def dead_and_supervised() -> bool:
        nonlocal deaths
        for worker in stage.cluster.of("worker"):
            if not worker.alive():
                deaths += 1
                stage.note(f"{worker.name} died (exit {worker.returncode()}); restarted by design")
                worker.start()
                stage.restarted += 1
        status = await stage.pool.fetchval(
            "SELECT status FROM job_executions WHERE run_id = $1 ORDER BY attempt DESC LIMIT 1", run.run_id
        )
        return bool(status == "dead")

    try:
        await eventually(dead_and_supervised, within=60, interval=0.25, what="the crashing run dead-lettered")
    except TimeoutError as exc:
        stage.violation("crashing job not dead-lettered", str(exc))
    for worker in stage.cluster.of("worker"):
        if not worker.alive():
            worker.start()
            stage.restarted += 1
        await stage.role_ready(worker)
    stage.note(f"{deaths} worker deaths by test.crash")
    await stage.sleep_until(now() + timedelta(seconds=3))


async def cancel_while_reconnecting(stage: Stage) -> None:
    """Cancel a running run while its worker's pub/sub connection is being re-established."""
    job = await stage.control.create_job(JobSpec(name="long-one", handler="test.delay", payload={"seconds": 20}))
    run = (await stage.control.trigger_job(job.id))[0]

    async def running_on() -> str | None:
        return await stage.pool.fetchval(  # type: ignore[no-any-return]
            "SELECT worker_id FROM job_executions WHERE run_id = $1 AND status = 'running'", run.run_id
        )

    worker = stage.cluster.by_worker_id(await eventually(running_on, within=20, what="the long run started"))
    assert worker is not None
    # The worker's Redis connections are reset and refused for 2 s: its cancel listener is between
    # subscriptions when the request is published.
    worker.redis_link.reset(refuse=True)
    stage.fault(f"reset {worker.redis_link.name} 2s, cancel meanwhile")
    at = now()
    await stage.control.cancel_execution(run.run_id)
    await stage.sleep_until(at + timedelta(seconds=2))
    worker.redis_link.heal()

    async def cancelled() -> bool:
        status = await stage.pool.fetchval(
            "SELECT status FROM job_executions WHERE run_id = $1 ORDER BY attempt DESC LIMIT 1", run.run_id
        )
        return bool(status == "cancelled")

    try:
        await eventually(cancelled, within=20, what="the running run cancelled")
        stage.note(f"cancelled {(now() - at).total_seconds():.2f}s after the request")
    except TimeoutError as exc:
        stage.violation("cancellation lost", str(exc))


async def catch_up(stage: Stage, jobs: int = 300, behind_s: int = 1000) -> None:
    """`jobs` per-second jobs `behind_s` seconds behind (as after an outage): the leader plans the
    catch-up without losing its lease, and runs every slot still within the misfire grace.

    How the misfired slots are recorded (a row each, or one per run of misfires) is the planner's
    business: only the slots that must run are counted here."""
    terms_before = await stage.pool.fetchval("SELECT count(*) FROM chaos_term_history")
    rows = await stage.pool.fetch(
        """INSERT INTO jobs (name, handler, schedule_kind, cron, next_run_time, misfire_policy)
           SELECT 'catch-up-' || i, 'test.echo', 'cron', '* * * * * *',
                  date_trunc('second', now()) - make_interval(secs => $2), 'skip'
           FROM generate_series(1, $1) AS i RETURNING id, next_run_time""",
        jobs,
        behind_s,
    )
    await stage.pool.execute("SELECT pg_notify($1, '')", JOBS_CHANGED_CHANNEL)
    behind_from = rows[0]["next_run_time"]
    stage.fault(f"{jobs} jobs {behind_s}s behind")
    at = now()

    async def caught_up() -> bool:
        late = await stage.pool.fetchval(
            "SELECT count(*) FROM jobs WHERE name LIKE 'catch-up-%' AND next_run_time < now() - interval '5 seconds'"
        )
        return bool(late == 0)

    try:
        await eventually(caught_up, within=60, interval=0.5, what="the catch-up planned")
    except TimeoutError as exc:
        stage.violation("catch-up not planned", str(exc))
    stage.note(f"caught up {(now() - at).total_seconds():.1f}s after the jobs appeared")
    # Only the catch-up is under test: stop these jobs' steady load once it is planned.
    # One row per statement: the leader's firing updates many of these rows in one transaction in its
    # own order, so a multi-row UPDATE here can deadlock with it (seen once in `make chaos`); holding
    # one row lock at a time, this never waits while holding another.
    for job_id in await stage.pool.fetch("SELECT id FROM jobs WHERE name LIKE 'catch-up-%'"):
        await stage.pool.execute("UPDATE jobs SET status = 'paused', next_run_time = NULL WHERE id = $1", job_id["id"])
    # Slots this recent were within the grace however long the planning took (bounded above).
    until = at.replace(microsecond=0)
    recent = until - timedelta(seconds=30)
    ran = await stage.pool.fetchval(
        """SELECT count(DISTINCT (e.job_id, e.scheduled_for)) FROM job_executions e JOIN jobs j ON j.id = e.job_id
           WHERE j.name LIKE 'catch-up-%' AND e.scheduled_for >= $1 AND e.scheduled_for < $2
             AND e.status NOT IN ('missed', 'skipped')""",
        recent,
        until,
    )
    expected = jobs * 30
    if ran < expected:
        stage.violation("catch-up slots lost", f"{expected - ran} of {expected} slots within the grace did not run")
    missed = await stage.pool.fetchval(
        """SELECT count(*) FROM job_executions e JOIN jobs j ON j.id = e.job_id
           WHERE j.name LIKE 'catch-up-%' AND e.status = 'missed'"""
    )
    stage.note(f"catch-up from {behind_from:%H:%M:%S}: {missed} rows recorded missed")
    new_terms = await stage.pool.fetchval("SELECT count(*) FROM chaos_term_history") - terms_before
    if new_terms:
        stage.violation("leadership lost during catch-up", f"{new_terms} new terms while planning (no fault)")
    await stage.sleep_until(now() + timedelta(seconds=3))


async def thundering_herd(stage: Stage, count: int = 10_000) -> None:
    """`count` one-shot jobs due in the same second; each must fire once and succeed."""
    due = (now() + timedelta(seconds=8)).replace(microsecond=0)
    ids = await stage.pool.fetch(
        """INSERT INTO jobs (name, handler, schedule_kind, run_at, next_run_time, max_retries)
           SELECT 'herd-' || i, 'test.echo', 'once', $1, $1, 3 FROM generate_series(1, $2) AS i
           RETURNING id""",
        due,
        count,
    )
    await stage.pool.execute("SELECT pg_notify($1, '')", JOBS_CHANGED_CHANNEL)
    stage.fault(f"{count} jobs due at {due:%H:%M:%S}")
    herd = [str(row["id"]) for row in ids]
    stage.succeeding.extend(herd)

    async def all_done() -> bool:
        done = await stage.pool.fetchval(
            """SELECT count(*) FROM job_executions e JOIN jobs j ON j.id = e.job_id
               WHERE j.name LIKE 'herd-%' AND e.status = 'succeeded'"""
        )
        return bool(done >= count)

    await stage.sleep_until(due)
    try:
        await eventually(all_done, within=90, interval=0.5, what=f"{count} herd runs succeeded")
    except TimeoutError as exc:
        stage.violation("herd not drained", str(exc))
    row = await stage.pool.fetchrow(
        """SELECT count(*) AS runs, count(DISTINCT e.job_id) AS jobs,
                  percentile_cont(0.5) WITHIN GROUP (ORDER BY extract(epoch FROM e.created_at - e.scheduled_for))
                      AS fire_p50,
                  max(extract(epoch FROM e.created_at - e.scheduled_for)) AS fire_max,
                  max(extract(epoch FROM e.finished_at - e.scheduled_for)) AS drained
           FROM job_executions e JOIN jobs j ON j.id = e.job_id WHERE j.name LIKE 'herd-%' AND e.attempt = 1"""
    )
    assert row is not None
    stage.note(
        f"herd: {row['jobs']} jobs, {row['runs']} first attempts; fired p50 {row['fire_p50'] or 0:.2f}s, "
        f"last {row['fire_max'] or 0:.2f}s after due; all finished {row['drained'] or 0:.1f}s after due"
    )
    if row["runs"] != count or row["jobs"] != count:
        stage.violation("herd fired wrong", f"{row['runs']} runs for {row['jobs']} of {count} jobs")
    stage.mark("herd due", due)


# -- what jobs return, what clients do (issue 19) -----------------------------------------------------

# Results a handler may return that the service must refuse: over the size bound (the issue's own
# reproduction with test.echo, and a larger one), nested past the depth bound (past protobuf's
# Struct limit, and past orjson's), and not storable or not JSON at all.
POISON_RESULTS: tuple[tuple[str, str, dict[str, object]], ...] = (
    ("result-large-echo", "test.echo", {"text": "x" * 65_520}),
    ("result-large", "test.result", {"shape": "large", "size": 200_000}),
    ("result-deep-40", "test.result", {"shape": "deep", "size": 40}),
    ("result-deep-300", "test.result", {"shape": "deep", "size": 300}),
    ("result-nul", "test.result", {"shape": "nul"}),
    ("result-surrogate", "test.result", {"shape": "surrogate"}),
    ("result-set", "test.result", {"shape": "set"}),
)
POISON_RUNS_EACH = 2


async def _latest(stage: Stage, run_ids: Sequence[str]) -> dict[str, asyncpg.Record]:
    """The latest attempt of each run, by run id."""
    rows = await stage.pool.fetch(
        """SELECT DISTINCT ON (run_id) run_id::text, id::text, attempt, status, error FROM job_executions
           WHERE run_id = ANY($1::uuid[]) ORDER BY run_id, attempt DESC""",
        list(run_ids),
    )
    return {row["run_id"]: row for row in rows}


async def _all_final(stage: Stage, run_ids: Sequence[str], within: float, what: str) -> bool:
    """Wait until every run's latest attempt is final; a violation (and False) if one is not in time."""

    async def final() -> bool:
        latest = await _latest(stage, run_ids)
        return len(latest) == len(set(run_ids)) and all(
            r["status"] not in ("queued", "running") for r in latest.values()
        )

    try:
        await eventually(final, within=within, interval=0.25, what=what)
    except TimeoutError as exc:
        latest = await _latest(stage, run_ids)
        open_runs = [f"{run[-12:]} attempt {r['attempt']} {r['status']}" for run, r in latest.items()
                     if r["status"] in ("queued", "running")]  # fmt: skip
        stage.violation(f"{what}: not final", f"{exc}; {len(open_runs)} open: {', '.join(open_runs[:5])}")
        return False
    return True


async def poison_outputs(stage: Stage) -> None:
    """Jobs whose results are too large, too deep or not JSON, and a flow whose `$from` resolves to
    more than 64 KiB, among the per-second jobs: each poison attempt fails with an error of its own
    (never a stall), the flow node is dead ("payload resolved to ..."), no role dies, and the API
    still reads every one of them back."""
    retry = RetryPolicy(max_retries=1, initial_backoff=timedelta(milliseconds=200),
                        max_backoff=timedelta(milliseconds=200), jitter=False)  # fmt: skip
    runs: dict[str, str] = {}  # run id -> poison job name
    for name, handler, payload in POISON_RESULTS:
        job = await stage.control.create_job(JobSpec(name=name, handler=handler, payload=payload, retry=retry))
        for _ in range(POISON_RUNS_EACH):
            runs[(await stage.control.trigger_job(job.id))[0].run_id] = name
    upstream = await stage.control.create_job(JobSpec(name="flow-up", handler="test.echo",
                                                      payload={"text": "y" * 40_000}))  # fmt: skip
    await stage.control.create_job(JobSpec(
        name="flow-down", handler="test.echo", depends_on=("flow-up",),
        payload={"a": {"$from": "flow-up.result"}, "b": {"$from": "flow-up.result"}}))  # fmt: skip
    flow_id = (await stage.control.trigger_job(upstream.id))[0].run_id
    stage.fault(f"results too large, too deep, not JSON ({len(POISON_RESULTS)} jobs x{POISON_RUNS_EACH})")
    stage.fault("a flow whose $from resolves to 80 KB")

    if await _all_final(stage, list(runs), within=40, what="poison runs"):
        rows = await stage.pool.fetch(
            """SELECT run_id::text, attempt, status, coalesce(error, '') AS error FROM job_executions
               WHERE run_id = ANY($1::uuid[]) ORDER BY run_id, attempt""",
            list(runs),
        )
        errors: dict[str, str] = {}
        for row in rows:
            name = runs[row["run_id"]]
            if row["status"] not in ("failed", "dead") or not row["error"]:
                stage.violation("poison attempt not failed for its output",
                                f"{name} attempt {row['attempt']} {row['status']}: {row['error'][:120]!r}")  # fmt: skip
            elif "stall" in row["error"] or "lease" in row["error"]:
                stage.violation("poison attempt failed as a stall", f"{name}: {row['error'][:120]}")
            if row["attempt"] > retry.max_retries + 1:
                stage.violation("poison run retried past its budget", f"{name}: attempt {row['attempt']}")
            errors.setdefault(name, row["error"][:100])
        latest = await _latest(stage, list(runs))
        not_dead = [f"{runs[run]} {r['status']}" for run, r in latest.items() if r["status"] != "dead"]
        if not_dead:
            stage.violation("poison run not dead after its retries", ", ".join(not_dead[:5]))
        for name, error in errors.items():
            stage.note(f"{name}: {error}")

    async def flow_done() -> FlowRun | None:
        flow = await stage.control.get_flow_run(flow_id)
        return flow if flow.state != "running" else None

    try:
        flow = await eventually(flow_done, within=30, interval=0.25, what="the flow run finished")
    except TimeoutError as exc:
        stage.violation("flow with an oversized $from never finished", str(exc))
    else:
        nodes = {node.job_name: node for node in flow.nodes}
        down = nodes.get("flow-down")
        error = ""
        if down is not None and down.execution_id is not None:
            error = (await stage.control.get_execution(down.execution_id)).error or ""
        stage.note(f"flow {flow.state}: flow-up {nodes['flow-up'].state}, flow-down "
                   f"{down.state if down else '-'}: {error[:100]}")  # fmt: skip
        if nodes["flow-up"].state != "succeeded" or down is None or down.state != "dead":
            stage.violation("oversized $from not a dead node", f"states {[(n, v.state) for n, v in nodes.items()]}")
        elif "payload resolved to" not in error:
            stage.violation("oversized $from without its reason", f"flow-down error {error[:120]!r}")

    # Whatever was stored, a client reads it back (never INTERNAL): each attempt, and full pages.
    address, _ = await stage.endpoints(stage.cluster.of("server")[0])
    token = await login(address)
    async with SchedulerClient.connect(address, token=token, timeout=30) as client:
        ids = await stage.pool.fetch("SELECT id::text, job_id::text FROM job_executions WHERE run_id = ANY($1::uuid[])",
                                     list(runs))  # fmt: skip
        for row in ids:
            try:
                await client.get_execution(row["id"])
            except SchedulerClientError as exc:
                stage.violation(
                    "GetExecution of a poison attempt failed", f"{runs.get(row['id'], row['id'][:8])}: {exc}"
                )
        for job_id in {row["job_id"] for row in ids}:
            try:
                await client.list_executions(job_id=job_id, view="full", page_size=50)
            except SchedulerClientError as exc:
                stage.violation("ListExecutions (full) of a poison job failed", f"{job_id[:8]}: {exc}")
        try:
            await client.list_executions(view="full", page_size=200)
        except SchedulerClientError as exc:
            stage.violation("ListExecutions (full) failed", str(exc))
    await stage.sleep_until(now() + timedelta(seconds=2))  # ordinary slots go on after the poison


STORM_SLOTS = 2  # the storm worker's slots: few, so its completion buffer fills quickly
STORM_SHORT_RUNS = 30
STORM_HOLD_S = 3.0  # how long one completion is held (the fault's length)
BLOCKER_S = 0.3  # the run whose completion is held


@contextlib.asynccontextmanager
async def _row_locked(stage: Stage, execution_id: str) -> AsyncIterator[None]:
    """Hold a row lock on one attempt: the worker's completion statement that records it waits."""
    async with stage.pool.acquire() as conn, conn.transaction():
        await conn.execute("SELECT 1 FROM job_executions WHERE id = $1 FOR UPDATE", execution_id)
        yield


async def _cancel(stage: Stage, run_id: str, within: float) -> bool:
    """CancelExecution of a run's latest attempt; False if it had finished or did not answer in time
    (a cancel waiting behind the held completion is given up: it changed nothing)."""
    try:
        async with asyncio.timeout(within):
            execution_id = await stage.pool.fetchval(
                "SELECT id::text FROM job_executions WHERE run_id = $1 ORDER BY attempt DESC LIMIT 1", run_id
            )
            await stage.control.cancel_execution(execution_id)
    except (FailedPrecondition, TimeoutError):
        return False
    return True


async def cancel_storm(stage: Stage) -> None:
    """Cancels of running and just-finished runs on a worker whose completion buffer is full.

    A worker of its own (queue `storm`, 2 slots) runs many short runs while one completion of it
    is held (a row lock on the attempt it records, for 3 s): outcomes pile up until the worker
    stops fetching, and every run it holds is cancelled then, twice over. Then runs cancelled
    mid-handler on a slowed PostgreSQL link. Every run ends final (a cancelled one `cancelled` or
    `succeeded`), every run not cancelled succeeds, none twice."""
    worker = await stage.cluster.add("worker", SCHEDULER_QUEUE="storm", SCHEDULER_WORKER_CONCURRENCY=str(STORM_SLOTS))
    await stage.role_ready(worker)

    def storm_job(name: str, seconds: float) -> JobSpec:
        return JobSpec(name=name, handler="test.delay", payload={"seconds": seconds}, queue="storm")

    blocker_job = await stage.control.create_job(storm_job("storm-blocker", BLOCKER_S))
    short_job = await stage.control.create_job(storm_job("storm-short", 0.02))
    long_job = await stage.control.create_job(storm_job("storm-long", 0.6))
    runs: list[str] = []
    cancelled: set[str] = set()

    async def claimed() -> int:
        return int(await stage.pool.fetchval(
            "SELECT count(*) FROM job_executions WHERE job_id = ANY($1::uuid[]) AND started_at IS NOT NULL",
            [short_job.id, blocker_job.id]))  # fmt: skip

    for _ in range(2):
        blocker = (await stage.control.trigger_job(blocker_job.id))[0].run_id
        runs.append(blocker)

        async def blocker_running(blocker: str = blocker) -> str | None:
            return await stage.pool.fetchval(  # type: ignore[no-any-return]
                "SELECT id::text FROM job_executions WHERE run_id = $1 AND status = 'running'", blocker
            )

        execution_id = await eventually(blocker_running, within=20, what="the blocking run started")
        async with _row_locked(stage, execution_id):
            # Its handler has returned: the completion recording it waits for the lock from now on.
            started = await stage.pool.fetchval("SELECT started_at FROM job_executions WHERE id = $1", execution_id)
            await stage.sleep_until(max(started, now()) + timedelta(seconds=BLOCKER_S + 0.3))
            triggers = (stage.control.trigger_job(short_job.id) for _ in range(STORM_SHORT_RUNS))
            triggered = await asyncio.gather(*triggers)
            batch = [run.run_id for runs_ in triggered for run in runs_]
            runs.extend(batch)
            # Full: the worker stopped taking work (nothing claimed for a second) with more runs
            # running than it has slots (their outcomes wait for the held completion).
            history: list[int] = []

            async def stopped_fetching(history: list[int] = history) -> bool:
                history.append(await claimed())
                running = await stage.pool.fetchval(
                    "SELECT count(*) FROM job_executions WHERE job_id = $1 AND status = 'running'", short_job.id
                )
                return len(history) > 10 and history[-1] == history[-11] and running > STORM_SLOTS

            try:
                await eventually(stopped_fetching, within=20, interval=0.1, what="the completion buffer full")
            except TimeoutError as exc:
                stage.violation("the storm did not fill the completion buffer", str(exc))
            at = now()
            holding = await stage.pool.fetch(
                "SELECT run_id::text FROM job_executions WHERE job_id = $1 AND status = 'running'", short_job.id
            )
            stage.fault(f"completion held {STORM_HOLD_S:g}s, {len(holding)} runs awaiting their record, all cancelled")
            targets = [row["run_id"] for row in holding] + batch[::2]  # and every other run still queued
            for _ in range(2):  # twice: a repeated cancel (a retrying client) must change nothing
                done = await asyncio.gather(*(_cancel(stage, run, 1.0) for run in targets))
                cancelled.update(run for run, ok in zip(targets, done, strict=True) if ok)
            await stage.sleep_until(at + timedelta(seconds=STORM_HOLD_S))

    # Runs cancelled while their handlers run, on a slowed PostgreSQL link (claims and records slow).
    worker.pg_link.latency(0.05, 0.15)
    stage.fault("latency 50-150ms on the storm worker's PostgreSQL, cancels mid-handler")
    longs = [r.run_id for _ in range(10) for r in await stage.control.trigger_job(long_job.id)]
    runs.extend(longs)
    pending = set(longs[::2])

    async def cancelled_while_running() -> bool:
        rows = await stage.pool.fetch(
            "SELECT run_id::text FROM job_executions WHERE run_id = ANY($1::uuid[]) AND status = 'running'",
            list(pending),
        )
        for row in rows:
            if await _cancel(stage, row["run_id"], 5.0):
                cancelled.add(row["run_id"])
            pending.discard(row["run_id"])
        return not pending

    try:
        await eventually(cancelled_while_running, within=30, interval=0.05, what="long runs cancelled mid-handler")
    except TimeoutError as exc:
        stage.note(f"some long runs finished before their cancel: {exc}")
    worker.pg_link.heal()

    if not await _all_final(stage, runs, within=40, what="storm runs"):
        return
    # Which runs were cancelled is read back, not assumed: a request given up on by its timeout
    # may have committed all the same.
    requested = {row["run_id"] for row in await stage.pool.fetch(
        """SELECT DISTINCT run_id::text FROM job_executions WHERE run_id = ANY($1::uuid[])
           AND (cancel_requested_at IS NOT NULL OR status = 'cancelled')""", runs)}  # fmt: skip
    cancelled |= requested
    latest = await _latest(stage, runs)
    wrong = [f"{run[-12:]} {r['status']}" for run, r in latest.items()
             if r["status"] not in (("cancelled", "succeeded") if run in cancelled else ("succeeded",))]  # fmt: skip
    if wrong:
        stage.violation("storm run ended wrong (not cancelled: must succeed; cancelled: cancelled or succeeded)",
                        f"{len(wrong)}: {', '.join(wrong[:5])}")  # fmt: skip
    counts = Counter(r["status"] for r in latest.values())
    stage.note(f"storm: {len(runs)} runs, {len(cancelled)} cancelled by request; ended {dict(counts)}")


GARBAGE_ROUNDS = 3


def _garbage(round_: int) -> list[dict[str, bytes | str]]:
    """Stream entries this version cannot read: not an event, not JSON, an unknown type, a newer
    writer's extra field, another shape, bytes that are not UTF-8, fields of the wrong type."""
    ids = [str(uuid.uuid4()) for _ in range(3)]
    stamp = now().isoformat()
    return [
        {"x": "y"},  # the issue's reproduction
        {"e": "not json"},
        {"e": orjson.dumps(["teleported", *ids, 1, "test.echo", "", "", stamp])},
        {"e": orjson.dumps(["created", *ids, 1, "test.echo", "", "", stamp, {"added": "later"}])},
        {"e": orjson.dumps({"type": "created", "round": round_})},
        {"e": b"\xff\xfe\x00garbage"},
        {"e": orjson.dumps(["created", *ids, "one", None, 7, [], "yesterday"])},
        {"e": b"[]", "v": "2"},
    ]


async def unknown_event(stage: Stage) -> None:
    """Entries of unknown types and shapes written into the event stream while WatchExecutions
    streams and the console's live feed are open (and opened after, resuming across them): every
    watcher goes on receiving every ordinary event due to it, each once."""
    address, console_url = await stage.endpoints(stage.cluster.of("server")[0])
    token = await login(address)
    watched_job = stage.jobs[0].id
    injected: set[str] = set()
    async with Watchers(address, console_url, token) as watchers:
        watchers.grpc("grpc-all")
        watchers.grpc("grpc-one-job", job_ids=[watched_job])
        watchers.console("console-live")
        await watchers.subscribed(stage.redis, within=30)

        async def flowing() -> bool:
            return all(w.received for w in watchers.watchers)

        await eventually(flowing, within=30, what="every watcher receiving")
        before = watchers.watchers[0].received[-1]
        for round_ in range(GARBAGE_ROUNDS):
            entries = _garbage(round_)
            for fields in entries:
                entry_id = await stage.redis.xadd(EventKeys().stream, fields)  # type: ignore[arg-type]
                injected.add(entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id))
            stage.fault(f"XADD {len(entries)} unreadable entries into the event stream")
            if round_ == 0:  # new watchers, two of them resuming from before the garbage
                watchers.grpc("grpc-resumed", cursor=before)
                watchers.console("console-resumed", cursor=before)
                watchers.grpc("grpc-new")
                await watchers.subscribed(stage.redis, within=30)
            await stage.sleep_until(now() + timedelta(seconds=2))  # ordinary events go on meanwhile
        # redis-py types stream replies loosely; the shape is [(id, {field: value}), ...].
        last: Any = await stage.redis.xrevrange(EventKeys().stream, count=1)
        stream: Any = await stage.redis.xrange(EventKeys().stream, min=before, max=last[0][0])
        ordinary: list[tuple[str, str]] = []  # (cursor, job id) of every event the service wrote
        for entry_id, fields in stream:
            cursor = entry_id.decode()
            if cursor not in injected:
                ordinary.append((cursor, ExecutionEvent.from_fields(cursor, fields).job_id))

        async def delivered() -> bool:
            return all(not gaps(w.due_of(ordinary), w.received).missing for w in watchers.watchers)

        with contextlib.suppress(TimeoutError):
            await eventually(delivered, within=30, interval=0.25, what="every ordinary event delivered")
        first_garbage = min(injected, key=stream_id)
        for watcher in watchers.watchers:
            note, violations = judge(watcher, ordinary, first_garbage)
            stage.note(note)
            for invariant, detail in violations:
                stage.violation(invariant, detail)


# -- limits (issue 22) ----------------------------------------------------------------------------------

CAP_LIMIT = "per-customer"  # the scenarios' one limit: concurrency 1 per customer
TRIGGER_CHUNK = 500  # concurrent TriggerJob calls (they batch into one statement and one enqueue)
ECHO_EVERY = 10  # one key in ten is also taken by a test.echo job keyed by `payload.customer_id`
CAPPED_WORKERS = {**FAST_WORKERS, "SCHEDULER_WORKER_CONCURRENCY": "50"}  # many keys in flight at once


def limits_scale() -> float:
    """`CHAOS_LIMITS_SCALE` (default 1): multiplies the number of keys of the limit scenarios, for
    a smoke run of the harness on a small machine (the issue's figures are at scale 1)."""
    return float(os.environ.get("CHAOS_LIMITS_SCALE") or 1)


@dataclass(frozen=True)
class CappedLoad:
    """The capped work of one scenario: its jobs, its runs (triggered), its keys."""

    job_ids: list[str]
    run_ids: list[str]
    keys: int


async def capped_load(
    stage: Stage, prefix: str, *, keys: int, runs_per_key: int, seconds: tuple[float, float]
) -> CappedLoad:
    """Define the limit `per-customer` (concurrency 1) and `keys` customers' work under it, and
    trigger it all at once: per key `runs_per_key` runs of a `test.delay` job (its key a constant,
    `cust-<i>`; the delays spread over `seconds`, 16 steps) and, for one key in `ECHO_EVERY`, one
    run of a `test.echo` job whose key comes from its payload (`payload.customer_id`): two jobs,
    both template forms, one key. A key's runs are triggered together, so without the cap they
    would run side by side.

    The limit and the echo jobs go through `Control` (the application layer behind LimitService
    and JobService); the thousands of delay jobs are inserted in one statement (as `herd-10k`
    does), with the refs in the form `jobs.limits` stores (`limits.refs_to_json`).
    """
    await stage.control.limits.create_limit(LimitSpec(CAP_LIMIT, LimitKind.CONCURRENCY, 1))
    low, high = seconds
    rows = await stage.pool.fetch(
        """INSERT INTO jobs (name, handler, schedule_kind, payload, limits)
           SELECT $1 || i, 'test.delay', 'manual',
                  jsonb_build_object('seconds', round(($3::float8 + (i % 16) * $4::float8)::numeric, 3)),
                  jsonb_build_array(jsonb_build_object('limit', $5::text, 'key', 'cust-' || i, 'units', 1))
           FROM generate_series(1, $2) AS i ORDER BY i RETURNING id::text""",
        f"{prefix}delay-",
        keys,
        low,
        (high - low) / 15,
        CAP_LIMIT,
    )
    delay_jobs = [row["id"] for row in rows]
    echo_jobs: dict[int, str] = {}
    echo_keys = list(range(1, keys + 1, ECHO_EVERY))
    for start in range(0, len(echo_keys), 50):
        chunk = echo_keys[start : start + 50]
        created = await asyncio.gather(*(stage.control.create_job(JobSpec(
            name=f"{prefix}echo-{i}", handler="test.echo", payload={"customer_id": f"cust-{i}"},
            limits=(LimitRef(CAP_LIMIT, "payload.customer_id"),))) for i in chunk))  # fmt: skip
        echo_jobs.update(zip(chunk, (job.id for job in created), strict=True))
    order: list[str] = []
    for index, job_id in enumerate(delay_jobs, 1):
        order += [job_id] * runs_per_key
        if index in echo_jobs:
            order.append(echo_jobs[index])
    runs: list[str] = []
    for start in range(0, len(order), TRIGGER_CHUNK):
        triggered = await asyncio.gather(
            *(stage.control.trigger_job(job) for job in order[start : start + TRIGGER_CHUNK])
        )
        runs += [run.run_id for queued in triggered for run in queued]
    jobs = delay_jobs + list(echo_jobs.values())
    stage.succeeding.extend(jobs)
    stage.fault(f"{keys} keys capped at 1, {len(runs)} runs triggered at once")
    return CappedLoad(jobs, runs, keys)


async def capped_progress(stage: Stage, load: CappedLoad) -> tuple[int, int]:
    """(runs of the load whose latest attempt is final, runs recorded)."""
    row = await stage.pool.fetchrow(
        """SELECT count(*) FILTER (WHERE status NOT IN ('queued', 'running')) AS done, count(*) AS runs
           FROM (SELECT DISTINCT ON (run_id) status FROM job_executions WHERE job_id = ANY($1::uuid[])
                 ORDER BY run_id, attempt DESC) latest""",
        load.job_ids,
    )
    assert row is not None  # an aggregate always returns its row
    return int(row["done"]), int(row["runs"])


async def capped_done_at_least(stage: Stage, load: CappedLoad, count: int, within: float, what: str) -> bool:
    """Wait until at least `count` runs of the load are final; a violation (and False) if not in time."""

    async def reached() -> bool:
        return (await capped_progress(stage, load))[0] >= count

    try:
        await eventually(reached, within=within, interval=1.0, what=what)
    except TimeoutError as exc:
        done, recorded = await capped_progress(stage, load)
        stage.violation(f"capped runs: {what}", f"{exc}; {done} of {recorded} final")
        return False
    return True


async def capped_check(stage: Stage, load: CappedLoad, kills: Sequence[Kill]) -> None:
    """Every run of the load final (bounded), then the caps from PostgreSQL (`checker.check_caps`):
    breaches and keys recorded wrong are violations; the counts go to the report's `over cap`."""
    await capped_done_at_least(stage, load, len(load.run_ids), within=240, what="every run final")
    report = await check_caps(stage.pool, kills=kills)
    stage.outcome.report.caps = report
    if report.breaches:
        stage.violation("key over its cap (attempts of one key running at once)",
                        f"{len(report.breaches)}: " + "; ".join(str(b) for b in report.breaches[:3]))  # fmt: skip
    if report.wrong_keys:
        stage.violation("run recorded other limit keys than its payload gives",
                        f"{len(report.wrong_keys)}: " + "; ".join(report.wrong_keys[:3]))  # fmt: skip
    for note in report.notes:
        stage.note(note)
    stage.note(f"caps: {report.keys} capped keys, {report.holds} attempts started, {len(report.breaches)} over cap")


async def busy_worker(stage: Stage, turn: int) -> tuple[RoleProcess, list[str]]:
    """The live worker running the most runs now (its run ids); with none running, the `turn`-th."""
    running = await stage.running_by_worker()
    alive = [worker for worker in stage.cluster.of("worker") if worker.alive()]
    load: dict[str, list[str]] = {worker.name: [] for worker in alive} | {
        role.name: runs
        for worker_id, runs in running.items()
        if (role := stage.cluster.by_worker_id(worker_id)) is not None and role.alive()
    }
    ordered = sorted(alive, key=lambda worker: (-len(load[worker.name]), (alive.index(worker) - turn) % len(alive)))
    return ordered[0], load[ordered[0].name]


async def limits_kill9(stage: Stage, kills: int = 12, every: float = 10.0) -> None:
    """10,000 keys capped at 1 (20,000 `test.delay` runs of 50-200 ms and 1,000 `test.echo` runs,
    all triggered at once); kill -9 of the busiest worker every `every` seconds, `kills` times
    (restarted at once). No key ever ran two attempts at once (a killed attempt ends at its kill),
    every run succeeded."""
    load = await capped_load(stage, "k9-", keys=round(10_000 * limits_scale()), runs_per_key=2,
                             seconds=(0.05, 0.2))  # fmt: skip
    killed: list[Kill] = []
    hit = 0
    for turn in range(kills):
        began = now()
        worker, runs = await busy_worker(stage, turn)
        pid, spawned = worker.pid, worker.spawned_at
        worker.kill9()
        at = now()  # reaped: every attempt it ran has stopped by now
        killed.append(Kill(pid, spawned, at))
        hit += bool(runs)
        stage.fault(f"kill -9 {worker.name} ({len(runs)} running)")
        if runs:
            stage.mark(f"kill -9 {worker.name}", at, run_ids=runs)
        await stage.restart(worker)
        await stage.sleep_until(began + timedelta(seconds=every))
    done, recorded = await capped_progress(stage, load)
    stage.note(f"{hit} of {kills} kills hit running work; {recorded - done} capped runs still open after the last")
    await capped_check(stage, load, killed)


async def limits_flushall(stage: Stage, flushes: int = 2) -> None:
    """2,000 keys capped at 1 (6,000 `test.delay` runs of 0.2-1 s, 200 `test.echo` runs); FLUSHALL
    once a quarter, then once half of them are final, with capped runs running and queued each
    time. Limit state is rebuilt from PostgreSQL: no key ever ran two attempts at once, every run
    succeeded."""
    load = await capped_load(stage, "fl-", keys=round(2_000 * limits_scale()), runs_per_key=3,
                             seconds=(0.2, 1.0))  # fmt: skip
    total = len(load.run_ids)
    for index in range(flushes):
        target = total * (index + 1) // (flushes + 2)
        if not await capped_done_at_least(stage, load, target, within=180, what=f"{target} final before FLUSHALL"):
            return
        before, _ = await capped_progress(stage, load)
        at = now()
        await stage.servers.redis.flushall()
        stage.fault(f"FLUSHALL ({total - before} capped runs open)")
        stage.mark("FLUSHALL", at)
        # Observable recovery: capped runs finish again (rebuilt from PostgreSQL by reconcile).
        await capped_done_at_least(stage, load, min(total, before + 100), within=120, what="progress after FLUSHALL")
    await capped_check(stage, load, ())


async def limits_failover(stage: Stage, rounds: int = 3, every: float = 12.0) -> None:
    """3,000 keys capped at 1 (9,000 `test.delay` runs of 0.1-0.5 s, 300 `test.echo` runs); kill -9
    of the leader together with the busiest worker, `rounds` times: the killed worker's units come
    back only when the new leader recovers its expired leases. No key ever ran two attempts at
    once, every run succeeded."""
    load = await capped_load(stage, "fo-", keys=round(3_000 * limits_scale()), runs_per_key=3,
                             seconds=(0.1, 0.5))  # fmt: skip
    killed: list[Kill] = []
    for turn in range(rounds):
        began = now()
        leader = await stage.leader()
        term = await stage.term()
        worker, runs = await busy_worker(stage, turn)
        at = now()
        leader.kill9()
        pid, spawned = worker.pid, worker.spawned_at
        worker.kill9()
        killed.append(Kill(pid, spawned, now()))
        stage.fault(f"kill -9 {leader.name}")
        stage.fault(f"kill -9 {worker.name} ({len(runs)} running)")
        stage.mark(f"kill -9 {leader.name}", at, after_term=term)
        await stage.restart(worker)
        try:
            await stage.wait_fired_after(at, after_term=term, within=60)
        except TimeoutError as exc:
            stage.violation("no new leader after kill -9", str(exc))
        await stage.restart(leader)
        await stage.sleep_until(began + timedelta(seconds=every))
    done, recorded = await capped_progress(stage, load)
    stage.note(f"{recorded - done} capped runs still open after the last failover")
    await capped_check(stage, load, killed)


# -- remote workers (issue 23) ---------------------------------------------------------------------------

REMOTE_QUEUE = "remote"  # the SDK workers' queue (not the in-process workers')
REMOTE_LEASE_S = 5.0  # SCHEDULER_VISIBILITY_TIMEOUT of these scenarios: a remote worker's lease
REMOTE_HELD = 100  # runs the killed worker holds ...
REMOTE_ACKED = 80  # ... of which it acknowledged this many (the rest withheld on the wire)
REMOTE_KILL9_ENV = {
    "SCHEDULER_VISIBILITY_TIMEOUT": f"{REMOTE_LEASE_S:g}s",
    # The withheld acknowledgements must still be pending when the worker dies (not handed back by
    # the ack timeout first): what its death does to them is the point.
    "SCHEDULER_REMOTE_ACK_TIMEOUT": "120s",
}
SILENT_S = 30.0  # the blackhole's length (the issue's figure)
SILENT_WORK = {"seconds": 1.0}  # per-second remote runs of 1 s: some always running on the worker
SILENT_ENV = {
    "SCHEDULER_VISIBILITY_TIMEOUT": f"{REMOTE_LEASE_S:g}s",
    # Two unanswered pings end a stream: within a lease, so a silent worker's lease is not kept alive.
    "SCHEDULER_REMOTE_PING_INTERVAL": "1s",
}


def sdk_lines(role: RoleProcess, message: str) -> list[dict[str, Any]]:
    """The JSON lines `message` of an SDK worker's current process (`chaos.remote_worker`)."""
    found = []
    for line in role.log_text().rsplit("=== start #", 1)[-1].splitlines():
        if f'"{message}"' in line:
            with contextlib.suppress(ValueError):
                entry = orjson.loads(line)
                if entry.get("message") == message:
                    found.append(entry)
    return found


async def worker_key(address: str) -> str:
    """A new API key of the `worker` role, made through the API by the development admin."""
    async with SchedulerClient.connect(address, token=await login(address)) as client:
        return (await client.create_api_key("chaos-remote-worker", "worker", rpc_timeout=30)).secret


async def sdk_worker(stage: Stage, address: str, key: str, *argv: str) -> RoleProcess:
    """A remote worker process on `REMOTE_QUEUE` behind a proxy of its own, once it is connected."""
    role = await stage.cluster.add_sdk_worker(address, "--queue", REMOTE_QUEUE, *argv, CHAOS_WORKER_KEY=key)
    await sdk_connected(role)
    return role


async def sdk_connected(role: RoleProcess, within: float = 60) -> str:
    """The worker id of `role`'s first stream (once its current process was welcomed)."""

    async def welcomed() -> str | None:
        lines = sdk_lines(role, "connected")
        return str(lines[0]["worker_id"]) if lines else None

    return await eventually(welcomed, within=within, what=f"{role.name} connected")


async def remote_check(
    stage: Stage, run_ids: Sequence[str], *, job_ids: Sequence[str] = (), unacknowledged: Sequence[str] = (),
    killed: Sequence[str] = (), allowed: timedelta, since: datetime | None = None,
) -> list[Attempt]:  # fmt: skip
    """The remote-worker rules of `chaos.checker` over these runs (and these jobs' runs), as violations."""
    attempts = await attempts_of(stage.pool, run_ids=run_ids, job_ids=job_ids)
    rules = {
        "remote run not succeeded exactly once": not_exactly_once(attempts, run_ids),
        "unacknowledged assignment spent an attempt": spent_unacknowledged(attempts, unacknowledged),
        "run succeeded on the killed worker": succeeded_on(attempts, killed),
        "running past its lease plus the visibility timeout": overdue_running(
            attempts, allowed=allowed, cutoff=now(), since=since
        ),
    }
    for invariant, found in rules.items():
        if found:
            stage.violation(invariant, f"{len(found)}: " + "; ".join(found[:5]))
    return attempts


async def _succeeded(stage: Stage, run_ids: Sequence[str]) -> int:
    return int(await stage.pool.fetchval(
        "SELECT count(DISTINCT run_id) FROM job_executions WHERE run_id = ANY($1::uuid[]) AND status = 'succeeded'",
        list(run_ids)))  # fmt: skip


async def remote_kill9(stage: Stage) -> None:
    """kill -9 of a remote worker (the Python SDK, in a process of its own) holding 100 runs, 80 of
    them acknowledged and 20 not (their acks withheld on the wire); another SDK worker, connected
    before the kill, finishes them. Every run succeeds once, elsewhere; the unacknowledged ones come
    back unspent (their run's only attempt is the one assigned to the dead worker); the dead
    worker's attempts end within its lease plus the visibility timeout of the kill."""
    address, _ = await stage.endpoints(stage.cluster.of("server")[0])
    key = await worker_key(address)
    job = await stage.control.create_job(JobSpec(
        name="remote-held", handler=REMOTE_HANDLER, queue=REMOTE_QUEUE, timeout=timedelta(minutes=10),
        retry=RetryPolicy(max_retries=2)))  # fmt: skip
    stage.succeeding.append(job.id)
    holder = await sdk_worker(stage, address, key, "--mode", "hold", "--slots", str(REMOTE_HELD),
                              "--ack-first", str(REMOTE_ACKED))  # fmt: skip
    holder_id = await sdk_connected(holder)
    triggered = await asyncio.gather(*(stage.control.trigger_job(job.id) for _ in range(REMOTE_HELD)))
    runs = [run.run_id for batch in triggered for run in batch]

    async def holding() -> bool:
        on_it = await stage.pool.fetchval(
            """SELECT count(*) FROM job_executions
               WHERE run_id = ANY($1::uuid[]) AND status = 'running' AND worker_id = $2""",
            runs,
            holder_id,
        )
        held, withheld = sdk_lines(holder, "held"), sdk_lines(holder, "withheld")
        return on_it == REMOTE_HELD and len(held) == REMOTE_HELD and len(withheld) == REMOTE_HELD - REMOTE_ACKED

    await eventually(holding, within=60, interval=0.2, what=f"{holder.name} holding {REMOTE_HELD} runs")
    unacked = [str(line["execution_id"]) for line in sdk_lines(holder, "withheld")]
    finisher = await sdk_worker(stage, address, key, "--mode", "work", "--slots", "20")
    at = now()
    holder.kill9()
    stage.fault(f"kill -9 {holder.name} ({REMOTE_HELD} held, {len(unacked)} unacknowledged)")
    stage.mark(f"kill -9 {holder.name}", at, run_ids=runs)

    async def all_succeeded() -> bool:
        return await _succeeded(stage, runs) == len(runs)

    try:
        await eventually(all_succeeded, within=2 * REMOTE_LEASE_S + 40, interval=0.2,
                         what=f"the {len(runs)} runs succeeded elsewhere")  # fmt: skip
    except TimeoutError as exc:
        stage.violation("held runs not finished elsewhere", f"{exc}; {await _succeeded(stage, runs)} succeeded")
    attempts = await remote_check(
        stage, runs, unacknowledged=unacked, killed=[holder_id],
        allowed=timedelta(seconds=2 * REMOTE_LEASE_S), since=at,
    )  # fmt: skip
    ended = Counter(a.status for a in attempts if a.worker_id == holder_id)
    back = sum(a.execution_id in unacked and a.worker_id != holder_id for a in attempts)
    stage.note(f"{holder.name}'s attempts ended {dict(ended)}; {back} of {len(unacked)} unacknowledged ones "
               f"claimed again as the same attempt; {finisher.name} served "
               f"{len(sdk_lines(finisher, 'served'))}")  # fmt: skip
    holder.start()  # back, as after any kill (its queue has nothing left to hold)
    stage.restarted += 1
    await sdk_connected(holder)
    await stage.sleep_until(now() + timedelta(seconds=2))


async def remote_silent_proxy(stage: Stage) -> None:
    """A TCP proxy between a remote worker (the Python SDK, serving per-second runs of 1 s) and the
    server goes silent for 30 s: nothing delivered either way, no FIN, no RST. The server ends the
    stream on its unanswered pings; no attempt stays `running` past its lease plus the visibility
    timeout; once the proxy heals, the same worker process reconnects and serves runs again."""
    address, _ = await stage.endpoints(stage.cluster.of("server")[0])
    key = await worker_key(address)
    worker = await sdk_worker(stage, address, key, "--mode", "work", "--slots", "25")
    first = await sdk_connected(worker)

    job_ids = [job.id for job in stage.jobs]

    async def steadily_running() -> list[str] | None:
        """Runs running on it for 300 ms at least (surely acknowledged), once its first backlog (the
        runs due before it connected) is drained: the blackhole must catch acknowledged runs."""
        backlog = await stage.pool.fetchval(
            """SELECT count(*) FROM job_executions WHERE job_id = ANY($1::uuid[]) AND status = 'queued'
               AND scheduled_for < clock_timestamp() - interval '1 second'""",
            job_ids,
        )
        rows = await stage.pool.fetch(
            """SELECT run_id::text FROM job_executions WHERE status = 'running' AND worker_id = $1
               AND started_at < clock_timestamp() - interval '300 milliseconds'""",
            first,
        )
        return [row["run_id"] for row in rows] if backlog == 0 and len(rows) >= 3 else None

    caught = await eventually(steadily_running, within=40, interval=0.05, what=f"runs running on {worker.name}")
    pid = worker.pid
    at = now()
    worker.grpc_link.blackhole()
    stage.fault(f"blackhole {worker.grpc_link.name} {SILENT_S:g}s, no FIN/RST ({len(caught)} running)")
    await stage.sleep_until(at + timedelta(seconds=SILENT_S))
    worker.grpc_link.heal()
    healed = now()
    stage.mark(f"heal {worker.grpc_link.name}", healed, run_ids=caught)

    def streams() -> list[dict[str, Any]]:
        return sdk_lines(worker, "connected")  # one per welcome, counted by the SDK (`connects`)

    async def serving_again() -> int | None:
        """Runs this process started after the heal and succeeded, once it was welcomed again."""
        if not any(line["connects"] > 1 for line in streams()):
            return None
        served = await stage.pool.fetchval(
            """SELECT count(*) FROM job_executions
               WHERE status = 'succeeded' AND started_at > $1 AND worker_id = ANY($2::text[])""",
            healed,
            [str(line["worker_id"]) for line in streams()],
        )
        return int(served) if served >= 5 else None

    try:
        served = await eventually(serving_again, within=40, interval=0.25, what=f"{worker.name} serving again")
        stage.note(f"{worker.name} reconnected ({len(streams())} streams) and served {served} runs within "
                   f"{(now() - healed).total_seconds():.1f}s of the heal")  # fmt: skip
    except TimeoutError:
        kept = "the silent stream was kept (no new stream)" if len(streams()) < 2 else "no run served"
        stage.violation("worker did not reconnect and continue after the blackhole", f"{worker.name}: {kept}")
    if not worker.alive() or worker.pid != pid:
        stage.violation("worker did not reconnect and continue after the blackhole", f"{worker.name} was restarted")
    ended = sum("missed two pings" in line for line in stage.cluster.of("server")[0].log_lines())
    stage.note(f"the server ended {ended} silent stream(s) on unanswered pings")
    await stage.sleep_until(now() + timedelta(seconds=3))  # ordinary runs go on after the reconnect
    allowed = timedelta(seconds=SILENT_WORK["seconds"] + 2 * REMOTE_LEASE_S)
    attempts = await remote_check(stage, caught, job_ids=job_ids, allowed=allowed)
    first_ends = Counter(a.status for a in attempts if a.worker_id == first and a.run_id in caught)
    stage.note(f"the attempts caught running ended {dict(first_ends)}")


# -- Valkey Cluster (issue 24) ----------------------------------------------------------------------------

CLUSTER_NODE_TIMEOUT = timedelta(seconds=2)  # cluster-node-timeout: a master cut off this long is replaced
CLUSTER_DRAIN = 3_000  # runs triggered at once, drained while the fault happens
CLUSTER_DRAIN_WORK = {"seconds": 0.05}  # each: 20 worker slots drain ~400 a second at most
# The sharded queue's drain (issue 24's acceptance: 50,000 runs over 3 shards, each succeeded once
# through a master's kill -9): no-op runs, so it lasts tens of seconds, not minutes.
CLUSTER_SHARDED_DRAIN = 50_000
SHARDED_DRAIN_WORKERS = {**FAST_WORKERS, "SCHEDULER_WORKER_CONCURRENCY": "100"}  # batches of 100, not 10
CLUSTER_DRAIN_PRIORITY = -100  # below the per-second jobs: a slot fired after the fault is not queued behind them
CLUSTER_HOLD_S = 3.0  # how long a migrating slot stays half-moved (past redis-py's TRYAGAIN retries)
CLUSTER_CUT_S = 15.0  # the longest a cut-off master stays cut off after its replica was promoted
CLUSTER_RECOVERY_S = 10.0  # the recovery aimed at: node timeout, election, the clients' new slot map


async def queue_slots(stage: Stage) -> list[int]:
    """The cluster slot of each shard of the in-process queue, shard 0 first (every key of a shard
    has its hash tag, `{q:<name>}` or `{q:<name>#<i>}`), asked of the cluster (CLUSTER KEYSLOT)."""
    valkey = _valkey(stage)
    histories = (await QueueShardRepository(stage.pool).histories())[1].get(IN_PROCESS_QUEUE, ())
    shards = max((change.shards for change in histories), default=1)
    return [await valkey.slot_of(QueueKeys(shard_name(IN_PROCESS_QUEUE, i)).ready) for i in range(shards)]


def _valkey(stage: Stage) -> ChaosValkeyCluster:
    if stage.valkey is None:
        raise RuntimeError(f"{stage.name} needs a Valkey Cluster (Scenario.valkey_cluster)")
    return stage.valkey


async def cluster_drain(stage: Stage, prefix: str, count: int = CLUSTER_DRAIN) -> list[str]:
    """`count` runs of a job below the per-second jobs' priority (`test.delay` of
    `CLUSTER_DRAIN_WORK`, or `test.echo` for more than `CLUSTER_DRAIN`), triggered at once in
    batches (BatchTriggerJobs' path); returns once a fifth of them are final (the queue holds the
    rest, the workers are busy)."""
    handler, payload = ("test.delay", CLUSTER_DRAIN_WORK) if count <= CLUSTER_DRAIN else ("test.echo", {})
    spec = JobSpec(name=f"{prefix}drain", handler=handler, payload=payload, priority=CLUSTER_DRAIN_PRIORITY)
    job = await stage.control.create_job(spec)
    stage.succeeding.append(job.id)
    runs: list[str] = []
    for start in range(0, count, MAX_TRIGGER_ITEMS):
        items = [TriggerItem(job.id) for _ in range(min(MAX_TRIGGER_ITEMS, count - start))]
        for made in await stage.control.trigger_many(items):
            if isinstance(made, SchedulerError):
                raise made  # the scenario could not run
            runs.append(made.run_id)

    async def under_way() -> bool:
        return await _final(stage, runs) >= len(runs) // 5

    await eventually(under_way, within=120, interval=0.2, what=f"a fifth of the {len(runs)} runs final")
    return runs


async def _final(stage: Stage, run_ids: Sequence[str]) -> int:
    return int(await stage.pool.fetchval(
        """SELECT count(*) FROM (SELECT DISTINCT ON (run_id) status FROM job_executions
           WHERE run_id = ANY($1::uuid[]) ORDER BY run_id, attempt DESC) latest
           WHERE status NOT IN ('queued', 'running')""", list(run_ids)))  # fmt: skip


async def completed_since(stage: Stage, at: datetime) -> datetime | None:
    """When the first slot fired after `at` succeeded (it went through the queue after `at`)."""
    return await stage.pool.fetchval(  # type: ignore[no-any-return]
        """SELECT min(finished_at) FROM job_executions
           WHERE status = 'succeeded' AND trigger = 'schedule' AND attempt = 1 AND created_at > $1""",
        at,
    )


async def _runs_complete_again(stage: Stage, at: datetime, what: str, within: float = 60) -> bool:
    """Wait until a slot fired after `at` succeeded; a violation (and False) if none did in time."""
    try:
        done = await eventually(lambda: completed_since(stage, at), within=within, interval=0.1,
                                what=f"a run fired after {what} succeeded")  # fmt: skip
    except TimeoutError as exc:
        stage.violation("runs did not complete again", str(exc))
        return False
    stage.note(f"runs complete again {(done - at).total_seconds():.2f}s after {what}")
    return True


async def _promoted(stage: Stage, slot: int, old: ValkeyNode, at: datetime, within: float = 30) -> ValkeyNode:
    """The replica that took slot `slot` over from `old`, once every answering node agrees."""
    valkey = _valkey(stage)
    node = await eventually(lambda: valkey.serving(slot, not_by=old.id), within=within, interval=0.05,
                            what=f"slot {slot} served by another master than {old.port}")  # fmt: skip
    stage.note(f"replica :{node.port} promoted: serves slot {slot} {(now() - at).total_seconds():.2f}s after the fault")
    return node


async def _rejoined(stage: Stage, port: int, within: float = 30) -> None:
    """Wait until node `port` is a replica in sync with its master (the old master, demoted)."""
    valkey = _valkey(stage)
    began = now()
    try:
        node = await eventually(lambda: valkey.replica_in_sync(port), within=within, interval=0.1,
                                what=f":{port} back as a replica in sync")  # fmt: skip
    except TimeoutError as exc:
        stage.violation("old master did not rejoin as a replica", str(exc))
        return
    master = next((n for n in await valkey.nodes() if n.id == node.master_id), None)
    stage.note(f":{port} rejoined as a replica of :{master.port if master else '?'} "
               f"{(now() - began).total_seconds():.2f}s after it came back")  # fmt: skip


async def _drained(stage: Stage, runs: Sequence[str], within: float = 120) -> None:
    """Every run of the drain final (bounded); the checker then says whether each succeeded once."""
    if await _all_final(stage, runs, within=within, what="drain runs"):
        stage.note(f"all {len(runs)} drain runs final")


async def cluster_master_kill9(stage: Stage) -> None:
    """kill -9 of the master serving shard 0 of a 3-shard queue while 50,000 runs drain (and the
    per-second jobs fire): its replica is promoted by the cluster; what the dead master had not
    replicated is lost and rebuilt from PostgreSQL. Then the killed node is started again and
    rejoins as a replica. Recovery: the kill -> a slot fired after it succeeded. The checker counts
    every drain run succeeded exactly once."""
    valkey = _valkey(stage)
    slots = await queue_slots(stage)
    slot = slots[0]
    runs = await cluster_drain(stage, "k9-", CLUSTER_SHARDED_DRAIN)
    master = await valkey.owner(slot)
    on_master = [i for i, other in enumerate(slots) if master.serves(other)]
    open_runs = len(runs) - await _final(stage, runs)
    valkey.kill(master.port)
    at = now()
    stage.fault(f"kill -9 the master of the queue's shards {on_master} of {len(slots)} (slot {slot}, :{master.port}, "
                f"{open_runs} drain runs open)")  # fmt: skip
    stage.mark("kill -9 the queue's master", at, completed=True)
    await _promoted(stage, slot, master, at)
    await _runs_complete_again(stage, at, "the kill")
    await stage.servers.run(lambda: valkey.restart(master.port))
    await _rejoined(stage, master.port)
    await _drained(stage, runs, within=300)


async def cluster_slot_migration(stage: Stage) -> None:
    """The queue's slot moved to another master and back while 3,000 runs drain: SETSLOT
    IMPORTING/MIGRATING, MIGRATE of its keys 10 at a time, SETSLOT NODE, as `valkey-cli --cluster
    reshard` does, each time held half-moved for 3 s (single-key commands get ASK, the queue's
    multi-key scripts TRYAGAIN: the roles retry, none dies, nothing is lost or run twice).
    Recovery: the migration's end -> a slot fired after it succeeded."""
    valkey = _valkey(stage)
    (slot,) = await queue_slots(stage)
    runs = await cluster_drain(stage, "mig-")
    home = await valkey.owner(slot)
    away = next(node for node in await valkey.nodes() if node.master and node.id != home.id)
    for source, target in ((home, away), (away, home)):
        open_runs = len(runs) - await _final(stage, runs)
        began = now()
        moved = await valkey.migrate_slot(slot, target, hold=CLUSTER_HOLD_S)
        at = now()
        stage.fault(f"migrate the queue's slot {slot} :{source.port} -> :{target.port} "
                    f"({moved} keys, {(at - began).total_seconds():.1f}s, {open_runs} drain runs open)")  # fmt: skip
        stage.mark(f"slot {slot} on :{target.port}", at, completed=True)
        if (await valkey.owner(slot)).id != target.id:
            stage.violation("slot not moved", f"slot {slot} is not on :{target.port} after its migration")
        await _runs_complete_again(stage, at, f"the move to :{target.port}")
    await _drained(stage, runs)


async def cluster_master_partition(stage: Stage) -> None:
    """The master serving the queue's slot cut off from everyone (SIGSTOP: its peers and the
    clients connect but get no answer) while 3,000 runs drain: its replica is promoted. The cut
    lasts until runs complete again, or `CLUSTER_CUT_S` after the promotion at most; then SIGCONT:
    the old master rejoins as a replica. Recovery: the cut -> a slot fired after it succeeded.

    A node that accepts connections but never answers gives redis-py's cluster client neither the
    error nor the MOVED it learns a new slot map from (the roles' own call timeouts cancel the calls
    inside the client): the roles' client checks its map itself when a call times out
    (`scheduler_grpc.cluster_client`), so runs must complete again while the old master is still
    cut off."""
    valkey = _valkey(stage)
    (slot,) = await queue_slots(stage)
    runs = await cluster_drain(stage, "part-")
    master = await valkey.owner(slot)
    open_runs = len(runs) - await _final(stage, runs)
    valkey.pause(master.port)
    at = now()
    stage.fault(f"SIGSTOP the master of the queue's slot {slot} (:{master.port}, {open_runs} drain runs open)")
    stage.mark("SIGSTOP the queue's master", at, completed=True)
    try:
        await _promoted(stage, slot, master, at)
        promoted = now()
        try:
            await eventually(lambda: completed_since(stage, at), within=CLUSTER_CUT_S, interval=0.1)
            stage.note(f"runs complete again while :{master.port} is cut off")
        except TimeoutError:
            stage.violation("runs did not complete again while the old master was cut off",
                            f"no run completed in the {CLUSTER_CUT_S:g}s after the promotion while :{master.port} "
                            "was cut off: the roles still ask the old master")  # fmt: skip
        stage.note(f"cut {(now() - promoted).total_seconds():.1f}s past the promotion")
    finally:
        valkey.resume(master.port)
    stage.note(f"SIGCONT :{master.port} {(now() - at).total_seconds():.1f}s after the cut")
    await _runs_complete_again(stage, at, "the cut")
    await _rejoined(stage, master.port)
    await _drained(stage, runs)


SCENARIOS: tuple[Scenario, ...] = (
    Scenario("leader-kill9", leader_kill9, budget=240, target_p99=3.0,
             description="kill -9 of the leader x10, default TTL"),
    Scenario("leader-sigterm", leader_sigterm, budget=120, target_p99=1.0,
             description="SIGTERM of the leader x5, default TTL"),
    Scenario("zombie-leader", zombie_leader, budget=90, description="SIGSTOP the leader 15 s, then SIGCONT"),
    Scenario("worker-kill9", worker_kill9, env=FAST_WORKERS, handler="test.delay", payload=BUSY, budget=150,
             description="kill -9 of the busiest worker x10"),
    Scenario("worker-kill9-reserved", worker_kill9_reserved, env=FAST_WORKERS, budget=120,
             description="kill -9 of a worker holding reservations x5"),
    Scenario("worker-sigterm", worker_sigterm, env=FAST_WORKERS, handler="test.delay", payload=BUSY, budget=120,
             description="SIGTERM of the busiest worker x3"),
    Scenario("worker-cut-off", worker_cut_off, env={"SCHEDULER_VISIBILITY_TIMEOUT": "2s"}, budget=60,
             description="a worker loses Redis past its visibility timeout"),
    Scenario("flushall", flushall, budget=90, description="FLUSHALL x2"),
    Scenario("valkey-restart", valkey_restart_empty, budget=60, description="kill -9 Valkey, restart empty"),
    Scenario("valkey-aof", valkey_restart_aof, budget=90, description="kill -9 Valkey, restart from its AOF"),
    Scenario("redis-slow", redis_slow_leader_link, budget=60, description="2-5 s latency on the leader's Redis"),
    # Runs in flight when the writes start failing, with short leases: their extensions meet the errors.
    Scenario("redis-readonly-oom", redis_refuses_writes, env=FAST_WORKERS, handler="test.delay",
             payload={"seconds": 1.5}, cron_jobs=10, budget=60, description="OOM, then READONLY"),
    Scenario("leader-no-redis", leader_loses_redis, budget=60, description="leader reaches PG, not Redis"),
    Scenario("leader-no-pg", leader_loses_postgres, budget=60, description="leader reaches Redis, not PG"),
    Scenario("pg-down-twice", postgres_down_twice, budget=120, settle=40, description="PG fast stop 10 s, twice"),
    Scenario("pg-immediate", postgres_immediate, budget=60, description="PG immediate stop 5 s"),
    Scenario("pg-sigstop", postgres_sigstop, budget=60, description="SIGSTOP PG and its backends 10 s"),
    Scenario("poison", poison, budget=60, description="always-failing and always-hanging jobs"),
    Scenario("handler-kills-worker", handler_kills_worker,
             env={**FAST_WORKERS, "SCHEDULER_MAX_STALLS": "2", "SCHEDULER_SOLO_RETRY_DELAY": "5s"},
             budget=90, description="test.crash SIGKILLs its worker"),
    Scenario("cancel-reconnect", cancel_while_reconnecting, budget=60,
             description="cancel a running run while its worker resubscribes"),
    Scenario("catch-up", catch_up, budget=150, settle=60, description="300 per-second jobs 1000 s behind"),
    Scenario("herd-10k", thundering_herd, budget=150, settle=40, description="10,000 jobs due in the same second"),
    # Every poison attempt fails: test.result's circuit breaker would hold its runs back (by design,
    # and not what this is about), so it never opens here.
    Scenario("poison-outputs", poison_outputs, servers=1, budget=90, env={"SCHEDULER_BREAKER_MIN_CALLS": "1000"},
             description="results too large, too deep, not JSON; an oversized resolved $from"),
    Scenario("cancel-storm", cancel_storm, cron_jobs=10, budget=90,
             description="cancels of running and finished runs while the completion buffer is full"),
    Scenario("unknown-event", unknown_event, schedulers=1, servers=1, budget=60,
             description="unreadable entries in the event stream under open watchers"),
    # Issue 22: the caps under faults, counted from PostgreSQL (`over cap`).
    Scenario("limits-kill9", limits_kill9, env=FAST_WORKERS, cron_jobs=5, budget=600, settle=60,
             description="10,000 keys capped at 1, kill -9 of a worker every 10 s for 2 min"),
    Scenario("limits-flushall", limits_flushall, env=CAPPED_WORKERS, cron_jobs=5, budget=480, settle=60,
             description="2,000 keys capped at 1, FLUSHALL x2 while they drain"),
    Scenario("limits-failover", limits_failover, env=CAPPED_WORKERS, cron_jobs=5, budget=480, settle=60,
             description="3,000 keys capped at 1, kill -9 of the leader (and a worker) x3"),
    # Issue 23: remote workers (the Python SDK in processes of their own), counted from PostgreSQL.
    Scenario("remote-kill9", remote_kill9, env=REMOTE_KILL9_ENV, schedulers=1, workers=1, servers=1, cron_jobs=5,
             budget=120, description="kill -9 of a remote worker holding 100 runs (20 unacknowledged)"),
    Scenario("remote-silent-proxy", remote_silent_proxy, env=SILENT_ENV, handler=REMOTE_HANDLER,
             payload=SILENT_WORK, queue=REMOTE_QUEUE, schedulers=1, workers=0, servers=1, cron_jobs=5,
             budget=120, description="a proxy silently drops a remote worker's stream 30 s (no FIN, no RST)"),
    # Issue 24: a Valkey Cluster of the scenario's own (3 masters, 3 replicas); roles on redis+cluster://.
    Scenario("cluster-master-kill9", cluster_master_kill9, env=SHARDED_DRAIN_WORKERS,
             valkey_cluster=CLUSTER_NODE_TIMEOUT,
             budget=420, target_p99=CLUSTER_RECOVERY_S,
             queue_shards=3, description="kill -9 of a 3-shard queue's master during a drain of 50,000 runs"),
    Scenario("cluster-slot-migration", cluster_slot_migration, env=FAST_WORKERS, valkey_cluster=CLUSTER_NODE_TIMEOUT,
             budget=150, target_p99=CLUSTER_RECOVERY_S,
             description="the queue's slot migrated to another master and back under load"),
    Scenario("cluster-master-partition", cluster_master_partition, env=FAST_WORKERS,
             valkey_cluster=CLUSTER_NODE_TIMEOUT, budget=150, target_p99=CLUSTER_RECOVERY_S,
             description="the queue's master cut off (SIGSTOP) during a drain, then back"),
)  # fmt: skip
