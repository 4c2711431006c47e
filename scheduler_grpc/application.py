"""The application layer as the server's front ends get it: `Api`, built once per server process.

The gRPC servicers (`services/`) and the web console (`console/`) are two doors onto the same
objects: `Control` for jobs, runs, flows and queues; the `Authenticator` for sessions and API keys;
the `EventFanout` for the live event stream; the `ClusterView` for workers and the leader; and the
server's `StoreHealth`. Neither door reaches PostgreSQL or Redis but through these
(`tests/test_layout.py` checks it on the imports).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from scheduler_grpc.auth import Authenticator
from scheduler_grpc.cluster import ClusterView, serves
from scheduler_grpc.control import Control
from scheduler_grpc.events import EventFanout
from scheduler_grpc.handlers import HandlerRegistry
from scheduler_grpc.jobs import Job
from scheduler_grpc.metrics import Metrics
from scheduler_grpc.remote import RemoteWorkers


@dataclass
class StoreHealth:
    """Whether Redis and PostgreSQL answered the server's last health check (`server.HealthMonitor`,
    about every second); the console's outage banner shows it. Both are taken as up until checked."""

    redis_up: bool = True
    postgres_up: bool = True


@dataclass(frozen=True)
class Api:
    """What the servicers and the console work with (built once per server process).

    Attributes:
        control: Jobs, runs, flows and queues.
        auth: Sessions, API keys, passwords.
        fanout: The execution event stream, shared by every WatchExecutions call and live page.
        cluster: Live workers and the scheduler leader.
        handlers: The handler registry (validation, descriptions).
        metrics: Where calls are recorded.
        health: The stores' health as the server last checked it.
        remote: The remote workers' sessions (`WorkerService.Connect`); None where not served.
    """

    control: Control
    auth: Authenticator
    fanout: EventFanout
    cluster: ClusterView
    handlers: HandlerRegistry
    metrics: Metrics
    health: StoreHealth
    remote: RemoteWorkers | None = None

    async def handlers_served(self, jobs: Sequence[Job]) -> list[bool]:
        """Whether something serves each job's handler now: it is the server's (`handlers`), or a
        live remote worker serves it on the job's queue (the workers' heartbeats, read only when a
        job names a handler the server does not know)."""
        remote = any(job.handler not in self.handlers for job in jobs)
        workers = await self.cluster.workers() if remote else []
        return [job.handler in self.handlers or serves(workers, job.handler, job.queue) for job in jobs]
