"""The worker registry: which workers are alive, as their heartbeats tell. Owns the heartbeat format.

Each worker writes its facts every `HEARTBEAT_INTERVAL` (`beat`): one hash per worker that expires
after `HEARTBEAT_TTL`, plus an index ZSET of worker id -> last beat (ms) to list them without SCAN.
A worker that stops gracefully removes both (`unregister`). One killed without unregistering leaves
its index entry behind; its hash expires on its own, and every beat of any worker drops index
entries older than the TTL, so readers never write: `live_workers` only reads.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, Final

import orjson
from redis.asyncio import Redis

from scheduler_grpc.keys import WorkerKeys
from scheduler_grpc.scripts import text

HEARTBEAT_INTERVAL: Final = timedelta(seconds=5)
"""How often a worker beats."""
HEARTBEAT_TTL: Final = timedelta(seconds=30)
"""How long a worker counts as alive after its last beat."""
_KEYS: Final = WorkerKeys()
_DEFAULT_TIMEOUT: Final = timedelta(seconds=5)


@dataclass(frozen=True)
class WorkerInfo:
    """One worker's facts, as its last heartbeat reported them.

    Attributes:
        id: Unique id of the worker process.
        host: Host name.
        pid: Process id on that host.
        slots: Runs it executes at once.
        active: Runs executing at the last beat.
        queue: The queue it works on.
        handlers: Names of the handlers it can run.
        started_at: When it started (None if unreadable).
        last_beat: When it beat last (None if unreadable).
        breakers: `{breaker key: state}` of its circuit breakers.
        sdk: A remote worker's SDK and version (`scheduler-client-python/0.1.0`); "" in-process.
        remote: Served over a `WorkerService.Connect` stream (its host is the peer's, its pid 0).
    """

    id: str
    host: str = ""
    pid: int = 0
    slots: int = 0
    active: int = 0
    queue: str = ""
    handlers: Sequence[str] = ()
    started_at: datetime | None = None
    last_beat: datetime | None = None
    breakers: Mapping[str, str] = field(default_factory=dict)
    sdk: str = ""
    remote: bool = False


def _ms(moment: datetime) -> int:
    return int(moment.timestamp() * 1000)


async def beat(redis: Redis, worker: WorkerInfo, *, call_timeout: timedelta = _DEFAULT_TIMEOUT) -> None:
    """Record a heartbeat of `worker` (its `last_beat`, or now), and forget index entries gone stale.

    Raises:
        redis.exceptions.RedisError, OSError, TimeoutError: Redis did not take it within `call_timeout`.
    """
    at = worker.last_beat or datetime.now(UTC)
    now_ms = _ms(at)
    key = _KEYS.worker(worker.id)
    pipe = redis.pipeline(transaction=False)
    pipe.hset(key, mapping={
        "id": worker.id, "host": worker.host, "pid": worker.pid, "slots": worker.slots, "active": worker.active,
        "queue": worker.queue, "handlers": ",".join(worker.handlers),
        "started_at": worker.started_at.isoformat() if worker.started_at else "", "last_beat_ms": now_ms,
        "breakers": orjson.dumps(dict(worker.breakers)), "sdk": worker.sdk, "remote": int(worker.remote),
    })  # fmt: skip
    pipe.pexpire(key, int(HEARTBEAT_TTL.total_seconds() * 1000))
    # Entries of workers killed without unregistering (their hashes have expired by now); before our
    # own entry, which stays whatever its time.
    pipe.zremrangebyscore(_KEYS.index, "-inf", f"({_ms(datetime.now(UTC) - HEARTBEAT_TTL)}")
    pipe.zadd(_KEYS.index, {worker.id: now_ms})
    async with asyncio.timeout(call_timeout.total_seconds()):
        await pipe.execute()


async def unregister(redis: Redis, worker_id: str, *, call_timeout: timedelta = _DEFAULT_TIMEOUT) -> None:
    """Remove a worker from the registry (it is stopping).

    Raises:
        redis.exceptions.RedisError, OSError, TimeoutError: Redis did not take it within `call_timeout`.
    """
    pipe = redis.pipeline(transaction=False)
    pipe.delete(_KEYS.worker(worker_id))
    pipe.zrem(_KEYS.index, worker_id)
    async with asyncio.timeout(call_timeout.total_seconds()):
        await pipe.execute()


async def live_workers(redis: Redis, *, call_timeout: timedelta = _DEFAULT_TIMEOUT) -> list[WorkerInfo]:
    """The workers whose last beat is younger than `HEARTBEAT_TTL`, by id. Only reads.

    Raises:
        redis.exceptions.RedisError, OSError, TimeoutError: no answer within `call_timeout`.
    """
    oldest = _ms(datetime.now(UTC) - HEARTBEAT_TTL)
    async with asyncio.timeout(call_timeout.total_seconds()):
        ids = [text(worker_id) for worker_id in await redis.zrangebyscore(_KEYS.index, oldest, "+inf")]
        pipe = redis.pipeline(transaction=False)
        for worker_id in ids:
            pipe.hgetall(_KEYS.worker(worker_id))
        replies: list[Any] = await pipe.execute() if ids else []
    workers = [_decode(fields) for fields in replies if fields]
    fresh = [w for w in workers if w.last_beat is not None and _ms(w.last_beat) >= oldest]
    return sorted(fresh, key=lambda w: w.id)


def _int(value: str) -> int:
    try:
        return int(value)
    except ValueError:
        return 0


def _decode(fields: Mapping[Any, Any]) -> WorkerInfo:
    """A heartbeat hash as `WorkerInfo`; unreadable fields read as empty rather than failing the list."""
    facts = {text(key): text(value) for key, value in fields.items()}
    started = None
    if facts.get("started_at"):
        try:
            started = datetime.fromisoformat(facts["started_at"])
        except ValueError:
            started = None
    beat_ms = _int(facts.get("last_beat_ms", "0"))
    breakers: dict[str, str] = {}
    if facts.get("breakers"):
        try:
            decoded = orjson.loads(facts["breakers"])
            breakers = {str(key): str(value) for key, value in decoded.items()} if isinstance(decoded, dict) else {}
        except orjson.JSONDecodeError:
            breakers = {}
    return WorkerInfo(
        id=facts.get("id", ""),
        host=facts.get("host", ""),
        pid=_int(facts.get("pid", "0")),
        slots=_int(facts.get("slots", "0")),
        active=_int(facts.get("active", "0")),
        queue=facts.get("queue", ""),
        handlers=tuple(name for name in facts.get("handlers", "").split(",") if name),
        started_at=started,
        last_beat=datetime.fromtimestamp(beat_ms / 1000, UTC) if beat_ms else None,
        breakers=breakers,
        sdk=facts.get("sdk", ""),
        remote=facts.get("remote", "0") == "1",
    )
