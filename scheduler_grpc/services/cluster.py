"""ClusterService: live workers, the scheduler leader, handlers and their circuit breakers."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Final

import grpc
import orjson
from scheduler_client.v1 import cluster_pb2, cluster_pb2_grpc

from scheduler_grpc.keys import LeaderKeys, WorkerKeys
from scheduler_grpc.services import Api, convert
from scheduler_grpc.worker import HEARTBEAT_TTL

Context = grpc.aio.ServicerContext[Any, Any]

_WORKERS: Final = WorkerKeys()
_LEADER: Final = LeaderKeys()


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _int(value: Any) -> int:
    try:
        return int(_text(value))
    except ValueError:
        return 0


@dataclass(frozen=True)
class _Worker:
    message: cluster_pb2.Worker
    breakers: dict[str, str] = field(default_factory=dict)


def _worker(fields: dict[str, Any]) -> _Worker:
    facts = {_text(key): _text(value) for key, value in fields.items()}
    started = None
    if facts.get("started_at"):
        try:
            started = datetime.fromisoformat(facts["started_at"])
        except ValueError:
            started = None
    beat_ms = _int(facts.get("last_beat_ms", "0"))
    message = cluster_pb2.Worker(
        id=facts.get("id", ""),
        host=facts.get("host", ""),
        pid=_int(facts.get("pid", "0")),
        slots=_int(facts.get("slots", "0")),
        active=_int(facts.get("active", "0")),
        queue=facts.get("queue", ""),
        handlers=[name for name in facts.get("handlers", "").split(",") if name],
        start_time=convert.timestamp(started),
        heartbeat_time=convert.timestamp(datetime.fromtimestamp(beat_ms / 1000, UTC)) if beat_ms else None,
    )
    breakers: dict[str, str] = {}
    if facts.get("breakers"):
        # Optional: `{breaker key: state}` as JSON, for workers that report their breakers.
        try:
            decoded = orjson.loads(facts["breakers"])
            breakers = {str(key): str(value) for key, value in decoded.items()} if isinstance(decoded, dict) else {}
        except orjson.JSONDecodeError:
            breakers = {}
    return _Worker(message, breakers)


class ClusterService(cluster_pb2_grpc.ClusterServiceServicer):
    """What runs where (the rights are in `auth.METHOD_ROLES`)."""

    def __init__(self, api: Api) -> None:
        self._redis = api.redis
        self._leadership = api.leadership
        self._handlers = api.handlers
        self._timeout = api.timeout.total_seconds()

    async def _live_workers(self) -> list[_Worker]:
        """Workers whose heartbeat is fresh; index entries of workers gone silent are dropped."""
        now_ms = int(time.time() * 1000)
        oldest = now_ms - int(HEARTBEAT_TTL.total_seconds() * 1000)
        async with asyncio.timeout(self._timeout):
            # A worker killed without unregistering leaves its index entry behind: forget it here,
            # its hash has expired by now anyway.
            await self._redis.zremrangebyscore(_WORKERS.index, "-inf", f"({oldest}")
            ids = [_text(worker_id) for worker_id in await self._redis.zrange(_WORKERS.index, 0, -1)]
            pipe = self._redis.pipeline(transaction=False)
            for worker_id in ids:
                pipe.hgetall(_WORKERS.worker(worker_id))
            replies: list[Any] = await pipe.execute() if ids else []
        workers = [_worker(fields) for fields in replies if fields]
        return sorted(
            (w for w in workers if w.message.heartbeat_time.ToMilliseconds() >= oldest),
            key=lambda w: w.message.id,
        )

    async def ListWorkers(
        self, request: cluster_pb2.ListWorkersRequest, context: Context
    ) -> cluster_pb2.ListWorkersResponse:
        return cluster_pb2.ListWorkersResponse(workers=[w.message for w in await self._live_workers()])

    async def GetSchedulerStatus(
        self, request: cluster_pb2.GetSchedulerStatusRequest, context: Context
    ) -> cluster_pb2.GetSchedulerStatusResponse:
        async with asyncio.timeout(self._timeout):
            lock = await self._redis.get(_LEADER.lock)
        record = await self._leadership.current(_LEADER.scope)
        # The lock's value is `<holder>:<random lease suffix>`; the holder is `<instance>:<pid>`.
        leader = _text(lock).rsplit(":", 1)[0] if lock is not None else ""
        return cluster_pb2.GetSchedulerStatusResponse(
            has_leader=lock is not None,
            leader=leader,
            term=record.term if record else 0,
            leader_since_time=convert.timestamp(record.acquired_at) if record else None,
        )

    async def ListHandlers(
        self, request: cluster_pb2.ListHandlersRequest, context: Context
    ) -> cluster_pb2.ListHandlersResponse:
        workers = await self._live_workers()
        handlers = []
        for entry in self._handlers.describe():
            name = str(entry["name"])
            breakers = [
                cluster_pb2.Breaker(key=key, state=convert.breaker_state(state), worker_id=worker.message.id)
                for worker in workers
                for key, state in sorted(worker.breakers.items())
                if key == name or key.startswith(f"{name}:")
            ]
            fields = entry.get("fields")
            handlers.append(
                cluster_pb2.Handler(
                    name=name,
                    description=str(entry.get("description") or ""),
                    admin_only=bool(entry.get("admin_only")),
                    enabled=bool(entry.get("enabled")),
                    payload_fields=convert.list_value(fields if isinstance(fields, list) else []),
                    breakers=breakers,
                )
            )
        return cluster_pb2.ListHandlersResponse(handlers=handlers)
