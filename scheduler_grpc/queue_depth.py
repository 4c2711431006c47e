"""Queue depth over time, sampled (the console's charts): once a minute one server process
(whichever claims the minute in Redis) records every queue's counts in a list per queue, kept for a
day (`KEEP` samples). `Control.sample_queue_depths` takes a sample, `Control.queue_depth` reads them;
`console/depth.py` runs the once-a-minute loop.

Why sampled: PostgreSQL's history says when runs were created, started and finished, but the depth
at a past moment would need a range scan per point over a day of rows; a sample is one `stats()` per
queue per minute and at most `KEEP` * `MAX_QUEUES` short list entries. Gaps: minutes no server ran.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Final

from redis.asyncio import Redis

from scheduler_grpc.keys import DepthKeys
from scheduler_grpc.queue import QueueStats

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


async def claim_minute(redis: Redis, now: float) -> bool:
    """Whether this process samples the minute of `now` (False: another one claimed it)."""
    async with asyncio.timeout(TIMEOUT):
        return bool(await redis.set(_KEYS.tick(int(now // 60)), b"1", nx=True, ex=int(INTERVAL * 2)))


async def record(redis: Redis, now: float, counts: Sequence[tuple[str, QueueStats]]) -> None:
    """Append each queue's counts at `now` to its samples (trimmed to `KEEP`, forgotten after two idle days)."""
    pipe = redis.pipeline(transaction=False)
    for name, stats in counts:
        key = _KEYS.samples(name)
        pipe.lpush(key, f"{int(now)} {stats.ready} {stats.processing} {stats.delayed} {stats.dead}")
        pipe.ltrim(key, 0, KEEP - 1)
        pipe.expire(key, 2 * 86400)  # a queue no longer used is forgotten
    async with asyncio.timeout(TIMEOUT):
        await pipe.execute()


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
