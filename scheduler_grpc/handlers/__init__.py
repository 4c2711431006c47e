"""Job handlers: what a job's `handler` name runs. They know nothing of Redis, PostgreSQL or gRPC.

Built-ins: `http.webhook`, `shell.command` (admins, off by default), `system.cleanup`, and the
`test.*` handlers. More come from plugins in the entry point group `scheduler_grpc.handlers`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

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
    RateLimited,
    check_handler_name,
    load_plugins,
)
from scheduler_grpc.handlers.shell import ShellHandler
from scheduler_grpc.handlers.system import CleanupHandler
from scheduler_grpc.handlers.testing import (
    CrashHandler,
    DelayHandler,
    EchoHandler,
    FailHandler,
    LogHandler,
    ResultHandler,
)
from scheduler_grpc.handlers.webhook import WebhookHandler, webhook_breaker_key

BUILTIN_HANDLERS: tuple[type[Handler], ...] = (
    WebhookHandler,
    ShellHandler,
    CleanupHandler,
    EchoHandler,
    DelayHandler,
    LogHandler,
    FailHandler,
    CrashHandler,
    ResultHandler,
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


def breaker_key(handler: str, payload: Mapping[str, Any] | None) -> str:
    """The circuit breaker a run of `handler` with `payload` counts against, without a registry.

    A pure function (the queue item carries it from enqueue time, see `dispatch.queue_item`): the
    handler's name, or `http.webhook:<host>` per webhook target. A plugin that keys its breakers
    otherwise is checked by its name before the claim and by its own key when it runs.
    """
    if handler == WebhookHandler.name and payload is not None:
        return webhook_breaker_key(payload)
    return handler


def handler_of_breaker_key(key: str) -> str:
    """The handler name inside a breaker key (`http.webhook:host` -> `http.webhook`); handler names
    have no ':'."""
    return key.split(":", 1)[0]


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
    "RateLimited",
    "ResultHandler",
    "ShellHandler",
    "WebhookHandler",
    "breaker_key",
    "builtin_handlers",
    "check_handler_name",
    "default_registry",
    "handler_of_breaker_key",
    "load_plugins",
]
