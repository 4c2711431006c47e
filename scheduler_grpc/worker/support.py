"""What the worker's stages share: settings as constants, the shared state, store-error handling,
the event outbox and the maintenance a `system.cleanup` run may do."""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import math
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

from redis.asyncio import Redis

from scheduler_grpc import events, metrics, stores
from scheduler_grpc.breakers import Breakers
from scheduler_grpc.config import Settings
from scheduler_grpc.db.executions import Claim
from scheduler_grpc.events import EventType
from scheduler_grpc.ports import EventBus, HistoryPruning, RunStore, WorkQueue
from scheduler_grpc.worker.attempt import Attempt
from scheduler_grpc.worker.lifecycle import RunTracker, State

log = logging.getLogger("scheduler_grpc.worker")

FETCH_WAIT = timedelta(seconds=2)
COMPLETION_BATCH = 500
PUBLISH_BATCH = 1000  # events per publish call
BATCH_WAIT = 0.005  # seconds a busy worker waits for a quarter of its slots before leasing fewer
RESERVE_BATCH = 100  # most delayed items one dequeue reserves
STORE_ERROR_LOG_EVERY = 30.0  # seconds between two log lines about the same failing loop
STORE_BACKOFF_MAX = 5.0  # seconds: the longest pause of a loop retrying a failing store
COMPLETION_RETRY_FOR = timedelta(minutes=2)  # then the leases are let go: the runs run again elsewhere
CANCEL_POLL_INTERVAL = timedelta(seconds=1)
GIVE_WAY_AHEAD = 0.002  # seconds: held runs due this soon (or overdue) make recording wait...
GIVE_WAY_MAX = 0.05  # ...at most this long per batch
MS = timedelta(milliseconds=1)
T = TypeVar("T")


@dataclass
class WorkerStats:
    """Counters for tests and metrics."""

    claimed: int = 0
    completed: int = 0
    breaker_deferred: int = 0
    throttled: int = 0  # runs handed back rate limited (`RateLimited`), no attempt spent
    unspent: int = 0  # runs handed back as they were (`HandBack`): never this worker's to run
    lost_leases: int = 0
    by_status: dict[str, int] = field(default_factory=dict)


