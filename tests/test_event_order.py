"""Event order: a run's CREATED is on the events stream before the run is in its queue.

A worker can claim a run (and publish STARTED) as soon as it is queued, so CREATED must be on the
stream by then, or a watcher could see STARTED before CREATED. The server's own log of what it ran
(MONITOR) shows each run's XADD to the stream and its enqueue in the order they happened, however
the writer sent them.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterable
from datetime import UTC, datetime, timedelta

import asyncpg
import redis.asyncio as aioredis

from scheduler_grpc.control import Control
from scheduler_grpc.db.leadership import LeadershipRepository
from scheduler_grpc.jobs import JobSpec, ScheduleKind
from scheduler_grpc.leader import Term
from scheduler_grpc.scheduler import LeaderLoops, LoopSettings


class _ServerLog:
    """The commands one Redis server runs, in the order it runs them, its scripts' own included
    (MONITOR, on a connection of its own): whatever a writer pipelines, this is the order that
    counts."""

    def __init__(self, redis: aioredis.Redis) -> None:
        self.commands: list[str] = []
        self._monitor = redis.monitor()
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> _ServerLog:
        await self._monitor.__aenter__()
        self._task = asyncio.create_task(self._read())
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        await self._monitor.__aexit__()

    async def _read(self) -> None:
        while True:
            info = await self._monitor.next_command()
            if info["client_type"] == "lua":
                self.commands.append(info["command"])

    def position(self, verb: str, key_part: str, run_id: str) -> int | None:
        """Where a script's first `verb` on a key containing `key_part` with `run_id` in it ran."""
        for index, command in enumerate(self.commands):
            words = command.split(" ")
            if words[0].upper() == verb and key_part in words[1] and run_id in command:
                return index
        return None

    async def wait_for(self, verb: str, key_part: str, run_ids: Iterable[str], deadline: float) -> None:
        while any(self.position(verb, key_part, run_id) is None for run_id in run_ids):
            assert time.monotonic() < deadline, f"no {verb} on {key_part} for every run: {self.commands[-20:]}"
            await asyncio.sleep(0.01)


def _announced_first(log: _ServerLog, run_ids: Iterable[str]) -> dict[str, tuple[int | None, int | None]]:
    """Each run whose CREATED (its XADD to the events stream) did not run before its enqueue (the
    HSETNX of its priority, the enqueue's first write): (the XADD's position, the HSETNX's)."""
    late = {}
    for run_id in run_ids:
        added, queued = log.position("XADD", "events", run_id), log.position("HSETNX", "priority", run_id)
        if added is None or queued is None or added > queued:
            late[run_id] = (added, queued)
    return late


async def test_trigger_and_backfill_announce_a_run_before_queueing_it(
    control: Control, redis: aioredis.Redis, deadline: Callable[[float], float]
) -> None:
    job = await control.create_job(
        JobSpec(name="ordered", handler="test.echo", schedule_kind=ScheduleKind.CRON, cron="* * * * *")
    )
    async with _ServerLog(redis) as log:
        triggered = await control.trigger_job(job.id)
        now = datetime.now(UTC).replace(second=0, microsecond=0)
        backfilled = await control.backfill_job(job.id, [now - timedelta(minutes=m) for m in (3, 2, 1)])
        run_ids = [run.run_id for run in [*triggered, *backfilled]]
        await log.wait_for("HSETNX", "priority", run_ids, deadline(10))
    assert len(run_ids) == 4
    assert _announced_first(log, run_ids) == {}


async def test_the_leaders_scan_announces_a_run_before_queueing_it(
    control: Control, redis: aioredis.Redis, pool: asyncpg.Pool, deadline: Callable[[float], float]
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
    async with _ServerLog(redis) as log:
        await LeaderLoops(redis, pool, LoopSettings()).scan_once(term)
        run_ids = [str(row["run_id"]) for row in await pool.fetch("SELECT run_id FROM job_executions")]
        assert run_ids, "the scan fired nothing"
        await log.wait_for("HSETNX", "priority", run_ids, deadline(10))
    assert _announced_first(log, run_ids) == {}
