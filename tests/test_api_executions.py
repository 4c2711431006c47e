"""ExecutionService: history, cancellation and the WatchExecutions stream (resume, fan-out, slow clients)."""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import replace
from datetime import UTC, datetime, timedelta

import asyncpg
import grpc
import pytest
from redis.asyncio import Redis
from scheduler_client.v1 import executions_pb2, executions_pb2_grpc, jobs_pb2

from scheduler_grpc import events
from scheduler_grpc.auth import Role
from scheduler_grpc.events import (
    EventFanout,
    EventFilter,
    EventType,
    ExecutionEvent,
    SubscriberTooSlow,
    Subscription,
    _Chunk,
)
from scheduler_grpc.keys import EventKeys
from scheduler_grpc.services import convert
from scheduler_grpc.services.executions import CURSOR_METADATA, EventWire
from tests.engine_helpers import eventually
from tests.test_api_support import Harness, Metadata, api, echo_job, running_api  # noqa: F401 - `api` is a fixture

WatchCall = grpc.aio.UnaryStreamCall[executions_pb2.WatchExecutionsRequest, executions_pb2.WatchExecutionsResponse]


def burst(
    first: int, count: int, job_id: str = "", handler: str = "test.echo", error: str = ""
) -> list[ExecutionEvent]:
    """Events numbered by their `attempt` field, so a test can check order and completeness."""
    job_id = job_id or str(uuid.UUID(int=1))
    return [
        ExecutionEvent(EventType.SUCCEEDED, str(uuid.uuid4()), str(uuid.uuid4()), job_id, n, handler=handler,
                       error=error)
        for n in range(first, first + count)
    ]  # fmt: skip


async def watch(harness: Harness, metadata: Metadata, **fields: object) -> tuple[WatchCall, str]:
    """Open a stream and wait until it is live (its headers carry the start cursor)."""
    request = executions_pb2.WatchExecutionsRequest(**fields)  # type: ignore[arg-type]
    call = harness.executions.WatchExecutions(request, metadata=metadata)
    headers = await call.initial_metadata()
    return call, dict(headers)[CURSOR_METADATA]


def events_of(response: executions_pb2.WatchExecutionsResponse) -> list[executions_pb2.ExecutionEvent]:
    """A response's events: a batch (`max_events_per_response`), or the one event of the original form."""
    if response.events:
        assert not response.HasField("event")
        return list(response.events)
    assert response.HasField("event")
    return [response.event]


async def take(call: WatchCall, count: int) -> list[executions_pb2.ExecutionEvent]:
    received: list[executions_pb2.ExecutionEvent] = []
    async with asyncio.timeout(20):
        while len(received) < count:
            received += events_of(await call.read())  # type: ignore[arg-type]
    return received


async def drain(call: WatchCall, into: list[executions_pb2.ExecutionEvent]) -> None:
    """Read a stream until it ends (or raises), appending its events to `into`."""
    async with asyncio.timeout(20):
        async for response in call:
            into += events_of(response)


