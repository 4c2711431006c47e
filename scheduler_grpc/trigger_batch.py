"""Group commit of manual triggers: concurrent TriggerJob calls share one statement, one enqueue
script call and one event publish.

A trigger is one row, one enqueue and one event; done one call at a time, each pays a PostgreSQL
round trip and commit, a Redis round trip and the pool's bookkeeping. Here a caller adds its
request to a queue and waits on its own future. While fewer than `max_in_flight` batches are
running, a batch starts at once with whatever is queued (the first caller of a quiet server waits
for nobody); calls that arrive while batches are in flight form the next batch.

Under load the next batch also waits up to `gather` for company: only after a batch of at least
`GATHER_AFTER` requests, the evidence of concurrent callers (as PostgreSQL's `commit_delay` waits
only with `commit_siblings` transactions open). A batch's cost is mostly its round trips, so on a
busy server bigger batches are more calls per second (measured: TriggerJob from 50 callers, batches
of ~7 -> ~14 and ~25 % more calls a second, at +3 ms before a batch starts); a lone caller, or a
few, never waits.

Each caller gets its own answer: a new run, the run of an earlier call with the same `request_id`,
or its own error (an unknown job is NOT_FOUND for that caller only). A statement error that may come
from one request's data (not a store outage) makes the batch run again one request at a time, so
only that request fails.

Manual runs are keyed by their trigger time (`scheduled_for`, unique per job and attempt with the
scheduled slots). Slots come from a per-process clock that never hands out the same microsecond
twice, so concurrent triggers of one job never collide here; one that collides anyway (another
server process, a scheduled slot at that very microsecond) is retried with a fresh slot.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import uuid
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, Final

from scheduler_grpc import stores, tracing
from scheduler_grpc.db.executions import Queued, TriggerOutcome, TriggerRequest, TriggerResult
from scheduler_grpc.errors import Aborted, InvalidArgument
from scheduler_grpc.ports import TriggerStore

log = logging.getLogger(__name__)

MAX_BATCH: Final = 500  # requests per statement (bounds its parameters and the enqueue script's)
# Batches running at once (each holds one pool connection). One: while it runs, the next batch
# gathers every call that arrives, so under load batches are bigger and fewer (measured: ~25 % more
# TriggerJob/s than with two), and an idle server still answers a lone call at once.
MAX_IN_FLIGHT: Final = 1
# BatchTriggerJobs statements running at once: each holds a pool connection for a statement of up to
# 1,000 rows, so ten concurrent calls would otherwise take a whole default pool (10) from everything else.
MAX_BULK_IN_FLIGHT: Final = 3
MAX_COLLISIONS: Final = 5  # fresh slots tried for one request before giving up (ABORTED)
GATHER: Final = timedelta(milliseconds=3)  # longest a batch waits for company (see the module docstring)
GATHER_AFTER: Final = 4  # a batch waits only after one of at least this many requests
BATCH_TIMEOUT: Final = timedelta(seconds=30)  # one batch's statement (the dispatch after it has its own bound)

Dispatch = Callable[[Sequence[Queued]], Awaitable[object]]


@dataclass(frozen=True)
class BulkRequest:
    """One run asked for by a BatchTriggerJobs call: a job (a UUID), its request id and payload."""

    job_id: str
    request_id: str | None = None
    payload: dict[str, Any] | None = None  # validated against the job's handler


@dataclass(eq=False)
class _Waiter:
    job_id: str
    request_id: str | None
    future: asyncio.Future[TriggerResult]
    collisions: int = 0
    trace_context: str | None = None  # the `traceparent` of its `run.trigger` span (tracing on)


@dataclass
class _Group:
    """The callers of one request (the same job and request_id in one batch share it)."""

    request: TriggerRequest
    waiters: list[_Waiter] = field(default_factory=list)


class TriggerBatcher:
    """Runs manual triggers in batches (see the module docstring).

    Args:
        executions: Where runs are created (`ports.TriggerStore`: `FiringRepository.trigger_now`).
        dispatch: Announces and enqueues a batch's new runs (one publish, one script call per queue);
            bounded, and it should not raise: the runs are committed (`dispatch.dispatch_committed`).
        max_batch: Most requests per batch.
        max_in_flight: Most batches running at once.
        max_bulk_in_flight: Most `trigger_all` statements running at once (the others wait their turn).
        gather: Longest a batch waits for more requests, after a batch of `GATHER_AFTER` or more.
    """

    def __init__(
        self,
        executions: TriggerStore,
        dispatch: Dispatch,
        *,
        max_batch: int = MAX_BATCH,
        max_in_flight: int = MAX_IN_FLIGHT,
        max_bulk_in_flight: int = MAX_BULK_IN_FLIGHT,
        gather: timedelta = GATHER,
    ) -> None:
        self._executions = executions
        self._dispatch = dispatch
        self._max_batch = max_batch
        self._max_in_flight = max_in_flight
        # Bounded by the callers waiting on it: each waits for its answer (and the gRPC server caps
        # concurrent calls, SCHEDULER_MAX_CONCURRENT_RPCS).
        self._pending: deque[_Waiter] = deque()
        self._in_flight = 0
        self._bulk = asyncio.Semaphore(max_bulk_in_flight)
        self._tasks: set[asyncio.Task[None]] = set()
        self._last_slot = datetime.min.replace(tzinfo=UTC)
        self._gather = gather.total_seconds()
        self._last_size = 0  # requests in the batch started last
        self._gathering: asyncio.TimerHandle | None = None  # starts the next batch when its wait ends
        self._gathered = False  # that wait is over: the next batch starts without another

    async def trigger(self, job_id: str, request_id: str | None = None) -> TriggerResult:
        """Create a manual run of `job_id` now (or find the one `request_id` created before).

        Returns:
            CREATED (with the run, enqueued; or left to the leader's reconcile if Redis failed the
            enqueue), REPEATED, NO_JOB or MISSED.

        Raises:
            InvalidArgument: `job_id` is not a UUID (naming `id`).
            Aborted: the request collided with other runs' slots `MAX_COLLISIONS` times.
            Exception: what the statement raised for this caller's batch (a failed enqueue after
                the commit is not raised: the run exists, and the leader's reconcile enqueues it).
        """
        try:
            job_id = str(uuid.UUID(job_id))
        except (ValueError, AttributeError, TypeError):
            raise InvalidArgument("id", f"{job_id!r} is not a valid id") from None
        waiter = _Waiter(job_id, request_id, asyncio.get_running_loop().create_future())
        if tracing.enabled:
            return await self._traced(waiter)
        self._pending.append(waiter)
        self._pump()
        return await waiter.future

    async def _traced(self, waiter: _Waiter) -> TriggerResult:
        """`trigger` under a `run.trigger` span (a child of the caller's, e.g. the TriggerJob call's):
        the run is recorded with its `traceparent`, so the run's attempts join the caller's trace."""
        span = tracing.start("run.trigger", attributes={"scheduler.job_id": waiter.job_id})
        waiter.trace_context = tracing.traceparent(span)
        try:
            self._pending.append(waiter)
            self._pump()
            result = await waiter.future
        except BaseException as exc:
            tracing.span_error(span, repr(exc))
            raise
        else:
            span.set_attribute("scheduler.trigger_outcome", result.outcome.value)
            if result.execution is not None:
                span.set_attribute("scheduler.run_id", result.execution.run_id)
            return result
        finally:
            span.end()

    async def trigger_all(self, requests: Sequence[BulkRequest]) -> list[TriggerResult]:
        """Manual runs for the requests of ONE call (BatchTriggerJobs), in one statement of their own:
        such a call is a batch already, so it does not queue behind the TriggerJob calls' batches.
        Requests must be valid (`job_id` a UUID, payloads checked) and distinct per (job, request_id).
        At most `max_bulk_in_flight` calls run their statements at once; the others wait their turn.

        Requests whose slot collided are tried again with fresh slots, `MAX_COLLISIONS` times in all;
        one still colliding after that comes back COLLIDED. A statement error that may come from a
        request's data (a job deleted between the statement's read and its insert) makes it run once
        more; a second one is raised, and nothing of it was committed.

        Returns:
            One result per request, in their order: CREATED (enqueued, or left to the leader's
            reconcile if Redis failed the enqueue), REPEATED, NO_JOB, MISSED or COLLIDED.
        """
        if not tracing.enabled:
            return await self._trigger_all(requests, None)
        span = tracing.start("run.trigger", attributes={"scheduler.trigger_count": len(requests)})
        try:
            return await self._trigger_all(requests, tracing.traceparent(span))
        except BaseException as exc:
            tracing.span_error(span, repr(exc))
            raise
        finally:
            span.end()

    async def _trigger_all(self, requests: Sequence[BulkRequest], trace_context: str | None) -> list[TriggerResult]:
        results: list[TriggerResult | None] = [None] * len(requests)
        todo = list(range(len(requests)))
        for attempt in range(MAX_COLLISIONS):
            asked = [requests[i] for i in todo]
            slots = self._slots(len(asked))
            batch = [
                TriggerRequest(r.job_id, slot, r.request_id, trace_context, r.payload)
                for r, slot in zip(asked, slots, strict=True)
            ]
            async with self._bulk, asyncio.timeout(BATCH_TIMEOUT.total_seconds()):
                try:
                    answers = await self._executions.trigger_now(batch)
                except Exception as exc:
                    if attempt > 0 or not stores.is_request_error(exc):
                        raise
                    answers = await self._executions.trigger_now(batch)
            created = [answer.run for answer in answers if answer.run is not None]
            if created:
                try:
                    await self._dispatch(created)
                except Exception:  # committed: the leader's reconcile enqueues them (see `_execute`)
                    log.exception("dispatching triggered runs failed after their commit", extra={"runs": len(created)})
            for i, answer in zip(todo, answers, strict=True):
                results[i] = answer
            todo = [i for i, answer in zip(todo, answers, strict=True) if answer.outcome is TriggerOutcome.COLLIDED]
            if not todo:
                break
        return [result for result in results if result is not None]

    def _slot(self) -> datetime:
        """Now, but never the same microsecond twice in this process."""
        now = datetime.now(UTC)
        if now <= self._last_slot:
            now = self._last_slot + timedelta(microseconds=1)
        self._last_slot = now
        return now

    def _slots(self, count: int) -> list[datetime]:
        """`count` slots as `_slot` hands them out, reading the clock once."""
        first = self._slot()
        self._last_slot = first + timedelta(microseconds=count - 1)
        return [first + timedelta(microseconds=n) for n in range(count)]

    def _waits(self) -> bool:
        """Whether the next batch waits for more requests now (see the module docstring); the first
        time, a timer is set that starts it."""
        if self._gathered or self._last_size < GATHER_AFTER or len(self._pending) >= self._max_batch:
            return False
        if self._gathering is None:
            self._gathering = asyncio.get_running_loop().call_later(self._gather, self._gather_ended)
        return True

    def _gather_ended(self) -> None:
        self._gathering = None
        self._gathered = True
        self._pump()

    def _pump(self) -> None:
        while self._pending and self._in_flight < self._max_in_flight:
            if self._waits():
                return
            if self._gathering is not None:  # a full batch before its wait ended
                self._gathering.cancel()
                self._gathering = None
            self._gathered = False
            groups: dict[tuple[str, str | None], _Group] = {}
            while self._pending and len(groups) < self._max_batch:
                waiter = self._pending.popleft()
                if waiter.future.done():  # its caller went away (cancelled)
                    continue
                # Calls without a request_id each get a run; calls with the same one share it.
                key = (waiter.job_id, waiter.request_id) if waiter.request_id else (waiter.job_id, str(id(waiter)))
                group = groups.get(key)
                if group is None:
                    group = groups[key] = _Group(
                        TriggerRequest(waiter.job_id, self._slot(), waiter.request_id, waiter.trace_context)
                    )
                group.waiters.append(waiter)
            if not groups:
                return
            self._last_size = len(groups)
            self._in_flight += 1
            # A context of its own: the batch serves many calls, not the one whose call started it.
            task = asyncio.get_running_loop().create_task(
                self._run(list(groups.values())), name="trigger-batch", context=contextvars.Context()
            )
            self._tasks.add(task)
            task.add_done_callback(self._finished)

    def _finished(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        self._in_flight -= 1
        if not task.cancelled() and task.exception() is not None:  # a bug: _run answers every error
            log.error("trigger batch failed", exc_info=task.exception())
        self._pump()

    async def _run(self, groups: list[_Group]) -> None:
        try:
            await self._execute(groups)
        except asyncio.CancelledError:
            _fail(groups, Aborted("the server is stopping; retry"))
            raise
        except Exception as exc:
            if len(groups) > 1 and stores.is_request_error(exc):
                # Perhaps one request's data, not the store: again one by one, so only it fails.
                for group in groups:
                    await self._run([group])
                return
            _fail(groups, exc)

    async def _execute(self, groups: list[_Group]) -> None:
        async with asyncio.timeout(BATCH_TIMEOUT.total_seconds()):
            results = await self._executions.trigger_now([group.request for group in groups])
        created = [result.run for result in results if result.run is not None]
        if created:
            try:
                await self._dispatch(created)
            except Exception:
                # Committed: each caller gets its run all the same (failing it would invite a retry
                # that runs the job twice); the leader's reconcile enqueues the runs.
                log.exception("dispatching triggered runs failed after their commit", extra={"runs": len(created)})
        for group, result in zip(groups, results, strict=True):
            if result.outcome is TriggerOutcome.COLLIDED:
                self._retry(group)
            else:
                for waiter in group.waiters:
                    if not waiter.future.done():
                        waiter.future.set_result(result)

    def _retry(self, group: _Group) -> None:
        for waiter in group.waiters:
            waiter.collisions += 1
            if waiter.collisions >= MAX_COLLISIONS:
                _fail([_Group(group.request, [waiter])], Aborted("the trigger kept colliding with other runs; retry"))
            else:
                self._pending.appendleft(waiter)  # the next batch (started when this one finishes)


def _fail(groups: list[_Group], exc: BaseException) -> None:
    for group in groups:
        for waiter in group.waiters:
            if not waiter.future.done():
                waiter.future.set_exception(exc)
