"""OpenTelemetry traces (`scheduler_grpc.tracing`): one trace per run, from the TriggerJob call to
each attempt's handler and the webhook it calls; log lines with the trace and span ids; nothing at
all with tracing off. Spans are caught by the SDK's in-memory exporter; the servers are real."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
import pytest
from aiohttp import web
from google.protobuf import duration_pb2, struct_pb2
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from scheduler_client.v1 import executions_pb2, jobs_pb2

from scheduler_grpc import tracing
from scheduler_grpc.auth import Role
from scheduler_grpc.connections import redis_client
from scheduler_grpc.control import Control
from scheduler_grpc.db.executions import Advance, Outcome, PlannedSlot
from scheduler_grpc.db.firing import FiringRepository
from scheduler_grpc.db.history import HistoryRepository
from scheduler_grpc.db.runs import RunRepository
from scheduler_grpc.errors import ConfigError
from scheduler_grpc.executions import ExecutionStatus
from scheduler_grpc.handlers import HandlerSettings, default_registry
from scheduler_grpc.jobs import JobSpec, RetryPolicy, ScheduleKind
from scheduler_grpc.worker import Worker
from tests.engine_helpers import eventually, make_settings
from tests.test_api_support import Harness, running_api
from tests.test_console import _with_cookie, running_console

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
LOOPBACK = "127.0.0.1/32"


# -- pure --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("environ", "on"),
    [
        ({}, False),
        ({"OTEL_SERVICE_NAME": "x"}, False),
        ({"OTEL_TRACES_EXPORTER": "otlp"}, True),
        ({"OTEL_TRACES_EXPORTER": "console"}, True),
        ({"OTEL_TRACES_EXPORTER": "none"}, False),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317"}, True),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4317"}, True),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317", "OTEL_TRACES_EXPORTER": "none"}, False),
        ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_SDK_DISABLED": "true"}, False),
        ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_SDK_DISABLED": "false"}, True),
    ],
)
def test_the_standard_variables_turn_tracing_on(environ: dict[str, str], on: bool) -> None:
    assert tracing.wanted(environ) is on


def test_an_exporter_this_service_does_not_ship_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="OTEL_TRACES_EXPORTER: zipkin"):
        tracing.wanted({"OTEL_TRACES_EXPORTER": "zipkin"})


def test_configure_leaves_tracing_off_without_the_variables() -> None:
    assert tracing.configure("worker", {}) is False
    assert tracing.enabled is False


def test_trace_id_of_a_traceparent() -> None:
    assert tracing.trace_id_of(f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01") == CLIENT_TRACE
    for bad in (None, "", "junk", f"00-{'0' * 32}-{CLIENT_SPAN}-01", f"00-{'x' * 32}-{CLIENT_SPAN}-01"):
        assert tracing.trace_id_of(bad) is None


# -- engine --------------------------------------------------------------------------------------------


@pytest.fixture
def exporter() -> Iterator[InMemorySpanExporter]:
    """Tracing on in this process, every span to an in-memory exporter as it ends."""
    spans = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    tracing.install(provider)
    try:
        yield spans
    finally:
        tracing.uninstall()
        provider.shutdown()


class Target:
    """A local webhook target: fails its first `failures` requests with 500, then answers 200;
    keeps every request's `traceparent` (None when absent)."""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.traceparents: list[str | None] = []
        self.url = ""

    async def handle(self, request: web.Request) -> web.Response:
        self.traceparents.append(request.headers.get("traceparent"))
        if len(self.traceparents) <= self.failures:
            return web.Response(status=500, text="not yet")
        return web.Response(text="ok")