@pytest.mark.cluster_too
async def test_get_list_and_cancel(api: Harness) -> None:  # noqa: F811
    job = (await api.jobs.CreateJob(jobs_pb2.CreateJobRequest(job=echo_job()), metadata=api.admin)).job
    runs = [
        (await api.jobs.TriggerJob(jobs_pb2.TriggerJobRequest(id=job.id), metadata=api.operator)).execution
        for _ in range(3)
    ]
    got = await api.executions.GetExecution(executions_pb2.GetExecutionRequest(id=runs[0].id), metadata=api.viewer)
    assert got.execution == runs[0]
    cancelled = await api.executions.CancelExecution(
        executions_pb2.CancelExecutionRequest(id=runs[1].id), metadata=api.operator
    )
    assert cancelled.execution.state == executions_pb2.EXECUTION_STATE_CANCELLED
    listed = await api.executions.ListExecutions(
        executions_pb2.ListExecutionsRequest(job_id=job.id, page_size=2), metadata=api.viewer
    )
    assert [e.id for e in listed.executions] == [runs[2].id, runs[1].id]
    assert listed.next_page_token
    rest = await api.executions.ListExecutions(
        executions_pb2.ListExecutionsRequest(job_id=job.id, page_token=listed.next_page_token), metadata=api.viewer
    )
    assert [e.id for e in rest.executions] == [runs[0].id]
    assert not rest.next_page_token
    queued = await api.executions.ListExecutions(
        executions_pb2.ListExecutionsRequest(states=[executions_pb2.EXECUTION_STATE_QUEUED]), metadata=api.viewer
    )
    assert {e.id for e in queued.executions} == {runs[0].id, runs[2].id}
    with pytest.raises(grpc.aio.AioRpcError) as caught:  # a finished run cannot be cancelled again
        await api.executions.CancelExecution(
            executions_pb2.CancelExecutionRequest(id=runs[1].id), metadata=api.operator
        )
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    for request, field in [
        (executions_pb2.ListExecutionsRequest(job_id="nope"), "job_id"),
        (executions_pb2.ListExecutionsRequest(states=[executions_pb2.EXECUTION_STATE_UNSPECIFIED]), "states[0]"),
        (executions_pb2.ListExecutionsRequest(page_size=-1), "page_size"),
    ]:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await api.executions.ListExecutions(request, metadata=api.viewer)
        assert (caught.value.code(), (caught.value.details() or "").split(":")[0]) == (
            grpc.StatusCode.INVALID_ARGUMENT,
            field,
        )


async def test_a_missed_range_shows_its_last_slot_and_count(api: Harness, pool: asyncpg.Pool) -> None:  # noqa: F811
    job = (await api.jobs.CreateJob(jobs_pb2.CreateJobRequest(job=echo_job()), metadata=api.admin)).job
    # What the scheduler records for a run of misfires (migration 0004): one row per range.
    insert = """INSERT INTO job_executions (id, run_id, job_id, scheduled_for, attempt, status, trigger, finished_at,
                                            missed_through, missed_count)
                VALUES ($1, $1, $2, $3::timestamptz, 1, 'missed', 'schedule', now(), $3::timestamptz + $4, $5)"""
    await pool.execute(insert, uuid.uuid4(), uuid.UUID(job.id), datetime(2026, 1, 1, tzinfo=UTC), timedelta(0), 1)
    await pool.execute(
        insert, uuid.uuid4(), uuid.UUID(job.id), datetime(2026, 1, 2, tzinfo=UTC), timedelta(hours=1), 3601
    )
    await pool.execute(
        insert, uuid.uuid4(), uuid.UUID(job.id), datetime(2026, 1, 3, tzinfo=UTC), timedelta(hours=1), None
    )
    listed = await api.executions.ListExecutions(
        executions_pb2.ListExecutionsRequest(job_id=job.id, states=[executions_pb2.EXECUTION_STATE_MISSED]),
        metadata=api.viewer,
    )
    ranges = sorted(
        (e.schedule_time.ToDatetime(UTC), e.missed_through.ToDatetime(UTC), e.missed_count) for e in listed.executions
    )
    assert ranges == [
        (datetime(2026, 1, 1, tzinfo=UTC), datetime(2026, 1, 1, tzinfo=UTC), 1),
        (datetime(2026, 1, 2, tzinfo=UTC), datetime(2026, 1, 2, 1, tzinfo=UTC), 3601),
        (datetime(2026, 1, 3, tzinfo=UTC), datetime(2026, 1, 3, 1, tzinfo=UTC), 0),  # 0: not counted
    ]
    got = await api.executions.GetExecution(
        executions_pb2.GetExecutionRequest(id=listed.executions[0].id), metadata=api.viewer
    )
    assert got.execution == listed.executions[0]
    trigger = jobs_pb2.TriggerJobRequest(id=job.id)
    run = (await api.jobs.TriggerJob(trigger, metadata=api.operator)).execution
    assert not run.HasField("missed_through")
    assert run.missed_count == 0


