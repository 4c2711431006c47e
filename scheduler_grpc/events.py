"""Execution events: every lifecycle transition is appended to one capped Redis Stream.

Writers add events in the same pipeline as the queue change they describe; gRPC servers read the
stream (one reader per process) and fan it out to subscribers, who resume from the last stream id
they saw. The stream is capped (approximately, `MAXLEN ~`) so it cannot grow without bound.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.client import Pipeline

from scheduler_grpc.keys import EventKeys

STREAM_MAX_LENGTH = 100_000
_KEYS = EventKeys()


class EventType(enum.StrEnum):
    CREATED = "created"
    STARTED = "started"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    TIMED_OUT = "timed_out"
    RETRYING = "retrying"
    DEAD = "dead"
    CANCELLED = "cancelled"
    ABANDONED = "abandoned"
    SKIPPED = "skipped"
    MISSED = "missed"


@dataclass(frozen=True)
class ExecutionEvent:
    """One transition of one execution."""

    type: EventType
    execution_id: str
    run_id: str
    job_id: str
    attempt: int
    handler: str = ""
    worker_id: str = ""
    error: str = ""
    time: datetime | None = None
    cursor: str = ""  # the stream id, set when read back

    def fields(self) -> dict[str, str]:
        return {
            "type": self.type.value,
            "execution_id": self.execution_id,
            "run_id": self.run_id,
            "job_id": self.job_id,
            "attempt": str(self.attempt),
            "handler": self.handler,
            "worker_id": self.worker_id,
            "error": self.error[:500],
            "time": (self.time or datetime.now(UTC)).isoformat(),
        }

    @classmethod
    def from_fields(cls, cursor: str, fields: Mapping[Any, Any]) -> ExecutionEvent:
        text = {(k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
                for k, v in fields.items()}  # fmt: skip
        return cls(
            type=EventType(text["type"]),
            execution_id=text["execution_id"],
            run_id=text["run_id"],
            job_id=text["job_id"],
            attempt=int(text["attempt"]),
            handler=text.get("handler", ""),
            worker_id=text.get("worker_id", ""),
            error=text.get("error", ""),
            time=datetime.fromisoformat(text["time"]),
            cursor=cursor,
        )


def add_events(pipe: Pipeline, events: Iterable[ExecutionEvent]) -> None:
    """Queue XADDs on a pipeline (so they travel with the queue change they describe)."""
    for event in events:
        pipe.xadd(_KEYS.stream, event.fields(), maxlen=STREAM_MAX_LENGTH, approximate=True)  # type: ignore[arg-type]


async def publish(redis: Redis, events: Iterable[ExecutionEvent]) -> None:
    """Append events in one round trip."""
    pipe = redis.pipeline(transaction=False)
    add_events(pipe, events)
    await pipe.execute()


async def read_after(redis: Redis, cursor: str = "0-0", count: int = 1000) -> list[ExecutionEvent]:
    """Events after `cursor` (a stream id), oldest first (tests, resumption)."""
    reply = await redis.xrange(_KEYS.stream, min=f"({cursor}" if cursor != "0-0" else "-", count=count)
    return [
        ExecutionEvent.from_fields(entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id), fields or {})
        for entry_id, fields in reply or []
    ]


async def trim_before(redis: Redis, older_than: datetime) -> int:
    """Drop events older than `older_than` (system.cleanup); stream ids start with ms since the epoch."""
    minimum = f"{int(older_than.timestamp() * 1000)}-0"
    trimmed: int = await redis.xtrim(_KEYS.stream, minid=minimum, approximate=False)
    return trimmed
