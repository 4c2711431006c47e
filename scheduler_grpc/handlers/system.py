"""`system.cleanup`: housekeeping of history, events and dead letters older than a retention."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from typing import Any, ClassVar

from scheduler_grpc.handlers.base import (
    ExecutionContext,
    Field,
    Handler,
    HandlerSettings,
    JSONValue,
    PermanentHandlerError,
    get_int,
)

DEFAULT_RETENTION_DAYS = 30


class CleanupHandler(Handler):
    """Drops execution history, stream events and dead letters older than `retention_days` (the history
    by whole UTC days: a day is dropped once it ends before the cut-off, unless it holds an open run)."""

    name: ClassVar[str] = "system.cleanup"
    description: ClassVar[str] = "Prune execution history, events and dead letters older than a retention"
    fields: ClassVar[tuple[Field, ...]] = (
        Field(
            "retention_days",
            "integer",
            "keep this many days (1-3650)",
            default=DEFAULT_RETENTION_DAYS,
        ),
    )

    def normalize(self, payload: Mapping[str, Any], settings: HandlerSettings) -> dict[str, Any]:
        days = get_int(payload, "retention_days", default=DEFAULT_RETENTION_DAYS, minimum=1, maximum=3650)
        return {"retention_days": days}

    async def run(self, ctx: ExecutionContext, payload: dict[str, Any]) -> JSONValue:
        if ctx.maintenance is None:
            raise PermanentHandlerError("system.cleanup needs a worker that offers maintenance operations")
        days = int(payload.get("retention_days", DEFAULT_RETENTION_DAYS))
        older_than = datetime.now(UTC) - timedelta(days=days)
        executions = await ctx.maintenance.prune_executions(older_than)
        events = await ctx.maintenance.trim_events(older_than)
        dead_letters = await ctx.maintenance.trim_dead_letters(older_than)
        ctx.log.info(
            "cleanup removed %d executions, %d events, %d dead letters older than %s",
            executions,
            events,
            dead_letters,
            older_than.isoformat(),
        )
        return {
            "retention_days": days,
            "older_than": older_than.isoformat(),
            "executions": executions,
            "events": events,
            "dead_letters": dead_letters,
        }