@pytest.mark.cluster_too
async def test_a_resumed_stream_gets_exactly_the_missed_events(api: Harness, redis: Redis) -> None:  # noqa: F811
    call, _ = await watch(api, api.viewer)
    await events.publish(redis, burst(1, 5))
    seen = await take(call, 5)
    assert [e.attempt for e in seen] == [1, 2, 3, 4, 5]
    call.cancel()  # disconnect
    await events.publish(redis, burst(6, 7))
    resumed, start = await watch(api, api.viewer, cursor=seen[-1].cursor)
    assert start == seen[-1].cursor
    await events.publish(redis, burst(13, 3))  # live events right after the catch-up: no gap, no repeat
    assert [e.attempt for e in await take(resumed, 10)] == list(range(6, 16))
    resumed.cancel()


async def test_a_batch_carries_the_ready_events_in_order_and_any_of_their_cursors_resumes_exactly(
    api: Harness,  # noqa: F811
    redis: Redis,
) -> None:
    call, _ = await watch(api, api.viewer, max_events_per_response=100)
    await events.publish(redis, burst(1, 250))  # one script call: the reader gets all 250 at once
    responses = []
    async with asyncio.timeout(20):
        while sum(len(r.events) for r in responses) < 250:
            responses.append(await call.read())
    assert [len(r.events) for r in responses] == [100, 100, 50]  # what was ready, at most 100 each
    assert not any(r.HasField("event") for r in responses)
    batched = [event for response in responses for event in response.events]
    published = await events.read_after(redis)
    assert [e.attempt for e in batched] == list(range(1, 251))
    assert [e.cursor for e in batched] == [e.cursor for e in published]
    call.cancel()
    # From any event's cursor (inside a batch, at a batch's end, the last), batched or one by one:
    # exactly the events after it, then the live ones.
    await events.publish(redis, burst(251, 5))
    for index, size in [(0, 7), (56, 1000), (99, 0), (100, 3), (248, 100), (249, 0)]:
        resumed, start = await watch(api, api.viewer, cursor=batched[index].cursor, max_events_per_response=size)
        assert start == batched[index].cursor
        rest = await take(resumed, 255 - (index + 1))
        assert [e.attempt for e in rest] == list(range(index + 2, 256)), (index, size)
        resumed.cancel()


@pytest.mark.parametrize("batch", [0, 10])
async def test_an_events_error_is_redacted_for_a_viewer_not_for_an_admin_watching_beside_it(
    api: Harness,  # noqa: F811
    redis: Redis,
    batch: int,
) -> None:
    """Each event is encoded once per redaction and shared: a viewer never gets the admin's bytes."""
    error = "connect postgres://u:hunter2@db/x failed"
    viewer, _ = await watch(api, api.viewer, max_events_per_response=batch)
    admin, _ = await watch(api, api.admin, max_events_per_response=batch)
    await events.publish(redis, burst(1, 3, error=error))
    seen_by_viewer, seen_by_admin = await take(viewer, 3), await take(admin, 3)
    assert [e.error for e in seen_by_admin] == [error] * 3
    assert [e.error for e in seen_by_viewer] == ["connect postgres://u:<redacted>@db/x failed"] * 3
    assert [e.cursor for e in seen_by_viewer] == [e.cursor for e in seen_by_admin]
    viewer.cancel()
    admin.cancel()


