"""The worker role: takes runs from the queue and executes them with bounded concurrency.

One pass of a run through a worker:

1. `dequeue_blocking` leases up to the number of free slots in one script call (no polling), in a
   fetch loop that hands each batch to a claim loop through a one-batch buffer, so the next batch
   is leased while the previous one is claimed.
2. Items whose handler breaker is open go straight back, delayed, without spending an attempt.
3. One statement claims the rest in PostgreSQL under their lease tokens (`ExecutionRepository.claim`);
   items with nothing left to run are acked away.
4. Each claim runs in its own task under the job's timeout and its breaker(s); its lease is extended
   while it runs. The claims of a batch that share a timeout share one deadline timer (`_Deadline`),
   which cancels the handlers still running when it fires. Its slot is freed when the handler
   returns: the run (its outcome set) goes to a buffer (`_finished`, bounded for runs from the
   queue; a held reservation's outcome never waits), and stays in `_running` (lease extended)
   until the outcome is recorded.
5. A completion stage, concurrent with fetching, takes outcomes in batches: one statement records
   them (only under the claim token, so an attempt whose lease was lost cannot overwrite its
   replacement), then one script call tells the queue (acks, retries with backoff, dead letters).
   Events (STARTED at the claim or a held run's start, the outcome's at completion) go through an ordered outbox that
   one task publishes in batches.

Reservations (`SCHEDULER_WORKER_RESERVE_AHEAD`): when ready items do not fill a dequeue, it also
leases delayed items due within the window. They are claimed at once (`started_at` = their due time),
held outside the slots (`_hold`), and started when the database clock reaches their due time,
measured from the claim's clock reading; then they take a slot like any run. A held run that cannot
start (no slot within the grace, its breaker open, a stop) is handed back unspent (`_unreserve`).

On SIGTERM: stop taking work (held reservations go straight back, unspent), let running jobs finish
within the grace period, then cancel the rest and hand their runs straight back to the queue (not
after the visibility timeout), each recorded `interrupted` with the next attempt `queued`.

Faults. Every loop (fetch, complete, extend, heartbeat, cancel listener and poll) survives any store
error (Redis or PostgreSQL unreachable, or answering an error such as READONLY, BUSY or OOM): it
counts it, logs it once per `STORE_ERROR_LOG_EVERY` (not a traceback per iteration), backs off and
retries. Only a bug ends the role (the exception propagates; `run_worker` logs its traceback and the
process exits non-zero). Outcomes whose recording fails are kept, with their leases extended, and
written again (for up to `COMPLETION_RETRY_FOR`, or the grace period plus 5 s once stopping) so a
PostgreSQL blip does not run a batch twice.
A cancel request is persisted in PostgreSQL; pub/sub only makes it fast, a poll of the worker's
running attempts (`CANCEL_POLL_INTERVAL`) makes it certain.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import functools
import gc
import logging
import math
import os
import socket
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

from redis.asyncio import Redis

from scheduler_grpc import events, metrics, outputs, stores
from scheduler_grpc import registry as workers
from scheduler_grpc.breakers import BreakerOpen, BreakerPolicy, Breakers, BreakerState
from scheduler_grpc.config import Settings
from scheduler_grpc.connections import connect
from scheduler_grpc.db.executions import Claim, Completed, ExecutionRepository, Outcome
from scheduler_grpc.errors import SchedulerError
from scheduler_grpc.events import EventType
from scheduler_grpc.executions import DeadReason, ExecutionStatus, Trigger
from scheduler_grpc.handlers import (
    ExecutionContext,
    HandlerError,
    HandlerRegistry,
    HandlerSettings,
    PermanentHandlerError,
    default_registry,
    handler_of_breaker_key,
)
from scheduler_grpc.keys import WorkerKeys
from scheduler_grpc.queue import Lease, Queue
from scheduler_grpc.registry import HEARTBEAT_INTERVAL

log = logging.getLogger(__name__)

DEFAULT_METRICS_PORT = 9100
# The cyclic garbage collector's first threshold for a busy worker (Python's default: 700). Each run
# allocates a task, its coroutines, a claim, an outcome, a context, events...: at 700 a worker
# draining a few thousand runs a second collected its youngest generations ~300 times per 20,000
# runs, ~0.25 s of CPU (~12 us per run, measured with gc.callbacks); at 5,000 about 10 times, ~0.03 s.
GC_THRESHOLD = (5_000, 20, 20)
FETCH_WAIT = timedelta(seconds=2)
COMPLETION_BATCH = 500
PUBLISH_BATCH = 1000  # events per publish call
BATCH_WAIT = 0.005  # seconds a busy worker waits for a quarter of its slots before leasing fewer
RESERVE_BATCH = 100  # most delayed items one dequeue reserves
STORE_ERROR_LOG_EVERY = 30.0  # seconds between two log lines about the same failing loop
STORE_BACKOFF_MAX = 5.0  # seconds: the longest pause of a loop retrying a failing store
COMPLETION_RETRY_FOR = timedelta(minutes=2)  # then the leases are let go: the runs run again elsewhere
CANCEL_POLL_INTERVAL = timedelta(seconds=1)
T = TypeVar("T")
_MS = timedelta(milliseconds=1)
_BREAKER_SEVERITY = {BreakerState.CLOSED: 0, BreakerState.HALF_OPEN: 1, BreakerState.OPEN: 2}
_LATENESS_TRIGGERS = frozenset({Trigger.SCHEDULE, Trigger.MANUAL})
# Attempts these make are never a flow run's downstream runs (a flow run's root has no upstreams):
# the claim path asks PostgreSQL for upstream results only for the others (upstream, retry, ...).
_ROOT_TRIGGERS = frozenset({Trigger.SCHEDULE, Trigger.MANUAL, Trigger.BACKFILL})
_WORKER_KEYS = WorkerKeys()
_EVENT_OF = {
    ExecutionStatus.SUCCEEDED: EventType.SUCCEEDED,
    ExecutionStatus.FAILED: EventType.FAILED,
    ExecutionStatus.TIMED_OUT: EventType.TIMED_OUT,
    ExecutionStatus.DEAD: EventType.DEAD,
    ExecutionStatus.CANCELLED: EventType.CANCELLED,
}


class _Deadline:
    """The timeout of the claims of one batch that share a job timeout: one timer for all of them
    instead of one `asyncio.timeout` (a timer armed, moved and cancelled) per run.

    When it fires it cancels the handlers still running (`running`); each of them takes that
    cancellation as its timeout (`release`, as `asyncio.timeout` turns it into TimeoutError). The
    timer is cancelled once every run of the group has finished (`finished`), so a drained batch
    leaves no timer behind.
    """

    __slots__ = ("_pending", "_timer", "expired", "running")

    def __init__(self, seconds: float, runs: int) -> None:
        self.running: dict[str, _Running] = {}  # by run id, while their handlers run
        self.expired = False
        self._pending = runs
        self._timer = asyncio.get_running_loop().call_later(seconds, self._expire)

    def _expire(self) -> None:
        self.expired = True
        for running in self.running.values():
            assert running.task is not None  # a handler runs in its task
            running.timed_out = True
            running.task.cancel()

    def release(self, running: _Running) -> bool:
        """`running`'s handler is done (however it ended): off the deadline. The deadline's
        cancellation, if any, is taken back (whatever the handler made of it, as `asyncio.timeout`
        does), so it never hides or outlives another one.

        Returns:
            True when the deadline cancelled this handler and nothing else did: its timeout.
        """
        if self.running.pop(running.lease.id, None) is None or not running.timed_out:
            return False
        assert running.task is not None
        return running.task.uncancel() == 0

    def finished(self) -> None:
        """One run of the group is done (whatever its end)."""
        self._pending -= 1
        if self._pending <= 0:
            self._timer.cancel()


class _Running:
    """A claimed attempt, from its claim until its outcome is recorded (or it is handed back).

    A reserved one is first held (`held`): claimed, waiting for its due time (`due`, monotonic),
    without a slot or a deadline; `started_at` is then its real start (database clock).
    """

    __slots__ = ("claim", "deadline", "due", "held", "lease", "outcome", "seconds", "started_at", "task", "timed_out")

    def __init__(self, lease: Lease, claim: Claim, deadline: _Deadline | None) -> None:
        self.lease = lease
        self.claim = claim
        self.deadline = deadline  # None while held: a held run's timeout starts with it
        self.task: asyncio.Task[None] | None = None
        self.outcome: Outcome | None = None  # set when the handler is done; then it waits in `_finished`
        self.timed_out = False  # its deadline cancelled its handler
        self.seconds = 0.0  # how long its handler ran (observed with its batch's outcomes)
        self.held = False
        self.due = 0.0
        self.started_at: datetime | None = None


class _Outbox:
    """Events waiting to be published, in the order they were added (a run's STARTED before its
    end), by one task (`Worker._publish_loop`) in batches, off the hot path.

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


