"""What runs where, for viewers: live workers (their heartbeats) and the scheduler leader.

Only reads: the heartbeat format belongs to `registry`, the leader lock's to `leader`, the term
record to `db.leadership`; the ClusterService servicer asks this module and never Redis itself.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster

from scheduler_grpc import leader, registry
from scheduler_grpc.db.leadership import LeadershipRepository
from scheduler_grpc.keys import LeaderKeys
from scheduler_grpc.registry import WorkerInfo


def serves(workers: Iterable[WorkerInfo], handler: str, queue: str) -> bool:
    """Whether one of `workers` (live ones, `ClusterView.workers`) runs `handler` on `queue`."""
    return any(handler in worker.handlers and worker.queue == queue for worker in workers)


@dataclass(frozen=True)
class LeaderStatus:
    """The scheduler leader as Redis (the lock) and PostgreSQL (the last term) see it.

    Attributes:
        holder: Who holds the leader lock now; None if nobody does.
        term: The latest term recorded in PostgreSQL (0: none yet).
        since: When that term began.
    """

    holder: str | None
    term: int
    since: datetime | None


class ClusterView:
    """Reads the cluster's state; every Redis call is bounded by `timeout`."""

    def __init__(self, redis: Redis, leadership: LeadershipRepository, *, timeout: timedelta) -> None:
        self._redis = redis
        self._leadership = leadership
        self._timeout = timeout

    async def workers(self) -> list[WorkerInfo]:
        """The live workers (a recent heartbeat), by id."""
        return await registry.live_workers(self._redis, call_timeout=self._timeout)

    async def electors(self) -> int:
        """Scheduler processes taking part in the leader election (leader and standbys).

        Every elector stays subscribed to the release channel from its first campaign on (it is how
        standbys hear of a graceful handover), so the channel's subscriber count is their number.
        On a Valkey Cluster each node counts its own subscribers: the counts of every node are summed.
        """
        channel = LeaderKeys().released
        async with asyncio.timeout(self._timeout.total_seconds()):
            if isinstance(self._redis, RedisCluster):
                counts = await self._redis.pubsub_numsub(channel, target_nodes=RedisCluster.ALL_NODES)
            else:
                counts = await self._redis.pubsub_numsub(channel)
        return int(counts[0][1]) if counts else 0

    async def leader(self) -> LeaderStatus:
        """Who leads the scheduler now, and the latest term."""
        scope = LeaderKeys().scope
        holder = await leader.current_holder(self._redis, scope, call_timeout=self._timeout.total_seconds())
        record = await self._leadership.current(scope)
        return LeaderStatus(holder, record.term if record else 0, record.acquired_at if record else None)
