"""Job handlers: what a job's `handler` name runs. They know nothing of Redis, PostgreSQL or gRPC.

Built-ins: `http.webhook`, `shell.command` (admins, off by default), `system.cleanup`, and the
`test.*` handlers. More come from plugins in the entry point group `scheduler_grpc.handlers`.
"""

from __future__ import annotations

from collections.abc import Iterable

from scheduler_grpc.handlers.base import (
    ENTRY_POINT_GROUP,
    MAX_PAYLOAD_BYTES,
    EntryPointLike,
    ExecutionContext,
    Field,
    Handler,
    HandlerError,
    HandlerRegistry,
    HandlerSettings,
    JSONValue,
    Maintenance,
    PermanentHandlerError,
    load_plugins,
)
from scheduler_grpc.handlers.shell import ShellHandler
from scheduler_grpc.handlers.system import CleanupHandler
from scheduler_grpc.handlers.testing import CrashHandler, DelayHandler, EchoHandler, FailHandler, LogHandler
from scheduler_grpc.handlers.webhook import WebhookHandler

BUILTIN_HANDLERS: tuple[type[Handler], ...] = (
    WebhookHandler,
    ShellHandler,
    CleanupHandler,
    EchoHandler,
    DelayHandler,
    LogHandler,
    FailHandler,
    CrashHandler,
)


def builtin_handlers() -> list[Handler]:
    """A fresh instance of every built-in handler."""
    return [cls() for cls in BUILTIN_HANDLERS]


def default_registry(
    settings: HandlerSettings,
    *,
    plugins: bool = True,
    entry_points: Iterable[EntryPointLike] | None = None,
) -> HandlerRegistry:
    """The built-ins plus the installed plugins; a plugin whose name is taken is logged and skipped.

    Args:
        settings: handler settings of this process.
        plugins: load entry-point plugins.
        entry_points: plugins to load instead of the installed ones (tests).
    """
    registry = HandlerRegistry(settings, builtin_handlers())
    if plugins:
        for handler in load_plugins(entry_points, taken=registry.names()):
            registry.register(handler)
    return registry


__all__ = [
    "BUILTIN_HANDLERS",
    "ENTRY_POINT_GROUP",
    "MAX_PAYLOAD_BYTES",
    "CleanupHandler",
    "CrashHandler",
    "DelayHandler",
    "EchoHandler",
    "EntryPointLike",
    "ExecutionContext",
    "FailHandler",
    "Field",
    "Handler",
    "HandlerError",
    "HandlerRegistry",
    "HandlerSettings",
    "JSONValue",
    "LogHandler",
    "Maintenance",
    "PermanentHandlerError",
    "ShellHandler",
    "WebhookHandler",
    "builtin_handlers",
    "default_registry",
    "load_plugins",
]
