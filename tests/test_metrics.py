"""Every documented metric exists, and the engine's metrics move when their event happens."""

from __future__ import annotations

import asyncio
import re
import urllib.request
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import asyncpg
import redis.asyncio as aioredis
from aiohttp import web
from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.parser import text_string_to_metric_families

from scheduler_grpc import metrics, stores
from scheduler_grpc.connections import redis_client
from scheduler_grpc.control import Control
from scheduler_grpc.embedded import free_port
from scheduler_grpc.jobs import JobSpec, RetryPolicy, ScheduleKind
from scheduler_grpc.limits import LimitKind, LimitRef, LimitSpec
from scheduler_grpc.queue import Queue
from tests.conftest import ROOT
from tests.engine_helpers import Role, Roles, eventually, wait_until_ready

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def documented() -> set[str]:
    """The metrics of the table docs/operations/metrics.md shows (generated from the registry)."""
    return set(re.findall(r"^\| `(scheduler_[a-z_]+)` \|", metrics.readme_table(), re.MULTILINE))


def test_the_metrics_page_shows_the_generated_metrics_table() -> None:
    page = (ROOT / "docs" / "operations" / "metrics.md").read_text()
    assert "<!-- generated: metrics -->" in page  # filled by scripts/docs_gen.py at build time


def test_every_label_is_a_bounded_one() -> None:
    # A label outside this list (a job id, a webhook host, a breaker key) would grow without bound.
    used = {
        label
        for collector in list(metrics.REGISTRY._collector_to_names)
        for label in getattr(collector, "_labelnames", ())
    }
    assert used, "no labelled metric found: the check would pass vacuously"
    assert used <= metrics.LABELS, used - metrics.LABELS


