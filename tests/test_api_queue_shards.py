"""QueueService's shard counts (issue 24): GetQueueShards, ListQueueShards, SetQueueShards over gRPC,
on a real server, Redis and PostgreSQL."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta

import asyncpg
import grpc
import pytest
from scheduler_client.v1 import queue_pb2

from scheduler_grpc.db.queue_shards import MAX_CHANGES, QueueShardRepository
from scheduler_grpc.sharding import SHARDS_MAX
from tests.test_api_support import Harness, api  # noqa: F401 - `api` is a fixture


def _ms(stamp: datetime) -> int:
    """A database time in whole ms, rounded as the histories are read."""
    return ((stamp - datetime(1970, 1, 1, tzinfo=UTC)) // timedelta(microseconds=1) + 500) // 1000


def _stamp_ms(change: queue_pb2.QueueShardChange) -> int:
    return change.effective_time.seconds * 1000 + change.effective_time.nanos // 1_000_000


async def _rows(pool: asyncpg.Pool) -> list[tuple[str, int]]:
    return [(r["queue"], r["shards"]) for r in await pool.fetch("SELECT queue, shards FROM queue_shards ORDER BY 1, 2")]


async def test_set_applies_a_lead_time_ahead_and_get_reads_the_history(api: Harness, pool: asyncpg.Pool) -> None:  # noqa: F811
    # A change already in effect (made with no lead), then one through the API.
    await QueueShardRepository(pool).set_shards("reports", 2, lead=timedelta(0))
    before = await pool.fetchval("SELECT clock_timestamp()")
    response = await api.queue.SetQueueShards(
        queue_pb2.SetQueueShardsRequest(queue="reports", shards=3), metadata=api.admin
    )
    after = await pool.fetchval("SELECT clock_timestamp()")
    # SCHEDULER_QUEUE_SHARD_LEAD (10 s, the default) after now, on the database clock.
    lead = api.server.api.control._queues.shard_map.lead
    assert lead == timedelta(seconds=10)
    assert response.change.shards == 3
    assert _ms(before + lead) <= _stamp_ms(response.change) <= _ms(after + lead)
    stored = await pool.fetchval("SELECT effective_at FROM queue_shards WHERE queue = 'reports' AND shards = 3")
    assert _stamp_ms(response.change) == _ms(stored)

    got = await api.queue.GetQueueShards(queue_pb2.GetQueueShardsRequest(queue="reports"), metadata=api.viewer)
    assert (got.queue, got.shards, got.served_shards) == ("reports", 2, 3)  # 3 is not in effect yet, but served
    assert [c.shards for c in got.changes] == [2, 3]
    assert got.changes[1] == response.change

    # A queue never changed has one shard; "" is the default queue, as in every QueueService call.
    plain = await api.queue.GetQueueShards(queue_pb2.GetQueueShardsRequest(), metadata=api.viewer)
    assert (plain.queue, plain.shards, plain.served_shards, list(plain.changes)) == ("default", 1, 1, [])
    await api.queue.SetQueueShards(queue_pb2.SetQueueShardsRequest(shards=SHARDS_MAX), metadata=api.admin)
    assert await _rows(pool) == [("default", SHARDS_MAX), ("reports", 2), ("reports", 3)]


async def test_list_pages_the_queues_with_a_history_by_name(api: Harness) -> None:  # noqa: F811
    for name, shards in [("c-queue", 4), ("a-queue", 2), ("b-queue", 1), ("a-queue", 5)]:
        await api.queue.SetQueueShards(queue_pb2.SetQueueShardsRequest(queue=name, shards=shards), metadata=api.admin)
    first = await api.queue.ListQueueShards(queue_pb2.ListQueueShardsRequest(page_size=2), metadata=api.viewer)
    assert [(q.queue, q.served_shards, [c.shards for c in q.changes]) for q in first.queues] == [
        ("a-queue", 5, [2, 5]),
        ("b-queue", 1, [1]),
    ]
    assert all(q.shards == 1 for q in first.queues)  # none in effect yet (the lead)
    rest = await api.queue.ListQueueShards(
        queue_pb2.ListQueueShardsRequest(page_size=2, page_token=first.next_page_token), metadata=api.viewer
    )
    assert [(q.queue, q.served_shards) for q in rest.queues] == [("c-queue", 4)]
    assert not rest.next_page_token
    every = await api.queue.ListQueueShards(queue_pb2.ListQueueShardsRequest(), metadata=api.viewer)
    assert [q.queue for q in every.queues] == ["a-queue", "b-queue", "c-queue"]


@pytest.mark.parametrize(
    ("request_", "field"),
    [
        (queue_pb2.SetQueueShardsRequest(queue="reports", shards=0), "shards"),
        (queue_pb2.SetQueueShardsRequest(queue="reports", shards=SHARDS_MAX + 1), "shards"),
        (queue_pb2.SetQueueShardsRequest(queue="reports", shards=-3), "shards"),
        (queue_pb2.SetQueueShardsRequest(queue="bad#queue", shards=2), "queue"),
        (queue_pb2.SetQueueShardsRequest(queue="x" * 200, shards=2), "queue"),
        (queue_pb2.SetQueueShardsRequest(queue="bad#queue", shards=0), "queue"),
    ],
)
async def test_bad_input_is_invalid_argument_naming_the_field_and_writes_nothing(
    api: Harness,  # noqa: F811
    pool: asyncpg.Pool,
    request_: queue_pb2.SetQueueShardsRequest,
    field: str,
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await api.queue.SetQueueShards(request_, metadata=api.admin)
    assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert (refused.value.details() or "").startswith(f"{field}: "), refused.value.details()
    assert await _rows(pool) == []


async def test_bad_reads_are_invalid_argument_naming_the_field(api: Harness) -> None:  # noqa: F811
    calls = [
        (api.queue.GetQueueShards(queue_pb2.GetQueueShardsRequest(queue="no spaces"), metadata=api.viewer), "queue"),
        (api.queue.ListQueueShards(queue_pb2.ListQueueShardsRequest(page_size=-1), metadata=api.viewer), "page_size"),
        (api.queue.ListQueueShards(queue_pb2.ListQueueShardsRequest(page_size=1001), metadata=api.viewer), "page_size"),
        (api.queue.ListQueueShards(queue_pb2.ListQueueShardsRequest(page_token="forged"), metadata=api.viewer),
         "page_token"),
    ]  # fmt: skip
    for call, field in calls:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await call
        assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert (refused.value.details() or "").startswith(f"{field}: "), refused.value.details()


async def test_a_queue_records_at_most_max_changes_and_concurrent_sets_cannot_pass_it(
    api: Harness,  # noqa: F811
    pool: asyncpg.Pool,
) -> None:
    # Every role re-reads the whole table every lead/4 and a change is never removed: its growth is
    # bounded where it grows. Ten sets racing for the last two places: exactly two get them.
    shards = QueueShardRepository(pool)
    for n in range(MAX_CHANGES - 2):
        await shards.set_shards("reports", 1 + n % 3, lead=timedelta(0))
    calls = [
        api.queue.SetQueueShards(queue_pb2.SetQueueShardsRequest(queue="reports", shards=2), metadata=api.admin)
        for _ in range(10)
    ]
    outcomes = await asyncio.gather(*calls, return_exceptions=True)
    refused = [o for o in outcomes if isinstance(o, grpc.aio.AioRpcError)]
    assert len(refused) == 8, outcomes
    assert {o.code() for o in refused} == {grpc.StatusCode.FAILED_PRECONDITION}
    assert f"{MAX_CHANGES} shard changes" in (refused[0].details() or "")
    assert await pool.fetchval("SELECT count(*) FROM queue_shards WHERE queue = 'reports'") == MAX_CHANGES
    # Another queue is not limited by this one's history.
    await api.queue.SetQueueShards(queue_pb2.SetQueueShardsRequest(queue="other", shards=2), metadata=api.admin)


async def test_only_an_admin_sets_a_count(api: Harness, pool: asyncpg.Pool) -> None:  # noqa: F811
    for metadata in (api.viewer, api.operator):
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await api.queue.SetQueueShards(
                queue_pb2.SetQueueShardsRequest(queue="reports", shards=2), metadata=metadata
            )
        assert refused.value.code() is grpc.StatusCode.PERMISSION_DENIED
    assert await _rows(pool) == []
    # Reading is a viewer's right.
    got = await api.queue.GetQueueShards(queue_pb2.GetQueueShardsRequest(queue="reports"), metadata=api.viewer)
    assert got.served_shards == 1


async def test_a_list_page_ends_before_a_mebibyte(api: Harness, pool: asyncpg.Pool) -> None:  # noqa: F811
    # Two queues of 40,000 changes each (~0.6 MiB each as messages): one per page, then the end.
    await pool.execute(
        """INSERT INTO queue_shards (queue, effective_at, shards)
           SELECT q, now() - make_interval(secs => n), 1 + n % 64
             FROM unnest(ARRAY['big-a', 'big-b', 'small']) AS q, generate_series(1, 40000) AS n
            WHERE q <> 'small' OR n = 1"""
    )
    first = await api.queue.ListQueueShards(queue_pb2.ListQueueShardsRequest(), metadata=api.viewer)
    assert [(q.queue, len(q.changes)) for q in first.queues] == [("big-a", 40000)]
    assert first.ByteSize() < 1 << 20
    rest = await api.queue.ListQueueShards(
        queue_pb2.ListQueueShardsRequest(page_token=first.next_page_token), metadata=api.viewer
    )
    assert [(q.queue, len(q.changes)) for q in rest.queues] == [("big-b", 40000), ("small", 1)]
    assert not rest.next_page_token
