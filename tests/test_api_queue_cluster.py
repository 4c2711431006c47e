"""QueueService (stats, dead letters) and ClusterService (workers, leader, handlers) over gRPC."""

from __future__ import annotations

import asyncio
import os
from datetime import UTC, datetime, timedelta

import asyncpg
import grpc
import pytest
from redis.asyncio import Redis
from scheduler_client.v1 import cluster_pb2, executions_pb2, jobs_pb2, queue_pb2

from scheduler_grpc import registry as workers
from scheduler_grpc.breakers import BreakerState
from scheduler_grpc.db.history import HistoryRepository
from scheduler_grpc.db.leadership import LeadershipRepository
from scheduler_grpc.db.runs import RunRepository
from scheduler_grpc.handlers import HandlerSettings, default_registry
from scheduler_grpc.keys import LeaderKeys, WorkerKeys
from scheduler_grpc.queue import Queue
from scheduler_grpc.worker import Worker
from tests.engine_helpers import eventually, make_settings
from tests.test_api_support import Harness, api, echo_job  # noqa: F401 - `api` is a fixture


async def dead_run(harness: Harness, redis: Redis, job_id: str) -> str:
    """Trigger a run and dead-letter it the way a worker does (PostgreSQL row `dead`, queue item parked)."""
    request = jobs_pb2.TriggerJobRequest(id=job_id)
    run = (await harness.jobs.TriggerJob(request, metadata=harness.operator)).execution
    (lease,) = await Queue(redis).dequeue("test-worker", timedelta(seconds=30), 1)
    assert lease.id == run.run_id
    await Queue(redis).dead_letter(lease.id, lease.token, "retry budget spent")
    await harness.server.api.control._recovery.mark_runs_dead([run.run_id], "retry budget spent")
    return run.run_id


async def test_queue_stats_and_dead_letters_list_requeue_purge(api: Harness, redis: Redis) -> None:  # noqa: F811
    job = (await api.jobs.CreateJob(jobs_pb2.CreateJobRequest(job=echo_job()), metadata=api.admin)).job
    first = await dead_run(api, redis, job.id)
    second = await dead_run(api, redis, job.id)
    stats = await api.queue.GetQueueStats(queue_pb2.GetQueueStatsRequest(), metadata=api.viewer)
    assert (stats.queue, stats.ready, stats.processing, stats.dead) == ("default", 0, 0, 2)
    page = await api.queue.ListDeadLetters(queue_pb2.ListDeadLettersRequest(page_size=1), metadata=api.viewer)
    assert [(d.run_id, d.reason, d.handler) for d in page.dead_letters] == [(first, "retry budget spent", "test.echo")]
    rest = await api.queue.ListDeadLetters(
        queue_pb2.ListDeadLettersRequest(page_token=page.next_page_token), metadata=api.viewer
    )
    assert [d.run_id for d in rest.dead_letters] == [second]
    assert not rest.next_page_token
    requeued = await api.queue.RequeueDeadLetters(
        queue_pb2.RequeueDeadLettersRequest(run_ids=[first]), metadata=api.operator
    )
    assert list(requeued.run_ids) == [first]
    history = await api.executions.ListExecutions(
        executions_pb2.ListExecutionsRequest(job_id=job.id, states=[executions_pb2.EXECUTION_STATE_QUEUED]),
        metadata=api.viewer,
    )
    assert [(e.run_id, e.attempt, e.trigger) for e in history.executions] == [
        (first, 2, executions_pb2.TRIGGER_DLQ_REQUEUE)
    ]
    stats = await api.queue.GetQueueStats(queue_pb2.GetQueueStatsRequest(queue="default"), metadata=api.viewer)
    assert (stats.ready, stats.dead) == (1, 1)
    purged = await api.queue.PurgeDeadLetters(queue_pb2.PurgeDeadLettersRequest(all=True), metadata=api.admin)
    assert list(purged.run_ids) == [second]
    again = await api.queue.RequeueDeadLetters(queue_pb2.RequeueDeadLettersRequest(all=True), metadata=api.operator)
    assert list(again.run_ids) == []
    for request, field in [
        (queue_pb2.RequeueDeadLettersRequest(), "run_ids"),
        (queue_pb2.RequeueDeadLettersRequest(run_ids=[first], all=True), "all"),
        (queue_pb2.RequeueDeadLettersRequest(run_ids=["x"]), "run_ids[0]"),
        (queue_pb2.RequeueDeadLettersRequest(queue="bad queue", all=True), "queue"),
    ]:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await api.queue.RequeueDeadLetters(request, metadata=api.operator)
        assert (caught.value.code(), (caught.value.details() or "").split(":")[0]) == (
            grpc.StatusCode.INVALID_ARGUMENT,
            field,
        )


