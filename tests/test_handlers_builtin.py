"""test.* handlers and system.cleanup."""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import orjson
import pytest

from scheduler_grpc.errors import InvalidArgument
from scheduler_grpc.handlers import (
    CleanupHandler,
    CrashHandler,
    DelayHandler,
    EchoHandler,
    ExecutionContext,
    FailHandler,
    HandlerError,
    HandlerSettings,
    LogHandler,
    Maintenance,
    PermanentHandlerError,
)
from scheduler_grpc.handlers.testing import ResultHandler

DEV = HandlerSettings()
PRODUCTION = HandlerSettings(dev_mode=False)


def make_ctx(
    settings: HandlerSettings = DEV, *, attempt: int = 1, maintenance: Maintenance | None = None
) -> ExecutionContext:
    return ExecutionContext(
        execution_id="exec-1",
        job_id="job-1",
        job_name="test-job",
        attempt=attempt,
        scheduled_for=datetime(2025, 1, 1, tzinfo=UTC),
        timeout=timedelta(seconds=30),
        settings=settings,
        maintenance=maintenance,
        log=logging.LoggerAdapter(logging.getLogger("test.builtin"), {"job_id": "job-1"}),
    )


@dataclass
class RecordingMaintenance:
    """Our own Maintenance interface, recording calls instead of touching storage."""

    calls: list[tuple[str, datetime]] = field(default_factory=list)

    async def prune_executions(self, older_than: datetime) -> int:
        self.calls.append(("prune_executions", older_than))
        return 7

    async def trim_events(self, older_than: datetime) -> int:
        self.calls.append(("trim_events", older_than))
        return 11

    async def trim_dead_letters(self, older_than: datetime) -> int:
        self.calls.append(("trim_dead_letters", older_than))
        return 2


async def test_echo_returns_any_payload() -> None:
    handler = EchoHandler()
    payload = handler.validate({"a": 1, "nested": {"b": [True, None]}}, DEV)
    assert await handler.run(make_ctx(), payload) == {"echo": {"a": 1, "nested": {"b": [True, None]}}}
    assert await handler.run(make_ctx(), handler.validate({}, DEV)) == {"echo": {}}


async def test_delay_sleeps_and_is_cancellable() -> None:
    handler = DelayHandler()
    assert await handler.run(make_ctx(), handler.validate({"seconds": 0.01}, DEV)) == {"slept": 0.01}
    task = asyncio.ensure_future(handler.run(make_ctx(), handler.validate({"seconds": 3600}, DEV)))
    await asyncio.sleep(0)  # let it start sleeping
    started = time.monotonic()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert time.monotonic() - started < 1


async def test_log_writes_through_ctx_log(caplog: pytest.LogCaptureFixture) -> None:
    handler = LogHandler()
    with caplog.at_level(logging.DEBUG, logger="test.builtin"):
        result = await handler.run(make_ctx(), handler.validate({"message": "hello", "level": "warning"}, DEV))
    assert result == {"logged": "hello"}
    (record,) = [r for r in caplog.records if r.name == "test.builtin"]
    assert (record.levelname, record.getMessage(), record.job_id) == ("WARNING", "hello", "job-1")  # type: ignore[attr-defined]
    assert handler.validate({"message": "m"}, DEV) == {"message": "m", "level": "INFO"}


async def test_fail_fails_while_attempt_within_fail_attempts() -> None:
    handler = FailHandler()
    payload = handler.validate({"fail_attempts": 2, "message": "boom"}, DEV)
    for attempt in (1, 2):
        with pytest.raises(HandlerError, match=f"boom \\(attempt {attempt} of 2 failing\\)") as err:
            await handler.run(make_ctx(attempt=attempt), payload)
        assert not isinstance(err.value, PermanentHandlerError)
    assert await handler.run(make_ctx(attempt=3), payload) == {"attempt": 3, "failed_attempts": 2}
    forever = handler.validate({}, DEV)
    assert forever["fail_attempts"] == 1_000_000
    with pytest.raises(HandlerError):
        await handler.run(make_ctx(attempt=101), forever)
    assert await handler.run(make_ctx(), handler.validate({"fail_attempts": 0}, DEV)) == {
        "attempt": 1,
        "failed_attempts": 0,
    }


async def test_crash_refused_outside_dev_mode() -> None:
    handler = CrashHandler()
    with pytest.raises(InvalidArgument) as err:
        handler.validate({}, PRODUCTION)
    assert err.value.field == "handler"
    with pytest.raises(PermanentHandlerError, match="SCHEDULER_ENV=dev"):
        await handler.run(make_ctx(PRODUCTION), {})
    assert handler.validate({}, DEV) == {}


