"""`test.*` handlers: deterministic behaviours for exercising the engine (retries, timeouts, crashes)."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import Mapping
from typing import Any, ClassVar

from scheduler_grpc.handlers.base import (
    ExecutionContext,
    Field,
    Handler,
    HandlerError,
    HandlerSettings,
    JSONValue,
    PermanentHandlerError,
    get_int,
    get_number,
    get_str,
    payload_error,
    require_str,
)

LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
CRASH_DISABLED = "test.crash kills its worker and runs only with SCHEDULER_ENV=dev"


class EchoHandler(Handler):
    """Returns its payload: `{"echo": payload}`, and in a flow run its upstream jobs' results as
    `{"echo": payload, "upstream": {job name: result}}`. Accepts any fields."""

    name: ClassVar[str] = "test.echo"
    description: ClassVar[str] = "Return the payload as the result (any fields)"
    extra_fields: ClassVar[bool] = True

    async def run(self, ctx: ExecutionContext, payload: dict[str, Any]) -> JSONValue:
        if ctx.upstream_results:
            return {"echo": payload, "upstream": dict(ctx.upstream_results)}
        return {"echo": payload}


class DelayHandler(Handler):
    """Sleeps (cancellably) for `seconds`."""

    name: ClassVar[str] = "test.delay"
    description: ClassVar[str] = "Sleep for a number of seconds, then succeed"
    fields: ClassVar[tuple[Field, ...]] = (Field("seconds", "number", "how long to sleep, 0-3600", required=True),)

    def normalize(self, payload: Mapping[str, Any], settings: HandlerSettings) -> dict[str, Any]:
        return {"seconds": get_number(payload, "seconds", default=None, minimum=0, maximum=3600)}

    async def run(self, ctx: ExecutionContext, payload: dict[str, Any]) -> JSONValue:
        seconds = float(payload["seconds"])
        await asyncio.sleep(seconds)
        return {"slept": seconds}


class LogHandler(Handler):
    """Writes `message` to the execution's log at `level`."""

    name: ClassVar[str] = "test.log"
    description: ClassVar[str] = "Log a message through the worker's log"
    fields: ClassVar[tuple[Field, ...]] = (
        Field("message", "string", "the text to log (at most 8192 characters)", required=True),
        Field("level", "string", f"one of {', '.join(LEVELS)}", default="INFO"),
    )

    def normalize(self, payload: Mapping[str, Any], settings: HandlerSettings) -> dict[str, Any]:
        message = require_str(payload, "message", max_length=8192)
        level = (get_str(payload, "level", default="INFO") or "INFO").upper()
        if level not in LEVELS:
            raise payload_error("level", f"must be one of {', '.join(LEVELS)}, got {payload['level']!r}")
        return {"message": message, "level": level}

    async def run(self, ctx: ExecutionContext, payload: dict[str, Any]) -> JSONValue:
        message = str(payload["message"])
        ctx.log.log(logging.getLevelName(payload.get("level", "INFO")), message, extra={"handler": self.name})
        return {"logged": message}


class FailHandler(Handler):
    """Fails while `ctx.attempt <= fail_attempts`, then succeeds."""

    name: ClassVar[str] = "test.fail"
    description: ClassVar[str] = "Fail the first fail_attempts attempts (default: all of them)"
    fields: ClassVar[tuple[Field, ...]] = (
        Field("fail_attempts", "integer", "attempts that fail (1-based; 0 never fails)", default=1_000_000),
        Field("message", "string", "the error message", default="test.fail: failing on purpose"),
    )

    def normalize(self, payload: Mapping[str, Any], settings: HandlerSettings) -> dict[str, Any]:
        return {
            "fail_attempts": get_int(payload, "fail_attempts", default=1_000_000, minimum=0, maximum=1_000_000),
            "message": get_str(payload, "message", default="test.fail: failing on purpose", max_length=4096),
        }

    async def run(self, ctx: ExecutionContext, payload: dict[str, Any]) -> JSONValue:
        fail_attempts = int(payload.get("fail_attempts", 1_000_000))
        if ctx.attempt <= fail_attempts:
            message = str(payload.get("message") or "test.fail: failing on purpose")
            raise HandlerError(f"{message} (attempt {ctx.attempt} of {fail_attempts} failing)")
        return {"attempt": ctx.attempt, "failed_attempts": fail_attempts}


class CrashHandler(Handler):
    """Kills its own worker process with SIGKILL (dev mode only): for testing stalled leases."""

    name: ClassVar[str] = "test.crash"
    description: ClassVar[str] = "SIGKILL the worker running it (dev mode only)"

    def disabled_reason(self, settings: HandlerSettings) -> str | None:
        return None if settings.dev_mode else CRASH_DISABLED

    async def run(self, ctx: ExecutionContext, payload: dict[str, Any]) -> JSONValue:
        if not ctx.settings.dev_mode:
            raise PermanentHandlerError(CRASH_DISABLED)
        ctx.log.warning("test.crash: killing worker process %d", os.getpid())
        os.kill(os.getpid(), signal.SIGKILL)
        await asyncio.sleep(3600)  # not reached: SIGKILL is delivered at once
        raise PermanentHandlerError("test.crash: the worker survived SIGKILL")


RESULT_DISABLED = "test.result returns results the service must refuse and runs only with SCHEDULER_ENV=dev"
RESULT_SHAPES = ("deep", "large", "nul", "surrogate", "set")


class ResultHandler(Handler):
    """Returns a result of a given shape (dev mode only): for testing how outputs are bounded.

    `shape`: `deep` (`size` objects nested in each other), `large` (a string of `size` characters),
    `nul` (a string holding a NUL character, which PostgreSQL's jsonb refuses), `surrogate` (a lone
    UTF-16 surrogate, which JSON cannot encode) or `set` (a Python set: not a JSON value at all).
    """

    name: ClassVar[str] = "test.result"
    description: ClassVar[str] = "Return a result of a given shape: deep, large, nul, surrogate, set (dev mode only)"
    fields: ClassVar[tuple[Field, ...]] = (
        Field("shape", "string", f"one of {', '.join(RESULT_SHAPES)}", required=True),
        Field("size", "integer", "nesting (deep) or characters (large), 0-1000000", default=0),
    )

    def disabled_reason(self, settings: HandlerSettings) -> str | None:
        return None if settings.dev_mode else RESULT_DISABLED

    def normalize(self, payload: Mapping[str, Any], settings: HandlerSettings) -> dict[str, Any]:
        shape = require_str(payload, "shape")
        if shape not in RESULT_SHAPES:
            raise payload_error("shape", f"must be one of {', '.join(RESULT_SHAPES)}, got {shape!r}")
        return {"shape": shape, "size": get_int(payload, "size", default=0, minimum=0, maximum=1_000_000)}

    async def run(self, ctx: ExecutionContext, payload: dict[str, Any]) -> JSONValue:
        if not ctx.settings.dev_mode:
            raise PermanentHandlerError(RESULT_DISABLED)
        shape, size = str(payload["shape"]), int(payload.get("size", 0))
        if shape == "deep":
            value: JSONValue = {}
            for _ in range(size):
                value = {"d": value}
            return value
        if shape == "large":
            return {"text": "x" * size}
        if shape == "nul":
            return {"text": "before\x00after"}
        if shape == "surrogate":
            return {"text": "\ud800"}
        unencodable: Any = {"set": {1, 2, 3}}  # on purpose: what a careless handler returns
        return unencodable  # type: ignore[no-any-return]
