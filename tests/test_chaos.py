"""The fast subset of `make chaos`: the fault proxy, the checker and the server faults against real
servers, and two short real-process scenarios (the full suite is `make chaos`)."""

from __future__ import annotations

import asyncio
import functools
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from pathlib import Path
from urllib.parse import urlsplit

import asyncpg
import pytest
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import OutOfMemoryError, ReadOnlyError

from chaos.checker import check, install_term_history
from chaos.harness import Scenario, Servers, run_scenario
from chaos.proxy import FaultProxy
from chaos.scenarios import leader_kill9, worker_cut_off
from chaos.servers import ChaosPostgres, ChaosRedis
from chaos.watchers import Watcher, judge
from scheduler_grpc.control import Control
from scheduler_grpc.jobs import JobSpec, ScheduleKind


async def _ping(port: int, within: float) -> float:
    """Seconds one PING through `port` took; TimeoutError past `within`."""
    client = aioredis.Redis(host="127.0.0.1", port=port, socket_connect_timeout=2)
    try:
        began = time.monotonic()
        async with asyncio.timeout(within):
            assert await client.ping()
        return time.monotonic() - began
    finally:
        await client.aclose(close_connection_pool=True)


async def test_proxy_injects_latency_blackhole_and_reset(redis_url: str) -> None:
    port = int(urlsplit(redis_url).port or 6379)
    proxy = await FaultProxy("test/redis", "127.0.0.1", port).start()
    try:
        assert await _ping(proxy.port, 2) < 0.3
        proxy.latency(0.4)
        assert await _ping(proxy.port, 10) >= 0.8  # both ways
        proxy.heal()
        proxy.blackhole()
        with pytest.raises(TimeoutError):
            await _ping(proxy.port, 0.5)
        proxy.heal()
        assert await _ping(proxy.port, 2) < 0.5

        no_retry = Retry(NoBackoff(), 0)
        client = aioredis.Redis(host="127.0.0.1", port=proxy.port, socket_connect_timeout=2, retry=no_retry)
        try:
            # A held command is delivered on heal, as TCP would after a partition, not lost.
            await client.ping()
            proxy.blackhole()
            held = asyncio.create_task(client.set("k", "v"))
            done, _ = await asyncio.wait([held], timeout=0.3)
            assert not done
            proxy.heal()
            assert await asyncio.wait_for(held, 2)
            assert proxy.reset() >= 1
            with pytest.raises(RedisConnectionError):
                await client.ping()
        finally:
            await client.aclose()
        proxy.reset(refuse=True)
        # Refused at once (an RST), not timed out: a client that does not retry sees the reset.
        refused = aioredis.Redis(host="127.0.0.1", port=proxy.port, socket_connect_timeout=2, retry=no_retry)
        try:
            began = time.monotonic()
            with pytest.raises(RedisConnectionError):
                await refused.ping()
            assert time.monotonic() - began < 1.0
        finally:
            await refused.aclose()
        proxy.heal()
        assert await _ping(proxy.port, 2) < 0.5
    finally:
        await proxy.close()