def test_crash_kills_its_own_process_in_dev_mode() -> None:
    script = textwrap.dedent(
        """
        import asyncio, logging
        from datetime import UTC, datetime, timedelta
        from scheduler_grpc.handlers.base import ExecutionContext, HandlerSettings
        from scheduler_grpc.handlers.testing import CrashHandler

        ctx = ExecutionContext("e", "j", "n", 1, datetime.now(UTC), timedelta(seconds=5),
                               HandlerSettings(dev_mode=True), None, logging.getLogger("crash"))
        print("before", flush=True)
        asyncio.run(CrashHandler().run(ctx, {}))
        print("survived", flush=True)
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=30, check=False)
    assert done.returncode == -9, done.stderr
    assert done.stdout == "before\n"


async def test_cleanup_calls_maintenance_with_the_retention() -> None:
    handler = CleanupHandler()
    maintenance = RecordingMaintenance()
    before = datetime.now(UTC)
    result = await handler.run(make_ctx(maintenance=maintenance), handler.validate({"retention_days": 7}, DEV))
    after = datetime.now(UTC)
    assert [name for name, _ in maintenance.calls] == ["prune_executions", "trim_events", "trim_dead_letters"]
    cutoffs = {cutoff for _, cutoff in maintenance.calls}
    assert len(cutoffs) == 1
    (cutoff,) = cutoffs
    assert before - timedelta(days=7) <= cutoff <= after - timedelta(days=7)
    assert result == {
        "retention_days": 7,
        "older_than": cutoff.isoformat(),
        "executions": 7,
        "events": 11,
        "dead_letters": 2,
    }
    assert handler.validate({}, DEV) == {"retention_days": 30}


async def test_cleanup_without_maintenance_is_permanent_failure() -> None:
    handler = CleanupHandler()
    with pytest.raises(PermanentHandlerError, match="maintenance"):
        await handler.run(make_ctx(), handler.validate({}, DEV))


@pytest.mark.parametrize(
    ("handler", "payload", "field"),
    [
        (CleanupHandler(), {"retention_days": 0}, "payload.retention_days"),
        (CleanupHandler(), {"retention_days": 3651}, "payload.retention_days"),
        (CleanupHandler(), {"retention_days": "30"}, "payload.retention_days"),
        (CleanupHandler(), {"retention_days": 1.5}, "payload.retention_days"),
        (DelayHandler(), {"seconds": -1}, "payload.seconds"),
        (DelayHandler(), {"seconds": 3601}, "payload.seconds"),
        (DelayHandler(), {"seconds": "1"}, "payload.seconds"),
        (LogHandler(), {}, "payload.message"),
        (LogHandler(), {"message": 3}, "payload.message"),
        (LogHandler(), {"message": "m", "level": "LOUD"}, "payload.level"),
        (FailHandler(), {"fail_attempts": -1}, "payload.fail_attempts"),
        (FailHandler(), {"fail_attempts": True}, "payload.fail_attempts"),
        (FailHandler(), {"message": ["x"]}, "payload.message"),
        (CrashHandler(), {"now": True}, "payload.now"),
    ],
)
def test_validation_errors_name_the_field(handler: Any, payload: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidArgument) as err:
        handler.validate(payload, DEV)
    assert err.value.field == field


async def test_result_returns_the_shapes_outputs_are_bounded_against_in_dev_mode_only() -> None:
    handler = ResultHandler()
    with pytest.raises(InvalidArgument) as err:
        handler.validate({"shape": "deep"}, PRODUCTION)
    assert err.value.field == "handler"
    with pytest.raises(InvalidArgument) as err:
        handler.validate({"shape": "round"}, DEV)
    assert err.value.field == "payload.shape"

    async def shaped(shape: str, size: int = 0) -> Any:
        return await handler.run(make_ctx(), handler.validate({"shape": shape, "size": size}, DEV))

    deep = await shaped("deep", 3)
    assert deep == {"d": {"d": {"d": {}}}}
    assert await shaped("large", 5) == {"text": "xxxxx"}
    assert "\x00" in (await shaped("nul"))["text"]
    with pytest.raises(orjson.JSONEncodeError):
        orjson.dumps(await shaped("surrogate"))
    with pytest.raises(orjson.JSONEncodeError):
        orjson.dumps(await shaped("set"))
    with pytest.raises(PermanentHandlerError, match="SCHEDULER_ENV=dev"):
        await handler.run(make_ctx(PRODUCTION), {"shape": "deep", "size": 1})