async def test_list_workers_shows_live_workers_only(
    api: Harness,  # noqa: F811
    redis: Redis,
    redis_url: str,
    database_url: str,
    pool: asyncpg.Pool,
) -> None:
    # A worker killed two minutes ago: its last heartbeat is stale (its hash would have expired too).
    gone = datetime.now(UTC) - timedelta(minutes=2)
    await workers.beat(redis, workers.WorkerInfo(id="host:2:gone", handlers=("test.echo",), last_beat=gone))
    settings = make_settings(redis_url, database_url)
    registry = default_registry(HandlerSettings(dev_mode=True))
    worker = Worker(
        redis, RunRepository(pool), registry, settings,
        history=HistoryRepository(pool), worker_id="host:1:live", concurrency=3,
    )  # fmt: skip
    # A real failure trips the breaker the worker then reports (one failed call opens it: min_calls 1).
    breaker = worker.breakers.get("test.fail")
    while breaker.state is not BreakerState.OPEN:
        await breaker.call(lambda: asyncio.sleep(0, "failed"), lambda result: True)
    stop = asyncio.Event()
    running = asyncio.create_task(worker.run(stop))
    try:

        async def listed() -> list[cluster_pb2.Worker]:
            reply = await api.cluster.ListWorkers(cluster_pb2.ListWorkersRequest(), metadata=api.viewer)
            return list(reply.workers)

        (shown,) = await eventually(listed)
        assert (shown.id, shown.pid, shown.slots, shown.active, shown.queue) == (
            "host:1:live",
            os.getpid(),
            3,
            0,
            "default",
        )
        assert list(shown.handlers) == registry.names()
        # The live worker's beat forgot the stale index entry; reading (ListWorkers) writes nothing.
        assert await redis.zrange(WorkerKeys().index, 0, -1) == [b"host:1:live"]
        handlers = (await api.cluster.ListHandlers(cluster_pb2.ListHandlersRequest(), metadata=api.viewer)).handlers
        by_name = {h.name: h for h in handlers}
        assert by_name["shell.command"].admin_only
        assert not by_name["test.echo"].admin_only
        assert [(b.key, b.state, b.worker_id) for b in by_name["test.fail"].breakers] == [
            ("test.fail", cluster_pb2.BREAKER_STATE_OPEN, "host:1:live")
        ]
        assert {f["name"] for f in by_name["test.delay"].payload_fields} == {"seconds"}  # type: ignore[index]
    finally:
        stop.set()
        await asyncio.wait_for(running, 30)
        await registry.aclose()
    # A graceful stop unregisters: nothing is listed any more.
    assert (await api.cluster.ListWorkers(cluster_pb2.ListWorkersRequest(), metadata=api.viewer)).workers == []
    assert await redis.zrange(WorkerKeys().index, 0, -1) == []


async def test_list_workers_does_not_write(api: Harness, redis: Redis) -> None:  # noqa: F811
    """A viewer's ListWorkers only reads: a stale index entry stays until a worker's beat drops it."""
    await workers.beat(redis, workers.WorkerInfo(id="host:2:gone", last_beat=datetime.now(UTC) - timedelta(minutes=2)))
    assert (await api.cluster.ListWorkers(cluster_pb2.ListWorkersRequest(), metadata=api.viewer)).workers == []
    assert await redis.zrange(WorkerKeys().index, 0, -1) == [b"host:2:gone"]


async def test_scheduler_status_reports_the_leader_and_its_term(api: Harness, redis: Redis) -> None:  # noqa: F811
    status = await api.cluster.GetSchedulerStatus(cluster_pb2.GetSchedulerStatusRequest(), metadata=api.viewer)
    assert (status.has_leader, status.leader, status.term) == (False, "", 0)
    record = await LeadershipRepository(api.server.api.control._pool).begin_term("scheduler", "sched-1:42")
    assert record is not None
    await redis.set(LeaderKeys().lock, "sched-1:42:0123abcd", px=10_000)
    status = await api.cluster.GetSchedulerStatus(cluster_pb2.GetSchedulerStatusRequest(), metadata=api.viewer)
    assert (status.has_leader, status.leader, status.term) == (True, "sched-1:42", record.term)
    since = status.leader_since_time.ToDatetime(tzinfo=UTC)
    assert abs(since - record.acquired_at) < timedelta(milliseconds=1)


async def test_a_dead_letters_reason_is_redacted_below_admin(api: Harness, redis: Redis) -> None:  # noqa: F811
    """The reason is the run's last error: credentials in it are redacted for a viewer, as everywhere."""
    job = (await api.jobs.CreateJob(jobs_pb2.CreateJobRequest(job=echo_job()), metadata=api.admin)).job
    run = (await api.jobs.TriggerJob(jobs_pb2.TriggerJobRequest(id=job.id), metadata=api.operator)).execution
    (lease,) = await Queue(redis).dequeue("test-worker", timedelta(seconds=30), 1)
    reason = "POST https://deploy:hunter2secret@hooks.example.com/x failed: 401"
    await Queue(redis).dead_letter(lease.id, lease.token, reason)
    request = queue_pb2.ListDeadLettersRequest()
    (seen_by_viewer,) = (await api.queue.ListDeadLetters(request, metadata=api.viewer)).dead_letters
    assert seen_by_viewer.run_id == run.run_id
    assert "hunter2secret" not in seen_by_viewer.reason
    assert "hooks.example.com" in seen_by_viewer.reason
    (seen_by_admin,) = (await api.queue.ListDeadLetters(request, metadata=api.admin)).dead_letters
    assert seen_by_admin.reason == reason
