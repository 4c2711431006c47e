"""ClusterService: live workers, the scheduler leader, handlers and their circuit breakers."""

from __future__ import annotations

from typing import Any

import grpc
from scheduler_client.v1 import cluster_pb2, cluster_pb2_grpc

from scheduler_grpc.application import Api
from scheduler_grpc.registry import WorkerInfo
from scheduler_grpc.services import convert

Context = grpc.aio.ServicerContext[Any, Any]


def _message(worker: WorkerInfo) -> cluster_pb2.Worker:
    return cluster_pb2.Worker(
        id=worker.id,
        host=worker.host,
        pid=worker.pid,
        slots=worker.slots,
        active=worker.active,
        queue=worker.queue,
        handlers=list(worker.handlers),
        start_time=convert.timestamp(worker.started_at),
        heartbeat_time=convert.timestamp(worker.last_beat),
        sdk=worker.sdk,
        remote=worker.remote,
    )


class ClusterService(cluster_pb2_grpc.ClusterServiceServicer):
    """What runs where (the rights are in `auth.METHOD_ROLES`)."""

    def __init__(self, api: Api) -> None:
        self._cluster = api.cluster
        self._handlers = api.handlers

    async def ListWorkers(
        self, request: cluster_pb2.ListWorkersRequest, context: Context
    ) -> cluster_pb2.ListWorkersResponse:
        return cluster_pb2.ListWorkersResponse(workers=[_message(w) for w in await self._cluster.workers()])

    async def GetSchedulerStatus(
        self, request: cluster_pb2.GetSchedulerStatusRequest, context: Context
    ) -> cluster_pb2.GetSchedulerStatusResponse:
        status = await self._cluster.leader()
        return cluster_pb2.GetSchedulerStatusResponse(
            has_leader=status.holder is not None,
            leader=status.holder or "",
            term=status.term,
            leader_since_time=convert.timestamp(status.since),
        )

    async def ListHandlers(
        self, request: cluster_pb2.ListHandlersRequest, context: Context
    ) -> cluster_pb2.ListHandlersResponse:
        workers = await self._cluster.workers()
        handlers = []
        for entry in self._handlers.describe():
            name = str(entry["name"])
            breakers = [
                cluster_pb2.Breaker(key=key, state=convert.breaker_state(state), worker_id=worker.id)
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