class Shared:
    """The state every stage of one worker reads: its stores, its runs (`tracker`), its events.

    Its stores are what the stages need of them (`scheduler_grpc.ports`): `runs` (the attempts in
    PostgreSQL), `queue` (the leases in Redis), `events` (the stream the outbox is published to);
    `redis` is left for the cancel channel. `capacity`, when set, bounds the fetch further than
    the free slots (a remote worker's credit).

    `spawn` starts a task in the role's task group (supervised: a bug in it ends the role), `fail`
    ends the role from a callback, where raising would only be logged by the event loop.
    """

    __slots__ = (
        "breakers", "capacity", "events", "group", "id", "outbox", "outcomes", "queue", "redis", "retry_until",
        "runs", "settings", "slot_free", "stats", "tracker",
    )  # fmt: skip

    def __init__(
        self,
        worker_id: str,
        *,
        redis: Redis,
        runs: RunStore,
        queue: WorkQueue,
        events: EventBus,
        settings: Settings,
        breakers: Breakers,
        tracker: RunTracker[Attempt],
    ) -> None:
        self.id = worker_id
        self.redis = redis
        self.runs = runs
        self.queue = queue
        self.events = events
        self.settings = settings
        self.breakers = breakers
        self.tracker = tracker
        self.outbox = Outbox(limit=PUBLISH_BATCH * 4)
        self.stats = WorkerStats()
        self.slot_free = asyncio.Event()  # set when slots may have come free (`tracker.on_slots`)
        self.outcomes = asyncio.Event()  # set when an outcome is ready (`tracker.on_finished`)
        self.group: asyncio.TaskGroup | None = None  # the role's, while it runs
        # Once stopping, failing writes are retried only this long (monotonic): a stop must not hang
        # for COMPLETION_RETRY_FOR; what is not recorded by then runs again elsewhere.
        self.retry_until = math.inf
        # What else bounds the fetch besides the free slots (None: nothing): a remote worker's session
        # (`scheduler_grpc.remote`) leases no more runs than the credit its worker granted. Whoever
        # raises it sets `slot_free`.
        self.capacity: Callable[[], int] | None = None

    def spawn(self, coro: Coroutine[Any, Any, None], name: str | None = None) -> asyncio.Task[None]:
        """Start `coro` in the role's task group."""
        if self.group is None:
            coro.close()
            raise RuntimeError("the worker is not running")
        return self.group.create_task(coro, name=name)

    def fail(self, exc: BaseException) -> None:
        """A bug found outside a task (a done callback): end the role with it."""
        try:
            self.spawn(_reraise(exc), name="bug")
        except RuntimeError:  # the task group is ending already (another bug): log this one
            log.exception("bug while the worker was ending", exc_info=exc, extra={"worker_id": self.id})

    def event(
        self, kind: EventType, claim: Claim, *, execution_id: str = "", attempt: int = 0, error: str = "", now: str = ""
    ) -> bytes:
        """An event of `claim`'s attempt, encoded; `now` is its time (ISO 8601), formatted once per batch."""
        return events.encode_fields(
            kind, execution_id or claim.execution_id, claim.run_id, claim.job_id, attempt or claim.attempt,
            handler=claim.handler, worker_id=self.id, error=error, time=now or datetime.now(UTC).isoformat(),
        )  # fmt: skip

    async def retrying(self, what: str, call: Callable[[], Awaitable[T]], until: float) -> T:
        """`call()` until it succeeds, backing off on store errors until the monotonic `until` (or
        the end of a stop's grace)."""
        trouble = StoreTrouble(what, self.id)
        while True:
            try:
                result = await call()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if not stores.is_fault(exc) or time.monotonic() >= min(until, self.retry_until):
                    raise
                await asyncio.sleep(trouble.failed(exc))
            else:
                trouble.recovered()
                return result


async def _reraise(exc: BaseException) -> None:
    raise exc


class StoreTrouble:
    """The store errors of one loop: each counted, logged at most once per `every` seconds (with how
    many were not), and answered with an exponential backoff that resets on success."""

    def __init__(self, what: str, worker_id: str, every: float = STORE_ERROR_LOG_EVERY) -> None:
        self._what = what
        self._worker_id = worker_id
        self._every = every
        self._last_log = -math.inf
        self._unlogged = 0
        self._delay = 0.0

    def failed(self, exc: BaseException) -> float:
        """Record a failure; returns how long to back off."""
        metrics.store_error(exc)
        now = time.monotonic()
        if now - self._last_log >= self._every:
            log.warning(
                "%s failed, retrying with backoff: %r", self._what, exc,
                extra={"worker_id": self._worker_id, "errors_not_logged": self._unlogged},
            )  # fmt: skip
            self._last_log, self._unlogged = now, 0
        else:
            self._unlogged += 1
        self._delay = min(max(self._delay * 2, 0.1), STORE_BACKOFF_MAX)
        return self._delay

    def recovered(self) -> None:
        if self._delay:
            log.info("%s works again", self._what, extra={"worker_id": self._worker_id})
        self._delay, self._last_log, self._unlogged = 0.0, -math.inf, 0


def faulted(exc: Exception, what: str, worker_id: str) -> None:
    """A one-off write failed: re-raise a bug; a store fault is counted and logged (the leases
    expire and the leader recovers the items, so nothing is lost)."""
    if not stores.is_fault(exc):
        raise exc
    metrics.store_error(exc)
    log.warning("could not %s: %r", what, exc, extra={"worker_id": worker_id})


