"""Event order: a run's CREATED is on the events stream before the run is in its queue.

A worker can claim a run (and publish STARTED) as soon as it is queued, so CREATED must be on the
stream by then, or a watcher could see STARTED before CREATED. A spy on the real queue's enqueue
reads the real events stream at the moment each run is enqueued.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import UTC, datetime, timedelta

import asyncpg
import pytest
import redis.asyncio as aioredis

from scheduler_grpc import events
from scheduler_grpc.control import Control
from scheduler_grpc.db.leadership import LeadershipRepository
from scheduler_grpc.events import EventType
from scheduler_grpc.jobs import JobSpec, ScheduleKind
from scheduler_grpc.leader import Term
from scheduler_grpc.queue import LimitDefinition, NewItem, Queue
from scheduler_grpc.scheduler import LeaderLoops, LoopSettings


def _spy_on_enqueue(monkeypatch: pytest.MonkeyPatch, redis: aioredis.Redis) -> list[tuple[str, bool]]:
    """Record, for each run enqueued, whether its CREATED event was already on the stream."""
    seen: list[tuple[str, bool]] = []
    enqueue_many = Queue.enqueue_many

    async def spying(self: Queue, items: Iterable[NewItem], definitions: Iterable[LimitDefinition] = ()) -> int:
        items = list(items)
        created = {e.run_id for e in await events.read_after(redis, count=10_000) if e.type is EventType.CREATED}
        seen.extend((item.id, item.id in created) for item in items)
        return await enqueue_many(self, items, definitions)

    monkeypatch.setattr(Queue, "enqueue_many", spying)
    return seen


async def test_trigger_and_backfill_announce_a_run_before_queueing_it(
    control: Control, redis: aioredis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    job = await control.create_job(
        JobSpec(name="ordered", handler="test.echo", schedule_kind=ScheduleKind.CRON, cron="* * * * *")
    )
    seen = _spy_on_enqueue(monkeypatch, redis)
    triggered = await control.trigger_job(job.id)
    now = datetime.now(UTC).replace(second=0, microsecond=0)
    backfilled = await control.backfill_job(job.id, [now - timedelta(minutes=m) for m in (3, 2, 1)])
    assert [run_id for run_id, _ in seen] == [run.run_id for run in [*triggered, *backfilled]]
    assert all(announced for _, announced in seen), seen


async def test_the_leaders_scan_announces_a_run_before_queueing_it(
    control: Control, redis: aioredis.Redis, pool: asyncpg.Pool, monkeypatch: pytest.MonkeyPatch
) -> None:
    record = await LeadershipRepository(pool).begin_term("scheduler", "leader")
    assert record is not None
    term = Term(token=record.term, holder=record.holder, lease_id=f"{record.holder}:x",
                acquired_at=record.acquired_at, scope=record.scope)  # fmt: skip
    term._renewed(0, float("inf"))
    await control.create_job(
        JobSpec(name="due", handler="test.echo", schedule_kind=ScheduleKind.CRON, cron="* * * * * *")
    )
    await pool.execute("UPDATE jobs SET next_run_time = now() - interval '1 second'")
    seen = _spy_on_enqueue(monkeypatch, redis)
    await LeaderLoops(redis, pool, LoopSettings()).scan_once(term)
    assert seen, "the scan enqueued nothing"
    assert all(announced for _, announced in seen), seen