async def test_checker_reports_a_planted_duplicate_hole_stuck_run_and_stale_write(
    pool: asyncpg.Pool, control: Control
) -> None:
    await install_term_history(pool)
    job = await control.create_job(
        JobSpec(name="planted", handler="test.echo", schedule_kind=ScheduleKind.CRON, cron="* * * * * *")
    )
    await pool.execute("UPDATE jobs SET status = 'paused', next_run_time = NULL")
    base = datetime(2030, 1, 1, tzinfo=UTC)
    slots = [base + timedelta(seconds=i) for i in range(12)]
    await pool.execute("INSERT INTO leader_state (scope, term, holder) VALUES ('scheduler', 1, 'a')")
    await pool.execute("UPDATE leader_state SET term = 2, holder = 'b'")

    async def row(slot: datetime, status: str, *, run_id: uuid.UUID | None = None, attempt: int = 1,
                  term: int | None = 2, missed_through: datetime | None = None) -> uuid.UUID:  # fmt: skip
        row_id = uuid.uuid4()
        running = status in ("running", "succeeded", "failed")
        await pool.execute(
            """INSERT INTO job_executions (id, run_id, job_id, scheduled_for, attempt, status, trigger, term,
                   worker_id, started_at, finished_at, claim_token, missed_through)
               VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13)""",
            row_id, run_id or row_id, uuid.UUID(job.id), slot, attempt, status,
            "schedule" if attempt == 1 else "retry", term if attempt == 1 else None,
            "w:1:x" if running else None, slot if running else None,
            None if status in ("queued", "running") else slot + timedelta(milliseconds=10),
            "token" if status == "running" else None,
            (missed_through or slot) if status == "missed" else None,
        )  # fmt: skip
        return row_id

    await row(slots[0], "succeeded")
    first = await row(slots[1], "failed")
    await row(slots[1], "succeeded", run_id=first, attempt=2)  # a retry: fine
    # slots[2]: a hole
    await row(slots[3], "succeeded")
    await row(slots[3], "succeeded", run_id=uuid.uuid4(), attempt=2)  # a second run of the same slot
    twice = await row(slots[4], "succeeded")
    await row(slots[4], "succeeded", run_id=twice, attempt=2)  # two successes of one run
    await row(slots[5], "running")  # stuck
    await row(slots[6], "missed")  # explained by the misfire policy
    await row(slots[7], "succeeded", term=1)  # written under term 1 after term 2 was recorded
    await row(slots[8], "missed", missed_through=slots[10])  # one row for a run of three misfires
    await row(slots[9], "succeeded")  # ... one of which also ran: a second fire of that slot
    await row(slots[11], "succeeded")

    try:
        report = await check(pool, jobs=[await control.get_job(job.id)], start=slots[0], end=slots[-1])
    finally:  # the session database is shared: leave leader_state as the other tests expect it
        await pool.execute("DROP TRIGGER chaos_term_history ON leader_state; DROP TABLE chaos_term_history")

    assert (report.expected, report.fired, report.explained, report.lost) == (12, 8, 3, 1)
    assert report.duplicated == 3
    assert report.stuck == 1
    assert report.stale == 1
    assert report.failed == 0
    invariants = {violation.invariant: violation.detail for violation in report.violations}
    assert f"{job.id[:8]}@00:00:02.000" in invariants["lost slot (expected, never recorded)"]
    assert f"{job.id[:8]}@00:00:03.000 x2" in invariants["duplicate slot (one slot, several runs)"]
    assert "attempts [1, 2]" in invariants["duplicate success (several succeeded attempts of one run)"]
    assert f"{job.id[:8]}@00:00:09.000" in invariants["duplicate slot (recorded missed in a range, and run)"]
    assert "running" in invariants["stuck (not final after settling)"]
    assert "term 1 < 2" in invariants["write accepted under a stale term"]


def test_watch_judge_fails_a_watcher_that_stopped_missed_or_repeated_events() -> None:
    # The service's events at 100-0 .. 100-9 (of two jobs); the first injected entry at 100-4.
    ordinary = [(f"100-{seq}", "job-a" if seq % 2 else "job-b") for seq in range(10) if seq != 4]
    fault = "100-4"
    cases = {
        "kept up": Watcher("all", cursor="100-0", received=[f"100-{seq}" for seq in range(1, 10) if seq != 4]),
        "one job": Watcher("one", cursor="100-0", job_ids=("job-a",), received=["100-1", "100-3", "100-5", "100-7",
                                                                                 "100-9"]),
        "stopped": Watcher("stopped", cursor="100-0", received=["100-1", "100-2", "100-3"]),
        "missed": Watcher("missed", cursor="100-0", received=["100-1", "100-2", "100-3", "100-5", "100-9"]),
        "twice": Watcher("twice", since="100-6", received=["100-7", "100-8", "100-8", "100-9"]),
        "never": Watcher("never", since="100-2"),
    }  # fmt: skip
    verdicts = {name: [invariant for invariant, _ in judge(w, ordinary, fault)[1]] for name, w in cases.items()}
    assert verdicts == {
        "kept up": [],
        "one job": [],
        "stopped": ["watcher stopped receiving"],
        "missed": ["watcher missed events"],
        "twice": ["watcher received an event twice"],
        "never": ["watcher stopped receiving"],
    }
    assert "8 events, 5 after the fault, 0 of 8 due missing" in judge(cases["kept up"], ordinary, fault)[0]


