"""The engine's promises, proven with real scheduler and worker processes.

Each test starts `scheduler-grpc scheduler|worker` processes against the test servers, drives them
through the domain API, and polls PostgreSQL with deadlines (no sleeping as synchronisation).
"""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from datetime import timedelta
from pathlib import Path

import asyncpg
import pytest
import redis.asyncio as aioredis
from aiohttp import web

from scheduler_grpc.connections import redis_client
from scheduler_grpc.control import Control
from scheduler_grpc.embedded import EmbeddedRedis
from scheduler_grpc.handlers import HandlerSettings, default_registry
from scheduler_grpc.jobs import JobSpec, RetryPolicy, ScheduleKind
from scheduler_grpc.queue import ItemState, Queue
from tests.engine_helpers import Role, Roles, eventually, wait_until_ready


def every_second(name: str, handler: str = "test.echo", **fields: object) -> JobSpec:
    return JobSpec(name=name, handler=handler, schedule_kind=ScheduleKind.CRON, cron="* * * * * *", **fields)  # type: ignore[arg-type]


def manual(name: str, handler: str, payload: dict[str, object] | None = None, **fields: object) -> JobSpec:
    return JobSpec(name=name, handler=handler, payload=payload or {}, **fields)  # type: ignore[arg-type]


def process_alive(pid: int) -> bool:
    """Whether `pid` is a live process (a zombie waiting for its reaper is not)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


async def statuses(pool: asyncpg.Pool, job_id: str) -> list[tuple[int, str]]:
    rows = await pool.fetch(
        "SELECT attempt, status FROM job_executions WHERE job_id = $1 ORDER BY scheduled_for, attempt", job_id
    )
    return [(row["attempt"], row["status"]) for row in rows]


@pytest.mark.cluster_too
async def test_per_second_cron_fires_once_per_slot_within_a_second(
    roles: Roles, control: Control, pool: asyncpg.Pool, redis: aioredis.Redis
) -> None:
    roles.start("scheduler")
    roles.start("worker")
    await wait_until_ready(redis, workers=1)
    job = await control.create_job(every_second("tick"))

    async def five_done() -> list[asyncpg.Record]:
        rows = await pool.fetch(
            "SELECT scheduled_for, started_at, status FROM job_executions WHERE job_id = $1 ORDER BY scheduled_for",
            job.id,
        )
        return rows if sum(row["status"] == "succeeded" for row in rows) >= 5 else []

    rows = await eventually(five_done, within=30)
    slots = [row["scheduled_for"] for row in rows]
    assert len(slots) == len(set(slots)), "a slot fired twice"
    assert all(b - a == timedelta(seconds=1) for a, b in itertools.pairwise(slots)), slots
    finished = [row for row in rows if row["status"] == "succeeded"]
    lateness = [(row["started_at"] - row["scheduled_for"]).total_seconds() for row in finished]
    assert max(lateness) < 1.0, lateness


@pytest.mark.cluster_too
async def test_kill_9_of_a_worker_mid_job_completes_elsewhere(
    roles: Roles, control: Control, pool: asyncpg.Pool
) -> None:
    roles.start("scheduler")
    first = roles.start("worker")
    job = await control.create_job(manual("slow", "test.delay", {"seconds": 2}))
    await control.trigger_job(job.id)

    async def running_on_first() -> bool:
        return (
            await pool.fetchval("SELECT count(*) FROM job_executions WHERE job_id = $1 AND status = 'running'", job.id)
            == 1
        )

    await eventually(running_on_first, within=15)
    first.signal(signal.SIGKILL)
    roles.start("worker")

    async def succeeded() -> list[tuple[int, str]]:
        history = await statuses(pool, job.id)
        return history if history and history[-1][1] == "succeeded" else []

    history = await eventually(succeeded, within=30)
    assert history == [(1, "abandoned"), (2, "succeeded")]


async def test_a_job_that_kills_its_workers_is_dead_lettered_while_others_flow(
    roles: Roles, control: Control, pool: asyncpg.Pool, redis: aioredis.Redis
) -> None:
    # Parked at its second solo stall (`queue_recover.lua`): three deaths with a limit of 2.
    stalls = {"SCHEDULER_MAX_STALLS": "2", "SCHEDULER_SOLO_RETRY_DELAY": "1s"}
    for _ in range(4):
        roles.start("worker", **stalls)
    roles.start("scheduler", **stalls)
    crash = await control.create_job(manual("crash", "test.crash"))
    echo = await control.create_job(manual("echo", "test.echo"))
    run = (await control.trigger_job(crash.id))[0]

    async def dead() -> list[tuple[int, str]]:
        history = await statuses(pool, crash.id)
        return history if history and history[-1][1] == "dead" else []

    history = await eventually(dead, within=40)
    # Three stalls, each a death, make ["abandoned", "abandoned", "dead"]. On a starved machine a
    # lease can also lapse before its worker claimed the run (a stall without a death, or a late
    # claim that starts one more attempt): never more than three deaths, and never more attempts
    # than one more per stall.
    assert [status for _, status in history][-1:] == ["dead"], history
    assert {status for _, status in history[:-1]} == {"abandoned"}, history
    assert 3 <= len(history) <= 6, history
    dead_page = await Queue(redis).list_dead()
    assert [item.id for item in dead_page.items] == [run.run_id]
    assert "stalled" in dead_page.items[0].reason
    died = sum(role.process.poll() is not None for role in roles.started)
    assert 1 <= died <= 3, f"{died} workers died"
    for _ in range(20):
        await control.trigger_job(echo.id)

    async def echoes_done() -> bool:
        return (await statuses(pool, echo.id)).count((1, "succeeded")) == 20

    await eventually(echoes_done, within=20)


async def test_handler_past_its_timeout_is_timed_out_and_leaves_no_orphan(
    roles: Roles, control: Control, pool: asyncpg.Pool, tmp_path: Path
) -> None:
    roles.start("scheduler")
    roles.start("worker", SCHEDULER_SHELL_ENABLED="true")
    pid_file = f"{tmp_path}/child.pid"
    script = f"sh -c 'trap \"\" TERM; echo $$ > {pid_file}; while true; do sleep 0.1; done' & wait"
    stubborn = await control.create_job(
        manual(
            "stubborn",
            "shell.command",
            {"argv": ["sh", "-c", script]},
            timeout=timedelta(seconds=1),
            retry=RetryPolicy(max_retries=1, initial_backoff=timedelta(seconds=30)),
        )
    )
    slow = await control.create_job(
        manual(
            "slow",
            "test.delay",
            {"seconds": 30},
            timeout=timedelta(seconds=1),
            retry=RetryPolicy(max_retries=1, initial_backoff=timedelta(seconds=30)),
        )
    )
    for job in (stubborn, slow):
        await control.trigger_job(job.id)

    async def both_finished() -> list[asyncpg.Record]:
        rows = await pool.fetch(
            """SELECT job_id, status, error, started_at, finished_at FROM job_executions
               WHERE attempt = 1 AND status NOT IN ('queued', 'running')"""
        )
        return rows if len(rows) == 2 else []

    rows = await eventually(both_finished, within=20)
    for row in rows:
        assert row["status"] == "timed_out"
        assert row["error"] == "timed out after 1s"
        assert (row["finished_at"] - row["started_at"]).total_seconds() < 2.0
    child = int(await asyncio.to_thread(Path(pid_file).read_text))

    def child_gone() -> bool:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            return True
        return False

    async def gone() -> bool:
        return child_gone()

    await eventually(gone, within=3)


async def test_kill_9_of_a_worker_takes_its_shell_command_with_it(
    roles: Roles, control: Control, pool: asyncpg.Pool, tmp_path: Path
) -> None:
    worker = roles.start("worker", SCHEDULER_SHELL_ENABLED="true")
    pid_file = tmp_path / "command.pid"
    # A command that would outlive its worker: it ignores SIGTERM and SIGHUP and runs a minute.
    program = (
        "import os, signal, time; "
        "signal.signal(signal.SIGTERM, signal.SIG_IGN); signal.signal(signal.SIGHUP, signal.SIG_IGN); "
        f"open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(60)"
    )
    job = await control.create_job(manual("long", "shell.command", {"argv": [sys.executable, "-c", program]}))
    await control.trigger_job(job.id)

    async def command_pid() -> int | None:
        text = await asyncio.to_thread(lambda: pid_file.read_text() if pid_file.exists() else "")
        return int(text) if text else None

    pid = await eventually(command_pid, within=15)
    assert process_alive(pid)
    worker.signal(signal.SIGKILL)

    async def gone() -> bool:
        return not process_alive(pid)

    await eventually(gone, within=5)


async def test_poison_job_gets_exactly_max_retries_plus_one_attempts_then_the_dlq(
    roles: Roles, control: Control, pool: asyncpg.Pool, redis: aioredis.Redis
) -> None:
    roles.start("scheduler")
    roles.start("worker")
    retry = RetryPolicy(
        max_retries=3, initial_backoff=timedelta(milliseconds=300), max_backoff=timedelta(seconds=1), jitter=False
    )
    # Fails its first four attempts: the budget (3 retries) is spent on them; a requeue then succeeds.
    job = await control.create_job(manual("poison", "test.fail", {"fail_attempts": 4}, retry=retry))
    run = (await control.trigger_job(job.id))[0]

    async def dead() -> list[asyncpg.Record]:
        rows = await pool.fetch(
            "SELECT attempt, status, started_at, finished_at FROM job_executions WHERE run_id = $1 ORDER BY attempt",
            run.run_id,
        )
        return rows if rows and rows[-1]["status"] == "dead" else []

    rows = await eventually(dead, within=30)
    assert [(row["attempt"], row["status"]) for row in rows] == [
        (1, "failed"),
        (2, "failed"),
        (3, "failed"),
        (4, "dead"),
    ]
    gaps = [(b["started_at"] - a["finished_at"]).total_seconds() for a, b in itertools.pairwise(rows)]
    expected = [0.3, 0.6, 1.0]  # min(initial * 2^(n-1), max)
    for gap, low in zip(gaps, expected, strict=True):
        assert low <= gap < low + 0.5, gaps
    queue = Queue(redis)

    async def parked() -> list[str]:  # PostgreSQL records `dead` first, then the queue parks the item
        return [item.id for item in (await queue.list_dead()).items]

    assert await eventually(parked, within=5) == [run.run_id]

    await control.requeue_dead_runs("default", [run.run_id])

    async def succeeded() -> list[tuple[int, str]]:
        history = await statuses(pool, job.id)
        return history if history[-1] == (5, "succeeded") else []

    await eventually(succeeded, within=15)
    assert (await queue.list_dead()).items == []


async def test_two_schedulers_and_a_paused_leader_fire_every_slot_exactly_once(
    roles: Roles, control: Control, pool: asyncpg.Pool, redis: aioredis.Redis
) -> None:
    schedulers = [roles.start("scheduler"), roles.start("scheduler")]
    roles.start("worker")
    await wait_until_ready(redis, workers=1)
    job = await control.create_job(every_second("tick"))

    async def leader() -> Role | None:
        holder = await pool.fetchval("SELECT holder FROM leader_state WHERE scope = 'scheduler'")
        return next((role for role in schedulers if holder and holder.startswith(f"{role.name}:")), None)

    async def slots_so_far() -> int:
        return int(await pool.fetchval("SELECT count(*) FROM job_executions WHERE job_id = $1", job.id))

    # A few slots in steady state first (the first leader fires them on time).
    await eventually(lambda: _at_least(slots_so_far, 5), within=40)
    zombie = await eventually(leader, within=5)
    zombie.signal(signal.SIGSTOP)
    paused_at = time.monotonic()

    async def someone_else_leads() -> bool:
        return (await leader()) not in (None, zombie)

    await eventually(someone_else_leads, within=10)
    takeover = time.monotonic() - paused_at
    # Keep it paused while the new leader fires slots (its own view of what is due goes stale), then
    # let it wake up believing it still leads.
    fired_before = await slots_so_far()
    await eventually(lambda: _at_least(slots_so_far, fired_before + 3), within=10)
    zombie.signal(signal.SIGCONT)

    async def zombie_stepped_down() -> bool:
        return any('"stepped down"' in line for line in zombie.log_lines())

    await eventually(zombie_stepped_down, within=10)
    # Slots after its wake-up: fired by the new leader while the zombie is back as a standby (a
    # duplicate or a hole here is what a zombie acting on its stale view would leave).
    stepped_down_at = await slots_so_far()
    await eventually(lambda: _at_least(slots_so_far, stepped_down_at + 5), within=30)
    await control.pause_job(job.id)
    rows = await pool.fetch(
        "SELECT scheduled_for, attempt, status FROM job_executions WHERE job_id = $1 ORDER BY scheduled_for", job.id
    )
    slots = [row["scheduled_for"] for row in rows]
    assert len(slots) == len(set(slots)), "a slot fired twice"
    assert all(b - a == timedelta(seconds=1) for a, b in itertools.pairwise(slots)), "a slot was lost"
    assert len(slots) >= 5 + 3 + 5
    assert takeover < 2.0 + 1.5, f"crash failover took {takeover:.2f}s"
    print(f"crash failover (SIGSTOP of the leader -> standby leads): {takeover:.2f}s")


async def _at_least(count: Callable[[], Awaitable[int]], minimum: int) -> bool:
    return await count() >= minimum


async def test_no_execution_is_lost_when_redis_is_flushed_or_restarted_empty(
    roles: Roles, pool: asyncpg.Pool, tmp_path: Path
) -> None:
    server = EmbeddedRedis(tmp_path / "valkey", persistent=False)
    url = server.start()
    client = redis_client(url)
    registry = default_registry(HandlerSettings())
    try:
        control = Control(client, pool, registry)
        roles.env["REDIS_URL"] = url
        roles.start("scheduler")
        roles.start("worker")
        roles.start("worker")
        await wait_until_ready(client, workers=2)
        job = await control.create_job(manual("work", "test.delay", {"seconds": 0.2}))
        triggered = 0

        async def trigger(count: int) -> None:
            nonlocal triggered
            for _ in range(count):
                await control.trigger_job(job.id)
            triggered += count

        async def all_succeeded() -> bool:
            done = await pool.fetchval(
                "SELECT count(*) FROM job_executions WHERE job_id = $1 AND status = 'succeeded'", job.id
            )
            return bool(done == triggered)

        await trigger(60)
        await client.flushall()  # mid-run: queued, delayed and leased items all vanish
        await trigger(10)
        await eventually(all_succeeded, within=40)

        await trigger(60)
        server.kill()  # SIGKILL, no persistence: it comes back empty on the same port
        server.start()
        await trigger(10)
        await eventually(all_succeeded, within=60)
        runs = await pool.fetchval("SELECT count(DISTINCT run_id) FROM job_executions WHERE job_id = $1", job.id)
        assert runs == triggered == 140
    finally:
        await registry.aclose()
        await client.aclose()
        roles.stop_all()
        server.stop()


async def test_sigterm_of_a_busy_worker_finishes_or_hands_back_its_work_at_once(
    roles: Roles, control: Control, pool: asyncpg.Pool, redis: aioredis.Redis
) -> None:
    roles.start("scheduler")
    worker = roles.start(
        "worker", "--concurrency", "4", SCHEDULER_SHUTDOWN_GRACE="1s", SCHEDULER_VISIBILITY_TIMEOUT="60s"
    )
    await wait_until_ready(redis, workers=1)
    quick = await control.create_job(manual("quick", "test.delay", {"seconds": 0.3}))
    slow = await control.create_job(manual("slow", "test.delay", {"seconds": 60}))
    slow_runs = [(await control.trigger_job(slow.id))[0].run_id for _ in range(2)]
    for _ in range(2):
        await control.trigger_job(quick.id)

    async def all_running() -> bool:
        return await pool.fetchval("SELECT count(*) FROM job_executions WHERE status = 'running'") == 4

    await eventually(all_running, within=15)
    worker.signal(signal.SIGTERM)
    stopped_at = time.monotonic()
    assert await asyncio.to_thread(worker.process.wait, 15) == 0
    assert time.monotonic() - stopped_at < 1 + 3.0  # the grace period plus start-up noise
    quick_history = await statuses(pool, quick.id)
    assert quick_history == [(1, "succeeded"), (1, "succeeded")]
    # History is not rewritten: each interrupted attempt is kept, and its run goes on in a new one.
    assert sorted(await statuses(pool, slow.id)) == [
        (1, "interrupted"),
        (1, "interrupted"),
        (2, "queued"),
        (2, "queued"),
    ]
    # Back in the queue at once, not after the 60 s visibility timeout.
    states = await Queue(redis).states(slow_runs)
    assert set(states.values()) == {ItemState.READY}


async def test_a_failing_webhook_opens_its_breaker_without_starving_other_jobs(
    roles: Roles, control: Control, pool: asyncpg.Pool, redis: aioredis.Redis
) -> None:
    healthy = False
    hits = 0

    async def target(request: web.Request) -> web.Response:
        nonlocal hits
        hits += 1
        return web.Response(status=200 if healthy else 503)

    app = web.Application()
    app.router.add_post("/hook", target)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        roles.start("scheduler")
        worker = roles.start(
            "worker",
            "--concurrency",
            "20",
            SCHEDULER_WEBHOOK_ALLOWLIST="127.0.0.1/32",
            SCHEDULER_BREAKER_RESET_TIMEOUT="2s",
        )
        await wait_until_ready(redis, workers=1)
        retry = RetryPolicy(
            max_retries=30,
            initial_backoff=timedelta(milliseconds=100),
            max_backoff=timedelta(milliseconds=300),
            jitter=False,
        )
        hook = await control.create_job(
            manual("hook", "http.webhook", {"url": f"http://127.0.0.1:{port}/hook"}, retry=retry)
        )
        echo = await control.create_job(manual("echo", "test.echo"))
        for _ in range(10):
            await control.trigger_job(hook.id)

        async def breaker_open() -> bool:
            return any("-> open" in line for line in worker.log_lines())

        await eventually(breaker_open, within=15)
        opened_at = time.monotonic()
        for _ in range(200):
            await control.trigger_job(echo.id)

        async def echoes_done() -> bool:
            done = await pool.fetchval(
                "SELECT count(*) FROM job_executions WHERE job_id = $1 AND status = 'succeeded'", echo.id
            )
            return bool(done == 200)

        await eventually(echoes_done, within=20)
        echo_seconds = time.monotonic() - opened_at

        # The outage outlasts the reset timeout (2 s): a half-open trial fails and the breaker reopens.
        async def trial_failed() -> bool:
            return any("half_open -> open" in line for line in worker.log_lines())

        await eventually(trial_failed, within=15)
        healthy = True

        async def hooks_done() -> bool:
            done = await pool.fetchval(
                "SELECT count(*) FROM job_executions WHERE job_id = $1 AND status = 'succeeded'", hook.id
            )
            return bool(done == 10)

        await eventually(hooks_done, within=20)
        attempts = await pool.fetch(
            "SELECT run_id, max(attempt) AS attempts FROM job_executions WHERE job_id = $1 GROUP BY run_id", hook.id
        )
        # ~5 s of outage at one retry per 100-300 ms would cost each run 15+ attempts without the
        # breaker; with it, a run only spends attempts before it opens and on half-open trials.
        assert max(row["attempts"] for row in attempts) <= 6, [row["attempts"] for row in attempts]

        # Lines reach the log file through the writer thread (up to its 20 ms batch later than the
        # completions PostgreSQL already shows): wait for the line rather than race the writer.
        async def breaker_closed() -> bool:
            return any("half_open -> closed" in line for line in worker.log_lines())

        await eventually(breaker_closed, within=5)
        print(f"200 echo runs completed {echo_seconds:.2f}s after the breaker opened; webhook hits: {hits}")
    finally:
        await runner.cleanup()


async def latest_statuses(pool: asyncpg.Pool, job_id: str) -> dict[str, str]:
    """Each run of the job -> the status of its latest attempt."""
    rows = await pool.fetch(
        "SELECT DISTINCT ON (run_id) run_id, status FROM job_executions WHERE job_id = $1"
        " ORDER BY run_id, attempt DESC",
        job_id,
    )
    return {str(row["run_id"]): row["status"] for row in rows}


async def test_runs_that_shared_a_worker_with_a_poison_run_are_not_dead_lettered_with_it(
    roles: Roles, control: Control, pool: asyncpg.Pool, redis: aioredis.Redis
) -> None:
    stalls = {"SCHEDULER_MAX_STALLS": "2", "SCHEDULER_SOLO_RETRY_DELAY": "1s"}
    roles.start("scheduler", **stalls)
    workers = [roles.start("worker", **stalls)]
    sleep = await control.create_job(manual("innocent", "test.delay", {"seconds": 2}))
    crash = await control.create_job(manual("poison", "test.crash"))
    innocent = [(await control.trigger_job(sleep.id))[0].run_id for _ in range(3)]

    async def all_running() -> bool:
        return list((await latest_statuses(pool, sleep.id)).values()).count("running") == 3

    await eventually(all_running, within=30)
    [poison] = await control.trigger_job(crash.id)  # the same worker leases it beside them, and dies

    async def settled() -> bool:
        # One worker at a time, as a supervisor would restart it: the innocent runs' every delivery
        # shares a worker with the poison run unless the queue keeps them apart.
        if workers[-1].process.poll() is not None:
            assert len(workers) < 6, "too many workers died"
            workers.append(roles.start("worker", **stalls))
        ends = await latest_statuses(pool, sleep.id)
        poison_end = (await latest_statuses(pool, crash.id)).get(poison.run_id)
        return poison_end == "dead" and all(ends.get(run) in ("succeeded", "dead") for run in innocent)

    await eventually(settled, within=90, interval=0.2)
    assert await latest_statuses(pool, sleep.id) == dict.fromkeys(innocent, "succeeded")
    dead_page = await Queue(redis).list_dead()
    assert [item.id for item in dead_page.items] == [poison.run_id]
    assert sum(worker.process.poll() is not None for worker in workers) == 3, "the poison run killed three workers"
