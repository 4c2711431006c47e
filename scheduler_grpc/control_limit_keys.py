"""Limit keys as operators see and steer them (issue 22): a key's state, pause and resume, the
busiest keys of a limit, and why a queued execution waits (`Control.limit_keys`).

Limit state lives in each queue (`queue.py`): jobs on two queues that name the same limit and key
are counted separately. So a key is read, paused and resumed on each queue the limit is used on
(the queues of the jobs that name it now), or on one queue the caller names; a read shows each
queue's state and the sums of running units and queued runs (admission and pauses stay per queue:
there is no single "next admission" of a key across queues, so none is made up).
"""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from typing import Final

from scheduler_grpc import stores
from scheduler_grpc.control_limits import LimitControl
from scheduler_grpc.db.limit_keys import LimitKeyQueries
from scheduler_grpc.dispatch import Queues
from scheduler_grpc.errors import FailedPrecondition, InvalidArgument, Unavailable
from scheduler_grpc.executions import BlockedBy, Execution, ExecutionStatus
from scheduler_grpc.limits import check_override_key
from scheduler_grpc.queue import KeyState, key_counts
from scheduler_grpc.rules import QUEUE_NAME_RULE, is_queue_name

log = logging.getLogger(__name__)

MAX_PAUSE: Final = timedelta(days=366)
BUSIEST_KEYS: Final = 5  # keys shown per limit on the console's Limits page


@dataclass(frozen=True)
class QueueKeyState:
    """One key's state on one queue."""

    queue: str
    state: KeyState


@dataclass(frozen=True)
class LimitKeyState:
    """One key of a limit on each queue it is read on (by queue name)."""

    limit: str
    key: str
    queues: list[QueueKeyState]

    @property
    def running(self) -> int:
        """Concurrency units held over every queue."""
        return sum(entry.state.running for entry in self.queues)

    @property
    def queued(self) -> int:
        """Runs waiting over every queue."""
        return sum(entry.state.queued for entry in self.queues)


@dataclass(frozen=True)
class BusyKey:
    """A key of a limit with work on one queue: units held, runs waiting."""

    queue: str
    key: str
    running: int
    queued: int


@dataclass(frozen=True)
class BusyKeys:
    """A limit's busiest keys (most held units, then most queued runs); `complete` is False when a
    queue had more keys than one bounded scan reads (the keys shown are then a sample's)."""

    keys: list[BusyKey]
    complete: bool


def _queue_name(queue: str | None) -> str | None:
    if not queue:
        return None
    if not is_queue_name(queue):
        raise InvalidArgument("queue", QUEUE_NAME_RULE)
    return queue


