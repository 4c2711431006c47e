"""The gRPC servicers: one thin module per `scheduler.v1` service.

Servicers translate messages to domain calls and back (`convert`) and raise domain errors; the
interceptors (`scheduler_grpc.interceptors`) authenticate, authorise, map errors to status codes,
log and measure every call in one place.
"""

from __future__ import annotations

import grpc
from scheduler_client.v1 import (
    auth_pb2,
    cluster_pb2,
    executions_pb2,
    jobs_pb2,
    limits_pb2,
    queue_pb2,
    users_pb2,
    workers_pb2,
)

from scheduler_grpc.application import Api


def add_services(server: grpc.aio.Server, api: Api) -> list[str]:
    """Register every `scheduler.v1` servicer on `server`; returns their full service names."""
    from scheduler_grpc.services.auth import AuthService
    from scheduler_grpc.services.cluster import ClusterService
    from scheduler_grpc.services.decode import register
    from scheduler_grpc.services.executions import ExecutionService
    from scheduler_grpc.services.jobs import JobService
    from scheduler_grpc.services.limits import LimitService
    from scheduler_grpc.services.queue import QueueService
    from scheduler_grpc.services.users import UserService
    from scheduler_grpc.services.workers_unary import UnaryWorkerService

    # Not the generated `add_*_to_server`: `register` adds the same handlers with deserializers that
    # answer a malformed request with INVALID_ARGUMENT instead of grpc.aio's UNKNOWN.
    register(server, auth_pb2.DESCRIPTOR.services_by_name["AuthService"], AuthService(api))
    register(server, jobs_pb2.DESCRIPTOR.services_by_name["JobService"], JobService(api))
    register(server, executions_pb2.DESCRIPTOR.services_by_name["ExecutionService"], ExecutionService(api))
    register(server, queue_pb2.DESCRIPTOR.services_by_name["QueueService"], QueueService(api))
    register(server, cluster_pb2.DESCRIPTOR.services_by_name["ClusterService"], ClusterService(api))
    register(server, users_pb2.DESCRIPTOR.services_by_name["UserService"], UserService(api))
    register(server, limits_pb2.DESCRIPTOR.services_by_name["LimitService"], LimitService(api))
    register(server, workers_pb2.DESCRIPTOR.services_by_name["WorkerService"], UnaryWorkerService(api))
    return list(SERVICE_NAMES)


SERVICE_NAMES = (
    "scheduler.v1.AuthService",
    "scheduler.v1.JobService",
    "scheduler.v1.ExecutionService",
    "scheduler.v1.QueueService",
    "scheduler.v1.ClusterService",
    "scheduler.v1.UserService",
    "scheduler.v1.LimitService",
    "scheduler.v1.WorkerService",
)