def test_event_wire_encodes_each_event_once_and_joins_a_filters_batch_once() -> None:
    wire = EventWire()
    published = [replace(e, cursor=f"1700000000000-{e.attempt}", time=datetime(2026, 1, 1, tzinfo=UTC))
                 for e in burst(1, 3, error="password=hunter2")]  # fmt: skip
    one, other = EventFilter(), EventFilter(handler="test.echo")
    response = wire.response(published, Role.ADMIN, batched=True, shared=one)
    decoded = executions_pb2.WatchExecutionsResponse.FromString(response)
    assert decoded == executions_pb2.WatchExecutionsResponse(events=[convert.event_to_proto(e) for e in published])
    assert wire.response(list(published), Role.ADMIN, batched=True, shared=EventFilter()) is response
    assert wire.response(published, Role.ADMIN, batched=True, shared=other) == response  # joined anew
    assert wire.response(published, Role.ADMIN, batched=True, shared=other) is not response
    viewer = executions_pb2.WatchExecutionsResponse.FromString(
        wire.response(published, Role.VIEWER, batched=True, shared=one)
    )
    assert [e.error for e in viewer.events] == ["password=<redacted>"] * 3
    single = executions_pb2.WatchExecutionsResponse.FromString(wire.response(published[1:2], Role.ADMIN, batched=False))
    assert single == executions_pb2.WatchExecutionsResponse(event=convert.event_to_proto(published[1]))
    assert wire.response(published[1:2], Role.ADMIN, batched=False) is wire.response(
        published[1:2], Role.ADMIN, batched=False
    )


async def test_a_subscription_skips_what_its_catch_up_gave_splits_at_the_limit_and_overflows(redis: Redis) -> None:
    """The buffer's bookkeeping, driven directly: chunks as the reader hands them over."""
    published = [replace(e, cursor=f"1-{e.attempt}") for e in burst(1, 30)]

    def chunk(first: int, last: int) -> _Chunk:
        return _Chunk([(1, n) for n in range(first, last + 1)], published[first - 1 : last])

    subscription = Subscription(EventFanout(redis), EventFilter(), None, buffer=10)
    subscription._last = (1, 3)  # a catch-up gave events 1-3
    assert subscription._offer(chunk(1, 3))  # all given already: nothing buffered
    assert subscription._offer(chunk(1, 6))  # 4-6 buffered
    assert subscription._offer(chunk(7, 12))
    batches = subscription.batches(4)
    taken = [await anext(batches) for _ in range(3)]
    assert [[e.attempt for e in batch] for batch in taken] == [[4, 5, 6, 7], [8, 9, 10, 11], [12]]
    assert subscription.cursor == "1-12"
    whole = chunk(13, 15)
    assert subscription._offer(whole)
    assert await anext(batches) is whole.events  # one read's events, shared as they are
    assert subscription._offer(chunk(16, 25))  # exactly full
    assert not subscription._offer(chunk(26, 26))  # one more: dropped, its buffer freed
    assert subscription.overflowed
    with pytest.raises(SubscriberTooSlow) as caught:
        await anext(batches)
    assert caught.value.cursor == "1-15"  # the last event it was given


@pytest.mark.parametrize("batch", [0, 10])
async def test_a_flow_run_watch_gets_only_its_runs_events_batched_or_not(
    api: Harness,  # noqa: F811
    redis: Redis,
    batch: int,
) -> None:
    root = (await api.jobs.CreateJob(jobs_pb2.CreateJobRequest(job=echo_job("root")), metadata=api.admin)).job
    child = echo_job("root-child")
    child.depends_on.append(root.id)
    await api.jobs.CreateJob(jobs_pb2.CreateJobRequest(job=child), metadata=api.admin)
    ours, theirs = [
        (await api.jobs.TriggerJob(jobs_pb2.TriggerJobRequest(id=root.id), metadata=api.operator)).execution
        for _ in range(2)
    ]
    call, _ = await watch(api, api.viewer, flow_run_id=ours.run_id, max_events_per_response=batch)

    def event(run: executions_pb2.Execution, attempt: int) -> ExecutionEvent:
        return ExecutionEvent(EventType.STARTED, run.id, run.run_id, run.job_id, attempt, handler="test.echo")

    # One read: the other flow run's events in between are left out of the batch, not sent empty.
    await events.publish(redis, [event(theirs, 1), event(ours, 2), event(theirs, 3), event(ours, 4), event(theirs, 5)])
    await events.publish(redis, [event(theirs, 6)])
    await events.publish(redis, [event(ours, 7)])
    got = await take(call, 3)
    assert [(e.run_id, e.attempt) for e in got] == [(ours.run_id, 2), (ours.run_id, 4), (ours.run_id, 7)]
    call.cancel()