class LimitKeyControl:
    """Reads and pauses limit keys in the queues (see the module docstring).

    Args:
        limits: The definitions (an unknown limit is NotFound).
        queries: Where limits are used (PostgreSQL).
        queues: The queues, by name.
    """

    def __init__(self, limits: LimitControl, queries: LimitKeyQueries, queues: Queues) -> None:
        self._limits = limits
        self._queries = queries
        self._queues = queues
        self._warned = False

    async def _queues_of(self, limit: str, key: str, queue: str | None) -> list[str]:
        check_override_key(key, "key")
        queue = _queue_name(queue)
        await self._limits.get_limit_by_name(limit)  # NotFound for an unknown limit
        if queue is not None:
            return [queue]
        return (await self._queries.queues_of_limits([limit])).get(limit, [])

    async def _read(self, limit: str, key: str, queues: Sequence[str]) -> LimitKeyState:
        states = await asyncio.gather(*(self._queues.get(name).key_state(limit, key) for name in queues))
        return LimitKeyState(
            limit, key, [QueueKeyState(name, state) for name, state in zip(queues, states, strict=True)]
        )

    async def key_state(self, limit: str, key: str, *, queue: str | None = None) -> LimitKeyState:
        """One key's state on `queue`, or on every queue the limit is used on.

        Raises:
            InvalidArgument: naming `key` or `queue`.
            NotFound: no limit has this name.
        """
        return await self._read(limit, key, await self._queues_of(limit, key, queue))

    async def pause_key(
        self,
        limit: str,
        key: str,
        *,
        duration: timedelta | None = None,
        until: datetime | None = None,
        queue: str | None = None,
    ) -> LimitKeyState:
        """Pause a key for `duration` or until `until` (exactly one), on `queue` or on every queue
        the limit is used on; returns its state after.

        Raises:
            InvalidArgument: naming `key`, `queue`, `duration` or `pause_end_time`.
            NotFound: no limit has this name.
            FailedPrecondition: no job names the limit and no queue is given.
        """
        if (duration is None) == (until is None):
            raise InvalidArgument("duration", "give either a duration or a pause_end_time")
        if until is not None:
            if until.tzinfo is None:
                raise InvalidArgument("pause_end_time", "must carry a time zone")
            duration = until - datetime.now(UTC)
            field = "pause_end_time"
            if duration <= timedelta(0):
                raise InvalidArgument(field, "must be in the future")
        else:
            field = "duration"
        assert duration is not None
        if duration < timedelta(milliseconds=1):
            raise InvalidArgument(field, "must be at least 1 ms")
        if duration > MAX_PAUSE:
            raise InvalidArgument(field, "a pause lasts at most 366 days")
        queues = await self._queues_of(limit, key, queue)
        if not queues:
            raise FailedPrecondition(f"no job names limit {limit!r}: name the queue to pause the key on")
        await asyncio.gather(*(self._queues.get(name).pause_key(limit, key, duration) for name in queues))
        return await self._read(limit, key, queues)

    async def resume_key(self, limit: str, key: str, *, queue: str | None = None) -> LimitKeyState:
        """End a key's pause on `queue`, or on every queue the limit is used on; its state after.

        Raises:
            InvalidArgument: naming `key` or `queue`.
            NotFound: no limit has this name.
        """
        queues = await self._queues_of(limit, key, queue)
        await asyncio.gather(*(self._queues.get(name).resume_key(limit, key) for name in queues))
        return await self._read(limit, key, queues)

    async def busiest_keys(self, limits: Sequence[str], count: int = BUSIEST_KEYS) -> dict[str, BusyKeys]:
        """Per limit name, its `count` busiest keys over the queues it is used on (one bounded
        scan of each queue's per-key counters, shared by every limit)."""
        used = await self._queries.queues_of_limits(limits)
        by_queue: dict[str, list[str]] = defaultdict(list)
        for name, queues in used.items():
            for queue in queues:
                by_queue[queue].append(name)
        names = list(by_queue)
        reads = await asyncio.gather(*(key_counts(self._queues.get(q), by_queue[q]) for q in names))
        found: dict[str, list[BusyKey]] = defaultdict(list)
        complete: dict[str, bool] = {}
        for queue, read in zip(names, reads, strict=True):
            for name in by_queue[queue]:
                complete[name] = complete.get(name, True) and read.complete
            for (name, key), (held, queued) in read.counts.items():
                found[name].append(BusyKey(queue, key, held, queued))
        return {
            name: BusyKeys(
                sorted(found[name], key=lambda k: (-k.running, -k.queued, k.key, k.queue))[:count],
                complete.get(name, True),
            )
            for name in limits
        }

    async def with_blocked_by(self, executions: Sequence[Execution]) -> list[Execution]:
        """`executions` with `blocked_by` set on the queued ones a limit key holds back: one
        PostgreSQL read (their queues) and one Redis call per queue, for the whole list.

        A store that fails leaves `blocked_by` unset (logged once): why a run waits is a hint, the
        read it decorates must not fail for it.
        """
        queued = [e.id for e in executions if e.status is ExecutionStatus.QUEUED]
        if not queued:
            return list(executions)
        try:
            queues = await self._queries.queues_of_queued_runs(queued)
            runs_by_queue: dict[str, list[str]] = defaultdict(list)
            run_of = {e.id: e.run_id for e in executions}
            for execution_id, queue in queues.items():
                runs_by_queue[queue].append(run_of[execution_id])
            names = list(runs_by_queue)
            replies = await asyncio.gather(*(self._queues.get(q).blocked_by(runs_by_queue[q]) for q in names))
        except Exception as exc:
            if not isinstance(exc, Unavailable) and stores.store_of(exc) is None:
                raise
            if not self._warned:
                self._warned = True
                log.warning("why queued runs wait could not be read; shown without it", exc_info=True)
            return list(executions)
        blocked = {run_id: why for reply in replies for run_id, why in reply.items()}
        return [
            replace(e, blocked_by=BlockedBy(why.limit, why.key, why.since, why.kind))
            if e.status is ExecutionStatus.QUEUED and (why := blocked.get(e.run_id)) is not None
            else e
            for e in executions
        ]