@dataclass
class WorkerStats:
    """Counters for tests and metrics."""

    claimed: int = 0
    completed: int = 0
    breaker_deferred: int = 0
    lost_leases: int = 0
    by_status: dict[str, int] = field(default_factory=dict)


class _Maintenance:
    """What `system.cleanup` may touch, implemented over our stores."""

    def __init__(self, redis: Redis, executions: ExecutionRepository, queue: Queue) -> None:
        self._redis = redis
        self._executions = executions
        self._queue = queue

    async def prune_executions(self, older_than: datetime) -> int:
        return await self._executions.prune(older_than)

    async def trim_events(self, older_than: datetime) -> int:
        return await events.trim_before(self._redis, older_than)

    async def trim_dead_letters(self, older_than: datetime) -> int:
        age = max(datetime.now(UTC) - older_than, timedelta(0))
        return len(await self._queue.purge_dead(None, older_than=age))


class _StoreTrouble:
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


class Worker:
    """Executes runs from one queue with `concurrency` slots.

    Args:
        redis: Client for the queue, events and heartbeats.
        executions: The execution history in PostgreSQL (claims, completions, cancel requests); the
            worker needs nothing else from PostgreSQL, so a test can hand it a wrapped repository.
        registry: The handlers this worker can run.
        settings: Process settings (visibility timeout, grace, breakers, ...).
        worker_id: Unique id of this worker process (default host:pid:random).
    """

    def __init__(
        self,
        redis: Redis,
        executions: ExecutionRepository,
        registry: HandlerRegistry,
        settings: Settings,
        *,
        worker_id: str | None = None,
        concurrency: int | None = None,
    ) -> None:
        self.id = worker_id or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
        self._redis = redis
        self._registry = registry
        self._settings = settings
        self._handler_settings = HandlerSettings.from_settings(settings)
        self.concurrency = concurrency or settings.worker_concurrency
        self._visibility = settings.visibility_timeout
        self._executions = executions
        self.queue = Queue(redis, settings.queue, call_timeout=settings.connect_timeout, max_stalls=settings.max_stalls)
        self.breakers = Breakers(
            BreakerPolicy(
                window=settings.breaker_window,
                min_calls=settings.breaker_min_calls,
                failure_ratio=settings.breaker_failure_ratio,
                reset_timeout=settings.breaker_reset_timeout,
            ),
            on_change=self._breaker_changed,
        )
        self._maintenance = _Maintenance(redis, self._executions, self.queue)
        self._running: dict[str, _Running] = {}  # by run id
        self._cancel_requested: set[str] = set()  # run ids an operator (or `replace`) cancelled
        self._giving_up: set[str] = set()  # run ids whose lease was lost, being stopped (`_give_up`)
        self._group: asyncio.TaskGroup | None = None  # run()'s: a bug in any of its tasks ends the role
        self._slot_free = asyncio.Event()
        # Slots are freed when a handler returns, not when its outcome is recorded: `_busy` counts
        # running handlers; `_running` also holds outcomes waiting in `_finished` or being recorded
        # (their leases stay extended until then). `_finished` is the bounded buffer between the two:
        # when recording falls behind, handlers wait to put their outcome, so their slots stay busy
        # and fetching stops.
        self._busy = 0
        # Dequeuing and claiming overlap: the fetch loop leases the next batch while the claim loop
        # claims the previous one. Leased, not yet claimed ready items hold their slots (`_unclaimed`).
        self._unclaimed = 0
        # Each batch with the monotonic time its dequeue replied (a reserved item's due time counts
        # from it) and how many of its items are reserved.
        self._claiming: asyncio.Queue[tuple[list[Lease], float, int]] = asyncio.Queue(maxsize=1)
        # Reservations (`SCHEDULER_WORKER_RESERVE_AHEAD`): delayed items leased ahead of their due
        # time, claimed at once and started at their due time; they take no slot until then.
        # `_reserving` counts those leased, not yet claimed; `_held` those claimed, not yet started;
        # together at most `_reserve_max`. `_starting` counts held runs due and waiting for a slot:
        # the fetch loop leaves them those slots.
        self._reserve_ahead = settings.worker_reserve_ahead
        self._reserve_max = settings.worker_reserve_max
        self._reserve_grace = settings.worker_reserve_grace.total_seconds()
        self._reserving = 0
        self._held = 0
        self._starting = 0
        self._slot_waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self._held_started: list[_Running] = []  # started in this turn of the loop (`_started_held`)
        # Bounded at `_finished_max` for runs from the queue (`_finish` waits for room). A held run's
        # outcome never waits: held runs are bounded by SCHEDULER_WORKER_RESERVE_MAX already, and a
        # crowd of them due at one instant on a worker of few slots must not be throttled to a
        # recording per handful of them (a slot is free once its outcome is in this buffer).
        self._finished: asyncio.Queue[_Running] = asyncio.Queue()
        self._finished_max = self.concurrency * 4
        self._finished_room = asyncio.Event()
        self._outbox = _Outbox(limit=PUBLISH_BATCH * 4)
        self._duration_by_handler: dict[str, Any] = {}  # handler -> its EXECUTION_DURATION child
        self._started_at = datetime.now(UTC)
        # Once stopping, failing writes are retried only this long (monotonic): a stop must not hang
        # for COMPLETION_RETRY_FOR; what is not recorded by then runs again elsewhere.
        self._retry_until_stopped = math.inf
        self.stats = WorkerStats()

    @property
    def active(self) -> int:
        """Slots in use (handlers running)."""
        return self._busy

    # -- the role ----------------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        """Work until `stop` is set, then shut down gracefully."""
        log.info("worker started", extra={"worker_id": self.id, "slots": self.concurrency, "queue": self.queue.name})
        async with asyncio.TaskGroup() as group:
            self._group = group
            fetcher = group.create_task(self._fetch_loop(), name="fetch")
            claimer = group.create_task(self._claim_loop(), name="claim")
            completer = group.create_task(self._complete_loop(), name="complete")
            extender = group.create_task(self._extend_loop(), name="extend-leases")
            beater = group.create_task(self._heartbeat_loop(), name="heartbeat")
            canceller = group.create_task(self._cancel_listener(), name="cancel-listener")
            poller = group.create_task(self._cancel_poll_loop(), name="cancel-poll")
            publisher = group.create_task(self._publish_loop(), name="publish-events")
            await stop.wait()
            log.info("worker stopping: no new work", extra={"worker_id": self.id, "active": self.active})
            self._retry_until_stopped = time.monotonic() + self._settings.shutdown_grace.total_seconds() + 5
            fetcher.cancel()
            await asyncio.wait([fetcher])
            await self._claiming.join()  # what was leased is claimed (or handed back) first
            claimer.cancel()
            await self._release_held()  # reserved runs not started yet go back at once, unspent
            await self._drain(self._settings.shutdown_grace)
            await self._finished.join()
            await self._outbox.flushed()  # bounded: the publisher gives up by _retry_until_stopped
            for task in (completer, extender, beater, canceller, poller, publisher):
                task.cancel()
        await self._unregister()
        log.info("worker stopped", extra={"worker_id": self.id})

    async def _drain(self, grace: timedelta) -> None:
        tasks = [running.task for running in self._running.values() if running.task is not None]
        if tasks:
            await asyncio.wait(tasks, timeout=grace.total_seconds())
        unfinished = [r for r in self._running.values() if r.task is not None and not r.task.done()]
        for running in unfinished:
            assert running.task is not None
            running.task.cancel()
        if unfinished:
            await asyncio.wait([r.task for r in unfinished if r.task is not None])
            # A task that finished just before its cancellation reported its outcome: keep that.
            await self._hand_back([r for r in unfinished if r.task is not None and r.task.cancelled()])

    async def _hand_back(self, runs: Sequence[_Running]) -> None:
        """Interrupted attempts are recorded `interrupted`, their runs get a `queued` next attempt,
        and their items go straight back to ready (not after the visibility timeout)."""
        if not runs:
            return
        try:
            await self._executions.release([(r.claim.execution_id, r.lease.token) for r in runs])
            await self.queue.nack_many([r.lease for r in runs], count_delivery=False)
            now = datetime.now(UTC).isoformat()
            self._outbox.add([self._event(EventType.INTERRUPTED, r.claim, now=now) for r in runs])
        except Exception as exc:
            if not stores.is_fault(exc):
                raise
            # Not lost: the leases expire, the leader recovers the items, a claim restarts the runs.
            metrics.store_error(exc)
            log.warning("could not hand back unfinished runs: %r", exc, extra={"worker_id": self.id})
        for running in runs:
            self._running.pop(running.lease.id, None)
        log.warning("handed back unfinished runs", extra={"worker_id": self.id, "runs": len(runs)})

    # -- taking work -------------------------------------------------------------------------------

    async def _fetch_loop(self) -> None:
        trouble = _StoreTrouble("taking work", self.id)
        min_batch = max(1, self.concurrency // 4)
        while True:
            free = self._free_slots()
            if free <= 0:
                self._slot_free.clear()
                await self._slot_free.wait()
                continue
            if free < min_batch and self._busy:
                # A few slots free while others are about to be: wait a moment for them, so a
                # busy worker leases (and claims, records) in batches rather than one item at a time.
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(BATCH_WAIT):
                        while self._free_slots() < min_batch:
                            self._slot_free.clear()
                            await self._slot_free.wait()
                free = self._free_slots()
                if free <= 0:  # held runs came due meanwhile and took the slots
                    continue
            reserve_count = 0
            if self._reserve_ahead:
                reserve_count = max(0, min(RESERVE_BATCH, self._reserve_max - self._reserving - self._held))
            try:
                # Idle (holding no run at all): only then may the queue hand over a solo item.
                idle = not self._running and not self._unclaimed and not self._reserving
                leases = await self.queue.dequeue_blocking(
                    self.id, self._visibility, free, FETCH_WAIT,
                    reserve=self._reserve_ahead if reserve_count else timedelta(0), reserve_count=reserve_count,
                    idle=idle,
                )  # fmt: skip
                trouble.recovered()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis failing: the leases expire, nothing is lost
                if not stores.is_fault(exc):
                    raise
                await asyncio.sleep(trouble.failed(exc))
                continue
            if not leases:
                continue
            fetched = time.monotonic()
            # Reserved items come last (a ready one never follows one): count from the end.
            reserved = 0
            if reserve_count:
                while reserved < len(leases) and leases[-1 - reserved].due_in is not None:
                    reserved += 1
            self._unclaimed += len(leases) - reserved
            self._reserving += reserved
            try:
                await self._claiming.put((leases, fetched, reserved))
            except BaseException:  # stopping while the claim stage is busy: hand the batch back now
                self._unclaimed -= len(leases) - reserved
                self._reserving -= reserved
                with contextlib.suppress(Exception):
                    await self._give_back_leases(leases, fetched)
                raise
            if leases[0].solo:  # it runs alone: fetch nothing until it is claimed and has ended
                await self._claiming.join()

    def _free_slots(self) -> int:
        """Slots the fetch loop may lease ready items for: not running a handler, not promised to a
        leased item, nor to a held run whose due time has come; none while a solo run is held."""
        if any(running.lease.solo for running in self._running.values()):
            return 0
        return self.concurrency - self._busy - self._unclaimed - self._starting

    async def _give_back_leases(self, leases: Sequence[Lease], fetched: float) -> None:
        """Return unclaimed leases to the queue, their deliveries given back: a ready item to ready, a
        reserved one delayed until its due time (ready, any worker would start it early)."""
        elapsed = timedelta(seconds=time.monotonic() - fetched)
        # A millisecond more: the queue's clock reads whole milliseconds.
        retries = [
            (lease, max(lease.due_in - elapsed + _MS, timedelta(0)) if lease.due_in is not None else timedelta(0))
            for lease in leases
        ]
        await self.queue.finish_many(retries=retries)

    async def _claim_loop(self) -> None:
        trouble = _StoreTrouble("claiming work", self.id)
        while True:
            leases, fetched, reserved = await self._claiming.get()
            try:
                await self._take(leases, fetched, reserved)
                trouble.recovered()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # PostgreSQL or Redis failing: the leases expire, nothing is lost
                if not stores.is_fault(exc):
                    raise
                await asyncio.sleep(trouble.failed(exc))
            finally:
                self._unclaimed -= len(leases) - reserved
                self._reserving -= reserved
                self._claiming.task_done()
                self._grant_slots()  # slots promised to this batch and not taken
                self._slot_free.set()

    async def _take(self, leases: list[Lease], fetched: float, reserved: int = 0) -> None:
        deferred: dict[timedelta, list[Lease]] = {}
        wanted: list[Lease] = []
        for lease in leases:
            wait = self.breakers.blocked_for(lease.data.decode())
            if wait > timedelta(0):
                deferred.setdefault(wait, []).append(lease)
            else:
                wanted.append(lease)
        for wait, group in deferred.items():
            if any(lease.due_in is not None for lease in group):
                # Never before a reserved item's due time, whatever the breaker's wait.
                elapsed = timedelta(seconds=time.monotonic() - fetched)
                await self.queue.finish_many(retries=[
                    (lease, max(wait, (lease.due_in or timedelta(0)) - elapsed + _MS)) for lease in group
                ])  # fmt: skip
            else:
                await self.queue.nack_many(group, wait, count_delivery=False)
            self.stats.breaker_deferred += len(group)
        if not wanted:
            return
        items = [(lease.id, lease.token) for lease in wanted]
        try:
            if reserved:
                flags = [lease.due_in is not None for lease in wanted]
                claims = await self._executions.claim(items, self.id, reserved=flags)
            else:  # a batch without reservations pays nothing for them
                claims = await self._executions.claim(items, self.id)
        except BaseException:
            await self._give_back_leases(wanted, fetched)
            raise
        replied = time.monotonic()
        flow_runs = [claim.run_id for claim in claims if claim.trigger not in _ROOT_TRIGGERS]
        if flow_runs:  # a flow run's downstream runs: their handlers get the upstream results
            try:
                upstream = await self._executions.upstream_results(flow_runs)
            except BaseException:
                await self._give_back_leases(wanted, fetched)
                raise
            claims = [
                replace(claim, upstream_results=upstream[claim.run_id]) if claim.run_id in upstream else claim
                for claim in claims
            ]
        by_run = {claim.run_id: claim for claim in claims}
        nothing_to_do = [lease for lease in wanted if lease.id not in by_run]
        if nothing_to_do:  # finished meanwhile, or its job was deleted
            await self.queue.ack_many(nothing_to_do)
        ready = claims
        if reserved:
            ready = [c for lease in wanted if lease.due_in is None and (c := by_run.get(lease.id)) is not None]
        now = datetime.now(UTC).isoformat()
        # Added before any of these handlers can run: a run's STARTED precedes its end in the stream.
        # A held run's STARTED comes when it starts.
        self._outbox.add([self._event(EventType.STARTED, claim, now=now) for claim in ready])
        deadlines: dict[timedelta, _Deadline] = {}
        for lease in wanted:
            claim = by_run.get(lease.id)
            if claim is None:
                continue
            if lease.due_in is not None:
                held = _Running(lease, claim, None)
                held.held = True
                assert claim.clock is not None  # every claim reads the clock
                held.due = replied + max((claim.started_at - claim.clock).total_seconds(), 0.0)
                self._running[lease.id] = held
                self._held += 1
                held.task = asyncio.create_task(self._hold(held, replied))
                held.task.add_done_callback(functools.partial(self._hold_ended, held))
                continue
            deadline = deadlines.get(claim.timeout)
            if deadline is None:
                runs = sum(1 for c in ready if c.timeout == claim.timeout)
                deadline = deadlines[claim.timeout] = _Deadline(claim.timeout.total_seconds(), runs)
            running = _Running(lease, claim, deadline)
            self._running[lease.id] = running
            self._busy += 1
            running.task = asyncio.create_task(self._execute(running))
        self.stats.claimed += len(claims)
        self._observe_starts(ready)

    # -- reservations ------------------------------------------------------------------------------

    async def _hold(self, running: _Running, replied: float) -> None:
        """A reserved run, claimed ahead: wait for its due time on the database clock, take a slot,
        run it. Handed back (`_unreserve`) if its breaker is open then, or if no slot frees up
        within the reserve grace; cancelled without running on a cancel request.

        The claim says when the run is due (`started_at`, the later of its `due_at` and the claim's
        clock) and what the database clock read (`clock`); the wait is their difference less the
        time since the reply: late by the reply's transfer, never early, whatever the host clocks.
        """
        claim, lease, due = running.claim, running.lease, running.due
        assert claim.clock is not None
        try:
            try:
                await _sleep_until(due)
                wait = self.breakers.blocked_for(lease.data.decode())
                if wait > timedelta(0):
                    self.stats.breaker_deferred += 1
                    await self._unreserve([running], wait)
                    return
                if not await self._take_slot(due + self._reserve_grace):
                    log.warning("no slot for a reserved run within the grace; handed back",
                                extra={"run_id": lease.id, "worker_id": self.id})  # fmt: skip
                    await self._unreserve([running])
                    return
            except asyncio.CancelledError:
                if lease.id not in self._cancel_requested:
                    raise  # a stop or a lost lease: `_release_held` or `_give_up` deals with the run
                # We cancelled this task ourselves for a cancel request: absorb exactly that one.
                self._cancel_requested.discard(lease.id)
                task = asyncio.current_task()
                if task is not None and task.uncancel() > 0:
                    raise
                await self._unreserve([running])  # its attempt is recorded cancelled: it never ran
                return
        finally:
            if running.held:
                running.held = False
                self._held -= 1
        # Started: a slot is ours (`_take_slot` counted it busy). Its STARTED event is added before
        # its handler can end (the outcome's event waits for the completion stage).
        running.started_at = max(claim.started_at, claim.clock + timedelta(seconds=time.monotonic() - replied))
        running.deadline = _Deadline(claim.timeout.total_seconds(), 1)
        self._started_held(running)
        await self._execute(running)

    def _hold_ended(self, running: _Running, task: asyncio.Task[None]) -> None:
        """A held task cancelled before its first step never ran its own clean-up: do it here."""
        if not running.held:
            return
        running.held = False
        self._held -= 1
        if task.cancelled() and running.lease.id in self._cancel_requested and self._group is not None:
            # Cancelled on request: record it cancelled (never run). A stop or a lost lease hands
            # the run back or abandons it by itself (`_release_held`, `_give_up`).
            self._cancel_requested.discard(running.lease.id)
            self._group.create_task(self._unreserve([running]), name="cancel-held")

    async def _take_slot(self, until: float) -> bool:
        """Wait for a slot until the monotonic `until`; True when taken (counted busy).

        Held runs due at the same instant queue here first come, first served: a freed slot is
        handed to the first of them (`_free_slot`), one wake-up per slot rather than all of them
        racing for each; they come before the fetch loop (`_starting`).
        """
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._slot_waiters.append(waiter)
        self._grant_slots()
        if waiter.done():  # a slot was free (and nobody waited before us)
            return True
        self._starting += 1
        got = False
        try:
            left = until - time.monotonic()
            if left > 0:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(left):
                        await waiter
                        got = True
        finally:
            self._starting -= 1
            if not got:
                if waiter.done() and not waiter.cancelled():
                    self._free_slot()  # handed a slot just as we gave up: pass it on
                else:
                    waiter.cancel()
        return got

    def _grant_slots(self) -> None:
        """Hand free slots to the held runs waiting for one, in their order."""
        while self._slot_waiters and self._busy + self._unclaimed < self.concurrency:
            waiter = self._slot_waiters.popleft()
            if not waiter.done():
                self._busy += 1
                waiter.set_result(None)

    def _free_slot(self) -> None:
        """A handler returned: its slot goes to a waiting held run, else to the fetch loop."""
        self._busy -= 1
        self._grant_slots()
        self._slot_free.set()

    async def _unreserve(self, runs: Sequence[_Running], delay: timedelta = timedelta(0)) -> None:
        """Hand back held runs that never started: each attempt back to `queued`, unspent (or
        `cancelled` where a cancel was requested), each item back to the queue without counting the
        delivery, delayed until its due time if that is still ahead (and at least `delay`)."""
        if not runs:
            return
        try:
            ended = await self._executions.unclaim([(r.claim.execution_id, r.lease.token) for r in runs])
            now = time.monotonic()
            retries: list[tuple[Lease, timedelta]] = []
            acks: list[Lease] = []
            cancelled: list[_Running] = []
            for running in runs:
                status = ended.get(running.claim.execution_id)
                if status is ExecutionStatus.QUEUED:
                    ahead = timedelta(seconds=max(running.due - now, 0.0))
                    retries.append((running.lease, max(delay, ahead + _MS if ahead else ahead)))
                elif status is ExecutionStatus.CANCELLED:
                    acks.append(running.lease)
                    cancelled.append(running)
                # None: no longer ours (lease lost, taken over): nothing to give back.
            await self.queue.finish_many(acks, retries)
            stamp = datetime.now(UTC).isoformat()
            self._outbox.add(
                [self._event(EventType.CANCELLED, r.claim, error="cancelled", now=stamp) for r in cancelled]
            )
            for running in cancelled:
                metrics.EXECUTIONS.labels(ExecutionStatus.CANCELLED.value, running.claim.handler).inc()
        except Exception as exc:
            if not stores.is_fault(exc):
                raise
            # Not lost: the leases expire, the leader recovers the items, a claim restarts the runs.
            metrics.store_error(exc)
            log.warning("could not hand back reserved runs: %r", exc, extra={"worker_id": self.id})
        finally:
            for running in runs:
                self._running.pop(running.lease.id, None)

    async def _release_held(self) -> None:
        """Stopping: hand back every held run that has not started (their tasks stopped first)."""
        held = [r for r in self._running.values() if r.held and r.task is not None]
        for running in held:
            assert running.task is not None
            running.task.cancel()
        if not held:
            return
        await asyncio.wait([r.task for r in held if r.task is not None])
        stopped = [r for r in held if r.task is not None and r.task.cancelled()]
        await self._unreserve(stopped)
        log.info("handed back reserved runs", extra={"worker_id": self.id, "runs": len(stopped)})

    def _observe_starts(self, claims: Sequence[Claim], starts: Sequence[datetime] = ()) -> None:
        """Lateness and queue wait of attempts that started (at `starts`, default their claims')."""
        metrics.WORKER_SLOTS.labels("busy").set(self._busy)
        lateness: list[float] = []
        waits: list[float] = []
        for claim, started in zip(claims, starts or [c.started_at for c in claims], strict=True):
            # Scheduling lateness is a slot's or a trigger's: a backfill or a dead-letter requeue runs
            # a slot of the past on purpose, and its age would swamp the histogram.
            if claim.attempt == 1 and claim.trigger in _LATENESS_TRIGGERS:
                lateness.append(max((started - claim.scheduled_for).total_seconds(), 0.0))
            if claim.due_at is not None:
                waits.append(max((started - claim.due_at).total_seconds(), 0.0))
        metrics.observe_many(metrics.LATENESS, lateness)
        metrics.observe_many(metrics.QUEUE_WAIT, waits)

    def _started_held(self, running: _Running) -> None:
        """A held run started: its STARTED event and metrics, gathered for all the held runs that
        start in this turn of the event loop (a crowd of them is due at one instant) and given out
        once, after them, off their start path."""
        if not self._held_started:
            asyncio.get_running_loop().call_soon(self._observe_held_starts)
        self._held_started.append(running)

    def _observe_held_starts(self) -> None:
        started, self._held_started = self._held_started, []
        claims = [r.claim for r in started]
        starts = [r.started_at or r.claim.started_at for r in started]
        self._outbox.add([
            self._event(EventType.STARTED, claim, now=start.isoformat())
            for claim, start in zip(claims, starts, strict=True)
        ])  # fmt: skip
        self._observe_starts(claims, starts)

    # -- running -----------------------------------------------------------------------------------

    async def _execute(self, running: _Running) -> None:
        claim, lease = running.claim, running.lease
        assert running.deadline is not None  # set from the claim, or when a held run starts
        try:
            try:
                handler = self._registry.get(claim.handler)
                breaker = self.breakers.get(handler.breaker_key(claim.payload))
                breaker.admit()
            except BreakerOpen as exc:
                # Rare since the item carries its breaker key (checked before the claim): the breaker
                # opened between that check and now. Not a failure and no retry spent: recorded
                # `interrupted`, the next attempt due (and the item back in the queue) after the wait.
                await self._defer(running, exc)
                return
            except SchedulerError as exc:  # unknown handler (plugin removed): a permanent failure
                outcome = Outcome(
                    claim.execution_id,
                    lease.token,
                    ExecutionStatus.DEAD,
                    error=str(exc),
                    dead_reason=DeadReason.PERMANENT,
                )
            else:
                try:
                    outcome = await self._attempt(running, handler)
                except asyncio.CancelledError:
                    if lease.id not in self._cancel_requested:
                        raise  # shutdown or a lost lease: not ours to record
                    # We cancelled this task ourselves for a cancel request: absorb exactly that one.
                    self._cancel_requested.discard(lease.id)
                    task = asyncio.current_task()
                    if task is not None and task.uncancel() > 0:
                        raise
                    outcome = Outcome(claim.execution_id, lease.token, ExecutionStatus.CANCELLED, error="cancelled")
                else:
                    breaker.record(_failed(outcome))  # a cancelled attempt counts neither way
            running.outcome = outcome
            await self._finish(running)
        finally:
            running.deadline.finished()
            self._free_slot()

    async def _finish(self, running: _Running) -> None:
        """Hand a run with its outcome to the completion stage; one from the queue waits while the
        buffer is full (its slot stays busy, so fetching stops), a held one never does."""
        if running.started_at is None:
            while self._finished.qsize() >= self._finished_max:
                self._finished_room.clear()
                await self._finished_room.wait()
        self._finished.put_nowait(running)

    async def _defer(self, running: _Running, exc: BreakerOpen) -> None:
        claim, lease = running.claim, running.lease
        self.stats.breaker_deferred += 1
        try:
            await self._executions.release([(claim.execution_id, lease.token)], reason=str(exc), delay=exc.retry_after)
            await self.queue.nack(lease.id, lease.token, exc.retry_after, count_delivery=False)
            self._outbox.add([self._event(EventType.INTERRUPTED, claim, error=str(exc))])
        except Exception as error:
            if not stores.is_fault(error):
                raise
            metrics.store_error(error)  # the lease expires; the leader recovers the item
            log.warning("could not defer a run: %r", error, extra={"worker_id": self.id})
        finally:
            self._running.pop(lease.id, None)

    async def _attempt(self, running: _Running, handler: Any) -> Outcome:
        claim, lease, deadline = running.claim, running.lease, running.deadline
        assert deadline is not None
        if deadline.expired:  # its batch's timeout passed before this handler could start
            return self._failure(claim, lease, ExecutionStatus.TIMED_OUT, _timed_out(claim))
        ctx = ExecutionContext(
            execution_id=claim.execution_id,
            job_id=claim.job_id,
            job_name=claim.job_name,
            attempt=claim.attempt,
            scheduled_for=claim.scheduled_for,
            timeout=claim.timeout,
            upstream_results=claim.upstream_results,
            settings=self._handler_settings,
            maintenance=self._maintenance,
            log=logging.LoggerAdapter(
                log,
                {
                    "execution_id": claim.execution_id,
                    "job_id": claim.job_id,
                    "attempt": claim.attempt,
                    "worker_id": self.id,
                },
            ),
        )
        status, error, result = ExecutionStatus.SUCCEEDED, None, None
        deadline.running[lease.id] = running
        began = time.perf_counter()
        try:
            result = outputs.bound_result(await handler.run(ctx, claim.payload))
        except asyncio.CancelledError:
            # The deadline's cancellation is this attempt's timeout: absorb exactly that one; any
            # other cancellation (a cancel request, a stop, a lost lease) goes on.
            if not deadline.release(running):
                raise
            status, error = ExecutionStatus.TIMED_OUT, _timed_out(claim)
        except PermanentHandlerError as exc:
            return Outcome(
                claim.execution_id, lease.token, ExecutionStatus.DEAD, error=str(exc), dead_reason=DeadReason.PERMANENT
            )
        except (HandlerError, outputs.Unstorable) as exc:  # (a result over a bound: this attempt's failure)
            status, error = ExecutionStatus.FAILED, str(exc)
        except Exception as exc:  # a handler bug is this attempt's failure, not the worker's
            log.exception("handler raised", extra={"execution_id": claim.execution_id, "handler": claim.handler})
            status, error = ExecutionStatus.FAILED, f"{type(exc).__name__}: {exc}"
        finally:
            deadline.release(running)  # (a no-op when released above)
            running.seconds = time.perf_counter() - began
        if status is ExecutionStatus.SUCCEEDED:
            return Outcome(claim.execution_id, lease.token, status, result=result)
        assert error is not None
        return self._failure(claim, lease, status, error)

    @staticmethod
    def _failure(claim: Claim, lease: Lease, status: ExecutionStatus, error: str) -> Outcome:
        """The outcome of a failed attempt: retried while its budget allows, else dead."""
        # Interrupted attempts (a worker's graceful stop) spend no retry budget.
        if claim.retry.allows_retry_after(claim.budget_attempt):
            backoff = claim.retry.backoff(claim.budget_attempt)
            return Outcome(claim.execution_id, lease.token, status, error=error, retry_after=backoff)
        spent = f"{error} (retry budget of {claim.retry.max_retries} spent)"
        return Outcome(
            claim.execution_id, lease.token, ExecutionStatus.DEAD, error=spent, dead_reason=DeadReason.RETRIES_EXHAUSTED
        )

    # -- finishing ---------------------------------------------------------------------------------

    async def _complete_loop(self) -> None:
        while True:
            await self._outbox.room()  # events not published yet bound how far recording runs ahead
            batch = [await self._finished.get()]
            while len(batch) < COMPLETION_BATCH and not self._finished.empty():
                batch.append(self._finished.get_nowait())
            self._finished_room.set()
            try:
                await self._complete(batch)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if not stores.is_fault(exc):
                    raise
                # Retried for COMPLETION_RETRY_FOR: let the leases go; the leader recovers the runs.
                log.warning("could not record outcomes, giving up: %r", exc,
                            extra={"worker_id": self.id, "count": len(batch)})  # fmt: skip
            finally:
                for finished in batch:
                    self._running.pop(finished.lease.id, None)
                    self._finished.task_done()
                self._slot_free.set()  # a solo run recorded frees every slot
                metrics.WORKER_SLOTS.labels("busy").set(self._busy)

    async def _retrying(self, what: str, call: Callable[[], Awaitable[T]], until: float) -> T:
        """`call()` until it succeeds, backing off on store errors until the monotonic `until`.

        The batch stays in `_running` meanwhile, so its leases keep being extended.
        """
        trouble = _StoreTrouble(what, self.id)
        while True:
            try:
                result = await call()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if not stores.is_fault(exc) or time.monotonic() >= min(until, self._retry_until_stopped):
                    raise
                await asyncio.sleep(trouble.failed(exc))
            else:
                trouble.recovered()
                return result

    async def _complete(self, batch: list[_Running]) -> None:
        until = time.monotonic() + COMPLETION_RETRY_FOR.total_seconds()
        # A reserved run's real start goes with its outcome (set here, off its start path).
        outcomes = [
            f.outcome if f.started_at is None else _with_start(f.outcome, f.started_at)
            for f in batch
            if f.outcome is not None
        ]
        tries = 0

        async def record() -> list[Completed]:
            nonlocal tries
            tries += 1  # a try after a failed one may follow a lost reply: then look for its record
            return await self._executions.complete(outcomes, resent=tries > 1)

        recorded = await self._retrying("recording outcomes", record, until)
        completed = {c.execution_id: c for c in recorded}
        acks: list[Lease] = []
        retries: list[tuple[Lease, timedelta]] = []
        deaths: list[tuple[Lease, str]] = []
        event_list: list[bytes] = []
        counts: dict[tuple[str, str], int] = {}
        durations: dict[str, list[float]] = {}
        now = datetime.now(UTC).isoformat()
        debug = log.isEnabledFor(logging.DEBUG)
        for finished in batch:
            outcome, lease, claim = finished.outcome, finished.lease, finished.claim
            assert outcome is not None  # only runs with an outcome are put in `_finished`
            durations.setdefault(claim.handler, []).append(finished.seconds)
            done: Completed | None = completed.get(outcome.execution_id)
            if done is None:
                self.stats.lost_leases += 1  # another attempt replaced this one: change nothing
                continue
            status = outcome.status
            if debug:
                log.debug(
                    "attempt finished",
                    extra={"execution_id": claim.execution_id, "job_id": claim.job_id, "attempt": claim.attempt,
                           "worker_id": self.id, "status": status.value},
                )  # fmt: skip
            key = (status.value, claim.handler)
            counts[key] = counts.get(key, 0) + 1
            event_list.append(self._event(_EVENT_OF[status], claim, error=outcome.error or "", now=now))
            if outcome.retry_after is not None:
                # The delivery is given back: only stalls count towards the stall limit.
                retries.append((lease, outcome.retry_after))
                metrics.RETRIES.labels(claim.handler).inc()
                if done.retry_execution_id is not None:
                    event_list.append(
                        self._event(EventType.RETRYING, claim, execution_id=done.retry_execution_id,
                                    attempt=claim.attempt + 1, now=now)
                    )  # fmt: skip
            elif status is ExecutionStatus.DEAD:
                deaths.append((lease, outcome.error or "dead"))
                metrics.DEAD_LETTERED.labels(outcome.dead_reason or DeadReason.PERMANENT).inc()
            else:
                acks.append(lease)
        self.stats.completed += sum(counts.values())
        for (status_value, handler), count in counts.items():
            self.stats.by_status[status_value] = self.stats.by_status.get(status_value, 0) + count
            metrics.EXECUTIONS.labels(status_value, handler).inc(count)
        for handler, seconds in durations.items():
            duration = self._duration_by_handler.get(handler)
            if duration is None:  # a child per handler, looked up once (`labels()` takes a lock)
                duration = self._duration_by_handler[handler] = metrics.EXECUTION_DURATION.labels(handler)
            metrics.observe_many(duration, seconds)
        # One script call for the whole batch; safe to repeat: a lease already acted on answers
        # "lost" and changes nothing.
        await self._retrying("finishing queue items", lambda: self.queue.finish_many(acks, retries, deaths), until)
        self._outbox.add(event_list)

    async def _publish_loop(self) -> None:
        """Publish the outbox's events, oldest first, in batches; a batch that cannot be published
        within COMPLETION_RETRY_FOR (or by the end of a stop) is dropped, logged: the changes it
        describes are recorded in PostgreSQL."""
        while True:
            batch = await self._outbox.take(PUBLISH_BATCH)
            until = time.monotonic() + COMPLETION_RETRY_FOR.total_seconds()
            try:
                await self._retrying(
                    "publishing events", functools.partial(events.publish_encoded, self._redis, batch, ids=False), until
                )
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if not stores.is_fault(exc):
                    raise
                log.warning("could not publish events, dropping them: %r", exc,
                            extra={"worker_id": self.id, "count": len(batch)})  # fmt: skip
            finally:
                self._outbox.done()

    def _event(
        self,
        kind: EventType,
        claim: Claim,
        *,
        execution_id: str = "",
        attempt: int = 0,
        error: str = "",
        now: str = "",
    ) -> bytes:
        """An event of `claim`'s attempt, encoded; `now` is its time (ISO 8601), formatted once per batch."""
        return events.encode_fields(
            kind, execution_id or claim.execution_id, claim.run_id, claim.job_id, attempt or claim.attempt,
            handler=claim.handler, worker_id=self.id, error=error, time=now or datetime.now(UTC).isoformat(),
        )  # fmt: skip

    # -- leases, heartbeats, breakers --------------------------------------------------------------

    async def _extend_loop(self) -> None:
        interval = self._visibility.total_seconds() / 3
        trouble = _StoreTrouble("extending leases", self.id)
        pause = interval
        while True:
            await asyncio.sleep(pause)
            pause = interval
            running = [r for r in self._running.values() if r.lease.id not in self._giving_up]
            if not running:
                continue
            try:
                deadlines = await self.queue.extend_many([r.lease for r in running], self._visibility)
                lost = [r for r, deadline in zip(running, deadlines, strict=True) if deadline is None]
                if lost:
                    # In a task of its own: a handler slow to stop (a process's kill grace, a
                    # plugin's clean-up) must not hold up the extension of every other lease.
                    self._giving_up.update(r.lease.id for r in lost)
                    assert self._group is not None
                    self._group.create_task(self._give_up(lost), name="give-up")
                trouble.recovered()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # READONLY, BUSY, OOM, unreachable: try again soon, never die of it
                if not stores.is_fault(exc):
                    raise
                pause = min(trouble.failed(exc), interval)

    async def _give_up(self, lost: list[_Running]) -> None:
        """Our leases are gone (recovered elsewhere, or Redis lost them): stop, and let the run go on
        in a new attempt; our outcome would be refused anyway.

        A store fault leaves the runs in `_running`: the next extension finds them lost again and
        gives them up then.
        """
        try:
            for running in lost:
                if running.task is not None:
                    running.task.cancel()
            await asyncio.wait([r.task for r in lost if r.task is not None])
            cancelled = [r for r in lost if r.task is not None and r.task.cancelled()]
            await self._executions.abandon([(r.claim.execution_id, r.lease.token) for r in cancelled])
            for running in cancelled:
                self._running.pop(running.lease.id, None)
            self.stats.lost_leases += len(cancelled)
            self._slot_free.set()
            log.warning("leases lost; attempts abandoned", extra={"worker_id": self.id, "runs": len(cancelled)})
        except Exception as exc:
            if not stores.is_fault(exc):
                raise
            log.warning("could not abandon lost attempts: %r", exc, extra={"worker_id": self.id})
        finally:
            self._giving_up.difference_update(r.lease.id for r in lost)

    async def _cancel_listener(self) -> None:
        """Cancel runs on request (CancelExecution, the `replace` concurrency policy): the fast path.

        A message missed (sent before the task registered, or while reconnecting) is still honoured
        by `_cancel_poll_loop`, which reads the persisted request.
        """
        trouble = _StoreTrouble("cancel channel", self.id)
        while True:
            pubsub = self._redis.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(_WORKER_KEYS.cancel)
                trouble.recovered()
                while True:
                    message = await pubsub.get_message(timeout=5.0)
                    if message is not None:
                        self._cancel_on_request(message["data"])
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis restarting: subscribe again
                if not stores.is_fault(exc):
                    raise
                await asyncio.sleep(trouble.failed(exc))
            finally:
                with contextlib.suppress(Exception):
                    await pubsub.aclose()  # type: ignore[no-untyped-call]

    async def _cancel_poll_loop(self) -> None:
        """Every CANCEL_POLL_INTERVAL, one query: which of our running attempts have a cancel request."""
        trouble = _StoreTrouble("polling cancel requests", self.id)
        pause = CANCEL_POLL_INTERVAL.total_seconds()
        while True:
            await asyncio.sleep(pause)
            pause = CANCEL_POLL_INTERVAL.total_seconds()
            by_execution = {
                r.claim.execution_id: run_id
                for run_id, r in self._running.items()
                if r.task is not None and not r.task.done() and run_id not in self._cancel_requested
            }
            if not by_execution:
                continue
            try:
                requested = await self._executions.cancel_requested(list(by_execution))
                trouble.recovered()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if not stores.is_fault(exc):
                    raise
                pause = max(pause, trouble.failed(exc))
                continue
            for execution_id in requested:
                self._cancel_on_request(by_execution[execution_id])

    def _cancel_on_request(self, data: bytes | str) -> None:
        run_id = data.decode() if isinstance(data, bytes) else str(data)
        running = self._running.get(run_id)
        if running is not None and running.task is not None and not running.task.done():
            log.info("cancelling on request", extra={"run_id": run_id, "worker_id": self.id})
            self._cancel_requested.add(run_id)
            running.task.cancel()

    async def _heartbeat_loop(self) -> None:
        trouble = _StoreTrouble("heartbeat", self.id)
        while True:
            try:
                await self._beat()
                trouble.recovered()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if not stores.is_fault(exc):
                    raise
                trouble.failed(exc)
            await asyncio.sleep(HEARTBEAT_INTERVAL.total_seconds())

    async def _beat(self) -> None:
        await workers.beat(self._redis, workers.WorkerInfo(
            id=self.id, host=socket.gethostname(), pid=os.getpid(), slots=self.concurrency, active=self.active,
            queue=self.queue.name, handlers=self._registry.names(), started_at=self._started_at,
            breakers={key: state.value for key, state in self.breakers.states().items()},
        ), call_timeout=HEARTBEAT_INTERVAL)  # fmt: skip

    async def _unregister(self) -> None:
        with contextlib.suppress(Exception):
            await workers.unregister(self._redis, self.id)

    def _breaker_changed(self, key: str, old: BreakerState, new: BreakerState) -> None:
        # Metrics by handler: a webhook host is not a bounded label. The handler shows its worst breaker.
        handler = handler_of_breaker_key(key)
        states = [new] + [
            state for other, state in self.breakers.states().items()
            if other != key and handler_of_breaker_key(other) == handler
        ]  # fmt: skip
        worst = max(states, key=_BREAKER_SEVERITY.__getitem__)
        metrics.BREAKER_STATE.labels(handler).set(metrics.BREAKER_VALUES[worst.value])
        metrics.BREAKER_TRANSITIONS.labels(handler, new.value).inc()
        level = logging.WARNING if new is BreakerState.OPEN else logging.INFO
        log.log(level, "circuit breaker %s: %s -> %s", key, old, new, extra={"breaker": key, "worker_id": self.id})


def _with_start(outcome: Outcome, started_at: datetime) -> Outcome:
    # Built directly: `dataclasses.replace` costs several times more.
    return Outcome(outcome.execution_id, outcome.claim_token, outcome.status, outcome.error, outcome.result,
                   outcome.retry_after, started_at, outcome.dead_reason)  # fmt: skip


async def _sleep_until(when: float) -> None:
    """Sleep until the monotonic `when`, never less: a loop's timer may fire a little early (uvloop
    counts from its cached clock), so it sleeps again for what is left."""
    left = when - time.monotonic()
    while left > 0:
        await asyncio.sleep(max(left, 0.001))
        left = when - time.monotonic()


def _timed_out(claim: Claim) -> str:
    return f"timed out after {claim.timeout.total_seconds():g}s"


def _failed(outcome: Outcome) -> bool:
    return outcome.status in (ExecutionStatus.FAILED, ExecutionStatus.TIMED_OUT, ExecutionStatus.DEAD)


async def run_worker(settings: Settings, args: argparse.Namespace, stop: asyncio.Event) -> int:
    """`scheduler-grpc worker`: execute jobs until SIGTERM/SIGINT."""
    port = settings.metrics_port if settings.metrics_port is not None else DEFAULT_METRICS_PORT
    # No session reset on release (a round trip per statement of the hot path): the worker's
    # statements leave no session state behind (SET LOCAL only, no LISTEN, no advisory locks).
    async with connect(settings, session_reset=False) as conns, metrics.serve(settings.metrics_host, port):
        registry = default_registry(HandlerSettings.from_settings(settings))
        try:
            executions = ExecutionRepository(conns.pool)
            worker = Worker(conns.redis, executions, registry, settings, concurrency=args.concurrency)
            # What start-up made (modules, the registry, pools) lives as long as the process: out of
            # the collector's sight, so a full collection does not walk it again and again.
            gc.freeze()
            gc.set_threshold(*GC_THRESHOLD)
            metrics.WORKER_SLOTS.labels("total").set(worker.concurrency)
            metrics.WORKER_SLOTS.labels("busy").set(0)
            await worker.run(stop)
        except Exception:
            # Store errors never get here (every loop rides them out): this is a bug.
            log.exception("worker failed")
            raise
        finally:
            await registry.aclose()
    return 0