@pytest.fixture(scope="module")
def chaos_servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    """Servers of the suite's own (it kills and restarts them), started from one long-lived thread."""
    root = tmp_path_factory.mktemp("chaos")
    thread = ThreadPoolExecutor(1, thread_name_prefix="chaos-servers")
    servers = Servers(ChaosRedis(root / "valkey"), ChaosPostgres(root / "postgres"), thread)
    thread.submit(servers.redis.start).result()
    thread.submit(servers.postgres.start).result()
    try:
        yield servers
    finally:
        thread.submit(servers.postgres.stop).result()
        thread.submit(servers.redis.stop).result()
        thread.shutdown()


@pytest.fixture
async def chaos_pg(chaos_servers: Servers) -> AsyncIterator[ChaosPostgres]:
    yield chaos_servers.postgres
    chaos_servers.postgres.cont()


async def test_postgres_faults_stop_freeze_and_come_back(chaos_servers: Servers, chaos_pg: ChaosPostgres) -> None:
    conn = await asyncpg.connect(chaos_pg.url, timeout=5)
    assert chaos_pg.freeze() >= 2  # the postmaster and its backends
    with pytest.raises(TimeoutError):
        await conn.fetchval("SELECT 1", timeout=0.5)
    chaos_pg.cont()
    await conn.close(timeout=5)
    conn = await asyncpg.connect(chaos_pg.url, timeout=5)
    await chaos_pg.shutdown("immediate")
    with pytest.raises((asyncpg.PostgresError, asyncpg.InterfaceError, OSError)):
        await conn.fetchval("SELECT 1", timeout=2)
    await chaos_servers.run(chaos_pg.start)
    conn = await asyncpg.connect(chaos_pg.url, timeout=5)
    assert await conn.fetchval("SELECT 1") == 1
    await conn.close()


async def test_valkey_restart_with_and_without_aof(chaos_servers: Servers) -> None:
    redis = chaos_servers.redis
    client = redis.client()
    try:
        await client.set("kept", "1")
        await redis.enable_aof()
        await chaos_servers.run(redis.kill)
        await chaos_servers.run(lambda: redis.start(persistent=True))
        assert await client.get("kept") == b"1"
        await chaos_servers.run(redis.kill)
        await chaos_servers.run(lambda: redis.start(persistent=False))
        assert await client.get("kept") is None
        await redis.refuse_writes_oom()
        with pytest.raises(OutOfMemoryError):
            await client.set("x", "1")
        await redis.accept_writes()
        await redis.become_replica()
        with pytest.raises(ReadOnlyError):
            await client.set("x", "1")
        await redis.become_master()
        assert await client.set("x", "1")
    finally:
        await redis.accept_writes()  # the servers are shared by the module's other tests
        await redis.become_master()
        await client.aclose()


async def test_scenario_leader_kill9_loses_and_duplicates_nothing(chaos_servers: Servers, tmp_path: Path) -> None:
    scenario = Scenario(
        "quick-leader-kill9", functools.partial(leader_kill9, times=1), env={"SCHEDULER_LEADER_TTL": "2s"},
        cron_jobs=3, workers=1, settle=15, budget=40,
    )  # fmt: skip
    outcome = await run_scenario(scenario, chaos_servers, tmp_path)
    assert outcome.ok, (outcome.error, outcome.report.violations)
    assert outcome.report.expected >= 9
    assert outcome.report.fired == outcome.report.expected
    assert len(outcome.report.recovery) == 1
    assert all(r is not None and r < 5 for r in outcome.report.recovery), outcome.report.recovery
    assert outcome.roles_alive == outcome.roles_total == 3


async def test_scenario_worker_cut_off_past_its_lease_has_its_late_completion_refused(
    chaos_servers: Servers, tmp_path: Path
) -> None:
    scenario = Scenario(
        "quick-worker-cut-off", worker_cut_off, env={"SCHEDULER_VISIBILITY_TIMEOUT": "2s"},
        schedulers=1, cron_jobs=2, settle=15, budget=40,
    )  # fmt: skip
    outcome = await run_scenario(scenario, chaos_servers, tmp_path)
    assert outcome.ok, (outcome.error, outcome.report.violations)
    assert any("#1 abandoned" in note for note in outcome.notes), outcome.notes
    assert outcome.report.recovery
    assert outcome.report.recovery[0] is not None
