"""The gRPC servicers: one thin module per `scheduler.v1` service.

Servicers translate messages to domain calls and back (`convert`) and raise domain errors; the
interceptors (`scheduler_grpc.interceptors`) authenticate, authorise, map errors to status codes,
log and measure every call in one place.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc
from scheduler_client.v1 import auth_pb2, cluster_pb2, executions_pb2, jobs_pb2, queue_pb2, users_pb2

from scheduler_grpc.auth import Authenticator
from scheduler_grpc.cluster import ClusterView
from scheduler_grpc.control import Control
from scheduler_grpc.events import EventFanout
from scheduler_grpc.handlers import HandlerRegistry
from scheduler_grpc.metrics import Metrics


@dataclass(frozen=True)
class Api:
    """What the servicers work with (built once per server process).

    Attributes:
        control: Jobs and runs.
        auth: Sessions, API keys, passwords.
        fanout: The execution event stream, shared by every WatchExecutions call.
        cluster: Live workers and the scheduler leader.
        handlers: The handler registry (validation, descriptions).
        metrics: Where calls are recorded.
    """

    control: Control
    auth: Authenticator
    fanout: EventFanout
    cluster: ClusterView
    handlers: HandlerRegistry
    metrics: Metrics


def add_services(server: grpc.aio.Server, api: Api) -> list[str]:
    """Register every `scheduler.v1` servicer on `server`; returns their full service names."""
    from scheduler_grpc.services.auth import AuthService
    from scheduler_grpc.services.cluster import ClusterService
    from scheduler_grpc.services.decode import register
    from scheduler_grpc.services.executions import ExecutionService
    from scheduler_grpc.services.jobs import JobService
    from scheduler_grpc.services.queue import QueueService
    from scheduler_grpc.services.users import UserService

    # Not the generated `add_*_to_server`: `register` adds the same handlers with deserializers that
    # answer a malformed request with INVALID_ARGUMENT instead of grpc.aio's UNKNOWN.
    register(server, auth_pb2.DESCRIPTOR.services_by_name["AuthService"], AuthService(api))
    register(server, jobs_pb2.DESCRIPTOR.services_by_name["JobService"], JobService(api))
    register(server, executions_pb2.DESCRIPTOR.services_by_name["ExecutionService"], ExecutionService(api))
    register(server, queue_pb2.DESCRIPTOR.services_by_name["QueueService"], QueueService(api))
    register(server, cluster_pb2.DESCRIPTOR.services_by_name["ClusterService"], ClusterService(api))
    register(server, users_pb2.DESCRIPTOR.services_by_name["UserService"], UserService(api))
    return list(SERVICE_NAMES)


SERVICE_NAMES = (
    "scheduler.v1.AuthService",
    "scheduler.v1.JobService",
    "scheduler.v1.ExecutionService",
    "scheduler.v1.QueueService",
    "scheduler.v1.ClusterService",
    "scheduler.v1.UserService",
)