@contextlib.asynccontextmanager
async def target(failures: int) -> AsyncIterator[Target]:
    hook = Target(failures)
    app = web.Application()
    app.router.add_post("/hook", hook.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    hook.url = f"http://127.0.0.1:{port}/hook"
    try:
        yield hook
    finally:
        await runner.cleanup()


@contextlib.asynccontextmanager
async def worker(redis_url: str, database_url: str, pool: asyncpg.Pool) -> AsyncIterator[Worker]:
    """An in-process worker that may call loopback webhooks."""
    settings = make_settings(redis_url, database_url, SCHEDULER_WEBHOOK_ALLOWLIST=LOOPBACK,
                             SCHEDULER_SHUTDOWN_GRACE="1s")  # fmt: skip
    client = redis_client(redis_url)
    registry = default_registry(HandlerSettings.from_settings(settings))
    running = Worker(client, RunRepository(pool), registry, settings, history=HistoryRepository(pool),
                     worker_id="traced", concurrency=4)  # fmt: skip
    stop = asyncio.Event()
    task = asyncio.create_task(running.run(stop))
    try:
        yield running
    finally:
        stop.set()
        async with asyncio.timeout(15):
            await task
        await registry.aclose()
        await client.aclose()


async def _webhook_job(api: Harness, url: str) -> str:
    payload = struct_pb2.Struct()
    payload.update({"url": url})
    job = jobs_pb2.Job(
        name="traced-hook", handler="http.webhook", payload=payload,
        retry_policy=jobs_pb2.RetryPolicy(max_retries=2, initial_backoff=duration_pb2.Duration(nanos=100_000_000)),
    )  # fmt: skip
    created = await api.jobs.CreateJob(jobs_pb2.CreateJobRequest(job=job), metadata=api.admin)
    return str(created.job.id)


async def _attempts(api: Harness, run_id: str, count: int) -> list[executions_pb2.Execution]:
    """The run's attempts once `count` of them have finished, oldest first."""

    async def finished() -> list[executions_pb2.Execution] | None:
        page = await api.executions.ListExecutions(executions_pb2.ListExecutionsRequest(), metadata=api.admin)
        attempts = sorted((e for e in page.executions if e.run_id == run_id), key=lambda e: e.attempt)
        done = [e for e in attempts if e.HasField("end_time")]
        return attempts if len(done) >= count else None

    found = await eventually(finished, within=30)
    assert found is not None
    return found


def _by_name(spans: tuple[ReadableSpan, ...], name: str) -> list[ReadableSpan]:
    return sorted((s for s in spans if s.name == name), key=lambda s: s.start_time or 0)


def _parent_id(span: ReadableSpan) -> int | None:
    return span.parent.span_id if span.parent is not None else None


def _span_id(span: ReadableSpan) -> int:
    assert span.context is not None
    return span.context.span_id


async def test_a_triggered_retried_webhook_run_is_one_trace_from_the_call_to_each_handler(
    redis_url: str,
    database_url: str,
    pool: asyncpg.Pool,
    exporter: InMemorySpanExporter,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="scheduler_grpc.rpc")
    async with (
        target(failures=1) as hook,
        running_api(redis_url, database_url, pool, SCHEDULER_WEBHOOK_ALLOWLIST=LOOPBACK) as api,
        worker(redis_url, database_url, pool),
    ):
        job_id = await _webhook_job(api, hook.url)
        exporter.clear()
        caller = (*api.admin, ("traceparent", f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"))
        first = (await api.jobs.TriggerJob(jobs_pb2.TriggerJobRequest(id=job_id), metadata=caller)).execution
        attempts = await _attempts(api, first.run_id, 2)
        got = await api.executions.GetExecution(executions_pb2.GetExecutionRequest(id=first.id), metadata=api.admin)

    # The run's trace id, on every attempt, through GetExecution: the caller's trace.
    assert got.execution.trace_id == CLIENT_TRACE
    assert [(a.attempt, a.state, a.trace_id) for a in attempts] == [
        (1, executions_pb2.EXECUTION_STATE_FAILED, CLIENT_TRACE),
        (2, executions_pb2.EXECUTION_STATE_SUCCEEDED, CLIENT_TRACE),
    ]
    spans = exporter.get_finished_spans()
    [rpc] = _by_name(spans, "scheduler.v1.JobService/TriggerJob")
    [trigger] = _by_name(spans, "run.trigger")
    claims = _by_name(spans, "run.claim")
    runs = _by_name(spans, "run.attempt")
    handlers = _by_name(spans, "handler http.webhook")
    tree = [rpc, trigger, *claims, *runs, *handlers]
    assert {span.context.trace_id for span in tree if span.context is not None} == {int(CLIENT_TRACE, 16)}
    # The call continues the caller's span; the trigger is the call's child; each attempt's claim
    # and attempt are children of the trigger (the run's parent, read back from PostgreSQL), and
    # each handler span a child of its attempt.
    assert _parent_id(rpc) == int(CLIENT_SPAN, 16)
    assert rpc.kind is SpanKind.SERVER
    assert _parent_id(trigger) == _span_id(rpc)
    assert [c.attributes["scheduler.attempt"] for c in claims if c.attributes] == [1, 2]
    assert [_parent_id(c) for c in claims] == [_span_id(trigger)] * 2
    assert [r.attributes["scheduler.attempt"] for r in runs if r.attributes] == [1, 2]
    assert [_parent_id(r) for r in runs] == [_span_id(trigger)] * 2
    assert [_parent_id(h) for h in handlers] == [_span_id(r) for r in runs]
    assert [r.attributes["scheduler.status"] for r in runs if r.attributes] == ["failed", "succeeded"]
    assert [r.status.status_code for r in runs] == [StatusCode.ERROR, StatusCode.UNSET]
    assert [h.status.status_code for h in handlers] == [StatusCode.ERROR, StatusCode.UNSET]
    assert runs[0].attributes is not None
    assert runs[0].attributes["scheduler.run_id"] == first.run_id
    # The RPC span's attributes.
    assert rpc.attributes is not None
    assert {
        key: rpc.attributes[key] for key in ("rpc.system", "rpc.service", "rpc.method", "rpc.grpc.status_code")
    } == {
        "rpc.system": "grpc",
        "rpc.service": "scheduler.v1.JobService",
        "rpc.method": "TriggerJob",
        "rpc.grpc.status_code": 0,
    }
    assert rpc.attributes["enduser.id"] == "admin"
    # The webhook got each attempt's handler span as its parent.
    assert hook.traceparents == [f"00-{CLIENT_TRACE}-{_span_id(h):016x}-01" for h in handlers]
    # The call's log line carries the trace and the call's span.
    [line] = [r for r in caplog.records if getattr(r, "method", "") == "/scheduler.v1.JobService/TriggerJob"]
    assert (line.trace, line.span) == (CLIENT_TRACE, f"{_span_id(rpc):016x}")  # type: ignore[attr-defined]


async def test_with_tracing_off_no_span_is_made_and_no_traceparent_sent(
    redis_url: str,
    database_url: str,
    pool: asyncpg.Pool,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    assert not tracing.enabled

    def no_span(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a span was started with tracing off")

    # Every span of the service is made through these two.
    monkeypatch.setattr(tracing, "start", no_span)
    monkeypatch.setattr(tracing, "tracer", no_span)
    caplog.set_level(logging.INFO, logger="scheduler_grpc.rpc")
    async with (
        target(failures=1) as hook,
        running_api(redis_url, database_url, pool, SCHEDULER_WEBHOOK_ALLOWLIST=LOOPBACK) as api,
        worker(redis_url, database_url, pool),
    ):
        job_id = await _webhook_job(api, hook.url)
        caller = (*api.admin, ("traceparent", f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"))
        first = (await api.jobs.TriggerJob(jobs_pb2.TriggerJobRequest(id=job_id), metadata=caller)).execution
        attempts = await _attempts(api, first.run_id, 2)
    assert [a.trace_id for a in attempts] == ["", ""]
    assert hook.traceparents == [None, None]
    # The log line keeps the caller's trace id (as before tracing existed), and no span id.
    [line] = [r for r in caplog.records if getattr(r, "method", "") == "/scheduler.v1.JobService/TriggerJob"]
    assert line.trace == CLIENT_TRACE  # type: ignore[attr-defined]
    assert not hasattr(line, "span")


async def test_a_fired_slot_keeps_its_trace_context_through_claim_retry_and_takeover(
    pool: asyncpg.Pool, control: Control
) -> None:
    slot = datetime.now(UTC).replace(microsecond=0) + timedelta(hours=1)
    spec = JobSpec(name="traced-slot", handler="test.echo", schedule_kind=ScheduleKind.ONCE, run_at=slot,
                   retry=RetryPolicy(max_retries=3, jitter=False))  # fmt: skip
    job = await control.create_job(spec)
    await pool.execute("INSERT INTO leader_state (scope, term, holder) VALUES ('scheduler', 1, 'test')")
    parent = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"
    queued, _ = await FiringRepository(pool).fire_clocked(
        1, [Advance(job.id, slot, None)], [PlannedSlot(job.id, slot, ExecutionStatus.QUEUED, slot)], [parent]
    )
    [fired] = queued
    runs = RunRepository(pool)
    [claim] = await runs.claim([(fired.run_id, "t1")], "w")
    assert claim.trace_context == parent
    # A retry (completion), a hand-back (release) and a takeover (claim under another token) copy it.
    await runs.complete([Outcome(claim.execution_id, "t1", ExecutionStatus.FAILED, error="x",
                                 retry_after=timedelta(0))])  # fmt: skip
    [retry] = await runs.claim([(fired.run_id, "t2")], "w")
    assert (retry.attempt, retry.trace_context) == (2, parent)
    await runs.release([(retry.execution_id, "t2")])
    [handed] = await runs.claim([(fired.run_id, "t3")], "w")
    assert (handed.attempt, handed.trace_context) == (3, parent)
    [taken] = await runs.claim([(fired.run_id, "t4")], "w")
    assert (taken.attempt, taken.trace_context) == (4, parent)
    rows = await pool.fetch("SELECT trace_context FROM job_executions WHERE run_id = $1", fired.run_id)
    assert [row["trace_context"] for row in rows] == [parent] * 4
    # Without a context (tracing off), none.
    later = slot + timedelta(hours=1)
    other = await control.create_job(JobSpec(name="untraced-slot", handler="test.echo",
                                             schedule_kind=ScheduleKind.ONCE, run_at=later))  # fmt: skip
    queued, _ = await FiringRepository(pool).fire_clocked(
        1, [Advance(other.id, later, None)], [PlannedSlot(other.id, later, ExecutionStatus.QUEUED, later)]
    )
    [untraced] = await runs.claim([(queued[0].run_id, "u1")], "w")
    assert untraced.trace_context is None


def test_inject_replaces_a_traceparent_the_job_set(exporter: InMemorySpanExporter) -> None:
    span = tracing.start("handler test")
    headers = {"TraceParent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01", "X-Other": "kept"}
    with tracing.current(span):
        tracing.inject(headers)
    span.end()
    assert headers == {"X-Other": "kept", "traceparent": tracing.traceparent(span)}


async def test_the_console_execution_page_shows_the_run_trace_id(
    redis_url: str, database_url: str, pool: asyncpg.Pool, exporter: InMemorySpanExporter
) -> None:
    async with running_console(redis_url, database_url, pool) as console:
        control = console.server.api.control
        job = await control.create_job(JobSpec(name="traced-page", handler="test.echo"))
        traced = await control.trigger_execution(job.id)  # no worker: it stays queued
        assert traced.trace_id is not None
        tracing.uninstall()
        untraced = await control.trigger_execution(job.id)
        assert untraced.trace_id is None
        token = await console.session_for("victor", Role.VIEWER)
        async with console.client() as http:
            _with_cookie(http, token)
            async with http.get(f"/executions/{traced.id}") as page:
                body = await page.text()
            assert f'<p id="trace-id">trace <code>{traced.trace_id}</code></p>' in body
            async with http.get(f"/executions/{untraced.id}") as page:
                body = await page.text()
            assert 'id="trace-id"' not in body
    [span] = _by_name(exporter.get_finished_spans(), "run.trigger")
    assert span.context is not None
    assert f"{span.context.trace_id:032x}" == traced.trace_id
