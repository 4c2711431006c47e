"""Queue depth over time, sampled: once a minute one server process (whichever claims the minute in
Redis) records every queue's counts in a list per queue, kept for a day (`KEEP` samples).

Why sampled: PostgreSQL's history says when runs were created, started and finished, but the depth
at a past moment would need a range scan per point over a day of rows; a sample is one `stats()` per
queue per minute and at most `KEEP` * `MAX_QUEUES` short list entries. Gaps: minutes no server ran.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Final

from redis.asyncio import Redis

from scheduler_grpc import stores
from scheduler_grpc.control import Control
from scheduler_grpc.keys import DepthKeys

log = logging.getLogger(__name__)

INTERVAL: Final = 60.0
KEEP: Final = 1440
"""Samples kept per queue: a day of minutes."""
MAX_QUEUES: Final = 50
"""Most queues sampled (by name): a bound on the work and the keys, whatever jobs name."""
TIMEOUT: Final = 5.0
_KEYS: Final = DepthKeys()


@dataclass(frozen=True)
class Sample:
    """A queue's counts at one moment."""

    time: datetime
    ready: int
    processing: int
    delayed: int
    dead: int


async def sample_once(redis: Redis, control: Control, now: float) -> bool:
    """Record every queue's counts for the minute of `now` unless another process did; True if recorded."""
    minute = int(now // 60)
    async with asyncio.timeout(TIMEOUT):
        if not await redis.set(_KEYS.tick(minute), b"1", nx=True, ex=int(INTERVAL * 2)):
            return False
        names = sorted({"default", *(await control.jobs.queue_names())})[:MAX_QUEUES]
        # One queue after another: one connection, not a burst of up to MAX_QUEUES of them.
        stats = [await control.queues.get(name).stats() for name in names]
        pipe = redis.pipeline(transaction=False)
        for name, counts in zip(names, stats, strict=True):
            key = _KEYS.samples(name)
            pipe.lpush(key, f"{int(now)} {counts.ready} {counts.processing} {counts.delayed} {counts.dead}")
            pipe.ltrim(key, 0, KEEP - 1)
            pipe.expire(key, 2 * 86400)  # a queue no longer used is forgotten
        await pipe.execute()
    return True


async def read(redis: Redis, queue: str, since: datetime) -> list[Sample]:
    """The samples of `queue` since `since`, oldest first."""
    async with asyncio.timeout(TIMEOUT):
        raw = await redis.lrange(_KEYS.samples(queue), 0, KEEP - 1)
    samples = []
    for entry in raw:
        try:
            stamp, ready, processing, delayed, dead = (int(part) for part in entry.split())
        except ValueError:
            continue  # not ours: skipped rather than failing the page
        moment = datetime.fromtimestamp(stamp, UTC)
        if moment >= since:
            samples.append(Sample(moment, ready, processing, delayed, dead))
    samples.reverse()
    return samples


@contextlib.asynccontextmanager
async def sampling(
    redis: Redis, control: Control, clock: Callable[[], float] = time.time, interval: float = INTERVAL
) -> AsyncIterator[None]:
    """Sample queue depths every `interval` while the block runs (a supervised task, cancelled at exit)."""

    async def loop(tick: Callable[[], Awaitable[bool]]) -> None:
        failing = False
        while True:
            # First at the next minute boundary, not at start-up: a starting server has enough to do.
            await asyncio.sleep(interval - clock() % interval)
            try:
                await tick()
                failing = False
            except Exception as exc:
                # A store that does not answer: log once, try again next minute.
                if not stores.is_fault(exc):
                    raise
                if not failing:
                    log.warning("queue depth sampling failed; retrying each minute", extra={"error": repr(exc)})
                failing = True

    task = asyncio.create_task(loop(lambda: sample_once(redis, control, clock())), name="console-depth-sampler")

    def crashed(done: asyncio.Task[None]) -> None:
        if not done.cancelled() and done.exception() is not None:
            log.error("queue depth sampling stopped", exc_info=done.exception())

    task.add_done_callback(crashed)
    try:
        yield
    finally:
        task.cancel()
        # Waits without raising the task's outcome; a cancellation of this block still propagates.
        await asyncio.wait({task})