async def test_a_negative_batch_size_is_refused(api: Harness) -> None:  # noqa: F811
    request = executions_pb2.WatchExecutionsRequest(max_events_per_response=-1)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await api.executions.WatchExecutions(request, metadata=api.viewer).read()
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (caught.value.details() or "").startswith("max_events_per_response:")


async def test_resuming_while_events_keep_coming_loses_and_repeats_nothing(
    api: Harness,  # noqa: F811
    redis: Redis,
) -> None:
    await events.publish(redis, burst(1, 50))
    cursor = (await events.read_after(redis))[19].cursor  # after event 20

    async def publish() -> None:
        for first in range(51, 301, 10):
            await events.publish(redis, burst(first, 10))
            await asyncio.sleep(0)

    publisher = asyncio.create_task(publish())
    call, _ = await watch(api, api.viewer, cursor=cursor)
    received = await take(call, 280)
    await publisher
    call.cancel()
    assert [e.attempt for e in received] == list(range(21, 301))


async def test_filters_by_job_type_and_handler(api: Harness, redis: Redis) -> None:  # noqa: F811
    job_a, job_b = str(uuid.uuid4()), str(uuid.uuid4())
    call, _ = await watch(
        api, api.viewer, job_ids=[job_a], types=[executions_pb2.EVENT_TYPE_FAILED], handler="test.fail"
    )
    wanted = ExecutionEvent(EventType.FAILED, str(uuid.uuid4()), "r", job_a, 7, handler="test.fail", error="boom")
    await events.publish(redis, [
        ExecutionEvent(EventType.FAILED, "x", "r", job_b, 1, handler="test.fail"),
        ExecutionEvent(EventType.SUCCEEDED, "x", "r", job_a, 2, handler="test.fail"),
        ExecutionEvent(EventType.FAILED, "x", "r", job_a, 3, handler="test.echo"),
        wanted,
    ])  # fmt: skip
    (event,) = await take(call, 1)
    assert (event.execution_id, event.attempt, event.error, event.type) == (
        wanted.execution_id, 7, "boom", executions_pb2.EVENT_TYPE_FAILED,
    )  # fmt: skip
    call.cancel()
    for fields, field in [({"job_ids": ["nope"]}, "job_ids[0]"), ({"cursor": "abc"}, "cursor"),
                          ({"types": [0]}, "types[0]")]:  # fmt: skip
        bad = api.executions.WatchExecutions(executions_pb2.WatchExecutionsRequest(**fields), metadata=api.viewer)  # type: ignore[arg-type]
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await bad.read()
        assert (caught.value.code(), (caught.value.details() or "").split(":")[0]) == (
            grpc.StatusCode.INVALID_ARGUMENT,
            field,
        )


async def test_1000_subscribers_share_one_reader_and_each_gets_every_event(
    api: Harness,  # noqa: F811
    redis: Redis,
) -> None:
    channels = [grpc.aio.insecure_channel(api.server.address) for _ in range(10)]
    try:
        stubs = [executions_pb2_grpc.ExecutionServiceStub(channel) for channel in channels]
        calls = [
            stubs[i % len(stubs)].WatchExecutions(executions_pb2.WatchExecutionsRequest(), metadata=api.viewer)
            for i in range(1000)
        ]
        await asyncio.gather(*(call.initial_metadata() for call in calls))
        assert api.server.api.fanout.subscriber_count == 1000
        await events.publish(redis, burst(1, 10))
        results = await asyncio.gather(*(take(call, 10) for call in calls))
        assert all([e.attempt for e in received] == list(range(1, 11)) for received in results)
        for call in calls:
            call.cancel()

        async def all_gone() -> bool:
            return api.server.api.fanout.subscriber_count == 0

        await eventually(all_gone, within=10)
    finally:
        await asyncio.gather(*(channel.close() for channel in channels))