class Outbox:
    """Events waiting to be published, in the order they were added (a run's STARTED before its
    end), by one task (the publish loop) in batches, off the hot path.

    Adding never blocks (the claim and the hand-back must not wait on Redis); the completion stage
    waits for `room()` before recording the next batch, which bounds the outbox through the slots.
    """

    def __init__(self, limit: int) -> None:
        self._events: list[bytes] = []  # encoded (`events.encode_fields`)
        self._limit = limit
        self._in_flight = 0
        self._ready = asyncio.Event()
        self._changed = asyncio.Event()

    def add(self, batch: Sequence[bytes]) -> None:
        if batch:
            self._events.extend(batch)
            self._ready.set()

    async def take(self, most: int) -> list[bytes]:
        """The oldest events, up to `most`, once there are any; `done()` must follow."""
        await self._ready.wait()
        batch, self._events = self._events[:most], self._events[most:]
        if not self._events:
            self._ready.clear()
        self._in_flight = len(batch)
        return batch

    def done(self) -> None:
        self._in_flight = 0
        self._changed.set()

    async def room(self) -> None:
        """Wait until the outbox is below its limit."""
        while len(self._events) >= self._limit:
            self._changed.clear()
            await self._changed.wait()

    async def flushed(self) -> None:
        """Wait until every event added so far was published (or given up on)."""
        while self._events or self._in_flight:
            self._changed.clear()
            await self._changed.wait()


class Maintenance:
    """What `system.cleanup` may touch, implemented over our stores."""

    def __init__(self, history: HistoryPruning, events: EventBus, queue: WorkQueue) -> None:
        self._history = history
        self._events = events
        self._queue = queue

    async def prune_executions(self, older_than: datetime) -> int:
        return await self._history.prune(older_than)

    async def trim_events(self, older_than: datetime) -> int:
        return await self._events.trim_before(older_than)

    async def trim_dead_letters(self, older_than: datetime) -> int:
        age = max(datetime.now(UTC) - older_than, timedelta(0))
        return len(await self._queue.purge_dead(None, older_than=age))


class DueStarts:
    """When the held runs come due, so that recording and publishing give way to starting.

    A crowd of held runs due at one instant starts one run after another on the worker's loop, and
    the outcomes of the first (their statement, script call and events, and the work PostgreSQL and
    Redis do for them on the same cores) would otherwise be recorded between the starts of the
    rest, each start later for it. `give_way` lets the starts go first, bounded by GIVE_WAY_MAX.
    """

    __slots__ = ("_heap", "_order")

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Attempt]] = []  # (due, order, run), earliest first
        self._order = itertools.count()

    def add(self, run: Attempt) -> None:
        """A held run (its `due` set), waiting for its due time."""
        heapq.heappush(self._heap, (run.due, next(self._order), run))

    def pending(self, within: float) -> bool:
        """A held run is due within `within` seconds, or overdue, and has not started yet (one
        waiting for a slot, STARTING, does not count: recording may be what frees one)."""
        heap = self._heap
        while heap and heap[0][2].state is not State.HELD:
            heapq.heappop(heap)  # started, or handed back: no longer waited for
        return bool(heap) and heap[0][0] <= time.monotonic() + within

    async def give_way(self) -> None:
        """Wait while held runs are due now and not started, at most GIVE_WAY_MAX."""
        if not self.pending(GIVE_WAY_AHEAD):
            return
        until = time.monotonic() + GIVE_WAY_MAX
        while time.monotonic() < until:
            await asyncio.sleep(0.001)
            if not self.pending(GIVE_WAY_AHEAD):
                return


async def sleep_until(when: float) -> None:
    """Sleep until the monotonic `when`, never less: a loop's timer may fire a little early (uvloop
    counts from its cached clock), so it sleeps again for what is left."""
    left = when - time.monotonic()
    while left > 0:
        await asyncio.sleep(max(left, 0.001))
        left = when - time.monotonic()
