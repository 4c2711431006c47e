"""The Node.js SDK's remote worker (`clients/node/worker.js`), in a process of its own
(`tests/remote_worker_node.js`), against a real server on the test stores: it drains runs each
succeeding exactly once, a cancel aborts its handler's signal, a lost stream is reconnected. Every
count is read from PostgreSQL. The server side is `tests/test_remote_workers.py`'s `deployment`."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, ClassVar

import grpc
import pytest
from scheduler_client.v1 import cluster_pb2, cluster_pb2_grpc

from scheduler_grpc.auth import Role
from scheduler_grpc.control import Control
from scheduler_grpc.db.firing import FiringRepository
from scheduler_grpc.dispatch import Queues, enqueue_runs
from scheduler_grpc.errors import Aborted
from scheduler_grpc.executions import Trigger
from scheduler_grpc.handlers import ExecutionContext as ServerContext
from scheduler_grpc.handlers import Handler, HandlerSettings, JSONValue, default_registry
from scheduler_grpc.jobs import JobSpec, RetryPolicy
from scheduler_grpc.queue import ItemState
from tests import test_client_node, test_remote_workers
from tests.conftest import ROOT
from tests.engine_helpers import eventually
from tests.test_remote_workers import QUEUE, Deployment

# Fixtures of other files: `npm ci` when node_modules is missing; a server on the test stores.
node_modules = test_client_node.node_modules
deployment = test_remote_workers.deployment

NODE = shutil.which("node")
# The drain's size: 2,000 keeps the tier fast; the figure is `SCHEDULER_TEST_DRAIN_RUNS=10000`.
DRAIN_RUNS = int(os.environ.get("SCHEDULER_TEST_DRAIN_RUNS") or 2000)
SCRIPT = ROOT / "tests" / "remote_worker_node.js"

pytestmark = [
    pytest.mark.skipif(NODE is None or shutil.which("npm") is None, reason="node and npm are needed"),
    pytest.mark.usefixtures("node_modules"),
]


@dataclass
class NodeWorker:
    """The Node.js worker process and the lines it printed (`connected`, `held`, `aborted`, `stats`)."""

    process: asyncio.subprocess.Process
    lines: asyncio.Queue[str] = field(default_factory=asyncio.Queue)
    seen: list[str] = field(default_factory=list)

    async def line(self, prefix: str, within: float = 10.0) -> str:
        """The next line starting with `prefix` (earlier lines of other kinds are kept in `seen`)."""
        async with asyncio.timeout(within):
            while True:
                line = await self.lines.get()
                self.seen.append(line)
                if line.startswith(prefix + " "):
                    return line[len(prefix) + 1 :]

    async def stop(self) -> dict[str, int]:
        """SIGTERM (the SDK's `stop()`: running handlers finish); its final counts."""
        self.process.send_signal(signal.SIGTERM)
        stats = json.loads(await self.line("stats", within=20))
        assert await self.process.wait() == 0
        return dict(stats)


@contextlib.asynccontextmanager
async def node_worker(
    deployment: Deployment,
    slots: int,
    expect: dict[str, Any] | None = None,
    transport: str = "stream",
    target: str | None = None,
) -> AsyncIterator[NodeWorker]:
    assert NODE is not None
    env = {
        **os.environ,
        "EXPECT_PAYLOAD": json.dumps(expect) if expect is not None else "",
        "WORKER_TRANSPORT": transport,
    }
    process = await asyncio.create_subprocess_exec(
        NODE, str(SCRIPT), target or deployment.target, deployment.worker_key, QUEUE, str(slots),
        stdout=asyncio.subprocess.PIPE, env=env, cwd=ROOT,
    )  # fmt: skip
    worker = NodeWorker(process)

    async def pump() -> None:
        assert process.stdout is not None
        while line := await process.stdout.readline():
            worker.lines.put_nowait(line.decode().rstrip("\n"))

    reader = asyncio.create_task(pump())
    try:
        yield worker
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
        reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reader


async def test_the_node_sdk_drains_runs_each_succeeding_exactly_once(deployment: Deployment) -> None:
    sent = {"n": 5, "f": 1.5, "s": "x", "nested": [1, {"b": True, "none": None}]}
    runs = await deployment.runs(DRAIN_RUNS, payload=sent)
    began = time.monotonic()
    async with node_worker(deployment, slots=64, expect=sent) as worker:
        worker_id = await worker.line("connected")

        async def drained() -> bool:
            return (await deployment.counts(runs)).get("succeeded", 0) == len(runs)

        await eventually(drained, within=max(120, DRAIN_RUNS / 50), interval=0.2)
        seconds = time.monotonic() - began
        print(f"node remote drain: {len(runs)} runs in {seconds:.2f}s, {len(runs) / seconds:.0f} runs/s")
        stats = await worker.stop()
    assert worker_id.startswith("remote:127.0.0.1:")
    assert await deployment.counts(runs) == {"succeeded": len(runs)}  # one attempt each, all succeeded
    # Each execution handed to the handler once, each outcome reported, nothing refused.
    assert stats["calls"] == stats["distinct"] == stats["assigned"] == stats["succeeded"] == len(runs), stats
    assert (stats["failed"], stats["rejected"], stats["connects"]) == (0, 0, 1), stats
    # The payload arrived intact (integral numbers, nesting, null), the result was stored.
    results = await deployment.pool.fetchval(
        "SELECT count(*) FROM job_executions WHERE run_id = ANY($1::uuid[]) "
        'AND result = \'{"attempt": 1, "ok": true}\'::jsonb',
        runs,
    )
    assert results == len(runs)


async def test_a_cancel_aborts_the_node_handlers_signal_within_a_second(deployment: Deployment) -> None:
    (run_id,) = await deployment.runs(1, payload={"hold": True})
    async with node_worker(deployment, slots=2) as worker:
        execution_id = await worker.line("held")
        assert execution_id == run_id  # the first attempt's execution id is the run's id
        # The worker is listed with its SDK while it holds the run.
        token = (("authorization", f"Bearer {await deployment.key(Role.VIEWER)}"),)
        async with grpc.aio.insecure_channel(deployment.target) as channel:
            reply = await cluster_pb2_grpc.ClusterServiceStub(channel).ListWorkers(
                cluster_pb2.ListWorkersRequest(), metadata=token
            )
        (shown,) = [w for w in reply.workers if w.remote]
        assert (shown.slots, shown.queue, list(shown.handlers)) == (2, QUEUE, ["remote.noop"])
        assert shown.sdk.startswith("scheduler-client-node/")
        asked = time.monotonic()
        await deployment.server.api.control.cancel_execution(run_id)
        aborted = await worker.line("aborted", within=5)
        assert time.monotonic() - asked < 1.0
        assert aborted.split(" ", 1) == [execution_id, "cancelled"]

        async def recorded() -> bool:
            return await deployment.counts([run_id]) == {"cancelled": 1}

        await eventually(recorded, within=10)
        stats = await worker.stop()
    assert (stats["cancelled"], stats["rejected"]) == (1, 0), stats


async def test_the_jobs_timeout_aborts_the_node_handler_and_records_the_timeout(deployment: Deployment) -> None:
    (run_id,) = await deployment.runs(1, job_timeout=timedelta(milliseconds=500), payload={"hold": True})
    async with node_worker(deployment, slots=2) as worker:
        execution_id = await worker.line("held")
        assert (await worker.line("aborted")).startswith(execution_id)

        async def recorded() -> bool:
            return await deployment.counts([run_id]) == {"dead": 1}  # timed out, no retries left

        await eventually(recorded, within=10)
        await worker.stop()
    error = await deployment.pool.fetchval("SELECT error FROM job_executions WHERE run_id = $1", run_id)
    assert error.startswith("timed out after 0.5s")


async def test_a_lost_stream_is_reconnected_and_the_node_worker_resumes_its_runs(deployment: Deployment) -> None:
    (held_run,) = await deployment.runs(1, payload={"hold": True})
    async with node_worker(deployment, slots=4) as worker:
        first = await worker.line("connected")
        held = await worker.line("held")
        remote = deployment.server.api.remote
        assert remote is not None
        (session,) = [s for s in remote.sessions if s.id == first]
        await eventually(lambda: _true(all(p.acked for p in session._pending.values())))  # its ack read
        # The server ends this stream (as it does for a worker that misses two pings): the run is
        # parked, the handler goes on, and the new stream resumes it under its claim token.
        session.fail(Aborted("ended by the test"))
        second = await worker.line("connected")  # within the 1 s backoff cap
        assert second != first
        assert await worker.line("resumed") == held
        # The cancel reaches it through the new stream: the same execution, its one attempt.
        await deployment.server.api.control.cancel_execution(held_run)
        assert (await worker.line("aborted")).startswith(held)

        async def settled() -> bool:
            return await deployment.counts([held_run]) == {"cancelled": 1}

        await eventually(settled, within=10)
        runs = await deployment.runs(20)

        async def drained() -> bool:
            return (await deployment.counts(runs)).get("succeeded", 0) == len(runs)

        await eventually(drained, within=30)
        stats = await worker.stop()
    assert await deployment.counts(runs) == {"succeeded": 20}
    assert (stats["connects"], stats["resumed"], stats["notResumed"]) == (2, 1, 0), stats


async def _true(value: bool) -> bool:
    return value


@pytest.mark.parametrize(
    "deployment",
    [{"SCHEDULER_VISIBILITY_TIMEOUT": "5s", "SCHEDULER_REMOTE_PING_INTERVAL": "300ms"}],
    indirect=True,
)
async def test_a_silently_cut_node_worker_reports_what_finished_meanwhile_once_resumed(deployment: Deployment) -> None:
    """A blackholed link: both sides find the stream dead (the server: two unanswered pings; the SDK:
    2.5 silent ping intervals); the runs finish while disconnected, and the next stream resumes them
    and takes their outcomes: one attempt each."""
    runs = await deployment.runs(2, payload={"gate": True})
    remote = deployment.server.api.remote
    assert remote is not None
    async with (
        test_remote_workers.proxy_to(deployment.server.port) as proxy,
        node_worker(deployment, slots=2, target=proxy.url_host_port) as worker,
    ):
        await worker.line("connected")
        gated = {await worker.line("gated") for _ in runs}
        [session] = remote.sessions
        await eventually(lambda: _true(all(p.acked for p in session._pending.values())))  # acks read
        proxy.blackhole()
        await worker.line("disconnected")  # the SDK's watchdog
        await eventually(lambda: _true(not remote.sessions), within=10)  # the server's pings: parked
        worker.process.send_signal(signal.SIGUSR2)
        assert {await worker.line("finished") for _ in runs} == gated  # while disconnected
        proxy.heal()
        assert set((await worker.line("resumed", within=15)).split(",")) == gated

        async def drained() -> bool:
            return await deployment.counts(runs) == {"succeeded": 2}

        await eventually(drained, within=10)
        stats = await worker.stop()
    assert await deployment.attempts(runs) == 1
    assert (stats["resumed"], stats["notResumed"], stats["succeeded"]) == (2, 0, 2), stats


# -- the unary transport ----------------------------------------------------------------------------


async def test_the_node_sdk_drains_runs_over_the_unary_transport_each_once(deployment: Deployment) -> None:
    sent = {"n": 5, "nested": [1, {"b": True, "none": None}]}
    runs = await deployment.runs(500, payload=sent)
    remote = deployment.server.api.remote
    assert remote is not None
    async with node_worker(deployment, slots=32, expect=sent, transport="unary") as worker:
        await worker.line("connected")
        assert len(remote.unary) == 1  # served by polls, not a stream

        async def drained() -> bool:
            return (await deployment.counts(runs)).get("succeeded", 0) == len(runs)

        await eventually(drained, within=60, interval=0.2)
        stats = await worker.stop()
    assert await deployment.counts(runs) == {"succeeded": len(runs)}
    assert stats["calls"] == stats["distinct"] == stats["assigned"] == stats["succeeded"] == len(runs), stats
    assert (stats["failed"], stats["rejected"], stats["connects"]) == (0, 0, 1), stats
    assert len(remote.unary) == 0  # `stop()` closed the session


async def test_a_cancel_aborts_the_unary_node_handlers_signal_within_a_second(deployment: Deployment) -> None:
    (run_id,) = await deployment.runs(1, payload={"hold": True})
    async with node_worker(deployment, slots=2, transport="unary") as worker:
        execution_id = await worker.line("held")
        remote = deployment.server.api.remote
        assert remote is not None
        [session] = remote.sessions
        # Its ack read first (a unary ack travels on the next call): a cancel before it drops the
        # assignment, and the handler's end is then answered Rejected, a different case.
        await eventually(lambda: _true(bool(session._pending) and all(p.acked for p in session._pending.values())))
        asked = time.monotonic()
        await deployment.server.api.control.cancel_execution(run_id)  # a long poll is waiting: it answers
        aborted = await worker.line("aborted", within=5)
        assert time.monotonic() - asked < 1.0
        assert aborted.split(" ", 1) == [execution_id, "cancelled"]

        async def recorded() -> bool:
            return await deployment.counts([run_id]) == {"cancelled": 1}

        await eventually(recorded, within=10)
        stats = await worker.stop()
    assert (stats["cancelled"], stats["rejected"]) == (1, 0), stats


async def test_a_node_worker_whose_unary_session_is_not_held_opens_a_new_one(deployment: Deployment) -> None:
    """What a load balancer sending a poll to another server process looks like to the SDK."""
    remote = deployment.server.api.remote
    assert remote is not None
    async with node_worker(deployment, slots=2, transport="unary") as worker:
        first = await worker.line("connected")
        (held,) = list(remote.unary._held.values())
        del remote.unary._held[held.id]  # the next poll reaches a process that does not hold it
        held.session.fail(Aborted("ended by the test"))  # (and the session ends, as it would)
        second = await worker.line("connected", within=30)
        assert second != first
        runs = await deployment.runs(5)

        async def drained() -> bool:
            return await deployment.counts(runs) == {"succeeded": 5}

        await eventually(drained, within=30)
        stats = await worker.stop()
    assert stats["connects"] == 2, stats


# -- the README's example ----------------------------------------------------------------------------


class AcmeSync(Handler):
    """Only so that jobs can name `acme.sync` (the API's registry validates job handlers)."""

    name: ClassVar[str] = "acme.sync"
    description: ClassVar[str] = "served by clients/node/worker-example.js"
    extra_fields: ClassVar[bool] = True

    async def run(self, ctx: ServerContext, payload: dict[str, Any]) -> JSONValue:
        raise AssertionError("never run in-process")


async def test_the_worker_example_serves_its_handler(deployment: Deployment) -> None:
    """`clients/node/worker-example.js` as the README runs it: a result, a permanent failure, a
    `ctx.retryAfter(30)` (back to the queue for 30 s, no attempt spent)."""
    assert NODE is not None
    registry = default_registry(HandlerSettings())
    registry.register(AcmeSync())
    control = Control(deployment.redis, deployment.pool, registry)
    run_ids: dict[str, str] = {}
    try:
        for name, payload in (("ok", {"account": "a1"}), ("bad", {}), ("busy", {"account": "a2", "busy": True})):
            job = await control.create_job(JobSpec(
                name=f"acme-{name}-{time.monotonic_ns()}", handler="acme.sync", queue=QUEUE, payload=payload,
                retry=RetryPolicy(max_retries=3),
            ))  # fmt: skip
            made = await FiringRepository(deployment.pool).trigger(job.id, Trigger.MANUAL, [datetime.now(UTC)])
            await enqueue_runs(Queues(deployment.redis), made)
            run_ids[name] = made[0].run_id
    finally:
        await registry.aclose()
    env = {**os.environ, "SCHEDCTL_SERVER": deployment.target, "SCHEDULER_WORKER_KEY": deployment.worker_key}
    process = await asyncio.create_subprocess_exec(
        NODE, "worker-example.js", cwd=ROOT / "clients" / "node", env=env, stdout=asyncio.subprocess.PIPE
    )
    try:
        assert process.stdout is not None
        async with asyncio.timeout(10):
            line = (await process.stdout.readline()).decode()
        assert line.startswith("serving acme.sync as remote:"), line

        async def finished() -> list[Any]:
            rows = await deployment.pool.fetch(
                "SELECT run_id::text, status, attempt, result, error FROM job_executions "
                "WHERE run_id = ANY($1::uuid[]) AND status IN ('succeeded', 'dead')",
                [run_ids["ok"], run_ids["bad"]],
            )
            return rows if len(rows) == 2 else []

        rows = {row["run_id"]: row for row in await eventually(finished, within=20)}
        ok, bad = rows[run_ids["ok"]], rows[run_ids["bad"]]
        assert (ok["status"], ok["attempt"]) == ("succeeded", 1)
        assert ok["result"] == {"synced": "a1", "attempt": 1}
        # PermanentError: dead at once, its retries unspent.
        assert (bad["status"], bad["attempt"], bad["error"]) == ("dead", 1, "payload.account is required")

        async def waiting() -> bool:
            (state,) = (await Queues(deployment.redis).get(QUEUE).states([run_ids["busy"]])).values()
            return state is ItemState.DELAYED

        await eventually(waiting, within=10)
        busy = await deployment.pool.fetch(
            "SELECT status, attempt FROM job_executions WHERE run_id = $1", run_ids["busy"]
        )
        assert [(row["status"], row["attempt"]) for row in busy] == [("queued", 1)]
        process.send_signal(signal.SIGTERM)
        async with asyncio.timeout(10):
            assert (await process.stdout.readline()).decode() == "stopped\n"
            assert await process.wait() == 0
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