async def test_a_cancelled_client_is_unsubscribed_at_once(api: Harness) -> None:  # noqa: F811
    call, _ = await watch(api, api.viewer)
    assert api.server.api.fanout.subscriber_count == 1
    call.cancel()

    async def gone() -> bool:
        return api.server.api.fanout.subscriber_count == 0

    await eventually(gone, within=5, interval=0.01)


@pytest.mark.parametrize("batch", [0, 100])
async def test_a_slow_subscriber_is_ended_with_its_resume_cursor(
    redis_url: str, database_url: str, redis: Redis, pool: asyncpg.Pool, batch: int
) -> None:
    """A subscriber that reads nothing is dropped once its buffer is full, without holding up the
    one beside it; its stream ends with RESOURCE_EXHAUSTED after what was already on its way, and
    its cursor resumes exactly. One event per message or batched (`batch`), alike."""
    async with running_api(redis_url, database_url, pool, SCHEDULER_WATCH_BUFFER="200") as harness:
        # A connection that does not grow its flow-control window, so the transport fills quickly.
        slow_channel = grpc.aio.insecure_channel(harness.server.address, options=[("grpc.http2.bdp_probe", 0)])
        slow_harness = Harness(harness.server, slow_channel)
        slow, _ = await watch(slow_harness, harness.viewer, max_events_per_response=batch)
        fast, _ = await watch(harness, harness.viewer, max_events_per_response=batch)
        # Far more than the transport and the 200-event buffer hold while the slow client reads
        # nothing; the fast one reads each chunk before the next is published, each within 5 s.
        fast_got = []
        for first in range(1, 3001, 100):
            await events.publish(redis, burst(first, 100, error="x" * 400))
            async with asyncio.timeout(5):
                fast_got += await take(fast, 100)
        assert [e.attempt for e in fast_got] == list(range(1, 3001))  # the slow one held nobody back
        assert harness.server.api.fanout.subscriber_count == 1  # the slow one was dropped
        assert harness.server.api.fanout.dropped == 1
        got: list[executions_pb2.ExecutionEvent] = []
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await drain(slow, got)
        assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        details = caught.value.details() or ""
        assert details.startswith("too slow; resume from cursor ")
        cursor = details.rsplit(" ", 1)[1]
        assert got
        assert cursor == got[-1].cursor
        assert len(got) < 3000
        resumed, _ = await watch(harness, harness.viewer, cursor=cursor, max_events_per_response=batch)
        rest = await take(resumed, 3000 - len(got))
        assert [e.attempt for e in got + rest] == list(range(1, 3001))
        resumed.cancel()
        fast.cancel()
        await slow_channel.close()


async def test_a_cursor_older_than_the_retention_is_refused_not_silently_skipped(
    api: Harness,  # noqa: F811
    redis: Redis,
) -> None:
    await events.publish(redis, burst(1, 10))
    published = await events.read_after(redis)
    old, kept = published[2].cursor, published[6].cursor  # after events 3 and 7
    await redis.xtrim(EventKeys().stream, maxlen=5, approximate=False)  # events 1-5 are gone
    call = api.executions.WatchExecutions(executions_pb2.WatchExecutionsRequest(cursor=old), metadata=api.viewer)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await take(call, 1)
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "cursor" in (caught.value.details() or "")
    resumed, _ = await watch(api, api.viewer, cursor=kept)
    assert [e.attempt for e in await take(resumed, 3)] == [8, 9, 10]
    resumed.cancel()
