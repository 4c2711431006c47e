"""scheduler-grpc: a distributed, cron-capable job scheduler with a gRPC control plane.

What a program embedding the scheduler uses, importable from the package itself::

    from scheduler_grpc import JobSpec, ScheduleKind, open_control

    async with open_control() as control:  # REDIS_URL and DATABASE_URL from the environment
        spec = JobSpec(name="tick", handler="test.echo", schedule_kind=ScheduleKind.CRON, cron="*/5 * * * *")
        job = await control.create_job(spec)

Everything else is internal and may change. The names load on first use (PEP 562), so importing the
package, as every `scheduler-grpc` command does, does not import Redis, asyncpg or the handlers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from scheduler_grpc.config import Settings
    from scheduler_grpc.config import load as load_settings
    from scheduler_grpc.connections import connect, redis_client
    from scheduler_grpc.control import Control
    from scheduler_grpc.db.executions import Queued
    from scheduler_grpc.db.pool import create_pool
    from scheduler_grpc.embed import open_control
    from scheduler_grpc.errors import (
        Aborted,
        AlreadyExists,
        ConfigError,
        FailedPrecondition,
        Fenced,
        InvalidArgument,
        LeaseLost,
        NotFound,
        SchedulerError,
        Unavailable,
    )
    from scheduler_grpc.executions import Execution, ExecutionStatus, Trigger
    from scheduler_grpc.handlers import (
        ExecutionContext,
        Handler,
        HandlerError,
        HandlerRegistry,
        HandlerSettings,
        PermanentHandlerError,
        default_registry,
    )
    from scheduler_grpc.jobs import ConcurrencyPolicy, Job, JobSpec, JobStatus, MisfirePolicy, RetryPolicy, ScheduleKind
    from scheduler_grpc.schedule import FoldPolicy, GapPolicy

# Public name -> (module, attribute in it).
_EXPORTS: dict[str, tuple[str, str]] = {
    "open_control": ("scheduler_grpc.embed", "open_control"),
    "Settings": ("scheduler_grpc.config", "Settings"),
    "load_settings": ("scheduler_grpc.config", "load"),
    "connect": ("scheduler_grpc.connections", "connect"),
    "redis_client": ("scheduler_grpc.connections", "redis_client"),
    "create_pool": ("scheduler_grpc.db.pool", "create_pool"),
    "Control": ("scheduler_grpc.control", "Control"),
    "Queued": ("scheduler_grpc.db.executions", "Queued"),
    **{name: ("scheduler_grpc.jobs", name) for name in (
        "Job", "JobSpec", "JobStatus", "RetryPolicy", "ScheduleKind", "MisfirePolicy", "ConcurrencyPolicy",
    )},
    **{name: ("scheduler_grpc.schedule", name) for name in ("FoldPolicy", "GapPolicy")},
    **{name: ("scheduler_grpc.executions", name) for name in ("Execution", "ExecutionStatus", "Trigger")},
    **{name: ("scheduler_grpc.handlers", name) for name in (
        "Handler", "HandlerRegistry", "HandlerSettings", "ExecutionContext", "HandlerError", "PermanentHandlerError",
        "default_registry",
    )},
    **{name: ("scheduler_grpc.errors", name) for name in (
        "SchedulerError", "ConfigError", "InvalidArgument", "NotFound", "AlreadyExists", "FailedPrecondition",
        "Aborted", "Unavailable", "Fenced", "LeaseLost",
    )},
}  # fmt: skip

__all__ = [
    "Aborted",
    "AlreadyExists",
    "ConcurrencyPolicy",
    "ConfigError",
    "Control",
    "Execution",
    "ExecutionContext",
    "ExecutionStatus",
    "FailedPrecondition",
    "Fenced",
    "FoldPolicy",
    "GapPolicy",
    "Handler",
    "HandlerError",
    "HandlerRegistry",
    "HandlerSettings",
    "InvalidArgument",
    "Job",
    "JobSpec",
    "JobStatus",
    "LeaseLost",
    "MisfirePolicy",
    "NotFound",
    "PermanentHandlerError",
    "Queued",
    "RetryPolicy",
    "ScheduleKind",
    "SchedulerError",
    "Settings",
    "Trigger",
    "Unavailable",
    "__version__",
    "connect",
    "create_pool",
    "default_registry",
    "load_settings",
    "open_control",
    "redis_client",
]


def __getattr__(name: str) -> Any:
    try:
        module, attr = _EXPORTS[name]
    except KeyError:
        raise AttributeError(f"module 'scheduler_grpc' has no attribute {name!r}") from None
    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value  # once loaded, a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