async def scrape(role: Role) -> Samples:
    port = role.metrics_port()
    if port is None:
        return {}

    def fetch() -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            return str(response.read().decode())

    text = await asyncio.to_thread(fetch)
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include `labels`."""
    return sum(v for (n, ls), v in samples.items() if n == name and all((k, labels[k]) in ls for k in labels))


async def test_engine_metrics_move_when_their_events_happen(
    roles: Roles, control: Control, pool: asyncpg.Pool, redis: aioredis.Redis
) -> None:
    scheduler = roles.start("scheduler", SCHEDULER_BREAKER_MIN_CALLS="2")
    worker = roles.start("worker", SCHEDULER_BREAKER_MIN_CALLS="2", SCHEDULER_WEBHOOK_ALLOWLIST="127.0.0.1/32")
    await wait_until_ready(redis, workers=1)
    throttling = await _throttling_server()
    created_before = metrics.JOBS_CREATED._value.get()
    tick = await control.create_job(
        JobSpec(name="tick", handler="test.echo", schedule_kind=ScheduleKind.CRON, cron="* * * * * *")
    )
    fail = await control.create_job(
        JobSpec(
            name="fail",
            handler="test.fail",
            retry=RetryPolicy(1, timedelta(milliseconds=100), timedelta(milliseconds=100), False),
        )
    )
    side = await control.create_job(JobSpec(name="side", handler="test.echo", queue="side"))
    await control.trigger_job(fail.id)
    await control.pause_job(tick.id)
    await control.resume_job(tick.id)
    assert metrics.JOBS_CREATED._value.get() == created_before + 3
    # A lease nobody acks (queue "side" has no worker): the leader recovers it.
    stalled = (await control.trigger_job(side.id))[0]
    assert await Queue(redis, "side").dequeue("test", timedelta(seconds=1), 1)
    # A run Redis "lost": reconcile puts it back.
    lost = (await control.trigger_job(side.id))[0]
    await Queue(redis, "side").remove(lost.run_id)
    # Limits (issue 22): a run admitted, a run waiting in its group (queue "side": no worker), a
    # run its webhook target rate limits (429 with Retry-After).
    await control.limits.create_limit(LimitSpec("metered", LimitKind.CONCURRENCY, 5))
    metered = (LimitRef("metered", "k"),)
    for spec in (
        JobSpec(name="admitted", handler="test.echo", limits=metered),
        JobSpec(name="waiting", handler="test.echo", queue="side", limits=metered),
        JobSpec(name="throttled", handler="http.webhook", payload={"url": throttling.url}, limits=metered),
    ):
        await control.trigger_job((await control.create_job(spec)).id)

    checks: dict[str, Callable[[Samples, Samples], bool]] = {
        "executions": lambda s, w: value(w, "scheduler_executions_total", status="succeeded", handler="test.echo") >= 2,
        "failed": lambda s, w: value(w, "scheduler_executions_total", status="failed", handler="test.fail") >= 1,
        "duration": lambda s, w: value(w, "scheduler_execution_duration_seconds_count", handler="test.echo") >= 2,
        "lateness": lambda s, w: value(w, "scheduler_lateness_seconds_count") >= 2,
        "wait": lambda s, w: value(w, "scheduler_dequeue_wait_seconds_count") >= 2,
        "retries": lambda s, w: value(w, "scheduler_retries_total", handler="test.fail") >= 1,
        "dead": lambda s, w: value(w, "scheduler_dead_lettered_total", reason="retries_exhausted") >= 1,
        "slots": lambda s, w: value(w, "scheduler_worker_slots", state="total") == 10,
        "breaker": lambda s, w: value(w, "scheduler_breaker_transitions_total", handler="test.fail", to="open") >= 1,
        "breaker_state": lambda s, w: value(w, "scheduler_breaker_state", handler="test.fail") >= 1,
        "leader": lambda s, w: value(s, "scheduler_leader") == 1 and value(s, "scheduler_leader_term") >= 1,
        "changes": lambda s, w: value(s, "scheduler_leadership_changes_total") >= 1,
        "scan": lambda s, w: value(s, "scheduler_scan_duration_seconds_count") >= 2,
        "scanned": lambda s, w: value(s, "scheduler_scan_due_jobs_sum") >= 2,
        "depth": lambda s, w: ("scheduler_queue_depth", (("queue", "side"), ("state", "ready"))) in s,
        "bands": lambda s, w: value(s, "scheduler_queue_ready_by_priority", queue="side", band="normal") >= 1,
        "recoveries": lambda s, w: value(s, "scheduler_lease_recoveries_total", queue="side") >= 1,
        "reconcile": lambda s, w: value(s, "scheduler_reconcile_reenqueued_total") >= 1,
        "admissions": lambda s, w: value(w, "scheduler_limit_admissions_total", limit="metered") >= 1,
        "limit_waiting": lambda s, w: value(s, "scheduler_limit_runs_waiting", limit="metered") >= 1,
        "throttle": lambda s, w: value(w, "scheduler_limit_throttle_waits_total", limit="metered") >= 1,
    }
    pending = dict(checks)

    async def all_moved() -> list[str]:
        s, w = await scrape(scheduler), await scrape(worker)
        for name in [name for name, check in pending.items() if check(s, w)]:
            del pending[name]
        return [] if pending else ["done"]

    try:
        await eventually(all_moved, within=30, interval=0.5)
    except AssertionError:
        raise AssertionError(f"metrics that did not move: {sorted(pending)}") from None
    finally:
        await throttling.runner.cleanup()
    assert stalled.run_id != lost.run_id
    scraped = set()
    for role in (scheduler, worker):
        scraped |= {name for name, _ in await scrape(role)}
    server_only = ("scheduler_grpc_", "scheduler_jobs_", "scheduler_stream", "scheduler_login", "scheduler_backend")
    engine_metrics = {name for name in documented() if not name.startswith(server_only)}
    missing = {name for name in engine_metrics if not any(s.startswith(name.removesuffix("_total")) for s in scraped)}
    assert not missing, missing


@dataclass
class _Server:
    runner: web.AppRunner
    url: str


async def _throttling_server() -> _Server:
    """A webhook target that always answers 429 with `Retry-After: 1`."""

    async def throttle(request: web.Request) -> web.Response:
        return web.Response(status=429, headers={"Retry-After": "1"})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", throttle)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return _Server(runner, f"http://127.0.0.1:{port}/hook")


async def test_lateness_counts_scheduled_and_manual_runs_not_a_backfilled_past(
    roles: Roles, control: Control, pool: asyncpg.Pool, redis: aioredis.Redis
) -> None:
    worker = roles.start("worker")
    await wait_until_ready(redis, workers=1, leader=False)
    yearly = await control.create_job(
        JobSpec(name="yearly", handler="test.echo", schedule_kind=ScheduleKind.CRON, cron="0 0 0 1 1 *")
    )
    manual = await control.create_job(JobSpec(name="manual", handler="test.echo"))
    now = await pool.fetchval("SELECT now()")
    last_new_year = datetime(now.year, 1, 1, tzinfo=UTC)  # months (or at least a moment) ago
    await control.backfill_job(yearly.id, [last_new_year])
    await control.trigger_job(manual.id)

    async def both_succeeded() -> bool:
        return await pool.fetchval("SELECT count(*) FROM job_executions WHERE status = 'succeeded'") == 2

    await eventually(both_succeeded, within=20)
    samples = await scrape(worker)
    # Before: the backfilled slot's age (up to a year) was observed as the lateness of a first attempt.
    assert value(samples, "scheduler_lateness_seconds_count") == 1
    assert value(samples, "scheduler_lateness_seconds_sum") < 60


async def failure(call: Callable[[], Awaitable[object]], *, within: float = 0.2) -> BaseException:
    """The error `call` fails with (a timeout past `within` seconds counts as one)."""
    try:
        async with asyncio.timeout(within):
            await call()
    except Exception as exc:
        return exc
    raise AssertionError("the call did not fail")


async def test_store_errors_are_counted_by_the_store_that_failed(redis: aioredis.Redis, pool: asyncpg.Pool) -> None:
    closed_port = free_port()
    refused_redis = redis_client(f"redis://127.0.0.1:{closed_port}", connect_timeout=timedelta(seconds=1))
    try:
        redis_refused = await failure(refused_redis.ping, within=10)
    finally:
        await refused_redis.aclose()
    # Builtin errors that name no library: a refused connection and our own timeouts.
    postgres_refused = await failure(lambda: asyncpg.connect(host="127.0.0.1", port=closed_port), within=10)
    redis_timeout = await failure(lambda: redis.blpop(["nothing-here"], timeout=0))
    postgres_timeout = await failure(lambda: pool.fetchval("SELECT pg_sleep(5)"))
    assert isinstance(postgres_refused, OSError)
    assert isinstance(redis_timeout, TimeoutError)
    assert isinstance(postgres_timeout, TimeoutError)
    unrelated = [ValueError("bad input"), await failure(lambda: asyncio.sleep(5))]

    def counted() -> dict[str, float]:
        return {store: metrics.STORE_ERRORS.labels(store)._value.get() for store in ("redis", "postgres")}

    before = counted()
    for exc in (redis_refused, redis_timeout, postgres_refused, postgres_timeout, *unrelated):
        metrics.store_error(exc)
    after = counted()
    assert (after["redis"] - before["redis"], after["postgres"] - before["postgres"]) == (2, 2)
    assert [stores.store_of(exc) for exc in unrelated] == [None, None]


def test_observe_many_counts_as_observe_does_value_by_value() -> None:
    # observe_many reads prometheus-client's bucket internals: it must stay exactly observe() per value.
    registry = CollectorRegistry()
    one_by_one = Histogram("one", "by observe", ["handler"], buckets=(0.01, 0.1, 1), registry=registry)
    batched = Histogram("many", "by observe_many", ["handler"], buckets=(0.01, 0.1, 1), registry=registry)
    values = [0.0, 0.01, 0.0100001, 0.05, 0.1, 0.5, 1.0, 7.0, 0.003]
    for value in values:
        one_by_one.labels("h").observe(value)
    metrics.observe_many(batched.labels("h"), values)
    metrics.observe_many(batched.labels("h"), [])

    def samples(name: str) -> list[tuple[str, dict[str, str], float]]:
        family = next(f for f in registry.collect() if f.name == name)
        return [(s.name.removeprefix(name), s.labels, s.value) for s in family.samples if "_created" not in s.name]

    assert samples("many") == samples("one")
    assert ("_count", {"handler": "h"}, 9.0) in samples("many")
